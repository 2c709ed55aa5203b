"""A git index refreshed by git itself is not a revert's conflict.

Every `git status` after a file's stat changed rewrites `.git/index` (its cached stat data, its
cache extensions) without changing what is staged.  A revert of a call that committed, with a
later `git status`, and an unrevert after a `git status`, were refused, "changed: .git/index".
The unit tests read indexes git itself wrote (versions 2, 3 and 4, SHA-1 and SHA-256); the
integration tests revert and unrevert through a real mount with real git processes, and check
the repository's own view (`git status`, `git log`) and the tree against the test's snapshots.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import SLOW, needs_fuse, overlayrec
from overlayrec.engines import gitindex
from test_replay import tree_of

GIT = ["git", "-c", "user.email=t@example.org", "-c", "user.name=t", "-c", "advice.all=false"]


def git(cwd, *args) -> str:
    return subprocess.run([*GIT, *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def repo(path, object_format: str = "sha1") -> str:
    os.makedirs(path)
    git(path, "init", "-q", f"--object-format={object_format}")
    for i in range(12):
        os.makedirs(os.path.join(path, f"d{i % 3}"), exist_ok=True)
        with open(os.path.join(path, f"d{i % 3}", f"f{i}"), "w") as f:
            f.write(f"{i}\n")
    git(path, "add", "-A")
    git(path, "commit", "-qm", "first")
    return path


def index(path) -> bytes:
    with open(os.path.join(path, ".git", "index"), "rb") as f:
        return f.read()


def touch_all(root) -> None:
    """Change every file's stat outside .git (not its content): the next `git status`
    refreshes the index."""
    time.sleep(1.05)  # past the index's own mtime, so git does not take the files as racy
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in (".git", ".overlayrec-attic")]
        for n in names:
            os.utime(os.path.join(d, n), follow_symlinks=False)


@pytest.mark.parametrize("object_format", ["sha1", "sha256"])
@pytest.mark.parametrize("version", [2, 3, 4])
def test_a_refresh_is_told_from_a_change(tmp_path, object_format, version):
    r = repo(str(tmp_path / "r"), object_format)
    git(r, "update-index", f"--index-version={version}")
    if version == 3:
        git(r, "update-index", "--skip-worktree", "d0/f0")  # an extended entry (version 3)
    before = index(r)
    touch_all(r)
    git(r, "status", "--short")
    refreshed = index(r)
    assert refreshed != before, "git did not rewrite its index: the test shows nothing"
    assert gitindex.refreshed(".git/index", before, refreshed)
    assert gitindex.refreshed(".git/index", refreshed, before)
    # staged content, a path, a mode, a flag: each a change
    with open(os.path.join(r, "d1", "f1"), "a") as f:
        f.write("more\n")
    git(r, "add", "d1/f1")
    assert not gitindex.refreshed(".git/index", refreshed, index(r))
    staged = index(r)
    git(r, "rm", "-q", "--cached", "d2/f2")
    assert not gitindex.refreshed(".git/index", staged, index(r))
    unstaged = index(r)
    git(r, "update-index", "--chmod=+x", "d0/f3")
    assert not gitindex.refreshed(".git/index", unstaged, index(r))
    chmodded = index(r)
    git(r, "update-index", "--assume-unchanged", "d0/f3")
    assert not gitindex.refreshed(".git/index", chmodded, index(r))
    # and a refresh after all of that is a refresh again
    flagged = index(r)
    touch_all(r)
    git(r, "status", "--short")
    assert index(r) != flagged and gitindex.refreshed(".git/index", flagged, index(r))


@pytest.mark.parametrize("object_format", ["sha1", "sha256"])
@pytest.mark.parametrize("version", [2, 4])
def test_a_split_index_is_read_with_its_shared_file(tmp_path, object_format, version):
    """core.splitIndex: a refresh moves the entries whose stat changed into the split part,
    the shared file unchanged; compared raw, a `git status` after a `git add` made the add's
    revert a conflict (found by a bug hunt).  Read with the shared file, as git merges them,
    it is a refresh; a staged change is not; unreadable shared file: not a refresh."""
    r = repo(str(tmp_path / "r"), object_format)
    git(r, "update-index", f"--index-version={version}")
    git(r, "config", "core.splitIndex", "true")
    git(r, "config", "splitIndex.maxPercentChange", "100")  # keep one shared file throughout
    git(r, "update-index", "--split-index")
    git(r, "status", "--short")

    def shared(name):
        assert name.startswith(".git/sharedindex."), name
        try:
            with open(os.path.join(r, name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def shared_files():
        return sorted(n for n in os.listdir(os.path.join(r, ".git")) if n.startswith("sharedindex."))

    base = index(r)
    with open(os.path.join(r, "d1", "f1"), "a") as f:
        f.write("more\n")
    git(r, "add", "d1/f1")
    added = index(r)
    assert not gitindex.refreshed(".git/index", base, added, shared=shared)
    files = shared_files()
    time.sleep(1.05)
    for n in ("d0/f0", "d0/f3", "d2/f2", "d2/f5"):  # stat moved, content not
        os.utime(os.path.join(r, n))
    git(r, "update-index", "-q", "--refresh")  # what `git status` does on a larger tree
    refreshed = index(r)
    assert shared_files() == files, "git wrote a new shared file: the test shows nothing"
    assert refreshed != added, "git did not rewrite its index: the test shows nothing"
    # the raw split parts differ beyond the stat data (the entries git moved)
    hash_len = 32 if object_format == "sha256" else 20
    raw = [gitindex._parse(x, hash_len) for x in (added, refreshed)]
    assert raw[0][3] is not None and raw[0][1:] != raw[1][1:], "split, and moved"
    assert gitindex.refreshed(".git/index", added, refreshed, shared=shared)
    assert gitindex.refreshed(".git/index", refreshed, added, shared=shared)
    assert not gitindex.refreshed(".git/index", base, refreshed, shared=shared)
    gitindex._READ.clear()  # (what it read with the shared file is kept: its name is its hash)
    assert not gitindex.refreshed(".git/index", added, refreshed, shared=lambda name: None)


def test_what_is_not_a_git_index_is_never_a_refresh(tmp_path):
    r = repo(str(tmp_path / "r"))
    before = index(r)
    touch_all(r)
    git(r, "status", "--short")
    after = index(r)
    assert gitindex.refreshed("sub/.git/index", before, after)
    assert gitindex.refreshed(".git/worktrees/w/index", before, after)
    assert gitindex.refreshed(".git/modules/lib/index", before, after)
    # the same bytes under a name that is no git index; a cut or damaged index; another version
    assert not gitindex.refreshed("index", before, after)
    assert not gitindex.refreshed("docs/index", before, after)
    assert not gitindex.refreshed(".git/index", before[:-7], after)
    assert not gitindex.refreshed(".git/index", before, after[:60] + b"\xff" + after[61:])
    git(r, "update-index", "--index-version=4")
    assert not gitindex.refreshed(".git/index", after, index(r))  # same entries, another format
    assert not gitindex.refreshed(".git/index", b"", b"DIRC")


def test_a_revert_read_back_takes_an_index_git_refreshed_meanwhile(tmp_path):
    """A revert reads back every path it wrote; an index an editor's `git status` refreshed
    in between holds what was put back (``unmet`` is None), one whose staging changed does
    not."""
    from overlayrec.engines.revert_apply import unmet
    from overlayrec.engines.revert_steps import Step
    from overlayrec.engines.states import State, Tree
    r = repo(str(tmp_path / "r"))
    put_back = index(r)
    target = State("file", 0o644, put_back)
    step = Step(".git/index", target, target)
    fd = os.open(r, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert unmet(Tree(fd), step, "replaced") is None
        touch_all(r)
        git(r, "status", "--short")
        assert index(r) != put_back, "git did not rewrite its index: the test shows nothing"
        assert unmet(Tree(fd), step, "replaced") is None
        git(r, "rm", "-q", "--cached", "d0/f0")
        assert unmet(Tree(fd), step, "replaced") == \
            "holds other content than the revert put back"
    finally:
        os.close(fd)


CALLS = ("echo b > b; git add b; git commit -qm second; sleep 1.1; touch d0/* b; "
         "git status --short; echo c > c")


def committed(make_mount, path: str):
    """A Mount (not mounted yet) whose workspace is a git repository with ``path`` committed."""
    m = make_mount()
    git(m.ws, "init", "-q")
    git(m.ws, "config", "user.email", "t@example.org")
    git(m.ws, "config", "user.name", "t")
    os.makedirs(os.path.dirname(os.path.join(m.ws, path)), exist_ok=True)
    with open(os.path.join(m.ws, path), "w") as f:
        f.write("a\n")
    git(m.ws, "add", "-A")
    git(m.ws, "commit", "-qm", "first")
    return m


def calls_of(ws) -> list[dict]:
    out = overlayrec("calls", ws, "--json").stdout
    return [json.loads(line) for line in out.splitlines()]


@needs_fuse
@pytest.mark.timeout(int(180 * SLOW))
def test_revert_a_commit_after_git_status_and_unrevert_after_another(make_mount, tmp_path):
    m = committed(make_mount, "d0/a")
    m.mount()
    # an agent without hooks: each command a call of its own (git add, git commit, touch,
    # git status), snapshots between the commit and the touch
    snap = str(tmp_path / "snap")
    overlayrec("run", "-w", m.ws, "--", "sh", "-c",
               CALLS.replace("sleep 1.1;", f"cp -a . {snap}; sleep 1.1;"), cwd=m.ws)
    commit = [c for c in calls_of(m.ws) if c["summary"].startswith("git commit")]
    assert len(commit) == 1
    status = [c for c in calls_of(m.ws) if c["summary"].startswith("git status")][0]
    assert ".git/index" in status["paths"], "git status did not rewrite the index: no test"
    tree = tree_of(m.ws)

    plan = json.loads(overlayrec("revert", m.ws, "--call", commit[0]["id"], "--json").stdout)
    assert [s["path"] for s in plan["steps"] if s.get("conflict")] == []
    overlayrec("revert", m.ws, "--call", commit[0]["id"], "--yes")
    # the repository as the commit found it: b staged, c untracked, one commit
    assert git(m.ws, "log", "--format=%s").split() == ["first"]
    assert git(m.ws, "status", "--porcelain").split("\n")[:2] == ["A  b", "?? c"]
    assert git(m.ws, "diff", "--cached", "--name-only").split() == ["b"]
    # git status (just run, mounted) refreshed the index again; and once more while unmounted
    m.umount()
    touch_all(m.ws)
    git(m.ws, "status", "--short")
    m.mount()
    overlayrec("unrevert", m.ws, "--yes")
    assert git(m.ws, "log", "--format=%s").split() == ["second", "first"]
    assert git(m.ws, "status", "--porcelain").split() == ["??", "c"]
    got = tree_of(m.ws)
    assert {p: v for p, v in got.items() if p != ".git/index"} == \
        {p: v for p, v in tree.items() if p != ".git/index"}
    assert git(m.ws, "ls-files", "-s") == git(snap, "ls-files", "-s")


@needs_fuse
@pytest.mark.timeout(int(180 * SLOW))
def test_a_refresh_between_interleaves_nothing_a_staged_change_conflicts(make_mount, tmp_path):
    m = committed(make_mount, "a")
    before = git(m.ws, "ls-files", "-s")
    m.mount()
    # one call stages b, waits, commits; while it waits an outside process (this test)
    # refreshes the index; a later call stages x
    go = tmp_path / "go"
    agent = subprocess.Popen(
        [sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--", "sh", "-c",
         f"sh -c 'echo b > b; git add b; while [ ! -e {go} ]; do sleep 0.05; done; "
         f"git commit -qm second'; echo x > x; git add x"], cwd=m.ws)
    try:
        deadline = time.monotonic() + 60 * SLOW
        while "b" not in git(m.ws, "ls-files").split():
            assert time.monotonic() < deadline and agent.poll() is None, "b was never staged"
            time.sleep(0.05)
        staged = index(m.ws)
        touch_all(m.ws)
        git(m.ws, "status", "--short")
        assert index(m.ws) != staged, "git did not rewrite its index: the test shows nothing"
        go.write_text("")
        assert agent.wait(timeout=60 * SLOW) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
    tree = tree_of(m.ws)
    calls = calls_of(m.ws)
    commit = [c for c in calls if "git commit" in c["summary"]][0]
    last = [c for c in calls if "git add x" in c["summary"]][0]
    overlayrec("revert", m.ws, "--call", last["id"], "--yes")
    assert git(m.ws, "status", "--porcelain") == "?? x\n"  # x unstaged (the agent wrote it)
    overlayrec("unrevert", m.ws, "--yes")
    # the commit's call: the index changed since in what it stages (x): a conflict still
    r = overlayrec("revert", m.ws, "--call", commit["id"], "--yes", check=False)
    assert r.returncode != 0 and "changed: .git/index" in r.stderr, r.stderr
    assert tree_of(m.ws) == tree  # nothing reverted
    # undone newest first, the commit's call reverts: the outside refresh between its two
    # writes to the index (git add, git commit) interleaves nothing
    overlayrec("revert", m.ws, "--call", last["id"], "--yes")
    plan = json.loads(overlayrec("revert", m.ws, "--call", commit["id"], "--json").stdout)
    assert [s["path"] for s in plan["steps"] if s.get("conflict")] == [], plan
    overlayrec("revert", m.ws, "--call", commit["id"], "--yes")
    assert git(m.ws, "log", "--format=%s").split() == ["first"]
    assert git(m.ws, "status", "--porcelain") == "?? x\n"
    assert git(m.ws, "ls-files", "-s") == before
    assert sorted(p for p in tree_of(m.ws) if not p.startswith(".git")) == ["a", "x"]
