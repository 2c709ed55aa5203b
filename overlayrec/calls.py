"""Sessions, turns and tool calls, and the rules that tie every actor to one of them.

This is the second half of attribution (``attribution`` names the process; this names its
*unit*).  A unit is what an epoch is keyed by and what a diff or a revert selects:

* ``call:<session>:<id>``: a tool call, announced by the agent's hooks or implicit (each direct
  child process of an agent that announces nothing is a call of its own, named by its argv);
* ``turn:<session>:<n>`` / ``session:<session>``: the agent process's own writes outside any call;
* ``outside:<actor>``: a process that does not descend from any agent (the user's editor, cron).

Rules (each has a test):
* a process descending from an agent belongs to the call during which the agent's direct child
  at the top of its line was started: a shell command, its children, and a background process
  that outlives the call (whose later writes are marked ``after_end``; so are the writes of
  what it starts after its session ended, placed below it: ``lineage``; under a later mount
  too, by the call its actor row keeps: ``_held_unit``).  When no call started that child (a
  persistent shell the agent sends each command to), the highest process below it that a call
  started decides, and a write by the shell itself goes to the call active
  then (``chosen``: ``during``), else to the turn or session as it is at that write.  Start times come from
  /proc (clock ticks since boot); a tick shared by two calls is settled by the snapshots of the
  agent's children taken at each call's begin and end;
* the agent's own writes belong to the call active when the file was opened;
* when several calls were active together (an agent that runs tools in parallel), the evidence
  chooses among them (``Calls._choose``): the call whose command the process's argv carries, or
  whose path the agent's own write names; without evidence, the newest of them (a tool's
  process is started right after its call is announced).  The event names every candidate and
  how its call was chosen (``chosen``: ``command``, ``path``, ``newest``), so readers can say
  which changes were placed by a guess;
* processes are (pid, start time), so pid reuse cannot move a write to another call;
* an implicit call ends when its processes have all exited (the agent's child at the top of its
  line and every descendant seen: attributed writers, children found in /proc, and orphans the
  runner adopted, placed by start time), or at its session's end at the latest.  The daemon
  checks every few tenths of a second (``end_exited_calls``); later writes are ``after_end``;
* a turn the agent's stop ended is taken up again, until the next prompt, by a call it begins,
  its own write, or its stop after a blocked one (a stop hook of the user's may block a stop:
  the agent goes on in the same turn), and ends at its last stop (``take_up``);
* the hooks of another agent that one of a session's calls runs (``codex exec`` in a Bash
  call) change nothing: all it does is that call's (``nested``).

Every unit's end, once journaled, is passed to ``Calls.on_unit_end`` (when set) as its key.

State lives in memory for the live daemon and is journaled (records in ``sessions``, ``turns``,
``calls``; control events in ``events``) for everything that reads it later.
"""
from __future__ import annotations

import logging
import os
import re
import time
import uuid
from typing import Callable

from .attribution import Attribution, alive, live_stat, proc_start_and_ppid, read_actor
from .journal import Journal, JournalError
from .journal.schema import (call_key, call_unit, outside_unit, parse_unit, revert_unit,
                             session_unit, turn_key, turn_unit, unit_session)
from .state import boot_id

log = logging.getLogger(__name__)

HZ = os.sysconf("SC_CLK_TCK")
SHELLS = {"sh", "bash", "dash", "zsh", "fish", "ksh", "busybox", "env", "timeout", "nice"}
# what hosts the user's terminals: every pane, tab or login is its descendant, so none is an
# agent (agent_for_hook takes the shell below it: the one the session was begun from)
TERMINAL_HOSTS = {
    "tmux", "screen", "SCREEN", "zellij", "abduco", "dtach", "mosh-server", "sshd",
    "sshd-session", "login", "systemd", "init", "gnome-terminal-server", "gnome-terminal",
    "konsole", "xterm", "uxterm", "kitty", "alacritty", "wezterm", "wezterm-gui", "foot",
    "terminator", "tilix", "urxvt", "rxvt", "st", "xfce4-terminal", "mate-terminal",
    "lxterminal", "qterminal", "guake", "yakuake", "terminology", "ghostty", "warp-terminal"}
# what a command's words are compared without: the quoting an agent wraps it in (Claude Code
# runs `bash -c -l "... eval '<command>' ..."`, escaping the command's own quotes)
_QUOTING = str.maketrans("", "", "'\"\\")
_WORD = re.compile(r"\S+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.translate(_QUOTING))


def _carries(argv: list[str], command: str) -> int:
    """How many words of ``command`` the argv carries in a row (0: not all of them).  The
    command's last word may be cut short (a summary is a line of at most 200 characters)."""
    want = _words(command)
    if not want:
        return 0
    have = _words(" ".join(argv))
    n = len(want)
    for i in range(len(have) - n + 1):
        if have[i:i + n - 1] == want[:-1] and have[i + n - 1].startswith(want[-1]):
            return n
    return 0


# what our hook command's interpreter runs (agents.hook_command): `python -S -c CODE hook NAME`
_HOOK_CODE = "from overlayrec.entry import main"


def is_overlayrec(argv: list[str]) -> bool:
    """Is this command line overlayrec's own (its script, ``python -m overlayrec``, our hook's
    ``python -c``)?  Only by what runs, not by a word anywhere in it: an agent asked to "fix
    the overlayrec tests", or started in ~/src/overlayrec, was skipped as ours, and the
    terminal above it taken for the agent (its other processes' writes put in the turn)."""
    if not argv:
        return False
    if os.path.basename(argv[0]) == "overlayrec":
        return True
    args = iter(argv[1:])
    for a in args:  # the interpreter's options, up to what it runs
        if a == "-m":
            mod = next(args, "")
            return mod == "overlayrec" or mod.startswith("overlayrec.")
        if a == "-c":
            return _HOOK_CODE in next(args, "")
        if a in ("-X", "-W", "-Q"):
            next(args, None)  # an option's value
        elif not a.startswith("-"):  # the script: ours is installed as `overlayrec`
            return os.path.basename(a) == "overlayrec"
    return False


# the longest session name taken (its calls' keys, the name and a 17-byte digest, stay
# within LMDB's 511 bytes a key, with room for the ".2" a second run of one name gets)
MAX_SESSION_NAME = 400


class ControlError(Exception):
    """A control request that cannot be honoured; the message goes back to the caller."""


def _keepable(**texts) -> None:
    """Refuse (ValueError, a bad request) text the journal cannot keep, before anything of
    the request is journaled: a lone surrogate (but a byte that was not UTF-8, U+DC80..U+DCFF)
    failed as the record was written, after the begin's event, and the turn or call was in the
    log and in the daemon but in no record.  The control endpoint makes a request's text
    keepable first (control.checked); this holds for any other caller."""
    for name, text in texts.items():
        if text is not None and not text.isascii():
            try:
                text.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                raise ValueError(f"{name} must be UTF-8 text") from None


def boot_ticks() -> int:
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * HZ)


def _child_pids(pid: int) -> list[int]:
    """The pids of a process's direct children (every thread's), from /proc."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def descendants_of(pid: int, limit: int = 10_000) -> set[str]:
    """Actor keys (pid:start) of every live descendant of a process, from /proc."""
    out: set[str] = set()
    todo, seen = _child_pids(pid), set()
    while todo and len(seen) < limit:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        st = proc_start_and_ppid(c)
        if st is not None:
            out.add(f"{c}:{st[0]}")
            todo.extend(_child_pids(c))
    return out


def _session_tree(s: "Session") -> set[str]:
    """The live processes of a session's tree at a call's begin or end: every descendant of
    its runner (the agent, and the orphans the runner adopted), else of its agent.  Not only
    the agent's children: an orphan is placed by its own start time (``lineage``), and one
    started in the tick a call ended or the next began is settled by these snapshots."""
    top = s.runner or s.agent
    return descendants_of(top["pid"]) if top is not None else set()


def _with_below(chain: list[dict], above: int) -> dict:
    """The agent's child of a line walked up from a writer (``chain``: the writer first, then
    its ancestors; the child is ``above`` from the end), with the keys of the processes below
    it, top-down (``below``)."""
    child = chain[-above]
    below = [c["key"] for c in reversed(chain[:len(chain) - above])]
    return dict(child, below=below) if below else child


def live_children_of(pid: int) -> dict[str, int]:
    """{actor key: pid} of a process's direct children that have not exited, from /proc."""
    out = {}
    for c in _child_pids(pid):
        st = live_stat(c)
        if st is not None:
            out[f"{c}:{st[0]}"] = c
    return out


class Call:
    __slots__ = ("session", "id", "tool", "summary", "turn", "begin_t", "end_t", "begin_tick",
                 "end_tick", "status", "before", "at_end", "implicit", "begin_seq", "end_seq",
                 "procs")

    def __init__(self, session: "Session", call_id: str, tool: str, summary: str | None,
                 implicit: bool = False):
        self.session = session
        self.id = call_id
        self.tool = tool
        self.summary = summary
        self.turn = session.turn_index()
        self.begin_t = time.time_ns()
        self.begin_tick = boot_ticks()
        self.end_t = self.end_tick = None
        self.status = None
        self.before: set[str] = set()
        self.at_end: set[str] = set()
        self.implicit = implicit
        self.begin_seq = self.end_seq = None
        self.procs: dict[str, int] = {}  # implicit: its processes not seen to exit, key -> pid

    @property
    def unit(self) -> str:
        return call_unit(self.session.id, self.id)

    def covers(self, key: str, start_tick: int) -> bool:
        """Was the agent's child ``key`` (started at ``start_tick``) started during this call?"""
        if key in self.before or start_tick < self.begin_tick:
            return False
        if self.end_tick is None or start_tick < self.end_tick:
            return True
        return start_tick == self.end_tick and key in self.at_end

    def record(self) -> dict:
        return {"session": self.session.id, "id": self.id, "tool": self.tool,
                "summary": self.summary, "turn": self.turn, "begin_t": self.begin_t,
                "end_t": self.end_t, "status": self.status, "begin_seq": self.begin_seq,
                "end_seq": self.end_seq, "implicit": self.implicit}


class Session:
    def __init__(self, sid: str, agent: dict | None, runner: dict | None):
        self.id = sid
        self.agent = agent              # {"key", "pid"} of the agent process (None: not yet)
        self.command: list[str] | None = None
        self.runner = runner            # `overlayrec run`, when it started the session
        self.started = time.time_ns()
        self.ended = None
        self.aliases: list[str] = []
        self.calls: dict[str, Call] = {}
        self.order: list[Call] = []
        self.active: list[Call] = []
        self.turns: list[dict] = []
        self.announced = False          # has any call been announced by hooks?
        # the turn the agent's stop ended, which it may take up again before the next prompt
        # (a stop hook of the user's blocked that stop): (its record, whether the agent's own
        # writes take it up too, or only the calls it begins), None once a prompt came
        self.stopped: tuple[dict, bool] | None = None
        self.child_units: dict[str, tuple[str, Call | None]] = {}
        self.members: dict[str, Call] = {}  # live process key -> the implicit call it is of

    def turn_index(self) -> int | None:
        """The open turn's index; None between turns (after a turn's end, before the next
        prompt): what is done then is the session's own, not the ended turn's, or `revert
        --turn` took what `diff --turn` (the turn's span) did not show."""
        return self.turns[-1]["index"] if self.turns and self.turns[-1]["end_t"] is None \
            else None

    def own_unit(self) -> str:
        t = self.turn_index()
        return turn_unit(self.id, t) if t is not None else session_unit(self.id)

    def record(self) -> dict:
        return {"id": self.id, "agent": self.agent["key"] if self.agent else None,
                "agent_pid": self.agent["pid"] if self.agent else None, "command": self.command,
                "runner": self.runner["key"] if self.runner else None,
                "started": self.started, "ended": self.ended, "aliases": self.aliases}


class Unit(str):
    """A unit key, carrying the extra facts an event should record about it."""
    extra: dict

    def __new__(cls, key: str, **extra):
        u = super().__new__(cls, key)
        u.extra = extra
        return u


def late(unit: str) -> Unit:
    """``unit`` (a call's) marked as changed after the call ended (``after_end``)."""
    return Unit(unit, **dict(getattr(unit, "extra", {}), after_end=True))


class Calls:
    """The live sessions of one mount and the unit of every actor."""

    def __init__(self, journal: Journal, attribution: Attribution):
        self.journal = journal
        self.attribution = attribution
        self.sessions: dict[str, Session] = {}
        self._names: dict[str, str] = {}       # alias -> session id
        self._by_agent: dict[str, Session] = {}  # agent actor key -> session
        self._by_runner: dict[str, Session] = {}
        self._lineage: dict[str, tuple[Session, dict | None] | None] = {}
        # the processes of ended sessions placed at their end (_place_survivors), kept apart
        # from _lineage (which a session's begin clears): where /proc no longer leads from a
        # process to any session, its nearest placed ancestor does (lineage)
        self._survivors: dict[str, tuple[Session, dict]] = {}
        # what the record places processes in that /proc leads to no live session from (a
        # call's survivor of an earlier mount, and what it starts): actor key -> unit or None,
        # each asked of the journal once (``_held_unit``)
        self._held: dict[str, Unit | None] = {}
        self._gone_cut, self._gone_ids = -1, {}  # sessions retention dropped (_gone), per cut
        # whether the record held any session when this daemon started (end_left_open): none,
        # and no process can be an earlier mount's survivor, so nothing is asked (a mount
        # outside any session, as the bench's, read the journal for every new process)
        self._earlier: bool | None = None
        self._boot = boot_id()  # actor keys are unique within one boot only
        self.reverts: dict[str, str] = {}  # actor key -> revert id, while it reverts
        self.live_implicit: list[Call] = []  # implicit calls not ended, oldest first
        # called with a unit's key once its end is journaled (the daemon seals the unit's paths)
        self.on_unit_end: Callable[[str], None] | None = None
        self.on_boundary: Callable[[], None] | None = None
        self._own_actor: dict | None = None
        # the session names of agents another agent's call started (``nested``) -> that call
        self._nested: dict[str, Call] = {}
        self.root: str | None = None  # the workspace's path (the recorder sets it): _choose

    # -- lineage --------------------------------------------------------------------------------
    def lineage(self, actor: dict) -> tuple[Session, dict | None] | None:
        """(session, the agent's direct child above ``actor``) for a descendant of an agent,
        (session, None) for the agent itself, None for an outside process.

        The line is walked up through /proc.  A session started by ``overlayrec run`` knows its
        runner: the runner's child is the agent, and a process that the runner adopted (it is
        a child subreaper) after its parent exited is placed by its own start time.  A line
        that leads to no agent nor runner (init's, once `run` has exited) is a survivor's when
        it passes through one (a process of an ended session placed at its end,
        ``_place_survivors``): what a background job starts after its session ended is the
        job's, below it in its line.

        Answers are kept (``_lineage``): this is asked on the write path, for every change,
        and a walk reads /proc once per ancestor; a kept answer is a dict lookup.  The
        survivors are looked at only on that walk, a dict lookup per ancestor, and only once
        the walk has found no session: they never change an answer /proc gives."""
        key = actor["key"]
        if key in self._lineage:
            return self._lineage[key]
        result = None
        if key in self._by_agent:
            result = (self._by_agent[key], None)
        elif self.sessions:
            chain = [{"key": key, "pid": actor["pid"]}]
            placed = 0 if key in self._survivors else None  # the nearest survivor's index
            pid = actor.get("ppid") or 0
            while pid > 1 and len(chain) < 64:
                st = proc_start_and_ppid(pid)
                if st is None:
                    break
                pkey = f"{pid}:{st[0]}"
                if pkey in self._by_agent:
                    result = (self._by_agent[pkey], _with_below(chain, 1))
                    break
                if pkey in self._by_runner:
                    s = self._by_runner[pkey]
                    top = chain[-1]
                    if s.agent is None or s.agent["key"] == top["key"]:
                        result = (s, _with_below(chain, 2) if len(chain) > 1 else None)
                    else:  # adopted by the runner: an orphan of some call
                        result = (s, dict(_with_below(chain, 1), orphan=True))
                    break
                if placed is None and pkey in self._survivors:
                    placed = len(chain)
                chain.append({"key": pkey, "pid": pid})
                pid = st[1]
            if result is None and placed is not None:
                s, child = self._survivors[chain[placed]["key"]]
                below = child.get("below", []) + [c["key"] for c in reversed(chain[:placed])]
                result = (s, dict(child, below=below, survivor=True) if below else
                          dict(child, survivor=True))
        if len(self._lineage) > 100_000:
            self._lineage.clear()
        self._lineage[key] = result
        return result

    # -- the record's places (a later mount's survivors) -----------------------------------------
    def _line(self, unit: str) -> dict:
        """An actor row's ``line`` for ``unit`` (the call its line is of, with how it was chosen
        among calls active together), in this boot."""
        extra = getattr(unit, "extra", {})
        line = {"unit": str(unit), "boot": self._boot}
        line.update((k, extra[k]) for k in ("candidates", "chosen") if k in extra)
        return line

    def _hold_line(self, actor: dict, unit: str) -> None:
        """Keep ``actor``'s line (its call, fixed by its start for its whole life) in its row,
        which its first event writes: a later mount places it, and what it starts, by that
        (``_held_unit``), when /proc leads from them to no session of its own."""
        if "line" not in actor and actor.get("start"):
            actor["line"] = self._line(unit)

    def _held_unit(self, actor: dict) -> Unit | None:
        """The unit the record places ``actor`` in: the line its row holds, else its nearest
        ancestor's in /proc (what a survivor starts is its own, below it), as an earlier mount,
        or this one, placed them; None when none of them is held.  A call's unit is marked
        ``after_end`` once that call ended (always, for a call of an earlier mount).

        Asked only where /proc leads to no live session; each process's answer is kept, so the
        journal is read once for each process of a line, and a known actor costs a dict lookup."""
        key = actor["key"]
        if key in self._held:
            found = self._held[key]
        elif self._earlier is False and not self.sessions:
            return None
        else:
            found = self._held_line(actor)
        if found is not None and self._gone(unit_session(found)):
            return None  # its session dropped by a gc: the process writes as its own
        return late(found) if found is not None and self._ended(found) else found

    def _gone(self, sid: str | None) -> bool:
        """Was session ``sid`` dropped by retention while a process of its calls still ran?
        What that process writes next is its own (another writer's): placed in the dropped
        session, it was in no reader's answer but a range's, and no revert of its call could
        reach it (found by a bug hunt).  Asked of the journal once a session for each cut."""
        if sid is None:
            return False
        s = self.sessions.get(sid)
        if s is not None and s.ended is None:
            return False
        cut = self.journal.cut
        if cut != self._gone_cut:
            self._gone_cut, self._gone_ids = cut, {}
        if sid not in self._gone_ids:
            try:
                self._gone_ids[sid] = self.journal.dropped_session(sid) is not None
            except JournalError:
                return False
        return self._gone_ids[sid]

    def _held_line(self, actor: dict) -> Unit | None:
        """``_held_unit``'s walk up from a process not asked of yet: the unit of the nearest
        held line, kept for every process walked through below it."""
        key = actor["key"]
        walked, found = [key], self._row_line(key)
        pid = actor.get("ppid") or 0
        while found is None and pid > 1 and len(walked) < 64:
            st = proc_start_and_ppid(pid)
            if st is None:
                break
            pkey = f"{pid}:{st[0]}"
            if pkey in self._held:
                found = self._held[pkey]
                break
            walked.append(pkey)
            found = self._row_line(pkey)
            pid = st[1]
        if len(self._held) > 100_000:
            self._held.clear()
        for k in walked:  # all of the line below the one held: the same answer
            self._held[k] = found
        return found

    def _row_line(self, key: str) -> Unit | None:
        """The unit the record's row of process ``key`` places it in (its ``line``, of this
        boot: after a reboot a pid and start tick may come again)."""
        try:
            # as committed: a row this mount wrote ahead is of a process it placed itself
            row = self.journal.actor(key, settle=False)
        except JournalError:
            return None
        line = row.get("line") if row else None
        if not isinstance(line, dict) or not isinstance(line.get("unit"), str) or \
                line.get("boot") != self._boot:
            return None
        return Unit(line["unit"], **{k: line[k] for k in ("candidates", "chosen") if k in line})

    def _ended(self, unit: str) -> bool:
        """Is ``unit`` a call that has ended: any of an earlier mount's (a daemon's sessions end
        with it, or at the next one's start), one of this mount's once it ended?"""
        u = parse_unit(unit)
        if u is None or u.kind != "call":
            return False
        s = self.sessions.get(u.session)
        c = s.calls.get(u.id) if s is not None else None
        return c is None or c.end_t is not None

    # -- units ----------------------------------------------------------------------------------
    def unit_of(self, actor: dict, path: str | Callable[[], str] | None = None) -> str:
        """The unit of ``actor``'s change; ``path`` (the workspace-relative path it changes, or
        a function that names it) is looked at only for the agent's own change while several
        calls are active."""
        if actor["key"] in self.reverts:
            return revert_unit(self.reverts[actor["key"]])
        lin = self.lineage(actor) if self.sessions else None
        if lin is None:
            held = self._held_unit(actor)
            if held is None:
                return outside_unit(actor["key"])
            self._hold_line(actor, held)  # its row too: its parent may be gone by the next mount
            return held
        session, child = lin
        if session.ended is not None and self._gone(session.id):
            return outside_unit(actor["key"])  # a survivor of a session a gc dropped
        if child is None:  # the agent itself: the call active now (at open, for a handle)
            if len(session.active) == 1:
                return Unit(session.active[0].unit)
            if len(session.active) > 1:
                if callable(path):
                    try:
                        path = path()
                    except OSError:
                        path = None
                call, how = self._choose(session.active, path=path)
                return Unit(call.unit, candidates=[c.unit for c in session.active], chosen=how)
            self._end_exited_first(session)
            if session.stopped is not None:  # the agent goes on after a blocked stop
                self.take_up(session, actor, by_write=True)
            return Unit(session.own_unit())
        return self._child_unit(session, child, actor)

    def _choose(self, calls: list[Call], argv: list[str] | None = None,
                path: str | None = None) -> tuple[Call, str]:
        """Of ``calls`` (active together, in the order they began), the one the evidence names,
        and how: ``command``, the call whose announced command (its summary) the agent's child
        carries in its argv, the most words of it where several do; ``path``, the call whose
        summary names the path the agent itself changes (an edit tool's file); else
        ``newest``, the one begun last (an agent starts a tool's process right after the call
        is announced)."""
        if argv:
            scored = [(_carries(argv, c.summary), i) for i, c in enumerate(calls) if c.summary]
            best = max(scored, default=(0, 0))
            if best[0]:
                tied = [i for score, i in scored if score == best[0]]
                if len(tied) > 1:  # several announced it alike: the newest of them, a guess
                    return calls[tied[-1]], "newest"  # (it went unsaid, "command")
                return calls[best[1]], "command"
        if path is not None:
            names = {path}
            if self.root is not None:
                names.add(os.path.join(self.root, path))
            named = [c for c in calls if c.summary in names]
            if named:
                return named[-1], "path"
        return calls[-1], "newest"

    def _child_unit(self, session: Session, child: dict, actor: dict | None = None) -> str:
        unit, call = self._call_of_line(session, child)
        if unit is None:
            # no process of the line was started in a call: one the agent started outside its
            # calls (a persistent shell it sends each command to, a server begun with the
            # session) writes for the call active now, by time, not by the process tree
            return self._during(session, actor)
        if actor is not None:
            self._hold_line(actor, unit)
        if call is not None and call.end_t is not None:
            return late(unit)
        if call is not None and call.implicit and actor is not None:
            self._join(session, call, actor["key"], actor["pid"])  # it keeps the call open
        return unit

    def _call_of_line(self, session: Session, child: dict) -> tuple:
        """(unit, call) of the line below the agent's child ``child``: the call that started
        the highest process of the line started in one (the child, else the processes below
        it, ``below``: a persistent shell's command), an implicit call for a session that
        announces none, else (None, None).  Each process's answer is kept."""
        known = self._covering(session, child["key"], child["pid"])
        if known[0] is None and not session.announced:
            known = self._implicit_unit(session, child, int(child["key"].split(":")[1]))
            session.child_units[child["key"]] = known
        if known[0] is not None:
            return known
        for key in child.get("below", ()):
            known = self._covering(session, key, int(key.split(":")[0]))
            if known[0] is not None:
                return known
        return None, None

    def _covering(self, session: Session, key: str, pid: int) -> tuple:
        """(unit, call) of the announced call during which the process ``key`` was started
        (chosen by evidence among several), else (None, None); kept."""
        known = session.child_units.get(key)
        if known is None:
            start = int(key.split(":")[1])
            found = [c for c in session.order if not c.implicit and c.covers(key, start)]
            if len(found) == 1:
                known = (Unit(found[0].unit), found[0])
            elif found:
                call, how = self._choose(found, argv=read_actor(pid).get("argv"))
                known = (Unit(call.unit, candidates=[c.unit for c in found], chosen=how), call)
            else:
                known = (None, None)
            session.child_units[key] = known
        return known

    def _during(self, session: Session, actor: dict | None) -> str:
        """The unit of a write by a process of the session no call started: the call active
        now (``chosen``: ``during``; among several, by evidence), else the turn or session,
        as it is now."""
        if len(session.active) == 1:
            return Unit(session.active[0].unit, candidates=[session.active[0].unit],
                        chosen="during")
        if session.active:
            argv = read_actor(actor["pid"]).get("argv") if actor is not None else None
            call, how = self._choose(session.active, argv=argv)
            return Unit(call.unit, candidates=[c.unit for c in session.active],
                        chosen=how if how == "command" else "during")
        return Unit(session.own_unit())

    def _implicit_unit(self, session: Session, child: dict, start: int) -> tuple[str, Call]:
        """The implicit call of an agent's child: one of its own, unless it is a process of a
        call already (found in /proc by ``end_exited_calls``) or an orphan the runner adopted,
        placed by its start time among the implicit calls whose processes were alive then."""
        found = [c for c in self.live_implicit if c.session is session and child["key"] in c.procs]
        if found:
            extra = {"candidates": [c.unit for c in found]} if len(found) > 1 else {}
            return Unit(found[0].unit, **extra), found[0]
        if child.get("orphan"):
            found = [c for c in session.order if c.implicit and c.begin_tick <= start and
                     (c.end_tick is None or start <= c.end_tick)]
            if found:
                extra = {"candidates": [c.unit for c in found]} if len(found) > 1 else {}
                return Unit(found[0].unit, **extra), found[0]
        call = self._implicit_call(session, child)
        return Unit(call.unit), call

    def _implicit_call(self, session: Session, child: dict) -> Call:
        self._end_exited_first(session)
        info = read_actor(child["pid"])
        argv = info.get("argv") or [os.path.basename(info.get("exe") or "?")]
        call = Call(session, f"implicit-{child['key'].replace(':', '-')}",
                    os.path.basename(argv[0]), " ".join(argv)[:200], implicit=True)
        call.begin_tick = int(child["key"].split(":")[1])  # it began when its process started
        session.calls[call.id] = call
        session.order.append(call)
        call.begin_seq = self.journal.last_seq() + 1
        self.journal.put_record("calls", call_key(session.id, call.id), call.record())
        self._boundary()
        self.live_implicit.append(call)
        self._join(session, call, child["key"], child["pid"])
        if session.ended is not None:
            # a process of a session that ended (a background job it left, first writing
            # after the end): its call ended at the session's end at the latest, as every
            # implicit call's did; what the process writes is after that end
            self._end_call(session, call, self._daemon_actor(), "abandoned")
        return call

    def _end_exited_first(self, session: Session) -> None:
        """End ``session``'s implicit calls whose processes have all exited before the agent
        changes anything else, not at the next look (every 0.25 s): an agent that runs its
        commands one after another (``a; b; echo x > f``) goes on before that look, and the
        call of ``a`` would end after the next command's or the agent's own first change, its
        span (its seq range, its commit in an export) holding that as another writer's."""
        if not any(c.session is session for c in self.live_implicit):
            return
        try:
            self.end_exited_calls(session)
        except JournalError as e:  # the next look ends them (and says so when it cannot)
            log.debug("implicit calls not ended before the agent went on: %s", e)

    def before_held_write(self, actor: dict) -> None:
        """``actor`` changes a file through a handle it opened earlier (a write, a truncate):
        when it is an agent itself, its implicit calls whose processes have all exited end
        first, as before a change it opens for (``unit_of``).  The handle's unit was taken at
        its open (``exec 3>>f`` before the call), so this write asks for none: without this,
        the call of a command run in between ended after the write, its span holding the
        agent's change.  Nothing is looked at while no implicit call is live."""
        if not self.live_implicit:
            return
        lin = self.lineage(actor)
        if lin is not None and lin[1] is None:
            self._end_exited_first(lin[0])

    @staticmethod
    def _join(session: Session, call: Call, key: str, pid: int) -> None:
        if key not in call.procs:
            call.procs[key] = pid
            session.members.setdefault(key, call)

    def end_exited_calls(self, session: Session | None = None, caller: dict | None = None
                         ) -> list[Call]:
        """End every live implicit call (of ``session``, or of all) whose processes have all
        exited; returns them.  Reads /proc only for those calls' processes (and the children
        of their runner): nothing at all while there is no live implicit call.

        Per session, in this order: the exited processes are dropped and the children of the
        living taken in (so the parent of a process missed here had not exited when it was
        looked at, and the process is still its child or has been adopted by then); then the
        orphans the runner adopted are placed by start time; then a call with no process left
        ends, with status "exited"."""
        if not self.live_implicit:
            return []
        live = [c for c in self.live_implicit if session is None or c.session is session]
        ended = []
        for s in dict.fromkeys(c.session for c in live):
            mine = [c for c in live if c.session is s]
            for c in mine:
                todo = list(c.procs.items())
                while todo:
                    key, pid = todo.pop()
                    if not alive(key):
                        del c.procs[key]
                        if s.members.get(key) is c:
                            del s.members[key]
                        continue
                    for kkey, kpid in live_children_of(pid).items():
                        if kkey not in c.procs:
                            self._join(s, c, kkey, kpid)
                            todo.append((kkey, kpid))
            runner = s.runner
            if runner is not None and alive(runner["key"]):
                agent = s.agent["key"] if s.agent else None
                for key, pid in live_children_of(runner["pid"]).items():
                    if key == agent or key in s.members or key in s.child_units:
                        continue
                    start = int(key.split(":")[1])
                    for c in mine:
                        if c.begin_tick <= start:
                            self._join(s, c, key, pid)
            for c in mine:
                if not c.procs:
                    self._end_call(s, c, caller or self._daemon_actor(), "exited")
                    ended.append(c)
        return ended

    def _daemon_actor(self) -> dict:
        if self._own_actor is None:
            self._own_actor = read_actor(os.getpid())
        return self._own_actor

    def _unit_ended(self, unit: str) -> None:
        if self.on_unit_end is not None:
            try:
                self.on_unit_end(unit)
            except Exception:  # the end is journaled already: the hook cannot undo it
                log.exception("unit end hook failed for %s", unit)

    # -- control requests -----------------------------------------------------------------------
    def _control_event(self, op: str, session: Session, actor: dict, **kw) -> int:
        ev = {"op": op, "path": None, "session": session.id, "actor": actor["key"]}
        ev.update(kw)
        seq = self.journal.append(ev, actor)
        self._boundary()
        return seq

    def _boundary(self) -> None:
        """A unit began or ended: every epoch ends there (``on_boundary``), so the record is
        exact at every unit boundary, whoever keeps writing across it."""
        if self.on_boundary is not None:
            self.on_boundary()

    def resolve(self, name: str | None, caller: dict) -> Session:
        """The session a request names, or the one the caller runs under."""
        if name:
            sid = self._names.get(name)
            if sid is not None:
                s = self.sessions[sid]
                if s.ended is not None:
                    # a name an ended session had, sent from inside another one that goes on
                    # (an agent resumed under a second `run` of this mount): the name is that
                    # one's now
                    lin = self._session_line(caller)
                    if lin is not None and lin[0] is not s and lin[0].ended is None:
                        self._names.pop(name)
                        self._alias(lin[0], name)
                        return lin[0]
                return s
        lin = self._session_line(caller)
        if lin is not None:
            self._alias(lin[0], name)
            return lin[0]
        if not name and len(self.sessions) == 1:
            return next(iter(self.sessions.values()))
        raise ControlError(f"no session {name!r}" if name else
                           "no session: start one (overlayrec run, or session begin)")

    def _session_line(self, caller: dict) -> tuple[Session, dict | None] | None:
        """``lineage`` of a control request's caller, None for one placed only as a survivor's
        (a process a background job started after its session ended): its writes are that
        session's, but it runs under no session (an agent it started begins one of its own;
        a name it gives is no alias of the ended one)."""
        lin = self.lineage(caller)
        if lin is not None and lin[1] is not None and lin[1].get("survivor"):
            return None
        return lin

    def agent_for_hook(self, caller: dict) -> dict:
        """The agent behind a hook process: its first ancestor that is not a shell or us.
        When that is what hosts the user's terminals (TERMINAL_HOSTS: a session begun by hand
        in a tmux pane), the nearest shell below it: the tmux server was taken for the agent,
        and the user's vim in another pane wrote as the session's (a revert of the call then
        threw the user's edit away; found by a bug hunt)."""
        pid, shell = caller["ppid"], None
        for _ in range(16):
            a = read_actor(pid)
            argv = a.get("argv") or [""]
            name = os.path.basename(argv[0])
            if pid <= 1 or a["start"] == 0:
                break
            if name.split(":")[0] in TERMINAL_HOSTS:  # ("tmux: server" too)
                return shell or read_actor(caller["ppid"])
            if name not in SHELLS and not is_overlayrec(argv):
                return a
            if shell is None and name in SHELLS and name not in ("env", "timeout", "nice"):
                shell = a
            pid = a["ppid"]
        return read_actor(caller["ppid"])

    def nested(self, caller: dict, name: str | None) -> Call | None:
        """The call another agent runs in, when the hook asking for session ``name`` is that
        agent's (``codex exec`` in a Claude Code Bash call, with Codex's own hooks installed):
        the hook's agent (``agent_for_hook``) is not the session's but a process one of its
        announced calls started (``_call_of_line``).  Its hooks must not touch the session:
        its name was taken for an alias of it, and its prompt ended the outer turn and
        interrupted the call running it, its Stop ended a turn of its own.  Everything it
        does is that call's (its writes are, by their line); None for any other request.  A
        request under one of the session's own names is never another agent's, nor one
        without a name (a harness's own ``overlayrec call begin``)."""
        if not name or caller["key"] in self._by_runner:
            return None  # a runner's requests are its own session's (a `run` inside a call too)
        known = self._nested.get(name)
        if known is not None:
            return known
        lin = self._session_line(caller)
        if lin is None or lin[1] is None:
            return None
        s = lin[0]
        if self._names.get(name) == s.id or s.agent is None or not s.announced:
            return None  # its own name; or no call announced yet (none to run an agent in)
        agent = self.agent_for_hook(caller)
        if agent["key"] == s.agent["key"]:
            return None
        inner = self.lineage(agent)
        if inner is None or inner[0] is not s or inner[1] is None:
            return None
        _, call = self._call_of_line(s, inner[1])
        if call is None:
            return None
        self._nested[name] = call
        log.info("session %s: its hooks are an agent's that call %s of session %s runs: "
                 "they change nothing", name, call.id, s.id)
        return call

    def session_begin(self, caller: dict, name: str | None, runner: bool = False,
                      command: list[str] | None = None) -> Session:
        """Begin a session.  ``runner``: the caller (``overlayrec run``) will start the agent as
        its child and name it with ``session_agent``.  Otherwise the caller is a hook: the agent
        is its first ancestor that is not a shell, or the session it already runs under."""
        before = None  # the ended session of this hook's agent, which this one follows
        if not runner:
            lin = self._session_line(caller)
            if lin is not None and lin[0].ended is None:
                # a hook inside a session `run` started (or one begun already): the same
                return self.resolve(name, caller)
            agent = self.agent_for_hook(caller)
            before = lin[0] if lin is not None else self._by_agent.get(agent["key"])
            if before is not None and before.ended is None:
                self._alias(before, name)
                return before
            # ``before`` ended: its agent goes on with a new session in the same process
            # (Claude Code's /clear ends one and begins the next); taken for the ended one's,
            # its calls were refused and what it did was the ended session's own
        if name and len(name.encode("utf-8", "surrogateescape")) > MAX_SESSION_NAME:
            # its calls' and turns' keys begin with it (LMDB takes 511 bytes a key): a longer
            # one was taken, and each call then failed half recorded (MDB_BAD_VALSIZE)
            raise ControlError(f"a session name of at most {MAX_SESSION_NAME} bytes, please "
                               f"(this one has {len(name.encode('utf-8', 'surrogateescape'))})")
        sid = name or uuid.uuid4().hex[:12]
        if name and (name in self._names or self._recorded(name)):
            sid = self._next_part(name, caller)
        if before is not None and before.runner is not None:
            # under the same `run`: its runner's and agent's processes lead here from now on
            s = Session(sid, before.agent, before.runner)
            self._by_runner[before.runner["key"]] = s
            if s.agent is not None:
                self._by_agent[s.agent["key"]] = s
        else:
            s = Session(sid, None if runner else agent, caller if runner else None)
        s.command = command if before is None else before.command
        self.sessions[sid] = s
        self._names[sid] = sid
        if runner:
            self._by_runner[caller["key"]] = s
        elif before is None or before.runner is None:
            self._by_agent[agent["key"]] = s
            self.journal.append_many([], [agent])
        held = self.sessions.get(self._names.get(name)) if name else None
        if name and sid != name and (held is None or held.ended is not None):
            # the name the agent goes on using is this session's now; not while the session
            # that has it goes on (two runs of one name at once: its runner ends it by it)
            self._names[name] = sid
            s.aliases.append(name)
        self._lineage.clear()  # processes seen before may descend from this session now
        self.journal.put_record("sessions", sid.encode(), s.record())
        self._control_event("session_begin", s, caller)
        return s

    def _recorded(self, sid: str) -> bool:
        """Does the record hold a session ``sid``, or did it (a gc dropped it: every reader
        takes that name for the dropped one's, so a new session of it was hidden from them
        all; found by a bug hunt)?"""
        return self.journal.record("sessions", sid.encode()) is not None or \
            self.journal.dropped_session(sid) is not None

    def _next_part(self, name: str, caller: dict) -> str:
        """A session named as one this record holds already: an agent's session resumed by a
        new process (``claude --resume``: the same session id), in this mount or an earlier
        one, or a second ``run --session`` of one name.  Its turns would be numbered from 1
        again and take the earlier ones' records, so it is a session of its own, ``NAME.2``
        (``.3`` ...), and the name leads to it from now on.  The earlier one, still open in
        this daemon, ends here when its runner and its agent are gone (the agent has handed
        the name on); while either still works (two runs of one name at once) it goes on: its
        later calls were made "abandoned" and their writes late (found by a hunt)."""
        old = self._names.get(name)
        if old is not None and self.sessions[old].ended is None:
            prev = self.sessions[old]
            if not any(x is not None and alive(x["key"]) for x in (prev.runner, prev.agent)):
                self.session_end(caller, old)
        n = 2
        while f"{name}.{n}" in self._names or self._recorded(f"{name}.{n}"):
            n += 1
        return f"{name}.{n}"

    def session_agent(self, caller: dict, name: str | None, pid: int) -> Session:
        """The runner names the agent it started: its own child, checked in /proc."""
        s = self.resolve(name, caller)
        if s.runner is None or s.runner["key"] != caller["key"]:
            raise ControlError("only the runner of a session can name its agent")
        st = proc_start_and_ppid(pid)
        if st is None or st[1] != caller["pid"]:
            raise ControlError(f"pid {pid} is not a child of the caller")
        s.agent = {"key": f"{pid}:{st[0]}", "pid": pid}
        self._by_agent[s.agent["key"]] = s
        self._lineage.clear()
        self.journal.put_record("sessions", s.id.encode(), s.record())
        return s

    def _alias(self, s: Session, name: str | None) -> None:
        if name and name not in self._names:
            s.aliases.append(name)
            self._names[name] = s.id
            self.journal.put_record("sessions", s.id.encode(), s.record())

    def session_end(self, caller: dict, name: str | None) -> Session:
        s = self.resolve(name, caller)
        if s.ended is not None:
            return s  # a hook's SessionEnd and the runner's both end it: once is enough
        # its calls end before its turn, as a turn holds them: a turn ended first took the
        # open call's changes into its own end (`export git`'s "turn ends" commit held them,
        # the call's was empty) while `diff --call` showed them the call's
        for c in list(s.active):
            self.call_end(caller, s.id, c.id, "abandoned")
        self.end_exited_calls(s, caller)
        for c in [c for c in self.live_implicit if c.session is s]:
            self._end_call(s, c, caller, "abandoned")  # its processes outlive the session
        if s.turns and s.turns[-1]["end_t"] is None:
            self.turn_end(caller, s.id)
        s.stopped = None
        self._place_survivors(s)
        s.ended = time.time_ns()
        self._control_event("session_end", s, caller)
        self.journal.put_record("sessions", s.id.encode(), s.record())
        self._unit_ended(session_unit(s.id))
        return s

    def end_left_open(self, as_of: tuple[int, int] | None = None) -> list[str]:
        """At a daemon's start: end the sessions an earlier daemon left open (it was killed: a
        crash, SIGKILL, the OOM killer), with their open turn and calls (``abandoned``).  No
        daemon goes on with them (a session lives in its daemon: an agent that asks again under
        its name begins a new part, ``_next_part``), and what waits for a session's end (`export
        git`'s commit of a session without calls, its calls' late writes) waited for good while
        `diff --session` showed its changes.  Ended by this daemon, at its start; their ids.
        ``as_of``: the seq and time of the earlier daemon's last event, where they ended (the
        records' ``end_seq`` and times, the events' ``as_of``): ended where they are journaled,
        after the changes made while unmounted, a call's or a turn's span took them in (its
        export commit, `replay --at after:`; found by a bug hunt)."""
        actor = self._daemon_actor()
        extra = {"as_of": as_of[0]} if as_of else {}
        ended = []
        self._earlier = False
        for rec in self.journal.records("sessions"):
            self._earlier = True
            sid = rec.get("id")
            if rec.get("ended") is not None or not isinstance(sid, str) or sid in self.sessions:
                continue
            s = Session(sid, None, None)  # its id only: what the end events name
            now = as_of[1] if as_of else time.time_ns()
            # calls first, then the turn that holds them (see session_end)
            for c in self.journal.records("calls", sid.encode() + b"\0"):
                if c.get("end_t") is None and c.get("session") == sid:
                    seq = self._control_event("call_end", s, actor, call=c["id"],
                                              status="abandoned", **extra)
                    c["end_seq"] = as_of[0] if as_of else seq
                    c["end_t"], c["status"] = now, "abandoned"
                    self.journal.put_record("calls", call_key(sid, c["id"]), c)
            for t in self.journal.records("turns", sid.encode() + b"\0"):
                if t.get("end_t") is None and t.get("session") == sid:
                    seq = self._control_event("turn_end", s, actor, turn=t["index"], **extra)
                    t["end_seq"] = as_of[0] if as_of else seq
                    t["end_t"] = now
                    self.journal.put_record("turns", turn_key(sid, t["index"]), t)
            rec["ended"] = now
            self._control_event("session_end", s, actor, **extra)
            self.journal.put_record("sessions", sid.encode(), rec)
            ended.append(sid)
        return ended

    def end_abandoned_sessions(self) -> list[Session]:
        """End each live session ``overlayrec run`` began whose runner and agent have both
        exited without ending it (the runner killed by SIGKILL, or by the OOM killer, with its
        agent): nothing would ever end it, and it would stay "running" in every listing and
        keep a mount `run` made from going.  Ended by the daemon, as the runner would have; the
        sessions the agents' hooks began are left to their agents (their hooks end them)."""
        ended = []
        for s in list(self.sessions.values()):
            if s.ended is not None or s.runner is None:
                continue
            if alive(s.runner["key"]):
                continue
            if s.agent is not None and alive(s.agent["key"]):
                continue  # the agent works on without its runner: its session goes on
            self.session_end(self._daemon_actor(), s.id)
            ended.append(s)
        return ended

    def _place_survivors(self, s: Session) -> None:
        """The session's processes still alive at its end (a server a call started) keep their
        call: once the runner has exited they are init's, and /proc no longer leads from them
        to the session.  Each is placed now, while it does (``lineage`` keeps the answer), so
        what it writes later is its call's, after the call's end."""
        top = s.runner or s.agent
        if top is None:
            return
        # survivors of earlier sessions that have exited go (their keys are never reused)
        for key in [k for k in self._survivors if not alive(k)]:
            del self._survivors[key]
        rows = []
        for key in descendants_of(top["pid"]):
            pid, start = map(int, key.split(":"))
            st = live_stat(pid)
            if st is not None and st[0] == start:
                lin = self.lineage({"key": key, "pid": pid, "ppid": st[1]})
                if lin is not None and lin[0] is s and lin[1] is not None:
                    # what it starts later, once /proc no longer leads from it to the
                    # session, is placed below it (lineage); kept also when a later
                    # session's begin clears the lineage kept so far
                    self._survivors[key] = lin
                    rows += self._survivor_row(s, key, pid, st[1])
        try:
            # and in the record, for the mounts after this one (_held_unit)
            self.journal.place_actors(rows)
        except JournalError as e:  # this mount still places them (_survivors)
            log.warning("the survivors of session %s are not in the record: %s", s.id, e)

    def _survivor_row(self, s: Session, key: str, pid: int, ppid: int) -> list[dict]:
        """The actor row that keeps a survivor's line for later mounts (none or one): its
        call's unit, or the session's own for a line no call started (a persistent shell's,
        which writes for the session once it ended).  None for a line of a session that
        announces nothing that has not written yet: its implicit call is made at its first
        write, in this mount only."""
        unit = self._placed(key, pid, ppid)
        if unit is None and s.announced:
            unit = session_unit(s.id)
        if unit is None:
            return []
        row = read_actor(pid)
        return [dict(row, line=self._line(unit))] if row["key"] == key else []  # not exited

    def _open(self, name: str | None, caller: dict) -> Session:
        """The session a request that begins something names (``resolve``), refused once it
        has ended: a call or turn begun then had no end for good, and was listed under the
        session's ended turn."""
        s = self.resolve(name, caller)
        if s.ended is not None:
            raise ControlError(f"session {s.id} has ended")
        return s

    def turn_begin(self, caller: dict, name: str | None, prompt: str | None) -> dict:
        _keepable(prompt=prompt)
        s = self._open(name, caller)
        # a call announced and never ended before the next prompt was interrupted (an agent
        # sends no end for a tool call the user stopped, nor a turn end): it ends here, or it
        # would stay active beside every later call (calls active together: each later change
        # a guess); what its processes write from now on is marked after its end
        self._interrupt(s, caller)
        if s.turns and s.turns[-1]["end_t"] is None:
            self.turn_end(caller, s.id)
        s.stopped = None  # a prompt: the stopped turn is over for good
        index = len(s.turns) + 1
        seq = self._control_event("turn_begin", s, caller, turn=index)
        t = {"session": s.id, "index": index, "prompt": prompt, "begin_t": time.time_ns(),
             "end_t": None, "begin_seq": seq, "end_seq": None}
        s.turns.append(t)
        self.journal.put_record("turns", turn_key(s.id, index), t)
        return t

    def _interrupt(self, s: Session, caller: dict) -> None:
        for c in [c for c in s.active if not c.implicit]:
            self._end_call(s, c, caller, "interrupted")

    def turn_end(self, caller: dict, name: str | None, resume: str | None = None,
                 again: bool = False) -> dict:
        """End the session's open turn.  ``resume``: the turn ends at an agent's stop, which a
        stop hook of the user's may block (the agent then goes on in the same turn, with no
        new prompt): until the next prompt a call begun (``"calls"``), or also the agent's own
        write (``"any"``), takes it up again (``take_up``).  ``again``: the agent's stop after
        a blocked one (``stop_hook_active``): a turn an earlier stop ended is taken up and ends
        here, so its span reaches the last stop."""
        s = self.resolve(name, caller)
        if again and s.turn_index() is None:
            self.take_up(s, caller)
        if not s.turns or s.turns[-1]["end_t"] is not None:
            raise ControlError(f"session {s.id} has no open turn")
        # a call of the turn still open at its end got no end from the agent (a tool denied,
        # a post hook that timed out): it ends with its turn, as at the next prompt, or it
        # stayed active past the turn and took what was written after it (`calls --turn` and
        # `revert --turn` held that, `turns` and `diff --turn` did not)
        self._interrupt(s, caller)
        t = s.turns[-1]
        t["end_seq"] = self._control_event("turn_end", s, caller, turn=t["index"])
        t["end_t"] = time.time_ns()
        self.journal.put_record("turns", turn_key(s.id, t["index"]), t)
        s.stopped = (t, resume == "any") if resume in ("calls", "any") else None
        self._unit_ended(turn_unit(s.id, t["index"]))
        return t

    def take_up(self, s: Session, caller: dict, by_write: bool = False) -> None:
        """Open again the turn the agent's last stop ended, when no prompt came since: the stop
        was blocked (Claude Code's Stop hook answered ``{"decision": "block"}``: the agent goes
        on in the same turn and stops again later).  Ended for good, the turn left out the
        calls that followed (each of no turn, revert --turn then conflicting with them).
        Journaled as a ``turn_begin`` of the same index (``again``), and the record's end is
        cleared, so every reader of its span (turns, diff and revert --turn, log, export)
        takes it up to its next end.  ``by_write``: asked for the agent's own write, which
        takes up only a turn whose stop said so."""
        if s.stopped is None or s.ended is not None:
            return
        t, writes = s.stopped
        if (by_write and not writes) or not s.turns or s.turns[-1] is not t or \
                t["end_t"] is None:
            return
        s.stopped = None
        seq = self._control_event("turn_begin", s, caller, turn=t["index"], again=True)
        t["taken_up"] = t.get("taken_up", []) + [seq]
        t["end_t"] = t["end_seq"] = None
        self.journal.put_record("turns", turn_key(s.id, t["index"]), t)

    def call_begin(self, caller: dict, name: str | None, call_id: str, tool: str,
                   summary: str | None) -> Call:
        _keepable(id=call_id, tool=tool, summary=summary)
        s = self._open(name, caller)
        if call_id in s.calls:
            raise ControlError(f"call {call_id} already begun in session {s.id}")
        self.take_up(s, caller)  # a call after a blocked stop: the turn goes on
        s.announced = True
        c = Call(s, call_id, tool, summary)
        c.before = _session_tree(s) if s.agent else set()
        c.begin_seq = self._control_event("call_begin", s, caller, call=call_id, tool=tool)
        s.calls[call_id] = c
        s.order.append(c)
        s.active.append(c)
        self.journal.put_record("calls", call_key(s.id, call_id), c.record())
        return c

    def call_end(self, caller: dict, name: str | None, call_id: str, status: str) -> Call:
        s = self.resolve(name, caller)
        c = s.calls.get(call_id)
        if c is None:
            raise ControlError(f"no call {call_id} in session {s.id}")
        if c.end_t is not None:
            raise ControlError(f"call {call_id} already ended")
        return self._end_call(s, c, caller, status)

    def _end_call(self, s: Session, c: Call, caller: dict, status: str) -> Call:
        c.at_end = _session_tree(s) if s.agent and not c.implicit else set()
        c.end_tick = boot_ticks()
        c.end_t = time.time_ns()
        c.status = status
        c.end_seq = self._control_event("call_end", s, caller, call=c.id, status=status)
        if c in s.active:
            s.active.remove(c)
        if c.implicit:
            if c in self.live_implicit:
                self.live_implicit.remove(c)
            for key in c.procs:
                if s.members.get(key) is c:
                    del s.members[key]
            c.procs.clear()
        self.journal.put_record("calls", call_key(s.id, c.id), c.record())
        self._unit_ended(c.unit)
        return c

    def revert_begin(self, caller: dict, revert_id: str) -> None:
        """The caller's writes are the revert's own unit until revert_end.  An implicit call
        whose processes have all exited ends first (the quarter-second look may not have
        come yet): a revert an agent's next command made of it at once was journaled while
        it was still open, and `export git` put the call's commit after the revert's."""
        self.end_exited_calls()
        self.reverts[caller["key"]] = revert_id
        self.journal.append({"op": "revert_begin", "path": None, "revert": revert_id,
                             "actor": caller["key"]}, caller)
        self._boundary()

    def revert_end(self, caller: dict, revert_id: str) -> None:
        self.reverts.pop(caller["key"], None)
        self.journal.append({"op": "revert_end", "path": None, "revert": revert_id,
                             "actor": caller["key"]}, caller)
        self._boundary()
        self._unit_ended(revert_unit(revert_id))

    def status(self) -> dict:
        return {"sessions": [dict(s.record(), active_calls=[c.id for c in s.active],
                                  turn=s.turn_index()) for s in self.sessions.values()]}

    def processes(self) -> list[dict]:
        """The live processes of the sessions' calls (the agents left out), each with the unit
        its changes go to: ``{"pid", "key", "argv", "unit"}``.  A revert names those of what it
        undoes that still run (what they write next follows it).  Nothing is journaled: a process that has not
        written yet is placed as its first change would be, without making an implicit call."""
        keys: set[str] = set()
        for s in self.sessions.values():
            top = s.runner or s.agent
            if top is not None and s.ended is None:
                keys |= descendants_of(top["pid"])
        keys |= {k for k, v in self._lineage.items() if v is not None and v[1] is not None}
        keys |= {k for k, v in self._held.items() if v is not None}
        out = []
        for key in sorted(keys):
            pid, start = map(int, key.split(":"))
            st = live_stat(pid)
            if st is None or st[0] != start:
                continue  # exited (or the pid is another process's now)
            unit = self._placed(key, pid, st[1])
            if unit is not None:
                out.append({"pid": pid, "key": key, "argv": read_actor(pid).get("argv") or [],
                            "unit": str(unit)})
        return out

    def _placed(self, key: str, pid: int, ppid: int) -> str | None:
        """unit_of's answer for a live process of a session, without its side effects (an
        implicit call made for a process not seen yet); None for an agent, an outside
        process, or one an unannounced session would make an implicit call of.  One /proc
        leads to no session from is placed as the record places it, once asked (``_held``)."""
        lin = self.lineage({"key": key, "pid": pid, "ppid": ppid}) if self.sessions else None
        if lin is None:
            return self._held.get(key)
        if lin[1] is None:
            return None
        session, child = lin
        if not session.announced:
            known = session.child_units.get(child["key"])
            if known is not None:
                return known[0]
            member = [c for c in self.live_implicit
                      if c.session is session and child["key"] in c.procs]
            return member[0].unit if member else None
        # a process no call started (a persistent shell) is none of theirs: like the agent
        unit, _ = self._call_of_line(session, child)
        return unit
