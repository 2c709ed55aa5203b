"""Flat memory over long sessions (issue 16): what the daemon keeps is bounded by the live tree
and by fixed cache sizes, never by how many events, links or processes a mount has seen.

Unit level, no mount and no timing: the recorder driven directly over a plain directory, the
attribution cache fed real short-lived processes, the journal fed many actors, each checked
at two lengths of the same workload (sizes must not follow the count).
"""
from __future__ import annotations

import os
import random
import subprocess

import pytest

from overlayrec import attribution
from overlayrec.attribution import Attribution
from overlayrec.journal import Journal, store
from overlayrec.recorder import Recorder
from overlayrec.fs import Handle
from overlayrec import underlay

from conftest import SLOW, plain_recorder

NAMES = [f"f{i:02d}" for i in range(30)] + [f"d/g{i:02d}" for i in range(10)]
LINKS = [f"h{i}" for i in range(4)]
SYMLINKS = [f"s{i}" for i in range(4)]


def fake_actor(n: int) -> dict:
    """An actor as attribution reads one (the recorder only keys and journals it)."""
    return {"key": f"{100000 + n}:{n + 1}", "pid": 100000 + n, "start": n + 1, "ppid": 1,
            "uid": os.geteuid(), "exe": "/bin/sh", "argv": ["sh", "-c", f"step {n}"],
            "cwd": "/", "first_seen": n}


class Driver:
    """A fixed random mix of what a session does to a fixed set of names, each op through the
    recorder: writes (create with O_TRUNC, then a write through a handle), appends, renames
    (often over a name), unlinks, chmods, symlinks and hard links.  A new actor every 20
    operations stands for a new process, whose unit ends (sealed) when the next begins."""

    def __init__(self, rec: Recorder, root_fd: int):
        self.rec, self.root_fd, self.rng, self.n = rec, root_fd, random.Random(16), 0
        self.euid, self.egid = os.geteuid(), os.getegid()

    def parent(self, path: str) -> tuple[int, str]:
        d, _, name = path.rpartition("/")
        return (underlay.open_path(self.root_fd, d) if d else os.dup(self.root_fd)), name

    def run(self, ops: int) -> None:
        for _ in range(ops):
            if self.n % 20 == 0:
                if self.n:
                    self.rec.seal(self.rec.units.unit_of(self.actor))  # the unit ended
                self.rec.end_epochs()  # a unit boundary
                self.actor = fake_actor(self.n // 20)
            self.n += 1
            try:
                self.one(self.rng.choice(
                    ["write"] * 6 + ["append"] * 2 + ["rename"] * 3 + ["unlink"] * 3 +
                    ["chmod", "symlink", "link", "link", "unlink_link"]))
            except (FileNotFoundError, FileExistsError):
                pass

    def one(self, kind: str) -> None:
        rec, actor, rng = self.rec, self.actor, self.rng
        path = rng.choice(NAMES)
        pfd, name = self.parent(path)
        try:
            if kind in ("write", "append"):
                flags = os.O_RDWR | (os.O_TRUNC if kind == "write" else 0)
                fd = rec.create(pfd, name, flags, 0o644, self.euid, self.egid, actor)
                try:
                    h = Handle(fd, None, actor, rec.units.unit_of(actor), rec)
                    off = os.fstat(fd).st_size
                    rec.write(h, off, os.urandom(rng.randrange(1, 300)))
                finally:
                    os.close(fd)
            elif kind == "rename":
                qfd, qname = self.parent(rng.choice(NAMES))
                try:
                    rec.rename(pfd, name, qfd, qname, 0, actor)
                finally:
                    os.close(qfd)
            elif kind == "unlink":
                rec.unlink(pfd, name, actor)
            elif kind == "chmod":
                fd = underlay.open_path(pfd, name)
                try:
                    rec.chmod(fd, rng.choice((0o600, 0o644)), actor)
                finally:
                    os.close(fd)
            elif kind == "symlink":
                s = rng.choice(SYMLINKS)
                if os.path.lexists(os.path.join(rec.root_path, s)):
                    return  # (an unlinked symlink goes to the attic: one entry each, on disk)
                rec.symlink(self.root_fd, s, path, self.euid, self.egid, actor)
            elif kind == "link":
                h = rng.choice(LINKS)
                if os.path.lexists(os.path.join(rec.root_path, h)):
                    rec.unlink(self.root_fd, h, actor)
                fd = underlay.open_path(pfd, name)
                try:
                    rec.link(fd, self.root_fd, h, actor)
                finally:
                    os.close(fd)
            elif kind == "unlink_link":
                rec.unlink(self.root_fd, rng.choice(LINKS), actor)
        finally:
            os.close(pfd)

    def sizes(self) -> dict:
        rec = self.rec
        return {"epochs": len(rec.epochs), "unsealed": len(rec.unsealed),
                "names": len(rec.names), "names_listed": sum(map(len, rec.names.values())),
                "pending": len(rec._pending), "unjournaled": len(rec._unjournaled),
                "attic_links": len(rec.attic_links), "known_actors": len(rec.journal._known_actors),
                "events": rec.journal.count()}


@pytest.mark.timeout(int(120 * SLOW))
def test_the_recorders_maps_follow_the_tree_not_the_events(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "_KNOWN_ACTORS", 64, raising=False)
    with plain_recorder(tmp_path) as (rec, root_fd):
        d = Driver(rec, root_fd)
        d.run(1500)
        short = d.sizes()
        d.run(4500)
        long = d.sizes()
        assert long["events"] > 2.5 * short["events"] > 2500  # the workload did run
        live = len(NAMES) + len(LINKS) + len(SYMLINKS)  # every name there can be
        for s in (short, long):
            # per path at most an epoch or a seal owed; per linked inode a non-empty set of the
            # names that hold it; no note left over; no attic entry (small files go to the
            # store, symlinks are never unlinked here); a bounded memory of actors journaled
            assert s["epochs"] <= live and s["unsealed"] <= live, s
            assert s["names"] <= s["names_listed"] <= live, s
            assert s["pending"] == s["unjournaled"] == s["attic_links"] == 0, s
            assert s["known_actors"] <= 64, s
        assert all(rec.names.values()), "an inode with no known name is still an entry"
        # the same at the record's end, sealed: nothing per path is left
        rec.seal()
        assert rec.epochs == {} and rec.unsealed == {}


@pytest.mark.timeout(int(60 * SLOW))
def test_the_journal_remembers_a_bounded_number_of_actors_and_writes_each_once(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setattr(store, "_KNOWN_ACTORS", 32, raising=False)
    j = Journal(str(tmp_path / "state"))
    try:
        first = fake_actor(0)
        j.append({"op": "unlink", "path": "a", "actor": first["key"]}, first)
        for n in range(1, 200):
            a = fake_actor(n)
            j.append({"op": "unlink", "path": "a", "actor": a["key"]}, a)
            assert len(j._known_actors) <= 32
        # forgotten by the memory, still in the table: its record is the first one, unchanged
        again = dict(first, argv=["not", "the", "first"], first_seen=-1)
        j.append({"op": "unlink", "path": "a", "actor": again["key"]}, again)
        assert j.actor(first["key"]) == first
        assert all(j.actor(fake_actor(n)["key"]) == fake_actor(n) for n in range(200))
    finally:
        j.close()


@pytest.mark.timeout(int(60 * SLOW))
def test_attribution_keeps_a_bounded_number_of_processes(monkeypatch):
    monkeypatch.setattr(attribution, "CACHED", 40, raising=False)
    monkeypatch.setattr(attribution, "SWEEP", 16, raising=False)
    a = Attribution()
    seen = []
    for _ in range(150):  # 150 processes, one after the other, each writing once
        p = subprocess.Popen(["sleep", "30"])
        try:
            seen.append((p.pid, a.actor(p.pid)["key"]))
        finally:
            p.kill()
            p.wait()
        assert len(a._by_tid) <= 40 and len(a._live) <= 16
    # a request served after its process exited is still its own, for the recent ones
    for pid, key in seen[-10:]:
        assert a.actor(pid)["key"] == key
    for fd, *_ in a._live.values():
        os.close(fd)


@pytest.mark.timeout(int(60 * SLOW))
def test_a_writer_lets_go_of_the_journal_map(tmp_path):
    """What the daemon reads through LMDB's map is RSS until let go; ``trim_map`` drops it (the
    mapping is read-only and shared: every page reads back the same)."""
    j = Journal(str(tmp_path / "state"))
    try:
        events = [{"op": "write", "path": f"f{i % 50}", "actor": "1:2", "pad": "x" * 300}
                  for i in range(8000)]
        for i in range(0, len(events), 100):
            j.append_many(events[i:i + 100], [])
        before = [e["path"] for e in j.events()]  # every page read through the map
        assert mapped_rss(j) > 2 << 20
        assert j.trim_map() > 0
        assert mapped_rss(j) < 256 << 10
        assert [e["path"] for e in j.events()] == before and j.count() == 8000
    finally:
        j.close()


def mapped_rss(j: Journal) -> int:
    """Bytes of the journal's data.mdb resident in this process's mappings."""
    path = os.path.realpath(os.path.join(j.state_dir, "journal", "data.mdb"))
    total, ours = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:
                ours = len(head) >= 6 and line.split(None, 5)[5].strip() == path
            elif ours and head[0] == "Rss:":
                total += int(head[1]) << 10
    return total


@pytest.mark.timeout(int(120 * SLOW))
def test_a_units_end_seals_its_paths_in_bounded_memory(tmp_path):
    """A unit that changed many paths was sealed in one batch: 5 KB a path held at once (110 MB
    for 20,000 files, which the daemon's heap kept after), and the unit's end of a revert of
    100,000 files took the daemon to 1.2 GB.  Sealed a chunk at a time (SEAL_CHUNK), the peak of
    the seal does not follow the number of paths, and every path is sealed."""
    import tracemalloc
    from overlayrec.recorder import SEAL_CHUNK
    peaks, sealed = [], []
    for n, sub in ((2 * SEAL_CHUNK, "a"), (6 * SEAL_CHUNK, "b")):
        with plain_recorder(tmp_path / sub) as (rec, root_fd):
            actor = fake_actor(n)
            for i in range(n):
                fd = rec.create(root_fd, f"f{i}", os.O_RDWR, 0o644, os.geteuid(),
                                os.getegid(), actor)
                try:
                    rec.write(Handle(fd, None, actor, rec.units.unit_of(actor), rec), 0,
                              b"x" * 300)
                finally:
                    os.close(fd)
            unit = rec.units.unit_of(actor)
            tracemalloc.start()
            try:
                assert rec.seal(unit) == n
                now, peak = tracemalloc.get_traced_memory()
                peaks.append(peak - now)  # held for the seal alone (not the ctimes kept)
            finally:
                tracemalloc.stop()
            assert rec.epochs == {}
            seals = [e["path"] for e in rec.journal.events() if e["op"] == "seal"]
            sealed.append(sorted(seals) == sorted(f"f{i}" for i in range(n)))
    assert sealed == [True, True]
    # three times the paths, not three times the memory
    assert peaks[1] < 1.5 * peaks[0], peaks
