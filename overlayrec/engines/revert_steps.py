"""A revert's plan: its steps (``Step``, ``Plan``), the words a step's result is told in, the
paths' helpers both sides use, and the plan's form in the state dir (``plan_to_json``).

Shared by the planning (engines.revert, engines.revert_moves) and the applying
(engines.revert_apply), which import it and not each other.
"""
from __future__ import annotations
from dataclasses import dataclass, field

from ..journal.schema import JournalError
from . import gitindex
from .large import over_limit, whole
from .states import State, Tree


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
    # ``expected.ino``), renamed back onto the path (moves_back); then written as any step
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
    # --path: paths the plan makes again that a rename in the selection took to a name outside
    # the pattern, which stays: (the path, that name)
    moved_to_outside: list[tuple[str, str]] = field(default_factory=list)

    @property
    def conflicts(self) -> list[Step]:
        return [s for s in self.steps if s.conflict]


def at_or_under(name: str, d: str) -> bool:
    return name == d or name.startswith(d + "/")


def up(name: str):
    """``name`` and each directory above it (a set's lookups per level, where a scan of the
    set per name made a revert of `mv big big2` quadratic: 25 s at 5,000 files)."""
    while name:
        yield name
        name = name.rpartition("/")[0]


def beneath_any(name: str, names: set | dict) -> bool:
    """Is ``name`` at or under one of ``names``?"""
    return any(u in names for u in up(name))


def refreshed(path: str, a: State, b: State, live: Tree) -> bool:
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


# a step's result when its path was changed by another writer after the plan was made
KEPT_CHANGED = FAILED + "kept: another writer changed it after the revert was planned"


def plan_from_json(d: dict, content_get) -> Plan:
    def st(x: dict) -> State:
        return State(x["kind"], x["mode"], content_get(x["blob"]) if "blob" in x else b"",
                     x.get("exact", True), **{f: x[f] for f in _FIELDS if f in x})
    return Plan(d["id"], d["selection"], [Step(s["path"], st(s["target"]), st(s["expected"]),
                                                s["conflict"], s.get("note"),
                                                s.get("in_place", True), s.get("moved_from"))
                                           for s in d["steps"]])
