"""The directory renames of a journal, indexed by directory: which of them touch a name.

A directory rename touches a name when its source or target is one of the name's ancestors
(the path history of ``overlayrec.engines.states``), or, for the mount's drift scan, the name
itself.  Reading every rename for every name made the readers and the drift scan quadratic in
a session that renames thousands of directories (an installer unpacks each package into a
temp directory and renames it into place); through the index a name costs a bisect per
ancestor."""
from __future__ import annotations

import bisect


def outermost(dirs) -> list[str]:
    """``dirs`` sorted, without those beneath another of them (a walk of each that is left
    takes them in)."""
    out: list[str] = []
    for d in sorted(dirs):
        if not any(d.startswith(t + "/") for t in out):
            out.append(d)
    return out


class RenameIndex:
    """``renames`` (``Journal.dir_renames()``, in order) and, for each directory, the indexes
    of the renames it is the source or target of."""

    def __init__(self, renames: list[dict]):
        self.renames = renames
        self.seqs = [r["seq"] for r in renames]
        self._by_dir: dict[str, list[int]] = {}
        for i, r in enumerate(renames):
            self._by_dir.setdefault(r["src"], []).append(i)
            if r["dst"] != r["src"]:
                self._by_dir.setdefault(r["dst"], []).append(i)

    def upto(self, seq: float) -> int:
        """How many renames are at or before ``seq``: the index of the first one after it."""
        return bisect.bisect_right(self.seqs, seq)

    def touching(self, name: str, lo: int, hi: int, *, last: bool = False,
                 itself: bool = False) -> int | None:
        """The index of the first (``last``: the last) rename in ``renames[lo:hi]`` whose
        source or target is an ancestor of ``name`` (``itself``: or ``name``); None when there
        is none."""
        best = None
        pos = name.find("/")
        while True:
            if pos == -1 and not itself:
                break
            got = self._by_dir.get(name if pos == -1 else name[:pos])
            if got:
                if last:
                    k = bisect.bisect_left(got, hi) - 1
                    if k >= 0 and got[k] >= lo and (best is None or got[k] > best):
                        best = got[k]
                else:
                    k = bisect.bisect_left(got, lo)
                    if k < len(got) and got[k] < hi and (best is None or got[k] < best):
                        best = got[k]
            if pos == -1:
                break
            pos = name.find("/", pos + 1)
        return best
