"""overlayrec: a recorder of everything that happens to a workspace, at the filesystem."""
__version__ = "0.1.0"
