"""The underlay: the real directory beneath the mount, reached only through file descriptors.

Everything here is a thin wrapper over the ``*at()`` family of system calls, relative to a
directory fd opened before the mount covered the workspace path.  It knows nothing of FUSE,
LMDB or journaling; the layers above decide *when* to call it.

A few calls Python's ``os`` module does not expose with the flags we need (``renameat2`` with
RENAME_NOREPLACE / RENAME_EXCHANGE, ``utimensat`` with UTIME_OMIT, ``fchownat`` with
AT_EMPTY_PATH for symlinks reached by an O_PATH fd, ``openat2`` with its RESOLVE_* rules) go
through ctypes.

Every path beneath a root is reached by one rule, ``resolve_beneath``: never following a
symlink, never climbing out.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import stat
import time
from typing import Callable


class _Libc:
    """The C library through ctypes, opened on first use (a reader that imports this module for
    ``kind_of`` never needs it): the one the interpreter already runs on, dlopen(NULL), found
    without a search (``ctypes.util.find_library`` imports shutil and subprocess and runs
    ldconfig)."""

    def __getattr__(self, name: str):
        lib = self.__dict__.get("_lib")
        if lib is None:
            lib = self._lib = ctypes.CDLL(None, use_errno=True)
            lib.syscall.restype = ctypes.c_long
        fn = getattr(lib, name)
        setattr(self, name, fn)   # once: later calls find it without coming here
        return fn


_libc = _Libc()

AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
AT_EMPTY_PATH = 0x1000
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2
FICLONE = 0x40049409

O_PATH = getattr(os, "O_PATH", 0o10000000)

# openat2(2), Linux >= 5.6: the same syscall number on every architecture
SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def madvise_dontneed(addr: int, length: int) -> None:
    """Let go of this process's pages of ``length`` bytes at ``addr`` (madvise MADV_DONTNEED):
    for a shared file mapping, the next read maps the page cache's page again."""
    _check(_libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length),
                         ctypes.c_int(mmap.MADV_DONTNEED)), "madvise")


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
    """Set times on the object behind an O_PATH fd; None leaves that time alone (UTIME_OMIT).

    The kernel gives the filesystem a ``touch``'s "now" as the time it is (pyfuse3 fills it
    in), and only a file's owner may set explicit times, where "now" needs only the right to
    write, which the kernel checked (default_permissions).  So explicit times refused to a
    daemon that does not own the file, both within a second of now, are set as "now"."""
    try:
        _utimens_fd(fd, atime_ns, mtime_ns, is_symlink)
    except PermissionError:
        now = time.time_ns()
        if atime_ns is None or mtime_ns is None or \
                max(abs(now - atime_ns), abs(now - mtime_ns)) > 1_000_000_000:
            raise
        if is_symlink:
            _check(_libc.utimensat(fd, b"", None, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW),
                   "utimensat")
        else:
            os.utime(proc_path(fd))


def _utimens_fd(fd: int, atime_ns: int | None, mtime_ns: int | None, is_symlink: bool) -> None:
    if not is_symlink and atime_ns is not None and mtime_ns is not None:
        # the same utimensat, without building its arguments through ctypes (1.8 us against
        # 4.1 us): touch, cp -p, rsync and Python's os.utime give both; tar leaves atime
        # alone (UTIME_OMIT), which os.utime cannot say
        os.utime(proc_path(fd), ns=(atime_ns, mtime_ns))
        return
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


class Escape(OSError):
    """A path that cannot be reached beneath its root without following a symlink: a symlink
    (ELOOP) or something else than a directory (ENOTDIR) on its way, or a name that climbs out
    (EXDEV: an absolute path, "..").  Never followed, never written through."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_openat2: bool | None = None  # has this kernel openat2?  (None: not asked yet)
_ESCAPES = {errno.ELOOP: "a symlink on the way, not followed",
            errno.ENOTDIR: "not a directory on the way",
            errno.EXDEV: "leaves its root"}


def _openat2_call(dirfd: int, path: str, flags: int, mode: int, resolve: int) -> int:
    """openat2(2): an fd, or -errno."""
    how = _OpenHow(flags & 0xFFFFFFFF, mode, resolve)
    ret = _libc.syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_long(dirfd),
                        ctypes.c_char_p(os.fsencode(path)), ctypes.byref(how),
                        ctypes.c_size_t(ctypes.sizeof(how)))
    return ret if ret >= 0 else -ctypes.get_errno()


def _have_openat2() -> bool:
    """Asked once per process: ENOSYS before Linux 5.6, or EPERM where a seccomp filter does
    not know the call; then every path is walked one component at a time instead.
    (OVERLAYREC_TEST_NO_OPENAT2 makes the tests take the walk on any kernel.)"""
    global _openat2
    if _openat2 is None:
        ok = False
        if not os.environ.get("OVERLAYREC_TEST_NO_OPENAT2"):
            fd = _openat2_call(AT_FDCWD, "/", O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0,
                               RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
            if fd >= 0:
                os.close(fd)
                ok = True
        _openat2 = ok
    return _openat2


def _blocker(root_fd: int, parts: list[str]) -> tuple[int, str] | None:
    """The first component of a path that is not a directory (ELOOP: a symlink, ENOTDIR:
    anything else), looked at without following anything: to say why it was refused."""
    try:
        fd = os.open(".", O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root_fd)
    except OSError:
        return None
    try:
        for i, part in enumerate(parts):
            nfd = os.open(part, O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
            kind = os.fstat(fd).st_mode
            if not stat.S_ISDIR(kind):
                return errno.ELOOP if stat.S_ISLNK(kind) else errno.ENOTDIR, \
                    "/".join(parts[:i + 1])
    except OSError:
        pass
    finally:
        os.close(fd)
    return None


def _fail(err: int, relpath: str, root_fd: int, parts: list[str]) -> OSError:
    if err in (errno.ELOOP, errno.ENOTDIR):
        found = _blocker(root_fd, parts)
        if found is not None:
            err, where = found
            what = "a symlink, not followed" if err == errno.ELOOP else "not a directory"
            return Escape(err, f"{where} is {what}", relpath)
    if err in _ESCAPES:
        return Escape(err, _ESCAPES[err], relpath)
    return OSError(err, os.strerror(err), relpath)  # FileNotFoundError and the like


def resolve_beneath(root_fd: int, relpath: str, flags: int = O_PATH, mode: int = 0) -> int:
    """An fd for ``relpath`` beneath the directory ``root_fd``, reached without following any
    symlink: not on the way, and not the last component either (O_NOFOLLOW and O_CLOEXEC are
    always added, so with O_PATH a final symlink is opened itself, and otherwise refused).
    ``flags`` and ``mode`` as for open(2): O_DIRECTORY to want a directory, O_CREAT to make a
    file.  "" and "." are the root itself.

    openat2 with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS where the kernel
    has it, else one component at a time with O_NOFOLLOW.  Raises ``Escape`` (an OSError) for a
    path it cannot reach that way (see there), FileNotFoundError for one that is not there."""
    parts = [p for p in relpath.split("/") if p not in ("", ".")]
    if relpath.startswith("/") or ".." in parts:
        raise Escape(errno.EXDEV, _ESCAPES[errno.EXDEV], relpath)
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    if _have_openat2():
        resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
        for _ in range(16):  # EAGAIN: a rename raced the lookup; EINTR: a signal
            ret = _openat2_call(root_fd, "/".join(parts) or ".", flags, mode, resolve)
            if ret >= 0:
                return ret
            if -ret not in (errno.EAGAIN, errno.EINTR):
                break
        raise _fail(-ret, relpath, root_fd, parts)
    fd = os.open(".", O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root_fd)
    try:
        for part in parts[:-1]:
            nfd = os.open(part, O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
            kind = os.fstat(fd).st_mode
            if not stat.S_ISDIR(kind):
                raise _fail(errno.ELOOP if stat.S_ISLNK(kind) else errno.ENOTDIR, relpath,
                            root_fd, parts)
        try:
            return os.open(parts[-1] if parts else ".", flags, mode, dir_fd=fd)
        except OSError as e:
            if e.errno in _ESCAPES:
                raise _fail(e.errno, relpath, root_fd, parts) from None
            raise
    finally:
        os.close(fd)


def open_beneath(dirfd: int, relpath: str) -> int:
    """An O_PATH fd for a relative path, following no symlink (a final one is opened itself):
    ``resolve_beneath``."""
    return resolve_beneath(dirfd, relpath)


def reopen(fd: int, flags: int) -> int:
    """Open the object behind an O_PATH fd for I/O (the passthrough_hp idiom)."""
    return os.open(proc_path(fd), flags | os.O_CLOEXEC)


def reopen_own(fd: int, flags: int, before_grant: Callable[[int], None] | None = None) -> int:
    """``reopen``, reading a regular file whose owner (this process) has no read permission
    on it: a daemon not run as root must still read what a write or a removal is about to
    destroy (its pre-image) where the owner may write (``chmod 200``).  The owner may grant
    itself the read bit: it is set for the open and the mode put back at once (the mount
    serves one request at a time, so nobody sees the mode between).  A file of another owner,
    a set-group-ID file whose group the process is not in (a chmod would clear that bit), and
    any other refusal: the PermissionError stands.  The grant moves the file's ctime:
    ``before_grant(fd)`` is called first (the daemon looks for another writer's change by the
    ctime, and takes the move that follows for its own)."""
    try:
        return reopen(fd, flags)
    except PermissionError:
        if flags & os.O_ACCMODE == os.O_WRONLY:
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not _may_grant(st, stat.S_IRUSR):
            raise
    if before_grant is not None:
        before_grant(fd)
    mode = stat.S_IMODE(st.st_mode)
    try:
        chmod_fd(fd, mode | stat.S_IRUSR)
    except OSError:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES)) from None
    try:
        return reopen(fd, flags)
    finally:
        chmod_fd(fd, mode)


def open_own(dirfd: int, name: str, flags: int) -> int:
    """``name`` in ``dirfd`` opened with ``flags`` (never following a final symlink), and
    read as ``reopen_own`` does where the owner may not read it."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    except PermissionError:
        pfd = open_path(dirfd, name)
    try:
        return reopen_own(pfd, flags & ~os.O_NOFOLLOW)  # the magic link is followed
    finally:
        os.close(pfd)


def _own_groups() -> set[int]:
    return {os.getegid(), *os.getgroups()}


def _may_grant(st: os.stat_result, bit: int) -> bool:
    """May this process give itself ``bit`` on an object it lacks it on, by a chmod that
    changes nothing else (its own, and not set-group-ID with a group it is not in)?"""
    return st.st_uid == os.geteuid() and not st.st_mode & bit and \
        not (st.st_mode & stat.S_ISGID and st.st_gid not in _own_groups())


@contextlib.contextmanager
def granted_own(fd: int, bits: int):
    """``bits`` of the owner's granted on the directory ``fd`` for the time of the block, where
    this process owns it without them (a workspace root its user made 0555, or an agent's
    `chmod 000 .`), and its mode put back after; nothing changed otherwise."""
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    missing = bits & ~mode
    if not stat.S_ISDIR(st.st_mode) or not missing or not _may_grant(st, missing):
        yield
        return
    chmod_fd(fd, mode | missing)
    try:
        yield
    finally:
        chmod_fd(fd, mode)


@contextlib.contextmanager
def searchable_own(root_fd: int, relpath: str):
    """An O_PATH fd of the directory ``relpath`` beneath ``root_fd`` (``resolve_beneath``),
    reached and searchable where directories on the way, or it itself, are this process's own
    without the search bit for their owner (``chmod 600 dir``): the bit is granted on each for
    the time of the block and the modes put back after it, deepest first (as ``reopen_own``:
    for the daemon, between two requests)."""
    granted: list[tuple[int, int]] = []  # (O_PATH fd, mode to put back)

    def grant(fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode) and _may_grant(st, stat.S_IXUSR):
            chmod_fd(fd, stat.S_IMODE(st.st_mode) | stat.S_IXUSR)
            granted.append((os.dup(fd), stat.S_IMODE(st.st_mode)))

    fd = os.dup(root_fd)
    try:
        for part in [p for p in relpath.split("/") if p not in ("", ".")]:
            grant(fd)
            nfd = resolve_beneath(fd, part, O_PATH | os.O_DIRECTORY)
            os.close(fd)
            fd = nfd
        grant(fd)
        yield fd
    finally:
        os.close(fd)
        for gfd, mode in reversed(granted):
            try:
                chmod_fd(gfd, mode)
            finally:
                os.close(gfd)


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


ACL_ACCESS = "system.posix_acl_access"
_ACL_USER_OBJ, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x04, 0x10, 0x20


def acl_mode(value: bytes, st: os.stat_result) -> int | None:
    """The mode (``st_mode`` bits, without the type) the kernel leaves on ``st``'s file when
    this process sets its access ACL to ``value``: the ACL's owner, mask (or group) and other
    entries become the permission bits (``posix_acl_equiv_mode``), and the set-group-ID bit
    goes unless this process is in the file's group or privileged
    (``posix_acl_update_mode``).  An empty ACL removes it and leaves the mode alone.  None
    when ``value`` is no ACL the kernel would take (then the change fails)."""
    mode = stat.S_IMODE(st.st_mode)
    if len(value) < 4 or (len(value) - 4) % 8 or int.from_bytes(value[:4], "little") != 2:
        return None
    if len(value) == 4:
        return mode
    perms = {}
    for off in range(4, len(value), 8):
        tag, perm = int.from_bytes(value[off:off + 2], "little"), value[off + 2] & 0o7
        perms[tag] = perm
    if not {_ACL_USER_OBJ, _ACL_GROUP_OBJ, _ACL_OTHER} <= perms.keys():
        return None
    group = perms.get(_ACL_MASK, perms[_ACL_GROUP_OBJ])
    mode = mode & 0o7000 | perms[_ACL_USER_OBJ] << 6 | group << 3 | perms[_ACL_OTHER]
    if mode & stat.S_ISGID and os.geteuid() != 0 and st.st_gid != os.getegid() and \
            st.st_gid not in os.getgroups():
        mode &= ~stat.S_ISGID
    return mode
