"""A record its daemon left unsealed (killed, or its seal at unmount refused for want of room).

Until the next mount seals it, the paths the daemon left open end at the live tree, which may
hold what the user changed since: readers take them as not exact (diff names them on stderr,
replay lists them as ``inexact``), and ``status`` and ``check`` say the record was left
unsealed.  While a daemon serves the workspace nothing of this is said (found by a bug hunt:
an edit made after the daemon's end read as the session's own change, exact)."""
from __future__ import annotations

import json
import os
import signal

from conftest import needs_fuse, overlayrec

pytestmark = needs_fuse


def _seed(m) -> None:
    for name in ("a", "b"):
        with open(os.path.join(m.ws, name), "w") as f:
            f.write(f"{name}\n")


def _kill_daemon(m) -> None:
    with open(os.path.join(m.state, "daemon.json")) as f:
        pid = json.load(f)["pid"]
    os.kill(pid, signal.SIGKILL)
    overlayrec("umount", m.ws)  # clears the dead mount; the record stays as the kill left it


def _said(m) -> dict:
    """What replay, status and check say of the record now."""
    rec = ("-w", m.ws, "--state-dir", m.state)
    out = os.path.join(m.base, f"replay-{len(os.listdir(m.base))}")
    replay = overlayrec("replay", *rec, "--at", "end", "--to", out, "--json").stdout
    status = overlayrec("status", *rec, "--json").stdout
    check = overlayrec("check", *rec, "--json").stdout
    return {"inexact": json.loads(replay)["inexact"],
            "status": bool(json.loads(status).get("left_unsealed")),
            "check": bool(json.loads(check).get("left_unsealed"))}


def test_a_record_left_unsealed_reads_its_open_ends_as_not_exact(make_mount):
    m = make_mount()
    _seed(m)
    m.mount()
    m.sh("echo agent >> a; mv b c")
    # a daemon serving the mount: its open epochs are its own, nothing is said
    assert _said(m) == {"inexact": [], "status": False, "check": False}
    _kill_daemon(m)
    with open(os.path.join(m.ws, "a"), "a") as f:  # the user's, while unmounted
        f.write("user\n")
    # every path it left open (the mv's too: no unit's end sealed them)
    assert _said(m) == {"inexact": ["a", "b", "c"], "status": True, "check": True}
    rec = ("-w", m.ws, "--state-dir", m.state)
    d = overlayrec("diff", *rec, "--since", "0")
    assert "+user" in d.stdout  # shown as near as the record can
    assert "left unsealed" in d.stderr and d.stderr.rstrip().endswith(": a, b, c"), d.stderr
    st = overlayrec("status", *rec)
    assert "left unsealed" in st.stdout and "next mount seals it" in st.stdout, st.stdout
    ck = overlayrec("check", *rec)
    assert "left unsealed" in ck.stdout and "record whole" in ck.stdout, ck.stdout
    # the next mount seals it: nothing more is said
    m.mount()
    m.umount()
    assert _said(m) == {"inexact": [], "status": False, "check": False}
    assert "left unsealed" not in overlayrec("diff", *rec, "--since", "0").stderr
