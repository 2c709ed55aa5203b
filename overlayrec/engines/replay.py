"""Forensic replay: points in the journal, the tree as it stood at one, and a path's history."""
from __future__ import annotations

import bisect
import datetime as dt
import errno
import os
import stat
import tempfile
from collections.abc import Callable

from ..journal import Journal
from ..journal.schema import AROUND, UNMOUNTED, outside_unit
from ..underlay import O_PATH, RENAME_EXCHANGE, Escape, chmod_fd, kind_of, resolve_beneath
from .diff import SelectionError, _visible, find_call, find_turn, session_named
from ..secrets import PLACEHOLDER, public_in
from ..views import guessed, shown
from .revert_apply import NAME_MAX, make_node, set_meta, temp_name
from .revert_steps import link_key, linked
from .large import copy_fd, write_to
from .states import ATTIC, INF, States, State, Tree, state_of_stat


def _time_of(states: States, point: int) -> int:
    """When event ``point`` was recorded (ns); 0 when it is not there."""
    ev = states.j.event(point) if point > 0 else None
    return ev.get("t", 0) if ev else 0


def point_time(spec: str) -> int | None:
    """The time (ns) a point given as a time names, else None (a seq, a unit's mark, end)."""
    import math
    import re
    if spec.startswith(("before:", "after:")):
        spec = spec.split(":", 1)[1]
    if spec in ("end", "now") or re.fullmatch(r"[0-9]+", spec) or \
            spec.startswith(("turn:", "call:", "session:")):
        return None
    try:
        t = float(spec[1:]) if spec.startswith("@") else \
            dt.datetime.fromisoformat(spec).timestamp()
    except (ValueError, OverflowError, OSError):
        return None
    return int(t * 1e9) if math.isfinite(t * 1e9) else None


def _drifted_by_then(states: States, path: str, point: int, at_ns: int) -> bool:
    """Was ``path`` changed by another writer, after ``point``'s event but at or before
    ``at_ns``, where the record found that change only later (a ``drift``)?  Then what it held
    at ``at_ns`` is not what the replay gives (the state before that change), which was
    written as exact (found by hunts).

    While unmounted: an edit found at the next mount, dated by the ctime the seal after it
    found (a point inside the gap is named by a time).  Around the mount (a process whose
    directory was entered before it): a change found at the daemon's next change of the path
    or at its seal, dated by what that found: the seal's ctime, or the next change's pre-image
    mtime (a point between the change and its finding is any event of another path)."""
    whole = states.chain_on(path)  # seals too: the one after a drift dates it
    chain = [e for e in whole if e["seq"] > point and e["op"] != "seal"]
    if not chain or chain[0]["op"] != "drift":
        return False
    unit = chain[0].get("unit")
    if unit == outside_unit(UNMOUNTED):
        # the change lies in the gap between the seal before the drift (the unmount's) and
        # the drift: a point named before that seal was made is before it (a path removed
        # or renamed while unmounted, whose seal after has no ctime, was said changed at
        # every earlier point: a session's end read inexact; found by a bug hunt)
        before = [e for e in whole if e["op"] == "seal" and e["seq"] < chain[0]["seq"]]
        if before and isinstance(before[-1].get("t"), int) and at_ns <= before[-1]["t"]:
            return False
        seal = next((e for e in whole if e["op"] == "seal" and e["seq"] > chain[0]["seq"]),
                    None)
        changed = ((seal or {}).get("pre") or {}).get("ctime_ns")
    elif unit == outside_unit(AROUND):
        found = states.pre_for(chain[1], path) if len(chain) > 1 else None
        changed = None if found is None else found.get("ctime_ns", found.get("mtime_ns"))
    else:
        return False
    return changed is None or at_ns >= changed


def first_seen_later(states: States, path: str, point: int, at_ns: int,
                     dirs: bool = True) -> bool:
    """Is ``path``'s state at ``point`` what the record first saw of it after ``point``, of a
    file changed after ``at_ns``?  Made or edited while unmounted after then: what it held at
    ``point`` is not known (it was written as exact; found by hunts).  What the record saw is
    the path's first pre-image, dated by its mtime; or, for a path with no event of its own
    before a directory above it was renamed (a file made in a directory made while unmounted,
    which a later session renamed: the directory was said inexact, its files not, and an
    export put them into every earlier base without a word), what its new name held: its next
    pre-image or seal, or the live file the record never saw, dated by their ctime as the
    export dates the files the record never touched (a `cp -p` keeps an old mtime).  A
    directory is judged by its own first pre-image only (``dirs`` false: never): its times
    move with its entries."""
    if not at_ns:
        return False
    evs = states.events_on(path)
    if evs and evs[0]["seq"] <= point:
        return False
    if evs:
        pre = states.pre_for(evs[0], path) or {}
        kind = pre.get("kind", "absent")
        if kind != "absent" and (dirs or kind != "dir") and pre.get("mtime_ns", 0) > at_ns \
                and not (kind == "dir" and _moved_by_entries(states, path, point, evs[0],
                                                             pre.get("mtime_ns", 0))):
            return True
    return _changed_unseen_at_source(states, path, point, at_ns)


# a directory's mtime is set as its entry changes; its event is written just before that
ENTRY_SLACK_NS = 1_000_000_000


def _moved_by_entries(states: States, path: str, point: int, first: dict,
                      mtime_ns: int) -> bool:
    """Is directory ``path``'s mtime at its first event ``first`` (after ``point``) one the
    record's own changes of its entries set, then?  A call's `rm -rf d` removes d's files
    before d: d's pre-image holds the mtime their removal gave it, which is no edit while
    unmounted (a replay before it said d inexact, every `.git/objects/XX` a `git gc`
    emptied: found by a bug hunt)."""
    names = states.all_names()
    prefix = path + "/" if path else ""
    at = bisect.bisect_left(names, prefix)
    latest = None
    while at < len(names) and names[at].startswith(prefix):
        child = names[at]
        at += 1
        if "/" in child[len(prefix):]:
            continue  # not an entry of its own: its change moved another directory's mtime
        for e in states.events_on(child):
            if point < e["seq"] < first["seq"] and (latest is None or e["t"] > latest):
                latest = e["t"]
    return latest is not None and mtime_ns <= latest + ENTRY_SLACK_NS


def _changed_unseen_at_source(states: States, path: str, point: int, at_ns: int) -> bool:
    """Was the file or symlink the record first learnt of after ``point`` under a later name
    of ``path`` (``States.source``, past a directory rename) changed after ``at_ns``?"""
    if not states.renames():  # one name all along: its own first pre-image said it
        return False
    src = states.whole_chains(states.source, path, point)
    if src is None or src[0] == path:
        return False
    name, pre, seq = src
    # a hard link the record made of it since moved its ctime (`mv q qq; ln qq/q1 x` read as
    # q/q1 changed while unmounted: a bug hunt): its mtime says then
    linked = any(e.get("source") == name for e in states.j.events_of(("link",), point + 1))
    if pre is None:  # the live file, never seen
        st = states.tree.lstat(name)
        return st is not None and not stat.S_ISDIR(st.st_mode) and \
            (st.st_mtime_ns if linked else st.st_ctime_ns) > at_ns
    if seq <= point or pre.get("kind", "absent") in ("absent", "dir"):
        return False  # (seen by then: a seal before the point)
    return pre.get("mtime_ns", 0) > at_ns if linked else \
        pre.get("ctime_ns", pre.get("mtime_ns", 0)) > at_ns


def resolve_point(j: Journal, spec: str, refuse_dropped: bool = True) -> int:
    """A point as a sequence number: SEQ, a time (ISO 8601 or @epoch-seconds), turn:N
    (turn:SESSION:N, turn:SESSION:last ...), call:ID (call:SESSION:ID: a turn or an id several
    sessions could mean is refused otherwise, as every command refuses it),
    session:S (its start and end; ``last``: the session begun last), and before:/after: any of
    those (after: is the default); ``end`` (or ``now``): the
    record's last event.  Anything else, or a number
    no sequence number can reach (2**63 or more), is a SelectionError (one past the last event
    is the tree as the record ends: ``replay`` says so); so is a point before the record's start
    (dropped by retention), unless ``refuse_dropped`` is False (the listings start there)."""
    from ..retention import dropped_point
    point = _resolve_point(j, spec)
    why = dropped_point(j, point) if refuse_dropped else None
    if why:
        if not spec.isdigit():  # a time, a turn ...: named as given, not by the seq it meant
            why = f"{spec} lies before the record's start, dropped by retention " \
                  f"(the record starts at seq {j.cut})"
        raise SelectionError(why)
    return point


def _resolve_point(j: Journal, spec: str) -> int:
    import math
    import re
    from ..retention import dropped_selection
    from ..views import shown as c_quoted
    usage = "SEQ, a time (ISO 8601 or @epoch), turn:N, call:ID, session:S, before:/after: " \
        "any of those, end"
    cut = spec if len(spec) <= 60 else spec[:57] + "..."
    # quoted; C-quoted where it holds bytes that are not UTF-8 (they showed as '\udcff')
    shown = repr(cut) if cut.isprintable() else c_quoted(cut)
    side = "after"
    if spec.startswith(("before:", "after:")):
        side, spec = spec.split(":", 1)
    if spec in ("end", "now"):  # the record's end is a point, with nothing after it to be before
        return j.last_seq()
    if re.fullmatch(r"[0-9]+", spec):  # ASCII digits only: str.isdigit takes '²' too
        n = int(spec) if len(spec) <= 19 else 2**63  # (int() refuses 4300 digits)
        if n >= 2**63:
            raise SelectionError(f"no event {shown}: past any sequence number")
        return max(n - 1, 0) if side == "before" else n
    if spec.startswith("turn:"):
        sid, _, sel = spec[5:].rpartition(":")  # turn:SESSION:N, where sessions hold turns N
        if not re.fullmatch(r"last|-?[0-9]{1,19}", sel):
            raise SelectionError(f"not a turn: {shown} (turn:N, turn:last, turn:-1, "
                                 "turn:SESSION:N ...)")
        try:
            t = find_turn(j, sel, session_named(j, sid) if sid else None,
                          several=f"name one as turn:SESSION:{sel}")
        except SelectionError as e:  # a dropped session's turn is said to be so
            raise SelectionError(dropped_selection(j, turn=sel, session=sid or None)
                                 or str(e)) from None
        return max(t["begin_seq"] - 1, 0) if side == "before" else (t["end_seq"] or j.last_seq())
    if spec in ("call:", "session:"):  # an empty id (a shell variable left unset)
        raise SelectionError(f"not a point: {shown}: an empty id ({usage})")
    if spec.startswith("call:"):
        cid, sid = spec[5:], None
        calls = j.records("calls")
        if not any(c["id"] == cid for c in calls) and ":" in cid:
            # call:SESSION:ID, where an id repeats; a session's id (or a call's) may hold ':'
            # too: the split that names a recorded call, else the first
            splits = [(cid[:i], cid[i + 1:]) for i, ch in enumerate(cid) if ch == ":"]
            sid, cid = next(((s, i) for s, i in splits
                             if any(c["id"] == i and c["session"] == s for c in calls)),
                            splits[0])
        if not cid:  # `call::`: it said "no call " of an empty id
            raise SelectionError(f"not a point: {shown}: an empty id ({usage})")
        try:
            c = find_call(j, cid, sid, several=f"name one as call:SESSION:{cid}")
        except SelectionError as e:
            raise SelectionError(dropped_selection(j, call=cid, session=sid) or str(e)) from None
        return (c["begin_seq"] or 1) - 1 if side == "before" else (c["end_seq"] or j.last_seq())
    if spec.startswith("session:"):
        sid = session_named(j, spec[8:])
        rec = j.record("sessions", sid.encode("utf-8", "surrogateescape"))
        if rec is None:
            raise SelectionError(dropped_selection(j, session=sid) or f"no session {sid}")
        # a session has no begin and end marks in the journal, as a turn or a call has: its
        # start and end times (every event is stamped by the daemon's clock, on this host)
        if side == "before":
            return _last_before(j, int(rec.get("started") or 0), strictly=True)
        ended = rec.get("ended")
        return _last_before(j, int(ended)) if ended else j.last_seq()
    try:
        t = float(spec[1:]) if spec.startswith("@") else \
            dt.datetime.fromisoformat(spec).timestamp()
    except (ValueError, OverflowError, OSError):  # year 1 in local time overflows, say
        raise SelectionError(f"not a point: {shown} ({usage})") from None
    if not math.isfinite(t):
        raise SelectionError(f"not a time: {shown} ({usage})")
    t_ns = t * 1e9
    if not math.isfinite(t_ns):  # a time beyond any event, or before them all
        return j.last_seq() if t_ns > 0 else 0
    return _last_before(j, int(t_ns))


def _last_before(j: Journal, t_ns: int, strictly: bool = False) -> int:
    """The last event made at or before ``t_ns`` (``strictly``: before it); 0 when none was.
    Below a gc's cut (``j.events`` starts there) it is the cut's last dropped seq when every
    session the gc dropped had ended by then: the state the record starts with, which
    ``before:session:S`` of the first session kept names (it was "seq 0 was dropped")."""
    last = 0
    if j.cut > 1:
        ends = [r.get("ended") for r in j.dropped_sessions()]
        if ends and all(isinstance(t, int) and (t < t_ns if strictly else t <= t_ns)
                        for t in ends):
            last = j.cut - 1
    for e in j.events():
        if e["t"] > t_ns or (strictly and e["t"] == t_ns):
            break
        last = e["seq"]
    return last


class _Build:
    """A replay being built below ``root_fd`` (a fresh temporary directory): every path is
    reached by ``resolve_beneath``, without following a symlink, so nothing is ever written
    outside it (a symlink the history or the live tree holds is made as a symlink, and a path
    that cannot be reached is a ``not_made`` line of the result); directory modes and owners
    are set last, deepest first."""

    def __init__(self, root_fd: int, secrets=None):
        self.root_fd = root_fd
        self.secrets = secrets  # secret paths: never copied from the live tree
        self.dirs: dict[str, tuple[State, tuple | None]] = {}  # rel -> (its state, times)
        # inode at the point -> the paths written holding it: (path, state), one per content
        # (a name answered inexactly may hold another content than the group's other names)
        self.groups: dict[int, list[tuple[str, State]]] = {}
        self.group_of: dict[str, int] = {}  # a holder's path -> its group's key (forget)
        self.live: dict[int, str] = {}         # live inode (nlink > 1) -> its copy's path
        self.copied: dict[str, int] = {}       # a live copy (nlink > 1) -> the live inode
        self.not_made: dict[str, dict] = {}
        self.owners: list[str] = []
        self.inexact: list[str] = []
        self.unlisted: dict[str, str] = {}  # live directories (--full) not listed: why
        self.default_mode = 0o777 & ~_umask()  # a directory the record does not describe
        # ... whose live directory's mode it takes where there is one: with the umask's, a
        # 0700 directory of the workspace came back 0755, its files readable by everyone
        # (found by a bug hunt)
        self.live_mode: Callable[[str], int | None] = lambda rel: None

    def dir_mode(self, rel: str) -> int:
        """The mode of a directory made for ``rel`` that the record does not describe."""
        mode = self.live_mode(rel)
        return self.default_mode if mode is None else mode

    # -- reaching paths
    def parent(self, rel: str, make: bool) -> tuple[int, str]:
        """An O_PATH fd of ``rel``'s directory and its name there, reached by
        ``resolve_beneath`` (no symlink followed); with ``make``, a missing directory on the
        way is made and anything else in its place (a symlink, a file the live tree holds there
        now) is replaced by one: the record says the path's parent was a directory at the
        point.  Raises ``Escape`` (without ``make``: a symlink or a file on the way; always: a
        name that would leave the replay) or FileNotFoundError."""
        *parts, name = rel.split("/")
        if name in ("", ".", "..") or rel.startswith("/") or \
                any(part in ("", ".", "..") for part in parts):
            raise Escape(errno.EXDEV, "path leaves the replay", rel)
        want = O_PATH | os.O_DIRECTORY
        try:
            return resolve_beneath(self.root_fd, "/".join(parts), want), name
        except (FileNotFoundError, Escape):
            if not make:
                raise
        fd = resolve_beneath(self.root_fd, "", want)
        try:
            done = []
            for part in parts:
                done.append(part)
                try:
                    st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    st = None
                if st is not None and not stat.S_ISDIR(st.st_mode):
                    _discard(fd, part)  # the symlink itself, never what it names
                    self.forget("/".join(done))
                    self.inexact.append("/".join(done))
                    st = None
                if st is None:
                    os.mkdir(part, 0o700, dir_fd=fd)
                    self.dirs.setdefault("/".join(done), (State("dir", self.dir_mode(
                        "/".join(done))), None))
                nfd = resolve_beneath(fd, part, want)
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd, name

    def forget(self, rel: str) -> None:
        """``rel`` and everything below it are gone (or are about to be replaced).  A path
        that is no directory made here has nothing below it (each directory made, its
        parents too, is in ``dirs``): its own entries only, looked up, not searched for (a
        `--full` replay forgot each path it wrote by a pass over every copy made, and took
        13 minutes after one `mv` of 20,000 files: found by a bug hunt)."""
        if rel not in self.dirs:
            ino = self.copied.pop(rel, None)
            if ino is not None and self.live.get(ino) == rel:
                del self.live[ino]
            key = self.group_of.pop(rel, None)
            if key is not None:
                self._drop_holders(key, lambda h: h == rel)
            self.not_made.pop(rel, None)
            return
        under = rel + "/"
        for d in [d for d in self.dirs if d == rel or d.startswith(under)]:
            del self.dirs[d]
        for k in [k for k, v in self.live.items() if v == rel or v.startswith(under)]:
            del self.live[k]
        for p in [p for p in self.group_of if p == rel or p.startswith(under)]:
            self._drop_holders(self.group_of.pop(p), lambda h, p=p: h == p)
        for p in [p for p in self.copied if p == rel or p.startswith(under)]:
            del self.copied[p]
        self.not_made.pop(rel, None)

    def _drop_holders(self, key: int, gone) -> None:
        holders = self.groups.get(key)
        if holders is None:
            return
        holders[:] = [h for h in holders if not gone(h[0])]
        if not holders:
            del self.groups[key]

    def _add_holder(self, key: int, rel: str, s: State) -> None:
        self.groups.setdefault(key, []).append((rel, s))
        self.group_of[rel] = key

    def meta(self, dfd: int, name: str, rel: str, s: State, mode: int | None = None) -> None:
        problem = set_meta(dfd, name, s, mode)
        if problem:
            self.owners.append(rel)

    # -- the live tree (--full)
    def copy_live(self, src_fd: int, dst_fd: int, base: str) -> None:
        """Copy the directory open as ``src_fd`` into ``dst_fd``: every kind of file, symlinks
        as symlinks, hard links as hard links; not the attic.  Depth first with a stack of its
        own (a tree of any depth; the fds it opens are its own and closed as it goes)."""
        stack = [(os.dup(src_fd), os.dup(dst_fd), base)]
        while stack:
            sfd, dfd, rel = stack.pop()
            try:
                stack.extend(self._copy_dir(sfd, dfd, rel))
            finally:
                os.close(sfd)
                os.close(dfd)

    def _copy_dir(self, src_fd: int, dst_fd: int, base: str) -> list[tuple[int, int, str]]:
        """Copy one directory's entries; its subdirectories are made and returned (open) for
        the caller to descend into."""
        below = []
        for name in sorted(os.listdir(src_fd)):
            if not base and name == ATTIC:
                continue
            rel = f"{base}/{name}" if base else name
            try:
                st = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # gone meanwhile
            except OSError as e:  # a directory listed but not searchable (mode 600, a user's)
                self.not_made[rel] = {"path": rel, "kind": "unknown",
                                      "why": os.strerror(e.errno) if e.errno else str(e)}
                continue
            kind = kind_of(st.st_mode)
            public = None  # a content-checked file's content, as looked at (overlayrec.secrets)
            if kind != "dir" and self.secrets is not None and \
                    (self.secrets.match(rel) or kind == "file" and self.secrets.checked(rel) and
                     (public := public_in(src_fd, name)) is None):
                self.withheld(rel, kind)
                continue
            s = state_of_stat(st, lambda: b"").but(nlink=st.st_nlink)
            try:
                if kind == "dir":
                    os.mkdir(name, 0o700, dir_fd=dst_fd)
                    self.dirs[rel] = (s, (st.st_atime_ns, st.st_mtime_ns))
                    try:
                        sfd = resolve_beneath(src_fd, name, os.O_RDONLY | os.O_DIRECTORY)
                    except PermissionError as e:
                        # made, but what lies beneath cannot be listed: only the record's
                        # paths there are given (it said nothing of the others; a hunt)
                        self.unlisted[rel] = os.strerror(e.errno)
                        self.inexact.append(rel)
                        continue
                    try:
                        dfd = resolve_beneath(dst_fd, name, O_PATH | os.O_DIRECTORY)
                    except BaseException:
                        os.close(sfd)
                        raise
                    below.append((sfd, dfd, rel))
                    continue
                if st.st_nlink > 1 and st.st_ino in self.live and \
                        self.link(self.live[st.st_ino], dst_fd, name):
                    self.copied[rel] = st.st_ino
                    continue
                if kind == "symlink":
                    os.symlink(os.readlink(name, dir_fd=src_fd), name, dir_fd=dst_fd)
                elif kind == "file":
                    _copy_file(src_fd, dst_fd, name, public)
                else:
                    make_node(dst_fd, name, s)
                self.meta(dst_fd, name, rel, s)
                os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dst_fd,
                         follow_symlinks=False)
                if st.st_nlink > 1:
                    self.live[st.st_ino] = rel
                    self.copied[rel] = st.st_ino
            except OSError as e:
                self.not_made[rel] = {"path": rel, "kind": kind, "why": os.strerror(e.errno)
                                      if e.errno else str(e)}
        return below

    def withheld(self, rel: str, kind: str) -> None:
        """A secret path: nothing is written there, and the result says why."""
        self.not_made[rel] = {"path": rel, "kind": kind, "why": PLACEHOLDER}
        self.inexact.append(rel)

    def link(self, first: str, dfd: int, name: str) -> bool:
        try:
            sfd, sname = self.parent(first, make=False)
        except OSError:
            return False
        try:
            os.link(sname, name, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
            return True
        except OSError:
            return False
        finally:
            os.close(sfd)

    # -- the recorded paths
    def _unsay(self, rel: str, beneath: bool) -> None:
        """Take back what was said of ``rel`` (and, with ``beneath``, of the paths beneath
        it): the live tree's copy (``--full``) could not make it or set its owner, and the
        point holds something else there, or nothing (`replay --full` before `mv dir dir2`
        named dir2's files, which the point does not hold, and the live copy's failure to set
        an owner twice: found by a bug hunt)."""
        if not (self.not_made or self.owners):
            return
        self.not_made.pop(rel, None)
        inside = rel + "/"
        if beneath and self.not_made:
            for p in [p for p in self.not_made if p.startswith(inside)]:
                del self.not_made[p]
        if self.owners:
            self.owners = [p for p in self.owners
                           if p != rel and not (beneath and p.startswith(inside))]

    def remove(self, rel: str) -> bool:
        self._unsay(rel, beneath=True)
        try:
            dfd, name = self.parent(rel, make=False)
        except (FileNotFoundError, Escape):
            return False  # beneath a symlink (or a file) at the point: nothing there to remove
        try:
            self.forget(rel)
            return _discard(dfd, name)
        finally:
            os.close(dfd)

    def write(self, rel: str, s: State) -> None:
        """Make ``rel`` hold ``s``: its kind, content or target, owner and mode (a directory's
        last), and its hard-link group.  An OSError that names no file names ``rel``."""
        try:
            self._write(rel, s)
        except OSError as e:
            if e.filename is None:
                e.filename = rel  # a write to its fd (EFBIG under `ulimit -f`) named nothing
            raise

    def _write(self, rel: str, s: State) -> None:
        self._unsay(rel, beneath=False)
        try:
            dfd, name = self.parent(rel, make=True)
        except Escape as e:  # never written through: said in the result
            self.not_made[rel] = {"path": rel, "kind": s.kind, "why": f"escape: {e.strerror}"}
            return
        try:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if s.kind == "dir":
                if st is not None and not stat.S_ISDIR(st.st_mode):
                    _discard(dfd, name)
                    self.forget(rel)
                    st = None
                if st is None:
                    os.mkdir(name, 0o700, dir_fd=dfd)
                self.dirs[rel] = (s, None)
                self.not_made.pop(rel, None)
                return
            if st is not None and s.kind == "file" and link_key(s) and st.st_nlink > 1 and \
                    stat.S_ISREG(st.st_mode) and self.copied.get(rel) == s.ino and \
                    link_key(s) not in self.groups:
                # the copy of the very inode the path held at the point, linked here as it is
                # live to paths the record did not touch (a hard-link group changed through
                # this name): its content goes back into it, for every name of the group (the
                # group's first path written; the others are linked to it below)
                flags = os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
                try:
                    fd = os.open(name, flags, dir_fd=dfd)
                except PermissionError:  # a read-only copy (it is ours): its mode comes after
                    pfd = resolve_beneath(dfd, name)  # the file itself, never followed
                    try:
                        if stat.S_ISREG(os.fstat(pfd).st_mode):
                            chmod_fd(pfd, 0o600)
                    finally:
                        os.close(pfd)
                    fd = os.open(name, flags, dir_fd=dfd)
                try:
                    write_to(fd, s.data)
                finally:
                    os.close(fd)
                self.meta(dfd, name, rel, s)
                self.not_made.pop(rel, None)
                self._hold(rel, s)
                return
            if st is not None:
                self.forget(rel)
                _discard(dfd, name)  # never written through: a live copy may share its inode
            self.not_made.pop(rel, None)
            if link_key(s) and self._join(s, rel, dfd, name):
                return
            if s.kind == "symlink":
                os.symlink(os.fsdecode(s.data), name, dir_fd=dfd)
            elif s.kind == "file":
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                             os.O_CLOEXEC, 0o600, dir_fd=dfd)
                try:
                    write_to(fd, s.data)
                finally:
                    os.close(fd)
            else:
                try:
                    make_node(dfd, name, s)
                except (OSError, ValueError) as e:
                    why = os.strerror(e.errno) if getattr(e, "errno", None) else str(e)
                    self.not_made[rel] = {"path": rel, "kind": s.kind, "why": why}
                    return
            self.meta(dfd, name, rel, s)
            if link_key(s):
                self._hold(rel, s)
        finally:
            os.close(dfd)

    def _hold(self, rel: str, s: State) -> None:
        """``rel``, just written holding ``s``, is where the other names of its inode that hold
        the same content are linked to (unless one already is)."""
        if not any(linked(s, h[1]) for h in self.groups.get(link_key(s), ())):
            self._add_holder(link_key(s), rel, s)

    def _join(self, s: State, rel: str, dfd: int, name: str) -> bool:
        """Link ``name`` to its hard-link group if a path of it is already here: one written
        from the record, or a live copy untouched by the record that holds the same inode (and
        so held it at the point too)."""
        holders = self.groups.get(link_key(s))
        made = None
        if holders:
            made = next((h for h in holders if linked(s, h[1])), None)
            if made is None:  # each holds another content (one of them was answered inexactly)
                return False
            first = made[0]
        else:
            # only a path linked at the point: a live copy may share the inode with it only
            # because the attic holds a second name of it today
            first = self.live.get(link_key(s)) if s.nlink > 1 else None
            if first is None or _content_at(self.root_fd, first) != (s.kind, s.data):
                return False
        if not self.link(first, dfd, name):
            return False
        if made is None:  # the live copy has today's mode and owner; the point's are in s
            self.meta(dfd, name, rel, s)
        # written from the record: the group's holder from now on
        if made is not None:
            self.groups[link_key(s)].remove(made)
            self.group_of.pop(made[0], None)
        self._add_holder(link_key(s), rel, s if made is None else made[1].but(
            nlink=max(s.nlink, made[1].nlink)))
        return True

    def finish(self, root_state: State | None) -> None:
        """Directory owners and modes, deepest first (a 0555 directory was filled as 0700)."""
        for rel in sorted(self.dirs, key=lambda d: -d.count("/")):
            s, times = self.dirs[rel]
            dfd, name = self.parent(rel, make=False)
            try:
                self.meta(dfd, name, rel, s)
                if times:
                    os.utime(name, ns=times, dir_fd=dfd, follow_symlinks=False)
            finally:
                os.close(dfd)
        root = root_state or State("dir", self.dir_mode(""))
        self.meta(self.root_fd, ".", "", root)


def _umask() -> int:
    old = os.umask(0o22)
    os.umask(old)
    return old


def _discard(dfd: int, name: str) -> bool:
    """Remove ``name`` from ``dfd``, a directory with all it holds (made writable on the way:
    it is the replay's own); never follows a symlink.  False when there was nothing."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dfd)
        return True
    pfd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        os.chmod(f"/proc/self/fd/{pfd}", 0o700)
        fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for n in os.listdir(fd):
                _discard(fd, n)
        finally:
            os.close(fd)
    finally:
        os.close(pfd)
    os.rmdir(name, dir_fd=dfd)
    return True


def _copy_file(src_dfd: int, dst_dfd: int, name: str, data: bytes | None = None) -> None:
    """Copy ``name``; with ``data``, write that instead (what was read once already)."""
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_dfd)
    try:
        dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600, dir_fd=dst_dfd)
        try:
            # a file copied as it is: in chunks, its holes kept (a sparse image stays sparse)
            if data is None:
                copy_fd(src, dst)
            else:
                write_to(dst, data)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _content_at(root_fd: int, rel: str) -> tuple[str, bytes] | None:
    try:
        st = Tree(root_fd).state(rel)
    except OSError:
        return None
    return st.kind, st.data


def replay(j: Journal, states: States, point: int, dest: str, full_from: str | None = None,
           at_time: int | None = None) -> dict:
    """Write the recorded paths as they stood at ``point`` into ``dest`` (with ``full_from``:
    first the whole live tree, then the recorded paths rolled back).

    Built in a temporary directory beside ``dest`` and renamed into place when complete: a
    replay that fails leaves nothing.  ``dest`` must not exist or be an empty directory."""
    dest = os.path.abspath(dest)
    parent, base = os.path.split(dest.rstrip("/") or "/")
    if len(os.fsencode(base)) > NAME_MAX:  # (the error named the temporary directory)
        raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), dest)
    made_parents = []
    p = parent
    while not os.path.lexists(p):
        made_parents.append(p)
        p = os.path.dirname(p)
    for d in reversed(made_parents):  # one at a time (os.makedirs recurses per level)
        os.mkdir(d)
    pfd = os.open(parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    tmp = root_fd = None
    try:
        _discard_stale_builds(pfd, base)
        # inside the try: a SIGTERM just after the temporary directory was made left it
        tmp = tempfile.mkdtemp(prefix=temp_name(base, _build_tag(os.getpid()))[:-8],
                               dir=parent)
        root_fd = os.open(tmp, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        b = _Build(root_fd, states.secrets)

        def live_mode(rel: str) -> int | None:
            try:
                st = states.tree.state(rel)
            except OSError:
                return None
            return st.mode if st.kind == "dir" else None
        b.live_mode = live_mode
        root_state = None
        if full_from is not None:
            src = os.open(full_from, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                root_state = state_of_stat(os.fstat(src), lambda: b"")
                b.copy_live(src, root_fd, "")
            finally:
                os.close(src)
        written = removed = 0
        at_ns = at_time or _time_of(states, point)  # ``at_time``: the point named as a time
        for rel in [p for p in states.all_names() if _visible(p)]:
            s = states.state(rel, point)
            if rel == "":  # the workspace root (a `chmod 700 .`): the replay's own mode, last
                if s.kind == "dir":
                    root_state = s
                continue
            if s.withheld:  # a secret path: its content was never kept, nothing is written
                b.withheld(rel, s.kind)
                continue
            if not s.exact or (s.present and first_seen_later(states, rel, point, at_ns)) or \
                    (at_ns and _drifted_by_then(states, rel, point, at_ns)):
                b.inexact.append(rel)
            if not s.present:
                removed += b.remove(rel)
                continue
            b.write(rel, s)
            written += 1
        b.finish(root_state)
        try:
            os.rename(os.path.basename(tmp), base, src_dir_fd=pfd, dst_dir_fd=pfd)
        except OSError as e:
            # said of --to (it named the temporary directory, removed by then: an empty
            # directory that is a mount point, EBUSY; found by a bug hunt)
            raise OSError(e.errno, e.strerror, dest) from None
    except BaseException:
        try:
            if tmp is not None:
                _discard(pfd, os.path.basename(tmp))
            for d in made_parents:
                os.rmdir(d)
        except OSError:
            pass
        raise
    finally:
        if root_fd is not None:
            os.close(root_fd)
        os.close(pfd)
    return {"point": point, "written": written, "removed": removed,
            "inexact": sorted(set(b.inexact)), "not_made": list(b.not_made.values()),
            "unlisted": [{"path": p, "why": w} for p, w in sorted(b.unlisted.items())],
            "owners_not_set": b.owners}


def _build_tag(pid: int) -> str:
    """The tag of the directory a replay builds beside its destination: its process, so that
    one a replay killed half way left is known for no live replay's (``XXXXXXXX``: the room
    mkdtemp's random part takes)."""
    from ..attribution import live_stat
    st = live_stat(pid)
    return _TAG_OF.format(pid, st[0] if st else 0)


def _discard_stale_builds(pfd: int, base: str) -> None:
    """Remove the directories replays to ``base`` that were killed half way left beside it
    (a SIGKILL leaves no chance to): one more for good at every kill, said by nothing (found
    by a bug hunt).  Only those of a process that is gone, and only those tagged so."""
    from ..attribution import alive
    try:
        entries = os.listdir(f"/proc/self/fd/{pfd}")  # (an O_PATH fd lists nothing itself)
    except OSError:
        return
    for entry in entries:
        if ".overlayrec-replay-" not in entry:
            continue
        key = entry.rpartition(".overlayrec-replay-")[2][:-9]  # "pid.start"
        pid, _, start = key.partition(".")
        if not (pid.isdigit() and start.isdigit()) or \
                temp_name(base, _TAG_OF.format(pid, start))[:-8] != entry[:-8] or \
                alive(f"{pid}:{start}"):
            continue
        try:
            _discard(pfd, entry)
        except OSError:
            pass


_TAG_OF = "overlayrec-replay-{}.{}-XXXXXXXX"


def _ways(r: dict) -> tuple[tuple[str, str], ...]:
    """The ways directory rename ``r`` moved things, (from, to): both for an exchange
    (``renameat2(RENAME_EXCHANGE)``: each directory's content went to the other name)."""
    if r.get("flags", 0) & RENAME_EXCHANGE:
        return (r["src"], r["dst"]), (r["dst"], r["src"])
    return ((r["src"], r["dst"]),)


def _path_steps(j: Journal, states: States, path: str, at: float) -> tuple[dict, list]:
    """The steps of ``path``'s history up to ``at``, keyed by (seq, name then), and the
    windows (name, lo, hi) of its names: the events on ``name`` in ``lo < seq <= hi`` are
    the path's (its own name's from its start, an earlier one's since the rename that brought
    it there)."""
    # (seq, name then) -> (event, name then, how[, the name before, for a move with a
    # directory]): a rename from one name the path had to another (a file that came back) is
    # a step of each
    steps: dict[tuple[int, str], tuple] = {}
    seen: set[tuple[str, float]] = set()
    windows: list[tuple[str, float, float]] = []

    def gather(name: str, hi: float, moved_here: bool = False) -> None:
        """The steps of ``name`` up to ``hi``.  ``moved_here``: a name the path had before a
        directory's rename brought it on; then only since the rename that brought it to this
        name in turn (if one did): before that, the name was another directory's child, and
        what happened to it there is another file's history (it was the path's if it was
        neither: the path's own name, from its start, or since the last exchange of a
        directory that brought its file to it)."""
        if (name, hi) in seen or len(seen) > 64:
            return
        seen.add((name, hi))
        renames = []
        for r in states.renames():
            if r["seq"] > hi:
                break
            renames.append(r)
        lo = float("-inf")
        for r in reversed(renames):
            # the path's own name keeps its whole history, but for an exchange that brought
            # the file here: what the name held before went to the other side
            if not moved_here and not r.get("flags", 0) & RENAME_EXCHANGE:
                continue
            if any(name.startswith(dst + "/") and
                   states.state(src + name[len(dst):], r["seq"] - 1).present
                   for src, dst in _ways(r)):
                lo = r["seq"]
                break
        windows.append((name, lo, hi))
        for e in states.events_on(name):
            if lo < e["seq"] <= hi and (e["seq"], name) not in steps:
                other = e.get("path2") if e["path"] == name else e["path"]
                if e.get("path2") is None:
                    op = e["op"]
                elif e.get("flags", 0) & RENAME_EXCHANGE:  # both names stay, swapped
                    op = f"exchange with {shown(other)}"
                else:
                    op = f"{e['op']} {'to' if e['path'] == name else 'from'} {shown(other)}"
                steps[e["seq"], name] = (e, name, op)
        for r in renames:
            if r["seq"] < lo:
                continue
            for src, dst in _ways(r):
                moved(r, src, dst, name)

    def moved(r: dict, src: str, dst: str, name: str) -> None:
        """The step of ``name`` in one way of directory rename ``r`` (``src`` to ``dst``)."""
        # a rename of a directory carries only what was beneath it then: a name made
        # there later (or never) was not moved, and its earlier holder is another file
        # (one move is one step: "moved with" under the name it went to, which the path
        # is followed to, not also "moved away" under the name it left)
        if name.startswith(src + "/"):
            if states.state(name, r["seq"] - 1).present and \
                    (r["seq"], dst + name[len(src):]) not in steps:
                steps.setdefault((r["seq"], name), (j.event(r["seq"]), name,
                                                    f"moved away with {shown(src + '/')} -> {shown(dst + '/')}"))
        elif name.startswith(dst + "/"):
            old = src + name[len(dst):]
            if states.state(old, r["seq"] - 1).present:
                steps[r["seq"], name] = (j.event(r["seq"]), name,
                                         f"moved with {shown(src + '/')} -> "
                                         f"{shown(dst + '/')}", old)
                if steps.get((r["seq"], old), (None, None, ""))[2].startswith("moved away"):
                    del steps[r["seq"], old]
                gather(old, r["seq"] - 1, moved_here=True)

    gather(path, at)
    return steps, windows


def path_names(j: Journal, states: States, path: str) -> tuple[list, set[int]]:
    """What ``log --path`` follows of ``path``: the windows (name, lo, hi) of the names it had,
    as blame follows them, and the seqs of the directory renames that moved it."""
    steps, windows = _path_steps(j, states, path, INF)
    return windows, {k[0] for k, v in steps.items() if v[2].startswith("moved ")}


def blame(j: Journal, states: States, path: str, at: int | None = None) -> list[dict]:
    """A path's history, newest first: one entry per run of changes by one unit.  The path is
    followed back through the renames of its directories (an entry for each such rename, and
    the runs under its earlier names), and a live path that departs from its seal says so."""
    steps = _path_steps(j, states, path, at if at is not None else INF)[0]
    steps = [steps[k] for k in sorted(steps)]
    runs: list[dict] = []
    for e, name, how, *came_from in steps:
        op = how
        unit = e.get("unit") or outside_unit(e["actor"])
        late = bool(e.get("after_end"))  # by a process its call left running, after its end
        # a run is all the call's own or all late: a create of the call's and a background
        # job's append after its end read as one run "after the call ended" (a bug hunt)
        if runs and runs[-1]["unit"] == unit and runs[-1]["name"] == name and \
                runs[-1].get("late", False) == late:
            r = runs[-1]
        else:
            r = {"unit": unit, "name": name, "first_seq": e["seq"], "ops": [], "actors": [],
                 "t_first": e["t"], "first_name": name}
            if came_from:  # moved with a directory: its name just before
                r["first_name"] = came_from[0]
            runs.append(r)
        r["last_seq"], r["t_last"] = e["seq"], e["t"]
        if op not in r["ops"]:
            r["ops"].append(op)
        if guessed([e])["guessed"]:  # placed in its call without the process tree's word
            r["guessed"] = True
            # by time (written while the call ran, by a process no call started), or by a
            # guess among calls active together
            r["by_time" if e.get("chosen") == "during" else "by_guess"] = True
        if late:
            r["late"] = True
        if e["actor"] not in r["actors"]:
            r["actors"].append(e["actor"])
    for r in runs:
        before = states.state(r.pop("first_name"), r["first_seq"] - 1)
        # what the run left: once a write run still writing at its last event was done
        after = states.state(r["name"], states.settle(r["name"], r["last_seq"]))
        # a name that holds nothing is known exactly, whatever a write run still open on its
        # last inode leaves unknown ("absent ~0B" after a mapping's page came past the unlink,
        # found by a bug hunt)
        r["before"] = {"kind": before.kind, "size": len(before.data),
                       "exact": before.exact or not before.present}
        r["after"] = {"kind": after.kind, "size": len(after.data),
                      "exact": after.exact or not after.present}
        for side, s in (("before", before), ("after", after)):
            if s.withheld:  # the size is the placeholder's: the content was never kept
                r[side]["withheld"] = True
        r["processes"] = [dict(key=k, **{f: (j.actor(k) or {}).get(f) for f in
                                          ("pid", "argv", "cwd", "uid")}) for k in r["actors"]]
        del r["actors"]
        if r["name"] == path:
            del r["name"]
    if at is None and runs and states.drifted(path):
        live = states.tree.state(path)
        runs.append({"unit": "drift", "first_seq": j.last_seq(), "last_seq": j.last_seq(),
                     "t_first": runs[-1]["t_last"], "t_last": runs[-1]["t_last"],
                     "ops": ["drifted: the live path departs from the record's end "
                             "(changed while unmounted or around the mount)"],
                     "before": runs[-1]["after"],
                     "after": {"kind": live.kind, "size": len(live.data)}, "processes": []})
    return list(reversed(runs))
