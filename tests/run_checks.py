"""What a write run begun by the event that opened its handle (a create that made the file,
a truncating open) must read as, whichever event began it: tests/test_create_runs.py and
tests/test_truncate_runs.py each make such runs with their writer and ask this of them."""
from __future__ import annotations


def check_extents(j, many: int, empty: int, chmodded: int) -> None:
    """The extents notes of the runs begun by events ``many`` (three writes, 21 bytes from
    0), ``empty`` (never written) and ``chmodded`` (one write, then a chmod)."""
    got = j.extents(many)
    assert got is not None and got["writes"] == 3, got
    assert (got["lo"], got["hi"], got["bytes"]) == (0, 21, 21), got
    assert j.extents(empty)["writes"] == 0
    # the run ended when the chmod came: one write, noted then
    assert j.extents(chmodded)["writes"] == 1


def check_points(states, at: dict, snap: dict) -> None:
    """``quick`` (one write before any other event): the opening event's point is the file
    with that write, exact.  ``many`` (writes went on after other events): not exact there;
    once the run ended (settle), exact and what the writer read back."""
    s = states.state("quick", at["quick"][0])
    assert s.exact and s.data == snap["quick"] == b"at once\n"
    assert states.settle("quick", at["quick"][0]) == at["quick"][0]
    s = states.state("many", at["many"][0])
    assert not s.exact
    point = states.settle("many", at["many"][0])
    assert point > at["many"][0]
    s = states.state("many", point)
    assert s.exact and s.data == snap["many"]
