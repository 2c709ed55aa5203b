"""A change journaled but never made: the daemon killed between its event and its syscall.

The recorder commits each event before it changes the underlay (the write-ahead order).  A
daemon killed in between left an event whose change never happened, and the next mount sealed
it as done: an ``mv f1 f2`` over f2 read as made (show, replay and diff gave f1's content as
f2's), a revert since it wrote f2's content into f1, a ``rm`` named an attic entry never made
(check: not whole), a ``mkdir`` made a directory a drift then removed (found by a bug hunt,
the syscall held with strace).  The daemon kills itself here in that window
(OVERLAYREC_TEST_KILL_AHEAD, a test switch); the next mount voids the event.  Every reader
is compared with the tree the test took itself."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

from conftest import is_mounted, needs_fuse, overlayrec
from test_replay import tree_of

from overlayrec.recorder import is_attic_entry

pytestmark = needs_fuse

BIG = 300 << 10  # past the small pre-images copied into the store: kept by the attic


def _seed(ws: str) -> None:
    os.makedirs(os.path.join(ws, "d", "sub"))
    for name, data in (("f1", b"one\n" * (BIG // 4)), ("f2", b"two\n" * (BIG // 4)),
                       ("d/g", b"g\n"), ("d/sub/s", b"s\n"), ("small", b"small\n")):
        with open(os.path.join(ws, name), "wb") as f:
            f.write(data)


def _killed_in(m, kill: str, op: str, wait: float = 0.0) -> dict:
    """Mount ``m`` with the daemon to kill itself at ``kill``, edit f1 and d/g (recorded),
    run ``op`` (refused: the daemon is gone), mount again and unmount.  The tree as the op
    left it (that is, before it)."""
    m.env = dict(os.environ, OVERLAYREC_TEST_KILL_AHEAD=kill)
    m.mount()
    m.sh("echo edit >> f1; echo edit >> d/g")
    r = m.sh(op, check=False)
    assert r.returncode != 0 and "connection abort" in r.stderr, (r.stdout, r.stderr)
    overlayrec("umount", m.ws, check=False)  # the dead mount
    assert not is_mounted(m.ws)
    want = tree_of(m.ws)
    time.sleep(wait)  # the next mount later than the killed daemon's last stamp's slack
    m.env = None
    m.mount()
    m.umount()
    return want


def _seq_of(m, op: str) -> int:
    rows = [json.loads(line) for line in overlayrec(
        "log", "-w", m.ws, "--state-dir", m.state, "--json").stdout.splitlines()]
    return next(r["seq"] for r in rows if r["op"] == op)


def _readers_agree(m, tmp_path, want: dict, op: str, paths: set[str]) -> None:
    """Every reader says the op was not made: log marks it, check finds the record whole,
    a replay at and after it gives the tree taken, the session's diff names only the
    edits, and a revert since the op changes nothing."""
    log = overlayrec("log", "-w", m.ws, "--state-dir", m.state).stdout
    line = next(x for x in log.splitlines() if f" {op} " in x)
    assert "not made: the daemon was killed" in line, log
    overlayrec("check", m.ws, "--state-dir", m.state)
    seq = _seq_of(m, op)
    for at in (seq, seq + 1):
        out = str(tmp_path / f"r{at}")
        overlayrec("replay", "-w", m.ws, "--state-dir", m.state, "--at", str(at), "--to", out,
                   "--full")
        assert tree_of(out) == want, at
    names = overlayrec("diff", "-w", m.ws, "--state-dir", m.state, "--since", "0",
                       "--name-status").stdout
    assert {line.split("\t")[-1] for line in names.splitlines()} == {"f1", "d/g"}, names
    for p in paths:
        assert p not in names
    overlayrec("revert", m.ws, "--state-dir", m.state, "--since", str(seq), "--yes")
    assert tree_of(m.ws) == want


def test_a_rename_over_a_file_killed_before_it_is_voided(make_mount, tmp_path):
    m = make_mount()
    _seed(m.ws)
    want = _killed_in(m, "rename:f1", "mv f1 f2")
    assert want["f1"][2].endswith(b"edit\n") and want["f2"][2].startswith(b"two")
    _readers_agree(m, tmp_path, want, "rename", {"f2"})


def test_a_rename_killed_after_the_attic_link_drops_the_link(make_mount, tmp_path):
    """Killed at the rename's syscall, after the link the attic took of the file it was
    about to replace: the link goes with the event (f2's link count reads as before)."""
    m = make_mount()
    _seed(m.ws)
    want = _killed_in(m, "renameat2:f1", "mv f1 f2", wait=1.2)
    attic = os.path.join(m.ws, ".overlayrec-attic")
    f2 = os.stat(os.path.join(m.ws, "f2")).st_ino
    kept = [n for n in os.listdir(attic) if is_attic_entry(n)]
    assert not any(os.stat(os.path.join(attic, n)).st_ino == f2 for n in kept), kept
    _readers_agree(m, tmp_path, want, "rename", {"f2"})
    m.mount()
    try:
        assert os.stat(os.path.join(m.ws, "f2")).st_nlink == 1
    finally:
        m.umount()


def test_an_unlink_killed_before_it_is_voided(make_mount, tmp_path):
    m = make_mount()
    _seed(m.ws)
    want = _killed_in(m, "unlink:f2", "rm f2")
    assert "f2" in want
    _readers_agree(m, tmp_path, want, "unlink", {"f2"})


def test_a_directory_rename_killed_before_it_is_voided(make_mount, tmp_path):
    m = make_mount()
    _seed(m.ws)
    want = _killed_in(m, "rename:d", "mv d e")
    assert "d/sub/s" in want and "e" not in want
    _readers_agree(m, tmp_path, want, "rename", {"e/g", "e/sub/s", "d/sub/s"})


@pytest.mark.parametrize("op,cmd,name", [("mkdir", "mkdir newd", "newd"),
                                         ("symlink", "ln -s f1 newl", "newl"),
                                         ("create", "echo x > newf", "newf")])
def test_a_make_killed_before_it_is_voided(make_mount, tmp_path, op, cmd, name):
    m = make_mount()
    _seed(m.ws)
    want = _killed_in(m, f"{op}:{name}", cmd)
    assert name not in want
    _readers_agree(m, tmp_path, want, op, {name})
    assert "drift" not in overlayrec("log", "-w", m.ws, "--state-dir", m.state).stdout


def test_a_rename_made_then_moved_back_while_unmounted_stays_made(make_mount, tmp_path):
    """The daemon killed just after a rename it made, and the user moving the file back while
    unmounted: the live tree's names hold what they held before the rename, but the file
    changed after the event (its ctime), so the rename stands, and the move back is the
    unmounted drift."""
    m = make_mount()
    _seed(m.ws)
    m.mount()
    m.sh("echo edit >> f1; mv small moved")
    with open(os.path.join(m.state, "daemon.json")) as f:
        pid = json.load(f)["pid"]
    os.kill(pid, 9)
    overlayrec("umount", m.ws, check=False)
    time.sleep(1.2)  # past the outcome check's slack (journal.outcome.AFTER_NS)
    os.rename(os.path.join(m.ws, "moved"), os.path.join(m.ws, "small"))
    m.env = None
    m.mount()
    m.umount()
    log = overlayrec("log", "-w", m.ws, "--state-dir", m.state).stdout
    assert "not made" not in log, log
    seq = _seq_of(m, "rename")
    out = str(tmp_path / "r")
    overlayrec("replay", "-w", m.ws, "--state-dir", m.state, "--at", str(seq), "--to", out,
               "--full")
    got = tree_of(out)  # (moved's content there is inexact: a rename copies nothing)
    assert "small" not in got and "moved" in got
    drift = [x.split()[-1] for x in log.splitlines() if " drift " in x]
    assert "small" in drift, log  # another writer's, found at the mount


def test_the_outcome_judged_from_the_live_tree():
    """journal.outcome alone: what each op's names must hold for it to be taken as unmade."""
    from overlayrec.journal import outcome

    class St:  # an lstat's fields the judgement reads
        def __init__(self, mode, ino, ctime):
            self.st_mode, self.st_ino, self.st_ctime_ns = mode, ino, ctime
    t = 10 ** 18
    f = lambda ino, ctime=t - 1: St(0o100644, ino, ctime)  # noqa: E731
    d = St(0o40755, 9, t - 1)
    file = {"kind": "file", "ino": 1}
    mv = {"op": "rename", "t": t, "path": "a", "path2": "b", "pre": file,
          "pre2": {"kind": "absent"}}
    assert outcome.unmade(mv, {"a": f(1), "": d}.get)
    assert not outcome.unmade(mv, {"b": f(1), "": d}.get)  # made
    assert not outcome.unmade(mv, {"a": f(2), "": d}.get)  # another file there now
    assert not outcome.unmade(mv, {"a": f(1, t + 2 * 10 ** 9), "": d}.get)  # changed since
    assert not outcome.unmade(mv, {"a": f(1), "b": f(3), "": d}.get)  # b made since
    over = dict(mv, pre2={"kind": "file", "ino": 3})
    assert outcome.unmade(over, {"a": f(1), "b": f(3)}.get)
    assert not outcome.unmade(over, {"b": f(1)}.get)
    swap = dict(over, flags=2)
    assert outcome.unmade(swap, {"a": f(1), "b": f(3)}.get)
    assert not outcome.unmade(swap, {"a": f(3), "b": f(1)}.get)
    rm = {"op": "unlink", "t": t, "path": "x/a", "pre": file}
    assert outcome.unmade(rm, {"x/a": f(1)}.get)
    assert not outcome.unmade(rm, {}.get)
    mk = {"op": "mkdir", "t": t, "path": "x/n", "pre": {"kind": "absent"}}
    assert outcome.unmade(mk, {"x": d}.get)
    assert not outcome.unmade(mk, {"x": d, "x/n": d}.get)  # made
    assert not outcome.unmade(mk, {"x": St(0o40755, 9, t + 2 * 10 ** 9)}.get)  # x changed since
    assert not outcome.unmade({"op": "write", "t": t, "path": "a", "pre": file}, {"a": f(1)}.get)
    assert not outcome.unmade(dict(rm, t=None), {"x/a": f(1)}.get)
    kinds = dict(swap, pre2={"kind": "dir"})  # a file and a directory exchanged, or not
    assert outcome.unmade(kinds, {"a": f(1), "b": d}.get)
    assert not outcome.unmade(kinds, {"a": d, "b": f(1)}.get)
    # exchanged, the replaced file not yet moved into the attic: half made
    half = dict(over, pre2={"kind": "file", "ino": 3, "attic": "j.7"})
    assert outcome.half_exchanged(half, {"a": f(3), "b": f(1)}.get)
    assert not outcome.half_exchanged(half, {"a": f(1), "b": f(3)}.get)  # not begun
    assert not outcome.half_exchanged(half, {"b": f(1)}.get)  # made whole


EXCHANGE = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True)\n"
            "if libc.renameat2(-100, b'small', -100, b'd', 2):\n"
            "    e = ctypes.get_errno(); raise OSError(e, os.strerror(e))\n")


def test_an_exchange_of_a_file_and_a_directory_killed_before_it_is_voided(make_mount,
                                                                          tmp_path):
    """renameat2(RENAME_EXCHANGE) of a file and a directory, the daemon killed before it:
    both names held an object either way, so it read as made, and a revert since it put a
    directory where the file was (found by a bug hunt).  The kinds tell: voided."""
    m = make_mount()
    _seed(m.ws)
    (tmp_path / "x.py").write_text(EXCHANGE)
    want = _killed_in(m, "rename:small", f"{sys.executable} {tmp_path / 'x.py'}")
    assert want["small"][0] == "file" and want["d"][0] == "dir"
    log = overlayrec("log", "-w", m.ws, "--state-dir", m.state).stdout
    assert "not made: the daemon was killed" in next(
        x for x in log.splitlines() if " exchange " in x), log
    seq = _seq_of(m, "rename")
    out = str(tmp_path / "r")
    overlayrec("replay", "-w", m.ws, "--state-dir", m.state, "--at", str(seq), "--to", out,
               "--full")
    assert tree_of(out) == want
    overlayrec("revert", m.ws, "--state-dir", m.state, "--since", str(seq), "--yes")
    assert tree_of(m.ws) == want


def test_a_secret_renamed_over_a_file_killed_before_it_leaves_the_file_plain(make_mount,
                                                                            tmp_path):
    """`mv .env f2`, the daemon killed before it: the secret's name was carried to f2 before
    the rename and stayed, so f2's content was withheld for the rest of the record, its
    later changes too (found by a bug hunt).  Voided, f2 is plain again."""
    m = make_mount()
    _seed(m.ws)
    with open(os.path.join(m.ws, ".env"), "w") as f:
        f.write("TOKEN=secret\n")
    want = _killed_in(m, "rename:.env", "mv .env f2")
    assert want[".env"][2] == b"TOKEN=secret\n"
    m.mount()
    try:
        m.sh("echo later >> f2")
    finally:
        m.umount()
    diff = overlayrec("diff", m.ws, "--state-dir", m.state, "--since", "0", "--path", "f2")
    assert "+later" in diff.stdout and "secret" not in diff.stderr, (diff.stdout, diff.stderr)
    seq = _seq_of(m, "rename")
    out = str(tmp_path / "r")
    overlayrec("replay", "-w", m.ws, "--state-dir", m.state, "--at", str(seq), "--to", out,
               "--full")
    assert tree_of(out)["f2"] == want["f2"]


def test_a_link_to_a_secret_killed_before_it_leaves_the_file_plain(make_mount, tmp_path):
    """`ln notes.txt .env.local`, the daemon killed before it: the secret name carried to
    notes.txt before the link stayed, and notes.txt was withheld for the rest of the record
    (found by a bug hunt).  Voided, notes.txt is plain again."""
    m = make_mount()
    _seed(m.ws)
    with open(os.path.join(m.ws, "notes.txt"), "w") as f:
        f.write("v1\n")
    _killed_in(m, "link:.env.local", "ln notes.txt .env.local")
    m.mount()
    try:
        m.sh("echo v2 > notes.txt")
    finally:
        m.umount()
    diff = overlayrec("diff", m.ws, "--state-dir", m.state, "--since", "0", "--path",
                      "notes.txt")
    assert "-v1" in diff.stdout and "+v2" in diff.stdout, (diff.stdout, diff.stderr)


def test_a_second_move_of_a_secret_killed_keeps_the_first_ones_name(make_mount, tmp_path):
    """`mv .env cfg` (cfg withheld from then on), a new .env, then `mv .env cfg` killed:
    voiding it took back cfg's name too, and cfg's secret was kept and shown from then on
    (found by a bug hunt).  Only the names the voided change carried go back."""
    m = make_mount()
    _seed(m.ws)
    with open(os.path.join(m.ws, ".env"), "w") as f:
        f.write("SECRET1\n")
    m.mount()
    try:
        m.sh("mv .env cfg && echo SECRET2 > .env")
    finally:
        m.umount()
    m.env = dict(os.environ, OVERLAYREC_TEST_KILL_AHEAD="rename:.env")
    m.mount()
    r = m.sh("mv .env cfg", check=False)
    assert r.returncode != 0
    overlayrec("umount", m.ws, check=False)
    m.env = None
    m.mount()
    try:
        m.sh("echo edited > cfg")
    finally:
        m.umount()
    out = overlayrec("diff", m.ws, "--state-dir", m.state, "--since", "0")
    assert "SECRET" not in out.stdout and "SECRET" not in out.stderr, out.stdout
    for root, _, files in os.walk(m.state):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                assert b"SECRET1" not in f.read(), name


def test_a_rename_over_a_file_killed_then_its_source_edited_while_unmounted(make_mount,
                                                                          tmp_path):
    """`mv f1 f2` over a large f2, killed after the attic's link of f2 and before the
    rename, then f1 edited while unmounted: the edit left the event as made, and the attic's
    link of the live f2 was its pre-image (check not whole, show wrong, a revert refused;
    found by a bug hunt).  f2 still holding its own inode says the rename was not made."""
    m = make_mount()
    _seed(m.ws)
    m.env = dict(os.environ, OVERLAYREC_TEST_KILL_AHEAD="renameat2:f1")
    m.mount()
    r = m.sh("mv f1 f2", check=False)
    assert r.returncode != 0
    overlayrec("umount", m.ws, check=False)
    time.sleep(1.2)
    with open(os.path.join(m.ws, "f1"), "a") as f:
        f.write("while unmounted\n")
    want = tree_of(m.ws)
    m.env = None
    m.mount()
    m.umount()
    overlayrec("check", m.ws, "--state-dir", m.state)
    assert "not made" in overlayrec("log", "-w", m.ws, "--state-dir", m.state).stdout
    assert os.stat(os.path.join(m.ws, "f2")).st_nlink == 1
    seq = _seq_of(m, "rename")
    out = str(tmp_path / "r")
    overlayrec("replay", "-w", m.ws, "--state-dir", m.state, "--at", "end", "--to", out,
               "--full")
    assert tree_of(out) == want
    assert seq


DIRS_EXCHANGE = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True)\n"
                 "if libc.renameat2(-100, b'd', -100, b'e', 2):\n"
                 "    n = ctypes.get_errno(); raise OSError(n, os.strerror(n))\n")


def test_an_exchange_of_two_directories_killed_before_it_is_voided(make_mount, tmp_path):
    """renameat2(RENAME_EXCHANGE) of two directories, the daemon killed before it: taken as
    made, replay before it showed files neither directory held and a revert made one (found
    by a bug hunt).  A directory's rename keeps its inode now: voided."""
    m = make_mount()
    _seed(m.ws)
    os.makedirs(os.path.join(m.ws, "e"))
    with open(os.path.join(m.ws, "e", "in_e"), "w") as f:
        f.write("e\n")
    (tmp_path / "x.py").write_text(DIRS_EXCHANGE)
    want = _killed_in(m, "rename:d", f"{sys.executable} {tmp_path / 'x.py'}")
    assert "e/in_e" in want and "d/g" in want
    seq = _seq_of(m, "rename")
    for at in (str(seq - 1), "end"):
        out = str(tmp_path / f"r{at}")
        overlayrec("replay", "-w", m.ws, "--state-dir", m.state, "--at", at, "--to", out,
                   "--full")
        got = tree_of(out)
        if at == "end":
            assert got == want
        else:
            assert "d/in_e" not in got and "e/g" not in got, got
    overlayrec("revert", m.ws, "--state-dir", m.state, "--since", str(seq), "--yes")
    assert tree_of(m.ws) == want


DEEP = "/".join(["p" * 200] * 19)  # a directory path of 3,818 bytes


@pytest.mark.parametrize("op,cmd,name", [
    ("rename", f"cd {DEEP} && mv deepf deepg", "deepf"),
    ("mknod", f"cd {DEEP} && mkfifo pipe", "pipe"),
    ("rename", "mv d/sub d/moved", "sub")])
def test_changes_of_other_shapes_killed_before_them_are_voided(make_mount, tmp_path, op, cmd,
                                                               name):
    """The same judgement on shapes the first tests leave out: a rename at a path of ~4,000
    bytes, a fifo made, a directory holding a file renamed beneath another: each voided, and
    replay, diff and a revert since it agree with the tree."""
    m = make_mount()
    _seed(m.ws)
    os.makedirs(os.path.join(m.ws, DEEP))
    with open(os.path.join(m.ws, DEEP, "deepf"), "w") as f:
        f.write("deep\n")
    want = _killed_in(m, f"{op}:{name}", cmd)
    log = overlayrec("log", "-w", m.ws, "--state-dir", m.state, "--json").stdout
    [row] = [json.loads(x) for x in log.splitlines() if json.loads(x)["op"] == op]
    assert row.get("unmade"), row
    out = str(tmp_path / "r")
    overlayrec("replay", "-w", m.ws, "--state-dir", m.state, "--at", str(row["seq"]), "--to",
               out, "--full")
    assert tree_of(out) == want
    names = overlayrec("diff", m.ws, "--state-dir", m.state, "--since", "0",
                       "--name-status").stdout
    assert {x.split("\t")[-1] for x in names.splitlines()} == {"f1", "d/g"}, names
    overlayrec("revert", m.ws, "--state-dir", m.state, "--since", str(row["seq"]), "--yes")
    assert tree_of(m.ws) == want
