"""Commands that need an optional extra say which to install, at once, when it is missing (a fresh install from the
README's serve command has none): no traceback, no work done first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

MISSING = ("aiohttp", "sklearn", "scipy")  # one of each extra's packages, blocked in the command's interpreter
RUN = ("import sys; sys.modules.update(dict.fromkeys({missing})); from service.cli import app; "
       "app(prog_name='routing-service')")


@pytest.mark.parametrize(("args", "says"), [
    (["train", "mine", "--data", "DATA", "--out", "OUT"], "train needs the train extra (pip install -e '.[train]')"),
    (["evaluate", "models/tweet-sentiment"], "evaluate needs the train extra (pip install -e '.[train]')"),
    *[(["bench", name], f"bench {name} needs the bench and train extras (pip install -e '.[bench,train]')")
      for name in ("serve", "explain", "sharing", "heads", "repository", "train")],
])
def test_a_command_without_its_extra_says_which_to_install(args: list[str], says: str, tmp_path: Path) -> None:
    data = tmp_path / "texts.csv"
    data.write_text("text,label\na,x\nb,y\n")
    args = [{"DATA": str(data), "OUT": str(tmp_path / "models")}.get(a, a) for a in args]
    out = subprocess.run([sys.executable, "-c", RUN.format(missing=MISSING), *args], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert out.returncode == 2, out.stdout + out.stderr
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "models").exists()
