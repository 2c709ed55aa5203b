"""Gemini CLI (``gemini``): command hooks under ``hooks`` in ``settings.json`` (user
``~/.gemini/settings.json``, project ``.gemini/settings.json``, system
``/etc/gemini-cli/settings.json`` or ``$GEMINI_CLI_SYSTEM_SETTINGS_PATH``).

References: https://geminicli.com/docs/hooks/reference and
https://github.com/google-gemini/gemini-cli/blob/main/docs/hooks/index.md (events, the
grouped ``{"matcher", "hooks": [{"name", "type", "command", "timeout"}]}`` entries; every
payload carries ``session_id``, ``transcript_path``, ``cwd``, ``hook_event_name``,
``timestamp``; BeforeTool ``tool_name``, ``tool_input``; AfterTool adds ``tool_response``
(``llmContent``, ``returnDisplay``, optional ``error``); BeforeAgent ``prompt``; AfterAgent
``prompt``, ``prompt_response``; hooks of every layer run).  stdout must be JSON only: the
hook prints ``{}`` (exit 0, no decision: the CLI goes on); warnings go to stderr.
https://geminicli.com/docs/reference/configuration (``GEMINI_CLI_SYSTEM_SETTINGS_PATH``).

Wired per run through ``GEMINI_CLI_SYSTEM_SETTINGS_PATH``: a copy of the system settings file
(if any) with our hooks added, in the run's scratch directory: nothing of the user's is edited.

Uncertain: tool payloads carry no call id, so a call's id is made from the tool and its
arguments (``_common.derived_id``; repeats are told apart by the daemon's answers).  If a later
release adds one (``tool_call_id``/``call_id``/``tool_use_id`` are accepted) it is used.  Some
releases need ``tools.enableHooks: true`` (or ``hooks.enabled``) before any hook runs;
overlayrec leaves that switch to the user, and without it the run records implicit calls.
"""
from __future__ import annotations

import os

from ._common import begin_derived, derived_id, end_call, end_derived, end_turn, first, \
    session_id, summarize, text, with_session

NAME = "gemini"
PROGRAMS = ("gemini",)
EVENTS = ("SessionStart", "SessionEnd", "BeforeAgent", "AfterAgent", "BeforeTool", "AfterTool")
SETTINGS = {"user": "~/.gemini/settings.json", "project": ".gemini/settings.json"}
SHAPE = "grouped"
SYSTEM_SETTINGS = "/etc/gemini-cli/settings.json"
_ONLY_HERE = ("BeforeAgent", "AfterAgent", "BeforeTool", "AfterTool")


def recognise(payload: dict) -> int:
    ev = payload.get("hook_event_name")
    if ev in _ONLY_HERE:
        return 2
    # SessionStart/SessionEnd: Claude Code's names too (and mapped the same); Gemini's carry
    # an ISO ``timestamp``
    return 2 if ev in EVENTS and isinstance(payload.get("timestamp"), str) else 0


def _call_id(payload: dict):
    return first(payload, "tool_call_id", "call_id", "tool_use_id")


def apply(payload: dict, target, errors: tuple) -> None:
    ev = payload.get("hook_event_name")
    sid = session_id(payload, "session_id")
    tool = text(payload.get("tool_name")) or "tool"
    if ev == "SessionStart":
        target.session_begin(session=sid)
    elif ev == "BeforeAgent":
        prompt = text(payload.get("prompt"))
        with_session(target, errors, sid, lambda: target.turn_begin(prompt=prompt, session=sid))
    elif ev == "BeforeTool":
        cid = _call_id(payload)
        summary = summarize(payload.get("tool_input"))
        if cid:
            with_session(target, errors, sid,
                         lambda: target.call_begin(cid, tool, summary, session=sid))
        else:
            base = derived_id(tool, payload.get("tool_input"))
            with_session(target, errors, sid,
                         lambda: begin_derived(target, errors, sid, base, tool, summary))
    elif ev == "AfterTool":
        resp = payload.get("tool_response")
        status = "error" if isinstance(resp, dict) and resp.get("error") else "ok"
        cid = _call_id(payload)
        if cid:
            end_call(target, errors, sid, cid, status)
        else:
            base = derived_id(tool, payload.get("tool_input"))
            with_session(target, errors, sid,
                         lambda: end_derived(target, errors, sid, base, status))
    elif ev == "AfterAgent":  # stop_hook_active: an earlier AfterAgent denied, a retry
        end_turn(target, errors, sid, again=payload.get("stop_hook_active") is True)
    elif ev == "SessionEnd":
        target.session_end(session=sid)


def answer(event) -> str | None:
    return "{}"  # JSON only on stdout, and no decision: go on


def hook_entries(command_for) -> dict:
    # no matcher: every tool and every session source
    return {ev: [{"hooks": [{"name": "overlayrec", "type": "command",
                             "command": command_for(ev), "timeout": 10000}]}]
            for ev in EVENTS}


def wire_run(argv: list, env: dict, scratch: str, command_for, cwd: str):
    from . import _settings
    if any(_settings.holds_ours(p, NAME) for p in (
            os.path.expanduser(SETTINGS["user"]), os.path.join(cwd, SETTINGS["project"]))):
        return argv, env, None, "hooks installed already"
    system = env.get("GEMINI_CLI_SYSTEM_SETTINGS_PATH") or SYSTEM_SETTINGS
    try:
        settings, how = _settings.load(system)
    except (_settings.SettingsError, OSError) as e:
        return argv, env, None, f"not wired: the system settings: {e}"
    settings = _settings.merge_grouped(settings, hook_entries(command_for), NAME)
    path = os.path.join(scratch, "gemini-system-settings.json")
    _settings.write(path, _settings.dumps(settings, how))
    return argv, dict(env, GEMINI_CLI_SYSTEM_SETTINGS_PATH=path), None, \
        f"GEMINI_CLI_SYSTEM_SETTINGS_PATH={path}"
