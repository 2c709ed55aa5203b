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
tools/setup
[ -e /dev/fuse ] && echo "provision: /dev/fuse present" || echo "provision: warning: no /dev/fuse" >&2
echo "provision: done; run the suite with: vagrant ssh -c 'cd /vagrant && sudo tools/test'"
