"""engines.gitdiff against git itself: the trees a diff writes through one fast-import stream
(their names computed in Python) are the trees git's own index makes of the same paths, and
what the diff decides without asking git is what git answers."""
from __future__ import annotations

import os
import random
import subprocess

import pytest

from overlayrec.engines.gitdiff import EMPTY_TREE, ObjectStore, _git_may_refuse
from overlayrec.engines.states import State

pytestmark = pytest.mark.timeout(120)

NAMES = ["a", "a.b", "a-b", "a b", "a0", "b", "\u00e4", '"q', "new\nline", "back\\slash",
         "tab\tname", "x" * 200, os.fsdecode(b"\xff\xfe"), ".gitignore", ".github", "git~10",
         "A", "z"]


def _random_side(r: random.Random, n: int) -> dict[str, State]:
    side: dict[str, State] = {}
    for _ in range(n):
        depth = r.randrange(1, 4)
        path = "/".join(r.choice(NAMES) for _ in range(depth))
        if any(q.startswith(path + "/") or path.startswith(q + "/") for q in side):
            continue  # one point of a tree: a name is a file or a directory, not both
        k = r.random()
        if k < 0.15:
            side[path] = State("symlink", 0o120000, r.choice([b"a", b"../x", b"t" * 50]))
        elif k < 0.25:
            side[path] = State("absent")
        else:
            side[path] = State("file", r.choice([0o644, 0o755, 0o600]),
                               r.choice([b"", b"x\n", b"\0bin", bytes(r.randrange(256)
                                                                        for _ in range(40))]))
    return side


def _by_gits_index(store: ObjectStore, side: dict[str, State], tmp) -> tuple[str, list[str]]:
    """The tree git's own update-index and write-tree make of a side, and what git said."""
    lines, said = [], []
    for p, s in sorted(side.items()):
        if s.kind not in ("file", "symlink"):
            continue
        sha = subprocess.run(["git", "hash-object", "-w", "--stdin"], input=s.data, env=store.env,
                             capture_output=True, check=True).stdout.decode().strip()
        mode = "120000" if s.kind == "symlink" else "100755" if s.mode & 0o111 else "100644"
        lines.append(f"{mode} {sha}\t{p}")
    env = dict(store.env, GIT_INDEX_FILE=str(tmp / "oracle-index"))
    if os.path.exists(env["GIT_INDEX_FILE"]):
        os.unlink(env["GIT_INDEX_FILE"])
    r = subprocess.run(["git", "update-index", "-z", "--index-info"], env=env,
                       input="".join(l + "\0" for l in lines).encode("utf-8", "surrogateescape"),
                       capture_output=True, check=True)
    said += r.stderr.decode(errors="replace").splitlines()
    tree = subprocess.run(["git", "write-tree"], env=env, capture_output=True,
                          check=True).stdout.decode().strip()
    return tree, said


def test_trees_are_the_trees_gits_index_makes(tmp_path):
    store = ObjectStore(str(tmp_path))
    r = random.Random(16)
    sides = [_random_side(r, r.randrange(0, 25)) for _ in range(40)]
    sides.append({"only/absent": State("absent"), "": State("dir", 0o755)})
    names = store.trees(*sides)
    assert names[-1] == EMPTY_TREE
    for side, name in zip(sides, names):
        want, _ = _by_gits_index(store, side, tmp_path)
        assert name == want, sorted(side)
        # the object is in the store, whole (git reads it back)
        subprocess.run(["git", "ls-tree", "-r", name], env=store.env, check=True,
                       capture_output=True)
    # the refs the stream wrote its trees' commits on are gone again
    refs = subprocess.run(["git", "for-each-ref"], env=store.env, capture_output=True,
                          check=True).stdout
    assert refs == b""


@pytest.mark.parametrize("known", [True, False])
def test_a_name_that_would_turn_a_terminal_around_is_quoted(tmp_path, known):
    """A diff naming a path with a bidi mark (or an invisible one, or bytes not UTF-8) is
    written with core.quotepath on: every name not ASCII octal-quoted, as git does by default
    and as the listings quote it, so no name shows other than it is.  A diff without one names
    its paths as they are (UTF-8 readable).  ``known``: the trees made by this store (their
    names known without git) or by another (git asked)."""
    store = ObjectStore(str(tmp_path))
    plain = {"caf\u00e9.txt": State("file", 0o644, b"a\n")}
    odd = {"evil\u202etxt.exe": State("file", 0o644, b"b\n"), **plain}
    empty, a, b = store.trees({}, plain, odd)
    if not known:
        store = ObjectStore(str(tmp_path))
    assert store.diff(empty, a, "name-status") == "A\tcaf\u00e9.txt\n"
    for fmt, want in (("name-status", 'A\t"caf\\303\\251.txt"\nA\t"evil\\342\\200\\256txt.exe"\n'),
                      ("stat", '"evil\\342\\200\\256txt.exe"')):
        out = store.diff(empty, b, fmt)
        assert "\u202e" not in out and want in out, (fmt, out)
    assert "\u202e" in store.diff(empty, b, "name-status-z")  # -z: as they are, for --json
    assert "\u202e" not in store.diff(a, b, "patch")  # the name in the patch's headers too
    assert "\u202e" in store.diff(a, b, "patch", as_they_are=True)  # the report escapes it
    # a name git quotes itself (a tab) leaves the others as they are
    tab, = store.trees({"a\tb": State("file", 0o644, b"t\n"), **plain})
    assert store.diff(empty, tab, "name-status") == 'A\t"a\\tb"\nA\tcaf\u00e9.txt\n'


def test_rename_decision_without_git_is_gits(tmp_path):
    """A diff may name renames unless a symlink and a directory trade places: decided from the
    trees' entries when both were made here, by `git diff-tree` otherwise; the same answer."""
    store = ObjectStore(str(tmp_path))
    r = random.Random(7)
    cases = [({"l": State("symlink", 0o120000, b"d")},
              {"l/f": State("file", 0o644, b"moved\n")}),
             ({"d/f": State("file", 0o644, b"x\n")}, {"d": State("symlink", 0o120000, b"e")})]
    cases += [(_random_side(r, 15), _random_side(r, 15)) for _ in range(30)]
    answers = set()
    for before, after in cases:
        a, b = store.trees(before, after)
        mine = store._renames_apply(a, b, None)
        gits = ObjectStore(str(tmp_path))._renames_apply(a, b, None)  # knows no entries: asks git
        assert mine == gits, (sorted(before), sorted(after))
        answers.add(mine)
    assert answers == {True, False}


@pytest.mark.parametrize("name,symlink", [
    ("git~1", False), ("GIT~1/x", False), (".git. ", False), (".Git::$INDEX_ALLOCATION", False),
    ("x/.git .", False), (".gitmodules", True), ("sub/GITMOD~1", True), (".gitignore", False),
    (".github", False), ("git~10", False), ("a.git", False), (".gitmodules", False)])
def test_names_git_may_refuse_go_through_git(tmp_path, name, symlink):
    """A name git's own path check refuses (or might) is caught before fast-import, which would
    take it; those trees come from git's index, what git says about them kept."""
    store = ObjectStore(str(tmp_path))
    s = State("symlink", 0o120000, b"t") if symlink else State("file", 0o644, b"x\n")
    side = {name: s, "ok.txt": State("file", 0o644, b"ok\n")}
    want, said = _by_gits_index(store, side, tmp_path)
    refused = bool(said)
    assert not refused or _git_may_refuse(name, symlink), said
    assert store.tree(side) == want
    if refused:
        assert any(name.split("/")[0] in w or name in w for w in store.warnings), store.warnings


def test_trees_of_long_paths_and_other_kinds_are_gits(tmp_path):
    """Shapes past the random ones: a path of about 4,000 bytes, a directory on one side that
    is a file on the other, and kinds a tree does not hold (fifo, socket, device, directory:
    left out, as git's index leaves them)."""
    store = ObjectStore(str(tmp_path))
    f = State("file", 0o644, b"x\n")
    deep = "/".join(["d" * 245] * 16) + "/leaf.txt"
    assert 3900 < len(deep.encode()) < 4096
    before = {deep: f, "a/b/c": f, "p": State("fifo", 0o644), "s": State("socket", 0o755),
              "dev": State("device", 0o600, rdev=259), "dir": State("dir", 0o755),
              "l": State("symlink", 0o120000, b"a/b")}
    after = {deep: State("file", 0o755, b"y\n"), "a": State("file", 0o644, b"now a file\n"),
             "p": f, "dir": State("symlink", 0o120000, b"/elsewhere")}
    for side, name in zip((before, after), store.trees(before, after)):
        want, _ = _by_gits_index(store, side, tmp_path)
        assert name == want, sorted(side)
    a, b = store.trees(before, after)
    assert store._renames_apply(a, b, None) == ObjectStore(str(tmp_path))._renames_apply(a, b,
                                                                                          None)
    listed = store.diff(a, b, "name-status")
    # p's content moved from a/b/c (git names the rename); the symlink l is gone, dir is one
    assert sorted(listed.splitlines()) == sorted(
        ["A\ta", f"M\t{deep}", "A\tdir", "D\tl", "R100\ta/b/c\tp"])


def _pack_everything(store: ObjectStore) -> None:
    """Every object of the store into one pack, the loose ones removed (git repack packs only
    what a ref reaches, and nothing here does)."""
    names = subprocess.run(["git", "cat-file", "--batch-all-objects",
                            "--batch-check=%(objectname)"], env=store.env, capture_output=True,
                           check=True).stdout
    subprocess.run(["git", "pack-objects", "-q",
                    os.path.join(store.git_dir, "objects", "pack", "pack")], input=names,
                   env=store.env, capture_output=True, check=True)
    subprocess.run(["git", "prune-packed"], env=store.env, check=True)


def _fast_imports(monkeypatch) -> list:
    """The fast-import streams started from now on (one entry each)."""
    from overlayrec.engines import gitdiff
    started = []
    real = gitdiff.FastImport.__init__

    def counting(self, *a, **kw):
        started.append(1)
        real(self, *a, **kw)
    monkeypatch.setattr(gitdiff.FastImport, "__init__", counting)
    return started


def test_trees_the_store_holds_are_not_written_again(tmp_path, monkeypatch):
    """The same sides asked again (a turn's --stat, then its patch): the trees' names are
    computed, found in the store (loose, or in a pack through its index) and not written
    again; the diff is the same."""
    r = random.Random(5)
    before, after = _random_side(r, 20), _random_side(r, 20)
    first = ObjectStore(str(tmp_path))
    a, b = first.trees(before, after)
    want = first.diff(a, b, "patch")
    started = _fast_imports(monkeypatch)
    again = ObjectStore(str(tmp_path))
    assert again.trees(before, after) == [a, b] and started == []
    assert again.diff(a, b, "patch") == want and started == []
    # packed: every object in one pack, none loose
    _pack_everything(first)
    objects = os.path.join(first.git_dir, "objects")
    assert not any(len(d) == 2 for d in os.listdir(objects))
    packed = ObjectStore(str(tmp_path))
    assert packed.trees(before, after) == [a, b] and started == []
    assert packed.diff(a, b, "patch") == want
    # a side never written is written
    other = {"new.txt": State("file", 0o644, b"new\n")}
    assert ObjectStore(str(tmp_path)).trees(other)[0] != EMPTY_TREE and started == [1]


def test_a_tree_held_without_what_it_names_is_written_again(tmp_path, monkeypatch):
    """A tree the store holds whose blob git cannot find (an alternate's, gone since): the diff
    fails once, the sides are written through fast-import after all, and the diff is made."""
    before = {"f.txt": State("file", 0o644, b"before\n")}
    after = {"f.txt": State("file", 0o644, b"after\n")}
    first = ObjectStore(str(tmp_path))
    a, b = first.trees(before, after)
    want = first.diff(a, b, "stat")
    from overlayrec.engines.gitdiff import blob_id
    gone = blob_id(b"after\n")
    os.unlink(os.path.join(first.git_dir, "objects", gone[:2], gone[2:]))
    started = _fast_imports(monkeypatch)
    again = ObjectStore(str(tmp_path))
    assert again.trees(before, after) == [a, b] and started == []
    assert again.diff(a, b, "stat") == want and started == [1]
    assert os.path.exists(os.path.join(first.git_dir, "objects", gone[:2], gone[2:]))


def test_pack_index_lookup_is_gits(tmp_path):
    """_pack_index_holds against git's own index of a pack: every object it lists is found,
    names beside them are not, and a file that is no index of version 2 holds nothing."""
    from overlayrec.engines.gitdiff import _pack_index_holds
    store = ObjectStore(str(tmp_path))
    r = random.Random(3)
    store.trees(*[_random_side(r, 25) for _ in range(10)])
    _pack_everything(store)
    pack_dir = os.path.join(store.git_dir, "objects", "pack")
    idx = next(os.path.join(pack_dir, n) for n in os.listdir(pack_dir) if n.endswith(".idx"))
    listed = subprocess.run(["git", "show-index"], stdin=open(idx, "rb"), capture_output=True,
                            check=True).stdout.decode().split()[1::3]
    assert len(listed) > 50
    for name in listed:
        raw = bytes.fromhex(name)
        assert _pack_index_holds(idx, raw)
        near = (int.from_bytes(raw, "big") ^ 1).to_bytes(20, "big")
        assert _pack_index_holds(idx, near) == (near.hex() in listed)
    assert not _pack_index_holds(idx, b"\0" * 20) or "00" * 20 in listed
    assert not _pack_index_holds(idx, b"\xff" * 20) or "ff" * 20 in listed
    junk = tmp_path / "junk.idx"
    junk.write_bytes(b"not an index")
    assert not _pack_index_holds(str(junk), bytes.fromhex(listed[0]))
    (tmp_path / "empty.idx").write_bytes(b"")
    assert not _pack_index_holds(str(tmp_path / "empty.idx"), bytes.fromhex(listed[0]))


def test_blob_names_are_gits_on_either_sha1(monkeypatch):
    """A reader hashes with CPython's own SHA-1 first (hashlib's OpenSSL is slow to load) and
    with OpenSSL's once a quarter MiB was hashed: the names are git's on both sides."""
    from overlayrec.engines import gitdiff
    monkeypatch.setattr(gitdiff, "_hashed", 0)
    monkeypatch.setattr(gitdiff, "_sha1", None)
    used = []
    for data in (b"", b"one\n", os.urandom(100_000), os.urandom(300_000), b"two\n"):
        want = subprocess.run(["git", "hash-object", "--stdin", "--no-filters"], input=data,
                              capture_output=True, check=True).stdout.decode().strip()
        assert gitdiff.blob_id(data) == want, len(data)
        used.append(gitdiff._sha1.__module__)
    assert used[0] == "_sha1" and used[-1] == "_hashlib", used  # both were used
