"""Small pre-images kept by the attic until the daemon is idle (Recorder.settle_small).

An unlinked file of at most SMALL_PREIMAGE bytes goes to the attic on the request path, as a
large one does (one rename, nothing copied); the daemon copies it into the content store when
it is idle, or at the unmount, rewrites its event's pre-image to name the blob, and drops the
entry (a small file renamed over is copied at once).  Every reader must give the same answers before the copy,
after it, and across it (a reader that read the event before the copy and reads the attic
after it); nothing may be lost to a ``kill -9``, a reclaim, or a write through a descriptor
left open on the removed file.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import time

import pytest

from overlayrec.recorder import ATTIC_NAME as ATTIC, is_attic_entry

from conftest import SLOW, needs_fuse, overlayrec
from test_attic import plain_recorder, run_session, seeded_repo, tree_of, unlink

# the daemon copies nothing while mounted: readers meet the pre-images in the attic
HOLD = {"OVERLAYREC_TEST_SETTLE_IDLE": "3600"}


def entries(ws: str, under: int | None = None) -> list[str]:
    """The attic's entries; mounted (the mount hides the attic), through ``under``, an fd of
    the workspace opened before the mount."""
    if under is None:
        return sorted(n for n in os.listdir(os.path.join(ws, ATTIC)) if is_attic_entry(n))
    fd = os.open(ATTIC, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=under)
    try:
        return sorted(n for n in os.listdir(fd) if is_attic_entry(n))
    finally:
        os.close(fd)


def underlay_of(ws: str) -> int:
    return os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def removals(evs: list[dict]) -> dict[str, dict]:
    """The pre-image each unlink or rename over kept, by the path that lost it."""
    out = {}
    for e in evs:
        if e["op"] == "unlink":
            out[e["path"]] = e["pre"]
        elif e["op"] == "rename" and e.get("pre2", {}).get("kind") == "file":
            out[e["path2"]] = e["pre2"]
    return out


def replay_at(m, seq: int, out) -> tuple[dict, list]:
    js = json.loads(overlayrec("replay", m.ws, "--at", str(seq), "--to", str(out),
                               "--json").stdout)
    return tree_of(str(out)), js["inexact"]


FILES = {"a.txt": b"alpha\n", "src/b.py": b"x = 1\n", "d/c": b"gamma\n", "d/e/f": b"delta\n",
         "keep.txt": b"kept\n"}
SCRIPT = "rm a.txt; sed -i s/1/2/ src/b.py; rm -r d; echo new > keep.txt"


@needs_fuse
@pytest.mark.timeout(int(180 * SLOW))
def test_every_reader_agrees_before_and_after_the_copy(make_mount, tmp_path):
    m = seeded_repo(make_mount, FILES)
    m.env = dict(os.environ, **HOLD)
    before = tree_of(m.ws)
    under = underlay_of(m.ws)
    m.mount()
    try:
        run_session(m, "s", SCRIPT)
        after = tree_of(m.ws)
        evs = m.events()
        first = min(e["seq"] for e in evs if e.get("session") == "s" or
                    e.get("unit", "").startswith("call:") or e["op"] in ("unlink", "rename"))
        kept = removals(evs)
        for p in ("a.txt", "d/c", "d/e/f"):
            assert "attic" in kept[p] and "blob" not in kept[p], (p, kept[p])  # still waiting
        assert "blob" in kept["src/b.py"] and "attic" not in kept["src/b.py"]  # copied at once
        assert len(entries(m.ws, under)) == 3
        waiting = replay_at(m, first - 1, tmp_path / "r1")
        assert waiting == ({k: v for k, v in before.items()}, []), waiting
        diff = overlayrec("diff", m.ws, "--session", "s").stdout
        assert "-alpha" in diff and "-gamma" in diff and "-x = 1" in diff, diff
        overlayrec("revert", m.ws, "--session", "s", "--yes")
        assert tree_of(m.ws) == before
        overlayrec("unrevert", "-w", m.ws, "--yes")
        assert tree_of(m.ws) == after
    finally:
        m.umount()
        os.close(under)
    # the unmount copied them: the events name blobs, the attic keeps nothing
    kept = removals(m.events())
    for p in ("a.txt", "src/b.py", "d/c", "d/e/f"):
        assert "blob" in kept[p] and "attic" not in kept[p], (p, kept[p])
        assert m.blob(kept[p]["blob"]) == FILES[p]
    assert entries(m.ws) == []
    assert replay_at(m, first - 1, tmp_path / "r2") == waiting
    assert overlayrec("diff", m.ws, "--session", "s").stdout == diff
    m.mount()
    try:
        overlayrec("revert", m.ws, "--session", "s", "--yes")
        assert tree_of(m.ws) == before
    finally:
        m.umount()


@needs_fuse
@pytest.mark.timeout(int(120 * SLOW))
def test_the_daemon_copies_them_when_idle(make_mount):
    m = make_mount()
    under = underlay_of(m.ws)
    m.mount()
    try:
        m.sh("for i in $(seq 50); do echo $i > f$i; done; rm f*; printf x > g; printf y > h; "
             "mv g h; rm h")
        deadline = time.monotonic() + 20 * SLOW
        while time.monotonic() < deadline:
            kept = removals(m.events())
            if all("blob" in pre for pre in kept.values()) and not entries(m.ws, under):
                break
            time.sleep(0.1)
        assert len(kept) == 51 and all("blob" in pre and "attic" not in pre
                                       for pre in kept.values()), kept
        assert m.blob(kept["f7"]["blob"]) == b"7\n" and m.blob(kept["h"]["blob"]) == b"x"
        assert entries(m.ws, under) == []
    finally:
        m.umount()
        os.close(under)


@needs_fuse
@pytest.mark.timeout(int(120 * SLOW))
def test_kill_9_leaves_them_in_the_attic_and_the_next_mount_copies_them(make_mount, tmp_path):
    m = seeded_repo(make_mount, FILES)
    m.env = dict(os.environ, **HOLD)
    before = tree_of(m.ws)
    m.mount()
    m.sh(SCRIPT)
    pid = json.load(open(os.path.join(m.state, "daemon.json")))["pid"]
    os.kill(pid, signal.SIGKILL)
    m.umount()
    evs = m.events()
    first = min(e["seq"] for e in evs if e["op"] in ("unlink", "rename"))
    assert all("attic" in pre for p, pre in removals(evs).items() if p != "src/b.py")
    assert len(entries(m.ws)) == 3
    unmounted = replay_at(m, first - 1, tmp_path / "r1")
    assert unmounted == (before, []), unmounted
    m.env = None
    m.mount()
    m.umount()
    kept = removals(m.events())
    for p in ("a.txt", "src/b.py", "d/c", "d/e/f"):
        assert "attic" not in kept[p] and m.blob(kept[p]["blob"]) == FILES[p], (p, kept[p])
    assert entries(m.ws) == []
    assert replay_at(m, first - 1, tmp_path / "r2") == unmounted


@needs_fuse
@pytest.mark.timeout(int(120 * SLOW))
def test_an_entry_written_through_a_descriptor_left_open_stays_in_the_attic(make_mount,
                                                                            tmp_path):
    """The removed file is written through a descriptor still open on it: an event on the
    attic entry's path.  The entry is no longer the pre-image alone: it is never copied as
    one (nor dropped), and replay before the removal reads it through its own chain."""
    m = make_mount(env=dict(os.environ, **HOLD))
    m.mount()
    try:
        m.sh("printf 'original\\n' > f && exec 3>>f && rm f && echo later >&3")
    finally:
        m.umount()
    evs = m.events()
    rm = next(e for e in evs if e["op"] == "unlink")
    assert "attic" in rm["pre"] and "blob" not in rm["pre"], rm
    assert any(e["op"] == "write" and e["path"] == f"{ATTIC}/{rm['pre']['attic']}"
               for e in evs), evs
    assert entries(m.ws) == [rm["pre"]["attic"]]
    got, inexact = replay_at(m, rm["seq"] - 1, tmp_path / "r")
    assert got["f"] == ("file", 0o644, b"original\n") or got["f"][2] == b"original\n", got
    assert "f" not in inexact


# -- without a mount ------------------------------------------------------------------------------

@pytest.mark.timeout(int(30 * SLOW))
def test_a_reader_that_read_the_event_before_the_copy_reads_the_store(tmp_path):
    """A reader decodes the events while the pre-image is in the attic; the daemon then copies
    it and drops the entry; the reader, finding no entry, asks the journal again."""
    from overlayrec.engines.states import States, Tree
    with plain_recorder(tmp_path) as (rec, j, ws):
        rec.later = True
        with open(os.path.join(ws, "a"), "wb") as f:
            f.write(b"the old bytes\n")
        unlink(rec, ws, "a")
        (seq, *_), = rec.to_store.values()
        assert "attic" in j.event(seq)["pre"]
        j.keep_events()  # as a listing or a diff does: the events decoded once, now
        root_fd = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            states = States(j, Tree(root_fd))
            assert rec.settle_small() == 0
            assert entries(ws) == [] and "attic" in j.event(seq)["pre"]  # as the reader kept it
            s = states.state("a", seq - 1)
            assert (s.kind, s.data, s.exact) == ("file", b"the old bytes\n", True)
            assert "blob" in j.event(seq, fresh=True)["pre"]
        finally:
            os.close(root_fd)


@pytest.mark.timeout(int(30 * SLOW))
def test_a_reclaim_never_drops_a_small_pre_image_waiting_for_the_store(tmp_path, monkeypatch):
    from overlayrec import recorder
    monkeypatch.setattr(recorder, "RECLAIM_HEADROOM", 1 << 62)  # drop all there is
    with plain_recorder(tmp_path) as (rec, j, ws):
        rec.later = True
        rec.small_preimage = 4096
        for name, size in (("small", 100), ("large", 8192)):
            with open(os.path.join(ws, name), "wb") as f:
                f.write(os.urandom(size))
        small = open(os.path.join(ws, "small"), "rb").read()
        unlink(rec, ws, "small")
        unlink(rec, ws, "large")
        assert len(entries(ws)) == 2 and len(rec.to_store) == 1
        assert rec.reclaim("test") > 0
        assert entries(ws) == list(rec.to_store)  # the large one went, the small one waits
        assert rec.settle_small() == 0 and entries(ws) == []
        pre = next(e for e in j.events() if e["op"] == "unlink" and e["path"] == "small")["pre"]
        assert j.content.get(pre["blob"]) == small


@pytest.mark.timeout(int(30 * SLOW))
def test_a_store_without_room_leaves_them_waiting_and_never_reclaimed(tmp_path, monkeypatch):
    """The copy fails for want of space (the state dir shares a full filesystem): the entries
    wait, a reclaim passes them by, and the next try copies them."""
    import errno
    from overlayrec import recorder
    monkeypatch.setattr(recorder, "RECLAIM_HEADROOM", 1 << 62)
    with plain_recorder(tmp_path) as (rec, j, ws):
        rec.later = True
        for name in ("x", "y"):
            with open(os.path.join(ws, name), "wb") as f:
                f.write(name.encode() * 100)
            unlink(rec, ws, name)
        real = rec._save_whole

        def full(fd, size):
            raise OSError(errno.ENOSPC, "No space left on device")
        rec._save_whole = full
        with pytest.raises(OSError):
            rec.settle_small()
        assert len(rec.to_store) == 2 and len(entries(ws)) == 2
        rec.reclaim("test")
        assert len(entries(ws)) == 2
        rec._save_whole = real
        assert rec.settle_small() == 0 and entries(ws) == []
        for e in j.events():
            if e["op"] == "unlink":
                assert j.content.get(e["pre"]["blob"]) == e["path"].encode() * 100


@pytest.mark.timeout(int(30 * SLOW))
@pytest.mark.parametrize("store_full", [False, True], ids=["store-has-room", "store-full"])
def test_a_full_workspace_copies_waiting_ones_before_any_entry_is_dropped(tmp_path, monkeypatch,
                                                                         store_full):
    """A change refused for want of space in the workspace: the small pre-images waiting in
    the attic go into the store first and the change is tried again, no entry dropped (a
    reclaim dropped the large entry before, or refused the change with none).  With the store
    full too, they wait and the reclaim goes on as before."""
    import errno
    from overlayrec import recorder
    monkeypatch.setattr(recorder, "RECLAIM_HEADROOM", 1 << 62)  # drop all there is
    with plain_recorder(tmp_path) as (rec, j, ws):
        rec.later = True
        rec.small_preimage = 4096
        data = {"small": b"s" * 100, "large": os.urandom(8192)}
        for name, content in data.items():
            with open(os.path.join(ws, name), "wb") as f:
                f.write(content)
            unlink(rec, ws, name)
        (small,) = rec.to_store
        (large,) = set(entries(ws)) - {small}
        real = rec._save_whole
        if store_full:
            def full(fd, size):
                raise OSError(errno.ENOSPC, "No space left on device")
            rec._save_whole = full
        tries = []

        @recorder._roomy
        def change(self):  # the workspace full while the attic holds both entries
            tries.append(len(entries(ws)))
            if len(entries(ws)) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return "made"
        assert change(rec) == "made" and tries == [2, 1]
        reclaims = [e for e in j.events() if e["op"] == "reclaim"]
        if store_full:  # the small one waits, readable; the large one went for room
            assert entries(ws) == [small] and list(rec.to_store) == [small]
            assert [e["dropped"] for e in reclaims] == [[large]]
            rec._save_whole = real
            assert rec.settle_small() == 0
        else:  # copied into the store at once: nothing dropped, the large entry kept
            assert reclaims == [] and rec.to_store == {} and entries(ws) == [large]
            assert open(os.path.join(ws, ATTIC, large), "rb").read() == data["large"]
        pres = {e["path"]: e["pre"] for e in j.events() if e["op"] == "unlink"}
        assert j.content.get(pres["small"]["blob"]) == data["small"]

@pytest.mark.timeout(int(30 * SLOW))
def test_a_file_gone_between_its_lstat_and_its_read_is_absent(tmp_path, monkeypatch):
    """The daemon drops an entry (or a process removes a file) between a reader's lstat of it
    and its read: the reader sees it absent, as it now is, and goes on (no traceback)."""
    from overlayrec.engines import states
    (tmp_path / "f").write_bytes(b"here\n")
    root_fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        tree = states.Tree(root_fd)
        assert tree.state("f").data == b"here\n"
        real = states._read_at

        def gone(dfd, name, st, *rest):
            os.unlink(name, dir_fd=dfd)
            return real(dfd, name, st, *rest)
        monkeypatch.setattr(states, "_read_at", gone)
        got, st = tree.state_stat("f")
        assert got == states.ABSENT and st is None
    finally:
        os.close(root_fd)


DEEP = "/".join(["x" * 200] * 18)  # 3,617 bytes of directories


@needs_fuse
@pytest.mark.timeout(int(180 * SLOW))
def test_waiting_pre_images_beneath_a_renamed_directory_a_long_path_and_other_kinds(
        make_mount, tmp_path):
    """Files removed at a 3,617-byte depth and in a directory renamed afterwards, beside a
    fifo, a symlink and one name of a hard-linked file removed: the small files wait in the
    attic (the linked one and the other kinds never do), and replay and revert give the tree
    the test saw, while they wait and after the unmount copied them."""
    m = make_mount()
    m.env = dict(os.environ, **HOLD)
    os.makedirs(os.path.join(m.ws, DEEP))
    os.makedirs(os.path.join(m.ws, "m"))
    for rel, data in ((f"{DEEP}/f", b"deep\n"), ("m/g", b"g\n"), ("t", b"t\n"),
                      ("h1", b"linked\n")):
        with open(os.path.join(m.ws, rel), "wb") as f:
            f.write(data)
    os.link(os.path.join(m.ws, "h1"), os.path.join(m.ws, "h2"))
    os.mkfifo(os.path.join(m.ws, "p"), 0o640)
    os.symlink("t", os.path.join(m.ws, "s"))
    before = tree_of(m.ws)
    under = underlay_of(m.ws)
    m.mount()
    try:
        run_session(m, "s", f"rm {DEEP}/f m/g; mv m m2; rm p s h1 t")
        after = tree_of(m.ws)
        evs = m.events()
        first = min(e["seq"] for e in evs if e["op"] == "unlink")
        kept = removals(evs)
        for p in (f"{DEEP}/f", "m/g", "t"):
            assert "attic" in kept[p] and "blob" not in kept[p], (p, kept[p])
        assert "blob" in kept["h1"] and "attic" not in kept["h1"]  # another name: copied now
        assert kept["p"]["kind"] == "fifo" and kept["s"]["kind"] == "symlink"
        assert len(entries(m.ws, under)) == 5  # the three files, the fifo, the symlink
        out = tmp_path / "r1"
        overlayrec("replay", m.ws, "--at", str(first - 1), "--to", str(out), "--full")
        assert tree_of(str(out)) == before
        overlayrec("revert", m.ws, "--session", "s", "--yes")
        assert tree_of(m.ws) == before
        overlayrec("unrevert", "-w", m.ws, "--yes")
        assert tree_of(m.ws) == after
    finally:
        m.umount()
        os.close(under)
    kept = removals(m.events())
    for p in (f"{DEEP}/f", "m/g", "t"):
        assert "blob" in kept[p] and "attic" not in kept[p], (p, kept[p])
    # only the fifo and the symlink stay, as they always have (removed by the session, and
    # again by the unrevert)
    left = {stat.S_IFMT(os.lstat(os.path.join(m.ws, ATTIC, n)).st_mode) for n in entries(m.ws)}
    assert left == {stat.S_IFIFO, stat.S_IFLNK}, left
    out = tmp_path / "r2"
    overlayrec("replay", m.ws, "--at", str(first - 1), "--to", str(out), "--full")
    assert tree_of(str(out)) == before
