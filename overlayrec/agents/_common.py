"""What the agent modules share: the session-tolerant request helpers their ``apply`` uses.

``target`` has the client's methods (``overlayrec.client.Client``, or the daemon's own stand-in
for a raw payload); ``errors`` is what it raises when the daemon refuses a request.  Imported on
every hook: stdlib only, nothing heavy.
"""
from __future__ import annotations

import json

from zlib import crc32


def summarize(tool_input) -> str | None:
    """One line saying what a tool call was asked to do."""
    if isinstance(tool_input, str):  # some agents send the arguments as a JSON string
        try:  # an object in it is read as one (its raw text matched no command line)
            parsed = json.loads(tool_input)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            return summarize(parsed)
        return tool_input.splitlines()[0][:200] if tool_input.strip() else None
    if not isinstance(tool_input, dict):
        return None
    for key in ("command", "cmd", "file_path", "path", "pattern", "url", "description",
                "prompt"):
        v = tool_input.get(key)
        if isinstance(v, list) and v and all(isinstance(w, str) for w in v):
            v = " ".join(v)  # an argv (Codex's shell tool): what calls.Calls._choose matches
        if isinstance(v, str) and v.strip():  # its first line that says something
            return next(line for line in v.splitlines() if line.strip())[:200]
    return None


def with_session(target, errors: tuple, sid, fn):
    """``fn()``, and when the daemon knows no session yet (hooks installed mid-session), begin
    one and try again."""
    try:
        return fn()
    except errors as e:
        if not str(e).startswith("no session"):
            raise
        target.session_begin(session=sid)
        return fn()


def end_turn(target, errors: tuple, sid, again=False, resume: str = "any") -> None:
    """End the open turn at the agent's stop; none open (a Stop after an interrupted prompt)
    is no error.  A stop hook of the user's may block the stop, and the agent goes on in the
    same turn: what it does before the next prompt takes the turn up again (``resume``: its
    calls, or ``"any"``, also its own writes), and ``again`` (its stop after a blocked one)
    ends the turn there (calls.Calls.turn_end)."""
    try:
        target.turn_end(session=sid, resume=resume, again=bool(again))
    except errors as e:
        if "no open turn" not in str(e) and not str(e).startswith("no session"):
            raise


def end_call(target, errors: tuple, sid, call_id, status: str) -> None:
    """End a tool call; one ended already is no error: a stopped tool's end that comes after
    the next prompt ended it (``interrupted``: what it wrote since is marked after its end),
    or an end sent twice."""
    try:
        with_session(target, errors, sid, lambda: target.call_end(call_id, status, session=sid))
    except errors as e:
        if "already ended" not in str(e):
            raise


def session_id(payload: dict, *keys) -> str | None:
    """The session id under the first of ``keys`` the payload carries one (None: none).  One
    that is not a string is refused (ValueError, a bad request): a number, a list or an object
    reached the daemon's session table and failed there with a traceback, or was taken."""
    for k in keys:
        v = payload.get(k)
        if v is None or v == "":
            continue
        if not isinstance(v, str):
            raise ValueError(f"{k} must be a string")
        return v
    return None


def text(value) -> str | None:
    """A payload's free-text field (a prompt, a tool's name) as text: a string as it is, None
    for none, anything else (an object, a number) as its JSON text.  What the agent sent is
    kept, and the daemon, which refuses a request whose text is not a string, takes it: a
    turn or a call lost over the shape of its prompt would leave its changes to the wrong
    unit."""
    if value is None or isinstance(value, str):
        return value
    from .. import wire
    return wire.dumps(value, ascii=False)


def first(payload: dict, *keys):
    """The first of ``keys`` the payload carries a non-empty value for."""
    for k in keys:
        v = payload.get(k)
        if v not in (None, ""):
            return v
    return None


# -- calls without an id --------------------------------------------------------------------------
# Some agents announce a tool call's begin and end with no id that ties the two together (Gemini
# CLI's BeforeTool/AfterTool).  The hook is a new process each time and keeps no state, so the id
# is made from what both payloads carry, the tool and its arguments, and the daemon's answers
# keep repeats apart: the n-th identical call is ``<id>.<n>``; an end closes the oldest open one.

MAX_REPEATS = 512


def derived_id(tool: str, tool_input) -> str:
    from .. import wire
    try:
        text = wire.dumps(tool_input)
    except (TypeError, ValueError):
        text = repr(tool_input)
    return f"{tool}-{crc32(text.encode('utf-8', 'surrogatepass')):08x}"


def begin_derived(target, errors: tuple, sid, base: str, tool: str, summary) -> None:
    for n in range(1, MAX_REPEATS + 1):
        cid = base if n == 1 else f"{base}.{n}"
        try:
            target.call_begin(cid, tool, summary, session=sid)
            return
        except errors as e:
            if "already begun" not in str(e):
                raise


def end_derived(target, errors: tuple, sid, base: str, status: str) -> None:
    for n in range(1, MAX_REPEATS + 1):
        cid = base if n == 1 else f"{base}.{n}"
        try:
            target.call_end(cid, status, session=sid)
            return
        except errors as e:
            if "already ended" in str(e):
                continue
            if str(e).startswith("no call"):
                return  # its begin was never seen (hooks installed mid-call): nothing to end
            raise
