"""Retention: which sessions a gc keeps, and the journal surgery that drops the others.

History is dropped as a prefix of the journal, whole sessions, oldest first: a state "after seq
S" is read from the pre-image of the next event on the path, so a hole in the middle would make
the sessions before it read the dropped changes as theirs.  A gc finds the cut C, the
``begin_seq`` of the oldest session it keeps (a session's begin is a unit boundary: every epoch
ended there, so no pre-image after C needs one before it), and then:

1. writes the cut (meta ``dropped_before``), a ``dropped`` record of each session dropped and
   the gc under way (meta ``gc``), in one transaction.  From then on every reader (the Journal
   itself) treats seq < C as gone;
2. deletes the events below C in batches, with their ``paths`` keys, ``renames`` and ``extents``
   rows and the session, turn and call records of the dropped sessions, keeping the seals that
   are still their path's latest (drift detection compares the live tree with them);
3. sweeps the content-store blobs that no remaining event, kept seal or saved revert plan names
   (only blobs older than the gc: one written since belongs to a writer), and the attic entries
   ``<journal_id>.<seq>`` below C that no remaining event names.

Each step is idempotent and the meta ``gc`` record says how far a gc got: one killed anywhere is
finished by the next gc or by the daemon at mount (``finish``).  Unmounted, the free pages of
data.mdb are then given back (``journal.store.compact``).  Always kept: the live session, pinned
sessions (table ``pins``), and the sessions a pending revert, or one that can still be
unreverted, reaches into.  The policy (``Policy``): keep the last N sessions, those active
within a duration, and a size budget for the whole record (journal pages in use, content store,
this journal's attic entries), met by dropping the oldest sessions first.

Everything here is synchronous.  ``gc_steps`` is a generator that yields between batches, so
the daemon can serve the mount between them (it runs the gc while mounted: the CLI never writes
the journal behind a running daemon); ``run_gc`` runs it to the end.  docs/retention.md has the
design and its reasons.
"""
from __future__ import annotations

import bisect
import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass

from . import state
from .journal import Journal, JournalError
from .journal.renames import RenameIndex
from .journal.schema import unit_session
from .journal.store import WRITER_LOCK, compact, decode_event, hold_lock

log = logging.getLogger(__name__)

ATTIC = ".overlayrec-attic"
BATCH = 2000        # events deleted per transaction (step 2)
SCAN_YIELD = 5000   # events read between yields (steps 2 and 3)
_HEX = re.compile(r"[0-9a-f]{32}")
# keys whose values are no blob or attic entry, however they look: a seal's ``hash`` is the
# content's digest, which names a blob only when ``blob`` says so (check.digests): taken for a
# reference, it kept a blob of the same content (a let-go revert's copy of a file still live)
# for as long as the file was unchanged, and a budget dropped every session for that room
_NOT_REFS = ("path", "path2", "source", "actor", "unit", "session", "call", "turn", "revert",
             "candidates", "chosen", "tool", "summary", "prompt", "op", "hash")
INF = float("inf")


class RetentionError(Exception):
    """A gc, pin or unpin that cannot go ahead; one line."""


# -- the policy ----------------------------------------------------------------------------------

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_TIME_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """Bytes from ``2G``, ``512M``, ``100k``, ``1.5G``, ``4096`` (K = 1024; KiB, KB, MiB ...
    too)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text or "")
    if not m:
        raise ValueError(f"{text!r} is not a size (a number with K, M, G or T)")
    n = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if not n < 1 << 62:  # also inf, from a number too long for a float
        raise ValueError(f"{text!r} is too large a size")
    return int(n)


def parse_duration(text: str) -> float:
    """Seconds from ``30d``, ``12h``, ``2w``, ``1d12h``, ``90m``, ``45s``."""
    parts = re.findall(r"([0-9]+(?:\.[0-9]+)?)([smhdw])", text or "")
    if not parts or "".join(a + b for a, b in parts) != (text or "").strip():
        raise ValueError(f"{text!r} is not a duration (e.g. 30d, 12h, 2w, 1d12h; s m h d w)")
    secs = sum(float(n) * _TIME_UNITS[u] for n, u in parts)
    if not secs < 1e11:  # some 3,000 years; also inf
        raise ValueError(f"{text!r} is too long a duration")
    return secs


@dataclass
class Policy:
    keep_last: int | None = None
    keep_within: float | None = None   # seconds
    max_bytes: int | None = None
    # done reverts no longer keep what an unrevert of them would need: the gc lets go of those
    # its cut passes (and every older one), which can then no longer be unreverted
    let_go_reverts: bool = False

    @property
    def rules(self) -> bool:
        return self.keep_last is not None or self.keep_within is not None

    def to_json(self) -> dict:
        return {"keep_last": self.keep_last, "keep_within": self.keep_within,
                "max_bytes": self.max_bytes, "let_go_reverts": self.let_go_reverts}

    @classmethod
    def from_json(cls, d: dict) -> "Policy":
        def num(k, kind):
            v = d.get(k)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{k} must be a number of 0 or more")
            return kind(v)
        let_go = d.get("let_go_reverts") or False
        if not isinstance(let_go, bool):
            raise ValueError("let_go_reverts must be true or false")
        return cls(num("keep_last", int), num("keep_within", float), num("max_bytes", int),
                   let_go)


# -- what the record holds -----------------------------------------------------------------------

def _refs(obj, blobs: set, attic: set) -> None:
    """The blob digests and attic entry names a stored event (or plan) names."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in _NOT_REFS:
                continue
            if k == "attic" and isinstance(v, str):
                attic.add(v)
            elif isinstance(v, str):
                if len(v) == 32 and _HEX.fullmatch(v):
                    blobs.add(v)
            else:
                _refs(v, blobs, attic)
    elif isinstance(obj, list):
        for v in obj:
            if isinstance(v, str):
                if len(v) == 32 and _HEX.fullmatch(v):
                    blobs.add(v)
            else:
                _refs(v, blobs, attic)


def read_plans(sd: str) -> list[dict]:
    """The saved revert records, oldest first."""
    return state.saved_reverts(sd)


@dataclass
class Sess:
    id: str
    begin_seq: int | None
    end_seq: int
    started: int | None
    ended: int | None
    calls: list
    turns: int


class Scan:
    """One pass over the record: the sessions' seq spans, where each blob and attic entry is
    last named, the bytes each event takes, the reverts' first seqs."""

    def __init__(self, j: Journal, content_root: str, attic_fd: int | None):
        self.cut = j.cut
        self.last = j.last_seq()
        begin: dict[str, int] = {}
        end: dict[str, int] = {}
        self.revert_seq: dict[str, int] = {}
        self.blob_last: dict[str, float] = {}
        self.attic_last: dict[str, float] = {}
        self.seqs: list[int] = []
        self.cum: list[int] = []
        kept_seals = {seq for _, seq in j.seals()}
        total = 0
        weights: list[tuple[float, int]] = []  # (seq, bytes) of what the journal holds
        for seq, raw in j.scan_raw(1):
            below = seq < self.cut
            if below and seq not in kept_seals:
                continue  # a gc's cut made, not yet deleted
            ev = _readable(j, seq, raw)  # or a session's begin would be missed too
            sid = ev.get("session") if ev.get("op") in ("session_begin", "session_end") \
                else unit_session(ev.get("unit"))
            if ev.get("op") == "session_begin" and sid is not None:
                begin.setdefault(sid, seq)
            if sid is not None:
                end[sid] = max(end.get(sid, 0), seq)
            if ev.get("op") == "revert_begin" and ev.get("revert"):
                self.revert_seq.setdefault(ev["revert"], seq)
            blobs: set = set()
            attic: set = set()
            _refs(ev, blobs, attic)
            at = INF if seq in kept_seals else seq
            for b in blobs:
                if self.blob_last.get(b, -1) < at:
                    self.blob_last[b] = at
            for a in attic:
                if self.attic_last.get(a, -1) < at:
                    self.attic_last[a] = at
            if not below:
                # the event, its index keys: about what it takes in the data file
                weights.append((seq, len(raw) + 16 + sum(
                    len(p) + 24 for p in (ev.get("path"), ev.get("path2")) if isinstance(p, str))))
        # the small blobs the journal holds (most of it, in a record of small edits), each
        # where it is last named: a plan that weighed the events alone said a session could
        # stay that the budget then had to drop (found by a bug hunt)
        for digest, n in j.blob_sizes():
            at = self.blob_last.get(digest, 0)
            weights.append((at, n + 16 + len(digest)))
        weights.sort(key=lambda w: w[0])
        for seq, w in weights:
            total += w
            self.seqs.append(seq)
            self.cum.append(total)
        self.total_weight = total
        self.sessions: list[Sess] = []
        counts_turns: dict[str, int] = {}
        for t in j.records("turns"):
            counts_turns[t["session"]] = counts_turns.get(t["session"], 0) + 1
        calls: dict[str, list] = {}
        for c in j.records("calls"):
            calls.setdefault(c["session"], []).append(c["id"])
        for rec in j.records("sessions"):
            sid = rec["id"]
            self.sessions.append(Sess(sid, begin.get(sid), end.get(sid, begin.get(sid, 0)),
                                      rec.get("started"), rec.get("ended"), calls.get(sid, []),
                                      counts_turns.get(sid, 0)))
        self.sessions.sort(key=lambda s: (s.begin_seq if s.begin_seq is not None else INF,
                                          s.started or 0))
        # sizes on disk
        self.blob_size = {d: st.st_blocks * 512 for d, st in _content(content_root).blobs()}
        self.attic_size: dict[str, int] = {}
        jid = j.meta("journal_id")
        self.attic_prefix = jid + "." if jid else None
        self.attic_size = _attic_charges(attic_fd, jid)
        self.pages = j.pages()

    def weight_below(self, cut: int) -> int:
        i = bisect.bisect_left(self.seqs, cut)
        return self.cum[i - 1] if i else 0

    def size_after(self, cut: int, plan_refs: set) -> dict:
        """What the record would take after a gc at ``cut`` (an estimate for the journal:
        the pages in use, less the share of the events dropped)."""
        used = self.pages["used"]
        if self.total_weight:
            used = int(used * (1 - self.weight_below(cut) / self.total_weight))
        content = sum(sz for d, sz in self.blob_size.items()
                      if d in plan_refs or self.blob_last.get(d, -1) >= cut)
        attic = sum(sz for n, sz in self.attic_size.items()
                    if self.attic_last.get(n, -1) >= cut or _entry_seq(n, self.attic_prefix) >= cut)
        return {"journal": used, "content": content, "attic": attic,
                "total": used + content + attic}


def _content(root: str):
    from .journal.content import ContentStore
    cs = ContentStore.__new__(ContentStore)
    cs.root = root
    return cs


def _entry_seq(name: str, prefix: str | None) -> float:
    if prefix and name.startswith(prefix) and name[len(prefix):].isdigit():
        return int(name[len(prefix):])
    return INF


def _attic_entries(attic_fd: int | None, prefix: str | None):
    """(name, lstat) of this journal's attic entries."""
    if attic_fd is None or not prefix:
        return
    try:
        dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=attic_fd)
    except OSError:
        return
    try:
        names = os.listdir(dfd)
    finally:
        os.close(dfd)
    for name in names:
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            try:
                yield name, os.stat(name, dir_fd=attic_fd, follow_symlinks=False)
            except OSError:
                continue


def attic_fd_of(ws: str) -> int | None:
    """An O_PATH fd of the workspace's attic (unmounted), or None when it has none."""
    try:
        return os.open(os.path.join(ws, ATTIC), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW
                       | os.O_CLOEXEC)
    except OSError:
        return None


def record_size(j: Journal, attic_fd: int | None = None) -> dict:
    """The record's bytes: journal pages in use (``journal``) and the data file's length and
    free pages, the content store, this journal's attic entries; ``total`` (what a budget
    counts) = journal + content + attic."""
    pages = j.pages()
    content = sum(st.st_blocks * 512 for _, st in _content(j.content.root).blobs())
    jid = j.meta("journal_id")
    attic = sum(_attic_charges(attic_fd, jid).values())
    return {"journal": pages["used"], "journal_file": pages["file"],
            "journal_free": pages["free"], "content": content, "attic": attic,
            "total": pages["used"] + content + attic}


def _attic_charges(attic_fd: int | None, journal_id: str | None) -> dict[str, int]:
    """What each of this journal's attic entries costs the record on disk, by name
    (``attic_costs``)."""
    if attic_fd is None or not journal_id:
        return {}
    try:
        dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=attic_fd)
    except OSError:
        return {}
    try:
        return {f"{journal_id}.{seq}": e["bytes"]
                for seq, e in attic_costs(dfd, journal_id).items()}
    finally:
        os.close(dfd)


_ATTIC_ENTRY = re.compile(r"([0-9a-f]+)\.([0-9]+)\Z")


def attic_costs(attic_fd: int, journal_id: str | None) -> dict[int, dict]:
    """This journal's attic entries by seq: ``{"bytes": charged, "size": length, "shared":
    bool, "inode": (dev, ino)}``.  An inode the workspace still links (more links than the
    attic's names of it) is shared and charged nothing; one only the attic holds is charged its
    blocks once, to its first entry.  (`storage` shows these; a budget counts them: it counted
    each name whole, and dropped sessions for bytes it could not free.)"""
    names = os.listdir(attic_fd)
    stats: dict[str, os.stat_result] = {}
    attic_links: dict[tuple[int, int], int] = {}
    for name in names:
        try:
            st = os.lstat(name, dir_fd=attic_fd)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode):
            continue
        stats[name] = st
        k = (st.st_dev, st.st_ino)
        attic_links[k] = attic_links.get(k, 0) + 1
    out: dict[int, dict] = {}
    charged: set[tuple[int, int]] = set()
    mine = []
    for name, st in stats.items():
        m = _ATTIC_ENTRY.match(name)
        if m and journal_id is not None and m.group(1) == journal_id:
            mine.append((int(m.group(2)), st))
    for seq, st in sorted(mine):
        k = (st.st_dev, st.st_ino)
        shared = st.st_nlink > attic_links[k]
        cost = 0
        if not shared and k not in charged:
            charged.add(k)
            cost = st.st_blocks * 512
        out[seq] = {"bytes": cost, "size": st.st_size, "shared": shared, "inode": k}
    return out


def reclaimable_bytes(state_dir: str) -> int:
    """The free pages of the journal's data file: what a gc run while nothing has the journal
    open gives back to the filesystem (for ``overlayrec storage``).  0 when there is no
    journal."""
    try:
        j = Journal(state_dir, readonly=True)
    except JournalError:
        return 0
    try:
        return j.pages()["free"]
    finally:
        j.close()


# -- the plan ------------------------------------------------------------------------------------

def _needs_from(r: dict, plans: dict, scan: Scan, by_id: dict, calls_of: dict,
                seen: set) -> int:
    """The first seq a revert still needs: its own events and what its selection reaches."""
    need = scan.revert_seq.get(r.get("id"), INF)
    sel = r.get("selection") or {}
    sids = set()
    if sel.get("session"):
        sids.add(sel["session"])
    if sel.get("call") is not None and not sel.get("session"):
        sids |= {sid for sid, cs in calls_of.items() if sel["call"] in cs}
    if sel.get("turn") is not None and not sel.get("session"):
        sids |= {s.id for s in scan.sessions if s.turns}
    for sid in sids:
        s = by_id.get(sid)
        if s is not None and s.begin_seq is not None:
            need = min(need, s.begin_seq)
    if sel.get("since") is not None:
        need = min(need, int(sel["since"]) + 1)
    rid = sel.get("revert_id") or r.get("unreverts")
    if rid and rid not in seen and rid in plans:
        seen.add(rid)
        need = min(need, _needs_from(plans[rid], plans, scan, by_id, calls_of, seen))
    elif rid:
        need = min(need, scan.revert_seq.get(rid, INF))
    return need


def make_plan(j: Journal, sd: str, policy: Policy, scan: Scan, *, live=(),
              now_ns: int | None = None, min_k: int = 0) -> dict:
    """Each session with drop or keep and why, the cut, and the record's size before and
    (estimated) after."""
    now_ns = now_ns or time.time_ns()
    S = scan.sessions
    n = len(S)
    by_id = {s.id: s for s in S}
    pins = j.pins()
    every = read_plans(sd)
    plans = {r["id"]: r for r in every if r.get("id")}
    calls_of = {s.id: s.calls for s in S}
    # the blobs the plans name that a revert still needs (its --continue, its unrevert),
    # whatever the cut: a plan let go, unreverted or undoable no more needs none (its blobs
    # were kept for good, and a budget dropped every session for room it could never free;
    # found by a bug hunt)
    plan_refs: set = set()
    protect: list[list[str]] = [[] for _ in S]
    needs = INF
    soft: list[tuple[str, int]] = []  # done reverts the policy may let go: (id, first seq needed)
    soft_refs: list[set] = []  # the blobs each of them names
    for r in every:
        pending = r.get("status") == "running"
        if not (pending or state.revert_undoable(r, every)):
            continue
        refs: set = set()
        _refs(r.get("steps"), refs, set())
        need = _needs_from(r, plans, scan, by_id, calls_of, {r["id"]})
        if need == INF:
            plan_refs |= refs
            continue
        if policy.let_go_reverts and not pending:
            soft.append((r["id"], need))
            soft_refs.append(refs)
            continue
        plan_refs |= refs
        needs = min(needs, need)
        why = f"pending revert {r['id']}" if pending else \
            f"revert {r['id']} can still be unreverted (gc --let-go-reverts lets it go)"
        for i, s in enumerate(S):
            if s.end_seq >= need:
                protect[i].append(why)
    for i, s in enumerate(S):
        if s.id in live:
            protect[i].insert(0, "live")
        if s.id in pins:
            protect[i].insert(0, "pinned")
        if s.begin_seq is None:
            protect[i].append("its begin is not in the record")
    policy_keep: list[list[str]] = [[] for _ in S]
    if policy.keep_last is not None:
        for i in range(max(n - policy.keep_last, 0), n):
            policy_keep[i].append(f"within policy (--keep-last {policy.keep_last})")
    if policy.keep_within is not None:
        since = now_ns - policy.keep_within * 1e9
        for i, s in enumerate(S):
            active = s.ended or now_ns
            if active >= since:
                policy_keep[i].append(f"within policy (--keep-within {_dur(policy.keep_within)})")

    def cut_at(k: int) -> int:
        if k == 0:
            return scan.cut
        if k < n:
            return S[k].begin_seq
        return max(s.end_seq for s in S) + 1

    def valid(k: int) -> str | None:
        """None when the first k sessions can go; else why not."""
        if k == 0:
            return None
        c = cut_at(k)
        for s in S[:k]:
            if s.end_seq >= c:
                return f"overlaps kept session {S[k].id if k < n else s.id}"
        if c > needs:
            return "a revert still needs it"
        return None

    def passed_at(c: int) -> int:
        """How many of the soft reverts a cut at ``c`` lets go: those it passes, and every
        one made before them (unreverts peel the newest first: one below a revert let go
        would be undone out of its order)."""
        passed = [i for i, (_, need) in enumerate(soft) if need < c]
        return passed[-1] + 1 if passed else 0

    def refs_at(c: int) -> set:
        return plan_refs.union(*soft_refs[passed_at(c):])

    def can_drop(i: int, budget: bool) -> bool:
        if protect[i] or S[i].begin_seq is None:
            return False
        if policy.rules and policy_keep[i]:
            return False
        return policy.rules or budget

    k = 0
    if policy.rules:
        for cand in range(1, n + 1):
            if not can_drop(cand - 1, False):
                break
            if valid(cand) is None:
                k = cand
    before = scan.size_after(scan.cut, refs_at(scan.cut))
    stopped = None
    if policy.max_bytes is not None:
        size_k = scan.size_after(cut_at(k), refs_at(cut_at(k)))["total"]
        cand = k
        while size_k > policy.max_bytes:
            cand += 1
            if cand > n or not can_drop(cand - 1, True):
                if cand <= n:
                    s = S[cand - 1]
                    stopped = f"stopped by session {s.id} ({', '.join(protect[cand - 1] + policy_keep[cand - 1])})"
                else:
                    stopped = "no session left to drop"
                break
            if valid(cand) is None:
                k = cand
                size_k = scan.size_after(cut_at(k), refs_at(cut_at(k)))["total"]
        cand = k
        while k < min_k and cand < n and can_drop(cand, True):
            # measured over the budget where the estimate said under: one more at least
            cand += 1
            if valid(cand) is None:
                k = cand
    cut = cut_at(k)
    after = scan.size_after(cut, refs_at(cut))
    let_go = [rid for rid, _ in soft[:passed_at(cut)]]
    rows = []
    first_kept = None
    for i, s in enumerate(S):
        row = {"session": s.id, "begin_seq": s.begin_seq, "end_seq": s.end_seq,
               "started": s.started, "ended": s.ended}
        if i < k:
            row["action"] = "drop"
            row["why"] = "over the budget" if policy_keep[i] or not policy.rules \
                else "not within policy"
        else:
            row["action"] = "keep"
            own = protect[i] + policy_keep[i]
            if own:
                row["why"] = ", ".join(own)
            elif first_kept is not None:
                row["why"] = f"newer than kept session {first_kept}"
            elif not policy.rules and policy.max_bytes is None:
                row["why"] = "no policy given"
            elif policy.max_bytes is not None and not policy.rules:
                row["why"] = "the record fits the budget without it" if not stopped \
                    else f"over the budget but {stopped}"
            else:
                row["why"] = valid(i + 1) or "kept"
            if first_kept is None:
                first_kept = s.id
        rows.append(row)
    return {"cut": cut, "record_starts": scan.cut or 1, "sessions": rows,
            "dropped": [r["session"] for r in rows if r["action"] == "drop"],
            "size_before": before, "size_after_estimate": after,
            "budget": policy.max_bytes, "over_budget": stopped if policy.max_bytes is not None
            and after["total"] > policy.max_bytes else None,
            "let_go": let_go, "policy": policy.to_json(), "_plan_refs": refs_at(cut)}


def _dur(sec: float) -> str:
    for u, n in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if sec >= n and sec % n == 0:
            return f"{int(sec // n)}{u}"
    return f"{sec:g}s"


# -- the gc --------------------------------------------------------------------------------------

def _stale_seals(j: Journal, cut: int) -> list[str]:
    """The paths whose latest seal lies below ``cut`` but no longer ends their chain: a later
    event on the path, or a directory rename of an ancestor, also below the cut (both about
    to be dropped).  Their ``seals`` entries go with the cut; otherwise the path would read
    as still holding what was sealed (a directory renamed away would come back)."""
    renames = RenameIndex([r for r in j.dir_renames() if r["seq"] < cut])
    out = []
    for path, s in j.seals():
        if s >= cut:
            continue
        last = j.last_seq_for_path(path)
        if last is not None and s < last < cut:
            out.append(path)
            continue
        if renames.touching(path, renames.upto(s), len(renames.seqs)) is not None:
            out.append(path)
    return out


def _fault(point: str) -> None:
    """Tests: OVERLAYREC_TEST_GC_KILL=<point> kills this process there (kill -9 mid-gc)."""
    if os.environ.get("OVERLAYREC_TEST_GC_KILL") == point:
        os.kill(os.getpid(), 9)


def _gc_meta(j: Journal) -> dict | None:
    raw = j.meta("gc")
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


def finish(j: Journal, sd: str, attic_fd: int | None, out: dict, drop_attic=None):
    """Steps 2 and 3 of the gc the meta ``gc`` record says is under way (a generator: yields
    between batches)."""
    g = _gc_meta(j)
    if g is None:
        return
    cut = int(g["cut"])
    if g.get("step", 2) <= 2:
        start, batch = 1, int(os.environ.get("OVERLAYREC_TEST_GC_BATCH", BATCH))
        # the latest seals below the cut now: no seal below it becomes one later (new events
        # lie above it), so these stay, and any other event below it goes
        kept = {seq for _, seq in j.seals() if seq < cut}
        deleted = 0
        while start is not None:
            nxt = j.delete_below(cut, kept, start, batch)
            deleted += batch if nxt is not None else 0
            start = nxt
            if nxt is not None:
                _fault("mid-delete")
            yield
        j.delete_session_records([d["id"] for d in j.dropped_sessions()])
        g["step"] = 3
        j.put_meta("gc", json.dumps(g))
        _fault("after-delete")
        yield
    swept = yield from _sweep(j, sd, attic_fd, int(g["t"]), drop_attic)
    out.setdefault("swept", {"blobs": 0, "blob_bytes": 0, "attic": 0, "attic_bytes": 0})
    for k, v in swept.items():
        out["swept"][k] += v
    j.put_meta("gc", "")


def _readable(j: Journal, seq: int, raw: bytes) -> dict:
    """Event ``seq`` decoded, or RetentionError: an event not read could name the only copy
    of a pre-image, which the sweep would then take for named by nothing."""
    ev, why = decode_event(seq, raw)
    if why is not None:
        raise RetentionError(f"journal in {j.state_dir} is corrupt: event {seq} {why}: a gc "
                             "drops nothing from a record it cannot read whole (overlayrec "
                             "check says what is wrong)")
    return ev


def _sweep(j: Journal, sd: str, attic_fd: int | None, before_ns: int, drop_attic=None):
    """Step 3: the blobs and attic entries nothing kept names."""
    blobs: set = set()
    attic: set = set()
    actors: set = set()  # the processes kept events name
    cut = j.cut
    high = 0
    n = 0
    for seq, raw in j.scan_raw(cut):
        high = seq
        ev = _readable(j, seq, raw)
        _refs(ev, blobs, attic)
        actors.add(ev.get("actor"))
        n += 1
        if n % SCAN_YIELD == 0:
            yield
    for path, seq in j.seals():
        if seq < cut:
            ev = j.event(seq)
            if ev is not None:
                _refs(ev, blobs, attic)
                actors.add(ev.get("actor"))
    _fault("mid-sweep")
    # from here to the end nothing yields: what the daemon journaled meanwhile is read now
    for seq, raw in j.scan_raw(high + 1):
        ev = _readable(j, seq, raw)
        _refs(ev, blobs, attic)
        actors.add(ev.get("actor"))
    every = read_plans(sd)
    for r in every:  # what a revert still needs (make_plan's plan_refs): not one let go
        if r.get("status") == "running" or state.revert_undoable(r, every):
            _refs(r.get("steps"), blobs, attic)
    _drop_actors(j, actors)
    nb, bb = j.content.sweep(blobs, before_ns)
    na = ba = 0
    jid = j.meta("journal_id")
    for name, st in list(_attic_entries(attic_fd, jid + "." if jid else None)):
        if name in attic or int(name[len(jid) + 1:]) >= cut:
            continue
        try:
            # its blocks are freed with its last name only (a name the workspace or another
            # attic entry still links frees nothing: it was counted as freed)
            last = os.stat(name, dir_fd=attic_fd, follow_symlinks=False).st_nlink == 1
            if drop_attic is not None:
                drop_attic(name, st)
            else:
                os.unlink(name, dir_fd=attic_fd)
        except OSError:
            continue
        na += 1
        ba += st.st_blocks * 512 if last else 0
    if na:
        log.info("gc: %d attic entries below seq %d removed", na, cut)
    return {"blobs": nb, "blob_bytes": bb, "attic": na, "attic_bytes": ba}


_ACTOR_KEY = re.compile(r"\d+:\d+")


def _drop_actors(j: Journal, named: set) -> int:
    """The process rows (``actors``) that no kept event, session, turn or call names, of
    processes that have exited (a live one may write again, its row known to the daemon):
    a gc dropped every event and kept every row, one a process, so a record of many short
    commands never shrank below them and a budget could not be met."""
    for db in ("sessions", "turns", "calls"):
        for rec in j.records(db):
            for v in rec.values():
                for x in (v if isinstance(v, list) else [v]):
                    if isinstance(x, str) and _ACTOR_KEY.fullmatch(x):
                        named.add(x)
    from .attribution import alive
    gone = [key for key in j.actor_keys()
            if key not in named and _ACTOR_KEY.fullmatch(key) and not alive(key)]
    j.delete_actors(gone)
    return len(gone)


def gc_steps(j: Journal, sd: str, policy: Policy, out: dict, *, live=(), attic_fd=None,
             dry_run: bool = False, drop_attic=None):
    """A whole gc as a generator (yields between batches): finish an interrupted one, plan,
    cut (step 1), delete (2), sweep (3); with a budget, again while the record is over it and
    a session can still go.  ``out`` gets the plan and what was done."""
    if dry_run:
        yield from _gc_rounds(j, sd, policy, out, live, attic_fd, dry_run, drop_attic)
        return
    held = _no_revert_under_way(sd)
    try:
        yield from finish(j, sd, attic_fd, out, drop_attic)
        yield from _gc_rounds(j, sd, policy, out, live, attic_fd, dry_run, drop_attic)
    finally:
        if held is not None:
            os.close(held)


def _no_revert_under_way(sd: str) -> int | None:
    """Hold the state dir's revert lock (reverts.one_at_a_time) for a gc: a revert being
    planned or carried out reaches into sessions its saved plan does not name yet, and a gc
    then dropped them and swept the blobs the plan was about to name (`revert --continue`
    could never finish: "No such file").  RetentionError while one is under way; None when
    the lock cannot be made (a state dir this user may not write: no revert runs there)."""
    try:
        fd = state.hold_revert_lock(sd)
    except OSError:
        return None
    if fd is None:
        raise RetentionError("a revert or unrevert of this workspace is under way: gc once it "
                             "is done (nothing dropped)")
    return fd


def _gc_rounds(j: Journal, sd: str, policy: Policy, out: dict, live, attic_fd, dry_run: bool,
               drop_attic):
    """gc_steps' plan, cut, delete and sweep, again while a budget asks."""
    rounds = 0
    dropped: list[str] = []
    while True:
        scan = Scan(j, j.content.root, attic_fd)
        p = make_plan(j, sd, policy, scan, live=live, min_k=1 if rounds else 0)
        p.pop("_plan_refs", None)
        if rounds == 0:
            out.update(p)
        if dry_run:
            return
        drop = [r for r in p["sessions"] if r["action"] == "drop"]
        if rounds:  # the first round's table says what each later round dropped too
            again = {r["session"]: r for r in drop}
            kept = {r["session"]: r for r in p["sessions"] if r["action"] == "keep"}
            for row in out["sessions"]:
                if row["session"] in again and row["action"] != "drop":
                    row.update(action="drop", why=again[row["session"]]["why"] +
                               " (measured after the sessions before it went)")
                elif row["session"] in kept:
                    # and why each kept one is kept now ("newer than kept session s3" was
                    # left where this round dropped s3: found by a bug hunt)
                    row["why"] = kept[row["session"]]["why"]
        now = time.time_ns()
        if p["let_go"]:  # before the cut: no unrevert may start from what it drops
            _let_go(sd, p["let_go"], p["cut"], now)
            out.setdefault("let_go", [])
            out["let_go"] += [r for r in p["let_go"] if r not in out["let_go"]]
        if drop:
            by_id = {s.id: s for s in scan.sessions}
            records = [{"id": r["session"], "dropped_t": now, "why": r["why"],
                        "begin_seq": r["begin_seq"], "end_seq": r["end_seq"],
                        "started": r["started"], "ended": r["ended"],
                        "calls": by_id[r["session"]].calls[:1000],
                        "turns": by_id[r["session"]].turns} for r in drop]
            j.set_cut(p["cut"], records, {"cut": p["cut"], "step": 2, "t": now},
                      _stale_seals(j, p["cut"]))
            dropped += [r["session"] for r in drop]
            log.info("gc: dropped session(s) %s (%s); the record starts at seq %d",
                     ", ".join(r["session"] for r in drop),
                     "; ".join(sorted({r["why"] for r in drop})), p["cut"])
            _fault("after-cut")
        else:
            # nothing to drop; below the cut still, a seal may have been superseded since the
            # last gc (its path sealed anew above the cut): step 2 takes such seals away
            j.put_meta("gc", json.dumps({"cut": j.cut, "step": 2 if j.cut > 1 else 3,
                                         "t": now}))
        yield
        yield from finish(j, sd, attic_fd, out, drop_attic)
        rounds += 1
        if not drop or policy.max_bytes is None or rounds > 50:
            break
        if record_size(j, attic_fd)["total"] <= policy.max_bytes:
            break
        # over the budget still (the estimate was short): one more round drops one more
    out["dropped"] = dropped
    out["cut"] = j.cut
    out["record_starts"] = max(j.cut, 1)
    out["size_after"] = record_size(j, attic_fd)
    if policy.max_bytes is not None and out["size_after"]["total"] > policy.max_bytes:
        out["over_budget"] = out.get("over_budget") or "no session left that may be dropped"
    elif policy.max_bytes is not None:
        out["over_budget"] = None
    j.put_meta("gc_last", json.dumps({"t": time.time_ns(), "dropped": dropped, "cut": j.cut,
                                      "swept": out.get("swept")}))


# -- the private git store: what only the dropped sessions' exports and diffs kept ------------

EXPORT_REFS = "refs/overlayrec/"


def _git_env(git_dir: str) -> dict:
    return dict(os.environ, GIT_DIR=git_dir, GIT_CONFIG_NOSYSTEM="1",
                GIT_CONFIG_GLOBAL=os.devnull)


def gone_sessions(j: Journal) -> list[str]:
    """The sessions gcs dropped whose names no session of the record has (forget_exports)."""
    held = {r["id"] for r in j.records("sessions")}
    return [d["id"] for d in j.dropped_sessions() if d.get("id") not in held]


def forget_exports(sd: str, dropped: list[str], since_ns: int, *, pruned: bool = True,
                   wait: bool = True) -> dict:
    """After a gc: the private git store (``git/``) forgets the sessions gcs dropped
    (``dropped``: gone_sessions).  Their export refs (the commits' ``Overlayrec-Session``
    trailer names them) are deleted and each export state file (``export-*.json``) forgets
    them; then, when some were deleted or ``pruned`` (this gc dropped sessions), git's own gc
    prunes what no ref names any more and was written before the gc began (``since_ns``: a
    reader writing its diff's objects meanwhile keeps them): those sessions' commits and the
    blobs diffs wrote.  The store kept every dropped session's content for good (found by a
    bug hunt).  ``wait`` False (the daemon): git's gc is left running on its own."""
    import subprocess
    git_dir = os.path.join(sd, "git")
    for name in sorted(os.listdir(sd)):
        if not (name.startswith("export-") and name.endswith(".json")) or \
                name.endswith(".live.json"):
            continue
        path = os.path.join(sd, name)
        try:
            with open(path) as f:
                done = json.load(f)
        except (OSError, ValueError):
            continue
        sessions = done.get("sessions") if isinstance(done, dict) else None
        if isinstance(sessions, dict) and set(sessions) & set(dropped):
            for sid in dropped:
                sessions.pop(sid, None)
            state.replace_private(path, json.dumps(done).encode())
    out = {"refs": 0, "bytes_before": None, "bytes_after": None}
    if not (dropped or pruned) or not os.path.exists(os.path.join(git_dir, "HEAD")):
        return out
    env = _git_env(git_dir)
    old_umask = os.umask(0o077)  # the store stays the user's alone (docs/storage.md)
    try:
        listed = subprocess.run(
            ["git", "for-each-ref", "--format=%(refname)%00%(trailers:key=Overlayrec-Session,"
             "valueonly,separator=%x00)", EXPORT_REFS], env=env, capture_output=True,
            cwd="/", timeout=300)
        if listed.returncode != 0:
            log.warning("gc: the export refs could not be listed: %s",
                        listed.stderr.decode(errors="replace").strip())
            return out
        gone = set(dropped)
        refs = [] if not gone else [fields[0] for line in listed.stdout.decode("utf-8", "surrogateescape")
                .splitlines() if len(fields := line.split("\0")) > 1 and fields[1] in gone]
        if refs:
            subprocess.run(["git", "update-ref", "--stdin"], env=env, cwd="/", timeout=300,
                           input="".join(f"delete {r}\n" for r in refs).encode(
                               "utf-8", "surrogateescape"), capture_output=True, check=True)
        out["refs"] = len(refs)
        if not (refs or pruned):
            return out
        prune = ["git", "-c", "gc.autoDetach=false", "gc", "--quiet",
                 f"--prune=@{since_ns // 10**9}"]
        if not wait:  # its own process, not the daemon's child: nothing left to reap
            subprocess.Popen(prune, env=env, cwd="/", stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
            return out
        out["bytes_before"] = state.tree_bytes(git_dir)[0]
        r = subprocess.run(prune, env=env, cwd="/", capture_output=True, timeout=3600)
        if r.returncode != 0:
            log.warning("gc: git gc of the private store failed: %s",
                        r.stderr.decode(errors="replace").strip())
        out["bytes_after"] = state.tree_bytes(git_dir)[0]
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("gc: the private git store was not pruned: %s", e)
    finally:
        os.umask(old_umask)
    return out


def _let_go(sd: str, ids: list[str], cut: int, now: int) -> None:
    """Mark these done reverts let go (state.revert_undoable: no unrevert undoes them any
    more), before the cut drops what an unrevert of them would read."""
    for r in read_plans(sd):
        if r.get("id") in ids and not r.get("let_go"):
            r["let_go"] = {"t": now, "cut": cut}
            state.save_revert(sd, r)
    log.info("gc: let go of revert(s) %s: they can no longer be unreverted (the record "
             "starts at seq %d)", ", ".join(ids), cut)


def run_gc(j: Journal, sd: str, policy: Policy, **kw) -> dict:
    """``gc_steps`` run to its end; the result."""
    out: dict = {}
    for _ in gc_steps(j, sd, policy, out, **kw):
        pass
    return out


def gc_unmounted(ws: str, sd: str, policy: Policy, dry_run: bool = False) -> dict:
    """The CLI's gc while nothing is mounted: the journal opened for writing here (the writer
    lock taken: a daemon starting meanwhile waits), then its free pages given back."""
    journal_dir = state.StateDir(sd).journal
    if not os.path.exists(os.path.join(journal_dir, "data.mdb")):
        raise RetentionError(f"no journal in {sd}")
    attic_fd = attic_fd_of(ws)
    try:
        if dry_run:
            j = Journal(sd, readonly=True)
            try:
                return run_gc(j, sd, policy, attic_fd=attic_fd, dry_run=True)
            finally:
                j.close()
        began = time.time_ns()
        lock = writer_lock(sd)
        try:
            j = Journal(sd)
            try:
                out = run_gc(j, sd, policy, attic_fd=attic_fd)
                gone = gone_sessions(j)
            finally:
                j.close()
            _fault("before-compact")
            out["compaction"] = compact(sd)
        finally:
            os.close(lock)
        out["exports"] = forget_exports(sd, gone, began, pruned=bool(out.get("dropped")))
        if out["compaction"].get("compacted"):
            j = Journal(sd, readonly=True)
            try:
                out["size_after"] = record_size(j, attic_fd)
            finally:
                j.close()
        return out
    finally:
        if attic_fd is not None:
            os.close(attic_fd)


def writer_lock(sd: str, wait: float = 0.0) -> int:
    """Hold the journal's writer lock (the daemon holds it while mounted)."""
    journal_dir = state.private_dir(state.StateDir(sd).journal)
    try:
        fd = hold_lock(journal_dir, WRITER_LOCK, shared=False, wait=wait)
    except JournalError:
        raise RetentionError("another process writes the journal (its daemon is running, or "
                             "another gc): nothing done") from None
    if fd is None:
        raise RetentionError(f"cannot open the journal's lock in {journal_dir}")
    return fd


def set_pin(j: Journal, sid: str, pinned: bool) -> str:
    """Pin or unpin a recorded session; a one-line answer."""
    if pinned:
        if j.record("sessions", sid.encode("utf-8", "surrogateescape")) is None:
            # a name the record keeps as another session's alias leads to it, as the readers'
            # --session does (a session begun by the name of one a gc dropped: NAME.2)
            named = [s["id"] for s in j.records("sessions") if sid in (s.get("aliases") or ())]
            if len(named) != 1:
                gone = j.dropped_session(sid)
                raise RetentionError(dropped_session_message(gone) if gone else
                                     f"no session {sid}")
            sid = named[0]
        j.set_pin(sid, True)
        return f"pinned session {sid}: no gc drops it (overlayrec unpin {sid} to release it)"
    if sid not in j.pins():
        raise RetentionError(f"session {sid} is not pinned")
    j.set_pin(sid, False)
    return f"unpinned session {sid}"


# -- refusing what was dropped -------------------------------------------------------------------

def _date(ns: int | None) -> str:
    return time.strftime("%Y-%m-%d", time.localtime((ns or 0) / 1e9))


def dropped_session_message(rec: dict) -> str:
    return f"session {rec['id']} was dropped by retention on {_date(rec.get('dropped_t'))}"


def dropped_point(j: Journal, point: int) -> str | None:
    """Why the state after seq ``point`` cannot be had (dropped), or None.  The record starts
    at the cut C: the state after C - 1 is its first."""
    if j.cut > 1 and point < j.cut - 1:
        return f"seq {point} was dropped by retention (the record starts at seq {j.cut})"
    return None


def dropped_selection(j: Journal, *, call=None, turn=None, session=None, since=None,
                      until=None, revert_id=None) -> str | None:
    """Why a selection (diff, revert) reaches into what retention dropped, or None."""
    if not j.cut:
        return None
    if session is not None and j.record("sessions", session.encode("utf-8",
                                                                   "surrogateescape")) is None:
        rec = j.dropped_session(session)
        if rec is not None:
            return dropped_session_message(rec)
    if call is not None and not any(c["id"] == call and (session is None or
                                                         c["session"] == session)
                                    for c in j.records("calls")):
        for rec in j.dropped_sessions():
            if call in (rec.get("calls") or []) and (session is None or rec["id"] == session):
                return f"call {call} of session {rec['id']} was dropped by retention on " \
                       f"{_date(rec.get('dropped_t'))}"
    if turn is not None and session is None and not j.records("turns"):
        # (a record that never had a turn says so, as before any gc: found by a bug hunt)
        if any(r.get("turns") for r in j.dropped_sessions()):
            return "the turns recorded were dropped by retention (the record starts at seq " \
                   f"{j.cut})"
    for p in (since, until):
        if p is not None:
            why = dropped_point(j, int(p))
            if why:
                return why
    if revert_id is not None:
        for seq, raw in j.scan_raw(j.cut):
            ev, why = decode_event(seq, raw)
            if why is not None:
                raise JournalError(f"journal in {j.state_dir} is corrupt: event {seq} {why}")
            if ev.get("op") == "revert_begin" and ev.get("revert") == revert_id:
                return None
        return f"revert {revert_id} was dropped by retention (the record starts at seq {j.cut})"
    return None
