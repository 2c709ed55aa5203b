"""``overlayrec check``: is the record whole?  One pass over the journal's events (those a gc's
cut left), looking for what a reader would need and not find:

* **actors**: each event's ``actor`` has its row in the ``actors`` table (the process a
  listing names);
* **content**: each digest an event names (a pre-image's ``blob`` and ``ranges``, a write's
  ``data``) is held, in the journal's ``blobs`` table or the content store;
* **attic**: each attic entry a pre-image names is in the workspace's attic, unless a
  ``reclaim`` event says the daemon dropped it for want of space (readers then know the state
  is inexact); and an entry kept of a file that had other names (hard links) and no copy in
  the store (past the whole-file limit) still has the size and mtime it had when it left the
  path, unless the record holds another name of it (a write through that name saved what it
  destroyed there): else a process wrote it through a link outside the record (a package
  manager's store, `pnpm`), the pre-image is gone, and readers say the state is inexact
  (``attic-changed``);
* **the log ahead**: no bytes of it were kept aside unread (``ahead.log.unread-*``), and,
  unmounted, none follow its last whole record (a damaged record hides every later one from
  the readers until the next mount keeps them aside);
* **events**: each record of the ``events`` table is an event (a reader refuses to answer
  over one that is not);
* **the path index**: every event is found under each path it names, and the index holds
  nothing else (a flipped byte in a key hid a path's change from every diff: LMDB keeps no
  checksums);
* **content bytes**: each blob file of the store an event names still hashes to its name
  (``blob-changed``: a reader refuses it);
* **revert plans**: each saved plan can be read (``plan``: revert, unrevert and gc refuse
  while one cannot).

An event whose change the underlay refused (a ``failed`` note names it) made nothing, so what
it names is not looked for.  While mounted, an entry the daemon copied into the store meanwhile
is looked at again in its event as it is now.  Sync, and reading only.
"""
from __future__ import annotations

import os

from .. import state
from ..journal import Journal, JournalError
from ..journal.ahead import kept_aside
from ..journal.content import BlobError
from ..journal.preimage import hash_fd
from ..journal.store import decode_event
from .states import ATTIC
from .usage import digests, open_attic


def check(j: Journal, root_fd: int | None, progress=None, writer_live: bool = False) -> dict:
    """The findings over ``j`` (the workspace's root fd, for its attic; None: not looked at;
    ``progress(seq, last seq)`` told as the pass goes, if given):
    ``{"events", "actors", "blobs", "attic_entries", "findings": [...]}``, each finding a dict
    with ``kind`` ("actor", "blob", "attic", "ahead", "event"), what is missing, how many
    events name it and the first of them (``seq``, ``path``)."""
    cut = j.cut
    kept_seals = {seq for _, seq in j.seals()}
    failed: set[int] = set()
    dropped: set[str] = set()
    for ev in j.events_of(("failed", "reclaim")):
        if ev["op"] == "failed" and isinstance(ev.get("ref"), int):
            failed.add(ev["ref"])
        elif ev["op"] == "reclaim":
            dropped.update(n for n in ev.get("dropped") or () if isinstance(n, str))
    findings: list[dict] = []
    actors: dict[str, list] = {}   # key -> [events, first seq, its path]
    blobs: dict[str, list] = {}
    attic: dict[str, list] = {}
    # (entry, seq, path, size, mtime_ns, nlink): a file's kept whole in the attic
    linked: list[tuple] = []
    written: set[str] = set()  # entries with events of their own
    indexed: list[tuple[str, int]] = []  # (path, seq) the path index must hold
    unread: set[int] = set()  # records that are no event
    events = 0
    last = j.last_seq()
    scanned = 0  # the last record looked at
    for seq, raw in j.scan_raw(1):
        scanned = seq
        if progress is not None and not seq & 0xFF:
            progress(seq, last)
        if seq < cut and seq not in kept_seals:
            unread.add(seq)
            continue  # a gc's cut made, not yet deleted
        ev, why = decode_event(seq, raw)
        if why is not None:  # a reader that meets it refuses to answer
            findings.append({"kind": "event", "name": f"event {seq} {why}", "seq": seq})
            unread.add(seq)
            continue
        events += 1
        for p in {ev.get("path"), ev.get("path2")}:
            if isinstance(p, str):
                indexed.append((p, seq))
        where = (seq, ev.get("path"))
        if isinstance(ev.get("actor"), str):
            _name(actors, ev["actor"], where)
        if seq in failed:
            continue
        for dg in digests(ev):
            _name(blobs, dg, where)
        for k, pk in (("pre", "path"), ("pre2", "path2")):
            pre = ev.get(k)
            if isinstance(pre, dict) and isinstance(pre.get("attic"), str):
                _name(attic, pre["attic"], where)
                if pre.get("kind") == "file" and "blob" not in pre and \
                        isinstance(pre.get("mtime_ns"), int):
                    linked.append((pre["attic"], seq, ev.get(pk), pre.get("size"),
                                   pre.get("mtime_ns"), pre.get("nlink", 1)))
        for p in (ev.get("path"), ev.get("path2")):
            if isinstance(p, str) and p.startswith(ATTIC + "/"):
                written.add(p[len(ATTIC) + 1:])  # written through a descriptor left open
    if progress is not None:
        progress(last, last)
    for key, (n, seq, path) in actors.items():
        try:
            known = j.actor(key) is not None
        except JournalError:
            known = False  # its row is damaged: as good as missing
        if not known:
            findings.append(_finding("actor", key, n, seq, path))
    for dg, (n, seq, path) in blobs.items():
        if not j.content.has(dg):
            findings.append(_finding("blob", dg, n, seq, path))
        elif not _holds_its_hash(j, dg):
            findings.append(_finding("blob-changed", dg, n, seq, path))
    findings += [{"kind": "index", "name": why, "seq": seq, "path": path}
                 for why, path, seq in j.index_defects(indexed, unread, scanned)]
    if root_fd is not None:  # no workspace to look in: the attic is not looked at
        findings += _missing_from_attic(j, root_fd, attic, dropped)
        findings += _changed_in_attic(j, root_fd, linked, dropped, written)
    findings += [{"kind": "ahead", "name": path}
                 for path, _ in kept_aside(os.path.join(j.state_dir, "journal"))]
    unread = j.unread_ahead()
    if unread and not writer_live:  # a daemon's record being written is no damage
        findings.append({"kind": "ahead", "name": f"{unread} byte(s) after the last whole "
                         "record of the log ahead (ahead.log): the events there are not read; "
                         "the next mount keeps them aside"})
    findings += [{"kind": "plan", "name": name, "why": why}
                 for name, why in state.damaged_reverts(j.state_dir)]
    findings += [{"kind": "table", "name": db, "why": why} for db, why in j.damaged_tables()]
    return {"events": events, "actors": len(actors), "blobs": len(blobs),
            "attic_entries": len(attic), "attic_looked_at": root_fd is not None,
            "findings": findings}


def _holds_its_hash(j: Journal, dg: str) -> bool:
    """Does the store's blob file ``dg`` (when it is one: a small blob lives in the journal)
    still hash to its name?  Read a chunk at a time."""
    if j.blob(dg) is not None:
        try:
            j.content.get(dg)
        except BlobError:
            return False
        return True
    try:
        fd = j.content.files.open(dg)
    except (OSError, BlobError):
        return False
    try:
        return hash_fd(fd) == dg
    finally:
        os.close(fd)


def _name(table: dict, key: str, where: tuple) -> None:
    row = table.get(key)
    if row is None:
        table[key] = [1, *where]
    else:
        row[0] += 1


def _missing_from_attic(j: Journal, root_fd: int, attic: dict, dropped: set) -> list[dict]:
    """The entries of ``attic`` (name -> [events, first seq, its path]) the workspace's attic
    does not hold, but for those a reclaim dropped and those copied into the store since (the
    daemon settles them while mounted: the event, read again, names the entry no more)."""
    out = []
    afd = open_attic(root_fd)
    try:
        for name, (n, seq, path) in attic.items():
            if name in dropped or _entry_there(afd, name):
                continue
            now = j.event(seq, fresh=True) or {}
            if name in ((now.get("pre") or {}).get("attic"), (now.get("pre2") or {}).get("attic")):
                out.append(_finding("attic", name, n, seq, path))
    finally:
        if afd is not None:
            os.close(afd)
    return out


def _changed_in_attic(j: Journal, root_fd: int, linked: list[tuple], dropped: set,
                      written: set) -> list[dict]:
    """The entries of ``linked`` (a file's kept whole in the attic, no copy in the store) whose
    size or mtime moved since, where the record holds nothing that explains it (the readers'
    rule: States._from_pre): a file with other names, none of which the record holds, was
    written through a hard link outside the record; one kept under its one name, with no
    events of its own (a descriptor left open on it), was changed around the record."""
    out = []
    afd = open_attic(root_fd) if linked else None
    partnered: dict | None = None  # path -> the first link or alias event naming it

    def partner_before(path, seq) -> bool:
        nonlocal partnered
        if partnered is None:
            partnered = {}
            for e in j.events_of(("link", "alias")):
                for p in (e.get("path"), e.get("source")):
                    partnered.setdefault(p, e["seq"])
        return partnered.get(path, seq) < seq
    try:
        for name, seq, path, size, mtime_ns, nlink in linked:
            if name in dropped or "/" in name or afd is None:
                continue
            try:
                st = os.lstat(name, dir_fd=afd)
            except FileNotFoundError:
                continue  # missing: _missing_from_attic's, or copied into the store since
            if (st.st_size, st.st_mtime_ns) == (size, mtime_ns):
                continue
            now = j.event(seq, fresh=True) or {}
            if not any(isinstance(p, dict) and p.get("attic") == name and "blob" not in p
                       for p in (now.get("pre"), now.get("pre2"))):
                continue  # copied into the store meanwhile
            if nlink < 2 and name in written:
                continue  # its own chain holds what it was
            if nlink > 1 and partner_before(path, seq):
                continue  # another name in the record: the readers follow it
            out.append(_finding("attic-changed", name, 1, seq, path))
    finally:
        if afd is not None:
            os.close(afd)
    return out


def _entry_there(afd: int | None, name: str) -> bool:
    if afd is None or "/" in name:
        return False
    try:
        os.lstat(name, dir_fd=afd)
        return True
    except FileNotFoundError:
        return False


def _finding(kind: str, name: str, n: int, seq: int, path) -> dict:
    return {"kind": kind, "name": name, "events": n, "seq": seq, "path": path}
