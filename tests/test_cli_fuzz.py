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
from overlayrec.journal import Journal, schema

# examples per command and world: OVERLAYREC_FUZZ_EXAMPLES raises it for a longer hunt, and
# OVERLAYREC_FUZZ_RANDOM=1 draws new ones each run (by default every run draws the same ones)
EXAMPLES = int(os.environ.get("OVERLAYREC_FUZZ_EXAMPLES", "100"))
FIXED = not os.environ.get("OVERLAYREC_FUZZ_RANDOM")

# commands never run here, and why
NOT_RUN = {
    ("mount",): "mounts (its values are checked by click types, see test_reported_tracebacks)",
    ("run",): "mounts and runs a command",
    ("hook", "claude-code"): "the agent's hook: reads JSON on stdin and exits 0 whatever happens",
}
# options never given, and why
NOT_GIVEN = {("log", "follow"): "waits for new events until interrupted, by design",
             ("revert", "yes"): "would change the workspace", ("unrevert", "yes"): "the same",
             ("gc", "dry_run"): "always given (command_line): a gc would drop from the worlds "
             "what the tests after it read"}
# commands run for their argument checks only, and how they are kept from blocking or mounting:
# call/turn/session begin/end find no daemon (OVERLAYREC_SOCKET names no socket); revert and
# unrevert, which mount to plan, plan on the unmounted workspace instead (cli._spawn_daemon does
# nothing) and only preview (no --yes); install-hooks writes only below the world's directory
# (never --user alone); umount meets no live mount.

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
    """Where one kind of fuzz runs: its workspace and state dir in ``base``, the commands run
    in ``here`` (an empty directory in it), and what they write goes to ``out``, outside
    ``base``: no workspace a command is given holds what an earlier one wrote."""

    def __init__(self, base: str, ws: str, sd: str | None, out: str):
        self.base, self.ws, self.sd, self.out = base, ws, sd, out
        self.here = os.path.join(base, "here")
        os.makedirs(self.out, exist_ok=True)
        os.makedirs(self.here, exist_ok=True)
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
                                None, os.path.join(base, "out", "c"))}
        out["missing"].events = []
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
    copy_state(m.state, csd, workspace=cws)
    corrupt_event(csd, bad, b'{"seq": %d, "op": "write", "pa' % bad)
    from overlayrec import state
    state.write_registry(cws, csd)
    a = World(m.base, m.ws, m.state, os.path.join(base, "out", "a"))
    b = World(cbase, cws, csd, os.path.join(base, "out", "b"))
    b.bad = bad
    a.events = b.events = evs
    return {"recorded": a, "corrupt": b}


def copy_state(src: str, dst: str, workspace: str | None = None) -> None:
    """A state dir's copy; its journal copied by LMDB (the file is mostly a sparse map).  Not
    the listings' kept rows: they were made from the intact journal, and a listing that finds
    them reads only the events since (it never meets an event a test corrupts).  With
    ``workspace``: the copy records that one (every command refuses a state dir that records
    another workspace)."""
    shutil.copytree(src, dst, symlinks=True,
                    ignore=shutil.ignore_patterns("journal", "control.sock", "daemon.json",
                                                  "listings"))
    os.makedirs(os.path.join(dst, "journal"))
    env = lmdb.open(os.path.join(src, "journal"), readonly=True, lock=False,
                    max_dbs=len(schema.DBS) + 1, subdir=True)
    try:
        env.copy(os.path.join(dst, "journal"), compact=True)
    finally:
        env.close()
    if workspace is not None:
        j = Journal(dst)
        try:
            j.put_meta("workspace", workspace)
        finally:
            j.close()


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

INTS = st.one_of(st.integers(-9, -1), st.integers(0, 60), st.sampled_from(
    [0, -1, 2**31, 2**63 - 1, 2**63, 2**64, -2**64, 10**30])).map(str) | \
    st.just("1" + "0" * 4400)  # past what int() reads
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
       "refs/overlayrec/../x", "refs/a b", "toolu_nope", "fz", "c1", "c2", "claude-code",
       "\udcff", "a\udce9.txt", "refs/\udcff"]
# argv holds no NUL; bytes that are not UTF-8 reach Python as surrogates (U+DC80..U+DCFF)
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00") |
               st.sampled_from([chr(c) for c in range(0xDC80, 0xDD00)]), max_size=30)
STRINGS = st.one_of(st.sampled_from(ODD), TEXT, INTS, FLOATS.map(str))


def junk_paths(w: World):
    return st.sampled_from([
        w.ws + "/", w.ws + "/a.txt", w.ws + "/sub", w.ws + "/nope", w.ws + "/../..", "/",
        "/nonexistent/x", "/proc", w.base, w.base + "/nowhere", "../..", "..", ".", "~", "-",
        "", ".overlayrec-attic", ".git/HEAD", "sub/../../x"])


def write_target(w: World, suffix=""):
    """Where a command may write: fresh names in the world's output directory, something that
    already exists, a name beneath 200 new directories, odd text as a name there."""
    return st.one_of(st.builds(lambda: w.fresh(suffix)), st.builds(lambda: w.fresh(suffix)),
                     st.sampled_from([w.out, w.base, w.ws, w.ws + "/a.txt", "", ".", "..",
                                      "../..", "/"]),
                     st.builds(lambda: w.fresh() + "/x" * 200),
                     TEXT.map(lambda s: os.path.join(w.fresh(), s.replace("/", "_"))))


def plausible(w: World, param: click.Parameter):
    """A value the command could well take, for the world at hand (None: no such thing)."""
    name, typ = param.name, param.type
    n = len(w.events)
    seqs = st.integers(0, n + 2).map(str)
    times = [e["t"] for e in w.events] or [0]
    points = st.one_of(
        seqs, st.sampled_from(["turn:1", "turn:2", "turn:last", "turn:-1", "before:turn:2",
                               "call:c1", "after:call:c2", "before:call:c1", "before:3",
                               "2000-01-01T00:00:00", "@1"]),
        st.sampled_from(times).map(lambda t: f"@{t / 1e9}"))
    by_name = {
        "workspace": st.just(w.ws), "workspace_opt": st.just(w.ws),
        "state_dir": st.sampled_from([w.sd or w.base + "/nowhere"]),
        "dest": write_target(w), "out": write_target(w, ".html"), "into": write_target(w),
        "project": st.builds(lambda: w.fresh()),
        "repo": st.one_of(st.builds(lambda: w.fresh()), st.sampled_from([w.ws, w.out])),
        "path": st.sampled_from(["a.txt", "gone.txt", "new.txt", "old.txt", "sub/f", "sub",
                                 "notes.txt", "b.txt", w.ws + "/a.txt"]),
        "glob": st.sampled_from(["*", "*.txt", "sub/*", "a.txt", "[ab].txt", "nothing"]),
        "at": points, "since": points if typ == click.STRING else seqs,
        "until": points if typ == click.STRING else seqs,
        "call_id": st.sampled_from([*CALLS, "c3"]), "sid": st.just(SESSION),
        "session": st.just(SESSION), "name": st.sampled_from([SESSION, "new"]),
        "turn_sel": st.sampled_from(["1", "2", "last", "-1", "-2", "3"]),
        "turn_index": st.sampled_from(["1", "2", "3"]),
        "ops": st.sampled_from(["write", "create", "unlink", "seal", "rename", "turn_begin"]),
        "actor": st.sampled_from(["sed", "bash", "1", "overlayrec"]),
        "limit": st.sampled_from(["1", "3", "100"]), "seq": st.integers(1, n + 2).map(str),
        "ref_prefix": st.sampled_from(["refs/fz", "refs/overlayrec"]),
        "revert_id": st.just("nope"), "timeout": st.sampled_from(["0", "1.5"]),
    }
    if name in by_name:
        return by_name[name]
    if isinstance(typ, click.Choice):
        return st.sampled_from(list(typ.choices))
    return TEXT


def junk(w: World, param: click.Parameter):
    """Anything: the odd values, text, numbers of every size, paths inside and out."""
    name, typ = param.name, param.type
    if name in ("dest", "out", "into"):  # where a command writes: never outside the world
        return write_target(w)
    if name in ("project", "repo"):
        return st.builds(lambda: w.fresh()) | st.sampled_from(["", w.ws, w.ws + "/a.txt"])
    if isinstance(typ, (click.types.FloatParamType, click.FloatRange, cli._Seconds)):
        return FLOATS.map(str) | STRINGS
    if isinstance(typ, (click.types.IntParamType, cli._Seq, cli._Turn)) or \
            name in ("at", "since", "until"):
        return INTS | STRINGS
    return st.one_of(STRINGS, junk_paths(w))


@st.composite
def command_line(draw, w: World, path: tuple, cmd: click.Command):
    """The command's path, some of its options (each with a value), its arguments.  Either every
    value is plausible but one (the likeliest: it gets the furthest), or none is odd, or any
    may be, with now and then something the command does not take."""
    mode = draw(st.sampled_from(["one odd", "none odd", "wild"]))
    options = [p for p in cmd.params if isinstance(p, click.Option) and p.name != "help"
               and (path[-1], p.name) not in NOT_GIVEN]
    chosen = draw(st.lists(st.sampled_from(options), max_size=4, unique_by=id)) if options else []
    for p in options:  # (for hypothesis, 0 is the simplest draw: the likeliest)
        if p.required and p not in chosen and draw(st.integers(0, 9)) != 9:
            chosen.append(p)  # a required option, but now and then left out
        elif p.name == "workspace" and p not in chosen and draw(st.integers(0, 3)) != 3:
            chosen.append(p)  # the workspace, as for commands that take it as an argument
    arguments = [p for p in cmd.params if isinstance(p, click.Argument) and p.nargs == 1
                 and (p.required or draw(st.integers(0, 3)) != 3)]  # (run's CMD...: not fuzzed)
    valued = [p for p in chosen + arguments if not getattr(p, "is_flag", False)]
    odd = draw(st.sampled_from(valued)) if valued and mode == "one odd" else None

    def value(p):
        if p is odd or (mode == "wild" and draw(st.booleans())):
            return draw(junk(w, p))
        return draw(plausible(w, p))
    chunks = []
    for p in chosen:
        opt = draw(st.sampled_from(p.opts))
        if p.is_flag:
            chunks.append([opt])
            continue
        for _ in range(draw(st.integers(1, 2)) if p.multiple else 1):
            chunks.append([opt, value(p)])
    if path == ("install-hooks",) and ["--user"] in chunks and \
            not any(c[0] == "--project" for c in chunks):
        chunks.remove(["--user"])  # would write the user's own settings
    positional = [value(p) for p in arguments]
    if path == ("replay",) and ["--full"] in chunks:  # copies the whole workspace: the world's
        positional = [w.ws if p.name == "workspace" else v for p, v in zip(arguments, positional)]
        chunks = [c for c in chunks if c[0] not in ("-w", "--workspace")]
    if path == ("gc",):
        chunks.append(["--dry-run"])
    chunks = draw(st.permutations(chunks))
    extra = draw(st.sampled_from([[], ["--bogus"], ["extra-arg"], ["-x", "1"]])) \
        if mode == "wild" else []
    sep = ["--"] if positional and draw(st.booleans()) else []
    return list(path) + [x for c in chunks for x in c] + extra + sep + positional


# -- running ----------------------------------------------------------------------------------

def run_cli(w: World, argv: list[str], limit: float = 30.0):
    """One command line in this process, in the world's directory; (exit code, stderr).  A
    command still running after ``limit`` seconds is interrupted and fails the test."""
    import _thread
    import threading
    here = os.getcwd()
    pipe, term = signal.getsignal(signal.SIGPIPE), signal.getsignal(signal.SIGTERM)
    hung = []
    watchdog = threading.Timer(limit * SLOW, lambda: (hung.append(1), _thread.interrupt_main()))
    os.chdir(w.here)
    watchdog.start()
    try:
        r = CliRunner().invoke(cli.main, argv, prog_name="overlayrec", catch_exceptions=True,
                               env={"OVERLAYREC_SOCKET": os.path.join(w.base, "no.sock"),
                                    "OVERLAYREC_SESSION": None, "OVERLAYREC_DEBUG": None})
    finally:
        watchdog.cancel()
        os.chdir(here)
        signal.signal(signal.SIGPIPE, pipe)  # the group's callback sets them for the CLI
        signal.signal(signal.SIGTERM, term)
    assert not hung, f"overlayrec {argv!r:.300} still ran after {limit:g} s"
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        import traceback
        raise AssertionError(f"overlayrec {argv!r:.300} raised:\n" + "".join(
            traceback.format_exception(*r.exc_info)))
    return r.exit_code, r.stderr


def check_outcome(argv, code, err):
    what = f"overlayrec {argv!r:.400} -> {code}:\n{err[:2000]}"
    assert code in (0, 1, 2), what
    assert "Traceback" not in err, what
    assert "internal error" not in err, what  # an exception no command expected: a bug
    if code:
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(("overlayrec: error: ",
                                                        "overlayrec: usage: ")), what
        assert lines[0].startswith("overlayrec: usage: ") == (code == 2), what


@pytest.fixture
def no_mounting(monkeypatch):
    """revert and unrevert plan on the workspace as it is, unmounted (their preview reads it)."""
    monkeypatch.setattr(cli, "_spawn_daemon", lambda ws, sd, **kw: 0)
    monkeypatch.setattr(cli, "_stop_daemon", lambda ws: None)
    monkeypatch.setattr(cli, "_release_mount", lambda ws, sd: None)


@pytest.mark.parametrize("world", ["recorded", "corrupt", "missing"])
@pytest.mark.parametrize("path", FUZZED, ids=" ".join)
def test_every_command_fails_in_one_line(worlds, world, path, no_mounting):
    if world not in worlds:
        pytest.skip("needs /dev/fuse to record the journal")
    w = worlds[world]
    cmd = COMMANDS[path]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=FIXED, database=None,
              suppress_health_check=list(HealthCheck))
    @given(command_line(w, path, cmd))
    def fuzz(argv):
        check_outcome(argv, *run_cli(w, argv))
    fuzz()


def test_the_group_itself(worlds, no_mounting):
    w = worlds["missing"]
    skip = ("call", "turn", "session", "hook", "export", "run", "mount", "install-hooks",
            "umount", "revert", "unrevert", "--help", "-h")

    @settings(max_examples=60, deadline=None, derandomize=FIXED, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(st.one_of(st.sampled_from(["--bogus", "-x", "nope", "LOG", "--version",
                                               "log", "show", "begin"]), STRINGS),
                    min_size=1, max_size=3))
    def fuzz(argv):
        if any(a in skip for a in argv):
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
        return overlayrec(*args, check=False, env=env, cwd=w.here, **kw)

    one_line(run("replay", w.ws, *sd, "--at", "@inf", "--to", w.fresh()), 1, "not a time")
    one_line(run("replay", w.ws, *sd, "--at", "@nan", "--to", w.fresh()), 1, "not a time")
    one_line(run("revert", w.ws, *sd, "--since", "-5"), 2, "--since", "not a sequence number")
    one_line(run("diff", w.ws, *sd, "--since", "-5"), 2, "--since", "not a sequence number")
    one_line(run("log", w.ws, *sd, "--limit", "0"), 2, "--limit")
    one_line(run("log", w.ws, *sd, "--since", "turn:x"), 1, "not a turn")
    one_line(run("show", "--", "-5", "-w", w.ws, *sd), 2, "not a sequence number")
    one_line(run("mount", worlds["missing"].ws, "--timeout", "nan"), 2, "--timeout")
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
                     ["calls", w.ws], ["blame", ev["path"], "-w", w.ws]):
            r = overlayrec(*args, "--state-dir", sd, check=False, env=_env(w), cwd=w.here)
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


def test_replay_into_a_deep_new_path(worlds):
    if "recorded" not in worlds:
        pytest.skip("needs /dev/fuse to record the journal")
    w = worlds["recorded"]
    top = w.fresh()
    argv = ["replay", w.ws, "--at", "0", "--to", top + "/x" * 1500]
    try:
        code, err = run_cli(w, argv)
        check_outcome(argv, code, err)
        assert code == 0, err  # every missing parent is made
    finally:
        subprocess.run(["rm", "-rf", top], check=True)  # shutil.rmtree recurses per level


def test_full_replay_of_a_deep_tree(worlds):
    if "recorded" not in worlds:
        pytest.skip("needs /dev/fuse to record the journal")
    w = worlds["recorded"]
    deep = w.fresh()
    os.mkdir(deep)
    fd = os.open(deep, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1100):  # (not os.makedirs: it recurses as well)
            os.mkdir("d", dir_fd=fd)
            fd, old = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
            os.close(old)
    finally:
        os.close(fd)
    dest, sd = w.fresh(), w.fresh("-state")
    copy_state(w.sd, sd, workspace=deep)  # the record, of the deep tree as its workspace
    argv = ["replay", deep, "--state-dir", sd, "--at", "0", "--full", "--to", dest]
    try:
        code, err = run_cli(w, argv)
        check_outcome(argv, code, err)
        assert code == 0, err  # the whole deep tree is copied
    finally:
        subprocess.run(["rm", "-rf", deep, dest, sd], check=True)  # shutil.rmtree recurses too


def test_bytes_that_are_not_utf8_come_back_as_given(worlds):
    """Under a UTF-8 locale stdout is strict: a path given in other bytes is still printed (as
    those bytes), and an id that cannot be one is a usage error."""
    w = worlds["missing"]
    env = dict(_env(w), PYTHONIOENCODING="utf-8:strict")
    run = lambda *args: subprocess.run([sys.executable, "-m", "overlayrec", *args], env=env,
                                       cwd=w.here, capture_output=True, timeout=60 * SLOW)
    here = os.fsencode(w.here) + b"/ws\xff"  # a directory (a missing one is an error)
    os.makedirs(here, exist_ok=True)
    r = run("status", here)
    assert r.returncode == 0 and here + b": not mounted" in r.stdout, r
    r = run("turns", w.ws, "--session", b"\xff")
    assert r.returncode == 2 and r.stderr.startswith(b"overlayrec: usage: "), r
    assert r.stderr.count(b"\n") == 1 and b"not UTF-8" in r.stderr, r


def test_records_whose_text_fields_are_not_text_are_read_as_their_json(worlds, tmp_path):
    """A prompt (or a call's tool, summary, status) that was not a string was taken by the
    daemon once: from then on `turns`, `export git` and `report` failed on that record for
    good ("'dict' object has no attribute 'splitlines'").  A record written then is read with
    such a field as its JSON text."""
    if "recorded" not in worlds:
        pytest.skip("needs /dev/fuse to record the journal")
    w = worlds["recorded"]
    sd = str(tmp_path / "state")
    copy_state(w.sd, sd)
    j = Journal(sd)
    try:
        t = j.record("turns", schema.turn_key(SESSION, 1))
        j.put_record("turns", schema.turn_key(SESSION, 1), dict(t, prompt={"text": "fix it"}))
        c = j.record("calls", schema.call_key(SESSION, "c1"))
        j.put_record("calls", schema.call_key(SESSION, "c1"),
                     dict(c, tool={"name": "Bash"}, summary=5, status=["ok"]))
    finally:
        j.close()
    env, sdo = _env(w), ["--state-dir", sd]

    def run(*args):
        r = overlayrec(*args, check=False, env=env, cwd=w.here)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stderr)
        return r
    turns = [json.loads(line) for line in run("turns", w.ws, *sdo, "--json").stdout.splitlines()]
    assert [t["prompt"] for t in turns] == ['{"text":"fix it"}', "second"]
    assert '{"text":"fix it"}' in run("turns", w.ws, *sdo).stdout
    calls = {c["id"]: c for c in map(json.loads, run("calls", w.ws, *sdo, "--json")
                                     .stdout.splitlines())}
    assert (calls["c1"]["tool"], calls["c1"]["summary"], calls["c1"]["status"]) == \
        ('{"name":"Bash"}', "5", '["ok"]')
    run("calls", w.ws, *sdo)
    run("diff", w.ws, *sdo, "--turn", "1")
    run("export", "git", w.ws, *sdo)
    run("report", w.ws, *sdo, "--html", str(tmp_path / "report.html"))
    assert '"sub": "{\\"text\\":\\"fix it\\"}"' in (tmp_path / "report.html").read_text()
