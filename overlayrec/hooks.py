"""Agent adapters: turn an agent's hook events into control requests.

Claude Code runs ``overlayrec hook claude-code`` for each hook with the event's JSON on stdin
(``hook_event_name``, ``session_id``, ``tool_use_id``, ``tool_name``, ``tool_input``, ``prompt``).
The adapter must be fast and must never break the agent: when there is no mount it does
nothing, and whatever goes wrong it exits 0 (a one-line warning on stderr).
"""
from __future__ import annotations

import os
import sys

from . import client, wire

from .claude import EVENTS as CLAUDE_EVENTS, apply as _apply


def claude_code(payload: dict, c: client.Client) -> None:
    _apply(payload, c, (client.ClientError,))


def run_claude_code_hook(stdin=None) -> int:
    """Entry point of ``overlayrec hook claude-code``: always exits 0."""
    try:
        payload = wire.loads((stdin or sys.stdin).read())
        cwd = payload.get("cwd") if isinstance(payload, dict) else None
        try:
            c = client.connect(cwd=cwd if cwd and os.path.isdir(cwd) else None)
        except client.NoMount:
            return 0  # not recording here: nothing to do
        with c:
            claude_code(payload, c)
    except Exception as e:  # never break the agent
        print(f"overlayrec hook: {e}", file=sys.stderr)
    return 0


def hook_entries(command: str) -> dict:
    """The settings.json hook entries that run ``command`` for every event we use."""
    out = {}
    for ev in CLAUDE_EVENTS:
        entry = {"hooks": [{"type": "command", "command": command}]}
        if ev in ("PreToolUse", "PostToolUse", "PostToolUseFailure"):
            entry = {"matcher": "*", **entry}
        out[ev] = [entry]
    return out


def merge_hooks(settings: dict, command: str, remove: bool = False) -> dict:
    """Add (or remove) our entries in a Claude Code settings dict, keeping everything else."""
    hooks = settings.setdefault("hooks", {})
    for ev, entries in hook_entries(command).items():
        current = hooks.get(ev, [])
        kept = []
        for entry in current:
            cmds = [h for h in entry.get("hooks", []) if not _ours(h.get("command", ""))]
            if cmds:
                kept.append(dict(entry, hooks=cmds))
            elif not entry.get("hooks"):
                kept.append(entry)
        if not remove:
            kept.extend(entries)
        if kept:
            hooks[ev] = kept
        else:
            hooks.pop(ev, None)
    if not hooks:
        settings.pop("hooks")
    return settings


def _ours(command: str) -> bool:
    return "overlayrec" in command and "hook claude-code" in command
