"""What a path held at any point of the record: the one place every reader asks.

The journal is a reverse-delta chain: an event's pre-image is the state of its path just before
it.  So the state of path P *after* sequence number S is the pre-image of the first later event
on P, with two rules that make it the truth about real sessions:

* **Path history.**  ``mv tests testsuite`` is one event, yet every path beneath moved.  If the
  first later thing to happen to P is a rename of one of its ancestors, P's state is the state
  of its new name just after that rename (or absent, when the rename replaced the ancestor).
  Backwards, the names a path had are found the same way, and ``all_names`` / ``descendants``
  list the paths beneath a directory at any point, so a directory rename shows (and reverts)
  as every file that moved.
* **Seals.**  A chain ends at the path's last seal (what the daemon saw when the epoch ended),
  not at whatever the live tree holds now.  When the live path no longer matches its seal it
  has *drifted* (an edit while unmounted, or by a process around the mount): the record's end is
  the seal, marked ``drifted``; a path whose last epoch is still open (mounted) ends live.

Pre-images are kept by facet (content may be saved by a later event of the same epoch, and for
large files only the ranges a change was about to lose), so a content is completed from what
the epoch saved and from the state at the epoch's end.  Exact at every epoch boundary (every
unit boundary); a point inside an epoch is answered with the epoch's next known state and marked
inexact.
"""
from __future__ import annotations

import bisect
import errno
import itertools
import os
import stat
from collections import namedtuple
from contextlib import contextmanager

from ..journal import Journal, preimage
from ..journal.renames import RenameIndex, outermost
from ..journal.schema import (MARK_OPS, beneath_rule, call_unit, is_dir_rename, revert_unit, session_unit,
                              turn_unit)
from ..secrets import Secrets, placeholder, public_in
from ..underlay import ACL_ACCESS, kind_of
from .large import Large, digest_of, holds, load, over_limit, source, whole

ATTIC = ".overlayrec-attic"


_Fields = namedtuple("_Fields", (
    "kind",      # absent | file | dir | symlink | fifo | socket | device
    "mode",      # permission bits (S_IMODE); 0o120000 for a symlink
    "data",      # file content, or a symlink's target
    "exact",     # False: the record cannot say exactly (see module doc)
    "uid",       # owner, where the record knows it
    "gid",
    "rdev",      # device number (kind "device"); ``block``: a block device
    "block",
    "ino",       # the inode at that point (0: unknown); with nlink > 1 it groups
    "nlink",     # the paths of one hard-link group
    "drifted",   # the live path no longer holds what the record sealed
    "withheld",  # a secret path's file: ``data`` is a placeholder, never content
), defaults=(0, b"", True, None, None, 0, False, 0, 1, False, False))


class State(_Fields):
    """What a path held at one point: the one type every reader compares, writes and prints.
    Immutable (a tuple: the readers share one State among their answers), compared and hashed
    field by field; a tuple and not a frozen dataclass, whose constructor costs five times as
    much: a diff of a turn makes thousands."""
    __slots__ = ()

    @property
    def present(self) -> bool:
        return self.kind != "absent"

    def but(self, **kw) -> "State":
        """A copy with some fields changed."""
        return self._replace(**kw)

    def same(self, other: "State", *, owner: bool = True) -> bool:
        """Does ``other`` hold the same thing: kind, content or target, mode and (where both
        know it) owner?  Inexactness, inode numbers and drift marks are not compared."""
        if self.kind != other.kind:
            return False
        if self.kind == "absent":
            return True
        if self.withheld != other.withheld:
            return False  # a placeholder never equals content
        if self.kind in ("file", "symlink") and self.data != other.data:
            return False
        if self.kind != "symlink" and self.mode != other.mode:
            return False
        if self.kind == "device" and (self.rdev, self.block) != (other.rdev, other.block):
            return False
        if owner:
            for a, b in ((self.uid, other.uid), (self.gid, other.gid)):
                if a is not None and b is not None and a != b:
                    return False
        return True


ABSENT = State("absent")
# what a reader says of a live path it may not read (Tree.unreadable), and shows for a file's
UNREADABLE_NOTE = "cannot be read: no read permission on it (chmod u+r, then ask again)"
UNREACHED_NOTE = "cannot be reached: a directory on its way may not be searched (chmod u+x)"
UNLISTED_NOTE = "cannot be listed: no read permission on it (chmod u+r)"
UNREADABLE_OTHERS = "cannot be read: no read permission on it (owned by uid %d)"
# ... a directory of another owner: "chmod u+r" is advice its reader cannot follow (a hunt)
UNLISTED_OTHERS = "cannot be listed: no read permission on it (owned by uid %d)"


def unlisted_note(st: os.stat_result | None) -> str:
    """Why a directory (its lstat ``st``) could not be listed, as said to its reader."""
    return UNLISTED_NOTE if st is None or st.st_uid == os.geteuid() else \
        UNLISTED_OTHERS % st.st_uid


def is_unlisted(note: str | None) -> bool:
    """Does ``note`` (Tree.unreadable's) say a directory could not be listed?"""
    return note is not None and note.startswith("cannot be listed")
UNREADABLE = b"overlayrec: content unknown, the file cannot be read here\n"
# a path beneath a directory the reader may not search: what it holds is not known, not absent
UNREACHED = State("absent", exact=False)


def state_of_stat(st: os.stat_result, content) -> State:
    """The State of a live object from its lstat; ``content()`` reads a file's bytes or a
    symlink's target (called only for those kinds)."""
    kind = kind_of(st.st_mode)
    common = dict(uid=st.st_uid, gid=st.st_gid, ino=st.st_ino)
    if kind == "symlink":
        return State("symlink", 0o120000, content(), **common)
    if kind == "file":
        return State("file", stat.S_IMODE(st.st_mode), content(), nlink=st.st_nlink, **common)
    return State(kind, stat.S_IMODE(st.st_mode), rdev=st.st_rdev if kind == "device" else 0,
                 block=stat.S_ISBLK(st.st_mode), **common)


def _read_at(dfd: int, name: str, st: os.stat_result, root_fd: int, rel: str) -> bytes | Large:
    if stat.S_ISLNK(st.st_mode):
        return os.fsencode(os.readlink(name, dir_fd=dfd))
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    if not holds(st.st_size):  # opened to be sure it can be; read when written or compared
        os.close(fd)
        return Large.live(root_fd, rel, st)
    try:  # to its end, as a file object's read() (without one: a diff reads 1,000 of these)
        chunks = []
        while chunk := os.read(fd, max(st.st_size + 1, 1 << 16) if not chunks else 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class Tree:
    """Reads the live tree and the attic below a root directory fd (the underlay).  With
    ``secrets`` (set by States from its journal), a secret path's file is never read (a
    content-checked one is read only to look: overlayrec.secrets): its State is a withheld
    placeholder."""

    def __init__(self, root_fd: int, secrets: Secrets | None = None):
        self.root_fd = root_fd
        self.secrets = secrets
        self.reads = None  # engines.answers.Reads: what a kept answer depends on, when set
        # mounted (a daemon serves it): a file in a write run changes with no event
        self.served = False
        # no daemon serves it (readers.tree_for found no mount): a record left unsealed then
        # ends its open epochs at whatever the live tree holds now (States.left_open)
        self.unmounted = False
        self._ahead: dict[str, tuple[State, os.stat_result | None]] = {}  # read_ahead
        # live paths this reader may not read (chmod), and why: a file's content (UNREADABLE),
        # a path beneath a directory it may not search (UNREACHED), a directory's entries
        self.unreadable: dict[str, str] = {}

    def _note(self, rel: str, st: os.stat_result | None) -> None:
        if self.reads is not None:
            self.reads.note(rel, st)

    @classmethod
    def at(cls, path: str) -> "Tree":
        return cls(os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))

    def _open_parent(self, rel: str) -> tuple[int, str]:
        """An O_PATH fd of ``rel``'s directory and its name there, reached without following a
        symlink: ``Escape`` (an OSError) when its way holds one, or a file, even as the last
        step (a parent that is now a symlink holds nothing of the workspace's)."""
        from ..underlay import O_PATH, Escape, resolve_beneath
        parent, _, name = rel.rpartition("/")
        if name in ("", ".", ".."):
            raise Escape(errno.EXDEV, "not a name beneath the root", rel)
        return resolve_beneath(self.root_fd, parent, O_PATH | os.O_DIRECTORY), name

    def state(self, rel: str) -> State:
        return self.state_stat(rel)[0]

    def state_stat(self, rel: str) -> tuple[State, os.stat_result | None]:
        """``state`` and the lstat it was read with (None when absent): one walk to the
        directory, for a caller that wants both."""
        if self._ahead:
            got = self._ahead.pop(rel, None)
            if got is not None:
                self._note(rel, got[1])
                return got
        if rel == "":  # the workspace root itself
            st = os.fstat(self.root_fd)
            self._note(rel, st)
            return state_of_stat(st, lambda: b""), st
        try:
            dfd, name = self._open_parent(rel)
        except PermissionError:
            self._note(rel, None)
            self.unreadable[rel] = UNREACHED_NOTE
            return UNREACHED, None
        except OSError:
            self._note(rel, None)
            return ABSENT, None
        try:
            got = self._state_in(dfd, name, rel)
            self._note(rel, got[1])
            return got
        finally:
            os.close(dfd)

    def _state_in(self, dfd: int, name: str, rel: str) -> tuple[State, os.stat_result | None]:
        """state_stat of ``rel``, named ``name`` in its directory ``dfd``."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return ABSENT, None
        except PermissionError:  # its directory may not be searched
            self.unreadable[rel] = UNREACHED_NOTE
            return UNREACHED, None
        if stat.S_ISREG(st.st_mode) and self.secrets is not None and \
                (self.secrets.match(rel) or self.secrets.checked(rel)):
            # a content-checked file is looked at once, and shown as read then when public
            data = None if self.secrets.match(rel) else public_in(dfd, name)
            if data is not None:
                return state_of_stat(st, lambda: data), st
            return state_of_stat(st, lambda: placeholder(None)).but(exact=False,
                                                                    withheld=True), st
        try:
            return state_of_stat(st, lambda: _read_at(dfd, name, st, self.root_fd, rel)), st
        except FileNotFoundError:  # gone between the lstat and the read: absent now
            return ABSENT, None
        except PermissionError:
            if not stat.S_ISREG(st.st_mode):
                raise
            # a file its owner may not read (chmod 200): neither may its reader, who is that
            # owner.  Its kind, mode and owner are known, its content is not (the daemon, which
            # may grant itself the read, has kept what it destroyed: underlay.reopen_own)
            self.unreadable[rel] = UNREADABLE_NOTE if st.st_uid == os.geteuid() else \
                UNREADABLE_OTHERS % st.st_uid
            return state_of_stat(st, lambda: UNREADABLE).but(exact=False), st

    def read_ahead(self, rels) -> None:
        """Read the state of each of ``rels`` now, a directory at a time, for state_stat to
        give (once each, noted then): a diff's side of 1,000 live files walked from the root
        once per directory, not once per file.  A path that cannot be read so (its directory
        unreachable, a read that fails) is left to state_stat, which says why in its turn."""
        by_parent: dict[str, list[tuple[str, str]]] = {}
        for rel in rels:
            parent, _, name = rel.rpartition("/")
            if name not in ("", ".", ".."):
                by_parent.setdefault(parent, []).append((rel, name))
        for group in by_parent.values():
            try:
                dfd, _ = self._open_parent(group[0][0])
            except OSError:
                continue
            try:
                for rel, name in group:
                    try:
                        self._ahead[rel] = self._state_in(dfd, name, rel)
                    except OSError:
                        pass
            finally:
                os.close(dfd)

    def lstat(self, rel: str) -> os.stat_result | None:
        st = self._lstat(rel)
        self._note(rel, st)
        return st

    def _lstat(self, rel: str) -> os.stat_result | None:
        if rel == "":
            return os.fstat(self.root_fd)
        try:
            dfd, name = self._open_parent(rel)
        except PermissionError:
            self.unreadable[rel] = UNREACHED_NOTE
            return None
        except OSError:
            return None
        try:
            return os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except PermissionError:
            self.unreadable[rel] = UNREACHED_NOTE
            return None
        finally:
            os.close(dfd)

    def stats_unnoted(self, rels) -> dict[str, os.stat_result | None]:
        """``lstat`` of each of ``rels``, not noted in ``reads`` (a kept answer's check of what
        it read): each directory is reached once for all its names."""
        by_parent: dict[str, list[str]] = {}
        for rel in rels:
            by_parent.setdefault(rel.rpartition("/")[0] if rel else None, []).append(rel)
        out: dict[str, os.stat_result | None] = {}
        for parent, group in by_parent.items():
            if parent is None:  # the root itself
                out[""] = os.fstat(self.root_fd)
                continue
            try:
                dfd, _ = self._open_parent(group[0])
            except OSError:
                out.update((rel, None) for rel in group)
                continue
            try:
                for rel in group:
                    try:
                        out[rel] = os.stat(rel.rpartition("/")[2], dir_fd=dfd,
                                           follow_symlinks=False)
                    except (FileNotFoundError, NotADirectoryError, PermissionError):
                        out[rel] = None
            finally:
                os.close(dfd)
        return out

    def walk(self, rel: str, skip=()) -> list[str]:
        """Every path beneath directory ``rel`` (not itself), following no symlink; the
        directories named in ``skip`` (paths) are listed but not entered."""
        return [p for p, _ in self._walk(rel, skip, False)]

    def walk_stat(self, rel: str, skip=()) -> list[tuple[str, os.stat_result]]:
        """``walk`` with each path's lstat (taken in its directory, as it was listed; a path
        gone meanwhile is left out)."""
        return self._walk(rel, skip, True)

    def _walk(self, rel: str, skip, want_stat: bool) -> list[tuple[str, os.stat_result | None]]:
        out: list[tuple[str, os.stat_result | None]] = []
        try:
            fd = self._open_dir(rel)
        except PermissionError:
            st = self._lstat(rel)
            self.unreadable[rel] = unlisted_note(st)
            self._note(rel, st)
            return out
        except OSError:  # not there, or not a directory (a symlink is not followed)
            self._note(rel, self._lstat(rel))
            return out
        stack = [(fd, rel)]
        while stack:
            fd, base = stack.pop()
            if self.reads is not None:  # a directory's ctime moves when its entries change
                self._note(base, os.fstat(fd))
            entries = []  # (name, is a directory, lstat or None)
            try:
                with os.scandir(fd) as it:
                    for e in it:
                        if not want_stat:
                            entries.append((e.name, e.is_dir(follow_symlinks=False), None))
                            continue
                        try:
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue   # gone meanwhile
                        entries.append((e.name, stat.S_ISDIR(st.st_mode), st))
            except PermissionError:
                self.unreadable[base] = unlisted_note(os.fstat(fd))
                entries = []
            except OSError:
                entries = []
            for name, is_dir, st in entries:
                if not base and name == ATTIC:
                    continue
                child = f"{base}/{name}" if base else name
                out.append((child, st))
                if is_dir and child not in skip:
                    try:
                        stack.append((os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                              | os.O_CLOEXEC, dir_fd=fd), child))
                    except PermissionError:
                        self.unreadable[child] = unlisted_note(
                            st if st is not None else self._lstat(child))
                    except OSError:
                        pass
            os.close(fd)
        return out

    def _open_dir(self, rel: str) -> int:
        from ..underlay import open_beneath
        pfd = open_beneath(self.root_fd, rel) if rel else os.dup(self.root_fd)
        try:
            return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=pfd)
        finally:
            os.close(pfd)

    def symlink_on_the_way(self, rel: str) -> bool:
        """Is ``rel`` out of reach without following a symlink: a directory on its way, its
        own parent included, now a symlink (or not a directory)?  A directory that is not
        there is not in the way (a revert makes it)."""
        from ..underlay import Escape
        if rel == "":  # the root itself
            return False
        try:
            fd, _ = self._open_parent(rel)
        except Escape:
            return True
        except (FileNotFoundError, PermissionError):
            # not there (made by the revert), or a directory on the way this user may not
            # search (`chmod 000 d` by the selection): no symlink known; what the path holds
            # is read as unreachable, and said so (Tree.unreadable); a revert's preview failed,
            # "d/s: Permission denied"
            return False
        os.close(fd)
        return False

    def blocker(self, rel: str) -> str | None:
        """The first directory on ``rel``'s way that is now something else (a symlink, a
        file), or None."""
        parts = rel.split("/")[:-1]
        for i in range(len(parts)):
            sub = "/".join(parts[:i + 1])
            st = self.lstat(sub)
            if st is None:
                return None
            if not stat.S_ISDIR(st.st_mode):
                return sub
        return None


def facts(pre: dict) -> dict:
    """The State fields a stored pre-image or seal gives besides kind, mode and content."""
    out = {"uid": pre.get("uid"), "gid": pre.get("gid")}
    if pre.get("ino"):
        out["ino"] = pre["ino"]
    if pre.get("nlink"):
        out["nlink"] = pre["nlink"]
    if pre.get("kind") == "device":
        out["rdev"] = pre.get("rdev", 0)
        out["block"] = bool(pre.get("block"))
    return out


def _exchanged(e: dict, path: str) -> bool:
    """Is ``e`` an exchange (renameat2 RENAME_EXCHANGE) of ``path`` with another name?"""
    return e["op"] == "rename" and bool(e.get("flags", 0) & 2) and e.get("path") != e.get("path2") \
        and path in (e.get("path"), e.get("path2"))


def starts_run(e: dict) -> bool:
    """Does ``e`` begin a write run, whose later writes are no events: a write (in a journal
    that does not record data), or a create that made a file opened for writing or a
    truncating open for writing (``run``: its handle's first writes join it, docs/design.md)?"""
    return "run" in e or e["op"] == "write" and "data" not in e


def _moves_away(e: dict, path: str) -> bool:
    """Does ``e`` take the object at ``path`` to another name (a rename of it, or an
    exchange)?"""
    return e["op"] == "rename" and e.get("path2") != e.get("path") and (
        e.get("path") == path or (bool(e.get("flags", 0) & 2) and e.get("path2") == path))


def _holding(evs) -> list[dict]:
    """The events of a path's chain that hold: not ``failed`` notes, nor the events they name."""
    evs = list(evs)
    failed = {e["ref"] for e in evs if e["op"] == "failed"}
    return [e for e in evs if e["op"] != "failed" and e["seq"] not in failed]


class _Partial(Exception):
    """A chain read from the floor on (States.floor) cannot answer: read it whole."""

    def __init__(self, path: str):
        super().__init__(path)
        self.path = path


def _hashed(st: State) -> State:
    """``st`` with a file's content as its hash (a withheld placeholder stays as it is)."""
    if st.kind != "file" or st.withheld:
        return st
    return st.but(data=digest_of(st.data).encode())


INF = float("inf")


def _fwd(name: str, r: dict) -> str | None:
    """The name just after directory rename ``r`` of what was ``name`` just before it; None
    when nothing could be there (beneath a target the rename replaced)."""
    src, dst = r["src"], r["dst"]
    if name.startswith(src + "/"):
        return dst + name[len(src):]
    if name.startswith(dst + "/"):
        return src + name[len(dst):] if r.get("flags", 0) & 2 else None
    return name


def _back(name: str, r: dict) -> str | None:
    """The name just before ``r`` of what is ``name`` just after it; None when it is new there
    (beneath the source, which moved away)."""
    src, dst = r["src"], r["dst"]
    if name.startswith(dst + "/"):
        return src + name[len(dst):]
    if name.startswith(src + "/"):
        return dst + name[len(src):] if r.get("flags", 0) & 2 else None
    return name


def _under(name: str, d: str) -> bool:
    return name.startswith(d + "/")


def _span(names: list[str], d: str) -> tuple[int, int]:
    """The range of the sorted ``names`` beneath ``d`` ("0" follows "/")."""
    return bisect.bisect_left(names, d + "/"), bisect.bisect_left(names, d + "0")


def _beneath(names: list[str], d: str) -> list[str]:
    lo, hi = _span(names, d)
    return names[lo:hi]


def _add_sorted(names: list[str], more: list[str]) -> None:
    """Add ``more`` to the sorted ``names``: a few one by one (a sort of the whole list, even
    of one run and a short tail, costs more than that)."""
    if len(more) < 64:
        for c in more:
            bisect.insort(names, c)
    elif more:
        names.extend(more)
        names.sort()


def _move(names: list[str], a: str, b: str, exchange: bool) -> list[str]:
    """The sorted ``names`` after a rename of directory ``a`` to ``b`` (what ``_fwd`` does to
    each; ``_back`` is the same with ``a`` and ``b`` swapped): the names beneath ``a`` now
    beneath ``b``; those beneath ``b`` gone, or beneath ``a`` for an exchange."""
    if a == b:
        return names
    lo_a, hi_a = _span(names, a)
    lo_b, hi_b = _span(names, b)
    if lo_a == hi_a and lo_b == hi_b:
        return names
    moved = [b + c[len(a):] for c in names[lo_a:hi_a]]
    swapped = [a + c[len(b):] for c in names[lo_b:hi_b]] if exchange else []
    for lo, hi in sorted(((lo_a, hi_a), (lo_b, hi_b)), reverse=True):
        del names[lo:hi]
    for block, d in ((moved, b), (swapped, a)):
        if block:
            at = bisect.bisect_left(names, d + "/")
            names[at:at] = block
    return names


def left_unsealed(j: Journal) -> bool:
    """Was the record left unsealed: a daemon opened it (meta ``sealed`` "0") and did not
    seal it at unmount (killed, or its state dir full)?  While one serves the workspace the
    meta says "0" too: callers ask only when none does."""
    return j.meta("sealed") == "0"


class States:
    """Answers state(path, after_seq) for one journal and one tree."""

    def __init__(self, journal: Journal, tree: Tree):
        self.j = journal
        self.tree = tree
        # secret paths: every state of one is a withheld placeholder, and the live tree
        # read here never reads one (overlayrec.secrets)
        self.secrets = Secrets.of_journal(journal)
        if tree.secrets is None:
            tree.secrets = self.secrets
        self._chain: dict[str, list[dict]] = {}
        self._chain_seqs: dict[str, tuple[list[dict], list[int]]] = {}
        self._cache: dict[tuple, State] = {}
        self._ends: dict[str, int] | None = None
        self._rindex: RenameIndex | None = None  # the directory renames, by directory
        # a name's path history, one step at a time (``_link``), and the next step back that
        # holds events (``_holding_from``): each asked once, however often a reader walks it
        self._links: dict[tuple[str, int], tuple[int | None, str | None]] = {}
        self._holds: dict[tuple[str, int, bool], tuple[str, int] | None] = {}
        self._beneath: dict[str, dict | str | None] = {}  # _beneath_rule, by directory
        self._dirs_next: dict[tuple[str, int], tuple[int, bool] | None] = {}  # _next_of_dirs
        self._universe: list[tuple[str, float]] | None = None
        self._candidates: dict[float, set[str]] = {}
        self._moved_by: dict[tuple[str, int], set[str]] | None = None
        self._names: list[str] | None = None
        self._preloaded = False
        self._sigs: dict[tuple, State] = {}
        self._unsettled: set[tuple] = set()
        # ``floor``: a reader that asks about points at or after it only (export) lets a chain
        # be read from there: its events after the floor and its last holding one at or before
        # it.  Such a chain is ``partial``; whatever would look further back reads it whole
        # (_Partial), so the answers are the same as from whole chains, only cheaper.
        self.floor: int | None = None
        self._partial: set[str] = set()
        self._partners_asked: set[tuple[str, int]] = set()   # _partner_state in progress
        # the record left unsealed (its daemon killed, or its seal at unmount refused) and no
        # daemon serving: an open epoch's end is the live tree, which may hold changes made
        # since (by hand, while unmounted), so it is not the record's own
        self.left_open = tree.unmounted and left_unsealed(journal)
        self.open_ends: set[str] = set()  # the paths read so (diff names them)

    # -- the chain of one name ------------------------------------------------------------------
    def chain_on(self, path: str) -> list[dict]:
        """Every event naming ``path`` that holds (not failed), seals included."""
        evs = self._chain.get(path)
        if evs is None and self._preloaded:
            return []
        if evs is None:
            seqs = self.j.seqs_for_path(path)
            if self.floor is not None and seqs and seqs[0] < self.floor \
                    and not self.renames():
                evs = self._chain[path] = self._tail_chain(path, seqs, self.floor)
            else:
                evs = self._chain[path] = _holding(
                    e for e in map(self.j.event, seqs) if e is not None)
        return evs

    def _tail_chain(self, path: str, seqs: list[int], floor: int) -> list[dict]:
        """``path``'s chain from ``floor`` on: its holding events after ``floor`` and the last
        holding one at or before it (a failed note comes after the event it names, so reading
        back from the floor finds that one).  Marked partial when events before it are left."""
        i = bisect.bisect_right(seqs, floor)
        high = [e for e in map(self.j.event, seqs[i:]) if e is not None]
        failed = {e["ref"] for e in high if e["op"] == "failed"}
        out = [e for e in high if e["op"] != "failed" and e["seq"] not in failed]
        for k in range(i - 1, -1, -1):
            e = self.j.event(seqs[k])
            if e is None:
                continue
            if e["op"] == "failed":
                failed.add(e["ref"])
            elif e["seq"] not in failed:
                if k > 0:
                    self._partial.add(path)
                return [e] + out
        return out

    @contextmanager
    def from_floor(self, floor: int):
        """Within: every question is about a point at or after ``floor`` (``floor``); after,
        chains are read whole again."""
        self.floor = floor
        try:
            yield self
        finally:
            self.floor = None
            for p in self._partial:
                self._chain.pop(p, None)
            if self._partial:
                self._holds.clear()
            self._partial.clear()

    def _whole(self, path: str) -> None:
        """Read ``path``'s chain whole (it was read from the floor on, and a question looks
        further back)."""
        self._partial.discard(path)
        self._holds.clear()  # (kept from chains now read whole)
        self._chain[path] = _holding(
            e for e in map(self.j.event, self.j.seqs_for_path(path)) if e is not None)

    def _short(self, path: str, after: float) -> bool:
        """Does ``path``'s chain leave out events at or before ``after`` that matter there?"""
        return path in self._partial and after < self.floor

    def whole_chains(self, fn, *args):
        """``fn(*args)``, again after reading a chain whole each time a partial one (see
        ``floor``) could not answer."""
        while True:
            try:
                return fn(*args)
            except _Partial as e:
                self._whole(e.path)

    def _seqs_of(self, path: str, chain: list[dict]) -> list[int]:
        """The seqs of ``chain`` (``path``'s, as chain_on gave it), ascending."""
        got = self._chain_seqs.get(path)
        if got is None or got[0] is not chain:
            got = self._chain_seqs[path] = (chain, [e["seq"] for e in chain])
        return got[1]

    def read_live_ahead(self, asks) -> None:
        """For ``state(path, at)`` of each of ``asks`` (path, at) about to be asked: the live
        states it will read (the end of a chain with no event after ``at``) read ahead, a
        directory at a time (Tree.read_ahead).  Only where no directory was ever renamed (a
        rename may bring the end from another name) and every chain is whole."""
        if self.floor is not None or self.renames():
            return
        want = []
        for path, at in asks:
            chain = self.chain_on(path)
            if path and (not chain or chain[-1]["seq"] <= at):
                want.append(path)
        self.tree.read_ahead(want)

    def preload(self) -> None:
        """Fill every path's chain from one pass over the journal, for a reader that will ask
        about most of the paths (a listing): one decode per event instead of one per path."""
        raw: dict[str, list[dict]] = {}
        failed = False
        for e in self.j.keep_events():
            p, p2 = e.get("path"), e.get("path2")
            if p is not None:
                raw.setdefault(p, []).append(e)
            if p2 is not None and p2 != p:
                raw.setdefault(p2, []).append(e)
            if e["op"] == "failed":
                failed = True
        if self.j.cut > 1:  # below the cut only each path's latest seal stays
            for p, seq in self.j.seals():
                if seq < self.j.cut and (e := self.j.event(seq)) is not None:
                    raw.setdefault(p, []).insert(0, e)
        if failed or self.j.cut > 1:
            for p, evs in raw.items():
                self._chain[p] = _holding(evs)
        else:  # no failed note anywhere: every event holds
            self._chain.update(raw)
        self._preloaded = True
        self._holds.clear()

    def events_on(self, path: str) -> list[dict]:
        """The changes of ``path`` (no seals)."""
        return [e for e in self.chain_on(path) if e["op"] not in MARK_OPS]

    @staticmethod
    def pre_for(ev: dict, path: str) -> dict | None:
        if ev.get("path") == path and ev.get("pre") is not None:
            return ev["pre"]
        if ev.get("path2") == path and ev.get("pre2") is not None:
            return ev["pre2"]
        return None

    @staticmethod
    def starts_epoch(ev: dict, path: str) -> bool:
        return (ev.get("path") == path and (ev.get("epoch") or ev["op"] in MARK_OPS)) or \
            (ev.get("path2") == path and ev.get("epoch2"))

    # -- path history ---------------------------------------------------------------------------
    def renames(self) -> list[dict]:
        """Every directory rename, in order (``{"seq","src","dst","flags"}``)."""
        return self._index().renames

    def _index(self) -> RenameIndex:
        """The directory renames indexed by directory: a name's are found through its
        ancestors."""
        if self._rindex is None:
            self._rindex = RenameIndex(self.j.dir_renames())
        return self._rindex

    def _next_move(self, path: str, after: int) -> dict | None:
        """The first directory rename after ``after`` that moves or replaces an ancestor."""
        idx = self._index()
        if not idx.renames:  # (most records: two states of every path a diff shows)
            return None
        i = idx.touching(path, idx.upto(after), len(idx.renames))
        return None if i is None else idx.renames[i]

    def _beyond(self, path: str, r: dict | None) -> State:
        """The state of ``path`` after all of its own events up to ``r`` (a rename of an
        ancestor, None: the end of the record): its new name's, just after the rename."""
        if r is None:
            return self._tail(path)
        new = _fwd(path, r)
        return ABSENT if new is None else self.state(new, r["seq"])

    def source(self, path: str, after: int) -> tuple[str, dict | None, int | None] | None:
        """Where the record learnt what ``path`` held after ``after``: (name, pre-image, seq)
        of the first full pre-image on its chain after ``after`` (an event's or a seal's),
        followed to its new name through each directory rename that moves it first; when
        nothing of that name came after, its end: the seal that governs it (taken at or
        before ``after``), or (name, None, None) for the live tree the record never saw;
        None when a rename took it away.  ``state`` reads the same
        entry (a file in a directory made while unmounted and renamed by a later session has
        no event of its own: what it held is its new name's seal, or the live file)."""
        name = path
        while True:
            if self._short(name, after):
                raise _Partial(name)
            move = self._next_move(name, after)
            chain = self.chain_on(name)
            seqs = self._seqs_of(name, chain)
            stop = len(chain) if move is None else bisect.bisect_left(seqs, move["seq"])
            for e in chain[bisect.bisect_right(seqs, after, 0, stop):stop]:
                pre = self.pre_for(e, name)
                if pre is not None and "kind" in pre:
                    return name, pre, e["seq"]
            if move is None:
                seal = self._governing_seal(name)
                return (name, seal["pre"], seal["seq"]) if seal else (name, None, None)
            name = _fwd(name, move)
            if name is None:
                return None
            after = move["seq"]

    def map_name(self, name: str, at: float, to: float) -> str | None:
        """What ``name`` (valid at point ``at``) is called at point ``to``, through the
        directory renames between; None when it cannot exist there."""
        idx = self._index()
        rs = idx.renames
        if to >= at:
            lo, hi = idx.upto(at), idx.upto(to)
            while (i := idx.touching(name, lo, hi)) is not None:
                name = _fwd(name, rs[i])
                if name is None:
                    return None
                lo = i + 1
        else:
            lo, hi = idx.upto(to), idx.upto(at)
            while (i := idx.touching(name, lo, hi, last=True)) is not None:
                name = _back(name, rs[i])
                if name is None:
                    return None
                hi = i
        return name

    def _universe_names(self) -> list[tuple[str, float]]:
        """(name, a point where it is valid): every path the journal names, once per interval
        between directory renames, and the live paths beneath each renamed directory."""
        if self._universe is None:
            seen: set[tuple[str, int]] = set()
            out: list[tuple[str, float]] = []
            rseqs = self._index().seqs
            for path in self.j.paths():
                if not rseqs:
                    out.append((path, INF))
                    continue
                for seq in self.j.seqs_for_path(path):
                    k = (path, bisect.bisect_left(rseqs, seq))
                    if k not in seen:
                        seen.add(k)
                        out.append((path, seq))
            roots = set()
            for r in self.renames():
                for d in ((r["dst"], r["src"]) if r.get("flags", 0) & 2 else (r["dst"],)):
                    now = self.map_name(d, r["seq"], INF)
                    if now is not None:
                        roots.add(now)
            for root in sorted(roots):
                out.extend((n, INF) for n in self.tree.walk(root))
            self._universe = out
        return self._universe

    def candidates(self, at: float) -> set[str]:
        """Names that may hold something at point ``at`` (a superset; ask state())."""
        got = self._candidates.get(at)
        if got is None:
            got = set()
            for name, valid in self._universe_names():
                for m in (self.map_name(name, valid, at), name):
                    if m is not None and m not in got:
                        got.add(m)
                        parent = m.rpartition("/")[0]
                        while parent and parent not in got:
                            got.add(parent)
                            parent = parent.rpartition("/")[0]
            self._candidates[at] = got
        return got

    def descendants(self, d: str, at: int) -> list[str]:
        """The paths beneath directory ``d`` that held something at point ``at``."""
        return sorted(c for c in self._beneath_candidates(d, at) if self.state(c, at).present)

    def _beneath_candidates(self, d: str, at: int):
        """Names beneath ``d`` that may hold something at ``at`` (a superset)."""
        moved = self._moved_sets().get((d, at))
        return moved if moved is not None else (c for c in self.candidates(at) if _under(c, d))

    def _moved_sets(self) -> dict[tuple[str, int], set[str]]:
        """``candidates(at)`` beneath each directory a rename moves, just before it (what
        ``moved_with`` and ``all_names`` ask), for every rename at once.

        One sweep up the renames carries the names valid before each (mapped forward), one
        down carries those valid after (mapped back); each rename moves only the names beneath
        its two directories, a range of the sorted names.  Mapping every name to each rename's
        point instead was names x renames (minutes for a session that renames thousands of
        directories, as installers do)."""
        if self._moved_by is not None:
            return self._moved_by
        rs = self.renames()
        n = len(rs)
        by_interval: list[list[str]] = [[] for _ in range(n + 1)]
        for name, valid in self._universe_names():
            by_interval[n if valid == INF else self._index().upto(valid)].append(name)
        raw = sorted(name for name, _ in self._universe_names())
        sides = [[r["src"], r["dst"]] if r.get("flags", 0) & 2 else [r["src"]] for r in rs]
        out: dict[tuple[str, int], set[str]] = {}

        def take(names: list[str], k: int) -> None:
            for d in sides[k]:
                got = out.setdefault((d, rs[k]["seq"] - 1), set())
                for c in _beneath(names, d):
                    got.add(c)
                    parent = c.rpartition("/")[0]
                    while parent != d and parent not in got:
                        got.add(parent)
                        parent = parent.rpartition("/")[0]

        fwd: list[str] = []
        for k in range(n):  # names valid before rename k, as named just before it
            _add_sorted(fwd, by_interval[k])
            take(fwd, k)
            take(raw, k)
            fwd = _move(fwd, rs[k]["src"], rs[k]["dst"], bool(rs[k].get("flags", 0) & 2))
        back: list[str] = []
        for k in range(n - 1, -1, -1):  # names valid after it, named back to just before it
            _add_sorted(back, by_interval[k + 1])
            back = _move(back, rs[k]["dst"], rs[k]["src"], bool(rs[k].get("flags", 0) & 2))
            take(back, k)
        self._moved_by = out
        return out

    def all_names(self) -> list[str]:
        """Every name a path had at some point of the record: the paths the events name, and
        both names of everything beneath a directory when a rename moved it."""
        if self._names is None:
            names = set(self.j.paths())
            for r in self.renames():
                sides = [(r["src"], r["dst"])]
                if r.get("flags", 0) & 2:
                    sides.append((r["dst"], r["src"]))
                for a, b in sides:
                    # a name and its moved name both known already add nothing, so only
                    # the others are asked whether they held something: a directory moved
                    # back and forth with files made and removed beneath it asked every
                    # name at every rename (names x renames states)
                    for c in self._beneath_candidates(a, r["seq"] - 1):
                        moved = b + c[len(a):]
                        if (c not in names or moved not in names) and \
                                self.state(c, r["seq"] - 1).present:
                            names.add(c)
                            names.add(moved)
            self._names = sorted(names)
        return self._names

    def moved_with(self, ev: dict) -> list[tuple[str, str]]:
        """For a directory rename event: (old name, new name) of every path that moved."""
        if not is_dir_rename(ev):
            return []
        sides = [(ev["path"], ev["path2"])]
        if ev.get("flags", 0) & 2:
            sides.append((ev["path2"], ev["path"]))
        return [(c, b + c[len(a):]) for a, b in sides
                for c in self.descendants(a, ev["seq"] - 1)]

    def history(self, path: str, at: float = INF) -> list[tuple[str, float, float]]:
        """The names ``path`` (as named at ``at``) had, newest first: (name, from, to) points,
        following its ancestors' renames back."""
        return list(self._walk(path, at))

    def _walk(self, path: str, at: float = INF):
        """``history(path, at)``, one name at a time."""
        rs = self.renames()
        if not rs:  # one name all along
            yield path, 0, at
            return
        name, t = path, at
        hi = len(rs) if t == INF else self._index().upto(t)
        while True:
            j, before = self._link(name, hi)
            if j is None:
                yield name, 0, t
                return
            yield name, rs[j]["seq"], t
            if before is None:  # new here, beneath the source: earlier holders moved away
                return
            name, t, hi = before, rs[j]["seq"] - 1, j

    def _link(self, name: str, hi: int) -> tuple[int | None, str | None]:
        """One step of a path history: the last of the first ``hi`` renames that touches
        ``name`` (None: none does) and what ``name`` was called just before it (None: it is
        new there, beneath the source that moved away)."""
        key = (name, hi)
        got = self._links.get(key)
        if got is None:
            i = self._index().touching(name, 0, hi, last=True)
            if i is None:
                got = (None, None)
            else:
                r = self.renames()[i]
                if _under(name, r["dst"]) or (r.get("flags", 0) & 2 and _under(name, r["src"])):
                    got = (i, _back(name, r))
                else:
                    got = (i, None)
            self._links[key] = got
        return got

    def _holding_from(self, name: str, hi: int, marks: bool) -> tuple[str, int] | None:
        """The first step of a path history, at or before the name ``name`` held up to the
        ``hi``-th rename (exclusive), whose name has events in its span (``marks``: seals
        too); None when none has.  A directory renamed back and forth thousands of times
        gives its files histories as long: every reader that looks back for a file's last
        event walked all of it, for every point it asked (quadratic, a hunt found); the answer
        is kept for every step the walk passed."""
        rs = self.renames()
        passed = []
        node: tuple[str, int] | None = (name, hi)
        while node is not None:
            key = (node[0], node[1], marks)
            if key in self._holds:
                node = self._holds[key]
                break
            passed.append(key)
            nm, h = node
            j, before = self._link(nm, h)
            lo = 0 if j is None else rs[j]["seq"]
            chain = self.chain_on(nm)
            seqs = self._seqs_of(nm, chain)
            k = bisect.bisect_right(seqs, lo)
            top = bisect.bisect_right(seqs, rs[h]["seq"] - 1)
            if any(marks or e["op"] not in MARK_OPS for e in chain[k:top]):
                break
            node = None if j is None or before is None else (before, j)
        for key in passed:
            self._holds[key] = node
        return node

    def _walk_holding(self, path: str, at: float, marks: bool = False):
        """The steps of ``_walk(path, at)`` whose names have events in their spans
        (``marks``: seals too), newest first."""
        rs = self.renames()
        if not rs:
            yield path, 0, at
            return
        j, before = self._link(path, len(rs) if at == INF else self._index().upto(at))
        yield path, 0 if j is None else rs[j]["seq"], at
        if j is None or before is None:
            return
        node = self._holding_from(before, j, marks)
        while node is not None:
            nm, h = node
            j, before = self._link(nm, h)
            yield nm, 0 if j is None else rs[j]["seq"], rs[h]["seq"] - 1
            if j is None or before is None:
                return
            node = self._holding_from(before, j, marks)

    def _events_back(self, path: str, after: int, marks: bool = False):
        """(event, the name it was on) of ``path`` (as named at ``after``) at or before
        ``after``, newest first, through its earlier names (``marks``: seals too)."""
        for name, lo, hi in self._walk_holding(path, after, marks):
            chain = self.chain_on(name)
            seqs = self._seqs_of(name, chain)
            for k in range(bisect.bisect_right(seqs, min(hi, after)) - 1, -1, -1):
                e = chain[k]
                if e["seq"] <= lo:
                    break
                if marks or e["op"] not in MARK_OPS:
                    yield e, name

    # -- the end of a chain: seals and drift ----------------------------------------------------
    def _governing_seal(self, path: str) -> dict | None:
        """The seal that ends ``path``'s chain now, following its names back; None when its
        last epoch is open (or it was never sealed): then the live tree is the end."""
        if not self.renames():  # one name all along: its whole chain is its own
            chain = self.chain_on(path)
            return chain[-1] if chain and chain[-1]["op"] == "seal" else None
        for e, _ in self._events_back(path, INF, marks=True):
            return e if e["op"] == "seal" else None
        return self._unseen_beneath(path)

    def _unseen_beneath(self, path: str) -> dict | None:
        """For a name with no event of its own: the seal that says it was absent at the
        record's end, when a directory above it has its last seal made with everything
        beneath sealed too (``beneath``: an unmount's, of a directory renamed while mounted);
        None when none has.  A file made beneath while unmounted was taken for one the
        directory held all along: a revert of the rename moved it back with the call's,
        and a replay before the rename held it (found by a bug hunt)."""
        d = path.rpartition("/")[0]
        while d:
            got = self._beneath.get(d, False)
            if got is False:
                got = self._beneath[d] = self._beneath_rule(d)
            if got == "up":
                d = d.rpartition("/")[0]
                continue
            return None if got is None else dict(got, path=path)
        return None

    def _beneath_rule(self, d: str):
        """beneath_rule of directory ``d``, its history followed back through its names: a
        seal saying absent (True), None (the live tree says) or "up"."""
        got = beneath_rule(self._events_back(d, INF, marks=True))
        if got == "up":
            return got
        if got is False:
            return None
        # the seq of the directory's seal that said so: ``source`` answers (name, pre, seq),
        # and `export git` failed on a seal without one (KeyError, found by a bug hunt)
        seq = next((e["seq"] for e, _ in self._events_back(d, INF, marks=True)
                    if e["op"] == "seal" and "beneath" in e), None)
        return {"op": "seal", "path": d, "pre": {"kind": "absent"}, "seq": seq}

    def _tail(self, path: str) -> State:
        seal = self._governing_seal(path)
        live, lst = self.tree.state_stat(path)
        if seal is None:
            if self.tree.reads is not None and self.tree.served and live.kind == "file":
                self.tree.reads.open_end = True  # maybe an open epoch's: no answer is kept
            if self.left_open and path and path.split("/", 1)[0] != ATTIC:
                # (an attic entry is the record's own keeping of a pre-image, not an end)
                self.open_ends.add(path)
                return live.but(exact=False)
            return live
        pre = seal["pre"]
        if path == "" and pre["kind"] == "absent":
            return live  # the root as older records sealed it: absent (a bug, now mended)
        if pre.get("withheld"):  # the record ends withheld, whatever the live file holds
            st = self.sealed_state(pre)
            return st if preimage.matches(pre, lst) else st.but(drifted=True)
        if path in self.tree.unreadable:
            # what it holds cannot be read here: the seal says what it is while its stat is
            # the seal's, a file's ctime included (no write leaves that as it was); where it
            # cannot be reached (UNREACHED), or its stat moved, the record ends at the seal
            st = self.sealed_state(pre)
            if lst is not None and preimage.matches(pre, lst) and \
                    (pre["kind"] != "file" or pre.get("ctime_ns") == lst.st_ctime_ns):
                return st
            return st.but(drifted=True)
        if preimage.matches(pre, lst,
                            lambda: os.fsdecode(live.data),
                            lambda: digest_of(live.data)):
            return live
        return self.sealed_state(pre).but(drifted=True)

    def sealed_state(self, pre: dict) -> State:
        """The state a seal (a full pre-image) records; inexact when its content was not kept."""
        kind = pre["kind"]
        if kind == "absent":
            return ABSENT
        if kind == "file":
            if pre.get("withheld"):
                return State("file", pre.get("mode", 0o644), b"", exact=False, withheld=True,
                             **facts(pre))
            if "blob" in pre:
                # State(..., **facts(pre)) without the dict, as _sig_of: a diff's side is
                # mostly these
                return State("file", pre.get("mode", 0o644), self._load(pre["blob"]),
                             True, pre.get("uid"), pre.get("gid"), 0, False,
                             pre.get("ino") or 0, pre.get("nlink") or 1)
            return State("file", pre.get("mode", 0o644), b"", exact=False, **facts(pre))
        if kind == "symlink":
            return State("symlink", 0o120000, os.fsencode(pre.get("target") or ""), **facts(pre))
        return State(kind, pre.get("mode", 0o755 if kind == "dir" else 0), **facts(pre))

    def _load(self, digest: str) -> bytes | Large:
        """A blob's content: its bytes, or past the size a reader holds (engines.large) a
        Large that reads the blob when it is written; checked against its name either way."""
        return load(self.j.content, digest)

    def drifted(self, path: str) -> bool:
        """Does the live ``path`` differ from what the record ends with?  (Stat first; the
        content is read only when size or mtime changed.)"""
        seal = self._governing_seal(path)
        if seal is None:
            return False
        lst = self.tree.lstat(path)
        if self.tree.unreadable.get(path) == UNREACHED_NOTE:
            return False  # not known to differ (readers say which paths they could not reach)
        return not preimage.matches(seal["pre"], lst,
                                    lambda: os.fsdecode(self.tree.state(path).data),
                                    lambda: digest_of(self.tree.state(path).data))

    def drift(self, paths=None) -> list[str]:
        """The sealed paths (or those of ``paths``) whose live state departs from their seal;
        without ``paths``, also the names made beneath a directory whose mark says all
        beneath it was sealed (``beneath``), which the next mount journals as drift (they
        were left out: `status` and `diff --drift` disagreed with it, found by a bug hunt)."""
        if paths is None:
            sealed = {self.map_name(p, seq, INF): seq for p, seq in self.j.seals()}
            sealed.pop(None, None)
            paths = set(sealed)
            for top in outermost(p for p, seq in sealed.items() if self._marked_dir(p, seq)):
                paths.update(n for n in self.tree.walk(top) if n not in sealed)
        out = []
        last = self.j.last_seq()
        for p in sorted(paths):
            if p.split("/", 1)[0] == ATTIC:
                continue
            if self._next_move(p, last) is None and self.drifted(p):
                out.append(p)
        return out

    def _marked_dir(self, path: str, seq: int) -> bool:
        """Is ``path``, sealed at ``seq`` as a directory, one whose history says every name
        beneath it was sealed (schema.beneath_rule)?"""
        e = self.j.event(seq)
        if e is None or (e.get("pre") or {}).get("kind") != "dir":
            return False
        got = self._beneath.get(path, False)
        if got is False:
            got = self._beneath[path] = self._beneath_rule(path)
        return isinstance(got, dict)

    # -- state ----------------------------------------------------------------------------------
    def state(self, path: str, after: int, forward: bool = True) -> State:
        """The state of ``path`` after event ``after`` (and before any later one)."""
        key = (path, after, forward)
        if key not in self._cache:
            for k in reversed(self._moves_ahead(path, after, self._cache)):
                # the deepest first: each then finds the next in the cache
                self._cache[k] = self.whole_chains(self._state_now, *k, True)
            self._cache[key] = self.whole_chains(self._state_now, path, after, forward)
        return self._cache[key]

    def _moves_ahead(self, path: str, after: int, known: dict) -> list[tuple[str, int]]:
        """(name, point) of each state that ``state(path, after)`` asks in turn where a
        directory rename moves the path before its next event (``_beyond``), up to the first
        in ``known``.  Asked one inside the other, a directory renamed back and forth
        thousands of times was as many frames deep (a RecursionError, a hunt found)."""
        out = []
        if not self.renames():
            return out
        while (move := self._next_move(path, after)) is not None:
            chain = self.chain_on(path)
            seqs = self._seqs_of(path, chain)
            if bisect.bisect_right(seqs, after) < bisect.bisect_left(seqs, move["seq"]):
                break  # an event of its own first
            new = _fwd(path, move)
            if new is None:
                break
            path, after = new, move["seq"]
            if (path, after, True) in known or (path, after) in known:
                break
            out.append((path, after))
        return out

    def _state_now(self, path: str, after: int, forward: bool) -> State:
        st = self._state(path, after, forward)
        if st.exact and self._may_change_unseen(path, after):
            st = st.but(exact=False)
        if st.kind == "file" and (st.withheld or self.secrets.match_at(path, after)):
            st = self._withheld(path, after, st)
        return st

    def sig(self, path: str, after: int) -> State:
        """What ``State.same`` compares of ``state(path, after)``, with a file's content as its
        hash: from the stored hashes (a pre-image's blob, a seal's hash) wherever the record has
        one, so a listing compares two points of 100,000 paths without reading them.  The end
        of a sealed chain is the seal's content, drifted or not (the record's end); exactness
        is not kept.  Anything else (inside an epoch, content completed from the attic or from
        ranges, an open epoch, a secret) is the full state, hashed."""
        key = (path, after)
        got = self._sigs.get(key)
        if got is None:
            for k in reversed(self._moves_ahead(path, after, self._sigs)):
                self.sig(*k)  # the deepest first, as state()
            got, settled = self.whole_chains(self._sig, path, after)
            if got is None:
                got = _hashed(self.state(path, after))
            if not settled:
                self._unsettled.add(key)
            self._sigs[key] = got
        return got

    def settled(self, path: str, after: int) -> bool:
        """Is ``sig(path, after)`` settled for good: read from an event after ``after`` (which
        later events cannot change), not from the live tree or an open epoch?"""
        self.sig(path, after)
        return (path, after) not in self._unsettled

    def _sig(self, path: str, after: int) -> tuple[State | None, bool]:
        if self.secrets.match(path):
            return None, False
        if self._short(path, after):
            raise _Partial(path)
        move = self._next_move(path, after)
        for e in self.chain_on(path):
            if e["seq"] <= after:
                continue
            if move is not None and e["seq"] >= move["seq"]:
                break
            pre = self.pre_for(e, path)
            if pre is None or "kind" not in pre:
                return None, False
            got = self._sig_of(pre, seal=e["op"] == "seal")
            return got, got is not None
        if move is not None:
            new = _fwd(path, move)
            if new is None:
                return ABSENT, True
            return self.sig(new, move["seq"]), self.settled(new, move["seq"])
        seal = self._governing_seal(path)
        if seal is None:
            return None, False
        # for good: the next event on the path, when one comes, takes its pre-image from what
        # the seal holds (a drift event's is the seal itself)
        got = self._sig_of(seal["pre"], seal=True)
        return got, got is not None

    def _sig_of(self, pre: dict, seal: bool) -> State | None:
        """A stored pre-image's or seal's State with a file's content as its hash; None when
        the record keeps neither the content nor its hash there."""
        if pre["kind"] != "file":
            return self.sealed_state(pre)  # no content to read
        digest = pre.get("blob") or (pre.get("hash") if seal else None)
        if digest is None or pre.get("withheld"):
            return None
        # as State("file", mode, digest, **facts(pre)), without the dict: a listing makes
        # two of these for every path it compares
        return State("file", pre.get("mode", 0o644), digest.encode(), True, pre.get("uid"),
                     pre.get("gid"), 0, False, pre.get("ino") or 0, pre.get("nlink") or 1)

    def _may_change_unseen(self, path: str, after: int) -> bool:
        """Writes after a handle's first one are not events (unless the journal records data):
        a point inside a run that wrote this way (before its handle was released, or before
        its unit ended for a journal that does not say) is not exact.  The run may have begun
        under an earlier name of the path (its directory renamed since)."""
        if path in self._partial and after >= self.floor:
            # what is left out lies before the floor: needed only when nothing after says
            recent = itertools.takewhile(lambda x: x[0]["seq"] > self.floor,
                                         self._events_back(path, after))
            if not any(starts_run(e) or self.starts_epoch(e, name) for e, name in recent):
                raise _Partial(path)
        elif self._short(path, after):
            raise _Partial(path)
        if next(self._events_back(path, after), None) is None:
            return False
        nxt = next((e for e in self.chain_on(path) if e["seq"] > after), None)
        if nxt is not None and nxt["seq"] == after + 1:
            pre = self.pre_for(nxt, path)
            # "just before that event": its pre-image, taken then, is exact; but a linked file
            # renamed away keeps no content in it, and a write run through another of its names
            # goes on changing it unseen (asked below)
            if pre is not None and "kind" in pre and not (
                    (pre.get("nlink") or 1) > 1 and _moves_away(nxt, path)):
                return False
        for e, name in self._events_back(path, after):
            if starts_run(e):
                break
            if e["op"] == "alias":
                # another name of the inode began a write run: its later writes change this
                # name too, unseen here
                run = self._alias_run(e)
                if run is not None:
                    e = run
                    break
            if self.starts_epoch(e, name):
                return False
        else:
            return False
        summary = self.j.extents(e["seq"])
        if summary is not None and "end" in summary and (summary["end"] < after or (
                summary.get("writes", 2) <= 1 and
                ("run" not in e or summary["end"] <= after))):
            # the run ended before ``after``; or its only write was the event; or it was
            # begun by a create or a truncating open with one write at most, made before any
            # other event (``end``: the opening event's own seq): that point is the file with
            # that write
            return False
        end = self._unit_ends().get(e.get("unit") or "")
        if end is not None and e["seq"] < end:
            return end > after  # its unit's end sealed the path: the run ended there
        if self._sealed_since(path, e["seq"], after):
            # a closing seal of the path after the run began (the one a mount's start makes of
            # what a killed daemon left open): the run, with no release and no unit end, ended
            return False
        # a run not ended by its unit's end: still going, or begun through a descriptor opened
        # in a call that had ended (its writes belong to that call; no end seals them)
        return True

    def settle(self, path: str, after: int) -> int:
        """The point at which to read what the changes up to ``after`` left in ``path``:
        ``after`` itself, or a later point when ``after`` falls inside a write run (its later
        writes are no events) whose release was noted (extents ``end``) before the path's
        next event: the first point after that release, where the same content is exact.  A
        call's diff and a revert read a path there (the call's last event on it may be the
        run's first write, or a chmod the run wrote on after): the content is the same, taken
        once the writes were done.  ``after`` when no such point is known (the run still open,
        or released after the path's next event), and when a directory rename moved or
        replaced an ancestor of the path after the run began, up to that point (the name then
        held another file, or the run went on under another name: not followed here)."""
        if self.state(path, after).exact:
            return after
        run = self._run_at(path, after)
        if run is None:
            return after
        summary = self.j.extents(run["seq"])
        nxt = next((e for e in self.chain_on(path) if e["seq"] > after), None)
        if summary is None or not isinstance(summary.get("end"), int):
            # no release noted, but the path's next event a seal (the one a mount makes of
            # what a killed daemon left open, under the name the file has then): the run
            # ended there, and the seal is exact
            if nxt is None or nxt["op"] != "seal" or not nxt.get("closing"):
                return after
            return nxt["seq"] if self.state(path, nxt["seq"]).exact else after
        else:
            point = summary["end"] + 1
            if point <= after or (nxt is not None and nxt["seq"] <= point):
                return after
        rs = self.renames()
        if rs:  # the name's own events are the file's only since the last move of the name
            idx = self._index()
            i = idx.touching(path, 0, idx.upto(point), last=True, itself=True)
            if i is not None and rs[i]["seq"] > run["seq"]:
                return after
        return point if self.state(path, point).exact else after

    def _run_at(self, path: str, after: int) -> dict | None:
        """The write that began the run ``path`` was in at ``after``: its last write event
        at or before it, or, when that is an ``alias`` (the file's other name the kernel
        named the write by: a hard link), the run of that name the alias came with; None when
        an epoch with no run in it began since.  Followed through the path's earlier names
        (its directory renamed while the run went on)."""
        for e, name in self._events_back(path, after):
            if starts_run(e):
                return e
            if e["op"] == "alias":
                run = self._alias_run(e)
                return run if run is not None and "data" not in run else None
            if self.starts_epoch(e, name):
                return None  # an epoch with no run in it
        return None

    def still_writing(self, path: str, after: int) -> bool:
        """Is ``path`` inexact at ``after`` because the write run it was in then has not
        ended yet (no release noted: a descriptor is still open on it)?"""
        run = self._run_at(path, after)
        return run is not None and self.j.extents(run["seq"]) is None and \
            not self._sealed_since(path, run["seq"], after)

    def _sealed_since(self, path: str, lo: int, after: int) -> bool:
        """Was ``path`` (as named at ``after``) sealed after ``lo`` and at or before ``after``
        by a closing seal (an unmount's, or the mount's after a killed daemon: no descriptor
        outlives it)?  A unit's end seals what the unit left while its descriptors may write
        on (their later writes are its own still)."""
        for x, _ in self._events_back(path, after, marks=True):
            if x["seq"] <= lo:
                return False
            if x["op"] == "seal" and x.get("closing"):
                return True
        return False

    def _alias_run(self, alias: dict) -> dict | None:
        """The write an ``alias`` event was committed with (the next event of its source, in
        the same commit) when that write began a run; None for any other change.  (A journal
        that records data makes every later write of the run an event of the source only: the
        alias's name is as unseen there.)"""
        src = alias.get("source")
        if src is None:
            return None
        chain = self.chain_on(src)
        i = bisect.bisect_right(self._seqs_of(src, chain), alias["seq"])
        if i < len(chain) and chain[i]["op"] == "write":
            return chain[i]
        return None

    def _withheld(self, path: str, after: int, st: State) -> State:
        """A secret file's state: its metadata, and a placeholder for the content the record
        never kept, naming the last event that changed it by then (so two points read alike
        only when nothing changed it between them)."""
        if path in self._partial:
            raise _Partial(path)
        last = 0
        for e in self.events_on(path):
            if e["seq"] > after:
                break
            last = e["seq"]
        return st.but(data=placeholder(last), exact=False, withheld=True)

    def _unit_ends(self) -> dict[str, int]:
        if self._ends is None:
            ends = {}
            for c in self.j.records("calls"):
                if c.get("end_seq"):
                    ends[call_unit(c["session"], c["id"])] = c["end_seq"]
            for t in self.j.records("turns"):
                if t.get("end_seq"):
                    ends[turn_unit(t["session"], t["index"])] = t["end_seq"]
            for e in self.j.events_of(("session_end", "revert_end")):
                if e["op"] == "session_end":  # (as of: ended by a later daemon)
                    ends[session_unit(e["session"])] = e.get("as_of") or e["seq"]
                else:
                    ends[revert_unit(e["revert"])] = e["seq"]
            self._ends = ends
        return self._ends

    def _state(self, path: str, after: int, forward: bool = True) -> State:
        if self._short(path, after):
            raise _Partial(path)
        chain = self.chain_on(path)
        seqs = self._seqs_of(path, chain)   # a chain is in seq order: bisect, not a scan
        if "/" in path and (self.renames() or not seqs or seqs[0] > after) and \
                self._parent_absent(path, after):
            # there only while its directory is: a directory the user renamed back while
            # unmounted (its drift from absent journaled) had its files put back into the
            # points between, exact, from their next pre-image or the live tree (found by a
            # bug hunt); a file the user replaced by a directory while unmounted, a file
            # made in it then and written by a later session, was put into the first
            # session's points, the directory with it (a hunt).  (A name with an event of its
            # own by then, without directory renames, is said by its own events.)
            return ABSENT
        move = self._next_move(path, after)
        allevs = chain if move is None else chain[:bisect.bisect_left(seqs, move["seq"])]
        evs = allevs[bisect.bisect_right(seqs, after, 0, len(allevs)):]
        if evs and forward:
            pre = self.pre_for(evs[0], path)
            if pre is None or "kind" not in pre:
                # inside an epoch: exact only if the journal holds the data of every write
                fwd = self._forward(path, after, [e for e in allevs if e["op"] not in MARK_OPS])
                if fwd is not None:
                    return fwd
        exact = True
        for i, e in enumerate(evs):
            pre = self.pre_for(e, path)
            if pre is None or "kind" not in pre:
                exact = False  # inside an epoch: the next full pre-image is later than asked
                continue
            s = self._from_pre(path, e, pre, evs[i:], move)
            return s if exact else s.but(exact=False)
        end = self._beyond(path, move)
        return end if exact else end.but(exact=False)

    def _parent_absent(self, path: str, after: int) -> bool:
        """Was a directory above ``path`` absent (or not a directory) after ``after``: does the
        next event of the nearest one with an event then (before a rename of one of its own
        directories) take it as absent (or a file, a symlink) just before (a drift from absent, a mkdir, a rename onto it), with no
        event of the path's own coming first?  Each directory's own chain only (a bisect):
        asking a directory's whole state, and its directories', for every path made a report
        of a path 1,000 directories deep take minutes; each directory's answer is kept."""
        verdict = self._next_of_dirs(path.rpartition("/")[0], after)
        if verdict is None or not verdict[1]:
            return False
        # an event of the path's own before that says what it held then: the directory was
        # there (removed and made anew by a rename onto its name since, and the changes of a
        # session before were taken for changes of nothing, a hunt found)
        own = self.chain_on(path)
        k = bisect.bisect_right(self._seqs_of(path, own), after)
        return k == len(own) or own[k]["seq"] > verdict[0]

    def _next_of_dirs(self, d: str, after: int) -> tuple[int, bool] | None:
        """(seq, absent just before it) of the next event after ``after`` of the nearest of
        ``d`` and the directories above it that has one (before a rename of its own
        directories: then (seq, False), the rule does not reach past it); None when none has.
        A grandchild was read as there after ``mv d e`` and ``mv e d`` while unmounted (only
        the immediate directory was asked; found by a bug hunt)."""
        walked, got = [], None
        while d:
            key = (d, after)
            if key in self._dirs_next:
                got = self._dirs_next[key]
                break
            walked.append(key)
            chain = self.chain_on(d)
            seqs = self._seqs_of(d, chain) if chain else []
            i = bisect.bisect_right(seqs, after)
            if i < len(chain):
                move = self._next_move(d, after)
                if move is not None and chain[i]["seq"] >= move["seq"]:
                    got = (chain[i]["seq"], False)
                else:
                    # absent, or not a directory (a file, a symlink): nothing was beneath it
                    pre = self.pre_for(chain[i], d)
                    got = (chain[i]["seq"], pre is not None and
                           pre.get("kind") not in (None, "dir"))
                break
            d = d.rpartition("/")[0]
        for key in walked:
            self._dirs_next[key] = got
        return got

    def _partner_state(self, path: str, at: int, ino: int | None) -> State | None:
        """The exact state at ``at`` of a name linked with ``path`` (a ``link`` or ``alias``
        event names the two) that holds the inode ``ino`` then; None when there is none.
        Asked only where an attic entry no longer holds what its inode held (rare): the links
        are read from the journal then."""
        if not ino or (path, at) in self._partners_asked:
            return None  # a partner's own chain that leads back here
        self._partners_asked.add((path, at))
        try:
            seen = set()
            for ev in self.j.events_of(("link", "alias"), 1, at):
                names = {ev.get("path"), ev.get("source")}
                if path not in names:
                    continue
                for other in names - {path, None} - seen:
                    seen.add(other)
                    st = self.state(other, at)
                    if st.kind == "file" and st.ino == ino and st.exact:
                        return st
            return None
        finally:
            self._partners_asked.discard((path, at))

    def stored_since(self, e: dict, path: str) -> dict | None:
        """The pre-image of ``path`` in event ``e`` as the journal holds it now, when it
        names a blob where ``e`` (as this reader read it) named an attic entry: the daemon
        copies small pre-images from the attic into the store when it is idle, then drops
        the entry (Recorder.settle_small)."""
        fresh = self.j.event(e["seq"], fresh=True)
        pre = self.pre_for(fresh, path) if fresh is not None else None
        return pre if pre is not None and "blob" in pre and "attic" not in pre else None

    def _sealed_as_left(self, path: str, seq: int, pre: dict) -> State | None:
        """The state of ``path``'s last event before ``seq`` when it is a seal that kept the
        content of the very inode ``pre`` records, with the size and mtime it had as it left
        (so nothing wrote it since, through any name); else None."""
        if pre.get("mtime_ns") is None or not pre.get("ino"):
            return None
        last = None
        for ev in self.chain_on(path):
            if ev["seq"] >= seq:
                break
            last = ev
        if last is None or last["op"] != "seal":
            return None
        sp = self.pre_for(last, path)
        if sp is None or sp.get("kind") != "file" or "blob" not in sp or \
                (sp.get("ino"), sp.get("size"), sp.get("mtime_ns")) != \
                (pre.get("ino"), pre.get("size"), pre.get("mtime_ns")):
            return None
        return self.sealed_state(sp)

    def _attic_as_left(self, pre: dict) -> bool:
        """Does the attic entry of ``pre`` still have the size and mtime its inode had when
        it left the path?"""
        st = self.tree.lstat(f"{ATTIC}/{pre['attic']}")
        return st is not None and st.st_size == pre.get("size") and \
            st.st_mtime_ns == pre.get("mtime_ns")

    def _from_pre(self, path: str, e: dict, pre: dict, later: list[dict],
                  move: dict | None) -> State:
        kind = pre["kind"]
        if kind == "absent":
            return ABSENT
        if kind != "file" or "blob" in pre or pre.get("withheld"):
            # (a directory changed while no daemon recorded, after a kill: what it was, what
            # lay beneath it, not known: Recorder._seal_some)
            return self.sealed_state(pre).but(exact=False) if pre.get("unkept") else \
                self.sealed_state(pre)
        mode = pre.get("mode", 0o644)
        if "attic" in pre and e["op"] in ("unlink", "rename") and not \
                (e["op"] == "rename" and e.get("path") == path):
            # as the entry was just after the event: a write through a descriptor still open
            # on the file lands on the entry later, an event of its own on the attic's path
            entry = f"{ATTIC}/{pre['attic']}"
            kept = self.state(entry, e["seq"])
            if entry in self.tree.unreadable:  # said of the path it stands for
                self.tree.unreadable.setdefault(path, self.tree.unreadable.pop(entry))
            data = kept.data if kept.kind in ("file", "symlink") else None
            if data is not None:
                s = State("file", mode, data, kept.exact, **facts(pre))
                # an inode that kept other names when it left this one (content past the
                # whole-file limit is not copied then): a write through those since changed
                # the attic's copy too, which its size and mtime tell.  Such a write saved
                # what it destroyed under the name it went through: that name's state then
                # is this one's
                if not s.exact or self._attic_as_left(pre):
                    return s
                if pre.get("nlink", 1) < 2:
                    # the entry was the inode's one name: only a descriptor still open on it
                    # writes it since, in its own chain (then ``kept`` is read from that);
                    # else it was changed around the record (by hand, a tool walking hidden
                    # directories), and what it holds now is not what the path held
                    written = any(ev["seq"] > e["seq"] for ev in self.events_on(entry))
                    if written or "mtime_ns" not in pre:
                        return s
                    stored = self.stored_since(e, path) if \
                        self.tree.lstat(f"{ATTIC}/{pre['attic']}") is None else None
                    # (gone since it was read: the daemon, idle, copied it into the store and
                    # let it go; the copy, checked against the entry as it left, says)
                    return self.sealed_state(stored) if stored is not None else \
                        s.but(exact=False)
                other = self._partner_state(path, e["seq"] - 1, pre.get("ino"))
                return s.but(exact=False) if other is None else \
                    State("file", mode, other.data, True, **facts(pre))
            stored = self.stored_since(e, path)
            if stored is not None:  # copied into the store after this reader read the event
                return self.sealed_state(stored)
            # the entry is gone (dropped to free space: a ``reclaim`` marker; or removed by
            # hand): a seal that kept the inode's content as it left the path says what it
            # held, else nothing does, so never guess it
            sealed = self._sealed_as_left(path, e["seq"], pre)
            if sealed is not None:
                return sealed
            return State("file", mode, b"", exact=False, **facts(pre))
        if e["op"] == "rename" and (e.get("path") == path or _exchanged(e, path)):
            s = self._moved(path, e)
            return s.but(mode=mode, **facts(pre)) if s.kind == "file" else s
        if pre.get("unkept") and e["op"] == "alias" and e.get("source"):
            # the inode this name shared with ``source`` was changed through that name, whose
            # own pre-images kept what it destroyed: what this name held just before is what
            # the source held then (the same inode), not whatever the inode holds later
            src = self.state(e["source"], e["seq"] - 1)
            if src.kind == "file" and src.ino and src.ino == pre.get("ino"):
                return State("file", mode, src.data, src.exact, **facts(pre))
        # a drift's pre-image is the seal it departed from; one without its content (a file
        # past the whole-file limit) does not say what the file held, and the live file after
        # it holds the change made outside the record: never taken as exact
        unkept = pre.get("unkept") or e["op"] == "drift"
        # content saved later in the epoch, or unchanged until the epoch's end
        ranges = list(pre.get("ranges", []))
        end_after = None
        for f in later[1:]:
            if self.starts_epoch(f, path) or f["op"] in ("unlink", "rmdir") or \
                    (f["op"] == "rename" and (f.get("path") == path or f.get("path2") == path)):
                end_after = f["seq"] - 1
                break
            fp = self.pre_for(f, path)
            if fp and fp.get("facet") == "content":
                if fp.get("withheld"):
                    return self.sealed_state(dict(pre, withheld=True))
                if "blob" in fp:
                    return State("file", mode, self._load(fp["blob"]), **facts(pre))
                ranges.extend(fp.get("ranges", []))
        end = self.state(path, end_after) if end_after is not None else self._beyond(path, move)
        size = pre.get("size", len(end.data))
        if isinstance(end.data, Large) or not holds(size):
            data = Large(size, source(end.data), [(off, source(self._load(digest)))
                                                  for off, _, digest in ranges])
            return State("file", mode, data, end.exact and not unkept, **facts(pre))
        data = bytearray(end.data[:size].ljust(size, b"\0"))
        for off, length, digest in ranges:
            data[off:off + length] = self._load(digest)
        data = bytes(data)
        # an alias whose content was not kept (a file past the whole-file limit): the inode
        # changed at once through the other name, so the later state is not this one's
        exact = end.exact and not unkept
        if not exact and e["op"] == "seal" and pre.get("hash") and \
                digest_of(data) == pre["hash"]:
            # what the seal hashed as it sealed, though read off a later state (a file past
            # the whole-file limit renamed, then appended to: nothing saved what it held)
            exact = True
        return State("file", mode, data, exact, **facts(pre))

    def _forward(self, path: str, after: int, evs: list[dict]) -> State | None:
        """Replay forward from the last full pre-image at or before ``after`` (full-fidelity
        journals: every write carries its data); None when an event cannot be replayed."""
        start = None
        # events of the name before a directory rename brought this object to it were another
        # object's (path history): the replay starts after that
        since = next(self._walk(path, after))[1]
        for i, e in enumerate(evs):
            if e["seq"] > after:
                break
            pre = self.pre_for(e, path)
            if pre is not None and "kind" in pre and e["seq"] > since:
                start = i
        if start is None:
            if path in self._partial:
                raise _Partial(path)   # a full pre-image may lie before the floor
            return None
        e0 = evs[start]
        st = self._state(path, e0["seq"] - 1)
        if over_limit(st.data):
            return None   # not replayed in memory: the next full pre-image answers
        kind, mode, data = st.kind, st.mode, bytearray(whole(st.data))
        facts_of = st  # owner, inode and link count: whose they are now
        # exact as far as the content it began from is, until an event replaces it whole: the
        # writes replayed on a content the record did not keep (a file past the whole-file
        # limit whose live copy changed since) give its size around unknown bytes, not it
        exact = st.exact
        for e in evs[start:]:
            if e["seq"] > after:
                break
            op = e["op"]
            if op == "write":
                if "data" not in e:
                    return None
                chunk = whole(self._load(e["data"]))
                off = e["offset"]
                if len(data) < off:
                    data.extend(b"\0" * (off - len(data)))
                data[off:off + len(chunk)] = chunk
            elif op == "truncate":
                if "run" in e and (self.j.extents(e["seq"]) or {}).get("writes") != 0:
                    return None  # its handle's first writes joined it: no events of theirs
                size = e["size"]
                del data[size:]
                data.extend(b"\0" * (size - len(data)))
            elif op == "create":
                if "run" in e and (self.j.extents(e["seq"]) or {}).get("writes") != 0:
                    return None  # its handle's first writes joined it: no events of theirs
                kind, mode, data = "file", e.get("mode", 0o644) & 0o7777, bytearray()
                facts_of, exact = ABSENT, True
            elif op == "chmod":
                mode = e["mode"]
            elif op == "chown":
                if kind != "dir" and mode & (stat.S_ISUID | stat.S_ISGID):
                    return None  # the kernel drops set-id bits by rules of its version
                facts_of = facts_of.but(
                    uid=facts_of.uid if e.get("uid", -1) == -1 else e["uid"],
                    gid=facts_of.gid if e.get("gid", -1) == -1 else e["gid"])
            elif op == "setxattr" and e.get("name") == ACL_ACCESS:
                if e.get("mode") is None:
                    return None  # recorded before the event said the mode an ACL leaves
                mode = e["mode"]
            elif op in ("utimens", "setxattr", "removexattr"):
                pass
            elif op in ("unlink", "rmdir"):
                kind, mode, data, exact = "absent", 0, bytearray(), True
            elif op == "mkdir":
                kind, mode, data = "dir", e.get("mode", 0o755), bytearray()
                facts_of, exact = ABSENT, True
            elif op == "symlink":
                kind, mode, data = "symlink", 0o120000, bytearray(os.fsencode(e["target"]))
                facts_of, exact = ABSENT, True
            elif _exchanged(e, path):
                s2 = self.state(e["path2"] if e.get("path") == path else e["path"],
                                e["seq"] - 1)
                if not s2.exact or over_limit(s2.data):
                    return None
                kind, mode, data = s2.kind, s2.mode, bytearray(whole(s2.data))
                facts_of, exact = s2, True
            elif op == "rename" and e.get("path") == path and e.get("path2") != path:
                kind, mode, data, exact = "absent", 0, bytearray(), True
            elif op in ("rename", "link"):
                src = e["path"] if op == "rename" else e.get("source")
                if not src:
                    return None
                s2 = self.state(src, e["seq"] - 1)
                if not s2.exact or over_limit(s2.data):
                    return None
                kind, mode, data = s2.kind, s2.mode, bytearray(whole(s2.data))
                facts_of = s2 if op == "rename" else s2.but(nlink=s2.nlink + 1)
                exact = True
            else:
                return None
        if kind == "absent":
            return ABSENT
        return State(kind, mode, bytes(data), exact=exact, uid=facts_of.uid, gid=facts_of.gid,
                     rdev=facts_of.rdev, block=facts_of.block, ino=facts_of.ino,
                     nlink=facts_of.nlink)

    def _moved(self, path: str, e: dict) -> State:
        """A renamed-away file: the inode, unchanged by the rename, now at its new name (the
        other name, for either side of an exchange).  Its content is the first one the journal
        saved under the new name (the recorder saves it before the first change there, in the
        same epoch too), or what the new name holds at the end of its history."""
        new = e["path2"] if e.get("path") == path else e["path"]
        move = self._next_move(new, e["seq"])
        unsaved = False  # changed under the new name with nothing saved first
        for f in self.chain_on(new):
            if f["seq"] <= e["seq"]:
                continue
            if move is not None and f["seq"] > move["seq"]:
                # nothing under the new name before a directory of it moved: the inode is
                # followed to where that took it, as past the name's last event
                break
            pre = self.pre_for(f, new)
            if pre is None:
                if f["op"] in ("write", "truncate"):
                    unsaved = True  # (a journal from before the rename rule): inexact
                    break
                continue
            if "blob" in pre:
                return State("file", 0, self._load(pre["blob"]))
            if pre.get("facet") == "content" and "ranges" not in pre and \
                    not pre.get("withheld"):
                # the whole-file capture of an empty file keeps no blob: it held nothing
                return State("file", 0, b"")
            moved = self.pre_for(e, path)
            if "ranges" in pre and "kind" not in pre and moved is not None and \
                    moved.get("kind") == "file" and "size" in moved and \
                    not _exchanged(e, path):
                # the ranges this first change under the new name destroyed, over what the
                # epoch the rename began left: the epoch's facts are the moved file's (a file
                # past the whole-file limit renamed, then rewritten: read as its later
                # content, inexact, where the ranges kept all it held; the history model)
                later = [e] + [x for x in self.chain_on(new) if x["seq"] >= f["seq"] and
                               (move is None or x["seq"] < move["seq"])]
                facts_only = {k: v for k, v in moved.items() if k not in ("attic", "blob")}
                s = self._from_pre(new, e, facts_only, later, move)
                return State("file", 0, s.data, s.exact, drifted=s.drifted,
                             withheld=s.withheld) if s.kind == "file" else s
            if "kind" in pre or "ranges" in pre:
                s = self.state(new, f["seq"] - 1, forward=False)
                return State("file", 0, s.data, s.exact, drifted=s.drifted,
                             withheld=s.withheld) if s.kind == "file" else s
        if not unsaved:
            s = self._beyond(new, move)
            # (a secret's placeholder stays one: written as content by replay under the
            # old name, where the file went to a secret name; found by a bug hunt)
            return State("file", 0, s.data, s.exact, drifted=s.drifted,
                         withheld=s.withheld) if s.kind == "file" else s
        s = self.state(new, e["seq"], forward=False)
        return State("file", 0, s.data, False, withheld=s.withheld) if s.kind == "file" else s
