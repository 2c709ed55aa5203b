"""Replay equals the tree as it stood: at every turn boundary by default, and at every step
when the mount records the data of every write (--record-data)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time

from conftest import needs_fuse, needs_root, overlayrec
from overlayrec import client
from overlayrec.engines.replay import replay
from overlayrec.engines.states import States, Tree
from overlayrec.journal import Journal

pytestmark = needs_fuse

AGENT = textwrap.dedent(r'''
    import json, os, shutil, subprocess, sys, time
    from overlayrec import client
    snaps, marks = sys.argv[1], []
    def snap(kind):
        t = time.time_ns()
        d = os.path.join(snaps, str(len(marks)))
        shutil.copytree(".", d, symlinks=True)
        marks.append({"t": t, "dir": d, "kind": kind})
    def sh(cmd):
        subprocess.run(["bash", "-c", cmd], check=True)
        snap("step")
    with client.connect() as c:
        for turn in range(3):
            c.turn_begin(prompt=f"turn {turn}")
            c.call_begin(f"b{turn}", "Bash")
            sh(f"echo t{turn} >> log.txt")
            if turn == 0:
                sh("sed -i s/one/ONE/ a.txt; mkdir -p sub/inner; printf '\\x00\\xff' > sub/bin")
                sh("ln -s a.txt link; chmod 750 tool; mv b.txt sub/b-moved.txt")
            if turn == 1:
                sh("rm sub/bin; ln -sfn log.txt link; chmod 640 a.txt; rmdir sub/inner")
                sh("printf 'x%.0s' $(seq 1 5000) > big.txt; truncate -s 100 big.txt")
            if turn == 2:
                sh("mv sub/b-moved.txt b.txt && echo back >> b.txt && rm -f tool")
            c.call_end(f"b{turn}")
            # the agent's own edit tool: one process, several writes, a point between each
            c.call_begin(f"e{turn}", "Edit")
            with open("notes.txt", "a") as f:
                for k in range(3):
                    f.write(f"turn {turn} note {k}\n")
                    f.flush()
                    os.fsync(f.fileno())
                    snap("step")
            c.call_end(f"e{turn}")
            c.turn_end()
            snap("turn")
    json.dump(marks, open(os.path.join(snaps, "marks.json"), "w"))
''')


def seed(ws):
    for p, data in {"a.txt": b"one\ntwo\n", "b.txt": b"bee\n", "tool": b"#!/bin/sh\n"}.items():
        with open(os.path.join(ws, p), "wb") as f:
            f.write(data)
    os.chmod(os.path.join(ws, "tool"), 0o755)


def tree_of(root):
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != ".overlayrec-attic"]
        for n in dirs + files:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                out[rel] = ("file", stat.S_IMODE(st.st_mode), open(p, "rb").read())
    return out


def record(make_mount, tmp_path, extra):
    m = make_mount(extra_args=extra)
    seed(m.ws)
    m.mount()
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    overlayrec("run", "-w", m.ws, "--session", "r", "--", sys.executable, str(agent), str(snaps),
               cwd=m.ws, timeout=180)
    return m, json.load(open(snaps / "marks.json"))


def check(m, marks, kinds, tmp_path):
    j = Journal(m.state, readonly=True)
    fd = client.underlay_fd(os.path.join(m.state, "control.sock"))
    try:
        states = States(j, Tree(fd))
        times = [(e["t"], e["seq"]) for e in j.events()]
        checked = 0
        for i, mark in enumerate(marks):
            if mark["kind"] not in kinds:
                continue
            point = max(seq for t, seq in times if t <= mark["t"])
            dest = tmp_path / f"replay-{i}"
            out = replay(j, states, point, str(dest), full_from=f"/proc/self/fd/{fd}")
            assert out["inexact"] == [], (i, out["inexact"])
            assert tree_of(dest) == tree_of(mark["dir"]), f"snapshot {i} ({mark['kind']})"
            checked += 1
        return checked
    finally:
        os.close(fd)
        j.close()


def test_replay_at_every_turn_boundary(make_mount, tmp_path):
    m, marks = record(make_mount, tmp_path, [])
    assert check(m, marks, {"turn"}, tmp_path) == 3


def test_replay_at_every_step_with_record_data(make_mount, tmp_path):
    m, marks = record(make_mount, tmp_path, ["--record-data"])
    assert check(m, marks, {"step", "turn"}, tmp_path) == len(marks) >= 20


def test_without_record_data_points_inside_a_run_are_marked_inexact(make_mount, tmp_path):
    m, marks = record(make_mount, tmp_path, [])
    j = Journal(m.state, readonly=True)
    fd = client.underlay_fd(os.path.join(m.state, "control.sock"))
    try:
        states = States(j, Tree(fd))
        times = [(e["t"], e["seq"]) for e in j.events()]
        def lines(mk):
            p = os.path.join(mk["dir"], "notes.txt")
            return open(p).read().count("\n") if os.path.exists(p) else 0
        # between the agent's first and second write to notes.txt: inside one epoch
        mid = [mk for mk in marks if mk["kind"] == "step" and lines(mk) == 1][0]
        point = max(seq for t, seq in times if t <= mid["t"])
        assert not states.state("notes.txt", point).exact
    finally:
        os.close(fd)
        j.close()


def _acl(*entries) -> bytes:
    """An access ACL as the kernel takes it in ``system.posix_acl_access``."""
    return (2).to_bytes(4, "little") + b"".join(
        tag.to_bytes(2, "little") + perm.to_bytes(2, "little") + ident.to_bytes(4, "little")
        for tag, perm, ident in entries)


def test_replay_between_metadata_changes_of_a_new_file(make_mount, tmp_path):
    """``sed -i`` makes its temp file 0600, chowns it, and sets the original's access ACL on it
    before writing it: an ACL sets the mode's permission bits.  A point between those changes
    is replayed forward from the file's creation; it gave 0600 after the ACL (and, after a
    chown, the replayer's own owner), marked exact.  Each point is checked against an lstat
    the writer took right after each change."""
    m = make_mount()
    m.mount()
    owner = os.geteuid() == 0  # only root may give a file away
    script = textwrap.dedent(f'''
        import json, os
        ACL = "system.posix_acl_access"
        seen = []
        def note():
            st = os.lstat("f")
            seen.append([stat_mode(st), st.st_uid, st.st_gid])
        def stat_mode(st):
            return st.st_mode & 0o7777
        os.close(os.open("f", os.O_CREAT | os.O_WRONLY, 0o600)); note()
        os.setxattr("f", ACL, bytes.fromhex({_acl((1, 7, 0), (4, 5, 0), (0x20, 4, 0)).hex()!r}))
        note()
        if {owner}:
            os.chown("f", 1234, 4321); note()
        os.setxattr("f", ACL, bytes.fromhex({_acl((1, 6, 0), (2, 7, 1234), (4, 7, 0), (0x10, 4, 0),
                                                   (0x20, 0, 0)).hex()!r}))
        note()
        print(json.dumps(seen))
    ''')
    seen = json.loads(m.py(script).stdout)
    assert [s[0] for s in seen] == ([0o600, 0o754, 0o754, 0o640] if owner else
                                    [0o600, 0o754, 0o640]), seen  # what the kernel did
    seqs = [e["seq"] for e in m.events() if e.get("path") == "f"]
    assert len(seqs) == len(seen), m.events()
    for k, (seq, (mode, uid, gid)) in enumerate(zip(seqs, seen)):
        out = tmp_path / f"at{k}"
        js = json.loads(overlayrec("replay", m.ws, "--at", str(seq), "--to", str(out),
                                   "--json").stdout)
        st = os.lstat(out / "f")
        assert "f" not in js["inexact"] and stat.S_IMODE(st.st_mode) == mode, (k, seq, js, st)
        if owner and k >= 2:
            assert (st.st_uid, st.st_gid) == (uid, gid) == (1234, 4321), (k, st)


def test_replay_refuses_a_directory_inside_the_workspace(make_mount, tmp_path):
    """The tree as it stood, written into the workspace itself, would be a change to it (drift
    while unmounted, the mount's own record while mounted): refused with one line, nothing
    written, mounted or not; a sibling whose name begins like the workspace's is fine."""
    m = make_mount()
    with open(os.path.join(m.ws, "a.txt"), "w") as f:
        f.write("a\n")
    m.mount()
    m.sh("echo b > b.txt")
    def names():
        return sorted(n for n in os.listdir(m.ws) if n != ".overlayrec-attic")
    before = names()
    into = tmp_path / "into"  # a symlink to the workspace: the way there does not matter
    os.symlink(m.ws, into)
    for mounted in (True, False):
        if not mounted:
            m.umount()
        for dest in (os.path.join(m.ws, "then"), os.path.join(m.ws, "sub", "then"),
                     os.path.join(str(into), "then")):
            r = overlayrec("replay", m.ws, "--at", "1", "--to", dest, check=False)
            assert r.returncode == 1 and r.stderr.strip() == (
                f"overlayrec: error: {dest} is inside the workspace {m.ws}: replay writes a new "
                "directory outside it"), r.stderr
        assert names() == before
    out = m.ws.rstrip("/") + "-then"
    overlayrec("replay", m.ws, "--at", "1", "--to", out)
    assert os.path.isdir(out)


@needs_root  # (a tmpfs mounted for the mount point)
def test_replay_errors_name_the_destination_not_its_temporary_directory(make_mount, tmp_path):
    """A --to whose name is over 255 bytes, and an empty directory that is a mount point
    (the rename into place answers EBUSY): the error named replay's own temporary directory,
    removed by then (found by a bug hunt).  It names --to, and nothing is left beside it."""
    m = make_mount()
    with open(os.path.join(m.ws, "a.txt"), "w") as f:
        f.write("a\n")
    m.mount()
    m.umount()
    long_dest = str(tmp_path / ("n" * 256))
    r = overlayrec("replay", m.ws, "--to", long_dest, check=False)
    assert r.returncode == 1 and "overlayrec-replay" not in r.stderr and \
        "File name too long" in r.stderr and long_dest in r.stderr, r.stderr
    point = tmp_path / "point"
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(point)], check=True)
    try:
        r = overlayrec("replay", m.ws, "--to", str(point), check=False)
        assert r.returncode == 1 and "overlayrec-replay" not in r.stderr and \
            str(point) in r.stderr, r.stderr
    finally:
        subprocess.run(["umount", str(point)], check=True)
    assert sorted(os.listdir(tmp_path)) == ["point"], os.listdir(tmp_path)


def test_replay_says_where_a_point_past_the_record_or_before_it_lands(make_mount, tmp_path):
    """A seq past the last event is the tree as the record ends, and replay says which seq it
    wrote (it said the seq asked for, as if the journal held it); a time before the first
    event is the tree before the record."""
    m = make_mount().mount()
    m.sh("echo one > a.txt")
    m.sh("echo two >> a.txt")
    m.umount()  # nothing appended meanwhile (a seal, a drift check)
    j = Journal(m.state, readonly=True)
    last = j.last_seq()
    j.close()
    r = overlayrec("replay", m.ws, "--at", "999999", "--to", str(tmp_path / "end"))
    assert r.stdout.startswith(f"replayed seq {last} (the last) into ")
    with open(tmp_path / "end" / "a.txt") as f:
        assert f.read() == "one\ntwo\n"
    js = json.loads(overlayrec("replay", m.ws, "--at", "999999", "--to", str(tmp_path / "j"),
                               "--json").stdout)
    assert js["point"] == last
    # no --at (or end, or now): the tree as the record ends, the live tree of the workspace
    for at, name in (([], "r-plain"), (["--at", "end"], "r-end"), (["--at", "now"], "r-now")):
        r = overlayrec("replay", m.ws, *at, "--to", str(tmp_path / name), "--full")
        assert r.stdout.startswith(f"replayed seq {last} (the last) into "), (at, r.stdout)
        assert tree_of(tmp_path / name) == tree_of(m.ws), at
    r = overlayrec("replay", m.ws, "--at", "before:end", "--to", str(tmp_path / "x"))
    assert r.stdout.startswith(f"replayed seq {last} (the last) into ")
    r = overlayrec("replay", m.ws, "--at", "1999-01-01T00:00:00", "--to", str(tmp_path / "b"))
    assert r.stdout.startswith("replayed seq 0 (before the record's first event) into ")
    assert not os.path.exists(tmp_path / "b" / "a.txt")


def test_replay_before_and_after_a_session(make_mount, tmp_path):
    """``session:S`` is a point as ``turn:N`` is (``before:`` its start, ``after:`` its end;
    ``last``: the session begun last), for agents whose runs have no turns: the tree before
    and after an ``overlayrec run`` whose command stashed, renamed a directory and edited, with
    outside writes before and after it, is the tree the test saw then."""
    m = make_mount()
    seed(m.ws)
    os.makedirs(os.path.join(m.ws, "d"))
    with open(os.path.join(m.ws, "d", "f"), "w") as f:
        f.write("in d\n")
    m.mount()
    m.sh("echo outside before >> a.txt")
    before = tree_of(m.ws)
    overlayrec("run", "-w", m.ws, "--", "bash", "-c",
               "mv d e && echo new > e/g && sed -i s/bee/BEE/ b.txt && rm tool", cwd=m.ws)
    after = tree_of(m.ws)
    m.sh("echo outside after > c.txt && mv e f")
    m.umount()
    for at, want in (("before:session:last", before), ("session:last", after),
                     ("after:session:last", after)):
        overlayrec("replay", m.ws, "--at", at, "--to", str(tmp_path / at), "--full")
        assert tree_of(tmp_path / at) == want, at
    j = Journal(m.state, readonly=True)
    try:
        [sid] = [r["id"] for r in j.records("sessions")]
    finally:
        j.close()
    overlayrec("replay", m.ws, "--at", f"before:session:{sid}", "--to", str(tmp_path / "id"),
               "--full")
    assert tree_of(tmp_path / "id") == before
    r = overlayrec("replay", m.ws, "--at", "session:nope", "--to", str(tmp_path / "n"),
                   check=False)
    assert r.returncode == 1 and r.stderr == "overlayrec: error: no session nope\n", r.stderr
    assert not os.path.exists(tmp_path / "n")


@needs_fuse
def test_a_directory_a_later_call_emptied_and_removed_is_exact_before(make_mount, tmp_path):
    """`rm -rf d` removes d's files, then d: d's pre-image holds the mtime the removal of its
    files gave it, later than the point replayed, which was taken for an edit made while
    unmounted: a replay before it said d inexact (every `.git/objects/XX` a `git gc` emptied;
    found by a bug hunt).  A directory made while unmounted and removed later still is."""
    m = make_mount()
    os.makedirs(os.path.join(m.ws, "d"))
    with open(os.path.join(m.ws, "d", "f"), "w") as f:
        f.write("x\n")
    with open(os.path.join(m.ws, "a"), "w") as f:
        f.write("a\n")
    before = tree_of(m.ws)
    time.sleep(1.1)  # past the second d and its file got their times in
    m.mount()
    (tmp_path / "job.sh").write_text("sh -c 'echo b >> a'\nsleep 1.1\nrm -rf d\n")
    overlayrec("run", "-w", m.ws, "--session", "s", "--", "bash", str(tmp_path / "job.sh"),
               cwd=m.ws)
    first = json.loads(overlayrec("calls", m.ws, "--json").stdout.splitlines()[0])["id"]
    r = json.loads(overlayrec("replay", "-w", m.ws, "--at", f"before:call:{first}",
                              "--to", str(tmp_path / "r"), "--full", "--json").stdout)
    assert r["inexact"] == [], r
    assert tree_of(str(tmp_path / "r")) == before
    m.umount()
    # made while unmounted (after the session), then removed by a call: not known before
    os.makedirs(os.path.join(m.ws, "e"))
    time.sleep(1.1)
    m.mount()
    overlayrec("run", "-w", m.ws, "--session", "t", "--", "rmdir", "e", cwd=m.ws)
    r = json.loads(overlayrec("replay", "-w", m.ws, "--at", "after:session:s",
                              "--to", str(tmp_path / "r2"), "--json").stdout)
    assert "e" in r["inexact"], r


def test_what_changed_while_unmounted_is_not_claimed_exact(make_mount, tmp_path):
    """Two gaps in what the record knows, which replay and export filled as exact (found by a
    hunt): a time inside an unmounted gap after an edit made then (the edit's drift is found
    only at the next mount), and a file made while unmounted that a later session wrote (its
    first pre-image, taken then, is all the record knows of it, and went into the earlier
    session's base).  Both are named: replay's `inexact`, export's `unsure_bases`."""
    m = make_mount()
    m.mount()
    overlayrec("run", "-w", m.ws, "--session", "s1", "--", "sh", "-c", "echo v1 > f", cwd=m.ws)
    m.umount()
    time.sleep(1.1)
    with open(os.path.join(m.ws, "f"), "w") as f:
        f.write("v2-user\n")
    with open(os.path.join(m.ws, "new"), "w") as f:
        f.write("made while unmounted\n")
    t = time.time()
    time.sleep(1.1)
    m.mount()
    overlayrec("run", "-w", m.ws, "--session", "s2", "--", "sh", "-c", "echo more >> new",
               cwd=m.ws)
    m.umount()
    r = json.loads(overlayrec("replay", "-w", m.ws, "--state-dir", m.state, "--at", f"@{t}",
                              "--to", str(tmp_path / "r1"), "--json").stdout)
    assert "f" in r["inexact"], r
    r = json.loads(overlayrec("replay", "-w", m.ws, "--state-dir", m.state, "--at",
                              "after:session:s1", "--to", str(tmp_path / "r2"),
                              "--json").stdout)
    assert "new" in r["inexact"], r
    # the edit came after the session's end (its ctime, which the seal after the drift
    # keeps): that point is exact for f (the seal was never found, and every earlier point was
    # said inexact; found by a bug hunt)
    assert "f" not in r["inexact"], r
    out = json.loads(overlayrec("export", "git", m.ws, "--state-dir", m.state,
                                "--json").stdout)
    assert "new" in out["unsure_bases"].get("s1", []), out


def test_a_build_a_killed_replay_left_beside_its_destination_is_removed(make_mount, tmp_path):
    """A replay killed (SIGKILL) while it built its tree left the directory beside the
    destination for good, one more at every kill, said by nothing (found by a bug hunt).  The
    next replay to that destination removes those of processes that are gone, not a live
    one's."""
    from overlayrec.attribution import live_stat
    m = make_mount()
    with open(os.path.join(m.ws, "a"), "w") as f:
        f.write("a\n")
    m.mount()
    m.sh("echo b >> a")
    m.umount()
    out = tmp_path / "out"
    out.mkdir()
    gone = subprocess.Popen(["sleep", "0"])
    gone_start = live_stat(gone.pid)
    gone.wait()
    me = os.getpid()
    stale = out / f".r.overlayrec-replay-{gone.pid}.{gone_start[0] if gone_start else 1}-abcdefgh"
    live = out / f".r.overlayrec-replay-{me}.{live_stat(me)[0]}-abcdefgh"
    other = out / ".s.overlayrec-replay-1.1-abcdefgh"  # beside another destination
    for d in (stale, live, other):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "f").write_text("half\n")
    (stale / "sub").chmod(0o555)
    overlayrec("replay", m.ws, "--at", "0", "--to", str(out / "r"))
    assert sorted(os.listdir(out)) == sorted(["r", live.name, other.name])
    assert (out / "r" / "a").read_text() == "a\n"


def test_a_directory_the_record_does_not_describe_keeps_its_live_mode(make_mount, tmp_path):
    """A recorded file in a 0700 directory the record never saw change: `replay` (without
    --full) made that directory with the umask's mode, 0755, and the file in it readable by
    everyone (found by a bug hunt).  It takes the live directory's mode."""
    m = make_mount()
    os.makedirs(os.path.join(m.ws, "private"))
    os.chmod(os.path.join(m.ws, "private"), 0o700)
    m.mount()
    try:
        m.sh("echo secretish > private/notes.txt")
    finally:
        m.umount()
    out = tmp_path / "r"
    overlayrec("replay", "-w", m.ws, "--state-dir", m.state, "--to", str(out))
    assert (out / "private" / "notes.txt").read_text() == "secretish\n"
    assert os.stat(out / "private").st_mode & 0o777 == 0o700
