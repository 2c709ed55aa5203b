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
version it does not know, a truncated file, a split index whose shared part cannot be read)
is not a refresh.  The format: git's Documentation/gitformat-index.txt.

A split index (``core.splitIndex``) keeps most entries in a shared index file
(``sharedindex.<hash>`` beside it, never rewritten: named by its hash) and in itself the
entries that replace, delete or add to them, a ``link`` extension saying which.  A refresh
moves entries whose stat changed into the split part, so two split indexes are compared by
the entries they mean together with their shared file (``shared``: how to read it), as git
reads them (split-index.c): the split part's first entries replace the shared entries its
replace bitmap marks, taking their names; the rest are added.  Compared raw, a `git status`
after a `git add` made the add's revert a conflict (found by a bug hunt).
"""
from __future__ import annotations

import hashlib
import struct
from typing import Callable

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


def refreshed(path: str, a, b, shared: Callable[[str], bytes | None] | None = None) -> bool:
    """Do ``a`` and ``b`` (a path's two contents, bytes) differ only in what git refreshes by
    itself, ``path`` being a git index?  ``shared``: the content of a workspace path (a
    split index's shared file), None where it cannot be read."""
    if not (isinstance(a, bytes) and isinstance(b, bytes)) or not is_index(path):
        return False
    if a == b:
        return True
    ka, kb = _known_meaning(path, a, shared), _known_meaning(path, b, shared)
    return ka is not None and ka == kb


_READ: dict[bytes, tuple | None] = {}  # content hash -> _meaning, for the last few indexes read


def _known_meaning(path: str, data: bytes, shared) -> tuple | None:
    """``_meaning``, read once per content: a revert asks of each refresh between two of its
    writes, and each refresh's index is the next one's before (100,000 entries: 0.1 s a read).
    A split index's meaning depends on its shared file, named by its hash, so the same
    content means the same; one whose shared file could not be read is not kept."""
    key = xxhash.xxh3_128_digest(data)
    if key not in _READ:
        got = _meaning(path, data, shared)
        if got is None and b"link" in data:
            return None
        if len(_READ) >= 8:
            _READ.pop(next(iter(_READ)))
        _READ[key] = got
    return _READ[key]


def _meaning(path: str, data: bytes, shared) -> tuple | None:
    """What an index says, without its caches: its version, each entry's mode, object id,
    flags (without the name's length) and path, and the extensions that are not caches.
    None: not an index this reads for certain."""
    for hash_len in _hash_lengths(data):
        try:
            version, entries, kept, link = _parse(data, hash_len)
        except (ValueError, IndexError, struct.error):
            continue
        if link is None:
            return version, tuple(_plain(entries)), kept
        try:
            return version, tuple(_merged(path, entries, link, hash_len, shared)), kept
        except (ValueError, IndexError, struct.error):
            return None
    return None


def _plain(entries):
    """Entries as compared: the flags' stage and bits, not the name's length (a split
    index's replacing entry keeps no name, so none of its own length)."""
    return [(mode, oid, flags & 0xF000, extended, name)
            for mode, oid, flags, extended, name in entries]


def _merged(path: str, entries: list, link: bytes, hash_len: int, shared) -> list:
    """A split index's entries merged with its shared file's, as git merges them."""
    base_hash = link[:hash_len]
    if len(base_hash) != hash_len:
        raise ValueError("a link extension shorter than its hash")
    if not base_hash.strip(b"\0"):  # no shared file: every entry is here
        return sorted(_plain(entries), key=lambda e: (e[4], e[2] & 0x3000))
    if shared is None:
        raise ValueError("a split index's shared file cannot be read")
    name = path.rpartition("/")[0] + "/sharedindex." + base_hash.hex()
    data = shared(name)
    if data is None:
        raise ValueError("a split index's shared file is gone")
    _v, base, _kept, base_link = _parse(data, hash_len)
    if base_link is not None:
        raise ValueError("a shared index that links again")
    at = hash_len
    deleted: set[int] = set()
    replaced: list[int] = []
    if at < len(link):
        deleted, at = _ewah(link, at)
        replaced_set, at = _ewah(link, at)
        replaced = sorted(replaced_set)
    if len(replaced) > len(entries) or any(i >= len(base) for i in deleted):
        raise ValueError("a bitmap past the entries")
    out = {}
    for i, (mode, oid, flags, extended, nm) in enumerate(base):
        if i not in deleted:
            out[i] = (mode, oid, flags & 0xF000, extended, nm)
    for k, i in enumerate(replaced):
        if i >= len(base):
            raise ValueError("a replaced entry past the shared ones")
        mode, oid, flags, extended, _nm = entries[k]
        out[i] = (mode, oid, flags & 0xF000, extended, base[i][4])
    merged = list(out.values()) + _plain(entries[len(replaced):])
    return sorted(merged, key=lambda e: (e[4], e[2] & 0x3000))


def _ewah(data: bytes, at: int) -> tuple[set[int], int]:
    """An EWAH bitmap (git's ewah/ewah_io.c) at ``at``: its set bits, and where it ends.
    Words are runs (bit 0: the run's bit, bits 1-32: its length in words, bits 33-63: the
    literal words that follow) and literal words."""
    bits, nwords = struct.unpack_from(">LL", data, at)
    at += 8
    words = struct.unpack_from(f">{nwords}Q", data, at)
    at += 8 * nwords + 4  # the words, then the last run's position
    out: set[int] = set()
    pos = 0  # in bits
    k = 0
    while k < nwords:
        rlw = words[k]
        k += 1
        run_bit, run_len, literals = rlw & 1, (rlw >> 1) & 0xFFFFFFFF, rlw >> 33
        if run_bit:
            out.update(range(pos, pos + 64 * run_len))
        pos += 64 * run_len
        for _ in range(literals):
            if k >= nwords:
                raise ValueError("an EWAH bitmap past its words")
            w = words[k]
            k += 1
            out.update(pos + b for b in range(64) if w >> b & 1)
            pos += 64
    return {b for b in out if b < bits}, at


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
    link = None
    while at < end:
        sig = data[at:at + 4]
        (size,) = struct.unpack_from(">L", data, at + 4)
        body = data[at + 8:at + 8 + size]
        if len(body) != size:
            raise ValueError("an extension past the end")
        if sig == b"link":
            link = body
        elif sig not in _CACHES:
            kept.append((sig, body))
        at += 8 + size
    if at != end:
        raise ValueError("extensions overrun the checksum")
    return version, entries, tuple(kept), link


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
