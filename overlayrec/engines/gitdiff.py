"""Diffs in git's own format, made by git itself.

The two sides of a diff (the recorded paths as they stood before and after a selection) are
written as blobs and trees into a private object store in the state dir, and `git diff-tree`
compares the trees: renames, binary files, modes and symlinks come out exactly as git shows
them, and `git apply` takes the patch.  The user's repository is never touched.
"""
from __future__ import annotations

import os
import subprocess
import tempfile

from ..views import git_refuses
from .states import State

EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"


def left_out_note(n: int, what: str = "shown") -> str:
    """The line that says what a diff (or, ``what="exported"``, an export) could not hold."""
    return (f"overlayrec: {n} change(s) under .git/ not {what} (git cannot hold them); "
            "`overlayrec replay` restores them")


class GitError(Exception):
    pass


class ObjectStore:
    """A git object store: the private one in the state dir (default), or a repository the
    user names.  The private one borrows the workspace repository's objects as an alternate
    (read only: nothing is ever written there)."""

    def __init__(self, state_dir: str, git_dir: str | None = None, workspace: str | None = None):
        self.git_dir = git_dir or os.path.join(state_dir, "git")
        if not os.path.exists(os.path.join(self.git_dir, "HEAD")):
            if git_dir is not None:
                raise GitError(f"{git_dir} is not a git repository")
            self._git("init", "-q", "--bare", self.git_dir, git_dir=False)
            theirs = os.path.join(workspace, ".git", "objects") if workspace else None
            if theirs and os.path.isdir(theirs):
                with open(os.path.join(self.git_dir, "objects", "info", "alternates"), "w") as f:
                    f.write(theirs + "\n")
        # paths as they are (UTF-8), not octal-quoted: diffs read as the workspace's names
        self.env = dict(os.environ, GIT_DIR=self.git_dir, GIT_CONFIG_NOSYSTEM="1",
                        GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_COUNT="1",
                        GIT_CONFIG_KEY_0="core.quotepath", GIT_CONFIG_VALUE_0="false")
        self.left_out: set[str] = set()   # paths git refuses, filtered out before git saw them
        self.warnings: list[str] = []     # what git said on stderr when it succeeded

    def _git(self, *args, input=None, env=None, git_dir=True) -> str:
        cmd = ["git", *args]
        r = subprocess.run(cmd, input=input, capture_output=True,
                           env=env or (self.env if git_dir else None))
        if r.returncode != 0:
            raise GitError(f"git {args[0]} failed: {r.stderr.decode(errors='replace').strip()}")
        for line in r.stderr.decode(errors="replace").splitlines():
            if line.strip() and line not in self.warnings:
                self.warnings.append(line)
        return r.stdout.decode("utf-8", "surrogateescape")

    def index_lines(self, states: dict[str, State]) -> list[str]:
        """``git update-index --index-info`` lines for these states: each present file or
        symlink written as a blob, each other path removed (mode 0).  Paths git refuses
        (``.git/``) are left out and remembered in ``left_out``; so is the workspace's root
        ("", a directory: never a tree entry)."""
        refused = {p for p in states if git_refuses(p)}
        self.left_out |= refused
        states = {p: s for p, s in states.items() if p and p not in refused}
        present = {p: s for p, s in states.items() if s.kind in ("file", "symlink")}
        lines = []
        if present:
            with tempfile.TemporaryDirectory(prefix="overlayrec-blobs-") as tmp:
                names = []
                for i, (p, s) in enumerate(sorted(present.items())):
                    f = os.path.join(tmp, str(i))
                    with open(f, "wb") as fh:
                        fh.write(s.data)
                    names.append(f)
                shas = self._git("hash-object", "-w", "--no-filters", "--stdin-paths",
                                 input="\n".join(names).encode()).split()
            for (p, s), sha in zip(sorted(present.items()), shas):
                mode = "120000" if s.kind == "symlink" else \
                    ("100755" if s.mode & 0o111 else "100644")
                lines.append(f"{mode} {sha}\t{p}")
        lines += [f"0 {'0' * 40}\t{p}" for p in states if p not in present]
        return lines

    def update_index(self, lines: list[str], env: dict) -> None:
        if lines:
            self._git("update-index", "-z", "--index-info",
                      input=("\0".join(lines) + "\0").encode("utf-8", "surrogateescape"),
                      env=env)

    def tree(self, states: dict[str, State]) -> str:
        """A tree holding each present path (files and symlinks) as a blob; not the paths git
        refuses (see index_lines)."""
        refused = {p for p in states if git_refuses(p)}
        self.left_out |= refused
        if not any(s.kind in ("file", "symlink") and p not in refused
                   for p, s in states.items()):
            return EMPTY_TREE
        with tempfile.TemporaryDirectory(prefix="overlayrec-tree-") as tmp:
            env = dict(self.env, GIT_INDEX_FILE=os.path.join(tmp, "index"))
            self.update_index([l for l in self.index_lines(states) if not l.startswith("0 ")],
                              env)
            return self._git("write-tree", env=env).strip()

    def diff(self, a: str, b: str, fmt: str, paths: list[str] | None = None,
             binary: bool = False) -> str:
        args = ["diff-tree", "-r", "-M" if self._renames_apply(a, b, paths) else "--no-renames",
                "--no-commit-id", "--root"]
        args += {"patch": ["-p"], "stat": ["--stat"], "numstat": ["--numstat"],
                 "name-status": ["--name-status"]}[fmt]
        if binary and fmt == "patch":
            args.append("--binary")
        args += [a, b]
        if paths:
            args += ["--", *paths]
        return self._git(*args)

    def _renames_apply(self, a: str, b: str, paths: list[str] | None) -> bool:
        """May the diff name renames?  Not where a symlink and a directory trade places (``l``
        a symlink becomes a directory holding what moved in): git apply then refuses a rename
        into ``l/...`` as "beyond a symbolic link", though it takes the same change written as
        deletions and additions."""
        raw = self._git("diff-tree", "-r", "-z", "--no-renames", "--no-commit-id", "--root",
                        a, b, *(["--", *paths] if paths else []))
        fields = raw.split("\0")
        links, changed = set(), []
        for meta, path in zip(fields[0::2], fields[1::2]):
            modes = meta.lstrip(":").split(" ")[:2]
            if "120000" in modes:
                links.add(path)
            changed.append(path)
        if not links:
            return True
        for path in changed:
            parts = path.split("/")
            if any("/".join(parts[:i]) in links for i in range(1, len(parts))):
                return False
        return True

