"""Content too large to hold in memory: a file's bytes as a length and where they lie.

A State's ``data`` is the file's bytes for every file up to LIMIT.  Past that (a disk image, a
model's weights, a database an agent made or truncated) the readers would hold gigabytes, a
few copies each, and a replay or a diff of one such file was killed for want of memory.  So a
larger content is a ``Large``: its length, a *base* (the live file or attic entry, a blob of
the store, or nothing) and the saved ranges laid over it, read chunk by chunk only when it is
written (``write_to``), hashed or compared.  Holes stay holes: a chunk of zeros is skipped by
the writers, so a sparse image replays and reverts sparse.

Equality and hashing go by length and content hash (xxh3-128, as the journal's), computed once
by streaming.  A live base is the file as opened when the state was read: a change made to it
between the read and the write is what the write gives (a reader of a small file reads it once;
one of this size cannot).
"""
from __future__ import annotations

import os

import xxhash

from ..journal.content import CHUNK, ZERO, BlobError, chunks

LIMIT = int(os.environ.get("OVERLAYREC_LARGE_FILE", 256 << 20))


class _Fd:
    """A file open for reading, closed when the last Large that reads it is gone."""
    __slots__ = ("fd", "size")

    def __init__(self, fd: int):
        self.fd = fd
        self.size = os.fstat(fd).st_size

    def pread(self, off: int, n: int) -> bytes:
        out = []
        for buf in chunks(self.fd, off, min(off + n, self.size)):
            out.append(buf)
        return b"".join(out)

    def __del__(self):
        try:
            os.close(self.fd)
        except OSError:
            pass


class _Bytes:
    __slots__ = ("data", "size")

    def __init__(self, data):
        self.data, self.size = data, len(data)

    def pread(self, off: int, n: int) -> bytes:
        return bytes(self.data[off:off + n])


class Large:
    """A file's content of ``size`` bytes: ``base`` (an open file, or bytes; None: zeros)
    truncated or zero-padded to ``size``, then each of ``over`` ((offset, source) pairs, in
    order) laid on it."""
    __slots__ = ("size", "base", "over", "_digest")

    def __init__(self, size: int, base=None, over=()):
        self.size, self.base, self.over, self._digest = size, base, tuple(over), None

    @classmethod
    def of_fd(cls, fd: int) -> "Large":
        """The content of an open file (the Large owns ``fd`` from now on)."""
        src = _Fd(fd)
        return cls(src.size, src)

    def resized(self, size: int, over=()) -> "Large":
        """This content cut or zero-padded to ``size``, with ``over`` laid on it."""
        return Large(size, self, over)

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
    """A blob's content from the record's store: its bytes, or past LIMIT a Large that reads
    the blob file when it is written; checked against its name either way (BlobError)."""
    size = content.size(digest)
    if size is None or size <= LIMIT:
        return content.get(digest)
    data = Large.of_fd(content.open(digest))
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
    """The ``paths`` of a diff's Side whose content is a Large before or after: left out of
    every patch (gitdiff.ObjectStore.trees), and said so by each reader that shows one."""
    return [p for p in paths
            if isinstance(getattr(side.before.get(p), "data", None), Large)
            or isinstance(getattr(side.after.get(p), "data", None), Large)]


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
    pos = 0
    for buf in data.chunks():
        if buf is not ZERO and buf != ZERO[:len(buf)]:
            view, at = memoryview(buf), pos
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n
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
