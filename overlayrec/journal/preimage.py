"""Pre-images and seals: the one stored form of "what a path held", written by the recorder and
read by every engine.

A pre-image (``pre`` of an event) and a seal (``pre`` of a ``seal`` event) share one JSON
layout, documented in ``schema``: ``kind`` plus ``mode``/``uid``/``gid``/``mtime_ns`` and the
kind's own facts (a file's ``size``, ``nlink``, ``ino`` and content by ``blob``, ``ranges`` or
``attic``; a symlink's ``target``; a device's ``rdev``).  ``from_stat`` builds the metadata part
from an lstat, and ``matches`` answers whether a live object still holds what a seal recorded:
stat first, the content hash only when size or mtime differ (git's own rule for its index).
"""
from __future__ import annotations

import os
import stat

import xxhash

from .content import chunks
from ..underlay import kind_of  # noqa: F401  (re-exported: a kind is a stored word)

KINDS = ("absent", "file", "dir", "symlink", "fifo", "socket", "device")
ABSENT = {"kind": "absent"}


def from_stat(st: os.stat_result, nlink: int | None = None) -> dict:
    """The metadata of a pre-image or seal (no content, no symlink target)."""
    kind = kind_of(st.st_mode)
    pre = {"kind": kind, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
           "mtime_ns": st.st_mtime_ns}
    if kind == "file":
        pre["size"] = st.st_size
        pre["nlink"] = st.st_nlink if nlink is None else nlink
        pre["ino"] = st.st_ino
    elif kind == "device":
        pre["rdev"] = st.st_rdev
        if stat.S_ISBLK(st.st_mode):
            pre["block"] = True
    return pre


def content_hash(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def hash_fd(fd: int) -> str:
    """The content hash of an open file, read in chunks (its holes not read)."""
    h = xxhash.xxh3_128()
    for buf in chunks(fd, 0, os.fstat(fd).st_size):
        h.update(buf)
    return h.hexdigest()


def matches(seal: dict, st: os.stat_result | None, target=None, digest=None) -> bool:
    """Does the live object (its lstat ``st``, None when absent) still hold what ``seal`` says?

    ``target()`` reads a symlink's target and ``digest()`` a file's content hash; each is called
    only when the stat cannot settle it.  Times, link counts and inode numbers do not count: a
    path that holds the same kind, mode, owner and content is the same."""
    if st is None:
        return seal["kind"] == "absent"
    kind = kind_of(st.st_mode)
    if kind != seal["kind"]:
        return False
    if kind != "symlink" and seal.get("mode") is not None and \
            stat.S_IMODE(st.st_mode) != seal["mode"]:
        return False
    if seal.get("uid") is not None and (st.st_uid, st.st_gid) != (seal["uid"], seal.get("gid")):
        return False
    if kind == "symlink":
        return target is None or seal.get("target") is None or target() == seal["target"]
    if kind == "device":
        return st.st_rdev == seal.get("rdev")
    if kind != "file":
        return True
    if st.st_size == seal.get("size") and st.st_mtime_ns == seal.get("mtime_ns"):
        # an edit that kept the size and put the mtime back (cp -p, touch -r, tar) still moved
        # the ctime, which no caller can set: the content says where the seal has its hash
        if seal.get("ctime_ns") in (None, st.st_ctime_ns):
            return True
        if seal.get("hash") is not None and digest is not None:
            return digest() == seal["hash"]
        # no hash (a file past the whole-file limit, a withheld one): another inode, or the
        # same one with the ctime moved by nothing the stat explains, may hold anything; a
        # link made or removed (the link count moved) moves the ctime too, and is taken for
        # that alone.  The count as a stat beneath the mount sees it: the attic's links too
        # (``links``, where the seal's ``nlink`` left them out)
        if seal.get("ino") not in (None, st.st_ino):
            return False
        return seal.get("links", seal.get("nlink")) not in (None, st.st_nlink)
    if seal.get("hash") is None or digest is None or st.st_size != seal.get("size"):
        return False
    return digest() == seal["hash"]


def naming_entry(ev: dict | None, name: str) -> dict | None:
    """The pre-image of event ``ev`` kept by attic entry ``name`` (an unlink's, or a rename's
    of the file it renamed over), or None."""
    for which in ("pre", "pre2"):
        pre = (ev or {}).get(which)
        if isinstance(pre, dict) and pre.get("attic") == name:
            return pre
    return None
