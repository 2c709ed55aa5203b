"""The underlay: the real directory beneath the mount, reached only through file descriptors.

Everything here is a thin wrapper over the ``*at()`` family of system calls, relative to a
directory fd opened before the mount covered the workspace path.  It knows nothing of FUSE,
LMDB or journaling; the layers above decide *when* to call it.

A few calls Python's ``os`` module does not expose with the flags we need (``renameat2`` with
RENAME_NOREPLACE / RENAME_EXCHANGE, ``utimensat`` with UTIME_OMIT, ``fchownat`` with
AT_EMPTY_PATH for symlinks reached by an O_PATH fd) go through ctypes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import stat

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
AT_EMPTY_PATH = 0x1000
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2
FICLONE = 0x40049409

O_PATH = getattr(os, "O_PATH", 0o10000000)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def proc_path(fd: int) -> str:
    """The magic-link path that reopens an (O_PATH) fd."""
    return f"/proc/self/fd/{fd}"


def renameat2(olddirfd: int, oldname: str, newdirfd: int, newname: str, flags: int = 0) -> None:
    if flags == 0:
        os.rename(oldname, newname, src_dir_fd=olddirfd, dst_dir_fd=newdirfd)
        return
    _check(_libc.renameat2(olddirfd, os.fsencode(oldname), newdirfd, os.fsencode(newname),
                           ctypes.c_uint(flags)), "renameat2")


def utimens_fd(fd: int, atime_ns: int | None, mtime_ns: int | None, is_symlink: bool) -> None:
    """Set times on the object behind an O_PATH fd; None leaves that time alone (UTIME_OMIT)."""
    ts = (_Timespec * 2)()
    for i, v in enumerate((atime_ns, mtime_ns)):
        if v is None:
            ts[i].tv_sec, ts[i].tv_nsec = 0, UTIME_OMIT
        else:
            ts[i].tv_sec, ts[i].tv_nsec = divmod(v, 1_000_000_000)
    if is_symlink:
        _check(_libc.utimensat(fd, b"", ts, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW), "utimensat")
    else:
        _check(_libc.utimensat(AT_FDCWD, os.fsencode(proc_path(fd)), ts, 0), "utimensat")


def chown_fd(fd: int, uid: int, gid: int) -> None:
    """chown the object behind an O_PATH fd, symlinks included (-1 leaves a field alone)."""
    _check(_libc.fchownat(fd, b"", ctypes.c_uint(uid & 0xFFFFFFFF), ctypes.c_uint(gid & 0xFFFFFFFF),
                          AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW), "fchownat")


def link_fd(src_fd: int, dirfd: int, name: str, *, root_fd: int | None = None,
            rel: str | None = None) -> None:
    """Hard-link the object behind an O_PATH fd (a symlink included) as ``name`` in ``dirfd``.

    ``rel``, the object's current path under ``root_fd``, is the fallback for a symlink on
    kernels that refuse the fd-based way (see below)."""
    st = os.fstat(src_fd)
    if not stat.S_ISLNK(st.st_mode):
        os.link(proc_path(src_fd), name, dst_dir_fd=dirfd, follow_symlinks=True)
        return
    # linkat(AT_EMPTY_PATH) links the symlink itself (/proc's magic link cannot: EXDEV). Before
    # Linux 6.10 it needs CAP_DAC_READ_SEARCH and fails with ENOENT without it, as it does for
    # a daemon run by a user: then link by path, and make sure that path named the same object.
    if _libc.linkat(src_fd, b"", dirfd, os.fsencode(name), AT_EMPTY_PATH) == 0:
        return
    err = ctypes.get_errno()
    if err != errno.ENOENT or root_fd is None or not rel:
        raise OSError(err, f"linkat: {os.strerror(err)}")
    os.link(rel, name, src_dir_fd=root_fd, dst_dir_fd=dirfd, follow_symlinks=False)
    made = os.lstat(name, dir_fd=dirfd)
    if (made.st_dev, made.st_ino) != (st.st_dev, st.st_ino):  # renamed meanwhile: undo
        os.unlink(name, dir_fd=dirfd)
        raise OSError(errno.ESTALE, f"linkat: {rel} changed while linking")


def chmod_fd(fd: int, mode: int) -> None:
    os.chmod(proc_path(fd), mode)


def truncate_fd(fd: int, size: int) -> None:
    os.truncate(proc_path(fd), size)


def open_path(dirfd: int, name: str) -> int:
    """An O_PATH fd for ``name`` in ``dirfd``, never following a final symlink."""
    return os.open(name, O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)


def open_beneath(dirfd: int, relpath: str) -> int:
    """An O_PATH fd for a relative path, component by component, following no symlink."""
    fd = os.dup(dirfd)
    try:
        for part in relpath.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                raise OSError(errno.EXDEV, "path escapes the workspace", relpath)
            nfd = open_path(fd, part)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def reopen(fd: int, flags: int) -> int:
    """Open the object behind an O_PATH fd for I/O (the passthrough_hp idiom)."""
    return os.open(proc_path(fd), flags | os.O_CLOEXEC)


def open_dir(fd: int) -> int:
    return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)


def lstat_at(dirfd: int, name: str) -> os.stat_result:
    return os.stat(name, dir_fd=dirfd, follow_symlinks=False)


def fd_path(fd: int) -> str:
    """Where the kernel says an fd's object lives now (follows renames)."""
    return os.readlink(proc_path(fd))


def clone_or_copy(src_fd: int, dst_fd: int, offset: int, length: int) -> None:
    """Copy [offset, offset+length) of src into dst at 0: copy_file_range (reflink where it can)."""
    done = 0
    while done < length:
        n = os.copy_file_range(src_fd, dst_fd, length - done, offset + done, done)
        if n == 0:
            break
        done += n


def try_clone_whole(src_fd: int, dst_fd: int) -> bool:
    """FICLONE the whole file where the filesystem can share extents (btrfs, xfs)."""
    try:
        fcntl.ioctl(dst_fd, FICLONE, src_fd)
        return True
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.EBADF):
            return False
        raise


def kind_of(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"


def list_xattrs(fd: int, is_symlink: bool) -> dict[str, bytes]:
    """xattrs of the object behind an O_PATH fd (symlinks carry none we can read)."""
    if is_symlink:
        return {}
    p = proc_path(fd)
    out = {}
    try:
        for name in os.listxattr(p):
            try:
                out[name] = os.getxattr(p, name)
            except OSError:
                pass
    except OSError:
        pass
    return out
