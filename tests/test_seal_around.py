"""A seal tells a change made around the mount by the file's ctime against the daemon's own
last change of it (``Recorder._around``).  A pre-image that takes long to save (a large file's
whole content before its first write, the tail a truncate drops) must not make the daemon's own
change, which follows it, look like one made around the mount."""
from __future__ import annotations

import os
import time

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
