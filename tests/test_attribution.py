"""Attribution end to end: a scripted agent announces calls through Claude Code hook JSON and
runs real commands while an unrelated process edits other files; every event lands on the
right call, turn, session or outside actor."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

from conftest import SLOW, needs_fuse, overlayrec, is_mounted

pytestmark = needs_fuse

# the agent scripts' hook: one Claude Code payload through `overlayrec hook` (SESSION and PY
# set by the script before it)
HOOK = textwrap.dedent(r'''
    def hook(event, **kw):
        payload = dict(hook_event_name=event, session_id=SESSION, cwd=os.getcwd(), **kw)
        r = subprocess.run([PY, "-m", "overlayrec", "hook", "claude-code"],
                           input=json.dumps(payload), capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout == "" and r.stderr == "", (event, r.stderr)
''')

FAKE_AGENT = textwrap.dedent(r'''
    import json, os, subprocess, sys, time
    PY, SESSION = sys.executable, "cc-session"
''') + HOOK + textwrap.dedent(r'''
    def bash(call_id, command):
        hook("PreToolUse", tool_use_id=call_id, tool_name="Bash", tool_input={"command": command})
        subprocess.run(["bash", "-c", command], check=True)
        hook("PostToolUse", tool_use_id=call_id, tool_name="Bash")
    marks = sys.argv[1]  # outside the workspace: markers shared with the test's other processes
    def mark(name):
        open(os.path.join(marks, name), "w").close()
    def wait_for(name):  # no sleeps sized for a fast machine: each step waits for the other
        deadline = time.monotonic() + 600
        while not os.path.exists(os.path.join(marks, name)):
            assert time.monotonic() < deadline, f"no {name} marker"
            time.sleep(0.05)
    hook("SessionStart")
    hook("UserPromptSubmit", prompt="rename greet and tidy up\nsecond line")
    mark("turn1")  # the user's editor writes now, during the turn
    bash("toolu_sed", "sed -i s/hello/goodbye/ src/app.py")
    # a formatter-like rewrite: write a temp file, rename it over the original
    bash("toolu_fmt", "python3 -c \"import os\nfor p in ['src/a.py', 'src/b.py']:\n"
                      "    s = open(p).read().upper()\n    open(p + '.tmp', 'w').write(s)\n"
                      "    os.replace(p + '.tmp', p)\"")
    bash("toolu_mv", "mv notes.txt docs-notes.txt && rm old.txt")
    # a background process that keeps writing after its call ended
    hook("PreToolUse", tool_use_id="toolu_bg", tool_name="Bash", tool_input={"command": "server &"})
    go, ticked = os.path.join(marks, "go"), os.path.join(marks, "ticked")
    subprocess.run(["bash", "-c", f"(while [ ! -e {go} ]; do sleep 0.05; done; for i in 1 2 3; "
                    f"do sleep 0.3; echo tick $i >> server.log; done; touch {ticked}) "
                    "> /dev/null 2>&1 &"], check=True)
    hook("PostToolUse", tool_use_id="toolu_bg", tool_name="Bash")
    mark("go")  # the writer starts once its call has ended
    # the agent's own edit tool, inside a call
    hook("PreToolUse", tool_use_id="toolu_edit", tool_name="Edit", tool_input={"file_path": "README"})
    with open("README", "a") as f:
        f.write("edited by the agent\n")
    hook("PostToolUse", tool_use_id="toolu_edit", tool_name="Edit")
    wait_for("ticked")  # the background writer's late writes, all inside the turn
    wait_for("edited")  # and the editor's
    hook("Stop")
    hook("UserPromptSubmit", prompt="second turn")
    with open("own.txt", "w") as f:     # the agent's own write, outside any call
        f.write("x")
    hook("Stop")
    hook("SessionEnd")
''')


def seed(ws):
    os.makedirs(os.path.join(ws, "src"))
    files = {"src/app.py": "print('hello')\n", "src/a.py": "a = 1\n", "src/b.py": "b = 2\n",
             "notes.txt": "n\n", "old.txt": "o\n", "README": "r\n", "user.txt": "u\n"}
    for p, t in files.items():
        with open(os.path.join(ws, p), "w") as f:
            f.write(t)


def events_by_path(m):
    out = {}
    for e in m.events():
        for p in (e.get("path"), e.get("path2")):
            if p:
                out.setdefault(p, []).append(e)
    return out


def test_scripted_agent_with_hooks_and_an_outside_editor(make_mount, tmp_path):
    m = make_mount()
    seed(m.ws)
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(FAKE_AGENT)
    marks = tmp_path / "marks"
    marks.mkdir()
    # an unrelated process (the user's editor) writing while the agent works in its first turn
    editor = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time\nturn1, edited = sys.argv[1:]\n"
         "while not os.path.exists(turn1): time.sleep(0.05)\nfor i in range(3):\n"
         "    open('user.txt', 'a').write(f'edit {i}\\n'); time.sleep(0.1)\n"
         "open(edited, 'w').close()", str(marks / "turn1"), str(marks / "edited")], cwd=m.ws)
    r = overlayrec("run", "-w", m.ws, "--session", "s1", "--", sys.executable, str(agent),
                   str(marks), cwd=m.ws, timeout=120)
    editor.wait(timeout=30 * SLOW)
    assert "session s1: 2 turn(s), 5 call(s)" in r.stderr
    assert is_mounted(m.ws)  # run joined the mount; it did not mount, so it does not unmount

    by = events_by_path(m)
    unit = "call:s1:{}".format
    assert {e["unit"] for e in by["src/app.py"]} == {unit("toolu_sed")}
    sed_tmp = [p for p in by if p.startswith("src/sed")]
    assert sed_tmp and all(e["unit"] == unit("toolu_sed") for p in sed_tmp for e in by[p])
    for p in ("src/a.py", "src/b.py", "src/a.py.tmp", "src/b.py.tmp"):
        assert {e["unit"] for e in by[p]} == {unit("toolu_fmt")}, p
    assert {e["unit"] for e in by["notes.txt"]} == {unit("toolu_mv")}
    assert {e["unit"] for e in by["old.txt"]} == {unit("toolu_mv")}
    late = by["server.log"]
    assert {e["unit"] for e in late} == {unit("toolu_bg")}
    assert all(e.get("after_end") for e in late)
    assert {e["unit"] for e in by["README"]} == {unit("toolu_edit")}
    assert {e["unit"] for e in by["own.txt"]} == {"turn:s1:2"}
    outside = {e["unit"] for e in by["user.txt"]}
    assert len(outside) == 1 and outside.pop() == f"outside:{by['user.txt'][0]['actor']}"
    assert m.actor(by["user.txt"][0]["actor"])["pid"] == editor.pid
    # no event of the session is attributed outside it, and control events are all there
    ops = [e["op"] for e in m.events()]
    assert ops.count("call_begin") == 5 and ops.count("call_end") == 5
    assert ops.count("turn_begin") == 2 and ops.count("session_end") == 1

    rows = [json.loads(l) for l in overlayrec("calls", m.ws, "--json").stdout.splitlines()]
    assert [r["id"] for r in rows] == ["toolu_sed", "toolu_fmt", "toolu_mv", "toolu_bg",
                                      "toolu_edit"]
    bg = rows[3]
    assert bg["late_events"] == bg["events"] > 0 and bg["paths"] == ["server.log"]
    assert rows[0]["summary"] == "sed -i s/hello/goodbye/ src/app.py"
    assert any(p.startswith("sed[") for p in rows[0]["processes"])
    turns = [json.loads(l) for l in overlayrec("turns", m.ws, "--json").stdout.splitlines()]
    assert [t["index"] for t in turns] == [1, 2]
    assert turns[0]["prompt"].startswith("rename greet")
    assert "src/app.py" in turns[0]["paths"] and turns[1]["paths"] == ["own.txt"]
    assert any(o.startswith("python") for o in turns[0]["others"])  # the editor, named
    text = overlayrec("turns", m.ws).stdout
    assert "shared with" in text
    log = overlayrec("log", m.ws, "--call", "toolu_mv").stdout.splitlines()
    assert {l.split()[5] for l in log} == {"rename", "unlink"}


def test_implicit_calls_without_hooks(make_mount, tmp_path):
    m = make_mount()
    seed(m.ws)
    m.mount()
    script = "sed -i s/hello/hi/ src/app.py; touch new.txt; echo own >> README"
    r = overlayrec("run", "-w", m.ws, "--session", "plain", "--", "bash", "-c", script,
                   cwd=m.ws)
    assert "session plain" in r.stderr
    by = events_by_path(m)
    sed_unit = {e["unit"] for e in by["src/app.py"]}
    touch_unit = {e["unit"] for e in by["new.txt"]}
    assert len(sed_unit) == 1 and len(touch_unit) == 1 and sed_unit != touch_unit
    assert sed_unit.pop().startswith("call:plain:implicit-")
    assert {e["unit"] for e in by["README"]} == {"session:plain"}  # bash's own write
    rows = [json.loads(l) for l in overlayrec("calls", m.ws, "--json").stdout.splitlines()]
    assert sorted(r["tool"] for r in rows) == ["sed", "touch"]
    assert all(r["implicit"] for r in rows)


def test_run_mounts_and_unmounts_and_passes_the_exit_status(tmpbase):
    ws = os.path.join(tmpbase, "w")
    os.makedirs(ws)
    sd = os.path.join(tmpbase, "st")
    r = overlayrec("run", "-w", ws, "--state-dir", sd, "--", "bash", "-c",
                   'echo "$OVERLAYREC_SESSION" > s.txt; test -S "$OVERLAYREC_SOCKET"; exit 7',
                   check=False)
    assert r.returncode == 7, r.stderr
    assert not is_mounted(ws)
    sid = open(os.path.join(ws, "s.txt")).read().strip()
    assert f"session {sid}" in r.stderr and "1 file(s) changed" in r.stderr
    r = overlayrec("run", "-w", os.path.join(tmpbase, "missing"), "--", "true", check=False)
    assert r.returncode == 125 and r.stderr.startswith("overlayrec: error:")


def test_two_sessions_share_one_mount(make_mount, tmp_path):
    m = make_mount()
    seed(m.ws)
    m.mount()
    gate = tmp_path / "gate"
    a = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--session",
                          "A", "--", "bash", "-c",
                          f"echo a > a.txt; while [ ! -e {gate} ]; do sleep 0.05; done"],
                         stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    b = overlayrec("run", "-w", m.ws, "--session", "B", "--", "bash", "-c", "echo b > b.txt")
    gate.write_text("")
    a.wait(timeout=30)
    assert a.returncode == 0
    by = events_by_path(m)
    assert {e["unit"].split(":")[1] for e in by["a.txt"]} == {"A"}
    assert {e["unit"].split(":")[1] for e in by["b.txt"]} == {"B"}
    assert "session B" in b.stderr
    assert is_mounted(m.ws)


def test_hook_without_a_mount_does_nothing(tmp_path):
    env = dict(os.environ)
    env.pop("OVERLAYREC_SOCKET", None)
    r = subprocess.run([sys.executable, "-m", "overlayrec", "hook", "claude-code"],
                       input=json.dumps({"hook_event_name": "PreToolUse", "session_id": "x",
                                         "tool_use_id": "t", "tool_name": "Bash"}),
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=30)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""
    r = subprocess.run([sys.executable, "-m", "overlayrec", "hook", "claude-code"],
                       input="not json", capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert r.returncode == 0 and r.stdout == ""


def test_install_hooks_merges_and_removes(tmp_path):
    settings = tmp_path / ".claude" / "settings.json"
    settings.parent.mkdir()
    mine = {"type": "command", "command": "my-linter"}
    settings.write_text(json.dumps({"model": "x", "hooks": {"PreToolUse": [
        {"matcher": "Edit", "hooks": [mine]}]}}))
    overlayrec("install-hooks", "claude-code", "--project", str(tmp_path))
    overlayrec("install-hooks", "claude-code", "--project", str(tmp_path))  # idempotent
    s = json.loads(settings.read_text())
    assert s["model"] == "x"
    pre = s["hooks"]["PreToolUse"]
    assert pre[0] == {"matcher": "Edit", "hooks": [mine]}
    ours = [h for e in pre for h in e["hooks"] if "hook claude-code" in h["command"]]
    assert len(ours) == 1
    assert set(s["hooks"]) == {"SessionStart", "UserPromptSubmit", "PreToolUse", "PostToolUse",
                               "PostToolUseFailure", "Stop", "SessionEnd"}
    overlayrec("install-hooks", "claude-code", "--project", str(tmp_path), "--remove")
    assert json.loads(settings.read_text()) == {"model": "x", "hooks": {"PreToolUse": [
        {"matcher": "Edit", "hooks": [mine]}]}}


def test_agent_write_with_several_active_calls_names_every_candidate(make_mount, tmp_path):
    """The agent's own write while several calls are active goes to the call whose summary
    names its file (an edit tool's file_path), else to the newest; the event names every
    candidate and how its call was chosen."""
    m = make_mount().mount()
    agent = tmp_path / "agent.py"
    agent.write_text(textwrap.dedent('''
        import os
        from overlayrec import client
        with client.connect() as c:
            c.call_begin("a", "Edit", summary=os.path.abspath("x.txt"))
            c.call_begin("b", "Read")
            open("x.txt", "w").write("x")         # a's file, while a and b are active
            open("both.txt", "w").write("x")      # nobody's file: the newest, b
            c.call_end("b")
            open("only_a.txt", "w").write("y")
            c.call_end("a")
    '''))
    overlayrec("run", "-w", m.ws, "--session", "par", "--", sys.executable, str(agent), cwd=m.ws)
    by = events_by_path(m)
    both = ["call:par:a", "call:par:b"]
    assert [(e["unit"], e["candidates"], e["chosen"]) for e in by["x.txt"]] == \
        [("call:par:a", both, "path")] * len(by["x.txt"])
    assert [(e["unit"], e["candidates"], e["chosen"]) for e in by["both.txt"]] == \
        [("call:par:b", both, "newest")] * len(by["both.txt"])
    assert all("candidates" not in e and "chosen" not in e and e["unit"] == "call:par:a"
               for e in by["only_a.txt"])


PARALLEL_AGENT = textwrap.dedent(r'''
    import json, os, shlex, subprocess, sys
    PY, SESSION = sys.executable, "cc-par"
''') + HOOK + textwrap.dedent(r'''
    def spawn(command):  # as Claude Code runs a Bash call: the command quoted into an eval
        return subprocess.Popen(["bash", "-c", "-l", "shopt -u extglob 2>/dev/null || true && "
                                 f"eval {shlex.quote(command)} < /dev/null"])
    one = "printf one > from_one.txt && printf 1 >> shared.txt"
    two = "printf 'two, said \"she\"' > from_two.txt && sleep 0.2 && printf 2 >> shared.txt"
    hook("UserPromptSubmit", prompt="two tools at once")
    # both calls announced before either tool's process starts (hooks run first): their
    # processes are started during both, in the order the calls began
    hook("PreToolUse", tool_use_id="t1", tool_name="Bash", tool_input={"command": one})
    hook("PreToolUse", tool_use_id="t2", tool_name="Bash", tool_input={"command": two})
    procs = [spawn(one), spawn(two), spawn("printf x > from_neither.txt")]
    assert [p.wait() for p in procs] == [0, 0, 0]
    hook("PostToolUse", tool_use_id="t2", tool_name="Bash")
    hook("PostToolUse", tool_use_id="t1", tool_name="Bash")
    hook("Stop")
''')


def test_processes_of_calls_active_together_go_to_the_call_whose_command_they_run(
        make_mount, tmp_path):
    """Two Bash calls announced together, then both processes started: each process goes to
    the call whose command its argv carries (quoted as an agent quotes it), not to the first
    or the newest call; one that carries neither goes to the newest, marked as a guess.  The
    listing names what was placed by a guess."""
    m = make_mount()
    open(os.path.join(m.ws, "shared.txt"), "w").write("0")
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(PARALLEL_AGENT)
    overlayrec("run", "-w", m.ws, "--session", "par", "--", sys.executable, str(agent), cwd=m.ws)
    by = events_by_path(m)
    both = ["call:par:t1", "call:par:t2"]
    want = {"from_one.txt": ("call:par:t1", "command"), "from_two.txt": ("call:par:t2", "command"),
            "from_neither.txt": ("call:par:t2", "newest")}
    for path, (unit, how) in want.items():
        assert {(e["unit"], tuple(e["candidates"]), e["chosen"]) for e in by[path]} == \
            {(unit, tuple(both), how)}, path
    assert {(e["unit"], e["chosen"]) for e in by["shared.txt"]} == \
        {("call:par:t1", "command"), ("call:par:t2", "command")}
    with open(os.path.join(m.ws, "shared.txt")) as f:
        assert sorted(f.read()) == ["0", "1", "2"]
    # what was placed by a guess is said by every reader of either call
    rows = {r["id"]: r for r in map(json.loads, overlayrec("calls", m.ws, "--json").stdout
                                     .splitlines())}
    assert (rows["t2"]["guessed"], rows["t2"]["active_with"]) == \
        (["from_neither.txt"], ["call:par:t1"])
    assert (rows["t1"]["guessed"], rows["t1"]["active_with"]) == ([], [])
    text = overlayrec("calls", m.ws).stdout
    assert "placed here by a guess (calls active together: t1): from_neither.txt" in text
    d = json.loads(overlayrec("diff", m.ws, "--call", "t2", "--json").stdout)
    assert (d["guessed"], d["maybe_ours"]) == (["from_neither.txt"], {})
    d = json.loads(overlayrec("diff", m.ws, "--call", "t1", "--json").stdout)
    assert (d["guessed"], d["maybe_ours"]) == ([], {"call:par:t2": ["from_neither.txt"]})
    r = overlayrec("diff", m.ws, "--call", "t1", "--stat")
    assert "may be this call's: from_neither.txt (`--call t2` selects them)" in r.stderr
    # (shared.txt, written by both, is a conflict of either's revert)
    r = overlayrec("revert", m.ws, "--call", "t2", check=False)
    assert "placed in this call by a guess" in r.stderr and "from_neither.txt" in r.stderr
    assert "delete   from_neither.txt" in r.stdout
    r = overlayrec("revert", m.ws, "--call", "t1", "--json", check=False)
    assert json.loads(r.stdout)["maybe_ours"] == {"call:par:t2": ["from_neither.txt"]}
    r = overlayrec("blame", "from_neither.txt", "-w", m.ws)
    assert " call:par:t2 (placed in it by a guess): " in r.stdout
    assert json.loads(overlayrec("blame", "from_one.txt", "-w", m.ws, "--json").stdout
                      .splitlines()[0]).get("guessed") is None
    gd = json.loads(overlayrec("export", "git", m.ws, "--json").stdout)["git_dir"]
    msgs = {c: subprocess.run(["git", "--git-dir", gd, "log", "-1", "--format=%B",
                               f"refs/overlayrec/par/calls/{c}"], capture_output=True,
                              text=True, check=True).stdout for c in ("t1", "t2")}
    assert "Overlayrec-Guessed: from_neither.txt\nOverlayrec-Active-With: t1\n" in msgs["t2"]
    assert "Overlayrec-Guessed" not in msgs["t1"]
    page = os.path.join(os.path.dirname(m.ws), "report.html")
    overlayrec("report", m.ws, "--html", page)
    with open(page) as f:
        text = f.read()
    data = json.loads(text.split('<script id="data" type="application/json">')[1]
                      .split("</script>")[0])
    lanes = {lane.get("call"): lane for lane in data["lanes"] if lane.get("call")}
    assert (lanes["t2"]["guessed"], lanes["t2"]["active_with"]) == (["from_neither.txt"], ["t1"])
    assert lanes["t1"]["guessed"] == []


def test_pid_reuse_cannot_move_a_write(tmp_path):
    """An agent is (pid, start time): a process with the agent's pid but another start time
    (what a reused pid looks like) and its children are outside the session."""
    from overlayrec.attribution import Attribution
    from overlayrec.calls import Calls, Session
    from overlayrec.journal import Journal
    j = Journal(str(tmp_path))
    calls = Calls(j, Attribution())
    me = Attribution().actor(os.getpid())
    s = Session("s", {"key": f"{os.getpid()}:{me['start'] + 1}", "pid": os.getpid()}, None)
    calls.sessions["s"] = s
    calls._by_agent[s.agent["key"]] = s
    child = subprocess.Popen([sys.executable, "-c", "import sys; print(1, flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        assert calls.unit_of(me) == f"outside:{me['key']}"
        kid = Attribution().actor(child.pid)
        assert calls.unit_of(kid) == f"outside:{kid['key']}"
        # the same pid with its real start time is the agent, and its child a call's
        real = Session("r", {"key": me["key"], "pid": os.getpid()}, None)
        calls.sessions["r"] = real
        calls._by_agent[me["key"]] = real
        calls._lineage.clear()
        assert calls.unit_of(me) == "session:r"
        assert calls.unit_of(kid).startswith("call:r:implicit-")
    finally:
        child.stdin.close()
        child.wait()
        j.close()


def test_run_forwards_signals_to_the_agent(make_mount):
    import signal
    m = make_mount().mount()
    p = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--", "bash",
                          "-c", "trap 'echo got-term > term.txt; exit 42' TERM; "
                                "touch ready; while :; do sleep 0.05; done"],
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(os.path.join(m.ws, "ready")) and time.monotonic() < deadline:
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 42
    finally:
        if p.poll() is None:
            p.kill()
    assert open(os.path.join(m.ws, "term.txt")).read() == "got-term\n"


def test_installed_hook_command_fast_and_fallback_paths(make_mount, tmp_path):
    """The command install-hooks writes: nc straight to the socket under `run`, the Python
    adapter when no socket is in the environment; both record the call."""
    from overlayrec.cli import hook_command
    m = make_mount().mount()
    agent = tmp_path / "agent.py"
    agent.write_text(textwrap.dedent(r'''
        import json, os, subprocess, sys
        hook = sys.argv[1]
        def send(env, **payload):
            r = subprocess.run(hook, shell=True, input=json.dumps(payload), text=True,
                               capture_output=True, env=env)
            assert r.returncode == 0 and r.stdout == "", r
        fast = dict(os.environ)
        slow = {k: v for k, v in os.environ.items() if k != "OVERLAYREC_SOCKET"}
        for env, cid in ((fast, "fast"), (slow, "slow")):
            send(env, hook_event_name="PreToolUse", session_id="h", tool_use_id=cid,
                 tool_name="Bash", tool_input={"command": "touch " + cid})
            subprocess.run(["touch", cid + ".txt"], check=True)
            send(env, hook_event_name="PostToolUse", session_id="h", tool_use_id=cid)
    '''))
    overlayrec("run", "-w", m.ws, "--session", "hk", "--", sys.executable, str(agent),
               hook_command(), cwd=m.ws)
    rows = {json.loads(l)["id"]: json.loads(l) for l in
            overlayrec("calls", m.ws, "--json").stdout.splitlines()}
    assert set(rows) == {"fast", "slow"}
    assert rows["fast"]["status"] == rows["slow"]["status"] == "ok"
    assert rows["fast"]["paths"] == ["fast.txt"] and rows["slow"]["paths"] == ["slow.txt"]
    assert rows["fast"]["summary"] == "touch fast"


# one shell for the whole session, each command sent to it (OpenHands, SWE-agent)
SHELL = textwrap.dedent(r'''
    sh = subprocess.Popen(["bash"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    def run(cmd):
        sh.stdin.write(cmd + "\necho __done__\n")
        sh.stdin.flush()
        while sh.stdout.readline().strip() != "__done__":
            pass
''')

PERSISTENT_SHELL_AGENT = textwrap.dedent(r'''
    import os, subprocess, sys, time
    from overlayrec import client
    marks = sys.argv[1]  # outside the workspace
    go, done = os.path.join(marks, "go"), os.path.join(marks, "done")
''') + SHELL + textwrap.dedent(r'''
    def wait_for(path):
        deadline = time.monotonic() + 120
        while not os.path.exists(path):
            assert time.monotonic() < deadline, path
            time.sleep(0.02)
    with client.connect() as c:
        c.turn_begin(prompt="one")
        c.call_begin("a", "Bash", summary="echo a > a.txt")
        run("echo a > a.txt")                      # a builtin: the shell itself writes
        c.call_end("a")
        c.call_begin("b", "Bash", summary="python3 ...")
        run(f"{sys.executable} -c 'open(\"b.txt\", \"w\").write(\"b\")'")  # a process of b's
        run(f"(while [ ! -e {go} ]; do sleep 0.02; done; echo late > late.txt; touch {done}) &")
        c.call_end("b")
        c.turn_end()
        c.turn_begin(prompt="two")
        run("echo between > between.txt")          # no call active: the turn's
        c.call_begin("c", "Bash", summary="echo c > c.txt")
        run("echo c > c.txt")
        open(go, "w").close()                      # b's background writer writes now
        wait_for(done)
        c.call_end("c")
        c.turn_end()
    sh.stdin.close()
    sh.wait()
''')


def test_a_persistent_shell_writes_for_the_call_that_sent_it_each_command(make_mount, tmp_path):
    """An agent that keeps one shell for the session: what the shell itself writes (a
    builtin) goes to the call active then, marked as placed by time; a command it starts is
    that call's by the process tree, and so are the later writes of one it sent to the
    background; with no call active, the turn as it is now (the first turn's name stuck to the
    shell for good: `revert --turn 2` found nothing, `--turn 1` took turn 2's files)."""
    m = make_mount().mount()
    agent = tmp_path / "agent.py"
    agent.write_text(PERSISTENT_SHELL_AGENT)
    marks = tmp_path / "marks"
    marks.mkdir()
    try:
        overlayrec("run", "-w", m.ws, "--session", "ps", "--", sys.executable, str(agent),
                   str(marks), cwd=m.ws)
    finally:
        (marks / "go").touch()
    units = {}
    for e in m.events():
        if e.get("path") and e["op"] in ("create", "write"):
            units.setdefault(e["path"], set()).add(
                (e["unit"], e.get("chosen"), bool(e.get("after_end"))))
    assert units == {"a.txt": {("call:ps:a", "during", False)},
                     "b.txt": {("call:ps:b", None, False)},
                     "late.txt": {("call:ps:b", None, True)},
                     "between.txt": {("turn:ps:2", None, False)},
                     "c.txt": {("call:ps:c", "during", False)}}
    rows = {r["id"]: r for r in map(json.loads, overlayrec("calls", m.ws, "--json").stdout
                                    .splitlines())}
    assert [(rows[c]["paths"], rows[c]["guessed"]) for c in "abc"] == [
        (["a.txt"], ["a.txt"]), (["b.txt", "late.txt"], []), (["c.txt"], ["c.txt"])]
    assert "placed here by time (written while it ran, by a process the agent started " \
        "outside any call): a.txt" in overlayrec("calls", m.ws).stdout
    # blame says it alike (it said "by a guess", as for calls active together)
    assert " call:ps:a (placed in it by time): " in overlayrec("blame", "a.txt", "-w",
                                                               m.ws).stdout
    r = overlayrec("revert", m.ws, "--turn", "2")
    assert sorted(line.split()[-1] for line in r.stdout.splitlines()[:-1]) == \
        ["between.txt", "c.txt"]
    r = overlayrec("revert", m.ws, "--turn", "1")
    assert sorted(line.split()[-1] for line in r.stdout.splitlines()[:-1]) == \
        ["a.txt", "b.txt", "late.txt"]


def test_a_subagents_calls_inside_its_task_call_are_their_own(make_mount, tmp_path):
    """A subagent runs inside the agent's process while its Task call is active: its Bash and
    Edit calls are active together with the Task.  Their changes go to them (by command, by
    path), not to the Task that began first; one the evidence does not name goes to the
    newest (the inner call), said to be a guess."""
    m = make_mount().mount()
    agent = tmp_path / "agent.py"
    agent.write_text(textwrap.dedent('''
        import os, subprocess
        from overlayrec import client
        with client.connect() as c:
            c.call_begin("task", "Task", summary="tidy the notes")
            c.call_begin("bash", "Bash", summary="printf x > from_bash.txt")
            subprocess.run(["bash", "-c", "printf x > from_bash.txt"], check=True)
            c.call_end("bash")
            c.call_begin("edit", "Edit", summary=os.path.abspath("notes.txt"))
            open("notes.txt", "w").write("tidy")
            c.call_end("edit")
            c.call_begin("other", "Bash", summary="make notes")
            subprocess.run(["bash", "-c", "printf y > unnamed.txt"], check=True)
            c.call_end("other")
            c.call_end("task")
    '''))
    overlayrec("run", "-w", m.ws, "--session", "sub", "--", sys.executable, str(agent),
               cwd=m.ws)
    by = events_by_path(m)
    got = {p: {(e["unit"], e["chosen"]) for e in by[p]}
           for p in ("from_bash.txt", "notes.txt", "unnamed.txt")}
    assert got == {"from_bash.txt": {("call:sub:bash", "command")},
                   "notes.txt": {("call:sub:edit", "path")},
                   "unnamed.txt": {("call:sub:other", "newest")}}
    rows = {r["id"]: r for r in map(json.loads, overlayrec("calls", m.ws, "--json").stdout
                                    .splitlines())}
    assert [rows[c]["paths"] for c in ("task", "bash", "edit", "other")] == \
        [[], ["from_bash.txt"], ["notes.txt"], ["unnamed.txt"]]
    assert rows["other"]["guessed"] == ["unnamed.txt"] and rows["bash"]["guessed"] == []


SHAPES_AGENT = textwrap.dedent(r'''
    import os, subprocess, sys
    from overlayrec import client
    long_dir = sys.argv[1]
''') + SHELL + textwrap.dedent(r'''
    with client.connect() as c:
        c.turn_begin(prompt="shapes")
        c.call_begin("s", "Bash", summary="reshape")
        # builtins and quick commands of the one shell: a directory renamed with files
        # beneath, a fifo, a hard link, a symlink to a directory, a file ~4,000 bytes deep
        run("mv src lib; echo new >> lib/a.py; mkfifo pipe; ln keep.txt keep2.txt; "
            f"ln -s lib lib-link; echo deep > {long_dir}/f.txt; echo more >> keep.txt")
        c.call_end("s")
        c.turn_end()
    sh.stdin.close()
    sh.wait()
''')


def test_a_persistent_shells_call_reverts_whole_whatever_it_made(make_mount, tmp_path):
    """What a persistent shell did in a call (its commands by the process tree, its own writes
    by time) is that call's for every kind of change: a directory renamed with files beneath, a fifo, a hard link, a symlink to a
    directory, a ~4,000-byte path.  The listing names it as placed by time, the revert gives
    back the tree before the call exactly, and edits made while unmounted (to a path the call
    did not touch, to a file it only moved with its directory) stay."""
    import stat as stat_
    m = make_mount()
    os.makedirs(os.path.join(m.ws, "src", "pkg"))
    for rel, text in (("src/a.py", "a\n"), ("src/pkg/b.py", "b\n"), ("keep.txt", "k\n"),
                      ("other.txt", "o\n")):
        with open(os.path.join(m.ws, rel), "w") as f:
            f.write(text)
    parts = ["d" * 200] * 19  # 19 * 201 bytes: the file's path is ~3,830 bytes
    long_dir = os.path.join(*parts)
    os.makedirs(os.path.join(m.ws, long_dir))

    def tree():
        out = {}
        for dp, dns, fns in os.walk(m.ws):
            for n in dns + fns:
                p = os.path.join(dp, n)
                rel = os.path.relpath(p, m.ws)
                if rel.startswith(".overlayrec-attic"):
                    continue
                st = os.lstat(p)
                kind = stat_.S_IFMT(st.st_mode)
                data = open(p, "rb").read() if stat_.S_ISREG(st.st_mode) else \
                    os.readlink(p) if stat_.S_ISLNK(st.st_mode) else None
                out[rel] = (kind, data)
        return out
    before = tree()
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(SHAPES_AGENT)
    overlayrec("run", "-w", m.ws, "--session", "sh", "--", sys.executable, str(agent), long_dir,
               cwd=m.ws)
    row = json.loads(overlayrec("calls", m.ws, "--json").stdout.splitlines()[0])
    assert row["id"] == "s" and "lib/a.py" in row["paths"] and "pipe" in row["paths"]
    # mv, mkfifo and ln are processes the shell started in the call (the process tree says
    # so); what the shell wrote itself (echo) was placed by time, keep.txt under both names
    assert sorted(row["guessed"]) == sorted(["lib/a.py", f"{long_dir}/f.txt", "keep.txt",
                                             "keep2.txt"])
    assert {"lib", "pipe", "keep2.txt", "lib-link", "lib/pkg/b.py"} <= set(row["paths"])
    assert os.stat(os.path.join(m.ws, "keep2.txt")).st_ino == \
        os.stat(os.path.join(m.ws, "keep.txt")).st_ino
    # edits made while unmounted: to a path the call did not touch, and to one it only
    # moved (with its directory)
    m.umount()
    with open(os.path.join(m.ws, "other.txt"), "a") as f:
        f.write("by hand\n")
    with open(os.path.join(m.ws, "lib", "pkg", "b.py"), "a") as f:
        f.write("by hand\n")
    pre_revert = tree()
    m.mount()
    # the moved file's edit departs from what the call left (the unmount sealed what lies
    # beneath the directory it renamed): a conflict, as the same edit made through the mount
    r = overlayrec("revert", m.ws, "--call", "s", "--yes", check=False)
    assert r.returncode == 1 and "changed: lib/pkg/b.py" in r.stderr, r.stderr
    assert tree() == pre_revert
    overlayrec("revert", m.ws, "--call", "s", "--yes", "--force")
    got = tree()
    want = dict(before)
    # neither edit is the call's: both stay (the edited file where the user left it, its
    # directories with it), and the rest is back
    want["other.txt"] = (want["other.txt"][0], b"o\nby hand\n")
    for d in ("lib", "lib/pkg"):
        want[d] = want["src/pkg"]
    want["lib/pkg/b.py"] = (want["src/pkg/b.py"][0], b"b\nby hand\n")
    assert got == want


INTERRUPT_AGENT = textwrap.dedent(r'''
    import json, os, shlex, subprocess, sys
    PY, SESSION = sys.executable, "cc-int"
''') + HOOK + textwrap.dedent(r'''
    hook("UserPromptSubmit", prompt="first")
    hook("PreToolUse", tool_use_id="t1", tool_name="Bash", tool_input={"command": "sleep 0"})
    # the user stops the tool: no PostToolUse, no Stop; the next prompt comes
    hook("UserPromptSubmit", prompt="second")
    hook("PreToolUse", tool_use_id="t2", tool_name="Bash", tool_input={"command": "make it"})
    subprocess.run(["bash", "-c", "printf two > two.txt"], check=True)  # argv: not its words
    hook("PostToolUse", tool_use_id="t2", tool_name="Bash")
    hook("PostToolUse", tool_use_id="t1", tool_name="Bash")  # a stopped tool's end, late: no error
    hook("Stop")
''')


def test_a_call_interrupted_before_the_next_prompt_ends_there(make_mount, tmp_path):
    """A tool call the user stopped gets no end from the agent; the next prompt ends it
    (`interrupted`).  Left active, it stood beside every later call, whose changes were then
    placed among calls active together, each marked a guess."""
    m = make_mount()
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(INTERRUPT_AGENT)
    overlayrec("run", "-w", m.ws, "--session", "int", "--", sys.executable, str(agent), cwd=m.ws)
    rows = {r["id"]: r for r in map(json.loads, overlayrec("calls", m.ws, "--json").stdout
                                     .splitlines())}
    assert rows["t1"]["status"] == "interrupted" and rows["t1"]["turn"] == 1
    assert rows["t2"]["status"] == "ok" and rows["t2"]["paths"] == ["two.txt"]
    assert (rows["t2"]["guessed"], rows["t2"]["active_with"]) == ([], [])
    (ev,) = [e for e in m.events() if e.get("path") == "two.txt" and e["op"] == "create"]
    assert ev["unit"] == "call:int:t2" and "candidates" not in ev
    assert "guess" not in overlayrec("diff", m.ws, "--call", "t2").stderr


RESUMED_AGENT = textwrap.dedent(r'''
    import json, os, shlex, subprocess, sys
    PY, SESSION, TAG = sys.executable, "cc-resumed", sys.argv[1]
''') + HOOK + textwrap.dedent(r'''
    hook("SessionStart", source="startup" if TAG == "1" else "resume")
    hook("UserPromptSubmit", prompt=f"prompt {TAG}")
    hook("PreToolUse", tool_use_id=f"t{TAG}", tool_name="Bash",
         tool_input={"command": f"printf {TAG} > f{TAG}.txt"})
    subprocess.run(["bash", "-c", f"printf {TAG} > f{TAG}.txt"], check=True)
    hook("PostToolUse", tool_use_id=f"t{TAG}", tool_name="Bash")
    hook("Stop")
    if TAG != "2":  # the second is killed: no SessionEnd
        hook("SessionEnd")
''')


def test_a_resumed_session_is_a_session_of_its_own(make_mount, tmp_path):
    """An agent's session resumed by a new process (`claude --resume`: the same session id)
    under a mount with the hooks installed, in the same mount and after a remount, and a
    second `run --session` of one name.  The hook said "session ... already exists" and the
    resumed work was no session's (its call listed 0 files); after a remount its turn 1 took
    the first one's record (`turns` lost it).  Each is a session of its own, NAME.2 ..."""
    m = make_mount()
    agent = tmp_path / "agent.py"
    agent.write_text(RESUMED_AGENT)
    m.mount()
    try:
        for tag in ("1", "2", "3"):  # 2 never ends its session: 3 resumes it in this mount
            subprocess.run([sys.executable, str(agent), tag], cwd=m.ws, check=True)
    finally:
        m.umount()
    m.mount()
    try:
        subprocess.run([sys.executable, str(agent), "4"], cwd=m.ws, check=True)
        for _ in range(2):
            overlayrec("run", "--session", "named", "--", "sh", "-c", "echo x >> run.txt",
                       cwd=m.ws)
    finally:
        m.umount()
    turns = {(t["session"], t["index"]): t for t in
             map(json.loads, overlayrec("turns", m.ws, "--json").stdout.splitlines())}
    want = {"cc-resumed": "1", "cc-resumed.2": "2", "cc-resumed.3": "3", "cc-resumed.4": "4"}
    for sid, tag in want.items():
        assert turns[(sid, 1)]["prompt"] == f"prompt {tag}", turns
        d = overlayrec("diff", m.ws, "--session", sid, "--name-status").stdout
        assert d == f"A\tf{tag}.txt\n", (sid, d)
    rows = {r["id"]: r for r in map(json.loads, overlayrec("calls", m.ws, "--json").stdout
                                     .splitlines())}
    for sid, tag in want.items():
        assert (rows[f"t{tag}"]["session"], rows[f"t{tag}"]["paths"]) == (sid, [f"f{tag}.txt"])
    sessions = {json.loads(line)["session"] for line in
                overlayrec("log", m.ws, "--op", "session_begin", "--json").stdout.splitlines()}
    assert {"named", "named.2"} <= sessions


def test_a_session_resumed_under_a_second_run_of_one_mount_is_that_runs(make_mount, tmp_path):
    """The agent's session id names the first `run`'s session (an alias); resumed under a
    second `run` of the same mount, its hooks went to the first, ended session: the second
    run's turns and calls were recorded under the first (its call: 0 files)."""
    m = make_mount()
    agent = tmp_path / "agent.py"
    agent.write_text(RESUMED_AGENT)
    m.mount()
    try:
        for tag in ("1", "3"):
            overlayrec("run", "--", sys.executable, str(agent), tag, cwd=m.ws)
    finally:
        m.umount()
    rows = {r["id"]: r for r in map(json.loads, overlayrec("calls", m.ws, "--json").stdout
                                     .splitlines())}
    assert rows["t1"]["paths"] == ["f1.txt"] and rows["t3"]["paths"] == ["f3.txt"]
    assert rows["t1"]["session"] != rows["t3"]["session"]
    turns = {t["session"]: t for t in
             map(json.loads, overlayrec("turns", m.ws, "--json").stdout.splitlines())}
    assert turns[rows["t3"]["session"]]["prompt"] == "prompt 3"
    assert turns[rows["t1"]["session"]]["prompt"] == "prompt 1"
