"""Revert and unrevert: exact, conflict-checked, safe, and crash-safe."""
from __future__ import annotations

import contextlib
import json
import os
import stat
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import (SLOW, needs_fuse, overlayrec, is_mounted, run_script,
                      run_with_outside_step, wait_unmounted)
from test_replay import tree_of

pytestmark = needs_fuse

CALL = textwrap.dedent(r'''
    import subprocess, sys
    from overlayrec import client
    with client.connect() as c:
        c.call_begin("c1", "Bash")
        subprocess.run(["bash", "-c", sys.argv[1]], check=True)
        c.call_end("c1")
''')


def setup_ws(make_mount, tmp_path, files=None):
    m = make_mount()
    for p, data in (files or {"a.txt": b"one\n", "k.txt": b"keep\n", "mode.sh": b"x\n",
                              "mv.txt": b"moving\n", "olddir/inner": b"i\n"}).items():
        full = os.path.join(m.ws, p)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)
    (tmp_path / "call.py").write_text(CALL)
    return m


def run_call(m, tmp_path, script):
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable,
               str(tmp_path / "call.py"), script, cwd=m.ws)


EVERYTHING = ("sed -i s/one/ONE/ a.txt && echo new > n.txt && rm k.txt && mkdir -p d/e && "
              "echo x > d/e/f && ln -s a.txt l && chmod 755 mode.sh && mv mv.txt moved.txt && "
              "rm -r olddir && printf '\\x00\\x01' > bin")


def test_revert_and_unrevert_every_kind_of_change(make_mount, tmp_path):
    m = setup_ws(make_mount, tmp_path)
    m.mount()
    before = tree_of(m.ws)
    run_call(m, tmp_path, EVERYTHING)
    after = tree_of(m.ws)
    assert after != before
    preview = overlayrec("revert", m.ws, "--call", "c1").stdout
    assert "preview only" in preview and tree_of(m.ws) == after  # a preview writes nothing
    js = json.loads(overlayrec("revert", m.ws, "--call", "c1", "--json").stdout)
    # `mv mv.txt moved.txt` is renamed back
    assert {s["action"] for s in js["steps"]} == {"replace", "create", "delete", "rename"}
    assert [(s["path"], s["from"]) for s in js["steps"] if s["action"] == "rename"] == [
        ("mv.txt", "moved.txt")], js
    out = overlayrec("revert", m.ws, "--call", "c1", "--yes").stdout
    assert "reverted" in out
    assert tree_of(m.ws) == before
    rid = out.split()[-1]
    # the revert's own changes are journaled as its unit
    evs = m.events()
    assert any(e.get("unit") == f"revert:{rid}" for e in evs)
    overlayrec("unrevert", m.ws, "--yes")  # the workspace as revert takes it, too
    assert tree_of(m.ws) == after
    # reverts stack: revert again, unrevert again
    overlayrec("revert", m.ws, "--call", "c1", "--yes", "--force")
    assert tree_of(m.ws) == before


CALL_N = textwrap.dedent(r'''
    import subprocess, sys
    from overlayrec import client
    with client.connect() as c:
        c.call_begin(sys.argv[1], "Bash")
        subprocess.run(["bash", "-c", sys.argv[2]], check=True)
        c.call_end(sys.argv[1])
''')


def test_unrevert_peels_stacked_reverts_newest_first(make_mount, tmp_path):
    """Three calls reverted one after another, newest first, then ``unrevert`` three times:
    each undoes the next revert down the stack, and a fourth finds none left.  Found by hand:
    the second unrevert undid the first one (an unrevert is itself a revert, and it was the
    newest not undone), so the tree went back and forth between two states.  Naming an
    unrevert still undoes it."""
    m = setup_ws(make_mount, tmp_path)
    (tmp_path / "calln.py").write_text(CALL_N)
    m.mount()
    trees = [tree_of(m.ws)]
    for i, script in enumerate(["echo two >> a.txt",
                                "mkdir -p new && echo n > new/f && mv mv.txt new/",
                                "rm k.txt && chmod 755 mode.sh && rm -r olddir"], 1):
        overlayrec("run", "-w", m.ws, "--session", f"s{i}", "--", sys.executable,
                   str(tmp_path / "calln.py"), f"c{i}", script, cwd=m.ws)
        trees.append(tree_of(m.ws))
    assert len({repr(t) for t in trees}) == 4
    reverted = {}
    for i in (3, 2, 1):
        out = overlayrec("revert", m.ws, "--call", f"c{i}", "--yes").stdout
        out = out.strip().splitlines()[-1]  # after the plan's lines: the summary
        assert out.startswith("reverted "), out
        reverted[i] = out.split()[-1]
        assert tree_of(m.ws) == trees[i - 1], i
    unreverts = []
    for i in (1, 2, 3):
        out = overlayrec("unrevert", "-w", m.ws, "--yes").stdout.strip().splitlines()[-1]
        # the summary says which revert it undid (it is a revert itself: its own id last)
        assert out.startswith(f"unreverted {reverted[i]}: restored "), out
        unreverts.append(out.split()[-1])
        assert tree_of(m.ws) == trees[i], i
    r = overlayrec("unrevert", "-w", m.ws, "--yes", check=False)
    assert r.returncode != 0 and r.stderr.strip().endswith("no revert to undo"), r.stderr
    out = overlayrec("unrevert", unreverts[-1], "-w", m.ws, "--yes").stdout  # that one undone
    out = out.strip().splitlines()[-1]
    assert out.startswith(f"unreverted {unreverts[-1]}: restored "), out
    assert tree_of(m.ws) == trees[2]


def test_a_forced_revert_that_changed_nothing_is_passed_by(make_mount, tmp_path):
    """Revert A takes a session back; a forced revert B of an earlier session whose every path
    is a conflict (edited while unmounted) changes nothing; then ``unrevert`` undoes A.  It
    said "nothing to revert" for good: B was the newest not undone, and undoing it did
    nothing."""
    m = make_mount()
    for name in ("f", "g"):
        with open(os.path.join(m.ws, name), "w") as f:
            f.write("base\n")
    m.mount()
    for sid, name in (("s1", "g"), ("s2", "f")):
        overlayrec("run", "-w", m.ws, "--session", sid, "--", "sh", "-c",
                   f"echo {sid} >> {name}", cwd=m.ws)
    overlayrec("revert", m.ws, "--session", "s2", "--yes")
    m.umount()
    with open(os.path.join(m.ws, "g"), "a") as f:
        f.write("user\n")
    m.mount()
    r = overlayrec("revert", m.ws, "--session", "s1", "--yes", "--force")
    assert "reverted 0 path(s)" in r.stdout, r.stdout
    assert open(os.path.join(m.ws, "f")).read() == "base\n"
    out = overlayrec("unrevert", "-w", m.ws, "--yes").stdout
    assert "unreverted" in out, out
    assert open(os.path.join(m.ws, "f")).read() == "base\ns2\n"
    assert open(os.path.join(m.ws, "g")).read() == "base\ns1\nuser\n"


@contextlib.contextmanager
def small_ext4(path: str):
    """A small ext4 on a loop device at ``path``: it gives a freed inode's number to the next
    file made, every time (on a large one, only by chance)."""
    img = path + ".img"
    os.makedirs(path, exist_ok=True)
    with open(img, "wb") as f:
        f.truncate(64 << 20)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", "-N", "256", img], capture_output=True,
                       text=True)
    if r.returncode == 0:
        r = subprocess.run(["mount", "-o", "loop", img, path], capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(img)
        pytest.skip(f"cannot mount a small ext4 here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", path], capture_output=True)
        os.unlink(img)


def test_a_file_given_a_freed_inodes_number_is_no_partner(make_mount, tmp_path):
    """c2 rewrites ``p`` by a rename over it (its old inode, its one name gone, is freed: a
    small pre-image is copied ahead, a large one once the attic lets it go); c3 rewrites ``q``, same content, and the new file gets the freed
    number.  Reverting c2 linked ``p`` to ``q`` (a live name with the inode's number, its
    content, and the record's word that it holds that number): two files never linked became
    one, and a write to ``q`` changed ``p``."""
    m = make_mount()
    with small_ext4(os.path.join(m.base, "ext4")) as fs:
        m.ws = os.path.join(fs, "ws")
        os.mkdir(m.ws)
        (tmp_path / "calln.py").write_text(CALL_N)
        try:
            m.mount()
            inos = {}
            for call, script in (("c1", "echo same > p; echo same > q"),
                                 ("c2", "echo changed > p.tmp; mv p.tmp p"),
                                 ("c3", "cp q q.tmp; mv q.tmp q")):
                overlayrec("run", "-w", m.ws, "--session", f"s{call}", "--", sys.executable,
                           str(tmp_path / "calln.py"), call, script, cwd=m.ws)
                inos[call] = {n: os.stat(os.path.join(m.ws, n)).st_ino for n in ("p", "q")}
            if inos["c3"]["q"] != inos["c1"]["p"]:
                pytest.skip("the filesystem did not give the freed number again")
            overlayrec("revert", m.ws, "--call", "c2", "--yes")
            p, q = (os.stat(os.path.join(m.ws, n)) for n in ("p", "q"))
            assert p.st_ino != q.st_ino and p.st_nlink == q.st_nlink == 1
            assert open(os.path.join(m.ws, "p")).read() == "same\n"
        finally:
            m.umount()


def test_a_group_written_anew_by_a_revert_is_linked_again_by_the_next(make_mount, tmp_path):
    """``ln d/a out``, ``mv d e``, ``mv e f; echo w >> out``; reverted newest first: the first
    revert writes the pair back as a new inode (linked), and the second, looking for the
    group's old inode, gave ``d/a`` back as a copy cut from ``out``, silently."""
    m = make_mount()
    os.makedirs(os.path.join(m.ws, "d"))
    with open(os.path.join(m.ws, "d", "a"), "w") as f:
        f.write("one\n")
    (tmp_path / "calln.py").write_text(CALL_N)
    m.mount()
    for i, script in enumerate(("ln d/a out", "mv d e", "mv e f; echo w >> out")):
        overlayrec("run", "-w", m.ws, "--session", f"s{i}", "--", sys.executable,
                   str(tmp_path / "calln.py"), f"c{i}", script, cwd=m.ws)
    for call in ("c2", "c1"):
        overlayrec("revert", m.ws, "--call", call, "--yes")
    a, out = (os.stat(os.path.join(m.ws, n)) for n in ("d/a", "out"))
    assert (a.st_ino, a.st_nlink) == (out.st_ino, 2), (a, out)
    assert open(os.path.join(m.ws, "out")).read() == "one\n"
    assert sorted(n for n in os.listdir(m.ws) if not n.startswith(".")) == ["d", "out"]


def test_git_objects_a_later_branch_may_name_stay(make_mount, tmp_path):
    """Call A commits, call B tags and branches it (new files under .git/refs only).  Reverting
    A took its objects away with it, and the repository was left corrupt (`git fsck`: invalid
    sha1 pointer; `git log --all`: bad object), exit 0, nothing said.  The objects stay, said
    on stderr; the rest of A is reverted.  With nothing after it, they go as before."""
    m = make_mount()
    git = ["git", "-C", m.ws]
    subprocess.run(["git", "init", "-q", "-b", "main", m.ws], check=True)
    for k, v in (("user.name", "u"), ("user.email", "u@example.org")):
        subprocess.run(git + ["config", k, v], check=True)
    with open(os.path.join(m.ws, "f.txt"), "w") as f:
        f.write("one\n")
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "init"], check=True)
    (tmp_path / "calln.py").write_text(CALL_N)
    m.mount()
    for call, script in (("A", "echo two >> f.txt && git commit -qam 'agent commit'"),
                         ("B", "git tag v1 && git branch keep")):
        overlayrec("run", "-w", m.ws, "--session", f"s{call}", "--", sys.executable,
                   str(tmp_path / "calln.py"), call, script, cwd=m.ws)
    r = overlayrec("revert", m.ws, "--call", "A", "--yes")
    assert "git object(s) this made stay" in r.stderr, r.stderr
    assert open(os.path.join(m.ws, "f.txt")).read() == "one\n"
    fsck = subprocess.run(git + ["fsck", "--no-dangling"], capture_output=True, text=True)
    assert fsck.returncode == 0 and "invalid" not in fsck.stdout + fsck.stderr, fsck
    log = subprocess.run(git + ["log", "--format=%s", "keep"], capture_output=True, text=True)
    assert log.stdout.split("\n")[:2] == ["agent commit", "init"], log
    # unrevert, then revert everything recorded: nothing after it, the objects go
    overlayrec("unrevert", "-w", m.ws, "--yes")
    r = overlayrec("revert", m.ws, "--since", "0", "--yes")
    assert "git object(s)" not in r.stderr, r.stderr
    assert subprocess.run(git + ["fsck"], capture_output=True).returncode == 0
    assert subprocess.run(git + ["cat-file", "-e", "keep"], capture_output=True).returncode != 0


def _git_repo(m, files=(("README", "readme\n"),)) -> list[str]:
    git = ["git", "-C", m.ws]
    subprocess.run(["git", "init", "-q", "-b", "main", m.ws], check=True)
    for k, v in (("user.name", "u"), ("user.email", "u@example.org"), ("gc.auto", "0")):
        subprocess.run(git + ["config", k, v], check=True)
    for name, text in files:
        with open(os.path.join(m.ws, name), "w") as f:
            f.write(text)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "init"], check=True)
    return git


def test_a_git_status_between_reverts_keeps_no_objects(make_mount, tmp_path):
    """Calls: `git gc`, a commit, an edit; reverted newest first with a `git status` between
    (an editor's git panel): git's refresh of its index counted as the repository changed
    since, the commit's objects were kept, and the revert of the gc was refused on their
    directories ("changed: .git/objects/3e"; found by a bug hunt).  A refresh names no
    object: every revert goes through and the tree is the one before the session."""
    m = make_mount()
    git = _git_repo(m)
    (tmp_path / "calln.py").write_text(CALL_N)
    before = _tree_files(m.ws)
    m.mount()
    try:
        for call, script in (("c1", "git gc -q --prune=now"),
                             ("c2", "echo new > new.txt && git add new.txt && "
                                    "git commit -qm new"),
                             ("c3", "echo more >> README")):
            overlayrec("run", "-w", m.ws, "--session", f"s{call}", "--", sys.executable,
                       str(tmp_path / "calln.py"), call, script, cwd=m.ws)
        overlayrec("revert", m.ws, "--call", "c3", "--yes")
        index = open(os.path.join(m.ws, ".git", "index"), "rb").read()
        subprocess.run(["touch", os.path.join(m.ws, "README")], check=True)
        subprocess.run(git + ["status", "--short"], check=True, capture_output=True)
        assert open(os.path.join(m.ws, ".git", "index"), "rb").read() != index  # refreshed
        for call in ("c2", "c1"):
            r = overlayrec("revert", m.ws, "--call", call, "--yes")
            assert "git object(s) this made stay" not in r.stderr, (call, r.stderr)
    finally:
        m.umount()
    after = _tree_files(m.ws)
    after.pop(".git/index", None)
    before.pop(".git/index", None)
    assert after == before, sorted(set(after) ^ set(before))
    assert subprocess.run(git + ["fsck"], capture_output=True).returncode == 0


@pytest.mark.parametrize("shape", ["shared-clone", "superproject"])
def test_git_objects_another_repository_may_name_stay(make_mount, tmp_path, shape):
    """Call c1 commits; call c2 makes another repository that names c1's commit: a `git clone
    --shared` (its objects borrowed through alternates), or the superproject recording the
    nested repository's commit (a gitlink).  Reverting c1 removed its objects, and the other
    repository was left corrupt (`fatal: bad object HEAD`), exit 0, nothing said (found by a
    bug hunt).  They stay, said."""
    m = make_mount()
    git = _git_repo(m)
    (tmp_path / "calln.py").write_text(CALL_N)
    if shape == "superproject":
        nested = os.path.join(m.ws, "nested")
        os.mkdir(nested)
        ngit = ["git", "-C", nested]
        subprocess.run(["git", "init", "-q", "-b", "main", nested], check=True)
        for k, v in (("user.name", "u"), ("user.email", "u@example.org")):
            subprocess.run(ngit + ["config", k, v], check=True)
        with open(os.path.join(nested, "n.txt"), "w") as f:
            f.write("n\n")
        subprocess.run(ngit + ["add", "-A"], check=True)
        subprocess.run(ngit + ["commit", "-qm", "n"], check=True)
        subprocess.run(git + ["add", "nested"], check=True, capture_output=True)
        subprocess.run(git + ["commit", "-qm", "nested"], check=True)
        steps = (("c1", "cd nested && echo more >> n.txt && git commit -qam more"),
                 ("c2", "git add nested && git commit -qm 'nested moved on'"))
    else:
        steps = (("c1", "echo agent >> README && git commit -qam agent"),
                 ("c2", "git clone -q --shared . clone2"))
    m.mount()
    try:
        for call, script in steps:
            overlayrec("run", "-w", m.ws, "--session", f"s{call}", "--", sys.executable,
                       str(tmp_path / "calln.py"), call, script, cwd=m.ws)
        r = overlayrec("revert", m.ws, "--call", "c1", "--yes")
        assert "git object(s) this made stay" in r.stderr, r.stderr
        if shape == "superproject":
            named = subprocess.run(git + ["rev-parse", "HEAD:nested"], capture_output=True,
                                   text=True, check=True).stdout.strip()
            assert subprocess.run(["git", "-C", os.path.join(m.ws, "nested"), "cat-file",
                                   "-e", named]).returncode == 0
        else:
            other = ["git", "-C", os.path.join(m.ws, "clone2")]
            fsck = subprocess.run(other + ["fsck", "--no-dangling"], capture_output=True,
                                  text=True)
            assert fsck.returncode == 0, fsck
            log = subprocess.run(other + ["log", "--format=%s", "-1"], capture_output=True,
                                 text=True)
            assert log.stdout.strip() == "agent", log
    finally:
        m.umount()


def _tree_files(top: str) -> dict[str, bytes]:
    out = {}
    for d, dirs, files in os.walk(top):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".overlayrec"))
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, top)] = open(p, "rb").read()
        for x in dirs:
            out[os.path.relpath(os.path.join(d, x), top) + "/"] = b""
    return out


def test_git_calls_reverted_newest_first_then_unreverted_give_each_tree_back(make_mount,
                                                                           tmp_path):
    """Three git calls (a commit, a repack, a commit) reverted newest first, then unreverted:
    the objects of each earlier call were kept for the later calls, though those had been
    reverted already (their changes undone), and the next revert then conflicted with what was
    kept, or the unreverts left packs and loose objects the session's end did not have (found
    by a bug hunt).  A later unit whose changes to the repository are undone names nothing."""
    m = make_mount()
    git = ["git", "-C", m.ws]
    subprocess.run(["git", "init", "-q", "-b", "main", m.ws], check=True)
    for k, v in (("user.name", "u"), ("user.email", "u@example.org"), ("gc.auto", "0")):
        subprocess.run(git + ["config", k, v], check=True)
    with open(os.path.join(m.ws, "a"), "w") as f:
        f.write("a\n")
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "init"], check=True)
    subprocess.run(git + ["gc", "-q"], check=True)
    (tmp_path / "calln.py").write_text(CALL_N)
    before = _tree_files(m.ws)
    m.mount()
    for call, script in (("s1", "echo b > b && git add b && git commit -qm b"),
                         ("s2", "git repack -adq"),
                         ("s3", "echo c > c && git add c && git commit -qm c")):
        overlayrec("run", "-w", m.ws, "--session", call, "--", sys.executable,
                   str(tmp_path / "calln.py"), call, script, cwd=m.ws)
    end = _tree_files(m.ws)
    for call in ("s3", "s2", "s1"):
        r = overlayrec("revert", m.ws, "--call", call, "--yes")
        assert "git object(s)" not in r.stderr, (call, r.stderr)
    assert _tree_files(m.ws) == before
    for _ in range(3):
        overlayrec("unrevert", "-w", m.ws, "--yes")
    assert _tree_files(m.ws) == end
    assert subprocess.run(git + ["fsck"], capture_output=True).returncode == 0


def _acl(*entries) -> bytes:
    """A POSIX access ACL as the kernel stores it in ``system.posix_acl_access``."""
    return (2).to_bytes(4, "little") + b"".join(
        tag.to_bytes(2, "little") + perm.to_bytes(2, "little") + ident.to_bytes(4, "little")
        for tag, perm, ident in entries)


# owner rw-, user nobody r--, group r--, mask r--, other r--: an ACL beyond the mode's bits
ACL = _acl((0x01, 6, 0xFFFFFFFF), (0x02, 4, 65534), (0x04, 4, 0xFFFFFFFF),
           (0x10, 4, 0xFFFFFFFF), (0x20, 4, 0xFFFFFFFF))


def test_a_file_put_back_keeps_the_attributes_its_name_holds(make_mount, tmp_path):
    """A revert writes a file anew and renames it over the name; attributes are no part of a
    recorded state (docs/design.md), so the file put back must keep those its name holds.  Found
    by hand: reverting a call that only chmodded a file, or appended to one, stripped the
    ``user.*`` attributes and the ACL the user had set before the session."""
    m = setup_ws(make_mount, tmp_path, {"a.txt": b"one\n", "b.txt": b"two\n"})
    for name in ("a.txt", "b.txt"):
        os.setxattr(os.path.join(m.ws, name), "user.note", name.encode())
    os.setxattr(os.path.join(m.ws, "b.txt"), "system.posix_acl_access", ACL)
    m.mount()
    before = tree_of(m.ws)
    run_call(m, tmp_path, "chmod +x a.txt && echo more >> b.txt")
    after = tree_of(m.ws)
    assert after != before

    def attrs(name):
        p = os.path.join(m.ws, name)
        return {k: os.getxattr(p, k) for k in os.listxattr(p)}

    kept = {"a.txt": {"user.note": b"a.txt"},
            "b.txt": {"user.note": b"b.txt", "system.posix_acl_access": ACL}}
    assert {n: attrs(n) for n in kept} == kept
    out = overlayrec("revert", m.ws, "--call", "c1", "--yes").stdout
    assert "failed" not in out, out
    assert tree_of(m.ws) == before
    assert {n: attrs(n) for n in kept} == kept
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert tree_of(m.ws) == after
    assert {n: attrs(n) for n in kept} == kept


def test_a_file_renamed_then_its_directory_moved_away_and_back(make_mount, tmp_path):
    """Found by the history model: a call renames d/x to d/b, makes d/a, then renames d away
    and back.  No event names d/b between its rename and the directory's move, so what it held
    is followed through the move (it was taken as changed unsaved: the revert was refused,
    ``unrecorded``).  The revert gives the tree before, and the unrevert the tree after; d/b
    is renamed back to d/x (the renames of d undo each other)."""
    m = setup_ws(make_mount, tmp_path, {"d/x": b"d/x.2\n", "a": b"a.1\n"})
    m.mount()
    before = tree_of(m.ws)
    run_call(m, tmp_path, "echo e > e && mv d/x d/b && echo a > d/a && mv d b && mv b d")
    after = tree_of(m.ws)
    js = json.loads(overlayrec("revert", m.ws, "--call", "c1", "--json").stdout)
    assert sorted((st["path"], st["action"], st["conflict"]) for st in js["steps"]) == [
        ("d/a", "delete", None), ("d/x", "rename", None), ("e", "delete", None)], js
    overlayrec("revert", m.ws, "--call", "c1", "--yes")
    assert tree_of(m.ws) == before
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert tree_of(m.ws) == after


def test_a_directory_later_work_filled_is_kept_and_said(make_mount, tmp_path):
    """A call renames a directory; files are made in it after the call.  Reverting the call
    moves its content back and keeps the directory with the later files (its rmdir fails: not
    empty), and the summary says which directories it kept, where the plan's line had said
    "delete".  The directory is not renamed back (the later file would go with it): what it
    held is, one rename for src/pkg."""
    m = setup_ws(make_mount, tmp_path, {"src/pkg/m.py": b"x = 1\n"})
    m.mount()
    run_call(m, tmp_path, "mv src lib")
    with open(os.path.join(m.ws, "lib", "later.txt"), "w") as f:  # after the call, outside it
        f.write("later\n")
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes")
    assert "  delete   lib  (kept: it holds what the revert does not remove)\n" in r.stdout, \
        r.stdout
    assert r.stdout.rstrip().endswith("; kept 1 directory that holds what it does not remove: "
                                      "lib"), r.stdout
    # the paths it reverted, the kept one not among them (it was counted: found by a bug hunt)
    reverted = [ln for ln in r.stdout.splitlines() if ln.startswith("reverted ")]
    assert "  rename   src/pkg (from lib/pkg)\n" in r.stdout, r.stdout
    assert reverted and reverted[0].startswith("reverted 2 path(s) as revert "), r.stdout
    assert tree_of(m.ws)["lib/later.txt"] and tree_of(m.ws)["src/pkg/m.py"], tree_of(m.ws)
    assert not os.path.exists(os.path.join(m.ws, "lib", "pkg"))


def test_a_name_made_anew_joins_its_group_written_in_place(make_mount, tmp_path):
    """Found by the history model: ``a``, ``b`` and ``c`` are one inode; a call appends
    through ``b`` and renames another file over ``a``.  The revert writes the content back into
    the inode ``b`` and ``c`` still share, and must link ``a`` to it again: made first (in path
    order), ``a`` got an inode of its own, apart from the group."""
    m = setup_ws(make_mount, tmp_path, {"b": b"v1\n", "other": b"other\n"})
    m.mount()
    m.sh("ln b a && ln b c")  # through the mount (links made outside it are not known)
    before = tree_of(m.ws)
    run_call(m, tmp_path, "echo v2 >> b && mv other a")
    after = tree_of(m.ws)
    overlayrec("revert", m.ws, "--call", "c1", "--yes")
    assert tree_of(m.ws) == before
    a, b, c = (os.lstat(os.path.join(m.ws, n)) for n in "abc")
    assert a.st_ino == b.st_ino == c.st_ino and b.st_nlink == 3, (a, b, c)
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert tree_of(m.ws) == after


def test_unrevert_links_a_name_again_to_its_partner_in_a_directory_renamed_since(make_mount,
                                                                                 tmp_path):
    """Found by the history model: a call makes ``b``; then, outside any call, ``b`` is linked
    as ``x/a`` and ``x`` renamed to ``d``.  The revert of the call removes ``b`` (``d/a`` keeps
    the inode); its unrevert must link ``b`` to ``d/a`` again.  The partner was looked for
    among the recorded names only, and ``d/a`` is one no event names (it got it from the
    directory's rename): ``b`` came back as a copy, apart from ``d/a``."""
    m = setup_ws(make_mount, tmp_path, {})
    m.mount()
    run_call(m, tmp_path, "echo z > a && mv a b")
    m.sh("mkdir x && ln b x/a && mv x d")
    linked = tree_of(m.ws)
    overlayrec("revert", m.ws, "--call", "c1", "--yes")
    assert not os.path.lexists(os.path.join(m.ws, "b"))
    assert os.lstat(os.path.join(m.ws, "d/a")).st_nlink == 1
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert tree_of(m.ws) == linked
    b, da = (os.lstat(os.path.join(m.ws, n)) for n in ("b", "d/a"))
    assert b.st_ino == da.st_ino and b.st_nlink == 2, (b, da)


TWO_CALLS = textwrap.dedent(r'''
    import subprocess, sys
    from overlayrec import client
    first, between, late = sys.argv[1:4]
    with client.connect() as c:
        c.call_begin("c0", "Bash")
        # c0's process lives on after its call: what it does later is still c0's
        p = subprocess.Popen(["bash", "-c", first + " && echo ok && read _ && " + late],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline() == "ok\n"
        c.call_end("c0")
        c.call_begin("c1", "Bash")
        subprocess.run(["bash", "-c", between], check=True)
        c.call_end("c1")
        p.communicate("\n")
        assert p.returncode == 0
''')


def test_a_name_taken_before_its_inode_was_linked_and_chmodded_is_not_linked_back(make_mount,
                                                                                  tmp_path):
    """Found by the history model: a call c0 chmods ``d/x``; a call c1 links ``d/x`` as
    ``d/e``; then c0 renames ``d`` to ``b``.  Reverting c0 puts ``d/x`` back as it was before
    the chmod (0644, one name) and ``d/e`` as it was before the rename (c1's link, 0755).  The
    two targets are one inode taken at two points with the same content, and were taken as one
    hard-link group: ``d/x`` came back 0755 and linked to ``d/e``.  A group's names hold one
    state (mode and owner too), or they were not one group then."""
    m = setup_ws(make_mount, tmp_path, {"d/x": b"x\n"})
    (tmp_path / "calls.py").write_text(TWO_CALLS)
    m.mount()
    before = tree_of(m.ws)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable,
               str(tmp_path / "calls.py"), "chmod 755 d/x", "ln d/x d/e", "mv d b", cwd=m.ws)
    after = tree_of(m.ws)
    bx, be = (os.lstat(os.path.join(m.ws, "b", n)) for n in "xe")
    assert bx.st_ino == be.st_ino and bx.st_mode & 0o777 == 0o755, (bx, be)
    js = json.loads(overlayrec("revert", m.ws, "--call", "c0", "--json").stdout)
    assert not [s for s in js["steps"] if s["conflict"]], js
    overlayrec("revert", m.ws, "--call", "c0", "--yes")
    x, e = (os.lstat(os.path.join(m.ws, "d", n)) for n in "xe")
    assert (x.st_mode & 0o777, x.st_nlink) == (0o644, 1), x
    assert (e.st_mode & 0o777, e.st_nlink) == (0o755, 1), e  # c1's name, kept as c1 left it
    assert not os.path.lexists(os.path.join(m.ws, "b"))
    assert tree_of(m.ws) == {**before, "d/e": after["b/e"]}
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert tree_of(m.ws) == after
    bx, be = (os.lstat(os.path.join(m.ws, "b", n)) for n in "xe")
    assert bx.st_ino == be.st_ino and bx.st_nlink == 2, (bx, be)


def test_a_name_linked_to_a_group_since_and_written_late_gets_its_own_state(make_mount,
                                                                            tmp_path):
    """Found by the history model: ``a`` and ``b`` are one inode; a call c0 writes it through
    ``a``; a call c1 links ``a`` as ``c``; then c0's process writes through ``a`` again.
    Reverting c0 puts ``a`` and ``b`` back as they were before c0 and ``c`` as c1 linked it
    (before c0's late write): two states, which one inode cannot hold.  Each was written back
    into the live inode in turn, the last one winning for all three names."""
    m = setup_ws(make_mount, tmp_path, {"a": b"v1\n"})
    (tmp_path / "calls.py").write_text(TWO_CALLS)
    m.mount()
    m.sh("ln a b")  # through the mount (links made outside it are not known)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable,
               str(tmp_path / "calls.py"), "echo v2 > a", "ln a c", "echo v3 > a", cwd=m.ws)
    after = tree_of(m.ws)
    assert {n: after[n] for n in "abc"} == {n: after["a"] for n in "abc"}, after
    js = json.loads(overlayrec("revert", m.ws, "--call", "c0", "--json").stdout)
    assert not [s for s in js["steps"] if s["conflict"]], js
    overlayrec("revert", m.ws, "--call", "c0", "--yes")
    read = {n: open(os.path.join(m.ws, n), "rb").read() for n in "abc"}
    assert read == {"a": b"v1\n", "b": b"v1\n", "c": b"v2\n"}, read
    a, b, c = (os.lstat(os.path.join(m.ws, n)) for n in "abc")
    assert a.st_ino == b.st_ino != c.st_ino and (a.st_nlink, c.st_nlink) == (2, 1), (a, b, c)
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert tree_of(m.ws) == after


def test_a_file_moved_by_a_call_and_linked_by_the_next_comes_back_linked(make_mount, tmp_path):
    """Found by the history model: a call c0 edits ``a``, moves it to ``b`` and moves ``d/x``
    over ``a``; a call c1 links ``a`` as ``e``.  Reverting c0 puts ``d/x`` back: its inode
    still lives, as ``e`` (and ``a``, which the revert gives back its own content), so ``d/x``
    is linked to ``e``, as moving the file back would leave it.  It came back a copy, apart."""
    m = setup_ws(make_mount, tmp_path, {"a": b"a.1\n", "d/x": b"d/x.2\n"})
    (tmp_path / "calls.py").write_text(TWO_CALLS)
    m.mount()
    before = tree_of(m.ws)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable,
               str(tmp_path / "calls.py"), "echo x.3 > a && mv a b && mv d/x a", "ln a e",
               "true", cwd=m.ws)
    after = tree_of(m.ws)
    js = json.loads(overlayrec("revert", m.ws, "--call", "c0", "--json").stdout)
    assert not [s for s in js["steps"] if s["conflict"]], js
    overlayrec("revert", m.ws, "--call", "c0", "--yes")
    assert tree_of(m.ws) == {**before, "e": after["e"]}
    dx, e, a = (os.lstat(os.path.join(m.ws, n)) for n in ("d/x", "e", "a"))
    assert dx.st_ino == e.st_ino != a.st_ino and dx.st_nlink == 2, (dx, e, a)
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert tree_of(m.ws) == after
    a, e = (os.lstat(os.path.join(m.ws, n)) for n in "ae")
    assert a.st_ino == e.st_ino and a.st_nlink == 2, (a, e)


def test_a_file_moved_by_a_call_and_linked_under_another_name_comes_back_linked(make_mount,
                                                                                 tmp_path):
    """Found by a history-model hunt: a call c0 moves ``d/x`` over ``a``; a call c1 links
    ``a`` as ``e``, renames the link to ``b``, and moves the two names about (``a`` to
    ``d/a``, ``b`` to ``a``, ``d/a`` to ``b``).  Reverting c0 gives ``a`` its content back and
    ``d/x`` its file: the inode ``b`` still holds, linked with it.  No name of the inode was
    made by the link under its own name now, so ``d/x`` came back a copy, apart from ``b``."""
    m = setup_ws(make_mount, tmp_path, {"a": b"a.1\n", "d/x": b"d/x.2\n"})
    (tmp_path / "calls.py").write_text(TWO_CALLS)
    m.mount()
    before = tree_of(m.ws)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable,
               str(tmp_path / "calls.py"), "mv d/x e && mv e a",
               "ln a e && mv e b && mkdir e && mv a d/a && mv b a && mv d/a b", "true",
               cwd=m.ws)
    after = tree_of(m.ws)
    js = json.loads(overlayrec("revert", m.ws, "--call", "c0", "--json").stdout)
    assert not [s for s in js["steps"] if s["conflict"]], js
    overlayrec("revert", m.ws, "--call", "c0", "--yes")
    assert tree_of(m.ws) == {**before, "b": after["b"], "e": after["e"]}
    dx, b, a = (os.lstat(os.path.join(m.ws, n)) for n in ("d/x", "b", "a"))
    assert dx.st_ino == b.st_ino != a.st_ino and dx.st_nlink == 2, (dx, b, a)
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert tree_of(m.ws) == after
    a, b = (os.lstat(os.path.join(m.ws, n)) for n in "ab")
    assert a.st_ino == b.st_ino and a.st_nlink == 2, (a, b)


def test_a_name_the_revert_removes_is_no_name_outside_the_group(make_mount, tmp_path):
    """Found by the history model: a call links ``a`` as ``e`` and truncates ``a``; then the
    user links ``e`` as ``x``.  Reverting the call gives ``a`` its content back and removes
    ``e``; ``x``, the user's, keeps what it was linked with.  ``e`` was counted as a name the
    group had outside the plan, so ``x`` seemed to stand in for it and ``a`` was written back
    in place, into the inode ``x`` holds."""
    m = setup_ws(make_mount, tmp_path, {"a": b"a.1\n"})
    m.mount()
    run_call(m, tmp_path, "ln a e && truncate -s 6 a")
    m.sh("ln e x")
    js = json.loads(overlayrec("revert", m.ws, "--call", "c1", "--json").stdout)
    assert not [s for s in js["steps"] if s["conflict"]], js
    overlayrec("revert", m.ws, "--call", "c1", "--yes")
    read = {n: open(os.path.join(m.ws, n), "rb").read() for n in ("a", "x")}
    assert read == {"a": b"a.1\n", "x": b"a.1\n\0\0"}, read
    assert not os.path.lexists(os.path.join(m.ws, "e"))
    a, x = (os.lstat(os.path.join(m.ws, n)) for n in "ax")
    assert a.st_ino != x.st_ino, (a, x)


PAUSED_CALL = textwrap.dedent(r'''
    import os, subprocess, sys, time
    from overlayrec import client
    script, sync = sys.argv[1:3]
    with client.connect() as c:
        c.call_begin("c1", "Bash")
        subprocess.run(["bash", "-c", script], check=True)
        open(os.path.join(sync, "ready"), "w").close()  # the test changes the tree now
        while not os.path.exists(os.path.join(sync, "done")):
            time.sleep(0.02)
        c.call_end("c1")
''')


def _call_with_an_intruder(m, tmp_path, script, intrude) -> None:
    """Call c1 runs ``script``, then waits while ``intrude()`` (this process: another
    writer, not the call's) changes the tree, then ends."""
    (tmp_path / "paused.py").write_text(PAUSED_CALL)
    p = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--session",
                          "s", "--", sys.executable, str(tmp_path / "paused.py"), script,
                          str(tmp_path)], cwd=m.ws)
    try:
        deadline = time.monotonic() + 60 * SLOW
        while not (tmp_path / "ready").exists():
            assert p.poll() is None and time.monotonic() < deadline, "the call did not run"
            time.sleep(0.02)
        intrude()
    finally:
        (tmp_path / "done").write_text("")
        assert p.wait(60 * SLOW) == 0


@pytest.mark.parametrize("made_dir", [False, True])
def test_a_file_written_twice_then_moved_by_another_process_is_a_conflict(make_mount, tmp_path,
                                                                          made_dir):
    """Found by the history model: a call makes ``a/a`` with two writes (so no point of the
    record holds its content exactly before the next event), and another process renames
    ``a`` to ``b`` before the call ends.  The revert of the call said "nothing to revert"
    (the path ``a/a`` holds nothing now, as before the call), leaving the call's file at
    ``b/a`` without a word; as with one write, ``a/a`` is a ``changed`` conflict, and nothing
    is written."""
    m = make_mount()
    if not made_dir:
        os.mkdir(os.path.join(m.ws, "a"))
    m.mount()
    write = ("python3 -c \"f = open('a/a', 'wb'); f.write(b'x'); f.flush(); f.write(b'y'); "
             "f.close()\"")
    _call_with_an_intruder(m, tmp_path, ("mkdir a && " if made_dir else "") + write,
                           lambda: os.rename(os.path.join(m.ws, "a"), os.path.join(m.ws, "b")))
    after = tree_of(m.ws)
    r = overlayrec("revert", m.ws, "--call", "c1", "--json", check=False)
    steps = {s["path"]: s["conflict"] for s in json.loads(r.stdout)["steps"]}
    assert steps == ({"a": "changed", "a/a": "changed"} if made_dir else {"a/a": "changed"}), \
        r.stdout
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes", check=False)
    assert r.returncode == 1 and "changed:" in r.stderr and "a/a" in r.stderr, r.stderr
    assert tree_of(m.ws) == after  # nothing written


def test_a_name_whose_alias_kept_no_content_is_in_the_plan(make_mount, tmp_path):
    """Found by the history model with every file kept as a large one: ``a`` and ``b`` are one
    inode past the whole-file limit; a call writes through ``a``.  ``b``'s alias keeps no
    content (design.md): its two states were guessed alike, and the plan left ``b`` out as if
    nothing had changed it (then said it was ``unrecorded``).  What ``b`` held before is what
    ``a`` held then, whose pre-image kept the range: ``b`` is in the plan, and the revert gives
    both names their content back."""
    m = make_mount(env=dict(os.environ, OVERLAYREC_TEST_WHOLE_FILE_LIMIT="8"))
    m.mount()
    m.sh("printf 'one two three four\\n' > a && ln a b")  # through the mount: a known link
    (tmp_path / "call.py").write_text(CALL)
    run_call(m, tmp_path, "printf TWO | dd of=a bs=1 seek=4 conv=notrunc status=none")
    assert open(os.path.join(m.ws, "b")).read() == "one TWO three four\n"
    r = overlayrec("revert", m.ws, "--call", "c1", "--json", check=False)
    steps = {s["path"]: s["conflict"] for s in json.loads(r.stdout)["steps"]}
    assert "b" in steps and steps["b"] is None and steps.get("a") is None, steps
    overlayrec("revert", m.ws, "--call", "c1", "--yes")
    for name in "ab":
        assert open(os.path.join(m.ws, name)).read() == "one two three four\n", name


def test_a_partner_chmodded_since_is_not_linked_to(make_mount, tmp_path):
    """``a`` and ``b`` are one inode; a call removes ``a``; then the user chmods ``b``.  The
    revert gives ``a`` back as it was (0644): not linked to ``b``, whose inode now has another
    mode (it was, and ``a`` came back 0755)."""
    m = setup_ws(make_mount, tmp_path, {"b": b"v1\n"})
    m.mount()
    m.sh("ln b a")  # through the mount (links made outside it are not known)
    before = tree_of(m.ws)
    run_call(m, tmp_path, "rm a")
    m.sh("chmod 755 b")
    overlayrec("revert", m.ws, "--call", "c1", "--yes")
    a, b = (os.lstat(os.path.join(m.ws, n)) for n in "ab")
    assert (a.st_mode & 0o777, a.st_nlink, b.st_mode & 0o777) == (0o644, 1, 0o755), (a, b)
    assert tree_of(m.ws) == {**before, "b": ("file", 0o755, b"v1\n")}


def test_a_hard_link_made_outside_the_mount_is_known_once_both_names_were_seen(make_mount,
                                                                               tmp_path):
    """``sub/a`` and ``sub/b`` were linked before the record.  Once the mount has seen both
    names (a listing of ``sub``) it knows them as a link made through it: a call's append
    through ``b`` is journaled on ``a`` too, and the revert of the call (which also renamed
    another file over ``a``) gives back the tree before, the two names one inode again.  (The
    record said the call wrote ``a`` only, and the revert left ``b`` appended.)"""
    m = setup_ws(make_mount, tmp_path, {"sub/b": b"v1\n", "sub/other": b"other\n"})
    os.link(os.path.join(m.ws, "sub/b"), os.path.join(m.ws, "sub/a"))
    before = tree_of(m.ws)
    m.mount()
    m.sh("ls sub > /dev/null")
    run_call(m, tmp_path, "cd sub && echo v2 >> b && mv other a")
    after = tree_of(m.ws)
    js = json.loads(overlayrec("revert", m.ws, "--call", "c1", "--json").stdout)
    assert {st["path"]: st["conflict"] for st in js["steps"]} == \
        {"sub/a": None, "sub/b": None, "sub/other": None}, js
    overlayrec("revert", m.ws, "--call", "c1", "--yes")
    assert tree_of(m.ws) == before
    a, b = (os.lstat(os.path.join(m.ws, "sub", n)) for n in "ab")
    assert a.st_ino == b.st_ino and b.st_nlink == 2, (a, b)
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert tree_of(m.ws) == after


def test_a_conflict_refuses_the_whole_revert(make_mount, tmp_path):
    m = setup_ws(make_mount, tmp_path)
    m.mount()
    run_call(m, tmp_path, "echo c1 >> a.txt && echo c1 >> k.txt")
    m.sh("echo user >> a.txt")  # the user edits after the call: outside actor
    mid = tree_of(m.ws)
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes", check=False)
    assert r.returncode == 1 and "changed: a.txt" in r.stderr
    assert tree_of(m.ws) == mid  # nothing written
    out = overlayrec("revert", m.ws, "--call", "c1", "--yes", "--force").stdout
    assert "1 conflicting path(s) left alone" in out
    assert open(os.path.join(m.ws, "k.txt")).read() == "keep\n"
    assert open(os.path.join(m.ws, "a.txt")).read() == "one\nc1\nuser\n"


REVERTS_ITS_OWN_CALL = textwrap.dedent(r'''
    import subprocess, sys
    from overlayrec import client
    with client.connect() as c:
        c.turn_begin(prompt="edit, then think better of it")
        c.call_begin("c1", "Bash")
        subprocess.run(["bash", "-c", "echo c1 >> a.txt && echo new > n.txt && rm k.txt"],
                       check=True)
        c.call_end("c1")
        c.call_begin("c2", "Bash")
        subprocess.run([sys.executable, "-m", "overlayrec", "revert", "--call", "c1", "--yes"],
                       check=True)
        subprocess.run(["bash", "-c", "echo c2 > z.txt"], check=True)
        c.call_end("c2")
        c.turn_end()
''')


def test_a_path_an_earlier_revert_put_back_needs_nothing(make_mount, tmp_path):
    """An agent's call reverts an earlier call of its turn: the turn's diff shows only what
    the turn left, but its revert refused the whole turn, every path of the earlier call a
    ``changed`` conflict though it held what the revert would put back.  A path an earlier
    revert put back needs nothing: said, and the rest reverted.  Put back by anyone else (the
    user's undo by hand) it stays a conflict: a revert over another unit's change is one."""
    m = setup_ws(make_mount, tmp_path)
    m.mount()
    (tmp_path / "agent.py").write_text(REVERTS_ITS_OWN_CALL)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable,
               str(tmp_path / "agent.py"), cwd=m.ws)
    d = overlayrec("diff", m.ws, "--turn", "1", "--name-status")
    assert d.stdout == "A\tz.txt\n"
    # its note named the paths the revert put back, which the diff does not show (a hunt)
    assert "changed by another writer too" not in d.stderr, d.stderr
    before = tree_of(m.ws)
    r = overlayrec("revert", m.ws, "--turn", "1", "--yes")
    assert "3 path(s) were put back already by an earlier revert: a.txt, k.txt, n.txt" \
        in r.stderr, r.stderr
    after = dict(before)
    del after["z.txt"]
    assert tree_of(m.ws) == after
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert tree_of(m.ws) == before
    run_call(m, tmp_path, "echo again >> a.txt && echo again >> k.txt")
    m.sh("printf 'one\\n' > a.txt")
    r = overlayrec("revert", m.ws, "--call", "c1", "--session", "s.2", "--json", check=False)
    preview = json.loads(r.stdout)
    assert preview["already"] == [], r.stdout
    assert [(s["path"], s["conflict"]) for s in preview["steps"]] == \
        [("a.txt", "changed"), ("k.txt", None)]


def test_path_selects_a_name_as_written_a_directory_beneath_or_a_glob(make_mount, tmp_path):
    """--path of a name with glob characters in it (`st*ar?[x]` matches itself, which as a
    glob it does not), of a directory (`src`, `./src/`: everything beneath), or a glob; the
    same for diff, log and revert."""
    m = setup_ws(make_mount, tmp_path, {"st*ar?[x]": b"s\n", "src/a.py": b"a\n",
                                        "src/deep/b.py": b"b\n", "srcx.txt": b"x\n",
                                        "top.py": b"t\n"})
    m.mount()
    run_call(m, tmp_path, "for f in 'st*ar?[x]' src/a.py src/deep/b.py srcx.txt top.py; do "
                          "echo more >> \"$f\"; done")
    after = tree_of(m.ws)

    def paths(*sel):
        r = overlayrec("diff", m.ws, "--call", "c1", "--json", *sel)
        return sorted(f["path"] for f in json.loads(r.stdout)["files"])
    assert paths("--path", "st*ar?[x]") == ["st*ar?[x]"]
    assert paths("--path", "src") == ["src/a.py", "src/deep/b.py"]
    assert paths("--path", "./src/") == ["src/a.py", "src/deep/b.py"]
    assert paths("--path", "*.py") == ["src/a.py", "src/deep/b.py", "top.py"]
    logged = overlayrec("log", m.ws, "--path", "src", "--json").stdout
    assert {json.loads(line)["path"] for line in logged.splitlines()} == \
        {"src/a.py", "src/deep/b.py"}

    overlayrec("revert", m.ws, "--call", "c1", "--path", "st*ar?[x]", "--yes")
    assert open(os.path.join(m.ws, "st*ar?[x]"), "rb").read() == b"s\n"
    overlayrec("revert", m.ws, "--call", "c1", "--path", "src", "--yes")
    assert open(os.path.join(m.ws, "src/deep/b.py"), "rb").read() == b"b\n"
    assert open(os.path.join(m.ws, "src/a.py"), "rb").read() == b"a\n"
    now = tree_of(m.ws)
    for p in ("srcx.txt", "top.py"):  # not beneath src, not the name: left as the call made them
        assert now[p] == after[p], p


def test_path_given_twice_selects_both_sides_of_a_rename(make_mount, tmp_path):
    """`--path rf --path sub/rf` (what the warning of a rename half outside --path asks for)
    selects both names, in diff and revert: click kept the last alone, so the revert removed
    `sub/rf` and put nothing back.  log follows one path: a second is refused, not dropped."""
    m = setup_ws(make_mount, tmp_path, {"rf": b"keep\n", "sub/other": b"o\n", "x": b"x\n"})
    m.mount()
    before = tree_of(m.ws)
    run_call(m, tmp_path, "mv rf sub/rf && echo more >> x")
    r = overlayrec("diff", m.ws, "--call", "c1", "--json", "--path", "rf", "--path", "sub/rf")
    assert sorted(f["path"] for f in json.loads(r.stdout)["files"]) == ["sub/rf"], r.stdout
    r = overlayrec("log", m.ws, "--path", "rf", "--path", "x", check=False)
    assert r.returncode == 2 and "one --path" in r.stderr, r.stderr
    r = overlayrec("revert", m.ws, "--call", "c1", "--path", "rf", "--path", "sub/rf",
                   "--yes", check=False)
    assert r.returncode == 0 and "came by a rename" not in r.stderr, r.stderr
    now = tree_of(m.ws)
    assert now["rf"] == before["rf"] and "sub/rf" not in now, sorted(now)
    assert now["x"] != before["x"]  # not named: left as the call made it


def test_a_refusal_of_many_conflicts_is_one_short_line(make_mount, tmp_path):
    """The error names ten paths of each kind and counts the rest; the plan lists them all."""
    m = setup_ws(make_mount, tmp_path, {f"f{i:02d}": b"x\n" for i in range(25)})
    m.mount()
    run_call(m, tmp_path, "for i in $(seq -w 0 24); do echo c1 >> f$i; done")
    m.sh("for i in $(seq -w 0 24); do echo user >> f$i; done")
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes", check=False)
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("f09 and 15 more"), err
    assert r.stdout.count("CONFLICT (changed)") == 25


def test_interleaved_writer_is_a_conflict(make_mount, tmp_path):
    m = setup_ws(make_mount, tmp_path)
    m.mount()
    gate = tmp_path / "gate"
    script = (f"echo first >> a.txt; while [ ! -e {gate} ]; do sleep 0.05; done; "
              "echo second >> a.txt")
    p = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--session", "s",
                          "--", sys.executable, str(tmp_path / "call.py"), script], cwd=m.ws)
    deadline = time.monotonic() + 20
    while "first" not in open(os.path.join(m.ws, "a.txt")).read() and time.monotonic() < deadline:
        time.sleep(0.05)
    m.sh("echo outsider >> a.txt")
    gate.write_text("")
    assert p.wait(timeout=30) == 0
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes", check=False)
    assert r.returncode == 1 and "interleaved: a.txt" in r.stderr


MOVED_ON = textwrap.dedent(r"""
    import os, subprocess, sys, time
    from overlayrec import client
    one = os.environ.get("ONE_CALL") == "1"
    with client.connect() as c:
        c.turn_begin(prompt="p")
        c.call_begin("c1", "Bash")
        subprocess.run(["bash", "-c", os.environ["FIRST"]], check=True)
        if not one:
            c.call_end("c1")
        open(sys.argv[1], "w").close()
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.02)
        if not one:
            c.call_begin("c2", "Bash")
        subprocess.run(["bash", "-c", os.environ["SECOND"]], check=True)
        c.call_end("c2" if not one else "c1")
        c.turn_end()
""")


def _moved_on(m, tmp_path, monkeypatch, first, second, edited, one_call=False):
    """The agent runs ``first``; the user (outside the session) appends a line to ``edited``;
    the agent runs ``second``; in two calls of one turn, or in one call."""
    monkeypatch.setenv("FIRST", first)
    monkeypatch.setenv("SECOND", second)
    monkeypatch.setenv("ONE_CALL", "1" if one_call else "0")

    def outside():
        with open(os.path.join(m.ws, edited), "a") as f:  # outside the session
            f.write("USER EDIT\n")
    run_with_outside_step(m, tmp_path, MOVED_ON, outside)


@pytest.mark.parametrize("how", ["turn", "session", "one-call"])
def test_a_users_edit_under_an_agents_temporary_name_is_interleaved(make_mount, tmp_path,
                                                                    monkeypatch, how):
    """`mv a a.bak`, the user appends to a.bak, `mv a.bak a`: a revert of the turn, the
    session or the one call doing both reported `replace a`, exit 0, and put back a's old
    content, the user's line lost without a word (a.bak, made and unmade, was passed by before
    the interleaved check, and a's own chain holds no other writer).  Now the file is followed
    through the selection's renames: `a` is interleaved, nothing is reverted without --force,
    and with it the user's edit stays.  Found by a bug hunt."""
    m = make_mount()
    with open(os.path.join(m.ws, "a"), "w") as f:
        f.write("a0\n")
    with open(os.path.join(m.ws, "other"), "w") as f:
        f.write("o0\n")
    m.mount()
    _moved_on(m, tmp_path, monkeypatch, "mv a a.bak; echo o1 >> other", "mv a.bak a", "a.bak",
              one_call=how == "one-call")
    sel = {"turn": ("--turn", "1"), "session": ("--session", "s"),
           "one-call": ("--call", "c1")}[how]
    before = tree_of(m.ws)
    assert before["a"][2] == b"a0\nUSER EDIT\n"
    r = overlayrec("revert", m.ws, *sel, "--yes", check=False)
    assert r.returncode == 1 and "interleaved: a" in r.stderr, (r.stdout, r.stderr)
    assert tree_of(m.ws) == before  # nothing reverted
    plan = json.loads(overlayrec("revert", m.ws, *sel, "--json", check=False).stdout)
    [step] = [s for s in plan["steps"] if s["path"] == "a"]
    assert step["conflict"] == "interleaved" and "a.bak" in step["note"], step
    r = overlayrec("revert", m.ws, *sel, "--yes", "--force", check=False)
    assert open(os.path.join(m.ws, "a"), "rb").read() == b"a0\nUSER EDIT\n"  # kept
    assert open(os.path.join(m.ws, "other"), "rb").read() == b"o0\n"  # the rest reverted
    assert not os.path.lexists(os.path.join(m.ws, "a.bak"))
    if how == "turn":
        # the diff names the outside writer for the path the file ends up at
        out = overlayrec("diff", m.ws, "--session", "s", "--turn", "1", "--json").stdout
        [f] = [f for f in json.loads(out)["files"] if f["path"] == "a"]
        assert any(w.startswith(f"outside:{os.getpid()}:") for w in f["writers"]), f


def test_a_users_edit_in_a_directory_the_agent_moved_on_is_interleaved(make_mount, tmp_path,
                                                                      monkeypatch):
    """`mv src lib`, the user edits lib/a, `mv lib code`: a revert of the session deleted
    code/a and gave src/a its old content back, the user's edit lost.  Now code/a and src/a
    (one file under the selection's renames) are interleaved, and --force keeps the edit."""
    m = make_mount()
    os.makedirs(os.path.join(m.ws, "src"))
    for name, data in (("a", "a0\n"), ("b", "b0\n")):
        with open(os.path.join(m.ws, "src", name), "w") as f:
            f.write(data)
    m.mount()
    _moved_on(m, tmp_path, monkeypatch, "mv src lib", "mv lib code", "lib/a")
    before = tree_of(m.ws)
    assert before["code/a"][2] == b"a0\nUSER EDIT\n"
    for sel in (("--session", "s"), ("--turn", "1")):
        r = overlayrec("revert", m.ws, *sel, "--yes", check=False)
        assert r.returncode == 1 and "interleaved: code/a" in r.stderr, (r.stdout, r.stderr)
        assert tree_of(m.ws) == before
        plan = json.loads(overlayrec("revert", m.ws, *sel, "--json", check=False).stdout)
        conflicts = {s["path"]: s["conflict"] for s in plan["steps"] if s["conflict"]}
        assert conflicts == {"code/a": "interleaved", "src/a": "interleaved"}, plan
    js = json.loads(overlayrec("diff", m.ws, "--session", "s", "--json").stdout)
    [f] = [f for f in js["files"] if f["path"] == "code/a"]
    assert any(w.startswith(f"outside:{os.getpid()}:") for w in f["writers"]), f
    overlayrec("revert", m.ws, "--session", "s", "--yes", "--force", check=False)
    assert open(os.path.join(m.ws, "code/a"), "rb").read() == b"a0\nUSER EDIT\n"  # kept
    assert open(os.path.join(m.ws, "src/b"), "rb").read() == b"b0\n"  # the rest reverted
    assert not os.path.lexists(os.path.join(m.ws, "code/b"))


def test_symlink_escape_is_refused(make_mount, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("precious")
    m = setup_ws(make_mount, tmp_path)
    m.mount()
    run_call(m, tmp_path, "mkdir x && echo made > x/f")
    # the user swaps the directory for a symlink that leads out of the workspace
    m.sh(f"rm -r x && ln -s {outside} x")
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes", check=False)
    assert r.returncode == 1 and "escape: x/f" in r.stderr
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes", "--force", check=False)
    assert (outside / "f").read_text() == "precious"  # never followed out
    assert os.path.islink(os.path.join(m.ws, "x"))
    from overlayrec.engines.revert_apply import apply_step
    from overlayrec.engines.revert_steps import Step
    from overlayrec.engines.states import ABSENT, State
    fd = os.open(m.ws, os.O_PATH | os.O_DIRECTORY)
    try:
        try:
            apply_step(fd, Step("x/f", State("file", 0o644, b"evil"), ABSENT))
            raise AssertionError("wrote through a symlink")
        except OSError:
            pass
    finally:
        os.close(fd)
    assert (outside / "f").read_text() == "precious"
    r = overlayrec("revert", m.ws, "--since", "0", "--path", "../*", check=False)
    assert "Traceback" not in r.stderr


def _slow_revert(m, delay: str, *extra: str) -> subprocess.Popen:
    """``revert --call c1 --yes`` of ``m`` started in the background, each step followed by
    ``delay`` seconds (OVERLAYREC_TEST_REVERT_DELAY), its output piped: tests act half way."""
    env = dict(os.environ, OVERLAYREC_TEST_REVERT_DELAY=delay)
    return subprocess.Popen([sys.executable, "-m", "overlayrec", "revert", m.ws, "--call", "c1",
                             "--yes", *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _kill_daemon_mid_revert(m, tmp_path):
    p = _slow_revert(m, "0.01")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if sum(1 for n in os.listdir(m.ws) if n.startswith("f")) < 250:
            break
        time.sleep(0.02)
    pid = json.load(open(os.path.join(m.state, "daemon.json")))["pid"]
    os.kill(pid, signal.SIGKILL)
    p.wait(timeout=60)
    assert p.returncode != 0
    overlayrec("umount", m.ws)
    st = json.loads(overlayrec("status", m.ws, "--json").stdout)
    assert st["pending_revert"], st
    assert "pending revert" in overlayrec("status", m.ws).stdout
    return p.pid


def test_sigkill_mid_revert_then_continue_or_roll_back(make_mount, tmp_path):
    for mode in ("continue", "rollback"):
        m = make_mount(sub=mode)
        os.makedirs(m.ws, exist_ok=True)
        (tmp_path / "call.py").write_text(CALL)
        m.mount()
        before = tree_of(m.ws)
        run_call(m, tmp_path, "for i in $(seq 1 300); do echo $i > f$i; done")
        after = tree_of(m.ws)
        killed = _kill_daemon_mid_revert(m, tmp_path)
        if mode == "continue":
            # a temporary file the killed revert left beside a path (its pid in the name):
            # --continue, whose own pid differs, left it in the workspace for good (found by
            # a bug hunt).  One of another pid's is no temporary file of this revert's: the
            # user's, kept (it was removed: found by a bug hunt)
            with open(os.path.join(m.ws, f".f7.overlayrec-revert-{killed}"), "w") as f:
                f.write("half written\n")
            users = ".f8.overlayrec-revert-4194999"
            with open(os.path.join(m.ws, users), "w") as f:
                f.write("the user's\n")
            overlayrec("revert", m.ws, "--continue")
            assert tree_of(m.ws) == {**before, users: ("file", 0o644, b"the user's\n")}
        else:
            overlayrec("unrevert", "-w", m.ws, "--yes")
            assert tree_of(m.ws) == after
        assert not json.loads(overlayrec("status", m.ws, "--json").stdout)["pending_revert"]
        assert not is_mounted(m.ws)


def test_a_revert_that_mounted_killed_half_way_leaves_no_mount(make_mount, tmp_path):
    """A revert of an unmounted workspace mounts it for itself; killed where nothing can catch
    it (SIGKILL) half way, it left that mount for good.  The daemon, whose mount it was, lifts
    it once the revert is gone, and ``--continue`` finishes the revert."""
    m = make_mount()
    os.makedirs(m.ws, exist_ok=True)
    (tmp_path / "call.py").write_text(CALL)
    m.mount()
    before = tree_of(m.ws)
    run_call(m, tmp_path, "for i in $(seq 1 300); do echo $i > f$i; done")
    m.umount()
    env = dict(os.environ, OVERLAYREC_TEST_REVERT_DELAY="0.01")
    p = subprocess.Popen([sys.executable, "-m", "overlayrec", "revert", m.ws, "--call", "c1",
                          "--yes"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60 * SLOW
        while not (is_mounted(m.ws) and
                   sum(1 for n in os.listdir(m.ws) if n.startswith("f")) < 250):
            assert time.monotonic() < deadline, "the revert did not get half way"
            time.sleep(0.02)
        p.kill()
        p.wait()
        wait_unmounted(m.ws, "the revert's mount stayed after it was killed")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert json.loads(overlayrec("status", m.ws, "--json").stdout)["pending_revert"]
    overlayrec("revert", m.ws, "--continue")
    assert tree_of(m.ws) == before
    assert not is_mounted(m.ws)


AGENT_OPEN = textwrap.dedent(r'''
    import json, subprocess, sys, time
    from overlayrec import client
    out = {}
    revert = [sys.executable, "-m", "overlayrec", "revert", "--call", "c1", "--json"]
    with client.connect() as c:
        c.call_begin("c1", "Bash")
        p = subprocess.Popen([sys.executable, "-c", "import time\nf = open('b.txt', 'a')\n"
                              "f.write('x\\n'); f.flush(); time.sleep(0.5)\n"
                              "f.write('y\\n'); f.flush(); time.sleep(60)"])
        time.sleep(2)
        out["open"] = subprocess.run(revert, capture_output=True, text=True).stdout
        p.kill()
        p.wait()
        c.call_end("c1")
    out["closed"] = subprocess.run(revert, capture_output=True, text=True).stdout
    json.dump(out, open(sys.argv[1], "w"))
''')


def test_a_file_still_being_written_says_so(make_mount, tmp_path):
    """A revert of a call whose process is still writing a file (its descriptor open, the
    run's writes no events) cannot know what the file will hold: the path is unrecorded, and
    the plan says why.  Once the descriptor is closed the same revert is planned."""
    m = setup_ws(make_mount, tmp_path, {"b.txt": b"base\n"})
    (tmp_path / "agent.py").write_text(AGENT_OPEN)
    m.mount()
    overlayrec("run", "-w", m.ws, "--", sys.executable, str(tmp_path / "agent.py"),
               str(tmp_path / "out.json"), cwd=m.ws)
    out = json.load(open(tmp_path / "out.json"))
    [step] = json.loads(out["open"])["steps"]
    assert (step["path"], step["conflict"], step["note"]) == \
        ("b.txt", "unrecorded", "still being written: a descriptor is open on it"), step
    [step] = json.loads(out["closed"])["steps"]
    assert step["path"] == "b.txt" and step.get("conflict") is None, step


def _wait_for(path, what):
    deadline = time.monotonic() + 30 * SLOW
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.05)


@pytest.mark.timeout(int(120 * SLOW))
def test_a_descriptor_left_open_after_the_run_is_still_writing(make_mount, tmp_path):
    """A call leaves a background process holding a write descriptor on ``f``; the `run`
    exits (its session and the call end, and the end seals ``f``), the mount stays.  The
    record then reads ``f`` as exact, but the process's next write would land in the file the
    revert replaced (the attic's), not in ``f``: the daemon's open handles say a descriptor of
    the call is open on it, so ``f`` is refused as still being written (as while the run was
    alive), and the process holding it is named.  Once it is closed the same revert is
    planned.  (Until 2026-12-06 the revert replaced ``f`` and exited 0, and the late write
    went to the attic.)"""
    m = setup_ws(make_mount, tmp_path, {"f": b"A\n"})
    m.mount()
    go, done, pid_file = tmp_path / "go", tmp_path / "done", tmp_path / "pid"
    writer = (f'bash -c "exec 3>>f; echo x >&3; (echo \\$BASHPID > {pid_file}; '
              f'while [ ! -e {go} ]; do sleep 0.05; done; echo late >&3; touch {done}) '
              '>/dev/null 2>&1 & exit 0"; true')
    try:
        overlayrec("run", "-w", m.ws, "--session", "s", "--", "bash", "-c", writer, cwd=m.ws)
        _wait_for(pid_file, "pid of the background writer")
        pid = int(pid_file.read_text())
        assert is_mounted(m.ws)  # the writer works in it
        [call] = [json.loads(l)["id"] for l in
                  overlayrec("calls", m.ws, "--json").stdout.splitlines()]
        r = overlayrec("revert", m.ws, "--call", call, "--yes", "--json", check=False)
        assert r.returncode == 1, (r.stdout, r.stderr)
        js = json.loads(r.stdout)
        [step] = js["steps"]
        assert (step["path"], step["conflict"], step.get("note")) == \
            ("f", "unrecorded", "still being written: a descriptor is open on it"), js
        # (with the `sleep` it runs now and then, which inherits the descriptor)
        assert pid in [int(p.split()[0]) for p in js["still_running"]], js
        assert "conflicts, nothing reverted" in r.stderr
        with open(os.path.join(m.ws, "f")) as f:
            assert f.read() == "A\nx\n"
        r = overlayrec("revert", m.ws, "--call", call, check=False)  # the preview says so
        assert "CONFLICT (unrecorded: still being written: a descriptor is open on it)" in \
            r.stdout, r.stdout
        assert "process(es) of what this reverts still run (" in r.stderr, r.stderr
        assert f"{pid} bash" in r.stderr, r.stderr
    finally:
        go.touch()  # the writer ends, whatever failed
    _wait_for(done, "end of the background writer")
    with open(os.path.join(m.ws, "f")) as f:
        assert f.read() == "A\nx\nlate\n"
    deadline = time.monotonic() + 30 * SLOW
    while True:  # its descriptor closed (the kernel's release comes on its own time)
        js = json.loads(overlayrec("revert", m.ws, "--call", call, "--json").stdout)
        if not js["still_running"] and js["steps"][0]["conflict"] is None:
            break
        assert time.monotonic() < deadline, js
        time.sleep(0.1)
    assert [(s["path"], s["action"]) for s in js["steps"]] == [("f", "replace")], js
    overlayrec("revert", m.ws, "--call", call, "--yes")
    with open(os.path.join(m.ws, "f")) as f:
        assert f.read() == "A\n"


def test_a_long_revert_shows_its_progress_on_a_terminal(make_mount, tmp_path):
    """A revert of thousands of paths takes seconds: on a terminal it says how far it has
    got, on one line it wipes at the end; piped, it says nothing more."""
    import shutil
    if shutil.which("script") is None:
        import pytest
        pytest.skip("needs script(1) for a terminal")
    m = setup_ws(make_mount, tmp_path, {f"f{i}": b"x\n" for i in range(3)})
    m.mount()
    run_call(m, tmp_path, "for f in f0 f1 f2; do echo y >> $f; done")
    env = dict(os.environ, OVERLAYREC_TEST_REVERT_DELAY="0.5")  # 1.5 s in all
    cmd = f"{sys.executable} -m overlayrec revert {m.ws} --call c1 --yes"
    r = subprocess.run(["script", "-qec", cmd, "/dev/null"], capture_output=True, env=env,
                       timeout=60)
    out = r.stdout.decode()  # bytes: text mode would read each \r as a line's end
    assert r.returncode == 0, out
    # the steps, then their paths read back (docs/revert.md), the line wiped at the end
    assert "\roverlayrec: reverting 3/3\r" in out, repr(out)
    line = "overlayrec: reading back 3/3"
    assert f"\r{line}\r{' ' * len(line)}\r" in out, repr(out)
    assert out.index("reverting 3/3") < out.index("reading back 1/3"), repr(out)
    assert out.rstrip().endswith("reverted 3 path(s) as revert " + out.split()[-1]), repr(out)
    piped = overlayrec("unrevert", m.ws, "--yes", env=env)
    assert "reverting" not in piped.stdout + piped.stderr


def test_a_second_revert_while_one_is_under_way_is_refused(make_mount, tmp_path):
    """A revert plans against the live tree and then writes: a second one planned while the
    first is writing would check its paths against a tree about to change.  It is refused
    with one line until the first is done; then it runs."""
    m = setup_ws(make_mount, tmp_path, {f"f{i}": b"v\n" for i in range(4)})
    (tmp_path / "calln.py").write_text(CALL_N)
    m.mount()
    for cid in ("c1", "c2"):
        overlayrec("run", "-w", m.ws, "--session", cid, "--", sys.executable,
                   str(tmp_path / "calln.py"), cid, f"for f in f0 f1 f2 f3; do echo {cid} >> $f; "
                   "done", cwd=m.ws)
    env = dict(os.environ, OVERLAYREC_TEST_REVERT_DELAY="0.5")
    first = subprocess.Popen([sys.executable, "-m", "overlayrec", "revert", m.ws, "--call",
                              "c2", "--yes"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not any(open(os.path.join(m.ws, f)).read() == "v\nc1\n" for f in
                      ("f0", "f1", "f2", "f3")):  # the first is writing
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.05)
        r = overlayrec("revert", m.ws, "--call", "c2", "--yes", check=False)
        assert (r.returncode, r.stderr.strip()) == (
            1, "overlayrec: error: another revert or unrevert, or a gc, of this workspace is "
               "under way: try again once it is done"), r.stderr
    finally:
        assert first.wait(timeout=60) == 0
    assert "reverted 4 path(s)" in first.stdout.read()
    for f in ("f0", "f1", "f2", "f3"):
        assert open(os.path.join(m.ws, f)).read() == "v\nc1\n"
    overlayrec("unrevert", m.ws, "--yes")  # the lock was let go
    assert open(os.path.join(m.ws, "f0")).read() == "v\nc1\nc2\n"


EXCHANGE = ("python3 -c \"import ctypes, os; l = ctypes.CDLL(None, use_errno=True); "
            "assert l.renameat2(-100, b'a.txt', -100, b'k.txt', 2) == 0, "
            "os.strerror(ctypes.get_errno())\" && echo more >> a.txt")


def test_an_exchange_then_a_write_under_either_name_is_reverted_exactly(make_mount, tmp_path):
    """renameat2(RENAME_EXCHANGE) moves each inode to the other's name; a write under the first
    name then changes the inode that came from the second, whose content no pre-image holds
    yet.  It must be saved before that write, as for a plain rename's target.  Found by a
    random-operations run: the write was journaled as inside the first name's epoch with its
    content saved, and the revert refused the other name as unrecorded."""
    m = setup_ws(make_mount, tmp_path, {"a.txt": b"aaaa\n", "k.txt": b"kk\n"})
    m.mount()
    before = tree_of(m.ws)
    run_call(m, tmp_path, EXCHANGE)
    after = tree_of(m.ws)
    assert after["a.txt"][2] == b"kk\nmore\n" and after["k.txt"][2] == b"aaaa\n"
    js = json.loads(overlayrec("revert", m.ws, "--call", "c1", "--json").stdout)
    assert [s.get("conflict") for s in js["steps"]] == [None, None], js
    overlayrec("revert", m.ws, "--call", "c1", "--yes")
    assert tree_of(m.ws) == before
    overlayrec("unrevert", m.ws, "--yes")
    assert tree_of(m.ws) == after


def test_the_workspace_roots_own_mode_is_recorded_reverted_and_replayed(make_mount, tmp_path):
    """`chmod 700 .` (as `chmod -R go-rwx .` does) changes the workspace root, whose path is
    "": its seal found no name "" in a parent and sealed it absent, so the record said the
    workspace was removed; a revert refused it as an escape, and replay left it out."""
    m = setup_ws(make_mount, tmp_path, {"a.txt": b"one\n"})
    os.chmod(m.ws, 0o755)
    m.mount()
    run_call(m, tmp_path, "touch . && chmod 700 . && echo two >> a.txt")
    assert os.stat(m.ws).st_mode & 0o777 == 0o700
    r = overlayrec("diff", m.ws, "--call", "c1", "--json")
    assert {"path": "", "change": "mode 0755 -> 0700"} in json.loads(r.stdout)["not_in_patch"]
    text = overlayrec("diff", m.ws, "--call", "c1", "--stat")
    assert ". (mode 0755 -> 0700)" in text.stderr and "removed" not in text.stderr
    for at, mode in (("before:call:c1", 0o755), ("after:call:c1", 0o700)):
        dest = tmp_path / f"replay-{mode:o}"
        overlayrec("replay", m.ws, "--at", at, "--to", str(dest))
        assert dest.stat().st_mode & 0o777 == mode, at
    overlayrec("revert", m.ws, "--call", "c1", "--yes")
    assert os.stat(m.ws).st_mode & 0o777 == 0o755
    with open(os.path.join(m.ws, "a.txt")) as f:
        assert f.read() == "one\n"
    overlayrec("unrevert", m.ws, "--yes")
    assert os.stat(m.ws).st_mode & 0o777 == 0o700
    m.umount()
    overlayrec("mount", m.ws, "--state-dir", m.state)  # no drift: the seal holds
    try:
        assert " drift " not in overlayrec("log", m.ws, "--state-dir", m.state).stdout
    finally:
        m.umount()


def call_with_user_around(m, tmp_path, call: str, user: str) -> None:
    """Mount ``m`` and run ``call`` as call c1 while a shell whose working directory is the
    workspace beneath the mount, entered before it, runs ``user`` around the recorder a second
    after the call's own changes, the call going on until it is done."""
    hand = tmp_path / "hand"
    hand.mkdir()
    shell = subprocess.Popen(["bash", "-c", f"while [ ! -e {hand}/go ]; do sleep 0.05; done; "
                              f"sleep 1; {user}; touch {hand}/done"], cwd=m.ws)
    try:
        m.mount()
        run_call(m, tmp_path, f"{call} && touch {hand}/go && "
                              f"while [ ! -e {hand}/done ]; do sleep 0.05; done")
    finally:
        shell.wait(timeout=30)


def test_a_change_around_the_mount_during_a_call_is_never_taken_for_the_calls(make_mount,
                                                                            tmp_path):
    """A shell whose directory was entered before the mount writes beneath it, around the
    recorder, while a call that edits the same file goes on.  The call's seal took what the
    file held then, the user's line with it, for the call's: its diff showed the line as the
    call's and a revert of the call removed it.  Now the seal finds the file's ctime later
    than the daemon's last change to it: a drift event of `outside:around` comes first, the
    call's end state is not known, the diff says so, and a revert refuses that file."""
    m = setup_ws(make_mount, tmp_path, {"f": b"a\n", "k": b"k\n"})
    # (the call's read leaves f's pages and size in the kernel's cache)
    call_with_user_around(m, tmp_path, "echo b >> f && cat f >/dev/null && echo kk >> k",
                          "echo user >> f")
    with open(os.path.join(m.ws, "f")) as f:  # through the mount: the cache of f was dropped
        assert f.read() == "a\nb\nuser\n"
    drifts = [json.loads(line) for line in
              overlayrec("log", m.ws, "--op", "drift", "--json").stdout.splitlines()]
    assert [(e["path"], e["unit"]) for e in drifts] == [("f", "outside:around")]
    d = json.loads(overlayrec("diff", m.ws, "--call", "c1", "--json").stdout)
    assert d["changed_around"] == ["f"] and "f" in d["inexact"] and "k" not in d["inexact"]
    row, = [json.loads(line) for line in overlayrec("calls", m.ws, "--json").stdout.splitlines()]
    assert row["around"] == ["f"], row
    r = overlayrec("diff", m.ws, "--call", "c1")
    assert "changed around the mount" in r.stderr
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes", check=False)
    assert r.returncode != 0 and "unrecorded: f" in r.stderr and "around the mount" in r.stderr
    overlayrec("revert", m.ws, "--call", "c1", "--force", "--yes")
    with open(os.path.join(m.ws, "f")) as f:
        assert f.read() == "a\nb\nuser\n"  # the user's line stays
    with open(os.path.join(m.ws, "k")) as f:
        assert f.read() == "k\n"


def test_the_calls_own_later_changes_are_never_taken_for_changes_around_the_mount(
        make_mount, tmp_path):
    """The other side of the check above: what the call itself does to a file well after its
    first change (another write, a touch, a chmod, an mmap flushed late, a chown to the owner
    it has, a link made and removed, a descriptor written again) moves the ctime through the
    daemon, which stamps it each time; nor is what it removes itself (beneath a directory it
    renamed, a fifo, a file beneath a path of some 4,200 bytes, a linked file by one of its
    names) taken for a removal around the mount: no drift event, and the call reverts whole."""
    files = {n: f"{n}\n".encode() for n in "abcdeghi"}
    m = setup_ws(make_mount, tmp_path, files)
    m.mount()
    before = tree_of(m.ws)
    run_call(m, tmp_path, textwrap.dedent('''
        echo 1 >> a; sleep 0.7; echo 2 >> a
        echo 1 >> b; sleep 0.7; touch -d 2001-01-01 b
        echo 1 >> c; sleep 0.7; chmod 600 c
        python3 -c "
        import mmap, os, time
        fd = os.open('d', os.O_RDWR); m = mmap.mmap(fd, 2); m[0:1] = b'X'; time.sleep(0.7)
        m.flush(); m.close(); os.close(fd)"
        echo 1 >> e; sleep 0.7; chown "$(id -u)" e
        echo 1 >> g; ln g g2; sleep 0.7; rm g2
        ln h h2; echo 1 >> h; sleep 0.7; rm h2
        exec 3>>i; echo 1 >&3; sleep 0.7; echo 2 >&3; exec 3>&-
        mkdir -p dd/sub && echo 1 > dd/sub/x && echo 2 > dd/y && mkfifo dd/p
        deep=$(printf 'e%.0s' $(seq 200)); deep="$deep/$deep/$deep/$deep/$deep/$deep/$deep"
        mkdir -p "long/$deep/$deep/$deep" && echo 1 > "long/$deep/$deep/$deep/f"
        echo 1 > j && ln j j2
        sleep 0.7
        mv dd dd2 && rm dd2/y dd2/p && rm -r "long/$deep/$deep" && rm j
        sleep 0.7'''))
    assert overlayrec("log", m.ws, "--op", "drift").stdout == ""
    row, = [json.loads(line) for line in overlayrec("calls", m.ws, "--json").stdout.splitlines()]
    assert row["around"] == [], row
    overlayrec("revert", m.ws, "--call", "c1", "--yes")
    assert tree_of(m.ws) == before


def test_a_removal_around_the_mount_during_a_call_is_never_taken_for_the_calls(make_mount,
                                                                               tmp_path):
    """The shell around the mount removes files while the call that made or edited them goes
    on.  The seal found them absent and the record took the removal for the call's: its diff
    showed an edited file deleted, and a file it made never there.  Now a file the daemon
    left there and no change of its removed is a drift of `outside:around` at the seal: the
    diff says so, and a revert of the call refuses the edited file (what the call left is
    gone with it) and leaves alone what is already as it was before the call."""
    m = setup_ws(make_mount, tmp_path, {"f": b"a\n", "k": b"k\n"})
    call_with_user_around(m, tmp_path, "echo b >> f && echo n > new && echo kk >> k",
                          "rm f new")
    assert sorted(os.listdir(m.ws)) == ["k"]
    # through the mount, whose cache of the names was dropped once the seal found them gone
    assert not os.path.exists(os.path.join(m.ws, "new"))
    assert not os.path.exists(os.path.join(m.ws, "f"))
    drifts = [json.loads(line) for line in
              overlayrec("log", m.ws, "--op", "drift", "--json").stdout.splitlines()]
    assert sorted((e["path"], e["unit"]) for e in drifts) == [("f", "outside:around"),
                                                             ("new", "outside:around")]
    d = json.loads(overlayrec("diff", m.ws, "--call", "c1", "--json").stdout)
    assert sorted(d["changed_around"]) == ["f", "new"] and "k" not in d["inexact"], d
    # the listing says it too, on the call's row
    assert "changed around the mount meanwhile (what it left is not known): f, new" in \
        overlayrec("calls", m.ws).stdout
    row, = [json.loads(line) for line in overlayrec("calls", m.ws, "--json").stdout.splitlines()]
    assert row["around"] == ["f", "new"], row
    err = overlayrec("diff", m.ws, "--call", "c1").stderr
    assert "changed around the mount" in err and "None" not in err, err  # no owner it cannot know
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes", check=False)
    assert r.returncode != 0 and "unrecorded: f" in r.stderr, r.stderr
    assert "new" not in r.stdout  # absent, as before the call: nothing to do there
    overlayrec("revert", m.ws, "--call", "c1", "--force", "--yes")
    assert sorted(os.listdir(m.ws)) == ["k"]  # the user's removal stays
    with open(os.path.join(m.ws, "k")) as f:
        assert f.read() == "k\n"


AROUND_AGENT = textwrap.dedent(r'''
    import os, subprocess, sys, time
    from overlayrec import client
    hand, n = sys.argv[1], int(sys.argv[2])
    with client.connect() as c:
        for i in range(n):
            c.call_begin(f"c{i}", "Bash")
            subprocess.run(["bash", "-c", "echo a >> big"], check=True)
            time.sleep(0.6)  # the change around the mount comes well after the call's own
            open(os.path.join(hand, f"go{i}"), "w").close()
            while not os.path.exists(os.path.join(hand, f"done{i}")):
                time.sleep(0.01)
            c.call_end(f"c{i}")
''')

READER = textwrap.dedent(r'''
    import os, sys
    path, stop = sys.argv[1], sys.argv[2]
    while not os.path.exists(stop):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # every read a request
        while os.read(fd, 1 << 16):
            pass
        os.close(fd)
''')


def _abort_fuse_connection(ws: str) -> None:
    """A daemon stuck in the kernel on its own connection dies only once the connection is
    aborted (fusectl): so that a regression here fails the test instead of hanging it."""
    with open("/proc/self/mountinfo", errors="surrogateescape") as f:
        minor = [line.split()[2].split(":")[1] for line in f if line.split()[4] == ws]
    if not minor:
        return
    conns = "/sys/fs/fuse/connections"
    mounted = subprocess.run(["mount", "-t", "fusectl", "none", conns], capture_output=True)
    try:
        with open(os.path.join(conns, minor[0], "abort"), "w") as f:
            f.write("1")
    except OSError:
        pass
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", conns], capture_output=True)


@pytest.mark.timeout(int(150 * SLOW))
def test_a_cache_dropped_at_a_seal_never_waits_for_a_read_the_daemon_must_answer(
        make_mount, tmp_path):
    """A seal that finds a file changed around the mount drops the kernel's cache of it; the
    kernel then waits for each of its pages a read holds locked, and a read waits for this
    daemon.  Done on the daemon's serving thread, the daemon hung for good there (in the
    kernel, beyond a SIGKILL) the first time a read was under way: here, a reader reads the
    file through the mount all along while a dozen calls end with it changed around the mount.
    Every call ends, and each seal finds its change around the mount."""
    m = setup_ws(make_mount, tmp_path, {"big": os.urandom(8 << 20)})
    hand = tmp_path / "hand"
    hand.mkdir()
    n = 12
    (tmp_path / "agent.py").write_text(AROUND_AGENT)
    (tmp_path / "reader.py").write_text(READER)
    user = subprocess.Popen(["bash", "-c", f"for i in $(seq 0 {n - 1}); do "
                             f"while [ ! -e {hand}/go$i ]; do sleep 0.02; done; "
                             f"echo u >> big; touch {hand}/done$i; done"], cwd=m.ws)
    reader = None
    try:
        m.mount()
        reader = subprocess.Popen([sys.executable, str(tmp_path / "reader.py"),
                                   os.path.join(m.ws, "big"), str(hand / "stop")])
        r = subprocess.run([sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--",
                            sys.executable, str(tmp_path / "agent.py"), str(hand), str(n)],
                           cwd=m.ws, capture_output=True, text=True, timeout=60 * SLOW)
        assert r.returncode == 0, r.stderr
        (hand / "stop").touch()
        assert reader.wait(timeout=30) == 0
        drifts = overlayrec("log", m.ws, "--op", "drift", "--json").stdout.splitlines()
        assert len(drifts) == n, drifts
    finally:
        (hand / "stop").touch()
        if reader is not None and reader.poll() is None:
            _abort_fuse_connection(m.ws)
            reader.kill()
        user.kill()
        user.wait(timeout=30)


@pytest.mark.parametrize("as_json", [False, True])
def test_a_path_written_while_the_revert_runs_is_read_back_and_said(make_mount, tmp_path,
                                                                      as_json):
    """The revert reads every path back once its steps are made: a step that did not fail
    but left its path holding something else (here the user's editor wrote it while the
    revert went on; a defect of the plan's rules would look the same) is never a silent
    success: the path is named, the exit is non-zero, the saved record keeps it, and the
    paths that do hold their target stay reverted."""
    n = 12
    m = setup_ws(make_mount, tmp_path, {f"f{i:02}": b"orig\n" for i in range(n)})
    m.mount()
    run_call(m, tmp_path, "for f in f*; do echo changed > $f; done")
    p = _slow_revert(m, "0.15", *(["--json"] if as_json else []))
    try:
        first = os.path.join(m.ws, "f00")
        deadline = time.monotonic() + 30 * SLOW
        while open(first).read() != "orig\n":
            assert time.monotonic() < deadline and p.poll() is None, "the revert did not start"
            time.sleep(0.01)
        with open(first, "w") as f:  # the user's edit, meanwhile
            f.write("mine\n")
        out, err = p.communicate(timeout=60 * SLOW)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 1 and "Traceback" not in err, (out, err)
    assert "1 path(s) do not hold what the revert put back" in err and \
        "f00 holds other content" in err, err
    if as_json:
        assert json.loads(out)["unmet"] == [
            {"path": "f00", "how": "holds other content than the revert put back"}], out
    assert open(first).read() == "mine\n"  # the edit is not undone behind the user's back
    assert all(open(os.path.join(m.ws, f"f{i:02}")).read() == "orig\n" for i in range(1, n))
    recs = [json.load(open(os.path.join(m.state, "reverts", x)))
            for x in os.listdir(os.path.join(m.state, "reverts")) if x.endswith(".json")]
    assert [(r["status"], [u["path"] for u in r["unmet"]]) for r in recs] == [("done", ["f00"])]


def test_a_hard_link_the_revert_made_then_replaced_by_a_copy_is_said(make_mount, tmp_path):
    """A call removed ``b``, a second name of ``a``, and rewrote ``a``: its revert writes
    ``a`` back in place and links ``b`` to it again.  A process that puts a copy in ``b``'s
    place meanwhile leaves the content right but the group broken (the next write through
    ``a`` would not show on ``b``): the read-back names ``b``, and the exit is non-zero."""
    m = setup_ws(make_mount, tmp_path, {"a": b"orig\n"} |
                 {f"c{i:02}": b"orig\n" for i in range(10)})
    m.mount()
    m.sh("ln a b")  # through the mount: the record knows the group
    run_call(m, tmp_path, "rm b && echo changed > a && for f in c*; do echo changed > $f; done")
    a, b = os.path.join(m.ws, "a"), os.path.join(m.ws, "b")
    p = _slow_revert(m, "0.15", "--json")
    try:
        deadline = time.monotonic() + 30 * SLOW
        while not (os.path.exists(b) and os.stat(b).st_ino == os.stat(a).st_ino):
            assert time.monotonic() < deadline and p.poll() is None, "b was not linked again"
            time.sleep(0.01)
        with open(b + ".new", "w") as f:  # a copy in its place: same content, its own inode
            f.write(open(b).read())
        os.rename(b + ".new", b)
        out, err = p.communicate(timeout=60 * SLOW)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 1 and "Traceback" not in err, (out, err)
    js = json.loads(out)
    assert ["b", "restored (hard link to a)"] in js["done"], js
    assert js["unmet"] == [{"path": "b", "how": "is not one file with a (a hard link) as the "
                            "revert put back"}], js
    assert open(a).read() == open(b).read() == "orig\n"


def test_a_linked_pair_renamed_away_keeps_a_name_linked_to_it_since(make_mount, tmp_path):
    """``d/x`` and ``d/y`` are one file.  Call c1 renames both away (``p``, ``q``); call c2
    links a third name to it (``r``).  Reverting c1 puts the pair back as that same file, one
    with ``r``, as renaming them back would: it gave the pair back as a new file, linked to
    each other only, and ``r`` no longer took a write through ``d/x`` (history model, random
    seed)."""
    m = setup_ws(make_mount, tmp_path, {"d/x": b"same\n"})
    (tmp_path / "calln.py").write_text(CALL_N)
    m.mount()
    m.sh("ln d/x d/y")  # through the mount: the record knows the pair
    for cid, script in (("c1", "mv d/x p && mv d/y q"), ("c2", "ln p r")):
        overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable,
                   str(tmp_path / "calln.py"), cid, script, cwd=m.ws)
    js = json.loads(overlayrec("revert", m.ws, "--call", "c1", "--yes", "--json").stdout)
    assert js["unmet"] == [] and js["failed"] == [], js
    ino = {n: os.lstat(os.path.join(m.ws, n)).st_ino for n in ("d/x", "d/y", "r")}
    assert len(set(ino.values())) == 1 and os.lstat(os.path.join(m.ws, "r")).st_nlink == 3, ino
    assert not os.path.exists(os.path.join(m.ws, "p")) and \
        not os.path.exists(os.path.join(m.ws, "q"))
    with open(os.path.join(m.ws, "d/x"), "a") as f:  # one file: a write shows under each name
        f.write("more\n")
    assert open(os.path.join(m.ws, "r")).read() == open(os.path.join(m.ws, "d/y")).read() == \
        "same\nmore\n"


def test_a_seal_moved_away_and_back_with_its_directory_is_not_drift(make_mount):
    """A file sealed as d/d (its call's end) moves with ``mv d b`` to b/d, is renamed away
    there, and ``mv b d`` (another call) moves the directory back: d/d is absent at the record's
    end.  The mount's drift check followed the stale seal of d/d through both renames without
    looking at b/d's own later events, called d/d changed while unmounted (a drift event), and
    a revert of the last call, after an edit of another file while unmounted, was refused:
    "changed: d/d" (found by the history model, unmounted cases, a random seed)."""
    m = make_mount()
    os.makedirs(os.path.join(m.ws, "d"))
    m.mount()
    calls = ["echo x > d/d",               # sealed as d/d at this call's end
             "mv d b; mv b/d b/e",         # moved to b/d, renamed away there
             "mv b d; echo fresh > f"]     # the directory moved back: no d/d now
    for n, script in enumerate(calls):
        overlayrec("run", "-w", m.ws, "--session", f"s{n}", "--", "sh", "-c", script, cwd=m.ws)
    m.umount()
    with open(os.path.join(m.ws, "f"), "a") as f:
        f.write("the user's line\n")  # while unmounted
    r = overlayrec("revert", m.ws, "--session", "s2", "--json", check=False)
    steps = {s["path"]: s for s in json.loads(r.stdout)["steps"]}
    assert {p: s["conflict"] for p, s in steps.items() if s["conflict"]} == {"f": "changed"}, \
        r.stdout
    assert "d/d" not in steps and "b/d" not in steps, r.stdout
    m.mount()
    try:
        drifted = [e["path"] for e in m.events() if e["op"] == "drift"]
        assert drifted == ["f"], drifted
        # the rest of the call is reverted; the user's f is left, reported
        r = overlayrec("revert", m.ws, "--session", "s2", "--force", "--yes", check=False)
        assert "f" in r.stdout + r.stderr and "d/d" not in r.stdout + r.stderr, r
        assert sorted(os.listdir(os.path.join(m.ws, "b"))) == ["e"]
        assert not os.path.exists(os.path.join(m.ws, "d"))
        assert open(os.path.join(m.ws, "f")).read() == "fresh\nthe user's line\n"
    finally:
        m.umount()


def test_a_partner_renamed_by_the_last_call_is_not_drift_of_the_other_name(make_mount):
    """``d/a`` and ``d/y`` are one inode past the whole-file limit (no hash in their seals),
    linked by the first call and sealed at its end.  The next call renames ``d/y`` (which
    moves the inode's ctime under ``d/a`` too, its link count unchanged) and then ``d`` to
    ``l``.  ``d/a`` had no event of that call, so its seal stayed the first call's, followed
    through ``mv d l`` to ``l/a``: the mount's drift check found the ctime moved and called
    ``l/a`` changed while unmounted, and a revert of the last call after an edit of another
    file while unmounted was refused, "changed: l/a" (found by the history model, unmounted
    cases with large files, a random seed).  The other known names of an inode whose name
    moves owe a seal at the end of the unit that moved it."""
    m = make_mount(env=dict(os.environ, OVERLAYREC_TEST_WHOLE_FILE_LIMIT="2"))
    os.makedirs(os.path.join(m.ws, "d"))
    with open(os.path.join(m.ws, "d", "y"), "w") as f:
        f.write("the partner's content\n")
    m.mount()
    calls = ["ln d/y d/a",                          # a link the mount knows; sealed at the end
             "mv d/y y; mv d l; echo fresh > f"]    # the partner renamed, then the directory
    for n, script in enumerate(calls):
        overlayrec("run", "-w", m.ws, "--session", f"s{n}", "--", "sh", "-c", script, cwd=m.ws)
    assert json.loads(overlayrec("status", m.ws, "--json").stdout)["drifted"] == []
    m.umount()
    with open(os.path.join(m.ws, "f"), "a") as f:
        f.write("the user's line\n")  # while unmounted
    assert json.loads(overlayrec("status", m.ws, "--json").stdout)["drifted"] == ["f"]
    r = overlayrec("revert", m.ws, "--session", "s1", "--json", check=False)
    steps = {s["path"]: s for s in json.loads(r.stdout)["steps"]}
    assert {p: s["conflict"] for p, s in steps.items() if s["conflict"]} == {"f": "changed"}, \
        r.stdout
    m.mount()
    try:
        drifted = [e["path"] for e in m.events() if e["op"] == "drift"]
        assert drifted == ["f"], drifted
        # the rest of the call is reverted; the user's f is left, reported
        r = overlayrec("revert", m.ws, "--session", "s1", "--force", "--yes", check=False)
        assert "1 conflicting path(s) left alone" in r.stdout, r
        assert not os.path.exists(os.path.join(m.ws, "l"))
        assert not os.path.exists(os.path.join(m.ws, "y"))
        a, y = (os.lstat(os.path.join(m.ws, "d", n)) for n in "ay")
        assert (a.st_ino, a.st_nlink) == (y.st_ino, 2), (a, y)
        assert open(os.path.join(m.ws, "d", "a")).read() == "the partner's content\n"
        assert open(os.path.join(m.ws, "f")).read() == "fresh\nthe user's line\n"
    finally:
        m.umount()


def test_since_with_session_takes_the_sessions_changes_after_that_point(make_mount, tmp_path):
    """`revert --since SEQ --session S` (and `diff`) planned the whole session, --since
    ignored without a word; `revert --json` with nothing to revert printed a line after its
    object.  Found by a bug hunt."""
    m = make_mount()
    for n in ("f1", "f2"):
        with open(os.path.join(m.ws, n), "w") as f:
            f.write(n + "\n")
    m.mount()
    (tmp_path / "call.py").write_text(textwrap.dedent('''
        import subprocess, sys
        from overlayrec import client
        with client.connect() as c:
            for i, cmd in enumerate(sys.argv[1:]):
                c.call_begin(f"c{i}", "Bash")
                subprocess.run(["sh", "-c", cmd], check=True)
                c.call_end(f"c{i}")
    '''))
    overlayrec("run", "-w", m.ws, "--session", "P", "--", sys.executable,
               str(tmp_path / "call.py"), "echo early >> f1", "echo late >> f2", cwd=m.ws)
    seq = next(e["seq"] for e in map(json.loads, overlayrec("log", m.ws, "--json").stdout
                                     .splitlines()) if e["op"] == "call_end")
    assert overlayrec("diff", m.ws, "--since", str(seq), "--session", "P",
                      "--name-status").stdout.split() == ["M", "f2"]
    plan = json.loads(overlayrec("revert", m.ws, "--since", str(seq), "--session", "P",
                                 "--json").stdout)
    assert [s["path"] for s in plan["steps"]] == ["f2"], plan
    overlayrec("revert", m.ws, "--since", str(seq), "--session", "P", "--yes")
    with open(os.path.join(m.ws, "f1")) as f1, open(os.path.join(m.ws, "f2")) as f2:
        assert (f1.read(), f2.read()) == ("f1\nearly\n", "f2\n")
    nothing = overlayrec("revert", m.ws, "--since", str(seq), "--session", "P", "--json",
                         "--path", "nowhere")
    assert json.loads(nothing.stdout)["steps"] == [], nothing.stdout


def test_continue_leaves_what_the_user_changed_since_the_revert_began(make_mount, tmp_path):
    """An interrupted revert carried on (`--continue`) wrote its saved plan over a file the
    user edited after the interruption, and over one the user made where the revert had
    removed one already: both edits gone, exit 0.  Refused now, naming them; `--force`
    carries on and leaves them.  Found by a bug hunt."""
    m = make_mount()
    os.makedirs(m.ws, exist_ok=True)
    (tmp_path / "call.py").write_text(CALL)
    m.mount()
    run_call(m, tmp_path, "for i in $(seq 1 300); do echo $i > f$i; done")
    _kill_daemon_mid_revert(m, tmp_path)
    left = sorted(n for n in os.listdir(m.ws) if n.startswith("f"))
    gone = sorted(f"f{i}" for i in range(1, 301) if f"f{i}" not in left)
    assert left and gone
    with open(os.path.join(m.ws, left[0]), "a") as f:
        f.write("the user's line\n")
    with open(os.path.join(m.ws, gone[0]), "w") as f:
        f.write("the user's own file\n")
    # nor does a new revert begin on the half-reverted tree (its rollback would undo it)
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes", check=False)
    assert r.returncode == 1 and "was interrupted: finish it" in r.stderr, r
    r = overlayrec("revert", m.ws, "--continue", check=False)
    assert r.returncode == 1 and "not carried on: 2 path(s) changed since the interrupted " \
        "revert began" in r.stderr and left[0] in r.stderr and gone[0] in r.stderr, r
    assert json.loads(overlayrec("status", m.ws, "--json").stdout)["pending_revert"]
    overlayrec("revert", m.ws, "--continue", "--force")
    assert sorted(n for n in os.listdir(m.ws) if n.startswith("f")) == sorted([left[0],
                                                                              gone[0]])
    with open(os.path.join(m.ws, left[0])) as a, open(os.path.join(m.ws, gone[0])) as b:
        assert a.read().endswith("the user's line\n") and b.read() == "the user's own file\n"
    assert not json.loads(overlayrec("status", m.ws, "--json").stdout)["pending_revert"]


def test_a_replay_during_a_revert_takes_its_paths_for_no_drift(make_mount, tmp_path):
    """`replay --full` while a revert writes through the mount: the revert's paths, journaled
    after the replay read the record and changed in the live tree it read next, were
    "drifted (changed outside the record)".  They are left out, and the replay says the
    record grew meanwhile.  Found by a bug hunt."""
    m = make_mount()
    os.makedirs(m.ws, exist_ok=True)
    (tmp_path / "call.py").write_text(CALL)
    m.mount()
    run_call(m, tmp_path, "for i in $(seq 1 200); do echo $i > f$i; done")
    env = dict(os.environ, OVERLAYREC_TEST_REVERT_DELAY="0.02")
    p = subprocess.Popen([sys.executable, "-m", "overlayrec", "revert", m.ws, "--call", "c1",
                          "--yes"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    try:
        deadline = time.monotonic() + 60
        while sum(1 for n in os.listdir(m.ws) if n.startswith("f")) > 150:
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.02)
        out = json.loads(overlayrec("replay", m.ws, "--full", "--json", "--to",
                                    str(tmp_path / "then")).stdout)
        assert p.poll() is None, "the revert ended before the replay: no overlap"
        assert out["drifted"] == [] and out["grew"] > 0, out
    finally:
        assert p.wait(timeout=60) == 0, p.stderr.read()


@pytest.mark.parametrize("how", ["save", "remove"])
def test_a_file_saved_while_the_revert_goes_through_the_others_is_kept(make_mount, tmp_path,
                                                                       how):
    """The user saves one of the call's files (an editor's atomic save, through the mount),
    or removes it, while the revert is writing the others, before it reaches that one: the
    revert wrote the recorded state over the save (or made the file again), said `reverted
    60 path(s)` and exit 0 (found by hunts).  Each path is looked at again just before its
    step: one changed or removed since the plan is kept, named, and the revert exits 1."""
    m = make_mount()
    os.makedirs(m.ws, exist_ok=True)
    for i in range(60):
        with open(os.path.join(m.ws, f"f{i:02d}"), "w") as f:
            f.write("base\n")
    (tmp_path / "call.py").write_text(CALL)
    m.mount()
    run_call(m, tmp_path, "for f in f*; do echo agent >> $f; done")
    p = _slow_revert(m, "0.05")
    try:
        deadline = time.monotonic() + 60 * SLOW
        while open(os.path.join(m.ws, "f00")).read() != "base\n":
            assert time.monotonic() < deadline and p.poll() is None, "the revert did not start"
            time.sleep(0.01)
        if how == "save":
            m.py("import os\nopen('.f59.tmp', 'w').write('USER-SAVED\\n')\n"
                 "os.rename('.f59.tmp', 'f59')")
        else:
            os.unlink(os.path.join(m.ws, "f59"))
        out, err = p.communicate(timeout=120 * SLOW)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 1, (out, err)
    assert "f59: kept: another writer changed it after the revert was planned" in err, err
    assert "reverted 59 path(s)" in out, out
    if how == "save":
        assert open(os.path.join(m.ws, "f59")).read() == "USER-SAVED\n"
    else:
        assert not os.path.exists(os.path.join(m.ws, "f59"))
    assert all(open(os.path.join(m.ws, f"f{i:02d}")).read() == "base\n" for i in range(59))


def test_a_file_saved_while_its_own_step_is_written_is_kept(make_mount, tmp_path):
    """A call rewrites a large file; its revert writes the old content beside it (a temp
    file) and renames it over the path.  The user's save between the two was written over,
    exit 0, nothing said (found by a hunt).  The path is looked at again once the content is
    ready: the save is kept, named, exit 1."""
    m = make_mount()
    os.makedirs(m.ws, exist_ok=True)
    with open(os.path.join(m.ws, "big"), "wb") as f:
        f.write(b"b" * (150 << 20))
    (tmp_path / "call.py").write_text(CALL)
    m.mount()
    run_call(m, tmp_path, "echo agent > big")
    p = subprocess.Popen([sys.executable, "-m", "overlayrec", "revert", m.ws, "--call", "c1",
                          "--yes"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60 * SLOW
        while not any("overlayrec-revert" in n for n in os.listdir(m.ws)):
            assert time.monotonic() < deadline and p.poll() is None, "no step began"
            time.sleep(0.005)
        m.py("import os\nopen('.big.tmp', 'w').write('USER-SAVED\\n')\n"
             "os.rename('.big.tmp', 'big')")
        out, err = p.communicate(timeout=120 * SLOW)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 1, (out, err)
    assert "big: kept: another writer changed it after the revert was planned" in err, err
    assert open(os.path.join(m.ws, "big")).read() == "USER-SAVED\n"
    assert not [n for n in os.listdir(m.ws) if "overlayrec-revert" in n]


def test_a_directory_another_writer_moved_away_is_said_when_made_anew(make_mount, tmp_path):
    """A call removes proj/old; a later session moves proj to proj2.  The call's revert made
    proj anew (mode 0755, where proj had 0700) holding only old, and said only `create
    proj/old` (found by a hunt): its step says it makes the directory anew, and why."""
    m = make_mount()
    os.makedirs(os.path.join(m.ws, "proj"))
    os.chmod(os.path.join(m.ws, "proj"), 0o700)
    for n in ("f", "old"):
        with open(os.path.join(m.ws, "proj", n), "w") as f:
            f.write(n + "\n")
    (tmp_path / "call.py").write_text(CALL_N)
    m.mount()
    for cid, script, session in (("c3", "rm proj/old", "s1"), ("d1", "mv proj proj2", "s2")):
        overlayrec("run", "-w", m.ws, "--session", session, "--", sys.executable,
                   str(tmp_path / "call.py"), cid, script, cwd=m.ws)
    r = overlayrec("revert", m.ws, "--call", "c3")
    assert "create   proj/old  (makes proj anew: another writer moved or removed it since)" \
        in r.stdout, r.stdout
    # the rename reverted first, the call's revert goes on into the directory it put back
    overlayrec("revert", m.ws, "--call", "d1", "--yes")
    r = overlayrec("revert", m.ws, "--call", "c3", "--yes")
    assert "anew" not in r.stdout, r.stdout
    assert sorted(os.listdir(os.path.join(m.ws, "proj"))) == ["f", "old"]


def test_path_on_one_side_of_a_rename_says_what_it_does_not_put_back(make_mount, tmp_path):
    """`mv proj proj2` reverted with `--path proj2`: the files are removed and nothing is put
    back under proj, which the pattern leaves out; the revert said only "reverted 3 path(s)"
    (found by hunts).  It warns, naming the rename, in the preview and the run."""
    m = make_mount()
    os.makedirs(os.path.join(m.ws, "proj"))
    with open(os.path.join(m.ws, "proj", "f"), "w") as f:
        f.write("f\n")
    (tmp_path / "call.py").write_text(CALL)
    m.mount()
    run_call(m, tmp_path, "mv proj proj2")
    for extra in ((), ("--yes",)):
        r = overlayrec("revert", m.ws, "--call", "c1", "--path", "proj2", *extra)
        assert "came by a rename from a name --path leaves out" in r.stderr and \
            "proj -> proj2" in r.stderr, r.stderr
    overlayrec("unrevert", "-w", m.ws, "--yes")
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes")  # both sides: no warning
    assert "--path leaves out" not in r.stderr
    assert os.listdir(os.path.join(m.ws, "proj")) == ["f"]


def test_path_on_the_old_side_of_a_rename_says_it_makes_copies(make_mount, tmp_path):
    """The other side: `mv d d2; echo 1 >> d2/g` reverted with `--path d` makes d/g and d/h
    again, copies, and d2 stays as it is; it said nothing (found by a bug hunt).  It warns,
    naming the rename, in the preview, the run and --json."""
    m = setup_ws(make_mount, tmp_path, {"d/g": b"g\n", "d/h": b"h\n"})
    m.mount()
    run_call(m, tmp_path, "mv d d2 && echo 1 >> d2/g")
    for extra in ((), ("--yes",)):
        r = overlayrec("revert", m.ws, "--call", "c1", "--path", "d", *extra)
        assert "moved by a rename to a name --path leaves out" in r.stderr and \
            "d -> d2" in r.stderr, r.stderr
    assert sorted(os.listdir(os.path.join(m.ws, "d2"))) == ["g", "h"]
    assert open(os.path.join(m.ws, "d", "g")).read() == "g\n"
    overlayrec("unrevert", "-w", m.ws, "--yes")
    js = json.loads(overlayrec("revert", m.ws, "--call", "c1", "--path", "d", "--json").stdout)
    assert sorted(map(tuple, js["moved_to_outside"])) == [
        ("d", "d2"), ("d/g", "d2/g"), ("d/h", "d2/h")], js
    r = overlayrec("revert", m.ws, "--call", "c1")  # both sides: no warning
    assert "--path leaves out" not in r.stderr, r.stderr


def test_what_a_rename_did_not_bring_is_no_pair_of_it(make_mount, tmp_path):
    """As above, with a file made in proj2 after the rename: it was named as having come from
    proj/c (`moved_from_outside`), which never existed, and counted in the warning (found by a
    bug hunt)."""
    m = setup_ws(make_mount, tmp_path, {"proj/a": b"a\n", "proj/sub/b": b"b\n"})
    m.mount()
    try:
        run_call(m, tmp_path, "mv proj proj2; echo c > proj2/c")
        r = overlayrec("revert", m.ws, "--call", "c1", "--path", "proj2", "--json")
        pairs = json.loads(r.stdout)["moved_from_outside"]
        assert sorted(map(tuple, pairs)) == [("proj", "proj2"), ("proj/a", "proj2/a"),
                                             ("proj/sub", "proj2/sub"),
                                             ("proj/sub/b", "proj2/sub/b")], pairs
    finally:
        m.umount()


def test_a_pair_unreverted_newest_last_is_one_file_again(make_mount, tmp_path):
    """`echo h > h` by one call, `ln h c` by the next; both reverted, newest first, then both
    unreverted: h comes back as a new inode, and c came back as a copy of it (two files, exit
    0, nothing said) unless the new inode happened to get the old number (found by a hunt, in
    about half the runs).  c is linked to h again: h's group then, made anew by a revert."""
    m = make_mount()
    (tmp_path / "call.py").write_text(CALL_N)
    m.mount()
    for i in range(3):
        for cid, script in ((f"a{i}", f"echo h > h{i}"), (f"b{i}", f"ln h{i} c{i}")):
            overlayrec("run", "-w", m.ws, "--session", f"s{i}{cid}", "--", sys.executable,
                       str(tmp_path / "call.py"), cid, script, cwd=m.ws)
            m.sh(f"echo filler > x{i}{cid}; rm x{i}{cid}")  # inode numbers move on
        overlayrec("revert", m.ws, "--call", f"b{i}", "--yes")
        overlayrec("revert", m.ws, "--call", f"a{i}", "--yes")
        m.sh(f"touch y{i}")  # takes the freed inode number, often
        overlayrec("unrevert", "-w", m.ws, "--yes")
        overlayrec("unrevert", "-w", m.ws, "--yes")
        h, c = (os.stat(os.path.join(m.ws, f"{n}{i}")) for n in "hc")
        assert (h.st_ino, h.st_nlink) == (c.st_ino, 2), (i, h, c)


def test_the_preview_says_a_directory_holding_others_files_is_kept(make_mount, tmp_path):
    """A call made `made/m`; the user added `made/user`: the preview said `delete made` with
    nothing more, and the run kept it (found by a hunt).  The step says it is kept."""
    m = make_mount()
    (tmp_path / "call.py").write_text(CALL)
    m.mount()
    run_call(m, tmp_path, "mkdir made; echo m > made/m")
    m.sh("echo u > made/user")
    for extra in ((), ("--yes",)):
        r = overlayrec("revert", m.ws, "--call", "c1", *extra)
        assert "delete   made  (kept: it holds what the revert does not remove)" in r.stdout, \
            r.stdout
    assert os.listdir(os.path.join(m.ws, "made")) == ["user"]


def test_a_set_id_bit_the_system_drops_is_said(tmp_path, monkeypatch):
    """A directory of another group, 2775, that a call chmodded 755: its revert by a user not
    of that group said "reverted", exit 0, and left 0775, the kernel having dropped the
    set-group-ID bit of its chmod (new files there then took the reverter's group).  Found by
    a bug hunt.  set_meta says what it could not set; the step is a failure."""
    from overlayrec import underlay
    from overlayrec.engines.revert_apply import set_meta
    from overlayrec.engines.states import State
    d = tmp_path / "sg"
    d.mkdir()
    real = underlay.chmod_fd

    def as_the_kernel(fd, mode):  # what chmod(2) does for a caller outside the group
        real(fd, mode & ~stat.S_ISGID)
    monkeypatch.setattr(underlay, "chmod_fd", as_the_kernel)
    st = os.stat(d)
    t = State("dir", 0o2775, b"", True, st.st_uid, st.st_gid)
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert set_meta(dfd, "sg", t) == "mode 2775 not set: the system dropped its " \
            "set-group-ID bit (this user is not of its group)"
        monkeypatch.setattr(underlay, "chmod_fd", real)
        assert set_meta(dfd, "sg", t) is None  # as root: kept
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o2775
    finally:
        os.close(dfd)


@pytest.mark.parametrize("away", ["mv d e", "rm -r d", "mv d/f d/g"])
def test_a_session_after_its_calls_revert_takes_what_that_revert_brought_back(make_mount,
                                                                                away):
    """Call 1 makes d/f, call 2 moves or removes it; call 2 is reverted (d/f comes back), then
    the session: d/f was made and unmade inside the session, so it was passed over, and the
    tree was not the one before the session, without a word (found by a bug hunt).  What
    only an earlier revert of part of the selection brought back goes with the selection."""
    m = make_mount()
    with open(os.path.join(m.ws, "k"), "w") as f:
        f.write("keep\n")
    m.mount()
    before = tree_of(m.ws)
    overlayrec("run", "-w", m.ws, "--session", "S", "--", "bash", "-c",
               f"bash -c 'mkdir d; echo 1 > d/f'; {away}; true", cwd=m.ws)
    calls = [json.loads(line)["id"] for line in
             overlayrec("calls", m.ws, "--session", "S", "--json").stdout.splitlines()]
    assert len(calls) == 2, calls
    overlayrec("revert", m.ws, "--call", calls[1], "--yes")
    assert os.path.exists(os.path.join(m.ws, "d", "f"))
    overlayrec("revert", m.ws, "--session", "S", "--yes")
    assert tree_of(m.ws) == before
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert open(os.path.join(m.ws, "d", "f")).read() == "1\n"


@pytest.mark.parametrize("pattern", [".", "./", "d/./f", "d//f"])
def test_path_dot_and_doubled_slashes_name_what_they_say(make_mount, pattern):
    """`--path .` selected nothing ("nothing to revert"), `./` the workspace root alone, and
    `d/./f` or `d//f` nothing (found by a bug hunt; diff and log share the matcher).  `.` and
    `./` are the whole workspace, the others `d/f`."""
    m = make_mount()
    os.makedirs(os.path.join(m.ws, "d"))
    with open(os.path.join(m.ws, "d", "f"), "w") as f:
        f.write("old\n")
    m.mount()
    overlayrec("run", "-w", m.ws, "--session", "s", "--", "sh", "-c",
               "echo new > d/f; echo made > g", cwd=m.ws)
    out = json.loads(overlayrec("revert", m.ws, "--session", "s", "--path", pattern,
                                "--json").stdout)
    want = ["d/f", "g"] if pattern in (".", "./") else ["d/f"]
    assert sorted(s["path"] for s in out["steps"]) == want, out
    d = overlayrec("diff", m.ws, "--session", "s", "--path", pattern, "--name-status").stdout
    assert sorted(line.split("\t")[1] for line in d.splitlines()) == want, d


def test_a_path_beneath_what_an_earlier_revert_made_a_file_again_needs_nothing(make_mount):
    """Call 1 turns file f into a directory holding f/x; call 1 is reverted (f a file again),
    then the session: f/x, beneath a file now, was refused as an `escape`, though the earlier
    revert had put it back already (found by a bug hunt)."""
    m = make_mount()
    for name, text in (("f", "file\n"), ("o", "other\n")):
        with open(os.path.join(m.ws, name), "w") as f:
            f.write(text)
    m.mount()
    before = tree_of(m.ws)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", "bash", "-c",
               "sh -c 'rm f; mkdir f; echo in > f/x'; sh -c 'echo more >> o'; true", cwd=m.ws)
    first = json.loads(overlayrec("calls", m.ws, "--session", "s", "--json")
                       .stdout.splitlines()[0])["id"]
    overlayrec("revert", m.ws, "--call", first, "--yes")
    r = overlayrec("revert", m.ws, "--session", "s", "--yes", check=False)
    assert r.returncode == 0, r.stderr
    assert "put back already by an earlier revert: f, f/x" in r.stderr, r.stderr
    assert tree_of(m.ws) == before


def _linked_in_an_earlier_mount(make_mount, tmp_path):
    """Mounted over ``a/h``, linked to ``a/z/L4`` through an earlier mount."""
    m = setup_ws(make_mount, tmp_path, {"a/h": b"3\n"})
    os.makedirs(os.path.join(m.ws, "a", "z"))
    m.mount()
    m.sh("ln a/h a/z/L4")
    m.umount()
    m.mount()
    return m


def test_a_rename_of_one_name_of_a_link_made_in_an_earlier_mount_is_reverted(make_mount,
                                                                               tmp_path):
    """``a/h`` linked to ``a/z/L4`` through the mount, in an earlier mount; a call renames
    ``a/h`` to ``a/e`` and reads ``a/z/L4``.  The mount found the two names one inode only at
    that read, inside ``a/e``'s epoch, and journaled an ``alias`` of ``a/z/L4`` whose content
    before was unknown, as after a write: the revert was refused ("unrecorded: a/z/L4", found
    by a bug hunt).  A rename changes no content: ``a/z/L4`` held before what it holds, and
    the revert renames ``a/e`` back, the link kept."""
    m = _linked_in_an_earlier_mount(make_mount, tmp_path)
    run_call(m, tmp_path, "mv a/h a/e; cat a/z/L4 > /dev/null")
    assert not [e for e in m.events() if e.get("pre", {}).get("unkept")]
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes", check=False)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert not os.path.lexists(os.path.join(m.ws, "a", "e"))
    h, l4 = (os.lstat(os.path.join(m.ws, *p)) for p in (("a", "h"), ("a", "z", "L4")))
    assert h.st_ino == l4.st_ino and h.st_nlink == 2, (h, l4)
    assert open(os.path.join(m.ws, "a", "h")).read() == "3\n"


def test_a_name_of_a_link_found_after_a_write_and_a_rename_is_still_unknown_before(make_mount,
                                                                                   tmp_path):
    """As above, but the call appends through ``a/h`` before renaming it: ``a/z/L4`` changed
    with it, unseen, so what it held before stays unknown (its ``alias`` keeps no content)
    and the revert refuses it rather than guess; a rename alone does not hide the write."""
    m = _linked_in_an_earlier_mount(make_mount, tmp_path)
    run_call(m, tmp_path, "echo x >> a/h; mv a/h a/e; cat a/z/L4 > /dev/null")
    assert [e["path"] for e in m.events() if e.get("pre", {}).get("unkept")] == ["a/z/L4"]
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes", check=False)
    assert r.returncode == 1 and "unrecorded: a/z/L4" in r.stderr, (r.stdout, r.stderr)


@pytest.mark.parametrize("blocker", ["file", "symlink"])
def test_a_directory_the_user_made_a_file_blocks_what_lies_beneath_it(make_mount, tmp_path,
                                                                       blocker):
    """A call ran `rm -r d`; then the user made a file (or a symlink) named d.  The preview
    refused d alone; `--force` left d alone and stopped half way at d/x ("escape: d is not a
    directory"), pending, though its preview had said nothing of d/x (found by a bug hunt).
    What lies beneath is an escape in the plan: `--force` leaves it, nothing pending."""
    m = setup_ws(make_mount, tmp_path, {"d/x": b"x\n", "d/y": b"y\n"})
    m.mount()
    try:
        run_call(m, tmp_path, "rm -r d")
        d = os.path.join(m.ws, "d")
        if blocker == "file":
            with open(d, "w") as f:
                f.write("user\n")
        else:
            os.symlink(str(tmp_path), d)
        js = json.loads(overlayrec("revert", m.ws, "--call", "c1", "--force",
                                   "--json").stdout)
        assert sorted((s["path"], s["conflict"]) for s in js["steps"]) == [
            ("d", "changed"), ("d/x", "escape"), ("d/y", "escape")], js
        r = overlayrec("revert", m.ws, "--call", "c1", "--force", "--yes")
        assert "3 conflicting path(s) left alone" in r.stdout, r.stdout
        st = json.loads(overlayrec("status", m.ws, "--json").stdout)
        assert not st.get("pending_revert"), st
        assert os.path.islink(d) if blocker == "symlink" else open(d).read() == "user\n"
    finally:
        m.umount()


def test_an_unrevert_links_no_file_that_took_a_removed_inodes_number(make_mount, tmp_path):
    """`mv proj proj2; mv a proj2/a`; a revert of `proj*` renamed proj2 back and removed
    proj/a (its inode to the attic, its number free); a file the user made then took that
    number, named a, with a's content.  The unrevert looked for the removal under proj2/a,
    found none, took the inode for alive and linked proj2/a to the user's file: a write to
    one changed the other (found by a bug hunt).  The removal is followed through the
    rename back."""
    m = setup_ws(make_mount, tmp_path, {"proj/x": b"x\n", "a": b"A\n"})
    m.mount()
    try:
        run_call(m, tmp_path, "mv proj proj2; mv a proj2/a")
        orig = os.stat(os.path.join(m.ws, "proj2", "a")).st_ino
        rid = json.loads(overlayrec("revert", m.ws, "--call", "c1", "--path", "proj*",
                                    "--yes", "--json").stdout)["id"]
        time.sleep(2)  # the daemon, idle, copies the removed file out of its attic: freed
        for i in range(2000):  # the user's files, until one is given the number again
            u = os.path.join(m.ws, f"u{i}")
            with open(u, "w") as f:
                f.write("A\n")
            if os.stat(u).st_ino == orig:
                os.rename(u, os.path.join(m.ws, "a"))
                break
        else:
            pytest.skip("the filesystem did not give the inode number again")
        for n in os.listdir(m.ws):
            if n.startswith("u") and n[1:].isdigit():
                os.unlink(os.path.join(m.ws, n))
        overlayrec("unrevert", "-w", m.ws, rid, "--yes")
        a, back = (os.stat(os.path.join(m.ws, p)) for p in ("a", "proj2/a"))
        assert a.st_ino != back.st_ino and a.st_nlink == back.st_nlink == 1, (a, back)
    finally:
        m.umount()


def test_a_chmod_of_a_linked_file_is_reverted_in_place_its_times_kept(make_mount, tmp_path):
    """A revert of `chmod 600 a`, a having a second name: the group's content was written
    again into its inode (a truncate and a write: its mtime the revert's, and not atomic),
    where a file of one name gets its mode back alone (found by a bug hunt)."""
    m = setup_ws(make_mount, tmp_path, {"a": b"hello\n"})
    os.link(os.path.join(m.ws, "a"), os.path.join(m.ws, "alink"))
    os.utime(os.path.join(m.ws, "a"), ns=(1577836800 * 10**9, 1577836800 * 10**9))
    before = os.stat(os.path.join(m.ws, "a"))
    m.mount()
    try:
        run_call(m, tmp_path, "chmod 600 a")
        overlayrec("revert", m.ws, "--call", "c1", "--yes")
        now = os.stat(os.path.join(m.ws, "a"))
        assert (now.st_ino, now.st_nlink, stat.S_IMODE(now.st_mode), now.st_mtime_ns) == \
            (before.st_ino, 2, 0o644, before.st_mtime_ns), now
        ops = [line.split()[5] for line in overlayrec("log", m.ws).stdout.splitlines()]
        assert "truncate" not in ops and "write" not in ops, ops
    finally:
        m.umount()


def test_a_file_of_one_name_renamed_away_comes_back_unlinked(make_mount, tmp_path):
    """`mv a b`, reverted with `--path a`: a came back as a second name of b's inode (the
    inode the rename took there), two names of a file that had one, and a write to a changed
    b (found by a bug hunt).  It comes back a file of its own."""
    m = setup_ws(make_mount, tmp_path, {"a": b"original\n"})
    m.mount()
    try:
        run_call(m, tmp_path, "mv a b")
        overlayrec("revert", m.ws, "--call", "c1", "--path", "a", "--yes")
        a, b = (os.stat(os.path.join(m.ws, n)) for n in ("a", "b"))
        assert a.st_ino != b.st_ino and a.st_nlink == b.st_nlink == 1, (a, b)
        assert open(os.path.join(m.ws, "a")).read() == "original\n"
    finally:
        m.umount()


def test_a_path_written_in_a_directory_renamed_back_is_still_being_written(make_mount,
                                                                            tmp_path):
    """`mv d e`, an append to e/a, and a background writer holding e/a open: the revert
    renamed d back and rewrote d/a, exit 0, and the writer's next write went to the replaced
    file (found by a bug hunt); without the rename the revert is refused.  The path is
    matched where it is written now."""
    m = setup_ws(make_mount, tmp_path, {"d/a": b"a\n", "d/q": b"q\n"})
    m.mount()
    try:
        holder = tmp_path / "held"
        run_call(m, tmp_path, f"mv d e; echo new >> e/a; (exec 3>>e/a; touch {holder}; "
                              "sleep 30) >/dev/null 2>&1 &")
        deadline = time.monotonic() + 30 * SLOW
        while not holder.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = overlayrec("revert", m.ws, "--call", "c1", "--json", check=False)
        steps = {s["path"]: s for s in json.loads(r.stdout)["steps"]}
        assert steps["d/a"]["conflict"] == "unrecorded" and \
            "still being written" in steps["d/a"]["note"], steps
    finally:
        subprocess.run(["pkill", "-f", f"touch {holder}"])
        subprocess.run(["pkill", "-f", "sleep 30"])
        m.umount()


def test_path_on_the_ends_of_a_chain_of_renames_names_the_first_name(make_mount, tmp_path):
    """`mv proj proj2; mv proj2 proj3`, reverted with `--path proj3`: the warning named
    proj2 (never in the tree before); with `--path proj2 --path proj3` everything was removed
    without a word; with `--path proj --path proj3` it warned though it renamed back (found by
    a bug hunt).  The chain is followed to its first name."""
    said = {}
    for sel in (("proj3",), ("proj2", "proj3"), ("proj", "proj3")):
        m = setup_ws(make_mount, tmp_path, {"proj/a": b"a\n", "proj/sub/b": b"b\n"})
        m.mount()
        try:
            run_call(m, tmp_path, "mv proj proj2; mv proj2 proj3")
            args = [x for p in sel for x in ("--path", p)]
            r = overlayrec("revert", m.ws, "--call", "c1", *args, "--json")
            said[sel] = sorted(map(tuple, json.loads(r.stdout)["moved_from_outside"]))
        finally:
            m.umount()
            shutil.rmtree(m.ws)
            shutil.rmtree(m.state, ignore_errors=True)
    want = [("proj", "proj3"), ("proj/a", "proj3/a"), ("proj/sub", "proj3/sub"),
            ("proj/sub/b", "proj3/sub/b")]
    assert said == {("proj3",): want, ("proj2", "proj3"): want, ("proj", "proj3"): []}, said


def test_a_session_after_a_revert_of_its_last_call_goes_back_before_it(make_mount):
    """Reverts stack, as Caudra's do.  Call 1 writes f and g, call 2 writes them again and h;
    call 2 is reverted (f and g hold call 1's content, h its first), then the session: f and
    g held what the earlier revert put back, a state the session itself had made, and each
    was refused as `changed` (found by a hunt on a real repository: `git checkout` of an old
    commit in one turn and back in the next, the second turn reverted, then the session: 99
    conflicts, .git/HEAD and .git/index among them).  The session's revert goes back before
    it; each unrevert peels one revert off."""
    m = make_mount()
    for n in "fgh":
        with open(os.path.join(m.ws, n), "w") as f:
            f.write("0\n")
    m.mount()
    before = tree_of(m.ws)
    overlayrec("run", "-w", m.ws, "--session", "S", "--", "bash", "-c",
               "bash -c 'echo 1 > f; echo 1 > g'; "
               "bash -c 'echo 2 > f; echo 2 >> g; echo 2 > h; echo n > new'; true", cwd=m.ws)
    after = tree_of(m.ws)
    calls = [json.loads(line)["id"] for line in
             overlayrec("calls", m.ws, "--session", "S", "--json").stdout.splitlines()]
    assert len(calls) == 2, calls
    overlayrec("revert", m.ws, "--call", calls[1], "--yes")
    between = tree_of(m.ws)
    assert between == {**before, "f": ("file", 0o644, b"1\n"), "g": ("file", 0o644, b"1\n")}
    js = json.loads(overlayrec("revert", m.ws, "--session", "S", "--json").stdout)
    assert not [s for s in js["steps"] if s["conflict"]], js
    overlayrec("revert", m.ws, "--session", "S", "--yes")
    assert tree_of(m.ws) == before
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert tree_of(m.ws) == between
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert tree_of(m.ws) == after


def test_a_user_edit_after_a_revert_of_part_of_a_session_is_still_a_conflict(make_mount):
    """The other side of the test above: what the earlier revert put back, changed since by
    the user, is theirs: the session's revert refuses it (`changed`), and writes nothing."""
    m = make_mount()
    with open(os.path.join(m.ws, "f"), "w") as f:
        f.write("0\n")
    m.mount()
    overlayrec("run", "-w", m.ws, "--session", "S", "--", "bash", "-c",
               "bash -c 'echo 1 > f'; bash -c 'echo 2 > f'; true", cwd=m.ws)
    calls = [json.loads(line)["id"] for line in
             overlayrec("calls", m.ws, "--session", "S", "--json").stdout.splitlines()]
    overlayrec("revert", m.ws, "--call", calls[1], "--yes")
    m.sh("echo 1 >> f")  # the user's, on what the revert put back
    r = overlayrec("revert", m.ws, "--session", "S", "--yes", check=False)
    assert r.returncode == 1 and "changed: f" in r.stderr, r
    assert open(os.path.join(m.ws, "f")).read() == "1\n1\n"


def test_a_reverted_file_whose_temp_name_a_secret_pattern_matches_keeps_its_record(
        make_mount, tmp_path):
    """A revert writes a file beside its path (`.NAME.overlayrec-revert-PID`) and renames it
    over.  For `envbuild.py` that name begins `.env`, which the default secret pattern `.env*`
    matches: what the revert wrote was withheld there, the rename carried the withholding to
    envbuild.py for the rest of the record (every reader showed a placeholder for its whole
    history), and the unrevert refused it as unrecorded (found by a hunt on pip's source,
    pep517/envbuild.py).  The revert's temporary name is one no secret pattern matches."""
    m = setup_ws(make_mount, tmp_path, {"envbuild.py": b"one\n", ".env": b"TOKEN=1\n"})
    m.mount()
    run_call(m, tmp_path, "echo two > envbuild.py && echo TOKEN=2 > .env")
    overlayrec("revert", m.ws, "--call", "c1", "--path", "envbuild.py", "--yes")
    assert open(os.path.join(m.ws, "envbuild.py"), "rb").read() == b"one\n"
    diff = overlayrec("diff", m.ws, "--call", "c1").stdout
    assert "-one\n+two\n" in diff and "TOKEN" not in diff, diff
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert open(os.path.join(m.ws, "envbuild.py"), "rb").read() == b"two\n"
    blame = overlayrec("blame", "-w", m.ws, "envbuild.py").stdout
    assert "secret" not in blame, blame


def test_a_group_remade_by_an_unrevert_takes_back_a_name_the_next_unrevert_makes(make_mount,
                                                                                tmp_path):
    """Found by a hunt: c0 appends to ``c`` and links it as ``y``; c1 links it as ``z``.
    Reverting c1, then c0 (c gets its content back in a new inode), then unreverting both:
    the first unrevert makes c and y one inode again, a new one; the second gave z back as a
    copy apart from them, where all three were one file (a write through z missed c)."""
    m = setup_ws(make_mount, tmp_path, {"c": b"C\n"})
    (tmp_path / "calls.py").write_text(TWO_CALLS)
    m.mount()
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable,
               str(tmp_path / "calls.py"), "echo more >> c && ln c y", "ln c z", "true",
               cwd=m.ws)
    after = tree_of(m.ws)
    for c in ("c1", "c0"):
        overlayrec("revert", m.ws, "--call", c, "--yes")
    assert tree_of(m.ws) == {"c": ("file", 0o644, b"C\n")}
    for _ in range(2):
        overlayrec("unrevert", "-w", m.ws, "--yes")
    assert tree_of(m.ws) == after
    c, y, z = (os.lstat(os.path.join(m.ws, n)) for n in "cyz")
    assert c.st_ino == y.st_ino == z.st_ino and c.st_nlink == 3, (c, y, z)


def test_path_says_the_hard_links_it_leaves_out_change_with_the_file(make_mount, tmp_path):
    """c0 links f as h and g as k; c1 appends to f and chmods g.  `revert --call c1 --path f
    --path g` puts f and g back into their inodes, which h and k share: they change too, as
    any write to a hard-linked file does.  Neither the preview nor the summary named them
    (found by a bug hunt); each step says so."""
    m = setup_ws(make_mount, tmp_path, {"f": b"F0\n", "g": b"G0\n"})
    (tmp_path / "calls.py").write_text(TWO_CALLS)
    m.mount()
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable,
               str(tmp_path / "calls.py"), "ln f h && ln g k", "echo x >> f && chmod 600 g",
               "true", cwd=m.ws)
    js = json.loads(overlayrec("revert", m.ws, "--call", "c1", "--path", "f", "--path", "g",
                               "--json").stdout)
    notes = {s["path"]: s.get("note") or "" for s in js["steps"]}
    assert set(notes) == {"f", "g"}, js
    for name, link in (("f", "h"), ("g", "k")):
        assert f"its hard link {link}, which --path leaves out, changes with it" in \
            notes[name], notes
    out = overlayrec("revert", m.ws, "--call", "c1", "--path", "f", "--path", "g",
                     "--yes").stdout
    assert "its hard link h" in out, out
    read = {n: open(os.path.join(m.ws, n), "rb").read() for n in "fhgk"}
    assert read == {"f": b"F0\n", "h": b"F0\n", "g": b"G0\n", "k": b"G0\n"}, read
    assert stat.S_IMODE(os.lstat(os.path.join(m.ws, "k")).st_mode) == 0o644


def test_continue_takes_a_rename_back_it_made_for_its_own(make_mount, tmp_path):
    """A call `echo edited >> a; mv a b`; its revert renames b back to a and writes a's old
    content (a new inode), and is killed before its next step.  `--continue` took a, which
    held what the step puts there, for another writer's change and refused (found by a bug
    hunt).  It carries on."""
    m = setup_ws(make_mount, tmp_path, {"a": b"a\n", "x": b"x\n"})
    m.mount()
    before = tree_of(m.ws)
    run_call(m, tmp_path, "echo edited >> a && mv a b && echo more >> x")
    p = _slow_revert(m, "3")
    try:
        deadline = time.monotonic() + 60 * SLOW
        a = os.path.join(m.ws, "a")
        while not (os.path.exists(a) and open(a, "rb").read() == b"a\n"):
            assert time.monotonic() < deadline and p.poll() is None, "no rename back seen"
            time.sleep(0.02)
        pid = json.load(open(os.path.join(m.state, "daemon.json")))["pid"]
        os.kill(pid, signal.SIGKILL)
        p.wait(timeout=60)
        assert p.returncode != 0
        overlayrec("umount", m.ws)
        assert json.loads(overlayrec("status", m.ws, "--json").stdout)["pending_revert"]
        r = overlayrec("revert", m.ws, "--continue", check=False)
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert tree_of(m.ws) == before
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


DIR_MOVED_SINCE = r'''
or call begin --id e1 --tool Bash --summary e; echo new > a/f; or call end --id e1
or call begin --id m1 --tool Bash --summary m; mv a b; or call end --id m1
'''


def test_a_file_whose_directory_another_call_moved_since_is_a_conflict_that_says_so(
        make_mount, tmp_path):
    """Call e1 edits a/f, call m1 then runs `mv a b`: reverting e1 said "changed: a/f", a
    path no longer there, without a word of why (found by a bug hunt).  The conflict names
    the directory another writer moved since; nothing is written."""
    m = make_mount()
    os.makedirs(os.path.join(m.ws, "a"))
    with open(os.path.join(m.ws, "a", "f"), "w") as f:
        f.write("old\n")
    m.mount()
    run_script(m, tmp_path, DIR_MOVED_SINCE)
    r = overlayrec("revert", m.ws, "--call", "e1", "--yes", check=False)
    assert r.returncode == 1 and "a was moved or removed by another writer since" in r.stdout, \
        (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    with open(os.path.join(m.ws, "b", "f")) as f:
        assert f.read() == "new\n"
    assert not os.path.exists(os.path.join(m.ws, "a"))
