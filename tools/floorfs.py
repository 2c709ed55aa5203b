#!/usr/bin/env python3
"""floorfs: the smallest passthrough on pyfuse3 + trio, the floor tools/bench measures overlayrec
against (its ``floor`` setup).  Not part of overlayrec; nothing here records anything.

It has what overlayrec's fs layer has that shapes the requests the kernel sends, and nothing
else:

* the same inode model: inodes keyed by the underlay's (st_dev, st_ino), FUSE inode numbers
  the underlay's st_ino (the root 1), a lookup count released on forget, the (parent, name) an
  inode was last reached by, and an O_PATH fd opened lazily from those (READDIRPLUS only
  stats; an entry gets its fd when it is used), with the (st_dev, st_ino) check on a reopen;
* the same cache settings: entry and attribute timeouts of 300 s, negative entries cached,
  ``keep_cache`` on every open, no writeback cache, FLUSH answered ENOSYS (the kernel stops
  sending it), READDIRPLUS with attributes, listings kept by the kernel (directories opened by the
  kernel itself, or ``cache_readdir`` on every opendir: overlayrec.dircache; a directory
  listed at its first read),
  ``default_permissions``, no ".." lookups;
* the same serving: one worker task (``pyfuse3.main(min_tasks=1, max_tasks=1)``) with
  overlayrec's way of running pyfuse3's request loop under trio (``overlayrec.serving``: the
  floor is FUSE in Python as overlayrec serves it), file I/O through fds reopened from
  /proc/self/fd (O_WRONLY widened to O_RDWR as overlayrec does).

No fd bound (the fd limit is raised to the hard limit instead), no attribution, no hidden
names, no journal.

Usage: tools/floorfs.py WORKSPACE   (mounts over WORKSPACE itself, prints "ready" on stdout
once mounted, serves in the foreground until ``fusermount3 -u WORKSPACE`` or SIGINT/SIGTERM)
"""
from __future__ import annotations

import bisect
import ctypes
import errno
import os
import resource
import signal
import stat
import sys

# the serving of this checkout's overlayrec (the floor serves as the daemon does), and its
# listings kept by the kernel (overlayrec.dircache: imported before pyfuse3, as the daemon does)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from overlayrec import dircache  # noqa: E402  isort: skip

import pyfuse3  # noqa: E402
import trio  # noqa: E402
from overlayrec import serving  # noqa: E402

TIMEOUT = 300.0
_STRIP = os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_APPEND | os.O_NOFOLLOW | \
    getattr(os, "O_DIRECT", 0)
O_PATH = getattr(os, "O_PATH", 0o10000000)
_COLLISION_BASE = 1 << 62
_COOKIE_BITS = (1 << 62) - 1
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


class Inode:
    __slots__ = ("ino", "key", "fd", "nlookup", "parent", "name", "is_symlink")

    def __init__(self, ino, key, mode, parent, name):
        self.ino, self.key, self.fd, self.nlookup = ino, key, -1, 0
        self.parent, self.name = parent, name
        self.is_symlink = stat.S_ISLNK(mode)


def _proc(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


def _boundary(fn):
    async def wrapper(self, *args):
        try:
            return await fn(self, *args)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
    wrapper.__name__ = fn.__name__
    return wrapper


class Floor(pyfuse3.Operations):
    enable_writeback_cache = False
    supports_dot_lookup = False

    def __init__(self, root_fd: int):
        super().__init__()
        st = os.fstat(root_fd)
        self.root = Inode(pyfuse3.ROOT_INODE, (st.st_dev, st.st_ino), st.st_mode, None, None)
        self.root.fd, self.root.nlookup = root_fd, 1 << 62
        self.inodes = {pyfuse3.ROOT_INODE: self.root}
        self.by_key = {self.root.key: pyfuse3.ROOT_INODE}
        self.handles: dict[int, int] = {}
        self.dirs: dict[int, tuple[Inode, list[str]]] = {}
        self.next_fh = 1
        self.next_collision = _COLLISION_BASE

    # -- inodes
    def _fd(self, inode: Inode) -> int:
        if inode.fd >= 0:
            return inode.fd
        chain, i = [], inode
        while i.fd < 0:
            if i.parent is None:
                raise pyfuse3.FUSEError(errno.ESTALE)
            chain.append(i)
            i = i.parent
        for i in reversed(chain):
            try:
                fd = os.open(i.name, O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=i.parent.fd)
            except (FileNotFoundError, NotADirectoryError):
                raise pyfuse3.FUSEError(errno.ESTALE) from None
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != i.key:
                os.close(fd)
                raise pyfuse3.FUSEError(errno.ESTALE)
            i.fd = fd
        return inode.fd

    def _attr(self, inode: Inode, st) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode.ino
        a.generation = 0
        a.entry_timeout = TIMEOUT
        a.attr_timeout = TIMEOUT
        a.st_mode = st.st_mode
        a.st_nlink = st.st_nlink
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

    def _remember(self, fd: int, st, parent: Inode, name: str) -> Inode:
        key = (st.st_dev, st.st_ino)
        ino = self.by_key.get(key)
        if ino is not None:
            inode = self.inodes[ino]
            if fd >= 0:
                if inode.fd < 0:
                    inode.fd = fd
                else:
                    os.close(fd)
            inode.parent, inode.name = parent, name
        else:
            ino = st.st_ino
            if ino <= pyfuse3.ROOT_INODE or ino in self.inodes or ino >= _COLLISION_BASE:
                ino = self.next_collision
                self.next_collision += 1
            inode = Inode(ino, key, st.st_mode, parent, name)
            inode.fd = fd
            self.inodes[ino] = inode
            self.by_key[key] = ino
        inode.nlookup += 1
        return inode

    def _entry(self, parent: Inode, name: str) -> pyfuse3.EntryAttributes:
        fd = os.open(name, O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._fd(parent))
        st = os.fstat(fd)
        return self._attr(self._remember(fd, st, parent, name), st)

    @_boundary
    async def lookup(self, parent_inode, name, ctx=None):
        parent = self.inodes[parent_inode]
        try:
            return self._entry(parent, os.fsdecode(name))
        except FileNotFoundError:
            a = pyfuse3.EntryAttributes()
            a.st_ino = 0
            a.entry_timeout = TIMEOUT
            return a

    async def forget(self, inode_list):
        for ino, n in inode_list:
            inode = self.inodes.get(ino)
            if inode is None or inode is self.root:
                continue
            inode.nlookup -= n
            if inode.nlookup <= 0:
                del self.inodes[ino]
                if self.by_key.get(inode.key) == ino:
                    del self.by_key[inode.key]
                if inode.fd >= 0:
                    os.close(inode.fd)
                    inode.fd = -1

    @_boundary
    async def getattr(self, inode, ctx=None):
        i = self.inodes[inode]
        return self._attr(i, os.fstat(self._fd(i)))

    @_boundary
    async def setattr(self, inode, attr, fields, fh, ctx):
        i = self.inodes[inode]
        fd = self._fd(i)
        if fields.update_size:
            os.truncate(_proc(fd), attr.st_size)
        if fields.update_mode:
            os.chmod(_proc(fd), stat.S_IMODE(attr.st_mode))
        if fields.update_uid or fields.update_gid:
            os.chown(_proc(fd), attr.st_uid if fields.update_uid else -1,
                     attr.st_gid if fields.update_gid else -1)
        if fields.update_atime or fields.update_mtime:
            st = os.fstat(fd)
            os.utime(_proc(fd), ns=(attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                                    attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns))
        return self._attr(i, os.fstat(fd))

    @_boundary
    async def readlink(self, inode, ctx):
        return os.fsencode(os.readlink("", dir_fd=self._fd(self.inodes[inode])))

    async def access(self, inode, mode, ctx):
        return True

    @_boundary
    async def statfs(self, ctx):
        s = os.statvfs(self.root.fd)
        r = pyfuse3.StatvfsData()
        for f in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                  "f_ffree", "f_favail", "f_namemax"):
            setattr(r, f, getattr(s, f))
        return r

    # -- creations, removals
    @_boundary
    async def mkdir(self, parent_inode, name, mode, ctx):
        p = self.inodes[parent_inode]
        os.mkdir(name, stat.S_IMODE(mode), dir_fd=self._fd(p))
        return self._entry(p, os.fsdecode(name))

    @_boundary
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        p = self.inodes[parent_inode]
        os.mknod(name, mode, rdev, dir_fd=self._fd(p))
        return self._entry(p, os.fsdecode(name))

    @_boundary
    async def symlink(self, parent_inode, name, target, ctx):
        p = self.inodes[parent_inode]
        os.symlink(target, name, dir_fd=self._fd(p))
        return self._entry(p, os.fsdecode(name))

    @_boundary
    async def link(self, inode, new_parent_inode, new_name, ctx):
        p = self.inodes[new_parent_inode]
        os.link(_proc(self._fd(self.inodes[inode])), new_name, dst_dir_fd=self._fd(p),
                follow_symlinks=True)
        return self._entry(p, os.fsdecode(new_name))

    @_boundary
    async def unlink(self, parent_inode, name, ctx):
        os.unlink(name, dir_fd=self._fd(self.inodes[parent_inode]))

    @_boundary
    async def rmdir(self, parent_inode, name, ctx):
        os.rmdir(name, dir_fd=self._fd(self.inodes[parent_inode]))

    @_boundary
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        pold, pnew = self.inodes[parent_inode_old], self.inodes[parent_inode_new]
        ofd, nfd = self._fd(pold), self._fd(pnew)
        st = os.stat(name_old, dir_fd=ofd, follow_symlinks=False)
        if flags:  # RENAME_NOREPLACE, RENAME_EXCHANGE (mv, some installers)
            if _libc.renameat2(ofd, name_old, nfd, name_new, flags) < 0:
                e = ctypes.get_errno()
                raise OSError(e, os.strerror(e))
        else:
            os.rename(name_old, name_new, src_dir_fd=ofd, dst_dir_fd=nfd)
        ino = self.by_key.get((st.st_dev, st.st_ino))
        if ino is not None:
            moved = self.inodes[ino]
            moved.parent, moved.name = pnew, os.fsdecode(name_new)

    # -- files
    def _open_fh(self, fd: int) -> pyfuse3.FileInfo:
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = fd
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    @staticmethod
    def _flags(flags: int) -> int:
        flags &= ~_STRIP
        if flags & os.O_ACCMODE == os.O_WRONLY:
            flags = (flags & ~os.O_ACCMODE) | os.O_RDWR
        return flags | os.O_CLOEXEC

    @_boundary
    async def create(self, parent_inode, name, mode, flags, ctx):
        p = self.inodes[parent_inode]
        fd = os.open(name, self._flags(flags) | os.O_CREAT, mode, dir_fd=self._fd(p))
        try:
            entry = self._entry(p, os.fsdecode(name))
        except BaseException:
            os.close(fd)
            raise
        return self._open_fh(fd), entry

    @_boundary
    async def open(self, inode, flags, ctx):
        return self._open_fh(os.open(_proc(self._fd(self.inodes[inode])), self._flags(flags)))

    @_boundary
    async def read(self, fh, off, size):
        return os.pread(self.handles[fh], size, off)

    @_boundary
    async def write(self, fh, off, buf):
        return os.pwrite(self.handles[fh], buf, off)

    async def flush(self, fh):
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def release(self, fh):
        os.close(self.handles.pop(fh))

    @_boundary
    async def fsync(self, fh, datasync):
        (os.fdatasync if datasync else os.fsync)(self.handles[fh])

    # -- directories
    @_boundary
    async def opendir(self, inode, ctx):
        if dircache.by_inode():  # the kernel opens directories itself, as the daemon lets it
            raise pyfuse3.FUSEError(errno.ENOSYS)
        i = self.inodes[inode]
        fh = self.next_fh
        self.next_fh += 1
        self.dirs[fh] = [i, None]  # listed at the first read, as the daemon does
        dircache.next_dir()
        return fh

    @_boundary
    async def readdir(self, fh, start_id, token):
        if fh & dircache.BY_INODE:  # a listing by inode, begun at offset 0, as the daemon's
            key = fh
            d = None if start_id == 0 else self.dirs.get(key)
            if d is None:
                d = self.dirs[key] = [self.inodes[fh ^ dircache.BY_INODE], None]
        else:
            d = self.dirs[fh]
        parent, names = d
        if names is None:  # in cookie order (the offsets, as the daemon's: stable by name)
            dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC,
                          dir_fd=self._fd(parent))
            try:
                names = sorted((((hash(n) & _COOKIE_BITS) + 3, n) for n in os.listdir(dfd)))
                d[1] = names
            finally:
                os.close(dfd)
        for idx in range(start_id, 2):
            a = pyfuse3.EntryAttributes()
            a.st_ino = parent.ino
            a.st_mode = stat.S_IFDIR
            if not pyfuse3.readdir_reply(token, b"." if idx == 0 else b"..", a, idx + 1):
                return
        pfd = self._fd(parent)
        for at in range(bisect.bisect_right(names, (start_id, "\U0010ffff")), len(names)):
            cookie, name = names[at]
            try:
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            inode = self._remember(-1, st, parent, name)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attr(inode, st), cookie):
                inode.nlookup -= 1
                return
        if fh & dircache.BY_INODE:
            self.dirs.pop(fh, None)

    async def releasedir(self, fh):
        self.dirs.pop(fh, None)

    @_boundary
    async def fsyncdir(self, fh, datasync):
        i = self.inodes[fh ^ dircache.BY_INODE] if fh & dircache.BY_INODE else self.dirs[fh][0]
        dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._fd(i))
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    # -- extended attributes
    @_boundary
    async def getxattr(self, inode, name, ctx):
        i = self.inodes[inode]
        if i.is_symlink:
            raise pyfuse3.FUSEError(errno.ENODATA)
        return os.getxattr(_proc(self._fd(i)), os.fsdecode(name))

    @_boundary
    async def listxattr(self, inode, ctx):
        i = self.inodes[inode]
        if i.is_symlink:
            return []
        return [os.fsencode(n) for n in os.listxattr(_proc(self._fd(i)))]

    @_boundary
    async def setxattr(self, inode, name, value, ctx):
        os.setxattr(_proc(self._fd(self.inodes[inode])), os.fsdecode(name), value)

    @_boundary
    async def removexattr(self, inode, name, ctx):
        os.removexattr(_proc(self._fd(self.inodes[inode])), os.fsdecode(name))


async def _serve() -> None:
    async with trio.open_nursery() as nursery:
        async def on_signal():
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as sigs:
                async for _ in sigs:
                    pyfuse3.terminate()
                    return
        nursery.start_soon(on_signal)
        serving.install()
        await pyfuse3.main(min_tasks=1, max_tasks=1)
        nursery.cancel_scope.cancel()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("Usage: ")[1].split("\n")[0], file=sys.stderr)
        return 2
    ws = os.path.realpath(argv[0])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    root_fd = os.open(ws, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # before the mount covers it
    options = set(pyfuse3.default_options) | {"fsname=floorfs", "subtype=floorfs"}
    pyfuse3.init(Floor(root_fd), ws, options)
    os.chdir("/")
    os.umask(0)  # the kernel applied the caller's umask to each request already
    print("ready", flush=True)
    try:
        trio.run(_serve)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
