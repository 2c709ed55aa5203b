"""A workspace another user's daemon records: root mounts a user's workspace (`--allow-other`,
root's state dir) and the owner asks about it.  Their `status` said "journal: (none yet)",
exit 0, and `diff` and `log` that the workspace "is not recorded", while root's daemon
journaled every change (found by a bug hunt).  Each now says that another user's daemon
(the mount's user_id) records it, whose record is not theirs to read; the readers exit 1.
Unmounted, the attic that daemon made in the workspace says so."""
from __future__ import annotations

import json
import os

import pytest

from conftest import force_unmount, needs_fuse, needs_root, overlayrec
from test_own_permissions import NOBODY, Owner

pytestmark = [needs_fuse, needs_root, pytest.mark.timeout(120)]


def test_a_workspace_another_users_daemon_records_is_said_so(tmpbase):
    user = Owner(tmpbase, "nobody")
    with open(os.path.join(user.ws, "a"), "w") as f:
        f.write("a\n")
    os.chown(os.path.join(user.ws, "a"), NOBODY, NOBODY)
    overlayrec("mount", user.ws, "--state-dir", os.path.join(tmpbase, "root-state"),
               "--allow-other")
    try:
        user.sh("echo user >> a")
        status = user.ask("status", user.ws)
        assert "another user's daemon (uid 0)" in status.stdout, status.stdout
        assert "none yet" not in status.stdout, status.stdout
        st = json.loads(user.ask("status", user.ws, "--json").stdout)
        assert st["mounted"] is True and st["recorded_by_uid"] == 0, st
        _readers_say(user, "recorded by another user's daemon (uid 0)")
        # the owner's own `run` cannot join root's daemon: said in one line (it failed on
        # "mount.lock: No such file or directory": found by a bug hunt)
        r = user.ask("run", "-w", user.ws, "--", "true", check=False)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 125 and len(lines) == 1 and \
            "recorded by another user's daemon (uid 0)" in lines[0], r
        # root's own record holds the user's change
        log = overlayrec("log", "-w", user.ws, "--state-dir",
                         os.path.join(tmpbase, "root-state")).stdout
        assert " a" in log, log
    finally:
        overlayrec("umount", user.ws, check=False)
        force_unmount(user.ws)
    # unmounted, the attic root's daemon left there says whose record it is (they said "not
    # recorded", and status "journal: (none yet)": found by a bug hunt)
    status = user.ask("status", user.ws)
    assert "recorded by another user (uid 0" in status.stdout and \
        "none yet" not in status.stdout, status.stdout
    st = json.loads(user.ask("status", user.ws, "--json").stdout)
    assert st["mounted"] is False and st["recorded_by_uid"] == 0, st
    _readers_say(user, "recorded by another user (uid 0")


def _readers_say(user, needle: str) -> None:
    """diff and log, asked by ``user``, refuse in one line saying ``needle``, exit 1."""
    for cmd in (["diff", "-w", user.ws, "--since", "0"], ["log", "-w", user.ws]):
        r = user.ask(*cmd, check=False)
        assert r.returncode == 1, (cmd, r)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and "not yours to read" in lines[0], \
            (cmd, r.stderr)
