"""Shared fixtures: a real FUSE mount of a temporary workspace, served by a daemon in its own
process (pyfuse3 serves one mount per process; the test process never holds the underlay)."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from overlayrec.journal import Journal

# a VM under software emulation (tools/vm-test --driver qemu) runs about ten times slower
SLOW = float(os.environ.get("OVERLAYREC_TEST_SLOWDOWN", "1"))

HAVE_FUSE = os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None
needs_fuse = pytest.mark.skipif(not HAVE_FUSE, reason="needs /dev/fuse and fusermount3")
# tests that need root are marked so; as another user they skip, and tools/test runs them in a
# second pass as root (by sudo) when it can
needs_root = pytest.mark.root


def pytest_collection_modifyitems(config, items):
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="needs root (tools/test runs it as root by sudo)")
        for item in items:
            if item.get_closest_marker("root"):
                item.add_marker(skip)


def overlayrec(*args, check=True, env=None, timeout=60, **kw):
    r = subprocess.run([sys.executable, "-m", "overlayrec", *args], capture_output=True,
                       text=True, env=env, timeout=timeout * SLOW, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"overlayrec {' '.join(args)} failed ({r.returncode}):\n"
                             f"{r.stdout}\n{r.stderr}")
    return r


def seeded(make_mount, files: dict, **kw):
    """A workspace holding ``files`` (path -> bytes or text), mounted."""
    m = make_mount(**kw)
    for rel, data in files.items():
        p = os.path.join(m.ws, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
    return m.mount()


def is_mounted(path: str) -> bool:
    with open("/proc/self/mountinfo", errors="surrogateescape") as f:
        return any(line.split()[4] == path for line in f)


def wait_unmounted(path: str, why: str, limit: float = 30.0) -> None:
    """Wait until nothing is mounted at ``path`` (a daemon that unmounts on its own); fail
    with ``why`` after ``limit`` seconds (times OVERLAYREC_TEST_SLOWDOWN)."""
    deadline = time.monotonic() + limit * SLOW
    while is_mounted(path):
        assert time.monotonic() < deadline, why
        time.sleep(0.1)


def run_with_outside_step(m: "Mount", tmp_path, agent: str, outside, session: str = "s"):
    """`overlayrec run` of the Python ``agent`` (its arguments: a ready flag and a go flag) in
    ``m``'s workspace: once the agent has made its ready flag, ``outside()`` runs in this
    process (no descendant of the session: an outside writer), then the go flag lets the agent
    on; the run must succeed."""
    (tmp_path / "agent.py").write_text(agent)
    ready, go = tmp_path / "ready", tmp_path / "go"
    run = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--session",
                            session, "--", sys.executable, str(tmp_path / "agent.py"),
                            str(ready), str(go)], cwd=m.ws)
    try:
        deadline = time.monotonic() + 30 * SLOW
        while not ready.exists():
            assert time.monotonic() < deadline and run.poll() is None
            time.sleep(0.02)
        outside()
        go.touch()
        assert run.wait(timeout=30 * SLOW) == 0
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


def run_script(m: "Mount", tmp_path, script: str, session: str = "s", **env) -> None:
    """``overlayrec run`` of a bash ``script`` in the mount of ``m`` as session ``session``:
    the script announces its calls with ``or call begin/end`` (``or``: overlayrec as
    ``"$PY" -m overlayrec``, ``PY`` this interpreter); ``env``: more of its environment."""
    path = tmp_path / f"{session}.sh"
    path.write_text('or() { "$PY" -m overlayrec "$@"; }\n' + script)
    overlayrec("run", "-w", m.ws, "--state-dir", m.state, "--session", session, "--", "bash",
               str(path), cwd=m.ws, env=dict(os.environ, PY=sys.executable, **env))


def force_unmount(path: str) -> None:
    for _ in range(3):
        if not is_mounted(path):
            return
        subprocess.run(["fusermount3", "-u", "-z", path], capture_output=True)
        time.sleep(0.1)


@contextlib.contextmanager
def plain_recorder(tmp_path):
    """A Recorder over a plain directory ``tmp_path/ws`` (no mount; a subdirectory ``d`` in
    it), and the workspace's root fd: the recorder's layer driven directly."""
    from overlayrec.attribution import Attribution
    from overlayrec.recorder import Recorder
    ws = tmp_path / "ws"
    (ws / "d").mkdir(parents=True)
    j = Journal(str(tmp_path / "state"))
    root_fd = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield Recorder(j, root_fd, Attribution()), root_fd
    finally:
        os.close(root_fd)
        j.close()


class Mount:
    """A workspace with overlayrec mounted over it, and its state dir."""

    def __init__(self, base: str, extra_args=(), env=None):
        self.base = base
        self.ws = os.path.join(base, "ws")
        self.state = os.path.join(base, "state")
        self.extra_args = list(extra_args)
        self.env = env
        os.makedirs(self.ws, exist_ok=True)

    def mount(self):
        overlayrec("mount", self.ws, "--state-dir", self.state, *self.extra_args, env=self.env)
        assert is_mounted(self.ws)
        return self

    def umount(self):
        if is_mounted(self.ws):
            overlayrec("umount", self.ws, check=False)
        force_unmount(self.ws)

    def sh(self, script: str, check=True, user=None, **kw) -> subprocess.CompletedProcess:
        """Run a shell script with its cwd in the mount (entered by path, after mounting)."""
        cmd = ["bash", "-ec", script]
        if user is not None:
            cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] + cmd
        r = subprocess.run(cmd, cwd=self.ws, capture_output=True, text=True, timeout=60 * SLOW,
                           **kw)
        if check and r.returncode != 0:
            raise AssertionError(f"script failed ({r.returncode}): {script}\n{r.stdout}\n{r.stderr}")
        return r

    def py(self, code: str, **kw) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, "-c", code], cwd=self.ws, capture_output=True,
                           text=True, timeout=60 * SLOW, **kw)
        if r.returncode != 0:
            raise AssertionError(f"python failed: {code}\n{r.stdout}\n{r.stderr}")
        return r

    def journal(self) -> Journal:
        return Journal(self.state, readonly=True)

    def events(self, *, failed=False, seals=False) -> list[dict]:
        j = self.journal()
        try:
            evs = list(j.events())
        finally:
            j.close()
        if not seals:  # seals record a state and change nothing
            evs = [e for e in evs if e["op"] != "seal"]
        if failed:
            return evs
        bad = {e["ref"] for e in evs if e["op"] == "failed"}
        return [e for e in evs if e["op"] != "failed" and e["seq"] not in bad]

    def actor(self, key: str) -> dict:
        j = self.journal()
        try:
            return j.actor(key)
        finally:
            j.close()

    def blob(self, digest: str) -> bytes:
        """A blob as the record keeps it (the journal's small blobs, or a content-store file)."""
        j = self.journal()
        try:
            return j.content.get(digest)
        finally:
            j.close()

    def attic(self, name: str) -> str:
        return os.path.join(self.ws, ".overlayrec-attic", name)  # valid once unmounted


@pytest.fixture
def tmpbase():
    # world-traversable, so tests can also act as an unprivileged user
    d = tempfile.mkdtemp(prefix="overlayrec-test-", dir="/var/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def linked_before_mount(m: "Mount") -> "Mount":
    """``m`` mounted over a/w.txt and b/second.txt, one file linked before the mount in two
    directories nothing lists (so the mount never matches the names), and x.txt linked as y.txt
    through the mount (a linked inode the daemon knows)."""
    for d in ("a", "b"):
        os.mkdir(os.path.join(m.ws, d))
    with open(os.path.join(m.ws, "a", "w.txt"), "w") as f:
        f.write("orig\n")
    os.link(os.path.join(m.ws, "a", "w.txt"), os.path.join(m.ws, "b", "second.txt"))
    with open(os.path.join(m.ws, "x.txt"), "w") as f:
        f.write("x\n")
    m.mount()
    m.sh("ln x.txt y.txt")
    return m


@pytest.fixture
def mounted(tmpbase):
    if not HAVE_FUSE:
        pytest.skip("needs /dev/fuse")
    m = Mount(tmpbase)
    m.mount()
    try:
        yield m
    finally:
        m.umount()


@pytest.fixture
def make_mount(tmpbase):
    """Build a Mount with options and a seeded workspace before mounting."""
    if not HAVE_FUSE:
        pytest.skip("needs /dev/fuse")
    made = []

    def make(extra_args=(), env=None, sub="m"):
        m = Mount(os.path.join(tmpbase, sub), extra_args, env)
        made.append(m)
        return m
    try:
        yield make
    finally:
        for m in made:
            m.umount()
