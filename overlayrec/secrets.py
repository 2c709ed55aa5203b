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

The effective list is stored in the journal's meta (``secrets``) at mount, so every reader
applies the list the recorder applied.  Content that a rename (or a hard link) carries from a
secret path to a name no pattern matches stays withheld under that name: the recorder adds
the name to meta ``secret_names`` (a path, with everything beneath) for the rest of the record.
"""
from __future__ import annotations

import fnmatch
import json
import re

DEFAULTS = (".env*", ".ssh/", ".npmrc", ".pypirc", ".netrc", ".git-credentials", "*.pem",
            "*.key")
PLACEHOLDER = "content not kept (secret path)"
META_PATTERNS = "secrets"
META_NAMES = "secret_names"


class SecretError(Exception):
    """A pattern that cannot be used: says why in one line."""


def check_pattern(p: str) -> str:
    if not p or not p.strip("/") or "\0" in p or "\n" in p:
        raise SecretError(f"not a secret pattern: {p!r}")
    return p


def effective(added=(), no_defaults: bool = False, stored: list[str] | None = None) -> list[str]:
    """The list a mount applies: the defaults (unless ``no_defaults``) and ``added``; with
    neither option given, what the journal already holds (the workspace keeps its setting
    from one mount to the next), or the defaults for a new journal."""
    added = [check_pattern(p) for p in added]
    if not added and not no_defaults and stored is not None:
        return list(stored)
    out = [] if no_defaults else list(DEFAULTS)
    return out + [p for p in added if p not in out]


def placeholder(as_of: int | None) -> bytes:
    """What a reader shows for a secret file's content at a point: the last event that changed
    it there (None: the live file), so two points read alike only when nothing changed it."""
    when = "live" if as_of is None else \
        (f"as of event {as_of}" if as_of else "as the record began")
    return f"overlayrec: {PLACEHOLDER}; {when}\n".encode()


def _one_re(patterns: list[str]):
    """One compiled expression matching what any of ``patterns`` matches (fnmatchcase)."""
    return re.compile("|".join(fnmatch.translate(p) for p in patterns)) if patterns else None


class Secrets:
    """The patterns and extra names of one journal, and the match."""

    def __init__(self, patterns=DEFAULTS, names=()):
        self.patterns = list(patterns)
        self.names = set(names)
        self._any: list[str] = []       # any component (base name or directory)
        self._anchored: list[str] = []  # the path from the root
        for p in self.patterns:
            if p.endswith("/") and "/" not in p.strip("/"):
                self._any.append(p.strip("/"))
            elif "/" not in p:
                self._any.append(p)
            else:
                self._anchored.append(p.strip("/"))
        # each list as one regular expression (fnmatchcase's own translation), asked once a name
        self._any_re = _one_re(self._any)
        self._anchored_re = _one_re(self._anchored)
        self._cache: dict[str, bool] = {}
        self._parts: dict[str, bool] = {}  # a name's answer under _any_re (names repeat)

    @classmethod
    def of_journal(cls, journal) -> "Secrets":
        """The journal's list (the defaults for a journal from before secret paths)."""
        raw = journal.meta(META_PATTERNS)
        names = journal.meta(META_NAMES)
        return cls(DEFAULTS if raw is None else json.loads(raw),
                   json.loads(names) if names else ())

    def match(self, path: str) -> bool:
        """Is the content at ``path`` (workspace-relative) withheld?"""
        if not path:
            return False
        got = self._cache.get(path)
        if got is None:
            got = self._match(path)
            if len(self._cache) > 65536:  # bounded: the daemon asks too (misses are cheap:
                # each name's answer is kept in _parts)
                self._cache.clear()
            self._cache[path] = got
        return got

    def _match(self, path: str) -> bool:
        parts = path.split("/")
        if self.names:
            for i in range(1, len(parts) + 1):
                if "/".join(parts[:i]) in self.names:
                    return True
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

    def carried(self, src: str, dst: str) -> bool:
        """``dst`` now holds what was at ``src`` (a rename, a hard link): when the content was
        withheld there and no pattern covers ``dst``, the name joins ``names``.  True when
        ``names`` changed (the caller stores it: meta ``secret_names``)."""
        changed = False
        if self.match(src) and not self.match(dst):
            self.names.add(dst)
            changed = True
        else:
            # names beneath a moved directory move with it
            for n in [n for n in self.names if n.startswith(src + "/")]:
                new = dst + n[len(src):]
                if not self.match(new):
                    self.names.add(new)
                    changed = True
        if changed:
            self._cache.clear()
        return changed

    def names_json(self) -> str:
        return json.dumps(sorted(self.names))
