"""Implicit calls end: an agent that announces no calls gets one call per direct child process,
and each ends once its processes (the child, its descendants, the orphans they leave) have all
exited, or at its session's end at the latest.  Every unit's end reaches ``on_unit_end``."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import SLOW, overlayrec
from overlayrec.attribution import Attribution, read_actor
from overlayrec.calls import Calls
from overlayrec.journal import Journal

pytestmark = pytest.mark.timeout(int(120 * SLOW))


def wait_until(cond, what: str, limit: float = 30):
    deadline = time.monotonic() + limit * SLOW
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_unit_ends_reach_the_hook_in_order(tmp_path):
    j = Journal(str(tmp_path / "state"))
    calls = Calls(j, Attribution())
    seen: list[str] = []
    calls.on_unit_end = seen.append
    me = read_actor(os.getpid())
    # a session whose agent announces its calls: calls, turns, an interrupted call (no end
    # before the next prompt), an abandoned one (no end before the session's), the session
    calls.session_begin(me, "s", runner=True)
    calls.turn_begin(me, "s", "first")
    calls.call_begin(me, "s", "a", "Bash", None)
    assert seen == []
    calls.call_end(me, "s", "a", "ok")
    assert seen == ["call:s:a"]
    calls.call_begin(me, "s", "b", "Bash", None)
    calls.turn_begin(me, "s", "second")  # ends b (interrupted), then turn 1
    calls.call_begin(me, "s", "c", "Bash", None)
    calls.session_end(me, "s")            # abandons c, ends turn 2 (which holds c), ends
    calls.session_end(me, "s")            # the session; a second end is a no-op
    assert seen == ["call:s:a", "call:s:b", "turn:s:1", "call:s:c", "turn:s:2", "session:s"]
    ends = [e for e in j.events() if e["op"] in ("call_end", "turn_end", "session_end")]
    assert [(e["op"], e.get("call") or e.get("turn"), e.get("status")) for e in ends] == \
        [("call_end", "a", "ok"), ("call_end", "b", "interrupted"), ("turn_end", 1, None),
         ("call_end", "c", "abandoned"), ("turn_end", 2, None), ("session_end", None, None)]
    j.close()


def test_implicit_calls_end_when_their_processes_exit(tmp_path):
    """Unit level, real processes: an agent (our child) with two children; each child is an
    implicit call once it is attributed; one exits and its call ends ("exited", hook called),
    the other outlives the session and is ended by it ("abandoned")."""
    j = Journal(str(tmp_path / "state"))
    calls = Calls(j, Attribution())
    seen: list[str] = []
    calls.on_unit_end = seen.append
    me = read_actor(os.getpid())
    agent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import subprocess, sys
            kids = [subprocess.Popen(["sleep", "600"]) for _ in range(2)]
            print(*[k.pid for k in kids], flush=True)
            sys.stdin.readline()
            for k in kids:
                k.kill()
                k.wait()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        first, second = (int(p) for p in agent.stdout.readline().split())
        calls.session_begin(me, "q", runner=True)
        calls.session_agent(me, "q", agent.pid)
        a1, a2 = read_actor(first), read_actor(second)
        u1, u2 = calls.unit_of(a1), calls.unit_of(a2)
        assert u1 == f"call:q:implicit-{first}-{a1['start']}" and u2.startswith("call:q:impl")
        assert calls.end_exited_calls() == []  # both alive
        assert seen == [] and len(calls.live_implicit) == 2
        os.kill(first, signal.SIGKILL)  # a zombie until the agent reaps it: exited all the same
        ended = wait_until(calls.end_exited_calls, "the first call to end", 10)
        assert [c.unit for c in ended] == [u1] and seen == [u1]
        rec = j.record("calls", b"q\0" + u1.split(":")[2].encode())
        assert rec["status"] == "exited" and rec["end_seq"] is not None and rec["implicit"]
        ev = j.event(rec["end_seq"])
        assert ev["op"] == "call_end" and ev["call"] == rec["id"] and ev["status"] == "exited"
        assert calls.unit_of(a1).extra.get("after_end") is True  # a late write stays its call's
        calls.session_end(me, "q")
        assert seen == [u1, u2, "session:q"]
        rec2 = j.record("calls", b"q\0" + u2.split(":")[2].encode())
        assert rec2["status"] == "abandoned" and rec2["end_seq"] is not None
        assert calls.live_implicit == [] and calls.end_exited_calls() == []
    finally:
        agent.stdin.close()
        agent.wait(timeout=30)
        j.close()


def _calls_of(m, sid: str) -> list[dict]:
    j = m.journal()
    try:
        return j.records("calls", sid.encode() + b"\0")
    finally:
        j.close()


def test_run_without_hooks_ends_the_implicit_call_and_reverts_it(make_mount):
    m = make_mount().mount()
    write = f"{shlex.quote(sys.executable)} -c 'open(\"f\", \"w\").write(\"x\")'"
    overlayrec("run", "-w", m.ws, "--session", "S", "--", "sh", "-c", write, cwd=m.ws)
    assert open(os.path.join(m.ws, "f")).read() == "x"
    [rec] = _calls_of(m, "S")
    assert rec["implicit"] and rec["end_seq"] is not None and rec["status"] == "exited"
    assert any(e["op"] == "call_end" and e.get("call") == rec["id"] and e["seq"] == rec["end_seq"]
               for e in m.events())
    rows = [json.loads(line) for line in overlayrec("calls", m.ws, "--json").stdout.splitlines()]
    assert [(r["id"], r["status"], r["paths"]) for r in rows] == [(rec["id"], "exited", ["f"])]
    assert rows[0]["end_t"] is not None and rows[0]["end_seq"] == rec["end_seq"]
    r = overlayrec("revert", m.ws, "--session", "S", "--yes")
    assert r.returncode == 0
    assert not os.path.lexists(os.path.join(m.ws, "f"))


def test_commands_run_one_after_another_have_spans_of_their_own(make_mount):
    """An agent without hooks that runs its commands one after another (``a; b; echo > f``)
    goes on before the daemon's look for exited processes (every 0.25 s): each call still ends
    before the next command's or the agent's own first change, so no call's span (its seq
    range; its commit in ``export git``) holds another's change.  It did: a call ended after
    the next one's writes, its commit held them (``Other-Writer``) and the next commit was
    empty, though ``diff --call`` named each change rightly."""
    m = make_mount()
    for i in (1, 2, 3):
        with open(os.path.join(m.ws, f"f{i}"), "w") as f:
            f.write(f"{i}\n")
    m.mount()
    script = "sed -i s/1/one/ f1; sed -i s/2/two/ f2; echo own > f4; cp f3 f5; rm f3"
    overlayrec("run", "-w", m.ws, "--session", "S", "--", "sh", "-c", script, cwd=m.ws)
    m.umount()
    calls = sorted(_calls_of(m, "S"), key=lambda c: c["begin_seq"])
    assert [c["summary"] for c in calls] == ["sed -i s/1/one/ f1", "sed -i s/2/two/ f2",
                                             "cp f3 f5", "rm f3"]
    units = {e["seq"]: e.get("unit") for e in m.events()}
    for a, b in zip(calls, calls[1:]):
        assert a["end_seq"] < b["begin_seq"], (a, b)
    for c in calls:  # every change inside a call's span is its own
        inside = {units[s] for s in units if c["begin_seq"] <= s <= c["end_seq"] and units[s]}
        assert inside == {f"call:S:{c['id']}"}, (c["summary"], inside)
    overlayrec("export", "git", m.ws)
    gd = os.path.join(m.state, "git")
    for c, changed in zip(calls, (["f1"], ["f2"], ["f5"], ["f3"])):
        ref = f"refs/overlayrec/S/calls/{c['id']}"
        shown = subprocess.run(["git", "--git-dir", gd, "show", "--name-only", "--format=%B", ref],
                               capture_output=True, text=True, check=True).stdout
        assert "Overlayrec-Other-Writer" not in shown, shown
        names = subprocess.run(["git", "--git-dir", gd, "diff-tree", "--no-commit-id",
                                "--name-only", "-r", ref], capture_output=True, text=True,
                               check=True).stdout.split()
        assert names == changed, (c["summary"], names)


def test_a_background_process_keeps_its_implicit_call_open(make_mount, tmp_path):
    """The call's shell starts a background writer and exits; the writer, adopted by the
    runner, keeps the call open until it exits, and its write is the call's own."""
    m = make_mount().mount()
    marks = tmp_path / "marks"
    marks.mkdir()
    go, wrote, finish, started = (shlex.quote(str(marks / n)) for n in
                                  ("go", "wrote", "finish", "started"))
    command = (f"echo a > f0; (while [ ! -e {go} ]; do sleep 0.05; done; echo y > g; "
               f"touch {wrote}) > /dev/null 2>&1 &")
    agent = (f"sh -c {shlex.quote(command)}; touch {started}; "
             f"while [ ! -e {finish} ]; do sleep 0.05; done")
    run = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--session",
                            "B", "--", "bash", "-c", agent], cwd=m.ws, stderr=subprocess.PIPE,
                           text=True)
    try:
        wait_until(lambda: (marks / "started").exists(), "the call's shell to exit")
        time.sleep(1.0 * SLOW)  # several exit checks: none may end the call while g's writer waits
        [rec] = _calls_of(m, "B")
        assert rec["end_seq"] is None, rec
        (marks / "go").touch()
        wait_until(lambda: (marks / "wrote").exists(), "the background write")
        # the writer has exited (or is about to): the daemon ends the call on its own
        rec = wait_until(lambda: [c for c in _calls_of(m, "B") if c["end_seq"]], "the end")[0]
        assert rec["status"] == "exited"
    finally:
        (marks / "finish").touch()
        run.wait(timeout=60 * SLOW)
    assert run.returncode == 0, run.stderr
    recs = _calls_of(m, "B")
    assert [c["id"] for c in recs] == [rec["id"]]  # the writer is no call of its own
    evs = [e for e in m.events() if e.get("unit") and e.get("path") in ("f0", "g")]
    assert {e["path"] for e in evs} == {"f0", "g"}
    assert {e["unit"] for e in evs} == {f"call:B:{rec['id']}"}
    assert not any(e.get("after_end") for e in evs)
    assert max(e["seq"] for e in evs) < rec["end_seq"]


def test_two_calls_announcing_one_command_place_its_writes_by_a_guess(make_mount, tmp_path):
    """Two calls active together announce the same command (a test script run twice): the
    first run's file went to the newer call as "by command", no reader calling it a guess.
    Found by a bug hunt."""
    m = make_mount()
    with open(os.path.join(m.ws, "t.sh"), "w") as f:
        f.write('#!/bin/sh\necho "$1" > "$1.out"\n')
    os.chmod(os.path.join(m.ws, "t.sh"), 0o755)
    m.mount()
    o = f"{sys.executable} -m overlayrec"
    overlayrec("run", "-w", m.ws, "--session", "s", "--", "sh", "-c",
               f"{o} turn begin --prompt p; {o} call begin --id A --tool Bash --summary ./t.sh; "
               f"{o} call begin --id B --tool Bash --summary ./t.sh; bash -c './t.sh first'; "
               f"{o} call end --id A; bash -c './t.sh second'; {o} call end --id B; "
               f"{o} turn end", cwd=m.ws)
    rows = {c["id"]: c for c in map(json.loads, overlayrec("calls", m.ws, "--json").stdout
                                    .splitlines())}
    assert "first.out" in rows["B"]["guessed"], rows["B"]


def test_two_runs_of_one_session_name_at_once_keep_their_sessions(make_mount, tmp_path):
    """A second `run --session X` while the first still works: it ended the first's session
    under its agent (its later calls "abandoned", their writes late), and the first run's own
    end then named the second session, so X stayed open for good (found by a hunt).  The
    second is X.2, and each run ends its own."""
    m = make_mount()
    m.mount()
    first = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws,
                              "--session", "X", "--", "sh", "-c",
                              "sleep 1; sh -c 'echo one >> f'; sleep 0.5; sh -c 'echo 3 >> h'"],
                             cwd=m.ws, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.3)
        overlayrec("run", "-w", m.ws, "--session", "X", "--", "sh", "-c",
                   "sh -c 'echo two >> g'", cwd=m.ws)
        _, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0 and "session still open" not in err, err
    ends = [(e["session"], e["op"]) for e in m.events() if e["op"].startswith("session_")]
    assert sorted(ends) == [("X", "session_begin"), ("X", "session_end"),
                            ("X.2", "session_begin"), ("X.2", "session_end")], ends
    rows = [json.loads(line) for line in overlayrec("calls", m.ws, "--json").stdout.splitlines()]
    assert sorted((r["session"], r["status"], tuple(r["paths"])) for r in rows) == [
        ("X", "exited", ("f",)), ("X", "exited", ("h",)), ("X.2", "exited", ("g",))], rows


def test_the_agent_writing_through_a_handle_it_held_ends_the_exited_call_first(make_mount):
    """The agent opens a file before a call (``exec 3>>f``) and writes through that handle
    after the call's process exited: the call ends before the write, as it does before a
    change the agent makes by a fresh open.  It did not: a write through a handle held took
    its unit from the open and ended no call, so the call's end came after the agent's write,
    its span (``replay --at call``, its commit in an export) holding the agent's line."""
    m = make_mount()
    with open(os.path.join(m.ws, "f"), "w") as f:
        f.write("1\n")
    m.mount()
    script = "exec 3>>f; touch other; echo agent >&3"
    overlayrec("run", "-w", m.ws, "--session", "S", "--", "bash", "-c", script, cwd=m.ws)
    [rec] = _calls_of(m, "S")
    [write] = [e for e in m.events() if e["op"] == "write" and e["path"] == "f"]
    assert write["unit"] == "session:S"
    assert rec["end_seq"] < write["seq"], (rec, write)
    at = os.path.join(m.base, "at-call")
    r = overlayrec("replay", m.ws, "--at", f"call:S:{rec['id']}", "--to", at)
    assert r.returncode == 0, r.stderr
    assert open(os.path.join(at, "f")).read() == "1\n"
    assert open(os.path.join(m.ws, "f")).read() == "1\nagent\n"
