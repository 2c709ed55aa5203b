"""The log ahead of LMDB (overlayrec.journal.ahead): while the daemon serves, each event is a
record there before its change, and its LMDB commit follows a few milliseconds later.  What a
killed writer left there is committed by whoever opens the journal next, reader or writer, so
no reader answers without it; a record cut off by the kill is not an event; near a full disk
the log is not used."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib

import pytest

from overlayrec.journal import Journal, JournalError, store
from overlayrec.journal.ahead import NAME, AheadLog, Batch, decode, encode

from conftest import SLOW, needs_fuse, overlayrec

ACTOR = {"key": "7:7", "pid": 7, "start": 7, "uid": 0}
ODD = "dir/\udcff-undecodable"  # a path whose bytes are not UTF-8 (surrogateescape)


def ev(op: str, path: str, **kw) -> dict:
    return {"op": op, "path": path, "actor": ACTOR["key"], **kw}


def writer(sd: str) -> Journal:
    j = Journal(sd)
    j.hold_notes = True  # as the daemon serves
    return j


def other(sd: str, expr: str):
    """``expr`` over the journal opened read-only as ``r`` in another process (LMDB opens an
    environment once per process); its JSON value."""
    code = ("import json, sys\n"
            "from overlayrec.journal import Journal\n"
            "r = Journal(sys.argv[1], readonly=True)\n"
            f"out = {expr}\n"
            "r.close()\n"
            "print(json.dumps(out))\n")
    out = subprocess.run([sys.executable, "-c", code, sd], capture_output=True, text=True,
                         check=True, timeout=60 * SLOW)
    return json.loads(out.stdout)


def ahead_size(sd: str) -> int:
    try:
        return os.path.getsize(os.path.join(sd, "journal", NAME))
    except FileNotFoundError:
        return 0


def test_a_record_reads_back_as_written(tmp_path):
    batch = Batch([ev("create", ODD, seq=3, t=1), ev("write", "a", seq=4, t=2)],
                  [ACTOR], {"d1": b"\0\1blob", "d2": b""})
    rec = encode(batch, store._dumps)
    back = decode(rec[8:], store._loads)
    assert (back.events, back.actors, back.blobs) == (batch.events, batch.actors, batch.blobs)
    assert back.last_seq == 4


def test_a_record_of_events_and_blobs_alone_reads_back_and_keeps_its_layout(tmp_path):
    """The record of a small pre-image (an unlink, a rename over: events and their blobs, no
    actor or note) takes a shorter way to the same bytes as the general one."""
    batch = Batch([ev("unlink", ODD, seq=7, t=1)], [], {"d1": b"\0\1blob"})
    rec = encode(batch, store._dumps)
    head = b'{"e":[' + store._dumps(batch.events[0]) + b'],"a":[],"x":[],"b":[["d1",6]]}'
    payload = struct.pack("<I", len(head)) + head + b"\0\1blob"
    assert rec == struct.pack("<II", len(payload), zlib.crc32(payload)) + payload
    back = decode(rec[8:], store._loads)
    assert (back.events, back.actors, back.blobs, back.notes) == \
        (batch.events, [], batch.blobs, [])


def test_a_cut_off_or_damaged_record_ends_the_log(tmp_path):
    log = AheadLog(str(tmp_path), store._loads)
    for seq in (1, 2, 3):
        log.append(encode(Batch([ev("chmod", "f", seq=seq, mode=0o600)], [], {}),
                          store._dumps), durable=False)
    log.close()
    assert [b.last_seq for b in log.batches()] == [1, 2, 3]
    size = os.path.getsize(log.path)
    os.truncate(log.path, size - 3)  # the last write cut off by a kill
    assert [b.last_seq for b in log.batches()] == [1, 2]
    with open(log.path, "r+b") as f:  # a byte of the second record's payload flipped
        data = bytearray(f.read())
        first = 8 + int.from_bytes(data[:4], "little")
        data[first + 8 + 5] ^= 0xFF
        f.seek(0)
        f.write(data)
    assert [b.last_seq for b in log.batches()] == [1]


def _record(head: bytes) -> bytes:
    payload = struct.pack("<I", len(head)) + head
    return struct.pack("<II", len(payload), zlib.crc32(payload)) + payload


@pytest.mark.parametrize("head", [b'{"e":[{"foo":1}]}', b'{"e":[{"seq":1}],"a":[],"x":[]}',
                                  b'not json', b'[1, 2]', b'{"e":[3],"a":[],"x":[],"b":[]}',
                                  b'{"e":[],"a":[],"x":[],"b":[["d", -1]]}', b''],
                         ids=["no-keys", "no-blobs", "not-json", "a-list", "no-event",
                              "bad-blob", "empty"])
def test_a_record_whose_crc_holds_but_that_is_no_batch_ends_the_log(tmp_path, head):
    """Damage (or a hand) that left a record whose CRC matches but which holds no batch made
    every command, the mount included, an internal error (KeyError, TypeError, struct.error)
    until the file was removed by hand: it ends the log, as a torn record does, and the
    writer's open keeps it aside."""
    sd = str(tmp_path / "state")
    Journal(sd).close()
    path = os.path.join(sd, "journal", NAME)
    good = encode(Batch([ev("chmod", "f", seq=1, mode=0o600, t=1)], [ACTOR], {}), store._dumps)
    bad = _record(head) if head else struct.pack("<II", 2, zlib.crc32(b"ab")) + b"ab"
    with open(path, "wb") as f:
        f.write(good + bad + good)
    assert [b.last_seq for b in AheadLog(os.path.join(sd, "journal"), store._loads).batches()] \
        == [1]
    r = Journal(sd, readonly=True)
    try:
        assert [e["op"] for e in r.events()] == ["chmod"]
    finally:
        r.close()
    Journal(sd).close()
    kept = [n for n in os.listdir(os.path.join(sd, "journal")) if ".unread-" in n]
    with open(os.path.join(sd, "journal", kept[0]), "rb") as f:
        assert f.read() == bad + good


def test_a_write_that_fails_leaves_no_part_behind(tmp_path, monkeypatch):
    log = AheadLog(str(tmp_path), store._loads)
    log.append(encode(Batch([ev("chmod", "f", seq=1, mode=0o600)], [], {}), store._dumps),
               durable=False)
    size = os.path.getsize(log.path)
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real(fd, data[:5]))  # a full disk
    with pytest.raises(OSError):
        log.append(encode(Batch([ev("chmod", "f", seq=2, mode=0o644)], [], {}), store._dumps),
                   durable=False)
    monkeypatch.setattr(os, "write", real)
    assert os.path.getsize(log.path) == size
    log.close()


KILLED_WRITER = """
import os, sys
from overlayrec.journal import Journal
j = Journal(sys.argv[1])
j.hold_notes = True
actor = {"key": "7:7", "pid": 7, "start": 7, "uid": 0}
digest = j.content.put_bytes(b"the old bytes")
j.append({"op": "create", "path": "new", "actor": "7:7", "pre": {"kind": "absent"}}, actor)
j.append({"op": "unlink", "path": "old", "actor": "7:7",
          "pre": {"kind": "file", "blob": digest}}, actor)
j.append({"op": "chmod", "path": sys.argv[2], "actor": "7:7", "mode": 384}, actor)
print(j.held, digest, flush=True)
os._exit(0)  # as a kill -9: nothing flushed, nothing closed
"""


def test_what_a_killed_writer_wrote_ahead_is_read_and_then_committed(tmp_path):
    sd = str(tmp_path / "state")
    Journal(sd).close()
    out = subprocess.run([sys.executable, "-c", KILLED_WRITER, sd, ODD], capture_output=True,
                         text=True, check=True, timeout=60 * SLOW).stdout.split()
    held, digest = int(out[0]), out[1]
    assert held == 3 and ahead_size(sd) > 0  # in the log only: LMDB had no commit
    # a reader (another process, the daemon may be serving): it commits them and sees them,
    # and leaves the log to its writer
    seen = other(sd, f"[[e['op'], e['path'], e['seq']] for e in r.events()] + "
                     f"[r.blob({digest!r}).decode(), r.last_seq()]")
    assert seen == [["create", "new", 1], ["unlink", "old", 2], ["chmod", ODD, 3],
                    "the old bytes", 3]
    assert ahead_size(sd) > 0
    # the next writer (the daemon's next mount): the log is emptied, the seqs go on
    j = writer(sd)
    try:
        assert ahead_size(sd) == 0
        assert j.append(ev("write", "new", offset=0, length=1), ACTOR) == 4
    finally:
        j.close()
    assert ahead_size(sd) == 0
    assert other(sd, "[e['seq'] for e in r.events()]") == [1, 2, 3, 4]


def test_a_killed_writer_found_by_a_writer_first(tmp_path):
    sd = str(tmp_path / "state")
    Journal(sd).close()
    subprocess.run([sys.executable, "-c", KILLED_WRITER, sd, "f"], capture_output=True,
                   text=True, check=True, timeout=60 * SLOW)
    j = Journal(sd)
    try:
        assert [e["op"] for e in j.events()] == ["create", "unlink", "chmod"]
        assert ahead_size(sd) == 0 and j.held == 0
    finally:
        j.close()


def test_a_damaged_record_and_what_follows_it_are_kept_aside_not_lost(tmp_path, caplog):
    """A record of the log whose bytes were damaged ends the log (the records after it are not
    read either); the writer's next open applies those before it and empties the log, and the
    bytes it could not apply go to a file of their own beside it, with a warning: they had
    been thrown away with the log."""
    sd = str(tmp_path / "state")
    Journal(sd).close()
    subprocess.run([sys.executable, "-c", KILLED_WRITER, sd, "f"], capture_output=True,
                   text=True, check=True, timeout=60 * SLOW)
    path = os.path.join(sd, "journal", NAME)
    with open(path, "r+b") as f:  # a byte of the second record's payload flipped
        data = bytearray(f.read())
        second = 8 + int.from_bytes(data[:4], "little")
        data[second + 8 + 5] ^= 0xFF
        f.seek(0)
        f.write(data)
    j = Journal(sd)
    try:
        assert [e["op"] for e in j.events()] == ["create"]
        assert ahead_size(sd) == 0
    finally:
        j.close()
    kept = [n for n in os.listdir(os.path.join(sd, "journal")) if n.startswith(NAME + ".unread-")]
    assert len(kept) == 1
    kept_path = os.path.join(sd, "journal", kept[0])
    with open(kept_path, "rb") as f:
        assert f.read() == bytes(data[second:])  # the damaged record and the one after it
    assert os.stat(kept_path).st_mode & 0o777 == 0o600
    assert any("not applied, kept in " + kept_path in r.getMessage() for r in caplog.records)
    Journal(sd).close()  # nothing more to keep: no second file
    assert len([n for n in os.listdir(os.path.join(sd, "journal")) if ".unread-" in n]) == 1


@needs_fuse
def test_the_mount_says_what_it_kept_aside_of_the_log(make_mount):
    m = make_mount().mount()
    m.sh("echo a > f")
    m.umount()
    with open(os.path.join(m.state, "journal", NAME), "ab") as f:
        f.write(b"\x40\x00\x00\x00 not a whole record")  # after whatever the log holds
    r = overlayrec("mount", m.ws, "--state-dir", m.state)
    try:
        kept = [n for n in os.listdir(os.path.join(m.state, "journal")) if ".unread-" in n]
        assert len(kept) == 1
        line = r.stderr.strip()
        assert line.startswith("overlayrec: warning: the log ahead of the journal ended in ") \
            and line.endswith("kept in " + os.path.join(m.state, "journal", kept[0])), r.stderr
        assert [e["path"] for e in m.events() if e["op"] == "create"] == ["f"]
    finally:
        m.umount()
    r = overlayrec("mount", m.ws, "--state-dir", m.state)  # nothing kept this time: not said
    try:
        assert "warning" not in r.stderr, r.stderr
    finally:
        m.umount()


def test_events_go_to_lmdb_at_once_near_a_full_disk(tmp_path, monkeypatch):
    sd = str(tmp_path / "state")
    j = writer(sd)
    try:
        s1 = j.append(ev("create", "a", pre={"kind": "absent"}), ACTOR)
        assert j.held == 1 and ahead_size(sd) > 0  # room: written ahead
        monkeypatch.setattr(store, "_free_bytes", lambda path: store._AHEAD_ROOM - 1)
        monkeypatch.setattr(j, "_room_at", float("-inf"))  # looked at again now
        s2 = j.append(ev("chmod", "a", mode=0o600), ACTOR)
        assert j.held == 0 and ahead_size(sd) == 0  # committed, the earlier one first
        assert other(sd, "[e['seq'] for e in r.events()]") == [s1, s2]
    finally:
        j.close()


def test_durable_syncs_each_record(tmp_path, monkeypatch):
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
    j = Journal(str(tmp_path / "state"), durable=True)
    j.hold_notes = True
    try:
        before = len(synced)
        j.append(ev("create", "a", pre={"kind": "absent"}), ACTOR)
        j.append(ev("chmod", "a", mode=0o600), ACTOR)
        assert len(synced) - before == 2
    finally:
        j.close()


def test_a_reader_that_cannot_commit_says_so(tmp_path, monkeypatch):
    """What was written ahead cannot be committed by this reader: it refuses to answer
    without it (an answer missing changes that happened would be wrong), in one line."""
    sd = str(tmp_path / "state")
    Journal(sd).close()
    subprocess.run([sys.executable, "-c", KILLED_WRITER, sd, "f"], capture_output=True,
                   text=True, check=True, timeout=60 * SLOW)
    import lmdb
    real = Journal._put_event

    def refuse(self, txn, e, raw=None):
        raise lmdb.DiskError("no room")
    monkeypatch.setattr(Journal, "_put_event", refuse)
    with pytest.raises(JournalError) as e:
        Journal(sd, readonly=True)
    assert "written ahead" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setattr(Journal, "_put_event", real)
    r = Journal(sd, readonly=True)
    try:
        assert [e["op"] for e in r.events()] == ["create", "unlink", "chmod"]
    finally:
        r.close()


def test_the_workspace_roots_seal_is_committed(tmp_path):
    """A call that changed the workspace root (chmod -R over it) ends with a seal of "" (the
    root's path); LMDB takes no empty key, so it has one of its own.  That seal used to fail
    its commit, leaving the call's paths unsealed; written ahead, it would have kept every
    later record out of LMDB."""
    sd = str(tmp_path / "state")
    j = writer(sd)
    try:
        j.append(ev("chmod", "", mode=0o755, pre={"kind": "dir", "mode": 0o700}), ACTOR)
        seals = j.append_many([{"op": "seal", "path": p, "pre": {"kind": "dir", "mode": 0o755},
                                "actor": "overlayrec"} for p in ("", "a")], [])
        j.append(ev("chmod", "a", mode=0o600), ACTOR)
        j.flush()
        assert j.held == 0
        assert (j.seal_seq(""), j.seal_seq("a")) == tuple(seals)
        assert sorted(j.seals()) == [("", seals[0]), ("a", seals[1])]
    finally:
        j.close()
    assert other(sd, "[r.seal_seq(''), r.last_seq()]") == [seals[0], seals[1] + 1]


def test_a_record_takes_the_extents_notes_held_before_it(tmp_path):
    """A reader that sees an event sees every write run that ended before it as ended: the
    extents notes held then go with the event's record (docs/design.md)."""
    sd = str(tmp_path / "state")
    j = writer(sd)
    try:
        s1 = j.append(ev("write", "a", offset=0, length=1), ACTOR)
        j.put_extents(s1, {"writes": 2, "bytes": 2, "lo": 0, "hi": 2, "end": s1})
        assert other(sd, f"r.extents({s1})") is None  # held: nothing came after it yet
        s2 = j.append(ev("write", "b", offset=0, length=1), ACTOR)
        assert other(sd, f"[r.extents({s1})['writes'], r.last_seq()]") == [2, s2]
        j.put_extents(s1, {"writes": 3, "bytes": 3, "lo": 0, "hi": 3, "end": s1})
        j.flush()
        assert other(sd, f"r.extents({s1})['writes']") == 3  # the later note wins
    finally:
        j.close()


def test_a_record_keeps_only_its_own_blobs(tmp_path):
    """A small pre-image held after a record was written ahead goes with the next record, not
    into the records already waiting for LMDB's commit (they were written without it)."""
    sd = str(tmp_path / "state")
    j = writer(sd)
    try:
        j.append(ev("create", "a"), ACTOR)
        j.hold_blob("d" * 32, b"the pre-image")
        j.append(ev("rename", "b", path2="a", pre2={"kind": "file", "blob": "d" * 32}), ACTOR)
        waiting = j._pending
        assert [dict(b.blobs) for b in waiting] == [{}, {"d" * 32: b"the pre-image"}]
        read = list(AheadLog(os.path.join(sd, "journal"), store._loads).batches())
        assert [b.blobs for b in read] == [{}, {"d" * 32: b"the pre-image"}]
        j.flush()
        assert j.blob("d" * 32) == b"the pre-image"
    finally:
        j.close()


LONG_READER = """
import json, sys
from overlayrec.journal import Journal
r = Journal(sys.argv[1], readonly=True)
for line in sys.stdin:
    n = r.last_seq()
    print(json.dumps([n, [e["seq"] for e in r.events()]]), flush=True)
r.close()
"""


def test_a_reader_kept_open_sees_what_was_written_ahead_since(tmp_path):
    """A reader that stays open (a test harness, a tool polling the journal) and asks
    ``last_seq`` again sees every event written before it asked, with the events to read."""
    sd = str(tmp_path / "state")
    j = writer(sd)
    reader = subprocess.Popen([sys.executable, "-c", LONG_READER, sd], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        def ask():
            reader.stdin.write("?\n")
            reader.stdin.flush()
            return json.loads(reader.stdout.readline())
        s1 = j.append(ev("create", "a", pre={"kind": "absent"}), ACTOR)
        assert ask() == [s1, [s1]]
        s2 = j.append(ev("chmod", "a", mode=0o600), ACTOR)
        assert j.held == 2  # nothing committed by the writer yet
        assert ask() == [s2, [s1, s2]]
    finally:
        reader.stdin.close()
        reader.wait(timeout=60 * SLOW)
        j.close()


def test_an_actor_made_known_alone_is_read_with_its_events(tmp_path):
    """An agent is made known before its first event (``append_many([], [agent])``, calls.py):
    written ahead as a record with no event, a reader's catch-up, which applies records by
    their seqs, never took it, while the writer wrote the agent's next events without it, so a
    reader in another process found them with no actor until the writer's own commit."""
    sd = str(tmp_path / "state")
    j = writer(sd)
    agent = {"key": "agent:9", "pid": 9, "start": 9, "uid": 0}
    try:
        j.append_many([], [agent])
        s = j.append({"op": "create", "path": "a", "actor": "agent:9",
                      "pre": {"kind": "absent"}}, agent)
        got = other(sd, "[[e['seq'], e['actor']] for e in r.events()] + [r.actor('agent:9')]")
        assert got == [[s, "agent:9"], agent], got
    finally:
        j.close()


SHAPES_WRITER = """
import os, stat, sys
from overlayrec.attribution import Attribution
from overlayrec.fs import Handle
from overlayrec.journal import Journal
from overlayrec.recorder import Recorder
ws, sd, kill = sys.argv[1], sys.argv[2], sys.argv[3] == "kill"
j = Journal(sd)
j.hold_notes = True  # as the daemon serves: every event written ahead, committed later
root = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
rec = Recorder(j, root, Attribution())
actor = rec.attribution.actor(os.getpid())
uid, gid = os.geteuid(), os.getegid()
def sub(path):
    return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root)
rec.mkdir(root, "d", 0o755, uid, gid, actor)
d = sub("d")
for name in ("a", "b"):
    fd = rec.create(d, name, os.O_WRONLY, 0o644, uid, gid, actor)
    rec.write(Handle(fd, None, actor, rec.units.unit_of(actor), rec), 0, name.encode() * 3)
    os.close(fd)
rec.mknod(d, "fifo", stat.S_IFIFO | 0o600, 0, uid, gid, actor)
src = os.open("a", os.O_PATH | os.O_NOFOLLOW, dir_fd=d)
rec.link(src, d, "hard", actor)
os.close(src)
rec.symlink(root, "to-d", "d", uid, gid, actor)
deep = root
for part in ["p" * 240] * 16:  # a path of about 3,900 bytes
    rec.mkdir(deep, part, 0o755, uid, gid, actor)
    deep = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=deep)
fd = rec.create(deep, "long", os.O_WRONLY, 0o644, uid, gid, actor)
os.close(fd)
rec.rename(root, "d", root, "moved", 0, actor)  # a directory with files beneath
rec.unlink(sub("moved"), "b", actor)
print(j.held, flush=True)
if kill:
    os._exit(0)  # as a kill -9: everything still only in the log ahead
j.close()
"""


def test_every_shape_written_ahead_reads_as_if_committed(tmp_path):
    """A directory renamed with files beneath, a fifo, a hard link, a symlink to a directory
    and a path near 4,000 bytes, all only in the log ahead when the writer dies: a reader
    sees the same events, paths, renames and link names as after a clean close."""
    out = {}
    for how in ("kill", "close"):
        ws, sd = tmp_path / f"ws-{how}", str(tmp_path / f"state-{how}")
        ws.mkdir()
        r = subprocess.run([sys.executable, "-c", SHAPES_WRITER, str(ws), sd, how],
                           capture_output=True, text=True, timeout=60 * SLOW)
        assert r.returncode == 0, r.stderr
        assert int(r.stdout) > 10  # written ahead, not committed by the writer
        if how == "kill":
            assert ahead_size(sd) > 0
        out[how] = other(sd, "[[[e['op'], e.get('path'), e.get('path2')] for e in r.events()"
                             " if e['op'] != 'seal'], [[x['src'], x['dst']] for x in "
                             "r.dir_renames()], r.seqs_for_path('moved/a'), "
                             "r.seqs_for_path('d/hard'), r.last_seq()]")
    assert out["kill"] == out["close"]
    events, renames = out["kill"][0], out["kill"][1]
    ops = [e[0] for e in events]
    assert {"mkdir", "create", "write", "mknod", "link", "symlink", "rename", "unlink"} <= \
        set(ops)
    assert renames == [["d", "moved"]]
    long = [e for e in events if e[1] and e[1].endswith("/long")]
    assert len(long) == 1 and len(long[0][1].encode()) > 3800


def test_a_utimens_that_owes_no_pre_image_waits_for_the_next_record(tmp_path):
    """A utimens changes nothing a reader reconstructs (a state has no times): in an epoch
    that saved the path's metadata already (a file this unit made, tar's pattern) it is held
    for the next record, not written ahead on its own; on a path whose first change it is
    (its pre-image owed), or on a file with a second name (an alias to follow), it is written
    ahead.  Either way the record holds every event, in order, with the same fields."""
    from overlayrec.attribution import Attribution
    from overlayrec.fs import Handle
    from overlayrec.recorder import Recorder
    ws, sd = tmp_path / "ws", str(tmp_path / "state")
    ws.mkdir()
    (ws / "old").write_bytes(b"before")
    j = writer(sd)
    root = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        rec = Recorder(j, root, Attribution())
        actor = rec.attribution.actor(os.getpid())
        uid, gid = os.geteuid(), os.getegid()
        records = []
        rec.journal._ahead.append = (lambda append: lambda record, durable: (
            records.append(record), append(record, durable))[1])(rec.journal._ahead.append)
        fd = rec.create(root, "new", os.O_WRONLY, 0o600, uid, gid, actor)
        rec.write(Handle(fd, None, actor, rec.units.unit_of(actor), rec), 0, b"data")
        before = len(records)
        rec.utimens(fd, None, 1_700_000_000_000_000_000, False, actor)
        assert len(records) == before and len(j._held_events) == 1  # no record of its own
        rec.chmod(fd, 0o644, actor)  # a change of the state: its record carries the utimens
        assert len(records) == before + 1 and not j._held_events
        assert b'"op":"utimens"' in records[-1]
        os.close(fd)
        old = os.open("old", os.O_PATH | os.O_NOFOLLOW, dir_fd=root)
        rec.utimens(old, None, 1_600_000_000_000_000_000, False, actor)  # its pre-image owed
        assert len(records) == before + 2
        os.link("old", "other", src_dir_fd=root, dst_dir_fd=root)
        rec.utimens(old, None, 1_600_000_000_000_000_001, False, actor)  # two names now
        assert len(records) == before + 3
        os.close(old)
        j.flush()
        evs = [e for e in j.events() if e["path"] in ("new", "old")]
        assert [(e["op"], e["path"]) for e in evs] == [
            ("create", "new"), ("write", "new"), ("utimens", "new"), ("chmod", "new"),
            ("utimens", "old"), ("utimens", "old")], evs
        assert [e["seq"] for e in evs] == sorted(e["seq"] for e in evs)
        held = evs[2]
        assert "pre" not in held and held["mtime_ns"] == 1_700_000_000_000_000_000 and \
            held["atime_ns"] is None and held["actor"] == actor["key"]
        assert evs[4]["pre"]["size"] == 6  # the first change of "old" took its pre-image
        assert os.stat(ws / "new").st_mtime_ns == 1_700_000_000_000_000_000
    finally:
        os.close(root)
        j.close()


def test_events_of_decodes_only_the_ops_asked_for(tmp_path):
    """``events_of`` gives what filtering ``events`` by op gives, also for a name that holds
    an op's JSON, from LMDB, from what is written ahead and from kept events alike."""
    sd = str(tmp_path / "state")
    j = writer(sd)
    try:
        j.append_many([ev("create", "a"), ev("link", "b", source="a"),
                       ev("create", '"op":"link"'), ev("unlink", "a"),
                       ev("alias", "c"), ev("unrecorded", "d")], [ACTOR])
        j.flush()
        j.append(ev("link", "e", source="b"), ACTOR)  # written ahead, not yet in LMDB
        for ops in (("link", "alias"), ("unrecorded",), ("session_end",)):
            want = [e for e in j.events() if e["op"] in ops]
            assert list(j.events_of(ops)) == want
            assert list(j.events_of(ops, 3, 6)) == [e for e in want if 3 <= e["seq"] <= 6]
        assert [e["path"] for e in j.events_of(("link",))] == ["b", "e"]
        j.keep_events()
        assert [e["path"] for e in j.events_of(("link",))] == ["b", "e"]
    finally:
        j.close()
