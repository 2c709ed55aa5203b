"""Files held open across renames, unlinks and directory moves: every state the readers call
exact is the state the tree had.

The history model test closes every handle before the next operation; agents' tools do not (an
editor keeps its file open while a formatter renames it away, a logger appends to a file a test
has moved, a build keeps writing an output whose directory was renamed).  Here two processes
(two units: each change of writer ends every epoch) hold up to three raw file descriptors each, opened with O_TRUNC, O_APPEND or O_RDWR, and
writes, pwrites and ftruncates through them between renames of files and directories, unlinks,
new files made in the old names, hard links, symlinks (to files, to directories, dangling),
exchanges (renameat2), truncates by name, chmods, mkdirs and rmdirs, in generated sequences
(seeded: a failure names its case).  After every operation it snapshots its directory
(contents, modes, link targets) through the mount.  Unmounted, ``States.state(path, N)`` is
compared path by path with the tree as it stood just before event
N+1 (what a state "after N" means: a write that joins an open write run is no event, so it lands
between two events), which is the last snapshot taken before event N+1 was committed: wherever
the record says a state is exact, it must be that snapshot's.  (States inside a run that goes on
past the next event are inexact: they are left out, and the test checks that enough states were
exact to mean something.)  ``replay`` is checked the same way at a dozen of those points: every
path it writes and does not call inexact is the snapshot's.

Knobs (environment): OVERLAYREC_HANDLE_CASES (default 40), OVERLAYREC_HANDLE_OPS (default 30),
OVERLAYREC_HANDLE_SEED (the first case's seed, default 0).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

from conftest import SLOW, needs_fuse, overlayrec
from overlayrec.engines.replay import replay
from overlayrec.engines.states import States, Tree
from overlayrec.journal import Journal

pytestmark = needs_fuse

CASES = int(os.environ.get("OVERLAYREC_HANDLE_CASES", "40"))
OPS = int(os.environ.get("OVERLAYREC_HANDLE_OPS", "30"))
SEED = int(os.environ.get("OVERLAYREC_HANDLE_SEED", "0"))
FILES = ("a", "b", "c", "d/x", "d/y", "e/x")
DIRS = ("d", "e")

DRIVER = textwrap.dedent(r'''
    import ctypes, json, os, subprocess, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    FLAGS = {"trunc": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
             "append": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
             "rdwr": os.O_RDWR | os.O_CREAT}

    def exchange(a, b):
        # renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)
        if libc.renameat2(-100, a.encode(), -100, b.encode(), 2) != 0:
            raise OSError(ctypes.get_errno(), "renameat2")

    def do(op, fds):
        kind, args = op[0], op[1:]
        try:
            if kind == "open":
                h, path, how = args
                if h in fds:
                    os.close(fds.pop(h))
                fds[h] = os.open(path, FLAGS[how], 0o644)
            elif kind == "write" and args[0] in fds:
                os.write(fds[args[0]], args[1].encode())
            elif kind == "pwrite" and args[0] in fds:
                os.pwrite(fds[args[0]], args[1].encode(), args[2])
            elif kind == "ftruncate" and args[0] in fds:
                os.ftruncate(fds[args[0]], args[1])
            elif kind == "close" and args[0] in fds:
                os.close(fds.pop(args[0]))
            elif kind == "rename":
                os.rename(*args)
            elif kind == "unlink":
                os.unlink(args[0])
            elif kind == "mkdir":
                os.mkdir(args[0])
            elif kind == "link":
                os.link(*args)
            elif kind == "chmod":
                # the drawn one, then a chmod and a chown that change nothing (the daemon holds
                # their events for its next commit): a write run ends at each all the same
                os.chmod(*args)
                st = os.stat(args[0])
                os.chmod(args[0], st.st_mode & 0o7777)
                os.chown(args[0], st.st_uid, st.st_gid)
            elif kind == "symlink":
                os.symlink(*args)
            elif kind == "rmdir":
                os.rmdir(args[0])
            elif kind == "exchange":
                exchange(*args)
            elif kind == "truncate":
                os.truncate(*args)
            elif kind == "make":
                with open(args[0], "w") as f:
                    f.write(args[1])
        except OSError:
            pass

    def close_all(fds):
        for fd in fds.values():
            os.close(fd)
        fds.clear()

    if sys.argv[1] == "worker":  # the second writer: another process, another unit
        fds = {}
        for line in sys.stdin:
            msg = json.loads(line)
            if "cd" in msg:
                close_all(fds)
                os.chdir(msg["cd"])
            else:
                do(msg["op"], fds)
            sys.stdout.write("ok\n")
            sys.stdout.flush()
        close_all(fds)
        sys.exit(0)

    plan, out = json.load(open(sys.argv[1])), sys.argv[2]
    calls = None  # a control connection when the plan has calls (run under `overlayrec run`)
    if any(op[0] == "call" for case in plan for op in case["ops"]):
        from overlayrec import client
        calls = client.connect()
    current = None
    worker = subprocess.Popen([sys.executable, __file__, "worker"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)

    def tell(msg):
        worker.stdin.write(json.dumps(msg) + "\n")
        worker.stdin.flush()
        assert worker.stdout.readline() == "ok\n"

    def snap():
        tree = {}
        for d, dirs, files in os.walk("."):
            for n in dirs + files:
                p = os.path.join(d, n)
                if os.path.islink(p):
                    tree[os.path.relpath(p, ".")] = {"link": os.readlink(p)}
                elif n in dirs:
                    tree[os.path.relpath(p, ".")] = None
            for n in files:
                p = os.path.join(d, n)
                if os.path.islink(p):
                    continue
                with open(p, "rb") as f:
                    tree[os.path.relpath(p, ".")] = [f.read().decode("latin-1"),
                                                     os.stat(p).st_mode & 0o7777]
        return tree

    marks = []
    for case in plan:
        os.mkdir(case["dir"])
        os.chdir(case["dir"])
        tell({"cd": os.getcwd()})
        fds = {}
        for op in case["ops"]:
            if op[0] == "call":  # the current call ends (its epochs are sealed), the next begins
                if current is not None:
                    calls.call_end(current)
                current = op[1]
                calls.call_begin(current, "Bash", summary=current)
            elif op[0] == "@1":
                tell({"op": op[1:]})
            else:
                do(op, fds)
            marks.append({"case": case["dir"], "t": time.time_ns(), "op": op, "tree": snap()})
        close_all(fds)
        tell({"cd": os.getcwd()})  # the worker closes its descriptors too
        if current is not None:
            calls.call_end(current)
            current = None
        os.chdir("..")
    worker.stdin.close()
    worker.wait()
    # closing the last handles is a change of nothing: the snapshots stand
    json.dump(marks, open(out, "w"))
''')


def _op(rnd: random.Random, kind: str, h: int, token, swap=FILES + DIRS) -> list:
    """One operation of ``kind`` (through handle ``h``; ``token()`` names written data;
    an exchange is of two of ``swap``)."""
    if kind == "open":
        return ["open", h, rnd.choice(FILES), rnd.choice(("trunc", "append", "rdwr"))]
    if kind in ("write", "pwrite"):
        return [kind, h, token()] + ([rnd.choice((0, 3))] if kind == "pwrite" else [])
    if kind == "ftruncate":
        return ["ftruncate", h, rnd.choice((0, 2))]
    if kind == "close":
        return ["close", h]
    if kind in ("rename", "link"):
        return [kind, *rnd.sample(FILES, 2)]
    if kind == "renamedir":
        return ["rename", *rnd.sample(DIRS, 2)]
    if kind in ("unlink", "mkdir", "rmdir"):
        return [kind, rnd.choice(DIRS if kind != "unlink" else FILES)]
    if kind == "chmod":
        return ["chmod", rnd.choice(FILES), rnd.choice((0o600, 0o644, 0o755))]
    if kind == "symlink":  # to a file, to a directory, up and out of a directory, nowhere
        return ["symlink", rnd.choice(("a", "d", "../b", "gone")), rnd.choice(FILES)]
    if kind == "exchange":
        return ["exchange", *rnd.sample(swap, 2)]
    if kind == "truncate":
        return ["truncate", rnd.choice(FILES), rnd.choice((0, 1))]
    return ["make", rnd.choice(FILES), token()]


def generate(seed: int, two: bool = True, calls: bool = False) -> list[list]:
    """A sequence of operations over a few names, mostly ones that can succeed; with ``two``,
    about a third of them made by a second process (its own descriptors, its own unit); with
    ``calls``, the driver's ops fall into tool calls (one ends and the next begins every few
    operations, while descriptors stay open across them)."""
    rnd = random.Random(seed)
    ops: list[list] = [["mkdir", "d"]]
    n = 0

    def token() -> str:
        nonlocal n
        n += 1
        return f"<{seed}.{n}>"
    for _ in range(OPS):
        h = rnd.randrange(3)
        start = len(ops)
        kind = rnd.choices(("open", "write", "pwrite", "ftruncate", "close", "rename",
                            "renamedir", "unlink", "mkdir", "make", "link", "chmod", "symlink",
                            "rmdir", "exchange", "truncate"),
                           (4, 6, 2, 1, 2, 4, 2, 2, 1, 2, 1, 1, 1, 1, 1, 1))[0]
        ops.append(_op(rnd, kind, h, token))
        if two and rnd.random() < 0.35:  # made by the second writer
            ops[start:] = [["@1", *op] for op in ops[start:]]
        if calls and rnd.random() < 0.25:
            ops.append(["call", f"k{seed}.{len(ops)}"])
    if calls:
        ops.insert(1, ["call", f"k{seed}.0"])
        # a last call of the driver's own, writing only through descriptors it opened: its
        # revert has the snapshot taken as it began to agree with (revert_last_calls)
        ops.append(["call", f"k{seed}.last"])
        mine: list[int] = []
        for _ in range(rnd.randrange(3, 8)):
            kind = rnd.choice(("open", "write", "write", "pwrite", "ftruncate", "close",
                               "rename", "unlink", "make", "chmod", "truncate", "link",
                               "exchange", "renamedir"))
            h = rnd.randrange(3)
            if kind in ("write", "pwrite", "ftruncate", "close") and h not in mine:
                kind = "open"
            if kind == "open":
                mine.append(h)
            ops.append(_op(rnd, kind, h, token, swap=FILES))
    return ops


def tree_at(root) -> dict:
    """A directory as the driver snapshots one (see ``snap`` in DRIVER)."""
    tree = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                tree[rel] = {"link": os.readlink(p)}
            elif n in dirs:
                tree[rel] = None
            else:
                with open(p, "rb") as f:
                    tree[rel] = [f.read().decode("latin-1"), os.stat(p).st_mode & 0o7777]
    return tree


def revert_last_calls(m, plan: list[dict], marks: list[dict]) -> int:
    """Revert each case's last call, where it is the driver's alone (no operation of the
    worker in it, no write through a descriptor opened before it): the case's tree must then
    be the snapshot taken as the call began, or, when the revert refuses (a conflict), stay
    the snapshot at its end; ``unrevert`` brings back the end.  The reverts made."""
    made = 0
    for case in plan:
        ops, dir_ = case["ops"], case["dir"]
        snaps = [mk["tree"] for mk in marks if mk["case"] == dir_]
        assert len(snaps) == len(ops)
        at = max((i for i, op in enumerate(ops) if op[0] == "call"), default=None)
        if at is None or at == len(ops) - 1:
            continue
        opened, own = set(), True
        for op in ops[at + 1:]:
            if op[0] == "@1" or (op[0] in ("write", "pwrite", "ftruncate")
                                 and op[1] not in opened):
                own = False
            elif op[0] == "open":
                opened.add(op[1])
        if not own:
            continue
        begin, end = snaps[at], snaps[-1]
        if begin == end:
            continue  # the call changed nothing (or put everything back)
        where = os.path.join(m.ws, dir_)
        assert tree_at(where) == end
        r = overlayrec("revert", m.ws, "--session", "h", "--call", ops[at][1], "--yes",
                       check=False)
        if r.returncode == 0:
            assert tree_at(where) == begin, (dir_, ops[at][1], r.stdout, r.stderr)
            u = overlayrec("unrevert", "-w", m.ws, "--yes", check=False)
            assert u.returncode == 0, (dir_, u.stdout, u.stderr)
            made += 1
        else:
            assert r.returncode == 1 and "conflict" in (r.stdout + r.stderr).lower() or \
                "changed" in r.stderr or "unrecorded" in r.stderr, (dir_, r.stdout, r.stderr)
        assert tree_at(where) == end, (dir_, ops[at][1])
    return made


def run_and_check(make_mount, tmp_path, plan: list[dict], *, min_exact: int, extra=(),
                  env=None, reverts=False):
    """Run ``plan`` (cases of operations) through the driver on a fresh mount (``extra``: its
    options; ``env``: the daemon's environment; a plan with calls runs as an agent under
    ``overlayrec run``), then compare every exact state with the tree as it stood (see the
    module's docstring)."""
    m = make_mount(extra_args=extra, env=env).mount()
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    out = tmp_path / "marks.json"
    argv = [sys.executable, str(driver), str(tmp_path / "plan.json"), str(out)]
    if any(op[0] == "call" for case in plan for op in case["ops"]):
        argv = [sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--session", "h", "--",
                *argv]
    r = subprocess.run(argv, cwd=m.ws, capture_output=True, text=True, timeout=300 * SLOW)
    assert r.returncode == 0, r.stderr
    marks = json.loads(out.read_text())
    if reverts:
        m.reverted = revert_last_calls(m, plan, marks)
    m.umount()

    j = Journal(m.state, readonly=True)
    try:
        states = States(j, Tree.at(m.ws))
        times = [(e["t"], e["seq"]) for e in j.events()]
        # each point's tree: the last snapshot before the next event (writes that joined a run
        # came between)
        last: dict[int, dict] = {}
        for i, mark in enumerate(marks):
            mark["i"] = i
            last[max((seq for t, seq in times if t <= mark["t"]), default=0)] = mark
        exact = inexact = 0
        for point, mark in sorted(last.items()):
            i, case = mark["i"], mark["case"]
            names = {f"{case}/{p}" for p in FILES + DIRS}
            for path in sorted(names | {f"{case}/{p}" for p in mark["tree"]}):
                st = states.state(path, point)
                if not st.exact:
                    inexact += 1
                    continue
                exact += 1
                rel = path[len(case) + 1:]
                if rel not in mark["tree"]:
                    got = st.kind
                    assert got == "absent", (i, mark["op"], path, point, got)
                elif mark["tree"][rel] is None:
                    assert st.kind == "dir", (i, mark["op"], path, point, st.kind)
                elif isinstance(mark["tree"][rel], dict):
                    want = ("symlink", mark["tree"][rel]["link"].encode())
                    assert (st.kind, st.data) == want, (i, mark["op"], path, point, st, want)
                else:
                    data, mode = mark["tree"][rel]
                    want = ("file", data.encode("latin-1"), mode)
                    assert (st.kind, st.data, st.mode & 0o7777) == want, \
                        (i, mark["op"], path, point, st, want)
        # what moved with each directory rename: the one sweep (States._moved_sets) names
        # what mapping every name to the rename's point does (States.candidates)
        moved = states._moved_sets()
        for r in states.renames():
            for d in ([r["src"], r["dst"]] if r.get("flags", 0) & 2 else [r["src"]]):
                at = r["seq"] - 1
                want = {c for c in states.candidates(at) if c.startswith(d + "/")}
                assert moved.get((d, at), set()) == want, (r, d)
        # the replay reader too, at a dozen points: what it writes, where it calls it exact
        compared = 0
        for point in sorted(random.Random(len(marks)).sample(sorted(last), min(12, len(last)))):
            mark = last[point]
            dest = tmp_path / f"replay-{point}"
            out = replay(j, states, point, str(dest))
            skip = set(out["inexact"])
            got = tree_at(dest / mark["case"]) if (dest / mark["case"]).is_dir() else {}
            for rel in sorted(set(got) | set(mark["tree"])):
                if f"{mark['case']}/{rel}" in skip:
                    continue
                assert got.get(rel) == mark["tree"].get(rel), \
                    (mark["i"], mark["op"], rel, point, got.get(rel), mark["tree"].get(rel))
                compared += 1
        assert compared >= min(12, len(last)), compared
    finally:
        j.close()
    # most states are exact: a run of joined writes is the only inexact stretch
    assert exact >= min_exact and exact > 2 * inexact, (exact, inexact)
    return m


def test_every_exact_state_is_the_tree_as_it_stood(make_mount, tmp_path):
    plan = [{"dir": f"c{seed}", "ops": generate(seed)} for seed in range(SEED, SEED + CASES)]
    run_and_check(make_mount, tmp_path, plan, min_exact=5 * CASES * len(FILES))


def test_every_state_across_calls(make_mount, tmp_path):
    """The driver as an agent whose operations fall into tool calls: each call's end seals its
    epochs while descriptors stay open, and the writes through them after it (the driver's
    belong to the call they were opened in, the worker's to the session) start epochs anew.
    Each case's last call, where it is the driver's own, is reverted and unreverted against
    the snapshots (``revert_last_calls``)."""
    n = max(4, CASES // 2)
    plan = [{"dir": f"c{seed}", "ops": generate(seed, calls=True)}
            for seed in range(SEED + 3000, SEED + 3000 + n)]
    m = run_and_check(make_mount, tmp_path, plan, min_exact=5 * n * len(FILES), reverts=True)
    assert m.reverted >= n // 4, m.reverted
    seals = [e for e in m.events(seals=True) if e["op"] == "seal"]
    assert len(seals) > n, len(seals)
    calls = {e.get("unit") for e in m.events() if str(e.get("unit")).startswith("call:h:k")}
    assert len(calls) >= 2 * n, calls  # the driver's changes are the calls


def test_a_descriptor_opened_in_a_call_that_ended(make_mount, tmp_path):
    """The agent opens a file in one call and writes it twice in the next: the writes belong
    to the first call (the call it was opened in), which has ended and whose end sealed
    nothing of this run, so the state between the two writes is not exact (it read the
    second write's content as the first's)."""
    ops = [["mkdir", "d"], ["call", "k1"], ["open", 0, "a", "trunc"], ["call", "k2"],
           ["write", 0, "<1>"], ["mkdir", "e"], ["write", 0, "<2>"], ["close", 0],
           ["mkdir", "z"]]
    m = run_and_check(make_mount, tmp_path, [{"dir": "c", "ops": ops}], min_exact=12)
    writes = [e for e in m.events() if e["op"] == "write" and e["path"] == "c/a"]
    assert [w["unit"] for w in writes] == ["call:h:k1"], writes


def test_every_state_with_record_data(make_mount, tmp_path):
    """With --record-data every write is an event with its data: states are replayed forward
    (exchanges, renames and links included), and nearly all are exact."""
    n = max(4, CASES // 4)
    plan = [{"dir": f"c{seed}", "ops": generate(seed)}
            for seed in range(SEED + 1000, SEED + 1000 + n)]
    run_and_check(make_mount, tmp_path, plan, min_exact=8 * n * len(FILES),
                  extra=["--record-data"])


def test_every_state_with_range_pre_images(make_mount, tmp_path):
    """Files past the whole-file limit keep only the ranges a change loses (here the limit is
    8 bytes, so nearly every file does): writes, truncates and renames under held descriptors
    against range pre-images."""
    n = max(4, CASES // 2)
    plan = [{"dir": f"c{seed}", "ops": generate(seed)}
            for seed in range(SEED + 2000, SEED + 2000 + n)]
    run_and_check(make_mount, tmp_path, plan, min_exact=4 * n * len(FILES),
                  env=dict(os.environ, OVERLAYREC_TEST_WHOLE_FILE_LIMIT="8"))


def test_every_state_as_of_large_files(make_mount, tmp_path):
    """Every file kept as one of 4 MiB and more is: content range by range (the whole-file
    limit at 8 bytes) and every unlinked or renamed-over inode in the attic (SMALL_PREIMAGE
    below 0), where descriptors still open on it go on writing."""
    n = max(4, CASES // 2)
    plan = [{"dir": f"c{seed}", "ops": generate(seed)}
            for seed in range(SEED + 3000, SEED + 3000 + n)]
    run_and_check(make_mount, tmp_path, plan, min_exact=4 * n * len(FILES),
                  env=dict(os.environ, OVERLAYREC_TEST_WHOLE_FILE_LIMIT="8",
                           OVERLAYREC_TEST_SMALL_PREIMAGE="-1"))


def test_two_handles_on_one_file(make_mount, tmp_path):
    """A process writing one file through two descriptors: a write through the first after
    the second's events starts a run of its own (an event), so the state after the second's
    write is what it wrote, not what the first wrote later unseen."""
    ops = [["mkdir", "d"], ["open", 0, "b", "trunc"], ["pwrite", 0, "<1>", 0],
           ["pwrite", 0, "<2>", 3], ["make", "b", "<3>"], ["mkdir", "e"],
           ["write", 0, "<4>"], ["close", 0], ["rename", "b", "c"]]
    m = run_and_check(make_mount, tmp_path, [{"dir": "c", "ops": ops}], min_exact=20)
    runs = [e for e in m.events() if e["path"] == "c/b" and
            (e["op"] == "write" or "run" in e)]
    # <1> (its run begun by the open that made b), the make's <3> (its run begun by the
    # make's truncating open), and <4> after it
    assert [e["op"] for e in runs] == ["create", "truncate", "write"], runs


def test_a_directory_renamed_over_an_emptied_one(make_mount, tmp_path):
    """e/x written and renamed away (e left empty), then d renamed over e: the e/x that d/x
    becomes is another object, its first change takes its own pre-image, and its state just
    after the rename is d/x's, not the old e/x's."""
    ops = [["mkdir", "d"], ["mkdir", "e"], ["make", "e/x", "<1>"], ["rename", "e/x", "a"],
           ["open", 2, "d/x", "append"], ["write", 2, "<2>"], ["close", 2], ["mkdir", "z"],
           ["rename", "d", "e"], ["mkdir", "z"], ["open", 2, "e/x", "append"],
           ["write", 2, "<3>"], ["close", 2], ["rename", "e/x", "b"]]
    m = run_and_check(make_mount, tmp_path, [{"dir": "c", "ops": ops}], min_exact=30)
    evs = m.events()
    moved = next(e["seq"] for e in evs if e["op"] == "rename" and e["path"] == "c/d")
    first = next(e for e in evs if e["path"] == "c/e/x" and e["seq"] > moved)
    assert first["op"] == "write" and first.get("pre", {}).get("kind") == "file", first


def test_a_replay_forward_never_starts_before_the_object_came(tmp_path):
    """A journal of an older overlayrec, which kept the replaced directory's epochs: the first
    write to e/x after ``mv d e`` has no pre-image.  Replaying e/x forward must not start from
    the old e/x's events (another object, renamed away before): the state after the rename is
    then inexact, never the old object's "absent"."""
    ws, sd = tmp_path / "ws", str(tmp_path / "state")
    (ws / "e").mkdir(parents=True)
    (ws / "a").write_text("<1>")
    (ws / "e" / "x").write_text("<2>")
    j = Journal(sd)
    actor = {"key": "1:1", "pid": 1}
    unit = "outside:1:1"
    f = {"kind": "file", "mode": 0o644, "size": 3}
    d = {"kind": "dir", "mode": 0o755}
    for ev in ({"op": "mkdir", "path": "d", "pre": {"kind": "absent"}, "epoch": True},
               {"op": "mkdir", "path": "e", "pre": {"kind": "absent"}, "epoch": True},
               {"op": "create", "path": "e/x", "pre": {"kind": "absent"}, "epoch": True},
               {"op": "write", "path": "e/x", "offset": 0, "length": 3},
               {"op": "rename", "path": "e/x", "path2": "a", "pre": f,
                "pre2": {"kind": "absent"}, "epoch2": True},
               {"op": "create", "path": "d/x", "pre": {"kind": "absent"}, "epoch": True},
               {"op": "rename", "path": "d", "path2": "e", "pre": d, "pre2": d}):
        moved = j.append(dict(ev, unit=unit), actor)
    j.append({"op": "write", "path": "e/x", "unit": unit, "offset": 0, "length": 3}, actor)
    j.close()
    r = Journal(sd, readonly=True)
    try:
        states = States(r, Tree.at(str(ws)))
        for path in ("e/x", "d/x"):
            st = states.state(path, moved - (path == "d/x"))
            assert st.kind == "file" or not st.exact, (path, st)
    finally:
        r.close()


def test_a_hard_link_written_through_its_other_name(make_mount, tmp_path):
    """c is a hard link of a; a write run through a changes c unseen too: c's state after the
    run's event (its alias) is not the content the run left, until the run has ended."""
    ops = [["make", "a", "<0>"], ["link", "a", "c"], ["open", 0, "a", "trunc"],
           ["write", 0, "<1>"], ["mkdir", "z"], ["write", 0, "<2>"], ["close", 0],
           ["rename", "c", "b"]]
    m = run_and_check(make_mount, tmp_path, [{"dir": "c", "ops": ops}], min_exact=15)
    assert [e["op"] for e in m.events() if e["path"] == "c/c"][-2:] == ["alias", "rename"]


def test_a_hard_link_renamed_away_while_written_through_another_name(make_mount, tmp_path):
    """c, a hard link of a, is renamed to b while a write run through a goes on: the rename's
    pre-image keeps no content, so c's state just before it is not what b holds later."""
    ops = [["make", "a", "<0>"], ["link", "a", "c"], ["open", 0, "a", "rdwr"],
           ["write", 0, "<1>"], ["rename", "c", "b"], ["write", 0, "<2>"], ["close", 0],
           ["mkdir", "z"]]
    run_and_check(make_mount, tmp_path, [{"dir": "c", "ops": ops}], min_exact=15)


def test_a_hard_link_written_through_its_other_name_with_record_data(make_mount, tmp_path):
    """With --record-data the run's later writes are events of the name written through only:
    the other name is not exact at them."""
    ops = [["make", "a", "<0>"], ["link", "a", "c"], ["open", 0, "a", "trunc"],
           ["write", 0, "<1>"], ["write", 0, "<2>"], ["mkdir", "z"], ["write", 0, "<3>"],
           ["close", 0], ["rename", "c", "b"]]
    run_and_check(make_mount, tmp_path, [{"dir": "c", "ops": ops}], min_exact=15,
                  extra=["--record-data"])


def test_a_hard_link_renamed_over_another_name_while_written(make_mount, tmp_path):
    """b, a hard link of c, is renamed over d/y while a write run through c goes on: the run's
    next write is an event again (journaled on d/y too), so d/y's state after the rename is the
    content it had then, not what the run wrote later."""
    ops = [["mkdir", "d"], ["make", "c", "<0>"], ["link", "c", "b"], ["open", 0, "c", "rdwr"],
           ["write", 0, "<1>"], ["write", 0, "<2>"], ["@1", "make", "d/y", "<3>"],
           ["rename", "b", "d/y"], ["mkdir", "e"], ["write", 0, "<4>"], ["close", 0],
           ["mkdir", "z"]]
    run_and_check(make_mount, tmp_path, [{"dir": "c", "ops": ops}], min_exact=20)


HELD_OVER = textwrap.dedent('''
    import os, sys, time
    from overlayrec import client
    with client.connect() as c:
        c.call_begin("C", "Bash")
        fd = os.open("f.txt", os.O_WRONLY)
        os.write(fd, b"AGENT1")
        open(sys.argv[1], "w").close()
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.02)
        os.write(fd, b"AGENT2")  # into the file the user's rename took the name from
        os.close(fd)
        c.call_end("C")
''')


def test_a_write_to_a_file_renamed_over_is_named_by_the_name_it_left(make_mount, tmp_path):
    """The agent writes through a descriptor to f.txt after the user renamed another file over
    it: `log` printed the attic's own name (`.overlayrec-attic/...gone...`, which no reader is
    to show) and `show` a patch deleting it.  Both name the file that left f.txt now.  Found
    by a bug hunt."""
    from conftest import run_with_outside_step
    m = make_mount()
    with open(os.path.join(m.ws, "f.txt"), "w") as f:
        f.write("aaaaaaaaaabbbbbbbbbb\n")
    m.mount()

    def outside():
        with open(os.path.join(m.ws, ".f.swp"), "w") as f:
            f.write("USER\n")
        os.rename(os.path.join(m.ws, ".f.swp"), os.path.join(m.ws, "f.txt"))
    run_with_outside_step(m, tmp_path, HELD_OVER, outside)
    lines = overlayrec("log", m.ws, "--call", "C").stdout.splitlines()
    assert len(lines) == 2 and ".overlayrec-attic" not in lines[1], lines
    assert lines[1].endswith("write       (the file that left f.txt, written through a "
                             "descriptor still open on it)"), lines
    seq = lines[1].split()[0]
    out = overlayrec("show", "-w", m.ws, seq).stdout
    assert "(the file that left f.txt" in out.splitlines()[0] and "deleted file" not in out, out
