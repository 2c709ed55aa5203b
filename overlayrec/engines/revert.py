"""Revert: put back what a call, a turn, a session, a range or an earlier revert changed.

The plan is made from the journal alone and checked for every path before anything is
written; one conflict refuses the whole revert (``--force`` reverts the paths without one):

* *changed*: the path no longer holds what the reverted changes left;
* *interleaved*: another unit changed the path between two of the reverted changes;
* *unrecorded*: the journal cannot say exactly what the path held (a change it could not
  record, or a point inside a run of writes it did not see one by one);
* *escape*: a directory on the path's way is now a symlink, which a revert never follows.

The plan is written to the state dir before the first change, so an interrupted revert can be
finished (``--continue``) or rolled back (``unrevert``).  Every step is idempotent: it makes a
path hold its target, whatever it holds now.  Paths are reached from the workspace root one
component at a time without following a symlink, and a path that would leave the workspace is
refused.  The changes go through the mount, so the daemon journals them as the revert's own
unit (``revert:<id>``): an unrevert is a revert of that unit.
"""
from __future__ import annotations

import os
import stat
import time
import uuid
from dataclasses import dataclass, field

from ..journal import Journal
from ..underlay import open_beneath
from .diff import SelectionError, file_events, _find_turn, _visible
from .states import States, State, Tree


@dataclass
class Step:
    path: str
    target: State
    expected: State
    conflict: str | None = None


@dataclass
class Plan:
    id: str
    selection: dict
    steps: list[Step] = field(default_factory=list)

    @property
    def conflicts(self) -> list[Step]:
        return [s for s in self.steps if s.conflict]


def selected_units(j: Journal, *, call=None, turn=None, session=None, since=None,
                   revert_id=None) -> tuple[set[str] | None, int, int | None]:
    """The units a selection names (None: every unit) and its seq range."""
    if revert_id is not None:
        return {f"revert:{revert_id}"}, 1, None
    if call is not None:
        calls = [c for c in j.records("calls") if c["id"] == call
                 and (session is None or c["session"] == session)]
        if not calls:
            raise SelectionError(f"no call {call}")
        return {f"call:{calls[0]['session']}:{call}"}, 1, None
    if turn is not None:
        t = _find_turn(j, turn, session)
        sid = t["session"]
        units = {f"turn:{sid}:{t['index']}"} | {
            f"call:{sid}:{c['id']}" for c in j.records("calls", sid.encode() + b"\0")
            if c.get("turn") == t["index"]}
        return units, t["begin_seq"], None
    if session is not None:
        if j.record("sessions", session.encode()) is None:
            raise SelectionError(f"no session {session}")
        units = {f"session:{session}"} | {f"call:{session}:{c['id']}" for c in
                                          j.records("calls", session.encode() + b"\0")} | \
            {f"turn:{session}:{t['index']}" for t in j.records("turns", session.encode() + b"\0")}
        return units, 1, None
    if since is not None:
        return None, since + 1, None
    raise SelectionError("say what to revert: --call, --turn, --session or --since")


def _same(a: State, b: State) -> bool:
    if a.kind != b.kind:
        return False
    if a.kind == "file":
        return a.data == b.data and (a.mode & 0o111 != 0) == (b.mode & 0o111 != 0)
    if a.kind == "symlink":
        return a.data == b.data
    return True


def make_plan(j: Journal, states: States, live: Tree, selection: dict, glob: str | None = None,
              revert_id: str | None = None) -> Plan:
    import fnmatch
    units, lo, hi = selected_units(j, **selection)
    spans: dict[str, list[int]] = {}
    others: dict[str, list[int]] = {}
    last_unit: dict[str, str] = {}
    for e in file_events(j, 1, hi):
        for p in (e.get("path"), e.get("path2")):
            if p is None or not _visible(p):
                continue
            mine = e["seq"] >= lo and (units is None or (e.get("unit") or "") in units)
            if mine:
                if glob and not fnmatch.fnmatchcase(p, glob):
                    continue
                s = spans.setdefault(p, [e["seq"], e["seq"]])
                s[1] = e["seq"]
                last_unit[p] = e.get("unit") or ""
            else:
                others.setdefault(p, []).append(e["seq"])
    ends = states._unit_ends()
    unrecorded = {e.get("path") for e in file_events(j, lo, hi) if e["op"] == "unrecorded"}
    plan = Plan(revert_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6], selection)
    for p, (first, last) in sorted(spans.items()):
        if p.startswith("/") or ".." in p.split("/"):
            raise SelectionError(f"refusing a path that leaves the workspace: {p}")
        target = states.state(p, first - 1)
        # what the reverted unit left: the path as its unit ended (its writes after the last
        # event, through a handle already open, are not events), unless another came between
        end = ends.get(last_unit[p])
        if end and end > last and not any(last < s <= end for s in others.get(p, [])):
            last = end
        expected = states.state(p, last)
        if _same(target, expected) and target.mode == expected.mode:
            continue  # made and unmade inside the selection (a temp file): nothing to do
        step = Step(p, target, expected)
        if live.symlink_on_the_way(p):
            step.conflict = "escape"  # a directory on its way is now a symlink: never followed
        elif p in unrecorded or not target.exact or not expected.exact:
            step.conflict = "unrecorded"
        elif any(first < s < last for s in others.get(p, [])):
            step.conflict = "interleaved"
        elif not _same(live.state(p), expected):
            step.conflict = "changed"
        plan.steps.append(step)
    return plan


# -- carrying a plan out ----------------------------------------------------------------------

def _parent(root_fd: int, rel: str, create: bool) -> tuple[int, str]:
    parent, _, name = rel.rpartition("/")
    if not parent:
        return os.dup(root_fd), name
    if create:
        fd = os.dup(root_fd)
        try:
            for part in parent.split("/"):
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd, name
    return open_beneath(root_fd, parent), name


def _remove(dfd: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        os.rmdir(name, dir_fd=dfd)
    else:
        os.unlink(name, dir_fd=dfd)


def apply_step(root_fd: int, step: Step) -> str:
    """Make ``step.path`` hold ``step.target``; returns what was done."""
    t = step.target
    try:
        dfd, name = _parent(root_fd, step.path, create=t.present)
    except FileNotFoundError:
        return "nothing (parent gone)"
    try:
        if not t.present:
            try:
                _remove(dfd, name)
            except OSError as e:
                if e.errno == 39:  # ENOTEMPTY: unrecorded files live in it; keep it
                    return "kept (not empty)"
                raise
            return "removed"
        if t.kind == "dir":
            try:
                os.mkdir(name, t.mode or 0o755, dir_fd=dfd)
            except FileExistsError:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    _remove(dfd, name)
                    os.mkdir(name, t.mode or 0o755, dir_fd=dfd)
            os.chmod(name, t.mode or 0o755, dir_fd=dfd)
            return "dir"
        tmp = f".{name}.overlayrec-revert-{os.getpid()}"[:255]
        _remove(dfd, tmp)
        if t.kind == "symlink":
            os.symlink(os.fsdecode(t.data), tmp, dir_fd=dfd)
        elif t.kind == "file":
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                         stat.S_IMODE(t.mode) or 0o644, dir_fd=dfd)
            try:
                view = memoryview(t.data)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, stat.S_IMODE(t.mode) or 0o644)
            finally:
                os.close(fd)
        else:
            return f"skipped ({t.kind} cannot be restored)"
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                os.rmdir(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # atomic in its directory
        return "restored"
    finally:
        os.close(dfd)


def order(steps: list[Step]) -> list[Step]:
    """Directories to create first (shallow first), then files, then removals deepest first."""
    mk = sorted([s for s in steps if s.target.kind == "dir"], key=lambda s: s.path.count("/"))
    files = [s for s in steps if s.target.present and s.target.kind != "dir"]
    rm = sorted([s for s in steps if not s.target.present], key=lambda s: -s.path.count("/"))
    return mk + files + rm


def plan_to_json(plan: Plan, content_put) -> dict:
    def st(s: State) -> dict:
        d = {"kind": s.kind, "mode": s.mode, "exact": s.exact}
        if s.kind in ("file", "symlink"):
            d["blob"] = content_put(s.data)
        return d
    return {"id": plan.id, "selection": plan.selection,
            "steps": [{"path": s.path, "target": st(s.target), "expected": st(s.expected),
                       "conflict": s.conflict} for s in plan.steps]}


def plan_from_json(d: dict, content_get) -> Plan:
    def st(x: dict) -> State:
        return State(x["kind"], x["mode"], content_get(x["blob"]) if "blob" in x else b"",
                     x.get("exact", True))
    return Plan(d["id"], d["selection"], [Step(s["path"], st(s["target"]), st(s["expected"]),
                                                s["conflict"]) for s in d["steps"]])
