"""Invariant 7: the state dir is the user's alone (docs/storage.md).

Directories 0700 and files 0600 whatever the umask (the daemon serves with umask 0); another
user can write nothing there; a state dir or registry another user could change is refused by
every command; a blob changed on disk is refused before it reaches a workspace or a replay; and
a pid read from daemon.json is verified before anything signals it.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time

import lmdb
import pytest
import xxhash

from conftest import HAVE_FUSE, SLOW, is_mounted, needs_fuse, needs_root, overlayrec
from overlayrec import state
from overlayrec.journal import ContentStore
from overlayrec.journal.content import BlobError

NOBODY = 65534

CALL = """
import subprocess, sys
from overlayrec import client
with client.connect() as c:
    c.call_begin(sys.argv[1], "Bash")
    subprocess.run(["bash", "-c", sys.argv[2]], check=True)
    c.call_end(sys.argv[1])
"""


def one_line_error(r, *needles):
    assert r.returncode != 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("overlayrec: error: "), lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


class Session:
    """A workspace and an existing 0755 --state-dir (the reported case), with a registry of its
    own ($XDG_STATE_HOME in the test's directory), every command run with that environment."""

    def __init__(self, base: str):
        self.base = base
        self.ws = os.path.join(base, "ws")
        self.sd = os.path.join(base, "state")
        self.xdg = os.path.join(base, "xdg")
        os.makedirs(self.ws)
        os.mkdir(self.sd)
        os.chmod(self.sd, 0o755)
        self.env = dict(os.environ, XDG_STATE_HOME=self.xdg)

    def run(self, *args, check=True, **kw):
        return overlayrec(*args, check=check, env=self.env, **kw)

    def mount(self):
        self.run("mount", self.ws, "--state-dir", self.sd)
        assert is_mounted(self.ws)
        return self

    def umount(self):
        if is_mounted(self.ws):
            self.run("umount", self.ws, check=False)
        for _ in range(3):
            if not is_mounted(self.ws):
                break
            subprocess.run(["fusermount3", "-u", "-z", self.ws], capture_output=True)
            time.sleep(0.1)

    def call(self, call_id: str, script: str):
        """``script`` run by bash as the announced call ``call_id`` (joining the mount)."""
        prog = os.path.join(self.base, "call.py")
        with open(prog, "w") as f:
            f.write(CALL)
        self.run("run", "-w", self.ws, "--session", f"s-{call_id}", "--", sys.executable, prog,
                 call_id, script, cwd=self.ws)

    def sh(self, script: str):
        r = subprocess.run(["bash", "-ec", script], cwd=self.ws, capture_output=True, text=True,
                           timeout=60 * SLOW)
        assert r.returncode == 0, r.stderr
        return r

    def daemon(self) -> dict:
        with open(os.path.join(self.sd, "daemon.json")) as f:
            return json.load(f)

    def registry(self) -> str:
        return os.path.join(self.xdg, "overlayrec", "mounts", state.workspace_id(self.ws) + ".json")


@pytest.fixture
def session(tmpbase):
    if not HAVE_FUSE:
        pytest.skip("needs /dev/fuse")
    s = Session(os.path.join(tmpbase, "s"))
    try:
        yield s
    finally:
        s.umount()


def record(s: Session, umask: int | None = None) -> None:
    """A recorded session: files made, overwritten, removed; a revert; an export; unmounted."""
    with open(os.path.join(s.ws, "old.txt"), "w") as f:
        f.write("old content\n")
    old = os.umask(umask) if umask is not None else None
    try:
        s.mount()
        st = os.stat(os.path.join(s.sd, "control.sock"))
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.join(s.sd, "daemon.json")).st_mode) == 0o600
        s.call("c1", "mkdir -p d/e && echo one > d/e/f && printf 'new\\n' > old.txt && "
               "echo x > gone && rm gone")
        s.call("c2", "echo two > d/h && printf 'newer\\n' > old.txt && mv d/e/f d/g")
        s.run("revert", s.ws, "--call", "c2", "--yes")
        assert open(os.path.join(s.ws, "old.txt")).read() == "new\n"
        s.run("export", "git", s.ws)
        s.run("umount", s.ws)
    finally:
        if old is not None:
            os.umask(old)


def walk(top: str):
    """(path, lstat) of ``top`` and everything beneath it."""
    yield top, os.lstat(top)
    for root, dirs, files in os.walk(top):
        for n in dirs + files:
            p = os.path.join(root, n)
            yield p, os.lstat(p)


# -- modes ----------------------------------------------------------------------------------------

@needs_fuse
def test_everything_kept_is_0700_or_0600_under_umask_000(session):
    s = session
    record(s, umask=0)
    seen = {"dir": 0, "file": 0}
    for p, st in walk(s.sd):
        rel = os.path.relpath(p, s.sd)
        mode = stat.S_IMODE(st.st_mode)
        assert st.st_uid == os.geteuid(), rel
        if stat.S_ISDIR(st.st_mode):
            assert mode == 0o700, (rel, oct(mode))
            seen["dir"] += 1
        elif rel.split(os.sep)[0] == "git":
            # git makes its own files (objects read-only): for the user alone all the same
            assert stat.S_ISREG(st.st_mode) and not mode & 0o077, (rel, oct(mode))
        else:
            assert stat.S_ISREG(st.st_mode) and mode == 0o600, (rel, oct(mode))
            seen["file"] += 1
    names = {os.path.relpath(p, s.sd) for p, _ in walk(s.sd)}
    # the walk saw what it is about: the journal, blobs, a revert plan, an export state file
    assert {"journal/data.mdb", "content/tmp", "reverts", "daemon.log"} <= names
    assert any(n.startswith("export-") for n in names)
    assert any(n.startswith("reverts/") and n.endswith(".json") for n in names)
    assert sum(1 for n in names if n.startswith("content/") and n.count("/") == 2
               and not n.startswith("content/tmp/")) >= 2
    for p, st in walk(os.path.join(s.xdg, "overlayrec")):
        want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
        assert stat.S_IMODE(st.st_mode) == want, (p, oct(st.st_mode))
    assert os.path.exists(s.registry())
    attic = os.lstat(os.path.join(s.ws, ".overlayrec-attic"))
    assert stat.S_IMODE(attic.st_mode) == 0o700


def assert_private(top: str) -> int:
    """Every directory beneath ``top`` 0700, every file without group or other bits; how many
    paths were looked at."""
    n = 0
    for p, st in walk(top):
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            assert mode == 0o700, (p, oct(mode))
        else:
            assert not mode & 0o077, (p, oct(mode))
        n += 1
    return n


@needs_fuse
def test_what_readers_and_records_that_travel_make_is_private_too(session, tmpbase):
    """Under the usual umask (022): the object store a diff or a report makes in the state
    dir (it was 0755, its files 0644: only the export's was made under a private umask), the
    origin file a push keeps, and the records a fetch brings into overlayrec's state home.
    An object store an older overlayrec left so is tightened when it is next used."""
    s = session
    record(s)
    shutil.rmtree(os.path.join(s.sd, "git"))
    old = os.umask(0o022)
    try:
        s.run("diff", s.ws, "--call", "c1", "--binary")
        s.run("report", s.ws, "--html", os.path.join(tmpbase, "r.html"))
        remote = os.path.join(tmpbase, "remote.git")
        subprocess.run(["git", "init", "-q", "--bare", remote], check=True)
        s.run("export", "git", s.ws, "--push", remote)
        s.run("fetch", remote)
    finally:
        os.umask(old)
    assert os.path.exists(os.path.join(s.sd, "git", "HEAD"))
    assert os.path.exists(os.path.join(s.xdg, "overlayrec", "records.git", "HEAD"))
    assert any(n.startswith("export-") for n in os.listdir(s.sd))
    assert assert_private(s.sd) > 20
    assert assert_private(os.path.join(s.xdg, "overlayrec")) > 20
    # a store left by an older overlayrec: tightened at its next use
    store = os.path.join(s.sd, "git")
    subprocess.run(["chmod", "-R", "go+rX", store], check=True)
    assert stat.S_IMODE(os.stat(os.path.join(store, "HEAD")).st_mode) == 0o644
    s.run("diff", s.ws, "--call", "c2")
    assert_private(s.sd)


@needs_fuse
def test_an_older_state_dir_is_brought_to_0700_at_mount(session):
    """What an older overlayrec left (the daemon's umask of 0): its directories and files are
    tightened when the daemon starts; a stray temp file of a writer that is gone is removed."""
    s = session
    record(s)
    loose = [os.path.join(s.sd, "content", "tmp"), os.path.join(s.sd, "content")]
    loose += [os.path.join(s.sd, "content", n) for n in os.listdir(os.path.join(s.sd, "content"))]
    for p in loose:
        os.chmod(p, 0o777)
    os.chmod(os.path.join(s.sd, "journal", "data.mdb"), 0o644)
    os.chmod(s.sd, 0o755)
    stray = os.path.join(s.sd, "content", "tmp", "999999999.1")
    with open(stray, "w") as f:
        f.write("half a blob")
    os.utime(stray, (time.time() - 60, time.time() - 60))
    s.mount()
    s.umount()
    for p in loose + [s.sd]:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700, p
    assert stat.S_IMODE(os.stat(os.path.join(s.sd, "journal", "data.mdb")).st_mode) == 0o600
    assert not os.path.exists(stray)


@needs_fuse
@needs_root
def test_another_user_can_write_nothing_in_the_state_dir(session):
    s = session
    record(s)
    assert stat.S_IMODE(os.stat(s.sd).st_mode) == 0o700  # the 0755 dir it was given
    paths = [p for p, _ in walk(s.sd)] + [p for p, _ in walk(os.path.join(s.xdg, "overlayrec"))]
    probe = r"""
import json, os, sys
done = []
for p in json.load(sys.stdin):
    try:
        if os.path.isdir(p):
            fd = os.open(os.path.join(p, "planted"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        else:
            fd = os.open(p, os.O_WRONLY | os.O_APPEND)
        os.close(fd)
        done.append(p)
    except OSError:
        pass
    try:
        os.rename(p, p + ".moved")
        done.append(p + " (renamed)")
    except OSError:
        pass
print(json.dumps(done))
"""

    def as_nobody() -> list[str]:
        r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                            "--clear-groups", sys.executable, "-c", probe],
                           input=json.dumps(paths), capture_output=True, text=True,
                           timeout=60 * SLOW)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)
    os.chmod(s.base, 0o755)
    assert as_nobody() == []
    # even with the state dir and the registry opened to others for reading, what is inside
    # keeps them out on its own (0700 directories, 0600 files)
    for d in (s.sd, s.xdg, os.path.join(s.xdg, "overlayrec")):
        os.chmod(d, 0o755)
    assert as_nobody() == []


# -- refusing a state dir or registry another user could change ----------------------------------

@needs_fuse
def test_a_state_dir_writable_by_others_is_refused(session):
    s = session
    record(s)
    os.chmod(s.sd, 0o777)
    one_line_error(s.run("mount", s.ws, "--state-dir", s.sd, check=False),
                   s.sd, "writable by group and others")
    assert not is_mounted(s.ws)
    for args in (["diff", s.ws, "--call", "c1", "--state-dir", s.sd],
                 ["revert", s.ws, "--call", "c1", "--yes", "--state-dir", s.sd],
                 ["log", s.ws, "--state-dir", s.sd],
                 ["diff", s.ws, "--call", "c1"],          # found through the registry
                 ["revert", s.ws, "--call", "c1", "--yes"],
                 ["status", s.ws], ["umount", s.ws]):
        one_line_error(s.run(*args, check=False), "writable by")
    assert not is_mounted(s.ws)
    assert open(os.path.join(s.ws, "old.txt")).read() == "new\n"  # nothing reverted
    os.chmod(s.sd, 0o755)  # readable by others is not writable by them
    assert "old.txt" in s.run("diff", s.ws, "--call", "c1", "--stat").stdout
    # the records in it are checked too: a journal or revert plans writable by others
    for sub in ("journal", "reverts"):
        os.chmod(os.path.join(s.sd, sub), 0o777)
        one_line_error(s.run("log", s.ws, check=False), os.path.join(s.sd, sub), "writable")
        os.chmod(os.path.join(s.sd, sub), 0o700)
    os.chmod(os.path.join(s.sd, "journal", "data.mdb"), 0o666)
    one_line_error(s.run("revert", s.ws, "--call", "c1", check=False), "data.mdb", "writable")


@needs_fuse
def test_a_registry_writable_by_others_is_refused(session):
    s = session
    record(s)
    mounts = os.path.dirname(s.registry())
    # $XDG_STATE_HOME traversable (the reported case): what is in it must keep others out
    for d in (s.xdg, os.path.dirname(mounts)):
        os.chmod(d, 0o755)
    os.chmod(mounts, 0o777)
    for args in (["status", s.ws], ["diff", s.ws, "--call", "c1"], ["umount", s.ws],
                 ["mount", s.ws, "--state-dir", s.sd]):
        one_line_error(s.run(*args, check=False), "registry", mounts, "writable")
    assert not is_mounted(s.ws)
    os.chmod(mounts, 0o755)
    os.chmod(s.registry(), 0o622)
    one_line_error(s.run("status", s.ws, check=False), "registry entry", "writable by")
    os.chmod(s.registry(), 0o600)
    # a parent of the state dir writable by others (not sticky): anyone could swap it
    os.chmod(s.base, 0o777)
    try:
        one_line_error(s.run("status", s.ws, check=False), s.base, "writable")
    finally:
        os.chmod(s.base, 0o755)
    assert json.loads(s.run("status", s.ws, "--json").stdout)["state_dir"] == s.sd


@needs_root
def test_a_state_dir_or_registry_owned_by_another_user_is_refused(tmpbase):
    base = os.path.join(tmpbase, "o")
    ws, sd, xdg = (os.path.join(base, n) for n in ("ws", "state", "xdg"))
    for d in (ws, sd):
        os.makedirs(d)
    os.chmod(base, 0o755)
    os.chown(sd, NOBODY, NOBODY)
    os.chmod(sd, 0o700)
    env = dict(os.environ, XDG_STATE_HOME=xdg)
    one_line_error(overlayrec("mount", ws, "--state-dir", sd, check=False, env=env),
                   sd, "is owned by", "uid 65534", "not by you or root")
    one_line_error(overlayrec("log", ws, "--state-dir", sd, check=False, env=env), "is owned by")
    assert not is_mounted(ws)
    # a registry entry naming that directory (the reported attack: another user's directory)
    reg = os.path.join(xdg, "overlayrec", "mounts")
    os.makedirs(reg, mode=0o700)
    with open(os.path.join(reg, state.workspace_id(ws) + ".json"), "w") as f:
        json.dump({"workspace": ws, "state_dir": sd}, f)
    for args in (["status", ws], ["umount", ws], ["diff", ws, "--since", "0"]):
        one_line_error(overlayrec(*args, check=False, env=env), sd, "uid 65534")
    os.chown(reg, NOBODY, NOBODY)
    one_line_error(overlayrec("status", ws, check=False, env=env), "registry", "uid 65534")


def test_check_private_rules(tmpbase):
    """ssh's rule, with its two exceptions: a sticky directory above (tmpbase is in /var/tmp),
    and what lies beneath a directory others cannot enter."""
    import pathlib
    import re
    tmp_path = pathlib.Path(tmpbase)
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    assert state.check_private(str(d)) is True  # closed to others
    os.chmod(d, 0o755)
    assert state.check_private(str(d)) is False
    assert state.check_private(str(d / "not-yet")) is False  # judged by its parents
    for mode, who in ((0o775, "group"), (0o757, "others"), (0o777, "group and others")):
        os.chmod(d, mode)
        with pytest.raises(state.StateError, match=f"is writable by {who}: refusing it"):
            state.check_private(str(d))
        with pytest.raises(state.StateError, match="writable"):
            state.check_private(str(d / "inner"))  # a parent anyone can write to
    os.chmod(d, 0o1777)  # sticky: no one else can rename or remove what is ours in it
    (d / "inner").mkdir(mode=0o700)
    assert state.check_private(str(d / "inner")) is True
    with pytest.raises(state.StateError):
        state.check_private(str(d))  # the state dir itself may not be writable by others
    # beneath a directory others cannot enter, nothing is reachable: looser modes are harmless
    os.chmod(d, 0o700)
    (d / "loose").mkdir()
    os.chmod(d / "loose", 0o777)
    assert state.check_private(str(d / "loose")) is True
    # a symlink is judged by what it points at
    os.chmod(d, 0o777)
    (tmp_path / "link").symlink_to(d)
    with pytest.raises(state.StateError, match=re.escape(f"link ({d}) is writable")):
        state.check_private(str(tmp_path / "link"))
    # beneath what is no directory (a mistyped XDG_STATE_HOME=/dev/null/x): said so, not a
    # permission to mend ("chmod go-w /dev/null")
    for above in ("/dev/null", str(tmp_path / "afile")):
        if above != "/dev/null":
            (tmp_path / "afile").write_text("")
            os.chmod(tmp_path / "afile", 0o666)
        with pytest.raises(state.StateError, match=re.escape(
                f"cannot check {above}: Not a directory")):
            state.check_private(os.path.join(above, "x", "overlayrec"))


# -- blobs --------------------------------------------------------------------------------------

def test_a_blob_is_checked_against_its_name(tmp_path):
    store = ContentStore(str(tmp_path / "content"))
    digest = store.put_bytes(b"the real bytes\n")
    assert store.get(digest) == b"the real bytes\n"
    with open(store.path(digest), "wb") as f:
        f.write(b"planted bytes!!\n")
    with pytest.raises(BlobError, match=f"blob {digest} .*does not match its hash"):
        store.get(digest)
    assert store.get(digest, verify=False) == b"planted bytes!!\n"
    # put heals a blob whose size is wrong (one of the right size is caught when read)
    with open(store.path(digest), "wb") as f:
        f.write(b"short")
    assert store.put_bytes(b"the real bytes\n") == digest
    assert store.get(digest) == b"the real bytes\n"
    # not a regular file: never followed, never blocked on
    other = xxhash.xxh3_128_hexdigest(b"x")
    os.makedirs(os.path.dirname(store.path(other)), exist_ok=True)
    os.symlink("/etc/passwd", store.path(other))
    with pytest.raises(BlobError, match="not a regular file"):
        store.get(other)
    os.unlink(store.path(other))
    os.mkfifo(store.path(other))
    with pytest.raises(BlobError, match="not a regular file"):
        store.get(other)


def test_stale_temp_files_are_cleaned_at_start(tmp_path):
    store = ContentStore(str(tmp_path / "content"))
    tmp = tmp_path / "content" / "tmp"
    old = time.time() - 60
    gone = tmp / "999999999.3"          # a writer that is gone, before the daemon started
    live = tmp / f"{os.getpid()}.7"     # a writer still running (a revert storing a plan)
    new = tmp / "999999998.1"           # made after the daemon started
    for p in (gone, live, new):
        p.write_bytes(b"partial")
    for p in (gone, live):
        os.utime(p, (old, old))
    assert store.clean(time.time_ns() - 10 * 10**9) == 1
    assert not gone.exists() and live.exists() and new.exists()


def _plant(s, digest: str, data: bytes | None) -> bytes:
    """Put ``data`` under ``digest`` where the record keeps that blob (the journal's ``blobs``
    table for a small one, a content-store file for a large one); what was there.  With data
    None, only read it."""
    blob = os.path.join(s.sd, "content", digest[:2], digest[2:])
    if os.path.exists(blob):
        old = open(blob, "rb").read()
        if data is not None:
            with open(blob, "wb") as f:
                f.write(data)
        return old
    env = lmdb.open(os.path.join(s.sd, "journal"), max_dbs=64, map_size=1 << 30)
    try:
        db = env.open_db(b"blobs", create=False)
        with env.begin(db=db, write=data is not None) as txn:
            old = txn.get(digest.encode())
            assert old is not None, f"blob {digest} is kept nowhere"
            if data is not None:
                txn.put(digest.encode(), data)
        return old
    finally:
        env.close()


@needs_fuse
@pytest.mark.parametrize("size", ["small", "large"])
def test_a_planted_blob_makes_revert_refuse_and_writes_nothing(session, tmp_path, size):
    """A small pre-image is kept in the journal, a large one as a file: other bytes planted
    under its name, in either place, are refused by every reader that would use them."""
    s = session
    old = b"old content\n" * (1 if size == "small" else 10000)
    with open(os.path.join(s.ws, "old.txt"), "wb") as f:
        f.write(old)
    s.mount()
    s.call("c1", "printf 'new\\n' > old.txt")
    digest = xxhash.xxh3_128_hexdigest(old)
    assert _plant(s, digest, None) == old
    assert os.path.exists(os.path.join(s.sd, "content", digest[:2], digest[2:])) == \
        (size == "large")
    _plant(s, digest, b"planted!!!!\n" + old[12:])  # the tamper: other bytes under the name
    r = s.run("revert", s.ws, "--call", "c1", "--yes", check=False)
    one_line_error(r, f"blob {digest}", "does not match its hash")
    assert open(os.path.join(s.ws, "old.txt")).read() == "new\n"
    assert not os.path.exists(os.path.join(s.sd, "reverts")) or \
        not [n for n in os.listdir(os.path.join(s.sd, "reverts"))
             if n.endswith(".json")]  # no plan saved: nothing begun (the lock is no plan)
    # a replay and a diff refuse it the same way; the replay's target is never made
    dest = tmp_path / "then"
    one_line_error(s.run("replay", s.ws, "--at", "before:call:c1", "--to", str(dest),
                         check=False), f"blob {digest}")
    assert not dest.exists()
    one_line_error(s.run("diff", s.ws, "--call", "c1", check=False), f"blob {digest}")
    _plant(s, digest, old)
    s.run("revert", s.ws, "--call", "c1", "--yes")
    assert open(os.path.join(s.ws, "old.txt"), "rb").read() == old


# -- signalling only the daemon -------------------------------------------------------------------

def _sleeper():
    p = subprocess.Popen(["sleep", "60"])
    time.sleep(0.05)
    return p


def _rewrite(path: str, **fields) -> None:
    with open(path) as f:
        d = json.load(f)
    d.update(fields)
    with open(path, "w") as f:
        json.dump(d, f)


def _gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout * SLOW
    while time.monotonic() < deadline:
        if not state.pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


@needs_fuse
def test_umount_signals_only_its_verified_daemon(session):
    s = session
    s.mount()
    daemon = s.daemon()
    assert daemon["start_ticks"] == state.proc_start_ticks(daemon["pid"])
    assert state.verify_daemon(daemon, s.sd) == (daemon["pid"], None)
    assert json.loads(s.run("status", s.ws, "--json").stdout)["daemon_pid"] == daemon["pid"]
    sleeper = _sleeper()
    try:
        # the pid rewritten: its start time is not the daemon's
        _rewrite(os.path.join(s.sd, "daemon.json"), pid=sleeper.pid)
        st = json.loads(s.run("status", s.ws, "--json").stdout)
        assert st["mounted"] and st["daemon_pid"] is None
        r = s.run("umount", s.ws)
        assert f"daemon.json names pid {sleeper.pid}" in r.stderr
        assert "started at another time" in r.stderr and "not signalling it" in r.stderr
        assert "no daemon signalled" in r.stdout
        assert sleeper.poll() is None  # still alive
        assert not is_mounted(s.ws)
        assert _gone(daemon["pid"])  # the daemon ends with its mount, unsignalled
        # pid, start time and boot id all the sleep's: it is not overlayrec
        s.mount()
        _rewrite(os.path.join(s.sd, "daemon.json"), pid=sleeper.pid,
                 start_ticks=state.proc_start_ticks(sleeper.pid), boot_id=state.boot_id())
        r = s.run("umount", s.ws)
        assert f"pid {sleeper.pid}, but it is not overlayrec (sleep 60)" in r.stderr
        assert sleeper.poll() is None and not is_mounted(s.ws)
        # and a file naming no valid pid (0 or -1 would signal a process group, or everyone)
        for bad in (0, -1, "1"):
            assert state.verify_daemon({"pid": bad}, s.sd)[0] is None
    finally:
        sleeper.kill()
        sleeper.wait()


@needs_fuse
def test_umount_does_not_signal_another_workspaces_daemon(session, tmpbase):
    """An overlayrec daemon, started when the file says, yet not this state dir's: left alone."""
    a = session
    b = Session(os.path.join(tmpbase, "b"))
    try:
        a.mount()
        b.mount()
        other = b.daemon()
        _rewrite(os.path.join(a.sd, "daemon.json"), pid=other["pid"],
                 start_ticks=other["start_ticks"], boot_id=other["boot_id"])
        r = a.run("umount", a.ws)
        assert f"pid {other['pid']}, but it is not the daemon of {a.sd}" in r.stderr
        assert not is_mounted(a.ws)
        assert is_mounted(b.ws) and state.pid_alive(other["pid"])
        assert "mounted by daemon pid" in b.run("status", b.ws).stdout
    finally:
        b.umount()


@needs_fuse
@needs_root
def test_a_registry_entry_naming_another_users_dir_gets_nothing_signalled(session):
    """The reported attack: another user's directory, holding a daemon.json that names a pid,
    put in the registry entry.  Nothing is signalled; umount says why."""
    s = session
    s.mount()
    evil = os.path.join(s.base, "evil")
    os.mkdir(evil, 0o700)
    sleeper = _sleeper()
    try:
        with open(os.path.join(evil, "daemon.json"), "w") as f:
            json.dump({"pid": sleeper.pid, "start_ticks": state.proc_start_ticks(sleeper.pid),
                       "boot_id": state.boot_id(), "workspace": s.ws, "state_dir": evil}, f)
        os.chown(os.path.join(evil, "daemon.json"), NOBODY, NOBODY)
        os.chown(evil, NOBODY, NOBODY)
        with open(s.registry(), "w") as f:
            json.dump({"workspace": s.ws, "state_dir": evil}, f)
        one_line_error(s.run("umount", s.ws, check=False), evil, "uid 65534")
        assert sleeper.poll() is None
        assert is_mounted(s.ws)  # refused as a whole: the real daemon is found again below
        with open(s.registry(), "w") as f:
            json.dump({"workspace": s.ws, "state_dir": s.sd}, f)
        s.run("umount", s.ws)
        assert not is_mounted(s.ws) and sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_workspace_keeps_its_state_dir_name():
    """A workspace's default state dir and registry entry are named by its basename and the
    first 12 hex digits of the SHA-256 of its path (surrogate-escaped bytes): the name must
    not change from one version to the next (computed without hashlib's OpenSSL since), or a
    recorded workspace would lose its record."""
    import hashlib
    for ws, want in (("/home/u/proj", "proj-"), ("/", "root-"), ("/w/x\udcff y", "x\udcff y-")):
        digest = hashlib.sha256(ws.encode("utf-8", "surrogateescape")).hexdigest()[:12]
        assert state.workspace_id(ws) == want + digest
    # as sha256sum says: printf %s /home/u/proj | sha256sum
    assert state.workspace_id("/home/u/proj") == "proj-9c09f8055a26"
