"""overlayrec export git: the journal as real git commits, checked with the real git."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import needs_fuse, overlayrec
from test_diff import AGENT, seed

pytestmark = needs_fuse


def git(git_dir, *args):
    r = subprocess.run(["git", "--git-dir", git_dir, *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_export_matches_overlayrec_diff_and_fscks(make_mount, tmp_path):
    m = make_mount()
    seed(m.ws)
    subprocess.run(["git", "init", "-q", m.ws], check=True)
    subprocess.run(["git", "-C", m.ws, "-c", "user.email=a@b", "-c", "user.name=n", "add", "-A"],
                   check=True)
    subprocess.run(["git", "-C", m.ws, "-c", "user.email=a@b", "-c", "user.name=n", "commit",
                    "-qm", "user's own"], check=True)
    user_refs = subprocess.run(["git", "-C", m.ws, "show-ref"], capture_output=True,
                               text=True).stdout
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    overlayrec("run", "-w", m.ws, "--session", "d", "--", sys.executable, str(agent), cwd=m.ws)
    out = json.loads(overlayrec("export", "git", m.ws, "--json").stdout)
    gd = out["git_dir"]
    assert gd == os.path.join(m.state, "git") and out["commits"] == 6  # base, 3 calls, 2 turns
    assert "fsck" not in git(gd, "fsck", "--strict", "--no-dangling")
    refs = git(gd, "for-each-ref", "--format=%(refname)").split()
    assert {"refs/overlayrec/d/head", "refs/overlayrec/d/base", "refs/overlayrec/d/calls/c1",
            "refs/overlayrec/d/turns/1", "refs/overlayrec/d/turns/2"} <= set(refs)
    # every call's commit against its parent is what overlayrec diff shows for the call
    for c in ("c1", "c2", "c3"):
        ref = f"refs/overlayrec/d/calls/{c}"
        for fmt in ("--stat", "--name-status"):
            want = overlayrec("diff", m.ws, "--call", c, fmt).stdout
            got = git(gd, "diff", "-M", fmt, f"{ref}^", ref)
            assert got == want, (c, fmt, got, want)
        want = overlayrec("diff", m.ws, "--call", c, "--binary").stdout
        got = git(gd, "diff", "-M", "--binary", "--full-index", f"{ref}^", ref)
        assert _strip_index(got) == _strip_index(want), c
    # a turn: from the state before its first call to its end
    got = git(gd, "diff", "-M", "--stat", "refs/overlayrec/d/base", "refs/overlayrec/d/turns/1")
    assert got == overlayrec("diff", m.ws, "--turn", "1", "--stat").stdout
    msg = git(gd, "log", "-1", "--format=%B%n%an", "refs/overlayrec/d/calls/c1")
    assert "Overlayrec-Call: c1" in msg and "Overlayrec-Tool: Bash" in msg
    assert "Overlayrec-Session: d" in msg and "sed -i s/alpha/ALPHA/ text.txt" in msg
    assert "agent (session d)" in msg
    # a commit checks out to the paths as they stood
    wt = tmp_path / "co"
    wt.mkdir()
    git(gd, f"--work-tree={wt}", "checkout", "-f", "refs/overlayrec/d/calls/c1", "--", ".")
    assert (wt / "text.txt").read_text() == "ALPHA\nbeta\n"
    assert os.readlink(wt / "link") == "text.txt" and not (wt / "gone.txt").exists()
    assert os.access(wt / "tool.sh", os.X_OK)
    # incremental: nothing new, nothing written; the user's repository untouched
    assert json.loads(overlayrec("export", "git", m.ws, "--json").stdout)["commits"] == 0
    assert subprocess.run(["git", "-C", m.ws, "show-ref"], capture_output=True,
                          text=True).stdout == user_refs
    assert not subprocess.run(["git", "-C", m.ws, "for-each-ref", "refs/overlayrec"],
                              capture_output=True, text=True).stdout
    # into a repository the user names
    other = tmp_path / "other.git"
    subprocess.run(["git", "init", "-q", "--bare", str(other)], check=True)
    out = json.loads(overlayrec("export", "git", m.ws, "--repo", str(other), "--ref-prefix",
                                "refs/agents", "--json").stdout)
    assert out["commits"] == 6
    assert git(str(other), "rev-parse", "refs/agents/d/head").strip() == \
        git(gd, "rev-parse", "refs/overlayrec/d/head").strip()
    r = overlayrec("export", "git", m.ws, "--repo", m.ws, check=False)
    assert r.returncode == 1 and "workspace's own repository" in r.stderr


def _strip_index(patch: str) -> str:
    return "\n".join(l for l in patch.splitlines() if not l.startswith("index "))
