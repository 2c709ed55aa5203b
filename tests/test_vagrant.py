"""The test VM's Vagrantfile is valid (`vagrant validate`), where the `vagrant` binary is present.

CI (`.ci/run`) installs vagrant and sets OVERLAYREC_REQUIRE_VAGRANT, which turns the skip into a
failure: there, the check must run.

The VM itself (tools/vm-test) is far too slow for every CI run; this only checks that
vagrant/Vagrantfile parses and its settings are accepted, for each driver setting.
"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

VAGRANT_DIR = Path(__file__).resolve().parent.parent / "vagrant"
vagrant = shutil.which("vagrant")

if vagrant is None and os.environ.get("OVERLAYREC_REQUIRE_VAGRANT"):
    raise RuntimeError("OVERLAYREC_REQUIRE_VAGRANT is set but vagrant is not installed")
pytestmark = pytest.mark.skipif(vagrant is None, reason="vagrant is not installed")


@pytest.mark.parametrize("driver", ["kvm", "qemu"])
def test_vagrantfile_validates(driver, tmp_path):
    env = dict(os.environ)
    env.update(
        OVERLAYREC_LIBVIRT_DRIVER=driver,
        # a private VAGRANT_HOME: no boxes, plugins or state of the machine leak in
        VAGRANT_HOME=str(tmp_path / "vagrant.d"),
        VAGRANT_CHECKPOINT_DISABLE="1",
    )
    # the system's plugins (vagrant-libvirt from Debian) stay visible with a fresh VAGRANT_HOME
    proc = subprocess.run(
        [vagrant, "validate"], cwd=VAGRANT_DIR, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "validated successfully" in proc.stdout


def test_bad_driver_is_refused(tmp_path):
    env = dict(os.environ, OVERLAYREC_LIBVIRT_DRIVER="xen",
               VAGRANT_HOME=str(tmp_path / "vagrant.d"), VAGRANT_CHECKPOINT_DISABLE="1")
    proc = subprocess.run(
        [vagrant, "validate"], cwd=VAGRANT_DIR, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "OVERLAYREC_LIBVIRT_DRIVER" in proc.stdout + proc.stderr
