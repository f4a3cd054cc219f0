"""The package's architecture as pyproject.toml's import-linter contracts state it: the layers of service and of
service.serving import one way, down, and no package of service has an import cycle; an import that breaks a layer,
at the top of a module, inside a function or under TYPE_CHECKING alike, fails the check."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(where: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package and pyproject.toml in ``where`` (no cache: what the files say now)."""
    return subprocess.run([str(LINT), "--no-cache"], cwd=where, capture_output=True, text=True, timeout=300)


def test_the_contracts_hold() -> None:
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 3 kept, 0 broken." in done.stdout


@pytest.mark.parametrize("line", [
    "from service.serving.api import app\n",  # at the top of a module
    "def later() -> None:\n    from service.serving.state import AppState  # noqa: F401\n",  # inside a function
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from service.serving.pipeline import inference\n",
])
def test_an_import_that_breaks_a_layer_fails(tmp_path: Path, line: str) -> None:
    shutil.copytree(ROOT / "service", tmp_path / "service", ignore=shutil.ignore_patterns("__pycache__", "static"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "service" / "serving" / "core" / "keys.py", "a") as f:  # the bottom layer reaching up
        f.write(line)
    done = lint(tmp_path)
    assert done.returncode == 1
    assert "service.serving.core is not allowed to import service.serving." in done.stdout
    assert "service.serving.core.keys -> service.serving." in done.stdout
