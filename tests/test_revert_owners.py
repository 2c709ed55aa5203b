"""A revert made by a user (not root) in a workspace holding other owners' files gives back what
a plain `mv` back or an in-place write would: the same inodes, their owners kept.

It rebuilt every rename as "create the old name, delete the new one": `mv dir dir2` of a
directory holding a root-owned subdirectory stopped half way, pending (the root-owned file in it
could not be removed), a root-owned file the user may not read moved by `mv` was refused as
``unrecorded``, and one it may read came back as the user's copy.  And an append to a root-owned
file the user may write (its group's) was reverted by a file replacing it, the user's (found by a
bug hunt).  Natively `mv dir2 dir` and `cat old > f` keep everything."""
from __future__ import annotations

import json
import os

import pytest

from conftest import needs_fuse, needs_root
from test_own_permissions import NOBODY, Owner

pytestmark = [needs_fuse, needs_root, pytest.mark.timeout(180)]


def owned(ws: str) -> dict:
    """Every path beneath ``ws`` as root reads it: mode, owner, group, inode, content (the
    attic left out)."""
    out = {}
    for top, dirs, files in os.walk(ws):
        dirs[:] = [d for d in dirs if d != ".overlayrec-attic"]
        for name in dirs + files:
            p = os.path.join(top, name)
            st = os.lstat(p)
            data = None
            if name in files:
                with open(p, "rb") as f:
                    data = f.read()
            out[os.path.relpath(p, ws)] = (oct(st.st_mode), st.st_uid, st.st_gid, st.st_ino,
                                           data)
    return out


def _put(path: str, data: str, uid: int, mode: int) -> None:
    with open(path, "w") as f:
        f.write(data)
    os.chmod(path, mode)
    os.chown(path, uid, uid)


def _reverted(u: Owner, *args: str):
    """``overlayrec revert ARGS --yes`` (or unrevert) through a mount made for it, and
    whether a revert is left pending."""
    u.ask("mount", u.ws, "--state-dir", u.sd)
    try:
        r = u.ask(*args, "--yes", check=False)
        st = json.loads(u.ask("status", u.ws, "--json").stdout)
    finally:
        u.ask("umount", u.ws)
    return r, st.get("pending_revert")


def test_a_directory_holding_another_owners_is_renamed_back(tmpbase):
    """`mv dir dir2`, dir holding a root-owned directory and file: the revert stopped at
    dir2/rsub/rs ("cannot be written (Permission denied)"), pending, and --force at the same
    step.  It renames dir2 back, and the unrevert renames it again: each the same inodes."""
    u = Owner(tmpbase, "nobody")
    os.makedirs(os.path.join(u.ws, "dir", "rsub"))
    os.chown(os.path.join(u.ws, "dir"), NOBODY, NOBODY)
    _put(os.path.join(u.ws, "dir", "u1"), "mine\n", NOBODY, 0o644)
    _put(os.path.join(u.ws, "dir", "rsub", "rs"), "roots\n", 0, 0o644)
    before = owned(u.ws)
    try:
        u.agent(["mv dir dir2"])
        after = owned(u.ws)
        r, pending = _reverted(u, "revert", u.ws, "--call", "c1")
        assert r.returncode == 0 and not pending, r.stdout + r.stderr
        assert "rename" in r.stdout and "dir2" in r.stdout, r.stdout
        assert owned(u.ws) == before
        r, pending = _reverted(u, "unrevert", u.ws)
        assert r.returncode == 0 and not pending, r.stdout + r.stderr
        assert owned(u.ws) == after
    finally:
        u.umount()


def test_files_of_another_owner_moved_are_renamed_back(tmpbase):
    """`mv rbig sub/` of a root-owned 0600 file was refused as unrecorded (the user may not
    read it); `mv rfile rfile2` of a root-owned 0644 one came back as the user's copy
    ("restored but not whole: owner 0:0 not set").  Each is renamed back, as `mv` would."""
    u = Owner(tmpbase, "nobody")
    os.mkdir(os.path.join(u.ws, "sub"))
    os.chown(os.path.join(u.ws, "sub"), NOBODY, NOBODY)
    _put(os.path.join(u.ws, "rbig"), "big\n", 0, 0o600)
    _put(os.path.join(u.ws, "rfile"), "readable\n", 0, 0o644)
    before = owned(u.ws)
    try:
        u.agent(["mv rbig sub/ && mv rfile rfile2"])
        r, pending = _reverted(u, "revert", u.ws, "--call", "c1")
        assert r.returncode == 0 and not pending, r.stdout + r.stderr
        assert owned(u.ws) == before
    finally:
        u.umount()


def test_a_file_changed_beneath_a_renamed_directory_is_written_after_the_rename_back(tmpbase):
    """A call renames a directory holding another owner's and then edits a file beneath it:
    the directory is renamed back (the other owner's directory and file in it keep their
    inodes) and the edited file is written back as its own step after."""
    u = Owner(tmpbase, "nobody")
    os.makedirs(os.path.join(u.ws, "d", "rsub"))
    os.chown(os.path.join(u.ws, "d"), NOBODY, NOBODY)
    _put(os.path.join(u.ws, "d", "u1"), "mine\n", NOBODY, 0o644)
    _put(os.path.join(u.ws, "d", "rsub", "rs"), "roots\n", 0, 0o644)
    before = owned(u.ws)
    try:
        u.agent(["mv d d2 && echo more >> d2/u1 && touch d2/new"])
        r, pending = _reverted(u, "revert", u.ws, "--call", "c1")
        assert r.returncode == 0 and not pending, r.stdout + r.stderr
        now = owned(u.ws)
        assert sorted(now) == sorted(before), sorted(now)
        for p in ("d", "d/rsub", "d/rsub/rs"):  # renamed back: the same inodes
            assert now[p] == before[p], p
        assert now["d/u1"][4] == b"mine\n" and now["d/u1"][:3] == before["d/u1"][:3]
    finally:
        u.umount()


def test_a_file_of_another_owner_is_written_in_place(tmpbase):
    """An append to a root-owned file the user may write (0664, of the user's group, in a
    setgid directory of that group): its revert replaced the file, which became the user's (a
    new inode, "restored but not whole: owner not set", exit 1).  Natively `cat old > f` keeps
    root's: the revert writes it in place."""
    u = Owner(tmpbase, "nobody")
    shared = os.path.join(u.ws, "shared")
    os.mkdir(shared)
    os.chown(shared, 0, NOBODY)
    os.chmod(shared, 0o2775)
    g = os.path.join(shared, "g")
    _put(g, "gfile\n", 0, 0o664)
    os.chown(g, 0, NOBODY)
    before = owned(u.ws)
    try:
        u.agent(["echo more >> shared/g"])
        assert owned(u.ws)["shared/g"][4] == b"gfile\nmore\n"
        r, pending = _reverted(u, "revert", u.ws, "--call", "c1")
        assert r.returncode == 0 and not pending, r.stdout + r.stderr
        assert owned(u.ws) == before
        r, pending = _reverted(u, "unrevert", u.ws)
        assert r.returncode == 0 and not pending, r.stdout + r.stderr
        now = owned(u.ws)["shared/g"]
        assert now[4] == b"gfile\nmore\n" and now[:4] == before["shared/g"][:4]
    finally:
        u.umount()


def test_a_file_renamed_over_another_owners_is_renamed_back_and_the_old_one_made(tmpbase):
    """`mv -f s k`, s root's 0600 (the user may not read it), k root's of the user's group:
    the preview refused `k` as unrecorded (the live k, s's content, unreadable), and `--force`
    renamed s back and left k "alone": gone (found by a bug hunt).  The unreadable object is
    what the rename back moves away: s comes back whole, k is made again with its content,
    the user's (the owner cannot be given away: said, exit 1)."""
    u = Owner(tmpbase, "nobody")
    _put(os.path.join(u.ws, "s"), "secret\n", 0, 0o600)
    _put(os.path.join(u.ws, "k"), "k\n", 0, 0o664)
    os.chown(os.path.join(u.ws, "k"), 0, NOBODY)
    before = owned(u.ws)
    try:
        u.agent(["mv -f s k"])
        u.ask("mount", u.ws, "--state-dir", u.sd)
        try:
            preview = u.ask("revert", u.ws, "--call", "c1", check=False)
        finally:
            u.ask("umount", u.ws)
        assert preview.returncode == 0 and "CONFLICT" not in preview.stdout, preview
        r, pending = _reverted(u, "revert", u.ws, "--call", "c1", "--force")
        assert not pending and "k: owner 0:" in r.stderr, r.stdout + r.stderr
        now = owned(u.ws)
        assert now["s"] == before["s"]  # renamed back: root's, its inode
        assert now["k"][4] == b"k\n" and now["k"][0] == before["k"][0]
    finally:
        u.umount()


def test_what_readers_say_of_another_owners_files_a_rename_moved(tmpbase, tmp_path):
    """`mv dir dir2; mv dir2/rsub dir2/rsub2` by a user, dir holding root's 0600 file, a
    directory of root's and a 0000 file of the user's (found by a bug hunt): `diff` said of the
    renamed 0600 file "file made" under the patch's "rename to"; `replay --full` before the
    session named as not made, and as owners not set, the live tree's dir2 paths, which the
    point does not hold; and a root 0700 directory there was "cannot be listed ... (chmod
    u+r)", advice its reader cannot follow."""
    u = Owner(tmpbase, "nobody")
    d = os.path.join(u.ws, "dir")
    os.makedirs(os.path.join(d, "rsub"))
    os.makedirs(os.path.join(d, "rpriv"))
    os.chown(d, NOBODY, NOBODY)
    _put(os.path.join(d, "r600"), "r\n", 0, 0o600)
    _put(os.path.join(d, "rsub", "s"), "s\n", 0, 0o644)
    _put(os.path.join(d, "rpriv", "p"), "p\n", 0, 0o644)
    os.chmod(os.path.join(d, "rpriv"), 0o700)
    _put(os.path.join(d, "u000"), "u\n", NOBODY, 0o000)
    try:
        u.agent(["mv dir dir2 && mv dir2/rsub dir2/rsub2"])
        r = u.ask("diff", u.ws, "--state-dir", u.sd, "--session", "s")
        assert "rename to dir2/r600" in r.stdout, r.stdout
        assert "dir2/r600 (renamed here, mode 0600)" in r.stderr and "file made" not in \
            r.stderr, r.stderr
        assert "cannot be listed: no read permission on it (owned by uid 0): dir2/rpriv" in \
            r.stderr, r.stderr
        out = os.path.join(u.base, "r")
        js = json.loads(u.ask("replay", u.ws, "--state-dir", u.sd, "--at", "0", "--to", out,
                              "--full", "--json").stdout)
        named = [x["path"] for x in js["not_made"]] + js["owners_not_set"]
        assert not [p for p in named if p.startswith("dir2")], js
        assert len(js["owners_not_set"]) == len(set(js["owners_not_set"])), js
    finally:
        u.umount()
