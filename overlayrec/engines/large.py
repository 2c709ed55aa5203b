"""Content not held in memory: a file's bytes as a length and where they lie.

A State's ``data`` is the file's bytes for a file of up to HOLD bytes (while the reader holds
less than BUDGET in all: ``holds``).  A larger one (a disk
image, a model's weights, a venv's shared libraries, a database an agent made or truncated) is
a ``Large``: its length, a *base* (the live file or attic entry, a blob of the store, or
nothing) and the saved ranges laid over it, read chunk by chunk when it is written
(``write_to``), hashed or compared, and never held whole.  A diff of a turn that installed 2 GB
of libraries held them all, several times over (6 GB, and 286 s for its ``--stat``); a replay
of a 3 GiB image took 15.7 GB.  Holes stay holes: the writers skip a chunk of zeros, so a
sparse image replays and reverts sparse.

Past LIMIT a file is also left out of patches (gitdiff.ObjectStore.trees, readers.not_in_patch):
a patch of it would be the file again, base85, and git holds a blob whole to make one.

A source is opened again for each read, so a diff of ten thousand such files holds no
descriptor open: a blob by its path in the store, a live file by its path beneath the tree's
root (never following a symlink), checked to be the very file the reader looked at (its inode,
and at least its length then); one replaced or cut since is an error (``ChangedWhileRead``).
Equality and hashing go by length and content hash (xxh3-128, as the journal's), computed once.
"""
from __future__ import annotations

import os

import xxhash

from ..journal.content import CHUNK, ZERO, BlobError, chunks, pwrite_sparse
from ..journal.schema import JournalError
from ..underlay import resolve_beneath

HOLD = int(os.environ.get("OVERLAYREC_HOLD_FILE", 4 << 20))
LIMIT = int(os.environ.get("OVERLAYREC_LARGE_FILE", 256 << 20))
# and all a reader holds together: past BUDGET, a content of more than SMALL is a Large too (a
# turn that wrote 10,000 files of 3 MiB would otherwise be 30 GB of bytes in one diff's side)
BUDGET = int(os.environ.get("OVERLAYREC_HOLD_TOTAL", 1 << 30))
SMALL = 64 << 10
_held = 0


def holds(size: int) -> bool:
    """May a reader hold a content of ``size`` bytes?  Up to HOLD each, and one of more than
    SMALL only while all it has held so far stays within BUDGET (counted as it is read, never
    given back: past the budget a reader is slower, never larger)."""
    global _held
    if size <= SMALL:
        return True
    if size > HOLD or _held + size > BUDGET:
        return False
    _held += size
    return True


class ChangedWhileRead(JournalError):
    """A live file a reader looked at changed before its content was read."""


class _Source:
    """A file read again at each ``pread``: ``open()`` gives a descriptor to it."""
    __slots__ = ("size",)

    def open(self) -> int:
        raise NotImplementedError

    def pread(self, off: int, n: int) -> bytes:
        fd = self.open()
        try:
            return b"".join(chunks(fd, off, min(off + n, self.size)))
        finally:
            os.close(fd)


class _Blob(_Source):
    __slots__ = ("store", "digest")

    def __init__(self, store, digest: str, size: int):
        self.store, self.digest, self.size = store, digest, size

    def open(self) -> int:
        return self.store.open(self.digest)


class _Live(_Source):
    """A live file, as long as it was when looked at.  One that has grown since is read to that
    length (a server's log, appended to while a diff reads it: what it held then); one that is
    another file now (renamed over) or shorter is an error, never other bytes."""
    __slots__ = ("root_fd", "rel", "key")

    def __init__(self, root_fd: int, rel: str, st: os.stat_result):
        self.root_fd, self.rel, self.size = root_fd, rel, st.st_size
        self.key = (st.st_dev, st.st_ino)

    def open(self) -> int:
        fd = resolve_beneath(self.root_fd, self.rel, os.O_RDONLY | os.O_NONBLOCK)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.key or st.st_size < self.size:
            os.close(fd)
            raise ChangedWhileRead(f"{self.rel} changed while it was being read: ask again")
        return fd


class _Bytes:
    __slots__ = ("data", "size")

    def __init__(self, data):
        self.data, self.size = data, len(data)

    def pread(self, off: int, n: int) -> bytes:
        return bytes(self.data[off:off + n])


class Large:
    """A file's content of ``size`` bytes: ``base`` (a source: a blob, a live file, another
    Large, bytes; None: zeros) cut or zero-padded to ``size``, then each of ``over`` ((offset,
    source) pairs, in order) laid on it.  A source has ``size`` and ``pread(offset, n)``."""
    __slots__ = ("size", "base", "over", "_digest")

    def __init__(self, size: int, base=None, over=()):
        self.size, self.base, self.over, self._digest = size, base, tuple(over), None

    @classmethod
    def live(cls, root_fd: int, rel: str, st: os.stat_result) -> "Large":
        """The content of the file ``rel`` beneath ``root_fd`` that ``st`` describes."""
        return cls(st.st_size, _Live(root_fd, rel, st))

    def pread(self, off: int, n: int) -> bytes:
        end = min(off + n, self.size)
        if off >= end:
            return b""
        base = self.base.pread(off, end - off) if self.base is not None else b""
        buf = None
        for o, src in self.over:
            lo, hi = max(o, off), min(o + src.size, end)
            if lo >= hi:
                continue
            if buf is None:
                buf = bytearray(base.ljust(end - off, b"\0"))
            buf[lo - off:hi - off] = src.pread(lo - o, hi - lo)
        if buf is not None:
            return bytes(buf)
        return base if len(base) == end - off else base.ljust(end - off, b"\0")

    def chunks(self):
        pos = 0
        while pos < self.size:
            buf = self.pread(pos, CHUNK)
            yield buf
            pos += len(buf)

    def digest(self) -> str:
        if self._digest is None:
            h = xxhash.xxh3_128()
            for buf in self.chunks():
                h.update(buf)
            self._digest = h.hexdigest()
        return self._digest

    def __len__(self) -> int:
        return self.size

    def __bool__(self) -> bool:
        return self.size > 0

    def __eq__(self, other) -> bool:
        if isinstance(other, Large):
            return self.size == other.size and (self is other or self.digest() == other.digest())
        if isinstance(other, (bytes, bytearray, memoryview)):
            return self.size == len(other) and self.digest() == xxhash.xxh3_128_hexdigest(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.size, self.digest()))

    def __repr__(self) -> str:
        return f"<Large {self.size} bytes>"


def load(content, digest: str):
    """A blob's content from the record's store: its bytes, or past HOLD a Large that reads
    the blob file when it is written; checked against its name either way (BlobError)."""
    size = content.size(digest)
    if size is None or holds(size):
        return content.get(digest)
    data = Large(size, _Blob(content, digest, size))
    if data.digest() != digest:
        raise BlobError(f"blob {digest} in {content.root} does not match its hash (changed "
                        "on disk): refusing to use it")
    return data


def put(content, data) -> str:
    """Store bytes or a Large in the record's store; its digest."""
    if isinstance(data, Large):
        return content.put_chunks(data.chunks())
    return content.put_bytes(data)


def too_large(side, paths) -> list[str]:
    """The ``paths`` of a diff's Side whose content is past LIMIT before or after: left out of
    every patch (gitdiff.ObjectStore.trees), and said so by each reader that shows one."""
    return [p for p in paths
            if over_limit(getattr(side.before.get(p), "data", b""))
            or over_limit(getattr(side.after.get(p), "data", b""))]


def over_limit(data) -> bool:
    """Is this content past LIMIT (left out of patches)?"""
    return isinstance(data, Large) and data.size > LIMIT


def whole(data) -> bytes:
    """The bytes of a content, a Large read whole (for a caller that must hold it)."""
    return b"".join(data.chunks()) if isinstance(data, Large) else data


def source(data):
    """Something ``Large`` can read from: a Large as it is, bytes wrapped."""
    return data if isinstance(data, Large) else _Bytes(data)


def digest_of(data) -> str:
    """The content hash of bytes or a Large."""
    return data.digest() if isinstance(data, Large) else xxhash.xxh3_128_hexdigest(data)


def write_to(fd: int, data) -> None:
    """Write bytes or a Large at the start of ``fd`` (a new, empty file); a Large's chunks of
    zeros are left holes (the file's length set at the end)."""
    if not isinstance(data, Large):
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        return
    _write_chunks(fd, data.chunks())


def copy_fd(src: int, dst: int) -> None:
    """Copy the open file ``src`` into ``dst`` (new, empty) in chunks, its holes kept."""
    _write_chunks(dst, chunks(src, 0, os.fstat(src).st_size))


def _write_chunks(fd: int, pieces) -> None:
    pos = 0
    for buf in pieces:
        if buf is not ZERO:
            pwrite_sparse(fd, buf, pos)  # its blocks of zeros left holes
        pos += len(buf)
    os.ftruncate(fd, pos)


def same_as_fd(fd: int, data, size: int) -> bool:
    """Does the open file (of ``size`` bytes) hold ``data``?  Read in chunks."""
    if size != len(data):
        return False
    h = xxhash.xxh3_128()
    for buf in chunks(fd, 0, size):
        h.update(buf)
    return h.hexdigest() == digest_of(data)
