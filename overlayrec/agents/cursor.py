"""Cursor's agent (the editor's Agent and the ``cursor-agent`` CLI): command hooks in
``hooks.json`` (``{"version": 1, "hooks": {EVENT: [{"command": ...}]}}``; user
``~/.cursor/hooks.json``, project ``.cursor/hooks.json``; every one found runs).

Reference: https://cursor.com/docs/hooks (events sessionStart/sessionEnd, beforeSubmitPrompt,
preToolUse/postToolUse/postToolUseFailure, beforeShellExecution/afterShellExecution,
afterFileEdit, stop; every payload carries ``hook_event_name``, ``conversation_id``,
``generation_id``, ``workspace_roots``; the tool events ``tool_name``, ``tool_input``,
``tool_use_id``, ``cwd``; beforeSubmitPrompt ``prompt``; stop ``status``).  A hook answers with
JSON on stdout: preToolUse ``{"permission": "allow"}`` lets the tool run (preToolUse does not
enforce "ask", so "allow" asks for nothing Cursor would not do without the hook),
beforeSubmitPrompt ``{"continue": true}``, the others ``{}``.  overlayrec uses the generic tool
events (they carry ``tool_use_id``) and not beforeShellExecution, whose "allow" would approve
shell commands the user is otherwise asked about.

Wired per run by editing the user's ``~/.cursor/hooks.json`` (Cursor has no per-run option for
hooks; the project's file would be recorded as a change of the workspace): the file is backed up
beside itself first and put back byte for byte when the agent exits; a run that was killed
leaves the backup, and the next ``run`` or ``mount`` puts the file back.

Uncertain: the session id field (``conversation_id``, or ``session_id`` which sessionStart may
carry; both accepted); whether ``tool_input`` is an object or a JSON string (both summarized).
"""
from __future__ import annotations

import os

from ._common import end_call, end_turn, session_id, summarize, text, with_session

NAME = "cursor"
PROGRAMS = ("cursor-agent",)
EVENTS = ("sessionStart", "sessionEnd", "beforeSubmitPrompt", "preToolUse", "postToolUse",
          "postToolUseFailure", "stop")
_KNOWN = EVENTS + ("beforeShellExecution", "afterShellExecution", "beforeMCPExecution",
                   "afterMCPExecution", "beforeReadFile", "afterFileEdit", "afterAgentResponse",
                   "afterAgentThought", "subagentStart", "subagentStop", "preCompact")
SETTINGS = {"user": "~/.cursor/hooks.json", "project": ".cursor/hooks.json"}
SHAPE = "flat"
_ANSWERS = {"preToolUse": '{"permission": "allow"}', "beforeSubmitPrompt": '{"continue": true}'}


def recognise(payload: dict) -> int:
    ev = payload.get("hook_event_name")
    return 3 if ev in _KNOWN or "conversation_id" in payload else 0


def apply(payload: dict, target, errors: tuple) -> None:
    ev = payload.get("hook_event_name")
    sid = session_id(payload, "conversation_id", "session_id")
    if ev == "sessionStart":
        target.session_begin(session=sid)
    elif ev == "beforeSubmitPrompt":
        prompt = text(payload.get("prompt"))
        with_session(target, errors, sid, lambda: target.turn_begin(prompt=prompt, session=sid))
    elif ev == "preToolUse":
        with_session(target, errors, sid, lambda: target.call_begin(
            payload.get("tool_use_id"), text(payload.get("tool_name")) or "tool",
            summarize(payload.get("tool_input")), session=sid))
    elif ev in ("postToolUse", "postToolUseFailure"):
        end_call(target, errors, sid, payload.get("tool_use_id"),
                 "ok" if ev == "postToolUse" else "error")
    elif ev == "stop":
        # a stop hook's followup_message goes on (loop_count: how many did); the agent may be
        # the editor the user saves files in, so only the calls it begins take the turn up
        loops = payload.get("loop_count")
        end_turn(target, errors, sid, again=isinstance(loops, int) and loops > 0,
                 resume="calls")
    elif ev == "sessionEnd":
        target.session_end(session=sid)


def answer(event) -> str | None:
    return _ANSWERS.get(event, "{}")


def hook_entries(command_for) -> dict:
    return {ev: [{"command": command_for(ev)}] for ev in EVENTS}


def new_file(settings: dict) -> dict:
    """What a hooks.json we create starts as."""
    return {"version": 1, **settings} if not settings else settings


def wire_run(argv: list, env: dict, scratch: str, command_for, cwd: str):
    from . import _settings
    user = os.path.expanduser(SETTINGS["user"])
    if any(_settings.holds_ours(p, NAME) for p in (user, os.path.join(cwd, SETTINGS["project"]))):
        return argv, env, None, "hooks installed already"

    def edited(settings, how):
        settings = _settings.merge_flat(new_file(settings), hook_entries(command_for), NAME)
        return _settings.dumps(settings, how)
    try:
        owned = _settings.edit_for_run(user, edited)
    except (_settings.SettingsError, OSError) as e:
        return argv, env, None, f"not wired: {e}"
    cleanup = (lambda: _settings.restore(user)) if owned else None
    return argv, env, cleanup, f"{user} (backed up beside it until the agent exits)"
