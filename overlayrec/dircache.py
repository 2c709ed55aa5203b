"""The kernel's cache of directory listings (FOPEN_CACHE_DIR), which pyfuse3 does not expose.

Without it every ``opendir``/``readdir`` of a directory reaches the daemon as READDIRPLUS
requests, one attribute set per entry: a warm ``git status`` of a 15,000-file tree spent 0.21 s
of the daemon's 0.24 s there (docs/bench.md).  With it the kernel keeps the listing it read
and answers the next reads of that directory itself until something changes it through the
mount (the kernel drops the listing on every create, unlink, rename, link, mkdir, rmdir in the
directory).  Nothing changes the underlay behind the kernel while mounted (the same holds for
the 300 s entry and attribute timeouts the daemon has always given), so the listing it keeps
is the listing the daemon would give.

``_dircache.c`` (built with the package), loaded here with RTLD_GLOBAL before pyfuse3 is
imported, provides two libfuse functions pyfuse3 then binds to.  Through ``fuse_session_new``
it learns at INIT whether the kernel can open directories itself (Linux 5.1+): then the
daemon answers OPENDIR with ENOSYS once, the kernel sends no OPENDIR or RELEASEDIR again and
keeps every listing it reads, and each READDIRPLUS names its directory by inode
(``by_inode``, ``BY_INODE``), which pyfuse3 alone does not pass on.  Otherwise it sets the
two bits on the OPENDIR reply that follows ``next_dir()`` (``fuse_reply_open``), pyfuse3
having no way to.  So this module must be imported before pyfuse3 (``overlayrec.daemon``
imports it first); imported later, or with the library not built, or with
``OVERLAYREC_TEST_NO_DIRCACHE=1`` (a bench switch), it loads nothing, ``by_inode`` is false
and ``next_dir`` does nothing: listings are then read from the daemon every time, as before.
docs/design.md, "The kernel keeps directory listings", says more.
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import os
import sys

_SWITCH = "OVERLAYREC_TEST_NO_DIRCACHE"


def _library() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(here, "_dircache" + suffix)
        if os.path.exists(path):
            return path
    return None


def _load():
    """The loaded library, or None (see the module's docstring for when)."""
    if os.environ.get(_SWITCH) or "pyfuse3" in sys.modules:
        return None  # pyfuse3 bound to libfuse already: the library would never be called
    path = _library()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    except OSError:
        return None
    if not lib.overlayrec_dircache_ready():
        # libfuse cannot be found: pyfuse3 cannot load either, and says why
        return None
    return lib


_lib = _load()

#: whether OPENDIR's replies let the kernel cache listings (for the daemon's log)
active = _lib is not None


def _nothing() -> None:
    pass


def _never() -> int:
    return 0


#: call as the last step of a successful opendir: its reply lets the kernel cache the listing
next_dir = _lib.overlayrec_cache_next_dir if _lib is not None else _nothing

#: true once the kernel's INIT has shown that it opens directories itself when OPENDIR answers
#: ENOSYS (Linux 5.1+): it then keeps every listing, and READDIRPLUS and FSYNCDIR name their
#: directory by inode, ``BY_INODE | ino``, in place of a handle
#: (``OVERLAYREC_TEST_DIRCACHE_BY_HANDLE=1``, a test switch: as on a kernel before 5.1, the
#: daemon opens directories and the reply to OPENDIR lets the kernel keep the listing)
by_inode = _lib.overlayrec_dircache_by_inode \
    if _lib is not None and not os.environ.get("OVERLAYREC_TEST_DIRCACHE_BY_HANDLE") else _never

#: the file handle's bit that marks an inode number (set by the library, never by the daemon,
#: whose handles count up from 1)
BY_INODE = 1 << 63
