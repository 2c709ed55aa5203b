"""What a mount may take with it or write over: the workspace named through another path (a
bind mount of it), a state dir moved between sessions."""
from __future__ import annotations

import os
import subprocess

import pytest

from overlayrec import state

from conftest import is_mounted, needs_fuse, overlayrec


def _bind(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    subprocess.run(["mount", "--bind", src, dst], check=True)


def _unbind(dst: str) -> None:
    subprocess.run(["umount", dst], check=False)


@needs_fuse
@pytest.mark.root
def test_a_state_dir_inside_the_workspace_through_a_bind_mount_is_refused(make_mount):
    """A state dir named through a bind mount of the workspace is inside it as much as one
    named directly: refused, not a journal the session could delete (found by a bug hunt: it
    was compared by path).  So is replay into it, and a second daemon over the same tree."""
    m = make_mount()
    alias = os.path.join(m.base, "alias")
    with open(os.path.join(m.ws, "a"), "w") as f:
        f.write("a\n")
    _bind(m.ws, alias)
    try:
        r = overlayrec("run", "-w", m.ws, "--state-dir", os.path.join(alias, "st"), "--",
                       "true", check=False)
        assert r.returncode == 1 and "inside the workspace" in r.stderr and \
            "Traceback" not in r.stderr, r.stderr
        assert not os.path.exists(os.path.join(m.ws, "st")) and not is_mounted(m.ws)
        m.mount()
        m.sh("echo b > b")
        m.umount()
        r = overlayrec("replay", m.ws, "--state-dir", m.state, "--to",
                       os.path.join(alias, "copy"), check=False)
        assert r.returncode == 1 and "inside the workspace" in r.stderr, r.stderr
        m.mount()
        # the same tree, mounted again through its other name with another state dir
        r = overlayrec("mount", alias, "--state-dir", os.path.join(m.base, "st2"), check=False)
        assert r.returncode == 1 and "recorded already" in r.stderr and \
            "Traceback" not in r.stderr, r.stderr
        assert state.fuse_mount_at(alias) is None
    finally:
        m.umount()
        if state.fuse_mount_at(alias) is not None:
            subprocess.run(["fusermount3", "-u", "-z", alias], check=False)
        _unbind(alias)
