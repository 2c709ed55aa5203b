"""The `overlayrec` command's entry point.

Agent hooks run on every tool call, so `overlayrec hook claude-code` skips the CLI framework
and goes straight to the adapter (no click, no LMDB: a few milliseconds instead of ~100).
"""
import sys


def main():
    if sys.argv[1:] == ["hook", "claude-code"]:
        from .hooks import run_claude_code_hook
        sys.exit(run_claude_code_hook())
    from .cli import main as cli_main
    cli_main()
