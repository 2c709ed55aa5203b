"""Small blobs in the journal and held extents notes (issue 16's recording cost).

A small blob is held and committed in the transaction of the event that names it (``blobs``);
in the daemon, a handle's extents note waits for the next commit (``hold_notes``).  What must
hold, whatever the timing: every event is still committed ahead of its change, with the blobs
it names; nothing held is seen by another process before it is committed; a failed commit
keeps what is held; a held blob is never swept; the daemon commits a held note on its own.
"""
from __future__ import annotations

import json
import os
import signal
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

from conftest import SLOW, needs_fuse

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
        assert woken == [1] and j.held == 2  # woken once, when the first started waiting
        assert [e["seq"] for e in committed(tmp_path)] == [s1, s2]  # events: committed ahead
        assert other(tmp_path, f"r.extents({s2})") is None
        s3 = j.append(ev("chmod", "f", mode=0o600), ACTOR)
        assert j.held == 0
        assert other(tmp_path, f"[r.extents({s2})['end'], r.extents({s1})['writes']]") == [s2, 0]
        assert [e["seq"] for e in committed(tmp_path)] == [s1, s2, s3]
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


def test_a_failed_commit_keeps_held_notes_and_blobs(tmp_path, monkeypatch):
    j = writer(tmp_path)
    try:
        s = j.append(ev("write", "f", offset=0, length=1), ACTOR)
        j.put_extents(s, {"writes": 1, "bytes": 1, "lo": 0, "hi": 1, "end": s})
        digest = j.content.put_bytes(b"the old bytes")
        real = j._put_event
        calls = []

        def refuse_once(txn, e):
            if not calls:
                calls.append(e["seq"])
                raise lmdb.DiskError("no room")
            return real(txn, e)
        monkeypatch.setattr(j, "_put_event", refuse_once)
        with pytest.raises(JournalError):
            j.append(ev("unlink", "f", pre={"kind": "file", "blob": digest}), ACTOR)
        assert j.held == 1 and [e["seq"] for e in committed(tmp_path)] == [s]
        assert other(tmp_path, f"[r.extents({s}), blob({digest!r})]") == [None, None]
        assert j.content.get(digest) == b"the old bytes"  # held, still the writer's
        seq = j.append(ev("unlink", "f", pre={"kind": "file", "blob": digest}), ACTOR)
        assert seq == s + 1  # the refused event's seq went back, and is given again
        assert [e["seq"] for e in committed(tmp_path)] == [s, seq]
        assert other(tmp_path, f"[r.extents({s})['writes'], blob({digest!r})]") == \
            [1, "the old bytes"]
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
    write = [e for e in m.events() if e["op"] == "write" and e["path"] == "f"]
    assert len(write) == 1  # committed ahead of the write
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
