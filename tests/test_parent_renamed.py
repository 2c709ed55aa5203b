"""A directory above a mounted workspace renamed (``mv p q``, the workspace ``p/ws``).

The mount moves with it.  The recorder names an fd's object by the kernel's path of it, less
the root's: kept as it was at mount, every later change was journaled under an absolute path
(diff failed on it, replay dropped it, check called the record whole); and the daemon's
unmount used the path it mounted, which names nothing any more: the mount was left dead at
its new path, and `run` exited 0 (found by a bug hunt)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import lmdb

from conftest import SLOW, force_unmount, is_mounted, needs_fuse, overlayrec
from overlayrec.journal import schema

pytestmark = needs_fuse


def _workspace(tmpbase: str) -> tuple[str, str, str]:
    """p/ws with a file ``a`` in it, its state dir, and the path it will have: q/ws."""
    ws = os.path.join(tmpbase, "p", "ws")
    os.makedirs(ws)
    with open(os.path.join(ws, "a"), "w") as f:
        f.write("a\n")
    return ws, os.path.join(tmpbase, "st"), os.path.join(tmpbase, "q", "ws")


def _wait_daemon_gone(sd: str) -> None:
    """The daemon unlinks its daemon.json as it ends (after sealing): wait for that."""
    deadline = time.monotonic() + 30 * SLOW
    while os.path.exists(os.path.join(sd, "daemon.json")):
        assert time.monotonic() < deadline, "the daemon did not end"
        time.sleep(0.1)


def _paths(sd: str) -> list[str]:
    from overlayrec.journal import Journal
    j = Journal(sd, readonly=True)
    try:
        return [e.get("path") for e in j.events() if e["op"] not in ("seal", "failed")]
    finally:
        j.close()


def test_changes_after_the_parent_is_renamed_keep_their_workspace_paths(tmpbase):
    ws, sd, moved = _workspace(tmpbase)
    overlayrec("mount", ws, "--state-dir", sd)
    try:
        with open(os.path.join(ws, "a"), "a") as f:
            f.write("a2\n")
        os.rename(os.path.join(tmpbase, "p"), os.path.join(tmpbase, "q"))
        with open(os.path.join(moved, "x"), "w") as f:
            f.write("x\n")
        with open(os.path.join(moved, "a"), "a") as f:
            f.write("a3\n")
        os.mkdir(os.path.join(moved, "d"))
    finally:
        overlayrec("umount", moved, check=False)
        force_unmount(moved)
    _wait_daemon_gone(sd)
    paths = _paths(sd)
    assert not [p for p in paths if p and p.startswith("/")], paths
    assert {"a", "x", "d"} <= set(paths), paths
    r = overlayrec("diff", "-w", moved, "--state-dir", sd, "--since", "0", "--name-status")
    assert r.stdout.split("\n")[:2] == ["M\ta", "A\tx"], r.stdout
    out = os.path.join(tmpbase, "out")
    overlayrec("replay", "-w", moved, "--state-dir", sd, "--at", "end", "--to", out)
    assert sorted(os.listdir(out)) == ["a", "d", "x"]
    with open(os.path.join(out, "a")) as f:
        assert f.read() == "a\na2\na3\n"
    overlayrec("check", "-w", moved, "--state-dir", sd)


def test_a_record_holding_an_absolute_path_is_not_whole(tmpbase):
    """A record an older recorder journaled so: check names the event, and the readers refuse
    it in one line, not a diff that fails in git or a replay that leaves the file out."""
    ws, sd, _ = _workspace(tmpbase)
    overlayrec("mount", ws, "--state-dir", sd)
    try:
        with open(os.path.join(ws, "x"), "w") as f:
            f.write("x\n")
    finally:
        overlayrec("umount", ws)
    env = lmdb.open(os.path.join(sd, "journal"), max_dbs=len(schema.DBS) + 1)
    try:
        with env.begin(write=True) as txn:
            events = env.open_db(b"events", txn=txn)
            for key, raw in txn.cursor(db=events):
                ev = json.loads(raw)
                if ev.get("path") == "x":
                    break
            # the event and the path index as that recorder wrote them: under the full path
            ev["path"] = os.path.join(ws, "x")
            txn.put(key, json.dumps(ev).encode(), db=events)
            paths = env.open_db(b"paths", txn=txn)
            assert txn.delete(schema.path_item("x", key)[0], db=paths)
            txn.put(*schema.path_item(ev["path"], key), db=paths)
            seq = ev["seq"]
    finally:
        env.close()
    r = overlayrec("check", "-w", ws, "--state-dir", sd, check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"not an event: event {seq} names an absolute path" in r.stdout, r.stdout
    r = overlayrec("diff", "-w", ws, "--state-dir", sd, "--since", "0", check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "names an absolute path" in r.stderr, r.stderr


def test_a_run_whose_session_renames_the_parent_unmounts_where_the_mount_is(tmpbase):
    ws, sd, moved = _workspace(tmpbase)
    q = os.path.join(tmpbase, "q")
    try:
        r = overlayrec("run", "-w", ws, "--state-dir", sd, "--", "sh", "-c",
                       f"echo b > b; mv {os.path.dirname(ws)} {q}; echo c > {moved}/c",
                       cwd=ws, check=False)
        left = is_mounted(moved)
    finally:
        force_unmount(moved)
    assert r.returncode == 0, r.stderr
    assert not left, "the mount was left at the workspace's new path"
    _wait_daemon_gone(sd)
    assert sorted(p for p in _paths(sd) if p) == ["b", "c"]


def test_a_run_lifts_the_moved_mount_its_dead_daemon_left(tmpbase):
    """The daemon killed after the parent's rename: nothing unmounted the mount at its new
    path; the run lifts it there, by the mount's own id."""
    ws, sd, moved = _workspace(tmpbase)
    q = os.path.join(tmpbase, "q")
    kill = ("import json,os,signal; "
            f"os.kill(json.load(open('{sd}/daemon.json'))['pid'], signal.SIGKILL)")
    try:
        r = overlayrec("run", "-w", ws, "--state-dir", sd, "--", "sh", "-c",
                       f"echo b > b; mv {os.path.dirname(ws)} {q}; cd /; "
                       f"{sys.executable} -c \"{kill}\"", cwd=ws, check=False)
        left = is_mounted(moved)
    finally:
        force_unmount(moved)
    assert not left, "the dead mount was left at the workspace's new path: " + r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_a_gone_mounts_id_given_to_another_mount_is_not_taken_for_it(make_mount, tmpbase):
    """A `run` whose daemon is gone looks for its mount by the mount's id (a directory above
    the workspace renamed moves it) and lifts it where it finds it.  The kernel gives a freed
    id to the next mount: another workspace's mount, made meanwhile, was taken for the run's,
    moved, and lifted under that workspace's agent (found in a test run).  Each mount has a
    source of its own, which must match too."""
    from overlayrec import mounting, state
    m = make_mount()
    m.mount()
    try:
        other = state.fuse_mount_at(m.ws)
        assert other["source"].startswith("overlayrec:"), other
        gone = {"id": other["id"], "source": "overlayrec:0123456789abcdef", "daemon": None}
        elsewhere = os.path.join(tmpbase, "gone-ws")
        os.mkdir(elsewhere)
        assert state.mount_point_of(gone) is None
        assert mounting.left_behind(elsewhere, m.state, gone) is None
        assert is_mounted(m.ws)
        assert state.mount_point_of(other) == m.ws
    finally:
        m.umount()


def test_a_moved_runs_end_leaves_a_mount_made_since_at_its_old_path_alone(tmpbase):
    """The parent renamed while a run goes on, and another workspace mounted since at the old
    path (its own state dir): the run's end took that mount, found at its path, for its own
    and lifted it (the other workspace's changes went unrecorded); the daemon also looked its
    own mount up by path as the rename came (found by a bug hunt).  Each is known by its
    source."""
    ws, sd, moved = _workspace(tmpbase)
    p, q = os.path.dirname(ws), os.path.join(tmpbase, "q")
    sd2 = os.path.join(tmpbase, "st2")
    try:
        overlayrec("run", "-w", ws, "--state-dir", sd, "--", "sh", "-c",
                   f"echo b > b; mv {p} {q}; mkdir -p {ws}; cd /; "
                   f"{sys.executable} -m overlayrec mount {ws} --state-dir {sd2} >/dev/null",
                   cwd=ws)
        assert is_mounted(ws), "the other workspace's mount was lifted"
        with open(os.path.join(ws, "f"), "w") as f:
            f.write("two\n")
        assert "f" in _paths(sd2)
        assert not is_mounted(moved)
    finally:
        if is_mounted(ws):
            overlayrec("umount", ws, check=False)
        force_unmount(ws)
        force_unmount(moved)


def test_a_moved_runs_release_sees_a_mount_beneath_it_where_it_is(tmpbase):
    """The parent renamed, then a tmpfs mounted inside the workspace: the run's release
    looked for mounts beneath the path it was made at, found none, and the lazy unmount took
    the tmpfs along, its files gone (found by a bug hunt).  It looks where the mount is."""
    ws, sd, moved = _workspace(tmpbase)
    q = os.path.join(tmpbase, "q")
    cache = os.path.join(moved, "cache")
    try:
        r = overlayrec("run", "-w", ws, "--state-dir", sd, "--", "sh", "-c",
                       f"mkdir cache; mv {os.path.dirname(ws)} {q}; "
                       f"mount -t tmpfs -o size=1m none {cache} && echo precious > {cache}/keep",
                       cwd=ws, check=False)
        assert r.returncode == 1 and "cache" in r.stderr, r.stderr
        assert is_mounted(moved) and open(os.path.join(cache, "keep")).read() == "precious\n"
    finally:
        subprocess.run(["umount", cache], capture_output=True)
        force_unmount(moved)
        _wait_daemon_gone(sd)


def test_a_workspace_holding_the_registry_is_refused(tmpbase):
    """A workspace that holds $XDG_STATE_HOME (a home directory), mounted with a state dir
    outside it: the daemon wrote its registry entry through its own mount before serving, hung,
    and the mount was left dead after 30 s (found by a bug hunt).  Refused in one line."""
    ws = os.path.join(tmpbase, "home")
    os.makedirs(os.path.join(ws, ".local", "state"))
    env = dict(os.environ, XDG_STATE_HOME=os.path.join(ws, ".local", "state"))
    r = overlayrec("mount", ws, "--state-dir", os.path.join(tmpbase, "sd"), env=env,
                   check=False)
    try:
        assert r.returncode == 1 and "registry" in r.stderr and \
            len(r.stderr.splitlines()) == 1, r.stderr
        assert not is_mounted(ws)
    finally:
        force_unmount(ws)
