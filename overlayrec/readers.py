"""The readers' answers (``turns``, ``calls``, ``diff``): made from the journal and the live
tree, kept whole for the next time (engines.answers), and written out.  No click here: cli.py's
commands call these, and so does entry.py's way in for a plain command line (fastcli), which
spares those readers click's import (some 25 ms of every one).

A failure the user is told of in one line (exit 1) is a ``Refusal``; cli turns it into its
``Fail``.
"""
from __future__ import annotations

import errno
import json
import os
import sys
import time

from . import state
from .journal import Journal, JournalError


class Refusal(Exception):
    """A reader cannot answer: one line for the user (cli shows it, exit 1)."""


def one_line(msg: str) -> str:
    """``msg`` on one line: the line breaks in it (a path, an id as given) shown escaped, and
    a byte that is not UTF-8 in octal, as the listings show it (not Python's ``\\udcff``)."""
    import re
    return re.sub("[\n\r\v\f\x1c-\x1e\x85\u2028\u2029\udc80-\udcff]",
                  lambda m: f"\\{ord(m.group()) - 0xdc00:03o}" if m.group() >= "\udc80"
                  else repr(m.group())[1:-1], msg)


def os_error_text(e: OSError) -> str:
    name = os.fsdecode(e.filename) if isinstance(e.filename, (str, bytes)) else None
    text = f"{name + ': ' if name else ''}{e.strerror or e}"
    if e.errno == errno.EFBIG and "ulimit" not in text:
        from .views import file_size_limit
        if limit := file_size_limit():
            text += f", past {limit}: raise it"  # (it said only "File too large")
    if isinstance(e, FileNotFoundError) and name and f"{os.sep}content{os.sep}" in name:
        # a blob of the record's content store gone while this read: a gc swept it (the
        # record was cut meanwhile: an export or a replay racing a gc), or the store was
        # damaged, which `check` tells
        text += " (a blob of the record, gone while this read it: a gc ran meanwhile? run " \
            "this again; `overlayrec check` tells a damaged store)"
    return text


def say_error(msg: str) -> None:
    """An error's one line on stderr, as cli's Fail shows it."""
    emit([(2, f"overlayrec: error: {one_line(msg)}\n")])


def state_dir_for(ws: str | None, state_dir: str | None, need_journal: bool = True) -> str:
    """The state dir a command looks at: the one named, or the workspace's (``ws``; None:
    the one named, whatever it records); refused (StateError) when another user could have
    changed it (docs/storage.md), or when the one named records another workspace."""
    if state_dir:
        sd = state.check_state_dir_private(os.path.realpath(state_dir))
        if ws is not None:
            check_records(sd, ws, state_dir)
        if need_journal and not os.path.exists(os.path.join(sd, "journal", "data.mdb")):
            # a mistyped one: a revert mounted the workspace over it, began an empty record
            # there and pointed every reader at it (found by a bug hunt)
            raise state.StateError(f"no record in {state_dir} (no journal there)")
        return sd
    sd = state.find_state_dir(ws)
    if not os.path.exists(os.path.join(sd, "journal", "data.mdb")):
        # (a workspace removed since keeps its record, and readers answer from it) one never
        # recorded is most often a mistyped path: say so, not only where no journal is
        if not os.path.lexists(ws):
            raise state.StateError(f"workspace {ws}: no such directory, and no record of it "
                                   f"(no journal in {sd})")
        other = state.others_mount(ws)
        if other is not None:  # it was "not recorded", while that daemon journaled it all
            raise state.StateError(state.recorded_by_another(ws, other))
        moved = moved_record(ws)
        if moved is not None:
            raise state.StateError(f"workspace {ws} is not recorded under this name: it was "
                                   f"{moved[0]}, moved since (read its record with --state-dir "
                                   f"{moved[1]})")
        other = state.others_attic(ws)
        if other is not None:  # unmounted, it was "not recorded" (found by a bug hunt)
            raise state.StateError(state.recorded_by_another(ws, other, mounted=False))
        raise state.StateError(f"workspace {ws} is not recorded (no journal in {sd})")
    return sd


def check_records(sd: str, ws: str, named: str) -> None:
    """StateError when the state dir ``sd`` records a workspace other than ``ws`` (and not
    ``ws`` moved since), as a mount refuses it: a gc given another workspace with the state
    dir swept that directory's attic (a copy's), and every reader read the wrong tree as the
    live one (found by a bug hunt)."""
    if not os.path.exists(os.path.join(sd, "journal", "data.mdb")):
        return
    try:
        j = Journal(sd, readonly=True)
    except JournalError:
        return  # the command itself says what is wrong with the journal
    try:
        recorded = j.meta("workspace")
        if recorded and recorded != ws and not _moved_here(j, recorded, ws):
            raise state.StateError(f"state dir {named} records workspace {recorded}, not {ws}")
    finally:
        j.close()


def _moved_here(j: Journal, old: str, ws: str) -> bool:
    from .recorder import moved_here  # (the recorder's imports: only when it is asked)
    return moved_here(j, old, ws)


def moved_record(ws: str) -> tuple[str, str] | None:
    """The record ``ws`` was made under another name, when ``ws`` is that workspace moved
    (renamed) since: its attic, which moves with it, names the record's state dir, and the
    journal there recorded a path that is gone (recorder.moved_here).  (the old path, the
    state dir), or None."""
    from .recorder import ATTIC_NAME, attic_record, moved_here
    note = attic_record(os.path.join(ws, ATTIC_NAME))
    if note is None:
        return None
    sd = note["state_dir"]
    try:
        state.check_state_dir_private(sd)
        j = Journal(sd, readonly=True)
    except (state.StateError, JournalError, OSError):
        return None  # no record there any more (removed, or not the user's)
    try:
        old = j.meta("workspace")
        moved = moved_here(j, old, ws)
    finally:
        j.close()
    return (old, sd) if moved else None


def _journal_id(sd: str) -> tuple[str | None, str | None]:
    """(journal id, recorded workspace) of the record in ``sd``; (None, None) when none is."""
    if not os.path.exists(os.path.join(sd, "journal", "data.mdb")):
        return None, None
    try:
        state.check_state_dir_private(sd)
        j = Journal(sd, readonly=True)
    except (state.StateError, JournalError, OSError):
        return None, None
    try:
        return j.meta("journal_id"), j.meta("workspace")
    finally:
        j.close()


def attic_of_another_record(ws: str, sd: str) -> str | None:
    """Why a mount of ``ws`` into ``sd`` (found, not named) must not begin: the attic of ``ws``
    names another record (its RECORD note), which is this workspace's (its state dir moved,
    or the registry lost) and would be written over by a new one named by nothing.  None
    when the record is ``sd``'s, a copy's original's (its workspace another that is still
    there), or gone with no pre-image left in the attic (a fresh start loses nothing)."""
    from .recorder import ATTIC_NAME, attic_record
    attic = os.path.join(ws, ATTIC_NAME)
    note = attic_record(attic)
    if note is None:
        return None
    jid, noted = note["journal_id"], note["state_dir"]
    if _journal_id(sd)[0] == jid:
        return None
    try:
        owner = os.stat(noted).st_uid
    except OSError:
        owner = None
    if owner is not None and owner not in (0, os.geteuid()):
        # not "moved": another user's, which this one may not read; the advice to remove
        # the attic destroyed that user's pre-images, and a record begun over it took their
        # attic from them (found by a bug hunt)
        return (f"{ws} is recorded by {state._owner_name(owner)} (uid {owner}), in {noted}: "
                "only that user can go on with it (run it as that user)")
    there, recorded = _journal_id(noted)
    if there == jid:
        if recorded != ws and os.path.lexists(recorded or ""):
            return None  # a copy of that workspace: a record of its own
        return (f"the record of {ws} is in {noted} (its attic says so), not in {sd}: "
                f"mount with --state-dir {noted} to go on with it")
    try:
        kept = any(n.startswith(jid + ".") for n in os.listdir(attic))
    except OSError:
        kept = False
    if not kept:
        return None
    return (f"the attic of {ws} holds the pre-images of record {jid}, whose state dir {noted} "
            f"no longer holds it (moved?), and {sd} is not it: mount with --state-dir naming "
            f"where that state dir is now, or remove {attic} to begin a new record")


def fmt_time(ns: int) -> str:
    t = ns / 1e9
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(ns % 10**9 / 1e6):03d}"


class Parts(list):
    """A command's output as it will be shown: (1, text) for stdout, (2, text) for stderr, in
    order (kept whole by engines.answers)."""

    def out(self, text: str) -> None:
        if text:
            self.append((1, text))

    def err(self, line: str) -> None:
        self.append((2, line + "\n"))


def emit(parts) -> None:
    """Write ``parts`` as click.echo(text, nl=False) would, without importing click where
    that changes nothing: a text stream of a real encoding (click rewraps an ASCII one) and,
    on stderr, no escape character (click strips ANSI codes when the stream is no terminal).
    What goes to stdout (a patch, a file's content) keeps its escape characters, as git's
    own diff does: stripped, `diff | git apply -R` failed on a file holding one."""
    for stream, text in parts:
        f = sys.stderr if stream == 2 else sys.stdout
        if f is None or (stream == 2 and "\x1b" in text) or not _plain_stream(f):
            import click
            click.echo(text, nl=False, err=stream == 2, color=None if stream == 2 else True)
            continue
        f.write(text)
        f.flush()


def _plain_stream(f) -> bool:
    """Would click.echo write to ``f`` as it is (click's _force_correct_text_writer)?"""
    encoding = getattr(f, "encoding", None)
    if not encoding or getattr(f, "errors", None) is None or not hasattr(f, "write"):
        return False
    import codecs
    try:
        return codecs.lookup(encoding).name != "ascii"
    except LookupError:
        return True


def _echo_err(text: str) -> None:
    if sys.stderr is None:  # started with stderr closed: nowhere to say it
        return
    sys.stderr.write(text)
    sys.stderr.flush()


# -- the live tree ----------------------------------------------------------------------------

def tree_for(ws: str, sd: str):
    """The live tree: beneath the mount via the daemon's fd, or the workspace itself."""
    from .engines.states import Tree
    from . import client
    # a mount going away (its daemon unmounting: the end of a run, a release) answers as a
    # dead one, or its socket is gone, for a moment: looked at again for a few seconds before
    # it is taken for what it says (a reader run just then refused, "holds a dead mount")
    deadline = time.monotonic() + UNMOUNTING_WAIT
    while True:
        if not state.fuse_mount_at(ws):
            tree = Tree.at(ws)
            tree.unmounted = True
            return tree
        try:
            if state.is_dead_mount(ws):  # every path in it answers ENOTCONN: say what it is
                raise Refusal(f"{ws} holds a dead mount (its daemon is gone): clear it with: "
                              f"overlayrec umount {ws} (the record stays)")
            try:
                tree = Tree(client.underlay_fd(os.path.join(sd, "control.sock")))
            except client.ClientError as e:
                raise Refusal(str(e)) from None
        except Refusal:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
            continue
        tree.served = True
        return tree


UNMOUNTING_WAIT = 5.0  # seconds a reader waits for a mount that looks dead to go


def answers_of(sd: str, j, tree):
    from .engines.answers import Answers
    return Answers(state.StateDir(sd).answers, j, tree.stats_unnoted)


def new_reads():
    from .engines.answers import Reads
    return Reads()


# -- listings ---------------------------------------------------------------------------------

NO_NET = ("overlayrec: warning: the workspace cannot be read: listing every path written, not "
          "the net changes")


def listing_states(j, ws: str | None, sd: str, quiet: bool = False):
    """(States, close) over the live tree for a listing; (None, close) when the tree cannot be
    read (then warned, unless ``quiet``)."""
    from .engines.states import States
    try:
        if not ws:
            raise Refusal("the journal names no workspace")
        tree = tree_for(ws, sd)
    except (Refusal, OSError):
        if not quiet:
            _echo_err(NO_NET + "\n")
        return None, lambda: None
    return States(j, tree), lambda: os.close(tree.root_fd)


class Progress:
    """``n/total`` on a terminal's stderr for work that turns out long (shown once a second
    has passed, on one line, wiped at the end); nothing when stderr is no terminal."""

    def __init__(self, what: str, on: bool = True):
        self.what, self.on = what, on and sys.stderr is not None and sys.stderr.isatty()
        self.start, self.width, self.shown = time.monotonic(), 0, 0.0

    def __call__(self, n: int, total: int, what: str | None = None) -> None:
        """``n`` of ``total`` done; ``what``: the work's next phase, if it has one (a revert
        reads its paths back once it has written them), said from its first step on."""
        if not self.on:
            return
        if what is not None and what != self.what:
            self.what, self.shown = what, 0.0
        now = time.monotonic()
        # after the first second, ten times a second at most (and the last)
        if now - self.start >= 1.0 and (now - self.shown >= 0.1 or n == total):
            self.shown = now
            line = f"overlayrec: {self.what} {n}/{total}"
            # a shorter line than the last one shown covers all of it
            self.width = max(self.width, len(line))
            _echo_err("\r" + line.ljust(self.width))

    def done(self) -> None:
        if self.width:
            _echo_err("\r" + " " * self.width + "\r")


# what an answer was made from (a listing's rows, a diff's states), left for the process's
# exit to drop (entry._leave): freed one object at a time, 10,000 calls' rows take ~15 ms
_SPARED: list = []


def listing(kind: str, j, ws: str, sd: str, question: list, render,
            progress: Progress | None = None, **kw) -> list:
    """The answer of ``turns`` or ``calls``: ``render(rows)`` of its rows (engines.listings:
    settled rows kept between runs), kept whole for the same question of the same record
    (engines.answers).  When the tree cannot be read, the rows carry every path written, not
    the net changes, and say so."""
    from . import views
    from .engines import listings
    states, close = listing_states(j, ws, sd, quiet=True)
    try:
        if states is None:
            parts = render(views.turn_rows(j, **kw) if kind == "turns"
                           else [(r, r) for r in views.call_rows(j, **kw)])
            parts.insert(0, (2, NO_NET + "\n"))  # said once the listing is made
            return parts
        answers = answers_of(sd, j, states.tree)
        parts = answers.get(question)
        if parts is None:
            states.tree.reads = new_reads()
            kept = state.StateDir(sd).listings
            rows = (listings.turn_rows(j, states, kept, progress=progress, **kw)
                    if kind == "turns"
                    else listings.call_pairs(j, states, kept, progress=progress, **kw))
            parts = render(rows)
            answers.put(question, parts, states.tree.reads)
            _SPARED.append(rows)
        return parts
    finally:
        close()
        if progress is not None:
            progress.done()


def session_of(j, sid: str | None) -> str | None:
    """``--session``'s value as the record names it (``last``: engines.diff.session_named);
    refused when the record holds no such session (a typo would list nothing, as if the
    session had changed nothing), as ``diff`` and ``revert`` refuse it."""
    from .engines.diff import SelectionError, session_named
    try:
        sid = session_named(j, sid)
    except SelectionError as e:
        raise Refusal(str(e)) from None
    if sid is not None and j.record("sessions", sid.encode("utf-8", "surrogateescape")) is None:
        why = None
        if j.cut:  # only a gc's cut drops a session (retention: imported then)
            from .retention import dropped_selection
            why = dropped_selection(j, session=sid)
        raise Refusal(why or f"no session {sid}")
    return sid


def turns(workspace, sid, churn, as_json, state_dir) -> Parts:
    """The answer of ``overlayrec turns``."""
    ws = state.resolve_workspace(workspace, must_exist=False, upward=True)
    sd = state_dir_for(ws, state_dir)
    j = Journal(sd, readonly=True)
    try:
        sid = session_of(j, sid)
        # the times are shown in the local zone: a question of its own in another
        return listing("turns", j, ws, sd, ["turns", sid, churn, as_json,
                                            os.environ.get("TZ"), list(time.tzname)],
                       lambda rows: turn_lines(rows, churn, as_json),
                       Progress("turns", not as_json), sid=sid)
    finally:
        j.close()


def find_turn(j, sid: str | None, sel) -> dict:
    """The record of a turn as ``diff --turn`` takes it (N, ``last``, or -1, -2 ... counting
    back from the last), refused alike (engines.diff.find_turn, which ``session_of`` has
    imported already): a mistyped turn would list nothing, as if it had made no call, and a
    turn N two sessions hold would list both."""
    from .engines.diff import SelectionError, find_turn as find
    try:
        return find(j, sel, sid)
    except SelectionError as e:
        why = None
        if j.cut:  # only a gc's cut drops a turn (retention: imported then)
            from .retention import dropped_selection
            why = dropped_selection(j, turn=sel, session=sid)
        raise Refusal(why or str(e)) from None


def turn_lines(rows: list[dict], churn: bool, as_json: bool) -> Parts:
    from .views import fold, one_line
    out = []
    for r in rows:
        if as_json:
            out.append(json.dumps(r))
            continue
        paths = fold(r, touched=churn)
        prompt = one_line((r["prompt"] or "").splitlines()[0][:50]) if r["prompt"] else ""
        others = r.get("touched_others", r["others"]) if churn else r["others"]
        shared = f"  [shared with {one_line(', '.join(others))}]" if others else ""
        if r["around"]:
            shared += f"  [{AROUND_LINE}{one_line(', '.join(r['around'][:6]))}]"
        if r.get("inexact"):
            shared += f"  [{INEXACT_LINE}{one_line(', '.join(r['inexact'][:6]))}]"
        out.append(f"{one_line(r['session']):<14} {r['index']:>3} {fmt_time(r['begin_t'])} "
                   f"{r['touched_files' if churn else 'files']:>4} files  {paths:<40}  "
                   f"{prompt}{shared}")
    return text_of_lines(out)


def calls(workspace, sid, turn_sel, churn, as_json, state_dir) -> Parts:
    """The answer of ``overlayrec calls``."""
    ws = state.resolve_workspace(workspace, must_exist=False, upward=True)
    sd = state_dir_for(ws, state_dir)
    j = Journal(sd, readonly=True)
    try:
        sid = session_of(j, sid)
        turn = None
        if turn_sel is not None:
            t = find_turn(j, sid, turn_sel)  # an index before the kept answer's key
            sid, turn = t["session"], t["index"]
        return listing("calls", j, ws, sd, ["calls", sid, turn, churn, as_json],
                       lambda rows: call_lines(rows, churn, as_json),
                       Progress("calls", not as_json), sid=sid, turn=turn)
    finally:
        j.close()


def text_of_lines(lines: list[str]) -> Parts:
    """Lines as one text for stdout: one echo per line costs more than the listing on 10k rows,
    and a newline added after the join would copy megabytes once more."""
    parts = Parts()
    if lines:
        lines.append("")
        parts.out("\n".join(lines))
    return parts


# what a listing says of a unit's paths a seal found changed around the mount
AROUND_LINE = "changed around the mount meanwhile (what it left is not known): "
INEXACT_LINE = "not known exactly on one side (content the record could not keep): "

# a call's line; %-formatting: a quarter less time than the f-string's specs on 10k rows
# (a session and a call id padded, never cut: a cut id was one no command found)
_CALL_LINE = "%-14s %3s %-24s %-10.10s %4d files  %-40.40s  %s"
_UNDER_CALL = " " * 20  # its paths' line


def call_lines(pairs: list[tuple[dict, dict]], churn: bool, as_json: bool) -> Parts:
    """The lines of ``calls``: one a call, and its paths under it (views.fold's, written out
    here: 10,000 calls).  ``pairs``: listings.call_pairs's (a call's record, its row's other
    fields)."""
    out = []
    if as_json:
        for c, fields in pairs:
            row = {**c, **fields}  # as listings.call_rows merges them (no key is in both)
            if row.get("touched") is None:
                row["touched"] = row["paths"]
            out.append(json.dumps(row))
        return text_of_lines(out)
    from .views import one_line, shown_all
    line, under = _CALL_LINE, _UNDER_CALL
    for c, f in pairs:
        if churn:
            paths, n, n_git = f["touched"], f["touched_files"], f["touched_git"]
            if paths is None:
                paths = f["paths"]
        else:
            paths, n, n_git = f["paths"], f["files"], f["git_changes"]
        fields = (c["session"], c["id"], c["tool"], c["summary"] or "",
                  ", ".join(f["processes"][:4]) + (" ..." if len(f["processes"]) > 4 else ""))
        # one look at all of them (a string is printable when each of its parts is): what
        # one_line would leave as it is, nearly always; else each through it
        if not "".join(fields).isprintable():
            fields = tuple(map(one_line, fields))
        # (%s formats as str() does)
        out.append(line % (fields[0], c["turn"] or "-", fields[1], fields[2], n, fields[3],
                           fields[4]))
        own = paths[:n]
        text = shown_all(own[:6]) + (" ..." if len(own) > 6 else "")
        if n_git:
            text += (" " if text else "") + f"+ {n_git} under .git/"
        if text:
            out.append(under + text)
        if f["around"]:
            out.append(under + AROUND_LINE + shown_all(f["around"][:6])
                       + (" ..." if len(f["around"]) > 6 else ""))
        if f.get("inexact"):
            out.append(under + INEXACT_LINE + shown_all(f["inexact"][:6])
                       + (" ..." if len(f["inexact"]) > 6 else ""))
        if f["guessed"]:
            out.append(under + guessed_line(f["guessed"], f["active_with"]))
        if f.get("late"):
            out.append(under + LATE_LINE + shown_all(f["late"][:6])
                       + (" ..." if len(f["late"]) > 6 else ""))
        if f.get("interleaved"):
            out.append(under + interleaved_line(f["interleaved"]))
    return text_of_lines(out)


LATE_LINE = "changed after the call ended, by a process it left running: "


def interleaved_line(mixed: dict[str, list[str]]) -> str:
    """What a call's row says of its paths another writer changed between its own changes
    (as ``diff --call`` says it: guess_lines)."""
    from .views import one_line, shown
    some = sorted(mixed.items())
    return ("changed by another writer too, between its own changes (`revert` refuses "
            "them): " + ", ".join(f"{shown(p)} ({one_line(', '.join(us))})" for p, us in some[:6])
            + (" ..." if len(some) > 6 else ""))


def guessed_line(paths: list[str], others: list[str]) -> str:
    """What a listing says of a unit's changes placed among calls active together without
    evidence (views.guessed)."""
    from .journal.schema import parse_unit
    from .views import one_line, shown
    how = (f"by a guess (calls active together: "
           f"{one_line(', '.join(parse_unit(u).id for u in others))})" if others else
           "by time (written while it ran, by a process the agent started outside any call)")
    return (f"placed here {how}: "
            + ", ".join(map(shown, paths[:6])) + (" ..." if len(paths) > 6 else ""))


# -- diffs ------------------------------------------------------------------------------------

def workspace_glob(ws: str, glob):
    """``--path`` as the workspace-relative pattern the readers match: an absolute one is
    taken as beneath the workspace (None: the workspace itself, every path), and refused when
    it is not (it matched nothing, silently: an empty diff, "nothing to revert").  Given more
    than once (a tuple): each so, a list of them, or None when one is the whole workspace
    (click took the last alone, without a word: `revert --path a --path b` of a rename
    removed b and put nothing back, found by a bug hunt)."""
    if isinstance(glob, (tuple, list)):
        each = [workspace_glob(ws, g) for g in glob]
        if not each or None in each:
            return None
        return each[0] if len(each) == 1 else sorted(set(each))
    if glob is None:
        return glob
    out = _one_glob(ws, glob)
    if out:
        _say_symlinks_on_the_way(ws, out)
    return out


def _say_symlinks_on_the_way(ws: str, rel: str) -> None:
    """A note on stderr when a directory on the way of the path ``rel`` (not a glob) is a
    symlink in the workspace now: the record names paths as they were written, so `lnk/f`
    is not the `real/f` it reaches.  It said nothing, and answered "nothing" (found by a bug
    hunt)."""
    import glob as _glob
    import sys
    if _glob.has_magic(rel):
        return
    parts = rel.rstrip("/").split("/")
    for k in range(1, len(parts)):
        way = "/".join(parts[:k])
        try:
            target = os.readlink(os.path.join(ws, way))
        except OSError:
            continue
        from .views import shown
        sys.stderr.write(f"overlayrec: note: {shown(way)} is a symlink (to {shown(target)}): "
                         f"the record names paths as written, and {shown(rel)} is not the "
                         "path it reaches; name that path\n")
        return


def _one_glob(ws: str, glob: str) -> str | None:
    """workspace_glob of one pattern."""
    if glob == "":
        # it matched every path: a revert of the whole selection (found by a bug hunt)
        raise Refusal("--path '' names no path: give a path or a pattern (or leave --path "
                      "out for every path)")
    from .views import shown
    if not os.path.isabs(glob):
        given, here = glob, _cwd_beneath(ws)
        if here:
            # run in a directory of the workspace, a pattern is that directory's, as git
            # takes a pathspec and `blame` its path: `--path ./x` from ws/dir named the root's
            # x, and a revert there would have put back a file the user did not mean (found
            # by a bug hunt)
            glob = f"{here}/{glob}"
        if ".." in glob.split("/"):
            # `sub/../f` is f (the recorded names hold no '..'; it was refused as climbing
            # out, which it does not, found by a bug hunt)
            norm = os.path.normpath(glob)
            if norm == ".":
                return None
            if norm != ".." and not norm.startswith("../"):
                return norm + ("/" if glob.endswith("/") else "")
            # (`../f` from the root matched nothing, silently: found by a hunt)
            raise Refusal(f"--path {shown(given)}: a pattern cannot climb out of the workspace "
                          "with '..' (it is relative to the directory the command runs in, "
                          "or to the workspace's root when that is outside it)")
        return glob
    norm = os.path.normpath(glob)
    # the directories on the way resolved (a workspace reached through a symlink), the name
    # itself not: a symlink named by its absolute path is the symlink, not what it points to
    # (`--path $PWD/sym` reverted the file sym points to, found by a bug hunt)
    head, tail = os.path.split(norm)
    if os.path.realpath(norm) == ws:  # the workspace itself, by a symlink to it: all of it
        return None
    for p in (norm, os.path.join(os.path.realpath(head), tail) if tail else norm):
        if p == ws:
            return None
        if p.startswith(ws.rstrip("/") + "/"):
            return p[len(ws.rstrip("/")) + 1:] + ("/" if glob.endswith("/") else "")
    raise Refusal(f"--path {shown(glob)} is outside the workspace {shown(ws)}")


def _cwd_beneath(ws: str) -> str:
    """The cwd as a path beneath the workspace's root ("" at the root, outside the workspace,
    or with no cwd)."""
    try:
        here = os.path.realpath(os.getcwd())
    except OSError:
        return ""
    root = ws.rstrip("/") + "/"
    return here[len(root):] if here.startswith(root) else ""


def diff(workspace, call_id, turn_sel, sid, since, until, drift, fmt, binary, glob, by_writer,
         as_json, state_dir) -> Parts:
    """The answer of ``overlayrec diff``."""
    if sum(x is not None for x in (call_id, turn_sel)) + (since is not None) + drift > 1:
        raise Refusal("choose one of --call, --turn, --since, --drift")
    if call_id is None and turn_sel is None and since is None and sid is None and not drift:
        raise Refusal("say what to diff: --call ID, --turn N, --session S, --since SEQ or "
                      "--drift")
    ws = state.resolve_workspace(workspace, must_exist=False, upward=True)
    glob = workspace_glob(ws, glob)
    sd = state_dir_for(ws, state_dir)
    j = Journal(sd, readonly=True)
    try:
        tree = tree_for(ws, sd)
    except BaseException:
        j.close()
        raise
    try:
        sid = session_of(j, sid)  # "last" names another session once one begins
        # the same question of the same record: the answer kept last time (engines.answers)
        answers = answers_of(sd, j, tree)
        question = ["diff", call_id, turn_sel, sid, since, until, drift, fmt, binary, glob,
                    by_writer, as_json,
                    # a turn or call several sessions hold is the caller's own, where it says
                    # (engines.diff.callers_session): another caller's answer is another
                    os.environ.get("OVERLAYREC_SESSION") if sid is None else None]
        parts = answers.get(question)
        if parts is None:
            parts = Parts()
            tree.reads = new_reads()
            diff_answer(parts, sd, j, tree, call_id, turn_sel, sid, since, until, drift, fmt,
                        binary, glob, by_writer, as_json)
            answers.put(question, parts, tree.reads)
    finally:
        os.close(tree.root_fd)
        j.close()
    return parts


def _grouped(notes: dict[str, str]) -> dict[str, list[str]]:
    """Paths by their note, each group sorted."""
    out: dict[str, list[str]] = {}
    for p in sorted(notes):
        out.setdefault(notes[p], []).append(p)
    return out


def diff_answer(parts: Parts, sd, j, tree, call_id, turn_sel, sid, since, until, drift, fmt,
                binary, glob, by_writer, as_json) -> None:
    """The diff command's answer, into ``parts``."""
    from .engines.diff import SelectionError
    from .engines.gitdiff import GitError
    try:
        _diff_parts(parts, sd, j, tree, call_id, turn_sel, sid, since, until, drift, fmt,
                    binary, glob, by_writer, as_json)
    except (SelectionError, GitError) as e:
        raise Refusal(str(e)) from None


def _diff_parts(parts: Parts, sd, j, tree, call_id, turn_sel, sid, since, until, drift, fmt,
                binary, glob, by_writer, as_json) -> None:
    from .engines.diff import (select, carried_writers, changed, changed_around,
                               changed_since, drift_side, overlaid, own_changes)
    from .engines.gitdiff import ObjectStore, git_refuses
    from .engines.states import States, ABSENT as tree_absent, is_unlisted
    last = j.last_seq()
    states = States(j, tree)
    side = drift_side(states, glob) if drift else \
        select(j, states, call=call_id, turn=turn_sel, session=sid, since=since,
               until=until, glob=glob)
    _SPARED.append((states, side))
    from .views import few, inexact_note, shown
    moved_on = sorted(p for p, s in side.after.items() if s.drifted)
    if moved_on:
        parts.err(f"overlayrec: {len(moved_on)} path(s) here changed later outside the record "
                  f"(drift: {', '.join(map(shown, moved_on[:3]))}"
                  f"{' ...' if len(moved_on) > 3 else ''}); "
                  "`overlayrec diff --drift` shows how")
    every = changed(side)
    # a mount recording while this read (an agent at work): the paths its events named may
    # mix the record before with the tree after (docs/design.md, Known limits); said, as
    # replay says it
    _, meanwhile = changed_since(j, last, side.before.keys() | side.after.keys())
    if meanwhile and not as_json:
        parts.err(f"overlayrec: {len(meanwhile)} path(s) here changed while diff read the "
                  f"record (a mount is recording): {few(meanwhile)}; run it again once it is "
                  "quiet")
    withheld = sorted(p for p in every
                      if side.before.get(p, tree_absent).withheld
                      or side.after.get(p, tree_absent).withheld)
    if withheld and not as_json:  # the patch shows a placeholder line for each
        parts.err(f"overlayrec: {len(withheld)} secret path(s) changed, content not kept: "
                  f"{', '.join(map(shown, withheld[:5]))}{' ...' if len(withheld) > 5 else ''}")
    around = [p for p in every if not side.after.get(p, tree_absent).exact
              and changed_around(states, p)]
    if around and not as_json:
        parts.err(f"overlayrec: {len(around)} path(s) here were also changed around the mount "
                  "while the selection went on (by a process that bypassed it, such as a "
                  "shell whose directory was entered before the mount, or while its daemon "
                  "was killed): shown as they were "
                  f"after, not exactly the selection's: {', '.join(map(shown, around[:5]))}"
                  f"{' ...' if len(around) > 5 else ''}")
    if not as_json:
        for line in guess_lines(side) + reverts_inside_lines(side):
            parts.err(line)
    unreadable = sorted(states.tree.unreadable)
    for note, group in _grouped(states.tree.unreadable).items():
        if not as_json:  # a file's content is shown as a placeholder
            parts.err(f"overlayrec: {len(group)} path(s) here {note}: "
                      f"{', '.join(map(shown, group[:5]))}{' ...' if len(group) > 5 else ''}")
    # a side the record cannot give exactly (content it could not keep: a file past the
    # whole-file limit changed around it or while unmounted, an attic entry gone), either side
    inexact = sorted({p for p, s in side.before.items() if not s.exact}
                     | {p for p, s in side.after.items() if not s.exact})
    told = set(withheld) | set(around) | set(unreadable)
    open_ends = [p for p in inexact if p in every and p in states.open_ends and p not in told]
    if open_ends and not as_json:
        parts.err(unsealed_note([shown(p) for p in open_ends]))
    told |= set(open_ends)
    vague = [p for p in inexact if p in every and p not in told]
    if vague and not as_json:
        parts.err("overlayrec: " + inexact_note([shown(p) for p in vague]))
    unseen = unseen_links(side, every)
    if unseen and not as_json:
        parts.err(f"overlayrec: {len(unseen)} file(s) changed in place have other names the "
                  f"record never saw (hard links made outside the mount), changed there too: "
                  f"{', '.join(map(shown, unseen[:5]))}{' ...' if len(unseen) > 5 else ''}")
    store = ObjectStore(sd)
    # git holds no .git/ path: they are left out, and said so (left_out_lines)
    left_out = [p for p in every if git_refuses(p)]
    # nor a fifo, a socket, a device, an empty directory, a directory's mode, a file's mode
    # bits but x, an owner: such changes are said too, or the patch would disagree with the
    # listings (which count them) without a word
    # (a drift's directory: what lies beneath it was made while unmounted, not recorded, so
    # none is called empty; "file -> empty directory" of one holding files: a bug hunt)
    unshown = not_in_patch(side, [p for p in every if not git_refuses(p)],
                           drift or any(map(is_unlisted, states.tree.unreadable.values())))
    groups = [(None, sorted(side.before))]
    # a path several writers changed: each writer's section shows its own change of it
    own = own_changes(states, side) if by_writer and not as_json else {}
    sides = {}  # a writer's (before, after), where its own change differs from the selection's
    for unit, o in own.items():
        sides[unit] = (overlaid(side.before, o.before), overlaid(side.after, o.after))
    if by_writer:
        units = sorted({u for us in side.writers.values() for u in us})

        def blob(p: str, before: dict, after: dict) -> bool:
            # a directory is no path of git's: as a pathspec it would take every change
            # beneath it, whoever made it (a call that renamed the directory got them all);
            # a path is a file on one side of the writer's own change (one the selection left
            # absent both sides, made and moved on, lost its writers' sections: a hunt found)
            return before.get(p, tree_absent).kind not in ("dir", "absent") or \
                after.get(p, tree_absent).kind not in ("dir", "absent")
        groups = [(u, sorted(p for p, us in side.writers.items()
                             if u in us and not git_refuses(p) and
                             blob(p, *sides.get(u, (side.before, side.after)))))
                  for u in units]
        groups = [(u, ps) for u, ps in groups if ps]
    a, b = store.trees(side.before, side.after)
    if as_json:  # it names the trees: kept while the object store that holds them is there
        tree.reads.note_abs(os.path.join(state.StateDir(sd).git, "objects"))
        # git's -z forms: each path as it is (the plain ones C-quote a name with a newline,
        # a tab, a quote or a backslash, and write a rename as "a => b")
        status = {}
        fields = store.diff(a, b, "name-status-z").split("\0")
        i = 0
        while i + 1 < len(fields):
            code = fields[i]
            if code[:1] in ("R", "C"):
                status[fields[i + 2]] = {"status": code, "from": fields[i + 1]}
                i += 3
            else:
                status[fields[i + 1]] = {"status": code, "from": None}
                i += 2
        nums = {}
        fields = store.diff(a, b, "numstat-z").split("\0")
        i = 0
        while i < len(fields) and fields[i]:
            add, dele, p = fields[i].split("\t", 2)
            if p == "":  # a rename: its two paths follow
                p, i = fields[i + 2], i + 3
            else:
                i += 1
            nums[p] = (None if add == "-" else int(add), None if dele == "-" else int(dele))
        carried = carried_writers(side)
        ours = set().union(*side.writers.values())  # (the events hold others' too)
        files = [{"path": p, **st, "added": nums.get(p, (None, None))[0],
                  "deleted": nums.get(p, (None, None))[1],
                  # a rename's writers are its old name's too, and so are those of a name
                  # moved to it inside the selection; a file that is no rename has no "from"
                  # (not the root's "", whose writers changed only the root)
                  "writers": sorted(side.writers.get(p, set()) | (carried.get(p, set()) & ours)
                                    | (side.writers.get(st["from"], set())
                                       if st.get("from") is not None else set()))}
                 for p, st in sorted(status.items())]
        parts.out(json.dumps({"from_tree": a, "to_tree": b, "files": files,
                              "inexact": inexact,
                              "withheld": withheld, "unreadable": unreadable,
                              "changed_around": around, "changed_meanwhile": meanwhile,
                              "guessed": side.guessed, "maybe_ours": side.maybe_ours,
                              "late": side.late,
                              "reverts_inside": [{"revert": r, "paths": ps}
                                                 for r, ps in side.reverts.items()],
                              "git_left_out": len(left_out), "git_left_out_paths": left_out,
                              "not_in_patch": [{"path": p, "change": what}
                                               for p, what in unshown],
                              "unseen_links": unseen,
                              "git_warnings": store.warnings}) + "\n")
    else:
        for unit, paths in groups:
            ua, ub = store.trees(*sides[unit]) if unit in sides else (a, b)
            out = store.diff(ua, ub, fmt, paths=paths if unit else None, binary=binary)
            if unit and out:
                parts.out(f"# {unit}\n")
            parts.out(out)
    if unshown and not as_json:
        parts.err(unshown_line(unshown))
    for line in left_out_lines(len(left_out), store):
        parts.err(line)


def unsealed_note(paths: list[str]) -> str:
    """The line that names the paths of a diff whose end is the live tree of a record left
    unsealed (engines.states.left_unsealed); ``paths`` as shown."""
    return (f"overlayrec: the record was left unsealed (its daemon ended without sealing it: "
            f"killed, or its state dir full; the next mount seals it): {len(paths)} path(s) "
            f"here end at the live tree, which may hold changes made since, not known to be "
            f"the record's: {', '.join(paths[:5])}{' ...' if len(paths) > 5 else ''}")


def reverts_inside_lines(side) -> list[str]:
    """What ``diff --session`` says of each revert run inside the session (Side.reverts): its
    changes are in the workspace at the session's end, and in the session's exported chain,
    not in the session's own diff."""
    from .views import shown
    return [f"overlayrec: revert {rid} ran inside this session and changed {len(paths)} "
            f"path(s) ({', '.join(map(shown, paths[:5]))}{' ...' if len(paths) > 5 else ''}): "
            "not in this diff, which holds the session's own changes; the workspace at the "
            "session's end, and its exported chain, hold them"
            for rid, paths in sorted(getattr(side, "reverts", {}).items())]


def guess_lines(side) -> list[str]:
    """What ``diff`` and ``revert`` of a call say of changes placed among calls active
    together without evidence (engines.diff.Side.guessed, maybe_ours): the selection may hold
    another call's change, or miss one of its own; and of its changes made after it ended
    (Side.late)."""
    from .views import shown
    out = []
    if side.guessed:
        out.append(f"overlayrec: {len(side.guessed)} path(s) here were placed in this call by a "
                   "guess (other calls were active together, or a process the agent started "
                   "outside any call wrote while it ran, and nothing said whose they are): "
                   f"{', '.join(map(shown, side.guessed[:5]))}"
                   f"{' ...' if len(side.guessed) > 5 else ''}")
    mixed = getattr(side, "interleaved", None)
    if mixed and hasattr(side, "before"):
        # only the paths the diff shows: one the other writer put back as it was (a revert of
        # the selection's own call inside it) is in no diff, and no revert refuses it
        from .engines.states import ABSENT
        mixed = {p: us for p, us in mixed.items()
                 if not side.before.get(p, ABSENT).same(side.after.get(p, ABSENT))}
    if mixed:
        # a turn's path another writer changed only before the turn's first change to it: its
        # revert puts back the state just before that change, theirs kept (the note said
        # `revert` refuses them: found by a bug hunt)
        earlier = getattr(side, "earlier", set())
        refused = {p: us for p, us in mixed.items() if p not in earlier}
        kept = {p: us for p, us in mixed.items() if p in earlier}

        def some(paths: dict) -> str:
            return ", ".join(f"{shown(p)} ({', '.join(us)})"
                             for p, us in sorted(paths.items())[:5]) + \
                (" ..." if len(paths) > 5 else "")
        if refused:
            out.append(f"overlayrec: {len(refused)} path(s) here were changed by another writer "
                       "too, between this selection's own changes (or, in a turn, after them "
                       "within it; the diff holds theirs, and `revert` refuses them): "
                       + some(refused))
        if kept:
            out.append(f"overlayrec: {len(kept)} path(s) here were changed by another writer "
                       "within this turn before its own first change to them (the diff holds "
                       "theirs; `revert` keeps them, putting back what was there just before "
                       "the turn's first change): " + some(kept))
    if side.late:
        out.append(f"overlayrec: {len(side.late)} path(s) here were changed after the call "
                   "ended, by a process it left running (a server, a watcher, a build daemon; "
                   "another call may have set it to work): "
                   f"{', '.join(map(shown, side.late[:5]))}{' ...' if len(side.late) > 5 else ''}")
    from .journal.schema import parse_unit
    for unit, paths in side.maybe_ours.items():
        other = parse_unit(unit).id
        out.append(f"overlayrec: {len(paths)} path(s) placed by a guess in call {other}, active "
                   f"together with this one, may be this call's: "
                   f"{', '.join(map(shown, paths[:5]))}{' ...' if len(paths) > 5 else ''} "
                   f"(`--call {other}` selects them)")
    return out


def unseen_links(side, paths: list[str]) -> list[str]:
    """The ``paths`` whose file was changed in place (the same inode before and after) while
    it had more names than the record saw: the names of a hard link made outside the mount,
    which the daemon learns only once it has reached the inode by each (docs/design.md, "Known
    limits").  Their change is in no patch, and the diff says so.  A name the selection saw
    (one it touched that held the inode before or after, or one its events saw hold it, such as
    a link made through the mount and removed again) is no such name."""
    from .engines.states import ABSENT
    out = []
    for p in paths:
        b, a = side.before.get(p, ABSENT), side.after.get(p, ABSENT)
        if b.kind != "file" or a.kind != "file" or b.nlink < 2 or not b.ino or \
                a.ino != b.ino or b.data == a.data:
            continue
        seen = {q for q in side.before if side.before[q].ino == b.ino
                or side.after.get(q, ABSENT).ino == b.ino}
        seen |= side.linked.get(b.ino, set())
        if len(seen) < b.nlink:
            out.append(p)
    return out


def _git_entry(s) -> tuple | None:
    """What a git tree holds of a State: a file's content and its x bit, a symlink's target;
    nothing of any other kind, nor of modes and owners beyond that."""
    if s.kind == "file":
        return ("100755" if s.mode & 0o111 else "100644", s.data)
    if s.kind == "symlink":
        return ("120000", s.data)
    return None


def not_in_patch(side, paths: list[str], unlisted: bool = False) -> list[tuple[str, str]]:
    """The changed ``paths`` of a Side (``engines.diff.changed``) whose change a git patch
    cannot show, each with a few words of what it was.  A directory made or removed with files
    that the patch shows is shown by them (but for the mode of one made: git applies 0755).
    ``unlisted``: a directory here could not be listed, so none is called empty."""
    from .engines.states import ABSENT
    from .engines.large import over_limit
    from .views import human_size
    hidden, shown_under, partly = [], set(), {}
    masked_before, masked_after = _masked(side.before), _masked(side.after)
    # the content of the files that left a name: one that comes to another name is renamed
    # there in the patch (git's rename), not made (a renamed 0600 file was said "file made"
    # under the patch's "rename to": found by a bug hunt)
    left = {bytes(b.data) for p in paths
            if (b := side.before.get(p, ABSENT)).kind == "file" and
            side.after.get(p, ABSENT).kind == "absent" and isinstance(b.data, bytes)}
    for p in paths:
        b, a = side.before.get(p, ABSENT), side.after.get(p, ABSENT)
        big = [s for s in (b, a) if over_limit(s.data)]
        if big:  # left out of both trees (ObjectStore.trees): gigabytes in a patch help no one
            partly[p] = (f"a file of {human_size(max(len(s.data) for s in big))}, too large "
                         "for a patch")
            continue
        if p in masked_before or p in masked_after:
            # each path's side is read at its own point (just before the selection's first
            # change to it, just after its last), so one side may hold a file at a name and
            # paths beneath that name, as a directory took it later: one git tree holds the
            # paths beneath, and the file's change went missing without a word
            partly[p] = (f"{(b if p in masked_before else a).kind} {'before' if p in masked_before else 'after'}, "
                         "its name a directory's on that side")
            continue
        if _git_entry(b) != _git_entry(a):
            parent = p.rpartition("/")[0]
            while parent and parent not in shown_under:
                shown_under.add(parent)
                parent = parent.rpartition("/")[0]
            said = [w for w in (_kind_left_out(p, b, a, side, paths, unlisted),
                                _left_out_of_file(b, a, left)) if w]
            if said:
                partly[p] = ", ".join(said)
        else:
            hidden.append((p, b, a))
    out = list(partly.items())
    for p, b, a in hidden:
        if b.kind != a.kind:
            what = (f"{a.kind} made" if b.kind == "absent" else f"{b.kind} removed"
                    if a.kind == "absent" else f"{b.kind} -> {a.kind}")
            if "dir" in (b.kind, a.kind) and "absent" in (b.kind, a.kind):
                if p not in shown_under:
                    what = ("" if unlisted else "empty ") + what.replace("dir", "directory")
                    if a.kind == "dir" and a.mode != 0o755:
                        # (`mkdir d; chmod 555 d` was "empty directory made": a bug hunt)
                        what += f", mode {a.mode:04o}"
                elif a.kind == "dir" and a.mode != 0o755:  # git apply makes it 0755 (umask 022)
                    what = f"directory made, mode {a.mode:04o}"
                else:
                    continue
        else:
            said = ([f"mode {b.mode:04o} -> {a.mode:04o}"]
                    if b.mode != a.mode and b.kind != "symlink" else []) + \
                ([f"owner {b.uid}:{b.gid} -> {a.uid}:{a.gid}"] if _owners_differ(b, a) else [])
            what = ", ".join(said) or "changed"
        out.append((p, what))
    return sorted(out, key=lambda pw: pw[0])


def _masked(states: dict) -> set[str]:
    """The paths whose file or symlink in ``states`` (one side of a diff) a git tree of that
    side cannot hold: other paths of the side lie beneath their name."""
    from .engines.large import over_limit
    from .views import git_refuses
    held = [p for p, s in states.items() if _git_entry(s) is not None and
            not over_limit(s.data) and not git_refuses(p)]
    dirs: set[str] = set()
    for p in held:
        parent = p.rpartition("/")[0]
        while parent and parent not in dirs:
            dirs.add(parent)
            parent = parent.rpartition("/")[0]
    return dirs.intersection(held)


def _owners_differ(b, a) -> bool:
    """Do two states name different owners, where both know theirs (State.same's rule: a
    state the record cannot know, such as what a unit left of a file removed around the
    mount, has none)?"""
    return None not in (b.uid, a.uid) and (b.uid, b.gid) != (a.uid, a.gid)


def _kind_left_out(p: str, b, a, side, paths: list[str], unlisted: bool) -> str | None:
    """A file or symlink that became what no git tree holds, or came from it: a fifo, a socket,
    a device, an empty directory (one with files is shown by them; ``unlisted``: what lies
    beneath is not known, so none is called empty).  The patch shows only the file's side:
    applied, it left the path missing, or failed on what stood there."""
    from .engines.states import ABSENT

    def unheld(s, states) -> str | None:
        if s.kind in ("fifo", "socket", "device"):
            return s.kind
        if s.kind == "dir" and not any(q.startswith(p + "/") and
                                       _git_entry(states.get(q, ABSENT)) for q in paths):
            return "directory" if unlisted else "empty directory"
        return None
    after, before = unheld(a, side.after), unheld(b, side.before)
    if after:
        return f"{b.kind} -> {after}"
    if before:
        return f"{before} -> {a.kind}"
    return None


def _left_out_of_file(b, a, left: set = frozenset()) -> str | None:
    """What a patch showing a file's change (its content, its x bit, its kind) leaves out:
    git holds a file's mode as 0644 or 0755 and no owner, and applies a file it makes with one
    of those two.  ``left``: the contents of the files that left their names (one of them
    come here was renamed)."""
    if a.kind != "file":
        return None
    if b.kind == "file":
        said = []  # both, where both changed (the owner went unsaid beside a mode)
        if b.mode != a.mode and not {b.mode, a.mode} <= {0o644, 0o755}:
            said.append(f"mode {b.mode:04o} -> {a.mode:04o}")
        if _owners_differ(b, a):
            said.append(f"owner {b.uid}:{b.gid} -> {a.uid}:{a.gid}")
        return ", ".join(said) or None
    if a.mode not in (0o644, 0o755):
        made = ("renamed here" if isinstance(a.data, bytes) and a.data in left else
                "file made") if b.kind == "absent" else f"{b.kind} -> file"
        return f"{made}, mode {a.mode:04o}"
    return None


def event_not_in_patch(tree, before: dict, after: dict, drift: bool) -> list[tuple[str, str]]:
    """``not_in_patch`` of one event (``show``): its paths' states just before and just after
    it, as ``diff`` says of a selection (a mode, an owner, an empty directory, a fifo ...).
    What lies beneath a directory a ``drift`` found is not among its paths: none is called
    empty (a file the user replaced by a directory of files while unmounted was said "file ->
    empty directory").  A path the event left holding what it held (a utimens, an xattr, a
    removexattr that failed: times and xattrs are no part of a state) is not said: it was
    "f (changed)", a change diff does not show and replay does not restore (found by a bug
    hunt)."""
    from types import SimpleNamespace
    from .engines.states import is_unlisted
    from .views import git_refuses
    paths = [p for p in before if not git_refuses(p) and not (
        before[p].exact and after[p].exact and before[p].same(after[p]))]
    return not_in_patch(SimpleNamespace(before=before, after=after), paths,
                        drift or any(map(is_unlisted, tree.unreadable.values())))


def unshown_line(unshown: list[tuple[str, str]]) -> str:
    """The stderr line that says what a patch could not show (``not_in_patch``)."""
    from .views import shown
    some = ", ".join(f"{shown(p)} ({what})" for p, what in unshown[:4])
    more = f" and {len(unshown) - 4} more" if len(unshown) > 4 else ""
    return (f"overlayrec: {len(unshown)} change(s) a git patch cannot show: {some}{more}; "
            "`overlayrec replay` restores them")


def left_out_lines(n: int, store, what: str = "shown") -> list[str]:
    """How many changes under .git/ a diff or an export left out (git holds no .git/ path;
    replay restores them), and whatever else git warned about: lines for stderr."""
    from .engines.gitdiff import left_out_note
    return ([left_out_note(n, what)] if n else []) + \
        [f"overlayrec: git: {w}" for w in store.warnings]


LEFT_LOOKS = 100_000  # events looked back through for the name an attic entry left


def left_name(j, path: str, seq: int) -> str | None:
    """The workspace name whose file an attic path holds (``.overlayrec-attic/<id>.gone.<ino>``:
    a file replaced or removed while a process kept it open, written through that descriptor
    since), from the last event before ``seq`` whose pre-image names its inode; None for any
    other path, or when none of the last LEFT_LOOKS events does."""
    if not path.startswith(".overlayrec-attic/"):
        return None
    ino = path.rpartition(".gone.")[2]
    if not ino.isdigit():
        return None
    found = None
    for e in j.events(max(1, seq - LEFT_LOOKS), seq - 1):
        for pre, name in (("pre", e.get("path")), ("pre2", e.get("path2"))):
            if name and not name.startswith(".overlayrec-attic") and \
                    (e.get(pre) or {}).get("ino") == int(ino):
                found = name
    return found


def attic_shown(j, path: str, seq: int) -> str | None:
    """How a reader names an attic path an event wrote (``left_name``): the name its file left,
    and how it was still written; None for a workspace path."""
    from .views import shown
    if not path.startswith(".overlayrec-attic/"):
        return None
    left = left_name(j, path, seq)
    return (f"(the file that left {shown(left)}" if left else "(a file that left the workspace") \
        + ", written through a descriptor still open on it)"
