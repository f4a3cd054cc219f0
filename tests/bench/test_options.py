"""The benchmarks' list options: a value that is no list of positive numbers is an error before any work, and
before anything else is checked (here: as if the peer frameworks were not installed, as in CI's test install)."""

import importlib.util

import pytest
from typer.testing import CliRunner

from service.cli import app


@pytest.fixture
def no_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, package=None: None if name in ("mosec", "litserve") else real(name, package))


@pytest.mark.parametrize("args", [
    ["serve", "--concurrency", "abc"], ["serve", "--concurrency", "0"], ["serve", "--concurrency", ","],
    ["serve", "--peer-concurrency", "8,x"], ["serve", "--open-loop", "half"], ["heads", "--heads", "0"],
    ["sharing", "--heads", "1,-2"], ["sharing", "--batch-sizes", ""], ["routing", "--factors", "1.5"],
    ["profile", "--concurrency", "8,0"],
])
def test_a_list_option_that_is_no_list_of_numbers_exits_2(args: list[str], no_peers: None) -> None:
    res = CliRunner().invoke(app, ["bench", *args])
    said = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "expected comma-separated" in said and f"got '{args[2]}'" in said, res.output


def test_thread_settings_are_pairs(no_peers: None) -> None:
    res = CliRunner().invoke(app, ["bench", "serve", "--threads", "1"])
    assert res.exit_code == 2 and "threads:wait-policy pairs" in " ".join(res.output.replace("│", " ").split())


@pytest.mark.parametrize("args", [["serve", "--duration", "0"], ["serve", "--texts", "0"], ["heads", "--rounds", "0"],
                                  ["train", "--folds", "1"], ["explain", "--timed-texts", "0"],
                                  ["routing", "--repeats", "0"]])
def test_a_count_or_duration_out_of_range_exits_2(args: list[str]) -> None:
    res = CliRunner().invoke(app, ["bench", *args])
    assert res.exit_code == 2 and f"Invalid value for '{args[1]}'" in " ".join(res.output.replace("│", " ").split())
