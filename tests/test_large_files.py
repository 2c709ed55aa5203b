"""Files of gigabytes (a disk image, a model's weights): recorded, replayed, reverted and
exported with memory that does not grow with them, holes kept as holes, and left out of
patches with a word.  A truncate of a 3 GiB sparse image once held the cut range in the
daemon's memory and wrote it out whole to the state dir; a replay of it took 15 GB and a diff
was killed for want of memory."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest

from conftest import SLOW, needs_fuse, overlayrec

pytestmark = needs_fuse

GIB = 1 << 30
MIB = 1 << 20

# an agent that makes a sparse 1 GiB image with data here and there, cuts it to 1 MiB, then
# writes far past its end; the hash and size of the image after each call go to ``hashes``
AGENT = textwrap.dedent(r'''
    import hashlib, json, os, sys
    from overlayrec import client
    hashes = {}
    def note(call):
        h = hashlib.sha256()
        with open("disk.img", "rb") as f:
            while buf := f.read(1 << 22):
                h.update(buf)
        hashes[call] = [h.hexdigest(), os.path.getsize("disk.img")]
    with client.connect() as c:
        c.turn_begin(prompt="make an image")
        note("c0")
        c.call_begin("c1", "Bash", summary="make a sparse image")
        with open("disk.img", "r+b") as f:
            f.truncate(1 << 30)
            f.seek(4096 * 1000)
            f.write(os.urandom(4096))
            f.seek(700 << 20)
            f.write(b"middle" * 1000)
        c.call_end("c1")
        note("c1")
        c.call_begin("c2", "Bash", summary="cut it")
        os.truncate("disk.img", 1 << 20)
        c.call_end("c2")
        note("c2")
        c.call_begin("c3", "Bash", summary="write far past its end")
        with open("disk.img", "r+b") as f:
            f.seek(600 << 20)
            f.write(os.urandom(65536))
        c.call_end("c3")
        note("c3")
        c.turn_end()
    with open(sys.argv[1], "w") as f:
        json.dump(hashes, f)
''')


def sha256_of(path: str) -> list:
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while buf := f.read(1 << 22):
            h.update(buf)
    return [h.hexdigest(), os.path.getsize(path)]


# the peak is taken by a small process between: a child's peak counts the memory of the
# process it was forked from until its exec, and this test's process may hold a large patch
MEASURE = ("import os, resource, subprocess, sys\n"
           "rc = subprocess.run(sys.argv[2:]).returncode\n"
           "with open(sys.argv[1], 'w') as f:\n"
           "    f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
           "sys.exit(rc)\n")


def measured(*args) -> tuple[int, str, str, int]:
    """Run the CLI; (exit code, stdout, stderr, its peak memory in KiB, git's included)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r") as peak:
        r = subprocess.run([sys.executable, "-c", MEASURE, peak.name, sys.executable, "-m",
                            "overlayrec", *args], stdout=out, stderr=err, timeout=600)
        out.seek(0)
        err.seek(0)
        return r.returncode, out.read().decode(), err.read().decode(), int(peak.read())


def peak_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


def disk_bytes(root: str) -> int:
    total = 0
    for d, _, files in os.walk(root):
        for n in files:
            total += os.lstat(os.path.join(d, n)).st_blocks * 512
    return total


@pytest.mark.timeout(int(400 * SLOW))  # a gigabyte hashed, replayed, reverted and exported
def test_a_sparse_image_of_a_gigabyte(make_mount, tmp_path):
    m = make_mount()
    with open(os.path.join(m.ws, "disk.img"), "wb") as f:
        f.write(b"an image to be\n")
    with open(os.path.join(m.ws, "base.img"), "wb") as f:  # never changed: copied by --full
        f.truncate(512 * MIB)
        f.write(b"a base image\n")
    m.mount()
    agent, hashes = tmp_path / "agent.py", tmp_path / "hashes.json"
    agent.write_text(AGENT)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable, str(agent),
               str(hashes), cwd=m.ws, timeout=300)
    want = json.loads(hashes.read_text())
    assert want["c1"][1] == GIB and want["c2"][1] == MIB and want["c3"][1] == 600 * MIB + 65536

    # the daemon kept the cut gigabyte (its data and its holes) with little memory and disk
    with open(os.path.join(m.state, "daemon.json")) as f:
        daemon = json.load(f)["pid"]
    assert peak_kib(daemon) < 400 * 1024, f"daemon peaked at {peak_kib(daemon)} KiB"
    assert disk_bytes(m.state) < 64 * MIB, f"state dir holds {disk_bytes(m.state)} bytes"

    # replay: the image as each call left it, sparse, read in chunks
    for call in ("c1", "c2", "c3"):
        to = str(tmp_path / f"r-{call}")
        rc, _, err, peak = measured("replay", m.ws, "--at", f"after:call:{call}", "--to", to,
                                    "--full")
        assert rc == 0, err
        img = os.path.join(to, "disk.img")
        assert sha256_of(img) == want[call], call
        assert os.lstat(img).st_blocks * 512 < 16 * MIB, f"{call}: the holes were written"
        assert peak < 300 * 1024, f"replay after {call} peaked at {peak} KiB"
        base = os.path.join(to, "base.img")
        assert os.path.getsize(base) == 512 * MIB and os.lstat(base).st_blocks * 512 <= 2 * MIB
    rc, _, err, _ = measured("replay", m.ws, "--at", "before:call:c1", "--to",
                             str(tmp_path / "r-c0"), "--full")
    assert rc == 0 and sha256_of(str(tmp_path / "r-c0" / "disk.img")) == want["c0"], err

    # diff: left out of the patch, said so (as the other changes a patch cannot show)
    for call in ("c1", "c2", "c3"):
        rc, out, err, peak = measured("diff", m.ws, "--call", call, "--binary")
        assert rc == 0 and "disk.img" not in out, (call, out[:300], err)
        assert "disk.img (a file of 1.0 GiB, too large for a patch)" in err or \
            "disk.img (a file of 600.1 MiB, too large for a patch)" in err, err
        assert peak < 300 * 1024, f"diff of {call} peaked at {peak} KiB"
    js = json.loads(overlayrec("diff", m.ws, "--call", "c2", "--json").stdout)
    assert js["files"] == [] and js["not_in_patch"] == [
        {"path": "disk.img", "change": "a file of 1.0 GiB, too large for a patch"}]

    # revert the last two calls: the image of c1 again, sparse; unrevert: c3's again
    for call in ("c3", "c2"):
        rc, _, err, peak = measured("revert", m.ws, "--call", call, "--yes")
        assert rc == 0, err
        assert peak < 300 * 1024, f"revert of {call} peaked at {peak} KiB"
    img = os.path.join(m.ws, "disk.img")
    assert sha256_of(img) == want["c1"]
    assert os.lstat(img).st_blocks * 512 < 16 * MIB
    for _ in range(2):
        overlayrec("unrevert", "-w", m.ws, "--yes")
    assert sha256_of(img) == want["c3"]

    # export: the image as a blob of each call's commit, streamed into git
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    rc, _, err, peak = measured("export", "git", m.ws, "--repo", str(repo))
    assert rc == 0, err
    assert peak < 300 * 1024, f"export peaked at {peak} KiB"
    r1 = tmp_path / "r-c1" / "disk.img"
    blob = subprocess.run(["git", "hash-object", str(r1)], capture_output=True, text=True,
                          check=True).stdout.strip()
    refs = subprocess.run(["git", "for-each-ref", "--format=%(refname)"], cwd=repo,
                          capture_output=True, text=True, check=True).stdout.split()
    c1 = next(r for r in refs if r.endswith("/calls/c1"))
    tree = subprocess.run(["git", "ls-tree", c1, "disk.img"], cwd=repo, capture_output=True,
                          text=True, check=True).stdout
    assert tree.split()[2] == blob, tree


MEDIUM = textwrap.dedent(r'''
    import os, subprocess
    from overlayrec import client
    with client.connect() as c:
        c.turn_begin(prompt="install libraries")
        c.call_begin("c1", "Bash", summary="install")
        os.mkdir("lib")
        for i in range(12):
            with open(f"lib/part{i}.so", "wb") as f:
                f.write(os.urandom(24 << 20))
        c.call_end("c1")
        c.call_begin("c2", "Bash", summary="patch one in place")
        subprocess.run(["dd", "if=/dev/zero", "of=lib/part3.so", "bs=4096", "count=2",
                        "seek=1000", "conv=notrunc", "status=none"], check=True)
        c.call_end("c2")
        c.turn_end()
''')


@pytest.mark.timeout(int(400 * SLOW))  # 288 MB written, diffed twice, applied, replayed
def test_many_files_of_megabytes_are_never_held_together(make_mount, tmp_path):
    """A turn that installs 288 MB of libraries: every reader reads them one chunk at a time
    (a diff held them all, several times over), the patch still holds them and applies."""
    m = make_mount()
    with open(os.path.join(m.ws, "README"), "w") as f:
        f.write("libraries\n")
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(MEDIUM)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable, str(agent),
               cwd=m.ws, timeout=300)
    want = {f"lib/part{i}.so": sha256_of(os.path.join(m.ws, "lib", f"part{i}.so"))
            for i in range(12)}

    # the content is never held: a diff whose answer is small takes little memory (a patch
    # with --binary is the content again, base85: an answer of its size)
    rc, out, err, peak = measured("diff", m.ws, "--turn", "1", "--stat")
    assert rc == 0 and "12 files changed" in out, (out, err)
    assert peak < 250 * 1024, f"diff of 288 MB peaked at {peak} KiB"  # 368 MB held, 135 now
    rc, patch, err, _ = measured("diff", m.ws, "--turn", "1", "--binary")
    assert rc == 0, err
    work = tmp_path / "apply"
    os.makedirs(work)
    (work / "README").write_text("libraries\n")
    r = subprocess.run(["git", "apply", "-"], input=patch.encode(), cwd=work,
                       capture_output=True)
    assert r.returncode == 0, r.stderr
    assert {p: sha256_of(str(work / p)) for p in want} == want

    to = tmp_path / "replay"
    rc, _, err, peak = measured("replay", m.ws, "--at", "after:call:c1", "--to", str(to),
                                "--full")
    assert rc == 0 and peak < 100 * 1024, (err, peak)
    assert {p: sha256_of(str(to / p)) for p in want if p != "lib/part3.so"} == \
        {p: h for p, h in want.items() if p != "lib/part3.so"}
    assert sha256_of(str(to / "lib/part3.so")) != want["lib/part3.so"]  # before c2's patch

    rc, _, err, peak = measured("revert", m.ws, "--call", "c2", "--yes")
    assert rc == 0 and peak < 100 * 1024, (err, peak)
    assert sha256_of(os.path.join(m.ws, "lib/part3.so")) == sha256_of(str(to / "lib/part3.so"))


SWAP = textwrap.dedent(r'''
    import subprocess
    from overlayrec import client
    with client.connect() as c:
        c.turn_begin(prompt="swap")
        c.call_begin("c1", "Bash", summary="swap")
        subprocess.run(["bash", "-c", "mv a.bin b.bin && mv c.bin a.bin"], check=True)
        c.call_end("c1")
        c.turn_end()
''')


def test_a_revert_reads_no_content_its_own_steps_change(make_mount, tmp_path):
    """`mv a.bin b.bin && mv c.bin a.bin` reverted: a.bin's content is b.bin's, which another
    step of the same revert removes.  A content read when written (not held) is read from the
    copy the saved plan keeps: read from b.bin, it was gone ("b.bin: No such file or
    directory", the revert stopped half way)."""
    m = make_mount()
    blobs = {"a.bin": os.urandom(20 << 20), "c.bin": os.urandom(6 << 20)}
    for name, data in blobs.items():
        with open(os.path.join(m.ws, name), "wb") as f:
            f.write(data)
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(SWAP)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable, str(agent), cwd=m.ws)
    overlayrec("revert", m.ws, "--call", "c1", "--yes")
    assert sorted(os.listdir(m.ws)) == ["a.bin", "c.bin"]
    for name, data in blobs.items():
        with open(os.path.join(m.ws, name), "rb") as f:
            assert f.read() == data, name
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert sorted(os.listdir(m.ws)) == ["a.bin", "b.bin"]
    with open(os.path.join(m.ws, "a.bin"), "rb") as f:
        assert f.read() == blobs["c.bin"]
    with open(os.path.join(m.ws, "b.bin"), "rb") as f:
        assert f.read() == blobs["a.bin"]


LINKED = textwrap.dedent(r'''
    import subprocess
    from overlayrec import client
    def sh(cmd):
        subprocess.run(["bash", "-c", cmd], check=True)
    with client.connect() as c:
        c.turn_begin(prompt="links")
        c.call_begin("c1", "Bash", summary="copy and link")
        sh("cp big big3 && ln big3 big4")
        c.call_end("c1")
        c.call_begin("c2", "Bash", summary="write through one name, move the other")
        sh("dd if=/dev/urandom of=big4 bs=1M count=1 seek=2 conv=notrunc status=none && "
           "mv big3 big5")
        c.call_end("c2")
        c.turn_end()
''')


def _tree(root) -> dict:
    out = {}
    for name in sorted(os.listdir(root)):
        if name != ".overlayrec-attic":
            out[name] = sha256_of(os.path.join(root, name))
    return out


def test_a_hard_linked_file_past_the_whole_file_limit_changed_through_one_name(
        make_mount, tmp_path):
    """big3 and big4 are one inode of 9 MB; a write through big4 is journaled on big3 (its
    first name, the changed ranges saved) and big4 gets an ``alias`` event that keeps no
    content.  big4's state before the write is what big3 held then: every reader said big4
    held the content after the write (replay "1 inexact", the diff of c2 did not apply, a
    revert of c2 left big4 changed)."""
    m = make_mount()
    with open(os.path.join(m.ws, "big"), "wb") as f:
        f.write(os.urandom(9 << 20))
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(LINKED)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable, str(agent), cwd=m.ws)
    after2 = _tree(m.ws)
    out = overlayrec("replay", m.ws, "--at", "after:call:c1", "--to", str(tmp_path / "r1"),
                     "--full").stdout
    assert "inexact" not in out, out
    after1 = _tree(tmp_path / "r1")
    assert sorted(after1) == ["big", "big3", "big4"]
    assert after1["big"] == after1["big3"] == after1["big4"] != after2["big4"]
    assert after2["big4"] == after2["big5"]

    patch = overlayrec("diff", m.ws, "--call", "c2", "--binary").stdout
    r = subprocess.run(["git", "apply", "-"], input=patch.encode(), cwd=tmp_path / "r1",
                       capture_output=True)
    assert r.returncode == 0, r.stderr
    assert _tree(tmp_path / "r1") == after2

    overlayrec("revert", m.ws, "--call", "c2", "--yes")
    assert _tree(m.ws) == after1
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert _tree(m.ws) == after2


def test_a_linked_name_removed_after_a_write_through_it(make_mount, tmp_path):
    """``a`` and ``b`` one inode of 9 MB: a call writes through ``a`` and removes it; the next
    truncates ``b``, links and writes it as ``c``, renames it.  ``a``'s attic entry is that
    inode, so the later changes through ``b`` changed it too: the record took ``a`` before
    each call as inexact (the content after them), and replay, diff and revert disagreed with
    the tree.  What ``a`` held is what ``b`` held then, whose pre-images kept it."""
    m = make_mount()
    with open(os.path.join(m.ws, "a"), "wb") as f:
        f.write(os.urandom(9 << 20))
    m.mount()
    snaps = run_steps(m, tmp_path, [
        "ln a b",
        "dd if=/dev/urandom of=a bs=1M count=1 seek=2 conv=notrunc status=none && rm a",
        "truncate -s 5000000 b && ln b c && "
        "dd if=/dev/zero of=c bs=1M count=1 seek=1 conv=notrunc status=none && mv b d"])
    check_every_state(m, tmp_path, snaps)


def test_large_files_beneath_a_renamed_directory(make_mount, tmp_path):
    """A 9 MB file written in place, its directory renamed, cut and written again: every state
    replayed and the revert chain give the agent's own snapshots (a large state's base is the
    live file under its new name)."""
    m = make_mount()
    os.mkdir(os.path.join(m.ws, "d"))
    with open(os.path.join(m.ws, "d", "big"), "wb") as f:
        f.write(os.urandom(9 << 20))
    m.mount()
    snaps = run_steps(m, tmp_path, [
        "dd if=/dev/urandom of=d/big bs=1M count=1 seek=3 conv=notrunc status=none",
        "mv d e && truncate -s 7000000 e/big",
        "dd if=/dev/zero of=e/big bs=1M count=2 seek=1 conv=notrunc status=none"])
    check_every_state(m, tmp_path, snaps, unrevert=False)


# an agent whose calls are shell steps (argv[2], JSON), a snapshot (every file's hash, by its
# relative path: an absolute one through the mount may pass the kernel's limit) before the
# first and after each, written to argv[1]
STEPS = textwrap.dedent(r'''
    import hashlib, json, os, stat, subprocess, sys
    from overlayrec import client
    def tree():
        out = {}
        for top, dirs, files, dfd in os.fwalk("."):
            dirs[:] = [d for d in dirs if d != ".overlayrec-attic"]
            for n in files:  # regular files (a fifo would block the open)
                fd = os.open(n, os.O_RDONLY | os.O_NONBLOCK, dir_fd=dfd)
                with os.fdopen(fd, "rb") as f:
                    if stat.S_ISREG(os.fstat(fd).st_mode):
                        out[os.path.join(top, n)[2:]] = hashlib.sha256(f.read()).hexdigest()
        return out
    snaps = [tree()]
    with client.connect() as c:
        c.turn_begin(prompt="steps")
        for i, step in enumerate(json.loads(sys.argv[2]), 1):
            c.call_begin(f"c{i}", "Bash", summary=step[:40])
            subprocess.run(["bash", "-c", step], check=True)
            c.call_end(f"c{i}")
            snaps.append(tree())
        c.turn_end()
    with open(sys.argv[1], "w") as f:
        json.dump(snaps, f)
''')


def _fwalk_hashes(root) -> dict:
    """Every regular file's sha256 by path beneath root, read through directory fds (the
    paths may be longer than an absolute path can be), the attic left out."""
    import hashlib
    out = {}
    for top, dirs, files, dfd in os.fwalk(root):
        dirs[:] = [d for d in dirs if d != ".overlayrec-attic"]
        for n in files:
            fd = os.open(n, os.O_RDONLY | os.O_NONBLOCK, dir_fd=dfd)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue  # (a fifo would block the open)
                h = hashlib.sha256()
                while buf := f.read(1 << 22):
                    h.update(buf)
            out[os.path.relpath(os.path.join(top, n), root)] = h.hexdigest()
    return out


def run_steps(m, tmp_path, steps: list[str]) -> list[dict]:
    """Run ``steps`` as calls c1, c2, ... of one turn in ``m``; the agent's snapshots."""
    agent, snaps_file = tmp_path / "agent.py", tmp_path / "snaps.json"
    agent.write_text(STEPS)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable, str(agent),
               str(snaps_file), json.dumps(steps), cwd=m.ws, timeout=120)
    return json.loads(snaps_file.read_text())


def check_every_state(m, tmp_path, snaps: list[dict], unrevert: bool = True) -> None:
    """Replay before and after each call, then revert every call newest first (and unrevert
    each): each gives the agent's own snapshot, exactly."""
    calls = range(1, len(snaps))
    for i in calls:
        for when, want in (("before", snaps[i - 1]), ("after", snaps[i])):
            to = tmp_path / f"{when}{i}"
            out = overlayrec("replay", m.ws, "--at", f"{when}:call:c{i}", "--to", str(to),
                             "--full").stdout
            assert "inexact" not in out and _fwalk_hashes(to) == want, (when, i, out)
    for i in reversed(calls):
        overlayrec("revert", m.ws, "--call", f"c{i}", "--yes")
        assert _fwalk_hashes(m.ws) == snaps[i - 1], i
    if unrevert:
        for i in calls:
            overlayrec("unrevert", "-w", m.ws, "--yes")
            assert _fwalk_hashes(m.ws) == snaps[i], i


def test_a_large_file_at_a_path_of_4000_bytes(make_mount, tmp_path):
    """A 6 MB file (past a reader's whole-file hold: its states are read from the live file
    and the saved ranges) at the end of a 4,000-byte path: written in place, cut and appended,
    its top directory renamed.  Every replay, and the revert chain, give the agent's own
    snapshots (a large state's live base is opened by a path no absolute path can name)."""
    m = make_mount()
    names = ["d%02d" % i + "x" * 246 for i in range(15)]  # 15 x 250 bytes with the slashes
    deep = "/".join(names)
    assert 3700 < len(deep) < 3800
    fd = os.open(m.ws, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for n in names:
            os.mkdir(n, dir_fd=fd)
            nfd = os.open(n, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        leaf = "big" + "y" * 250
        assert len(deep) + 1 + len(leaf) > 4000
        wfd = os.open(leaf, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        with os.fdopen(wfd, "wb") as f:
            f.write(os.urandom(6 << 20))
    finally:
        os.close(fd)
    m.mount()
    big = f"{deep}/{leaf}"
    snaps = run_steps(m, tmp_path, [
        f"dd if=/dev/urandom of={big} bs=1M count=1 seek=2 conv=notrunc status=none",
        f"truncate -s 5000000 {big} && head -c 100000 /dev/urandom >> {big}",
        f"mv {names[0]} top && dd if=/dev/zero of=top/{deep[len(names[0]) + 1:]}/{leaf} "
        "bs=1M count=1 seek=4 conv=notrunc status=none"])
    assert len({tuple(s.values()) for s in snaps}) == 4  # every call changed the file
    # the listing names the file each call changed, under its name then, known exactly
    # (the directory renamed with it beneath in the last)
    calls = [json.loads(line) for line in overlayrec("calls", m.ws, "--json").stdout.splitlines()]
    moved = f"top/{deep[len(names[0]) + 1:]}/{leaf}"
    assert [c["id"] for c in calls] == ["c1", "c2", "c3"], calls
    assert calls[0]["paths"] == calls[1]["paths"] == [big]
    assert {big, moved, names[0], "top"} <= set(calls[2]["paths"])
    assert all(c["inexact"] == [] and c["around"] == [] for c in calls), calls
    check_every_state(m, tmp_path, snaps)


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["mtime-moved", "mtime-kept"])
def test_a_large_file_edited_while_unmounted(make_mount, tmp_path, keep_mtime):
    """The agent writes into a 6 MB file; unmounted, the user writes elsewhere in it (the same
    size; the mtime moved, or put back as ``touch -r`` does).  A seal of a file past the
    whole-file limit keeps no content or hash: the drift's pre-image was taken as "unchanged
    until the next event", so the live file (the user's edit in it) was the call's exact after
    state, and the revert of the call went ahead over the edit.  With the mtime put back the
    drift was not seen at all (the moved ctime was trusted to a hash the seal does not have)."""
    m = make_mount()
    path = os.path.join(m.ws, "model.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(6 << 20))
    m.mount()
    run_steps(m, tmp_path, ["dd if=/dev/urandom of=model.bin bs=1M count=1 seek=1 conv=notrunc status=none"])
    agents = sha256_of(path)
    m.umount()
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(5 << 20)
        f.write(b"the user's edit")
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    users = sha256_of(path)
    assert users != agents and users[1] == agents[1]

    status = json.loads(overlayrec("status", m.ws, "--json").stdout)
    assert status["drifted"] == ["model.bin"], status
    # the record's end (a seal without content) is not the user's file: said, in both forms
    # (the JSON's list took each path's after side alone, and the text said nothing)
    assert json.loads(overlayrec("diff", m.ws, "--drift", "--json").stdout)["inexact"] == \
        ["model.bin"]
    for sel in (["--drift"], ["--call", "c1"]):
        r = overlayrec("diff", m.ws, *sel, "--stat")
        assert "model.bin" in r.stdout and "not known exactly" in r.stderr, (sel, r)
    # the listings say so of the call and its turn as the diff does, twice (the second
    # listing reads its rows back from the state dir)
    for _ in range(2):
        calls = [json.loads(line) for line in overlayrec("calls", m.ws, "--json").stdout.split("\n")
                 if line]
        assert [(c["id"], c["paths"], c["inexact"]) for c in calls] == \
            [("c1", ["model.bin"], ["model.bin"])], calls
        text = overlayrec("calls", m.ws).stdout
        assert "not known exactly on one side (content the record could not keep): model.bin" \
            in text, text
        turns = [json.loads(line) for line in overlayrec("turns", m.ws, "--json").stdout.split("\n")
                 if line]
        assert [t["inexact"] for t in turns] == [["model.bin"]], turns
        assert "not known exactly" in overlayrec("turns", m.ws).stdout
    overlayrec("report", m.ws, "--html", str(tmp_path / "report.html"))
    assert "not known exactly on one side (content the record could not keep), shown as near " \
        "as it can: model.bin" in (tmp_path / "report.html").read_text()
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes", check=False)
    assert r.returncode == 1 and "model.bin" in r.stderr and "not kept" in r.stderr, r
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sha256_of(path) == users
    # the revert mounted for the occasion: the edit is journaled as made while unmounted
    drift = [e for e in m.events() if e["op"] == "drift"]
    assert [(e["path"], e["unit"]) for e in drift] == [("model.bin", "outside:unmounted")]
    # what the call left is not known (the live file holds the user's edit): said, never
    # given as exact
    out = overlayrec("replay", m.ws, "--at", "after:call:c1", "--to", str(tmp_path / "r1"),
                     "--full").stdout
    assert "1 inexact" in out, out
    d = overlayrec("diff", m.ws, "--call", "c1", "--json")
    assert json.loads(d.stdout)["inexact"] == ["model.bin"], d
    # export: the call's commit holds bytes, and its message says which are not known exactly
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    overlayrec("export", "git", m.ws, "--repo", str(repo))
    refs = subprocess.run(["git", "for-each-ref", "--format=%(refname)"], cwd=repo,
                          capture_output=True, text=True, check=True).stdout.split()
    c1 = next(r for r in refs if r.endswith("/calls/c1"))
    msg = subprocess.run(["git", "log", "-1", "--format=%B", c1], cwd=repo, capture_output=True,
                         text=True, check=True).stdout
    assert "Overlayrec-Inexact: model.bin" in msg, msg
    # (and before it: the ranges the call's write saved, laid over what is not known)
    base = next(r for r in refs if r.endswith("/base"))
    assert "Overlayrec-Inexact: model.bin" in subprocess.run(
        ["git", "log", "-1", "--format=%B", base], cwd=repo, capture_output=True, text=True,
        check=True).stdout
    # records that travel: read from git alone elsewhere, the diff says so too
    remote = tmp_path / "server.git"
    subprocess.run(["git", "init", "-q", "--bare", str(remote)], check=True)
    overlayrec("export", "git", m.ws, "--push", str(remote))
    clone = tmp_path / "elsewhere.git"
    overlayrec("fetch", str(remote), "--into", str(clone))
    r = overlayrec("records", "diff", "--git", str(clone), "--call", "c1", "--stat")
    assert "model.bin" in r.stdout and "not known exactly on one side" in r.stderr and \
        "model.bin" in r.stderr, r
    # the record from the drift on is the live file's
    last = str(max(e["seq"] for e in m.events(seals=True)))
    out = overlayrec("replay", m.ws, "--at", last, "--to", str(tmp_path / "now"),
                     "--full").stdout
    assert "inexact" not in out and sha256_of(str(tmp_path / "now" / "model.bin")) == users


def test_a_symlink_planted_on_the_way_to_a_large_file(make_mount, tmp_path):
    """Unmounted, the directory above a large recorded file is replaced by a symlink to a
    directory outside the workspace holding a file of that name and size.  A replay of the
    state the live file is the base of must not read through the symlink: the replay names
    the file as drifted and its states as inexact, and never gives the outside file's bytes
    (nor does the call's diff)."""
    m = make_mount()
    os.mkdir(os.path.join(m.ws, "d"))
    with open(os.path.join(m.ws, "d", "big"), "wb") as f:
        f.write(os.urandom(6 << 20))
    m.mount()
    run_steps(m, tmp_path, ["dd if=/dev/urandom of=d/big bs=1M count=1 seek=1 conv=notrunc status=none"])
    m.umount()
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = b"outside the workspace\n" * ((6 << 20) // 22 + 1)
    (outside / "big").write_bytes(secret[:6 << 20])
    os.rename(os.path.join(m.ws, "d"), str(tmp_path / "moved-away"))
    os.symlink(str(outside), os.path.join(m.ws, "d"))

    for when in ("before", "after"):
        to = tmp_path / f"r-{when}"
        r = overlayrec("replay", m.ws, "--at", f"{when}:call:c1", "--to", str(to), "--full",
                       check=False)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r
        assert "2 inexact" in r.stdout and "drifted (1): d/big" in r.stdout, r.stdout
        assert (to / "d").is_dir() and not (to / "d").is_symlink()
        got = to / "d" / "big"
        assert not got.exists() or b"outside the workspace" not in got.read_bytes(), when
    r = overlayrec("diff", m.ws, "--call", "c1", "--binary", check=False)
    assert "Traceback" not in r.stderr and "outside the workspace" not in r.stdout, r


def test_a_large_file_linked_and_edited_its_mtime_put_back_while_unmounted(make_mount,
                                                                           tmp_path):
    """A 6 MB file (past the whole-file limit: its content is not kept) a call wrote.
    Unmounted, the user links it (a backup) and edits it in place, its size and mtime put
    back: the ctime moved with the link count, and was taken for the link alone, so nothing
    had drifted, the call's diff showed the user's bytes as the call's, and a revert of the
    call went ahead and cut the user's link (found by a bug hunt).  The seal has the
    content's hash now: the edit is drift, and the revert a `changed` conflict."""
    m = make_mount()
    big = os.path.join(m.ws, "big")
    with open(big, "wb") as f:
        f.write(b"a" * (6 << 20))
    m.mount()
    run_steps(m, tmp_path, ["printf AGENT | dd of=big bs=1 seek=100 conv=notrunc status=none"])
    m.umount()
    os.link(big, os.path.join(m.ws, "big.bak"))
    st = os.stat(big)
    with open(big, "r+b") as f:
        f.seek(3000)
        f.write(b"USER")
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert json.loads(overlayrec("status", m.ws, "--json").stdout)["drifted"] == ["big"]
    patch = overlayrec("diff", m.ws, "--call", "c1", "--binary").stdout
    assert "USER" not in patch, patch
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes", check=False)
    assert r.returncode == 1 and "changed: big" in r.stderr, r
    assert os.stat(big).st_ino == os.stat(os.path.join(m.ws, "big.bak")).st_ino


def test_a_large_file_linked_then_its_directory_renamed_while_unmounted(make_mount, tmp_path):
    """Beside a fifo the call made, a 6 MB file the call wrote.  Unmounted, the user links it
    under a second name: its ctime moves with its link count, which is no change of what it
    holds (its seal has no hash), so nothing has drifted and the call's replay is exact.  Then
    the user renames its directory: the file is gone from the record's path, the call's after
    state is not known any more, and a revert of the call is a `changed` conflict."""
    m = make_mount()
    os.mkdir(os.path.join(m.ws, "d"))
    with open(os.path.join(m.ws, "d", "big"), "wb") as f:
        f.write(os.urandom(6 << 20))
    m.mount()
    snaps = run_steps(m, tmp_path, [
        "mkfifo d/pipe && dd if=/dev/urandom of=d/big bs=1M count=1 seek=2 conv=notrunc "
        "status=none"])
    m.umount()
    os.link(os.path.join(m.ws, "d", "big"), os.path.join(m.ws, "linked"))
    assert json.loads(overlayrec("status", m.ws, "--json").stdout)["drifted"] == []
    out = overlayrec("replay", m.ws, "--at", "after:call:c1", "--to", str(tmp_path / "r1"),
                     "--full").stdout
    assert "inexact" not in out and _fwalk_hashes(tmp_path / "r1") == \
        {**snaps[1], "linked": snaps[1]["d/big"]}, out
    assert stat.S_ISFIFO(os.lstat(tmp_path / "r1" / "d" / "pipe").st_mode)

    os.rename(os.path.join(m.ws, "d"), os.path.join(m.ws, "e"))
    assert "d/big" in json.loads(overlayrec("status", m.ws, "--json").stdout)["drifted"]
    r = overlayrec("revert", m.ws, "--call", "c1", "--yes", check=False)
    assert r.returncode == 1 and "changed: " in r.stderr and "d/big" in r.stderr, r
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(os.listdir(os.path.join(m.ws, "e"))) == ["big", "pipe"]


def test_a_sparse_image_with_data_in_every_chunk_stays_sparse(make_mount, tmp_path):
    """A 64 MiB image holding 4 KiB of data in each MiB, one block of it changed in a
    session: its revert wrote it back with every MiB that held data written whole (3 MiB on
    disk where 0.25 MiB is data), and its saved copies as much again (found by a bug hunt).
    The revert, its copies and a replay keep the holes to the block now."""
    m = make_mount()
    img = os.path.join(m.ws, "img")
    with open(img, "wb") as f:
        f.truncate(64 * MIB)
        for k in range(64):
            f.seek(k * MIB + 8192)
            f.write(os.urandom(4096))
    before = sha256_of(img)
    m.mount()
    overlayrec("run", "-w", m.ws, "--session", "s1", "--", sys.executable, "-c",
               "f = open('img', 'r+b'); f.seek(5 * 2 ** 20 + 8192); f.write(b'x' * 4096)",
               cwd=m.ws)
    m.umount()
    state_before = disk_bytes(m.state)
    overlayrec("revert", m.ws, "--state-dir", m.state, "--session", "s1", "--yes")
    assert sha256_of(img) == before
    assert os.lstat(img).st_blocks * 512 < MIB, os.lstat(img).st_blocks
    assert disk_bytes(m.state) - state_before < 2 * MIB, disk_bytes(m.state) - state_before
    to = str(tmp_path / "r")
    overlayrec("replay", m.ws, "--state-dir", m.state, "--at", "before:session:s1", "--to", to,
               "--full")
    assert sha256_of(os.path.join(to, "img")) == before
    assert os.lstat(os.path.join(to, "img")).st_blocks * 512 < MIB
