"""fastcli, the readers' way in without click: every command line it takes, it takes as
click's own parser and types do (the same parameters), and what click refuses it leaves to
click.  That the answers it writes are click's is checked on a recorded session by
tests/test_answers.py."""
from __future__ import annotations

import os

import click
import pytest

from overlayrec import cli, fastcli

PLAIN = [
    ["calls"], ["calls", "ws"], ["calls", "--json", "ws"], ["calls", "ws", "--turn", "5"],
    ["calls", "--turn=5", "ws"], ["calls", "--turn", "last"], ["calls", "--turn", "-2"],
    ["calls", "--all", "--state-dir", "sd", "ws"],
    ["calls", "--session", "s", "--json", "--all", "--turn", "-3"], ["calls", "--", "-ws"],
    ["calls", "--session=s"], ["calls", "readable"], ["turns"], ["turns", "ws", "--all"],
    ["turns", "--json", "--session", "s1", "--state-dir=sd"], ["turns", "--", "ws"],
    ["diff", "--turn", "-1", "--stat"], ["diff", "ws", "--turn", "last"],
    ["diff", "--since", "0", "--until", "10"], ["diff", "--numstat", "--call", "c1"],
    ["diff", "--name-status", "--binary", "--by-writer", "--path", "*.py", "--call", "c1",
     "--drift", "--session", "s", "--json", "--state-dir", "sd"],
    ["diff", "--patch", "--turn", "3"], ["diff", "--call", "-x"], ["diff", "--path", ""],
    ["diff", "--turn", "9223372036854775807"], ["diff", "--since=9223372036854775807"],
    # the workspace is a plain string to both (click.Path's check would stat a hung mount):
    # the reader says what is wrong with it
    ["calls", "-"], ["diff", "-"], ["calls", "unreadable"], ["calls", "a\0b"],
    # or an option, as the commands whose argument is something else take it
    ["calls", "-w", "ws"], ["turns", "--workspace", "ws", "--json"],
    ["diff", "--stat", "--workspace=ws", "--turn", "1"], ["calls", "-w", "-x"],
]
REFUSED_OR_OTHER = [
    ["calls", "-h"], ["calls", "--help"], ["calls", "a", "b"], ["calls", "--turn", "x"],
    ["calls", "--turn"], ["calls", "--json=1"], ["calls", "--session", ""],
    ["calls", "--session", "s", "--session", "t"], ["calls", "--bogus"], ["calls", "--jso"],
    ["calls", "--turn", "1.5"], ["calls", "--turn", " 7 "],
    ["calls", "--session", os.fsdecode(b"\xff")],
    ["calls", "--", "a", "b"], ["calls", "a", "--", "b"],
    ["turns", "--turn", "1"], ["diff", "--turn", "1.5"], ["diff", "--turn", "+1"],
    ["diff", "--turn", "lastx"], ["diff", "--turn", "-"], ["diff", "--turn", "1" * 20],
    ["diff", "--since", "-1"], ["diff", "--since", "9223372036854775808"],
    ["diff", "--since", "1" * 20], ["diff", "--stat", "--patch"], ["diff", "--stat=1"],
    ["diff", "--turn"], ["diff", "--bogus"], ["diff", "-stat"],
    ["log"], ["--version"], [], ["calls", "ws", "-x"],
    ["calls", "ws", "-w", "ws"], ["calls", "-w", "a", "b"], ["calls", "-w", "a", "-w", "a"],
    ["calls", "-w"], ["diff", "--workspace"],
]


def _clicks(args: list[str]):
    """The parameters click gives the command, or the exception it raises."""
    ctx = cli.main.make_context("overlayrec", list(args[:1]) or ["--help"],
                                resilient_parsing=False)
    cmd = cli.main.get_command(ctx, args[0])
    try:
        params = cmd.make_context(args[0], list(args[1:]), parent=ctx).params
    except click.exceptions.Exit as e:   # --help
        return e
    except click.ClickException as e:
        return e
    # the workspace as the command receives it (cli._workspace_param): the option's, else the
    # argument's, else "."; both given is a usage error
    opt = params.pop("workspace_opt")
    if opt is not None and params["workspace"] is not None:
        return click.UsageError("the workspace is given twice")
    ws = params["workspace"]
    params["workspace"] = opt if opt is not None else ws if ws is not None else "."
    return params


@pytest.mark.parametrize("args", PLAIN + REFUSED_OR_OTHER)
def test_fastcli_takes_what_click_takes_as_click_does(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "readable").mkdir()
    (tmp_path / "unreadable").mkdir(mode=0)
    got = fastcli.parse(args)
    if args in PLAIN:
        assert got is not None, args
    else:
        assert got is None, args
    if got is None:
        return
    assert got[0] == args[0]
    want = _clicks(args)
    assert isinstance(want, dict), (args, want)
    assert got[1] == want, args


def test_fastcli_leaves_shell_completion_to_click(monkeypatch):
    monkeypatch.setenv("_OVERLAYREC_COMPLETE", "bash_complete")
    assert fastcli.run(["calls"]) is None
