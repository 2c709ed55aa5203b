"""overlayrec report: one self-contained HTML timeline, checked in a real headless Chromium.

A real session recorded through a mount: a stand-in for Claude Code named `claude`, whose hooks
`overlayrec run` wires, works in two turns (sed, a new file and a background process that
writes after its call ended, a directory rename, a delete, the agent's own edit, a git commit),
while an editor outside the agent writes a file.  The page is opened in Debian's chromium by
playwright: a screenshot is taken, the lanes (one per turn and per call, outside, late writes)
and the marks (one per change, as the page's legend defines a change) are counted, and a click
on a mark or a call shows its diff.  Nothing is fetched from a network.

CI (.ci/run) sets OVERLAYREC_REQUIRE_BROWSER: there a missing chromium or playwright fails the
run instead of skipping the browser test.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest

from conftest import needs_fuse, overlayrec
from overlayrec.engines import report
from overlayrec.engines.gitdiff import ObjectStore
from overlayrec.engines.states import State

CHROMIUM = "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None
try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None
MISSING = ("Debian's chromium (/usr/bin/chromium)" if CHROMIUM is None else None) or \
    ("the python package playwright" if sync_playwright is None else None)
if MISSING and os.environ.get("OVERLAYREC_REQUIRE_BROWSER"):
    raise RuntimeError(f"OVERLAYREC_REQUIRE_BROWSER is set but {MISSING} is not installed "
                       "(tools/setup installs both)")
needs_browser = pytest.mark.skipif(MISSING is not None, reason=f"needs {MISSING} "
                                   "(tools/setup installs it; CI requires it)")
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]

CLAUDE = textwrap.dedent(r'''
    import json, os, subprocess, sys, time
    hooks = json.load(open(sys.argv[sys.argv.index("--settings") + 1]))["hooks"]
    flags = os.environ["REPORT_TEST_FLAGS"]

    def fire(event, **payload):
        payload.update(hook_event_name=event, session_id="cc-1", cwd=os.getcwd(),
                       transcript_path="/dev/null")
        for group in hooks.get(event, []):
            for h in group["hooks"]:
                subprocess.run(h["command"], shell=True, input=json.dumps(payload), text=True,
                               check=True)

    def call(cid, name, tool_input, action):
        fire("PreToolUse", tool_name=name, tool_use_id=cid, tool_input=tool_input)
        action()
        fire("PostToolUse", tool_name=name, tool_use_id=cid, tool_input=tool_input,
             tool_response={})

    def bash(cid, command):
        call(cid, "Bash", {"command": command},
             lambda: subprocess.run(command, shell=True, check=True))

    def wait_for(path):
        for _ in range(1200):
            if os.path.exists(path):
                return
            time.sleep(0.05)
        raise SystemExit(f"never came: {path}")

    def own_edit():   # the agent's own edit tool writes the file itself
        open("README.md", "w").write("# readme, by the agent\n")

    fire("SessionStart", source="startup")
    fire("UserPromptSubmit", prompt="shout alpha and start the server")
    bash("c1", "sed -i s/alpha/ALPHA/ src/app.py")
    # the server outlives its call: its write lands after the call ended (a late write)
    bash("c2", "echo new > new.txt && (while [ ! -e %s/late-go ]; do sleep 0.05; done; "
               "echo started >> server.log) >/dev/null 2>&1 &" % flags)
    open(os.path.join(flags, "editor-go"), "w").close()   # the editor writes meanwhile
    wait_for(os.path.join(flags, "editor-done"))
    fire("Stop", stop_hook_active=False)
    fire("UserPromptSubmit", prompt="reorganise")
    bash("c3", "mv tests testsuite")
    bash("c4", "rm notes.txt")
    call("c5", "Write", {"file_path": os.path.abspath("README.md")}, own_edit)
    open(os.path.join(flags, "late-go"), "w").close()
    wait_for("server.log")
    bash("c6", "git add -A && git -c user.name=a -c user.email=a@b commit -qm reorganised")
    fire("Stop", stop_hook_active=False)
    fire("SessionEnd", reason="exit")
''')

EDITOR = textwrap.dedent(r'''
    import os, sys, time
    flags = sys.argv[1]
    for _ in range(1200):
        if os.path.exists(os.path.join(flags, "editor-go")):
            break
        time.sleep(0.05)
    open("user.txt", "w").write("written in an editor\n")
    open(os.path.join(flags, "editor-done"), "w").close()
''')

# the changes the page must mark: (lane kind, lane label, status, path); one per file a unit
# left changed, a moved file once; nothing under .git/ (c6's commit is folded into a count)
EXPECTED = sorted([
    ("call", "Bash c1", "M", "src/app.py"),
    ("call", "Bash c2", "A", "new.txt"),
    ("outside", "outside the sessions", "A", "user.txt"),
    ("call", "Bash c3", "R", "testsuite/a.py"),
    ("call", "Bash c3", "R", "testsuite/b.py"),
    ("call", "Bash c4", "D", "notes.txt"),
    ("call", "Write c5", "A", "README.md"),
    ("late", "late writes", "A", "server.log"),
])


def seed(ws):
    os.makedirs(os.path.join(ws, "src"))
    os.makedirs(os.path.join(ws, "tests"))
    files = {"src/app.py": "print('alpha')\nprint('beta')\n", "notes.txt": "some notes\n",
             "tests/a.py": "".join(f"assert {i} == {i}  # test a\n" for i in range(12)),
             "tests/b.py": "".join(f"assert {i} + 0 == {i}  # test b\n" for i in range(12))}
    for p, text in files.items():
        with open(os.path.join(ws, p), "w") as f:
            f.write(text)
    subprocess.run("git init -q . && git add -A && git -c user.name=a -c user.email=a@b "
                   "commit -qm seed", shell=True, cwd=ws, check=True, capture_output=True)


def recorded(m, tmp_path):
    """The session above, recorded on the Mount ``m``: the report's path, the calls' rows."""
    seed(m.ws)
    m.mount()
    flags = tmp_path / "flags"
    flags.mkdir()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    claude = bindir / "claude"
    claude.write_text(f"#!{sys.executable}\n" + CLAUDE)
    claude.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ, HOME=str(home), REPORT_TEST_FLAGS=str(flags),
               PATH=f"{bindir}:{os.environ['PATH']}")
    env.setdefault("XDG_STATE_HOME", os.path.join(os.path.expanduser("~"), ".local", "state"))
    editor = subprocess.Popen([sys.executable, "-c", EDITOR, str(flags)], cwd=m.ws)
    try:
        r = overlayrec("run", "-w", m.ws, "--session", "rep", "--", "claude", env=env,
                       cwd=m.ws, timeout=120)
        assert "warning" not in r.stderr, r.stderr
    finally:
        if editor.poll() is None:
            editor.kill()
        editor.wait()
    page = tmp_path / "report.html"
    overlayrec("report", m.ws, "--html", str(page), env=env, timeout=120)
    calls = {c["id"]: c for c in map(json.loads, overlayrec(
        "calls", m.ws, "--json", env=env).stdout.splitlines())}
    return page, calls


def png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read(32)
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@needs_fuse
@needs_browser
@pytest.mark.timeout(300)
def test_report_timeline_in_a_real_browser(make_mount, tmp_path):
    m = make_mount()
    try:
        page, calls = recorded(m, tmp_path)
        assert calls["c2"]["late_events"] >= 1   # the server's write came after its call
        assert calls["c3"]["files"] > 2          # what the listing counts for the rename
        text = page.read_text()
        assert "http://" not in text and "https://" not in text and "@import" not in text
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
            try:
                ctx = browser.new_context(viewport={"width": 1400, "height": 900})
                pg = ctx.new_page()
                asked, errors = [], []
                pg.on("request", lambda req: asked.append(req.url))
                pg.on("pageerror", lambda e: errors.append(str(e)))
                pg.goto(page.as_uri())
                shot = tmp_path / "report.png"
                pg.screenshot(path=str(shot), full_page=True)
                w, h = png_size(shot)
                assert w >= 1400 and h >= 600 and shot.stat().st_size > 30_000, (w, h)

                lanes = pg.eval_on_selector_all(".lane", "ls => ls.map(l => [l.dataset.kind, "
                                                "l.querySelector('.name').textContent])")
                kinds = [k for k, _ in lanes]
                assert [n for k, n in lanes if k == "turn"] == ["Turn 1", "Turn 2"]
                assert [n for k, n in lanes if k == "call"] == \
                    ["Bash c1", "Bash c2", "Bash c3", "Bash c4", "Write c5", "Bash c6"]
                assert kinds.count("outside") == 1 and kinds.count("late") == 1
                assert kinds.index("turn") < kinds.index("call") < kinds.index("outside")
                marks = pg.eval_on_selector_all(
                    ".lane .mark", "ms => ms.map(m => [m.closest('.lane').dataset.kind, "
                    "m.closest('.lane').querySelector('.name').textContent, "
                    "m.className.match(/st-(\\w)/)[1], m.dataset.path])")
                assert sorted(map(tuple, marks)) == EXPECTED   # one mark per change
                assert not [mk for mk in marks if mk[3].startswith(".git")]
                c6 = pg.text_content('.lane[data-id="rep:c6"] .count')
                assert c6.startswith("0 changes + ") and c6.endswith(" under .git/"), c6

                # a click on a mark: that file's diff, and only its
                pg.click('.lane[data-id="rep:c1"] .mark')
                diff = pg.text_content("#diff")
                assert "-print('alpha')" in diff and "+print('ALPHA')" in diff
                assert "new.txt" not in diff
                assert pg.text_content("#diff-title") == "modified src/app.py"
                pg.click('.lane[data-kind="late"] .mark')
                assert "+started" in pg.text_content("#diff")
                assert "Bash c2" in pg.text_content("#diff-meta")
                pg.click('.lane[data-kind="outside"] .mark')
                assert "+written in an editor" in pg.text_content("#diff")
                # a click on a call: its whole diff; the rename is git's own, one per file
                pg.click('.lane[data-id="rep:c3"] .label')
                diff = pg.text_content("#diff")
                assert diff.count("rename from tests/") == 2 and "rename to testsuite/a.py" in diff
                # the files view: each file with the units that changed it, the own first
                files = pg.eval_on_selector_all("#files td.path",
                                                "ts => ts.map(t => t.textContent)")
                assert files[-1] == ".git/" and "src/app.py" in files
                git_row = pg.text_content("#files tr:last-child")
                assert f"{c6[len('0 changes + '):-len(' under .git/')]} changes under .git/, " \
                    "folded (by Bash c6)" in git_row, git_row
                assert "tests/a.py" in files and "testsuite/a.py" in files
                pg.click('#files .chip:has-text("Write c5")')
                assert "+# readme, by the agent" in pg.text_content("#diff")
                pg.screenshot(path=str(tmp_path / "report-clicked.png"), full_page=True)
                assert errors == []
                assert all(u.startswith("file://") for u in asked), asked
            finally:
                browser.close()
    finally:
        m.umount()


@needs_fuse
@needs_browser
@pytest.mark.timeout(180)
def test_invisible_and_bidi_marks_are_shown_not_obeyed(make_mount, tmp_path):
    """A name or a line holding a bidi mark (U+202E turns the rest of its line around, so
    ``exe.txt`` reads as a text file) or an invisible one is shown in the page as its escape,
    wherever the page shows it: the diff's title and text, the files view, a mark's label."""
    m = make_mount()
    try:
        m.mount()
        name = "report\u202etxt.exe"
        m.py(f"open({name!r}, 'w').write('access = user\\u2066  # admin\\u2069\\n'"
             "); open('zw\u200bspace.txt', 'w').write('x\\n')")
        page = tmp_path / "report.html"
        overlayrec("report", m.ws, "--html", str(page), timeout=120)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
            try:
                pg = browser.new_page()
                errors = []
                pg.on("pageerror", lambda e: errors.append(str(e)))
                pg.goto(page.as_uri())
                files = pg.eval_on_selector_all("#files td.path",
                                                "ts => ts.map(t => t.textContent)")
                assert sorted(files) == ["report\\u202Etxt.exe", "zw\\u200Bspace.txt"], files
                labels = pg.eval_on_selector_all(".lane .mark",
                                                 "ms => ms.map(m => m.getAttribute('aria-label'))")
                assert any("report\\u202Etxt.exe" in a for a in labels), labels
                pg.click('.lane[data-kind="outside"] .mark[data-path^="report"]')
                assert pg.text_content("#diff-title") == "added report\\u202Etxt.exe"
                diff = pg.text_content("#diff")
                assert "+access = user\\u2066  # admin\\u2069" in diff, diff
                body = pg.inner_text("body")
                assert not [ch for ch in body if ch in "\u202e\u2066\u2069\u200b"], body
                assert errors == []
            finally:
                browser.close()
    finally:
        m.umount()


@needs_browser
@pytest.mark.timeout(180)
def test_names_with_a_tab_a_newline_or_bytes_not_utf8_are_shown_quoted(make_mount, tmp_path):
    """Three files ``a b``, ``a<TAB>b`` and ``a<NEWLINE>b`` read as the same name in the page
    (HTML shows a tab and a newline as a space), and a byte not UTF-8 as a replacement
    character; they are C-quoted now, as `calls` and every listing show them (found by a bug
    hunt)."""
    m = make_mount()
    try:
        m.mount()
        m.py("for n in (b'a b', b'a\\tb', b'a\\nb', b'x\\xffy'):\n"
             "    open(n, 'w').write('x\\n')")
        page = tmp_path / "report.html"
        overlayrec("report", m.ws, "--html", str(page), timeout=120)
        listed = overlayrec("log", m.ws).stdout
        assert '"a\\tb"' in listed and '"a\\nb"' in listed, listed
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
            try:
                pg = browser.new_page()
                errors = []
                pg.on("pageerror", lambda e: errors.append(str(e)))
                pg.goto(page.as_uri())
                files = pg.eval_on_selector_all("#files td.path",
                                                "ts => ts.map(t => t.textContent)")
                assert sorted(files) == sorted(['a b', '"a\\tb"', '"a\\nb"', '"x\\377y"']), \
                    files
                pg.eval_on_selector_all(".lane .mark", "ms => ms.find("
                                        "m => m.dataset.path.startsWith('\"x')).click()")
                assert pg.text_content("#diff-title") == 'added "x\\377y"'
                assert errors == []
            finally:
                browser.close()
    finally:
        m.umount()


# -- git's output cut per file (no mount, no browser) ---------------------------------------------

@pytest.mark.timeout(60)
def test_each_file_of_a_diff_gets_its_own_sections(tmp_path):
    store = ObjectStore(str(tmp_path / "state"))
    f = lambda data, mode=0o644: State("file", mode, data)   # noqa: E731
    body = b"".join(b"line %d of a file that moves\n" % i for i in range(10))
    before = {"a\tb.txt": f(b"one\n"), "kind": f(b"was a file\n"), "old/m.txt": f(body),
              "mode.sh": f(b"#!/bin/sh\n"), "gone": f(b"bye\n"), 'q"uote': f(b"x\n")}
    after = {"a\tb.txt": f(b"two\n"), "kind": State("symlink", 0o120000, b"target"),
             "new/m.txt": f(body), "mode.sh": f(b"#!/bin/sh\n", 0o755), 'q"uote': f(b"y\n"),
             "é new": f(b"new\n"), "ls\u2028x": f("a\u2028line\x85\n".encode())}
    tb, ta = store.tree(before), store.tree(after)
    listed = report._name_status(store.diff(tb, ta, "name-status", as_they_are=True))
    sections = report._sections(store.diff(tb, ta, "patch", as_they_are=True))
    got = {new: (status, old, [sections[i] for i in secs])
           for status, old, new, secs in report._match(listed, sections)}
    # U+2028 and U+0085, which git leaves as they are in a name and a line, cut nothing (the
    # report failed on such a name: found by a hunt)
    assert set(got) == {"a\tb.txt", "kind", "new/m.txt", "mode.sh", "gone", 'q"uote', "é new",
                        "ls\u2028x"}
    assert got["ls\u2028x"][2][0].endswith("+a\u2028line\x85\n")
    assert got["a\tb.txt"][0] == "M" and "+two" in got["a\tb.txt"][2][0]
    assert got["new/m.txt"][:2] == ("R", "old/m.txt")
    assert got["gone"][0] == "D" and got["mode.sh"][0] == "M"
    assert len(got["kind"][2]) == 2   # a kind change: git shows a deletion and an addition
    assert "+y" in got['q"uote'][2][0] and "+new" in got["é new"][2][0]
    assert sum(len(s) for _, _, s in got.values()) == len(sections)
    for p in got:
        assert report._unquote(report._quote(p)) == p


def test_a_file_too_large_for_a_patch_is_in_the_files_view(make_mount, tmp_path):
    """A file past the size a patch holds (lowered here) was left out of the page's Files
    view, its marks and its count, though `calls` counts it (found by a bug hunt): it is
    there, its patch the note that says why no patch is shown."""
    import json as _json
    import re as _re
    env = dict(os.environ, OVERLAYREC_LARGE_FILE=str(1 << 20),
               OVERLAYREC_HOLD_FILE=str(1 << 19))
    m = make_mount(env=env)
    try:
        m.mount()
        m.sh("head -c 3000000 /dev/urandom > big.bin; echo b > a")
        page = tmp_path / "report.html"
        overlayrec("report", m.ws, "--html", str(page), env=env, timeout=120)
        text = page.read_text()
        data = _json.loads(_re.search(r'<script id="data" type="application/json">(.*?)'
                                      r'</script>', text, _re.S).group(1))
        assert [f["path"] for f in data["files"]["own"]] == ["a", "big.bin"], data["files"]
        assert data["summary"]["files"] == 2 and data["summary"]["changes"] == 2
        big = next(c for c in data["changes"] if c["path"] == "big.bin")
        assert big["status"] == "A"
        note = data["patches"][big["patch"]][big["sections"][0]]
        assert "too large for a patch" in note, note
    finally:
        m.umount()
