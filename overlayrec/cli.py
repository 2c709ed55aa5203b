"""The command line: click commands, human and --json output, errors as one line and an exit code.

Exit codes: 0 success, 1 a failure the message explains, 2 bad usage: the command line cannot be
parsed, or a value is not of its option's form (a sequence number, a turn, a number of seconds).
Either way stderr holds one line, ``overlayrec: error: ...`` or ``overlayrec: usage: ...``; an
unexpected exception is one line too (OVERLAYREC_DEBUG=1 adds its traceback).
"""
from __future__ import annotations

import contextlib
import errno
import gc as cycle_gc  # ``gc`` is a command here
import json
import math
import os
import re
import signal
import sys
import time
import click

from . import readers, state
from .journal import Journal, JournalError
from .journal.schema import CONTROL_OPS, MARK_OPS
from .state import StateError

_one_line = readers.one_line

RENAME_EXCHANGE = 2  # renameat2's flag, as underlay has it (not imported for one number)


def _shown(value: str, limit: int = 60) -> str:
    """A value as given, quoted, cut to ``limit`` characters."""
    return repr(_cut(value, limit))


def _cut(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters, "..." saying where it was cut (a command line cut
    bare read as another: `unrevert ws --state-dir sd` as `unrevert ws --stat`)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


class Fail(click.ClickException):
    """A one-line error and exit 1."""

    def show(self, file=None):
        click.echo(f"overlayrec: error: {_one_line(self.format_message())}", err=True)


class Usage(click.UsageError):
    """Bad usage: one line (naming the command's --help) and exit 2."""

    def show(self, file=None):
        where = f" (see {self.ctx.command_path} --help)" if self.ctx else ""
        click.echo(f"overlayrec: usage: {_one_line(self.format_message())}{where}", err=True)


_os_error_text = readers.os_error_text


def _failure(e: Exception) -> click.ClickException:
    """The one line an exception a command let through comes out as."""
    import lmdb
    if isinstance(e, (StateError, JournalError, readers.Refusal)):
        return Fail(str(e))
    if isinstance(e, lmdb.Error):
        return Fail(f"the journal cannot be read: {e}")
    if isinstance(e, OSError):
        return Fail(_os_error_text(e))
    # (loaded when one is raised: a git object store that cannot be written, a read-only
    # state dir under `show`, said as every other command says it; found by a bug hunt)
    gitdiff = sys.modules.get("overlayrec.engines.gitdiff")
    if gitdiff is not None and isinstance(e, gitdiff.GitError):
        return Fail(str(e))
    if os.environ.get("OVERLAYREC_DEBUG", "") not in ("", "0"):
        import traceback
        traceback.print_exception(e)
    what = type(e).__name__ + (f": {e}" if str(e) else "")
    return Fail(f"internal error: {what} (a bug: please report it, with the traceback that "
                "OVERLAYREC_DEBUG=1 prints)")


def _without_cycle_gc(fn):
    """For a reader that builds its whole answer at once (``calls``, ``turns``, ``diff``):
    Python's cycle collector held off while it runs.  The answer is some hundred thousand
    dicts, lists and strings, none of them in a cycle, and each collection walks again all
    that survived the last ones (some 10 ms of ``calls`` on 10,000 rows)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        was = cycle_gc.isenabled()
        cycle_gc.disable()
        try:
            return fn(*a, **kw)
        finally:
            if was:
                cycle_gc.enable()
    return wrapper


def _workspace_param(default: str | None = ".", required: bool = False, type=None):
    """WORKSPACE as the command's argument, or as ``-w``/``--workspace``, which the commands
    whose argument is something else take (run, blame, show, unrevert): either, not both.
    Given as neither, ``default`` (``required``: a usage error)."""
    import functools

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*a, workspace_opt=None, **kw):
            if workspace_opt is not None:
                if kw.get("workspace") is not None:
                    raise Usage("the workspace is given twice: as WORKSPACE and as -w",
                                click.get_current_context())
                kw["workspace"] = workspace_opt
            elif kw.get("workspace") is None:
                if required:
                    raise Usage("Missing argument 'WORKSPACE' (or -w WORKSPACE): this command "
                                "does not take it from the current directory.",
                                click.get_current_context())
                kw["workspace"] = default
            return fn(*a, **kw)
        wrapper = click.option("-w", "--workspace", "workspace_opt", type=type,
                               metavar="WORKSPACE", help="The workspace, as WORKSPACE: either "
                               "one.")(wrapper)
        return click.argument("workspace", required=False, type=type)(wrapper)
    return deco


def _guard(fn):
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except (StateError, JournalError, readers.Refusal) as e:
            raise Fail(str(e)) from None
        except OSError as e:
            if e.errno == errno.EPIPE:
                raise  # click ends a closed pipe's output quietly
            if os.environ.get("OVERLAYREC_DEBUG"):
                import traceback
                traceback.print_exc()
            if isinstance(e, FileNotFoundError) and e.filename is None and _cwd_gone():
                # (it said "No such file or directory", naming nothing)
                raise Fail("the current directory was removed: name the workspace and the "
                           "paths absolutely (-w WORKSPACE)") from None
            raise Fail(_os_error_text(e)) from None
    return wrapper


def _cwd_gone() -> bool:
    try:
        os.getcwd()
    except FileNotFoundError:
        return True
    return False


class _Main(click.Group):
    """The group: click's usage errors as one line and exit 2 (--help as click makes it), and
    whatever a command lets through as one line and exit 1, never a traceback."""

    def main(self, args=None, prog_name=None, *a, **kw):
        # a path or name given in bytes that are not UTF-8 (Python holds them as surrogates)
        # is printed back as those bytes, as under the C locale, not refused by the encoder
        if getattr(sys.stdout, "errors", None) == "strict":
            try:
                sys.stdout.reconfigure(errors="surrogateescape")
            except (AttributeError, ValueError, OSError):
                pass
        return super().main(args, prog_name or "overlayrec", *a, **kw)

    @staticmethod
    def _usage(e: click.UsageError) -> click.UsageError:
        if isinstance(e, (Usage, getattr(click.exceptions, "NoArgsIsHelpError", Usage))):
            return e  # (a group without its command shows its help: click 8.2 and later)
        return Usage(e.format_message(), e.ctx)

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as e:
            raise self._usage(e) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            raise self._usage(e) from None
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort, EOFError):
            raise
        except KeyboardInterrupt as e:
            # Ctrl-C (or SIGTERM, SIGHUP: main) where the command itself says nothing: one
            # line and 128 + N, as a shell says a command ended by the signal (130 for Ctrl-C;
            # click said "Aborted!", exit 1)
            err = Fail("interrupted")
            err.exit_code = 128 + e.signum if isinstance(e, _Stopped) else 130
            raise err from None
        except OSError as e:
            if e.errno == errno.EPIPE:
                raise
            raise _failure(e) from None
        except Exception as e:
            raise _failure(e) from None


class _Seq(click.ParamType):
    """A sequence number: ASCII digits (no sign, no exponent), ``low`` or more."""
    name = "seq"

    def __init__(self, low: int):
        self.low = low

    def convert(self, value, param, ctx):
        s = str(value)
        if not re.fullmatch(r"[0-9]{1,19}", s) or not self.low <= int(s) < 2**63:
            self.fail(f"{_shown(s)} is not a sequence number ({self.low} or more)", param, ctx)
        return int(s)


class _Turn(click.ParamType):
    """A turn: its index N, last, or -1, -2 ... counting back from the last."""
    name = "turn"

    def convert(self, value, param, ctx):
        s = str(value)
        if not re.fullmatch(r"last|-?[0-9]{1,19}", s):
            from .views import shown
            self.fail(f"{_shown(s) if s.isprintable() else shown(s)} is not a turn "
                      "(N, last, or -1, -2 ...)", param, ctx)
        return s


class _Seconds(click.ParamType):
    """A number of seconds: finite, from 0 to a million (select() refuses far larger)."""
    name = "seconds"

    def convert(self, value, param, ctx):
        try:
            t = float(value)
        except (TypeError, ValueError):
            t = math.nan
        if not (math.isfinite(t) and 0 <= t <= 1e6):
            self.fail(f"{_shown(str(value))} is not a number of seconds (0 to 1000000)",
                      param, ctx)
        return t


class _Id(click.ParamType):
    """An id or a name as the journal keys it: not empty, and text (not bytes that are not
    UTF-8, which arrive as surrogates)."""
    name = "id"

    def convert(self, value, param, ctx):
        s = str(value)
        if not s:
            self.fail("an empty id", param, ctx)
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            self.fail(f"{_shown(s)} is not UTF-8 text", param, ctx)
        return s


class _NewPath(click.Path):
    """A path to be made: not empty (the empty path would be the current directory)."""

    def convert(self, value, param, ctx):
        if value == "":
            self.fail("an empty path", param, ctx)
        return super().convert(value, param, ctx)


class _Size(click.ParamType):
    """A number of bytes: 2G, 512M, 100K, 4096 (K = 1024)."""
    name = "size"

    def __init__(self, budget: bool = False):
        # a mount's budget: 0 (read as "no limit" by many tools) dropped every session as it
        # ended, the whole history, without a word (found by a bug hunt)
        self.budget = budget

    def convert(self, value, param, ctx):
        from .retention import parse_size
        if isinstance(value, int):
            size = value
        else:
            try:
                size = parse_size(str(value))
            except ValueError as e:
                self.fail(str(e), param, ctx)
        if self.budget and size <= 0:
            self.fail(f"{value!r}: a budget of 0 would drop every session as it ends (leave "
                      "--max-bytes out for no budget)", param, ctx)
        return size


class _Duration(click.ParamType):
    """A duration: 30d, 12h, 2w, 1d12h (s m h d w); in seconds."""
    name = "duration"

    def convert(self, value, param, ctx):
        from .retention import parse_duration
        try:
            return parse_duration(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


SEQ0, SEQ1, TURN, SECONDS, ID = _Seq(0), _Seq(1), _Turn(), _Seconds(), _Id()
# one for every path argument: each click.Path made looks up its name's translation (gettext)
PATH = click.Path()


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="overlayrec")
def main():
    """overlayrec records everything that happens to a workspace.

    A FUSE passthrough mounted over the workspace itself sees every write from every process,
    journals the pre-image of each change before it lands, and names the process that made it.
    """
    # a closed pipe (`overlayrec log | head`) ends output quietly, as for any Unix tool
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    # SIGTERM as Ctrl-C: what a command cleans up when interrupted (a replay's half-built
    # tree, an export's scratch files) goes then too (it was left behind; found by a hunt)
    # SIGHUP (a closed terminal or ssh session) the same: a replay left its half-built tree
    # beside --to (found by a bug hunt); `run` forwards it to the agent instead
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _terminated)
    cycle_gc.enable()  # held off while the CLI was imported (entry.main)


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP taken as Ctrl-C (main), with its signal: the exit status a shell
    gives a command ended by it (128 + N; it was 130, SIGINT's, found by a bug hunt)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _terminated(signum, frame):
    raise _Stopped(signum)


LOW_SPACE_FRACTION = 0.05  # the state dir's filesystem is low on space below 5% of its size
LOW_SPACE_BYTES = 100 << 20  # or below 100 MiB, whichever is less


def _warn_low_space(sd: str) -> None:
    """One line on stderr when the state dir's filesystem is nearly full: once it is full, every
    change through the mount fails with ENOSPC (nothing lands unrecorded) until space is freed."""
    path = sd
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except OSError:
        return
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if size <= 0 or free >= min(size * LOW_SPACE_FRACTION, LOW_SPACE_BYTES):
        return
    click.echo(f"overlayrec: warning: the state dir's filesystem has {_mib(free)} free of "
               f"{_mib(size)} ({sd}); when it is full, changes through the mount fail with "
               "ENOSPC until space is freed", err=True)


def _mib(n: int) -> str:
    # under a tenth of a MiB in KiB: a budget of 1K read "0.0 MiB", a gc's small change none
    if n < 100 << 10:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1 << 20):.1f} MiB" if n < 10 << 30 else f"{n / (1 << 30):.0f} GiB"


_state_dir_for = readers.state_dir_for  # the state dir a reading command looks at


def _daemon_pid(sd: str) -> tuple[int | None, dict | None, str | None]:
    """``mounting.daemon_pid``, saying on stderr why a live pid it names failed the check."""
    from .mounting import daemon_pid
    pid, info, why = daemon_pid(sd)
    if why:
        click.echo(f"overlayrec: warning: {why}", err=True)
    return pid, info, why


@main.command()
@_workspace_param(required=True, type=PATH)
@click.option("--state-dir", type=PATH,
              help="Where the journal lives (default: $XDG_STATE_HOME/overlayrec/<id>).")
@click.option("--foreground", is_flag=True, help="Serve in this process until unmounted.")
@click.option("--allow-other", is_flag=True,
              help="Let other users in (FUSE allow_other; permissions checked by the kernel).")
@click.option("--durable", is_flag=True,
              help="fsync every journal commit, so it also survives power loss.")
@click.option("--record-data", is_flag=True,
              help="Full fidelity: journal every write's data, so replay is exact at every event.")
@click.option("--secret", "secret", multiple=True, metavar="PATTERN",
              help="A path whose content is never kept (repeatable; added to the defaults: "
              ".env* .ssh/ .npmrc .pypirc .netrc .git-credentials *.pem *.key id_rsa id_dsa "
              "id_ecdsa id_ed25519 .aws/, and to the patterns earlier mounts added).")
@click.option("--no-default-secrets", is_flag=True,
              help="Only the --secret patterns, not the defaults.")
@click.option("--timeout", type=SECONDS, default=30.0, show_default=True,
              help="Seconds to wait for the mount.")
@click.option("--max-bytes", "max_bytes", type=_Size(budget=True), metavar="SIZE",
              help="Keep the record within SIZE (K/M/G): the daemon drops the oldest sessions "
              "itself (docs/retention.md).")
@_guard
def mount(workspace, state_dir, foreground, allow_other, durable, record_data, secret,
          no_default_secrets, timeout, max_bytes):
    """Mount the recorder over WORKSPACE itself.

    Every path into the workspace keeps working; from now on each change made through it is
    journaled.  Returns once the mount is ready (or says why it failed), unless --foreground.
    """
    ws = state.resolve_workspace(workspace)
    if state.is_dead_mount(ws):
        raise Fail(f"{ws} holds a dead mount; clear it with: overlayrec umount {ws}")
    other = state.fuse_mount_at(ws, any_fuse=True)
    if other and other["fstype"] != f"fuse.{state.FSNAME}":
        raise Fail(f"{ws} is a mount of another filesystem ({other['fstype']}): unmount it "
                   "first")
    if other:
        raise Fail(f"{ws} is already mounted")
    from .mounting import refuse_nested
    refuse_nested(ws)
    secret = _check_secrets(secret, ws)
    sd = state.check_state_dir(ws, _mount_state_dir(ws, state_dir))
    state.make_state_dir(sd)
    _put_back_agent_settings()
    if foreground:
        from . import daemon
        sys.exit(daemon.run(ws, sd, foreground=True, durable=durable, allow_other=allow_other,
                            ready_fd=None, record_data=record_data, secret=secret,
                            no_default_secrets=no_default_secrets, max_bytes=max_bytes))
    pid = _spawn_daemon(ws, sd, durable=durable, allow_other=allow_other, timeout=timeout,
                        record_data=record_data, secret=secret,
                        no_default_secrets=no_default_secrets, max_bytes=max_bytes)
    click.echo(f"mounted {ws} (daemon pid {pid}, journal {os.path.join(sd, 'journal')})")
    _warn_holders(ws, {os.getpid(), pid})


def _warn_holders(ws: str, exclude: set[int]) -> None:
    """Say which processes work in the workspace beneath the new mount: a shell or an editor
    whose directory was entered before it writes around the recorder, unrecorded (and a file
    a call changes meanwhile is then not the call's alone: docs/design.md)."""
    holders = state.underlay_holders(ws, exclude)
    if not holders:
        return
    click.echo(f"overlayrec: warning: {len(holders)} process(es) work in {ws} beneath the "
               "mount, around the recorder: their changes are not recorded (a shell there "
               "re-enters through the mount with `cd .`):", err=True)
    for h in holders[:5]:
        click.echo(f"  {h['pid']:>7} {h['command']:<16} {'; '.join(h['holds'][:2])}", err=True)
    if len(holders) > 5:
        click.echo(f"  ... and {len(holders) - 5} more (overlayrec status)", err=True)


def _ancestors(pid: int) -> set[int]:
    """``pid`` and its parents, up to init."""
    out = set()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat", errors="surrogateescape") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def _mount_state_dir(ws: str, state_dir: str | None) -> str:
    """The state dir a mount of ``ws`` records into: the one named, or the one the record of
    ``ws`` is in already (the registry names it: an earlier ``--state-dir``), else the default.
    Mounting without repeating an earlier ``--state-dir`` began a new, empty record and pointed
    every reader at it, the old one left where nothing named it any more.  Naming another
    state dir than the one holding the record says so."""
    known = state.find_state_dir(ws)
    if not state_dir:
        if not os.path.exists(os.path.join(known, "journal", "data.mdb")):
            _refuse_a_moved_record(ws)
        refused = readers.attic_of_another_record(ws, known)
        if refused:
            raise Fail(refused)
        return known
    # one that records another workspace is refused (by the mount): no word of it before
    readers.check_records(os.path.realpath(state_dir), ws, state_dir)
    # nor of one the mount refuses (inside the workspace: the warning below said the
    # readers would read it from now on, and the next line refused it; a bug hunt)
    state.check_state_dir(ws, state_dir)
    if os.path.exists(os.path.join(known, "journal", "data.mdb")) and \
            os.path.realpath(state_dir) != os.path.realpath(known):
        click.echo(f"overlayrec: warning: the record of {ws} is in {known}; this mount "
                   f"records into {state_dir}, and the readers read that one from now on",
                   err=True)
    return state_dir


def _refuse_a_moved_record(ws: str) -> None:
    """A workspace with no record under its name whose attic belongs to a record made under
    another name that is gone: the workspace was moved (renamed).  A new record begun here would
    leave that one, and the pre-images its attic holds, named by nothing; so the mount asks
    which is meant."""
    from .recorder import ATTIC_NAME
    moved = readers.moved_record(ws)
    if moved is not None:
        old, sd = moved
        raise Fail(f"{ws} holds the attic of the record made when it was {old} (moved since): "
                   f"mount with --state-dir {sd} to go on with that record, or remove "
                   f"{os.path.join(ws, ATTIC_NAME)} (its pre-images) to begin a new one")


def _refuse_secrets_unheld(ws: str, patterns: tuple[str, ...]) -> None:
    """A run joining a mount whose secret paths lack some of its ``--secret``: refused (its
    agent would have the secret recorded; it was a warning, and the content kept: a bug
    hunt)."""
    from .journal import Journal, JournalError
    from .secrets import META_PATTERNS
    try:
        j = Journal(state.find_state_dir(ws), readonly=True)
        try:
            held = json.loads(j.meta(META_PATTERNS) or "[]")
        finally:
            j.close()
    except (JournalError, ValueError, OSError):
        held = []
    missing = [p for p in patterns if p not in held]
    if missing:
        raise Fail(f"{ws} is already mounted without --secret {' '.join(missing)}: its "
                   "content would be recorded; unmount it and run again (or mount it with "
                   "that --secret)")


def _check_secrets(patterns, ws: str) -> tuple[str, ...]:
    """The ``--secret`` patterns as the mount applies them (``secrets.as_given``)."""
    from .secrets import SecretError, as_given
    try:
        return tuple(as_given(p, ws) for p in patterns)
    except SecretError as e:
        raise Fail(str(e)) from None


def _spawn_daemon(ws: str, sd: str, **kw) -> int:
    """``mounting.spawn``: the daemon started and serving; its pid.  Says what its open of the
    journal kept aside of the log ahead, which only its log would say."""
    from .mounting import spawn
    pid, aside = spawn(ws, sd, **kw)
    for path in aside:
        click.echo(f"overlayrec: warning: the log ahead of the journal ended in bytes that "
                   f"are no whole record (a crash's torn write, or damage): not applied, "
                   f"kept in {path}", err=True)
    return pid


@main.command()
@_workspace_param(required=True)  # a plain string: click.Path would stat a possibly hung mount
@click.option("--timeout", type=SECONDS, default=20.0, show_default=True,
              help="Seconds to wait for the daemon to finish before detaching the mount.")
@_guard
def umount(workspace, timeout):
    """Unmount WORKSPACE: stop its daemon cleanly, or clear a dead mount.

    A daemon that does not stop within --timeout is killed and its mount detached; nothing here
    touches the mounted path itself, so a hung mount cannot hang this command."""
    ws = state.named_workspace(workspace)
    mount = state.fuse_mount_at(ws)
    mounted = mount is not None
    if mounted and os.geteuid() != 0 and mount["uid"] not in (None, os.geteuid()):
        # fusermount3 would say "entry not found in /etc/mtab": it is not this user's
        raise Fail(f"{ws} is mounted by another user (uid {mount['uid']}): only that user, or "
                   "root, can unmount it")
    sd = state.find_state_dir(ws)
    pid, info, refused = _daemon_pid(sd)  # a pid that fails the check is left alone
    if not mounted:
        if pid:
            from .mounting import end_daemon
            # a daemon whose mount was detached as it ended (a run's release) serves a process
            # that still holds it for a few seconds more: that is ended now
            killed = end_daemon(pid, info, timeout)
            if state.overlayrec_mount_containing(ws) is None:
                click.echo(f"unmounted {ws} (its mount was gone already; ended its daemon, "
                           "which still ran" + (": killed it)" if killed else ")"))
                return
        outer = state.overlayrec_mount_containing(ws)
        if outer is not None:  # run in a subdirectory: say which mount holds it
            raise Fail(f"{ws} is not mounted itself: it is in the workspace {outer} "
                       f"(overlayrec umount {outer})")
        raise Fail(f"{ws} is not mounted")
    beneath = state.beneath_refusal(ws)
    if beneath:
        raise Fail(beneath)
    # an unmount leaves them "Transport endpoint is not connected" for every operation
    users = state.mount_users(ws, _ancestors(os.getpid()) | ({pid} if pid else set()))
    if users:
        named = ", ".join(f"{u['pid']} {u['command']}" for u in users[:3])
        click.echo(f"overlayrec: warning: {len(users)} process(es) still work in {ws} ({named}"
                   f"{' ...' if len(users) > 3 else ''}): they lose it now", err=True)
    from .mounting import end_daemon, lift_if_left, mount_of
    mount = mount_of(ws, sd) or mount
    # (a probe in a thread: a hung daemon's mount cannot hang this command)
    live = not pid and not refused and state.mount_answers(ws, timeout=1.0) is True
    killed = end_daemon(pid, info, timeout) if pid else False
    lift_if_left(ws, sd, mount)
    # a daemon this command killed (hung) is said above; status and the readers say the rest
    unsealed = _unsealed_at_end(ws, sd) if pid and not killed else None
    note = " (daemon did not stop: killed it)" if killed else \
        " (detached it; no daemon signalled)" if refused else \
        " (detached it; its daemon, not in this user's state, was not signalled: it ends " \
        "once nothing holds the mount)" if live else \
        " (cleared a dead mount)" if not pid else ""
    click.echo(f"unmounted {ws}{note}")
    try:
        here = os.getcwd()
    except OSError:  # the mount's directory, gone with it
        here = None
    if here is None or _beneath(here, ws):
        # the caller's own shell (left out of the warning above, as this command's ancestor)
        # has its working directory there: its next command said "Transport endpoint is not
        # connected" without a word why (found by a bug hunt)
        click.echo("overlayrec: your working directory was in it: `cd` out and back in to "
                   "see the workspace as it is now", err=True)
    if unsealed:
        raise Fail(unsealed)
    if not pid and not refused and not live:
        # a dead mount's daemon was killed or died: its record is left unsealed, which
        # status says (this said nothing of it; found by a bug hunt)
        dead = _unsealed_at_end(ws, sd)
        if dead:
            click.echo(f"overlayrec: warning: {dead}", err=True)


@main.command()
@_workspace_param()  # not click.Path: it would stat a hung mount
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.option("--state-dir", type=PATH, help="The state dir the workspace was mounted with "
              "(default: the one the registry names, else the workspace's default).")
@_guard
def status(workspace, as_json, state_dir):
    """Say whether WORKSPACE is mounted, by which daemon, where its journal is and how much it holds."""
    from .views import few
    ws = state.recorded_at_or_above(state.named_workspace(workspace))
    # (status says what it finds there: a journal missing, none yet)
    sd = _state_dir_for(ws, state_dir, need_journal=False) if state_dir else \
        state.find_state_dir(ws)
    _warn_low_space(sd)
    pid = state.verify_daemon(state.daemon_info(sd), sd)[0]
    in_table = bool(state.fuse_mount_at(ws))
    answers = state.mount_answers(ws) if in_table else True
    hung = in_table and answers is False
    dead = in_table and answers is None
    mounted = in_table and not dead
    events = None
    journal_path = os.path.join(sd, "journal")
    recorded = os.path.exists(os.path.join(journal_path, "data.mdb"))
    other = None if recorded or state_dir else state.others_mount(ws)
    if other is not None:  # "journal: (none yet)", while that daemon journaled every change
        _status_of_anothers(ws, other, as_json)
        return
    other = None if recorded or state_dir or in_table else state.others_attic(ws)
    if other is not None:  # and unmounted (found by a bug hunt)
        _status_of_anothers(ws, other, as_json, mounted=False)
        return
    if not (in_table or recorded or os.path.lexists(ws)):  # a mistyped path, most often
        raise Fail(f"workspace {workspace}: no such directory, and no record of it")
    if not (in_table or recorded or os.path.isdir(ws)):  # as mount and revert say it
        raise Fail(f"workspace {workspace}: not a directory")
    left_open = False
    corrupt = None
    if recorded:
        j = Journal(sd, readonly=True)
        try:
            events = j.count()
            try:
                j.scan()
            except JournalError as e:
                corrupt = str(e)
            left_open = corrupt is None and not in_table and not pid and left_unsealed(j)
        finally:
            j.close()
    holders = state.underlay_holders(ws, {os.getpid()} | ({pid} if pid else set())) \
        if mounted and not hung else []
    pending = [r["id"] for r in state.saved_reverts(sd, damaged_ok=True)
               if r.get("status") == "running"]
    damaged_plans = [{"file": n, "why": w} for n, w in state.damaged_reverts(sd)]
    readable = events is not None and not hung and not dead and corrupt is None
    drifted, unchecked = _drifted(ws, sd) if readable else (None, [])
    size = _record_size(ws, sd, mounted) if readable \
        else None
    live, owner, ending = _live_sessions(sd) if mounted and not hung and pid else \
        (None, None, False)
    out = {"workspace": ws, "mounted": mounted, "dead_mount": dead, "daemon_pid": pid,
           "state_dir": sd, "journal": journal_path if events is not None else None,
           "events": events, "underlay_holders": holders, "pending_revert": pending,
           "responding": not hung, "drifted": drifted, "drift_unchecked": unchecked,
           "damaged_plans": damaged_plans,
           "journal_missing": events is None and _had_journal(sd),
           "record_bytes": size["total"] if size else None,
           "attic": size["attic"] if size else None, "sessions": live, "mounted_for": owner,
           "ending": ending or bool(pid and not in_table), "left_unsealed": left_open,
           "corrupt": corrupt}
    if as_json:
        click.echo(json.dumps(out))
        _journal_gone(out)
        return
    if dead:
        click.echo(f"{ws}: dead mount (clear it with: overlayrec umount {ws})")
    elif hung:
        click.echo(f"{ws}: mounted, but daemon pid {pid} does not answer "
                   f"(overlayrec umount {ws} stops it)")
    elif mounted:
        click.echo((f"{ws}: mounted by daemon pid {pid}" if pid else f"{ws}: mounted")
                   + (", ending (its unmount under way)" if ending else ""))
    elif pid:  # its mount detached as it ended, a process holding it served a little longer
        click.echo(f"{ws}: not mounted; its daemon pid {pid} is still ending")
    else:
        click.echo(f"{ws}: not mounted")
    # a state dir a daemon served (its stamp), or that kept content or revert plans, had a
    # journal: gone, not "none yet"
    lost = events is None and _had_journal(sd)
    click.echo(f"  journal: {journal_path if events is not None else '(none yet)'}"
               if not lost else f"  journal: missing from {sd}, where a record was kept: "
               "its history is gone (restore journal/ from a copy)")
    if events is not None:
        click.echo(f"  events:  {events}")
    if size:
        from .views import human_size
        attic = size["attic"]
        n = attic["entries"] if attic is not None else 0
        held = f"{n} entr{'y' if n == 1 else 'ies'}, {human_size(attic['bytes'])}" \
            if attic is not None else "not reachable"
        click.echo(f"  record:  {human_size(size['total'])} on disk; attic: {held} "
                   "(`overlayrec storage` says where)")
    if left_open:
        click.echo(f"  {UNSEALED_LINE}")
    if drifted:
        click.echo(f"  drifted: {len(drifted)} path(s) differ from the record's end (changed "
                   f"while unmounted or around the mount): {few(drifted)}")
    for bad in damaged_plans:
        click.echo(f"  revert plan {bad['file']} cannot be read ({bad['why']}): a revert it "
                   "held may be half done; revert, unrevert and gc refuse until it is restored "
                   "or moved aside")
    if unchecked:
        click.echo(f"  drift not checked: {len(unchecked)} recorded path(s) cannot be reached "
                   f"(a directory on the way may not be searched): {few(unchecked)}")
    for x in live or ():
        click.echo(f"  session {x['id']}: running since {_fmt_time(x['started'])[:19]}"
                   + (f", agent pid {x['agent_pid']}" if x["agent_alive"] else
                      f", its agent (pid {x['agent_pid']}) gone" if x["agent_pid"] else "")
                   + ("" if x["runner_alive"] in (None, True) else
                      ", its `run` gone (ended once its agent has exited too)"))
    if owner and not owner["alive"]:
        click.echo(f"  mounted for pid {owner['pid']}, gone: unmounted once no session is "
                   "live and no process works in it")
    if pending:
        click.echo(f"  pending revert {pending[-1]}: finish it with `overlayrec revert "
                   "--continue` or roll it back with `overlayrec unrevert`")
    if holders:
        click.echo("  processes still using the directory beneath the mount (their changes are "
                   "not recorded; `cd .` re-enters through the mount):")
        for h in holders:
            click.echo(f"    {h['pid']:>7} {h['command']:<16} {'; '.join(h['holds'][:3])}")
    _journal_gone(out)


# what status and check say of a record left unsealed (engines.states.left_unsealed)
UNSEALED_LINE = ("left unsealed: its daemon ended without sealing the record (killed, or its "
                 "state dir full); the next mount seals it, and until then readers take the "
                 "paths it left open as not exact (their end is the live tree, which may hold "
                 "changes made since)")


def left_unsealed(j) -> bool:
    from .engines.states import left_unsealed as unsealed
    return unsealed(j)


def _status_of_anothers(ws: str, uid: int, as_json: bool, mounted: bool = True) -> None:
    """status of a workspace another user's daemon has mounted and records (or recorded, its
    attic says, and is not mounted now): said so, since this user's state dir holds nothing
    of it."""
    if as_json:
        click.echo(json.dumps({"workspace": ws, "mounted": mounted, "recorded_by_uid": uid,
                               "journal": None}))
        return
    click.echo(f"{ws}: mounted by another user's daemon (uid {uid}), which records it"
               if mounted else f"{ws}: not mounted; recorded by another user (uid {uid}, "
               "whose .overlayrec-attic is there)")
    click.echo("  journal: in that user's state dir, not yours to read")


def _corrupt_record(sd: str) -> str | None:
    """Why the journal in ``sd`` is damaged (Journal.scan), None when it reads whole."""
    try:
        j = Journal(sd, readonly=True)
    except JournalError as e:
        return str(e)
    try:
        j.scan()
    except JournalError as e:
        return str(e)
    finally:
        j.close()
    return None


def _journal_gone(out: dict) -> None:
    """status's exit: 1 when the record's journal is gone (a found hunt: "none yet", exit 0)."""
    if out["journal_missing"]:
        raise Fail(f"the journal of {out['workspace']} is missing from {out['state_dir']}: "
                   "the record's history is gone")
    if out["corrupt"]:
        raise Fail(f"{out['corrupt']} (`overlayrec check` says what can still be read)")


def _live_sessions(sd: str) -> tuple[list[dict] | None, dict | None, bool]:
    """The daemon's live sessions (each: id, started, agent pid and whether the agent and the
    `run` that began it still run), the command the mount was made for (``--owner``: pid
    and whether it still runs), and whether the mount is ending; None for what cannot be
    known (a daemon that does not answer)."""
    from . import client
    from .attribution import alive as running

    def alive(key: str | None) -> bool | None:
        return running(key) if key else None
    owner = (state.daemon_info(sd) or {}).get("owner")
    if isinstance(owner, dict) and isinstance(owner.get("pid"), int):
        owner = {"pid": owner["pid"], "alive": alive(f"{owner['pid']}:{owner.get('start')}")}
    else:
        owner = None
    try:
        with client.Client(state.StateDir(sd).control_sock, session="", timeout=5.0) as c:
            answer = c.status()
            sessions = answer["sessions"]
    except (client.ClientError, KeyError, TypeError):
        return None, owner, False
    return [{"id": x["id"], "started": x["started"], "agent_pid": x.get("agent_pid"),
             "agent_alive": alive(x.get("agent")), "runner_alive": alive(x.get("runner"))}
            for x in sessions if x.get("ended") is None], owner, bool(answer.get("ending"))


def _had_journal(sd: str) -> bool:
    """Did state dir ``sd`` hold a journal: a daemon stamped it, or it keeps content (beside
    the store's own ``tmp``) or revert plans?"""
    d = state.StateDir(sd)
    if os.path.exists(d.alive):
        return True
    for where in (d.content, d.reverts):
        try:
            if any(n != "tmp" for n in os.listdir(where)):
                return True
        except OSError:
            pass
    return False


def _drifted(ws: str, sd: str) -> tuple[list[str] | None, list[str]]:
    """The recorded paths whose live state departs from their seal (None: cannot tell), and
    the sealed ones this user cannot reach to tell (a directory above them not searchable:
    `diff --drift` names them too)."""
    from .engines.states import UNREACHED_NOTE, States
    try:
        j = Journal(sd, readonly=True)
    except JournalError:
        return None, []
    try:
        tree = _tree_for(ws, sd)
    except (Fail, OSError):
        j.close()
        return None, []
    try:
        drifted = States(j, tree).drift()
        return drifted, sorted(p for p, why in tree.unreadable.items() if why == UNREACHED_NOTE)
    except (OSError, JournalError):
        return None, []
    finally:
        os.close(tree.root_fd)
        j.close()


def _record_size(ws: str, sd: str, mounted: bool) -> dict | None:
    """The record's figures without the sessions (engines.usage), or None when they cannot be
    had (the journal unreadable); the attic is None when the workspace cannot be read."""
    import lmdb
    from .engines import usage
    try:
        j = Journal(sd, readonly=True)
    except JournalError:
        return None
    try:
        try:
            tree = _tree_for(ws, sd) if mounted or os.path.isdir(ws) else None
        except (Fail, OSError):
            tree = None
        try:
            return usage.measure(sd, j, tree.root_fd if tree else None, mounted=mounted,
                                 per_session=False)
        except (OSError, JournalError, lmdb.Error):
            return None
        finally:
            if tree:
                os.close(tree.root_fd)
    finally:
        j.close()


@main.command()
@_workspace_param()
@click.option("--state-dir", type=PATH, help="Read this state dir.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object (see below).")
@_guard
def check(workspace, state_dir, as_json):
    """Say whether the record of WORKSPACE is whole: that every event's process is known, every
    content an event names (a pre-image, a recorded write) is held, every attic entry a
    pre-image names is in the attic (unless the daemon said it dropped it for want of space)
    and was not written since around the record (by hand while unmounted, or through a hard
    link outside it), and that nothing of the log ahead was left unread.  Mounted or not; it only reads.

    \b
    Exit status: 0 whole, 1 not (one line per finding and a summary on stdout, one error
    line on stderr), 2 bad usage.
    --json: {"workspace", "state_dir", "events", "actors", "blobs", "attic_entries",
      "attic_looked_at", "whole", "findings": [{"kind": "actor" | "blob" | "attic" |
      "attic-changed" | "blob-changed", "name",
      "events" (how many name it), "seq" and "path" (the first)} or {"kind": "ahead",
      "name" (the file kept aside, or what follows the log's last whole record)} or
      {"kind": "event", "name" (what is wrong), "seq"} or {"kind": "index", "name", "seq",
      "path"} or {"kind": "plan", "name" (a revert plan's file), "why"}, ...],
      "left_unsealed" (its daemon ended without sealing it and none serves it now: no
      finding, the next mount seals it)}"""
    from .engines.check import check as do_check
    from .views import shown
    ws = state.resolve_workspace(workspace, must_exist=False, upward=True)
    sd = _state_dir_for(ws, state_dir)
    j = Journal(sd, readonly=True)
    try:
        root_fd = None
        # a dead mount is a workspace too (its stat may fail or be answered from the kernel's
        # cache): the tree's reader says what it is, not "no workspace, the attic not looked at"
        if os.path.isdir(ws) or state.fuse_mount_at(ws):
            root_fd = _tree_for(ws, sd).root_fd
        shown_progress = readers.Progress("checking event", not as_json)
        try:
            # mounted, the daemon may be writing a record ahead: its unread end is no damage
            out = do_check(j, root_fd, shown_progress,
                           writer_live=bool(state.fuse_mount_at(ws)))
        finally:
            shown_progress.done()
            if root_fd is not None:
                os.close(root_fd)
        # not a finding: nothing is missing, and the next mount seals what it left open
        out["left_unsealed"] = not state.fuse_mount_at(ws) and left_unsealed(j) and \
            not state.verify_daemon(state.daemon_info(sd), sd)[0]
    finally:
        j.close()
    found = out["findings"]
    if as_json:
        click.echo(json.dumps({"workspace": ws, "state_dir": sd, **out, "whole": not found}))
    else:
        said = {"actor": "no process (actor) recorded for", "blob": "no content held for",
                "attic": "no attic entry",
                "attic-changed": "changed since kept (written around the record, or through a "
                                 "hard link outside it: the pre-image is lost): attic entry",
                "blob-changed": "content changed on disk (it no longer matches its hash: "
                                "readers refuse it):"}
        for f in found:
            if f["kind"] == "ahead":
                click.echo(f"unread bytes of the log ahead kept aside in {f['name']}"
                           if f["name"].startswith("/") else f"log ahead: {f['name']}")
                continue
            if f["kind"] == "plan":
                click.echo(f"revert plan {f['name']} cannot be read ({f['why']}): revert, "
                           "unrevert and gc refuse until it is restored or moved aside")
                continue
            if f["kind"] == "index":
                click.echo(f"path index: {f['name']}"
                           + (f" (seq {f['seq']}, {shown(f['path'])})"
                              if isinstance(f.get("path"), str) else ""))
                continue
            if f["kind"] == "event":
                click.echo(f"not an event: {f['name']}")
                continue
            if f["kind"] == "table":
                click.echo(f"the {f['name']} table cannot be read ({f['why']}): the listings "
                           "and the selections by session, turn or call refuse")
                continue
            click.echo(f"{said[f['kind']]} {shown(f['name'])}, named by {f['events']} "
                       f"event(s) (the first: seq {f['seq']}"
                       + (f", {shown(f['path'])})" if isinstance(f["path"], str) else ")"))
        if out["left_unsealed"]:
            click.echo(UNSEALED_LINE)
        looked = "" if out["attic_looked_at"] else " (the attic not looked at: no workspace)"
        click.echo(f"{'record whole' if not found else 'record not whole'}: {out['events']} "
                   f"event(s), {out['actors']} process(es), {out['blobs']} content(s), "
                   f"{out['attic_entries']} attic entr{'y' if out['attic_entries'] == 1 else 'ies'}"
                   f" checked{looked}" + (f"; {len(found)} finding(s)" if found else ""))
    if found:
        raise Fail(f"the record of {ws} is not whole: {len(found)} finding(s)"
                   + ("" if as_json else ", listed above"))


@main.command()
@_workspace_param(default=None)  # not click.Path: it would stat a hung mount
@click.option("--all", "every", is_flag=True, help="Every workspace in the registry (each one "
              "this user's overlayrec has mounted).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object (see below).")
@click.option("--state-dir", type=PATH, help="Read this state dir.")
@_guard
def storage(workspace, every, as_json, state_dir):
    """Where the record's bytes go: for WORKSPACE (default: the recorded workspace at or above
    the current directory) or --all, the bytes on disk of the journal (and of its free pages,
    which a gc gives back), the content store, the attic (entries the workspace still links
    cost nothing), the exports and the logs; then per session, newest first: its events, the
    content it kept first and the attic entries its events kept.  A bar per category on a
    terminal; piped, a tab-separated table with a header line.

    \b
    --json: {"workspace", "state_dir", "mounted", "total",
      "journal": {"bytes", "data_size", "page_size", "pages", "used_pages",
                  "free_pages", "reclaimable"},
      "content": {"bytes", "files"}, "exports": {"bytes", "git"},
      "attic": {"bytes", "entries", "shared_entries", "shared_size"} or null,
      "logs": {"bytes"}, "other": {"bytes"},
      "sessions": [{"session" (null: outside every session), "events", "content",
                    "blobs", "attic", "attic_entries", "first_seq", "last_seq",
                    "begun", "ended" (ns), "live", "pinned"}, ...]}
    With --all: {"workspaces": [that, ...], "total", "errors": [{"workspace", "error"}],
    "gone": [registered workspaces whose state dir is gone]}.
    Every figure is bytes on disk; docs/storage.md says what each counts."""
    from .engines import usage
    if every and (workspace or state_dir):
        raise Usage("--all reads every registered workspace: give no WORKSPACE or --state-dir")
    if every:
        docs, errors, gone = [], [], []
        for ws in usage.registered():
            try:
                sd = state.find_state_dir(ws)
                if not os.path.exists(os.path.join(sd, "journal", "data.mdb")):
                    gone.append(ws)  # a registry entry outlives a state dir removed by hand
                    continue
                docs.append(_storage_of(ws, sd))
            except (Fail, StateError, JournalError, OSError) as e:
                msg = e.format_message() if isinstance(e, Fail) else \
                    _os_error_text(e) if isinstance(e, OSError) else str(e)
                errors.append({"workspace": ws, "error": msg})
        if as_json:
            click.echo(json.dumps({"workspaces": docs, "total": sum(d["total"] for d in docs),
                                   "errors": errors, "gone": gone}))
        else:
            _print_storage(docs)
        if gone and not as_json:
            click.echo(f"overlayrec: {len(gone)} registered workspace(s) have no journal any "
                       "more (their state dir was removed): left out", err=True)
        for e in errors:  # one line each; the others are still shown
            click.echo(f"overlayrec: error: {_one_line(e['error'])}", err=True)
        if errors:
            sys.exit(1)
        return
    if workspace is not None:
        ws = state.resolve_workspace(workspace, must_exist=False)
    elif state_dir:
        ws = None  # the journal names it
    else:
        ws = _recorded_above(os.getcwd())
    if state_dir:
        if not os.path.isdir(state_dir):
            raise Fail(f"state dir {state_dir} " + ("is not a directory" if
                                                    os.path.lexists(state_dir) else
                                                    "does not exist"))
        sd = _state_dir_for(ws, state_dir)
    else:
        sd = _state_dir_for(ws, None)
    doc = _storage_of(ws, sd)
    if as_json:
        click.echo(json.dumps(doc))
    else:
        _print_storage([doc])


main.add_command(storage, name="du")


def _recorded_above(cwd: str) -> str:
    """The recorded workspace at or above ``cwd``: an overlayrec mount, or a directory the
    registry names."""
    here = os.path.realpath(cwd)
    mp = state.overlayrec_mount_containing(here)
    if mp is not None:
        return mp
    p = here
    while True:
        if os.path.exists(state.registry_path(p)):
            return p
        if p == "/":
            raise Fail(f"no recorded workspace at or above {here} (name one, or --all)")
        p = os.path.dirname(p)


def _storage_of(ws: str | None, sd: str) -> dict:
    """``storage``'s document of one workspace (engines.usage.measure)."""
    from .engines import usage
    if not os.path.isdir(sd):
        raise Fail(f"{ws} is not recorded (no state dir {sd})")
    if not os.path.exists(os.path.join(sd, "journal", "data.mdb")):
        raise Fail(f"{ws or sd} is not recorded (no journal in {sd})")
    j = Journal(sd, readonly=True)
    try:
        ws = ws or j.meta("workspace")
        in_table = bool(ws) and bool(state.fuse_mount_at(ws))
        answers = state.mount_answers(ws) if in_table else None
        mounted = in_table and answers is True
        tree = None
        if ws and (mounted or (not in_table and os.path.isdir(ws))):
            try:
                tree = _tree_for(ws, sd)
            except (Fail, OSError):
                tree = None  # the attic is then not reachable: null, and said so
        try:
            doc = usage.measure(sd, j, tree.root_fd if tree else None, mounted=mounted)
        finally:
            if tree:
                os.close(tree.root_fd)
    finally:
        j.close()
    return {"workspace": ws, "state_dir": sd, "mounted": mounted, **doc}


def _print_storage(docs: list[dict]) -> None:
    from .views import storage_lines, storage_rows, STORAGE_COLUMNS
    if sys.stdout.isatty():
        import shutil
        width = shutil.get_terminal_size((80, 24)).columns
        for i, doc in enumerate(docs):
            if i:
                click.echo("")
            for line in storage_lines(doc, width, _fmt_time):
                click.echo(line)
        return
    click.echo("\t".join(STORAGE_COLUMNS))
    for doc in docs:
        for row in storage_rows(doc):
            click.echo("\t".join(_one_line(str(v)).replace("\t", "\\t") for v in row))


_fmt_time = readers.fmt_time


@main.command(name="log")
@_workspace_param()  # not click.Path: it would stat a hung mount
@click.option("--path", "glob", multiple=True,
              help="Only events on this path, paths beneath it or paths "
              "matching this glob (either side of a rename).  A path (no *, ? or [) is followed "
              "back as blame follows it: the events on its earlier names, and each directory "
              "rename that moved it; a glob matches the events' own paths only.")
@click.option("--limit", type=click.IntRange(min=1), help="Only the last N events.")
@click.option("--call", "call_id", help="Only events of this call.")
@click.option("--turn", "turn_sel", type=TURN,
              help="Only events recorded during this turn: N, last, -1 ...")
@click.option("--session", "sid", help="Only events of this session's calls, turns and agent "
              "(last: the session begun last).")
@click.option("--actor", help="Only events by this process: a pid or a command name.")
@click.option("--since", help="Only events after this point: SEQ or a time (ISO 8601, @epoch).")
@click.option("--until", help="Only events up to this point: SEQ or a time.")
@click.option("--op", "ops", multiple=True, help="Only this operation (repeatable).")
@click.option("--outside", is_flag=True, help="Only writes by processes outside every session.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events as they come.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--state-dir", type=PATH, help="Read this state dir.")
@_guard
def log_cmd(workspace, glob, limit, call_id, turn_sel, sid, actor, since, until, ops, outside,
            follow, as_json, state_dir):
    """The recorded events, newest last: time, actor (pid and command), operation and path."""
    from .journal.schema import is_dir_rename, parse_unit
    from .views import command_name, one_line, path_matcher, shown
    from .engines.replay import resolve_point
    from .engines.diff import SelectionError, find_call
    from .journal.schema import OPS
    unknown = [o for o in ops if o not in OPS]
    if unknown:  # `--op delete` (the op is unlink) matched nothing, without a word
        raise click.UsageError(f"no operation {unknown[0]!r}; the record's operations: "
                               + ", ".join(OPS))
    if len(glob) > 1:  # click kept the last alone, without a word
        raise click.UsageError("log follows one --path (a glob matches several paths)")
    ws = state.resolve_workspace(workspace, must_exist=False, upward=True)
    try:
        glob = readers.workspace_glob(ws, glob[0] if glob else None)
    except readers.Refusal as e:
        raise Fail(str(e)) from None
    sd = _state_dir_for(ws, state_dir)
    _warn_low_space(sd)
    j = Journal(sd, readonly=True)
    try:
        lo, hi = 1, None
        try:
            sid = readers.session_of(j, sid)  # a session the record does not hold: refused
            if since is not None:
                lo = resolve_point(j, since, refuse_dropped=False) + 1
            if until is not None:
                hi = resolve_point(j, until, refuse_dropped=False)
            if since is not None and until is not None and hi < lo - 1:
                raise SelectionError(f"--until {until} is before --since {since}: nothing "
                                     "between")
        except (SelectionError, readers.Refusal) as e:
            raise Fail(str(e)) from None
        if turn_sel is not None:
            try:  # N, last, -1 ... as diff and calls take it, refused alike
                t = readers.find_turn(j, sid, turn_sel)
            except readers.Refusal as e:
                raise Fail(str(e)) from None
            lo, hi = t["begin_seq"], t["end_seq"]
        if call_id is not None:
            try:  # an id two sessions hold is refused, as diff and revert refuse it
                find_call(j, call_id, sid)
            except SelectionError as e:
                from .retention import dropped_selection  # a dropped call is said to be so
                raise Fail(dropped_selection(j, call=call_id, session=sid) or str(e)) from None
        actor_cache: dict = {}

        def actor_matches(key):
            if key not in actor_cache:
                a = j.actor(key) if key else None
                actor_cache[key] = (str(a["pid"]) if a else "", command_name(a))
            return actor in actor_cache[key]

        failed = {}
        actors: dict[str, dict | None] = {}

        selects = path_matcher(glob) if glob else None
        earlier = _earlier_names(j, ws, sd, glob) if glob else None

        def keep(ev) -> bool:
            u = parse_unit(ev.get("unit"))
            if call_id is not None and not (u is not None and u.kind == "call" and u.id == call_id
                                            and (sid is None or u.session == sid)):
                return False
            if sid is not None and call_id is None and (u.session if u else None) != sid \
                    and ev.get("session") != sid:
                return False
            if actor is not None and not actor_matches(ev.get("actor")):
                return False
            if ops and ev["op"] not in ops:
                return False
            if not ops and ev["op"] in MARK_OPS:
                return False  # seals change nothing: shown with --op seal
            if outside and (u is None or u.kind != "outside"):
                return False
            if glob and not any(p is not None and selects(p)
                                for p in (ev.get("path"), ev.get("path2"))) \
                    and not (earlier and earlier(ev)):
                return False
            return True

        def emit(ev) -> None:
            key = ev.get("actor")
            if key not in actors:
                actors[key] = j.actor(key) if key else None
            a = actors[key]
            if ev["seq"] in failed:
                ev["failed_errno"] = failed[ev["seq"]].get("errno")
                if failed[ev["seq"]].get("unmade"):  # journaled, then the daemon killed
                    ev["unmade"] = True
            if as_json:
                click.echo(json.dumps(dict(ev, actor=a or {"key": key})))
                return
            where = shown(ev.get("path") or "")
            if where.startswith(".overlayrec-attic/"):  # no reader shows the attic's names
                where = readers.attic_shown(j, ev["path"], ev["seq"]) or where
            if ev["op"] in CONTROL_OPS:
                where = one_line(" ".join(f"{k}={ev[k]}" for k in ("session", "turn", "call",
                                                                   "tool", "status", "revert")
                                          if ev.get(k) is not None))
            op = ev["op"]
            if ev.get("path2") is not None:
                swapped = op == "rename" and ev.get("flags", 0) & RENAME_EXCHANGE
                op = "exchange" if swapped else op  # both names stay, their objects swapped
                where += f" {'<->' if swapped else '->'} {shown(ev['path2'])}"
            note = "  (not made: the daemon was killed before it)" if ev.get("unmade") else \
                f"  (failed: {os.strerror(ev['failed_errno'])})" if "failed_errno" in ev else ""
            click.echo(f"{ev['seq']:>6} {_fmt_time(ev['t'])} {a['pid'] if a else '?':>7} "
                       f"{one_line(command_name(a)):<12.12} {op:<11} {where}{note}")

        rows, last = [], lo - 1
        for ev in j.events(lo, hi):
            last = ev["seq"]
            if ev["op"] == "failed":
                failed[ev["ref"]] = ev
            elif keep(ev):
                rows.append(ev)
        for ev in rows[-limit:] if limit else rows:
            emit(ev)
        # followed, an event waits a moment before it is printed: a refused change's
        # `failed` note is journaled just after it, and the event printed at once went out
        # without its "(failed: ...)" (found by a bug hunt)
        waiting: list[tuple[float, dict]] = []

        def ripe(hold: float) -> None:
            now = time.monotonic()
            while waiting and now - waiting[0][0] >= hold:
                emit(waiting.pop(0)[1])
        try:
            while follow and (hi is None or last < hi):
                time.sleep(0.3)
                fresh = list(j.events(last + 1, hi))
                for ev in fresh:
                    last = ev["seq"]
                    if glob and is_dir_rename(ev):
                        # the path's names as of now: a rename that came while following
                        # was never matched (found by a bug hunt)
                        earlier = _earlier_names(j, ws, sd, glob)
                    if ev["op"] == "failed":
                        failed[ev["ref"]] = ev
                    elif keep(ev):
                        waiting.append((time.monotonic(), ev))
                ripe(FOLLOW_HOLD)
        finally:
            ripe(0)
    except KeyboardInterrupt:
        pass
    finally:
        j.close()


FOLLOW_HOLD = 0.5  # s an event waits under `log --follow` for a `failed` note after it


def _earlier_names(j, ws: str, sd: str, glob: str):
    """What ``log --path`` selects besides the events on the path itself: a predicate on
    events, true of those on the path's earlier names (and beneath them) while it held them,
    and of the directory renames that moved it, as blame follows it; None for a glob (it
    matches the events' own paths) or when nothing was renamed."""
    from .engines.replay import path_names
    from .engines.states import States
    path = "/".join(part for part in glob.split("/") if part not in ("", "."))
    if not path or any(c in path for c in "*?[") or not j.dir_renames():
        return None
    try:
        tree = readers.tree_for(ws, sd)
    except readers.Refusal as e:  # the events on the path itself are still shown
        click.echo(f"overlayrec: {path} not followed through directory renames: {e}",
                   err=True)
        return None
    try:
        windows, moves = path_names(j, States(j, tree), path)
    finally:
        os.close(tree.root_fd)
    windows = [w for w in windows if w[0] != path]  # its own name: matched as it is

    def on(p: str | None, name: str) -> bool:
        return p is not None and (p == name or p.startswith(name + "/"))

    def earlier(ev: dict) -> bool:
        return ev["seq"] in moves or any(
            lo < ev["seq"] <= hi and (on(ev.get("path"), name) or on(ev.get("path2"), name))
            for name, lo, hi in windows)
    return earlier


# -- announcing sessions, turns and calls ---------------------------------------------------------

def _client(session=None):
    from . import client
    try:
        return client.connect(session=session)
    except (client.ClientError, StateError) as e:
        raise Fail(str(e)) from None


def _announce(session, send, as_json):
    """Send one announcement through a client found for ``session``; the daemon's answer."""
    with _client(session) as c:
        return _request(lambda: send(c), as_json)


def _request(fn, as_json=False):
    from . import client
    try:
        out = fn()
    except client.ClientError as e:
        raise Fail(str(e)) from None
    if as_json:
        click.echo(json.dumps(out))
    return out


@main.group()
def call():
    """Announce a tool call's begin and end (the mount is found from OVERLAYREC_SOCKET or the
    current directory; the caller's identity is taken from the kernel)."""


@call.command(name="begin")
@click.option("--id", "call_id", required=True, help="The call's id (e.g. the agent's tool_use_id).")
@click.option("--tool", required=True, help="The tool's name (Bash, Edit, ...).")
@click.option("--summary", help="One line saying what the call does.")
@click.option("--session", help="The session (default: OVERLAYREC_SESSION or the caller's own).")
@click.option("--json", "as_json", is_flag=True)
def call_begin(call_id, tool, summary, session, as_json):
    """Begin a call: from now on the processes the agent starts belong to it."""
    _announce(session, lambda c: c.call_begin(call_id, tool, summary), as_json)


@call.command(name="end")
@click.option("--id", "call_id", required=True)
@click.option("--status", type=click.Choice(["ok", "error"]), default="ok", show_default=True)
@click.option("--session")
@click.option("--json", "as_json", is_flag=True)
def call_end(call_id, status, session, as_json):
    """End a call."""
    _announce(session, lambda c: c.call_end(call_id, status), as_json)


@main.group()
def turn():
    """Announce a turn's begin (a user prompt) and end (the agent's answer)."""


@turn.command(name="begin")
@click.option("--session")
@click.option("--prompt", help="The user's prompt (its first line is shown in listings).")
@click.option("--json", "as_json", is_flag=True)
def turn_begin(session, prompt, as_json):
    """Begin a turn (ending the open one, if any)."""
    _announce(session, lambda c: c.turn_begin(prompt), as_json)


@turn.command(name="end")
@click.option("--session")
@click.option("--json", "as_json", is_flag=True)
def turn_end(session, as_json):
    """End the open turn."""
    _announce(session, lambda c: c.turn_end(), as_json)


@main.group()
def session():
    """Begin or end a session by hand (overlayrec run does this for you)."""


@session.command(name="begin")
@click.option("--session", "name", help="The session's name (default: a new id).")
@click.option("--json", "as_json", is_flag=True)
def session_begin(name, as_json):
    """Begin a session whose agent is the caller's first ancestor that is not a shell."""
    out = _announce(None, lambda c: c.session_begin(session=name), as_json)
    if not as_json:
        click.echo(out["session"])


@session.command(name="end")
@click.option("--session", "name")
@click.option("--json", "as_json", is_flag=True)
def session_end(name, as_json):
    """End a session (its open turn and calls with it)."""
    _announce(name, lambda c: c.session_end(), as_json)


# -- hooks ----------------------------------------------------------------------------------------

@main.group()
def hook():
    """Agent hook adapters (run by the agent on each hook event, JSON on stdin)."""


def _hook_command_for(name: str):
    from . import agents
    mod = agents.get(name)
    events = ", ".join(mod.EVENTS)

    @hook.command(name=name, help=f"{name}: {events}.\n\nReads the hook's JSON on stdin. "
                  "Silent on success (but for the answer the agent expects on stdout); exits 0 "
                  "even when nothing is mounted, so it never breaks the agent.")
    def _hook():
        sys.exit(agents.run_hook(name))
    return _hook


def _agent_names() -> list[str]:
    from . import agents
    return agents.names()


for _name in _agent_names():  # one subcommand per agent in the registry (overlayrec/agents/)
    _hook_command_for(_name)


@main.command(name="install-hooks")
@click.argument("agent", type=click.Choice(_agent_names()))
@click.option("--project", type=click.Path(file_okay=False, exists=True),
              help="A project's settings (e.g. DIR/.claude/settings.json).")
@click.option("--user", is_flag=True, help="The user's settings (e.g. ~/.claude/settings.json).")
@click.option("--remove", is_flag=True, help="Take our entries out again.")
@_guard
def install_hooks(agent, project, user, remove):
    """Merge overlayrec's hook entries into an agent's settings, keeping what is there (other
    entries, key order, indentation); --remove takes exactly ours out again."""
    from . import agents
    from .agents._settings import SettingsError
    if bool(project) == bool(user):
        raise Fail("say where: --project DIR or --user")
    path = agents.settings_path(agent, None if user else project)
    try:
        agents.install(agent, path, remove=remove)
    except SettingsError as e:
        raise Fail(f"{path}: {e}" if not str(e).startswith(path) else str(e)) from None
    click.echo(f"{'removed hooks from' if remove else 'installed hooks in'} {path}")


# -- run ------------------------------------------------------------------------------------------

def hook_command(agent: str = "claude-code", event: str | None = None) -> str:
    """The hook's command line for ``agent`` (see ``agents.hook_command``)."""
    from . import agents
    return agents.hook_command(agent, event)


PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def _set_subreaper() -> None:
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _own_failures(fn):
    """`run`'s own failures (a missing workspace, a state dir refused) exit 125, as env's,
    timeout's and docker run's do: with 1, the status of an agent that ran and failed, a
    caller could not tell that the agent never ran (found by a bug hunt)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except click.ClickException as e:
            if e.exit_code == 1 and not isinstance(e, click.UsageError):
                e.exit_code = 125
            raise
    return wrapper


@main.command(context_settings={"ignore_unknown_options": True,
                                "allow_interspersed_args": False})
@click.option("-w", "--workspace", default=".", show_default=True,
              help="The workspace to record (mounted unless it already is).")
@click.option("--session", "name", help="The session's name (default: a new id).")
@click.option("--state-dir", type=PATH, help="Where the journal lives, when mounting.")
@click.option("--record-data", is_flag=True, help="When mounting: journal every write's data.")
@click.option("--secret", "secret", multiple=True, metavar="PATTERN",
              help="When mounting: a path whose content is never kept (repeatable; added to "
              "the defaults).")
@click.option("--no-default-secrets", is_flag=True,
              help="When mounting: only the --secret patterns, not the defaults.")
@click.option("--max-bytes", "max_bytes", type=_Size(budget=True), metavar="SIZE",
              help="When mounting: keep the record within SIZE (K/M/G), oldest sessions first.")
@click.option("--no-hooks", is_flag=True,
              help="Do not wire the agent's hooks for this run: implicit calls only.")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@_own_failures
@_guard
def run(workspace, name, state_dir, record_data, secret, no_default_secrets, max_bytes, no_hooks,
        cmd):
    """Run CMD (an agent) in the recorded workspace: mount it (or join the daemon already
    there), run CMD with the terminal passed through and OVERLAYREC_SOCKET/OVERLAYREC_SESSION
    set, then unmount if this run mounted, print a summary and exit with CMD's status (1 when
    CMD succeeded but the daemon could not seal the record at unmount, or its mount, moved by
    a rename of a directory above the workspace, could not be lifted: it says why).  Its own
    failures exit 125 (as env's and timeout's do), a CMD not found 127, not runnable 126.

    The agent's hooks are wired for this run when CMD's program is one overlayrec knows
    (claude, codex, gemini, cursor-agent; docs/agents.md), through the agent's own per-run
    option where it has one, and its settings are as they were afterwards.  --no-hooks, and any
    other program, record each direct child of CMD as an implicit call.

    Example: overlayrec run -- claude"""
    import subprocess
    from . import client
    _output_outlives_its_reader()
    # a signal before the agent runs (Ctrl-C while mounting) is taken once the mount is made,
    # so that it goes again: it killed the run there and left the mount behind
    stopped: list[int] = []
    early = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    # what the caller ignored stays ignored, here and in the agent, which inherits it
    # (`nohup overlayrec run -- agent`: the agent was killed by the hangup; a script's
    # `run ... &` lost the SIGINT a background job ignores; found by a bug hunt)
    ignored = {sig for sig in early if signal.getsignal(sig) == signal.SIG_IGN}
    for sig in early:
        if sig not in ignored:
            signal.signal(sig, lambda s, f: stopped.append(s))
    ws = state.resolve_workspace(workspace)
    named = ws  # where the agent starts, also when the workspace is a directory above it
    try:
        here = os.path.realpath(os.getcwd())
    except OSError:  # a removed working directory: the agent starts at the workspace
        here = ws
    # re-entered by path; `-w ws/pkg` of a workspace recorded at ws starts the agent in pkg
    # (it started at ws: a command meant for pkg/f wrote ws/f, found by a bug hunt)
    cwd = here if _beneath(here, named) else named
    _runnable(cmd[0], cwd)
    outer = state.overlayrec_mount_containing(ws)
    if outer is not None and outer != ws:
        # a directory inside a recorded workspace: the run joins it (a second mount inside
        # the first would record every change twice, the outer record blaming our daemon)
        click.echo(f"overlayrec: {ws} is inside the workspace {outer}: recording there",
                   err=True)
        ws = outer
    elif outer is None and (above := state.recorded_at_or_above(ws)) != ws:
        # unmounted, the same: a record of its own began there, without a word, the session
        # missing from the workspace's record and the edit drift in it
        click.echo(f"overlayrec: {ws} is inside the recorded workspace {above}: recording "
                   "there", err=True)
        ws = above
    other = state.others_mount(ws)
    if other is not None:
        # its daemon's state dir (and socket) are that user's: the run could neither join it
        # nor announce a call (it failed on `mount.lock: No such file or directory`: found by
        # a bug hunt)
        raise Fail(f"{state.recorded_by_another(ws, other)}: a run joins a mount of its own "
                   "user's only (run it as that user, or have them unmount it)")
    if state.fuse_mount_at(ws):
        if secret:
            _refuse_secrets_unheld(ws, _check_secrets(secret, ws))
        # the daemon there applies what it mounted with (a --state-dir, --record-data or
        # --max-bytes given to a run that joined were ignored without a word: a bug hunt)
        other_sd = state_dir and os.path.realpath(state_dir) != \
            os.path.realpath(state.find_state_dir(ws))
        given = [opt for opt, v in (("--state-dir", other_sd), ("--record-data", record_data),
                                    ("--secret", secret),
                                    ("--no-default-secrets", no_default_secrets),
                                    ("--max-bytes", max_bytes is not None)) if v]
        if given:
            click.echo(f"overlayrec: warning: {ws} is already mounted: {', '.join(given)} "
                       "apply at mount only; this session goes into the record of the mount "
                       "there", err=True)
    made = None  # the mount this run made (mounting.mount_of), known by its id wherever it goes
    for attempt in range(5):
        mounted_here = False
        if state.is_dead_mount(ws):
            raise Fail(f"{ws} holds a dead mount; clear it with: overlayrec umount {ws}")
        if not state.fuse_mount_at(ws):
            secret = _check_secrets(secret, ws)
            sd = state.check_state_dir(ws, _mount_state_dir(ws, state_dir))
            state.make_state_dir(sd)
        else:
            sd = state.find_state_dir(ws)
        from .mounting import one_mounter, wait_released
        with one_mounter(sd):
            # two runs started together: the second waits here for the first's mount, and
            # joins it (it failed, "already mounted", and its agent never ran)
            if not state.fuse_mount_at(ws):
                daemon_pid = _spawn_daemon(ws, sd, record_data=record_data, secret=secret,
                                           no_default_secrets=no_default_secrets,
                                           max_bytes=max_bytes, for_this=True)
                mounted_here = True
                from .mounting import mount_of
                made = mount_of(ws, sd)
                # the shell that started this run waits for it: only the others write around
                # us
                _warn_holders(ws, _ancestors(os.getpid()) | {daemon_pid})
            elif secret:  # joined a mount another run made meanwhile (a race: unchecked, the
                # secret was recorded; found by a bug hunt)
                _refuse_secrets_unheld(ws, _check_secrets(secret, ws))
        sock = os.path.join(sd, "control.sock")
        try:
            # a session of its own, also when run inside another one (an agent may start
            # one): not the OVERLAYREC_SESSION it inherited
            c = client.Client(sock, session="")
            sid = c.session_begin(session=name, runner=True, command=list(cmd))["session"]
            break
        except client.MountEnding:
            # the run that mounted let the mount go as we joined: once it is gone, mount anew
            c.close()
            wait_released(ws, sd)
        except client.ClientError as e:
            if mounted_here:
                _stop_daemon(ws)
            raise Fail(str(e)) from None
    else:
        raise Fail(f"{ws}: its mount kept ending as this run joined it")
    _set_subreaper()
    env = dict(os.environ, OVERLAYREC_SOCKET=sock, OVERLAYREC_SESSION=sid, OVERLAYREC_WORKSPACE=ws)
    _set_pwd(env, cwd)
    # git stops looking for a repository at a filesystem's boundary, which the mount is: in a
    # workspace inside a repository (a package of a monorepo) every git command of the agent
    # failed, "not a git repository ... Stopping at filesystem boundary"
    env.setdefault("GIT_DISCOVERY_ACROSS_FILESYSTEM", "1")
    argv, env, unwire = _wire_agent(list(cmd), env, cwd, no_hooks)
    try:
        if stopped:  # stopped before the agent began: it does not
            raise InterruptedError
        # the caller's descriptors past 2 go through, as a shell passes them (`3>log`,
        # make's jobserver: they were closed, found by a bug hunt); ours are not inheritable
        child = subprocess.Popen(argv, cwd=cwd, env=env, close_fds=False)
    except InterruptedError:
        unwire()
        c.session_end(session=sid)
        if mounted_here:
            _stop_daemon(ws)
        err = Fail(f"stopped by {signal.Signals(stopped[0]).name} before {cmd[0]} began")
        err.exit_code = 128 + stopped[0]  # as a shell says a command ended by a signal
        raise err from None
    except OSError as e:
        unwire()
        c.session_end(session=sid)
        if mounted_here:
            _stop_daemon(ws)
        # exit as a shell does for a command it cannot run: 127 not found, 126 not runnable
        err = Fail(f"{cmd[0]}: {e.strerror}")
        err.exit_code = 127 if isinstance(e, FileNotFoundError) else 126
        raise err from None
    try:
        c.session_agent(child.pid, session=sid)
    except client.ClientError as e:
        click.echo(f"overlayrec: warning: {e}", err=True)
    # a signal meant for the agent, sent to this run (a supervisor's stop, `kill -USR1`):
    # passed on (USR1 and USR2 ended this run alone, the agent left running; a bug hunt)
    forwarded = tuple(sig for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                                      signal.SIGUSR1, signal.SIGUSR2) if sig not in ignored)
    # os.kill, not Popen.send_signal: that polls first, and its reaping of an agent just
    # dead left _wait_reaping waiting for the daemon, which waited for this run (a hang,
    # found by a bug hunt); only _wait_reaping reaps the agent, so its pid is its own till then
    def pass_on(sig, frame=None):
        if child.returncode is None:  # (reaped: its pid may be another process's by now)
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, sig)
    for sig in forwarded:
        signal.signal(sig, pass_on)
    tty = _controlling_tty()
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, lambda s, f: None if _in_foreground(tty) else pass_on(s))
    for sig in stopped:  # while the agent was being started
        if sig in forwarded or sig == signal.SIGINT and not _in_foreground(tty):
            pass_on(sig)
    try:
        rc = _wait_reaping(child)
    finally:
        unwire()  # the agent's settings as they were, also when this run is being stopped
    for sig in forwarded + (signal.SIGINT,):
        if sig not in ignored:
            signal.signal(sig, signal.SIG_DFL)
    try:
        c.session_end(session=sid)
    except client.ClientError as e:
        click.echo(f"overlayrec: warning: {e}", err=True)
    c.close()
    unsealed = left = None
    beneath = False
    if mounted_here:
        beneath = _release_mount(ws, sd, made)
        if not beneath:  # (left mounted on purpose: no mount left behind)
            from .mounting import left_behind
            left = left_behind(ws, sd, made)
        unsealed = _unsealed_at_end(ws, sd)
    try:
        _print_summary(sd, sid)
    except Exception as e:  # the summary must not hide CMD's status
        click.echo(f"overlayrec: no summary: {e}", err=True)
    # every page read, not only the summary's: a damaged page elsewhere went unsaid
    corrupt = _corrupt_record(sd)
    rc = rc if rc >= 0 else 128 - rc
    if corrupt:  # recorded into a journal the readers refuse: not a record to trust
        click.echo(f"overlayrec: error: the session was recorded into a damaged record: "
                   f"{corrupt} (`overlayrec check` says what can still be read)", err=True)
        sys.exit(rc or 1)
    if unsealed:  # CMD's own failure, if any, keeps its status
        click.echo(f"overlayrec: error: {unsealed}", err=True)
    if left:
        click.echo(f"overlayrec: error: {left}", err=True)
    sys.exit((rc or 1) if unsealed or left or beneath else rc)


def _set_pwd(env: dict, cwd: str) -> None:
    """The agent's $PWD names where it starts, as `cd WS && agent` would: it named the
    caller's directory, and a Makefile's $(PWD) wrote there, outside the workspace and
    unrecorded (found by a bug hunt).  The caller's own, when it names that directory."""
    old = env.get("PWD")
    try:
        same = old is not None and os.path.samefile(old, cwd)
    except OSError:
        same = False
    if not same:
        env["PWD"] = cwd
        if old is not None:
            env["OLDPWD"] = old


def _controlling_tty() -> int | None:
    """A descriptor of this process's controlling terminal (None: it has none)."""
    try:
        return os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None


def _in_foreground(tty: int | None) -> bool:
    """Is this process in its terminal's foreground group?  Then a Ctrl-C went to the agent
    too (it is in this group): passing it on would give it two.  A SIGINT sent to this run
    alone otherwise (a supervisor's `kill -INT`) is passed on; it was dropped (a bug hunt)."""
    if tty is None:
        return False
    try:
        return os.tcgetpgrp(tty) == os.getpgrp()
    except OSError:
        return False


def _wait_reaping(child) -> int:
    """Wait for the agent, reaping meanwhile the orphans this run adopts as their child
    subreaper (each stayed a zombie, a pid taken, until the agent ended; found by a bug
    hunt).  Its status as Popen gives it (negative: the signal that ended it)."""
    while child.returncode is None:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return child.wait()
        if pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)
    return child.returncode


def _runnable(cmd0: str, cwd: str) -> None:
    """Refuse a command that cannot be run (127 not found, 126 not runnable), as a shell says
    it, before a session is begun for it: a typo's session took the name given, and the
    retry's went to NAME.2, `--session NAME` then showing the empty first (a bug hunt)."""
    import shutil
    if "/" in cmd0:
        path = os.path.join(cwd, cmd0)
        if not os.path.exists(path):
            why, code = "No such file or directory", 127
        elif os.path.isdir(path) or not os.access(path, os.X_OK):
            why, code = "Permission denied", 126
        else:
            return
    elif shutil.which(cmd0) is None and all(
            os.path.isabs(d) for d in os.environ.get("PATH", os.defpath).split(os.pathsep)):
        # (a relative entry of $PATH is looked up from where the agent starts: Popen says)
        why, code = "No such file or directory", 127
    else:
        return
    err = Fail(f"{cmd0}: {why}")
    err.exit_code = code
    raise err


class _Unbroken:
    """A text stream whose writes to a pipe no one reads any more, or to a terminal that hung
    up (EIO), are dropped: a line to a closed terminal ended `run` with 1, not the agent's
    status, and before its end checks (found by a bug hunt)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            if not isinstance(e, BrokenPipeError) and e.errno != errno.EIO:
                raise
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except OSError as e:
            if not isinstance(e, BrokenPipeError) and e.errno != errno.EIO:
                raise

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _output_outlives_its_reader() -> None:
    """A command that mounts for the occasion (`run`, a revert of an unmounted workspace)
    must not be ended by its own lines between the mount and the unmount: with its output a
    pipe whose reader had gone (`overlayrec run -- agent 2>&1 | head -1`), a line killed it by
    SIGPIPE there, and the mount was left behind (and run's agent not run, or its settings
    left wired).  Its lines are dropped instead; an agent gets SIGPIPE as it had it (Popen
    restores it)."""
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Unbroken):
            setattr(sys, name, _Unbroken(stream))


def _put_back_agent_settings() -> None:
    """Put back the agents' settings files a killed `run` left edited (a backup beside them)."""
    from . import agents
    for said in agents.restore_left_behind():
        click.echo(f"overlayrec: {said}", err=True)


def _wire_agent(argv: list, env: dict, cwd: str, no_hooks: bool):
    """Wire the hooks of the agent ``argv`` runs (known by its program's name, see
    overlayrec/agents/) for this run: ``(argv, env, unwire)``.  Unknown programs, and
    ``--no-hooks``, run as they are: their direct children are implicit calls."""
    import shutil
    import tempfile
    from . import agents
    _put_back_agent_settings()
    mod = None if no_hooks else agents.for_program(argv[0])
    if mod is None:
        return argv, env, lambda: None
    scratch = tempfile.mkdtemp(prefix="overlayrec-run-")
    try:
        argv, env, cleanup, note = agents.wire_run(mod, argv, env, scratch, cwd)
    except Exception as e:  # the agent runs anyway, with implicit calls
        cleanup, note = None, f"not wired: {e}"
    if note.startswith("not wired"):
        click.echo(f"overlayrec: warning: {mod.NAME} hooks {note}; implicit calls only",
                   err=True)
    done = []

    def unwire():
        if done:
            return
        done.append(True)
        try:
            if cleanup is not None:
                cleanup()
        except OSError as e:
            click.echo(f"overlayrec: warning: could not put the {mod.NAME} settings back: {e}",
                       err=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return argv, env, unwire


def _call_processes(sd: str) -> list[dict]:
    """The live processes of the mount's calls (client.processes); none when its daemon cannot
    say (an older one)."""
    from . import client
    try:
        with client.Client(os.path.join(sd, "control.sock")) as c:
            return c.processes()
    except (client.ClientError, OSError):
        return []


def _release_mount(ws: str, sd: str, made: dict | None = None) -> bool:
    """Unmount a mount this command made for itself, unless something works in it: a session
    live (a `run` that joined it), or a process the agent left working in the workspace (a
    server, a watcher: every operation of theirs would fail, ENOTCONN), which the daemon waits
    for (its --owner: this command, gone by then); or a mount made beneath it, which the
    unmount would take along: the user decides (whether the mount was left for that, said).  The daemon looks and ends in one step
    (ControlServer.release): a `run` joining meanwhile is either seen or told to mount anew."""
    from . import client
    from .mounting import wait_released
    try:
        with client.Client(os.path.join(sd, "control.sock")) as c:
            out = c.release()
    except client.ClientError as e:
        click.echo(f"overlayrec: warning: {e}; unmounting", err=True)
        _stop_daemon(ws)
        return
    if out["released"]:
        from .mounting import wait_previous
        if not wait_previous(sd, 1.0):
            click.echo("overlayrec: a process came to the workspace as its mount ended: the "
                       "daemon serves it for up to 10 s more before this command exits", err=True)
        wait_released(ws, sd, made=made)
    elif out.get("beneath"):
        click.echo(f"overlayrec: error: leaving {ws} mounted: {out['beneath']}", err=True)
        return True
    elif out["sessions"]:
        click.echo(f"overlayrec: leaving {ws} mounted: session(s) {', '.join(out['sessions'])} "
                   "still running; it is unmounted once they end and nothing works in it",
                   err=True)
    else:
        users = out["users"]
        named = ", ".join(f"{u['pid']} {u['command']}" for u in users[:3])
        click.echo(f"overlayrec: leaving {ws} mounted: {len(users)} process(es) still work "
                   f"in it ({named}{' ...' if len(users) > 3 else ''}), recorded as "
                   f"before; it is unmounted once they are done", err=True)


def _unsealed_at_end(ws: str, sd: str) -> str | None:
    """Once this command's daemon has ended: why the record was left unsealed (one line), or
    None when it was sealed, or a daemon serves the workspace again.  The daemon logs a seal
    refused at unmount and exits; its meta ``sealed`` says so to this command (a `run` exited
    0 and said nothing, found by a bug hunt)."""
    from .mounting import wait_previous, mounting_now
    if state.fuse_mount_at(ws) or state.verify_daemon(state.daemon_info(sd), sd)[0]:
        return None
    if not wait_previous(sd, 0):
        return None  # still ending (a detached mount it serves a while): it seals then
    # a `run` starting now holds the mount lock until its mount is served; its daemon marks
    # the record unsealed as it opens it, before it mounts (this run said its own daemon had
    # died unsealed: found under load)
    with mounting_now(sd, 30.0) as free:
        if not free or state.fuse_mount_at(ws) or \
                state.verify_daemon(state.daemon_info(sd), sd)[0]:
            return None
        try:
            j = Journal(sd, readonly=True)
        except JournalError:
            return None
        try:
            if not left_unsealed(j):
                return None
        finally:
            j.close()
    try:
        st = os.statvfs(sd)
        full = st.f_bavail * st.f_frsize < 1 << 20
    except OSError:
        full = False
    log_path = state.StateDir(sd).daemon_log
    if not _seal_refused_in_log(log_path):  # killed, or it died: the log says nothing of it
        return ("the daemon ended without sealing the record (it was killed or died before "
                "its unmount): the next mount seals it, and until then readers take the paths "
                "it left open as not exact")
    why = ("no space left in the state dir; " if full else "") + f"{log_path} says why"
    return (f"the daemon could not seal the record at unmount ({why}): the next mount seals "
            "it, and until then readers take the paths it left open as not exact")


def _seal_refused_in_log(path: str) -> bool:
    """Does the daemon log's last mount (its lines after the last "mounted") say the seal at
    unmount failed?  (A killed daemon's says nothing: `run` pointed to it for a reason it did
    not hold; found by a bug hunt.)"""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - (256 << 10)))
            tail = f.read().decode(errors="replace")
    except OSError:
        return False
    last = tail.rfind(" INFO overlayrec: mounted ")
    return "sealing at unmount failed" in tail[last if last >= 0 else 0:]


def _stop_daemon(ws: str) -> None:
    """``mounting.stop``, saying on stderr why the daemon's pid was not signalled."""
    from .mounting import stop
    why = stop(ws)
    if why:
        click.echo(f"overlayrec: warning: {why}", err=True)


def _print_summary(sd: str, sid: str) -> None:
    from .views import session_summary
    from .journal import Journal
    j = Journal(sd, readonly=True)
    net, close = _listing_net(j, j.meta("workspace"), sd, quiet=True)
    try:
        for line in session_summary(j, sid, net):
            click.echo(line, err=True)
    finally:
        close()
        j.close()


# -- listings -------------------------------------------------------------------------------------

def _listing_net(j, ws: str | None, sd: str, quiet: bool = False):
    """(net, close) for the listings (views' ``net``: which paths a unit left changed), read
    from the live tree; (None, close) when the tree cannot be read: they then list every path
    written."""
    from .engines.diff import net_of
    states, close = readers.listing_states(j, ws, sd, quiet)
    return (net_of(states) if states is not None else None), close



@main.command()
@_workspace_param()  # not click.Path: it would stat a hung mount
@click.option("--session", "sid", type=ID,
              help="Only this session (last: the session begun last).")
@click.option("--all", "churn", is_flag=True, help="Count every path written, also those left "
              "as they were (temp files, same-content rewrites); --json carries both.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--state-dir", type=PATH)
@_guard
@_without_cycle_gc
def turns(workspace, sid, churn, as_json, state_dir):
    """One row per turn: index, time, files changed (net: the state differs between the turn's
    begin and end), the first paths and a count of those under .git/, the prompt's first line,
    and who else changed files in the workspace during it (--all: who else wrote at all;
    "others" and "touched_others" in --json).  Paths whose change is not known (changed
    around the mount meanwhile, or not known exactly on one side, as diff says) are named
    in brackets ("around", "inexact" in --json)."""
    readers.emit(readers.turns(workspace, sid, churn, as_json, state_dir))


@main.command()
@_workspace_param()  # not click.Path: it would stat a hung mount
@click.option("--session", "sid", type=ID,
              help="Only this session (last: the session begun last).")
@click.option("--turn", "turn_sel", type=TURN,
              help="Only calls of this turn: N, last, -1 ...")
@click.option("--all", "churn", is_flag=True, help="Count every path written, also those left "
              "as they were (temp files, same-content rewrites); --json carries both.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--state-dir", type=PATH)
@_guard
@_without_cycle_gc
def calls(workspace, sid, turn_sel, churn, as_json, state_dir):
    """One row per call: tool, files changed (net: the state differs between just before the
    call's first change and just after its last), summary, the processes it ran; under it the
    paths, the workspace's own first and those under .git/ as a count, and a line for paths
    whose change is not known (changed around the mount meanwhile, not known exactly on one
    side as diff says, changed after the call ended: "around", "inexact", "late" in
    --json)."""
    readers.emit(readers.calls(workspace, sid, turn_sel, churn, as_json, state_dir))


# -- diffs ----------------------------------------------------------------------------------------

def _open_journal_and_tree(workspace: str, state_dir: str | None):
    """What the engines read: (workspace, state dir, journal read-only, live tree)."""
    ws = state.resolve_workspace(workspace, must_exist=False, upward=True)
    sd = _state_dir_for(ws, state_dir)
    return ws, sd, Journal(sd, readonly=True), _tree_for(ws, sd)


def _tree_for(ws: str, sd: str):
    """readers.tree_for: the live tree, beneath the mount or the workspace itself."""
    try:
        return readers.tree_for(ws, sd)
    except readers.Refusal as e:
        raise Fail(str(e)) from None


@main.command()
@_workspace_param()  # not click.Path: it would stat a hung mount
@click.option("--call", "call_id", help="What this call changed.")
@click.option("--turn", "turn_sel", type=TURN,
              help="What this turn changed: N, last, or -1, -2 ...")
@click.option("--session", "sid", type=ID,
              help="What this session changed (or: narrows --call/--turn); last: the "
              "session begun last.")
@click.option("--since", type=SEQ0, help="Everything recorded after this sequence number.")
@click.option("--until", type=SEQ0, help="... up to and including this one.")
@click.option("--drift", is_flag=True, help="What changed around the record: each recorded path "
              "whose live state departs from the record's end (edits made while unmounted, or by "
              "a process that bypassed the mount), from the record to the live tree.")
@click.option("--stat", "fmt", flag_value="stat", help="git diff --stat.")
@click.option("--numstat", "fmt", flag_value="numstat", help="git diff --numstat.")
@click.option("--name-status", "fmt", flag_value="name-status", help="git diff --name-status.")
@click.option("--patch", "fmt", flag_value="patch", default=True, help="A unified diff (default).")
@click.option("--binary", is_flag=True, help="Binary patches (for git apply).")
@click.option("--path", "glob", multiple=True,
              help="Only this path, the paths beneath it, or those matching this glob "
              "(* crosses /; relative to the current directory inside the workspace, to its "
              "root from outside it); repeatable: any of them.")
@click.option("--by-writer", is_flag=True, help="Split the changes by call and outside actor.")
@click.option("--json", "as_json", is_flag=True, help="Files, their status and writers, as JSON.")
@click.option("--state-dir", type=PATH)
@_guard
@_without_cycle_gc
def diff(workspace, call_id, turn_sel, sid, since, until, drift, fmt, binary, glob, by_writer,
         as_json, state_dir):
    """What a call, a turn, a session or a range changed, in git's own format.

    The diff is made by git (diff-tree of two trees in a private object store), so renames,
    binary files, modes and symlinks read as git shows them, and git apply takes it."""
    readers.emit(readers.diff(workspace, call_id, turn_sel, sid, since, until, drift, fmt,
                              binary, glob, by_writer, as_json, state_dir))


_left_out_lines = readers.left_out_lines


def _answers(sd: str, j, tree):
    return readers.answers_of(sd, j, tree)


def _say_left_out(n: int, store, what: str = "shown") -> None:
    """On stderr: readers.left_out_lines."""
    for line in _left_out_lines(n, store, what):
        click.echo(line, err=True)


def _beneath(path: str, top: str) -> bool:
    """Is ``path`` (which need not exist yet) ``top`` or beneath it, symlinks resolved, and
    by identity (a bind mount of ``top`` names it by another path: state.is_beneath)?"""
    parent, name = os.path.split(os.path.abspath(path))
    real, top = os.path.join(os.path.realpath(parent), name), os.path.realpath(top)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep) or \
        state.is_beneath(real, top)


@main.command()
@_workspace_param()
@click.option("--at", "at", default="end", show_default=True,
              help="SEQ, a time (ISO 8601 or @epoch), turn:N (turn:SESSION:N where several "
              "sessions hold turns), call:ID (call:SESSION:ID where two sessions hold the id), session:S (last: the session begun last), "
              "before:/after: any of those, or end (the record's last event).")
@click.option("--to", "dest", required=True, type=_NewPath(),
              help="A new directory, outside the workspace.")
@click.option("--full", is_flag=True, help="The whole workspace as it stood, not just the "
              "recorded paths (the live tree rolled back through the journal).")
@click.option("--state-dir", type=PATH)
@click.option("--json", "as_json", is_flag=True)
@_guard
def replay(workspace, at, dest, full, state_dir, as_json):
    """Write the workspace's recorded paths as they stood at a point into a new directory.

    Exact at every epoch boundary (every call, turn and outside actor boundary); see
    docs/export.md for the precision inside one."""
    from .engines.diff import SelectionError
    from .engines.replay import point_time, replay as do_replay, resolve_point
    from .views import named, shown
    from .engines.states import States
    if os.path.lexists(dest):
        if os.path.islink(dest) or not os.path.isdir(dest):
            raise Fail(f"{dest} exists and is not a directory")
        if os.listdir(dest):
            raise Fail(f"{dest} exists and is not empty")
    ws, sd, j, tree = _open_journal_and_tree(workspace, state_dir)
    try:
        # the tree as it stood, written into the workspace itself, would be a change to it
        # (drift, or the mount's own record) and a copy inside the copy at the next replay
        if _beneath(dest, ws):
            raise Fail(f"{dest} is inside the workspace {ws}: replay writes a new directory "
                       "outside it")
        # a seq past the last event is the tree as the record ends (said so below)
        j_last = j.last_seq()
        point = min(resolve_point(j, at), j_last)
        # built beside dest and renamed into place when complete: a failure leaves no dest
        full_from = f"/proc/self/fd/{tree.root_fd}" if full else None
        states = States(j, tree)
        try:
            out = do_replay(j, states, point, dest, full_from, at_time=point_time(at))
        except OSError as e:
            if e.errno == errno.EFBIG:  # under the user's `ulimit -f`
                raise Fail(f"cannot replay into {dest} (nothing written there): "
                           f"{_os_error_text(e)}") from None
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise Fail(f"cannot write {dest}: {os.strerror(e.errno)} (nothing written there: "
                       "free some room, or replay elsewhere)") from None
        out["drifted"] = states.drift()
        out["grew"] = _grew_meanwhile(j, j_last, out)
    except SelectionError as e:
        raise Fail(str(e)) from None
    finally:
        os.close(tree.root_fd)
        j.close()
    if as_json:
        click.echo(json.dumps(out))
    else:
        where = " (the last)" if point == j_last and point else \
            " (before the record's first event)" if point == 0 else ""
        click.echo(f"replayed seq {point}{where} into {shown(dest)}: {out['written']} written, "
                   f"{out['removed']} removed" + (f", {len(out['inexact'])} inexact"
                                                  if out["inexact"] else ""))
        if out["not_made"]:  # kinds this caller cannot make here (a device node, say)
            click.echo(f"not made ({len(out['not_made'])}): " + named(
                f"{n['kind']} {n['path']} ({n['why']})" for n in out["not_made"]))
        if out["unlisted"]:  # --full: a live directory this user may not list
            click.echo(f"not listed ({len(out['unlisted'])}): " + named(
                f"{n['path']} ({n['why']})" for n in out["unlisted"])
                + "; only the recorded paths beneath are given")
        if out["owners_not_set"]:
            click.echo(f"owner not set ({len(out['owners_not_set'])}): "
                       + named(out["owners_not_set"]))
        if out["grew"]:
            click.echo(f"overlayrec: the record grew by {out['grew']} event(s) while replay "
                       "read it (a mount is writing: a revert, an agent): what they changed may "
                       "show as it is now; replay again once it is quiet", err=True)
        if out["drifted"]:  # the replay shows the record; the live tree departs from it here
            click.echo(f"drifted ({len(out['drifted'])}): {', '.join(out['drifted'][:5])}"
                       + (" ..." if len(out["drifted"]) > 5 else "")
                       + " (changed outside the record; `overlayrec diff --drift` shows how)")


def _grew_meanwhile(j, last: int, out: dict) -> int:
    """How many events the record took after ``last`` while a reader read it (a mount writing
    meanwhile: a revert, an agent; ``j`` read-only, catches up); the paths they name are left
    out of ``out["drifted"]``, which compares the live tree, read later, with the record read
    before (a revert's paths read as changed outside the record)."""
    from .engines.diff import changed_since
    grew, moved = changed_since(j, last, out["drifted"])
    out["drifted"] = [p for p in out["drifted"] if p not in set(moved)]
    return grew


@main.command()
@click.argument("path")
@click.option("-w", "--workspace", help="The workspace (default: the recorded one around the "
              "current directory, else the one around PATH).")
@click.option("--at", "at", help="Only history up to this point.")
@click.option("--state-dir", type=PATH)
@click.option("--json", "as_json", is_flag=True)
@_guard
def blame(path, workspace, at, state_dir, as_json):
    """The history of one path, newest first: each run of changes with its call, turn,
    session or outside actor, the processes, the time and the size.  Deleted paths work."""
    from .engines.diff import SelectionError
    from .views import one_line, shown, unit_shown
    from .engines.replay import blame as do_blame, resolve_point
    from .engines.states import States
    ws = state.resolve_workspace(workspace or ".", must_exist=False, upward=True)
    # a path is the cwd's, as git takes it (`blame app.py` in src/, `blame ws/app.py` above
    # the workspace); a relative one that leads out of the workspace is the workspace's
    try:
        here = os.path.realpath(os.getcwd())
    except OSError:
        here = ws
    near = os.path.normpath(os.path.join(here, path))
    if not (near + "/").startswith(ws.rstrip("/") + "/") and os.path.basename(near):
        # reached through a symlinked directory (`blame $PWD/f` where $PWD is a symlink's):
        # the directories resolved, the name itself not (a symlink is blamed as itself)
        near = os.path.join(os.path.realpath(os.path.dirname(near)), os.path.basename(near))
    if workspace is None and not state.is_recorded(ws):
        # run outside any recorded workspace (`blame ws/app.py` from its parent, `blame
        # /abs/ws/app.py`): the workspace is the recorded one around the path
        ws, near = state.recorded_around(near) or (ws, near)
    rel = os.path.relpath(near, ws) if _beneath(near, ws) or os.path.isabs(path) else \
        os.path.normpath(path)
    if rel == ".." or rel.startswith("../"):  # (`..dots` is a name: found by a bug hunt)
        raise Fail(f"{path} is outside the workspace {ws}")
    _, sd, j, tree = _open_journal_and_tree(ws, state_dir)
    cut = j.cut
    try:
        rows = do_blame(j, States(j, tree), rel, resolve_point(j, at) if at else None)
    except SelectionError as e:
        raise Fail(str(e)) from None
    finally:
        os.close(tree.root_fd)
        j.close()
    if not rows:
        raise Fail(f"nothing recorded for {rel}" + (
            f" since seq {cut} (retention dropped the record before it)" if cut > 1 else ""))
    for r in rows:
        if as_json:
            click.echo(json.dumps(r))
            continue
        procs = "; ".join(f"{p['pid']} {one_line(_cut(' '.join(p['argv'] or []), 60))}"
                          for p in r["processes"])
        named = f" (as {shown(r['name'])})" if r.get("name") else ""
        guess = (" (placed in it by a guess)" if r.get("by_guess") else
                 " (placed in it by time)" if r.get("by_time") else "") + \
            (" (after the call ended)" if r.get("late") else "")
        click.echo(f"{_fmt_time(r['t_first'])} seq {r['first_seq']}-{r['last_seq']} "
                   f"{unit_shown(r['unit'])}{guess}{named}: {one_line(', '.join(r['ops']))}  "
                   f"{_blame_side(r['before'])} -> {_blame_side(r['after'])}  [{procs}]")
    if not as_json and any(not r[s].get("exact", True) for r in rows for s in ("before",
                                                                              "after")):
        click.echo("(~: a size the record does not know exactly, its nearest kept state's)",
                   err=True)


def _blame_side(side: dict) -> str:
    """A run's state before or after in blame's line: kind and size, ``~`` when the record
    does not know it exactly (diff and replay say so of such a path: 'inexact')."""
    return f"{side['kind']} {'' if side.get('exact', True) else '~'}{side['size']}B"


@main.command()
@click.argument("seq", type=SEQ1)
@click.option("-w", "--workspace", default=".")
@click.option("--state-dir", type=PATH)
@click.option("--json", "as_json", is_flag=True)
@_guard
def show(seq, workspace, state_dir, as_json):
    """One event in full: what, who (process and unit), its pre-image, and its diff."""
    from .engines.gitdiff import GitError, ObjectStore
    from .views import shown, unit_shown
    from .engines.large import over_limit
    from .engines.states import States
    from .views import human_size
    ws, sd, j, tree = _open_journal_and_tree(workspace, state_dir)
    try:
        ev = j.event(seq)
        if ev is None:
            if 1 < j.cut and seq < j.cut:  # kept seals below the cut are events still
                raise Fail(f"event {seq} was dropped by retention (the record starts at seq "
                           f"{j.cut})")
            raise Fail(f"no event {seq} (the journal holds {max(j.cut, 1)}..{j.last_seq()})")
        actor = j.actor(ev.get("actor") or "") or {}
        diff_text, vague, unshown = "", [], []
        paths = [p for p in (ev.get("path"), ev.get("path2")) if p]
        left = readers.attic_shown(j, paths[0], seq) if paths else None
        if left:  # in no tree: a diff of it read as the file's deletion
            diff_text = f"# {left}: in no tree, so no diff; its pre-image is above\n"
        elif paths:
            from .engines.diff import touched
            st = States(j, tree)
            store = ObjectStore(sd)
            # a directory's rename moves what lies beneath it too (its show gave no diff of
            # them, where diff of the event's range did; found by a bug hunt)
            every = touched(st, ev) or paths
            before = {p: st.state(p, seq - 1) for p in every}
            after = {p: st.state(p, seq) for p in every}
            try:
                a, b = store.trees(before, after)
                diff_text = store.diff(a, b, "patch")
            except GitError as e:  # the private store not writable (a full state dir)
                raise Fail(str(e)) from None
            for p in every:
                big = [s.data for s in (before[p], after[p]) if over_limit(s.data)]
                if big:
                    diff_text += (f"# {p}: a file of {human_size(max(map(len, big)))}, too "
                                  "large for a patch\n")
            # a side whose content the record could not keep (an attic entry gone) reads as
            # empty in the patch: said, as diff says it (show said nothing; found by a hunt)
            vague = [p for p in every if not (before[p].exact and after[p].exact)]
            # a mode, an owner, an empty directory ...: the patch is silent, so say it, as
            # diff does (show printed the header alone; found by a bug hunt)
            unshown = readers.event_not_in_patch(tree, before, after, ev["op"] == "drift")
    finally:
        os.close(tree.root_fd)
        j.close()
    if as_json:
        click.echo(json.dumps({"event": ev, "actor": actor, "diff": diff_text,
                               "inexact": vague,
                               "not_in_patch": [{"path": p, "change": what}
                                                for p, what in unshown]}))
        return
    if vague:
        from .views import inexact_note
        click.echo("overlayrec: " + inexact_note([shown(p) for p in vague]), err=True)
    if unshown:
        click.echo(readers.unshown_line(unshown), err=True)
    swapped = ev["op"] == "rename" and ev.get("flags", 0) & RENAME_EXCHANGE
    click.echo(f"event {seq}: {'exchange' if swapped else ev['op']} "
               f"{(' <-> ' if swapped else ' -> ').join(map(shown, paths))}"
               + (f" {left}" if left else ""))
    click.echo(f"  time:    {_fmt_time(ev['t'])}")
    click.echo(f"  unit:    {unit_shown(ev.get('unit'))}" + (" (after its call ended)"
                                                        if ev.get("after_end") else ""))
    # (escaped: a name the process was given, with an escape sequence or a newline, reached
    # the terminal raw and broke the row; found by a bug hunt)
    from .views import one_line
    click.echo(f"  process: {actor.get('pid')} {one_line(' '.join(actor.get('argv') or []))}")
    click.echo(f"  cwd:     {one_line(str(actor.get('cwd')))}")
    for k in ("pre", "pre2"):
        if ev.get(k):
            click.echo(f"  {k}:{' ' * (7 - len(k))}{json.dumps(ev[k])}")
    if diff_text:
        click.echo(diff_text, nl=False, color=True)  # a file's escapes kept


@main.command()
@_workspace_param()
@click.option("--html", "out", default="overlayrec-report.html", show_default=True,
              type=PATH, help="Where to write the page.")
@click.option("--state-dir", type=PATH)
@_guard
def report(workspace, out, state_dir):
    """A single self-contained HTML page (no network): the sessions on a time axis, a lane per
    turn and per call, one for outside writers and one for late writes of background processes,
    a mark per changed file (its diff a click away), and the files with the units that changed
    each (docs/report.md)."""
    from .engines.gitdiff import ObjectStore
    from .engines.report import report_data
    from .engines.report_html import render
    from .engines.states import States
    from .engines.gitdiff import GitError
    if not out:
        raise Fail("--html: an empty path (name the file to write the page to)")
    ws, sd, j, tree = _open_journal_and_tree(workspace, state_dir)
    real = os.path.realpath(out)
    if real == os.path.realpath(sd) or real.startswith(os.path.realpath(sd) + os.sep):
        os.close(tree.root_fd)
        j.close()
        # written over the journal itself, the record was gone (found by a bug hunt)
        raise Fail(f"{out} is inside the record's state dir {sd}: write the page elsewhere")
    try:
        store = ObjectStore(sd)
        page = render(report_data(j, States(j, tree), store, ws))
    except GitError as e:  # the private store not writable: a full or read-only state dir
        raise Fail(str(e)) from None
    finally:
        os.close(tree.root_fd)
        j.close()
    _write_page(out, page)
    click.echo(f"wrote {out}")
    for w in store.warnings:
        click.echo(f"overlayrec: git: {w}", err=True)


# -- revert ---------------------------------------------------------------------------------------

def _run_revert(ws, sd, selection, glob, yes, force, as_json, revert_id=None, unreverts=None,
                resume=None):
    """Plan, check, confirm and carry out a revert (overlayrec.reverts) through the mount,
    mounting it for the occasion when it is not; what it says is said here."""
    from . import reverts
    from .views import named, one_line, shown
    if state.is_dead_mount(ws):
        raise Fail(f"{ws} holds a dead mount; clear it with: overlayrec umount {ws}")
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(reverts.one_at_a_time(sd))
        except reverts.RevertError as e:
            raise Fail(str(e)) from None
        waiting = reverts.pending(sd)
        if resume is None and waiting is not None and unreverts != waiting["id"]:
            # planned on a half-reverted tree, and stacked above it: the pending one's
            # rollback (`unrevert`) would then undo this one instead (as Caudra, refused)
            raise Fail(f"revert {waiting['id']} was interrupted: finish it with `overlayrec "
                       "revert --continue` or roll it back with `overlayrec unrevert` first")
        if not state.fuse_mount_at(ws):
            _output_outlives_its_reader()  # a closed pipe must not leave the mount behind
            for sig in (signal.SIGTERM, signal.SIGHUP):  # nor a kill: stopped as by Ctrl-C
                signal.signal(sig, _terminated)
            from .mounting import one_mounter
            with one_mounter(sd):  # a `run` starting meanwhile joins this mount
                if not state.fuse_mount_at(ws):
                    _spawn_daemon(ws, sd, for_this=True, registry=False)
                    held.callback(_release_mount, ws, sd)  # once the revert is done
        src = reverts.Sources(ws, sd, _tree_for(ws, sd))
        held.callback(src.close)
        try:
            plan = reverts.plan_for(src, selection, glob, revert_id, resume)
        except reverts.RevertError as e:
            raise Fail(str(e)) from None
        running = []
        if resume is None:
            # a descriptor of what it undoes still open for writing (a background process
            # the call left, after the `run` ended): its path refused, its holder named
            holders = reverts.held_open(src.j, plan, reverts.open_writes(sd), src.live)
            if force:  # what lies beneath a directory it leaves, its way blocked
                reverts.blocked_beneath_conflicts(plan, src.live)
            running = reverts.still_running(src.j, plan, _call_processes(sd) + holders,
                                            _ancestors(os.getpid()))
        preview = reverts.preview(plan)
        preview["still_running"] = running
        if not as_json:  # the call's changes may hold another's, or miss one of its own
            for line in readers.guess_lines(plan):
                click.echo(line, err=True)
            if running:  # a server a call started: said, not refused
                click.echo(f"overlayrec: warning: {len(running)} process(es) of what this "
                           f"reverts still run ({'; '.join(map(one_line, running[:3]))}"
                           f"{' ...' if len(running) > 3 else ''}): what they write next "
                           "follows the revert (stop them first for a revert that holds)",
                           err=True)
        if as_json and plan.steps and not (yes and (not plan.conflicts or force)):
            click.echo(json.dumps(preview))
        elif not as_json:
            for s in plan.steps:
                mark = f"  CONFLICT ({s.conflict}" + (f": {s.note}" if s.note else "") \
                    + ")" if s.conflict else f"  ({s.note})" if s.note else ""
                back = f" (from {shown(s.moved_from)})" if s.moved_from is not None else ""
                click.echo(f"  {reverts.describe(s):<8} {shown(s.path)}{back}{mark}")
        if plan.already and not as_json:
            click.echo(f"overlayrec: {len(plan.already)} path(s) were put back already by "
                       f"an earlier revert: {named(map(shown, plan.already))}", err=True)
        for pairs, what, then in (
                (plan.moved_from_outside, "removes came by a rename from a name --path leaves "
                 "out, which it does not put back", ""),
                (plan.moved_to_outside, "makes again were moved by a rename to a name --path "
                 "leaves out, which stays", "they come back as copies; ")):
            if pairs and not as_json:  # --path took one side of a rename
                old, new = pairs[0]
                click.echo(f"overlayrec: warning: {len(pairs)} path(s) this {what} "
                           f"({shown(old)} -> {shown(new)}{' ...' if len(pairs) > 1 else ''}): "
                           f"{then}name both sides of the rename to move them back", err=True)
        if plan.kept_objects and not as_json:
            click.echo(f"overlayrec: {len(plan.kept_objects)} git object(s) this made stay: "
                       "their repository was changed since by what is not reverted (a branch, "
                       "a tag, the index may name them; `git gc` drops them once nothing does)",
                       err=True)
        if not plan.steps:  # with --json one object that says so, nothing after it
            click.echo(json.dumps(dict(preview, result="nothing to revert")) if as_json else
                       "nothing to revert")
            return
        if resume is not None:
            if plan.changed_since and not force:
                raise Fail(f"not carried on: {len(plan.changed_since)} path(s) changed since "
                           f"the interrupted revert began ({named(map(shown, plan.changed_since))}"
                           "): `overlayrec revert --continue --force` carries it on and leaves "
                           "them as they are; `overlayrec unrevert` rolls it back")
        elif plan.conflicts and not force:
            raise Fail(reverts.refusal(plan, ws))
        if not yes:
            if not (sys.stdin.isatty() and click.confirm(
                    f"revert {len(plan.steps) - len(plan.conflicts)} path(s)?")):
                if not as_json:
                    click.echo("preview only: run again with --yes to revert")
                return
        if resume is None:  # before the plan is saved: a refusal here changes nothing
            try:
                reverts.check_room(ws, plan, src.under.root_fd)
            except reverts.RevertError as e:
                raise Fail(str(e)) from None
        progress = readers.Progress("reverting", not as_json)
        try:
            rec = reverts.carry_out(ws, sd, plan, src.content, unreverts=unreverts,
                                    resume=resume, progress=progress, secret=src.secret())
        except reverts.RevertError as e:
            raise Fail(str(e)) from None
        except KeyboardInterrupt as e:  # Ctrl-C, or a kill while it mounted (resumable)
            err = Fail("interrupted: `overlayrec revert --continue` carries the rest out, "
                       "`overlayrec unrevert` undoes what it did")
            err.exit_code = 128 + e.signum if isinstance(e, _Stopped) else 130
            raise err from None
        finally:
            progress.done()
        line, errors = reverts.outcome(plan, rec, unreverts)
        if as_json:
            click.echo(json.dumps(dict(preview, done=rec["done"], status="done",
                                       failed=rec["failed"], unmet=rec["unmet"])))
        else:
            click.echo(line)
        if errors:  # a path the revert could not make whole is never a silent success
            raise Fail("; and ".join(errors))


@main.command()
@_workspace_param()
@click.option("--call", "call_id", help="Revert this call.")
@click.option("--turn", "turn_sel", type=TURN,
              help="Revert this turn: its calls and the agent's own changes in it, not another "
              "writer's (N, last, -1 ...).")
@click.option("--session", "sid", type=ID,
              help="Revert this session (or: narrows --call/--turn); last: the session "
              "begun last.")
@click.option("--since", type=SEQ0,
              help="Revert everything recorded after this sequence number.")
@click.option("--path", "glob", multiple=True,
              help="Only this path, the paths beneath it, or those matching this glob "
              "(* crosses /; relative to the current directory inside the workspace, to its "
              "root from outside it); repeatable: any of them.")
@click.option("--yes", is_flag=True, help="Carry it out (default: preview only).")
@click.option("--force", is_flag=True, help="Revert the paths without conflicts, report the rest "
              "(with --continue: carry on past the paths changed since the revert began).")
@click.option("--continue", "cont", is_flag=True, help="Finish an interrupted revert.")
@click.option("--json", "as_json", is_flag=True)
@click.option("--state-dir", type=PATH)
@_guard
def revert(workspace, call_id, turn_sel, sid, since, glob, yes, force, cont, as_json, state_dir):
    """Put back what a call, a turn, a session or everything since a point changed.

    Previews by default; every path is checked first (changed since, interleaved with another
    writer, unrecorded) and one conflict refuses the whole revert unless --force.  Once
    done, every path written is read back: one that does not hold what was put back (another
    process wrote it meanwhile) is named, and the exit is 1."""
    from . import reverts
    ws = state.resolve_workspace(workspace, upward=True)
    try:
        glob = readers.workspace_glob(ws, glob)
    except readers.Refusal as e:
        raise Fail(str(e)) from None
    sd = _state_dir_for(ws, state_dir)
    if cont and glob is not None:
        raise Fail("--continue carries on the revert as it was planned: it takes no --path")
    if cont:
        rec = reverts.pending(sd)
        if rec is None:
            raise Fail("no interrupted revert to continue")
        _run_revert(ws, sd, rec["selection"], None, True, force, as_json, resume=rec,
                    unreverts=rec.get("unreverts"))  # an unrevert carried on says so
        return
    selection = {"call": call_id, "turn": turn_sel, "session": sid, "since": since}
    if sum(v is not None for k, v in selection.items() if k != "session") > 1:
        raise Fail("choose one of --call, --turn, --since")
    if not any(v is not None for v in selection.values()):
        raise Fail("say what to revert: --call ID, --turn N, --session S or --since SEQ")
    _run_revert(ws, sd, selection, glob, yes, force, as_json)


@main.command()
@click.argument("revert_id", required=False)
@click.option("-w", "--workspace", default=".")
@click.option("--yes", is_flag=True, help="Carry it out (default: preview only).")
@click.option("--force", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@click.option("--state-dir", type=PATH)
@_guard
def unrevert(revert_id, workspace, yes, force, as_json, state_dir):
    """Undo a revert (by default the newest one not yet undone), with the same checks; an
    interrupted revert is rolled back the same way.  Reverts stack; unreverts peel them, newest
    first.  An unrevert is undone only when REVERT_ID names it."""
    from . import reverts
    if revert_id is not None and workspace == "." and os.path.isdir(revert_id):
        # `unrevert WS`, as revert and the readers take a workspace (a revert's id is a time
        # and a random tag, no directory's name)
        workspace, revert_id = revert_id, None
    ws = state.resolve_workspace(workspace, upward=True)
    sd = _state_dir_for(ws, state_dir)
    try:
        target = reverts.to_undo(sd, revert_id)
    except reverts.RevertError as e:
        raise Fail(str(e)) from None
    _run_revert(ws, sd, {"revert_id": target["id"]}, None, yes, force, as_json,
                unreverts=target["id"])
    if yes:
        reverts.rolled_back(sd, target)


# -- retention ------------------------------------------------------------------------------------

@main.command()
@_workspace_param()
@click.option("--keep-last", type=click.IntRange(min=0), metavar="N",
              help="Keep the N most recent sessions.")
@click.option("--keep-within", type=_Duration(), metavar="DURATION",
              help="Keep every session active within DURATION (30d, 12h, 2w; s m h d w).")
@click.option("--max-bytes", "max_bytes", type=_Size(), metavar="SIZE",
              help="Drop the oldest sessions until the record takes at most SIZE (K/M/G).")
@click.option("--let-go-reverts", is_flag=True,
              help="Done reverts no longer keep the sessions an unrevert of them would read: "
              "the ones the cut passes (and every older one) are let go, and can no longer be "
              "unreverted.  A pending revert is always kept.")
@click.option("--dry-run", is_flag=True, help="Print the plan (each session, drop or keep and "
              "why) and change nothing.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.option("--state-dir", type=PATH)
@_guard
def gc(workspace, keep_last, keep_within, max_bytes, let_go_reverts, dry_run, as_json,
       state_dir):
    """Drop the oldest sessions of WORKSPACE's record by policy, whole sessions, oldest first,
    and free what only they used (blobs, attic entries, journal pages).

    A session is kept when a rule keeps it (--keep-last, --keep-within); with --max-bytes the
    oldest go until the record fits.  Always kept: the live session, pinned sessions (overlayrec
    pin), and sessions a pending revert, or one that can still be unreverted, reaches into
    (with --let-go-reverts, a pending one only; a mount's --max-bytes budget lets go of done
    reverts too).  Without a rule nothing is dropped (an interrupted gc is finished, orphans
    swept).  Mounted, the daemon runs it; see docs/retention.md."""
    from . import retention
    ws = state.resolve_workspace(workspace, must_exist=False, upward=True)
    sd = _state_dir_for(ws, state_dir)
    policy = retention.Policy(keep_last, keep_within, max_bytes, let_go_reverts)
    if state.fuse_mount_at(ws) and not state.is_dead_mount(ws):
        from . import client
        try:
            with client.Client(state.StateDir(sd).control_sock, timeout=3600) as c:
                out = c.request("gc", dry_run=dry_run or None, **policy.to_json())
        except client.ClientError as e:
            raise Fail(str(e)) from None
        out.pop("ok", None)
    else:
        try:
            out = retention.gc_unmounted(ws, sd, policy, dry_run)
        except retention.RetentionError as e:
            raise Fail(str(e)) from None
    if as_json:
        click.echo(json.dumps(out))
        return
    for r in out.get("sessions", []):
        span = f"seq {r['begin_seq']}-{r['end_seq']}" if r.get("begin_seq") else "seq ?"
        when = _fmt_time(r["started"])[:16] if r.get("started") else "?"
        click.echo(f"  {r['action']:<4} {r['session']:<20} {when}  {span:<16} {r['why']}")
    before = out.get("size_before") or {}
    if out.get("let_go"):
        click.echo(f"{'would let' if dry_run else 'let'} go of {len(out['let_go'])} revert(s), "
                   f"which can no longer be unreverted: {', '.join(out['let_go'])}")
    if dry_run:
        est = out.get("size_after_estimate") or {}
        n = sum(r["action"] == "drop" for r in out.get("sessions", []))
        click.echo(f"dry run: would drop {n} session(s); the record would start at seq "
                   f"{max(out.get('cut') or 1, 1)}; about {_mib(before.get('total', 0))} -> "
                   f"{_mib(est.get('total', 0))}"
                   # the journal's pages after a cut are estimated; the gc measures them
                   + ("; an estimate: the gc itself measures after each drop and drops more "
                      "while over the budget" if out.get("budget") is not None else ""))
    else:
        after = out.get("size_after") or {}
        sw = out.get("swept") or {}
        click.echo(f"dropped {len(out.get('dropped') or [])} session(s)"
                   + (f"; the record starts at seq {out.get('record_starts')}" if out.get("cut")
                      else "")
                   + f"; removed {sw.get('blobs', 0)} blob(s) and {sw.get('attic', 0)} attic "
                   f"entr{'y' if sw.get('attic', 0) == 1 else 'ies'}; "
                   f"{_mib(before.get('total', 0))} -> {_mib(after.get('total', 0))}")
        comp = out.get("compaction") or {}
        if comp.get("compacted"):
            click.echo(f"journal compacted: {_mib(comp['before'])} -> {_mib(comp['after'])}")
        elif comp.get("why"):
            click.echo(f"journal not compacted: {comp['why']}")
        ex = out.get("exports") or {}
        if ex.get("bytes_after") is not None:
            click.echo(f"private git store (diffs, exports): {_mib(ex['bytes_before'])} -> "
                       f"{_mib(ex['bytes_after'])}"
                       + (f", {ex['refs']} export ref(s) of dropped sessions deleted"
                          if ex.get("refs") else ""))
    if out.get("over_budget"):
        click.echo(f"overlayrec: still over the budget of {_mib(max_bytes)}: "
                   f"{out['over_budget']}", err=True)


def _pin(session_id: str, workspace: str, state_dir, pinned: bool) -> None:
    from . import retention
    ws = state.resolve_workspace(workspace, must_exist=False, upward=True)
    sd = _state_dir_for(ws, state_dir)
    if session_id == "last" and os.path.exists(os.path.join(sd, "journal", "data.mdb")):
        from .engines.diff import SelectionError, session_named
        j = Journal(sd, readonly=True)
        try:
            session_id = session_named(j, session_id)
        except SelectionError as e:
            raise Fail(str(e)) from None
        finally:
            j.close()
    if state.fuse_mount_at(ws) and not state.is_dead_mount(ws):
        from . import client
        try:  # mounted: the daemon alone writes the journal
            with client.Client(state.StateDir(sd).control_sock) as c:
                out = c.request("pin" if pinned else "unpin", session=session_id)
        except client.ClientError as e:
            raise Fail(str(e)) from None
        click.echo(out["message"])
        return
    if not os.path.exists(os.path.join(sd, "journal", "data.mdb")):
        raise Fail(f"{ws} is not recorded (no journal in {sd})")
    try:
        lock = retention.writer_lock(sd)
        try:
            j = Journal(sd)
            try:
                click.echo(retention.set_pin(j, session_id, pinned))
            finally:
                j.close()
        finally:
            os.close(lock)
    except retention.RetentionError as e:
        raise Fail(str(e)) from None


@main.command()
@click.argument("session_id", metavar="SESSION", type=ID)
@click.option("-w", "--workspace", default=".")
@click.option("--state-dir", type=PATH)
@_guard
def pin(session_id, workspace, state_dir):
    """Keep SESSION whatever a gc's policy says (until overlayrec unpin); last: the session
    begun last."""
    _pin(session_id, workspace, state_dir, True)


@main.command()
@click.argument("session_id", metavar="SESSION", type=ID)
@click.option("-w", "--workspace", default=".")
@click.option("--state-dir", type=PATH)
@_guard
def unpin(session_id, workspace, state_dir):
    """Let a gc drop SESSION again when its policy says so."""
    _pin(session_id, workspace, state_dir, False)


@main.group()
def export():
    """Write the journal out in another format."""


@export.command(name="git")
@_workspace_param()
@click.option("--repo", type=PATH, help="Write into this repository (default: a private "
              "object store in the state dir).")
@click.option("--ref-prefix", type=ID, default="refs/overlayrec", show_default=True)
@click.option("--push", "remote", help="Then send the refs to this git remote (a path or URL "
              "git understands) under refs/overlayrec/origins/<origin>/: only what it lacks.")
@click.option("--origin", "origin", help="The name this workspace's records take on the remote "
              "(default: <host>-<workspace>-<random>, kept in the state dir).")
@click.option("--state-dir", type=PATH)
@click.option("--json", "as_json", is_flag=True)
@_guard
def export_git(workspace, repo, ref_prefix, remote, origin, state_dir, as_json):
    """One commit per call (its parent: the state before it), one per turn end, refs under
    <prefix>/<session>/{calls,turns}/ and <session>/head.  Incremental: a second run writes
    only what is new.  The workspace's own repository is never written.  --push sends them
    on (docs/export.md: records that travel)."""
    import contextlib
    import hashlib
    from .engines.export import Exporter
    from .engines.gitdiff import ObjectStore, GitError
    from .engines.states import States
    if not ref_prefix.startswith("refs/"):
        raise Fail("--ref-prefix must start with refs/")
    ws, sd, j, tree = _open_journal_and_tree(workspace, state_dir)
    try:
        if repo:
            git_dir = _own_repository_refused(ws, repo)
            store = ObjectStore(sd, git_dir=git_dir)
        else:
            with state.private_umask():  # the private store is the user's alone
                store = ObjectStore(sd)
        tag = hashlib.sha256(f"{store.git_dir}\0{ref_prefix}".encode()).hexdigest()[:12]
        state_file = state.StateDir(sd).export_state(tag)
        ex = Exporter(j, States(j, tree), store, state_file, ref_prefix, shared=bool(repo))
        tty = sys.stderr.isatty() and not as_json
        with state.private_umask() if not repo else contextlib.nullcontext():
            out = ex.run(progress=(lambda sid, n, total: click.echo(
                f"\r{sid}: {n}/{total}", nl=False, err=True)) if tty else None)
        state.tighten(state_file)  # 0600 also when --repo left the umask to the user's
        if tty:
            click.echo("", err=True)
        out["git_dir"] = store.git_dir
        out["git_warnings"] = store.warnings
        if remote:
            from .engines.travel import origin_name, push
            local = remote[len("file://"):] if remote.startswith("file://") else remote
            if os.path.isdir(local):  # (a path or a file:// URL: the workspace's own was
                # pushed into; found by bug hunts)
                _own_repository_refused(ws, local)
            name = origin_name(state.StateDir(sd).export_state("origin"), ws, origin)
            out["push"] = push(store.git_dir, ref_prefix, remote, name)
        if as_json:
            click.echo(json.dumps(out))
        else:
            click.echo(f"wrote {out['commits']} commit(s) for {out['sessions']} session(s) "
                       f"into {store.git_dir} (refs under {ref_prefix}/)")
            if remote:
                p = out["push"]
                click.echo(f"pushed to {remote} as {p['refs_prefix']}: {len(p['new'])} new "
                           f"ref(s), {len(p['updated'])} moved, {p['up_to_date']} up to date")
        _say_left_out(out["git_left_out"], store, "exported")
        from .views import shown
        for sid, unsure in out["unsure_bases"].items():
            click.echo(f"overlayrec: session {sid}'s base holds {len(unsure)} file(s) the "
                       "record never saw as they are now, not as they stood: changed after it "
                       "began, while unmounted (" + ", ".join(map(shown, unsure[:3]))
                       + (" ..." if len(unsure) > 3 else "") + ")", err=True)
    except GitError as e:
        raise Fail(str(e)) from None
    finally:
        os.close(tree.root_fd)
        j.close()


# -- records that travel --------------------------------------------------------------------------

@main.command()
@click.argument("remote")
@click.option("--into", type=PATH, help="A bare repository to hold them (made when "
              "missing; default: records.git in overlayrec's state home).")
@click.option("--json", "as_json", is_flag=True)
@_guard
def fetch(remote, into, as_json):
    """Bring the records other hosts pushed (`export git --push`) from REMOTE: every origin's
    refs under refs/overlayrec/origins/.  `overlayrec records ...` reads them."""
    from .engines.gitdiff import GitError
    from .engines.travel import fetch as do_fetch, default_records_dir
    if into:
        target = os.path.realpath(into)
        ws = state.recorded_at_or_above(target)
        if state.overlayrec_mount_containing(target) is not None or state._known(ws):
            # its refs were written into the workspace's own repository (`--into WS/.git`,
            # through a link too), which `export git --repo` refuses (found by a bug hunt)
            raise Fail(f"{into} is inside the recorded workspace {ws}: fetch into a "
                       "directory outside it")
    try:
        out = do_fetch(remote, into or default_records_dir(), private=not into)
    except GitError as e:
        raise Fail(str(e)) from None
    if as_json:
        click.echo(json.dumps(out))
    else:
        click.echo(f"fetched {out['sessions']} session(s) of {len(out['origins'])} origin(s) "
                   f"into {out['into']}")


@main.group()
def records():
    """Read fetched records from git alone (no journal): list, diff, blame, report."""


def _records(git_dir):
    from .engines.travel import Records, default_records_dir
    return Records(git_dir or default_records_dir())


_GIT_OPT = click.option("--git", "git_dir", type=PATH,
                        help="The repository holding the records (default: where `overlayrec "
                        "fetch` puts them).")


@records.command(name="list")
@_GIT_OPT
@click.option("--json", "as_json", is_flag=True)
@_guard
def records_list(git_dir, as_json):
    """The origins and sessions held, with their calls and turns."""
    from .engines.gitdiff import GitError
    try:
        recs = _records(git_dir)
    except GitError as e:
        raise Fail(str(e)) from None
    rows = [{"origin": o, "session": sid, "calls": len(s["calls"]), "turns": len(s["turns"]),
             "head": s["head"]} for (o, sid), s in sorted(recs.sessions.items())]
    for r in rows:
        click.echo(json.dumps(r) if as_json else
                   f"{r['origin']}  {r['session']}  {r['turns']} turn(s), {r['calls']} call(s)")


@records.command(name="diff")
@_GIT_OPT
@click.option("--origin", help="The origin (when several hold the selection).")
@click.option("--session", "sid", type=ID)
@click.option("--call", "call_id")
@click.option("--turn", "turn_sel", type=TURN)
@click.option("--stat", "fmt", flag_value="stat")
@click.option("--numstat", "fmt", flag_value="numstat")
@click.option("--name-status", "fmt", flag_value="name-status")
@click.option("--patch", "fmt", flag_value="patch", default=True)
@click.option("--binary", is_flag=True)
@_guard
def records_diff(git_dir, origin, sid, call_id, turn_sel, fmt, binary):
    """What a call, a turn or a session changed, as `overlayrec diff` printed it on its origin."""
    from .engines.gitdiff import GitError
    from .engines.travel import SelectionError
    if call_id is not None and turn_sel is not None:
        raise Fail("choose one of --call, --turn")
    if call_id is None and turn_sel is None and sid is None:
        raise Fail("say what to diff: --call ID, --turn N or --session S")
    try:
        recs = _records(git_dir)
        click.echo(recs.diff(fmt, binary, origin=origin, session=sid, call=call_id,
                             turn=turn_sel), nl=False, color=True)  # a file's escapes kept
        vague = recs.inexact(origin, sid, call_id) if call_id is not None else []
        if vague:  # as `overlayrec diff` said on the origin
            from .views import inexact_note
            click.echo("overlayrec: " + inexact_note(vague), err=True)
    except (GitError, SelectionError) as e:
        raise Fail(str(e)) from None


@records.command(name="blame")
@click.argument("path")
@_GIT_OPT
@click.option("--origin", help="Only this origin's history of the path.")
@click.option("--json", "as_json", is_flag=True)
@_guard
def records_blame(path, git_dir, origin, as_json):
    """Each exported commit that changed PATH (relative to its workspace), newest first."""
    from .engines.gitdiff import GitError
    from .views import one_line, unit_shown
    try:
        rows = _records(git_dir).blame(os.path.normpath(path), origin)
    except GitError as e:
        raise Fail(str(e)) from None
    if not rows:
        raise Fail(f"nothing exported changed {path}")
    for r in rows:
        if as_json:
            click.echo(json.dumps(r))
            continue
        click.echo(one_line(
            f"{_fmt_time(r['t'])} {r['origin']} seq {r['first_seq']}-{r['last_seq']} "
            f"{unit_shown(r['unit'])}: {r['subject']}  "
            f"{r['before']['kind']} {r['before']['size']}B "
            f"-> {r['after']['kind']} {r['after']['size']}B  "
            f"[{'; '.join(_cut(p, 60) for p in r['processes'])}]"))


def _own_repository_refused(ws: str, repo: str) -> str:
    """The git dir of the repository ``repo`` names, refused (Fail) where it is not a
    repository's own directory, or is the workspace's own repository (or one inside it):
    its refs written, the export in the user's `git log --all`.  For `export git --repo` and
    `--push` to a local path."""
    import subprocess
    # git walks up from a directory (across the mount's boundary too, as the user's
    # git does from outside it): a directory inside a repository names that one,
    # which may be the workspace's own (its refs written, against the promise)
    env = dict(os.environ, GIT_DISCOVERY_ACROSS_FILESYSTEM="1")

    def rev_parse(where: str, *what: str) -> str | None:
        r = subprocess.run(["git", "-C", where, "rev-parse", *what], env=env,
                           capture_output=True, text=True)
        return os.path.realpath(r.stdout.strip()) if r.returncode == 0 else None

    def common(where: str) -> str | None:  # the refs a worktree shares
        return rev_parse(where, "--path-format=absolute", "--git-common-dir")
    git_dir = rev_parse(repo, "--absolute-git-dir")
    if git_dir is None:
        raise Fail(f"{repo} is not a git repository")
    top = rev_parse(repo, "--show-toplevel")  # none for a bare repository
    if os.path.realpath(repo) not in {git_dir, top}:
        raise Fail(f"{repo} is not a git repository itself: it lies in "
                   f"{top or git_dir}; name a repository's own directory")
    # the workspace's own: its .git, the one above it, and where a worktree's .git
    # file leads (its gitdir, and the repository whose refs it shares: a hunt found
    # the export's refs in the user's `git log --all`)
    own = {os.path.realpath(os.path.join(ws, ".git")),
           rev_parse(os.path.dirname(ws), "--absolute-git-dir"),
           rev_parse(ws, "--absolute-git-dir"), common(ws)} - {None}
    # and a repository whose work tree holds the workspace wherever its git dir is
    # (core.worktree: a hunt found the export in the user's `git log --all`)
    if git_dir in own or common(repo) in own or \
            git_dir.startswith(os.path.realpath(ws).rstrip("/") + "/") or \
            (top is not None and _beneath(ws, top)):
        raise Fail("refusing to write into the workspace's own repository (or one "
                   "inside it); name another one, or leave --repo out")
    return git_dir


@records.command(name="report")
@_GIT_OPT
@click.option("--html", "out", default="overlayrec-records.html", show_default=True,
              type=PATH, help="Where to write the page.")
@_guard
def records_report(git_dir, out):
    """A self-contained HTML page of every fetched session: turns, calls, their files and
    diffs, and the changes between calls."""
    from .engines.gitdiff import GitError
    from .engines.travel import render
    try:
        page = render(_records(git_dir).report_data())
    except GitError as e:
        raise Fail(str(e)) from None
    if not out:
        raise Fail("--html: an empty path (name the file to write the page to)")
    _write_page(out, page)
    click.echo(f"wrote {out}")


def _write_page(out: str, page: str) -> None:
    """An HTML page written to a temp file beside ``out`` (0600: it holds the record's
    content) and renamed over it: a symlink or a hard link at ``out`` is replaced, never
    written through (a link an agent planted in the workspace sent the page over a file
    outside it, root's too; a hard link to the journal, over the journal).  Not into an
    attic (over a kept pre-image).  Found by bug hunts."""
    import tempfile
    from .engines.states import ATTIC as ATTIC_NAME
    if out.endswith("/") or os.path.isdir(out):
        raise Fail(f"cannot write {out}: Is a directory (name the file to write the page to)")
    real = os.path.realpath(os.path.dirname(os.path.abspath(out)))
    if ATTIC_NAME in real.split(os.sep):
        raise Fail(f"{out} is inside a workspace's attic ({ATTIC_NAME}): write the page "
                   "elsewhere")
    try:
        fd, tmp = tempfile.mkstemp(dir=real, prefix=".overlayrec-page.", suffix=".tmp")
    except OSError as e:
        raise Fail(f"cannot write {out}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, os.path.join(real, os.path.basename(out)))
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise Fail(f"cannot write {out}: {e.strerror}") from None


if __name__ == "__main__":
    main()
