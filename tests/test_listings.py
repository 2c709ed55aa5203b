"""Listings show net changes, and .git/ is said, not hidden.

One call runs git init/add/commit in the workspace, another makes and removes a temp file,
rewrites a file with the content it had, runs a chmod -R that changes no mode, and makes one
real change.  `calls` and `turns` name only what changed (`--all`: everything written), fold
.git/ into a count; `diff` and `export git` say how many .git/ changes git could not hold."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

from conftest import needs_fuse, overlayrec, run_script
from test_diff import snapshot

from overlayrec.engines.gitdiff import ObjectStore, git_refuses
from overlayrec.engines.states import State

AGENT = textwrap.dedent(r'''
    import os, subprocess
    from overlayrec import client
    env = dict(os.environ, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull,
               GIT_AUTHOR_NAME="agent", GIT_AUTHOR_EMAIL="agent@example.invalid",
               GIT_COMMITTER_NAME="agent", GIT_COMMITTER_EMAIL="agent@example.invalid")
    def sh(cmd):
        subprocess.run(["bash", "-c", cmd], check=True, env=env)
    with client.connect() as c:
        c.turn_begin(prompt="commit it")
        c.call_begin("gitcall", "Bash", summary="write app.txt, git init, add, commit")
        sh("printf 'v1\\n' > app.txt && git init -q -b main . && git add -A && "
           "git commit -q -m first")
        c.call_end("gitcall")
        c.call_begin("churn", "Bash", summary="churn and one real edit")
        sh("printf 'scratch\\n' > scratch.tmp && rm scratch.tmp")
        sh("printf 'same\\n' > same.txt")      # the content it already held
        sh("chmod -R u+r .")                   # every mode stays as it was (.git/ too)
        sh("printf 'more\\n' >> real.txt")
        c.call_end("churn")
        c.turn_end()
''')


def rows(m, *args):
    return {r["id"]: r for r in map(json.loads, overlayrec("calls", m.ws, "--json", *args)
                                    .stdout.splitlines())}


def test_git_paths_are_filtered_before_git_and_its_warnings_kept(tmp_path):
    assert git_refuses(".git/HEAD") and git_refuses("vendor/lib/.GIT/config")
    assert git_refuses(".git") and not git_refuses(".github/x") and not git_refuses("a.git/b")
    # the same answer as a look at each component, on names near ".git"
    names = [".git", ".GiT", "git", ".gitx", "x.git", ".git.", "", "a", ".", "..", "\u0130",
             ".g\u0130t", "\u03a3", ".git\u03a3"]
    for a in names:
        for b in names:
            for path in (a, f"{a}/{b}", f"x/{a}/{b}", f"{a}/{b}/y", f"{a}//{b}"):
                want = any(part.lower() == ".git" for part in path.split("/"))
                assert git_refuses(path) == want, path
    store = ObjectStore(str(tmp_path))
    f = State("file", 0o644, b"x\n")
    tree = store.tree({".git/HEAD": f, "ok.txt": f, "": State("dir", 0o755),
                       "sub/.git": State("absent")})
    assert store.diff(store.tree({}), tree, "name-status") == "A\tok.txt\n"
    assert store.left_out == {".git/HEAD", "sub/.git"}
    assert store.tree({".git/HEAD": f}) == store.tree({})
    # a name git refuses that is not .git/ itself: git's own warning is kept, not swallowed
    tree = store.tree({"git~1/x": f, "ok.txt": f})
    assert store.diff(store.tree({}), tree, "name-status") == "A\tok.txt\n"
    assert any("git~1/x" in w for w in store.warnings), store.warnings


@needs_fuse
def test_listings_net_and_git_said_not_hidden(make_mount, tmp_path):
    m = make_mount()
    for name, data in (("same.txt", "same\n"), ("real.txt", "real\n")):
        with open(os.path.join(m.ws, name), "w") as f:
            f.write(data)
    before = tmp_path / "before"
    snapshot(m.ws, before)
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    r = overlayrec("run", "-w", m.ws, "--session", "l", "--", sys.executable, str(agent),
                   cwd=m.ws, timeout=120)
    # the summary counts net changes too: app.txt and real.txt, and .git/ as a count
    assert "session l: 1 turn(s), 2 call(s), 2 file(s) changed + " in r.stderr, r.stderr
    assert " under .git/" in r.stderr

    # calls: net by default, churn in `touched`
    c = rows(m)
    churn, gitcall = c["churn"], c["gitcall"]
    assert churn["paths"] == ["real.txt"] and churn["files"] == 1, churn
    assert churn["git_changes"] == 0  # chmod -R went over .git/ and changed nothing there
    assert {"scratch.tmp", "same.txt", "real.txt"} <= set(churn["touched"])
    assert churn["touched_git"] > 0
    assert gitcall["files"] == 1 and gitcall["paths"][0] == "app.txt"
    assert gitcall["git_changes"] > 5
    assert all(p.split("/")[0] == ".git" for p in gitcall["paths"][1:])  # the workspace's first
    assert ".git/HEAD" in gitcall["paths"] and ".git/refs/heads/main" in gitcall["paths"]
    # every change here is known exactly (a file made and written is read where its writes
    # were done): no path is said to be inexact
    assert all(r["inexact"] == [] and r["around"] == [] for r in c.values()), c

    text = overlayrec("calls", m.ws).stdout
    assert "scratch.tmp" not in text and "same.txt" not in text and "real.txt" in text
    assert f"app.txt + {gitcall['git_changes']} under .git/" in text
    assert ".git/HEAD" not in text  # folded into the count
    every = overlayrec("calls", m.ws, "--all").stdout
    assert "scratch.tmp" in every and "same.txt" in every

    turns = [json.loads(l) for l in overlayrec("turns", m.ws, "--json").stdout.splitlines()]
    assert len(turns) == 1 and turns[0]["paths"][:2] == ["app.txt", "real.txt"]
    assert turns[0]["inexact"] == [], turns
    assert turns[0]["files"] == 2 and "scratch.tmp" in turns[0]["touched"]
    text = overlayrec("turns", m.ws).stdout
    assert "   2 files  app.txt, real.txt + " in text and "under .git/" in text
    assert "   4 files  " in overlayrec("turns", m.ws, "--all").stdout  # same.txt, scratch.tmp

    # the agent's own commit is in log and blame
    log = overlayrec("log", m.ws, "--call", "gitcall", "--path", ".git/*").stdout
    assert ".git/HEAD" in log and "git" in log
    for p in (".git/HEAD", ".git/refs/heads/main"):
        b = overlayrec("blame", p, "-w", m.ws).stdout
        assert "call:l:gitcall" in b, (p, b)

    # diff: says how many .git/ changes it leaves out, and the patch applies with git
    d = overlayrec("diff", m.ws, "--call", "gitcall", "--binary")
    assert "app.txt" in d.stdout and ".git/" not in d.stdout
    note = f"overlayrec: {gitcall['git_changes']} change(s) under .git/ or to a name git takes for .git not shown"
    assert note in d.stderr and "overlayrec replay" in d.stderr, d.stderr
    assert "Ignoring path" not in d.stderr
    work = tmp_path / "apply"
    snapshot(before, work)
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    a = subprocess.run(["git", "apply", "-"], input=d.stdout, text=True, cwd=work,
                       capture_output=True)
    assert a.returncode == 0, a.stderr
    assert (work / "app.txt").read_text() == "v1\n"
    for fmt in ("--stat", "--name-status", "--numstat"):
        assert note in overlayrec("diff", m.ws, "--call", "gitcall", fmt).stderr
    js = overlayrec("diff", m.ws, "--turn", "1", "--json")
    out = json.loads(js.stdout)
    assert out["git_left_out"] == len(out["git_left_out_paths"]) > 5
    assert sorted(f["path"] for f in out["files"]) == ["app.txt", "real.txt"]
    assert "under .git/ or to a name git takes for .git not shown" in js.stderr
    d = overlayrec("diff", m.ws, "--call", "churn")
    assert "real.txt" in d.stdout and "same.txt" not in d.stdout and "under .git/" not in d.stderr

    # export: the same count, and no .git/ path in any tree
    e = overlayrec("export", "git", m.ws)
    assert " change(s) under .git/ or to a name git takes for .git not exported" in e.stderr, e.stderr
    assert "overlayrec: git:" not in e.stderr  # no other warning (the root "" is no entry)
    gd = os.path.join(m.state, "git")
    tree = subprocess.run(["git", "--git-dir", gd, "ls-tree", "-r", "--name-only",
                           "refs/overlayrec/l/head"], capture_output=True, text=True,
                          check=True).stdout.split()
    assert tree == ["app.txt", "real.txt", "same.txt"]
    again = json.loads(overlayrec("export", "git", m.ws, "--json").stdout)
    assert again["commits"] == 0 and again["git_left_out"] == 0

    # the report: net paths, .git/ counted, and the call's diff says what it leaves out
    page = tmp_path / "r.html"
    overlayrec("report", m.ws, "--html", str(page))
    data = json.loads(page.read_text().split('<script id="data" type="application/json">')[1]
                      .split("</script>")[0])
    calls = {lane["call"]: lane for lane in data["lanes"] if lane["kind"] == "call"}
    assert calls["churn"]["paths"] == ["real.txt"] and "scratch.tmp" in calls["churn"]["touched"]
    assert calls["gitcall"]["git_changes"] == gitcall["git_changes"]
    diff = "".join(data["patches"][calls["gitcall"]["patch"]])
    assert "app.txt" in diff and ".git/HEAD" not in diff
    assert "under .git/ or to a name git takes for .git not shown" in diff
    assert not [c for c in data["changes"] if git_refuses(c["path"])]   # .git/: counted only


KEPT_AGENT = textwrap.dedent(r'''
    import os, subprocess, sys, time
    from overlayrec import client
    go = sys.argv[1]
    def sh(cmd):
        subprocess.run(["bash", "-c", cmd], check=True)
    with client.connect() as c:
        c.turn_begin(prompt="one")
        c.call_begin("plain", "Edit")
        sh("printf 'a\\n' > a.txt; printf 'b\\n' > b.txt; mkdir -p dir; printf 'x\\n' > dir/x")
        c.call_end("plain")
        c.call_begin("late", "Bash")  # leaves a process that writes when told, long after
        subprocess.Popen(["bash", "-c", f"for i in $(seq 1200); do [ -e {go} ] && break; "
                          f"sleep 0.05; done; [ -e {go} ] && printf 'late\\n' >> c.txt; "
                          f"touch {go}.done"],
                         start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sh("printf 'c\\n' > c.txt")
        c.call_end("late")
        c.turn_end()
        c.turn_begin(prompt="two")
        c.call_begin("moves", "Bash")
        sh("mv dir moved")             # a directory rename: its row is never kept
        c.call_end("moves")
        c.call_begin("secret", "Edit")
        sh("printf 'TOKEN=1\\n' > .env; printf 'b2\\n' > b.txt")
        c.call_end("secret")
        c.turn_end()
        open(go + ".ready", "w").close()  # the test lists now, then lets the late write go
        for _ in range(400):
            if os.path.exists(go + ".done"):
                break
            time.sleep(0.05)
''')


def listing(m, kind, *args):
    return [json.loads(l) for l in overlayrec(kind, m.ws, "--json", *args).stdout.splitlines()]


def kept_rows(kept: str) -> dict:
    """Every shard's rows in the kept-rows directory (engines.listings)."""
    rows = {}
    for name in os.listdir(kept):
        if name.endswith(".json"):
            with open(os.path.join(kept, name)) as f:
                rows.update(json.load(f)["rows"])
    return rows


@contextlib.contextmanager
def kept_aside(kept: str):
    """No kept rows while inside: the listing made then is made afresh."""
    if os.path.exists(kept):
        os.rename(kept, kept + ".aside")
    try:
        yield
    finally:
        if os.path.exists(kept + ".aside"):
            shutil.rmtree(kept, ignore_errors=True)
            os.rename(kept + ".aside", kept)


@needs_fuse
def test_kept_rows_agree_with_rows_made_afresh(make_mount, tmp_path):
    """The listings keep settled rows in the state dir (engines.listings).  After late writes
    by a call's process, writes by others, a second session, an edit while unmounted (drift)
    and a file that is not JSON, a listing made with the kept rows equals one made afresh."""
    m = make_mount()
    m.mount()
    kept = os.path.join(m.state, "listings")
    go = tmp_path / "go"
    agent = tmp_path / "agent.py"
    agent.write_text(KEPT_AGENT)

    def afresh(kind, *args):
        with kept_aside(kept):
            return listing(m, kind, *args)

    def agrees():
        """The calls (by id) once both listings agree with ones made afresh."""
        got = {}
        for kind in ("calls", "turns"):
            got[kind] = listing(m, kind)
            assert got[kind] == afresh(kind), kind
        for t in {r["turn"] for r in got["calls"]} - {None}:  # one shard of kept rows
            assert listing(m, "calls", "--turn", str(t)) == afresh("calls", "--turn", str(t))
        return {r["id"]: r for r in got["calls"]}

    run = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--session",
                            "k", "--", sys.executable, str(agent), str(go)], cwd=m.ws,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(400):
            if os.path.exists(str(go) + ".ready"):
                break
            time.sleep(0.05)
        assert os.path.exists(str(go) + ".ready")
        first = {r["id"]: r for r in listing(m, "calls")}
        assert first["plain"]["paths"] == ["a.txt", "b.txt", "dir", "dir/x"]
        assert first["secret"]["paths"] == [".env", "b.txt"]
        rows = kept_rows(kept)
        assert "call:k:plain" in rows and "call:k:late" in rows   # settled: kept
        assert "call:k:moves" not in rows and "call:k:secret" not in rows
        assert os.stat(kept).st_mode & 0o777 == 0o700
        assert {os.stat(os.path.join(kept, n)).st_mode & 0o777 for n in os.listdir(kept)} == \
            {0o600}
        agrees()
        # the late call's process writes now: its kept row goes, the listing has the write
        go.write_text("")
        assert run.wait(timeout=60) == 0
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert os.path.exists(str(go) + ".done")
    calls = agrees()
    assert calls["late"]["late_events"] >= 1 and calls["late"]["paths"] == ["c.txt"]
    with open(os.path.join(m.ws, "c.txt")) as f:
        assert f.read() == "c\nlate\n"

    # another writer, another session, then an edit while unmounted
    m.sh("printf 'outside\\n' >> a.txt")
    overlayrec("run", "-w", m.ws, "--session", "k2", "--", "bash", "-c", "printf 'z\\n' > z.txt",
               cwd=m.ws, timeout=60)
    agrees()
    m.umount()
    with open(os.path.join(m.ws, "b.txt"), "a") as f:
        f.write("edited while unmounted\n")
    agrees()
    m.mount()
    agrees()
    for name in os.listdir(kept):
        with open(os.path.join(kept, name), "w") as f:
            f.write("{not json")
    assert listing(m, "calls") == afresh("calls")
    assert listing(m, "turns") == afresh("turns")


KINDS_AGENT = textwrap.dedent(r'''
    import os
    from overlayrec import client
    deep = "/".join(["d" * 200] * 19)               # 3,818 bytes of directories
    with client.connect() as c:
        c.turn_begin(prompt="kinds")
        c.call_begin("kinds", "Bash")
        os.mkfifo("pipe")
        with open("one", "w") as f:
            f.write("one\n")
        os.link("one", "two")                     # a hard link
        os.makedirs(deep)
        with open(deep + "/" + "f" * 150, "w") as f:   # a path of 3,969 bytes
            f.write("deep\n")
        os.mkdir("real")
        os.symlink("real", "via")                 # a symlink to a directory
        with open("via/inner", "w") as f:          # written through it
            f.write("inner\n")
        c.call_end("kinds")
        c.call_begin("again", "Bash")
        with open("two", "a") as f:                # through the other name
            f.write("more\n")
        os.unlink("pipe")
        os.rename("real", "moved")                 # a directory renamed, a file beneath
        c.call_end("again")
        c.turn_end()
''')


@needs_fuse
def test_kept_rows_of_every_kind_of_path(make_mount, tmp_path):
    """Kept rows hold for what is not a plain file: a fifo, a hard link written through its
    other name, a path of nearly 4,000 bytes, a symlink to a directory written through, a
    directory renamed with a file beneath; also after the symlink's target is swapped while
    unmounted (planted on the way to the paths the rows name)."""
    m = make_mount()
    m.mount()
    kept = os.path.join(m.state, "listings")
    agent = tmp_path / "agent.py"
    agent.write_text(KINDS_AGENT)
    overlayrec("run", "-w", m.ws, "--session", "k", "--", sys.executable, str(agent),
               cwd=m.ws, timeout=120)
    deep = "/".join(["d" * 200] * 19) + "/" + "f" * 150

    def both(kind):
        got = listing(m, kind)
        with kept_aside(kept):
            assert listing(m, kind) == got, kind
        return got

    calls = {r["id"]: r for r in both("calls")}
    assert {"pipe", "one", "two", deep, "real", "real/inner", "via"} <= \
        set(calls["kinds"]["paths"]), calls["kinds"]["paths"]
    assert {"one", "two", "pipe", "real", "moved", "real/inner", "moved/inner"} <= \
        set(calls["again"]["paths"]), calls["again"]["paths"]
    assert "call:k:kinds" in kept_rows(kept)  # settled: kept, long path and all
    both("turns")
    m.umount()
    os.unlink(os.path.join(m.ws, "via"))
    os.symlink("/", os.path.join(m.ws, "via"))     # planted while unmounted
    m.mount()
    assert {r["id"]: r for r in both("calls")}["kinds"]["paths"] == calls["kinds"]["paths"]
    both("turns")


TURNS_AGENT = textwrap.dedent(r'''
    from overlayrec import client
    with client.connect() as c:
        for t in (1, 2):
            c.turn_begin(prompt=f"turn {t}")
            c.call_begin(f"c{t}", "Edit")
            with open(f"f{t}.txt", "w") as f:
                f.write(f"turn {t}\n")
            c.call_end(f"c{t}")
            c.turn_end()
''')


@needs_fuse
def test_kept_rows_are_read_by_the_turn(make_mount, tmp_path):
    """The calls' kept rows are one file per turn: ``calls --turn 2`` reads and writes only
    turn 2's, ``turns`` only the turns'; what each lists equals a listing made afresh.  The
    single file of the first version, left beside, is removed."""
    m = make_mount()
    m.mount()
    kept = os.path.join(m.state, "listings")
    agent = tmp_path / "agent.py"
    agent.write_text(TURNS_AGENT)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable, str(agent),
               cwd=m.ws, timeout=120)
    legacy = os.path.join(m.state, "listings.json")
    with open(legacy, "w") as f:
        f.write("{}")
    two = listing(m, "calls", "--turn", "2")
    assert [(r["id"], r["paths"]) for r in two] == [("c2", ["f2.txt"])]
    assert [n.endswith("-2.json") for n in os.listdir(kept)] == [True]
    assert not os.path.exists(legacy)
    assert set(kept_rows(kept)) == {"call:s:c2"}
    turns = listing(m, "turns")
    assert [(r["index"], r["paths"]) for r in turns] == [(1, ["f1.txt"]), (2, ["f2.txt"])]
    assert "turns.json" in os.listdir(kept) and len(os.listdir(kept)) == 2
    calls = listing(m, "calls")
    assert [(r["id"], r["paths"]) for r in calls] == [("c1", ["f1.txt"]), ("c2", ["f2.txt"])]
    assert len(os.listdir(kept)) == 3
    assert set(kept_rows(kept)) == {"call:s:c1", "call:s:c2", "turn:s:1", "turn:s:2"}
    with kept_aside(kept):
        assert listing(m, "calls") == calls and listing(m, "turns") == turns
        assert listing(m, "calls", "--turn", "2") == two
    # another session writes after the rows were kept: they are read back all the same
    overlayrec("run", "-w", m.ws, "--session", "s2", "--", "bash", "-c", "echo more >> f2.txt",
               cwd=m.ws, timeout=60)
    assert listing(m, "calls", "--turn", "2") == two
    assert listing(m, "turns", "--session", "s") == turns
    # a session or a turn the record does not hold is refused, not listed as if it had
    # changed nothing (as diff, revert and log --turn refuse them)
    refused = [(["calls", "--session", "nope"], "no session nope"),
               (["turns", "--session", "nope"], "no session nope"),
               (["calls", "--json", "--session", "nope"], "no session nope"),
               (["calls", "--turn", "1", "--session", "nope"], "no session nope"),
               (["log", "--session", "nope"], "no session nope"),
               (["calls", "--turn", "3"], "no turn 3"),
               (["calls", "--turn", "0", "--json"], "no turn 0"),
               (["calls", "--turn", "1", "--session", "s2"], "no turns recorded in session s2"),
               (["diff", "--turn", "1", "--session", "s2"], "no turns recorded in session s2")]
    for q, said in refused:
        r = overlayrec(q[0], m.ws, "--state-dir", m.state, *q[1:], check=False)
        assert (r.returncode, r.stdout, r.stderr) == (1, "", f"overlayrec: error: {said}\n"), \
            (q, r)
    assert listing(m, "calls", "--turn", "2", "--session", "s") == two
    # started with stderr closed (nowhere to show progress or warnings): the answer all the same
    for q in (["calls"], ["turns"], ["diff", "--session", "s", "--turn", "2", "--stat"]):
        r = subprocess.run(["sh", "-c", 'exec "$@" 2>&-', "sh", sys.executable, "-m",
                            "overlayrec", q[0], m.ws, "--state-dir", m.state, *q[1:]],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout == overlayrec(q[0], m.ws, "--state-dir",
                                                             m.state, *q[1:]).stdout, (q, r)


@needs_fuse
def test_listings_say_how_far_they_are(make_mount, tmp_path):
    """A listing tells its progress of the rows it computes (not of those it reads back)."""
    from overlayrec.engines import listings
    from overlayrec.engines.states import States, Tree
    from overlayrec.journal import Journal
    m = make_mount()
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(TURNS_AGENT)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable, str(agent),
               cwd=m.ws, timeout=120)
    kept = str(tmp_path / "kept")
    j = Journal(m.state, readonly=True)
    tree = Tree.at(m.ws)
    try:
        for kind, want in (("calls", [(2, 2)]), ("turns", [(1, 2), (2, 2)])):
            fn = listings.call_rows if kind == "calls" else listings.turn_rows
            ticks: list = []
            rows = fn(j, States(j, tree), kept, progress=lambda n, t: ticks.append((n, t)))
            assert ticks == want, kind
            assert [r["paths"] for r in rows] == [["f1.txt"], ["f2.txt"]]
            ticks.clear()
            assert fn(j, States(j, tree), kept, progress=lambda n, t: ticks.append((n, t))) \
                == rows
            assert ticks == [], kind   # all read back
    finally:
        os.close(tree.root_fd)
        j.close()


def test_progress_shows_long_work_on_a_terminal_only(capsys):
    from overlayrec.readers import Progress
    quick = Progress("calls")
    quick.on = True   # as on a terminal
    quick(100, 300)
    quick.done()
    assert capsys.readouterr().err == ""   # under a second: nothing said
    slow = Progress("calls")
    slow.on, slow.start = True, slow.start - 2
    slow(100, 300)
    slow(150, 300)   # right after: not said (ten times a second at most)
    slow(300, 300)   # the last always is
    slow.done()
    err = capsys.readouterr().err
    line = "overlayrec: calls 300/300"
    assert err == f"\roverlayrec: calls 100/300\r{line}\r{' ' * len(line)}\r"
    phases = Progress("reverting")   # a second phase is said from its first step, its line
    phases.on, phases.start = True, phases.start - 2   # covering the longer one before it
    phases(2, 2)
    phases(1, 2, "reading")
    phases(2, 2, "reading")
    phases.done()
    err = capsys.readouterr().err
    wide = len("overlayrec: reverting 2/2")
    assert err == ("\roverlayrec: reverting 2/2\r" + "overlayrec: reading 1/2".ljust(wide) +
                   "\r" + "overlayrec: reading 2/2".ljust(wide) + "\r" + " " * wide + "\r")
    piped = Progress("calls")   # stderr is no terminal under pytest
    piped.start -= 2
    piped(1, 2)
    piped.done()
    assert capsys.readouterr().err == ""


def test_call_lines_escape_what_one_line_and_shown_escape():
    """``calls``'s text looks at a row's fields and paths all at once and escapes each only
    when one needs it: every row reads as each field through ``one_line`` and each path
    through ``shown``, odd ones (a newline, a quote, a backslash, a bidi mark, a name that is
    not UTF-8, the workspace's root) and plain ones alike."""
    from overlayrec.readers import _CALL_LINE, _UNDER_CALL, call_lines
    from overlayrec.views import one_line, shown
    odd = ["plain.txt", "new\nline", 'quote"d', "back\\slash", "bidi\u202emark",
           "undecodable\udcff", "", "a, b", "tab\there"]
    pairs = []
    for i, name in enumerate(odd):
        paths = [f"d/{name}", "fine.py"] if i % 2 else [name, "fine.py", "x/y"]
        c = {"session": "s" if i % 3 else f"s{name}", "turn": i or None, "id": f"c{i}",
             "tool": "Bash" if i % 2 else f"T{name}", "summary": f"run {name}" if i % 4 else None}
        f = {"paths": paths, "files": len(paths), "git_changes": 0, "touched": None,
             "touched_files": len(paths), "touched_git": 0,
             "processes": ["sh[1]", f"{name}[2]"], "around": [], "inexact": [],
             "guessed": [], "active_with": [], "late": []}
        pairs.append((c, f))
    want = []
    for c, f in pairs:
        want.append(_CALL_LINE % (one_line(c["session"]), c["turn"] or "-", one_line(c["id"]),
                                  one_line(c["tool"]), f["files"], one_line(c["summary"] or ""),
                                  one_line(", ".join(f["processes"][:4]))))
        # (a name holding the separator is quoted too: "a, b" read as two names)
        want.append(_UNDER_CALL + ", ".join(f'"{p}"' if ", " in p and shown(p) == p else
                                            shown(p) for p in f["paths"]))
    got = call_lines(pairs, churn=False, as_json=False)
    assert [stream for stream, _ in got] == [1]
    assert got[0][1] == "\n".join(want) + "\n", (got, want)


def test_runs_summary_counts_its_own_files_and_names_the_others(tmpbase):
    """Session B wrote three files while session A's agent ran: A's summary said "4 file(s)
    changed" for a session that changed one (its lines below named B's apart).  Found by a
    bug hunt."""
    from conftest import SLOW, force_unmount, wait_unmounted
    ws = os.path.join(tmpbase, "ws")
    os.mkdir(ws)
    env = dict(os.environ, XDG_STATE_HOME=os.path.join(tmpbase, "st"))
    a_in, b_done = os.path.join(tmpbase, "a_in"), os.path.join(tmpbase, "b_done")
    a = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", ws, "--session", "A",
                          "--", "sh", "-c", f"echo a > a.txt; touch {a_in}; "
                          f"while [ ! -e {b_done} ]; do sleep 0.05; done"],
                         env=env, stderr=subprocess.PIPE, text=True, cwd=ws)
    try:
        deadline = time.monotonic() + 30 * SLOW
        while not os.path.exists(a_in):
            assert time.monotonic() < deadline and a.poll() is None
            time.sleep(0.05)
        overlayrec("run", "-w", ws, "--session", "B", "--", "sh", "-c",
                   "echo 1 > b1.txt; echo 2 > b2.txt; echo 3 > b3.txt", env=env, cwd=ws)
        open(b_done, "w").close()
        _, err = a.communicate(timeout=60 * SLOW)
        assert a.returncode == 0, err
        assert "session A: 0 turn(s), 0 call(s), 1 file(s) changed\n" in err, err
        assert "  session B: 3 file(s)" in err, err
        wait_unmounted(ws, "the mount outlived the runs")
    finally:
        if a.poll() is None:
            a.kill()
        force_unmount(ws)


def test_runs_summary_leaves_out_what_others_wrote_after_its_end(make_mount):
    """A `run` whose mount was still held as it let it go waited for its daemon, and printed
    its summary after the next `run` had written: "session B: 1 file(s)" under session A's,
    which had ended before B began.  Other writers count from the session's begin to its end;
    its own late writes (a process it left running) still count."""
    from overlayrec.views import session_summary
    m = make_mount().mount()
    overlayrec("run", "-w", m.ws, "--session", "A", "--", "sh", "-c", "echo a > a.txt",
               cwd=m.ws)
    overlayrec("run", "-w", m.ws, "--session", "B", "--", "sh", "-c", "echo b > b.txt",
               cwd=m.ws)
    j = m.journal()
    try:
        a, b = session_summary(j, "A"), session_summary(j, "B")
    finally:
        j.close()
    assert a == ["overlayrec: session A: 0 turn(s), 0 call(s), 1 file(s) changed",
                 "  the agent itself: 1 file(s)"], a
    assert b == ["overlayrec: session B: 0 turn(s), 0 call(s), 1 file(s) changed",
                 "  the agent itself: 1 file(s)"], b


def test_calls_and_turns_print_ids_whole(make_mount, tmp_path):
    """A Claude Code call id (toolu_ and 24 more) and a session's UUID were cut to 24 and 14
    characters in `calls` and `turns`: pasted back, "no call toolu_01A09q90qw90lq9178".
    Found by a bug hunt."""
    m = make_mount().mount()
    sid, cid = "0b6c2a8e-1f3d-4c5e-9a7b-1234567890ab", "toolu_01A09q90qw90lq917835lq9"
    o = f"{sys.executable} -m overlayrec"
    overlayrec("run", "-w", m.ws, "--session", sid, "--", "sh", "-c",
               f"{o} turn begin --prompt p; {o} call begin --id {cid} --tool Bash; "
               f"echo x > x.txt; {o} call end --id {cid}; {o} turn end", cwd=m.ws)
    calls = overlayrec("calls", m.ws).stdout
    assert calls.split()[0] == sid and cid in calls.split(), calls
    assert overlayrec("turns", m.ws).stdout.split()[0] == sid
    assert "+x" in overlayrec("diff", m.ws, "--call", calls.split()[2]).stdout


def test_readers_take_the_agents_own_name_for_its_session(make_mount):
    """Claude Code names its session by its own id, which the record keeps as an alias of the
    session `run` began: `diff`, `calls` and `turns --session <that id>` said "no session".
    Found by a bug hunt."""
    m = make_mount().mount()
    o = f"{sys.executable} -m overlayrec"
    overlayrec("run", "-w", m.ws, "--session", "R", "--", "sh", "-c",
               f"{o} session begin --session claude-uuid-1; {o} turn begin --prompt p; "
               f"{o} call begin --id c1 --tool Bash; echo x > x.txt; {o} call end --id c1; "
               f"{o} turn end", cwd=m.ws)
    assert "x.txt" in overlayrec("diff", m.ws, "--session", "claude-uuid-1", "--stat").stdout
    assert overlayrec("calls", m.ws, "--session", "claude-uuid-1").stdout.split()[:3] == \
        ["R", "1", "c1"]
    assert overlayrec("turns", m.ws, "--session", "claude-uuid-1").stdout.split()[0] == "R"


def test_a_calls_row_says_it_names_only_its_first_processes():
    """``calls`` names a row's first 4 processes and, as for its paths, " ..." when it had
    more (`--json` names them all); it cut the list with no word (found by a bug hunt)."""
    from overlayrec.readers import call_lines
    procs = [f"p{i}[{i}]" for i in range(6)]
    pairs = []
    for n in (4, 6):
        c = {"session": "s", "turn": 1, "id": f"c{n}", "tool": "Bash", "summary": None}
        f = {"paths": ["a"], "files": 1, "git_changes": 0, "touched": None,
             "touched_files": 1, "touched_git": 0, "processes": procs[:n], "around": [],
             "inexact": [], "guessed": [], "active_with": [], "late": []}
        pairs.append((c, f))
    rows = [line for line in call_lines(pairs, churn=False, as_json=False)[0][1].splitlines()
            if line.startswith("s ")]
    assert rows[0].endswith("p0[0], p1[1], p2[2], p3[3]"), rows
    assert rows[1].endswith("p0[0], p1[1], p2[2], p3[3] ..."), rows


@needs_fuse
def test_runs_summary_names_no_writer_that_left_nothing_changed(make_mount, tmp_path):
    """A user's `sed -i` that matched nothing (a rewrite with the same content) during a run:
    the summary listed "outside: sed[PID]: 0 file(s)"; a listing names only what a writer
    left changed (found by a bug hunt).  One that changed a file is still named."""
    m = make_mount()
    for name in ("f", "g"):
        with open(os.path.join(m.ws, name), "w") as f:
            f.write("base\n")
    m.mount()
    ready, go = tmp_path / "ready", tmp_path / "go"
    run = subprocess.Popen(
        [sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--session", "s", "--", "sh",
         "-c", f"sh -c 'echo agent >> f'; touch {ready}; while [ ! -e {go} ]; do sleep 0.02; "
         "done"], cwd=m.ws, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline and run.poll() is None
            time.sleep(0.02)
        m.sh("sed -i s/nomatch/x/ f")        # the same content: no change
        m.sh("sed -i s/base/user/ g")        # a change
        go.touch()
        _, err = run.communicate(timeout=60)
        assert run.returncode == 0, err
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    outside = [line for line in err.splitlines() if line.startswith("  outside: ")]
    assert len(outside) == 1 and outside[0].endswith(": 1 file(s)"), err
    assert "agent tool calls: 1 file(s)" in err, err


@needs_fuse
def test_a_turn_is_shared_only_with_a_writer_that_left_something_changed(make_mount, tmp_path):
    """An editor's swap and lock files made and removed during a turn: `turns` said the turn
    was "shared with" it, where the run's summary and `calls` named nothing (found by a bug
    hunt).  A writer that changed a file is still named."""
    m = make_mount()
    with open(os.path.join(m.ws, "f"), "w") as f:
        f.write("base\n")
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(textwrap.dedent(r'''
        import os, subprocess, sys, time
        from overlayrec import client
        ready, go = sys.argv[1], sys.argv[2]
        with client.connect() as c:
            for n in (1, 2):
                c.turn_begin(prompt=f"turn {n}")
                c.call_begin(f"c{n}", "Bash")
                subprocess.run(["sh", "-c", f"echo agent{n} >> f"], check=True)
                c.call_end(f"c{n}")
                open(f"{ready}.{n}", "w").close()
                while not os.path.exists(f"{go}.{n}"):
                    time.sleep(0.02)
                c.turn_end()
    '''))
    ready, go = tmp_path / "ready", tmp_path / "go"
    run = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--session",
                            "s", "--", sys.executable, str(agent), str(ready), str(go)],
                           cwd=m.ws)
    try:
        for n, user in ((1, "touch .f.swp && ln -s x .#f && rm .f.swp .#f"),
                        (2, "echo user > g")):
            deadline = time.monotonic() + 30
            while not os.path.exists(f"{ready}.{n}"):
                assert time.monotonic() < deadline and run.poll() is None
                time.sleep(0.02)
            m.sh(user)
            open(f"{go}.{n}", "w").close()
        assert run.wait(timeout=60) == 0
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    rows = [json.loads(x) for x in overlayrec("turns", m.ws, "--json").stdout.splitlines()]
    assert rows[0]["others"] == [], rows
    assert len(rows[1]["others"]) == 1 and rows[1]["others"][0].startswith("bash["), rows
    assert rows[0]["touched_others"], rows  # --json carries every writer too
    text = overlayrec("turns", m.ws).stdout.splitlines()
    assert "shared with" not in text[0] and "shared with bash[" in text[-1], text
    every = overlayrec("turns", m.ws, "--all").stdout
    assert every.count("shared with") == 2, every  # --all names every writer


def test_a_name_holding_the_listings_separator_is_quoted(make_mount, tmp_path):
    """`calls` joins a call's paths with ", ": one file named ``a, b`` read as two files
    ``a`` and ``b`` (found by a bug hunt); such a name is quoted now."""
    m = make_mount()
    m.mount()
    run_script(m, tmp_path, 'or call begin --id A --tool Bash --summary s\n'
                            'echo x > "a, b"; echo y > c\nor call end --id A\n')
    out = overlayrec("calls", m.ws).stdout
    assert [x.strip() for x in out.splitlines() if "a, b" in x] == ['"a, b", c'], out
