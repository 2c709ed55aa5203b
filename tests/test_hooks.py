"""Hooks installed in a workspace (`install-hooks`, no `overlayrec run`), driven by a fake agent
through a real mount: which process is the agent, what a call left open at its turn's end
holds, a payload whose cwd is outside the mount, ids and text fields that are not strings;
and the fast path under `run` with a payload of several lines."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import SLOW, force_unmount, overlayrec

pytestmark = pytest.mark.timeout(int(180 * SLOW))

# The fake agent: runs each step of the JSON list in its last argument, in order.
# ["hook", EVENT, PAYLOAD] pipes PAYLOAD (with hook_event_name, and cwd and session_id unless
# given) to every command the project's Claude Code settings hold for EVENT, from the agent's
# own working directory, and keeps what they said on stderr in ../hook-stderr; ["sh", COMMAND]
# runs a command as a child; ["write", PATH, TEXT] writes a file itself (an agent's own edit);
# ["sleep", SECONDS] waits.  Any arguments before the list only make
# its command line longer.
AGENT = r'''
import json, os, subprocess, sys, time
steps = json.loads(sys.argv[-1])
here = os.getcwd()
hooks = json.load(open(os.path.join(here, ".claude", "settings.json")))["hooks"]
for step in steps:
    if step[0] == "hook":
        p = dict({"cwd": here, "session_id": "S1"}, hook_event_name=step[1], **step[2])
        for g in hooks[step[1]]:
            for h in g["hooks"]:
                r = subprocess.run(["/bin/sh", "-c", h["command"]], input=json.dumps(p).encode(),
                                   capture_output=True)
                assert r.returncode == 0, r
                if r.stderr:
                    with open(os.path.join(os.path.dirname(here), "hook-stderr"), "ab") as f:
                        f.write(r.stderr)
    elif step[0] == "sh":
        subprocess.run(["bash", "-c", step[1]], check=True)
    elif step[0] == "write":
        with open(step[1], "w") as f:
            f.write(step[2])
    else:
        time.sleep(step[1])
'''


def clean_env() -> dict:
    """Hooks as outside `run`: no socket named (the hook finds the mount by its cwd)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("OVERLAYREC_")}


def installed(make_mount, tmp_path):
    """A mount of a workspace with Claude Code's hooks installed in it, and the fake agent."""
    m = make_mount()
    overlayrec("install-hooks", "claude-code", "--project", m.ws)
    (tmp_path / "agent.py").write_text(AGENT)
    return m.mount()


def run_agent(m, tmp_path, steps, *more, cwd=None, env=None):
    r = subprocess.run([sys.executable, str(tmp_path / "agent.py"), *more, json.dumps(steps)],
                       cwd=cwd or m.ws, env=env or clean_env(), capture_output=True, text=True,
                       timeout=120 * SLOW)
    assert r.returncode == 0, r
    return r


def hook_stderr(m) -> str:
    path = os.path.join(m.base, "hook-stderr")
    return open(path).read() if os.path.exists(path) else ""


def rows(m, *args):
    return [json.loads(line) for line in
            overlayrec(*args, m.ws, "--json", env=clean_env()).stdout.splitlines()]


def units_of(m, path: str) -> set[str]:
    return {e.get("unit") for e in m.events() if e.get("path") == path and e.get("unit")}


def only_the_agents_is_reverted(m, unit: str, *selection: str) -> None:
    """a.txt is ``unit``'s, b.txt (the user's edit) an outside writer's, and a revert of the
    selection would put back a.txt alone."""
    assert units_of(m, "a.txt") == {unit}
    got = units_of(m, "b.txt")
    assert got and all(u.startswith("outside:") for u in got), got
    plan = json.loads(overlayrec("revert", m.ws, *selection, "--json", env=clean_env()).stdout)
    assert {s["path"] for s in plan["steps"]} == {"a.txt"}, plan


def one_call(cid: str, command: str, post: bool = True) -> list:
    steps = [["hook", "PreToolUse", {"tool_name": "Bash", "tool_use_id": cid,
                                     "tool_input": {"command": command}}],
             ["sh", command]]
    if post:
        steps.append(["hook", "PostToolUse", {"tool_name": "Bash", "tool_use_id": cid,
                                              "tool_input": {}, "tool_response": {}}])
    return steps


START = [["hook", "SessionStart", {"source": "startup"}],
         ["hook", "UserPromptSubmit", {"prompt": "p1"}]]


def test_an_agent_whose_command_line_mentions_overlayrec_is_the_agent(make_mount, tmp_path):
    """The agent was looked for as the hook's first ancestor that is no shell and whose
    command line does not mention "overlayrec": `claude "fix the overlayrec tests"` was
    skipped, the terminal above it taken for the agent, and the user's own edit made in
    another pane of it put in the agent's turn (and undone by `revert --turn`)."""
    m = installed(make_mount, tmp_path)
    try:
        with open(os.path.join(m.ws, "b.txt"), "w") as f:
            f.write("keep\n")
        steps = START + one_call("c1", "echo one > a.txt") + [["hook", "Stop", {}]]
        terminal = (f"import subprocess, sys\n"
                    f"subprocess.run(['bash', '-c', 'exec \"$0\" \"$@\"', sys.executable, "
                    f"{str(tmp_path / 'agent.py')!r}, 'please fix the overlayrec tests', "
                    f"{json.dumps(steps)!r}], cwd={m.ws!r}, check=True)\n"
                    f"subprocess.run(['bash', '-c', 'echo user-edit > b.txt'], cwd={m.ws!r}, "
                    f"check=True)\n")
        subprocess.run([sys.executable, "-c", terminal], env=clean_env(), check=True,
                       timeout=120 * SLOW)
        only_the_agents_is_reverted(m, "call:S1:c1", "--turn", "1")
    finally:
        m.umount()


@pytest.mark.parametrize("host_name", ["tmux", "sshd"])
def test_a_session_begun_by_hand_in_a_terminal_pane_is_that_shells(make_mount, tmp_path,
                                                                    host_name):
    """`overlayrec session begin` typed in a tmux pane: the agent was taken as the first
    ancestor that is no shell, the tmux server, so the user's vim in another pane wrote as
    the session's call, and `revert --call` threw the user's edit away (found by a bug hunt).
    What hosts the terminals is no agent: the shell the session was begun from is."""
    m = make_mount()
    for name in ("a.txt", "b.txt"):
        with open(os.path.join(m.ws, name), "w") as f:
            f.write("base\n")
    m.mount()
    try:
        o = f"{sys.executable} -m overlayrec"
        ready, go = tmp_path / "ready", tmp_path / "go"
        pane1 = (f"{o} session begin --session S >/dev/null && {o} turn begin --prompt T "
                 f">/dev/null && {o} call begin --id c1 --tool Bash >/dev/null && "
                 f"echo agent >> a.txt && touch {ready} && "
                 f"while [ ! -e {go} ]; do sleep 0.02; done && {o} call end --id c1 "
                 f">/dev/null && {o} turn end >/dev/null && {o} session end --session S "
                 f">/dev/null")
        pane2 = f"echo user >> b.txt && touch {go}"
        # the terminals' host: a process whose name is the host's, each pane a shell of it
        host = (f"bash -c {shlex.quote(pane1)} & p=$!; while [ ! -e {ready} ]; do "
                f"kill -0 $p || exit 1; sleep 0.02; done; bash -c {shlex.quote(pane2)}; wait $p")
        subprocess.run(["bash", "-c", f'exec -a {host_name} bash -c "$0"', host], cwd=m.ws,
                       env=clean_env(), check=True, timeout=120 * SLOW)
        only_the_agents_is_reverted(m, "call:S:c1", "--call", "c1")
    finally:
        m.umount()


def test_overlayrecs_own_command_lines_are_told_from_an_agents():
    from overlayrec.calls import is_overlayrec
    py = sys.executable
    assert is_overlayrec([py, "-m", "overlayrec", "hook", "claude-code"])
    assert is_overlayrec([py, "-S", "-c", "import sys; sys.path.insert(0, '/x'); "
                          "from overlayrec.entry import main; main()", "hook", "codex"])
    assert is_overlayrec([py, "/venv/bin/overlayrec", "run", "--", "claude"])
    assert is_overlayrec(["/usr/local/bin/overlayrec", "run"])
    assert not is_overlayrec(["claude", "fix the overlayrec tests"])
    assert not is_overlayrec(["node", "/usr/lib/codex/cli.js", "--cd", "/src/overlayrec"])
    assert not is_overlayrec([py, "/src/overlayrec/tools/agent.py"])
    assert not is_overlayrec([py, "-c", "print('overlayrec')"])
    assert not is_overlayrec([])


def test_a_call_the_agent_never_ended_ends_with_its_turn(make_mount, tmp_path):
    """A tool call with no PostToolUse (a denied tool, a post hook that timed out) stayed
    active past its turn's Stop: a later write in no call went into it, which `calls --turn 1`
    and `revert --turn 1` held while `turns` and `diff --turn 1` did not."""
    m = installed(make_mount, tmp_path)
    try:
        run_agent(m, tmp_path, START + one_call("c1", "echo 1 > f1", post=False)
                  + [["hook", "Stop", {}], ["sleep", 0.3], ["sh", "echo 2 > f2"],
                     ["hook", "PostToolUse", {"tool_name": "Bash", "tool_use_id": "c1",
                                              "tool_input": {}, "tool_response": {}}]])
        assert hook_stderr(m) == ""  # the late end is taken silently
        calls = rows(m, "calls")
        assert [(c["id"], c["status"], c["paths"]) for c in calls] == \
            [("c1", "interrupted", ["f1"])], calls
        assert units_of(m, "f2") == {"session:S1"}
        assert rows(m, "calls", "--turn", "1") == calls
        names = {line.split()[-1] for line in overlayrec(
            "diff", m.ws, "--turn", "1", "--name-status", env=clean_env()).stdout.splitlines()}
        assert names == {"f1"}
        plan = json.loads(overlayrec("revert", m.ws, "--turn", "1", "--json",
                                     env=clean_env()).stdout)
        assert {s["path"] for s in plan["steps"]} == {"f1"}, plan
    finally:
        m.umount()


def test_a_stop_a_stop_hook_blocked_is_taken_up_again_to_the_last_stop(make_mount, tmp_path):
    """Claude Code sends Stop, a Stop hook of the user's answers {"decision": "block"}, and
    Claude goes on in the same turn (no new prompt) and stops again (``stop_hook_active``).
    The turn ended at the first Stop: the later calls were of no turn, `turns` and `diff
    --turn 1` left them out, `revert --turn 1` conflicted with them, and an export made
    meanwhile kept the turn's commit at the first Stop.  The turn now holds them all and
    ends at the last Stop, a Stop with nothing between included."""
    m = installed(make_mount, tmp_path)
    try:
        export = f"{sys.executable} -m overlayrec export git {m.ws} >/dev/null"
        run_agent(m, tmp_path, START + one_call("c1", "echo 1 > f1")
                  + [["hook", "Stop", {"stop_hook_active": False}], ["sh", export],
                     ["write", "own", "the agent's own\n"]]
                  + one_call("c2", "echo 2 > f1; echo ok > f2")
                  + [["hook", "Stop", {"stop_hook_active": True}],
                     ["hook", "Stop", {"stop_hook_active": True}],  # blocked again: no call
                     ["hook", "UserPromptSubmit", {"prompt": "p2"}]]
                  + one_call("c3", "echo 3 > f3") + [["hook", "Stop", {}],
                                                     ["hook", "SessionEnd", {}]])
        assert hook_stderr(m) == ""
        assert [(c["id"], c["turn"], c["status"]) for c in rows(m, "calls")] == \
            [("c1", 1, "ok"), ("c2", 1, "ok"), ("c3", 2, "ok")]
        assert units_of(m, "own") == {"turn:S1:1"}
        stops = [e["seq"] for e in m.events() if e["op"] == "turn_end" and e.get("turn") == 1]
        again = [e["seq"] for e in m.events() if e["op"] == "turn_begin" and e.get("again")]
        assert len(stops) == 3 and len(again) == 2, (stops, again)
        turns = rows(m, "turns")
        assert [(t["index"], t["seq"][1], sorted(t["paths"])) for t in turns] == \
            [(1, stops[-1], ["f1", "f2", "own"]), (2, turns[1]["seq"][1], ["f3"])], turns
        assert rows(m, "calls", "--turn", "1") == rows(m, "calls")[:2]
        names = {line.split()[-1] for line in overlayrec(
            "diff", m.ws, "--turn", "1", "--name-status", env=clean_env()).stdout.splitlines()}
        assert names == {"f1", "f2", "own"}
        plan = json.loads(overlayrec("revert", m.ws, "--turn", "1", "--json",
                                     env=clean_env()).stdout)
        assert {s["path"] for s in plan["steps"]} == {"f1", "f2", "own"}, plan
        assert not plan.get("conflicts"), plan
        # the export made at the first Stop is taken on: the turn's commit is at its last
        gd = json.loads(overlayrec("export", "git", m.ws, "--json", env=clean_env()).stdout)[
            "git_dir"]
        git = ["git", "--git-dir", gd]
        got = subprocess.run(git + ["diff", "--stat", "refs/overlayrec/S1/base",
                                    "refs/overlayrec/S1/turns/1"], capture_output=True,
                             text=True, check=True).stdout
        assert got == overlayrec("diff", m.ws, "--turn", "1", "--stat", env=clean_env()).stdout
        msg = subprocess.run(git + ["log", "-1", "--format=%B", "refs/overlayrec/S1/turns/1"],
                             capture_output=True, text=True, check=True).stdout
        assert f"Overlayrec-Seq: {turns[0]['seq'][0]}..{stops[-1]}" in msg, msg
    finally:
        m.umount()


def test_a_payload_whose_cwd_is_outside_the_mount_is_taken_by_the_hooks_own(make_mount,
                                                                              tmp_path):
    """Claude Code's payload cwd follows its Bash tool's `cd` (into an --add-dir directory,
    outside the mount) while the hook runs in the workspace: the hook looked only at the
    payload's cwd, and dropped the turn, its call and the session's end without a word."""
    m = installed(make_mount, tmp_path)
    try:
        other = str(tmp_path / "other")
        os.mkdir(other)
        f2 = os.path.join(m.ws, "f2")
        there = {"cwd": other}
        run_agent(m, tmp_path, START + one_call("c1", "echo 1 > f1") + [
            ["hook", "Stop", {}],
            ["hook", "UserPromptSubmit", dict(there, prompt="p2")],
            ["hook", "PreToolUse", dict(there, tool_name="Bash", tool_use_id="c2",
                                        tool_input={"command": f"echo 2 > {f2}"})],
            ["sh", f"echo 2 > {f2}"],
            ["hook", "PostToolUse", dict(there, tool_name="Bash", tool_use_id="c2",
                                         tool_input={}, tool_response={})],
            ["hook", "Stop", there], ["hook", "SessionEnd", there]])
        assert hook_stderr(m) == ""
        assert [(t["index"], t["prompt"], bool(t["end_t"])) for t in rows(m, "turns")] == \
            [(1, "p1", True), (2, "p2", True)]
        assert [(c["id"], c["turn"], c["status"], c["paths"]) for c in rows(m, "calls")] == \
            [("c1", 1, "ok", ["f1"]), ("c2", 2, "ok", ["f2"])]
        assert units_of(m, "f2") == {"call:S1:c2"}
        assert "session_end" in {e["op"] for e in m.events()}
    finally:
        m.umount()


@pytest.mark.parametrize("name", ["claude-code", "cursor"])
def test_install_hooks_refuses_a_settings_file_that_is_not_utf8_in_one_line(tmp_path, name):
    """A settings file in Latin-1 gave "internal error: UnicodeDecodeError ..."; JSON is
    UTF-8, so it is refused as a file that is not JSON is, and left as it is."""
    from overlayrec import agents
    path = agents.settings_path(name, str(tmp_path))
    os.makedirs(os.path.dirname(path))
    before = b'{"model": "caf\xe9"}\n'
    with open(path, "wb") as f:
        f.write(before)
    for remove in ((), ("--remove",)):
        r = overlayrec("install-hooks", name, "--project", str(tmp_path), *remove, check=False)
        assert r.returncode == 1 and r.stdout == "", r
        assert r.stderr.count("\n") == 1 and "is not valid JSON (not UTF-8" in r.stderr, r.stderr
        assert "not touching it" in r.stderr and "Traceback" not in r.stderr
        with open(path, "rb") as f:
            assert f.read() == before


BAD_IDS = [("claude-code", "SessionStart", "session_id", 5),
           ("cursor", "sessionStart", "conversation_id", ["a"]),
           ("claude-code", "UserPromptSubmit", "session_id", {"a": 1}),
           ("codex", "PreToolUse", "session_id", 7),
           ("gemini", "BeforeAgent", "session_id", 0)]


def test_a_session_id_that_is_not_a_string_is_a_bad_request_in_one_line(make_mount):
    """A session or conversation id that was a number, a list or an object: tracebacks in the
    daemon's log ("control request failed"), "internal error: 'int' object has no attribute
    'encode'" from the hook, "unhashable type" for an object, and a number on other events
    taken quietly.  Now a bad request, said in one line, on every path: the hook, a raw
    payload on the socket (the fast hook), a control request."""
    from overlayrec import client
    m = make_mount().mount()
    try:
        for name, event, key, value in BAD_IDS:
            payload = {"hook_event_name": event, key: value, "cwd": m.ws, "prompt": "p",
                       "tool_name": "Bash", "tool_use_id": "t1", "tool_input": {}}
            r = subprocess.run([sys.executable, "-m", "overlayrec", "hook", name],
                               input=json.dumps(payload), capture_output=True, text=True,
                               cwd=m.ws, env=clean_env(), timeout=30 * SLOW)
            assert r.returncode == 0, r
            assert r.stderr == f"overlayrec hook: bad request: {key} must be a string\n", r
            with client.Client(os.path.join(m.state, "control.sock")) as c:
                with pytest.raises(client.ClientError,
                                   match=f"^bad request: {key} must be a string$"):
                    _raw(c, payload)
        for op in ("session_begin", "turn_begin", "session_end", "pin"):
            with client.Client(os.path.join(m.state, "control.sock")) as c:
                with pytest.raises(client.ClientError,
                                   match="^bad request: session must be a string$"):
                    c.request(op, session=5)
        assert rows(m, "turns") == [] and rows(m, "calls") == []
        assert "session_begin" not in {e["op"] for e in m.events()}
        with open(os.path.join(m.state, "daemon.log")) as f:
            log = f.read()
        assert "Traceback" not in log and "control request failed" not in log, log
    finally:
        m.umount()


def _hook(name: str, m, **payload) -> subprocess.CompletedProcess:
    """`overlayrec hook NAME` with ``payload`` (its cwd the workspace), as outside `run`."""
    r = subprocess.run([sys.executable, "-m", "overlayrec", "hook", name],
                       input=json.dumps(dict(payload, cwd=m.ws)), capture_output=True,
                       text=True, cwd=m.ws, env=clean_env(), timeout=30 * SLOW)
    assert r.returncode == 0, r
    return r


def test_text_fields_that_are_not_strings_are_kept_as_text_or_refused(make_mount):
    """A prompt that was an object, a number or a list was taken as it was, and from then on
    `turns`, `export git` and `report` failed on its record; a tool name that was an object
    was kept as its Python repr.  A hook payload's are kept as their JSON text (the agent sent
    them: the turn and the call are not lost), on both paths (`overlayrec hook`, a raw payload
    on the socket); a control request's are refused, before anything is journaled."""
    from overlayrec import client
    m = make_mount().mount()
    try:
        sock = os.path.join(m.state, "control.sock")
        r = _hook("claude-code", m, hook_event_name="SessionStart", session_id="S1")
        r = _hook("claude-code", m, hook_event_name="UserPromptSubmit", session_id="S1",
                  prompt={"text": "fix it"})
        assert r.stderr == "", r
        r = _hook("claude-code", m, hook_event_name="PreToolUse", session_id="S1",
                  tool_use_id="t1", tool_name={"name": "Bash"}, tool_input={"command": "ls"})
        assert r.stderr == "", r
        with client.Client(sock) as c:
            _raw(c, {"hook_event_name": "beforeSubmitPrompt", "conversation_id": "S1",
                     "prompt": 5})
            _raw(c, {"hook_event_name": "preToolUse", "conversation_id": "S1",
                     "tool_use_id": "t2", "tool_name": ["Edit"], "tool_input": {}})
        before = len(m.events())
        refused = [("turn_begin", {"prompt": {"a": 1}}, "prompt"),
                   ("turn_begin", {"prompt": ["a"]}, "prompt"),
                   ("call_begin", {"id": "t3", "tool": {"a": 1}}, "tool"),
                   ("call_begin", {"id": "t3", "tool": "Bash", "summary": 5}, "summary"),
                   ("call_end", {"id": "t2", "status": {"a": 1}}, "status"),
                   ("session_begin", {"command": "ls"}, "command"),
                   ("session_begin", {"command": ["ls", 5]}, "command")]
        for op, fields, field in refused:
            with client.Client(sock) as c:
                with pytest.raises(client.ClientError,
                                   match=f"^bad request: {field} must be "):
                    c.request(op, session="S1", **fields)
        assert len(m.events()) == before  # nothing of them journaled
        assert [t["prompt"] for t in rows(m, "turns")] == ['{"text":"fix it"}', "5"]
        assert [(c["id"], c["tool"]) for c in rows(m, "calls")] == \
            [("t1", '{"name":"Bash"}'), ("t2", '["Edit"]')]
        assert overlayrec("turns", m.ws, env=clean_env()).returncode == 0
        with open(os.path.join(m.state, "daemon.log")) as f:
            assert "Traceback" not in f.read()
    finally:
        m.umount()
    overlayrec("export", "git", m.ws, "--state-dir", m.state, env=clean_env())
    overlayrec("report", m.ws, "--state-dir", m.state, "--html",
               os.path.join(m.base, "report.html"), env=clean_env())


def test_a_lone_surrogate_is_kept_as_u_fffd_and_a_refusal_journals_nothing(make_mount):
    """A prompt or a command cut inside an emoji (JSON "\\ud83d", as JSON.stringify writes
    it) was refused with an encoding error after the daemon had journaled the turn's (the
    call's) begin: `turns`, `calls` and `diff --turn/--call` knew nothing of it, and its end
    was refused too.  Text keeps such a character as U+FFFD (a byte that was not UTF-8,
    U+DC80..U+DCFF, is kept as it is); an id that holds one is refused before anything of
    its request is journaled."""
    from overlayrec import client
    m = make_mount().mount()
    try:
        sock = os.path.join(m.state, "control.sock")
        for ev, kw in (("SessionStart", {}), ("UserPromptSubmit", {"prompt": "fix \ud83d"}),
                       ("PreToolUse", {"tool_use_id": "c1", "tool_name": "Bash",
                                       "tool_input": {"command": "echo 1 > a.txt # \ud83d"}})):
            r = _hook("claude-code", m, hook_event_name=ev, session_id="S1", **kw)
            assert r.stderr == "", r
        m.sh("echo 1 > a.txt")
        for ev in ("PostToolUse", "Stop"):
            r = _hook("claude-code", m, hook_event_name=ev, session_id="S1", tool_use_id="c1")
            assert r.stderr == "", r
        with client.Client(sock) as c:  # the fast hook's path, and a client's
            _raw(c, {"hook_event_name": "beforeSubmitPrompt", "conversation_id": "S1",
                     "prompt": "again \ud800"})
            c.request("call_begin", session="S1", id="c2", tool="Edit\udfff",
                      summary="bytes \udcff kept")
            c.request("call_end", session="S1", id="c2")
            before = m.events()
            for fields, said in (({"id": "c\ud83d", "tool": "Bash"}, "id"),
                                 ({"session": "S\ud83d", "id": "c3", "tool": "Bash"},
                                  "session"),
                                 ({"session": "S\udcff", "id": "c3", "tool": "Bash"},
                                  "session")):
                with pytest.raises(client.ClientError, match=f"^bad request: {said} must be "):
                    c.request("call_begin", **dict({"session": "S1"}, **fields))
            with pytest.raises(client.ClientError, match="^bad request: session must be "):
                c.request("session_begin", session="\ud83d")
            assert m.events() == before  # nothing of them journaled
        turns = rows(m, "turns")
        assert [t["prompt"] for t in turns] == ["fix \ufffd", "again \ufffd"]
        calls = {c["id"]: c for c in rows(m, "calls")}
        assert (calls["c1"]["summary"], calls["c1"]["status"], calls["c1"]["paths"]) == \
            ("echo 1 > a.txt # \ufffd", "ok", ["a.txt"])
        assert (calls["c2"]["tool"], calls["c2"]["summary"], calls["c2"]["turn"]) == \
            ("Edit\ufffd", "bytes \udcff kept", 2)
        assert overlayrec("diff", m.ws, "--turn", "1", env=clean_env()).stdout
        assert overlayrec("diff", m.ws, "--call", "c1", env=clean_env()).stdout
        with open(os.path.join(m.state, "daemon.log")) as f:
            assert "Traceback" not in f.read()
    finally:
        m.umount()


def test_the_daemons_calls_refuse_text_they_cannot_keep_before_journaling(tmp_path):
    """Calls journaled a turn's begin (and the end of the turn before, and its interrupted
    calls) and only then failed to write the turn's record over a lone surrogate; a call's
    begin the same.  Refused first now, whoever asks: nothing journaled, nothing changed."""
    from overlayrec.attribution import Attribution
    from overlayrec.calls import Calls
    from overlayrec.journal import Journal
    from overlayrec.journal.schema import call_key
    j = Journal(str(tmp_path))
    try:
        calls = Calls(j, Attribution())
        me = Attribution().actor(os.getpid())
        calls.session_begin(me, "S", runner=True)
        calls.turn_begin(me, "S", "p1")
        calls.call_begin(me, "S", "c1", "Bash", "ls")
        seqs = j.last_seq()
        for bad in (lambda: calls.turn_begin(me, "S", "p2 \ud83d"),
                    lambda: calls.call_begin(me, "S", "c2", "Bash", "ls \ud83d"),
                    lambda: calls.call_begin(me, "S", "c\ud83d", "Bash", None)):
            with pytest.raises(ValueError, match="must be UTF-8 text"):
                bad()
        assert j.last_seq() == seqs
        s = calls.sessions["S"]
        assert [t["index"] for t in s.turns] == [1] and s.turn_index() == 1
        assert [c.id for c in s.active] == ["c1"]
        calls.call_begin(me, "S", "c2", "Bash", "bytes \udcff")  # a byte not UTF-8: kept
        assert j.record("calls", call_key("S", "c2"))["summary"] == "bytes \udcff"
    finally:
        j.close()


def _raw(c, payload: dict) -> dict:
    """A hook's payload sent to the daemon as it is, as the fast hook's `nc` sends it."""
    from overlayrec import client
    c.sock.sendall(json.dumps(payload).encode() + b"\n")
    while b"\n" not in c._buf:
        c._buf += c.sock.recv(65536)
    line, c._buf = c._buf.split(b"\n", 1)
    out = json.loads(line)
    if not out.get("ok"):
        raise client.ClientError(out.get("error"))
    return out


PRETTY_CLAUDE = r'''
import json, os, subprocess, sys
hooks = json.load(open(sys.argv[sys.argv.index("--settings") + 1]))["hooks"]
def hook(ev, **kw):
    p = dict(hook_event_name=ev, session_id="S7", cwd=os.getcwd(), **kw)
    for g in hooks[ev]:
        for h in g["hooks"]:
            r = subprocess.run(["/bin/sh", "-c", h["command"]], capture_output=True,
                               input=json.dumps(p, indent=2).replace("\n", "\r\n").encode())
            assert r.returncode == 0 and r.stderr == b"", r
hook("SessionStart", source="startup")
hook("UserPromptSubmit", prompt="two\nlines")
hook("PreToolUse", tool_name="Bash", tool_use_id="c1", tool_input={"command": "echo 1 > f1"})
subprocess.run(["bash", "-c", "echo 1 > f1"], check=True)
hook("PostToolUse", tool_name="Bash", tool_use_id="c1", tool_input={}, tool_response={})
hook("Stop")
hook("SessionEnd")
'''


def test_the_fast_hook_takes_a_payload_laid_out_on_several_lines(make_mount, tmp_path):
    """Under `run` the hook pipes the payload to the daemon's socket with nc; the daemon
    reads a request a line, so a pretty-printed payload was refused line by line while nc
    exited 0: no turn, no call, and no fallback to `overlayrec hook`, which takes it."""
    if subprocess.run(["sh", "-c", "command -v nc"], capture_output=True).returncode:
        pytest.skip("needs nc (the fast hook's path)")
    m = make_mount().mount()
    try:
        bindir = tmp_path / "bin"
        bindir.mkdir()
        (bindir / "claude").write_text(f"#!{sys.executable}\n" + PRETTY_CLAUDE)
        (bindir / "claude").chmod(0o755)
        env = clean_env()
        overlayrec("run", "-w", m.ws, "--session", "R", "--", str(bindir / "claude"), env=env,
                   cwd=m.ws)
        assert [(t["prompt"], bool(t["end_t"])) for t in rows(m, "turns")] == \
            [("two\nlines", True)]
        assert [(c["id"], c["status"], c["paths"]) for c in rows(m, "calls")] == \
            [("c1", "ok", ["f1"])]
    finally:
        m.umount()


@pytest.mark.parametrize("name,text", [
    ("claude-code", '{\n  "model": "opus",\n  "hooks": {}\n}\n'),
    ("claude-code", '{\n  "hooks": {\n    "Stop": []\n  }\n}\n'),
    ("claude-code", '{\n  "hooks": {\n    "Stop": [],\n    "Notification": []\n  }\n}\n'),
    ("claude-code", '{\n  "model": "opus"\n}\n'),
    ("gemini", '{\n  "hooks": {\n    "AfterAgent": [],\n    "x": 1\n  }\n}\n'),
    ("cursor", '{\n  "version": 1\n}\n'),
    ("cursor", '{\n  "version": 1,\n  "hooks": {}\n}\n'),
    ("cursor", '{\n  "version": 1,\n  "hooks": {\n    "stop": []\n  }\n}\n'),
])
def test_install_then_remove_keeps_the_users_empty_tables(tmp_path, name, text):
    """`"hooks": {}` was dropped, `"Stop": []` too (the table then dropped), and Cursor's
    `{"version": 1}` gained `"hooks": {}`: install then --remove was not byte-identical, as
    docs/agents.md says it is.  An installed file runs our hooks still, once each."""
    from overlayrec import agents
    path = agents.settings_path(name, str(tmp_path))
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write(text)
    for _ in range(2):  # idempotent: a second install changes nothing
        overlayrec("install-hooks", name, "--project", str(tmp_path))
        with open(path) as f:
            installed_ = f.read()
        hooks = json.loads(installed_)["hooks"]
        for ev in agents.get(name).EVENTS:
            cmds = [h["command"] for h in hooks[ev]] if name == "cursor" else \
                [h["command"] for g in hooks[ev] for h in g["hooks"]]
            assert sum(f"overlayrec hook {name}" in c for c in cmds) == 1, (ev, cmds)
    overlayrec("install-hooks", name, "--project", str(tmp_path), "--remove")
    with open(path) as f:
        assert f.read() == text
    overlayrec("install-hooks", name, "--project", str(tmp_path), "--remove")  # none there
    with open(path) as f:
        assert f.read() == text


def test_a_daemon_whose_own_code_lies_in_the_workspace_answers_hooks(make_mount, tmp_path):
    """overlayrec installed inside the workspace it records (a project's venv, an editable
    checkout there): the first hook payload imported its agent's module through the daemon's
    own mount, the daemon waited on itself for good, and every process touching the workspace
    hung with it (found by a bug hunt).  The daemon imports all it needs before it mounts."""
    import overlayrec
    from overlayrec import client
    m = make_mount()
    lib = os.path.join(m.ws, "pylib")
    shutil.copytree(os.path.dirname(overlayrec.__file__), os.path.join(lib, "overlayrec"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    m.env = dict(os.environ, PYTHONPATH=lib)
    m.mount()
    try:
        with client.Client(os.path.join(m.state, "control.sock"), timeout=20) as c:
            _raw(c, {"hook_event_name": "SessionStart", "session_id": "S1", "cwd": m.ws,
                     "source": "startup"})
        r = subprocess.run(["cat", os.path.join(lib, "overlayrec", "__init__.py")],
                           capture_output=True, timeout=20)
        assert r.returncode == 0
    finally:
        m.umount()


def test_the_installed_hook_answers_in_a_workspace_whose_daemon_is_gone(make_mount, tmp_path):
    """The daemon killed in the middle of a run, its mount dead under the agent's cwd: the
    installed hook command's Python fallback looked for its imports in the cwd, died with a
    traceback (ENOTCONN), and Cursor got no answer (found by a bug hunt).  It gives the
    agent's answer, without a traceback, on both of its paths (nc to the socket's name, and
    none)."""
    import signal
    from overlayrec import agents
    m = make_mount().mount()
    sock = os.path.join(m.state, "control.sock")
    payload = json.dumps({"hook_event_name": "preToolUse", "conversation_id": "S1",
                          "generation_id": "g1", "tool_name": "Shell",
                          "tool_input": {"command": "ls"}, "cwd": m.ws})
    envs = [dict(clean_env(), OVERLAYREC_SOCKET=sock), clean_env()]
    # the agent: in the workspace before its daemon goes, hooks run from there after
    agent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        sys.path = [p for p in sys.path if p]  # (not the cwd, about to die)
        import json, selectors, subprocess, threading
        cmd, payload, envs = json.loads(sys.argv[1])
        sys.stdin.readline()
        out = [subprocess.run(["sh", "-c", cmd], input=payload, capture_output=True,
                              text=True, env=env, timeout=60) for env in envs]
        print(json.dumps([(r.returncode, r.stdout, r.stderr) for r in out]))
    """), json.dumps([agents.hook_command("cursor", "preToolUse"), payload, envs])],
        cwd=m.ws, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pid = json.load(open(os.path.join(m.state, "daemon.json")))["pid"]
    try:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        out, _ = agent.communicate("go\n", timeout=120)
        for code, stdout, stderr in json.loads(out):
            assert code == 0 and json.loads(stdout) == {"permission": "allow"} and \
                "Traceback" not in stderr, (code, stdout, stderr)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        force_unmount(m.ws)
