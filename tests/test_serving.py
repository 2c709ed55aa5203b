"""overlayrec.serving, the stand-in pyfuse3 finds as ``trio``: a request already waiting is
read without a pass through trio's run loop, but never more than BURST in a row (the other
tasks, the control socket among them, still run under a stream of requests); under a stream
the next request is polled for up to SPIN; nothing waiting is trio's own wait; the readers' lock is taken without a checkpoint when free and waited for
when not; everything else is trio's.  The daemon serves with it in every mounted test."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pyfuse3
import trio

from overlayrec import serving

from conftest import needs_fuse


_CHECKPOINT = trio.lowlevel.checkpoint  # trio's own, whatever a test puts in its place


async def _spin(ran: list[int]) -> None:
    """Another task, always runnable: ``ran[0]`` counts the passes of the run loop it saw."""
    while True:
        ran[0] += 1
        await _CHECKPOINT()


def test_a_waiting_request_is_read_without_a_pass_but_never_more_than_burst_in_a_row(
        monkeypatch):
    a, b = socket.socketpair()
    passes = []  # how many times another task ran, as seen before each wait
    checkpoints = []  # the waits done when each pass through the run loop was given
    waits = []  # the waits that went to trio's own
    real_wait, real_checkpoint = trio.lowlevel.wait_readable, trio.lowlevel.checkpoint

    async def counted_wait(fd):
        waits.append(len(passes))
        await real_wait(fd)

    async def counted_checkpoint():
        checkpoints.append(len(passes) - 1)
        await real_checkpoint()

    async def main():
        readable = serving._Readable()
        ran = [0]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_spin, ran)
            await real_checkpoint()  # the other task is under way
            monkeypatch.setattr(trio.lowlevel, "wait_readable", counted_wait)
            monkeypatch.setattr(trio.lowlevel, "checkpoint", counted_checkpoint)
            b.send(b"x")  # a request waits, and stays (nothing reads it)
            for _ in range(3 * serving.BURST + 1):
                passes.append(ran[0])
                await readable(a.fileno())
            passes.append(ran[0])
            a.recv(1)
            with trio.move_on_after(0.05) as scope:  # nothing waits: trio's own wait
                await readable(a.fileno())
            assert scope.cancelled_caught
            monkeypatch.undo()
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        a.close()
        b.close()
    # BURST waits in a row return at once, then the next one gives the run loop a pass first,
    # where the other task runs (in that pass or the next: trio orders a batch at random);
    # the last is trio's own as nothing waits
    k = serving.BURST
    assert checkpoints == [k, 2 * k, 3 * k], checkpoints
    assert waits == [3 * k + 2], waits
    assert passes[:k + 1] == [passes[0]] * (k + 1), passes  # the first BURST: it never ran
    assert passes[-1] > passes[0], passes


class _Clock:
    """A stand-in for time.perf_counter, and a poll on a request that comes at ``ready``:
    each poll takes 10 us of this clock, and trio's wait lasts until the request is there."""

    def __init__(self):
        self.now = 100.0
        self.ready = 0.0
        self.polls = self.waits = 0

    def __call__(self) -> float:
        return self.now

    def poll(self, timeout):
        assert timeout == 0, "a poll with a timeout lets the CPU go idle"
        self.polls += 1
        self.now += 10e-6
        return [(0, 1)] if self.now >= self.ready else []

    async def wait_readable(self, fd):
        self.waits += 1
        self.now = max(self.now, self.ready)

    def request_in(self, seconds: float) -> None:
        self.ready = self.now + seconds
        self.polls = self.waits = 0


def _serve(monkeypatch, spin: float, gaps) -> list[tuple[int, int]]:
    """Requests coming ``gaps`` apart, each read through one ``_Readable`` with SPIN ``spin``
    on the fake clock: (trio waits, polls) for each."""
    clock = _Clock()
    monkeypatch.setattr(serving, "SPIN", spin)
    monkeypatch.setattr(serving.time, "perf_counter", clock)
    monkeypatch.setattr(trio.lowlevel, "wait_readable", clock.wait_readable)
    seen = []

    async def main():
        readable = serving._Readable()
        readable._polls[7] = clock
        for gap in gaps:
            clock.request_in(gap)
            await readable(7)
            seen.append((clock.waits, clock.polls))

    trio.run(main)
    return seen


def test_under_a_stream_the_next_request_is_polled_for_and_a_slower_one_is_waited_for(
        monkeypatch):
    """Polling for up to SPIN keeps the daemon's CPU from going idle between a stream's
    requests (docs/bench.md, "Serving, second pass"); a request slower than SPIN is waited for
    in trio, and the polling stays off until the requests come faster again."""
    seen = _serve(monkeypatch, 200e-6,
                  (50e-6, 100e-6, 150e-6, 1e-3, 100e-6, 100e-6, 300e-6, 300e-6, 0.0))
    assert seen == [
        (1, 1),    # the first: not a stream yet, waited for (after the one look)
        (0, 10),   # 50 us came, now a stream: polled for, found after 100 us
        (0, 15),   # and again
        (1, 21),   # 1 ms: polled for 200 us (20 polls after the look), then waited for
        (1, 1),    # no longer a stream: waited for at once
        (0, 10),   # 100 us came within SPIN: a stream again
        (1, 21),   # 300 us: slower than SPIN, waited for after polling
        (1, 1),    # and the next not polled for
        (0, 1),    # a request already there is read at the first look
    ], seen


def test_no_polling_when_spin_is_zero(monkeypatch):
    seen = _serve(monkeypatch, 0.0, (50e-6, 50e-6, 50e-6))
    assert seen == [(1, 1)] * 3, seen


def test_the_readers_lock_is_free_without_a_checkpoint_and_waited_for_when_held():
    order = []

    async def main():
        lock = serving._Lock()
        ran = [0]

        async def holder(task_status=trio.TASK_STATUS_IGNORED):
            async with lock:
                task_status.started()
                order.append("held")
                await trio.sleep(0.02)
                order.append("let go")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_spin, ran)
            await trio.lowlevel.checkpoint()
            before = ran[0]
            async with lock:  # free: no pass through the run loop
                pass
            assert ran[0] == before
            await nursery.start(holder)
            async with lock:  # held: waited for
                order.append("taken")
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert order == ["held", "let go", "taken"]


def test_the_readers_lock_is_held_by_one_task_at_a_time_and_survives_a_cancelled_waiter():
    inside, most, done = [0], [0], []

    async def main():
        lock = serving._Lock()

        async def worker(i):
            for _ in range(5):
                async with lock:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                    await trio.sleep(0.001)  # held across passes of the run loop
                    inside[0] -= 1
            done.append(i)

        with trio.fail_after(5):
            async with lock:
                with trio.move_on_after(0.01):  # a waiter cancelled while it waits
                    async with trio.open_nursery() as waiting:
                        waiting.start_soon(lock.__aenter__)
                        await trio.sleep(1)
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(worker, i)

    trio.run(main)
    assert most[0] == 1 and sorted(done) == [0, 1, 2], (most, done)


def test_install_gives_pyfuse3_trio_but_for_the_lock_and_the_wait():
    try:
        serving.install()
        fake = pyfuse3.trio
        assert fake is not trio
        assert fake.Lock is serving._Lock
        assert isinstance(fake.lowlevel.wait_readable, serving._Readable)
        # the rest is trio's own: what pyfuse3 uses besides
        assert fake.open_nursery is trio.open_nursery
        assert fake.ClosedResourceError is trio.ClosedResourceError
        assert fake.from_thread is trio.from_thread
        for name in ("current_task", "current_trio_token", "notify_closing"):
            assert getattr(fake.lowlevel, name) is getattr(trio.lowlevel, name)
    finally:
        serving.uninstall()
    assert pyfuse3.trio is trio


@needs_fuse
def test_the_control_socket_is_served_under_requests_that_never_stop(make_mount):
    """Processes opening and closing a file through the mount without a pause: the daemon
    still answers its control socket (what every hook talks to) while the stream goes on.
    (The stream leaves gaps a look-first wait falls through; that a stream without any gap
    still yields every BURST requests is the first test's.)"""
    from overlayrec import client
    m = make_mount()
    (open(os.path.join(m.ws, "r"), "w")).close()
    m.mount()
    # four of them, so that a request nearly always waits
    busy = [subprocess.Popen(
        [sys.executable, "-c", "import os, time\nend = time.monotonic() + 60\n"
         "while time.monotonic() < end:\n    os.close(os.open('r', os.O_RDONLY))"], cwd=m.ws)
        for _ in range(4)]
    try:
        time.sleep(0.3)  # the stream is under way
        for _ in range(20):
            with client.Client(os.path.join(m.state, "control.sock"), timeout=30) as c:
                assert c.request("ping")["pid"] > 0
        assert all(b.poll() is None for b in busy), "answered only after the stream ended"
    finally:
        for b in busy:
            b.kill()
            b.wait()


def test_spin_from_the_environment(monkeypatch):
    for value, want in (("0", 0.0), ("120", 120e-6), ("-5", 50e-6), ("fast", 50e-6),
                        ("nan", 50e-6), ("inf", 50e-6), ("10000", 0.01), ("10001", 50e-6)):
        monkeypatch.setenv("OVERLAYREC_SPIN_US", value)
        assert serving._spin_from_env() == want, value
    monkeypatch.delenv("OVERLAYREC_SPIN_US")
    assert serving._spin_from_env() == 50e-6
