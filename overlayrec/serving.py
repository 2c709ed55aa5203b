"""How pyfuse3's request loop runs under trio in the daemon: fewer trips through trio's
scheduler per request.

pyfuse3 reads each request in ``_session_loop``: it takes a ``trio.Lock`` (its readers'
lock), then ``await trio.lowlevel.wait_readable`` on /dev/fuse, then reads and dispatches.
Both awaits go through trio's run loop every time, the lock's even when nobody holds it
(``Lock.acquire`` ends in a checkpoint) and the wait's even when a request is already waiting
(an epoll registration, an ``epoll_wait``, a reschedule): about 2.3 passes of the run loop a
request, most of what a request costs at the floor (docs/bench.md, "Per request, against the
floor").

pyfuse3 finds trio through its module attribute ``pyfuse3.trio``, which it documents as
replaceable (``pyfuse3.asyncio.enable`` swaps in an asyncio layer the same way).  ``install``
puts a thin stand-in there, trio itself for everything but two things:

- ``Lock``: taken without a checkpoint when it is free (the daemon serves with one worker
  task, so it always is), waited for as trio's own when it is not;
- ``lowlevel.wait_readable``: returns at once when the fd already polls readable, for up to
  ``BURST`` requests in a row; then, and whenever nothing waits, it is trio's own.  So under a
  stream of requests the run loop still gets a pass every ``BURST`` requests: the control
  socket, the journal's committer and signals are served within a few requests' time, and
  a cancellation (``pyfuse3.terminate``) is seen there, or at the session's exit flag, which
  pyfuse3 checks before every request.

Nothing else about serving changes: the same requests, answered in the same order by the same
handlers.
"""
from __future__ import annotations

import select
import sys
import types

import pyfuse3
import trio

# requests read without a pass through trio's run loop, at most, before one
BURST = 8


class _Lock:
    """trio.Lock, taken without a checkpoint when free."""
    __slots__ = ("_lock",)

    def __init__(self):
        self._lock = trio.Lock()

    async def __aenter__(self) -> None:
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    async def __aexit__(self, *exc) -> bool:
        self._lock.release()
        return False


class _Readable:
    """``wait_readable`` that looks first (a poll with no timeout), BURST times in a row."""
    __slots__ = ("_polls", "_run")

    def __init__(self):
        self._polls: dict[int, select.poll] = {}
        self._run = 0  # requests found waiting since the last pass through the run loop

    async def __call__(self, fd) -> None:
        if self._run < BURST:
            p = self._polls.get(fd)
            if p is None:
                p = self._polls[fd] = select.poll()
                p.register(fd, select.POLLIN)
            if p.poll(0):
                self._run += 1
                return
        self._run = 0
        await trio.lowlevel.wait_readable(fd)


class _Facade(types.ModuleType):
    """What pyfuse3 sees as ``trio``: trio's own attributes, but for the two above."""

    def __getattr__(self, name):
        return getattr(trio, name)


class _Lowlevel(types.ModuleType):
    """trio.lowlevel, but for wait_readable."""

    def __init__(self, readable: _Readable):
        super().__init__("trio.lowlevel")
        self.wait_readable = readable

    def __getattr__(self, name):
        return getattr(trio.lowlevel, name)


def install() -> None:
    """Serve pyfuse3's request loop with the stand-in (before ``pyfuse3.main``)."""
    facade = _Facade("trio")
    facade.Lock = _Lock  # type: ignore[attr-defined]
    facade.lowlevel = _Lowlevel(_Readable())  # type: ignore[attr-defined]
    pyfuse3.trio = facade  # type: ignore[attr-defined]


def uninstall() -> None:
    """pyfuse3 on trio itself again (the tests' way back)."""
    pyfuse3.trio = sys.modules["trio"]  # type: ignore[attr-defined]
