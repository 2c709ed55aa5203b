"""``State``, the value every reader compares, writes and prints (engines/states.py): immutable
(the readers share one among their answers and caches), equal and hashed field by field,
``but`` a changed copy, ``same`` blind to what is no content (exactness, inode, drift)."""
from __future__ import annotations

import pytest

from overlayrec.engines.states import ABSENT, State


def test_a_state_cannot_be_changed_in_place():
    s = State("file", 0o644, b"x")
    for field in ("kind", "data", "exact", "mode"):
        with pytest.raises(AttributeError):
            setattr(s, field, None)
    with pytest.raises(AttributeError):
        s.extra = 1  # no instance dict either
    assert s == State("file", 0o644, b"x")


def test_equal_and_hashed_by_every_field():
    a = State("file", 0o644, b"x", uid=1, gid=2, ino=7, nlink=2)
    b = State("file", mode=0o644, data=b"x", uid=1, gid=2, ino=7, nlink=2)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    for kw in ({"exact": False}, {"ino": 8}, {"drifted": True}, {"withheld": True},
               {"mode": 0o600}, {"data": b"y"}, {"uid": 3}):
        c = a.but(**kw)
        assert c != a and type(c) is State, kw
        assert getattr(c, next(iter(kw))) == next(iter(kw.values()))
    assert a.exact and not a.drifted  # but() left the original as it was


def test_same_compares_content_not_bookkeeping():
    a = State("file", 0o644, b"x", uid=1, ino=7)
    assert a.same(a.but(exact=False, ino=9, drifted=True, nlink=3))
    assert a.same(a.but(uid=None))        # an owner the record does not know
    assert not a.same(a.but(uid=2))
    assert not a.same(a.but(withheld=True))
    assert State("symlink", 0o120000, b"t").same(State("symlink", 0o120000, b"t", uid=0))
    assert ABSENT.same(State("absent", exact=False)) and not ABSENT.present
    assert repr(ABSENT).startswith("State(kind='absent'")
