"""No traceback, ever, from bad input.

A property-based test runs every command of the click group (the list is taken from the group,
so a new command is fuzzed as soon as it exists) with arguments and values generated from its
own parameters, against three worlds: a workspace with a small journal recorded once through a
real mount and a scripted session (unmounted again: no daemon runs while fuzzing), a copy of it
whose journal holds one event that is not JSON, and a workspace that does not exist.  Each run
exits 0, 1 or 2, never shows a traceback, and when it fails (1) or is misused (2) says so in
exactly one line on stderr: ``overlayrec: error: ...`` or ``overlayrec: usage: ...``.

The fuzz runs the commands in this process (click's CliRunner), which is what makes thousands
of runs fit in a minute or two; the errors first reported, and the corrupt event, are also run
through the real entry point in a subprocess.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import click
import lmdb
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import HAVE_FUSE, Mount, SLOW, overlayrec, force_unmount
from overlayrec import cli
from overlayrec.journal import schema

# examples per command and world (OVERLAYREC_FUZZ_EXAMPLES raises it for a longer hunt)
EXAMPLES = int(os.environ.get("OVERLAYREC_FUZZ_EXAMPLES", "25"))

# commands never run here, and why
NOT_RUN = {
    ("mount",): "mounts (its values are checked by click types, see test_reported_tracebacks)",
    ("run",): "mounts and runs a command",
    ("hook", "claude-code"): "the agent's hook: reads JSON on stdin and exits 0 whatever happens",
}
# commands run for their argument checks only, and how they are kept from blocking or mounting:
# call/turn/session begin/end find no daemon (OVERLAYREC_SOCKET names no socket); revert and
# unrevert would mount to plan, which the fuzz refuses (cli._spawn_daemon fails); install-hooks
# writes only below the world's directory (never --user alone); umount meets no live mount.

SESSION, CALLS = "fz", ("c1", "c2")

SCRIPT = r"""
ovr() { "$PY" -m overlayrec "$@"; }
ovr turn begin --prompt 'fix the greeting'
ovr call begin --id c1 --tool Bash --summary 'edit, make, remove, rename'
sed -i s/hello/HELLO/ a.txt
printf 'new\n' > b.txt
mkdir -p sub && echo x > sub/f
rm gone.txt
mv old.txt new.txt
ovr call end --id c1
ovr call begin --id c2 --tool Edit
echo more >> a.txt
ovr call end --id c2 --status error
ovr turn end
ovr turn begin --prompt 'second'
echo later >> a.txt
ovr turn end
"""


def leaf_commands(group: click.Group, path: tuple = ()):
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            yield from leaf_commands(cmd, path + (name,))
        else:
            yield path + (name,), cmd


COMMANDS = dict(leaf_commands(cli.main))
FUZZED = sorted(p for p in COMMANDS if p not in NOT_RUN)


def test_exclusions_name_real_commands():
    assert set(NOT_RUN) <= set(COMMANDS), "a command in NOT_RUN is gone: take it out"
    assert len(FUZZED) >= 15


class World:
    """Where one kind of fuzz runs: its workspace, state dir and a directory for what the
    commands write."""

    def __init__(self, base: str, ws: str, sd: str | None):
        self.base, self.ws, self.sd = base, ws, sd
        self.out = os.path.join(base, "out")
        os.makedirs(self.out, exist_ok=True)
        self.n = 0

    def fresh(self, suffix="") -> str:
        self.n += 1
        return os.path.join(self.out, f"{self.n}{suffix}")


@pytest.fixture(scope="module")
def worlds():
    """(a) a recorded workspace, (b) a copy whose journal holds a corrupt event, (c) a missing
    workspace; the registry that finds a workspace's state dir lives in this module's own
    XDG_STATE_HOME."""
    base = tempfile.mkdtemp(prefix="overlayrec-fuzz-", dir="/var/tmp")
    os.chmod(base, 0o755)
    saved = {k: os.environ.get(k) for k in ("XDG_STATE_HOME",)}
    os.environ["XDG_STATE_HOME"] = os.path.join(base, "xdg")
    try:
        out = {"missing": World(os.path.join(base, "c"), os.path.join(base, "c", "nowhere"),
                                None)}
        if HAVE_FUSE:
            out.update(_record(base))
        yield out
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(base, ignore_errors=True)


def _record(base: str) -> dict:
    m = Mount(os.path.join(base, "a"))
    for name, text in (("a.txt", "hello\n"), ("gone.txt", "bye\n"), ("old.txt", "old\n")):
        with open(os.path.join(m.ws, name), "w") as f:
            f.write(text)
    env = dict(os.environ, PY=sys.executable)
    env.pop("OVERLAYREC_SOCKET", None)
    env.pop("OVERLAYREC_SESSION", None)
    m.env = env
    try:
        m.mount()
        m.sh("echo by-hand > notes.txt")  # an outside writer
        overlayrec("run", "-w", m.ws, "--session", SESSION, "--", "bash", "-ec", SCRIPT,
                   cwd=m.ws, env=env)
    finally:
        m.umount()
        force_unmount(m.ws)
    # (b): the same workspace and journal, one event's value overwritten by invalid JSON
    j = m.journal()
    try:
        evs = list(j.events())
    finally:
        j.close()
    writes = [e["seq"] for e in evs if e["op"] == "write"]
    bad = writes[len(writes) // 2] if writes else evs[len(evs) // 2]["seq"]
    cbase = os.path.join(base, "b")
    cws, csd = os.path.join(cbase, "ws"), os.path.join(cbase, "state")
    shutil.copytree(m.ws, cws, symlinks=True)
    copy_state(m.state, csd)
    corrupt_event(csd, bad, b'{"seq": %d, "op": "write", "pa' % bad)
    from overlayrec import state
    state.write_registry(cws, csd)
    a = World(m.base, m.ws, m.state)
    b = World(cbase, cws, csd)
    b.bad = bad
    a.events = b.events = evs
    return {"recorded": a, "corrupt": b}


def copy_state(src: str, dst: str) -> None:
    """A state dir's copy; its journal copied by LMDB (the file is mostly a sparse map)."""
    shutil.copytree(src, dst, symlinks=True,
                    ignore=shutil.ignore_patterns("journal", "control.sock", "daemon.json"))
    os.makedirs(os.path.join(dst, "journal"))
    env = lmdb.open(os.path.join(src, "journal"), readonly=True, lock=False,
                    max_dbs=len(schema.DBS) + 1, subdir=True)
    try:
        env.copy(os.path.join(dst, "journal"), compact=True)
    finally:
        env.close()


def corrupt_event(sd: str, seq: int, value: bytes) -> None:
    env = lmdb.open(os.path.join(sd, "journal"), max_dbs=len(schema.DBS) + 1, subdir=True)
    try:
        db = env.open_db(b"events", create=False)
        with env.begin(write=True, db=db) as txn:
            assert txn.get(schema.seq_key(seq)) is not None
            txn.put(schema.seq_key(seq), value)
    finally:
        env.close()


# -- values -----------------------------------------------------------------------------------

INTS = st.one_of(st.integers(-5, 60), st.sampled_from(
    [0, -1, 2**31, 2**63 - 1, 2**63, 2**64, -2**64, 10**30, 10**4400]))
FLOATS = st.one_of(st.floats(), st.sampled_from(
    [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, -1.0, 1e308, 5e-324]))
ODD = ["@inf", "@-inf", "@nan", "@1e400", "@-1e300", "@1e20", "@", "@x", "turn:x", "turn:",
       "turn:-1", "turn:last", "turn:0", "turn:99999999999999999999999", "turn:1.5", "call:",
       "call:c1", "call:nope", "before:", "after:", "before:0", "after:0", "before:turn:1",
       "after:call:c1", "before:before:1", "0", "1", "3", "-1", "-5", "1e3", "0x10", "+5",
       "99999999999999999999999", "18446744073709551616", "9223372036854775807", "²", "٣",
       "2024-01-01", "0001-01-01", "0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59",
       "1970-01-01T00:00:00Z", "last", "-0", "inf", "nan", "../..", "..", ".", "/", "",
       " ", "*", "[", "[!", "**/", "\\", "é", "日本語", "\u202e", "a\nb", "\r", "\u2028", "-",
       "--", "--help", "x" * 5000, "9" * 5000, "/" * 300, "a/" * 2100, "refs/",
       "refs/overlayrec/../x", "refs/a b", "toolu_nope", "fz", "c1", "c2", "claude-code"]
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
               max_size=30)  # argv holds no NUL, and no lone surrogate in a str from the shell
STRINGS = st.one_of(st.sampled_from(ODD), TEXT, INTS.map(str), FLOATS.map(str))


def path_values(w: World):
    inside = [w.ws, w.ws + "/", w.ws + "/a.txt", w.ws + "/sub", w.ws + "/nope", w.ws + "/../..",
              "a.txt", "sub/f", "gone.txt", "new.txt", "old.txt", "notes.txt", "sub", "nope",
              ".overlayrec-attic", ".git/HEAD"]
    outside = ["/", "/nonexistent/x", "/proc", w.base, w.base + "/nowhere", "../..", "..",
               "~", "-", ""]
    return st.one_of(st.sampled_from(inside + outside), STRINGS)


def write_target(w: World, suffix=""):
    """Where a command may write: fresh names in the world's own directory, or something that
    already exists there (and junk relative to it: the fuzz runs in the world's directory)."""
    return st.one_of(st.builds(lambda: w.fresh(suffix)),
                     st.sampled_from([w.out, w.base, w.ws, w.ws + "/a.txt", "", ".", "..",
                                      "../..", "/", w.base + "/x" * 2000]),
                     TEXT.filter(lambda s: s and not s.startswith(("/", "~"))
                                 and ".." not in s))


def value_for(w: World, param: click.Parameter):
    name, typ = param.name, param.type
    if name == "workspace":
        return st.one_of(st.just(w.ws), st.just(w.ws), path_values(w))
    if name == "state_dir":
        dirs = [d for d in (w.sd, w.base, w.base + "/nowhere", w.ws, "/") if d]
        return st.one_of(st.sampled_from(dirs), STRINGS)
    if name == "dest":
        return write_target(w)
    if name == "out":
        return write_target(w, ".html")
    if name == "project":
        return st.builds(lambda: w.fresh())
    if name == "repo":
        return st.one_of(st.builds(lambda: w.fresh()), st.sampled_from([w.ws, w.out, ""]))
    if name == "path":
        return path_values(w)
    if name in ("call_id", "sid", "name", "session", "revert_id", "actor"):
        return st.one_of(st.sampled_from([SESSION, *CALLS, "nope", "", "x" * 600]), STRINGS)
    if isinstance(typ, click.Choice):
        return st.one_of(st.sampled_from(list(typ.choices)), STRINGS)
    if isinstance(typ, (click.types.IntParamType, click.IntRange, cli._Seq, cli._Turn)):
        return st.one_of(INTS.map(str), STRINGS)
    if isinstance(typ, (click.types.FloatParamType, click.FloatRange, cli._Seconds)):
        return st.one_of(FLOATS.map(str), STRINGS)
    return st.one_of(path_values(w), STRINGS)


@st.composite
def command_line(draw, w: World, path: tuple, cmd: click.Command):
    chunks = []  # each option with its value, in an order drawn too
    positional = []
    for p in cmd.params:
        if isinstance(p, click.Argument):
            if p.nargs != 1:
                continue  # (run's CMD...: not fuzzed)
            if p.required or draw(st.booleans()):
                positional.append(draw(value_for(w, p)))
            continue
        if not isinstance(p, click.Option):
            continue
        opt = draw(st.sampled_from(p.opts))
        if p.is_flag:
            if p.name != "help" and draw(st.integers(0, 2)) == 0:
                chunks.append([opt])
            continue
        times = draw(st.integers(0, 2)) if p.multiple else \
            (1 if p.required else draw(st.integers(0, 2)) % 2)
        if p.required and not draw(st.integers(0, 9)):
            times = 0  # a required option left out, now and then
        for _ in range(times):
            chunks.append([opt, draw(value_for(w, p))])
    if path == ("install-hooks",) and ["--user"] in chunks and \
            not any(c[0] == "--project" for c in chunks):
        chunks.remove(["--user"])  # would write the user's own settings
    chunks = draw(st.permutations(chunks))
    extra = draw(st.sampled_from([[], [], [], ["--bogus"], ["extra-arg"], ["-x", "1"]]))
    sep = ["--"] if positional and draw(st.booleans()) else []
    return list(path) + [x for c in chunks for x in c] + extra + sep + positional


# -- running ----------------------------------------------------------------------------------

def run_cli(w: World, argv: list[str]):
    """One command line in this process, in the world's directory; (exit code, stderr)."""
    here = os.getcwd()
    pipe = signal.getsignal(signal.SIGPIPE)
    os.chdir(w.base)
    try:
        r = CliRunner().invoke(cli.main, argv, prog_name="overlayrec", catch_exceptions=True,
                               env={"OVERLAYREC_SOCKET": os.path.join(w.base, "no.sock"),
                                    "OVERLAYREC_SESSION": None, "OVERLAYREC_DEBUG": None})
    finally:
        os.chdir(here)
        signal.signal(signal.SIGPIPE, pipe)  # the group's callback sets it for the CLI
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        import traceback
        raise AssertionError(f"overlayrec {argv!r:.300} raised:\n" + "".join(
            traceback.format_exception(*r.exc_info)))
    return r.exit_code, r.stderr


def check_outcome(argv, code, err):
    what = f"overlayrec {argv!r:.400} -> {code}:\n{err[:2000]}"
    assert code in (0, 1, 2), what
    assert "Traceback" not in err, what
    if code:
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(("overlayrec: error: ",
                                                        "overlayrec: usage: ")), what
        assert lines[0].startswith("overlayrec: usage: ") == (code == 2), what


@pytest.fixture
def no_mounting(monkeypatch):
    def refuse(ws, sd, **kw):
        raise cli.Fail("the fuzz does not mount")
    monkeypatch.setattr(cli, "_spawn_daemon", refuse)


@pytest.mark.parametrize("world", ["recorded", "corrupt", "missing"])
@pytest.mark.parametrize("path", FUZZED, ids=" ".join)
def test_every_command_fails_in_one_line(worlds, world, path, no_mounting):
    if world not in worlds:
        pytest.skip("needs /dev/fuse to record the journal")
    w = worlds[world]
    cmd = COMMANDS[path]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(command_line(w, path, cmd))
    def fuzz(argv):
        check_outcome(argv, *run_cli(w, argv))
    fuzz()


def test_the_group_itself(worlds):
    w = worlds["missing"]
    skip = ("call", "turn", "session", "hook", "export", "run", "mount", "install-hooks",
            "umount", "revert", "unrevert", "--help", "-h")

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(st.one_of(st.sampled_from(["--bogus", "-x", "nope", "LOG", "--version",
                                               "log", "show", "begin"]), STRINGS),
                    min_size=1, max_size=3))
    def fuzz(argv):
        if argv[0] in skip:
            return  # fuzzed above, not run, or help (a group without its command shows it)
        check_outcome(argv, *run_cli(w, argv))
    fuzz()


# -- the reported cases, through the real entry point ---------------------------------------

def one_line(r, code, *needles):
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("overlayrec: usage: " if code == 2 else "overlayrec: error: ")
    for n in needles:
        assert n in lines[0], lines[0]


def _env(w: World) -> dict:
    env = dict(os.environ)
    for k in ("OVERLAYREC_SOCKET", "OVERLAYREC_SESSION", "OVERLAYREC_DEBUG"):
        env.pop(k, None)
    return env


def test_reported_tracebacks(worlds):
    if "recorded" not in worlds:
        pytest.skip("needs /dev/fuse to record the journal")
    w, c = worlds["recorded"], worlds["corrupt"]
    env = _env(w)
    sd = ["--state-dir", w.sd]

    def run(*args, **kw):
        return overlayrec(*args, check=False, env=env, cwd=w.base, **kw)

    one_line(run("replay", w.ws, *sd, "--at", "@inf", "--to", w.fresh()), 1, "not a time")
    one_line(run("replay", w.ws, *sd, "--at", "@nan", "--to", w.fresh()), 1, "not a time")
    one_line(run("revert", w.ws, *sd, "--since", "-5"), 2, "--since", "not a sequence number")
    one_line(run("diff", w.ws, *sd, "--since", "-5"), 2, "--since", "not a sequence number")
    one_line(run("log", w.ws, *sd, "--limit", "0"), 2, "--limit")
    one_line(run("log", w.ws, *sd, "--since", "turn:x"), 1, "not a turn")
    one_line(run("show", "--", "-5", "-w", w.ws, *sd), 2, "not a sequence number")
    one_line(run("mount", w.ws, "--timeout", "nan"), 2, "--timeout")
    one_line(run("nosuchcommand"), 2, "No such command")
    # the corrupt event: named by every command that meets it
    bad = str(c.bad)
    csd = ["--state-dir", c.sd]
    for args in (["show", bad, "-w", c.ws, *csd], ["log", c.ws, *csd],
                 ["diff", c.ws, *csd, "--since", "0"], ["turns", c.ws, *csd],
                 ["replay", c.ws, *csd, "--at", "@1e12", "--to", c.fresh()]):
        one_line(run(*args), 1, f"journal in {c.sd} is corrupt: event {bad} is not valid JSON")
    # --help stays click's own
    h = run("log", "--help")
    assert h.returncode == 0 and h.stdout.startswith("Usage: overlayrec log") and not h.stderr


def test_an_event_without_its_fields_is_corrupt_too(worlds, tmp_path):
    if "recorded" not in worlds:
        pytest.skip("needs /dev/fuse to record the journal")
    w = worlds["recorded"]
    ev = dict(next(e for e in w.events if e["op"] == "write"))
    for i, broken in enumerate(({k: v for k, v in ev.items() if k != "op"}, [1, 2],
                                dict(ev, path=7), dict(ev, seq=ev["seq"] + 1000))):
        sd = str(tmp_path / f"s{i}")
        copy_state(w.sd, sd)
        corrupt_event(sd, ev["seq"], json.dumps(broken).encode())
        for args in (["log", w.ws], ["show", str(ev["seq"]), "-w", w.ws],
                     ["calls", w.ws], ["blame", "a.txt", "-w", w.ws]):
            r = overlayrec(*args, "--state-dir", sd, check=False, env=_env(w), cwd=w.base)
            one_line(r, 1, f"is corrupt: event {ev['seq']} ")


def test_an_unexpected_exception_is_one_line_and_debug_shows_it(worlds, monkeypatch):
    w = worlds["missing"]

    def boom(*a, **kw):
        raise RuntimeError("boom")
    monkeypatch.setattr(cli.state, "resolve_workspace", boom)
    code, err = run_cli(w, ["log", w.ws])
    assert code == 1 and err.splitlines() == [
        "overlayrec: error: internal error: RuntimeError: boom (a bug: please report it, with "
        "the traceback that OVERLAYREC_DEBUG=1 prints)"]
    monkeypatch.setenv("OVERLAYREC_DEBUG", "1")
    here = os.getcwd()
    try:
        r = CliRunner().invoke(cli.main, ["log", w.ws], prog_name="overlayrec")
    finally:
        os.chdir(here)
    assert r.exit_code == 1 and "Traceback" in r.stderr and "RuntimeError: boom" in r.stderr
    assert r.stderr.splitlines()[-1].startswith("overlayrec: error: internal error:")
