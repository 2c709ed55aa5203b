"""Permissions that bind the owner, with the daemon run by that owner (not root).

Files their owner may not read (``chmod 200``): the daemon must read what a change destroys;
a write-only file's owner may write it, truncate it, remove it, rename over it, and natively all
of that succeeds.  Through the mount it did not (EACCES on the write), and once such a file was
in the record every listing failed on it.  Now the daemon grants itself the read for the moment
of its read (underlay.reopen_own), a removed one's content goes into the store (no reader could
read it from the attic), and a reader meeting a live file it may not read says so for that file
alone.  Likewise directories it may not search or list, and directories a call left read-only,
which a revert must still write into.
"""
from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
import sysconfig
import textwrap

import pytest
import overlayrec
from conftest import force_unmount, is_mounted, needs_fuse, needs_root

NOBODY = 65534

AGENT = textwrap.dedent(r'''
    import subprocess
    from overlayrec import client
    with client.connect() as c:
        c.turn_begin(prompt="unreadable files")
        for i, step in enumerate(%r, 1):
            c.call_begin(f"c{i}", "Bash", summary=step)
            subprocess.run(["bash", "-c", step], check=True)
            c.call_end(f"c{i}")
        c.turn_end()
''')

STEPS = [
    "echo new > wo",
    "printf 's\\n' > x && chmod 200 x",
    "rm -f wo big",
    "mv y wo2",
    "truncate -s 1 wo3 && printf 'more\\n' >> wo4",
]
SEED = ("printf 'secret\\n' > wo && printf 'two\\n' > wo2 && printf 'three\\n' > wo3 && "
        "printf 'four\\n' > wo4 && head -c 300000 /dev/zero | tr '\\0' b > big && "
        "printf 'y\\n' > y && chmod 200 wo wo2 wo3 wo4 big")


# the daemon's user, every process of the test: an ordinary user, or root without the
# capabilities that let it read any file (so root's own write-only files are as a user's)
OWNERS = {
    "nobody": (["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"], NOBODY),
    "root-without-dac": (["setpriv", "--bounding-set", "-dac_override,-dac_read_search",
                          "--inh-caps", "-dac_override,-dac_read_search"], 0),
}


class Owner:
    """A workspace, its state dir and its XDG state home, all the owner's, and every command
    (overlayrec, the agent, the shell) run as that owner."""

    def __init__(self, tmpbase: str, owner: str):
        self.prefix, uid = OWNERS[owner]
        self.python, path = self._python(uid)
        self.base = os.path.join(tmpbase, "u")
        self.ws, self.sd, xdg = (os.path.join(self.base, d) for d in ("ws", "sd", "xdg"))
        for d in (self.base, self.ws, xdg):
            os.mkdir(d)
            os.chown(d, uid, uid)
        self.env = dict(os.environ, XDG_STATE_HOME=xdg, HOME=self.base)
        if path is not None:
            self.env["PYTHONPATH"] = path

    def _python(self, uid: int) -> tuple[str, str | None]:
        """A Python the owner can run, with this checkout's packages: the tests' own, or,
        where a directory on the way to its interpreter is closed to the owner (a pyenv under
        /root), the system's of the same version given the venv's packages and the checkout
        (on PYTHONPATH, which the daemon and the agent inherit).  Skips the test when there is
        none."""
        # the daemon and the agent are started by an overlayrec process, not by setpriv
        probe = ["sh", "-c", 'exec "$0" -c "import lmdb, pyfuse3, overlayrec.daemon"']
        if not self.run(probe + [sys.executable], check=False).returncode:
            return sys.executable, None
        system = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
        path = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(
            overlayrec.__file__))), sysconfig.get_paths()["purelib"]])
        r = subprocess.run([*self.prefix, "env", f"PYTHONPATH={path}", *probe, system],
                           capture_output=True, text=True, timeout=60)
        if r.returncode:
            pytest.skip(f"neither {sys.executable} nor {system} can be run by uid {uid} with "
                        f"this checkout (a directory on its way): {r.stderr.strip()[-200:]}")
        return system, path

    def run(self, args, cwd=None, check=True):
        r = subprocess.run([*self.prefix, *args], capture_output=True, text=True,
                           env=getattr(self, "env", None), cwd=cwd, timeout=90)
        if check and r.returncode != 0:
            raise AssertionError(f"{args} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def sh(self, script: str):
        # entered by the owner: root may not enter another user's mount (no allow_other)
        return self.run(["bash", "-c", f"cd {shlex.quote(self.ws)} && {script}"], cwd=self.base)

    def ask(self, *args, check=True):
        return self.run([self.python, "-m", "overlayrec", *args], cwd=self.base, check=check)

    def agent(self, steps: list[str]) -> None:
        """One session, a call for each step (every step must succeed, as natively)."""
        self.run([self.python, "-m", "overlayrec", "run", "--state-dir", self.sd,
                  "--session", "s", "--", self.python, "-c", AGENT % (steps,)], cwd=self.ws)

    def refused(self, *args, needles=()) -> str:
        """``overlayrec ARGS`` refused in one line, no traceback: the line."""
        r = self.ask(*args, check=False)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        for n in needles:
            assert n in lines[0], lines[0]
        return lines[0]

    def umount(self) -> None:
        if is_mounted(self.ws):
            self.ask("umount", self.ws, check=False)
        force_unmount(self.ws)

    def daemon_log(self) -> str:
        with open(os.path.join(self.sd, "daemon.log")) as f:
            return f.read()


def tree(ws: str) -> dict:
    """Every file as root reads it: mode and content (the attic left out)."""
    return {p: (m, d) for p, (m, d) in held(tree_of(ws)).items() if d is not None}


def held(snapshot: dict) -> dict:
    """A ``tree_of`` snapshot without the inode numbers: what each path holds."""
    return {p: (m, d) for p, (m, _, d) in snapshot.items()}


@needs_fuse
@needs_root
@pytest.mark.parametrize("owner", sorted(OWNERS))
def test_write_only_files_are_recorded_read_and_reverted_by_their_owners_daemon(tmpbase, owner):
    u = Owner(tmpbase, owner)
    ws, sd, ask = u.ws, u.sd, u.ask
    u.sh(SEED)
    before = tree(ws)
    try:
        u.agent(STEPS)
        after = tree(ws)
        assert after["x"] == ("0o100200", b"s\n") and "wo" not in after and "big" not in after
        assert after["wo2"] == ("0o100644", b"y\n")
        assert after["wo3"][1] == b"t" and after["wo4"][1] == b"four\nmore\n"

        listed = [json.loads(line) for line in ask("calls", ws, "--json").stdout.splitlines()]
        assert [c["id"] for c in listed] == [f"c{i}" for i in range(1, 6)]
        # each call's diff holds what was there: the pre-images the daemon read
        d1 = ask("diff", ws, "--call", "c1").stdout
        assert "-secret" in d1 and "+new" in d1
        d3 = ask("diff", ws, "--call", "c3", "--numstat").stdout.split("\n")
        assert "0\t1\two" in d3 and "0\t1\tbig" in d3, d3
        d5 = ask("diff", ws, "--call", "c5").stdout
        assert "-three" in d5 and "+more" in d5

        ask("mount", ws, "--state-dir", sd)
        for i in range(5, 0, -1):
            ask("revert", ws, "--call", f"c{i}", "--yes")
        ask("umount", ws)
        assert tree(ws) == before

        ask("mount", ws, "--state-dir", sd)
        for _ in range(5):
            ask("unrevert", ws, "--yes")
        ask("umount", ws)
        assert tree(ws) == after

        # an edit while unmounted, to a file no reader may read: named, never guessed
        u.sh("printf 'other\\n' > x")
        r = ask("diff", ws, "--call", "c2")
        assert "+s" in r.stdout and "Traceback" not in r.stderr
        r = ask("diff", ws, "--drift", "--json")
        assert json.loads(r.stdout)["unreadable"] == ["x"]
        ask("mount", ws, "--state-dir", sd)
        u.refused("revert", ws, "--call", "c2", "--yes",
                  needles=("unrecorded: x", "no read permission"))
        ask("umount", ws)
        assert tree(ws)["x"] == ("0o100200", b"other\n")
        assert "Traceback" not in u.daemon_log()
    finally:
        u.umount()


@needs_fuse
@needs_root
@pytest.mark.parametrize("owner", sorted(OWNERS))
def test_directories_their_owner_may_not_search_or_list(tmpbase, owner):
    """``chmod 600 d`` (no search) and ``chmod 000 d`` (no listing either) by a call: the daemon
    seals what lies beneath (it took them for absent, or could not seal: an edit there while
    unmounted was then the call's own), and a reader never takes what it cannot see for
    absent or empty: it names the paths, and a revert refuses them until they can be seen."""
    u = Owner(tmpbase, owner)
    ws, ask = u.ws, u.ask
    u.sh("mkdir d e && echo a > d/f && echo b > e/g")
    try:
        u.agent(["echo s > d/f && echo t > d/h && chmod 600 d", "mv e e2 && chmod 000 e2"])
        assert "cannot seal" not in u.daemon_log()

        d1 = ask("diff", ws, "--call", "c1").stdout
        assert "-a\n+s" in d1 and "+t" in d1
        r = ask("diff", ws, "--call", "c2", "--json")
        got = json.loads(r.stdout)
        assert got["unreadable"] == ["e2"]
        assert "empty" not in json.dumps(got["not_in_patch"])
        # status says which sealed paths it could not look at for drift (it said nothing,
        # where `diff --drift` names them; found by a bug hunt)
        st = json.loads(ask("status", ws, "--json").stdout)
        assert {"d/f", "d/h"} <= set(st["drift_unchecked"]), st
        assert "drift not checked: " in ask("status", ws).stdout
        # the live tree copied whole past a directory listed but not searchable, and what
        # lies in it given from the record (replay --full failed: "f: Permission denied";
        # found by a bug hunt)
        r = ask("replay", ws, "--to", os.path.join(u.base, "then"), "--full", check=False)
        assert r.returncode == 0, r
        with open(os.path.join(u.base, "then", "d", "h"), "rb") as f:
            assert f.read() == b"t\n"
        # a directory it may not list is said so, and inexact (a file beneath it the record
        # never touched was left out without a word; found by a bug hunt)
        out = json.loads(ask("replay", ws, "--to", os.path.join(u.base, "then2"), "--full",
                             "--json").stdout)
        assert [n["path"] for n in out["unlisted"]] == ["e2"] and "e2" in out["inexact"], out
        assert "not listed (1): e2" in r.stdout, r.stdout

        # an edit beneath the unsearchable directory while unmounted: drift, found at the mount
        u.sh("chmod 700 d && echo evil > d/h && chmod 600 d")
        ask("mount", ws, "--state-dir", u.sd)
        assert " drift " in ask("log", ws).stdout

        for call, note in (("c1", "cannot be reached"), ("c2", "cannot be listed")):
            u.refused("revert", ws, "--call", call, "--yes", needles=(note,))

        # once they can be seen: the user's edit is a conflict and stays, the rest goes back
        u.sh("chmod 700 d e2")
        ask("revert", ws, "--call", "c1", "--force", "--yes")
        ask("revert", ws, "--call", "c2", "--force", "--yes")
        ask("umount", ws)
        for rel, want in (("d/f", b"a\n"), ("d/h", b"evil\n"), ("e/g", b"b\n")):
            with open(os.path.join(ws, rel), "rb") as f:
                assert f.read() == want, rel
        assert "Traceback" not in u.daemon_log()
    finally:
        u.umount()


@needs_fuse
@needs_root
@pytest.mark.parametrize("owner", sorted(OWNERS))
def test_a_file_of_another_owner_that_none_may_read(tmpbase, owner):
    """Left by another user (a container's root, say) with mode 0600 where the owner may
    remove and rename it: recorded (the attic keeps it, by a rename), and every reader answers,
    naming the one file whose content no reader may see; a revert refuses to guess it."""
    u = Owner(tmpbase, owner)
    other = 0 if OWNERS[owner][1] else NOBODY
    u.sh("mkdir sub && echo mine > mine")
    for rel in ("theirs", "sub/theirs2"):
        with open(os.path.join(u.ws, rel), "w") as f:
            f.write("not yours\n")
        os.chmod(os.path.join(u.ws, rel), 0o600)
        os.chown(os.path.join(u.ws, rel), other, other)
    try:
        u.agent(["rm -f theirs && echo more >> mine", "mv sub/theirs2 sub/moved"])
        assert len(u.ask("calls", u.ws, "--json").stdout.splitlines()) == 2
        r = u.ask("diff", u.ws, "--call", "c1")
        assert "+more" in r.stdout and "Traceback" not in r.stderr
        assert f"cannot be read: no read permission on it (owned by uid {other}): theirs" \
            in r.stderr
        r = u.ask("diff", u.ws, "--call", "c2", "--json")
        assert json.loads(r.stdout)["unreadable"] == ["sub/moved"]
        u.ask("mount", u.ws, "--state-dir", u.sd)
        u.refused("revert", u.ws, "--call", "c1", "--yes", needles=("unrecorded: theirs",))
        u.ask("revert", u.ws, "--call", "c1", "--force", "--yes")
        u.ask("umount", u.ws)
        with open(os.path.join(u.ws, "mine")) as f:
            assert f.read() == "mine\n"
        assert "Traceback" not in u.daemon_log()
    finally:
        u.umount()


def _beneath(ws: str):
    """(relative path, lstat, full path, listed by os.walk among the files) of everything
    beneath ``ws``, the attic left out."""
    for top, dirs, files in os.walk(ws):
        dirs[:] = [d for d in dirs if d != ".overlayrec-attic"]
        for name in dirs + files:
            p = os.path.join(top, name)
            yield os.path.relpath(p, ws), os.lstat(p), p, name in files


def tree_of(ws: str) -> dict:
    """Every path beneath ``ws`` as root reads it: mode, inode, content (the attic left out)."""
    out = {}
    for rel, st, p, in_files in _beneath(ws):
        data = None
        if in_files:
            with open(p, "rb") as f:
                data = f.read()
        out[rel] = (oct(st.st_mode), st.st_ino, data)
    return out


@needs_fuse
@needs_root
@pytest.mark.parametrize("owner", sorted(OWNERS))
def test_a_directory_left_read_only_is_reverted_into(tmpbase, owner):
    """A call leaves ``chmod 555 d``; reverting a later call that chmodded or wrote a file in d
    wrote a temporary file beside it and stopped, pending, on EACCES (naming the temporary
    file); reverting the first removed d's new file before giving d its mode back."""
    u = Owner(tmpbase, owner)
    u.sh("mkdir d && echo a > d/a")
    before = tree_of(u.ws)
    try:
        u.agent(["echo x > d/f && echo b > d/a && chmod 555 d", "chmod 444 d/a",
                 "echo q > d/f"])
        after = tree_of(u.ws)
        u.ask("mount", u.ws, "--state-dir", u.sd)
        for i in (3, 2, 1):
            u.ask("revert", u.ws, "--call", f"c{i}", "--yes")
        for _ in range(3):
            u.ask("unrevert", u.ws, "--yes")
        u.ask("umount", u.ws)
        now = tree_of(u.ws)
        assert held(now) == held(after)
        # a mode put back in place: the file is the same inode (its links, its attributes)
        u.ask("mount", u.ws, "--state-dir", u.sd)
        u.ask("revert", u.ws, "--call", "c2", "--yes")
        u.ask("umount", u.ws)
        assert tree_of(u.ws)["d/a"][1] == now["d/a"][1]
        u.ask("mount", u.ws, "--state-dir", u.sd)
        for i in (3, 1):
            u.ask("revert", u.ws, "--call", f"c{i}", "--yes")
        u.ask("umount", u.ws)
        assert held(tree_of(u.ws)) == held(before)
        assert "Traceback" not in u.daemon_log()
    finally:
        u.umount()


@needs_fuse
@needs_root
@pytest.mark.parametrize("owner", sorted(OWNERS))
def test_a_workspace_made_read_only_is_mounted_again_to_revert_it(tmpbase, owner):
    """`chmod -R a-w .` by an agent: fusermount3 mounts only where its user may write, so the
    workspace could not be mounted again, not even to revert that chmod ("fuse_session_mount
    failed").  Now it mounts, and the revert gives every mode back, the root's included."""
    u = Owner(tmpbase, owner)
    u.sh("echo a > f && mkdir d && echo b > d/g")
    before = tree_of(u.ws)
    root_mode = os.stat(u.ws).st_mode
    try:
        u.agent(["echo c > new && chmod -R a-w ."])
        assert os.stat(u.ws).st_mode & 0o777 == 0o555
        u.ask("mount", u.ws, "--state-dir", u.sd)
        u.ask("revert", u.ws, "--call", "c1", "--yes")
        u.ask("umount", u.ws)
        assert held(tree_of(u.ws)) == held(before)
        assert os.stat(u.ws).st_mode == root_mode
        assert "Traceback" not in u.daemon_log()
    finally:
        u.umount()


def kinds_of(ws: str) -> dict:
    """Every path beneath ``ws`` as root reads it, fifos and symlinks too: kind and mode, a
    file's content, a symlink's target (the attic left out)."""
    out = {}
    for rel, st, p, _ in _beneath(ws):
        what = None
        if stat.S_ISREG(st.st_mode):
            with open(p, "rb") as f:
                what = f.read()
        elif stat.S_ISLNK(st.st_mode):
            what = os.readlink(p)
        out[rel] = (oct(st.st_mode), what)
    return out


@needs_fuse
@needs_root
@pytest.mark.parametrize("owner", sorted(OWNERS))
def test_other_shapes_beneath_a_directory_its_owner_may_not_search(tmpbase, owner):
    """Beneath a directory a call leaves unsearchable (``chmod 600 d``): a path of some 3,800
    bytes, a fifo, a symlink to a directory outside the workspace that its owner may not
    search either, and a symlink to ``d`` itself.  The seals hold (none fails, none blocks on
    the fifo), nothing outside the workspace has its mode moved, and once ``d`` may be searched
    again a revert of the call gives back the tree as it was (but for ``d``'s mode, which the
    user set since: a conflict the revert leaves)."""
    u = Owner(tmpbase, owner)
    outside = os.path.join(u.base, "outside")
    os.mkdir(outside, 0o600)
    os.chown(outside, *(os.stat(u.ws).st_uid,) * 2)
    deep = "/".join(["x" * 200] * 19)
    u.sh(f"mkdir -p d/{deep} && echo a > d/{deep}/f && echo k > d/k")
    before = kinds_of(u.ws)
    try:
        u.agent([f"echo b > d/{deep}/f && mkfifo d/p && ln -s {outside} d/out && ln -s d s && "
                 "echo c > d/k && chmod 600 d"])
        log = u.daemon_log()
        assert "cannot seal" not in log and "Traceback" not in log, log[-2000:]
        assert oct(os.stat(outside).st_mode) == oct(stat.S_IFDIR | 0o600)
        got = json.loads(u.ask("diff", u.ws, "--call", "c1", "--json").stdout)
        changed = {f["path"] for f in got["files"]} | {x["path"] for x in got["not_in_patch"]}
        assert {f"d/{deep}/f", "d/k", "d/p", "d/out", "s"} <= changed, sorted(changed)
        u.sh("chmod 700 d")
        u.ask("mount", u.ws, "--state-dir", u.sd)
        u.ask("revert", u.ws, "--call", "c1", "--force", "--yes")
        u.ask("umount", u.ws)
        now = kinds_of(u.ws)
        assert now.pop("d") == (oct(stat.S_IFDIR | 0o700), None)
        before.pop("d")
        assert now == before
        assert oct(os.stat(outside).st_mode) == oct(stat.S_IFDIR | 0o600)
    finally:
        u.umount()


@needs_fuse
def test_another_users_mount_is_not_theirs_to_unmount(make_mount, tmpbase):
    """root's mount, and `overlayrec umount` by nobody: it ran fusermount3, which said "entry
    not found in /etc/mtab"; it says whose the mount is, in one line, and the mount stays."""
    m = make_mount().mount()
    nobody = Owner(tmpbase, "nobody")
    r = nobody.ask("umount", m.ws, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "is mounted by another user (uid 0): only that user, or root, can unmount it" \
        in lines[0], r.stderr
    assert is_mounted(m.ws)


@needs_fuse
def test_another_users_recorded_workspace_is_not_theirs_to_mount(make_mount, tmpbase):
    """root's recorded workspace, unmounted, and `overlayrec mount` by nobody: "mount failed:
    [Errno 13] Permission denied: '.'" (its attic is root's alone), a traceback in the log.
    It says whose the workspace is, in one line.  Found by a bug hunt."""
    m = make_mount().mount()
    with open(os.path.join(m.ws, "a"), "w") as f:
        f.write("a\n")
    m.umount()
    os.chmod(m.base, 0o755)
    os.chmod(m.ws, 0o755)
    nobody = Owner(tmpbase, "nobody")
    r = nobody.ask("mount", m.ws, "--state-dir", nobody.sd, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert f"cannot mount {m.ws}: {m.ws} is uid 0's, not this user's (uid {NOBODY})" in \
        lines[0], r.stderr
    assert not is_mounted(m.ws)
    with open(os.path.join(nobody.sd, "daemon.log")) as f:
        assert "Traceback" not in f.read()


@needs_fuse
@needs_root
@pytest.mark.parametrize("owner", sorted(OWNERS))
def test_a_selection_that_closed_a_directory_is_planned(tmpbase, owner):
    """A call wrote beneath d and left it `chmod 000`: its revert, even the preview, failed as
    the owner with "d/s: Permission denied" (looking for a symlink on the way), so an agent's
    `chmod -R 000` could not be undone.  It plans: what lies beneath names what stops it
    (cannot be reached), and d's own mode goes back.  Found by a bug hunt."""
    u = Owner(tmpbase, owner)
    u.sh("mkdir -p d/s && echo old > d/f && echo x > d/s/x")
    try:
        u.agent(["echo new > d/f && echo newx > d/s/x && chmod 000 d"])
        r = u.ask("revert", u.ws, "--call", "c1", "--json", check=False)
        assert "Permission denied" not in r.stderr and "Traceback" not in r.stderr, r.stderr
        steps = {s["path"]: s for s in json.loads(r.stdout)["steps"]}
        assert steps["d"]["conflict"] is None, steps
        assert {steps[p]["conflict"] for p in ("d/f", "d/s/x")} == {"unrecorded"}, steps
        assert "cannot be reached" in steps["d/f"]["note"], steps
    finally:
        u.umount()


@needs_fuse
@needs_root
@pytest.mark.parametrize("owner", sorted(OWNERS))
def test_a_directory_the_revert_removes_is_opened_first(tmpbase, owner):
    """A call made a directory with a file in it and left it `chmod 500`: its revert, which
    removes both, stopped half way, pending, asking the user to make writable the directory
    it was removing (its preview had promised a clean revert).  It opens it first.  Found by
    a bug hunt."""
    u = Owner(tmpbase, owner)
    u.sh("echo keep > k")
    try:
        u.agent(["mkdir e && echo x > e/f && chmod 500 e", "mkdir g && echo y > g/h && "
                 "mv g g2 && chmod 500 g2"])
        for call in ("c2", "c1"):
            r = u.ask("revert", u.ws, "--call", call, "--yes", check=False)
            assert r.returncode == 0, r
        u.ask("umount", u.ws, check=False)
        assert sorted(n for n in os.listdir(u.ws) if not n.startswith(".overlayrec")) == \
            ["k"], os.listdir(u.ws)
    finally:
        u.umount()


@pytest.mark.parametrize("kind", ["create", "mkdir", "symlink"])
def test_what_another_user_makes_is_gone_when_its_owner_cannot_be_given(tmp_path, monkeypatch,
                                                                         kind):
    """A daemon that is not root serves another user through allow_other: what that user makes
    gets their owner by a chown after it is made, which such a daemon may not give.  The
    request failed (EPERM) and left an empty file of the daemon's user behind, which no event
    of the record held.  Found by a bug hunt.  What was made goes again."""
    from conftest import plain_recorder
    ws = tmp_path / "ws"
    with plain_recorder(tmp_path) as (rec, root_fd):
        j = rec.journal

        def refused(*a, **kw):  # what os.chown answers a daemon that is not root
            raise PermissionError(1, "Operation not permitted")
        monkeypatch.setattr(os, "chown", refused)
        actor = rec.attribution.actor(os.getpid())
        with pytest.raises(PermissionError):
            if kind == "create":
                os.close(rec.create(root_fd, "x", os.O_WRONLY | os.O_CREAT, 0o644, NOBODY,
                                    NOBODY, actor))
            elif kind == "mkdir":
                rec.mkdir(root_fd, "x", 0o755, NOBODY, NOBODY, actor)
            else:
                rec.symlink(root_fd, "x", "target", NOBODY, NOBODY, actor)
        assert not os.path.lexists(ws / "x")
        evs = [j.event(s) for s in range(1, j.last_seq() + 1)]
        made = [e for e in evs if e.get("path") == "x" and e["op"] != "failed"]
        failed = {e["ref"] for e in evs if e["op"] == "failed"}
        assert made and all(e["seq"] in failed for e in made), evs


OTHERS_STEPS = [
    # GNU sed's temp file renamed over a readable file past the small-file size, not its own
    "sed -i s/a/b/ big",
    # renamed over a small file its owner may not read
    "echo new > n && mv -f n hidden",
    # utimensat(NULL): write permission suffices natively
    "touch -c shared",
]


def _others_files(ws: str, other: int) -> None:
    for name, mode, data in (("big", 0o644, b"a\n" * 200_000), ("hidden", 0o600, b"h\n"),
                             ("shared", 0o666, b"s\n")):
        p = os.path.join(ws, name)
        with open(p, "wb") as f:
            f.write(data)
        os.chmod(p, mode)
        os.chown(p, other, other)
        os.utime(p, ns=(10**18, 10**18))


@needs_fuse
@needs_root
@pytest.mark.parametrize("owner", sorted(OWNERS))
def test_another_owners_files_renamed_over_and_touched(tmpbase, owner):
    """Files another user left where the owner may replace them (its directory) or write them
    (mode 666): natively `sed -i` and `mv -f` over them and `touch` of them succeed.  Through a
    daemon not root they failed: the attic's hard link of the renamed-over file met
    ``protected_hardlinks`` (EPERM), and the kernel's "now" came to the daemon as explicit
    times, which only the file's owner may set.  The replaced file goes to the attic by an
    exchange of names now, the times as "now"; the record and a revert give the tree back."""
    u = Owner(tmpbase, owner)
    other = 0 if OWNERS[owner][1] else NOBODY
    native = os.path.join(u.base, "native")
    os.mkdir(native)
    os.chown(native, *(os.stat(u.ws).st_uid,) * 2)
    for d in (native, u.ws):
        _others_files(d, other)
    before = tree_of(u.ws)
    u.run(["bash", "-c", " && ".join(OTHERS_STEPS)], cwd=native)  # natively they succeed
    try:
        u.agent(OTHERS_STEPS)
        after = tree_of(u.ws)
        assert held(after) == held(tree_of(native))
        assert after["big"][2] == b"b\n" * 200_000 and after["hidden"][2] == b"new\n"
        assert os.stat(os.path.join(u.ws, "shared")).st_mtime_ns > 10**18
        assert len(u.ask("calls", u.ws, "--json").stdout.splitlines()) == 3
        r = u.ask("diff", u.ws, "--call", "c1")
        assert "-a\n+b\n" in r.stdout, r.stdout[:500]
        assert "hidden" in u.ask("diff", u.ws, "--call", "c2", "--stat").stdout
        u.ask("mount", u.ws, "--state-dir", u.sd)
        r = u.ask("revert", u.ws, "--call", "c1", "--yes", check=False)
        u.ask("umount", u.ws)
        assert held(tree_of(u.ws))["big"][1] == before["big"][2]
        if OWNERS[owner][1]:  # a user may not give the file back to root: said, not hidden
            assert r.returncode == 1 and "overlayrec: error: 1 path(s) restored but not " \
                "whole: big: owner 0:0 not set (Operation not permitted)" in r.stderr, r.stderr
        else:
            assert r.returncode == 0 and os.stat(os.path.join(u.ws, "big")).st_uid == other
        assert "Traceback" not in u.daemon_log()
        assert "unexpected" not in u.daemon_log()
    finally:
        u.umount()


@needs_fuse
@needs_root
@pytest.mark.parametrize("owner", sorted(OWNERS))
def test_a_write_only_file_rewritten_by_two_calls_has_no_other_writer(tmpbase, owner):
    """A file its owner may only write (``chmod 200``), rewritten by one call and again by the
    next a second later: the daemon's own read of it (the mode granted for the read and put
    back) moved its ctime, and the second call's change found "another writer around the
    mount" (a drift of the outside unit in the log, blame naming it)."""
    u = Owner(tmpbase, owner)
    u.sh("printf 'one\\n' > wo && chmod 200 wo")
    try:
        u.agent(["printf 'two\\n' > wo", "sleep 1.2 && printf 'three\\n' > wo",
                 "sleep 1.2 && printf 'four\\n' >> wo"])
        events = [json.loads(line) for line in u.ask("log", u.ws, "--json").stdout.splitlines()]
        assert [e for e in events if e.get("op") == "drift"] == [], " ".join(f'{e["op"]}:{e.get("path")}:{e.get("seq")}' for e in events)
        assert "-two\n+three" in u.ask("diff", u.ws, "--call", "c2").stdout
        assert tree(u.ws)["wo"] == ("0o100200", b"three\nfour\n")
    finally:
        u.umount()


@needs_fuse
@needs_root
@pytest.mark.parametrize("owner", sorted(OWNERS))
def test_another_owners_file_in_a_sticky_directory_is_reverted(tmpbase, owner):
    """A sticky directory (``/tmp``'s mode, 1777) of another user holding a file of a third
    party that anyone may write: a call rewrites it (natively allowed), and its revert wrote a
    temporary file to rename over it, which the sticky bit refuses (EPERM): the revert stayed
    pending.  Where nothing but that rename is refused, the content goes into the file."""
    u = Owner(tmpbase, owner)
    uid = OWNERS[owner][1]
    dir_owner, file_owner = (0, 1) if uid else (NOBODY, 1)
    d = os.path.join(u.ws, "shared")
    os.mkdir(d)
    os.chmod(d, 0o1777)
    os.chown(d, dir_owner, dir_owner)
    p = os.path.join(d, "theirs")
    with open(p, "w") as f:
        f.write("theirs\n")
    os.chmod(p, 0o666)
    os.chown(p, file_owner, file_owner)
    before = tree_of(u.ws)
    try:
        u.agent(["echo mine > shared/theirs"])
        assert tree_of(u.ws)["shared/theirs"][2] == b"mine\n"
        u.ask("mount", u.ws, "--state-dir", u.sd)
        r = u.ask("revert", u.ws, "--call", "c1", "--yes", check=False)
        st = json.loads(u.ask("status", u.ws, "--json").stdout)
        u.ask("umount", u.ws)
        assert held(tree_of(u.ws)) == held(before), r.stderr
        assert r.returncode == 0, r.stderr
        assert not st.get("pending_revert"), st
    finally:
        u.umount()


@needs_fuse
@needs_root
@pytest.mark.parametrize("owner", sorted(OWNERS))
def test_renamed_over_from_a_sticky_directory_of_another_user(tmpbase, owner):
    """`mv -f tmp/src target`: the owner's file in a sticky directory of another user, moved
    over a file of that user the owner may not read.  The attic may not link `target`
    (protected_hardlinks), and the exchange of names that keeps it otherwise left the two
    files swapped: the move of the old target out of the sticky directory was refused, and
    so was the exchange back (mv failed, the workspace changed, the record said nothing;
    found by a bug hunt).  It succeeds as natively, its state before said to be unknown."""
    u = Owner(tmpbase, owner)
    uid = OWNERS[owner][1]
    other = 0 if uid else NOBODY
    native = os.path.join(u.base, "native")
    os.mkdir(native)
    os.chown(native, *(os.stat(u.ws).st_uid,) * 2)
    for w in (native, u.ws):
        os.mkdir(os.path.join(w, "tmp"))
        os.chmod(os.path.join(w, "tmp"), 0o1777)
        os.chown(os.path.join(w, "tmp"), other, other)
        for rel, data, who, mode in (("target", "theirs\n", other, 0o600),
                                     ("tmp/src", "mine\n", uid, 0o644)):
            with open(os.path.join(w, rel), "w") as f:
                f.write(data)
            os.chmod(os.path.join(w, rel), mode)
            os.chown(os.path.join(w, rel), who, who)
    u.run(["mv", "-f", "tmp/src", "target"], cwd=native)  # natively it succeeds
    try:
        u.agent(["mv -f tmp/src target"])
        assert held(tree_of(u.ws)) == held(tree_of(native))
        assert tree_of(u.ws)["target"][2] == b"mine\n"
        r = u.ask("diff", u.ws, "--call", "c1", "--name-status")
        assert "target" in r.stdout and "tmp/src" in r.stdout, r.stdout
        assert "Traceback" not in u.daemon_log()
    finally:
        u.umount()


@needs_fuse
@needs_root
def test_a_symlink_renamed_over_in_a_sticky_directory_is_not_written_as_a_file(tmpbase):
    """`mv -f R tmp/L`: another user's writable file moved over the owner's symlink in a
    sticky directory of that user.  The revert may not rename over `tmp/L` (sticky), and
    its fallback wrote the symlink's target text into the file (found by a bug hunt).  It
    refuses that path in one line and leaves the file and no temporary file."""
    u = Owner(tmpbase, "nobody")
    tmp = os.path.join(u.ws, "tmp")
    os.mkdir(tmp)
    os.chmod(tmp, 0o1777)
    with open(os.path.join(u.ws, "R"), "w") as f:
        f.write("root file\n")
    os.chmod(os.path.join(u.ws, "R"), 0o666)
    u.sh("ln -s /etc/hostname tmp/L")
    try:
        u.agent(["mv -f R tmp/L"])
        after = tree_of(u.ws)
        u.ask("mount", u.ws, "--state-dir", u.sd)
        r = u.ask("revert", u.ws, "--call", "c1", "--yes", check=False)
        assert r.returncode == 1 and "tmp/L" in r.stderr and "Traceback" not in r.stderr
        u.ask("umount", u.ws)
        assert tree_of(u.ws)["tmp/L"] == after["tmp/L"]  # the same file, as it was
        assert sorted(os.listdir(tmp)) == ["L"]
    finally:
        u.umount()
