"""`overlayrec storage`: where the record's bytes go, checked against what the test measures on
disk itself.  Two sessions through a real mount: the first edits a 300 KiB file (its pre-image
goes to the content store), the second deletes a 2 MiB file (kept in the attic) and one name of
a hard-linked file (an attic entry the workspace still links: it costs nothing).  Then the
totals (content store, attic, journal, the whole state dir), the per-session split, the three
output forms and `status`'s size line; and the errors: an unrecorded directory, a missing state
dir, a corrupt journal, each one line and exit 1."""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import textwrap

import lmdb
import pytest

from conftest import SLOW, needs_fuse, overlayrec
from overlayrec.journal import Journal
from overlayrec.views import unit_session

ONE = textwrap.dedent(r'''
    from overlayrec import client
    with client.connect() as c:
        c.turn_begin(prompt="edit the big file")
        c.call_begin("edit", "Edit")
        with open("big.txt", "r+b") as f:   # every byte overwritten: its pre-image is kept
            f.write(b"B" * (300 << 10))
        c.call_end("edit")
        c.turn_end()
''')

TWO = textwrap.dedent(r'''
    import subprocess
    from overlayrec import client
    with client.connect() as c:
        c.turn_begin(prompt="clean up")
        c.call_begin("rm", "Bash")
        subprocess.run(["rm", "huge.bin", "shared.bin"], check=True)
        c.call_end("rm")
        c.turn_end()
''')


def du(path: str) -> int:
    """Bytes on disk of everything at and beneath ``path``, as du counts them."""
    st = os.lstat(path)
    total = st.st_blocks * 512
    if stat.S_ISDIR(st.st_mode):
        for d, dirs, files in os.walk(path):
            for n in dirs + files:
                total += os.lstat(os.path.join(d, n)).st_blocks * 512
    return total


def attic_of(m, jid: str) -> dict[str, os.stat_result]:
    """This journal's attic entries, by name (the workspace unmounted: the attic is visible)."""
    d = os.path.join(m.ws, ".overlayrec-attic")
    return {n: os.lstat(os.path.join(d, n)) for n in os.listdir(d)
            if re.fullmatch(re.escape(jid) + r"\.[0-9]+", n)}


def inline_blobs(m) -> dict:
    """The journal's small blobs (its ``blobs`` table) and their lengths, read straight from LMDB."""
    env = lmdb.open(os.path.join(m.state, "journal"), readonly=True, lock=False, max_dbs=64)
    try:
        db = env.open_db(b"blobs", create=False)
        with env.begin(db=db) as txn:
            return {k.decode(): len(v) for k, v in txn.cursor()}
    finally:
        env.close()


def expected_content(m) -> dict:
    """Per session, the bytes of the blobs its events name first (a file's bytes on disk, a small
    blob's length in the journal): an event's session is its unit's, else the one open then (a
    seal names no unit); outside every session: None."""
    inline = inline_blobs(m)
    out: dict = {}
    seen: set = set()
    open_now: list = []
    for ev in m.events(failed=True, seals=True):
        if ev["op"] == "session_begin":
            open_now.append(ev["session"])
        elif ev["op"] == "session_end":
            open_now.remove(ev["session"])
        owner = unit_session(ev.get("unit")) or ev.get("session") or \
            (open_now[-1] if open_now else None)
        digests = [ev["data"]] if isinstance(ev.get("data"), str) else []
        for k in ("pre", "pre2"):
            pre = ev.get(k) or {}
            digests += [pre["blob"]] if "blob" in pre else []
            digests += [r[2] for r in pre.get("ranges", [])]
        for dg in digests:
            if dg not in seen:
                seen.add(dg)
                p = os.path.join(m.state, "content", dg[:2], dg[2:])
                size = inline[dg] if dg in inline else os.lstat(p).st_blocks * 512
                out[owner] = out.get(owner, 0) + size
    return out


def record(make_mount, tmp_path):
    m = make_mount()
    with open(os.path.join(m.ws, "big.txt"), "wb") as f:
        f.write(os.urandom(300 << 10))
    with open(os.path.join(m.ws, "huge.bin"), "wb") as f:
        f.write(os.urandom(2 << 20))
    with open(os.path.join(m.ws, "shared.bin"), "wb") as f:
        f.write(os.urandom(1 << 20))  # larger than a pre-image kept in the content store
    os.link(os.path.join(m.ws, "shared.bin"), os.path.join(m.ws, "shared.link"))
    m.mount()
    for name, script in (("one", ONE), ("two", TWO)):
        agent = tmp_path / f"{name}.py"
        agent.write_text(script)
        overlayrec("run", "-w", m.ws, "--session", name, "--", sys.executable, str(agent),
                   cwd=m.ws)
        if name == "one":  # between the sessions: a write outside both
            m.sh("echo outside > outside.txt")
    return m


def by_session(doc: dict) -> dict:
    return {r["session"]: r for r in doc["sessions"]}


@needs_fuse
@pytest.mark.timeout(240 * SLOW)
def test_storage_figures_match_the_disk(make_mount, tmp_path):
    m = record(make_mount, tmp_path)
    try:
        # mounted: the attic is read beneath the mount, and `status` says what it holds
        live = json.loads(overlayrec("storage", m.ws, "--json").stdout)
        assert live["mounted"] is True
        st = overlayrec("status", m.ws)
        line = [x for x in st.stdout.splitlines() if x.strip().startswith("record:")]
        assert len(line) == 1 and "attic: 2 entries" in line[0], st.stdout
        st_json = json.loads(overlayrec("status", m.ws, "--json").stdout)
        assert st_json["attic"]["entries"] == 2
        assert st_json["attic"]["bytes"] >= 2 << 20
        assert st_json["record_bytes"] >= st_json["attic"]["bytes"] + (300 << 10)
    finally:
        m.umount()
    j = m.journal()
    try:
        jid = j.meta("journal_id")
    finally:
        j.close()
    doc = json.loads(overlayrec("storage", m.ws, "--json").stdout)
    assert doc["mounted"] is False

    # the categories, against the disk
    assert doc["content"]["bytes"] == du(os.path.join(m.state, "content"))
    entries = attic_of(m, jid)
    assert len(entries) == 2 and doc["attic"]["entries"] == 2
    own = sum(s.st_blocks * 512 for s in entries.values() if s.st_nlink == 1)
    assert own >= 2 << 20
    assert doc["attic"]["bytes"] == own == live["attic"]["bytes"]
    assert doc["attic"]["shared_entries"] == 1  # shared.bin's inode: shared.link keeps it
    assert doc["attic"]["shared_size"] == 1 << 20
    data = os.path.join(m.state, "journal", "data.mdb")
    assert doc["journal"]["data_size"] == os.stat(data).st_size
    assert doc["journal"]["bytes"] == du(os.path.join(m.state, "journal"))
    assert 0 <= doc["journal"]["reclaimable"] <= doc["journal"]["bytes"]
    assert doc["journal"]["used_pages"] + doc["journal"]["free_pages"] <= \
        doc["journal"]["pages"]
    assert doc["total"] == du(m.state) + own
    parts = sum(doc[k]["bytes"] for k in ("journal", "content", "attic", "exports", "logs",
                                          "other"))
    assert parts == doc["total"]

    # per session: newest first, the outside writes in their own row, last
    rows = by_session(doc)
    assert [r["session"] for r in doc["sessions"]] == ["two", "one", None]
    want = expected_content(m)
    assert rows["one"]["content"] >= 300 << 10
    assert rows["one"]["content"] == want.get("one", 0)
    assert rows["two"]["content"] == want.get("two", 0)
    assert rows["one"]["attic"] == 0 and rows["one"]["attic_entries"] == 0
    assert rows["two"]["attic"] == own and rows["two"]["attic_entries"] == 2
    assert rows[None]["events"] >= 1 and rows[None]["attic"] == 0
    assert sum(r["events"] for r in doc["sessions"]) == len(m.events(failed=True, seals=True))
    assert all(r["begun"] for r in doc["sessions"][:2])
    assert not any(r["live"] or r["pinned"] for r in doc["sessions"])

    # a pin, as `overlayrec pin` makes it, is shown (a meta "pins" was read, which nothing
    # writes: found by a bug hunt)
    overlayrec("pin", "one", "-w", m.ws)
    rows = by_session(json.loads(overlayrec("storage", m.ws, "--json").stdout))
    assert rows["one"]["pinned"] and not rows["two"]["pinned"]

    # piped: a tab-separated table with a header line, no bars
    out = overlayrec("storage", m.ws).stdout
    lines = out.splitlines()
    assert lines[0].split("\t") == ["workspace", "kind", "name", "bytes", "events", "content",
                                    "attic", "begun", "state"]
    table = [x.split("\t") for x in lines[1:]]
    assert all(len(r) == 9 for r in table)
    assert ["category", "attic", str(own)] in [r[1:4] for r in table]
    assert "█" not in out and "\x1b" not in out
    sessions = {r[2]: r for r in table if r[1] == "session"}
    assert sessions["one"][8] == "pinned" and int(sessions["two"][6]) == own

    # on a terminal: a bar per category, human sizes, the sessions below
    r = subprocess.run(["script", "-qec", f"{sys.executable} -m overlayrec storage {m.ws}",
                        "/dev/null"], capture_output=True, text=True, timeout=60 * SLOW,
                       env=dict(os.environ, COLUMNS="100"))
    assert r.returncode == 0, r.stdout + r.stderr
    bars = [x for x in r.stdout.splitlines() if "█" in x]
    assert any(x.split()[0] == "attic" and "MiB" in x for x in bars), r.stdout
    assert any(x.split()[0] == "content" for x in bars), r.stdout
    assert re.search(r"^\s+one\s.*pinned", r.stdout, re.M), r.stdout

    # from inside the workspace, no argument: the workspace above the cwd
    sub = os.path.join(m.ws, "d")
    os.mkdir(sub)
    here = json.loads(overlayrec("storage", "--json", cwd=sub).stdout)
    assert here["workspace"] == m.ws and here["total"] == doc["total"]


@pytest.mark.timeout(60 * SLOW)
def test_storage_errors_are_one_line(tmp_path):
    # a directory never recorded
    plain = tmp_path / "plain"
    plain.mkdir()
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "xdg"))
    r = overlayrec("storage", str(plain), check=False, env=env)
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("overlayrec: error: ")
    assert "not recorded" in r.stderr
    # no recorded workspace at or above the cwd
    r = overlayrec("storage", check=False, env=env, cwd=str(plain))
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    # a state dir that is not there
    r = overlayrec("storage", "--state-dir", str(tmp_path / "nope"), check=False, env=env)
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "does not exist" in r.stderr
    # a corrupt journal: an event record that is not JSON
    sd = tmp_path / "state"
    os.mkdir(sd, 0o700)
    j = Journal(str(sd), workspace=str(plain))
    try:
        j.append({"op": "create", "path": "a", "actor": "1:1", "unit": "outside:1:1"})
        with j.env.begin(write=True) as txn:
            txn.put((2).to_bytes(8, "big"), b"{not json", db=j.dbs["events"])
    finally:
        j.close()
    r = overlayrec("storage", "--state-dir", str(sd), "--json", check=False, env=env)
    assert r.returncode == 1 and r.stdout == "", r.stdout
    assert len(r.stderr.splitlines()) == 1 and "corrupt" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
