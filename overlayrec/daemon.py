"""The daemon: one mount's lifecycle.

Opens the underlay root fd *before* mounting (afterwards the path is the mount), opens the
journal, mounts with pyfuse3, serves until unmounted or signalled (SIGINT/SIGTERM unmount
cleanly), then closes.  Run as ``python -m overlayrec.daemon``; ``mounting.spawn`` starts it in
its own process (pyfuse3 serves one mount per process) and waits on a pipe for "ready" or the
reason it failed.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import resource
import signal
import stat
import subprocess
import sys
import tempfile
import time

# before pyfuse3, which then binds to its two libfuse functions: the kernel keeps listings
from . import dircache  # isort: skip
import pyfuse3
import trio
import trio.testing  # wait_all_tasks_blocked: the run loop's own idle check (_commit_held_notes)

from .attribution import Attribution, alive, live_stat
from .calls import Calls, late
from .control import ControlServer
from .fs import Operations
from .journal import Journal, JournalError
from .journal.schema import parse_unit
from .recorder import ForeignAttic, Recorder, UnrecordedRecorder, moved_here, time_mutations
from . import retention, secrets, serving, state, underlay

log = logging.getLogger("overlayrec")


class MountError(Exception):
    pass


# the fewest open files the daemon mounts with (its soft limit, raised to the hard one)
MIN_FD_LIMIT = 128


def _raise_fd_limit() -> None:
    """Raise the soft fd limit to the hard one (the inode table keeps O_PATH fds up to half of
    it, fs.Operations._trim).  OVERLAYREC_FD_LIMIT=N, a test and bench knob, sets the soft limit
    to N instead (at most the hard limit, at least MIN_FD_LIMIT) to see the daemon under a
    small one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard
    knob = os.environ.get("OVERLAYREC_FD_LIMIT", "").strip()
    if knob.isdigit():
        want = max(MIN_FD_LIMIT, int(knob))
        if hard != resource.RLIM_INFINITY:
            want = min(want, hard)
    if want != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


# the least hard file-size limit the daemon mounts under: its journal, content store and the
# copies it makes grow past a smaller one (its soft limit is raised to the hard one)
MIN_FSIZE_LIMIT = 1 << 30


def _raise_file_size_limit() -> str | None:
    """Raise the soft file-size limit to the hard one; why the daemon cannot record under the
    hard one, if it is below MIN_FSIZE_LIMIT.  A soft `ulimit -f` in the user's shell is the
    shell's, not the recorder's: inherited, it failed a truncate of a large file (its
    pre-image copy) and, once the journal grew past it, every change (EIO from the commit).
    The kernel still holds each client's writes to the client's own limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if hard != resource.RLIM_INFINITY and hard < MIN_FSIZE_LIMIT:
        return (f"the file-size limit is {hard // 1024} KiB (`ulimit -Hf` {hard // 1024}); the "
                f"recorder's journal grows past it: mount where the hard limit is at least "
                f"{MIN_FSIZE_LIMIT >> 30} GiB (unlimited is best)")
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    return None


def _setup_logging(state_dir: str, foreground: bool) -> None:
    path = state.StateDir(state_dir).daemon_log
    os.close(state.open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND))  # 0600
    handlers: list[logging.Handler] = [logging.FileHandler(path)]
    if foreground:
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")


# how long the daemon, asked to end, waits for the kernel to write back what processes left
# dirty in their shared mappings of the mount's files before it unmounts anyway
FLUSH_WAIT = 10.0


def _preload() -> None:
    """Import now, before the mount, what the daemon imports lazily later: once the mount is
    up, an import from a package inside the workspace (a project's venv, an editable checkout
    there) reads through the daemon's own mount, which waits on itself for good (found by a
    bug hunt: the first hook payload imported its agent's module, the daemon hung, and every
    process touching the workspace with it)."""
    import ctypes  # noqa: F401  (the daemon's own lazy imports, stdlib's too)
    import fcntl  # noqa: F401
    import subprocess  # noqa: F401
    from . import agents, retention, wire  # noqa: F401
    from .agents import _common, _settings  # noqa: F401
    from .journal import ahead, content  # noqa: F401
    agents.modules()


def _flush_mount(ws: str, control: ControlServer | None = None) -> None:
    """syncfs(2) of the mount at ``ws``, from a thread while the daemon serves: the kernel's
    dirty pages of its files come to the daemon as writes.  With ``control`` (a release: no
    process worked in the mount at its look) the mount is detached from the workspace first,
    the syncfs going through a descriptor opened before (``control.detached`` says it was)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        log.warning("cannot open %s to write back its dirty pages: %s", ws, e)
        return
    try:
        if control is not None:
            control.detached = _detach(ws)
            if control.detached and control.recorder is not None:
                control.recorder.detached_at = time.time_ns()  # its end's seal: _around
        if libc.syncfs(fd) != 0:
            log.warning("syncfs of %s: %s", ws, os.strerror(ctypes.get_errno()))
    finally:
        os.close(fd)


def _detach(ws: str) -> bool:
    """Detach the mount at ``ws`` lazily (``fusermount3 -u -z``): the path shows the directory
    beneath at once, and the mount lives on for what holds it (a descriptor, a working
    directory) until the last of them lets go, when the kernel ends the session.  Whether it
    was detached."""
    try:
        p = subprocess.run(["fusermount3", "-u", "-z", ws], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=DETACH_WAIT)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("cannot detach %s (unmounted at the end instead): %s", ws, e)
        return False
    if p.returncode != 0:
        log.warning("cannot detach %s (unmounted at the end instead): %s", ws,
                    p.stderr.strip() or f"fusermount3 exited with {p.returncode}")
        return False
    return True


DETACH_WAIT = 15.0
# how long a detached mount is served for what came to it between a release's look and the
# detach (a reader that opened a file there just then) before the daemon ends it anyway
DETACHED_WAIT = 10.0


def _where(ws: str, mount: dict | None) -> str:
    """The path the mount is at now: where it was made, unless a directory above the workspace
    was renamed since (the mount moves with it; the path it was made at names nothing, or
    another directory).  Known by the mount's own id and source in /proc/self/mountinfo."""
    where = state.mount_point_of(mount) if mount is not None else None
    return where or ws


async def _serve(control: ControlServer, ws: str, owner: dict | None,
                 mount: dict | None = None) -> None:
    async with trio.open_nursery() as nursery:
        delay = float(os.environ.get("OVERLAYREC_TEST_END_DELAY") or 0)

        async def end(detach: bool = False) -> None:
            if control.detached and not detach:
                # a signal (`overlayrec umount`) while a detached mount is held: at once, not
                # after another DETACHED_WAIT
                pyfuse3.terminate()
                return
            if delay:  # tests: a mount that takes its time to end, as a busy one may
                await trio.sleep(delay)
            # pages a process wrote through a shared mapping (mmap) that the kernel still holds
            # dirty are written back while the daemon serves them: after the unmount they have
            # nowhere to go, and the writes were lost without a word
            with trio.move_on_after(FLUSH_WAIT):
                await trio.to_thread.run_sync(_flush_mount, _where(ws, mount),
                                              control if detach else None,
                                              abandon_on_cancel=True)
            if control.detached:
                # a process that came to the workspace after the release's look (nothing
                # worked in it then) and opened a file there is served until it lets go: the
                # kernel then ends the session (pyfuse3.main returns, and this is cancelled).
                # Unmounted at once, its next read said "Transport endpoint is not connected"
                await trio.sleep(DETACHED_WAIT)
                log.warning("the detached mount of %s is still held after %.0f s: ended under "
                            "what holds it", ws, DETACHED_WAIT)
            pyfuse3.terminate()
        control.stop = lambda detach=False: nursery.start_soon(end, detach)
        nursery.start_soon(control.serve)
        async def on_signal():
            ending, got = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP), []

            def later(signum, frame):
                got.append(signum)
                log.info("signal %d: already unmounting", signum)
            # the end (the flush, the unmount, the seal) is not cut short by another signal:
            # the receiver puts back, when it closes, what was there before it (the default:
            # a second SIGTERM, of two `umount`s or of a `run` ending beside one, killed the
            # daemon before it sealed; found by a bug hunt), and redelivers a signal queued
            # then.  SIGKILL still ends a daemon that hangs
            for sig in ending:
                signal.signal(sig, later)
            with trio.open_signal_receiver(*ending) as sigs:
                if not got:  # (one that came just before the receiver opened counts)
                    async for signum in sigs:
                        got.append(signum)
                        break
            log.info("signal %d: unmounting", got[0])
            control.end()
        nursery.start_soon(on_signal)
        async def end_exited_calls(calls=control.calls):
            # an implicit call ends once its processes have exited: looked at every 0.25 s, in
            # the trio thread between requests (no handler awaits, so nothing else touches the
            # calls meanwhile), reading /proc only while some implicit call is live
            full_logged = float("-inf")
            while True:
                await trio.sleep(0.25)
                if not calls.live_implicit:
                    continue
                try:
                    calls.end_exited_calls()
                except JournalError as e:
                    # the state dir full: the call's end (and the seal of its epochs) is retried
                    # every 0.25 s until there is room again; said once a minute
                    if time.monotonic() - full_logged > 60:
                        full_logged = time.monotonic()
                        log.warning("cannot journal the end of an implicit call now: %s", e)
                except Exception:  # a failed check must not take the mount down: retried
                    log.exception("checking implicit calls for exited processes failed")
        nursery.start_soon(end_exited_calls)
        nursery.start_soon(_follow_runners, control, ws, owner, mount)
        nursery.start_soon(_stamp_alive, state.StateDir(control.calls.journal.state_dir).alive)
        await nursery.start(_commit_held_notes, control.calls.journal)
        if not isinstance(control.recorder, UnrecordedRecorder) and \
                os.environ.get("OVERLAYREC_TEST_COPY_SMALL_NOW") != "1":
            await nursery.start(_settle_small, control.recorder)
        if control.max_bytes is not None:
            nursery.start_soon(_keep_budget, control)
        nursery.start_soon(_keep_reserve, control.recorder)
        # every handler runs to completion without awaiting, so more worker tasks cannot overlap
        # anything: one reader saves the task spawning and read-lock traffic per request
        # (tools/bench: grep and cat-all about 15% faster)
        serving.install()  # fewer passes through trio's run loop per request
        await pyfuse3.main(min_tasks=1, max_tasks=1)
        nursery.cancel_scope.cancel()


# how often the serving daemon stamps its state dir's ``alive`` file (StateDir.alive): a daemon
# killed (kill -9, a crash) did nothing to the workspace more than this, plus the scheduling's
# delay, after the stamp its next mount finds (Recorder.open_record)
ALIVE_EVERY = 0.25


def last_alive(path: str) -> int | None:
    """When a daemon of this state dir was last known alive (ns), or None: never stamped."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_mtime_ns if stat.S_ISREG(st.st_mode) else None  # no stamp of ours


async def _stamp_alive(path: str) -> None:
    """Stamp ``path`` (StateDir.alive) every ALIVE_EVERY seconds while serving.  A stamp that
    cannot be made (the name taken by a directory: the daemon died just after `mount` said it
    had mounted; found by a hunt) is said once and left: it makes recovery more careful only."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        log.warning("cannot stamp %s (%s): serving without it", path, e.strerror or e)
        return
    try:
        while True:
            try:
                os.utime(fd)
            except OSError as e:  # a stamp missed makes the next recovery more careful only
                log.debug("cannot stamp %s: %s", path, e)
            await trio.sleep(ALIVE_EVERY)
    finally:
        os.close(fd)


async def _keep_reserve(recorder: Recorder) -> None:
    """Make the state dir's reserve again once a change spent it (Recorder.make_reserve), as
    soon as there is room: the room that change's reclaim freed comes back only once the
    kernel lets go of the removed file, after the request."""
    while True:
        await trio.sleep(RUNNER_CHECK)
        if recorder.reserve_owed:
            recorder.reserve_owed = not recorder.make_reserve()


# how often the daemon looks for a session whose runner has gone without ending it, and for
# the end of the process it mounted for
RUNNER_CHECK = 1.0
USERS_CHECK = 5.0  # and for the processes still working in such a mount, once one was found


async def _follow_runners(control: ControlServer, ws: str, owner: dict | None,
                          mount: dict | None = None) -> None:
    """End the sessions whose runner and agent went without ending them (``Calls.
    end_abandoned_sessions``: `overlayrec run` killed by SIGKILL); and, for a mount made for a
    command (``owner``: the `run` or the revert that mounted, ``--owner``), unmount once that
    command is gone, no session is live and no process uses the mount.  The command unmounts
    itself when it ends well; this is for when it was killed where nothing could catch it
    (the mount stayed for good, its session "running" in every listing).  A mount `run` left
    for processes still working in it goes when they are done."""
    calls = control.calls
    failed_logged = next_scan = float("-inf")
    while True:
        await trio.sleep(RUNNER_CHECK)
        try:
            for s in calls.end_abandoned_sessions():
                log.info("session %s: its runner and agent exited without ending it: ended",
                         s.id)
        except JournalError as e:  # the state dir full: tried again next time
            if time.monotonic() - failed_logged > 60:
                failed_logged = time.monotonic()
                log.warning("cannot journal the end of an abandoned session now: %s", e)
            continue
        except Exception:  # must not take the mount down: tried again next time
            log.exception("ending abandoned sessions failed")
            continue
        if owner is None or alive(f"{owner['pid']}:{owner['start']}"):
            continue
        if any(s.ended is None for s in calls.sessions.values()):
            continue
        if time.monotonic() < next_scan:
            continue
        # a scan of /proc that asks no filesystem anything (state._holders): off the trio
        # thread only so that requests are served meanwhile; a few milliseconds a hundred
        # processes, so while some process works in the mount, every USERS_CHECK seconds
        users = await trio.to_thread.run_sync(state.mount_users, _where(ws, mount),
                                              {os.getpid()})
        if users:
            next_scan = time.monotonic() + USERS_CHECK
            continue
        if any(s.ended is None for s in calls.sessions.values()):
            continue  # one began during the scan (a `run` joined)
        if state.beneath_refusal(_where(ws, mount)):
            # a mount made inside the workspace would go with this one (its data with a
            # tmpfs): the mount stays until the user unmounts those (overlayrec umount says)
            next_scan = time.monotonic() + USERS_CHECK
            continue
        log.info("pid %d, which mounted %s for itself, is gone, and nothing uses the mount: "
                 "unmounting", owner["pid"], ws)
        control.end(detach=True)  # with no await since the look: nothing began meanwhile
        return


# what waits for a commit (Journal.hold_notes: extents notes, held events, records written
# ahead) is committed once the daemon has been idle this long: a burst's last note reaches LMDB
# this much after the burst
NOTE_DELAY = 0.005
# and, under requests that never leave it idle that long, this often (a record written ahead
# carries the notes and held events before it, and every reader commits the records it finds:
# only what no record carries yet waits this long for a reader to see it)
COMMIT_EVERY = 0.05


async def _commit_held_notes(journal, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Commit what waits in the journal once the daemon is idle, NOTE_DELAY after its last
    request, or every COMMIT_EVERY under a stream of requests.

    Waiting for idle is trio's own check on each pass of the run loop, where a sleep of
    NOTE_DELAY after every first note was a deadline set, expired and cancelled 200 times a
    second under load, each with a small commit: an untar makes about 100 commits, not 600 to
    1,000 (the daemon's CPU the same within noise; docs/bench.md, seventh pass)."""
    woken = trio.Event()

    def wake():
        woken.set()
    journal.on_held = wake
    journal.hold_notes = True
    task_status.started()
    failed_logged = float("-inf")
    try:
        while True:
            await woken.wait()
            woken = trio.Event()
            while journal.held:
                with trio.move_on_after(COMMIT_EVERY):
                    await trio.testing.wait_all_tasks_blocked(NOTE_DELAY)
                try:
                    journal.flush()
                except JournalError as e:  # the state dir full: tried again a little later
                    if time.monotonic() - failed_logged > 60:
                        failed_logged = time.monotonic()
                        log.warning("cannot commit %d extents note(s) now: %s", journal.held, e)
                    await trio.sleep(0.25)
    finally:
        journal.hold_notes = False
        journal.on_held = None


# small pre-images kept by the attic (Recorder.settle_small) go into the store once the daemon
# has been idle this long, a batch of at most SETTLE_BATCH seconds at a time (a request that
# comes meanwhile waits that long at most); under requests that never leave it idle, batch
# after batch between requests while this many wait (the attic's entries and the daemon's
# list of them stay bounded)
SETTLE_IDLE = 0.02
SETTLE_BATCH = 0.01
SETTLE_WAITING = 20_000


async def _settle_small(recorder, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Copy the small pre-images the attic keeps into the content store when the daemon is
    idle (docs/design.md, "The attic"): what an ``rm -rf`` would otherwise copy on the
    request path."""
    woken = trio.Event()

    def wake():
        woken.set()
    recorder.on_kept_later = wake
    recorder.later = True
    # a test knob: how long idle before copying (3600: not while mounted, for tests of readers
    # meeting pre-images the attic keeps still)
    idle_for = float(os.environ.get("OVERLAYREC_TEST_SETTLE_IDLE", "").strip() or SETTLE_IDLE)
    task_status.started()
    failed_logged = float("-inf")
    try:
        if recorder.to_store:  # left by an earlier daemon
            woken.set()
        while True:
            await woken.wait()
            woken = trio.Event()
            while recorder.to_store:
                if len(recorder.to_store) < SETTLE_WAITING:  # else: at once, between requests
                    idle = False
                    with trio.move_on_after(1.0):  # to look at the count again
                        await trio.testing.wait_all_tasks_blocked(idle_for)
                        idle = True
                    if not idle:
                        continue
                try:
                    recorder.settle_small(SETTLE_BATCH)
                except (JournalError, OSError) as e:  # the state dir full: they wait, readable,
                    # in the attic, never reclaimed
                    if time.monotonic() - failed_logged > 60:
                        failed_logged = time.monotonic()
                        log.warning("cannot copy %d small pre-image(s) into the store now: %s",
                                    len(recorder.to_store), e)
                    await trio.sleep(1.0)
                except Exception:  # must not take the mount down: they wait in the attic
                    log.exception("copying small pre-images into the store failed")
                    await trio.sleep(1.0)
                await trio.sleep(0)
    finally:
        recorder.later = False
        recorder.on_kept_later = None


_writer_lock: int | None = None
BUDGET_EVERY = 60.0  # seconds between looks at a budget set at mount (and after each session)


async def _keep_budget(control: ControlServer) -> None:
    """A budget set at mount (``--max-bytes``): after a session ends, and once a minute,
    measure the record (journal pages in use, content store, attic: a walk of the store, not
    a scan of the journal) and, when over, drop the oldest sessions (a gc in the daemon)."""
    last = time.monotonic()
    every = float(os.environ.get("OVERLAYREC_BUDGET_EVERY", BUDGET_EVERY))
    while True:
        await trio.sleep(0.5)
        if not control.budget_due and time.monotonic() - last < every:
            continue
        control.budget_due = False
        last = time.monotonic()
        try:
            size = retention.record_size(control.calls.journal,
                                         getattr(control.recorder, "attic_fd", None))
            if size["total"] <= control.max_bytes:
                continue
            # a budget lets go of done reverts its cut passes: otherwise one revert kept every
            # session after it for good, and the budget stopped dropping anything
            out = await control.run_gc(_BUDGET_GC | {"max_bytes": control.max_bytes})
            _budget_kept(control.max_bytes, size, out)
        except retention.RetentionError as e:  # a revert under way: looked at again later
            log.info("budget %d bytes: not looked at now: %s", control.max_bytes, e)
        except Exception:  # the budget must not take the mount down: looked at again later
            log.exception("keeping the budget failed")


# a budget lets go of done reverts its cut passes: otherwise one revert kept every session
# after it for good, and the budget stopped dropping anything
_BUDGET_GC = {"let_go_reverts": True}


def _budget_kept(max_bytes: int, size: dict, out: dict) -> None:
    if out.get("let_go"):
        log.warning("budget %d bytes: let go of revert(s) %s, which can no longer be "
                    "unreverted", max_bytes, ", ".join(out["let_go"]))
    if out.get("dropped"):
        log.info("budget %d bytes: the record held %d; dropped session(s) %s, now %d",
                 max_bytes, size["total"], ", ".join(out["dropped"]),
                 out["size_after"]["total"])
    if out.get("over_budget"):
        log.warning("budget %d bytes: still over (%s)", max_bytes, out["over_budget"])


def _keep_budget_at_end(control: ControlServer) -> None:
    """The budget looked at once more when the record is closed: a `run` that mounted for
    itself releases the mount as soon as its session ends, before the daemon's next look, so
    its --max-bytes was never kept (a record five times its budget; found by a bug hunt).
    What ``control.run_gc`` does, in one go: nothing is served any more."""
    journal = control.calls.journal
    try:
        journal.flush()  # the sessions' ends and the seals: what the plan reads
        size = retention.record_size(journal, getattr(control.recorder, "attic_fd", None))
        if size["total"] <= control.max_bytes:
            return
        out: dict = {}
        for _ in control.gc_steps(_BUDGET_GC | {"max_bytes": control.max_bytes}, out):
            pass
        _budget_kept(control.max_bytes, size, out)
    except Exception:  # the record is closed and whole: the next mount or gc keeps it
        log.exception("keeping the budget at unmount failed")


def _whose_record(ws: str, state_dir: str) -> None:
    """MountError at once when the state dir records another workspace (not this one moved),
    read as a reader does: not after waiting for the writer lock its own daemon holds."""
    if not os.path.exists(os.path.join(state_dir, "journal", "data.mdb")):
        return
    try:
        peek = Journal(state_dir, readonly=True)
    except JournalError as e:
        raise MountError(str(e)) from None
    try:
        recorded = peek.meta("workspace")
        if recorded and recorded != ws and not moved_here(peek, recorded, ws):
            raise MountError(f"state dir {state_dir} records workspace {recorded}, not {ws}")
    finally:
        peek.close()


def _refuse_recorded_elsewhere(ws: str, state_dir: str) -> None:
    """MountError when the workspace's attic names another state dir whose daemon runs: the
    same tree mounted already under another name (a bind mount of it), which the path
    checks of a nested mount do not see.  Two records of one tree would each blame the
    other's daemon for every change, and share one attic."""
    from .recorder import ATTIC_NAME, attic_record
    note = attic_record(os.path.join(ws, ATTIC_NAME))
    if note is None or os.path.realpath(note["state_dir"]) == os.path.realpath(state_dir):
        return
    other = note["state_dir"]
    try:
        pid, _ = state.verify_daemon(state.daemon_info(other), other)
    except (state.StateError, OSError):
        return
    if pid:
        where = (state.daemon_info(other) or {}).get("workspace")
        raise MountError(f"{ws} is recorded already by the daemon of state dir {other} "
                         f"(mounted at {where}): the same directory under another name; "
                         f"unmount that one first (overlayrec umount {where})")


def prepare(ws: str, state_dir: str, durable: bool, allow_other: bool, record_data: bool = False,
            secret: tuple = (), no_default_secrets: bool = False):
    """Everything up to and including the mount; raises MountError with a one-line reason."""
    other = state.fuse_mount_at(ws, any_fuse=True)
    if other is not None or state.is_dead_mount(ws):
        if state.is_dead_mount(ws):
            raise MountError(f"{ws} holds a dead mount; clear it with: overlayrec umount {ws}")
        if other["fstype"] != f"fuse.{state.FSNAME}":
            raise MountError(f"{ws} is a mount of another filesystem ({other['fstype']}): "
                             "unmount it first")
        raise MountError(f"{ws} is already mounted")
    try:
        owner = os.stat(ws).st_uid
    except OSError:
        owner = None
    if owner is not None and os.geteuid() not in (0, owner):
        # refused before a journal is made: refused later, it left an empty journal the
        # readers answered from ("no session", "events: 0"; found by a bug hunt)
        raise MountError(f"cannot mount {ws}: {ws} is uid {owner}'s, not this user's (uid "
                         f"{os.geteuid()}): only its owner or root can record it")
    _whose_record(ws, state_dir)
    _refuse_recorded_elsewhere(ws, state_dir)
    global _writer_lock  # held while mounted: no gc writes the journal behind us
    try:
        # before the journal is opened as its writer: a daemon still ending (sealing, or
        # serving a detached mount a process held) writes it until it lets go, and a writer
        # opened beside it took its next seq and emptied its log ahead (two events per seq)
        if _writer_lock is None:  # an unmounted gc finishes first (docs/retention.md)
            _writer_lock = retention.writer_lock(state_dir, wait=20.0)
    except retention.RetentionError as e:
        raise MountError(f"cannot mount: {e}") from None
    try:
        journal = Journal(state_dir, durable=durable, workspace=ws)
    except JournalError as e:
        raise MountError(str(e)) from None
    recorded = journal.meta("workspace")
    if recorded and recorded != ws:
        if not moved_here(journal, recorded, ws):
            journal.close()
            raise MountError(f"state dir {state_dir} records workspace {recorded}, not {ws}")
        # the workspace was moved (renamed) since: the record goes on under its new name
        try:
            journal.put_meta("workspace", ws)
        except JournalError as e:
            journal.close()
            raise MountError(str(e)) from None
        log.info("the workspace recorded at %s was moved to %s: its record goes on", recorded, ws)
    try:  # the secret paths, in the journal before any event: every reader applies this list
        stored = journal.meta(secrets.META_PATTERNS)
        stored_checked = json.loads(journal.meta(secrets.META_CHECKED) or "[]")
        patterns, checked = secrets.effective(
            secret, no_default_secrets, json.loads(stored) if stored is not None else None,
            stored_checked)
        # the content-checked list first: a reader between the two sees a pattern in both
        # (the plain one wins), never in neither
        if checked != stored_checked:
            journal.put_meta(secrets.META_CHECKED, json.dumps(checked))
        if stored is None or json.loads(stored) != patterns:
            journal.put_meta(secrets.META_PATTERNS, json.dumps(patterns))
    except (secrets.SecretError, JournalError, ValueError) as e:
        raise MountError(str(e)) from None
    root_fd = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    attribution = Attribution()
    calls = Calls(journal, attribution)
    # OVERLAYREC_BENCH_NORECORD=1: a bench switch, not a user feature (tools/bench's norecord
    # setup): the same filesystem layer over a recorder that journals no change. Read once here.
    make = UnrecordedRecorder if os.environ.get("OVERLAYREC_BENCH_NORECORD") == "1" else Recorder
    try:
        recorder = make(journal, root_fd, attribution, units=calls, record_data=record_data)
    except ForeignAttic as e:
        os.close(root_fd)
        journal.close()
        raise MountError(f"cannot mount {ws}: {e}") from None
    if make is not Recorder:
        log.info("OVERLAYREC_BENCH_NORECORD=1: changes are NOT recorded (a bench switch)")
    try:
        # a gc killed half way is finished first (docs/retention.md)
        for _ in retention.finish(journal, state_dir, recorder.attic_fd, {},
                                  lambda name, st: recorder._drop_attic(
                                      name, (st.st_dev, st.st_ino))):
            pass
        # before the mount: nothing can change the tree meanwhile
        # the sessions an earlier daemon left open end inside, before this daemon's own
        # units (their ends need no seal: open_record sealed) and before the drift
        found = recorder.open_record(last_alive(state.StateDir(state_dir).alive),
                                     end_left=calls.end_left_open)
    except (OSError, JournalError) as e:
        raise MountError(f"cannot check the workspace against the record: {e}") from None
    if found["drifted"] or found["recovered"] or found["voided"]:
        log.info("record opened: %s", found)
    recorder.start_reserve()  # where the state dir shares the workspace's filesystem
    _kill_ahead(recorder, os.environ.get("OVERLAYREC_TEST_KILL_AHEAD"))
    left = found["ended"]
    if left:
        log.info("ended %d session(s) an earlier daemon left open: %s", len(left),
                 ", ".join(left))
    calls.on_unit_end = recorder.seal  # a unit's end ends its epochs: seal what they left
    calls.on_boundary = recorder.end_epochs  # every unit boundary ends every epoch
    control = ControlServer(state.StateDir(state_dir).control_sock, calls, attribution,
                            os.fstat(root_fd).st_uid, root_fd)
    control.bind()
    control.recorder = recorder
    control.workspace, control.stop = ws, lambda detach=False: pyfuse3.terminate()

    def on_unit_end(unit, seal=calls.on_unit_end):
        seal(unit)
        kind = parse_unit(unit).kind
        if kind == "session":
            control.budget_due = True  # a session can go now: the budget is looked at
        elif kind == "call":
            # its handles open across its end write after it from now on (the end just
            # ended every epoch: their next write is an event, which says so)
            ops.call_ended(unit, late)
    ops = Operations(recorder, root_fd, fault_name=os.environ.get("OVERLAYREC_INJECT_FAULT"))
    calls.on_unit_end = on_unit_end  # once ops is there: a call's end looks at its handles
    control.open_writes = ops.open_writes  # a revert asks which files are still written
    recorder.on_around = ops.forget_cached
    control.operations = ops  # (run: whether a process works beneath the mount)
    # a source of its own (state.mount_point_of): the mount's id alone names the next mount
    # made once it has gone, which the kernel gives the freed id (a `run` ending took another
    # workspace's new mount for its own, moved, and lifted it; found in a test run)
    control.source = f"{state.FSNAME}:{os.urandom(8).hex()}"
    options = set(pyfuse3.default_options) | {f"fsname={control.source}",
                                              f"subtype={state.FSNAME}"}
    if allow_other:
        options.add("allow_other")
    said: list[str] = []
    _preload()
    try:
        with _writable_mountpoint(root_fd), _helper_said(said):
            pyfuse3.init(ops, ws, options)
    except RuntimeError as e:
        control.unbind()  # no mount, no daemon: a socket left would answer no one
        raise MountError(f"cannot mount {ws}: {'; '.join(said) or e}") from None
    return journal, control, recorder


def _kill_ahead(recorder: Recorder, spec: str | None) -> None:
    """OVERLAYREC_TEST_KILL_AHEAD=OP:NAME, a test switch: the daemon kills itself (SIGKILL)
    once it has committed the event of OP on a path whose last name is NAME, before the
    change is made (a crash in the write-ahead window; Recorder._void_unmade); OP
    ``renameat2``: at the rename's syscall, after its other steps (the attic's link)."""
    if not spec:
        return
    op, _, name = spec.partition(":")
    log.warning("OVERLAYREC_TEST_KILL_AHEAD=%s: the daemon kills itself there (a test switch)",
                spec)

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)
    if op == "renameat2":
        renameat2 = underlay.renameat2

        def renaming(pfd, old, npfd, new, flags=0):
            if os.fsdecode(old) == name:
                die()
            return renameat2(pfd, old, npfd, new, flags)
        underlay.renameat2 = renaming
        return
    append = recorder._append

    def appending(ev: dict, actor: dict) -> int:
        seq = append(ev, actor)
        if ev["op"] == op and (ev.get("path") or "").rpartition("/")[2] == name:
            die()
        return seq
    recorder._append = appending


@contextlib.contextmanager
def _helper_said(said: list[str]):
    """Gather into ``said`` the lines libfuse and fusermount3 write to stderr while the mount
    is made: they say why it failed ("option allow_other only allowed if 'user_allow_other'
    is set in /etc/fuse.conf"), where pyfuse3 says only "fuse_session_mount failed".  They
    still reach stderr (daemon.log) after."""
    with tempfile.TemporaryFile() as caught:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            text = caught.read()
            if text:
                os.write(2, text)
            said += [line.strip() for line in text.decode(errors="replace").splitlines()
                     if line.strip()]


@contextlib.contextmanager
def _writable_mountpoint(root_fd: int):
    """fusermount3 mounts only where its user may write, and enters the mountpoint.  A
    workspace its owner made read-only (an agent's `chmod -R a-w .`) or closed (`chmod 000 .`)
    could then never be mounted again, not even to revert that chmod: its owner's write and
    search bits are set for the mount and the mode put back beneath it after (the daemon's own
    change: the record never sees it, the tree ends as it was)."""
    if os.geteuid() == 0:
        yield
        return
    with underlay.granted_own(root_fd, stat.S_IWUSR | stat.S_IXUSR):
        yield


def run(ws: str, state_dir: str, *, foreground: bool, durable: bool, allow_other: bool,
        ready_fd: int | None, record_data: bool = False, secret: tuple = (),
        no_default_secrets: bool = False, max_bytes: int | None = None,
        owner: int | None = None, registry: bool = True) -> int:
    # what the daemon makes for itself is the user's alone whatever the caller's umask
    # (docs/storage.md; LMDB's files take their mode from it); the umask drops to 0 only to
    # serve, where the kernel has applied the caller's umask to each request already
    os.umask(0o077)
    started = time.time_ns()
    # the command that mounts for itself (it waits for "ready": alive now), known by its start
    # tick too, so that a new process given its pid is not taken for it
    st = live_stat(owner) if owner is not None else None
    owning = None if owner is None else {"pid": owner, "start": st[0] if st else -1}
    _raise_fd_limit()
    sd = state.StateDir(state_dir)

    def tell(msg: str) -> None:
        """Tell the command that started this daemon how the start went.  One gone meanwhile
        (killed while it waited: a `revert` or `run` that mounted for itself) is no reason to
        die with the mount made: that left a dead mount (found by a hunt); the mount serves,
        and ends with its owner (_follow_runners)."""
        if ready_fd is not None:
            try:
                os.write(ready_fd, msg.encode() + b"\n")
            except OSError as e:
                log.warning("the command that started this daemon is gone (%s): %s",
                            e.strerror or e, msg)
            finally:
                os.close(ready_fd)

    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit != resource.RLIM_INFINITY and limit < MIN_FD_LIMIT:
        # the inode table alone keeps up to 64 O_PATH fds (fs._MIN_FD_HIGH), then the open
        # handles, the journal, the attribution's pidfds: under a lower limit the mount served
        # EMFILE to reads and writes alike, and the daemon died of it (a dead mount)
        tell(f"error: cannot mount {ws}: the open-file limit is {limit} (`ulimit -n`); the "
             f"recorder needs at least {MIN_FD_LIMIT}: raise the hard limit and mount again")
        return 1

    too_small = _raise_file_size_limit()
    if too_small:
        tell(f"error: cannot mount {ws}: {too_small}")
        return 1

    try:  # the CLI checked too; the daemon can be started on its own
        state.make_state_dir(state.check_state_dir(ws, state_dir))
    except (state.StateError, OSError) as e:
        tell(f"error: {e}")
        return 1
    _setup_logging(state_dir, foreground)

    try:
        journal, control, recorder = prepare(ws, state_dir, durable, allow_other, record_data,
                                             secret, no_default_secrets)
        control.max_bytes = max_bytes
    except MountError as e:
        log.error("%s", e)
        tell(f"error: {e}")
        return 1
    except PermissionError as e:
        # another user's workspace (its attic is its owner's alone, 0700): said as that, with
        # the path it names, not as "[Errno 13] Permission denied: '.'" and a traceback
        try:
            owner = os.stat(ws).st_uid
        except OSError:
            owner = None
        why = (f"{ws} is uid {owner}'s, not this user's (uid {os.geteuid()}): only its owner "
               "or root can record it" if owner is not None and owner != os.geteuid() else
               f"permission denied reading {e.filename or ws} and beneath it")
        log.error("cannot mount: %s", why)
        tell(f"error: cannot mount {ws}: {why}")
        return 1
    except Exception as e:  # an unexpected failure still gets a one-line reason
        log.exception("mount failed")
        tell(f"error: mount failed: {e}")
        return 1
    os.chdir("/")
    try:  # what an older overlayrec left looser; temp files of writers gone before we started
        for name in ("data.mdb", "lock.mdb"):
            state.tighten(os.path.join(sd.journal, name))
        journal.content.clean(started)
    except OSError as e:
        log.warning("tidying the state dir: %s", e)
    # pid, start ticks and boot id: umount verifies them before it signals this process
    # the mount, found by its source, its own (mounting.mount_of tells it from another's at
    # the path): by its path, a directory above renamed as it was made found nothing, or
    # another workspace's mount made since at the old path (its detach was ours: a hunt)
    mine = mounted = state.mount_by_source(control.source)
    info = {**state.daemon_identity(), "workspace": ws, "state_dir": state_dir,
            "started": time.time_ns(), "durable": durable, "record_data": record_data,
            "owner": owning, "source": mine["source"] if mine else None}
    try:
        state.write_private(sd.daemon_json, json.dumps(info).encode())
    except OSError as e:
        # the state dir full (or read-only): without daemon.json no umount finds this daemon,
        # so the mount goes now, not left dead over the workspace
        log.error("cannot write %s: %s: unmounting", sd.daemon_json, e)
        tell(f"error: cannot write the state dir {state_dir}: {e.strerror or e}")
        try:
            pyfuse3.close(unmount=True)
        finally:
            journal.close()
            for path in (sd.daemon_json + ".tmp", sd.control_sock):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        return 1
    try:
        if registry:
            state.write_registry(ws, state_dir)
    except (state.StateError, OSError) as e:  # a convenience: --state-dir still finds it
        log.warning("registry entry not written: %s", e)
    # OVERLAYREC_BENCH_TIMES=FILE: a bench switch, as OVERLAYREC_BENCH_NORECORD: the
    # recorder's time by mutation and the daemon's CPU time while serving, one JSON line
    # appended to FILE at unmount (docs/bench.md)
    times_file = os.environ.get("OVERLAYREC_BENCH_TIMES")
    # OVERLAYREC_BENCH_STEPS=1 with it: the steps inside the mutations too (tools/bench-paired
    # --steps)
    times = time_mutations(recorder, os.environ.get("OVERLAYREC_BENCH_STEPS") == "1") \
        if times_file else None
    # OVERLAYREC_BENCH_PROFILE=PREFIX: another bench switch (tools/bench --profile)
    if os.environ.get("OVERLAYREC_BENCH_PROFILE"):
        _profile_on_signals(os.environ["OVERLAYREC_BENCH_PROFILE"])
    log.info("mounted %s (state dir %s)%s", ws, state_dir,
             "" if dircache.active else ", the kernel does not cache listings (dircache)")
    # what the start made (the imports' modules and classes, the mount's scan of the record)
    # lives as long as the daemon: kept out of the cycle collector's full passes, which would
    # otherwise walk all of it again each time (15-25 ms a pass, one in a `sed -i` over 1,500
    # files; docs/bench.md); its garbage goes first
    gc.collect()
    gc.freeze()
    control.where = lambda: _where(ws, mounted)
    try:
        # (a scan of /proc that asks no filesystem anything: safe before the mount is served;
        # the `run` that mounted for itself enters the workspace again through the mount)
        control.operations.beneath = bool(state.underlay_holders(
            ws, {os.getpid()} | ({owning["pid"]} if owning else set())))
    except Exception:  # not known: every open looks
        log.exception("looking for processes beneath the mount failed")
    tell("ready")
    os.umask(0)
    cpu0 = _cpu_seconds()
    try:
        trio.run(_serve, control, ws, owning, mounted)
    except BaseException:
        log.exception("serve loop failed")
        raise
    finally:
        if times is not None:  # serving only: not the unmount's sealing
            _write_times(times_file, recorder, times, _cpu_seconds() - cpu0)
        try:
            _unmount(ws, mounted, control.detached)
            try:
                recorder.room_to_record("seal")
                recorder.close_record()
            except JournalError as e:  # the state dir full: the record stays open
                log.error("sealing at unmount failed (the next mount recovers): %s", e)
            except Exception:
                log.exception("sealing at unmount failed (the next mount recovers)")
            else:
                if control.max_bytes is not None:
                    _keep_budget_at_end(control)
        finally:
            journal.close()
            for path in (sd.daemon_json, sd.control_sock):
                try:
                    os.unlink(path)
                except OSError:
                    pass
            log.info("unmounted %s", ws)
    return 0


def _unmount(ws: str, mount: dict | None, detached: bool) -> None:
    """End the FUSE session and lift the mount wherever it is now: libfuse unmounts the path
    it mounted, which a rename of a directory above the workspace made name nothing (the mount
    was left dead at its new path, the daemon saying "unmounted").  Detached: nothing is left
    to unmount (and a mount made anew at the path since must not be)."""
    where = state.mount_point_of(mount) if mount is not None and not detached else None
    if where is None or where == ws:
        pyfuse3.close(unmount=not detached)
        return
    moved = _detach(where)  # while the session still answers: a lazy unmount asks it nothing
    pyfuse3.close(unmount=False)
    if moved:
        log.info("the mount had moved to %s (a directory above %s renamed): unmounted there",
                 where, ws)
    else:
        log.error("cannot unmount the mount, moved to %s (a directory above %s renamed): "
                  "clear it with: overlayrec umount %s", where, ws, where)


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _profile_on_signals(prefix: str) -> None:
    """OVERLAYREC_BENCH_PROFILE=PREFIX, a bench switch: SIGUSR1 starts a profile of what the
    daemon spends its CPU on (cProfile timed by ``time.process_time``: what it waits for is not
    counted), SIGUSR2 stops it and writes ``PREFIX.N.pstats`` (N = 1, 2, ...: one a workload,
    tools/bench --profile).  Its per-call cost (two clock reads a call) weighs on code of many
    small calls: for shares between the daemon's layers, not for absolute times."""
    import cProfile
    held: dict = {"profile": None, "n": 0}

    def start(signum, frame) -> None:
        if held["profile"] is None:
            held["profile"] = cProfile.Profile(time.process_time)
            held["profile"].enable()

    def stop(signum, frame) -> None:
        prof, held["profile"] = held["profile"], None
        if prof is None:
            return
        prof.disable()
        held["n"] += 1
        try:
            prof.dump_stats(f"{prefix}.{held['n']}.pstats")
        except OSError as e:  # a bench's output, never a reason for the mount to fail
            log.warning("OVERLAYREC_BENCH_PROFILE: cannot write %s.%d.pstats: %s", prefix,
                        held["n"], e)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)


def _write_times(path: str, recorder, times: dict, cpu: float) -> None:
    """OVERLAYREC_BENCH_TIMES's line: never a reason for the unmount to fail."""
    line = {"recorder": type(recorder).__name__, "pid": os.getpid(), "cpu_s": cpu,
            "mutations": {k: {"calls": n, "seconds": t} for k, (n, t) in times.items() if n}}
    try:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
    except OSError as e:
        log.warning("OVERLAYREC_BENCH_TIMES: cannot write %s: %s", path, e)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="overlayrec-daemon")
    p.add_argument("--workspace", required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--foreground", action="store_true")
    p.add_argument("--durable", action="store_true")
    p.add_argument("--allow-other", action="store_true")
    p.add_argument("--record-data", action="store_true")
    p.add_argument("--secret", action="append", default=[])
    p.add_argument("--no-default-secrets", action="store_true")
    p.add_argument("--ready-fd", type=int)
    p.add_argument("--max-bytes", type=int)
    p.add_argument("--owner", type=int, help="the pid of the command that mounts for itself: "
                   "once it is gone, no session is live and nothing uses the mount, unmount")
    p.add_argument("--no-registry", action="store_true", help="a revert's own mount: the "
                   "registry keeps naming the record it named (a revert given --state-dir "
                   "pointed every reader at that one)")
    a = p.parse_args(argv)
    return run(a.workspace, a.state_dir, foreground=a.foreground, durable=a.durable,
               allow_other=a.allow_other, ready_fd=a.ready_fd, record_data=a.record_data,
               secret=tuple(a.secret), no_default_secrets=a.no_default_secrets,
               max_bytes=a.max_bytes, owner=a.owner, registry=not a.no_registry)


if __name__ == "__main__":
    sys.exit(main())
