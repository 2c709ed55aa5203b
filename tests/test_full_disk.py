"""A full filesystem is an errno, never a crash (issue 13).

* the state dir on a small tmpfs, filled by several writers creating and rewriting files through
  the mount: they get ENOSPC (never EIO, never ENOTCONN), the mount stays up and answers, no
  change reaches the workspace without its event (write-ahead holds), no partial blob is left
  behind, and once space is freed the same mount records again;
* the workspace itself on a small full tmpfs: the writers get ENOSPC, the mount lives, each
  refused write is voided by a ``failed`` note, and the journal reads back (``diff --since 0``).

Those two mount tmpfs filesystems, so they need root (as another user they skip; tools/test
runs them in its root pass).  Two more need neither root nor a mount: a refused commit leaves
the recorder's epochs as they were (the retry journals the pre-image again), and the journal's
map starts small and grows, with readers following.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import SLOW, needs_fuse, needs_root, overlayrec, is_mounted, plain_recorder, \
    run_script

ATTIC = ".overlayrec-attic"

# One writer: creates new files and rewrites a few over and over, each operation in a child
# process of its own (a new actor, so a new epoch: each rewrite saves the old content as a blob,
# and the state dir fills with blobs and events), until it has been refused ENOSPC often enough
# or its time is up.  Prints what it saw as JSON.
WRITER = r'''
import errno, json, os, sys, time
root, tag, seconds, size = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
os.chdir(root)
errors, ok, full, i = {}, 0, 0, 0
end = time.monotonic() + seconds
while time.monotonic() < end and full < 40:
    i += 1
    name = "%s-new-%d" % (tag, i) if i % 3 == 0 else "%s-%d" % (tag, i % 8)
    data = os.urandom(size if i % 3 else 100)
    # appended to (its first write begins a run: an event, voided when refused), or made or
    # truncated by the open (the writes join the run the open began: no event to void)
    mode = "ab" if i % 3 == 1 else "wb"
    pid = os.fork()
    if pid == 0:
        try:
            with open(name, mode) as f:
                f.write(data)
        except OSError as e:
            os._exit(e.errno or 255)
        except BaseException:
            os._exit(254)
        os._exit(0)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code == 0:
        ok += 1
        continue
    name = errno.errorcode.get(code, str(code))
    errors[name] = errors.get(name, 0) + 1
    if code == errno.ENOSPC:
        full += 1
        time.sleep(0.01)
    elif code in (errno.ENOTCONN, errno.ECONNABORTED):
        break
print(json.dumps({"ok": ok, "errors": errors}), flush=True)
'''


@contextlib.contextmanager
def tmpfs(path: str, size: str):
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", path],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: str, name: str, leave: int) -> str:
    """A filler file that leaves about ``leave`` bytes free on ``path``'s filesystem."""
    filler = os.path.join(path, name)
    want = max(0, free_bytes(path) - leave)
    with open(filler, "wb") as f:
        while want > 0:
            try:
                want -= f.write(b"\0" * min(want, 1 << 20))
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
    return filler


def run_writers(ws: str, n: int, seconds: float, size: int) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, ws, f"w{k}", str(seconds * SLOW),
                               str(size)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd="/")
             for k in range(n)]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=(seconds + 30) * SLOW)
            assert p.returncode == 0, stderr
            out.append(json.loads(stdout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def daemon_pid(m) -> int:
    with open(os.path.join(m.state, "daemon.json")) as f:
        return json.load(f)["pid"]


def assert_alive(m, pid: int) -> None:
    """Mounted, answering, served by the same daemon, and listable."""
    assert is_mounted(m.ws)
    st = json.loads(overlayrec("status", m.ws, "--json").stdout)
    assert st["mounted"] is True and st["responding"] is True and st["dead_mount"] is False, st
    assert st["daemon_pid"] == pid
    os.kill(pid, 0)
    m.sh("ls -la > /dev/null")


def underlay_files(ws: str) -> set[str]:
    out = set()
    for d, dirs, files in os.walk(ws):
        if d == ws and ATTIC in dirs:
            dirs.remove(ATTIC)
        for f in files:
            out.add(os.path.relpath(os.path.join(d, f), ws))
    return out


def assert_write_ahead(m, before: set[str] = frozenset()) -> None:
    """Every file on the underlay (read with nothing mounted) that was not there before the
    mount was created by an event that holds (none that a ``failed`` note voids)."""
    assert not is_mounted(m.ws)
    created = {e["path"] for e in m.events() if e["op"] == "create"}
    files = underlay_files(m.ws) - before
    assert files, "the writers made nothing at all"
    missing = sorted(files - created)
    assert not missing, f"on the underlay without a create event: {missing[:10]}"


def total_errors(results: list[dict]) -> dict[str, int]:
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    return errors


# creates empty files until one is refused: only events, so the journal itself must grow
CREATOR = r'''
import errno, json, os, sys
os.chdir(sys.argv[1])
for k in range(int(sys.argv[2])):
    try:
        os.close(os.open("j-%d" % k, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except OSError as e:
        print(json.dumps({"made": k, "errno": errno.errorcode.get(e.errno, e.errno)}))
        break
else:
    print(json.dumps({"made": k + 1, "errno": None}))
'''


@needs_fuse
@needs_root
@pytest.mark.timeout(int(90 * SLOW))
def test_full_state_dir_is_enospc_and_recording_resumes(make_mount):
    m = make_mount()
    with tmpfs(os.path.join(m.base, "statefs"), "16m") as statefs:
        m.state = os.path.join(statefs, "state")
        try:
            m.mount()
            pid = daemon_pid(m)
            m.sh("echo before > before")
            filler = fill(statefs, "filler", 3 << 20)

            # several writers fill it: rewrites save blobs, creates add events
            results = run_writers(m.ws, 3, 10, 64 << 10)
            errors = total_errors(results)
            assert errors.get("ENOSPC", 0) > 0, results
            assert set(errors) == {"ENOSPC"}, results  # never EIO, never ENOTCONN
            assert sum(r["ok"] for r in results) > 0, results
            assert_alive(m, pid)

            # not a byte left: the journal itself cannot grow, and a create is refused
            filler2 = fill(statefs, "filler2", 0)
            r = subprocess.run([sys.executable, "-c", CREATOR, m.ws, "20000"], cwd="/",
                               capture_output=True, text=True, timeout=60 * SLOW)
            made = json.loads(r.stdout)
            assert made["errno"] == "ENOSPC", (made, r.stderr)
            assert not os.path.exists(os.path.join(m.ws, "j-%d" % made["made"]))
            assert_alive(m, pid)
            # a control request is refused in one line, as the record cannot take it (it was
            # an "internal error", with a traceback in the daemon's log)
            r = overlayrec("session", "begin", "--session", "full", cwd=m.ws, check=False)
            assert r.returncode == 1 and "internal error" not in r.stderr and \
                "not recorded: " in r.stderr and len(r.stderr.strip().splitlines()) == 1, \
                r.stderr

            # while full: status and log warn, in one line; no partial blob was left behind
            r = overlayrec("status", m.ws)
            assert "warning" in r.stderr and "ENOSPC" in r.stderr, r.stderr
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert "warning" in overlayrec("log", m.ws, "--limit", "1").stderr
            tmp = os.path.join(m.state, "content", "tmp")
            if os.path.isdir(tmp):
                assert os.listdir(tmp) == []
            data = os.path.join(m.state, "journal", "data.mdb")
            assert os.stat(data).st_size <= 16 << 20  # not a sparse map-sized file

            # space freed: the same mount records again, without a restart
            os.unlink(filler)
            os.unlink(filler2)
            m.sh("echo after > after-free; echo more >> before")
            assert daemon_pid(m) == pid
            evs = m.events()
            first = [e for e in evs if e["path"] == "after-free"]
            assert first and first[0]["op"] == "create", first
            assert any(e["op"] == "write" and e["path"] == "before" and
                       e["seq"] > first[0]["seq"] for e in evs)
            assert_alive(m, pid)
            assert "warning" not in overlayrec("status", m.ws).stderr
        finally:
            m.umount()
        assert_write_ahead(m)
        assert open(os.path.join(m.ws, "after-free")).read() == "after\n"
        log = open(os.path.join(m.state, "daemon.log"), errors="replace").read()
        assert "unexpected error" not in log and "Traceback" not in log, log[-3000:]


@needs_fuse
@needs_root
@pytest.mark.timeout(int(90 * SLOW))
def test_full_workspace_is_enospc_and_the_journal_holds(make_mount):
    m = make_mount()
    with tmpfs(os.path.join(m.base, "wsfs"), "8m") as wsfs:
        m.ws = os.path.join(wsfs, "ws")
        os.mkdir(m.ws)
        fill(m.ws, ".filler", 1 << 20)  # made before the mount: not recorded
        try:
            m.mount()
            pid = daemon_pid(m)
            m.sh("echo seed > seed")
            results = run_writers(m.ws, 3, 10, 256 << 10)
            errors = total_errors(results)
            assert errors.get("ENOSPC", 0) > 0, results
            assert set(errors) == {"ENOSPC"}, results
            assert_alive(m, pid)

            # the refused writes are voided in the journal, which reads back
            evs = m.events(failed=True)
            failed = [e for e in evs if e["op"] == "failed"]
            assert failed and all(e["errno"] == errno.ENOSPC for e in failed), failed[:5]
            by_seq = {e["seq"]: e for e in evs}
            assert all(by_seq[e["ref"]]["path"] == e["path"] for e in failed)
            r = overlayrec("diff", m.ws, "--since", "0", "--stat")
            assert "seed" in r.stdout

            # room again (a truncation through the mount frees it; an unlink would keep the
            # file in the attic): the same mount writes and records
            m.sh("truncate -s 0 w0-* w1-*")
            m.sh("echo after > after-free")
            assert "after-free" in {e["path"] for e in m.events()}
            assert daemon_pid(m) == pid
        finally:
            m.umount()
        assert_write_ahead(m, before={".filler"})
        log = open(os.path.join(m.state, "daemon.log"), errors="replace").read()
        assert "unexpected error" not in log and "Traceback" not in log, log[-3000:]


# -- without a mount: the recorder's bookkeeping after a refused commit (no root needed) ---------

@pytest.mark.timeout(int(30 * SLOW))
def test_a_refused_commit_leaves_no_half_epoch(tmp_path, monkeypatch):
    """A truncation refused because the journal is full (its pre-image captured, its commit
    failed) is not made, and leaves the epoch as it was: the retry, once there is room again,
    journals the pre-image again (a recorder that kept the epoch would journal the truncation
    without the content it destroyed)."""
    from overlayrec.attribution import Attribution
    from overlayrec.journal import Journal, JournalError
    from overlayrec.recorder import Recorder

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "f").write_bytes(b"the old content")
    j = Journal(str(tmp_path / "state"))
    root_fd = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    opath = os.open(ws / "f", os.O_PATH | os.O_CLOEXEC)
    rw = os.open(ws / "f", os.O_RDWR | os.O_CLOEXEC)
    try:
        rec = Recorder(j, root_fd, Attribution())
        actor = rec.attribution.actor(os.getpid())
        real = j._write

        def full(body):  # every commit refused, as by a full filesystem
            raise JournalError("journal write failed: no space", errno.ENOSPC)
        monkeypatch.setattr(j, "_write", full)
        with pytest.raises(JournalError) as refused:
            rec.truncate(opath, 0, actor, open_fd=rw)
        assert refused.value.errno == errno.ENOSPC
        assert (ws / "f").read_bytes() == b"the old content"  # write-ahead: not made
        assert "f" not in rec.epochs

        monkeypatch.setattr(j, "_write", real)  # space freed
        rec.truncate(opath, 0, actor, open_fd=rw)
        assert (ws / "f").read_bytes() == b""
        evs = [e for e in j.events() if e.get("path") == "f"]
        assert [e["op"] for e in evs] == ["truncate"]
        assert evs[0]["epoch"] and j.content.get(evs[0]["pre"]["blob"]) == b"the old content"
    finally:
        for fd in (rw, opath, root_fd):
            os.close(fd)
        j.close()


READER = r'''
import sys
from overlayrec.journal import Journal
j = Journal(sys.argv[1], readonly=True)
print(j.count(), flush=True)
sys.stdin.readline()          # the writer grows the map meanwhile
print(j.count(), j.event(j.last_seq())["path"], flush=True)
'''


@pytest.mark.timeout(int(60 * SLOW))
def test_the_map_grows_with_the_data_and_readers_follow(tmp_path, monkeypatch):
    """The writer's map starts small and grows on MDB_MAP_FULL (the commit retried, nothing
    lost); data.mdb is as long as its data (no sparse map-sized file); a reader opened before
    the growth reads what was written after it."""
    from overlayrec.journal import Journal, schema

    monkeypatch.setattr(schema, "MAP_SIZE", 1 << 20)
    monkeypatch.setattr(schema, "MAP_STEP", 1 << 20)
    state = str(tmp_path / "state")
    j = Journal(state)
    try:
        j.append({"op": "create", "path": "first", "actor": "a"})
        first_map = j.env.info()["map_size"]
        assert first_map <= 2 << 20
        reader = subprocess.Popen([sys.executable, "-c", READER, state], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd="/")
        try:
            assert reader.stdout.readline().split() == ["1"]
            n = 6000
            j.append_many([{"op": "write", "path": f"d/f{i}", "actor": "a", "pad": "x" * 400}
                           for i in range(n // 2)], [])  # one commit larger than the map
            for i in range(n // 2, n):
                j.append({"op": "write", "path": f"d/f{i}", "actor": "a", "pad": "x" * 400})
            assert j.count() == n + 1 and j.last_seq() == n + 1
            assert j.env.info()["map_size"] > first_map
            size = os.stat(os.path.join(state, "journal", "data.mdb")).st_size
            assert size <= j.env.info()["map_size"] and size < (n * 600) * 2
            reader.stdin.write("\n")
            reader.stdin.flush()
            assert reader.stdout.readline().split() == [str(n + 1), f"d/f{n - 1}"]
        finally:
            reader.kill()
            reader.wait()
    finally:
        j.close()


# -- a revert into a full workspace -------------------------------------------------------------

CALL = r'''
import subprocess, sys
from overlayrec import client
with client.connect() as c:
    c.call_begin("c1", "Bash")
    subprocess.run(["bash", "-c", sys.argv[1]], check=True)
    c.call_end("c1")
'''


@needs_fuse
@needs_root
@pytest.mark.timeout(int(90 * SLOW))
def test_a_revert_without_room_changes_nothing_and_leaves_nothing(make_mount, tmp_path):
    """A revert that must write more than the workspace's filesystem has room for (the files
    it replaces free none: the record keeps them) is refused before anything changes: one
    line that says so and what to do, no pending revert to continue or roll back, no temp
    file left in the workspace (one was: 11 MB of a half-written `.x.bin.overlayrec-revert-N`,
    and the revert stayed pending).  Once room is made, the same revert goes through."""
    m = make_mount()
    with tmpfs(os.path.join(m.base, "wsfs"), "10m") as wsfs:
        m.ws = os.path.join(wsfs, "ws")
        os.mkdir(m.ws)
        old = os.urandom(3 << 20)
        with open(os.path.join(m.ws, "x.bin"), "wb") as f:
            f.write(old)
        (tmp_path / "call.py").write_text(CALL)
        try:
            m.mount()
            overlayrec("run", "-w", m.ws, "--", sys.executable, str(tmp_path / "call.py"),
                       "head -c 3M /dev/urandom > x.bin", cwd=m.ws)
            new = open(os.path.join(m.ws, "x.bin"), "rb").read()
            assert new != old and len(new) == len(old)
            filler = fill(m.ws, "filler", 1 << 20)  # through the mount: recorded, as a user's
            listing = sorted(os.listdir(m.ws))
            r = overlayrec("revert", m.ws, "--call", "c1", "--yes", check=False)
            assert r.returncode == 1, (r.stdout, r.stderr)
            err = r.stderr.strip()
            assert err.startswith("overlayrec: error: nothing reverted: the revert writes 3.0 MiB "
                                  "into the workspace, whose filesystem has "), err
            assert "free some room" in err and "\n" not in err and "Traceback" not in err, err
            assert sorted(os.listdir(m.ws)) == listing  # no temp file
            assert open(os.path.join(m.ws, "x.bin"), "rb").read() == new
            assert "pending revert" not in overlayrec("status", m.ws).stdout
            os.truncate(filler, 0)  # a truncation frees room (an unlink would keep it)
            overlayrec("revert", m.ws, "--call", "c1", "--yes")
            assert open(os.path.join(m.ws, "x.bin"), "rb").read() == old
            assert sorted(os.listdir(m.ws)) == listing
        finally:
            m.umount()


@needs_root
@pytest.mark.timeout(int(30 * SLOW))
def test_a_revert_step_stopped_by_a_full_disk_leaves_no_temp_file(tmp_path):
    """Past the room check (another writer filled the disk meanwhile), a step whose write the
    filesystem refuses removes its temp file and names the path and what to do; the revert
    stays pending, to be continued or rolled back."""
    from overlayrec.engines.revert_apply import apply_step
    from overlayrec.engines.revert_steps import Step
    from overlayrec.engines.states import State
    with tmpfs(str(tmp_path / "small"), "2m") as small:
        with open(os.path.join(small, "big"), "wb") as f:
            f.write(b"old\n")
        root = os.open(small, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            step = Step("big", State("file", 0o644, os.urandom(3 << 20)),
                        State("file", 0o644, b"old\n"))
            with pytest.raises(OSError) as e:
                apply_step(root, step, {})
        finally:
            os.close(root)
        assert e.value.errno == errno.ENOSPC and e.value.filename == "big", e.value
        assert "overlayrec revert --continue" in e.value.strerror, e.value
        assert os.listdir(small) == ["big"]
        assert open(os.path.join(small, "big"), "rb").read() == b"old\n"


@needs_fuse
@needs_root
@pytest.mark.timeout(int(60 * SLOW))
def test_a_replay_into_a_full_filesystem_says_so_and_leaves_nothing(make_mount, tmp_path):
    """`replay --to` a directory on a filesystem without room for the tree: one line naming
    the destination (it was a bare "No space left on device"), and nothing left there."""
    m = make_mount()
    m.mount()
    try:
        m.sh("head -c 3M /dev/urandom > big.bin && echo small > s.txt")
    finally:
        m.umount()
    with tmpfs(str(tmp_path / "small"), "1m") as small:
        dest = os.path.join(small, "out")
        r = overlayrec("replay", m.ws, "--at", str(10 ** 6), "--to", dest, check=False)
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert r.stderr.strip() == (f"overlayrec: error: cannot write {dest}: No space left on "
                                    "device (nothing written there: free some room, or replay "
                                    "elsewhere)"), r.stderr
        assert os.listdir(small) == []


def test_the_room_a_revert_takes_counts_what_small_files_it_replaces_give_back():
    """The room check's sum (engines.revert_apply.bytes_written): a small file replaced gives its
    room back once renamed over (its pre-image is copied into the state dir), a large one does
    not (the attic keeps it); a hard-link group is written once; a file whose content stays
    (a chmod) takes nothing; the peak counts, not the sum."""
    from overlayrec.engines.revert_apply import bytes_written
    from overlayrec.engines.revert_steps import Plan, Step
    from overlayrec.engines.states import ABSENT, State
    k = 4096

    def f(size, **kw):
        return State("file", 0o644, b"x" * size, **kw)
    plan = Plan("p", {}, [
        Step("a", f(3 * k), f(3 * k - 1)),            # +3k, then the old 3k given back
        Step("b", f(2 * k), f(5 * k)),                # +2k (peak 3k), then 5k back
        Step("c", f(4 * k, ino=7, nlink=2), ABSENT),  # a group: written once
        Step("d", f(4 * k, ino=7, nlink=2), ABSENT),
        Step("e", f(k), f(k)),                        # content as it is: mode and owner only
        Step("big", f(6 * k), f(100 * k)),            # the large one it replaces stays
        Step("skip", f(50 * k), ABSENT, conflict="changed"),
    ])
    # running: 3k, 0k, 2k, -3k, 1k (c), 7k (big): the peak is 7k with a small limit of 8k
    assert bytes_written(plan, 8 * k) == 7 * k
    # with nothing small enough to be given back: 3 + 2 + 4 + 6 = 15k
    assert bytes_written(plan, 0) == 15 * k


@needs_fuse
@needs_root
@pytest.mark.timeout(int(90 * SLOW))
def test_a_file_whose_attic_entry_was_reclaimed_is_read_from_its_seal(make_mount, tmp_path):
    """A call writes a large file until the workspace is full (its end seals it: the content
    kept); the next call removes it (kept whole in the attic) and its next write, refused, has
    the mount drop that entry to free room.  The seal holds what the file held as it left (the
    same inode, size and mtime): replay before that call gave it empty and inexact, `show`
    the deletion of an empty file, and revert refused it as unrecorded."""
    m = make_mount()
    with tmpfs(os.path.join(m.base, "wsfs"), "4m") as wsfs:
        m.ws = os.path.join(wsfs, "ws")
        os.mkdir(m.ws)
        calls = tmp_path / "agent.sh"
        calls.write_text(
            f'O="{sys.executable} -m overlayrec"\n'
            "$O call begin --id p1 --tool Bash\n"
            "head -c 6000000 /dev/urandom > partial.bin 2>/dev/null\n"
            "$O call end --id p1\n"
            "$O call begin --id p3 --tool Bash\n"
            "rm partial.bin; head -c 6000000 /dev/zero > z.bin 2>/dev/null\n"
            "$O call end --id p3\n")
        try:
            m.mount()
            overlayrec("run", "-w", m.ws, "--session", "s", "--", "sh", str(calls), cwd=m.ws)
            evs = m.events()
            assert any(e["op"] == "reclaim" for e in evs), [e["op"] for e in evs]
            at_p1 = tmp_path / "p1"
            overlayrec("replay", m.ws, "--at", "call:p1", "--to", str(at_p1))
            kept = (at_p1 / "partial.bin").read_bytes()
            assert len(kept) > 1 << 20
            out = json.loads(overlayrec("replay", m.ws, "--at", "before:call:p3", "--to",
                                        str(tmp_path / "b3"), "--json").stdout)
            assert out["inexact"] == [], out
            assert (tmp_path / "b3" / "partial.bin").read_bytes() == kept
            plan = json.loads(overlayrec("revert", m.ws, "--call", "p3", "--json",
                                         check=False).stdout)
            steps = {s["path"]: (s["action"], s["conflict"]) for s in plan["steps"]}
            assert steps["partial.bin"] == ("create", None), steps
            unlink = next(e for e in evs if e["op"] == "unlink" and e["path"] == "partial.bin")
            shown = overlayrec("show", str(unlink["seq"]), "-w", m.ws).stdout
            assert "e69de29" not in shown and "deleted file" in shown, shown
        finally:
            m.umount()


def fill_through(path: str, name: str) -> None:
    """A filler written through the mount, page by page, until the filesystem refuses."""
    fd = os.open(os.path.join(path, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)


@needs_fuse
@needs_root
@pytest.mark.timeout(int(120 * SLOW))
@pytest.mark.parametrize("large", [False, True], ids=["alone", "beside-a-large-entry"])
def test_a_full_workspace_stores_waiting_small_pre_images_before_dropping_any(make_mount,
                                                                             tmp_path, large):
    """On a full workspace, ``rm a; cp b c`` failed through the mount with ENOSPC where it
    works natively: the removed file waited in the attic (same filesystem) for the idle copy
    into the store, and the reclaim never drops a waiting entry (found by a bug hunt).  The
    waiting pre-image now goes into the store at once and the copy goes through; beside a
    large entry, that entry is not dropped for room either.  Every reader gives the removed
    files' content exactly."""
    m = make_mount(env=dict(os.environ, OVERLAYREC_TEST_SETTLE_IDLE="3600"))  # no idle copy
    with tmpfs(os.path.join(m.base, "wsfs"), "2m") as wsfs:
        m.ws = os.path.join(wsfs, "ws")
        os.mkdir(m.ws)
        a = b"".join(b"%d\n" % i for i in range(1, 2001))
        b = b"".join(b"%d\n" % i for i in range(2001, 4001))
        big = os.urandom(300 << 10)  # past the small-file size: the attic keeps it by link
        for name, data in (("a", a), ("b", b), ("big", big)):
            with open(os.path.join(m.ws, name), "wb") as f:
                f.write(data)
        try:
            m.mount()
            fill_through(m.ws, "filler")
            r = m.sh("rm big a && cp b c" if large else "rm a && cp b c", check=False)
            assert r.returncode == 0, r.stderr
            assert open(os.path.join(m.ws, "c"), "rb").read() == b
            evs = m.events()
            assert not [e for e in evs if e["op"] == "reclaim"], evs[-5:]
            gone = {e["path"]: e for e in evs if e["op"] == "unlink"}
            pre = gone["a"]["pre"]
            assert "attic" not in pre and m.blob(pre["blob"]) == a, pre
            first = min(e["seq"] for e in gone.values())
            out = json.loads(overlayrec("replay", m.ws, "--at", str(first - 1), "--to",
                                        str(tmp_path / "before"), "--json").stdout)
            assert set(out["inexact"]) <= {"filler"}, out  # (its run goes on past that point)
            assert (tmp_path / "before" / "a").read_bytes() == a
            if large:
                assert (tmp_path / "before" / "big").read_bytes() == big
            diff = overlayrec("diff", m.ws, "--since", "0", "--path", "a").stdout
            assert "deleted file" in diff and diff.count("\n-") == 2000 + 1, diff[:500]
            assert "-1\n-2\n" in diff and "-2000\n" in diff
        finally:
            m.umount()


@needs_fuse
@needs_root
@pytest.mark.timeout(int(60 * SLOW))
def test_a_mount_on_a_full_state_dir_leaves_no_mount(make_mount):
    """The state disk full at the mount: the daemon mounted, failed writing daemon.json and
    exited, leaving a dead mount over the workspace ("Transport endpoint is not connected" for
    every process; found by a hunt).  It unmounts and says why in one line."""
    m = make_mount()
    with tmpfs(os.path.join(m.base, "statefs"), "4m") as statefs:
        m.state = os.path.join(statefs, "state")
        with open(os.path.join(m.ws, "a"), "w") as f:
            f.write("hello\n")
        m.mount()
        m.sh("echo more >> a")
        m.umount()
        fill(statefs, "filler", 0)
        r = overlayrec("mount", m.ws, "--state-dir", m.state, check=False)
        try:
            assert r.returncode != 0 and "No space left on device" in r.stderr, r.stderr
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert not is_mounted(m.ws)
            assert open(os.path.join(m.ws, "a")).read() == "hello\nmore\n"
            assert not os.path.exists(os.path.join(m.state, "daemon.json.tmp"))
        finally:
            m.umount()


@needs_fuse
@needs_root
@pytest.mark.timeout(int(90 * SLOW))
def test_readers_on_a_full_state_dir_say_so(make_mount):
    """The state disk nearly full: `git fast-import` stopped for want of room and the next
    write to it killed diff, show and report by SIGPIPE, exit 141, nothing said (found by a
    hunt).  Each says what git said, in one line."""
    m = make_mount()
    with tmpfs(os.path.join(m.base, "statefs"), "8m") as statefs:
        m.state = os.path.join(statefs, "state")
        m.mount()
        m.py("import os\nfor i in range(4): open(f'big{i}.bin', 'wb').write(os.urandom(300000))")
        m.umount()
        fill(statefs, "filler", 300_000)
        for cmd in (["diff", m.ws, "--since", "0", "--stat"], ["show", "-w", m.ws, "1"],
                    ["report", m.ws, "--html", os.path.join(m.base, "r.html")]):
            r = overlayrec(*cmd, "--state-dir", m.state, check=False)
            assert r.returncode == 1, (cmd, r.returncode, r.stderr)
            assert "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
            assert "overlayrec: error: " in r.stderr, r.stderr


@needs_fuse
@needs_root
@pytest.mark.timeout(int(90 * SLOW))
def test_a_revert_whose_plan_finds_no_room_in_the_state_dir_says_so(make_mount, tmp_path):
    """The state dir's filesystem full as a revert saves its plan: it listed every step and
    ended "No space left on device", saying neither that nothing was reverted nor where the
    room was missing (found by a bug hunt).  Nothing is reverted, and it says so; with room
    made, the same revert goes through."""
    m = make_mount()
    with tmpfs(os.path.join(m.base, "statefs"), "24m") as statefs:
        m.state = os.path.join(statefs, "st")
        m.extra_args = ["--state-dir", m.state]
        olds = {}
        for i in range(6):
            olds[i] = os.urandom(1 << 20)
            with open(os.path.join(m.ws, f"big{i}"), "wb") as f:
                f.write(olds[i])
        try:
            m.mount()
            # written outside any call: no unit's end has sealed (kept) what they hold, so
            # the plan must store it
            news = {i: os.urandom(1 << 20) for i in olds}
            for i, data in news.items():
                with open(os.path.join(m.ws, f"big{i}"), "wb") as f:
                    f.write(data)
            filler = fill(statefs, "filler", 300 << 10)
            r = overlayrec("revert", m.ws, "--state-dir", m.state, "--since", "0", "--yes",
                           check=False)
            err = r.stderr.strip()
            assert r.returncode == 1 and "\n" not in err and err.startswith(
                f"overlayrec: error: nothing reverted: no room in the state dir {m.state} "
                "for the revert's plan"), err
            assert {i: open(os.path.join(m.ws, f"big{i}"), "rb").read() for i in olds} == news
            assert "pending revert" not in overlayrec("status", m.ws, "--state-dir",
                                                      m.state).stdout
            os.unlink(filler)
            overlayrec("revert", m.ws, "--state-dir", m.state, "--since", "0", "--yes")
            assert {i: open(os.path.join(m.ws, f"big{i}"), "rb").read() for i in olds} == olds
        finally:
            m.umount()


@needs_fuse
@needs_root
@pytest.mark.timeout(int(120 * SLOW))
def test_a_run_whose_seal_at_unmount_finds_no_room_says_so(make_mount):
    """The state dir filled by the session itself: the daemon could not seal the record at
    unmount (daemon.log said so) and `run` exited 0, nothing said (found by a bug hunt).  It
    says so in one line and exits 1; the diff that follows names the paths left open."""
    m = make_mount()
    with tmpfs(os.path.join(m.base, "statefs"), "16m") as statefs:
        m.state = os.path.join(statefs, "state")
        for name in ("a", "b"):
            with open(os.path.join(m.ws, name), "w") as f:
                f.write(f"{name}\n")
        filler = os.path.join(statefs, "filler")
        r = overlayrec("run", "-w", m.ws, "--state-dir", m.state, "--session", "S", "--",
                       "bash", "-c", f"echo agent >> a; mv b c; sleep 0.5; "
                       f"dd if=/dev/zero of={filler} bs=1M count=64 2>/dev/null; true",
                       cwd=m.ws, check=False)
        os.unlink(filler)
        assert not is_mounted(m.ws)
        errors = [x for x in r.stderr.splitlines() if x.startswith("overlayrec: error: ")]
        assert r.returncode == 1 and len(errors) == 1, (r.returncode, r.stderr)
        assert "could not seal the record" in errors[0], errors
        assert "no space left in the state dir" in errors[0], errors
        with open(os.path.join(m.ws, "a"), "a") as f:
            f.write("user\n")
        d = overlayrec("diff", "-w", m.ws, "--state-dir", m.state, "--session", "S")
        assert "left unsealed" in d.stderr and d.stderr.rstrip().endswith(": a"), d.stderr


@needs_fuse
@needs_root
@pytest.mark.timeout(int(90 * SLOW))
def test_a_first_diff_on_a_full_state_dir_says_so_and_leaves_no_store(make_mount):
    """The private object store made by the first diff, on a full state dir: git's two lines
    were one line with a literal \\n in it, and a half-made git/ was left behind (found by a
    bug hunt).  One plain line; nothing left; the next diff, once there is room, works."""
    m = make_mount()
    with tmpfs(os.path.join(m.base, "statefs"), "8m") as statefs:
        m.state = os.path.join(statefs, "state")
        m.mount()
        m.sh("echo more > a")
        m.umount()
        filler = fill(statefs, "filler", 0)
        rec = ("-w", m.ws, "--state-dir", m.state, "--since", "0")
        r = overlayrec("diff", *rec, check=False)
        assert r.returncode == 1, r
        assert r.stderr.count("\n") == 1 and "\\n" not in r.stderr, r.stderr
        assert "no space left in the state dir" in r.stderr, r.stderr
        assert not os.path.exists(os.path.join(m.state, "git"))
        os.unlink(filler)
        assert "+more" in overlayrec("diff", *rec).stdout


def test_a_commit_lmdb_refuses_as_eio_on_a_full_state_dir_names_no_space(tmp_path,
                                                                         monkeypatch):
    """LMDB tells a short write (its file could not grow: the state dir full) as EIO; the next
    mount was refused, "journal write failed: mdb_txn_commit: Input/output error" (found by a
    bug hunt).  The words name the cause when the state dir has no room; not otherwise."""
    import lmdb
    from overlayrec.journal import Journal, JournalError, store
    j = Journal(str(tmp_path / "state"))
    try:
        def short_write(txn):
            raise lmdb.Error("mdb_txn_commit: Input/output error")
        monkeypatch.setattr(store, "_free_bytes", lambda path: 0)
        with pytest.raises(JournalError) as full:
            j._write(short_write)
        assert full.value.errno == errno.ENOSPC
        assert "no space left in the state dir" in str(full.value), full.value
        monkeypatch.setattr(store, "_free_bytes", lambda path: 1 << 30)
        with pytest.raises(JournalError) as other:
            j._write(short_write)
        assert other.value.errno == errno.EIO and "no space" not in str(other.value)
    finally:
        j.close()


@needs_fuse
@needs_root
@pytest.mark.timeout(int(120 * SLOW))
def test_a_revert_stopped_by_a_full_state_dir_says_whose_room_it_needs(make_mount, tmp_path):
    """The state dir's filesystem full, the workspace's not: a revert's step is refused
    (the daemon journals each change before it lands), and it said "free room on the
    workspace's filesystem", which had plenty (found by a bug hunt).  It names the state dir;
    once there is room, --continue finishes it."""
    import time
    m = make_mount()
    with tmpfs(os.path.join(m.base, "statefs"), "16m") as statefs:
        m.state = os.path.join(statefs, "state")
        (tmp_path / "call.py").write_text(CALL)
        for i in range(40):
            with open(os.path.join(m.ws, f"f{i}"), "wb") as f:
                f.write(b"%d\n" % i * 20000)
        before = {f"f{i}": open(os.path.join(m.ws, f"f{i}"), "rb").read() for i in range(40)}
        try:
            m.mount()
            overlayrec("run", "-w", m.ws, "--", sys.executable, str(tmp_path / "call.py"),
                       "for i in $(seq 0 39); do head -c 100000 /dev/urandom > f$i; done",
                       cwd=m.ws)
            env = dict(os.environ, OVERLAYREC_TEST_REVERT_DELAY="0.3")
            p = subprocess.Popen([sys.executable, "-m", "overlayrec", "revert", m.ws, "--call",
                                  "c1", "--yes"], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 60 * SLOW
            while not any(open(os.path.join(m.ws, n), "rb").read() == data
                          for n, data in before.items()):
                assert p.poll() is None and time.monotonic() < deadline, p.communicate()
                time.sleep(0.02)
            filler = fill(statefs, "filler", 0)  # the plan saved, a first step made
            out, err = p.communicate(timeout=120 * SLOW)
            assert p.returncode == 1 and "Traceback" not in err, (out, err)
            last = err.strip().splitlines()[-1]
            assert f"the record's state dir {m.state} is full" in last and \
                "workspace's filesystem" not in last, last
            os.unlink(filler)
            overlayrec("revert", m.ws, "--continue")
            after = {n: open(os.path.join(m.ws, n), "rb").read() for n in before}
            assert after == before
        finally:
            m.umount()


@needs_fuse
@needs_root
@pytest.mark.timeout(int(120 * SLOW))
def test_a_file_removed_on_a_full_shared_filesystem_frees_its_room(make_mount, tmp_path):
    """The workspace and the state dir on one filesystem (a project in the home directory
    and the default state dir), filled through the mount: ``rm`` of the file that filled it
    was refused ENOSPC (its event could not be committed, and nothing could be removed
    until the unmount; found by a bug hunt).  The daemon keeps a reserve in the state dir
    and spends it on a change that can free room (or the commit finds room in a page the
    journal has): the rm goes through, the next change that needs room reclaims the attic's
    copy of the file, the room comes back, the reserve is made again, the record is whole and
    every reader says the file was removed."""
    m = make_mount()
    with tmpfs(os.path.join(m.base, "fs"), "24m") as fs:
        m.ws, m.state = os.path.join(fs, "ws"), os.path.join(fs, "state")
        os.mkdir(m.ws)
        with open(os.path.join(m.ws, "keep"), "wb") as f:
            f.write(b"keep\n")
        try:
            m.mount()
            reserve = os.path.join(m.state, "reserve")
            assert os.path.getsize(reserve) > 0
            m.sh("echo one > small")
            fill_through(m.ws, "fill")
            r = m.sh("echo more > more", check=False)
            assert r.returncode != 0 and "No space left" in r.stderr
            r = m.sh("rm fill", check=False)
            assert r.returncode == 0, r.stderr
            assert not os.path.exists(os.path.join(m.ws, "fill"))
            # the next change that needs room has it (the attic's copy of fill reclaimed,
            # by the rm that spent the reserve or by this one)
            m.sh("head -c 4000000 /dev/zero > after")
            # the room comes back once the kernel lets go of the removed file (its forget,
            # after the request), and the reserve is made again a second later at most
            for _ in range(int(100 * SLOW)):
                if free_bytes(m.ws) > 8 << 20 and os.path.exists(reserve):
                    break
                time.sleep(0.1)
            assert free_bytes(m.ws) > 8 << 20
            assert os.path.getsize(reserve) > 0
            m.sh("rm small")  # and the record goes on as before
        finally:
            m.umount()
        overlayrec("check", m.ws, "--state-dir", m.state)
        evs = m.events()
        ops = [(e["op"], e.get("path")) for e in evs if e["op"] != "reclaim"]
        assert ("unlink", "fill") in ops and ("create", "after") in ops, ops
        # refused: voided, or made empty (its write refused), as natively on a full tmpfs
        assert (("create", "more") in ops) == os.path.exists(os.path.join(m.ws, "more")), ops
        assert any(e["op"] == "reclaim" for e in evs)
        names = overlayrec("diff", m.ws, "--state-dir", m.state, "--since", "0",
                           "--name-status").stdout.split()
        assert "fill" not in names and "after" in names and "small" not in names, names
        log = open(os.path.join(m.state, "daemon.log"), errors="replace").read()
        assert "reclaim" in log and "Traceback" not in log, log[-3000:]


@pytest.mark.timeout(int(30 * SLOW))
def test_the_reserve_is_spent_only_on_a_change_that_can_free_room(tmp_path, monkeypatch):
    """Every commit refused (the filesystem the workspace and the state dir share is full)
    while the state dir's reserve is there: a create is refused and leaves the reserve; an
    unlink spends it, goes through with its event journaled, and the reserve is made again
    once there is room."""
    with plain_recorder(tmp_path) as (rec, root_fd):
        _spend_the_reserve(rec, root_fd, monkeypatch)


def _spend_the_reserve(rec, root_fd, monkeypatch):
    from overlayrec.journal import JournalError
    from overlayrec.state import StateDir
    j = rec.journal
    assert rec.make_reserve()
    reserve = StateDir(j.state_dir).reserve
    assert os.stat(reserve).st_blocks * 512 >= 2 << 20
    with open(os.path.join(os.readlink(f"/proc/self/fd/{root_fd}"), "big"), "wb") as f:
        f.write(os.urandom(300 << 10))
    actor = rec.attribution.actor(os.getpid())
    real = j._write

    def full(body):  # refused while the reserve holds the last of the room
        if os.path.exists(reserve):
            raise JournalError("journal write failed: no space", errno.ENOSPC)
        return real(body)
    monkeypatch.setattr(j, "_write", full)
    with pytest.raises(JournalError):
        rec.create(root_fd, "new", os.O_WRONLY, 0o644, 0, 0, actor)
    assert os.path.exists(reserve)
    rec.unlink(root_fd, "big", actor)
    assert os.path.exists(reserve)  # made again: this filesystem has room
    monkeypatch.setattr(j, "_write", real)
    assert [e["op"] for e in j.events() if e.get("path") == "big"] == ["unlink"]
    assert [e["op"] for e in j.events() if e.get("path") == "new"] == []


@pytest.mark.timeout(int(30 * SLOW))
def test_a_refused_copy_of_waiting_pre_images_leaves_no_blob_held(tmp_path, monkeypatch):
    """The small pre-images the attic keeps go into the store in commits of a few, and one
    refused (a full filesystem) leaves nothing held for the next commit: their blobs stayed
    held, every later commit carried them all and was refused, and nothing could change
    until the unmount (found by a bug hunt)."""
    from overlayrec import recorder as recorder_mod
    from overlayrec.journal import JournalError
    with plain_recorder(tmp_path) as (rec, root_fd):
        j = rec.journal
        ws = os.readlink(f"/proc/self/fd/{root_fd}")
        rec.later = True  # kept by the attic until the daemon is idle, as in the daemon
        actor = rec.attribution.actor(os.getpid())
        for i in range(recorder_mod.SETTLE_COMMIT + 5):
            with open(os.path.join(ws, f"f{i}"), "wb") as f:
                f.write(b"%d\n" % i * 100)
            rec.unlink(root_fd, f"f{i}", actor)
        assert len(rec.to_store) == recorder_mod.SETTLE_COMMIT + 5
        real = j._write

        def full(body):
            raise JournalError("journal write failed: no space", errno.ENOSPC)
        monkeypatch.setattr(j, "_write", full)
        assert rec.store_waiting("test") == 0
        assert j._held_blobs == {} and len(rec.to_store) == recorder_mod.SETTLE_COMMIT + 5
        monkeypatch.setattr(j, "_write", real)
        assert rec.store_waiting("test") > 0 and not rec.to_store
        assert j._held_blobs == {}


@needs_fuse
@needs_root
@pytest.mark.timeout(int(150 * SLOW))
def test_records_that_free_nothing_find_room_on_a_full_shared_filesystem(make_mount, tmp_path):
    """The workspace and the state dir on one filesystem; a file renamed over another (the
    attic keeps the old one), then the filesystem filled by another program.  A turn begun then was refused ("not recorded"), so was the
    unmount's seal, and a revert's plan, while the attic held what would free the room (found
    by a bug hunt).  Each now makes room as a refused change does (waiting pre-images into
    the store, then attic entries reclaimed): the turn and its call are recorded, the revert
    goes through, the unmount seals, and the record is whole."""
    m = make_mount()
    with tmpfs(os.path.join(m.base, "fs"), "24m") as fs:
        m.ws, m.state = os.path.join(fs, "ws"), os.path.join(fs, "state")
        os.mkdir(m.ws)
        pad = os.path.join(fs, "pad")

        def fill_again(n: int) -> None:
            """A file renamed over another through the mount (the attic keeps 6 MiB), then
            the filesystem filled by another program, outside the mount."""
            if os.path.exists(pad):
                os.unlink(pad)
            with open(os.path.join(m.ws, f"big{n}"), "wb") as f:
                f.write(os.urandom(3 << 20))
            with open(os.path.join(m.ws, f"fill{n}"), "wb") as f:
                f.write(os.urandom(6 << 20))
            os.rename(os.path.join(m.ws, f"big{n}"), os.path.join(m.ws, f"fill{n}"))
            fill_through(fs, "pad")
            assert free_bytes(m.ws) < (1 << 20)  # full: what is tested below
        try:
            m.mount()
            fill_again(1)
            run_script(m, tmp_path, """set -e
or turn begin --prompt one
or call begin --id c1 --tool Bash
echo made > made
or call end --id c1
or turn end
""")
            turns = overlayrec("turns", m.ws, "--state-dir", m.state, "--session", "s",
                               "--json").stdout.splitlines()
            assert [json.loads(t)["index"] for t in turns] == [1], turns
            d = overlayrec("diff", m.ws, "--state-dir", m.state, "--session", "s", "--call",
                           "c1", "--name-status").stdout.split()
            assert d == ["A", "made"], d
            fill_again(2)
            overlayrec("revert", m.ws, "--state-dir", m.state, "--session", "s", "--call",
                       "c1", "--yes")
            assert not os.path.exists(os.path.join(m.ws, "made"))
            fill_again(3)
            r = overlayrec("umount", m.ws, check=False)
            assert r.returncode == 0 and "seal" not in r.stderr, r.stderr
        finally:
            m.umount()
        overlayrec("check", m.ws, "--state-dir", m.state)
        log = open(os.path.join(m.state, "daemon.log"), errors="replace").read()
        assert "Traceback" not in log and "not recorded" not in log, log[-3000:]
        # taken from the reserve (a change through the mount, the revert's, reclaims)
        assert "reserve given to a record" in log, log[-3000:]
        assert not any("dropped attic entry" in line and "(write)" not in line
                       for line in log.splitlines()), log[-3000:]


@needs_fuse
@needs_root
@pytest.mark.timeout(int(150 * SLOW))
def test_reading_and_reverting_on_a_full_shared_filesystem_drops_no_pre_image(make_mount,
                                                                              tmp_path):
    """A file removed through the mount (the attic keeps it), then the filesystem filled by
    another program: `status`, a revert's preview and its own queries each made room by
    dropping the attic's oldest entries, the removed file's among them, and the revert that
    needed it then failed, the file lost (found by a bug hunt).  Requests that journal nothing
    make no room, and a record that does takes it from the reserve: the file comes back."""
    m = make_mount()
    with tmpfs(os.path.join(m.base, "fs"), "24m") as fs:
        m.ws, m.state = os.path.join(fs, "ws"), os.path.join(fs, "state")
        os.mkdir(m.ws)
        data = os.urandom(6 << 20)
        with open(os.path.join(m.ws, "data.bin"), "wb") as f:
            f.write(data)
        try:
            m.mount()
            m.sh("rm data.bin")
            fill(fs, "pad", 300 << 10)  # another program, outside the mount
            assert free_bytes(fs) < (1 << 20)
            overlayrec("status", m.ws, "--state-dir", m.state)
            r = overlayrec("revert", m.ws, "--state-dir", m.state, "--since", "0")
            assert "data.bin" in r.stdout, r.stdout
            r = overlayrec("revert", m.ws, "--state-dir", m.state, "--since", "0", "--yes",
                           check=False)
            # its plan keeps what it puts back in the store: 6 MiB there is no room for
            assert r.returncode == 0 or "nothing reverted: no room" in r.stderr, r.stderr
            os.unlink(os.path.join(fs, "pad"))
            if r.returncode:
                overlayrec("revert", m.ws, "--state-dir", m.state, "--since", "0", "--yes")
            with open(os.path.join(m.ws, "data.bin"), "rb") as f:
                assert f.read() == data
        finally:
            m.umount()
        log = open(os.path.join(m.state, "daemon.log"), errors="replace").read()
        assert "dropped attic entry" not in log, log[-3000:]
