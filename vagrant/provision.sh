#!/usr/bin/env bash
# Provision the overlayrec test VM (run by `vagrant up` as root, with the project in /vagrant).
# It installs exactly what the README's set-up installs, by running that set-up, tools/setup:
# the apt packages of tools/packages.apt, then .venv with overlayrec and its test extras.
# Nothing else is installed here: a package the project needs goes into tools/packages.apt.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
cd /vagrant
echo "provision: $(. /etc/os-release && echo "$PRETTY_NAME"), kernel $(uname -r)"
modprobe fuse 2>/dev/null || true          # /dev/fuse, for the mounts
# Trust what the host trusts: its local CAs (copied to /tmp/overlayrec-ca by the Vagrantfile), e.g.
# a TLS-inspecting proxy's; and make pip use the system store rather than its own bundle.
if compgen -G '/tmp/overlayrec-ca/*.crt' >/dev/null; then
  echo "provision: trusting the host's local CAs: $(cd /tmp/overlayrec-ca && echo *.crt)"
  install -m 644 /tmp/overlayrec-ca/*.crt /usr/local/share/ca-certificates/
  update-ca-certificates >/dev/null
fi
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > /etc/pip.conf
tools/setup --deps-only                    # the apt packages, as root
# .venv belongs to the user who runs the suite: tools/test runs as vagrant (its root tests by sudo)
if id -u vagrant >/dev/null 2>&1; then
  runuser -u vagrant -- env HOME=/home/vagrant tools/setup
else
  tools/setup
fi
[ -e /dev/fuse ] && echo "provision: /dev/fuse present" || echo "provision: warning: no /dev/fuse" >&2
echo "provision: done; run the suite with: vagrant ssh -c 'cd /vagrant && tools/test'"
