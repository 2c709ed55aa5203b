"""The data of ``overlayrec report --html``: the record as a timeline (report_html renders it).

Lanes, in time order: per session, a lane per turn and, under it, a lane per call (the turn's or
call's span a bar, its diff a click away); then one lane for outside actors (an editor, another
terminal, edits made while unmounted), one for the late writes of background processes (events
after their call had ended: ``after_end``) and, when there were any, one for reverts.

A *change*, one mark on the timeline, is one file in a unit's diff: a path the unit left changed
(added, modified, deleted, its mode or kind changed), as ``overlayrec diff`` shows it, a file
that moved (``mv tests testsuite``) once, old name -> new name.  A unit here is a call (its
writes up to its end), a turn's or session's own writes outside any call, an outside actor, the
late writes of one call, or a revert.  Directories are not changes by themselves (their files
are), and changes under ``.git/`` are counted per unit, never marked.  The mark stands at the
time of the unit's last event on that file.

Each unit's diff is made once (git's own, from the private object store) and cut into its
files' sections, so a mark shows its file's part and a bar the whole.
"""
from __future__ import annotations

import re
import time

from ..journal import Journal
from ..journal.schema import outside_unit, parse_unit, session_unit, turn_unit
from ..views import (C_ESCAPES, call_rows, call_unit, command_name, git_refuses,
                     inexact_note, unit_session)
from .diff import changed, file_events, side_of, touched
from .gitdiff import ObjectStore, left_out_note
from .large import too_large

MAX_SECTION = 200_000   # characters of one file's diff kept in the page


def report_data(j: Journal, states, store: ObjectStore, workspace: str) -> dict:
    """Everything the page shows, as plain data (JSON-able): ``lanes`` in display order,
    ``changes`` (the marks), ``patches`` (each a list of diff sections), ``files`` (which
    units changed each file) and ``summary``."""
    rep = _Report(j, states, store, workspace)
    by_unit: dict[str, list[dict]] = {}
    span: dict[str, list[int]] = {}   # session -> [first, last] event time
    for e in file_events(j):
        unit = e.get("unit") or outside_unit(e["actor"])
        by_unit.setdefault(unit, []).append(e)
        sid = unit_session(unit)
        if sid:
            lo_hi = span.setdefault(sid, [e["t"], e["t"]])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], e["t"]), max(lo_hi[1], e["t"])

    calls = call_rows(j)   # tool, summary, status, processes; changes come from the diffs here
    turns = sorted(j.records("turns"), key=lambda t: (t["session"], t["index"]))
    sessions = {s["id"]: s for s in j.records("sessions") if "id" in s}
    for x in calls + turns:
        lo_hi = span.setdefault(x["session"], [x["begin_t"], x["begin_t"]])
        lo_hi[0] = min(lo_hi[0], x["begin_t"])
        lo_hi[1] = max(lo_hi[1], x.get("end_t") or 0, x["begin_t"])
    last = j.last_seq()
    for sid in sorted(span, key=lambda s: span[s][0]):
        s_turns = [t for t in turns if t["session"] == sid]
        s_calls = [c for c in calls if c["session"] == sid]
        rec = sessions.get(sid) or {}
        rep.lane("session", sid, f"Session {sid}",
                 f"{len(s_turns)} turn(s), {len(s_calls)} call(s)",
                 begin=rec.get("started") or span[sid][0], end=rec.get("ended") or span[sid][1])
        own = by_unit.get(session_unit(sid), [])
        if own:
            rep.lane("agent", f"{sid}:own", "the agent itself", "its writes outside any turn",
                     unit=session_unit(sid), events=own)
        # turns and the calls outside any turn, in time order; a turn's calls beneath it
        indices = {t["index"] for t in s_turns}
        items = [("turn", t) for t in s_turns] + \
            [("call", c) for c in s_calls if c.get("turn") not in indices]
        for kind, x in sorted(items, key=lambda kx: kx[1]["begin_t"]):
            if kind == "call":
                rep.call_lane(x, by_unit)
                continue
            t = x
            lo, hi = t["begin_seq"], t["end_seq"] or last
            evs = [e for e in file_events(j, lo, hi) if unit_session(e.get("unit")) == sid]
            whole = rep.diffed(evs, (lo, hi))   # `diff --turn`: the turn's net, every unit's
            tu = turn_unit(sid, t["index"])
            rep.lane("turn", f"{sid}:{t['index']}", f"Turn {t['index']}",
                     (t.get("prompt") or "").split("\n")[0], begin=t["begin_t"],
                     end=t.get("end_t"), unit=tu, events=by_unit.get(tu, []),
                     whole=whole, extra={"turn": t["index"], "session": sid})
            for c in s_calls:
                if c.get("turn") == t["index"]:
                    rep.call_lane(c, by_unit)

    outside = rep.lane("outside", "outside", "outside the sessions",
                       "your editor, other terminals, edits while unmounted")
    for unit, evs in by_unit.items():
        if parse_unit(unit).kind == "outside":
            a = j.actor(parse_unit(unit).id)
            rep.add_group(outside, evs, f"{command_name(a)}[{a['pid'] if a else '?'}]",
                          writer=unit)
    late = rep.lane("late", "late", "late writes",
                    "background processes, after their call had ended")
    for c in calls:
        evs = [e for e in by_unit.get(call_unit(c), []) if e.get("after_end")]
        if evs:
            rep.add_group(late, evs, f"{c['tool']} {c['id']} (late)", writer=call_unit(c))
    reverts = [(u, evs) for u, evs in by_unit.items() if parse_unit(u).kind == "revert"]
    if reverts:
        lane = rep.lane("revert", "revert", "reverts", "overlayrec revert and unrevert")
        for unit, evs in reverts:
            rep.add_group(lane, evs, "revert " + parse_unit(unit).id, writer=unit)
    for lane in rep.lanes:
        lane["marks"].sort(key=lambda i: rep.changes[i]["t"])
        # the files it left changed (a moved file by both names): a turn's all, else its marks'
        named = rep.entries[lane["patch"]][0] if lane["kind"] == "turn" else \
            [(c["status"], c["old"] or c["path"], c["path"], None)
             for c in map(rep.changes.__getitem__, lane["marks"])]
        lane["paths"] = sorted({p for _, old, new, _ in named for p in (old, new)})
    return {"workspace": workspace, "generated_t": time.time_ns() / 1e6,
            "lanes": rep.lanes, "changes": rep.changes, "patches": rep.patches,
            "files": rep.files_view(), "summary": rep.summary(span, calls, turns)}


class _Report:
    def __init__(self, j: Journal, states, store: ObjectStore, workspace: str):
        self.j, self.states, self.store, self.workspace = j, states, store, workspace
        self.lanes: list[dict] = []
        self.changes: list[dict] = []
        self.patches: list[list[str]] = []
        self.entries: list[tuple[list, int]] = []   # per patch: (files, changes under .git/)
        self.counts: list[tuple[int, int]] = []

    # -- lanes ----------------------------------------------------------------------------------
    def lane(self, kind, key, label, sub="", *, begin=None, end=None, unit=None, events=(),
             whole=None, extra=None) -> dict:
        """A lane; with ``events``, the marks of that unit's changes, and a bar from ``begin``
        to ``end`` whose click shows ``whole`` (a patch index; default: the unit's own)."""
        lane = {"index": len(self.lanes), "kind": kind, "id": key, "label": label, "sub": sub,
                "marks": [],
                "begin_t": _ms(begin), "end_t": _ms(end), "patch": whole, "files": 0,
                "git_changes": 0, "marked_git": 0, **(extra or {})}
        self.lanes.append(lane)
        if events:
            own = self.add_group(lane, list(events), label, writer=unit)
            if whole is None:
                lane["patch"] = own
        if whole is not None:
            lane["files"], lane["git_changes"] = self.counts[whole]
        return lane

    def call_lane(self, c: dict, by_unit: dict) -> None:
        unit = call_unit(c)
        evs = by_unit.get(unit, [])
        now = [e for e in evs if not e.get("after_end")]
        summary = c.get("summary") or ""
        if summary.startswith(self.workspace + "/"):   # an edit tool's absolute path
            summary = summary[len(self.workspace) + 1:]
        # an implicit call's id is made up (implicit-PID-TICK): its command names it
        label = f"{c['tool']} (implicit)" if c["implicit"] else f"{c['tool']} {c['id']}"
        lane = self.lane("call", f"{c['session']}:{c['id']}", label, summary,
                         begin=c["begin_t"],
                         end=c.get("end_t") or max([e["t"] for e in now], default=None),
                         unit=unit, events=now,
                         extra={"status": c["status"], "implicit": c["implicit"],
                                "processes": c["processes"], "turn": c.get("turn"),
                                "session": c["session"], "call": c["id"],
                                "late_events": c["late_events"],
                                # placed here by a guess among calls active together
                                "guessed": c["guessed"],
                                "active_with": [parse_unit(u).id for u in c["active_with"]],
                                "touched": c["touched"]})   # all it wrote, own first
        if len(now) < len(evs):   # the bar shows what `diff --call` shows: the late writes too
            lane["patch"] = self.diffed(evs)
        if lane["patch"] is None:
            lane["patch"] = self.diffed([])

    def add_group(self, lane: dict, evs: list[dict], who: str, writer: str | None) -> int:
        """Diff one unit's events, mark each changed file on ``lane``; the patch's index."""
        idx = self.diffed(evs)
        entries, _ = self.entries[idx]
        last_t: dict[str, int] = {}   # path -> the group's last event on it (both names)
        if entries:
            for e in evs:
                for p in touched(self.states, e):
                    last_t[p] = max(last_t.get(p, 0), e["t"])
        for status, old, new, sections in entries:
            ts = [last_t[p] for p in (old, new) if p in last_t]
            self.changes.append({
                "id": len(self.changes), "lane": lane["index"],
                "status": status, "path": new, "old": old if old != new else None,
                "t": _ms(max(ts) if ts else evs[-1]["t"]), "who": who, "unit": writer,
                "patch": idx, "sections": sections})
            lane["marks"].append(len(self.changes) - 1)
        files, git = self.counts[idx]
        lane["marked_git"] += git   # the .git/ changes of the units whose files are marked here
        if lane["patch"] is None or lane["kind"] in ("outside", "late", "revert"):
            lane["files"] += files
            lane["git_changes"] += git
        return idx

    # -- diffs ----------------------------------------------------------------------------------
    def diffed(self, evs: list[dict], bounds=None) -> int:
        """The patch of these events' net change (a Side, as ``overlayrec diff`` makes it), cut
        into its files' sections: its index in ``patches``; ``entries[i]``: (status, old name,
        new name, section indices) per file, ``counts[i]``: (files, changes under .git/)."""
        side = side_of(self.states, evs, bounds)
        net = [p for p in changed(side) if p]
        git = sum(1 for p in net if git_refuses(p))
        entries, sections = [], []
        if len(net) > git:
            tb, ta = self.store.trees(side.before, side.after)
            if tb != ta:
                # names as they are: matched here (_quote), escaped by the page itself
                listed = _name_status(self.store.diff(tb, ta, "name-status", as_they_are=True))
                patch = self.store.diff(tb, ta, "patch", as_they_are=True)
                sections = _sections(patch)
                entries = _match(listed, sections)
        if git:
            sections.append(f"# {left_out_note(git)}\n")
        vague = [p for p in net if not git_refuses(p) and any(
            not s.exact and not s.withheld for s in (side.before.get(p), side.after.get(p))
            if s is not None)]
        if vague:  # as `overlayrec diff` says on stderr
            sections.append(f"# {inexact_note(vague)}\n")
        large = too_large(side, net)
        if large:
            sections.append(f"# {len(large)} file(s) too large for a patch, not shown: "
                            f"{', '.join(large[:5])}{' ...' if len(large) > 5 else ''}; "
                            "`overlayrec replay` restores them\n")
            # each is a change of the unit all the same, in the Files view, its marks and its
            # count (`calls` counts it: the page left it out; a hunt), its patch that note
            for p in large:
                b, a = side.before.get(p), side.after.get(p)
                status = "A" if b is None or not b.present else \
                    "D" if a is None or not a.present else "M"
                entries.append((status, p, p, [len(sections) - 1]))
        self.patches.append([_cap(s) for s in sections])
        self.entries.append((entries, git))
        self.counts.append((len(entries), git))
        return len(self.patches) - 1

    # -- views ----------------------------------------------------------------------------------
    def files_view(self) -> dict:
        """Which units changed each file: the workspace's own files, sorted, each with its
        changes in time order (a moved file under both names); ``.git/`` as one count, with
        the units that changed something there."""
        files: dict[str, list[int]] = {}
        for ch in sorted(self.changes, key=lambda c: c["t"]):
            for p in {ch["path"], ch["old"]} - {None}:
                files.setdefault(p, []).append(ch["id"])
        git_by = [(lane["label"], lane["marked_git"]) for lane in self.lanes
                  if lane["marked_git"]]
        return {"own": [{"path": p, "changes": ids} for p, ids in sorted(files.items())],
                "git": {"changes": sum(n for _, n in git_by),
                        "units": [label for label, _ in git_by]}}

    def summary(self, sessions, calls, turns) -> dict:
        ts = [c["t"] for c in self.changes] + \
            [t for lane in self.lanes for t in (lane["begin_t"], lane["end_t"]) if t]
        return {"sessions": len(sessions), "turns": len(turns), "calls": len(calls),
                "changes": len(self.changes),
                "files": len({p for c in self.changes for p in (c["path"], c["old"]) if p}),
                "git_changes": sum(lane["marked_git"] for lane in self.lanes),
                "outside": sum(1 for c in self.changes
                               if self.lanes[c["lane"]]["kind"] == "outside"),
                "late": sum(1 for c in self.changes if self.lanes[c["lane"]]["kind"] == "late"),
                "first_t": min(ts, default=None), "last_t": max(ts, default=None)}


def _ms(ns) -> float | None:
    return None if not ns else ns / 1e6


def _cap(section: str) -> str:
    if len(section) <= MAX_SECTION:
        return section
    cut = section.rfind("\n", 0, MAX_SECTION) + 1 or MAX_SECTION
    more = section[cut:].count("\n")
    return section[:cut] + f"# ... {more} more line(s) not in the page: see `overlayrec diff`\n"


# -- git's output, cut per file --------------------------------------------------------------------

_ESC = {letter: byte for byte, letter in C_ESCAPES.items()}


def _unquote(s: str) -> str:
    """A path as git prints it: C-quoted ("a\\tb", octal bytes) when it holds a control
    character, a quote or a backslash (core.quotepath is off, so not for other bytes)."""
    if len(s) < 2 or s[0] != '"' or s[-1] != '"':
        return s
    raw = s[1:-1].encode("utf-8", "surrogateescape")
    out, i = bytearray(), 0
    while i < len(raw):
        c = raw[i]
        if c == 92 and i + 1 < len(raw):
            nxt = chr(raw[i + 1])
            if nxt in _ESC:
                out.append(_ESC[nxt])
                i += 2
                continue
            if nxt in "01234567":
                out.append(int(raw[i + 1:i + 4], 8))
                i += 4
                continue
        out.append(c)
        i += 1
    return out.decode("utf-8", "surrogateescape")


def _quote(s: str) -> str:
    """What git prints for a path (see _unquote)."""
    if not any(ord(ch) < 32 or ch in '"\\' or ord(ch) == 127 for ch in s):
        return s
    out = []
    for b in s.encode("utf-8", "surrogateescape"):
        if b in C_ESCAPES:
            out.append("\\" + C_ESCAPES[b])
        elif b < 32 or b == 127:
            out.append(f"\\{b:03o}")
        else:
            out.append(chr(b))
    return '"' + "".join(out).encode("latin-1").decode("utf-8", "surrogateescape") + '"'


def _name_status(text: str) -> list[tuple[str, str, str]]:
    """``git diff-tree --name-status`` lines as (status letter, old name, new name)."""
    out = []
    for line in text.split("\n"):  # not splitlines: a name may hold U+2028, git leaves it
        if not line:
            continue
        parts = line.split("\t")
        names = [_unquote(p) for p in parts[1:]]
        out.append((parts[0][:1], names[0], names[-1]))
    return out


def _sections(patch: str) -> list[str]:
    """A patch cut at each file's ``diff --git`` header."""
    out: list[str] = []
    # at git's newlines only, as _name_status
    for line in re.split(r"(?<=\n)", patch):
        if not line:
            continue
        if line.startswith("diff --git ") or not out:
            out.append(line)
        else:
            out[-1] += line
    return out


def _match(listed, sections) -> list[tuple[str, str, str, list[int]]]:
    """Each file of the name-status listing with the patch sections that show it (a kind
    change, file to symlink, is two sections); a section no header names goes with the file
    before it."""
    heads = {}
    for i, (status, old, new) in enumerate(listed):
        a = old if status != "A" else new
        b = new if status != "D" else old
        heads[f"diff --git {_quote('a/' + a)} {_quote('b/' + b)}"] = i
    found: list[list[int]] = [[] for _ in listed]
    prev = None
    for k, sec in enumerate(sections):
        i = heads.get(sec.split("\n", 1)[0], prev)
        if i is not None:
            found[i].append(k)
            prev = i
    return [(status, old, new, found[i]) for i, (status, old, new) in enumerate(listed)]
