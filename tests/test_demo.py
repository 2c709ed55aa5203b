"""tools/demo, as a person runs it (only tools/setup skipped: the suite is set up already): it
exits 0, in under a minute, and its output tells the story: each section with its command, the
agent's hooks wired by `run`, the outside edit, the revert saying what it reverted and the
unrevert putting turn 2 back."""
from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from conftest import SLOW, force_unmount, needs_fuse

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "demo")


@needs_fuse
@pytest.mark.timeout(240)
def test_demo_tells_the_whole_story(tmpbase):
    base = os.path.join(tmpbase, "demo")
    env = dict(os.environ, OVERLAYREC_DEMO_NO_SETUP="1")
    started = time.monotonic()
    try:
        r = subprocess.run([DEMO, base], capture_output=True, text=True, env=env,
                           timeout=180 * SLOW, cwd="/")
    finally:
        force_unmount(os.path.join(base, "workspace"))
    took = time.monotonic() - started
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-3000:]
    assert took < 60 * SLOW, f"the demo took {took:.0f} s"
    sections = re.findall(r"^== (\d+)\. ", out, re.M)
    assert sections == [str(i) for i in range(1, 11)], sections
    for command in ("$ overlayrec run --session demo -- claude", "$ overlayrec turns",
                    "$ overlayrec calls", "$ overlayrec diff --turn 1 --stat",
                    "$ overlayrec blame src/app.py", "$ overlayrec revert --turn 2\n",
                    "$ overlayrec revert --turn 2 --yes", "$ overlayrec unrevert --yes",
                    "$ overlayrec replay --at before:turn:2", "$ overlayrec storage",
                    "$ overlayrec report --html"):
        assert command in out, command
    # the session went through Claude Code's hooks (not implicit calls), the user's edit outside
    assert "overlayrec: session demo: 2 turn(s), 6 call(s)" in out
    assert re.search(r"^  outside: bash\[\d+\]: 1 file\(s\)$", out, re.M), out
    assert re.search(r"^demo +1 toolu_02 +Bash .*sed -i", out, re.M)
    assert "tests/fixtures/golden.json | 2 +-" in out
    # the revert said what it reverted, and the unrevert put turn 2 back
    reverted = out.split("$ overlayrec revert --turn 2 --yes", 1)[1]
    reverted, unreverted = reverted.split("$ overlayrec unrevert --yes", 1)
    # (the rename is renamed back: one step, docs/revert.md)
    assert "  create   NOTES.md" in reverted and "  rename   tests (from testsuite)" in reverted
    assert re.search(r"^reverted \d+ path\(s\) as revert \S+$", reverted, re.M)
    assert "$ ls -F\nNOTES.md\nTODO.md\nsrc/\ntests/\ntools/\n" in reverted
    assert "  delete   NOTES.md" in unreverted and \
        "  rename   testsuite (from tests)" in unreverted, unreverted
    assert "$ ls -F\nTODO.md\nsrc/\ntestsuite/\ntools/\n" in unreverted
    page = re.search(r"^report: file://(\S+)$", out, re.M)
    assert page and os.path.getsize(page.group(1)) > 10_000
    assert os.path.isdir(os.path.join(base, "workspace", "testsuite"))
