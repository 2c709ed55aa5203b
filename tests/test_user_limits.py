"""A user's daemon under that user's limits: /etc/fuse.conf, the open-file and file-size
limits, a mount another user's daemon holds, a workspace root the user made read-only (found
by a bug hunt run as a non-root user, 2026-12-06)."""
from __future__ import annotations

import errno
import json
import os
import shlex
import stat

import pytest

from conftest import force_unmount, needs_fuse, needs_root, overlayrec
from test_own_permissions import NOBODY, Owner

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


def _limited(u: Owner, limit: str, *args: str, cwd: str | None = None):
    """``overlayrec ARGS`` run by ``u`` under ``ulimit LIMIT`` (bash's words: ``-Sf 512``)."""
    argv = " ".join(shlex.quote(a) for a in (u.python, "-m", "overlayrec", *args))
    return u.run(["bash", "-c", f"ulimit {limit} && exec {argv}"], cwd=cwd or u.base,
                 check=False)


def _seed_big(path: str, size: int) -> None:
    with open(path, "wb") as f:
        f.write(b"b" * size)
    os.chown(path, NOBODY, NOBODY)


# a file made larger than the limit is cut at it, and the process gets EFBIG (bash's head
# dies of SIGXFSZ): as natively, through the mount
FILE_SIZE_STEPS = ("echo x > big; echo trunc=$?; head -c 700000 /dev/zero > huge; "
                   "echo huge=$? $(stat -c %s huge)")


def test_a_soft_file_size_limit_binds_the_client_not_the_daemon(tmpbase):
    u = Owner(tmpbase, "nobody")
    native = os.path.join(u.base, "native")
    os.mkdir(native)
    os.chown(native, NOBODY, NOBODY)
    for d in (u.ws, native):
        _seed_big(os.path.join(d, "big"), 600_000)
    try:
        want = u.run(["bash", "-c", f"ulimit -Sf 512 && cd {native} && {FILE_SIZE_STEPS}"])
        assert "trunc=0" in want.stdout and "huge=153 524288" in want.stdout, want.stdout
        r = _limited(u, "-Sf 512", "run", "-w", u.ws, "--state-dir", u.sd, "--", "bash", "-c",
                     f"cd {shlex.quote(u.ws)} && {FILE_SIZE_STEPS}")
        assert r.returncode == 0, r.stderr
        assert r.stdout == want.stdout, (r.stdout, r.stderr)
        with open(os.path.join(u.ws, "big"), "rb") as f:
            assert f.read() == b"x\n"
        diff = u.ask("diff", "-w", u.ws, "--session", "last", "--numstat").stdout
        assert "big" in diff and "huge" in diff, diff
        assert "Traceback" not in u.daemon_log()
    finally:
        u.umount()


def test_a_low_hard_file_size_limit_is_refused_in_one_line(tmpbase):
    u = Owner(tmpbase, "nobody")
    try:
        r = _limited(u, "-f 512", "mount", "-w", u.ws, "--state-dir", u.sd)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, r.stderr
        assert "file-size limit is 512 KiB" in lines[0] and "Traceback" not in r.stderr, lines
        assert not os.path.exists(os.path.join(u.sd, "control.sock"))
    finally:
        u.umount()


def _one_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_readers_under_a_small_file_size_limit_name_the_path_and_the_limit(tmpbase):
    u = Owner(tmpbase, "nobody")
    big = os.path.join(u.ws, "big")
    with open(big, "wb") as f:
        f.write(os.urandom(400_000))  # not packed smaller than the limit by git
    os.chown(big, NOBODY, NOBODY)
    with open(big, "rb") as f:
        before = f.read()
    try:
        u.ask("run", "-w", u.ws, "--state-dir", u.sd, "--", "sh", "-c", f"echo x > {big}")
        dest = os.path.join(u.base, "rp")
        line = _one_line(_limited(u, "-Sf 100", "replay", "-w", u.ws, "--state-dir", u.sd,
                                  "--at", "before:session:last", "--to", dest))
        assert f"cannot replay into {dest}" in line and "big: File too large" in line \
            and "`ulimit -f`: 100 KiB" in line, line
        line = _one_line(_limited(u, "-Sf 100", "diff", "-w", u.ws, "--state-dir", u.sd,
                                  "--session", "last", "--stat"))
        assert "git fast-import failed" in line and "`ulimit -f`: 100 KiB" in line \
            and os.path.join(u.sd, "git") in line, line
        line = _one_line(_limited(u, "-Sf 100", "revert", "-w", u.ws, "--state-dir", u.sd,
                                  "--session", "last", "--yes"))
        assert line.startswith("overlayrec: error: big: cannot be written (File too large") \
            and "`ulimit -f`: 100 KiB" in line and "pending" in line \
            and "`overlayrec revert --continue`" in line, line
        assert "pending revert" in u.ask("status", "-w", u.ws, "--state-dir", u.sd).stdout
        u.ask("revert", "-w", u.ws, "--state-dir", u.sd, "--continue")
        with open(big, "rb") as f:
            assert f.read() == before
    finally:
        u.umount()


def _readers(ws: str, dest: str) -> list[list[str]]:
    """Every command that reads a workspace's record (or records into it), as ARGS."""
    return [["log", "-w", ws], ["diff", "-w", ws, "--since", "0"], ["blame", "-w", ws, "a"],
            ["calls", ws], ["replay", ws, "--to", dest], ["export", "git", ws],
            ["gc", ws, "--keep-last", "1", "--dry-run"], ["report", ws],
            ["run", "-w", ws, "--", "true"]]


def _says_whose(r, uid: int, cmd) -> None:
    lines = r.stderr.strip().splitlines()
    # (125: run's own failure, as env's; the readers' is 1)
    assert r.returncode == (125 if cmd[0] == "run" else 1) and len(lines) == 1, \
        (cmd, r.stdout, r.stderr)
    assert f"mounted and recorded by another user's daemon (uid {uid})" in lines[0], (cmd, lines)


def test_a_mount_another_user_may_not_enter_is_said_whose_by_every_reader(tmpbase):
    u = Owner(tmpbase, "nobody")
    with open(os.path.join(u.ws, "a"), "w") as f:
        f.write("a\n")
    os.chown(os.path.join(u.ws, "a"), NOBODY, NOBODY)
    root_env = dict(os.environ, XDG_STATE_HOME=os.path.join(tmpbase, "root-xdg"))
    # the user's daemon, without allow_other: root may not enter it either
    u.ask("mount", "-w", u.ws, "--state-dir", u.sd)
    try:
        assert "another user's daemon (uid 65534)" in \
            overlayrec("status", u.ws, env=root_env).stdout
        for cmd in _readers(u.ws, os.path.join(tmpbase, "rp-root")):
            _says_whose(overlayrec(*cmd, env=root_env, check=False, cwd="/"), NOBODY, cmd)
    finally:
        u.umount()
    # root's daemon over the user's own workspace, without allow_other: the owner asks
    overlayrec("mount", u.ws, "--state-dir", os.path.join(tmpbase, "root-state"), env=root_env)
    try:
        for cmd in _readers(u.ws, os.path.join(u.base, "rp-user")):
            _says_whose(u.ask(*cmd, check=False), 0, cmd)
    finally:
        overlayrec("umount", u.ws, env=root_env, check=False)
        force_unmount(u.ws)


def test_a_read_only_root_mounts_the_first_time_and_a_closed_root_says_what_to_do(tmpbase):
    u = Owner(tmpbase, "nobody")
    u.sh("mkdir d && echo a > d/a")
    os.chmod(u.ws, 0o555)  # the user's own root, read-only before any mount: no attic yet
    try:
        u.ask("run", "-w", u.ws, "--state-dir", u.sd, "--", "sh", "-c",
              f"echo b >> {shlex.quote(u.ws)}/d/a")
        assert stat.S_IMODE(os.stat(u.ws).st_mode) == 0o555
        assert os.path.isdir(os.path.join(u.ws, ".overlayrec-attic"))
        os.chmod(u.ws, 0o755)
        u.ask("run", "-w", u.ws, "--state-dir", u.sd, "--", "sh", "-c",
              f"echo c >> {shlex.quote(u.ws)}/d/a && chmod 000 {shlex.quote(u.ws)}")
        assert stat.S_IMODE(os.stat(u.ws).st_mode) == 0
        line = u.refused("revert", "-w", u.ws, "--state-dir", u.sd, "--session", "last",
                         "--yes", needles=("the workspace root has mode 0000",))
        assert f"`chmod 755 {u.ws}` first" in line and "--force" in line, line
        u.run(["chmod", "755", u.ws])
        u.ask("revert", "-w", u.ws, "--state-dir", u.sd, "--session", "last", "--yes",
              "--force")
        with open(os.path.join(u.ws, "d", "a")) as f:
            assert f.read() == "a\nb\n"
        assert stat.S_IMODE(os.stat(u.ws).st_mode) == 0o755
    finally:
        u.umount()


HOLD_OPEN = r'''
import errno, json, os
held, failed = [], None
for i in range(1000):
    try:
        held.append(open(f"f{i}", "w"))
    except OSError as e:
        failed = {"name": f"f{i}", "errno": e.errno}
        break
print(json.dumps({"held": len(held), "failed": failed}))
'''


@needs_fuse
def test_out_of_fds_a_failed_create_leaves_nothing_and_is_logged(make_mount):
    m = make_mount(env=dict(os.environ, OVERLAYREC_FD_LIMIT="128")).mount()
    try:
        out = json.loads(m.py(HOLD_OPEN).stdout)
        failed = out["failed"]
        assert failed is not None and failed["errno"] == errno.EMFILE, out
        # natively an EMFILE makes no file: nor does the mount's, nor does its record say so
        assert not os.path.lexists(os.path.join(m.ws, failed["name"])), out
        assert failed["name"] not in {e.get("path") for e in m.events()}
        m.sh("ls > /dev/null")
    finally:
        m.umount()
    with open(os.path.join(m.state, "daemon.log")) as f:
        said = [line for line in f if "out of file descriptors" in line]
    assert 1 <= len(said) <= 2 and "raise the hard limit" in said[0], said
