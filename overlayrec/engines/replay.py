"""Forensic replay: points in the journal, the tree as it stood at one, and a path's history."""
from __future__ import annotations

import datetime as dt
import os
import shutil
import stat

from ..journal import Journal
from .diff import SelectionError, file_events, _find_turn, _visible
from .states import States, State


def resolve_point(j: Journal, spec: str) -> int:
    """A point as a sequence number: SEQ, a time (ISO 8601 or @epoch-seconds), turn:N, call:ID,
    and before:/after: either of those (after: is the default)."""
    side = "after"
    if spec.startswith(("before:", "after:")):
        side, spec = spec.split(":", 1)
    if spec.isdigit():
        n = int(spec)
        return n - 1 if side == "before" else n
    if spec.startswith("turn:"):
        t = _find_turn(j, spec[5:], None)
        return t["begin_seq"] - 1 if side == "before" else (t["end_seq"] or j.last_seq())
    if spec.startswith("call:"):
        cid = spec[5:]
        calls = [c for c in j.records("calls") if c["id"] == cid]
        if not calls:
            raise SelectionError(f"no call {cid}")
        c = calls[0]
        return (c["begin_seq"] or 1) - 1 if side == "before" else (c["end_seq"] or j.last_seq())
    try:
        t = float(spec[1:]) if spec.startswith("@") else \
            dt.datetime.fromisoformat(spec).timestamp()
    except ValueError:
        raise SelectionError(f"not a point: {spec!r} (SEQ, a time, turn:N, call:ID, "
                             "before:/after: either)") from None
    t_ns = int(t * 1e9)
    last = 0
    for e in j.events():
        if e["t"] > t_ns:
            break
        last = e["seq"]
    return last


def recorded_paths(j: Journal, until: int | None = None) -> list[str]:
    out = set()
    for e in file_events(j, 1, until):
        for p in (e.get("path"), e.get("path2")):
            if p is not None and _visible(p):
                out.add(p)
    return sorted(out)


def _write(root: str, rel: str, s: State) -> None:
    p = os.path.join(root, rel)
    if s.kind == "dir":
        os.makedirs(p, exist_ok=True)
        os.chmod(p, s.mode or 0o755)
        return
    os.makedirs(os.path.dirname(p), exist_ok=True)
    if os.path.lexists(p) and not os.path.isdir(p):
        os.unlink(p)
    if s.kind == "symlink":
        os.symlink(os.fsdecode(s.data), p)
    elif s.kind == "file":
        with open(p, "wb") as f:
            f.write(s.data)
        os.chmod(p, stat.S_IMODE(s.mode) or 0o644)
    elif s.kind == "fifo":
        os.mkfifo(p, stat.S_IMODE(s.mode) or 0o644)


def replay(j: Journal, states: States, point: int, dest: str, full_from: str | None = None) -> dict:
    """Write the recorded paths as they stood at ``point`` into ``dest`` (with ``full_from``:
    first the whole live tree, then the recorded paths rolled back)."""
    if full_from is not None:
        shutil.copytree(full_from, dest, symlinks=True, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".overlayrec-attic"))
    written = removed = 0
    inexact = []
    for rel in recorded_paths(j):
        s = states.state(rel, point)
        if not s.exact:
            inexact.append(rel)
        p = os.path.join(dest, rel)
        if not s.present:
            if os.path.lexists(p):
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p)
                else:
                    os.unlink(p)
                removed += 1
            continue
        if s.kind == "dir" and os.path.isdir(p):
            continue
        _write(dest, rel, s)
        written += 1
    return {"point": point, "written": written, "removed": removed, "inexact": inexact}


def blame(j: Journal, states: States, path: str, at: int | None = None) -> list[dict]:
    """A path's history, newest first: one entry per run of changes by one unit."""
    runs: list[dict] = []
    for e in states.events_on(path):
        if at is not None and e["seq"] > at:
            break
        unit = e.get("unit") or "outside:" + e["actor"]
        if runs and runs[-1]["unit"] == unit:
            r = runs[-1]
        else:
            r = {"unit": unit, "first_seq": e["seq"], "ops": [], "actors": [], "t_first": e["t"]}
            runs.append(r)
        r["last_seq"], r["t_last"] = e["seq"], e["t"]
        op = e["op"] if e.get("path2") is None else \
            f"{e['op']} {'to ' + e['path2'] if e['path'] == path else 'from ' + e['path']}"
        if op not in r["ops"]:
            r["ops"].append(op)
        if e["actor"] not in r["actors"]:
            r["actors"].append(e["actor"])
    for r in runs:
        before = states.state(path, r["first_seq"] - 1)
        after = states.state(path, r["last_seq"])
        r["before"] = {"kind": before.kind, "size": len(before.data)}
        r["after"] = {"kind": after.kind, "size": len(after.data)}
        r["processes"] = [dict(key=k, **{f: (j.actor(k) or {}).get(f) for f in
                                          ("pid", "argv", "cwd", "uid")}) for k in r["actors"]]
        del r["actors"]
    return list(reversed(runs))
