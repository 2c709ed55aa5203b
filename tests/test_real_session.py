"""Issue 12's acceptance test, on a real source tree.

click's released sdist (a pinned version from PyPI by pip, checked against PyPI's sha256 and
cached outside the repository, in $OVERLAYREC_TEST_CACHE or ~/.cache/overlayrec-tests; without a
network, or with OVERLAYREC_TEST_OFFLINE=1, the click installed beside overlayrec with a tests/
made of its own modules: never a skip) is made a git repository and committed by the user.
Then, recorded:

* turn 1: an Edit-style call changes ``src/click/__init__.py``; the user's editor saves
  ``tests/test_formatting.py`` vim-style (a process outside the session, between two calls); a
  Bash call runs ``python -m compileall -q tests`` (``__pycache__`` files) and ``sed -i`` over
  three files;
* turn 2: a call runs ``mv tests testsuite`` (a directory rename with ~60 files beneath); a call
  deletes a moved file and changes ``CHANGES.rst``; a call commits everything to the user's
  ``.git`` (the agent's own commit);
* the session ends, the workspace is unmounted, and the user appends a line to ``CHANGES.rst``
  while nothing records.

The test snapshots the tree itself (path -> kind, mode, content or target) before turn 1, after
each call, after the editor's save, after each turn, at the session's end and after the
unmounted edit, and checks every reader against those snapshots, run as a user runs them (the
CLI, JSON where there is one): diff, export git, replay --full, blame, calls, turns, revert and
unrevert.

All the commands run once, in the module's fixture (readers first, then the reverts, which change
the tree), so the checks below do not depend on the order tests run in; each check collects
every problem it finds and reports them together.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
from types import SimpleNamespace

import pytest

from conftest import HAVE_FUSE, SLOW, Mount, is_mounted, needs_fuse, overlayrec

pytestmark = [needs_fuse, pytest.mark.timeout(int(300 * SLOW))]

SDIST = ("click", "8.1.7", "ca9853ad459e787e2192211578cc907e7594e294c7ccc834310722b41b9ca6de")
SESSION = "rs"
EDITED = "src/click/__init__.py"                     # the Edit call's file
EDITOR_FILE = "tests/test_formatting.py"             # the user's editor saves this one
SEDDED = ["tests/test_basic.py", "tests/test_chain.py", "tests/typing/typing_options.py"]
DELETED = "testsuite/test_imports.py"                # turn 2 deletes it after the move
TOP = "CHANGES.rst"                                  # turn 2 changes it; the user, unmounted
USER_LINE = "edit made while unmounted\n"
CALLS = ["t1-edit", "t1-bash", "t2-mv", "t2-rm", "t2-commit"]
INSIDE = ("tests", "testsuite")                      # what `revert --path 'tests*'` covers


# -- snapshots -------------------------------------------------------------------------------------

def tree_snapshot(root):
    """path -> ("dir", mode) | ("file", mode, bytes) | ("link", target) | ("other", mode) for
    everything beneath root but the attic (hidden through the mount, visible beneath it)."""
    import os
    import stat
    out = {}
    for d, dirs, files in os.walk(root):
        if d == root:
            dirs[:] = [x for x in dirs if x != ".overlayrec-attic"]
        for n in dirs + files:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", mode)
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    out[rel] = ("file", mode, f.read())
            else:
                out[rel] = ("other", mode)
    return out


def is_git(p: str) -> bool:
    return p == ".git" or p.startswith(".git/")


def under(p: str, top: str) -> bool:
    return p == top or p.startswith(top + "/")


def blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def git_view(snap: dict) -> dict:
    """What git can hold of a tree: files (with the executable bit) and symlinks, .git/ left
    out, directories implied."""
    out = {}
    for p, v in snap.items():
        if is_git(p):
            continue
        if v[0] == "file":
            out[p] = ("100755" if v[1] & 0o100 else "100644", blob_oid(v[2]))
        elif v[0] == "link":
            out[p] = ("120000", blob_oid(os.fsencode(v[1])))
    return out


def show(v) -> str:
    if v is None:
        return "absent"
    if v[0] == "file":
        return f"file {v[1]:o} {len(v[2])}B {hashlib.sha1(v[2]).hexdigest()[:8]}"
    return " ".join(str(x) for x in v)


def delta(got: dict, want: dict, limit: int = 12) -> str:
    """The paths where two snapshots (or git views) differ, for assertion messages."""
    bad = sorted(p for p in set(got) | set(want) if got.get(p) != want.get(p))
    lines = [f"    {p}: got {show(got.get(p))}, want {show(want.get(p))}" for p in bad[:limit]]
    if len(bad) > limit:
        lines.append(f"    ... and {len(bad) - limit} more")
    return f"{len(bad)} path(s) differ:\n" + "\n".join(lines)


def changed(a: dict, b: dict) -> set[str]:
    return {p for p in set(a) | set(b) if a.get(p) != b.get(p)}


def name_status(a: dict, b: dict) -> set[tuple]:
    """git diff --name-status between two snapshots, without rename detection."""
    ga, gb = git_view(a), git_view(b)
    out = set()
    for p in set(ga) | set(gb):
        if p not in ga:
            out.add(("A", p))
        elif p not in gb:
            out.add(("D", p))
        elif ga[p] != gb[p]:
            out.add(("M", p))
    return out


def materialize(snap: dict, dest: str) -> None:
    """Write a snapshot (without .git/) into a new directory."""
    os.makedirs(dest)
    for p, v in sorted(snap.items()):
        if is_git(p):
            continue
        full = os.path.join(dest, p)
        if v[0] == "dir":
            os.makedirs(full, exist_ok=True)
            continue
        os.makedirs(os.path.dirname(full), exist_ok=True)
        if v[0] == "file":
            with open(full, "wb") as f:
                f.write(v[2])
            os.chmod(full, v[1])
        elif v[0] == "link":
            os.symlink(v[1], full)


def parse_name_status(out: str) -> set[tuple]:
    return {tuple(line.split("\t")) for line in out.splitlines() if "\t" in line}


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def ran(r) -> str:
    """A failed command, for assertion messages."""
    return f"exit {r.returncode}\n  stdout: {r.stdout[-1500:]}\n  stderr: {r.stderr[-1500:]}"


def report(problems: list[str]) -> None:
    assert not problems, f"{len(problems)} problem(s):\n- " + "\n- ".join(problems)


# -- the source tree -------------------------------------------------------------------------------

def _cache_dir() -> str:
    d = os.environ.get("OVERLAYREC_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "overlayrec-tests")
    os.makedirs(d, exist_ok=True)
    return d


def _sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def fetch_sdist() -> str | None:
    """The pinned sdist: from the cache, else by pip from PyPI, checked against PyPI's hash."""
    if os.environ.get("OVERLAYREC_TEST_OFFLINE"):
        return None
    name, version, sha = SDIST
    path = os.path.join(_cache_dir(), f"{name}-{version}.tar.gz")
    if _sha256(path) == sha:
        return path
    with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
        try:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                                "--no-binary", ":all:", "--disable-pip-version-check", "-q",
                                "-d", tmp, f"{name}=={version}"],
                               capture_output=True, text=True, timeout=150 * SLOW)
        except subprocess.TimeoutExpired:
            return None
        got = os.path.join(tmp, os.path.basename(path))
        if r.returncode != 0 or _sha256(got) != sha:
            return None
        os.replace(got, path)
    return path


def seed_from_sdist(tarball: str, ws: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(tarball) as tf:
            tf.extractall(tmp, filter="data")
        (top,) = os.listdir(tmp)
        shutil.copytree(os.path.join(tmp, top), ws, dirs_exist_ok=True)


def seed_from_installed(ws: str) -> None:
    """No network: the click installed beside overlayrec (its dependency), with a tests/ made of
    its own modules (each twice: tests/ and tests/typing/), the files the calls use among them;
    every file distinct and non-empty."""
    import click
    src = os.path.dirname(click.__file__)
    shutil.copytree(src, os.path.join(ws, "src", "click"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    mods = sorted(f for f in os.listdir(src) if f.endswith(".py"))
    named = ["tests/conftest.py", EDITOR_FILE, "tests/test_imports.py", *SEDDED]
    for i, mod in enumerate(mods):
        stem = os.path.splitext(mod)[0].strip("_")
        with open(os.path.join(src, mod), "rb") as f:
            data = f.read()
        for rel in (named[i] if i < len(named) else f"tests/test_{stem}.py",
                    f"tests/typing/typing_{stem}_copy.py"):
            full = os.path.join(ws, rel)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as f:
                f.write(f"# {rel}, from click/{mod}\n".encode() + data)
    with open(os.path.join(ws, TOP), "w") as f:
        f.write(".. currentmodule:: click\n\nVersion (installed)\n-------------------\n\n"
                "-   The tree of this test, made from the installed package.\n")
    with open(os.path.join(ws, "README.rst"), "w") as f:
        f.write("click, as installed\n")


def git_env(who: str) -> dict:
    env = dict(os.environ, GIT_CONFIG_GLOBAL="/dev/null", GIT_CONFIG_NOSYSTEM="1", LC_ALL="C",
               PYTHONDONTWRITEBYTECODE="1",
               GIT_AUTHOR_NAME=who, GIT_AUTHOR_EMAIL=f"{who}@example.invalid",
               GIT_COMMITTER_NAME=who, GIT_COMMITTER_EMAIL=f"{who}@example.invalid",
               GIT_CONFIG_COUNT="3", GIT_CONFIG_KEY_0="gc.auto", GIT_CONFIG_VALUE_0="0",
               GIT_CONFIG_KEY_1="maintenance.auto", GIT_CONFIG_VALUE_1="false",
               GIT_CONFIG_KEY_2="commit.gpgsign", GIT_CONFIG_VALUE_2="false")
    env.pop("OVERLAYREC_SOCKET", None)
    env.pop("OVERLAYREC_SESSION", None)
    return env


# -- the agent and the editor ----------------------------------------------------------------------

AGENT = textwrap.dedent(r'''
    import os, pickle, shlex, subprocess, sys, time
    from overlayrec import client
''') + inspect.getsource(tree_snapshot) + textwrap.dedent(r'''
    marks, snaps = sys.argv[1], sys.argv[2]
    SLOW = float(os.environ.get("OVERLAYREC_TEST_SLOWDOWN", "1"))
    PY = shlex.quote(sys.executable)

    def snap(name):  # the agent's own reads through the mount: they record nothing
        with open(os.path.join(snaps, name + ".pickle"), "wb") as f:
            pickle.dump(tree_snapshot("."), f)

    def mark(name):
        open(os.path.join(marks, name), "w").close()

    def wait_for(name):
        deadline = time.monotonic() + 120 * SLOW
        while not os.path.exists(os.path.join(marks, name)):
            assert time.monotonic() < deadline, f"no {name} marker"
            time.sleep(0.02)

    def bash(c, cid, command):
        c.call_begin(cid, "Bash", summary=command)
        subprocess.run(["bash", "-ec", command], check=True)
        c.call_end(cid)
        snap("after-" + cid)

    with client.connect() as c:
        snap("pre")
        c.turn_begin(prompt="compile the tests and mark the reviewed ones")
        # the agent's own edit tool: it writes the file itself, in place
        c.call_begin("t1-edit", "Edit", summary="src/click/__init__.py")
        p = "src/click/__init__.py"
        with open(p) as f:
            s = f.read()
        with open(p, "w") as f:
            f.write(s.replace("\n", "\n# edited by the agent\n", 1))
        c.call_end("t1-edit")
        snap("after-t1-edit")
        mark("editor-go")        # the user's editor saves now, between two calls
        wait_for("editor-saved")
        snap("after-editor")
        bash(c, "t1-bash", f"{PY} -m compileall -q tests && "
                           "sed -i '1i # reviewed by the agent' tests/test_basic.py "
                           "tests/test_chain.py tests/typing/typing_options.py")
        c.turn_end()
        snap("turn-1")
        c.turn_begin(prompt="rename tests to testsuite and commit")
        bash(c, "t2-mv", "mv tests testsuite")
        bash(c, "t2-rm", "rm testsuite/test_imports.py && "
                         "sed -i '1i Unreleased: the tests moved to testsuite/.' CHANGES.rst")
        bash(c, "t2-commit", "git add -A && git commit -q -m 'Move the tests to testsuite/'")
        c.turn_end()
        snap("turn-2")
''')

# vim's save (writebackup, backupcopy=no, roughly): a swap file while editing, the 4913 probe,
# the new content to a temporary name renamed over the file, the swap file removed
EDITOR = textwrap.dedent(r'''
    import os, sys, time
    go, saved, path, slow = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    deadline = time.monotonic() + 120 * slow
    while not os.path.exists(go):
        assert time.monotonic() < deadline, "no editor-go marker"
        time.sleep(0.02)
    d, n = os.path.split(path)
    swp = os.path.join(d, "." + n + ".swp")
    with open(swp, "wb") as f:
        f.write(b"b0VIM 9.0")
    probe = os.path.join(d, "4913")
    os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644))
    os.unlink(probe)
    with open(path) as f:
        text = f.read()
    tmp = path + "~"
    with open(tmp, "w") as f:
        f.write(text + "\n\n# saved in the user's editor\n")
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, os.stat(path).st_mode & 0o7777)
    os.replace(tmp, path)
    os.unlink(swp)
    open(saved, "w").close()
''')


# -- the recording and every command, once ---------------------------------------------------------

def cli(*args, timeout=60):
    return overlayrec(*args, check=False, timeout=timeout)


@pytest.fixture(scope="module")
def rec():
    if not HAVE_FUSE:
        pytest.skip("needs /dev/fuse")
    base = tempfile.mkdtemp(prefix="overlayrec-real-", dir="/var/tmp")
    os.chmod(base, 0o755)
    m = Mount(base)
    try:
        yield _record_and_read(m, base)
    finally:
        m.umount()
        shutil.rmtree(base, ignore_errors=True)


def _record_and_read(m: Mount, base: str) -> SimpleNamespace:
    R = SimpleNamespace(ws=m.ws, state=m.state, snaps={}, cmd={})
    ws, sd = m.ws, m.state

    # the source tree, committed by the user
    tarball = fetch_sdist()
    if tarball:
        seed_from_sdist(tarball, ws)
        R.source = os.path.basename(tarball)
    else:
        seed_from_installed(ws)
        R.source = "installed click (no network)"
    user = git_env("user")
    for args in (["init", "-q", "-b", "main"], ["add", "-A"],
                 ["commit", "-q", "-m", "click, as released"]):
        subprocess.run(["git", "-C", ws, *args], check=True, env=user, capture_output=True)
    R.premount = tree_snapshot(ws)

    # the session
    m.mount()
    marks, snaps = os.path.join(base, "marks"), os.path.join(base, "snaps")
    os.makedirs(marks)
    os.makedirs(snaps)
    agent, editor_py = os.path.join(base, "agent.py"), os.path.join(base, "editor.py")
    with open(agent, "w") as f:
        f.write(AGENT)
    with open(editor_py, "w") as f:
        f.write(EDITOR)
    env = git_env("agent")
    editor = subprocess.Popen([sys.executable, editor_py, os.path.join(marks, "editor-go"),
                               os.path.join(marks, "editor-saved"), EDITOR_FILE, str(SLOW)],
                              cwd=ws, env=env)
    try:
        R.run = overlayrec("run", "-w", ws, "--session", SESSION, "--", sys.executable, agent,
                           marks, snaps, cwd=ws, env=env, timeout=150, check=False)
        assert R.run.returncode == 0, f"the recorded session failed: {ran(R.run)}"
        assert editor.wait(timeout=30 * SLOW) == 0, "the editor failed"
    finally:
        if editor.poll() is None:
            editor.kill()
            editor.wait()
    R.editor_pid = editor.pid
    for name in os.listdir(snaps):
        with open(os.path.join(snaps, name), "rb") as f:
            R.snaps[name[:-len(".pickle")]] = pickle.load(f)
    R.snaps["session-end"] = tree_snapshot(ws)
    m.umount()
    assert not is_mounted(ws)

    # the user's edit while nothing records
    with open(os.path.join(ws, TOP), "a") as f:
        f.write(USER_LINE)
    R.snaps["unmounted"] = tree_snapshot(ws)

    # the readers, as a user runs them (unmounted: straight from the journal and the tree)
    c = R.cmd
    W = (ws, "--state-dir", sd)
    c["log"] = cli("log", *W, "--json")
    c["mv-ns"] = cli("diff", *W, "--call", "t2-mv", "--name-status")
    c["commit-ns"] = cli("diff", *W, "--call", "t2-commit", "--name-status")
    for t in ("1", "2"):
        c[f"turn{t}-ns"] = cli("diff", *W, "--turn", t, "--name-status")
        c[f"turn{t}-bin"] = cli("diff", *W, "--turn", t, "--binary")
    c["session-patch"] = cli("diff", *W, "--session", SESSION)
    c["calls"] = cli("calls", *W, "--json")
    c["turns"] = cli("turns", *W, "--json")
    c["export"] = cli("export", "git", *W, "--json", timeout=120)

    R.seq = {}
    if c["log"].returncode == 0:
        evs = json_lines(c["log"].stdout)
        ends = [e["seq"] for e in evs if e["op"] == "session_end" and e.get("session") == SESSION]
        R.seq["end"] = max(ends) if ends else max(e["seq"] for e in evs)
        ed = [e["seq"] for e in evs if (e.get("actor") or {}).get("pid") == R.editor_pid]
        if ed:
            R.seq["editor"] = max(ed)
    R.points = [("before:turn:1", "pre"), ("before:call:t1-edit", "pre"),
                ("call:t1-edit", "after-t1-edit"), ("before:call:t1-bash", "after-editor"),
                ("call:t1-bash", "after-t1-bash"), ("turn:1", "turn-1"),
                ("before:turn:2", "turn-1"), ("before:call:t2-mv", "turn-1"),
                ("call:t2-mv", "after-t2-mv"), ("before:call:t2-rm", "after-t2-mv"),
                ("call:t2-rm", "after-t2-rm"), ("before:call:t2-commit", "after-t2-rm"),
                ("call:t2-commit", "after-t2-commit"), ("turn:2", "turn-2")]
    if "editor" in R.seq:
        R.points.append((str(R.seq["editor"]), "after-editor"))
    if "end" in R.seq:
        R.points.append((str(R.seq["end"]), "session-end"))
    R.replays = {}
    for i, (at, _) in enumerate(R.points):
        dest = os.path.join(base, f"replay-{i}")
        r = cli("replay", *W, "--at", at, "--full", "--to", dest, "--json", timeout=120)
        R.replays[at] = tree_snapshot(dest) if r.returncode == 0 else r

    pyc = sorted(p for p in R.snaps["turn-1"] if p.startswith("tests/__pycache__/"))
    R.pyc = pyc[0][len("tests/"):] if pyc else None
    R.blamed = {}
    for p in ([f"testsuite/{R.pyc}", f"tests/{R.pyc}"] if R.pyc else []) + \
            [TOP, "testsuite/" + EDITOR_FILE[len("tests/"):], DELETED]:
        R.blamed[p] = (cli("blame", p, "-w", ws, "--state-dir", sd, "--json"),
                       cli("blame", p, "-w", ws, "--state-dir", sd))

    # the reverts (they change the tree: last)
    c["revert-preview"] = cli("revert", *W, "--turn", "2", "--json", timeout=120)
    c["revert-yes"] = cli("revert", *W, "--turn", "2", "--yes", timeout=120)
    R.snaps["after-refused-revert"] = tree_snapshot(ws)
    c["revert-tests"] = cli("revert", *W, "--turn", "2", "--path", "tests*", "--yes",
                            timeout=120)
    R.snaps["after-revert-tests"] = tree_snapshot(ws)
    c["unrevert"] = cli("unrevert", "-w", ws, "--state-dir", sd, "--yes", timeout=120)
    R.snaps["after-unrevert"] = tree_snapshot(ws)
    return R


# -- the checks ------------------------------------------------------------------------------------

def test_the_session_did_what_the_scenario_says(rec):
    """Not overlayrec's behaviour: that the scenario happened, so the checks below mean
    something."""
    S, problems = rec.snaps, []
    assert rec.premount == S["pre"], "the tree seen through the mount is not the tree beneath " \
        "it: " + delta(S["pre"], rec.premount)
    moved = [p for p in S["turn-1"] if p.startswith("tests/") and S["turn-1"][p][0] == "file"]
    pycs = [p for p in moved if "/__pycache__/" in p]
    if len(moved) < 40 or len(pycs) < 20:
        problems.append(f"turn 1 left {len(moved)} files under tests/, {len(pycs)} of them "
                        "compiled; the scenario wants a directory of many")
    if S["after-t1-edit"][EDITED] == S["pre"][EDITED]:
        problems.append("the Edit call changed nothing")
    if S["after-editor"][EDITOR_FILE] == S["after-t1-edit"][EDITOR_FILE]:
        problems.append("the editor's save changed nothing")
    if any(p.startswith("testsuite") for p in S["turn-1"]) or \
            any(p.startswith("tests/") for p in S["turn-2"]):
        problems.append("the move did not happen as scripted")
    if DELETED in S["turn-2"] or S["turn-2"][TOP] == S["turn-1"][TOP]:
        problems.append(f"t2-rm did not delete {DELETED} and change {TOP}")
    if S["after-t2-commit"][".git/index"] == S["after-t2-rm"][".git/index"]:
        problems.append("the agent's commit did not change .git/index")
    if S["turn-2"] != S["session-end"]:
        problems.append("the tree changed after turn 2: " + delta(S["session-end"], S["turn-2"]))
    if S["unmounted"][TOP][2] != S["session-end"][TOP][2] + USER_LINE.encode():
        problems.append("the unmounted edit is not the only change of " + TOP)
    files = [v[2] for p, v in S["turn-1"].items() if p.startswith("tests/") and v[0] == "file"]
    if len(set(files)) != len(files) or not all(files):
        problems.append("two files under tests/ are identical or empty: git's rename detection "
                        "could pair them either way")
    for line in rec.run.stderr.splitlines():
        if "session rs:" in line and "2 turn(s), 5 call(s)" not in line:
            problems.append(f"overlayrec run says: {line}")
    report(problems)


def test_diff_of_the_move_lists_every_moved_file_as_a_rename(rec):
    S, r = rec.snaps, rec.cmd["mv-ns"]
    assert r.returncode == 0, ran(r)
    want = {("R100", p, "testsuite/" + p[len("tests/"):]) for p, v in S["turn-1"].items()
            if p.startswith("tests/") and v[0] in ("file", "link")}
    got = parse_name_status(r.stdout)
    assert got == want, (
        f"diff --call t2-mv --name-status: {len(got & want)} of {len(want)} moves listed as "
        f"R100 tests/x -> testsuite/x;\n  missing (first 8): {sorted(want - got)[:8]}"
        f"\n  unexpected (first 8): {sorted(got - want)[:8]}")


def _apply_reverse(patch: str, after: dict, dest: str) -> dict | str:
    """git apply -R of a patch onto a copy of a snapshot: the tree it gives, or git's error."""
    materialize(after, dest)
    subprocess.run(["git", "init", "-q", dest], check=True, capture_output=True)
    r = subprocess.run(["git", "apply", "-R", "--whitespace=nowarn", "-"], input=patch.encode(),
                       cwd=dest, capture_output=True, timeout=60 * SLOW)
    if r.returncode != 0:
        return r.stderr.decode(errors="replace")[-2000:]
    return tree_snapshot(dest)


def test_diff_of_turn_1_holds_the_pycache_and_reverses_with_git(rec, tmp_path):
    S, problems = rec.snaps, []
    r = rec.cmd["turn1-ns"]
    assert r.returncode == 0, ran(r)
    # the session's changes only: the editor's save is an outside process's
    want = name_status(S["pre"], S["turn-1"]) - {("M", EDITOR_FILE)}
    got = parse_name_status(r.stdout)
    pyc_want = {x for x in want if "/__pycache__/" in x[1]}
    if not pyc_want <= got:
        problems.append(f"diff --turn 1 lacks {len(pyc_want - got)} of the {len(pyc_want)} "
                        f"__pycache__ files turn 1 created under tests/, e.g. "
                        f"{sorted(pyc_want - got)[:4]}")
    if got != want:
        problems.append(f"diff --turn 1 --name-status: missing {sorted(want - got)[:6]}, "
                        f"unexpected {sorted(got - want)[:6]}")
    b = rec.cmd["turn1-bin"]
    if b.returncode != 0:
        problems.append(f"diff --turn 1 --binary: {ran(b)}")
    else:
        back = _apply_reverse(b.stdout, S["turn-1"], str(tmp_path / "t1"))
        # the editor's save stays: it is not the turn's
        want_tree = dict(git_view(S["pre"]), **{EDITOR_FILE: git_view(S["turn-1"])[EDITOR_FILE]})
        if isinstance(back, str):
            problems.append(f"git apply -R of diff --turn 1 onto the tree after turn 1 "
                            f"failed: {back}")
        elif git_view(back) != want_tree:
            problems.append("git apply -R of diff --turn 1 onto the tree after turn 1 is not "
                            "the tree before it (the editor's save kept): "
                            + delta(git_view(back), want_tree))
    report(problems)


def test_diff_of_turn_2_reverses_with_git_and_counts_what_it_leaves_out_of_git(rec, tmp_path):
    S, problems = rec.snaps, []
    b = rec.cmd["turn2-bin"]
    assert b.returncode == 0, ran(b)
    back = _apply_reverse(b.stdout, S["turn-2"], str(tmp_path / "t2"))
    if isinstance(back, str):
        problems.append(f"git apply -R of diff --turn 2 onto the tree after turn 2 failed: "
                        f"{back}")
    elif git_view(back) != git_view(S["turn-1"]):
        problems.append("git apply -R of diff --turn 2 onto the tree after turn 2 is not the "
                        "tree before it (.git/ aside): "
                        + delta(git_view(back), git_view(S["turn-1"])))
    # .git/ is left out of the diff, and the diff says how much it left out
    for key, what, a, b in (("turn2-ns", "diff --turn 2", "turn-1", "turn-2"),
                            ("commit-ns", "diff --call t2-commit", "after-t2-rm",
                             "after-t2-commit")):
        # every path under .git/ that changed: files and the directories git made
        git_changes = sorted(p for p in changed(S[a], S[b]) if is_git(p))
        r = rec.cmd[key]
        if r.returncode != 0:
            problems.append(f"{what} --name-status: {ran(r)}")
            continue
        listed = [x for x in parse_name_status(r.stdout) if any(is_git(p) for p in x[1:])]
        if listed:
            problems.append(f"{what} lists .git/ paths: {sorted(listed)[:4]}")
        notes = r.stderr + "".join(l + "\n" for l in r.stdout.splitlines() if "\t" not in l)
        said = re.search(r"(\d+)[^\n]*\.git/|\.git/[^\n]*?(\d+)", notes)
        if not said:
            problems.append(f"{what} does not say how many .git/ changes it leaves out "
                            f"({len(git_changes)} paths under .git/ changed, e.g. "
                            f"{git_changes[:3]}); it printed: {notes.strip()[-300:]!r}")
        elif int(said.group(1) or said.group(2)) != len(git_changes):
            problems.append(f"{what} says {said.group(0)!r}; the snapshots show "
                            f"{len(git_changes)} paths under .git/ changed")
    report(problems)


def test_the_users_unmounted_edit_is_in_no_diff_and_on_no_call(rec):
    problems = []
    for key in ("turn1-bin", "turn2-bin", "session-patch"):
        r = rec.cmd[key]
        if r.returncode != 0:
            problems.append(f"{key}: {ran(r)}")
        elif USER_LINE.strip() in r.stdout:
            problems.append(f"the line the user added while unmounted is in {key}")
    rows_r, _ = rec.blamed[TOP]
    if rows_r.returncode != 0:
        problems.append(f"blame {TOP}: {ran(rows_r)}")
    else:
        rows = json_lines(rows_r.stdout)
        mine = [r for r in rows if r["unit"].startswith(("call:", "turn:", "session:"))]
        for r in mine:
            if r["after"]["size"] == len(rec.snaps["unmounted"][TOP][2]):
                problems.append(f"blame {TOP}: {r['unit']} is shown leaving the file with the "
                                "user's unmounted line in it")
        if rows and rows[0]["unit"].startswith(("call:", "turn:", "session:")):
            problems.append(f"blame {TOP}: the newest change (the unmounted edit) is "
                            f"attributed to {rows[0]['unit']}")
    report(problems)


EXPORTED = {f"refs/overlayrec/{SESSION}/base": "pre",
            **{f"refs/overlayrec/{SESSION}/calls/{c}": "after-" + c for c in CALLS},
            f"refs/overlayrec/{SESSION}/turns/1": "turn-1",
            f"refs/overlayrec/{SESSION}/turns/2": "turn-2"}


def _exported(rec) -> dict:
    """ref -> {path: (mode, oid)} of each commit the export should have made (or git's error)."""
    r = rec.cmd["export"]
    assert r.returncode == 0, ran(r)
    gd = json.loads(r.stdout)["git_dir"]
    out = {}
    for ref in EXPORTED:
        ls = subprocess.run(["git", "--git-dir", gd, "ls-tree", "-r", "-z", "--full-tree", ref],
                            capture_output=True, text=True)
        if ls.returncode != 0:
            out[ref] = ls.stderr.strip()
            continue
        tree = out[ref] = {}
        for entry in filter(None, ls.stdout.split("\0")):
            meta, path = entry.split("\t", 1)
            mode, _, oid = meta.split()
            tree[path] = (mode, oid)
    return out


def test_export_git_commits_agree_with_the_snapshots(rec):
    """Every path a commit holds is as the snapshot at that point has it, nothing under .git/;
    before the move, every file under tests/ is there (path history: they were recorded only
    by the rename of their directory)."""
    S, problems = rec.snaps, []
    before_move = {"pre", "after-t1-edit", "after-t1-bash", "turn-1"}
    for ref, tree in _exported(rec).items():
        name = EXPORTED[ref]
        if isinstance(tree, str):
            problems.append(f"{ref}: {tree}")
            continue
        want = git_view(S[name])
        wrong = {p: v for p, v in tree.items() if want.get(p) != v}
        if wrong:
            problems.append(f"{ref}: {len(wrong)} entries differ from the snapshot {name!r}: "
                            + delta({p: tree[p] for p in wrong}, {p: want.get(p) for p in wrong},
                                    6))
        if name in before_move:
            tests = [p for p in want if p.startswith("tests/")]
            lost = [p for p in tests if tree.get(p) != want[p]]
            if lost:
                problems.append(f"{ref} (before the move): {len(lost)} of the {len(tests)} "
                                f"files under tests/ are missing or wrong, e.g. {lost[:4]}")
        elif any(p.startswith("tests/") for p in tree):
            problems.append(f"{ref} (after the move) still holds tests/")
    report(problems)


def test_export_git_commits_hold_the_whole_tree(rec):
    """Each call's (and turn's) commit tree equals the snapshot after it: files and symlinks,
    .git/ and empty directories aside (the whole workspace, files never touched included, as
    docs/export.md says)."""
    S, problems = rec.snaps, []
    for ref, tree in _exported(rec).items():
        name = EXPORTED[ref]
        if isinstance(tree, str):
            problems.append(f"{ref}: {tree}")
            continue
        want = git_view(S[name])
        missing = sorted(set(want) - set(tree))
        if missing:
            problems.append(f"{ref}: {len(missing)} of the {len(want)} files of the snapshot "
                            f"{name!r} are not in the commit, e.g. {missing[:4]}")
    report(problems)


def test_replay_full_equals_the_snapshot_at_every_unit_boundary(rec):
    problems = []
    for at, name in rec.points:
        got = rec.replays[at]
        if not isinstance(got, dict):
            problems.append(f"replay --at {at} --full: {ran(got)}")
        elif got != rec.snaps[name]:
            problems.append(f"replay --at {at} --full is not the snapshot {name!r} (.git/ "
                            "included): " + delta(got, rec.snaps[name], 6))
    if "editor" not in rec.seq:
        problems.append("log --json shows no event by the editor (pid "
                        f"{rec.editor_pid}): {ran(rec.cmd['log'])[:500]}")
    report(problems)


def _units(pair) -> list[str] | str:
    r, _ = pair
    if r.returncode != 0:
        return ran(r)
    return [row["unit"] for row in json_lines(r.stdout)]


def test_blame_follows_the_move_and_sees_the_drift(rec):
    problems = []
    call = f"call:{SESSION}:{{}}".format
    assert rec.pyc, "turn 1 compiled nothing under tests/"
    want = {f"testsuite/{rec.pyc}": [call("t2-mv"), call("t1-bash")],
            f"tests/{rec.pyc}": [call("t2-mv"), call("t1-bash")],
            DELETED: [call("t2-rm"), call("t2-mv")]}
    for path, units in want.items():
        got = _units(rec.blamed[path])
        if got != units:
            problems.append(f"blame {path}: units newest first {got}, want {units}")
    # the move, seen from each name: the old one ends absent, the new one holds the file
    for path, kinds in ((f"tests/{rec.pyc}", ("file", "absent")),
                        (f"testsuite/{rec.pyc}", (None, "file"))):
        r, _ = rec.blamed[path]
        rows = [row for row in json_lines(r.stdout) if row["unit"] == call("t2-mv")] \
            if r.returncode == 0 else []
        got = [(row["before"]["kind"], row["after"]["kind"]) for row in rows]
        if len(got) != 1 or got[0][1] != kinds[1] or kinds[0] not in (None, got[0][0]):
            problems.append(f"blame {path}: the move's row goes {got}, want "
                            f"{kinds[0] or 'any'} -> {kinds[1]}")
    ed = "testsuite/" + EDITOR_FILE[len("tests/"):]
    got = _units(rec.blamed[ed])
    if not (isinstance(got, list) and len(got) == 2 and got[0] == call("t2-mv")
            and got[1].startswith("outside:") and got[1].split(":")[1] == str(rec.editor_pid)):
        problems.append(f"blame {ed}: units newest first {got}, want [{call('t2-mv')}, "
                        f"outside:{rec.editor_pid}:... (the editor)]")
    # the top-level file: the call that changed it, then the drift, never on a call
    got = _units(rec.blamed[TOP])
    if not isinstance(got, list) or \
            [u for u in got if u.startswith(("call:", "turn:", "session:"))] != [call("t2-rm")]:
        problems.append(f"blame {TOP}: units {got}; the only recorded change is "
                        f"{call('t2-rm')}")
    r, text = rec.blamed[TOP]
    if r.returncode == 0:
        rows = json_lines(r.stdout)
        sealed = len(rec.snaps["session-end"][TOP][2])
        for row in rows:
            if row["unit"] == call("t2-rm") and row["after"]["size"] != sealed:
                problems.append(f"blame {TOP}: t2-rm left {row['after']['size']}B by blame, "
                                f"{sealed}B by the snapshot at the session's end")
    if not re.search(r"drift|outside the record", text.stdout + text.stderr, re.I):
        problems.append(f"blame {TOP} does not say the file drifted (changed while unmounted): "
                        f"{(text.stdout + text.stderr).strip()[-400:]!r}")
    report(problems)


def _check_listing(what: str, paths: list[str], before: dict, after: dict,
                   skip: set[str] = frozenset()) -> list[str]:
    """A listing of net changes: every path listed changed between before and after (no
    temporary file, no path put back as it was), and every file that changed is listed (by its
    new name at least; .git/ and `skip` aside)."""
    out = []
    net = changed(before, after)
    churn = sorted(p for p in paths if p not in net)
    if churn:
        out.append(f"{what} lists {len(churn)} path(s) that are no net change (churn), e.g. "
                   f"{churn[:5]}")
    listed = set(paths)
    unlisted = []
    for p in sorted(net - skip):
        if is_git(p) or (after.get(p) or before.get(p))[0] == "dir" or p in listed:
            continue
        if p not in after and p.startswith("tests/") and \
                "testsuite/" + p[len("tests/"):] in listed:
            continue  # moved away: its new name is listed
        unlisted.append(p)
    if unlisted:
        out.append(f"{what} leaves out {len(unlisted)} changed file(s), e.g. {unlisted[:5]}")
    return out


def test_calls_and_turns_list_net_changes(rec):
    S, problems = rec.snaps, []
    r = rec.cmd["calls"]
    assert r.returncode == 0, ran(r)
    rows = {row["id"]: row for row in json_lines(r.stdout)}
    if sorted(rows) != sorted(CALLS):
        problems.append(f"calls lists {sorted(rows)}, want {sorted(CALLS)}")
    spans = {"t1-edit": ("pre", "after-t1-edit"), "t1-bash": ("after-editor", "after-t1-bash"),
             "t2-mv": ("turn-1", "after-t2-mv"), "t2-rm": ("after-t2-mv", "after-t2-rm"),
             "t2-commit": ("after-t2-rm", "after-t2-commit")}
    for cid, (a, b) in spans.items():
        if cid in rows:
            problems += _check_listing(f"calls: {cid}", rows[cid]["paths"], S[a], S[b])
    for cid, row in rows.items():  # every change of this session is known exactly
        if row.get("inexact") != []:
            problems.append(f"calls: {cid} says {row.get('inexact')} not known exactly")
    r = rec.cmd["turns"]
    assert r.returncode == 0, ran(r)
    turns = {row["index"]: row for row in json_lines(r.stdout)}
    if sorted(turns) != [1, 2]:
        problems.append(f"turns lists {sorted(turns)}")
    if 1 in turns:
        t = turns[1]
        if EDITOR_FILE in t["paths"]:
            problems.append(f"turns: turn 1 lists {EDITOR_FILE}, which only the editor changed")
        problems += _check_listing("turns: turn 1", t["paths"], S["pre"], S["turn-1"],
                                   skip={EDITOR_FILE})
        if not any(f"[{rec.editor_pid}]" in o for o in t["others"]):
            problems.append(f"turns: turn 1 does not name the editor among others: {t['others']}")
    if 2 in turns:
        problems += _check_listing("turns: turn 2", turns[2]["paths"], S["turn-1"], S["turn-2"])
    for i, t in turns.items():
        if t.get("inexact") != []:
            problems.append(f"turns: turn {i} says {t.get('inexact')} not known exactly")
    report(problems)


def _split(snap: dict) -> tuple[dict, dict]:
    inside = {p: v for p, v in snap.items() if any(under(p, t) for t in INSIDE)}
    return inside, {p: v for p, v in snap.items() if p not in inside}


def test_revert_of_turn_2_conflicts_on_the_drift_then_moves_the_tests_back(rec):
    S, c, problems = rec.snaps, rec.cmd, []
    # the preview: the user's unmounted edit makes the top-level file a `changed` conflict
    pv = c["revert-preview"]
    try:
        steps = json.loads(pv.stdout.splitlines()[0])["steps"]
    except (IndexError, ValueError, KeyError):
        steps = None
        problems.append(f"revert --turn 2 --json (preview): no plan: {ran(pv)}")
    if steps is not None:
        conflicts = {s["path"]: s["conflict"] for s in steps if s["conflict"]}
        if conflicts != {TOP: "changed"}:
            problems.append(f"revert --turn 2 preview: conflicts {conflicts}, want "
                            f"{{{TOP!r}: 'changed'}}")
        planned = {s["path"] for s in steps}
        uncovered = [p for p in S["turn-1"] if p.startswith("tests/")
                     and S["turn-1"][p][0] == "file"
                     and not any(q in planned for q in _ancestors_and_self(p))
                     and not any(q in planned for q in _ancestors_and_self(
                         "testsuite/" + p[len("tests/"):]))]
        if uncovered:
            problems.append(f"revert --turn 2 preview: {len(uncovered)} moved file(s) have no "
                            f"step (neither old nor new name, nor a directory above), e.g. "
                            f"{uncovered[:4]}")
    # --yes refuses as a whole: nothing written
    y = c["revert-yes"]
    if y.returncode != 1 or f"changed: {TOP}" not in y.stderr:
        problems.append(f"revert --turn 2 --yes should refuse with `changed: {TOP}`: {ran(y)}")
    if S["after-refused-revert"] != S["unmounted"]:
        problems.append("the refused revert wrote: "
                        + delta(S["after-refused-revert"], S["unmounted"], 6))
    # only the tests: they move back, the rest stays as the user left it
    t = c["revert-tests"]
    if t.returncode != 0:
        problems.append(f"revert --turn 2 --path 'tests*' --yes: {ran(t)}")
    got_in, got_out = _split(S["after-revert-tests"])
    want_in, _ = _split(S["turn-1"])
    _, want_out = _split(S["unmounted"])
    if "testsuite" in S["after-revert-tests"]:
        n = sum(1 for p in got_in if p.startswith("testsuite/"))
        m = sum(1 for p in got_in if p.startswith("tests/"))
        problems.append(f"after revert --path 'tests*': testsuite/ still exists ({n} entries) "
                        f"beside tests/ ({m} entries)")
    if got_in != want_in:
        problems.append("after revert --path 'tests*', tests/ and testsuite/ are not as before "
                        "turn 2: " + delta(got_in, want_in, 8))
    if got_out != want_out:
        problems.append("revert --path 'tests*' changed paths outside tests*: "
                        + delta(got_out, want_out, 6))
    # unrevert gives back the tree before the revert
    u = c["unrevert"]
    if u.returncode != 0:
        problems.append(f"unrevert --yes: {ran(u)}")
    if S["after-unrevert"] != S["unmounted"]:
        problems.append("after unrevert the tree is not what it was before the revert: "
                        + delta(S["after-unrevert"], S["unmounted"], 8))
    report(problems)


def _ancestors_and_self(p: str) -> list[str]:
    parts = p.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
