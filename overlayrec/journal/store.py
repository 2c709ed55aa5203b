"""The Journal: opens the LMDB environment described in ``schema``, appends events and actors,
and reads them back for the log and the engines.

Write-ahead is the caller's contract: ``append`` commits before it returns, so a caller that
changes the underlay only after ``append`` returned never changes it unrecorded.  Commits are
not fsynced by default (they reach the page cache, which a killed daemon cannot lose);
``durable=True`` syncs every commit, for power loss.
"""
from __future__ import annotations

import json
import os
import time
from typing import Iterator

import lmdb

from . import schema
from .content import ContentStore
from .schema import JournalError, seq_key, key_seq, path_key, path_key_split


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
        if readonly and not os.path.exists(os.path.join(path, "data.mdb")):
            raise JournalError(f"no journal in {state_dir}")
        try:
            if not readonly:
                os.makedirs(path, mode=0o700, exist_ok=True)
            self.env = lmdb.open(
                path, map_size=schema.MAP_SIZE, max_dbs=len(schema.DBS) + 1,
                subdir=True, readonly=readonly, lock=True,
                sync=durable, metasync=durable, writemap=not durable and not readonly,
                map_async=False, max_readers=256)
            self.dbs = {}
            for name in schema.DBS:
                try:
                    self.dbs[name] = self.env.open_db(name.encode(), create=not readonly)
                except lmdb.NotFoundError:
                    self.dbs[name] = None  # a journal older than this table (read only)
        except lmdb.Error as e:
            raise JournalError(f"cannot open journal {path}: {e}") from None
        self.content = ContentStore(os.path.join(state_dir, "content")) if not readonly else \
            _ReadOnlyContent(os.path.join(state_dir, "content"))
        self._check_format(workspace)
        self._next_seq = self._load_next_seq()
        self._known_actors: set[str] = set()
        if not readonly and self.meta("renames_indexed") is None:
            self._index_renames()

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
        try:
            with self.env.begin(write=True, db=self.dbs["meta"]) as txn:
                txn.put(key.encode(), value.encode("utf-8", "surrogateescape"))
        except lmdb.Error as e:
            raise JournalError(f"journal write failed: {e}") from None

    def meta(self, key: str) -> str | None:
        with self.env.begin(db=self.dbs["meta"]) as txn:
            v = txn.get(key.encode())
        return v.decode("utf-8", "surrogateescape") if v is not None else None

    def _load_next_seq(self) -> int:
        with self.env.begin(db=self.dbs["events"]) as txn:
            cur = txn.cursor()
            return key_seq(cur.key()) + 1 if cur.last() else 1

    # -- writing --------------------------------------------------------------------------------
    def reserve_seq(self) -> int:
        """A sequence number for an event about to be appended (e.g. to name its attic entry)."""
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def append(self, event: dict, actor: dict | None = None) -> int:
        """Commit one event (and its actor, the first time it is seen); returns its seq."""
        return self.append_many([event], [actor] if actor else [])[0]

    def append_many(self, events: list[dict], actors: list[dict]) -> list[int]:
        seqs = []
        try:
            with self.env.begin(write=True) as txn:
                for a in actors:
                    if a["key"] in self._known_actors:
                        continue
                    akey = a["key"].encode()
                    if txn.get(akey, db=self.dbs["actors"]) is None:
                        txn.put(akey, _dumps(a), db=self.dbs["actors"])
                    self._known_actors.add(a["key"])
                for ev in events:
                    if "seq" not in ev:
                        ev["seq"] = self.reserve_seq()
                    ev.setdefault("t", time.time_ns())
                    k = seq_key(ev["seq"])
                    txn.put(k, _dumps(ev), db=self.dbs["events"])
                    for p in (ev.get("path"), ev.get("path2")):
                        if p is not None:
                            txn.put(path_key(p, ev["seq"]), b"", db=self.dbs["paths"])
                    if schema.is_dir_rename(ev):
                        txn.put(k, _dumps(_rename_record(ev)), db=self.dbs["renames"])
                    elif ev["op"] == "seal":
                        txn.put(schema.seal_key(ev["path"]),
                                k + ev["path"].encode("utf-8", "surrogateescape"),
                                db=self.dbs["seals"])
                    seqs.append(ev["seq"])
        except lmdb.Error as e:
            raise JournalError(f"journal write failed: {e}") from None
        return seqs

    def _index_renames(self) -> None:
        """Index the directory renames of a journal written before that index existed."""
        found = [ev for ev in self.events() if schema.is_dir_rename(ev)]
        with self.env.begin(write=True) as txn:
            for ev in found:
                txn.put(seq_key(ev["seq"]), _dumps(_rename_record(ev)), db=self.dbs["renames"])
            txn.put(b"renames_indexed", b"1", db=self.dbs["meta"])

    def put_record(self, db: str, key: bytes, record: dict) -> None:
        """Write a session, turn or call record (they change as they begin and end)."""
        try:
            with self.env.begin(write=True, db=self.dbs[db]) as txn:
                txn.put(key, _dumps(record))
        except lmdb.Error as e:
            raise JournalError(f"journal write failed: {e}") from None

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
        with self.env.begin(write=True, db=self.dbs["extents"]) as txn:
            txn.put(seq_key(seq), _dumps(summary))

    # -- reading --------------------------------------------------------------------------------
    def count(self) -> int:
        with self.env.begin(db=self.dbs["events"]) as txn:
            return txn.stat(self.dbs["events"])["entries"]

    def last_seq(self) -> int:
        return self._load_next_seq() - 1

    def event(self, seq: int) -> dict | None:
        with self.env.begin(db=self.dbs["events"]) as txn:
            v = txn.get(seq_key(seq))
        return _loads(v) if v is not None else None

    def events(self, since: int = 1, until: int | None = None) -> Iterator[dict]:
        try:
            with self.env.begin(db=self.dbs["events"]) as txn:
                cur = txn.cursor()
                if not cur.set_range(seq_key(since)):
                    return
                for k, v in cur:
                    if until is not None and key_seq(k) > until:
                        break
                    yield _loads(v)
        except (lmdb.Error, ValueError) as e:
            raise JournalError(f"journal in {self.state_dir} is corrupt: {e}") from None

    def seqs_for_path(self, path: str) -> list[int]:
        prefix = path.encode("utf-8", "surrogateescape") + b"\0"
        out = []
        with self.env.begin(db=self.dbs["paths"]) as txn:
            cur = txn.cursor()
            if cur.set_range(prefix):
                for k in cur.iternext(values=False):
                    if not k.startswith(prefix):
                        break
                    out.append(path_key_split(k)[1])
        return out

    def paths(self) -> Iterator[str]:
        last = None
        with self.env.begin(db=self.dbs["paths"]) as txn:
            for k in txn.cursor().iternext(values=False):
                p = path_key_split(k)[0]
                if p != last:
                    last = p
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
        prefix = path.encode("utf-8", "surrogateescape") + b"\0"
        with self.env.begin(db=self.dbs["paths"]) as txn:
            cur = txn.cursor()
            nxt = path.encode("utf-8", "surrogateescape") + b"\1"
            if cur.set_range(nxt):
                if not cur.prev():
                    return None
            elif not cur.last():
                return None
            k = cur.key()
            return key_seq(k[-8:]) if k.startswith(prefix) and len(k) == len(prefix) + 8 else None

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


def _rename_record(ev: dict) -> dict:
    return {"src": ev["path"], "dst": ev["path2"], "flags": ev.get("flags", 0)}


class _ReadOnlyContent(ContentStore):
    def __init__(self, root: str):  # no mkdir: readers never create state
        self.root = root
