"""The journal as real git commits.

Per session, a chain of commits: for each call, in the order calls ended, one commit whose tree
is the recorded paths as they stood at the call's end and whose parent is the chain's previous
commit; when something changed between two calls (the agent's own edits, another process), an
interim commit for it comes first; at each turn's end a commit (possibly empty) marks the
turn.  So a call's commit, diffed against its parent, is what happened during that call.

A commit's tree holds every path recorded up to the export (files and symlinks; directories are
implied; fifos and devices cannot be stored in git), each as it stood at the commit's point:
`git diff A B` between two commits of one export shows exactly what `overlayrec diff` shows
between the same two points.  Export is incremental: what a run exported is remembered in the
state dir and a later run only adds commits for calls and turns that ended since; paths first
recorded after an earlier run appear in the new commits only (docs/export.md).

Messages carry the facts as trailers; refs live under ``refs/overlayrec/<session>/``.
"""
from __future__ import annotations

import json
import os
import tempfile

from ..journal import Journal
from .diff import file_events, touched, _visible
from .gitdiff import ObjectStore, git_refuses
from .states import States


def _ident(name: str, email: str, t_ns: int) -> dict:
    return {"name": name, "email": email, "date": f"{t_ns // 10**9} +0000"}


class Exporter:
    def __init__(self, j: Journal, states: States, store: ObjectStore, state_file: str,
                 ref_prefix: str = "refs/overlayrec"):
        self.j = j
        self.states = states
        self.store = store
        self.state_file = state_file
        self.prefix = ref_prefix.rstrip("/")
        try:
            with open(state_file) as f:
                self.done = json.load(f)
        except (OSError, ValueError):
            self.done = {"horizon": 0, "paths": [], "sessions": {}}
        self.written = 0

    def _git(self, *args, input=None, env=None) -> str:
        return self.store._git(*args, input=input, env=env)

    def run(self, progress=None) -> dict:
        horizon = self.j.last_seq()
        paths = {p for p in self.done["paths"] if not git_refuses(p)}
        refused = set()   # .git/ paths: git holds none, they are counted and left out
        for p in self.states.all_names():  # path history: names beneath renamed dirs too
            if _visible(p):
                (refused if git_refuses(p) else paths).add(p)
        paths = sorted(paths)
        new = {p for e in file_events(self.j, self.done["horizon"] + 1, horizon)
               for p in (e.get("path"), e.get("path2")) if p in refused}
        left_out = sum(1 for p in new if not self.states.state(p, self.done["horizon"]).same(
            self.states.state(p, horizon)))
        calls = self.j.records("calls")
        turns = self.j.records("turns")
        sessions = sorted({c["session"] for c in calls} | {t["session"] for t in turns})
        for sid in sessions:
            self._session(sid, [c for c in calls if c["session"] == sid and c.get("end_seq")],
                          [t for t in turns if t["session"] == sid and t.get("end_seq")],
                          paths, progress)
        self.done["horizon"] = horizon
        self.done["paths"] = paths
        tmp = self.state_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.done, f)
        os.replace(tmp, self.state_file)
        return {"commits": self.written, "sessions": len(sessions), "paths": len(paths),
                "git_left_out": left_out}

    def _session(self, sid: str, calls: list[dict], turns: list[dict], paths: list[str],
                 progress) -> None:
        st = self.done["sessions"].setdefault(sid, {"head": None, "point": 0, "calls": {},
                                                    "turns": {}})
        points = []
        for c in calls:
            if c["id"] not in st["calls"]:
                points.append((c["end_seq"], 1, "call", c))
        for t in turns:
            if str(t["index"]) not in st["turns"]:
                points.append((t["end_seq"], 2, "turn", t))
        points.sort(key=lambda p: (p[0], p[1]))
        if not points:
            return
        with tempfile.TemporaryDirectory(prefix="overlayrec-export-") as tmp:
            index = os.path.join(tmp, "index")
            env = dict(self.store.env, GIT_INDEX_FILE=index)
            if st["head"]:
                self._git("read-tree", st["head"], env=env)
            point = st["point"]
            if not st["head"]:
                first = points[0][3]
                point = max(0, (first.get("begin_seq") or points[0][0]) - 1)
            have = set(self._git("ls-files", "-z", env=env).split("\0")) if st["head"] else set()
            fill = [p for p in paths if p not in have]
            self._update(fill, point, env)
            if not st["head"]:
                # the session's base: the workspace as it stood before its first call (the
                # recorded paths rolled back, every other file as it is: nothing changed it)
                self._fill_unrecorded(paths, env)
                msg = (f"session {sid}: the workspace before it\n\n"
                       f"Overlayrec-Session: {sid}\nOverlayrec-Seq: ..{point}\n")
                t0 = points[0][3].get("begin_t") or 0
                st["head"] = self._commit(sid, st, env, _ident(f"agent (session {sid})",
                                                               "agent@overlayrec.invalid", t0),
                                          msg, t0)
                self._ref(f"{sid}/base", st["head"])
            for n, (seq, _, kind, rec) in enumerate(points):
                if kind == "call":
                    begin = rec.get("begin_seq") or seq
                    if begin - 1 > point and self._changed(point, begin - 1):
                        self._commit_interim(sid, st, point, begin - 1, paths, env)
                        point = begin - 1
                    self._advance(point, seq, paths, env)
                    st["head"] = self._commit(sid, st, env, *self._call_message(sid, rec, point, seq))
                    st["calls"][rec["id"]] = st["head"]
                    self._ref(f"{sid}/calls/{rec['id']}", st["head"])
                else:
                    if seq > point and self._changed(point, seq):
                        self._advance(point, seq, paths, env)
                    st["head"] = self._commit(sid, st, env, *self._turn_message(sid, rec, point, seq))
                    st["turns"][str(rec["index"])] = st["head"]
                    self._ref(f"{sid}/turns/{rec['index']}", st["head"])
                point = seq
                st["point"] = point
                if progress:
                    progress(sid, n + 1, len(points))
            self._ref(f"{sid}/head", st["head"])

    # -- trees ----------------------------------------------------------------------------------
    def _fill_unrecorded(self, paths: list[str], env, batch: int = 2000) -> None:
        """Add every file and symlink of the live tree the record never touched (so a commit
        holds the whole workspace, not only what changed), in batches."""
        known = set(paths)
        tree = self.states.tree
        rest = [p for p in tree.walk("", skip={".git"})
                if p not in known and _visible(p) and not git_refuses(p)]
        for i in range(0, len(rest), batch):
            states = {}
            for p in rest[i:i + batch]:
                s = tree.state(p)
                if s.kind in ("file", "symlink"):
                    states[p] = s
            self.store.update_index(self.store.index_lines(states), env)

    def _changed(self, lo: int, hi: int) -> bool:
        return any(_visible(p) and not git_refuses(p) for e in file_events(self.j, lo + 1, hi)
                   for p in (e.get("path"), e.get("path2")) if p is not None)

    def _touched(self, lo: int, hi: int) -> list[str]:
        out = set()
        for e in file_events(self.j, lo + 1, hi):
            for p in touched(self.states, e):
                if _visible(p):
                    out.add(p)
        return sorted(out)

    def _advance(self, lo: int, hi: int, paths: list[str], env) -> None:
        known = set(paths)
        self._update([p for p in self._touched(lo, hi) if p in known], hi, env)

    def _update(self, paths: list[str], point: int, env) -> None:
        if paths:
            states = {p: self.states.state(p, point) for p in paths}
            self.store.update_index(self.store.index_lines(states), env)

    # -- commits --------------------------------------------------------------------------------
    def _commit(self, sid, st, env, author: dict, message: str, t_ns: int) -> str:
        tree = self._git("write-tree", env=env).strip()
        cenv = dict(self.store.env, GIT_AUTHOR_NAME=author["name"],
                    GIT_AUTHOR_EMAIL=author["email"], GIT_AUTHOR_DATE=author["date"],
                    GIT_COMMITTER_NAME="overlayrec", GIT_COMMITTER_EMAIL="overlayrec@localhost",
                    GIT_COMMITTER_DATE=f"{t_ns // 10**9} +0000")
        args = ["commit-tree", tree]
        if st["head"]:
            args += ["-p", st["head"]]
        sha = self._git(*args, input=message.encode("utf-8", "surrogateescape"), env=cenv).strip()
        self.written += 1
        return sha

    def _ref(self, name: str, sha: str) -> None:
        self._git("update-ref", f"{self.prefix}/{name}", sha)

    def _actors(self, lo: int, hi: int, unit: str | None) -> list[str]:
        out = []
        for e in file_events(self.j, lo + 1, hi):
            if unit is not None and e.get("unit") != unit:
                continue
            a = self.j.actor(e["actor"]) or {}
            line = f"{a.get('pid', '?')} {' '.join(a.get('argv') or [])[:120]}"
            if line not in out:
                out.append(line)
        return out

    def _call_message(self, sid: str, c: dict, lo: int, hi: int):
        unit = f"call:{sid}:{c['id']}"
        subject = f"{c['tool']}: {c.get('summary') or c['id']}".splitlines()[0][:72]
        trailers = [("Overlayrec-Call", c["id"]), ("Overlayrec-Tool", c["tool"]),
                    ("Overlayrec-Turn", str(c.get("turn"))), ("Overlayrec-Session", sid),
                    ("Overlayrec-Seq", f"{lo + 1}..{hi}"), ("Overlayrec-Status", str(c.get("status"))),
                    ("Overlayrec-Begin", str(c["begin_t"])), ("Overlayrec-End", str(c["end_t"]))]
        trailers += [("Overlayrec-Actor", a) for a in self._actors(lo, hi, unit)]
        others = [a for a in self._actors(lo, hi, None) if a not in self._actors(lo, hi, unit)]
        trailers += [("Overlayrec-Other-Writer", a) for a in others]
        msg = subject + "\n\n" + "\n".join(f"{k}: {v}" for k, v in trailers) + "\n"
        author = _ident(f"agent (session {sid})", "agent@overlayrec.invalid", c["end_t"])
        return author, msg, c["end_t"]

    def _turn_message(self, sid: str, t: dict, lo: int, hi: int):
        prompt = (t.get("prompt") or "").splitlines()
        subject = f"turn {t['index']} ends" + (f": {prompt[0]}" if prompt else "")
        trailers = [("Overlayrec-Turn", str(t["index"])), ("Overlayrec-Session", sid),
                    ("Overlayrec-Seq", f"{t['begin_seq']}..{hi}"),
                    ("Overlayrec-Begin", str(t["begin_t"])), ("Overlayrec-End", str(t["end_t"]))]
        msg = subject[:72] + "\n\n" + "\n".join(f"{k}: {v}" for k, v in trailers) + "\n"
        return _ident(f"agent (session {sid})", "agent@overlayrec.invalid", t["end_t"]), msg, \
            t["end_t"]

    def _commit_interim(self, sid, st, lo, hi, paths, env) -> None:
        self._advance(lo, hi, paths, env)
        units = sorted({e.get("unit") or "" for e in file_events(self.j, lo + 1, hi)})
        outside = all(u.startswith("outside:") for u in units)
        actors = self._actors(lo, hi, None)
        t_ns = max((e["t"] for e in file_events(self.j, lo + 1, hi)), default=0)
        who = ("outside process" if outside else f"agent (session {sid})")
        msg = (f"changes between calls by {'outside processes' if outside else 'the agent'}\n\n"
               + "\n".join([f"Overlayrec-Session: {sid}", f"Overlayrec-Seq: {lo + 1}..{hi}"]
                           + [f"Overlayrec-Unit: {u}" for u in units]
                           + [f"Overlayrec-Actor: {a}" for a in actors]) + "\n")
        email = "outside@overlayrec.invalid" if outside else "agent@overlayrec.invalid"
        st["head"] = self._commit(sid, st, env, _ident(who, email, t_ns), msg, t_ns)
