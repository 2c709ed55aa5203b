"""The attic stays out of the user's way (issue 14).

* Unmounted, the attic ignores itself (a ``.gitignore`` of ``*`` and a ``CACHEDIR.TAG``, 0600,
  never counted as entries): ``git status`` lists nothing of overlayrec's, ``git add -A``
  commits no pre-image, and a revert still brings every file back exactly.
* Empty and small files (up to SMALL_PREIMAGE) that are unlinked or renamed over keep their
  pre-image in the content store, not in the attic: ``git status`` in a loop leaves the
  attic's entry count constant.
* A full workspace: a write refused ENOSPC makes the daemon drop attic entries (oldest first,
  logged, journaled as a ``reclaim`` marker) and the write is tried again; a revert that
  needs a dropped pre-image is refused as ``unrecorded``, saying why.

The first tests need no mount (the recorder on a plain directory); the tmpfs one needs root.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import subprocess
import time

import pytest

from conftest import SLOW, is_mounted, needs_fuse, needs_root, overlayrec

ATTIC = ".overlayrec-attic"
SIGNATURE = b"Signature: 8a477f597d28d172789f06886806bc55"
BIG = 300 << 10  # above SMALL_PREIMAGE: kept in the attic


def attic_entries(ws: str) -> list[str]:
    from overlayrec.recorder import is_attic_entry
    return sorted(n for n in os.listdir(os.path.join(ws, ATTIC)) if is_attic_entry(n))


def check_own_files(ws: str) -> None:
    """The attic's own files are there, whole, 0600."""
    d = os.path.join(ws, ATTIC)
    with open(os.path.join(d, ".gitignore"), "rb") as f:
        assert b"\n*\n" in b"\n" + f.read()
    with open(os.path.join(d, "CACHEDIR.TAG"), "rb") as f:
        assert f.read().startswith(SIGNATURE)  # the spec: the tag's first 43 bytes
    with open(os.path.join(d, "RECORD"), "rb") as f:  # whose record it is (a moved workspace)
        assert set(json.loads(f.read())) == {"journal_id", "state_dir"}
    for n in (".gitignore", "CACHEDIR.TAG", "RECORD"):
        st = os.lstat(os.path.join(d, n))
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, n


def tree_of(root: str) -> dict:
    """Every path beneath root but the attic and .git: kind, mode, content or target (a fifo
    by its kind and mode: never opened)."""
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if not (d == root and x in (ATTIC, ".git"))]
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            elif stat.S_ISFIFO(st.st_mode):
                out[rel] = ("fifo", stat.S_IMODE(st.st_mode))
            else:
                with open(p, "rb") as f:
                    out[rel] = ("file", stat.S_IMODE(st.st_mode), f.read())
    return out


def git(ws: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.org",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.org",
               GIT_CONFIG_NOSYSTEM="1", HOME=ws + "/..")
    r = subprocess.run(["git", "-c", "init.defaultBranch=main", *args], cwd=ws,
                       capture_output=True, text=True, env=env, timeout=60 * SLOW)
    if check and r.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed ({r.returncode}):\n{r.stderr}")
    return r


def run_session(m, session: str, script: str) -> None:
    overlayrec("run", "-w", m.ws, "--session", session, "--", "bash", "-ec", script, cwd=m.ws)


@contextlib.contextmanager
def plain_recorder(tmp_path):
    """A Recorder over a plain directory (no mount), its journal, and the workspace path."""
    from overlayrec.attribution import Attribution
    from overlayrec.journal import Journal
    from overlayrec.recorder import Recorder
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    j = Journal(str(tmp_path / "state"))
    root_fd = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        rec = Recorder(j, root_fd, Attribution())
        yield rec, j, str(ws)
    finally:
        os.close(root_fd)
        j.close()


def unlink(rec, ws: str, name: str) -> None:
    dfd = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        rec.unlink(dfd, name, rec.attribution.actor(os.getpid()))
    finally:
        os.close(dfd)


# -- without a mount ------------------------------------------------------------------------------

@pytest.mark.timeout(int(30 * SLOW))
def test_the_attic_ignores_itself_and_its_own_files_are_no_entries(tmp_path, monkeypatch):
    from overlayrec import recorder
    monkeypatch.setattr(recorder, "RECLAIM_HEADROOM", 1 << 62)  # drop all there is
    ws = tmp_path / "ws"
    (ws / ATTIC).mkdir(parents=True)
    (ws / ATTIC / ".gitignore").write_bytes(b"not what overlayrec writes\n")  # an old one
    os.chmod(ws / ATTIC / ".gitignore", 0o644)
    with plain_recorder(tmp_path) as (rec, j, w):
        check_own_files(w)
        assert rec.attic_links == {}  # the own files are no attic entries
        (ws / "big").write_bytes(os.urandom(BIG))
        (ws / "small").write_bytes(b"small\n")
        unlink(rec, w, "big")
        unlink(rec, w, "small")
        assert len(rec.attic_links) == 1 and attic_entries(w) == [rec.attic_prefix + "1"]
    before = {n: (ws / ATTIC / n).read_bytes() for n in (".gitignore", "CACHEDIR.TAG")}
    with plain_recorder(tmp_path) as (rec, j, w):  # opened again: the same, counted the same
        check_own_files(w)
        assert {n: (ws / ATTIC / n).read_bytes() for n in before} == before
        assert len(rec.attic_links) == 1
        assert sorted(os.listdir(ws / ATTIC)) == sorted([".gitignore", "CACHEDIR.TAG",
                                                         "RECORD", rec.attic_prefix + "1"])
        # a reclaim never takes them either
        assert rec.reclaim("test") > 0
        assert sorted(os.listdir(ws / ATTIC)) == [".gitignore", "CACHEDIR.TAG", "RECORD"]


@pytest.mark.timeout(int(30 * SLOW))
def test_small_and_empty_files_go_to_the_content_store_not_the_attic(tmp_path):
    from overlayrec.engines.states import States, Tree
    from overlayrec.recorder import SMALL_PREIMAGE
    ws = tmp_path / "ws"
    ws.mkdir()
    files = {"empty": b"", "small": b"x" * 100, "edge": os.urandom(SMALL_PREIMAGE),
             "big": os.urandom(SMALL_PREIMAGE + 1), "over": b"renamed over\n",
             "src": b"the new one\n"}
    for n, data in files.items():
        (ws / n).write_bytes(data)
    with plain_recorder(tmp_path) as (rec, j, w):
        actor = rec.attribution.actor(os.getpid())
        held = os.open(ws / "small", os.O_RDWR | os.O_CLOEXEC)  # open across its unlink
        for n in ("empty", "small", "edge", "big"):
            unlink(rec, w, n)
        try:  # really unlinked, so no name of the workspace's is its name any more
            assert os.fstat(held).st_nlink == 0 and rec.rel(held).startswith(ATTIC + "/")
        finally:
            os.close(held)
        dfd = os.open(w, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            rec.rename(dfd, "src", dfd, "over", 0, actor)
        finally:
            os.close(dfd)
        evs = {(e["op"], e["path"]): e for e in j.events()}
        for n in ("empty", "small", "edge"):
            pre = evs[("unlink", n)]["pre"]
            assert "attic" not in pre and j.content.get(pre["blob"]) == files[n], n
            assert not (ws / n).exists()
        assert "attic" in evs[("unlink", "big")]["pre"]
        pre2 = evs[("rename", "src")]["pre2"]
        assert "attic" not in pre2 and j.content.get(pre2["blob"]) == files["over"]
        assert attic_entries(w) == [evs[("unlink", "big")]["pre"]["attic"]]
        assert len(rec.attic_links) == 1
        # every reader gets each pre-image back exactly
        states = States(j, Tree(rec.root_fd))
        for n in ("empty", "small", "edge", "big"):
            s = states.state(n, evs[("unlink", n)]["seq"] - 1)
            assert s.exact and s.data == files[n], n
        s = states.state("over", evs[("rename", "src")]["seq"] - 1)
        assert s.exact and s.data == files["over"]


@pytest.mark.timeout(int(30 * SLOW))
def test_a_full_state_dir_elsewhere_drops_nothing_and_a_reclaim_is_journaled_late(
        tmp_path, monkeypatch):
    """ENOSPC from the journal drops attic entries only when the state dir shares the
    workspace's filesystem; a reclaim the full journal cannot take goes with the next event;
    the dropped pre-image then reads inexact, and a revert is refused saying why."""
    from overlayrec.engines.revert import make_plan
    from overlayrec.engines.states import States, Tree
    from overlayrec import recorder
    from overlayrec.journal import JournalError
    monkeypatch.setattr(recorder, "RECLAIM_HEADROOM", 1 << 62)  # drop all there is
    ws = tmp_path / "ws"
    ws.mkdir()
    data = os.urandom(BIG)
    (ws / "big").write_bytes(data)
    with plain_recorder(tmp_path) as (rec, j, w):
        actor = rec.attribution.actor(os.getpid())
        unlink(rec, w, "big")
        [kept] = attic_entries(w)
        real = j._write

        def full(body):  # every commit refused, as by a full filesystem
            raise JournalError("journal write failed: no space", errno.ENOSPC)
        dfd = os.open(w, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            monkeypatch.setattr(j, "_write", full)
            monkeypatch.setattr(rec, "_shares_fs", lambda: False)
            with pytest.raises(JournalError):
                rec.mkdir(dfd, "d", 0o755, os.getuid(), os.getgid(), actor)
            assert attic_entries(w) == [kept]  # another filesystem's fullness: kept

            monkeypatch.setattr(rec, "_shares_fs", lambda: True)
            with pytest.raises(JournalError):  # still full after the reclaim: refused
                rec.mkdir(dfd, "d", 0o755, os.getuid(), os.getgid(), actor)
            assert attic_entries(w) == [] and not (ws / "d").exists()

            monkeypatch.setattr(j, "_write", real)  # room again
            rec.mkdir(dfd, "d", 0o755, os.getuid(), os.getgid(), actor)
        finally:
            os.close(dfd)
        evs = list(j.events())
        [marker] = [e for e in evs if e["op"] == "reclaim"]
        assert marker["dropped"] == [kept] and marker["cause"] == "ENOSPC"
        assert marker["seq"] < [e for e in evs if e["op"] == "mkdir"][0]["seq"]
        u = [e for e in evs if e["op"] == "unlink"][0]
        states = States(j, Tree(rec.root_fd))
        s = states.state("big", u["seq"] - 1)
        assert s.kind == "file" and not s.exact and s.data != data  # never invented
        plan = make_plan(j, states, Tree(rec.root_fd), {"since": 0})
        [step] = [s for s in plan.steps if s.path == "big"]
        assert step.conflict == "unrecorded" and "free space" in (step.note or "")


# -- through the mount ----------------------------------------------------------------------------

def seeded_repo(make_mount, files: dict):
    m = make_mount()
    for p, data in files.items():
        full = os.path.join(m.ws, p)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)
    git(m.ws, "init", "-q")
    git(m.ws, "add", "-A")
    git(m.ws, "commit", "-q", "-m", "first")
    return m


@needs_fuse
@pytest.mark.timeout(int(180 * SLOW))
def test_unmounted_git_sees_nothing_of_overlayrec_and_revert_is_exact(make_mount):
    files = {"small.txt": b"small\n", "empty": b"", "big.bin": os.urandom(BIG),
             "big2.bin": os.urandom(BIG), "a.txt": b"a\n", "b.txt": b"b\n",
             "src/mod.py": b"x = 1\n", "dir/inner": b"inner\n"}
    m = seeded_repo(make_mount, files)
    before = tree_of(m.ws)
    m.mount()
    try:
        run_session(m, "s", "rm small.txt empty big.bin; mv a.txt b.txt; "
                    "head -c 400000 /dev/urandom > new.bin; mv new.bin big2.bin; "
                    "sed -i s/1/2/ src/mod.py; rm -r dir; echo fresh > fresh.txt")
    finally:
        m.umount()
    assert not is_mounted(m.ws)
    evs = m.events()  # the small pre-images went into the store by the unmount at the latest
    kept = {e["path2"] if e["op"] == "rename" else e["path"]: (e.get("pre2") if e["op"] ==
            "rename" else e.get("pre")) for e in evs if e["op"] in ("unlink", "rename")}
    assert {p for p, pre in kept.items() if pre and "attic" in pre} == {"big.bin", "big2.bin"}
    for p in ("small.txt", "empty", "b.txt", "src/mod.py", "dir/inner"):
        assert "blob" in kept[p] and "attic" not in kept[p], p
    assert len(attic_entries(m.ws)) == 2
    check_own_files(m.ws)

    status = git(m.ws, "status", "--porcelain", "--untracked-files=all").stdout
    assert status.strip() and "overlayrec" not in status, status  # the session's own changes
    git(m.ws, "add", "-A")
    git(m.ws, "commit", "-q", "-m", "after the session")
    listed = git(m.ws, "ls-files").stdout.split()
    assert not [p for p in listed if p.startswith(ATTIC)], listed
    tree = git(m.ws, "ls-tree", "-r", "--name-only", "HEAD").stdout
    assert ATTIC not in tree and "fresh.txt" in tree

    m.mount()
    try:
        overlayrec("revert", m.ws, "--session", "s", "--yes")
        assert tree_of(m.ws) == before
    finally:
        m.umount()
    check_own_files(m.ws)


@needs_fuse
@pytest.mark.timeout(int(300 * SLOW))
def test_git_status_in_a_loop_leaves_the_attic_as_it_was(make_mount):
    """``git status`` 1,000 times while recording (about 25 s here): each takes and drops an
    empty ``.git/index.lock`` (and may rename a new index over the old one), none of which
    costs an attic entry."""
    m = seeded_repo(make_mount, {f"f{i}.txt": b"%d\n" % i for i in range(20)})
    m.mount()
    try:
        m.sh("git status --porcelain > /dev/null")
    finally:
        m.umount()
    first = attic_entries(m.ws)
    m.mount()
    try:
        t0 = time.monotonic()
        subprocess.run(["bash", "-ec", "echo changed >> f1.txt; for i in $(seq 1000); do "
                        "git status --porcelain > /dev/null; done"], cwd=m.ws, check=True,
                       timeout=240 * SLOW)
        took = time.monotonic() - t0
    finally:
        m.umount()
    evs = m.events()  # the index renamed over went into the store by the unmount at the latest
    assert attic_entries(m.ws) == first, (len(first), len(attic_entries(m.ws)), took)
    locks = [e for e in evs if e.get("path") == ".git/index.lock" and e["op"] == "unlink"]
    assert locks and all("attic" not in e["pre"] for e in locks)
    assert not [e for e in evs if "attic" in (e.get("pre") or {}) or
                "attic" in (e.get("pre2") or {})]


@contextlib.contextmanager
def tmpfs(path: str, size: str):
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", path],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


@needs_fuse
@needs_root
@pytest.mark.timeout(int(180 * SLOW))
def test_a_full_workspace_frees_the_attic_and_the_next_write_succeeds(make_mount):
    m = make_mount()
    dropped = None
    with tmpfs(os.path.join(m.base, "wsfs"), "16m") as wsfs:
        m.ws = os.path.join(wsfs, "ws")
        os.mkdir(m.ws)
        try:
            m.mount()
            # fill the workspace through the mount (dd stops at ENOSPC)
            run_session(m, "fill", "dd if=/dev/zero of=big bs=1M 2>/dev/null || true")
            assert os.path.getsize(os.path.join(m.ws, "big")) > 8 << 20
            r = m.sh("head -c 1048576 /dev/zero > probe", check=False)
            assert r.returncode != 0 and "No space left" in r.stderr, r  # full indeed
            run_session(m, "s", "rm big")  # into the attic: frees nothing yet
            m.sh("rm -f probe; head -c 2097152 /dev/urandom > after")  # room is made
            assert os.path.getsize(os.path.join(m.ws, "after")) == 2 << 20
            evs = m.events()
            [unl] = [e for e in evs if e["op"] == "unlink" and e["path"] == "big"]
            dropped = unl["pre"]["attic"]
            marks = [e for e in evs if e["op"] == "reclaim"]
            assert marks and dropped in marks[0]["dropped"], marks

            r = overlayrec("revert", m.ws, "--session", "s", "--yes", check=False)
            assert r.returncode != 0, r.stdout
            said = r.stdout + r.stderr
            assert "unrecorded" in said and "dropped to free space" in said, said
            assert not os.path.exists(os.path.join(m.ws, "big"))  # nothing written

            assert is_mounted(m.ws)  # the mount lives and records
            m.sh("echo alive > alive")
            assert "alive" in {e.get("path") for e in m.events()}
        finally:
            m.umount()
        log = open(os.path.join(m.state, "daemon.log"), errors="replace").read()
        assert f"dropped attic entry {dropped}" in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        assert not is_mounted(m.ws)


@needs_fuse
@pytest.mark.timeout(int(120 * SLOW))
def test_a_linked_entry_written_through_its_other_name_is_not_exact_any_more(make_mount,
                                                                             tmp_path):
    """Found by the history model with every file kept as a large one: ``a`` and ``b`` are one
    inode past the whole-file limit (not copied when a name leaves it); ``b`` is removed, so its
    attic entry shares the inode with ``a``, and then ``a`` is appended to.  Replay before the
    removal gave ``b`` the appended content, marked exact.  Before the append, the entry is
    still what ``b`` held: exact.  After it, what ``b`` held is what ``a`` held then (the
    append's pre-image: its length before), exact too (it was given as inexact)."""
    m = make_mount(env=dict(os.environ, OVERLAYREC_TEST_WHOLE_FILE_LIMIT="8",
                            OVERLAYREC_TEST_SMALL_PREIMAGE="-1"))  # as a file of 4 MiB and more
    m.mount()
    m.sh("printf 'one two three four\\n' > a && ln a b && rm b")
    seq_rm = max(e["seq"] for e in m.events() if e["op"] == "unlink")
    pre = next(e for e in m.events() if e["op"] == "unlink")["pre"]
    assert "attic" in pre and "blob" not in pre, pre  # this test's case: the attic shares it

    def replay_b(out):
        js = json.loads(overlayrec("replay", m.ws, "--at", str(seq_rm - 1), "--to",
                                   str(tmp_path / out), "--json").stdout)
        return (tmp_path / out / "b").read_bytes(), "b" in js["inexact"]
    assert replay_b("r1") == (b"one two three four\n", False)
    m.sh("echo five >> a")
    # the attic's copy changed with a: never taken as it is now, but from a's own chain
    assert replay_b("r2") == (b"one two three four\n", False)


@needs_fuse
@pytest.mark.timeout(int(120 * SLOW))
def test_a_write_through_a_descriptor_left_open_is_not_what_the_name_held(make_mount,
                                                                          tmp_path):
    """A process holds ``f`` open, ``f`` is removed (its inode goes to the attic: a file past
    SMALL_PREIMAGE), then the process writes through its descriptor: an event on the attic's
    path.  Replay before the removal read the entry as it is now and gave ``f`` the later
    write, marked exact; it is the entry as the removal left it."""
    m = make_mount(env=dict(os.environ, OVERLAYREC_TEST_SMALL_PREIMAGE="-1"))
    m.mount()
    m.sh("printf 'original\\n' > f && exec 3>>f && rm f && echo later >&3")
    evs = m.events()
    rm = next(e for e in evs if e["op"] == "unlink")
    assert "attic" in rm["pre"], rm  # this test's case
    assert any(e["op"] == "write" and e["path"].startswith(ATTIC) for e in evs), evs
    js = json.loads(overlayrec("replay", m.ws, "--at", str(rm["seq"] - 1), "--to",
                               str(tmp_path / "r"), "--json").stdout)
    assert (tmp_path / "r" / "f").read_bytes() == b"original\n" and "f" not in js["inexact"]


@needs_fuse
@pytest.mark.timeout(int(120 * SLOW))
@pytest.mark.parametrize("sub", ["", "/".join(["x" * 200] * 19)], ids=["top", "path-3800"])
def test_a_file_renamed_over_while_held_open_is_changed_in_the_attic(make_mount, tmp_path, sub):
    """Found by test_open_handles with every pre-image in the attic: a process holds ``a``
    open, ``c`` is renamed over ``a`` (the old inode is linked into the attic first, so the
    descriptor's name reads "a (deleted)"), then the process truncates and writes through its
    descriptor.  Those were journaled as changes of ``a``, the name another file holds now:
    replay before the rename gave ``a`` the later content.  They are changes of the attic's
    entry."""
    m = make_mount(env=dict(os.environ, OVERLAYREC_TEST_SMALL_PREIMAGE="-1"))
    m.mount()
    m.py("import os\n"
         f"os.makedirs({sub!r} or '.', exist_ok=True); d = os.open({sub!r} or '.', os.O_PATH)\n"
         "def at(n, fl): return os.open(n, fl | os.O_CREAT, 0o644, dir_fd=d)\n"
         "os.write(at('a', os.O_WRONLY), b'old\\n'); os.write(at('c', os.O_WRONLY), b'new\\n')\n"
         "fd = at('a', os.O_WRONLY | os.O_APPEND)\n"
         "os.rename('c', 'a', src_dir_fd=d, dst_dir_fd=d); os.ftruncate(fd, 2)\n"
         "os.write(fd, b'xy')\n")
    a = f"{sub}/a" if sub else "a"
    evs = m.events()
    rn = next(e for e in evs if e["op"] == "rename")
    later = [(e["op"], e["path"]) for e in evs if e["seq"] > rn["seq"]]
    assert later == [("truncate", f"{ATTIC}/{rn['pre2']['attic']}"),
                     ("write", f"{ATTIC}/{rn['pre2']['attic']}")], later
    js = json.loads(overlayrec("replay", m.ws, "--at", str(rn["seq"] - 1), "--to",
                               str(tmp_path / "r"), "--json").stdout)
    assert (tmp_path / "r" / a).read_bytes() == b"old\n" and a not in js["inexact"]
    fd = os.open(m.ws, os.O_PATH)
    try:  # read relative to the workspace: its absolute path may pass PATH_MAX
        with open(os.open(a, os.O_RDONLY, dir_fd=fd), "rb") as f:
            assert f.read() == b"new\n"
    finally:
        os.close(fd)


@needs_fuse
@pytest.mark.timeout(int(120 * SLOW))
def test_a_linked_symlink_renamed_over_is_changed_under_its_other_name(make_mount, tmp_path):
    """Found by a wide run of the random operations (seed 201): ``a/y`` is a symlink with a
    second name (a hard link of the symlink itself, ``a/s/x``), a file is renamed over ``a/y``
    (the symlink lives on in the attic and as ``a/s/x``), then a link is made from ``a/s/x`` and
    its times are set.  The daemon reaches the symlink by the descriptor it opened for ``a/y``,
    whose name reads "a/y (deleted)": only a regular file's lost name was looked past, so both
    changes were journaled on ``a/y``, which the renamed file held, and replay before them made
    ``a/y`` the symlink.  Every reader agrees with the snapshots taken here."""
    m = make_mount()
    m.mount()
    m.py("import os\n"
         "os.makedirs('a/s'); os.makedirs('c'); os.symlink('c/x', 'a/y')\n"
         "os.link('a/y', 'a/s/x', follow_symlinks=False)\n"
         "open('c/y', 'w').write('moved\\n'); os.rename('c/y', 'a/y')\n")
    before = tree_of(m.ws)
    point = max(e["seq"] for e in m.events())
    m.py("import os\n"
         "os.link('a/s/x', 'b', follow_symlinks=False)\n"
         "os.utime('a/s/x', (1e9, 1e9), follow_symlinks=False)\n")
    after = tree_of(m.ws)
    assert after["b"] == after["a/s/x"] == ("link", "c/x") and before["a/y"][0] == "file"
    later = [e for e in m.events() if e["seq"] > point]
    assert later and all(e.get("path") != "a/y" and e.get("source") != "a/y" for e in later), \
        later
    m.umount()
    for at, want in ((str(point), before), ("end", after)):
        out = tmp_path / f"at-{at}"
        js = json.loads(overlayrec("replay", m.ws, "--state-dir", m.state, "--at", at, "--full",
                                   "--to", str(out), "--json").stdout)
        assert tree_of(str(out)) == want and not js["inexact"], (at, js)
    r = overlayrec("check", m.ws, "--state-dir", m.state, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_fuse
@pytest.mark.timeout(int(120 * SLOW))
def test_a_removed_directory_changed_through_a_descriptor_is_not_its_successor(make_mount,
                                                                               tmp_path):
    """A process holds directory ``d`` open, ``d`` is removed and a new ``d`` made, then the
    process changes the removed one's mode through its descriptor.  The daemon's name for the
    old directory reads "d (deleted)": the chmod was journaled on ``d``, the new directory,
    whose mode the record then gave wrongly.  It changes no path; and a directory whose own
    name ends in " (deleted)" is still named by it."""
    m = make_mount()
    m.mount()
    m.py("import os\n"
         "os.mkdir('d', 0o755); fd = os.open('d', os.O_RDONLY | os.O_DIRECTORY)\n"
         "os.rmdir('d'); os.mkdir('d', 0o755); os.fchmod(fd, 0o700); os.close(fd)\n"
         "os.mkdir('e (deleted)', 0o755); os.chmod('e (deleted)', 0o750)\n")
    want = tree_of(m.ws)
    assert want["d"] == ("dir", 0o755) and want["e (deleted)"] == ("dir", 0o750), want
    chmods = [e["path"] for e in m.events() if e["op"] == "chmod"]
    assert len(chmods) == 2 and chmods[0].startswith(ATTIC + "/") and \
        chmods[1] == "e (deleted)", chmods
    m.umount()
    out = tmp_path / "end"
    overlayrec("replay", m.ws, "--state-dir", m.state, "--full", "--to", str(out))
    assert tree_of(str(out)) == want


@needs_fuse
@needs_root
@pytest.mark.timeout(int(180 * SLOW))
def test_a_filesystem_mounted_inside_the_workspace_is_recorded_without_an_attic(make_mount,
                                                                                tmp_path):
    """A directory of the workspace that is another filesystem (a tmpfs for a cache, a bind
    mount in a container): the attic cannot take its files (a rename or a link across
    filesystems fails), so an unlink and a rename over copy the content first, whatever its
    size.  Found by hand: `rm sub/f` and `mv` out of it failed with EXDEV through the mount,
    the user's workspace broken.  Every call's revert then puts back the tree before it."""
    m = make_mount()
    sub = os.path.join(m.ws, "sub")
    with tmpfs(sub, "64m"):
        try:
            for name, data in (("a.txt", b"a\n"), ("b.txt", b"b\n"),
                               ("big.bin", os.urandom(5 << 20))):
                with open(os.path.join(sub, name), "wb") as f:
                    f.write(data)
            with open(os.path.join(m.ws, "top.txt"), "w") as f:
                f.write("top\n")
            m.mount()
            trees = [tree_of(m.ws)]
            for i, script in enumerate([
                    "echo more >> sub/a.txt && rm sub/b.txt && echo new > sub/new.txt",
                    "mv sub/a.txt moved.txt && mv top.txt sub/top.txt",
                    "sed -i s/new/NEW/ sub/new.txt && mkdir sub/d && echo x > sub/d/x && "
                    "mv sub/d sub/e",
                    "head -c 100 /dev/zero > sub/big2 && mv sub/big2 sub/big.bin && "
                    "rm -r sub/e"], 1):
                run_session(m, f"s{i}", script)
                trees.append(tree_of(m.ws))
            assert len({repr(t) for t in trees}) == 5
            for i in (4, 3, 2, 1):
                overlayrec("revert", m.ws, "--session", f"s{i}", "--yes")
                assert tree_of(m.ws) == trees[i - 1], i
            for i in (1, 2, 3, 4):
                overlayrec("unrevert", "-w", m.ws, "--yes")
                assert tree_of(m.ws) == trees[i], i
        finally:
            m.umount()


@needs_fuse
@pytest.mark.parametrize("what", ["notes", "record"])
def test_a_directory_of_the_attics_name_the_user_made_is_not_taken_over(tmp_path, what):
    """A workspace holding a directory named as the attic that overlayrec never made (no
    record's note in it, files of the user's): the mount took it as the attic without a word,
    wrote its own .gitignore and RECORD over the user's and hid the directory from every
    reader.  The mount refuses, naming it, and leaves it as it was."""
    ws = tmp_path / "ws"
    own = ws / ATTIC
    own.mkdir(parents=True)
    (own / ".gitignore").write_text("build/\n")
    if what == "notes":
        (own / "notes.txt").write_text("my notes\n")
    else:
        (own / "RECORD").write_text("my record keeping\n")
    before = {p.name: p.read_bytes() for p in own.iterdir()}
    r = overlayrec("mount", str(ws), "--state-dir", str(tmp_path / "state"), check=False)
    try:
        assert r.returncode != 0 and "not overlayrec's attic" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
        assert not is_mounted(str(ws))
    finally:
        if is_mounted(str(ws)):
            overlayrec("umount", str(ws), check=False)
    assert {p.name: p.read_bytes() for p in own.iterdir()} == before
    # an attic overlayrec made (empty here: no entry yet) mounts again, by any state dir
    os.rename(own, tmp_path / "theirs")
    for state in ("state", "state2", "state"):
        overlayrec("mount", str(ws), "--state-dir", str(tmp_path / state))
        subprocess.run(["bash", "-c", f"cd {ws} && seq 100000 > big && rm big"], check=True)
        overlayrec("umount", str(ws))
    names = set(os.listdir(own))
    assert {".gitignore", "CACHEDIR.TAG", "RECORD"} < names  # and the removed files' entries


@needs_fuse
def test_show_of_a_removal_whose_pre_image_is_gone_says_so(make_mount):
    """The attic entry of a removed file lost (removed by hand): `show` of the removal gave
    the patch of an empty file's deletion, exit 0, nothing said, where diff says the content
    is not known exactly (found by a hunt)."""
    m = make_mount()
    with open(os.path.join(m.ws, "huge.bin"), "wb") as f:
        f.write(os.urandom(1_000_000))
    m.mount()
    overlayrec("run", "-w", m.ws, "--session", "s", "--", "rm", "huge.bin", cwd=m.ws)
    m.umount()
    attic = os.path.join(m.ws, ATTIC)
    for n in os.listdir(attic):
        if not n.startswith(".") and n not in ("RECORD", "CACHEDIR.TAG"):
            os.unlink(os.path.join(attic, n))
    seq = [e["seq"] for e in m.events() if e["op"] == "unlink"][0]
    r = overlayrec("show", "-w", m.ws, "--state-dir", m.state, str(seq))
    assert "not known exactly" in r.stderr and "huge.bin" in r.stderr, r.stderr
    out = json.loads(overlayrec("show", "-w", m.ws, "--state-dir", m.state, str(seq),
                                "--json").stdout)
    assert out["inexact"] == ["huge.bin"], out


@needs_fuse
@needs_root
def test_an_attic_another_user_made_is_refused(tmp_path):
    """A workspace others may write (a shared 1777 directory): another user made the attic
    before the first mount, and the mount took it; that user then swapped a kept pre-image,
    `check` said the record was whole, and a revert wrote their bytes back.  Found by a bug
    hunt.  The mount refuses an attic of another owner, and makes its own 0700 again."""
    ws = tmp_path / "ws"
    (ws / ATTIC).mkdir(parents=True)
    os.chmod(ws / ATTIC, 0o777)
    os.chown(ws / ATTIC, 4242, 4242)
    r = overlayrec("mount", str(ws), "--state-dir", str(tmp_path / "state"), check=False)
    try:
        assert r.returncode != 0 and "belongs to uid 4242, not to this user" in r.stderr, \
            r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
        assert not is_mounted(str(ws))
    finally:
        if is_mounted(str(ws)):
            overlayrec("umount", str(ws), check=False)
    os.chown(ws / ATTIC, os.geteuid(), os.getegid())  # ours, but left loose
    overlayrec("mount", str(ws), "--state-dir", str(tmp_path / "state"))
    overlayrec("umount", str(ws))
    assert stat.S_IMODE(os.lstat(ws / ATTIC).st_mode) == 0o700  # (hidden while mounted)


@needs_fuse
@needs_root
def test_a_bind_mount_beneath_the_workspace_keeps_its_files_in_the_store(make_mount, tmp_path):
    """A bind mount of the workspace's own filesystem beneath it has the attic's ``st_dev``:
    the attic's rename or link met EXDEV, so `rm` of any file there and `mv` over a large one
    failed through the mount (natively they succeed), and the revert could not remove a file
    the session made (found by a bug hunt).  Such a directory is found by that EXDEV once, and
    what leaves it goes into the content store; replay and revert give back the tree before."""
    from test_replay import tree_of
    m = make_mount()
    elsewhere = os.path.join(m.base, "elsewhere")
    os.makedirs(elsewhere)
    with open(os.path.join(elsewhere, "small"), "w") as f:
        f.write("small\n")
    with open(os.path.join(elsewhere, "big"), "wb") as f:
        f.write(os.urandom(5 << 20))  # past the whole-file limit
    with open(os.path.join(elsewhere, "mid"), "wb") as f:
        f.write(os.urandom(BIG))
    os.link(os.path.join(elsewhere, "mid"), os.path.join(elsewhere, "mid2"))  # a hard link
    os.symlink("small", os.path.join(elsewhere, "link"))
    os.makedirs(os.path.join(elsewhere, "deep", "er"))
    with open(os.path.join(elsewhere, "deep", "er", "x"), "w") as f:
        f.write("x\n")
    sub = os.path.join(m.ws, "sub")
    os.mkdir(sub)
    subprocess.run(["mount", "--bind", elsewhere, sub], check=True)
    try:
        assert os.stat(sub).st_dev == os.stat(m.ws).st_dev  # st_dev cannot tell it
        before = tree_of(m.ws)
        m.mount()
        r = overlayrec("run", "-w", m.ws, "--session", "s", "--", "bash", "-c",
                       "rm sub/small && rm sub/mid && echo x > sub/newf && mv sub/newf sub/big "
                       "&& echo y > sub/other && rm sub/link sub/mid2 && mv sub/deep sub/moved "
                       "&& echo z >> sub/moved/er/x", cwd=m.ws, check=False)
        assert r.returncode == 0, r.stderr
        after = tree_of(m.ws)
        assert set(after) - set(before) == {"sub/other", "sub/moved", "sub/moved/er",
                                            "sub/moved/er/x"}
        assert "sub/small" not in after and "sub/link" not in after
        m.umount()
        assert "record whole" in overlayrec("check", m.ws, "--state-dir", m.state).stdout
        dest = tmp_path / "then"
        overlayrec("replay", m.ws, "--state-dir", m.state, "--at", "before:session:s",
                   "--to", str(dest), "--full")
        assert tree_of(str(dest)) == before
        m.mount()
        overlayrec("revert", m.ws, "--session", "s", "--yes")
        assert tree_of(m.ws) == before
    finally:
        m.umount()
        subprocess.run(["umount", "-l", sub], check=False)
