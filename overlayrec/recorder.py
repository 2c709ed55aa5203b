"""The recorder: what a mutation means, and the write-ahead order that makes it undoable.

Every mutating operation the filesystem layer receives is carried out here, in three steps:

1. find the path's *epoch* (a run of changes to one path by one attribution unit) and, at the
   epoch's first change of each kind, capture the *pre-image* the change is about to destroy;
2. commit the event (with that pre-image) to the journal;
3. only then change the underlay, and journal a ``failed`` note if the underlay refused.

Pre-images cost what the change costs: an unlinked or renamed-over file moves to the *attic*
by rename or hard link (no copy).  One of at most SMALL_PREIMAGE bytes is copied into the
content store instead (so lock-file churn costs the workspace nothing): a renamed-over one
before its event, an unlinked one when the daemon is idle, its attic entry then dropped
(``settle_small``), so an ``rm -rf`` copies nothing while it runs.
Content is copied into the store only before it is overwritten or cut, whole for small files
and range by range for large ones, so an append to a huge log copies nothing.

The attic is a directory in the underlay's root (same filesystem, so hard links work) that the
filesystem layer hides; its extra links are subtracted from ``st_nlink`` so link counts read as
native.  Unmounted, it ignores itself (a ``.gitignore`` of ``*`` and a ``CACHEDIR.TAG``), so
git and backup tools pass it by.  When the workspace's filesystem refuses a change for want of
space, the small pre-images waiting in the attic go into the store at once and the change is
tried again; still refused, attic entries are dropped oldest first (``reclaim``, journaled)
and the change is tried once more (``_roomy``).
"""
from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import re
import stat
import time
from typing import Callable

from . import state, underlay
from .attribution import Attribution
from .calls import Calls
from .journal import Journal, JournalError, outcome, preimage
from .journal.renames import RenameIndex, outermost
from .journal.schema import AROUND, UNMOUNTED, beneath_rule, outside_unit
from .secrets import Secrets, META_NAMES, public_at

log = logging.getLogger(__name__)

ATTIC_NAME = ".overlayrec-attic"
_ATTIC_SLASH = ATTIC_NAME + "/"
_READ = os.O_RDONLY | os.O_NONBLOCK  # a content-checked file looked at (never a fifo's wait)
WHOLE_FILE_LIMIT = 4 << 20  # files up to this size are saved whole at an epoch's first change
# a seal of a file past it still has its content's hash up to this many times its size (64 MiB):
# without one, a moved ctime with a moved link count was taken for the link alone, and an edit
# made with a link while unmounted, its mtime put back, went unseen (found by a bug hunt)
SEAL_HASH_FACTOR = 16
# An unlinked or renamed-over regular file of at most this size is copied into the content
# store instead of being kept by a link in the attic: lock files, editor and build temp files
# and nearly every source file are below it, so their churn costs the workspace nothing (the
# store keeps one blob per distinct content, often already there from an earlier capture), and
# such pre-images are never dropped to free space.  The bound keeps the copy cheap (``rm -rf``
# of a tree of them copies each, when the daemon is idle); larger files cost no copy.
SMALL_PREIMAGE = 256 << 10
# A file past RANGES_PAST under the whole-file limit is saved whole at its first WHOLE_COPIES
# epochs in a daemon, then by ranges (only what each change is about to lose), as files past
# the limit always are: two units writing one file by turns (two calls writing one SQLite
# WAL, a server an earlier call left running writing a log beside later calls) begin an epoch
# at each change of hands, and a whole copy each time saved about 650 MB for 200 one-row
# commits into a 4 MB WAL (found by a bug hunt).  Smaller files stay whole: a copy is cheap,
# and a whole pre-image needs no later state to be read back.
RANGES_PAST = 64 << 10
WHOLE_COPIES = 3
WHOLE_COPIES_KEPT = 4096  # paths counted at once; past it the count starts again


def _protected_hardlinks() -> bool:
    try:
        with open("/proc/sys/fs/protected_hardlinks") as f:
            return f.read().strip() != "0"
    except OSError:
        return True


_PROTECTED_HARDLINKS = _protected_hardlinks()
# The attic's own files, so that git and backup tools pass it by when the workspace is
# unmounted (as virtual environments and .pytest_cache do): never attic entries.
ATTIC_OWN = {
    ".gitignore": b"# made by overlayrec: the attic holds pre-images, never commit them\n*\n",
    "CACHEDIR.TAG": b"Signature: 8a477f597d28d172789f06886806bc55\n"
                    b"# This file is a cache directory tag created by overlayrec.\n"
                    b"# For information about cache directory tags, see:\n"
                    b"#\thttps://bford.info/cachedir/\n",
}
# A workspace filesystem that refuses a change with ENOSPC gets attic entries dropped until
# this much is free: room for the refused change and those right after it, so a burst of
# writes costs one reclaim, not one per write, and few pre-images go.
RECLAIM_HEADROOM = 32 << 20
# Where the state dir shares the workspace's filesystem, the daemon keeps this much room in it
# (``Recorder.make_reserve``): on that filesystem full, a change that can free room (an ``rm``
# of the file that filled it) needs its event committed first, and nothing else could make
# room for it (found by a bug hunt: nothing could be removed until the unmount)
RESERVE_BYTES = 2 << 20
# the changes the reserve is spent on: those that take a name away, whose reclaim frees room
ROOM_FREEING = ("unlink", "rename", "rmdir")
# a record that frees nothing (a turn or call begun, the unmount's seal, a gc's or a revert's
# plan) finds less than this free on a filesystem the state dir shares: room is made first,
# from the reserve (``Recorder.room_to_record``)
RECORD_ROOM = 64 << 10
# what such a record takes of the reserve at a time, and what it leaves of it for a removal
RECORD_TAKE = 128 << 10
RESERVE_FLOOR = 1 << 20


# the attic's note of the record it belongs to: {"journal_id", "state_dir"} (JSON), so that a
# workspace moved elsewhere can be matched with its record again (daemon.prepare)
ATTIC_RECORD = "RECORD"


def attic_record(attic_dir: str) -> dict | None:
    """The ATTIC_RECORD note of the attic at ``attic_dir``; None when there is none (an attic
    of an older overlayrec) or it cannot be read as one."""
    try:
        fd = os.open(os.path.join(attic_dir, ATTIC_RECORD),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            note = json.loads(f.read(4096))
    except (OSError, ValueError):
        return None
    if not isinstance(note, dict) or not isinstance(note.get("journal_id"), str) or \
            not isinstance(note.get("state_dir"), str):
        return None
    return note


def moved_here(journal: Journal, recorded: str, ws: str) -> bool:
    """Is ``ws`` the workspace ``journal`` recorded at ``recorded``, moved since?  The old path
    is gone, and the attic ``ws`` holds (which moves with it) notes this journal's id
    (ATTIC_RECORD).  A copy is not: its old path is still there."""
    if not recorded or recorded == ws or os.path.lexists(recorded):
        return False
    note = attic_record(os.path.join(ws, ATTIC_NAME))
    return note is not None and note["journal_id"] == journal.meta("journal_id")


def is_attic_entry(name: str) -> bool:
    """Is ``name`` (in the attic) a kept inode, not one of the attic's own files?"""
    return name not in ATTIC_OWN and name != ATTIC_RECORD and not name.startswith(".")


class ForeignAttic(Exception):
    """The workspace holds a directory of the attic's name that overlayrec did not make."""


_ENTRY = re.compile(r"(?:[0-9a-f]+\.)?[0-9]+")  # "<journal id>.<seq>"; an older attic's "<seq>"


def _not_an_attic(fd: int) -> str | None:
    """Why the directory at ``fd`` (named as the attic) is not one overlayrec made, or None:
    it is, or it is empty.  Ours notes its record (ATTIC_RECORD; an older overlayrec's did
    not) and holds nothing but entries, its own files and their dot temp files."""
    dfd = underlay.open_dir(fd)
    try:
        names = os.listdir(dfd)
    finally:
        os.close(dfd)
    if ATTIC_RECORD in names and attic_record(f"/proc/self/fd/{fd}") is None:
        return f"its {ATTIC_RECORD} is no record's note"
    strange = sorted(n for n in names if is_attic_entry(n) and not _ENTRY.fullmatch(n))
    if strange:
        return f"it holds {strange[0]!r}" + (f" and {len(strange) - 1} more" if len(strange) > 1
                                             else "")
    return None


def unit_fields(unit: str) -> dict:
    """The event fields that name a unit (and its candidates or lateness, when it has them)."""
    return {"unit": str(unit), **getattr(unit, "extra", {})}


def _fd_flags(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GETFL)


def _undoable(fn):
    """A mutation that fails (the journal or the content store cannot take its pre-image, the
    underlay refuses it) leaves the epochs as they were before it: what it noted as saved never
    reached the journal, or went with an event that the ``failed`` note voids, so the next
    change must capture it again (and, once there is room again, does)."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if self._undo is not None:  # inside another undoable step: that one restores
            return fn(self, *args, **kwargs)
        self._undo = {}
        try:
            return fn(self, *args, **kwargs)
        except BaseException:
            self._restore(self._undo)
            raise
        finally:
            self._undo = None
    return wrapper


class _CrossedMount(Exception):
    """The attic step of an unlink or a rename over a file met another mount of the same
    filesystem (EXDEV: a bind mount beneath the workspace, which ``st_dev`` cannot tell): its
    directory is noted (``Recorder.bound_dirs``), and ``_roomy`` makes the change again, the
    file's pre-image copied into the store; the first try's event is voided by its ``failed``
    note and its epochs were put back (``_undoable``, inside that)."""


def _roomy(fn):
    """A change refused for want of space on the workspace's filesystem (ENOSPC from the
    underlay, or from the journal or the content store when the state dir shares that
    filesystem) is tried again after each way of making room that freed something: first
    ``Recorder.store_waiting`` (the small pre-images waiting in the attic go into the store,
    nothing lost), then ``Recorder.reclaim`` (attic entries dropped), and last, for a change
    that can free room (ROOM_FREEING), the state dir's reserve (``Recorder._spend_reserve``).
    Each refused try left the epochs as they were (``_undoable``, applied inside this) and its
    event, if journaled, is voided by its ``failed`` note.  Nothing freed: the refusal stands."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except _CrossedMount:  # (here, not in a wrapper of its own: a frame less a change)
            return fn(self, *args, **kwargs)
        except (OSError, JournalError) as e:
            if not self._workspace_full(e):
                raise
            refused = e
        for make_room in (self.store_waiting, self._reclaim_for, self._spend_reserve):
            if not make_room(name):
                continue
            try:
                done = fn(self, *args, **kwargs)
            except (OSError, JournalError) as e:
                if not self._workspace_full(e):
                    raise
                refused = e
                continue
            if make_room == self._spend_reserve:
                self._reserve_spent(name)
            return done
        raise refused
    return wrapper


class _Mutation:
    """``Recorder._mutation``'s context (a class, not a generator: every change enters one):
    entering commits the event and gives its seq; an OSError from the body is noted as the
    event's ``failed`` and goes on."""
    __slots__ = ("rec", "ev", "actor", "seq")

    def __init__(self, rec: "Recorder", ev: dict, actor: dict):
        self.rec, self.ev, self.actor = rec, ev, actor

    def __enter__(self) -> int:
        self.ev["actor"] = self.actor["key"]
        self.seq = self.rec._append(self.ev, self.actor)
        return self.seq

    def __exit__(self, typ, e, tb) -> bool:
        if typ is None:
            self.rec._left_by(self.ev)
        elif issubclass(typ, OSError):
            self.rec._note_failed(self.seq, self.ev.get("path"), e.errno, self.actor["key"])
        return False


class _Held:
    """A held change's context (``Recorder._unchanging``; a class, not a generator, as
    ``_Mutation``): entering holds the event and gives its seq; an OSError from the body takes
    it back, since the change did not happen."""
    __slots__ = ("journal", "ev", "ep", "actor", "seq", "last")

    def __init__(self, journal: Journal, ev: dict, ep: "Epoch", actor: dict):
        self.journal, self.ev, self.ep, self.actor = journal, ev, ep, actor

    def __enter__(self) -> int:
        self.seq = self.journal.hold_event(self.ev, self.actor)
        self.last, self.ep.last = self.ep.last, self.seq
        return self.seq

    def __exit__(self, typ, e, tb) -> bool:
        if typ is not None and issubclass(typ, OSError):
            self.journal.unhold_event(self.seq)
            self.ep.last = self.last
        return False


class _StateDirStore:
    """The content store, with its OSErrors marked as the state dir's (``in_state_dir``): a
    full state dir on another filesystem is no reason to drop the workspace's attic."""

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            except OSError as e:
                e.in_state_dir = True
                raise
        # made once per name, not per call (a pre-image's store is on every change's path):
        # the next lookup finds it here and __getattr__ is not asked again
        setattr(self, name, call)
        return call


class Names:
    """The names the daemon knows each linked inode by: (st_dev, st_ino) -> its names, with the
    reverse map (name -> inode) so that an unlink or a rename costs a lookup, not a pass over
    every inode (git alone leaves thousands: each object is linked into place).  An inode with
    no name left is no entry."""
    __slots__ = ("_by_key", "_key_of")

    def __init__(self):
        self._by_key: dict[tuple[int, int], set[str]] = {}
        self._key_of: dict[str, tuple[int, int]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key, default=frozenset()):
        """The names of inode ``key`` (a set; ``default``, empty, for an inode with none
        known: a set too, so that callers may subtract from it)."""
        return self._by_key.get(key, default)

    def values(self):
        return self._by_key.values()

    def add(self, key, paths) -> None:
        names = self._by_key.setdefault(key, set())
        for p in paths:
            old = self._key_of.get(p)
            if old is not None and old != key:  # a name holds one inode: no longer that one
                self.discard(old, p)
            names.add(p)
            self._key_of[p] = key

    def discard(self, key, path: str) -> None:
        names = self._by_key.get(key)
        if names is None:
            return
        names.discard(path)
        if self._key_of.get(path) == key:
            del self._key_of[path]
        if not names:
            del self._by_key[key]

    def unname(self, path: str) -> None:
        key = self._key_of.get(path)
        if key is not None:
            self.discard(key, path)

    def rename(self, path: str, path2: str, is_dir: bool, exchange: bool) -> None:
        """``path`` became ``path2`` (and what lay beneath, for a directory); with exchange,
        ``path2`` became ``path`` too.  A name renamed over (no exchange) is gone."""
        def beneath(top: str) -> list[str]:
            prefix = top + "/"
            return [n for n in self._key_of if n.startswith(prefix)]
        moves = [(path, path2)] + [(n, path2 + n[len(path):]) for n in
                                   (beneath(path) if is_dir else ())]
        if exchange:
            moves += [(path2, path)] + [(n, path + n[len(path2):]) for n in beneath(path2)]
        else:
            self.unname(path2)
        moved = [(self._key_of[old], new) for old, new in moves if old in self._key_of]
        for old, _ in moves:
            self.unname(old)
        for key, new in moved:
            self.add(key, (new,))


class RangeSet:
    """Sorted, disjoint [lo, hi) intervals (touching ones merged).  Found by bisection and
    changed in place: writes scattered over a large file (glibc's posix_fallocate writes a
    byte every 4 KiB) never merge, and a scan from the start, a sort and a copy at each write
    made a call's writes quadratic.  ``mark`` begins a log of the changes that ``undo``
    takes back (a mutation that failed: Recorder._restore), so no copy is kept for it."""
    __slots__ = ("iv", "log")

    def __init__(self):
        self.iv: list[list[int]] = []
        self.log: list | None = None

    def missing(self, lo: int, hi: int) -> list[tuple[int, int]]:
        iv = self.iv
        out, cur = [], lo
        # the first interval ending past lo: the ones before it cover nothing of [lo, hi)
        for k in range(bisect.bisect_right(iv, lo, key=_iv_hi), len(iv)):
            a, b = iv[k]
            if a >= hi:
                break
            if a > cur:
                out.append((cur, a))
            cur = b
            if cur >= hi:
                break
        if cur < hi:
            out.append((cur, hi))
        return out

    def add(self, lo: int, hi: int) -> None:
        iv = self.iv
        i = bisect.bisect_left(iv, lo, key=_iv_hi)    # the first ending at or past lo
        j = bisect.bisect_right(iv, hi, key=_iv_lo)   # the first starting past hi
        if i < j:
            lo, hi = min(lo, iv[i][0]), max(hi, iv[j - 1][1])
        if self.log is not None:
            self.log.append((i, iv[i:j]))
        iv[i:j] = [[lo, hi]]

    def mark(self) -> None:
        self.log = []

    def undo(self) -> None:
        for i, old in reversed(self.log or ()):
            self.iv[i:i + 1] = old
        self.log = None


def _iv_lo(x: list[int]) -> int:
    return x[0]


def _iv_hi(x: list[int]) -> int:
    return x[1]


class Epoch:
    __slots__ = ("unit", "content_saved", "meta_saved", "size0", "ranges", "last", "moved")

    def __init__(self, unit: str):
        self.unit = unit
        self.content_saved = False   # the whole pre-image content is in the journal (or not needed)
        self.meta_saved = False
        self.size0: int | None = None  # range mode: size at the epoch's start
        self.ranges: RangeSet | None = None
        # the seq of the path's latest event: a handle's write joins its run (no event) only
        # while its run's event is still the latest (see before_write)
        self.last = 0
        # the inode came to this name by a rename and nothing changed it since (_epoch clears
        # it at the next change): its other names hold what they held (_unknown_before)
        self.moved = False


class Recorder:
    def __init__(self, journal: Journal, root_fd: int, attribution: Attribution,
                 whole_file_limit: int = WHOLE_FILE_LIMIT, units: Calls | None = None,
                 record_data: bool = False):
        self.journal = journal
        self.record_data = record_data
        self.units = units or Calls(journal, attribution)
        self.content = _StateDirStore(journal.content)
        # secret paths: their content never leaves the file (overlayrec.secrets)
        self.secrets = Secrets.of_journal(journal)
        self._undo: dict[str, tuple | None] | None = None  # see _undoable
        self._unjournaled: list[dict] = []  # notes (failed, reclaim) the journal owes
        self.root_fd = root_fd
        self.attribution = attribution
        # tests of range pre-images make small files take them (a few bytes)
        knob = os.environ.get("OVERLAYREC_TEST_WHOLE_FILE_LIMIT", "").strip()
        self.whole_file_limit = int(knob) if knob else whole_file_limit
        # tests of the attic itself keep small files there too (=-1: every file)
        knob = os.environ.get("OVERLAYREC_TEST_SMALL_PREIMAGE", "").strip()
        self.small_preimage = int(knob) if knob else SMALL_PREIMAGE
        # tests of files saved by ranges after their first copies make small ones do it too
        knob = os.environ.get("OVERLAYREC_TEST_RANGES_PAST", "").strip()
        self.ranges_past = int(knob) if knob else RANGES_PAST
        knob = os.environ.get("OVERLAYREC_TEST_WHOLE_COPIES", "").strip()
        self.copies_first = int(knob) if knob else WHOLE_COPIES
        self._learn_root(underlay.fd_path(root_fd))
        self._euid, self._egid = os.geteuid(), os.getegid()
        self.epochs: dict[str, Epoch] = {}
        self.whole_copies: dict[str, int] = {}  # path -> its epochs saved whole (_whole_copy)
        # bumped by every rename, unlink and rmdir: an open handle's file may have another
        # name since (fs.Handle.path asks the kernel again when this moved)
        self.name_changes = 0
        # the names the daemon knows for inodes with several links (made through the mount):
        # a change through one name is journaled on the others too (an ``alias`` event)
        self.names = Names()
        self._pending: list[dict] = []  # alias events, committed with the event they go with
        # paths whose last epoch ended unsealed (at a unit boundary, or carried to a new name
        # by a directory rename): sealed with their unit
        self.unsealed: dict[str, str] = {}
        # directories a rename brought to their names in this mount (name now -> the rename's
        # seq): what lies beneath them is sealed at the record's end (close_record)
        self.moved_dirs: dict[str, int] = {}
        self.beneath_sealed: set[str] = set()  # of those, the ones walked whole at the end
        self.beneath_failed: set[str] = set()  # ... and the tops whose walk failed
        self.seal_failed: list[str] = []  # the paths the seal in progress could not seal
        # path -> when the daemon last changed what it holds (time.time_ns(), just before):
        # a file whose ctime is later at its seal was changed around the mount (seal)
        self.served: dict[str, int] = {}
        self.served_ino: dict[int, int] = {}  # inode -> when a name of it came or went
        # path -> the ctime its last seal found, for files of one link sealed by this daemon
        # and not changed since: a later ctime at the next change is another writer's around
        # the mount (_bypassed); at most SEALED_CTIMES kept, the oldest let go
        self.sealed_ctime: dict[str, int] = {}
        self.detached_at: int | None = None  # when the mount was detached (daemon: its end)
        # path -> the kind of what the daemon's last change to it left there (None: it removed
        # it), for the paths it changed since their seal: a file found absent at its seal that
        # the daemon left there was removed around the mount (seal)
        self.left: dict[str, str | None] = {}
        # the names a killed daemon left open, stamped at its next mount (open_record): a
        # directory among them whose ctime is later was made, or its entries changed, while
        # no daemon recorded
        self.recovering: set[str] = set()
        # told each path a seal found changed around the mount (the daemon drops the kernel's
        # cache of it: fs.Operations.forget_cached)
        self.on_around: Callable[[str], None] | None = None
        self.attic_fd = self._open_attic()
        # a file of another filesystem mounted inside the workspace cannot go to the attic
        # (a rename or a link across filesystems fails): _copy_elsewhere
        self.attic_dev = os.fstat(self.attic_fd).st_dev
        # directories beneath another mount of the attic's filesystem (a bind mount), which
        # st_dev cannot tell: found by the kernel's EXDEV (_crossed)
        self.bound_dirs: set[tuple[int, int]] = set()
        self.attic_links: dict[tuple[int, int], int] = {}
        # the entry a renamed-over inode was linked to (this daemon's): a descriptor still open
        # on it is named there, not by the name it lost (rel)
        self.attic_names: dict[tuple[int, int], str] = {}
        # the filesystem's own name for an object (its inode table's parent/name chain), asked
        # when the kernel cannot name an fd: an absolute path past PATH_MAX
        self.namer: Callable[[os.stat_result], str | None] | None = None
        # small pre-images of unlinked files kept by the attic until the daemon is idle
        # (settle_small): entry name -> (seq, size, mtime_ns).  Only the daemon, which
        # settles them, sets ``later``; OVERLAYREC_TEST_COPY_SMALL_NOW=1 (a test and bench
        # switch) copies them on the request path as before.
        self.to_store: dict[str, tuple[int, int, int]] = {}
        self.later = False
        # (fd, seq, path, epoch) of the create just made when it began a write run (begin_run)
        self.created: tuple[int, int, str, Epoch] | None = None
        self.made_anew: tuple[int, int, str] | None = None  # (fd, seq, path): create's last
        self.on_kept_later: Callable[[], None] | None = None
        # this journal's small single-link entries found at start (_find_small_kept's)
        self._small_found: list[str] = []
        self.reserve_owed = False  # the state dir's reserve was spent: made again when it can be
        self._unmade_ctime: dict[str, int] = {}  # path -> when _void_unmade moved its ctime
        self._count_attic()

    # -- attic ----------------------------------------------------------------------------------
    def _open_attic(self) -> int:
        # entries are named "<journal id>.<seq>": a workspace mounted with another state dir
        # (another journal, whose seqs start again at 1) never meets this journal's names
        jid = self.journal.meta("journal_id")
        if jid is None:
            jid = os.urandom(8).hex()
            self.journal.put_meta("journal_id", jid)
        self.attic_prefix = jid + "."
        try:
            fd = self._make_attic()
        except PermissionError:
            # the root is this user's, made read-only (0555) or closed (an agent's `chmod 000
            # .`): the first mount could not make the attic, nor a revert's mount reach it.
            # The owner grants itself the bits for the moment, the mode put back at once
            # (before the mount: nothing sees it)
            with underlay.granted_own(self.root_fd, stat.S_IWUSR | stat.S_IXUSR):
                fd = self._make_attic()
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            os.close(fd)
            raise OSError(errno.ENOTDIR, f"{ATTIC_NAME} in the workspace is not a directory")
        # another user's (made before the first mount in a workspace others may write, a
        # shared 1777 directory): that user could swap the pre-images a revert puts back
        me, ws_uid = os.geteuid(), os.fstat(self.root_fd).st_uid
        mine = {me, ws_uid} if me == 0 else {me}
        # (another user's workspace itself is said as that: daemon.run, "is uid N's")
        if st.st_uid not in mine and (me == 0 or ws_uid == me):
            os.close(fd)
            raise ForeignAttic(
                f"{ATTIC_NAME} in the workspace belongs to uid {st.st_uid}, not to this user: "
                "another user could change the pre-images kept there (mount as its owner, or "
                "move it aside: it holds that user's record's pre-images)")
        if stat.S_IMODE(st.st_mode) & 0o077:
            underlay.chmod_fd(fd, 0o700)  # ours, made looser since: 0700 again
        try:
            foreign = _not_an_attic(fd)
        except BaseException:
            os.close(fd)
            raise
        if foreign is not None:
            os.close(fd)
            raise ForeignAttic(
                f"{ATTIC_NAME} in the workspace is not overlayrec's attic ({foreign}): overlayrec "
                "keeps its pre-images under that name and would take it over; rename it first")
        note = json.dumps({"journal_id": jid,
                           "state_dir": os.path.realpath(self.journal.state_dir)}).encode()
        try:
            self._ignore_attic(fd, {ATTIC_RECORD: note})
        except OSError as e:  # a full workspace must not keep it from mounting: next time
            log.warning("cannot make %s ignored by git and backup tools: %s", ATTIC_NAME, e)
        return fd

    def _make_attic(self) -> int:
        """An O_PATH fd of the attic, made first where there is none."""
        try:
            os.mkdir(ATTIC_NAME, 0o700, dir_fd=self.root_fd)
        except FileExistsError:
            pass
        return underlay.open_path(self.root_fd, ATTIC_NAME)

    @staticmethod
    def _ignore_attic(fd: int, more: dict[str, bytes] | None = None) -> None:
        """Make the attic (``fd``) self-ignoring: its ``.gitignore`` and ``CACHEDIR.TAG``
        (ATTIC_OWN), 0600, written whole by a rename when missing or not what they should be
        (an attic made by an older overlayrec gets them at its next mount), and ``more``
        (the ATTIC_RECORD note) the same way."""
        for name, data in {**ATTIC_OWN, **(more or {})}.items():
            try:
                st = underlay.lstat_at(fd, name)
                if stat.S_ISREG(st.st_mode) and st.st_size == len(data) and \
                        stat.S_IMODE(st.st_mode) == 0o600:
                    with open(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK |
                                      os.O_CLOEXEC, dir_fd=fd), "rb") as f:
                        if f.read() == data:
                            continue
            except FileNotFoundError:
                pass
            tmp = f".{name}.{os.getpid()}.tmp"  # a dot name: never an attic entry
            wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW |
                          os.O_CLOEXEC, 0o600, dir_fd=fd)
            try:
                os.fchmod(wfd, 0o600)  # whatever the umask (docs/storage.md)
                os.write(wfd, data)
            except BaseException:
                os.close(wfd)
                os.unlink(tmp, dir_fd=fd)
                raise
            os.close(wfd)
            os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)

    def _count_attic(self) -> None:
        dfd = underlay.open_dir(self.attic_fd)
        try:
            for name in os.listdir(dfd):
                if not is_attic_entry(name):
                    continue  # the attic's own files (ATTIC_OWN), a temp file of them
                try:
                    st = underlay.lstat_at(self.attic_fd, name)
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    k = (st.st_dev, st.st_ino)
                    self.attic_links[k] = self.attic_links.get(k, 0) + 1
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and \
                        0 < st.st_size <= self.small_preimage and \
                        name.startswith(self.attic_prefix) and \
                        name[len(self.attic_prefix):].isdigit():
                    self._small_found.append(name)
        finally:
            os.close(dfd)

    def nlink(self, st: os.stat_result) -> int:
        return st.st_nlink - self.attic_links.get((st.st_dev, st.st_ino), 0)

    def _keep_small(self, dirfd: int, name: str, st: os.stat_result, pre: dict) -> bool:
        """A regular file of at most SMALL_PREIMAGE bytes about to lose ``name`` (unlink,
        rename over): its content goes into the store now (``pre["blob"]``; the empty blob
        for an empty file), ahead of the event, and it needs no attic entry.  False (the attic
        keeps it) for anything else, and for a file the daemon may not read (a link needs no
        read permission)."""
        if not stat.S_ISREG(st.st_mode) or st.st_size > self.small_preimage:
            return False
        if st.st_size == 0:
            pre["blob"] = self.content.put_bytes(b"")
            return True
        try:
            fd = underlay.open_own(dirfd, name, os.O_RDONLY | os.O_NONBLOCK)
        except PermissionError:
            return False
        try:
            pre["blob"] = self._save_whole(fd, st.st_size)
        finally:
            os.close(fd)
        return True

    def _beyond_attic(self, st: os.stat_result, dirfd: int) -> bool:
        """Can the attic not keep this inode (in the directory ``dirfd``) as a pre-image?  Not
        one of another filesystem mounted inside the workspace (``st_dev`` not the attic's:
        the kernel refuses a rename or a link across filesystems, and the unlink or rename
        would fail), nor one beneath another mount of the attic's own filesystem (a bind
        mount: the same ``st_dev``, found by the kernel's EXDEV once, ``bound_dirs``); nor a
        file its owner, the daemon's user, may not read, which no reader run by that user
        could read from the attic (underlay.reopen_own is the daemon's alone: it serves one request at a
        time, a reader would race it).  Root reads it anyway; copying it costs little."""
        return st.st_dev != self.attic_dev or (
            st.st_uid == self._euid and stat.S_ISREG(st.st_mode) and
            not st.st_mode & stat.S_IRUSR) or \
            (bool(self.bound_dirs) and self._dir_key(dirfd) in self.bound_dirs)

    @staticmethod
    def _dir_key(dirfd: int) -> tuple[int, int]:
        st = os.fstat(dirfd)
        return st.st_dev, st.st_ino

    def _crossed(self, dirfd: int, e: OSError) -> None:
        """The attic step failed: EXDEV (a mount of the attic's filesystem beneath the
        workspace) makes the change go again without the attic (_CrossedMount); anything
        else is the change's own refusal."""
        if e.errno != errno.EXDEV:
            raise e
        key = self._dir_key(dirfd)
        if key in self.bound_dirs:
            raise e
        self.bound_dirs.add(key)
        log.info("a directory beneath the workspace is another mount of its filesystem: "
                 "what leaves it is copied into the store, not kept in the attic")
        raise _CrossedMount() from None

    def _copy_elsewhere(self, dirfd: int, name: str, st: os.stat_result, pre: dict) -> None:
        """A file about to lose ``name`` that the attic cannot keep (``_beyond_attic``): its
        content goes into the store now, whatever its size.  One the daemon may not read is
        marked ``unkept``: its state before is then never taken as exact."""
        if not stat.S_ISREG(st.st_mode):
            return
        try:
            fd = underlay.open_own(dirfd, name, os.O_RDONLY | os.O_NONBLOCK)
        except PermissionError:
            pre["unkept"] = True
            return
        try:
            if st.st_size <= self.whole_file_limit:
                pre["blob"] = self._save_whole(fd, st.st_size)
            else:
                pre["ranges"] = [[0, st.st_size, self.content.put_range(fd, 0, st.st_size)]]
        finally:
            os.close(fd)

    def _small_later(self, st: os.stat_result) -> bool:
        """Is this file, about to be unlinked, a small pre-image the attic keeps for now
        (``settle_small`` copies it into the store when the daemon is idle)?  A file with
        other names is not: a write through one of them would change the entry."""
        return self.later and st.st_nlink == 1 and 0 < st.st_size <= self.small_preimage \
            and stat.S_ISREG(st.st_mode) \
            and (st.st_dev, st.st_ino) not in self.attic_links

    def _kept_later(self, name: str, seq: int, pre: dict) -> None:
        first = not self.to_store
        self.to_store[name] = (seq, pre["size"], pre["mtime_ns"])
        if first and self.on_kept_later is not None:
            self.on_kept_later()

    def settle_small(self, budget: float | None = None) -> int:
        """Copy small pre-images the attic keeps for now (``to_store``) into the content
        store, oldest first, for at most ``budget`` seconds (None: all): each event's
        pre-image then names the blob instead of the entry (one commit for all), and the
        entries are dropped.  An entry changed since (an event on its attic path, another
        link, another size or mtime) or unreadable stays in the attic, where readers read it
        through its own chain.  Returns how many wait still.  JournalError when the journal
        cannot take the change now, OSError (ENOSPC, EDQUOT) when the store cannot: the
        entries wait (and stay readable, and are not reclaimed) for the next try."""
        self._settle(budget)
        return len(self.to_store)

    def store_waiting(self, why: str = "") -> int:
        """The workspace's filesystem is full: copy every small pre-image waiting in the attic
        into the store now, not when the daemon is idle, and drop their entries (nothing is
        lost: each event names its blob instead).  Returns the bytes their entries held (0:
        none waited, or the store or the journal cannot take them now, and they wait)."""
        if not self.to_store:
            return 0
        try:
            freed = self._settle(None)
        except (JournalError, OSError) as e:  # they wait; the reclaim passes them by
            log.warning("%s: the workspace is full and %d small pre-image(s) cannot go into "
                        "the store now: %s", why, len(self.to_store), e)
            return 0
        log.info("%s: the workspace is full: small pre-images copied into the store, "
                 "%d bytes of attic entries freed", why, freed)
        return freed

    def _settle(self, budget: float | None) -> int:
        """``settle_small``'s work; returns the bytes of the entries it dropped.  Committed
        SETTLE_COMMIT entries at a time: on a full filesystem one commit of them all was
        refused whole, and nothing ever gave room back (found by a bug hunt)."""
        deadline = None if budget is None else time.monotonic() + budget
        freed = 0
        names = list(self.to_store)
        for i in range(0, len(names), SETTLE_COMMIT):
            if deadline is not None and i and time.monotonic() >= deadline:
                break
            got, stopped = self._settle_some(names[i:i + SETTLE_COMMIT], deadline)
            freed += got
            if stopped:
                break
        return freed

    def _settle_some(self, names: list[str], deadline: float | None) -> tuple[int, bool]:
        """``_settle`` of the entries ``names`` (those still waiting) in one commit: the bytes
        freed, and whether the deadline stopped it."""
        done: list[tuple[int, str, str]] = []
        taken: dict[str, tuple[tuple[int, int, int], os.stat_result]] = {}
        stopped = False
        try:
            for name in names:
                if name not in self.to_store:
                    continue
                if deadline is not None and done and time.monotonic() >= deadline:
                    stopped = True
                    break
                waiting = self.to_store.pop(name)
                seq, size, mtime_ns = waiting
                try:
                    digest, st = self._copy_entry(name, size, mtime_ns)
                except OSError:  # no room in the store now: it waits, with the rest
                    self.to_store[name] = waiting
                    raise
                if digest is not None:
                    done.append((seq, name, digest))
                    taken[name] = (waiting, st)
            if done:
                self.journal.store_preimages(done)
        except BaseException:
            for name, (waiting, _) in taken.items():  # not journaled: they wait for a next try
                self.to_store[name] = waiting
            # nor do their blobs wait for the next commit: each later one carried them all
            # and was refused on a full filesystem (found by a bug hunt)
            self.journal.unhold_blobs([digest for _, _, digest in done])
            raise
        freed = 0
        for name, (_, st) in taken.items():
            try:
                self._drop_attic(name, (st.st_dev, st.st_ino))
            except FileNotFoundError:
                continue
            except OSError as e:  # its blob is in the record: a gc sweeps the entry
                log.warning("cannot drop attic entry %s, copied into the store: %s", name, e)
                continue
            freed += st.st_blocks * 512
        return freed, stopped

    def _copy_entry(self, name: str, size: int, mtime_ns: int) -> tuple[str | None,
                                                                         os.stat_result | None]:
        """The blob of attic entry ``name`` and the entry's stat (None, None when it is not
        the pre-image as kept)."""
        try:
            fd = underlay.open_own(self.attic_fd, name, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None, None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size != size or \
                    st.st_mtime_ns != mtime_ns or \
                    self.attic_links.get((st.st_dev, st.st_ino)) != 1:
                return None, None
            digest = self._save_whole(fd, size)
            st = os.fstat(fd)  # nothing writes it meanwhile (the daemon serves no other request)
            if st.st_size != size or st.st_mtime_ns != mtime_ns:
                return None, None
            return digest, st
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            log.warning("cannot copy attic entry %s into the store (the attic keeps it): %s",
                        name, e)
            return None, None
        finally:
            os.close(fd)

    def _drop_attic(self, name: str, key: tuple[int, int]) -> None:
        os.unlink(name, dir_fd=self.attic_fd)
        if self.attic_names.get(key) == name:
            del self.attic_names[key]
        n = self.attic_links.get(key, 0) - 1
        if n > 0:
            self.attic_links[key] = n
        else:
            self.attic_links.pop(key, None)

    def _workspace_full(self, e: Exception) -> bool:
        """Is ``e`` the workspace's filesystem out of space (so a reclaim may help)?"""
        if getattr(e, "errno", None) != errno.ENOSPC:
            return False
        if isinstance(e, JournalError) or getattr(e, "in_state_dir", False):
            return self._shares_fs()
        return True

    def _shares_fs(self) -> bool:
        """Is the state dir on the workspace's filesystem?"""
        try:
            return os.stat(self.journal.state_dir).st_dev == os.fstat(self.root_fd).st_dev
        except (AttributeError, OSError):
            return False

    def start_reserve(self) -> None:
        """At mount: the reserve made where the state dir shares the workspace's filesystem,
        or, without the room for it now, owed (the daemon makes it once there is room: it
        was never made when the mount found the filesystem nearly full; found by a hunt)."""
        if self._shares_fs():
            self.reserve_owed = not self.make_reserve()

    def make_reserve(self) -> bool:
        """Keep RESERVE_BYTES of room in the state dir where it shares the workspace's
        filesystem (allocated, so a full filesystem cannot take it), not taking the last of
        the room for it.  Asked at mount and after the reserve was spent.  Whether it is
        there."""
        if not self._shares_fs():
            return False
        path = state.StateDir(self.journal.state_dir).reserve
        try:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and st.st_blocks * 512 >= RESERVE_BYTES:
                    return True
            vfs = os.statvfs(self.journal.state_dir)
        except OSError as e:
            log.warning("cannot look at the reserve %s: %s", path, e)
            return False
        if vfs.f_bavail * vfs.f_frsize < 2 * RESERVE_BYTES:
            return False
        tmp = f"{path}.{os.getpid()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, RESERVE_BYTES)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.info("cannot keep a reserve of %d bytes in the state dir now: %s",
                     RESERVE_BYTES, e)
            return False
        return True

    def _spend_reserve(self, why: str) -> int:
        """The last way of making room, for a change that can free some (ROOM_FREEING) on a
        full filesystem the state dir shares: the reserve goes, the change's event takes its
        room, and ``_roomy`` then reclaims what the change gave back and makes the reserve
        again.  The bytes freed (0: no reserve, or not such a change)."""
        if why not in ROOM_FREEING:
            return 0
        path = state.StateDir(self.journal.state_dir).reserve
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):  # (a planted link: never spent through)
                return 0
            size = st.st_blocks * 512
            os.unlink(path)
        except OSError:
            return 0
        self.reserve_owed = True
        log.warning("%s: the filesystem the workspace and the state dir share is full: the "
                    "state dir's reserve (%d bytes) is spent on a change that can free room",
                    why, size)
        return size

    def room_to_record(self, why: str) -> int:
        """Before a record that is no change of the workspace (a turn or call begun or ended,
        the unmount's seal, a gc, a revert's plan) on a filesystem the state dir shares with
        less than RECORD_ROOM free: RECORD_TAKE of the reserve is given back, down to
        RESERVE_FLOOR, which stays a removal's (``_spend_reserve``), and the daemon makes it
        whole again once there is room (``reserve_owed``).  A full filesystem refused them all
        (found by a bug hunt: `turn begin` and the seal failed after `mv a big` filled it).
        Never the attic's kept pre-images: reclaimed for such a record (even a `status`), they
        were what a revert then needed, the file lost (found by a bug hunt).  The bytes
        given back."""
        if not self._shares_fs():
            return 0
        path = state.StateDir(self.journal.state_dir).reserve
        try:
            vfs = os.statvfs(self.journal.state_dir)
            if vfs.f_bavail * vfs.f_frsize >= RECORD_ROOM:
                return 0
            # (never through a link: a planted one sent the truncate to a file outside the
            # state dir; found by a bug hunt)
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                size = st.st_blocks * 512
                if not stat.S_ISREG(st.st_mode) or size <= RESERVE_FLOOR:
                    return 0
                left = max(RESERVE_FLOOR, size - RECORD_TAKE)
                os.ftruncate(fd, left)
            finally:
                os.close(fd)
        except OSError:
            return 0
        self.reserve_owed = True
        log.info("%s: the filesystem the workspace and the state dir share is full: %d bytes "
                 "of the state dir's reserve given to a record", why, size - left)
        return size - left

    def _reserve_spent(self, why: str) -> None:
        """A change that can free room went through on the reserve: what it removed, kept by
        the attic, is reclaimed now with the oldest entries (nothing else would free room for
        the next commit, nor for the reserve), and the reserve is made again (the room comes
        back once the kernel lets go of the removed file: else by the daemon a moment later,
        ``reserve_owed``)."""
        self._reclaim_for(why)
        self.reserve_owed = not self.make_reserve()

    def _reclaim_for(self, why: str) -> int:
        """``reclaim``, its own trouble logged: the refused change's errno is the answer."""
        try:
            return self.reclaim(why)
        except OSError as e:
            log.warning("cannot reclaim attic entries: %s", e)
            return 0

    def reclaim(self, why: str = "") -> int:
        """The workspace's filesystem is full: drop attic entries of this journal, oldest
        first (by seq), until RECLAIM_HEADROOM is free, taking only entries whose unlink frees
        blocks (the attic's link is their only one).  The drop is journaled ahead (a ``reclaim``
        marker naming every entry; when the journal cannot take it now, it goes with the next
        event) and each dropped name is logged.  Readers meeting such a pre-image say they
        cannot know its content.  Returns the bytes freed (0: nothing to drop)."""
        dfd = underlay.open_dir(self.attic_fd)
        try:
            names = os.listdir(dfd)
        finally:
            os.close(dfd)
        entries = []
        for name in names:
            seq = name[len(self.attic_prefix):]
            if not name.startswith(self.attic_prefix) or not seq.isdigit():
                continue  # another journal's entries are that journal's to drop
            try:
                st = underlay.lstat_at(self.attic_fd, name)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_blocks and \
                    name not in self.to_store:  # a small pre-image: the store's, never dropped
                entries.append((int(seq), name, st))
        entries.sort()
        vfs = os.statvfs(self.root_fd)
        free, inodes = vfs.f_bavail * vfs.f_frsize, vfs.f_favail
        plan = []
        for _, name, st in entries:
            if free >= RECLAIM_HEADROOM and (not vfs.f_files or inodes > 0):
                break
            plan.append((name, st))
            free += st.st_blocks * 512
            inodes += 1
        if not plan:  # every refused write asks again: not worth a line each
            log.debug("%s: the workspace is full and the attic holds nothing to drop", why)
            return 0
        marker = {"op": "reclaim", "cause": "ENOSPC", "during": why, "actor": "overlayrec",
                  "dropped": [n for n, _ in plan], "bytes": sum(st.st_blocks * 512
                                                               for _, st in plan)}
        try:
            self.journal.append_many(self._unjournaled + [marker], [])
            self._unjournaled = []
        except JournalError as e:  # the state dir shares the full filesystem: journal later
            log.warning("cannot journal the reclaim now (%s): kept to journal later", e)
            self._unjournaled.append(marker)
        freed = 0
        for name, st in plan:
            try:
                self._drop_attic(name, (st.st_dev, st.st_ino))
            except OSError as e:
                log.warning("reclaim: cannot drop attic entry %s: %s", name, e)
                continue
            freed += st.st_blocks * 512
            log.warning("reclaim: the workspace is full (%s): dropped attic entry %s "
                        "(%d bytes), its pre-image is lost", why, name, st.st_size)
        return freed

    # -- paths ----------------------------------------------------------------------------------
    def _learn_root(self, path: str) -> None:
        """Take ``path`` as the workspace root's path: the prefix ``rel`` strips, made once a
        path (not again for every fd)."""
        self.root_path = path
        self._root_slash = path.rstrip("/") + "/"
        self._root_cut = len(self._root_slash)
        self.units.root = path

    def _root_moved(self) -> bool:
        """Has the root another path than the one ``rel`` strips (a directory above the
        workspace renamed while it is mounted)?  Learnt again then: every name the kernel
        gives an fd since begins with the new one.  Asked only when a name does not begin
        with the old one, so it costs a readlink only after such a move."""
        try:
            now = underlay.fd_path(self.root_fd)
        except OSError:
            return False
        if now == self.root_path or now.endswith(" (deleted)"):
            return False
        log.info("the workspace's root is at %s now, not %s (a directory above it renamed)",
                 now, self.root_path)
        self._learn_root(now)
        return True

    def rel(self, fd: int) -> str:
        """The workspace-relative path of an fd's object, as the kernel names it now.  An fd
        opened by a name that has since gone (unlinked into the attic, or renamed over) while
        the inode lives on under another hard link is named by that other link; one renamed
        over and kept in the attic, by its attic entry; never by the name it lost."""
        try:
            p = underlay.fd_path(fd)
        except OSError as e:
            if e.errno != errno.ENAMETOOLONG or self.namer is None:
                raise
            rel = self.namer(os.fstat(fd))
            if rel is None:
                raise
            return rel
        if not p.startswith(self._root_slash) and p != self.root_path:
            self._root_moved()
        st = os.fstat(fd) if p.endswith(" (deleted)") else None
        if st is not None and self._gone(p, st):
            # the fd's name is gone, never to be journaled as changed: another object may
            # hold it now.  A small file unlinked or renamed over (its pre-image is in the
            # content store) has no name left: what is done through the fd changes no
            # path, and goes to the hidden attic's namespace.  A larger one renamed over
            # lives on in the attic (linked there first), or under another hard link.
            # So for every kind: a symlink hard-linked under a second name, renamed over
            # under the first, lives on in the attic and under the second (a link made
            # from the second was journaled from the first, which another file held then:
            # replay before it made the symlink there); a removed directory has no name
            if st.st_nlink:
                live = self._live_name(fd) if self.names else None
                if live is not None:
                    return live
                kept = self.attic_names.get((st.st_dev, st.st_ino))
                if kept is not None:
                    return f"{ATTIC_NAME}/{kept}"
            return f"{ATTIC_NAME}/{self.attic_prefix}gone.{st.st_ino}"
        if p.startswith(self._root_slash):
            rel = p[self._root_cut:]
            if self.names and (rel == ATTIC_NAME or rel.startswith(_ATTIC_SLASH)):
                return self._live_name(fd) or rel
            return rel
        if p == self.root_path:
            return ""
        # outside the root as the kernel names both (another mount namespace's view): an
        # absolute path journaled is a change no reader can place (diff failed on it, replay
        # dropped it), so the operation fails instead of being journaled so
        log.error("cannot name %s beneath the workspace's root %s: refused", p, self.root_path)
        raise OSError(errno.EIO, f"{p} is not beneath the workspace's root {self.root_path}")

    def _gone(self, p: str, st: os.stat_result) -> bool:
        """The kernel's name ``p`` of an fd (``st``) ends in " (deleted)": is the name gone,
        or is it an object's own name, which holds it still (a file or directory named so)?"""
        if not p.startswith(self._root_slash):
            return True
        try:
            named = self._lstat(p[self._root_cut:])
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != (named.st_dev, named.st_ino)

    def _live_name(self, fd: int) -> str | None:
        """A name the daemon knows the inode behind ``fd`` by that still holds it."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        for name in sorted(self.names.get(key, ())):
            try:
                other = self._lstat(name)
            except OSError:
                continue
            if (other.st_dev, other.st_ino) == key:
                return name
        return None

    def child(self, parent_fd: int, name: str) -> str:
        base = self.rel(parent_fd)
        return f"{base}/{name}" if base else name

    # -- pre-images -----------------------------------------------------------------------------
    def _meta(self, st: os.stat_result) -> dict:
        return preimage.from_stat(st, self.nlink(st))

    def _pre_at(self, dirfd: int, name: str) -> tuple[dict, os.stat_result | None]:
        """``name``'s pre-image in ``dirfd``; name "": ``dirfd``'s own (the workspace root's,
        whose path is "": a `chmod 700 .` was sealed absent)."""
        try:
            st = underlay.lstat_at(dirfd, name) if name else os.fstat(dirfd)
        except FileNotFoundError:
            return {"kind": "absent"}, None
        pre = self._meta(st)
        if pre["kind"] == "symlink":
            pre["target"] = os.readlink(name, dir_fd=dirfd)
        return pre, st

    def _save_whole(self, fd: int, size: int) -> str:
        return self.content.put_range(fd, 0, size)

    def _withhold(self, path: str, pre: dict | None = None,
                  opener: Callable[[], int] | None = None) -> bool:
        """Is ``path``'s content never to be kept (overlayrec.secrets): a secret path, or a
        content-checked one whose file (opened by ``opener``, closed here; none given: not
        looked at) holds more than public PEM blocks?  Marks a file's pre-image ``withheld``
        (its metadata stays: kind, mode, owner, size)."""
        if not self.secrets.match(path):
            if not self.secrets.checked(path) or \
                    (pre is not None and pre.get("kind", "file") != "file") or \
                    (opener is not None and self._public(opener)):
                return False
        if pre is not None and pre.get("kind", "file") == "file":
            pre["withheld"] = True
        return True

    @staticmethod
    def _public(opener: Callable[[], int]) -> bool:
        try:
            fd = opener()
        except OSError:
            return False  # not looked at: withheld
        try:
            return public_at(fd)
        except OSError:
            return False
        finally:
            os.close(fd)

    def _carry_secret(self, src: str, dst: str, withheld: bool | None = None,
                      since: int | None = None) -> None:
        """``dst`` now holds what ``src`` held (a rename, a hard link): a secret's content
        (``withheld``: as decided for ``src``'s pre-image, when it was) stays withheld under
        its new name, for the rest of the record (meta ``secret_names``; stored before the
        change is journaled, so no reader ever sees the name hold it unwithheld)."""
        # from the change's own seq, by default the next handed out; 0: from the record's start
        # (a link made outside the mount, found only now: which states were the secret's is
        # not known)
        if since is None:
            since = self.journal.last_reserved() + 1
        if self.secrets.carried(src, dst, withheld, since=since):
            self.journal.put_meta(META_NAMES, self.secrets.names_json())

    def _uncarry_secrets(self, before: tuple[set[str], dict[str, int]]) -> None:
        """The secret names as they were (``before``: the names and since when) a change
        that carried some and was not made."""
        if (self.secrets.names, self.secrets.since) != before:
            self.secrets.names, self.secrets.since = before
            self.secrets.forget()
            self.journal.put_meta(META_NAMES, self.secrets.names_json())

    def _epoch(self, path: str, unit: str, checked: bool = False) -> tuple[Epoch, bool]:
        """The epoch a change of ``path`` by ``unit`` belongs to, and whether it begins here.
        Unless the caller ``checked`` already, another writer's change around the mount since
        the daemon's last is found first (_look_around)."""
        now = time.time_ns()
        if not checked:
            self._look_around(path, now)
        self.served[path] = now  # before every change the daemon makes to it
        self.sealed_ctime.pop(path, None)
        ep = self.epochs.get(path)
        if self._undo is not None and path not in self._undo:
            self._undo[path] = None if ep is None else (
                ep, ep.unit, ep.content_saved, ep.meta_saved, ep.size0,
                ep.ranges)
            if ep is not None and ep.ranges is not None:
                ep.ranges.mark()
        if ep is not None and ep.unit == unit:
            ep.moved = False
            return ep, False
        ep = Epoch(unit)
        self.epochs[path] = ep
        # the new epoch's pre-image is where the last one ended: no seal owed for it
        self.unsealed.pop(path, None)
        if self.to_store and path.startswith(_ATTIC_SLASH):
            # written through a descriptor left open on the removed file: the entry is no
            # longer the pre-image alone, and stays in the attic (read through its own chain)
            self.to_store.pop(path[len(_ATTIC_SLASH):], None)
        return ep, True

    def _restore(self, undo: dict[str, tuple | None]) -> None:
        """Put the epochs of these paths back as ``_epoch`` found them (see _undoable)."""
        for path, snap in undo.items():
            if snap is None:
                self.epochs.pop(path, None)
                continue
            ep, unit, content_saved, meta_saved, size0, ranges = snap
            ep.unit, ep.content_saved = unit, content_saved
            ep.meta_saved, ep.size0 = meta_saved, size0
            if ranges is not None:
                ranges.undo()
            ep.ranges = ranges
            self.epochs[path] = ep

    def _look_around(self, path: str, now: int) -> None:
        """``_bypassed`` of ``path`` as it is now, where the daemon changed or sealed it before;
        nothing when it may not be looked at (a way its owner may not search: its seal looks
        by the owner's leave).  Not within the slack of the daemon's own last change, where
        no ctime could tell it (a temp file an editor writes and renames over its target: no
        syscall more)."""
        last = self.served.get(path)
        if (last is None or now - last <= AROUND_SLACK_NS) and path not in self.sealed_ctime:
            return
        try:
            st = self._lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        except OSError:
            return
        self._bypassed(path, st)

    def before_grant(self, fd: int) -> None:
        """The file behind ``fd`` is about to be read by its owner's leave (a chmod and back,
        underlay.reopen_own), which moves its ctime: another writer's change around the mount
        is looked for now, and the move that follows is the daemon's own (``served``).  Else a
        write-only file changed by one call and again by the next read as changed around the
        mount in between (a drift of the outside unit before the second change)."""
        try:
            path = self.rel(fd)
        except OSError:
            return
        if not path.startswith(_ATTIC_SLASH):
            self._look_around(path, time.time_ns())
            self.served[path] = time.time_ns()

    def _bypassed(self, path: str, st: os.stat_result | None) -> bool:
        """Was ``path`` (found as ``st``; None: nothing there) changed by another writer, around
        the mount, since the daemon last changed it (``served``) or sealed it (``sealed_ctime``)?
        A process whose working directory was entered before the mount writes beneath it: its
        change, taken into the pre-image of the next change or the epoch going on, read as the
        unit's own (its diff showed the user's line; a revert of the call removed it).  Found
        by the ctime, as a seal finds one (``_around``): then a ``drift`` of the outside unit
        "around" is journaled ahead of the next event (its pre-image: the seal it departed
        from, or, inside an epoch, what the unit left, not known), and the path's epoch ends,
        so the next change takes a pre-image of what the other writer left.  The drift is
        committed at once: its seq must come before any the change has reserved."""
        if path.startswith(_ATTIC_SLASH):
            return False
        served, sealed = self.served.get(path), self.sealed_ctime.get(path)
        if st is None:
            changed = served is not None and self.left.get(path) == "file"
        elif not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return False  # a directory's ctime moves with its entries; a link's with its names
        else:
            # a name of the inode the daemon made or removed since (`ln a b; rm b`, or a
            # backup link's partner renamed over) moved its ctime too: the daemon's own change
            named = self.served_ino.get(st.st_ino)
            if named is not None and st.st_ctime_ns <= named + AROUND_SLACK_NS:
                changed = False
            elif served is not None:
                changed = st.st_ctime_ns > served + AROUND_SLACK_NS
            else:
                changed = sealed is not None and st.st_ctime_ns > sealed
        if not changed:
            return False
        pre = None
        if served is None:  # sealed, unchanged since by the daemon: the seal says what it held
            last = self.journal.last_seq_for_path(path)
            ev = self.journal.event(last) if last is not None else None
            if ev is not None and ev["op"] == "seal":
                pre = ev["pre"]
        if pre is not None:
            drift = {"op": "drift", "path": path, "pre": pre, "epoch": True,
                     "unit": outside_unit(AROUND), "actor": AROUND}
        else:
            drift = _around_event(path, self._meta(st) if st is not None else {"kind": "file"},
                                  self.left.get(path, ""))
        self.journal.append(drift)
        log.info("%s was changed around the mount (a process that bypassed it)", path)
        self.epochs.pop(path, None)
        self.unsealed.pop(path, None)
        self.served[path] = time.time_ns()
        self.sealed_ctime.pop(path, None)
        if self.on_around is not None:
            try:
                self.on_around(path)
            except Exception:  # the record is whole; only a cache is left as it was
                log.exception("cannot drop the kernel's cache of %s", path)
        return True

    # -- the write-ahead step -------------------------------------------------------------------
    def _append(self, ev: dict, actor: dict) -> int:
        """Commit ``ev`` (after any failed notes still owed, in the same commit); its seq.
        JournalError (with the errno to answer, ENOSPC for a full state dir) when it cannot be
        committed: the caller must then leave the underlay alone."""
        aliases, self._pending = self._pending, []
        for a in aliases:
            a["actor"] = ev.get("actor", actor["key"])
        if not self._unjournaled and not aliases:
            seq = self.journal.append(ev, actor)
            self._latest(ev, seq)
            return seq
        owed = self._unjournaled
        evs = owed + aliases + [ev]
        seqs = self.journal.append_many(evs, [actor])
        if owed:
            log.info("journaled %d note(s) owed since the journal was full", len(owed))
        self._unjournaled = []
        for e, seq in zip(evs, seqs):
            self._latest(e, seq)
        return seqs[-1]

    def _latest(self, ev: dict, seq: int) -> None:
        """``ev`` (committed as ``seq``) is the latest event of the paths it names."""
        for p in (ev.get("path"), ev.get("path2")):
            ep = self.epochs.get(p) if p is not None else None
            if ep is not None:
                ep.last = seq

    def _left_by(self, ev: dict, left: dict | None = None) -> None:
        """The underlay took ``ev``'s change: what it left at its paths (in ``left``, by
        default the daemon's own ``self.left``)."""
        op, path = ev["op"], ev["path"]
        left = self.left if left is None else left
        kind = _LEFT_KIND.get(op, "")
        if kind != "":
            left[path] = kind
        elif op == "rename":
            exchange = ev.get("flags", 0) & underlay.RENAME_EXCHANGE
            left[path] = ev["pre2"]["kind"] if exchange else None
            left[ev["path2"]] = ev["pre"]["kind"]
        elif op == "mknod":
            left[path] = preimage.kind_of(ev["mode"])
        elif path not in left and "pre" in ev:  # a change in place: the kind it had
            left[path] = ev["pre"].get("kind")

    def _note_failed(self, seq: int, path: str | None, err: int | None, actor_key: str,
                     **more) -> None:
        """Journal that the underlay refused event ``seq`` (``more``: the note's other fields).
        When the journal cannot take the note now (its filesystem is full too), it goes with
        the next event that commits."""
        note = {"op": "failed", "ref": seq, "path": path, "errno": err, "actor": actor_key,
                **more}
        try:
            self.journal.append_many(self._unjournaled + [note], [])
            self._unjournaled = []
        except JournalError as e:
            log.warning("cannot journal that event %d failed (%s): kept to journal later", seq, e)
            self._unjournaled.append(note)

    def _mutation(self, ev: dict, actor: dict) -> "_Mutation":
        """Journal ``ev``, then let the caller change the underlay; a refusal is noted.

        JournalError from the commit reaches the caller before the underlay is touched (write-
        ahead: the body never runs); the filesystem layer answers its errno."""
        return _Mutation(self, ev, actor)

    def _event(self, op: str, path: str, actor: dict, unit: str, **kw) -> tuple[dict, Epoch, bool]:
        ep, new = self._epoch(path, unit)
        ev = {"op": op, "path": path, **unit_fields(unit)}
        if new:
            ev["epoch"] = True
        ev.update(kw)
        return ev, ep, new

    # -- creations ------------------------------------------------------------------------------
    def _owner(self, parent_fd: int, uid: int, gid: int) -> tuple[int, int]:
        """The owner a new object gets: the caller's, but the parent's group when it is setgid."""
        if stat.S_ISGID & os.fstat(parent_fd).st_mode:
            gid = -1
        return uid, gid

    def _fix_owner(self, parent_fd: int, name: str, uid: int, gid: int, mode: int | None,
                   is_dir: bool = False) -> None:
        """Give what a request just made its caller's owner.  Where the owner cannot be given
        (a daemon that is not root, serving another user through allow_other), what it made
        goes again: the request fails and leaves nothing behind (an empty file of the daemon's
        user was left, which no event of the record held)."""
        if uid == self._euid and gid == self._egid:
            return
        try:
            uid, gid = self._owner(parent_fd, uid, gid)
            os.chown(name, uid, gid, dir_fd=parent_fd, follow_symlinks=False)
            if mode is not None and mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(name, mode | (stat.S_IMODE(underlay.lstat_at(parent_fd, name).st_mode)
                                       & stat.S_ISGID), dir_fd=parent_fd)
        except OSError:
            try:
                if is_dir:
                    os.rmdir(name, dir_fd=parent_fd)
                else:
                    os.unlink(name, dir_fd=parent_fd)
            except OSError:
                pass
            raise

    def _creation(self, op: str, parent_fd: int, name: str, actor: dict, **kw):
        path = self.child(parent_fd, name)
        unit = self.units.unit_of(actor, path)
        ev, ep, new = self._event(op, path, actor, unit, **kw)
        if new:
            pre, _ = self._pre_at(parent_fd, name)
            ev["pre"] = pre
            ep.content_saved = ep.meta_saved = True
        return ev

    @_roomy
    @_undoable
    def create(self, parent_fd: int, name: str, flags: int, mode: int, uid: int, gid: int,
               actor: dict) -> int:
        """Create (or open, O_CREAT) ``name``; the fd.  A file this makes anew, opened for
        writing, begins its handle's write run (``run``: ``begin_run`` gives the handle it):
        the handle's first writes join the create's event instead of making one of their
        own (docs/design.md, "A create begins its handle's write run")."""
        self.created = None
        ev = self._creation("create", parent_fd, name, actor, mode=mode)
        if ev.get("pre", {}).get("kind", "absent") != "absent" and flags & os.O_TRUNC:
            # O_CREAT|O_TRUNC on an existing file destroys its content: save it first
            ev["pre"] = self._content_pre(parent_fd, name, ev["path"], ev["pre"])
        elif flags & os.O_ACCMODE != os.O_RDONLY and not self.record_data and \
                ev.get("pre", {}).get("kind") == "absent":
            ev["run"] = True
        with self._mutation(ev, actor) as seq:
            try:
                fd = os.open(name, flags | os.O_CREAT | os.O_CLOEXEC, mode, dir_fd=parent_fd)
            except PermissionError:
                if flags & os.O_EXCL:
                    raise
                # an existing file its owner may not read, opened read-write for the recorder
                fd = underlay.open_own(parent_fd, name, flags & ~os.O_CREAT)
            try:
                if ev.get("pre", {"kind": "absent"})["kind"] == "absent":
                    self._fix_owner(parent_fd, name, uid, gid, mode)
            except OSError:
                os.close(fd)
                raise
        if "run" in ev:
            self.created = (fd, seq, ev["path"], self.epochs[ev["path"]])
        # what undo_create needs, should the request fail after this
        self.made_anew = (fd, seq, ev["path"]) if ev.get("pre", {}).get("kind", "absent") == \
            "absent" else None
        return fd

    def undo_create(self, parent_fd: int, name: str, fd: int, err: int | None,
                    actor: dict) -> None:
        """The request whose ``create`` gave ``fd`` failed after it (the filesystem layer ran
        out of fds): a file that create made anew is removed, as long as ``name`` still holds
        it, and its event voided as a refused change's is (its ``failed`` note), so the record
        holds nothing of it.  An existing file opened is left as it is."""
        made, self.made_anew, self.created = self.made_anew, None, None
        if made is None or made[0] != fd:
            return
        _, seq, path = made
        try:
            st, now = os.fstat(fd), os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
                return
            os.unlink(name, dir_fd=parent_fd)
        except OSError as e:
            log.warning("cannot remove %s, made by a create that failed: %s", path, e)
            return
        self.left[path] = None
        self._note_failed(seq, path, err or errno.EIO, actor["key"])

    def begin_run(self, handle) -> None:
        """``handle`` was opened by the ``create`` (or the truncating open: ``truncate`` with
        ``open_fd``) just made: when that event began a write run, the handle's writes join it
        (as a handle's later writes join the run its first write began), named by its path."""
        made, self.created = self.created, None
        if made is None or made[0] != handle.fd:
            return
        _, seq, path, ep = made
        handle.write_seq, handle.epoch = seq, ep
        handle.name_as(path, self.name_changes)
        handle.empty_run(seq)

    def _content_pre(self, parent_fd: int, name: str, path: str, pre: dict) -> dict:
        if pre["kind"] != "file" or \
                self._withhold(path, pre, lambda: underlay.open_own(parent_fd, name, _READ)) or \
                pre["size"] == 0:
            return pre
        fd = underlay.open_own(parent_fd, name, os.O_RDONLY)
        try:
            if pre["size"] <= self.whole_file_limit:
                pre["blob"] = self._save_whole(fd, pre["size"])
            else:
                pre["ranges"] = [[0, pre["size"], self.content.put_range(fd, 0, pre["size"])]]
        finally:
            os.close(fd)
        return pre

    @_roomy
    @_undoable
    def mkdir(self, parent_fd: int, name: str, mode: int, uid: int, gid: int, actor: dict) -> None:
        ev = self._creation("mkdir", parent_fd, name, actor, mode=mode)
        with self._mutation(ev, actor):
            os.mkdir(name, mode, dir_fd=parent_fd)
            self._fix_owner(parent_fd, name, uid, gid, None, is_dir=True)

    @_roomy
    @_undoable
    def mknod(self, parent_fd: int, name: str, mode: int, rdev: int, uid: int, gid: int,
              actor: dict) -> None:
        ev = self._creation("mknod", parent_fd, name, actor, mode=mode, rdev=rdev)
        with self._mutation(ev, actor):
            os.mknod(name, mode, rdev, dir_fd=parent_fd)
            self._fix_owner(parent_fd, name, uid, gid, None)

    @_roomy
    @_undoable
    def symlink(self, parent_fd: int, name: str, target: str, uid: int, gid: int,
                actor: dict) -> None:
        ev = self._creation("symlink", parent_fd, name, actor, target=target)
        with self._mutation(ev, actor):
            os.symlink(target, name, dir_fd=parent_fd)
            self._fix_owner(parent_fd, name, uid, gid, None)

    @_roomy
    @_undoable
    def link(self, src_fd: int, parent_fd: int, name: str, actor: dict) -> None:
        source = self.rel(src_fd)
        # the source changes no content, but its epoch goes on under two names: another
        # writer's change since the daemon's last is found before (after, its ctime moved)
        self._look_around(source, time.time_ns())
        ev = self._creation("link", parent_fd, name, actor, source=source)
        ev["seq"] = self.journal.reserve_seq()  # the carried names' (a refusal takes them back)
        # one inode under a secret name and another: withheld under both (a content-checked
        # one too, public or not: a key written through the other name, which no pattern
        # checks, would be kept)
        secret_names = set(self.secrets.names), dict(self.secrets.since)
        self._carry_secret(source, ev["path"], since=ev["seq"])
        self._carry_secret(ev["path"], source, since=ev["seq"])
        try:
            with self._mutation(ev, actor):
                underlay.link_fd(src_fd, parent_fd, name, root_fd=self.root_fd, rel=source)
        except OSError:
            # not linked: the names carried go back (else the file was withheld for the rest
            # of the record; found by a bug hunt)
            self._uncarry_secrets(secret_names)
            raise
        try:
            st = os.fstat(src_fd)
        except OSError:
            return
        self._named(st, source, ev["path"])
        self._stamp_names(st, ev["unit"], ev["path"])  # a name more: its ctime moved
        self._capture_afresh((st.st_dev, st.st_ino))

    def _capture_afresh(self, key: tuple[int, int]) -> None:
        """The inode ``key`` has a name it had not when its names' epochs began: the next change
        through any of them must capture afresh, so that it is journaled on the new name too
        (an ``alias`` event with what that name held just before)."""
        names = self.names.get(key)
        if names:
            # the smaller of the two is walked (dict_keys & set): a link a name made in a
            # loop walked every name of the inode, 2,000 links 2,000,000 pops
            for n in self.epochs.keys() & names:
                self.unsealed.setdefault(n, self.epochs.pop(n).unit)

    def seen_linked(self, st: os.stat_result, first: tuple[int, str],
                    second: tuple[int, str]) -> None:
        """The fs layer reached one inode (``st``) by two names, each ``(parent_fd, name)``: a
        hard link made outside the mount (before it, or around it).  When both names hold it
        still, they are known from now on as a link made through the mount is (a change
        through one journals ``alias`` events on the other, a secret stays withheld under
        both).  A link is found so only once both names were looked up: a change through one
        before that is not seen on the other (design.md, "Known limits")."""
        if not stat.S_ISREG(st.st_mode) or self.nlink(st) < 2:
            return
        key = (st.st_dev, st.st_ino)
        try:
            paths = []
            for parent_fd, name in (first, second):
                got = underlay.lstat_at(parent_fd, name)
                if (got.st_dev, got.st_ino) != key:
                    return  # moved away meanwhile: not two names of it
                paths.append(self.child(parent_fd, name))
        except OSError:
            return
        known = self.names.get(key, ())
        if all(p in known for p in paths) or paths[0] == paths[1]:
            return
        try:
            self._carry_secret(paths[0], paths[1], since=0)
            self._carry_secret(paths[1], paths[0], since=0)
        except JournalError as e:  # withheld in this mount still (the names are in memory)
            log.warning("cannot store that %s and %s are one secret inode: %s", *paths, e)
        self._named(st, *paths)
        self._unknown_before(st, [p for p in paths if p not in known], paths)
        self._capture_afresh(key)

    def _unknown_before(self, st: os.stat_result, fresh: list[str], paths: list[str]) -> None:
        """A name of the inode found only now (``fresh``) while another name of it has an
        epoch open, its change made: what the new name held before that change is not known
        here (its first pre-image would be the changed inode, and readers took it for what
        it held all along: replay before the change gave the changed content as exact, a
        revert split the link and wrote that content back; found by a bug hunt).  An
        ``alias`` says so: its content before is not kept.  Not where that epoch only renamed
        the inode to its name (``Epoch.moved``): a rename changes no content, so the new name
        held what it holds; it owes a seal at the unit's end only, its ctime moved
        (``_stamp_names``).  Its alias refused the revert of a plain ``mv`` of a name linked
        in an earlier mount (found by a bug hunt)."""
        for p in fresh:
            src = next((c for c in paths if c != p and c in self.epochs), None)
            if src is None:
                continue
            unit = self.epochs[src].unit
            if self.epochs[src].moved:
                if p not in self.epochs:
                    self.unsealed.setdefault(p, str(unit))
                continue
            pre = self._meta(st)
            if st.st_size:
                pre["unkept"] = True
            try:
                self.journal.append({"op": "alias", "path": p, "pre": pre, "epoch": True,
                                     "actor": "overlayrec", **unit_fields(unit)})
            except JournalError as e:
                log.warning("cannot note that %s held what is not known: %s", p, e)
                continue
            self.epochs.pop(p, None)
            self.unsealed.setdefault(p, str(unit))

    # -- removals -------------------------------------------------------------------------------
    @_roomy
    @_undoable
    def unlink(self, parent_fd: int, name: str, actor: dict) -> None:
        self.name_changes += 1
        path = self.child(parent_fd, name)
        unit = self.units.unit_of(actor, path)
        ev, ep, new = self._event("unlink", path, actor, unit)
        pre, st = self._pre_at(parent_fd, name)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, "unlink", name)
        self._stamp_names(st, unit, path)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "unlink", name)
        if self._withhold(path, pre, lambda: underlay.open_own(parent_fd, name, _READ)):
            ev["pre"] = pre
            with self._mutation(ev, actor):
                os.unlink(name, dir_fd=parent_fd)  # a secret: no attic, no copy, really gone
        elif self._beyond_attic(st, parent_fd):
            self._copy_elsewhere(parent_fd, name, st, pre)
            ev["pre"] = pre
            with self._mutation(ev, actor):
                os.unlink(name, dir_fd=parent_fd)  # its content is in the store: really gone
        elif not (later := self._small_later(st)) and \
                self._keep_small(parent_fd, name, st, pre):
            ev["pre"] = pre
            with self._mutation(ev, actor):
                os.unlink(name, dir_fd=parent_fd)  # its content is in the store: really gone
        else:
            seq = self.journal.reserve_seq()
            ev["seq"] = seq
            pre["attic"] = self.attic_prefix + str(seq)
            self._keep_if_linked(parent_fd, name, st, pre)
            ev["pre"] = pre
            try:
                with self._mutation(ev, actor):
                    # one rename is both the pre-image and the change: the inode lives on in
                    # the attic
                    os.rename(name, pre["attic"], src_dir_fd=parent_fd,
                              dst_dir_fd=self.attic_fd)
            except OSError as e:
                self._crossed(parent_fd, e)
            k = (st.st_dev, st.st_ino)
            self.attic_links[k] = self.attic_links.get(k, 0) + 1
            if later:
                self._kept_later(pre["attic"], seq, pre)
        if self.names:
            self.names.unname(path)
        ep.content_saved = ep.meta_saved = True

    @_roomy
    @_undoable
    def rmdir(self, parent_fd: int, name: str, actor: dict) -> None:
        self.name_changes += 1
        path = self.child(parent_fd, name)
        unit = self.units.unit_of(actor, path)
        ev, ep, new = self._event("rmdir", path, actor, unit)
        pre, _ = self._pre_at(parent_fd, name)
        ev["pre"] = pre
        with self._mutation(ev, actor):
            os.rmdir(name, dir_fd=parent_fd)
        ep.content_saved = ep.meta_saved = True

    @_roomy
    @_undoable
    def rename(self, pfd: int, name: str, npfd: int, nname: str, flags: int, actor: dict) -> None:
        self.name_changes += 1
        path = self.child(pfd, name)
        if npfd == pfd:  # within one directory (an editor's, a formatter's): its name once
            parent = path.rpartition("/")[0]
            path2 = f"{parent}/{nname}" if parent else nname
        else:
            path2 = self.child(npfd, nname)
        unit = self.units.unit_of(actor, path2)  # an edit tool's file is where it lands
        # before the event opens their epochs: did an open epoch change what each name holds?
        untouched = self._untouched(path), self._untouched(path2)
        ev, ep, new = self._event("rename", path, actor, unit, path2=path2)
        if flags:
            ev["flags"] = flags
        pre, st = self._pre_at(pfd, name)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, "rename", name)
        if stat.S_ISDIR(st.st_mode):  # which directory it was: the next mount's outcome
            pre["dino"] = st.st_ino
        ev["pre"] = pre
        withheld = self._withhold(path, pre, lambda: underlay.open_own(pfd, name, _READ))
        pre2, st2 = self._pre_at(npfd, nname)
        if st2 is not None and stat.S_ISDIR(st2.st_mode):
            pre2["dino"] = st2.st_ino
        self._stamp_names(st, unit, path, path2)
        if st2 is not None:
            self._stamp_names(st2, unit, path, path2)
        # a secret renamed over is really gone: no attic link, no copy (overlayrec.secrets)
        withheld2 = self._withhold(path2, pre2, lambda: underlay.open_own(npfd, nname, _READ))
        if path2 in self.served or path2 in self.sealed_ctime:
            self._bypassed(path2, st2)  # before the seq is reserved: the drift comes first
        seq = self.journal.reserve_seq()
        ev["seq"] = seq
        attic_key = None
        exchange_into = False
        # a small file renamed over is copied now, not kept by the attic until the daemon is
        # idle as an unlinked one is: its link into the attic, the event's rewrite and the
        # entry's unlink cost more than the copy, and the rename frees nothing the unlink's
        # deferral would (tools/bench, overlayrec-copynow: docs/bench.md, tenth pass)
        if st2 is not None and not flags & underlay.RENAME_EXCHANGE and not stat.S_ISDIR(st2.st_mode) \
                and not (st.st_dev == st2.st_dev and st.st_ino == st2.st_ino) and not withheld2:
            if self._beyond_attic(st2, npfd):
                self._copy_elsewhere(npfd, nname, st2, pre2)
            elif not self._keep_small(npfd, nname, st2, pre2):
                # the renamed-over inode survives by a hard link in the attic, taken before
                # the rename
                pre2["attic"] = self.attic_prefix + str(seq)
                attic_key = (st2.st_dev, st2.st_ino)
                self._keep_if_linked(npfd, nname, st2, pre2)
                if not flags and not stat.S_ISDIR(st.st_mode) and \
                        self._link_refused(npfd, nname, st2):
                    if self._exchange_safe(pfd, st2):
                        exchange_into = True
                    else:  # no way to keep it: the change goes on, its state before unknown
                        del pre2["attic"]
                        pre2["unkept"] = True
                        attic_key = None
        ev["pre2"] = pre2
        ep2, new2 = self._epoch(path2, unit, checked=True)
        if new2:
            ev["epoch2"] = True
        secret_names = set(self.secrets.names), dict(self.secrets.since)
        self._carry_secret(path, path2, withheld, since=seq)
        if flags & underlay.RENAME_EXCHANGE:
            self._carry_secret(path2, path, withheld2, since=seq)
        linking = bool(attic_key)
        try:
            with self._mutation(ev, actor):
                if attic_key:
                    try:
                        if not exchange_into:
                            os.link(nname, pre2["attic"], src_dir_fd=npfd,
                                    dst_dir_fd=self.attic_fd, follow_symlinks=False)
                    except OSError as e:
                        if not self._may_exchange(e, flags, st) or \
                                not self._exchange_safe(pfd, st2):
                            raise
                        exchange_into = True
                    if exchange_into:  # the rename itself, and the attic's entry
                        self._exchange_into_attic(pfd, name, npfd, nname, pre2["attic"])
                    linking = False
                    self.attic_links[attic_key] = self.attic_links.get(attic_key, 0) + 1
                    self.attic_names[attic_key] = pre2["attic"]
                try:
                    if not exchange_into:
                        underlay.renameat2(pfd, name, npfd, nname, flags)
                except OSError:
                    if attic_key:  # refused (a full disk: retried after a reclaim): no stray link
                        try:
                            self._drop_attic(pre2["attic"], attic_key)
                        except OSError as e:
                            log.warning("cannot drop attic entry %s: %s", pre2["attic"], e)
                    raise
        except OSError as e:
            # not moved: a secret's name carried to path2 goes back (else path2's content
            # was withheld for the rest of the record; found by a bug hunt)
            self._uncarry_secrets(secret_names)
            if not linking:
                raise  # the rename's own refusal (EXDEV across mounts, as natively)
            self._crossed(npfd, e)
        exchange = bool(flags & underlay.RENAME_EXCHANGE)
        if self.names:
            self.names.rename(path, path2, stat.S_ISDIR(st.st_mode), exchange)
            for moved, name in ((st, path2), (st2 if exchange else None, path)):
                if moved is not None and not stat.S_ISDIR(moved.st_mode) and \
                        self.nlink(moved) >= 2:
                    self._end_runs(moved, name)
        # the moved inode's content is in no pre-image (a rename copies nothing): the next
        # content change under the new name, even in this epoch, must save it first.  An
        # exchange moves the other inode to the old name too: the same there
        for moved_to, was in ((ep2, untouched[0]), (ep, untouched[1])) if exchange else \
                ((ep2, untouched[0]),):
            moved_to.meta_saved = True
            moved_to.content_saved = False
            moved_to.size0 = moved_to.ranges = None
            moved_to.moved = was
        if not exchange:
            ep.content_saved = ep.meta_saved = True
        if stat.S_ISDIR(st.st_mode) or (st2 is not None and stat.S_ISDIR(st2.st_mode)):
            self._move_beneath(path, path2, exchange)
            self._moved_dir(path, path2, exchange, seq, stat.S_ISDIR(st.st_mode),
                            st2 is not None and stat.S_ISDIR(st2.st_mode))

    def _untouched(self, path: str) -> bool:
        """Has no open epoch changed what ``path`` names (none is open on it, or the inode
        only came to it by a rename: ``Epoch.moved``)?"""
        ep = self.epochs.get(path)
        return ep is None or ep.moved

    @staticmethod
    def _may_exchange(e: OSError, flags: int, st: os.stat_result) -> bool:
        """The attic's hard link of a renamed-over file refused where the rename itself is
        not: ``protected_hardlinks`` (EPERM: another owner's file the daemon's user may not
        both read and write, which natively its directory lets it replace) or the inode's
        most links (EMLINK).  A plain rename of a non-directory can go by an exchange."""
        return e.errno in (errno.EPERM, errno.EMLINK) and not flags and \
            not stat.S_ISDIR(st.st_mode)

    def _link_refused(self, dirfd: int, name: str, st: os.stat_result) -> bool:
        """Would the kernel refuse the attic's hard link of ``name`` (``st``)?  With
        ``protected_hardlinks`` a process may link only a file it owns, or a regular one it
        may read and write that is neither set-user-ID nor executable set-group-ID (root
        may link any)."""
        if self._euid == 0 or st.st_uid == self._euid or not _PROTECTED_HARDLINKS:
            return False
        mode = st.st_mode
        if stat.S_ISREG(mode) and not mode & stat.S_ISUID and \
                not (mode & stat.S_ISGID and mode & stat.S_IXGRP):
            try:
                return not os.access(name, os.R_OK | os.W_OK, dir_fd=dirfd,
                                     effective_ids=True, follow_symlinks=False)
            except OSError:
                return True
        return True

    def _exchange_safe(self, pfd: int, st2: os.stat_result) -> bool:
        """May the replaced file leave the source's directory for the attic once the two
        names are exchanged?  Not from a sticky directory (``/tmp``'s mode) where neither it
        nor the directory is the daemon's: that move is refused, and so is the exchange back
        (the two files were left swapped, unrecorded; found by a bug hunt)."""
        if self._euid == 0 or st2.st_uid == self._euid:
            return True
        d = os.fstat(pfd)
        return not d.st_mode & stat.S_ISVTX or d.st_uid == self._euid

    def _exchange_into_attic(self, pfd: int, name: str, npfd: int, nname: str,
                             attic: str) -> None:
        """``rename(name, nname)`` with the replaced inode kept as ``attic``, without a link:
        the two names are exchanged, then the old target leaves the source's name for the
        attic.  The kernel holds both directories for the request, so no process served by
        the mount sees the name between the two; one that fails puts the exchange back."""
        underlay.renameat2(pfd, name, npfd, nname, underlay.RENAME_EXCHANGE)
        try:
            os.rename(name, attic, src_dir_fd=pfd, dst_dir_fd=self.attic_fd)
        except OSError:
            underlay.renameat2(pfd, name, npfd, nname, underlay.RENAME_EXCHANGE)
            raise

    def _move_beneath(self, path: str, path2: str, exchange: bool) -> None:
        """Paths below a renamed directory change: their epochs end (owed seals go with them)
        and start afresh under their new names.  The names below the target held other objects
        (the empty directory it replaced had held them once; an exchange moves the other side's
        to ``path``): their epochs end too, or the next change there would be taken as inside
        an epoch of an object that has gone, and journaled without its pre-image."""
        if path == path2:
            return  # onto itself: nothing moved
        src, dst = path + "/", path2 + "/"
        beneath = (src, dst)  # the paths that move or go (one C call a path: these maps hold
        # every path written since its unit's last seal, tens of thousands in a long session)

        def moved(p: str) -> str | None:
            if p.startswith(src):
                return path2 + p[len(path):]
            return path + p[len(path2):] if exchange else None  # beneath dst
        ended: dict[str, str] = {}
        for p in [p for p in self.epochs if p.startswith(beneath)]:
            unit = self.epochs.pop(p).unit
            q = moved(p)
            if q is not None:
                ended[q] = unit
        owed = {p: self.unsealed.pop(p) for p in [p for p in self.unsealed
                                                  if p.startswith(beneath)]}
        for p, unit in owed.items():
            q = moved(p)
            if q is not None:
                self.unsealed[q] = unit
        self.unsealed.update(ended)
        # what the daemon last did to each file, and the ctime its seal found, go with it:
        # a change beneath the mount before the rename is still found at the file's next
        # change under its new name (a user's line read as the call's, a revert removed it).
        # Left under the old name, the stamp was read against whatever file came there (a
        # false drift, the old file's content its pre-image)
        for table in (self.served, self.sealed_ctime, self.left):
            went = {p: table.pop(p) for p in [p for p in table if p.startswith(beneath)]}
            for p, v in went.items():
                q = moved(p)
                if q is not None:
                    table[q] = v

    def _moved_dir(self, path: str, path2: str, exchange: bool, seq: int, is_dir: bool,
                   is_dir2: bool) -> None:
        """Keep ``moved_dirs`` up to date with a rename of ``path`` to ``path2``."""
        src, dst = path + "/", path2 + "/"
        moved = {}
        for p in [p for p in self.moved_dirs if p in (path, path2) or p.startswith((src, dst))]:
            at = self.moved_dirs.pop(p)
            if p == path or p.startswith(src):
                moved[path2 + p[len(path):]] = at
            elif exchange:
                moved[path + p[len(path2):]] = at
        self.moved_dirs.update(moved)
        if is_dir:
            self.moved_dirs[path2] = seq
        if exchange and is_dir2:
            self.moved_dirs[path] = seq

    def _owe_beneath_moved(self) -> list[str]:
        """At the record's end: every path beneath a directory renamed in this mount that has
        no event under its name since owes a seal (returned).  The record knew those paths only from the
        live tree (the rename journals the directory, not what it holds), so an edit made
        while unmounted beneath it read as the record's own end: a revert of the rename moved
        the user's edit back as the call's, with no conflict, and a diff or replay lost the
        files when the directory was renamed again while unmounted (found by bug hunts)."""
        walked: set[str] = set()
        owed_all: list[str] = []
        for top in outermost(self.moved_dirs):  # each walked with the directories beneath it
            failed: list[OSError] = []
            seen_dirs, owed = [], []
            try:  # (the top itself: raised, not given to onerror)
                for dirpath, dirs, files, _ in os.fwalk(top, dir_fd=self.root_fd,
                                                         follow_symlinks=False,
                                                         onerror=failed.append):
                    if dirpath.split("/", 1)[0] == ATTIC_NAME:
                        dirs[:] = []
                        continue
                    seen_dirs.append(dirpath)
                    # the last rename that brought it to its name: of its nearest moved
                    # ancestor, or of one further up (renamed later)
                    since, d = 0, dirpath
                    while d:
                        since = max(since, self.moved_dirs.get(d, 0))
                        d = d.rpartition("/")[0]
                    for name in dirs + files:
                        p = f"{dirpath}/{name}"
                        if p not in self.epochs and p not in self.unsealed and \
                                (self.journal.last_seq_for_path(p) or 0) < since:
                            owed.append(p)
            except OSError as e:
                failed.append(e)
            for p in owed:
                self.unsealed[p] = ""
            owed_all += owed
            if failed:  # a directory beneath it could not be read: nothing there is said absent
                log.warning("cannot walk all of %s to seal what lies beneath: %s", top,
                            failed[0])
                # said so by its seal (``beneath``: false): a mark an earlier walk left on it
                # no longer tells what it holds
                self.beneath_failed.add(top)
                if top not in self.epochs:
                    self.unsealed.setdefault(top, "")
                continue
            walked.update(seen_dirs)
        # the seals of the directories walked say so (``beneath``): a name beneath with no
        # event of its own was not there at the record's end, whatever the live tree holds
        # later; and a name found in one at the next mount was made while unmounted
        for d in walked:
            if d not in self.epochs:
                self.unsealed.setdefault(d, "")
        self.beneath_sealed = walked
        self.moved_dirs.clear()
        return owed_all

    def _made_beneath(self, tops: list[str], covered: set[str], marks: dict[str, bool],
                      renames: RenameIndex) -> list[dict]:
        """At mount: the names made while unmounted beneath the directories ``tops``, whose
        last seals say everything beneath them was sealed too (``beneath``), with all beneath
        them: a drift from absent and a seal each.  ``covered``: the names the mount's
        comparison of the seals looked at (each sealed object under its name now); any other
        name beneath is new (one the record used for an object moved away since, or beneath a
        file that became a directory, was passed by: a hunt found both).  ``marks``: the
        directories' own marks (a false one: what lies beneath it is the live tree's to say).
        A top that cannot be walked whole is sealed again with its mark false."""
        j = self.journal

        def known(p: str) -> bool:
            if p in covered:
                return True
            # a chain the comparison passed by (not ended by a seal) is the record's while
            # its object is still called so; a name whose object moved on is free
            last = j.last_seq_for_path(p)
            return last is not None and _name_now(j, renames, p, last) == p

        events, new = [], []
        for top in tops:
            try:
                if not stat.S_ISDIR(self._lstat(top).st_mode):
                    continue  # replaced while unmounted: its seal's comparison journals it
            except OSError:
                continue  # gone (removed, renamed): the same
            failed: list[OSError] = []
            try:
                for dirpath, dirs, files, _ in os.fwalk(top, dir_fd=self.root_fd,
                                                         follow_symlinks=False,
                                                         onerror=failed.append):
                    keep = []
                    for name in sorted(dirs):
                        p = f"{dirpath}/{name}"
                        if not known(p):
                            new.append(p)
                            for dp, ds, fs, _ in os.fwalk(p, dir_fd=self.root_fd,
                                                          follow_symlinks=False,
                                                          onerror=failed.append):
                                new.extend(f"{dp}/{n}" for n in sorted(ds + fs))
                        elif marks.get(p) is not False:
                            keep.append(name)
                    dirs[:] = keep
                    new.extend(p for p in (f"{dirpath}/{n}" for n in sorted(files))
                               if not known(p))
            except OSError as e:
                failed.append(e)
            if failed:
                log.warning("cannot look for names made beneath %s: %s", top, failed[0])
                events.append({"op": "seal", "path": top, "pre": self._seal_pre(top),
                               "actor": "overlayrec", "beneath": False})
        for p in new:
            events.append({"op": "drift", "path": p, "pre": dict(preimage.ABSENT),
                           "epoch": True, "unit": outside_unit(UNMOUNTED),
                           "actor": UNMOUNTED})
            events.append({"op": "seal", "path": p, "pre": self._seal_pre(p),
                           "actor": "overlayrec"})
        return events

    def _carried_beneath(self, path: str) -> bool | None:
        """The ``beneath`` mark directory ``path``'s history leaves its next seal
        (schema.beneath_rule): an earlier mark is carried on over its metadata's changes (a
        later unit's seal of it lost the mark, and a file made beneath it while unmounted was
        taken for one it held all along: found by a bug hunt); false where it came by a
        rename not walked yet; None: no mark (the directories above it say)."""
        j = self.journal
        got = beneath_rule((e, path) for e in map(j.event, reversed(j.seqs_for_path(path)))
                           if e is not None)
        return None if got == "up" else got

    def _stamp_names(self, st: os.stat_result, unit: str, *own: str) -> None:
        """The inode ``st`` loses or gains a name, or one of its names moves: its ctime moves
        under its other names too, known or not (a link made before the mount): ``served_ino``,
        seal.  Each other name the daemon knows (not ``own``, the names the change journals
        itself) whose epoch has ended owes a seal at ``unit``'s end: its last seal kept the
        ctime from before, and where that seal has no hash (a file past the whole-file limit)
        a moved ctime with the link count unmoved (a rename) reads as an edit made while
        unmounted (a false drift: a revert of the call refused, "changed")."""
        if st.st_nlink > 1:
            self.served_ino[st.st_ino] = time.time_ns()
            if not self.names or not stat.S_ISREG(st.st_mode):
                return
            key = (st.st_dev, st.st_ino)
            # a name with an epoch, or owing a seal already, is sealed at its own epoch's end
            # anyway, after this: only the others are looked at (set.difference of a dict
            # walks the set in C: a loop making links walked every name in Python)
            for other in sorted(self.names.get(key, frozenset()).difference(self.unsealed)
                                .difference(self.epochs).difference(own)):
                try:
                    ost = self._lstat(other)
                except (FileNotFoundError, NotADirectoryError):
                    ost = None
                except OSError:  # a way its owner may not search: the seal finds it
                    ost = st
                if ost is None or (ost.st_dev, ost.st_ino) != key:
                    self.names.discard(key, other)  # not a name of it any more (as _alias)
                    continue
                self.unsealed[other] = str(unit)

    def _end_runs(self, st: os.stat_result, name: str) -> None:
        """A linked inode has a new name (``name``): the write runs through its other names end
        here, so their next write is an event again, journaled on the new name too (an
        ``alias``); joined unseen, it would change the new name after the event that made it."""
        names = self.names.get((st.st_dev, st.st_ino))
        if names:
            for other in self.epochs.keys() & names:  # the smaller walked
                if other != name:
                    self.epochs[other].last = 0

    # -- content --------------------------------------------------------------------------------
    def _capture(self, path: str, fd: int, unit: str, lo: int, hi: int | None, *,
                 checked: bool = True) -> dict | None:
        """Save what [lo, hi) of the file at ``fd`` is about to lose (hi None: to its end).
        ``checked``: the caller looked around the mount already (a write: once a run).

        Returns the event to commit ahead of the change, or None when nothing new needs saving.
        """
        ep, new = self._epoch(path, unit, checked=checked)
        if ep.content_saved and not new:
            return None
        st = os.fstat(fd)
        ev = {"path": path, **unit_fields(unit)}
        pre = None
        if new:
            ev["epoch"] = True
            pre = self._meta(st)
            ep.meta_saved = True
        if not ep.content_saved and self._withhold(path, None, lambda: os.dup(fd)):
            # a secret path: its content is never kept, the pre-image says so (its size stays)
            (pre := pre or {"facet": "content"})["withheld"] = True
            ep.content_saved = True
        if ep.size0 is None and not ep.content_saved:
            ep.size0 = st.st_size
            if self._whole_copy(path, st):
                (pre := pre or {"facet": "content"})["blob"] = self._save_whole(fd, st.st_size) \
                    if st.st_size else None
                if pre.get("blob") is None:
                    pre.pop("blob")
                ep.content_saved = True
            else:
                ep.ranges = RangeSet()
        if not ep.content_saved:
            end = ep.size0 if hi is None else min(hi, ep.size0)
            saved = []
            for a, b in (ep.ranges.missing(lo, end) if lo < end else []):
                saved.append([a, b - a, self.content.put_range(fd, a, b - a)])
                ep.ranges.add(a, b)
            if saved:
                (pre := pre or {"facet": "content"})["ranges"] = saved
        if pre is None and not new:
            return None
        if pre is not None:
            ev["pre"] = pre
            self._alias(path, st, unit, pre, content=True)
            # the change follows now, not when _epoch began: saving a large pre-image takes
            # longer than the seal's slack, and its ctime would read as a change around the
            # mount (AROUND_SLACK_NS)
            self.served[path] = time.time_ns()
        return ev

    def _whole_copy(self, path: str, st: os.stat_result) -> bool:
        """Is the pre-image of ``path``'s new epoch (its file's stat ``st``) its whole content,
        not ranges?  Past RANGES_PAST, only for its first WHOLE_COPIES epochs, unless the file
        has other names: the aliases of a change through one take the whole content (a range
        pre-image leaves them unknown at that point)."""
        if st.st_size > self.whole_file_limit:
            return False
        if st.st_size <= self.ranges_past or self.nlink(st) > 1:
            return True
        copies = self.whole_copies.get(path, 0)
        if copies >= self.copies_first:
            return False
        if len(self.whole_copies) >= WHOLE_COPIES_KEPT:
            self.whole_copies.clear()  # bounded memory: at worst a few more whole copies
        self.whole_copies[path] = copies + 1
        return True

    # -- hard links -----------------------------------------------------------------------------
    def _keep_if_linked(self, dirfd: int, name: str, st: os.stat_result, pre: dict) -> None:
        """An inode leaving a name for the attic while other names keep it: writes through
        those change the attic's copy too, so its content is kept now (small files)."""
        if not stat.S_ISREG(st.st_mode) or self.nlink(st) < 2 or \
                st.st_size > self.whole_file_limit:
            return
        try:
            fd = underlay.open_own(dirfd, name, os.O_RDONLY | os.O_NONBLOCK)
        except PermissionError:
            return  # another owner's, unreadable: no reader could read it either way
        try:
            pre["blob"] = self._save_whole(fd, st.st_size)
        finally:
            os.close(fd)

    def _alias(self, path: str, st: os.stat_result, unit: str, pre: dict, *,
               content: bool) -> None:
        """``path``'s inode is about to change (its data when ``content``, else only its
        metadata): every other name the daemon knows it by changes with it.  Queue an ``alias``
        event for each (its pre-image: the same inode's, under that name), committed with the
        change's own event."""
        if not self.names or self.nlink(st) < 2:
            return
        key = (st.st_dev, st.st_ino)
        for other in sorted(self.names.get(key, frozenset()) - {path}):
            try:
                ost = self._lstat(other)
            except OSError:
                ost = None
            if ost is None or (ost.st_dev, ost.st_ino) != key:
                self.names.discard(key, other)
                continue
            apre = self._meta(st)
            if "blob" in pre:
                apre["blob"] = pre["blob"]
            elif content and st.st_size:
                # past the whole-file limit (or withheld): the data the other name held is
                # not kept under it, so a reader may not take it from a later state
                apre["unkept"] = True
            # the other name's content changes with every write through this one, unseen
            # there: its epoch ends here, so its next own change captures a fresh pre-image
            self.epochs.pop(other, None)
            self.unsealed.setdefault(other, str(unit))
            self._pending.append({"op": "alias", "path": other, "source": path, "pre": apre,
                                  "epoch": True, **unit_fields(unit)})

    def _alias_again(self, path: str, fd: int, unit: str, *, content: bool = True) -> None:
        """A change through ``path`` inside its epoch (it takes no pre-image of its own): the
        inode's other known names change with it, unseen there, so each gets an ``alias`` event
        again, its pre-image the inode as it is now (the content kept for files up to the
        whole-file limit).  A write run's later writes are no events, here as under ``path``."""
        if not self.names:
            return
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or self.nlink(st) < 2 or \
                not self.names.get((st.st_dev, st.st_ino), set()) - {path}:
            return
        pre = self._meta(st)
        if not self._withhold(path, pre, lambda: underlay.reopen_own(fd, os.O_RDONLY)) and \
                st.st_size <= self.whole_file_limit:
            if st.st_size == 0:
                pre["blob"] = self.content.put_bytes(b"")
            else:
                rfd = underlay.reopen_own(fd, os.O_RDONLY)
                try:
                    pre["blob"] = self._save_whole(rfd, st.st_size)
                finally:
                    os.close(rfd)
        self._alias(path, st, unit, pre, content=content)

    def _lstat(self, path: str) -> os.stat_result:
        parent, _, name = path.rpartition("/")
        dfd = underlay.open_beneath(self.root_fd, parent) if parent else os.dup(self.root_fd)
        try:
            return underlay.lstat_at(dfd, name)
        finally:
            os.close(dfd)

    def _named(self, st: os.stat_result, *paths: str) -> None:
        if stat.S_ISREG(st.st_mode) and self.nlink(st) > 1:
            self.names.add((st.st_dev, st.st_ino), paths)

    @_undoable
    def before_write(self, handle, off: int, length: int, data: bytes | None = None) -> int | None:
        """Called before each write through a handle; commits ahead whatever must be saved.

        In full-fidelity mode (``record_data``) every write is an event carrying its data, so
        the tree can be replayed exactly at every event, not only at epoch boundaries.
        Returns the seq of the event it journaled, or None when the write joins the handle's
        run (the caller counts it in the run once the underlay has made it: ``write``)."""
        if handle.path in self.served or handle.path in self.sealed_ctime:
            ep = self.epochs.get(handle.path)
            if handle.write_seq is None or ep is None or handle.epoch is not ep or \
                    ep.last != handle.write_seq:  # a new run (below): looked at once a run
                self._bypassed(handle.path, os.fstat(handle.fd))
        captured = ev = self._capture(handle.path, handle.fd, handle.unit, off, off + length)
        if self.record_data and data is not None:
            ev = ev or {"path": handle.path, **unit_fields(handle.unit)}
            # a secret's written data is never kept, nor a content-checked path's (what is
            # written may be a key)
            if not self.secrets.match(handle.path) and not self.secrets.checked(handle.path):
                ev["data"] = self.content.put_bytes(data)
        if captured is None:
            ep = self.epochs.get(handle.path)
            if handle.write_seq is None or ep is None or handle.epoch is not ep or \
                    ep.last != handle.write_seq:
                # a new run: the handle's first write, or one after another event on the path
                # (another handle's write or truncate, a chmod, a rename): readers take the
                # state after that event from it, so no write may follow it unseen; the
                # inode's other names change with the run (also when each write is an event
                # of this name, recording data)
                ev = ev or {"path": handle.path, **unit_fields(handle.unit)}
                self._alias_again(handle.path, handle.fd, handle.unit)
            elif ev is None:
                return None
        ev["op"] = "write"
        ev["offset"], ev["length"] = off, length
        ev["actor"] = handle.actor["key"]
        if handle.opened_run:
            # the run the create (or the truncating open) began ends here (another event on
            # the path came first): readers learn where its last write was, as from a release
            # (with none, the state just after that event is exact, as it was when the first
            # write was an event)
            self.note_extents(handle)
        handle.write_seq = self._append(ev, handle.actor)
        self.left[handle.path] = "file"
        handle.epoch = self.epochs.get(handle.path)
        handle.reset_extent(off, length, self.journal.last_reserved())
        return handle.write_seq

    def note_extents(self, handle) -> None:
        """Journal where ``handle``'s write run ended (its extents note: a summary, not a
        pre-image; lost when the journal cannot take it, and said so)."""
        try:
            self.journal.put_extents(handle.write_seq, {
                "writes": handle.writes, "bytes": handle.nbytes, "lo": handle.lo,
                "hi": handle.hi, "end": handle.last_at})
        except JournalError as e:
            log.warning("extents of event %d not journaled: %s", handle.write_seq, e)

    def grown_beneath(self, handle, st: os.stat_result) -> None:
        """An O_APPEND write through ``handle`` found its file (``st``) longer than the kernel
        knew: another writer appended around the mount.  Within the handle's write run the
        first write's look (before_write) is long past, so the run would take the other
        writer's bytes as its own; where the ctime says it came after the daemon's last write
        (past the slack) it is journaled as such, and the run's next write begins an epoch.
        Only appends tell so; a write run of other writes is not looked at again."""
        last = self.served.get(handle.path)  # stamped at each write (_epoch)
        if last is not None and st.st_ctime_ns > last + AROUND_SLACK_NS:
            self._bypassed(handle.path, st)

    @_roomy
    @_undoable
    def write(self, handle, off: int, data: bytes) -> int:
        """A write through ``handle``: journaled ahead (``before_write``), then made; bytes
        written.  One the underlay refuses (ENOSPC) after its event was journaled gets a
        ``failed`` note, and the handle's next write a fresh event."""
        self.units.before_held_write(handle.actor)
        seq = self.before_write(handle, off, len(data), data)
        try:
            n = os.pwrite(handle.fd, data, off)
        except OSError as e:
            if seq is not None:
                handle.write_seq = None
                self._note_failed(seq, handle.path, e.errno, handle.actor["key"])
            raise
        # the run's extents count what the underlay made: a write it refused inside the run
        # is not in them, one it made short only as far as it went (the note says where the
        # run wrote, never more)
        if seq is None:
            handle.note_write(off, n, self.journal.last_reserved())
        elif n != len(data):
            handle.reset_extent(off, n, handle.last_at)
        return n

    @_roomy
    @_undoable
    def truncate(self, fd: int, size: int, actor: dict, *, handle=None,
                 open_fd: int | None = None) -> None:
        """Truncate the file behind the O_PATH ``fd``: by setattr (through ``handle`` when the
        caller named one, whose opener it is attributed to) or by an O_TRUNC open (``open_fd``,
        the opener's fd, already open without O_TRUNC so the content can be saved first).

        An O_TRUNC open for writing of a file with this one name begins its handle's write
        run, as a create does (``run``; ``begin_run`` gives the handle it): the handle's first
        writes join the truncate's event (docs/design.md, "A truncating open begins its
        handle's write run")."""
        self.created = None
        if handle is not None:
            self.units.before_held_write(handle.actor)
            path, unit, actor, rfd = handle.path, handle.unit, handle.actor, handle.fd
        else:
            path = self.rel(fd)
            unit, rfd = self.units.unit_of(actor, path), open_fd
        tmp = None
        accmode = os.O_ACCMODE & _fd_flags(rfd) if rfd is not None else None
        if rfd is None or accmode == os.O_WRONLY:
            rfd = tmp = underlay.reopen_own(fd, os.O_RDONLY, self.before_grant)
        try:
            ev = self._capture(path, rfd, unit, size, None, checked=False)
            if ev is None:  # inside the path's epoch: its other names still change, unseen
                ev = {"path": path, **unit_fields(unit)}
                self._alias_again(path, rfd, unit)
            # no other name (an alias to follow, an attic link a write would change): the
            # run's writes change this name only
            run = open_fd is not None and size == 0 and accmode != os.O_RDONLY and \
                not self.record_data and os.fstat(rfd).st_nlink == 1
        finally:
            if tmp is not None:
                os.close(tmp)
        ev["op"] = "truncate"
        ev["size"] = size
        if run:
            ev["run"] = True
        with self._mutation(ev, actor) as seq:
            underlay.truncate_fd(fd, size)
        if run:
            self.created = (open_fd, seq, path, self.epochs[path])

    # -- metadata -------------------------------------------------------------------------------
    def _meta_event(self, op: str, fd: int, actor: dict, where: tuple | None = None,
                    **kw) -> dict:
        """The event of a metadata change, with the pre-image its epoch still owes; ``where``:
        the (path, unit) of the fd when the caller has them already."""
        if where is None:
            path = self.rel(fd)
            where = path, self.units.unit_of(actor, path)
        path, unit = where
        ev, ep, new = self._event(op, path, actor, unit, **kw)
        if not ep.meta_saved:
            st = os.fstat(fd)
            pre = self._meta(st)
            if pre["kind"] == "symlink":
                pre["target"] = os.readlink("", dir_fd=fd)
            xattrs = underlay.list_xattrs(fd, pre["kind"] == "symlink")
            if xattrs:
                pre["xattrs"] = {k: v.hex() for k, v in xattrs.items()}
            if not new:
                pre["facet"] = "meta"
            ev["pre"] = pre
            ep.meta_saved = True
            if pre["kind"] == "file":
                self._alias(path, st, unit, pre, content=False)
        else:
            self._alias_again(path, fd, unit, content=False)
        return ev

    @_roomy
    @_undoable
    def chmod(self, fd: int, mode: int, actor: dict) -> None:
        with self._meta_change("chmod", fd, actor, mode=mode):
            underlay.chmod_fd(fd, mode)

    @_roomy
    @_undoable
    def chown(self, fd: int, uid: int, gid: int, actor: dict) -> None:
        with self._meta_change("chown", fd, actor, uid=uid, gid=gid):
            underlay.chown_fd(fd, uid, gid)

    def _meta_change(self, op: str, fd: int, actor: dict, **kw):
        """The context in which to make a chmod, chown or utimens: its event held
        (``_unchanging``), else written ahead with the pre-image its epoch owes."""
        held, where = self._unchanging(op, fd, actor, **kw)
        if held is not None:
            return held
        return self._mutation(self._meta_event(op, fd, actor, where, **kw), actor)

    def _unchanging(self, op: str, fd: int, actor: dict, **kw) -> tuple["_Held | None",
                                                                          tuple | None]:
        """For a chmod to the mode the file has (``mode``), a chown to the owner it has
        (``uid``, ``gid``; -1: unchanged) or a utimens (``op``): a context in which to make
        it, its event held for the next commit (Journal.hold_event), or None when it must be
        an event of its own; with the (path, unit) of ``fd`` when it looked them up (None
        otherwise), so that the event of its own does not look them up again.

        Tar, ``sed -i`` and the formatter pattern make one such change a file, tar a utimens
        too.  None changes what the record reconstructs (a state is a kind, a mode, an owner
        and content: times are not part of it, engines.states), so no reader's answer differs
        while it waits and nothing is lost when it is not written ahead: held only when no
        setuid or setgid bit is there for the kernel to clear, the inode has this one name
        (no alias to follow), and the path's epoch is the unit's own with its metadata saved
        (no pre-image owed).  The path's next write starts a new run, as after any event on
        it (``Epoch.last``)."""
        if not self.journal.hold_notes:
            return None, None
        st = os.fstat(fd)
        setid = stat.S_ISUID | stat.S_ISGID
        if (st.st_mode | kw.get("mode", 0)) & setid or \
                (st.st_nlink != 1 and not stat.S_ISDIR(st.st_mode)):
            return None, None
        if op != "utimens" and (
                "mode" in kw and stat.S_IMODE(kw["mode"]) != stat.S_IMODE(st.st_mode) or
                kw.get("uid", -1) not in (-1, st.st_uid) or kw.get("gid", -1) not in (-1, st.st_gid)):
            return None, None  # a change of the state
        path = self.rel(fd)
        unit = self.units.unit_of(actor, path)
        ep = self.epochs.get(path)
        if ep is None or ep.unit != unit or not ep.meta_saved or \
                (path in self.served and self._bypassed(path, st)):
            return None, (path, unit)
        self.served[path] = time.time_ns()  # its ctime moves with it (seal)
        ev = {"op": op, "path": path, **unit_fields(unit), **kw, "actor": actor["key"]}
        return _Held(self.journal, ev, ep, actor), None

    @_roomy
    @_undoable
    def utimens(self, fd: int, atime_ns, mtime_ns, is_symlink: bool, actor: dict) -> None:
        with self._meta_change("utimens", fd, actor, atime_ns=atime_ns, mtime_ns=mtime_ns):
            underlay.utimens_fd(fd, atime_ns, mtime_ns, is_symlink)

    @_roomy
    @_undoable
    def setxattr(self, fd: int, name: str, value: bytes, actor: dict,
                 at: str | None = None) -> None:
        """``at``: a symlink's path from its parent (fs.Operations._symlink_at), not
        followed; the object behind ``fd`` otherwise."""
        kw = {}
        if name == underlay.ACL_ACCESS:
            # an access ACL sets the mode's permission bits (``sed -i`` copies one onto its
            # temp file): the mode after, for a reader replaying forward (engines.states)
            kw["mode"] = underlay.acl_mode(value, os.fstat(fd))
        with self._mutation(self._meta_event("setxattr", fd, actor, name=name, size=len(value),
                                             **kw), actor):
            os.setxattr(at or underlay.proc_path(fd), name, value, follow_symlinks=at is None)

    @_roomy
    @_undoable
    def removexattr(self, fd: int, name: str, actor: dict, at: str | None = None) -> None:
        with self._mutation(self._meta_event("removexattr", fd, actor, name=name), actor):
            os.removexattr(at or underlay.proc_path(fd), name, follow_symlinks=at is None)

    # -- seals ----------------------------------------------------------------------------------
    def _seal_pre(self, path: str, keep: bool = True, seen: list | None = None) -> dict:
        """What ``path`` holds now, as a seal: metadata, a symlink's target, and a file's
        content hash (the content itself kept in the store when ``keep`` and it is small).
        ``seen`` gets the file's ctime as found, before any read of the daemon's moved it."""
        return self._in_parent(path,
                               lambda dfd, name: self._seal_at(dfd, name, path, keep, seen),
                               lambda: dict(preimage.ABSENT))

    def _in_parent(self, path: str, fn, absent):
        """``fn(dfd, name)`` in ``path``'s directory, or ``absent()`` when its way is not there
        (or leads through a symlink).  A directory on the way, or the parent, that its owner may
        not search (``chmod 600 d``) is searched by its owner's leave
        (``underlay.searchable_own``): a path beneath it is never taken for absent."""
        parent, _, name = path.rpartition("/")
        try:
            dfd = underlay.open_beneath(self.root_fd, parent) if parent else os.dup(self.root_fd)
        except PermissionError:
            dfd = None
        except OSError:
            return absent()
        if dfd is not None:
            try:
                return fn(dfd, name)
            except PermissionError:
                pass
            finally:
                os.close(dfd)
        with contextlib.ExitStack() as stack:
            try:
                dfd = stack.enter_context(underlay.searchable_own(self.root_fd, parent))
            except PermissionError:
                raise
            except OSError:
                return absent()
            return fn(dfd, name)

    def _seal_at(self, dfd: int, name: str, path: str, keep: bool,
                 seen: list | None = None) -> dict:
        try:
            pre, st = self._pre_at(dfd, name)
            if seen is not None and st is not None:
                seen.append(st.st_ctime_ns)
            if self._withhold(path, pre, lambda: underlay.open_own(dfd, name, _READ)):
                return pre  # no blob and no hash: a short secret's fast hash is brute-forced
            if pre["kind"] == "file":
                pre["ctime_ns"] = st.st_ctime_ns  # an edit that puts the mtime back moves it
                if st.st_nlink != pre["nlink"]:
                    # the attic holds links of it too: the link count a stat outside the mount
                    # sees, which preimage.matches compares (a link counted apart from the
                    # attic's was taken for a link made, and the ctime an edit moved for it)
                    pre["links"] = st.st_nlink
            if pre["kind"] == "file" and pre["size"] <= self.whole_file_limit * SEAL_HASH_FACTOR:
                fd = underlay.open_own(dfd, name, os.O_RDONLY | os.O_NONBLOCK)
                try:
                    if pre["size"] > self.whole_file_limit:
                        pre["hash"] = preimage.hash_fd(fd)  # not kept: told apart, not known
                    elif keep:
                        try:
                            pre["blob"] = pre["hash"] = self.content.put_range(fd, 0,
                                                                               pre["size"])
                        except OSError as e:
                            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                                raise
                            # the store is full: the seal says what the file holds, without
                            # keeping it (a later change to it is found; what it held is not
                            # known).  Passed over, it was taken for absent beneath a renamed
                            # directory (found by a bug hunt)
                            pre["hash"] = preimage.hash_fd(fd)
                    else:
                        pre["hash"] = preimage.hash_fd(fd)
                finally:
                    os.close(fd)
            return pre
        except (FileNotFoundError, NotADirectoryError):
            return dict(preimage.ABSENT)

    def seal(self, unit: str | None = None) -> int:
        """End the epochs of ``unit`` (of every unit: None) by journaling what each of their
        paths holds now.  A reader ends each path's chain at its last seal, so a change made
        later around the mount is told apart from the unit's own.  Returns how many were sealed."""
        paths = {p for p, ep in self.epochs.items() if unit is None or ep.unit == unit}
        paths |= {p for p, u in self.unsealed.items() if unit is None or u == unit}
        # the directories walked at the record's end last, the deepest first: a ``beneath``
        # mark is committed only after everything beneath it (a state dir full or a kill
        # between two chunks left a directory marked and the files of later chunks unsealed,
        # which readers then took for absent: found by a bug hunt)
        marked = paths & self.beneath_sealed
        ordered = sorted(paths - marked) + sorted(marked, key=lambda p: (-p.count("/"), p))
        done = 0
        self.seal_failed = []
        # a chunk at a time, each committed before the next is read: a unit that changed
        # 20,000 paths was sealed in one batch, 5 KB a path held at once (110 MB), which the
        # daemon's heap kept for good after (its RSS 190 MB higher; 1.2 GB after 100k files)
        for i in range(0, len(ordered), SEAL_CHUNK):
            got = self._seal_some(ordered[i:i + SEAL_CHUNK], unit, after=i > 0)
            if got is None:
                break
            done += got
        if unit is None:
            # the walk's marks were for this seal: a mount that goes on after its recovery
            # may move another directory to one of those names, whose seal must not say so
            self.beneath_sealed, self.beneath_failed = set(), set()
        return done

    def _seal_some(self, paths: list[str], unit: str | None, after: bool) -> int | None:
        """seal() of these paths, in one commit (``after`` a chunk: that one committed first,
        its batch let go): how many events; None when the state dir is full at a unit's end
        (the paths' epochs stay open)."""
        events = []
        for p in paths:
            served, seen = self.served.get(p), []
            try:
                pre = self._seal_pre(p, seen=seen)
            except OSError as e:  # an unreadable path stays unsealed: its chain ends live
                log.warning("cannot seal %s: %s", p, e)
                self.seal_failed.append(p)
                continue
            if served is not None and pre.get("ino") in self.served_ino:
                served = max(served, self.served_ino.pop(pre["ino"]))
            if served is not None and seen and self._around(pre, seen[-1], served):
                events.append(_around_event(p, pre, self.left.get(p, "")))
            elif served is not None and pre["kind"] == "absent" and \
                    self.left.get(p) not in (None, "", "absent") and \
                    not p.startswith(_ATTIC_SLASH):
                # the daemon left a file (a directory, a symlink) there, and no change of its
                # removed it: a process that bypassed the mount did, while the unit went on,
                # or while no daemon recorded after a kill (a directory the call made, removed
                # then, read as the call's own removal: found by a bug hunt)
                events.append(_around_event(p, {"kind": self.left[p]}))
            elif served is not None and p in self.recovering and pre["kind"] == "dir" and \
                    seen and seen[-1] > served + AROUND_SLACK_NS:
                # a directory made, or its entries changed, after a killed daemon's last
                # stamp (its own changes came before): what the unit left there, and what lay
                # beneath it when a rename moved it, are not known (a directory the call
                # removed, made again then, read as the call's; a file removed then beneath a
                # directory the call renamed was lost from every point: found by a bug hunt)
                events.append(_around_event(p, pre, self.left.get(p, "")))
            events.append({"op": "seal", "path": p, "pre": pre, "actor": "overlayrec",
                           # of every unit (an unmount, the mount after a killed daemon): no
                           # descriptor of the mount's outlives it, so a write run ends here
                           **({"closing": True} if unit is None else {}),
                           **self._beneath_mark(p, pre)})
        self._ctimes_after_reads([(e["path"], e["pre"]) for e in events if e["op"] == "seal"])
        sealed_ctimes = {e["path"]: e["pre"]["ctime_ns"] for e in events
                         if e["op"] == "seal" and "ctime_ns" in e["pre"] and
                         e["pre"].get("nlink", 1) == 1 and "links" not in e["pre"] and
                         not e["path"].startswith(_ATTIC_SLASH)}
        try:
            if after:
                self.journal.flush()
            self.journal.append_many(events, [])
        except JournalError as e:
            if unit is None:  # the record's end (unmount, recovery): the caller must know
                raise
            # a unit's end, the state dir full: its epochs stay open, and the next seal (at the
            # latest at unmount) journals what their paths hold then: late, never missing
            log.warning("cannot seal %d path(s) at the end of %s (%s): left open",
                        len(events), unit, e)
            return None
        for p in paths:
            self.epochs.pop(p, None)
            self.unsealed.pop(p, None)
            self.served.pop(p, None)
            self.left.pop(p, None)
            self.recovering.discard(p)
        self.sealed_ctime.update(sealed_ctimes)
        while len(self.sealed_ctime) > SEALED_CTIMES:  # the oldest first (insertion order)
            del self.sealed_ctime[next(iter(self.sealed_ctime))]
        if self.on_around is not None:
            for e in events:
                if e["op"] == "drift":
                    try:
                        self.on_around(e["path"])
                    except Exception:  # the record is whole; only a cache is left as it was
                        log.exception("cannot drop the kernel's cache of %s", e["path"])
        return len(events)

    def _beneath_mark(self, path: str, pre: dict) -> dict:
        """The ``beneath`` field of a seal of ``path`` (a directory): true where everything
        beneath it was walked and sealed at the record's end, false where the walk or a seal
        beneath it failed (a path left unsealed there is the live tree's to say: it was taken
        for absent), an earlier mark carried on otherwise."""
        if pre["kind"] != "dir":
            return {}
        if path in self.beneath_sealed:
            inside = path + "/"
            return {"beneath": not any(f.startswith(inside) for f in self.seal_failed)}
        if path in self.beneath_failed:
            return {"beneath": False}
        mark = self._carried_beneath(path)
        return {} if mark is None else {"beneath": mark}

    def _ctimes_after_reads(self, sealed: list[tuple[str, dict]]) -> None:
        """Files their owner may not read were read by the owner's leave (a chmod and back:
        underlay.reopen_own), which moves the ctime, also under the other names of a linked
        one sealed earlier in the pass: their seals take the ctime as the pass left it, or no
        reader (who may not read them) could ever find them as sealed."""
        for path, pre in sealed:
            if pre["kind"] != "file" or pre.get("mode", 0) & stat.S_IRUSR:
                continue
            st = self._in_parent(path, lambda dfd, name: underlay.lstat_at(dfd, name)
                                 if name else os.fstat(dfd), lambda: None)
            if st is not None and (st.st_ino, st.st_size, st.st_mtime_ns) == \
                    (pre.get("ino"), pre.get("size"), pre.get("mtime_ns")):
                pre["ctime_ns"] = st.st_ctime_ns

    def _around(self, seal: dict, ctime_ns: int, served: int) -> bool:
        """Was this file, sealed as ``seal`` and found with ``ctime_ns``, changed after the
        daemon last changed it (``served``)?  Its ctime says so: a process that bypassed the
        mount (a shell whose working directory was entered before the mount) wrote it while
        its unit went on, and the seal would give that change to the unit.  Not for a file of
        several links (a change through a name the daemon does not know moves it too).
        Once the mount was detached from the workspace (its end, ``detached_at``), every
        process that opens the file by its path writes it beneath: a change later than the
        detach, of a file the daemon last changed before it, is another writer's, also
        within the slack (a user's save just after a `run`, sealed as the agent's)."""
        if seal["kind"] != "file" or seal.get("nlink", 1) != 1:
            return False
        if ctime_ns > served + AROUND_SLACK_NS:
            return True
        gone = self.detached_at
        return gone is not None and served < gone and ctime_ns > gone + DETACHED_SLACK_NS

    def end_epochs(self) -> None:
        """A unit boundary: every epoch ends, so the next change of any path captures a fresh
        pre-image and every reader is exact there.  The paths are sealed later, with their
        unit's end (or at unmount)."""
        for p, ep in self.epochs.items():
            self.unsealed.setdefault(p, ep.unit)
        self.epochs.clear()

    def open_record(self, last_alive_ns: int | None = None,
                    end_left: Callable[[tuple[int, int] | None], list[str]] | None = None
                    ) -> dict:
        """At mount: seal what a daemon that did not unmount cleanly left open, then compare
        every sealed path with what the live tree holds and journal each difference as a
        ``drift`` event of the outside unit "while unmounted" (its pre-image: the seal).
        ``last_alive_ns``: when that daemon was last known alive (StateDir.alive).
        ``end_left``: ends the sessions an earlier daemon left open (``Calls.end_left_open``)
        as of that daemon's last event (its seq and time, where the record stood when no
        daemon recorded any more), called once the killed daemon's paths are sealed and
        before the drift is looked for: ended after it, a call, turn or session left open took
        the changes made while unmounted into its span (its export commit, ``replay --at
        after:``, ``diff --turn``; found by a bug hunt).
        Returns {"recovered": n, "drifted": n, "checked": n, "voided": seq, "ended": ids}."""
        j = self.journal
        j.append_many([], [UNMOUNTED_ACTOR, RECORDER_ACTOR, AROUND_ACTOR])
        last = j.last_seq()
        last_ev = j.event(last) if last else None
        as_of = (last, last_ev["t"]) if last_ev is not None else None
        recovered = 0
        unclean = j.meta("sealed") == "0"
        voided = self._void_unmade() if unclean else None  # before the renames are read
        renames = RenameIndex(j.dir_renames())
        if unclean:
            open_paths = []
            for p in j.paths():
                last = j.last_seq_for_path(p)
                ev = j.event(last) if last is not None else None
                if ev is not None and ev["op"] != "seal":
                    # under the name it has now: a directory renamed since moved it (sealed
                    # under its old name, it read as removed by another writer: a false drift,
                    # and replay before the rename held it twice; found by a hunt)
                    name = _name_now(j, renames, p, last)
                    if name is not None:
                        open_paths.append((p, name, ev))
            # what the killed daemon's renames moved is sealed beneath too, as at an unmount;
            # a file changed (or made) since it was last known alive was another writer's,
            # as for the paths it left open (below): an edit made after the kill was sealed
            # as the record's own end (found by a bug hunt)
            self.moved_dirs.update(_renamed_unclosed(j, renames))
            for p in self._owe_beneath_moved():
                if last_alive_ns is not None:
                    self.served[p] = last_alive_ns + ALIVE_SLACK_NS
                    self.recovering.add(p)
            for p, name, ev in open_paths:
                self.epochs[name] = Epoch("recovered")
                if last_alive_ns is not None:
                    # what the killed daemon served ended by its last stamp: a file changed
                    # later, or removed where its last event left one, was changed by another
                    # writer while no daemon recorded (its unit's own end is then not known:
                    # the seal's around check, as for a change around the mount)
                    # (or later, where voiding a change not made moved the ctime itself)
                    self.served[name] = max(last_alive_ns + ALIVE_SLACK_NS,
                                            self._unmade_ctime.get(name, 0))
                    self.recovering.add(name)
                    left: dict = {}
                    self._left_by(ev, left)
                    if p in left:
                        self.left[name] = left[p]
            recovered = self.seal()
        ended: list[str] = []
        if end_left is not None:
            try:
                ended = end_left(as_of)
            except JournalError as e:  # the state dir full: they stay open until a later mount
                log.warning("cannot end the sessions an earlier daemon left open now: %s", e)
        self._find_small_kept()
        checked = drifted = 0
        events = []
        # each file found holding its seal (or sealed anew, drifted) is looked at around the
        # mount at its next change, as one this daemon sealed: a ctime after this look is
        # another writer's beneath the mount (a process whose directory was entered before
        # it).  Only this daemon's own seals were, and such an edit to a file an earlier mount
        # sealed was taken into the next call's pre-image, and replay gave it as exact at
        # points before it (found by a hunt)
        looked_ns = time.time_ns()
        found: dict[str, int] = {}
        covered: set[str] = set()  # the names looked at, each sealed object's name now
        marks: dict[str, bool] = {}  # the directories' ``beneath`` marks
        for path, seq in list(j.seals()):
            if j.last_seq_for_path(path) != seq:
                continue  # changed again after this seal: not the end of its chain
            # the object's names since: a directory's rename may have moved it on, and under
            # any of them an event after it came there (a rename of the file itself, a write)
            # ends the seal's rule; the seal then says nothing of the path it was moved back to
            # (a stale seal taken as the record's end was journaled as drift, and a revert of
            # the call that moved the directory back was refused, "changed")
            name = _name_now(j, renames, path, seq)
            if name is None:
                continue
            checked += 1
            covered.add(name)
            sealed = j.event(seq)
            seal = sealed["pre"]
            if seal["kind"] == "dir":
                mark = self._carried_beneath(path)
                if mark is not None:
                    marks[name] = mark
            if self._holds(name, seal):
                now = seal
                if seal["kind"] == "file" and not seal.get("mode", 0) & stat.S_IRUSR:
                    # its owner may not read it: the check read it by the owner's leave, which
                    # moved its ctime, or it moved at the last seal of another of its names
                    now = again = dict(seal)
                    self._ctimes_after_reads([(name, again)])
                    if again.get("ctime_ns") != seal.get("ctime_ns"):
                        events.append({"op": "seal", "path": name, "pre": again,
                                       "actor": "overlayrec"})
                if now["kind"] == "file":
                    found[name] = max(now.get("ctime_ns", 0), looked_ns)
                continue
            drifted += 1
            events.append({"op": "drift", "path": name, "pre": seal, "epoch": True,
                           "unit": outside_unit(UNMOUNTED), "actor": UNMOUNTED})
            now = self._seal_pre(name)
            events.append({"op": "seal", "path": name, "pre": now, "actor": "overlayrec",
                           # a directory's mode changed: what lies beneath is as known
                           **({"beneath": marks[name]} if name in marks and
                              now["kind"] == "dir" else {})})
            self._ctimes_after_reads([(name, events[-1]["pre"])])
            if events[-1]["pre"]["kind"] == "file":
                found[name] = max(events[-1]["pre"].get("ctime_ns", 0), looked_ns)
            if len(events) >= 512:
                j.append_many(events, [])
                events = []
        try:
            made = self._made_beneath(outermost(d for d, mark in marks.items() if mark),
                                      covered, marks, renames)
        except OSError as e:  # not looked at: its names keep the live tree as end
            log.warning("cannot look for names made beneath renamed directories: %s", e)
            made = []
        drifted += sum(1 for e in made if e["op"] == "drift")
        events.extend(made)
        if events:
            j.append_many(events, [])
        for name, ctime in found.items():
            if name not in self.served:
                self.sealed_ctime.setdefault(name, ctime)
        while len(self.sealed_ctime) > SEALED_CTIMES:  # the oldest first (insertion order)
            del self.sealed_ctime[next(iter(self.sealed_ctime))]
        if drifted:
            log.info("%d path(s) changed while unmounted (drift events journaled)", drifted)
        j.put_meta("sealed", "0")
        return {"recovered": recovered, "drifted": drifted, "checked": checked,
                "voided": voided, "ended": ended}

    def _void_unmade(self) -> int | None:
        """At the mount after a daemon that did not unmount: its last event was committed
        before its change (the write-ahead order), and a daemon killed between the two left
        the record of a change never made.  Where the live tree says so (journal.outcome),
        the event is voided by a ``failed`` note naming its paths (their last event: what the
        killed daemon left there is then what it left before it), and a link its rename took
        into the attic for the file it was about to replace is dropped (that file keeps its
        name).  The seq voided, or None."""
        j = self.journal
        last = j.last_seq()
        ev = j.event(last) if last >= max(j.cut, 1) else None
        if ev is None:
            return None
        if outcome.half_exchanged(ev, self._look):
            self._finish_exchange(ev)
            return None
        if not outcome.unmade(ev, self._look):
            return None
        # the attic's link first: a mount killed here finds the event unmade again, its
        # link gone (after the note, it stayed for good; found by a bug hunt)
        attic = (ev.get("pre2") or {}).get("attic") if ev["op"] == "rename" else None
        if isinstance(attic, str) and is_attic_entry(attic):
            try:
                st = underlay.lstat_at(self.attic_fd, attic)
                live = self._look(ev["path2"])
                if live is not None and (st.st_dev, st.st_ino) == (live.st_dev, live.st_ino):
                    self._drop_attic(attic, (st.st_dev, st.st_ino))
                    # its link count moved its ctime: this change, no other writer's
                    self._unmade_ctime[ev["path2"]] = time.time_ns()
            except FileNotFoundError:
                pass  # killed before the link too
            except OSError as e:  # kept: a stray link, the file's content as it is
                log.warning("cannot drop attic entry %s of a rename not made: %s", attic, e)
        if self.secrets.uncarried(last):  # the secret names it carried go back
            j.put_meta(META_NAMES, self.secrets.names_json())
        # (path2 too: the rename's target's last event is the note, not the rename)
        self._note_failed(last, ev["path"], errno.ECONNABORTED,
                          ev.get("actor", RECORDER_ACTOR["key"]), unmade=True,
                          **({"path2": ev["path2"]} if ev.get("path2") is not None else {}))
        log.warning("event %d (%s %s) was journaled but not made: the daemon was killed "
                    "before it; voided", last, ev["op"], ev["path"])
        return last

    def _finish_exchange(self, ev: dict) -> None:
        """A rename made by an exchange and a move into the attic (``_exchange_into_attic``),
        its daemon killed between the two: the names were left swapped, the caller told it
        failed, and the record said it was made (check: an attic entry missing; found by a
        bug hunt).  The replaced file goes on into the attic now, as the event says."""
        name = ev["pre2"]["attic"]
        try:
            underlay.lstat_at(self.attic_fd, name)
            return  # there already: not this half state
        except FileNotFoundError:
            pass
        parent, _, base = ev["path"].rpartition("/")
        try:
            dfd = underlay.open_beneath(self.root_fd, parent) if parent else os.dup(self.root_fd)
            try:
                st = underlay.lstat_at(dfd, base)
                os.rename(base, name, src_dir_fd=dfd, dst_dir_fd=self.attic_fd)
            finally:
                os.close(dfd)
        except OSError as e:
            log.warning("cannot finish the rename of event %d (%s): %s", ev["seq"],
                        ev["path"], e)
            return
        k = (st.st_dev, st.st_ino)
        self.attic_links[k] = self.attic_links.get(k, 0) + 1
        self.attic_names[k] = name
        self._unmade_ctime[ev["path"]] = time.time_ns()
        log.warning("event %d (rename %s over %s) was left half made by a killed daemon (the "
                    "names exchanged, the replaced file not yet in the attic): finished",
                    ev["seq"], ev["path"], ev["path2"])

    def _look(self, path: str) -> os.stat_result | None:
        """``path``'s lstat beneath the root (its way searched by its owner's leave), None
        when it is not there."""
        def at(dfd: int, name: str) -> os.stat_result | None:
            try:
                return underlay.lstat_at(dfd, name) if name else os.fstat(dfd)
            except (FileNotFoundError, NotADirectoryError):
                return None
        return self._in_parent(path, at, lambda: None)

    def _find_small_kept(self) -> None:
        """At mount: the small pre-images an earlier daemon left in the attic (killed before
        it was idle, or the journal full then) wait to go into the store (``to_store``)."""
        for name in self._small_found:  # listed by _count_attic
            seq = int(name[len(self.attic_prefix):])
            pre = preimage.naming_entry(self.journal.event(seq), name)
            if pre is not None and pre.get("nlink", 1) == 1 and \
                    self.journal.seqs_for_path(f"{ATTIC_NAME}/{name}") == []:
                self.to_store[name] = (seq, pre.get("size", -1), pre.get("mtime_ns", -1))
        self._small_found = []

    def close_record(self) -> None:
        """At unmount: the small pre-images the attic keeps go into the store, every open
        epoch is sealed, and the record is marked cleanly closed."""
        try:
            self.settle_small()
        except (JournalError, OSError) as e:  # the attic keeps them: the next mount tries again
            log.warning("cannot copy %d small pre-image(s) into the store now: %s",
                        len(self.to_store), e)
        self._owe_beneath_moved()
        self.seal()
        self.journal.put_meta("sealed", "1")

    def _holds(self, path: str, seal: dict) -> bool:
        return self._in_parent(path, lambda dfd, name: self._holds_at(dfd, name, seal),
                               lambda: seal["kind"] == "absent")

    @staticmethod
    def _holds_at(dfd: int, name: str, seal: dict) -> bool:
        try:
            st = underlay.lstat_at(dfd, name) if name else os.fstat(dfd)  # "": the root
        except (FileNotFoundError, NotADirectoryError):
            st = None

        def digest():
            fd = underlay.open_own(dfd, name, os.O_RDONLY | os.O_NONBLOCK)
            try:
                return preimage.hash_fd(fd)
            finally:
                os.close(fd)
        return preimage.matches(seal, st, lambda: os.readlink(name, dir_fd=dfd), digest)


# a file's ctime later than the daemon's last change to it by this much was changed around the
# mount (kernel clocks are coarse, and a change is made just after its stamp)
AROUND_SLACK_NS = 500_000_000
# ... and, after the mount was detached, by this much past the detach (Recorder._around): no
# change of the daemon's comes then to a path it last changed before (the kernel's coarse
# clock and a request in flight as the detach was made are what this covers)
DETACHED_SLACK_NS = 50_000_000


# a unit's end seals its paths this many at a time (Recorder.seal)
SEAL_CHUNK = 1024
# the small pre-images the attic kept that go into the store in one commit (Recorder._settle)
SETTLE_COMMIT = 32
# at most this many sealed files' ctimes kept to find another writer's change at the next
# change (Recorder.sealed_ctime): about 150 bytes each
SEALED_CTIMES = 100_000


# a killed daemon served nothing later than this after the last stamp its next mount finds
# (daemon.ALIVE_EVERY, and the delay of the stamp under a stream of requests: a pass of the run
# loop every few requests, serving.BURST); AROUND_SLACK_NS comes on top (Recorder._around)
ALIVE_SLACK_NS = 500_000_000


# what a change leaves at its path, by op ("": it depends, Recorder._left_by)
_LEFT_KIND = {"create": "file", "link": "file", "mkdir": "dir", "symlink": "symlink",
              "unlink": None, "rmdir": None}


def _around_event(path: str, seal: dict, left: str | None = "") -> dict:
    """A ``drift`` event found at a seal: the file changed around the mount while its unit
    went on, so what the unit left is not known (``unkept``: never taken as exact; its kind,
    mode and owner taken as the seal's), and what it holds now is that outside change's (the
    seal after it).  ``left`` None: the daemon's last change removed the path, so what the
    unit left there is known: nothing (a file made there since is the other writer's)."""
    if left is None:
        return {"op": "drift", "path": path, "pre": dict(preimage.ABSENT), "epoch": True,
                "unit": outside_unit(AROUND), "actor": AROUND}
    pre = {k: seal[k] for k in ("kind", "mode", "uid", "gid") if k in seal}
    return {"op": "drift", "path": path, "pre": dict(pre, unkept=True), "epoch": True,
            "unit": outside_unit(AROUND), "actor": AROUND}


UNMOUNTED_ACTOR = {"key": UNMOUNTED, "pid": 0, "start": 0, "ppid": 0, "uid": -1, "exe": "",
                   "argv": ["(while unmounted)"], "cwd": "", "first_seen": 0}
AROUND_ACTOR = {"key": AROUND, "pid": 0, "start": 0, "ppid": 0, "uid": -1, "exe": "",
                "argv": ["(around the mount)"], "cwd": "", "first_seen": 0}
RECORDER_ACTOR = {"key": "overlayrec", "pid": 0, "start": 0, "ppid": 0, "uid": -1, "exe": "",
                  "argv": ["(overlayrec)"], "cwd": "", "first_seen": 0}


def _name_now(j: Journal, renames: RenameIndex, path: str, seq: int) -> str | None:
    """The name the object ``path`` named at ``seq`` has now, through the directory renames
    after it; None when a later event named it under one of its names (its own chain rules
    from there) or a rename replaced it."""
    name, since = path, seq
    lo = renames.upto(seq)
    while name is not None and (i := renames.touching(
            name, lo, len(renames.seqs), itself=True)) is not None:
        r = renames.renames[i]
        if name != path and _named_between(j, name, since, r["seq"]):
            return None
        name, since = _moved_name(name, r), r["seq"]
        lo = i + 1
    if name is None or (name != path and _named_between(j, name, since, None)):
        return None
    return name


def _renamed_unclosed(j: Journal, renames: RenameIndex) -> dict[str, int]:
    """The directories renamed with no closing seal of theirs since (a daemon killed before
    its unmount): their names now, each with its last such rename's seq."""
    out: dict[str, int] = {}
    rs, n = renames.renames, len(renames.renames)
    for i, r in enumerate(rs):
        name: str | None = r["dst"]
        lo = i + 1
        while name is not None and (k := renames.touching(name, lo, n, itself=True)) is not None:
            later = rs[k]
            exchange = later.get("flags", 0) & underlay.RENAME_EXCHANGE
            if name == later["dst"] and not exchange:
                name = None  # replaced
            elif name == later["dst"]:
                name = later["src"]
            else:
                name = _moved_name(name, later)
            lo = k + 1
        if name is None:
            continue
        for s in reversed(j.seqs_for_path(name)):
            if s <= r["seq"]:
                out[name] = r["seq"]
                break
            ev = j.event(s)
            if ev is not None and ev["op"] == "seal" and ev.get("closing"):
                break
        else:
            out[name] = r["seq"]
    return out


def _named_between(j: Journal, name: str, lo: int, hi: int | None) -> bool:
    """Does an event name ``name`` after seq ``lo`` (and before ``hi``, None: the end)?"""
    last = j.last_seq_for_path(name)
    if last is None or last <= lo:
        return False
    return hi is None or any(lo < s < hi for s in j.seqs_for_path(name))


def _moved_name(name: str, r: dict) -> str | None:
    """The name after directory rename ``r`` of what was called ``name`` just before it (None:
    it cannot have existed, being beneath the replaced target)."""
    src, dst = r["src"], r["dst"]
    if name == src or name.startswith(src + "/"):
        return dst + name[len(src):]
    if name.startswith(dst + "/"):
        return src + name[len(dst):] if r.get("flags", 0) & underlay.RENAME_EXCHANGE else None
    return name


MUTATIONS = ("create", "mkdir", "mknod", "symlink", "link", "unlink", "rmdir", "rename", "write",
             "truncate", "chmod", "chown", "utimens", "setxattr", "removexattr")
# the steps inside the mutations (OVERLAYREC_BENCH_STEPS): the recorder's helpers, and the
# journal's part of an event (``journal.``: its record written ahead, ``ahead.append`` the
# record's write alone)
STEPS = ("rel", "_pre_at", "_event", "_epoch", "_withhold", "_keep_small", "_append",
         "_unchanging", "_capture", "before_write", "note_extents", "begin_run", "_fix_owner",
         "_carry_secret", "_left_by", "settle_small")
JOURNAL_STEPS = ("append", "append_many", "_write_ahead", "hold_event", "reserve_seq")


def time_mutations(recorder: Recorder, steps: bool = False) -> dict[str, list]:
    """A bench switch, not a user feature (``OVERLAYREC_BENCH_TIMES``, read by the daemon):
    wrap ``recorder``'s mutations, as the filesystem layer calls them, so that each counts its
    calls and the seconds spent in it.  Returns the counts, ``{method: [calls, seconds]}``,
    kept current.  A mutation's time is the recorder's whole part of a request: its event,
    pre-image and commit, and the underlay's change itself (which norecord makes too).  The
    journal's write transactions are counted too, as ``commit`` (part of the mutations' time,
    and the flushes of held notes and events).  ``steps`` (``OVERLAYREC_BENCH_STEPS``): the
    helpers of ``STEPS`` and ``JOURNAL_STEPS`` are counted too, each with what it calls
    (a step's time includes its own steps'); each wrapper costs some tenths of a
    microsecond a call, so a run with steps is for where the time goes, not for ratios."""
    times: dict[str, list] = {}

    def timed(name: str, fn):
        cell = times.setdefault(name, [0, 0.0])

        @functools.wraps(fn)
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                cell[0] += 1
                cell[1] += time.perf_counter() - t
        return call
    for name in MUTATIONS:
        setattr(recorder, name, timed(name, getattr(recorder, name)))
    journal = recorder.journal
    journal._write = timed("commit", journal._write)
    if steps:
        for name in STEPS:
            setattr(recorder, name, timed(name, getattr(recorder, name)))
        recorder.units.unit_of = timed("units.unit_of", recorder.units.unit_of)
        for name in JOURNAL_STEPS:
            setattr(journal, name, timed("journal." + name, getattr(journal, name)))
        journal._ahead.append = timed("ahead.append", journal._ahead.append)
    return times


class UnrecordedRecorder(Recorder):
    """A bench switch, not a user feature: ``OVERLAYREC_BENCH_NORECORD=1`` in the daemon's
    environment (read once, at mount, by ``daemon.prepare``) serves with this recorder, whose
    mutations change the underlay as the filesystem layer asks and journal nothing (no events,
    no pre-images, no attic, no epochs). tools/bench's ``norecord`` setup uses it to split what
    overlayrec's filesystem layer costs from what recording costs. Without the variable the
    daemon builds a plain ``Recorder``: nothing here runs."""

    def before_grant(self, fd):
        pass

    def undo_create(self, parent_fd, name, fd, err, actor):
        pass  # a bench switch: nothing journaled to void, nor a failed create measured

    def create(self, parent_fd, name, flags, mode, uid, gid, actor):
        # a new object gets the caller's owner (as Recorder.create), an existing one keeps its
        foreign = (uid, gid) != (self._euid, self._egid)
        existed = foreign and not flags & os.O_EXCL and \
            self._pre_at(parent_fd, name)[1] is not None
        fd = os.open(name, flags | os.O_CREAT | os.O_CLOEXEC, mode, dir_fd=parent_fd)
        if foreign and not existed:
            try:
                self._fix_owner(parent_fd, name, uid, gid, mode)
            except OSError:
                os.close(fd)
                raise
        return fd

    def mkdir(self, parent_fd, name, mode, uid, gid, actor):
        os.mkdir(name, mode, dir_fd=parent_fd)
        self._fix_owner(parent_fd, name, uid, gid, None, is_dir=True)

    def mknod(self, parent_fd, name, mode, rdev, uid, gid, actor):
        os.mknod(name, mode, rdev, dir_fd=parent_fd)
        self._fix_owner(parent_fd, name, uid, gid, None)

    def symlink(self, parent_fd, name, target, uid, gid, actor):
        os.symlink(target, name, dir_fd=parent_fd)
        self._fix_owner(parent_fd, name, uid, gid, None)

    def link(self, src_fd, parent_fd, name, actor):
        underlay.link_fd(src_fd, parent_fd, name, root_fd=self.root_fd, rel=self.rel(src_fd))

    def seen_linked(self, st, first, second):
        pass

    def unlink(self, parent_fd, name, actor):
        os.unlink(name, dir_fd=parent_fd)

    def rmdir(self, parent_fd, name, actor):
        os.rmdir(name, dir_fd=parent_fd)

    def rename(self, pfd, name, npfd, nname, flags, actor):
        underlay.renameat2(pfd, name, npfd, nname, flags)

    def grown_beneath(self, handle, st):
        pass

    def write(self, handle, off, data):
        return os.pwrite(handle.fd, data, off)

    def truncate(self, fd, size, actor, *, handle=None, open_fd=None):
        underlay.truncate_fd(fd, size)

    def chmod(self, fd, mode, actor):
        underlay.chmod_fd(fd, mode)

    def chown(self, fd, uid, gid, actor):
        underlay.chown_fd(fd, uid, gid)

    def utimens(self, fd, atime_ns, mtime_ns, is_symlink, actor):
        underlay.utimens_fd(fd, atime_ns, mtime_ns, is_symlink)

    def setxattr(self, fd, name, value, actor, at=None):
        os.setxattr(at or underlay.proc_path(fd), name, value, follow_symlinks=at is None)

    def removexattr(self, fd, name, actor, at=None):
        os.removexattr(at or underlay.proc_path(fd), name, follow_symlinks=at is None)
