"""Engines: pure functions of the journal and the underlay (diff, and later revert, replay,
blame, export).  They never need a mount: the live tree is read through a ``Tree`` reader,
which is the workspace itself when unmounted or the underlay fd the daemon hands over."""
