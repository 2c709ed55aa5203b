"""Group commit and small blobs in the journal (issue 16's recording cost).

An event that carries no pre-image may wait for the next commit (``Journal.defer``); a small
blob is held and committed with the event that names it (``blobs``).  What must hold, whatever
the timing: nothing that waits is seen by another process before it is committed, everything
that waits is committed in seq order with (or before) the next commit of any kind, a failed
commit keeps what waits, a held blob is never swept, and a pre-image is never what waits.
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
    j.group_commit = True
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


def test_what_waits_is_committed_with_the_next_commit_in_seq_order(tmp_path):
    j = writer(tmp_path)
    woken = []
    j.on_deferred = lambda: woken.append(j.deferred)
    try:
        first = j.append(ev("create", "f", pre={"kind": "absent"}, epoch=True), ACTOR)
        s1 = j.defer(ev("write", "f", offset=0, length=3), ACTOR)
        s2 = j.defer(ev("chmod", "f", mode=0o600), ACTOR)
        j.put_extents(s1, {"writes": 1, "bytes": 3, "lo": 0, "hi": 3, "end": s2})
        assert (s1, s2) == (first + 1, first + 2)
        assert woken == [1]  # woken once, when the first started waiting
        assert [e["seq"] for e in committed(tmp_path)] == [first]
        last = j.append(ev("rename", "f", path2="g", pre={"kind": "file"}), ACTOR)
        assert last == s2 + 1 and j.deferred == 0
        evs = committed(tmp_path)
        assert [(e["seq"], e["op"]) for e in evs] == \
            [(first, "create"), (s1, "write"), (s2, "chmod"), (last, "rename")]
        assert other(tmp_path, f"r.extents({s1})")["end"] == s2
    finally:
        j.close()


def test_a_flush_or_a_read_of_its_own_commits_what_waits(tmp_path):
    j = writer(tmp_path)
    try:
        s = j.defer(ev("write", "f", offset=0, length=1), ACTOR)
        assert committed(tmp_path) == []
        assert [e["seq"] for e in j.events()] == [s]  # the writer reads what it wrote
        assert [e["seq"] for e in committed(tmp_path)] == [s]
        s2 = j.defer(ev("write", "f", offset=1, length=1), ACTOR)
        j.flush()
        assert [e["seq"] for e in committed(tmp_path)] == [s, s2]
    finally:
        j.close()


def test_closing_commits_what_waits(tmp_path):
    j = writer(tmp_path)
    s = j.defer(ev("utimens", "f", atime_ns=1, mtime_ns=2), ACTOR)
    j.close()
    assert [(e["seq"], e["op"]) for e in committed(tmp_path)] == [(s, "utimens")]


def test_without_group_commit_defer_commits_at_once(tmp_path):
    j = Journal(str(tmp_path / "state"))
    try:
        s = j.defer(ev("write", "f", offset=0, length=1), ACTOR)
        assert j.deferred == 0 and [e["seq"] for e in committed(tmp_path)] == [s]
    finally:
        j.close()


def test_a_failed_commit_keeps_what_waits_and_its_blobs(tmp_path, monkeypatch):
    j = writer(tmp_path)
    try:
        s = j.defer(ev("write", "f", offset=0, length=1), ACTOR)
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
        assert j.deferred == 1 and committed(tmp_path) == []
        assert j.content.get(digest) == b"the old bytes"  # held, still the writer's
        seq = j.append(ev("unlink", "f", pre={"kind": "file", "blob": digest}), ACTOR)
        assert seq == s + 1  # the refused event's seq went back, and is given again
        assert [e["seq"] for e in committed(tmp_path)] == [s, seq]
        assert other(tmp_path, f"blob({digest!r})") == "the old bytes"
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


def test_the_recorder_holds_only_what_carries_no_pre_image(tmp_path):
    """A fresh file's write and chmod wait; a change that needs a pre-image never does, and
    commits what waits with it, ahead of the change."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "old").write_bytes(b"before\n")
    j = writer(tmp_path)
    root_fd = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    rec = Recorder(j, root_fd, Attribution())
    actor = {"key": "9:9", "pid": 9, "start": 9, "uid": os.geteuid()}
    try:
        fd = rec.create(root_fd, "tmp", os.O_WRONLY, 0o644, os.geteuid(), os.getegid(), actor)
        assert j.deferred == 0  # a creation commits ahead
        h = Handle(fd, None, actor, rec.units.unit_of(actor), rec)
        rec.write(h, 0, b"after\n")
        path_fd = os.open("tmp", os.O_PATH | os.O_NOFOLLOW, dir_fd=root_fd)
        try:
            rec.chmod(path_fd, 0o600, actor)
        finally:
            os.close(path_fd)
        assert j.deferred == 2 and [e["op"] for e in committed(tmp_path)] == ["create"]
        rec.rename(root_fd, "tmp", root_fd, "old", 0, actor)
        assert j.deferred == 0
        evs = committed(tmp_path)
        assert [e["op"] for e in evs] == ["create", "write", "chmod", "rename"]
        ren = evs[-1]
        assert j.content.get(ren["pre2"]["blob"]) == b"before\n"  # committed with the rename
        assert (ws / "old").read_bytes() == b"after\n"
        os.close(fd)
    finally:
        os.close(root_fd)
        j.close()


@needs_fuse
def test_the_daemon_commits_what_waits_without_another_change(make_mount):
    """A write to a fresh file waits for a commit; with nothing else happening, the daemon's
    flush commits it (no unmount, no other event)."""
    m = make_mount()
    m.mount()
    m.sh("printf one > f; chmod 600 f")
    deadline = time.monotonic() + 10 * SLOW
    ops = []
    while time.monotonic() < deadline:
        ops = [e["op"] for e in m.events() if e.get("path") == "f"]
        if ops == ["create", "write", "chmod"]:
            break
        time.sleep(0.05)
    assert ops == ["create", "write", "chmod"]


@needs_fuse
def test_kill_9_after_rewrites_loses_no_pre_image(make_mount):
    """The rewrite pattern (temp file written, chmodded, renamed over the original), then the
    daemon killed at once: every original's content is in the record (a small blob in the
    journal), whatever of the temp files' events was still waiting."""
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
