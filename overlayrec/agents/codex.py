"""Codex CLI (``codex``): command hooks in ``hooks.json`` or ``[hooks]`` tables of
``config.toml``, beside each config layer (user ``~/.codex/``, project ``.codex/``).

References: https://developers.openai.com/codex/hooks and the input schemas Codex generates,
https://github.com/openai/codex/tree/main/codex-rs/hooks/schema/generated
(``pre-tool-use.command.input.schema.json``, ``post-tool-use...``, ``stop...``): every payload
carries ``session_id``, ``cwd``, ``hook_event_name``, ``model``, ``transcript_path``,
``permission_mode``; PreToolUse/PostToolUse add ``tool_name``, ``tool_use_id``, ``tool_input``
(``{"command": ...}`` for Bash), PostToolUse ``tool_response`` and ``turn_id``; Stop adds
``turn_id``, ``stop_hook_active``, ``last_assistant_message``; UserPromptSubmit adds ``prompt``.
Hooks are on by default in current releases (``[features] hooks``, formerly ``codex_hooks``).

Wired per run with ``-c hooks.EVENT=[...]`` config overrides (the session-flags layer, whose
``hooks`` Codex reads like any other layer's: ``codex-rs/hooks/src/engine/discovery.rs``):
nothing of the user's is edited.

Uncertain: current Codex runs a non-managed hook only once the user has trusted it (``/hooks``
in Codex records its hash; ``--dangerously-bypass-hook-trust`` skips the check, which overlayrec
never passes on its own).  Until then Codex skips our hooks and the run records implicit calls.
``tool_response``'s shape is not specified: a failure is read from ``exit_code``/``exitCode``
not 0 or an ``error``/``is_error`` field when there is one.  There is no SessionEnd event:
the session ends with the run.
"""
from __future__ import annotations

import os

from ._common import end_call, end_turn, session_id, summarize, text, with_session

NAME = "codex"
PROGRAMS = ("codex",)
EVENTS = ("SessionStart", "UserPromptSubmit", "PreToolUse", "PostToolUse", "Stop")
SETTINGS = {"user": "~/.codex/hooks.json", "project": ".codex/hooks.json"}
SHAPE = "grouped"


def recognise(payload: dict) -> int:
    ev = payload.get("hook_event_name")
    return 2 if ev in EVENTS and ("turn_id" in payload or "model" in payload) else 0


def _failed(response) -> bool:
    if not isinstance(response, dict):
        return False
    for k in ("exit_code", "exitCode"):
        if isinstance(response.get(k), int) and response[k] != 0:
            return True
    return bool(response.get("is_error") or response.get("error"))


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
            payload.get("tool_use_id"), text(payload.get("tool_name")) or "tool",
            summarize(payload.get("tool_input")), session=sid))
    elif ev == "PostToolUse":
        status = "error" if _failed(payload.get("tool_response")) else "ok"
        end_call(target, errors, sid, payload.get("tool_use_id"), status)
    elif ev == "Stop":  # stop_hook_active: its earlier Stop was blocked, the turn went on
        end_turn(target, errors, sid, again=payload.get("stop_hook_active") is True)


def answer(event) -> str | None:
    return None  # exit 0 with no output: Codex goes on


def hook_entries(command_for) -> dict:
    # no matcher: every tool (Codex matchers are regexes; "*" alone is not one)
    return {ev: [{"hooks": [{"type": "command", "command": command_for(ev)}]}] for ev in EVENTS}


def _toml_str(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out) + '"'


def overrides(command_for) -> list[str]:
    """The ``-c`` arguments that add our hooks for one run."""
    args = []
    for ev in EVENTS:
        args += ["-c", f"hooks.{ev}=[{{hooks=[{{type=\"command\",command="
                       f"{_toml_str(command_for(ev))}}}]}}]"]
    return args


def _installed(cwd: str) -> bool:
    from . import _settings
    home = os.path.expanduser("~/.codex")
    return any(_settings.holds_ours(os.path.join(d, f), NAME)
               for d in (home, os.path.join(cwd, ".codex"))
               for f in ("hooks.json", "config.toml"))


def wire_run(argv: list, env: dict, scratch: str, command_for, cwd: str):
    if _installed(cwd):
        return argv, env, None, "hooks installed already"
    return [argv[0], *overrides(command_for), *argv[1:]], env, None, "-c hooks.*"
