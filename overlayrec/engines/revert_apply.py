"""Putting a revert's plan on disk, step by step.

Each step makes its path hold its target, whatever it holds now (``apply_step``): a step run
again does nothing more, so an interrupted revert is finished by running its steps again.
Paths are reached from the workspace root one component at a time without following a
symlink; content goes to a temp file beside the path and is renamed over it.  Also here: the
steps' order (``order``), the check that another writer changed a path since the plan was
made (``changed_since``, ``recheck``), and the temp files an interrupted revert left.
"""
from __future__ import annotations
import errno
import heapq
import os
import re
import signal
import stat

from ..underlay import O_PATH, RENAME_NOREPLACE, Escape, renameat2, resolve_beneath
from ..views import file_size_limit, shown
from .large import same_as_fd, write_to
from .states import State, Tree
from .revert_steps import (FAILED, KEPT, KEPT_CHANGED, LINKED, PARTLY, DirMode, Opening, Plan,
                           Step, at_or_under, beneath_any, failed, link_key, linked,
                           refreshed, up)


NAME_MAX = 255


def bytes_written(plan: Plan, small: int) -> int:
    """About how much room on the workspace's filesystem carrying out ``plan`` takes at its
    peak: each file it writes anew, in whole blocks, once for a hard-link group (the group's
    other names are linked).  A file it replaces frees its room only when it is of at most
    ``small`` bytes (Recorder.SMALL_PREIMAGE: the mount copies such a pre-image into the state
    dir at once); a larger one the mount keeps in the attic, so that unrevert can put it back."""
    def blocks(n: int) -> int:
        return -(-n // 4096) * 4096
    running = peak = 0
    groups: set = set()
    for s in plan.steps:
        t, was = s.target, s.expected
        if s.conflict or t.kind != "file" or not t.data:
            continue
        if was.kind == "file" and was.data == t.data:
            continue  # its mode and owner, set in place
        if link_key(t):
            if link_key(t) in groups or link_key(t) in plan.partners:
                continue
            groups.add(link_key(t))
        running += blocks(len(t.data))
        peak = max(peak, running)
        if was.kind == "file" and was.nlink < 2 and len(was.data) <= small:
            running -= blocks(len(was.data))
    return peak


def temp_name(name: str, tag: str) -> str:
    """``.{name}.{tag}``, with ``name`` cut (on a character boundary) so that the whole fits in
    NAME_MAX *bytes*: a long UTF-8 name still gets a temporary name beside it."""
    tail = f".{tag}"
    room = NAME_MAX - 1 - len(os.fsencode(tail))
    while len(os.fsencode(name)) > room:
        name = name[:-1]
    return f".{name}{tail}"


def revert_temp(path: str, tag: str, secret=None) -> str:
    """The name a step's content is written under beside ``path`` before it is renamed over:
    ``temp_name``, or, where ``secret`` (a path's predicate: the record's secret patterns)
    takes that name for a secret path and not ``path`` itself, the name without ``path``'s
    (``.{tag}``).  The recorder withholds what is written under a secret name, and a
    rename carries that to the name it lands on for the rest of the record: `envbuild.py`,
    reverted through `.envbuild.py...`, which `.env*` matches, had its whole history shown
    as a placeholder and its unrevert refused (found by a hunt on pip's source).  (A pattern
    of the user's that matches the plain name too, `.*`, leaves it withheld there as well.)"""
    parent, _, name = path.rpartition("/")
    tmp = temp_name(name, tag)
    if secret is not None and secret(f"{parent}/{tmp}" if parent else tmp) and \
            not secret(path):
        tmp = f".{tag}"
    return tmp


_TEMP = re.compile(r"\.overlayrec-revert-(\d+)\Z")
# the signals a revert takes for an interruption (cli: Ctrl-C, SIGTERM, SIGHUP)
_STOPS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def clear_stale_temps(root_fd: int, paths: list[str], pids=None) -> list[str]:
    """Remove the temporary files (``temp_name``, tagged with the reverting process's pid) a
    revert killed half way left beside these paths; those removed.  Reverts go one at a time
    (``reverts.one_at_a_time``), so another pid's is no live one's: `revert --continue`
    left them in the workspace for good.  ``pids``: the processes that carried the revert
    out (its record's), whose temporary files alone go: a file of the user's that happened to
    have such a name was removed too (found by a bug hunt); None (a record from before they
    were kept): any pid's."""
    by_dir: dict[str, set[str]] = {}
    for p in paths:
        parent, _, name = p.rpartition("/")
        if name:
            by_dir.setdefault(parent, set()).add(name)
    removed = []
    for parent, names in by_dir.items():
        try:
            dfd = resolve_beneath(root_fd, parent, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            for entry in os.listdir(dfd):
                m = _TEMP.search(entry)
                if m is None or int(m.group(1)) == os.getpid() or \
                        pids is not None and int(m.group(1)) not in pids:
                    continue
                tag = f"overlayrec-revert-{m.group(1)}"
                if entry != f".{tag}" and \
                        not any(temp_name(n, tag) == entry for n in names):
                    continue
                try:
                    if not stat.S_ISDIR(os.stat(entry, dir_fd=dfd,
                                                follow_symlinks=False).st_mode):
                        os.unlink(entry, dir_fd=dfd)
                        removed.append(f"{parent}/{entry}" if parent else entry)
                except OSError:
                    pass
        finally:
            os.close(dfd)
    return removed


def _parent(root_fd: int, rel: str, create: bool) -> tuple[int, str]:
    """An O_PATH fd of ``rel``'s directory and its name there, reached from ``root_fd`` by
    ``resolve_beneath`` (no symlink followed, nothing climbs out); with ``create``, the
    directories missing on the way are made.  Raises ``Escape`` when a symlink or a file is
    on the way, its own parent included, or ``rel`` is not a name beneath the root."""
    if rel == "":  # the workspace root itself (a `chmod 700 .`): its mode and owner
        return os.open(".", O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root_fd), "."
    parent, _, name = rel.rpartition("/")
    if name in ("", ".", "..") or rel.startswith("/"):
        raise Escape(errno.EXDEV, "leaves the workspace", rel)
    want = O_PATH | os.O_DIRECTORY
    try:
        return resolve_beneath(root_fd, parent, want), name
    except FileNotFoundError:
        if not create:
            raise
    fd = resolve_beneath(root_fd, "", want)
    try:
        for part in parent.split("/"):
            if part in ("", "."):
                continue
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass  # a directory, or whatever it is: resolve_beneath refuses a non-directory
            nfd = resolve_beneath(fd, part, want)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd, name


def _remove(dfd: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        os.rmdir(name, dir_fd=dfd)
    else:
        os.unlink(name, dir_fd=dfd)


def make_node(dfd: int, name: str, t: State) -> None:
    """Make a fifo, socket or device node ``name`` in ``dfd`` (mode 0600 until set_meta).
    Raises OSError when it cannot be made (a device node without the privilege, say)."""
    if t.kind == "fifo":
        os.mkfifo(name, 0o600, dir_fd=dfd)
    elif t.kind == "socket":
        try:
            os.mknod(name, stat.S_IFSOCK | 0o600, dir_fd=dfd)
        except OSError as e:
            # a socket node is also what binding a unix socket leaves behind
            path = f"/proc/self/fd/{dfd}/{name}"
            if len(os.fsencode(path)) > 107:
                raise
            import socket
            with socket.socket(socket.AF_UNIX) as s:
                try:
                    s.bind(path)
                except OSError:
                    raise e from None
            os.chmod(path, 0o600)
    elif t.kind == "device":
        os.mknod(name, (stat.S_IFBLK if t.block else stat.S_IFCHR) | 0o600, t.rdev, dir_fd=dfd)
    else:
        raise ValueError(f"not a node kind: {t.kind}")


def set_meta(dfd: int, name: str, t: State, mode: int | None = None,
             carried: list[str] | None = None) -> str | None:
    """Give ``name`` (never followed) the owner the record knows (where it differs from what
    it has) and then its mode (``mode`` or ``t.mode``; not for a symlink): chown first, since
    it clears set-id bits.  Returns what could not be done (an owner the caller may not give,
    and ``carried``: the attributes ``_carry_xattrs`` could not keep), or None."""
    from ..underlay import chmod_fd, chown_fd
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        problems = list(carried or ())
        uid = -1 if t.uid is None or t.uid == st.st_uid else t.uid
        gid = -1 if t.gid is None or t.gid == st.st_gid else t.gid
        if uid != -1 or gid != -1:
            try:
                chown_fd(fd, uid, gid)
            except PermissionError as e:
                problems.insert(0, f"owner {t.uid}:{t.gid} not set ({os.strerror(e.errno)})")
        if not stat.S_ISLNK(st.st_mode):
            want = stat.S_IMODE(t.mode if mode is None else mode)
            if stat.S_IMODE(os.fstat(fd).st_mode) != want:  # another's: only its owner may
                chmod_fd(fd, want)
            # the kernel drops a set-group-ID bit its caller's groups do not allow (a directory
            # of another group, chmod by its owner): a revert that said it put 2775 back left
            # 0775, and new files there took the reverter's group
            lost = want & (stat.S_ISUID | stat.S_ISGID) & ~stat.S_IMODE(os.fstat(fd).st_mode)
            if lost:
                problems.append(f"mode {want:04o} not set: the system dropped its set-"
                                f"{'group' if lost & stat.S_ISGID else 'user'}-ID bit (this "
                                "user is not of its group)")
        return "; ".join(problems) or None
    finally:
        os.close(fd)


def _carry_xattrs(dfd: int, name: str, tmp: str, t: State) -> list[str]:
    """The extended attributes of the live file ``name`` (an access ACL, a file capability,
    ``user.*``) put on ``tmp``, the file about to replace it.  Attributes are no part of a
    recorded state (docs/design.md), so a file put back keeps those its name holds: without
    this, reverting a call that only chmodded a file would strip what the user had set on it.
    Set before the mode (``set_meta`` after it), as ``cp -a`` does: an ACL's bits then follow
    the mode the record knows.  Returns what could not be kept, in words."""
    from ..underlay import list_xattrs, proc_path
    if t.kind != "file":
        return []
    try:
        src = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return []
    try:
        if not stat.S_ISREG(os.fstat(src).st_mode):
            return []
        attrs = list_xattrs(src, False)
    finally:
        os.close(src)
    if not attrs:
        return []
    lost = []
    dst = os.open(tmp, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        for key, value in sorted(attrs.items()):
            try:
                os.setxattr(proc_path(dst), key, value)
            except OSError as e:
                lost.append(f"attribute {key} not kept ({os.strerror(e.errno)})")
    finally:
        os.close(dst)
    return lost


def _blocks(mode: int) -> bool:
    """Would a directory of this mode stop its owner from filling it?"""
    return stat.S_IMODE(mode) & 0o700 != 0o700


def apply_step(root_fd: int, step: Step, made: dict | None = None,
               seen: os.stat_result | None | bool = False, secret=None) -> str:
    """Make ``step.path`` hold ``step.target``; returns what was done (``failed(...)`` tells
    a path it could not make whole).  ``made``, shared by the steps of one plan, maps the
    inode of a target to the paths made for it, one (path, inode made, target) for each group
    of that inode (see ``linked``): the other paths of a group are linked to its path, not
    copied.  ``seen``: the lstat the caller found the path with (None: nothing there; False:
    not looked at); a path that no longer matches it when the new content is ready to go in
    (saved by another writer while a large file was written beside it) is kept
    (``KEPT_CHANGED``).  ``secret``: the record's secret paths (``revert_temp``).  Raises
    ``Escape`` (naming ``step.path``) when the path cannot be
    reached without following a symlink."""
    t = step.target
    try:
        dfd, name = _parent(root_fd, step.path, create=t.present)
    except FileNotFoundError:
        return "nothing (parent gone)"
    except Escape as e:
        # a symlink (or a file) put on the way since the plan was made (`--continue` carries
        # out a saved plan): never followed; the revert stops there and stays pending
        raise Escape(e.errno, f"escape: {e.strerror}", step.path) from None
    try:
        return _apply_in(root_fd, dfd, name, step, made, seen, secret)
    except PermissionError as e:
        # the revert writes as its user, through the mount: a directory left read-only (a
        # call's chmod 555 the selection does not undo) stops it; it stays pending
        mode = stat.S_IMODE(os.fstat(dfd).st_mode)
        why = f"its directory has mode {mode:04o}; make it writable" if _blocks(mode) else \
            "make it writable"
        raise PermissionError(e.errno, f"cannot be written ({os.strerror(e.errno)}): {why}, "
                              "then `overlayrec revert --continue`, or `overlayrec unrevert`",
                              step.path) from None
    except OSError as e:
        if e.errno == errno.EFBIG:
            limit = file_size_limit() or "the largest file its filesystem holds"
            raise OSError(e.errno, f"cannot be written ({os.strerror(e.errno)}, past {limit}): "
                          "the revert is pending: raise the limit, then `overlayrec revert "
                          "--continue`, or `overlayrec unrevert`", step.path) from None
        if isinstance(e, Escape):
            raise
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            # said of the step's path (it named the last component only: "x: Directory not
            # empty"), with what is left to do: the revert is saved as running
            raise OSError(e.errno, f"{os.strerror(e.errno)}: the revert stopped here, pending: "
                          "`overlayrec revert --continue` once the path can be written, or "
                          "`overlayrec unrevert`", step.path) from None
        raise OSError(e.errno, f"cannot be written ({os.strerror(e.errno)}): free room on the "
                      "workspace's filesystem, then `overlayrec revert --continue`, or "
                      "`overlayrec unrevert`", step.path) from None
    finally:
        os.close(dfd)


def ways(steps: list[Step], results: list[str]) -> set[str]:
    """The directories on the way of the paths a carried-out plan put something in: each is
    a directory after the revert, whatever its own step said (``_parent`` makes it)."""
    out: set[str] = set()
    for s, r in zip(steps, results):
        if s.target.present and not failed(r):
            parts = s.path.split("/")
            out.update("/".join(parts[:k]) for k in range(1, len(parts)))
    return out


def unmet(live: Tree, step: Step, result: str, around: set[str] = frozenset()) -> str | None:
    """After a plan was carried out: why ``step.path`` does not hold ``step.target`` although
    its step did not fail (a process wrote it while the revert ran, or a defect of the plan's
    rules), read afresh from ``live``; None when it does, or when the target is not known
    exactly enough to compare (a guess, a secret's placeholder) or the path cannot be read
    here (a mode that denies its reader: set by the revert itself, as recorded), or a
    directory the revert kept, or made again ``around`` (``ways``) a path it put back.  The owner
    is not compared: a revert made by its user may not give a file away.  A name the step
    linked to its group's first name must still be one file with it."""
    t = step.target
    if failed(result) or not t.exact or t.withheld or isinstance(step, (DirMode, Opening)):
        return None
    now, st = live.state_stat(step.path)
    if step.path in live.unreadable:
        return None
    if t.same(now, owner=False) and result.startswith(LINKED) and st is not None:
        # one file with the group's first name, as put back: a copy in its place since would
        # not take the next write through either name
        first = result[len(LINKED):-1]
        other = live.state_stat(first)[1]
        if other is not None and (other.st_dev, other.st_ino) != (st.st_dev, st.st_ino):
            return f"is not one file with {shown(first)} (a hard link) as the revert put back"
        return None
    if t.same(now, owner=False) or t.kind == now.kind == "dir" or \
            (now.kind == "dir" and (result == KEPT or step.path in around)):
        return None  # a directory's mode is its DirMode step's
    if refreshed(step.path, t, now, live):
        return None  # git refreshed the index it put back (an editor's git panel polling)
    if now.kind != t.kind:
        return f"holds {_a(now.kind)} where the revert put back {_a(t.kind)}"
    if t.kind != "symlink" and now.mode != t.mode:
        return f"has mode {now.mode:04o} where the revert put back {t.mode:04o}"
    return "holds other content than the revert put back"


def _a(kind: str) -> str:
    return "nothing" if kind == "absent" else f"a {kind}"


def _apply_in(root_fd: int, dfd: int, name: str, step: Step, made: dict | None,
              seen: os.stat_result | None | bool = False, secret=None) -> str:
    """apply_step in ``step.path``'s directory ``dfd``, where it is ``name``."""
    t = step.target
    if isinstance(step, Opening):
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            return "nothing to open"
        problem = set_meta(dfd, name, State("dir", stat.S_IMODE(st.st_mode) | 0o700))
        return FAILED + problem if problem else "opened"
    if isinstance(step, DirMode):
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            return FAILED + "not a directory any more: mode not set"
        problem = set_meta(dfd, name, t)
        return FAILED + problem if problem else "dir mode"
    if step.moved_from is not None:
        done = _move_back(root_fd, dfd, name, step)
        if done is not None:
            if done.startswith(MOVED_BACK) and made is not None and link_key(t) and \
                    _holder(made, t) is None:
                # the group's inode itself is back: its other names are linked to it
                made.setdefault(link_key(t), []).append(
                    (step.path, os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ino, t))
            return done
        # the object is back; what the selection changed in it after the rename goes next
        seen = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        step = Step(step.path, t, step.expected, in_place=step.in_place)
    if not t.present:
        try:
            _remove(dfd, name)
        except OSError as e:
            if e.errno == errno.ENOTEMPTY:  # unrecorded files live in it; keep it
                return KEPT
            raise
        return "removed"
    if t.kind == "dir":
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                _remove(dfd, name)
                raise FileNotFoundError
        except FileNotFoundError:
            os.mkdir(name, 0o700, dir_fd=dfd)
        # a mode that would stop the directory being filled comes last (a DirMode step)
        problem = set_meta(dfd, name, t, t.mode | 0o700 if _blocks(t.mode) else t.mode)
        return FAILED + problem if problem else "dir"
    first = _holder(made, t)
    if t.kind == "file" and link_key(t) and t.nlink > 1 and step.in_place:
        if first is not None and first[1] == t.ino and _as_written(made, dfd, name, t):
            # the group's inode, written in place by an earlier step and unchanged since:
            # each of a 1,000-name file's steps wrote it again (1,000 alias events a write)
            return f"restored in place with {first[0]} (hard-link group)"
        # only a target that was itself linked then shares its inode: writing into an
        # inode linked since would change names the revert does not own
        done = _write_in_place(dfd, name, t)
        if done is not None:
            if first is None and made is not None:
                made.setdefault(link_key(t), []).append((step.path, t.ino, t))
                if not done.startswith(FAILED):
                    made[("written", t.ino)] = _written_mark(dfd, name)
            return done
    if first is None and t.kind == "file" and step.expected.kind == "file" and \
            step.expected.data == t.data:
        done = _meta_in_place(dfd, name, t)
        if done is not None:
            if made is not None and link_key(t):
                made.setdefault(link_key(t), []).append(
                    (step.path, os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ino, t))
            return done
    if first is None and t.kind == "file":
        done = _into_theirs(dfd, name, t, seen)
        if done is not None:
            return done
    tmp = revert_temp(step.path, f"overlayrec-revert-{os.getpid()}", secret)
    _remove(dfd, tmp)
    if first is not None and _link_to(root_fd, first, dfd, tmp):
        if not _as_seen(dfd, name, seen):
            _remove(dfd, tmp)
            return KEPT_CHANGED
        _replace(dfd, tmp, name)
        return f"{LINKED}{first[0]})"
    problem = None
    if t.kind == "symlink":
        os.symlink(os.fsdecode(t.data), tmp, dir_fd=dfd)
    elif t.kind == "file":
        # Ctrl-C held while the temp file is made: a signal that came as its create went
        # through the mount was raised once the open returned, before its descriptor was
        # held, which stayed open (the revert's own mount then waited 10 s on it at its
        # end) and left the temp file behind (found by a bug hunt).  Raised below instead.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                         os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except PermissionError:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            done = _overwrite(dfd, name, t)
            if done is None:
                raise
            return done
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            raise
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal held is raised here
            write_to(fd, t.data)
        except BaseException:
            os.close(fd)
            _remove(dfd, tmp)  # a full filesystem leaves no half-written temp file behind
            raise
        os.close(fd)
    elif t.kind in ("fifo", "socket", "device"):
        try:
            make_node(dfd, tmp, t)
        except OSError as e:
            return FAILED + f"cannot make a {t.kind} here ({os.strerror(e.errno)})"
    else:
        return FAILED + f"cannot make a {t.kind}"
    try:
        problem = set_meta(dfd, tmp, t, carried=_carry_xattrs(dfd, name, tmp, t))
    except BaseException:
        _remove(dfd, tmp)
        raise
    if not _as_seen(dfd, name, seen):
        _remove(dfd, tmp)
        return KEPT_CHANGED
    try:
        _replace(dfd, tmp, name)
    except PermissionError:
        try:
            done = _into_kept(dfd, name, t)
        finally:
            _remove(dfd, tmp)
        if done is None:
            raise
        return done
    except OSError:
        _remove(dfd, tmp)  # (not left beside the path for `--continue` to find)
        raise
    if made is not None and link_key(t) and first is None:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        made.setdefault(link_key(t), []).append((step.path, st.st_ino, t))
    return PARTLY + problem if problem else "restored"


MOVED_BACK = "renamed back from "  # ... the name it was at


def moved_in(made: dict, step: Step) -> None:
    """Once ``step``'s rename back is made: the paths of ``made`` (hard-link groups' names
    and partners, apply_step's) beneath the name it came from are called by the name it came
    back to (a name linked to one the rename back brought is linked to it there: a copy
    otherwise, its group cut)."""
    src = step.moved_from
    for key, held in made.items():
        if isinstance(held, list):
            made[key] = [(step.path + h[0][len(src):], *h[1:]) if at_or_under(h[0], src)
                         else h for h in held]


def _move_back(root_fd: int, dfd: int, name: str, step: Step) -> str | None:
    """Rename ``step.moved_from`` back to ``step.path`` (in ``dfd``, where it is ``name``),
    never over anything: the object the plan moves (``step.expected.ino``) is renamed back
    whole.  Returns what was done when that is all; None when the target is still to be
    written into what came back; KEPT_CHANGED when neither name holds that object (moved or
    replaced by another writer since).  Idempotent: an object already back is not moved."""
    ino = step.expected.ino
    try:
        here = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        here = None
    if here is None or here.st_ino != ino:
        if here is not None:
            if step.target.kind == "file" and step.target.data is not None and \
                    stat.S_IMODE(here.st_mode) == step.target.mode and \
                    _holds_content(dfd, name, step.target, lambda st: True):
                return "put back already"  # (by this revert, before it was interrupted)
            return KEPT_CHANGED
        try:
            sfd, sname = _parent(root_fd, step.moved_from, create=False)
        except FileNotFoundError:
            return KEPT_CHANGED
        except Escape as e:
            raise Escape(e.errno, f"escape: {e.strerror}", step.moved_from) from None
        try:
            if os.stat(sname, dir_fd=sfd, follow_symlinks=False).st_ino != ino:
                return KEPT_CHANGED
            renameat2(sfd, sname, dfd, name, RENAME_NOREPLACE)
        except (FileNotFoundError, FileExistsError):
            return KEPT_CHANGED
        finally:
            os.close(sfd)
    if step.target.same(step.expected):
        return f"{MOVED_BACK}{step.moved_from}"
    return None


def _as_seen(dfd: int, name: str, seen: os.stat_result | None | bool) -> bool:
    """Does ``name`` still hold what the step's caller looked at (``seen``: its lstat, None
    for nothing there; False: not looked at, so nothing to compare)?  Its inode, size, mtime
    and ctime: a save (in place or by a rename over it) moves one of them."""
    if seen is False:
        return True
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return seen is None
    return seen is not None and (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) == \
        (seen.st_ino, seen.st_size, seen.st_mtime_ns, seen.st_ctime_ns)


def _written_mark(dfd: int, name: str) -> tuple | None:
    """What a file written in place looks like just after (its ctime moves with any later
    change of content, mode, owner or links)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid, \
        st.st_gid


def _as_written(made: dict | None, dfd: int, name: str, t: State) -> bool:
    """Does ``name`` hold the inode an earlier step of its group wrote in place, as that
    step left it?"""
    mark = made.get(("written", t.ino)) if made is not None else None
    return mark is not None and _written_mark(dfd, name) == mark


def _holder(made: dict | None, t: State) -> tuple | None:
    """The path already made (or a partner) holding ``t``'s group: one inode of the record may
    stand for several groups, one for each state it was taken in (see ``linked``)."""
    if made is None or not link_key(t):
        return None
    return next((h for h in made.get(link_key(t), ()) if linked(t, h[2])), None)


def _holds_group_inode(root_fd: int, step: Step) -> bool:
    """Does the live path of ``step`` hold its target's inode, linked (a step apply_step may
    write in place)?"""
    t = step.target
    if not (t.kind == "file" and link_key(t) and t.nlink > 1 and step.in_place):
        return False
    st = _lstat(root_fd, step.path)
    return st is not None and _in_live_group(st, t)


def _lstat(root_fd: int, rel: str) -> os.stat_result | None:
    """What ``rel`` is now, reached without following a symlink (None: nothing, or not
    reachable)."""
    try:
        dfd, name = _parent(root_fd, rel, create=False)
    except OSError:
        return None
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(dfd)


def _in_live_group(st: os.stat_result, t: State) -> bool:
    """Does the live file ``st`` hold the target's own inode, linked still?"""
    return stat.S_ISREG(st.st_mode) and st.st_ino == t.ino and st.st_nlink > 1


def _write_in_place(dfd: int, name: str, t: State) -> str | None:
    """When the path still holds the target's own inode and that inode has other links (a
    hard-link group whose content was changed through one of its names), the content goes
    back into that inode, so every name of the group gets it back (a rename would leave the
    others behind).  Not atomic, unlike the rename.  None: not this case."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not _in_live_group(st, t):
        return None
    if _holds_content(dfd, name, t, lambda now: now.st_ino == st.st_ino):
        # its content as the target's (a chmod, a chown of the group): only its mode and
        # owner are set, its content and times kept (it was written again: a truncate and
        # a write, its mtime the revert's; found by a bug hunt)
        problem = set_meta(dfd, name, t)
        return FAILED + "restored in place, but " + problem if problem else \
            "restored in place (mode and owner, hard-link group)"
    # swapped meanwhile: written the usual way; a read-only file: replaced whole (the group
    # is not kept)
    return _write_into(dfd, name, t, lambda now: now.st_ino == t.ino, "hard-link group")


def _holds_content(dfd: int, name: str, t: State, fits) -> bool:
    """Does the live regular file ``name``, where ``fits(its fstat)``, hold the target's
    content?"""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dfd)
    except OSError:
        return False
    try:
        now = os.fstat(fd)
        return stat.S_ISREG(now.st_mode) and fits(now) and same_as_fd(fd, t.data, now.st_size)
    finally:
        os.close(fd)


def _overwrite(dfd: int, name: str, t: State) -> str | None:
    """A directory the revert may not write in (a call left it read-only, and the selection
    does not undo that): no temporary file can be made there, so the content goes into the
    live file, unlinked, as ``cat > file`` would put it (not atomic).  None: not this case
    (no such file, or one the revert may not write either)."""
    return _write_into(dfd, name, t, lambda now: now.st_nlink == 1,
                       "its directory is read-only")


def _into_kept(dfd: int, name: str, t: State) -> str | None:
    """A file the revert may write but not replace: another user's in a sticky directory
    (``/tmp``'s mode) refuses the rename over it (EPERM), as natively.  The content goes into
    the live file, unlinked, as the call's own write did (not atomic).  None: not this case
    (not a file to put back: a symlink's target text went into the file that replaced it)."""
    if t.kind != "file":
        return None
    return _write_into(dfd, name, t, lambda now: now.st_nlink == 1,
                       "another user's file in a sticky directory")


def _into_theirs(dfd: int, name: str, t: State,
                 seen: os.stat_result | None | bool) -> str | None:
    """A file of another owner that the reverting user (not root) may write: its content
    goes into the live file, as `cat old > f` would put it (not atomic), since a file replacing
    it would be the reverting user's, who may not give it away (it became theirs, a new inode,
    "restored but not whole: owner not set": found by a bug hunt in a shared setgid
    directory).  Only where the live file is of the owner and mode the target has (only its
    owner may set a mode), has no other name, and is as the caller ``seen`` it; None: not
    this case (written the usual way)."""
    me = os.geteuid()
    if me == 0:  # root gives the owner back to the file that replaces it
        return None
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid == me or st.st_nlink != 1 or \
            (t.uid is not None and t.uid != st.st_uid) or stat.S_IMODE(st.st_mode) != t.mode:
        return None
    if seen is not False and not _as_seen(dfd, name, seen):
        return None  # the caller's own checks say what happened to it
    return _write_into(dfd, name, t, lambda now: now.st_ino == st.st_ino and
                       now.st_nlink == 1, "another owner's file")


def _write_into(dfd: int, name: str, t: State, fits, why: str) -> str | None:
    """The target's content written into the live regular file ``name`` where ``fits(its
    fstat)``, then its mode and owner; None when it cannot be opened for writing or does not
    fit."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dfd)
    except OSError:
        return None
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or not fits(now):
            return None
        os.ftruncate(fd, 0)
        write_to(fd, t.data)
    finally:
        os.close(fd)
    problem = set_meta(dfd, name, t)
    return FAILED + "restored in place, but " + problem if problem else \
        f"restored in place ({why})"


def _meta_in_place(dfd: int, name: str, t: State) -> str | None:
    """A file whose content the selection did not change (a chmod, a chown): its mode and
    owner are set on the live file, whose content, inode, links and attributes stay, where it
    holds the target's content, unlinked.  No temporary file: a directory left read-only does
    not stop it.  None: not this case."""
    if not _holds_content(dfd, name, t, lambda now: now.st_nlink == 1):
        return None
    problem = set_meta(dfd, name, t)
    return FAILED + "restored in place, but " + problem if problem else \
        "restored in place (mode and owner)"


def _replace(dfd: int, tmp: str, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(name, dir_fd=dfd)
    except FileNotFoundError:
        pass
    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # atomic in its directory


def _link_to(root_fd: int, first: tuple, dfd: int, tmp: str) -> bool:
    """Hard-link the path ``first`` names (if it still holds the inode this plan made there)
    as ``tmp``; False when it cannot (then the path is written on its own)."""
    path, ino = first[0], first[1]
    try:
        sfd, sname = _parent(root_fd, path, create=False)
    except OSError:
        return False
    try:
        if os.stat(sname, dir_fd=sfd, follow_symlinks=False).st_ino != ino:
            return False
        os.link(sname, tmp, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
        return True
    except OSError:
        return False
    finally:
        os.close(sfd)


def order(steps: list[Step], root_fd: int | None = None) -> list[Step]:
    """The renames back (``moved_from``) come after the steps that touch neither of their
    names (_plain_order: what makes the directories they go into) and before those that do
    (what they free or bring is then planned: a file of a directory renamed back written, a
    directory they empty removed), and, among them, in the order they may be made; the modes
    of directories last, as ever."""
    moves = [s for s in steps if s.moved_from is not None]
    if not moves:
        return _plain_order(steps, root_fd)
    ends = {x for m in moves for x in (m.path, m.moved_from)}
    above = {u for m in moves for u in up(m.moved_from)}
    # a name of a hard-link group whose inode a rename brings back: linked to it once it is
    # back (made before, it held an inode of its own and stayed apart from the group)
    groups = {link_key(m.target) for m in moves if m.target.kind == "file"} - {0}

    def after(s: Step) -> bool:  # (a path above a name a rename back empties: it may be
        # removed or turned into a file once that name has gone)
        return beneath_any(s.path, ends) or s.path in above or \
            (s.target.kind == "file" and link_key(s.target) in groups)
    rest = [s for s in steps if s.moved_from is None]
    first = _plain_order([s for s in rest if not after(s)], root_fd)
    then = _plain_order([s for s in rest if after(s)], root_fd)
    late = [s for s in first + then if isinstance(s, DirMode)]
    return [s for s in first if not isinstance(s, DirMode)] + _moves_in_order(moves) + \
        [s for s in then if not isinstance(s, DirMode)] + late


def _moves_in_order(moves: list[Step]) -> list[Step]:
    """Each rename back after those it waits on: the one that frees its name (a chain,
    `mv a b; mv c a`), the one that brings back the directory it is in or comes from."""
    by_from, by_path = {}, {}
    for o in moves:
        by_from.setdefault(o.moved_from, []).append(o)
        by_path.setdefault(o.path, []).append(o)

    def waits_on(m: Step) -> set[int]:  # those whose name was m's, or a directory above
        # m's names that one of them brings back
        os_ = [o for u in up(m.path) for o in by_from.get(u, ())]
        os_ += [o for x in (m.path, m.moved_from) for u in up(x) if u != x
                for o in by_path.get(u, ())]
        return {id(o) for o in os_ if o is not m}
    waiting = {id(m): waits_on(m) for m in moves}
    index = {id(m): i for i, m in enumerate(moves)}
    waited_by: dict[int, list[int]] = {}
    for m in moves:
        for o in waiting[id(m)]:
            waited_by.setdefault(o, []).append(index[id(m)])
    ready = [i for i, m in enumerate(moves) if not waiting[id(m)]]
    heapq.heapify(ready)
    out, done, first = [], set(), 0
    while len(out) < len(moves):
        # the first in the plan's order that waits on nothing left; in a cycle (a chain
        # with no free name) the first left
        i = heapq.heappop(ready) if ready else None
        if i is None:
            while first in done:
                first += 1
            i = first
        if i in done:
            continue
        done.add(i)
        out.append(moves[i])
        for w in waited_by.get(id(moves[i]), ()):
            waiting[id(moves[w])].discard(id(moves[i]))
            if not waiting[id(moves[w])] and w not in done:
                heapq.heappush(ready, w)
    return out


def _plain_order(steps: list[Step], root_fd: int | None = None) -> list[Step]:
    """Removals first (deepest first: a directory the revert turns back into a file must be
    emptied before), then directories to create (shallow first), then files, then the modes
    of directories that would not let their owner fill them (deepest first).  With
    ``root_fd``, the files whose live path still holds their hard-link group's inode come
    first: written in place, that inode is what the group's other names are linked to (one
    made before would hold an inode of its own, and stay apart from the group)."""
    mk = sorted([s for s in steps if s.target.kind == "dir"], key=lambda s: s.path.count("/"))
    files = [s for s in steps if s.target.present and s.target.kind != "dir"]
    opening = []
    if root_fd is not None:
        files.sort(key=lambda s: not _holds_group_inode(root_fd, s))
        # before all: a directory that stays one and gets back a mode its owner may fill (a
        # call left it 0555), or nothing could be removed from it or written into it
        opening = [s for s in mk if not _blocks(s.target.mode) and _blocks_now(root_fd, s.path)]
        mk = [s for s in mk if s not in opening]
    rm = sorted([s for s in steps if not s.target.present], key=lambda s: -s.path.count("/"))
    if root_fd is not None:
        # a directory the revert removes, closed to its owner now: opened before it is emptied
        opening += [Opening(s.path, s.target, s.expected) for s in
                    sorted(rm, key=lambda s: s.path.count("/"))
                    if s.expected.kind == "dir" and _blocks_now(root_fd, s.path)]
    late = [DirMode(s.path, s.target, s.expected) for s in reversed(mk) if _blocks(s.target.mode)]
    return opening + rm + mk + files + late


def _blocks_now(root_fd: int, rel: str) -> bool:
    """Is ``rel`` a directory now, of a mode that would not let its owner fill it?"""
    st = _lstat(root_fd, rel)
    return st is not None and stat.S_ISDIR(st.st_mode) and _blocks(st.st_mode)


CHANGED_SINCE = "changed since the interrupted revert began"


def recheck(plan: Plan, live) -> None:
    """A saved plan carried on (`revert --continue`): each path that holds something must hold
    what the plan found (not reached yet) or what it puts there (reached): else someone put
    it there since the revert began, and it is a conflict (``changed``), which --continue
    overwrote.  A path that holds nothing (removed since, or beyond a directory made a
    symlink, which the step itself refuses) loses nothing to the step.  ``live``: the live
    tree (states.Tree)."""
    for s in plan.steps:
        if not s.conflict and changed_since(live, s):
            s.conflict, s.note = "changed", CHANGED_SINCE
            plan.changed_since.append(s.path)


def changed_since(live, step: Step, ours: set | None = None, *, removed: bool = False,
                  seen: list | None = None) -> bool:
    """Does ``step.path`` hold something the plan neither found there (``expected``) nor puts
    there (``target``)?  Someone put it there after the plan was made, and the step would
    write over it.  Nothing there loses nothing to the step, unless ``removed`` asks for a
    removal since as well (the plan found a file there and puts one back: the step would undo
    another writer's `rm`, as a plan made after it refuses to); a path that cannot be read is
    read again by the step itself, which says what stops it.  ``ours``: the inodes the plan's
    steps wrote so far (a hard-link group's other names hold what one step wrote in place).
    ``seen`` gets the lstat the path was looked at with (None: nothing there)."""
    if step.moved_from is not None:
        # a rename back: its object at either name (not moved yet, or moved already), or
        # the path holding the step's whole end already (the object back and its content
        # written anew, a new inode: a --continue took the revert's own step for another
        # writer's change; found by a bug hunt)
        if seen is not None:
            seen.append(None)
        if any((st := live.lstat(p)) is not None and st.st_ino == step.expected.ino
               for p in (step.path, step.moved_from)):
            return False
        try:
            now = live.state(step.path)
        except OSError:
            return False
        return not (now.exact and now.same(step.target))
    try:
        now, st = live.state_stat(step.path)
    except OSError:
        return False
    if seen is not None:
        seen.append(st)
    if ours and st is not None and (st.st_dev, st.st_ino) in ours:
        return False
    if removed and not now.present and step.expected.present and step.target.present:
        # not a path out of reach (a symlink put on its way): its step refuses that itself
        return not live.symlink_on_the_way(step.path)
    if not now.exact:  # its content may not be read here (a mode that denies its owner)
        return now.kind not in (step.expected.kind, step.target.kind)
    # a directory loses nothing to a step but by its removal, which keeps one not empty
    # (KEPT); one on the way of the plan's paths is made by their steps (``ways``)
    return now.present and now.kind != "dir" and \
        not (now.same(step.expected) or now.same(step.target)) and \
        not refreshed(step.path, step.expected, now, live)  # git's index refreshed, as the plan
