"""The layers of the brief are enforced: import-linter contracts in pyproject.toml, checked here,
and shown to break when a layer is crossed."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lint(cwd: str) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    env = dict(os.environ, PYTHONPATH=cwd)
    return subprocess.run([exe, "--no-cache"], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=120)


def test_contracts_kept():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 kept, 0 broken" in r.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("fs.py", "import lmdb", "fs never touches LMDB"),
    ("journal/store.py", "import trio", "journal never touches FUSE or trio"),
    ("journal/content.py", "import pyfuse3", "journal never touches FUSE or trio"),
    ("recorder.py", "from . import fs", "The layers of the brief"),
    ("underlay.py", "from . import journal", "The layers of the brief"),
])
def test_a_crossed_layer_breaks_the_contract(tmp_path, module, line, broken):
    shutil.copytree(os.path.join(ROOT, "overlayrec"), tmp_path / "overlayrec",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path)
    p = tmp_path / "overlayrec" / module
    p.write_text(p.read_text() + f"\n{line}  # deliberate violation\n")
    r = lint(str(tmp_path))
    assert r.returncode != 0
    assert f"{broken}" in r.stdout and "BROKEN" in r.stdout
