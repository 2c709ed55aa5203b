"""`overlayrec run -- AGENT` behaves as the agent started without it would: the signals its
caller ignored, the signals sent to it, the descriptors and $PWD it passes on, the orphans it
adopts, its exit status (the agent's, 125 for its own failures, 126/127 for a command that
cannot run), a terminal that hangs up.  Each found by a bug hunt against the wrapper."""
from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time

from conftest import SLOW, is_mounted, needs_fuse, overlayrec, wait_unmounted

# execs argv[2:] with the signals named in argv[1] ("HUP,INT") ignored, or none ("-"), the
# others at their default (a test runner started in a script's background has SIGINT ignored)
IGNORING = """
import os, signal, sys
named = set(filter(None, sys.argv[1].strip("-").split(",")))
for name in ("HUP", "INT", "QUIT", "TERM", "USR1", "USR2"):
    signal.signal(getattr(signal, "SIG" + name),
                  signal.SIG_IGN if name in named else signal.SIG_DFL)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _run_argv(ws, sd, *cmd) -> list[str]:
    return [sys.executable, "-m", "overlayrec", "run", "-w", str(ws), "--state-dir", str(sd),
            "--", *cmd]


def _ignoring(tmp_path, names: str, argv: list[str]) -> list[str]:
    helper = tmp_path / "ignoring.py"
    helper.write_text(IGNORING)
    return [sys.executable, str(helper), names, *argv]


def _sig_ignored(status_line: str) -> int:
    return int(status_line.split()[-1], 16)


def _bit(sig: int) -> int:
    return 1 << (sig - 1)


def _wait_for(path, why: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit * SLOW
    while not os.path.exists(path):
        assert time.monotonic() < deadline, why
        time.sleep(0.05)


def _signalled(argv: list[str], started, sig: int, **kw) -> tuple[int, str]:
    """Start ``argv`` (a run), send it ``sig`` once its agent made ``started``: (its exit
    status, its stderr)."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    try:
        _wait_for(started, "the agent did not start")
        p.send_signal(sig)
        _, err = p.communicate(timeout=60 * SLOW)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, err


@needs_fuse
def test_the_signals_the_caller_ignored_stay_ignored_in_the_agent(tmp_path):
    """`nohup overlayrec run -- agent`: the agent was killed by the hangup (run set its own
    handlers, which exec resets to the default, and forwarded the SIGHUP); a script's
    `run ... &` lost the SIGINT and SIGQUIT a background job ignores."""
    ws, sd = tmp_path / "ws", tmp_path / "sd"
    ws.mkdir()
    agent = "grep SigIgn /proc/$$/status > ign; touch started; sleep 2; echo done > done"
    rc, err = _signalled(_ignoring(tmp_path, "HUP,INT,QUIT", _run_argv(ws, sd, "sh", "-c",
                                                                         agent)),
                         ws / "started", signal.SIGHUP)
    wait_unmounted(str(ws), "run's end")
    assert rc == 0, err
    assert (ws / "done").read_text() == "done\n"
    ignored = _sig_ignored((ws / "ign").read_text())
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT):
        assert ignored & _bit(sig), (sig, hex(ignored))


@needs_fuse
def test_a_signal_sent_to_run_alone_reaches_the_agent(tmp_path):
    """SIGINT sent to `run` itself (a supervisor's stop, not a terminal's Ctrl-C, which the
    agent gets too) was dropped, the agent running on; SIGUSR1 ended run alone, the agent
    left running."""
    ws, sd = tmp_path / "ws", tmp_path / "sd"
    ws.mkdir()
    agent = "touch started; i=0; while [ $i -lt 300 ]; do i=$((i+1)); sleep 0.1; done; " \
            "touch finished"
    for sig in (signal.SIGINT, signal.SIGUSR1):
        for name in ("started", "finished"):
            if (ws / name).exists():
                (ws / name).unlink()
        # with SIGINT at its default (a test runner may have it ignored), and no terminal
        rc, err = _signalled(_ignoring(tmp_path, "-", _run_argv(ws, sd, "sh", "-c", agent)),
                             ws / "started", sig, start_new_session=True)
        wait_unmounted(str(ws), "run's end")
        assert rc == 128 + sig, (sig, rc, err)
        assert not (ws / "finished").exists(), sig


@needs_fuse
def test_run_ends_when_its_agent_died_while_it_was_stopped(tmp_path):
    """run stopped (Ctrl-Z) while its agent dies, then a SIGTERM and a SIGCONT (a stopped
    job's `kill %1`): the forwarding reaped the dead agent (Popen.send_signal polls), and
    the wait for it went on to wait for the daemon, which waited for run: a hang, the mount
    kept (found by a bug hunt)."""
    ws, sd = tmp_path / "ws", tmp_path / "sd"
    ws.mkdir()
    p = subprocess.Popen(_run_argv(ws, sd, "sh", "-c", "touch started; exec sleep 300"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(ws / "started", "the agent did not start")
        agent = int(subprocess.run(["pgrep", "-P", str(p.pid), "-x", "sleep"],
                                   capture_output=True, text=True).stdout.split()[0])
        p.send_signal(signal.SIGSTOP)
        os.kill(agent, signal.SIGKILL)
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        p.send_signal(signal.SIGCONT)
        _, err = p.communicate(timeout=30 * SLOW)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    wait_unmounted(str(ws), "run's end")
    assert p.returncode == 128 + signal.SIGKILL, (p.returncode, err)


@needs_fuse
def test_the_agent_has_the_callers_descriptors_and_its_own_pwd(tmp_path):
    """The caller's descriptors past 2 were closed (`3>log`: EBADF; make's jobserver lost),
    and $PWD named the caller's directory, not the workspace the agent starts in: a
    Makefile's $(PWD) wrote outside the workspace, unrecorded."""
    ws, sd = tmp_path / "ws", tmp_path / "sd"
    ws.mkdir()
    log = tmp_path / "fd3.log"
    # a shell's `3>>log` for run, started outside the workspace
    r = subprocess.run(["sh", "-c", 'exec "$@" 3>>fd3.log', "sh",
                        *_run_argv(ws, sd, "sh", "-c", 'echo via-run >&3 && echo "$PWD" > '
                                   '"$PWD/pwd"')],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60 * SLOW)
    assert r.returncode == 0, r.stderr
    assert log.read_text() == "via-run\n"
    assert (ws / "pwd").read_text() == f"{ws}\n"
    assert "pwd" in overlayrec("log", str(ws), "--state-dir", str(sd)).stdout


@needs_fuse
def test_the_orphans_run_adopts_are_reaped_while_the_agent_runs(tmp_path):
    """`run` is the agent's child subreaper: the orphans it adopted stayed zombies, a pid
    each, until the agent ended."""
    ws, sd = tmp_path / "ws", tmp_path / "sd"
    ws.mkdir()
    agent = 'for i in 1 2 3 4 5 6 7 8 9 10; do sh -c "(true) &"; done; sleep 1; ' \
            'ps -o stat= --ppid $PPID > kids'
    overlayrec("run", "-w", str(ws), "--state-dir", str(sd), "--", "sh", "-c", agent,
               timeout=60)
    kids = (ws / "kids").read_text().split()
    assert not [k for k in kids if k.startswith("Z")], kids


@needs_fuse
def test_a_command_that_cannot_run_begins_no_session_and_run_fails_apart(tmp_path):
    """A typo's `run --session fix` recorded a session fix with nothing in it, and the retry
    with the right command went to fix.2: `diff --session fix` showed the empty one.  And
    `run`'s own failures exited 1, an agent's failure: now 125, as env's and timeout's."""
    ws, sd = tmp_path / "ws", tmp_path / "sd"
    ws.mkdir()
    r = overlayrec("run", "-w", str(ws), "--state-dir", str(sd), "--session", "fix", "--",
                   "no-such-agent-here", check=False)
    assert r.returncode == 127 and "no-such-agent-here: No such file" in r.stderr, r.stderr
    overlayrec("run", "-w", str(ws), "--state-dir", str(sd), "--session", "fix", "--",
               "sh", "-c", "echo x > x")
    out = overlayrec("diff", str(ws), "--state-dir", str(sd), "--session", "fix",
                     "--name-status").stdout
    assert out.split() == ["A", "x"], out
    for args in (["-w", str(tmp_path / "missing")], ["-w", str(ws), "--state-dir",
                                                    str(ws / "st")]):
        r = overlayrec("run", *args, "--", "true", check=False)
        assert r.returncode == 125 and r.stderr.startswith("overlayrec: error:"), r.stderr
        assert "readers read that one" not in r.stderr, r.stderr
    assert overlayrec("run", "-w", str(ws), "--state-dir", str(sd), "--", "false",
                      check=False).returncode == 1


@needs_fuse
def test_a_run_joining_a_mount_says_which_options_it_cannot_apply(tmp_path):
    """--state-dir, --record-data and --max-bytes given to a run that joins a mount were
    ignored without a word (the session went into the mount's record, the state dir named
    was never made)."""
    ws, sd = tmp_path / "ws", tmp_path / "sd"
    ws.mkdir()
    first = subprocess.Popen(_run_argv(ws, sd, "sh", "-c", "touch started; sleep 3"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(ws / "started", "the first run's agent did not start")
        r = overlayrec("run", "-w", str(ws), "--state-dir", str(tmp_path / "mine"),
                       "--record-data", "--max-bytes", "1M", "--", "true")
        assert "--state-dir, --record-data, --max-bytes apply at mount only" in r.stderr, \
            r.stderr
        r = overlayrec("run", "-w", str(ws), "--state-dir", str(sd), "--", "true")
        assert "warning" not in r.stderr, r.stderr
    finally:
        first.communicate(timeout=60 * SLOW)
    wait_unmounted(str(ws), "run's end")


@needs_fuse
def test_a_terminal_that_hangs_up_leaves_the_agents_status(tmp_path):
    """The terminal closed under an agent that takes SIGHUP and exits 0: run's summary to
    the hung-up terminal failed (EIO), and run exited 1 before its end checks."""
    ws, sd = tmp_path / "ws", tmp_path / "sd"
    ws.mkdir()
    agent = 'trap "echo bye > bye; exit 0" HUP; touch started; while :; do sleep 0.1; done'
    pid, fd = pty.fork()
    if pid == 0:  # the child: run on the terminal, its session's leader
        try:
            os.execvp(sys.executable, _run_argv(ws, sd, "bash", "-c", agent))
        finally:
            os._exit(99)
    try:
        deadline = time.monotonic() + 60 * SLOW
        while not (ws / "started").exists():
            assert time.monotonic() < deadline, "the agent did not start"
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    os.read(fd, 4096)
                except OSError:
                    break
        os.close(fd)  # the terminal goes away: SIGHUP to its session
        _, status = os.waitpid(pid, 0)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    wait_unmounted(str(ws), "run's end")
    assert os.waitstatus_to_exitcode(status) == 0
    assert (ws / "bye").read_text() == "bye\n"
    assert not is_mounted(str(ws))


def test_a_sigterm_taken_as_ctrl_c_exits_as_a_sigterm_does():
    """SIGTERM (or SIGHUP) reaching a command before its own handling (main takes it as
    Ctrl-C) said "interrupted" with 130, SIGINT's status: `run` stopped in its first tenth of
    a second exited so, a little later with 143."""
    import click
    from click.testing import CliRunner

    from overlayrec import cli

    @click.group(cls=cli._Main)
    def group():
        pass

    @group.command()
    @click.argument("signum", type=int)
    def stop(signum):
        cli._terminated(signum, None)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        r = CliRunner().invoke(group, ["stop", str(int(sig))])
        assert r.exit_code == 128 + sig and "interrupted" in r.output, (sig, r.output)
