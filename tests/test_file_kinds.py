"""Every file kind, modes and owners, and hard links: replay --full gives each back as it stood,
a failed replay leaves nothing, and revert/unrevert remove and restore each of them."""
from __future__ import annotations

import errno
import json
import os
import stat
import sys
import textwrap

import pytest

from conftest import needs_fuse, overlayrec
from overlayrec import client
from overlayrec.engines.replay import replay
from overlayrec.engines.revert_apply import apply_step, order
from overlayrec.engines.revert_steps import Plan, Step, plan_from_json, plan_to_json
from overlayrec.engines.states import ABSENT, State, States, Tree
from overlayrec.journal import Journal

SNAP = textwrap.dedent(r'''
    import os, stat
    def snap(root):
        """rel -> kind, permission bits, content or target, inode, of everything below root."""
        out = {}
        for d, dirs, files in os.walk(root):
            dirs[:] = [x for x in dirs if x != ".overlayrec-attic"]
            for n in dirs + files:
                p = os.path.join(d, n)
                st = os.lstat(p)
                m = st.st_mode
                kind = ("symlink" if stat.S_ISLNK(m) else "dir" if stat.S_ISDIR(m) else
                        "file" if stat.S_ISREG(m) else "fifo" if stat.S_ISFIFO(m) else
                        "socket" if stat.S_ISSOCK(m) else "device")
                e = {"kind": kind, "mode": stat.S_IMODE(m), "ino": st.st_ino}
                if kind == "symlink":
                    e["data"] = os.readlink(p)
                    e["mode"] = 0
                elif kind == "file":
                    e["data"] = open(p, "rb").read().decode("latin-1")
                out[os.path.relpath(p, root)] = e
        return out
''')
exec(SNAP)  # snap(), the same in the test and in the agent

# one call makes every kind: a fifo, a socket (bound), a hard-link pair, a symlink to a
# directory written through, and a directory filled and then made 0555
KINDS = textwrap.dedent(r'''
    import os, socket
    os.mkfifo("p", 0o640)
    s = socket.socket(socket.AF_UNIX); s.bind("sock"); s.close()
    open("h1", "w").write("hard\n"); os.link("h1", "h2")
    os.makedirs("src/click"); os.symlink("src/click", "lib")
    open("lib/x.py", "w").write("through the symlink\n")
    os.mkdir("ro"); open("ro/f", "w").write("ro\n"); os.chmod("ro", 0o555)
''')
MADE = ["p", "sock", "h1", "h2", "lib", "src/click", "src/click/x.py", "ro", "ro/f"]

AGENT = SNAP + textwrap.dedent(r'''
    import json, subprocess, sys
    from overlayrec import client
    snaps = {}
    def call(c, cid, code):
        c.call_begin(cid, "Bash")
        subprocess.run([sys.executable, "-c", code], check=True)
        c.call_end(cid)
    with client.connect() as c:
        c.turn_begin(prompt="one")
        call(c, "c0", "open('e.txt', 'w').write('e\\n')")
        c.turn_end()
        snaps["before:call:c1"] = snap(".")
        c.turn_begin(prompt="two")
        call(c, "c1", sys.argv[2])
        snaps["after:call:c1"] = snap(".")
        call(c, "c2", "import os; os.chmod('d', 0o755)")
        call(c, "c3", "import os; os.chmod('e.txt', 0o600)")
        c.turn_end()
        snaps["after:call:c3"] = snap(".")
    json.dump(snaps, open(sys.argv[1], "w"))
''')


def record(make_mount, tmp_path):
    m = make_mount()
    os.makedirs(os.path.join(m.ws, "d"))
    os.chmod(os.path.join(m.ws, "d"), 0o775)
    with open(os.path.join(m.ws, "d", "f"), "w") as f:
        f.write("f\n")
    os.makedirs(os.path.join(m.ws, "src"))
    with open(os.path.join(m.ws, "src", "a.py"), "w") as f:
        f.write("a\n")
    m.mount()
    (tmp_path / "agent.py").write_text(AGENT)
    overlayrec("run", "-w", m.ws, "--session", "k", "--", sys.executable,
               str(tmp_path / "agent.py"), str(tmp_path / "snaps.json"), KINDS, cwd=m.ws,
               timeout=120)
    return m, json.load(open(tmp_path / "snaps.json"))


def shape(snapshot: dict) -> dict:
    """What must come back: kind, mode and content of every path (not inode numbers)."""
    return {p: (e["kind"], oct(e["mode"]), e.get("data")) for p, e in snapshot.items()}


def groups(snapshot: dict) -> list[list[str]]:
    """The hard-link groups: paths (not directories) that share an inode."""
    by = {}
    for p, e in snapshot.items():
        if e["kind"] != "dir":
            by.setdefault(e["ino"], []).append(p)
    return sorted(sorted(v) for v in by.values() if len(v) > 1)


@needs_fuse
@pytest.mark.timeout(240)
def test_replay_full_gives_every_kind_mode_and_link_back(make_mount, tmp_path):
    m, snaps = record(make_mount, tmp_path)
    assert groups(snaps["after:call:c1"]) == [["h1", "h2"]]
    assert snaps["before:call:c1"]["d"]["mode"] == 0o775
    for i, (point, snapshot) in enumerate(snaps.items()):
        dest = tmp_path / "out" / f"r{i}"
        r = overlayrec("replay", m.ws, "--at", point, "--to", str(dest), "--full", "--json")
        out = json.loads(r.stdout)
        assert out["not_made"] == [] and out["inexact"] == [], (point, out)
        got = snap(str(dest))
        assert shape(got) == shape(snapshot), point
        assert groups(got) == groups(snapshot), point
        assert not [n for n in os.listdir(tmp_path / "out") if "overlayrec-replay" in n]
    # the symlink is a symlink, and nothing was written through it
    assert os.readlink(tmp_path / "out" / "r1" / "lib") == "src/click"


@needs_fuse
@pytest.mark.timeout(240)
def test_a_failed_replay_leaves_nothing(make_mount, tmp_path):
    m, snaps = record(make_mount, tmp_path)

    class Failing:
        """States that fail half way through the recorded paths."""
        def __init__(self, states):
            self.states, self.n = states, 0

        def __getattr__(self, name):
            return getattr(self.states, name)

        def state(self, *a, **kw):
            self.n += 1
            if self.n > 4:
                raise OSError(errno.EIO, "injected failure")
            return self.states.state(*a, **kw)

    j = Journal(m.state, readonly=True)
    fd = client.underlay_fd(os.path.join(m.state, "control.sock"))
    try:
        point = max(e["seq"] for e in j.events())
        for dest in (tmp_path / "dest", tmp_path / "new" / "deeper" / "dest"):
            with pytest.raises(OSError, match="injected"):
                replay(j, Failing(States(j, Tree(fd))), point, str(dest),
                       full_from=f"/proc/self/fd/{fd}")
            assert not dest.exists()
        assert sorted(os.listdir(tmp_path)) == ["agent.py", "snaps.json"]  # no temp dir left
        # an empty directory is replaced whole; a replay into it still gives the tree
        (tmp_path / "empty").mkdir()
        replay(j, States(j, Tree(fd)), point, str(tmp_path / "empty"),
               full_from=f"/proc/self/fd/{fd}")
        assert shape(snap(str(tmp_path / "empty"))) == shape(snaps["after:call:c3"])
    finally:
        os.close(fd)
        j.close()
    # the CLI refuses a destination that is not empty, and writes nothing into it
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    r = overlayrec("replay", m.ws, "--at", "after:call:c1", "--to", str(tmp_path / "full"),
                   check=False)
    assert r.returncode == 1 and os.listdir(tmp_path / "full") == ["x"]


@needs_fuse
@pytest.mark.timeout(240)
def test_revert_and_unrevert_every_kind(make_mount, tmp_path):
    m, snaps = record(make_mount, tmp_path)
    end = snaps["after:call:c3"]
    assert shape(snap(m.ws)) == shape(end)
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes")
    assert "reverted" in r.stdout
    now = snap(m.ws)
    assert not [p for p in MADE if p in now], now
    assert shape(now) == {p: v for p, v in shape(end).items() if p not in MADE}
    r = overlayrec("unrevert", "-w", m.ws, "--yes")  # exit 0: every kind was made
    assert "reverted" in r.stdout
    back = snap(m.ws)
    assert back["p"]["kind"] == "fifo" and back["sock"]["kind"] == "socket"
    assert os.readlink(os.path.join(m.ws, "lib")) == "src/click"
    assert shape(back) == shape(end)
    # no spurious conflict after the round trip
    js = json.loads(overlayrec("revert", m.ws, "--call", "c1", "--json").stdout)
    assert [s for s in js["steps"] if s["conflict"]] == [], js
    assert groups(back) == [["h1", "h2"]], "the hard links share an inode again"
    # the point after c1 now comes from the journal (the revert's pre-images), not the live tree
    dest = tmp_path / "again"
    out = json.loads(overlayrec("replay", m.ws, "--at", "after:call:c1", "--to", str(dest),
                                "--full", "--json").stdout)
    assert out["not_made"] == [] and out["inexact"] == [], out
    got = snap(str(dest))
    assert shape(got) == shape(snaps["after:call:c1"])
    assert groups(got) == [["h1", "h2"]]


@needs_fuse
@pytest.mark.timeout(240)
def test_a_later_chmod_is_a_changed_conflict(make_mount, tmp_path):
    m, snaps = record(make_mount, tmp_path)
    before = shape(snap(m.ws))
    r = overlayrec("revert", m.ws, "--turn", "-2", "--yes", check=False)
    assert r.returncode == 1 and "changed: e.txt" in r.stderr, (r.stdout, r.stderr)
    assert shape(snap(m.ws)) == before


# -- the write side on a plain directory (no mount) ------------------------------------------

def _cap(n: int) -> bool:
    """Does this process hold capability ``n`` (0 CHOWN, 1 DAC_OVERRIDE, 27 MKNOD)?"""
    with open("/proc/self/status") as f:
        eff = next(line for line in f if line.startswith("CapEff:")).split()[1]
    return bool(int(eff, 16) >> n & 1)


def test_apply_step_makes_every_kind_with_mode_and_owner(tmp_path):
    root = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    made = {}
    uid, gid = (1234, 4321) if _cap(0) else (os.geteuid(), os.getegid())
    steps = [
        Step("d", State("dir", 0o555, uid=uid, gid=gid), ABSENT),
        Step("d/f", State("file", 0o640, b"f", uid=uid, gid=gid, ino=7, nlink=2), ABSENT),
        Step("g", State("file", 0o640, b"f", uid=uid, gid=gid, ino=7, nlink=2), ABSENT),
        Step("p", State("fifo", 0o604, uid=uid, gid=gid), ABSENT),
        Step("s", State("socket", 0o751, uid=uid, gid=gid), ABSENT),
        Step("l", State("symlink", 0o120000, b"d", uid=uid, gid=gid), ABSENT),
        Step("é" * 120, State("file", 0o600, b"long"), ABSENT),  # 240 bytes of name
    ]
    if _cap(27):
        steps.append(Step("null", State("device", 0o666, rdev=os.makedev(1, 3)), ABSENT))
    try:
        results = {s.path: apply_step(root, s, made) for s in order(steps)}
        assert not any(r.startswith("failed") for r in results.values()), results
        assert "hard link" in results["g"]
        st = {p: os.lstat(tmp_path / p) for p in ("d", "d/f", "g", "p", "s", "l")}
        assert stat.S_ISDIR(st["d"].st_mode) and stat.S_IMODE(st["d"].st_mode) == 0o555
        assert stat.S_ISFIFO(st["p"].st_mode) and stat.S_IMODE(st["p"].st_mode) == 0o604
        assert stat.S_ISSOCK(st["s"].st_mode) and stat.S_IMODE(st["s"].st_mode) == 0o751
        assert st["d/f"].st_ino == st["g"].st_ino and stat.S_IMODE(st["g"].st_mode) == 0o640
        assert os.readlink(tmp_path / "l") == "d"
        assert all((s.st_uid, s.st_gid) == (uid, gid) for s in st.values())
        assert (tmp_path / ("é" * 120)).read_bytes() == b"long"
        if _cap(27):
            dev = os.lstat(tmp_path / "null")
            assert stat.S_ISCHR(dev.st_mode) and dev.st_rdev == os.makedev(1, 3)
        # a directory that exists gets its mode back too
        os.chmod(tmp_path / "d", 0o700)
        assert apply_step(root, Step("d", State("dir", 0o750), ABSENT)) == "dir"
        assert stat.S_IMODE(os.lstat(tmp_path / "d").st_mode) == 0o750
    finally:
        os.chmod(tmp_path / "d", 0o755)
        os.close(root)


def test_a_step_that_fails_says_its_path_and_what_is_left(tmp_path):
    """A step the filesystem refuses for a reason the plan did not foresee (a file put back
    where a directory still holds another's file) names the step's whole path and what to do
    next: it named the last component only ("x: Directory not empty")."""
    root = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    (tmp_path / "d" / "x").mkdir(parents=True)
    (tmp_path / "d" / "x" / "theirs").write_bytes(b"t")
    try:
        with pytest.raises(OSError) as got:
            apply_step(root, Step("d/x", State("file", 0o644, b"mine"), State("dir", 0o755)))
        assert got.value.filename == "d/x" and "revert --continue" in got.value.strerror and \
            "unrevert" in got.value.strerror, got.value
        assert (tmp_path / "d" / "x" / "theirs").read_bytes() == b"t"  # nothing lost
        assert sorted(os.listdir(tmp_path / "d")) == ["x"]  # no temp file left beside it
    finally:
        os.close(root)


def test_one_recorded_inode_taken_in_two_states_is_two_groups(tmp_path):
    """A plan takes each path at its own point: ``b`` and ``c`` before a chmod of their inode,
    ``a`` after it.  ``b`` and ``c`` are one group again and ``a`` a file of its own (an inode
    cannot hold two modes), whichever of them is made first."""
    root = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    made = {}
    before = State("file", 0o644, b"x", ino=7, nlink=2)
    steps = [Step("a", before.but(mode=0o755, nlink=3), ABSENT), Step("b", before, ABSENT),
             Step("c", before, ABSENT)]
    try:
        results = {s.path: apply_step(root, s, made) for s in order(steps)}
        assert results == {"a": "restored", "b": "restored",
                           "c": "restored (hard link to b)"}, results
        a, b, c = (os.lstat(tmp_path / n) for n in "abc")
        assert b.st_ino == c.st_ino != a.st_ino and (a.st_nlink, b.st_nlink) == (1, 2)
        assert (stat.S_IMODE(a.st_mode), stat.S_IMODE(b.st_mode)) == (0o755, 0o644)
    finally:
        os.close(root)


def test_a_node_that_cannot_be_made_is_a_failure_not_a_skip(tmp_path):
    root = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        r = apply_step(root, Step("x", State("whiteout", 0o644), ABSENT))
        assert r.startswith("failed")
        os.mkdir(tmp_path / "ro", 0o555)
        if not _cap(1):  # root may write anywhere: only a user sees EACCES here
            r = apply_step(root, Step("ro/p", State("fifo", 0o644), ABSENT))
            assert r.startswith("failed") and "fifo" in r
    finally:
        os.close(root)


def test_a_saved_plan_keeps_every_state_field():
    blobs = {}

    def put(b):
        blobs[str(len(blobs))] = b
        return str(len(blobs) - 1)
    t = State("device", 0o600, uid=1, gid=2, rdev=os.makedev(8, 1), block=True, ino=9, nlink=3)
    f = State("file", 0o4755, b"x", uid=5, gid=6, ino=11, nlink=2)
    plan = Plan("p1", {"call": "c"}, [Step("a", t, ABSENT), Step("b", f, ABSENT, "changed")])
    d = json.loads(json.dumps(plan_to_json(plan, put)))
    back = plan_from_json(d, blobs.__getitem__)
    assert back.steps[0].target == t and back.steps[1].target == f
    # a plan saved before these fields existed still reads
    for s in d["steps"]:
        for x in (s["target"], s["expected"]):
            for k in ("uid", "gid", "rdev", "block", "ino", "nlink", "drifted"):
                x.pop(k, None)
    old = plan_from_json(d, blobs.__getitem__)
    assert old.steps[1].target == State("file", 0o4755, b"x")


@needs_fuse
@pytest.mark.timeout(240)
def test_a_diff_says_what_its_patch_cannot_show(make_mount, tmp_path):
    """git holds files and symlinks, and of a mode only the x bit: a fifo, a socket, a
    directory's mode and a file's other mode bits are in no patch.  The diff says which
    changes it left out, on stderr and in --json, so it agrees with the listings, which count
    them; and its patch, applied to the tree before, gives the tree after but for exactly
    those paths."""
    m, snaps = record(make_mount, tmp_path)
    base = tmp_path / "base"
    overlayrec("replay", m.ws, "--at", "before:call:c1", "--to", str(base), "--full")
    import subprocess
    subprocess.run(["git", "init", "-q", str(base)], check=True)
    expected = {"c1": [("p", "fifo made"), ("ro", "directory made, mode 0555"),
                       ("sock", "socket made")],
                "c2": [("d", "mode 0775 -> 0755")],
                "c3": [("e.txt", "mode 0644 -> 0600")]}
    for cid, unshown in expected.items():
        r = overlayrec("diff", m.ws, "--call", cid, "--binary")
        said = [line for line in r.stderr.splitlines() if "cannot show" in line]
        assert said == [f"overlayrec: {len(unshown)} change(s) a git patch cannot show: "
                        + ", ".join(f"{p} ({what})" for p, what in unshown)
                        + "; `overlayrec replay` restores them"], r.stderr
        js = json.loads(overlayrec("diff", m.ws, "--call", cid, "--json").stdout)
        assert [(e["path"], e["change"]) for e in js["not_in_patch"]] == unshown
        if cid == "c1":
            if r.stdout:
                subprocess.run(["git", "apply", "--binary", "-"], input=r.stdout.encode(),
                               cwd=base, check=True)
            got = {p: v for p, v in shape(snap(str(base))).items() if not p.startswith(".git")}
            want = shape(snaps["after:call:c1"])
            assert sorted(p for p in got.keys() | want.keys()
                          if got.get(p) != want.get(p)) == [p for p, _ in unshown]


@needs_fuse
@pytest.mark.timeout(240)
def test_a_renamed_directory_names_what_its_patch_cannot_move(make_mount, tmp_path):
    """A directory renamed with a fifo and an empty directory beneath: the patch moves its file
    and symlink, and the diff names the fifo and the empty directory under both names."""
    m = make_mount().mount()
    agent = tmp_path / "agent.py"
    agent.write_text(textwrap.dedent(r'''
        import subprocess, sys
        from overlayrec import client
        with client.connect() as c:
            for cid, sh in (("c1", "mkdir -p box/empty && mkfifo box/p && echo f > box/f && "
                                   "ln -s f box/l"), ("c2", "mv box crate")):
                c.call_begin(cid, "Bash")
                subprocess.run(["bash", "-c", sh], check=True)
                c.call_end(cid)
    '''))
    overlayrec("run", "-w", m.ws, "--", sys.executable, str(agent), cwd=m.ws)
    r = overlayrec("diff", m.ws, "--call", "c2", "--name-status")
    assert r.stdout.splitlines() == ["R100\tbox/f\tcrate/f", "R100\tbox/l\tcrate/l"], r.stdout
    assert r.stderr.splitlines() == [
        "overlayrec: 4 change(s) a git patch cannot show: box/empty (empty directory removed), "
        "box/p (fifo removed), crate/empty (empty directory made), crate/p (fifo made); "
        "`overlayrec replay` restores them"], r.stderr


@needs_fuse
@pytest.mark.timeout(240)
def test_a_diff_names_the_mode_a_files_patch_leaves_out(make_mount, tmp_path):
    """A patch that shows a file's content also shows its x bit, but no other mode bit: a
    set-id bit set with the x bit, a mode narrowed with an edit, a file made 0600 (git applies
    0644).  Each is named on stderr; a plain edit with ``chmod +x`` is not.  Found by hand:
    ``chmod 4755`` with an edit was shown as 100755 and the set-id bit named nowhere."""
    from test_replay import tree_of
    m = make_mount()
    for name in ("g.txt", "h.txt", "u.txt", "x.sh"):
        with open(os.path.join(m.ws, name), "w") as f:
            f.write(f"{name}\n")
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(textwrap.dedent(r'''
        import subprocess, sys
        from overlayrec import client
        with client.connect() as c:
            c.call_begin("c1", "Bash")
            subprocess.run(["bash", "-c", sys.argv[1]], check=True)
            c.call_end("c1")
    '''))
    base = tmp_path / "base"
    import shutil
    shutil.copytree(m.ws, base, symlinks=True)
    overlayrec("run", "-w", m.ws, "--", sys.executable, str(agent),
               "printf x >> g.txt && chmod 4755 g.txt && (umask 077 && echo s > s.txt) && "
               "printf y >> h.txt && chmod 600 h.txt && echo z >> u.txt && chmod 744 u.txt && "
               "echo q >> x.sh && chmod +x x.sh", cwd=m.ws)
    after = tree_of(m.ws)
    unshown = [("g.txt", "mode 0644 -> 4755"), ("h.txt", "mode 0644 -> 0600"),
               ("s.txt", "file made, mode 0600"), ("u.txt", "mode 0644 -> 0744")]
    r = overlayrec("diff", m.ws, "--call", "c1", "--binary")
    assert r.stderr.splitlines() == [
        "overlayrec: 4 change(s) a git patch cannot show: "
        + ", ".join(f"{p} ({what})" for p, what in unshown)
        + "; `overlayrec replay` restores them"], r.stderr
    js = json.loads(overlayrec("diff", m.ws, "--call", "c1", "--json").stdout)
    assert [(e["path"], e["change"]) for e in js["not_in_patch"]] == unshown
    import subprocess
    subprocess.run(["git", "apply", "--binary", "-"], input=r.stdout.encode(), cwd=base,
                   check=True)
    got = tree_of(str(base))
    assert sorted(p for p in got.keys() | after.keys() if got.get(p) != after.get(p)) == \
        [p for p, _ in unshown]
