"""Secret paths: the paths whose content overlayrec never keeps.

A change to a secret path is still an event (who, when, kind, mode, owner, size), but no byte
of its content leaves the file: no blob or range in the content store, no attic entry, no
written data, no seal hash.  Its pre-images carry ``"withheld": true`` instead, and every
reader shows such a path as holding ``PLACEHOLDER`` text (diff, show, report, export) or
refuses to make it (revert: an ``unrecorded`` conflict; replay: not made).

Patterns (``DEFAULTS``, plus ``overlayrec mount --secret``, minus the defaults with
``--no-default-secrets``) are matched against workspace-relative paths:

* a pattern without a slash (``*.pem``) matches a path whose base name or any directory
  component it matches (fnmatch, case-sensitive): the path and everything beneath;
* a pattern ending in ``/`` (``.ssh/``) matches a directory of that name anywhere, and
  everything beneath it (a non-directory of that name too: nothing is lost by withholding);
* any other pattern (``config/prod.yml``, ``/top.txt``) is anchored at the workspace root and
  matches that path and everything beneath.

A pattern is *content-checked* by default only for ``*.pem`` (``CHECKED_DEFAULTS``): a file it
matches is withheld unless its content, looked at wherever the record would keep or show it,
is PEM blocks of public kinds only (certificates, CRLs, requests, public keys, parameters:
``public_pem``).  A CA bundle (certifi's ``cacert.pem`` in every venv's pip) is then kept like
any file, so a deleted venv reverts; a private key, a certificate with its key, anything
else, empty or unreadable or over ``CHECK_LIMIT``, is withheld, state by state: the recorder
decides for each pre-image it takes (and never keeps written data or a rename's carry
unchecked), a reader for each live file it reads.  A pattern given with ``--secret`` is
never content-checked.

The effective lists are stored in the journal's meta (``secrets``, ``secrets_checked``) at
mount, so every reader applies the lists the recorder applied.  Content that a rename (or a
hard link) carries from a secret path to a name no pattern matches stays withheld under that
name: the recorder adds the name to meta ``secret_names`` (a path, with everything beneath)
for the rest of the record.
"""
from __future__ import annotations

import fnmatch
import glob
import json
import os
import re
import stat

# the defaults the first records stored (a list holding them all was made with defaults)
FIRST_DEFAULTS = (".env*", ".ssh/", ".npmrc", ".pypirc", ".netrc", ".git-credentials", "*.key")
DEFAULTS = FIRST_DEFAULTS + (
    # private keys ssh-keygen names (their .pub is another name), cloud credentials
    "id_rsa", "id_dsa", "id_ecdsa", "id_ed25519", ".aws/")
CHECKED_DEFAULTS = ("*.pem",)
PLACEHOLDER = "content not kept (secret path)"
META_PATTERNS = "secrets"
META_CHECKED = "secrets_checked"
META_NAMES = "secret_names"
# the PEM labels whose blocks hold nothing secret (RFC 7468 and OpenSSL's names); any other
# label (PRIVATE KEY in all its forms, a PGP private key block ...) withholds the file
PUBLIC_LABELS = frozenset({
    b"CERTIFICATE", b"TRUSTED CERTIFICATE", b"X509 CERTIFICATE", b"X509 CRL",
    b"CERTIFICATE REQUEST", b"NEW CERTIFICATE REQUEST", b"PUBLIC KEY", b"RSA PUBLIC KEY",
    b"DH PARAMETERS", b"X9.42 DH PARAMETERS", b"EC PARAMETERS", b"PKCS7", b"CMS",
    b"SSH2 PUBLIC KEY", b"PGP PUBLIC KEY BLOCK", b"PGP SIGNATURE"})
CHECK_LIMIT = 8 << 20  # a CA bundle is some 300 KB; a larger file is not read to decide
_BEGIN = re.compile(rb"-----BEGIN ([^-\r\n]{1,64})-----")


class SecretError(Exception):
    """A pattern that cannot be used: says why in one line."""


def check_pattern(p: str) -> str:
    if not p or not p.strip("/") or "\0" in p or "\n" in p:
        raise SecretError(f"not a secret pattern: {p!r}")
    return p


def as_given(p: str, ws: str, cwd: str | None = None) -> str:
    """A ``--secret`` as the user typed it, made a pattern of the workspace's paths: a path
    (absolute, or ``./x`` and ``../x`` from where the command runs, ``cwd``) inside the
    workspace, also through a symlink, is its path from the root (anchored); ``//`` and ``/./``
    collapse; a path outside the workspace, or a pattern with ``..``, is refused.  Such a
    pattern was taken as given and never matched, and the secret was recorded (found by bug
    hunts)."""
    check_pattern(p)
    given = p
    dir_only = p.endswith("/")
    typed = p in (".", "..") or p.startswith(("./", "../"))  # a path, from where it was typed
    if typed:
        p = os.path.join(cwd or os.getcwd(), p)
    if p.startswith("/"):
        cand = os.path.normpath(p)
        head, leaf = os.path.split(cand)
        # the real path first: one through a symlink inside the workspace (`cfglink/x`,
        # linked to `conf`) names no path an event ever names (found by a bug hunt)
        seen = [os.path.join(os.path.realpath(head), leaf), cand]
        for root in {ws.rstrip("/") or "/", os.path.realpath(ws)}:
            for c in seen:
                if c.startswith(root.rstrip("/") + "/"):
                    return check_pattern("/" + c[len(root.rstrip("/")) + 1:]
                                         + ("/" if dir_only else ""))
                if c == root:
                    raise SecretError(f"--secret {given}: the whole workspace (give a path in it, "
                                      "or a pattern)")
        top = cand.strip("/").split("/")[0]
        if typed or "/" in cand.strip("/") and os.path.isdir("/" + top) and \
                not os.path.lexists(os.path.join(ws, top)):
            # a path of this machine outside the workspace, not one anchored at its root
            # (`/conf/prod.yml`)
            raise SecretError(f"--secret {given}: not inside the workspace {ws} (give a path "
                              "from the workspace's root, or a pattern)")
    parts = [x for x in p.split("/") if x not in ("", ".")]
    if ".." in parts:
        raise SecretError(f"--secret {given}: a path with '..' (give a path from the "
                          "workspace's root, or a pattern)")
    return check_pattern(("/" if p.startswith("/") else "") + "/".join(parts)
                         + ("/" if dir_only else ""))


def effective(added=(), no_defaults: bool = False, stored: list[str] | None = None,
              stored_checked: list[str] | None = None) -> tuple[list[str], list[str]]:
    """The lists a mount applies, (patterns, content-checked patterns): the defaults (unless
    ``no_defaults``) and ``added`` (never content-checked); with neither option given, what the
    journal already holds (the workspace keeps its setting from one mount to the next: a
    journal from before content checks keeps ``*.pem`` among its plain patterns), or the
    defaults for a new journal."""
    added = [check_pattern(p) for p in added]
    if not added and not no_defaults and stored is not None:
        if set(FIRST_DEFAULTS) <= set(stored):
            # a list made with the defaults of its day: the defaults added since join it
            # (a record from before them recorded a private key in full)
            return list(stored) + [p for p in DEFAULTS if p not in stored], \
                list(stored_checked or ())
        return list(stored), list(stored_checked or ())
    # an earlier mount's own patterns stay: a later `--secret other` dropped them, and the
    # path they withheld had its content kept from then on, without a word
    earlier = [p for p in stored or () if p not in DEFAULTS]
    out = [] if no_defaults else list(DEFAULTS)
    out += [p for p in earlier + added if p not in out]
    return out, [] if no_defaults else [p for p in CHECKED_DEFAULTS if p not in out]


def public_pem(data: bytes) -> bool:
    """May content at a content-checked path be kept: is it PEM blocks of public kinds only
    (at least one, text around them allowed, as in a CA bundle's comments)?"""
    labels = set(_BEGIN.findall(data))
    return bool(labels) and labels <= PUBLIC_LABELS


def public_at(fd: int) -> bool:
    """``public_pem`` of the file open at ``fd`` (read with pread: its offset stays); False
    for one over ``CHECK_LIMIT`` or not a regular file."""
    data = _read_public(fd)
    return data is not None and public_pem(data)


def _read_public(fd: int) -> bytes | None:
    """The whole file at ``fd`` (pread), or None: not a regular file, or over CHECK_LIMIT."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > CHECK_LIMIT:
        return None
    chunks, off = [], 0
    while off <= CHECK_LIMIT:
        got = os.pread(fd, 1 << 20, off)
        if not got:
            break
        chunks.append(got)
        off += len(got)
    return b"".join(chunks) if off <= CHECK_LIMIT else None


def public_in(dfd: int, name: str) -> bytes | None:
    """The content of the file ``name`` in the directory ``dfd`` (a reader's live file) when
    it is public (``public_pem``), read once: what is shown is what was looked at.  None when
    it is not, or cannot be read, or is over ``CHECK_LIMIT``."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dfd)
    except OSError:
        return None
    try:
        data = _read_public(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if data is not None and public_pem(data) else None


def _beneath(pattern: str, src: str) -> str | None:
    """What an anchored ``pattern`` names beneath the directory ``src`` (the rest of it,
    after components that match ``src``'s), or None when it names nothing beneath it."""
    pp, sp = pattern.split("/"), src.split("/")
    if len(pp) <= len(sp) or not all(fnmatch.fnmatchcase(s, q) for s, q in zip(sp, pp)):
        return None
    return "/".join(pp[len(sp):])


def placeholder(as_of: int | None) -> bytes:
    """What a reader shows for a secret file's content at a point: the last event that changed
    it there (None: the live file), so two points read alike only when nothing changed it."""
    when = "live" if as_of is None else \
        (f"as of event {as_of}" if as_of else "as the record began")
    return f"overlayrec: {PLACEHOLDER}; {when}\n".encode()


def _one_re(patterns: list[str]):
    """One compiled expression matching what any of ``patterns`` matches (fnmatchcase)."""
    return re.compile("|".join(fnmatch.translate(p) for p in patterns)) if patterns else None


class _Patterns:
    """A list of patterns, and the match of a workspace-relative path against it."""

    def __init__(self, patterns):
        self._any: list[str] = []       # any component (base name or directory)
        self.anchored: list[str] = []  # the path from the root
        for p in patterns:
            if p.endswith("/") and "/" not in p.strip("/"):
                self._any.append(p.strip("/"))
            elif "/" not in p:
                self._any.append(p)
            else:
                self.anchored.append(p.strip("/"))
        # each list as one regular expression (fnmatchcase's own translation), asked once a name
        self._any_re = _one_re(self._any)
        self._anchored_re = _one_re(self.anchored)
        self._parts: dict[str, bool] = {}  # a name's answer under _any_re (names repeat)

    def match(self, parts: list[str]) -> bool:
        if self._any_re is not None:
            known = self._parts
            for part in parts:
                got = known.get(part)
                if got is None:
                    if len(known) > 1 << 16:
                        known.clear()
                    got = known[part] = self._any_re.match(part) is not None
                if got:
                    return True
        if self._anchored_re is not None:
            for i in range(1, len(parts) + 1):
                if self._anchored_re.match("/".join(parts[:i])):
                    return True
        return False


class Secrets:
    """The patterns, content-checked patterns and extra names of one journal, and the match."""

    def __init__(self, patterns=DEFAULTS, names=(), checked=CHECKED_DEFAULTS):
        self.patterns = list(patterns)
        self.checked_patterns = list(checked)
        # a name carried by a rename or a link (``carried``) and the seq of that change: the
        # name is secret at the points from that seq on, and its states before were kept as
        # any path's (a names list of an older journal: from the record's start)
        if isinstance(names, dict):
            self.since = {n: s for n, s in names.items() if isinstance(s, int) and s > 0}
        else:
            self.since = {}
        self.names = set(names)
        self._plain = _Patterns(self.patterns)
        self._checked = _Patterns(self.checked_patterns) if self.checked_patterns else None
        self._cache: dict[str, bool] = {}
        self._checked_cache: dict[str, bool] = {}

    @classmethod
    def of_journal(cls, journal) -> "Secrets":
        """The journal's lists (the defaults for a journal from before secret paths)."""
        raw = journal.meta(META_PATTERNS)
        names = journal.meta(META_NAMES)
        checked = journal.meta(META_CHECKED)
        return cls(DEFAULTS if raw is None else json.loads(raw),
                   json.loads(names) if names else (),
                   CHECKED_DEFAULTS if raw is None else (json.loads(checked) if checked else ()))

    def match(self, path: str) -> bool:
        """Is the content at ``path`` (workspace-relative) withheld, whatever it holds?"""
        if not path:
            return False
        got = self._cache.get(path)
        if got is None:
            got = self._match(path)
            if len(self._cache) > 65536:  # bounded: the daemon asks too (misses are cheap:
                # each name's answer is kept in _Patterns._parts)
                self._cache.clear()
            self._cache[path] = got
        return got

    def match_at(self, path: str, after: int) -> bool:
        """``match`` at the point just after event ``after``: a carried name counts from the
        change that carried it (a formatter's ``.envelope.py.tmp`` renamed over envelope.py
        made envelope.py secret for the record's start too: its kept history, and a revert
        of the formatter, were refused; found by a bug hunt)."""
        if not self.since or not self.match(path) or self._plain.match(path.split("/")):
            return self.match(path)
        parts = path.split("/")
        for i in range(1, len(parts) + 1):
            name = "/".join(parts[:i])
            if name in self.names and self.since.get(name, 0) <= after:
                return True
        return False

    def checked(self, path: str) -> bool:
        """Is the content at ``path`` withheld unless it is public (``public_pem``): a path a
        content-checked pattern matches and no plain one does?"""
        if self._checked is None or not path:
            return False
        got = self._checked_cache.get(path)
        if got is None:
            got = not self.match(path) and self._checked.match(path.split("/"))
            if len(self._checked_cache) > 65536:
                self._checked_cache.clear()
            self._checked_cache[path] = got
        return got

    def _match(self, path: str) -> bool:
        parts = path.split("/")
        if self.names:
            for i in range(1, len(parts) + 1):
                if "/".join(parts[:i]) in self.names:
                    return True
        return self._plain.match(parts)

    def carried(self, src: str, dst: str, withheld: bool | None = None,
                since: int = 0) -> bool:
        """``dst`` now holds what was at ``src`` (a rename, a hard link): when the content was
        withheld there (``withheld``, when the caller looked at it; else a content-checked
        ``src`` counts as withheld) and no pattern covers ``dst``, the name joins ``names``.
        True when ``names`` changed (the caller stores it: meta ``secret_names``).  ``since``:
        the seq of the change (``match_at``)."""
        changed = False
        if withheld is None:
            withheld = self.match(src) or self.checked(src)
        # a directory carried away from under an anchored pattern (`conf/*.yml`, `mv conf
        # cfg`) and now moved back beneath it: the pattern covers what it covered again, and
        # the rest of the directory is no secret's (it was withheld whole for good; a hunt)
        back = src in self.names and \
            any(_beneath(p, dst) is not None for p in self._plain.anchored)
        if withheld and not self.match(dst) and not back:
            self.names.add(dst)
            if since:
                self.since[dst] = since
            changed = True
        else:
            # names beneath a moved directory move with it, and so do the paths an anchored
            # pattern names beneath it (`config/prod.yml` after `mv config cfg`: its content
            # was kept from then on): the path under its new name, or the whole directory
            # where the rest of the pattern is a pattern itself
            moved = [dst + n[len(src):] for n in self.names if n.startswith(src + "/")]
            for p in self._plain.anchored:
                rest = _beneath(p, src)
                if rest is not None:
                    moved.append(dst if glob.has_magic(rest) else f"{dst}/{rest}")
            for new in moved:
                if not self.match(new):
                    self.names.add(new)
                    if since:
                        self.since[new] = since
                    changed = True
        if changed:
            self._cache.clear()
            self._checked_cache.clear()
        return changed

    def forget(self) -> None:
        """``names`` was set anew: what was asked of the old one is asked again."""
        self._cache.clear()
        self._checked_cache.clear()

    def uncarried(self, since: int) -> bool:
        """The change of seq ``since`` that carried names (``carried``) was never made (its
        daemon killed before it): the names it carried go, and only those (a name an earlier
        change carried to the same path stays: taken back too, a secret was kept and shown;
        found by a bug hunt).  True when ``names`` changed."""
        gone = {n for n in self.names if self.since.get(n) == since}
        if not gone:
            return False
        self.names -= gone
        for n in gone:
            del self.since[n]
        self.forget()
        return True

    def names_json(self) -> str:
        """The names as meta ``secret_names`` keeps them: a list, or with any carried since a
        seq, an object of name -> that seq (0: from the record's start)."""
        if not any(self.since.get(n) for n in self.names):
            return json.dumps(sorted(self.names))
        return json.dumps({n: self.since.get(n, 0) for n in sorted(self.names)})
