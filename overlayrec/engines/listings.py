"""The listings' rows (``turns``, ``calls``) with their net changes, kept between runs.

A row's net (which paths a unit left changed: views.unit_listing through diff.Net) is settled
for good once every state it compares was read from an event after its point: the journal is
append-only, so later events cannot change it.  Settled rows are kept in the state dir
(``listings/``, docs/storage.md) with the last event they saw.  The next listing decodes only
the events since then, and computes again only the rows those events touch (a call's late
writes) and the rows not settled (an open epoch, a secret, content only the attic or the live
tree holds, a directory rename); the rest it reads back.

The rows are kept in shards a listing reads only when it shows them: the turns in one file,
the calls in one file per (session, turn).  ``calls --turn N`` and ``turns`` then decode a
hundred rows, not every call's paths (10,000 calls were 5 MB of JSON, 60 ms to decode).

The files are derived and private to this module: each names the journal it was made from
(its creation time and retention cut) and the code that made it (``state.code_ident``: an
upgrade computes its rows afresh), and is rebuilt when it does not fit; a failed event that
refers to an event it saw throws it away; removing them costs only time.  A reader that cannot
write them (a read-only state dir) lists all the same.
"""
from __future__ import annotations

import bisect
import json
import os

import xxhash

try:  # the kept rows of 10k calls are megabytes: the faster decoder where there is one
    import orjson
except ImportError:
    orjson = None

from ..journal import Journal
from ..journal.schema import CONTROL_OPS, MARK_OPS, turn_unit
from ..state import code_ident, replace_private
from ..views import (call_fields, call_unit, calls_of, file_events, turn_fields,
                     turn_record_fields)
from .states import States

VERSION = 4  # 3: rows name their paths not known exactly (``inexact``); 4: a call's
# paths another writer changed between its own changes (``interleaved``)
LEGACY = "listings.json"  # the single file of version 1, beside the directory: removed on save


class Kept:
    """The rows of one shard kept for one journal, and what happened in it since they were
    made (``fresh``: the events after the oldest shard's last, shared by the shards)."""

    def __init__(self, path: str, ident: list, last: int, doc: dict | None, fresh: list[dict]):
        self.path, self.ident, self.last = path, ident, last
        self.rows: dict[str, dict] = {}
        self.upto = 0
        self.changed = False
        if doc is not None:
            self.rows, self.upto = doc["rows"], doc["upto"]
            fresh = [e for e in fresh if e["seq"] > self.upto]
            # a unit that wrote again (a call's late writes) is computed again, and a failed
            # event that refers to one already seen changes any row: start over
            if any(e["op"] == "failed" and e["ref"] <= self.upto for e in fresh):
                self.rows, self.changed = {}, True
            for e in fresh:
                if self.rows.pop(e.get("unit") or "", None) is not None:
                    self.changed = True
        if self.upto != self.last:
            self.changed = True

    def get(self, key: str, check=None) -> dict | None:
        """The kept row of ``key`` (if ``check(row)`` accepts it); its ``touched`` may be None,
        kept once when it equals the net (see put): ``_whole`` makes the row a listing shows."""
        row = self.rows.get(key)
        if row is None or (check is not None and not check(row)):
            return None
        return row

    def put(self, key: str, row: dict, settled: bool) -> None:
        if settled:
            self.rows[key] = dict(row, touched=None) if row["touched"] == row["paths"] else row
            self.changed = True
        elif self.rows.pop(key, None) is not None:
            self.changed = True

    def save(self) -> None:
        """Write the rows (a temp file of this process renamed over the file); a state dir
        that cannot take it is no error: the listing is made all the same."""
        if not self.changed:
            return
        data = json.dumps({"version": VERSION, "journal": self.ident, "upto": self.last,
                           "rows": self.rows}, separators=(",", ":")).encode()
        if not replace_private(self.path, data):
            return
        try:
            os.unlink(os.path.join(os.path.dirname(os.path.dirname(self.path)), LEGACY))
        except OSError:
            pass


def _load(path: str, ident: list, last: int) -> dict | None:
    try:
        with open(path, "rb") as f:
            raw = f.read()
        doc = orjson.loads(raw) if orjson is not None else json.loads(raw)
    except (OSError, ValueError):  # orjson's JSONDecodeError is a ValueError too
        return None
    if not isinstance(doc, dict) or doc.get("version") != VERSION or \
            doc.get("journal") != ident or not isinstance(doc.get("rows"), dict) or \
            not isinstance(doc.get("upto"), int) or not 0 < doc["upto"] <= last:
        return None
    return doc


def shards(j: Journal, kept_dir: str, names) -> dict[str, Kept]:
    """The kept shards ``names`` (file names without ".json") of the journal ``j``; the events
    since the oldest of them are decoded once for all."""
    ident, last = [j.meta("created"), j.cut, code_ident()], j.last_seq()
    docs = {n: _load(os.path.join(kept_dir, n + ".json"), ident, last) for n in names}
    lo = min((d["upto"] for d in docs.values() if d is not None), default=last)
    fresh = [e for e in j.events(lo + 1, last)
             if e["op"] not in CONTROL_OPS and e["op"] not in MARK_OPS] if lo < last else []
    return {n: Kept(os.path.join(kept_dir, n + ".json"), ident, last, d, fresh)
            for n, d in docs.items()}


def _calls_shards(calls: list[dict]) -> list[str]:
    """The shard of each call's row: its session (hashed: any id makes a file name) and
    turn."""
    names: dict[tuple, str] = {}  # (session, turn) -> its shard: a name made once
    out = []
    for c in calls:
        key = (c["session"], c.get("turn") or 0)
        name = names.get(key)
        if name is None:
            tag = xxhash.xxh64_hexdigest(key[0].encode())
            name = names[key] = f"calls-{tag}-{key[1]}"
        out.append(name)
    return out


def call_rows(j: Journal, states: States, kept_dir: str, sid: str | None = None,
              turn: int | None = None, progress=None) -> list[dict]:
    """views.call_rows with its net, kept rows read back and the others computed in one pass
    over the journal from the earliest call among them.  ``progress(done, total)`` is told of
    the rows computed (not those read back), every hundred and at the end."""
    rows = []
    for c, fields in call_pairs(j, states, kept_dir, sid, turn, progress):
        c.update(fields)  # the call's record, decoded for this listing alone, is its row
        rows.append(_whole(c))
    return rows


def call_pairs(j: Journal, states: States, kept_dir: str, sid: str | None = None,
               turn: int | None = None, progress=None) -> list[tuple[dict, dict]]:
    """call_rows as (the call's record, its row's other fields) each: a row is the two
    merged, its ``touched`` None when it is the ``paths`` (see Kept.put).  For a caller that
    reads a few fields of each (the text of ``calls``): 10,000 merges are some 10 ms."""
    calls = calls_of(j, sid, turn)
    where = _calls_shards(calls)
    kept = shards(j, kept_dir, set(where))
    found = [kept[w].get(call_unit(c)) for c, w in zip(calls, where)]
    todo = [c for c, fields in zip(calls, found) if fields is None]
    by_unit: dict[str, list[dict]] = {}
    net = None
    flat: list[dict] = []
    if todo:
        lo = min(c.get("begin_seq") or 1 for c in todo)
        from .diff import net_of  # rows to compute: only then
        net = net_of(states, preload=lo <= j.cut + 1 or not any(k.rows for k in kept.values()))
        flat = file_events(j, lo)
        for e in flat:
            by_unit.setdefault(e.get("unit") or "", []).append(e)
    seqs = [e["seq"] for e in flat]
    actors: dict = {}
    pairs = []
    done = 0
    for c, fields, w in zip(calls, found, where):
        if fields is None:
            key = call_unit(c)
            mine = by_unit.get(key, [])
            fields = call_fields(j, mine, net, actors)
            fields["interleaved"] = _interleaved(states, key, mine, flat, seqs, fields["paths"])
            kept[w].put(key, fields, net.settled)
            done += 1
            if progress is not None and (done % 100 == 0 or done == len(todo)):
                progress(done, len(todo))
        pairs.append((c, fields))
    for k in kept.values():
        k.save()
    return pairs


def _interleaved(states: States, unit: str, mine: list[dict], flat: list[dict],
                 seqs: list[int], paths: list[str]) -> dict[str, list[str]]:
    """The call's net ``paths`` another writer changed between its own changes, each with
    those writers, as ``diff --call`` names them (engines.diff._interleaved).  Only a call
    with another unit's event between its first and its last is looked at closely: most run
    alone, and the listing stays one pass."""
    if len(mine) < 2:
        return {}
    lo = bisect.bisect_right(seqs, mine[0]["seq"])
    hi = bisect.bisect_left(seqs, mine[-1]["seq"])
    if all(e.get("unit") == unit for e in flat[lo:hi]):
        return {}
    from .diff import Side, _interleaved as interleaved
    side = Side({}, {}, {p: {unit} for p in paths})
    interleaved(states, side, mine, flat[lo - 1:hi + 1], lambda u: u == unit)
    return {p: us for p, us in side.interleaved.items() if p in side.writers}


def turn_rows(j: Journal, states: States, kept_dir: str, sid: str | None = None,
              progress=None) -> list[dict]:
    """views.turn_rows with its net: a turn that ended before the kept rows were made, with
    the same bounds, is read back.  ``progress(done, total)``: as call_rows, every turn."""
    kept = shards(j, kept_dir, ["turns"])["turns"]
    turns = j.records("turns", (sid.encode() + b"\0") if sid else b"")

    def same_bounds(t):
        return lambda row: row["seq"] == [t["begin_seq"], t["end_seq"]]
    todo = [t for t in turns if kept.get(_turn_key(t), same_bounds(t)) is None]
    net = None
    if todo:
        from .diff import net_of  # rows to compute: only then
        net = net_of(states, preload=len(todo) > len(turns) // 2 or not kept.rows)
    actors: dict = {}
    rows = []
    done = 0
    for t in turns:
        key = _turn_key(t)
        fields = kept.get(key, same_bounds(t))
        if fields is None:
            fields = turn_fields(j, t, kept.last, net, actors)
            kept.put(key, fields, net.settled and bool(t["end_seq"]) and
                     t["end_seq"] <= kept.last)
            done += 1
            if progress is not None:
                progress(done, len(todo))
        rows.append(_whole({**turn_record_fields(t), **fields}))
    kept.save()
    return rows


def _whole(row: dict) -> dict:
    """A listing's row from a kept one (its own copy): ``touched`` filled in."""
    if row.get("touched") is None:
        row["touched"] = row["paths"]
    return row


def _turn_key(t: dict) -> str:
    return turn_unit(t["session"], t["index"])
