"""Small blobs in the journal and held extents notes (issue 16's recording cost).

A small blob is held and committed in the transaction of the event that names it (``blobs``);
in the daemon, a handle's extents note waits for the next commit (``hold_notes``).  What must
hold, whatever the timing: every event is still committed ahead of its change, with the blobs
it names; nothing held is seen by another process before it is committed; a failed commit
keeps what is held; a held blob is never swept; the daemon commits a held note on its own.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time

import lmdb
import pytest
import xxhash

from overlayrec.attribution import Attribution
from overlayrec.fs import Handle
from overlayrec.journal import Journal, JournalError
from overlayrec.journal.schema import INLINE_BLOB
from overlayrec.recorder import Recorder

from conftest import SLOW, needs_fuse, overlayrec

ACTOR = {"key": "7:8", "pid": 7, "start": 8}


def writer(tmp_path) -> Journal:
    j = Journal(str(tmp_path / "state"))
    j.hold_notes = True
    return j


def other(tmp_path, expr: str):
    """``expr`` evaluated in another process (LMDB opens an environment once per process)
    over the state dir's journal opened read-only as ``r``; its JSON value."""
    code = ("import json, sys\n"
            "from overlayrec.journal import Journal\n"
            "r = Journal(sys.argv[1], readonly=True)\n"
            "def blob(d):\n"
            "    try:\n"
            "        return r.content.get(d).decode()\n"
            "    except FileNotFoundError:\n"
            "        return None\n"
            f"print(json.dumps({expr}))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "state")],
                         capture_output=True, text=True, check=True, timeout=60 * SLOW)
    return json.loads(out.stdout)


def committed(tmp_path) -> list[dict]:
    """The events another process sees now."""
    return other(tmp_path, "list(r.events())")


def ev(op: str, path: str, **kw) -> dict:
    return {"op": op, "path": path, "actor": ACTOR["key"], **kw}


def test_a_held_note_is_committed_with_the_next_commit(tmp_path):
    j = writer(tmp_path)
    woken = []
    j.on_held = lambda: woken.append(j.held)
    try:
        s1 = j.append(ev("create", "f", pre={"kind": "absent"}, epoch=True), ACTOR)
        s2 = j.append(ev("write", "f", offset=0, length=3), ACTOR)
        j.put_extents(s2, {"writes": 1, "bytes": 3, "lo": 0, "hi": 3, "end": s2})
        j.put_extents(s1, {"writes": 0, "bytes": 0, "lo": 0, "hi": 0, "end": s2})
        # woken once, when the first started waiting: two events written ahead, two notes
        assert woken == [1] and j.held == 4
        # the events were written ahead: a reader's open commits them (module ahead)
        assert [e["seq"] for e in committed(tmp_path)] == [s1, s2]
        assert other(tmp_path, f"r.extents({s2})") is None  # the notes wait for the next
        s3 = j.append(ev("chmod", "f", mode=0o600), ACTOR)  # ... which takes them along
        assert j.held == 3 and woken == [1]
        assert other(tmp_path, f"[r.extents({s2})['end'], r.extents({s1})['writes']]") == [s2, 0]
        assert [e["seq"] for e in committed(tmp_path)] == [s1, s2, s3]
        j.flush()  # the daemon's, 5 ms after the first started waiting
        assert j.held == 0
    finally:
        j.close()


def test_a_flush_a_read_or_a_close_commits_held_notes(tmp_path):
    j = writer(tmp_path)
    try:
        s = j.append(ev("write", "f", offset=0, length=1), ACTOR)
        j.put_extents(s, {"writes": 1, "bytes": 1, "lo": 0, "hi": 1, "end": s})
        assert other(tmp_path, f"r.extents({s})") is None
        assert j.extents(s)["end"] == s  # the writer reads what it wrote
        assert other(tmp_path, f"r.extents({s})")["end"] == s
        j.put_extents(s, {"writes": 2, "bytes": 2, "lo": 0, "hi": 2, "end": s})
        j.flush()
        assert other(tmp_path, f"r.extents({s})")["writes"] == 2
        j.put_extents(s, {"writes": 3, "bytes": 3, "lo": 0, "hi": 3, "end": s})
    finally:
        j.close()
    assert other(tmp_path, f"r.extents({s})")["writes"] == 3


def test_without_hold_notes_a_note_commits_at_once(tmp_path):
    j = Journal(str(tmp_path / "state"))
    try:
        s = j.append(ev("write", "f", offset=0, length=1), ACTOR)
        j.put_extents(s, {"writes": 1, "bytes": 1, "lo": 0, "hi": 1, "end": s})
        assert j.held == 0 and other(tmp_path, f"r.extents({s})")["writes"] == 1
    finally:
        j.close()


def test_a_failed_write_ahead_keeps_held_notes_and_blobs(tmp_path, monkeypatch):
    """The log ahead cannot take the record (a full disk): the append is refused with the
    errno, its seq goes back, and what waited (the note, the blob) waits on."""
    j = writer(tmp_path)
    try:
        s = j.append(ev("write", "f", offset=0, length=1), ACTOR)
        j.put_extents(s, {"writes": 1, "bytes": 1, "lo": 0, "hi": 1, "end": s})
        digest = j.content.put_bytes(b"the old bytes")
        real = j._ahead.append
        calls = []

        def refuse_once(record, durable):
            if not calls:
                calls.append(record)
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(record, durable)
        monkeypatch.setattr(j._ahead, "append", refuse_once)
        with pytest.raises(JournalError) as refused:
            j.append(ev("unlink", "f", pre={"kind": "file", "blob": digest}), ACTOR)
        assert refused.value.errno == errno.ENOSPC
        assert j.held == 2 and [e["seq"] for e in committed(tmp_path)] == [s]
        assert other(tmp_path, f"[r.extents({s}), blob({digest!r})]") == [None, None]
        assert j.content.get(digest) == b"the old bytes"  # held, still the writer's
        seq = j.append(ev("unlink", "f", pre={"kind": "file", "blob": digest}), ACTOR)
        assert seq == s + 1  # the refused event's seq went back, and is given again
        assert [e["seq"] for e in committed(tmp_path)] == [s, seq]
        assert other(tmp_path, f"blob({digest!r})") == "the old bytes"
        j.flush()
        assert other(tmp_path, f"r.extents({s})['writes']") == 1
    finally:
        j.close()


def test_a_failed_commit_keeps_what_was_written_ahead(tmp_path, monkeypatch):
    """LMDB cannot take the records written ahead now: the flush says so, they wait on (a
    reader still sees them: it commits them itself), and the next flush commits them."""
    j = writer(tmp_path)
    try:
        digest = j.content.put_bytes(b"the old bytes")
        s = j.append(ev("unlink", "f", pre={"kind": "file", "blob": digest}), ACTOR)
        real = j._put_event
        calls = []

        def refuse_once(txn, e, raw=None):
            if not calls:
                calls.append(e["seq"])
                raise lmdb.DiskError("no room")
            return real(txn, e, raw)
        monkeypatch.setattr(j, "_put_event", refuse_once)
        with pytest.raises(JournalError):
            j.flush()
        assert calls == [s] and j.held == 1
        assert os.path.getsize(j._ahead.path) > 0  # still written ahead
        assert other(tmp_path, f"[[e['seq'] for e in r.events()], blob({digest!r})]") == \
            [[s], "the old bytes"]
        j.flush()
        assert j.held == 0 and os.path.getsize(j._ahead.path) == 0
        assert [e["seq"] for e in committed(tmp_path)] == [s]
    finally:
        j.close()


def test_small_blobs_go_in_the_event_commit_large_ones_to_files(tmp_path):
    j = writer(tmp_path)
    try:
        small, large = b"s" * INLINE_BLOB, b"L" * (INLINE_BLOB + 1)
        ds, dl = j.content.put_bytes(small), j.content.put_bytes(large)
        assert (ds, dl) == (xxhash.xxh3_128_hexdigest(small), xxhash.xxh3_128_hexdigest(large))
        files = os.path.join(str(tmp_path / "state"), "content")
        assert os.path.exists(os.path.join(files, dl[:2], dl[2:]))
        assert not os.path.exists(os.path.join(files, ds[:2], ds[2:]))
        # not committed yet: no other process sees it
        assert other(tmp_path, f"[blob({ds!r}), blob({dl!r})]") == [None, large.decode()]
        j.append(ev("unlink", "f", pre={"kind": "file", "blob": ds}), ACTOR)
        assert other(tmp_path, f"[blob({ds!r}), dict(r.blob_sizes())]") == \
            [small.decode(), {ds: len(small)}]
    finally:
        j.close()


def test_a_sweep_spares_held_and_named_blobs(tmp_path):
    j = writer(tmp_path)
    try:
        named = j.content.put_bytes(b"named")
        orphan = j.content.put_bytes(b"orphan")
        j.append(ev("unlink", "f", pre={"kind": "file", "blob": named}), ACTOR)
        held = j.content.put_bytes(b"held, its event not committed yet")
        n, size = j.content.sweep({named}, time.time_ns())
        assert (n, size) == (1, len(b"orphan"))
        assert not j.content.has(orphan)
        assert j.content.get(named) == b"named"
        assert j.content.get(held) == b"held, its event not committed yet"
    finally:
        j.close()


def test_the_recorder_commits_every_event_ahead_with_the_blobs_it_names(tmp_path):
    """The rewrite pattern driven through the recorder: each event is committed before its
    change (another process sees it at once), the renamed-over file's content in the rename's
    own commit, in the journal, with no file in the content store."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "old").write_bytes(b"before\n")
    j = writer(tmp_path)
    root_fd = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    rec = Recorder(j, root_fd, Attribution())
    actor = {"key": "9:9", "pid": 9, "start": 9, "uid": os.geteuid()}
    try:
        fd = rec.create(root_fd, "tmp", os.O_WRONLY, 0o644, os.geteuid(), os.getegid(), actor)
        h = Handle(fd, None, actor, rec.units.unit_of(actor), rec)
        rec.write(h, 0, b"after\n")
        path_fd = os.open("tmp", os.O_PATH | os.O_NOFOLLOW, dir_fd=root_fd)
        try:
            rec.chmod(path_fd, 0o600, actor)
        finally:
            os.close(path_fd)
        assert [e["op"] for e in committed(tmp_path)] == ["create", "write", "chmod"]
        rec.rename(root_fd, "tmp", root_fd, "old", 0, actor)
        evs = committed(tmp_path)
        assert [e["op"] for e in evs] == ["create", "write", "chmod", "rename"]
        digest = evs[-1]["pre2"]["blob"]
        assert other(tmp_path, f"blob({digest!r})") == "before\n"
        assert not os.path.exists(os.path.join(j.content.root, digest[:2], digest[2:]))
        assert (ws / "old").read_bytes() == b"after\n"
        os.close(fd)
    finally:
        os.close(root_fd)
        j.close()


@needs_fuse
def test_the_daemon_commits_a_held_note_without_another_change(make_mount):
    """A write run's extents note waits for a commit; with nothing else happening, the
    daemon commits it on its own (no unmount, no other event)."""
    m = make_mount()
    m.mount()
    m.sh("printf one > f")
    # the create that made f began the run its write joined: committed ahead of both
    write = [e for e in m.events() if e["op"] == "create" and e["path"] == "f"]
    assert len(write) == 1 and write[0]["run"]
    deadline = time.monotonic() + 10 * SLOW
    note = None
    while note is None and time.monotonic() < deadline:
        j = m.journal()
        try:
            note = j.extents(write[0]["seq"])
        finally:
            j.close()
        time.sleep(0.05)
    assert note is not None and note["bytes"] == 3 and note["writes"] == 1


def test_what_waits_is_committed_when_idle_and_under_requests_that_never_stop(monkeypatch):
    """The daemon's committer (daemon._commit_held_notes) commits what waits once the loop is
    idle; a loop that is never idle (a task always runnable, as under a stream of requests)
    still gets it committed, within COMMIT_EVERY, not only when the stream ends."""
    import trio

    from overlayrec import daemon

    class Waiting:  # what the committer sees of the journal
        def __init__(self):
            self.hold_notes, self.on_held, self.held, self.flushes = False, None, 0, 0

        def hold(self):
            first = not self.held
            self.held += 1
            if first:
                self.on_held()

        def flush(self):
            self.held, self.flushes = 0, self.flushes + 1
            self.flushed.set()

    async def main(busy: bool) -> tuple[int, int]:
        j = Waiting()
        j.flushed = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(daemon._commit_held_notes, j)
            assert j.hold_notes
            j.hold()
            spins = 0
            if busy:  # never idle: always a task to run; ends once committed, or after 5 s
                end = trio.current_time() + 5
                while j.held and trio.current_time() < end:
                    spins += 1
                    await trio.lowlevel.checkpoint()
            else:
                with trio.move_on_after(5):  # blocked, as the daemon between requests
                    await j.flushed.wait()
            nursery.cancel_scope.cancel()
        assert not j.hold_notes and j.on_held is None  # let go when the daemon stops
        return j.flushes, spins

    with monkeypatch.context() as mp:
        mp.setattr(daemon, "COMMIT_EVERY", 3600.0)  # idle: only the idle wait can commit it
        flushes, _ = trio.run(main, False)
    assert flushes == 1
    flushes, spins = trio.run(main, True)
    assert flushes == 1 and spins > 0, "committed only when the stream ended"


@needs_fuse
def test_kill_9_after_rewrites_loses_no_pre_image(make_mount):
    """The rewrite pattern (temp file written, chmodded, renamed over the original), then the
    daemon killed at once: every original's content is in the record (a small blob in the
    journal), committed with its rename."""
    m = make_mount()
    originals = {f"f{i}": os.urandom(300 + i) for i in range(40)}
    for name, data in originals.items():
        with open(os.path.join(m.ws, name), "wb") as f:
            f.write(data)
    m.mount()
    m.py("import os\n"
         "for i in range(40):\n"
         "    n = f'f{i}'\n"
         "    with open('.' + n + '.tmp', 'wb') as f: f.write(b'new %d' % i)\n"
         "    os.chmod('.' + n + '.tmp', 0o640)\n"
         "    os.replace('.' + n + '.tmp', n)\n")
    pid = json.load(open(os.path.join(m.state, "daemon.json")))["pid"]
    os.kill(pid, signal.SIGKILL)
    m.umount()
    renames = [e for e in m.events() if e["op"] == "rename"]
    assert sorted(e["path2"] for e in renames) == sorted(originals)
    for e in renames:
        assert m.blob(e["pre2"]["blob"]) == originals[e["path2"]]


CALL = r'''
import subprocess, sys
from overlayrec import client
with client.connect() as c:
    c.call_begin("c1", "Bash")
    subprocess.run(["bash", "-c", sys.argv[1]], check=True)
    c.call_end("c1")
'''


def snap(root: str) -> dict:
    """Every path under ``root`` (the attic left out): kind, mode, content or target; a fifo
    is never opened."""
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != ".overlayrec-attic"]
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            elif stat.S_ISFIFO(st.st_mode):
                out[rel] = ("fifo", stat.S_IMODE(st.st_mode))
            else:
                with open(p, "rb") as f:
                    out[rel] = ("file", stat.S_IMODE(st.st_mode), f.read())
    return out


@needs_fuse
def test_journal_blobs_of_every_shape_revert_and_unrevert_exactly(make_mount, tmp_path):
    """Pre-images kept as the journal's small blobs, taken through shapes beyond a plain
    rewrite: a hard link written through its other name, a file rewritten beneath a directory
    renamed in the same call, a file at a path of about 4,000 bytes, a symlink to a directory
    written through, an edit made while unmounted then rewritten, fifos old and new.  Revert
    and unrevert must give back the snapshots taken before and after the call."""
    m = make_mount()
    deep = "/".join(["d" * 200] * 19)  # 3,819 bytes of directories
    long_file = deep + "/" + "f" * 150
    assert len(long_file.encode()) > 3900
    seeds = {"h1": b"linked\n", "dir/a.txt": b"in a dir\n", "dir/b.txt": b"stays\n",
             long_file: b"far down\n", "target/t.txt": b"through a link\n",
             "edited.txt": b"recorded\n"}
    for p, data in seeds.items():
        full = os.path.join(m.ws, p)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)
    os.link(os.path.join(m.ws, "h1"), os.path.join(m.ws, "h2"))
    os.symlink("target", os.path.join(m.ws, "via"))
    os.mkfifo(os.path.join(m.ws, "old.fifo"))
    m.mount()
    m.sh("printf 'seen once\\n' >> edited.txt")  # recorded, sealed at unmount
    m.umount()
    with open(os.path.join(m.ws, "edited.txt"), "ab") as f:  # an edit while unmounted
        f.write(b"unmounted edit\n")
    m.mount()
    (tmp_path / "call.py").write_text(CALL)
    before = snap(m.ws)
    script = ("printf 'more\\n' >> h2 && mv dir moved && sed -i s/in/IN/ moved/a.txt && "
              f"sed -i s/far/FAR/ {long_file} && printf 'x\\n' >> via/t.txt && "
              "sed -i s/unmounted/UNMOUNTED/ edited.txt && mkfifo new.fifo")
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable,
               str(tmp_path / "call.py"), script, cwd=m.ws)
    after = snap(m.ws)
    assert after["moved/a.txt"][2] == b"IN a dir\n" and after["h1"][2] == b"linked\nmore\n"
    assert after["edited.txt"][2] == b"recorded\nseen once\nUNMOUNTED edit\n"
    diff = overlayrec("diff", m.ws, "--call", "c1").stdout
    assert "FAR down" in diff and long_file in diff and "UNMOUNTED edit" in diff
    overlayrec("revert", m.ws, "--call", "c1", "--yes")
    assert snap(m.ws) == before
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert snap(m.ws) == after
    m.umount()
    # the small pre-images were kept in the journal's blobs table (the revert's saved plan
    # keeps its own copy as a file: docs/revert.md)
    env = lmdb.open(os.path.join(m.state, "journal"), readonly=True, lock=False, max_dbs=64)
    try:
        with env.begin(db=env.open_db(b"blobs", create=False)) as txn:
            for data in (b"far down\n", b"in a dir\n", b"linked\n",
                         b"recorded\nseen once\nunmounted edit\n"):
                assert txn.get(xxhash.xxh3_128_hexdigest(data).encode()) == data, data
    finally:
        env.close()
