"""The daemon: one mount's lifecycle.

Opens the underlay root fd *before* mounting (afterwards the path is the mount), opens the
journal, mounts with pyfuse3, serves until unmounted or signalled (SIGINT/SIGTERM unmount
cleanly), then closes.  Run as ``python -m overlayrec.daemon``; ``overlayrec mount`` starts it in
its own process (pyfuse3 serves one mount per process) and waits on a pipe for "ready" or the
reason it failed.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import signal
import sys
import time

import pyfuse3
import trio

from .attribution import Attribution
from .calls import Calls
from .control import ControlServer
from .fs import Operations
from .journal import Journal, JournalError
from .recorder import Recorder
from . import state

log = logging.getLogger("overlayrec")


class MountError(Exception):
    pass


def _raise_fd_limit() -> None:
    """Raise the soft fd limit to the hard one (the inode table keeps O_PATH fds up to half of
    it, fs.Operations._trim).  OVERLAYREC_FD_LIMIT=N, a test and bench knob, sets the soft limit
    to N instead (at most the hard limit, at least 128) to see the daemon under a small one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard
    knob = os.environ.get("OVERLAYREC_FD_LIMIT", "").strip()
    if knob.isdigit():
        want = max(128, int(knob))
        if hard != resource.RLIM_INFINITY:
            want = min(want, hard)
    if want != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _setup_logging(state_dir: str, foreground: bool) -> None:
    path = state.StateDir(state_dir).daemon_log
    os.close(state.open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND))  # 0600
    handlers: list[logging.Handler] = [logging.FileHandler(path)]
    if foreground:
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")


async def _serve(control: ControlServer) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(control.serve)
        async def on_signal():
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as sigs:
                async for signum in sigs:
                    log.info("signal %d: unmounting", signum)
                    pyfuse3.terminate()
                    return
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
        # every handler runs to completion without awaiting, so more worker tasks cannot overlap
        # anything: one reader saves the task spawning and read-lock traffic per request
        # (tools/bench: grep and cat-all about 15% faster)
        await pyfuse3.main(min_tasks=1, max_tasks=1)
        nursery.cancel_scope.cancel()


def prepare(ws: str, state_dir: str, durable: bool, allow_other: bool, record_data: bool = False):
    """Everything up to and including the mount; raises MountError with a one-line reason."""
    if state.fuse_mount_at(ws) is not None or state.is_dead_mount(ws):
        if state.is_dead_mount(ws):
            raise MountError(f"{ws} holds a dead mount; clear it with: overlayrec umount {ws}")
        raise MountError(f"{ws} is already mounted")
    try:
        journal = Journal(state_dir, durable=durable, workspace=ws)
    except JournalError as e:
        raise MountError(str(e)) from None
    recorded = journal.meta("workspace")
    if recorded and recorded != ws:
        raise MountError(f"state dir {state_dir} records workspace {recorded}, not {ws}")
    root_fd = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    attribution = Attribution()
    calls = Calls(journal, attribution)
    recorder = Recorder(journal, root_fd, attribution, units=calls, record_data=record_data)
    try:
        found = recorder.open_record()  # before the mount: nothing can change the tree meanwhile
    except (OSError, JournalError) as e:
        raise MountError(f"cannot check the workspace against the record: {e}") from None
    if found["drifted"] or found["recovered"]:
        log.info("record opened: %s", found)
    calls.on_unit_end = recorder.seal  # a unit's end ends its epochs: seal what they left
    calls.on_boundary = recorder.end_epochs  # every unit boundary ends every epoch
    control = ControlServer(state.StateDir(state_dir).control_sock, calls, attribution,
                            os.fstat(root_fd).st_uid, root_fd)
    control.bind()
    ops = Operations(recorder, root_fd, fault_name=os.environ.get("OVERLAYREC_INJECT_FAULT"))
    options = set(pyfuse3.default_options) | {f"fsname={state.FSNAME}", f"subtype={state.FSNAME}"}
    if allow_other:
        options.add("allow_other")
    try:
        pyfuse3.init(ops, ws, options)
    except RuntimeError as e:
        raise MountError(f"cannot mount {ws}: {e}") from None
    return journal, control, recorder


def run(ws: str, state_dir: str, *, foreground: bool, durable: bool, allow_other: bool,
        ready_fd: int | None, record_data: bool = False) -> int:
    # what the daemon makes for itself is the user's alone whatever the caller's umask
    # (docs/storage.md; LMDB's files take their mode from it); the umask drops to 0 only to
    # serve, where the kernel has applied the caller's umask to each request already
    os.umask(0o077)
    started = time.time_ns()
    _raise_fd_limit()
    sd = state.StateDir(state_dir)

    def tell(msg: str) -> None:
        if ready_fd is not None:
            os.write(ready_fd, msg.encode() + b"\n")
            os.close(ready_fd)

    try:  # the CLI checked too; the daemon can be started on its own
        state.make_state_dir(state.check_state_dir(ws, state_dir))
    except (state.StateError, OSError) as e:
        tell(f"error: {e}")
        return 1
    _setup_logging(state_dir, foreground)

    try:
        journal, control, recorder = prepare(ws, state_dir, durable, allow_other, record_data)
    except MountError as e:
        log.error("%s", e)
        tell(f"error: {e}")
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
    info = {**state.daemon_identity(), "workspace": ws, "state_dir": state_dir,
            "started": time.time_ns(), "durable": durable, "record_data": record_data}
    state.write_private(sd.daemon_json, json.dumps(info).encode())
    try:
        state.write_registry(ws, state_dir)
    except (state.StateError, OSError) as e:  # a convenience: --state-dir still finds it
        log.warning("registry entry not written: %s", e)
    log.info("mounted %s (state dir %s)", ws, state_dir)
    tell("ready")
    os.umask(0)
    try:
        trio.run(_serve, control)
    except BaseException:
        log.exception("serve loop failed")
        raise
    finally:
        try:
            pyfuse3.close(unmount=True)
            try:
                recorder.close_record()
            except JournalError as e:  # the state dir full: the record stays open
                log.error("sealing at unmount failed (the next mount recovers): %s", e)
            except Exception:
                log.exception("sealing at unmount failed (the next mount recovers)")
        finally:
            journal.close()
            for path in (sd.daemon_json, sd.control_sock):
                try:
                    os.unlink(path)
                except OSError:
                    pass
            log.info("unmounted %s", ws)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="overlayrec-daemon")
    p.add_argument("--workspace", required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--foreground", action="store_true")
    p.add_argument("--durable", action="store_true")
    p.add_argument("--allow-other", action="store_true")
    p.add_argument("--record-data", action="store_true")
    p.add_argument("--ready-fd", type=int)
    a = p.parse_args(argv)
    return run(a.workspace, a.state_dir, foreground=a.foreground, durable=a.durable,
               allow_other=a.allow_other, ready_fd=a.ready_fd, record_data=a.record_data)


if __name__ == "__main__":
    sys.exit(main())
