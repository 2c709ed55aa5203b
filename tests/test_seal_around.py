"""A seal tells a change made around the mount by the file's ctime against the daemon's own
last change of it (``Recorder._around``).  A pre-image that takes long to save (a large file's
whole content before its first write, the tail a truncate drops) must not make the daemon's own
change, which follows it, look like one made around the mount."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import needs_fuse, overlayrec, plain_recorder

from overlayrec.attribution import Attribution
from overlayrec.fs import Handle
from overlayrec.journal import Journal
from overlayrec.recorder import AROUND_SLACK_NS, Recorder


def _slow_store(rec: Recorder) -> None:
    """Every save into the content store takes longer than the seal's slack."""
    put_range = rec.content.put_range

    def slow(fd, off, length):
        time.sleep(AROUND_SLACK_NS / 1e9 + 0.2)
        return put_range(fd, off, length)
    rec.content.put_range = slow


def test_a_slow_preimage_is_not_taken_for_a_change_around_the_mount(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "w.bin").write_bytes(b"w" * 100_000)
    (ws / "t.bin").write_bytes(b"t" * 100_000)
    j = Journal(str(tmp_path / "state"))
    root_fd = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        rec = Recorder(j, root_fd, Attribution())
        _slow_store(rec)
        actor = rec.attribution.actor(os.getpid())
        unit = rec.units.unit_of(actor)
        # a write: its file's whole content is saved first
        fd = os.open("w.bin", os.O_RDWR, dir_fd=root_fd)
        try:
            rec.write(Handle(fd, None, actor, unit, rec), 0, b"changed")
        finally:
            os.close(fd)
        # a truncate: the tail it drops is saved first
        path_fd = os.open("t.bin", os.O_PATH, dir_fd=root_fd)
        try:
            rec.truncate(path_fd, 10, actor)
        finally:
            os.close(path_fd)
        assert rec.seal() == 2
        evs = [j.event(s) for s in range(1, j.last_seq() + 1)]
        assert [e["op"] for e in evs if e.get("op") == "drift"] == [], evs
        assert sorted(e["path"] for e in evs if e["op"] == "seal") == ["t.bin", "w.bin"]
        assert (ws / "t.bin").read_bytes() == b"t" * 10
    finally:
        os.close(root_fd)
        j.close()


def test_a_change_beneath_after_the_detach_is_no_units_within_the_slack(tmp_path):
    """The end of a mount detaches it first and seals after: a process that wrote a file by its
    path in that moment wrote it beneath the mount, and where the daemon had changed the file
    in the half second before (the slack), the seal took that write for the unit's own (a
    user's save just after a `run` ended, reverted with the agent's call).  Found by a bug
    hunt.  Past the detach (``detached_at``), the slack is the clock's only."""
    ws = tmp_path / "ws"
    with plain_recorder(tmp_path) as (rec, root_fd):
        j = rec.journal
        actor = rec.attribution.actor(os.getpid())
        unit = rec.units.unit_of(actor)
        for name in ("f", "g"):
            fd = rec.create(root_fd, name, os.O_RDWR, 0o644, os.geteuid(), os.getegid(), actor)
            try:
                rec.write(Handle(fd, None, actor, unit, rec), 0, b"agent\n")
            finally:
                os.close(fd)
        time.sleep(0.02)
        rec.detached_at = time.time_ns()  # the mount's end (daemon._flush_mount)
        time.sleep(0.1)
        with open(ws / "f", "a") as f:  # by its path: beneath, the mount detached
            f.write("user\n")
        assert rec.seal() == 3
        evs = [j.event(s) for s in range(1, j.last_seq() + 1)]
        drifts = [(e["path"], e["unit"]) for e in evs if e["op"] == "drift"]
        assert drifts == [("f", "outside:around")], evs


BENEATH = r'''
import os, sys, time
go, done = sys.argv[1], sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.01)
with open("f", "a") as f:   # relative to a working directory entered before the mount
    f.write("user-line\n")
open(done, "w").close()
'''


AGENT_BESIDE = '''
import os, subprocess, time
from overlayrec import client

def call(cid, cmd):
    c.call_begin(cid, "Bash")
    subprocess.run(["bash", "-c", cmd], check=True)
    c.call_end(cid)

def user():  # past the slack the ctime is read with (the daemon's own changes)
    time.sleep(1.0)
    open(%(go)r, "w").close()
    while not os.path.exists(%(done)r):
        time.sleep(0.01)
    time.sleep(0.1)

with client.connect() as c:
'''


def run_beside_beneath(m, tmp_path, body: str, session: str = "s") -> None:
    """A process whose directory was entered before ``m``'s mount (BENEATH) appends a line to
    ``f`` when the agent's ``user()`` tells it to; the agent's ``body`` (lines in its client's
    ``with`` block, ``call(id, cmd)`` and ``user()`` at hand) runs in session ``session``,
    mounting the workspace if it is not."""
    (tmp_path / "beneath.py").write_text(BENEATH)
    go, done = tmp_path / "go", tmp_path / "done"
    beneath = subprocess.Popen([sys.executable, str(tmp_path / "beneath.py"), str(go),
                                str(done)], cwd=m.ws)
    try:
        m.mount()
        (tmp_path / "agent.py").write_text(
            AGENT_BESIDE % {"go": str(go), "done": str(done)}
            + textwrap.indent(textwrap.dedent(body).strip() + "\n", "    "))
        overlayrec("run", "-w", m.ws, "--session", session, "--", sys.executable,
                   str(tmp_path / "agent.py"), cwd=m.ws)
        assert beneath.wait(timeout=30) == 0
    finally:
        if beneath.poll() is None:
            beneath.kill()
            beneath.wait()


@needs_fuse
@pytest.mark.parametrize("between", ["calls", "inside"])
def test_a_change_beneath_the_mount_is_found_at_the_next_change(make_mount, tmp_path, between):
    """A shell whose directory was entered before the mount appends to a file beneath it,
    between two calls or inside one call between two of its changes; the call then changes
    the file again.  The next change's pre-image took the other writer's line as the call's
    (diff showed it, a revert of the call removed it; found by hunts).  A drift of the outside
    unit "around" is journaled ahead of it: diff names the other writer, the revert refuses."""
    m = make_mount()
    with open(os.path.join(m.ws, "f"), "w") as f:
        f.write("base\n")
    run_beside_beneath(m, tmp_path, f"""
        c.call_begin("c1", "Bash")
        subprocess.run(["bash", "-c", "echo agent1 >> f"], check=True)
        {"c.call_end('c1'); user(); c.call_begin('c2', 'Bash')" if between == "calls"
         else "user()"}
        subprocess.run(["bash", "-c", "sed -i s/base/BASE/ f"], check=True)
        c.call_end({"'c2'" if between == "calls" else "'c1'"})
    """)
    last = "c2" if between == "calls" else "c1"
    assert open(os.path.join(m.ws, "f")).read() == "BASE\nagent1\nuser-line\n"
    drifts = [e for e in m.events() if e["op"] == "drift"]
    assert [(e["path"], e["unit"]) for e in drifts] == [("f", "outside:around")], drifts
    # the listing agrees with diff: the first call's seal says what it left when the other
    # writer's line came after it (`calls` said "what it left is not known")
    rows = {r["id"]: r for r in map(json.loads, overlayrec(
        "calls", m.ws, "--json").stdout.splitlines())}
    assert rows["c1"]["around"] == ([] if between == "calls" else ["f"]), rows["c1"]
    d = overlayrec("diff", m.ws, "--call", last)
    if between == "calls":  # the call's own change only: the user's line was there before it
        assert "+user-line" not in d.stdout and "-base\n+BASE" in d.stdout, d.stdout
    else:
        assert "outside:around" in d.stderr, d.stderr
    r = overlayrec("revert", m.ws, "--call", last, "--yes", check=False)
    if between == "calls":  # its revert gives back what the user left
        assert r.returncode == 0, r.stderr
        assert open(os.path.join(m.ws, "f")).read() == "base\nagent1\nuser-line\n"
    else:
        assert r.returncode != 0 and "f" in r.stderr, r.stderr
        assert open(os.path.join(m.ws, "f")).read() == "BASE\nagent1\nuser-line\n"


@needs_fuse
def test_a_point_between_a_change_beneath_and_its_finding_is_not_exact(make_mount, tmp_path):
    """A change beneath the mount is found at the daemon's next change of the file: a replay
    of a point between the two (another call's end, after the other writer's line) gave the
    file as the call before left it, and said it was exact (found by a hunt).  Such a point
    is inexact for the file; one before the other writer's change stays exact."""
    m = make_mount()
    with open(os.path.join(m.ws, "f"), "w") as f:
        f.write("base\n")
    run_beside_beneath(m, tmp_path, """
        call("c1", "echo agent1 >> f")
        call("before", "echo b > g")
        user()
        call("after", "echo a > h")
        call("c2", "sed -i s/base/BASE/ f")
    """)
    assert [e["unit"] for e in m.events() if e["op"] == "drift"] == ["outside:around"]
    for point, exact in (("before", True), ("after", False)):
        dest = tmp_path / point
        out = json.loads(overlayrec("replay", m.ws, "--at", f"call:{point}", "--to", str(dest),
                                    "--json").stdout)
        assert ("f" not in out["inexact"]) == exact, (point, out)
        assert (dest / "f").read_text() == "base\nagent1\n"  # the record's last known


@needs_fuse
def test_a_change_beneath_to_a_file_an_earlier_mount_sealed_is_found(make_mount, tmp_path):
    """Only the seals this daemon took were looked at around the mount: a shell entered
    before the mount appending to a file an earlier mount's session had sealed went into the
    next call's pre-image, blame showed no other writer, and replay gave the line at points
    before it as exact (found by a hunt).  The mount's start looks at every sealed file."""
    m = make_mount()
    with open(os.path.join(m.ws, "f"), "w") as f:
        f.write("base\n")
    m.mount()
    overlayrec("run", "-w", m.ws, "--session", "A", "--", "sh", "-c", "echo A >> f", cwd=m.ws)
    m.umount()
    run_beside_beneath(m, tmp_path, """
        call("first", "echo x > g")
        user()
        call("rewrite", "printf 'rewritten\\\\n' > f.tmp && mv f.tmp f")
    """, session="B")
    drifts = [(e["path"], e["unit"]) for e in m.events() if e["op"] == "drift"]
    assert drifts == [("f", "outside:around")], drifts
    out = json.loads(overlayrec("replay", m.ws, "--at", "after:call:first", "--to",
                                str(tmp_path / "then"), "--json").stdout)
    # before the other writer's line: as session A left it, and exact
    assert "f" not in out["inexact"], out
    assert (tmp_path / "then" / "f").read_text() == "base\nA\n"
    blame = overlayrec("blame", "f", "-w", m.ws).stdout
    assert "outside:around" in blame, blame


@needs_fuse
@pytest.mark.parametrize("change", ["mv f g", "rm f", "truncate -s 3 f", "ln f g"])
def test_a_change_beneath_the_mount_is_found_at_any_next_change(make_mount, tmp_path, change):
    """As above, inside one call, where the call's next change of the file is no write: a
    rename of it away, its removal, a truncate by name, a hard link.  The epoch went on
    through the other writer's line, so a revert of the session put the file back without it
    (a rename's, a truncate's) or called the removed line the session's."""
    m = make_mount()
    with open(os.path.join(m.ws, "f"), "w") as f:
        f.write("base\n")
    (tmp_path / "beneath.py").write_text(BENEATH)
    go, done = tmp_path / "go", tmp_path / "done"
    beneath = subprocess.Popen([sys.executable, str(tmp_path / "beneath.py"), str(go),
                                str(done)], cwd=m.ws)
    try:
        m.mount()
        overlayrec("run", "-w", m.ws, "--session", "s", "--", "sh", "-c",
                   f"echo agent1 >> f; sleep 1; touch {go}; while [ ! -e {done} ]; do "
                   f"sleep 0.05; done; sleep 0.1; {change}", cwd=m.ws)
        assert beneath.wait(timeout=30) == 0
    finally:
        if beneath.poll() is None:
            beneath.kill()
            beneath.wait()
    drifts = [e for e in m.events() if e["op"] == "drift"]
    assert [(e["path"], e["unit"]) for e in drifts] == [("f", "outside:around")], drifts
    r = overlayrec("revert", m.ws, "--session", "s", "--yes", check=False)
    assert r.returncode != 0 and "f" in r.stderr, r.stderr


@needs_fuse
def test_an_append_through_the_mount_goes_to_the_files_end(make_mount):
    """A process working beneath the mount appends to a file the mount has served; then an
    append through the mount: the kernel appended at the size it had cached, over the other
    process's bytes (found by hunts).  The daemon writes an O_APPEND handle's writes at the
    file's end, as the filesystem beneath would, and the kernel's stale size and pages go."""
    m = make_mount()
    beneath = subprocess.Popen(["sleep", "60"], cwd=m.ws)  # its directory: the one beneath
    try:
        m.mount()
        under = f"/proc/{beneath.pid}/cwd/log"
        m.sh(f"echo line1 > log; cat log > /dev/null; echo user-line >> {under}; "
             "echo agent >> log")
        assert m.sh("cat log").stdout == "line1\nuser-line\nagent\n"
    finally:
        beneath.kill()
        beneath.wait()
    m.umount()
    assert open(os.path.join(m.ws, "log")).read() == "line1\nuser-line\nagent\n"
    writes = [e for e in m.events() if e["op"] == "write" and e["path"] == "log"]
    assert writes and writes[-1]["offset"] == len("line1\nuser-line\n"), writes


@needs_fuse
def test_appends_after_the_file_changed_beneath_go_to_its_end_each_time(make_mount):
    """A process beneath the mount truncates a file the mount served, then an append through
    the mount: it landed at the old end, after a hole of NULs.  A long-lived O_APPEND handle
    (`exec 3>>f`) while a process beneath appends too: its first append after the other's was
    moved to the end, its next written over the other's bytes (found by a bug hunt)."""
    m = make_mount()
    beneath = subprocess.Popen(["sleep", "60"], cwd=m.ws)  # its directory: the one beneath
    try:
        m.mount()
        under = f"/proc/{beneath.pid}/cwd"
        m.sh(f"printf 'AAAAAAAA\\n' > t; cat t > /dev/null; : > {under}/t; echo BB >> t")
        assert m.sh("cat t").stdout == "BB\n"
        m.sh(f"printf 'start\\n' > f; exec 3>>f; echo m1 >&3; echo beneath-line >> {under}/f; "
             "echo m2 >&3; echo m3 >&3; exec 3>&-")
        assert m.sh("cat f").stdout == "start\nm1\nbeneath-line\nm2\nm3\n"
    finally:
        beneath.kill()
        beneath.wait()
    m.umount()
    assert open(os.path.join(m.ws, "t"), "rb").read() == b"BB\n"
    assert open(os.path.join(m.ws, "f")).read() == "start\nm1\nbeneath-line\nm2\nm3\n"


POSITIONAL = r"""
import fcntl, mmap, os
open("a", "wb").write(b"." * 8192)
with open("a", "a+b") as f:  # a shared mapping of an O_APPEND file, its page written back
    m = mmap.mmap(f.fileno(), 8192)
    m[0:5] = b"HELLO"
    m.flush()
    m.close()
open("d", "wb").write(b"." * 100)
fd = os.open("d", os.O_WRONLY | os.O_APPEND)
fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_APPEND)
os.pwrite(fd, b"SETFL", 10)
os.close(fd)
fd = os.open("d", os.O_WRONLY | os.O_APPEND)
os.write(fd, b"END")  # and an append: at the end
os.close(fd)
"""


@needs_fuse
def test_a_write_at_an_offset_through_an_append_handle_lands_there(make_mount, tmp_path):
    """The daemon moved every write of an O_APPEND handle that was not at the file's size to
    its end: a shared mapping's page written back through it (a store at 0 of an `a+`
    file's mapping), a pwrite after fcntl cleared O_APPEND, RWF_NOAPPEND: each landed at the
    end, the file corrupted and the record keeping it so (found by a bug hunt)."""
    m = make_mount().mount()
    (tmp_path / "positional.py").write_text(POSITIONAL)
    subprocess.run([sys.executable, str(tmp_path / "positional.py")], cwd=m.ws, check=True)
    a = open(os.path.join(m.ws, "a"), "rb").read()
    assert len(a) == 8192 and a.startswith(b"HELLO..."), (len(a), a.find(b"HELLO"))
    assert open(os.path.join(m.ws, "d"), "rb").read() == b"." * 10 + b"SETFL" + b"." * 85 + \
        b"END"
    m.umount()
    writes = [(e["path"], e["offset"]) for e in m.events() if e["op"] == "write"]
    assert ("a", 0) in writes and ("d", 10) in writes and ("d", 100) in writes, writes


@needs_fuse
def test_a_file_made_beneath_where_a_call_removed_one_is_the_other_writers(make_mount,
                                                                          tmp_path):
    """A call removes f; a process working beneath the mount makes f anew while the call goes
    on: what the call left there is known (nothing), so its diff shows the removal exactly and
    its revert refuses to write over the other writer's file; `run` names that writer as
    "(around the mount)", its file counted (it read "(around the mount)[0]: 0 file(s)")."""
    m = make_mount()
    with open(os.path.join(m.ws, "f"), "w") as f:
        f.write("base\n")
    (tmp_path / "beneath.py").write_text(BENEATH.replace('open("f", "a")', 'open("f", "w")'))
    go, done = tmp_path / "go", tmp_path / "done"
    beneath = subprocess.Popen([sys.executable, str(tmp_path / "beneath.py"), str(go),
                                str(done)], cwd=m.ws)
    try:
        m.mount()
        r = overlayrec("run", "-w", m.ws, "--session", "s", "--", "sh", "-c",
                       f"sh -c 'rm f; sleep 0.7; touch {go}; while [ ! -e {done} ]; do "
                       "sleep 0.05; done; sleep 0.2'", cwd=m.ws)
        assert beneath.wait(timeout=30) == 0
    finally:
        if beneath.poll() is None:
            beneath.kill()
            beneath.wait()
    assert "outside: (around the mount): 1 file(s)" in r.stderr, r.stderr
    cid = json.loads(overlayrec("calls", m.ws, "--json").stdout.splitlines()[0])["id"]
    d = overlayrec("diff", m.ws, "--call", cid).stdout
    assert "deleted file mode 100644" in d and "-base" in d, d
    r = overlayrec("revert", m.ws, "--call", cid, "--yes", check=False)
    assert r.returncode != 0 and "changed: f" in r.stderr, r.stderr
    assert open(os.path.join(m.ws, "f")).read() == "user-line\n"


@needs_fuse
def test_a_name_a_directory_rename_fills_is_not_changed_around_the_mount(make_mount,
                                                                          tmp_path):
    """d/x and e/x are sealed at one call's end; the next moves d away and e into its place,
    so d/x names the file made as e/x, a little later.  The seal's ctime stayed with the name
    d/x, and the next write there took the other file's ctime for a change around the mount:
    a drift of "around" with the old d/x's content as its pre-image (found when every change
    looked around the mount: test_open_handles)."""
    m = make_mount().mount()
    (tmp_path / "agent.py").write_text(textwrap.dedent('''
        import subprocess, time
        from overlayrec import client

        def sh(cmd):
            subprocess.run(["bash", "-c", cmd], check=True)
        with client.connect() as c:
            c.call_begin("c1", "Bash")
            sh("mkdir d e; echo old > d/x; echo new > e/x")
            c.call_end("c1")
            c.call_begin("c2", "Bash")
            sh("mv d gone; mv e d")
            c.call_end("c2")
            time.sleep(0.7)  # past the slack the daemon's own changes are read with
            c.call_begin("c3", "Bash")
            sh("echo more >> d/x; chmod 600 gone/x")
            c.call_end("c3")
    '''))
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable,
               str(tmp_path / "agent.py"), cwd=m.ws)
    assert [e for e in m.events() if e["op"] == "drift"] == []
    d = overlayrec("diff", m.ws, "--call", "c3").stdout
    assert " new\n+more" in d and "-old" not in d, d
    r = overlayrec("revert", m.ws, "--call", "c3", "--yes", check=False)
    assert r.returncode == 0, r.stderr
    assert open(os.path.join(m.ws, "d", "x")).read() == "new\n"
    assert open(os.path.join(m.ws, "gone", "x")).read() == "old\n"


@needs_fuse
@pytest.mark.parametrize("steps", [
    "echo two >> a; sleep 0.7; ln a b; rm b; echo three >> a",
    "ln a a.bak; sleep 0.7; sed -i s/base/B/ a; sleep 0.7; echo more >> a.bak"])
def test_a_name_the_daemon_made_or_removed_is_no_change_around_the_mount(make_mount, steps):
    """A hard link made and removed through the mount, or a backup link whose partner is
    renamed over: the inode's ctime moves with its names, at the daemon's own change.  Read
    as another writer's (a drift of "around"), the call's revert was refused as interleaved
    (found by hunts)."""
    m = make_mount()
    with open(os.path.join(m.ws, "a"), "w") as f:
        f.write("base\n")
    m.mount()
    m.sh(f"{sys.executable} -m overlayrec run --session s -- sh -c '({steps})'")
    assert [e for e in m.events() if e["op"] == "drift"] == []
    cid = json.loads(overlayrec("calls", m.ws, "--json").stdout.splitlines()[0])["id"]
    r = overlayrec("revert", m.ws, "--call", cid, "--yes", check=False)
    assert r.returncode == 0, r.stderr
    assert open(os.path.join(m.ws, "a")).read() == "base\n"
    assert sorted(os.listdir(m.ws)) == ["a"]


def _beneath(ws: str) -> subprocess.Popen:
    """A process whose working directory was entered before the mount: writes through
    /proc/PID/cwd go to the directory beneath the mount (the user's second terminal)."""
    return subprocess.Popen(["sleep", "120"], cwd=ws)


@needs_fuse
@pytest.mark.parametrize("shape", ["append-run", "directory-moved", "between-writes"])
def test_a_change_beneath_inside_a_call_is_never_the_calls(make_mount, tmp_path, shape):
    """A user's line appended beneath the mount while a call goes on: in the middle of the
    call's own run of appends through one descriptor (the run's first write had looked, the
    others did not), before the call moves the file's directory (the stamps stayed under the
    old name), or between two of the call's writes.  Found by hunts: no drift, the call's
    revert removed the user's line, and `calls` said nothing of it.  Now a drift of "around"
    is journaled, `calls` names the path, the revert refuses and the line stays."""
    m = make_mount()
    os.makedirs(os.path.join(m.ws, "d"))
    with open(os.path.join(m.ws, "d", "f"), "w") as f:
        f.write("base\n")
    user = _beneath(m.ws)
    try:
        m.mount()
        under = f"/proc/{user.pid}/cwd/d/f"
        script = {
            "append-run": f"""{sys.executable} -c "
import os, time
fd = os.open('d/f', os.O_WRONLY | os.O_APPEND)
os.write(fd, b'agent1\\n'); time.sleep(0.7)
open('{under}', 'a').write('USER-LINE\\n'); time.sleep(0.7)
os.write(fd, b'agent2\\n')"
""",
            "directory-moved": f"echo agent1 >> d/f; sleep 0.7; echo USER-LINE >> {under}; "
                               "sleep 0.7; mv d d2; echo agent2 >> d2/f",
            "between-writes": f"echo agent1 >> d/f; sleep 0.7; echo USER-LINE >> {under}; "
                              "sleep 0.7; echo agent2 >> d/f"}[shape]
        # in a subshell: one call, the agent's (sh's) only child
        overlayrec("run", "-w", m.ws, "--session", "s", "--", "sh", "-c", f"({script})",
                   cwd=m.ws)
    finally:
        user.kill()
        user.wait()
    name = "d2/f" if shape == "directory-moved" else "d/f"
    assert open(os.path.join(m.ws, name)).read() == "base\nagent1\nUSER-LINE\nagent2\n"
    drifts = [e for e in m.events() if e["op"] == "drift"]
    assert [e["unit"] for e in drifts] == ["outside:around"], drifts
    row = json.loads(overlayrec("calls", m.ws, "--json").stdout.splitlines()[0])
    if shape != "directory-moved":  # there the drift is under the name the call moved it to
        assert row["around"] == [name], row
    r = overlayrec("revert", m.ws, "--call", row["id"], "--yes", check=False)
    assert r.returncode != 0 and name in r.stderr, r.stderr
    assert open(os.path.join(m.ws, name)).read() == "base\nagent1\nUSER-LINE\nagent2\n"


SEAL_CHUNKS = r'''
import os
os.mkdir("a")
for i in range(1500):  # more paths than one seal's chunk (SEAL_CHUNK)
    with open(f"a/f{i}", "w") as f:
        f.write(f"{i}\n")
os.mkfifo("a/p")
os.link("a/f0", "a/h")
os.symlink("a", "s")
deep = "/".join(["n" * 200] * 19)  # a path of about 3,900 bytes
os.makedirs("a/" + deep)
with open(f"a/{deep}/x", "w") as f:
    f.write("deep\n")
os.rename("a", "b")  # the directory renamed, everything beneath it with it
with open("d/old", "a") as f:
    f.write("more\n")
'''


@needs_fuse
def test_a_unit_of_more_paths_than_a_seal_chunk_reads_back_whole(make_mount, tmp_path):
    """A unit's end seals its paths a chunk at a time (SEAL_CHUNK): a call of 1,500 files, a
    fifo, a hard link, a symlink to a directory and a 3,900-byte path, all moved by a
    directory rename, plus an edit of a file from before: `check` finds the record whole,
    the replay of the session's end and its start are the trees as they were, and its revert
    gives the tree before it back."""
    from test_history import tree
    m = make_mount()
    os.mkdir(os.path.join(m.ws, "d"))
    with open(os.path.join(m.ws, "d", "old"), "w") as f:
        f.write("old\n")
    before = tree(m.ws)
    m.mount()
    (tmp_path / "make.py").write_text(SEAL_CHUNKS)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable,
               str(tmp_path / "make.py"), cwd=m.ws)
    after = tree(m.ws)
    assert len(after) > 1500
    m.umount()
    assert "record whole" in overlayrec("check", m.ws, "--state-dir", m.state).stdout
    for point, want in (("session:s", after), ("before:session:s", before)):
        dest = tmp_path / point.replace(":", "-")
        overlayrec("replay", m.ws, "--state-dir", m.state, "--at", point, "--full",
                   "--to", str(dest))
        got = tree(str(dest))
        assert got == want, sorted(set(got.items()) ^ set(want.items()))[:5]
    overlayrec("revert", m.ws, "--state-dir", m.state, "--session", "s", "--yes")
    assert tree(m.ws) == before


# an editor whose directory was entered before the mount saves each file by rename, vim's
# way (the old one renamed to NAME~, the new one written, NAME~ removed), when told to
SAVES_BENEATH = r'''
import os, sys, time
flags, names = sys.argv[1], sys.argv[2:]
for name in names:
    while not os.path.exists(os.path.join(flags, "save-" + name)):
        time.sleep(0.01)
    os.rename(name, name + "~")
    with open(name, "w") as f:
        f.write(open(name + "~").read() + "user-line\n")
    os.unlink(name + "~")
    open(os.path.join(flags, "saved-" + name), "w").close()
'''


@needs_fuse
def test_a_file_an_editor_beneath_the_mount_saved_by_rename_is_the_one_opened(make_mount,
                                                                              tmp_path):
    """The kernel's entry of a name (kept 300 s) led to the old inode after an editor that
    works beneath the mount saved the file by rename: the agent's write through the mount
    went into the removed file (lost), its read gave the old content (which it then wrote
    back over the user's line), or failed with ESTALE (found by a bug hunt).  The open now
    finds the name replaced, and the kernel looks it up again: the new file is the one read
    and written, with its fd held by the daemon (a) or not (b: known from a listing)."""
    m = make_mount()
    for name in ("a", "b"):
        with open(os.path.join(m.ws, name), "w") as f:
            f.write(f"{name}-base\n")
    flags = tmp_path / "flags"
    flags.mkdir()
    (tmp_path / "saves.py").write_text(SAVES_BENEATH)
    editor = subprocess.Popen([sys.executable, str(tmp_path / "saves.py"), str(flags), "a", "b"],
                              cwd=m.ws)
    try:
        time.sleep(0.3)  # its directory entered before the mount
        m.mount()
        assert m.sh("cat a").stdout == "a-base\n"          # looked up: its fd held
        assert "b" in m.sh("ls -l").stdout                  # b known from the listing only
        for name in ("a", "b"):
            (flags / f"save-{name}").touch()
            deadline = time.monotonic() + 20
            while not (flags / f"saved-{name}").exists():
                assert time.monotonic() < deadline and editor.poll() is None
                time.sleep(0.01)
            assert m.sh(f"cat {name}").stdout == f"{name}-base\nuser-line\n", name
            m.sh(f"echo agent-line >> {name}")
    finally:
        if editor.poll() is None:
            editor.kill()
        editor.wait()
        m.umount()
    for name in ("a", "b"):
        with open(os.path.join(m.ws, name)) as f:
            assert f.read() == f"{name}-base\nuser-line\nagent-line\n", name
