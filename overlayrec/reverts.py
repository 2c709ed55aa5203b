"""The revert lifecycle: the saved plans, carrying a plan out through the mount, finishing an
interrupted one (``--continue``) and the unrevert stack.

A plan (``engines.revert``) is saved in the state dir before its first change and marked done
after its last, so an interrupted revert can be continued or rolled back.  The changes go
through the mount, announced to the daemon (``revert_begin``/``revert_end``), which journals
them as the revert's own unit ``revert:<id>``: an unrevert is a revert of that unit, and a
revert record names the revert it undid (``unreverts``) and is named by the one that undid it
(``unreverted_by``).  The command layer mounts the workspace when it is not mounted, prints and
asks; nothing here prints.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import stat
import time
from typing import Callable

from . import client, state
from .engines import large
from .engines.revert import blocked_beneath_conflicts, make_plan
from .engines.revert_apply import (apply_step, bytes_written, changed_since, clear_stale_temps,
                                   moved_in, order, recheck, unmet, ways)
from .engines.revert_steps import (KEPT, KEPT_CHANGED, PARTLY, STILL_WRITING, DirMode, Opening,
                                   Plan, failed, plan_from_json, plan_to_json)
from .engines.states import UNREACHED_NOTE, Tree


class RevertError(Exception):
    """A revert that cannot go ahead; the message is one line."""


def plans(sd: str) -> list[dict]:
    """Every saved revert record, oldest first."""
    return state.saved_reverts(sd)


def save(sd: str, rec: dict) -> None:
    state.save_revert(sd, rec)


def with_room(sd: str, make):
    """``make()`` (a revert's plan made and saved before its first change).  Refused for
    want of room where the state dir shares the workspace's full filesystem, the daemon is
    asked to make room (from its reserve: ``Recorder.room_to_record``) and it is made again,
    while the daemon gives room (found by a bug hunt: a revert was refused on a full shared
    filesystem)."""
    for _ in range(16):
        try:
            return make()
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            try:
                with client.Client(state.StateDir(sd).control_sock) as c:
                    freed = c.request("room").get("freed")
            except (client.ClientError, OSError):  # no daemon to ask: the refusal stands
                raise e from None
            if not freed:
                raise
    return make()


@contextlib.contextmanager
def one_at_a_time(sd: str):
    """Hold the state dir's revert lock from a revert's plan to its end: a second revert of
    the workspace planned meanwhile would check the paths against a tree the first is
    changing (its conflicts found before the first wrote, its writes after), so it is refused
    (RevertError) until the first is done."""
    fd = state.hold_revert_lock(sd)
    if fd is None:
        raise RevertError("another revert or unrevert, or a gc, of this workspace is "
                          "under way: try again once it is done")
    try:
        yield
    finally:
        os.close(fd)  # lets the lock go


def pending(sd: str) -> dict | None:
    """The newest revert that was interrupted (still ``running``), or None."""
    running = [r for r in plans(sd) if r.get("status") == "running"]
    return running[-1] if running else None


def to_undo(sd: str, revert_id: str | None) -> dict:
    """The revert an unrevert undoes: the one named, or the newest not yet undone that is not
    itself a finished unrevert.  So unreverts peel the stack of reverts, newest first: the
    second does not undo the first (it is the newest revert record, and undoing it would put
    back what the first took away).  A finished unrevert is undone only by its id."""
    every = plans(sd)
    if revert_id is not None:
        found = [r for r in every if r["id"] == revert_id]
        if not found:
            raise RevertError(f"no revert {revert_id}")
        gone = found[0].get("let_go")
        if gone:
            raise RevertError(f"revert {revert_id} can no longer be unreverted: a gc let it go "
                              f"on {time.strftime('%Y-%m-%d %H:%M', time.localtime(gone['t'] / 1e9))}"
                              f" (the record starts at seq {gone['cut']}; "
                              "`gc --let-go-reverts`, or a mount's --max-bytes)")
        return found[0]
    candidates = [r for r in every if state.revert_undoable(r, every)
                  and not (r.get("unreverts") and r.get("status") == "done")]
    if not candidates:
        raise RevertError("no revert to undo")
    return candidates[-1]


def rolled_back(sd: str, rec: dict) -> None:
    """An interrupted revert that an unrevert undid is over."""
    if rec.get("status") == "running":
        rec["status"] = "rolled back"
        save(sd, rec)


def describe(step) -> str:
    t, e = step.target, step.expected
    if step.moved_from is not None:  # renamed back (then written, where it differs)
        return "rename"
    if not t.present:
        return "delete"
    if not e.present:
        return "create"
    return "replace"


def _pin(plan: Plan, rec: dict, content) -> None:
    """Point each content of the plan too large to hold (engines.large: read when written)
    at its copy in the saved plan, not at the live file it was read from: the revert's own
    steps change live files (one restored in place, a path another step replaces), and a
    content read after that would be another, or an error half way."""
    for s, d in zip(plan.steps, rec["steps"]):
        if isinstance(s.target.data, large.Large):
            s.target = s.target.but(data=large.load(content, d["target"]["blob"]))
        if isinstance(s.expected.data, large.Large):
            s.expected = s.expected.but(data=large.load(content, d["expected"]["blob"]))


def preview(plan: Plan) -> dict:
    """A plan as ``--json`` shows it: each step's path, action and conflict, and the note
    that says why where the conflict's name alone does not."""
    return {"id": plan.id, "steps": [{"path": s.path, "action": describe(s),
                                      "conflict": s.conflict, **({"note": s.note} if s.note
                                                                 else {}),
                                      **({"from": s.moved_from} if s.moved_from is not None
                                         else {})}
                                     for s in plan.steps],
            "guessed": plan.guessed, "maybe_ours": plan.maybe_ours, "late": plan.late,
            "already": plan.already, "kept_objects": plan.kept_objects,
            "moved_from_outside": [list(x) for x in plan.moved_from_outside],
            "moved_to_outside": [list(x) for x in plan.moved_to_outside]}


class Sources:
    """What a revert reads: the journal (read-only), the content store, the tree beneath the
    mount (what the record saw: ``under``, from ``readers.tree_for``) and the live tree
    through the mount (what every process sees).  Closed together."""

    def __init__(self, ws: str, sd: str, under: Tree):
        from .journal import ContentStore, Journal
        self.under = under
        self.content = ContentStore(state.StateDir(sd).content)
        self.live = None
        self.j = None
        try:
            self.j = Journal(sd, readonly=True)
            self.live = Tree.at(ws)
        except BaseException:
            self.close()
            raise

    def secret(self) -> Callable[[str], bool]:
        """The record's secret paths as the recorder withholds them (a pattern's, a name a
        rename carried withheld content to, a content-checked one's): asked of a step's
        temporary name (``carry_out``)."""
        from .secrets import Secrets
        sec = Secrets.of_journal(self.j)
        return lambda p: sec.match(p) or sec.checked(p)

    def close(self) -> None:
        os.close(self.under.root_fd)
        if self.live is not None:
            os.close(self.live.root_fd)
        if self.j is not None:
            self.j.close()


def plan_for(src: Sources, selection: dict, glob: str | None, revert_id: str | None = None,
             resume: dict | None = None) -> Plan:
    """A fresh plan for ``selection`` (its session named as ``diff`` names it), or the saved one
    of an interrupted revert (``resume``).  RevertError when the selection names nothing, or
    reaches into what retention dropped."""
    from .engines.diff import SelectionError, session_named
    from .engines.states import States
    from .retention import dropped_selection
    if resume is not None:
        plan = plan_from_json(resume, functools.partial(large.load, src.content))
        recheck(plan, src.live)
        return plan
    try:
        if selection.get("session") is not None:
            selection["session"] = session_named(src.j, selection["session"])
        why = dropped_selection(src.j, **selection)
        if why:
            raise RevertError(why)
        return make_plan(src.j, States(src.j, src.under), src.live, selection, glob, revert_id)
    except SelectionError as e:
        raise RevertError(str(e)) from None


def open_writes(sd: str) -> list[dict] | None:
    """The files the mount's daemon has a descriptor open on for writing, each with the unit
    its writes go to and the processes holding it (client.writing, ControlServer.writing);
    None when no daemon can say (not mounted, or an older one)."""
    try:
        with client.Client(state.StateDir(sd).control_sock) as c:
            return c.writing()
    except (client.ClientError, OSError):
        return None


def held_open(j, plan: Plan, writing: list[dict] | None, live: Tree) -> list[dict]:
    """Refuse the plan's paths on which a descriptor of what it undoes is still open for
    writing (``writing``: open_writes()), as ``unrecorded`` with STILL_WRITING: its next write
    would land in the file the revert replaced, not in the path, and an unrevert would give
    the path back without it.  The record says so only while the run of writes is open (no
    release noted); once the call, its session and the `run` have ended, their ends sealed the
    path, and only the daemon's open handles still tell (a background process that inherited
    the descriptor).  A path is matched by its name, or by the file it holds now (the
    descriptor's inode: a hard link, a rename since).  Returns the processes holding such
    descriptors, as Calls.processes gives them (with the descriptor's unit), for
    still_running.  Nothing changes when the daemon cannot say (``writing`` None)."""
    import stat
    from .engines.revert import selected_units
    from .engines.revert_steps import up
    if not writing or not plan.steps:
        return []
    units = selected_units(j, **plan.selection)[0]
    mine = [w for w in writing if units is None or w["unit"] in units]
    if not mine:
        return []
    by_path = {w["path"] for w in mine}
    by_ino = {w["ino"] for w in mine}
    # a path beneath a directory a rename back brings is written where that directory is now
    # (a background writer's late write to e/a, `mv d e` renamed back and d/a written: the
    # write was lost, exit 0; found by a bug hunt)
    back = {m.path: m.moved_from for m in plan.steps if m.moved_from is not None}

    def now_at(p: str) -> str:
        u = next((u for u in up(p) if u in back), None)
        return p if u is None else back[u] + p[len(u):]
    for s in plan.steps:
        if s.conflict:
            continue
        name = now_at(s.path) if back else s.path
        held = name in by_path or s.moved_from in by_path  # (a rename back's object)
        if not held and s.expected.kind == "file":  # (another kind: a conflict already)
            st = live.lstat(name)
            held = st is not None and stat.S_ISREG(st.st_mode) and st.st_ino in by_ino
        if held:
            s.conflict, s.note = "unrecorded", STILL_WRITING
    return [dict(h, unit=w["unit"]) for w in mine for h in w["holders"]]


def still_running(j, plan: Plan, processes: list[dict], exclude: set[int]) -> list[str]:
    """The processes of what the plan undoes that still run, each as ``pid command``: those
    whose changes it undoes (the same pid and start time), and those the daemon places in its
    units (``processes``: client.processes(), a call's server that has not written yet).  What
    they write after the revert would follow it, half undone.  Not an agent (it writes in its
    calls, and waits for its user between them), nor a pid in ``exclude`` (the revert's own
    ancestors: an agent's tool that reverts its own turn)."""
    from .attribution import live_stat
    from .engines.revert import selected_units
    agents = {s.get("agent") for s in j.records("sessions")}
    units = selected_units(j, **plan.selection)[0] if plan.steps else set()
    found: dict[str, str] = {}
    for p in processes:
        if (units is None or p["unit"] in units) and p["key"] not in agents \
                and p["pid"] not in exclude:
            found[p["key"]] = " ".join(p["argv"])
    for key in sorted(plan.writers - agents - set(found)):
        pid_s, _, start = key.partition(":")
        if not pid_s.isdigit() or int(pid_s) <= 1 or int(pid_s) in exclude or \
                not start.isdigit():
            continue
        st = live_stat(int(pid_s))
        if st is None or st[0] != int(start):
            continue
        found[key] = " ".join((j.actor(key) or {}).get("argv") or [])
    return [f"{k.split(':')[0]} {argv[:60]}".rstrip() for k, argv in sorted(found.items())]


def conflict_summary(plan: Plan) -> str:
    from .views import named, shown  # one line, whatever the names hold
    kinds: dict[str, list[str]] = {}
    for s in plan.conflicts:
        kinds.setdefault(s.conflict, []).append(shown(s.path))
    # one line that stays one: the plan above (or --json) lists every path
    return "; ".join(f"{k}: {named(v)}" for k, v in sorted(kinds.items()))


def refusal(plan: Plan, ws: str | None = None) -> str:
    """Why a plan with conflicts is refused whole (without --force): the conflicts by kind,
    and the paths behind each note that says more than its kind's name; and what to do when
    the workspace root ``ws`` itself is closed to its owner."""
    from .views import named, shown
    noted = sorted({s.note for s in plan.conflicts if s.note})
    return ("conflicts, nothing reverted: " + conflict_summary(plan)
            + "".join(f" ({n}: " + named(shown(s.path) for s in plan.conflicts if s.note == n)
                      + ")" for n in noted)
            + (_closed_root(plan, ws) if ws is not None and UNREACHED_NOTE in noted else ""))


def _closed_root(plan: Plan, ws: str) -> str:
    """What to do when the paths the revert cannot reach lie beneath a workspace root its
    owner may not search (an agent's `chmod 000 .`): the revert reads the live tree as its
    user, so the owner opens the root first, to the mode the revert would give it; "" when
    that is not why."""
    try:
        st = os.stat(ws)
    except OSError:
        return ""
    if st.st_uid != os.geteuid() or st.st_mode & stat.S_IXUSR:
        return ""
    back = [s.target.mode for s in plan.steps
            if s.path == "" and s.target.present and s.target.mode is not None]
    mode = f"{stat.S_IMODE(back[0]):o}" if back else "u+rwx"
    return (f"; the workspace root has mode {stat.S_IMODE(st.st_mode):04o}, closed to its "
            f"owner: `chmod {mode} {ws}` first (the mode the revert puts back), then revert "
            "again with --force (the root then reads as changed since, and is left as it is)")


def outcome(plan: Plan, rec: dict, unreverts: str | None) -> tuple[str, list[str]]:
    """What a carried-out revert says: its one line of what it did, and the failures that make
    its exit 1 (paths it could not make whole, paths read back otherwise than it put them:
    never a silent success)."""
    from .views import named, shown
    done, bad, wrong = rec["done"], rec["failed"], rec["unmet"]
    # a directory the plan empties that holds what it does not remove (files made later, by
    # others) stays: said, as its step line said "delete"
    kept = sorted({p for p, result in done if result == KEPT})
    which = "directory that holds" if len(kept) == 1 else "directories that hold"
    verb = f"unreverted {unreverts}: restored" if unreverts else "reverted"
    # a kept directory is no path reverted (the unrevert's count then disagreed)
    untouched = {p for p, result in done if result == KEPT_CHANGED}  # another's, kept
    line = (f"{verb} {len({p for p, _ in done} - set(kept) - untouched)} path(s) as revert "
            f"{plan.id}"
            + (f"; {len(plan.conflicts)} conflicting path(s) left alone" if plan.conflicts
               else "")
            + (f"; kept {len(kept)} {which} what it does not remove: "
               f"{named(map(shown, kept))}" if kept else ""))
    errors = []
    # the content put back but not all of its metadata (an owner a user may not give)
    partly = [f for f in bad if f["result"].startswith(PARTLY)]
    if partly:
        errors.append(f"{len(partly)} path(s) restored but not whole: " + "; ".join(
            f"{f['path']}: {f['result'][len(PARTLY):]}" for f in partly))
    if len(partly) < len(bad):
        errors.append(f"{len(bad) - len(partly)} path(s) not restored: " + "; ".join(
            f"{f['path']}: {f['result'][len('failed: '):]}" for f in bad
            if not f["result"].startswith(PARTLY)))
    if wrong:
        errors.append(f"{len(wrong)} path(s) do not hold what the revert put back (written by "
                      "another process while it ran?): " + "; ".join(
                          f"{shown(w['path'])} {w['how']}" for w in wrong[:5])
                      + (" ..." if len(wrong) > 5 else ""))
    return line, errors



def attic_droppable(under_fd: int) -> int:
    """The bytes the mount may free from the attic when the workspace's filesystem is full
    (Recorder.store_waiting, then Recorder.reclaim): entries whose attic link is their only
    one."""
    from .recorder import ATTIC_NAME, ATTIC_OWN
    try:
        dfd = os.open(ATTIC_NAME, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                      dir_fd=under_fd)
    except OSError:
        return 0
    total = 0
    try:
        for e in os.scandir(dfd):
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if e.name not in ATTIC_OWN and e.is_file(follow_symlinks=False) and \
                    st.st_nlink == 1:
                total += st.st_blocks * 512
    finally:
        os.close(dfd)
    return total


def check_room(ws: str, plan: Plan, under_fd: int) -> None:
    """RevertError, before anything is changed, when the workspace's filesystem has no room
    for what the revert writes at its peak (engines.revert_apply.bytes_written), counting what the
    mount may free by dropping attic entries: a revert stopped half way by a full disk stays
    pending (to be continued or rolled back), where one refused here changes nothing."""
    from .recorder import SMALL_PREIMAGE
    from .views import human_size
    need = bytes_written(plan, SMALL_PREIMAGE)
    if not need:
        return
    vfs = os.statvfs(ws)
    free = vfs.f_bavail * vfs.f_frsize
    if free >= need:
        return
    droppable = attic_droppable(under_fd)
    if free + droppable >= need:
        return
    raise RevertError(
        f"nothing reverted: the revert writes {human_size(need)} into the workspace, whose "
        f"filesystem has {human_size(free)} free"
        + (f" (and {human_size(droppable)} of old pre-images the record would give up)"
           if droppable else "")
        + "; the large files it replaces free no room (the record keeps them, for "
        "unrevert): free some room, or revert fewer paths (--path)")


def _state_dir_full(e: OSError, sd: str, ws: str) -> None:
    """RevertError for a step refused for room (ENOSPC, EDQUOT) where the full filesystem is
    the state dir's, not the workspace's: the daemon journals each change before it lands,
    and its refusal comes back through the mount as the workspace's own.  The step said
    "free room on the workspace's filesystem", which had 79 GB free (found by a bug hunt)."""
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return
    try:
        if shutil.disk_usage(sd).free > (1 << 20) or shutil.disk_usage(ws).free < (1 << 20):
            return  # (the workspace's full too, or the state dir not: the step's words)
    except OSError:
        return
    raise RevertError(f"{e.filename}: cannot be written ({os.strerror(e.errno)}): the record's "
                      f"state dir {sd} is full (each change is journaled before it lands): free "
                      "room there, then `overlayrec revert --continue`, or `overlayrec "
                      "unrevert`") from None


def carry_out(ws: str, sd: str, plan: Plan, content, *, unreverts: str | None = None,
              resume: dict | None = None, progress=None, secret=None) -> dict:
    """Carry out the plan's paths without conflicts through the mount, the plan saved first
    and its outcome after (``progress(n, total)`` after each), then read every path again
    (``progress(n, total, "reading back")``); ``secret``, the record's secret paths, keeps a
    step's temporary name from being one (engines.revert_apply.revert_temp):
    a step that did not fail but left its path holding something else than its target is
    never a silent success.  Returns the record: ``done`` [(path, what)], ``failed``,
    ``unmet`` (the paths read back otherwise than put back, and how)."""
    def planned() -> tuple[dict, list | None]:
        rec = resume or dict(plan_to_json(plan, functools.partial(large.put, content)),
                             created=time.time_ns(), status="running", unreverts=unreverts,
                             ws=ws)
        rec["status"] = "running"
        # the processes that carried it out, whose temporary files a --continue removes
        earlier = rec.get("pids") if resume is not None else []
        rec["pids"] = (earlier or []) + [os.getpid()]
        save(sd, rec)  # the plan is on disk before the first change
        return rec, earlier
    try:
        rec, earlier = with_room(sd, planned)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # (it said only "No space left on device", after listing every step)
        raise RevertError(f"nothing reverted: no room in the state dir {sd} for the revert's "
                          f"plan ({os.strerror(e.errno)}): free some room there and run it "
                          "again") from None
    _pin(plan, rec, content)
    root_fd = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    done: list[tuple[str, str]] = []
    # hard-link groups, by recorded inode: the first path made of each holds the group's
    # inode (or a live path outside the plan that still holds it)
    made = {key: [partner] for key, partner in plan.partners.items()}
    try:
        with client.Client(state.StateDir(sd).control_sock) as c:
            c.request("revert_begin", id=plan.id)
            try:
                delay = float(os.environ.get("OVERLAYREC_TEST_REVERT_DELAY", "0"))
                steps = order([s for s in plan.steps if not s.conflict], root_fd)
                if resume is not None:  # what the killed run left half made
                    clear_stale_temps(root_fd, [s.path for s in steps], earlier)
                live, ours = Tree(root_fd), set()
                for s in steps:
                    # a path saved (or removed) by another writer while the revert went
                    # through the others (an editor's save): kept, said, never written over;
                    # looked at again once the step's new content is ready (apply_step).  A
                    # revert carried on puts back what was removed since, as its recheck
                    # lets it (the user's directory put back empty after a symlink's)
                    seen: list = []
                    if not isinstance(s, (DirMode, Opening)) and \
                            changed_since(live, s, ours, removed=resume is None, seen=seen):
                        done.append((s.path, KEPT_CHANGED))
                        continue
                    try:
                        done.append((s.path, apply_step(root_fd, s, made,
                                                        seen[0] if seen else False, secret)))
                    except OSError as e:
                        _state_dir_full(e, sd, ws)
                        raise
                    if s.moved_from is not None and not failed(done[-1][1]):
                        moved_in(made, s)  # its group's names and partners are there now
                    st = live.state_stat(s.path)[1] if s.target.kind == "file" else None
                    if st is not None and st.st_nlink > 1:
                        ours.add((st.st_dev, st.st_ino))
                    if progress is not None:
                        progress(len(done), len(steps))
                    if delay:  # tests interrupt a revert half way
                        time.sleep(delay)
            finally:
                c.request("revert_end", id=plan.id)
        # read back once every step is made: a later step may rightly change an earlier
        # one's path (a directory's mode set after its contents; a group's name linked)
        live, results = Tree(root_fd), [r for _, r in done]
        around = ways(steps, results)
        wrong = []
        for n, (s, result) in enumerate(zip(steps, results), 1):
            if (how := unmet(live, s, result, around)) is not None:
                wrong.append({"path": s.path, "how": how})
            if progress is not None:
                progress(n, len(steps), "reading back")
    except client.ClientError as e:
        # the daemon went away under it (an `overlayrec umount` meanwhile): the revert is
        # saved as running, and said so (it said only "control request failed: Broken
        # pipe"; found by a bug hunt)
        raise RevertError(f"{e}: the revert stopped half done (its mount went away?): "
                          "`overlayrec revert --continue` carries the rest out, `overlayrec "
                          "unrevert` undoes what it did") from None
    except OSError as e:
        if e.errno not in (errno.ENOTCONN, errno.ECONNABORTED):
            raise
        # the same, met by a read of the tree through the mount gone (it said "f1159:
        # Software caused connection abort", the path cut, nothing of the revert pending;
        # found by a bug hunt)
        raise RevertError(f"{os.strerror(e.errno)}: the revert stopped half done (its mount "
                          "went away?): `overlayrec revert --continue` carries the rest out, "
                          "`overlayrec unrevert` undoes what it did") from None
    finally:
        os.close(root_fd)
    rec["status"] = "done"
    rec["skipped_conflicts"] = [s.path for s in plan.conflicts]
    rec["failed"] = [{"path": p, "result": r} for p, r in done if failed(r)]
    rec["done"] = done
    rec["unmet"] = wrong
    save(sd, rec)
    if unreverts:
        for r in plans(sd):
            if r["id"] == unreverts:
                r["unreverted_by"] = plan.id
                save(sd, r)
    return rec
