"""overlayrec.serving, the stand-in pyfuse3 finds as ``trio``: a request already waiting is
read without a pass through trio's run loop, but never more than BURST in a row (the other
tasks, the control socket among them, still run under a stream of requests); nothing waiting
is trio's own wait; the readers' lock is taken without a checkpoint when free and waited for
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


async def _spin(ran: list[int]) -> None:
    """Another task, always runnable: ``ran[0]`` counts the passes of the run loop it saw."""
    while True:
        ran[0] += 1
        await trio.lowlevel.checkpoint()


def test_a_waiting_request_is_read_without_a_pass_but_never_more_than_burst_in_a_row(
        monkeypatch):
    a, b = socket.socketpair()
    passes = []  # how many times another task ran, as seen before each wait
    waits = []  # the waits that went to trio's own (a pass through the run loop each)
    real = trio.lowlevel.wait_readable

    async def counted(fd):
        waits.append(len(passes))
        await real(fd)
    monkeypatch.setattr(trio.lowlevel, "wait_readable", counted)

    async def main():
        readable = serving._Readable()
        ran = [0]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_spin, ran)
            await trio.lowlevel.checkpoint()  # the other task is under way
            b.send(b"x")  # a request waits, and stays (nothing reads it)
            for _ in range(3 * (serving.BURST + 1)):
                passes.append(ran[0])
                await readable(a.fileno())
            passes.append(ran[0])
            a.recv(1)
            with trio.move_on_after(0.05) as scope:  # nothing waits: trio's own wait
                await readable(a.fileno())
            assert scope.cancelled_caught
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        a.close()
        b.close()
    # BURST waits in a row return at once, then one is trio's own: a pass through the run
    # loop, where the other task runs (in that pass or the next: trio orders a batch at
    # random); the last is trio's own as nothing waits
    k = serving.BURST + 1
    assert waits == [k, 2 * k, 3 * k, 3 * k + 1], waits
    assert passes[:k] == [passes[0]] * k, passes  # the first BURST: the other task never ran
    assert passes[-1] > passes[0], passes


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
