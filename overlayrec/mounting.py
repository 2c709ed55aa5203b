"""A command's side of a mount: start a workspace's daemon and wait until it serves, stop it,
and lift a mount whose daemon is gone or hung.

The daemon itself (``daemon.py``) lives in its own process, since pyfuse3 serves one mount per
process; ``mount``, ``run``, ``umount`` and a revert of an unmounted workspace start and stop it
through here.  Nothing here prints: a refusal is a ``MountError`` (one line, for the command to
show), and what a command should warn of is returned.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time

from . import state

SOCKET_PATH_MAX = 107  # sockaddr_un.sun_path: 108 bytes with its NUL


class MountError(state.StateError):
    """A mount refused or failed: the message is the one line the user reads (a StateError:
    every command shows one as its error line)."""


def refuse_nested(ws: str) -> None:
    """A mount inside another overlayrec mount, or over one, would record its changes twice,
    the outer record blaming the inner daemon for all of them (an outside process), or the
    inner one the outer: refused."""
    outer = state.overlayrec_mount_containing(ws)
    if outer is not None and outer != ws:
        raise MountError(f"{ws} is inside the overlayrec mount {outer}, which records it "
                         "already")
    # and the other way: the inner record would blame this daemon for every change made
    # through the new mount beneath it (the daemon writes there, not the process)
    inner = state.overlayrec_mounts_beneath(ws)
    if inner:
        raise MountError(f"{ws} holds the overlayrec mount {inner[0]}, which records that part "
                         f"of it already: unmount it first (overlayrec umount {inner[0]})")


def spawn(ws: str, sd: str, *, durable=False, allow_other=False, timeout=30.0,
          record_data=False, secret=(), no_default_secrets=False, max_bytes=None,
          for_this=False, registry=True) -> tuple[int, list[str]]:
    """Start the daemon in its own process and wait until the mount is ready: its pid, and
    what its open of the journal kept aside of the log ahead (``kept_aside``: bytes after the
    last whole record, a crash's torn write or damage; only its log says so otherwise).

    ``for_this``: the mount is this command's (run, a revert of an unmounted workspace), and
    goes once the command is gone even if it was killed where it could not unmount (the
    daemon's ``--owner``)."""
    refuse_nested(ws)  # mount, run and a revert's own mount alike
    sock = os.path.join(sd, "control.sock")
    if len(os.fsencode(sock)) > SOCKET_PATH_MAX:
        # the hooks reach the daemon by this path (nc -U, the client): it must fit as it is
        raise MountError(f"the state dir's path is too long for its control socket "
                         f"({len(os.fsencode(sock))} bytes with /control.sock; a unix "
                         f"socket's path holds {SOCKET_PATH_MAX}): use --state-dir (or "
                         f"XDG_STATE_HOME) with a shorter path")
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "overlayrec.daemon", "--workspace", ws, "--state-dir", sd,
           "--ready-fd", str(w)]
    if durable:
        cmd.append("--durable")
    if allow_other:
        cmd.append("--allow-other")
    if record_data:
        cmd.append("--record-data")
    cmd += [f"--secret={p}" for p in secret]  # "=": a pattern may begin with "-"
    if no_default_secrets:
        cmd.append("--no-default-secrets")
    if max_bytes is not None:
        cmd.append(f"--max-bytes={max_bytes}")
    if for_this:
        cmd.append(f"--owner={os.getpid()}")
    if not registry:
        cmd.append("--no-registry")
    if (state.daemon_info(sd) or {}).get("workspace") == ws and not wait_previous(sd, 0.5):
        # the last mount's daemon serves a process that held its detached mount as it ended:
        # the new one waits for the journal (up to 20 s); said, not a silent pause
        sys.stderr.write("overlayrec: the workspace's last mount is still ending (a process "
                         "held it as it ended): waiting for its daemon\n")
    log_fd = state.open_private(state.StateDir(sd).daemon_log,
                                os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    started = time.time_ns()
    with open(os.devnull, "rb") as devnull, os.fdopen(log_fd, "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=devnull, stdout=logf, stderr=logf, pass_fds=(w,),
                                start_new_session=True, cwd="/")
    os.close(w)
    msg = _read_ready(r, proc, timeout)
    if msg != "ready":
        raise MountError(msg.removeprefix("error: ") if msg else
                         f"daemon exited without mounting (see "
                         f"{os.path.join(sd, 'daemon.log')})")
    from .journal.ahead import kept_aside
    aside = [path for path, when in kept_aside(os.path.join(sd, "journal")) if when >= started]
    return proc.pid, aside


def _read_ready(fd: int, proc: subprocess.Popen, timeout: float) -> str:
    """The daemon's one line on its ready pipe: "ready", or why it did not mount."""
    buf = b""
    deadline = time.monotonic() + timeout
    try:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                proc.terminate()
                return f"timed out after {timeout:g}s waiting for the mount"
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                buf += chunk
    finally:
        os.close(fd)
    return buf.decode(errors="replace").strip()


def daemon_pid(sd: str) -> tuple[int | None, dict | None, str | None]:
    """The state dir's daemon pid, verified before anything signals it (state.verify_daemon),
    daemon.json's record, and why a live pid it names failed the check (for a warning)."""
    info = state.daemon_info(sd)
    pid, why = state.verify_daemon(info, sd)
    return pid, info, why


def stop(ws: str) -> str | None:
    """Stop the daemon of ``ws`` (SIGTERM: it unmounts, seals and closes) and lift the mount if
    it stays (a dead or hung daemon's); why the daemon's pid was not signalled, if it was not."""
    sd = state.find_state_dir(ws)
    mount = mount_of(ws, sd)
    pid, _, why = daemon_pid(sd)
    if pid:
        os.kill(pid, signal.SIGTERM)
        wait_gone(pid, 20)
    lift_if_left(ws, sd, mount)
    return why


def wait_previous(sd: str, timeout: float = 30.0) -> bool:
    """Wait for the process daemon.json names (its pid and start time: the same process,
    whatever verify_daemon says of it once it has closed the journal) to be gone; whether it
    is.  A daemon ending after its mount is gone still seals, closes the journal and unlinks
    its socket and daemon.json: one started meanwhile wrote the journal beside it, and lost
    its socket to the old one's last unlink."""
    named = _named_daemon(sd)
    if not _running(named):
        return True  # gone (a zombie not reaped yet counts), or its pid another's since
    wait_gone(named[0], timeout)
    return not _running(named)


def wait_released(ws: str, sd: str, timeout: float = 20.0, made: dict | None = None) -> None:
    """Wait for a daemon that is ending its mount (released, or stopped by another command)
    to be gone, and lift the mount if it stays (a hung daemon's).  ``made``: the mount as
    this command made it (mount_of then): a mount at ``ws`` of another source is not it (a
    workspace moved, another mounted since at its old path: a `run`'s end lifted it)."""
    mount = mount_of(ws, sd)
    if mount is not None and made is not None and mount["source"] != made["source"]:
        mount = None
    wait_previous(sd, timeout)
    lift_if_left(ws, sd, mount)


def mount_of(ws: str, sd: str) -> dict | None:
    """The mount at ``ws`` (state.fuse_mount_at) and the daemon daemon.json names for it then
    (pid and start time), as lift_if_left tells it from a mount made anew; None when what is
    mounted there is not that daemon's (its source, which daemon.json keeps): a `run` whose
    workspace had moved (a directory above it renamed) took another workspace's mount, made
    since at its old path, for its own and lifted it (found by a bug hunt; once daemon.json is
    gone, wait_released compares with the mount the command made)."""
    mount = state.fuse_mount_at(ws)
    if mount is None:
        return None
    info = state.daemon_info(sd) or {}
    if info.get("source") not in (None, mount["source"]):
        return None  # (none, or without a source: not written yet, or an older daemon's)
    return dict(mount, daemon=_named_daemon(sd))


def _named_daemon(sd: str) -> tuple[int, object] | None:
    """(pid, start ticks) of the daemon daemon.json names, whether it runs or not."""
    info = state.daemon_info(sd) or {}
    pid = info.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return None
    return pid, info.get("start_ticks")


def _running(named: tuple | None) -> bool:
    """Is that process still running (not exited, no zombie, not a later one given its pid)?"""
    from .attribution import alive
    return named is not None and alive(f"{named[0]}:{named[1]}")


def _serving_another(sd: str, mount: dict) -> bool:
    """Does a daemon other than the one ``mount`` was taken with run for ``sd`` now (a mount
    made anew, whose id may be the old one's: the kernel hands a freed mount id out again)?"""
    named = _named_daemon(sd)
    return named != mount.get("daemon") and _running(named)


def lift_if_left(ws: str, sd: str, mount: dict | None) -> None:
    """Lift ``mount`` (state.fuse_mount_at, taken before its daemon was stopped) if it is still
    at ``ws`` once the daemon is gone (a hung or dead daemon's); not a mount made anew there
    since (a `run` that was told the old one was ending), nor while one is being made."""
    if mount is None:
        return
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(one_mounter(sd))
        except OSError:  # no state dir of ours there (a dead mount's): nothing mounts by it
            pass
        now = state.fuse_mount_at(ws)
        # the same id is not enough: a run told the old mount was ending mounted anew, got
        # the freed id, and the stopping command lifted its mount under its agent (whose
        # writes then went to the directory beneath, unrecorded; CI at b74a836)
        if now is not None and now["id"] == mount["id"] and not _serving_another(sd, mount):
            unmount_now(ws)


def left_behind(ws: str, sd: str, mount: dict | None) -> str | None:
    """Once the daemon of ``mount`` (mount_of, taken when it was made) is gone: lift that mount
    if it is still there under another path (a directory above the workspace renamed while it
    was mounted: nothing at ``ws`` any more), and say in one line if it could not be; None when
    nothing is left.  A daemon still serving it (a session, a process working there) keeps it."""
    if mount is None or _running(mount.get("daemon")):
        return None
    where = state.mount_point_of(mount)
    if where is None or where == ws:
        return None  # gone, or at its own path: lift_if_left's
    try:
        unmount_now(where)
    except MountError as e:
        return (f"the mount of {ws} moved to {where} (a directory above it renamed) and was "
                f"left there: {e}; clear it with: overlayrec umount {where}")
    return None


def end_daemon(pid: int, info: dict | None, timeout: float) -> bool:
    """SIGTERM to a verified daemon pid, and SIGKILL if it has not gone within ``timeout``
    (hung: what it journaled is safe, written ahead); whether it had to be killed."""
    os.kill(pid, signal.SIGTERM)
    # the same process still (not a later one given its pid) before it is killed
    if not wait_gone(pid, timeout) and \
            state.proc_start_ticks(pid) == (info or {}).get("start_ticks"):
        os.kill(pid, signal.SIGKILL)
        wait_gone(pid, 5)
        return True
    return False


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not state.pid_alive(pid):
            return True
        time.sleep(0.05)
    return not state.pid_alive(pid)


def unmount_now(ws: str) -> None:
    """Detach the mount at ``ws`` lazily (fusermount3, else umount): nothing here touches the
    mounted path, so a hung daemon cannot hang the caller."""
    err = _detach(["fusermount3", "-u", "-z", ws])
    if err is not None and state.fuse_mount_at(ws):
        err2 = _detach(["umount", "-l", ws])
        if err2 is not None:
            raise MountError(f"cannot unmount {ws}: {err or err2}")


def _detach(cmd: list[str], timeout: float = 15.0) -> str | None:
    """Run a lazy-unmount command; None on success, else why not.  A helper stuck in the
    kernel is left behind rather than waited for: umount must come back."""
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        return f"{cmd[0]}: {e.strerror}"
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        return f"{cmd[0]} did not finish in {timeout:.0f} s"
    return None if p.returncode == 0 else (err.strip() or f"{cmd[0]} exited with {p.returncode}")


MOUNT_LOCK = "mount.lock"


@contextlib.contextmanager
def mounting_now(sd: str, timeout: float):
    """The mount lock (one_mounter's), waited for at most ``timeout`` seconds: yields whether
    it was taken (no command between its look and its mount being served, then)."""
    import fcntl
    try:
        fd = os.open(os.path.join(sd, MOUNT_LOCK), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        yield True  # (no lock file: nothing ever mounted by this state dir)
        return
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.05)
        yield True
    finally:
        os.close(fd)


@contextlib.contextmanager
def one_mounter(sd: str):
    """Held by a command from its look at whether the workspace is mounted to its mount being
    served: another one (two `run`s started together) waits, then finds the mount and joins
    it."""
    import fcntl
    fd = os.open(os.path.join(sd, MOUNT_LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW |
                 os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
