"""The filesystem: a thin pyfuse3.Operations adapter over the underlay and the recorder.

It owns inodes and handles and the mapping of failures to errno, nothing else:

* an inode is keyed by the underlay's (st_dev, st_ino), holds a real lookup count released on
  forget (libfuse passthrough_hp's model) and remembers the (parent inode, name) it was last
  reached by; it holds an O_PATH fd only while recently used: past a high-water mark (half the
  fd limit) the least recently used fds are closed, and ``Operations._fd`` opens one again from
  the parent's fd and the name, checking that (st_dev, st_ino) still match (else ESTALE);
* every mutation is handed to the recorder, which journals before it changes the underlay;
* a handle remembers the actor that opened it, so its writes are that actor's;
* every handler maps OSError to its errno; any other exception is logged and becomes EIO, so
  the mount never dies of an error.

FUSE inode numbers are the underlay's st_ino (``ls -i`` and hard-link detection read as native),
except the root, which FUSE calls 1, and the rare collision, which gets a number of its own.
"""
from __future__ import annotations

import bisect
import errno
import functools
import logging
import os
import queue
import resource
import stat
import threading
import time

import pyfuse3

from . import dircache, underlay
from .attribution import in_group
from .journal import JournalError
from .recorder import ATTIC_NAME, Recorder

log = logging.getLogger(__name__)

TIMEOUT = 300.0  # every change goes through the mount, so the kernel may cache long
_ACCMODE = os.O_ACCMODE
# flags the kernel has already acted on, or that cannot apply to a reopen through /proc
_STRIP = os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_APPEND | os.O_NOFOLLOW | \
    getattr(os, "O_DIRECT", 0)
_COLLISION_BASE = 1 << 62
_MIN_FD_HIGH = 64  # never fewer O_PATH fds kept than this, whatever the fd limit
_NO_NAMES: frozenset[bytes] = frozenset()
# listings begun by readers that have not read them to the end: at most so many, and names
_LISTINGS_KEPT = 64
_LISTED_NAMES_KEPT = 200_000
# what a file an O_EXCL create made cannot have: the kernel asks for it before every write
# (to drop it), and a capability is only ever set by a setxattr, which forgets this
_NEW_FILE: frozenset[bytes] = frozenset({b"security.capability"})


class Inode:
    """One object of the underlay the kernel knows (or a directory on the way to one).

    ``opath`` is its O_PATH fd, or -1 when it has none: never read it directly, ask
    ``Operations._fd`` (which opens one again through ``parent`` and ``name``).  An inode stays
    in the table while the kernel holds a lookup on it (``nlookup``) or while some inode in the
    table names it as its parent (``nchildren``), so a parent is always the same object as the
    one renames update; ``nopen`` counts open handles, whose inode keeps its fd (an open file
    may have lost every name)."""
    __slots__ = ("fuse_ino", "opath", "key", "nlookup", "is_symlink", "is_dir", "no_xattr",
                 "parent", "name", "nchildren", "nopen", "used", "told_size")

    def __init__(self, fuse_ino: int, key: tuple[int, int], mode: int,
                 parent: "Inode | None", name: str | None):
        self.fuse_ino = fuse_ino
        self.opath = -1
        self.key = key
        self.nlookup = 0
        self.parent = parent
        self.name = name
        self.nchildren = 0
        self.nopen = 0
        self.used = False  # the clock's reference bit: used since the last sweep
        self.is_symlink = stat.S_ISLNK(mode)
        self.is_dir = stat.S_ISDIR(mode)
        # the kernel asks for security.capability before every write (and ls for ACLs and
        # labels on every file); xattrs change only through us, so a known absence is
        # remembered until this inode's attributes change
        self.no_xattr: frozenset[bytes] = _NO_NAMES  # shared while empty (most inodes)
        # the size the kernel holds for it: the last we told it, grown by the writes since
        # (-1: not known); where an O_APPEND write lands (Operations.write)
        self.told_size = -1


_inval_queue: "queue.SimpleQueue[int] | None" = None


def _invalidate_inode_async(ino: int) -> None:
    """``pyfuse3.invalidate_inode`` on a thread of its own, as pyfuse3's
    ``invalidate_entry_async`` does for entries: the kernel drops the inode's pages one by one,
    and waits for a page that a read request holds locked, which only this daemon's answer to
    that request unlocks; on the serving thread that wait would never end."""
    global _inval_queue
    if _inval_queue is None:
        _inval_queue = queue.SimpleQueue()
        threading.Thread(target=_invalidating, args=(_inval_queue,), daemon=True,
                         name="overlayrec-invalidate").start()
    _inval_queue.put(ino)


def _invalidating(q: "queue.SimpleQueue[int]") -> None:
    while True:
        ino = q.get()
        try:
            pyfuse3.invalidate_inode(ino)  # (the GIL let go while the kernel works)
        except OSError as e:  # the kernel knows no such inode (forgotten meanwhile)
            log.debug("cannot invalidate inode %d: %s", ino, e)


class Handle:
    __slots__ = ("fd", "inode", "actor", "unit", "_path", "_named_at", "write_seq", "epoch",
                 "writes", "lo", "hi", "nbytes", "last_at", "recorder", "flags", "opened_run",
                 "append")

    def __init__(self, fd: int, inode: Inode, actor: dict | None, unit: str | None,
                 recorder: Recorder):
        self.fd = fd              # -1: a reader's, opened on its first READ (fs.open)
        self.flags = 0            # the flags to open it with then
        self.inode = inode
        self.actor = actor
        self.unit = unit
        self.recorder = recorder
        self._path = None
        self._named_at = -1  # the recorder's name_changes when _path was asked
        self.write_seq = None
        self.epoch = None
        self.writes = self.nbytes = 0
        self.lo = self.hi = 0
        self.last_at = 0  # the last seq handed out when the run's last write was made
        # the run was begun by the event that opened the handle (a create that made the file,
        # a truncating open), not by a write: it counts its writes from zero
        self.opened_run = False
        self.append = False  # opened O_APPEND: each write goes to the file's end (fs.write)

    @property
    def path(self) -> str:
        """The workspace path of the handle's file now.  Asked of the kernel again after any
        rename, unlink or rmdir: a file renamed (or unlinked) while open is written under its
        new name (or the attic's), never under the old one, which may name another file by
        then."""
        changes = self.recorder.name_changes
        if self._named_at != changes:
            self._path = self.recorder.rel(self.fd)
            self._named_at = changes
        return self._path

    def name_as(self, path: str, changes: int) -> None:
        """The handle's file is named ``path`` (as the recorder's ``name_changes`` stood at
        ``changes``): known already, not asked of the kernel."""
        self._path, self._named_at = path, changes

    def reset_extent(self, off: int, length: int, at: int) -> None:
        """A new run begins with this write (its event was journaled: ``at``, the last seq
        handed out)."""
        self.writes, self.nbytes, self.lo, self.hi = 1, length, off, off + length
        self.last_at = at
        self.opened_run = False

    def empty_run(self, at: int) -> None:
        """A new run begins with no write yet: the create that made the file or the truncating
        open (event ``at``)."""
        self.writes = self.nbytes = self.lo = self.hi = 0
        self.last_at = at
        self.opened_run = True

    def note_write(self, off: int, length: int, at: int) -> None:
        """A later write of the run, made when ``at`` was the last seq handed out."""
        if self.writes:
            self.lo, self.hi = min(self.lo, off), max(self.hi, off + length)
        else:  # the first of a run its create began
            self.lo, self.hi = off, off + length
        self.writes += 1
        self.nbytes += length
        self.last_at = at


def _cookie(name: str) -> int:
    """Where a name is in its directory's listing: the offset the kernel resumes after it.
    The same in every listing of the directory while the daemon runs, as ext4's hash order
    is: a reader whose listing is made again half-way through (a directory the kernel
    opened itself is listed by inode, dircache), or whose directory gained or lost a name
    meanwhile, resumes after the last name it got, and no other name is listed twice or
    skipped.  Above 2: offsets 1 and 2 follow "." and ".."."""
    return (hash(name) & _COOKIE_BITS) + 3


_COOKIE_BITS = (1 << 62) - 1


class DirHandle:
    __slots__ = ("inode", "names", "cookies")

    def __init__(self, inode: Inode, names: list[str] | None):
        self.inode = inode
        self.names = names
        self.cookies: list[int] = []


_REFUSALS_LOGGED_EVERY = 10.0  # seconds: a full state dir refuses every change, logged sparingly
_refusals = {"last": float("-inf"), "quiet": 0}


def _log_refusal(op: str, e: Exception) -> None:
    now = time.monotonic()
    if now - _refusals["last"] < _REFUSALS_LOGGED_EVERY:
        _refusals["quiet"] += 1
        return
    quiet, _refusals["quiet"], _refusals["last"] = _refusals["quiet"], 0, now
    log.warning("%s refused, not journaled: %s%s", op, e,
                f" ({quiet} more refused since the last report)" if quiet else "")


_short_of_fds = {"last": float("-inf"), "quiet": 0}


def _log_short_of_fds(op: str, e: OSError) -> None:
    """Say, now and then, that the daemon ran out of file descriptors: each file a client
    holds open through the mount costs the daemon two (its handle and its inode's O_PATH fd),
    so a client reaches EMFILE at about half its own limit, and nothing said why."""
    now = time.monotonic()
    if now - _short_of_fds["last"] < _REFUSALS_LOGGED_EVERY:
        _short_of_fds["quiet"] += 1
        return
    quiet, _short_of_fds["quiet"], _short_of_fds["last"] = _short_of_fds["quiet"], 0, now
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    log.warning("%s: out of file descriptors (%s; limit %s, hard %s%s): each file open through "
                "the mount holds two of the daemon's; raise the hard limit (`ulimit -Hn`, "
                "LimitNOFILE=) and mount again", op, e.strerror or e, soft, hard,
                f"; {quiet} more since the last report" if quiet else "")


def _errno_boundary(fn):
    """OSError -> its errno; JournalError (a commit that could not be made: nothing changed) ->
    its errno, ENOSPC for a full state dir; anything unexpected is logged and becomes EIO.

    After the request, O_PATH fds past the high-water mark are closed: only there, so no
    handler ever holds an fd number that was closed under it."""
    @functools.wraps(fn)
    async def wrapper(self, *args, **kwargs):
        try:
            return await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                _log_short_of_fds(fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except JournalError as e:
            # the change was not journaled, so it was not made (write-ahead): the caller gets
            # the journal's errno (ENOSPC when the state dir is full) and may try again
            _log_refusal(fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno) from None
        except Exception:
            log.exception("unexpected error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            if len(self._ring) > self._fd_high:
                self._trim()
    return wrapper


class Operations(pyfuse3.Operations):
    enable_writeback_cache = False
    # the kernel checks POSIX ACLs with the mode (default_permissions checks the mode bits
    # alone otherwise: a user an ACL lets read a 0600 file was refused through the mount)
    enable_acl = True
    # no NFS export: the kernel then never asks us to look up ".." (see _parent_of)
    supports_dot_lookup = False

    def __init__(self, recorder: Recorder, root_fd: int, fault_name: str | None = None,
                 fd_limit: int | None = None):
        super().__init__()
        self.recorder = recorder
        self.attribution = recorder.attribution
        self.fault_name = fault_name
        self.inodes: dict[int, Inode] = {}
        self.by_key: dict[tuple[int, int], int] = {}
        # may a process work beneath the mount (entered before it)?  Until the daemon's start
        # has looked (no such process: False, and none can come but their children), and
        # again once a change around the mount is found (forget_cached): _refuse_replaced
        self.beneath = True
        self.handles: dict[int, Handle | DirHandle] = {}
        # listings of directories the kernel opened itself, by inode (_dir)
        self.listings: dict[int, DirHandle] = {}
        self._next_fh = 1
        self._next_collision = _COLLISION_BASE
        # the inodes holding an O_PATH fd, oldest first (the root's is never closed: not here)
        self._ring: dict[int, Inode] = {}
        if fd_limit is None:
            fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            if fd_limit == resource.RLIM_INFINITY:
                fd_limit = 1 << 20
        # half the fds for O_PATH fds (the rest: open handles, the journal, the control socket)
        self._fd_high = max(_MIN_FD_HIGH, fd_limit // 2)
        self._fd_low = self._fd_high * 3 // 4  # a trim closes down to here
        st = os.fstat(root_fd)
        self.root = Inode(pyfuse3.ROOT_INODE, (st.st_dev, st.st_ino), st.st_mode, None, None)
        self.root.opath = root_fd
        self.root.nlookup = 1 << 62  # never forgotten
        self.inodes[pyfuse3.ROOT_INODE] = self.root
        self.by_key[self.root.key] = pyfuse3.ROOT_INODE
        recorder.namer = self._name_of

    def _name_of(self, st: os.stat_result) -> str | None:
        """The workspace-relative path of a known object by its chain of parents and names:
        the recorder's way to name an object whose absolute path is past the kernel's PATH_MAX
        (readlink of /proc/self/fd then fails)."""
        ino = self.by_key.get((st.st_dev, st.st_ino))
        inode = self.inodes.get(ino) if ino is not None else None
        parts = []
        while inode is not None and inode is not self.root:
            if inode.name is None:
                return None
            parts.append(inode.name)
            inode = inode.parent
        return "/".join(reversed(parts)) if inode is self.root else None

    def call_ended(self, unit: str, late) -> None:
        """The call ``unit`` has ended: what its handles still open write from now on (a
        writer it left running, its file opened during the call) was written after its end,
        ``late(unit)`` (its ``after_end``), as what its processes open from now on is.  A
        handle's unit is taken at its open; looked at here, once per call's end, and not on
        each write (the write path stays as it was)."""
        for h in self.handles.values():
            if isinstance(h, Handle) and h.unit is not None and h.unit == unit:
                h.unit = late(h.unit)

    def open_writes(self) -> list[tuple[str, str, int]]:
        """The file handles open for writing, each as (its file's workspace path now, the unit
        its writes go to, its FUSE inode number): what the control endpoint's ``writing``
        answers from.  A handle whose file can no longer be named is left out."""
        out = []
        for h in list(self.handles.values()):
            if isinstance(h, Handle) and h.unit is not None:
                try:
                    out.append((h.path, str(h.unit), h.inode.fuse_ino))
                except OSError:
                    continue
        return out

    def forget_cached(self, path: str) -> None:
        """``path`` was changed or removed around the mount (Recorder.seal found it so): the
        kernel's cache of it, its entry, its attributes and pages and its directory's listing,
        is dropped, so that processes using the mount see what it holds now rather than what
        the daemon last served (until TIMEOUT; the pages, for as long as they stay cached)."""
        self.beneath = True
        parent, _, name = path.rpartition("/")
        try:
            pfd = underlay.open_beneath(self.root.opath, parent) if parent else \
                os.dup(self.root.opath)
        except OSError:
            return  # its directory is gone too: the kernel learns so at its next lookup
        try:
            pst = os.fstat(pfd)
            pino = self.by_key.get((pst.st_dev, pst.st_ino))
            inode = self._known_at(pfd, name) if name else None
        finally:
            os.close(pfd)
        if pino is None:
            return  # the kernel was never given the directory: nothing of it is cached
        if name:
            pyfuse3.invalidate_entry_async(pino, os.fsencode(name), ignore_enoent=True)
        for ino in (pino, inode.fuse_ino if inode is not None else None):
            if ino is not None:
                _invalidate_inode_async(ino)

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
        a.st_size = inode.told_size = st.st_size
        a.st_blksize = st.st_blksize
        a.st_blocks = st.st_blocks
        a.st_atime_ns = st.st_atime_ns
        a.st_mtime_ns = st.st_mtime_ns
        a.st_ctime_ns = st.st_ctime_ns
        return a

    def _remember(self, fd: int, st: os.stat_result, parent: Inode, name: str) -> Inode:
        """Count one lookup of ``name`` in ``parent``, whose stat is ``st``; ``fd`` is its O_PATH
        fd (ownership taken) or -1 (the inode then gets one when it is next used)."""
        key = (st.st_dev, st.st_ino)
        ino = self.by_key.get(key)
        if ino is not None:
            inode = self.inodes[ino]
            if fd >= 0:
                if inode.opath < 0:
                    self._hold(inode, fd)
                else:
                    os.close(fd)
            if inode.parent is not parent or inode.name != name:
                if stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and inode.parent is not None:
                    # another hard link (or the file moved outside us): the recorder checks
                    try:
                        self.recorder.seen_linked(st, (self._fd(inode.parent), inode.name),
                                                  (self._fd(parent), name))
                    except (OSError, pyfuse3.FUSEError):
                        pass  # its old directory gone meanwhile (ESTALE): nothing to learn
                self._relink(inode, parent, name)  # another hard link, or moved outside us
        else:
            ino = st.st_ino
            if ino <= pyfuse3.ROOT_INODE or ino in self.inodes or ino >= _COLLISION_BASE:
                ino = self._next_collision
                self._next_collision += 1
            inode = Inode(ino, key, st.st_mode, parent, name)
            parent.nchildren += 1
            self.inodes[ino] = inode
            self.by_key[key] = ino
            if fd >= 0:
                self._hold(inode, fd)
        inode.nlookup += 1
        return inode

    def _lookup_name(self, parent: Inode, name: str) -> tuple[Inode, os.stat_result]:
        fd = underlay.open_path(self._fd(parent), name)
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        return self._remember(fd, st, parent, name), st

    def _parent_of(self, inode: Inode) -> Inode:
        """The parent directory's inode, never by walking ".." onto the mountpoint (the
        underlay root's dentry is where our own mount sits: stepping on it would call us).
        A directory has one name, and renames through us keep its remembered parent current."""
        parent = inode.parent if inode is not self.root else None
        if parent is None:
            parent = self.root
        parent.nlookup += 1
        return parent

    # -- O_PATH fds: at most about half the fd limit ---------------------------------------------
    def _fd(self, inode: Inode) -> int:
        """The inode's O_PATH fd, opened again from its parent and name if it was closed.

        The only way handlers reach an inode's fd.  An fd returned here stays open until the
        request ends (fds are closed only between requests, by ``_trim``)."""
        fd = inode.opath
        if fd >= 0:
            inode.used = True
            return fd
        # walk up to the nearest inode that has an fd, then open names downwards (iteratively:
        # a deep tree must not hit the recursion limit)
        chain = []
        i = inode
        while i.opath < 0:
            if i.parent is None:  # dropped from the table: it has no name we could follow
                raise pyfuse3.FUSEError(errno.ESTALE)
            chain.append(i)
            i = i.parent
        fd = i.opath
        i.used = True
        transient = False  # fd is a directory's on the way down, kept by no inode
        try:
            for i in reversed(chain):
                nfd = self._open_again(fd, i)
                if transient:
                    os.close(fd)
                fd, transient = nfd, False
                # directories on the way keep their fd only below the high-water mark, so a
                # deep path costs at most two fds more than that in one request
                if i is inode or len(self._ring) < self._fd_high:
                    self._hold(i, fd)
                else:
                    transient = True
        except BaseException:
            if transient:
                os.close(fd)
            raise
        return fd

    def _open_again(self, parent_fd: int, inode: Inode) -> int:
        try:
            fd = underlay.open_path(parent_fd, inode.name)
        except (FileNotFoundError, NotADirectoryError):
            raise pyfuse3.FUSEError(errno.ESTALE) from None
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if (st.st_dev, st.st_ino) != inode.key:  # the name now holds another object
            os.close(fd)
            raise pyfuse3.FUSEError(errno.ESTALE)
        return fd

    def _hold(self, inode: Inode, fd: int) -> None:
        inode.opath = fd
        inode.used = True
        self._ring[inode.fuse_ino] = inode

    def _unhold(self, inode: Inode) -> None:
        if inode.opath >= 0 and inode is not self.root:
            del self._ring[inode.fuse_ino]
            fd, inode.opath = inode.opath, -1
            os.close(fd)

    def _trim(self) -> None:
        """Close O_PATH fds down to the low-water mark, least recently used first (a clock: an
        inode used since the last sweep gets a second chance; one with open handles keeps its
        fd). Called between requests only."""
        ring = self._ring
        try:
            for _ in range(2):  # the second lap takes what the first spared for being used
                for ino, inode in list(ring.items()):
                    if len(ring) <= self._fd_low:
                        return
                    if inode.nopen or inode.used:
                        inode.used = False
                        del ring[ino]
                        ring[ino] = inode  # to the end: youngest
                        continue
                    self._unhold(inode)
        except Exception:  # the mount must not die of a trim: the next request tries again
            log.exception("closing idle O_PATH fds failed")

    def _relink(self, inode: Inode, parent: Inode, name: str) -> None:
        """``inode`` is now reached as ``name`` in ``parent`` (a rename, another hard link)."""
        if parent is not inode.parent:
            p = parent
            while p is not None:  # never a cycle (a bind mount of an ancestor inside the tree)
                if p is inode:
                    return
                p = p.parent
            old = inode.parent
            parent.nchildren += 1
            inode.parent = parent
            if old is not None:
                old.nchildren -= 1
                self._drop_if_unused(old)
        inode.name = name

    def _drop_if_unused(self, inode: Inode) -> None:
        """Take inodes nobody holds (no lookup, no child in the table) out of the table, and then
        their parents that this leaves unused."""
        while inode is not self.root and inode.nlookup <= 0 and inode.nchildren <= 0 \
                and inode.nopen <= 0:
            ino = inode.fuse_ino
            if self.inodes.get(ino) is inode:
                del self.inodes[ino]
            if self.by_key.get(inode.key) == ino:
                del self.by_key[inode.key]
            self._unhold(inode)
            parent, inode.parent = inode.parent, None
            if parent is None:
                return
            parent.nchildren -= 1
            inode = parent

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
            inode, st = parent, os.fstat(self._fd(parent))
            inode.nlookup += 1
            return self._attr(inode, st)
        if name == "..":
            inode = self._parent_of(parent)
            return self._attr(inode, os.fstat(self._fd(inode)))
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
                if inode.nopen <= 0:
                    self._unhold(inode)  # still a parent of inodes in the table: a name only
                self._drop_if_unused(inode)

    @_errno_boundary
    async def getattr(self, inode, ctx=None):
        i = self._inode(inode)
        return self._attr(i, os.fstat(self._fd(i)))

    @_errno_boundary
    async def setattr(self, inode, attr, fields, fh, ctx):
        i = self._inode(inode)
        i.no_xattr = _NO_NAMES  # chmod rewrites an ACL's mask; chown drops capabilities
        actor = self._actor(ctx)
        rec = self.recorder
        fd = self._fd(i)
        if fields.update_size:
            h = self.handles.get(fh) if fh is not None else None
            if not isinstance(h, Handle) or h.unit is None:
                h = None
            rec.truncate(fd, attr.st_size, actor, handle=h)
        if fields.update_mode:
            if i.is_symlink:
                raise pyfuse3.FUSEError(errno.EOPNOTSUPP)
            rec.chmod(fd, stat.S_IMODE(attr.st_mode), actor)
        if fields.update_uid or fields.update_gid:
            rec.chown(fd, attr.st_uid if fields.update_uid else -1,
                      attr.st_gid if fields.update_gid else -1, actor)
        if fields.update_atime or fields.update_mtime:
            rec.utimens(fd, attr.st_atime_ns if fields.update_atime else None,
                        attr.st_mtime_ns if fields.update_mtime else None, i.is_symlink, actor)
        return self._attr(i, os.fstat(fd))

    @_errno_boundary
    async def readlink(self, inode, ctx):
        return os.fsencode(os.readlink("", dir_fd=self._fd(self._inode(inode))))

    @_errno_boundary
    async def access(self, inode, mode, ctx):
        return True  # default_permissions: the kernel checks modes itself

    @_errno_boundary
    async def statfs(self, ctx):
        s = os.statvfs(self._fd(self.root))
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
        self.recorder.mkdir(self._fd(p), name, stat.S_IMODE(mode), ctx.uid, ctx.gid,
                            self._actor(ctx))
        return self._entry(p, name)

    @_errno_boundary
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        name = os.fsdecode(name)
        self._check_name(parent_inode, name)
        p = self._inode(parent_inode)
        self.recorder.mknod(self._fd(p), name, mode, rdev, ctx.uid, ctx.gid, self._actor(ctx))
        return self._entry(p, name)

    @_errno_boundary
    async def symlink(self, parent_inode, name, target, ctx):
        name = os.fsdecode(name)
        self._check_name(parent_inode, name)
        p = self._inode(parent_inode)
        self.recorder.symlink(self._fd(p), name, os.fsdecode(target), ctx.uid, ctx.gid,
                              self._actor(ctx))
        return self._entry(p, name)

    @_errno_boundary
    async def link(self, inode, new_parent_inode, new_name, ctx):
        new_name = os.fsdecode(new_name)
        self._check_name(new_parent_inode, new_name)
        i, p = self._inode(inode), self._inode(new_parent_inode)
        self.recorder.link(self._fd(i), self._fd(p), new_name, self._actor(ctx))
        return self._entry(p, new_name)

    @_errno_boundary
    async def create(self, parent_inode, name, mode, flags, ctx):
        name = os.fsdecode(name)
        self._check_name(parent_inode, name)
        p = self._inode(parent_inode)
        actor = self._actor(ctx)
        fd = self.recorder.create(self._fd(p), name, self._io_flags(flags), mode, ctx.uid, ctx.gid,
                                  actor)
        try:
            inode, st = self._lookup_name(p, name)
        except BaseException as e:
            # (out of fds: EMFILE) the caller is told the create failed, as natively, where
            # nothing is made: a file this request made goes, its event voided
            self.recorder.undo_create(self._fd(p), name, fd, getattr(e, "errno", None), actor)
            os.close(fd)
            raise
        if flags & os.O_EXCL and not inode.no_xattr:
            inode.no_xattr = _NEW_FILE
        info = self._file_info(fd, inode, actor)
        self.handles[info.fh].append = bool(flags & os.O_APPEND)
        self.recorder.begin_run(self.handles[info.fh])
        return info, self._attr(inode, st)

    # -- removals and renames -------------------------------------------------------------------
    @_errno_boundary
    async def unlink(self, parent_inode, name, ctx):
        name = os.fsdecode(name)
        self._check_name(parent_inode, name)
        self.recorder.unlink(self._fd(self._inode(parent_inode)), name, self._actor(ctx))

    @_errno_boundary
    async def rmdir(self, parent_inode, name, ctx):
        name = os.fsdecode(name)
        self._check_name(parent_inode, name)
        self.recorder.rmdir(self._fd(self._inode(parent_inode)), name, self._actor(ctx))

    @_errno_boundary
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        name_old, name_new = os.fsdecode(name_old), os.fsdecode(name_new)
        self._check_name(parent_inode_old, name_old)
        self._check_name(parent_inode_new, name_new)
        pold, pnew = self._inode(parent_inode_old), self._inode(parent_inode_new)
        ofd, nfd = self._fd(pold), self._fd(pnew)
        moved = self._known_at(ofd, name_old)
        other = self._known_at(nfd, name_new) if flags & underlay.RENAME_EXCHANGE else None
        self.recorder.rename(ofd, name_old, nfd, name_new, flags, self._actor(ctx))
        # the remembered names follow (what the rename replaced keeps its stale name: the next
        # use of it checks (st_dev, st_ino) and answers ESTALE)
        if moved is not None and moved.parent is pold and moved.name == name_old:
            self._relink(moved, pnew, name_new)
        if other is not None and other.parent is pnew and other.name == name_new:
            self._relink(other, pold, name_old)

    def _known_at(self, dirfd: int, name: str) -> Inode | None:
        """The table's inode for ``name`` in ``dirfd``, if any."""
        try:
            st = underlay.lstat_at(dirfd, name)
        except OSError:
            return None
        ino = self.by_key.get((st.st_dev, st.st_ino))
        return None if ino is None else self.inodes[ino]

    # -- files ----------------------------------------------------------------------------------
    @staticmethod
    def _io_flags(flags: int) -> int:
        flags &= ~_STRIP
        if flags & _ACCMODE == os.O_WRONLY:
            # pre-images are read through the writer's own fd (the owner's write-only file
            # too: underlay.reopen_own)
            flags = (flags & ~_ACCMODE) | os.O_RDWR
        return flags

    def _file_info(self, fd: int, inode: Inode, actor: dict | None) -> pyfuse3.FileInfo:
        unit = (self.recorder.units.unit_of(actor, lambda: self.recorder.rel(fd))
                if actor is not None else None)
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = Handle(fd, inode, actor, unit, self.recorder)
        inode.nopen += 1  # an open inode keeps its O_PATH fd (it may lose every name)
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    @_errno_boundary
    async def open(self, inode, flags, ctx):
        i = self._inode(inode)
        writing = flags & _ACCMODE != os.O_RDONLY
        actor = self._actor(ctx) if writing or flags & os.O_TRUNC else None
        io_flags = self._io_flags(flags)
        self._refuse_replaced(i)
        if flags & os.O_TRUNC:
            # the open itself truncates: journal the content first, then open without O_TRUNC
            # and truncate, so the pre-image is read before the data goes
            io_flags &= ~os.O_TRUNC
            ifd = self._fd(i)
            fd = underlay.reopen_own(ifd, io_flags, self.recorder.before_grant)
            try:
                self.recorder.truncate(ifd, 0, actor, open_fd=fd)
                if ctx.uid != 0:
                    self._drop_set_ids(ifd, ctx, actor)
            except BaseException:
                os.close(fd)
                raise
            if i.told_size >= 0:
                # the kernel takes the file for empty now: a write another handle sends at the
                # old size (RWF_NOAPPEND, O_APPEND cleared by fcntl) is no stale append (it
                # was moved to the new end; found by a bug hunt)
                i.told_size = 0
            info = self._file_info(fd, i, actor if writing else None)
            if writing:  # the truncate may have begun the handle's write run
                self.handles[info.fh].append = bool(flags & os.O_APPEND)
                self.recorder.begin_run(self.handles[info.fh])
            return info
        elif not writing:
            # opened on the first READ: with the page cache serving the data (keep_cache), a
            # reader such as grep or cat of a file read before costs no underlay open at all.
            # The kernel has checked the permissions already (default_permissions).
            info = self._file_info(-1, i, None)
            self.handles[info.fh].flags = io_flags
            return info
        else:
            try:
                fd = underlay.reopen_own(self._fd(i), io_flags, self.recorder.before_grant)
            except PermissionError:
                if not flags & os.O_APPEND:
                    raise
                # an append-only file (chattr +a) opens for writing with O_APPEND only: its
                # writes then land at its end, where the kernel sends an append (refused,
                # where natively it appends; found by a bug hunt)
                fd = underlay.reopen_own(self._fd(i), io_flags | os.O_APPEND,
                                         self.recorder.before_grant)
        info = self._file_info(fd, i, actor if writing else None)
        self.handles[info.fh].append = bool(flags & os.O_APPEND)
        return info

    def _drop_set_ids(self, fd: int, ctx, actor: dict) -> None:
        """An open that truncates clears the set-user-ID bit, and the set-group-ID bit where
        the group may execute or the caller is not of the file's group, as the kernel does
        for a caller without CAP_FSETID.  With an O_TRUNC the filesystem does itself
        (atomic_o_trunc) the kernel leaves that to it, and the daemon, root, truncates with
        the capability: a user's `: > prog` kept prog's setuid bit (found by a bug hunt)."""
        st = os.fstat(fd)
        drop = st.st_mode & stat.S_ISUID
        if st.st_mode & stat.S_ISGID and (st.st_mode & stat.S_IXGRP or
                                          not in_group(ctx.pid, ctx.gid, st.st_gid)):
            drop |= stat.S_ISGID
        if drop and stat.S_ISREG(st.st_mode):
            self.recorder.chmod(fd, stat.S_IMODE(st.st_mode) & ~drop, actor)

    def _refuse_replaced(self, inode: Inode) -> None:
        """ESTALE for an open of a file that another object replaced beneath the mount (an
        editor working there since before the mount saved it by rename: vim's backup rename,
        a safe write's rename over): the kernel's entry, kept for its timeout, still led to the
        old inode.  Its fd held here, an agent's write went into that removed file, lost, and a
        read gave the old content, which the agent then wrote back over the user's edit; its
        fd not held, the first READ failed with ESTALE (found by a bug hunt).  On ESTALE the
        kernel looks the name up again and opens what it holds now.  One stat: of the held fd
        (its name looked at only once it has no link left: a removed file's descriptor reopened
        through /proc/self/fd opens as before), else of the name.  None where no process
        works beneath the mount (``beneath``: a grep paid some 10 us an open)."""
        if not self.beneath or inode.parent is None or inode.name is None or \
                inode is self.root:
            return
        held = inode.opath >= 0
        if held and os.fstat(inode.opath).st_nlink:
            return
        try:
            st = os.lstat(inode.name, dir_fd=self._fd(inode.parent))
        except (FileNotFoundError, NotADirectoryError):
            if held:
                return  # removed, not replaced: its held fd still serves it
            raise pyfuse3.FUSEError(errno.ESTALE) from None  # removed: no fd to serve it
        except OSError:
            return  # (a parent this user may not search: the open's own fd says)
        if (st.st_dev, st.st_ino) != inode.key:
            raise pyfuse3.FUSEError(errno.ESTALE)

    def _handle_fd(self, h: "Handle") -> int:
        """The underlay fd of a file handle, opened now if its open was left to the first
        READ."""
        if h.fd < 0:
            h.fd = underlay.reopen(self._fd(h.inode), h.flags)
        return h.fd

    @_errno_boundary
    async def read(self, fh, off, size):
        return os.pread(self._handle_fd(self.handles[fh]), size, off)

    @_errno_boundary
    async def write(self, fh, off, buf):
        h = self.handles[fh]
        if h.unit is None:  # opened read-only: the kernel would not send this
            raise pyfuse3.FUSEError(errno.EBADF)
        inode = h.inode
        if h.append and off == inode.told_size:
            # the kernel appends at the size it cached: a process working beneath the mount (a
            # shell whose directory was entered before it) may have made the file longer since,
            # and the append wrote over its bytes.  Written at the end, as the underlay would
            # (O_APPEND is not kept on our fd: the recorder journals each write where it lands);
            # the kernel's size and pages of the file are dropped when they were stale.  Only
            # a write at the size the kernel holds is an append: one elsewhere through the
            # same handle (a shared mapping's page written back, RWF_NOAPPEND, O_APPEND
            # cleared by fcntl) goes where it is sent (it was moved to the end, found by a
            # bug hunt)
            st = os.fstat(h.fd)
            if st.st_size != off:  # longer, or shorter (truncated beneath: a hole of NULs)
                self.recorder.grown_beneath(h, st)
                n = self.recorder.write(h, st.st_size, buf)
                # the kernel takes the file for off + n long now: its next append comes there,
                # and is moved again (it was left over the other writer's bytes: a bug hunt)
                inode.told_size = off + n
                _invalidate_inode_async(inode.fuse_ino)
                return n
        n = self.recorder.write(h, off, buf)
        if off + n > inode.told_size >= 0:
            inode.told_size = off + n
        return n

    async def flush(self, fh):
        # writes reach the underlay as they come, so a close has nothing to flush: ENOSYS
        # tells the kernel to stop sending FLUSH at all (one request less per close)
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @_errno_boundary
    async def release(self, fh):
        h = self.handles.pop(fh)
        try:
            if h.write_seq is not None:
                # also marks the run ended: readers know no unseen write follows ``end``, the
                # point of its last write.  Not of the release, which the kernel sends on its
                # own time: a call's end (another socket) can come first and seal the path,
                # and the run would then seem to write on after the seal (inexact)
                self.recorder.note_extents(h)
        finally:
            if h.fd >= 0:
                os.close(h.fd)
            self._closed(h.inode)

    def _closed(self, inode: Inode) -> None:
        inode.nopen -= 1
        if inode.nopen <= 0 and inode.nlookup <= 0:  # forgotten while open (not by the kernel)
            self._unhold(inode)
            self._drop_if_unused(inode)

    @_errno_boundary
    async def fsync(self, fh, datasync):
        fd = self._handle_fd(self.handles[fh])
        (os.fdatasync if datasync else os.fsync)(fd)

    # -- directories ----------------------------------------------------------------------------
    @_errno_boundary
    async def opendir(self, inode, ctx):
        if dircache.by_inode():
            # the kernel can open directories itself: told so (once), it keeps their listings
            # and names the directory by inode in each read (dircache)
            log.info("directories are opened by the kernel, their listings kept (dircache)")
            raise pyfuse3.FUSEError(errno.ENOSYS)
        i = self._inode(inode)
        fh = self._next_fh
        self._next_fh += 1
        # listed at the first READDIRPLUS: a listing the kernel keeps (dircache) sends none
        self.handles[fh] = DirHandle(i, None)
        i.nopen += 1
        dircache.next_dir()  # last: its flag must go with this opendir's reply
        return fh

    def _names(self, d: DirHandle) -> list[str]:
        """The names ``d``'s reads list, in the order of their cookies (``d.cookies``), read at
        its first read and kept."""
        if d.names is None:
            dfd = underlay.open_dir(self._fd(d.inode))
            try:
                names = os.listdir(dfd)
            finally:
                os.close(dfd)
            if d.inode.fuse_ino == pyfuse3.ROOT_INODE:
                names = [n for n in names if n != ATTIC_NAME]
            pairs = sorted(zip(map(_cookie, names), names))
            d.cookies, d.names = [c for c, _ in pairs], [n for _, n in pairs]
        return d.names

    def _dir(self, fh: int, start_id: int) -> DirHandle:
        """The listing a READDIRPLUS continues: its handle's, or for a directory the kernel
        opened itself (dircache.BY_INODE) the one a read from offset 0 began, kept until a read
        past its end (another reader's read from 0 begins it anew: the offsets are cookies,
        so a reader half-way through resumes after the last name it got)."""
        if not fh & dircache.BY_INODE:
            return self.handles[fh]
        ino = fh ^ dircache.BY_INODE
        i = self._inode(ino)
        d = None if start_id == 0 else self.listings.get(ino)
        if d is None or d.inode is not i:  # (an inode number the table has given again)
            d = DirHandle(i, None)
            self.listings.pop(ino, None)
            # readers that stopped half-way: the oldest listings go first
            while self.listings and (len(self.listings) >= _LISTINGS_KEPT or sum(
                    len(k.names or ()) for k in self.listings.values()) > _LISTED_NAMES_KEPT):
                del self.listings[next(iter(self.listings))]
            self.listings[ino] = d
        return d

    @_errno_boundary
    async def readdir(self, fh, start_id, token):
        d = self._dir(fh, start_id)
        names = self._names(d)
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
        cookies = d.cookies
        start = bisect.bisect_right(cookies, start_id)
        if start >= len(names) and start_id >= 2 and fh & dircache.BY_INODE:
            # the reader has it all and asks past the end: its reading is over
            self.listings.pop(fh ^ dircache.BY_INODE, None)
            return
        parent = d.inode
        pfd = self._fd(parent)
        for at in range(start, len(names)):
            name = names[at]
            try:
                # a stat, no fd: an entry gets an O_PATH fd when it is used (most never are)
                st = underlay.lstat_at(pfd, name)
            except FileNotFoundError:
                continue  # gone since opendir
            inode = self._remember(-1, st, parent, name)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attr(inode, st),
                                         cookies[at]):
                inode.nlookup -= 1  # not sent: the kernel holds no reference to it
                if inode.nlookup <= 0:
                    self._forget([(inode.fuse_ino, 0)])
                return

    @_errno_boundary
    async def releasedir(self, fh):
        d = self.handles.pop(fh, None)
        if d is not None:
            self._closed(d.inode)

    @_errno_boundary
    async def fsyncdir(self, fh, datasync):
        if fh & dircache.BY_INODE:
            i = self._inode(fh ^ dircache.BY_INODE)
        else:
            i = self.handles[fh].inode
        dfd = underlay.open_dir(self._fd(i))
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    # -- extended attributes --------------------------------------------------------------------
    def _symlink_at(self, i: Inode) -> str:
        """The path by which the xattr calls reach the symlink ``i`` itself: its parent's fd
        and its name, never followed (``/proc/self/fd/N`` of the symlink's own O_PATH fd
        cannot name it to them: root's `cp -a` dropped a symlink's ``trusted.*`` attributes,
        and `lsetxattr` failed, EPERM; found by a bug hunt).  The name must still hold it."""
        if i.parent is None or i.name is None:
            raise pyfuse3.FUSEError(errno.ENODATA)
        p = f"{underlay.proc_path(self._fd(i.parent))}/{i.name}"
        st = os.lstat(p)
        if (st.st_dev, st.st_ino) != i.key:  # the name holds another object now
            raise pyfuse3.FUSEError(errno.ENODATA)
        return p

    def _xattr_path(self, i: Inode) -> tuple[str, bool]:
        """Where the xattr calls reach the object, and whether they follow that path."""
        if i.is_symlink:
            return self._symlink_at(i), False
        return underlay.proc_path(self._fd(i)), True

    @_errno_boundary
    async def getxattr(self, inode, name, ctx):
        i = self._inode(inode)
        if name in i.no_xattr:
            raise pyfuse3.FUSEError(errno.ENODATA)
        p, follow = self._xattr_path(i)
        try:
            return os.getxattr(p, os.fsdecode(name), follow_symlinks=follow)
        except OSError as e:
            if e.errno == errno.ENODATA and len(i.no_xattr) < 16:
                i.no_xattr = i.no_xattr | {name}
            raise

    @_errno_boundary
    async def listxattr(self, inode, ctx):
        p, follow = self._xattr_path(self._inode(inode))
        names = os.listxattr(p, follow_symlinks=follow)
        if ctx.uid != 0:
            # the trusted namespace is listed to its holders only (CAP_SYS_ADMIN), as the
            # filesystems beneath list it: the daemon lists as root, and `cp --preserve=xattr`
            # of a user then failed on a name it may not read (found by a bug hunt)
            names = [n for n in names if not n.startswith("trusted.")]
        return [os.fsencode(n) for n in names]

    @_errno_boundary
    async def setxattr(self, inode, name, value, ctx):
        i = self._inode(inode)
        at = self._symlink_at(i) if i.is_symlink else None
        i.no_xattr = _NO_NAMES
        self.recorder.setxattr(self._fd(i), os.fsdecode(name), value, self._actor(ctx), at=at)

    @_errno_boundary
    async def removexattr(self, inode, name, ctx):
        i = self._inode(inode)
        at = self._symlink_at(i) if i.is_symlink else None
        i.no_xattr = _NO_NAMES
        self.recorder.removexattr(self._fd(i), os.fsdecode(name), self._actor(ctx), at=at)
