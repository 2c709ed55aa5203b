"""A create that makes a file opened for writing begins its handle's write run: the handle's
first writes make no event of their own (docs/design.md, "A create begins its handle's write
run").  What the record answers must not change for it: each point is exact, or said not to
be, and the content a reader gives at a point is what the file held then (snapshots taken by
the writer itself)."""
from __future__ import annotations

import json
import os
import textwrap

import pytest

from conftest import needs_fuse
from run_checks import check_extents, check_points
from overlayrec.engines.states import States, Tree

pytestmark = needs_fuse

# each step's (path, content) as the writer saw it once the step was done, and the time
WRITER = textwrap.dedent(r'''
    import json, os, sys, time
    steps = []
    def step(name, path):
        data = open(path, "rb").read() if os.path.exists(path) else None
        steps.append([name, path, None if data is None else data.hex(), time.time_ns()])
    with open("quick", "wb") as f:         # written before any other event
        f.write(b"at once\n")
    step("quick", "quick")
    with open("many", "wb") as f:          # three writes, one run begun by the create, with
        for k in range(3):                 # events elsewhere between them
            f.write(b"part %d\n" % k)
            f.flush()
            os.mkdir("elsewhere%d" % k)
    step("many", "many")
    open("empty", "w").close()               # made, never written (touch)
    step("empty", "empty")
    fd = os.open("chmodded", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, b"before\n")
    step("first", "chmodded")
    os.fchmod(fd, 0o600)                     # an event: the next write begins a new run
    step("chmod", "chmodded")
    os.write(fd, b"after\n")
    os.close(fd)
    step("second", "chmodded")
    fd = os.open("ro", os.O_RDONLY | os.O_CREAT, 0o644)   # made, but not for writing
    os.close(fd)
    open("existing", "ab").write(b"more\n")  # opened by O_CREAT, but it was there
    step("existing", "existing")
    json.dump(steps, sys.stdout)
''')


def _writer(make_mount):
    """A mount with ``existing`` seeded, WRITER run through it, unmounted: (mount, steps)."""
    m = make_mount()
    with open(os.path.join(m.ws, "existing"), "wb") as f:
        f.write(b"seed\n")
    m.mount()
    try:
        return m, json.loads(m.py(WRITER).stdout)
    finally:
        m.umount()


def test_a_created_file_and_its_writes_are_one_event(make_mount):
    m, steps = _writer(make_mount)
    evs = m.events()
    ops = {p: [(e["op"], "run" in e) for e in evs if e["path"] == p]
           for p in ("quick", "many", "empty", "chmodded", "ro", "existing")}
    assert ops["quick"] == [("create", True)], ops
    assert ops["many"] == [("create", True)], ops
    assert ops["empty"] == [("create", True)], ops
    assert ops["chmodded"] == [("create", True), ("chmod", False), ("write", False)], ops
    # not a run: opened read-only, or by O_CREAT on a file that was there (its first write
    # takes the pre-image: an event)
    assert ops["ro"] == [("create", False)], ops
    assert ops["existing"] == [("write", False)], ops

    j = m.journal()
    try:
        seq = {p: next(e["seq"] for e in evs if e["path"] == p) for p in ops}
        check_extents(j, seq["many"], seq["empty"], seq["chmodded"])
    finally:
        j.close()


def test_every_point_of_a_create_run_reads_as_it_was_or_says_not(make_mount):
    m, steps = _writer(make_mount)
    evs = m.events()
    j = m.journal()
    fd = os.open(m.ws, os.O_PATH | os.O_DIRECTORY)
    try:
        states = States(j, Tree(fd))
        at = {p: [e["seq"] for e in evs if e["path"] == p]
              for p in ("quick", "many", "empty", "chmodded")}
        snap = {name: bytes.fromhex(data) for name, _, data, _ in steps}

        # "quick": its write came before any other event, so the create's point is the file
        # it made with what its handle wrote then, exact; "many": writes followed unseen after
        # other events, not exact until the run ended
        check_points(states, at, snap)

        # never written: exact at once, and empty
        s = states.state("empty", at["empty"][0])
        assert s.exact and s.data == b"" and s.kind == "file"

        # written once, then a chmod, then a new run: inside the path's epoch no point is
        # exact (the record keeps no content between an epoch's start and its end); the
        # second run's end is what the writer saw last
        create, chmod, write = at["chmodded"]
        assert not states.state("chmodded", create).exact
        assert not states.state("chmodded", chmod).exact
        s = states.state("chmodded", states.settle("chmodded", write))
        assert s.exact and s.data == snap["second"] and s.mode & 0o777 == 0o600
    finally:
        os.close(fd)
        j.close()


def test_a_runs_extents_count_only_what_the_underlay_made(tmp_path, monkeypatch):
    """A write joining its handle's run is counted in the run's extents note once the
    underlay has made it: one refused (ENOSPC) is not in the note, one made short only as far
    as it went.  Neither moves where the note says the run ended past what the file holds."""
    import errno
    from overlayrec.attribution import Attribution
    from overlayrec.fs import Handle
    from overlayrec.journal import Journal
    from overlayrec.recorder import Recorder
    ws, sd = tmp_path / "ws", str(tmp_path / "state")
    ws.mkdir()
    j = Journal(sd)
    j.hold_notes = True  # as the daemon serves
    root = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    real_pwrite = os.pwrite

    def refusing(fd, data, off):
        if data.startswith(b"refused"):
            raise OSError(errno.ENOSPC, "No space left on device")
        if data.startswith(b"short"):
            return real_pwrite(fd, data[:3], off)
        return real_pwrite(fd, data, off)
    try:
        rec = Recorder(j, root, Attribution())
        actor = rec.attribution.actor(os.getpid())
        fd = rec.create(root, "f", os.O_RDWR, 0o644, os.geteuid(), os.getegid(), actor)
        h = Handle(fd, None, actor, rec.units.unit_of(actor), rec)
        rec.begin_run(h)
        made = j.last_reserved()
        monkeypatch.setattr(os, "pwrite", refusing)
        assert rec.write(h, 0, b"0123456789") == 10
        with pytest.raises(OSError):
            rec.write(h, 10, b"refused, and long enough to reach far")
        assert rec.write(h, 10, b"short write") == 3
        monkeypatch.setattr(os, "pwrite", real_pwrite)
        rec.note_extents(h)
        os.close(fd)
        j.flush()
        note = j.extents(made)
        assert (note["writes"], note["bytes"], note["lo"], note["hi"]) == (2, 13, 0, 13), note
        assert os.path.getsize(ws / "f") == note["hi"]
        assert [e["op"] for e in j.events() if e["path"] == "f"] == ["create"]
    finally:
        monkeypatch.undo()
        os.close(root)
        j.close()
