"""Unit tests of the layers below the mount, called directly."""
from __future__ import annotations

import ctypes
import errno
import os

import pytest
from hypothesis import given, settings, strategies as st

from overlayrec import underlay
from overlayrec.attribution import Attribution, proc_start_and_ppid
from overlayrec.journal import ContentStore, Journal
from overlayrec.recorder import RangeSet


def test_rangeset_missing_and_add():
    r = RangeSet()
    assert r.missing(0, 10) == [(0, 10)]
    r.add(2, 4)
    r.add(6, 8)
    assert r.missing(0, 10) == [(0, 2), (4, 6), (8, 10)]
    r.add(3, 7)
    assert r.iv == [[2, 8]]
    assert r.missing(2, 8) == []
    assert r.missing(5, 9) == [(8, 9)]


def test_rangeset_agrees_with_a_set_of_bytes_and_takes_back_what_it_added():
    """Generated adds against the set of bytes they cover: every ``missing`` answer, the
    intervals sorted, disjoint and not touching; ``undo`` after ``mark`` gives back the
    intervals as they were (a mutation that failed), with the file's intervals changed in
    place (no copy a write: scattered writes over a large file were quadratic)."""
    import random
    for seed in range(500):
        rnd, r, cover = random.Random(seed), RangeSet(), set()
        for step in range(rnd.randrange(1, 30)):
            a = rnd.randrange(0, 80)
            b = a + rnd.randrange(1, 20)
            want, cur = [], None
            for x in range(a, b):
                if x in cover:
                    cur = None
                elif cur is not None and want[-1][1] == x:
                    want[-1] = (want[-1][0], x + 1)
                else:
                    want.append((x, x + 1))
                    cur = x
            assert r.missing(a, b) == want, (seed, step, r.iv, a, b)
            if rnd.random() < 0.3:  # a mutation that fails: its adds are taken back
                before = [list(x) for x in r.iv]
                r.mark()
                for _ in range(rnd.randrange(1, 4)):
                    lo = rnd.randrange(0, 80)
                    r.add(lo, lo + rnd.randrange(1, 12))
                r.undo()
                assert r.iv == before, (seed, step)
            lo = rnd.randrange(0, 80)
            hi = lo + rnd.randrange(1, 12)
            r.add(lo, hi)
            cover |= set(range(lo, hi))
            assert all(x[1] < y[0] for x, y in zip(r.iv, r.iv[1:])), r.iv
            assert set().union(*(set(range(x, y)) for x, y in r.iv)) == cover


def test_content_store_dedups(tmp_path):
    cs = ContentStore(str(tmp_path))
    a = cs.put_bytes(b"hello")
    b = cs.put_bytes(b"hello")
    assert a == b and len(a) == 32 and cs.get(a) == b"hello"
    p = tmp_path / "src"
    p.write_bytes(b"0123456789")
    fd = os.open(p, os.O_RDONLY)
    try:
        assert cs.get(cs.put_range(fd, 3, 4)) == b"3456"
    finally:
        os.close(fd)


def test_content_store_streams_a_large_sparse_range_and_keeps_its_holes(tmp_path):
    """A truncated disk image's cut range is gigabytes of mostly holes: stored with one chunk
    of memory (not the range) and as a sparse blob (not its length on disk), its bytes the
    same; a range of data and zeros mixed reads back as it was."""
    import tracemalloc
    import xxhash
    cs = ContentStore(str(tmp_path / "store"))
    p = tmp_path / "img"
    size = 96 << 20
    with open(p, "wb") as f:
        f.truncate(size)
        f.seek(40 << 20)
        f.write(b"superblock" * 1000)
        f.seek(size - 5)
        f.write(b"tail!")
    fd = os.open(p, os.O_RDONLY)
    try:
        tracemalloc.start()
        digest = cs.put_range(fd, 1 << 20, size)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        expected = os.pread(fd, size, 1 << 20)
    finally:
        os.close(fd)
    assert peak < 8 << 20, f"{peak} bytes held to store a {size >> 20} MiB range"
    assert digest == xxhash.xxh3_128_hexdigest(expected)
    blob = os.lstat(cs.path(digest))
    assert blob.st_size == len(expected) == size - (1 << 20)
    assert blob.st_blocks * 512 < 4 << 20, "the blob's holes were written as zeros"
    assert cs.get(digest) == expected
    # the same range again: deduplicated, no temp file left
    fd = os.open(p, os.O_RDONLY)
    try:
        assert cs.put_range(fd, 1 << 20, size) == digest
    finally:
        os.close(fd)
    assert os.listdir(tmp_path / "store" / "tmp") == []


def test_journal_append_read_and_path_index(tmp_path):
    j = Journal(str(tmp_path), workspace="/w")
    actor = {"key": "1:2", "pid": 1}
    s1 = j.append({"op": "create", "path": "a", "actor": "1:2"}, actor)
    s2 = j.append({"op": "rename", "path": "a", "path2": "b", "actor": "1:2"}, actor)
    assert (s1, s2) == (1, 2)
    assert [e["op"] for e in j.events()] == ["create", "rename"]
    assert j.seqs_for_path("a") == [1, 2] and j.seqs_for_path("b") == [2]
    assert j.actor("1:2")["pid"] == 1 and j.meta("workspace") == "/w"
    j.close()
    j = Journal(str(tmp_path))
    assert j.append({"op": "unlink", "path": "b", "actor": "1:2"}) == 3  # seq continues
    j.close()


def test_actor_identity_is_pid_and_start_time():
    a = Attribution()
    me = a.actor(os.getpid())
    start, ppid = proc_start_and_ppid(os.getpid())
    assert me["key"] == f"{os.getpid()}:{start}" and me["ppid"] == ppid == os.getppid()
    assert a.actor(os.getpid()) is me  # cached while the process lives


def test_an_exited_process_is_never_served_from_the_cache():
    import subprocess
    import sys
    a = Attribution()
    code = "import sys; print('up', flush=True); sys.stdin.read()"
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"up\n"
    first = a.actor(p.pid)
    assert first["argv"][-1] == code and first["start"] > 0
    p.stdin.close()
    p.wait()
    assert p.pid in a._live
    gone = a.actor(p.pid)
    assert p.pid not in a._live  # its pidfd said it exited: the cache entry is dropped
    # a request from a process gone before it could be read is the last process known there
    assert gone["key"] == first["key"]


def test_threads_are_their_process():
    import threading
    a = Attribution()
    out = {}

    def run():
        out["actor"] = a.actor(threading.get_native_id())
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert out["actor"]["pid"] == os.getpid()


def test_wire_json_round_trips_with_the_json_package():
    import json

    import pytest

    from overlayrec import wire
    samples = [{"a": 1, "b": [True, None, 'q"\\\u00e9\n'], "c": {"d": 1.5, "e": -2}}, [], "",
               {"hook_event_name": "PreToolUse", "tool_input": {"command": "sed -i 's/a/b/' x"}}]
    for o in samples:
        assert json.loads(wire.dumps(o)) == o
        assert wire.loads(json.dumps(o, indent=2)) == o
    for bad in ("", "{", "[1,]", "{} x"):
        with pytest.raises(ValueError):
            wire.loads(bad)


class _OldKernelLinkat:
    """libc as Linux before 6.10 answers a user without CAP_DAC_READ_SEARCH: linkat with
    AT_EMPTY_PATH fails with ENOENT."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    @staticmethod
    def linkat(*args):
        ctypes.set_errno(errno.ENOENT)
        return -1


def test_a_symlink_is_hard_linked_by_path_where_the_kernel_refuses_the_fd(tmp_path, monkeypatch):
    os.symlink("target", tmp_path / "sl")
    os.symlink("other", tmp_path / "decoy")
    root = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    src = underlay.open_path(root, "sl")
    monkeypatch.setattr(underlay, "_libc", _OldKernelLinkat(underlay._libc))
    try:
        with pytest.raises(FileNotFoundError):  # no path to fall back on: the kernel's answer
            underlay.link_fd(src, root, "nolink")
        underlay.link_fd(src, root, "second", root_fd=root, rel="sl")
        assert os.readlink(tmp_path / "second") == "target"
        assert os.lstat(tmp_path / "sl").st_nlink == 2
        # a path that no longer names the fd's object: nothing is left behind
        with pytest.raises(OSError) as e:
            underlay.link_fd(src, root, "wrong", root_fd=root, rel="decoy")
        assert e.value.errno == errno.ESTALE
        assert not os.path.lexists(tmp_path / "wrong")
        assert os.lstat(tmp_path / "decoy").st_nlink == 1
    finally:
        os.close(src)
        os.close(root)


def test_no_request_handler_awaits():
    """The daemon serves FUSE with one worker task (daemon.py), which is only right while every
    handler runs to completion without yielding to trio: an await in a handler would stall
    every other request behind it."""
    import ast
    import inspect

    from overlayrec import fs

    tree = ast.parse(inspect.getsource(fs))
    handlers = [n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef)]
    assert len(handlers) > 20  # the whole Operations class was found
    awaiting = sorted({h.name for h in handlers
                       for n in ast.walk(h) if isinstance(n, (ast.Await, ast.AsyncFor,
                                                               ast.AsyncWith))})
    assert awaiting == ["wrapper"]  # only _errno_boundary's wrapper, which awaits the handler


def test_names_agree_with_a_scan_of_every_inode():
    """Recorder.names (a reverse-mapped table) against the plain scan it replaced, over a
    random mix of links, unlinks, renames of files and directories, renames over a name and
    exchanges: the same names for every inode after every step."""
    import random
    from overlayrec.recorder import Names

    def model_rename(model, path, path2, is_dir, exchange):
        def move(n):
            if n == path or (is_dir and n.startswith(path + "/")):
                return path2 + n[len(path):]
            if exchange and (n == path2 or n.startswith(path2 + "/")):
                return path + n[len(path2):]
            return n
        kept = {}
        for key, names in model.items():
            moved = {move(n) for n in names if exchange or n != path2}
            if moved:
                kept[key] = moved
        return kept

    rng = random.Random(16)
    pool = ["a", "b", "c", "d/x", "d/y", "d/e/z", "f/x", "f/y", "g"]
    for _ in range(200):
        names, model = Names(), {}
        for _ in range(60):
            op = rng.choice(["add", "add", "unname", "rename", "rename_dir", "exchange"])
            key = (1, rng.randrange(6))
            if op == "add":
                ps = rng.sample(pool, 2)
                names.add(key, ps)
                for p in ps:  # a name holds one inode
                    for other in model.values():
                        other.discard(p)
                model = {k: v for k, v in model.items() if v}
                model.setdefault(key, set()).update(ps)
            elif op == "unname":
                p = rng.choice(pool)
                names.unname(p)
                model = {k: v - {p} for k, v in model.items() if v - {p}}
            else:
                if op == "rename":
                    a, b = rng.sample(["a", "b", "c", "g", "d/x", "f/y"], 2)
                    is_dir = False
                else:
                    a, b = rng.sample(["d", "f", "h"], 2)
                    is_dir = True
                    if op == "rename_dir":  # a directory is renamed over an empty one only
                        for p in [p for v in model.values() for p in v if p.startswith(b + "/")]:
                            names.unname(p)
                            model = {k: v - {p} for k, v in model.items() if v - {p}}
                names.rename(a, b, is_dir, op == "exchange")
                model = model_rename(model, a, b, is_dir, op == "exchange")
            assert {k: set(v) for k, v in zip(list(names._by_key), names.values())} == model, op
            assert len(names) == len(model) and all(names.values())


def test_a_large_live_content_is_read_when_used_and_as_it_was(tmp_path):
    """A reader's state of a file past HOLD is read when used, from the file it looked at: a
    log appended to since gives what it held then; a file renamed over it is an error, never
    the other file's bytes."""
    from overlayrec.engines.large import HOLD, ChangedWhileRead, Large, whole
    from overlayrec.engines.states import Tree
    first = os.urandom(HOLD + 12345)
    (tmp_path / "log").write_bytes(first)
    tree = Tree.at(str(tmp_path))
    try:
        st = tree.state("log")
        assert isinstance(st.data, Large) and len(st.data) == len(first)
        with open(tmp_path / "log", "ab") as f:
            f.write(b"appended while a diff reads\n")
        assert whole(st.data) == first and st.data == first
        again = tree.state("log")  # a new look sees the append
        (tmp_path / "other").write_bytes(first + b"x" * 100)
        os.replace(tmp_path / "other", tmp_path / "log")
        with pytest.raises(ChangedWhileRead, match="log changed while it was being read"):
            whole(again.data)
    finally:
        os.close(tree.root_fd)


def test_a_reader_holds_little_in_all(tmp_path, monkeypatch):
    """Past the reader's budget, a content of more than SMALL is read when used, not held: a
    diff of ten thousand files of 3 MiB held 30 GB.  Small files are always held."""
    from overlayrec.engines import large
    from overlayrec.engines.states import Tree
    monkeypatch.setattr(large, "BUDGET", 300 << 10)
    monkeypatch.setattr(large, "_held", 0)
    files = {f"f{i}": os.urandom(100 << 10) for i in range(5)}
    files["small"] = b"small\n"
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    tree = Tree.at(str(tmp_path))
    try:
        states = {name: tree.state(name) for name in sorted(files)}
        held = [n for n, s in states.items() if isinstance(s.data, bytes)]
        assert held == ["f0", "f1", "f2", "small"], held   # 300 KiB of 100 KiB files, then none
        for name, s in states.items():
            assert large.whole(s.data) == files[name] and s.data == files[name]
    finally:
        os.close(tree.root_fd)


@settings(max_examples=300, deadline=None)
@given(session=st.text(min_size=1), call_id=st.text(min_size=1), index=st.integers(0, 10**6))
def test_unit_keys_read_back_as_written(session, call_id, index):
    """A unit key is made and read in one place (journal.schema); a session's id and a call's
    may hold ':' and '%' (``--session fix:10:30``): each reads back whole, and keys of
    different units never meet."""
    from overlayrec.journal.schema import (call_unit, outside_unit, parse_unit, revert_unit,
                                           session_unit, turn_unit, unit_kind, unit_session)
    assert parse_unit(call_unit(session, call_id)) == ("call", session, call_id)
    assert parse_unit(turn_unit(session, index)) == ("turn", session, str(index))
    assert parse_unit(session_unit(session)) == ("session", session, None)
    assert parse_unit(revert_unit(call_id)) == ("revert", None, call_id)
    assert parse_unit(outside_unit("123:456")) == ("outside", None, "123:456")
    for unit in (call_unit(session, call_id), turn_unit(session, index), session_unit(session)):
        assert unit_session(unit) == session
    assert unit_session(outside_unit(session)) is None and unit_session(None) is None
    for unit in (call_unit(session, call_id), turn_unit(session, index), session_unit(session),
                 revert_unit(call_id), outside_unit(call_id)):
        assert unit_kind(unit) == parse_unit(unit).kind
    assert unit_kind(None) is None
    u = parse_unit(call_unit(session, call_id))
    assert (u.kind, u.session, u.id) == ("call", session, call_id)
    assert call_unit(session, call_id) != call_unit(session + ":" + call_id, "x")


def test_unit_keys_written_before_the_escaping_read_the_same():
    """Keys of journals made before: a call's id without ':' or '%' is written as it was, and
    a session's id with ':' now reads whole (it was cut at its first ':')."""
    from overlayrec.journal.schema import call_unit, parse_unit
    assert call_unit("s1", "toolu_01ABC") == "call:s1:toolu_01ABC"
    assert call_unit("s1", "implicit-12-345") == "call:s1:implicit-12-345"
    assert parse_unit("call:fix:10:30:implicit-12-345") == ("call", "fix:10:30",
                                                          "implicit-12-345")
    assert parse_unit("turn:fix:10:30:2") == ("turn", "fix:10:30", "2")


def test_a_units_end_is_waited_for_past_the_clients_timeout(tmp_path):
    """The daemon answers a unit's end once it has sealed the unit's paths: a revert of
    100,000 files took longer than the client's 10 s, which then said "control request
    failed: timed out" and left the finished revert pending (found by a hunt).  An end is
    waited for; any other request still times out."""
    import socket
    import threading
    import time as _time
    from overlayrec import client
    path = str(tmp_path / "sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)

    def serve():
        for _ in range(2):
            conn, _ = server.accept()
            with conn:
                conn.recv(4096)
                _time.sleep(1.0)  # sealing
                try:  # the client may be gone: no SIGPIPE (a CLI test in this process may
                    # have given it its default action, which ends the process)
                    conn.sendall(b'{"ok": true}\n', socket.MSG_NOSIGNAL)
                except OSError:
                    pass
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with client.Client(path, timeout=0.3) as c:
            assert c.request("revert_end", id="r1") == {"ok": True}
        with client.Client(path, timeout=0.3) as c:
            with pytest.raises(client.ClientError, match="timed out"):
                c.request("status")
    finally:
        t.join(timeout=5)
        server.close()


def _with_a_child(test):
    """Run ``test(parent pid, child pid)`` while ``sh`` and the ``sleep`` it started run."""
    import subprocess
    import time
    from overlayrec.calls import live_children_of
    sh = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 30
        while not live_children_of(sh.pid):
            assert time.monotonic() < deadline, "sh started no sleep"
            time.sleep(0.01)
        test(sh.pid, next(iter(live_children_of(sh.pid).values())))
    finally:
        sh.kill()
        sh.wait()


@pytest.mark.parametrize("same_boot", [True, False], ids=["this-boot", "another-boot"])
def test_the_record_places_a_survivor_and_what_it_starts_in_its_call(tmp_path, same_boot):
    """A process whose actor row holds its call (its ``line``: a call's survivor an earlier
    mount placed) is that call's where /proc leads to no session, after the call's end, and so
    is what it starts; the journal is asked once a process.  A row of another boot places
    nothing: after a reboot a pid and a start tick may come again."""
    from overlayrec.attribution import read_actor
    from overlayrec.calls import Calls
    from overlayrec.state import boot_id

    def test(parent: int, child: int) -> None:
        j = Journal(str(tmp_path / "state"))
        try:
            line = {"unit": "call:s1:c1", "boot": boot_id() if same_boot else "another boot"}
            j.place_actors([dict(read_actor(parent), line=line)])
            asked = []
            held = j.actor
            j.actor = lambda key, **kw: asked.append(key) or held(key, **kw)
            calls = Calls(j, Attribution())
            actor = read_actor(child)
            unit = calls.unit_of(actor)
            assert asked[:2] == [actor["key"], f"{parent}:{read_actor(parent)['start']}"]
            if not same_boot:
                assert unit == f"outside:{actor['key']}"
                return
            assert len(asked) == 2  # the walk up ends at the row that places it
            assert unit == "call:s1:c1" and unit.extra == {"after_end": True}
            # known now: neither it nor its parent is asked of the journal again
            assert calls.unit_of(actor) == calls.unit_of(read_actor(parent)) == "call:s1:c1"
            assert len(asked) == 2
        finally:
            j.close()
    _with_a_child(test)
