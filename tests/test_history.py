"""Path history and seals on a real mount: a directory rename shows (and reverts) as every file
that moved, through nested and repeated renames; an edit made while unmounted is drift, never
the agent's: diffs end at the seals, revert calls it a `changed` conflict, status and blame say
so, and the next mount journals it as the outside unit "while unmounted"."""
from __future__ import annotations

import json
import os
import sys
import textwrap

from conftest import needs_fuse, overlayrec

pytestmark = needs_fuse

AGENT = textwrap.dedent(r'''
    import subprocess, sys
    from overlayrec import client
    def sh(cmd):
        subprocess.run(["bash", "-ec", cmd], check=True)
    with client.connect() as c:
        c.turn_begin(prompt="one")
        c.call_begin("edit", "Bash")
        sh("echo changed > tests/a.py && mkdir -p tests/__pycache__ && echo pyc > tests/__pycache__/a.pyc")
        c.call_end("edit")
        c.turn_end()
        c.turn_begin(prompt="two")
        c.call_begin("mv", "Bash")
        sh("mv tests testsuite && mkdir tests && echo fresh > tests/new.py")
        c.call_end("mv")
        c.call_begin("nested", "Bash")
        sh("mv testsuite/deep testsuite/deeper && mv testsuite suite2 && echo more >> suite2/b.py")
        sh("echo agent >> CHANGELOG")
        c.call_end("nested")
        c.turn_end()
''')


def tree(root: str) -> dict:
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in (".overlayrec-attic",)]
        for n in files + dirs:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir", st.st_mode & 0o7777)
            elif not os.path.isfile(p):  # a fifo (never opened: that would block)
                out[rel] = ("special", st.st_mode)
            else:
                out[rel] = ("file", open(p, "rb").read(), st.st_mode & 0o7777)
    return out


def session(make_mount, tmp_path):
    m = make_mount()
    os.makedirs(os.path.join(m.ws, "tests", "deep", "er"))
    for rel, text in (("tests/a.py", "a\n"), ("tests/b.py", "b\n"), ("tests/deep/c.py", "c\n"),
                      ("tests/deep/er/d.py", "d\n"), ("CHANGELOG", "v1\n")):
        with open(os.path.join(m.ws, rel), "w") as f:
            f.write(text)
    snaps = {"start": tree(m.ws)}
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable, str(agent), cwd=m.ws)
    snaps["end"] = tree(m.ws)
    return m, snaps


def names(out: str) -> set[tuple]:
    return {tuple(line.split("\t")) for line in out.splitlines() if line}


def test_directory_renames_in_every_reader(make_mount, tmp_path):
    m, snaps = session(make_mount, tmp_path)
    moved = names(overlayrec("diff", m.ws, "--call", "mv", "--name-status").stdout)
    assert moved == {("R100", f"tests/{p}", f"testsuite/{p}") for p in
                     ("a.py", "b.py", "deep/c.py", "deep/er/d.py", "__pycache__/a.pyc")} | \
        {("A", "tests/new.py")}, moved
    nested = names(overlayrec("diff", m.ws, "--call", "nested", "--name-status").stdout)
    assert ("R100", "testsuite/deep/er/d.py", "suite2/deeper/er/d.py") in nested, nested
    assert ("R100", "testsuite/a.py", "suite2/a.py") in nested, nested
    assert any(n[0] == "M" and n[1] == "CHANGELOG" for n in nested), nested
    # turn 1's diff still holds the files it made, under their names then
    t1 = names(overlayrec("diff", m.ws, "--turn", "1", "--name-status").stdout)
    assert t1 == {("M", "tests/a.py"), ("A", "tests/__pycache__/a.pyc")}, t1
    blame = overlayrec("blame", "suite2/__pycache__/a.pyc", "-w", m.ws).stdout
    assert "call:s:edit" in blame and "absent 0B -> file 4B" in blame, blame
    assert "moved with tests/ -> testsuite/" in blame, blame
    # replay before turn 2 has tests/ with its files; the whole tree equals the start + turn 1
    out = tmp_path / "then"
    overlayrec("replay", m.ws, "--at", "before:turn:2", "--to", str(out), "--full")
    then = tree(str(out))
    assert then["tests/deep/er/d.py"][1] == b"d\n" and then["tests/a.py"][1] == b"changed\n"
    assert not any(k.startswith(("testsuite", "suite2")) for k in then), sorted(then)
    # revert of turn 2 puts everything back, no empty tests/ beside a full testsuite/
    r = overlayrec("revert", m.ws, "--turn", "2", "--yes")
    now = tree(m.ws)
    assert {k: v for k, v in now.items() if k != ".git"} == \
        {k: v for k, v in then.items()}, (r.stdout, sorted(now), sorted(then))
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert tree(m.ws) == snaps["end"]


def test_edit_while_unmounted_is_drift(make_mount, tmp_path):
    m, snaps = session(make_mount, tmp_path)
    agent_diff = overlayrec("diff", m.ws, "--turn", "2").stdout
    m.umount()
    with open(os.path.join(m.ws, "CHANGELOG"), "a") as f:
        f.write("user line\n")
    # unmounted: the turn's diff is the agent's alone; revert calls the user's edit a conflict
    assert overlayrec("diff", m.ws, "--turn", "2").stdout == agent_diff
    assert "user line" not in agent_diff
    st = json.loads(overlayrec("status", m.ws, "--json").stdout)
    assert st["drifted"] == ["CHANGELOG"], st
    assert "drifted" in overlayrec("blame", "CHANGELOG", "-w", m.ws).stdout
    d = overlayrec("diff", m.ws, "--drift")
    assert "+user line" in d.stdout and "agent" not in d.stdout.replace(" agent", ""), d.stdout
    assert "drift" in overlayrec("diff", m.ws, "--turn", "2").stderr
    # revert mounts for the occasion: that mount journals the drift, and the revert refuses
    r = overlayrec("revert", m.ws, "--turn", "2", "--yes", check=False)
    assert r.returncode == 1 and "changed" in r.stderr and "CHANGELOG" in r.stderr, r
    assert open(os.path.join(m.ws, "CHANGELOG")).read() == "v1\nagent\nuser line\n"
    # the drift is journaled as the outside unit "while unmounted", never a call
    m.mount()
    drift = [e for e in m.events() if e["op"] == "drift"]
    assert [(e["path"], e["unit"]) for e in drift] == [("CHANGELOG", "outside:unmounted")]
    assert json.loads(overlayrec("status", m.ws, "--json").stdout)["drifted"] == []
    assert "user line" not in overlayrec("diff", m.ws, "--turn", "2").stdout
    since = overlayrec("diff", m.ws, "--since", str(drift[0]["seq"] - 1)).stdout
    assert "+user line" in since


SWAP = textwrap.dedent(r'''
    import subprocess
    from overlayrec import client
    def sh(cmd):
        subprocess.run(["bash", "-ec", cmd], check=True)
    with client.connect() as c:
        c.call_begin("c0", "Bash")
        sh("rm p && mkdir p && mkfifo p/own")
        c.call_end("c0")
        c.call_begin("c1", "Bash")
        sh("echo theirs > p/theirs")
        c.call_end("c1")
''')


def test_a_directory_holding_another_units_file_is_a_conflict(make_mount, tmp_path):
    """Reverting the call that turned a fifo into a directory, after another call put a file in
    it, refuses with `changed` and writes nothing (never a revert stopped half way)."""
    m = make_mount()
    os.mkfifo(os.path.join(m.ws, "p"))
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(SWAP)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable, str(agent), cwd=m.ws)
    before = tree(m.ws)
    r = overlayrec("revert", m.ws, "--call", "c0", "--yes", check=False)
    assert r.returncode == 1 and "changed: p" in r.stderr, (r.stdout, r.stderr)
    assert tree(m.ws) == before
    st = json.loads(overlayrec("status", m.ws, "--json").stdout)
    assert st["pending_revert"] == [], st
