"""The Python API of the control endpoint: announce sessions, turns and calls to the daemon
recording a workspace.

    from overlayrec import client
    c = client.connect()                 # OVERLAYREC_SOCKET, or the mount around the cwd
    c.call_begin("toolu_1", "Bash", summary="sed -i ...")
    ...
    c.call_end("toolu_1", status="ok")

Stdlib only and import-light: hooks run it on every tool call.
"""
from __future__ import annotations

import os

# the C module: `socket` pulls in enum and selectors, a third of a hook's start-up
import _socket as socket

from . import state, wire


class ClientError(Exception):
    """The daemon refused a request, or could not be reached; the message says which."""


class MountEnding(ClientError):
    """The mount is ending (its daemon let it go): mount anew."""


class NoMount(ClientError):
    """No overlayrec mount was found for this process."""


def find_socket(cwd: str | None = None) -> str:
    env = os.environ.get("OVERLAYREC_SOCKET")
    if env:
        return env
    try:
        here = os.path.realpath(cwd or os.getcwd())
    except OSError as e:
        raise NoMount(f"no overlayrec mount here ({e.strerror})") from None
    ws = state.overlayrec_mount_containing(here)
    if ws is None:
        raise NoMount(f"no overlayrec mount at or above {here}")
    return os.path.join(state.find_state_dir(ws), "control.sock")


# the requests that end a unit, which the daemon answers once it has sealed the unit's paths,
# and how long the client waits for that answer
_SEALING = frozenset({"call_end", "turn_end", "session_end", "revert_end"})
SEAL_TIMEOUT = 3600.0
TIMEOUT = 10.0  # how long any other request waits for its answer


def timeout_for(op: str) -> float:
    """How long a request for ``op`` waits for the daemon's answer."""
    return SEAL_TIMEOUT if op in _SEALING else TIMEOUT


class Client:
    def __init__(self, path: str, session: str | None = None, timeout: float = TIMEOUT):
        self.path = path
        self.session = session if session is not None else os.environ.get("OVERLAYREC_SESSION")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.timeout = timeout
        try:
            self.sock.connect(path)
        except OSError as e:
            self.sock.close()
            raise NoMount(f"cannot reach the daemon at {path}: {e.strerror or e}") from None
        self._buf = b""

    def request(self, op: str, **fields) -> dict:
        req = {"op": op, **{k: v for k, v in fields.items() if v is not None}}
        if "session" not in req and self.session and op not in ("ping", "status",
                                                                 "processes", "writing"):
            req["session"] = self.session
        # a unit's end seals every path it changed (a revert of 100,000 files: minutes), and
        # answers once they are: a timeout before then left a finished revert "pending"
        # (found by a hunt)
        self.sock.settimeout(max(self.timeout, SEAL_TIMEOUT) if op in _SEALING else
                             self.timeout)
        try:
            # a daemon gone meanwhile is an error said, not a SIGPIPE that ends the command
            # without a word (the CLI gives SIGPIPE its default action, for its output)
            self.sock.sendall(wire.dumps(req).encode() + b"\n", socket.MSG_NOSIGNAL)
            while b"\n" not in self._buf:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise ClientError("the daemon closed the connection")
                self._buf += chunk
        except OSError as e:
            raise ClientError(f"control request failed: {e.strerror or e}") from None
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            out = wire.loads(line.decode())
            if not isinstance(out, dict):
                raise ValueError("not an object")
        except (ValueError, UnicodeDecodeError):  # not our daemon (OVERLAYREC_SOCKET set
            # to another socket): said as that, not as an internal error (a bug hunt)
            raise ClientError("the control socket answered with no overlayrec answer (is "
                              "OVERLAYREC_SOCKET another program's?)") from None
        if not out.get("ok"):
            if out.get("ending"):
                raise MountEnding(out.get("error") or "the mount is ending")
            raise ClientError(out.get("error") or "request refused")
        return out

    def session_begin(self, session=None, runner=False, command=None):
        return self.request("session_begin", session=session, runner=runner or None,
                            command=command)

    def session_agent(self, pid: int, session=None):
        return self.request("session_agent", pid=pid, session=session)

    def session_end(self, session=None):
        return self.request("session_end", session=session)

    def turn_begin(self, prompt=None, session=None):
        return self.request("turn_begin", prompt=prompt, session=session)

    def turn_end(self, session=None, resume=None, again=False):
        """End the turn; ``resume`` and ``again`` for an agent's stop (Calls.turn_end)."""
        return self.request("turn_end", session=session, resume=resume, again=again or None)

    def call_begin(self, call_id, tool, summary=None, session=None):
        return self.request("call_begin", id=call_id, tool=tool, summary=summary, session=session)

    def call_end(self, call_id, status="ok", session=None):
        return self.request("call_end", id=call_id, status=status, session=session)

    def release(self):
        """Let the mount go if nothing works in it (ControlServer.release): ``released``, or
        the live ``sessions`` and the ``users`` that keep it."""
        return self.request("release")

    def status(self):
        return self.request("status")

    def processes(self):
        """The live processes of the sessions' calls, each with its unit (Calls.processes)."""
        return self.request("processes")["processes"]

    def writing(self):
        """The files a descriptor is open on for writing, each with its unit and the processes
        holding it (ControlServer.writing)."""
        return self.request("writing")["writing"]

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def underlay_fd(sock_path: str) -> int:
    """The daemon's fd of the directory beneath the mount (for engines that read the tree)."""
    import socket as stdsocket
    with stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM) as s:
        s.settimeout(10)
        try:
            s.connect(sock_path)
            s.sendall(b'{"op": "underlay"}\n', stdsocket.MSG_NOSIGNAL)  # EPIPE, not death
            msg, fds, _, _ = stdsocket.recv_fds(s, 4096, 1)
        except OSError as e:
            raise ClientError(f"cannot get the underlay from the daemon: {e.strerror or e}") \
                from None
    if not fds:
        raise ClientError("the daemon did not hand over the underlay")
    return fds[0]


def connect(session: str | None = None, cwd: str | None = None) -> Client:
    return Client(find_socket(cwd), session=session)
