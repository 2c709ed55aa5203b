"""overlayrec report: one self-contained HTML page, checked in a real headless Chromium: it
loads, shows the turns and the outside lane, and a click on a call opens its diff."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from conftest import needs_fuse, overlayrec
from test_diff import AGENT, seed

pytestmark = needs_fuse

CHROMIUM = shutil.which("chromium")


def dump_dom(page: str, tmp_path, fragment: str = "") -> str:
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                        "--no-first-run", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000",
                        "--dump-dom", f"file://{page}{fragment}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (tools/setup installs it)")
def test_report_in_a_real_browser(make_mount, tmp_path):
    m = make_mount()
    seed(m.ws)
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    first = tmp_path / "first-edit-done"   # the first edit lands before the session begins
    editor = subprocess.Popen([sys.executable, "-c", "import sys, time\nfor i in range(4):\n"
                               "    open('notes-by-user.txt', 'a').write('x')\n"
                               "    if i == 0: open(sys.argv[1], 'w').close()\n"
                               "    time.sleep(0.2)", str(first)], cwd=m.ws)
    for _ in range(1200):
        if first.exists() or editor.poll() is not None:
            break
        time.sleep(0.05)
    assert first.exists(), "the editor never made its first edit"
    overlayrec("run", "-w", m.ws, "--session", "rep", "--", sys.executable, str(agent), cwd=m.ws)
    editor.wait(timeout=30)
    page = str(tmp_path / "report.html")
    overlayrec("report", m.ws, "--html", page)
    text = open(page).read()
    assert "http://" not in text and "https://" not in text  # nothing fetched from a network
    dom = dump_dom(page, tmp_path)
    assert "Session rep" in dom and "Turn 1" in dom and "Turn 2" in dom
    assert "refactor" in dom and 'id="call-c1"' in dom and 'id="call-c3"' in dom
    assert "Outside the sessions" in dom and "notes-by-user.txt" in dom
    assert "Click a call to see its diff" in dom
    opened = dump_dom(page, tmp_path, "#open=call-c1")   # the page clicks that call's box
    assert "Diff of Bash c1" in opened
    panel = opened.split('<div id="diff">', 1)[1].split('<script id="data"', 1)[0]
    assert '<div class="del">-alpha</div>' in panel and '<div class="add">+ALPHA</div>' in panel
    assert "appended by c2" not in panel
    assert '<div id="diff"></div>' in dom  # before the click, the panel was empty
