"""A reader's answer kept for the next time the same question is asked (``diff``, ``turns``,
``calls``): its output, and the live files it read.

An answer is a function of the journal, of the live files it read (the end of a sealed
chain, an attic entry, a directory listed) and of the code that made it.  The journal's
creation time, retention cut and generation (LMDB's last write transaction: every event,
record and meta key moves it) name what it holds; ``state.code_ident`` names the code (an
upgrade's readers answer afresh, not with what the readers before them kept).  A live file's
lstat names what it held: its inode, mode, size, mtime and ctime (ctime moves on every change,
and no caller can set it).  So a kept answer is given again while the journal's generation and
the code are the same and every file it read stats as it did; otherwise the question is
answered again, and that answer kept.

An answer that read a live file at the end of an unsealed chain, while the workspace is mounted,
is not kept: that may be an open epoch's, and the writes of a run inside an epoch are no
events, so the journal does not move with them, and two of them within one clock tick of the
filesystem leave the same ctime.  A sealed path changes through the mount only with an event
(its next epoch's first), and so does any path's kind, mode or name; around the mount (drift),
or while unmounted, its stat changes.

The files are derived and private to this module (``answers/`` in the state dir,
docs/storage.md): the newest ``KEEP`` are kept, removing them costs only time, and a reader
that cannot write them (a read-only state dir) answers all the same.
"""
from __future__ import annotations

import json
import os

import xxhash

try:  # a listing's answer is megabytes: some ten times the standard module's speed
    import orjson
except ImportError:
    orjson = None

from ..state import code_ident, read_regular, replace_private

VERSION = 1
KEEP = 64                 # answers kept per state dir (the oldest used is removed first)
LARGEST = 16 << 20        # an answer larger than this (a patch of a big turn) is not kept


def stat_sig(st: os.stat_result | None) -> list | None:
    """What a kept answer compares of a live file: None when it was absent."""
    if st is None:
        return None
    return [st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class Reads:
    """The live files one answer read (Tree notes them here), and whether it read the live end
    of an open epoch (States says so): then the answer is not kept."""

    def __init__(self):
        self.files: dict[str, list | None] = {}
        self.open_end = False

    def note(self, key: str, st: os.stat_result | None) -> None:
        """``key``: a path beneath the live tree's root, or an absolute path (a file of the
        state dir the answer names, such as the private object store)."""
        self.files.setdefault(key, stat_sig(st))

    def note_abs(self, path: str) -> None:
        self.note(path, _lstat_abs(path))


def _encode(doc: dict) -> bytes:
    if orjson is not None:
        try:
            return orjson.dumps(doc)
        except (orjson.JSONEncodeError, TypeError):
            pass  # a lone surrogate (a name's undecodable bytes): the standard encoder takes it
    return json.dumps(doc, separators=(",", ":")).encode()  # ASCII: lone surrogates escaped


def _decode(raw: bytes):
    """A kept answer's document (ValueError when it is none)."""
    if orjson is not None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # a lone surrogate escaped: the standard decoder takes it
    return json.loads(raw)


def _lstat_abs(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


class Answers:
    """The kept answers of one state dir, for the journal ``j`` as it stands.  ``lstat(keys)``
    stats live files as Tree noted them (paths beneath the root, attic entries among them):
    a dict of each key's lstat, None for one absent."""

    def __init__(self, kept_dir: str, j, lstat):
        self.dir = kept_dir
        # read before the answer is made: a change committed meanwhile makes a newer one; and
        # made by this code: an upgrade's or an edit's readers answer afresh
        self.ident = [j.meta("created"), j.cut, j.generation(), code_ident()]
        self.lstat = lstat

    def _path(self, question: list) -> str:
        raw = json.dumps(question, separators=(",", ":"))
        return os.path.join(self.dir, xxhash.xxh64_hexdigest(raw.encode()) + ".json")

    def get(self, question: list) -> list | None:
        """The kept answer to ``question`` (``[[stream, text], ...]``, stream 1 or 2), or None
        when there is none, or it no longer fits the journal or the live files."""
        path = self._path(question)
        try:
            doc = _decode(read_regular(path))
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict) or doc.get("version") != VERSION or \
                doc.get("journal") != self.ident or doc.get("question") != question:
            return None
        try:
            reads = doc["reads"]
            live = self.lstat([key for key, _ in reads if not key.startswith("/")])
            for key, sig in reads:
                if stat_sig(_lstat_abs(key) if key.startswith("/") else live[key]) != sig:
                    return None
            parts = [(int(s), str(t)) for s, t in doc["parts"]]
        except (KeyError, TypeError, ValueError):
            return None
        try:
            os.utime(path)  # used: the last to be removed
        except OSError:
            pass
        return parts

    def put(self, question: list, parts: list, reads: Reads) -> None:
        """Keep ``parts`` as the answer to ``question``, unless it read an open epoch's live
        end or is too large; a state dir that cannot take it is no error."""
        if reads.open_end or sum(len(t) for _, t in parts) > LARGEST:
            return
        data = _encode({"version": VERSION, "journal": self.ident, "question": question,
                        "reads": sorted(reads.files.items()), "parts": parts})
        if replace_private(self._path(question), data):
            self._trim()

    def _trim(self) -> None:
        names = [n for n in os.listdir(self.dir) if n.endswith(".json")]
        if len(names) <= KEEP:
            return
        aged = []
        for n in names:
            try:
                aged.append((os.stat(os.path.join(self.dir, n)).st_mtime_ns, n))
            except OSError:
                pass
        for _, n in sorted(aged)[:len(aged) - KEEP]:
            try:
                os.unlink(os.path.join(self.dir, n))
            except OSError:
                pass
