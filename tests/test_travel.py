"""Records that travel: two recorded workspaces push their exports to one bare repository, a
third repository fetches them and reads diffs, a blame and a report from git alone."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import needs_fuse, overlayrec
from test_diff import AGENT, seed
from overlayrec.journal import schema

pytestmark = [needs_fuse, pytest.mark.timeout(400)]

AGENT_B = textwrap.dedent(r'''
    import subprocess
    from overlayrec import client
    with client.connect() as c:
        c.turn_begin(prompt="other host's work")
        c.call_begin("c1", "Write", summary="a new module")
        with open("mod.py", "w") as f:
            f.write("def f():\n    return 1\n")
        c.call_end("c1")
        c.call_begin("c2", "Bash")
        subprocess.run(["bash", "-c", "echo tail >> text.txt && rm blob.bin"], check=True)
        c.call_end("c2")
        c.turn_end()
''')

AGENT_MORE = textwrap.dedent(r'''
    from overlayrec import client
    with client.connect() as c:
        c.turn_begin(prompt="more")
        c.call_begin("e1", "Edit")
        with open("text.txt", "a") as f:
            f.write("one more line\n")
        c.call_end("e1")
        c.turn_end()
''')


def git(git_dir, *args):
    r = subprocess.run(["git", "--git-dir", str(git_dir), *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def refs(git_dir) -> dict[str, str]:
    out = git(git_dir, "for-each-ref", "--format=%(refname) %(objectname)")
    return dict(line.split() for line in out.splitlines())


def stored_objects(git_dir) -> int:
    got = dict(line.split(": ") for line in git(git_dir, "count-objects", "-v").splitlines())
    return int(got["count"]) + int(got["in-pack"])


def object_ids(git_dir) -> set[str]:
    return set(git(git_dir, "cat-file", "--batch-all-objects", "--batch-check=%(objectname)")
               .split())


def record(m, tmp_path, agent: str, session: str) -> None:
    path = tmp_path / f"agent-{session}-{os.path.basename(m.base)}.py"
    path.write_text(agent)
    overlayrec("run", "-w", m.ws, "--state-dir", m.state, "--session", session, "--",
               sys.executable, str(path), cwd=m.ws)


def seen_on_origin(m, session: str, calls: list[str]) -> dict:
    """What `overlayrec diff` prints on the origin, to compare with the fetched side."""
    d = lambda *a: overlayrec("diff", m.ws, "--state-dir", m.state, *a).stdout  # noqa: E731
    out = {("session", "patch"): d("--session", session),
           ("session", "binary"): d("--session", session, "--binary"),
           ("turn", "stat"): d("--session", session, "--turn", "1", "--stat"),
           ("turn", "patch"): d("--session", session, "--turn", "1")}
    for c in calls:
        out[(c, "patch")] = d("--session", session, "--call", c)
        out[(c, "name-status")] = d("--session", session, "--call", c, "--name-status")
    return out


def read_fetched(clone, origin: str, session: str, calls: list[str]) -> dict:
    r = lambda *a: overlayrec("records", "diff", "--git", str(clone), "--origin",  # noqa: E731
                              origin, "--session", session, *a).stdout
    out = {("session", "patch"): r(), ("session", "binary"): r("--binary"),
           ("turn", "stat"): r("--turn", "1", "--stat"), ("turn", "patch"): r("--turn", "1")}
    for c in calls:
        out[(c, "patch")] = r("--call", c)
        out[(c, "name-status")] = r("--call", c, "--name-status")
    return out


def test_two_workspaces_push_a_third_fetches_and_reads(make_mount, tmp_path):
    a, b = make_mount(sub="a"), make_mount(sub="b")
    try:
        for m in (a, b):
            seed(m.ws)
            m.mount()
        # the same session name and call ids in both: the origins keep them apart
        record(a, tmp_path, AGENT, "d")
        record(b, tmp_path, AGENT_B, "d")
        want_a = seen_on_origin(a, "d", ["c1", "c2", "c3"])
        want_b = seen_on_origin(b, "d", ["c1", "c2"])
        assert want_a[("session", "patch")] and want_b[("session", "patch")]
        assert want_a[("session", "patch")] != want_b[("session", "patch")]

        remote = tmp_path / "server.git"
        subprocess.run(["git", "init", "-q", "--bare", str(remote)], check=True)
        out_a = json.loads(overlayrec("export", "git", a.ws, "--state-dir", a.state, "--push",
                                      str(remote), "--json").stdout)
        out_b = json.loads(overlayrec("export", "git", b.ws, "--state-dir", b.state, "--push",
                                      str(remote), "--origin", "ci-runner-7", "--json").stdout)
        origin_a = out_a["push"]["origin"]
        assert re.fullmatch(r"[A-Za-z0-9._-]+-ws-[0-9a-f]{8}", origin_a), origin_a  # host-ws-id
        assert out_b["push"]["origin"] == "ci-runner-7"
        on_server = refs(remote)
        for o, calls in ((origin_a, ["c1", "c2", "c3"]), ("ci-runner-7", ["c1", "c2"])):
            pre = f"refs/overlayrec/origins/{o}/d/"
            assert {pre + n for n in ["base", "head", "sides", "turns/1"]
                    + [f"calls/{c}" for c in calls]} <= set(on_server), on_server
        assert on_server[f"refs/overlayrec/origins/{origin_a}/d/head"] != \
            on_server["refs/overlayrec/origins/ci-runner-7/d/head"]
        # the push named exactly what it made on the remote
        assert sorted(out_a["push"]["new"]) == sorted(
            r for r in on_server if r.startswith(f"refs/overlayrec/origins/{origin_a}/"))

        # a third machine: fetch, then read from git alone (both workspaces unmounted and
        # their state dirs out of reach would change nothing: nothing here opens them)
        clone = tmp_path / "elsewhere" / "records.git"
        fetched = json.loads(overlayrec("fetch", str(remote), "--into", str(clone),
                                        "--json").stdout)
        assert fetched["origins"] == sorted([origin_a, "ci-runner-7"]) and \
            fetched["sessions"] == 2
        listed = [json.loads(l) for l in overlayrec("records", "list", "--git", str(clone),
                                                    "--json").stdout.splitlines()]
        assert {(r["origin"], r["session"], r["calls"]) for r in listed} == \
            {(origin_a, "d", 3), ("ci-runner-7", "d", 2)}
        assert read_fetched(clone, origin_a, "d", ["c1", "c2", "c3"]) == want_a
        assert read_fetched(clone, "ci-runner-7", "d", ["c1", "c2"]) == want_b
        # a selection in two origins is refused until one is named
        r = overlayrec("records", "diff", "--git", str(clone), "--call", "c1", check=False)
        assert r.returncode == 1 and "several sessions" in r.stderr

        # blame: each exported commit that changed text.txt, newest first, per origin
        rows = [json.loads(l) for l in overlayrec("records", "blame", "text.txt", "--git",
                                                  str(clone), "--json").stdout.splitlines()]
        mine = [r["unit"] for r in rows if r["origin"] == origin_a]
        assert mine[:3] == ["call:d:c3", "call:d:c2", "call:d:c1"], rows
        assert [r["unit"] for r in rows if r["origin"] == "ci-runner-7"][:1] == ["call:d:c2"]
        c1 = next(r for r in rows if r["unit"] == "call:d:c1" and r["origin"] == origin_a)
        assert c1["before"] == {"kind": "file", "size": len("alpha\nbeta\n")}
        assert any("sed -i s/alpha/ALPHA/ text.txt" in p for p in c1["processes"])
        text = overlayrec("records", "blame", "text.txt", "--git", str(clone), "--origin",
                          "ci-runner-7").stdout
        assert "call:d:c2" in text and origin_a not in text

        # the report: both origins, every call, each call's diff in the page
        page_path = tmp_path / "records.html"
        overlayrec("records", "report", "--git", str(clone), "--html", str(page_path))
        page = page_path.read_text()
        assert origin_a in page and "ci-runner-7" in page
        assert f'id="call-{origin_a}-d-c3"' in page and 'id="call-ci-runner-7-d-c2"' in page
        assert "+def f():" in page and "-alpha" in page and "a new module" in page

        # more calls on a: the second push sends only the new session's refs and objects
        record(a, tmp_path, AGENT_MORE, "e")
        before_refs, before_objects = refs(remote), stored_objects(remote)
        before_ids = object_ids(remote)
        out = json.loads(overlayrec("export", "git", a.ws, "--state-dir", a.state, "--push",
                                    str(remote), "--json").stdout)
        assert out["commits"] == 3 and out["push"]["origin"] == origin_a  # base, e1, turn 1
        after = refs(remote)
        pre = f"refs/overlayrec/origins/{origin_a}/e/"
        assert sorted(out["push"]["new"]) == sorted(
            pre + n for n in ["base", "calls/e1", "head", "sides", "turns/1"])
        assert out["push"]["updated"] == []
        assert set(after) - set(before_refs) == set(out["push"]["new"])
        assert {k: after[k] for k in before_refs} == before_refs   # old refs did not move
        # every object stored now is one the remote lacked (none sent twice), and each is
        # reachable from the new refs
        added = object_ids(remote) - before_ids
        assert added and stored_objects(remote) - before_objects == len(added)
        reachable = {l.split()[0] for l in git(remote, "rev-list", "--objects",
                                               *out["push"]["new"]).splitlines()}
        assert added <= reachable
        # nothing new: nothing sent
        again = json.loads(overlayrec("export", "git", b.ws, "--state-dir", b.state, "--push",
                                      str(remote), "--origin", "ci-runner-7", "--json").stdout)
        assert again["commits"] == 0 and again["push"]["new"] == again["push"]["updated"] == []
        assert refs(remote) == after
        # the fetch side follows
        overlayrec("fetch", str(remote), "--into", str(clone))
        assert overlayrec("records", "diff", "--git", str(clone), "--session", "e").stdout == \
            overlayrec("diff", a.ws, "--state-dir", a.state, "--session", "e").stdout
    finally:
        for m in (a, b):
            m.umount()


def test_a_remote_git_refuses_is_one_line(tmp_path):
    """git's reason, not its advice: a fetch from (or push to) a remote that is no repository
    fails with one line that says so, and leaves nothing behind: the bare repository it made
    for them is taken away again (as git clone does), one that was there is left as it was."""
    missing = str(tmp_path / "no" / "such.git")
    recs = tmp_path / "recs.git"
    r = overlayrec("fetch", missing, "--into", str(recs), check=False)
    assert r.returncode == 1, r
    assert r.stderr.count("\n") == 1 and "\\n" not in r.stderr, r.stderr
    assert r.stderr == (f"overlayrec: error: git fetch from {missing} failed: '{missing}' does "
                        "not appear to be a git repository\n")
    assert not os.path.lexists(recs)
    subprocess.run(["git", "init", "-q", "--bare", str(recs)], check=True)
    before = sorted(os.listdir(recs))
    assert overlayrec("fetch", missing, "--into", str(recs), check=False).returncode == 1
    assert sorted(os.listdir(recs)) == before
    # an empty directory given is left empty again (a bare repository was left in it: found
    # by a bug hunt), as git clone leaves it
    empty = tmp_path / "empty"
    empty.mkdir()
    assert overlayrec("fetch", missing, "--into", str(empty), check=False).returncode == 1
    assert os.listdir(empty) == []


ODD_IDS = ["a b", "x:y", "x..y", "x.lock", "../../up", "t~1^2", "-dash", "q?*[", "\u00e9t\u00e9",
           "new\nline", "@{x}", "end/", "50%",
           "L" * 250]  # cut to fit a ref: found by its trailer (it was "not in the records")

AGENT_ODD = textwrap.dedent(r'''
    import subprocess, sys, json
    from overlayrec import client
    with client.connect() as c:
        c.turn_begin(prompt="odd ids")
        for i, cid in enumerate(json.loads(sys.argv[1])):
            c.call_begin(cid, "Bash")
            subprocess.run(["bash", "-c", f"echo {i} > f{i}"], check=True)
            c.call_end(cid)
        c.turn_end()
''')


def test_sessions_and_calls_any_git_ref_would_refuse_are_exported(make_mount, tmp_path):
    """A session's name and a call's id come from the user and the agent: a space, ``..``,
    ``:``, ``~``, a slash, a newline.  git refuses them in a ref name; the export writes them
    ``%XX``-encoded, one-to-one, and the readers of fetched records find them by their own
    names.  Found by hand: one such id made the whole export fail (fast-import: "Branch name
    doesn't conform to GIT standards")."""
    m = make_mount().mount()
    path = tmp_path / "agent.py"
    path.write_text(AGENT_ODD)
    session = "s/../x y"
    overlayrec("run", "-w", m.ws, "--state-dir", m.state, "--session", session, "--",
               sys.executable, str(path), json.dumps(ODD_IDS), cwd=m.ws)
    remote = tmp_path / "remote.git"
    subprocess.run(["git", "init", "-q", "--bare", str(remote)], check=True)
    overlayrec("export", "git", m.ws, "--state-dir", m.state, "--push", str(remote),
               "--origin", "here")
    names = list(refs(remote))
    assert len([n for n in names if "/calls/" in n]) == len(ODD_IDS), names
    for n in names:
        subprocess.run(["git", "check-ref-format", n], check=True)
    clone = tmp_path / "fetched"
    overlayrec("fetch", str(remote), "--into", str(clone))
    assert overlayrec("records", "list", "--git", str(clone)).stdout.split()[1:5] == \
        ["s/../x", "y", "1", "turn(s),"]
    seen = seen_on_origin(m, session, ODD_IDS)
    assert read_fetched(clone, "here", session, ODD_IDS) == seen
    for i, cid in enumerate(ODD_IDS):
        assert f"+++ b/f{i}\n" in seen[(cid, "patch")], cid
    # the commits' trailers name each call whole: one holding a newline was cut there, so
    # `records blame` named a call that never was and `records report` failed on it (a hunt)
    for i, cid in enumerate(ODD_IDS):
        rows = [json.loads(line) for line in overlayrec(
            "records", "blame", "--git", str(clone), f"f{i}", "--json").stdout.splitlines()]
        assert rows and all(r["unit"] == schema.call_unit(session, cid) for r in rows), rows
    overlayrec("records", "report", "--git", str(clone), "--html", str(tmp_path / "r.html"))


def test_a_push_under_an_origin_another_workspace_pushes_as_is_refused(make_mount, tmp_path):
    """Two workspaces pushed under the same `--origin`: the second push moved the first's
    refs by force ("updated 3") and the remote mixed the two records (calls of one beside
    the base and head of the other).  Refused in one line, nothing moved; the first
    workspace's own later pushes go on as before.  Found by a bug hunt."""
    a, b = make_mount(sub="a"), make_mount(sub="b")
    remote = tmp_path / "server.git"
    subprocess.run(["git", "init", "-q", "--bare", str(remote)], check=True)
    push = lambda m, *more: overlayrec("export", "git", m.ws, "--state-dir", m.state,  # noqa
                                       "--push", str(remote), "--origin", "ci", *more,
                                       check=False)
    for m in (a, b):
        seed(m.ws)
        m.mount()
    record(a, tmp_path, AGENT, "d")
    record(b, tmp_path, AGENT_B, "d")
    assert push(a).returncode == 0
    before = refs(remote)
    r = push(b)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r
    assert "another workspace as origin 'ci'" in r.stderr and "--origin" in r.stderr, r.stderr
    assert refs(remote) == before
    record(a, tmp_path, AGENT_B, "e")
    r = push(a, "--json")
    assert r.returncode == 0, r.stderr
    assert "refs/overlayrec/origins/ci/e/head" in json.loads(r.stdout)["push"]["new"]
    assert refs(remote)["refs/overlayrec/origins/ci/d/head"] == before[
        "refs/overlayrec/origins/ci/d/head"]


def test_a_file_past_the_patch_limit_is_left_out_of_the_records_diff_too(make_mount, tmp_path):
    """A file past the size a patch holds (engines.large.LIMIT, lowered here) is left out of
    the origin's diff and named on stderr; the fetched records' diff of the same call, turn and
    session gave it whole (the call's commit holds it; found by a bug hunt)."""
    env = dict(os.environ, OVERLAYREC_LARGE_FILE=str(1 << 20),
               OVERLAYREC_HOLD_FILE=str(1 << 19))
    m = make_mount(env=env).mount()
    with open(os.path.join(m.ws, "a"), "w") as f:
        f.write("a\n")
    agent = tmp_path / "agent.py"
    agent.write_text(textwrap.dedent(r'''
        import subprocess
        from overlayrec import client
        with client.connect() as c:
            c.turn_begin(prompt="big")
            c.call_begin("c1", "Bash")
            subprocess.run(["bash", "-c", "head -c 3000000 /dev/urandom > big.bin; "
                            "echo b >> a"], check=True)
            c.call_end("c1")
            c.turn_end()
    '''))
    overlayrec("run", "-w", m.ws, "--state-dir", m.state, "--session", "s", "--",
               sys.executable, str(agent), cwd=m.ws, env=env)
    remote = tmp_path / "remote.git"
    subprocess.run(["git", "init", "-q", "--bare", str(remote)], check=True)
    overlayrec("export", "git", m.ws, "--state-dir", m.state, "--push", str(remote),
               "--origin", "here", env=env)
    clone = tmp_path / "fetched"
    overlayrec("fetch", str(remote), "--into", str(clone), env=env)
    for sel in (["--call", "c1"], ["--turn", "1"], []):
        for fmt in (["--name-status"], ["--binary"]):
            origin = overlayrec("diff", m.ws, "--state-dir", m.state, "--session", "s",
                                *sel, *fmt, env=env)
            fetched = overlayrec("records", "diff", "--git", str(clone), "--session", "s",
                                 *sel, *fmt, env=env)
            assert "big.bin" in origin.stderr and "big.bin" not in origin.stdout, origin
            assert fetched.stdout == origin.stdout, (sel, fmt, fetched.stdout[:300])


def test_an_origin_name_git_would_refuse_is_refused_first(tmp_path):
    """`--origin a..b` passed the check and the export then failed in git's push ("invalid
    refspec"); a workspace whose name held `..` made a default origin git refuses the same way
    (found by a bug hunt).  Refused in one line before anything is exported."""
    from overlayrec.engines.gitdiff import GitError
    from overlayrec.engines.travel import origin_name
    state = str(tmp_path / "none.json")
    for bad in ("a..b", "a/b", "x.lock", "..", "-x"):
        with pytest.raises(GitError, match="use letters"):
            origin_name(state, str(tmp_path), bad)
    assert origin_name(state, str(tmp_path), "ci-runner.7") == "ci-runner.7"
    made = origin_name(state, str(tmp_path / "a..b"))
    assert ".." not in made and "a.b" in made, made
    check = subprocess.run(["git", "check-ref-format", f"refs/overlayrec/origins/{made}/x"])
    assert check.returncode == 0, made


def test_fetch_into_a_project_directory_is_refused(tmp_path):
    """`fetch --into` a project's directory (files, no repository) ran `git init --bare`
    there: HEAD, config, objects/, hooks/ among the project's files (found by a bug hunt)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "main.py").write_text("print(1)\n")
    r = overlayrec("fetch", str(tmp_path / "nowhere"), "--into", str(proj), check=False)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "holds files and no git repository" in r.stderr, r.stderr
    assert sorted(os.listdir(proj)) == ["main.py"]
