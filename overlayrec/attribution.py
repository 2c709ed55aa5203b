"""Attribution: who is making a request.

The kernel gives each FUSE request the caller's thread id.  An *actor* is the process behind it,
identified by (tgid, start time) so that a reused pid can never be mistaken for an earlier
process.  Actors are read from /proc once and cached; the cache entry is trusted only while the
process's start time still matches.

Tool calls, turns and sessions (the units a later layer maps actors to) build on this; for now
an actor is its own attribution unit.
"""
from __future__ import annotations

import os
import select
import time

UNKNOWN = {"key": "0:0", "pid": 0, "start": 0, "ppid": 0, "uid": -1, "exe": None,
           "argv": [], "cwd": None}


def _read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 65536)
    except OSError:
        return None
    finally:
        os.close(fd)


def in_group(pid: int, gid: int, group: int) -> bool:
    """Is the process ``pid`` (of group ``gid``) of ``group``: its own, or a supplementary
    group (/proc/PID/status)?  Not known (the process gone): taken for yes, which keeps a
    set-group-ID bit the kernel might have cleared rather than clearing one it would have
    kept (fs.Operations._drop_set_ids)."""
    if gid == group:
        return True
    status = _read(f"/proc/{pid}/status")
    for line in (status or b"").splitlines():
        if line.startswith(b"Groups:"):
            return str(group).encode() in line.split()[1:]
    return True


def proc_start_and_ppid(pid: int) -> tuple[int, int] | None:
    """(start time in clock ticks since boot, ppid) from /proc/<pid>/stat."""
    raw = _read(f"/proc/{pid}/stat")
    if raw is None:
        return None
    # comm may hold spaces and parens: fields resume after the last ')'
    rest = raw[raw.rfind(b")") + 2:].split()
    return int(rest[19]), int(rest[1])


def alive(key: str | None) -> bool:
    """Is the process of ``key`` ("pid:start tick", an actor's key) still running (not exited,
    not a zombie, and not a later process given its pid)?"""
    if not key:
        return False
    pid, _, start = key.partition(":")
    st = live_stat(int(pid))
    return st is not None and str(st[0]) == start


def live_stat(pid: int) -> tuple[int, int] | None:
    """(start tick, ppid) of a process that has not exited: None when it is gone or a zombie
    (which keeps its /proc entry until reaped, and nobody may reap an orphan's in a container
    whose init does not)."""
    raw = _read(f"/proc/{pid}/stat")
    if raw is None:
        return None
    rest = raw[raw.rfind(b")") + 2:].split()
    if len(rest) < 20 or rest[0] in (b"Z", b"X", b"x"):
        return None
    return int(rest[19]), int(rest[1])


def tgid_of(tid: int) -> int:
    raw = _read(f"/proc/{tid}/status")
    if raw:
        for line in raw.splitlines():
            if line.startswith(b"Tgid:"):
                return int(line.split()[1])
    return tid


def read_actor(pid: int) -> dict:
    """Everything we record once about a process; missing fields when it has already gone."""
    st = proc_start_and_ppid(pid)
    if st is None:
        return dict(UNKNOWN, key=f"{pid}:0", pid=pid)
    start, ppid = st
    uid = -1
    raw = _read(f"/proc/{pid}/status")
    if raw:
        for line in raw.splitlines():
            if line.startswith(b"Uid:"):
                uid = int(line.split()[1])
                break
    argv_raw = _read(f"/proc/{pid}/cmdline") or b""
    # an empty argument inside is one (`sh -c '...' '' x`: dropped, the command read as
    # another; found by a bug hunt); trailing NULs are the list's end, or a process's title
    # padding (setproctitle)
    argv = [a.decode("utf-8", "surrogateescape")
            for a in argv_raw.rstrip(b"\0").split(b"\0")] if argv_raw.strip(b"\0") else []

    def link(name):
        try:
            return os.readlink(f"/proc/{pid}/{name}")
        except OSError:
            return None

    return {"key": f"{pid}:{start}", "pid": pid, "start": start, "ppid": ppid, "uid": uid,
            "exe": link("exe"), "argv": argv, "cwd": link("cwd"), "first_seen": time.time_ns()}


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _watch(pidfd: int) -> select.poll:
    """A poller of ``pidfd``, kept with it: asked on every request of its process, so made
    once (not select(): the daemon holds fds far above FD_SETSIZE)."""
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return p


def _exited(watch: select.poll) -> bool:
    """A pidfd polls readable once its process has exited."""
    return bool(watch.poll(0))


# Threads whose actors are cached (least recently used dropped first): the cache serves the
# threads other than a process's main one, and a request served after its process exited; a
# mount's lifetime of processes must not grow the daemon (issue 16: flat memory).
CACHED = 1024
# Main threads' pidfds held before the exited among them are let go (then twice the living).
SWEEP = 256


class Attribution:
    """Caches tid -> actor.

    A cached actor is trusted only while its process is provably the same one: for a process's
    main thread (tid == pid, nearly every writer) a pidfd held since first sight says whether it
    has exited, at the cost of one poll instead of reading /proc; other threads are checked
    against their start time in /proc on every use.  Both caches are bounded: the pidfds of
    exited processes are let go in sweeps (``_evict``), and the tid cache keeps the ``CACHED``
    most recently used threads.
    """

    def __init__(self, own_pid: int | None = None):
        # tid -> (start time, actor), least recently used first, at most CACHED of them
        self._by_tid: dict[int, tuple[int, dict]] = {}
        # pid -> (pidfd, actor, its poller), main threads only
        self._live: dict[int, tuple[int, dict, select.poll]] = {}
        self._cached = CACHED
        self._sweep_at = SWEEP  # _live's size at which the exited are let go (_evict)
        self.own_pid = own_pid or os.getpid()

    def actor(self, tid: int) -> dict:
        if tid <= 0:
            return UNKNOWN
        live = self._live.get(tid)
        if live is not None:
            if not _exited(live[2]):
                return live[1]
            os.close(live[0])
            del self._live[tid]
            self._keep(tid, live[1])  # a request it sent before it exited is still its own
        actor = self._actor_from_proc(tid)
        if actor["pid"] == tid and actor["start"]:
            fd = _pidfd(tid)
            if fd is not None:
                # the pidfd is taken after the start time was read: check it is the same process
                st = proc_start_and_ppid(tid)
                if st is not None and st[0] == actor["start"]:
                    if len(self._live) >= self._sweep_at:
                        self._evict()
                    self._live[tid] = (fd, actor, _watch(fd))
                else:
                    os.close(fd)
        return actor

    def _evict(self) -> None:
        """Let the pidfds of exited processes go (their actors stay in the tid cache, as the
        last process known there).  The next sweep waits until twice as many as the living
        are held, so a crowd of running writers costs no sweep per new process."""
        for pid, (fd, actor, watch) in list(self._live.items()):
            if _exited(watch):
                os.close(fd)
                del self._live[pid]
                self._keep(pid, actor)
        self._sweep_at = max(SWEEP, 2 * len(self._live))

    def _keep(self, tid: int, actor: dict) -> None:
        """An exited process's actor stays known for its tid (its cache entry, else ``actor``),
        as the most recently used."""
        self._put(tid, self._by_tid.get(tid) or (actor["start"], actor))

    def _put(self, tid: int, entry: tuple[int, dict]) -> None:
        """``entry`` is ``tid``'s, the most recently used; past CACHED entries, the least
        recently used go."""
        self._by_tid.pop(tid, None)
        self._by_tid[tid] = entry
        while len(self._by_tid) > self._cached:
            del self._by_tid[next(iter(self._by_tid))]

    def _actor_from_proc(self, tid: int) -> dict:
        st = proc_start_and_ppid(tid)
        cached = self._by_tid.get(tid)
        if st is None:
            # gone already: the best we know is the last process seen there, else a pid
            # without a start time
            if cached is None:
                return dict(UNKNOWN, key=f"{tid}:0", pid=tid)
            self._put(tid, cached)
            return cached[1]
        if cached is None or cached[0] != st[0]:
            cached = (st[0], read_actor(tgid_of(tid)))
        self._put(tid, cached)
        return cached[1]
