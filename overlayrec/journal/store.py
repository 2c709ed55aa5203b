"""The Journal: opens the LMDB environment described in ``schema``, appends events and actors,
and reads them back for the log and the engines.

Write-ahead is the caller's contract: ``append`` commits before it returns, so a caller that
changes the underlay only after ``append`` returned never changes it unrecorded.  Commits are
not fsynced by default (they reach the page cache, which a killed daemon cannot lose);
``durable=True`` syncs every commit, for power loss.

Three things ride with the next commit instead of one of their own: a small blob
(``hold_blob``, the content store's, for the event its caller commits next) and, in the daemon
(``hold_notes``), a handle's extents note, a summary readers go without and never a pre-image,
and an event that changes nothing (``hold_event``: a chmod to the mode the file has, a chown to
the owner it has), which has no pre-image to lose and no state for a reader to miss.  ``flush``
commits them a few milliseconds later when nothing else commits first.  A held event has its
seq when it is held, and every commit puts the held events first, so the journal's order is
the order things happened, with no gap a reader could see.

A commit that cannot be made (the state dir's filesystem is full, a quota, an I/O error) raises
JournalError with the errno the filesystem operation that needed it should fail with; the
environment stays usable, and the next commit succeeds once there is room again.  LMDB writes
through the file, not through its map (no MDB_WRITEMAP), so a full filesystem is never a SIGBUS,
and the map grows as the data does (``_grow``): data.mdb is as long as what it holds.

What a process reads through the map stays in its RSS until the kernel wants the memory back;
a writer lets go of it every few dozen commits (``trim_map``), so a mount's RSS does not grow
with its journal.
"""
from __future__ import annotations

import bisect
import errno
import fcntl
import json
import os
import time
from collections.abc import Iterator, Mapping  # (not typing: ~4 ms of a reader's start)
from types import MappingProxyType

import lmdb

try:  # three times the standard decoder's speed; what it cannot take, the standard one reads
    import orjson
except ImportError:
    orjson = None

from . import preimage, schema
from .ahead import AheadLog, Batch, encode as encode_batch
from .content import ContentStore, RecordContent
from ..state import private_dir, write_private
from ..underlay import madvise_dontneed
from .schema import JournalError, seq_key, key_seq, path_key_split



class _Log:
    """This module's logger, made on first use: only a writer logs, and importing logging
    costs every reader's start some 5 ms."""

    def __getattr__(self, name: str):
        import logging
        return getattr(logging.getLogger(__name__), name)


log = _Log()

# system errors a commit may fail with that the caller gets as they are (anything else is EIO)
_PASSED_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.EROFS, errno.ENOMEM)
_LOW_SPACE = 1 << 20  # an EIO from a commit with less free than this in the state dir: ENOSPC
# actor keys remembered as already in the table (a commit then skips looking them up); past
# this many the memory starts again empty: a mount's lifetime of processes must not grow it
_KNOWN_ACTORS = 4096
# commits between two ``trim_map``s of a writer: the map's pages it read since the last are
# all it keeps of the journal in its RSS (a commit writes its B-tree paths to fresh pages,
# which the next reads: some 10 to 40 KiB a commit); a trim costs about ten microseconds
_TRIM_EVERY = 32
# extents notes a writer holds at most: past it, the next note commits at once
_HELD_MAX = 256
_NO_BLOBS: Mapping[str, bytes] = MappingProxyType({})  # a record's blobs when it has none
# the log ahead is used while the state dir has this much free (looked at every few ms):
# what waits there must always fit into LMDB, so near a full disk every event is committed
# to LMDB at once, as without the log, and a full disk refuses the change itself
_AHEAD_ROOM = 64 << 20
_ROOM_EVERY = 0.005
MAX_KEY = 511  # LMDB's largest key (its default build): a longer one is in no database


def _dumps(obj) -> bytes:
    if orjson is not None:
        try:
            return orjson.dumps(obj)
        except (orjson.JSONEncodeError, TypeError):
            pass  # a path's undecodable bytes (lone surrogates): the standard encoder keeps them
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogateescape")


def _loads(b: bytes):
    if orjson is not None:
        try:
            return orjson.loads(b)
        except orjson.JSONDecodeError:
            pass  # not UTF-8 (a path's undecodable bytes, kept by surrogateescape), or a bad record
    return json.loads(b.decode("utf-8", "surrogateescape"))


# the fields of a session, turn or call record the readers rely on, and what each holds (None
# too where it says so): a record that is JSON but holds another shape failed every reader with
# "internal error" and passed `check` (found by a bug hunt)
_INT = (int,)
_RECORD_FIELDS = {
    "sessions": {"id": (str,), "started": _INT + (type(None),), "ended": _INT + (type(None),)},
    "turns": {"session": (str,), "index": _INT, "begin_seq": _INT + (type(None),),
              "end_seq": _INT + (type(None),), "begin_t": _INT + (type(None),),
              "end_t": _INT + (type(None),)},
    "calls": {"session": (str,), "id": (str,), "begin_seq": _INT + (type(None),),
              "end_seq": _INT + (type(None),), "begin_t": _INT + (type(None),),
              "end_t": _INT + (type(None),)},
}
_REQUIRED = {"sessions": ("id",), "turns": ("session", "index"), "calls": ("session", "id")}


def _record_defect(db: str, r) -> str | None:
    """Why record ``r`` of table ``db`` cannot be read as one (None: it can)."""
    if not isinstance(r, dict):
        return "a record that is no JSON object"
    fields = _RECORD_FIELDS.get(db)
    if fields is None:
        return None
    for name in _REQUIRED[db]:
        if name not in r:
            return f"a record without its {name!r}"
    for name, kinds in fields.items():
        v = r.get(name)
        if name in r and (not isinstance(v, kinds) or isinstance(v, bool)):
            return f"a record whose {name!r} is {json.dumps(v)[:40]}"
    return None


def _loads_all(raws: list[bytes]) -> list:
    """``_loads`` of each: orjson's own loop where it takes them all (10,000 call records in
    a third less time than one call of _loads each)."""
    if orjson is not None:
        loads = orjson.loads
        try:
            return [loads(b) for b in raws]
        except orjson.JSONDecodeError:
            pass  # one of them is not UTF-8: each through _loads
    return [_loads(b) for b in raws]


# a record's free-text fields (schema, ``turns`` and ``calls``): a string, or null
_TEXT_FIELDS = {"turns": ("prompt",), "calls": ("tool", "summary", "status")}


def _as_text(records: list[dict], fields: tuple) -> list[dict]:
    """``records``, each of ``fields`` that is neither a string nor null made its JSON text:
    a prompt that was an object, taken before the daemon checked a request's text fields,
    broke `turns`, `export git` and `report` on its record for good."""
    for r in records:
        if type(r) is not dict:
            continue  # a damaged record: its readers say so
        for f in fields:
            v = r.get(f)
            if v is not None and type(v) is not str:
                r[f] = json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    return records


class Journal:
    def __init__(self, state_dir: str, *, readonly: bool = False, durable: bool = False,
                 workspace: str | None = None):
        self.state_dir = state_dir
        self.readonly = readonly
        self._kept: list[dict] | None = None  # keep_events()
        self._kept_seq: dict[int, dict] = {}
        path = os.path.join(state_dir, "journal")
        try:
            os.fsencode(path).decode("utf-8")
        except UnicodeDecodeError:  # LMDB takes its path as UTF-8 text only
            raise JournalError(f"cannot open a journal in {os.fsencode(state_dir)!r}: "
                               "not a UTF-8 path") from None
        self._path, self._durable = path, durable
        self._ahead = AheadLog(path, _loads)  # the log ahead of LMDB (module ahead)
        self._pending: list[Batch] = []  # written ahead, not committed to LMDB yet
        self._owner = not readonly  # the one writer (writer lock): only it empties the log
        self._room_at = float("-inf")  # when the state dir's free space was last looked at
        self._room = False
        if readonly and not os.path.exists(os.path.join(path, "data.mdb")):
            raise JournalError(f"no journal in {state_dir}")
        self._compact_lock = None
        self._lock_fd: int | None = None  # lock.mdb, while the environment is open (_size_map)
        try:
            if not readonly:
                private_dir(path)  # 0700 whatever the umask (docs/storage.md)
            # held shared while the environment is open: a gc compacts data.mdb only when it
            # can hold it alone (no process has the journal open), see ``compact``
            self._compact_lock = hold_lock(path, COMPACT_LOCK, shared=True, wait=60.0)
            self._open_env()
        except lmdb.Error as e:
            self._release_lock()
            raise JournalError(f"cannot open journal {path}: {e}", _lmdb_errno(e)) from None
        except BaseException:
            self._release_lock()
            raise
        self._held_blobs: dict[str, bytes] = {}  # hold_blob(): for the next commit
        files = ContentStore(os.path.join(state_dir, "content")) if not readonly else \
            _ReadOnlyContent(os.path.join(state_dir, "content"))
        self.content = RecordContent(files, self)
        try:
            self._check_format(workspace)
        except BaseException:
            self.env.close()
            self._release_lock()
            raise
        self.load_cut()
        self._next_seq = self._load_next_seq()
        self._known_actors: set[str] = set()
        self._commits = 0
        self._map_spans: list[tuple[int, int]] = []  # trim_map: where the map was last found
        self._map_real: str | None = None
        self.hold_notes = False  # the daemon's writer: extents notes wait for the next commit
        self.on_held = None      # called when a note starts waiting (the daemon's wake-up)
        self._held: list[tuple[int, dict]] = []  # extents notes (seq, summary) not committed
        self._held_events: list[dict] = []  # hold_event: events that change nothing, seq given
        self._held_actors: list[dict] = []  # ... and their actors the table may not have
        try:
            self._catch_up()
        except BaseException:
            self.env.close()
            self._release_lock()
            raise
        if not readonly and not self._renames_indexed():
            self._index_renames()

    # -- the environment and its map ------------------------------------------------------------
    def _open_env(self) -> None:
        path, readonly = self._path, self.readonly
        data = os.path.join(path, "data.mdb")
        try:
            size = os.stat(data).st_size
        except FileNotFoundError:
            size = 0
        if readonly:
            # address space only: whatever the writer grows the map to meanwhile is mapped
            map_size = max(schema.READ_MAP_SIZE, _round_up(2 * size, schema.MAP_STEP))
        else:
            map_size = schema.MAP_SIZE  # LMDB raises it to what the data holds; sized below
        # a reader's environment is writable where it can be: it commits what the writer wrote
        # ahead (module ahead) before it reads; where it cannot write, it opens read only
        self._env_writable = True
        try:
            self.env = self._lmdb_open(map_size, readonly=False)
        except lmdb.Error as e:
            if not readonly or _lmdb_errno(e) not in (errno.EACCES, errno.EROFS, errno.EPERM):
                raise
            self.env = self._lmdb_open(map_size, readonly=True)
            self._env_writable = False
        try:
            self._check_length(data)
            if not readonly:
                self._size_map(data, size)
            self.dbs = {}
            for name in schema.DBS:
                try:
                    self.dbs[name] = self.env.open_db(name.encode(), create=not readonly)
                except lmdb.NotFoundError:
                    self.dbs[name] = None  # a journal older than this table (read only)
        except BaseException:
            self.env.close()
            raise

    def _check_length(self, data: str) -> None:
        """A data.mdb cut short (a copy that stopped, a disk that lost its tail) still opens,
        its meta pages whole, and the first read of a page past its end is a SIGBUS that kills
        the reader without a word: its length is checked against what the last commit uses
        first (LMDB's meta page says), a JournalError when it falls short."""
        # what the last commit uses first, then the length: a writer writes a commit's pages
        # before its meta page, so a commit made between the two only lengthens the file
        # (the other order took a commit made meanwhile for a file cut short: a reader's
        # open failed while the daemon wrote, once in a loaded test run)
        used = self._used()
        try:
            length = os.stat(data).st_size
        except OSError:
            return
        if length < used:
            raise JournalError(f"journal in {self._path} is corrupt: data.mdb holds {length} "
                               f"bytes, its last commit uses {used} (the file was cut short): "
                               "move the state dir aside, or put back a whole copy of it")

    def _lmdb_open(self, map_size: int, readonly: bool):
        return lmdb.open(
            self._path, map_size=map_size, max_dbs=len(schema.DBS) + 1,
            subdir=True, readonly=readonly, lock=True,
            sync=self._durable, metasync=self._durable, writemap=False,
            map_async=False, max_readers=256)

    def _used(self) -> int:
        """Bytes of data.mdb the last commit uses (LMDB never touches a page past them)."""
        return (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]

    def _size_map(self, data: str, size: int) -> None:
        """At a writable open: a map one step larger than the data; a data.mdb left sparse and
        64 GiB long by an older overlayrec (which wrote through the map) cut to its data; the
        lock file's pages allocated now (LMDB writes them through a map: on a full filesystem a
        new page there would be a SIGBUS, to us or to a reader)."""
        used = self._used()
        want = _round_up(used, schema.MAP_STEP) + schema.MAP_STEP
        if self.env.info()["map_size"] < want:
            self.env.set_mapsize(want)
        if size > used + schema.MAP_STEP:
            try:
                os.truncate(data, used)
            except OSError as e:
                log.warning("cannot shorten %s to its %d bytes of data: %s", data, used, e)
        lock = os.path.join(self._path, "lock.mdb")
        try:
            # the fd stays open until the environment is closed (``_release_lock``): LMDB's
            # locks on lock.mdb are POSIX record locks, which the process loses when it closes
            # any fd of the file; without them the next process to open the journal finds
            # itself alone, starts the lock table again, and commits are lost between them
            if self._lock_fd is None:
                self._lock_fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
            os.posix_fallocate(self._lock_fd, 0, os.fstat(self._lock_fd).st_size)
        except OSError as e:
            log.warning("cannot allocate %s: %s", lock, e)

    def _grow(self) -> None:
        """MDB_MAP_FULL: a larger map (address space; data.mdb grows only as pages are written).
        Only between transactions: no transaction of this process is open here."""
        cur = self.env.info()["map_size"]
        new = _round_up(cur + max(schema.MAP_STEP, cur // 2), schema.MAP_STEP)
        self.env.set_mapsize(new)
        log.info("journal map grown from %d to %d MiB", cur >> 20, new >> 20)

    def _reopen(self) -> None:
        """After MDB_PANIC (a meta page that could not be written): the environment refuses
        every transaction until it is opened again, at its last good commit."""
        try:
            self.env.close()
        except lmdb.Error:
            pass
        self._open_env()

    def _write(self, body):
        """Run ``body(txn)`` in one write transaction and commit it; returns what body returned.

        MDB_MAP_FULL grows the map and runs body again in a new transaction (body only puts, so
        it can run twice); any other failure is a JournalError carrying the errno to answer."""
        held, blobs, events = self._held, self._held_blobs, self._held_events
        pending = self._pending
        for _ in range(16):
            try:
                with self.env.begin(write=True) as txn:
                    for batch in pending:  # written ahead: before all else, in their order
                        self._put_batch(txn, batch, self._owner)
                    if blobs:
                        self._put_blobs(txn, blobs)
                    if held:
                        self._put_notes(txn, held)
                    if events:  # before the body: their seqs are lower than any it gives
                        self._put_actors(txn, self._held_actors)
                        for ev in events:
                            self._put_event(txn, ev)
                    out = body(txn)
                if blobs:
                    self._held_blobs = {}
                if held:
                    self._held = []
                if events:
                    self._held_events, self._held_actors = [], []
                if pending:
                    self._pending = []
                    if self._owner:  # all it wrote ahead is in LMDB now
                        self._empty_ahead()
                self._commits += 1
                if self._commits % _TRIM_EVERY == 0:
                    self.trim_map()
                return out
            except lmdb.MapResizedError:  # another process grew the map: take its size
                self.env.set_mapsize(0)
            except lmdb.MapFullError:
                try:
                    self._grow()
                except lmdb.Error as e:
                    raise self._write_error(e) from None
            except lmdb.PanicError as e:
                err = self._write_error(e)
                log.error("journal environment failed (%s): opening it again", e)
                try:
                    self._reopen()
                except lmdb.Error as e2:
                    log.error("cannot open the journal again: %s", e2)
                raise err from None
            except lmdb.Error as e:
                raise self._write_error(e) from None
        raise JournalError("journal write failed: the map cannot grow enough", errno.ENOSPC)

    def _write_error(self, e: lmdb.Error) -> JournalError:
        """The JournalError a failed write is told as: its errno, and words that name the
        cause (LMDB reports a short write, a full disk, as EIO: a mount on a full state dir
        was refused with "Input/output error", found by a bug hunt)."""
        code = _lmdb_errno(e)
        if code == errno.EIO and _free_bytes(self.state_dir) < _LOW_SPACE:
            return JournalError(f"journal write failed: no space left in the state dir "
                                f"{self.state_dir} ({e})", errno.ENOSPC)
        return JournalError(f"journal write failed: {e}", code)

    # -- format ---------------------------------------------------------------------------------
    def _check_format(self, workspace: str | None) -> None:
        made = os.path.join(self._path, MADE_NAME)
        try:
            with self.env.begin(db=self.dbs["meta"], write=not self.readonly) as txn:
                fmt = txn.get(b"format")
                if fmt is None:
                    if self.readonly or self._made_before(made):
                        # a journal kept here lost its data (data.mdb truncated or damaged):
                        # never a fresh record over it, its blobs and attic orphaned
                        raise JournalError(
                            f"journal in {self.state_dir} is empty or corrupt (no format "
                            "record)" + ("" if self.readonly else
                                         ", though a record was kept there: move the state "
                                         "dir aside to begin a new one"))
                    fmt = str(schema.FORMAT_VERSION).encode()
                    txn.put(b"format", fmt)
                    txn.put(b"created", str(time.time_ns()).encode())
                    if workspace:
                        txn.put(b"workspace", workspace.encode("utf-8", "surrogateescape"))
        except lmdb.Error as e:
            raise JournalError(f"journal in {self.state_dir} is corrupt: {e}") from None
        try:
            version = int(fmt)
        except ValueError:
            raise JournalError(f"journal in {self.state_dir} is corrupt "
                               f"(format record {fmt!r})") from None
        if version != schema.FORMAT_VERSION:
            raise JournalError(
                f"journal in {self.state_dir} has format {version}; this overlayrec "
                f"reads format {schema.FORMAT_VERSION}")
        if not self.readonly and not os.path.exists(made):
            # once the format record is committed: the mark that a record is kept here
            try:
                write_private(made, fmt + b"\n")
            except OSError as e:
                raise JournalError(f"journal write failed: {e}", e.errno) from None

    def _made_before(self, made: str) -> bool:
        """Was a record kept in this state dir (a journal without its format record is then
        damaged, not new)?  Its mark (MADE_NAME, written since), or blobs in its content
        store (a journal made before the mark was)."""
        if os.path.exists(made):
            return True
        try:
            with os.scandir(os.path.join(self.state_dir, "content")) as it:
                return any(e.name != "tmp" for e in it)
        except OSError:
            return False

    def put_meta(self, key: str, value: str) -> None:
        db = self.dbs["meta"]
        self._write(lambda txn: txn.put(key.encode(), value.encode("utf-8", "surrogateescape"),
                                        db=db))

    def meta(self, key: str) -> str | None:
        with self._read(db=self.dbs["meta"]) as txn:
            v = txn.get(key.encode())
        return v.decode("utf-8", "surrogateescape") if v is not None else None

    def _load_next_seq(self) -> int:
        """The seq after the last event, and never below the retention cut: a gc that
        dropped the newest session deleted the events up to the cut, and the next mount's
        first events took seqs below it, dropped as they were written (a session whose begin
        was not in the record; found by a bug hunt)."""
        with self._read(db=self.dbs["events"]) as txn:
            cur = txn.cursor()
            return max(key_seq(cur.key()) + 1 if cur.last() else 1, self.cut)

    # -- writing --------------------------------------------------------------------------------
    def last_reserved(self) -> int:
        """The last sequence number handed out (committed or about to be)."""
        return self._next_seq - 1

    def reserve_seq(self) -> int:
        """A sequence number for an event about to be appended (e.g. to name its attic entry)."""
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def append(self, event: dict, actor: dict | None = None) -> int:
        """Commit one event (and its actor, the first time it is seen); returns its seq."""
        if self.hold_notes and self._ahead_room():
            return self._write_ahead([event], [actor] if actor is not None else [])[0]["seq"]
        if actor is not None and actor["key"] not in self._known_actors:
            return self.append_many([event], [actor])[0]
        # the daemon's every change: one event of a known actor, without append_many's lists
        assigned: list[tuple[dict, bool]] = []
        self._stamp(event, assigned)
        try:
            self._write(lambda txn: self._put_event(txn, event))
        except JournalError:
            self._unstamp(assigned)
            raise
        return event["seq"]

    def append_many(self, events: list[dict], actors: list[dict]) -> list[int]:
        """Commit events (and the actors not seen before) in one transaction; their seqs.
        JournalError (with ``errno``) when the commit cannot be made: then nothing of it is in
        the journal."""
        # actors alone (an agent made known before its first event) are committed now: a record
        # ahead with no event has no seq a reader's catch-up would apply it by, and the writer
        # would write the actors' events without them
        if self.hold_notes and self._ahead_room() and (events or self._held_events):
            return [ev["seq"] for ev in self._write_ahead(events, actors)]
        added: list[str] = []
        assigned: list[tuple[dict, bool]] = []

        def body(txn) -> list[int]:
            added[:] = self._put_actors(txn, actors)
            for ev in events:
                self._stamp(ev, assigned)
                self._put_event(txn, ev)
            return [ev["seq"] for ev in events]

        try:
            seqs = self._write(body)
        except JournalError:
            self._unstamp(assigned)
            raise
        if len(self._known_actors) + len(added) > _KNOWN_ACTORS:
            self._known_actors.clear()  # the table answers for the forgotten ones
        self._known_actors.update(added)  # only once committed
        return seqs

    def _stamp(self, ev: dict, assigned: list[tuple[dict, bool]]) -> None:
        """Give ``ev`` its seq (when it has none) and time; what was given here is noted in
        ``assigned`` (the event, and whether its time was), for ``_unstamp``."""
        if "seq" not in ev:
            ev["seq"] = self.reserve_seq()
            assigned.append((ev, "t" not in ev))
        ev.setdefault("t", time.time_ns())

    def _unstamp(self, assigned: list[tuple[dict, bool]]) -> None:
        """A commit that failed: the seqs given here go back (nothing was reserved meanwhile),
        and the events can be appended again later in their place in the order."""
        if assigned and self._next_seq == assigned[-1][0]["seq"] + 1:
            self._next_seq = assigned[0][0]["seq"]
        for ev, timed_here in assigned:
            del ev["seq"]
            if timed_here:
                ev.pop("t", None)

    def _write_ahead(self, events: list[dict], actors: list[dict]) -> list[dict]:
        """``append``/``append_many`` while the daemon serves (``hold_notes``): the events (the
        held ones first, as a commit puts them) and their blobs, new actors and the extents
        notes held so far are one record of the log ahead, written before the caller changes
        the underlay; LMDB's commit follows with the next one (module ahead).  Returns the
        events, stamped.  JournalError (with the errno) when the record cannot be written:
        then nothing of it is in the journal, and nothing waits that did not wait before."""
        if len(self._pending) >= _HELD_MAX:
            self.flush()  # LMDB must keep up: a journal that cannot commit refuses here
        assigned: list[tuple[dict, bool]] = []
        for ev in events:
            self._stamp(ev, assigned)
        known = self._known_actors
        if self._held_actors:
            new = [a for a in self._held_actors + actors if a["key"] not in known]
        elif len(actors) == 1:  # nearly every append: the actor is known
            new = actors if actors[0]["key"] not in known else []
        else:
            new = [a for a in actors if a["key"] not in known]
        if len(new) > 1:
            new = list({a["key"]: a for a in new}.values())
        # the notes go too: a reader that sees these events sees the write runs that ended
        # before them as ended (docs/design.md, "A release ends a write run")
        notes, blobs = self._held, self._held_blobs
        first = not (notes or self._held_events or self._pending)
        # a record without blobs gets none of its own: not the journal's empty dict, which the
        # next small pre-image fills (and every record waiting with it would then put again)
        batch = Batch(self._held_events + events if self._held_events else events, new,
                      blobs if blobs else _NO_BLOBS, notes)
        try:
            self._ahead.append(encode_batch(batch, _dumps), self._durable)
        except OSError as e:
            self._unstamp(assigned)
            code = e.errno if e.errno in _PASSED_ERRNOS else errno.EIO
            raise JournalError(f"journal write failed: {e.strerror or e}", code) from None
        self._pending.append(batch)
        if self._held_events:
            self._held_events, self._held_actors = [], []
        if blobs:
            self._held_blobs = {}
        if notes:
            self._held = []
        if new:
            if len(known) + len(new) > _KNOWN_ACTORS:
                known.clear()
            known.update(a["key"] for a in new)
        if first and self.on_held is not None:
            self.on_held()
        return events

    def _ahead_room(self) -> bool:
        """May events be written ahead now: is there room for all that may wait to fit into
        LMDB (``_AHEAD_ROOM``)?  Looked at once every ``_ROOM_EVERY`` seconds at most."""
        now = time.monotonic()
        if now - self._room_at >= _ROOM_EVERY:
            self._room_at = now
            self._room = _free_bytes(self._path) >= _AHEAD_ROOM
        return self._room

    def _put_batch(self, txn, batch: Batch, owner: bool = True) -> None:
        """One record of the log ahead into LMDB (twice gives the same keys and values).  Not
        the ``owner`` (a reader catching up): an event LMDB holds already is left as it is,
        since the writer may have changed it since (``store_preimages``)."""
        if batch.blobs:
            self._put_blobs(txn, batch.blobs)
        self._put_actors(txn, batch.actors, known=())  # the writer remembered them early
        events = self.dbs["events"]
        for ev, raw in zip(batch.events, batch.raws or [None] * len(batch.events)):
            if owner or txn.get(seq_key(ev["seq"]), db=events) is None:
                self._put_event(txn, ev, raw)
        if batch.notes:
            self._put_notes(txn, batch.notes)

    def _put_notes(self, txn, notes) -> None:
        """Extents notes, (seq, summary) each, in order (a later one of a seq wins)."""
        db = self.dbs["extents"]
        for seq, summary in notes:
            txn.put(seq_key(seq), _dumps(summary), db=db)

    def _empty_ahead(self) -> None:
        try:
            self._ahead.empty()
        except OSError as e:  # applied again at the next open, harmlessly
            log.warning("cannot empty the log ahead of the journal: %s", e)

    def _catch_up(self) -> None:
        """The records of the log ahead that LMDB does not hold yet are committed now: at the
        writer's open (a daemon killed before it committed them), which then empties the log;
        at a reader's open and at each of its ``last_seq`` (the daemon may be serving: the
        log stays its), so that a reader never answers without an event that was written
        before it asked."""
        nxt = self._load_next_seq()
        todo = [b for b in self._ahead.batches() if b.last_seq >= nxt]
        if self._owner and self._ahead.tail:  # before the log is emptied below
            n = len(self._ahead.tail)
            try:
                kept = self._ahead.keep_tail()
                log.warning("the log ahead of the journal ends in %d byte(s) that are no whole "
                            "record (a crash's torn write, or damage): not applied, kept in %s",
                            n, kept)
            except OSError as e:
                log.warning("the log ahead of the journal ends in %d byte(s) that are no whole "
                            "record, not applied, and cannot be kept (%s)", n, e)
        if not todo:
            if self._owner and self._ahead.size():
                self._empty_ahead()
            return
        try:
            if not self._env_writable:
                raise JournalError("this process cannot write the journal", errno.EACCES)
            self._pending = todo
            self.flush()
        except JournalError as e:
            n = sum(len(b.events) for b in todo)
            raise JournalError(f"cannot read the journal in {self.state_dir}: its last {n} "
                               f"event(s), written ahead, cannot be committed ({e})",
                               e.errno) from None
        finally:
            self._pending = []
        self.load_cut()
        self._next_seq = self._load_next_seq()

    def _put_actors(self, txn, actors, known=None) -> list[str]:
        """Put the actors the table may not have (not those in ``known``: by default the ones
        this writer stored already); the keys put."""
        known = self._known_actors if known is None else known
        added = []
        for a in actors:
            if a["key"] in known:
                continue
            akey = a["key"].encode()
            if txn.get(akey, db=self.dbs["actors"]) is None:
                txn.put(akey, _dumps(a), db=self.dbs["actors"])
            added.append(a["key"])
        return added

    def _put_event(self, txn, ev: dict, raw: bytes | None = None) -> None:
        """One event (``raw``: its JSON, when it was encoded already), with its path keys and
        its place in the rename or seal index."""
        dbs = self.dbs
        k = seq_key(ev["seq"])
        txn.put(k, raw if raw is not None else _dumps(ev), db=dbs["events"])
        for p in (ev.get("path"), ev.get("path2")):
            if p is not None:
                txn.put(*schema.path_item(p, k), db=dbs["paths"])
        if schema.is_dir_rename(ev):
            txn.put(k, _dumps(_rename_record(ev)), db=dbs["renames"])
        elif ev["op"] == "failed":  # a refused rename moved nothing: out of path history
            txn.delete(seq_key(ev["ref"]), db=dbs["renames"])
        elif ev["op"] == "seal":
            txn.put(schema.seal_key(ev["path"]), k + ev["path"].encode("utf-8", "surrogateescape"),
                    db=dbs["seals"])

    # -- small blobs --------------------------------------------------------------------------
    def hold_blob(self, digest: str, data: bytes) -> None:
        """Keep a small blob (``blobs``) with the next commit: the one of the event that names
        it, which its caller makes next.  A digest the table has already is not written again."""
        self._held_blobs[digest] = data

    def unhold_blobs(self, digests) -> None:
        """The blobs held for a commit that will not be made (``hold_blob``) wait no more."""
        for d in digests:
            self._held_blobs.pop(d, None)

    def store_preimages(self, items: list[tuple[int, str, str, str]]) -> None:
        """Pre-images the attic kept for a while, now in the content store: for each
        ``(seq, attic entry, blob digest)`` the event's pre-image names the blob and no longer
        the entry, all in one commit (with what waits before it: the
        events themselves may still be written ahead).  An event that no longer names the
        entry (dropped by retention since) is left alone.  The same content as before, so no
        reader's answer changes; a reader that read the event before this commit and then
        finds the entry gone asks the journal again (``event(seq, fresh=True)``)."""
        def body(txn):
            db = self.dbs["events"]
            for seq, name, digest in items:
                k = seq_key(seq)
                raw = txn.get(k, db=db)
                if raw is None:
                    continue
                ev = _loads(raw)
                pre = preimage.naming_entry(ev, name)
                if pre is None:
                    continue
                del pre["attic"]
                pre["blob"] = digest
                txn.put(k, _dumps(ev), db=db)
        self._write(body)

    def _put_blobs(self, txn, blobs: dict[str, bytes]) -> None:
        db = self.dbs["blobs"]
        for digest, data in blobs.items():
            k = digest.encode()
            if txn.get(k, db=db) is None:
                txn.put(k, data, db=db)

    def blob(self, digest: str) -> bytes | None:
        """A small blob's bytes as stored (unchecked), or None when ``blobs`` has no such one."""
        held = self._held_blobs.get(digest)
        if held is not None:
            return held
        for batch in self._pending:  # written ahead
            if digest in batch.blobs:
                return batch.blobs[digest]
        if self.dbs["blobs"] is None:  # a journal older than the table
            return None
        try:
            with self._read(db=self.dbs["blobs"]) as txn:
                return txn.get(digest.encode())
        except lmdb.Error as e:
            raise JournalError(f"journal in {self.state_dir} is corrupt: {e}") from None

    def blob_sizes(self) -> Iterator[tuple[str, int]]:
        """(digest, bytes) of every blob ``blobs`` holds."""
        if self.dbs["blobs"] is None:
            return
        with self._read(db=self.dbs["blobs"]) as txn:
            for k, v in txn.cursor(db=self.dbs["blobs"]):
                yield k.decode("ascii", "replace"), len(v)

    def sweep_blobs(self, keep, only=None, batch: int = 2000) -> tuple[int, int]:
        """Delete the blobs of ``blobs`` not in ``keep`` (with ``only``, of those digests);
        (count, bytes).  Only blobs committed can go: one held for the next commit is a
        writer's, for an event not committed yet."""
        if self.dbs["blobs"] is None:
            return 0, 0
        # before blob_sizes' read, which commits them (those written ahead are named by
        # their events, which the caller's keep has seen: its reads committed them too)
        held = set(self._held_blobs)
        names = [dg for dg in only] if only is not None else [dg for dg, _ in self.blob_sizes()]
        gone = [dg for dg in names if dg not in keep and dg not in held]
        n = size = 0
        db = self.dbs["blobs"]
        for i in range(0, len(gone), batch):
            part = gone[i:i + batch]

            def body(txn, part=part):
                m = b = 0
                for dg in part:
                    v = txn.pop(dg.encode(), db=db)
                    if v is not None:
                        m, b = m + 1, b + len(v)
                return m, b
            m, b = self._write(body)
            n, size = n + m, size + b
        return n, size

    # -- held notes ---------------------------------------------------------------------------
    @property
    def held(self) -> int:
        """How many extents notes, events and records written ahead wait for the next
        commit."""
        return len(self._held) + len(self._held_events) + len(self._pending)

    def flush(self) -> None:
        """Commit what waits (JournalError when it cannot be: it waits on)."""
        if self._held or self._held_blobs or self._held_events or self._pending:
            self._write(lambda txn: None)

    def _settle(self) -> None:
        """Before this process reads extents notes or events: those held are committed (when
        they cannot be, the read sees the journal as committed, and they stay held).  Held blobs
        need no settling: ``blob`` looks at them first."""
        if self._held or self._held_events or self._pending:
            try:
                self.flush()
            except JournalError as e:
                log.warning("cannot commit %d held note(s) before a read: %s", self.held, e)

    def hold_event(self, event: dict, actor: dict) -> int:
        """An event that changes nothing in the record (no pre-image, no state differs after
        it): with ``hold_notes``, its seq now and its commit with the next one; else committed
        now.  Its seq either way.  JournalError when too many wait and they cannot be
        committed (the caller then leaves the underlay alone, as after ``append``)."""
        if not self.hold_notes:
            return self.append(event, actor)
        if len(self._held_events) >= _HELD_MAX:
            self.flush()
        self._stamp(event, [])  # never taken back: unhold_event discards the event whole
        first = not self.held
        self._held_events.append(event)
        if actor["key"] not in self._known_actors:
            self._held_actors.append(actor)
        if first and self.on_held is not None:
            self.on_held()
        return event["seq"]

    def unhold_event(self, seq: int) -> None:
        """The change held event ``seq`` named was refused by the underlay: it did not
        happen, so neither did the event (its seq goes back when none was given after it)."""
        if self._held_events and self._held_events[-1]["seq"] == seq:
            self._held_events.pop()
            if self._next_seq == seq + 1:
                self._next_seq = seq

    def _renames_indexed(self) -> bool:
        """Does ``renames`` hold exactly the directory renames that held (schema)?"""
        if self.dbs["renames"] is None:
            return False
        with self._read(db=self.dbs["meta"]) as txn:
            return txn.get(b"renames_indexed") == schema.RENAMES_INDEXED

    def _scan_renames(self) -> list[dict]:
        """The directory renames that held, read off the events (no index)."""
        evs = [ev for ev in self.events() if ev["op"] == "failed" or schema.is_dir_rename(ev)]
        failed = {ev["ref"] for ev in evs if ev["op"] == "failed"}
        return [ev for ev in evs if ev["op"] != "failed" and ev["seq"] not in failed]

    def _index_renames(self) -> None:
        """Index the directory renames of a journal written before that index existed, or
        before refused renames were left out of it."""
        found = self._scan_renames()
        db = self.dbs["renames"]

        def body(txn):
            txn.drop(db, delete=False)
            for ev in found:
                txn.put(seq_key(ev["seq"]), _dumps(_rename_record(ev)), db=db)
            txn.put(b"renames_indexed", schema.RENAMES_INDEXED, db=self.dbs["meta"])
        self._write(body)

    def put_record(self, db: str, key: bytes, record: dict) -> None:
        """Write a session, turn or call record (they change as they begin and end)."""
        handle, value = self.dbs[db], _dumps(record)
        self._write(lambda txn: txn.put(key, value, db=handle))

    def place_actors(self, rows: list[dict]) -> None:
        """Give processes their ``line`` (schema, ``actors``): each row's ``line`` goes into the
        row the table holds of its key (a process that wrote), else the row is put whole (one
        that never wrote: a survivor whose later children may)."""
        handle = self.dbs["actors"]

        def body(txn):
            for row in rows:
                key = row["key"].encode()
                old = txn.get(key, db=handle)
                try:
                    held = _loads(old) if old is not None else None
                except ValueError:
                    held = None  # a damaged row (check names it): this one is whole
                new = dict(held, line=row["line"]) if isinstance(held, dict) else row
                txn.put(key, _dumps(new), db=handle)
        if rows:
            self._write(body)

    def records(self, db: str, prefix: bytes = b"", holding: bytes | None = None) -> list[dict]:
        """The records of ``db`` whose key starts with ``prefix``; with ``holding``, only
        those whose stored bytes hold it (the rest are not decoded: a caller that filters on
        a field looks for the field as the encoder writes it, and checks what it gets)."""
        out = []
        if self.dbs[db] is None:
            return out
        try:
            with self._read(db=self.dbs[db]) as txn:
                cur = txn.cursor()
                if not prefix and holding is None:  # all of them (a listing of every call)
                    out = _loads_all(list(cur.iternext(keys=False)))
                elif cur.set_range(prefix):
                    for k, v in cur:
                        if not k.startswith(prefix):
                            break
                        if holding is None or holding in v:
                            out.append(_loads(v))
        except (ValueError, lmdb.Error) as e:  # each reader failed on it: "internal error"
            raise self._damaged(db, e) from None
        for r in out:
            why = _record_defect(db, r)
            if why:
                raise self._damaged(db, why)
        if self._dropped and db in _SESSION_DBS:  # a gc's cut made, its records not yet deleted
            key = _SESSION_DBS[db]
            out = [r for r in out if r.get(key) not in self._dropped]
        return _as_text(out, _TEXT_FIELDS[db]) if db in _TEXT_FIELDS else out

    def _damaged(self, db: str, why) -> JournalError:
        """A session, turn or call record that cannot be read: said in one line, as a damaged
        journal is (found by a bug hunt: every reader failed with "internal error")."""
        return JournalError(f"journal in {self.state_dir} is damaged: its {db} table cannot be "
                            f"read ({why}); `overlayrec check` says what can still be read")

    def damaged_tables(self) -> list[tuple[str, str]]:
        """The session, turn and call tables that cannot be read whole, and why (``check``:
        it said "record whole" over them)."""
        out = []
        for db in ("sessions", "turns", "calls"):
            try:
                self.records(db)
            except JournalError as e:
                out.append((db, str(e).split(" cannot be read (", 1)[-1].rsplit(");", 1)[0]))
        return out

    def record(self, db: str, key: bytes) -> dict | None:
        if self.dbs[db] is None or not 0 < len(key) <= MAX_KEY:
            return None  # no such key can be stored (LMDB refused it: MDB_BAD_VALSIZE)
        try:
            with self._read(db=self.dbs[db]) as txn:
                v = txn.get(key)
            r = _loads(v) if v is not None else None
        except (ValueError, lmdb.Error) as e:
            raise self._damaged(db, e) from None
        why = _record_defect(db, r) if r is not None else None
        if why:
            raise self._damaged(db, why)
        if r is not None and self._dropped and db in _SESSION_DBS and \
                r.get(_SESSION_DBS[db]) in self._dropped:
            return None
        return _as_text([r], _TEXT_FIELDS[db])[0] if r is not None and db in _TEXT_FIELDS \
            else r

    # -- retention (overlayrec.retention; the format in schema) --------------------------------
    def load_cut(self) -> int:
        """Read the retention cut (meta ``dropped_before``) and the dropped sessions again."""
        v = self.meta("dropped_before")
        self.cut = int(v) if v and v.isdigit() else 0
        self._dropped = {r["id"] for r in self.dropped_sessions()} if self.cut else set()
        return self.cut

    def dropped_sessions(self) -> list[dict]:
        """Every session a gc dropped (table ``dropped``), in key order."""
        if self.dbs.get("dropped") is None:
            return []
        with self._read(db=self.dbs["dropped"]) as txn:
            return [_loads(v) for _, v in txn.cursor()]

    def dropped_session(self, sid: str) -> dict | None:
        if self.dbs.get("dropped") is None:
            return None
        with self._read(db=self.dbs["dropped"]) as txn:
            v = txn.get(sid.encode("utf-8", "surrogateescape"))
        return _loads(v) if v is not None else None

    def pins(self) -> dict[str, dict]:
        if self.dbs.get("pins") is None:
            return {}
        with self._read(db=self.dbs["pins"]) as txn:
            return {k.decode("utf-8", "surrogateescape"): _loads(v) for k, v in txn.cursor()}

    def set_pin(self, sid: str, pinned: bool) -> None:
        handle, key = self.dbs["pins"], sid.encode("utf-8", "surrogateescape")
        if pinned:
            value = _dumps({"t": time.time_ns()})
            self._write(lambda txn: txn.put(key, value, db=handle))
        else:
            self._write(lambda txn: txn.delete(key, db=handle))

    def seal_seq(self, path: str) -> int | None:
        """The seq of ``path``'s latest seal (table ``seals``), or None."""
        if self.dbs.get("seals") is None:
            return None
        with self._read(db=self.dbs["seals"]) as txn:
            v = txn.get(schema.seal_key(path))
        if v is None or v[8:].decode("utf-8", "surrogateescape") != path:
            return None
        return key_seq(v[:8])

    def scan_raw(self, since: int = 1, until: int | None = None):
        """(seq, raw event bytes) from ``since`` on, whatever the cut (the gc's own scans)."""
        with self._read(db=self.dbs["events"]) as txn:
            cur = txn.cursor()
            if not cur.set_range(seq_key(since)):
                return
            for k, v in cur:
                seq = key_seq(k)
                if until is not None and seq > until:
                    break
                yield seq, bytes(v)

    def set_cut(self, cut: int, dropped: list[dict], gc_meta: dict,
                unseal: list[str] = ()) -> None:
        """Step 1 of a gc, in one transaction: the cut (meta ``dropped_before``), a record of
        each session dropped, the gc under way (meta ``gc``), and the ``seals`` entries of
        ``unseal`` removed (seals below the cut that no longer end their path's chain)."""
        meta, ddb, sdb = self.dbs["meta"], self.dbs["dropped"], self.dbs["seals"]

        def body(txn):
            old = txn.get(b"dropped_before", db=meta)
            if old is not None and int(old) > cut:
                raise JournalError(f"a cut at {cut} is below the record's start {int(old)}")
            txn.put(b"dropped_before", str(cut).encode(), db=meta)
            txn.put(b"gc", _dumps(gc_meta), db=meta)
            for d in dropped:
                txn.put(d["id"].encode("utf-8", "surrogateescape"), _dumps(d), db=ddb)
            for p in unseal:
                txn.delete(schema.seal_key(p), db=sdb)
        self._write(body)
        self.load_cut()

    def delete_below(self, cut: int, kept: set[int], start: int = 1,
                     batch: int = 2000) -> int | None:
        """Step 2 of a gc, one transaction: delete up to ``batch`` events below ``cut`` from
        ``start`` on, with their ``paths`` keys, ``renames`` and ``extents`` rows, but those
        of ``kept`` (the seqs of the seals ``seals`` points at below the cut, passed over
        without decoding them).  Returns the seq to go on from, None when done."""
        dbs = self.dbs

        def body(txn):
            cur = txn.cursor(db=dbs["events"])
            n = 0
            if not cur.set_range(seq_key(start)):
                return None
            while True:
                k = cur.key()
                if not k:
                    return None
                seq = key_seq(k)
                if seq >= cut:
                    return None
                if n >= batch:
                    return seq
                if seq in kept:
                    n += 1
                    if not cur.next():
                        return None
                    continue
                ev = _loads(cur.value())
                for p in (ev.get("path"), ev.get("path2")):
                    if p is not None:
                        for prefix, _ in schema.path_prefixes(p):
                            txn.delete(prefix + k, db=dbs["paths"])
                txn.delete(k, db=dbs["renames"])
                txn.delete(k, db=dbs["extents"])
                n += 1
                if not cur.delete():  # moves to the next record
                    return None
        return self._write(body)

    def delete_session_records(self, sids: list[str]) -> None:
        """Step 2 of a gc: the session, turn and call records of dropped sessions."""
        dbs = self.dbs

        def body(txn):
            for sid in sids:
                raw = sid.encode("utf-8", "surrogateescape")
                txn.delete(raw, db=dbs["sessions"])
                txn.delete(raw, db=dbs["pins"])
                for db in ("turns", "calls"):
                    cur = txn.cursor(db=dbs[db])
                    prefix = raw + b"\0"
                    if cur.set_range(prefix):
                        while cur.key().startswith(prefix):
                            if not cur.delete():
                                break
        self._write(body)

    def pages(self) -> dict:
        """The data file in bytes: ``file`` (its length), ``used`` (pages the tables and the
        meta pages hold), ``free`` (the rest: pages a compaction gives back)."""
        psize = self.env.stat()["psize"]
        used_pages = 2  # the two meta pages
        st = self.env.stat()  # the main table (it names the others)
        used_pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        with self._read() as txn:
            for handle in self.dbs.values():
                if handle is None:
                    continue
                st = txn.stat(handle)
                used_pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        last = self.env.info()["last_pgno"] + 1
        try:
            size = os.stat(os.path.join(self._path, "data.mdb")).st_size
        except OSError:
            size = last * psize
        used = min(used_pages, last) * psize
        return {"file": size, "used": used, "free": max(size - used, 0), "psize": psize}

    def put_extents(self, seq: int, summary: dict) -> None:
        """A write handle's extents note (a summary readers may go without, and a release
        reaches the daemon after the writer's close anyway): with ``hold_notes``, it waits for
        the next commit."""
        if self.hold_notes and len(self._held) < _HELD_MAX:
            first = not self.held
            self._held.append((seq, summary))
            if first and self.on_held is not None:
                self.on_held()
            return
        handle, value = self.dbs["extents"], _dumps(summary)
        self._write(lambda txn: txn.put(seq_key(seq), value, db=handle))

    # -- reading --------------------------------------------------------------------------------
    def count(self) -> int:
        with self._read(db=self.dbs["events"]) as txn:
            return txn.stat(self.dbs["events"])["entries"]

    def scan(self) -> None:
        """Read every page of every table once (keys, values, overflow pages' first): a
        JournalError when one is damaged.  A page garbled inside the events left `status`
        saying all was well and `run` recording into a journal every reader refused (found
        by a bug hunt); about 0.3 s for a 140 MB journal, so `status` and `run`'s end do it,
        not every mount nor every reader."""
        try:
            with self.env.begin(buffers=True) as txn:
                for db in self.dbs.values():
                    if db is None:  # a table this older journal does not have
                        continue
                    for _key, value in txn.cursor(db):
                        value[:1]  # an overflow page is read when the value is
        except lmdb.Error as e:
            raise JournalError(f"journal in {self.state_dir} is corrupt: {e}") from None

    def last_seq(self) -> int:
        if self.readonly:  # what the writer wrote ahead since: a seq named here can be read
            self._catch_up()
        self._settle()  # a writer's held events first: a seq it names is one readers see
        return self._load_next_seq() - 1

    def _read(self, db=None):
        """A read transaction that sees what this process wrote ahead (committed first)."""
        if self._pending:
            self._settle()
        return self.env.begin(db=db)

    def generation(self) -> int:
        """LMDB's last committed write transaction: it moves with every change to the journal
        (an event, a call's or turn's record, a meta key), so an answer made from the journal
        as it stood at one generation holds while the generation is the same."""
        if self._pending:
            self._settle()
        return self.env.info()["last_txnid"]

    def event(self, seq: int, fresh: bool = False) -> dict | None:
        """Event ``seq``, or None; JournalError when its record is not an event.  ``fresh``:
        as the journal holds it now, not as this reader kept it (``keep_events``)."""
        kept = None if fresh else self._kept_seq.get(seq)  # keep_events()
        if kept is not None:
            return kept
        try:
            with self._read(db=self.dbs["events"]) as txn:
                v = txn.get(seq_key(seq))
        except lmdb.Error as e:
            raise JournalError(f"journal in {self.state_dir} is corrupt: {e}") from None
        if v is None:
            return None
        ev = self._decode_event(seq, v)
        if seq < self.cut and not (ev["op"] == "seal" and self.seal_seq(ev["path"]) == seq):
            return None  # dropped by retention (only the latest seal of a path stays)
        return ev

    def keep_events(self) -> list[dict]:
        """Decode every event once and answer ``events()`` from memory from now on: for a
        reader that passes over the whole journal more than once (a listing).  The journal as
        it stands now; a writer's later events are not seen."""
        if self._kept is None:
            self._kept = list(self.events())
            self._kept_seq = {e["seq"]: e for e in self._kept}
        return self._kept

    def remember_events(self, events: list[dict]) -> None:
        """Answer ``event(seq)`` for these events (as ``events()`` gave them) from memory too:
        a reader that holds a range's events and then looks them up one by one (a diff's
        states) decodes each once."""
        kept = self._kept_seq
        for e in events:
            kept.setdefault(e["seq"], e)

    def forget_events(self) -> None:
        """Read ``events()`` from the journal again (what keep_events() kept is let go)."""
        self._kept = None
        self._kept_seq = {}

    def events(self, since: int = 1, until: int | None = None) -> Iterator[dict]:
        """The events from ``since`` to ``until`` (inclusive), in order; JournalError naming
        the first record that is not an event."""
        since = max(since, self.cut)  # below the cut: dropped by retention
        if self._kept is not None:
            kept = self._kept
            lo = bisect.bisect_left(kept, since, key=lambda e: e["seq"])
            hi = len(kept) if until is None else \
                bisect.bisect_right(kept, until, key=lambda e: e["seq"])
            return iter(kept[lo:hi])
        return self._read_events(since, until)

    def events_of(self, ops: tuple[str, ...], since: int = 1,
                  until: int | None = None) -> Iterator[dict]:
        """The events of these ``ops`` from ``since`` to ``until``, in order: only those are
        decoded (a record's raw JSON is looked at first), so a reader that needs a few kinds
        from a long journal (a revert's session ends, the links before its selection) does not
        decode every event."""
        since = max(since, self.cut)
        if self._kept is not None:
            return (e for e in self.events(since, until) if e["op"] in ops)
        needles = tuple(b'"op":"%s"' % op.encode() for op in ops)
        return self._read_events(since, until, needles, ops)

    def _read_events(self, since: int, until: int | None, needles: tuple[bytes, ...] = (),
                     ops: tuple[str, ...] = ()) -> Iterator[dict]:
        try:
            with self._read(db=self.dbs["events"]) as txn:
                cur = txn.cursor()
                if not cur.set_range(seq_key(since)):
                    return
                for k, v in cur:
                    if len(k) != 8:
                        raise JournalError(f"journal in {self.state_dir} is corrupt: an event "
                                           f"key of {len(k)} bytes")
                    seq = key_seq(k)
                    if until is not None and seq > until:
                        break
                    if needles:  # events_of: what holds none of them is another op
                        if not any(n in v for n in needles):
                            continue
                        ev = self._decode_event(seq, v)
                        if ev["op"] in ops:  # (a needle found inside another value)
                            yield ev
                        continue
                    yield self._decode_event(seq, v)
        except lmdb.Error as e:
            raise JournalError(f"journal in {self.state_dir} is corrupt: {e}") from None

    def _decode_event(self, seq: int, raw: bytes) -> dict:
        """One event's record, checked for what every reader takes for granted."""
        ev, why = decode_event(seq, raw)
        if why is None:
            return ev
        raise JournalError(f"journal in {self.state_dir} is corrupt: event {seq} {why}")

    def seqs_for_path(self, path: str) -> list[int]:
        """The seqs of every event naming ``path``, ascending (whatever form its keys have)."""
        out = []
        with self._read(db=self.dbs["paths"]) as txn:
            cur = txn.cursor()
            for prefix, value in schema.path_prefixes(path):
                if cur.set_range(prefix):
                    for k, v in cur:
                        if not k.startswith(prefix):
                            break
                        if len(k) == len(prefix) + 8 and v == value:
                            out.append(key_seq(k[-8:]))
        if out and out[0] < self.cut:  # dropped by retention, but for the path's latest seal
            sealed = self.seal_seq(path)
            out = [s for s in out if s >= self.cut or s == sealed]
        return sorted(out)

    def paths(self) -> Iterator[str]:
        """Every path the events name, once each, in key order (a long path's place is that of
        its digest)."""
        last = None
        long_seen: set[str] = set()
        with self._read(db=self.dbs["paths"]) as txn:
            for k, v in txn.cursor():
                p = path_key_split(k, v)[0]
                if p == last:
                    continue
                last = p
                if v or len(k) - 9 > schema.PATH_KEY_MAX or k[:1] == b"\xff":  # both forms: once
                    if p in long_seen:
                        continue
                    long_seen.add(p)
                yield p

    def dir_renames(self) -> list[dict]:
        """Every directory rename, in order: ``{"seq","src","dst","flags"}``."""
        if not self._renames_indexed():
            return [dict(_rename_record(ev), seq=ev["seq"]) for ev in self._scan_renames()]
        out = []
        with self._read(db=self.dbs["renames"]) as txn:
            cur = txn.cursor()
            if cur.set_range(seq_key(self.cut)):
                for k, v in cur:
                    out.append(dict(_loads(v), seq=key_seq(k)))
        return out

    def seals(self) -> Iterator[tuple[str, int]]:
        """(path, seq of its latest seal), every sealed path."""
        if self.dbs["seals"] is None:
            return
        with self._read(db=self.dbs["seals"]) as txn:
            for _, v in txn.cursor():
                yield v[8:].decode("utf-8", "surrogateescape"), key_seq(v[:8])

    def last_seq_for_path(self, path: str) -> int | None:
        """The seq of the last event naming ``path``, or None."""
        best = None
        with self._read(db=self.dbs["paths"]) as txn:
            cur = txn.cursor()
            for prefix, value in schema.path_prefixes(path):
                # the last key of the prefix: step back from the first key past it
                if cur.set_range(prefix[:-1] + b"\1"):
                    if not cur.prev():
                        continue
                elif not cur.last():
                    continue
                while True:
                    k = cur.key()
                    if not k.startswith(prefix):
                        break
                    if len(k) == len(prefix) + 8 and cur.value() == value:
                        seq = key_seq(k[-8:])
                        best = seq if best is None else max(best, seq)
                        break
                    if not cur.prev():  # a stray key of the other form: look further back
                        break
        return best

    def actor(self, key: str, settle: bool = True) -> dict | None:
        """The process row ``key``, or None; JournalError when the row is damaged.  ``settle``
        False: the row as committed, what this process wrote ahead left out (the daemon's look
        on its request path, which must not make a commit of its own)."""
        with (self._read if settle else self.env.begin)(db=self.dbs["actors"]) as txn:
            v = txn.get(key.encode())
        if v is None:
            return None
        try:
            row = _loads(v)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            raise JournalError(f"journal in {self.state_dir} is corrupt: the row of process "
                               f"{key} is not a process record")
        return row

    def index_defects(self, items, unread=(), upto: int | None = None
                      ) -> list[tuple[str, str | None, int | None]]:
        """``overlayrec check``'s look at the path index: of the (path, seq) the events name,
        those it does not hold, and the entries it holds that no event names (why, path, seq;
        ``unread``: the seqs of records that are no event, whose entries are not looked at;
        nor those past ``upto``, the last event looked at: a daemon's since).  Unless a gc is
        under way (its cut's events not deleted yet)."""
        out: list[tuple[str, str | None, int | None]] = []
        want = set(items)
        with self._read(db=self.dbs["paths"]) as txn:
            for path, seq in want:
                key, value = schema.path_item(path, seq_key(seq))
                if txn.get(key) != value:
                    out.append(("an event the path index does not hold (no reader finds it "
                                "under its path)", path, seq))
            if self.meta("gc"):
                return out
            for key, value in txn.cursor():
                try:
                    path, seq = schema.path_key_split(key, value)
                except (ValueError, UnicodeDecodeError):
                    path, seq = None, None
                if (path, seq) not in want and seq not in unread and \
                        (upto is None or seq is None or seq <= upto):
                    out.append(("an entry of the path index that no event names (a reader "
                                "takes it for a path that was never there)", path, seq))
        return out

    def unread_ahead(self) -> int:
        """The bytes of the log ahead after its last whole record, as last read (a reader's
        catch-up): damage, or a record being written."""
        return len(self._ahead.tail)

    def actor_keys(self) -> list[str]:
        """Every actor row's key (``<pid>:<start-ticks>``)."""
        with self._read(db=self.dbs["actors"]) as txn:
            return [k.decode() for k in txn.cursor().iternext(keys=True, values=False)]

    def delete_actors(self, keys) -> None:
        """Step 3 of a gc: the rows of processes no kept record names any more."""
        keys = list(keys)

        def body(txn):
            for k in keys:
                txn.delete(k.encode(), db=self.dbs["actors"])
        if keys:
            self._write(body)
            self._known_actors.difference_update(keys)

    def extents(self, seq: int) -> dict | None:
        self._settle()
        with self._read(db=self.dbs["extents"]) as txn:
            v = txn.get(seq_key(seq))
        return _loads(v) if v is not None else None

    def trim_map(self) -> int:
        """Let go of the pages of data.mdb this process has read through LMDB's map: LMDB reads
        every page through it (appends too: the B-tree's path to the last leaf, the leaf just
        written), and a page once read stays in the process's RSS, shared with the page cache,
        until the kernel reclaims it; a journal of a million events would read as hundreds of
        MB of a daemon's RSS.  The map is a read-only shared file mapping (no MDB_WRITEMAP), so
        MADV_DONTNEED only unmaps: the next read of a page maps the page cache's again, as it
        was, and nothing is lost or read from disk.  Only this environment's own map is
        touched: a mapping of this data.mdb (its name and inode), shared, not writable, of the
        map's size.  Bytes of map advised."""
        try:
            size = self.env.info()["map_size"]
            path = os.path.join(self._path, "data.mdb")
            if self._map_real is None:
                self._map_real = os.path.realpath(path)
            spans = self._map_spans
            if not spans or spans[0][1] != size or not _still_mapped(spans, self._map_real):
                spans = self._map_spans = _find_map(path, size)  # mapped anew (grown, reopened)
            return _advise(spans)
        except (OSError, ValueError, AttributeError) as e:  # memory, never the record
            global _trim_warned
            if not _trim_warned:  # said once
                _trim_warned = True
                log.warning("cannot let go of the journal map's pages (RSS grows with it): %s", e)
            return 0

    def close(self) -> None:
        if self._held or self._held_events or self._pending:
            try:
                self.flush()
            except JournalError as e:
                log.error("closing the journal: %d held note(s) and event(s) could not be "
                          "committed: %s", self.held, e)
        self._ahead.close()
        self.env.close()
        self._release_lock()

    def _release_lock(self) -> None:
        """After the environment is closed (or was never opened): the fds that held it."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._compact_lock is not None:
            os.close(self._compact_lock)
            self._compact_lock = None


_SESSION_DBS = {"sessions": "id", "turns": "session", "calls": "session"}
MADE_NAME = "made"  # written once a journal's format record is: a record is kept here
COMPACT_LOCK = "compact.lock"  # held shared by every open Journal; alone by a compaction
WRITER_LOCK = "writer.lock"    # held by the one process that writes: the daemon, or a gc


def hold_lock(journal_dir: str, name: str, *, shared: bool, wait: float = 0.0) -> int | None:
    """An fd holding flock ``name`` in the journal dir (shared or alone), waiting up to ``wait``
    seconds; JournalError (EBUSY) when it is held otherwise.  None when the lock file cannot
    be opened at all (a reader without write access to the dir): no lock then."""
    path = os.path.join(journal_dir, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return None
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise JournalError(f"the journal in {os.path.dirname(journal_dir)} is busy "
                                   f"({name} is held: " + ("a gc is compacting it" if shared
                                                          else "another process writes it")
                                   + ")", errno.EBUSY) from None
            time.sleep(0.05)


def compact(state_dir: str) -> dict:
    """Give the data file's free pages back to the filesystem: a compacting copy (LMDB's
    ``mdb_env_copy2(MDB_CP_COMPACT)``), fsynced and renamed over data.mdb, and a fresh lock
    file (the copy starts its transaction ids again).  Only when no process has the journal
    open (COMPACT_LOCK taken alone, so none can open it meanwhile either); otherwise nothing,
    and ``{"compacted": False, "why": ...}``."""
    path = os.path.join(state_dir, "journal")
    data = os.path.join(path, "data.mdb")
    try:
        lock = hold_lock(path, COMPACT_LOCK, shared=False)
    except JournalError:
        return {"compacted": False, "why": "the journal is open in another process (mounted, "
                "or a reader): its free pages are reused by the journal, and given back by a "
                "gc while nothing has it open"}
    try:
        before = os.stat(data).st_size
        tmp = data + ".compact"
        env = lmdb.open(path, readonly=True, lock=True, max_dbs=len(schema.DBS) + 1,
                        map_size=max(schema.READ_MAP_SIZE, 2 * before))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                env.copyfd(fd, compact=True)
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            env.close()
        if os.environ.get("OVERLAYREC_TEST_GC_KILL") == "compact":
            os.kill(os.getpid(), 9)  # tests: killed with the copy made, not yet in place
        os.rename(tmp, data)
        try:
            os.unlink(os.path.join(path, "lock.mdb"))  # its txn ids are the old file's
        except FileNotFoundError:
            pass
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        after = os.stat(data).st_size
        return {"compacted": True, "before": before, "after": after, "freed": before - after}
    except (OSError, lmdb.Error) as e:
        try:
            os.unlink(data + ".compact")
        except OSError:
            pass
        return {"compacted": False, "why": f"compaction failed: {e}"}
    finally:
        if lock is not None:
            os.close(lock)


# the fields the readers index without asking: (name, type, required)
_EVENT_FIELDS = (("seq", int, True), ("t", int, True), ("op", str, True), ("path", str, False),
                 ("path2", str, False), ("actor", str, False), ("unit", str, False))


def decode_event(seq: int, raw: bytes) -> tuple[dict | None, str | None]:
    """Event ``seq``'s record decoded and checked for what every reader takes for granted:
    (the event, None), or (None, what makes it no event: the message's tail)."""
    try:
        ev = _loads(raw)
    except ValueError as e:  # not JSON (UnicodeDecodeError cannot happen: surrogateescape)
        return None, f"is not valid JSON ({e})"
    why = _event_defect(ev, seq)
    return (ev, None) if why is None else (None, why)


def _event_defect(ev, seq: int) -> str | None:
    """What makes a decoded record no event (the message's tail), or None."""
    if type(ev) is dict:  # the common case in one expression: every reader decodes every event
        g = ev.get
        if g("seq") == seq and type(g("seq")) is int and type(g("t")) is int and \
                type(g("op")) is str and g("op") != "failed" and \
                type(g("path", "")) is str and type(g("path2", "")) is str and \
                g("path", "")[:1] != "/" and g("path2", "")[:1] != "/" and \
                type(g("actor", "")) is str and type(g("unit", "")) is str:
            return None
    if not isinstance(ev, dict):
        return f"is not a JSON object but {type(ev).__name__}"
    for name, kind, required in _EVENT_FIELDS:
        v = ev.get(name)
        if v is None:
            if required:
                return f"has no {name!r} field"
        elif not isinstance(v, kind) or isinstance(v, bool):
            return f"has a bad {name!r} field ({str(v)[:40]!r})"
    if ev["seq"] != seq:
        return f"says it is event {ev['seq']}"
    for name in ("path", "path2"):
        if (ev.get(name) or "")[:1] == "/":
            # every path is the workspace's own; an absolute one was journaled by a recorder
            # that kept the root's path as it was at mount after a directory above the
            # workspace was renamed: no reader can place the change
            return (f"names an absolute path ({ev[name][:60]!r}), not one in the workspace "
                    "(a directory above the mounted workspace renamed, by an older overlayrec)")
    if ev["op"] == "failed" and (not isinstance(ev.get("ref"), int) or isinstance(ev["ref"], bool)):
        return "has no 'ref' field (the event that failed)"
    return None


_trim_warned = False


def _find_map(path: str, size: int) -> list[tuple[int, int]]:
    """The read-only shared mappings of ``path`` (its name and inode) of ``size`` bytes in this
    process, from /proc/self/maps: (address, size)."""
    st = os.stat(path)
    real = os.path.realpath(path)
    spans = []
    with open("/proc/self/maps", errors="surrogateescape") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) < 6 or fields[5].rstrip("\n") != real:
                continue
            span, perms, _offset, _dev, ino = fields[:5]
            if int(ino) != st.st_ino or perms[1] != "-" or perms[3] != "s":
                continue
            lo, hi = (int(x, 16) for x in span.split("-"))
            if hi - lo == size:
                spans.append((lo, size))
    return spans


def _still_mapped(spans: list[tuple[int, int]], real: str) -> bool:
    """Is each of ``spans`` still one mapping of the file ``real`` (its entry in
    /proc/self/map_files: a readlink, where reading /proc/self/maps costs a hundred times
    more)?"""
    try:
        return bool(spans) and all(
            os.readlink(f"/proc/self/map_files/{lo:x}-{lo + size:x}") == real
            for lo, size in spans)
    except OSError:
        return False


def _advise(spans: list[tuple[int, int]]) -> int:
    """Let go of these spans' pages (underlay.madvise_dontneed); the bytes advised."""
    for lo, size in spans:
        madvise_dontneed(lo, size)
    return sum(size for _, size in spans)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _lmdb_errno(e: lmdb.Error) -> int:
    """The errno behind an LMDB error: the system's where LMDB passed one on (py-lmdb's
    ``code``, else its message), ENOSPC for a map that cannot grow, else EIO."""
    if isinstance(e, (lmdb.MapFullError, lmdb.DiskError)):
        return errno.ENOSPC
    code = getattr(e, "code", None)
    if isinstance(code, int) and code > 0:
        return code if code in _PASSED_ERRNOS else errno.EIO
    text = str(e)
    for code in _PASSED_ERRNOS:
        if os.strerror(code) in text:
            return code
    return errno.EIO


def _free_bytes(path: str) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 1 << 62
    return st.f_bavail * st.f_frsize


def _rename_record(ev: dict) -> dict:
    return {"src": ev["path"], "dst": ev["path2"], "flags": ev.get("flags", 0)}


class _ReadOnlyContent(ContentStore):
    def __init__(self, root: str):  # no mkdir: readers never create state
        self.root = root
