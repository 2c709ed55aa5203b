"""A way in for the readers (``calls``, ``turns``, ``diff``) that skips click: their plain
command lines parsed here, their answers made and written by ``readers`` as the click commands
do.  Importing click and building the CLI is some 25 ms of a reader's 100-150.

Only what is sure to mean the same to click is taken: each option once (``--opt VALUE``,
``--opt=VALUE`` or a flag), at most one workspace argument, values click's types would take
as they are.  Anything else (``--help``, ``-h``, an option unknown or repeated, a value a type
refuses, shell completion) is left to click, which parses it and says what is wrong.  So is
any exception while the answer is made: the readers only read (what they keep is kept the same
way whoever makes it), so click's command makes it again and reports the failure as it would.
Once output has begun nothing is made again.
"""
from __future__ import annotations

import os
import sys

# each command's options: name -> (parameter, kind); kinds: "flag", "str", "strs" (a
# repeatable option), "id", "int", "path", "turn", "seq0", or ("flag_value", value) for --stat
# and its kind
_COMMON = {"--session": ("sid", "id"), "--json": ("as_json", "flag"),
           "--state-dir": ("state_dir", "path")}
_OPTIONS = {
    "turns": {**_COMMON, "--all": ("churn", "flag")},
    "calls": {**_COMMON, "--all": ("churn", "flag"), "--turn": ("turn_sel", "turn")},
    "diff": {**_COMMON, "--call": ("call_id", "str"), "--turn": ("turn_sel", "turn"),
             "--since": ("since", "seq0"), "--until": ("until", "seq0"),
             "--drift": ("drift", "flag"), "--stat": ("fmt", ("flag_value", "stat")),
             "--numstat": ("fmt", ("flag_value", "numstat")),
             "--name-status": ("fmt", ("flag_value", "name-status")),
             "--patch": ("fmt", ("flag_value", "patch")), "--binary": ("binary", "flag"),
             "--path": ("glob", "strs"), "--by-writer": ("by_writer", "flag")},
}
_DEFAULTS = {
    "turns": {"sid": None, "churn": False, "as_json": False, "state_dir": None},
    "calls": {"sid": None, "turn_sel": None, "churn": False, "as_json": False,
              "state_dir": None},
    "diff": {"call_id": None, "turn_sel": None, "sid": None, "since": None, "until": None,
             "drift": False, "fmt": "patch", "binary": False, "glob": (),
             "by_writer": False, "as_json": False, "state_dir": None},
}


class _NotPlain(Exception):
    """A command line left to click."""


def parse(args: list[str]) -> tuple[str, dict] | None:
    """(command, its parameters) as click would give them, or None when the command line is
    not one of the plain forms (see the module's doc)."""
    if not args or args[0] not in _OPTIONS:
        return None
    cmd, options = args[0], _OPTIONS[args[0]]
    params = dict(_DEFAULTS[cmd])
    seen: set[str] = set()
    workspace = None
    rest = args[1:]
    i = 0
    try:
        while i < len(rest):
            arg = rest[i]
            i += 1
            if arg == "--":
                positional = rest[i:]
                if len(positional) > 1 or (positional and workspace is not None):
                    return None
                if positional:
                    workspace = positional[0]
                break
            if arg in ("-w", "--workspace") or arg.startswith("--workspace="):
                # the workspace as an option (cli._workspace_param): once, and not beside it
                if workspace is not None or "=" not in arg and i >= len(rest):
                    return None
                workspace = arg.partition("=")[2] if "=" in arg else rest[i]
                i += "=" not in arg
                continue
            if arg[:1] == "-" and len(arg) > 1:
                name, eq, value = arg.partition("=")
                spec = options.get(name)
                if spec is None or spec[0] in seen:
                    return None  # unknown (--help, -h, a typo) or given twice
                dest, kind = spec
                seen.add(dest)
                if kind == "flag" or isinstance(kind, tuple):
                    if eq:
                        return None  # click: "does not take a value"
                    params[dest] = True if kind == "flag" else kind[1]
                    continue
                if not eq:
                    if i >= len(rest):
                        return None  # click: "requires an argument"
                    value = rest[i]
                    i += 1
                params[dest] = _convert(kind, value)
                continue
            if workspace is not None:
                return None  # click: "unexpected extra argument"
            workspace = arg
        # a plain string, as click takes it (a stat here would wait on a hung mount: the
        # reader's resolve_workspace looks at the mount first)
        params["workspace"] = "." if workspace is None else workspace
    except _NotPlain:
        return None
    return cmd, params


def _convert(kind: str, value: str):
    """``value`` as click's type for ``kind`` converts it (cli's PATH, ID, TURN, SEQ0, int,
    str); _NotPlain where that type would refuse it (click then says so)."""
    if kind == "str":
        return value
    if kind == "strs":  # a repeatable option, given once here (again: left to click)
        return (value,)
    if kind == "path":  # click.Path(): an existing path must be readable
        if value == "-":
            raise _NotPlain
        try:
            os.stat(value)
        except OSError:
            return value
        except ValueError:  # a NUL in it
            raise _NotPlain from None
        if not os.access(value, os.R_OK):
            raise _NotPlain
        return value
    if kind == "id":
        if not value:
            raise _NotPlain
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise _NotPlain from None
        return value
    if kind == "int":
        try:
            return int(value)
        except ValueError:
            raise _NotPlain from None
    digits = value[1:] if kind == "turn" and value[:1] == "-" else value
    plain = 1 <= len(digits) <= 19 and all("0" <= c <= "9" for c in digits)
    if kind == "turn":
        if value == "last" or plain:
            return value
        raise _NotPlain
    if kind == "seq0" and plain and int(value) < 2**63:
        return int(value)
    raise _NotPlain


def run(args: list[str]) -> int | None:
    """Answer a plain reader command line: its exit status, or None to leave it to click (then
    nothing was written)."""
    if "_OVERLAYREC_COMPLETE" in os.environ:  # click's shell completion
        return None
    got = parse(args)
    if got is None:
        return None
    cmd, params = got
    # as cli's group does before any command
    if getattr(sys.stdout, "errors", None) == "strict":
        try:
            sys.stdout.reconfigure(errors="surrogateescape")
        except (AttributeError, ValueError, OSError):
            pass
    import signal
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    from . import readers
    try:
        parts = getattr(readers, cmd)(**params)
    except Exception:
        return None  # click's command makes it again, and says what failed as it does
    except KeyboardInterrupt:  # as click's main: a new line, then "Aborted!"
        sys.stderr.write("\nAborted!\n")
        return 1
    try:
        readers.emit(parts)
    except OSError as e:  # as cli's _guard and click's main take it
        import errno
        if e.errno == errno.EPIPE:
            return 1
        readers.say_error(readers.os_error_text(e))
        return 1
    return 0
