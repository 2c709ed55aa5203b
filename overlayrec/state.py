"""Where things live: a workspace's state dir, the record of its running daemon, and what the
kernel's mount table says about it.  Plain files and /proc only; no journal, no FUSE.
"""
from __future__ import annotations

import errno
import os

FSNAME = "overlayrec"
# what a FUSE mount whose daemon died answers: "Transport endpoint is not connected", or
# "Software caused connection abort" when the connection was aborted under a request
DEAD_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)


class StateError(Exception):
    """A user-facing problem with a workspace or state dir; the message is one line."""


def resolve_workspace(path: str, must_exist: bool = True) -> str:
    ws = os.path.realpath(os.path.abspath(path))
    if must_exist:
        try:
            st = os.stat(ws)
        except OSError as e:
            if e.errno in DEAD_ERRNOS:  # a dead mount is still a workspace
                return ws
            raise StateError(f"workspace {path}: {e.strerror}") from None
        import stat as _s
        if not _s.S_ISDIR(st.st_mode):
            raise StateError(f"workspace {path}: not a directory")
    return ws


def state_home() -> str:
    return os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")


def workspace_id(ws: str) -> str:
    import hashlib  # not at module level: hooks import this module on every tool call
    h = hashlib.sha256(ws.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    return f"{os.path.basename(ws) or 'root'}-{h}"


def default_state_dir(ws: str) -> str:
    return os.path.join(state_home(), "overlayrec", workspace_id(ws))


def registry_path(ws: str) -> str:
    """Points at a workspace's state dir, wherever --state-dir put it."""
    return os.path.join(state_home(), "overlayrec", "mounts", workspace_id(ws) + ".json")


def check_state_dir(ws: str, state_dir: str) -> str:
    sd = os.path.realpath(os.path.abspath(state_dir))
    if sd == ws or sd.startswith(ws.rstrip("/") + "/"):
        raise StateError(f"state dir {state_dir} is inside the workspace; put it outside")
    return sd


def write_registry(ws: str, state_dir: str) -> None:
    p = registry_path(ws)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    tmp = p + ".tmp"
    import json
    with open(tmp, "w") as f:
        json.dump({"workspace": ws, "state_dir": state_dir}, f)
    os.replace(tmp, p)


def find_state_dir(ws: str) -> str:
    from . import wire  # not json: hooks come through here on every tool call
    try:
        with open(registry_path(ws)) as f:
            return wire.loads(f.read())["state_dir"]
    except (OSError, ValueError, KeyError):
        return default_state_dir(ws)


def daemon_info(state_dir: str) -> dict | None:
    from . import wire
    try:
        with open(os.path.join(state_dir, "daemon.json")) as f:
            info = wire.loads(f.read())
    except (OSError, ValueError):
        return None
    return info


def pid_alive(pid: int) -> bool:
    """True while the process runs (a zombie waiting to be reaped does not count)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return False
    return raw[raw.rfind(b")") + 2:][:1] not in (b"Z", b"X")


def _unescape(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as octal
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def fuse_mount_at(path: str) -> dict | None:
    """The FUSE mount whose mountpoint is exactly ``path`` (the topmost one), or None."""
    found = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                lf, rf = left.split(), right.split()
                if len(lf) < 5 or len(rf) < 2:
                    continue
                if _unescape(lf[4]) == path and rf[0].startswith("fuse"):
                    found = {"fstype": rf[0], "source": _unescape(rf[1])}
    except OSError:
        return None
    return found


def overlayrec_mounts() -> list[str]:
    """Mountpoints of every overlayrec mount, from the mount table."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                lf, rf = left.split(), right.split()
                if len(lf) >= 5 and rf and rf[0] == "fuse." + FSNAME:
                    out.append(_unescape(lf[4]))
    except OSError:
        pass
    return out


def overlayrec_mount_containing(path: str) -> str | None:
    best = None
    for mp in overlayrec_mounts():
        if path == mp or path.startswith(mp.rstrip("/") + "/"):
            if best is None or len(mp) > len(best):
                best = mp
    return best


def mount_id_at(path: str) -> int | None:
    found = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                lf = line.split(" - ")[0].split()
                if len(lf) >= 5 and _unescape(lf[4]) == path:
                    found = int(lf[0])
    except OSError:
        return None
    return found


def underlay_holders(ws: str, exclude: set[int]) -> list[dict]:
    """Processes whose working directory or open files inside ``ws`` were taken before the
    mount: they see the underlay and bypass recording."""
    mnt = mount_id_at(ws)
    try:
        mount_dev = os.stat(ws).st_dev
    except OSError:
        return []
    inside = lambda p: p == ws or p.startswith(ws.rstrip("/") + "/")
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in exclude:
            continue
        pid = int(name)
        what = []
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            if inside(cwd) and os.stat(f"/proc/{pid}/cwd").st_dev != mount_dev:
                what.append(f"cwd {cwd}")
        except OSError:
            pass
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if not inside(target):
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    info = dict(l.split(":", 1) for l in f.read().splitlines() if ":" in l)
                if mnt is not None and int(info.get("mnt_id", "-1")) != mnt:
                    what.append(f"fd {fd} {target}")
            except (OSError, ValueError):
                continue
        if what:
            try:
                with open(f"/proc/{pid}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                comm = "?"
            out.append({"pid": pid, "command": comm, "holds": what})
    return out


def mount_answers(path: str, timeout: float = 3.0) -> bool | None:
    """Does the daemon answer a statfs within ``timeout``?  None: it answers with an error."""
    import threading
    out: list = []

    def probe():
        try:
            os.statvfs(path)
            out.append(True)
        except OSError:
            out.append(None)
    t = threading.Thread(target=probe, daemon=True)  # a hung request stays behind, harmlessly
    t.start()
    t.join(timeout)
    return out[0] if out else False


def is_dead_mount(path: str) -> bool:
    # statfs always reaches the daemon; stat may be answered from the kernel's attribute cache
    try:
        os.statvfs(path)
        return False
    except OSError as e:
        return e.errno in DEAD_ERRNOS
