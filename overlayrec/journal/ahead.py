"""The log ahead of LMDB: the daemon's events written ahead, a few milliseconds before they are
committed to LMDB in a batch.

An LMDB commit of one event rewrites a handful of pages (the two B-trees' paths from leaf to
root, the main database's page, the meta page: about 24 KiB of page writes) and took 40-43% of
recording's time in the daemon (docs/bench.md, sixth pass).  Appending the event to this file
is one small ``write``.  So while the daemon serves, each commit of events (``Journal.append``,
``append_many``) is one record here, made before the change reaches the underlay (the
write-ahead invariant: a ``kill -9`` cannot lose what the page cache holds; with ``--durable``
each record is synced); its LMDB commit rides with the next one, with the daemon's flush 5 ms
later, or before any read of this process.

Whoever opens the journal first applies the records LMDB does not hold yet: the daemon at its
start (after a ``kill -9``), and a reader in another process at its open, so no reader ever
answers without an event that was written ahead (``Journal._catch_up``).  A record is known
to be in LMDB when its highest seq is below the journal's next seq: records are applied in
order, each whole in one transaction.  Applying one twice puts the same keys and values.

The file is ``journal/ahead.log`` (0600).  A record is its payload's length and CRC-32
(``<II``), then the payload: a JSON header (the events, the actors the journal may not have
yet, the extents notes held before them, and the length of each blob) followed by the
blobs' bytes.  A record that is short, whose
CRC does not match, or that holds no batch (damage that kept its CRC) ends the log: a write cut off by a crash never reached the underlay
(its change came after it).  Only the journal's one writer (the daemon, or a gc holding the
writer lock) empties the file, once everything in it is in LMDB; the bytes after the last whole
record it keeps aside first (``keep_tail``): damage would have ended the log before records
whose changes were made.
"""
from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Callable, Iterator  # (not typing: ~4 ms of a reader's start)

from ..state import read_regular

NAME = "ahead.log"
UNREAD = ".unread-"  # ahead.log.unread-<ns>: bytes a writer's open kept aside (keep_tail)

_HEAD = struct.Struct("<II")  # payload length, CRC-32 of the payload
_JSON_LEN = struct.Struct("<I")


def kept_aside(journal_dir: str) -> list[tuple[str, int]]:
    """The files of bytes kept aside unread in ``journal_dir`` (``keep_tail``), oldest first:
    (path, when it was kept, in ns)."""
    prefix = NAME + UNREAD
    try:
        names = os.listdir(journal_dir)
    except OSError:
        return []
    found = [(os.path.join(journal_dir, n), int(n[len(prefix):])) for n in names
             if n.startswith(prefix) and n[len(prefix):].isascii() and n[len(prefix):].isdigit()]
    return sorted(found, key=lambda f: f[1])


class Batch:
    """What one record holds: events (in seq order), actors, small blobs by digest, and the
    extents notes held before them (seq, summary).  ``raws``: each event's JSON as the
    writer encoded it (what LMDB then stores, byte for byte), None for a batch read back."""
    __slots__ = ("events", "actors", "blobs", "notes", "raws")

    def __init__(self, events: list[dict], actors: list[dict], blobs: dict[str, bytes],
                 notes: list | None = None, raws: list[bytes] | None = None):
        self.events, self.actors, self.blobs = events, actors, blobs
        self.notes = notes or []
        self.raws = raws

    @property
    def last_seq(self) -> int:
        """The highest seq in the record (an event named by a seq reserved earlier, for its
        attic entry, may follow events stamped after the reservation)."""
        return max((ev["seq"] for ev in self.events), default=0)


_BARE = b'],"a":[],"x":[],"b":[]}'  # the rest of a record of events alone: the most common
_BLOBS_ONLY = b'],"a":[],"x":[],"b":'


def encode(batch: Batch, dumps: Callable[[object], bytes]) -> bytes:
    """A record of ``batch``; ``dumps`` is the journal's own JSON encoder (it keeps a path's
    undecodable bytes).  Each event is encoded once: the same bytes go to LMDB."""
    if batch.raws is None:
        batch.raws = [dumps(ev) for ev in batch.events]
    if batch.actors or batch.notes:
        rest = b"".join((b'],"a":', dumps(batch.actors), b',"x":', dumps(batch.notes), b',"b":',
                         dumps([[d, len(data)] for d, data in batch.blobs.items()]), b"}"))
    elif batch.blobs:  # a small pre-image's record (an unlink, a rename over): the blobs alone
        rest = _BLOBS_ONLY + dumps([[d, len(data)] for d, data in batch.blobs.items()]) + b"}"
    else:
        rest = _BARE
    head = b'{"e":[' + b",".join(batch.raws) + rest
    payload = _JSON_LEN.pack(len(head)) + head
    if batch.blobs:
        payload += b"".join(batch.blobs.values())
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def decode(payload: bytes, loads: Callable[[bytes], object]) -> Batch:
    """The batch a record's payload holds; ValueError when it holds none (its CRC matched,
    yet it is no record this module wrote: damage, or a hand's)."""
    try:
        (n,) = _JSON_LEN.unpack_from(payload)
        head = loads(payload[4:4 + n])
        blobs, at = {}, 4 + n
        for digest, size in head["b"]:
            if not isinstance(digest, str) or not isinstance(size, int) or size < 0:
                raise ValueError("a blob's digest or size")
            blobs[digest] = payload[at:at + size]
            at += size
        events, actors, notes = head["e"], head["a"], head["x"]
        if at != len(payload) or not all(isinstance(x, list) for x in (events, actors, notes)) \
                or not all(isinstance(ev, dict) and type(ev.get("seq")) is int and ev["seq"] > 0
                           for ev in events):
            raise ValueError("its events, actors or blobs")
    except (struct.error, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a record of the log ahead ({e})") from None
    return Batch(events, actors, blobs, notes)


class AheadLog:
    """The log file of one journal directory, opened for appending (the writer) or reading."""

    def __init__(self, journal_dir: str, loads: Callable[[bytes], object]):
        self.path = os.path.join(journal_dir, NAME)
        self._loads = loads
        self._fd: int | None = None
        self._end = 0  # the file's length, as this writer made it
        self.tail = b""  # what batches() found after the last whole record

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                               0o600)
            self._end = os.fstat(self._fd).st_size
        return self._fd

    def append(self, record: bytes, durable: bool) -> None:
        """One record at the end, synced when ``durable``.  OSError when it cannot be made
        whole: then the file is cut back to where it was, so no part of it stays."""
        fd = self._open()
        try:
            if os.write(fd, record) != len(record):
                raise OSError(28, "No space left on device")  # a short write: the disk is full
            if durable:
                os.fdatasync(fd)
        except OSError:
            try:
                os.ftruncate(fd, self._end)
            except OSError:
                pass  # a reader stops at the torn record; the writer's next open cuts it
            raise
        self._end += len(record)

    def batches(self) -> Iterator[Batch]:
        """The whole records in the file, in order (none when there is no file).  Once read
        through, ``tail`` holds the bytes after the last whole record (none: b"")."""
        self.tail = b""
        try:  # (never a fifo: one hung every reader; found by a bug hunt)
            data = read_regular(self.path)
        except FileNotFoundError:
            return
        at = 0
        while at + _HEAD.size <= len(data):
            size, crc = _HEAD.unpack_from(data, at)
            payload = data[at + _HEAD.size:at + _HEAD.size + size]
            if len(payload) != size or zlib.crc32(payload) != crc:
                break  # cut off, or being written now: the end of the log
            try:
                batch = decode(payload, self._loads)
            except ValueError:
                break  # damage that kept its CRC: the end of the log, as a torn record
            yield batch
            at += _HEAD.size + size
        self.tail = data[at:]

    def keep_tail(self) -> str | None:
        """The writer, about to empty the file: the bytes after its last whole record (read
        by ``batches``), if any, go to a file of their own beside it (0600), its path returned.
        A write is one ``write`` that a kill does not cut, and a failed one is cut back, so
        such bytes are a crash's torn record or damage (records after a damaged one were
        written, and their changes made): not applied, and not thrown away either."""
        if not self.tail:
            return None
        path = f"{self.path}{UNREAD}{time.time_ns()}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, self.tail)
        finally:
            os.close(fd)
        self.tail = b""
        return path

    def size(self) -> int:
        try:
            return os.stat(self.path).st_size
        except FileNotFoundError:
            return 0

    def empty(self) -> None:
        """Everything in the file is in LMDB: start it again (the writer only)."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            self._end = 0
        elif self.size():
            os.truncate(self.path, 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
