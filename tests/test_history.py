"""Path history and seals on a real mount: a directory rename shows (and reverts) as every file
that moved, through nested and repeated renames; an edit made while unmounted is drift, never
the agent's: diffs end at the seals, revert calls it a `changed` conflict, status and blame say
so, and the next mount journals it as the outside unit "while unmounted"."""
from __future__ import annotations

import json
import os
import sys
import textwrap

from conftest import needs_fuse, overlayrec, run_script

pytestmark = needs_fuse

AGENT = textwrap.dedent(r'''
    import subprocess, sys
    from overlayrec import client
    def sh(cmd):
        subprocess.run(["bash", "-ec", cmd], check=True)
    with client.connect() as c:
        c.turn_begin(prompt="one")
        c.call_begin("edit", "Bash")
        sh("echo changed > tests/a.py && mkdir -p tests/__pycache__ && echo pyc > tests/__pycache__/a.pyc")
        c.call_end("edit")
        c.turn_end()
        c.turn_begin(prompt="two")
        c.call_begin("mv", "Bash")
        sh("mv tests testsuite && mkdir tests && echo fresh > tests/new.py")
        c.call_end("mv")
        c.call_begin("nested", "Bash")
        sh("mv testsuite/deep testsuite/deeper && mv testsuite suite2 && echo more >> suite2/b.py")
        sh("echo agent >> CHANGELOG")
        c.call_end("nested")
        c.turn_end()
''')


def tree(root: str) -> dict:
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in (".overlayrec-attic",)]
        for n in files + dirs:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir", st.st_mode & 0o7777)
            elif not os.path.isfile(p):  # a fifo (never opened: that would block)
                out[rel] = ("special", st.st_mode)
            else:
                out[rel] = ("file", open(p, "rb").read(), st.st_mode & 0o7777)
    return out


def session(make_mount, tmp_path):
    m = make_mount()
    os.makedirs(os.path.join(m.ws, "tests", "deep", "er"))
    for rel, text in (("tests/a.py", "a\n"), ("tests/b.py", "b\n"), ("tests/deep/c.py", "c\n"),
                      ("tests/deep/er/d.py", "d\n"), ("CHANGELOG", "v1\n")):
        with open(os.path.join(m.ws, rel), "w") as f:
            f.write(text)
    snaps = {"start": tree(m.ws)}
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable, str(agent), cwd=m.ws)
    snaps["end"] = tree(m.ws)
    return m, snaps


def names(out: str) -> set[tuple]:
    return {tuple(line.split("\t")) for line in out.splitlines() if line}


def test_directory_renames_in_every_reader(make_mount, tmp_path):
    m, snaps = session(make_mount, tmp_path)
    moved = names(overlayrec("diff", m.ws, "--call", "mv", "--name-status").stdout)
    assert moved == {("R100", f"tests/{p}", f"testsuite/{p}") for p in
                     ("a.py", "b.py", "deep/c.py", "deep/er/d.py", "__pycache__/a.pyc")} | \
        {("A", "tests/new.py")}, moved
    nested = names(overlayrec("diff", m.ws, "--call", "nested", "--name-status").stdout)
    assert ("R100", "testsuite/deep/er/d.py", "suite2/deeper/er/d.py") in nested, nested
    assert ("R100", "testsuite/a.py", "suite2/a.py") in nested, nested
    assert any(n[0] == "M" and n[1] == "CHANGELOG" for n in nested), nested
    # turn 1's diff still holds the files it made, under their names then
    t1 = names(overlayrec("diff", m.ws, "--turn", "1", "--name-status").stdout)
    assert t1 == {("M", "tests/a.py"), ("A", "tests/__pycache__/a.pyc")}, t1
    blame = overlayrec("blame", "suite2/__pycache__/a.pyc", "-w", m.ws).stdout
    assert "call:s:edit" in blame and "absent 0B -> file 4B" in blame, blame
    assert "moved with tests/ -> testsuite/" in blame, blame
    # replay before turn 2 has tests/ with its files; the whole tree equals the start + turn 1
    out = tmp_path / "then"
    overlayrec("replay", m.ws, "--at", "before:turn:2", "--to", str(out), "--full")
    then = tree(str(out))
    assert then["tests/deep/er/d.py"][1] == b"d\n" and then["tests/a.py"][1] == b"changed\n"
    assert not any(k.startswith(("testsuite", "suite2")) for k in then), sorted(then)
    # revert of turn 2 puts everything back, no empty tests/ beside a full testsuite/
    r = overlayrec("revert", m.ws, "--turn", "2", "--yes")
    now = tree(m.ws)
    assert {k: v for k, v in now.items() if k != ".git"} == \
        {k: v for k, v in then.items()}, (r.stdout, sorted(now), sorted(then))
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert tree(m.ws) == snaps["end"]


def test_edit_while_unmounted_is_drift(make_mount, tmp_path):
    m, snaps = session(make_mount, tmp_path)
    agent_diff = overlayrec("diff", m.ws, "--turn", "2").stdout
    m.umount()
    with open(os.path.join(m.ws, "CHANGELOG"), "a") as f:
        f.write("user line\n")
    # unmounted: the turn's diff is the agent's alone; revert calls the user's edit a conflict
    assert overlayrec("diff", m.ws, "--turn", "2").stdout == agent_diff
    assert "user line" not in agent_diff
    st = json.loads(overlayrec("status", m.ws, "--json").stdout)
    assert st["drifted"] == ["CHANGELOG"], st
    assert "drifted" in overlayrec("blame", "CHANGELOG", "-w", m.ws).stdout
    d = overlayrec("diff", m.ws, "--drift")
    assert "+user line" in d.stdout and "agent" not in d.stdout.replace(" agent", ""), d.stdout
    assert "drift" in overlayrec("diff", m.ws, "--turn", "2").stderr
    # revert mounts for the occasion: that mount journals the drift, and the revert refuses
    r = overlayrec("revert", m.ws, "--turn", "2", "--yes", check=False)
    assert r.returncode == 1 and "changed" in r.stderr and "CHANGELOG" in r.stderr, r
    assert open(os.path.join(m.ws, "CHANGELOG")).read() == "v1\nagent\nuser line\n"
    # the drift is journaled as the outside unit "while unmounted", never a call
    m.mount()
    drift = [e for e in m.events() if e["op"] == "drift"]
    assert [(e["path"], e["unit"]) for e in drift] == [("CHANGELOG", "outside:unmounted")]
    assert json.loads(overlayrec("status", m.ws, "--json").stdout)["drifted"] == []
    assert "user line" not in overlayrec("diff", m.ws, "--turn", "2").stdout
    since = overlayrec("diff", m.ws, "--since", str(drift[0]["seq"] - 1)).stdout
    assert "+user line" in since



def test_edit_keeping_size_and_mtime_is_drift(make_mount, tmp_path):
    """An edit while unmounted that keeps the size and puts the mtime back (cp -p, touch -r,
    tar): the stat the seal kept says nothing changed, the ctime does.  The turn's diff stays
    the agent's, status and --drift name the file, and a revert refuses to undo over it."""
    m, snaps = session(make_mount, tmp_path)
    agent_diff = overlayrec("diff", m.ws, "--turn", "2").stdout
    m.umount()
    path = os.path.join(m.ws, "CHANGELOG")
    st = os.stat(path)
    old = open(path, "rb").read()
    with open(path, "r+b") as f:
        f.write(old[:2].upper() if old[:2] != old[:2].upper() else b"XX")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    assert overlayrec("diff", m.ws, "--turn", "2").stdout == agent_diff
    assert json.loads(overlayrec("status", m.ws, "--json").stdout)["drifted"] == ["CHANGELOG"]
    assert "CHANGELOG" in overlayrec("diff", m.ws, "--drift").stdout
    r = overlayrec("revert", m.ws, "--turn", "2", "--yes", check=False)
    assert r.returncode == 1 and "CHANGELOG" in r.stderr, r
    assert open(path, "rb").read() != old

SWAP = textwrap.dedent(r'''
    import subprocess
    from overlayrec import client
    def sh(cmd):
        subprocess.run(["bash", "-ec", cmd], check=True)
    with client.connect() as c:
        c.call_begin("c0", "Bash")
        sh("rm p && mkdir p && mkfifo p/own")
        c.call_end("c0")
        c.call_begin("c1", "Bash")
        sh("echo theirs > p/theirs")
        c.call_end("c1")
''')


def test_a_directory_holding_another_units_file_is_a_conflict(make_mount, tmp_path):
    """Reverting the call that turned a fifo into a directory, after another call put a file in
    it, refuses with `changed` and writes nothing (never a revert stopped half way)."""
    m = make_mount()
    os.mkfifo(os.path.join(m.ws, "p"))
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(SWAP)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable, str(agent), cwd=m.ws)
    before = tree(m.ws)
    r = overlayrec("revert", m.ws, "--call", "c0", "--yes", check=False)
    assert r.returncode == 1 and "changed: p" in r.stderr, (r.stdout, r.stderr)
    assert tree(m.ws) == before
    st = json.loads(overlayrec("status", m.ws, "--json").stdout)
    assert st["pending_revert"] == [], st


def test_a_refused_directory_rename_moves_nothing(make_mount, tmp_path):
    """A directory rename the underlay refuses (ENOTEMPTY: the target holds files) is journaled
    ahead, then voided by its ``failed`` note: path history must not take it, or every earlier
    rename of the same names reads wrong."""
    m = make_mount().mount()
    m.py("import errno, os\n"
         "os.mkdir('d'); open('d/y', 'w').write('y\\n'); os.mkdir('e'); os.rename('d', 'e')\n"
         "os.mkdir('d'); open('d/z', 'w').write('z\\n')\n"
         "try:\n"
         "    os.rename('d', 'e')\n"
         "except OSError as e:\n"
         "    assert e.errno == errno.ENOTEMPTY, e\n"
         "else:\n"
         "    raise AssertionError('renamed')\n")
    evs = m.events(failed=True)
    failed = {e["ref"] for e in evs if e["op"] == "failed"}
    moved = [e for e in evs if e["op"] == "rename"]
    assert [e["seq"] in failed for e in moved] == [False, True], moved
    m.umount()
    ok = moved[0]["seq"]
    for seq, want in ((ok - 1, {"d", "d/y", "e"}), (ok, {"e", "e/y"}),
                      (max(e["seq"] for e in evs), {"d", "d/z", "e", "e/y"})):
        dest = tmp_path / f"at-{seq}"
        overlayrec("replay", m.ws, "--state-dir", m.state, "--at", str(seq), "--to", str(dest))
        assert set(tree(str(dest))) == want, (seq, sorted(tree(str(dest))))
    status = names(overlayrec("diff", m.ws, "--state-dir", m.state, "--since", str(ok - 1),
                              "--until", str(ok), "--name-status").stdout)
    assert status == {("R100", "d/y", "e/y")}, status


def test_an_index_that_kept_refused_renames_is_made_again(tmp_path):
    """A journal whose ``renames`` index still holds a refused directory rename (written before
    the index left those out) is read right at once (readers scan the events) and indexed again
    at its next writable open."""
    import lmdb
    from overlayrec.journal import Journal
    sd = str(tmp_path / "state")
    j = Journal(sd)
    actor = {"key": "1:1", "pid": 1}
    pre = {"kind": "dir", "mode": 0o755}
    j.append({"op": "mkdir", "path": "d", "pre": {"kind": "absent"}}, actor)
    ok = j.append({"op": "rename", "path": "d", "path2": "e", "pre": pre,
                   "pre2": {"kind": "absent"}}, actor)
    bad = j.append({"op": "rename", "path": "e", "path2": "f", "pre": pre,
                    "pre2": {"kind": "dir", "mode": 0o755}}, actor)
    j.append({"op": "failed", "ref": bad, "path": "e", "errno": 39}, actor)
    assert [r["seq"] for r in j.dir_renames()] == [ok]
    j.close()
    # as an older overlayrec left it: the refused rename indexed, the index marked "1"
    env = lmdb.open(os.path.join(sd, "journal"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(bad.to_bytes(8, "big"), json.dumps({"src": "e", "dst": "f", "flags": 0}).encode(),
                db=env.open_db(b"renames", txn=txn))
        txn.put(b"renames_indexed", b"1", db=env.open_db(b"meta", txn=txn))
    env.close()
    r = Journal(sd, readonly=True)
    try:
        assert [x["seq"] for x in r.dir_renames()] == [ok]
    finally:
        r.close()
    w = Journal(sd)
    try:
        assert w.meta("renames_indexed") == "2"
        assert [x["seq"] for x in w.dir_renames()] == [ok]
    finally:
        w.close()


def test_an_empty_file_renamed_then_written_held_nothing_before(make_mount, tmp_path):
    """A file made empty, renamed, then written in the same epoch: the write's pre-image of the
    new name is the empty content (kept without a blob), so the file held nothing under both
    names until the write, not what it holds in the end."""
    m = make_mount().mount()
    m.py("import os\n"
         "open('y', 'w').close(); os.rename('y', 'b')\n"
         "with open('b', 'a') as f:\n"
         "    f.write('hi\\n')\n"
         "os.rename('b', 'a')\n")
    evs = m.events()
    assert [e["op"] for e in evs] == ["create", "rename", "write", "rename"], evs
    m.umount()
    for e, want in zip(evs, ({"y": b""}, {"b": b""}, {"b": b"hi\n"}, {"a": b"hi\n"})):
        dest = tmp_path / f"at-{e['seq']}"
        out = json.loads(overlayrec("replay", m.ws, "--state-dir", m.state, "--at", str(e["seq"]),
                                    "--to", str(dest), "--json").stdout)
        assert out["inexact"] == [], out
        got = {k: v[1] for k, v in tree(str(dest)).items()}
        assert got == want, (e, got)


def test_blame_follows_a_directory_rename_only_for_what_it_moved(make_mount):
    """A directory rename carries what was beneath it then: blame of a file it moved lists
    the move and the file's runs under its earlier name; blame of a file made beneath the new
    name afterwards lists only its own making (the rename moved nothing of it)."""
    m = make_mount().mount()
    m.sh("mkdir unpack && echo old > unpack/old.txt && echo gone > unpack/new.txt && "
         "rm unpack/new.txt")
    m.sh("mv unpack work")
    m.sh("echo new > work/new.txt")

    def ops(name):
        runs = [json.loads(line) for line in
                overlayrec("blame", name, "-w", m.ws, "--json").stdout.splitlines()]
        return [op for r in reversed(runs) for op in r["ops"]]
    moved = ops("work/old.txt")
    assert "moved with unpack/ -> work/" in moved and moved[0] == "create", moved
    made = ops("work/new.txt")
    assert made == ["create"], made  # its write joined the create's run


def test_blame_of_a_name_a_directory_rename_left_then_another_moved_onto(make_mount):
    """A name a directory's rename left (``mv l e`` takes ``l/e`` to ``e/e``) and another
    directory renamed onto later (``mv e l/e``), both followed back from ``e/e``: the move is
    one step, "moved with" under the name it went to, and the name it left begins its next run
    as absent (the history model's random seed 43001: its check took that for a broken chain)."""
    m = make_mount().mount()
    m.sh("mkdir l && mkdir l/e && mv l e")   # e/e: the directory made as l/e
    m.sh("mkdir l && mv e l/e && mv l e")    # e/e: the one made as e (it held the first)
    runs = [json.loads(line) for line in
            overlayrec("blame", "e/e", "-w", m.ws, "--json").stdout.splitlines()]
    got = [(r.get("name", "e/e"), r["ops"], r["before"]["kind"], r["after"]["kind"])
           for r in reversed(runs)]
    assert got == [("l/e", ["mkdir"], "absent", "dir"),
                   ("e/e", ["moved with l/ -> e/"], "dir", "dir"),       # l/e left absent
                   ("e/e", ["moved away with e/ -> l/e/"], "dir", "absent"),
                   ("l/e", ["rename from e"], "absent", "dir"),          # so it begins
                   ("e/e", ["moved with l/ -> e/"], "dir", "dir")], got


def test_blame_follows_both_sides_of_a_directory_exchange(make_mount):
    """``renameat2(RENAME_EXCHANGE)`` of two directories moves each one's files to the other
    name: blame follows a file either way, back to its runs under its earlier name (it
    followed only the first directory's files: the second's read "nothing recorded", found by
    a bug hunt); a name both held is the other side's file afterwards."""
    m = make_mount()
    for rel in ("d/x", "d/z", "e/y", "e/z"):
        os.makedirs(os.path.join(m.ws, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(m.ws, rel), "w") as f:
            f.write(rel + "\n")
    m.mount()
    m.sh("echo more >> e/y && echo more >> e/z")
    m.py("import ctypes\nl = ctypes.CDLL(None, use_errno=True)\n"
         "assert l.renameat2(-100, b'd', -100, b'e', 2) == 0")
    m.sh("echo again >> d/y")
    m.umount()

    def history(name):
        runs = [json.loads(line) for line in
                overlayrec("blame", name, "-w", m.ws, "--json").stdout.splitlines()]
        return [(r.get("name", name), r["ops"], r["before"]["kind"], r["after"]["kind"])
                for r in reversed(runs)]
    assert history("d/y") == [("e/y", ["write"], "file", "file"),
                              ("d/y", ["moved with e/ -> d/"], "file", "file"),
                              ("d/y", ["write"], "file", "file")], history("d/y")
    assert history("e/y") == [("e/y", ["write"], "file", "file"),
                              ("e/y", ["moved away with e/ -> d/"], "file", "absent")]
    assert history("e/x") == [("e/x", ["moved with d/ -> e/"], "file", "file")]
    assert history("d/x") == [("d/x", ["moved away with d/ -> e/"], "file", "absent")]
    # e/z held a file each side: the one there now came from d/, the one written went to d/
    assert history("e/z") == [("e/z", ["moved with d/ -> e/"], "file", "file")], history("e/z")
    assert history("d/z") == [("e/z", ["write"], "file", "file"),
                              ("d/z", ["moved with e/ -> d/"], "file", "file")], history("d/z")
    with open(os.path.join(m.ws, "d", "z")) as f:
        assert f.read() == "e/z\nmore\n"


def test_log_of_a_path_follows_it_back_through_directory_renames(make_mount):
    """``log --path FILE`` lists what blame lists: the events on FILE's earlier names while it
    held them, and the directory rename that moved it (it listed none of them for the new
    name, and not the move for the old one: found by a bug hunt); a glob matches the events'
    own paths only, and a file made beneath the new name later is not followed back."""
    m = make_mount()
    os.makedirs(os.path.join(m.ws, "src"))
    for name in ("a.py", "c.py", "new.py"):
        with open(os.path.join(m.ws, "src", name), "w") as f:
            f.write("a\n")
    m.mount()
    m.sh("echo b >> src/a.py && echo d >> src/c.py && rm src/new.py")
    m.sh("mv src lib")
    m.sh("echo e >> lib/a.py && echo n > lib/new.py")
    m.umount()

    def logged(pattern):
        rows = [json.loads(line) for line in
                overlayrec("log", m.ws, "--path", pattern, "--json").stdout.splitlines()]
        return [(e["op"], e["path"], e.get("path2")) for e in rows]
    write, move = ("write", "src/a.py", None), ("rename", "src", "lib")
    assert logged("lib/a.py") == [write, move, ("write", "lib/a.py", None)]
    assert logged("src/a.py") == [write, move]
    assert logged("lib/new.py") == [("create", "lib/new.py", None)]  # src/new.py: another file
    assert logged("lib/*") == [("write", "lib/a.py", None), ("create", "lib/new.py", None)]
    assert "glob matches the events' own paths" in \
        overlayrec("log", "--help").stdout.replace("\n", " ").replace("  ", " ")


@needs_fuse
def test_blame_of_a_name_gone_says_absent_exactly(make_mount, tmp_path):
    """A shared mapping's page of a file written back after the file was unlinked (SQLite's
    -shm at a WAL database's last close): blame said `absent 0B -> absent ~0B`, inexact, of a name that
    holds nothing (found by a bug hunt)."""
    m = make_mount().mount()
    script = tmp_path / "shm.py"
    script.write_text(textwrap.dedent("""\
        import sqlite3
        c = sqlite3.connect("t.db")
        c.execute("pragma journal_mode=wal")
        c.execute("create table t(a)")
        c.commit()
        c.close()
        """))
    overlayrec("run", "-w", m.ws, "--", sys.executable, str(script), cwd=m.ws)
    runs = [json.loads(line) for line in
            overlayrec("blame", "t.db-shm", "-w", m.ws, "--json").stdout.splitlines()]
    assert runs and runs[0]["after"] == {"kind": "absent", "size": 0, "exact": True}, runs


LATE_APPEND = r'''
set -e
or call begin --id A --tool Bash --summary a
echo a > a.txt
(while [ ! -e "$FLAG" ]; do sleep 0.05; done; echo late >> a.txt; touch "$FLAG.done") \
    > /dev/null 2>&1 &
or call end --id A
touch "$FLAG"
while [ ! -e "$FLAG.done" ]; do sleep 0.05; done
'''


def test_blame_marks_late_only_what_came_after_the_call_ended(make_mount, tmp_path):
    """A call's create and its background job's append after the call ended were one run of
    blame, all of it "after the call ended" (found by a bug hunt): two runs now, the create
    the call's own, the append late."""
    m = make_mount()
    m.mount()
    run_script(m, tmp_path, LATE_APPEND, FLAG=str(tmp_path / "flag"))
    runs = [json.loads(x) for x in
            overlayrec("blame", "-w", m.ws, "a.txt", "--json").stdout.splitlines()]
    mine = [r for r in runs if r["unit"] == "call:s:A"]
    assert [(r.get("late", False), r["ops"]) for r in mine] == \
        [(True, ["write"]), (False, ["create"])], runs
    text = overlayrec("blame", "-w", m.ws, "a.txt").stdout.splitlines()
    assert len([x for x in text if "call:s:A" in x]) == 2, text
    assert [x for x in text if "after the call ended" in x and "create" in x] == [], text
