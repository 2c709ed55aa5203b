"""The journal layer: the LMDB environment (events, actors, meta), the content store of blobs.

Nothing here imports pyfuse3 or trio: the engines read a journal without a mount.
"""
from .schema import FORMAT_VERSION, JournalError  # noqa: F401
from .store import Journal  # noqa: F401
from .content import ContentStore  # noqa: F401
