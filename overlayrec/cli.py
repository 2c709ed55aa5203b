"""The command line: click commands, human and --json output, errors as one line and an exit code.

Exit codes: 0 success, 1 a failure the message explains, 2 bad usage (click's own).
"""
from __future__ import annotations

import fnmatch
import json
import os
import signal
import subprocess
import sys
import time

import click

from . import state
from .journal import Journal, JournalError
from .state import StateError


class Fail(click.ClickException):
    """A one-line error and exit 1."""

    def show(self, file=None):
        click.echo(f"overlayrec: error: {self.format_message()}", err=True)


def _guard(fn):
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except (StateError, JournalError) as e:
            raise Fail(str(e)) from None
        except OSError as e:
            raise Fail(f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}") from None
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="overlayrec")
def main():
    """overlayrec records everything that happens to a workspace.

    A FUSE passthrough mounted over the workspace itself sees every write from every process,
    journals the pre-image of each change before it lands, and names the process that made it.
    """
    # a closed pipe (`overlayrec log | head`) ends output quietly, as for any Unix tool
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def _state_dir_for(ws: str, state_dir: str | None) -> str:
    """The state dir a reading command looks at: the one named, or the workspace's."""
    return os.path.realpath(state_dir) if state_dir else state.find_state_dir(ws)


@main.command()
@click.argument("workspace", type=click.Path())
@click.option("--state-dir", type=click.Path(),
              help="Where the journal lives (default: $XDG_STATE_HOME/overlayrec/<id>).")
@click.option("--foreground", is_flag=True, help="Serve in this process until unmounted.")
@click.option("--allow-other", is_flag=True,
              help="Let other users in (FUSE allow_other; permissions checked by the kernel).")
@click.option("--durable", is_flag=True,
              help="fsync every journal commit, so it also survives power loss.")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for the mount.")
@_guard
def mount(workspace, state_dir, foreground, allow_other, durable, timeout):
    """Mount the recorder over WORKSPACE itself.

    Every path into the workspace keeps working; from now on each change made through it is
    journaled.  Returns once the mount is ready (or says why it failed), unless --foreground.
    """
    ws = state.resolve_workspace(workspace)
    if state.is_dead_mount(ws):
        raise Fail(f"{ws} holds a dead mount; clear it with: overlayrec umount {ws}")
    if state.fuse_mount_at(ws):
        raise Fail(f"{ws} is already mounted")
    sd = state.check_state_dir(ws, state_dir or state.default_state_dir(ws))
    os.makedirs(sd, mode=0o700, exist_ok=True)
    if foreground:
        from . import daemon
        sys.exit(daemon.run(ws, sd, foreground=True, durable=durable, allow_other=allow_other,
                            ready_fd=None))
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "overlayrec.daemon", "--workspace", ws, "--state-dir", sd,
           "--ready-fd", str(w)]
    if durable:
        cmd.append("--durable")
    if allow_other:
        cmd.append("--allow-other")
    with open(os.devnull, "rb") as devnull, open(os.path.join(sd, "daemon.log"), "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=devnull, stdout=logf, stderr=logf, pass_fds=(w,),
                                start_new_session=True, cwd="/")
    os.close(w)
    msg = _read_ready(r, proc, timeout)
    if msg != "ready":
        raise Fail(msg.removeprefix("error: ") if msg else
                   f"daemon exited without mounting (see {os.path.join(sd, 'daemon.log')})")
    click.echo(f"mounted {ws} (daemon pid {proc.pid}, journal {os.path.join(sd, 'journal')})")


def _read_ready(fd: int, proc: subprocess.Popen, timeout: float) -> str:
    import select
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


def _unmount_now(ws: str) -> None:
    r = subprocess.run(["fusermount3", "-u", "-z", ws], capture_output=True, text=True)
    if r.returncode != 0 and (state.fuse_mount_at(ws) or state.is_dead_mount(ws)):
        r2 = subprocess.run(["umount", "-l", ws], capture_output=True, text=True)
        if r2.returncode != 0:
            raise Fail(f"cannot unmount {ws}: {(r.stderr or r2.stderr).strip()}")


@main.command()
@click.argument("workspace", type=click.Path())
@click.option("--timeout", default=20.0, show_default=True,
              help="Seconds to wait for the daemon to finish before detaching the mount.")
@_guard
def umount(workspace, timeout):
    """Unmount WORKSPACE: stop its daemon cleanly, or clear a dead mount."""
    ws = state.resolve_workspace(workspace, must_exist=False)
    dead = state.is_dead_mount(ws)
    mounted = state.fuse_mount_at(ws)
    sd = state.find_state_dir(ws)
    info = state.daemon_info(sd)
    pid = info["pid"] if info and state.pid_alive(info["pid"]) else None
    if not mounted and not dead:
        if pid:
            os.kill(pid, signal.SIGTERM)
        raise Fail(f"{ws} is not mounted")
    if pid and not dead:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and state.pid_alive(pid):
            time.sleep(0.05)
    if state.fuse_mount_at(ws) or state.is_dead_mount(ws):
        _unmount_now(ws)
        if pid and state.pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
    click.echo(f"unmounted {ws}" + (" (cleared a dead mount)" if dead else ""))


@main.command()
@click.argument("workspace", type=click.Path(), default=".")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@_guard
def status(workspace, as_json):
    """Say whether WORKSPACE is mounted, by which daemon, where its journal is and how much it holds."""
    ws = state.resolve_workspace(workspace, must_exist=False)
    sd = state.find_state_dir(ws)
    info = state.daemon_info(sd)
    pid = info["pid"] if info and state.pid_alive(info["pid"]) else None
    dead = state.is_dead_mount(ws)
    mounted = bool(state.fuse_mount_at(ws)) and not dead
    events = None
    journal_path = os.path.join(sd, "journal")
    if os.path.exists(os.path.join(journal_path, "data.mdb")):
        j = Journal(sd, readonly=True)
        try:
            events = j.count()
        finally:
            j.close()
    out = {"workspace": ws, "mounted": mounted, "dead_mount": dead, "daemon_pid": pid,
           "state_dir": sd, "journal": journal_path if events is not None else None,
           "events": events}
    if as_json:
        click.echo(json.dumps(out))
        return
    if dead:
        click.echo(f"{ws}: dead mount (clear it with: overlayrec umount {ws})")
    elif mounted:
        click.echo(f"{ws}: mounted by daemon pid {pid}" if pid else f"{ws}: mounted")
    else:
        click.echo(f"{ws}: not mounted")
    click.echo(f"  journal: {journal_path if events is not None else '(none yet)'}")
    if events is not None:
        click.echo(f"  events:  {events}")


def _command_name(actor: dict | None) -> str:
    if not actor:
        return "?"
    if actor.get("argv"):
        return os.path.basename(actor["argv"][0])
    return os.path.basename(actor.get("exe") or "?")


def _fmt_time(ns: int) -> str:
    t = ns / 1e9
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(ns % 10**9 / 1e6):03d}"


@main.command(name="log")
@click.argument("workspace", type=click.Path(), default=".")
@click.option("--path", "glob", help="Only events on paths matching this glob (either side of a rename).")
@click.option("--limit", type=click.IntRange(min=1), help="Only the last N events.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--state-dir", type=click.Path(), help="Read this state dir.")
@_guard
def log_cmd(workspace, glob, limit, as_json, state_dir):
    """The recorded events, newest last: time, actor (pid and command), operation and path."""
    ws = state.resolve_workspace(workspace, must_exist=False)
    sd = _state_dir_for(ws, state_dir)
    j = Journal(sd, readonly=True)
    try:
        failed = {}
        rows = []
        for ev in j.events():
            if ev["op"] == "failed":
                failed[ev["ref"]] = ev.get("errno")
                continue
            if glob and not any(p is not None and fnmatch.fnmatchcase(p, glob)
                                for p in (ev.get("path"), ev.get("path2"))):
                continue
            rows.append(ev)
        if limit:
            rows = rows[-limit:]
        actors: dict[str, dict | None] = {}
        for ev in rows:
            key = ev.get("actor")
            if key not in actors:
                actors[key] = j.actor(key) if key else None
            a = actors[key]
            if ev["seq"] in failed:
                ev["failed_errno"] = failed[ev["seq"]]
            if as_json:
                ev = dict(ev, actor=a or {"key": key})
                click.echo(json.dumps(ev, ensure_ascii=False))
                continue
            where = ev.get("path") or "."
            if ev.get("path2") is not None:
                where += f" -> {ev['path2']}"
            note = f"  (failed: {os.strerror(ev['failed_errno'])})" if "failed_errno" in ev else ""
            click.echo(f"{ev['seq']:>6} {_fmt_time(ev['t'])} {a['pid'] if a else '?':>7} "
                       f"{_command_name(a):<12.12} {ev['op']:<11} {where}{note}")
    finally:
        j.close()


if __name__ == "__main__":
    main()
