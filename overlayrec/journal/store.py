"""The Journal: opens the LMDB environment described in ``schema``, appends events and actors,
and reads them back for the log and the engines.

Write-ahead is the caller's contract: ``append`` commits before it returns, so a caller that
changes the underlay only after ``append`` returned never changes it unrecorded.  Commits are
not fsynced by default (they reach the page cache, which a killed daemon cannot lose);
``durable=True`` syncs every commit, for power loss.

A commit that cannot be made (the state dir's filesystem is full, a quota, an I/O error) raises
JournalError with the errno the filesystem operation that needed it should fail with; the
environment stays usable, and the next commit succeeds once there is room again.  LMDB writes
through the file, not through its map (no MDB_WRITEMAP), so a full filesystem is never a SIGBUS,
and the map grows as the data does (``_grow``): data.mdb is as long as what it holds.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import time
from typing import Iterator

import lmdb

from . import schema
from .content import ContentStore
from ..state import private_dir
from .schema import JournalError, seq_key, key_seq, path_key, path_key_split

log = logging.getLogger(__name__)

# system errors a commit may fail with that the caller gets as they are (anything else is EIO)
_PASSED_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.EROFS, errno.ENOMEM)
_LOW_SPACE = 1 << 20  # an EIO from a commit with less free than this in the state dir: ENOSPC


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogateescape")


def _loads(b: bytes):
    return json.loads(b.decode("utf-8", "surrogateescape"))


class Journal:
    def __init__(self, state_dir: str, *, readonly: bool = False, durable: bool = False,
                 workspace: str | None = None):
        self.state_dir = state_dir
        self.readonly = readonly
        path = os.path.join(state_dir, "journal")
        self._path, self._durable = path, durable
        if readonly and not os.path.exists(os.path.join(path, "data.mdb")):
            raise JournalError(f"no journal in {state_dir}")
        try:
            if not readonly:
                private_dir(path)  # 0700 whatever the umask (docs/storage.md)
            self._open_env()
        except lmdb.Error as e:
            raise JournalError(f"cannot open journal {path}: {e}", _lmdb_errno(e)) from None
        self.content = ContentStore(os.path.join(state_dir, "content")) if not readonly else \
            _ReadOnlyContent(os.path.join(state_dir, "content"))
        self._check_format(workspace)
        self._next_seq = self._load_next_seq()
        self._known_actors: set[str] = set()
        if not readonly and self.meta("renames_indexed") is None:
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
        self.env = lmdb.open(
            path, map_size=map_size, max_dbs=len(schema.DBS) + 1,
            subdir=True, readonly=readonly, lock=True,
            sync=self._durable, metasync=self._durable, writemap=False,
            map_async=False, max_readers=256)
        try:
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
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
            try:
                os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
            finally:
                os.close(fd)
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
        for _ in range(16):
            try:
                with self.env.begin(write=True) as txn:
                    return body(txn)
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
        code = _lmdb_errno(e)
        if code == errno.EIO and _free_bytes(self.state_dir) < _LOW_SPACE:
            code = errno.ENOSPC  # LMDB reports a short write (a full disk) as EIO
        return JournalError(f"journal write failed: {e}", code)

    # -- format ---------------------------------------------------------------------------------
    def _check_format(self, workspace: str | None) -> None:
        try:
            with self.env.begin(db=self.dbs["meta"], write=not self.readonly) as txn:
                fmt = txn.get(b"format")
                if fmt is None:
                    if self.readonly:
                        raise JournalError(f"journal in {self.state_dir} is empty or corrupt "
                                           "(no format record)")
                    txn.put(b"format", str(schema.FORMAT_VERSION).encode())
                    txn.put(b"created", str(time.time_ns()).encode())
                    if workspace:
                        txn.put(b"workspace", workspace.encode("utf-8", "surrogateescape"))
                    return
                try:
                    version = int(fmt)
                except ValueError:
                    raise JournalError(f"journal in {self.state_dir} is corrupt "
                                       f"(format record {fmt!r})") from None
                if version != schema.FORMAT_VERSION:
                    raise JournalError(
                        f"journal in {self.state_dir} has format {version}; this overlayrec "
                        f"reads format {schema.FORMAT_VERSION}")
        except lmdb.Error as e:
            raise JournalError(f"journal in {self.state_dir} is corrupt: {e}") from None

    def put_meta(self, key: str, value: str) -> None:
        db = self.dbs["meta"]
        self._write(lambda txn: txn.put(key.encode(), value.encode("utf-8", "surrogateescape"),
                                        db=db))

    def meta(self, key: str) -> str | None:
        with self.env.begin(db=self.dbs["meta"]) as txn:
            v = txn.get(key.encode())
        return v.decode("utf-8", "surrogateescape") if v is not None else None

    def _load_next_seq(self) -> int:
        with self.env.begin(db=self.dbs["events"]) as txn:
            cur = txn.cursor()
            return key_seq(cur.key()) + 1 if cur.last() else 1

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
        return self.append_many([event], [actor] if actor else [])[0]

    def append_many(self, events: list[dict], actors: list[dict]) -> list[int]:
        """Commit events (and the actors not seen before) in one transaction; their seqs.
        JournalError (with ``errno``) when the commit cannot be made: then nothing of it is in
        the journal."""
        added: list[str] = []
        assigned: list[tuple[dict, bool]] = []  # events given their seq here (and their time?)

        def body(txn) -> list[int]:
            seqs = []
            added.clear()
            for a in actors:
                if a["key"] in self._known_actors:
                    continue
                akey = a["key"].encode()
                if txn.get(akey, db=self.dbs["actors"]) is None:
                    txn.put(akey, _dumps(a), db=self.dbs["actors"])
                added.append(a["key"])
            for ev in events:
                if "seq" not in ev:
                    ev["seq"] = self.reserve_seq()
                    assigned.append((ev, "t" not in ev))
                ev.setdefault("t", time.time_ns())
                k = seq_key(ev["seq"])
                txn.put(k, _dumps(ev), db=self.dbs["events"])
                for p in (ev.get("path"), ev.get("path2")):
                    if p is not None:
                        txn.put(path_key(p, ev["seq"]), schema.path_value(p),
                                db=self.dbs["paths"])
                if schema.is_dir_rename(ev):
                    txn.put(k, _dumps(_rename_record(ev)), db=self.dbs["renames"])
                elif ev["op"] == "seal":
                    txn.put(schema.seal_key(ev["path"]),
                            k + ev["path"].encode("utf-8", "surrogateescape"),
                            db=self.dbs["seals"])
                seqs.append(ev["seq"])
            return seqs

        try:
            seqs = self._write(body)
        except JournalError:
            # not committed: the seqs given here go back (nothing was reserved meanwhile), and
            # the events can be appended again later in their place in the order
            if assigned and self._next_seq == assigned[-1][0]["seq"] + 1:
                self._next_seq = assigned[0][0]["seq"]
            for ev, timed_here in assigned:
                del ev["seq"]
                if timed_here:
                    ev.pop("t", None)
            raise
        self._known_actors.update(added)  # only once committed
        return seqs

    def _index_renames(self) -> None:
        """Index the directory renames of a journal written before that index existed."""
        found = [ev for ev in self.events() if schema.is_dir_rename(ev)]

        def body(txn):
            for ev in found:
                txn.put(seq_key(ev["seq"]), _dumps(_rename_record(ev)), db=self.dbs["renames"])
            txn.put(b"renames_indexed", b"1", db=self.dbs["meta"])
        self._write(body)

    def put_record(self, db: str, key: bytes, record: dict) -> None:
        """Write a session, turn or call record (they change as they begin and end)."""
        handle, value = self.dbs[db], _dumps(record)
        self._write(lambda txn: txn.put(key, value, db=handle))

    def records(self, db: str, prefix: bytes = b"") -> list[dict]:
        out = []
        with self.env.begin(db=self.dbs[db]) as txn:
            cur = txn.cursor()
            if cur.set_range(prefix):
                for k, v in cur:
                    if not k.startswith(prefix):
                        break
                    out.append(_loads(v))
        return out

    def record(self, db: str, key: bytes) -> dict | None:
        with self.env.begin(db=self.dbs[db]) as txn:
            v = txn.get(key)
        return _loads(v) if v is not None else None

    def put_extents(self, seq: int, summary: dict) -> None:
        handle, value = self.dbs["extents"], _dumps(summary)
        self._write(lambda txn: txn.put(seq_key(seq), value, db=handle))

    # -- reading --------------------------------------------------------------------------------
    def count(self) -> int:
        with self.env.begin(db=self.dbs["events"]) as txn:
            return txn.stat(self.dbs["events"])["entries"]

    def last_seq(self) -> int:
        return self._load_next_seq() - 1

    def event(self, seq: int) -> dict | None:
        """Event ``seq``, or None; JournalError when its record is not an event."""
        try:
            with self.env.begin(db=self.dbs["events"]) as txn:
                v = txn.get(seq_key(seq))
        except lmdb.Error as e:
            raise JournalError(f"journal in {self.state_dir} is corrupt: {e}") from None
        return self._decode_event(seq, v) if v is not None else None

    def events(self, since: int = 1, until: int | None = None) -> Iterator[dict]:
        """The events from ``since`` to ``until`` (inclusive), in order; JournalError naming
        the first record that is not an event."""
        try:
            with self.env.begin(db=self.dbs["events"]) as txn:
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
                    yield self._decode_event(seq, v)
        except lmdb.Error as e:
            raise JournalError(f"journal in {self.state_dir} is corrupt: {e}") from None

    def _decode_event(self, seq: int, raw: bytes) -> dict:
        """One event's record, checked for what every reader takes for granted."""
        try:
            ev = _loads(raw)
        except ValueError as e:  # not JSON (UnicodeDecodeError cannot happen: surrogateescape)
            why = f"is not valid JSON ({e})"
        else:
            why = _event_defect(ev, seq)
            if why is None:
                return ev
        raise JournalError(f"journal in {self.state_dir} is corrupt: event {seq} {why}")

    def seqs_for_path(self, path: str) -> list[int]:
        """The seqs of every event naming ``path``, ascending (whatever form its keys have)."""
        out = []
        with self.env.begin(db=self.dbs["paths"]) as txn:
            cur = txn.cursor()
            for prefix, value in schema.path_prefixes(path):
                if cur.set_range(prefix):
                    for k, v in cur:
                        if not k.startswith(prefix):
                            break
                        if len(k) == len(prefix) + 8 and v == value:
                            out.append(key_seq(k[-8:]))
        return sorted(out)

    def paths(self) -> Iterator[str]:
        """Every path the events name, once each, in key order (a long path's place is that of
        its digest)."""
        last = None
        long_seen: set[str] = set()
        with self.env.begin(db=self.dbs["paths"]) as txn:
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
        if self.dbs["renames"] is None or self.meta("renames_indexed") is None:
            return [dict(_rename_record(ev), seq=ev["seq"]) for ev in self.events()
                    if schema.is_dir_rename(ev)]
        out = []
        with self.env.begin(db=self.dbs["renames"]) as txn:
            for k, v in txn.cursor():
                out.append(dict(_loads(v), seq=key_seq(k)))
        return out

    def seals(self) -> Iterator[tuple[str, int]]:
        """(path, seq of its latest seal), every sealed path."""
        if self.dbs["seals"] is None:
            return
        with self.env.begin(db=self.dbs["seals"]) as txn:
            for _, v in txn.cursor():
                yield v[8:].decode("utf-8", "surrogateescape"), key_seq(v[:8])

    def last_seq_for_path(self, path: str) -> int | None:
        """The seq of the last event naming ``path``, or None."""
        best = None
        with self.env.begin(db=self.dbs["paths"]) as txn:
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

    def actor(self, key: str) -> dict | None:
        with self.env.begin(db=self.dbs["actors"]) as txn:
            v = txn.get(key.encode())
        return _loads(v) if v is not None else None

    def extents(self, seq: int) -> dict | None:
        with self.env.begin(db=self.dbs["extents"]) as txn:
            v = txn.get(seq_key(seq))
        return _loads(v) if v is not None else None

    def close(self) -> None:
        self.env.close()


# the fields the readers index without asking: (name, type, required)
_EVENT_FIELDS = (("seq", int, True), ("t", int, True), ("op", str, True), ("path", str, False),
                 ("path2", str, False), ("actor", str, False), ("unit", str, False))


def _event_defect(ev, seq: int) -> str | None:
    """What makes a decoded record no event (the message's tail), or None."""
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
    if ev["op"] == "failed" and (not isinstance(ev.get("ref"), int) or isinstance(ev["ref"], bool)):
        return "has no 'ref' field (the event that failed)"
    return None


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
