"""Listings the kernel keeps (overlayrec.dircache): the kernel answers a directory's later
reads itself until a change through the mount drops what it kept.

To see whether a listing came from the kernel or from the daemon, a test changes the underlay
behind the mount (through a descriptor of the workspace opened before the mount, the
directory's mtime put back): the daemon would list that change, a listing the kernel kept
does not.  Nothing in overlayrec changes the underlay that way while mounted; every change
through the mount must drop the kept listing, so that what a process lists is the directory
as it is.
"""
from __future__ import annotations

import ctypes
import os
import stat
import subprocess
import sys

import pytest

from conftest import SLOW, needs_fuse

_libc = ctypes.CDLL(None, use_errno=True)
RENAME_EXCHANGE = 2


def listing(path: str) -> list[tuple[str, bool]]:
    """What a process lists in ``path``: names and whether each is a directory (d_type)."""
    with os.scandir(path) as it:
        return sorted((e.name, e.is_dir(follow_symlinks=False)) for e in it)


def underlay_listing(under: int, sub: str) -> list[tuple[str, bool]]:
    fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=under)
    try:
        out = []
        for name in os.listdir(fd):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            out.append((name, stat.S_ISDIR(st.st_mode)))
        return sorted(out)
    finally:
        os.close(fd)


def behind(under: int, path: str) -> None:
    """Make a file in the underlay behind the mount, the kernel not hearing of it: the
    directory's mtime is put back, since the kernel asks for the directory's attributes at
    each open (glibc's opendir stats it, and a read leaves the atime stale) and drops what it
    kept when the mtime moved."""
    parent = os.path.dirname(path)
    dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=under)
    try:
        st = os.stat(dfd)
        fd = os.open(os.path.basename(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                     0o644, dir_fd=dfd)
        os.close(fd)
        os.utime(dfd, ns=(st.st_atime_ns, st.st_mtime_ns))
    finally:
        os.close(dfd)


def seed(ws: str) -> None:
    os.makedirs(os.path.join(ws, "d", "sub"))
    os.makedirs(os.path.join(ws, "elsewhere"))
    for p in ("d/a", "d/b", "d/sub/c", "elsewhere/e"):
        with open(os.path.join(ws, p), "w") as f:
            f.write(p + "\n")


# how the kernel is let keep listings: directories it opens itself (Linux 5.1+, what this
# machine's kernel does), or the daemon's OPENDIR replies (older kernels: a test switch here)
MODES = {"by-inode": {}, "by-handle": {"OVERLAYREC_TEST_DIRCACHE_BY_HANDLE": "1"}}


@needs_fuse
@pytest.mark.timeout(int(120 * SLOW))
@pytest.mark.parametrize("mode", MODES)
def test_a_kept_listing_is_dropped_by_every_change_through_the_mount(make_mount, mode):
    m = make_mount(env=dict(os.environ, **MODES[mode]))
    seed(m.ws)
    under = os.open(m.ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    m.mount()
    try:
        d = os.path.join(m.ws, "d")
        first = listing(d)
        assert first == [("a", False), ("b", False), ("sub", True)]
        behind(under, "d/unheard")
        # the kernel answers from what it kept: the daemon would have listed "unheard"
        assert listing(d) == first
        assert listing(d) == first

        def changes():
            yield "create", lambda: open(os.path.join(d, "new"), "w").close()
            yield "mkdir", lambda: os.mkdir(os.path.join(d, "newdir"))
            yield "unlink", lambda: os.unlink(os.path.join(d, "a"))
            yield "rename within", lambda: os.rename(os.path.join(d, "b"),
                                                     os.path.join(d, "b2"))
            yield "rename in", lambda: os.rename(os.path.join(m.ws, "elsewhere", "e"),
                                                 os.path.join(d, "e"))
            yield "rename out", lambda: os.rename(os.path.join(d, "e"),
                                                  os.path.join(m.ws, "elsewhere", "e"))
            yield "symlink", lambda: os.symlink("b2", os.path.join(d, "link"))
            yield "hard link", lambda: os.link(os.path.join(d, "b2"), os.path.join(d, "b3"))
            yield "fifo", lambda: os.mkfifo(os.path.join(d, "fifo"))
            yield "exchange", lambda: exchange(os.path.join(d, "b2"), os.path.join(d, "newdir"))
            yield "rmdir", lambda: os.rmdir(os.path.join(d, "b2"))  # a directory now
            yield "rename over", lambda: os.rename(os.path.join(d, "b3"),
                                                   os.path.join(d, "new"))
            yield "directory renamed in", lambda: os.rename(os.path.join(m.ws, "elsewhere"),
                                                            os.path.join(d, "moved"))

        for what, change in changes():
            listing(d)  # kept again before each change
            behind(under, f"d/unheard-before-{what.replace(' ', '-')}")
            change()
            assert listing(d) == underlay_listing(under, "d"), what
        # a change beneath does not touch the directory's own listing, and is listed below
        open(os.path.join(d, "sub", "deeper"), "w").close()
        assert listing(os.path.join(d, "sub")) == underlay_listing(under, "d/sub")
    finally:
        m.umount()
        os.close(under)


def exchange(a: str, b: str) -> None:
    if _libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), RENAME_EXCHANGE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


@needs_fuse
@pytest.mark.timeout(int(120 * SLOW))
def test_the_switch_leaves_every_listing_to_the_daemon(make_mount):
    """``OVERLAYREC_TEST_NO_DIRCACHE=1`` (the bench's overlayrec-nodircache): the daemon lists
    each read, so what the test above sees kept is listed here."""
    m = make_mount(env=dict(os.environ, OVERLAYREC_TEST_NO_DIRCACHE="1"))
    seed(m.ws)
    under = os.open(m.ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    m.mount()
    try:
        d = os.path.join(m.ws, "d")
        listing(d)
        behind(under, "d/unheard")
        assert ("unheard", False) in listing(d)
    finally:
        m.umount()
        os.close(under)


def test_the_library_is_built_and_loads_before_pyfuse3():
    """A checkout set up by tools/setup has the library; the daemon finds and loads it (it is
    imported before pyfuse3 in a fresh interpreter, as the daemon does)."""
    code = ("import overlayrec.dircache as d, sys; "
            "assert 'pyfuse3' not in sys.modules; print(d.active)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env={k: v for k, v in os.environ.items()
                                        if k != "OVERLAYREC_TEST_NO_DIRCACHE"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"


@needs_fuse
@pytest.mark.timeout(int(120 * SLOW))
@pytest.mark.parametrize("mode", MODES)
def test_a_reader_half_way_through_a_large_directory_resumes_where_it_was(make_mount, mode):
    """A directory of more names than one READDIRPLUS carries, read a little by one reader;
    names are added through the mount, another reader lists the whole directory (which begins
    the daemon's listing of it anew when the kernel opened it itself), and the first reader
    reads on: every name that was there throughout is listed to it exactly once."""
    m = make_mount(env=dict(os.environ, **MODES[mode]))
    d = os.path.join(m.ws, "big")
    os.makedirs(d)
    old = {f"entry-{i:05d}-{'x' * 40}" for i in range(1500)}
    for n in old:
        open(os.path.join(d, n), "w").close()
    m.mount()
    try:
        with os.scandir(d) as it:
            first = [next(it).name for _ in range(5)]
            new = {f"added-{i:03d}" for i in range(200)}
            for n in new:
                open(os.path.join(d, n), "w").close()
            assert set(os.listdir(d)) == old | new  # the other reader, from offset 0
            rest = [e.name for e in it]
        got = first + rest
        assert len([n for n in got if n in old]) == len(old)
        assert set(got) >= old and set(got) <= old | new
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)  # FSYNCDIR of a directory the kernel opened itself
        finally:
            os.close(fd)
    finally:
        m.umount()
    with open(os.path.join(m.state, "daemon.log")) as f:
        log = f.read()
    # which mode served (Linux 5.1+ opens directories itself)
    assert ("directories are opened by the kernel" in log) == (mode == "by-inode")


@needs_fuse
@pytest.mark.timeout(int(120 * SLOW))
@pytest.mark.parametrize("mode", MODES)
def test_deep_and_moved_directories_list_as_they_are(make_mount, mode):
    """Beyond the first shapes: a directory 3,600 bytes deep (the daemon reaches it through
    its inode table, past what one path lookup takes), and a directory renamed with files
    beneath, listed before and after the rename and after changes beneath its new name."""
    deep = "/".join(["y" * 200] * 18)
    m = make_mount(env=dict(os.environ, **MODES[mode]))
    under = os.open(m.ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    subprocess.run(["mkdir", "-p", deep, "top/mid/low"], cwd=m.ws, check=True)
    for p in ("top/a", "top/mid/b", "top/mid/low/c"):
        open(os.path.join(m.ws, p), "w").close()
    m.mount()
    try:
        # the deep directory: listed, a name added and one removed through the mount
        code = ("import os\n"
                f"os.chdir({deep!r})\n"
                "print(sorted(os.listdir('.')))\n"
                "open('f1', 'w').close(); open('f2', 'w').close()\n"
                "print(sorted(os.listdir('.')))\n"
                "os.unlink('f1')\n"
                "print(sorted(os.listdir('.')))\n")
        out = m.py(code).stdout.split("\n")
        assert out[:3] == ["[]", "['f1', 'f2']", "['f2']"], out
        # a directory renamed with files beneath: what each level lists, before and after
        levels = ("top", "top/mid", "top/mid/low")
        before = {p: listing(os.path.join(m.ws, p)) for p in levels}
        os.rename(os.path.join(m.ws, "top"), os.path.join(m.ws, "moved"))
        moved = {p: listing(os.path.join(m.ws, "moved" + p[3:])) for p in levels}
        assert moved == before
        os.rename(os.path.join(m.ws, "moved/mid/b"), os.path.join(m.ws, "moved/mid/low/b"))
        for p in levels:
            q = "moved" + p[3:]
            assert listing(os.path.join(m.ws, q)) == underlay_listing(under, q), q
        assert not os.path.exists(os.path.join(m.ws, "top"))
    finally:
        m.umount()
        os.close(under)
    assert sorted(os.listdir(os.path.join(m.ws, deep))) == ["f2"]
