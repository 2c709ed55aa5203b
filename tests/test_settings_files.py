"""The agents' settings files as users have them: what `install-hooks` and a run's backup do
to a file that is a link to something else, one hard-linked, another user's, one held private,
one written by Python's json or with CRLF ends, one two installs write at once, and a run's
backup whose pid another process took (found by a bug hunt, 2026-12-08).  Unit tests of
overlayrec/agents/_settings.py and agents.install, and the CLI for its one-line refusals."""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import stat
import subprocess
import sys

import pytest

from conftest import overlayrec
from overlayrec import agents
from overlayrec.agents import _settings


def _project(tmp_path, name="claude-code", text=None):
    project = tmp_path / "proj"
    path = agents.settings_path(name, str(project))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if text is not None:
        with open(path, "wb") as f:
            f.write(text if isinstance(text, bytes) else text.encode())
    return project, path


def test_a_settings_path_linked_to_a_fifo_or_a_device_is_refused(tmp_path):
    """`ln -s /dev/null .claude/settings.json` (a user keeping an agent's settings off): the
    install replaced the device by a plain file; a fifo hung it.  Both are refused in one line
    and left as they are."""
    project, path = _project(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    targets = [fifo]
    if os.geteuid() == 0:
        dev = tmp_path / "null"
        os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        targets.append(dev)
    for target in targets:
        if os.path.lexists(path):
            os.unlink(path)
        os.symlink(target, path)
        before = os.stat(target)
        for extra in ((), ("--remove",)):
            r = overlayrec("install-hooks", "claude-code", "--project", str(project), *extra,
                           check=False, timeout=20)
            assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
            assert "is not a regular file; not touching it" in r.stderr, r.stderr
        after = os.stat(target)
        assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode)
        assert (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
        assert os.path.islink(path)
    assert not [p for p in os.listdir(os.path.dirname(path)) if "overlayrec" in p]


def _install_many(args):
    path, rounds, remove_too = args
    for _ in range(rounds):
        agents.install("claude-code", path)
        if remove_too:
            agents.install("claude-code", path, remove=True)


def test_two_installs_at_once_leave_a_whole_file(tmp_path):
    """Two installs (and removals) at once: one fixed temp name, opened by both, left a file
    that was neither's (not JSON: "Extra data"), or one install failed on the other's rename.
    Each is whole now, one after the other."""
    user = {"permissions": {"allow": ["Bash(ls:*)"]}, "env": {"A": "x" * 300}}
    _, path = _project(tmp_path, text=json.dumps(user, indent=2) + "\n")
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        pool.map(_install_many, [(path, 25, True), (path, 25, False)])
    s = json.loads(open(path).read())
    assert s["permissions"] == user["permissions"] and s["env"] == user["env"]
    assert sorted(os.listdir(os.path.dirname(path))) == ["settings.json"]


def test_a_private_settings_file_stays_private_while_it_is_written(tmp_path, monkeypatch):
    """A 0600 settings.json holding a key: the temp file the install wrote it to was the
    umask's (0644) until the rename, and another user read the key from it.  Every byte is
    written to a file that is already 0600, and the mode and owner stay."""
    _, path = _project(tmp_path, text='{"env": {"ANTHROPIC_API_KEY": "sk-secret"}}\n')
    os.chmod(path, 0o600)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
    modes = []
    real_write = os.write

    def watching(fd, data):
        modes.append(os.fstat(fd).st_mode & 0o777)
        return real_write(fd, data)
    monkeypatch.setattr(os, "write", watching)
    agents.install("claude-code", path)
    monkeypatch.undo()
    assert modes and all(m == 0o600 for m in modes), modes
    st = os.stat(path)
    assert st.st_mode & 0o777 == 0o600
    if os.geteuid() == 0:  # root's install made the user's file root's, unreadable to them
        assert (st.st_uid, st.st_gid) == (65534, 65534)


def test_a_hard_linked_settings_file_keeps_its_link(tmp_path):
    """A settings file kept by a hard link into a dotfiles directory: the install's rename cut
    it from the link (later edits of the dotfiles copy no longer reached the agent)."""
    dot = tmp_path / "dotfiles-settings.json"
    dot.write_text('{"model": "opus"}\n')
    _, path = _project(tmp_path)
    os.link(dot, path)
    agents.install("claude-code", path)
    assert os.stat(path).st_ino == os.stat(dot).st_ino and os.stat(dot).st_nlink == 2
    assert _settings.holds_ours(str(dot), "claude-code")
    agents.install("claude-code", path, remove=True)
    assert dot.read_text() == '{"model": "opus"}\n' and os.stat(dot).st_nlink == 2


@pytest.mark.parametrize("text", [
    # Python's json.dump(indent=2): non-ASCII written as \\u escapes
    json.dumps({"user": "José Müller", "env": {"A": "ü"}}, indent=2) + "\n",
    # CRLF line ends (an editor on Windows)
    json.dumps({"model": "opus", "env": {"A": "1"}}, indent=2).replace("\n", "\r\n") + "\r\n",
    # a lone escaped surrogate, as JavaScript's JSON.stringify writes a cut emoji
    '{\n  "note": "cut \\ud83d here",\n  "model": "opus"\n}\n',
])
def test_install_then_remove_is_byte_identical_for_more_layouts(tmp_path, text):
    """Python-written files lost their \\u escapes, CRLF files their CRs, and a lone surrogate
    was an internal error leaving a temp file behind; each comes back byte for byte."""
    project, path = _project(tmp_path, text=text)
    overlayrec("install-hooks", "claude-code", "--project", str(project))
    assert _settings.holds_ours(path, "claude-code")
    overlayrec("install-hooks", "claude-code", "--project", str(project), "--remove")
    assert open(path, "rb").read() == text.encode()
    assert sorted(os.listdir(os.path.dirname(path))) == ["settings.json"]


def test_remove_rewrites_nothing_and_takes_away_the_file_it_made(tmp_path):
    """`--remove` on a file holding nothing of ours rewrote it (its bytes changed); install
    then --remove where there was no file left `{}` behind."""
    text = '{"a":1,   "b": [1.50, 1e3]}'
    project, path = _project(tmp_path, text=text)
    mtime = os.stat(path).st_mtime_ns
    overlayrec("install-hooks", "claude-code", "--project", str(project), "--remove")
    assert open(path).read() == text and os.stat(path).st_mtime_ns == mtime
    os.unlink(path)
    overlayrec("install-hooks", "claude-code", "--project", str(project))
    overlayrec("install-hooks", "claude-code", "--project", str(project))
    assert os.path.exists(path)
    overlayrec("install-hooks", "claude-code", "--project", str(project), "--remove")
    assert not os.path.exists(path)
    cursor_project, cursor = _project(tmp_path, "cursor")
    overlayrec("install-hooks", "cursor", "--project", str(cursor_project))
    overlayrec("install-hooks", "cursor", "--project", str(cursor_project), "--remove")
    assert not os.path.exists(cursor)


@pytest.mark.parametrize("text,says", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"n": 1e400}', "out of range"),
])
def test_settings_json_cannot_write_back_is_refused_in_one_line(tmp_path, text, says):
    """A nesting too deep was an internal RecursionError; 1e400 was written back as
    Infinity, which is no JSON (the agent could read its settings no more)."""
    project, path = _project(tmp_path, text=text)
    r = overlayrec("install-hooks", "claude-code", "--project", str(project), check=False)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr[:300]
    assert open(path).read() == text


def test_install_hooks_for_a_project_that_does_not_exist_is_refused(tmp_path):
    """A typo in --project made the whole directory tree, silently."""
    r = overlayrec("install-hooks", "claude-code", "--project", str(tmp_path / "nope" / "x"),
                   check=False)
    assert r.returncode == 2 and "does not exist" in r.stderr, r.stderr
    assert not (tmp_path / "nope").exists()


def test_an_install_during_a_run_that_backed_the_file_up_stays(tmp_path):
    """`install-hooks cursor --user` while a Cursor run had ~/.cursor/hooks.json backed up
    (or after a killed run left the backup): the run's end put the backup back, the hooks
    the user asked for gone without a word.  The install is made to the backup too."""
    path = tmp_path / "hooks.json"
    path.write_text('{\n  "version": 1\n}\n')
    mod = agents.get("cursor")

    def run_edit(settings, how):
        _settings.merge_flat(settings, mod.hook_entries(
            lambda ev: agents.hook_command("cursor", ev)), "cursor")
        return _settings.dumps(settings, how)
    assert _settings.edit_for_run(str(path), run_edit)
    agents.install("cursor", str(path))  # the user's, while the run has the file
    assert _settings.restore(str(path))  # the run's end
    assert _settings.holds_ours(str(path), "cursor")
    agents.install("cursor", str(path), remove=True)
    assert path.read_text() == '{\n  "version": 1\n}\n'


def test_a_killed_runs_backup_whose_pid_was_taken_again_is_put_back(tmp_path):
    """The backup named its run by pid only: another process with that pid (after a reboot,
    or a container sharing $HOME) kept a killed run's hooks in the file for good."""
    path = tmp_path / "hooks.json"
    path.write_text('{"version": 1}\n')
    assert _settings.edit_for_run(str(path), lambda s, how: '{"ours": true}\n')
    bak = str(path) + _settings.BACKUP_SUFFIX
    raw = open(bak, "rb").read()
    head, _, original = raw.partition(b"\n")
    meta = json.loads(head)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        meta["pid"] = other.pid  # alive, but not the run that made the backup
        with open(bak, "wb") as f:
            f.write(json.dumps(meta).encode() + b"\n" + original)
        assert _settings.restore(str(path), dead_only=True)
    finally:
        other.kill()
        other.wait()
    assert path.read_text() == '{"version": 1}\n'


def test_a_run_of_claude_with_its_own_settings_flag_gets_one(tmp_path):
    """`overlayrec run -- claude --settings mine.json`: Claude Code was handed two --settings
    (it takes one).  Theirs, with our hooks merged in, takes its place."""
    from overlayrec.agents import claude_code
    mine = tmp_path / "mine.json"
    mine.write_text('{"model": "opus"}\n')
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    old = os.environ.get("HOME")
    os.environ["HOME"] = str(home)
    try:
        for argv in (["claude", "--settings", "mine.json", "-p", "hi"],
                     ["claude", "--settings=mine.json", "-p", "hi"]):
            out, _, _, note = claude_code.wire_run(
                argv, {}, str(scratch), lambda ev: agents.hook_command("claude-code", ev),
                str(tmp_path))
            given = [a for a in out if a.startswith("--settings")]
            assert len(given) == 1, out
            value = out[out.index("--settings") + 1] if "--settings" in out else \
                given[0].split("=", 1)[1]
            s = json.loads(open(value).read())
            assert s["model"] == "opus" and _settings.holds_ours(value, "claude-code")
            assert out[-2:] == ["-p", "hi"]
        assert mine.read_text() == '{"model": "opus"}\n'
    finally:
        if old is None:
            del os.environ["HOME"]
        else:
            os.environ["HOME"] = old


def test_an_install_during_a_run_that_made_the_file_stays(tmp_path):
    """No hooks.json before a Cursor run; the user's `install-hooks cursor --user` during it:
    the run's end removed the file it had made, the user's install with it."""
    path = tmp_path / "hooks.json"
    assert _settings.edit_for_run(str(path), lambda s, how: '{"version": 1, "ours": 1}\n')
    agents.install("cursor", str(path))
    assert _settings.restore(str(path))
    assert _settings.holds_ours(str(path), "cursor")
    assert "ours" not in json.loads(path.read_text())  # the run's own entries went


def test_a_fifo_beside_the_settings_does_not_hang_a_run(tmp_path):
    """A fifo at .claude/settings.local.json: `run -- claude` looked for our hooks in it and
    hung for good (SIGTERM did not stop it)."""
    os.mkfifo(tmp_path / "settings.local.json")
    assert not _settings.holds_ours(str(tmp_path / "settings.local.json"), "claude-code")


@pytest.mark.skipif(os.geteuid() != 0, reason="root's install only")
def test_root_does_not_write_through_another_users_link(tmp_path):
    """A user's project links .claude/settings.json to a root-only file: root's install-hooks
    wrote its hooks into that file."""
    secret = tmp_path / "rootonly.json"
    secret.write_text('{"a": 1}\n')
    os.chmod(secret, 0o600)
    project, path = _project(tmp_path)
    os.symlink(secret, path)
    os.lchown(path, 65534, 65534)
    r = overlayrec("install-hooks", "claude-code", "--project", str(project), check=False)
    assert r.returncode == 1 and "root does not write through it" in r.stderr, r.stderr
    assert secret.read_text() == '{"a": 1}\n'


def test_a_settings_file_in_a_directory_it_may_not_write_is_written_in_place(tmp_path):
    """A writable settings.json in a read-only .claude/: the install failed on its temp file's
    name (the old in-place write had worked)."""
    _, path = _project(tmp_path, text='{"model": "opus"}\n')
    os.chmod(path, 0o666)
    d = os.path.dirname(path)
    os.chmod(d, 0o555)
    try:
        if os.access(d, os.W_OK):  # root: a 0555 directory is writable still
            real_mkstemp = _settings.tempfile.mkstemp

            def refused(*a, **k):
                raise PermissionError(13, "Permission denied", d)
            _settings.tempfile.mkstemp = refused
        try:
            agents.install("claude-code", path)
        finally:
            if os.access(d, os.W_OK):
                _settings.tempfile.mkstemp = real_mkstemp
        assert _settings.holds_ours(path, "claude-code")
        assert json.loads(open(path).read())["model"] == "opus"
    finally:
        os.chmod(d, 0o755)
