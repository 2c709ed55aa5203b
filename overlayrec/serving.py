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
  task, so it always is), waited for in a trio parking lot when it is not;
- ``lowlevel.wait_readable``: returns at once when the fd already polls readable; when it
  does not, and the last request came soon after the wait for it began (a stream: ``tar``,
  ``rm -r``, a formatter), it polls again for up to ``SPIN`` seconds before it parks in
  trio's own wait.  After ``BURST`` requests read so, a checkpoint gives the run loop a pass.
  So under a stream of requests the control socket, the journal's committer and signals are
  served within a few requests' time, and a cancellation (``pyfuse3.terminate``) is seen
  there, or at the session's exit flag, which pyfuse3 checks before every request.

Why poll a little before parking (docs/bench.md, "Serving, second pass"): a process making one
syscall after another sends its next request some tens of microseconds after our reply.
Parked in ``epoll_wait``, the daemon's CPU goes idle, and on a virtual machine an idle vCPU
halts: each request then costs a wake-up through the hypervisor, and the daemon runs with
caches that the host gave to something else meanwhile.  Measured on a 2-vCPU VM (tools/bench,
two runs each way), the whole bench took 0.85x the time through overlayrec with the polling
(an untar 0.67x), and the daemon 0.81x the CPU time.  Polled for, the next request of a
stream came within 4 us (median; 41 us at the 99th percentile), so ``SPIN`` is short: the
polling happens only while requests come faster than it (the gap before the last one is
measured), a slower stream or an idle mount costs none, and the end of a stream one ``SPIN``
(200 us cost pip and compileall a fifth more server CPU time; 50 us, nothing measurable).

Nothing else about serving changes: the same requests, answered in the same order by the same
handlers.
"""
from __future__ import annotations

import os
import select
import sys
import time
import types

import pyfuse3
import trio

# requests read without a pass through trio's run loop, at most, before one
BURST = 8


def _spin_from_env(default_us: float = 50.0) -> float:
    """SPIN in seconds: OVERLAYREC_SPIN_US (microseconds, for a bench; 0: never poll), the
    default when it is unset or not a number from 0 to 10,000 (a longer polling would hold
    the run loop's other tasks up for as long)."""
    try:
        us = float(os.environ.get("OVERLAYREC_SPIN_US", default_us))
    except ValueError:
        return default_us / 1e6
    return us / 1e6 if 0 <= us <= 10_000 else default_us / 1e6


# seconds to keep polling for the next request of a stream before parking in trio's wait
SPIN = _spin_from_env()


class _Lock:
    """A lock for pyfuse3's readers: a flag when free (the daemon serves with one worker task,
    so it always is), a trio ParkingLot to wait in when not.  trio.Lock's bookkeeping (its
    owner task, the parking lot's breakers: some 1.5 us a request, taken and given back on
    every request) buys error checks for misuse pyfuse3 never makes."""
    __slots__ = ("_held", "_lot")

    def __init__(self):
        self._held = False
        self._lot = trio.lowlevel.ParkingLot()

    async def __aenter__(self) -> None:
        while self._held:
            await self._lot.park()  # woken by a release; another may have taken it first
        self._held = True

    async def __aexit__(self, *exc) -> bool:
        self._held = False
        if self._lot:
            self._lot.unpark()
        return False


class _Readable:
    """``wait_readable`` that looks first (a poll with no timeout), and under a stream of
    requests polls for up to SPIN before it parks; a checkpoint every BURST requests."""
    __slots__ = ("_polls", "_run", "_stream")

    def __init__(self):
        self._polls: dict[int, select.poll] = {}
        self._run = 0  # requests read since the last pass through the run loop
        self._stream = False  # the last request came within SPIN of its wait's start

    async def __call__(self, fd) -> None:
        if self._run >= BURST:
            self._run = 0
            await trio.lowlevel.checkpoint()  # the other tasks' turn
        p = self._polls.get(fd)
        if p is None:
            p = self._polls[fd] = select.poll()
            p.register(fd, select.POLLIN)
        if p.poll(0):
            self._run += 1
            return
        start = time.perf_counter()
        if self._stream and _polled(p, start + SPIN):
            self._run += 1
            return
        self._run = 0
        await trio.lowlevel.wait_readable(fd)
        # polling pays while the requests come within SPIN of the wait's start (a polling
        # that found none counts as waited: a stream slower than SPIN is never polled for)
        self._stream = time.perf_counter() - start < SPIN


def _polled(p: select.poll, end: float) -> bool:
    """Did ``p`` poll readable before ``end`` (``time.perf_counter``), polled without a
    timeout again and again (a poll with a timeout would let the CPU go idle: what this is
    here to avoid)?"""
    while time.perf_counter() < end:
        if p.poll(0):
            return True
    return False


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
