"""Where things live: a workspace's state dir, the record of its running daemon, and what the
kernel's mount table says about it.  Plain files and /proc only; no journal, no FUSE.

Every file and directory overlayrec keeps is named here (``StateDir``, ``registry_path``) and
made here, with its mode given explicitly whatever the umask (the daemon runs with umask 0):
directories 0700 (``private_dir``), files 0600 (``open_private``, ``write_private``).  What is
read back is checked first: a state dir or registry another user could change is refused
(``check_private``), and a pid read from daemon.json is verified before anything signals it
(``verify_daemon``).  docs/storage.md lists every name with its role, mode and owner.
"""
from __future__ import annotations

import errno
import json
import os
import stat as _stat

FSNAME = "overlayrec"
# what a FUSE mount whose daemon died answers: "Transport endpoint is not connected", or
# "Software caused connection abort" when the connection was aborted under a request
DEAD_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)


class StateError(Exception):
    """A user-facing problem with a workspace or state dir; the message is one line."""


DIR_MODE = 0o700
FILE_MODE = 0o600


class StateDir:
    """A workspace's state dir: the name of everything overlayrec keeps in it.  The layout is
    docs/storage.md; change a name there and here together."""

    def __init__(self, path: str):
        self.path = path

    @property
    def journal(self) -> str:
        """The LMDB environment (data.mdb, lock.mdb)."""
        return os.path.join(self.path, "journal")

    @property
    def content(self) -> str:
        """The content store: blobs at xx/<rest of the xxh3-128 digest>, temp files in tmp/."""
        return os.path.join(self.path, "content")

    @property
    def content_tmp(self) -> str:
        return os.path.join(self.content, "tmp")

    @property
    def control_sock(self) -> str:
        return os.path.join(self.path, "control.sock")

    @property
    def daemon_json(self) -> str:
        """The running daemon: pid, start time (verify_daemon), workspace; gone at unmount."""
        return os.path.join(self.path, "daemon.json")

    @property
    def alive(self) -> str:
        """Touched by the serving daemon every few tenths of a second (its mtime: when a
        daemon was last known alive); after a crash, what changed later was not its doing."""
        return os.path.join(self.path, "alive")

    @property
    def reserve(self) -> str:
        """Room the daemon keeps where the state dir shares the workspace's filesystem, given
        up when that filesystem is full for a change that can free room (an ``rm``), whose
        event needs it (Recorder.make_reserve)."""
        return os.path.join(self.path, "reserve")

    @property
    def daemon_log(self) -> str:
        return os.path.join(self.path, "daemon.log")

    @property
    def reverts(self) -> str:
        """Saved revert plans, <revert id>.json: written before a revert's first change."""
        return os.path.join(self.path, "reverts")

    @property
    def revert_lock(self) -> str:
        """Held (flock) by the one revert or unrevert under way, from its plan to its end, or
        by a gc for its run (hold_revert_lock)."""
        return os.path.join(self.reverts, "lock")

    def revert_plan(self, revert_id: str) -> str:
        return os.path.join(self.reverts, revert_id + ".json")

    @property
    def git(self) -> str:
        """The private git object store of diff, show, report and export."""
        return os.path.join(self.path, "git")

    @property
    def listings(self) -> str:
        """The directory of the listings' settled rows (engines.listings): derived, rebuilt
        when removed."""
        return os.path.join(self.path, "listings")

    @property
    def answers(self) -> str:
        """The readers' kept answers (engines.answers): derived, rebuilt when removed."""
        return os.path.join(self.path, "answers")

    def export_state(self, tag: str) -> str:
        """What an export has written so far, for one (object store, ref prefix)."""
        return os.path.join(self.path, f"export-{tag}.json")


def private_dir(path: str) -> str:
    """Make ``path`` a directory of mode 0700, whatever the umask (missing parents too, 0700);
    an existing one of ours is brought to 0700.  One that is not ours is left as it is:
    ``check_private`` says whether to use it."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    except FileNotFoundError:
        parent = os.path.dirname(path)
        if parent == path:
            raise
        private_dir(parent)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            pass
    st = os.lstat(path)
    if not _stat.S_ISDIR(st.st_mode):
        raise StateError(f"{path} is not a directory")
    if _stat.S_IMODE(st.st_mode) != DIR_MODE and st.st_uid == os.geteuid():
        os.chmod(path, DIR_MODE)  # mkdir's mode went through the umask; an old one was looser
    return path


def replace_private(path: str, data: bytes) -> bool:
    """Put ``data`` at ``path`` (0600, in a 0700 directory made as needed) whole or not at all:
    a temp file of this process, renamed over it.  False when the state dir cannot take it
    (``path`` is then as it was)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        private_dir(os.path.dirname(path))
        fd = open_private(tmp)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def open_private(path: str, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC) -> int:
    """An fd on the regular file ``path``, made 0600 whatever the umask (an existing one of ours
    is brought to 0600); a symlink is never followed."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise StateError(f"{path} is not a regular file")
        if _stat.S_IMODE(st.st_mode) != FILE_MODE and st.st_uid == os.geteuid():
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def tighten(path: str) -> None:
    """Bring an existing file of ours to 0600, a directory to 0700 (what an older overlayrec,
    or a tool that takes no mode, left looser); anything else is left alone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    want = DIR_MODE if _stat.S_ISDIR(st.st_mode) else \
        FILE_MODE if _stat.S_ISREG(st.st_mode) else None
    if want is not None and st.st_uid == os.geteuid() and _stat.S_IMODE(st.st_mode) != want:
        os.chmod(path, want)


def write_private(path: str, data: bytes, durable: bool = False) -> None:
    """Replace ``path`` with ``data`` at once (a 0600 temp file beside it, renamed over it);
    ``durable``: fsynced before the rename."""
    tmp = path + ".tmp"
    fd = open_private(tmp)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def tighten_tree(path: str) -> None:
    """A tree of ours made for the user alone where an older overlayrec let git make it by the
    umask (a diff's object store, 0755): directories 0700, files without the group's and
    others' bits (git's read-only objects stay read-only).  Only when ``path`` itself is
    looser, so a store tightened once is not walked again."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not _stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or \
            not _stat.S_IMODE(st.st_mode) & 0o077:
        return
    for top, dirs, files in os.walk(path, topdown=False):
        for name in files + dirs:
            p = os.path.join(top, name)
            st = os.lstat(p)
            if st.st_uid == os.geteuid() and not _stat.S_ISLNK(st.st_mode):
                os.chmod(p, DIR_MODE if _stat.S_ISDIR(st.st_mode)
                         else _stat.S_IMODE(st.st_mode) & 0o700)
    os.chmod(path, DIR_MODE)


class private_umask:
    """``with private_umask():`` a block that makes state-dir files through code that takes no
    mode (git, LMDB) makes them for the user alone.  The umask is per process: not for a block
    that other threads run beside."""

    def __enter__(self):
        self._old = os.umask(0o077)
        return self

    def __exit__(self, *exc):
        os.umask(self._old)


def _owner_name(uid: int) -> str:
    import pwd
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_private(path: str, what: str = "state dir") -> bool:
    """Refuse (StateError, one line) a ``path`` another user could change, as ssh refuses an
    authorized_keys file: the path and every directory above it must be owned by the caller
    or root and not be writable by group or others.  Two exceptions, both places no one else
    can change an entry of ours: a sticky directory above it (/tmp, /var/tmp), and whatever
    lies beneath a directory others cannot enter (a 0700 home).  A path that does not exist
    yet is judged by the directories above it.  Symlinks are resolved first.

    True when others cannot reach inside ``path`` (it or a directory above it is closed to
    them), so what it holds needs only the owner check (``check_entry``)."""
    me = os.geteuid()
    real = os.path.realpath(os.path.abspath(path))
    chain = [real]
    while chain[-1] != "/":
        chain.append(os.path.dirname(chain[-1]))
    closed = False
    for p in reversed(chain):
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            break
        except OSError as e:
            raise StateError(f"{what} {path}: cannot check {p}: {e.strerror}") from None
        shown = path if os.path.abspath(path) == real else f"{path} ({real})"
        which = f"{what} {shown}" if p == real else f"{what} {shown}: {p} above it"
        if st.st_uid not in (me, 0):
            raise StateError(f"{which} is owned by {_owner_name(st.st_uid)}, not by you or "
                             "root: refusing it")
        is_dir = _stat.S_ISDIR(st.st_mode)
        if p != real and not is_dir:  # /dev/null/x: not a permission to mend
            raise StateError(f"{what} {path}: cannot check {p}: Not a directory")
        sticky_above = is_dir and p != real and st.st_mode & _stat.S_ISVTX
        if not closed and st.st_mode & 0o022 and not sticky_above:
            who = "group and others" if st.st_mode & 0o022 == 0o022 else \
                ("group" if st.st_mode & 0o020 else "others")
            raise StateError(f"{which} is writable by {who}: refusing it (check what it "
                             f"holds, then: chmod go-w {p})")
        if is_dir and not st.st_mode & 0o011:
            closed = True
    return closed


def check_entry(path: str, closed: bool, what: str = "state dir", own: bool = False) -> None:
    """``path`` inside a directory that passed ``check_private`` (``closed``: its answer):
    owned by the caller or root, and unless others cannot reach it, not writable by them.
    ``own``: an entry overlayrec makes itself, never a symlink (one out of the state dir, into
    a directory another user may write, was followed: events forged into the journal, a hook
    of theirs run by `export git`; found by a bug hunt), nor a fifo or device."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    if own and not (_stat.S_ISDIR(st.st_mode) or _stat.S_ISREG(st.st_mode)):
        raise StateError(f"{what}: {path} is not a file or directory overlayrec made (a "
                         "symlink, say): refusing it")
    if st.st_uid not in (os.geteuid(), 0):
        raise StateError(f"{what}: {path} is owned by {_owner_name(st.st_uid)}, not by you or "
                         "root: refusing it")
    if not closed and st.st_mode & 0o022 and not _stat.S_ISLNK(st.st_mode):
        raise StateError(f"{what}: {path} is writable by group or others: refusing it (check "
                         f"what it holds, then: chmod go-w {path})")


def check_state_dir_private(sd: str) -> str:
    """A state dir that is the user's alone (``check_private``), and so are the records in it
    that steer writes into the workspace: the journal and the saved revert plans.  (Blobs are
    checked against their names when read; a daemon's pid before it is signalled.)"""
    closed = check_private(sd, "state dir")
    d = StateDir(sd)
    for p in (d.journal, os.path.join(d.journal, "data.mdb"), os.path.join(d.journal, "lock.mdb"),
              os.path.join(d.journal, "ahead.log"), d.reverts):
        check_entry(p, closed, f"state dir {sd}", own=True)
    # what an older overlayrec made with the umask's mode (a mount brings it to 0700): its
    # kind and owner (a blob is checked against its name, and the git store runs no hook)
    for p in (d.content, d.git, os.path.join(d.git, "hooks"), os.path.join(d.git, "config"),
              d.answers, d.daemon_json, d.reserve):
        check_entry(p, True, f"state dir {sd}", own=True)
    return sd


def resolve_workspace(path: str, must_exist: bool = True, upward: bool = False) -> str:
    """``path`` as a workspace: resolved, and (``must_exist``) a directory.  ``upward`` (the
    reading commands): the recorded workspace at or above it, so that a command run in a
    subdirectory reads the workspace around it, as git finds its repository from anywhere in
    it.  A path at or below a mount whose daemon does not answer is refused (StateError) before
    anything stats it: that would wait on the daemon for good."""
    refuse_hung(path)
    ws = os.path.realpath(os.path.abspath(path))
    if upward:
        ws = recorded_at_or_above(ws)
        mount = overlayrec_mount_containing(ws)
        if mount is not None and mount != ws:
            # a record of its own inside a mounted workspace: a `run` here records into the
            # mount, while this reads the inner record (it answered for it without a word)
            import sys
            sys.stderr.write(f"overlayrec: note: reading the record of {ws}, which lies inside "
                             f"{mount}, mounted now (a `run` here records there: `-w {mount}` "
                             "reads that record)\n")
    try:
        st = os.stat(ws)
    except PermissionError:
        refuse_anothers(ws)
        st = None
        if must_exist:
            raise StateError(f"workspace {path}: Permission denied") from None
    except OSError as e:
        if e.errno in DEAD_ERRNOS or not must_exist:  # a dead mount is still a workspace
            return ws
        raise StateError(f"workspace {path}: {e.strerror}") from None
    import stat as _s
    if must_exist and not _s.S_ISDIR(st.st_mode):
        raise StateError(f"workspace {path}: not a directory")
    return ws


def refuse_anothers(ws: str) -> None:
    """StateError, in status's words, when ``ws`` is another user's overlayrec mount that
    this user may not enter (mounted without allow_other, the kernel refuses every other
    user): every command said "no such directory, and no record of it", or `run` "Permission
    denied", while `status` said whose daemon records it."""
    uid = others_mount(ws)
    if uid is not None:
        raise StateError(recorded_by_another(ws, uid))


_HUNG: set[str] = set()  # mounts found not answering by this process


def refuse_hung(path: str) -> None:
    """StateError when ``path`` (as written: a cwd in the mount is one) lies at or below an
    overlayrec mount whose daemon does not answer (stopped, or hung): a stat, a realpath or
    click's check of a path there waits on that daemon, and a reader would never return."""
    mount = overlayrec_mount_containing(os.path.abspath(path))
    if mount is None:
        return
    if mount not in _HUNG:  # asked once a process (a reader fastcli hands on to click asks twice)
        if mount_answers(mount) is not False:
            return
        _HUNG.add(mount)
    raise StateError(f"{mount} is mounted, but its daemon does not answer (stopped or hung): "
                     f"`overlayrec status {mount}` says more; `overlayrec umount {mount}` stops "
                     "it and detaches the mount (the record stays), then read it")


def named_workspace(path: str) -> str:
    """``path`` resolved as ``resolve_workspace`` resolves it, without ever asking the object it
    names: its directories by ``realpath``, and a last component that is a symlink (the way
    ``mount`` was given it) by ``readlink`` alone, which a hung mount does not answer for (a
    stat of a mount point would wait on its daemon).  For ``umount`` and ``status``."""
    p = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit of symlinks on one lookup
        p = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))
        try:
            target = os.readlink(p)
        except OSError:  # not a symlink (EINVAL), or nothing there: named as it is
            return p
        p = os.path.normpath(os.path.join(os.path.dirname(p), target))
    raise StateError(f"workspace {path}: too many levels of symbolic links")


def recorded_at_or_above(path: str) -> str:
    """The nearest recorded workspace at or above the resolved ``path``: an overlayrec mount
    point, or a directory the registry names or whose default state dir holds a journal;
    ``path`` itself when none is (its readers then say it is not recorded)."""
    if _known(path):  # the common case: named as it is (no mount table read)
        return path
    mount = overlayrec_mount_containing(path)
    p = path
    while True:
        if p == mount or _known(p):
            return p
        up = os.path.dirname(p)
        if up == p:
            return path
        p = up


def is_recorded(path: str) -> bool:
    """Is the resolved ``path`` a recorded workspace (``recorded_at_or_above`` would stop at
    it): one the registry names, whose default state dir holds a journal, or a mount point?"""
    return _known(path) or overlayrec_mount_containing(path) == path


def recorded_around(path: str) -> tuple[str, str] | None:
    """The recorded workspace at or above the absolute ``path``'s directory, and ``path``
    with that directory resolved; None when there is none.  A path at or below a mount whose
    daemon does not answer is refused first (StateError), as ``resolve_workspace`` does."""
    refuse_hung(path)
    up = os.path.realpath(os.path.dirname(path))
    around = recorded_at_or_above(up)
    return (around, os.path.join(up, os.path.basename(path))) if is_recorded(around) else None


def _known(p: str) -> bool:
    return os.path.exists(registry_path(p)) or \
        os.path.exists(os.path.join(default_state_dir(p), "journal", "data.mdb"))


def state_home() -> str:
    return os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")


def workspace_id(ws: str) -> str:
    try:  # CPython's own SHA-256: hashlib would load OpenSSL (some 4 ms of every reader and
        # hook that finds its state dir) to hash one path
        from _sha256 import sha256
    except ImportError:
        from hashlib import sha256
    h = sha256(ws.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    name = os.path.basename(ws) or "root"
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) + 13 > ID_MAX:
        # a legal name of up to 255 bytes made a registry entry (id.json.tmp) past a file
        # name's limit, and the workspace could not be recorded (found by a bug hunt); the
        # hash of the whole path keeps the id its own, and an id that fitted is as it was
        name = raw[:ID_MAX - 13].decode("utf-8", "ignore")
    return f"{name}-{h}"


# the longest workspace id kept whole: the registry's temp file, id + ".json.tmp", is a name
ID_MAX = 255 - len(".json.tmp")


def default_state_dir(ws: str) -> str:
    # a name that is not UTF-8 (café in Latin-1) gave a state dir LMDB cannot open ("not a
    # UTF-8 path": found by a bug hunt): there its undecodable bytes become "_" (the hash
    # tells such names apart).  The registry keeps workspace_id as it was: its entries of
    # such workspaces (recorded with --state-dir) must still be found
    name = workspace_id(ws).encode("utf-8", "surrogateescape")
    return os.path.join(state_home(), "overlayrec",
                        name.decode("utf-8", "replace").replace(chr(0xFFFD), "_"))


def registry_path(ws: str) -> str:
    """Points at a workspace's state dir, wherever --state-dir put it."""
    return os.path.join(state_home(), "overlayrec", "mounts", workspace_id(ws) + ".json")


def check_state_dir(ws: str, state_dir: str) -> str:
    """The state dir a mount will use, resolved: outside the workspace, the user's alone, and
    so is the registry that will point at it (StateError otherwise)."""
    sd = os.path.realpath(os.path.abspath(state_dir))
    # by identity, not by path: a bind mount of the workspace (another name of the same
    # directory) put the journal in the workspace, where the session could delete it
    if sd == ws or sd.startswith(ws.rstrip("/") + "/") or is_beneath(sd, ws):
        raise StateError(f"state dir {state_dir} is inside the workspace; put it outside")
    if ws.startswith(sd.rstrip("/") + "/") or (os.path.isdir(sd) and is_beneath(ws, sd)):
        # its own entries (git, content, journal) would be the workspace's: a reader's bare
        # repository was made in the user's directory, and its mode taken to 0700
        raise StateError(f"state dir {state_dir} holds the workspace; put it beside it")
    registry = os.path.dirname(registry_path(ws))
    if is_beneath(registry, ws) or registry.startswith(ws.rstrip("/") + "/"):
        # the daemon writes its entry there once mounted, through its own mount, before it
        # serves: it hung, and the mount was left dead (a home directory as the workspace;
        # found by a bug hunt)
        raise StateError(f"the registry of mounts ({registry}, under XDG_STATE_HOME) is "
                         "inside the workspace; set XDG_STATE_HOME outside it")
    _refuse_anothers_record(ws, sd, state_dir)
    check_state_dir_private(sd)
    check_private(registry, "registry dir")
    return sd


def _within(path: str, top: str) -> bool:
    """By path alone: ``top`` may be a hung mount, which a stat would wait on for good."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def _refuse_anothers_record(ws: str, sd: str, given: str) -> None:
    """A state dir inside another recorded workspace, or a workspace holding the state dir of
    another one mounted now: the first daemon's journal is then written through the second's
    mount, which records it, and each waits on the other (a write in either hung, `umount`
    too; with one of them, every write of the other failed with EIO once the first was
    unmounted under it; found by a bug hunt).  StateError.  Paths are compared as the mount
    table and the registry name them: nothing here asks another mount anything."""
    entries = registered()
    for other in sorted(set(overlayrec_mounts()) | {w for w, _ in entries}):
        if other != ws and _within(sd, other):
            raise StateError(f"state dir {given} is inside the recorded workspace {other}: "
                             "its mount would record this record, and each wait on the "
                             "other; put it outside every recorded workspace")
    for other, other_sd in entries:
        if other != ws and _within(other_sd, ws) and fuse_mount_at(other):
            raise StateError(f"{ws} holds the state dir of the mounted workspace {other} "
                             f"({other_sd}): a mount here would cover that record; give "
                             f"{other} a state dir outside, or unmount it first")


def registered() -> list[tuple[str, str]]:
    """(workspace, state dir) of each entry in this user's registry of mounts."""
    import json
    d = os.path.join(state_home(), "overlayrec", "mounts")
    try:
        names = os.listdir(d)
    except OSError:
        return []
    out = []
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(d, name), "rb") as f:
                entry = json.loads(f.read().decode("utf-8", "surrogateescape"))
            ws, sd = entry["workspace"], entry["state_dir"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(ws, str) and isinstance(sd, str) and ws and sd:
            out.append((ws, os.path.abspath(sd)))  # (no realpath: it may cross a hung mount)
    return out


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def is_beneath(path: str, top: str) -> bool:
    """Is ``path`` (resolved; it may not exist yet) ``top`` or inside it, by identity: is
    ``top``'s (st_dev, st_ino) that of ``path`` or of one of its existing ancestors?  A bind
    mount names the same directory by another path, which a comparison of paths misses."""
    want = _identity(top)
    if want is None:
        return False
    p = os.path.realpath(os.path.abspath(path))
    while True:
        if _identity(p) == want:
            return True
        up = os.path.dirname(p)
        if up == p:
            return False
        p = up


def make_state_dir(sd: str) -> str:
    """Create a state dir ``check_state_dir`` accepted (or bring an existing one to 0700)."""
    return private_dir(sd)


def write_registry(ws: str, state_dir: str) -> None:
    p = registry_path(ws)
    d = os.path.dirname(p)
    check_private(d, "registry dir")
    private_dir(os.path.dirname(d))  # $XDG_STATE_HOME/overlayrec: ours, 0700
    private_dir(d)
    import json
    write_private(p, json.dumps({"workspace": ws, "state_dir": state_dir}).encode())


def find_state_dir(ws: str) -> str:
    """The workspace's state dir, as the registry names it (or the default); StateError when
    the registry or the state dir could have been changed by another user."""
    from . import wire  # not json: hooks come through here on every tool call
    p = registry_path(ws)
    check_private(p, "registry entry")
    sd = None
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        pass
    else:
        with open(fd, "rb") as f:
            raw = f.read()
        try:
            sd = wire.loads(raw.decode())["state_dir"]
        except (ValueError, KeyError, TypeError):
            pass
    if not isinstance(sd, str) or not sd:
        sd = default_state_dir(ws)
    check_state_dir_private(sd)
    return sd


def read_regular(path: str) -> bytes:
    """The bytes of the regular file at ``path``, not followed if a symlink; OSError for any
    other kind (a fifo planted in a state dir hung every reader; a link to /dev/zero filled
    memory; found by a bug hunt)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not _stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return f.read()


def daemon_info(state_dir: str) -> dict | None:
    from . import wire
    try:
        info = wire.loads(read_regular(StateDir(state_dir).daemon_json).decode())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def proc_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (/proc/<pid>/stat field 22): with
    the boot id, it tells this process from a later one given the same pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        return int(raw[raw.rfind(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def daemon_identity() -> dict:
    """What daemon.json records of the calling daemon so that ``verify_daemon`` knows it again."""
    pid = os.getpid()
    return {"pid": pid, "start_ticks": proc_start_ticks(pid), "boot_id": boot_id()}


def _is_overlayrec(argv: list[str]) -> bool:
    # python -m overlayrec.daemon ... | python -m overlayrec mount --foreground | .../bin/overlayrec
    return any(a in ("overlayrec", "overlayrec.daemon") or os.path.basename(a) == "overlayrec"
               for a in argv[:3])


def _holds_for_writing(pid: int, path: str) -> bool | None:
    """Does ``pid`` hold ``path`` open for writing?  None: its fds cannot be read."""
    try:
        fds = sorted(int(n) for n in os.listdir(f"/proc/{pid}/fd"))
    except PermissionError:
        return None
    except (OSError, ValueError):
        return False
    for fd in fds:  # LMDB opens its files early: low fds, found before the inode table's
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != path:
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = next(int(l.split()[1], 8) for l in f if l.startswith("flags:"))
        except (OSError, StopIteration, ValueError, IndexError):
            continue
        if flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR):
            return True
    return False


def verify_daemon(info: dict | None, state_dir: str) -> tuple[int | None, str | None]:
    """Is the pid daemon.json names (``info``) the running daemon of ``state_dir``?  (pid, None)
    when it is: it started when daemon.json says (start ticks and boot id: not a later process
    given the same pid), its command line is overlayrec's, and it holds this state dir's
    journal open for writing (it is the daemon of this workspace).  (None, None) when no daemon
    is recorded or it is gone; (None, why) when a live process must not be signalled."""
    if not info:
        return None, None
    pid = info.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return None, f"daemon.json names no valid pid ({pid!r}): signalling nothing"
    if not pid_alive(pid):
        return None, None

    def refuse(why: str) -> tuple[None, str]:
        return None, f"daemon.json names pid {pid}, but {why}: not signalling it"
    if info.get("start_ticks") is None:
        return refuse("it records no start time to check it by")
    if proc_start_ticks(pid) != info["start_ticks"] or info.get("boot_id") != boot_id():
        return refuse("that process started at another time (the pid was reused, or the file "
                      "was rewritten)")
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        argv = []
    if not _is_overlayrec(argv):
        return refuse(f"it is not overlayrec ({' '.join(argv)[:60] or '?'})")
    holds = _holds_for_writing(pid, os.path.join(os.path.realpath(StateDir(state_dir).journal),
                                                 "data.mdb"))
    if holds is None:
        return refuse("its open files cannot be read to check it")
    if not holds:
        return refuse(f"it is not the daemon of {state_dir} (it does not hold its journal)")
    return pid, None


def pid_alive(pid: int) -> bool:
    """True while the process runs (a zombie waiting to be reaped does not count)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return False
    return raw[raw.rfind(b")") + 2:][:1] not in (b"Z", b"X")


def _unescape(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as octal
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def fuse_mount_at(path: str, any_fuse: bool = False) -> dict | None:
    """The overlayrec mount whose mountpoint is exactly ``path`` (the topmost one), or None:
    ``fstype``, ``source``, ``uid``, the user who mounted it (None when not said), and ``id``,
    the mount's id (a mount made anew at the same path has another).  ``any_fuse``: any FUSE
    mount there (one not ours was taken for ours: `status` called a bindfs "mounted" and
    `umount` detached it; found by a bug hunt)."""
    found = None
    try:
        with open("/proc/self/mountinfo", errors="surrogateescape") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                lf, rf = left.split(), right.split()
                if len(lf) < 5 or len(rf) < 2:
                    continue
                if _unescape(lf[4]) == path and (
                        rf[0] == f"fuse.{FSNAME}" or any_fuse and rf[0].startswith("fuse")):
                    opts = dict(o.partition("=")[::2] for o in
                                (rf[2] if len(rf) > 2 else "").split(","))
                    owner = opts.get("user_id", "")
                    found = {"fstype": rf[0], "source": _unescape(rf[1]),
                             "uid": int(owner) if owner.isdigit() else None, "id": int(lf[0])}
    except OSError:
        return None
    return found


def mount_by_source(source: str) -> dict | None:
    """The overlayrec mount whose source is ``source`` (a daemon's own, daemon.prepare), as
    fuse_mount_at gives one, wherever it is now; None: not mounted."""
    try:
        with open("/proc/self/mountinfo", errors="surrogateescape") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                lf, rf = left.split(), right.split()
                if len(lf) >= 5 and len(rf) >= 2 and rf[0] == "fuse." + FSNAME and \
                        _unescape(rf[1]) == source:
                    opts = dict(o.partition("=")[::2] for o in
                                (rf[2] if len(rf) > 2 else "").split(","))
                    owner = opts.get("user_id", "")
                    return {"fstype": rf[0], "source": source,
                            "uid": int(owner) if owner.isdigit() else None, "id": int(lf[0])}
    except OSError:
        pass
    return None


def mount_point_of(mount: dict) -> str | None:
    """Where the overlayrec mount ``mount`` (fuse_mount_at's, taken when it was made) is now:
    its mountpoint in /proc/self/mountinfo, found by its id and its source (the daemon makes
    each its own), or None: no such mount.  A directory above a mounted workspace renamed moves
    the mount with it; the path it was made at names nothing any more.  The id alone is given
    to the next mount made once this one has gone (taken for this one, moved, and lifted)."""
    mount_id, source = mount["id"], mount.get("source")
    try:
        with open("/proc/self/mountinfo", errors="surrogateescape") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                lf, rf = left.split(), right.split()
                if len(lf) >= 5 and len(rf) >= 2 and lf[0] == str(mount_id) and \
                        rf[0] == "fuse." + FSNAME and _unescape(rf[1]) == source:
                    return _unescape(lf[4])
    except OSError:
        pass
    return None


def others_mount(path: str) -> int | None:
    """The uid of the user whose overlayrec daemon has ``path`` mounted, when that is another
    user (the mount table's ``user_id=``): that daemon records it, in that user's state dir,
    which this user's commands do not find; None otherwise."""
    mount = fuse_mount_at(path)
    if mount is None or mount["fstype"] != "fuse." + FSNAME:
        return None
    uid = mount["uid"]
    return uid if uid is not None and uid != os.geteuid() else None


def others_attic(ws: str) -> int | None:
    """The uid of another user whose attic (``.overlayrec-attic``, a directory the recorder
    makes in the workspace) is in ``ws``: a workspace that user records, unmounted now, whose
    record is in their state dir; None otherwise (no attic, or this user's)."""
    try:
        st = os.lstat(os.path.join(ws, ".overlayrec-attic"))
    except OSError:
        return None
    import stat as _s
    return st.st_uid if _s.S_ISDIR(st.st_mode) and st.st_uid != os.geteuid() else None


def recorded_by_another(ws: str, uid: int, mounted: bool = True) -> str:
    """What readers say of a workspace another user's daemon records (``others_mount``), or
    recorded and left unmounted (``others_attic``)."""
    if not mounted:
        return (f"workspace {ws} is recorded by another user (uid {uid}, whose "
                ".overlayrec-attic is there), not mounted now: its record is in that user's "
                "state dir, not yours to read")
    return (f"workspace {ws} is mounted and recorded by another user's daemon (uid {uid}): "
            "its record is in that user's state dir, not yours to read")


def overlayrec_mounts() -> list[str]:
    """Mountpoints of every overlayrec mount, from the mount table."""
    out = []
    try:
        with open("/proc/self/mountinfo", errors="surrogateescape") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                lf, rf = left.split(), right.split()
                if len(lf) >= 5 and rf and rf[0] == "fuse." + FSNAME:
                    out.append(_unescape(lf[4]))
    except OSError:
        pass
    return out


def overlayrec_mount_containing(path: str) -> str | None:
    best = None
    for mp in overlayrec_mounts():
        if path == mp or path.startswith(mp.rstrip("/") + "/"):
            if best is None or len(mp) > len(best):
                best = mp
    return best


def overlayrec_mounts_beneath(path: str) -> list[str]:
    """The overlayrec mounts strictly beneath ``path``."""
    top = path.rstrip("/") + "/"
    return sorted(mp for mp in overlayrec_mounts() if mp.startswith(top))


def mounts_beneath(path: str) -> list[str]:
    """Mountpoints of any kind strictly beneath ``path`` (a tmpfs, a bind mount made inside a
    mounted workspace), from the mount table: a lazy unmount of ``path`` takes them along."""
    top = path.rstrip("/") + "/"
    out = set()
    try:
        with open("/proc/self/mountinfo", errors="surrogateescape") as f:
            for line in f:
                lf = line.split(" - ")[0].split()
                if len(lf) >= 5 and _unescape(lf[4]).startswith(top):
                    out.add(_unescape(lf[4]))
    except OSError:
        pass
    return sorted(out)


def beneath_refusal(ws: str) -> str | None:
    """Why ``ws`` is not unmounted now (one line, with what to do), or None: mounts beneath
    it would be detached with it, and a tmpfs's data lost, where natively they stay."""
    found = mounts_beneath(ws)
    if not found:
        return None
    named = ", ".join(found[:3]) + (" ..." if len(found) > 3 else "")
    return (f"{ws} holds {len(found)} mount(s) beneath it ({named}), which its unmount would "
            f"take along: unmount them first (umount {found[-1]}), then overlayrec umount {ws}")


def mount_id_at(path: str) -> int | None:
    found = None
    try:
        with open("/proc/self/mountinfo", errors="surrogateescape") as f:
            for line in f:
                lf = line.split(" - ")[0].split()
                if len(lf) >= 5 and _unescape(lf[4]) == path:
                    found = int(lf[0])
    except OSError:
        return None
    return found


def _mount_of(link: str) -> int | None:
    """The mount id of what a /proc magic link (a cwd) leads to, without asking its filesystem
    anything: an O_PATH open follows the link to its dentry, and a FUSE daemon, hung or not,
    gets no request (a stat would send one)."""
    try:
        fd = os.open(link, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return None


def underlay_holders(ws: str, exclude: set[int]) -> list[dict]:
    """Processes whose working directory or open files inside ``ws`` were taken before the
    mount: they see the underlay and bypass recording."""
    return _holders(ws, exclude, beneath=True)


def _mount_device(mnt: int) -> str | None:
    """The device (``major:minor``, as /proc/PID/maps writes it, in hex) of mount ``mnt``."""
    try:
        with open("/proc/self/mountinfo", errors="surrogateescape") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[0] == str(mnt):
                    major, minor = (int(x) for x in fields[2].split(":"))
                    return f"{major:02x}:{minor:02x}"
    except (OSError, ValueError):
        return None
    return None


def _mapped_from(pid: int, dev: str) -> str | None:
    """A path of a file ``pid`` has mapped from device ``dev``, if any."""
    try:
        with open(f"/proc/{pid}/maps", errors="surrogateescape") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[3] == dev:
                    return fields[5].rstrip("\n")
    except OSError:
        return None
    return None


def mount_users(ws: str, exclude: set[int]) -> list[dict]:
    """Processes whose working directory or open files are on the mount at ``ws``: an unmount
    now would leave them with "Transport endpoint is not connected" for each (a server an
    agent left running in the workspace)."""
    return _holders(ws, exclude, beneath=False)


def _holders(ws: str, exclude: set[int], beneath: bool) -> list[dict]:
    """underlay_holders (``beneath``) or mount_users: each process as pid, command and what it
    holds there."""
    mnt = mount_id_at(ws)
    if mnt is None:
        return []
    inside = lambda p: p == ws or p.startswith(ws.rstrip("/") + "/")
    # a file mapped into memory from the mount (its fd closed since): its maps line carries
    # the mount's device, and its pages fault with SIGBUS once the mount is gone
    dev = None if beneath else _mount_device(mnt)
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in exclude:
            continue
        pid = int(name)
        what = []
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            if inside(cwd) and (_mount_of(f"/proc/{pid}/cwd") != mnt) == beneath:
                what.append(f"cwd {cwd}")
        except OSError:
            pass
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if not inside(target):
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    info = dict(l.split(":", 1) for l in f.read().splitlines() if ":" in l)
                if mnt is not None and (int(info.get("mnt_id", "-1")) != mnt) == beneath:
                    what.append(f"fd {fd} {target}")
            except (OSError, ValueError):
                continue
        if dev is not None and not what:
            mapped = _mapped_from(pid, dev)
            if mapped:
                what.append(f"maps {mapped}")
        if what:
            try:
                with open(f"/proc/{pid}/comm", errors="replace") as f:
                    comm = f.read().strip()
            except OSError:
                comm = "?"
            out.append({"pid": pid, "command": comm, "holds": what})
    return out


def write_holders(ws: str, files: dict[int, str], exclude: set[int]) -> dict[int, list[int]]:
    """The processes holding a descriptor open for writing on a file of the mount at ``ws``
    (``files``: its inode number there, and its workspace path), by inode number: the daemon
    knows its open handles, not which processes hold them (a descriptor is inherited by a
    fork, and its opener may be gone).  Read from /proc (the fd's mount id, inode number and
    flags in its fdinfo; its path where the kernel gives no inode number), asking the mount
    nothing, so the daemon may look on its own thread."""
    mnt = mount_id_at(ws)
    if mnt is None or not files:
        return {}
    root = ws.rstrip("/") + "/"
    by_path = {root + p: ino for ino, p in files.items()}
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in exclude:
            continue
        pid = int(name)
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        held = set()
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if not target.startswith(root):
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    info = dict(l.split(":", 1) for l in f.read().splitlines() if ":" in l)
                if int(info.get("mnt_id", "-1")) != mnt or \
                        int(info.get("flags", "0"), 8) & os.O_ACCMODE == os.O_RDONLY:
                    continue
                ino = int(info["ino"]) if "ino" in info else by_path.get(target)
                if ino in files:
                    held.add(ino)
            except (OSError, ValueError):
                continue
        for ino in held:
            out.setdefault(ino, []).append(pid)
    return out


def mount_answers(path: str, timeout: float = 3.0) -> bool | None:
    """Does the daemon answer a statfs within ``timeout``?  None: it answers with an error."""
    import threading
    out: list = []

    def probe():
        try:
            os.statvfs(path)
            out.append(True)
        except OSError:
            out.append(None)
    t = threading.Thread(target=probe, daemon=True)  # a hung request stays behind, harmlessly
    t.start()
    t.join(timeout)
    return out[0] if out else False


def is_dead_mount(path: str) -> bool:
    # statfs always reaches the daemon; stat may be answered from the kernel's attribute cache
    try:
        os.statvfs(path)
        return False
    except OSError as e:
        return e.errno in DEAD_ERRNOS


def hold_revert_lock(sd: str) -> int | None:
    """An fd holding the state dir's revert lock (StateDir.revert_lock): a revert or unrevert
    holds it from its plan to its end, a gc for its run, so that none of them runs beside
    another.  None when it is held elsewhere."""
    import fcntl
    private_dir(StateDir(sd).reverts)
    fd = os.open(StateDir(sd).revert_lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def saved_reverts(sd: str, damaged_ok: bool = False) -> list[dict]:
    """Every saved revert record of the state dir ``sd``, oldest first (``reverts`` keeps them;
    retention reads them too, from below that layer).  A plan steers writes: the directory and
    each file must be the user's alone.  One that cannot be read (cut short, not a record) is
    refused (StateError), unless ``damaged_ok`` (a look: ``status``, ``check``, which name it
    through damaged_reverts): passed over, an interrupted revert it held could be neither
    continued nor rolled back, and a gc dropped what its unrevert needed (found by a hunt)."""
    out, bad = _read_reverts(sd)
    if bad and not damaged_ok:
        name, why = bad[0]
        raise StateError(f"revert plan {os.path.join(StateDir(sd).reverts, name)} cannot be "
                         f"read ({why}): a revert or unrevert it holds may be half done; "
                         "restore the file, or move it out of that directory to go on without "
                         "it")
    return out


def damaged_reverts(sd: str) -> list[tuple[str, str]]:
    """The revert plans of ``sd`` that cannot be read: (file name, why)."""
    return _read_reverts(sd)[1]


def _read_reverts(sd: str) -> tuple[list[dict], list[tuple[str, str]]]:
    out: list[dict] = []
    bad: list[tuple[str, str]] = []
    d = StateDir(sd).reverts
    if not os.path.isdir(d):
        return out, bad
    closed = check_private(d, "revert plans")
    for name in sorted(os.listdir(d)):
        if name.endswith(".json"):
            check_entry(os.path.join(d, name), closed, "revert plans", own=True)
            try:
                rec = json.loads(read_regular(os.path.join(d, name)))
            except ValueError as e:
                bad.append((name, f"not JSON: {e}"))
                continue
            except OSError as e:
                bad.append((name, e.strerror or str(e)))
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get("id"), str) or \
                    not isinstance(rec.get("status"), str):
                bad.append((name, "not a revert record"))
                continue
            out.append(rec)
    out.sort(key=lambda r: r.get("created", 0) if isinstance(r.get("created"), (int, float))
             else 0)
    return out, bad


def save_revert(sd: str, rec: dict) -> None:
    """Write revert record ``rec`` (``reverts`` saves them; retention marks one let go)."""
    private_dir(StateDir(sd).reverts)
    write_private(StateDir(sd).revert_plan(rec["id"]), json.dumps(rec).encode(), durable=True)


def revert_undoable(r: dict, every: list[dict]) -> bool:
    """Can an unrevert still undo revert record ``r`` (``every``: all of them, saved_reverts)?
    By its id whenever this holds; by default also, unless ``r`` is itself a finished unrevert
    (``reverts.to_undo``).  Retention keeps what such a revert reaches into.  One that changed
    nothing is not: an unrevert by default passed it by (``nothing to revert``) and never
    reached the revert below it."""
    if r.get("let_go"):
        return False  # a gc dropped what its unrevert would read (retention, let_go_reverts)
    if r.get("status") == "done" and not r.get("done"):
        return False  # it changed nothing (every path a conflict, left alone by --force)
    return not r.get("unreverted_by") and not r.get("unreverts_done") \
        and r.get("status") in ("done", "running") \
        and not any(o.get("unreverts") == r["id"] and o.get("status") == "done" for o in every)


_CODE: str | None = None


def code_ident() -> str:
    """What names the code of this process, for what readers keep in the state dir (answers,
    listing rows): a hash of the name, size and mtime of every module of the package.  An
    upgrade or an edit changes it, so an answer the code before made is made again, never
    given as this code's (a fixed reader would otherwise repeat its old answer until the
    record changed)."""
    global _CODE
    if _CODE is None:
        _CODE = package_ident(os.path.dirname(os.path.abspath(__file__)))
    return _CODE


def package_ident(root: str) -> str:
    """code_ident of the package at ``root``: its .py and .so files, bytecode caches aside."""
    import xxhash
    h = xxhash.xxh64()
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for name in sorted(files):
            if name.endswith((".py", ".so")):
                path = os.path.join(d, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                h.update(f"{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}\n"
                         .encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def tree_bytes(path: str) -> tuple[int, int]:
    """(bytes on disk, files) of everything at and beneath ``path`` (not following links);
    (0, 0) when it is not there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0, 0
    total, files = st.st_blocks * 512, 0
    if not _stat.S_ISDIR(st.st_mode):
        return total, 1
    stack = [path]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except (FileNotFoundError, NotADirectoryError):
            continue  # gone meanwhile (a temp dir of a running diff)
        with it:
            for e in it:
                try:
                    est = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                total += est.st_blocks * 512
                if _stat.S_ISDIR(est.st_mode):
                    stack.append(e.path)
                else:
                    files += 1
    return total, files
