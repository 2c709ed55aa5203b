"""Secret paths on a real mount: a call that writes and edits `.env`, `keys/id.pem` and
`.ssh/config` (and moves, deletes and renames over secrets) leaves its events, each pre-image
``withheld``, and not one byte of any secret anywhere in the state dir (LMDB, content store,
git store, exports, logs), whatever reader ran; diff says "content not kept", revert refuses
with `unrecorded`, replay makes nothing there, while the ordinary file beside them still diffs
and reverts.  `--secret` adds a pattern, `--no-default-secrets` drops the defaults."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
import uuid
import zlib

import pytest

from conftest import needs_fuse, overlayrec, run_script

pytestmark = needs_fuse


def secrets(n: int) -> list[bytes]:
    tag = uuid.uuid4().hex
    return [f"S3CR3T-{i}-{tag}".encode() for i in range(n)]


# the agent writes from Python: a shell command's argv (which the journal keeps, as it keeps
# every process's) would carry the secret itself
AGENT = textwrap.dedent(r'''
    import os, sys
    from overlayrec import client
    vals = open(sys.argv[1], "rb").read().split(b"\n")
    def put(p, data, mode="wb"):
        with open(p, mode) as f:
            f.write(data)
    with client.connect() as c:
        c.turn_begin(prompt="secrets")
        c.call_begin("c1", "Write")
        put(".env.local", vals[0] + b"\n")               # a new secret
        put(".env", b"MORE=" + vals[1] + b"\n", "ab")    # an existing one edited
        os.makedirs("keys", exist_ok=True)
        put("keys/id.pem", vals[2] + b"\n")
        os.makedirs(".ssh", exist_ok=True)
        put(".ssh/config", b"Host x\n  IdentityFile " + vals[3] + b"\n")
        put(".env.tmp", vals[4] + b"\n")
        os.rename(".env.tmp", "env.bak")                  # a secret under an ordinary name
        put("env.bak", b"tail\n", "ab")                   # ... changed there
        os.unlink(".npmrc")                               # a secret deleted
        put("plain.new", b"not secret\n")
        os.rename("plain.new", ".pypirc")                 # a secret renamed over
        put("notes.txt", b"world\n", "ab")                # an ordinary file
        c.call_end("c1")
        c.turn_end()
''')


def snapshot(ws: str) -> dict:
    out = {}
    for d, dirs, files in os.walk(ws):
        dirs[:] = [x for x in dirs if x != ".overlayrec-attic"]
        for n in files:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, ws)] = f.read()
    return out


def everything_in(root: str) -> list[tuple[str, bytes]]:
    """Every file below ``root`` as stored, and, for what git keeps deflated (loose objects),
    packs aside, also inflated; plus every object git can read there."""
    out = []
    for d, _, files in os.walk(root):
        for n in files:
            p = os.path.join(d, n)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            with open(p, "rb") as f:
                data = f.read()
            out.append((p, data))
            try:
                out.append((p + " (inflated)", zlib.decompress(data)))
            except zlib.error:
                pass
    for d, dirs, _ in os.walk(root):
        if os.path.exists(os.path.join(d, "HEAD")) and os.path.isdir(os.path.join(d, "objects")):
            r = subprocess.run(["git", "--git-dir", d, "cat-file", "--batch-all-objects",
                                "--batch"], capture_output=True, timeout=60)
            out.append((d + " (git objects)", r.stdout))
    return out


def assert_nowhere(roots: list[str], needles: list[bytes]) -> None:
    for root in roots:
        for where, data in everything_in(root):
            for s in needles:
                assert s not in data, f"secret {s!r} found in {where}"


def run_readers(m, tmp_path, tag: str) -> dict:
    out = {}
    for sel in (["--call", "c1"], ["--turn", "last"], ["--session", "s"]):
        out[sel[0]] = overlayrec("diff", m.ws, *sel, "--state-dir", m.state)
    last = max(e["seq"] for e in m.events())
    for seq in range(1, last + 1):
        overlayrec("show", str(seq), "-w", m.ws, "--state-dir", m.state)
    for p in (".env", "env.bak", "keys/id.pem", ".npmrc", "notes.txt"):
        overlayrec("blame", p, "-w", m.ws, "--state-dir", m.state)
    out["report"] = str(tmp_path / f"report-{tag}.html")
    overlayrec("report", m.ws, "--html", out["report"], "--state-dir", m.state)
    overlayrec("export", "git", m.ws, "--state-dir", m.state)
    out["replay"] = str(tmp_path / f"replay-{tag}")
    out["replayed"] = json.loads(overlayrec("replay", m.ws, "--at", "call:c1", "--full",
                                            "--to", out["replay"], "--json",
                                            "--state-dir", m.state).stdout)
    overlayrec("status", m.ws)
    return out


@pytest.mark.timeout(300)
def test_secret_content_is_never_kept(make_mount, tmp_path):
    m = make_mount()
    vals = secrets(5)
    old = secrets(3)  # what the secrets held before the mount: never kept either
    for rel, data in ((".env", b"A=" + old[0] + b"\n"), (".npmrc", old[1] + b"\n"),
                      (".pypirc", old[2] + b"\n"), ("notes.txt", b"hello\n")):
        with open(os.path.join(m.ws, rel), "wb") as f:
            f.write(data)
    vals_file = tmp_path / "vals"
    vals_file.write_bytes(b"\n".join(vals))
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    m.mount()
    try:
        overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable, str(agent),
                   str(vals_file), cwd=m.ws)
        assert open(os.path.join(m.ws, "keys/id.pem"), "rb").read() == vals[2] + b"\n"
        mounted = run_readers(m, tmp_path, "mounted")

        # the events are there, each secret pre-image withheld, none with content
        evs = m.events(seals=True)
        by_path: dict[str, list[dict]] = {}
        for e in evs:
            for k, pk in (("path", "pre"), ("path2", "pre2")):
                if e.get(k):
                    by_path.setdefault(e[k], []).append((e, e.get(pk)))
        for p in (".env", ".env.local", "keys/id.pem", ".ssh/config", "env.bak", ".npmrc",
                  ".pypirc"):
            assert by_path.get(p), f"no event for {p}"
            for e, pre in by_path[p]:
                if pre and pre.get("kind") == "file":
                    assert pre.get("withheld") is True, (p, e)
                    assert not {"blob", "ranges", "attic", "hash"} & pre.keys(), (p, e)
                assert "data" not in e
        ops = {(e["op"], e.get("path")) for e in evs}
        assert ("unlink", ".npmrc") in ops and ("write", ".env") in ops

        diff = mounted["--call"].stdout
        assert "content not kept (secret path)" in diff
        for p in (".env", "keys/id.pem", ".ssh/config", ".env.local", "env.bak", ".pypirc"):
            assert f"b/{p}" in diff, p
        assert "+world" in diff  # the ordinary file: its real diff
        assert "secret path(s) changed, content not kept" in mounted["--call"].stderr
        for sel in ("--turn", "--session"):
            assert "content not kept (secret path)" in mounted[sel].stdout
        # replay makes nothing at a secret path, and says why
        not_made = {n["path"]: n["why"] for n in mounted["replayed"]["not_made"]}
        for p in (".env", "keys/id.pem", ".ssh/config", "env.bak"):
            assert "content not kept" in not_made.get(p, ""), (p, not_made)
            assert not os.path.lexists(os.path.join(mounted["replay"], p))
        assert open(os.path.join(mounted["replay"], "notes.txt"), "rb").read() == b"hello\nworld\n"

        # revert of the call: refused, `unrecorded`, said why; nothing changed
        before = snapshot(m.ws)
        r = overlayrec("revert", m.ws, "--call", "c1", "--yes", "--state-dir", m.state,
                       check=False)
        assert r.returncode != 0
        assert "unrecorded" in r.stderr and "content not kept" in r.stderr, r.stderr
        assert "CONFLICT (unrecorded: content not kept (secret path))" in r.stdout
        for p in (".env", "keys/id.pem", ".ssh/config"):
            assert p in r.stderr
        assert snapshot(m.ws) == before
        # the ordinary file still reverts
        overlayrec("revert", m.ws, "--call", "c1", "--path", "notes.txt", "--yes",
                   "--state-dir", m.state)
        assert open(os.path.join(m.ws, "notes.txt"), "rb").read() == b"hello\n"
        after = snapshot(m.ws)
        assert {k: v for k, v in after.items() if k != "notes.txt"} == \
            {k: v for k, v in before.items() if k != "notes.txt"}
    finally:
        m.umount()
    unmounted = run_readers(m, tmp_path, "unmounted")
    assert "content not kept (secret path)" in unmounted["--call"].stdout
    assert "+world" in unmounted["--call"].stdout
    # nothing in the attic holds a secret: a secret deleted or renamed over is really gone
    attic = os.path.join(m.ws, ".overlayrec-attic")
    assert_nowhere([m.state] + ([attic] if os.path.isdir(attic) else []), vals + old)
    for html in (mounted["report"], unmounted["report"]):
        page = open(html, "rb").read()
        assert b"content not kept (secret path)" in page
        assert not any(s in page for s in vals + old), html
    for rep in (mounted["replay"], unmounted["replay"]):
        assert_nowhere([rep], vals + old)


@pytest.mark.timeout(240)
def test_secret_options(make_mount, tmp_path):
    """--secret adds a pattern (withheld), --no-default-secrets keeps .env's content."""
    m = make_mount(["--secret", "*.tfstate", "--no-default-secrets"])
    vals = secrets(2)
    with open(os.path.join(m.ws, ".env"), "wb") as f:
        f.write(b"A=1\n")
    m.mount()
    try:
        code = textwrap.dedent(f'''
            from overlayrec import client
            with client.connect() as c:
                c.call_begin("c1", "Write")
                open("infra/prod.tfstate", "wb").write(open({str(tmp_path / "v0")!r}, "rb").read())
                open(".env", "ab").write(b"B=2\\n")
                c.call_end("c1")
        ''')
        (tmp_path / "v0").write_bytes(vals[0])
        os.makedirs(os.path.join(m.ws, "infra"))
        overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable, "-c", code,
                   cwd=m.ws)
        d = overlayrec("diff", m.ws, "--call", "c1", "--state-dir", m.state).stdout
        assert "content not kept (secret path)" in d and "b/infra/prod.tfstate" in d
        assert "+B=2" in d  # .env: an ordinary file now
        j = m.journal()
        try:
            assert json.loads(j.meta("secrets")) == ["*.tfstate"]
        finally:
            j.close()
    finally:
        m.umount()
    evs = m.events(seals=True)
    tf = [e for e in evs if e.get("path") == "infra/prod.tfstate" and e.get("pre", {}).get("kind") == "file"]
    assert tf and all(e["pre"].get("withheld") for e in tf)
    env = [e for e in evs if e.get("path") == ".env" and e.get("pre", {}).get("kind") == "file"]
    assert env and any("blob" in e["pre"] for e in env)
    assert not any(e["pre"].get("withheld") for e in env)
    assert_nowhere([m.state], vals[:1])
    # a mount without the options keeps the workspace's list
    m2 = m
    m2.extra_args = []
    m2.mount()
    try:
        j = m2.journal()
        try:
            assert json.loads(j.meta("secrets")) == ["*.tfstate"]
        finally:
            j.close()
    finally:
        m2.umount()


def pem(label: str, body: bytes) -> bytes:
    return f"-----BEGIN {label}-----\n".encode() + body + f"\n-----END {label}-----\n".encode()


# the agent: c1 deletes a venv's pip (with certifi's CA bundle) and a directory of keys, as
# `rm -rf` does; c2 writes a certificate chain, a file that first holds a certificate and then
# gets a private key appended, and renames a private key to an ordinary name
PEM_AGENT = textwrap.dedent(r'''
    import json, os, shutil, sys
    from overlayrec import client
    content = {k: v.encode() for k, v in json.load(open(sys.argv[1])).items()}
    with client.connect() as c:
        c.turn_begin(prompt="certs")
        c.call_begin("c1", "Bash", summary="rm -rf venv tls")
        shutil.rmtree("venv")
        shutil.rmtree("tls")
        c.call_end("c1")
        c.call_begin("c2", "Bash", summary="make certs")
        os.makedirs("new")
        with open("new/chain.pem", "wb") as f:
            f.write(content["chain"])
        with open("new/later.pem", "wb") as f:
            f.write(content["later"])
        with open("new/later.pem", "ab") as f:
            f.write(content["later_key"])
        os.rename("keys/id.pem", "keys/id.bak")
        c.call_end("c2")
        c.turn_end()
''')


@pytest.mark.timeout(300)
def test_a_pem_file_holding_only_public_blocks_is_kept(make_mount, tmp_path):
    """`*.pem` is content-checked: certifi's CA bundle (in every venv's pip) is kept like any
    file, so the `rm -rf` of a venv diffs, replays and reverts; a private key, a certificate
    with its key, a `.pem` that is no PEM, a key renamed to an ordinary name stay withheld,
    state by state (a certificate that later gets a key appended is withheld from then on)."""
    m = make_mount()
    keys = secrets(4)
    certs = [uuid.uuid4().hex.encode() * 2 for _ in range(4)]
    bundle = (b"##\n## Bundle of CA Root Certificates\n##\n\n# Issuer: CN=One\n" +
              pem("CERTIFICATE", certs[0]) + b"\n# Issuer: CN=Two\n" + pem("CERTIFICATE", certs[1]))
    certifi = "venv/lib/python3/site-packages/pip/_vendor/certifi"
    before = {f"{certifi}/cacert.pem": bundle,
              f"{certifi}/core.py": b"def where():\n    return 'cacert.pem'\n",
              "tls/server.pem": pem("CERTIFICATE", certs[2]) + pem("PRIVATE KEY", keys[0]),
              "tls/key.pem": pem("RSA PRIVATE KEY", keys[1]),
              "tls/notpem.pem": keys[2] + b"\n",
              "keys/id.pem": pem("OPENSSH PRIVATE KEY", keys[3])}
    for rel, data in before.items():
        os.makedirs(os.path.dirname(os.path.join(m.ws, rel)), exist_ok=True)
        with open(os.path.join(m.ws, rel), "wb") as f:
            f.write(data)
    content = tmp_path / "content.json"
    content.write_text(json.dumps({"chain": pem("CERTIFICATE", certs[3]).decode(),
                                   "later": pem("CERTIFICATE", certs[0]).decode(),
                                   "later_key": pem("EC PRIVATE KEY", keys[0]).decode()}))
    agent = tmp_path / "agent.py"
    agent.write_text(PEM_AGENT)
    m.mount()
    try:
        overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable, str(agent),
                   str(content), cwd=m.ws)
        j = m.journal()
        try:
            assert json.loads(j.meta("secrets_checked")) == ["*.pem"]
            assert "*.pem" not in json.loads(j.meta("secrets"))
        finally:
            j.close()

        # the bundle's deletion is a real diff; the keys' a placeholder, named on stderr
        d1 = overlayrec("diff", m.ws, "--call", "c1", "--state-dir", m.state)
        assert f"-{certs[0].decode()}" in d1.stdout and f"-{certs[1].decode()}" in d1.stdout
        assert "content not kept (secret path)" in d1.stdout
        for p in ("tls/server.pem", "tls/key.pem", "tls/notpem.pem"):
            assert p in d1.stderr, d1.stderr
        assert f"{certifi}/cacert.pem" not in d1.stderr
        # c2: the chain is shown; the file that got a key is a placeholder, the key renamed
        # to an ordinary name too
        d2 = overlayrec("diff", m.ws, "--call", "c2", "--state-dir", m.state)
        assert f"+{certs[3].decode()}" in d2.stdout
        for p in ("new/later.pem", "keys/id.bak"):
            assert p in d2.stderr, d2.stderr
        assert "new/chain.pem" not in d2.stderr

        # the events: each key's pre-image withheld, the bundle's kept
        evs = m.events(seals=True)
        for e in evs:
            for k, pk in (("path", "pre"), ("path2", "pre2")):
                pre = e.get(pk) or {}
                if e.get(k) in ("tls/server.pem", "tls/key.pem", "tls/notpem.pem",
                                "keys/id.pem", "keys/id.bak") and \
                        (pre.get("kind") == "file" or pre.get("facet") == "content"):
                    assert pre.get("withheld") is True, e
                    assert not {"blob", "ranges", "attic", "hash"} & pre.keys(), e
        gone = [e for e in evs if e["op"] == "unlink" and e["path"] == f"{certifi}/cacert.pem"]
        assert gone and not gone[0]["pre"].get("withheld") and \
            {"blob", "attic"} & gone[0]["pre"].keys(), gone
        # the file that got a key: sealed at the call's end without a hash; the chain with one
        sealed = {e["path"]: e["pre"] for e in evs if e["op"] == "seal"}
        assert sealed["new/later.pem"].get("withheld") and "hash" not in sealed["new/later.pem"]
        assert "hash" in sealed["new/chain.pem"] and not sealed["new/chain.pem"].get("withheld")

        # replay before c1: the bundle as it was; no key made
        rep = tmp_path / "replay"
        got = json.loads(overlayrec("replay", m.ws, "--at", "before:call:c1", "--full",
                                    "--to", str(rep), "--json", "--state-dir", m.state).stdout)
        assert (rep / certifi / "cacert.pem").read_bytes() == bundle
        not_made = {n["path"] for n in got["not_made"]}
        assert {"tls/server.pem", "tls/key.pem", "tls/notpem.pem", "keys/id.pem"} <= not_made

        # the other readers, then: not one byte of a key anywhere
        overlayrec("export", "git", m.ws, "--state-dir", m.state)
        overlayrec("report", m.ws, "--html", str(tmp_path / "report.html"), "--state-dir", m.state)
        for p in ("new/later.pem", "keys/id.bak", f"{certifi}/cacert.pem"):
            overlayrec("blame", p, "-w", m.ws, "--state-dir", m.state)
        for seq in range(1, max(e["seq"] for e in evs) + 1):
            overlayrec("show", str(seq), "-w", m.ws, "--state-dir", m.state)

        # revert of c1: the keys are conflicts (their content was never kept); forced, the
        # venv comes back whole, the bundle byte for byte
        r = overlayrec("revert", m.ws, "--call", "c1", "--yes", "--state-dir", m.state,
                       check=False)
        assert r.returncode != 0 and "unrecorded" in r.stderr and "tls/key.pem" in r.stderr
        assert f"{certifi}/cacert.pem" not in r.stderr
        overlayrec("revert", m.ws, "--call", "c1", "--yes", "--force", "--state-dir", m.state)
        for rel in (f"{certifi}/cacert.pem", f"{certifi}/core.py"):
            assert open(os.path.join(m.ws, rel), "rb").read() == before[rel], rel
        assert not os.path.exists(os.path.join(m.ws, "tls/key.pem"))
    finally:
        m.umount()
    attic = os.path.join(m.ws, ".overlayrec-attic")
    assert_nowhere([m.state, str(tmp_path / "replay"), str(tmp_path / "report.html")] +
                   ([attic] if os.path.isdir(attic) else []), keys)


@pytest.mark.timeout(300)
def test_content_checked_pem_files_in_every_shape(make_mount, tmp_path):
    """The shapes a first test leaves out: a directory of `.pem` files renamed with the files
    beneath, a hard link to a CA bundle, a fifo named `.pem`, and a key written into a linked
    bundle while unmounted.  The bundle moves and replays byte for byte; the fifo is no
    secret; a bundle hard-linked to another name is withheld under both (a key written through
    either name would be the other's too); the key the drift brought is kept by nothing."""
    m = make_mount()
    keys = secrets(2)
    bundle = pem("CERTIFICATE", uuid.uuid4().hex.encode() * 2)
    os.makedirs(os.path.join(m.ws, "certs"))
    for rel, data in (("certs/cacert.pem", bundle), ("certs/linked.pem", bundle),
                      ("certs/key.pem", pem("PRIVATE KEY", keys[0]))):
        with open(os.path.join(m.ws, rel), "wb") as f:
            f.write(data)
    m.mount()
    try:
        code = textwrap.dedent('''
            import os
            from overlayrec import client
            with client.connect() as c:
                c.call_begin("c1", "Bash")
                os.rename("certs", "tls")
                os.link("tls/linked.pem", "bundle.crt")
                os.mkfifo("pipe.pem")
                c.call_end("c1")
        ''')
        overlayrec("run", "-w", m.ws, "--session", "s", "--", sys.executable, "-c", code,
                   cwd=m.ws)
        d = json.loads(overlayrec("diff", m.ws, "--call", "c1", "--json").stdout)
        assert "tls/cacert.pem" not in d["withheld"], d
        assert {"tls/key.pem", "tls/linked.pem", "bundle.crt"} <= set(d["withheld"]), d
        rep = tmp_path / "after"
        got = json.loads(overlayrec("replay", m.ws, "--at", "after:call:c1", "--full", "--to",
                                    str(rep), "--json").stdout)
        assert (rep / "tls/cacert.pem").read_bytes() == bundle
        assert stat.S_ISFIFO(os.lstat(rep / "pipe.pem").st_mode)
        assert "tls/key.pem" in {n["path"] for n in got["not_made"]}
    finally:
        m.umount()
    # while unmounted, a key is written into the linked bundle (under both its names)
    with open(os.path.join(m.ws, "tls/linked.pem"), "ab") as f:
        f.write(pem("RSA PRIVATE KEY", keys[1]))
    m.mount()
    try:
        drift = [e for e in m.events() if e["op"] == "drift" and e["path"] == "bundle.crt"]
        assert drift and drift[-1]["pre"].get("withheld") and "hash" not in drift[-1]["pre"]
        overlayrec("export", "git", m.ws)
        got = json.loads(overlayrec("replay", m.ws, "--at", "999999", "--full", "--to",
                                    str(tmp_path / "again"), "--json").stdout)
        assert {"tls/linked.pem", "bundle.crt"} <= {n["path"] for n in got["not_made"]}
        assert (tmp_path / "again/tls/cacert.pem").read_bytes() == bundle
        overlayrec("blame", "bundle.crt", "-w", m.ws)
        # the call's revert, forced past what it cannot put back (the key's content, the
        # linked bundle the drift changed), puts the public bundle back where it was
        overlayrec("revert", m.ws, "--call", "c1", "--yes", "--force")
        assert open(os.path.join(m.ws, "certs/cacert.pem"), "rb").read() == bundle
        assert not os.path.exists(os.path.join(m.ws, "tls/cacert.pem"))
    finally:
        m.umount()
    assert_nowhere([m.state, str(tmp_path / "after"), str(tmp_path / "again")], keys)


def test_anchored_patterns_follow_a_directory_renamed_above_them():
    """`--secret config/prod.yml`, then `mv config cfg`: the pattern named nothing beneath
    `cfg`, so its content was kept from the rename on (found by a bug hunt).  The name moves
    with the directory, or the whole directory where the rest is a pattern itself."""
    from overlayrec.secrets import Secrets
    s = Secrets(["config/prod.yml", "deploy/*/token", "conf*/other.yml"], checked=())
    assert s.carried("config", "cfg") and s.match("cfg/prod.yml") and s.match("cfg/other.yml")
    assert not s.match("cfg/public.yml")
    assert s.carried("deploy", "d2") and s.match("d2/any/thing")  # the rest has a wildcard
    assert not s.carried("elsewhere", "e2") and not s.match("e2/prod.yml")
    assert not s.carried("config/prod.yml.d", "x")  # no pattern beneath it
    # moved back beneath its pattern: the pattern covers what it did, the rest is no secret's
    # (`mv conf cfg; mv cfg conf` withheld all of conf for good: found by a bug hunt)
    back = Secrets(["conf/*.yml"], checked=())
    assert back.carried("conf", "cfg") and back.match("cfg/readme.txt")
    back.carried("cfg", "conf")
    assert back.match("conf/a.yml") and not back.match("conf/readme.txt")


def test_a_carried_name_is_secret_from_its_change_on():
    """A name a change carried counts from that change's seq (meta ``secret_names`` keeps
    it), and a list from an older journal from the record's start."""
    from overlayrec.secrets import Secrets
    s = Secrets([".env"], checked=())
    assert s.carried(".env", "env.bak", since=7)
    assert s.match("env.bak") and s.match_at("env.bak", 7) and not s.match_at("env.bak", 6)
    assert json.loads(s.names_json()) == {"env.bak": 7}
    again = Secrets([".env"], names=json.loads(s.names_json()), checked=())
    assert not again.match_at("env.bak/x", 6) and again.match_at("env.bak/x", 8)
    old = Secrets([".env"], names=["env.bak"], checked=())
    assert old.match_at("env.bak", 0) and json.loads(old.names_json()) == ["env.bak"]
    assert not s.uncarried(8) and s.match("env.bak")  # another change's names stay
    assert s.uncarried(7) and not s.match("env.bak")


def test_a_later_mounts_secret_adds_to_an_earlier_ones():
    """A later mount's `--secret other.txt` replaced the earlier mount's `--secret creds.txt`
    without a word: creds.txt's content was kept from then on (found by a bug hunt)."""
    from overlayrec.secrets import DEFAULTS, effective
    first, checked = effective(["creds.txt"], stored=None)
    assert "creds.txt" in first and ".env*" in first and checked == ["*.pem"]
    later, _ = effective(["other.txt"], stored=first, stored_checked=checked)
    assert later == list(DEFAULTS) + ["creds.txt", "other.txt"]
    assert effective([], stored=later, stored_checked=checked) == (later, checked)
    bare, bare_checked = effective([], no_defaults=True, stored=later)
    assert bare == ["creds.txt", "other.txt"] and bare_checked == []
    # a record whose list was made with the defaults of its day gets the defaults added
    # since (`id_rsa`, `.aws/`: a record from before them kept a private key in full; found
    # by a bug hunt); one made without the defaults keeps its own list
    from overlayrec.secrets import FIRST_DEFAULTS
    older = list(FIRST_DEFAULTS) + ["mine.txt"]
    got, _ = effective([], stored=older, stored_checked=["*.pem"])
    assert got[:len(older)] == older and {"id_rsa", ".aws/"} <= set(got)
    assert effective([], stored=["mine.txt"], stored_checked=[]) == (["mine.txt"], [])


@pytest.mark.timeout(240)
def test_a_secret_beneath_a_renamed_directory_and_a_later_exports_cached_blob(make_mount,
                                                                               tmp_path):
    """Two leaks a bug hunt found, each through a real mount: `--secret config/prod.yml` and
    a call that renames `config` and writes the file there (its pre-images kept the content:
    diff, show, export and the journal held it); an incremental export after a later mount
    made `untouched.yml` secret, which reused the blob the first export had kept for it."""
    vals = secrets(3)
    m = make_mount(["--secret", "config/prod.yml"])
    os.makedirs(os.path.join(m.ws, "config"))
    with open(os.path.join(m.ws, "config", "prod.yml"), "wb") as f:
        f.write(vals[0] + b"\n")
    with open(os.path.join(m.ws, "untouched.yml"), "wb") as f:
        f.write(vals[2] + b"\n")
    with open(os.path.join(m.ws, "a.txt"), "w") as f:
        f.write("a\n")
    old = 10**9 * (int(os.stat(m.ws).st_mtime) - 3600)
    os.utime(os.path.join(m.ws, "untouched.yml"), ns=(old, old))
    (tmp_path / "v1").write_bytes(vals[1] + b"\n")
    code = textwrap.dedent(f'''
        import os
        from overlayrec import client
        with client.connect() as c:
            c.call_begin("c1", "Bash")
            os.rename("config", "cfg")
            open("cfg/prod.yml", "ab").write(open({str(tmp_path / "v1")!r}, "rb").read())
            open("a.txt", "a").write("b\\n")
            c.call_end("c1")
            c.call_begin("c2", "Bash")
            os.unlink("cfg/prod.yml")
            c.call_end("c2")
    ''')
    m.mount()
    try:
        overlayrec("run", "-w", m.ws, "--session", "s1", "--", sys.executable, "-c", code,
                   cwd=m.ws)
        d = overlayrec("diff", m.ws, "--call", "c1", "--state-dir", m.state).stdout
        assert "b/cfg/prod.yml" in d and "content not kept (secret path)" in d, d
        time.sleep(3.5)  # the untouched file's times well before the export's walk
        overlayrec("export", "git", m.ws, "--state-dir", m.state)
    finally:
        m.umount()
    m.extra_args = ["--secret", "untouched.yml"]
    m.mount()
    try:
        overlayrec("run", "-w", m.ws, "--session", "s2", "--", "sh", "-c",
                   "echo c >> a.txt", cwd=m.ws)
        j = m.journal()
        try:  # the earlier mount's pattern stays beside the later one's
            assert {"config/prod.yml", "untouched.yml"} <= set(json.loads(j.meta("secrets")))
        finally:
            j.close()
        overlayrec("export", "git", m.ws, "--state-dir", m.state)
        run_readers_on(m, ["--session", "s1"], ["--session", "s2"])
    finally:
        m.umount()
    assert_nowhere([m.state, os.path.join(m.ws, ".overlayrec-attic")], vals[:2])
    gd = json.loads(overlayrec("export", "git", m.ws, "--state-dir", m.state,
                               "--json").stdout)["git_dir"]
    head = subprocess.run(["git", "--git-dir", gd, "show", "refs/overlayrec/s2/head:"
                           "untouched.yml"], capture_output=True, timeout=60).stdout
    assert vals[2] not in head and b"content not kept (secret path)" in head, head


def run_readers_on(m, *selections) -> None:
    for sel in selections:
        overlayrec("diff", m.ws, *sel, "--state-dir", m.state)
    last = max(e["seq"] for e in m.events())
    for seq in range(1, last + 1):
        overlayrec("show", str(seq), "-w", m.ws, "--state-dir", m.state)


@needs_fuse
def test_a_secret_renamed_over_a_file_the_underlay_refuses_leaves_the_file_plain(
        make_mount, tmp_path):
    """`mv .env f2` refused by the underlay (f2 immutable): the secret's name was carried to
    f2 before the rename and never taken back, so f2's content was withheld for the rest of
    the record (found by a bug hunt).  The name goes back with the refusal."""
    if subprocess.run(["which", "chattr"], capture_output=True).returncode != 0:
        pytest.skip("needs chattr")
    m = make_mount()
    with open(os.path.join(m.ws, ".env"), "w") as f:
        f.write("TOKEN=secret\n")
    with open(os.path.join(m.ws, "f2"), "w") as f:
        f.write("two\n")
    f2 = os.path.join(m.ws, "f2")
    if subprocess.run(["chattr", "+i", f2], capture_output=True).returncode != 0:
        pytest.skip("the filesystem takes no immutable flag")
    try:
        m.mount()
        r = m.sh("mv .env f2", check=False)
        assert r.returncode != 0
        m.umount()
        subprocess.run(["chattr", "-i", f2], check=True)  # (the underlay's: unmounted)
        m.mount()
        m.sh("echo later >> f2")
    finally:
        m.umount()
        subprocess.run(["chattr", "-i", f2], capture_output=True)
    diff = overlayrec("diff", m.ws, "--state-dir", m.state, "--since", "0", "--path", "f2")
    assert "+later" in diff.stdout and "secret" not in diff.stderr, (diff.stdout, diff.stderr)


FORMATTER = r'''
set -e
or call begin --id fmt --tool Bash --summary fmt
tr a-z A-Z < envelope.py > .envelope.py.tmp
mv .envelope.py.tmp envelope.py
or call end --id fmt
'''


@needs_fuse
def test_a_name_a_secret_temp_file_was_renamed_over_is_secret_from_then_on_only(
        make_mount, tmp_path):
    """A formatter's temp file `.envelope.py.tmp` (a `.env*` name: its content withheld)
    renamed over envelope.py: the name was secret for the whole record, so the file's kept
    history was hidden from every reader (diff, replay before the formatter) and a revert of
    the formatter was refused, unrecorded (found by a bug hunt).  It is secret from that
    rename on; before it, the file reads as kept, and the revert puts it back."""
    m = make_mount()
    old = "".join(f"line {i}\n" for i in range(20))
    with open(os.path.join(m.ws, "envelope.py"), "w") as f:
        f.write(old)
    m.mount()
    try:
        run_script(m, tmp_path, FORMATTER)
        out = str(tmp_path / "r")
        overlayrec("replay", "-w", m.ws, "--at", "before:call:fmt", "--to", out, "--full")
        with open(os.path.join(out, "envelope.py")) as f:
            assert f.read() == old
        diff = overlayrec("diff", m.ws, "--call", "fmt").stdout
        assert "-line 3\n" in diff and "LINE 3" not in diff, diff  # after: withheld
        # what the formatter left is a secret's (never kept): its revert cannot tell whether
        # the file still holds it, and refuses in one line, as for any secret path it left
        r = overlayrec("revert", m.ws, "--call", "fmt", "--yes", check=False)
        assert r.returncode == 1 and "secret path" in r.stderr, r.stderr
        subprocess.run(["git", "init", "-q", str(tmp_path / "repo")], check=True)
        export = overlayrec("export", "git", m.ws, "--repo", str(tmp_path / "repo"),
                            check=False)
        assert export.returncode == 0, export.stderr
        # the formatter's commit's parent: the tree before it
        shown = subprocess.run(["git", "-C", str(tmp_path / "repo"), "show",
                                "refs/overlayrec/s/calls/fmt^:envelope.py"],
                               capture_output=True, text=True)
        assert shown.stdout == old, shown
    finally:
        m.umount()


RENAMED_TO_SECRET = r'''
or call begin --id c1 --tool Bash --summary a; echo "notes v1" > notes.txt; or call end --id c1
or call begin --id c2 --tool Bash --summary b; mv notes.txt .env.bak; or call end --id c2
'''


@needs_fuse
def test_a_file_renamed_to_a_secret_name_is_never_replayed_as_the_placeholder(make_mount,
                                                                             tmp_path):
    """`mv notes.txt .env.bak`: notes.txt's content before the rename is the inode's, which
    the secret name holds after it; replay before the rename wrote the placeholder text
    into notes.txt as its content, and listed nothing as not made (found by a bug hunt).
    The placeholder stays a secret's: not made, said."""
    m = make_mount()
    m.mount()
    try:
        run_script(m, tmp_path, RENAMED_TO_SECRET)
    finally:
        m.umount()
    out = tmp_path / "r"
    got = json.loads(overlayrec("replay", "-w", m.ws, "--state-dir", m.state, "--at",
                                "before:call:c2", "--to", str(out), "--full", "--json").stdout)
    if (out / "notes.txt").exists():
        assert (out / "notes.txt").read_text() == "notes v1\n"
    else:
        assert "notes.txt" in {n["path"] for n in got["not_made"]}, got
