"""A file two writers change by turns (a SQLite WAL two calls write, a log a server left
running writes beside a call): every change of hands begins an epoch, and each epoch's
pre-image was the whole file, 650 MB for 200 one-row commits into a 4 MB WAL (found by a bug
hunt).  After its first few whole copies such a file is saved by ranges, and every point of
its history still reads back as the writers left it."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time

from conftest import SLOW, needs_fuse, overlayrec

pytestmark = needs_fuse

MIB = 1 << 20
PAGE = 4096
TURNS = 12

# one call: at each turn it writes a page of db.bin, notes the file's hash, says so (ready.K)
# and waits for the outside writer's turn to end (go.K)
AGENT = textwrap.dedent(r'''
    import hashlib, json, os, sys, time
    from overlayrec import client
    flags, turns = sys.argv[1], int(sys.argv[2])
    hashes = []
    with client.connect() as c:
        c.turn_begin(prompt="write the database")
        c.call_begin("c1", "Bash", summary="a server writing its WAL")
        for k in range(turns):
            fd = os.open("db.bin", os.O_WRONLY)
            os.pwrite(fd, os.urandom(4096), (2 * k) * 8192)
            os.close(fd)
            with open("db.bin", "rb") as f:
                hashes.append(hashlib.sha256(f.read()).hexdigest())
            open(os.path.join(flags, f"ready.{k}"), "w").close()
            while not os.path.exists(os.path.join(flags, f"go.{k}")):
                time.sleep(0.01)
        c.call_end("c1")
        c.turn_end()
    with open(os.path.join(flags, "agent.json"), "w") as f:
        json.dump(hashes, f)
''')


def _wait_for(path, run):
    deadline = time.monotonic() + 30 * SLOW
    while not os.path.exists(path):
        assert time.monotonic() < deadline and run.poll() is None, f"no {path}"
        time.sleep(0.01)


def test_a_file_two_writers_change_by_turns_is_saved_by_ranges_after_a_few_copies(
        make_mount, tmp_path):
    m = make_mount()
    original = os.urandom(MIB)  # incompressible: the store's bytes are the copies' own
    with open(os.path.join(m.ws, "db.bin"), "wb") as f:
        f.write(original)
    m.mount()
    flags = tmp_path / "flags"
    flags.mkdir()
    (tmp_path / "agent.py").write_text(AGENT)
    db = os.path.join(m.ws, "db.bin")
    states = []  # the file's hash after each change, the agent's and the outside writer's
    run = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--session",
                            "s", "--", sys.executable, str(tmp_path / "agent.py"), str(flags),
                            str(TURNS)], cwd=m.ws)
    try:
        for k in range(TURNS):
            _wait_for(flags / f"ready.{k}", run)
            with open(db, "rb") as f:
                states.append(hashlib.sha256(f.read()).hexdigest())
            fd = os.open(db, os.O_WRONLY)  # outside every session: the other writer
            os.pwrite(fd, os.urandom(PAGE), (2 * k + 1) * 8192)
            os.close(fd)
            with open(db, "rb") as f:
                states.append(hashlib.sha256(f.read()).hexdigest())
            (flags / f"go.{k}").touch()
        assert run.wait(timeout=60 * SLOW) == 0
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert json.loads((flags / "agent.json").read_text()) == states[0::2]

    events = [e for e in m.events() if e.get("path") == "db.bin" and e["op"] != "seal"]
    assert len(events) == 2 * TURNS, [e["op"] for e in events]  # one epoch a change of hands
    whole = [e for e in events if "blob" in e.get("pre", {})]
    ranged = [e for e in events if "ranges" in e.get("pre", {})]
    assert len(whole) == 3 and len(ranged) == 2 * TURNS - 3
    # what the epochs kept: three copies and a page each after them (not 24 MiB)
    kept = {e["pre"]["blob"]: len(m.blob(e["pre"]["blob"])) for e in whole}
    kept.update({r[2]: r[1] for e in ranged for r in e["pre"]["ranges"]})
    assert sum(kept.values()) == 3 * MIB + (2 * TURNS - 3) * PAGE

    # each change of hands reads back as the writer left it
    for i, ev in enumerate(events):
        to = tmp_path / f"r{i}"
        overlayrec("replay", m.ws, "--at", str(ev["seq"]), "--to", str(to))
        got = hashlib.sha256((to / "db.bin").read_bytes()).hexdigest()
        assert got == states[i], f"after event {i} (seq {ev['seq']})"
    # and the call's diff is the interleaving it is: its pages and the other writer's
    before = tmp_path / "before"
    overlayrec("replay", m.ws, "--at", "before:call:c1", "--to", str(before))
    assert (before / "db.bin").read_bytes() == original
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes", check=False)
    assert r.returncode == 1 and "interleaved: db.bin" in r.stderr


# SQLite itself: a call's process and an outside one keep one WAL database open and commit
# into it by turns (its -shm index written through a shared mapping); each commit a row of
# 20 KB.  Each waits for its turn's flag (turn.WHO.K) and says when it is done (done.WHO.K)
SQLITE_WRITER = textwrap.dedent(r'''
    import os, sqlite3, sys, time
    flags, who, turns = sys.argv[1], sys.argv[2], int(sys.argv[3])
    def wait(name):
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(flags, name)):
            assert time.monotonic() < deadline, name
            time.sleep(0.01)
    db = sqlite3.connect("app.db", isolation_level=None)
    db.execute("PRAGMA wal_autocheckpoint=0")  # the WAL only grows: no checkpoint between
    for k in range(turns):
        wait(f"turn.{who}.{k}")
        db.execute("INSERT INTO t VALUES (?, ?)", (f"{who}{k}", os.urandom(20000)))
        open(os.path.join(flags, f"done.{who}.{k}"), "w").close()
    wait("close")  # both keep it open to the end: the last close checkpoints and removes it
    db.close()
''')

SQLITE_AGENT = textwrap.dedent(r'''
    import subprocess, sys
    from overlayrec import client
    with client.connect() as c:
        c.turn_begin(prompt="run the app")
        c.call_begin("c1", "Bash", summary="the app writing its database")
        subprocess.run([sys.executable] + sys.argv[1:], check=True)
        c.call_end("c1")
        c.turn_end()
''')


def _rows(directory) -> list[str]:
    """The keys of the table a replay (or the workspace) holds."""
    import sqlite3
    db = sqlite3.connect(f"file:{directory}/app.db?mode=ro", uri=True)
    try:
        return sorted(k for (k,) in db.execute("SELECT k FROM t"))
    finally:
        db.close()


def test_a_sqlite_wal_two_writers_commit_into_by_turns(make_mount, tmp_path):
    m = make_mount().mount()
    flags = tmp_path / "flags"
    flags.mkdir()
    (tmp_path / "agent.py").write_text(SQLITE_AGENT)
    writer = tmp_path / "writer.py"
    writer.write_text(SQLITE_WRITER)
    turns = 8
    # the database made first, outside: both writers then open it as it is
    subprocess.run([sys.executable, "-c", "import sqlite3; db = sqlite3.connect('app.db'); "
                    "db.execute('PRAGMA journal_mode=WAL'); "
                    "db.execute('CREATE TABLE t (k TEXT PRIMARY KEY, v BLOB)'); db.close()"],
                   cwd=m.ws, check=True)
    run = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", m.ws, "--session",
                            "s", "--", sys.executable, str(tmp_path / "agent.py"), str(writer),
                            str(flags), "agent", str(turns)], cwd=m.ws)
    user = subprocess.Popen([sys.executable, str(writer), str(flags), "user", str(turns)],
                            cwd=m.ws)
    points = []  # (a time between two commits, the rows then)
    try:
        rows = []
        for k in range(turns):
            for who in ("agent", "user"):
                (flags / f"turn.{who}.{k}").touch()
                _wait_for(flags / f"done.{who}.{k}", run)
                rows.append(f"{who}{k}")
                time.sleep(0.02)  # the commit's last request served before the time taken
                points.append((f"@{time.time():.6f}", sorted(rows)))
                time.sleep(0.02)
        (flags / "close").touch()
        assert user.wait(timeout=60 * SLOW) == 0
        assert run.wait(timeout=60 * SLOW) == 0
    finally:
        for p in (run, user):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert _rows(m.ws) == points[-1][1]

    wal = [e for e in m.events() if e.get("path") == "app.db-wal" and "pre" in e]
    # the later turns append frames: their epochs save what they overwrite, nothing
    big_whole = [e for e in wal if "blob" in e["pre"] and
                 len(m.blob(e["pre"]["blob"])) > 64 << 10]
    assert len(big_whole) <= 3 and len(wal) >= 2 * turns, \
        [(e["op"], e.get("unit"), sorted(e["pre"])) for e in wal]
    # between each two commits the database reads back as it was: its rows then
    for i, (at, want) in enumerate(points):
        to = tmp_path / f"r{i}"
        overlayrec("replay", m.ws, "--at", at, "--to", str(to))
        assert _rows(to) == want, (i, at)
