"""Claude Code (``claude``): command hooks in ``settings.json``.

Reference: https://docs.claude.com/en/docs/claude-code/hooks (hook input: ``hook_event_name``,
``session_id``, ``cwd``, ``tool_use_id``, ``tool_name``, ``tool_input``, ``prompt``) and
https://docs.claude.com/en/docs/claude-code/settings (``--settings`` loads one more settings
file for one run; user ``~/.claude/settings.json``, project ``.claude/settings.json``).

Wired per run with ``claude --settings FILE`` (a file in the run's scratch directory holding
only our hooks): nothing of the user's is edited.  Skipped when ``install-hooks`` put our hooks
in the user's or the project's settings already (they would run twice).
"""
from __future__ import annotations

import os

from ._common import end_call, end_turn, session_id, summarize, text, with_session

NAME = "claude-code"
PROGRAMS = ("claude",)
EVENTS = ("SessionStart", "UserPromptSubmit", "PreToolUse", "PostToolUse",
          "PostToolUseFailure", "Stop", "SessionEnd")
SETTINGS = {"user": "~/.claude/settings.json", "project": ".claude/settings.json"}
SHAPE = "grouped"
_TOOL_EVENTS = ("PreToolUse", "PostToolUse", "PostToolUseFailure")


def recognise(payload: dict) -> int:
    """How surely a raw payload is Claude Code's (0: not).  Codex sends the same event names
    with ``turn_id``/``model`` added and maps the same way, so the lowest score is enough."""
    return 1 if payload.get("hook_event_name") in EVENTS else 0


def apply(payload: dict, target, errors: tuple) -> None:
    ev = payload.get("hook_event_name")
    sid = session_id(payload, "session_id")
    if ev == "SessionStart":
        target.session_begin(session=sid)
    elif ev == "UserPromptSubmit":
        prompt = text(payload.get("prompt"))
        with_session(target, errors, sid, lambda: target.turn_begin(prompt=prompt, session=sid))
    elif ev == "PreToolUse":
        with_session(target, errors, sid, lambda: target.call_begin(
            payload.get("tool_use_id"), text(payload.get("tool_name")),
            summarize(payload.get("tool_input")), session=sid))
    elif ev in ("PostToolUse", "PostToolUseFailure"):
        end_call(target, errors, sid, payload.get("tool_use_id"),
                 "ok" if ev == "PostToolUse" else "error")
    elif ev == "Stop":  # stop_hook_active: its earlier Stop was blocked, the turn went on
        end_turn(target, errors, sid, again=payload.get("stop_hook_active") is True)
    elif ev == "SessionEnd":
        target.session_end(session=sid)


def answer(event) -> str | None:
    """What the hook prints on stdout: nothing (Claude Code reads exit 0 as "go on")."""
    return None


def hook_entries(command_for) -> dict:
    """The settings entries that run our hook for every event we use."""
    out = {}
    for ev in EVENTS:
        entry = {"hooks": [{"type": "command", "command": command_for(ev)}]}
        if ev in _TOOL_EVENTS:
            entry = {"matcher": "*", **entry}
        out[ev] = [entry]
    return out


def wire_run(argv: list, env: dict, scratch: str, command_for, cwd: str):
    """``claude --settings FILE`` with our hooks only."""
    from . import _settings
    if any(_settings.holds_ours(p, NAME) for p in (
            os.path.expanduser(SETTINGS["user"]), os.path.join(cwd, SETTINGS["project"]),
            os.path.join(cwd, ".claude", "settings.local.json"))):
        return argv, env, None, "hooks installed already"
    path = os.path.join(scratch, "claude-settings.json")
    given = _given_settings(argv)
    if given is None:
        _settings.write(path, _settings.dumps({"hooks": hook_entries(command_for)}, {}))
        return [argv[0], "--settings", path, *argv[1:]], env, None, f"--settings {path}"
    # the user's own --settings: a second one beside it was one Claude Code refuses, or one
    # dropped (found by a bug hunt): theirs, with our hooks merged in, takes its place
    i, value = given
    try:
        if value.lstrip().startswith("{"):
            mine, how = _settings._loads(value.encode("utf-8"))
        else:
            mine, how = _settings.load(os.path.join(cwd, os.path.expanduser(value)))
            if how.get("absent"):
                raise _settings.SettingsError(f"{value}: no such file")
    except (_settings.SettingsError, OSError) as e:
        return argv, env, None, f"not wired: --settings {e}"
    _settings.merge_grouped(mine, hook_entries(command_for), NAME)
    _settings.write(path, _settings.dumps(mine, how))
    out = list(argv)
    if out[i] == "--settings":
        out[i + 1] = path
    else:
        out[i] = f"--settings={path}"
    return out, env, None, f"--settings {path} (yours, {value}, with our hooks)"


def _given_settings(argv: list) -> tuple[int, str] | None:
    """Where the command line gives ``--settings`` (``--settings X`` or ``--settings=X``),
    and its value: a file's path or a JSON string."""
    for i, a in enumerate(argv[1:], 1):
        if a == "--":
            return None
        if a == "--settings" and i + 1 < len(argv):
            return i, argv[i + 1]
        if a.startswith("--settings="):
            return i, a[len("--settings="):]
    return None
