"""What a call, a turn, a session or a range of the journal changed: the two sides of the diff.

A selection is a set of (path, before-point, after-point): for a call, each path it touched, from
just before its first change to just after its last; for a turn, the paths its session's units
touched between the turn's begin and end; for a range, every path changed in it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..journal import Journal
from ..journal.outcome import RENAME_EXCHANGE
from ..journal.schema import (AROUND, CONTROL_OPS, MARK_OPS, call_unit, is_dir_rename,
                              outside_unit)
from ..views import (file_events as _tree_events, guessed, late, path_matcher,
                     unit_session as _unit_session)
from .states import States, State


class SelectionError(Exception):
    pass


@dataclass
class Side:
    before: dict[str, State]
    after: dict[str, State]
    writers: dict[str, set[str]]   # path -> units that changed it in the selection
    # inode -> the names the selection's events saw it hold when it had several (a write's
    # pre-image and its aliases'): a hard link made and removed in the selection is seen too
    linked: dict[int, set[str]] = field(default_factory=dict)
    # a call's selection: its paths placed here by a guess among calls active together, and
    # the paths of other calls' changes placed there by a guess while this one was active too
    # (views.guessed): a diff or a revert of the call may hold the first and miss the second
    guessed: list[str] = field(default_factory=list)
    maybe_ours: dict[str, list[str]] = field(default_factory=dict)  # unit -> its paths
    late: list[str] = field(default_factory=list)  # a call's paths changed after it ended
    # a call's paths another unit changed between the call's own changes (its diff, from the
    # call's first change to its last, holds them): path -> those units
    interleaved: dict[str, list[str]] = field(default_factory=dict)
    # a turn's: those of them whose other writers changed them only before the turn's own
    # first change to them (its diff holds their change; its revert keeps it)
    earlier: set[str] = field(default_factory=set)
    # the selection's own events (select() sets them): what each writer did (own_changes)
    events: list[dict] | None = None
    # a session's: the reverts run inside it (an agent's call ran `overlayrec revert`), each
    # with the paths it changed, which its diff (its own units') does not hold: revert -> paths
    reverts: dict[str, list[str]] = field(default_factory=dict)


def file_events(j: Journal, lo: int = 1, hi: int | None = None) -> list[dict]:
    """Events that change a path (not control events, not failed ones)."""
    return [e for e in _tree_events(j, lo, hi) if e.get("path") is not None]


def _selection_events(j: Journal, lo: int = 1, hi: int | None = None) -> list[dict]:
    """file_events, the journal remembering the seals among the events read too: the states
    look up each path's chain, and the seals of a call's or turn's paths lie in its range (a
    unit's end seals what it wrote).  Each was decoded here and again by Journal.event: a turn
    of 1,000 paths, 1,000 decodes."""
    failed, evs, marks = set(), [], []
    for e in j.events(lo, hi):
        op = e["op"]
        if op == "failed":
            failed.add(e["ref"])
        elif op in MARK_OPS:
            marks.append(e)
        elif op not in CONTROL_OPS:
            evs.append(e)
    j.remember_events(marks)
    return [e for e in evs if e["seq"] not in failed and e.get("path") is not None]


def _paths(e: dict) -> list[str]:
    return [p for p in (e.get("path"), e.get("path2")) if p is not None]


def touched(states: States, e: dict) -> list[str]:
    """The paths an event changed: the ones it names and, for a directory rename, both names of
    everything beneath the directory (path history)."""
    out = _paths(e)
    for old, new in states.moved_with(e):
        out += (old, new)
    return out


def _moves(states: States, e: dict) -> tuple[list[str], list[tuple[str, str]]]:
    """(touched(e), the (old name, new name) of what a rename event moved: the path itself,
    both ways for an exchange, and for a directory everything beneath it), asking the
    directory's descendants once."""
    beneath = states.moved_with(e)
    paths = _paths(e) + [x for pair in beneath for x in pair]
    if e["op"] != "rename" or e.get("path2") in (None, e.get("path")):
        return paths, []
    out = [(e["path"], e["path2"])]
    if e.get("flags", 0) & 2:
        out.append((e["path2"], e["path"]))
    return paths, out + beneath


def moved_on(states: States, evs: list[dict], mine, anywhere: bool = False,
             ignore=None) -> dict[str, tuple[dict[str, set[str]], set[str]]]:
    """Another unit's change of a file that the selection then moved on, following the file
    through the selection's renames (of it, or of a directory above it): path the file ends at
    -> ({the other unit: the names it changed the file under}, every name the file had through
    those renames).  A per-name check misses it: ``mv a a.bak``, the user appends to a.bak,
    ``mv a.bak a`` leaves a.bak made and unmade and no other writer in a's own chain, so a
    revert put a's old content back over the user's line, and a diff held it as the agent's.

    ``evs``: the events in order, the selection's (``mine(e)``) and others'; another unit's
    change counts where the selection changed that name before it and changes it again (the
    change is between two of the selection's), or, with ``anywhere``, wherever it is among
    ``evs`` (a turn's span); ``ignore(path, seq)``: a change that does not count (a git index
    refresh).  What a name held goes with the file when it is renamed, by anyone, and a name it
    leaves or that is removed holds none of it: a lock file another git wrote and renamed away
    between two of the selection's is no change of the next one."""
    Held = dict[str, set[str]]  # another unit -> the names it changed the file under
    pending: dict[str, Held] = {}  # name -> others' changes since the selection's last there
    held: dict[str, Held] = {}     # name -> others' changes between two of the selection's
    moved: dict[str, Held] = {}    # name -> the same, its file since moved on by the selection
    names: dict[str, set[str]] = {}  # name -> the names its file had before, through renames
    seen: set[str] = set()

    def join(into: dict[str, Held], p: str, got: Held) -> None:
        for unit, where in got.items():
            into.setdefault(p, {}).setdefault(unit, set()).update(where)
    for e in evs:
        paths, moves = _moves(states, e)
        ours = mine(e)
        if ours:  # the selection changes these names again: what came between is held
            for p in paths:
                seen.add(p)
                join(held, p, pending.pop(p, {}))
        went = {old: (pending.pop(old, {}), held.pop(old, {}), moved.pop(old, {}),
                      names.pop(old, set())) for old, _ in moves}
        for old, new in moves:  # the file goes on under its new name, with what it holds
            pend, hold, carried, had = went[old]
            # the names the file had since the selection changed it: one it had before (a
            # directory another unit renamed before the selection's first change of it) is no
            # name of the selection's change, and what that name holds now is another file's
            # matter (a file written there later was called interleaved; the history model)
            names[new] = (had | {old} if old in seen else set()) | {new}
            pending[new] = pend
            if ours:  # moved on by the selection
                held[new], moved[new] = {}, dict(carried)
                join(moved, new, hold)
            else:
                held[new], moved[new] = hold, carried
            if old in seen:
                seen.add(new)
        if e["op"] in ("unlink", "rmdir"):  # the file is gone, and what it held with it
            for p in paths:
                for d in (pending, held, moved, names):
                    d.pop(p, None)
        elif not ours:
            unit = e.get("unit") or outside_unit(e.get("actor", "?"))
            left = {old for old, _ in moves} - {new for _, new in moves}
            for p in paths:
                if p not in left and (anywhere or p in seen) and \
                        not (ignore and ignore(p, e["seq"])):
                    join(pending, p, {unit: {p}})
    return {p: (got, names[p]) for p, got in moved.items() if got}


def _visible(p: str) -> bool:
    return not (p == ".overlayrec-attic" or p.startswith(".overlayrec-attic/"))


def changed_since(j: Journal, last: int, paths) -> tuple[int, list[str]]:
    """What the record took after seq ``last`` while a reader read it (a mount recording
    meanwhile: an agent, a revert): how many events, and which of ``paths`` one of them
    names, itself or a directory above it (a directory's rename moves what lies beneath).
    A reader reads the journal one transaction at a time and the live tree as it goes, so
    those paths' answers may mix the record before with the tree after; the others' hold."""
    now = j.last_seq()  # a read-only journal catches up with what was written ahead
    if now <= last:
        return 0, []
    named = set()
    for e in j.events(last + 1, now):
        named.update(p for p in (e.get("path"), e.get("path2")) if p)

    def hit(p: str) -> bool:
        while p:
            if p in named:
                return True
            p = p.rpartition("/")[0]
        return False
    return now - last, sorted(p for p in paths if hit(p))


def select(j: Journal, states: States, *, call: str | None = None, turn: int | str | None = None,
           session: str | None = None, since: int | None = None, until: int | None = None,
           glob: str | None = None) -> Side:
    if j.cut:  # only a gc's cut drops anything (retention and its logging: imported then)
        from ..retention import dropped_selection
        why = dropped_selection(j, call=call, turn=turn, session=session, since=since,
                                until=until)
        if why:
            raise SelectionError(why)
    last = j.last_seq()
    keep = path_matcher(glob) if glob else None
    if call is not None:
        c = find_call(j, call, session)
        unit = call_unit(c["session"], call)
        evs = _selection_events(j, c.get("begin_seq") or 1)
        mine = [e for e in evs if e.get("unit") == unit]
        side = _selected(states, mine, keep=keep, every=evs)
        # its notes name only the paths --path selects (the late note named others: a bug hunt)
        side.guessed = _kept(guessed(mine)["guessed"], keep)
        side.maybe_ours = {u: ps for u, ps in ((u, _kept(ps, keep)) for u, ps in
                                               placed_elsewhere(evs, unit).items()) if ps}
        side.late = _kept(late(mine), keep)
        _interleaved(states, side, mine, evs, lambda u: u == unit)
        return side
    if turn is not None:
        t = find_turn(j, turn, session)
        sid = t["session"]
        lo, hi = t["begin_seq"], t["end_seq"] or last
        evs = _selection_events(j, lo, hi)
        mine = [e for e in evs if _unit_session(e.get("unit")) == sid]
        side = _selected(states, mine, (lo, hi), keep=keep, every=evs)
        _interleaved(states, side, mine, evs, lambda u: _unit_session(u) == sid, (lo, hi))
        return side
    if session is not None:
        rec = j.record("sessions", session.encode())
        if rec is None:
            raise SelectionError(f"no session {session}")
        evs = _selection_events(j, since + 1 if since is not None else 1)  # --since: after it
        mine = [e for e in evs if _unit_session(e.get("unit")) == session]
        side = _selected(states, mine, keep=keep, every=evs)
        _interleaved(states, side, mine, evs, lambda u: _unit_session(u) == session)
        side.reverts = reverts_inside(states, evs, rec, keep)
        return side
    # (since, until]: everything recorded after --since, as its help, export.md, `log`,
    # `revert` and replay's points say (event ``since`` itself was in the diff)
    lo = since + 1 if since is not None else 1
    hi = until if until is not None else last
    if hi < lo - 1:
        if until is None:
            raise SelectionError(f"--since {since} is past the record's end (seq {last})")
        raise SelectionError(f"--until {until} is before --since {since}: nothing between")
    return _selected(states, _selection_events(j, lo, hi), (lo - 1, hi), keep=keep)


def reverts_inside(states: States, evs: list[dict], rec: dict, keep=None) -> dict[str, list[str]]:
    """The reverts run inside a session (``rec``: their events between its start and its end)
    and the paths each left other than it found them (those ``keep`` takes; not its temporary
    files).  A session's diff holds its own units' changes, not a revert's, though the
    workspace at the session's end does (an agent's call that ran `overlayrec revert`)."""
    start, end = rec.get("started") or 0, rec.get("ended")
    spans: dict[str, list] = {}
    for e in evs:
        unit = e.get("unit") or ""
        if not unit.startswith("revert:") or e["t"] < start or (end is not None and e["t"] > end):
            continue
        span = spans.setdefault(unit[len("revert:"):], [e["seq"], e["seq"], set()])
        span[1] = e["seq"]
        span[2].update(p for p in touched(states, e) if _visible(p) and (keep is None or keep(p)))
    out = {}
    for rid, (lo, hi, paths) in spans.items():
        changed = sorted(p for p in paths
                         if not states.state(p, lo - 1).same(states.state(p, hi)))
        if changed:
            out[rid] = changed
    return out


def _kept(paths: list[str], keep) -> list[str]:
    """The ``paths`` a ``--path`` matcher ``keep`` takes (all of them without one)."""
    return paths if keep is None else [p for p in paths if keep(p)]


def placed_elsewhere(evs: list[dict], unit: str) -> dict[str, list[str]]:
    """Other calls' changes among ``evs`` placed by a guess (views.guessed) while ``unit`` was
    one of the calls active together: each such call's unit and its paths."""
    by_unit: dict[str, list[dict]] = {}
    for e in evs:
        if e.get("unit") != unit and unit in (e.get("candidates") or ()):
            by_unit.setdefault(e["unit"], []).append(e)
    out = {}
    for u, es in by_unit.items():
        paths = guessed(es)["guessed"]
        if paths:
            out[u] = paths
    return out


def changed_around(states: States, path: str, after: int = 0) -> bool:
    """Did a seal find ``path`` changed around the mount (after seq ``after``) while a unit
    went on (a drift event of ``outside:around``, Recorder.seal)?"""
    unit = outside_unit(AROUND)
    return any(e["op"] == "drift" and e.get("unit") == unit and e["seq"] > after
               for e in states.chain_on(path))


def session_named(j: Journal, session: str | None) -> str | None:
    """``session`` as the record names it: ``last`` is the session begun last (unless one is
    called so), for the commands that take ``--session``, as ``--turn last``."""
    if session is not None and session != "last" and \
            j.record("sessions", session.encode("utf-8", "surrogateescape")) is None:
        # the agent's own name for it (Claude Code's session_id, kept as an alias of the
        # session `run` began): what the agent's transcript names it by
        named = [s["id"] for s in j.records("sessions") if session in (s.get("aliases") or ())]
        if len(named) == 1:
            return named[0]
    if session != "last" or j.record("sessions", b"last") is not None:
        return session
    newest = max(j.records("sessions"), key=lambda s: s.get("started") or 0, default=None)
    if newest is None:
        gone = max(j.dropped_sessions(), key=lambda s: s.get("started") or 0, default=None)
        if gone is not None:  # a budget at mount can drop the session that just ended
            from ..retention import dropped_session_message
            raise SelectionError(dropped_session_message(gone) + ", and every session "
                                 "before it: none is left")
        raise SelectionError("no session recorded")
    return newest["id"]


def drift_side(states: States, glob: str | None = None) -> Side:
    """The drift: each recorded path whose live state departs from the record's end (its seal),
    from what the record holds to what the live tree holds, under no unit of the record."""
    before, after, writers = {}, {}, {}
    keep = path_matcher(glob) if glob else None
    for p in states.drift():
        if not _visible(p) or (keep and not keep(p)):
            continue
        before[p] = states.state(p, states.j.last_seq())
        after[p] = states.tree.state(p)
        writers[p] = {"drift"}
    return Side(before, after, writers)


def _interleaved(states: States, side: Side, mine: list[dict], evs: list[dict], own,
                 bounds: tuple[int, int] | None = None) -> None:
    """Another unit's change of a selection's path that its diff holds: between the
    selection's first change to it and its last (a call, a session), or anywhere within
    ``bounds`` (a turn: its sides are taken at its begin and end).  ``own(unit)``: is the
    unit the selection's.  The diff holds that change (as `revert` refuses it,
    ``interleaved``), so its writers name that unit and the diff says so; a user's edit
    between two of the agent's read as the agent's, without a word (a turn's and a
    session's until 2026-12-05, a call's before)."""
    if not mine:
        return
    first, last = bounds if bounds else (mine[0]["seq"], mine[-1]["seq"])
    inside = (lambda seq, lo, hi: lo < seq <= hi) if bounds else \
        (lambda seq, lo, hi: lo + 1 < seq < hi)
    spans = own_first = None
    earlier: dict[str, bool] = {}  # a turn's path -> are all others' changes before its own?
    for e in evs:
        if not inside(e["seq"], first - (0 if bounds else 1), last) or own(e.get("unit")):
            continue
        if spans is None:
            spans = spans_of(states, mine, bounds)[0]
            if bounds:  # the point a turn's revert puts each path back to
                own_first = {p: lo for p, (lo, _) in spans_of(states, mine)[0].items()}
        beneath: set[str] = set()
        if is_dir_rename(e):
            # another unit's rename of a directory above the selection's paths within it
            # (`mv e/sub e/sub2` while the call moved d to e and wrote e/sub2/f): the diff
            # held the file under two names, and nothing said whose the move was (found by
            # a bug hunt)
            tops = tuple(x + "/" for x in (e.get("path"), e.get("path2")) if x)
            beneath = {q for q in side.writers if q.startswith(tops)}
        for p in list(touched(states, e)) + sorted(beneath):
            span = spans.get(p)
            if (p in beneath or span is not None and inside(e["seq"], *span)) and \
                    p in side.writers:
                other = e.get("unit") or outside_unit(e.get("actor", "?"))
                side.writers[p].add(other)
                if other not in side.interleaved.setdefault(p, []):
                    side.interleaved[p].append(other)
                if own_first is not None:
                    earlier[p] = earlier.get(p, True) and e["seq"] <= own_first.get(p, -1)
    if spans is None:  # no other unit's change among them
        return
    side.earlier = {p for p, yes in earlier.items() if yes}
    # and the path a file ends up at, where another unit changed it under a name the selection
    # then renamed it from (`mv a a.bak`, the user's edit of a.bak, `mv a.bak a`): the diff of
    # that path holds the change, though no other writer is in its own chain
    for p, (held, _) in moved_on(states, evs, lambda e: own(e.get("unit")),
                                 anywhere=bounds is not None).items():
        if p not in side.writers:
            continue
        for other in held:
            side.writers[p].add(other)
            if other not in side.interleaved.setdefault(p, []):
                side.interleaved[p].append(other)
        side.earlier.discard(p)


def find_call(j: Journal, call: str, session: str | None = None,
              several: str = "say --session") -> dict:
    """The record of call ``call`` (of ``session``, when given).  An id two sessions hold
    (an agent's own ids may repeat across sessions) is refused, never taken as the first:
    every command that selects a call says so alike (``several``: how to name one)."""
    calls = [c for c in j.records("calls") if c["id"] == call
             and (session is None or c["session"] == session)]
    if not calls:
        raise SelectionError(f"no call {call}" + (f" in session {session}" if session else ""))
    sessions = sorted({c["session"] for c in calls})
    if len(sessions) > 1 and (mine := callers_session(j, sessions)) is not None:
        calls = [c for c in calls if c["session"] == mine]
    elif len(sessions) > 1:
        raise SelectionError(f"call {call} exists in several sessions ({', '.join(sessions)}): "
                             f"{several}")
    return calls[0]


def callers_session(j: Journal, among: list[str]) -> str | None:
    """The session of ``among`` the caller runs in, where it says (``OVERLAYREC_SESSION``, as
    `run` sets it for its agent and the Python client sends it): an agent's tool that asks
    for its own turn or call while another agent's session holds one too (two `run`s on one
    mount) means its own."""
    name = os.environ.get("OVERLAYREC_SESSION")
    if not name:
        return None
    if name in among:
        return name
    for sid in among:
        rec = j.record("sessions", sid.encode("utf-8", "surrogateescape")) or {}
        if name in (rec.get("aliases") or ()):
            return sid
    return None


def find_turn(j: Journal, turn, session: str | None = None,
              several: str = "say --session ID, or --session last") -> dict:
    """The record of turn ``turn`` (N, ``last``, or -1, -2 ... counting back from the last) of
    ``session``, when given.  A turn several sessions could mean (N when two hold a turn N;
    last or -N when two hold turns) is refused, never taken as the first, naming the
    sessions: every command that selects a turn says so alike (``several``: how to name one),
    as ``find_call`` does for a call."""
    turns = [t for t in j.records("turns") if session is None or t["session"] == session]
    if not turns:
        raise SelectionError("no turns recorded" + (f" in session {session}" if session else ""))
    n = -1 if turn == "last" else int(turn)
    if n >= 0:
        turns = [t for t in turns if t["index"] == n]
        if not turns:
            raise SelectionError(f"no turn {n}" + (f" in session {session}" if session else ""))
    sessions = sorted({t["session"] for t in turns})
    if len(sessions) > 1 and (mine := callers_session(j, sessions)) is not None:
        turns, sessions = [t for t in turns if t["session"] == mine], [mine]
    if len(sessions) > 1:
        which = "turns of several sessions are recorded" if n < 0 else \
            f"turn {n} exists in several sessions"
        raise SelectionError(f"{which} ({', '.join(sessions)}): {several}")
    turns.sort(key=lambda t: t["index"])
    if n >= 0:
        return turns[0]
    if -n > len(turns):
        raise SelectionError(f"no turn {n}: {len(turns)} recorded")
    return turns[n]


def _selected(states: States, events: list[dict], bounds: tuple[int, int] | None = None, *,
              keep=None, every: list[dict] | None = None) -> Side:
    """side_of for select(): the journal remembers the selection's events first, since the
    states look each up again (``Journal.event``), a second decoding of every one."""
    states.j.remember_events(events)
    side = side_of(states, events, bounds, keep=keep, read_ahead=True, settle=bounds is None)
    # every writer's events in the selection's range, other writers' too (own_changes)
    side.events = events if every is None else every
    return side


def own_changes(states: States, side: Side) -> dict[str, Side]:
    """For each writer of a path that several writers of the selection changed: its own
    change of those paths, from just before its first event on each to just after its last,
    as a diff of that call alone gives it (the selection's change of such a path holds every
    writer's: ``diff --by-writer`` showed it under each, found by a bug hunt).  {} when no
    path has several writers, or the side holds no events (``--drift``)."""
    shared = {p for p, us in side.writers.items() if len(us) > 1}
    if not shared or side.events is None:
        return {}
    mine: dict[str, list[dict]] = {}
    for e in side.events:
        mine.setdefault(e.get("unit") or outside_unit(e.get("actor", "?")), []).append(e)
    return {u: side_of(states, evs, keep=shared.__contains__, settle=True)
            for u, evs in mine.items() if any(u in side.writers[p] for p in shared)}


def carried_writers(side: Side) -> dict[str, set[str]]:
    """path -> the writers of what it holds at the selection's end under the names it held
    before, within the selection: a file a call made and another moved (itself, or a
    directory above it) is the first call's too (``diff --json``'s writers of a file made in
    the selection gave only the move's and later writers'; found by a bug hunt).  {} for a
    side without events (``--drift``)."""
    carried: dict[str, set[str]] = {}
    for e in side.events or ():
        unit = e.get("unit") or outside_unit(e.get("actor", "?"))
        old, new = e.get("path"), e.get("path2")
        if e["op"] != "rename" or new is None:
            if old is not None:
                carried.setdefault(old, set()).add(unit)
            continue
        swap = bool(e.get("flags", 0) & RENAME_EXCHANGE)
        moved = {}
        for a, b in ((old, new), (new, old)) if swap else ((old, new),):
            for q in [q for q in carried if q == a or q.startswith(a + "/")]:
                moved[b + q[len(a):]] = carried.pop(q)
        if not swap:  # what the rename replaced
            for q in [q for q in carried if q == new or q.startswith(new + "/")]:
                del carried[q]
        carried.update(moved)
        for p in (old, new):
            carried.setdefault(p, set()).add(unit)
    return carried


def overlaid(base: dict, own: dict) -> dict:
    """``base`` (a side's before or after) with a writer's ``own`` states of its paths over
    it, as one tree: a name the writer left a file (or a symlink) is no directory there, and
    its directories are none of another writer's files (``kind`` a file of call A's, then
    call B's directory holding kind/inner: A's section of ``--by-writer`` showed B's
    kind/inner, and not its own file; found by a bug hunt)."""
    out = {**base, **own}
    for p, st in own.items():
        if st.kind in ("dir", "absent"):
            continue
        below = p + "/"
        for q in [q for q in out if q.startswith(below)]:
            del out[q]
        up = p.rpartition("/")[0]
        while up:
            if up not in own and out.get(up) is not None and out[up].kind not in ("dir", "absent"):
                del out[up]
            up = up.rpartition("/")[0]
    return out


def spans_of(states: States, events: list[dict], bounds: tuple[int, int] | None = None, *,
             keep=None) -> tuple[dict[str, list[int]], dict[str, set[str]]]:
    """(path -> [before-point, after-point], path -> the units that changed it) of one unit
    whose events are at hand, as side_of takes them."""
    spans: dict[str, list[int]] = {}
    writers: dict[str, set[str]] = {}
    for e in events:
        for p in touched(states, e):
            if not _visible(p) or (keep is not None and not keep(p)):
                continue
            lo, hi = bounds if bounds else (e["seq"] - 1, e["seq"])
            cur = spans.get(p)
            spans[p] = [min(cur[0], lo), max(cur[1], hi)] if cur else [lo, hi]
            writers.setdefault(p, set()).add(e.get("unit") or outside_unit(e.get("actor", "?")))
    return spans, writers


def side_of(states: States, events: list[dict], bounds: tuple[int, int] | None = None, *,
            keep=None, read_ahead: bool = False, settle: bool = False) -> Side:
    """The Side of one unit whose events are already at hand (grouped per unit in one pass
    over the journal, as the listings do), as select() makes it: without ``bounds``, each path
    from just before its first event to just after its last (a call, a session, an actor);
    with ``bounds`` (lo, hi), every path from lo to hi (a turn, a range).  ``keep(path)``: only
    the paths it accepts.  ``read_ahead``: the live files the after side reads are read a
    directory at a time first (States.read_live_ahead; ``states`` a States, not a stand-in such
    as export's).  ``settle``: a path's after side is read where the writes of a run still
    writing at its last event were done (States.settle; a States too)."""
    spans, writers = spans_of(states, events, bounds, keep=keep)
    linked: dict[int, set[str]] = {}
    for e in events:
        pre = e.get("pre")
        if pre and pre.get("ino") and pre.get("nlink", 1) > 1 and e.get("path") is not None:
            linked.setdefault(pre["ino"], set()).add(e["path"])
    before = {p: states.state(p, lo) for p, (lo, _) in spans.items()}
    if read_ahead:
        states.read_live_ahead((p, hi) for p, (_, hi) in spans.items())
    after = {p: states.state(p, hi) for p, (_, hi) in spans.items()}
    if settle:
        for p, st in after.items():
            if not st.exact and st.kind == "file":
                after[p] = states.state(p, states.settle(p, spans[p][1]))
    return Side(before, after, writers, linked)


class Net:
    """What the listings (views) take as ``net``: called with one unit's events (and bounds,
    as side_of), it gives (its changed paths, every path it touched), comparing the two points
    by States.sig (stored hashes, no content read where the record has them), so a listing of
    every call costs a pass over the journal, not a read of every file it touched.
    ``settled`` then says whether that answer is for good (engines.listings keeps it), and
    ``inexact`` which changed paths are not known exactly on one side (as ``diff`` names them:
    content the record could not keep; a secret's withheld content is not one)."""

    def __init__(self, states: States):
        self.states = states
        self.settled = False
        self.inexact: list[str] = []

    def __call__(self, events: list[dict], bounds: tuple[int, int] | None = None):
        states = self.states
        sig = states.sig
        spans, _ = spans_of(states, events, bounds)
        changed, inexact = [], []
        for p, (lo, hi) in spans.items():
            before, after = sig(p, lo), sig(p, hi)
            if before.same(after):
                continue
            changed.append(p)
            if before.exact and after.exact or before.withheld or after.withheld:
                continue
            # a unit's own span is read where a run's writes were done, as side_of settles
            # it (not a turn's or a range's bounds, which diff reads as they are)
            if before.exact and bounds is None and self._exact_once_done(p, hi):
                continue
            inexact.append(p)
        changed.sort()
        self.inexact = sorted(inexact)
        # a directory rename's moved paths are read from the live tree too (States.moved_with)
        self.settled = not any(is_dir_rename(e) for e in events) and \
            all(states.settled(p, lo) and states.settled(p, hi) for p, (lo, hi) in spans.items())
        return changed, spans.keys()

    def _exact_once_done(self, path: str, hi: int) -> bool:
        """A unit's last event on ``path`` may begin a write run (a create, a first write) whose
        later writes are no events: read where the run's release was noted, as ``diff`` does
        (States.settle), the state is exact.  Only asked of a path whose after side is not
        known exactly from a stored hash (an open epoch: the live tree)."""
        states = self.states
        point = states.settle(path, hi)
        return point != hi and states.state(path, point).exact

    def around(self, evs: list[dict]) -> list[str]:
        """The paths of one unit's events that were found changed around the mount between
        two of the unit's changes (at the daemon's next change, Recorder._bypassed) or after
        its last change to each (a seal's): a drift of ``outside:around`` in the path's chain
        there.  What the unit itself changed is not known."""
        span: dict[str, list[int]] = {}
        for e in evs:
            for p in _paths(e):
                span.setdefault(p, [e["seq"], e["seq"]])[1] = e["seq"]
        unit = outside_unit(AROUND)
        out = []
        for p, (first, last) in span.items():
            for f in self.states.chain_on(p):
                if f["seq"] <= first:
                    continue
                if f["op"] == "seal":
                    if f["seq"] > last:
                        break  # sealed at the unit's end: what it left is known, a drift
                        # found after is a change after it (diff shows it so)
                    continue
                if f["op"] == "drift" and f.get("unit") == unit:
                    out.append(p)
                    break
                if f["seq"] > last:
                    break  # the next change after the unit's last: not around
        return sorted(out)


def net_of(states: States, preload: bool = True) -> Net:
    """A Net over ``states``; ``preload``: for a listing of (nearly) the whole journal, every
    path's chain read in one pass first."""
    if preload:
        states.preload()
    return Net(states)


def changed(side: Side) -> list[str]:
    """The paths of a Side whose state differs between its two points (State.same): a file made
    and removed again, rewritten with the same content, or chmod-ed to the mode it had is not
    a change."""
    gone = State("absent")
    return sorted(p for p in side.before.keys() | side.after.keys()
                  if not side.before.get(p, gone).same(side.after.get(p, gone)))
