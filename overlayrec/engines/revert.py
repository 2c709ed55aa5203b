"""Revert: put back what a call, a turn, a session, a range or an earlier revert changed.

The plan is made from the journal alone and checked for every path before anything is
written; one conflict refuses the whole revert (``--force`` reverts the paths without one):

* *changed*: the path no longer holds what the reverted changes left (one an earlier revert
  put back as it was before them needs nothing: ``Plan.already``);
* *interleaved*: another unit changed the path between two of the reverted changes;
* *unrecorded*: the journal cannot say exactly what the path held (a change it could not
  record, a point inside a run of writes it did not see one by one, a secret path, whose
  content is never kept, or a pre-image whose attic entry was dropped to free space: the
  step's ``note`` says so);
* *escape*: a directory on the path's way is now a symlink, which a revert never follows.

A rename of the selection is undone by renaming back (the inode kept, and a directory's
contents with it) where what it moved is still whole at its new name (``_moves_back``); the
other paths are put back one by one.

The plan is written to the state dir before the first change, so an interrupted revert can be
finished (``--continue``) or rolled back (``unrevert``).  Every step is idempotent: it makes a
path hold its target, whatever it holds now.  Paths are reached from the workspace root one
component at a time without following a symlink, and a path that would leave the workspace is
refused.  The changes go through the mount, so the daemon journals them as the revert's own
unit (``revert:<id>``): an unrevert is a revert of that unit.
"""
from __future__ import annotations

import bisect
import errno
import heapq
import os
import re
import signal
import stat
import time
import uuid
from dataclasses import dataclass, field

from ..journal import Journal
from ..journal.schema import (MARK_OPS, UNMOUNTED, JournalError, call_unit, outside_unit,
                              revert_unit,
                              session_unit, turn_unit, unit_kind)
from ..secrets import PLACEHOLDER
from ..underlay import O_PATH, RENAME_NOREPLACE, Escape, kind_of, renameat2, resolve_beneath
from ..views import file_size_limit, guessed, path_matcher, shown
from . import gitindex
from .diff import (SelectionError, changed_around, file_events, find_call, moved_on,
                   placed_elsewhere, touched, find_turn, _visible)
from .large import over_limit, same_as_fd, whole, write_to
from .states import ABSENT, ATTIC, INF, States, State, Tree, _fwd, is_unlisted


# why a path is unrecorded when a descriptor of the reverted changes is still writing it
STILL_WRITING = "still being written: a descriptor is open on it"


@dataclass
class Step:
    path: str
    target: State
    expected: State
    conflict: str | None = None
    note: str | None = None   # why, where the conflict's name alone does not say
    # a hard-linked target may go back into the inode the path holds, for every name of its
    # group; not when names outside the plan joined that inode after the target's point
    in_place: bool = True
    # a rename back: the path's target is the object now at this name (its inode:
    # ``expected.ino``), renamed back onto the path (_moves_back); then written as any step
    # where the target differs from ``expected``
    moved_from: str | None = None


@dataclass
class Plan:
    id: str
    selection: dict
    steps: list[Step] = field(default_factory=list)
    # live paths outside the plan that still hold the inode of a hard-linked target: the
    # target is linked to them, not copied (the seed of apply_step's ``made``)
    partners: dict = field(default_factory=dict)
    # a call's revert: its paths placed in it by a guess among calls active together, and
    # other calls' paths placed by a guess while it was active too (engines.diff.Side.guessed)
    guessed: list[str] = field(default_factory=list)
    maybe_ours: dict[str, list[str]] = field(default_factory=dict)
    late: list[str] = field(default_factory=list)  # a call's paths changed after it ended
    # the actors (pid:start) whose events the plan's steps undo (reverts.still_running)
    writers: set[str] = field(default_factory=set)
    # an interrupted revert carried on: its paths changed since it began (recheck)
    changed_since: list[str] = field(default_factory=list)
    # paths the selection changed that an earlier revert put back as they were before it:
    # nothing to do, no step
    already: list[str] = field(default_factory=list)
    # git objects the selection made that stay: another unit changed their repository since,
    # and what it wrote there (a branch, a tag, the index) may name them (_keep_git_objects)
    kept_objects: list[str] = field(default_factory=list)
    # --path: paths the plan removes that a rename in the selection brought from a name
    # outside the pattern, which it does not put back: (that name, the path)
    moved_from_outside: list[tuple[str, str]] = field(default_factory=list)

    @property
    def conflicts(self) -> list[Step]:
        return [s for s in self.steps if s.conflict]


def selected_units(j: Journal, *, call=None, turn=None, session=None, since=None,
                   revert_id=None) -> tuple[set[str] | None, int, int | None]:
    """The units a selection names (None: every unit) and its seq range."""
    if revert_id is not None:
        return {revert_unit(revert_id)}, 1, None
    if call is not None:
        c = find_call(j, call, session)
        # none of a call's events comes before its begin
        return {call_unit(c["session"], call)}, c.get("begin_seq") or 1, None
    if turn is not None:
        t = find_turn(j, turn, session)
        sid = t["session"]
        units = {turn_unit(sid, t["index"])} | {
            call_unit(sid, c["id"]) for c in j.records("calls", sid.encode() + b"\0")
            if c.get("turn") == t["index"]}
        return units, t["begin_seq"], None
    if session is not None:
        if j.record("sessions", session.encode()) is None:
            raise SelectionError(f"no session {session}")
        units = {session_unit(session)} | {call_unit(session, c["id"]) for c in
                                          j.records("calls", session.encode() + b"\0")} | \
            {turn_unit(session, t["index"]) for t in j.records("turns", session.encode() + b"\0")}
        # with --since: the session's changes after that point (it was ignored: the whole
        # session was planned)
        return units, (since + 1 if since is not None else 1), None
    if since is not None:
        if since > j.last_seq():
            raise SelectionError(f"--since {since} is past the record's end (seq "
                                 f"{j.last_seq()})")
        return None, since + 1, None
    raise SelectionError("say what to revert: --call, --turn, --session or --since")


def _same(a: State, b: State) -> bool:
    """Kept for older callers: everything the record keeps (see State.same)."""
    return a.same(b)


def make_plan(j: Journal, states: States, live: Tree, selection: dict, glob: str | None = None,
              revert_id: str | None = None) -> Plan:
    keep = path_matcher(glob) if glob else None
    units, lo, hi = selected_units(j, **selection)
    spans: dict[str, list[int]] = {}
    others: dict[str, list[int]] = {}
    last_unit: dict[str, str] = {}
    linkish: set[str] = set()  # names the record saw share an inode
    call_unit = next(iter(units)) if selection.get("call") is not None else None
    shared: list[dict] = []  # events placed among calls active together, the call's among them
    writers: set[str] = set()
    late_paths: set[str] = set()  # a call's, changed after it ended (views.late)
    drifts: set[int] = set()  # seals' drifts: changes the record found, not saw made
    by_reverts: set[int] = set()  # other units' events that are reverts'
    evs = file_events(j, lo, hi)
    selected = {e["seq"] for e in evs if units is None or (e.get("unit") or "") in units}
    # from the selection's first event: what came before it neither interleaves nor extends a
    # span; the links made before it are read only when a hard-linked target asks (below)
    for e in evs:
        if e["op"] in ("link", "alias"):
            linkish.update(x for x in (e.get("path"), e.get("source")) if x)
        elif e["op"] == "drift":
            drifts.add(e["seq"])
        if call_unit is not None and call_unit in (e.get("candidates") or ()):
            shared.append(e)
        for p in touched(states, e):
            if not _visible(p):
                continue
            mine = e["seq"] in selected
            if mine:
                if keep and not keep(p):
                    continue
                s = spans.setdefault(p, [e["seq"], e["seq"]])
                s[1] = e["seq"]
                last_unit[p] = e.get("unit") or ""
                writers.add(e["actor"])
                if call_unit is not None and e.get("after_end"):
                    late_paths.add(p)
            else:
                others.setdefault(p, []).append(e["seq"])
                if unit_kind(e.get("unit")) == "revert":
                    by_reverts.add(e["seq"])
    ends = states._unit_ends()
    unrecorded = {e.get("path") for e in j.events_of(("unrecorded",), lo, hi)}
    plan = Plan(revert_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6], selection,
                writers=writers, late=sorted(late_paths))
    if shared:
        plan.guessed = guessed([e for e in shared if e.get("unit") == call_unit])["guessed"]
        plan.maybe_ours = placed_elsewhere(shared, call_unit)
    # a file another unit changed between two of the selection's changes under a name the
    # selection moved it from or on to (`mv a a.bak`, the user's edit of a.bak, `mv a.bak a`;
    # or of a directory above it): a per-name check sees a.bak made and unmade and no other
    # writer in a's chain, and the revert put a's old content back over the user's line.  Every
    # name the file had through those renames is interleaved, as the name it was changed under
    # would be: path -> the names another unit changed it under
    moved_over: dict[str, set[str]] = {}
    if others:
        for end, (held, had) in moved_on(
                states, evs, lambda e: e["seq"] in selected,
                ignore=lambda p, s: _a_refresh(states, p, s)).items():
            where = set().union(*held.values())
            for name in had | {end}:
                moved_over.setdefault(name, set()).update(where)
    made_dirs: set[str] = set()
    gone_ways: dict[str, bool] = {}  # _way_gone's answers, by directory
    for p, (first, last) in sorted(spans.items(), key=lambda kv: kv[0].split("/")):
        if p.startswith("/") or ".." in p.split("/"):
            raise SelectionError(f"refusing a path that leaves the workspace: {p}")
        target = states.state(p, first - 1)
        # what the reverted unit left: the path as its unit ended (its writes after the last
        # event, through a handle already open, are not events), unless another came between
        end = ends.get(last_unit[p])
        if end and end > last and not any(last < s <= end for s in others.get(p, [])):
            last = end
        # or, for a run still writing then (written through a descriptor after its unit's
        # end), once its release was noted
        last = states.settle(p, last)
        expected = states.state(p, last)
        # changed since only by earlier reverts (one of the selection's calls reverted): what
        # they put back is the selection's own matter, never another writer's change
        since = [q for q in others.get(p, ()) if q > last]
        reverted = bool(since) and all(q in by_reverts for q in since)
        if target.same(expected) and (target.exact and expected.exact or
                                      target.withheld and expected.withheld):
            # made and unmade inside the selection (a temp file): nothing to do.  Not when a
            # side is a guess (a secret's placeholder names the event that last changed it):
            # two guesses alike say nothing of what the path held
            if not (target.exact and reverted):
                continue
            back = states.state(p, since[-1])
            if not back.exact or target.same(back):
                continue
            # but an earlier revert of part of the selection brought it back since (a call
            # that moved or removed what another made reverted, then their session): it goes
            # as the selection's own, from what that revert left (it stayed without a word:
            # found by a hunt)
            expected = back
        step = Step(p, target, expected)
        if live.symlink_on_the_way(p) and live.blocker(p) not in made_dirs:
            if reverted and target.exact and (now := live.state(p)).exact and \
                    target.same(now):
                # put back already by an earlier revert (as below): the file it made again
                # where the selection had made a directory is what blocks the way (the path
                # was refused as an escape: found by a hunt)
                plan.already.append(p)
                continue
            # a directory on its way is now a symlink (or a file) the plan does not itself
            # replace by a directory: never followed
            step.conflict = "escape"
        elif not expected.exact and (drift := _drifted_unkept(states, p, last)):
            # changed while unmounted after the selection: a conflict, as where the record
            # kept the content (the live file then differs from what the selection left);
            # here what the selection left is not known either
            step.conflict, step.note = "changed", drift
        elif not expected.exact and p not in unrecorded and expected.kind != "absent" and \
                any(s > last and s not in drifts for s in others.get(p, ())) and \
                live.state(p).kind != expected.kind:
            # what the selection left is not known in content, but it left something there,
            # and another unit has changed the path through the mount since: a conflict, as
            # where the content was kept.  Not "nothing to do" when the path happens to hold
            # the target (a file the selection made, moved away with its directory by another
            # process: found by the history model).  A removal around the mount (a seal's
            # drift) is left to the branches below
            step.conflict = "changed"
        elif (p in unrecorded or not expected.exact) and target.exact and \
                (now := live.state(p)).exact and target.same(now):
            # what the selection left is not known, but the path holds what the revert would
            # put back (a file it made, removed around the mount): nothing to do
            continue
        elif p in unrecorded or not target.exact or not expected.exact:
            step.conflict = "unrecorded"
            if target.withheld or expected.withheld:
                step.note = PLACEHOLDER  # a secret path: nothing to put back
            else:
                step.note = _attic_gone(j, states, p) or _changed_around(states, p, first) or (
                    STILL_WRITING if not expected.exact and states.still_writing(p, last)
                    else states.tree.unreadable.get(p) or live.unreadable.get(p))
        elif any(first < s < last and not _a_refresh(states, p, s) for s in others.get(p, [])):
            step.conflict = "interleaved"
        elif p in moved_over:
            step.conflict = "interleaved"
            step.note = "the file was changed by another writer as " + ", ".join(
                sorted(shown(w) for w in moved_over[p])) + ", between two of the reverted " \
                "changes"
        else:
            now = live.state(p)
            unknown = None if now.exact else live.unreadable.get(p)
            if unknown:
                # a live file this reader may not read is taken for what the record ends with
                # only where the seal vouches for it (its stat unmoved); one it cannot even
                # reach (a directory on its way), never
                end = states.state(p, INF)
                if now.kind != "file" or end.drifted or not expected.same(end):
                    step.conflict, step.note = "unrecorded", unknown
            elif not expected.same(now) and not _refreshed(p, expected, now, live):
                if now.exact and target.exact and target.same(now) and reverted:
                    # an earlier revert put back since what the selection changed (one of
                    # the turn's calls reverted by the agent inside the turn): nothing to
                    # write, so nothing to refuse; said, not a step.  Put back by another
                    # unit (the user by hand, a change around the mount) it stays a conflict
                    plan.already.append(p)
                    continue
                step.conflict = "changed"
        if not step.conflict and not step.note and target.present and \
                (gone := _way_gone(p, last, states, live, others, gone_ways)):
            # a directory on its way that the selection left there was moved or removed by
            # another writer since (`mv proj proj2` in a later session): the step makes it
            # anew, empty but for this path and with a mode of its own, which it did without a
            # word (found by a hunt).  Said on the step; not refused, as the history model has
            # it (the path is put back where the selection found it)
            step.note = f"makes {shown(gone)} anew: another writer moved or removed it since"
        plan.steps.append(step)
        if target.kind == "dir":
            # this plan puts a directory here first (order(): dirs first); if the directory
            # has a conflict of its own the revert is refused there, not on what lies beneath
            made_dirs.add(p)
    if keep:
        _moved_from_outside(plan, [e for e in evs if e["seq"] in selected and
                                   e["op"] == "rename" and e.get("path2")], keep, states)
    _keep_git_objects(plan, spans, others, states)
    for step in plan.steps:
        # a directory the plan moves, makes or removes whose entries could not be listed: what
        # it holds is unknown, so the revert would not be the tree before
        unlisted = states.tree.unreadable.get(step.path) or live.unreadable.get(step.path)
        if is_unlisted(unlisted) and not step.conflict:
            step.conflict, step.note = "unrecorded", unlisted
    _holding_others(plan, live)
    _beneath_a_non_directory(plan)
    _moves_back(plan, states, live, evs, selected, spans, unrecorded)
    _kept_directories(plan, live)
    names: list[set[str]] = []

    def candidates() -> set[str]:  # asked only when a hard-linked target needs them
        if not names:
            # the recorded names, and what they are called now (candidates: a name linked
            # before its directory was renamed holds the inode under the directory's new name)
            for e in j.events_of(("link", "alias"), 1, lo - 1):
                linkish.update(x for x in (e.get("path"), e.get("source")) if x)
            names.append((linkish | states.candidates(INF)) - {s.path for s in plan.steps})
        return names[0]
    inodes: list[dict[int, list[str]]] = []

    def by_ino() -> dict[int, list[str]]:  # the candidates' live regular files, each stat'ed once
        if not inodes:
            found: dict[int, list[str]] = {}
            for name in sorted(candidates()):
                st = live.lstat(name)
                if st is not None and stat.S_ISREG(st.st_mode):
                    found.setdefault(st.st_ino, []).append(name)
            inodes.append(found)
        return inodes[0]
    _find_partners(plan, live, by_ino, states, spans)
    _joined_since(plan, live, by_ino)
    return plan


_OBJECT = re.compile(r"(?:[0-9a-f]{2}/[0-9a-f]{38,62}|pack/pack-[0-9a-f]+\.[a-z]+)")


KEEPS_OTHERS = "kept: it holds what the revert does not remove"


def _kept_directories(plan: Plan, live: Tree) -> None:
    """A directory the plan removes that holds paths it does not remove (files made there
    since by others) stays, as apply_step keeps it (KEPT): the preview said "delete" of it,
    with nothing more, and the run then kept it (found by a hunt).  Its step is noted so."""
    removed = {s.path for s in plan.steps if not s.conflict and not s.target.present}
    away = {s.moved_from for s in plan.steps if s.moved_from and not s.conflict}
    for s in plan.steps:
        if s.conflict or s.note or s.target.present or s.expected.kind != "dir":
            continue
        if any(p not in removed and not _beneath_any(p, away) for p in live.walk(s.path)):
            s.note = KEEPS_OTHERS


def blocked_beneath_conflicts(plan: Plan, live: Tree) -> None:
    """For `--force`: a path whose way is blocked now (a file or a symlink where a directory
    was) by a directory the plan would make but cannot (its step a conflict: the user's file
    there) is an escape too.  Without --force the plan is refused at the directory (the
    history model's conflicts); `--force`, which leaves the directory alone, stopped half way
    at the path beneath it, and its preview said nothing of it (found by a bug hunt)."""
    blocked = {s.path for s in plan.steps if s.conflict and s.target.kind == "dir"}
    if not blocked:
        return
    for s in plan.steps:
        if not s.conflict and any(u in blocked for u in _up(s.path.rpartition("/")[0])) and \
                live.symlink_on_the_way(s.path) and live.blocker(s.path) in blocked:
            s.conflict = "escape"


def _at_or_under(name: str, d: str) -> bool:
    return name == d or name.startswith(d + "/")


def _up(name: str):
    """``name`` and each directory above it (a set's lookups per level, where a scan of the
    set per name made a revert of `mv big big2` quadratic: 25 s at 5,000 files)."""
    while name:
        yield name
        name = name.rpartition("/")[0]


def _beneath_any(name: str, names: set | dict) -> bool:
    """Is ``name`` at or under one of ``names``?"""
    return any(u in names for u in _up(name))


_NAMING = ("rename", "unlink", "rmdir", "create", "mkdir", "mknod", "symlink", "link")


class _Naming:
    """The events that may move a name or take it (``evs``, in the journal's order), found
    by the names they touch: following a name through them looks only at the events on it
    and on the directories above it (a scan of every event a name made a revert of 2,000
    single renames take 20 s)."""

    def __init__(self, evs: list[dict]):
        self.evs = evs
        self.seqs = [e["seq"] for e in evs]
        self.on: dict[str, list[int]] = {}
        for i, e in enumerate(evs):
            for p in {e.get("path"), e.get("path2")}:
                if p is not None:
                    self.on.setdefault(p, []).append(i)

    def after(self, name: str, i: int) -> int | None:
        """The position of the first event from position ``i`` on that names ``name`` or a
        directory above it."""
        found = None
        for u in _up(name):
            at = self.on.get(u)
            if at:
                k = bisect.bisect_left(at, i)
                if k < len(at) and (found is None or at[k] < found):
                    found = at[k]
        return found


def _moved_to(path: str, first: int, naming: _Naming, selected: set[int]) -> str | None:
    """What the object ``path`` held just before event ``first`` is called now, followed
    through the selection's renames of it or of a directory above it (``naming``: every
    event from the selection's first on that may move or take a name); None where it left
    its name otherwise (removed, renamed over, moved by another unit, exchanged)."""
    name = path
    i = bisect.bisect_left(naming.seqs, first)
    while (i := naming.after(name, i)) is not None:
        e = naming.evs[i]
        i += 1
        op, src, dst = e["op"], e.get("path"), e.get("path2")
        if op == "rename" and dst and dst != src:
            if e.get("flags", 0) & 2:
                if _at_or_under(name, src) or _at_or_under(name, dst):
                    return None
            elif _at_or_under(name, src):
                if e["seq"] not in selected:
                    return None
                name = dst + name[len(src):]
            elif _at_or_under(name, dst):
                return None
        elif op in ("unlink", "rmdir") and _at_or_under(name, src) or \
                op in ("create", "mkdir", "mknod", "symlink", "link") and src == name:
            return None
    return name


def _only_moved(states: States, names, first: int, unrecorded: set) -> bool:
    """Does the record vouch that the object under ``names`` (its names, the last the live
    one) was changed by nothing but renames from event ``first`` on, and is as sealed (no
    drift)?  Then what it held then is what it holds now, though neither may be read here (a
    file of another owner that its reader may not read)."""
    for n in names:
        if n in unrecorded or any(e["seq"] >= first and e["op"] != "rename" and
                                  e["op"] not in MARK_OPS for e in states.events_on(n)):
            return False
    return not states.state(names[-1], INF).drifted


def _moves_back(plan: Plan, states: States, live: Tree, evs: list[dict], selected: set[int],
                spans: dict[str, list[int]], unrecorded: set) -> None:
    """Undo the selection's renames by renaming back (one rename(2), the inode kept: its owner,
    links and attributes, and for a directory everything beneath it), where the rename's
    destination still holds what the rename put there and the name it came from is free, or
    freed by another rename back first.  The revert rebuilt every rename as "make the old
    name, delete the new one": a user's revert of `mv dir dir2`, dir holding a root-owned
    directory, stopped half way on what it could not remove; a root-owned file the user may
    not read, moved, was refused as unrecorded, and one it may read came back as the user's
    copy (found by a bug hunt).

    A path's step becomes the rename back (``moved_from``) when the object it held before the
    selection is, followed through the selection's renames, at a live name of the plan,
    still its kind (a file: the same inode), and every path of the plan beneath that name is
    without a conflict (one the record vouches for though its reader may not read it:
    _only_moved) and nothing else lives there.  The steps of the paths beneath both names
    are then planned against what the rename back leaves: those it makes whole go, a file
    the selection changed after the rename is written back as its own step after it, and
    what the selection added there is removed.  Elsewhere the steps stay as they were."""
    sources = {e["path"] for e in evs if e["op"] == "rename" and e["seq"] in selected}
    if not sources:
        return
    # the events that may move a name or take it (a session's writes are most of them)
    naming = _Naming(sorted((e for e in evs if e["op"] in _NAMING), key=lambda e: e["seq"]))
    steps = {s.path: s for s in plan.steps}
    conflicted = [(p, o) for p, o in steps.items() if o.conflict]
    held = {p: s.expected for p, s in steps.items()}  # what each path holds, as moves go
    waiting = []
    for s in sorted(plan.steps, key=lambda s: s.path.count("/")):
        parts = s.path.split("/")
        if not s.target.present or \
                not any("/".join(parts[:k]) in sources for k in range(1, len(parts) + 1)):
            continue  # not beneath a name the selection renamed
        now = _moved_to(s.path, spans[s.path][0], naming, selected)
        if now is not None and now != s.path and \
                _may_move(s, now, steps, conflicted, states, live, spans, unrecorded):
            waiting.append((s, now))
    accepted = _Accepted()
    waiting_at: dict[str, int] = {}  # how many waiting items' objects are at each name
    for _, now in waiting:
        waiting_at[now] = waiting_at.get(now, 0) + 1
    while waiting:
        # the first that can be decided now; what waits on a name no rename back frees stays
        # planned as before
        item, here = next(((w, v) for w in waiting if (v := _fits_then(
            w, accepted, waiting_at, held, states, spans, unrecorded)) is not None),
            (None, None))
        if item is None:
            break
        waiting.remove(item)
        waiting_at[item[1]] -= 1
        if here:
            s, now = item
            moving = {p: held[p] for p in held if _at_or_under(p, here)} \
                if held[here].kind == "dir" else {here: held[here]}
            for p in moving:
                held[p] = ABSENT
            for p, st in moving.items():
                held[s.path + p[len(here):]] = st
            accepted.add(s, here, now)
    if accepted.all:
        _rewrite(plan, accepted.all, held, states, live, spans, unrecorded)


class _Accepted:
    """The renames back taken so far, in order, with the names they touch indexed (each
    candidate asks of them only its own names and the directories above them)."""

    def __init__(self):
        self.all: list[tuple[Step, str, str]] = []  # (step, where its object is then, live name)
        self.froms: dict[str, list[tuple[int, str]]] = {}  # name left -> (order, name back)
        self.above_paths: set[str] = set()  # the names renamed back to, and the dirs above
        self.above_froms: set[str] = set()  # the names left, and the dirs above

    def add(self, s: Step, here: str, now: str) -> None:
        self.froms.setdefault(here, []).append((len(self.all), s.path))
        self.above_paths.update(_up(s.path))
        self.above_froms.update(_up(here))
        self.all.append((s, here, now))

    def where(self, name: str) -> str:
        """Where ``name``'s object is once the renames back are made in order (those that
        bring a directory above it back)."""
        last = -1
        while True:
            k, u, back = min(((k, u, back) for u in _up(name)
                              for k, back in self.froms.get(u, ()) if k > last),
                             default=(None, None, None))
            if k is None:
                return name
            name, last = back + name[len(u):], k


def _may_move(s: Step, now: str, steps: dict[str, Step], conflicted: list, states: States,
              live: Tree, spans: dict[str, list[int]], unrecorded: set) -> bool:
    """Does the live name ``now`` hold what ``s.path`` held before the selection, as the
    selection left it, and nothing the plan does not know beneath it?"""
    n = steps.get(now)
    st = live.lstat(now)
    t = s.target
    if n is None or st is None or n.expected.kind != t.kind or kind_of(st.st_mode) != t.kind:
        return False
    if t.kind != "dir" and not (t.ino and t.ino == n.expected.ino == st.st_ino):
        return False
    if not _renamable(live, now, s.path, st):
        return False
    first = spans[s.path][0]
    for p, o in conflicted:
        if _at_or_under(p, now) and not (
                o.conflict == "unrecorded" and
                _only_moved(states, [s.path + p[len(now):], p], first, unrecorded)):
            return False
    return t.kind != "dir" or all(p in steps for p in live.walk(now))


def _renamable(live: Tree, now: str, back: str, st: os.stat_result) -> bool:
    """May the reverting user rename ``now`` (its lstat ``st``) to ``back``, as far as a
    removal and a making there would not already ask?  Not another's object out of another's
    sticky directory (/tmp's mode), nor a directory it may not write into another directory
    (its ``..`` changes): natively `mv` is refused too, and the revert, planned as before,
    refuses what it must in one line, where a rename back stopped it half way."""
    me = os.geteuid()
    if me == 0:  # (the owner's privileges that let root do both)
        return True
    parent = live.lstat(now.rpartition("/")[0])
    if parent is not None and parent.st_mode & stat.S_ISVTX and me not in (st.st_uid,
                                                                          parent.st_uid):
        return False
    if stat.S_ISDIR(st.st_mode) and now.rpartition("/")[0] != back.rpartition("/")[0]:
        bits = 0o200 if st.st_uid == me else 0o020 if st.st_gid in os.getgroups() or \
            st.st_gid == os.getegid() else 0o002
        return bool(st.st_mode & bits)
    return True


def _fits_then(item: tuple[Step, str], accepted: _Accepted, waiting_at: dict[str, int],
               held: dict, states: States, spans: dict[str, list[int]],
               unrecorded: set) -> str | bool | None:
    """Can ``item``'s rename back be made after those ``accepted``?  Where its object is
    then (a directory above it renamed back first), False when it cannot, None when its name
    is to be freed by a rename back still waiting (``waiting_at``: how many wait at each)."""
    s, now = item
    here = accepted.where(now)
    if any(u in accepted.froms for u in _up(s.path) if u != s.path) or \
            s.path in accepted.above_paths or here in accepted.above_paths or \
            here in accepted.above_froms:
        return False  # entangled with another rename back: planned as before
    if _at_or_under(s.path, here) or not held.get(here, ABSENT).present:
        return False  # (one cannot be renamed into itself)
    parts = s.path.split("/")
    if any(held.get("/".join(parts[:k]), ABSENT).kind not in ("dir", "absent")
           for k in range(1, len(parts))):
        return False  # a file above its name then: planned as before
    if held[s.path].present:
        # taken: by what another rename back moves away first, or planned as before
        return None if waiting_at.get(s.path, 0) - (now == s.path) > 0 else False
    moved = held[here]
    if s.conflict and not (s.conflict == "unrecorded" and s.target.same(moved) and
                           _only_moved(states, [s.path, now], spans[s.path][0], unrecorded)):
        return False
    return here


def _settled(t: State, now: State, vouched) -> bool:
    """Does a path that holds ``now`` once the renames back are made hold its target ``t``
    (a file: in the same inode), with nothing to write?"""
    if not t.present or not now.present:
        return t.present == now.present
    if not t.same(now) or t.kind != "dir" and t.ino != now.ino:
        return False
    return t.exact and now.exact or vouched()


def _rewrite(plan: Plan, accepted: list, held: dict, states: States, live: Tree,
             spans: dict[str, list[int]], unrecorded: set) -> None:
    """The plan's steps once the renames back ``accepted`` are made (``held``: what each path
    holds then): each becomes a rename back, goes (made whole by one), is planned against
    what the renames leave, or is made to remove what they bring that was not there."""
    moves = {id(s): (here, now) for s, here, now in accepted}
    ends = {x for s, here, _ in accepted for x in (s.path, here)}
    nows = {now for _, _, now in accepted}
    back_to = {s.path: now for s, _, now in accepted}  # (their paths do not nest: _fits_then)
    origin = {}  # a path beneath a rename back -> its live name now, the record's (vouching)
    for p in held:
        a = next((u for u in _up(p) if u in back_to), None)
        if a is not None:
            origin[p] = back_to[a] + p[len(a):]
    out = []
    for s in plan.steps:
        if id(s) in moves:
            here, now = moves[id(s)]
            s.moved_from = here
            s.expected = held[s.path]
            if s.conflict == "unrecorded":
                s.conflict = s.note = None  # (_fits_then: the record vouches for it)
            out.append(s)
        elif _beneath_any(s.path, ends):
            now = held[s.path]
            first = spans.get(s.path, [1])[0]
            if _settled(s.target, now, lambda: _only_moved(
                    states, [s.path, origin.get(s.path, s.path)], first, unrecorded)):
                continue
            s.expected = now
            if s.conflict == "unrecorded" and _beneath_any(s.path, nows):
                # what could not be read there is what a rename back moves away (vouched by
                # _may_move): the path is written afresh.  Left a conflict, `--force` renamed
                # the object away and left the path "alone", empty (found by a bug hunt)
                s.conflict = s.note = None
            out.append(s)
        else:
            out.append(s)
    paths = {s.path for s in plan.steps}
    for p, now in held.items():
        if p not in paths and now.present:  # brought by a rename back: the selection made it
            out.append(Step(p, ABSENT, now))
    for s, _, now in accepted:  # the inode each moves (a directory's is not in the record)
        st = live.lstat(now)
        s.expected = s.expected.but(ino=st.st_ino if st is not None else s.expected.ino)
    plan.steps = sorted(out, key=lambda s: s.path.split("/"))


def _moved_from_outside(plan: Plan, renames: list[dict], keep, states: States) -> None:
    """``--path`` takes one side of a rename: the steps that remove what a rename of the
    selection brought under the pattern from a name outside it (`mv proj proj2`, reverted
    with `--path proj2`) put nothing back there, and the files left the tree, said by
    nothing (found by a hunt).  Named in ``moved_from_outside``: what the old name held just
    before the rename (a file made there after it came by no rename: it was named too, a
    hunt found)."""
    for s in plan.steps:
        if s.target.present:
            continue
        # followed back through a chain of them (`mv proj proj2; mv proj2 proj3`): the name
        # before the first (the warning named proj2, never in the tree before, and said
        # nothing when proj2 and proj3 were both named: found by a bug hunt)
        old, first = s.path, None
        for r in reversed(renames):
            src, dst = r["path"], r["path2"]
            if old == dst or old.startswith(dst + "/"):
                old, first = src + old[len(dst):], r["seq"]
        if first is not None and not keep(old) and states.state(old, first - 1).present:
            plan.moved_from_outside.append((old, s.path))


def _way_gone(path: str, last: int, states: States, live: Tree,
              others: dict[str, list[int]], answers: dict[str, bool]) -> str | None:
    """The nearest directory on ``path``'s way that is not there now, was a directory when
    the selection last changed ``path`` (seq ``last``), and another unit has changed since
    (moved or removed it); None when there is none.  A directory the plan itself makes again
    (one the selection removed) is the plan's, not another writer's."""
    parts = path.split("/")
    for k in range(len(parts) - 1, 0, -1):
        d = "/".join(parts[:k])
        if d not in answers:
            answers[d] = live.state(d).kind == "absent" and \
                states.state(d, last).kind == "dir" and \
                any(q > last for q in others.get(d, ()))
        if answers[d]:
            return d
    return None


def _git_dir(path: str) -> tuple[str, str] | None:
    """(the repository's ``.git`` directory, the rest of ``path`` beneath it), or None."""
    parts = path.split("/")
    if ".git" not in parts[:-1]:
        return None
    i = parts.index(".git")
    return "/".join(parts[:i + 1]), "/".join(parts[i + 1:])


def _keep_git_objects(plan: Plan, spans: dict[str, list[int]],
                      others: dict[str, list[int]], states: States) -> None:
    """The git objects the selection made (a loose object, a pack) are not removed where
    another unit changed their repository after the selection first wrote them: a branch, a
    tag or the index it wrote may name them, and removing them left the repository corrupt
    (`git fsck`: invalid sha1 pointer) with nothing in the plan to say so, since the other
    unit's own paths were new ones.  An object no one names is harmless (``git gc`` drops it),
    so they stay, said (``kept_objects``).

    A path that holds now what it held before the other units' changes after the selection's
    first write to the repository (a later commit reverted since, and its revert's changes)
    changed nothing that can name them: reverting git calls newest first kept each earlier
    call's objects for the later ones already reverted, and the next revert then conflicted
    with an object it had kept (found by a bug hunt)."""
    first: dict[str, int] = {}  # a .git directory -> the selection's first write there
    for p, (lo, _) in spans.items():
        g = _git_dir(p)
        if g is not None:
            first[g[0]] = min(first.get(g[0], lo), lo)
    changed: dict[str, int] = {}  # a .git directory -> the last seq another unit changed it
    for p, seqs in others.items():
        g = _git_dir(p)
        if g is None or g[0] not in first:
            continue
        later = [q for q in seqs if q > first[g[0]]]
        if later and not states.state(p, INF).same(states.state(p, min(later) - 1)):
            changed[g[0]] = max(changed.get(g[0], 0), max(later))
    if not changed:
        return
    keep = []
    for step in plan.steps:
        g = _git_dir(step.path)
        if g is None or step.target.present or step.expected.kind != "file" or \
                not g[1].startswith("objects/") or not _OBJECT.fullmatch(g[1][8:]):
            continue
        if changed.get(g[0], 0) > spans[step.path][0]:
            keep.append(step)
    if keep:
        plan.steps = [s for s in plan.steps if not any(s is k for k in keep)]
        plan.kept_objects = sorted(s.path for s in keep)


def _joined_since(plan: Plan, live: Tree, by_ino) -> None:
    """A hard-linked target whose live inode now has more names outside the plan than its
    group had then (a name linked to it after the target's point, say by another unit) is not
    written back in place: that would change a name the revert does not own.

    Nor where the live inode is held by steps of two groups: a name linked to the group after
    its target's point (by another unit) and changed since by the selection (a late write
    through the group) has a target of its own, the state the name was linked in, and one
    inode cannot hold both.  Of the groups sharing it, only the one whose names outside the
    plan still need it written in place (names the record does not know) is; the others are
    written anew and linked among themselves."""
    sharing: dict[int, list[list[Step]]] = {}  # live inode -> the groups of steps holding it
    outside: dict[int, int] = {}               # id(group) -> its names outside the plan then
    held_by: dict[int, list[set[int]]] = {}    # live inode -> its groups' steps, as ids
    for step in plan.steps:
        t = step.target
        if not (t.kind == "file" and link_key(t) and t.nlink > 1) or not step.in_place:
            continue
        group = [o for o in plan.steps if linked(t, o.target)]
        members = {id(o) for o in group}  # (a scan of the group per step: a 1,000-name file's
        # revert made 10^9 comparisons, 80-100 s)
        # the names the inode had then, less the group's, less the plan's other steps that
        # hold it (a name the selection linked, which the revert removes, is no name outside)
        others = sum(1 for o in plan.steps if id(o) not in members and
                     _holds_ino(o, live, t.ino))
        outside_then = max(0, t.nlink - len(group) - others)
        if len(by_ino().get(t.ino, ())) > outside_then:
            for o in group:
                o.in_place = False
            continue
        st = live.lstat(step.path)
        if st is None or st.st_ino != t.ino or not stat.S_ISREG(st.st_mode):
            continue
        groups = sharing.setdefault(st.st_ino, [])
        if not any(id(step) in held for held in held_by.get(st.st_ino, ())):
            held_by.setdefault(st.st_ino, []).append(members)
            groups.append(group)
            outside[id(group)] = outside_then
    for groups in sharing.values():
        if len(groups) < 2:
            continue
        needing = [g for g in groups if outside[id(g)] > 0]
        keep = needing[0] if len(needing) == 1 else None
        for g in groups:
            if g is not keep:
                for o in g:
                    o.in_place = False


def _holds_ino(step: Step, live: Tree, ino: int) -> bool:
    """Does ``step``'s path hold inode ``ino``, as the selection left it or now?"""
    e = step.expected
    if e.kind == "file" and e.ino == ino:
        return True
    st = live.lstat(step.path)
    return st is not None and st.st_ino == ino and stat.S_ISREG(st.st_mode)


AROUND_NOTE = ("changed around the mount while its unit went on (by a process that bypassed "
               "the mount, or after its daemon was killed): what the unit left is not known")


def _refreshed(path: str, a: State, b: State, live: Tree) -> bool:
    """Do ``a`` and ``b`` differ only as a git index refreshed by git itself (a `git
    status` after a file's stat changed: engines.gitindex)?  Then putting back one over the
    other loses nothing, and it is not a conflict.  A split index's shared file is read
    from ``live``: git never rewrites one (its name is its hash)."""
    if not (a.kind == b.kind == "file" and a.mode == b.mode and a.exact and b.exact and
            gitindex.is_index(path)) or over_limit(a.data) or over_limit(b.data):
        return False
    try:
        return gitindex.refreshed(path, whole(a.data), whole(b.data),
                                  shared=lambda name: _small_file(live, name))
    except (OSError, JournalError):  # a content that cannot be read now: a conflict, as before
        return False


def _small_file(live: Tree, rel: str) -> bytes | None:
    """The live content of a regular file ``rel`` within the size a reader holds; None."""
    st = live.state(rel)
    if st.kind != "file" or over_limit(st.data):
        return None
    return whole(st.data)


def _a_refresh(states: States, path: str, seq: int) -> bool:
    """Was another unit's event ``seq`` on ``path`` git refreshing its index (_refreshed)?"""
    return gitindex.is_index(path) and _refreshed(path, states.state(path, seq - 1),
                                                  states.state(path, seq), states.tree)


def _changed_around(states: States, path: str, first: int) -> str | None:
    """Why ``path`` is unrecorded when a seal found it changed around the mount."""
    return AROUND_NOTE if changed_around(states, path, first) else None


DRIFT_NOTE = ("changed while unmounted since; its content, past the whole-file limit, was "
              "not kept, so what the selection left is not known")


def _drifted_unkept(states: States, path: str, last: int) -> str | None:
    """Why ``path`` is a ``changed`` conflict when a change made while unmounted (a drift of
    ``outside:unmounted``; one around the mount is _changed_around's) followed the selection
    (through ``last``) and the seal it departed from kept no content."""
    unit = outside_unit(UNMOUNTED)
    for e in states.chain_on(path):
        pre = e.get("pre") or {}
        if e["seq"] > last and e["op"] == "drift" and e.get("unit") == unit and \
                pre.get("kind") == "file" and "blob" not in pre and not pre.get("withheld"):
            return DRIFT_NOTE
    return None


def _attic_gone(j: Journal, states: States, path: str) -> str | None:
    """Why ``path`` is unrecorded when a pre-image of it was kept in the attic and that entry
    is gone: dropped to free space (named by a ``reclaim`` marker) or removed by hand."""
    gone = set()
    for e in states.chain_on(path):
        pre = states.pre_for(e, path)
        if pre and "attic" in pre and "blob" not in pre and \
                states.tree.lstat(f"{ATTIC}/{pre['attic']}") is None and \
                states.stored_since(e, path) is None:
            gone.add(pre["attic"])
    if not gone:
        return None
    if any(gone.intersection(e.get("dropped", ())) for e in j.events() if e["op"] == "reclaim"):
        return "its pre-image was dropped to free space when the workspace's filesystem was full"
    return "its pre-image's attic entry is gone"


def _holding_others(plan: Plan, live: Tree) -> None:
    """A path the revert turns from a directory back into a file (a fifo, a symlink) while the
    directory holds what the plan does not remove (another unit's files): a ``changed``
    conflict, not a revert that stops half way on a directory that is not empty."""
    gone = {s.path for s in plan.steps if not s.target.present and not s.conflict}
    for step in plan.steps:
        if step.conflict or step.target.kind in ("dir", "absent"):
            continue
        st = live.lstat(step.path)
        if st is not None and stat.S_ISDIR(st.st_mode) and \
                any(c not in gone for c in live.walk(step.path)):
            step.conflict = "changed"


def _beneath_a_non_directory(plan: Plan) -> None:
    """A path the plan puts back beneath one it turns into a file (a fifo, a symlink): the
    selection made that directory, another unit put the path in it, and the selection moved
    it on; the two targets cannot both be made.  An ``interleaved`` conflict, not a revert
    that stops half way, pending, on "not a directory" (found by the history model: an
    outside process moved a directory into one a call had made in a file's place)."""
    not_dirs = {s.path for s in plan.steps if s.target.present and s.target.kind != "dir"}
    if not not_dirs:
        return
    for step in plan.steps:
        if step.conflict or not step.target.present:
            continue
        parts = step.path.split("/")
        if any("/".join(parts[:i]) in not_dirs for i in range(1, len(parts))):
            step.conflict = "interleaved"


def _find_partners(plan: Plan, live: Tree, by_ino, states: States,
                   spans: dict[str, list[int]]) -> None:
    """For each hard-linked target whose group had more names than the plan makes: a live
    path outside the plan (a recorded name; ``by_ino()`` maps the live inodes of them, asked
    only when needed) still holding that inode and content, which the group's steps link to.

    And for a file that had one name then, whose inode has left the path (the selection
    renamed it away) and lives on under a name another unit linked to it since: that name,
    when the record says it holds that inode (not another one given the same number since)
    and it holds the target's state.  The revert links the path to it, as renaming the file
    back would have (found by the history model: a file renamed over another by one call,
    linked by the next; reverting the first gave the file back as a copy)."""
    shared: list = []  # _linked_with_outside's answer, made once if a target asks
    for step in plan.steps:
        t = step.target
        if not link_key(t) or link_key(t) in plan.partners or t.kind != "file":
            continue
        moved = t.nlink <= 1
        if t.nlink > 1:
            group = [o for o in plan.steps if linked(t, o.target)]
            if t.nlink <= len(group):
                # every name of the group is a step of the plan: a partner only where the
                # inode has left them all and lives on under a name another unit linked to
                # it since, as for one name below (history model: a linked pair renamed away
                # by one call, a third name linked by another; the revert of the first gave
                # the pair back as a new file, and the third name was no longer one with it)
                if any(_inode_at(live, o.path) == t.ino for o in group) or \
                        _gone_with(states, group, spans):
                    continue
                moved = True
            seed = t
        else:
            if _inode_at(live, step.path) == t.ino:
                continue  # the inode is still here
            if _gone_with(states, [step], spans):
                continue  # (a revert linked two files never linked, a name with that number)
            seed = t.but(nlink=2)  # one group with its partner (``linked``)
        for name in by_ino().get(t.ino, ()):
            if _visible(name) and live.state(name).same(t) and \
                    (not moved or states.state(name, INF).ino == t.ino and
                     _linked_since(states, name, spans[step.path][0])):
                # (same(): chmodded since, it is a name of another group)
                plan.partners[link_key(t)] = (name, t.ino, seed)
                break
        else:
            if t.nlink > 1 and not moved:
                if not shared:  # once, when a target first asks
                    shared.append(_linked_with_outside(plan, live, by_ino))
                found = _partner_anew(t, shared[0], live, states, spans[step.path][0]) or \
                    _partner_remade(t, by_ino(), live, states, spans[step.path][0])
                if found is not None:
                    plan.partners[link_key(t)] = (found[0], found[1], seed)


def _linked_since(states: States, name: str, first: int) -> bool:
    """Was ``name`` made a name of its inode by a link (``ln``) from event ``first`` on, not
    only reached by renames?  A file of one name renamed away (`mv a b`, reverted with `--path
    a`) came back linked to b, the name the rename took it to: two names of one inode, which
    it never had, and a write to one changed the other (found by a bug hunt)."""
    return any(e["op"] == "link" and e.get("path") == name and e["seq"] >= first
               for e in states.events_on(name))


def _linked_with_outside(plan: Plan, live: Tree, by_ino) -> list[tuple[int, list[str]]]:
    """The live inodes that paths of the plan hold linked with names outside it, every name
    of each known (the plan's and the recorded ones: its link count says so), in the plan's
    order: (inode, the names outside)."""
    paths = {s.path for s in plan.steps}
    inside: dict[int, list[int]] = {}  # inode -> [plan paths holding it, its link count]
    for s in plan.steps:
        st = live.lstat(s.path)
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            inside.setdefault(st.st_ino, [0, st.st_nlink])[0] += 1
    out = []
    for ino, (n, nlink) in inside.items():
        names = [x for x in by_ino().get(ino, ()) if x not in paths and _visible(x)]
        if names and nlink == len(names) + n:  # else a name the record does not know
            out.append((ino, names))
    return out


def _partner_anew(t: State, shared: list[tuple[int, list[str]]], live: Tree, states: States,
                  first: int) -> tuple[str, int] | None:
    """(name, live inode) of a name outside the plan that was of ``t``'s group then (it held
    ``t``'s inode before event ``first``) and is linked now with a path of the plan, in
    another inode (``shared``: _linked_with_outside): the group was written anew since, as
    one (an earlier revert made the pair again).  Only where that inode's every name is the
    plan's or was of the group then, and it holds ``t``.  A revert of the move before that gave
    the name back as a copy, cut from its group (found by hand: ``ln d/a out``, ``mv d e``,
    ``mv e f``, reverted newest first)."""
    for ino, names in shared:
        if ino != t.ino and all(states.state(n, first - 1).ino == t.ino for n in names) and \
                live.state(names[0]).same(t):
            return names[0], ino
    return None


def _partner_remade(t: State, inodes: dict[int, list[str]], live: Tree, states: States,
                    first: int) -> tuple[str, int] | None:
    """(name, live inode) of a recorded name that was of ``t``'s group then (it held ``t``'s
    inode before event ``first``) and holds ``t`` now alone, in an inode a revert made anew
    since (its last change a revert's: `ln h c` and the call that made h reverted newest
    first, then unreverted: h came back as a new inode, and c then came back as a copy of it,
    not one file with it, unless the new inode happened to get the old number; found by a
    hunt).  None when there is no such name."""
    for ino, names in inodes.items():
        if ino == t.ino:
            continue
        for n in names:
            if not _visible(n) or states.state(n, first - 1).ino != t.ino:
                continue
            st = live.lstat(n)
            if st is None or st.st_nlink != 1 or not live.state(n).same(t):
                continue
            evs = states.events_on(n)
            if evs and unit_kind(evs[-1].get("unit")) == "revert":
                return n, ino
    return None


def _parked(states: States, path: str, first: int) -> int | None:
    """The names the file ``path`` held before event ``first`` had as it left the path by an
    unlink or by another renamed over it (into the attic); None when it left otherwise
    (renamed away, exchanged: it lives on under another name) or not at all.  Followed through
    the renames of the directories above it: a revert that renamed `proj2` back to `proj` and
    then removed `proj/a` left the inode of `proj2/a` in the attic, and an unrevert linked
    `proj2/a` to an unrelated file given its number (found by a bug hunt)."""
    name, since = path, first
    for _ in range(10_000):  # (a bound: each turn follows one rename forward)
        move = states._next_move(name, since - 1)
        for e in states.events_on(name):
            if e["seq"] < since:
                continue
            if move is not None and e["seq"] > move["seq"]:
                break
            if e["op"] == "rename" and e.get("flags", 0) & 2:
                return None  # an exchange: it lives on under the other name
            if e["op"] == "unlink" and e.get("path") == name or \
                    e["op"] == "rename" and e.get("path2") == name:
                pre = states.pre_for(e, name)
                return pre.get("nlink", 1) if pre is not None and pre.get("kind") == "file" \
                    else None
            if e["op"] == "rename" and e.get("path") == name:
                return None
        if move is None or move.get("flags", 0) & 2:
            return None
        name, since = _fwd(name, move), move["seq"] + 1
        if name is None:
            return None
    return None


def _gone_with(states: States, steps: list[Step], spans: dict[str, list[int]]) -> bool:
    """Did the inode the targets of ``steps`` (its names then) held leave them all into the
    attic, the last with no other name left?  Then no live name holds it: one with its number
    holds another file, given the number once the attic let the inode go."""
    left = [_parked(states, s.path, spans[s.path][0]) for s in steps]
    return all(n is not None for n in left) and min(left) <= 1


def _inode_at(live: Tree, path: str) -> int | None:
    st = live.lstat(path)
    return st.st_ino if st is not None else None


# -- carrying a plan out ----------------------------------------------------------------------

NAME_MAX = 255


def bytes_written(plan: Plan, small: int) -> int:
    """About how much room on the workspace's filesystem carrying out ``plan`` takes at its
    peak: each file it writes anew, in whole blocks, once for a hard-link group (the group's
    other names are linked).  A file it replaces frees its room only when it is of at most
    ``small`` bytes (Recorder.SMALL_PREIMAGE: the mount copies such a pre-image into the state
    dir at once); a larger one the mount keeps in the attic, so that unrevert can put it back."""
    def blocks(n: int) -> int:
        return -(-n // 4096) * 4096
    running = peak = 0
    groups: set = set()
    for s in plan.steps:
        t, was = s.target, s.expected
        if s.conflict or t.kind != "file" or not t.data:
            continue
        if was.kind == "file" and was.data == t.data:
            continue  # its mode and owner, set in place
        if link_key(t):
            if link_key(t) in groups or link_key(t) in plan.partners:
                continue
            groups.add(link_key(t))
        running += blocks(len(t.data))
        peak = max(peak, running)
        if was.kind == "file" and was.nlink < 2 and len(was.data) <= small:
            running -= blocks(len(was.data))
    return peak


def temp_name(name: str, tag: str) -> str:
    """``.{name}.{tag}``, with ``name`` cut (on a character boundary) so that the whole fits in
    NAME_MAX *bytes*: a long UTF-8 name still gets a temporary name beside it."""
    tail = f".{tag}"
    room = NAME_MAX - 1 - len(os.fsencode(tail))
    while len(os.fsencode(name)) > room:
        name = name[:-1]
    return f".{name}{tail}"


_TEMP = re.compile(r"\.overlayrec-revert-(\d+)\Z")
# the signals a revert takes for an interruption (cli: Ctrl-C, SIGTERM, SIGHUP)
_STOPS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def clear_stale_temps(root_fd: int, paths: list[str]) -> list[str]:
    """Remove the temporary files (``temp_name``, tagged with the reverting process's pid) a
    revert killed half way left beside these paths; those removed.  Reverts go one at a time
    (``reverts.one_at_a_time``), so another pid's is no live one's: `revert --continue`
    left them in the workspace for good."""
    by_dir: dict[str, set[str]] = {}
    for p in paths:
        parent, _, name = p.rpartition("/")
        if name:
            by_dir.setdefault(parent, set()).add(name)
    removed = []
    for parent, names in by_dir.items():
        try:
            dfd = resolve_beneath(root_fd, parent, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            for entry in os.listdir(dfd):
                m = _TEMP.search(entry)
                if m is None or int(m.group(1)) == os.getpid():
                    continue
                tag = f"overlayrec-revert-{m.group(1)}"
                if not any(temp_name(n, tag) == entry for n in names):
                    continue
                try:
                    if not stat.S_ISDIR(os.stat(entry, dir_fd=dfd,
                                                follow_symlinks=False).st_mode):
                        os.unlink(entry, dir_fd=dfd)
                        removed.append(f"{parent}/{entry}" if parent else entry)
                except OSError:
                    pass
        finally:
            os.close(dfd)
    return removed


def _parent(root_fd: int, rel: str, create: bool) -> tuple[int, str]:
    """An O_PATH fd of ``rel``'s directory and its name there, reached from ``root_fd`` by
    ``resolve_beneath`` (no symlink followed, nothing climbs out); with ``create``, the
    directories missing on the way are made.  Raises ``Escape`` when a symlink or a file is
    on the way, its own parent included, or ``rel`` is not a name beneath the root."""
    if rel == "":  # the workspace root itself (a `chmod 700 .`): its mode and owner
        return os.open(".", O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root_fd), "."
    parent, _, name = rel.rpartition("/")
    if name in ("", ".", "..") or rel.startswith("/"):
        raise Escape(errno.EXDEV, "leaves the workspace", rel)
    want = O_PATH | os.O_DIRECTORY
    try:
        return resolve_beneath(root_fd, parent, want), name
    except FileNotFoundError:
        if not create:
            raise
    fd = resolve_beneath(root_fd, "", want)
    try:
        for part in parent.split("/"):
            if part in ("", "."):
                continue
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass  # a directory, or whatever it is: resolve_beneath refuses a non-directory
            nfd = resolve_beneath(fd, part, want)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd, name


def _remove(dfd: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        os.rmdir(name, dir_fd=dfd)
    else:
        os.unlink(name, dir_fd=dfd)


def make_node(dfd: int, name: str, t: State) -> None:
    """Make a fifo, socket or device node ``name`` in ``dfd`` (mode 0600 until set_meta).
    Raises OSError when it cannot be made (a device node without the privilege, say)."""
    if t.kind == "fifo":
        os.mkfifo(name, 0o600, dir_fd=dfd)
    elif t.kind == "socket":
        try:
            os.mknod(name, stat.S_IFSOCK | 0o600, dir_fd=dfd)
        except OSError as e:
            # a socket node is also what binding a unix socket leaves behind
            path = f"/proc/self/fd/{dfd}/{name}"
            if len(os.fsencode(path)) > 107:
                raise
            import socket
            with socket.socket(socket.AF_UNIX) as s:
                try:
                    s.bind(path)
                except OSError:
                    raise e from None
            os.chmod(path, 0o600)
    elif t.kind == "device":
        os.mknod(name, (stat.S_IFBLK if t.block else stat.S_IFCHR) | 0o600, t.rdev, dir_fd=dfd)
    else:
        raise ValueError(f"not a node kind: {t.kind}")


def set_meta(dfd: int, name: str, t: State, mode: int | None = None,
             carried: list[str] | None = None) -> str | None:
    """Give ``name`` (never followed) the owner the record knows (where it differs from what
    it has) and then its mode (``mode`` or ``t.mode``; not for a symlink): chown first, since
    it clears set-id bits.  Returns what could not be done (an owner the caller may not give,
    and ``carried``: the attributes ``_carry_xattrs`` could not keep), or None."""
    from ..underlay import chmod_fd, chown_fd
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        problems = list(carried or ())
        uid = -1 if t.uid is None or t.uid == st.st_uid else t.uid
        gid = -1 if t.gid is None or t.gid == st.st_gid else t.gid
        if uid != -1 or gid != -1:
            try:
                chown_fd(fd, uid, gid)
            except PermissionError as e:
                problems.insert(0, f"owner {t.uid}:{t.gid} not set ({os.strerror(e.errno)})")
        if not stat.S_ISLNK(st.st_mode):
            want = stat.S_IMODE(t.mode if mode is None else mode)
            if stat.S_IMODE(os.fstat(fd).st_mode) != want:  # another's: only its owner may
                chmod_fd(fd, want)
            # the kernel drops a set-group-ID bit its caller's groups do not allow (a directory
            # of another group, chmod by its owner): a revert that said it put 2775 back left
            # 0775, and new files there took the reverter's group
            lost = want & (stat.S_ISUID | stat.S_ISGID) & ~stat.S_IMODE(os.fstat(fd).st_mode)
            if lost:
                problems.append(f"mode {want:04o} not set: the system dropped its set-"
                                f"{'group' if lost & stat.S_ISGID else 'user'}-ID bit (this "
                                "user is not of its group)")
        return "; ".join(problems) or None
    finally:
        os.close(fd)


def _carry_xattrs(dfd: int, name: str, tmp: str, t: State) -> list[str]:
    """The extended attributes of the live file ``name`` (an access ACL, a file capability,
    ``user.*``) put on ``tmp``, the file about to replace it.  Attributes are no part of a
    recorded state (docs/design.md), so a file put back keeps those its name holds: without
    this, reverting a call that only chmodded a file would strip what the user had set on it.
    Set before the mode (``set_meta`` after it), as ``cp -a`` does: an ACL's bits then follow
    the mode the record knows.  Returns what could not be kept, in words."""
    from ..underlay import list_xattrs, proc_path
    if t.kind != "file":
        return []
    try:
        src = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return []
    try:
        if not stat.S_ISREG(os.fstat(src).st_mode):
            return []
        attrs = list_xattrs(src, False)
    finally:
        os.close(src)
    if not attrs:
        return []
    lost = []
    dst = os.open(tmp, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        for key, value in sorted(attrs.items()):
            try:
                os.setxattr(proc_path(dst), key, value)
            except OSError as e:
                lost.append(f"attribute {key} not kept ({os.strerror(e.errno)})")
    finally:
        os.close(dst)
    return lost


def _blocks(mode: int) -> bool:
    """Would a directory of this mode stop its owner from filling it?"""
    return stat.S_IMODE(mode) & 0o700 != 0o700


def link_key(s: State) -> int:
    """The inode that may join ``s`` to a hard-link group (0: none known)."""
    return s.ino if s.present and s.kind != "dir" else 0


def linked(a: State, b: State) -> bool:
    """Were ``a`` and ``b`` (each at its own point) one hard-link group?  The same inode, and
    one of them saw it linked: a group's paths are each taken at their own point (in a plan,
    just before the first change to each), and a path taken after another of its group was
    unlinked counts one link less.  And they hold one state (content, mode, owner): one inode
    taken at two moments between which it was written or chmodded is two things to put back,
    which one inode cannot hold."""
    return link_key(a) != 0 and link_key(a) == link_key(b) and max(a.nlink, b.nlink) > 1 and \
        a.same(b)


FAILED = "failed: "
# put back, but not all of it (an owner the reverting user may not give): still a failure
PARTLY = FAILED + "restored, but "
# a directory the revert would remove that holds what it does not remove (docs/revert.md)
KEPT = "kept (not empty)"
LINKED = "restored (hard link to "  # ... the group's first name, and ")"


def failed(result: str) -> bool:
    """Did apply_step fail to make its path hold its target (in whole or in part)?"""
    return result.startswith(FAILED)


@dataclass
class DirMode(Step):
    """A late step: a directory's own mode and owner, set after its contents were written
    (a 0555 directory cannot be filled once it has its mode)."""


@dataclass
class Opening(Step):
    """An early step: a directory the revert empties whose mode closes it to its owner (a
    call's `chmod 500` on a directory it made): opened to its owner first (u+rwx), or the
    revert stopped half way on what it was itself removing, asking the user to open it."""


def apply_step(root_fd: int, step: Step, made: dict | None = None,
               seen: os.stat_result | None | bool = False) -> str:
    """Make ``step.path`` hold ``step.target``; returns what was done (``failed(...)`` tells
    a path it could not make whole).  ``made``, shared by the steps of one plan, maps the
    inode of a target to the paths made for it, one (path, inode made, target) for each group
    of that inode (see ``linked``): the other paths of a group are linked to its path, not
    copied.  ``seen``: the lstat the caller found the path with (None: nothing there; False:
    not looked at); a path that no longer matches it when the new content is ready to go in
    (saved by another writer while a large file was written beside it) is kept
    (``KEPT_CHANGED``).  Raises ``Escape`` (naming ``step.path``) when the path cannot be
    reached without following a symlink."""
    t = step.target
    try:
        dfd, name = _parent(root_fd, step.path, create=t.present)
    except FileNotFoundError:
        return "nothing (parent gone)"
    except Escape as e:
        # a symlink (or a file) put on the way since the plan was made (`--continue` carries
        # out a saved plan): never followed; the revert stops there and stays pending
        raise Escape(e.errno, f"escape: {e.strerror}", step.path) from None
    try:
        return _apply_in(root_fd, dfd, name, step, made, seen)
    except PermissionError as e:
        # the revert writes as its user, through the mount: a directory left read-only (a
        # call's chmod 555 the selection does not undo) stops it; it stays pending
        mode = stat.S_IMODE(os.fstat(dfd).st_mode)
        why = f"its directory has mode {mode:04o}; make it writable" if _blocks(mode) else \
            "make it writable"
        raise PermissionError(e.errno, f"cannot be written ({os.strerror(e.errno)}): {why}, "
                              "then `overlayrec revert --continue`, or `overlayrec unrevert`",
                              step.path) from None
    except OSError as e:
        if e.errno == errno.EFBIG:
            limit = file_size_limit() or "the largest file its filesystem holds"
            raise OSError(e.errno, f"cannot be written ({os.strerror(e.errno)}, past {limit}): "
                          "the revert is pending: raise the limit, then `overlayrec revert "
                          "--continue`, or `overlayrec unrevert`", step.path) from None
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise OSError(e.errno, f"cannot be written ({os.strerror(e.errno)}): free room on the "
                      "workspace's filesystem, then `overlayrec revert --continue`, or "
                      "`overlayrec unrevert`", step.path) from None
    finally:
        os.close(dfd)


def ways(steps: list[Step], results: list[str]) -> set[str]:
    """The directories on the way of the paths a carried-out plan put something in: each is
    a directory after the revert, whatever its own step said (``_parent`` makes it)."""
    out: set[str] = set()
    for s, r in zip(steps, results):
        if s.target.present and not failed(r):
            parts = s.path.split("/")
            out.update("/".join(parts[:k]) for k in range(1, len(parts)))
    return out


def unmet(live: Tree, step: Step, result: str, around: set[str] = frozenset()) -> str | None:
    """After a plan was carried out: why ``step.path`` does not hold ``step.target`` although
    its step did not fail (a process wrote it while the revert ran, or a defect of the plan's
    rules), read afresh from ``live``; None when it does, or when the target is not known
    exactly enough to compare (a guess, a secret's placeholder) or the path cannot be read
    here (a mode that denies its reader: set by the revert itself, as recorded), or a
    directory the revert kept, or made again ``around`` (``ways``) a path it put back.  The owner
    is not compared: a revert made by its user may not give a file away.  A name the step
    linked to its group's first name must still be one file with it."""
    t = step.target
    if failed(result) or not t.exact or t.withheld or isinstance(step, (DirMode, Opening)):
        return None
    now, st = live.state_stat(step.path)
    if step.path in live.unreadable:
        return None
    if t.same(now, owner=False) and result.startswith(LINKED) and st is not None:
        # one file with the group's first name, as put back: a copy in its place since would
        # not take the next write through either name
        first = result[len(LINKED):-1]
        other = live.state_stat(first)[1]
        if other is not None and (other.st_dev, other.st_ino) != (st.st_dev, st.st_ino):
            return f"is not one file with {shown(first)} (a hard link) as the revert put back"
        return None
    if t.same(now, owner=False) or t.kind == now.kind == "dir" or \
            (now.kind == "dir" and (result == KEPT or step.path in around)):
        return None  # a directory's mode is its DirMode step's
    if _refreshed(step.path, t, now, live):
        return None  # git refreshed the index it put back (an editor's git panel polling)
    if now.kind != t.kind:
        return f"holds {_a(now.kind)} where the revert put back {_a(t.kind)}"
    if t.kind != "symlink" and now.mode != t.mode:
        return f"has mode {now.mode:04o} where the revert put back {t.mode:04o}"
    return "holds other content than the revert put back"


def _a(kind: str) -> str:
    return "nothing" if kind == "absent" else f"a {kind}"


def _apply_in(root_fd: int, dfd: int, name: str, step: Step, made: dict | None,
              seen: os.stat_result | None | bool = False) -> str:
    """apply_step in ``step.path``'s directory ``dfd``, where it is ``name``."""
    t = step.target
    if isinstance(step, Opening):
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            return "nothing to open"
        problem = set_meta(dfd, name, State("dir", stat.S_IMODE(st.st_mode) | 0o700))
        return FAILED + problem if problem else "opened"
    if isinstance(step, DirMode):
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            return FAILED + "not a directory any more: mode not set"
        problem = set_meta(dfd, name, t)
        return FAILED + problem if problem else "dir mode"
    if step.moved_from is not None:
        done = _move_back(root_fd, dfd, name, step)
        if done is not None:
            return done
        # the object is back; what the selection changed in it after the rename goes next
        seen = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        step = Step(step.path, t, step.expected, in_place=step.in_place)
    if not t.present:
        try:
            _remove(dfd, name)
        except OSError as e:
            if e.errno == errno.ENOTEMPTY:  # unrecorded files live in it; keep it
                return KEPT
            raise
        return "removed"
    if t.kind == "dir":
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                _remove(dfd, name)
                raise FileNotFoundError
        except FileNotFoundError:
            os.mkdir(name, 0o700, dir_fd=dfd)
        # a mode that would stop the directory being filled comes last (a DirMode step)
        problem = set_meta(dfd, name, t, t.mode | 0o700 if _blocks(t.mode) else t.mode)
        return FAILED + problem if problem else "dir"
    first = _holder(made, t)
    if t.kind == "file" and link_key(t) and t.nlink > 1 and step.in_place:
        if first is not None and first[1] == t.ino and _as_written(made, dfd, name, t):
            # the group's inode, written in place by an earlier step and unchanged since:
            # each of a 1,000-name file's steps wrote it again (1,000 alias events a write)
            return f"restored in place with {first[0]} (hard-link group)"
        # only a target that was itself linked then shares its inode: writing into an
        # inode linked since would change names the revert does not own
        done = _write_in_place(dfd, name, t)
        if done is not None:
            if first is None and made is not None:
                made.setdefault(link_key(t), []).append((step.path, t.ino, t))
                if not done.startswith(FAILED):
                    made[("written", t.ino)] = _written_mark(dfd, name)
            return done
    if first is None and t.kind == "file" and step.expected.kind == "file" and \
            step.expected.data == t.data:
        done = _meta_in_place(dfd, name, t)
        if done is not None:
            if made is not None and link_key(t):
                made.setdefault(link_key(t), []).append(
                    (step.path, os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ino, t))
            return done
    if first is None and t.kind == "file":
        done = _into_theirs(dfd, name, t, seen)
        if done is not None:
            return done
    tmp = temp_name(name, f"overlayrec-revert-{os.getpid()}")
    _remove(dfd, tmp)
    if first is not None and _link_to(root_fd, first, dfd, tmp):
        if not _as_seen(dfd, name, seen):
            _remove(dfd, tmp)
            return KEPT_CHANGED
        _replace(dfd, tmp, name)
        return f"{LINKED}{first[0]})"
    problem = None
    if t.kind == "symlink":
        os.symlink(os.fsdecode(t.data), tmp, dir_fd=dfd)
    elif t.kind == "file":
        # Ctrl-C held while the temp file is made: a signal that came as its create went
        # through the mount was raised once the open returned, before its descriptor was
        # held, which stayed open (the revert's own mount then waited 10 s on it at its
        # end) and left the temp file behind (found by a bug hunt).  Raised below instead.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                         os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except PermissionError:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            done = _overwrite(dfd, name, t)
            if done is None:
                raise
            return done
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            raise
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal held is raised here
            write_to(fd, t.data)
        except BaseException:
            os.close(fd)
            _remove(dfd, tmp)  # a full filesystem leaves no half-written temp file behind
            raise
        os.close(fd)
    elif t.kind in ("fifo", "socket", "device"):
        try:
            make_node(dfd, tmp, t)
        except OSError as e:
            return FAILED + f"cannot make a {t.kind} here ({os.strerror(e.errno)})"
    else:
        return FAILED + f"cannot make a {t.kind}"
    try:
        problem = set_meta(dfd, tmp, t, carried=_carry_xattrs(dfd, name, tmp, t))
    except BaseException:
        _remove(dfd, tmp)
        raise
    if not _as_seen(dfd, name, seen):
        _remove(dfd, tmp)
        return KEPT_CHANGED
    try:
        _replace(dfd, tmp, name)
    except PermissionError:
        try:
            done = _into_kept(dfd, name, t)
        finally:
            _remove(dfd, tmp)
        if done is None:
            raise
        return done
    if made is not None and link_key(t) and first is None:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        made.setdefault(link_key(t), []).append((step.path, st.st_ino, t))
    return PARTLY + problem if problem else "restored"


MOVED_BACK = "renamed back from "  # ... the name it was at


def moved_in(made: dict, step: Step) -> None:
    """Once ``step``'s rename back is made: the paths of ``made`` (hard-link groups' names
    and partners, apply_step's) beneath the name it came from are called by the name it came
    back to (a name linked to one the rename back brought is linked to it there: a copy
    otherwise, its group cut)."""
    src = step.moved_from
    for key, held in made.items():
        if isinstance(held, list):
            made[key] = [(step.path + h[0][len(src):], *h[1:]) if _at_or_under(h[0], src)
                         else h for h in held]


def _move_back(root_fd: int, dfd: int, name: str, step: Step) -> str | None:
    """Rename ``step.moved_from`` back to ``step.path`` (in ``dfd``, where it is ``name``),
    never over anything: the object the plan moves (``step.expected.ino``) is renamed back
    whole.  Returns what was done when that is all; None when the target is still to be
    written into what came back; KEPT_CHANGED when neither name holds that object (moved or
    replaced by another writer since).  Idempotent: an object already back is not moved."""
    ino = step.expected.ino
    try:
        here = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        here = None
    if here is None or here.st_ino != ino:
        if here is not None:
            return KEPT_CHANGED
        try:
            sfd, sname = _parent(root_fd, step.moved_from, create=False)
        except FileNotFoundError:
            return KEPT_CHANGED
        except Escape as e:
            raise Escape(e.errno, f"escape: {e.strerror}", step.moved_from) from None
        try:
            if os.stat(sname, dir_fd=sfd, follow_symlinks=False).st_ino != ino:
                return KEPT_CHANGED
            renameat2(sfd, sname, dfd, name, RENAME_NOREPLACE)
        except (FileNotFoundError, FileExistsError):
            return KEPT_CHANGED
        finally:
            os.close(sfd)
    if step.target.same(step.expected):
        return f"{MOVED_BACK}{step.moved_from}"
    return None


def _as_seen(dfd: int, name: str, seen: os.stat_result | None | bool) -> bool:
    """Does ``name`` still hold what the step's caller looked at (``seen``: its lstat, None
    for nothing there; False: not looked at, so nothing to compare)?  Its inode, size, mtime
    and ctime: a save (in place or by a rename over it) moves one of them."""
    if seen is False:
        return True
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return seen is None
    return seen is not None and (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) == \
        (seen.st_ino, seen.st_size, seen.st_mtime_ns, seen.st_ctime_ns)


def _written_mark(dfd: int, name: str) -> tuple | None:
    """What a file written in place looks like just after (its ctime moves with any later
    change of content, mode, owner or links)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid, \
        st.st_gid


def _as_written(made: dict | None, dfd: int, name: str, t: State) -> bool:
    """Does ``name`` hold the inode an earlier step of its group wrote in place, as that
    step left it?"""
    mark = made.get(("written", t.ino)) if made is not None else None
    return mark is not None and _written_mark(dfd, name) == mark


def _holder(made: dict | None, t: State) -> tuple | None:
    """The path already made (or a partner) holding ``t``'s group: one inode of the record may
    stand for several groups, one for each state it was taken in (see ``linked``)."""
    if made is None or not link_key(t):
        return None
    return next((h for h in made.get(link_key(t), ()) if linked(t, h[2])), None)


def _holds_group_inode(root_fd: int, step: Step) -> bool:
    """Does the live path of ``step`` hold its target's inode, linked (a step apply_step may
    write in place)?"""
    t = step.target
    if not (t.kind == "file" and link_key(t) and t.nlink > 1 and step.in_place):
        return False
    try:
        dfd, name = _parent(root_fd, step.path, create=False)
    except OSError:
        return False
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return False
    finally:
        os.close(dfd)
    return _in_live_group(st, t)


def _in_live_group(st: os.stat_result, t: State) -> bool:
    """Does the live file ``st`` hold the target's own inode, linked still?"""
    return stat.S_ISREG(st.st_mode) and st.st_ino == t.ino and st.st_nlink > 1


def _write_in_place(dfd: int, name: str, t: State) -> str | None:
    """When the path still holds the target's own inode and that inode has other links (a
    hard-link group whose content was changed through one of its names), the content goes
    back into that inode, so every name of the group gets it back (a rename would leave the
    others behind).  Not atomic, unlike the rename.  None: not this case."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not _in_live_group(st, t):
        return None
    if _holds_content(dfd, name, t, lambda now: now.st_ino == st.st_ino):
        # its content as the target's (a chmod, a chown of the group): only its mode and
        # owner are set, its content and times kept (it was written again: a truncate and
        # a write, its mtime the revert's; found by a bug hunt)
        problem = set_meta(dfd, name, t)
        return FAILED + "restored in place, but " + problem if problem else \
            "restored in place (mode and owner, hard-link group)"
    # swapped meanwhile: written the usual way; a read-only file: replaced whole (the group
    # is not kept)
    return _write_into(dfd, name, t, lambda now: now.st_ino == t.ino, "hard-link group")


def _holds_content(dfd: int, name: str, t: State, fits) -> bool:
    """Does the live regular file ``name``, where ``fits(its fstat)``, hold the target's
    content?"""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dfd)
    except OSError:
        return False
    try:
        now = os.fstat(fd)
        return stat.S_ISREG(now.st_mode) and fits(now) and same_as_fd(fd, t.data, now.st_size)
    finally:
        os.close(fd)


def _overwrite(dfd: int, name: str, t: State) -> str | None:
    """A directory the revert may not write in (a call left it read-only, and the selection
    does not undo that): no temporary file can be made there, so the content goes into the
    live file, unlinked, as ``cat > file`` would put it (not atomic).  None: not this case
    (no such file, or one the revert may not write either)."""
    return _write_into(dfd, name, t, lambda now: now.st_nlink == 1,
                       "its directory is read-only")


def _into_kept(dfd: int, name: str, t: State) -> str | None:
    """A file the revert may write but not replace: another user's in a sticky directory
    (``/tmp``'s mode) refuses the rename over it (EPERM), as natively.  The content goes into
    the live file, unlinked, as the call's own write did (not atomic).  None: not this case
    (not a file to put back: a symlink's target text went into the file that replaced it)."""
    if t.kind != "file":
        return None
    return _write_into(dfd, name, t, lambda now: now.st_nlink == 1,
                       "another user's file in a sticky directory")


def _into_theirs(dfd: int, name: str, t: State,
                 seen: os.stat_result | None | bool) -> str | None:
    """A file of another owner that the reverting user (not root) may write: its content
    goes into the live file, as `cat old > f` would put it (not atomic), since a file replacing
    it would be the reverting user's, who may not give it away (it became theirs, a new inode,
    "restored but not whole: owner not set": found by a bug hunt in a shared setgid
    directory).  Only where the live file is of the owner and mode the target has (only its
    owner may set a mode), has no other name, and is as the caller ``seen`` it; None: not
    this case (written the usual way)."""
    me = os.geteuid()
    if me == 0:  # root gives the owner back to the file that replaces it
        return None
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid == me or st.st_nlink != 1 or \
            (t.uid is not None and t.uid != st.st_uid) or stat.S_IMODE(st.st_mode) != t.mode:
        return None
    if seen is not False and not _as_seen(dfd, name, seen):
        return None  # the caller's own checks say what happened to it
    return _write_into(dfd, name, t, lambda now: now.st_ino == st.st_ino and
                       now.st_nlink == 1, "another owner's file")


def _write_into(dfd: int, name: str, t: State, fits, why: str) -> str | None:
    """The target's content written into the live regular file ``name`` where ``fits(its
    fstat)``, then its mode and owner; None when it cannot be opened for writing or does not
    fit."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dfd)
    except OSError:
        return None
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or not fits(now):
            return None
        os.ftruncate(fd, 0)
        write_to(fd, t.data)
    finally:
        os.close(fd)
    problem = set_meta(dfd, name, t)
    return FAILED + "restored in place, but " + problem if problem else \
        f"restored in place ({why})"


def _meta_in_place(dfd: int, name: str, t: State) -> str | None:
    """A file whose content the selection did not change (a chmod, a chown): its mode and
    owner are set on the live file, whose content, inode, links and attributes stay, where it
    holds the target's content, unlinked.  No temporary file: a directory left read-only does
    not stop it.  None: not this case."""
    if not _holds_content(dfd, name, t, lambda now: now.st_nlink == 1):
        return None
    problem = set_meta(dfd, name, t)
    return FAILED + "restored in place, but " + problem if problem else \
        "restored in place (mode and owner)"


def _replace(dfd: int, tmp: str, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(name, dir_fd=dfd)
    except FileNotFoundError:
        pass
    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # atomic in its directory


def _link_to(root_fd: int, first: tuple, dfd: int, tmp: str) -> bool:
    """Hard-link the path ``first`` names (if it still holds the inode this plan made there)
    as ``tmp``; False when it cannot (then the path is written on its own)."""
    path, ino = first[0], first[1]
    try:
        sfd, sname = _parent(root_fd, path, create=False)
    except OSError:
        return False
    try:
        if os.stat(sname, dir_fd=sfd, follow_symlinks=False).st_ino != ino:
            return False
        os.link(sname, tmp, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
        return True
    except OSError:
        return False
    finally:
        os.close(sfd)


def order(steps: list[Step], root_fd: int | None = None) -> list[Step]:
    """The renames back (``moved_from``) come after the steps that touch neither of their
    names (_plain_order: what makes the directories they go into) and before those that do
    (what they free or bring is then planned: a file of a directory renamed back written, a
    directory they empty removed), and, among them, in the order they may be made; the modes
    of directories last, as ever."""
    moves = [s for s in steps if s.moved_from is not None]
    if not moves:
        return _plain_order(steps, root_fd)
    ends = {x for m in moves for x in (m.path, m.moved_from)}
    above = {u for m in moves for u in _up(m.moved_from)}

    def after(s: Step) -> bool:  # (a path above a name a rename back empties: it may be
        # removed or turned into a file once that name has gone)
        return _beneath_any(s.path, ends) or s.path in above
    rest = [s for s in steps if s.moved_from is None]
    first = _plain_order([s for s in rest if not after(s)], root_fd)
    then = _plain_order([s for s in rest if after(s)], root_fd)
    late = [s for s in first + then if isinstance(s, DirMode)]
    return [s for s in first if not isinstance(s, DirMode)] + _moves_in_order(moves) + \
        [s for s in then if not isinstance(s, DirMode)] + late


def _moves_in_order(moves: list[Step]) -> list[Step]:
    """Each rename back after those it waits on: the one that frees its name (a chain,
    `mv a b; mv c a`), the one that brings back the directory it is in or comes from."""
    by_from, by_path = {}, {}
    for o in moves:
        by_from.setdefault(o.moved_from, []).append(o)
        by_path.setdefault(o.path, []).append(o)

    def waits_on(m: Step) -> set[int]:  # those whose name was m's, or a directory above
        # m's names that one of them brings back
        os_ = [o for u in _up(m.path) for o in by_from.get(u, ())]
        os_ += [o for x in (m.path, m.moved_from) for u in _up(x) if u != x
                for o in by_path.get(u, ())]
        return {id(o) for o in os_ if o is not m}
    waiting = {id(m): waits_on(m) for m in moves}
    index = {id(m): i for i, m in enumerate(moves)}
    waited_by: dict[int, list[int]] = {}
    for m in moves:
        for o in waiting[id(m)]:
            waited_by.setdefault(o, []).append(index[id(m)])
    ready = [i for i, m in enumerate(moves) if not waiting[id(m)]]
    heapq.heapify(ready)
    out, done, first = [], set(), 0
    while len(out) < len(moves):
        # the first in the plan's order that waits on nothing left; in a cycle (a chain
        # with no free name) the first left
        i = heapq.heappop(ready) if ready else None
        if i is None:
            while first in done:
                first += 1
            i = first
        if i in done:
            continue
        done.add(i)
        out.append(moves[i])
        for w in waited_by.get(id(moves[i]), ()):
            waiting[id(moves[w])].discard(id(moves[i]))
            if not waiting[id(moves[w])] and w not in done:
                heapq.heappush(ready, w)
    return out


def _plain_order(steps: list[Step], root_fd: int | None = None) -> list[Step]:
    """Removals first (deepest first: a directory the revert turns back into a file must be
    emptied before), then directories to create (shallow first), then files, then the modes
    of directories that would not let their owner fill them (deepest first).  With
    ``root_fd``, the files whose live path still holds their hard-link group's inode come
    first: written in place, that inode is what the group's other names are linked to (one
    made before would hold an inode of its own, and stay apart from the group)."""
    mk = sorted([s for s in steps if s.target.kind == "dir"], key=lambda s: s.path.count("/"))
    files = [s for s in steps if s.target.present and s.target.kind != "dir"]
    opening = []
    if root_fd is not None:
        files.sort(key=lambda s: not _holds_group_inode(root_fd, s))
        # before all: a directory that stays one and gets back a mode its owner may fill (a
        # call left it 0555), or nothing could be removed from it or written into it
        opening = [s for s in mk if not _blocks(s.target.mode) and _blocks_now(root_fd, s.path)]
        mk = [s for s in mk if s not in opening]
    rm = sorted([s for s in steps if not s.target.present], key=lambda s: -s.path.count("/"))
    if root_fd is not None:
        # a directory the revert removes, closed to its owner now: opened before it is emptied
        opening += [Opening(s.path, s.target, s.expected) for s in
                    sorted(rm, key=lambda s: s.path.count("/"))
                    if s.expected.kind == "dir" and _blocks_now(root_fd, s.path)]
    late = [DirMode(s.path, s.target, s.expected) for s in reversed(mk) if _blocks(s.target.mode)]
    return opening + rm + mk + files + late


def _blocks_now(root_fd: int, rel: str) -> bool:
    """Is ``rel`` a directory now, of a mode that would not let its owner fill it?"""
    try:
        dfd, name = _parent(root_fd, rel, create=False)
    except OSError:
        return False
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return False
    finally:
        os.close(dfd)
    return stat.S_ISDIR(st.st_mode) and _blocks(st.st_mode)


_FIELDS = ("uid", "gid", "rdev", "block", "ino", "nlink", "drifted", "withheld")


def plan_to_json(plan: Plan, content_put) -> dict:
    def st(s: State) -> dict:
        d = {"kind": s.kind, "mode": s.mode, "exact": s.exact}
        if s.kind in ("file", "symlink"):
            d["blob"] = content_put(s.data)
        for f in _FIELDS:
            d[f] = getattr(s, f)
        return d
    return {"id": plan.id, "selection": plan.selection,
            "steps": [{"path": s.path, "target": st(s.target), "expected": st(s.expected),
                       "conflict": s.conflict, "note": s.note, "in_place": s.in_place,
                       **({"moved_from": s.moved_from} if s.moved_from is not None else {})}
                      for s in plan.steps]}


CHANGED_SINCE = "changed since the interrupted revert began"


def recheck(plan: Plan, live) -> None:
    """A saved plan carried on (`revert --continue`): each path that holds something must hold
    what the plan found (not reached yet) or what it puts there (reached): else someone put
    it there since the revert began, and it is a conflict (``changed``), which --continue
    overwrote.  A path that holds nothing (removed since, or beyond a directory made a
    symlink, which the step itself refuses) loses nothing to the step.  ``live``: the live
    tree (states.Tree)."""
    for s in plan.steps:
        if not s.conflict and changed_since(live, s):
            s.conflict, s.note = "changed", CHANGED_SINCE
            plan.changed_since.append(s.path)


# a step's result when its path was changed by another writer after the plan was made
KEPT_CHANGED = FAILED + "kept: another writer changed it after the revert was planned"


def changed_since(live, step: Step, ours: set | None = None, *, removed: bool = False,
                  seen: list | None = None) -> bool:
    """Does ``step.path`` hold something the plan neither found there (``expected``) nor puts
    there (``target``)?  Someone put it there after the plan was made, and the step would
    write over it.  Nothing there loses nothing to the step, unless ``removed`` asks for a
    removal since as well (the plan found a file there and puts one back: the step would undo
    another writer's `rm`, as a plan made after it refuses to); a path that cannot be read is
    read again by the step itself, which says what stops it.  ``ours``: the inodes the plan's
    steps wrote so far (a hard-link group's other names hold what one step wrote in place).
    ``seen`` gets the lstat the path was looked at with (None: nothing there)."""
    if step.moved_from is not None:
        # a rename back: its object at either name (not moved yet, or moved already)
        if seen is not None:
            seen.append(None)
        return not any((st := live.lstat(p)) is not None and st.st_ino == step.expected.ino
                       for p in (step.path, step.moved_from))
    try:
        now, st = live.state_stat(step.path)
    except OSError:
        return False
    if seen is not None:
        seen.append(st)
    if ours and st is not None and (st.st_dev, st.st_ino) in ours:
        return False
    if removed and not now.present and step.expected.present and step.target.present:
        # not a path out of reach (a symlink put on its way): its step refuses that itself
        return not live.symlink_on_the_way(step.path)
    if not now.exact:  # its content may not be read here (a mode that denies its owner)
        return now.kind not in (step.expected.kind, step.target.kind)
    # a directory loses nothing to a step but by its removal, which keeps one not empty
    # (KEPT); one on the way of the plan's paths is made by their steps (``ways``)
    return now.present and now.kind != "dir" and \
        not (now.same(step.expected) or now.same(step.target)) and \
        not _refreshed(step.path, step.expected, now, live)  # git's index refreshed, as the plan


def plan_from_json(d: dict, content_get) -> Plan:
    def st(x: dict) -> State:
        return State(x["kind"], x["mode"], content_get(x["blob"]) if "blob" in x else b"",
                     x.get("exact", True), **{f: x[f] for f in _FIELDS if f in x})
    return Plan(d["id"], d["selection"], [Step(s["path"], st(s["target"]), st(s["expected"]),
                                                s["conflict"], s.get("note"),
                                                s.get("in_place", True), s.get("moved_from"))
                                           for s in d["steps"]])
