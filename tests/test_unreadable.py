"""Files their owner may not read (``chmod 200``), with the daemon run by that owner, not root.

The daemon must read what a change destroys; a write-only file's owner may write it, truncate
it, remove it, rename over it, and natively all of that succeeds.  Through the mount it did
not (EACCES on the write), and once such a file was in the record every listing failed on it.
Now the daemon grants itself the read for the moment of its read (underlay.reopen_own), a
removed one's content goes into the store (no reader could read it from the attic), and a
reader meeting a live file it may not read says so for that file alone.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import force_unmount, is_mounted, needs_fuse, needs_root

NOBODY = 65534

AGENT = textwrap.dedent(r'''
    import subprocess
    from overlayrec import client
    STEPS = [
        "echo new > wo",
        "printf 's\\n' > x && chmod 200 x",
        "rm -f wo big",
        "mv y wo2",
        "truncate -s 1 wo3 && printf 'more\\n' >> wo4",
    ]
    with client.connect() as c:
        c.turn_begin(prompt="write-only files")
        for i, step in enumerate(STEPS, 1):
            c.call_begin(f"c{i}", "Bash", summary=step)
            subprocess.run(["bash", "-c", step], check=True)
            c.call_end(f"c{i}")
        c.turn_end()
''')

SEED = ("printf 'secret\\n' > wo && printf 'two\\n' > wo2 && printf 'three\\n' > wo3 && "
        "printf 'four\\n' > wo4 && head -c 300000 /dev/zero | tr '\\0' b > big && "
        "printf 'y\\n' > y && chmod 200 wo wo2 wo3 wo4 big")


# the daemon's user, every process of the test: an ordinary user, or root without the
# capabilities that let it read any file (so root's own write-only files are as a user's)
OWNERS = {
    "nobody": (["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"], NOBODY),
    "root-without-dac": (["setpriv", "--bounding-set", "-dac_override,-dac_read_search",
                          "--inh-caps", "-dac_override,-dac_read_search"], 0),
}


def run_as(prefix, args, env, cwd=None, check=True):
    r = subprocess.run([*prefix, *args], capture_output=True, text=True, env=env, cwd=cwd,
                       timeout=90)
    if check and r.returncode != 0:
        raise AssertionError(f"{args} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def tree(ws: str) -> dict:
    """Every file as root reads it: mode and content (the attic left out)."""
    out = {}
    for name in sorted(os.listdir(ws)):
        if name == ".overlayrec-attic":
            continue
        p = os.path.join(ws, name)
        with open(p, "rb") as f:
            out[name] = (oct(os.lstat(p).st_mode), f.read())
    return out


@needs_fuse
@needs_root
@pytest.mark.parametrize("owner", sorted(OWNERS))
def test_write_only_files_are_recorded_read_and_reverted_by_their_owners_daemon(tmpbase, owner):
    prefix, uid = OWNERS[owner]
    # the daemon and the agent are started by an overlayrec process, not by setpriv itself
    if run_as(prefix, ["sh", "-c", 'exec "$0" -c 0', sys.executable], None,
              check=False).returncode:
        pytest.skip(f"{sys.executable} cannot be run by uid {uid} (a directory on its way)")
    base = os.path.join(tmpbase, "u")
    ws, sd, xdg = (os.path.join(base, d) for d in ("ws", "sd", "xdg"))
    for d in (base, ws, xdg):
        os.mkdir(d)
        os.chown(d, uid, uid)
    env = dict(os.environ, XDG_STATE_HOME=xdg, HOME=base)
    ovr = [sys.executable, "-m", "overlayrec"]

    def as_owner(args, env, cwd=None, check=True):
        return run_as(prefix, args, env, cwd, check)

    def ask(*args, check=True):
        return as_owner([*ovr, *args], env, cwd=base, check=check)

    as_owner(["bash", "-c", SEED], env, cwd=ws)
    before = tree(ws)
    try:
        # every step succeeds through the mount, as it does natively (the agent checks)
        as_owner([*ovr, "run", "--state-dir", sd, "--session", "s", "--",
                   sys.executable, "-c", AGENT], env, cwd=ws)
        after = tree(ws)
        assert after["x"] == ("0o100200", b"s\n") and "wo" not in after and "big" not in after
        assert after["wo2"] == ("0o100644", b"y\n")
        assert after["wo3"][1] == b"t" and after["wo4"][1] == b"four\nmore\n"

        listed = [json.loads(line) for line in ask("calls", ws, "--json").stdout.splitlines()]
        assert [c["id"] for c in listed] == [f"c{i}" for i in range(1, 6)]
        # each call's diff holds what was there: the pre-images the daemon read
        d1 = ask("diff", ws, "--call", "c1").stdout
        assert "-secret" in d1 and "+new" in d1
        d3 = ask("diff", ws, "--call", "c3", "--numstat").stdout.split("\n")
        assert "0\t1\two" in d3 and "0\t1\tbig" in d3, d3
        d5 = ask("diff", ws, "--call", "c5").stdout
        assert "-three" in d5 and "+more" in d5

        ask("mount", ws, "--state-dir", sd)
        for i in range(5, 0, -1):
            ask("revert", ws, "--call", f"c{i}", "--yes")
        ask("umount", ws)
        assert tree(ws) == before

        ask("mount", ws, "--state-dir", sd)
        for _ in range(5):
            ask("unrevert", ws, "--yes")
        ask("umount", ws)
        assert tree(ws) == after

        # an edit while unmounted, to a file no reader may read: named, never guessed
        as_owner(["bash", "-c", "printf 'other\\n' > x"], env, cwd=ws)
        r = ask("diff", ws, "--call", "c2")
        assert "+s" in r.stdout and "Traceback" not in r.stderr
        r = ask("diff", ws, "--drift", "--json")
        assert json.loads(r.stdout)["unreadable"] == ["x"]
        ask("mount", ws, "--state-dir", sd)
        r = ask("revert", ws, "--call", "c2", "--yes", check=False)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr
        assert "unrecorded: x" in lines[0] and "no read permission" in lines[0], lines
        ask("umount", ws)
        assert tree(ws)["x"] == ("0o100200", b"other\n")
        with open(os.path.join(sd, "daemon.log")) as f:
            assert "Traceback" not in f.read()
    finally:
        if is_mounted(ws):
            as_owner([*ovr, "umount", ws], env, check=False)
        force_unmount(ws)
