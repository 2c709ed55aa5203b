"""The inode table stays below the daemon's fd limit, whatever the workspace's size.

Each inode holds an O_PATH fd only while recently used: past half the fd limit the least recently
used are closed (fs.Operations._trim), and an inode without one is opened again from its parent
and name when next used.  The daemon's limit is lowered here with the OVERLAYREC_FD_LIMIT knob
(daemon._raise_fd_limit) so that a tree of 20,000 files is far larger than it."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time

from conftest import SLOW, needs_fuse

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main",
       "-c", "gc.auto=0",  # no background gc changing .git while it is compared
       "-c", "safe.directory=*"]


class FdSampler:
    """Counts the daemon's open fds every few milliseconds, in a thread, and keeps the maximum."""

    def __init__(self, pid: int):
        self.pid = pid
        self.max = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def count(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def _run(self):
        while not self._stop.is_set():
            try:
                n = self.count()
            except OSError:
                return
            self.max = max(self.max, n)
            self.samples += 1
            self._stop.wait(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)


def daemon_pid(m) -> int:
    with open(os.path.join(m.state, "daemon.json")) as f:
        return json.load(f)["pid"]


def soft_fd_limit(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise AssertionError("no fd limit in /proc/PID/limits")


def held_paths(pid: int) -> set[str]:
    """What the daemon's fds point at (underlay paths)."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return out


def run(m, script: str, timeout: float = 300) -> tuple[str, float]:
    """A shell script with its cwd in the mount; it must succeed and print nothing on stderr."""
    t = time.perf_counter()
    r = subprocess.run(["bash", "-ec", script], cwd=m.ws, capture_output=True, text=True,
                       timeout=timeout * SLOW)
    took = time.perf_counter() - t
    assert r.returncode == 0 and r.stderr == "", \
        f"{script} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return r.stdout, took


def write_tree(ws: str, tops: int, subs: int, files: int) -> list[str]:
    made = []
    for t in range(tops):
        for s in range(subs):
            d = os.path.join(ws, f"d{t:02d}", f"s{s}")
            os.makedirs(d)
            for i in range(files):
                rel = f"d{t:02d}/s{s}/f{i:03d}"
                with open(os.path.join(ws, rel), "w") as f:
                    f.write(rel + "\n")
                made.append(rel)
    return made


def deep_chain(ws: str, depth: int) -> str:
    rel = "/".join(f"deep{k}" for k in range(depth))
    os.makedirs(os.path.join(ws, rel))
    rel += "/bottom"
    with open(os.path.join(ws, rel), "w") as f:
        f.write("bottom\n")
    return rel


def events_for(m, op: str, path: str) -> list[dict]:
    return [e for e in m.events() if e["op"] == op and e["path"] == path]


CAT_ALL = "find . -type f -print0 | sort -z | xargs -0 cat | sha256sum"


@needs_fuse
def test_twenty_thousand_files_under_a_1024_fd_limit(make_mount):
    limit = 1024
    m = make_mount(env=dict(os.environ, OVERLAYREC_FD_LIMIT=str(limit)))
    write_tree(m.ws, 40, 5, 100)  # 20,000 files in 240 directories
    bottom = deep_chain(m.ws, 40)
    subprocess.run(GIT + ["init", "-q"], cwd=m.ws, check=True)
    subprocess.run(GIT + ["add", "-A"], cwd=m.ws, check=True)
    subprocess.run(GIT + ["commit", "-q", "-m", "base"], cwd=m.ws, check=True)
    native_count, _ = run(m, "find . | wc -l")
    native_sum, _ = run(m, CAT_ALL)

    m.mount()
    pid = daemon_pid(m)
    assert soft_fd_limit(pid) == limit
    times = {}
    with FdSampler(pid) as fds:
        count, times["find"] = run(m, "find . | wc -l")
        assert count == native_count
        got, times["cat"] = run(m, CAT_ALL)
        assert got == native_sum
        assert run(m, f"cat {bottom}")[0] == "bottom\n"
        for k in ("git status", "git status again"):
            out, times[k] = run(m, shlex.join(GIT) + " status --porcelain")
            assert out == ""

        # recording through inodes whose fd was closed: their paths come from the fd opened
        # again, so they must name the file as it is now (also after its directory's rename)
        held = held_paths(pid)
        for rel in ("d00/s0/f000", "d01/s0/f000"):
            assert os.path.join(m.ws, rel) not in held, f"{rel} still has an fd"
        run(m, "echo more >> d00/s0/f000; mv d01 d01-moved; echo more >> d01-moved/s0/f000;"
               f" echo more >> {bottom}")
        assert events_for(m, "write", "d00/s0/f000")
        assert events_for(m, "rename", "d01")
        assert events_for(m, "write", "d01-moved/s0/f000")
        assert events_for(m, "write", bottom)
        assert run(m, "cat d01-moved/s0/f000")[0] == "d01/s0/f000\nmore\n"
        assert run(m, "git status --porcelain | wc -l")[0].strip() != "0"
    print(f"\n20,000 files, fd limit {limit}: daemon fds max {fds.max} over {fds.samples} samples;"
          + "".join(f" {k} {v:.2f} s;" for k, v in times.items()))
    assert fds.samples > 100
    assert fds.max < limit


@needs_fuse
def test_names_follow_renames_and_links_without_fds(make_mount):
    """A tiny limit (128: 64 O_PATH fds), so nearly every inode loses its fd between uses."""
    limit = 128
    m = make_mount(env=dict(os.environ, OVERLAYREC_FD_LIMIT=str(limit)))
    write_tree(m.ws, 3, 2, 50)  # 300 files
    for d in ("x", "y"):
        os.makedirs(os.path.join(m.ws, d))
        with open(os.path.join(m.ws, d, "f"), "w") as f:
            f.write(f"in {d}\n")
    bottom = deep_chain(m.ws, 80)  # deeper than the O_PATH fds kept
    m.mount()
    pid = daemon_pid(m)
    assert soft_fd_limit(pid) == limit
    pressure = f"{CAT_ALL} >/dev/null"
    with FdSampler(pid) as fds:
        run(m, pressure)
        assert run(m, f"cat {bottom}")[0] == "bottom\n"
        # an open file keeps working after its name is gone and every fd has been cycled
        run(m, f"""exec 3<d00/s0/f000; rm d00/s0/f000; {pressure}
                   test "$(cat <&3)" = d00/s0/f000; test "$(stat -L -c %s /dev/fd/3)" = 12""")
        # a working directory keeps working too
        run(m, f"cd d00/s1; (cd ../.. && {pressure}); ls | wc -l | grep -qx 50")
        # a renamed directory: its children (fd-less, still cached by the kernel) follow it
        run(m, f"mv d01 d01-moved; {pressure}; echo w >> d01-moved/s1/f007")
        assert run(m, "cat d01-moved/s1/f007")[0] == "d01/s1/f007\nw\n"
        assert events_for(m, "write", "d01-moved/s1/f007")
        # renamed across directories, then over an existing (fd-less) name
        run(m, f"mv d02/s0/f001 d00/s1/g; mv d02/s0/f002 d02/s1/f003; {pressure};"
               " echo w >> d00/s1/g; echo w >> d02/s1/f003")
        assert run(m, "cat d00/s1/g d02/s1/f003")[0] == "d02/s0/f001\nw\nd02/s0/f002\nw\n"
        assert events_for(m, "write", "d00/s1/g") and events_for(m, "write", "d02/s1/f003"), \
            [(e["seq"], e["op"], e["path"], e.get("path2"), e.get("ref")) for e in
             m.events(failed=True) if e["op"] in ("write", "rename", "failed", "alias") and
             str(e["path"]).startswith(("d00/s1/g", "d02/"))][-12:]  # (once seen flaky)
        # RENAME_EXCHANGE of two directories
        run(m, f"{shlex.quote(sys.executable)} -c 'import ctypes;"
               " l = ctypes.CDLL(None, use_errno=True);"
               " assert l.renameat2(-100, b\"x\", -100, b\"y\", 2) == 0, ctypes.get_errno()';"
               f" {pressure}; echo w >> x/f")
        assert run(m, "cat x/f y/f")[0] == "in y\nw\nin x\n"
        assert events_for(m, "write", "x/f")
        # hard links: both names reach the inode, whichever was looked up last
        run(m, f"ln d00/s1/f010 d02/s1/h; {pressure}; echo w >> d02/s1/h; {pressure};"
               " echo v >> d00/s1/f010")
        assert run(m, "cat d02/s1/h")[0] == "d00/s1/f010\nw\nv\n"
        assert run(m, "stat -c %h d02/s1/h")[0] == "2\n"
        # the deep file after its top directory moved
        run(m, f"mv deep0 deep-moved; {pressure}; echo w >> deep-moved/{bottom[6:]}")
        assert events_for(m, "write", f"deep-moved/{bottom[6:]}")
    print(f"\nfd limit {limit}: daemon fds max {fds.max} over {fds.samples} samples")
    assert fds.max < limit, fds.max


@needs_fuse
def test_a_hard_limit_too_low_to_serve_is_refused_at_mount(make_mount):
    """Under a hard limit of 64 open files the daemon served EMFILE to every other read,
    then died of an EMFILE on its control socket, leaving a dead mount over the workspace
    (found by a hunt).  It refuses to mount, in one line, and the workspace stays as it was."""
    m = make_mount()
    with open(os.path.join(m.ws, "f"), "w") as f:
        f.write("x\n")
    r = subprocess.run(["sh", "-c", "set -e; ulimit -Sn 64; ulimit -Hn 64; exec \"$@\"", "sh",
                        sys.executable, "-m", "overlayrec", "mount", m.ws, "--state-dir",
                        m.state], capture_output=True, text=True, timeout=60 * SLOW)
    assert r.returncode != 0, (r.stdout, r.stderr)
    assert "open-file limit is 64" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert subprocess.run(["mountpoint", "-q", m.ws]).returncode != 0
    assert open(os.path.join(m.ws, "f")).read() == "x\n"
