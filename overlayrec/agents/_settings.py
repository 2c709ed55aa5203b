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

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import stat
import tempfile

from ..state import proc_start_ticks


class EditedMeanwhile(OSError):
    """The settings file was edited while the run had it: kept as it is, and said."""


def _real(path: str) -> str:
    """The file a settings path names: a symlink's target (a dotfiles link), which a write or
    a restore replaced by a plain copy of it, the link gone.  A link of another user's is not
    followed by root (one in a user's project sent root's install into a root-only file;
    found by a bug hunt)."""
    if not os.path.islink(path):
        return path
    owner = os.lstat(path).st_uid
    if os.geteuid() == 0 and owner != 0:
        raise SettingsError(f"{path} is a symlink of uid {owner}'s: root does not write "
                            "through it; not touching it")
    return os.path.realpath(path)


def _regular(path: str) -> os.stat_result | None:
    """``path``'s stat, None when absent; anything but a regular file is refused (a settings
    path linked to /dev/null was replaced by a plain file, a fifo hung the install; found by
    a bug hunt)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise SettingsError(f"{path} is not a regular file; not touching it")
    return st


@contextlib.contextmanager
def locked(path: str):
    """Hold the lock of ``path``'s directory (flock on the directory itself: no file of ours
    beside the user's) for a read, merge and write: two installs at once, or an install and
    a run's restore, each wrote the other's file over (found by a bug hunt)."""
    d = os.path.dirname(_real(path)) or "."
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


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

def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # (written back as Infinity: no JSON at all)
        raise ValueError(f"the number {literal} is out of range")
    return value


def load(path: str) -> tuple[dict, dict]:
    """The settings in ``path`` ({} when absent) and its layout."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}, {"indent": 2, "newline": True, "absent": True}
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SettingsError(f"{path} is not a regular file; not touching it")
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:  # JSON is UTF-8 (RFC 8259): refused as invalid JSON is
        raise SettingsError(f"{path} is not valid JSON (not UTF-8: byte 0x{e.object[e.start]:02x} "
                            f"at offset {e.start}); not touching it") from None
    if not text.strip():
        return {}, {"indent": 2, "newline": True}
    try:
        settings = json.loads(text, parse_float=_finite)
    except ValueError as e:
        raise SettingsError(f"{path} is not valid JSON ({e}); not touching it") from None
    except RecursionError:
        raise SettingsError(f"{path} is nested too deeply to be read; not touching it") from None
    if not isinstance(settings, dict):
        raise SettingsError(f"{path} does not hold a JSON object; not touching it")
    return settings, layout(text)


def layout(text: str) -> dict:
    """How ``text`` is laid out: its indent, a trailing newline, CRLF line ends, and whether
    it is ASCII only (Python's ``json.dump`` writes ``\\u00e9``: kept so)."""
    m = re.search(r"^[{\[]\s*?\n([ \t]+)\S", text, re.M)
    indent: int | str | None = 2
    if m:
        ws = m.group(1)
        indent = ws if "\t" in ws else len(ws)
    elif text.strip() and "\n" not in text.strip():
        indent = None  # all on one line
    return {"indent": indent, "newline": text.endswith("\n"), "crlf": "\r\n" in text,
            "ascii": text.isascii()}


def dumps(settings: dict, how: dict) -> str:
    indent = how.get("indent", 2)
    ascii_only = bool(how.get("ascii"))
    text = json.dumps(settings, indent=indent, ensure_ascii=ascii_only)
    if not ascii_only:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\\ud83d", a cut emoji): escaped
            text = json.dumps(settings, indent=indent, ensure_ascii=True)
    text += "\n" if how.get("newline", True) else ""
    return text.replace("\n", "\r\n") if how.get("crlf") else text


def write(path: str, text: str) -> None:
    """Replace ``path``'s content with ``text``, keeping its mode and owner (and a symlink:
    its target is written)."""
    _put(_real(path), text.encode("utf-8"))


def _put(path: str, data: bytes, mode: int | None = None) -> None:
    """``path`` made to hold ``data``: through a temp file of a name of its own, private until
    it takes the file's mode and owner, renamed over it; a file of several hard links is
    written in place (a rename cut it from its other names).  ``mode``: a file made anew
    (default: the umask's).  Found by a bug hunt: a fixed temp name, two writers at once
    made a file of neither; a temp file world-readable while it held a 0600 file's secret;
    root's install made the user's file root's."""
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    st = _regular(path)
    if st is not None and st.st_nlink > 1:
        _write_in_place(path, data)
        return
    try:
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{os.path.basename(path)}.",
                                   suffix=".overlayrec.tmp")
    except (PermissionError, OSError) as e:
        if st is None or e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise OSError(e.errno, e.strerror, path) from None
        # a directory this user may not write, a file it may: written in place, as before
        # (the temp file's name was the error; found by a bug hunt)
        _write_in_place(path, data)
        return
    try:
        if st is not None:
            if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                with contextlib.suppress(PermissionError):
                    os.fchown(fd, st.st_uid, st.st_gid)
            os.fchmod(fd, st.st_mode & 0o7777)
        else:
            if mode is None:
                mode = 0o666 & ~_umask()
            os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_in_place(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def _umask() -> int:
    um = os.umask(0o022)
    os.umask(um)
    return um


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


def _merge(settings: dict, entries: dict, agent: str, remove: bool, flat: bool,
           absent: bool = False) -> dict:
    """Add (or remove) our entries in a hook table, keeping every other entry, and the empty
    table or lists the user had (our entries' marks say which, once they are in); ``absent``:
    the file is made by this install (marked ``file``: ``made_by_install``)."""
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
            if absent or any("file" in _marks(c) for cs in mine.values() for c in cs):
                marks.add("file")
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


def merge_grouped(settings: dict, entries: dict, agent: str, remove: bool = False,
                  absent: bool = False) -> dict:
    """Add (or remove) our groups in a grouped hook table, keeping every other entry."""
    return _merge(settings, entries, agent, remove, flat=False, absent=absent)


def merge_flat(settings: dict, entries: dict, agent: str, remove: bool = False,
               absent: bool = False) -> dict:
    """Add (or remove) our entries in a flat hook table (Cursor), keeping every other entry."""
    return _merge(settings, entries, agent, remove, flat=True, absent=absent)


def made_by_install(settings: dict, agent: str) -> bool:
    """Do our entries in ``settings`` say the file was made by the install (no file before:
    ``--remove`` then removes it, not leaving ``{}`` behind; found by a bug hunt)?"""
    hooks = settings.get("hooks")
    if not isinstance(hooks, dict):
        return False
    for got in hooks.values():
        for entry in got if isinstance(got, list) else ():
            for h in _commands(entry, False) + _commands(entry, True):
                c = h.get("command")
                if ours(c, agent) and "file" in _marks(c):
                    return True
    return False


def holds_ours(path: str, agent: str) -> bool:
    """Whether the file at ``path`` already runs our hook (installed by ``install-hooks``)."""
    try:  # (a fifo there hung `run -- claude` for good: a bug hunt)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            text = f.read().decode("utf-8", "replace")
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


class _Gone(str):
    """An edit's answer: the file goes (the one an install made, emptied by --remove)."""


GONE = _Gone()


def edit_for_run(path: str, new_text_for) -> bool:
    """Back ``path`` up beside itself, then write ``new_text_for(settings, layout)``.  False
    when another live run holds a backup already: the file is edited then, but that run's
    backup stays the one that puts it back."""
    path = _real(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with locked(path):
        restore(path, dead_only=True, held=True)  # a killed run's leftover: the user's bytes
        if os.path.exists(path + BACKUP_SUFFIX):
            settings, how = load(path)
            write(path, new_text_for(settings, how))
            return False
        st = _regular(path)
        if st is not None:
            with open(path, "rb") as f:
                original, existed = f.read(), True
            mode = st.st_mode & 0o7777
        else:
            original, existed, mode = b"", False, None
        settings, how = load(path)
        text = new_text_for(settings, how)
        # what the run wrote, to tell at the restore whether the file was edited meanwhile
        wrote = hashlib.sha256(text.encode("utf-8")).hexdigest()
        _write_backup(path, {"pid": os.getpid(), "start": proc_start_ticks(os.getpid()),
                             "existed": existed, "mode": mode, "wrote": wrote}, original)
        write(path, text)
        return True


def _write_backup(path: str, meta: dict, original: bytes) -> None:
    """The backup beside ``path``: ``meta`` as one JSON line, then the original bytes."""
    _put(path + BACKUP_SUFFIX, json.dumps(meta).encode() + b"\n" + original, mode=0o600)


def _read_backup(path: str) -> tuple[dict, bytes] | None:
    try:
        with open(path + BACKUP_SUFFIX, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    head, _, original = raw.partition(b"\n")
    try:
        meta = json.loads(head)
    except ValueError:
        return None  # not ours: left alone
    return (meta, original) if isinstance(meta, dict) else None


def edit_with_backup(path: str, edit) -> bool:
    """``install-hooks``' change (``edit(settings, layout)``: the new text, None for no
    change) made to ``path``, and to the file a run's backup beside it will put back: made to
    the live file only, the run's end undid it (the user's `install-hooks cursor --user`
    during a Cursor run, or after a killed one; found by a bug hunt).  Whether the live file
    changed.  The caller holds ``locked``."""
    path = _real(path)
    settings, how = load(path)
    text = edit(settings, how)
    if text is GONE:
        os.unlink(path)
    elif text is not None:
        write(path, text)
    held = _read_backup(path)
    if held is not None:
        meta, original = held
        if meta.get("existed"):
            try:
                before, before_how = _loads(original)
            except SettingsError:
                return text is not None  # kept as the user had it
        else:  # none before the run: what the install makes is what the run's end keeps
            # (it removed the file, the install with it; found by a bug hunt)
            before, before_how = {}, {"indent": 2, "newline": True, "absent": True}
        new = edit(before, before_how)
        if new is GONE:
            meta["existed"], original = False, b""
        elif new is not None:
            meta["existed"], original = True, new.encode("utf-8")
        if text is GONE:
            meta.pop("wrote", None)  # nothing left to tell an edit by
        elif text is not None and meta.get("wrote"):
            meta["wrote"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
        _write_backup(path, meta, original)
    return text is not None


def _loads(raw: bytes) -> tuple[dict, dict]:
    """``load`` of bytes held elsewhere (a backup's)."""
    try:
        text = raw.decode("utf-8")
        if not text.strip():
            return {}, {"indent": 2, "newline": True}
        settings = json.loads(text, parse_float=_finite)
    except (ValueError, RecursionError) as e:
        raise SettingsError(f"not valid JSON ({e})") from None
    if not isinstance(settings, dict):
        raise SettingsError("not a JSON object")
    return settings, layout(text)


def _alive(pid, start=None) -> bool:
    """Is the run of ``pid`` (started at ``start``, when the backup says) still running?  A
    pid alone: a killed run's backup whose pid another process took was never put back (found
    by a bug hunt)."""
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError):
        return False
    return start is None or proc_start_ticks(int(pid)) == start


def restore(path: str, dead_only: bool = False, held: bool = False) -> bool:
    """Put ``path`` back from the backup beside it, if there is one; True if it did.
    ``dead_only``: only a backup whose run is gone (killed).  A file edited while the run had
    it (the user added a hook of their own) is kept as it is, the backup set aside beside it,
    and EditedMeanwhile says so: the backup's bytes put back threw the edit away.  ``held``:
    the caller holds ``locked`` already."""
    path = _real(path)
    if not held:
        if not os.path.exists(path + BACKUP_SUFFIX):
            return False
        with locked(path):
            return restore(path, dead_only, held=True)
    got = _read_backup(path)
    if got is None:
        return False
    meta, original = got
    if dead_only and meta.get("pid") != os.getpid() and \
            _alive(meta.get("pid"), meta.get("start")):
        return False
    if meta.get("wrote"):
        try:
            _regular(path)
            with open(path, "rb") as f:
                now = hashlib.sha256(f.read()).hexdigest()
        except FileNotFoundError:
            now = None
        if now != meta["wrote"]:
            aside = path + ".overlayrec-before-run"
            _put(aside, original, mode=0o600)
            os.unlink(path + BACKUP_SUFFIX)
            raise EditedMeanwhile(
                f"{path} was edited during the run: kept as it is, with the run's hooks in it "
                f"(`overlayrec install-hooks <agent> --remove` takes them out); the file as it "
                f"was before the run is {aside}")
    if meta.get("existed"):
        if _regular(path) is None and meta.get("mode") is not None:
            _put(path, original, mode=meta["mode"])
        else:
            _put(path, original)
            if meta.get("mode") is not None:
                os.chmod(path, meta["mode"])
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    os.unlink(path + BACKUP_SUFFIX)
    return True
