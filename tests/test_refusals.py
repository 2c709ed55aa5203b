"""Bad input refused in one line, with nothing lost: the cases a bug hunt of every command
found still giving a wrong answer or losing data (2026-12-08)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import SLOW, force_unmount, needs_fuse, needs_root, overlayrec, run_script, \
    is_mounted

pytestmark = needs_fuse


def _recorded(m, tmp_path, script="or call begin --id c1 --tool Bash; echo agent >> a; "
              "or call end --id c1\n"):
    with open(os.path.join(m.ws, "a"), "w") as f:
        f.write("a\n")
    m.mount()
    try:
        run_script(m, tmp_path, script)
    finally:
        m.umount()


def test_a_report_written_into_the_state_dir_is_refused(make_mount, tmp_path):
    """`report --html STATE/journal/data.mdb` wrote the page over the journal: the record was
    gone ("not an LMDB file")."""
    m = make_mount()
    _recorded(m, tmp_path)
    target = os.path.join(m.state, "journal", "data.mdb")
    before = open(target, "rb").read()
    r = overlayrec("report", m.ws, "--state-dir", m.state, "--html", target, check=False)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "inside the record's state dir" in r.stderr
    assert open(target, "rb").read() == before
    overlayrec("check", m.ws, "--state-dir", m.state)
    r = overlayrec("report", m.ws, "--state-dir", m.state, "--html", "", check=False)
    assert r.returncode == 1 and "an empty path" in r.stderr, r.stderr


def test_a_budget_of_zero_is_refused(make_mount):
    """`mount --max-bytes 0` (read as "no limit" by many tools) dropped every session at the
    unmount, the whole history without a word."""
    m = make_mount()
    for cmd in (("mount", m.ws), ("run", "-w", m.ws)):
        r = overlayrec(*cmd, "--state-dir", m.state, "--max-bytes", "0",
                       *(("--", "true") if cmd[0] == "run" else ()), check=False)
        assert r.returncode == 2 and "a budget of 0" in r.stderr, r.stderr
        assert not is_mounted(m.ws)


@pytest.mark.parametrize("given", ["{ws}/conf/token.txt", "./conf/token.txt"])
def test_a_secret_given_as_a_path_is_withheld(make_mount, tmp_path, given):
    """`--secret /abs/ws/conf/token.txt` or `--secret ./conf/token.txt` were taken as given,
    matched nothing, and the secret was recorded; a path outside the workspace is refused,
    and a `run` joining a mount without its --secret is refused (it warned, then recorded)."""
    m = make_mount()
    os.makedirs(os.path.join(m.ws, "conf"))
    with open(os.path.join(m.ws, "conf", "token.txt"), "w") as f:
        f.write("old\n")
    r = overlayrec("mount", m.ws, "--state-dir", m.state, "--secret", "/usr/share/x/token",
                   check=False)
    assert r.returncode == 1 and "not inside the workspace" in r.stderr, r.stderr
    assert not is_mounted(m.ws)
    # (./ is a path from where the command runs: here, the workspace)
    overlayrec("mount", m.ws, "--state-dir", m.state, "--secret", given.format(ws=m.ws),
               cwd=m.ws)
    try:
        m.sh("echo SECRET-hunter2 > conf/token.txt")
        r = overlayrec("run", "-w", m.ws, "--secret", "conf/other.txt", "--", "true",
                       check=False, cwd=m.ws)
        assert r.returncode == 125 and "already mounted without --secret conf/other.txt" in \
            r.stderr, r.stderr
    finally:
        m.umount()
    d = overlayrec("diff", m.ws, "--state-dir", m.state, "--since", "0")
    assert "content not kept" in d.stdout and "hunter2" not in d.stdout, d.stdout


def test_a_mistyped_state_dir_is_no_record_and_repoints_nothing(make_mount, tmp_path):
    """A revert preview given a mistyped --state-dir mounted the workspace over it, began an
    empty record there, and pointed every reader at it ("no session", "events: 0")."""
    m = make_mount()
    _recorded(m, tmp_path)
    typo = str(tmp_path / "typo")
    os.mkdir(typo, 0o700)
    r = overlayrec("revert", m.ws, "--state-dir", typo, "--call", "c1", check=False)
    assert r.returncode == 1 and f"no record in {typo}" in r.stderr, r.stderr
    assert not os.path.exists(os.path.join(typo, "journal"))
    calls = overlayrec("calls", m.ws).stdout  # the registry still names the record
    assert "c1" in calls, calls


def test_umount_leaves_a_fuse_mount_that_is_not_overlayrecs(tmp_path):
    """`status` called a bindfs mount "mounted" and `umount` detached it."""
    if shutil.which("bindfs") is None:
        pytest.skip("needs bindfs")
    src, ws = tmp_path / "src", tmp_path / "ws"
    src.mkdir()
    ws.mkdir()
    subprocess.run(["bindfs", str(src), str(ws)], check=True, timeout=30)
    try:
        st = json.loads(overlayrec("status", str(ws), "--json", check=False).stdout or "{}")
        assert not st.get("mounted"), st
        r = overlayrec("umount", str(ws), check=False)
        assert r.returncode != 0, r.stdout
        assert is_mounted(str(ws))
        r = overlayrec("mount", str(ws), "--state-dir", str(tmp_path / "st"), check=False)
        assert r.returncode == 1 and "a mount of another filesystem" in r.stderr, r.stderr
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(ws)], capture_output=True)


def test_an_empty_argument_is_kept_in_the_recorded_command(make_mount, tmp_path):
    """`sh -c '...' '' hello` was recorded without its '' (the command read as another)."""
    m = make_mount()
    m.mount()
    try:
        m.sh("""sh -c 'echo "$1" > out.txt' '' hello""")
    finally:
        m.umount()
    evs = [json.loads(x) for x in overlayrec("log", m.ws, "--state-dir", m.state,
                                              "--json").stdout.splitlines()]
    argvs = [e["actor"]["argv"] for e in evs if e.get("path") == "out.txt"]
    assert argvs and argvs[0][-3:] == ["echo \"$1\" > out.txt", "", "hello"], argvs


def test_a_workspace_of_a_long_legal_name_is_recorded(make_mount, tmp_path):
    """A 245-byte name: its registry entry's name passed 255 bytes ("File name too long"),
    and nothing could record it."""
    ws = tmp_path / ("w" * 245)
    ws.mkdir()
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "xdg"))
    overlayrec("mount", str(ws), "--state-dir", str(tmp_path / "st"), env=env)
    try:
        subprocess.run(["sh", "-c", "echo x > f"], cwd=ws, check=True)
    finally:
        overlayrec("umount", str(ws), env=env, check=False)
        force_unmount(str(ws))
    st = json.loads(overlayrec("status", str(ws), "--json", env=env).stdout)
    assert st.get("events", 0) >= 1 or "f" in overlayrec("log", str(ws), env=env).stdout, st


@needs_root
def test_a_mount_refused_to_another_user_leaves_no_journal(tmp_path):
    """As another user, a mount of root's workspace was refused after the journal was made:
    the readers then answered from that empty journal ("no session", "events: 0")."""
    import tempfile
    base = tempfile.mkdtemp(dir="/var/tmp", prefix="overlayrec-test-")
    try:
        os.chmod(base, 0o755)  # (the other user reaches the workspace)
        ws = os.path.join(base, "ws")
        os.mkdir(ws)
        home = os.path.join(base, "nb")
        os.mkdir(home)
        os.chown(home, 65534, 65534)
        import sysconfig
        import overlayrec as pkg
        env = dict(os.environ, XDG_STATE_HOME=os.path.join(home, "state"), HOME=home,
                   PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(
                       os.path.abspath(pkg.__file__))), sysconfig.get_paths()["purelib"]]))
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
        probe = subprocess.run([*nobody, python, "-c", "import lmdb, click, overlayrec.cli"],
                               capture_output=True, text=True, env=env, cwd="/", timeout=60)
        if probe.returncode:
            pytest.skip(f"no Python the other user can run with this checkout: "
                        f"{probe.stderr.strip()[-200:]}")
        r = subprocess.run([*nobody, python, "-m", "overlayrec", "mount", ws],
                           capture_output=True, text=True, env=env, timeout=60 * SLOW,
                           cwd="/")
        assert r.returncode != 0 and not is_mounted(ws), r.stderr
        assert "only its owner or root can record it" in r.stderr, r.stderr
        made = [os.path.join(d, f) for d, _, fs in os.walk(home) for f in fs]
        assert not [p for p in made if p.endswith("data.mdb")], made
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _turn_record_made(m, tmp_path, change) -> None:
    """A record of one turn, whose turns record is then replaced by ``change(raw)``."""
    import lmdb
    _recorded(m, tmp_path, "or turn begin --prompt p; or call begin --id c1 --tool Bash; "
              "echo agent >> a; or call end --id c1; or turn end\n")
    env = lmdb.open(os.path.join(m.state, "journal"), max_dbs=64)
    try:
        db = env.open_db(b"turns")
        with env.begin(write=True, db=db) as txn:
            key, raw = next(iter(txn.cursor()))
            txn.put(key, change(raw))
    finally:
        env.close()


def test_a_damaged_turns_record_is_found_by_check_and_said_by_readers(make_mount, tmp_path):
    """One turns record that is no JSON: `check` said "record whole", and `turns`, `diff
    --turn`, `revert` ... failed with "internal error: JSONDecodeError"."""
    m = make_mount()
    _turn_record_made(m, tmp_path, lambda raw: b"{not json")
    r = overlayrec("check", m.ws, "--state-dir", m.state, check=False)
    assert r.returncode == 1 and "the turns table cannot be read" in r.stdout, r.stdout
    for cmd in (("turns",), ("diff", "--turn", "1")):
        r = overlayrec(*cmd, m.ws, "--state-dir", m.state, check=False)
        assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
        assert "its turns table cannot be read" in r.stderr and "internal error" not in \
            r.stderr, r.stderr


def test_a_turn_record_of_another_shape_is_said_in_one_line(make_mount, tmp_path):
    """A turns record that is JSON but holds a begin_seq of "x": `check` said whole and
    every reader failed with "internal error: TypeError"."""
    m = make_mount()
    _turn_record_made(m, tmp_path, lambda raw: json.dumps(dict(json.loads(raw),
                                                                begin_seq="x")).encode())
    r = overlayrec("check", m.ws, "--state-dir", m.state, check=False)
    assert r.returncode == 1 and "the turns table cannot be read" in r.stdout, r.stdout
    r = overlayrec("turns", m.ws, "--state-dir", m.state, check=False)
    assert r.returncode == 1 and "'begin_seq' is \"x\"" in r.stderr and \
        "internal error" not in r.stderr, r.stderr


def test_secret_paths_typed_as_paths_are_normalized():
    """`--secret WS/./conf/prod.yml`, `conf//key.txt`, `./token` typed in a subdirectory:
    each matched nothing (or the wrong path) and the secret was recorded."""
    from overlayrec.secrets import SecretError, as_given
    ws = os.path.realpath("/var/tmp")  # any existing directory serves as a workspace here
    assert as_given(f"{ws}/./conf/prod.yml", ws) == "/conf/prod.yml"
    assert as_given("conf//key.txt", ws) == "conf/key.txt"
    assert as_given("conf/prod.yml/.", ws) == "conf/prod.yml"
    assert as_given("./token", ws, cwd=f"{ws}/conf/sub") == "/conf/sub/token"
    assert as_given(".ssh/", ws) == ".ssh/" and as_given("*.pem", ws) == "*.pem"
    for bad, cwd in (("../x", "/"), ("a/../b", None), ("/usr/share/x/t", None)):
        with pytest.raises(SecretError):
            as_given(bad, ws, cwd=cwd)


def test_a_state_dir_entry_that_is_a_symlink_or_a_fifo_is_refused(make_mount, tmp_path):
    """The state dir's `journal/` a symlink into a directory another user may write: readers
    followed it (events forged into root's journal); a fifo as `daemon.json` hung `status`."""
    m = make_mount()
    _recorded(m, tmp_path)
    journal = os.path.join(m.state, "journal")
    moved = str(tmp_path / "elsewhere")
    os.rename(journal, moved)
    os.symlink(moved, journal)
    try:
        r = overlayrec("turns", m.ws, "--state-dir", m.state, check=False)
        assert r.returncode == 1 and "refusing it" in r.stderr, r.stderr
    finally:
        os.unlink(journal)
        os.rename(moved, journal)
    os.mkfifo(os.path.join(m.state, "daemon.json"))
    r = overlayrec("status", m.ws, "--state-dir", m.state, check=False, timeout=20)
    assert r.returncode == 1 and "refusing it" in r.stderr, r.stderr


def test_a_report_written_over_a_symlink_replaces_the_link(make_mount, tmp_path):
    """An agent's `ln -s ../outside/notes.txt overlayrec-report.html`: the user's `report` in
    the workspace wrote the page over the file outside (root's too)."""
    m = make_mount()
    _recorded(m, tmp_path)
    outside = tmp_path / "notes.txt"
    outside.write_text("mine\n")
    link = os.path.join(m.ws, "overlayrec-report.html")
    os.symlink(outside, link)
    overlayrec("report", m.ws, "--state-dir", m.state, cwd=m.ws)
    assert outside.read_text() == "mine\n"
    assert not os.path.islink(link) and "<!doctype html>" in open(link).read().lower()
    assert os.stat(link).st_mode & 0o077 == 0  # it holds the record's content
    attic = os.path.join(m.ws, ".overlayrec-attic", "x.html")
    r = overlayrec("report", m.ws, "--state-dir", m.state, "--html", attic, check=False)
    assert r.returncode == 1 and "attic" in r.stderr, r.stderr


def test_fetch_and_push_into_the_workspaces_own_repository_are_refused(make_mount, tmp_path):
    """`fetch --into WS/.git` (or a link to it) and `export git --push WS` wrote the records'
    refs into the workspace's own repository, which `export git --repo` refuses."""
    m = make_mount()
    subprocess.run(["git", "init", "-q", m.ws], check=True)
    _recorded(m, tmp_path)
    link = tmp_path / "gitlink"
    os.symlink(os.path.join(m.ws, ".git"), link)
    for into in (os.path.join(m.ws, ".git"), str(link)):
        r = overlayrec("fetch", str(tmp_path / "nowhere"), "--into", into, check=False)
        assert r.returncode == 1 and "inside the recorded workspace" in r.stderr, r.stderr
    r = overlayrec("export", "git", m.ws, "--state-dir", m.state, "--push", m.ws, check=False)
    assert r.returncode == 1 and "workspace's own repository" in r.stderr, r.stderr
    refs = subprocess.run(["git", "-C", m.ws, "for-each-ref"], capture_output=True,
                          text=True).stdout
    assert "overlayrec" not in refs, refs


def test_no_hook_of_the_private_git_store_runs(make_mount, tmp_path):
    """A hook put into the private store's hooks/ (by another user, where it was reached
    through a link or left open) ran as the reader on `export git`, root included."""
    m = make_mount()
    _recorded(m, tmp_path)
    overlayrec("export", "git", m.ws, "--state-dir", m.state)  # the store exists now
    marker = tmp_path / "ran"
    hooks = os.path.join(m.state, "git", "hooks")
    os.makedirs(hooks, exist_ok=True)
    for name in ("reference-transaction", "post-commit", "pre-auto-gc"):
        path = os.path.join(hooks, name)
        with open(path, "w") as f:
            f.write(f"#!/bin/sh\necho {name} >> {marker}\nexit 0\n")
        os.chmod(path, 0o700)
    _recorded(m, tmp_path, "or call begin --id c2 --tool Bash; echo more >> a; "
              "or call end --id c2\n")
    overlayrec("export", "git", m.ws, "--state-dir", m.state)
    overlayrec("diff", m.ws, "--state-dir", m.state, "--since", "0")
    assert not marker.exists(), marker.read_text()


@needs_root
def test_gc_through_the_socket_is_refused_to_another_user(make_mount, tmp_path):
    """Root recording another user's workspace gives that user the control socket (to
    announce calls): the recorded agent sent `gc` through it and dropped root's record of
    itself."""
    import sysconfig
    import overlayrec as pkg
    m = make_mount()
    _recorded(m, tmp_path)
    m.mount()
    try:
        sock = os.path.join(m.state, "control.sock")
        os.chown(sock, 65534, 65534)
        os.chmod(m.state, 0o711)
        parents, p = [], m.state
        while p != "/":
            p = os.path.dirname(p)
            parents.append((p, os.stat(p).st_mode))
            os.chmod(p, os.stat(p).st_mode | 0o011)
        try:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(
                os.path.abspath(pkg.__file__))), sysconfig.get_paths()["purelib"]]))
            python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
            code = ("import json, socket, sys; s = socket.socket(socket.AF_UNIX); "
                    "s.connect(sys.argv[1]); s.sendall(b'{\"op\": \"gc\", \"keep_last\": 0}\\n');"
                    " print(s.makefile().readline())")
            r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                python, "-c", code, sock], capture_output=True, text=True,
                               env=env, cwd="/", timeout=60)
            if r.returncode and "Permission denied" in r.stderr:
                pytest.skip("the other user cannot reach the socket here")
            answer = json.loads(r.stdout)
            assert not answer["ok"] and "refused" in answer["error"], answer
        finally:
            for p, mode in parents:
                os.chmod(p, mode)
    finally:
        m.umount()
    assert "c1" in overlayrec("calls", m.ws, "--state-dir", m.state).stdout


@needs_root
def test_a_workspace_another_user_records_is_said_to_be_theirs(tmp_path):
    """Root mounting a workspace whose attic names another user's record was told its state
    dir "no longer holds it (moved?) ... or remove the attic": the advice destroyed that
    user's pre-images (found by a bug hunt).  It says whose record it is."""
    from overlayrec import readers
    ws = tmp_path / "ws"
    attic = ws / ".overlayrec-attic"
    attic.mkdir(parents=True)
    theirs = tmp_path / "theirs-state"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    (attic / "RECORD").write_text(json.dumps({"journal_id": "abc123", "state_dir":
                                              str(theirs)}))
    (attic / "abc123.7").write_text("a kept pre-image\n")
    why = readers.attic_of_another_record(str(ws), str(tmp_path / "mine"))
    assert why is not None and "recorded by" in why and "uid 65534" in why, why
    assert "remove" not in why


def test_more_ways_around_the_refusals(make_mount, tmp_path):
    """`--push file://WS` wrote refs into the workspace's own repository; `--secret` through a
    symlink inside the workspace matched nothing; `report --html DIR/` said "Not a
    directory"; a fifo among the revert plans hung status; a symlink at the reserve sent its
    truncate outside the state dir (found by a bug hunt)."""
    from overlayrec.secrets import as_given
    m = make_mount()
    subprocess.run(["git", "init", "-q", m.ws], check=True)
    os.makedirs(os.path.join(m.ws, "conf"))
    os.symlink("conf", os.path.join(m.ws, "cfglink"))
    assert as_given(os.path.join(m.ws, "cfglink", "prod.cfg"), m.ws) == "/conf/prod.cfg"
    _recorded(m, tmp_path)
    r = overlayrec("export", "git", m.ws, "--state-dir", m.state, "--push",
                   f"file://{m.ws}", check=False)
    assert r.returncode == 1 and "workspace's own repository" in r.stderr, r.stderr
    out = tmp_path / "outdir"
    out.mkdir()
    r = overlayrec("report", m.ws, "--state-dir", m.state, "--html", f"{out}/", check=False)
    assert r.returncode == 1 and "Is a directory" in r.stderr, r.stderr
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * (3 << 20))
    os.unlink(os.path.join(m.state, "reserve")) if os.path.exists(
        os.path.join(m.state, "reserve")) else None
    os.symlink(victim, os.path.join(m.state, "reserve"))
    r = overlayrec("status", m.ws, "--state-dir", m.state, check=False)
    assert r.returncode == 1 and "refusing it" in r.stderr, r.stderr
    os.unlink(os.path.join(m.state, "reserve"))
    os.makedirs(os.path.join(m.state, "reverts"), exist_ok=True)
    os.mkfifo(os.path.join(m.state, "reverts", "x.json"))
    r = overlayrec("status", m.ws, "--state-dir", m.state, check=False, timeout=20)
    assert r.returncode == 1 and "refusing it" in r.stderr, r.stderr
    assert victim.read_bytes() == b"v" * (3 << 20)
