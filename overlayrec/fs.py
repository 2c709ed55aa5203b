"""The filesystem: a thin pyfuse3.Operations adapter over the underlay and the recorder.

It owns inodes and handles and the mapping of failures to errno, nothing else:

* an inode is keyed by the underlay's (st_dev, st_ino) and holds an O_PATH fd and a real lookup
  count, released on forget (libfuse passthrough_hp's model, not an inode-to-path map);
* every mutation is handed to the recorder, which journals before it changes the underlay;
* a handle remembers the actor that opened it, so its writes are that actor's;
* every handler maps OSError to its errno; any other exception is logged and becomes EIO, so
  the mount never dies of an error.

FUSE inode numbers are the underlay's st_ino (``ls -i`` and hard-link detection read as native),
except the root, which FUSE calls 1, and the rare collision, which gets a number of its own.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import stat

import pyfuse3

from . import underlay
from .recorder import ATTIC_NAME, Recorder

log = logging.getLogger(__name__)

TIMEOUT = 300.0  # every change goes through the mount, so the kernel may cache long
_ACCMODE = os.O_ACCMODE
# flags the kernel has already acted on, or that cannot apply to a reopen through /proc
_STRIP = os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_APPEND | os.O_NOFOLLOW | \
    getattr(os, "O_DIRECT", 0)
_COLLISION_BASE = 1 << 62


class Inode:
    __slots__ = ("fuse_ino", "fd", "key", "nlookup", "is_symlink", "is_dir", "no_xattr")

    def __init__(self, fuse_ino: int, fd: int, key: tuple[int, int], mode: int):
        self.fuse_ino = fuse_ino
        self.fd = fd
        self.key = key
        self.nlookup = 0
        self.is_symlink = stat.S_ISLNK(mode)
        self.is_dir = stat.S_ISDIR(mode)
        # the kernel asks for security.capability before every write (and ls for ACLs and
        # labels on every file); xattrs change only through us, so a known absence is
        # remembered until this inode's attributes change
        self.no_xattr: set[bytes] = set()


class Handle:
    __slots__ = ("fd", "inode", "actor", "unit", "_path", "write_seq", "epoch", "writes",
                 "lo", "hi", "nbytes", "recorder")

    def __init__(self, fd: int, inode: Inode, actor: dict | None, unit: str | None,
                 recorder: Recorder):
        self.fd = fd
        self.inode = inode
        self.actor = actor
        self.unit = unit
        self.recorder = recorder
        self._path = None
        self.write_seq = None
        self.epoch = None
        self.writes = self.nbytes = 0
        self.lo = self.hi = 0

    @property
    def path(self) -> str:
        if self._path is None:
            self._path = self.recorder.rel(self.fd)
        return self._path

    def reset_extent(self, off: int, length: int) -> None:
        self.writes, self.nbytes, self.lo, self.hi = 1, length, off, off + length

    def note_write(self, off: int, length: int) -> None:
        self.writes += 1
        self.nbytes += length
        self.lo, self.hi = min(self.lo, off), max(self.hi, off + length)


class DirHandle:
    __slots__ = ("inode", "names")

    def __init__(self, inode: Inode, names: list[str]):
        self.inode = inode
        self.names = names


def _errno_boundary(fn):
    """OSError -> its errno; anything unexpected is logged and becomes EIO."""
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception:
            log.exception("unexpected error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
    return wrapper


class Operations(pyfuse3.Operations):
    enable_writeback_cache = False
    # no NFS export: the kernel then never asks us to look up ".." (see _parent_of)
    supports_dot_lookup = False

    def __init__(self, recorder: Recorder, root_fd: int, fault_name: str | None = None):
        super().__init__()
        self.recorder = recorder
        self.attribution = recorder.attribution
        self.fault_name = fault_name
        self.inodes: dict[int, Inode] = {}
        self.by_key: dict[tuple[int, int], int] = {}
        self.handles: dict[int, Handle | DirHandle] = {}
        self._next_fh = 1
        self._next_collision = _COLLISION_BASE
        st = os.fstat(root_fd)
        self.root = Inode(pyfuse3.ROOT_INODE, root_fd, (st.st_dev, st.st_ino), st.st_mode)
        self.root.nlookup = 1 << 62  # never forgotten
        self.inodes[pyfuse3.ROOT_INODE] = self.root
        self.by_key[self.root.key] = pyfuse3.ROOT_INODE

    # -- inodes ---------------------------------------------------------------------------------
    def _inode(self, ino: int) -> Inode:
        try:
            return self.inodes[ino]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ESTALE) from None

    def _attr(self, inode: Inode, st: os.stat_result) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode.fuse_ino
        a.generation = 0
        a.entry_timeout = TIMEOUT
        a.attr_timeout = TIMEOUT
        a.st_mode = st.st_mode
        a.st_nlink = self.recorder.nlink(st) - (inode is self.root)  # the hidden attic dir
        a.st_uid = st.st_uid
        a.st_gid = st.st_gid
        a.st_rdev = st.st_rdev
        a.st_size = st.st_size
        a.st_blksize = st.st_blksize
        a.st_blocks = st.st_blocks
        a.st_atime_ns = st.st_atime_ns
        a.st_mtime_ns = st.st_mtime_ns
        a.st_ctime_ns = st.st_ctime_ns
        return a

    def _remember(self, fd: int, st: os.stat_result) -> Inode:
        """Count one lookup of the object behind ``fd`` (taking ownership of ``fd``)."""
        key = (st.st_dev, st.st_ino)
        ino = self.by_key.get(key)
        if ino is not None:
            os.close(fd)
            inode = self.inodes[ino]
        else:
            ino = st.st_ino
            if ino <= pyfuse3.ROOT_INODE or ino in self.inodes or ino >= _COLLISION_BASE:
                ino = self._next_collision
                self._next_collision += 1
            inode = Inode(ino, fd, key, st.st_mode)
            self.inodes[ino] = inode
            self.by_key[key] = ino
        inode.nlookup += 1
        return inode

    def _lookup_name(self, parent: Inode, name: str) -> tuple[Inode, os.stat_result]:
        fd = underlay.open_path(parent.fd, name)
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        return self._remember(fd, st), st

    def _parent_of(self, inode: Inode) -> Inode:
        """The parent directory's inode, never by walking ".." onto the mountpoint (the
        underlay root's dentry is where our own mount sits: stepping on it would call us)."""
        path = self.recorder.rel(inode.fd)
        if inode is self.root or "/" not in path:
            self.root.nlookup += 1
            return self.root
        fd = underlay.open_beneath(self.root.fd, path.rsplit("/", 1)[0])
        return self._remember(fd, os.fstat(fd))

    def _hidden(self, parent_ino: int, name: str) -> bool:
        return parent_ino == pyfuse3.ROOT_INODE and name == ATTIC_NAME

    def _check_name(self, parent_ino: int, name: str) -> None:
        if self._hidden(parent_ino, name):
            raise pyfuse3.FUSEError(errno.EPERM)

    def _actor(self, ctx) -> dict:
        return self.attribution.actor(ctx.pid)

    # -- lookups and attributes -----------------------------------------------------------------
    @_errno_boundary
    async def lookup(self, parent_inode, name, ctx=None):
        name = os.fsdecode(name)
        if self.fault_name is not None and name == self.fault_name:
            raise RuntimeError("injected fault (OVERLAYREC_INJECT_FAULT)")
        parent = self._inode(parent_inode)
        if self._hidden(parent_inode, name):
            raise pyfuse3.FUSEError(errno.ENOENT)
        if name == ".":
            inode, st = parent, os.fstat(parent.fd)
            inode.nlookup += 1
            return self._attr(inode, st)
        if name == "..":
            inode = self._parent_of(parent)
            return self._attr(inode, os.fstat(inode.fd))
        try:
            inode, st = self._lookup_name(parent, name)
        except FileNotFoundError:
            a = pyfuse3.EntryAttributes()
            a.st_ino = 0  # a negative entry the kernel may cache
            a.entry_timeout = TIMEOUT
            return a
        return self._attr(inode, st)

    async def forget(self, inode_list):
        try:
            self._forget(inode_list)
        except Exception:  # forget cannot answer an error; the mount must not die of one
            log.exception("unexpected error in forget")

    def _forget(self, inode_list):
        for ino, n in inode_list:
            inode = self.inodes.get(ino)
            if inode is None or inode is self.root:
                continue
            inode.nlookup -= n
            if inode.nlookup <= 0:
                del self.inodes[ino]
                if self.by_key.get(inode.key) == ino:
                    del self.by_key[inode.key]
                os.close(inode.fd)

    @_errno_boundary
    async def getattr(self, inode, ctx=None):
        i = self._inode(inode)
        return self._attr(i, os.fstat(i.fd))

    @_errno_boundary
    async def setattr(self, inode, attr, fields, fh, ctx):
        i = self._inode(inode)
        i.no_xattr.clear()  # chmod rewrites an ACL's mask; chown drops capabilities
        actor = self._actor(ctx)
        rec = self.recorder
        if fields.update_size:
            h = self.handles.get(fh) if fh is not None else None
            if not isinstance(h, Handle) or h.unit is None:
                h = None
            rec.truncate(i.fd, attr.st_size, actor, handle=h)
        if fields.update_mode:
            if i.is_symlink:
                raise pyfuse3.FUSEError(errno.EOPNOTSUPP)
            rec.chmod(i.fd, stat.S_IMODE(attr.st_mode), actor)
        if fields.update_uid or fields.update_gid:
            rec.chown(i.fd, attr.st_uid if fields.update_uid else -1,
                      attr.st_gid if fields.update_gid else -1, actor)
        if fields.update_atime or fields.update_mtime:
            rec.utimens(i.fd, attr.st_atime_ns if fields.update_atime else None,
                        attr.st_mtime_ns if fields.update_mtime else None, i.is_symlink, actor)
        return self._attr(i, os.fstat(i.fd))

    @_errno_boundary
    async def readlink(self, inode, ctx):
        return os.fsencode(os.readlink("", dir_fd=self._inode(inode).fd))

    @_errno_boundary
    async def access(self, inode, mode, ctx):
        return True  # default_permissions: the kernel checks modes itself

    @_errno_boundary
    async def statfs(self, ctx):
        s = os.statvfs(self.root.fd)
        r = pyfuse3.StatvfsData()
        for f in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                  "f_ffree", "f_favail", "f_namemax"):
            setattr(r, f, getattr(s, f))
        return r

    # -- creations ------------------------------------------------------------------------------
    def _entry(self, parent: Inode, name: str) -> pyfuse3.EntryAttributes:
        inode, st = self._lookup_name(parent, name)
        return self._attr(inode, st)

    @_errno_boundary
    async def mkdir(self, parent_inode, name, mode, ctx):
        name = os.fsdecode(name)
        self._check_name(parent_inode, name)
        p = self._inode(parent_inode)
        self.recorder.mkdir(p.fd, name, stat.S_IMODE(mode), ctx.uid, ctx.gid, self._actor(ctx))
        return self._entry(p, name)

    @_errno_boundary
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        name = os.fsdecode(name)
        self._check_name(parent_inode, name)
        p = self._inode(parent_inode)
        self.recorder.mknod(p.fd, name, mode, rdev, ctx.uid, ctx.gid, self._actor(ctx))
        return self._entry(p, name)

    @_errno_boundary
    async def symlink(self, parent_inode, name, target, ctx):
        name = os.fsdecode(name)
        self._check_name(parent_inode, name)
        p = self._inode(parent_inode)
        self.recorder.symlink(p.fd, name, os.fsdecode(target), ctx.uid, ctx.gid, self._actor(ctx))
        return self._entry(p, name)

    @_errno_boundary
    async def link(self, inode, new_parent_inode, new_name, ctx):
        new_name = os.fsdecode(new_name)
        self._check_name(new_parent_inode, new_name)
        i, p = self._inode(inode), self._inode(new_parent_inode)
        self.recorder.link(i.fd, p.fd, new_name, self._actor(ctx))
        return self._entry(p, new_name)

    @_errno_boundary
    async def create(self, parent_inode, name, mode, flags, ctx):
        name = os.fsdecode(name)
        self._check_name(parent_inode, name)
        p = self._inode(parent_inode)
        actor = self._actor(ctx)
        fd = self.recorder.create(p.fd, name, self._io_flags(flags), mode, ctx.uid, ctx.gid, actor)
        try:
            inode, st = self._lookup_name(p, name)
        except BaseException:
            os.close(fd)
            raise
        return self._file_info(fd, inode, actor), self._attr(inode, st)

    # -- removals and renames -------------------------------------------------------------------
    @_errno_boundary
    async def unlink(self, parent_inode, name, ctx):
        name = os.fsdecode(name)
        self._check_name(parent_inode, name)
        self.recorder.unlink(self._inode(parent_inode).fd, name, self._actor(ctx))

    @_errno_boundary
    async def rmdir(self, parent_inode, name, ctx):
        name = os.fsdecode(name)
        self._check_name(parent_inode, name)
        self.recorder.rmdir(self._inode(parent_inode).fd, name, self._actor(ctx))

    @_errno_boundary
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        name_old, name_new = os.fsdecode(name_old), os.fsdecode(name_new)
        self._check_name(parent_inode_old, name_old)
        self._check_name(parent_inode_new, name_new)
        self.recorder.rename(self._inode(parent_inode_old).fd, name_old,
                             self._inode(parent_inode_new).fd, name_new, flags, self._actor(ctx))

    # -- files ----------------------------------------------------------------------------------
    @staticmethod
    def _io_flags(flags: int) -> int:
        flags &= ~_STRIP
        if flags & _ACCMODE == os.O_WRONLY:
            # pre-images are read through the writer's own fd
            flags = (flags & ~_ACCMODE) | os.O_RDWR
        return flags

    def _file_info(self, fd: int, inode: Inode, actor: dict | None) -> pyfuse3.FileInfo:
        unit = self.recorder.units.unit_of(actor) if actor is not None else None
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = Handle(fd, inode, actor, unit, self.recorder)
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    @_errno_boundary
    async def open(self, inode, flags, ctx):
        i = self._inode(inode)
        writing = flags & _ACCMODE != os.O_RDONLY
        actor = self._actor(ctx) if writing or flags & os.O_TRUNC else None
        io_flags = self._io_flags(flags)
        if flags & os.O_TRUNC:
            # the open itself truncates: journal the content first, then open without O_TRUNC
            # and truncate, so the pre-image is read before the data goes
            io_flags &= ~os.O_TRUNC
            fd = underlay.reopen(i.fd, io_flags)
            try:
                self.recorder.truncate(i.fd, 0, actor, open_fd=fd)
            except BaseException:
                os.close(fd)
                raise
        else:
            fd = underlay.reopen(i.fd, io_flags)
        return self._file_info(fd, i, actor if writing else None)

    @_errno_boundary
    async def read(self, fh, off, size):
        return os.pread(self.handles[fh].fd, size, off)

    @_errno_boundary
    async def write(self, fh, off, buf):
        h = self.handles[fh]
        if h.unit is None:  # opened read-only: the kernel would not send this
            raise pyfuse3.FUSEError(errno.EBADF)
        self.recorder.before_write(h, off, len(buf), buf)
        return os.pwrite(h.fd, buf, off)

    async def flush(self, fh):
        # writes reach the underlay as they come, so a close has nothing to flush: ENOSYS
        # tells the kernel to stop sending FLUSH at all (one request less per close)
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @_errno_boundary
    async def release(self, fh):
        h = self.handles.pop(fh)
        try:
            if h.write_seq is not None and h.writes > 1:
                self.recorder.journal.put_extents(h.write_seq, {
                    "writes": h.writes, "bytes": h.nbytes, "lo": h.lo, "hi": h.hi})
        finally:
            os.close(h.fd)

    @_errno_boundary
    async def fsync(self, fh, datasync):
        fd = self.handles[fh].fd
        (os.fdatasync if datasync else os.fsync)(fd)

    # -- directories ----------------------------------------------------------------------------
    @_errno_boundary
    async def opendir(self, inode, ctx):
        i = self._inode(inode)
        dfd = underlay.open_dir(i.fd)
        try:
            names = os.listdir(dfd)
        finally:
            os.close(dfd)
        if inode == pyfuse3.ROOT_INODE:
            names = [n for n in names if n != ATTIC_NAME]
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = DirHandle(i, names)
        return fh

    @_errno_boundary
    async def readdir(self, fh, start_id, token):
        d = self.handles[fh]
        names = d.names
        # ids 0 and 1 are "." and "..": listed as natively, with no lookup count (the kernel
        # takes no reference on them from readdirplus)
        # (".." carries the directory's own number: nothing reads d_ino of "..", and walking
        # ".." on the underlay could step onto the mountpoint and into our own mount)
        for idx in range(start_id, 2):
            a = pyfuse3.EntryAttributes()
            a.st_ino = d.inode.fuse_ino
            a.st_mode = stat.S_IFDIR
            if not pyfuse3.readdir_reply(token, b"." if idx == 0 else b"..", a, idx + 1):
                return
        for idx in range(max(start_id, 2), len(names) + 2):
            name = names[idx - 2]
            try:
                fd = underlay.open_path(d.inode.fd, name)
            except FileNotFoundError:
                continue  # gone since opendir
            st = os.fstat(fd)
            inode = self._remember(fd, st)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attr(inode, st), idx + 1):
                inode.nlookup -= 1  # not sent: the kernel holds no reference to it
                if inode.nlookup <= 0:
                    self._forget([(inode.fuse_ino, 0)])
                return

    @_errno_boundary
    async def releasedir(self, fh):
        self.handles.pop(fh, None)

    @_errno_boundary
    async def fsyncdir(self, fh, datasync):
        d = self.handles[fh]
        dfd = underlay.open_dir(d.inode.fd)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    # -- extended attributes --------------------------------------------------------------------
    def _xattr_path(self, inode: int) -> tuple[Inode, str]:
        i = self._inode(inode)
        if i.is_symlink:
            raise pyfuse3.FUSEError(errno.ENODATA)
        return i, underlay.proc_path(i.fd)

    @_errno_boundary
    async def getxattr(self, inode, name, ctx):
        i, p = self._xattr_path(inode)
        if name in i.no_xattr:
            raise pyfuse3.FUSEError(errno.ENODATA)
        try:
            return os.getxattr(p, os.fsdecode(name))
        except OSError as e:
            if e.errno == errno.ENODATA and len(i.no_xattr) < 16:
                i.no_xattr.add(name)
            raise

    @_errno_boundary
    async def listxattr(self, inode, ctx):
        i = self._inode(inode)
        if i.is_symlink:
            return []
        return [os.fsencode(n) for n in os.listxattr(underlay.proc_path(i.fd))]

    @_errno_boundary
    async def setxattr(self, inode, name, value, ctx):
        i = self._inode(inode)
        if i.is_symlink:
            raise pyfuse3.FUSEError(errno.EPERM)
        i.no_xattr.clear()
        self.recorder.setxattr(i.fd, os.fsdecode(name), value, self._actor(ctx))

    @_errno_boundary
    async def removexattr(self, inode, name, ctx):
        i = self._inode(inode)
        if i.is_symlink:
            raise pyfuse3.FUSEError(errno.ENODATA)
        i.no_xattr.clear()
        self.recorder.removexattr(i.fd, os.fsdecode(name), self._actor(ctx))
