"""Every mutating operation, made by a real process through a real mount, lands in the journal
with the right path, the right actor, and a pre-image equal to what the path held before."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import stat
import time

import pytest

from conftest import SLOW, linked_before_mount, needs_fuse, needs_root, overlayrec, seeded

pytestmark = needs_fuse


def only(events, op, path=None):
    got = [e for e in events if e["op"] == op and (path is None or e["path"] == path)]
    assert got, f"no {op} event for {path} in {[(e['op'], e['path']) for e in events]}"
    return got


def once_copied(m, path: str) -> dict:
    """The pre-image of the last unlink of ``path``, a small file, once the daemon, idle, has
    copied it from the attic into the store."""
    deadline = time.monotonic() + 20 * SLOW
    while True:
        pre = [e for e in m.events() if e["op"] == "unlink" and e["path"] == path][-1]["pre"]
        if "blob" in pre or time.monotonic() > deadline:
            return pre
        time.sleep(0.05)


def pre_content(m, pre: dict) -> bytes:
    if "blob" in pre:
        return m.blob(pre["blob"])
    if "ranges" in pre:
        buf = bytearray(pre["size"]) if "size" in pre else bytearray()
        for off, length, digest in pre["ranges"]:
            buf[off:off + length] = m.blob(digest)
        return bytes(buf)
    assert pre.get("size", 0) == 0, pre
    return b""


def test_shell_append_records_pre_image_and_actor(make_mount):
    m = seeded(make_mount, {"a.txt": b"hello\n"})
    r = m.sh('echo world >> a.txt; echo $$')
    pid = int(r.stdout.strip())
    ev = only(m.events(), "write", "a.txt")[0]
    assert ev["epoch"] is True
    assert pre_content(m, ev["pre"]) == b"hello\n"
    actor = m.actor(ev["actor"])
    assert actor["pid"] == pid
    assert os.path.basename(actor["argv"][0]) == "bash"
    assert actor["cwd"] == m.ws and actor["uid"] == os.getuid() and actor["ppid"] > 0
    assert actor["start"] > 0 and actor["exe"].endswith("bash")


def test_sed_in_place_is_create_write_rename_over(make_mount):
    m = seeded(make_mount, {"src/mod.py": b"x = 1\ny = 2\n"})
    m.sh("sed -i s/1/42/ src/mod.py")
    assert open(os.path.join(m.ws, "src/mod.py"), "rb").read() == b"x = 42\ny = 2\n"
    evs = m.events()
    ren = only(evs, "rename")[-1]
    assert ren["path2"] == "src/mod.py" and ren["path"].startswith("src/sed")
    assert ren["pre2"]["kind"] == "file" and ren["pre2"]["size"] == 12
    # a small file renamed over: its pre-image is a blob, not an attic entry (SMALL_PREIMAGE)
    assert "attic" not in ren["pre2"] and m.blob(ren["pre2"]["blob"]) == b"x = 1\ny = 2\n"
    assert all(os.path.basename(m.actor(e["actor"])["argv"][0]) == "sed"
               for e in evs if e["path"].startswith("src/sed"))


def test_in_place_overwrite_and_truncate(make_mount):
    m = seeded(make_mount, {"f": b"0123456789", "g": b"abcdefgh", "h": b"old content"})
    m.py("f = open('f', 'r+b'); f.seek(2); f.write(b'XY'); f.close()")
    m.sh("truncate -s 3 g; : > h")
    evs = m.events()
    w = only(evs, "write", "f")[0]
    assert pre_content(m, w["pre"]) == b"0123456789" and w["offset"] == 2 and w["length"] == 2
    t = only(evs, "truncate", "g")[0]
    assert t["size"] == 3 and pre_content(m, t["pre"]) == b"abcdefgh"
    t = only(evs, "truncate", "h")[0]
    assert t["size"] == 0 and pre_content(m, t["pre"]) == b"old content"
    assert open(os.path.join(m.ws, "f"), "rb").read() == b"01XY456789"
    assert open(os.path.join(m.ws, "g"), "rb").read() == b"abc"
    assert os.path.getsize(os.path.join(m.ws, "h")) == 0


def test_one_pre_image_per_epoch_then_again_for_another_actor(make_mount):
    m = seeded(make_mount, {"f": b"v0"})
    m.sh("echo v1 > f; echo v2 > f")       # one process: one epoch
    m.sh("echo v3 > f")                    # another process: a new epoch
    evs = [e for e in m.events() if e["path"] == "f"]
    epochs = [e for e in evs if e.get("epoch")]
    assert len(epochs) == 2
    assert pre_content(m, epochs[0]["pre"]) == b"v0"
    assert pre_content(m, epochs[1]["pre"]) == b"v2\n"


def test_create_unlink_and_attic(make_mount):
    m = seeded(make_mount, {"gone.txt": b"precious"})
    m.sh("echo new > fresh.txt; rm gone.txt")
    evs = m.events()
    c = only(evs, "create", "fresh.txt")[0]
    assert c["pre"] == {"kind": "absent"}
    u = only(evs, "unlink", "gone.txt")[0]
    assert u["pre"]["kind"] == "file" and u["pre"]["size"] == 8
    assert not os.path.exists(os.path.join(m.ws, "gone.txt"))
    assert ".overlayrec-attic" not in os.listdir(m.ws)
    assert not os.path.exists(os.path.join(m.ws, ".overlayrec-attic"))
    # a small file: its pre-image is a blob and the unlink really unlinks (SMALL_PREIMAGE),
    # once the daemon has been idle a moment
    pre = once_copied(m, "gone.txt")
    assert "attic" not in pre and m.blob(pre["blob"]) == b"precious"
    m.umount()
    assert sorted(os.listdir(os.path.join(m.ws, ".overlayrec-attic"))) == \
        [".gitignore", "CACHEDIR.TAG", "RECORD"]  # its own files: no entry left


def test_dirs_symlinks_fifos_links(make_mount):
    m = seeded(make_mount, {"d/keep": b"k", "t": b"target"})
    m.sh("mkdir -p e/f; rmdir e/f; ln -s t sl; readlink sl; mkfifo pipe; ln t hard; "
         "rm sl; mv d dd; rm pipe")
    evs = m.events()
    assert only(evs, "mkdir", "e")[0]["pre"] == {"kind": "absent"}
    rd = only(evs, "rmdir", "e/f")[0]
    assert rd["pre"]["kind"] == "dir" and rd["pre"]["mode"] == 0o755
    assert only(evs, "symlink", "sl")[0]["target"] == "t"
    un = only(evs, "unlink", "sl")[0]
    assert un["pre"]["kind"] == "symlink" and un["pre"]["target"] == "t"
    mk = only(evs, "mknod", "pipe")[0]
    assert stat.S_ISFIFO(mk["mode"])
    assert only(evs, "unlink", "pipe")[0]["pre"]["kind"] == "fifo"
    assert only(evs, "link", "hard")[0]["source"] == "t"
    mv = only(evs, "rename", "d")[0]
    assert mv["path2"] == "dd" and mv["pre"]["kind"] == "dir" and mv["pre2"] == {"kind": "absent"}
    # hard links share content and count as natively (the attic's links do not show)
    m.sh("echo more >> hard")
    assert open(os.path.join(m.ws, "t"), "rb").read() == b"targetmore\n"
    assert os.stat(os.path.join(m.ws, "t")).st_nlink == 2
    assert os.stat(os.path.join(m.ws, "t")).st_ino == os.stat(os.path.join(m.ws, "hard")).st_ino
    m.sh("rm hard")
    assert os.stat(os.path.join(m.ws, "t")).st_nlink == 1
    # a hard link to a symlink is a second name of the symlink itself
    m.sh("ln -s t sl2 && ln -P sl2 slh")
    assert os.readlink(os.path.join(m.ws, "slh")) == "t"
    assert os.lstat(os.path.join(m.ws, "slh")).st_nlink == 2


@needs_root  # chown to other owners
def test_metadata_changes_record_old_values(make_mount):
    m = seeded(make_mount, {"f": b"x"})
    old = os.stat(os.path.join(m.ws, "f"))
    m.sh("chmod 600 f; chown 65534:65534 f; touch -d '2001-02-03 04:05:06' f")
    m.py("import os; os.setxattr('f', 'user.k', b'v1'); os.setxattr('f', 'user.k', b'v2');"
         "os.removexattr('f', 'user.k')")
    evs = m.events()
    ch = only(evs, "chmod", "f")[0]
    assert ch["mode"] == 0o600 and ch["pre"]["mode"] == stat.S_IMODE(old.st_mode)
    assert ch["pre"]["mtime_ns"] == old.st_mtime_ns
    co = only(evs, "chown", "f")[0]
    assert (co["uid"], co["gid"]) == (65534, 65534)
    ut = only(evs, "utimens", "f")[0]
    assert ut["mtime_ns"] == 981173106 * 10**9 or ut["mtime_ns"] is not None
    assert [e["op"] for e in evs if e["path"] == "f"] == \
        ["chmod", "chown", "utimens", "setxattr", "setxattr", "removexattr"]
    st = os.stat(os.path.join(m.ws, "f"))
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 65534
    assert st.st_mtime_ns == ut["mtime_ns"]


def test_utime_omit_and_now(make_mount):
    m = seeded(make_mount, {"f": b"x"})
    p = os.path.join(m.ws, "f")
    os.utime(p, ns=(10**9, 2 * 10**9))
    before = os.stat(p)
    m.py("import os; os.utime('f', ns=(5 * 10**9, 6 * 10**9))")
    # UTIME_OMIT on atime, UTIME_NOW on mtime, through utimensat(2)
    m.py("import ctypes, os\n"
         "class T(ctypes.Structure): _fields_=[('s', ctypes.c_long), ('n', ctypes.c_long)]\n"
         "ts = (T*2)(); ts[0].s, ts[0].n = 0, (1<<30)-2; ts[1].s, ts[1].n = 0, (1<<30)-1\n"
         "libc = ctypes.CDLL(None, use_errno=True)\n"
         "assert libc.utimensat(-100, b'f', ts, 0) == 0, os.strerror(ctypes.get_errno())")
    st = os.stat(p)
    assert before.st_mtime_ns == 2 * 10**9
    assert st.st_atime_ns == 5 * 10**9            # omitted: kept
    assert st.st_mtime_ns > 6 * 10**9             # now


def test_renameat2_noreplace_and_exchange(make_mount):
    m = seeded(make_mount, {"a": b"AAA", "b": b"BBB"})
    r = m.py(
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def rn(a, b, fl):\n"
        "    r = libc.renameat2(-100, a, -100, b, fl)\n"
        "    return 0 if r == 0 else ctypes.get_errno()\n"
        "print(rn(b'a', b'b', 1), rn(b'a', b'b', 2), rn(b'a', b'c', 1))")
    import errno
    assert r.stdout.split() == [str(errno.EEXIST), "0", "0"]
    assert open(os.path.join(m.ws, "b"), "rb").read() == b"AAA"
    assert open(os.path.join(m.ws, "c"), "rb").read() == b"BBB"
    evs = only(m.events(), "rename")
    assert [(e["path"], e["path2"], e.get("flags")) for e in evs] == [("a", "b", 2), ("a", "c", 1)]
    # the readers say the exchange is one: both names stay (it read as "rename a -> b", a gone
    # and b replaced: found by a hunt)
    m.umount()
    log = overlayrec("log", m.ws, "--op", "rename").stdout.splitlines()
    assert "exchange    a <-> b" in log[0] and "rename      a -> c" in log[1], log
    seq = str(evs[0]["seq"])
    assert overlayrec("show", "-w", m.ws, seq).stdout.startswith(f"event {seq}: exchange a <-> b")
    blame = overlayrec("blame", "-w", m.ws, "b").stdout
    assert "exchange with a" in blame and "rename" not in blame, blame


def test_git_works_through_the_mount(make_mount):
    m = seeded(make_mount, {"README": b"hi\n"})
    m.sh("git init -q . && git add -A && git -c user.email=a@b -c user.name=n commit -qm one && "
         "echo more >> README && git -c user.email=a@b -c user.name=n commit -qam two && "
         "git status --porcelain && git log --oneline | wc -l > /dev/null && git fsck --strict 2>&1")
    assert m.sh("git log --format=%s").stdout.split() == ["two", "one"]
    evs = m.events()
    gits = [e for e in evs if e["path"].startswith(".git/")]
    unknown = [e for e in gits if m.actor(e["actor"]) is None]
    if unknown:  # what a reader could not find, and whether it is found once all is committed
        m.umount()
        raise AssertionError(f"events without their actor: {unknown[:3]}; after unmount: "
                             f"{[m.actor(e['actor']) for e in unknown[:3]]}")
    assert gits and all(os.path.basename(m.actor(e["actor"])["argv"][0]) == "git" for e in gits)
    w = only(evs, "write", "README")[0]
    assert pre_content(m, w["pre"]) == b"hi\n"


def test_large_file_saves_only_the_ranges_it_loses(make_mount):
    big = bytes(range(256)) * (6 << 12)  # 6 MiB, over the whole-file limit
    m = seeded(make_mount, {"big": big})
    m.py("f = open('big', 'r+b'); f.seek(1 << 20); f.write(b'Z' * 4096); f.close()")
    m.py("f = open('big', 'ab'); f.write(b'tail' * 1000); f.close()")
    m.sh("truncate -s 5000000 big")
    evs = [e for e in m.events() if e["path"] == "big"]
    # three processes, three epochs: the overwrite saved its 4 KiB, the append saved nothing,
    # the cut saved what it cut (the appended tail included)
    by_epoch = [[r for r in e["pre"].get("ranges", [])] for e in evs if "pre" in e]
    assert [sum(r[1] for r in rs) for rs in by_epoch] == [4096, 0, len(big) + 4000 - 5000000]
    before_cut = big[:1 << 20] + b"Z" * 4096 + big[(1 << 20) + 4096:] + b"tail" * 1000
    for (off, length, digest), content in zip(by_epoch[0] + by_epoch[2],
                                              [big] * len(by_epoch[0]) + [before_cut] * 9):
        assert m.blob(digest) == content[off:off + length]
    assert not any("blob" in e.get("pre", {}) for e in evs)


def test_sparse_and_past_4gib(make_mount):
    m = seeded(make_mount, {})
    m.py("f = open('sparse', 'wb'); f.seek(5 << 30); f.write(b'end'); f.close()\n"
         "f = open('sparse', 'rb'); f.seek(5 << 30); assert f.read() == b'end'\n"
         "f.seek(1 << 30); assert f.read(4) == bytes(4)")
    st = os.stat(os.path.join(m.ws, "sparse"))
    assert st.st_size == (5 << 30) + 3 and st.st_blocks * 512 < (1 << 20)
    # the write joined the run its create began: the run's extents say where it wrote
    m.umount()  # the note comes with the release, and waits for the daemon's next commit
    made = only(m.events(), "create", "sparse")[0]
    assert made["run"]
    j = m.journal()
    try:
        note = j.extents(made["seq"])
    finally:
        j.close()
    assert (note["writes"], note["lo"], note["hi"]) == (1, 5 << 30, (5 << 30) + 3), note


def test_unlinked_while_open_keeps_working(make_mount):
    m = seeded(make_mount, {"f": b"start"})
    m.py("import os\nf = open('f', 'r+b')\nos.unlink('f')\nf.seek(0, 2); f.write(b'+more'); f.flush()\n"
         "f.seek(0); assert f.read() == b'start+more'\nassert not os.path.exists('f')\nf.close()")
    evs = m.events()
    assert only(evs, "unlink", "f")


def test_a_file_renamed_or_unlinked_while_open_is_written_under_its_new_name(make_mount,
                                                                             tmp_path):
    """Writes through a handle follow its file: after a rename they are the new name's (with
    the content it held before as their pre-image), after an unlink the attic's; the old name,
    which another file takes meanwhile, is never charged with them."""
    m = seeded(make_mount, {"keep": b"k\n", "gone": b"g\n"})
    m.py("import os\n"
         "f = open('a', 'w'); f.write('one\\n'); f.flush()\n"
         "os.rename('a', 'b')\n"
         "f.write('two\\n'); f.flush()\n"
         "os.rename('keep', 'a')\n"
         "f.write('three\\n'); f.close()\n"
         "g = open('gone', 'a'); os.unlink('gone')\n"
         "open('gone', 'w').write('new\\n')\n"
         "g.write('late\\n'); g.close()\n")
    truth = {"a": b"k\n", "b": b"one\ntwo\nthree\n", "gone": b"new\n"}
    for p, data in truth.items():
        assert open(os.path.join(m.ws, p), "rb").read() == data
    evs = m.events()
    to_b = only(evs, "rename", "a")[0]["seq"]
    to_a = only(evs, "rename", "keep")[0]["seq"]
    made = only(evs, "create", "gone")[0]["seq"]
    assert not [e for e in evs if e["path"] == "a" and e["seq"] > to_a], evs
    assert [(e["op"], e["offset"], e["length"]) for e in evs
            if e["path"] == "gone" and e["seq"] > made] == [("write", 0, 4)]  # "new\n" only
    late = [e for e in evs if e["path"].startswith(".overlayrec-attic/") and e["op"] == "write"]
    assert [(e["offset"], e["length"]) for e in late] == [(2, 5)]
    into_b = only(evs, "write", "b")[0]
    assert into_b["seq"] > to_b and pre_content(m, into_b["pre"]) == b"one\n"
    m.umount()
    # the readers agree with what the files held at those points
    for seq, want in ((to_b, {"b": b"one\n", "keep": b"k\n"}),
                      (to_a, {"a": b"k\n"}),
                      (made, {"gone": b""}),
                      (max(e["seq"] for e in evs), truth)):
        dest = tmp_path / f"at-{seq}"
        overlayrec("replay", m.ws, "--state-dir", m.state, "--at", str(seq), "--to", str(dest))
        for p, data in want.items():
            assert (dest / p).read_bytes() == data, (seq, p)


def test_shared_mmap_writes_reach_the_file(make_mount):
    m = seeded(make_mount, {"f": b"a" * 8192})
    m.py("import mmap\nf = open('f', 'r+b')\nmm = mmap.mmap(f.fileno(), 0)\nmm[100:105] = b'HELLO'\n"
         "mm.flush(); mm.close(); f.close()")
    data = open(os.path.join(m.ws, "f"), "rb").read()
    assert data[100:105] == b"HELLO"
    w = only(m.events(), "write", "f")[0]
    assert pre_content(m, w["pre"]) == b"a" * 8192
    m.umount()
    assert open(os.path.join(m.ws, "f"), "rb").read()[100:105] == b"HELLO"


def test_listing_and_stat_match_the_underlay(make_mount):
    m = seeded(make_mount, {"a/b/c": b"1", "a/d": b"22", "e": b"333"})
    seen = m.py("import os, json\nout = {}\n"
                "for root, dirs, files in os.walk('.'):\n"
                "    for n in dirs + files:\n"
                "        p = os.path.join(root, n); s = os.lstat(p)\n"
                "        out[p] = [s.st_mode, s.st_size, s.st_nlink, s.st_ino, s.st_mtime_ns]\n"
                "print(json.dumps(out, sort_keys=True))").stdout
    m.umount()
    import json
    native = {}
    for root, dirs, files in os.walk(m.ws):
        for n in dirs + files:
            if n == ".overlayrec-attic":
                continue
            p = os.path.join(root, n)
            s = os.lstat(p)
            native["." + p[len(m.ws):]] = [s.st_mode, s.st_size, s.st_nlink, s.st_ino, s.st_mtime_ns]
    dirs_kept = {k: v for k, v in native.items() if not k.startswith("./.overlayrec-attic")}
    assert json.loads(seen) == dirs_kept


def test_statfs_and_fsync(make_mount):
    m = seeded(make_mount, {"f": b"x"})
    r = m.py("import os\nfd = os.open('f', os.O_RDWR); os.write(fd, b'y'); os.fsync(fd);"
             " os.fdatasync(fd); os.close(fd)\n"
             "d = os.open('.', os.O_RDONLY); os.fsync(d); os.close(d)\n"
             "s = os.statvfs('.'); print(s.f_bsize, s.f_blocks, s.f_namemax)")
    native = os.statvfs(m.base)
    bsize, blocks, namemax = map(int, r.stdout.split())
    assert (bsize, blocks, namemax) == (native.f_bsize, native.f_blocks, native.f_namemax)


def test_log_command_shows_events(make_mount):
    m = seeded(make_mount, {"a.txt": b"a"})
    m.sh("echo b >> a.txt; mkdir sub; touch sub/x; mv a.txt sub/a.txt")
    from conftest import overlayrec
    out = overlayrec("log", m.ws).stdout.splitlines()
    assert [l.split()[5] for l in out] == ["write", "mkdir", "create", "utimens", "rename"]
    assert out[-1].split()[-3:] == ["a.txt", "->", "sub/a.txt"]
    assert out[0].split()[4] == "bash"
    out = overlayrec("log", m.ws, "--path", "sub/*", "--limit", "2").stdout.splitlines()
    assert [l.split()[5] for l in out] == ["utimens", "rename"]
    import json
    rows = [json.loads(l) for l in overlayrec("log", m.ws, "--json").stdout.splitlines()]
    assert rows[0]["op"] == "write" and rows[0]["actor"]["argv"][0] == "bash"
    assert [r["seq"] for r in rows] == sorted(r["seq"] for r in rows)


@needs_root  # chown to other owners
def test_xattr_and_owner_pre_images(make_mount):
    m = make_mount()
    p = os.path.join(m.ws, "f")
    with open(p, "wb") as f:
        f.write(b"x")
    os.setxattr(p, "user.k", b"v0")
    os.chown(p, 1234, 5678)
    m.mount()
    m.py("import os; os.setxattr('f', 'user.k', b'v1'); os.setxattr('f', 'user.new', b'n')")
    m.sh("chown 0:0 f; chmod 640 f")
    evs = [e for e in m.events() if e["path"] == "f"]
    sx = evs[0]
    assert sx["op"] == "setxattr" and sx["name"] == "user.k"
    assert sx["pre"]["xattrs"] == {"user.k": b"v0".hex()}
    assert (sx["pre"]["uid"], sx["pre"]["gid"]) == (1234, 5678)
    # a later event of the same process's epoch carries no second pre-image; chown and chmod
    # are processes of their own, so each opens an epoch
    assert [(e["op"], "pre" in e) for e in evs] == \
        [("setxattr", True), ("setxattr", False), ("chown", True), ("chmod", True)]
    # the new epoch's pre-image is what the first one left
    ch = evs[2]
    assert ch["epoch"] and ch["pre"]["xattrs"] == {"user.k": b"v1".hex(), "user.new": b"n".hex()}
    assert (ch["pre"]["uid"], ch["pre"]["gid"]) == (1234, 5678)
    assert os.getxattr(p, "user.k") == b"v1" and os.stat(p).st_uid == 0


@needs_root  # a file capability is set by root only
def test_a_write_drops_a_capability_set_after_an_exclusive_create(make_mount):
    """A file an O_EXCL create made cannot hold a capability, so the kernel's question before
    each write is answered without the underlay (fs.create); a capability set afterwards is
    asked for again, and a write drops it as natively: the kernel's removexattr is journaled,
    between the setxattr and the write."""
    # VFS_CAP_REVISION_2 with the effective flag, CAP_NET_RAW (13) permitted
    cap = (0x02000001).to_bytes(4, "little") + (1 << 13).to_bytes(4, "little") + bytes(12)
    code = ("import os\n"
            "fd = os.open('f', os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o755)\n"
            "os.write(fd, b'a')\n"
            f"os.setxattr('f', 'security.capability', {cap!r})\n"
            "assert os.getxattr('f', 'security.capability')\n"
            "os.write(fd, b'b')\n"
            "os.close(fd)\n"
            "try:\n"
            "    os.getxattr('f', 'security.capability')\n"
            "    print('kept')\n"
            "except OSError as e:\n"
            "    print(e.errno)\n")
    m = make_mount()
    native = os.path.join(m.base, "native")
    os.makedirs(native)
    import subprocess
    import sys
    want = subprocess.run([sys.executable, "-c", code], cwd=native, capture_output=True,
                          text=True, check=True).stdout
    m.mount()
    got = m.py(code).stdout
    assert got == want == "61\n"  # ENODATA: the write dropped it
    evs = [(e["op"], e.get("name")) for e in m.events() if e["path"] == "f"]
    i = evs.index(("setxattr", "security.capability"))
    assert ("removexattr", "security.capability") in evs[i + 1:], evs


def test_a_change_that_changes_nothing_is_recorded_in_order(make_mount):
    """A chmod to the mode a file has, a chown to the owner it has (tar, sed -i and the
    formatter pattern make one a file) and tar's utimens ride with the next commit instead of
    one of their own:
    still recorded, in the order things happened, the path's next write starts a new run
    after them (so the state there is exact), and a refused one leaves no event."""
    from overlayrec.engines.states import States, Tree
    m = make_mount()
    m.mount()
    m.py("import os\n"
         "os.umask(0o022)\n"
         "fd = os.open('f', os.O_WRONLY | os.O_CREAT, 0o644)\n"
         "os.write(fd, b'A')\n"
         "os.fchmod(fd, 0o644)\n"                       # nothing changes: held
         "os.write(fd, b'B')\n"                         # a new run: its own event
         "os.fchown(fd, os.getuid(), os.getgid())\n"    # nothing changes: held
         "os.write(fd, b'C')\n"
         "os.utime(fd, ns=(10**18, 10**18))\n"         # times are no state: held
         "os.close(fd)\n"
         "os.mkdir('d', 0o755)\n"
         "os.chmod('d', 0o755)\n"                       # a directory's too
         "os.chmod('f', 0o600)\n"                       # a change: an event of its own
         "os.chmod('f', 0o4600)\n"                      # a setuid bit: never held
         "os.chmod('f', 0o4600)\n")
    m.umount()
    evs = [e for e in m.events() if e["path"] in ("f", "d")]
    assert [(e["op"], e["path"], e.get("mode")) for e in evs] == [
        ("create", "f", 0o100644 if evs[0]["mode"] > 0o7777 else 0o644),
        # the first write joined the run the create began
        ("chmod", "f", 0o644), ("write", "f", None),
        ("chown", "f", None), ("write", "f", None), ("utimens", "f", None),
        ("mkdir", "d", evs[6].get("mode")), ("chmod", "d", 0o755),
        ("chmod", "f", 0o600), ("chmod", "f", 0o4600), ("chmod", "f", 0o4600)], evs
    assert evs[0]["run"]
    assert [e["seq"] for e in evs] == sorted(e["seq"] for e in evs)
    assert [e["t"] for e in evs] == sorted(e["t"] for e in evs)
    assert all("pre" not in e for e in evs[1:6])  # the create saved all there was
    j = m.journal()
    try:
        states = States(j, Tree.at(m.ws))
        # within one epoch the writes after the create carry no pre-image, so a reader may
        # call these points inexact; what it calls exact must be what was there
        for ev, content in ((evs[1], b"A"), (evs[3], b"AB")):
            st = states.state("f", ev["seq"])
            assert not st.exact or (st.kind == "file" and st.data == content), (ev, st)
        end = states.state("f", evs[-1]["seq"])
        assert end.exact and end.data == b"ABC" and end.mode & 0o7777 == 0o4600, end
    finally:
        j.close()


def test_a_held_change_ends_a_write_run(make_mount):
    """A write run, a chmod that changes nothing (held), more writes through the same
    descriptor, then another process's append: the state at the chmod is what was there then,
    never what the later writes made."""
    from overlayrec.engines.states import States, Tree
    m = make_mount()
    with open(os.path.join(m.ws, "h"), "wb") as f:
        f.write(b"0")
    os.chmod(os.path.join(m.ws, "h"), 0o644)
    m.mount()
    m.py("import os, subprocess\n"
         "fd = os.open('h', os.O_WRONLY | os.O_APPEND)\n"
         "os.write(fd, b'A')\n"
         "os.fchmod(fd, 0o644)\n"                              # held
         "os.write(fd, b'B')\n"
         "os.write(fd, b'C')\n"
         "subprocess.run(['sh', '-c', 'printf D >> h'], check=True)\n"  # another unit
         "os.close(fd)\n")
    m.umount()
    evs = [e for e in m.events() if e["path"] == "h"]
    assert [e["op"] for e in evs] == ["write", "chmod", "write", "write"], evs
    j = m.journal()
    try:
        states = States(j, Tree.at(m.ws))
        # the write after the chmod is an event of its own: the run before it ended there,
        # so the other process's pre-image (0ABC) is not taken for the state at the chmod
        for ev, content in zip(evs, (b"0A", b"0A", b"0ABC", b"0ABCD")):
            st = states.state("h", ev["seq"])
            assert not st.exact or st.data == content, (ev, st)
        assert states.state("h", evs[-1]["seq"]).exact
    finally:
        j.close()


def test_changes_that_change_nothing_on_other_shapes(make_mount):
    """Held changes on a fifo, on a file at a path near 4,000 bytes, and on a file whose
    directory was renamed since: each recorded under the name it had then, in order, with no
    gap in the seqs; a hard-linked file's is an event of its own (its other name follows)."""
    from overlayrec.engines.states import States, Tree
    m = make_mount()
    m.mount()
    deep = "/".join(["d" * 200] * 19)  # 3,818 bytes of directories
    m.py("import os\n"
         "os.umask(0o022)\n"
         "os.mkfifo('p', 0o644)\n"
         "os.chmod('p', 0o644)\n"
         f"os.makedirs({deep!r})\n"
         f"long = {deep!r} + '/' + 'f' * 150\n"
         "with open(long, 'w') as f:\n"
         "    f.write('x')\n"
         "os.chmod(long, 0o644)\n"
         "os.makedirs('top/sub')\n"
         "with open('top/sub/g', 'w') as f:\n"
         "    f.write('y')\n"
         "os.rename('top', 'moved')\n"
         "os.chmod('moved/sub/g', 0o644)\n"
         "os.chown('moved/sub/g', os.getuid(), os.getgid())\n"
         "with open('h', 'w') as f:\n"
         "    f.write('z')\n"
         "os.link('h', 'h2')\n"
         "os.chmod('h', 0o644)\n")
    long = deep + "/" + "f" * 150
    m.umount()
    evs = m.events()
    seqs = [e["seq"] for e in m.events(failed=True, seals=True)]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    def ops(path):
        return [(e["op"], e.get("mode")) for e in evs if e["path"] == path]
    assert ops("p") == [("mknod", ops("p")[0][1]), ("chmod", 0o644)], ops("p")
    # the create began the run its write joined
    assert ops(long) == [("create", ops(long)[0][1]), ("chmod", 0o644)]
    assert [op for op, _ in ops("moved/sub/g")] == ["chmod", "chown"], evs[-8:]
    assert [op for op, _ in ops("h")][-1] == "chmod"
    j = m.journal()
    try:
        states = States(j, Tree.at(m.ws))
        end = evs[-1]["seq"]
        for path, kind in (("p", "fifo"), (long, "file"), ("moved/sub/g", "file"),
                           ("h", "file"), ("h2", "file")):
            st = states.state(path, end)
            assert st.exact and st.kind == kind and st.mode & 0o7777 == 0o644, (path, st)
    finally:
        j.close()


def test_utimens_held_or_not_on_other_shapes(make_mount):
    """A utimens is held where its epoch owes no pre-image, written ahead otherwise; either way
    each is recorded under the name the path had then, in order with no gap in the seqs, and
    the times are the ones asked: on a fifo, a symlink to a directory (the link itself), a
    file at a path near 4,000 bytes, a file whose directory was renamed with it beneath, a
    hard-linked file (its other name follows), and a file edited while unmounted (its drift
    comes first, then the utimens with its pre-image)."""
    from overlayrec.engines.states import States, Tree
    m = make_mount()
    with open(os.path.join(m.ws, "edited"), "w") as f:
        f.write("before")
    m.mount()
    m.sh("touch edited")  # recorded and sealed: the unmounted edit below is drift
    m.umount()
    with open(os.path.join(m.ws, "edited"), "a") as f:
        f.write(", edited while unmounted")
    m.mount()
    deep = "/".join(["d" * 200] * 19)  # 3,818 bytes of directories
    t = 1_600_000_000_000_000_000
    m.py("import os\n"
         f"t = {t}\n"
         "os.mkfifo('p', 0o644)\n"
         "os.utime('p', ns=(t, t))\n"
         "os.mkdir('dir')\n"
         "os.symlink('dir', 'link')\n"
         "os.utime('link', ns=(t, t + 1), follow_symlinks=False)\n"
         f"os.makedirs({deep!r})\n"
         f"long = {deep!r} + '/' + 'f' * 150\n"
         "with open(long, 'w') as f:\n"
         "    f.write('x')\n"
         "os.utime(long, ns=(t, t + 2))\n"
         "os.makedirs('top/sub')\n"
         "with open('top/sub/g', 'w') as f:\n"
         "    f.write('y')\n"
         "os.rename('top', 'moved')\n"
         "os.utime('moved/sub/g', ns=(t, t + 3))\n"
         "with open('h', 'w') as f:\n"
         "    f.write('z')\n"
         "os.link('h', 'h2')\n"
         "os.utime('h', ns=(t, t + 4))\n"
         "os.utime('edited', ns=(t, t + 5))\n")
    long = deep + "/" + "f" * 150
    m.umount()
    for path, mtime in (("link", t + 1), (long, t + 2), ("moved/sub/g", t + 3), ("h2", t + 4),
                        ("edited", t + 5), ("p", t)):
        assert os.lstat(os.path.join(m.ws, path)).st_mtime_ns == mtime, path
    evs = m.events()
    seqs = [e["seq"] for e in m.events(failed=True, seals=True)]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs

    def ops(path):
        return [e["op"] for e in evs if e["path"] == path]
    assert ops("p") == ["mknod", "utimens"], ops("p")
    assert ops("link") == ["symlink", "utimens"], ops("link")
    assert ops(long) == ["create", "utimens"], ops(long)  # the write joined the create
    assert ops("moved/sub/g") == ["utimens"], evs[-8:]
    assert ops("h")[-1] == "utimens" and ops("h2")[-1] == "alias", (ops("h"), ops("h2"))
    edited = [e for e in evs if e["path"] == "edited"]
    assert [e["op"] for e in edited][-2:] == ["drift", "utimens"], edited
    assert edited[-1]["pre"]["size"] == len("before, edited while unmounted")
    for path, mtime in (("p", t), ("link", t + 1), (long, t + 2), ("moved/sub/g", t + 3),
                        ("h", t + 4), ("edited", t + 5)):
        last = [e for e in evs if e["path"] == path and e["op"] == "utimens"][-1]
        assert last["mtime_ns"] == mtime, (path, last)
    j = m.journal()
    try:
        states = States(j, Tree.at(m.ws))
        end = evs[-1]["seq"]
        for path, kind, data in (("p", "fifo", b""), ("link", "symlink", b"dir"),
                                 (long, "file", b"x"), ("moved/sub/g", "file", b"y"),
                                 ("h", "file", b"z"), ("h2", "file", b"z"),
                                 ("edited", "file", b"before, edited while unmounted")):
            st = states.state(path, end)
            assert st.exact and st.kind == kind and st.data == data, (path, st)
    finally:
        j.close()


@needs_root  # the immutable flag
def test_a_refused_change_that_changes_nothing_leaves_no_event(make_mount):
    """A held chmod the underlay refuses did not happen: no event, and no gap in the seqs."""
    import array
    import fcntl
    m = make_mount()
    under = os.open(m.ws, os.O_RDONLY | os.O_DIRECTORY)  # the underlay, beneath the mount
    try:
        m.mount()
        p = os.path.join(m.ws, "g")
        with open(p, "wb") as f:  # this process's epoch, its metadata saved by the create
            f.write(b"x")
        os.chmod(p, 0o640)
        fd = os.open("g", os.O_RDONLY, dir_fd=under)
        flags = array.array("l", [0])
        fs_ioc_getflags, fs_ioc_setflags, immutable = 0x80086601, 0x40086602, 0x10
        try:
            fcntl.ioctl(fd, fs_ioc_getflags, flags, True)
            fcntl.ioctl(fd, fs_ioc_setflags, array.array("l", [flags[0] | immutable]))
        except OSError as e:
            os.close(fd)
            pytest.skip(f"the underlay has no immutable flag: {e}")
        try:
            with pytest.raises(PermissionError):
                os.chmod(p, 0o640)  # nothing would change: held, then refused
        finally:
            fcntl.ioctl(fd, fs_ioc_setflags, array.array("l", [flags[0]]))
            os.close(fd)
        os.chmod(p, 0o600)
        m.umount()
    finally:
        os.close(under)
    evs = m.events(failed=True)
    assert [(e["op"], e.get("mode")) for e in evs if e.get("path") == "g"][1:] == \
        [("chmod", 0o640), ("chmod", 0o600)], evs  # the write joined the create's run
    seqs = [e["seq"] for e in evs]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # no gap where it was


def test_thousands_of_files_created_and_removed(make_mount):
    """Enough inodes that the daemon's fds pass 1024 (FD_SETSIZE), by two processes."""
    m = seeded(make_mount, {})
    m.py("import os\nfor d in range(3):\n    os.mkdir(f'd{d}')\n    for i in range(600):\n"
         "        open(f'd{d}/f{i}', 'w').write('x' * 10)")
    r = m.sh("ls -R | wc -l; rm -rf d0 d1 d2; ls")
    assert r.stderr == "" and r.stdout.split() == ["1810"]
    evs = m.events()
    assert sum(e["op"] == "create" for e in evs) == 1800
    assert sum(e["op"] == "unlink" for e in evs) == 1800
    assert sum(e["op"] == "rmdir" for e in evs) == 3


def test_log_filters_and_follow(make_mount):
    import subprocess as sp
    import sys
    from conftest import overlayrec
    m = seeded(make_mount, {"a": b"a"})
    m.sh("echo 1 >> a; mkdir d; touch d/x; rm a")
    seqs = [e["seq"] for e in m.events()]
    ops = lambda *args: [l.split()[5] for l in overlayrec("log", m.ws, *args).stdout.splitlines()]
    assert ops("--op", "mkdir", "--op", "unlink") == ["mkdir", "unlink"]
    assert ops("--since", str(seqs[1]), "--until", str(seqs[2])) == ["create"]
    assert ops("--outside", "--op", "write") == ["write"]  # no session: every writer is outside
    assert ops("--since", "2000-01-01T00:00:00") == ops()
    assert ops("--until", "@1") == []
    r = overlayrec("log", m.ws, "--since", "yesterday-ish", check=False)
    assert r.returncode == 1 and "not a point" in r.stderr
    f = sp.Popen([sys.executable, "-m", "overlayrec", "log", m.ws, "--follow", "--op", "create"],
                 stdout=sp.PIPE, text=True)
    try:
        m.sh("touch late-arrival")
        line = f.stdout.readline()
        while "late-arrival" not in line:
            line = f.stdout.readline()
        assert line.split()[5] == "create"
    finally:
        f.terminate()
        f.wait(timeout=10)
    # a refused change is followed with its "(failed: ...)", as `log` says it (the event went
    # out before its failed note came: found by a bug hunt)
    os.makedirs(os.path.join(m.ws, "full", "inside"))
    f = sp.Popen([sys.executable, "-m", "overlayrec", "log", m.ws, "--follow", "--op", "rmdir"],
                 stdout=sp.PIPE, text=True)
    try:
        time.sleep(1)
        m.sh("rmdir full || true")
        line = f.stdout.readline()
        assert "full" in line and "(failed: Directory not empty)" in line, line
    finally:
        f.terminate()
        f.wait(timeout=10)


@needs_fuse
def test_a_write_through_a_link_made_before_the_mount_succeeds(make_mount):
    """A file with two names made before the mount, written through one the mount has not
    matched with the other, while the daemon knows some other linked file: the write must
    land.  It failed with EIO: the recorder took the inode's names as a set where it had none
    (``Names.get`` gave an empty tuple)."""
    m = linked_before_mount(make_mount())
    m.sh("echo more >> b/second.txt")
    m.umount()
    assert open(os.path.join(m.ws, "a", "w.txt")).read() == "orig\nmore\n"
    log = open(os.path.join(m.state, "daemon.log"), errors="replace").read()
    assert "Traceback" not in log, log[-2000:]


def test_an_unmount_keeps_what_a_shared_mapping_wrote(make_mount, tmp_path):
    """A process writes through a MAP_SHARED mapping and still holds it at `umount`: the
    kernel's dirty pages had nowhere to go once the mount was gone, and the write, which every
    reader had seen, was lost from the file and the record (found by a hunt).  The daemon has
    the kernel write them back (syncfs) before it unmounts."""
    m = seeded(make_mount, {"k": b"k" * 8192})
    written = tmp_path / "written"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import mmap, os, time
        fd = os.open("k", os.O_RDWR); m = mmap.mmap(fd, 0); os.close(fd)
        m[0:5] = b"HELLO"
        open({str(written)!r}, "w").close()
        time.sleep(30)
    """)], cwd=m.ws)
    try:
        deadline = time.monotonic() + 30 * SLOW
        while not written.exists():
            assert time.monotonic() < deadline and holder.poll() is None
            time.sleep(0.02)
        overlayrec("umount", m.ws)
    finally:
        holder.kill()
        holder.wait()
    assert open(os.path.join(m.ws, "k"), "rb").read(8) == b"HELLOkkk"
    assert [e["path"] for e in m.events() if e["op"] == "write"] == ["k"]
