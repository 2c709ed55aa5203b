"""The `overlayrec` command's entry point.

Agent hooks run on every tool call, so `overlayrec hook AGENT` skips the CLI framework and goes
straight to the agent registry (no click, no LMDB: a few milliseconds instead of ~100).  The
readers (`calls`, `turns`, `diff`) on a plain command line skip click too (fastcli); anything
else goes to the CLI.
"""
import gc
import sys


def main():
    args = sys.argv[1:]
    if len(args) == 2 and args[0] == "hook" and not args[1].startswith("-"):
        from .agents import run_hook
        sys.exit(run_hook(args[1]))
    # the CLI's imports make tens of thousands of objects and no garbage: the cycle collector
    # only walks them over and over (~4 ms of every command's start); cli.main turns it back on
    gc.disable()
    if args and args[0] in ("calls", "turns", "diff"):
        from .fastcli import run
        code = run(args)
        if code is not None:
            sys.exit(code)
    from .cli import main as cli_main
    cli_main()
