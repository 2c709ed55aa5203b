"""Listings of sessions, turns and calls: pure functions of the journal (no mount needed)."""
from __future__ import annotations

import os

from .journal import Journal
from .journal.schema import CONTROL_OPS


def unit_session(unit: str | None) -> str | None:
    """The session a unit key belongs to (None for an outside actor)."""
    if not unit:
        return None
    kind, _, rest = unit.partition(":")
    if kind in ("call", "turn"):
        return rest.rsplit(":", 1)[0] if kind == "turn" else rest.split(":", 1)[0]
    if kind == "session":
        return rest
    return None


def command_name(actor: dict | None) -> str:
    if not actor:
        return "?"
    if actor.get("argv"):
        return os.path.basename(actor["argv"][0])
    return os.path.basename(actor.get("exe") or "?")


def file_events(j: Journal, since: int = 1, until: int | None = None):
    """Events that change the tree (not control events, not failed ones)."""
    failed = set()
    evs = []
    for ev in j.events(since, until):
        if ev["op"] == "failed":
            failed.add(ev["ref"])
        elif ev["op"] not in CONTROL_OPS:
            evs.append(ev)
    return [e for e in evs if e["seq"] not in failed]


def _paths(ev: dict) -> list[str]:
    return [p for p in (ev.get("path"), ev.get("path2")) if p is not None]


def writer_name(j: Journal, unit: str, actors: dict) -> str:
    if unit.startswith("revert:"):
        return unit.replace(":", " ", 1)
    if unit.startswith("outside:"):
        key = unit.split(":", 1)[1]
        if key not in actors:
            actors[key] = j.actor(key)
        a = actors[key]
        return f"{command_name(a)}[{a['pid'] if a else '?'}]"
    return "session " + (unit_session(unit) or "?")


def turn_rows(j: Journal, sid: str | None = None) -> list[dict]:
    rows = []
    last = j.last_seq()
    actors: dict = {}
    for t in j.records("turns", (sid.encode() + b"\0") if sid else b""):
        s = t["session"]
        evs = file_events(j, t["begin_seq"], t["end_seq"] or last)
        mine, others = set(), set()
        for e in evs:
            if unit_session(e.get("unit")) == s:
                mine.update(_paths(e))
            else:
                others.add(writer_name(j, e.get("unit") or "outside:" + e["actor"], actors))
        rows.append({"session": s, "index": t["index"], "begin_t": t["begin_t"],
                     "end_t": t["end_t"], "prompt": t.get("prompt"), "files": len(mine),
                     "paths": sorted(mine), "others": sorted(others),
                     "seq": [t["begin_seq"], t["end_seq"]]})
    return rows


def call_rows(j: Journal, sid: str | None = None, turn: int | None = None) -> list[dict]:
    by_unit: dict[str, list[dict]] = {}
    for e in file_events(j):
        by_unit.setdefault(e.get("unit") or "", []).append(e)
    actors: dict = {}
    rows = []
    calls = j.records("calls", (sid.encode() + b"\0") if sid else b"")
    calls.sort(key=lambda c: c["begin_t"])
    for c in calls:
        if turn is not None and c.get("turn") != turn:
            continue
        evs = by_unit.get(f"call:{c['session']}:{c['id']}", [])
        procs = []
        for e in evs:
            if e["actor"] not in actors:
                actors[e["actor"]] = j.actor(e["actor"])
            name = f"{command_name(actors[e['actor']])}[{e['actor'].split(':')[0]}]"
            if name not in procs:
                procs.append(name)
        paths = sorted({p for e in evs for p in _paths(e)})
        rows.append({**c, "files": len(paths), "paths": paths, "processes": procs,
                     "events": len(evs), "late_events": sum(1 for e in evs if e.get("after_end"))})
    return rows


def session_summary(j: Journal, sid: str) -> list[str]:
    rec = j.record("sessions", sid.encode()) or {}
    start = None
    for ev in j.events():
        if ev["op"] == "session_begin" and ev.get("session") == sid:
            start = ev["seq"]
            break
    evs = file_events(j, start or 1)
    turns = [t for t in j.records("turns", sid.encode() + b"\0")]
    ncalls = len(j.records("calls", sid.encode() + b"\0"))
    by_writer: dict[str, set] = {}
    actors: dict = {}
    for e in evs:
        unit = e.get("unit") or "outside:" + e["actor"]
        if unit_session(unit) == sid:
            who = unit.split(":")[0] if not unit.startswith("call:") else "calls"
            who = "agent tool calls" if who == "calls" else "the agent itself"
        elif unit.startswith("revert:"):
            who = "reverts"
        elif unit_session(unit) is None:
            who = "outside: " + writer_name(j, unit, actors)
        else:
            who = "session " + unit_session(unit)
        by_writer.setdefault(who, set()).update(_paths(e))
    files = set().union(*by_writer.values()) if by_writer else set()
    lines = [f"overlayrec: session {sid}: {len(turns)} turn(s), {ncalls} call(s), "
             f"{len(files)} file(s) changed"]
    for who, paths in sorted(by_writer.items()):
        lines.append(f"  {who}: {len(paths)} file(s)")
    if rec.get("ended") is None:
        lines.append("  (session still open)")
    return lines
