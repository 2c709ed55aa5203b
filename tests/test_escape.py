"""Nothing written outside the target, ever: replay, revert, unrevert and `revert --continue`
reach every path beneath their root without following a symlink, whatever the history or the
live tree hold (issue 13).  Every test keeps canary files outside the workspace and outside the
replay's destination, and checks that they are untouched (content, mode, times, links) and that
nothing new appeared beside them."""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import SLOW, needs_fuse, overlayrec
from overlayrec import underlay

CALL = textwrap.dedent(r'''
    import subprocess, sys
    from overlayrec import client
    with client.connect() as c:
        c.call_begin("c1", "Bash")
        subprocess.run(["bash", "-c", sys.argv[1]], check=True)
        c.call_end("c1")
''')

# every name a recorded path has below a directory that becomes a symlink: written through
# the symlink, a careless writer would hit one of these
CANARIES = ["f", "g", "h", "sub/f", "sub/g"] + [f"a{i:03}" for i in range(30)]
OLD = 1_000_000_000 * 10**9  # the canaries' times: any touch shows


def tree_of(root: str) -> dict:
    """Every path below ``root`` (symlinks as symlinks, never followed): kind, mode, content."""
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != ".overlayrec-attic"]
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                with open(p, "rb") as f:
                    out[rel] = ("file", stat.S_IMODE(st.st_mode), f.read())
    return out


class Outside:
    """The canaries: a directory beside the workspace full of files named like the recorded
    paths, and everything else under the test's base directory but the workspace, its state
    dir and the replay destinations."""

    def __init__(self, base: str, skip: list[str]):
        self.base = base
        self.dir = os.path.join(base, "outside")
        self.dests = os.path.join(base, "dests")
        self.skip = set(skip) | {self.dests}
        os.makedirs(self.dests)
        for rel in CANARIES:
            p = os.path.join(self.dir, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w") as f:
                f.write(f"canary {rel}: never to be written\n")
            os.utime(p, ns=(OLD, OLD))
        for d in (os.path.join(self.dir, "sub"), self.dir):
            os.utime(d, ns=(OLD, OLD))
        self.before = self.snapshot()

    def snapshot(self) -> dict:
        out = {}
        for d, dirs, files in os.walk(self.base):
            dirs[:] = [x for x in dirs if os.path.join(d, x) not in self.skip]
            for n in [""] + dirs + files:
                p = os.path.join(d, n) if n else d
                st = os.lstat(p)
                data = os.readlink(p) if stat.S_ISLNK(st.st_mode) else \
                    open(p, "rb").read() if stat.S_ISREG(st.st_mode) else None
                out[os.path.relpath(p, self.base)] = (
                    st.st_mode, st.st_uid, st.st_gid, st.st_nlink, st.st_size, st.st_mtime_ns,
                    st.st_ctime_ns, data)
        return out

    def check(self) -> None:
        now = self.snapshot()
        assert now == self.before, {k: (self.before.get(k), now.get(k))
                                    for k in set(now) | set(self.before)
                                    if now.get(k) != self.before.get(k)}

    def dest(self, name: str) -> str:
        return os.path.join(self.dests, name)

    def rel_from(self, ws_dir: str) -> str:
        """The canary directory as a relative symlink target from ``ws_dir``."""
        return os.path.relpath(self.dir, ws_dir)


@pytest.fixture(params=["openat2", "walk"])
def resolver(request, monkeypatch):
    """Both ways of resolving beneath a root: openat2 (Linux >= 5.6) and the component walk
    (older kernels), in this process and in the commands the tests run."""
    if request.param == "openat2" and not underlay._have_openat2():
        pytest.skip("this kernel has no openat2")
    if request.param == "walk":
        monkeypatch.setenv("OVERLAYREC_TEST_NO_OPENAT2", "1")
        monkeypatch.setattr(underlay, "_openat2", False)
    return request.param


def _mount(make_mount, tmpbase, tmp_path, files=None):
    """A workspace seeded with ``files`` and mounted, and the canaries beside it."""
    m = make_mount(sub="m")
    os.makedirs(m.ws, exist_ok=True)
    for rel, data in (files or {}).items():
        p = os.path.join(m.ws, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write(data)
    (tmp_path / "call.py").write_text(CALL)
    m.mount()  # the state dir is made: what is outside is fixed from here on
    out = Outside(tmpbase, [m.ws, m.state])
    return m, out


def run_call(m, tmp_path, script):
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable,
               str(tmp_path / "call.py"), script, cwd=m.ws)


def last_seq(m) -> int:
    return max(e["seq"] for e in m.events(failed=True, seals=True))


def swap_for_symlink(m, rel: str, target: str, how: str) -> None:
    """Replace directory ``rel`` of the workspace by a symlink to ``target``: through the mount
    (recorded), or around it while unmounted (drift the record does not see)."""
    if how == "mount":
        m.sh(f"rm -r {rel} && ln -s {target} {rel}")
    else:
        assert how == "around"
        m.umount()
        shutil.rmtree(os.path.join(m.ws, rel))
        os.symlink(target, os.path.join(m.ws, rel))


# -- the helper itself ------------------------------------------------------------------------

def test_resolve_beneath_follows_no_symlink(tmp_path, resolver):
    root, out = tmp_path / "root", tmp_path / "out"
    (root / "d" / "e").mkdir(parents=True)
    (root / "d" / "e" / "f").write_text("in")
    out.mkdir()
    (out / "f").write_text("out")
    os.symlink(out, root / "abs")
    os.symlink("../out", root / "rel")
    os.symlink("d", root / "inside")  # even one that stays inside is not followed
    (root / "file").write_text("x")
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        got = underlay.resolve_beneath(fd, "d/e/f", os.O_RDONLY)
        assert os.read(got, 10) == b"in"
        os.close(got)
        got = underlay.resolve_beneath(fd, "./d//e/", underlay.O_PATH | os.O_DIRECTORY)
        assert os.path.samestat(os.fstat(got), os.stat(root / "d" / "e"))
        os.close(got)
        for final in ("abs", "rel", "inside"):  # a final symlink: itself, with O_PATH
            got = underlay.resolve_beneath(fd, final)
            assert stat.S_ISLNK(os.fstat(got).st_mode)
            os.close(got)
            with pytest.raises(underlay.Escape):
                underlay.resolve_beneath(fd, final, os.O_RDONLY)
        for bad in ("abs/f", "rel/f", "inside/e/f", "abs", "file/x", "../out/f", "d/../../out",
                    "/etc/passwd", "d/e/../../abs/f"):
            flags = underlay.O_PATH | os.O_DIRECTORY if bad == "abs" else os.O_RDONLY
            with pytest.raises(underlay.Escape):
                os.close(underlay.resolve_beneath(fd, bad, flags))
        with pytest.raises(FileNotFoundError):
            underlay.resolve_beneath(fd, "d/nothing/f")
        # open_beneath is the same rule
        with pytest.raises(underlay.Escape):
            underlay.open_beneath(fd, "abs/f")
        # a new file, made beneath the root only
        got = underlay.resolve_beneath(fd, "d/new", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(got)
        with pytest.raises(underlay.Escape):
            underlay.resolve_beneath(fd, "abs/new", os.O_WRONLY | os.O_CREAT, 0o600)
    finally:
        os.close(fd)
    assert sorted(os.listdir(out)) == ["f"] and (out / "f").read_text() == "out"


# -- (a) replay: a symlink in the history -----------------------------------------------------

@needs_fuse
def test_replay_a_history_holding_a_symlink_at_every_point(make_mount, tmpbase, tmp_path,
                                                           resolver):
    m, out = _mount(make_mount, tmpbase, tmp_path)
    # an absolute symlink one way, a relative one the other
    link = out.dir if resolver == "openat2" else out.rel_from(m.ws)
    points = {}
    try:
        for cmd in ("mkdir d", "echo x > d/f", "rm d/f", "rmdir d", f"ln -s {link} d", "rm d",
                    "mkdir d", "echo y > d/f"):
            m.sh(cmd)
            points[last_seq(m)] = tree_of(m.ws)
    finally:
        m.umount()
    assert os.path.islink(os.path.join(m.ws, "d")) is False
    out.check()
    last = max(points)
    for point in range(0, last + 1):
        for full in (False, True):
            dest = out.dest(f"{point}-{full}")
            r = overlayrec("replay", m.ws, "--state-dir", m.state, "--at", str(point), "--to",
                           dest, "--json", *(["--full"] if full else []), check=False)
            assert r.returncode == 0, (point, full, r.stderr)
            res = json.loads(r.stdout)
            assert not res["not_made"], res
            if point in points:
                assert tree_of(dest) == points[point], (point, full)
            out.check()
    symlinked = [p for p, t in points.items() if t.get("d", ("",))[0] == "link"]
    assert symlinked and os.path.islink(out.dest(f"{symlinked[0]}-True") + "/d")


# -- (b) replay --full: a symlink in the live tree --------------------------------------------

@needs_fuse
@pytest.mark.parametrize("how", ["mount", "around"])
def test_replay_full_with_a_symlink_in_the_live_tree(make_mount, tmpbase, tmp_path, resolver,
                                                      how):
    m, out = _mount(make_mount, tmpbase, tmp_path, {"keep.txt": "kept\n"})
    try:
        m.sh("mkdir -p d/sub && echo x > d/f && echo z > d/sub/g && ln d/f d/h && "
             "ln -s f d/g && chmod 640 d/f && touch -d @1000000 d/sub/g")
        point = last_seq(m)
        then = tree_of(m.ws)
        swap_for_symlink(m, "d", out.dir, how)  # live: d -> the canaries (f, g, h, sub/...)
    finally:
        m.umount()
    out.check()
    for full in ("--full", None):
        for at in (str(point), "2", str(last_seq(m))):
            dest = out.dest(f"{at}{full}")
            r = overlayrec("replay", m.ws, "--state-dir", m.state, "--at", at, "--to", dest,
                           "--json", *([full] if full else []), check=False)
            assert r.returncode == 0, r.stderr
            out.check()
            if at == str(point):
                want = then if full else {k: v for k, v in then.items() if k != "keep.txt"}
                assert tree_of(dest) == want
                st = os.stat(os.path.join(dest, "d", "f"))
                assert st.st_nlink == 2 and os.path.samestat(st, os.stat(dest + "/d/h"))
    # and mounted, as a user would right after (the live tree read beneath the mount)
    m.mount()
    try:
        dest = out.dest("mounted")
        overlayrec("replay", m.ws, "--at", str(point), "--to", dest, "--full")
        assert tree_of(dest) == then
    finally:
        m.umount()
    out.check()


# -- (c) a symlink as the direct parent of a recorded path ------------------------------------

@needs_fuse
@pytest.mark.parametrize("how", ["mount", "around"])
def test_a_symlink_as_the_direct_parent_replay_and_revert(make_mount, tmpbase, tmp_path,
                                                          resolver, how):
    # d existed before (its own path never recorded); the call changed d/f and made e/g
    m, out = _mount(make_mount, tmpbase, tmp_path, {"d/f": "orig\n", "top.txt": "top\n"})
    try:
        run_call(m, tmp_path, "echo changed > d/f && mkdir e && echo new > e/g && "
                 "echo changed > top.txt")
        point = last_seq(m)
        then = tree_of(m.ws)
        swap_for_symlink(m, "d", out.dir, how)
        if how == "mount":
            swap_for_symlink(m, "e", out.rel_from(m.ws), how)
    finally:
        m.umount()
    out.check()
    # replay: the record's d/f, in a directory of the replay's own
    for full in (False, True):
        dest = out.dest(f"replay-{full}")
        r = overlayrec("replay", m.ws, "--state-dir", m.state, "--at", str(point), "--to", dest,
                       "--json", *(["--full"] if full else []), check=False)
        assert r.returncode == 0, r.stderr
        got = tree_of(dest)
        assert got["d/f"] == then["d/f"] and got["d"][0] == "dir"
        out.check()
    # revert: an escape conflict naming the path, and nothing written
    for mounted in (False, True):
        if mounted:
            m.mount()
        try:
            live = tree_of(m.ws)
            for extra in ((), ("--json",)):
                r = overlayrec("revert", m.ws, "--call", "c1", "--yes", *extra, check=False)
                assert r.returncode == 1, r.stdout + r.stderr
                assert "escape: d/f" in r.stderr, r.stderr
                assert "Not a directory" not in r.stderr and "Traceback" not in r.stderr
                if how == "mount":
                    assert "e/g" in r.stderr.split("escape: ", 1)[1]
                assert tree_of(m.ws) == live
                out.check()
            preview = overlayrec("revert", m.ws, "--call", "c1", check=False).stdout
            assert "d/f  CONFLICT (escape)" in preview
            # --force reverts the paths without a conflict, and still never follows
            overlayrec("revert", m.ws, "--call", "c1", "--yes", "--force", check=False)
            out.check()
            assert os.path.islink(os.path.join(m.ws, "d"))
            assert open(os.path.join(m.ws, "top.txt")).read() == "top\n"
        finally:
            m.umount()
    out.check()


# -- (d) revert --continue and (e) unrevert of an interrupted revert --------------------------

def _interrupted_revert(m, tmp_path, n: int) -> None:
    """A revert of c1 (which changed d/a000 ...) killed after its first paths: the daemon is
    SIGKILLed, as in a crash; the plan stays `running` in the state dir."""
    env = dict(os.environ, OVERLAYREC_TEST_REVERT_DELAY="0.1")
    p = subprocess.Popen([sys.executable, "-m", "overlayrec", "revert", m.ws, "--call", "c1",
                          "--yes"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        first = os.path.join(m.ws, "d", "a000")
        deadline = time.monotonic() + 30 * SLOW
        while open(first).read() != "orig\n":
            assert time.monotonic() < deadline and p.poll() is None, "the revert did not start"
            time.sleep(0.02)
        pid = json.load(open(os.path.join(m.state, "daemon.json")))["pid"]
        os.kill(pid, signal.SIGKILL)
        p.wait(timeout=60 * SLOW)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0
    overlayrec("umount", m.ws)
    plans = [json.load(open(os.path.join(m.state, "reverts", n_)))
             for n_ in os.listdir(os.path.join(m.state, "reverts")) if n_.endswith(".json")]
    assert [r["status"] for r in plans] == ["running"]
    assert any(s["path"] == f"d/a{n - 1:03}" for s in plans[0]["steps"])


@needs_fuse
@pytest.mark.parametrize("how", ["mount", "around"])
@pytest.mark.parametrize("then", ["continue", "unrevert"])
def test_interrupted_revert_then_a_symlink_on_the_way(make_mount, tmpbase, tmp_path, resolver,
                                                     how, then):
    n = 30
    m, out = _mount(make_mount, tmpbase, tmp_path,
                    {f"d/a{i:03}": "orig\n" for i in range(n)} | {"z.txt": "orig\n"})
    before = tree_of(m.ws)
    try:
        run_call(m, tmp_path, "for f in d/a* z.txt; do echo changed > $f; done")
        _interrupted_revert(m, tmp_path, n)
        if how == "mount":
            m.mount()
        swap_for_symlink(m, "d", out.dir, how)
        live = tree_of(m.ws)
        out.check()
        if then == "continue":
            r = overlayrec("revert", m.ws, "--continue", check=False)
            assert r.returncode == 1, r.stdout + r.stderr
            # the plan stops at the first path it cannot reach, and stays pending
            assert "d/a000: escape: d is a symlink, not followed" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr
            assert json.loads(overlayrec("status", m.ws, "--json").stdout)["pending_revert"]
        else:
            r = overlayrec("unrevert", "-w", m.ws, "--yes", check=False)
            assert r.returncode == 1, r.stdout + r.stderr
            assert "escape: d/a000" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr
        assert tree_of(m.ws) == live
        assert os.readlink(os.path.join(m.ws, "d")) == out.dir
        out.check()
        if then == "continue":  # the user puts the directory back: the revert can finish
            m.umount()
            os.unlink(os.path.join(m.ws, "d"))
            os.mkdir(os.path.join(m.ws, "d"))
            overlayrec("revert", m.ws, "--continue")
            assert tree_of(m.ws) == before
            out.check()
    finally:
        m.umount()
    out.check()


# -- (e) unrevert of a revert that was carried out --------------------------------------------

@needs_fuse
@pytest.mark.parametrize("how", ["mount", "around"])
def test_unrevert_after_a_symlink_was_put_on_the_way(make_mount, tmpbase, tmp_path, resolver,
                                                      how):
    m, out = _mount(make_mount, tmpbase, tmp_path, {"d/f": "orig\n", "d/sub/g": "orig\n"})
    try:
        run_call(m, tmp_path, "echo changed > d/f && echo changed > d/sub/g && echo new > d/h")
        overlayrec("revert", m.ws, "--call", "c1", "--yes")
        assert open(os.path.join(m.ws, "d", "f")).read() == "orig\n"
        target = out.dir if how == "around" else out.rel_from(m.ws)
        swap_for_symlink(m, "d", target, how)
        live = tree_of(m.ws)
        for args in (("--yes",), ("--yes", "--json"), ("--yes", "--force")):
            r = overlayrec("unrevert", "-w", m.ws, *args, check=False)
            if "--force" not in args:
                assert r.returncode == 1, r.stdout + r.stderr
                assert "escape: d/f, d/h, d/sub/g" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr
            assert tree_of(m.ws) == live
            out.check()
    finally:
        m.umount()
    out.check()


@pytest.mark.timeout(120)
def test_log_json_of_an_undecodable_name_is_json_as_every_reader_writes_it(mounted):
    """`log --json` wrote a name that is not UTF-8 as its raw bytes (not JSON: no parser took
    the line) and U+2028 as is (a line cut there by readers that split at it), where every
    other reader writes escapes (found by a hunt)."""
    mounted.py("open(b'n\\xff', 'w').write('x'); open('ls\\u2028x', 'w').write('y')")
    raw = subprocess.run([sys.executable, "-m", "overlayrec", "log", mounted.ws, "--json"],
                         capture_output=True, check=True).stdout
    lines = raw.decode("ascii").splitlines()  # ASCII: every escape written out
    paths = {json.loads(line).get("path") for line in lines}
    assert os.fsdecode(b"n\xff") in paths and "ls\u2028x" in paths, paths
