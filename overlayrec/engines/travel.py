"""Records that travel: exported refs pushed to a git remote, fetched elsewhere, and read there
from git alone (no journal, no workspace).

Layout on a remote (and in a repository that fetched them)::

    refs/overlayrec/origins/<origin>/<session>/{base,head,sides,calls/<id>,turns/<n>}

``<origin>`` names one recorded workspace on one host (``<host>-<workspace>-<random>``, kept in
its state dir; ``--origin`` names it): two workspaces never write the same refs.  The commits
are the export's (engines/export.py); the readers here take ids, tools, times and processes
from their trailers, and each diff from the session's ``sides`` tree (the two sides
``overlayrec diff`` compares) or, for a call the chain shows exactly, from its commit and parent.
"""
from __future__ import annotations

import html
import json
import os
import re
import secrets
import socket
import subprocess

from ..journal.schema import call_unit, turn_unit
from ..views import shown
from .large import LIMIT
from .export import ID_TRAILERS, from_ref_part, from_trailer_id, side_key
from .gitdiff import EMPTY_TREE, GitError, ObjectStore

ORIGINS = "refs/overlayrec/origins"
_BEFORE_LOOKS = 200  # files of a call whose before side ``Records.inexact`` looks up


def _clean(s: str) -> str:
    s = re.sub(r"\.\.+", ".", re.sub(r"[^A-Za-z0-9._-]+", "_", s)).strip("._-")
    return s or "x"


def origin_name(state_file: str, workspace: str, given: str | None = None) -> str:
    """This workspace's origin: ``given``, or the one kept in ``state_file``, else a new one
    (``<host>-<workspace basename>-<8 random hex digits>``)."""
    if given:
        # (and what git refuses in a ref's name: `..`, a name ending in `.lock`; `a..b` went
        # through and failed in git's push: found by a bug hunt)
        if _clean(given) != given or given.endswith(".lock") or ".." in given:
            raise GitError(f"origin {given!r}: use letters, digits, '.', '_' and '-' only, "
                           "no '..'")
        return given
    from ..state import read_regular
    try:  # (a fifo there hung the push: a bug hunt)
        return json.loads(read_regular(state_file))["origin"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    name = (f"{_clean(socket.gethostname())}-{_clean(os.path.basename(workspace) or 'root')}"
            f"-{secrets.token_hex(4)}")
    from ..state import write_private
    write_private(state_file, json.dumps({"origin": name}).encode())
    return name


def _user_env(git_dir: str) -> dict:
    """git as the user runs it (their config: remotes' credentials, url rewrites, ssh)."""
    return dict(os.environ, GIT_DIR=git_dir)


def _git_says(stderr: bytes) -> str:
    """git's reason, for a one-line error: its first ``fatal:`` or ``error:`` line (git adds
    advice on the lines after), else its first line."""
    lines = [ln.strip() for ln in stderr.decode(errors="replace").splitlines() if ln.strip()]
    for ln in lines:
        for tag in ("fatal: ", "error: "):
            if ln.startswith(tag):
                return ln[len(tag):]
    return lines[0] if lines else ""


def push(git_dir: str, prefix: str, remote: str, origin: str) -> dict:
    """Send every ref under ``prefix`` to ``remote`` beneath ``ORIGINS/<origin>/``: git sends
    only the objects the remote lacks and moves only the refs that changed."""
    spec = f"+{prefix.rstrip('/')}/*:{ORIGINS}/{origin}/*"
    _refuse_anothers(git_dir, prefix, remote, origin)
    r = subprocess.run(["git", "push", "--porcelain", remote, spec], capture_output=True,
                       env=_user_env(git_dir))
    out = r.stdout.decode("utf-8", "surrogateescape")
    if r.returncode != 0:
        raise GitError(f"git push to {remote} failed: {_git_says(r.stderr) or out.strip()}")
    new, updated, same = [], [], 0
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or len(parts[0]) != 1:
            continue
        dst = parts[1].split(":", 1)[-1]
        if parts[0] == "*":
            new.append(dst)
        elif parts[0] in " +":
            updated.append(dst)
        elif parts[0] == "=":
            same += 1
    return {"remote": remote, "origin": origin, "refs_prefix": f"{ORIGINS}/{origin}/",
            "new": new, "updated": updated, "up_to_date": same}


def _refuse_anothers(git_dir: str, prefix: str, remote: str, origin: str) -> None:
    """The push moves refs by force (a session's ``sides`` are made anew as it goes on): a ref
    of ``origin`` on the remote that it would move must hold a commit of this record's own
    (pushed before), not another workspace's pushed under the same ``--origin``, whose
    records it overwrote and mixed with these without a word."""
    env = _user_env(git_dir)
    r = subprocess.run(["git", "ls-remote", remote], capture_output=True, env=env)
    if r.returncode != 0:
        raise GitError(f"git ls-remote {remote} failed: {_git_says(r.stderr)}")
    theirs = {}
    for line in r.stdout.decode("utf-8", "surrogateescape").splitlines():
        sha, _, name = line.partition("\t")
        if name.startswith(f"{ORIGINS}/{origin}/"):
            theirs[name[len(f"{ORIGINS}/{origin}/"):]] = sha
    if not theirs:
        return
    r = subprocess.run(["git", "for-each-ref", "--format=%(objectname) %(refname)",
                        prefix.rstrip("/") + "/"], capture_output=True, env=env, check=True)
    moved = {}
    for line in r.stdout.decode("utf-8", "surrogateescape").splitlines():
        sha, _, name = line.partition(" ")
        rel = name[len(prefix.rstrip("/")) + 1:]
        if rel in theirs and theirs[rel] != sha:
            moved[theirs[rel]] = rel
    if not moved:
        return
    r = subprocess.run(["git", "cat-file", "--batch-check=%(objectname)"],
                       input="".join(f"{sha}\n" for sha in moved).encode(),
                       capture_output=True, env=env)
    foreign = [moved[line.split()[0]] for line in r.stdout.decode().splitlines()
               if line.endswith(" missing")]
    if foreign:
        raise GitError(f"{remote} holds records of another workspace as origin {origin!r} "
                       f"({ORIGINS}/{origin}/{foreign[0]} is no commit of this record): "
                       "name another with --origin")


def default_records_dir() -> str:
    from ..state import state_home
    return os.path.join(state_home(), "overlayrec", "records.git")


def fetch(remote: str, into: str, private: bool = False) -> dict:
    """Bring every origin's refs from ``remote`` into the bare repository ``into`` (made when
    missing); git fetches only what is new.  ``private`` (the default records dir, in
    overlayrec's state home): its files are the user's alone whatever their umask."""
    umask = 0o077 if private else -1
    if private:
        from ..state import tighten_tree
        tighten_tree(into)
    # taken away again when the fetch fails, as git clone does: the directory, or what was
    # made in it when it was there and empty (a bare repository was left in it: a bug hunt)
    made = not os.path.lexists(into)
    empty = not made and os.path.isdir(into) and not os.path.islink(into) and \
        not os.listdir(into)
    try:
        return _fetch(remote, into, umask)
    except BaseException:
        import shutil
        if made and os.path.isdir(into) and not os.path.islink(into):
            shutil.rmtree(into, ignore_errors=True)
        elif empty and not os.path.islink(into):
            for name in os.listdir(into):
                p = os.path.join(into, name)
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    os.unlink(p)
        raise


def _fetch(remote: str, into: str, umask: int) -> dict:
    if os.path.isdir(into) and os.listdir(into) and \
            not os.path.exists(os.path.join(into, "HEAD")):
        # a project's directory: a bare repository was made among its files (HEAD, config,
        # objects/, hooks/ ...), untracked files of its own repository (found by a bug hunt)
        raise GitError(f"{into} holds files and no git repository: fetch into an empty or "
                       "new directory, or a bare repository")
    if not os.path.exists(os.path.join(into, "HEAD")):
        r = subprocess.run(["git", "init", "-q", "--bare", into], capture_output=True,
                           umask=umask)
        if r.returncode != 0:
            raise GitError(f"git init {into} failed: {_git_says(r.stderr)}")
    r = subprocess.run(["git", "fetch", "--no-write-fetch-head", "--porcelain", remote,
                        f"+{ORIGINS}/*:{ORIGINS}/*"], capture_output=True, env=_user_env(into),
                       umask=umask)
    if r.returncode != 0 and b"porcelain" in r.stderr:   # a git before 2.41: no --porcelain
        r = subprocess.run(["git", "fetch", "--no-write-fetch-head", remote,
                            f"+{ORIGINS}/*:{ORIGINS}/*"], capture_output=True,
                           env=_user_env(into), umask=umask)
    if r.returncode != 0:
        raise GitError(f"git fetch from {remote} failed: {_git_says(r.stderr)}")
    recs = Records(into)
    return {"into": into, "origins": sorted({o for o, _ in recs.sessions}),
            "sessions": len(recs.sessions)}


def _lines(text: str) -> list[str]:
    """git's output cut at its newlines only (``str.splitlines`` also cuts at U+2028 and
    U+0085, which git leaves unquoted in a name)."""
    return [line for line in text.split("\n") if line]


def _trailers(message: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in message.split("\n"):
        if line.startswith("Overlayrec-") and ": " in line:
            k, v = line.split(": ", 1)
            k = k[len("Overlayrec-"):]
            out.setdefault(k, []).append(from_trailer_id(v) if k in ID_TRAILERS else v)
    return out


def _seq(t: dict) -> tuple[int, int]:
    lo, _, hi = (t.get("Seq") or [".."])[0].partition("..")
    return (int(lo) if lo else 0), (int(hi) if hi else 0)


class SelectionError(Exception):
    pass


class Records:
    """The exported records a git repository holds under ``ORIGINS``."""

    def __init__(self, git_dir: str):
        if not os.path.exists(os.path.join(git_dir, "HEAD")) and \
                not os.path.exists(os.path.join(git_dir, ".git")):
            raise GitError(f"{git_dir} is not a git repository (`overlayrec fetch` makes one)")
        self.store = ObjectStore("", git_dir=git_dir if os.path.exists(
            os.path.join(git_dir, "HEAD")) else os.path.join(git_dir, ".git"))
        refs = self.store._git("for-each-ref", "--format=%(objectname) %(refname)",
                               ORIGINS + "/").splitlines()
        names = {}
        for line in refs:
            sha, name = line.split(" ", 1)
            names[name[len(ORIGINS) + 1:]] = sha
        # (origin, session) -> its refs; a session is known by its head
        self.sessions: dict[tuple[str, str], dict] = {}
        # (the session's and the calls' parts of a ref are written by export.ref_part)
        parts = {}
        for rest in names:
            if rest.endswith("/head"):
                origin, _, part = rest[:-len("/head")].partition("/")
                if part:
                    sid = self._named(part, names[rest], "Session")
                    parts[(origin, sid)] = part
                    self.sessions[(origin, sid)] = {"head": names[rest], "calls": {},
                                                    "turns": {}}
        for (origin, sid), s in self.sessions.items():
            pre = f"{origin}/{parts[(origin, sid)]}/"
            s["base"] = names.get(pre + "base")
            s["sides"] = names.get(pre + "sides")
            for rest, sha in names.items():
                if rest.startswith(pre + "calls/"):
                    s["calls"][self._named(rest[len(pre + "calls/"):], sha, "Call")] = sha
                elif rest.startswith(pre + "turns/") and rest[len(pre + "turns/"):].isdigit():
                    s["turns"][int(rest[len(pre + "turns/"):])] = sha

    def _named(self, part: str, sha: str, trailer: str) -> str:
        """The session's or call's name a ref ``part`` stands for: as ``ref_part`` wrote it,
        or, for one cut to fit a ref (``%%`` and a hash), the whole name its commit's
        ``trailer`` holds (a call of a long id was "not in the fetched records"; a hunt)."""
        if "%%" not in part:
            return from_ref_part(part)
        said = _trailers(self.store._git("log", "-1", "--format=%B", sha)).get(trailer) or []
        return said[0] if len(said) == 1 else from_ref_part(part)

    def pick(self, origin=None, session=None, want=lambda s: True, what="records") -> tuple:
        found = [k for k, s in self.sessions.items()
                 if (origin is None or k[0] == origin) and (session is None or k[1] == session)
                 and want(s)]
        if not found:
            raise SelectionError(f"no {what} in the fetched records"
                                 + (f" of origin {origin}" if origin else "")
                                 + (f" in session {session}" if session and
                                    what != f"session {session}" else ""))
        if len(found) > 1:
            raise SelectionError(f"{what}: in several sessions ("
                                 + ", ".join(f"{o}/{s}" for o, s in sorted(found))
                                 + "): say --origin and --session")
        return found[0]

    def _side(self, sides: str | None, key: str) -> tuple[str, str] | None:
        if not sides:
            return None
        out = self.store._git("ls-tree", "-z", sides, key + "/").split("\0")
        trees = {}
        for entry in out:
            if "\t" in entry:
                meta, path = entry.split("\t", 1)
                trees[path.rsplit("/", 1)[-1]] = meta.split()[2]
        if not out or not any(out):
            return None
        return trees.get("a", EMPTY_TREE), trees.get("b", EMPTY_TREE)

    def diff(self, fmt: str = "patch", binary: bool = False, origin=None, session=None,
             call=None, turn=None) -> str:
        """What ``overlayrec diff --call/--turn/--session`` printed on the origin."""
        if call is not None:
            k = self.pick(origin, session, lambda s: call in s["calls"], f"call {call}")
            s = self.sessions[k]
            ab = self._side(s["sides"], side_key("call", call))
            if ab is None:   # the chain shows it exactly: its commit against its parent
                ab = (s["calls"][call] + "^", s["calls"][call])
        elif turn is not None:
            # turn N: the session that holds one (as `diff --turn N` picks it); last, -1 ...:
            # the one session with turns
            n = int(turn) if str(turn).isdigit() else None
            k = self.pick(origin, session, lambda s: n in s["turns"] if n is not None
                          else bool(s["turns"]), f"turn {turn}" if n is not None else "turns")
            s = self.sessions[k]
            n = self._turn_index(s, turn)
            ab = self._side(s["sides"], side_key("turn", n))
            if ab is None:
                raise SelectionError(f"turn {n} of {k[0]}/{k[1]} has no diff sides")
        else:
            k = self.pick(origin, session, what=f"session {session}" if session else "sessions")
            ab = self._side(self.sessions[k]["sides"], side_key("session", None))
            if ab is None:
                ab = (EMPTY_TREE, EMPTY_TREE)
        return self._diff_held(ab[0], ab[1], fmt, binary)

    def _diff_held(self, a: str, b: str, fmt: str, binary: bool) -> str:
        """The diff of ``a`` and ``b`` less the files past the size a patch holds on either
        side (engines.large.LIMIT), as the origin's diff leaves them out of both its trees
        (ObjectStore.trees): a call's commit holds them, and the records' diff gave them
        whole (found by a hunt: 1.7 MB where the origin printed 85 bytes)."""
        fields = self.store._git("diff-tree", "-r", "-z", "--no-renames", "--no-commit-id",
                                 "--root", a, b).split("\0")
        blobs = {path: meta.lstrip(":").split(" ")[2:4]
                 for meta, path in zip(fields[0::2], fields[1::2])}
        ids = sorted({x for pair in blobs.values() for x in pair if x.strip("0")})
        sizes = {}
        if ids:
            for line in self.store._git("cat-file", "--batch-check",
                                        input="".join(i + "\n" for i in ids).encode()
                                        ).splitlines():
                parts = line.split()
                if len(parts) == 3 and parts[2].isdigit():
                    sizes[parts[0]] = int(parts[2])
        big = {p for p, pair in blobs.items() if any(sizes.get(x, 0) > LIMIT for x in pair)}
        if not big:
            return self.store.diff(a, b, fmt, binary=binary)
        keep = sorted(set(blobs) - big)
        return self.store.diff(a, b, fmt, paths=keep, binary=binary) if keep else ""

    def inexact(self, origin=None, session=None, call=None) -> list[str]:
        """The files of a call's diff its origin could not give exactly, as git quotes them:
        those its commit names in ``Overlayrec-Inexact`` (the after side), and those the last
        earlier commit that wrote each file names so (the before side)."""
        k = self.pick(origin, session, lambda s: call in s["calls"], f"call {call}")
        commit = self.sessions[k]["calls"][call]
        said = set(_trailers(self.store._git("log", "-1", "--format=%B", commit))
                   .get("Inexact", []))
        parents = self.store._git("log", "-1", "--format=%P", commit).split()
        if not parents:
            return sorted(said)
        parent = parents[0]
        changed = [p for p in self.store._git("diff", "--name-only", "-z", "--no-renames",
                                              parent, commit).split("\0") if p]
        for p in changed[:_BEFORE_LOOKS]:  # one git process a file: the first ones only
            body = self.store._git("log", "-1", "--format=%B", parent, "--", p)
            said |= {v for v in _trailers(body).get("Inexact", []) if v == shown(p)}
        return sorted(said)

    @staticmethod
    def _turn_index(s: dict, turn) -> int:
        ns = sorted(s["turns"])
        if turn == "last":
            return ns[-1]
        n = int(turn)
        if n < 0:
            if -n > len(ns):
                raise SelectionError(f"no turn {n}: {len(ns)} exported")
            return ns[n]
        if n not in s["turns"]:
            raise SelectionError(f"no turn {n}")
        return n

    # -- the chain's commits ------------------------------------------------------------------
    def commits(self, rev: str, path: str | None = None) -> list[dict]:
        """The chain's commits from its base (oldest first), each with its trailers."""
        args = ["log", "--reverse", "--format=%x1e%H%x1f%P%x1f%an%x1f%at%x1f%B", rev]
        if path is not None:
            args += ["--", path]
        out = []
        for rec in self.store._git(*args).split("\x1e")[1:]:
            sha, parents, author, at, body = rec.split("\x1f", 4)
            t = _trailers(body)
            out.append({"sha": sha, "parent": parents.split()[0] if parents.strip() else None,
                        "author": author, "t": int(at), "subject": body.split("\n", 1)[0],
                        "trailers": t, "seq": _seq(t)})
        return out

    def _entry(self, rev: str | None, path: str) -> dict:
        if rev is None:
            return {"kind": "absent", "size": 0}
        line = self.store._git("ls-tree", "-l", "-z", rev, "--", path).split("\0")[0]
        if not line:
            return {"kind": "absent", "size": 0}
        meta = line.split("\t", 1)[0].split()
        kind = {"120000": "symlink", "040000": "dir", "160000": "commit"}.get(meta[0], "file")
        return {"kind": kind, "size": int(meta[3]) if meta[3].isdigit() else 0}

    def _in_sides(self, sides: str | None, call: str, path: str) -> bool:
        """Does ``call``'s diff, as its sides hold it, change ``path``?  True where it has no
        sides (its commit then is its diff)."""
        ab = self._side(sides, side_key("call", call))
        if ab is None:
            return True
        a, b = (self.store._git("ls-tree", "-z", tree, "--", path).split("\0")[0]
                for tree in ab)
        return a != b

    def blame(self, path: str, origin=None) -> list[dict]:
        """Each exported commit that changed ``path``, newest first, per origin: its unit
        (call, turn's end, or the units of the changes between calls), the sequence range,
        the time and the processes that wrote (commit granularity: the journal's blame is per
        event run)."""
        rows = []
        for (o, sid), s in sorted(self.sessions.items()):
            if origin is not None and o != origin:
                continue
            for c in self.commits(s["head"], path):
                if c["parent"] is None:
                    continue   # the base: the workspace before the session, not a change
                t = c["trailers"]
                processes = t.get("Actor", []) + t.get("Other-Writer", [])
                if "Call" in t and t.get("Other-Writer") and \
                        not self._in_sides(s["sides"], t["Call"][0], path):
                    # another writer's change inside the call's span: the call's sides (made
                    # since another unit wrote there) say what was the call's own
                    unit = f"other writers during call {t['Call'][0]}"
                    processes = t["Other-Writer"]
                elif "Call" in t:
                    unit = call_unit(sid, t["Call"][0])
                elif "Unit" in t:
                    unit = ", ".join(t["Unit"])
                else:
                    unit = turn_unit(sid, t.get("Turn", ["?"])[0])
                before, after = self._entry(c["parent"], path), self._entry(c["sha"], path)
                if before == after and before["kind"] == "dir":
                    continue
                rows.append({"origin": o, "session": sid, "commit": c["sha"], "unit": unit,
                             "first_seq": c["seq"][0], "last_seq": c["seq"][1],
                             "t": int((t.get("End") or [c["t"] * 10**9])[0]),
                             "subject": c["subject"], "before": before, "after": after,
                             "processes": processes})
        seen, out = set(), []
        for r in sorted(rows, key=lambda r: (r["origin"], r["last_seq"], r["first_seq"]),
                        reverse=True):
            key = (r["origin"], r["first_seq"], r["last_seq"], r["unit"])
            if key not in seen:   # an interim commit two sessions both hold
                seen.add(key)
                out.append(r)
        return out

    # -- the report -----------------------------------------------------------------------------
    def report_data(self) -> dict:
        out = []
        for (o, sid), s in sorted(self.sessions.items()):
            calls, turns, outside = [], [], []
            for c in self.commits(s["head"]):
                t = c["trailers"]
                if "Call" in t:
                    cid = t["Call"][0]
                    patch = self.diff(call=cid, origin=o, session=sid)
                    files = self.diff("name-status", call=cid, origin=o, session=sid)
                    calls.append({"id": cid, "tool": t.get("Tool", ["?"])[0],
                                  "summary": (t.get("Summary") or [""])[0],
                                  "turn": t.get("Turn", ["None"])[0],
                                  "status": t.get("Status", [""])[0],
                                  "begin_t": int(t.get("Begin", [0])[0]),
                                  "end_t": int(t.get("End", [0])[0]),
                                  "processes": t.get("Actor", []),
                                  "others": t.get("Other-Writer", []),
                                  "files": _lines(files), "diff": patch})
                elif c["parent"] and "Turn" in t and "Call" not in t:
                    n = int(t["Turn"][0])
                    turns.append({"index": n, "prompt": (t.get("Prompt") or [""])[0]
                                  or c["subject"].partition(": ")[2],
                                  "begin_t": int(t.get("Begin", [0])[0]),
                                  "end_t": int(t.get("End", [0])[0]),
                                  "files": _lines(self.diff("name-status", turn=n, origin=o,
                                                     session=sid))})
                elif c["parent"] and "Unit" in t:
                    outside.append({"units": t["Unit"], "processes": t.get("Actor", []),
                                    "t": c["t"], "seq": list(c["seq"]),
                                    "files": _lines(self.store.diff(c["parent"], c["sha"],
                                                                    "name-status"))})
            out.append({"origin": o, "session": sid, "turns": turns, "calls": calls,
                        "between": outside})
        return {"sessions": out}


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>overlayrec records</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
h2{font-size:1.1em;margin-top:1.5em} .turn{border-left:3px solid #36c;padding-left:.6em}
.call{border:1px solid #bbb;border-radius:4px;padding:.3em .5em;margin:.3em 0;cursor:pointer;
background:#f7f9ff} .between{border:1px dashed #a70;background:#fff8ec;padding:.3em .5em}
.meta{font-size:.85em;color:#555} pre{display:none;font:12px ui-monospace,monospace;
background:#fafafa;border:1px solid #ddd;padding:.5em;overflow:auto}
.call.open pre{display:block}
</style></head><body>
<h1>overlayrec: fetched records</h1>
__BODY__
<script>
for (const c of document.querySelectorAll('.call'))
  c.addEventListener('click', () => c.classList.toggle('open'));
</script></body></html>
"""


def render(data: dict) -> str:
    """A self-contained page (no network): per origin and session, each turn with its calls,
    each call's files and its diff a click away, and the changes between calls."""
    e = html.escape
    parts = []
    for s in data["sessions"]:
        parts.append(f'<h2 id="s-{e(s["origin"])}-{e(s["session"])}">{e(s["origin"])} · '
                     f'session {e(s["session"])}</h2>')
        turns = {str(t["index"]): t for t in s["turns"]}
        groups: dict[str, list] = {}
        for c in s["calls"]:
            groups.setdefault(str(c["turn"]), []).append(c)
        for key in list(turns) + [k for k in groups if k not in turns]:
            t = turns.get(key)
            parts.append('<div class="turn">' + (
                f'<div>Turn {e(key)}: {e(t["prompt"] or "")} '
                f'<span class="meta">{len(t["files"])} file(s)</span></div>' if t else
                f'<div>Calls (turn {e(key)})</div>'))
            for c in groups.get(key, []):
                parts.append(
                    f'<div class="call" id="call-{e(s["origin"])}-{e(s["session"])}-{e(c["id"])}">'
                    f'<b>{e(c["tool"])}</b> {e(c["id"])} {e(c["summary"])} '
                    f'<span class="meta">{e(c["status"])} · {len(c["files"])} file(s): '
                    f'{e(", ".join(f.split(chr(9))[-1] for f in c["files"][:5]))} · '
                    f'{e("; ".join(c["processes"][:3]))}</span>'
                    f'<pre>{e(c["diff"] or "(no change)")}</pre></div>')
            parts.append("</div>")
        for b in s["between"]:
            parts.append(f'<div class="between">between calls: {e(", ".join(b["units"]))} · '
                         f'{e(", ".join(f.split(chr(9))[-1] for f in b["files"][:5]))}</div>')
    return PAGE.replace("__BODY__", "\n".join(parts))
