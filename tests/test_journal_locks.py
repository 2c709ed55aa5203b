"""A process that has the journal open keeps LMDB's locks on lock.mdb for as long as it has
it open.  They are POSIX record locks: closing any fd of the file drops them all, and the next
process to open the journal then finds itself alone, starts LMDB's lock table again under the
daemon, and commits are lost (an actor whose events were committed went missing)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from overlayrec.journal import Journal

from conftest import needs_fuse, needs_root

ACTOR = {"key": "7:7", "pid": 7, "start": 7, "uid": 0}


def posix_locks(path: str, pid: int) -> list[str]:
    """The POSIX record locks ``pid`` holds on ``path`` (from /proc/locks)."""
    st = os.stat(path)
    out = []
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if "->" in fields:  # a waiter, not a holder
                continue
            kind, _, mode, holder, ident = fields[1:6]
            if kind == "POSIX" and int(holder) == pid and int(ident.rsplit(":", 1)[1]) == st.st_ino:
                out.append(mode)
    return out


def test_a_writer_keeps_lmdbs_locks_while_it_has_the_journal_open(tmp_path):
    sd = str(tmp_path / "state")
    lock = os.path.join(sd, "journal", "lock.mdb")
    j = Journal(sd)
    try:
        assert "READ" in posix_locks(lock, os.getpid())  # LMDB's "in use" lock
        j.append({"op": "mkdir", "path": "d", "actor": ACTOR["key"]}, ACTOR)
        assert "READ" in posix_locks(lock, os.getpid())
        # another process may not take the journal as its own alone: its exclusive lock fails
        r = subprocess.run([sys.executable, "-c", (
            "import fcntl, sys\n"
            "f = open(sys.argv[1], 'r+b')\n"
            "try:\n"
            "    fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)\n"
            "except OSError:\n"
            "    print('busy')\n"
            "else:\n"
            "    print('alone')\n"), lock], capture_output=True, text=True, timeout=30)
        assert r.stdout.strip() == "busy", r.stderr
    finally:
        j.close()
    assert posix_locks(lock, os.getpid()) == []


@needs_fuse
@needs_root
def test_the_daemon_keeps_lmdbs_locks_while_it_serves(make_mount):
    m = make_mount()
    m.mount()
    m.sh("echo a > f; mkdir d; mv f d/g")
    with open(os.path.join(m.state, "daemon.json")) as f:
        pid = json.load(f)["pid"]
    assert "READ" in posix_locks(os.path.join(m.state, "journal", "lock.mdb"), pid)
    # a reader opened and closed meanwhile leaves the daemon's records whole
    evs = m.events()
    assert {"create", "mkdir", "rename"} <= {e["op"] for e in evs}
    assert all(m.actor(e["actor"]) is not None for e in evs)
