"""Diffs in git's own format, made by git itself.

The two sides of a diff (the recorded paths as they stood before and after a selection) are
written as blobs and trees into a private object store in the state dir, both sides through
one `git fast-import` stream (the trees' names computed here, checked against git's own index
by tests/test_gitdiff.py), and `git diff-tree` compares the trees: renames, binary files,
modes and symlinks come out exactly as git shows them, and `git apply` takes the patch.  The
user's repository is never touched.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading

from .. import views
from ..views import git_refuses
from .large import LIMIT, Large, over_limit
from .states import State

EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"


def left_out_note(n: int, what: str = "shown") -> str:
    """The line that says what a diff (or, ``what="exported"``, an export) could not hold."""
    return (f"overlayrec: {n} change(s) under .git/ or to a name git takes for .git not {what} "
            "(git cannot hold them); "
            "`overlayrec replay` restores them")


def quote_path(p: str) -> bytes:
    """A path as fast-import reads it: as is, or C-quoted when it starts with a double quote or
    holds a newline (or a backslash, which quoting would otherwise misread)."""
    b = p.encode("utf-8", "surrogateescape")
    if not (b.startswith(b'"') or b"\n" in b):
        return b
    out = bytearray(b'"')
    for ch in b:
        if ch in (0x22, 0x5c):
            out += b"\\" + bytes([ch])
        elif ch == 0x0a:
            out += b"\\n"
        elif ch < 0x20 or ch == 0x7f:
            out += b"\\%03o" % ch
        else:
            out.append(ch)
    return bytes(out + b'"')


def _no_room(path: str) -> bool:
    """Has the filesystem of ``path``'s directory no room left (under a MiB free)?"""
    try:
        st = os.statvfs(os.path.dirname(path))
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 1 << 20


class GitError(Exception):
    pass


_SMALL_HASHING = 256 << 10   # bytes hashed with CPython's own SHA-1 before OpenSSL's is loaded
_hashed = 0
_sha1 = None


def sha1(data: bytes, size: int = 0):
    """A SHA-1 object over ``data`` (``size``: the bytes to be added to it still): CPython's own
    while little has been hashed, since loading hashlib's OpenSSL costs a reader's start some
    4 ms (a diff of a turn hashes kilobytes); OpenSSL's once more than ``_SMALL_HASHING`` bytes
    were, as it is seven times faster on large content."""
    global _hashed, _sha1
    if _sha1 is None or _hashed <= _SMALL_HASHING:
        _hashed += len(data) + size
        if _hashed > _SMALL_HASHING:
            from hashlib import sha1 as _sha1
        elif _sha1 is None:
            try:
                from _sha1 import sha1 as _sha1
            except ImportError:
                from hashlib import sha1 as _sha1
    return _sha1(data)


def blob_id(data: bytes | Large) -> str:
    """The object name git gives a blob of these bytes (``git hash-object --no-filters``)."""
    h = sha1(b"blob %d\0" % len(data), len(data))
    for buf in data.chunks() if isinstance(data, Large) else (data,):
        h.update(buf)
    return h.hexdigest()


class ObjectStore:
    """A git object store: the private one in the state dir (default), or a repository the
    user names.  Each holds every object its refs name: the private one once borrowed the
    workspace repository's objects as an alternate, and git then wrote no object that
    repository held, so an agent's `rm -rf .git` (or its `git gc` pruning a branch) took
    objects of the store's recorded commits with it."""

    def __init__(self, state_dir: str, git_dir: str | None = None):
        # absolute: git runs from / (it failed, "Unable to read current working directory",
        # for a reader started in a directory removed since)
        self.git_dir = os.path.abspath(git_dir or os.path.join(state_dir, "git"))
        # the private store is the user's alone whatever their umask (docs/storage.md): every
        # git it runs makes its files so (a diff's blobs too, not only an export's); a
        # repository the user names keeps the modes their git gives it
        self.umask = 0o077 if git_dir is None else -1
        if git_dir is None:
            from ..state import tighten_tree
            tighten_tree(self.git_dir)
        if not os.path.exists(os.path.join(self.git_dir, "HEAD")):
            if git_dir is not None:
                raise GitError(f"{git_dir} is not a git repository")
            self._make()
        # paths as they are (UTF-8), not octal-quoted: diffs read as the workspace's names
        # a path given to git is a name, never a pattern (a file called `*.py` is one file)
        self.env = dict(os.environ, GIT_DIR=self.git_dir, GIT_CONFIG_NOSYSTEM="1",
                        GIT_LITERAL_PATHSPECS="1",
                        GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_COUNT="1",
                        GIT_CONFIG_KEY_0="core.quotepath", GIT_CONFIG_VALUE_0="false")
        if git_dir is None:
            # the private store runs no hook: none is ours, and one put into its hooks/ by
            # another user (a store reached through a link, or left open) ran as the reader
            # (found by a bug hunt: as root, on `export git`)
            self.env.update(GIT_CONFIG_COUNT="2", GIT_CONFIG_KEY_1="core.hooksPath",
                            GIT_CONFIG_VALUE_1=os.devnull)
        if git_dir is None:
            self._dissociate()
        self.left_out: set[str] = set()   # paths git refuses, filtered out before git saw them
        self.warnings: list[str] = []     # what git said on stderr when it succeeded
        self._entries: dict[str, dict] = {EMPTY_TREE: {}}  # trees made here: path -> (mode, id)
        self._last_changes: tuple = (None, [])  # _changes: the last pair asked, its answer
        # trees named here but not written, the store holding them already (trees): written
        # should git not find what they name after all
        self._unwritten: list[dict[str, tuple[str, str]]] = []

    def _make(self) -> None:
        """``git init`` of the private store; one it could not finish (no room in the state
        dir) is removed, not left half made beside a one-line reason."""
        made = not os.path.lexists(self.git_dir)
        try:
            self._git("init", "-q", "--bare", self.git_dir, git_dir=False)
        except GitError as e:
            if made:
                shutil.rmtree(self.git_dir, ignore_errors=True)
            if _no_room(self.git_dir):
                raise GitError(f"cannot make the object store {self.git_dir}: no space left "
                               "in the state dir (free some room and run it again)") from None
            raise e from None

    def _dissociate(self) -> None:
        """A private store made by an earlier version borrows from the workspace repository
        (``objects/info/alternates``): what it borrows is copied in (as ``git clone
        --dissociate`` does: a repack that takes the borrowed objects too; unreachable ones of
        its own are kept, loose) and the alternate dropped."""
        alternates = os.path.join(self.git_dir, "objects", "info", "alternates")
        if not os.path.exists(alternates):
            return
        try:
            self._git("repack", "-A", "-d", "-q")
        except GitError as e:
            raise GitError(f"the object store {self.git_dir} names objects it borrowed from "
                           f"the workspace's own repository, which lost them ({e}); move it "
                           "aside and run the command again: a new one is written from the "
                           "journal") from None
        os.unlink(alternates)

    def _git(self, *args, input=None, env=None, git_dir=True) -> str:
        cmd = ["git", *args]
        with _no_sigpipe() if input is not None else contextlib.nullcontext():
            r = subprocess.run(cmd, input=input, capture_output=True, cwd="/",
                               env=env or (self.env if git_dir else None), umask=self.umask)
        if r.returncode != 0:
            # one line: git's own lines joined (they broke the one line of the error)
            said = "; ".join(x.strip() for x in r.stderr.decode(errors="replace").splitlines()
                             if x.strip())
            raise GitError(f"git {args[0]} failed: {said}")
        for line in r.stderr.decode(errors="replace").splitlines():
            if line.strip() and line not in self.warnings:
                self.warnings.append(line)
        return r.stdout.decode("utf-8", "surrogateescape")

    def packs(self) -> int:
        """How many packs the store holds."""
        try:
            return sum(n.endswith(".pack") for n in
                       os.listdir(os.path.join(self.git_dir, "objects", "pack")))
        except OSError:
            return 0

    def write_blobs(self, blobs: list[bytes]) -> list[str]:
        """Write these blobs into the store; their object names.  One ``git fast-import``
        stream for them all (no file or process per object), each content once: git writes
        one pack of what the store's packs do not hold yet (an earlier diff's, an export's),
        or loose objects when that is under 100 of them (its
        ``fastimport.unpackLimit``, as a fetch does)."""
        if not blobs:
            return []
        fi = FastImport(self, marks=False, prefix="overlayrec-blobs-")
        try:
            names = [fi.named_blob(data) for data in blobs]
        except BaseException:
            fi.cleanup()
            raise
        fi.close()
        return names

    def tree(self, states: dict[str, State]) -> str:
        """A tree holding each present path (files and symlinks) as a blob; not the paths git
        refuses (``.git/``: remembered in ``left_out``), nor the workspace's root ("")."""
        return self.trees(states)[0]

    def trees(self, *sides: dict[str, State]) -> list[str]:
        """The tree of each side (see tree), all written through one ``git fast-import``
        stream: fast-import writes trees only as a commit's, so each is the root of a commit on
        a ref of this process's that the stream deletes again at its end (the objects stay;
        nothing names them).  The trees' names are computed here (``_tree_name``) and their
        entries kept, so ``diff`` can tell which paths differ without asking git."""
        names, todo = [], []
        # nor a file past the size a reader holds (engines.large) on any side: a diff says it
        # is left out (readers.not_in_patch), where git would make a patch of gigabytes
        large = {p for states in sides for p, s in states.items() if over_limit(s.data)}
        for states in sides:
            refused = {p for p in states if git_refuses(p)}
            self.left_out |= refused
            entries = {p: ("120000" if s.kind == "symlink" else
                           "100755" if s.mode & 0o111 else "100644", s.data)
                       for p, s in sorted(states.items())
                       if p and p not in refused and s.kind in ("file", "symlink")
                       and p not in large}
            if not entries:
                names.append(EMPTY_TREE)
            elif any(_git_may_refuse(p, m == "120000") for p, (m, _) in entries.items()):
                names.append(self._tree_by_index(entries))
            else:
                todo.append((len(names), entries))
                names.append(None)
        if not todo:
            return names
        named_sides = []
        for i, entries in todo:
            named = {p: (mode, blob_id(data), data) for p, (mode, data) in entries.items()}
            names[i], flat = _tree_name({p: (mode, sha) for p, (mode, sha, _) in named.items()})
            self._entries[names[i]] = flat
            named_sides.append(named)
        # the same sides asked again (a turn's --stat, then its patch or --json): the trees
        # are in the store already, and so is what they name, written by the same stream
        if all(self._holds(names[i]) for i, _ in todo):
            self._unwritten.extend(named_sides)
        else:
            self._write_trees(named_sides)
        return names

    def _write_trees(self, sides: list[dict[str, tuple[str, str, bytes]]]) -> None:
        """Write each side (path -> (mode, blob id, content)) as a tree, with its blobs, through
        one ``git fast-import`` stream: as the root of a commit on a ref of this process's that
        the stream deletes again at its end (fast-import writes trees only as a commit's)."""
        ref = f"refs/overlayrec/tree-{os.getpid()}"
        who = {"name": "overlayrec", "email": "overlayrec", "date": "0 +0000"}
        fi = FastImport(self, marks=False, prefix="overlayrec-tree-")
        try:
            for named in sides:
                for _, sha, data in named.values():
                    fi.known_blob(sha, data)
                fi.reset(ref)
                fi.commit(ref, who, who, "", None,
                          [f"M {mode} {sha} ".encode() + quote_path(p)
                           for p, (mode, sha, _) in named.items()])
            fi.reset(ref)   # no "from": the ref is deleted when the stream ends
        except BaseException:
            fi.cleanup()
            raise
        fi.close()

    def _holds(self, name: str) -> bool:
        """Does the store hold object ``name``, loose or packed?"""
        objects = os.path.join(self.git_dir, "objects")
        if os.path.exists(os.path.join(objects, name[:2], name[2:])):
            return True
        try:
            idxs = [n for n in os.listdir(os.path.join(objects, "pack")) if n.endswith(".idx")]
        except OSError:
            return False
        raw = bytes.fromhex(name)
        return any(_pack_index_holds(os.path.join(objects, "pack", n), raw) for n in idxs)

    def _tree_by_index(self, entries: dict[str, tuple[str, bytes]]) -> str:
        """The tree of these entries made by ``git update-index`` and ``write-tree`` in a
        private index: for names git may refuse (``_git_may_refuse``), which fast-import would
        take as they are; update-index leaves them out, and what it says is kept."""
        shas = self.write_blobs([data for _, data in entries.values()])
        lines = [f"{mode} {sha}\t{p}" for (p, (mode, _)), sha in zip(entries.items(), shas)]
        import tempfile
        with tempfile.TemporaryDirectory(prefix="overlayrec-tree-") as tmp:
            env = dict(self.env, GIT_INDEX_FILE=os.path.join(tmp, "index"))
            self._git("update-index", "-z", "--index-info",
                      input=("\0".join(lines) + "\0").encode("utf-8", "surrogateescape"),
                      env=env)
            return self._git("write-tree", env=env).strip()

    def diff(self, a: str, b: str, fmt: str, paths: list[str] | None = None,
             binary: bool = False, as_they_are: bool = False) -> str:
        """git's diff of trees ``a`` and ``b`` in ``fmt``; names C-quoted as git quotes them,
        every name not ASCII too where one would turn a terminal around (``_quoted_env``),
        unless ``as_they_are`` (a caller that escapes names itself: the report's HTML)."""
        try:
            return self._diff(a, b, fmt, paths, binary, as_they_are)
        except GitError:
            if not self._unwritten:
                raise
        # a tree not written (trees) names what git cannot find now: written after all
        sides, self._unwritten = self._unwritten, []
        self._write_trees(sides)
        return self._diff(a, b, fmt, paths, binary, as_they_are)

    def _quoted_env(self, a: str, b: str, paths: list[str] | None) -> dict | None:
        """git's environment for a diff that names a path git would print as it is although
        it holds an invisible or bidi mark (U+202E turns a name around on a terminal) or bytes
        that are not UTF-8: core.quotepath on, so every name that is not ASCII is octal-quoted,
        as git does by default and as the listings quote such a name (views.shown).  None (the
        store's own, names as they are) for every other diff."""
        names = (p for _, _, p in self._changes(a, b, paths))
        # (git quotes a control character, a quote or a backslash itself)
        if all(p.isprintable() or p.isascii() for p in names):
            return None
        return dict(self.env, GIT_CONFIG_VALUE_0="true")

    def _diff(self, a: str, b: str, fmt: str, paths: list[str] | None,
              binary: bool, as_they_are: bool = False) -> str:
        args = ["diff-tree", "-r", "-M" if self._renames_apply(a, b, paths) else "--no-renames",
                "--no-commit-id", "--root"]
        # the -z forms: paths as they are (not C-quoted), for --json
        args += {"patch": ["-p"], "stat": ["--stat"], "numstat": ["--numstat"],
                 "name-status": ["--name-status"], "numstat-z": ["--numstat", "-z"],
                 "name-status-z": ["--name-status", "-z"]}[fmt]
        if binary and fmt == "patch":
            args.append("--binary")
        args += [a, b]
        if paths:
            args += ["--", *paths]
        # the -z forms name paths as they are, whatever core.quotepath says
        return self._git(*args, env=None if as_they_are or fmt.endswith("-z") else
                         self._quoted_env(a, b, paths))

    def _changes(self, a: str, b: str, paths: list[str] | None) -> list[tuple[str, str, str]]:
        """(mode before, mode after, path) of each path where trees ``a`` and ``b`` differ
        (beneath ``paths``): from the entries kept when both were made here (``trees``), else
        from git.  The last pair's are kept: a diff asks twice (renames, names to quote)."""
        key = (a, b, tuple(paths) if paths else None)
        if self._last_changes[0] == key:
            return self._last_changes[1]
        ea, eb = self._entries.get(a), self._entries.get(b)
        if ea is not None and eb is not None and not paths:  # both made here: no git to ask
            none = ("", "")
            got = [(ea.get(p, none)[0], eb.get(p, none)[0], p) for p in ea.keys() | eb.keys()
                   if ea.get(p, none) != eb.get(p, none)]
        else:
            fields = self._git("diff-tree", "-r", "-z", "--no-renames", "--no-commit-id",
                               "--root", a, b, *(["--", *paths] if paths else [])).split("\0")
            got = []
            for meta, path in zip(fields[0::2], fields[1::2]):
                was, now = meta.lstrip(":").split(" ")[:2]
                got.append((was, now, path))
        self._last_changes = (key, got)
        return got

    def _renames_apply(self, a: str, b: str, paths: list[str] | None) -> bool:
        """May the diff name renames?  Not where a symlink and a directory trade places (``l``
        a symlink becomes a directory holding what moved in): git apply then refuses a rename
        into ``l/...`` as "beyond a symbolic link", though it takes the same change written as
        deletions and additions."""
        changes = self._changes(a, b, paths)
        links = {p for was, now, p in changes if "120000" in (was, now)}
        if not links:
            return True
        for _, _, path in changes:
            parts = path.split("/")
            if any("/".join(parts[:i]) in links for i in range(1, len(parts))):
                return False
        return True


# the code points HFS+ ignores in a name, which git's fsck ignores as well when it looks for a
# ``.git`` (utf8.c, next_hfs_char): ".git" with a zero-width joiner in it is ``.git`` there
_HFS_IGNORED = dict.fromkeys([0x200C, 0x200D, 0x200E, 0x200F, *range(0x202A, 0x202F),
                              *range(0x206A, 0x2070), 0xFEFF])


def _git_may_refuse(path: str, symlink: bool) -> bool:
    """Might git's own path check (``verify_path``, core.protectNTFS on as by default) refuse
    this path?  Besides ``.git`` (git_refuses) it refuses the names NTFS reads as ``.git``
    (``git~1``, ``.git. ``, ``.git::$INDEX_ALLOCATION``: git's ``is_ntfs_dotgit``) or HFS+
    does (``.git`` with a zero-width code point in it: ``is_hfs_dotgit``) and, for a
    symlink, as ``.gitmodules``.  A wide net: what it catches goes through git's own check."""
    for part in path.lower().split("/"):
        hfs = part.translate(_HFS_IGNORED)  # HFS+ reads a name without these (is_hfs_dotgit)
        if hfs == ".git" or (symlink and hfs == ".gitmodules"):
            return True
        for stem in (".git", "git~1"):
            if part.startswith(stem):
                rest = part[len(stem):].lstrip(". ")
                if not rest or rest[0] in "\\:":
                    return True
        if symlink and part.startswith((".gitmodules", "gitmod~", "gi7eba~")):
            return True
    return False


def _tree_name(entries: dict[str, tuple[str, str]]) -> tuple[str, dict]:
    """The object name of the tree fast-import makes of these ``M`` lines (path -> (mode, blob
    id), in this order), and the entries it ends up holding: a later path beneath an earlier
    file's name turns that file into a directory, as fast-import does."""
    root: dict = {}
    for path, entry in entries.items():
        node = root
        *dirs, name = path.split("/")
        for d in dirs:
            sub = node.get(d)
            if not isinstance(sub, dict):
                sub = node[d] = {}
            node = sub
        node[name] = entry
    flat: dict[str, tuple[str, str]] = {}

    def write(node: dict, prefix: str) -> str:
        items = []
        for name, v in node.items():
            raw = name.encode("utf-8", "surrogateescape")
            if isinstance(v, dict):
                # git orders a tree's entries by name, a directory's as if it ended in "/"
                items.append((raw + b"/", b"40000 " + raw + b"\0" +
                              bytes.fromhex(write(v, prefix + name + "/"))))
            else:
                flat[prefix + name] = v
                items.append((raw, v[0].encode() + b" " + raw + b"\0" + bytes.fromhex(v[1])))
        body = b"".join(e for _, e in sorted(items))
        return sha1(b"tree %d\0" % len(body) + body).hexdigest()

    return write(root, ""), flat


def _pack_index_holds(path: str, name: bytes) -> bool:
    """Does the pack index (version 2) at ``path`` list the object ``name`` (20 bytes)?  Its
    fan-out table gives the range of the sorted names that begin with the same byte; a
    bisection of that range finds it.  An index of another version, or unreadable: no."""
    import mmap
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m[:8] != b"\xfftOc\x00\x00\x00\x02" or len(m) < 8 + 1024:
                return False
            first = name[0]
            lo = int.from_bytes(m[8 + 4 * (first - 1):12 + 4 * (first - 1)], "big") \
                if first else 0
            hi = int.from_bytes(m[8 + 4 * first:12 + 4 * first], "big")
            base = 8 + 1024
            if base + 20 * hi > len(m):
                return False
            while lo < hi:
                mid = (lo + hi) // 2
                got = m[base + 20 * mid:base + 20 * mid + 20]
                if got == name:
                    return True
                if got < name:
                    lo = mid + 1
                else:
                    hi = mid
            return False
    except (OSError, ValueError):
        return False


def _name(s: str) -> str:
    """An ident name as git commit-tree writes it: without newlines and angle brackets."""
    return "".join(ch for ch in s if ch not in "\n<>").strip()


def _scratch_dir(prefix: str) -> str:
    """A new private directory, where ``tempfile.mkdtemp`` makes one: in the first of $TMPDIR,
    $TEMP, $TMP set, else /tmp; tempfile itself (its search, for when that fails) only then.
    Importing tempfile (shutil, bz2, lzma, random) is some 5 ms of every diff's start."""
    base = next((d for d in map(os.environ.get, ("TMPDIR", "TEMP", "TMP")) if d), "/tmp")
    path = os.path.join(os.path.abspath(base), prefix + os.urandom(6).hex())
    try:
        os.mkdir(path, 0o700)
        return path
    except OSError:
        import tempfile
        return tempfile.mkdtemp(prefix=prefix)


@contextlib.contextmanager
def _no_sigpipe():
    """SIGPIPE ignored while writing to a git process: the CLI takes SIGPIPE's default (a
    closed `| head` ends it quietly), under which a git that stopped early (fast-import out
    of room on a full state disk) killed the whole command, exit 141, nothing said (found by a
    hunt).  Its broken pipe is then an error with what git said."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGPIPE, old)


class FastImport:
    """One ``git fast-import`` process fed objects, commits and refs; refs are updated (forced)
    when the stream ends, and each mark's object name read back then (``marks=False``: blobs
    only, named here: ``named_blob``).  Export writes a whole run through one; a diff its
    blobs (ObjectStore.write_blobs)."""

    def __init__(self, store: ObjectStore, marks: bool = True,
                 prefix: str = "overlayrec-export-", keep_pack: bool = False):
        self.tmp = _scratch_dir(prefix)
        self.git_dir = store.git_dir
        self.marks_file = os.path.join(self.tmp, "marks") if marks else None
        self.err = open(os.path.join(self.tmp, "stderr"), "w+b")
        self.proc = subprocess.Popen(
            # ``keep_pack``: the objects stay one pack however few (by default git makes loose
            # objects of under 100: a file each, and a directory for each new first byte)
            ["git", *(["-c", "fastimport.unpackLimit=0"] if keep_pack else []),
             # a blob past the size a reader holds (engines.large) is streamed into the pack
             # by git too (by default git holds one of up to 512 MiB whole)
             "fast-import", "--quiet", "--force", "--done", f"--big-file-threshold={LIMIT}",
             *([f"--export-marks={self.marks_file}"] if marks else [])],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self.err, cwd="/",
            # glibc otherwise gives memory back and asks for it again for every object (tens
            # of thousands of brk calls: most of fast-import's time on a long session)
            env=dict(store.env, MALLOC_TOP_PAD_=str(64 << 20)), umask=store.umask)
        self.out = self.proc.stdin
        self.buf = bytearray()
        self.n = 0
        self.blobs: dict[bytes, str] = {}   # content digest -> its mark (one blob per content)
        self.named: set[str] = set()        # blobs written without a mark (named_blob)

    def _write(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) >= 1 << 20:   # in large writes: a pipe's 64 KiB at a time is slow
            self._flush()

    def _flush(self) -> None:
        try:
            with _no_sigpipe():
                self.out.write(self.buf)
        except BrokenPipeError:
            self._fail()
        self.buf = bytearray()

    def _fail(self):
        self.proc.wait()
        self.err.seek(0)
        said = [l for l in self.err.read().decode(errors="replace").splitlines() if l.strip()]
        self.cleanup()
        try:  # its crash report, in the store: what it said is in the error
            os.unlink(os.path.join(self.git_dir, f"fast_import_crash_{self.proc.pid}"))
        except OSError:
            pass
        fatal = [l for l in said if l.startswith("fatal:")] or said[-3:] or \
            [self._how_it_ended()]
        raise GitError("git fast-import failed: " + "; ".join(fatal)[:2000])

    def _how_it_ended(self) -> str:
        """Why fast-import ended, for one that said nothing: killed by SIGXFSZ (a pack in the
        store grew past the user's `ulimit -f`) or by another signal, or its exit status."""
        code = self.proc.returncode
        if code == -signal.SIGXFSZ:
            limit = views.file_size_limit() or "the file-size limit (`ulimit -f`)"
            return f"a file it wrote in {self.git_dir} grew past {limit}: raise it"
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"it exited with {code}, saying nothing"

    def mark(self) -> str:
        self.n += 1
        return f":{self.n}"

    def blob(self, data: bytes | Large) -> str:
        if isinstance(data, Large):  # streamed: read twice (its key, then its bytes), held never
            h = sha1(b"", len(data))
            for buf in data.chunks():
                h.update(buf)
            key = h.digest()
        else:
            key = sha1(data).digest()
        m = self.blobs.get(key)
        if m is None:
            m = self.blobs[key] = self.mark()
            self._blob_data(b"blob\nmark %s\n" % m.encode(), data)
        return m

    def _blob_data(self, head: bytes, data: bytes | Large) -> None:
        if isinstance(data, Large):
            self._write(head + b"data %d\n" % len(data))
            for buf in data.chunks():
                self._write(buf)
            self._write(b"\n")
        else:
            self._write(head + b"data %d\n" % len(data) + data + b"\n")

    def named_blob(self, data: bytes) -> str:
        """This content as a blob without a mark (once per stream): its object name, computed
        here.  git skips writing it when the store's packs hold it already."""
        return self.known_blob(blob_id(data), data)

    def known_blob(self, name: str, data: bytes) -> str:
        """named_blob of content whose object name ``name`` is known already."""
        if name not in self.named:
            self.named.add(name)
            self._blob_data(b"blob\n", data)
        return name

    def commit(self, ref: str, author: dict, committer: dict, message: str,
               parent: str | None, changes: list[bytes]) -> str:
        m = self.mark()
        msg = message.encode("utf-8", "surrogateescape")
        head = (f"commit {ref}\nmark {m}\n"
                f"author {_name(author['name'])} <{author['email']}> {author['date']}\n"
                f"committer {_name(committer['name'])} <{committer['email']}> "
                f"{committer['date']}\n").encode("utf-8", "surrogateescape")
        parts = [head, b"data %d\n" % len(msg), msg, b"\n"]
        if parent:
            parts.append(f"from {parent}\n".encode())
        for c in changes:
            parts += [c, b"\n"]
        parts.append(b"\n")
        self._write(b"".join(parts))
        return m

    def reset(self, ref: str, to: str | None = None) -> None:
        self._write(f"reset {ref}\n".encode("utf-8", "surrogateescape")
                    + (f"from {to}\n\n".encode() if to else b"\n"))

    def close(self) -> dict[str, str]:
        """End the stream; the object name of each mark (none without ``marks``)."""
        self._write(b"done\n")
        self._flush()
        try:
            with _no_sigpipe():
                self.out.close()
        except BrokenPipeError:
            self._fail()
        if self.proc.wait() != 0:
            self._fail()
        marks = {}
        try:
            if self.marks_file:
                with open(self.marks_file) as f:
                    for line in f:
                        m, sha = line.split()
                        marks[m] = sha
        finally:
            self.cleanup()
        return marks

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.err.close()
        if os.path.isdir(self.tmp):
            for name in os.listdir(self.tmp):
                os.unlink(os.path.join(self.tmp, name))
            os.rmdir(self.tmp)
