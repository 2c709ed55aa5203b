"""``overlayrec check``: a record made through a real mount reads as whole, mounted or not; each
piece a reader would need, taken away by hand (an actor's row, a blob of the content store, an
attic entry), is named, with the events that name it, and the exit status says so."""
from __future__ import annotations

import json
import os
import stat

import lmdb

from conftest import needs_fuse, overlayrec
from overlayrec.journal import schema

pytestmark = needs_fuse


def recorded(make_mount):
    m = make_mount()
    with open(os.path.join(m.ws, "big.log"), "wb") as f:
        f.write(b"x" * 400_000)      # past the small pre-image: its unlink keeps it in the attic
    with open(os.path.join(m.ws, "mid.txt"), "wb") as f:
        f.write(b"m\n" * 50_000)     # 100 KB: its pre-image a file of the content store
    with open(os.path.join(m.ws, "small.txt"), "w") as f:
        f.write("one\n")
    m.mount()
    m.sh("rm big.log; sed -i s/m/n/ mid.txt; echo two >> small.txt; mkdir d; mv small.txt d/")
    return m


def check(m, *args):
    return overlayrec("check", m.ws, "--state-dir", m.state, *args, check=False)


def test_a_record_made_through_the_mount_is_whole_mounted_and_not(make_mount):
    m = recorded(make_mount)
    try:
        r = check(m)  # mounted: the attic is read beneath the mount
        assert r.returncode == 0 and r.stdout.startswith("record whole: "), r.stdout + r.stderr
    finally:
        m.umount()
    r = check(m, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["whole"] and out["findings"] == [] and out["attic_looked_at"]
    assert out["attic_entries"] == 1 and out["blobs"] >= 1 and out["actors"] >= 3


def test_what_was_taken_away_is_named(make_mount):
    m = recorded(make_mount)
    m.umount()
    evs = m.events()
    unlink = next(e for e in evs if e["op"] == "unlink" and e["path"] == "big.log")
    entry = unlink["pre"]["attic"]
    os.unlink(m.attic(entry))
    # the 100 KB pre-image of mid.txt, which sed renamed over: a file of the content store
    digest = next(e["pre2"]["blob"] for e in evs if e.get("path2") == "mid.txt")
    blob_file = os.path.join(m.state, "content", digest[:2], digest[2:])
    assert os.path.exists(blob_file), os.listdir(os.path.join(m.state, "content"))
    os.unlink(blob_file)
    rm_actor = unlink["actor"]
    env = lmdb.open(os.path.join(m.state, "journal"), max_dbs=len(schema.DBS) + 1)
    try:
        with env.begin(write=True) as txn:
            assert txn.delete(rm_actor.encode(), db=env.open_db(b"actors", txn=txn))
    finally:
        env.close()
    r = check(m)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert f"no attic entry {entry}, named by 1 event(s) (the first: seq {unlink['seq']}, " \
        "big.log)" in lines, lines
    assert any(line.startswith(f"no content held for {digest}, named by ") for line in lines)
    assert any(line.startswith(f"no process (actor) recorded for {rm_actor}, named by 1 event(s)")
               for line in lines), lines
    assert lines[-1].startswith("record not whole: ") and lines[-1].endswith("; 3 finding(s)")
    assert r.stderr == f"overlayrec: error: the record of {m.ws} is not whole: 3 finding(s), " \
        "listed above\n", r.stderr
    out = json.loads(check(m, "--json").stdout)
    assert not out["whole"]
    assert sorted(f["kind"] for f in out["findings"]) == ["actor", "attic", "blob"]


def test_a_record_that_is_no_event_is_a_finding(make_mount):
    """A record of the events table that is no event (a reader refuses to answer over it) is
    named; the rest is checked as before."""
    m = recorded(make_mount)
    m.umount()
    first = m.events()[0]["seq"]
    env = lmdb.open(os.path.join(m.state, "journal"), max_dbs=len(schema.DBS) + 1)
    try:
        with env.begin(write=True) as txn:
            txn.put(schema.seq_key(first), b"[1, 2, 3]", db=env.open_db(b"events", txn=txn))
    finally:
        env.close()
    r = check(m)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0] == f"not an event: event {first} is not a JSON object but list", lines
    assert lines[-1].endswith("; 1 finding(s)"), lines


def test_bytes_of_the_log_ahead_kept_aside_are_a_finding(make_mount):
    m = make_mount().mount()
    m.sh("echo a > f")
    m.umount()
    with open(os.path.join(m.state, "journal", "ahead.log"), "ab") as f:
        f.write(b"\x40\x00\x00\x00 torn")
    overlayrec("mount", m.ws, "--state-dir", m.state)  # its open keeps them aside
    m.umount()
    r = check(m)
    assert r.returncode == 1
    assert r.stdout.startswith("unread bytes of the log ahead kept aside in "
                               + os.path.join(m.state, "journal", "ahead.log.unread-")), r.stdout


def test_without_its_workspace_the_attic_is_not_looked_at(make_mount, tmp_path):
    """A record whose workspace has gone (moved, deleted) is checked for what the state dir
    holds; its attic entries are not taken as missing, and the summary says it did not look."""
    m = recorded(make_mount)
    m.umount()
    os.rename(m.ws, str(tmp_path / "moved"))
    r = check(m)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("checked (the attic not looked at: no workspace)")


def test_the_pass_tells_its_progress_up_to_the_last_event(make_mount):
    """What ``overlayrec check`` shows on a terminal once the pass has taken a second: the
    seqs it has reached, rising, ending at the record's last."""
    from overlayrec.engines.check import check as do_check
    from overlayrec.journal import Journal
    m = make_mount().mount()
    m.sh("for i in $(seq 1 300); do echo $i > f$i; done")
    m.umount()
    told = []
    j = Journal(m.state, readonly=True)
    try:
        out = do_check(j, None, lambda n, total: told.append((n, total)))
        last = j.last_seq()
    finally:
        j.close()
    assert out["findings"] == [] and out["events"] >= 600
    assert told[-1] == (last, last) and len(told) >= 3, told
    assert [n for n, _ in told] == sorted(n for n, _ in told)


def test_every_shape_of_file_and_path_reads_as_whole(make_mount):
    """Not only the shapes first thought of: a directory renamed with files beneath (a large one
    removed there after, kept by the attic), a fifo, a hard-linked file removed under one name,
    a symlink to a directory, a path of about 4,000 bytes with a large file removed in it, and
    an edit made while unmounted (drift): every piece the record names is found."""
    m = make_mount()
    deep = "/".join(["d" * 240] * 16)  # 3,855 bytes of directories
    os.makedirs(os.path.join(m.ws, "src/pkg"))
    for rel, size in (("src/pkg/big.bin", 300_000), ("src/pkg/a.py", 10), ("linked", 300_000)):
        with open(os.path.join(m.ws, rel), "wb") as f:
            f.write(b"z" * size)
    os.link(os.path.join(m.ws, "linked"), os.path.join(m.ws, "other-name"))
    m.mount()
    m.sh(f"mv src lib && rm lib/pkg/big.bin && echo b >> lib/pkg/a.py && mkfifo lib/fifo && "
         f"ln -s lib dirlink && rm linked && mkdir -p {deep} && "
         f"head -c 300000 /dev/zero > {deep}/f && rm {deep}/f && echo x > {deep}/g")
    m.umount()
    with open(os.path.join(m.ws, "lib/pkg/a.py"), "w") as f:  # a recorded path: sealed
        f.write("changed while unmounted\n")
    m.mount()
    m.umount()
    evs = m.events()
    assert any(e["op"] == "drift" for e in evs)
    assert any(e["op"] == "rename" and e["path"] == "src" for e in evs)
    out = json.loads(check(m, "--json").stdout)
    assert out["whole"] and out["findings"] == [], out
    assert out["attic_entries"] >= 2, out  # the two large files removed
    assert check(m).returncode == 0


def test_bad_input_is_one_line(make_mount, tmp_path):
    r = overlayrec("check", str(tmp_path / "nowhere"), check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr


def test_an_entry_written_through_a_link_outside_the_record_is_a_finding(make_mount, tmp_path):
    """A package manager's store (pnpm) hard-links its files into node_modules; the agent's
    `rm -rf node_modules` keeps each file in the attic (past the whole-file limit: no copy in the
    store), and a later write to the store's name changes the entry: the pre-image is lost.
    Readers said so (revert: `unrecorded`), `check` said "record whole".  A hard link inside
    the record (whose writes the record saw) is no finding."""
    store = tmp_path / "store"
    store.mkdir()
    knobs = dict(os.environ, OVERLAYREC_TEST_WHOLE_FILE_LIMIT="2",
                 OVERLAYREC_TEST_SMALL_PREIMAGE="-1")
    m = make_mount(env=knobs)
    os.makedirs(os.path.join(m.ws, "node_modules", "p"))
    for name in ("f.js", "g.js"):
        (store / name).write_text(f"{name} v1\n" * 100)
        os.link(store / name, os.path.join(m.ws, "node_modules", "p", name))
    with open(os.path.join(m.ws, "inside.txt"), "w") as f:
        f.write("in\n" * 100)
    m.mount()
    m.sh("ln inside.txt inside2.txt; rm -rf node_modules inside.txt; echo more >> inside2.txt")
    m.umount()
    r = check(m)
    assert r.returncode == 0 and r.stdout.startswith("record whole: "), r.stdout + r.stderr
    with open(store / "f.js", "a") as f:
        f.write("v2\n")
    r = check(m, "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    found = json.loads(r.stdout)["findings"]
    assert [(f["kind"], f["path"]) for f in found] == \
        [("attic-changed", "node_modules/p/f.js")], found
    r = check(m)
    assert r.returncode == 1 and "changed since kept" in r.stdout and \
        "node_modules/p/f.js" in r.stdout, r.stdout
    # as the readers say: the revert of the rm refuses that path, unrecorded
    r = overlayrec("revert", m.ws, "--state-dir", m.state, "--since", "0", "--json",
                   check=False)
    steps = {s["path"]: s["conflict"] for s in json.loads(r.stdout)["steps"]}
    assert steps["node_modules/p/f.js"] == "unrecorded" and \
        steps["node_modules/p/g.js"] is None, steps


def test_an_entry_changed_around_the_record_is_known_by_every_reader(make_mount, tmp_path):
    """A large file removed by the agent is kept whole in the attic under its one name; the
    entry truncated by hand while unmounted.  `check` said "record whole", and diff, replay
    and revert took the entry as it is now for what the file held (exact, a 1,000-byte
    file).  The entry is taken only while its size and mtime are those the pre-image noted:
    else the state is inexact, as for a hard-linked entry written through another name.  One
    written through a descriptor left open on it (its own events) is read from those."""
    knobs = dict(os.environ, OVERLAYREC_TEST_SMALL_PREIMAGE="-1")
    m = make_mount(env=knobs)
    for name in ("big.bin", "open.bin"):
        with open(os.path.join(m.ws, name), "wb") as f:
            f.write(os.urandom(300_000))
    m.mount()
    # open.bin: removed while a descriptor stays open on it, then written through it
    overlayrec("run", "-w", m.ws, "--session", "s1", "--", "sh", "-c",
               "exec 3>>open.bin; rm big.bin open.bin; echo late >&3", cwd=m.ws)
    m.umount()
    assert check(m).returncode == 0
    attic = os.path.join(m.ws, ".overlayrec-attic")
    pre = {e["path"]: e["pre"]["attic"] for e in m.events() if e["op"] == "unlink"}
    os.truncate(os.path.join(attic, pre["big.bin"]), 1000)
    r = check(m, "--json")
    assert r.returncode == 1
    assert [(f["kind"], f["path"]) for f in json.loads(r.stdout)["findings"]] == \
        [("attic-changed", "big.bin")], r.stdout
    plan = json.loads(overlayrec("revert", m.ws, "--state-dir", m.state, "--session", "s1",
                                 "--json", check=False).stdout)
    steps = {s["path"]: s["conflict"] for s in plan["steps"]}
    assert steps == {"big.bin": "unrecorded", "open.bin": None}, steps
    out = json.loads(overlayrec("replay", m.ws, "--state-dir", m.state, "--at",
                                "before:session:s1", "--to", str(tmp_path / "r"),
                                "--json").stdout)
    assert out["inexact"] == ["big.bin"], out
    assert (tmp_path / "r" / "open.bin").stat().st_size == 300_000
    diff = json.loads(overlayrec("diff", m.ws, "--state-dir", m.state, "--session", "s1",
                                 "--json").stdout)
    assert diff["inexact"] == ["big.bin"], diff
    assert {f["path"] for f in diff["files"]} == {"big.bin", "open.bin"}, diff


def test_entries_changed_around_the_record_beneath_a_renamed_long_path(make_mount, tmp_path):
    """The same rule off the first shapes: two large files in a directory some 3,800 bytes
    deep, beside a fifo and a symlink; the session renames the directory, then removes both
    files under their new names; one attic entry is truncated while unmounted.  Only that one
    is a finding and inexact; the other, and the fifo and symlink renamed with them, read back
    exactly."""
    knobs = dict(os.environ, OVERLAYREC_TEST_SMALL_PREIMAGE="-1")
    m = make_mount(env=knobs)
    deep = "/".join(["d" * 200] * 19)
    os.makedirs(os.path.join(m.ws, deep))
    for name in ("one.bin", "two.bin"):
        with open(os.path.join(m.ws, deep, name), "wb") as f:
            f.write(os.urandom(300_000))
    os.mkfifo(os.path.join(m.ws, deep, "p"))
    os.symlink("one.bin", os.path.join(m.ws, deep, "l"))
    m.mount()
    moved = "e" + deep[1:]
    overlayrec("run", "-w", m.ws, "--session", "s1", "--", "sh", "-c",
               f"mv {'d' * 200} {'e' + 'd' * 199} && rm {moved}/one.bin {moved}/two.bin",
               cwd=m.ws)
    m.umount()
    entries = {e["path"]: e["pre"]["attic"] for e in m.events() if e["op"] == "unlink"}
    assert set(entries) == {f"{moved}/one.bin", f"{moved}/two.bin"}, entries
    os.truncate(os.path.join(m.ws, ".overlayrec-attic", entries[f"{moved}/one.bin"]), 10)
    found = json.loads(check(m, "--json").stdout)["findings"]
    assert [(f["kind"], f["path"]) for f in found] == \
        [("attic-changed", f"{moved}/one.bin")], found
    out = json.loads(overlayrec("replay", m.ws, "--state-dir", m.state, "--at",
                                "before:session:s1", "--to", str(tmp_path / "r"),
                                "--json").stdout)
    assert out["inexact"] == [f"{deep}/one.bin"], out
    r = tmp_path / "r" / deep
    assert (r / "two.bin").stat().st_size == 300_000 and os.readlink(r / "l") == "one.bin"
    assert stat.S_ISFIFO((r / "p").lstat().st_mode)


def _lmdb_put(m, db: bytes, key: bytes, value: bytes | None, delete: bool = False) -> None:
    env = lmdb.open(os.path.join(m.state, "journal"), max_dbs=len(schema.DBS) + 1)
    try:
        with env.begin(write=True) as txn:
            handle = env.open_db(db, txn=txn)
            if delete:
                assert txn.delete(key, db=handle)
            else:
                txn.put(key, value, db=handle)
    finally:
        env.close()


def test_damage_the_readers_would_pass_over_is_a_finding(make_mount):
    """Found by a bug hunt, each with `check` saying "record whole": a blob of the store cut
    short (every reader then refused it); a path index entry whose key a flipped byte changed
    (diff left that change out without a word); a process row that is no JSON (check and log
    failed with an internal error); bytes after the log ahead's last whole record (the events
    in it hidden from every reader until the next mount)."""
    m = recorded(make_mount)
    m.umount()
    evs = m.events()
    digest = next(e["pre2"]["blob"] for e in evs if e.get("path2") == "mid.txt")
    blob_file = os.path.join(m.state, "content", digest[:2], digest[2:])
    os.truncate(blob_file, 10)
    moved = next(e for e in evs if e["op"] == "rename" and e.get("path2") == "d/small.txt")
    key, value = schema.path_item("d/small.txt", schema.seq_key(moved["seq"]))
    _lmdb_put(m, b"paths", key, None, delete=True)
    _lmdb_put(m, b"paths", key.replace(b"small", b"smalp"), value)
    actor = next(e["actor"] for e in evs if e["op"] == "unlink")
    _lmdb_put(m, b"actors", actor.encode(), b"X{not json")
    r = check(m)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    out = json.loads(check(m, "--json").stdout)
    kinds = sorted(f["kind"] for f in out["findings"])
    assert kinds == ["actor", "blob-changed", "index", "index"], out["findings"]
    r = overlayrec("log", m.ws, "--state-dir", m.state, check=False)
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    # the log ahead: a damaged record hides the whole ones after it
    m2 = make_mount(sub="m2").mount()
    m2.sh("echo a > f")
    m2.umount()
    with open(os.path.join(m2.state, "journal", "ahead.log"), "ab") as f:
        f.write(b"\x40\x00\x00\x00 torn, and what follows it")
    out = json.loads(check(m2, "--json").stdout)
    assert [f["kind"] for f in out["findings"]] == ["ahead"], out["findings"]
    assert "after the last whole record" in out["findings"][0]["name"]


def test_a_revert_plan_that_cannot_be_read_is_said_and_refused(make_mount):
    """A revert plan cut short was passed over without a word: an interrupted revert could
    then be neither continued nor rolled back, and a gc dropped what its unrevert needed; one
    that was JSON but no record failed status, revert, unrevert and gc with an internal error
    (found by a bug hunt).  Each says so in one line and refuses; status and check name it."""
    m = make_mount().mount()
    m.sh("echo a > f")
    overlayrec("run", "-w", m.ws, "--session", "s", "--", "bash", "-c", "echo b >> f",
               cwd=m.ws)
    overlayrec("revert", m.ws, "--session", "s", "--yes")
    m.umount()
    plans = os.path.join(m.state, "reverts")
    [name] = [n for n in os.listdir(plans) if n.endswith(".json")]
    for damage in (b'{"id": "20', b"[1, 2]"):
        with open(os.path.join(plans, name), "wb") as f:
            f.write(damage)
        st = json.loads(overlayrec("status", m.ws, "--state-dir", m.state, "--json").stdout)
        assert [p["file"] for p in st["damaged_plans"]] == [name], st
        assert f"revert plan {name} cannot be read" in overlayrec(
            "status", m.ws, "--state-dir", m.state).stdout
        out = json.loads(check(m, "--json").stdout)
        assert [f["kind"] for f in out["findings"]] == ["plan"], out
        for args in (["unrevert", "-w", m.ws], ["revert", m.ws, "--session", "s"],
                     ["revert", m.ws, "--continue"], ["gc", m.ws, "--keep-last", "0"]):
            r = overlayrec(*args, "--state-dir", m.state, check=False)
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 1 and len(lines) == 1, (args, r.stderr)
            assert "cannot be read" in lines[0] and name in lines[0], (args, lines)


def test_a_journal_gone_from_its_state_dir_is_said_by_status(make_mount):
    """The state dir's journal/ removed: `status` said "journal: (none yet)", exit 0, as of a
    workspace never recorded (found by a bug hunt).  It says the journal is missing, exit 1."""
    import shutil
    m = make_mount().mount()
    m.sh("echo a > f")
    m.umount()
    shutil.rmtree(os.path.join(m.state, "journal"))
    r = overlayrec("status", m.ws, "--state-dir", m.state, check=False)
    assert r.returncode == 1 and "journal: missing from" in r.stdout, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = overlayrec("status", m.ws, "--state-dir", m.state, "--json", check=False)
    assert r.returncode == 1 and json.loads(r.stdout)["journal_missing"], r.stdout
