"""A git index read for what it says, not for the stat data it caches.

Every `git status` (an agent's, an editor's git panel polling every few seconds) rewrites
`.git/index` when a file's stat changed since the index was written: the entries' cached
ctime, mtime, inode and size, and the caches among its extensions (the cache tree, the
untracked cache).  The staged content, each entry's path, mode, object id and stage, is
unchanged.  A revert compares a path with what the reverted changes left, so a git repository
in the workspace made every revert of a call that committed, and every unrevert after a
`git status`, a ``changed`` conflict on `.git/index` whose only change was git's refresh.

``refreshed(path, a, b)`` says whether two contents of a git index differ only in what git
refreshes by itself: then neither holds anything the other lacks, and putting one back in the
other's place loses nothing (git refreshes it again).  Anything it cannot read for certain (a
version it does not know, a truncated file, a split index whose shared part differs) is not a
refresh.  The format: git's Documentation/gitformat-index.txt.
"""
from __future__ import annotations

import hashlib
import struct

import xxhash

# extensions that cache what git can compute again from the entries and the work tree
_CACHES = {b"TREE", b"UNTR", b"FSMN", b"EOIE", b"IEOT"}
_STAT = 40  # ctime, mtime (seconds, nanoseconds), dev, ino, mode, uid, gid, size: 4 bytes each
_MODE_AT = 24  # the entry's mode, within the stat data: the one field of it that is content


def is_index(path: str) -> bool:
    """Is ``path`` (workspace-relative) a git index: `.git/index` of the workspace's own
    repository or of one beneath it, or a linked worktree's or a submodule's index kept in
    the repository's git directory."""
    parts = path.split("/")
    if len(parts) < 2 or parts[-1] != "index":
        return False
    if parts[-2] == ".git":
        return True
    # .git/worktrees/NAME/index, .git/modules/NAME[/modules/NAME...]/index
    return ".git" in parts[:-3] and parts[-3] in ("worktrees", "modules")


def refreshed(path: str, a, b) -> bool:
    """Do ``a`` and ``b`` (a path's two contents, bytes) differ only in what git refreshes by
    itself, ``path`` being a git index?"""
    if not (isinstance(a, bytes) and isinstance(b, bytes)) or not is_index(path):
        return False
    if a == b:
        return True
    ka, kb = _known_meaning(a), _known_meaning(b)
    return ka is not None and ka == kb


_READ: dict[bytes, tuple | None] = {}  # content hash -> _meaning, for the last few indexes read


def _known_meaning(data: bytes) -> tuple | None:
    """``_meaning``, read once per content: a revert asks of each refresh between two of its
    writes, and each refresh's index is the next one's before (100,000 entries: 0.1 s a read)."""
    key = xxhash.xxh3_128_digest(data)
    if key not in _READ:
        if len(_READ) >= 8:
            _READ.pop(next(iter(_READ)))
        _READ[key] = _meaning(data)
    return _READ[key]


def _meaning(data: bytes) -> tuple | None:
    """What an index says, without its caches: its version, each entry's mode, object id,
    flags and path, and the extensions that are not caches.  None: not an index this reads
    for certain."""
    for hash_len in _hash_lengths(data):
        try:
            return _parse(data, hash_len)
        except (ValueError, IndexError, struct.error):
            continue
    return None


def _hash_lengths(data: bytes) -> tuple[int, ...]:
    """SHA-1 or SHA-256 (the repository's object format, which the index does not name): the
    trailing checksum says which, unless git wrote none (``index.skipHash``: zeros)."""
    if len(data) > 20 and hashlib.sha1(data[:-20]).digest() == data[-20:]:
        return (20,)
    if len(data) > 32 and hashlib.sha256(data[:-32]).digest() == data[-32:]:
        return (32,)
    return (20, 32)


def _parse(data: bytes, hash_len: int) -> tuple:
    sig, version, count = struct.unpack_from(">4sLL", data, 0)
    if sig != b"DIRC" or version not in (2, 3, 4):
        raise ValueError("not a git index")
    end = len(data) - hash_len
    at = 12
    entries = []
    name = b""
    fixed = _STAT + hash_len + 2
    for _ in range(count):
        start = at
        mode = data[at + _MODE_AT:at + _MODE_AT + 4]
        oid = data[at + _STAT:at + _STAT + hash_len]
        (flags,) = struct.unpack_from(">H", data, at + _STAT + hash_len)
        at += fixed
        extended = b""
        if flags & 0x4000:
            if version < 3:
                raise ValueError("an extended entry in a version 2 index")
            extended = data[at:at + 2]
            at += 2
        if version == 4:
            strip, at = _varint(data, at)
            nul = data.index(b"\0", at, end)
            if strip > len(name):
                raise ValueError("a path stripped past its start")
            name = name[:len(name) - strip] + data[at:nul]
            at = nul + 1
        else:
            nul = data.index(b"\0", at, end)
            name = data[at:nul]
            # padded with one to eight NULs to a multiple of eight bytes from the entry's start
            at = start + ((nul - start + 8) & ~7)
            if data[nul:at].strip(b"\0"):
                raise ValueError("an entry's padding holds data")
        if at > end:
            raise ValueError("an entry past the end")
        entries.append((mode, oid, flags, extended, name))
    kept = []
    while at < end:
        sig = data[at:at + 4]
        (size,) = struct.unpack_from(">L", data, at + 4)
        body = data[at + 8:at + 8 + size]
        if len(body) != size:
            raise ValueError("an extension past the end")
        if sig not in _CACHES:
            kept.append((sig, body))
        at += 8 + size
    if at != end:
        raise ValueError("extensions overrun the checksum")
    return version, tuple(entries), tuple(kept)


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """git's offset varint (varint.c): each further byte adds one before shifting."""
    byte = data[at]
    at += 1
    value = byte & 0x7F
    while byte & 0x80:
        byte = data[at]
        at += 1
        value = ((value + 1) << 7) | (byte & 0x7F)
    return value, at
