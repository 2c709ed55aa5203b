"""The control endpoint: a Unix socket in the state dir (mode 0600) on which agents, hooks and
`overlayrec run` announce sessions, turns and calls.

Protocol (docs/control.md): one JSON object per line in each direction; a request is
``{"op": ..., ...}`` and its answer ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``.
Who is asking is never taken from the request: the caller's pid comes from the kernel
(SO_PEERCRED) and its identity and ancestry from /proc.
"""
from __future__ import annotations

import array
import errno
import json
import logging
import os
import socket
import struct
import time

import trio

from . import agents, state
from .retention import RetentionError
from .calls import Calls, ControlError
from .journal import JournalError
from .attribution import Attribution

log = logging.getLogger(__name__)

# a hook's payload carries the tool's input and response whole: Claude Code's for a Read or a
# Write of a large file is megabytes (at 1 MiB the connection was closed, and the call with
# it); a larger one is refused, and said in the daemon's log
MAX_REQUEST = 256 << 20


def peer_pid(sock) -> int:
    return peer(sock)[0]


def peer(sock) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", raw)
    return pid, uid


# what only the daemon's own user (or root) may ask: the socket is given to the workspace's
# owner where root records another user's workspace, and that user's agent, recorded, could
# drop the record of itself (`gc`), pin it, or take the underlay's fd (found by a bug hunt)
_OWNER_OPS = frozenset({"gc", "pin", "unpin", "underlay"})


# errnos of a resource the system or the process is short of for now: accept again later
_SHORT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def _owner_op(line: bytes) -> bool:
    """Is ``line`` a request of _OWNER_OPS (not parsed when it cannot be one)?"""
    if b'"op"' not in line:
        return False
    try:
        req = json.loads(line)
    except ValueError:
        return False
    return isinstance(req, dict) and req.get("op") in _OWNER_OPS


class MountEnding(ControlError):
    """A session asked to begin in a mount that is ending."""


def _resume(value) -> str | None:
    """A turn end's ``resume`` (what takes the turn up again after the agent's stop)."""
    if value not in (None, "calls", "any"):
        raise ValueError("resume must be \"calls\" or \"any\"")
    return value


# requests that journal nothing: no room is made for them (Recorder.room_to_record)
_READING_OPS = frozenset({"ping", "status", "processes", "writing", "room"})
# the requests an agent's hooks make about its own session, turns and calls: refused to none
# of them, and done by none, when that agent runs inside another's call (Calls.nested)
_AGENT_OPS = frozenset({"session_begin", "session_end", "turn_begin", "turn_end", "call_begin",
                        "call_end"})


class _Local:
    """The client's methods, served in the daemon for a raw hook payload: each one a request
    handled as the client's is (``ControlServer.handle``), its fields checked in that one
    place."""

    def __init__(self, server: "ControlServer", caller: dict):
        self.server, self.caller = server, caller

    def _request(self, op: str, **fields) -> dict:
        req = {"op": op, **{k: v for k, v in fields.items() if v is not None}}
        return self.server.handle(req, self.caller)

    def session_begin(self, session=None):
        return self._request("session_begin", session=session)

    def session_end(self, session=None):
        return self._request("session_end", session=session)

    def turn_begin(self, prompt=None, session=None):
        return self._request("turn_begin", prompt=prompt, session=session)

    def turn_end(self, session=None, resume=None, again=False):
        return self._request("turn_end", session=session, resume=resume,
                             again=again or None)

    def call_begin(self, call_id, tool, summary=None, session=None):
        return self._request("call_begin", id=call_id, tool=tool, summary=summary,
                             session=session)

    def call_end(self, call_id, status="ok", session=None):
        return self._request("call_end", id=call_id, status=status, session=session)


# a request's free-text fields: each a string, or absent (``command``: a list of strings)
TEXT_FIELDS = ("prompt", "tool", "summary", "status")


def storable(text: str) -> str:
    """``text`` with each lone surrogate the journal cannot keep made U+FFFD: a prompt cut
    inside an emoji (JSON ``"\\ud83d"``, as JSON.stringify writes it) was refused with an
    encoding error once the daemon had journaled the turn's begin.  U+DC80..U+DCFF stay: they
    are bytes that were not UTF-8 (a path's, an argv's), kept as those bytes."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8", "surrogateescape")
        return text
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= ch <= "\udfff" and not "\udc80" <= ch <= "\udcff"
                       else ch for ch in text)


def _id_text(req: dict, field: str, errors: str) -> None:
    """Refuse (ValueError) an id the journal cannot key: a session's keys are UTF-8 text, a
    call's may hold bytes that were not (U+DC80..U+DCFF); another lone surrogate in either
    failed as the first record was written, half of the request journaled."""
    v = req.get(field)
    if isinstance(v, str) and not v.isascii():
        try:
            v.encode("utf-8", errors)
        except UnicodeEncodeError:
            raise ValueError(f"{field} must be UTF-8 text") from None


def checked(req: dict) -> dict:
    """``req``, its fields checked before anything of it is applied: a ``session`` or a text
    field that is not a string is a bad request (ValueError), and so is an id that cannot be
    keyed; a text field's lone surrogates are made storable.  A number or a list as the
    session failed in the session table (a traceback in the log, "internal error" to the
    caller), a 0 was taken as none; a prompt that was an object was kept as it was, and
    `turns`, `export git` and `report` failed on its record for good."""
    name = req.get("session")
    if name is not None and not isinstance(name, str):
        raise ValueError("session must be a string")
    _id_text(req, "session", "strict")
    _id_text(req, "id", "surrogateescape")
    for field in TEXT_FIELDS:
        if req.get(field) is not None:
            if not isinstance(req[field], str):
                raise ValueError(f"{field} must be a string")
            req[field] = storable(req[field])
    command = req.get("command")
    if command is not None:
        if not (isinstance(command, list) and all(isinstance(w, str) for w in command)):
            raise ValueError("command must be a list of strings")
        req["command"] = [storable(w) for w in command]
    return req


class ControlServer:
    def __init__(self, path: str, calls: Calls, attribution: Attribution, owner_uid: int,
                 root_fd: int | None = None):
        self.path = path
        self.root_fd = root_fd
        self.calls = calls
        self.attribution = attribution
        self.owner_uid = owner_uid
        self.recorder = None      # set by the daemon: the gc reaches the attic through it
        self.max_bytes = None     # a budget set at mount (``mount --max-bytes``)
        self.budget_due = False   # a session ended: the budget is looked at soon
        self._gc_lock = trio.Lock()
        self.workspace = None     # set by the daemon, with ``stop``: what a release needs
        # where the mount is now (set by the daemon once it is up): a directory above the
        # workspace renamed moves it, and the path it was made at names nothing, or another
        # workspace (a release looked there for the processes and mounts in it: it ended the
        # mount under a server working in it, and took a tmpfs beneath along; a bug hunt)
        self.where = lambda: self.workspace
        self.source = None  # the mount's source, the daemon's own (daemon.prepare)
        self.stop = None          # ends the mount (detach: lazily first, daemon._serve)
        self.ending = False       # the mount is ending: no session begins in it any more
        self.detached = False     # the mount was detached from the workspace as it ended
        # set by the daemon: the file handles open for writing (fs.Operations.open_writes)
        self.open_writes = None
        self.operations = None  # the mount's fs.Operations (the daemon sets it)

    def handle(self, req: dict, caller: dict) -> dict:
        if self.ending and (req.get("op") == "session_begin" or "op" not in req):
            # a session begun now would lose the mount under its agent (a `run` joining just
            # as the one that mounted lets it go): said, so that it mounts anew
            raise MountEnding("the mount is ending: mount again")
        if "hook_event_name" in req and "op" not in req:
            # an agent's hook payload piped straight in (the fast hook: nc, no interpreter);
            # the registry says whose it is (docs/agents.md)
            event = agents.event_of(req)
            agent = agents.recognise(req)
            if agent is None:
                raise ControlError(f"no agent sends hook event {event!r}")
            agent.apply(req, _Local(self, caller), (ControlError,))
            return {}
        req = checked(req)
        op = req.get("op")
        c = self.calls
        name = req.get("session") or None
        if op in _AGENT_OPS and not req.get("runner"):
            inner = c.nested(caller, name)
            if inner is not None:  # accepted, and nothing done: see Calls.nested
                return {"session": name, "inside": inner.unit}
        if op == "ping":
            return {"pid": os.getpid()}
        if op == "room":  # a record the caller writes itself (a revert's plan)
            return {"freed": self.recorder.room_to_record("revert plan")
                    if self.recorder is not None else 0}
        if op == "status":
            return {**c.status(), "ending": self.ending}
        if op == "processes":
            return {"processes": c.processes()}
        if op == "writing":
            return {"writing": self.writing()}
        if op == "session_begin":
            s = c.session_begin(caller, name, runner=bool(req.get("runner")),
                                command=req.get("command"))
            return {"session": s.id}
        if op == "session_agent":
            return {"session": c.session_agent(caller, name, int(req["pid"])).id}
        if op == "session_end":
            return {"session": c.session_end(caller, name).id}
        if op == "turn_begin":
            t = c.turn_begin(caller, name, req.get("prompt"))
            return {"session": t["session"], "turn": t["index"]}
        if op == "turn_end":
            t = c.turn_end(caller, name, _resume(req.get("resume")), bool(req.get("again")))
            return {"session": t["session"], "turn": t["index"]}
        if op == "call_begin":
            if not req.get("id") or not req.get("tool"):
                raise ControlError("call_begin needs id and tool")
            call = c.call_begin(caller, name, str(req["id"]), str(req["tool"]), req.get("summary"))
            return {"session": call.session.id, "call": call.id, "turn": call.turn}
        if op == "call_end":
            status = req.get("status") or "ok"
            call = c.call_end(caller, name, str(req.get("id")), status)
            return {"session": call.session.id, "call": call.id}
        if op == "revert_begin":
            c.revert_begin(caller, str(req["id"]))
            return {}
        if op == "revert_end":
            c.revert_end(caller, str(req["id"]))
            return {}
        if op == "release":
            return self.release(caller)
        if op in ("pin", "unpin"):
            from . import retention
            if not req.get("session"):
                raise ControlError(f"{op} needs session")
            try:
                return {"message": retention.set_pin(c.journal, str(req["session"]),
                                                     op == "pin")}
            except retention.RetentionError as e:
                raise ControlError(str(e)) from None
        raise ControlError(f"unknown op {op!r}")

    async def run_gc(self, req: dict) -> dict:
        """A gc run here, in the daemon (docs/retention.md): in the trio thread, between
        requests, yielding to the mount between batches; one at a time."""
        out: dict = {}
        async with self._gc_lock:
            began = time.time_ns()
            if self.recorder is not None and not req.get("dry_run"):
                self.recorder.room_to_record("gc")
            for _ in self.gc_steps(req, out):
                await trio.sleep(0)
            if not req.get("dry_run"):
                self.forget_exports(out, began)
        out["compaction"] = {"compacted": False, "why": "mounted: the free pages are reused "
                             "by the journal, and given back by a gc while unmounted"}
        return out

    def forget_exports(self, out: dict, began: int) -> None:
        """retention.forget_exports after a gc here: git's gc of the private store runs on its
        own (a repack of a large store would hold up the mount)."""
        from . import retention
        try:
            out["exports"] = retention.forget_exports(
                os.path.dirname(self.path), retention.gone_sessions(self.calls.journal), began,
                pruned=bool(out.get("dropped")), wait=False)
        except Exception:  # the record is whole either way: the next gc looks again
            log.exception("forgetting the dropped sessions' exports failed")

    def writing(self) -> list[dict]:
        """The files a descriptor is open on for writing, each with the unit its writes go to
        and the live processes holding it: ``{"path", "unit", "ino", "holders": [{"pid",
        "key", "argv"}]}``.  A revert refuses such a file of what it undoes (its next write
        would land in the file the revert replaced) and names the holders, which the record
        cannot know once the call, its session and the `run` have ended (a descriptor a
        background process inherited).  One step on the trio thread: the /proc scan asks the
        mount nothing (state.write_holders)."""
        from .attribution import live_stat, read_actor
        handles = self.open_writes() if self.open_writes is not None else []
        if not handles:
            return []
        pids = state.write_holders(self.where(), {ino: path for path, _, ino in handles},
                                   {os.getpid()}) if self.workspace else {}
        actors: dict[int, dict] = {}
        for pid in {p for held in pids.values() for p in held}:
            st = live_stat(pid)
            if st is not None:
                actors[pid] = {"pid": pid, "key": f"{pid}:{st[0]}",
                               "argv": read_actor(pid).get("argv") or []}
        out, seen = [], set()
        for path, unit, ino in handles:
            if (path, unit) in seen:  # two opens of one file by one unit: said once
                continue
            seen.add((path, unit))
            out.append({"path": path, "unit": unit, "ino": ino,
                        "holders": [actors[p] for p in sorted(pids.get(ino, ()))
                                    if p in actors]})
        return out

    def gc_steps(self, req: dict, out: dict):
        """retention.gc_steps of this mount's record, the recorder's attic and the sessions
        still live (``req``: a gc request's policy and dry_run); ``out`` gets its answer."""
        from . import retention
        rec = self.recorder
        drop = getattr(rec, "_drop_attic", None)
        live = {s.id for s in self.calls.sessions.values() if s.ended is None}
        return retention.gc_steps(
            self.calls.journal, os.path.dirname(self.path), retention.Policy.from_json(req),
            out, live=live, attic_fd=getattr(rec, "attic_fd", None),
            dry_run=bool(req.get("dry_run")),
            drop_attic=(lambda name, st: drop(name, (st.st_dev, st.st_ino))) if drop else None)

    def release(self, caller: dict) -> dict:
        """End the mount if nothing works in it: no session live and no process (but the
        caller, the command that mounted for itself) with its directory or a file there.  One
        step on the trio thread, so that no session can begin between the look and the end;
        the /proc scan asks the mount nothing (state.mount_users)."""
        live = [s.id for s in self.calls.sessions.values() if s.ended is None]
        if live:
            return {"released": False, "sessions": live, "users": []}
        where = self.where()
        users = state.mount_users(where, {os.getpid(), caller["pid"]})
        if users:
            return {"released": False, "sessions": [], "users": users}
        beneath = state.beneath_refusal(where)
        if beneath:  # left for the user to decide (the mount stays, its daemon serves it)
            return {"released": False, "sessions": [], "users": [], "beneath": beneath}
        log.info("released by pid %d: nothing works in the mount: unmounting", caller["pid"])
        self.end(detach=True)
        return {"released": True}

    def end(self, detach: bool = False) -> None:
        """The mount ends: no session begins from here on.  ``detach``: nothing worked in it
        at the look (a release), and whatever comes to it since is served until it lets go
        (daemon._serve)."""
        self.ending = True
        self.stop(detach)

    def bind(self) -> None:
        """Bind before the mount is announced ready, so a client can connect at once."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # born 0600: no moment at which another user may connect
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)  # and 0600 whatever umask bind met (docs/storage.md)
        if self.owner_uid != os.geteuid():
            os.chown(self.path, self.owner_uid, -1)  # the workspace owner's agent may connect
        sock.listen(64)
        self._sock = sock

    def unbind(self) -> None:
        """Close the socket and remove its path (the mount it was bound for failed)."""
        sock = getattr(self, "_sock", None)  # bind() sets it
        if sock is not None:
            sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    async def serve(self) -> None:
        listener = trio.socket.from_stdlib_socket(self._sock)
        async with trio.open_nursery() as nursery:
            with listener:
                while True:
                    try:
                        conn, _ = await listener.accept()
                    except OSError as e:
                        if e.errno not in _SHORT_OF:
                            raise
                        # out of descriptors (a low `ulimit -n`): the caller's connection waits
                        # in the backlog until one is free; never the daemon's end (a dead
                        # mount over the workspace)
                        log.warning("control socket: cannot accept a connection now: %s", e)
                        await trio.sleep(0.1)
                        continue
                    nursery.start_soon(self._connection, conn)

    async def _connection(self, conn) -> None:
        with conn:
            try:
                pid, uid = peer(conn)
                caller = self.attribution.actor(pid)
                trusted = uid in (0, os.geteuid())
                buf = bytearray()
                while True:
                    chunk = await conn.recv(1 << 20)
                    if not chunk:
                        if buf.strip():  # a payload that ends with the connection (nc -N)
                            await conn.send(self._answer(bytes(buf), caller) + b"\n")
                        return
                    buf += chunk  # in place: a payload of megabytes is no quadratic copy
                    if len(buf) > MAX_REQUEST:
                        log.warning("a control request of more than %d bytes from pid %s: "
                                    "refused", MAX_REQUEST, caller.get("pid"))
                        return
                    if b"\n" not in chunk:  # only the new bytes can hold the line's end
                        continue
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        if not trusted and _owner_op(line):
                            await conn.send(json.dumps({
                                "ok": False, "error": "refused: only the user who mounted the "
                                "workspace, or root, may ask that"}).encode() + b"\n")
                            continue
                        if line.strip() == b'{"op": "underlay"}' and self.root_fd is not None:
                            # the engines read the tree beneath the mount through this fd;
                            # only the socket's owner (0600) can ask for it
                            await conn.sendmsg([b'{"ok": true}\n'], [(
                                socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                array.array("i", [self.root_fd]))])
                            continue
                        if line.lstrip().startswith(b"{") and b'"gc"' in line:
                            answer = await self._gc_answer(line)
                            if answer is not None:
                                out = memoryview(answer + b"\n")
                                while out:
                                    out = out[await conn.send(out):]
                                continue
                        out = memoryview(self._answer(line, caller) + b"\n")
                        while out:
                            out = out[await conn.send(out):]
            except OSError:
                return
            except Exception:  # one bad connection must never take the mount down
                log.exception("control connection failed")

    async def _gc_answer(self, line: bytes) -> bytes | None:
        """The answer to a ``gc`` request (None: the line is no gc request)."""
        try:
            req = json.loads(line)
        except ValueError:
            return None
        if not isinstance(req, dict) or req.get("op") != "gc":
            return None
        try:
            out = {"ok": True, **await self.run_gc(req)}
        except ValueError as e:
            out = {"ok": False, "error": f"bad request: {e}"}
        except RetentionError as e:  # said in one line: a revert under way, say
            out = {"ok": False, "error": str(e)}
        except Exception as e:  # the endpoint must never take the mount down
            log.exception("gc failed")
            out = {"ok": False, "error": f"gc failed: {e}"}
        return json.dumps(out).encode()

    def _answer(self, line: bytes, caller: dict) -> bytes:
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise ValueError("a request is a JSON object")
            if self.recorder is not None and req.get("op") not in _READING_OPS:
                # its record must find room (a full filesystem)
                self.recorder.room_to_record(str(req.get("op") or "hook"))
            out = {"ok": True, **self.handle(req, caller)}
        except MountEnding as e:
            out = {"ok": False, "error": str(e), "ending": True}
        except ControlError as e:
            out = {"ok": False, "error": str(e)}
        except (ValueError, KeyError, TypeError) as e:
            out = {"ok": False, "error": f"bad request: {e}"}
        except JournalError as e:  # the state dir full, say: said as it is, no traceback
            log.warning("control request not recorded: %s", e)
            out = {"ok": False, "error": f"not recorded: {e}"}
        except Exception as e:  # the endpoint must never take the mount down
            log.exception("control request failed")
            out = {"ok": False, "error": f"internal error: {e}"}
        return json.dumps(out).encode()
