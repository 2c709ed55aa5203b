"""Claude Code's hook events mapped to sessions, turns and calls.

Pure mapping, shared by both ends: the `overlayrec hook claude-code` adapter applies it through
the client, and the daemon applies it to a raw hook payload that arrives on its socket (the
fast hook: `nc` pipes Claude Code's JSON straight in, no interpreter started).  ``target`` has
the client's methods; ``NoSession`` is what it raises when no session is known yet.
"""
from __future__ import annotations

EVENTS = ("SessionStart", "UserPromptSubmit", "PreToolUse", "PostToolUse",
          "PostToolUseFailure", "Stop", "SessionEnd")


def summarize(tool_input) -> str | None:
    """One line saying what a tool call was asked to do."""
    if not isinstance(tool_input, dict):
        return None
    for key in ("command", "file_path", "path", "pattern", "url", "description", "prompt"):
        v = tool_input.get(key)
        if isinstance(v, str) and v:
            return v.splitlines()[0][:200]
    return None


def apply(payload: dict, target, errors: tuple) -> None:
    ev = payload.get("hook_event_name")
    sid = payload.get("session_id") or None

    def with_session(fn):
        try:
            return fn()
        except errors as e:
            if not str(e).startswith("no session"):
                raise
            target.session_begin(session=sid)  # hooks installed mid-session: start one now
            return fn()

    if ev == "SessionStart":
        target.session_begin(session=sid)
    elif ev == "UserPromptSubmit":
        with_session(lambda: target.turn_begin(prompt=payload.get("prompt"), session=sid))
    elif ev == "PreToolUse":
        with_session(lambda: target.call_begin(payload.get("tool_use_id"), payload.get("tool_name"),
                                               summarize(payload.get("tool_input")), session=sid))
    elif ev in ("PostToolUse", "PostToolUseFailure"):
        with_session(lambda: target.call_end(payload.get("tool_use_id"),
                                             "ok" if ev == "PostToolUse" else "error",
                                             session=sid))
    elif ev == "Stop":
        try:
            target.turn_end(session=sid)
        except errors as e:
            if "no open turn" not in str(e) and not str(e).startswith("no session"):
                raise
    elif ev == "SessionEnd":
        target.session_end(session=sid)
