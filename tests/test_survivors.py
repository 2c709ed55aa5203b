"""Processes a call leaves running: a `cmd &` that outlives its call, its session and the `run`
that started it.  Its later writes stay its call's (also when it started in the clock tick its
call ended and the next began), `run` does not unmount under it, and a revert of its call
says it still runs."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import SLOW, force_unmount, is_mounted, needs_fuse, overlayrec, wait_unmounted

pytestmark = needs_fuse

AGENT = textwrap.dedent(r'''
    import subprocess, sys
    from overlayrec import client
    go, done = sys.argv[1], sys.argv[2]  # markers outside the workspace
    with client.connect() as c:
        c.turn_begin(prompt="start a writer and go on")
        c.call_begin("c1", "Bash", summary="start a writer")
        # the subshell outlives the bash that started it at once: an orphan the runner adopts,
        # started in the tick c1 ends (and, most often, c2 begins)
        subprocess.run(["bash", "-c", "echo first > status.txt; (while [ ! -e " + go + " ]; do "
                        "sleep 0.05; done; echo late >> status.txt; echo more > late.txt; "
                        "touch " + done + ") > /dev/null 2>&1 &"], check=True)
        c.call_end("c1", status="ok")
        c.call_begin("c2", "Bash", summary="echo next")
        subprocess.run(["bash", "-c", "echo next > next.txt"], check=True)
        c.call_end("c2", status="ok")
        c.turn_end()
''')


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + 60 * SLOW
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.05)


def test_a_process_that_outlives_its_run_stays_its_calls(make_mount, tmp_path):
    m = make_mount()  # not mounted: `run` mounts it, and would unmount at its end
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    go, done = str(tmp_path / "go"), str(tmp_path / "done")
    try:
        _writer_left_running(m, agent, go, done)
    finally:
        open(go, "w").close()  # the writer ends, whatever failed


def _writer_left_running(m, agent, go: str, done: str) -> None:
    r = overlayrec("run", "-w", m.ws, "--state-dir", m.state, "--session", "s", "--",
                   sys.executable, str(agent), go, done, cwd=m.ws)
    # the writer still works in the workspace: the mount stays, and says why
    assert is_mounted(m.ws)
    assert f"leaving {m.ws} mounted: " in r.stderr and "process(es) still work in it" in r.stderr
    # a revert of its call says it still runs (its next writes would follow the revert)
    r = overlayrec("revert", m.ws, "--call", "c1")
    assert "overlayrec: warning: 1 process(es) of what this reverts still run (" in r.stderr
    assert "bash" in r.stderr and "follows the revert" in r.stderr
    js = json.loads(overlayrec("revert", m.ws, "--call", "c1", "--json").stdout)
    assert len(js["still_running"]) == 1 and js["still_running"][0].split()[1].endswith("bash")
    overlayrec("revert", m.ws, "--call", "c2", "--yes")
    assert not os.path.exists(os.path.join(m.ws, "next.txt"))
    with open(os.path.join(m.ws, "status.txt")) as f:
        assert f.read() == "first\n"
    exported = json.loads(overlayrec("export", "git", m.ws, "--json").stdout)
    assert exported["commits"] >= 3
    open(go, "w").close()
    _wait_for(done)
    # the export's chain ends with what the session's processes wrote after it ended (it
    # ended at the session's last turn: diff --call c1 and the export disagreed)
    assert json.loads(overlayrec("export", "git", m.ws, "--json").stdout)["commits"] == 1
    assert json.loads(overlayrec("export", "git", m.ws, "--json").stdout)["commits"] == 0

    def git(*args):
        return subprocess.run(["git", "--git-dir", exported["git_dir"], *args], check=True,
                              capture_output=True, text=True).stdout
    assert git("log", "-1", "--format=%s", "refs/overlayrec/s/head") == \
        "late writes by the session's calls after its end\n"
    assert git("show", "refs/overlayrec/s/head:status.txt") == "first\nlate\n"
    assert git("show", "refs/overlayrec/s/head:late.txt") == "more\n"
    # the call's sides (what `records diff --call c1` answers from) hold them too
    assert git("show", "refs/overlayrec/s/sides:calls/c-c1/b/late.txt") == "more\n"
    # its writes reached the workspace (an unmount under it would have failed each one)
    with open(os.path.join(m.ws, "status.txt")) as f:
        assert f.read() == "first\nlate\n"
    with open(os.path.join(m.ws, "late.txt")) as f:
        assert f.read() == "more\n"
    late = [e for e in m.events() if e.get("path") in ("status.txt", "late.txt")
            and e["op"] in ("write", "create", "truncate")]
    assert {(e["path"], e["unit"]) for e in late} == {
        ("status.txt", "call:s:c1"), ("late.txt", "call:s:c1")}
    assert any(e.get("after_end") for e in late if e["path"] == "late.txt")
    rows = {r["id"]: r for r in map(json.loads, overlayrec("calls", m.ws, "--json").stdout
                                    .splitlines())}
    assert rows["c1"]["paths"] == ["late.txt", "status.txt"]
    assert rows["c2"]["paths"] == ["next.txt"]
    # every reader says which of the call's changes came after it ended
    assert rows["c1"]["late"] == ["late.txt", "status.txt"] and rows["c2"]["late"] == []
    listed = overlayrec("calls", m.ws).stdout
    assert "changed after the call ended, by a process it left running: late.txt, " \
        "status.txt" in listed
    said = "2 path(s) here were changed after the call ended, by a process it left running"
    assert said in overlayrec("diff", m.ws, "--call", "c1").stderr
    assert said not in overlayrec("diff", m.ws, "--call", "c2").stderr
    assert json.loads(overlayrec("diff", m.ws, "--call", "c1", "--json").stdout)["late"] == \
        ["late.txt", "status.txt"]
    assert "(after the call ended)" in overlayrec("blame", "late.txt", "-w", m.ws).stdout
    r = overlayrec("revert", m.ws, "--call", "c1")
    assert said in r.stderr
    assert json.loads(overlayrec("revert", m.ws, "--call", "c1", "--json").stdout)["late"] == \
        ["late.txt", "status.txt"]
    # its call's revert takes its late writes too
    overlayrec("revert", m.ws, "--call", "c1", "--yes")
    # (the attic is seen once the mount is gone: it went when the writer was done)
    assert [n for n in os.listdir(m.ws) if n != ".overlayrec-attic"] == []
    # as run said: unmounted once the writer was done
    wait_unmounted(m.ws, "the mount stayed after the writer was done")


def test_umount_names_the_processes_that_lose_the_workspace(make_mount):
    """A process working in the mount (its directory there) loses it at the unmount: every
    operation of its fails from then on; umount says which, without asking the daemon."""
    m = make_mount().mount()
    proc = subprocess.Popen(["sleep", "600"], cwd=m.ws)
    try:
        r = overlayrec("umount", m.ws)
        assert f"overlayrec: warning: 1 process(es) still work in {m.ws} ({proc.pid} sleep): " \
            "they lose it now" in r.stderr
        assert not is_mounted(m.ws)
    finally:
        proc.kill()
        proc.wait()


def test_umount_names_a_process_that_only_maps_a_file_of_the_mount(make_mount, tmp_path):
    """A process with a workspace file mapped into memory, its fd closed and its directory
    elsewhere, still uses the mount (its pages fault with SIGBUS once it is gone)."""
    m = make_mount().mount()
    with open(os.path.join(m.ws, "data.bin"), "wb") as f:
        f.write(b"x" * 8192)
    ready = tmp_path / "ready"
    # libc's mmap: Python's mmap module keeps a duplicate of the fd open
    code = ("import ctypes, mmap, os, sys, time\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.mmap.restype = ctypes.c_void_p\n"
            "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, "
            "ctypes.c_int, ctypes.c_int, ctypes.c_long]\n"
            f"fd = os.open({os.path.join(m.ws, 'data.bin')!r}, os.O_RDONLY)\n"
            "addr = libc.mmap(None, 8192, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)\n"
            "assert addr not in (None, ctypes.c_void_p(-1).value)\n"
            "os.close(fd); os.chdir('/')\n"
            f"open({str(ready)!r}, 'w').close()\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd="/")
    try:
        _wait_for(str(ready))
        r = overlayrec("umount", m.ws)
        assert f"1 process(es) still work in {m.ws} ({proc.pid} python" in r.stderr
    finally:
        proc.kill()
        proc.wait()


KILLED_RUN_AGENT = textwrap.dedent(r'''
    import os, sys, time
    go = sys.argv[1]  # a marker outside the workspace
    with open("before.txt", "w") as f:
        f.write("written while run lived\n")
    while not os.path.exists(go):
        time.sleep(0.05)
    with open("after.txt", "w") as f:
        f.write("written after run was killed\n")
''')


def test_a_run_killed_by_sigkill_leaves_no_mount_behind(make_mount, tmp_path):
    """`run` killed where nothing can catch it (SIGKILL, the OOM killer) could not unmount nor
    end its session: the mount stayed for good, its session with no end.  The daemon, whose
    mount it was, records the agent that works on without it, ends the session once the agent
    is gone too, and then unmounts."""
    m = make_mount()  # not mounted: `run` mounts it
    agent = tmp_path / "agent.py"
    agent.write_text(KILLED_RUN_AGENT)
    go = tmp_path / "go"
    run = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws,
                            "--state-dir", m.state, "--session", "k", "--",
                            sys.executable, str(agent), str(go)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(os.path.join(m.ws, "before.txt"))
        run.kill()
        run.wait()
        # the agent goes on without its runner: recorded, its session live, the mount kept
        time.sleep(3 * 1.0)  # the daemon looks once a second
        assert is_mounted(m.ws)
        # status says why the mount stays, and until when
        st = json.loads(overlayrec("status", m.ws, "--json").stdout)
        assert [(x["id"], x["agent_alive"], x["runner_alive"]) for x in st["sessions"]] == \
            [("k", True, False)], st
        assert st["mounted_for"] == {"pid": run.pid, "alive": False}, st
        said = overlayrec("status", m.ws).stdout
        assert "its `run` gone (ended once its agent has exited too)" in said, said
        assert f"mounted for pid {run.pid}, gone: unmounted once no session is live" in said
        go.touch()
        wait_unmounted(m.ws, "the mount stayed after its run and agent")
    finally:
        go.touch()
        if run.poll() is None:
            run.kill()
            run.wait()
    with open(os.path.join(m.ws, "after.txt")) as f:
        assert f.read() == "written after run was killed\n"
    ends = [e for e in m.events() if e["op"] == "session_end"]
    assert [e["session"] for e in ends] == ["k"]
    stat = json.loads(overlayrec("diff", m.ws, "--session", "k", "--json").stdout)
    assert sorted(f["path"] for f in stat["files"]) == ["after.txt", "before.txt"]


def test_a_mount_run_left_for_another_session_goes_when_that_one_ends(make_mount, tmp_path):
    """`run` A mounts, `run` B joins, A ends first: A leaves the mount to B's session (it said
    so, and was left mounted for good); once B's session ends and nothing works in the mount,
    the daemon, whose mount was A's, unmounts."""
    m = make_mount()  # not mounted: run A mounts it
    go = tmp_path / "go"
    a = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws,
                          "--state-dir", m.state, "--session", "a", "--", "sh", "-c",
                          f"echo a > a.txt; while [ ! -e {tmp_path}/b-in ]; do sleep 0.05; done"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    b = None
    try:
        _wait_for(os.path.join(m.ws, "a.txt"))
        b = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--session",
                              "b", "--", "sh", "-c", f"touch {tmp_path}/b-in; echo b > b.txt; "
                              f"while [ ! -e {go} ]; do sleep 0.05; done"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, err = a.communicate(timeout=60 * SLOW)
        assert a.returncode == 0, err
        assert f"leaving {m.ws} mounted: session(s) b still running" in err, err
        time.sleep(3 * 1.0)  # the daemon looks once a second: B's session holds the mount
        assert is_mounted(m.ws)
        go.touch()
        assert b.wait(timeout=60 * SLOW) == 0
        wait_unmounted(m.ws, "the mount stayed after both runs ended")
    finally:
        go.touch()
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert sorted(e["session"] for e in m.events() if e["op"] == "session_end") == ["a", "b"]


def test_runs_started_together_on_an_unmounted_workspace_all_run(tmpbase):
    """Three `run`s started at once on a workspace no one has mounted: the second and third
    failed ("already mounted": the first's daemon mounted between their look and their
    daemon's) and their agents never ran.  They wait for the first's mount and join it."""
    from pathlib import Path
    ws = Path(tmpbase) / "ws"
    ws.mkdir()
    env = dict(os.environ, XDG_STATE_HOME=os.path.join(tmpbase, "st"))
    runs = [subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", str(ws),
                              "--session", f"R{i}", "--", "sh", "-c",
                              f"sleep 1; echo {i} > f{i}.txt"], env=env,
                             stderr=subprocess.PIPE, text=True) for i in (1, 2, 3)]
    try:
        for r in runs:
            assert r.wait(timeout=60 * SLOW) == 0, r.stderr.read()
        # (the attic shows once the mount is gone, which it may be already)
        assert sorted(p.name for p in ws.iterdir() if p.name != ".overlayrec-attic") == \
            ["f1.txt", "f2.txt", "f3.txt"]
        wait_unmounted(str(ws), "the mount outlived the runs")
    finally:
        force_unmount(str(ws))
    evs = {e["path"]: e["unit"] for e in map(json.loads, overlayrec(
        "log", str(ws), "--json", env=env).stdout.splitlines()) if e["op"] == "create"}
    assert {p: u.split(":")[1] for p, u in evs.items()} == \
        {"f1.txt": "R1", "f2.txt": "R2", "f3.txt": "R3"}, evs


def test_a_run_leaves_its_mount_to_the_shell_that_started_it_and_entered_it(tmpbase):
    """The shell that started `run` in the background entered the mount meanwhile: run
    unmounted under it at its end (its ancestors were never counted as users), and its next
    `ls` failed, "Transport endpoint is not connected".  It is a user like any other: the
    mount stays while it is in it, and goes once it has left."""
    ws = os.path.join(tmpbase, "ws")
    os.mkdir(ws)
    env = dict(os.environ, XDG_STATE_HOME=os.path.join(tmpbase, "st"))
    script = (f"{sys.executable} -m overlayrec run -w {ws} --session r -- "
              "sh -c 'sleep 1; echo x > x.txt' & "
              f"until grep -q ' {ws} fuse' /proc/mounts; do sleep 0.05; done; "
              f"cd {ws}; wait; ls")
    try:
        r = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                           timeout=60 * SLOW)
        assert r.returncode == 0 and r.stdout.split() == ["x.txt"], r
        assert "leaving " + ws + " mounted: 1 process(es) still work in it" in r.stderr, r.stderr
        wait_unmounted(ws, "the mount outlived the shell that was in it")
    finally:
        force_unmount(ws)


def _made_by_session(ws: str, env: dict, path: str, session: str) -> None:
    """The record says ``path`` was made by a unit of ``session``."""
    evs = {e["path"]: e["unit"] for e in map(json.loads, overlayrec(
        "log", ws, "--json", env=env).stdout.splitlines()) if e["op"] == "create"}
    assert evs[path].split(":")[1] == session, evs


def _run_waiting(ws: str, env: dict, name: str, started: str, go: str) -> subprocess.Popen:
    """A `run` whose agent marks that it began (its session is live) and writes once ``go``
    exists (markers outside the workspace)."""
    return subprocess.Popen(
        [sys.executable, "-m", "overlayrec", "run", "-w", ws, "--session", name, "--", "sh",
         "-c", f"touch {started}; while [ ! -e {go} ]; do sleep 0.05; done; echo b > b.txt"],
        env=env, stderr=subprocess.PIPE, text=True)


def test_a_run_that_joined_a_reverts_mount_keeps_it(tmpbase):
    """A revert of an unmounted workspace mounts for itself; a `run` started meanwhile joins
    that mount, and the revert's end unmounted under its agent (whose next write failed,
    "Transport endpoint is not connected").  The mount stays while a session is live, and goes
    once nothing works in it."""
    import pty
    ws = os.path.join(tmpbase, "ws")
    os.mkdir(ws)
    env = dict(os.environ, XDG_STATE_HOME=os.path.join(tmpbase, "st"))
    started, go = os.path.join(tmpbase, "started"), os.path.join(tmpbase, "go")
    overlayrec("run", "-w", ws, "--session", "A", "--", "sh", "-c", "echo a > a.txt", env=env)
    master, slave = pty.openpty()  # the revert asks before it reverts, on a terminal only
    revert = subprocess.Popen([sys.executable, "-m", "overlayrec", "revert", "-w", ws,
                               "--session", "A"], env=env, stdin=slave, stdout=slave,
                              stderr=slave)
    os.close(slave)
    runner = None
    try:
        out = b""
        deadline = time.monotonic() + 60 * SLOW
        while b"revert 1 path(s)?" not in out:  # mounted, planned, asking
            assert time.monotonic() < deadline and revert.poll() is None, out
            out += os.read(master, 4096)
        assert is_mounted(ws)
        runner = _run_waiting(ws, env, "B", started, go)
        _wait_for(started)
        os.write(master, b"y\n")
        assert revert.wait(timeout=60 * SLOW) == 0
        assert not os.path.exists(os.path.join(ws, "a.txt"))
        assert is_mounted(ws), "the revert unmounted under the run that joined its mount"
        open(go, "w").close()
        assert runner.wait(timeout=60 * SLOW) == 0, runner.stderr.read()
        with open(os.path.join(ws, "b.txt")) as f:
            assert f.read() == "b\n"
        wait_unmounted(ws, "the mount outlived the revert and the run")
    finally:
        os.close(master)
        for p in (revert, runner):
            if p is not None and p.poll() is None:
                p.kill()
        force_unmount(ws)
    _made_by_session(ws, env, "b.txt", "B")


def test_a_run_joining_a_mount_that_is_ending_mounts_anew(tmpbase):
    """A `run` that joins a mount its maker is letting go (its session asked for in the moment
    between the maker's look and the daemon's end) lost it: its agent's writes failed.  The
    ending daemon refuses the session, and the run mounts anew once it is gone."""
    ws = os.path.join(tmpbase, "ws")
    os.mkdir(ws)
    env = dict(os.environ, XDG_STATE_HOME=os.path.join(tmpbase, "st"))
    started, go = os.path.join(tmpbase, "started"), os.path.join(tmpbase, "go")
    open(go, "w").close()
    # a daemon that takes 3 s to end once told to: the run below joins in that moment
    overlayrec("mount", ws, env=dict(env, OVERLAYREC_TEST_END_DELAY=str(3 * SLOW)))
    runner = None
    try:
        stop = subprocess.Popen([sys.executable, "-m", "overlayrec", "umount", ws], env=env)
        deadline = time.monotonic() + 30 * SLOW
        while "ending" not in overlayrec("status", ws, env=env, check=False).stdout:
            assert time.monotonic() < deadline, "the daemon never said it was ending"
            time.sleep(0.05)
        runner = _run_waiting(ws, env, "B", started, go)
        assert runner.wait(timeout=60 * SLOW) == 0, runner.stderr.read()
        assert stop.wait(timeout=30 * SLOW) == 0
        with open(os.path.join(ws, "b.txt")) as f:
            assert f.read() == "b\n"
        wait_unmounted(ws, "the run's own mount outlived it")
    finally:
        if runner is not None and runner.poll() is None:
            runner.kill()
        force_unmount(ws)
    _made_by_session(ws, env, "b.txt", "B")


def _run_and_release(m, script: str, go: str, done: str) -> None:
    """`overlayrec run` of ``sh -c script`` in session "s"; once it has exited (its session
    ended, what it left running still waiting for ``go``), ``go`` lets that on, and the mount
    goes once it is done (``done``)."""
    try:
        overlayrec("run", "-w", m.ws, "--state-dir", m.state, "--session", "s", "--",
                   "sh", "-c", script, cwd=m.ws)
        assert [e["op"] for e in m.events() if e["op"] == "session_end"] == ["session_end"]
    finally:
        open(go, "w").close()  # what it left running ends, whatever failed
    _wait_for(done)
    wait_unmounted(m.ws, "the mount stayed after what the run left was done")


def _call_script(body: str, explicit: bool) -> str:
    """``body`` as an agent's command: in an announced call S, or the agent's own (each of
    its commands an implicit call)."""
    if not explicit:
        return body
    ovr = f"{sys.executable} -m overlayrec"
    return f"{ovr} call begin --id S --tool Bash\n{body}\n{ovr} call end --id S"


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "implicit"])
def test_what_a_background_job_starts_after_its_session_ended_is_its_calls(
        make_mount, tmp_path, explicit):
    """A call's background job (`( ...; cmd ) &`) outlives the call, its session and `run`;
    the processes it starts after that (python3, cp) were outside actors, /proc leading from
    them only to the job's shell, itself init's by then: only the shell's own write (`echo z >
    z.txt`, placed at the session's end) stayed the call's, and `calls`, `diff --session`,
    `revert --session` missed the others.  They are the call's, after its end."""
    m = make_mount()  # not mounted: `run` mounts it
    go, done = str(tmp_path / "go"), str(tmp_path / "done")
    job = (f"(while [ ! -e {go} ]; do sleep 0.05; done; "
           f"{sys.executable} -c \"open('x.txt', 'w').write('x')\"; cp x.txt y.txt; "
           f"echo z > z.txt; touch {done}) > /dev/null 2>&1 &")
    _run_and_release(m, _call_script(job, explicit), go, done)
    made = {e["path"]: e for e in m.events() if e["op"] == "create"}
    assert sorted(made) == ["x.txt", "y.txt", "z.txt"]
    units = {e["unit"] for e in made.values()}
    assert len(units) == 1, made
    unit = units.pop()
    assert unit == "call:s:S" if explicit else unit.startswith("call:s:implicit-"), unit
    assert all(e.get("after_end") for e in made.values()), made
    rows = [json.loads(r) for r in overlayrec("calls", m.ws, "--json").stdout.splitlines()]
    assert [(r["paths"], r["late"], r["status"]) for r in rows] == \
        [(["x.txt", "y.txt", "z.txt"], ["x.txt", "y.txt", "z.txt"],
          "ok" if explicit else "abandoned")], rows
    stat = json.loads(overlayrec("diff", m.ws, "--session", "s", "--json").stdout)
    assert sorted(f["path"] for f in stat["files"]) == ["x.txt", "y.txt", "z.txt"]
    assert overlayrec("log", m.ws, "--outside").stdout == ""
    overlayrec("revert", m.ws, "--session", "s", "--yes")
    assert [n for n in os.listdir(m.ws) if n != ".overlayrec-attic"] == []


WRITER = textwrap.dedent(r'''
    import os, sys, time
    started, go, done = sys.argv[1:4]  # markers outside the workspace
    with open("big.txt", "a") as f:
        f.write("before\n")
        f.flush()
        open(started, "w").close()
        while not os.path.exists(go):
            time.sleep(0.05)
        f.write("after\n")  # through the handle opened during the call
        f.flush()
    open(done, "w").close()
''')


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "implicit"])
def test_a_write_through_a_handle_opened_in_a_call_after_its_end_is_late(
        make_mount, tmp_path, explicit):
    """A writer a call left running writes on through the file it opened during the call;
    its call ended (by its end, or an implicit call at its session's end: "abandoned"), and
    those writes were not marked after its end (a handle's unit is taken at its open): `calls`
    said late 0, blame nothing of it."""
    m = make_mount()
    (tmp_path / "writer.py").write_text(WRITER)
    started, go, done = (str(tmp_path / n) for n in ("started", "go", "done"))
    body = (f"{sys.executable} {tmp_path / 'writer.py'} {started} {go} {done} "
            f"> /dev/null 2>&1 & while [ ! -e {started} ]; do sleep 0.05; done")
    _run_and_release(m, _call_script(body, explicit), go, done)
    with open(os.path.join(m.ws, "big.txt")) as f:
        assert f.read() == "before\nafter\n"
    evs = m.events()
    end = [e["seq"] for e in evs if e["op"] == "call_end"]
    assert len(end) == 1
    changes = [e for e in evs if e.get("path") == "big.txt"]
    assert {e["unit"] for e in changes} == {changes[0]["unit"]}
    assert [e["op"] for e in changes if e["seq"] < end[0]] == ["create"]
    assert not changes[0].get("after_end")
    later = [e for e in changes if e["seq"] > end[0]]
    assert [e["op"] for e in later] == ["write"] and later[0].get("after_end"), changes
    row = json.loads(overlayrec("calls", m.ws, "--json").stdout)
    assert (row["status"], row["late"], row["late_events"]) == \
        ("ok" if explicit else "abandoned", ["big.txt"], 1), row
    assert "(after the call ended)" in overlayrec("blame", "big.txt", "-w", m.ws).stdout


def test_a_run_in_a_subdirectory_of_a_recorded_workspace_records_there(tmpbase):
    """`run` started in a package directory of a recorded, unmounted workspace that is itself
    inside a git repository (a monorepo): it began a record of its own for the package, the
    session missing from the workspace's record, and every git command of the agent failed at
    the mount ("Stopping at filesystem boundary").  Found by a bug hunt."""
    top = os.path.join(tmpbase, "mono")
    ws = os.path.join(top, "ws")
    os.makedirs(os.path.join(ws, "pkg"))
    env = dict(os.environ, XDG_STATE_HOME=os.path.join(tmpbase, "st"))
    env.pop("GIT_DISCOVERY_ACROSS_FILESYSTEM", None)
    subprocess.run(["git", "init", "-q", top], check=True)
    try:
        overlayrec("run", "-w", ws, "--session", "first", "--", "sh", "-c", "echo 1 > one.txt",
                   env=env)
        r = subprocess.run([sys.executable, "-m", "overlayrec", "run", "--session", "second",
                            "--", "sh", "-c", "echo 2 > two.txt && git status --short"],
                           cwd=os.path.join(ws, "pkg"), env=env, capture_output=True,
                           text=True, timeout=60 * SLOW)
        assert r.returncode == 0, r.stderr
        assert f"is inside the recorded workspace {ws}: recording there" in r.stderr, r.stderr
        wait_unmounted(ws, "the run's mount outlived it")
    finally:
        force_unmount(ws)
    assert "pkg/two.txt" in overlayrec("diff", ws, "--session", "second", "--stat",
                                       env=env).stdout
    assert not os.path.exists(os.path.join(ws, "pkg", ".overlayrec-attic"))


def _run_letting_go(m, env: dict, *args: str) -> subprocess.Popen:
    """`overlayrec run [args] -- true` in ``m``, its daemon slowed to end by
    OVERLAYREC_TEST_END_DELAY in ``env``; returned once the daemon says it is ending: the
    moment between the run's release (its look found nothing working in the mount) and the
    end, in which a process may come to the workspace."""
    run = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--state-dir",
                            m.state, *args, "--", "true"], env=env, stderr=subprocess.PIPE,
                           text=True)
    deadline = time.monotonic() + 30 * SLOW
    while "ending" not in overlayrec("status", m.ws, "--state-dir", m.state,
                                     check=False).stdout:
        assert time.monotonic() < deadline, "the run's daemon never said it was ending"
        time.sleep(0.05)
    return run


def test_what_comes_as_a_run_lets_its_mount_go_is_served_until_it_lets_go(make_mount):
    """A process that came to the workspace just after the look of a `run` letting its mount
    go (nothing worked in the mount then) lost the mount under it: its next read of a file it
    had opened there said "Transport endpoint is not connected" (a revert's plan, in CI).  The
    mount is detached from the workspace first: what comes later finds the directory beneath,
    and what came in between is served, and recorded, until it lets go."""
    # the daemon waits 2 s between the run's release and its end: the moment to come in
    env = dict(os.environ, OVERLAYREC_TEST_END_DELAY=str(2 * SLOW))
    m = make_mount(env=env)
    with open(os.path.join(m.ws, "f"), "w") as f:
        f.write("data\n")
    run = _run_letting_go(m, env, "--session", "s")
    fd = None
    try:
        fd = os.open(os.path.join(m.ws, "f"), os.O_RDWR)
        assert os.fstat(fd).st_dev == os.stat(m.ws).st_dev != os.stat(m.base).st_dev
        wait_unmounted(m.ws, "the mount stayed at the workspace after the run let it go")
        # the workspace is the directory beneath now; the descriptor is still served
        assert os.stat(m.ws).st_dev == os.stat(m.base).st_dev
        assert os.pread(fd, 100, 0) == b"data\n"
        assert os.pwrite(fd, b"more\n", 5) == 5
        os.fsync(fd)  # to the daemon now, not at the close
    finally:
        if fd is not None:
            os.close(fd)
    assert run.wait(timeout=60 * SLOW) == 0, run.stderr.read()
    with open(os.path.join(m.ws, "f")) as f:
        assert f.read() == "data\nmore\n"
    ends = [e["seq"] for e in m.events() if e["op"] == "session_end"]
    late = [e for e in m.events() if e.get("path") == "f" and e["op"] == "write"]
    assert len(ends) == 1 and [e["seq"] > ends[0] for e in late] == [True], late


def test_a_run_started_while_the_last_mount_still_ends_waits_for_its_journal(make_mount):
    """A `run` started while the last mount's daemon still served a process holding its
    detached mount opened the journal as a second writer, waiting for the writer's lock only
    after: it took seqs the ending daemon gave too (two events under one seq, the record
    going back in time, writes lost) while `check` said the record was whole.  Found by a bug
    hunt.  The new daemon takes the lock before it opens the journal."""
    env = dict(os.environ, OVERLAYREC_TEST_END_DELAY=str(1 * SLOW))
    m = make_mount(env=env)
    with open(os.path.join(m.ws, "f"), "w") as f:
        f.write("0\n")
    first = _run_letting_go(m, env, "--session", "A")
    second = fd = None
    try:
        fd = os.open(os.path.join(m.ws, "f"), os.O_WRONLY | os.O_APPEND)
        wait_unmounted(m.ws, "the first run's mount stayed at the workspace")
        second = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws,
                                   "--state-dir", m.state, "--session", "B", "--", "sh", "-c",
                                   "echo two > two.txt"], env=env, cwd=m.base,
                                  stderr=subprocess.PIPE, text=True)
        time.sleep(1.5 * SLOW)  # its daemon started, and waits for the journal
        for i in range(1, 4):
            os.write(fd, f"{i}\n".encode())
            os.fsync(fd)  # to the ending daemon, which journals it
            time.sleep(0.2)
    finally:
        if fd is not None:
            os.close(fd)
    assert first.wait(timeout=60 * SLOW) == 0, first.stderr.read()
    _, err = second.communicate(timeout=60 * SLOW)
    assert second.returncode == 0, err
    # (it paused without a word)
    assert "overlayrec: the workspace's last mount is still ending" in err, err
    with open(os.path.join(m.ws, "f")) as f:
        assert f.read() == "0\n1\n2\n3\n"
    with open(os.path.join(m.ws, "two.txt")) as f:
        assert f.read() == "two\n"
    evs = m.events(seals=True)
    times = [e["t"] for e in evs]
    assert times == sorted(times), [(e["seq"], e["op"], e.get("path"), e["t"]) for e in evs]
    # one write run (its later writes are no events), journaled by the ending daemon
    writes = [e for e in evs if e.get("path") == "f" and e["op"] == "write"]
    made = [e for e in evs if e.get("path") == "two.txt" and e["op"] != "seal"]
    assert len(writes) == 1 and len(made) == 1, evs
    assert [e["op"] for e in evs if e["op"].startswith("session_")] == \
        ["session_begin", "session_end"] * 2, evs
    assert "record whole" in overlayrec("check", m.ws, "--state-dir", m.state).stdout


def test_umount_ends_a_daemon_that_serves_a_held_detached_mount(make_mount):
    """While a process held a mount its run had let go (detached), `umount` said "not
    mounted" and exited 1, having signalled the daemon, which served on for another 10 s.
    Found by a bug hunt.  It ends the daemon at once and says so."""
    env = dict(os.environ, OVERLAYREC_TEST_END_DELAY=str(1 * SLOW))
    m = make_mount(env=env)
    with open(os.path.join(m.ws, "f"), "w") as f:
        f.write("data\n")
    run = _run_letting_go(m, env)
    fd = None
    try:
        fd = os.open(os.path.join(m.ws, "f"), os.O_RDWR)
        wait_unmounted(m.ws, "the run's mount stayed at the workspace")
        os.pwrite(fd, b"more\n", 5)
        os.fsync(fd)  # served still
        r = overlayrec("umount", m.ws, env=env)
        assert r.stdout.startswith(f"unmounted {m.ws} (its mount was gone already; ended its "
                                   "daemon, which still ran"), r.stdout
        with pytest.raises(OSError) as e:  # ended: not served for the rest of the 10 s
            os.pwrite(fd, b"last\n", 10)
            os.fsync(fd)
        assert e.value.errno == errno.ENOTCONN
    finally:
        if fd is not None:
            os.close(fd)
    assert run.wait(timeout=60 * SLOW) == 0, run.stderr.read()


def test_umount_of_a_live_mount_whose_daemon_it_cannot_find_says_so(make_mount, tmpbase):
    """root's `umount` of another user's live mount (its daemon in that user's state, not
    root's) said "(cleared a dead mount)"; the mount was live, and its daemon went on serving
    what held it.  Found by a bug hunt.  Here the other state is another XDG_STATE_HOME."""
    m = make_mount()
    mine = dict(os.environ, XDG_STATE_HOME=os.path.join(tmpbase, "mine"))
    other = dict(os.environ, XDG_STATE_HOME=os.path.join(tmpbase, "other"))
    overlayrec("mount", m.ws, env=mine)
    try:
        r = overlayrec("umount", m.ws, env=other)
        assert r.stdout.strip() == f"unmounted {m.ws} (detached it; its daemon, not in this " \
            "user's state, was not signalled: it ends once nothing holds the mount)", r.stdout
        assert not is_mounted(m.ws)
    finally:
        force_unmount(m.ws)


def _run_next_mount(m, go: str, *done: str) -> None:
    """A second `run` (session "s2", its own mount: the first one's is gone) that lets what the
    first left running go on (``go``) and waits until it is ``done``."""
    assert not is_mounted(m.ws)
    wait = " && ".join(f"[ -e {d} ]" for d in done)
    overlayrec("run", "-w", m.ws, "--state-dir", m.state, "--session", "s2", "--", "sh", "-c",
               f"touch {go}; until {wait}; do sleep 0.05; done", cwd=m.base)
    wait_unmounted(m.ws, "the second run's mount outlived it")


def _late_writes_of(m, unit: str, paths: list[str]) -> None:
    """Each of ``paths`` was changed by ``unit`` alone, after it ended, and every reader says
    so: no outside actor wrote."""
    changes = [e for e in m.events() if e.get("path") in paths]
    assert {(e["path"], e["unit"], bool(e.get("after_end"))) for e in changes} == \
        {(p, unit, True) for p in paths}, changes
    assert overlayrec("log", m.ws, "--state-dir", m.state, "--outside").stdout == ""
    for p in paths:
        said = overlayrec("blame", p, "-w", m.ws, "--state-dir", m.state).stdout
        assert f"{unit} (after the call ended)" in said, said


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "implicit"])
def test_a_calls_survivor_writing_under_the_next_mount_stays_its_calls(
        make_mount, tmp_path, explicit):
    """A call's background job writes during the call, outlives the call, its session and its
    `run` (whose mount went: the job works elsewhere), and writes again under the next `run`'s
    mount, as does what it starts then.  Those writes were an outside actor's: the daemon that
    placed the job at its session's end kept that in its memory only, and the new one found no
    session in /proc.  The record keeps each process's call (its actor row): they are the
    call's, after its end (found by a bug hunt)."""
    m = make_mount()  # not mounted: each `run` mounts it
    with open(os.path.join(m.ws, "f"), "w") as f:
        f.write("base\n")
    go, wrote, done = (str(tmp_path / n) for n in ("go", "wrote", "done"))
    job = (f"(cd /; echo a >> {m.ws}/f; touch {wrote}; "
           f"while [ ! -e {go} ]; do sleep 0.05; done; echo b >> {m.ws}/g; "
           f"{sys.executable} -c \"open('{m.ws}/h', 'w').write('h')\"; touch {done}) "
           f"> /dev/null 2>&1 &\nwhile [ ! -e {wrote} ]; do sleep 0.05; done")
    try:
        overlayrec("run", "-w", m.ws, "--state-dir", m.state, "--session", "s", "--",
                   "sh", "-c", _call_script(job, explicit), cwd=m.ws)
        wait_unmounted(m.ws, "the first run's mount outlived it")
        _run_next_mount(m, go, done)
    finally:
        open(go, "w").close()  # the job ends, whatever failed
    writes = [e for e in m.events() if e.get("path") == "f"]
    assert len(writes) == 1 and not writes[0].get("after_end"), writes
    unit = writes[0]["unit"]
    assert unit == "call:s:S" if explicit else unit.startswith("call:s:implicit-"), unit
    _late_writes_of(m, unit, ["g", "h"])
    rows = [json.loads(r) for r in overlayrec("calls", m.ws, "--state-dir", m.state,
                                              "--json").stdout.splitlines()]
    assert [(r["session"], r["paths"], r["late"]) for r in rows] == \
        [("s", ["f", "g", "h"], ["g", "h"])], rows
    call = unit.rpartition(":")[2]
    stat = json.loads(overlayrec("diff", m.ws, "--state-dir", m.state, "--call", call,
                                 "--session", "s", "--json").stdout)
    assert sorted(f["path"] for f in stat["files"]) == ["f", "g", "h"], stat


def test_a_survivor_that_wrote_nothing_in_its_session_is_its_calls_under_the_next_mount(
        make_mount, tmp_path):
    """A call's background job that wrote nothing before its session ended is placed at that
    end (``_place_survivors``), in the record too: under the next mount what it and its
    children write is the call's, after its end."""
    m = make_mount()
    go, done = str(tmp_path / "go"), str(tmp_path / "done")
    job = (f"echo a > f; (cd /; while [ ! -e {go} ]; do sleep 0.05; done; echo b > {m.ws}/g; "
           f"{sys.executable} -c \"open('{m.ws}/h', 'w').write('h')\"; touch {done}) "
           "> /dev/null 2>&1 &")
    try:
        overlayrec("run", "-w", m.ws, "--state-dir", m.state, "--session", "s", "--",
                   "sh", "-c", _call_script(job, True), cwd=m.ws)
        wait_unmounted(m.ws, "the first run's mount outlived it")
        _run_next_mount(m, go, done)
    finally:
        open(go, "w").close()
    _late_writes_of(m, "call:s:S", ["g", "h"])


KILLED_DAEMON_AGENT = textwrap.dedent(r'''
    import os, subprocess, sys, time
    from overlayrec import client
    ws, wrote, ready, finish, go, done = sys.argv[1:7]  # markers outside the workspace
    with client.connect() as c:
        c.call_begin("c1", "Bash", summary="start a writer")
        subprocess.run(["bash", "-c", f"(cd /; echo a >> {ws}/f; touch {wrote}; "
                        f"while [ ! -e {go} ]; do sleep 0.05; done; echo b >> {ws}/g; "
                        f"touch {done}) > /dev/null 2>&1 &"], check=True)
        while not os.path.exists(wrote):
            time.sleep(0.05)
        c.call_end("c1", status="ok")
    open(ready, "w").close()
    while not os.path.exists(finish):
        time.sleep(0.05)
''')


def test_a_survivor_of_a_killed_daemon_stays_its_calls_under_the_next_mount(make_mount,
                                                                             tmp_path):
    """The daemon is killed (SIGKILL) while a call's background job runs: nothing ends its
    session nor places its survivors, and the next mount ends the session at its start.  The
    job's row, written with its first write (by the log ahead of the killed daemon), still
    holds its call: what it writes under the next mount is the call's, after its end."""
    import signal
    m = make_mount()
    agent = tmp_path / "agent.py"
    agent.write_text(KILLED_DAEMON_AGENT)
    marks = [str(tmp_path / n) for n in ("wrote", "ready", "finish", "go", "done")]
    wrote, ready, finish, go, done = marks
    run = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws,
                            "--state-dir", m.state, "--session", "s", "--", sys.executable,
                            str(agent), m.ws, *marks], cwd=m.base,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(ready)
        with open(os.path.join(m.state, "daemon.json")) as f:
            os.kill(json.load(f)["pid"], signal.SIGKILL)
        open(finish, "w").close()
        run.wait(timeout=60 * SLOW)
        force_unmount(m.ws)  # the dead mount, unless the run cleared it
        _run_next_mount(m, go, done)
    finally:
        for mark in (finish, go):
            open(mark, "w").close()
        if run.poll() is None:
            run.kill()
            run.wait()
    assert [e["unit"] for e in m.events() if e.get("path") == "f"] == ["call:s:c1"]
    _late_writes_of(m, "call:s:c1", ["g"])
