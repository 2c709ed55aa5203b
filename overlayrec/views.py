"""Listings of sessions, turns and calls: pure functions of the journal (no mount needed)."""
from __future__ import annotations

import os

from .journal import Journal
from .journal.schema import (CONTROL_OPS, MARK_OPS, call_unit as _call_unit, outside_unit,
                             parse_unit, unit_session)


ATTIC_PREFIX = ".overlayrec-attic/"  # the hidden attic's namespace (recorder.ATTIC_NAME)

# C's escapes as git writes them in a quoted path: byte -> the letter after the backslash
C_ESCAPES = {7: "a", 8: "b", 9: "t", 10: "n", 11: "v", 12: "f", 13: "r", 34: '"', 92: "\\"}


def _escaped(text: str, quotes: bool) -> str:
    out = []
    for ch in text:
        o = ord(ch)
        if quotes and o in C_ESCAPES or not quotes and o < 32 and o in C_ESCAPES:
            out.append("\\" + C_ESCAPES[o])
        elif ch.isprintable():
            out.append(ch)
        else:  # a control character, a bidi mark, or a byte that was not UTF-8
            out.extend(f"\\{b:03o}" for b in ch.encode("utf-8", "surrogateescape"))
    return "".join(out)


def path_matcher(pattern):
    """What ``--path PATTERN`` selects, as a predicate on workspace-relative paths: the path
    itself (a name with ``*``, ``?`` or ``[`` in it matches as written), a directory and
    everything beneath it (``src``, ``src/``), or a glob (fnmatch: ``*`` crosses ``/``).  A
    leading ``./`` is the workspace's; ``.`` and ``./`` are all of it, and ``d/./f`` and
    ``d//f`` are ``d/f`` (they selected nothing, or the root alone: found by a hunt).
    Several patterns (``--path`` given again) select what any of them selects."""
    import fnmatch
    if not isinstance(pattern, str):
        each = [path_matcher(p) for p in pattern]
        return lambda p: any(m(p) for m in each)
    pat = "/".join(part for part in pattern.split("/") if part not in ("", "."))
    if not pat:
        return lambda p: True
    beneath = pat + "/"
    return lambda p: p == pat or p.startswith(beneath) or fnmatch.fnmatchcase(p, pat)


def named(items, limit: int = 10) -> str:
    """``items`` (strings) for one line: the first ``limit`` and a count of the rest (the
    full list is the caller's --json or its listing above)."""
    items = list(items)
    more = f" and {len(items) - limit:,} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def shown(path: str) -> str:
    """A path for a terminal, as git prints one: as it is, or C-quoted (``"new\\nline"``,
    octal for other bytes) when it holds a control character, a double quote, a backslash,
    an invisible or bidi mark, or bytes that are not UTF-8.  A name then can neither break a
    listing's rows nor send the terminal an escape sequence."""
    if path.isprintable() and '"' not in path and "\\" not in path:
        return path or "."  # "": the workspace root
    return '"' + _escaped(path, True) + '"'


def few(paths: list[str], n: int = 5) -> str:
    """The first ``n`` of ``paths`` as shown, and `` ...`` when there are more (a line's
    names; --json holds them all)."""
    return ", ".join(map(shown, paths[:n])) + (" ..." if len(paths) > n else "")


def shown_all(paths: list[str]) -> str:
    """``", ".join(map(shown, paths))``, with one look at the joined text when every path
    would be shown as it is (a string is printable when each of its parts is): the 10,000 rows
    of ``calls`` spare 60,000 calls.  A name holding the separator is quoted (``"a, b"``):
    one file named so read as two, ``a`` and ``b``."""
    text = ", ".join(paths)
    if text.isprintable() and '"' not in text and "\\" not in text and all(paths) and \
            text.count(", ") == len(paths) - 1:
        return text
    return ", ".join('"' + _escaped(p, True) + '"' if ", " in p else shown(p) for p in paths)


def inexact_note(paths: list[str]) -> str:
    """The line that names the paths of a diff whose content on one side is not known exactly
    (``diff``'s stderr, the report's patches, ``records diff``); ``paths`` as shown."""
    return (f"{len(paths)} path(s) here are not known exactly on one side (content the record "
            f"could not keep), shown as near as it can: {', '.join(paths[:5])}"
            f"{' ...' if len(paths) > 5 else ''}")


def unit_shown(unit: str | None) -> str:
    """A unit key for a terminal: a call's id as the agent gave it (the key escapes ':' and
    '%' in it: ``call:S:Bash%3A1`` is ``call:S:Bash:1``, which ``replay --at`` takes too), on
    one line; ``-`` for none."""
    u = parse_unit(unit)
    if u is None:
        return "-"
    return one_line(f"call:{u[1]}:{u[2]}" if u[0] == "call" else unit)


def one_line(text: str) -> str:
    """Free text (a call's summary, a prompt's first line) on one line of a terminal: control
    characters and invisible marks escaped, nothing quoted."""
    return text if text.isprintable() else _escaped(text, False)


def command_name(actor: dict | None) -> str:
    if not actor:
        return "?"
    if actor.get("argv"):
        return os.path.basename(actor["argv"][0])
    return os.path.basename(actor.get("exe") or "?")


def file_events(j: Journal, since: int = 1, until: int | None = None):
    """Events that change the tree (not control events, not failed ones)."""
    failed = set()
    evs = []
    for ev in j.events(since, until):
        if ev["op"] == "failed":
            failed.add(ev["ref"])
        elif ev["op"] not in CONTROL_OPS and ev["op"] not in MARK_OPS:
            evs.append(ev)
    return [e for e in evs if e["seq"] not in failed]


def _paths(ev: dict) -> list[str]:
    return [p for p in (ev.get("path"), ev.get("path2")) if p is not None]


def writer_name(j: Journal, unit: str, actors: dict) -> str:
    u = parse_unit(unit)
    if u is not None and u.kind == "revert":
        return "revert " + u.id
    if u is not None and u.kind == "outside":
        key = u.id
        if key not in actors:
            actors[key] = j.actor(key)
        a = actors[key]
        if a and not a.get("pid") and a.get("argv"):
            return a["argv"][0]  # the record's own writers: "(while unmounted)", "(around ...)"
        return f"{command_name(a)}[{a['pid'] if a else '?'}]"
    return "session " + (unit_session(unit) or "?")


def git_refuses(path: str) -> bool:
    """Is ``path`` one git will not hold in a tree: a ``.git`` directory or what is beneath it
    (any component named ``.git``, in any case)?  Listings fold these into a count, diffs and
    exports leave them out and say how many; ``overlayrec replay`` restores them.  (git refuses
    a few more names, e.g. NTFS aliases of ``.git``: those surface as git's own warning.)"""
    # on the whole path at once (listings ask it of every path of every row): a component is
    # ".git" when the lowered path is it, begins or ends with it, or holds it between slashes
    p = path.lower()
    return p == ".git" or p.startswith(".git/") or p.endswith("/.git") or "/.git/" in p


def unit_listing(net, evs: list[dict], bounds: tuple[int, int] | None = None) -> dict:
    """The row fields of one unit from its events.  ``net(evs, bounds)`` (from the engines:
    engines.diff.net_of) gives (the paths whose state differs between the unit's two points,
    every path the unit touched): then ``paths`` are only the changes (churn, such as a temp
    file made and removed, a rewrite with the same content or a chmod to the same mode, is not
    one) and ``touched`` all it wrote.  Without ``net``: the touched."""
    touched = {p for e in evs for p in _paths(e)}
    if net is None:
        return listing(touched, None)
    changed, more = net(evs, bounds)
    return dict(listing(touched | set(more), changed),
                inexact=list(getattr(net, "inexact", ())))


def listing(touched, net: list[str] | None) -> dict:
    """A listing row's path fields, the workspace's own files first, then those under .git/:
    ``paths`` the net changes (``files`` of the workspace's own, ``git_changes`` under .git/),
    ``touched`` every path written, churn included (``touched_files``, ``touched_git``).
    Without ``net`` (no tree to read) the net is the touched, and ``net`` is false.  The
    workspace's root itself ("", e.g. a ``chmod -R .``) is not named."""
    def split(ps):
        ps = {p for p in ps if p and p != ".overlayrec-attic"
              and not p.startswith(".overlayrec-attic/")}
        own = sorted(p for p in ps if not git_refuses(p))
        return own, sorted(p for p in ps if git_refuses(p))
    t_own, t_git = split(touched)
    n_own, n_git = split(net) if net is not None else (t_own, t_git)
    return {"files": len(n_own), "git_changes": len(n_git), "paths": n_own + n_git,
            "touched_files": len(t_own), "touched_git": len(t_git), "touched": t_own + t_git,
            "net": net is not None}


def fold(row: dict, touched: bool = False, first: int = 3) -> str:
    """A row's paths for a terminal: the first of the workspace's own, then the ones under .git/
    as a count ("a.py, b.py ... + 45 under .git/"); ``touched``: churn included."""
    key, own_n, git_n = ("touched", "touched_files", "touched_git") if touched else \
        ("paths", "files", "git_changes")
    own = row[key][:row[own_n]]
    text = shown_all(own[:first]) + (" ..." if len(own) > first else "")
    if row[git_n]:
        text += (" " if text else "") + f"+ {row[git_n]} under .git/"
    return text


def turn_rows(j: Journal, sid: str | None = None, net=None) -> list[dict]:
    """One row per turn; with ``net`` (see unit_listing), ``paths`` are the net changes of the
    session's units from the turn's begin to its end (``touched``: all they wrote)."""
    last = j.last_seq()
    actors: dict = {}
    return [{**turn_record_fields(t), **turn_fields(j, t, last, net, actors)}
            for t in j.records("turns", (sid.encode() + b"\0") if sid else b"")]


def turn_record_fields(t: dict) -> dict:
    return {"session": t["session"], "index": t["index"], "begin_t": t["begin_t"],
            "end_t": t["end_t"], "prompt": t.get("prompt")}


def turn_fields(j: Journal, t: dict, last: int, net, actors: dict) -> dict:
    """A turn row's fields from the journal: its paths (unit_listing), who else wrote."""
    s = t["session"]
    bounds = (t["begin_seq"], t["end_seq"] or last)
    mine, by_other = [], {}
    for e in file_events(j, *bounds):
        if unit_session(e.get("unit")) == s:
            mine.append(e)
        else:
            by_other.setdefault(writer_name(j, e.get("unit") or outside_unit(e["actor"]),
                                            actors), []).append(e)
    fields = unit_listing(net, mine, bounds)
    # only a writer that left something changed (an editor's swap and lock files made and
    # removed were "shared with" it: found by a bug hunt); ``touched_others``: every writer
    others = [w for w, evs in by_other.items()
              if net is None or (row := unit_listing(net, evs, bounds))["files"] or
              row["git_changes"]]
    return {**fields, "others": sorted(others), "touched_others": sorted(by_other),
            "seq": [t["begin_seq"], t["end_seq"]], **_unknown(net, mine, fields)}


def call_rows(j: Journal, sid: str | None = None, turn: int | None = None, net=None
              ) -> list[dict]:
    """One row per call; with ``net`` (see unit_listing), ``paths`` are the net changes of the
    call (each path from just before the call's first change to it to just after its last),
    ``touched`` all it wrote.  One pass over the journal."""
    by_unit: dict[str, list[dict]] = {}
    for e in file_events(j):
        by_unit.setdefault(e.get("unit") or "", []).append(e)
    actors: dict = {}
    return [{**c, **call_fields(j, by_unit.get(call_unit(c), []), net, actors)}
            for c in calls_of(j, sid, turn)]


def calls_of(j: Journal, sid: str | None = None, turn: int | None = None) -> list[dict]:
    """The call records (of a session, of a turn), in the order they began."""
    # records are compact JSON: a call of turn N holds '"turn":N' (and one of turn N0 too,
    # which the check below leaves out); the others are not decoded
    calls = j.records("calls", (sid.encode() + b"\0") if sid else b"",
                      holding=None if turn is None else b'"turn":%d' % turn)
    calls.sort(key=lambda c: c["begin_t"])
    return [c for c in calls if turn is None or c.get("turn") == turn]


def call_unit(c: dict) -> str:
    """The unit key of a call's record."""
    return _call_unit(c["session"], c["id"])


def call_fields(j: Journal, evs: list[dict], net, actors: dict) -> dict:
    """A call row's fields from its events: paths (unit_listing), the processes that wrote."""
    procs = []
    for e in evs:
        if e["actor"] not in actors:
            actors[e["actor"]] = j.actor(e["actor"])
        name = f"{command_name(actors[e['actor']])}[{e['actor'].split(':')[0]}]"
        if name not in procs:
            procs.append(name)
    fields = unit_listing(net, evs)
    return {**fields, "processes": procs, "events": len(evs),
            "late_events": sum(1 for e in evs if e.get("after_end")), "late": late(evs),
            **_unknown(net, evs, fields), **guessed(evs)}


def late(evs: list[dict]) -> list[str]:
    """The paths of a call's events made after it ended, by a process it left running (a
    server, a watcher, a build daemon: ``after_end``).  Its diff and revert hold them, though
    other calls ran meanwhile and may have set the process to work."""
    paths: dict[str, None] = {}
    for e in evs:
        if e.get("after_end"):
            for p in (e.get("path"), e.get("path2")):
                if p is not None and not p.startswith(ATTIC_PREFIX) and p != ATTIC_PREFIX[:-1]:
                    paths[p] = None
    return sorted(paths)


def guessed(evs: list[dict]) -> dict:
    """What of a unit's events was placed in a call without evidence from the process tree:
    among calls active together (``calls.Calls._choose``'s ``newest``, or the first candidate
    in events written before ``chosen`` existed), or by time (``during``: written while the
    call ran by a process the agent started outside any call, such as a persistent shell).
    ``guessed``, their paths; ``active_with``, the other calls active then.  A revert or a
    diff of such a call may take another call's change, or leave one."""
    paths: dict[str, None] = {}
    others: dict[str, None] = {}
    for e in evs:
        cands = e.get("candidates")
        if not cands or e.get("chosen", "newest") not in ("newest", "during"):
            continue
        for p in (e.get("path"), e.get("path2")):
            if p is not None and not p.startswith(ATTIC_PREFIX) and p != ATTIC_PREFIX[:-1]:
                paths[p] = None
        for u in cands:
            if u != e.get("unit"):
                others[u] = None
    return {"guessed": sorted(paths), "active_with": list(others)}


def _unknown(net, evs: list[dict], fields: dict) -> dict:
    """A row's paths whose net change is not known: ``around`` (changed around the mount
    meanwhile), ``inexact`` (the others not known exactly on one side, Net.inexact)."""
    around = _around(net, evs)
    return {"around": around,
            "inexact": [p for p in fields.get("inexact", ()) if p not in around]}


def _around(net, evs: list[dict]) -> list[str]:
    """The unit's paths changed around the mount while it went on (engines.diff.Net.around);
    none known without a net."""
    around = getattr(net, "around", None)
    return around(evs) if around is not None else []


def session_summary(j: Journal, sid: str, net=None) -> list[str]:
    """The lines ``run`` prints at the end: the files the session left changed (with ``net``,
    see unit_listing; without, every file written), then the same per writer from its begin to
    its end (its calls, the agent itself, other sessions, the user's processes, reverts)."""
    rec = j.record("sessions", sid.encode())
    if rec is None:
        gone = j.dropped_session(sid)
        if gone is not None:  # a budget set at mount drops sessions as they end, this one too
            from .retention import dropped_session_message
            return [f"overlayrec: {dropped_session_message(gone)}, as it ended (the mount's "
                    "--max-bytes budget): nothing of it is left to list"]
        rec = {}
    start = end = None
    for ev in j.events_of(("session_begin", "session_end")):
        if ev.get("session") != sid:
            continue
        if ev["op"] == "session_begin":
            start = ev["seq"]
        else:
            end = ev.get("as_of") or ev["seq"]  # (as of: ended by a later daemon)
            break
    evs = file_events(j, start or 1)
    turns = [t for t in j.records("turns", sid.encode() + b"\0")]
    ncalls = len(j.records("calls", sid.encode() + b"\0"))
    by_writer: dict[str, list] = {}
    actors: dict = {}
    own = []
    for e in evs:
        unit = e.get("unit") or outside_unit(e["actor"])
        u = parse_unit(unit)
        if unit_session(unit) == sid:  # its late writes too (a process it left running)
            own.append(e)
            who = "agent tool calls" if u.kind == "call" else "the agent itself"
        elif end is not None and e["seq"] > end:
            continue  # another writer after the session's end (the next `run`'s session)
        elif u is not None and u.kind == "revert":
            who = "reverts"
        elif unit_session(unit) is None:
            who = "outside: " + writer_name(j, unit, actors)
        else:
            who = "session " + one_line(unit_session(unit))
        by_writer.setdefault(who, []).append(e)

    def count(row):
        return f"{row['files']} file(s)" + \
            (f" + {row['git_changes']} under .git/" if row["git_changes"] else "")
    # the session's own: another session's files, or the user's, are on their own lines (the
    # header counted them as this session's)
    total = unit_listing(net, own)
    lines = [f"overlayrec: session {one_line(sid)}: {len(turns)} turn(s), {ncalls} call(s), "
             f"{count(total).replace('file(s)', 'file(s) changed', 1)}"]
    for who, wevs in sorted(by_writer.items()):
        row = unit_listing(net, wevs)
        if row["files"] or row["git_changes"]:
            # a writer that left nothing changed is no writer of the session's files (a
            # user's `sed -i` that matched nothing was listed "0 file(s)": a bug hunt)
            lines.append(f"  {who}: " + count(row))
    if rec.get("ended") is None:
        lines.append("  (session still open)")
    return lines


# -- sizes: `overlayrec storage` and `status` ------------------------------------------------------

def file_size_limit() -> str | None:
    """This process's file-size limit as an EFBIG's message names it ("the file-size limit
    (`ulimit -f`: 100 KiB)"); None when there is none (the filesystem's own largest file
    refused it)."""
    import resource
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    return f"the file-size limit (`ulimit -f`: {soft // 1024} KiB)"


def human_size(n: int) -> str:
    """Bytes as people read them: 512 B, 4.0 KiB, 12.3 MiB, 2.1 GiB."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    return f"{n:.1f} TiB"


_EIGHTHS = " ▏▎▍▌▋▊▉"


def bar(parts: list[tuple[int, str]], scale: int, width: int) -> str:
    """A proportional bar ``width`` cells wide for ``scale`` bytes: each (bytes, fill) part in
    turn, the last cell of a "█" part in eighths (so a small part still shows)."""
    out = []
    for n, fill in parts:
        cells = width * n / scale if scale else 0
        whole = int(cells)
        out.append(fill * whole)
        frac = cells - whole
        if fill == "█" and frac >= 1 / 8:
            out.append(_EIGHTHS[int(frac * 8)])
        elif fill != "█" and frac >= 0.5:
            out.append(fill)
    return "".join(out)[:width]


CATEGORIES = ("journal", "content", "attic", "exports", "logs", "other")


def storage_lines(doc: dict, width: int, fmt_time) -> list[str]:
    """``overlayrec storage`` on a terminal: a bar per category scaled to the record's total,
    what the free pages and the attic's shared entries are, then one row per session."""
    total = doc["total"]
    state = "mounted" if doc["mounted"] else "not mounted"
    lines = [f"{doc['workspace']}: {human_size(total)} ({state}; state dir {doc['state_dir']})"]
    bar_w = max(10, min(60, width - 24))
    for name in CATEGORIES:
        c = doc[name]
        if c is None:
            lines.append(f"  {name:<8} {'?':>10}  (not reachable: the workspace cannot be read)")
            continue
        n = c["bytes"]
        parts = [(n, "█")]
        if name == "journal":  # the free pages, a gc gives them back, drawn apart
            free = min(c["reclaimable"], n)
            parts = [(n - free, "█"), (free, "░")]
        lines.append(f"  {name:<8} {human_size(n):>10}  {bar(parts, total, bar_w)}".rstrip())
    j, a = doc["journal"], doc["attic"]
    lines.append(f"  journal: {human_size(j['reclaimable'])} of it free pages (░), which a gc "
                 "gives back")
    if a is not None:
        shared = f"; {a['shared_entries']} more shared with the workspace, costing nothing " \
            f"({human_size(a['shared_size'])})" if a["shared_entries"] else ""
        lines.append(f"  attic: {_entries(a['entries'] - a['shared_entries'])} held only there"
                     f"{shared}")
    rows = doc.get("sessions") or []
    if rows:
        kept = sum(r["content"] for r in rows)
        lines.append(f"  content: {human_size(kept)} in blobs the events name, the rest in the "
                     "store's directories and blobs no event names (revert plans)")
        lines.append("")
        lines.append(f"  {'session':<16} {'begun':<23} {'events':>8} {'content':>10} "
                     f"{'attic':>10}")
        for r in rows:
            name = r["session"] if r["session"] is not None else "(outside)"
            flags = " ".join(f for f, on in (("live", r["live"]), ("pinned", r["pinned"])) if on)
            begun = fmt_time(r["begun"]) if r["begun"] else "-"
            lines.append(f"  {name:<16.16} {begun:<23} {r['events']:>8} "
                         f"{human_size(r['content']):>10} {human_size(r['attic']):>10}  "
                         f"{flags}".rstrip())
    return lines


def _entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


STORAGE_COLUMNS = ("workspace", "kind", "name", "bytes", "events", "content", "attic", "begun",
                   "state")


def storage_rows(doc: dict) -> list[tuple]:
    """``overlayrec storage`` piped: one row per category (kind ``category``; the journal's free
    pages, part of the journal's bytes, and ``attic-shared``: the length of the attic's entries
    the workspace still links, which cost nothing and are in no total), then per session (kind
    ``session``, or ``outside`` for the events no session holds); bytes as integers, ``-``
    where a column does not apply, times as ns since the epoch."""
    ws = doc["workspace"]
    out = [(ws, "category", "total", doc["total"], "-", "-", "-", "-", "-")]
    for name in CATEGORIES:
        c = doc[name]
        out.append((ws, "category", name, "-" if c is None else c["bytes"],
                    "-", "-", "-", "-", "-"))
        if name == "journal":
            out.append((ws, "category", "journal-free", c["reclaimable"], "-", "-", "-", "-", "-"))
        if name == "attic" and c is not None:
            out.append((ws, "category", "attic-shared", c["shared_size"], "-", "-", "-", "-",
                        "-"))
    for r in doc.get("sessions") or []:
        state = ",".join(f for f, on in (("live", r["live"]), ("pinned", r["pinned"])) if on)
        out.append((ws, "session" if r["session"] is not None else "outside",
                    r["session"] if r["session"] is not None else "-",
                    r["content"] + r["attic"], r["events"], r["content"], r["attic"],
                    r["begun"] if r["begun"] else "-", state or "-"))
    return out
