"""The content store: blobs named by their xxh3-128 digest, one file each, deduplicated.

A blob is written to a temp file, hashed as it is written, then renamed to its name; a crash
leaves at worst a stray temp file, never a blob whose name does not match its bytes.
"""
from __future__ import annotations

import os

import xxhash

CHUNK = 1 << 20


class ContentStore:
    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)
        self._tmp = os.path.join(root, "tmp")
        os.makedirs(self._tmp, exist_ok=True)
        self._n = 0

    def path(self, digest: str) -> str:
        return os.path.join(self.root, digest[:2], digest[2:])

    def has(self, digest: str) -> bool:
        return os.path.exists(self.path(digest))

    def put_bytes(self, data: bytes) -> str:
        digest = xxhash.xxh3_128_hexdigest(data)
        if not self.has(digest):
            self._commit(digest, lambda fd: os.write(fd, data))
        return digest

    def put_range(self, src_fd: int, offset: int, length: int) -> str:
        """Store [offset, offset+length) of an open file; returns the digest."""
        h = xxhash.xxh3_128()
        chunks = []
        pos, end = offset, offset + length
        while pos < end:
            buf = os.pread(src_fd, min(CHUNK, end - pos), pos)
            if not buf:
                break
            h.update(buf)
            chunks.append(buf)
            pos += len(buf)
        digest = h.hexdigest()
        if not self.has(digest):
            def write(fd):
                for c in chunks:
                    os.write(fd, c)
            self._commit(digest, write)
        return digest

    def _commit(self, digest: str, writer) -> None:
        self._n += 1
        tmp = os.path.join(self._tmp, f"{os.getpid()}.{self._n}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            writer(fd)
        finally:
            os.close(fd)
        final = self.path(digest)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        os.rename(tmp, final)

    def get(self, digest: str) -> bytes:
        with open(self.path(digest), "rb") as f:
            return f.read()
