"""What moved with each directory rename, on journals written directly (no mount): many
directories renamed, nested, exchanged and renamed over empty ones, files made in them before
the record began (seen only in the live tree) and during it.

``States.descendants(src, seq - 1)`` (what ``moved_with``, ``touched``, diffs and reverts
ask) must name exactly the paths a model of the tree held beneath the directory just before
the rename; and the one sweep that answers it for every rename (``States._moved_sets``) must
name what mapping every name to that point does (``States.candidates``, the reference)."""
from __future__ import annotations

import os
import random

import pytest

from overlayrec.engines.states import States, Tree
from overlayrec.journal import Journal

DIR = {"kind": "dir", "mode": 0o755}
ABSENT = {"kind": "absent"}


def _beneath(tree: set[str], d: str) -> set[str]:
    return {p for p in tree if p.startswith(d + "/")}


def run(seed: int, tmp_path) -> None:
    rnd = random.Random(seed)
    ws, sd = tmp_path / "ws", str(tmp_path / "state")
    ws.mkdir()
    dirs = {"top"}          # the model: every directory and file by path
    files: set[str] = set()
    n = 0
    for i in range(4):  # there before the record: only the live tree knows them
        d = f"top/pre{i}"
        dirs.add(d)
        for k in range(2):
            files.add(f"{d}/old{k}")
    j = Journal(sd, workspace=str(ws))
    actor, unit = {"key": "1:1", "pid": 1}, "outside:1:1"
    expect: list[tuple[str, int, set[str]]] = []

    def append(ev):
        return j.append(dict(ev, unit=unit), actor)
    for _ in range(rnd.randrange(20, 80)):
        n += 1
        op = rnd.random()
        if op < 0.2:
            d = f"{rnd.choice(sorted(dirs))}/d{n}"
            dirs.add(d)
            append({"op": "mkdir", "path": d, "pre": ABSENT, "epoch": True})
        elif op < 0.45:
            f = f"{rnd.choice(sorted(dirs))}/f{n}"
            files.add(f)
            append({"op": "create", "path": f, "pre": ABSENT, "epoch": True})
        else:
            movable = sorted(dirs - {"top"})
            if not movable:
                continue
            src = rnd.choice(movable)
            # a target outside src's own subtree: a new name, an empty directory, or (an
            # exchange) another directory that neither holds nor is held by src
            others = [d for d in sorted(dirs) if d != src and not d.startswith(src + "/")
                      and not src.startswith(d + "/")]
            kind = rnd.random()
            if kind < 0.3 and [d for d in others if d != "top"]:
                dst = rnd.choice([d for d in others if d != "top"])
                before = _beneath(dirs | files, src) | _beneath(dirs | files, dst)
                seq = append({"op": "rename", "path": src, "path2": dst, "pre": DIR,
                              "pre2": DIR, "flags": 2})
                expect.append((src, seq, _beneath(dirs | files, src)))
                expect.append((dst, seq, _beneath(dirs | files, dst)))
                swap = {}
                for p in before:
                    if p.startswith(src + "/"):
                        swap[p] = dst + p[len(src):]
                    else:
                        swap[p] = src + p[len(dst):]
                dirs = {swap.get(p, p) for p in dirs}
                files = {swap.get(p, p) for p in files}
                continue
            empty = [d for d in others if d != "top" and not _beneath(dirs | files, d)]
            if kind < 0.5 and empty:
                dst = rnd.choice(empty)
                pre2 = DIR
            else:
                dst = f"{rnd.choice(others or ['top'])}/r{n}"
                pre2 = ABSENT
            seq = append({"op": "rename", "path": src, "path2": dst, "pre": DIR, "pre2": pre2})
            expect.append((src, seq, _beneath(dirs | files, src)))
            dirs.discard(dst)
            move = {p: dst + p[len(src):] for p in _beneath(dirs | files, src) | {src}}
            dirs = {move.get(p, p) for p in dirs}
            files = {move.get(p, p) for p in files}
    j.close()
    for d in sorted(dirs, key=len):  # the live tree: the model's end
        (ws / d).mkdir(parents=True, exist_ok=True)
    for f in files:
        (ws / f).write_text(f)
    r = Journal(sd, readonly=True)
    try:
        states = States(r, Tree.at(str(ws)))
        moved = states._moved_sets()
        for d, seq, want in expect:
            at = seq - 1
            assert set(states.descendants(d, at)) == want, (seed, d, seq)
            ref = {c for c in states.candidates(at) if c.startswith(d + "/")}
            assert moved.get((d, at), set()) == ref, (seed, d, seq)
        assert expect, seed
    finally:
        r.close()
        os.close(states.tree.root_fd)


@pytest.mark.parametrize("seed", range(int(os.environ.get("OVERLAYREC_PATH_CASES", "40"))))
def test_what_moved_with_each_directory_rename(seed, tmp_path):
    run(seed, tmp_path)


def test_rename_index_finds_what_a_scan_finds():
    """``RenameIndex.touching`` against reading every rename: the first and the last rename
    of a range whose source or target is an ancestor of a name (or, ``itself``, the name)."""
    from overlayrec.journal.renames import RenameIndex
    rnd = random.Random(7)
    names = ["a", "a/b", "a/b/c", "a/bc", "ab", "b", "b/a", "a/b/c/d", "c", "c/a/b"]
    for _ in range(200):
        rs = [{"seq": 10 * i + rnd.randrange(9) + 1, "src": rnd.choice(names),
               "dst": rnd.choice(names)} for i in range(rnd.randrange(0, 12))]
        idx = RenameIndex(rs)
        for name in names + ["a/b/c/d/e", "zz/y"]:
            for itself in (False, True):
                def hits(r):
                    return any(name.startswith(d + "/") or (itself and name == d)
                               for d in (r["src"], r["dst"]))
                for lo in range(len(rs) + 1):
                    for hi in range(lo, len(rs) + 1):
                        found = [i for i in range(lo, hi) if hits(rs[i])]
                        assert idx.touching(name, lo, hi, itself=itself) == \
                            (found[0] if found else None)
                        assert idx.touching(name, lo, hi, last=True, itself=itself) == \
                            (found[-1] if found else None)


def test_a_directory_renamed_back_and_forth_thousands_of_times(tmp_path):
    """A directory renamed back and forth: a file made in it before the renames is the live
    file at every point since, and one made half-way is absent before and there after.  Each
    state was asked inside the next rename's (one level a rename: a RecursionError past some
    2,000 round trips, with the CLI's own frame limit), and every point walked the file's
    whole history back (quadratic; found by a bug hunt)."""
    from overlayrec.entry import deep_enough
    deep_enough()  # the frame limit the CLI runs the readers with
    ws, sd = tmp_path / "ws", str(tmp_path / "state")
    ws.mkdir()
    j = Journal(sd, workspace=str(ws))
    actor, unit = {"key": "1:1", "pid": 1}, "outside:1:1"

    def append(ev):
        return j.append(dict(ev, unit=unit), actor)
    append({"op": "mkdir", "path": "a", "pre": ABSENT, "epoch": True})
    made = append({"op": "create", "path": "a/k", "pre": ABSENT, "epoch": True})
    trips, half = 2_500, 1_250
    points = []   # (point, the directory's name then)
    for i in range(trips):
        points.append((append({"op": "rename", "path": "a", "path2": "b", "pre": DIR,
                               "pre2": ABSENT}), "b"))
        if i == half:
            g = append({"op": "create", "path": "b/g", "pre": ABSENT, "epoch": True})
        points.append((append({"op": "rename", "path": "b", "path2": "a", "pre": DIR,
                               "pre2": ABSENT}), "a"))
    j.close()
    (ws / "a").mkdir()
    (ws / "a" / "k").write_text("k")
    (ws / "a" / "g").write_text("g")
    r = Journal(sd, readonly=True)
    states = States(r, Tree.at(str(ws)))
    try:
        k = states.state("a/k", made)
        assert (k.kind, k.data) == ("file", b"k")
        assert len(states.history("a/k", made)) == 1
        assert len(states.history("a/k")) == 2 * trips + 1
        for at, d in points[::97] + points[-3:]:
            assert states.state(f"{d}/k", at).data == b"k", at
            assert states.state(f"{d}/g", at).present == (at > g), at
            other = "a" if d == "b" else "b"
            assert not states.state(f"{other}/k", at).present, at
        assert states.state("a/g", g - 1).present is False
    finally:
        r.close()
        os.close(states.tree.root_fd)
