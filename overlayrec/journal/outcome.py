"""Whether the change an event was written ahead of was made, judged from the live tree.

The recorder commits an event before it changes the underlay (the write-ahead order).  A
daemon killed between the two (``kill -9``, a crash) leaves an event whose change never
happened; its caller got ECONNABORTED.  Taken as done, such an event puts a tree in the record
that the workspace never had: an ``mv f1 f2`` over f2 that did not happen read as done (show,
replay and diff gave f1's content as f2's, and a revert wrote f2's content into f1), a ``rm``
named an attic entry never made, a ``mkdir`` made a directory a drift then removed.

At the next mount (``Recorder.open_record``) the killed daemon's last event is judged here:
where every name it touches still holds the object it held before the event (a file: the same
inode), and none of them changed after the event's time, the change was not made, and the
recorder voids the event with a ``failed`` note, as a change the underlay refused.  A name
changed since (a user's edit while unmounted) leaves the event as done: what followed it is
then the drift the next mount finds, as before.

Only changes of names are judged (rename, unlink, rmdir and the makes): a change in place
(write, truncate, chmod) taken as done is harmless, since the seal after it is the live tree:
it reads as a change to what the file already held.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Callable

from .preimage import kind_of

# renameat2's flag (as underlay has it; the journal does not import the underlay for one number)
RENAME_EXCHANGE = 2
# a name whose ctime is later than the event's time by more than this was changed after the
# event by something else (the user while unmounted), not by the event's own change: the
# kernel's coarse clock and the time from the event's stamp to its syscall are far below it,
# an unmount and a user's edit far above
AFTER_NS = 1_000_000_000
MAKES = ("create", "mkdir", "mknod", "symlink", "link")
JUDGED = ("rename", "unlink", "rmdir") + MAKES

Look = Callable[[str], "os.stat_result | None"]  # a path's lstat beneath the root, None: absent


def _inode(pre: dict) -> int | None:
    """The inode a pre-image names: a file's ``ino``, a directory's ``dino`` (a rename's)."""
    return pre.get("ino") or pre.get("dino")


def _holds(st: os.stat_result | None, pre: dict | None) -> bool:
    """Does the live object (its lstat ``st``, None: absent) hold what ``pre`` was: the same
    kind and, where the pre-image names it, the same inode?"""
    if not isinstance(pre, dict):
        return False
    if st is None:
        return pre.get("kind") == "absent"
    return kind_of(st.st_mode) == pre.get("kind") and _inode(pre) in (None, st.st_ino)


def _since(st: os.stat_result | None, t: int) -> bool:
    """Was the object left alone since time ``t`` (its ctime not after it)?"""
    return st is not None and st.st_ctime_ns <= t + AFTER_NS


def unmade(ev: dict, look: Look) -> bool:
    """Was ``ev``'s change not made: does the live tree (``look``) still hold, at every name
    the change touches, what the event says was there before it?  False where the tree cannot
    tell (an exchange of two directories, a change in place, an event without a time)."""
    op, t, path = ev.get("op"), ev.get("t"), ev.get("path")
    if op not in JUDGED or not isinstance(t, int) or not isinstance(path, str):
        return False
    if op in MAKES:
        pre = ev.get("pre", {"kind": "absent"})  # none: not the epoch's first (made over nothing)
        if not isinstance(pre, dict) or pre.get("kind") != "absent" or look(path) is not None:
            return False
        # absent now: not made, unless made and removed since (its directory changed since)
        return _since(look(path.rpartition("/")[0]), t)
    st = look(path)
    if not _holds(st, ev.get("pre")):
        return False
    if op != "rename":
        return _since(st, t)  # unlink, rmdir: the name still holds what it would remove
    path2, pre2 = ev.get("path2"), ev.get("pre2")
    if not isinstance(path2, str):
        return False
    st2 = look(path2)
    if not _holds(st2, pre2):
        return False
    pre = ev["pre"]
    flags = ev.get("flags", 0)
    if isinstance(flags, int) and flags & RENAME_EXCHANGE:
        # both names hold an object whether it was made or not: two kinds tell (a file and
        # a directory, a file and a symlink: taken as made, a revert put a directory where
        # the file was; found by a bug hunt), or the two inodes (files, directories); two
        # symlinks cannot be told apart
        if st2 is None or not (_since(st, t) and _since(st2, t)):
            return False
        if pre.get("kind") != pre2.get("kind"):
            return True  # each name holds the kind it held before (_holds)
        return _inode(pre) is not None and _inode(pre2) is not None and \
            st.st_ino != st2.st_ino
    if st2 is not None and _inode(pre2) is not None and _inode(pre) is not None:
        # over an object: the target still holds its own inode, which a rename made would
        # have put away (to the attic): not made, whatever changed the source since (an
        # edit while unmounted left the event as made, the attic's link of the live target
        # its pre-image; found by a bug hunt)
        return True
    return _since(st, t)


def half_exchanged(ev: dict, look: Look) -> bool:
    """Was ``ev``, a rename over a file whose link the attic could not take (``EMLINK``,
    ``protected_hardlinks``), left half made: the two names exchanged, the replaced file not
    yet moved from the source's name into the attic (``Recorder._exchange_into_attic``'s two
    steps, a kill between them)?  Then the source's name holds the replaced file and the
    target the moved one.  The caller looks at the attic entry (absent) and finishes the move."""
    if ev.get("op") != "rename" or ev.get("flags") or not isinstance(ev.get("t"), int):
        return False
    pre, pre2 = ev.get("pre"), ev.get("pre2")
    if not isinstance(pre, dict) or not isinstance(pre2, dict) or \
            not isinstance(pre2.get("attic"), str) or pre.get("kind") != "file" or \
            pre2.get("kind") != "file" or pre.get("ino") is None or pre2.get("ino") is None:
        return False
    st, st2 = look(ev["path"]), look(ev["path2"])
    return _holds(st, pre2) and _holds(st2, pre) and _since(st, ev["t"]) and \
        _since(st2, ev["t"])
