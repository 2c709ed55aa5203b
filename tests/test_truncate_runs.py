"""A truncating open for writing (O_TRUNC: ``open(path, "w")``, a shell's ``>``, an agent's
Write tool) of a file with one name begins its handle's write run, as a create does: the
handle's first writes make no event of their own (docs/design.md, "A truncating open begins
its handle's write run").  What the record answers must not change for it: each point is
exact, or said not to be, and the content a reader gives at a point is what the file held
then (snapshots taken by the writer itself); a revert of the call puts back what it held."""
from __future__ import annotations

import json
import os
import sys
import textwrap

from conftest import needs_fuse, overlayrec
from run_checks import check_extents, check_points
from overlayrec.engines.states import States, Tree

pytestmark = needs_fuse

SEEDED = ("quick", "many", "emptied", "chmodded", "linked", "twice", "ro")

# each step's (name, path, content as hex) as the writer saw it once the step was done
WRITER = textwrap.dedent(r'''
    import json, os, sys
    steps = []
    def step(name, path):
        steps.append([name, path, open(path, "rb").read().hex()])
    with open("quick", "wb") as f:         # one write, before any other event
        f.write(b"at once\n")
    step("quick", "quick")
    with open("many", "wb") as f:          # three writes, events elsewhere between them
        for k in range(3):
            f.write(b"part %d\n" % k)
            f.flush()
            os.mkdir("elsewhere%d" % k)
    step("many", "many")
    open("emptied", "w").close()           # truncated, never written
    step("emptied", "emptied")
    fd = os.open("chmodded", os.O_WRONLY | os.O_TRUNC)
    os.write(fd, b"before\n")
    step("first", "chmodded")
    os.fchmod(fd, 0o600)                   # an event: the next write begins a new run
    os.write(fd, b"after\n")
    os.close(fd)
    step("second", "chmodded")
    os.link("linked", "linked2")           # two names: its writes change both, not a run
    with open("linked", "wb") as f:
        f.write(b"through a link\n")
    step("linked", "linked2")
    with open("twice", "wb") as f:         # the second open is inside the path's epoch
        f.write(b"first\n")
    step("twice1", "twice")
    with open("twice", "wb") as f:
        f.write(b"second\n")
    step("twice2", "twice")
    os.close(os.open("ro", os.O_RDONLY | os.O_TRUNC))   # truncated, not opened for writing
    step("ro", "ro")
    json.dump(steps, sys.stdout)
''')


def _writer(make_mount):
    """A mount with SEEDED files, WRITER run through it, unmounted: (mount, steps)."""
    m = make_mount()
    for name in SEEDED:
        with open(os.path.join(m.ws, name), "wb") as f:
            f.write(b"seed of %s\n" % name.encode())
    m.mount()
    try:
        return m, json.loads(m.py(WRITER).stdout)
    finally:
        m.umount()


def _ops(evs, path):
    return [(e["op"], "run" in e) for e in evs
            if e["path"] == path and e["op"] in ("truncate", "write", "chmod")]


def test_a_truncating_open_and_its_writes_are_one_event(make_mount):
    m, _ = _writer(make_mount)
    evs = m.events()
    assert _ops(evs, "quick") == [("truncate", True)]
    assert _ops(evs, "many") == [("truncate", True)]
    assert _ops(evs, "emptied") == [("truncate", True)]
    assert _ops(evs, "chmodded") == [("truncate", True), ("chmod", False), ("write", False)]
    assert _ops(evs, "twice") == [("truncate", True), ("truncate", True)]
    # not a run: a file with another name (its writes are journaled on both), or one opened
    # read-only
    assert _ops(evs, "linked") == [("truncate", False), ("write", False)]
    assert _ops(evs, "ro") == [("truncate", False)]

    seq = {p: next(e["seq"] for e in evs if e["path"] == p and e["op"] == "truncate")
           for p in ("many", "emptied", "chmodded")}
    j = m.journal()
    try:
        check_extents(j, seq["many"], seq["emptied"], seq["chmodded"])
    finally:
        j.close()


def test_every_point_of_a_truncate_run_reads_as_it_was_or_says_not(make_mount):
    m, steps = _writer(make_mount)
    evs = m.events()
    snap = {name: bytes.fromhex(data) for name, _, data in steps}
    j = m.journal()
    fd = os.open(m.ws, os.O_PATH | os.O_DIRECTORY)
    try:
        states = States(j, Tree(fd))
        at = {p: [e["seq"] for e in evs if e["path"] == p and
                  e["op"] in ("truncate", "write", "chmod")] for p in SEEDED}

        for p in ("quick", "many", "emptied", "chmodded", "twice"):
            # just before the truncate: the seed, exact (the truncate's pre-image)
            s = states.state(p, at[p][0] - 1)
            assert s.exact and s.data == b"seed of %s\n" % p.encode(), p

        check_points(states, at, snap)  # "quick" and "many", as a create's run reads
        assert snap["many"] == b"part 0\npart 1\npart 2\n"

        s = states.state("emptied", at["emptied"][0])
        assert s.exact and s.data == b"" and s.kind == "file"

        trunc, chmod, write = at["chmodded"]
        s = states.state("chmodded", states.settle("chmodded", write))
        assert s.exact and s.data == snap["second"] == b"before\nafter\n"
        assert s.mode & 0o777 == 0o600
        assert not states.state("chmodded", chmod).exact  # inside the epoch: no content kept

        s = states.state("twice", states.settle("twice", at["twice"][1]))
        assert s.exact and s.data == snap["twice2"] == b"second\n"

        s = states.state("linked", states.settle("linked", at["linked"][-1]))
        assert s.exact and s.data == snap["linked"] == b"through a link\n"
        s = states.state("ro", at["ro"][0])
        assert s.exact and s.data == b"" == snap["ro"]
    finally:
        os.close(fd)
        j.close()


CALL = textwrap.dedent(r'''
    import subprocess, sys
    from overlayrec import client
    with client.connect() as c:
        c.call_begin("c1", "Write")
        subprocess.run([sys.executable, "-c", sys.argv[1]], check=True)
        c.call_end("c1")
''')

# an agent's Write tool: the file written whole, in place, twice in one call, and a shell's >
EDIT = ("open('a.txt', 'w').write('written by the tool\\n');"
        "open('b.txt', 'w').write('first\\n'); open('b.txt', 'w').write('second\\n');"
        "import subprocess; subprocess.run(['sh', '-c', 'echo redirected > c.txt'], check=True)")


def _tree(ws):
    out = {}
    for name in sorted(os.listdir(ws)):
        p = os.path.join(ws, name)
        if os.path.isfile(p) and not name.startswith("."):
            out[name] = open(p, "rb").read()
    return out


def test_a_call_that_rewrites_files_in_place_diffs_reverts_and_unreverts(make_mount, tmp_path):
    m = make_mount()
    for name in ("a.txt", "b.txt", "c.txt"):
        with open(os.path.join(m.ws, name), "wb") as f:
            f.write(b"old %s\n" % name.encode())
    (tmp_path / "call.py").write_text(CALL)
    m.mount()
    try:
        before = _tree(m.ws)
        overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable,
                   str(tmp_path / "call.py"), EDIT, cwd=m.ws)
        after = _tree(m.ws)
        assert after == {"a.txt": b"written by the tool\n", "b.txt": b"second\n",
                         "c.txt": b"redirected\n"}
        runs = [e for e in m.events() if e["op"] == "truncate" and "run" in e]
        assert {e["path"] for e in runs} == {"a.txt", "b.txt", "c.txt"}, runs
        assert not [e for e in m.events() if e["op"] == "write"]

        diff = overlayrec("diff", m.ws, "--call", "c1").stdout
        for line in ("-old a.txt", "+written by the tool", "-old b.txt", "+second",
                     "-old c.txt", "+redirected"):
            assert line in diff.splitlines(), (line, diff)
        assert "+first" not in diff.splitlines()

        overlayrec("revert", m.ws, "--call", "c1", "--yes")
        assert _tree(m.ws) == before
        overlayrec("unrevert", m.ws, "--yes")
        assert _tree(m.ws) == after
    finally:
        m.umount()
