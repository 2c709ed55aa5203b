"""What a mount may take with it or write over: the workspace named through another path (a
bind mount of it), a state dir moved between sessions."""
from __future__ import annotations

import os
import subprocess

import pytest

from overlayrec import state

from conftest import is_mounted, needs_fuse, overlayrec, wait_unmounted


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
        assert r.returncode == 125 and "inside the workspace" in r.stderr and \
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


@needs_fuse
def test_a_moved_state_dir_is_not_written_over(make_mount, tmpbase):
    """The state dir moved between sessions (`mv st st2`): the next `run` without --state-dir
    began a new, empty record at the old path without a word and wrote over the attic's
    RECORD note, though the attic held the moved record's pre-images (found by a bug hunt).
    It is refused, naming both, and goes on with --state-dir the moved one.  A state dir gone
    with nothing of it left in the attic is a fresh start."""
    env = dict(os.environ, XDG_STATE_HOME=os.path.join(tmpbase, "xdg"))
    m = make_mount(env=env)
    with open(os.path.join(m.ws, "big.bin"), "wb") as f:
        f.write(os.urandom(400_000))  # past the small pre-images: kept by the attic
    overlayrec("run", "-w", m.ws, "--state-dir", m.state, "--", "rm", "big.bin", env=env)
    note = open(m.attic("RECORD")).read()
    moved = m.state + "2"
    os.rename(m.state, moved)
    r = overlayrec("run", "-w", m.ws, "--", "true", env=env, check=False)
    assert r.returncode == 125 and m.state in r.stderr and "--state-dir" in r.stderr and \
        "Traceback" not in r.stderr, r.stderr
    assert open(m.attic("RECORD")).read() == note and not os.path.exists(m.state)
    overlayrec("run", "-w", m.ws, "--state-dir", moved, "--", "true", env=env)
    assert "big.bin" in overlayrec("diff", m.ws, "--since", "0", "--stat", "--state-dir",
                                   moved, env=env).stdout
    # gone, and nothing of it kept in the attic: nothing to lose
    fresh = make_mount(env=env, sub="fresh")
    overlayrec("run", "-w", fresh.ws, "--state-dir", fresh.state, "--", "true", env=env)
    os.rename(fresh.state, fresh.state + "2")
    overlayrec("run", "-w", fresh.ws, "--", "true", env=env)


@needs_fuse
@pytest.mark.root
def test_a_mount_made_inside_the_workspace_is_not_taken_along(make_mount):
    """A tmpfs mounted inside the mounted workspace by the session went with the lazy unmount
    at the run's end, and its data with it (found by a bug hunt); natively it stays.  The
    run leaves the workspace mounted and says why (exit non-zero); umount refuses until the
    user has unmounted it; then the mount goes (the run's daemon ends it once nothing is left
    beneath, or umount does)."""
    m = make_mount()
    cache = os.path.join(m.ws, "cache")
    os.mkdir(cache)
    try:
        r = overlayrec("run", "-w", m.ws, "--state-dir", m.state, "--", "sh", "-c",
                       "mount -t tmpfs -o size=1m tmpfs cache && echo precious > cache/data",
                       check=False)
        assert r.returncode != 0 and cache in r.stderr and "Traceback" not in r.stderr, \
            r.stderr
        assert is_mounted(m.ws) and is_mounted(cache)
        assert open(os.path.join(cache, "data")).read() == "precious\n"
        r = overlayrec("umount", m.ws, check=False)
        assert r.returncode == 1 and cache in r.stderr and "Traceback" not in r.stderr, \
            r.stderr
        assert is_mounted(m.ws) and is_mounted(cache)
        subprocess.run(["umount", cache], check=True)
        # the run's daemon, whose run is gone, may end the mount first on its own
        overlayrec("umount", m.ws, check=False)
        wait_unmounted(m.ws, "the workspace stayed mounted once the tmpfs was gone")
    finally:
        if is_mounted(cache):
            subprocess.run(["umount", "-l", cache], check=False)
        m.umount()
