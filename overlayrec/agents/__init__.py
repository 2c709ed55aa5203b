"""The agent registry: one module per agent in this package, found by its file name.

An agent module (``claude_code.py`` is agent ``claude-code``) holds everything overlayrec knows
about that agent, and nothing else needs to know it:

* ``NAME``, ``PROGRAMS`` (the program names ``overlayrec run`` recognises), ``EVENTS`` (the hook
  events we install);
* ``recognise(payload) -> int``: how surely a raw hook payload is this agent's (0: not), for
  the daemon's fast path, where a payload arrives on the socket with no name attached;
* ``apply(payload, target, errors)``: the pure mapping of one payload to session/turn/call
  begin and end requests on ``target`` (the client, or the daemon's stand-in);
* ``answer(event) -> str | None``: what the hook prints on stdout for that event;
* ``SETTINGS`` (``{"user": ..., "project": ...}``), ``SHAPE`` (``grouped``/``flat``) and
  ``hook_entries(command_for)``: where its settings live and what we merge into them;
* ``wire_run(argv, env, scratch, command_for, cwd)``: how one ``overlayrec run`` wires it,
  returning ``(argv, env, cleanup or None, note)``.

``overlayrec hook AGENT``, ``install-hooks AGENT``, the daemon's payload recognition and the
CLI's choices all loop over this registry: a new agent is one new file here (and its test).
Hooks import this on every call: stdlib only, the agent modules loaded only when asked for.
"""
from __future__ import annotations

import importlib
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


_NAMES: list[str] = []


def names() -> list[str]:
    """Every agent, by name (``claude-code``, ``codex``, ...).  The package is listed once a
    process: the daemon listed it on every hook payload, which, with overlayrec installed
    inside the workspace it records, went through its own mount and hung it (found by a bug
    hunt; daemon._preload asks before the mount)."""
    if not _NAMES:
        _NAMES.extend(sorted(f[:-3].replace("_", "-") for f in os.listdir(_HERE)
                             if f.endswith(".py") and not f.startswith("_")))
    return list(_NAMES)


def get(name: str):
    """The agent module called ``name``; KeyError for none."""
    if name not in names():
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{name.replace('-', '_')}")


def modules() -> list:
    return [get(n) for n in names()]


def for_program(argv0: str):
    """The agent a command runs, from its program's name (None: no agent we know)."""
    prog = os.path.basename(argv0 or "")
    for m in modules():
        if prog in m.PROGRAMS:
            return m
    return None


def event_of(payload) -> str | None:
    """The hook event a payload names (None: it names none).  A payload that is no JSON object,
    or whose ``hook_event_name`` is not a string, is a bad request (ValueError): a list or an
    object was looked up among Cursor's answers, and its hook ended in a traceback, exit 1 and
    no answer on stdout."""
    if not isinstance(payload, dict):
        raise ValueError("a hook payload is a JSON object")
    event = payload.get("hook_event_name")
    if event is not None and not isinstance(event, str):
        raise ValueError("hook_event_name must be a string")
    return event


def recognise(payload: dict):
    """The agent a raw hook payload comes from (None: none)."""
    best, score = None, 0
    for m in modules():
        s = m.recognise(payload)
        if s > score:
            best, score = m, s
    return best


# -- the hook command -----------------------------------------------------------------------------

class _Probe:
    """A target that notes the requests an agent's mapping makes (their op names)."""

    def __init__(self):
        self.ops: list[str] = []

    def __getattr__(self, op: str):
        return lambda *args, **kwargs: self.ops.append(op)


def hook_bound(mod, event: str | None) -> int:
    """How many seconds the fast hook waits for the daemon's answer to ``event``: as long as
    the Python client waits for the requests it maps to (client.timeout_for: a unit's end is
    answered once its paths are sealed, anything else within 10 s).  The mapping itself says
    which requests (``apply`` is pure), so no agent keeps a second list of them."""
    from .. import client
    probe = _Probe()
    try:
        mod.apply({"hook_event_name": event, "session_id": "s", "conversation_id": "s",
                   "tool_use_id": "t", "tool_name": "t"}, probe, ())
    except Exception:  # a mapping that needs more of a payload: the default bound
        pass
    return int(max((client.timeout_for(op) for op in probe.ops), default=client.TIMEOUT))


def hook_command(name: str, event: str | None = None) -> str:
    """The command line our settings entries run for ``event``.  Under `overlayrec run`
    (OVERLAYREC_SOCKET set) and with `nc` installed, the hook's JSON goes straight to the
    daemon's socket: no interpreter starts.  Otherwise this interpreter runs without site (-S:
    half the start-up) with the package's directory on its path.  Either way a missing mount
    or any failure exits 0, and stdout carries only the agent's expected answer.

    The payload is read once into the shell, so that when `nc` fails (another netcat without
    ``-U``/``-N``, a refused connection) the same JSON goes to the Python client: a call's
    begin or end is never dropped because the fast path could not deliver it.  `nc` waits for
    the answer as long as the Python client would (``hook_bound``): a daemon that accepts and
    never answers (a stopped one) held the agent's hook for good.  Bounded by coreutils'
    `timeout` where there is one (exit 124: it covers a connect into a full backlog too), else
    by nc's own ``-w`` (idle: exit 0); either way the agent's answer is given, and the Python
    client, which would wait as long again, is not asked."""
    import shlex
    mod = get(name)
    where = os.path.dirname(os.path.dirname(_HERE))
    # the package's directory in place of the cwd ('' first on -c's path): an import looked
    # in the cwd, and in a workspace whose mount had lost its daemon that raised ENOTCONN, a
    # traceback instead of the hook's answer (found by a bug hunt)
    code = (f"import sys; sys.path[0] = {where!r}; "
            "from overlayrec.entry import main; main()")
    py = f"{shlex.quote(sys.executable)} -S -c {shlex.quote(code)} hook {name}"
    said = mod.answer(event)
    say = f"printf '%s\\n' {shlex.quote(said)}; " if said is not None else ""
    # $(cat) drops trailing newlines only, which JSON does not need; printf keeps the rest.
    # The daemon reads a request a line: a payload laid out on several lines (pretty-printed)
    # was taken line by line, each refused, and nc said nothing of it.  Its line ends can only
    # be whitespace between tokens (in a string they are escaped), so tr makes them spaces
    bound = hook_bound(mod, event)
    fast = ('if [ -S "${OVERLAYREC_SOCKET:-}" ] && command -v nc >/dev/null; then '
            f'p=$(cat); t=; command -v timeout >/dev/null && t="timeout {bound}"; '
            'printf %s "$p" | tr \'\\r\\n\' \'  \' | '
            f'$t nc -UN -w {bound} "$OVERLAYREC_SOCKET" >/dev/null 2>&1; r=$?; '
            f'if [ $r = 0 ] || [ $r = 124 ]; then {say}exit 0; fi; '
            f'printf %s "$p" | {py} || {{ {say}exit 0; }}; exit 0; fi; ')
    # not exec'd: an interpreter gone since the hooks were installed (a venv made anew) exited
    # 127, where a hook exits 0 whatever goes wrong; the agent's answer is given then too (the
    # hook itself never exits other than 0)
    return "sh -c " + shlex.quote(fast + f"{py} || {{ {say}exit 0; }}; exit 0") + \
        f" # overlayrec hook {name}"


def run_hook(name: str, stdin=None, stdout=None) -> int:
    """``overlayrec hook AGENT``: apply one payload from stdin; always exits 0.  Silent on
    success but for the agent's expected answer on stdout; a warning goes to stderr."""
    from .. import client, wire
    out = stdout or sys.stdout
    event = None
    try:
        mod = get(name)
    except KeyError:
        print(f"overlayrec hook: no agent {name!r}", file=sys.stderr)
        return 0
    try:
        payload = wire.loads((stdin or sys.stdin).read())
        event = event_of(payload)
        cwd = payload.get("cwd")
        roots = payload.get("workspace_roots")
        if not cwd and isinstance(roots, list) and roots and isinstance(roots[0], str):
            cwd = roots[0]
        c = None
        # the payload's cwd first, then the hook's own: Claude Code's cwd follows its Bash
        # tool's `cd` (into an --add-dir directory outside the mount, say) while the hook
        # runs in the workspace; the payload's alone dropped the turn without a word
        for where in dict.fromkeys((cwd if isinstance(cwd, str) and os.path.isdir(cwd)
                                    else None, None)):
            try:
                c = client.connect(cwd=where)
                break
            except client.NoMount:
                pass  # not recording here: nothing to do
        if c is not None:
            with c:
                mod.apply(payload, c, (client.ClientError,))
    except ValueError as e:  # not JSON, or not the payload it should be: said as the daemon
        print(f"overlayrec hook: bad request: {e}", file=sys.stderr)  # says it, in one line
    except Exception as e:  # never break the agent
        print(f"overlayrec hook: {e}", file=sys.stderr)
    said = mod.answer(event)
    if said is not None:
        out.write(said + "\n")
        out.flush()
    return 0


# -- settings files -------------------------------------------------------------------------------

def settings_path(name: str, project: str | None = None) -> str:
    """The settings file ``install-hooks`` edits: the user's, or ``project``'s."""
    mod = get(name)
    if project is None:
        return os.path.expanduser(mod.SETTINGS["user"])
    return os.path.join(project, mod.SETTINGS["project"])


def install(name: str, path: str, remove: bool = False) -> None:
    """Merge our entries into (or take them out of) the settings file at ``path``, keeping
    every other entry, its key order and its layout."""
    from . import _settings
    mod = get(name)
    merge = _settings.merge_flat if mod.SHAPE == "flat" else _settings.merge_grouped
    fresh = mod.new_file({}) if getattr(mod, "new_file", None) else {}

    def edit(settings: dict, how: dict) -> str | None:
        """The file's new text, None when nothing changes (a file that holds nothing of
        ours is not rewritten by --remove, nor one holding ours already by an install)."""
        before = json.loads(json.dumps(settings))
        absent = bool(how.get("absent"))
        made = remove and _settings.made_by_install(settings, name)
        if not remove and not settings and getattr(mod, "new_file", None):
            settings = mod.new_file(settings)
        merge(settings, mod.hook_entries(lambda ev: hook_command(name, ev)), name,
              remove=remove, absent=absent)
        if remove and absent:
            return None
        if made and settings in ({}, fresh):
            return _settings.GONE  # the file the install made: removed
        return None if settings == before else _settings.dumps(settings, how)
    if remove and not os.path.lexists(path):
        return
    os.makedirs(os.path.dirname(_settings._real(path)) or ".", exist_ok=True)
    with _settings.locked(path):
        _settings.edit_with_backup(path, edit)


def wire_run(mod, argv: list, env: dict, scratch: str, cwd: str):
    """Wire ``mod``'s hooks for one run: ``(argv, env, cleanup or None, note)``."""
    return mod.wire_run(list(argv), dict(env), scratch,
                        lambda ev: hook_command(mod.NAME, ev), cwd)


def restore_left_behind() -> list[str]:
    """Put back the settings files a killed run left edited (their backup beside them): what
    to say of each."""
    from . import _settings
    done = []
    for m in modules():
        for path in (os.path.expanduser(m.SETTINGS["user"]),):
            try:
                if _settings.restore(path, dead_only=True):
                    done.append(f"put back {path} (a run that was killed had edited it)")
            except _settings.EditedMeanwhile as e:
                done.append(str(e))
            except OSError:
                pass
    return done
