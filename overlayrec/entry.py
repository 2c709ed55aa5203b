"""The `overlayrec` command's entry point.

Agent hooks run on every tool call, so `overlayrec hook AGENT` skips the CLI framework and goes
straight to the agent registry (no click, no LMDB: a few milliseconds instead of ~100).  The
readers (`calls`, `turns`, `diff`) on a plain command line skip click too (fastcli); anything
else goes to the CLI.
"""
import gc
import os
import sys


def main():
    std_fds_open()
    args = sys.argv[1:]
    if len(args) == 2 and args[0] == "hook" and not args[1].startswith("-"):
        from .agents import run_hook
        sys.exit(run_hook(args[1]))
    # the CLI's imports make tens of thousands of objects and no garbage: the cycle collector
    # only walks them over and over (~4 ms of every command's start); cli.main turns it back on
    gc.disable()
    deep_enough()
    if args and args[0] in ("calls", "turns", "diff"):
        from .fastcli import run
        code = run(args)
        if code is not None:
            _leave(code)
    from .cli import main as cli_main
    cli_main()


def std_fds_open() -> None:
    """A stdin, stdout or stderr the caller closed is opened on /dev/null: else the first
    files the command opens take their numbers (the mount's lock as 0, the daemon's ready
    pipe as 1 and 2), and the daemon, whose log goes on 2, wrote its "ready" into its log:
    `mount` failed without a word and left the mount, `run` never ran its command (found
    by a bug hunt)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def deep_enough() -> None:
    """The readers walk a path's directories recursively (git trees, a replay's tree): a
    workspace path may be some 2,000 directories deep within PATH_MAX, past Python's default
    of 1,000 frames (a RecursionError in diff, replay and report: found by a hunt)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), RECURSION_LIMIT))


RECURSION_LIMIT = 20_000


def _leave(code: int) -> None:
    """Exit with ``code`` once a reader has answered, without the interpreter's teardown: its
    answer is written and flushed and its files and journal closed, so what the teardown does
    is free, one object at a time, the rows it listed and every module it imported (~20 ms of
    a 150 ms ``calls`` of 10,000 rows; docs/bench.md)."""
    for f in (sys.stdout, sys.stderr):
        try:
            if f is not None:
                f.flush()
        except (OSError, ValueError):
            code = code or 1  # what could not be written is the answer's failure
    os._exit(code)
