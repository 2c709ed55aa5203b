"""Where the record's bytes go: the figures of ``overlayrec storage`` and of ``status``'s size line.

Every figure is bytes on disk (``st_blocks * 512``, as ``du`` counts them): what removing the
thing would give back, so a sparse or a small file costs what it occupies, not its length.

* **journal**: the files of the LMDB environment.  Of its data file, the pages a compaction
  (``gc``) would give back: LMDB's free pages (on its freelist, kept for reuse, never returned
  to the filesystem), the freelist's own pages and any length past the last page.
* **content**: the content store, directories and temp files included; each blob is charged to
  the first session whose events name it (``blob``, ``ranges``, a write's ``data``).  A small
  blob kept in the journal (``blobs``, at most 64 KiB) is charged by its length to its
  session's content, and counted in the journal's bytes in the totals.
* **attic**: this journal's entries (``<journal id>.<seq>``).  An entry whose inode the
  workspace still links costs nothing (it is shared); one only the attic holds costs its blocks,
  once however many attic names it has, charged to the session of the event that kept it.
* **exports**: the private git store (``git/``) and the export state files.
* **logs**: the daemon's log.  **other**: the rest of the state dir (revert plans, daemon.json, the reserve).

Sessions are charged by one pass over the events: an event belongs to the session its unit
names, else (an outside actor, a revert) to the session open at that point (the latest begun
when several are), else to nobody (the "outside" row).  Blob sizes come from one stat per digest.

Sync, and reading only: nothing here writes to the state dir or the workspace.
"""
from __future__ import annotations

import json
import os
import stat
import struct

from ..journal import Journal
from ..state import StateDir, registry_path, tree_bytes
from ..views import unit_session
from .states import ATTIC

BLOCK = 512
OUTSIDE = None  # the key of the row of events no session holds


def on_disk(st: os.stat_result) -> int:
    return st.st_blocks * BLOCK


# -- the journal's pages --------------------------------------------------------------------------

_META_MAGIC = 0xBEEFC0DE
_PAGE_HEADER = 16            # MDB_page up to its pointers (pgno, pad, flags, lower/upper)
_DB = struct.Struct("<IHHQQQQQ")  # MDB_db: pad, flags, depth, branch, leaf, overflow, entries, root
# MDB_meta: magic, version, address, mapsize, two MDB_db records (freelist, main), then these
_META_TAIL = 24 + 2 * _DB.size  # mm_last_pg, mm_txnid


def _tree_pages(db: tuple) -> int:
    return db[3] + db[4] + db[5]


def journal_pages(j: Journal) -> dict:
    """The data file's pages: ``pages`` (its length), ``used`` (meta pages and every table's
    pages: what a compacted copy holds), ``free`` (the rest: LMDB's freelist, the freelist's own
    pages, any length past the last page), ``page_size``, ``size`` (bytes).  The binding does not
    reach the freelist, so free is what no table uses; the last page number is read from the
    meta page of the snapshot the read transaction sees (64-bit LMDB's layout, little-endian).
    (Retention's own count of what a gc reclaims is to replace this one.)"""
    env = j.env
    psize = env.stat()["psize"]
    data = os.path.join(j.state_dir, "journal", "data.mdb")
    named = 0
    with env.begin() as txn:
        tid = txn.id()
        main = txn.stat(env.open_db())
        for _, v in txn.cursor():  # the main table holds one MDB_db record per named table
            if len(v) == _DB.size:
                named += _tree_pages(_DB.unpack(v))
        metas = []
        with open(data, "rb") as f:
            for pgno in (0, 1):
                f.seek(pgno * psize)
                raw = f.read(_PAGE_HEADER + _META_TAIL + 16)
                if len(raw) < _PAGE_HEADER + _META_TAIL + 16:
                    continue
                magic = struct.unpack_from("<I", raw, _PAGE_HEADER)[0]
                if magic != _META_MAGIC:
                    continue
                last, txnid = struct.unpack_from("<QQ", raw, _PAGE_HEADER + _META_TAIL)
                metas.append((txnid == tid, txnid, last))
            size = os.fstat(f.fileno()).st_size
    pages = size // psize
    if not metas:  # not the layout we know: count nothing as free rather than guess
        return {"page_size": psize, "size": size, "pages": pages, "used": pages, "free": 0,
                "past_last": 0}
    _, _, last = max(metas)  # the meta of our snapshot, else the newest
    used = 2 + main["branch_pages"] + main["leaf_pages"] + main["overflow_pages"] + named
    used = min(used, pages)
    # pages past the last one: none in a file written through (what the daemon does now); in
    # a sparse file an older overlayrec left, holes, costing nothing (``categories`` caps it)
    return {"page_size": psize, "size": size, "pages": pages, "used": used,
            "free": max(0, min(pages, last + 1) - used), "past_last": max(0, pages - last - 1)}


# -- the attic ------------------------------------------------------------------------------------

def attic_entries(attic_fd: int, journal_id: str | None) -> dict[int, dict]:
    """This journal's attic entries by seq, as retention charges them (``attic_costs``, which a
    budget counts by too)."""
    from ..retention import attic_costs
    return attic_costs(attic_fd, journal_id)


def open_attic(root_fd: int) -> int | None:
    """The attic directory beneath a workspace root fd (the underlay's, when mounted: the
    mount hides it), or None when there is none."""
    try:
        return os.open(ATTIC, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                       dir_fd=root_fd)
    except (FileNotFoundError, NotADirectoryError):
        return None


def attic_summary(entries: dict[int, dict] | None) -> dict | None:
    if entries is None:
        return None
    shared = [e for e in entries.values() if e["shared"]]
    return {"bytes": sum(e["bytes"] for e in entries.values()), "entries": len(entries),
            "shared_entries": len(shared), "shared_size": sum(e["size"] for e in shared)}


def registered() -> list[str]:
    """Every workspace the registry names (each one this user's overlayrec has mounted),
    sorted; entries that cannot be read are left out."""
    d = os.path.dirname(registry_path("/"))
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith(".json"))
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        try:
            with open(os.path.join(d, n), "rb") as f:
                ws = json.loads(f.read()).get("workspace")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(ws, str) and ws and ws not in out:
            out.append(ws)
    return sorted(out)


# -- the whole record -----------------------------------------------------------------------------

def categories(sd: str, j: Journal, attic: dict[int, dict] | None) -> dict:
    """The state dir's bytes by category, and the attic's; ``total`` their sum."""
    d = StateDir(sd)
    journal_bytes, _ = tree_bytes(d.journal)
    pages = journal_pages(j)
    content_bytes, content_files = tree_bytes(d.content)
    git_bytes, _ = tree_bytes(d.git)
    exports = git_bytes
    logs = other = 0
    try:
        top = os.lstat(sd)
        other = on_disk(top)
        with os.scandir(sd) as it:
            for e in it:
                if e.path in (d.journal, d.content, d.git):
                    continue
                b, _ = tree_bytes(e.path)
                if e.name.startswith("export-") and e.name.endswith(".json"):
                    exports += b
                elif e.name.startswith("daemon.log"):
                    logs += b
                else:
                    other += b
    except FileNotFoundError:
        pass
    try:
        data_disk = on_disk(os.stat(os.path.join(d.journal, "data.mdb")))
    except FileNotFoundError:
        data_disk = 0
    psize = pages["page_size"]
    # what a compaction gives back: the free pages, and whatever the file occupies past its
    # last page (never more than it occupies: an old sparse data.mdb is mostly holes)
    free = min(data_disk, pages["free"] * psize +
               max(0, data_disk - (pages["pages"] - pages["past_last"]) * psize))
    out = {
        "journal": {"bytes": journal_bytes,
                    "data_size": pages["size"],
                    "page_size": pages["page_size"], "pages": pages["pages"],
                    "used_pages": pages["used"], "free_pages": pages["free"],
                    "pages_past_last": pages["past_last"],
                    "reclaimable": free},
        "content": {"bytes": content_bytes, "files": content_files},
        "attic": attic_summary(attic),
        "exports": {"bytes": exports, "git": git_bytes},
        "logs": {"bytes": logs},
        "other": {"bytes": other},
    }
    out["total"] = sum((v or {}).get("bytes", 0) for v in out.values())
    return out


def digests(ev: dict):
    """The content digests an event names: its pre-images' ``blob`` and ``ranges``, a write's
    ``data``."""
    for k in ("pre", "pre2"):
        pre = ev.get(k)
        if isinstance(pre, dict):
            if isinstance(pre.get("blob"), str):
                yield pre["blob"]
            for r in pre.get("ranges") or ():
                if isinstance(r, list) and len(r) == 3 and isinstance(r[2], str):
                    yield r[2]
    if isinstance(ev.get("data"), str):
        yield ev["data"]


def _attic_seqs(ev: dict, prefix: str):
    for k in ("pre", "pre2"):
        name = (ev.get(k) or {}).get("attic") if isinstance(ev.get(k), dict) else None
        if isinstance(name, str) and name.startswith(prefix) and name[len(prefix):].isdigit():
            yield int(name[len(prefix):])


def pins(j: Journal) -> set[str]:
    """The pinned sessions: the journal's ``pins`` table, which `pin` writes (a meta ``pins``
    was read here, which nothing writes: no session ever showed as pinned)."""
    return set(j.pins())


def sessions(j: Journal, content_root: str, attic: dict[int, dict] | None,
             mounted: bool) -> list[dict]:
    """One row per session, newest first, then the outside row: ``events``, ``content`` (bytes
    of the blobs it named first), ``attic`` (bytes of the attic entries its events kept),
    ``begun`` (ns), ``ended``, ``live`` (open while mounted), ``pinned``."""
    rows: dict[str | None, dict] = {}
    records = {r["id"]: r for r in j.records("sessions") if isinstance(r.get("id"), str)}

    def row(sid):
        r = rows.get(sid)
        if r is None:
            r = rows[sid] = {"session": sid, "events": 0, "content": 0, "blobs": 0, "attic": 0,
                             "attic_entries": 0, "first_seq": None, "last_seq": None}
        return r
    seen: set[str] = set()
    inline = dict(j.blob_sizes())
    jid = j.meta("journal_id")
    prefix = (jid + ".") if jid else None
    attic_owner: dict[int, str | None] = {}
    ranges: dict[str, list] = {}  # session -> [begin seq, end seq or None]
    open_now: list[str] = []
    for ev in j.events():
        op, seq = ev["op"], ev["seq"]
        sid = ev.get("session") if isinstance(ev.get("session"), str) else None
        if op == "session_begin" and sid:
            ranges.setdefault(sid, [seq, None])
            if sid not in open_now:
                open_now.append(sid)
        elif op == "session_end" and sid:
            ranges.setdefault(sid, [seq, None])[1] = seq
            if sid in open_now:
                open_now.remove(sid)
        owner = unit_session(ev.get("unit")) or sid or (open_now[-1] if open_now else OUTSIDE)
        r = row(owner)
        r["events"] += 1
        if r["first_seq"] is None:
            r["first_seq"] = seq
        r["last_seq"] = seq
        for dg in digests(ev):
            if dg in seen:
                continue
            seen.add(dg)
            if dg in inline:  # a small blob, kept in the journal's pages
                r["content"] += inline[dg]
                r["blobs"] += 1
                continue
            try:
                r["content"] += on_disk(os.lstat(os.path.join(content_root, dg[:2], dg[2:])))
                r["blobs"] += 1
            except (OSError, ValueError):
                pass  # named but not kept (dropped, or never written: a failed save)
        if prefix and attic:
            for a in _attic_seqs(ev, prefix):
                attic_owner[a] = owner
    for aseq, entry in (attic or {}).items():
        if aseq in attic_owner:
            owner = attic_owner[aseq]
        else:  # its event is not in the journal (a change that failed): by the seq ranges
            holders = [(b, s) for s, (b, e) in ranges.items()
                       if b <= aseq and (e is None or aseq <= e)]
            owner = max(holders)[1] if holders else OUTSIDE
        r = row(owner)
        r["attic"] += entry["bytes"]
        r["attic_entries"] += 1
    pinned = pins(j)
    for sid in records:
        row(sid)
    out = []
    for sid, r in rows.items():
        if sid is OUTSIDE:
            continue
        rec = records.get(sid, {})
        out.append({**r, "begun": rec.get("started"), "ended": rec.get("ended"),
                    "live": mounted and sid in records and rec.get("ended") is None,
                    "pinned": sid in pinned})
    out.sort(key=lambda r: (r["begun"] or 0, r["first_seq"] or 0), reverse=True)
    if OUTSIDE in rows:
        out.append({**rows[OUTSIDE], "begun": None, "ended": None, "live": False,
                    "pinned": False})
    return out


def measure(sd: str, j: Journal, root_fd: int | None, *, mounted: bool = False,
            per_session: bool = True) -> dict:
    """The record's figures (``categories``), and with ``per_session`` its sessions' rows.
    ``root_fd``: the workspace's root (beneath the mount when mounted), for the attic; None
    when it cannot be reached (the attic is then unknown: null)."""
    attic = None
    if root_fd is not None:
        afd = open_attic(root_fd)
        if afd is None:
            attic = {}
        else:
            try:
                attic = attic_entries(afd, j.meta("journal_id"))
            finally:
                os.close(afd)
    out = categories(sd, j, attic)
    if per_session:
        out["sessions"] = sessions(j, StateDir(sd).content, attic, mounted)
    return out
