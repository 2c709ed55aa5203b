"""A revert made by a user (not root) in a workspace holding other owners' files gives back what
an in-place write would: the same inode, its owner kept.

An append to a root-owned file the user may write (its group's) was reverted by a file replacing
it, the user's (found by a bug hunt).  Natively `cat old > f` keeps everything."""
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
