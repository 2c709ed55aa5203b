"""Appends as the kernel sends them through the mount, against what Linux does natively: an
append-only file (chattr +a), and a positioned write through an O_APPEND handle after another
handle's truncating open (found by a bug hunt, 2026-12-08)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import needs_fuse, overlayrec

pytestmark = needs_fuse


def test_an_append_only_file_is_appended_to(make_mount):
    """`chattr +a app.log`: `>>` and an O_APPEND write were refused (EPERM) through the mount,
    the daemon reopening the file without O_APPEND; natively they append.  The record says
    each write."""
    m = make_mount()
    log = os.path.join(m.ws, "app.log")
    with open(log, "w") as f:
        f.write("line 1\n")
    if subprocess.run(["chattr", "+a", log], capture_output=True).returncode:
        pytest.skip("the filesystem takes no append-only flag")
    try:
        m.mount()
        try:
            m.sh("echo 'line 2' >> app.log")
            m.py("import os; fd = os.open('app.log', os.O_WRONLY | os.O_APPEND); "
                 "os.write(fd, b'line 3\\n'); os.close(fd)")
            r = m.sh("echo 'line 4' > app.log", check=False)
            assert r.returncode != 0  # natively refused too (a truncating open)
        finally:
            m.umount()
        assert open(log).read() == "line 1\nline 2\nline 3\n"
        d = overlayrec("diff", m.ws, "--state-dir", m.state, "--since", "0").stdout
        assert "+line 2" in d and "+line 3" in d, d
    finally:
        subprocess.run(["chattr", "-a", log], capture_output=True)


POSITIONED = r'''
import fcntl, os, sys
f, mode = sys.argv[1:]
with open(f, "wb") as w:
    w.write(b"." * 8192)
os.stat(f)
a = os.open(f, os.O_WRONLY | os.O_APPEND)
b = os.open(f, os.O_WRONLY | os.O_TRUNC)  # another handle truncates by its open
os.write(b, b"B" * 100)
os.close(b)
if mode == "noappend":
    os.pwritev(a, [b"X" * 10], 8192, 0x20)  # RWF_NOAPPEND
else:
    fcntl.fcntl(a, fcntl.F_SETFL, fcntl.fcntl(a, fcntl.F_GETFL) & ~os.O_APPEND)
    os.pwrite(a, b"X" * 10, 8192)
os.close(a)
data = open(f, "rb").read()
print(len(data), data.find(b"X"))
'''


@pytest.mark.parametrize("mode", ["noappend", "fcntl"])
def test_a_positioned_write_after_a_truncating_open_lands_where_it_is_sent(make_mount,
                                                                          tmp_path, mode):
    """An O_APPEND handle writes at 8192 (RWF_NOAPPEND, or O_APPEND cleared by fcntl) after
    another handle's O_TRUNC open made the file 100 bytes: the daemon still took 8192 for the
    size it had told the kernel, and moved the write to the end (100), as a stale append."""
    native = tmp_path / "native"
    native.mkdir()
    want = subprocess.run([sys.executable, "-c", POSITIONED, str(native / "f"), mode],
                          capture_output=True, text=True, check=True).stdout.split()
    assert want == ["8202", "8192"], want
    m = make_mount()
    m.mount()
    try:
        got = subprocess.run([sys.executable, "-c", POSITIONED, os.path.join(m.ws, "f"), mode],
                             capture_output=True, text=True, check=True).stdout.split()
    finally:
        m.umount()
    assert got == want
