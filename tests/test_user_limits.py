"""A user's daemon under that user's limits: /etc/fuse.conf, the open-file and file-size
limits, a mount another user's daemon holds, a workspace root the user made read-only (found
by a bug hunt run as a non-root user, 2026-12-06)."""
from __future__ import annotations

import os

import pytest

from conftest import needs_fuse, needs_root
from test_own_permissions import Owner

pytestmark = [needs_fuse, needs_root, pytest.mark.timeout(180)]


def _fuse_conf_allows_other() -> bool:
    try:
        with open("/etc/fuse.conf") as f:
            return any(line.strip() == "user_allow_other" for line in f)
    except OSError:
        return False


def test_allow_other_refused_by_fuse_conf_says_why_and_leaves_no_socket(tmpbase):
    if _fuse_conf_allows_other():
        pytest.skip("/etc/fuse.conf has user_allow_other: a user's allow_other mounts")
    u = Owner(tmpbase, "nobody")
    try:
        line = u.refused("mount", u.ws, "--state-dir", u.sd, "--allow-other",
                         needles=("user_allow_other", "/etc/fuse.conf"))
        assert "fuse_session_mount failed" not in line, line
        assert not os.path.exists(os.path.join(u.sd, "control.sock")), os.listdir(u.sd)
    finally:
        u.umount()
