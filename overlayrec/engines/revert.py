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
contents with it) where what it moved is still whole at its new name (engines.revert_moves); the
other paths are put back one by one.

The plan is written to the state dir before the first change, so an interrupted revert can be
finished (``--continue``) or rolled back (``unrevert``).  Every step is idempotent: it makes a
path hold its target, whatever it holds now.  Paths are reached from the workspace root one
component at a time without following a symlink, and a path that would leave the workspace is
refused.  The changes go through the mount, so the daemon journals them as the revert's own
unit (``revert:<id>``): an unrevert is a revert of that unit.
"""
from __future__ import annotations
import os
import re
import stat
import time
import uuid

from ..journal import Journal
from ..journal.schema import (UNMOUNTED, call_unit, outside_unit, revert_unit, session_unit,
                              turn_unit, unit_kind)
from ..secrets import PLACEHOLDER
from ..views import guessed, path_matcher, shown
from . import gitindex
from .diff import (SelectionError, changed_around, file_events, find_call, moved_on,
                   placed_elsewhere, touched, find_turn, _visible)
from .states import ATTIC, INF, States, State, Tree, _fwd, is_unlisted
from .large import over_limit, whole
from .revert_moves import moves_back
from .revert_steps import (STILL_WRITING, Plan, Step, beneath_any, link_key, linked, refreshed,
                           up)


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
            elif not expected.same(now) and not refreshed(p, expected, now, live):
                if now.exact and target.exact and target.same(now) and reverted:
                    # an earlier revert put back since what the selection changed (one of
                    # the turn's calls reverted by the agent inside the turn): nothing to
                    # write, so nothing to refuse; said, not a step.  Put back by another
                    # unit (the user by hand, a change around the mount) it stays a conflict
                    plan.already.append(p)
                    continue
                if reverted and now.exact and \
                        _put_back_within(states, p, first, last, since[-1], now):
                    # reverts stack: an earlier revert of a later part of the selection put
                    # back what the path held inside it (the session's second turn reverted,
                    # then the session): it goes on back from there.  It was refused as
                    # changed (found by a hunt: `git checkout` there and back in two turns)
                    step.expected = now
                else:
                    step.conflict = "changed"
                    if not now.present and target.present and \
                            (gone := _way_gone(p, last, states, live, others, gone_ways)):
                        # the file moved on with its directory (`mv a b` by a later call):
                        # said, where "changed: a/f" named a path no longer there (a hunt)
                        step.note = (f"{shown(gone)} was moved or removed by another writer "
                                     "since; the file is not where the selection left it")
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
    moves_back(plan, states, live, evs, selected, spans, unrecorded)
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
    if keep:
        _links_left_out(plan, live, by_ino)
    return plan


def _links_left_out(plan: Plan, live: Tree, by_ino) -> None:
    """--path: a file the plan puts back into its live inode (``in_place``) whose inode has
    names the pattern leaves out changes under them too (its hard links): said on the step.
    `revert --path f` of a write through f changed f's link h, and neither the preview nor
    the summary named h (found by a bug hunt)."""
    paths = {s.path for s in plan.steps}
    for step in plan.steps:
        t = step.target
        if step.conflict or step.note or not step.in_place or t.kind != "file" or \
                t.nlink <= 1:
            continue
        st = live.lstat(step.path)
        if st is None or st.st_nlink <= 1 or not stat.S_ISREG(st.st_mode):
            continue
        out = sorted(n for n in by_ino().get(st.st_ino, ()) if n not in paths)
        if out:
            many = len(out) > 1
            step.note = (f"written into its inode: its hard link{'s' if many else ''} "
                         f"{', '.join(shown(n) for n in out[:3])}{' ...' if len(out) > 3 else ''}"
                         f", which --path leaves out, change{'' if many else 's'} with it")


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
        if any(p not in removed and not beneath_any(p, away) for p in live.walk(s.path)):
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
        if not s.conflict and any(u in blocked for u in up(s.path.rpartition("/")[0])) and \
                live.symlink_on_the_way(s.path) and live.blocker(s.path) in blocked:
            s.conflict = "escape"


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
    # and the other side (`--path proj`): what the plan makes again at the old name comes
    # back a copy, the rename's new name left as it is (said by nothing: a bug hunt)
    for s in plan.steps:
        if not s.target.present or s.expected.present or s.moved_from is not None:
            continue
        new, moved = s.path, False
        for r in renames:
            src, dst = r["path"], r["path2"]
            if new == src or new.startswith(src + "/"):
                new, moved = dst + new[len(src):], True
        if moved and not keep(new):
            plan.moved_to_outside.append((s.path, new))


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
    naming: dict[tuple[str, str], bool] = {}
    for p, seqs in others.items():
        g2 = _git_dir(p)
        if g2 is None:
            continue
        for g, since in first.items():
            later = [q for q in seqs if q > since]
            if not later:
                continue
            if g2[0] != g:
                # another repository that may name this one's objects: a superproject's
                # gitlink, a `clone --shared` (alternates); their removal left it corrupt
                # with nothing said (found by a bug hunt)
                key = (g2[0], g)
                if key not in naming:
                    naming[key] = _may_name_objects_of(states, g2[0], g)
                if not naming[key]:
                    continue
            before, now = states.state(p, min(later) - 1), states.state(p, INF)
            # (git refreshing its index, a `git status`, names no object: counted, it kept
            # the selection's objects, whose directories then stood in the way of the next
            # revert; found by a bug hunt)
            if not now.same(before) and not refreshed(p, before, now, states.tree):
                changed[g] = max(changed.get(g, 0), max(later))
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


def _may_name_objects_of(states: States, g2: str, g: str) -> bool:
    """May the repository of the ``.git`` directory ``g2`` name objects of ``g``'s: ``g``'s
    work tree lies inside ``g2``'s (a superproject's gitlink names a nested repository's
    commits), or ``g2``'s ``objects/info/alternates`` names ``g``'s objects (`git clone
    --shared`, as git writes it: an absolute path, or one relative to ``g2``'s objects)?"""
    wt, wt2 = g.rpartition("/")[0], g2.rpartition("/")[0]  # ("": the workspace's root)
    if wt != wt2 and (wt2 == "" or wt.startswith(wt2 + "/")):
        return True
    st = states.tree.state(g2 + "/objects/info/alternates")
    if st.kind != "file" or over_limit(st.data):
        return False
    try:
        ws = os.readlink(f"/proc/self/fd/{states.tree.root_fd}")
    except OSError:
        return True  # not known: as if named
    target = os.path.normpath(os.path.join(ws, g, "objects"))
    for line in whole(st.data).decode("utf-8", "replace").splitlines():
        line = line.strip()
        if line and not line.startswith("#") and os.path.normpath(
                os.path.join(ws, g2, "objects", line)) == target:
            return True
    return False


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


def _a_refresh(states: States, path: str, seq: int) -> bool:
    """Was another unit's event ``seq`` on ``path`` git refreshing its index (refreshed)?"""
    return gitindex.is_index(path) and refreshed(path, states.state(path, seq - 1),
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
                     (_linked_since(states, name, spans[step.path][0]) or
                      _more_names(plan, live, by_ino, t))):
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


def _put_back_within(states: States, p: str, first: int, last: int, put: int,
                     now: State) -> bool:
    """Does ``p`` hold what the record says event ``put`` (an earlier revert's) left there,
    ``now``, and is that a state the path had within the selection's span (after one of its
    changes from ``first`` to ``last``)?  Only an earlier revert of part of the selection
    puts such a state back; another unit's is a change of its own.  Each state is asked just
    before a change (its pre-image) as well as after one: after a write, inside a run of
    writes, the record does not know the content, which the next change's pre-image holds.
    Not a state the path also had before the selection: that one an earlier revert of more
    than the selection may have put back."""
    back = states.state(p, put)
    if not (back.exact and back.same(now)):
        return False
    within = False
    for e in states.events_on(p):
        if e["seq"] < first:
            # a state it had before the selection too (`git checkout` there and back): an
            # earlier revert reaching further back may have put it there, and going on from
            # it would write back what that revert undid; a conflict, as before
            if any(states.state(p, at).same(now) for at in (e["seq"] - 1, e["seq"])):
                return False
        elif e["seq"] <= last and not within:
            for at in (e["seq"] - 1, e["seq"]) if e["seq"] > first else (e["seq"],):
                if at < last and (held := states.state(p, at)).exact and held.same(now):
                    within = True
    return within


def _linked_since(states: States, name: str, first: int) -> bool:
    """Was ``name`` made a name of its inode by a link (``ln``) from event ``first`` on, not
    only reached by renames?  A file of one name renamed away (`mv a b`, reverted with `--path
    a`) came back linked to b, the name the rename took it to: two names of one inode, which
    it never had, and a write to one changed the other (found by a bug hunt)."""
    return any(e["op"] == "link" and e.get("path") == name and e["seq"] >= first
               for e in states.events_on(name))


def _more_names(plan: Plan, live: Tree, by_ino, t: State) -> bool:
    """Do more recorded names hold ``t``'s inode now than it had then (the plan's paths and
    the names outside it, by the record's names: an attic's link is not one)?  A name was
    linked to it since, though not as the partner's name itself: a call moved a file away,
    the next linked it and renamed the link about (`ln a e; mv e b; mv a d/a; mv b a; mv d/a
    b`); reverting the first gave the file back as a copy, cut from the name the link left
    (found by a hunt).  A file only renamed away keeps its count, and is not linked back
    (_linked_since)."""
    inside = sum(1 for o in plan.steps if _inode_at(live, o.path) == t.ino)
    return len(by_ino().get(t.ino, ())) + inside > max(1, t.nlink)


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
    hunt).  Or several such names, linked again by the revert in that new inode, which no
    other name holds (`echo more >> c; ln c y` by one call, `ln c z` by the next, reverted
    newest first and unreverted: c and y came back one inode, z a copy apart from them;
    found by a hunt).  None when there is no such name."""
    for ino, names in inodes.items():
        if ino == t.ino or not all(_visible(n) and states.state(n, first - 1).ino == t.ino
                                   for n in names):
            continue
        st = live.lstat(names[0])
        if st is None or st.st_nlink != len(names) or not live.state(names[0]).same(t):
            continue  # (a name the record does not know holds it too)
        for n in names:
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
