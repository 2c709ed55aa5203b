"""The canonical description of the journal's on-disk format.  Every key and value layout of the
LMDB environment is defined here and nowhere else; ``FORMAT_VERSION`` is checked at open.

Every file and directory overlayrec keeps (the state dir around ``journal/``: the content
store, the control socket, daemon.json and daemon.log, revert plans, export stores; the
registry; the attic), with its role, mode and owner, is listed in docs/storage.md; the names
are made in ``overlayrec.state.StateDir``.  This module describes what is inside ``journal/``.

Sub-databases of the LMDB environment:

``meta``      ascii key -> utf-8 value.  ``format`` (FORMAT_VERSION as decimal), ``workspace``
              (absolute path), ``created`` (ns since epoch), ``next_seq`` (decimal; the next
              event sequence number), ``journal_id`` (random hex, set at the first mount: the
              journal's attic entries are named ``<journal_id>.<seq>``), ``secrets`` (JSON list
              of the secret-path patterns the mount applied, stored at mount; absent: the
              defaults of ``overlayrec.secrets``), ``secrets_checked`` (JSON list of the
              content-checked ones: a file they match is withheld unless it holds public PEM
              blocks only; absent with ``secrets`` present: none), ``secret_names`` (JSON list of paths a
              rename or hard link carried a secret's content to: withheld like the patterns,
              each with everything beneath it, for the rest of the record).
              Retention (``overlayrec.retention``, docs/retention.md): ``dropped_before``
              (decimal seq C: every event before C was dropped by a gc and is gone to every
              reader, whatever step 2 has deleted yet; only the latest seal of a path, the one
              ``seals`` points at, is kept below C), ``gc`` (JSON ``{"cut", "step", "t"}``: a gc
              between its cut (step 1) and its end; step 2 deletes below the cut, step 3 sweeps
              the content store and the attic; the next gc, or the daemon at mount, finishes
              it), ``gc_last`` (JSON: what the last gc did).
``events``    seq (8-byte big-endian) -> event JSON (compact, utf-8).  An event is::

                {"seq": int, "t": ns, "op": str, "path": str, ["path2": str,]
                 "actor": actor-key, ["unit": unit-key,] ["epoch": true,]
                 ["candidates": [unit-key, ...], "chosen": str,] ["after_end": true,]
                 ["pre": pre-image,] ["pre2": pre-image,] [op-specific fields]}

              ``op`` is one of OPS.  A unit key is ``call:<session>:<id>``, ``turn:<session>:<n>``
              (the agent's own writes outside any call), ``session:<session>``, or
              ``outside:<actor-key>`` (a process that does not descend from any agent), or
              ``revert:<id>`` (the changes a revert made); made and read only by the unit
              functions below (``call_unit`` ... ``parse_unit``): a session id may hold ``:``,
              so a call's id, the part after the key's last ``:``, is written with ``:`` and
              ``%`` escaped (``%3A``, ``%25``).
              ``candidates`` lists every call that was active when the agent opened the file, or
              when the agent's child at the top of the writer's line was started, when there
              were several; ``chosen`` says how ``unit`` was chosen among them
              (``calls.Calls._choose``): ``command`` (the child's argv carries the call's
              summary), ``path`` (the call's summary names the agent's file), ``newest`` (no
              evidence: the call begun last), ``during`` (a process the agent started outside
              any call, such as a persistent shell, wrote while the call ran: ``candidates``
              are the calls active then, one or more); absent in events written before it
              existed (the first candidate then).  ``after_end`` marks a write by a call's process after the
              call ended.  Control events (``session_begin`` ...) carry ``session`` and the record.  ``epoch`` marks the first change of ``path`` by ``unit`` in a
              run: its ``pre`` is the pre-image of that epoch.  ``pre2`` is the pre-image of
              ``path2`` (a rename's target).  A later event may only add facets to an epoch's
              pre-image (``pre`` with ``"facet"``).  ``failed`` events name a seq whose operation
              the underlay refused after the event was written (the write-ahead order).
              A ``create`` of a file it made anew, opened for writing, carries ``run``
              (true): its handle's first writes join it, with no ``write`` event, and its
              extents note counts them from 0 (docs/design.md); so does the ``truncate`` of
              an O_TRUNC open for writing of a file with one name.
              A ``setxattr`` of ``system.posix_acl_access`` carries ``mode``: the mode the ACL
              leaves (its permission bits come from the ACL; null for a value the kernel
              refuses); one written before that field existed replays forward inexact.
              ``seal`` events change nothing: their ``pre`` is what the path held when an epoch
              ended (a unit's end, unmount), with ``hash`` (and ``blob`` where the content was
              kept).  The chain of a path ends at its last seal, not at the live tree.
              ``"closing": true`` on a seal of every unit (an unmount's, the mount's after a
              killed daemon): no descriptor of the mount outlives it, so a write run ends there.
              ``"beneath": true`` on such a seal of a directory renamed in that mount: every
              path beneath it was sealed too, so a name beneath with no event of its own was
              not there (a directory's rename journals no path beneath it); ``false`` where
              the walk, or a seal beneath it, failed (the live tree says).  A later seal of
              the directory after changes of its metadata only carries the mark on
              (``beneath_rule``).
              ``alias`` events: a change through one name of an inode with several links,
              journaled on each other name the daemon knows (``source``: the name written); one
              without ``source`` whose pre-image is ``unkept``: a name of a file linked outside
              the mount, found after another name's change in its open epoch.
              ``drift`` events are changes found at mount by comparing the live tree with the
              seals (made while unmounted, or around the mount): unit ``outside:unmounted``,
              ``pre`` the seal they depart from.  Or found at a seal: a file whose ctime is
              later than the daemon's last change to it was changed around the mount while
              its unit went on: unit ``outside:around``, ``pre`` its kind, mode and owner with
              ``"unkept": true`` (what the unit left is not known); the seal follows.  Or
              a file the daemon left there that the seal finds absent (removed around the
              mount): ``pre`` ``{"kind": "file", "unkept": true}``.
              ``reclaim`` events change no path (they have none): the workspace's filesystem
              refused a change for want of space, so the daemon dropped attic entries to free
              it, journaled ahead of the drop (or, when the journal itself was full, with the
              next event).  ``{"op": "reclaim", "actor": "overlayrec", "cause": "ENOSPC",
              "during": recorder operation, "dropped": [attic entry name, ...], "bytes": n}``
              (``bytes``: the blocks the drop frees).  A pre-image naming a dropped entry has
              no content any more: readers give an inexact state for it, and a revert that
              needs it is refused (``unrecorded``).
``actors``    actor-key (``"<pid>:<start-ticks>"``) -> actor JSON
              ``{"pid","start","ppid","uid","exe","argv","cwd","first_seen",["line"]}``.
              ``line``: ``{"unit", "boot", ["candidates", "chosen"]}``, the unit of a process
              of a call's line (the call that started it; the session's own for a survivor of
              a line no call started), fixed for its life: written with its first event, or at
              its session's end for a survivor that had not written (``Calls._place_survivors``).
              A later mount places it, and what it starts, by it where /proc leads to no
              session (``Calls._held_unit``); ``boot`` is the boot id it was placed in (a pid
              and start tick may come again after a reboot: a row of another boot places
              nothing).  Absent for the agents, outside processes, and rows written before it.
``paths``     path_key(path, seq) -> path_value(path): every event by path, for ``log --path``
              and blame without a scan.  A path of at most PATH_KEY_MAX bytes is its own key:
              path utf-8 + b"\\0" + seq (8-byte big-endian) -> b"".  A longer one (up to the
              kernel's 4095 bytes) would not fit an LMDB key (511 bytes), so it is keyed by its
              digest and the path itself is the value: b"\\xff" + xxh3-128 digest (16 bytes) +
              b"\\0" + seq -> path utf-8; so is a path whose bytes begin with 0xff (never utf-8),
              so that no key of the first form begins with that byte.  Either way the keys of
              one path share a prefix (``path_prefix``) and its seqs follow in ascending order.
              Journals written before the digest form hold the first form only (any path of up
              to 502 bytes as its own key): readers look for both forms (``path_prefixes``)
              and tell them apart by the value.
``sessions``  session id utf-8 -> JSON ``{"id","agent","agent_pid","runner","started","ended",
              "aliases": [...]}`` (``agent``: the actor key of the agent process).
``turns``     session id + b"\0" + index (4-byte big-endian) -> JSON ``{"session","index",
              "prompt","begin_t","end_t","begin_seq","end_seq"}``, and ``taken_up``: the seqs
              of the ``turn_begin`` events (``again``) that took the turn up after a stop a
              stop hook blocked (its end is then the last stop's; ``Calls.take_up``).
``calls``     call_key(session, call id) -> JSON ``{"session","id","tool","summary","turn",
              "begin_t","end_t","status","begin_seq","end_seq","implicit"}``.
              A turn's ``prompt`` and a call's ``tool``, ``summary`` and ``status`` are strings
              or null; a record written before 2026-12-06 may hold other JSON there (the daemon
              took a request's as it came), which ``Journal.records`` reads as its JSON text.
              The key is session id + b"\0" + call id; a call id too long for an LMDB key
              (or beginning with byte 0xff) is replaced by b"\xff" + its xxh3-128 digest (the
              record holds the id; readers scan by the session's prefix).
              A session an earlier daemon left open (killed, or unmounted with it running) is
              ended by the next mount, before its drift: its ``call_end``, ``turn_end`` and
              ``session_end`` events carry ``as_of``, the seq of that daemon's last event, and
              the records' ``end_seq`` (and ``end_t``, the session's ``ended``) are that
              event's: the span ends where the daemon stopped recording (2026-12-08; before,
              at the events themselves).
``renames``   seq (8-byte big-endian) -> JSON ``{"src","dst","flags"}``: every rename whose source
              (or, for an exchange, either side) was a directory.  Path history: every path
              beneath moved with it, though the event names only the directory.  Indexed as
              the event is appended, and taken out again by the ``failed`` note of a rename the
              underlay refused (ENOTEMPTY, EXDEV, ...): nothing moved.  A journal indexed
              before that (meta ``renames_indexed`` other than RENAMES_INDEXED) is indexed again
              at its next writable open, and read-only readers scan.
``seals``     seal_key(path) -> seq (8-byte big-endian) of the latest ``seal`` event of that path,
              followed by the path (utf-8).  The key is the path itself when it fits an LMDB
              key (the workspace root's, "", is ``b"/"``), else ``b"\xff"`` + its xxh3-128
              digest.
``dropped``   session id utf-8 -> JSON ``{"id","dropped_t","why","begin_seq","end_seq",
              "started","ended","calls": [call id, ...],"turns": n}``: each session a gc
              dropped, written with the cut (step 1), so that a later request for it is refused
              with "dropped by retention on DATE" rather than "no such session".
``pins``      session id utf-8 -> JSON ``{"t": ns}``: sessions ``overlayrec pin`` keeps whatever
              the retention policy says.
``extents``   seq -> JSON ``{"writes": n, "bytes": n, "lo": off, "hi": end, "end": seq}``: what the
              writes through the handle of write event ``seq`` did (or of a ``create`` or a
              ``truncate`` with ``run``: then ``writes`` counts from 0), summarised at its
              release, or when such a run ended at another event on the path (not
              write-ahead: no pre-image in it); ``end``: the
              last seq handed out when the run's last write was made, so a reader knows no
              write of that run came after it (journals before 2026-12 have the last seq at
              release: later, never wrong).
``blobs``     digest (32 ascii hex digits) -> the blob's bytes: the content store's small blobs
              (at most ``INLINE_BLOB`` bytes), committed in the transaction of the event that
              first names them, so a small pre-image costs no file of its own.  A digest names
              the same bytes wherever they are kept; readers look here first, then in the
              content store's files, and check the bytes against the digest either way.

Pre-image JSON (``pre``)::

    {"kind": "absent"}
    {"kind": "file", "mode", "uid", "gid", "mtime_ns", "size", "nlink",
        ["blob": hex]             whole content, in the content store (``blobs`` or a file)
        ["ranges": [[off, len, hex], ...]]  only the ranges about to be overwritten or cut
                                  (the whole file past the whole-file limit, for one of
                                  another filesystem leaving its name: it has no attic)
        ["attic": name]           the old inode itself, hard-linked in the attic
        ["xattrs": {name: hex}]
        ["ino": n]                the inode number then (hard-link groups at one point)
        ["hash": hex]             seals: xxh3-128 of the content (whenever it was read)
        ["ctime_ns": n]           seals with a hash: the ctime then (an edit that keeps the
                                  size and puts the mtime back still moves it, and then
                                  the hash says whether the content is the same)
        ["links": n]              seals: the link count a stat beneath the mount sees, where
                                  it differs from ``nlink`` (which leaves the attic's links
                                  out); preimage.matches compares it with the live count
        ["unkept": true]          an ``alias`` whose inode's data changed at once through
                                  another name, and whose content was not kept (past the
                                  whole-file limit), or a file of another filesystem mounted
                                  in the workspace the daemon could not read as it left its
                                  name (no attic there): its state there is inexact
        ["withheld": true]}       a secret path (``overlayrec.secrets``): no blob, ranges,
                                  attic, data or hash, ever.  No hash on purpose: xxh3 is
                                  fast, and a short secret (a token, a password) is found
                                  from its hash by brute force; size and mtime are kept, so
                                  a changed secret still shows as drift at mount
    {"kind": "dir", "mode", "uid", "gid", "mtime_ns"}
    {"kind": "symlink", "target", "uid", "gid", "mtime_ns"}
    {"kind": "fifo" | "socket" | "device", "mode", "uid", "gid", "rdev"}
    A ``"facet": "meta" | "content"`` key marks a partial pre-image that completes an earlier one
    (a content facet of a secret path is ``{"facet": "content", "withheld": true}``).
"""
from __future__ import annotations

import errno as _errno
import struct

import xxhash

FORMAT_VERSION = 2

DBS = ("meta", "events", "actors", "paths", "extents", "sessions", "turns", "calls", "renames",
       "seals", "dropped", "pins", "blobs")
INLINE_BLOB = 64 << 10  # blobs up to this size are kept in ``blobs``, larger ones as files

OPS = (
    "create", "mkdir", "mknod", "symlink", "link", "unlink", "rmdir", "rename",
    "write", "truncate", "chmod", "chown", "utimens", "setxattr", "removexattr", "failed",
    "unrecorded",
    "session_begin", "session_end", "turn_begin", "turn_end", "call_begin", "call_end",
    "revert_begin", "revert_end", "seal", "drift", "alias", "reclaim",
)
CONTROL_OPS = ("session_begin", "session_end", "turn_begin", "turn_end", "call_begin", "call_end",
               "revert_begin", "revert_end")
MARK_OPS = ("seal", "reclaim")  # events that record a state or a drop and change no path
META_OPS = ("chmod", "chown", "utimens", "setxattr", "removexattr")  # a path's metadata only


def beneath_rule(history) -> bool | str:
    """What a directory's own history says of the names beneath it that have no event of
    their own.  ``history``: (event, the name it was on then), newest first.  True: its last
    mark (``beneath``) says everything beneath it was sealed, so such a name was not there;
    False: the live tree says (a mark of false: a walk or a seal beneath it failed; or it
    came here by a rename, with what it holds, before any walk); "up": its history says
    nothing (no event, or it was made anew), the directories above it say.  Its seals
    without a mark, its metadata's changes and a drift that leaves it a directory pass (what
    lies beneath is as known as it was).  The recorder (what it carries on and walks at
    mount) and the readers (engines.states) ask the same."""
    for e, name in history:
        op = e["op"]
        if op == "seal":
            if "beneath" in e:
                return bool(e["beneath"])
        elif op in META_OPS or op == "drift" and (e.get("pre") or {}).get("kind") == "dir":
            continue
        elif op == "rename" and (e.get("path2") == name or
                                 e.get("flags", 0) & 2 and e.get("path") == name):
            return False
        else:
            return "up"
    return "up"


UNMOUNTED = "unmounted"    # the actor key (and ``outside:`` unit) of changes made while unmounted
AROUND = "around"  # ... of changes made around the mount while a unit went on (Recorder.seal)


# -- unit keys: the one place they are spelled and read -------------------------------------
# A session id may hold ':' (``--session fix:10:30``), and so may a call's id: the call's id is
# the part after the key's last ':', written with ':' and '%' escaped; a turn's index is a
# number.  (Keys written before the escaping read the same unless a call's id held ':' or '%'.)

def _escaped(call_id: str) -> str:
    if ":" not in call_id and "%" not in call_id:
        return call_id
    return call_id.replace("%", "%25").replace(":", "%3A")


def call_unit(session: str, call_id: str) -> str:
    return f"call:{session}:{_escaped(call_id)}"


def turn_unit(session: str, index: int) -> str:
    return f"turn:{session}:{index}"


def session_unit(session: str) -> str:
    """The agent's own writes outside any call and any turn."""
    return f"session:{session}"


def revert_unit(revert_id: str) -> str:
    return f"revert:{revert_id}"


def outside_unit(actor: str) -> str:
    """A process that descends from no agent (its actor key), or UNMOUNTED, AROUND."""
    return f"outside:{actor}"


class Unit(tuple):
    """A unit key read: ``kind`` (call, turn, session, revert, outside), ``session`` (None for
    a revert or an outside actor), ``id`` (a call's id, a turn's index as text, a revert's id,
    an actor key; None for a session's own unit)."""
    __slots__ = ()
    kind = property(lambda self: self[0])
    session = property(lambda self: self[1])
    id = property(lambda self: self[2])


def parse_unit(unit: str | None) -> Unit | None:
    """The parts of a unit key (None for no unit)."""
    if not unit:
        return None
    kind, _, rest = unit.partition(":")
    if kind in ("call", "turn"):
        session, _, ident = rest.rpartition(":")
        if kind == "call" and "%" in ident:
            ident = ident.replace("%3A", ":").replace("%25", "%")
        return Unit((kind, session, ident))
    if kind == "session":
        return Unit((kind, rest, None))
    return Unit((kind, None, rest))  # revert, outside (or a kind no reader knows)


def unit_kind(unit: str | None) -> str | None:
    """A unit key's kind: call, turn, session, revert, outside (None for no unit)."""
    return unit.partition(":")[0] if unit else None


def unit_session(unit: str | None) -> str | None:
    """The session a unit key belongs to (None for a revert, an outside actor, no unit)."""
    u = parse_unit(unit)
    return u[1] if u is not None else None


# meta ``renames_indexed``: "1" indexed every directory rename, refused ones too; "2" leaves
# out those a ``failed`` note voids
RENAMES_INDEXED = b"2"


def is_dir_rename(ev: dict) -> bool:
    """Does this rename move a directory (so every path beneath it moves too)?"""
    return ev.get("op") == "rename" and (
        (ev.get("pre") or {}).get("kind") == "dir" or
        (bool(ev.get("flags", 0) & 2) and (ev.get("pre2") or {}).get("kind") == "dir"))

# The writer maps MAP_SIZE at first (or what the data already holds, rounded up to MAP_STEP)
# and grows the map by MAP_STEP-sized steps on MDB_MAP_FULL.  It writes through the file, not
# through the map (no MDB_WRITEMAP): a full filesystem is then an error of the commit, never a
# SIGBUS on a page of a sparse file, and data.mdb is as long as the data in it.  Readers map
# READ_MAP_SIZE of address space (or more, for a larger file), so a writer that grew the map
# meanwhile never leaves them behind (MDB_MAP_RESIZED).
MAP_SIZE = 64 << 20
MAP_STEP = 64 << 20
READ_MAP_SIZE = 1 << 36


class JournalError(Exception):
    """The journal cannot be opened, read or written: says why in one line.

    ``errno`` is what a filesystem operation that needed the journal fails with: ENOSPC when
    the state dir's filesystem is full, the system's errno when LMDB or the content store gave
    one, else EIO."""

    def __init__(self, message: str = "", errno: int | None = None):
        super().__init__(message)
        self.errno = errno or _errno.EIO


def seq_key(seq: int) -> bytes:
    return struct.pack(">Q", seq)


def key_seq(key: bytes) -> int:
    return struct.unpack(">Q", key)[0]


def turn_key(session: str, index: int) -> bytes:
    return session.encode() + b"\0" + struct.pack(">I", index)


MAX_KEY = 500  # LMDB's default key limit is 511 bytes
LMDB_MAX_KEY = 511
PATH_KEY_MAX = MAX_KEY - 9  # the longest path (utf-8 bytes) that is its own ``paths`` key


def call_key(session: str, call_id: str) -> bytes:
    head = session.encode() + b"\0"
    raw = call_id.encode("utf-8", "surrogateescape")
    if len(head) + len(raw) <= MAX_KEY and raw[:1] != b"\xff":
        return head + raw
    return head + b"\xff" + xxhash.xxh3_128_digest(raw)


def _path_bytes(path: str) -> bytes:
    return path.encode("utf-8", "surrogateescape")


def _digest_form(raw: bytes) -> bool:
    # utf-8 never begins with 0xff: a path that does (a non-utf-8 name) takes the digest form
    # too, so that the two forms never share a key
    return len(raw) > PATH_KEY_MAX or raw[:1] == b"\xff"


def path_prefix(path: str) -> bytes:
    """The prefix every ``paths`` key of ``path`` starts with (the seq follows)."""
    raw = _path_bytes(path)
    if not _digest_form(raw):
        return raw + b"\0"
    return b"\xff" + xxhash.xxh3_128_digest(raw) + b"\0"


def path_prefixes(path: str) -> list[tuple[bytes, bytes]]:
    """(prefix, value) of every form the ``paths`` keys of ``path`` may have been written in:
    the digest form where ``path_prefix`` takes it, and the path itself wherever LMDB could
    hold it (a journal written before the digest form)."""
    raw = _path_bytes(path)
    out = []
    if len(raw) + 9 <= LMDB_MAX_KEY:
        out.append((raw + b"\0", b""))
    if _digest_form(raw):
        out.append((b"\xff" + xxhash.xxh3_128_digest(raw) + b"\0", raw))
    return out


def path_item(path: str, key: bytes) -> tuple[bytes, bytes]:
    """(path_key, path_value) of ``path`` for the event whose ``seq_key`` is ``key``: the
    path encoded once (every event puts one or two)."""
    raw = _path_bytes(path)
    if not _digest_form(raw):
        return raw + b"\0" + key, b""
    return b"\xff" + xxhash.xxh3_128_digest(raw) + b"\0" + key, raw


def path_key(path: str, seq: int) -> bytes:
    return path_item(path, seq_key(seq))[0]


def path_value(path: str) -> bytes:
    """The value of a ``paths`` key: b"" when the key holds the path, else the path."""
    return path_item(path, b"")[1]


ROOT_SEAL_KEY = b"/"  # the workspace root's path is "": LMDB takes no empty key, and no
                      # relative path is "/"


def seal_key(path: str) -> bytes:
    raw = path.encode("utf-8", "surrogateescape")
    if not raw:
        return ROOT_SEAL_KEY
    if len(raw) <= MAX_KEY:
        return raw
    return b"\xff" + xxhash.xxh3_128_digest(raw)


def path_key_split(key: bytes, value: bytes = b"") -> tuple[str, int]:
    """(path, seq) of a ``paths`` entry (the value holds the path of a digest-form key)."""
    raw = value if value else key[:-9]
    return raw.decode("utf-8", "surrogateescape"), key_seq(key[-8:])
