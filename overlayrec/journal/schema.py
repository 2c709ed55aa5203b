"""The canonical description of the journal's on-disk format.  Every key and value layout of the
LMDB environment is defined here and nowhere else; ``FORMAT_VERSION`` is checked at open.

State dir layout::

    <state>/journal/        LMDB environment (data.mdb, lock.mdb)
    <state>/content/aa/bb...  content store: blobs named by xxh3-128 hex, deduplicated
    <state>/daemon.log      the daemon's log
    <state>/daemon.json     the running daemon: pid, workspace, mountpoint, started

Sub-databases of the LMDB environment:

``meta``      ascii key -> utf-8 value.  ``format`` (FORMAT_VERSION as decimal), ``workspace``
              (absolute path), ``created`` (ns since epoch), ``next_seq`` (decimal; the next
              event sequence number).
``events``    seq (8-byte big-endian) -> event JSON (compact, utf-8).  An event is::

                {"seq": int, "t": ns, "op": str, "path": str, ["path2": str,]
                 "actor": actor-key, ["unit": unit-key,] ["epoch": true,]
                 ["candidates": [unit-key, ...],] ["after_end": true,]
                 ["pre": pre-image,] ["pre2": pre-image,] [op-specific fields]}

              ``op`` is one of OPS.  A unit key is ``call:<session>:<id>``, ``turn:<session>:<n>``
              (the agent's own writes outside any call), ``session:<session>``, or
              ``outside:<actor-key>`` (a process that does not descend from any agent), or
              ``revert:<id>`` (the changes a revert made).
              ``candidates`` lists every call that was active when the agent opened the file, when
              there were several; ``after_end`` marks a write by a call's process after the call
              ended.  Control events (``session_begin`` ...) carry ``session`` and the record.  ``epoch`` marks the first change of ``path`` by ``unit`` in a
              run: its ``pre`` is the pre-image of that epoch.  ``pre2`` is the pre-image of
              ``path2`` (a rename's target).  A later event may only add facets to an epoch's
              pre-image (``pre`` with ``"facet"``).  ``failed`` events name a seq whose operation
              the underlay refused after the event was written (the write-ahead order).
              ``seal`` events change nothing: their ``pre`` is what the path held when an epoch
              ended (a unit's end, unmount), with ``hash`` (and ``blob`` where the content was
              kept).  The chain of a path ends at its last seal, not at the live tree.
              ``drift`` events are changes found at mount by comparing the live tree with the
              seals (made while unmounted, or around the mount): unit ``outside:unmounted``,
              ``pre`` the seal they depart from.
``actors``    actor-key (``"<pid>:<start-ticks>"``) -> actor JSON
              ``{"pid","start","ppid","uid","exe","argv","cwd","first_seen"}``.
``paths``     path utf-8 + b"\\0" + seq (8-byte big-endian) -> b"" : every event by path, for
              ``log --path`` and blame without a scan.
``sessions``  session id utf-8 -> JSON ``{"id","agent","agent_pid","runner","started","ended",
              "aliases": [...]}`` (``agent``: the actor key of the agent process).
``turns``     session id + b"\0" + index (4-byte big-endian) -> JSON ``{"session","index",
              "prompt","begin_t","end_t","begin_seq","end_seq"}``.
``calls``     session id + b"\0" + call id -> JSON ``{"session","id","tool","summary","turn",
              "begin_t","end_t","status","begin_seq","end_seq","implicit"}``.
``renames``   seq (8-byte big-endian) -> JSON ``{"src","dst","flags"}``: every rename whose source
              (or, for an exchange, either side) was a directory.  Path history: every path
              beneath moved with it, though the event names only the directory.  Indexed as
              the event is appended; a journal written before this index is indexed at its next
              writable open (meta ``renames_indexed``), and read-only readers scan.
``seals``     seal_key(path) -> seq (8-byte big-endian) of the latest ``seal`` event of that path,
              followed by the path (utf-8).  The key is the path itself when it fits an LMDB
              key, else ``b"\xff"`` + its xxh3-128 digest.
``extents``   seq -> JSON ``{"writes": n, "bytes": n, "lo": off, "hi": end}``: what the writes after
              an epoch's first write did, summarised at release (not write-ahead: no pre-image in it).

Pre-image JSON (``pre``)::

    {"kind": "absent"}
    {"kind": "file", "mode", "uid", "gid", "mtime_ns", "size", "nlink",
        ["blob": hex]             whole content, in the content store
        ["ranges": [[off, len, hex], ...]]  only the ranges about to be overwritten or cut
        ["attic": name]           the old inode itself, hard-linked in the attic
        ["xattrs": {name: hex}]
        ["ino": n]                the inode number then (hard-link groups at one point)
        ["hash": hex]}            seals: xxh3-128 of the content (whenever it was read)
    {"kind": "dir", "mode", "uid", "gid", "mtime_ns"}
    {"kind": "symlink", "target", "uid", "gid", "mtime_ns"}
    {"kind": "fifo" | "socket" | "device", "mode", "uid", "gid", "rdev"}
    A ``"facet": "meta" | "content"`` key marks a partial pre-image that completes an earlier one.
"""
from __future__ import annotations

import struct

import xxhash

FORMAT_VERSION = 2

DBS = ("meta", "events", "actors", "paths", "extents", "sessions", "turns", "calls", "renames",
       "seals")

OPS = (
    "create", "mkdir", "mknod", "symlink", "link", "unlink", "rmdir", "rename",
    "write", "truncate", "chmod", "chown", "utimens", "setxattr", "removexattr", "failed",
    "unrecorded",
    "session_begin", "session_end", "turn_begin", "turn_end", "call_begin", "call_end",
    "revert_begin", "revert_end", "seal", "drift",
)
CONTROL_OPS = ("session_begin", "session_end", "turn_begin", "turn_end", "call_begin", "call_end",
               "revert_begin", "revert_end")
MARK_OPS = ("seal",)       # events that record a state and change nothing
UNMOUNTED = "unmounted"    # the actor key (and ``outside:`` unit) of changes made while unmounted


def is_dir_rename(ev: dict) -> bool:
    """Does this rename move a directory (so every path beneath it moves too)?"""
    return ev.get("op") == "rename" and (
        (ev.get("pre") or {}).get("kind") == "dir" or
        (bool(ev.get("flags", 0) & 2) and (ev.get("pre2") or {}).get("kind") == "dir"))

MAP_SIZE = 1 << 36  # 64 GiB of address space; the file grows only as used


class JournalError(Exception):
    """The journal cannot be opened or read: says why in one line."""


def seq_key(seq: int) -> bytes:
    return struct.pack(">Q", seq)


def key_seq(key: bytes) -> int:
    return struct.unpack(">Q", key)[0]


def path_key(path: str, seq: int) -> bytes:
    return path.encode("utf-8", "surrogateescape") + b"\0" + seq_key(seq)


def turn_key(session: str, index: int) -> bytes:
    return session.encode() + b"\0" + struct.pack(">I", index)


def call_key(session: str, call_id: str) -> bytes:
    return session.encode() + b"\0" + call_id.encode("utf-8", "surrogateescape")


MAX_KEY = 500  # LMDB's default key limit is 511 bytes


def seal_key(path: str) -> bytes:
    raw = path.encode("utf-8", "surrogateescape")
    if len(raw) <= MAX_KEY:
        return raw
    return b"\xff" + xxhash.xxh3_128_digest(raw)


def path_key_split(key: bytes) -> tuple[str, int]:
    return key[:-9].decode("utf-8", "surrogateescape"), key_seq(key[-8:])
