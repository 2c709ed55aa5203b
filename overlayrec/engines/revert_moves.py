"""Renames renamed back: the part of a revert's plan that undoes the selection's renames.

Where the selection's own renames took an object to its live name and it is still whole there,
its step renames it back (one rename(2): the inode, owner and hard links kept, and a
directory's contents with it); the paths it cannot move are put back one by one by the rest of
the plan (engines.revert).  Every lookup follows a name through the events on it and on the
directories above it only (``_Naming``): a scan of every event per name made a revert of
`mv big big2` over 5,000 files quadratic.
"""
from __future__ import annotations
import bisect
import os
import stat

from ..journal.schema import MARK_OPS
from ..underlay import kind_of
from .states import ABSENT, INF, States, State, Tree
from .revert_steps import Plan, Step, at_or_under, beneath_any, up


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
        for u in up(name):
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
                if at_or_under(name, src) or at_or_under(name, dst):
                    return None
            elif at_or_under(name, src):
                if e["seq"] not in selected:
                    return None
                name = dst + name[len(src):]
            elif at_or_under(name, dst):
                return None
        elif op in ("unlink", "rmdir") and at_or_under(name, src) or \
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


def moves_back(plan: Plan, states: States, live: Tree, evs: list[dict], selected: set[int],
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
            moving = {p: held[p] for p in held if at_or_under(p, here)} \
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
        self.above_paths.update(up(s.path))
        self.above_froms.update(up(here))
        self.all.append((s, here, now))

    def where(self, name: str) -> str:
        """Where ``name``'s object is once the renames back are made in order (those that
        bring a directory above it back)."""
        last = -1
        while True:
            k, u, back = min(((k, u, back) for u in up(name)
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
    # a conflict beneath either name, unless the record vouches that the object there was
    # only moved; beneath the name it comes back to too (another unit's fifo in a directory
    # the selection made and moved on: the rename back settled the path, the step holding the
    # conflict went with it, and the revert stopped half way on "directory not empty"; found
    # by the history model)
    for p, o in conflicted:
        for name in (now, s.path):
            if at_or_under(p, name):
                rel = p[len(name):]
                if not (o.conflict == "unrecorded" and _only_moved(
                        states, [s.path + rel, now + rel], first, unrecorded)):
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
    if any(u in accepted.froms for u in up(s.path) if u != s.path) or \
            s.path in accepted.above_paths or here in accepted.above_paths or \
            here in accepted.above_froms:
        return False  # entangled with another rename back: planned as before
    if at_or_under(s.path, here) or not held.get(here, ABSENT).present:
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
        a = next((u for u in up(p) if u in back_to), None)
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
        elif beneath_any(s.path, ends):
            now = held[s.path]
            first = spans.get(s.path, [1])[0]
            if _settled(s.target, now, lambda: _only_moved(
                    states, [s.path, origin.get(s.path, s.path)], first, unrecorded)):
                continue
            s.expected = now
            if s.conflict == "unrecorded" and beneath_any(s.path, nows):
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
