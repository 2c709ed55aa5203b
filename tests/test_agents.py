"""The agent registry (overlayrec/agents/): for each agent, its hook driven with payloads shaped
like the agent's published reference, through a real mount under `overlayrec run` with a fake
agent named like the real one that runs the hook commands from wherever `run` put them, the way
the agent reads them; install-hooks then --remove leaves the user's file byte-identical; a
killed run leaves the user's settings as they were."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import SLOW, needs_fuse, overlayrec
from overlayrec import agents

PROGRAM = {"claude-code": "claude", "codex": "codex", "gemini": "gemini", "cursor": "cursor-agent"}

# -- payloads shaped like each agent's reference (docs/agents.md names the pages) ---------------
FAKE = r'''
import json, os, subprocess, sys, tomllib
AGENT = __AGENT__
args = sys.argv[1:]
cwd = os.getcwd()
ts = "2026-11-30T12:00:00Z"
SID = "S1"  # the agent's session id: a /clear begins another in the same process


def hooks_for(event):
    """The commands this agent would run for ``event``, read where the real agent reads them."""
    if AGENT == "claude-code":
        path = args[args.index("--settings") + 1]
        table = json.load(open(path))["hooks"]
    elif AGENT == "codex":
        table = {}
        for i, a in enumerate(args):
            if a == "-c" and args[i + 1].startswith("hooks."):
                key, _, value = args[i + 1].partition("=")
                table[key.split(".", 1)[1]] = tomllib.loads("v = " + value)["v"]
        if not table and os.path.exists(os.path.expanduser("~/.codex/hooks.json")):
            table = json.load(open(os.path.expanduser("~/.codex/hooks.json")))["hooks"]
    elif AGENT == "gemini":
        table = json.load(open(os.environ["GEMINI_CLI_SYSTEM_SETTINGS_PATH"]))["hooks"]
    else:
        table = json.load(open(os.path.expanduser("~/.cursor/hooks.json")))["hooks"]
    if AGENT == "cursor":
        return [h["command"] for h in table.get(event, [])]
    return [h["command"] for g in table.get(event, []) for h in g["hooks"]]


def fire(event, env=None, **payload):
    payload["hook_event_name"] = event
    for cmd in hooks_for(event):
        r = subprocess.run(cmd, shell=True, input=json.dumps(payload), text=True,
                           capture_output=True, env=env)
        assert r.returncode == 0, r
        if AGENT in ("gemini", "cursor"):
            json.loads(r.stdout)  # JSON only, or the agent breaks
            if AGENT == "cursor" and event == "preToolUse":
                assert json.loads(r.stdout) == {"permission": "allow"}, r.stdout
        else:
            assert r.stdout == "", r
        assert r.stderr == "", r


def base(**kw):
    if AGENT == "claude-code":
        return dict(session_id=SID, transcript_path="/t.jsonl", cwd=cwd, **kw)
    if AGENT == "codex":
        return dict(session_id=SID, transcript_path=None, cwd=cwd, model="gpt-5-codex",
                    permission_mode="default", **kw)
    if AGENT == "gemini":
        return dict(session_id=SID, transcript_path="/t.json", cwd=cwd, timestamp=ts, **kw)
    return dict(conversation_id=SID, generation_id="g1", workspace_roots=[cwd],
                model="m", cursor_version="2.0", **kw)


def session_start():
    ev = {"cursor": "sessionStart"}.get(AGENT, "SessionStart")
    fire(ev, **base(source="startup") if AGENT != "cursor" else base())


def prompt(text, turn):
    ev = {"gemini": "BeforeAgent", "cursor": "beforeSubmitPrompt"}.get(AGENT, "UserPromptSubmit")
    extra = {"turn_id": f"turn{turn}"} if AGENT == "codex" else {}
    if AGENT == "cursor":
        extra = {"attachments": []}
    fire(ev, **base(prompt=text, **extra))


def stop(turn):
    if AGENT == "gemini":
        fire("AfterAgent", **base(prompt="p", prompt_response="done", stop_hook_active=False))
    elif AGENT == "cursor":
        fire("stop", **base(status="completed", loop_count=0))
    else:
        extra = {"turn_id": f"turn{turn}", "last_assistant_message": "done"} \
            if AGENT == "codex" else {}
        fire("Stop", **base(stop_hook_active=False, **extra))


def call(cid, command, turn, slow=False):
    """One shell tool call: before, the command (a child of the agent), after."""
    env = None
    if slow:  # the Python fallback: no socket in the hook's environment
        env = {k: v for k, v in os.environ.items() if k != "OVERLAYREC_SOCKET"}
    if AGENT == "gemini":
        pre = dict(tool_name="run_shell_command", tool_input={"command": command})
        fire("BeforeTool", env, **base(**pre))
        subprocess.run(command, shell=True, check=True)
        fire("AfterTool", env, **base(tool_response={"llmContent": "", "returnDisplay": ""},
                                      **pre))
    elif AGENT == "cursor":
        pre = dict(tool_name="Shell", tool_input={"command": command, "working_directory": cwd},
                   tool_use_id=cid, cwd=cwd)
        fire("preToolUse", env, **base(**pre))
        subprocess.run(command, shell=True, check=True)
        fire("postToolUse", env, **base(tool_output='{"exitCode":0}', duration=5, **pre))
    else:
        pre = dict(tool_name="Bash", tool_use_id=cid, tool_input={"command": command})
        if AGENT == "codex":
            pre["turn_id"] = f"turn{turn}"
        fire("PreToolUse", env, **base(**pre))
        subprocess.run(command, shell=True, check=True)
        post = dict(pre, tool_response={"exit_code": 0, "output": ""}) if AGENT == "codex" \
            else dict(pre, tool_response={"stdout": ""})
        fire("PostToolUse", env, **base(**post))


if args[:1] == ["exec"]:  # another agent a tool call runs (FAKE_NESTED), with hooks of its own
    SID = "N1"
    session_start()
    prompt("review b", 1)
    call("x1", "echo reviewed > review.txt", 1)
    stop(1)
    sys.exit(0)
session_start()
prompt("make a and b", 1)
call("c1", "echo a > a.txt", 1)
call("c2", "mkdir -p d && echo b > d/b.txt" + (" && codex exec review" if os.environ.get(
    "FAKE_NESTED") else ""), 1)
stop(1)
prompt("again, and drop a", 2)
call("c3", "echo a > a.txt", 2)          # the same command as c1: a repeat
call("c4", "rm a.txt && echo c > c.txt", 2, slow=True)
stop(2)
if os.environ.get("FAKE_CLEAR"):  # Claude Code's /clear: the session ends, the next begins
    fire("SessionEnd", **base(reason="clear"))
    SID = "S2"
    fire("SessionStart", **base(source="clear"))
    prompt("after the clear", 1)
    call("c5", "echo e > e.txt", 1)
    stop(1)
if AGENT in ("claude-code", "gemini", "cursor"):
    fire({"cursor": "sessionEnd"}.get(AGENT, "SessionEnd"), **base(reason="exit"))
'''


def fake_agent(tmp_path, name: str) -> str:
    bindir = tmp_path / f"bin-{name}"
    bindir.mkdir(exist_ok=True)
    prog = bindir / PROGRAM[name]
    prog.write_text(f"#!{sys.executable}\n" + FAKE.replace("__AGENT__", repr(name)))
    prog.chmod(0o755)
    return str(prog)


def run_env(home) -> dict:
    env = dict(os.environ)
    env.setdefault("XDG_STATE_HOME", os.path.join(os.path.expanduser("~"), ".local", "state"))
    env["HOME"] = str(home)  # the fake agents' user settings (cursor) live here
    env.pop("GEMINI_CLI_SYSTEM_SETTINGS_PATH", None)
    return env


def rows(*args, env=None):
    return [json.loads(line) for line in overlayrec(*args, "--json", env=env).stdout.splitlines()]


# -- the registry ---------------------------------------------------------------------------------

def test_the_registry_holds_every_agent_and_tells_their_payloads_apart():
    assert agents.names() == ["claude-code", "codex", "cursor", "gemini"]
    for name, prog in PROGRAM.items():
        assert agents.for_program(f"/usr/local/bin/{prog}").NAME == name
    assert agents.for_program("aider") is None and agents.for_program("bash") is None
    samples = {
        "claude-code": {"hook_event_name": "PreToolUse", "session_id": "s", "tool_use_id": "t",
                        "tool_name": "Bash", "permission_mode": "default"},
        "codex": {"hook_event_name": "PostToolUse", "session_id": "s", "model": "gpt-5",
                  "turn_id": "t1", "tool_use_id": "t"},
        "gemini": {"hook_event_name": "BeforeTool", "session_id": "s", "timestamp": "x",
                   "tool_name": "run_shell_command"},
        "cursor": {"hook_event_name": "preToolUse", "conversation_id": "c",
                   "tool_use_id": "t"},
    }
    for name, payload in samples.items():
        assert agents.recognise(payload).NAME == name
    assert agents.recognise({"hook_event_name": "SessionStart", "session_id": "s",
                             "timestamp": "2026"}).NAME == "gemini"
    assert agents.recognise({"hook_event_name": "NoSuchEvent"}) is None


class _Target:
    """The client's methods, recording requests and refusing as the daemon does."""

    def __init__(self):
        self.calls, self.log = {}, []

    def session_begin(self, session=None):
        self.log.append(("session_begin", session))

    def turn_begin(self, prompt=None, session=None):
        self.log.append(("turn_begin", prompt))

    def turn_end(self, session=None, resume=None, again=False):
        self.log.append(("turn_end", resume, again))

    def session_end(self, session=None):
        self.log.append(("session_end",))

    def call_begin(self, cid, tool, summary=None, session=None):
        if cid in self.calls:
            raise ValueError(f"call {cid} already begun in session x")
        self.calls[cid] = None
        self.log.append(("call_begin", cid, tool, summary))

    def call_end(self, cid, status="ok", session=None):
        if cid not in self.calls:
            raise ValueError(f"no call {cid} in session x")
        if self.calls[cid] is not None:
            raise ValueError(f"call {cid} already ended")
        self.calls[cid] = status
        self.log.append(("call_end", cid, status))


def test_each_agents_stop_says_that_a_stop_hook_may_take_its_turn_on():
    """A stop hook of the user's may block an agent's stop, and the agent goes on in the same
    turn: each agent's stop ends the turn saying what may take it up again, and its stop
    after a blocked one (``stop_hook_active``, Cursor's ``loop_count``) says so.  Cursor's
    agent may be the editor the user saves files in: only its calls take the turn up."""
    cases = [("claude-code", "Stop", {"stop_hook_active": False}, {"stop_hook_active": True}),
             ("codex", "Stop", {"stop_hook_active": False, "turn_id": "t"},
              {"stop_hook_active": True, "turn_id": "t"}),
             ("gemini", "AfterAgent", {"stop_hook_active": False},
              {"stop_hook_active": True}),
             ("cursor", "stop", {"status": "completed", "loop_count": 0},
              {"status": "completed", "loop_count": 1})]
    for name, ev, first, later in cases:
        t = _Target()
        for extra in (first, later):
            agents.get(name).apply(dict(extra, hook_event_name=ev, session_id="s"), t,
                                   (ValueError,))
        resume = "calls" if name == "cursor" else "any"
        assert t.log == [("turn_end", resume, False), ("turn_end", resume, True)], name


def test_gemini_calls_without_ids_pair_up_and_repeats_stay_apart():
    g = agents.get("gemini")
    t = _Target()
    pre = {"session_id": "s", "tool_name": "run_shell_command", "tool_input": {"command": "ls"}}
    for _ in range(2):
        g.apply(dict(pre, hook_event_name="BeforeTool"), t, (ValueError,))
    g.apply(dict(pre, hook_event_name="AfterTool", tool_response={"error": "boom"}), t,
            (ValueError,))
    g.apply(dict(pre, hook_event_name="AfterTool", tool_response={}), t, (ValueError,))
    base = next(iter(t.calls))
    assert t.calls == {base: "error", f"{base}.2": "ok"}
    assert base.startswith("run_shell_command-")
    g.apply(dict(pre, hook_event_name="AfterTool"), t, (ValueError,))  # no begin seen: nothing
    assert len(t.calls) == 2


def test_a_tool_calls_end_after_the_next_prompt_ended_it_is_no_error():
    """The daemon ends a call still open at the next prompt (``interrupted``: the user stopped
    the tool); the tool's end may still come.  Each agent's hook takes it silently, and a
    repeat of the same call without an id (Gemini) is still the one that ends."""
    for name, pre, post in (("claude-code", "PreToolUse", "PostToolUse"),
                            ("codex", "PreToolUse", "PostToolUse"),
                            ("cursor", "preToolUse", "postToolUse")):
        a, t = agents.get(name), _Target()
        p = {"session_id": "s", "tool_use_id": "t1", "tool_name": "Bash",
             "tool_input": {"command": "ls"}}
        a.apply(dict(p, hook_event_name=pre), t, (ValueError,))
        t.calls["t1"] = "interrupted"  # as the daemon's next turn_begin leaves it
        a.apply(dict(p, hook_event_name=post), t, (ValueError,))
        assert t.calls == {"t1": "interrupted"}, name
    g, t = agents.get("gemini"), _Target()
    pre = {"session_id": "s", "tool_name": "run_shell_command", "tool_input": {"command": "ls"}}
    g.apply(dict(pre, hook_event_name="BeforeTool"), t, (ValueError,))
    base = next(iter(t.calls))
    t.calls[base] = "interrupted"
    g.apply(dict(pre, hook_event_name="BeforeTool"), t, (ValueError,))
    g.apply(dict(pre, hook_event_name="AfterTool", tool_response={}), t, (ValueError,))
    assert t.calls == {base: "interrupted", f"{base}.2": "ok"}


# -- settings files: in and out again, byte for byte ---------------------------------------------

USER_SETTINGS = {
    # a user's own hook whose command names overlayrec and "hook claude-code" is theirs: it was
    # taken for ours and removed (found by a bug hunt)
    "claude-code": {"model": "opus", "hooks": {"PreToolUse": [
        {"matcher": "Edit", "hooks": [{"type": "command", "command":
                                       "/opt/overlayrec-extras/bin/audit-hook claude-code"}]}]},
        "permissions": {"allow": ["Bash(ls:*)"]}},
    "codex": {"hooks": {"Stop": [{"hooks": [{"type": "command", "command": "notify-send done",
                                             "timeout": 5}]}]}},
    "gemini": {"ui": {"theme": "GitHub"}, "hooks": {"BeforeTool": [
        {"matcher": "write_file", "hooks": [{"name": "scan", "type": "command",
                                             "command": "scan.sh"}]}]}, "général": "é"},
    "cursor": {"version": 1, "hooks": {"afterFileEdit": [
        {"command": "overlayrec-tools/format hook cursor"}]}},
}


@pytest.mark.parametrize("name", sorted(PROGRAM))
@pytest.mark.parametrize("indent,newline", [(2, True), (4, False), ("\t", True)])
def test_install_then_remove_leaves_the_file_byte_identical(tmp_path, name, indent, newline):
    project = tmp_path / "proj"
    path = agents.settings_path(name, str(project))
    os.makedirs(os.path.dirname(path))
    before = (json.dumps(USER_SETTINGS[name], indent=indent, ensure_ascii=False)
              + ("\n" if newline else "")).encode()
    with open(path, "wb") as f:
        f.write(before)
    os.chmod(path, 0o640)
    mod = agents.get(name)
    overlayrec("install-hooks", name, "--project", str(project))
    overlayrec("install-hooks", name, "--project", str(project))  # idempotent
    text = open(path).read()
    s = json.loads(text)
    assert text.endswith("\n") == newline
    for ev in mod.EVENTS:
        entries = s["hooks"][ev]
        cmds = [h["command"] for h in entries] if mod.SHAPE == "flat" else \
            [h["command"] for g in entries for h in g["hooks"]]
        assert sum(f"overlayrec hook {name}" in c for c in cmds) == 1, (ev, cmds)
    for k, v in USER_SETTINGS[name].items():  # everything else kept
        if k != "hooks":
            assert s[k] == v
    for ev, entries in USER_SETTINGS[name]["hooks"].items():
        assert s["hooks"][ev][0] == entries[0]
    overlayrec("install-hooks", name, "--project", str(project), "--remove")
    assert open(path, "rb").read() == before
    assert os.stat(path).st_mode & 0o777 == 0o640


def test_install_hooks_user_and_refusals(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ, HOME=str(home))
    r = overlayrec("install-hooks", "gemini", "--user", env=env)
    assert str(home / ".gemini" / "settings.json") in r.stdout
    s = json.loads((home / ".gemini" / "settings.json").read_text())
    assert set(s["hooks"]) == set(agents.get("gemini").EVENTS)
    bad = tmp_path / "p" / ".cursor"
    bad.mkdir(parents=True)
    (bad / "hooks.json").write_text("{not json")
    r = overlayrec("install-hooks", "cursor", "--project", str(tmp_path / "p"), check=False)
    assert r.returncode == 1 and "not valid JSON" in r.stderr
    assert (bad / "hooks.json").read_text() == "{not json"
    r = overlayrec("install-hooks", "nope", "--user", env=env, check=False)
    assert r.returncode == 2
    # an event's entries of another shape than a list: taken apart, the user's value was lost
    # ({"a": 1} became ["a", ours]); now the file is left as it is.  A group whose "hooks" is
    # of another shape is kept as it is
    claude = tmp_path / "q" / ".claude"
    claude.mkdir(parents=True)
    for agent, where, text in (
            ("claude-code", claude / "settings.json", '{"hooks": {"PreToolUse": {"a": 1}}}'),
            ("cursor", bad / "hooks.json", '{"version": 1, "hooks": {"stop": "x"}}')):
        where.write_text(text)
        r = overlayrec("install-hooks", agent, "--project", str(where.parent.parent),
                       check=False)
        assert r.returncode == 1 and "is not a list; not touching it" in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1 and where.read_text() == text
    odd = {"hooks": {"Stop": [{"matcher": "*", "hooks": "keep me"}]}}
    (claude / "settings.json").write_text(json.dumps(odd))
    overlayrec("install-hooks", "claude-code", "--project", str(tmp_path / "q"))
    got = json.loads((claude / "settings.json").read_text())
    assert got["hooks"]["Stop"][0] == odd["hooks"]["Stop"][0] and len(got["hooks"]["Stop"]) == 2
    overlayrec("install-hooks", "claude-code", "--project", str(tmp_path / "q"), "--remove")
    assert json.loads((claude / "settings.json").read_text()) == odd


@pytest.mark.parametrize("name", sorted(PROGRAM))
def test_hook_without_a_mount_exits_0_and_answers_as_the_agent_expects(tmp_path, name):
    env = {k: v for k, v in os.environ.items() if k != "OVERLAYREC_SOCKET"}
    mod = agents.get(name)
    for ev in mod.EVENTS:
        payload = {"hook_event_name": ev, "session_id": "x", "conversation_id": "x",
                   "tool_use_id": "t", "tool_name": "Bash", "cwd": str(tmp_path)}
        r = subprocess.run([sys.executable, "-m", "overlayrec", "hook", name],
                           input=json.dumps(payload), capture_output=True, text=True,
                           cwd=tmp_path, env=env, timeout=30 * SLOW)
        said = mod.answer(ev)
        assert r.returncode == 0 and r.stderr == ""
        assert r.stdout == ("" if said is None else said + "\n")
    r = subprocess.run([sys.executable, "-m", "overlayrec", "hook", name], input="not json",
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=30 * SLOW)
    assert r.returncode == 0
    if name == "gemini":
        assert json.loads(r.stdout) == {}  # stdout stays JSON even then


@pytest.mark.parametrize("name", sorted(PROGRAM))
@pytest.mark.parametrize("event", [["preToolUse"], {"a": 1}, 5, True])
def test_a_hook_event_name_that_is_not_a_string_is_a_bad_request_in_one_line(tmp_path, name,
                                                                            event):
    """Cursor's hook gave a traceback, exit 1 and no answer for an event name that was a list
    or an object (its answer was looked up by it): now a bad request in one line, as any
    other, with the agent's neutral answer, for every agent."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERLAYREC_")}
    payload = {"hook_event_name": event, "session_id": "x", "conversation_id": "x",
               "cwd": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "overlayrec", "hook", name],
                       input=json.dumps(payload), capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=30 * SLOW)
    said = agents.get(name).answer(None)
    assert (r.returncode, r.stdout) == (0, "" if said is None else said + "\n"), r
    assert r.stderr == "overlayrec hook: bad request: hook_event_name must be a string\n", r


# -- under `overlayrec run`, through a real mount -------------------------------------------------

def broken_nc(tmp_path) -> str:
    """A directory with an `nc` that cannot deliver (a netcat without -U, say), for PATH."""
    bindir = tmp_path / "bin-nc"
    bindir.mkdir()
    nc = bindir / "nc"
    nc.write_text("#!/bin/sh\necho \"nc: invalid option -- 'U'\" >&2\nexit 1\n")
    nc.chmod(0o755)
    return str(bindir)


@needs_fuse
@pytest.mark.parametrize("name,nc", [(n, "nc") for n in sorted(PROGRAM)]
                         + [("claude-code", "broken nc"), ("cursor", "broken nc")])
def test_agent_hooks_under_run_record_turns_and_calls(make_mount, tmp_path, name, nc):
    """Every call recorded; with an `nc` that fails, each hook's JSON reaches the daemon
    through the Python client instead: none is lost."""
    m = make_mount().mount()
    home = tmp_path / "home"
    (home / ".cursor").mkdir(parents=True)
    user_cursor = b'{\n    "version": 1,\n    "hooks": {}\n}'  # the user's own, 4 spaces
    (home / ".cursor" / "hooks.json").write_bytes(user_cursor)
    env = run_env(home)
    if nc == "broken nc":
        env["PATH"] = broken_nc(tmp_path) + os.pathsep + env["PATH"]
    r = overlayrec("run", "-w", m.ws, "--session", "run1", "--", fake_agent(tmp_path, name),
                   env=env, cwd=m.ws)
    assert "warning" not in r.stderr, r.stderr
    assert (home / ".cursor" / "hooks.json").read_bytes() == user_cursor  # as it was
    assert not (home / ".cursor" / "hooks.json.overlayrec-backup").exists()
    turns = [t for t in rows("turns", m.ws, env=env) if t["session"] == "run1"]
    assert [t["index"] for t in turns] == [1, 2]
    assert [t["prompt"] for t in turns] == ["make a and b", "again, and drop a"]
    assert all(t["end_t"] for t in turns)
    calls = {c["summary"]: c for c in rows("calls", m.ws, env=env) if c["session"] == "run1"}
    assert not any(c["implicit"] for c in calls.values()), calls
    first, again = [c for c in rows("calls", m.ws, env=env)
                    if c["summary"] == "echo a > a.txt"]
    assert first["id"] != again["id"] and (first["turn"], again["turn"]) == (1, 2)
    assert first["paths"] == ["a.txt"] and first["status"] == "ok"
    b = calls["mkdir -p d && echo b > d/b.txt"]
    assert b["turn"] == 1 and "d/b.txt" in b["paths"]
    c4 = calls["rm a.txt && echo c > c.txt"]  # through the Python fallback
    assert c4["turn"] == 2 and sorted(c4["paths"]) == ["a.txt", "c.txt"] and c4["status"] == "ok"
    every = [c for c in rows("calls", m.ws, env=env) if c["session"] == "run1"]
    assert len(calls) == 3 and len(every) == 4
    if name != "gemini":  # the agent's own ids; Gemini's are made from tool and arguments
        assert {c["id"] for c in every} == {"c1", "c2", "c3", "c4"}


def _drive_claude(m, agent: str, env: dict, under: str) -> None:
    """The fake Claude Code in ``m``: under `run` (session R), or with its hooks installed in
    the workspace and started by hand (``under`` "mount")."""
    if under == "run":
        overlayrec("run", "-w", m.ws, "--session", "R", "--", agent, env=env, cwd=m.ws)
    else:
        overlayrec("install-hooks", "claude-code", "--project", m.ws, env=env)
        settings = os.path.join(m.ws, ".claude", "settings.json")
        subprocess.run([agent, "--settings", settings], env=env, cwd=m.ws, check=True,
                       timeout=120 * SLOW)


@needs_fuse
@pytest.mark.parametrize("under", ["run", "mount"])
def test_a_cleared_session_goes_on_as_a_new_one_of_the_same_agent(make_mount, tmp_path, under):
    """Claude Code's /clear ends its session and begins another in the same process: the
    second session was taken for the first, ended one (its calls refused, its files the ended
    session's own, under a run and under hooks installed in the workspace alike)."""
    m = make_mount().mount()
    env = dict(run_env(tmp_path), FAKE_CLEAR="1")
    agent = fake_agent(tmp_path, "claude-code")
    _drive_claude(m, agent, env, under)
    calls = {c["id"]: c for c in rows("calls", m.ws, env=env)}
    assert calls["c5"]["session"] == "S2" and calls["c5"]["paths"] == ["e.txt"], calls
    assert calls["c5"]["turn"] == 1 and calls["c5"]["status"] == "ok"
    first = calls["c1"]["session"]
    assert first != "S2" and all(calls[c]["session"] == first for c in ("c2", "c3", "c4"))
    turns = {(t["session"], t["index"]): t for t in rows("turns", m.ws, env=env)}
    assert turns[("S2", 1)]["prompt"] == "after the clear" and turns[("S2", 1)]["end_t"]
    sessions = {r["unit"] for r in rows("blame", "e.txt", "-w", m.ws, env=env)}
    assert sessions == {"call:S2:c5"}, sessions


@needs_fuse
@pytest.mark.parametrize("under", ["run", "mount"])
def test_an_agent_a_call_runs_with_hooks_of_its_own_is_that_calls(make_mount, tmp_path,
                                                                   under):
    """Claude Code's Bash call runs `codex exec`, whose hooks the user installed: Codex's
    session id was taken for an alias of Claude's session, its prompt ended turn 1 and
    interrupted the call running it, its Stop ended a "turn 2", and Claude's later calls
    fell in no turn.  Everything Codex does is the call's; Claude's turns and calls stay."""
    m = make_mount().mount()
    home = tmp_path / "home"
    home.mkdir()
    env = dict(run_env(home), FAKE_NESTED="1")
    overlayrec("install-hooks", "codex", "--user", env=env)
    env["PATH"] = os.path.dirname(fake_agent(tmp_path, "codex")) + os.pathsep + env["PATH"]
    agent = fake_agent(tmp_path, "claude-code")
    _drive_claude(m, agent, env, under)
    calls = rows("calls", m.ws, env=env)
    outer = "R" if under == "run" else "S1"
    assert [(c["session"], c["id"], c["turn"], c["status"]) for c in calls] == \
        [(outer, "c1", 1, "ok"), (outer, "c2", 1, "ok"), (outer, "c3", 2, "ok"),
         (outer, "c4", 2, "ok")], calls
    assert sorted(calls[1]["paths"]) == ["d", "d/b.txt", "review.txt"], calls[1]
    turns = rows("turns", m.ws, env=env)
    assert [(t["session"], t["index"], t["prompt"], bool(t["end_t"])) for t in turns] == \
        [(outer, 1, "make a and b", True), (outer, 2, "again, and drop a", True)], turns
    assert {r["unit"] for r in rows("blame", "review.txt", "-w", m.ws, env=env)} == \
        {f"call:{outer}:c2"}
    r = overlayrec("diff", m.ws, "--session", "N1", env=env, check=False)  # nor an alias
    assert r.returncode == 1 and "no session N1" in r.stderr, r.stderr


@needs_fuse
def test_no_hooks_and_unknown_programs_get_implicit_calls(make_mount, tmp_path):
    m = make_mount().mount()
    env = run_env(tmp_path)
    agent = fake_agent(tmp_path, "codex")
    # the fake agent finds no -c hooks: it runs its commands with no hook at all
    overlayrec("run", "-w", m.ws, "--session", "nh", "--no-hooks", "--", agent, env=env,
               cwd=m.ws)
    got = [c for c in rows("calls", m.ws, env=env) if c["session"] == "nh"]
    assert got and all(c["implicit"] for c in got)
    aider = tmp_path / "bin-aider" / "aider"
    aider.parent.mkdir()
    aider.write_text("#!/bin/sh\necho x > aider.txt\n")
    aider.chmod(0o755)
    overlayrec("run", "-w", m.ws, "--session", "ai", "--", str(aider), env=env, cwd=m.ws)
    assert not (tmp_path / ".cursor").exists()


CURSOR_SLEEPER = r'''#!__PY__
import json, os, sys, time
hooks = json.load(open(os.path.expanduser("~/.cursor/hooks.json")))["hooks"]
assert any("overlayrec hook cursor" in h["command"] for h in hooks["preToolUse"])
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(60)
'''


@needs_fuse
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_run_leaves_the_users_settings_as_they_were(make_mount, tmp_path, sig):
    m = make_mount().mount()
    home = tmp_path / "home"
    (home / ".cursor").mkdir(parents=True)
    user = home / ".cursor" / "hooks.json"
    before = b'{"version": 1, "hooks": {"stop": [{"command": "say done"}]}}'
    user.write_bytes(before)
    env = run_env(home)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    prog = bindir / "cursor-agent"
    prog.write_text(CURSOR_SLEEPER.replace("__PY__", sys.executable))
    prog.chmod(0o755)
    up = tmp_path / "up"
    p = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--", str(prog),
                          str(up)], env=env, cwd=m.ws, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30 * SLOW
        while not up.exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        assert up.exists(), p.stderr.read() if p.poll() is not None else "agent never started"
        assert user.read_bytes() != before  # edited for the run, backed up beside it
        assert (home / ".cursor" / "hooks.json.overlayrec-backup").exists()
        os.kill(p.pid, sig)
        p.wait(timeout=30 * SLOW)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if up.exists():  # the fake agent itself, by its own pid (a SIGKILLed run leaves it)
            try:
                os.kill(int(up.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    if sig == signal.SIGKILL:
        # the run had no chance: the backup stays, and the next run puts the file back
        assert user.read_bytes() != before
        r = overlayrec("run", "-w", m.ws, "--", "true", env=env, cwd=m.ws)
        assert "put back" in r.stderr
    assert user.read_bytes() == before
    assert not (home / ".cursor" / "hooks.json.overlayrec-backup").exists()


def test_a_calls_summary_is_its_first_line_that_says_something_and_an_argv_joined():
    """The summary is what a listing shows and what the daemon matches a process's argv
    against when calls run together (calls.Calls._choose): an argv (Codex's shell tool sends
    one) is joined, not dropped; a command that begins with a blank line is not summarized as
    an empty string."""
    from overlayrec.agents._common import summarize
    assert summarize({"command": ["bash", "-lc", "sed -i s/a/b/ f"]}) == "bash -lc sed -i s/a/b/ f"
    assert summarize({"cmd": "git status"}) == "git status"
    assert summarize({"command": "\n  \nrm -rf build\nmake"}) == "rm -rf build"
    assert summarize({"command": "   ", "description": "tidy"}) == "tidy"
    assert summarize({"command": [1, 2]}) is None
    assert summarize({"command": "x" * 300}) == "x" * 200
    assert summarize("  ") is None
    # Cursor may send its tool_input as a JSON string: its raw text (`{"command": ...`) matched
    # no process's command line, and writes went to another call (found by a bug hunt)
    assert summarize('{"command": "sed -i s/a/b/ f"}') == "sed -i s/a/b/ f"
    assert summarize("echo not json\nmore") == "echo not json"


def test_a_run_edits_a_symlinked_settings_file_through_its_link(tmp_path):
    """~/.cursor/hooks.json a symlink into a dotfiles repository: the run's edit and its
    restore replaced the link by a plain copy (the user's link gone, the hooks never in the
    file it named).  Found by a bug hunt."""
    from overlayrec.agents import _settings
    real = tmp_path / "dotfiles" / "hooks.json"
    real.parent.mkdir()
    real.write_text('{"version": 1, "hooks": {}}\n')
    link = tmp_path / "home" / ".cursor" / "hooks.json"
    link.parent.mkdir(parents=True)
    link.symlink_to(real)
    assert _settings.edit_for_run(str(link), lambda s, how: '{"ours": true}\n')
    assert link.is_symlink() and real.read_text() == '{"ours": true}\n'
    assert _settings.restore(str(link))
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == '{"version": 1, "hooks": {}}\n'
    assert sorted(p.name for p in real.parent.iterdir()) == ["hooks.json"]


def test_a_settings_file_edited_during_the_run_is_kept(tmp_path):
    """The user added a hook of their own to ~/.cursor/hooks.json while a run had it: the
    restore put the backup's bytes back, the user's edit gone without a word.  It is kept,
    the file as it was before the run set beside it, and said.  Found by a bug hunt."""
    from overlayrec.agents import _settings
    path = tmp_path / "hooks.json"
    path.write_text('{"version": 1}\n')
    assert _settings.edit_for_run(str(path), lambda s, how: '{"ours": true}\n')
    path.write_text('{"ours": true, "mine": "the user\'s own"}\n')
    try:
        _settings.restore(str(path))
    except _settings.EditedMeanwhile as e:
        assert "was edited during the run: kept as it is" in str(e)
    else:
        raise AssertionError("the edit made during the run went unsaid")
    assert path.read_text() == '{"ours": true, "mine": "the user\'s own"}\n'
    assert (tmp_path / "hooks.json.overlayrec-before-run").read_text() == '{"version": 1}\n'
    assert not (tmp_path / "hooks.json.overlayrec-backup").exists()


def test_a_hook_payload_of_megabytes_is_taken(make_mount):
    """Claude Code's PostToolUse for a Write or a Read of a large file carries it whole: at
    1 MiB the daemon closed the connection, `nc` said nothing, and the call was gone (its
    files the agent's own) or abandoned.  Found by a bug hunt."""
    import socket
    m = make_mount().mount()
    payload = {"hook_event_name": "PreToolUse", "session_id": "s1", "tool_name": "Write",
               "tool_use_id": "toolu_big", "cwd": m.ws,
               "tool_input": {"file_path": "big.txt", "content": "x" * (3 << 20)}}
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(os.path.join(m.state, "control.sock"))
        s.sendall(json.dumps({"op": "session_begin", "session": "s1"}).encode() + b"\n")
        assert json.loads(s.makefile().readline())["ok"]
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(os.path.join(m.state, "control.sock"))
        s.sendall(json.dumps(payload).encode() + b"\n")
        answer = json.loads(s.makefile().readline())
    assert answer.get("ok"), answer
    r = overlayrec("log", m.ws, "--json")
    assert any(e.get("call") == "toolu_big" for e in map(json.loads, r.stdout.splitlines())), \
        r.stdout


@pytest.mark.parametrize("name", ["claude-code", "cursor"])
def test_an_installed_hook_whose_interpreter_is_gone_exits_0(tmp_path, monkeypatch, name):
    """The hooks name the interpreter they were installed with; a venv made anew since, and the
    hook exited 127 ("exec: ...python: not found"), where a hook exits 0 whatever goes wrong
    and gives the agent the answer it expects.  Found by a bug hunt."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "gone" / "python"))
    mod = agents.get(name)
    for ev in mod.EVENTS:
        cmd = agents.hook_command(name, ev)
        env = {k: v for k, v in os.environ.items() if k != "OVERLAYREC_SOCKET"}
        r = subprocess.run(cmd, shell=True, input="{}", capture_output=True, text=True,
                           env=env, timeout=30 * SLOW)
        said = mod.answer(ev)
        assert r.returncode == 0, (ev, r)
        assert r.stdout == ("" if said is None else said + "\n"), (ev, r.stdout)


def _path_without_timeout(tmp_path) -> str:
    """A PATH with what the fast hook runs but coreutils' `timeout` (a system without it)."""
    import shutil
    bindir = tmp_path / "bin-no-timeout"
    bindir.mkdir()
    for prog in ("sh", "nc", "tr", "cat"):
        (bindir / prog).symlink_to(shutil.which(prog))
    return str(bindir)


def test_the_fast_hook_gives_up_on_a_daemon_that_does_not_answer(tmp_path):
    """The fast hook's `nc -UN` had no time limit: a daemon that accepts and never answers (a
    stopped one: the kernel accepts into its backlog) held the agent's hook for good, where
    the Python client gives up after 10 s.  It gives up as the client would for the event's
    request (an end's: once it is sealed), with the agent's neutral answer and no second
    wait in the Python client; with coreutils' `timeout` or, without it, nc's own `-w`."""
    import shutil
    import socket
    from overlayrec import client
    if not shutil.which("nc") or subprocess.run(["nc", "-h"], capture_output=True,
                                                 text=True).stderr.find("-U") < 0:
        pytest.skip("needs an nc with -U (the fast hook's path)")
    path = str(tmp_path / "control.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen(8)  # never accepted, never answered: as a stopped daemon's socket
        runs = []
        for name, ev in (("cursor", "preToolUse"), ("claude-code", "PreToolUse")):
            (tmp_path / name).mkdir()
            payload = tmp_path / name / "payload.json"  # given whole at once: the hooks wait
            payload.write_text(json.dumps({  # for the socket side by side
                "hook_event_name": ev, "session_id": "S", "conversation_id": "S",
                "tool_use_id": "t1", "tool_name": "Bash", "tool_input": {"command": "ls"}}))
            for bare in (False, True):
                env = dict(os.environ, OVERLAYREC_SOCKET=path)
                if bare:
                    env["PATH"] = _path_without_timeout(tmp_path / name)
                with open(payload) as stdin:
                    p = subprocess.Popen(["/bin/sh", "-c", agents.hook_command(name, ev)],
                                         stdin=stdin, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, env=env,
                                         start_new_session=True)
                runs.append((name, ev, bare, p))
        try:
            for name, ev, bare, p in runs:
                out, err = p.communicate(timeout=60 * SLOW)
                said = agents.get(name).answer(ev)
                assert (p.returncode, out, err) == \
                    (0, "" if said is None else said + "\n", ""), (name, bare)
        finally:
            for *_, p in runs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)  # the hook's nc with it
                    p.wait()
    # the bound is the client's for the request the event maps to
    assert agents.hook_bound(agents.get("cursor"), "preToolUse") == client.TIMEOUT
    assert agents.hook_bound(agents.get("cursor"), "postToolUse") == client.SEAL_TIMEOUT
    assert agents.hook_bound(agents.get("claude-code"), "Stop") == client.SEAL_TIMEOUT
    assert agents.hook_bound(agents.get("gemini"), "BeforeTool") == client.TIMEOUT
