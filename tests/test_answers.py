"""Kept answers (engines.answers): a question asked again of the same record is answered from
what was kept, and that answer is always the one made afresh.

A recorded session (two calls in a turn: writes, a directory renamed with files beneath, an
unlink, a large file, a fifo, a hard link, a file at a path near 4,000 bytes), then changes of every kind a kept answer must notice: the daemon's own
events, an edit made while unmounted that keeps the size and puts the mtime back, a chmod
while unmounted, a symlink planted on the way to recorded files, a file held open and written twice (an open epoch, whose writes are no
events), a new session whose one call changes nothing (a record written without an event
moves the journal's generation: the unit test below).  At each step every question is asked
with the answers kept so far, then with none, and the two must be the same, and the same
through click's commands as through fastcli; asked once more, nothing changed, the kept answer
must be the one used (its file is not written again).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

from conftest import needs_fuse, overlayrec

from overlayrec.journal import Journal

LONG = "/".join(["p" * 200] * 19)  # a path of 3,819 bytes, its file's near 4,000

AGENT = textwrap.dedent(r'''
    import os, subprocess
    from overlayrec import client
    LONG = %r
    def sh(cmd):
        subprocess.run(["bash", "-c", cmd], check=True)
    with client.connect() as c:
        c.turn_begin(prompt="change things")
        c.call_begin("c1", "Bash", summary="writes")
        sh("printf 'one\\ntwo\\n' > a.txt && printf 'b\\n' >> b.txt && mkdir -p d/e && "
           "printf 'x\\n' > d/e/x.txt && head -c 300000 /dev/urandom | base64 > big.txt")
        c.call_end("c1")
        c.call_begin("c2", "Bash", summary="moves and removes")
        sh("mv d moved && printf 'y\\n' >> moved/e/x.txt && rm gone.txt && "
           "printf 'three\\n' >> a.txt && mkfifo pipe && ln a.txt hard.txt && "
           "mkdir -p " + LONG + " && printf 'deep\\n' > " + LONG + "/f")
        c.call_end("c2")
        c.turn_end()
''' % LONG)

QUESTIONS = [
    ["diff", "--session", "s", "--turn", "1", "--stat"],
    ["diff", "--session", "s", "--turn", "last"],
    ["diff", "--call", "c1", "--json"],
    ["diff", "--call", "c2", "--by-writer"],
    ["diff", "--since", "0", "--numstat"],
    ["diff", "--drift"],
    ["calls"],
    ["calls", "--json", "--all"],
    ["turns"],
    ["turns", "--json"],
]


def ask(m, q) -> tuple:
    r = overlayrec(q[0], m.ws, "--state-dir", m.state, *q[1:], check=False)
    return r.returncode, r.stdout, r.stderr


# the CLI through click itself: the plain command lines above go through fastcli otherwise
BY_CLICK = "import sys; from overlayrec.cli import main; main(sys.argv[1:], 'overlayrec')"


def ask_click(m, q) -> tuple:
    r = subprocess.run([sys.executable, "-c", BY_CLICK, q[0], m.ws, "--state-dir", m.state,
                        *q[1:]], capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout, r.stderr


def kept_files(m) -> dict:
    d = os.path.join(m.state, "answers")
    if not os.path.isdir(d):
        return {}
    return {n: os.stat(os.path.join(d, n)).st_ino for n in os.listdir(d)}


def agree(m, *, kept_again=True) -> dict:
    """Every question: the answer with what was kept equals the one made afresh; asked again,
    the kept answer is used (``kept_again``).  The fresh answers, by question."""
    before = {}
    for q in QUESTIONS:
        before[json.dumps(q)] = ask(m, q)
    shutil.rmtree(os.path.join(m.state, "answers"), ignore_errors=True)
    fresh = {}
    for q in QUESTIONS:
        key = json.dumps(q)
        fresh[key] = ask(m, q)
        assert fresh[key] == before[key], (q, before[key], fresh[key])
        assert fresh[key][0] == 0, (q, fresh[key])
    # click's commands answer as fastcli did, made afresh; what they keep fastcli reads back
    shutil.rmtree(os.path.join(m.state, "answers"), ignore_errors=True)
    for q in QUESTIONS:
        assert ask_click(m, q) == fresh[json.dumps(q)], q
    files = kept_files(m)
    if kept_again:
        assert len(files) == len(QUESTIONS), files
    for q in QUESTIONS:
        assert ask(m, q) == fresh[json.dumps(q)], q
    if kept_again:
        assert kept_files(m) == files  # read back, not made and written again
    return fresh


def written_out(m, fresh: dict) -> None:
    """A reader leaves without the interpreter's teardown (entry._leave) once it has answered:
    what it wrote still reaches a pipe whole, read slowly and in small pieces, and a stdout
    that cannot take it (a full device) is a one-line error and a non-zero exit."""
    for q in (["calls"], ["diff", "--session", "s", "--turn", "last"]):
        args = [sys.executable, "-m", "overlayrec", q[0], m.ws, "--state-dir", m.state, *q[1:]]
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        got = b""
        while chunk := p.stdout.read(7):
            got += chunk
        err = p.stderr.read()
        assert p.wait(timeout=60) == 0, err
        assert got.decode() == fresh[json.dumps(q)][1], q
        with open("/dev/full", "w") as full:
            r = subprocess.run(args, stdout=full, stderr=subprocess.PIPE, text=True,
                               timeout=60)
        assert r.returncode == 1, (q, r.returncode, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
        assert "No space left" in r.stderr, r.stderr


@needs_fuse
def test_kept_answers_are_the_fresh_ones(make_mount, tmp_path):
    m = make_mount()
    for name, data in (("a.txt", "a\n"), ("b.txt", "b\n"), ("gone.txt", "g\n")):
        with open(os.path.join(m.ws, name), "w") as f:
            f.write(data)
    m.mount()
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable, str(agent),
               cwd=m.ws, timeout=120)
    m.umount()
    first = agree(m)
    written_out(m, first)
    stat = first[json.dumps(QUESTIONS[0])][1]
    assert "a.txt" in stat and "moved/e/x.txt" in stat and "gone.txt" in stat, stat
    assert "hard.txt" in stat and "/f " in stat, stat

    # unmounted: a.txt edited in place, its size kept and its mtime put back (only its ctime
    # says so), then b.txt's mode: each is drift, and every answer that read them is made again
    a = os.path.join(m.ws, "a.txt")
    st = os.stat(a)
    with open(a, "r+") as f:
        f.write("ONE")
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = agree(m)
    assert second != first
    assert "a.txt" in second[json.dumps(["diff", "--drift"])][1]
    os.chmod(os.path.join(m.ws, "b.txt"), 0o755)  # git shows the x bit
    third = agree(m)
    assert "b.txt" in third[json.dumps(["diff", "--drift"])][1]
    # a symlink planted on the way: moved/ is now a link to a copy elsewhere (the record's
    # files are no longer reachable without following it)
    os.rename(os.path.join(m.ws, "moved"), os.path.join(m.ws, "elsewhere"))
    os.symlink("elsewhere", os.path.join(m.ws, "moved"))
    fourth = agree(m)
    assert fourth != third

    # mounted again: a file held open and written twice, asked between the writes; the answers
    # that read its open epoch are not kept (its writes are no events)
    m.mount()
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent('''
            import os, sys
            fd = os.open("held.txt", os.O_WRONLY | os.O_CREAT, 0o644)
            for chunk in (b"first\\n", b"other\\n"):
                os.write(fd, chunk)
                print("written", flush=True)
                sys.stdin.readline()
            os.close(fd)
        ''')], cwd=m.ws, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "written\n"
        q = ["diff", "--since", "0", "--stat"]
        shutil.rmtree(os.path.join(m.state, "answers"), ignore_errors=True)
        once = ask(m, q)
        assert "held.txt" in once[1], once
        assert kept_files(m) == {}  # it read an open epoch's live end: not kept
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline() == "written\n"
        # the same size, likely the same clock tick: only the journal's word could tell
        again = ask(m, q)
        shutil.rmtree(os.path.join(m.state, "answers"), ignore_errors=True)
        assert again == ask(m, q)
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=30) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    # a session whose call changes nothing
    j = Journal(m.state, readonly=True)
    try:
        gen = j.generation()
    finally:
        j.close()
    agree(m, kept_again=False)  # read through the mount: its epochs may be open
    overlayrec("run", "-w", m.ws, "--session", "s2", "--", sys.executable, "-c", textwrap.dedent('''
        from overlayrec import client
        with client.connect() as c:
            c.turn_begin(prompt="nothing")
            c.call_begin("idle", "Read", summary="reads only")
            c.call_end("idle")
            c.turn_end()
    '''), cwd=m.ws, timeout=120)
    m.umount()
    j = Journal(m.state, readonly=True)
    try:
        assert j.generation() > gen
    finally:
        j.close()
    last = agree(m)
    assert "idle" in last[json.dumps(["calls"])][1]
    # the turns' times are shown in the local zone: another zone is another question
    shown = {}
    for tz in ("UTC", "Asia/Tokyo", "UTC"):
        r = overlayrec("turns", m.ws, "--state-dir", m.state, env=dict(os.environ, TZ=tz))
        shown.setdefault(tz, set()).add(r.stdout)
    assert len(shown["UTC"]) == 1 and shown["UTC"] != shown["Asia/Tokyo"], shown


def test_generation_moves_with_records(tmp_path):
    """A record written without an event (a call's end) moves the journal's generation."""
    j = Journal(str(tmp_path), workspace=str(tmp_path))
    try:
        g0 = j.generation()
        j.put_record("calls", b"s\0c", {"id": "c"})
        g1 = j.generation()
        assert g1 > g0
        j.put_meta("x", "y")
        assert j.generation() > g1
    finally:
        j.close()


def test_kept_answer_with_undecodable_names(tmp_path):
    """An answer naming a path of bytes that are not UTF-8 (held as lone surrogates) is kept
    and read back as it was made (orjson takes no lone surrogate: the standard module does)."""
    from overlayrec.engines.answers import Answers, Reads
    j = Journal(str(tmp_path / "sd"), workspace=str(tmp_path))
    try:
        kept = tmp_path / "answers"
        kept.mkdir()
        answers = Answers(str(kept), j, lambda keys: {k: None for k in keys})
        name = os.fsdecode(b"caf\xe9.txt")
        reads = Reads()
        reads.note(name, None)
        for question, parts in ((["calls", name], [(1, f"{name}\n"), (2, "warned\n")]),
                                (["calls", "plain"], [(1, "caf\u00e9 \u2028 ok\n")])):
            answers.put(question, parts, reads)
            assert answers.get(question) == parts
    finally:
        j.close()


def test_what_other_code_kept_is_made_again(tmp_path, monkeypatch):
    """A kept answer and kept listing rows name the code that made them (state.code_ident):
    after an upgrade, or an edit of any module, the readers answer afresh instead of giving
    back what the readers before them kept (a fixed reader would otherwise repeat its old
    answer until the record changed)."""
    from overlayrec import state
    from overlayrec.engines import answers as answers_mod, listings
    # the ident follows every module's name, size and mtime, bytecode caches aside
    pkg = tmp_path / "pkg"
    (pkg / "sub" / "__pycache__").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    first = state.package_ident(str(pkg))
    (pkg / "sub" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"\0")
    assert state.package_ident(str(pkg)) == first
    os.utime(pkg / "sub" / "b.py", ns=(1, 1))
    assert state.package_ident(str(pkg)) != first
    assert state.code_ident() == state.package_ident(os.path.dirname(state.__file__))

    j = Journal(str(tmp_path / "sd"), workspace=str(tmp_path))
    try:
        j.append({"op": "create", "path": "a", "actor": "1:1"},
                 {"key": "1:1", "pid": 1, "start": 1, "uid": 0})
        kept = tmp_path / "answers"
        kept.mkdir()
        made = answers_mod.Answers(str(kept), j, lambda keys: {k: None for k in keys})
        made.put(["calls"], [(1, "old readers' answer\n")], answers_mod.Reads())
        rows_dir = tmp_path / "listings"
        rows_dir.mkdir()
        rows = listings.shards(j, str(rows_dir), ["turns"])["turns"]
        rows.put("turn:s:1", {"paths": ["a"], "touched": ["a"]}, settled=True)
        rows.save()
        assert answers_mod.Answers(str(kept), j, lambda keys: {}).get(["calls"]) is not None
        assert listings.shards(j, str(rows_dir), ["turns"])["turns"].get("turn:s:1")
        monkeypatch.setattr(state, "_CODE", "other code")
        assert answers_mod.Answers(str(kept), j, lambda keys: {}).get(["calls"]) is None
        assert listings.shards(j, str(rows_dir), ["turns"])["turns"].get("turn:s:1") is None
    finally:
        j.close()
