"""The journal as real git commits.

Per session, a chain of commits from its base (the workspace when the session began): for each
call, in the order calls ended, one commit whose tree is the recorded paths as they stood at
the call's end and whose parent is the chain's previous commit; when something changed between
two calls (the agent's own edits, another process), an interim commit for it comes first; at
each turn's end a commit (possibly empty) marks the turn; once the session ended, a commit of
what its units changed after its last call (a session without calls or turns: all of it).  So
a call's commit, diffed against its parent, is what happened during that call.

A commit's tree holds every path recorded up to the export (files and symlinks; directories are
implied; fifos and devices cannot be stored in git), each as it stood at the commit's point:
`git diff A B` between two commits of one export shows exactly what `overlayrec diff` shows
between the same two points.  Export is incremental: what a run exported is remembered in the
state dir and a later run only adds commits for calls and turns that ended since; paths first
recorded after an earlier run appear in the new commits only (docs/export.md).

Beside the chain, a ``sides`` commit per session holds the two sides of each exported call's,
turn's and the session's own diff exactly as ``overlayrec diff`` makes them (trees of only the
selection's paths), so a copy of the refs elsewhere answers ``diff`` without the journal
(engines/travel.py).

Everything is written through one ``git fast-import`` stream per run (no process per object or
commit).  Messages carry the facts as trailers; refs live under ``refs/overlayrec/<session>/``.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import time
from stat import S_ISLNK, S_ISREG

from ..journal import Journal
from ..state import read_regular
from ..journal.schema import call_key, call_unit, parse_unit, revert_unit
from ..views import guessed, one_line, shown, unit_session
from .diff import file_events, touched, side_of, _visible
from .replay import first_seen_later
from .gitdiff import FastImport, GitError, ObjectStore, _git_may_refuse, git_refuses, quote_path
from .states import States, State

_REF_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def _unexported_end(st: dict, t: dict) -> bool:
    """Is turn record ``t``'s end not yet in the session's chain (export state ``st``)?  A
    turn exported at a stop the agent's stop hook blocked ends again later (calls.take_up): its
    turn commit is made again at that end, and its ref moves there.  A state kept before the
    ends were (no ``turn_ends``) counts its turns as exported at their ends."""
    key = str(t["index"])
    if key not in st["turns"]:
        return True
    return st.get("turn_ends", {}).get(key, t["end_seq"]) != t["end_seq"]


def ref_part(name: str) -> str:
    """A session's name or a call's id as one component of a git ref name: as it is when git
    takes it (letters, digits, ``_``, ``-`` and dots where git allows them), else each byte
    outside ``[A-Za-z0-9_-]`` written ``%XX``.  An id from an agent or a ``--session`` may hold
    a space, ``..``, ``:``, ``~``, a slash or a newline, which git refuses in a ref (and which
    made the whole export fail).  One-to-one: a name kept as it is holds no ``%``.  A part
    longer than ``REF_PART_MAX`` (a component of a ref is a file name, at most 255 bytes: one
    call id of 256 bytes failed the whole export) is cut, and ends in ``%%`` and a hash of the
    whole name; the commits' trailers hold the whole name (``trailer_id``)."""
    part = _escaped(name)
    if len(part) <= REF_PART_MAX:
        return part
    head = part[:REF_PART_MAX - 34]
    if "%" in head[-2:]:  # no escape cut in two
        head = head[:head.rindex("%")]
    whole = hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return f"{head}%%{whole}"


# the longest ref component ref_part writes (NAME_MAX is 255; git adds ".lock" while it writes)
REF_PART_MAX = 200


def _escaped(name: str) -> str:
    if name and all(c in _REF_SAFE or c == "." for c in name) and ".." not in name and \
            not name.startswith(".") and not name.endswith((".", ".lock")):
        return name
    return "".join(chr(b) if chr(b) in _REF_SAFE else f"%{b:02X}"
                   for b in name.encode("utf-8", "surrogateescape"))


def from_ref_part(part: str) -> str:
    """The name ``ref_part`` wrote as ``part``."""
    if "%" not in part:
        return part
    from urllib.parse import unquote_to_bytes
    return unquote_to_bytes(part).decode("utf-8", "surrogateescape")


def _ident(name: str, email: str, t_ns: int) -> dict:
    return {"name": name, "email": email, "date": f"{t_ns // 10**9} +0000"}


# beside a unit's ``a/`` and ``b/`` in the sides tree: says that its sides are there
def _refused(p: str, s: State) -> bool:
    """Is ``p`` a path git will not hold: ``.git/`` (git_refuses), or a name its path check
    refuses (an NTFS alias of ``.git``, a ``.gitmodules`` symlink), which fast-import took as
    it was: `git fsck --strict` then failed on the store, and a push to a server that checks
    what it receives (receive.fsckObjects) failed whole."""
    return git_refuses(p) or _git_may_refuse(p, s.kind == "symlink")


SIDES_NAME = ".sides"
UNSURE_NAMED = 50  # files changed unseen that a base's message names (then a count)
SIDES_NOTE = (b"a/ holds what this unit's paths held before it, b/ what they held after it, "
              b"each only its paths that git can hold (none: neither is there)\n")


def side_key(kind: str, key) -> str:
    """Where one unit's diff sides live in a session's ``sides`` tree: ``calls/c-<id>``
    (the id percent-encoded: any text is a valid id), ``turns/<n>``, ``session``; beneath it
    ``a/`` (before) and ``b/`` (after), each holding only the selection's paths."""
    if kind == "call":
        from urllib.parse import quote   # here: most runs never need it
        return "calls/c-" + quote(key, safe="")
    if kind == "turn":
        return f"turns/{key}"
    return "session"


# the trailers that carry an id (a call's, a session's), read back by the records' readers
ID_TRAILERS = ("Call", "Session", "Active-With", "Revert")


def trailer_id(name: str) -> str:
    """A call's id or a session's name as a trailer's value: as it is, or, when it holds what a
    trailer cannot (a newline cut it there, and `records blame` named a call that never was),
    a ``%`` or spaces at its ends, written as ``ref_part`` writes it, whole whatever its
    length (``from_trailer_id``).  So too one holding any other control character: an ESC
    in a call id went raw into the message, and `git log` sent it to the terminal (found by a
    bug hunt)."""
    if any(c in "\n\r%" or c < " " or "\x7f" <= c < "\xa0" for c in name) or \
            name != name.strip():
        return _escaped(name)
    return name


def from_trailer_id(value: str) -> str:
    """The id ``trailer_id`` wrote as ``value`` (one with a ``%`` was written so)."""
    return from_ref_part(value)


def _trailer_value(text, first_line: bool = True) -> str:
    """Free text as a trailer's value, on one line (at most 200 characters): a prompt's first
    line; a command (``first_line`` false) whole, its newlines and control characters escaped
    as the listings show them (a file name in an argument may hold a newline: cut there, `mv
    'dir with space' $'dir\\nnl'` read as a move to `dir`, and the rest broke the trailers)."""
    lines = str(text).splitlines() if first_line else [str(text)]
    return one_line(lines[0].strip())[:200] if lines else ""


def record_id(j: Journal) -> str:
    """This record's name in the commits it exports (``Overlayrec-Record``): a hash of when its
    journal was made, the same for every export of it, another for another workspace's record
    (or one begun anew in the same workspace)."""
    made = j.meta("created") or os.path.realpath(j.state_dir)
    return hashlib.sha256(f"overlayrec record {made}".encode()).hexdigest()[:16]


class Exporter:
    def __init__(self, j: Journal, states: States, store: ObjectStore, state_file: str,
                 ref_prefix: str = "refs/overlayrec", sides: bool = True, shared: bool = False):
        """``shared``: the store is a repository the user named (``--repo``), whose refs may
        hold another record's commits, or the user's own: a run refuses to move them."""
        self.j = j
        self.record = record_id(j)
        self.shared = shared
        self.states = states
        self.store = store
        self.state_file = state_file
        self.prefix = ref_prefix.rstrip("/")
        self.sides = sides
        try:
            self.done = json.loads(read_regular(state_file))
        except (OSError, ValueError):
            self.done = {"horizon": 0, "paths": [], "sessions": {}}
        if not self._store_holds_done():
            # the store lost what an earlier run wrote (removed by hand, say, to free room):
            # exported anew, or nothing would be written and no ref would name anything
            self.done = {"horizon": 0, "paths": [], "sessions": {}}
        self.written = 0
        self.fi: FastImport | None = None
        self._evs: list[dict] | None = None
        self._reverts_new: dict[str, list[dict]] = {}  # per session: reverts inside it, new
        self._actor_cache: dict = {}
        self._state_cache: dict = {}
        self._live_base: str | None = None   # the mark of the last session base made
        self._ended: set[str] = set()  # sessions ended by this run's horizon (run)
        self._live_new: dict[str, list] = {}
        # per session whose base this run made: files the record never saw that changed after
        # the session began (while unmounted): the base holds them as they are now
        self.unsure_bases: dict[str, list[str]] = {}

    def _git(self, *args, input=None, env=None) -> str:
        return self.store._git(*args, input=input, env=env)

    def _store_holds_done(self) -> bool:
        """Does the store hold the head commit of every session an earlier run exported?"""
        heads = [st["head"] for st in self.done.get("sessions", {}).values()
                 if isinstance(st, dict) and isinstance(st.get("head"), str)]
        if not heads:
            return True
        out = self._git("cat-file", "--batch-check", input="".join(
            h + "\n" for h in heads).encode())
        return " missing" not in out

    def _refuse_anothers(self, work: list) -> None:
        """Refuse (GitError, nothing written) when a ref this run sets holds a commit that is
        not this record's: neither one its export state knows nor one whose trailers name it
        (``Overlayrec-Record``).  Another workspace's export into the same repository, with a
        session of the same name, moved its refs by force without a word, its commits then
        reachable from none; a user's own commit there went the same way."""
        mine = self._refs_to_set(work)
        known = self._known_commits()
        out = self._git("for-each-ref", "--format=%(objectname) %(refname)", self.prefix + "/")
        held = {}
        for line in out.splitlines():
            sha, _, name = line.partition(" ")
            if name in mine and sha not in known:
                held[name] = sha
        ours = self._naming_this_record(set(held.values()))
        foreign = sorted(name for name, sha in held.items() if sha not in ours)
        if foreign:
            more = f" (and {len(foreign) - 1} more ref(s))" if len(foreign) > 1 else ""
            raise GitError(f"{self.store.git_dir}: {foreign[0]}{more} holds a commit that is "
                           "not this record's (another workspace's export, or a commit of "
                           "your own): export into another repository, or name another "
                           "--ref-prefix")

    def _refs_to_set(self, work: list) -> set[str]:
        """The refs a run of ``work`` (session, new calls, new turns) may set."""
        out = set()
        for sid, c_new, t_new in work:
            st = self.done["sessions"].get(sid) or {}
            tails = ["head", "sides"] + ([] if st.get("head") else ["base"])
            tails += [f"calls/{ref_part(c['id'])}" for c in c_new]
            tails += [f"turns/{t['index']}" for t in t_new]
            out |= {self._refname(self._in(sid, t)) for t in tails}
        return out

    def _known_commits(self) -> set[str]:
        """The commits the export state says this record wrote."""
        out = set()
        for st in self.done.get("sessions", {}).values():
            if isinstance(st, dict):
                out |= {st.get("head"), st.get("sides")}
                for kind in ("calls", "turns", "reverts"):
                    out |= set((st.get(kind) or {}).values())
        return {x for x in out if isinstance(x, str)}

    def _naming_this_record(self, shas: set[str]) -> set[str]:
        """Of these objects, the commits whose message names this record
        (``Overlayrec-Record``)."""
        if not shas:
            return set()
        kinds = self._git("cat-file", "--batch-check=%(objectname) %(objecttype)",
                          input="".join(f"{x}\n" for x in sorted(shas)).encode())
        commits = [ln.split()[0] for ln in kinds.splitlines() if ln.endswith(" commit")]
        if not commits:
            return set()
        out = self._git("log", "--no-walk=unsorted", "--stdin", "--format=%H%x00%B%x01",
                        input="".join(f"{x}\n" for x in commits).encode())
        tag = f"\nOverlayrec-Record: {self.record}\n"
        return {sha.strip() for sha, _, body in (c.partition("\0") for c in out.split("\1"))
                if sha.strip() and tag in "\n" + body}

    def run(self, progress=None) -> dict:
        self.began_ns = time.time_ns()
        horizon = self.j.last_seq()
        paths = {p for p in self.done["paths"] if not git_refuses(p)}
        refused = set()   # .git/ paths: git holds none, they are counted and left out
        maybe = set()     # names git may take for .git (_refused: by their kind at a point)
        for p in self.states.all_names():  # path history: names beneath renamed dirs too
            if _visible(p):
                (refused if git_refuses(p) else paths).add(p)
                if _git_may_refuse(p, True):
                    maybe.add(p)
        paths = sorted(paths)
        calls = self.j.records("calls")
        turns = self.j.records("turns")
        sessions = sorted({c["session"] for c in calls} | {t["session"] for t in turns})
        work = []
        for sid in sessions:
            st = self.done["sessions"].get(sid) or {"calls": {}, "turns": {}}
            c_new = [c for c in calls if c["session"] == sid and c.get("end_seq")
                     and c["id"] not in st["calls"]]
            t_new = [t for t in turns if t["session"] == sid and t.get("end_seq")
                     and _unexported_end(st, t)]
            if c_new or t_new:
                work.append((sid, c_new, t_new))
        # an ended session whose calls' processes wrote after its chain's last commit (a
        # server one of them left running): a commit of those late writes follows
        self._ended = {r["id"] for r in self.j.records("sessions") if r.get("ended")}
        # an ended session with neither calls nor turns (an agent without hooks that wrote
        # only itself: a shell's builtins) is a chain too, once: its base and its changes
        work += [(sid, [], []) for sid in sorted(self._ended - set(sessions))
                 if sid not in self.done["sessions"]]
        # the sessions recorded by now (read after the horizon: a session's record is written
        # before any event of it), so a later run knows a session it never saw began after
        # this run's horizon
        seen = self.done.get("seen")
        seen = set(seen["ids"]) if isinstance(seen, dict) and \
            seen.get("horizon") == self.done["horizon"] else None   # else: not known
        records = [r for r in self.j.records("sessions") if isinstance(r.get("id"), str)]
        recorded = {r["id"] for r in records}
        self.done["seen"] = {"horizon": horizon, "ids": sorted(recorded | (seen or set()))}
        # a revert run inside a session (an agent's call ran `overlayrec revert`): a commit of
        # its own in the session's chain, so the chain ends where the session did
        self._reverts_new = self._reverts_inside(
            [r for r in records if r["id"] in set(sessions) | self._ended], seen, horizon)
        busy = {w[0] for w in work}
        work += [(sid, [], []) for sid in sorted(self._reverts_new) if sid not in busy]
        late = self._late_writers(self._ended, horizon, {w[0] for w in work})
        work += [(sid, [], []) for sid in sorted(late)]
        if work:
            # the events this run reads: from the earliest point a chain, a new unit's span or
            # a session's spans (all of a session never exported) start from
            lo = self.done["horizon"]
            self._since = {}
            for sid, c_new, t_new in work:
                st = self.done["sessions"].get(sid)
                if st and st.get("spans") is not None:
                    since = min(st["point"], st.get("spans_to", 0))
                elif seen is not None and sid not in seen and sid in recorded:
                    since = self.done["horizon"]   # all of it after the last run's horizon
                else:
                    since = 0
                self._since[sid] = since
                lo = min([lo, since]
                         + [(c.get("begin_seq") or c["end_seq"]) - 1 for c in c_new]
                         + [t["begin_seq"] - 1 for t in t_new]
                         + [r["begin_seq"] - 1 for r in self._reverts_new.get(sid, [])])
            # an exported call of an ended session that wrote since (a process it left
            # running): its sides are made again, from its begin (below ``lo``: the states
            # there were read from the floor up, and its sides took its first writes' results
            # for what the paths held before them)
            lo = min([lo] + self._late_call_begins({w[0] for w in work}, horizon))
            lo = max(0, lo)
            if self.shared:
                self._refuse_anothers(work)   # before a byte is written
            # the states asked for are at ``lo`` or later: each path's chain is read from there
            # (States.floor: only its events after ``lo`` and its last one before).  When most
            # of the journal is read anyway, or chains are read whole (directory renames), one
            # decode of it all serves every chain
            if lo - self.j.cut < (horizon - self.j.cut) // 2 or self.states.renames():
                self.j.keep_events()
            self._load(lo, horizon)
            self.refs: list[tuple[str, str]] = []
            # a run's objects as one pack, until the store holds as many as ``git gc --auto``
            # lets be (gc.autoPackLimit); then as git does (loose, when under 100)
            self.fi = FastImport(self.store, keep_pack=self.store.packs() < 50)
            try:
                with self.states.from_floor(lo):
                    for sid, c_new, t_new in work:
                        self._session(sid, c_new, t_new, paths, horizon, progress)
                marks = self.fi.close()
            except BaseException:
                self.fi.cleanup()
                raise
            new = {p for e in self._events(self.done["horizon"], horizon)
                   for p in touched(self.states, e) if p in refused or p in maybe}
        else:
            # (touched: what a directory rename moved beneath it too, `mv d e` of d/.git/:
            # the count said none left out, where diff said 4: found by a bug hunt)
            new = {p for e in file_events(self.j, self.done["horizon"] + 1, horizon)
                   for p in touched(self.states, e) if p in refused or p in maybe}
        left_out = 0
        for p in new:
            was, now = self.states.state(p, self.done["horizon"]), self.states.state(p, horizon)
            if not was.same(now) and (p in refused or any(
                    x.kind in ("file", "symlink") and _refused(p, x) for x in (was, now))):
                left_out += 1
        if work:
            # the marks of this run become object names in the state kept
            for st in self.done["sessions"].values():
                for d, k in [(st, "head"), (st, "sides")] + \
                        [(st["calls"], k) for k in st["calls"]] + \
                        [(st["turns"], k) for k in st["turns"]] + \
                        [(st["reverts"], k) for k in st.get("reverts", {})]:
                    if isinstance(d.get(k), str) and d[k].startswith(":"):
                        d[k] = marks[d[k]]
            if self._live_base is not None:
                self._save_live(marks)
            if self.refs:
                self._git("update-ref", "--stdin", input="".join(
                    f"update {name} {marks[m]}\n" for name, m in self.refs
                ).encode("utf-8", "surrogateescape"))
        self.done["horizon"] = horizon
        self.done["paths"] = paths
        tmp = self.state_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.done, f)
        os.replace(tmp, self.state_file)
        chains = sum(1 for st in self.done["sessions"].values()
                     if isinstance(st, dict) and st.get("head"))
        return {"commits": self.written, "sessions": chains, "paths": len(paths),
                "git_left_out": left_out, "unsure_bases": self.unsure_bases}

    # -- the journal's events, read once a run ----------------------------------------------------
    def _load(self, lo: int, hi: int) -> None:
        self._evs = file_events(self.j, lo + 1, hi)
        self._seqs = [e["seq"] for e in self._evs]
        self._lo, self._hi = lo, hi

    def _events(self, lo: int, hi: int) -> list[dict]:
        """File events with lo < seq <= hi (within what _load read)."""
        if self._evs is None or lo < self._lo:
            self._load(lo, self._hi if self._evs is not None else self.j.last_seq())
        return self._evs[bisect.bisect_right(self._seqs, lo):bisect.bisect_right(self._seqs, hi)]

    def state(self, path: str, point: int) -> State:
        """What ``path`` held after ``point``, as States.state gives it but without working out
        whether the point is exact (a tree holds the bytes, not that flag); cached."""
        key = (path, point)
        st = self._state_cache.get(key)
        if st is None:
            st = self._state_cache[key] = self.states.whole_chains(self._state_now, path, point)
        return st

    def _state_now(self, path: str, point: int) -> State:
        s = self.states
        st = s._state(path, point)
        if st.kind == "file" and (st.withheld or s.secrets.match_at(path, point)):
            st = s._withheld(path, point, st)   # a secret's placeholder, as every reader
        return st

    def moved_with(self, e: dict):
        return self.states.moved_with(e)

    def _actor(self, key: str) -> dict:
        if key not in self._actor_cache:
            self._actor_cache[key] = self.j.actor(key) or {}
        return self._actor_cache[key]

    def _late_call_begins(self, sids: set[str], horizon: int) -> list[int]:
        """The seq before the begin of each exported call of an ended session in ``sids``
        that has events after the session's chain point (late writes, whose sides are made
        again)."""
        points = {sid: st["point"] for sid, st in self.done["sessions"].items()
                  if sid in sids and sid in self._ended and st.get("head") and st.get("calls")}
        if not points:
            return []
        begins = []
        seen: set[str] = set()
        for e in file_events(self.j, min(points.values()) + 1, horizon):
            u = e.get("unit") or ""
            if u in seen:
                continue
            sid = unit_session(u)
            if sid not in points or e["seq"] <= points[sid]:
                continue
            unit = parse_unit(u)
            if unit.kind == "call":
                seen.add(u)
                cid = unit.id
                if cid in self.done["sessions"][sid]["calls"]:
                    rec = self.j.record("calls", call_key(sid, cid))
                    if rec and (rec.get("begin_seq") or rec.get("end_seq")):
                        begins.append((rec.get("begin_seq") or rec["end_seq"]) - 1)
        return begins

    def _late_writers(self, ended: set[str], horizon: int, busy: set[str]) -> set[str]:
        """The ended sessions (chain exported, no new call or turn: ``busy`` have some) whose
        units wrote after the chain's point; each session's ``late_checked`` horizon spares a
        later run the events it looked at."""
        todo = {sid: max(st["point"], st.get("late_checked", 0))
                for sid, st in self.done["sessions"].items()
                if sid in ended and st.get("head") and sid not in busy}
        todo = {sid: frm for sid, frm in todo.items() if frm < horizon}
        found = set()
        if todo:
            for e in file_events(self.j, min(todo.values()) + 1, horizon):
                sid = unit_session(e.get("unit"))
                if sid in todo and e["seq"] > todo[sid] and sid not in found and \
                        any(_visible(p) and not git_refuses(p)
                            for p in (e.get("path"), e.get("path2")) if p is not None):
                    found.add(sid)
        for sid in todo:
            if sid not in found:
                self.done["sessions"][sid]["late_checked"] = horizon
        return found

    def _reverts_inside(self, sessions: list[dict], seen: set[str] | None,
                        horizon: int) -> dict[str, list[dict]]:
        """Per session (of these records), the reverts done by ``horizon`` whose begin and end
        lie inside its span (its start to its end, or on: a live one) that its chain lacks,
        after the chain's point: each ``{"id", "begin_seq", "end_seq", "begin_t", "end_t",
        "actor"}`` (``actor``: the process that asked for it).  Read from the events after the
        earliest such point only (a session new since the last run: after its horizon)."""
        floors = {}
        for r in sessions:
            st = self.done["sessions"].get(r["id"])
            if st and st.get("head"):
                # one that ended by the last run's horizon was committed by that run
                floors[r["id"]] = max(st["point"], self.done["horizon"])
            elif seen is not None and r["id"] not in seen:
                floors[r["id"]] = self.done["horizon"]
            else:
                floors[r["id"]] = 0
        if not floors:
            return {}
        lo = min(floors.values())
        began: dict[str, dict] = {}
        ended = []
        for e in self.j.events_of(("revert_begin", "revert_end"), lo + 1, horizon):
            if e["op"] == "revert_begin":
                began[e.get("revert")] = e
            else:
                ended.append(e)
        if any(e.get("revert") not in began for e in ended):
            # begun before ``lo`` (an export ran while it went on): its begin, further back
            began.update((e.get("revert"), e) for e in self.j.events_of(("revert_begin",), 1, lo))
        done = [{"id": e["revert"], "begin_seq": b["seq"], "end_seq": e["seq"],
                 "begin_t": b["t"], "end_t": e["t"], "actor": b.get("actor")}
                for e in ended if (b := began.get(e.get("revert"))) is not None]
        out: dict[str, list[dict]] = {}
        for r in sessions:
            sid, st = r["id"], self.done["sessions"].get(r["id"]) or {}
            start, end = r.get("started") or 0, r.get("ended")
            mine = [v for v in done if v["end_seq"] > floors[sid] and start <= v["begin_t"]
                    and (end is None or v["end_t"] <= end)
                    and v["id"] not in (st.get("reverts") or {})]
            if mine:
                out[sid] = mine
        return out

    # -- one session's chain ------------------------------------------------------------------------
    def _session(self, sid: str, calls: list[dict], turns: list[dict], paths: list[str],
                 horizon: int, progress) -> None:
        st = self.done["sessions"].setdefault(sid, {"head": None, "point": 0, "calls": {},
                                                    "turns": {}})
        points = []
        for c in calls:
            points.append((c["end_seq"], 1, "call", c))
        for t in turns:
            points.append((t["end_seq"], 2, "turn", t))
        for r in self._reverts_new.get(sid, []):
            points.append((r["end_seq"], 1, "revert", r))
        points.sort(key=lambda p: (p[0], p[1]))
        if not points and sid not in self._ended:
            return
        if not points and not st["head"] and not self._changed_by(sid, horizon):
            return  # a session that changed nothing: no chain (and not looked at again)
        self.pending: list[bytes] = []
        # the paths staged for the next commit whose content is not known exactly (content
        # the record could not keep): a tree holds bytes, so the commit's message names them
        self.vague: list[str] = []
        # the files of the chain's tree as it stands (a path is removed only where it is a
        # file: a path now a directory keeps what lies beneath it, as an index would)
        self.files: set[str] = set()
        if st["head"]:
            self.files = set(p for p in self._git("ls-tree", "-r", "-z", "--name-only",
                                                  st["head"]).split("\0") if p)
        point = st["point"]
        if not st["head"]:
            first = points[0][3] if points else {}
            point = max(0, (first.get("begin_seq") or points[0][0]) - 1) if points else horizon
            # the base is the workspace before the session, not before its first call: what
            # the agent itself (or another process) changed in between is a commit of its own
            # (it was folded into the base, which then held the session's first changes)
            begun = next((e["seq"] for e in self.j.events_of(
                ("session_begin",), max(1, self._since.get(sid, 0)), point)
                if e.get("session") == sid), None)
            if begun is not None:
                point = begun
        fill = [p for p in paths if p not in self.files]
        self._update(fill, point)
        if not st["head"]:
            # the session's base: the workspace as it stood when the session began (the
            # recorded paths rolled back, every other file as it is: nothing the record saw
            # changed it, but something it did not see may have, while unmounted)
            started = (self.j.record("sessions", sid.encode()) or {}).get("started")
            t0 = first.get("begin_t") or started or 0
            unsure = sorted(set(self._fill_unrecorded(paths, started or t0)) |
                            set(self._first_seen_later(paths, point, started or t0)))
            msg = (f"session {sid}: the workspace before it\n\n"
                   f"Overlayrec-Session: {trailer_id(sid)}\nOverlayrec-Seq: ..{point}\n")
            if unsure:
                self.unsure_bases[sid] = unsure
                msg += "".join(f"Overlayrec-Changed-Unseen: {shown(p)}\n"
                               for p in unsure[:UNSURE_NAMED]) + \
                    (f"Overlayrec-Changed-Unseen-More: {len(unsure) - UNSURE_NAMED}\n"
                     if len(unsure) > UNSURE_NAMED else "")
            # a root commit, whatever was there
            self.fi.reset(self._refname(self._in(sid, "head")))
            st["head"] = self._commit(sid, st, _ident(f"agent (session {sid})",
                                                      "agent@overlayrec.invalid", t0), msg, t0)
            self._live_base = st["head"]
            self._ref(self._in(sid, "base"), st["head"])
        for n, (seq, _, kind, rec) in enumerate(points):
            if kind in ("call", "revert"):
                begin = rec.get("begin_seq") or seq
                if begin - 1 > point and self._changed(point, begin - 1):
                    self._commit_interim(sid, st, point, begin - 1, paths)
                    point = begin - 1
                self._advance(point, seq, paths)
                if kind == "revert":
                    st["head"] = self._commit(sid, st, *self._revert_message(sid, rec, point,
                                                                            seq))
                    st.setdefault("reverts", {})[rec["id"]] = st["head"]
                else:
                    st["head"] = self._commit(sid, st, *self._call_message(sid, rec, point,
                                                                          seq))
                    st["calls"][rec["id"]] = st["head"]
                    self._ref(self._in(sid, f"calls/{ref_part(rec['id'])}"), st["head"])
            else:
                if seq > point and self._changed(point, seq):
                    self._advance(point, seq, paths)
                st["head"] = self._commit(sid, st, *self._turn_message(sid, rec, point, seq))
                st["turns"][str(rec["index"])] = st["head"]
                st.setdefault("turn_ends", {})[str(rec["index"])] = seq
                self._ref(self._in(sid, f"turns/{rec['index']}"), st["head"])
            point = seq
            st["point"] = point
            if progress:
                progress(sid, n + 1, len(points))
        if sid in self._ended:
            # what its calls' processes wrote after its last turn ended, up to their last write
            late = [e for e in self._events(point, horizon) if unit_session(e.get("unit")) == sid]
            if late and self._changed(point, late[-1]["seq"]):
                by_calls = [parse_unit(e.get("unit")).kind == "call" for e in late]
                if all(by_calls):
                    subject = "late writes by the session's calls after its end"
                elif not (points or st["calls"] or st["turns"]):
                    subject = "changes by the agent"  # a session without calls or turns
                else:
                    subject = "changes after the last call by the agent" + (
                        ", and late writes by its calls" if any(by_calls) else "")
                self._commit_interim(sid, st, point, late[-1]["seq"], paths, subject=subject)
                st["point"] = late[-1]["seq"]
                # their calls' sides are made again: their diffs hold these writes too
                units = {e.get("unit") for e in late}
                done = {c["id"] for c in calls}
                calls = calls + [c for c in self.j.records("calls", sid.encode() + b"\0")
                                 if call_unit(sid, c["id"]) in units and c["id"] not in done
                                 and c.get("end_seq")]
            st["late_checked"] = horizon
        if self.sides:
            self._sides(sid, st, calls, turns, horizon)

    def _changed_by(self, sid: str, horizon: int) -> bool:
        """Did a unit of session ``sid`` change a path a tree holds, up to ``horizon``?"""
        return any(unit_session(e.get("unit")) == sid and self._counts(e)
                   for e in self._events(self._since.get(sid, 0), horizon))

    def _refname(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    @staticmethod
    def _in(sid: str, tail: str) -> str:
        """Ref ``tail`` (head, base, sides, calls/<id>, turns/<n>) of session ``sid``, the
        session's name as one ref component (ref_part)."""
        return f"{ref_part(sid)}/{tail}"

    # -- trees ----------------------------------------------------------------------------------
    def _fill_unrecorded(self, paths: list[str], since_ns: int) -> list[str]:
        """Add every file and symlink of the live tree the record never touched (so a commit
        holds the whole workspace, not only what changed); those among them changed after
        ``since_ns`` (their ctime: edited, made or chmodded while unmounted), whose state at
        that time the record cannot know.

        Their blob ids are kept beside the export state (``.live.json``) with each one's
        lstat, as git's index keeps them: a file whose mode, size, mtime, ctime and inode are
        the ones kept is not read again (any change to a file sets its ctime to the time of
        the change; an edit while unmounted too).  A file whose times are within a few
        seconds of the walk is not kept (a later change could leave the same times), nor a
        secret (never read).  The ids are used only while the commit they went into (the
        last session base made) is in the store."""
        known = set(paths)
        tree = self.states.tree
        kept = self._live_kept()
        racy = time.time_ns() - 3 * 10**9
        fresh: dict[str, list] = {}
        states, ids = {}, {}
        unsure = []
        walked = [(p, st) for p, st in tree.walk_stat("", skip={".git"})
                  if not (p in known or not _visible(p) or git_refuses(p) or
                          not (S_ISREG(st.st_mode) or S_ISLNK(st.st_mode)) or
                          _git_may_refuse(p, S_ISLNK(st.st_mode)))]
        late = self._recorded_since([p for p, st in walked if st.st_ctime_ns >= self.began_ns])
        for p, st in walked:
            if p in late:
                if late[p]:  # it held something at the base's point, not known here
                    unsure.append(p)
                continue
            if since_ns and st.st_ctime_ns > since_ns:
                unsure.append(p)
            key = [st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
            k = kept.get(p)
            # not a secret since (a later mount's --secret): its kept id is its content
            if k is not None and k[:5] == key and not self.states.secrets.match(p):
                ids[p] = ("120000" if S_ISLNK(st.st_mode) else
                          "100755" if st.st_mode & 0o111 else "100644", k[5])
                fresh[p] = k
                continue
            s = tree.state(p)
            if s.kind not in ("file", "symlink"):
                continue
            states[p] = s
            if max(st.st_mtime_ns, st.st_ctime_ns) < racy and not s.withheld and \
                    not self.states.secrets.match(p):
                fresh[p] = key   # its blob's mark, then object name, added below
        self._stage(states)
        for p, key in fresh.items():
            if len(key) == 5:
                key.append(self.fi.blob(states[p].data))   # the mark _stage wrote it under
        for p in sorted(ids):
            mode, sha = ids[p]
            self.pending.append(f"M {mode} {sha} ".encode() + quote_path(p))
            self._placed(p)
        self._live_new = fresh
        return sorted(unsure)

    def _recorded_since(self, paths: list[str]) -> dict[str, bool]:
        """Of ``paths``, found in the live tree changed after this export began, those the
        record has events of now (a call writing while the export ran): the base must not
        take them as the record never touched them (a file a call made meanwhile went into
        the session's base and its earlier calls, for good: found by a hunt).  Each with
        whether its first event found something there (then the base's content is not
        known here: said), or nothing (a file made since: rightly not in the base)."""
        if not paths:
            return {}
        self.j.last_seq()  # what the daemon wrote ahead is committed: every change walked
        out = {}
        for p in paths:
            seqs = self.j.seqs_for_path(p)
            ev = self.j.event(seqs[0]) if seqs else None
            if ev is not None:
                pre = self.states.pre_for(ev, p) or {}
                out[p] = pre.get("kind", "absent") != "absent"
        return out

    def _first_seen_later(self, paths: list[str], point: int, since_ns: int) -> list[str]:
        """Recorded paths the base holds as the record first saw them after ``point`` (the
        session's base), modified after ``since_ns``: made or edited while unmounted after the
        session began, and written by a later unit (its first pre-image; found by a hunt: a
        file made between two sessions went into the first one's base, and its first call's
        commit then removed it, with nothing said), or beneath a directory a later unit
        renamed (its new name's seal or the live file: a directory made between two sessions
        and renamed in the second put its files into the first's base, said by replay, not
        here).  The judgment replay makes (``replay.first_seen_later``), so the two agree;
        a directory's times move with its entries, so it is not judged (the unit's own
        ``rm -r d`` or ``mv d/f g; mv d e`` moved them: a hunt found such a base named)."""
        if not since_ns:
            return []
        out = []
        for p in paths:
            if not _visible(p) or git_refuses(p):
                continue
            evs = self.states.events_on(p)
            if evs and (evs[0]["seq"] <= point or self._seen_as(p, evs[0]["seq"])):
                continue
            if self.state(p, point).kind not in ("file", "symlink"):
                # not in the base: nothing it holds to name (a file made beneath a directory
                # the user made where a file stood was named, found by a bug hunt)
                continue
            if first_seen_later(self.states, p, point, since_ns, dirs=False):
                out.append(p)
        return out

    def _seen_as(self, path: str, seq: int) -> bool:
        """Did the record see the file ``path`` holds at ``seq`` under an earlier name, before
        a directory above it was renamed (`mv d x`, then a revert's step on x/f: x/f was
        taken for a file made while unmounted)?"""
        for name, _, _ in self.states.history(path, seq - 1)[1:]:
            evs = self.states.events_on(name)
            if evs and evs[0]["seq"] < seq:
                return True
        return False

    def _live_file(self) -> str:
        return self.state_file[:-5] + ".live.json" if self.state_file.endswith(".json") \
            else self.state_file + ".live"

    def _live_kept(self) -> dict[str, list]:
        """The kept ids of unrecorded files (see _fill_unrecorded), when their commit is in
        the store."""
        try:
            kept = json.loads(read_regular(self._live_file()))
            files, commit = kept["files"], kept["commit"]
        except (OSError, ValueError, KeyError, TypeError):
            return {}
        if not (isinstance(files, dict) and isinstance(commit, str) and files):
            return {}
        try:
            self._git("cat-file", "-e", commit + "^{commit}")
        except GitError:
            return {}
        return {p: k for p, k in files.items() if isinstance(k, list) and len(k) == 6
                and isinstance(k[5], str) and len(k[5]) in (40, 64)
                and all(c in "0123456789abcdef" for c in k[5])}

    def _save_live(self, marks: dict[str, str]) -> None:
        """Keep the ids of the last base's unrecorded files (marks made object names)."""
        files = {p: k[:5] + [marks.get(k[5], k[5])] for p, k in self._live_new.items()}
        files = {p: k for p, k in files.items() if not k[5].startswith(":")}
        tmp = self._live_file() + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"commit": marks[self._live_base], "files": files}, f)
        os.replace(tmp, self._live_file())

    def _changed(self, lo: int, hi: int) -> bool:
        return any(_visible(p) and not git_refuses(p) for e in self._events(lo, hi)
                   for p in (e.get("path"), e.get("path2")) if p is not None)

    def _touched(self, lo: int, hi: int) -> list[str]:
        out = set()
        for e in self._events(lo, hi):
            for p in touched(self.states, e):
                if _visible(p):
                    out.add(p)
        return sorted(out)

    def _advance(self, lo: int, hi: int, paths: list[str]) -> None:
        known = set(paths)
        self._update([p for p in self._touched(lo, hi) if p in known], hi)

    def _update(self, paths: list[str], point: int) -> None:
        if paths:
            self._stage({p: self.state(p, point) for p in paths})

    def _blob_line(self, p: str, s: State, prefix: str = "") -> bytes:
        mode = "120000" if s.kind == "symlink" else ("100755" if s.mode & 0o111 else "100644")
        return f"M {mode} {self.fi.blob(s.data)} ".encode() + quote_path(prefix + p)

    def _stage(self, states: dict[str, State]) -> None:
        """The changes that bring the chain's tree to these states (as ``git update-index
        --index-info`` would: each present file or symlink written as a blob, each other path
        removed where it is a file).  Paths git refuses (``.git/``) are left out and remembered
        in the store's ``left_out``; so is the workspace's root."""
        refused = {p for p, st in states.items() if _refused(p, st)}
        self.store.left_out |= refused
        present = []
        for p in sorted(states):
            if not p:
                continue
            if p in refused:
                if p in self.files:  # what it held before is no longer so
                    self.pending.append(b"D " + quote_path(p))
                    self.files.discard(p)
                continue
            if states[p].kind in ("file", "symlink"):
                present.append(p)
            elif p in self.files:
                self.pending.append(b"D " + quote_path(p))
                self.files.discard(p)
        for p in present:
            self.pending.append(self._blob_line(p, states[p]))
            self._placed(p)
            if not states[p].exact and not states[p].withheld:
                self.vague.append(p)

    def _placed(self, p: str) -> None:
        parts = p.split("/")
        for i in range(1, len(parts)):   # a file where a directory now is: replaced
            self.files.discard("/".join(parts[:i]))
        self.files.add(p)

    # -- commits --------------------------------------------------------------------------------
    def _commit(self, sid, st, author: dict, message: str, t_ns: int) -> str:
        committer = _ident("overlayrec", "overlayrec@localhost", t_ns)
        if self.vague:
            message += "".join(f"Overlayrec-Inexact: {shown(p)}\n" for p in sorted(self.vague))
            self.vague = []
        message += f"Overlayrec-Record: {self.record}\n"
        m = self.fi.commit(self._refname(self._in(sid, "head")), author, committer, message,
                           st["head"], self.pending)
        self.pending = []
        self.written += 1
        return m

    def _ref(self, name: str, mark: str) -> None:
        # set once the stream is done (a ``reset`` in the stream would load the commit's tree
        # into fast-import for every ref): one ``git update-ref --stdin`` for them all
        self.refs.append((self._refname(name), mark))

    def _actors(self, lo: int, hi: int, unit: str | None) -> list[str]:
        out = []
        for e in self._events(lo, hi):
            if unit is not None and e.get("unit") != unit:
                continue
            a = self._actor(e["actor"])
            line = f"{a.get('pid', '?')} {one_line(' '.join(a.get('argv') or []))[:120]}"
            if line not in out:
                out.append(line)
        return out

    def _call_message(self, sid: str, c: dict, lo: int, hi: int):
        unit = call_unit(sid, c["id"])
        subject = one_line(f"{c['tool']}: {c.get('summary') or c['id']}")[:72]
        trailers = [("Overlayrec-Call", trailer_id(c["id"])),
                    ("Overlayrec-Tool", one_line(c["tool"])),
                    ("Overlayrec-Turn", str(c.get("turn"))),
                    ("Overlayrec-Session", trailer_id(sid)),
                    ("Overlayrec-Seq", f"{lo + 1}..{hi}"), ("Overlayrec-Status", str(c.get("status"))),
                    ("Overlayrec-Begin", str(c["begin_t"])), ("Overlayrec-End", str(c["end_t"]))]
        # a call in no turn (an implicit call, an agent without turns) has no turn to name:
        # the trailer said "None", Python's word (found by a bug hunt)
        trailers = [(k, v) for k, v in trailers if not (k == "Overlayrec-Turn" and
                                                         c.get("turn") is None)]
        if EXTRA_TRAILERS:
            if c.get("summary"):
                trailers.append(("Overlayrec-Summary", _trailer_value(c["summary"], False)))
            if c.get("implicit"):
                trailers.append(("Overlayrec-Implicit", "yes"))
        mine = self._actors(lo, hi, unit)
        trailers += [("Overlayrec-Actor", a) for a in mine]
        others = [a for a in self._actors(lo, hi, None) if a not in mine]
        trailers += [("Overlayrec-Other-Writer", a) for a in others]
        # changes placed in this call by a guess among calls active together (views.guessed)
        placed = guessed([e for e in self._events(lo, hi) if e.get("unit") == unit])
        trailers += [("Overlayrec-Guessed", shown(p)) for p in placed["guessed"]]
        trailers += [("Overlayrec-Active-With", trailer_id(parse_unit(u).id))
                     for u in placed["active_with"] if placed["guessed"]]
        msg = subject + "\n\n" + "\n".join(f"{k}: {v}" for k, v in trailers) + "\n"
        author = _ident(f"agent (session {sid})", "agent@overlayrec.invalid", c["end_t"])
        return author, msg, c["end_t"]

    def _turn_message(self, sid: str, t: dict, lo: int, hi: int):
        prompt = (t.get("prompt") or "").splitlines()
        subject = f"turn {t['index']} ends" + (f": {one_line(prompt[0])}" if prompt else "")
        trailers = [("Overlayrec-Turn", str(t["index"])), ("Overlayrec-Session", trailer_id(sid)),
                    ("Overlayrec-Seq", f"{t['begin_seq']}..{hi}"),
                    ("Overlayrec-Begin", str(t["begin_t"])), ("Overlayrec-End", str(t["end_t"]))]
        if EXTRA_TRAILERS and prompt:
            trailers.append(("Overlayrec-Prompt", _trailer_value(t["prompt"])))
        msg = subject[:72] + "\n\n" + "\n".join(f"{k}: {v}" for k, v in trailers) + "\n"
        return _ident(f"agent (session {sid})", "agent@overlayrec.invalid", t["end_t"]), msg, \
            t["end_t"]

    def _revert_message(self, sid: str, r: dict, lo: int, hi: int):
        """A revert's commit inside a session's chain: its subject names the revert, its
        trailers the revert, its unit (as an interim commit's), the process that asked for it
        and each process that wrote in its span."""
        unit = revert_unit(r["id"])
        asked = self._actor(r["actor"]) if isinstance(r.get("actor"), str) else {}
        argv = asked.get("argv") or []
        # the command from its verb on (`overlayrec revert --call c1 --yes`), not the
        # interpreter's path that begins it
        verb = next((i for i, a in enumerate(argv) if a in ("revert", "unrevert")), None)
        command = one_line(" ".join(["overlayrec"] + argv[verb:] if verb is not None else argv))
        subject = one_line(f"revert {r['id']}" + (f": {command}" if command else ""))[:72]
        trailers = [("Overlayrec-Revert", trailer_id(r["id"])),
                    ("Overlayrec-Session", trailer_id(sid)),
                    ("Overlayrec-Seq", f"{lo + 1}..{hi}"), ("Overlayrec-Unit", unit),
                    ("Overlayrec-Begin", str(r["begin_t"])), ("Overlayrec-End", str(r["end_t"]))]
        mine = self._actors(lo, hi, unit)
        if asked:   # (the process that asked: one line, as the actors')
            line = f"{asked.get('pid', '?')} {one_line(' '.join(argv))[:120]}"
            if line not in mine:
                trailers.append(("Overlayrec-Requested-By", line))
        trailers += [("Overlayrec-Actor", a) for a in mine]
        trailers += [("Overlayrec-Other-Writer", a) for a in self._actors(lo, hi, None)
                     if a not in mine]
        msg = subject + "\n\n" + "\n".join(f"{k}: {v}" for k, v in trailers) + "\n"
        return _ident("overlayrec revert", "revert@overlayrec.invalid", r["end_t"]), msg, \
            r["end_t"]

    def _commit_interim(self, sid, st, lo, hi, paths, subject: str | None = None) -> None:
        self._advance(lo, hi, paths)
        evs = self._events(lo, hi)
        units = sorted({e.get("unit") or "" for e in evs})
        outside = all(u and parse_unit(u).kind == "outside" for u in units)
        # none of this session's own (another session's call, with outside processes or
        # not): no change of its agent's, as the commit said it was
        others = not outside and not any(unit_session(u) == sid for u in units)
        # some of the agent's, some another's (the user's edit between two of its commands):
        # the agent's name alone said the other's change was its
        mixed = not outside and not others and \
            any(unit_session(u) != sid for u in units)
        # all of them the session's calls' (a process a call left running, writing after its
        # end): no change of the agent's own, as the commit said
        by_calls = not (outside or others or mixed) and bool(units) and \
            all(parse_unit(u).kind == "call" for u in units)
        actors = self._actors(lo, hi, None)
        t_ns = max((e["t"] for e in evs), default=0)
        who = "outside process" if outside else "other writers" if others else \
            f"agent (session {sid}) and other writers" if mixed else \
            f"calls' processes (session {sid})" if by_calls else f"agent (session {sid})"
        subject = subject or "changes between calls by " + (
            "outside processes" if outside else "other writers (another session's, outside "
            "processes)" if others else "the agent and other writers (another session's, "
            "outside processes)" if mixed else "processes earlier calls left running"
            if by_calls else "the agent")
        msg = (f"{subject}\n\n"
               + "\n".join([f"Overlayrec-Session: {trailer_id(sid)}",
                             f"Overlayrec-Seq: {lo + 1}..{hi}"]
                           + [f"Overlayrec-Unit: {u}" for u in units]
                           + [f"Overlayrec-Actor: {a}" for a in actors]) + "\n")
        email = "outside@overlayrec.invalid" if outside or others else \
            "agent@overlayrec.invalid"
        st["head"] = self._commit(sid, st, _ident(who, email, t_ns), msg, t_ns)

    # -- the sides of each unit's diff ----------------------------------------------------------
    def _counts(self, e: dict) -> bool:
        """Does this event change a path a tree can hold (not the attic, not under .git/)?"""
        return any(_visible(p) and not git_refuses(p) for p in (e.get("path"), e.get("path2"))
                   if p is not None)

    def _sides(self, sid: str, st: dict, calls: list[dict], turns: list[dict],
               horizon: int) -> None:
        """One commit on ``<session>/sides``: the before (``a/``) and after (``b/``) trees of
        the diffs ``overlayrec diff`` makes (engines/diff.py), each only its selection's paths:
        every new turn's, the session's (kept up to date path by path), and a new call's only
        where the chain cannot show it (another unit wrote inside its span, it wrote after its
        end, or the chain commits inside its span): else its commit against its parent is that
        diff already."""
        changes: list[bytes] = []

        def put(key: str, events: list[dict], bounds=None) -> None:
            side = side_of(self, events, bounds)
            changes.append(b"D " + quote_path(key))
            # a unit's sides are there even when they hold no file (it changed only what git
            # cannot hold, an empty directory, or nothing): without this a reader of the refs
            # took them for absent and answered a call's diff from its commit, another unit's
            # writes inside its span included (found by the history model)
            changes.append(f"M 100644 {self.fi.blob(SIDES_NOTE)} ".encode()
                           + quote_path(f"{key}/{SIDES_NAME}"))
            for half, states in (("a/", side.before), ("b/", side.after)):
                for p in sorted(states):
                    s = states[p]
                    if p and s.kind in ("file", "symlink") and not _refused(p, s):
                        changes.append(self._blob_line(p, s, f"{key}/{half}"))

        if calls:
            lo = min(c.get("begin_seq") or c["end_seq"] for c in calls) - 1
            by_unit: dict[str, list[dict]] = {}
            for e in self._events(lo, horizon):
                by_unit.setdefault(e.get("unit") or "", []).append(e)
            # where the chain may commit: each call's begin (an interim commit) and end, each
            # turn's end.  One inside a call's span takes what the call wrote before it: a
            # turn ended while a call was still active (a tool's end hook that never came)
            # held the call's first writes in its commit, the call's commit only the rest
            prefix = sid.encode() + b"\0"
            marks = sorted({x for r in self.j.records("calls", prefix)
                            for x in (r.get("begin_seq"), r.get("end_seq")) if x} |
                           {r["end_seq"] for r in self.j.records("turns", prefix)
                            if r.get("end_seq")})
            for c in calls:
                unit = call_unit(sid, c["id"])
                mine = by_unit.get(unit, [])
                begin, end = c.get("begin_seq") or c["end_seq"], c["end_seq"]
                crossed = bisect.bisect_left(marks, end) > bisect.bisect_right(marks, begin)
                if crossed or any(e["seq"] > end for e in mine) or any(
                        e.get("unit") != unit and self._counts(e)
                        for e in self._events(begin - 1, end)):
                    put(side_key("call", c["id"]), mine)
        for t in turns:
            lo, hi = t["begin_seq"], t["end_seq"]
            put(side_key("turn", t["index"]),
                [e for e in self._events(lo - 1, hi) if unit_session(e.get("unit")) == sid],
                (lo, hi))
        # the session: each path from just before the session's first change to it to just
        # after its last; spans kept in the export state, so a run reads only its new events
        spans = st.get("spans")
        since = st.get("spans_to", 0) if spans is not None else self._since.get(sid, 0)
        spans = spans or {}
        moved = {}
        for e in self._events(since, horizon):
            if unit_session(e.get("unit")) != sid:
                continue
            for p in touched(self.states, e):
                if not _visible(p):
                    continue
                cur = moved.get(p) or spans.get(p)
                span = [min(cur[0], e["seq"] - 1), max(cur[1], e["seq"])] if cur else \
                    [e["seq"] - 1, e["seq"]]
                moved[p] = span + (cur[2:] if cur else [False, False])
        drops, puts = [], []
        for p in sorted(moved):
            lo, hi, had_a, had_b = moved[p]
            now = []
            for half, point, had in (("a/", lo, had_a), ("b/", hi, had_b)):
                s = self.state(p, point)
                there = bool(p) and s.kind in ("file", "symlink") and not _refused(p, s)
                if had:
                    drops.append(b"D " + quote_path(f"session/{half}{p}"))
                if there:
                    puts.append(self._blob_line(p, s, f"session/{half}"))
                now.append(there)
            spans[p] = [lo, hi] + now
        changes += drops + puts
        st["spans"], st["spans_to"] = spans, horizon
        t_ns = max([c["end_t"] for c in calls] + [t["end_t"] for t in turns]
                   + [e["t"] for e in self._events(since, horizon)
                      if unit_session(e.get("unit")) == sid], default=0)
        who = _ident("overlayrec", "overlayrec@localhost", t_ns)
        msg = (f"session {sid}: the sides of its diffs\n\nOverlayrec-Session: {trailer_id(sid)}\n"
               f"Overlayrec-Seq: ..{horizon}\nOverlayrec-Record: {self.record}\n")
        if not st.get("sides"):
            # a root commit, whatever was there
            self.fi.reset(self._refname(self._in(sid, "sides")))
        st["sides"] = self.fi.commit(self._refname(self._in(sid, "sides")), who, who, msg,
                                     st.get("sides"), changes)


EXTRA_TRAILERS = True
