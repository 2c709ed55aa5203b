"""Paths as long as the kernel allows, through a real mount and back out of the journal: nested
directories of 255-byte names (ASCII and multi-byte UTF-8), files, symlinks, renames and
removals at every depth; then diff, export git, replay and revert/unrevert on those paths.
And the attic of a workspace recorded by one journal after another."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import xxhash

from conftest import SLOW, Mount, needs_fuse, overlayrec
from overlayrec.journal import Journal, schema

PATH_MAX = 4096  # with its NUL: a path argument holds at most 4095 bytes

# 255 bytes each: one-, two-, three- and four-byte characters
NAMES = ["a" * 255, "é" * 127 + "e", "語" * 85, "😀" * 63 + "fff"]
RENAMED = "ê" * 127 + "e"  # what a directory of the chain is renamed to (the same length)

AGENT = textwrap.dedent(r'''
    import json, os, sys
    step, budget = sys.argv[1], int(sys.argv[2])
    with open(sys.argv[3]) as f:
        plan = json.load(f)
    def b(p):
        return len(p.encode())

    def write(p, data):
        with open(p, "wb") as f:
            f.write(data)

    def build():
        for d in plan["dirs"]:
            os.mkdir(d)
            write(d + "/f.txt", ("at %d bytes\n" % b(d)).encode())
        for p, data in plan["files"].items():
            write(p, data.encode())
        os.chmod(plan["files_order"][0], 0o750)
        os.symlink(plan["link_target"], plan["link"])
        os.mkdir(plan["empty"])
        os.mkdir(plan["maxdir"])

    def change():
        f = plan["files_order"]
        with open(f[0], "r+b") as fh:          # overwrite in place
            fh.seek(3)
            fh.write(b"CHANGED")
        with open(f[1], "ab") as fh:
            fh.write(b"appended\n")
        os.rename(f[2], plan["renamed_file"])   # a rename to another 255-byte name
        os.rename(f[3], f[4])                   # a rename over an existing file
        os.unlink(f[5])
        os.rmdir(plan["empty"])
        os.rmdir(plan["maxdir"])
        os.unlink(plan["link"])
        os.symlink(plan["link_target2"], plan["link"])
        os.chmod(plan["files_order"][1], 0o600)
        write(plan["new_file"], b"made in the second session\n")
        os.rename(plan["dir_from"], plan["dir_to"])  # a directory: every path beneath moves

    if os.environ.get("OVERLAYREC_SOCKET"):
        from overlayrec import client
        with client.connect() as c:
            c.turn_begin(prompt=step)
            c.call_begin("c-" + step, "Bash")
            {"build": build, "change": change}[step]()
            c.call_end("c-" + step)
            c.turn_end()
    else:
        {"build": build, "change": change}[step]()
''')


def b(p: str) -> int:
    return len(p.encode())


def make_plan(budget: int) -> dict:
    """Every path of the two steps, none longer than ``budget`` bytes, the longest exactly
    ``budget``: a chain of 255-byte directory names, files at every depth, and at the bottom
    files, a symlink and directories whose names fill the budget."""
    dirs, cur = [], ""
    while b(cur) + (1 if cur else 0) + 255 + 1 + 255 <= budget:  # room for one more and a leaf
        cur = f"{cur}/{NAMES[len(dirs) % 4]}" if cur else NAMES[0]
        dirs.append(cur)
    room = budget - b(cur) - 1
    if room > 255:  # one shorter directory, so that the leaves fill the budget exactly
        n = max(1, room - 256)
        cur = f"{cur}/{'ß' * (n // 2)}{'s' * (n % 2)}"
        dirs.append(cur)
        room = budget - b(cur) - 1  # what a leaf name at the bottom holds (255 at most)
    assert 0 < room <= 255, room

    def leaf(kind: str, n: int = room) -> str:
        # a multi-byte name of exactly n bytes, told apart by its first character
        body = "ü" * ((n - 1) // 2) + "u" * ((n - 1) % 2)
        return f"{cur}/{kind}{body}"
    files = {leaf("A"): "first file at the bottom\n" * 20, leaf("B"): "second\n",
             leaf("C"): "third, renamed\n", leaf("D"): "moved over the victim\n",
             leaf("E"): "the victim, kept in the attic\n", leaf("F"): "unlinked\n",
             f"{cur}/short.txt": "a short name at the bottom\n"}
    order = list(files)
    for p in order[:6]:
        assert b(p) == budget, (b(p), budget)
    k = len(dirs) // 2  # a directory halfway down is renamed (to a name of the same length)
    dir_from = dirs[k]
    dir_to = dir_from.rpartition("/")[0] + "/" + RENAMED
    assert b(dir_to) == b(dir_from)
    return {"dirs": dirs, "deep": cur, "files": files, "files_order": order,
            "link": leaf("L"), "link_target": os.path.basename(order[0]),
            "link_target2": "/".join(NAMES * 4),  # a target of 4095 bytes, the most there is
            "empty": leaf("M"), "maxdir": leaf("N"), "renamed_file": leaf("R"),
            "new_file": leaf("Z"), "dir_from": dir_from, "dir_to": dir_to}


def snapshot(root: str) -> dict:
    """The tree beneath root, read by dir fd and name (no path is too long for that), as
    {rel: ("dir", mode) | ("file", mode, bytes) | ("link", target)}, the attic left out."""
    out = {}
    for top, dirs, files, dfd in os.fwalk(root):
        rel_top = os.path.relpath(top, root)
        dirs[:] = [d for d in dirs if not (rel_top == "." and d == ".overlayrec-attic")]
        for n in dirs + files:
            rel = n if rel_top == "." else f"{rel_top}/{n}"
            st = os.lstat(n, dir_fd=dfd)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(n, dir_fd=dfd))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                fd = os.open(n, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
                with os.fdopen(fd, "rb") as f:
                    out[rel] = ("file", stat.S_IMODE(st.st_mode), f.read())
    return out


def materialize(snap: dict, root: str) -> None:
    """Write a snapshot out below root, by dir fds."""
    os.makedirs(root)
    rfd = os.open(root, os.O_DIRECTORY)
    try:
        for rel in sorted(snap, key=lambda p: p.count("/")):
            parent, _, name = rel.rpartition("/")
            dfd = os.open(parent or ".", os.O_DIRECTORY | os.O_PATH, dir_fd=rfd) \
                if parent else os.dup(rfd)
            try:
                kind = snap[rel][0]
                if kind == "dir":
                    os.mkdir(name, snap[rel][1], dir_fd=dfd)
                elif kind == "link":
                    os.symlink(snap[rel][1], name, dir_fd=dfd)
                else:
                    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, snap[rel][1],
                                 dir_fd=dfd)
                    with os.fdopen(fd, "wb") as f:
                        f.write(snap[rel][2])
                    os.chmod(name, snap[rel][1], dir_fd=dfd)
            finally:
                os.close(dfd)
    finally:
        os.close(rfd)


def run_step(m: Mount, step: str, budget: int, plan: str, agent: str) -> None:
    overlayrec("run", "-w", m.ws, "--session", step, "--", sys.executable, agent, step,
               str(budget), plan, cwd=m.ws)


def native_step(ws: str, step: str, budget: int, plan: str, agent: str) -> None:
    r = subprocess.run([sys.executable, agent, step, str(budget), plan], cwd=ws,
                       capture_output=True, text=True, timeout=120 * SLOW,
                       env={k: v for k, v in os.environ.items() if k != "OVERLAYREC_SOCKET"})
    assert r.returncode == 0, r.stderr


def last_seq(m: Mount) -> int:
    j = m.journal()
    try:
        return j.last_seq()
    finally:
        j.close()


def git_view(snap: dict) -> dict:
    """What git holds of a snapshot: files (content, executable or not) and symlinks."""
    return {p: (v if v[0] == "link" else ("file", bool(v[1] & 0o111), v[2]))
            for p, v in snap.items() if v[0] != "dir"}


def changed(a: dict, b_: dict) -> set[str]:
    ga, gb = git_view(a), git_view(b_)
    return {p for p in ga.keys() | gb.keys() if ga.get(p) != gb.get(p)}


def unquote(p: str) -> str:
    """A path as git prints it (C-quoted when it has bytes past ASCII) back to the path."""
    if not p.startswith('"'):
        return p
    raw, i, body = bytearray(), 0, p[1:-1]
    esc = {"n": 10, "t": 9, '"': 34, "\\": 92, "a": 7, "b": 8, "f": 12, "r": 13, "v": 11}
    while i < len(body):
        if body[i] == "\\":
            if body[i + 1] in esc:
                raw.append(esc[body[i + 1]])
                i += 2
            else:
                raw.append(int(body[i + 1:i + 4], 8))
                i += 4
        else:
            raw += body[i].encode()
            i += 1
    return os.fsdecode(bytes(raw))


def name_status(out: str) -> set[tuple]:
    return {tuple([l.split("\t")[0][:1]] + [unquote(x) for x in l.split("\t")[1:]])
            for l in out.splitlines() if l}


@needs_fuse
def test_long_paths_through_the_mount_and_out_of_the_journal(make_mount, tmp_path):
    # the renamed-over victim is small: kept in the attic all the same, whose long names
    # this test is about (else its pre-image would be a blob: SMALL_PREIMAGE)
    m = make_mount(env=dict(os.environ, OVERLAYREC_TEST_SMALL_PREIMAGE="-1"))
    with open(os.path.join(m.ws, "keep.txt"), "w") as f:
        f.write("untouched\n")
    # the longest workspace-relative path such that the underlay's absolute path is a path the
    # kernel can name (see test_path_longer_than_the_kernel_can_name_beneath_the_workspace)
    budget = PATH_MAX - 1 - b(m.ws) - 1
    plan = make_plan(budget)
    agent, plan_file = str(tmp_path / "agent.py"), str(tmp_path / "plan.json")
    with open(agent, "w") as f:
        f.write(AGENT)
    with open(plan_file, "w") as f:
        json.dump(plan, f)

    # the same steps natively, in a sibling workspace whose path has the same length
    native = Mount(os.path.join(os.path.dirname(m.base), "n"))
    assert b(native.ws) == b(m.ws)
    with open(os.path.join(native.ws, "keep.txt"), "w") as f:
        f.write("untouched\n")
    native_step(native.ws, "build", budget, plan_file, agent)
    native1 = snapshot(native.ws)
    native_step(native.ws, "change", budget, plan_file, agent)
    native2 = snapshot(native.ws)

    m.mount()
    s0 = snapshot(m.ws)
    run_step(m, "build", budget, plan_file, agent)
    seq1 = last_seq(m)
    s1 = snapshot(m.ws)
    assert s1 == native1
    run_step(m, "change", budget, plan_file, agent)
    s2 = snapshot(m.ws)
    assert s2 == native2
    seq2 = last_seq(m)
    deepest = max(s2, key=b)
    assert b(deepest) == budget and b(max(s1, key=b)) == budget

    # the journal names every path in full, keyed whatever its length
    j = m.journal()
    try:
        names = list(j.paths())
        assert len(names) == len(set(names))
        for p in plan["files_order"][:6] + [plan["link"], plan["new_file"]] + plan["dirs"]:
            assert p in names, p
        for p in plan["files_order"][:6]:
            seqs = j.seqs_for_path(p)
            assert seqs and seqs == sorted(seqs), p
            assert all(p in (j.event(s)["path"], j.event(s).get("path2")) for s in seqs)
            assert j.last_seq_for_path(p) == seqs[-1]
        assert j.seqs_for_path(plan["files_order"][0] + "x") == []
        victim = plan["files_order"][4]
        over = [j.event(s) for s in j.seqs_for_path(victim) if j.event(s)["op"] == "rename"]
        attic = over[0]["pre2"]["attic"]
    finally:
        j.close()

    # diff: everything since 0 is the change from s0 to s2; the change since seq1 names the
    # renames; and git apply of it onto s1 gives s2
    got = name_status(overlayrec("diff", m.ws, "--since", "0", "--name-status").stdout)
    assert {x[-1] for x in got} == changed(s0, s2) and {x[0] for x in got} == {"A"}
    got = name_status(overlayrec("diff", m.ws, "--since", str(seq1), "--name-status").stdout)
    def mv(p):  # where the directory rename took a path of the first step
        return plan["dir_to"] + p[len(plan["dir_from"]):] \
            if p.startswith(plan["dir_from"] + "/") else p
    f = plan["files_order"]
    assert ("R", f[2], mv(plan["renamed_file"])) in got and ("R", f[3], mv(f[4])) in got
    assert ("D", f[5]) in got and ("A", mv(plan["new_file"])) in got
    moved = [x for x in got if x[0] == "R" and x[1].startswith(plan["dir_from"] + "/")]
    assert len(moved) > 10 and all(x[2] == mv(x[1]) for x in moved if x[1] not in f)
    assert {x[-1] for x in got} | {x[1] for x in got if x[0] == "R"} == changed(s1, s2)
    patch = overlayrec("diff", m.ws, "--since", str(seq1), "--binary").stdout
    work = str(tmp_path / "apply")
    materialize(s1, work)
    subprocess.run(["git", "init", "-q", work], check=True)
    r = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], input=patch, text=True,
                       cwd=work, capture_output=True)
    assert r.returncode == 0, r.stderr[:2000]
    applied = {p: v for p, v in snapshot(work).items() if p.split("/")[0] != ".git"}
    assert git_view(applied) == git_view(s2)

    # export git: the commit of each call holds the paths as they stood at its end
    out = json.loads(overlayrec("export", "git", m.ws, "--json").stdout)
    gd = out["git_dir"]
    for session, want in (("build", s1), ("change", s2)):
        ref = f"refs/overlayrec/{session}/calls/c-{session}"
        ls = subprocess.run(["git", "--git-dir", gd, "ls-tree", "-r", "-z", ref],
                            capture_output=True, check=True).stdout
        tree = {}
        for entry in ls.split(b"\0"):
            if entry:
                meta, _, path = entry.partition(b"\t")
                mode, _, sha = meta.decode().split(" ")
                tree[os.fsdecode(path)] = (mode, sha)
        want = git_view(want)
        assert set(tree) == set(want), set(tree) ^ set(want)
        for p, (mode, sha) in tree.items():
            data = subprocess.run(["git", "--git-dir", gd, "cat-file", "blob", sha],
                                  capture_output=True, check=True).stdout
            v = want[p]
            assert data == (v[2] if v[0] == "file" else os.fsencode(v[1])), p
            assert mode == ("120000" if v[0] == "link" else "100755" if v[1] else "100644"), p
    fsck = subprocess.run(["git", "--git-dir", gd, "fsck", "--strict", "--no-dangling"],
                          capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr

    # replay the whole tree as it stood after the first step, into a directory whose own name
    # is 255 bytes of multi-byte characters (its temporary name beside it must fit NAME_MAX)
    dest = str(tmp_path / NAMES[2])
    overlayrec("replay", m.ws, "--at", str(seq1), "--to", dest, "--full")
    assert snapshot(dest) == s1
    assert os.listdir(tmp_path).count(NAMES[2]) == 1 and \
        not [n for n in os.listdir(tmp_path) if "overlayrec-replay" in n]

    # revert everything since the first step, then unrevert it
    overlayrec("revert", m.ws, "--since", str(seq1), "--yes")
    assert snapshot(m.ws) == s1
    overlayrec("unrevert", "-w", m.ws, "--yes")
    assert snapshot(m.ws) == s2
    assert seq2 < last_seq(m)

    m.umount()
    with open(m.attic(attic), "rb") as f:  # the renamed-over victim, kept by its inode
        assert f.read() == plan["files"][victim].encode()
    # mounted again: every seal (long paths' too) is checked against the live tree, no drift
    m.mount()
    assert not [e for e in m.events() if e["op"] == "drift"]
    assert snapshot(m.ws) == s2
    j = m.journal()
    try:
        assert len([p for p, _ in j.seals() if b(p) == budget]) >= 5
    finally:
        j.close()
    # and an edit made while unmounted, at the deepest path, is found as drift
    m.umount()
    target = plan["new_file"].replace(plan["dir_from"] + "/", plan["dir_to"] + "/", 1)
    parent, _, name = target.rpartition("/")
    dfd = os.open(m.ws, os.O_DIRECTORY)
    for part in parent.split("/"):
        nfd = os.open(part, os.O_DIRECTORY, dir_fd=dfd)
        os.close(dfd)
        dfd = nfd
    try:
        fd = os.open(name, os.O_WRONLY | os.O_APPEND, dir_fd=dfd)
        os.write(fd, b"edited while unmounted\n")
        os.close(fd)
    finally:
        os.close(dfd)
    m.mount()
    assert [e["path"] for e in m.events() if e["op"] == "drift"] == [target]


@needs_fuse
def test_path_longer_than_the_kernel_can_name_beneath_the_workspace(make_mount, tmp_path):
    """A workspace-relative path of 4095 bytes: natively fine (relative to the cwd), through
    the mount too.  The kernel names an fd (readlink of /proc/self/fd/N) only up to PATH_MAX
    bytes of *absolute* path; past that the daemon names the object by its own inode table,
    and the journal and replay hold every path in full."""
    m = make_mount()
    plan = make_plan(PATH_MAX - 1)
    code = textwrap.dedent('''
        import json, os, sys
        with open(sys.argv[1]) as f:
            plan = json.load(f)
        for d in plan["dirs"]:
            os.mkdir(d)
        with open(plan["files_order"][0], "w") as f:
            f.write("at the kernel's limit\\n")
        os.mkdir(plan["maxdir"])
        os.symlink("t", plan["link"])
        print(max(len(p.encode()) for p in [plan["files_order"][0], plan["maxdir"]]))
    ''')
    plan_file = str(tmp_path / "plan.json")
    with open(plan_file, "w") as f:
        json.dump(plan, f)
    native = os.path.join(m.base, "native-ws")
    os.makedirs(native)
    r = subprocess.run([sys.executable, "-c", code, plan_file], cwd=native,
                       capture_output=True, text=True, timeout=60 * SLOW)
    assert r.returncode == 0 and r.stdout.strip() == str(PATH_MAX - 1), r.stderr
    m.mount()
    r = subprocess.run([sys.executable, "-c", code, plan_file], cwd=m.ws,
                       capture_output=True, text=True, timeout=60 * SLOW)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(PATH_MAX - 1)
    # each change journaled under its full relative name (the kernel cannot name these: the
    # daemon names them by its own inode table)
    made = {(e["op"], e["path"]) for e in m.events()}
    want = {("mkdir", d) for d in plan["dirs"]} | {
        ("create", plan["files_order"][0]),  # its write joined the create's run
        ("mkdir", plan["maxdir"]), ("symlink", plan["link"])}
    assert want <= made, sorted(want - made)[:3]
    m.umount()
    out = str(tmp_path / "r")
    last = max(e["seq"] for e in m.events())
    r = overlayrec("replay", m.ws, "--state-dir", m.state, "--at", str(last), "--to", out,
                   "--json")
    assert r.returncode == 0, r.stderr
    dfd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in plan["files_order"][0].split("/")[:-1]:
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=dfd)
            os.close(dfd)
            dfd = nfd
        fd = os.open(plan["files_order"][0].rsplit("/", 1)[1], os.O_RDONLY, dir_fd=dfd)
        assert os.read(fd, 100) == b"at the kernel's limit\n"
        os.close(fd)
    finally:
        os.close(dfd)


@needs_fuse
def test_attic_entries_of_two_journals_on_one_workspace(make_mount, tmp_path):
    from overlayrec.recorder import is_attic_entry
    # small files kept in the attic all the same (else their pre-images are blobs)
    m = make_mount(env=dict(os.environ, OVERLAYREC_TEST_SMALL_PREIMAGE="-1"))
    for n in ("a", "b", "c", "d", "e"):
        with open(os.path.join(m.ws, n), "w") as f:
            f.write(f"first {n}\n")
    state_a, state_b = m.state + "-A", m.state + "-B"

    # journal A: rm and rename-over
    m.state = state_a
    m.mount()
    try:
        m.sh("rm c && mv a b && echo 'second d' > d")
    finally:
        m.umount()
    ja = Journal(state_a, readonly=True)
    try:
        kept = {}
        for e in ja.events():
            for k in ("pre", "pre2"):
                if "attic" in (e.get(k) or {}):
                    kept[e[k]["attic"]] = e
    finally:
        ja.close()
    assert len(kept) == 2
    attic_dir = os.path.join(m.ws, ".overlayrec-attic")
    before = {n: open(os.path.join(attic_dir, n), "rb").read() for n in os.listdir(attic_dir)
              if is_attic_entry(n)}  # not its .gitignore and CACHEDIR.TAG
    assert sorted(before.values()) == [b"first b\n", b"first c\n"] and set(before) == set(kept)

    # journal B on the same workspace: its seqs start again at 1, and its first two changes
    # take the seqs that named A's attic entries
    m.state = state_b
    m.mount()
    try:
        m.sh("mv d b && rm e && echo third > d && mv d e && echo x > new && rm new")
        assert m.sh("cat b e").stdout == "second d\nthird\n"
    finally:
        m.umount()
    after = {n: open(os.path.join(attic_dir, n), "rb").read() for n in os.listdir(attic_dir)
             if is_attic_entry(n)}
    for n, data in before.items():
        assert after[n] == data, n  # A's entries untouched
    jb = Journal(state_b, readonly=True)
    ja = Journal(state_a, readonly=True)
    try:
        assert jb.meta("journal_id") and ja.meta("journal_id") != jb.meta("journal_id")
        mine = {}
        for e in jb.events():
            assert e["op"] != "failed", e
            for k in ("pre", "pre2"):
                if "attic" in (e.get(k) or {}):
                    mine[e[k]["attic"]] = (e["op"], e[k])
    finally:
        ja.close()
        jb.close()
    # mv d b (over b: "first a"), rm e, rm new
    assert sorted(after[n] for n in mine) == [b"first a\n", b"first e\n", b"x\n"]
    assert not set(mine) & set(before) and set(after) == set(mine) | set(before)
    for n, (op, pre) in mine.items():
        assert os.stat(os.path.join(attic_dir, n)).st_size == pre["size"], (n, op)

    # each journal's readers find its own attic entries: what rm and mv took away
    for sd, gone in ((state_a, ("-first c", "-first b", "+first a")),
                     (state_b, ("-first a", "+second d", "-first e", "+third"))):
        d = overlayrec("diff", m.ws, "--state-dir", sd, "--since", "0").stdout
        for text in gone:
            assert text + "\n" in d, (sd, text, d)


# -- the journal's keys, called directly ------------------------------------------------------

def test_paths_index_of_any_length_and_of_an_older_journal(tmp_path):
    j = Journal(str(tmp_path), workspace="/w")
    long1 = "/".join(NAMES) + "/f"                       # 1024 bytes: a digest key
    long2 = long1 + "2"
    mid = "m" * 495                                      # an old journal's own key, now a digest
    # a short path whose bytes are long1's digest key's: no utf-8, keyed by a digest of its own
    twin = os.fsdecode(b"\xff" + xxhash.xxh3_128_digest(os.fsencode(long1)))
    short = "src/a.txt"
    try:
        for p in (short, long1, twin, mid, long2):
            j.append({"op": "create", "path": p, "actor": "1:2"}, {"key": "1:2", "pid": 1})
        j.append({"op": "rename", "path": long1, "path2": short, "actor": "1:2"})
        j.append({"op": "unlink", "path": long2, "actor": "1:2"})
        # what an overlayrec before the digest form wrote for ``mid`` (its key fit LMDB then),
        # and for ``twin``: its own bytes as the key, the very key of long1's event 3 but for b""
        with j.env.begin(write=True, db=j.dbs["paths"]) as txn:
            txn.put(os.fsencode(mid) + b"\0" + schema.seq_key(8), b"")
            txn.put(os.fsencode(twin) + b"\0" + schema.seq_key(9), b"")
        assert schema.path_key(twin, 3) != schema.path_key(long1, 3)
        assert os.fsencode(twin) + b"\0" + schema.seq_key(3) == schema.path_key(long1, 3)
        assert len(schema.path_key(long1, 2)) == 26 and schema.path_value(short) == b""
        assert j.seqs_for_path(short) == [1, 6] and j.seqs_for_path(long1) == [2, 6]
        assert j.seqs_for_path(long2) == [5, 7] and j.seqs_for_path(twin) == [3, 9]
        assert j.seqs_for_path(mid) == [4, 8] and j.seqs_for_path(long1 + "x") == []
        assert j.last_seq_for_path(long1) == 6 and j.last_seq_for_path(twin) == 9
        assert j.last_seq_for_path(mid) == 8 and j.last_seq_for_path(long2) == 7
        assert j.last_seq_for_path(short) == 6 and j.last_seq_for_path("nope") is None
        names = list(j.paths())
        assert sorted(names) == sorted([short, long1, twin, mid, long2])
    finally:
        j.close()
    r = Journal(str(tmp_path), readonly=True)  # and read only, as every reader opens it
    try:
        assert r.seqs_for_path(long1) == [2, 6] and len(list(r.paths())) == 5
    finally:
        r.close()


def test_call_keys_of_any_length(tmp_path):
    j = Journal(str(tmp_path), workspace="/w")
    try:
        long_id = "toolu_" + "é" * 400
        for cid in ("toolu_01", long_id):
            key = schema.call_key("s1", cid)
            assert len(key) <= schema.MAX_KEY and key.startswith(b"s1\0")
            j.put_record("calls", key, {"session": "s1", "id": cid})
        assert schema.call_key("s1", long_id) != schema.call_key("s1", long_id + "x")
        assert sorted(c["id"] for c in j.records("calls", b"s1\0")) == sorted(["toolu_01",
                                                                                long_id])
    finally:
        j.close()


@needs_fuse
def test_readers_of_a_path_a_thousand_directories_deep(make_mount, tmp_path):
    """A chain of 1,000 directories with a file at the bottom, then moved: diff, replay and
    report failed with "internal error: RecursionError" (found by a hunt)."""
    m = make_mount().mount()
    m.py(textwrap.dedent('''
        import os
        fd = os.open(".", os.O_RDONLY)
        for i in range(1000):
            os.mkdir("d", dir_fd=fd)
            n = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = n
        os.close(os.open("bottom", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
        os.close(fd)
        os.rename("d", "top")
    '''))
    made = [e["seq"] for e in m.events() if e["op"] == "create"]
    r = overlayrec("diff", m.ws, "--since", "0", "--stat", check=False)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    r = overlayrec("replay", "-w", m.ws, "--at", str(made[0]), "--to", str(tmp_path / "out"),
                   "--full", check=False)
    assert r.returncode == 0, r.stderr
    bottom = tmp_path / "out" / "/".join(["d"] * 1000) / "bottom"
    fd = os.open(tmp_path / "out", os.O_RDONLY)
    try:
        for _ in range(1000):
            n = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = n
        assert os.listdir(fd) == ["bottom"], bottom
    finally:
        os.close(fd)
    r = overlayrec("report", "-w", m.ws, "--html", str(tmp_path / "r.html"), check=False)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    # shutil.rmtree (the fixtures' clean-up) recurses as deep as the tree: rm does not
    subprocess.run(["rm", "-rf", str(tmp_path / "out"), os.path.join(m.ws, "top")], check=True)
