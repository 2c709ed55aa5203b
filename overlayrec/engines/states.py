"""The state of a recorded path at any sequence point, rebuilt from the journal.

The journal is a reverse-delta chain ending at the live tree: an event's pre-image is the state
of its path just before it.  So the state of path P *after* sequence number S is the pre-image
of the first later event on P, or the live tree when there is none.  Pre-images are kept by
facet (content may be saved by a later event of the same epoch, and for large files only the
ranges a change was about to lose), so a content is completed from what the epoch saved and
from the state at the epoch's end.

Exact at every epoch boundary (every unit boundary); a point inside an epoch is answered with
the epoch's next known state and marked inexact.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from ..journal import Journal

ATTIC = ".overlayrec-attic"


@dataclass(frozen=True)
class State:
    kind: str                 # absent | file | dir | symlink | fifo | socket | device
    mode: int = 0
    data: bytes = b""         # file content, or a symlink's target
    exact: bool = True

    @property
    def present(self) -> bool:
        return self.kind != "absent"


ABSENT = State("absent")


class Tree:
    """Reads the live tree and the attic below a root directory fd (the underlay)."""

    def __init__(self, root_fd: int):
        self.root_fd = root_fd

    @classmethod
    def at(cls, path: str) -> "Tree":
        return cls(os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))

    def _open_parent(self, rel: str) -> tuple[int, str]:
        from ..underlay import open_beneath
        parent, _, name = rel.rpartition("/")
        return (open_beneath(self.root_fd, parent) if parent else os.dup(self.root_fd)), name

    def state(self, rel: str) -> State:
        try:
            dfd, name = self._open_parent(rel)
        except OSError:
            return ABSENT
        try:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                return ABSENT
            if stat.S_ISLNK(st.st_mode):
                return State("symlink", 0o120000, os.fsencode(os.readlink(name, dir_fd=dfd)))
            if stat.S_ISDIR(st.st_mode):
                return State("dir", stat.S_IMODE(st.st_mode))
            if stat.S_ISREG(st.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                with os.fdopen(fd, "rb") as f:
                    return State("file", stat.S_IMODE(st.st_mode), f.read())
            return State("fifo" if stat.S_ISFIFO(st.st_mode) else "device",
                         stat.S_IMODE(st.st_mode))
        finally:
            os.close(dfd)

    def symlink_on_the_way(self, rel: str) -> bool:
        """Is a parent directory of ``rel`` a symlink (or not a directory) now?"""
        fd = os.dup(self.root_fd)
        try:
            for part in rel.split("/")[:-1]:
                try:
                    st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    return False
                if not stat.S_ISDIR(st.st_mode):
                    return True
                nfd = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = nfd
            return False
        finally:
            os.close(fd)

    def attic(self, name: str) -> bytes | None:
        s = self.state(f"{ATTIC}/{name}")
        return s.data if s.kind in ("file", "symlink") else None


class States:
    """Answers state(path, after_seq) for one journal and one tree."""

    def __init__(self, journal: Journal, tree: Tree):
        self.j = journal
        self.tree = tree
        self._events: dict[str, list[dict]] = {}
        self._cache: dict[tuple, State] = {}
        self._ends: dict[str, int] | None = None

    def events_on(self, path: str) -> list[dict]:
        evs = self._events.get(path)
        if evs is None:
            evs = []
            failed = set()
            for seq in self.j.seqs_for_path(path):
                e = self.j.event(seq)
                if e is None:
                    continue
                if e["op"] == "failed":
                    failed.add(e["ref"])
                else:
                    evs.append(e)
            evs = [e for e in evs if e["seq"] not in failed]
            self._events[path] = evs
        return evs

    @staticmethod
    def pre_for(ev: dict, path: str) -> dict | None:
        if ev.get("path") == path and ev.get("pre") is not None:
            return ev["pre"]
        if ev.get("path2") == path and ev.get("pre2") is not None:
            return ev["pre2"]
        return None

    @staticmethod
    def starts_epoch(ev: dict, path: str) -> bool:
        return (ev.get("path") == path and ev.get("epoch")) or \
            (ev.get("path2") == path and ev.get("epoch2"))

    def state(self, path: str, after: int, forward: bool = True) -> State:
        """The state of ``path`` after event ``after`` (and before any later one)."""
        key = (path, after, forward)
        if key not in self._cache:
            st = self._state(path, after, forward)
            if st.exact and self._may_change_unseen(path, after):
                st = State(st.kind, st.mode, st.data, exact=False)
            self._cache[key] = st
        return self._cache[key]

    def _may_change_unseen(self, path: str, after: int) -> bool:
        """Writes after a handle's first one are not events (unless the journal records data):
        a point inside a run that wrote this way, before its unit ended, is not exact."""
        allevs = self.events_on(path)
        evs = [e for e in allevs if e["seq"] <= after]
        if not evs:
            return False
        nxt = next((e for e in allevs if e["seq"] > after), None)
        if nxt is not None and nxt["seq"] == after + 1:
            pre = self.pre_for(nxt, path)
            if pre is not None and "kind" in pre:
                return False  # "just before that event": its pre-image, taken then, is exact
        for e in reversed(evs):
            if e["op"] == "write" and "data" not in e:
                break
            if self.starts_epoch(e, path):
                return False
        else:
            return False
        end = self._unit_ends().get(evs[-1].get("unit") or "")
        return end is None or end > after

    def _unit_ends(self) -> dict[str, int]:
        if self._ends is None:
            ends = {}
            for c in self.j.records("calls"):
                if c.get("end_seq"):
                    ends[f"call:{c['session']}:{c['id']}"] = c["end_seq"]
            for t in self.j.records("turns"):
                if t.get("end_seq"):
                    ends[f"turn:{t['session']}:{t['index']}"] = t["end_seq"]
            for e in self.j.events():
                if e["op"] == "session_end":
                    ends[f"session:{e['session']}"] = e["seq"]
            self._ends = ends
        return self._ends

    def _state(self, path: str, after: int, forward: bool = True) -> State:
        allevs = self.events_on(path)
        evs = [e for e in allevs if e["seq"] > after]
        if evs and forward:
            pre = self.pre_for(evs[0], path)
            if pre is None or "kind" not in pre:
                # inside an epoch: exact only if the journal holds the data of every write
                fwd = self._forward(path, after, allevs)
                if fwd is not None:
                    return fwd
        exact = True
        for i, e in enumerate(evs):
            pre = self.pre_for(e, path)
            if pre is None or "kind" not in pre:
                exact = False  # inside an epoch: the next full pre-image is later than asked
                continue
            s = self._from_pre(path, e, pre, evs[i:])
            return s if exact else State(s.kind, s.mode, s.data, exact=False)
        live = self.tree.state(path)
        return live if exact else State(live.kind, live.mode, live.data, exact=False)

    def _from_pre(self, path: str, e: dict, pre: dict, later: list[dict]) -> State:
        kind = pre["kind"]
        if kind == "absent":
            return ABSENT
        if kind == "dir":
            return State("dir", pre.get("mode", 0o755))
        if kind == "symlink":
            return State("symlink", 0o120000, os.fsencode(pre.get("target") or ""))
        if kind != "file":
            return State(kind, pre.get("mode", 0))
        mode = pre.get("mode", 0o644)
        if "blob" in pre:
            return State("file", mode, self.j.content.get(pre["blob"]))
        if "attic" in pre and e["op"] in ("unlink", "rename") and not \
                (e["op"] == "rename" and e.get("path") == path):
            data = self.tree.attic(pre["attic"])
            if data is not None:
                return State("file", mode, data)
        if e["op"] == "rename" and e.get("path") == path:
            return self._moved(path, e, mode)
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
                if "blob" in fp:
                    return State("file", mode, self.j.content.get(fp["blob"]))
                ranges.extend(fp.get("ranges", []))
        end = self.state(path, end_after) if end_after is not None else self.tree.state(path)
        size = pre.get("size", len(end.data))
        data = bytearray(end.data[:size].ljust(size, b"\0"))
        for off, length, digest in ranges:
            data[off:off + length] = self.j.content.get(digest)
        return State("file", mode, bytes(data), end.exact)

    def _forward(self, path: str, after: int, evs: list[dict]) -> State | None:
        """Replay forward from the last full pre-image at or before ``after`` (full-fidelity
        journals: every write carries its data); None when an event cannot be replayed."""
        start = None
        for i, e in enumerate(evs):
            if e["seq"] > after:
                break
            pre = self.pre_for(e, path)
            if pre is not None and "kind" in pre:
                start = i
        if start is None:
            return None
        e0 = evs[start]
        st = self._state(path, e0["seq"] - 1)
        kind, mode, data = st.kind, st.mode, bytearray(st.data)
        for e in evs[start:]:
            if e["seq"] > after:
                break
            op = e["op"]
            if op == "write":
                if "data" not in e:
                    return None
                chunk = self.j.content.get(e["data"])
                off = e["offset"]
                if len(data) < off:
                    data.extend(b"\0" * (off - len(data)))
                data[off:off + len(chunk)] = chunk
            elif op == "truncate":
                size = e["size"]
                del data[size:]
                data.extend(b"\0" * (size - len(data)))
            elif op == "create":
                kind, mode, data = "file", e.get("mode", 0o644) & 0o7777, bytearray()
            elif op == "chmod":
                mode = e["mode"]
            elif op in ("chown", "utimens", "setxattr", "removexattr"):
                pass
            elif op in ("unlink", "rmdir"):
                kind, mode, data = "absent", 0, bytearray()
            elif op == "mkdir":
                kind, mode, data = "dir", e.get("mode", 0o755), bytearray()
            elif op == "symlink":
                kind, mode, data = "symlink", 0o120000, bytearray(os.fsencode(e["target"]))
            elif op == "rename" and e.get("path") == path and e.get("path2") != path:
                kind, mode, data = "absent", 0, bytearray()
            elif op in ("rename", "link"):
                src = e["path"] if op == "rename" else e.get("source")
                if not src:
                    return None
                s2 = self.state(src, e["seq"] - 1)
                if not s2.exact:
                    return None
                kind, mode, data = s2.kind, s2.mode, bytearray(s2.data)
            else:
                return None
        return State(kind, mode, bytes(data)) if kind != "absent" else ABSENT

    def _moved(self, path: str, e: dict, mode: int) -> State:
        """A renamed-away file: the inode, unchanged by the rename, now at its new name.  Its
        content is the first one the journal saved under the new name (the recorder saves it
        before the first change there, in the same epoch too), or the live file."""
        new = e["path2"]
        for f in self.events_on(new):
            if f["seq"] <= e["seq"]:
                continue
            pre = self.pre_for(f, new)
            if pre is None:
                if f["op"] in ("write", "truncate"):
                    break  # changed unsaved (a journal from before the rename rule): inexact
                continue
            if "blob" in pre:
                return State("file", mode, self.j.content.get(pre["blob"]))
            if "kind" in pre:
                s = self.state(new, f["seq"] - 1, forward=False)
                return State("file", mode, s.data, s.exact) if s.kind == "file" else s
            if "ranges" in pre:
                s = self.state(new, f["seq"] - 1, forward=False)
                return State("file", mode, s.data, s.exact) if s.kind == "file" else s
        else:
            live = self.tree.state(new)
            return State("file", mode, live.data) if live.kind == "file" else live
        s = self.state(new, e["seq"], forward=False)
        return State("file", mode, s.data, False) if s.kind == "file" else s
