"""Agents' settings files: merge our hook entries in and take them out again, touching nothing
else; put a file back exactly after a run that had to edit it.

A settings file is read keeping its key order and written back in the layout it was found in
(its indentation, a trailing newline or none), so ``install-hooks`` then ``--remove`` leaves a
file that holds other entries byte-identical to before (for files laid out as
``JSON.stringify(value, null, N)`` and ``json.dumps(value, indent=N)`` lay them out, which is
how agents and editors write them).

Two shapes of hook table exist.  *Grouped* (Claude Code, Codex, Gemini CLI): ``hooks`` maps an
event to a list of groups ``{"matcher": ..., "hooks": [{"type": "command", "command": ...}]}``.
*Flat* (Cursor): ``hooks`` maps an event to a list of ``{"command": ..., ...}``.  Our entries
are recognised by their command (``... # overlayrec hook AGENT``), never by position.
"""
from __future__ import annotations

import hashlib
import json
import os
import re


class EditedMeanwhile(OSError):
    """The settings file was edited while the run had it: kept as it is, and said."""


def _real(path: str) -> str:
    """The file a settings path names: a symlink's target (a dotfiles link), which a write or
    a restore replaced by a plain copy of it, the link gone."""
    return os.path.realpath(path) if os.path.islink(path) else path


class SettingsError(Exception):
    """A settings file we must not touch (not JSON, not an object)."""


def ours(command, agent: str) -> bool:
    """Is ``command`` a hook entry overlayrec wrote for ``agent``: one ending in our marker
    (``# overlayrec hook NAME``, hook_command), or in the commands earlier versions wrote
    (``-m overlayrec hook NAME``; the entry's ``-c`` code then ``hook NAME``)?  Any command
    naming overlayrec and "hook NAME" was taken (`/opt/overlayrec-extras/bin/audit-hook
    claude-code`, the user's own): run wired no hooks, and `--remove` deleted it (found by a
    bug hunt)."""
    if not isinstance(command, str):
        return False
    c = _EMPTY_BEFORE.sub("", command).rstrip()  # (the marks _marked adds after ours)
    return c.endswith((f"# overlayrec hook {agent}", f"-m overlayrec hook {agent}")) or \
        c.endswith(f" hook {agent}") and "from overlayrec.entry import main; main()" in c


# -- reading and writing in the layout found ------------------------------------------------------

def load(path: str) -> tuple[dict, dict]:
    """The settings in ``path`` ({} when absent) and its layout."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return {}, {"indent": 2, "newline": True}
    except UnicodeDecodeError as e:  # JSON is UTF-8 (RFC 8259): refused as invalid JSON is
        raise SettingsError(f"{path} is not valid JSON (not UTF-8: byte 0x{e.object[e.start]:02x} "
                            f"at offset {e.start}); not touching it") from None
    if not text.strip():
        return {}, {"indent": 2, "newline": True}
    try:
        settings = json.loads(text)
    except ValueError as e:
        raise SettingsError(f"{path} is not valid JSON ({e}); not touching it") from None
    if not isinstance(settings, dict):
        raise SettingsError(f"{path} does not hold a JSON object; not touching it")
    return settings, layout(text)


def layout(text: str) -> dict:
    m = re.search(r"^[{\[]\s*?\n([ \t]+)\S", text, re.M)
    indent: int | str = 2
    if m:
        ws = m.group(1)
        indent = ws if "\t" in ws else len(ws)
    elif text.strip() and "\n" not in text.strip():
        indent = None  # all on one line
    return {"indent": indent, "newline": text.endswith("\n")}


def dumps(settings: dict, how: dict) -> str:
    indent = how.get("indent", 2)
    if indent is None:
        text = json.dumps(settings, ensure_ascii=False)
    else:
        text = json.dumps(settings, indent=indent, ensure_ascii=False)
    return text + ("\n" if how.get("newline", True) else "")


def write(path: str, text: str) -> None:
    """Replace ``path`` atomically, keeping its mode (and a symlink: its target is replaced)."""
    path = _real(path)
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    tmp = path + ".overlayrec.tmp"
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        mode = None
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)


# -- merging --------------------------------------------------------------------------------------

def _listed(hooks: dict, ev: str) -> list:
    """The entries of event ``ev`` in a hook table: a list, or the file is not touched (a
    value of another shape would be taken apart, and the user's lost)."""
    got = hooks.get(ev, [])
    if not isinstance(got, list):
        raise SettingsError(f"its \"hooks\".\"{ev}\" is not a list; not touching it")
    return got


# An empty table or list the user had ("hooks": {}, "Stop": []) looks, once our entries are
# taken out again, like one our install made: it was dropped, and install then --remove was not
# byte-identical.  The file is the only memory between the two, so our entries say it: their
# command's comment ends "(empty before: hooks)" / "(... event)" / "(... hooks, event)".
_EMPTY_BEFORE = re.compile(r" \(empty before: ([a-z, ]+)\)$")


def _marks(command) -> set[str]:
    m = _EMPTY_BEFORE.search(command) if isinstance(command, str) else None
    return set(m.group(1).split(", ")) if m else set()


def _marked(command: str, marks: set[str]) -> str:
    command = _EMPTY_BEFORE.sub("", command)
    return f"{command} (empty before: {', '.join(sorted(marks))})" if marks else command


def _commands(entry, flat: bool) -> list:
    """The hook commands (dicts with ``command``) of one entry of an event's list."""
    if flat:
        return [entry] if isinstance(entry, dict) else []
    got = entry.get("hooks") if isinstance(entry, dict) else None
    return [h for h in got if isinstance(h, dict)] if isinstance(got, list) else []


def _merge(settings: dict, entries: dict, agent: str, remove: bool, flat: bool) -> dict:
    """Add (or remove) our entries in a hook table, keeping every other entry, and the empty
    table or lists the user had (our entries' marks say which, once they are in)."""
    had = "hooks" in settings
    hooks = settings.get("hooks")
    if hooks is None:
        hooks = {}
    if not isinstance(hooks, dict):
        raise SettingsError("its \"hooks\" is not an object; not touching it")
    listed = {ev: _listed(hooks, ev) for ev in entries}
    mine = {ev: [h.get("command") for e in got for h in _commands(e, flat)
                 if ours(h.get("command"), agent)] for ev, got in listed.items()}
    hooks_empty = (had and not hooks) or any("hooks" in _marks(c) for cs in mine.values()
                                             for c in cs)
    for ev in list(entries):
        ev_empty = (ev in hooks and not listed[ev]) or any("event" in _marks(c)
                                                           for c in mine[ev])
        kept = []
        for entry in listed[ev]:
            if flat:
                if not (isinstance(entry, dict) and ours(entry.get("command"), agent)):
                    kept.append(entry)
                continue
            if not isinstance(entry, dict) or not isinstance(entry.get("hooks", []), list):
                kept.append(entry)  # not a shape we write: not ours, kept as it is
                continue
            cmds = [h for h in entry.get("hooks", []) if not
                    (isinstance(h, dict) and ours(h.get("command"), agent))]
            if cmds:
                kept.append(dict(entry, hooks=cmds) if len(cmds) != len(entry["hooks"])
                            else entry)
            elif not entry.get("hooks"):
                kept.append(entry)
        if not remove:
            marks = {"hooks"} if hooks_empty else set()
            if ev_empty:
                marks.add("event")
            for entry in entries[ev]:
                for h in _commands(entry, flat):
                    h["command"] = _marked(h["command"], marks)
                kept.append(entry)
        if kept or ev_empty:
            hooks[ev] = kept
        else:
            hooks.pop(ev, None)
    if hooks or hooks_empty:
        settings["hooks"] = hooks
    else:
        settings.pop("hooks", None)
    return settings


def merge_grouped(settings: dict, entries: dict, agent: str, remove: bool = False) -> dict:
    """Add (or remove) our groups in a grouped hook table, keeping every other entry."""
    return _merge(settings, entries, agent, remove, flat=False)


def merge_flat(settings: dict, entries: dict, agent: str, remove: bool = False) -> dict:
    """Add (or remove) our entries in a flat hook table (Cursor), keeping every other entry."""
    return _merge(settings, entries, agent, remove, flat=True)


def holds_ours(path: str, agent: str) -> bool:
    """Whether the file at ``path`` already runs our hook (installed by ``install-hooks``)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return False
    try:
        found = [json.loads(text)]
    except ValueError:  # (not JSON, or a TOML of Codex's: its strings as written)
        return any(ours(line.strip().rstrip(",").strip('"\''), agent)
                   for line in text.splitlines())
    while found:  # every string the settings hold, at any depth
        x = found.pop()
        if isinstance(x, dict):
            found.extend(x.values())
        elif isinstance(x, list):
            found.extend(x)
        elif ours(x, agent):
            return True
    return False


# -- a file a run must edit, put back exactly -----------------------------------------------------
# The backup is written beside the file before it is touched: one JSON header line (the run's
# pid, whether the file existed, its mode) and then the original bytes.  The run restores it when
# the agent exits; a run that was killed leaves the backup, and the next run or mount restores it.

BACKUP_SUFFIX = ".overlayrec-backup"


def edit_for_run(path: str, new_text_for) -> bool:
    """Back ``path`` up beside itself, then write ``new_text_for(settings, layout)``.  False
    when another live run holds a backup already: the file is edited then, but that run's
    backup stays the one that puts it back."""
    path = _real(path)
    restore(path, dead_only=True)  # a killed run's leftover: it holds the user's own bytes
    if os.path.exists(path + BACKUP_SUFFIX):
        settings, how = load(path)
        write(path, new_text_for(settings, how))
        return False
    try:
        with open(path, "rb") as f:
            original, existed = f.read(), True
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        original, existed, mode = b"", False, None
    settings, how = load(path)
    text = new_text_for(settings, how)
    # what the run wrote, to tell at the restore whether the file was edited meanwhile
    wrote = hashlib.sha256(text.encode("utf-8")).hexdigest()
    header = json.dumps({"pid": os.getpid(), "existed": existed, "mode": mode,
                         "wrote": wrote}).encode()
    bak = path + BACKUP_SUFFIX
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(bak + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(header + b"\n" + original)
        f.flush()
        os.fsync(f.fileno())
    os.replace(bak + ".tmp", bak)
    write(path, text)
    return True


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError):
        return False
    return True


def restore(path: str, dead_only: bool = False) -> bool:
    """Put ``path`` back from the backup beside it, if there is one; True if it did.
    ``dead_only``: only a backup whose run is gone (killed).  A file edited while the run had
    it (the user added a hook of their own) is kept as it is, the backup set aside beside it,
    and EditedMeanwhile says so: the backup's bytes put back threw the edit away."""
    path = _real(path)
    bak = path + BACKUP_SUFFIX
    try:
        with open(bak, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return False
    head, _, original = raw.partition(b"\n")
    try:
        meta = json.loads(head)
    except ValueError:
        return False  # not ours: leave it
    if dead_only and meta.get("pid") != os.getpid() and _alive(meta.get("pid")):
        return False
    if meta.get("wrote"):
        try:
            with open(path, "rb") as f:
                now = hashlib.sha256(f.read()).hexdigest()
        except FileNotFoundError:
            now = None
        if now != meta["wrote"]:
            aside = path + ".overlayrec-before-run"
            with open(aside + ".tmp", "wb") as f:
                f.write(original)
            os.replace(aside + ".tmp", aside)
            os.unlink(bak)
            raise EditedMeanwhile(
                f"{path} was edited during the run: kept as it is, with the run's hooks in it "
                f"(`overlayrec install-hooks <agent> --remove` takes them out); the file as it "
                f"was before the run is {aside}")
    if meta.get("existed"):
        tmp = path + ".overlayrec.tmp"
        with open(tmp, "wb") as f:
            f.write(original)
        if meta.get("mode") is not None:
            os.chmod(tmp, meta["mode"])
        os.replace(tmp, path)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    os.unlink(bak)
    return True
