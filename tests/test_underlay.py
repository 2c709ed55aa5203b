"""The underlay's fd-based helpers, called directly (no mount): what the fs layer and the
recorder change through an O_PATH fd lands on that object, and only there."""
import os

import pytest

from overlayrec import underlay

pytestmark = pytest.mark.timeout(30)

T1 = 1_704_067_200_123_456_789
T2 = 1_600_000_000_987_654_321


def _opath(path: str) -> int:
    return os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)


def test_utimens_fd_sets_both_times_to_the_nanosecond(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    fd = _opath(str(f))
    try:
        underlay.utimens_fd(fd, T1, T2, False)
    finally:
        os.close(fd)
    st = os.lstat(f)
    assert (st.st_atime_ns, st.st_mtime_ns) == (T1, T2)


@pytest.mark.parametrize("which", ["atime", "mtime"])
def test_utimens_fd_leaves_a_time_given_as_none_alone(tmp_path, which):
    f = tmp_path / "f"
    f.write_text("x")
    os.utime(f, ns=(T2, T2))
    fd = _opath(str(f))
    try:
        underlay.utimens_fd(fd, None if which == "atime" else T1,
                            None if which == "mtime" else T1, False)
    finally:
        os.close(fd)
    st = os.lstat(f)
    assert (st.st_atime_ns, st.st_mtime_ns) == ((T2, T1) if which == "atime" else (T1, T2))


def test_utimens_fd_of_a_symlink_sets_the_links_times_not_its_targets(tmp_path):
    target = tmp_path / "target"
    target.write_text("x")
    os.utime(target, ns=(T2, T2))
    link = tmp_path / "link"
    os.symlink("target", link)
    fd = _opath(str(link))
    try:
        underlay.utimens_fd(fd, T1, T1, True)
    finally:
        os.close(fd)
    assert os.lstat(link).st_mtime_ns == T1
    assert (os.lstat(target).st_atime_ns, os.lstat(target).st_mtime_ns) == (T2, T2)


def test_utimens_fd_of_a_gone_fd_raises_oserror(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    fd = _opath(str(f))
    os.close(fd)
    with pytest.raises(OSError):
        underlay.utimens_fd(fd, T1, T1, False)


def _acl(*entries) -> bytes:
    return (2).to_bytes(4, "little") + b"".join(
        tag.to_bytes(2, "little") + perm.to_bytes(2, "little") + ident.to_bytes(4, "little")
        for tag, perm, ident in entries)


@pytest.mark.parametrize("start, acl", [
    (0o600, _acl((1, 7, 0), (4, 5, 0), (0x20, 4, 0))),                      # equivalent to 0754
    (0o644, _acl((1, 6, 0), (2, 7, 4321), (4, 7, 0), (0x10, 4, 0), (0x20, 0, 0))),  # mask
    (0o2755, _acl((1, 5, 0), (4, 1, 0), (0x20, 1, 0))),                     # set-id bits kept
    (0o640, _acl()),                                                        # empty: removed
    (0o640, _acl((1, 6, 0), (0x20, 4, 0))),                                 # no group: refused
    (0o640, b"\x01\x00\x00\x00"),                                           # not version 2
], ids=["equivalent", "mask", "set-id", "empty", "no-group", "version-1"])
def test_acl_mode_is_the_mode_the_kernel_leaves(tmp_path, start, acl):
    f = tmp_path / "f"
    f.write_text("x")
    try:
        os.setxattr(f, underlay.ACL_ACCESS, _acl((1, 6, 0), (4, 4, 0), (0x20, 4, 0)))
    except OSError:
        pytest.skip("no ACLs on this filesystem")
    os.chmod(f, start)
    try:
        os.setxattr(f, underlay.ACL_ACCESS, acl)
    except OSError as e:
        assert underlay.acl_mode(acl, os.lstat(f)) is None, e  # the kernel refused it too
        return
    got = underlay.acl_mode(acl, os.stat_result((start | 0o100000,) + tuple(os.lstat(f))[1:]))
    assert got == os.lstat(f).st_mode & 0o7777, (oct(got), oct(os.lstat(f).st_mode))
