"""The content store: blobs named by their xxh3-128 digest, one file each, deduplicated.

A blob is written to a temp file in ``tmp/``, hashed as it is written, then renamed to its name;
a crash leaves at worst a stray temp file (the daemon removes those at start, ``clean``), never
a blob whose name does not match its bytes.  What is on disk is still not taken on trust:
``get`` hashes what it read and refuses a blob whose bytes do not match its name (BlobError),
so a blob changed on disk (by hand, by another user while the store was open to others, by a
bad disk) never reaches a workspace, a replay or a diff.  Directories are 0700 and blobs 0600
whatever the umask (the daemon serves with umask 0); docs/storage.md has the layout.
"""
from __future__ import annotations

import errno
import os
import stat

import xxhash

from .. import state
from .schema import INLINE_BLOB, JournalError

CHUNK = 1 << 20


class BlobError(JournalError):
    """A blob whose bytes do not match its name, or that is not a regular file."""


class ContentStore:
    def __init__(self, root: str):
        self.root = root
        state.private_dir(root)
        self._tmp = os.path.join(root, "tmp")
        state.private_dir(self._tmp)
        self._n = 0

    def path(self, digest: str) -> str:
        return os.path.join(self.root, digest[:2], digest[2:])

    def has(self, digest: str) -> bool:
        return os.path.exists(self.path(digest))

    def _present(self, digest: str, size: int) -> bool:
        """A blob of this name and size is there (one of another size is replaced)."""
        try:
            st = os.lstat(self.path(digest))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == size

    def put_bytes(self, data: bytes) -> str:
        digest = xxhash.xxh3_128_hexdigest(data)
        if not self._present(digest, len(data)):
            self._commit(digest, lambda fd: _write_all(fd, data))
        return digest

    def put_range(self, src_fd: int, offset: int, length: int) -> str:
        """Store [offset, offset+length) of an open file (what of it there is: a file shorter
        than that gives what it has); returns the digest.

        Streamed: the range is written to the temp file as it is read and hashed, so a range
        of gigabytes (a disk image truncated, a model's weights overwritten) costs the daemon
        one chunk of memory, not the range.  Its holes and runs of zeros are left holes in the
        blob (the same bytes, read back as zeros), so a sparse file's pre-image costs the disk
        what its data does."""
        return self.put_chunks(chunks(src_fd, offset, min(offset + length,
                                                          os.fstat(src_fd).st_size)))

    def put_chunks(self, pieces) -> str:
        """Store the content ``pieces`` (an iterable of bytes) make, as put_range does: as it
        comes, its chunks of zeros left holes; returns the digest."""
        h = xxhash.xxh3_128()
        self._n += 1
        tmp = os.path.join(self._tmp, f"{os.getpid()}.{self._n}")
        fd = state.open_private(tmp)
        try:
            try:
                size = 0
                for buf in pieces:
                    h.update(buf)
                    if buf is not ZERO:
                        pwrite_sparse(fd, buf, size)
                    size += len(buf)
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            digest = h.hexdigest()
            if self._present(digest, size):
                os.unlink(tmp)
            else:
                self._place(tmp, digest)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return digest

    def _commit(self, digest: str, writer) -> None:
        self._n += 1
        tmp = os.path.join(self._tmp, f"{os.getpid()}.{self._n}")
        fd = state.open_private(tmp)
        try:
            try:
                writer(fd)
            finally:
                os.close(fd)
            self._place(tmp, digest)
        except BaseException:
            _unlink_quietly(tmp)
            raise

    def _place(self, tmp: str, digest: str) -> None:
        """Rename a written temp file to its blob's name."""
        final = self.path(digest)
        try:
            os.rename(tmp, final)
        except FileNotFoundError:  # the first blob under this prefix
            state.private_dir(os.path.dirname(final))
            os.rename(tmp, final)

    def size(self, digest: str) -> int | None:
        """The length of the blob file of this name; None when there is none."""
        try:
            st = os.lstat(self.path(digest))
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def open(self, digest: str) -> int:
        """A descriptor for reading the blob file (a regular file, never followed)."""
        fd = os.open(self.path(digest), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK |
                     os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise BlobError(f"blob {digest} in {self.root} is not a regular file: refusing "
                            "to use it")
        return fd

    def get(self, digest: str, verify: bool = True) -> bytes:
        """The blob's bytes, checked against its name: BlobError when they do not match (or it
        is not a regular file), so a changed blob is never written anywhere.  A missing blob
        raises FileNotFoundError."""
        path = self.path(digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno.ELOOP:  # O_NOFOLLOW's answer for a symlink
                raise
            raise BlobError(f"blob {digest} in {self.root} is not a regular file: refusing "
                            "to use it") from None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise BlobError(f"blob {digest} in {self.root} is not a regular file: "
                                "refusing to use it")
            data = f.read()
        if verify and xxhash.xxh3_128_hexdigest(data) != digest:
            raise BlobError(f"blob {digest} in {self.root} does not match its hash (changed on "
                            "disk): refusing to use it")
        return data

    def clean(self, before_ns: int) -> int:
        """At daemon start: remove the temp files of writers that are gone, made before
        ``before_ns`` (a crash's leftovers; a live writer's file is its own), and bring the
        store's directories to 0700 (an older overlayrec made them with the daemon's umask of
        0).  The number of files removed."""
        removed = 0
        with os.scandir(self._tmp) as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                    writer = e.name.split(".", 1)[0]
                    if st.st_mtime_ns >= before_ns or (writer.isdigit() and
                                                       state.pid_alive(int(writer))):
                        continue
                    os.unlink(e.path)
                    removed += 1
                except (OSError, ValueError):
                    continue
        with os.scandir(self.root) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    state.tighten(e.path)
        state.tighten(self.root)
        return removed


    def blobs(self):
        """(digest, lstat) of every blob in the store."""
        try:
            top = os.scandir(self.root)
        except FileNotFoundError:
            return
        with top:
            for d in top:
                if len(d.name) != 2 or not d.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(d.path) as it:
                    for e in it:
                        try:
                            yield d.name + e.name, e.stat(follow_symlinks=False)
                        except OSError:
                            continue

    def sweep(self, keep, before_ns: int, only=None) -> tuple[int, int]:
        """Remove the blobs not in ``keep`` (a set of digests) last changed before
        ``before_ns`` (a blob written since, for an event not yet committed, is a writer's:
        never swept); with ``only``, just those digests.  (count, bytes) removed."""
        n = size = 0
        names = ((dg, None) for dg in only) if only is not None else self.blobs()
        for digest, st in names:
            if digest in keep:
                continue
            path = self.path(digest)
            try:
                st = st or os.lstat(path)
                if st.st_mtime_ns >= before_ns:
                    continue
                os.unlink(path)
            except OSError:
                continue
            n += 1
            size += st.st_blocks * 512
        return n, size


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


# a piece of at least this many bytes is written block by block, its blocks of zeros left
# holes: a chunk of a sparse image with a little data in it was written whole (a 64 MiB image
# holding 48 KiB came back from a revert taking 3 MiB, and its saved copies 7 MiB; found by a
# bug hunt); a smaller one is one write
SPARSE_MIN = 64 << 10
BLOCK = 4096
_ZERO_BLOCK = bytes(BLOCK)


def pwrite_sparse(fd: int, buf, offset: int) -> None:
    """Write ``buf`` at ``offset`` of ``fd``, its blocks of zeros (BLOCK bytes, counted from
    ``offset``) not written: holes, read back as zeros.  The file's length is the caller's to
    set (ftruncate) when the last of it may be such a hole."""
    n = len(buf)
    if n < SPARSE_MIN:
        if buf != ZERO[:n]:
            _pwrite_all(fd, buf, offset)
        return
    if buf == ZERO[:n]:
        return
    view = memoryview(buf)
    i = 0
    while i < n:
        while i < n and view[i:i + BLOCK] == _ZERO_BLOCK[:min(BLOCK, n - i)]:
            i += BLOCK
        j = i
        while j < n and view[j:j + BLOCK] != _ZERO_BLOCK[:min(BLOCK, n - j)]:
            j += BLOCK
        if j > i:
            _pwrite_all(fd, view[i:min(j, n)], offset + i)
        i = j


def _unlink_quietly(path: str) -> None:
    # a full disk (or anything else) leaves no partial temp file behind
    try:
        os.unlink(path)
    except OSError:
        pass


ZERO = bytes(CHUNK)


def chunks(fd: int, pos: int, end: int):
    """The bytes of [pos, end) of an open file, in chunks of at most CHUNK; a hole (found by
    SEEK_DATA, where the filesystem tells) is never read: ``ZERO`` or a slice of it stands for
    it.  Stops early at the file's end."""
    if end - pos <= CHUNK:  # one read: no holes worth asking for (the common seal's hash)
        while pos < end:
            buf = os.pread(fd, end - pos, pos)
            if not buf:
                return
            yield buf
            pos += len(buf)
        return
    while pos < end:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            # ENXIO: nothing but a hole from pos to the end; otherwise no answer (read it)
            data = end if e.errno == errno.ENXIO else pos
        if data > pos:
            n = min(data, end) - pos
            while n:
                k = min(n, CHUNK)
                yield ZERO if k == CHUNK else ZERO[:k]
                n -= k
                pos += k
            continue
        try:
            stop = min(os.lseek(fd, pos, os.SEEK_HOLE), end)
        except OSError:
            stop = end
        if stop <= pos:
            stop = end
        while pos < stop:
            buf = os.pread(fd, min(CHUNK, stop - pos), pos)
            if not buf:
                return
            yield buf
            pos += len(buf)


class RecordContent:
    """The record's content, wherever a blob is kept: a small one (at most INLINE_BLOB bytes)
    in the journal's ``blobs`` table, committed with the event that names it (a pre-image of a
    small file then costs no file create, write and rename in the state dir: the most common
    pre-image, the file a formatter or ``sed -i`` renames over, is a small one); a larger one as
    a file of the store.  A digest is the same name either way, and ``get`` checks the bytes
    against it wherever they came from."""

    def __init__(self, files: ContentStore, journal):
        self.files = files
        self.root = files.root
        self._j = journal

    def put_bytes(self, data: bytes) -> str:
        if len(data) > INLINE_BLOB or self._j.readonly:
            return self.files.put_bytes(data)
        digest = xxhash.xxh3_128_hexdigest(data)
        self._j.hold_blob(digest, bytes(data))
        return digest

    def put_range(self, src_fd: int, offset: int, length: int) -> str:
        """Store [offset, offset+length) of an open file; returns the digest."""
        if length > INLINE_BLOB or self._j.readonly:
            return self.files.put_range(src_fd, offset, length)
        data = os.pread(src_fd, length, offset)
        while len(data) < length:  # a short read: more may follow (a file shrunk: what is there)
            more = os.pread(src_fd, length - len(data), offset + len(data))
            if not more:
                break
            data += more
        return self.put_bytes(data)

    def put_chunks(self, pieces) -> str:
        return self.files.put_chunks(pieces)

    def get(self, digest: str, verify: bool = True) -> bytes:
        """The blob's bytes, checked against its name (BlobError when they do not match);
        FileNotFoundError when neither the journal nor the store has it."""
        data = self._j.blob(digest)
        if data is None:
            return self.files.get(digest, verify)
        if verify and xxhash.xxh3_128_hexdigest(data) != digest:
            raise BlobError(f"blob {digest} in the journal of {os.path.dirname(self.root)} does "
                            "not match its hash (changed on disk): refusing to use it")
        return bytes(data)

    def has(self, digest: str) -> bool:
        return self._j.blob(digest) is not None or self.files.has(digest)

    def sweep(self, keep, before_ns: int, only=None) -> tuple[int, int]:
        """The file store's sweep (ContentStore.sweep), then the journal's small blobs not in
        ``keep``; (count, bytes) removed, both together."""
        n, size = self.files.sweep(keep, before_ns, only)
        m, b = self._j.sweep_blobs(keep, only)
        return n + m, size + b

    def __getattr__(self, name):  # blobs(), clean(), path(): the file store's own
        return getattr(self.files, name)
