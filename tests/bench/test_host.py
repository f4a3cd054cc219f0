"""``bench host``: the engine host's CPU a request, measured in its own process against a baseline in turns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.bench import host

ROOT = Path(__file__).resolve().parents[2]


def test_the_host_is_measured_against_a_baseline_in_turns(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    result = host.run(ROOT, ROOT, [8], 0.5, 1, 1.0, out)
    rows = result["results"]["8"]
    for name in ("this", "baseline"):
        (row,) = rows[name]  # one round each, a fresh host process each
        assert row["requests"] > 0 and row["requests_per_s"] > 0 and 0 < row["host_us_per_request"] < 10_000
    summary = json.loads(out.read_text())["summary"]["c8"]
    assert summary["this_over_baseline"] > 0 and set(summary["host_us_per_request"]) == {"this", "baseline"}


def test_requests_of_several_texts_count_the_host_cpu_a_text(tmp_path: Path) -> None:
    result = host.run(ROOT, ROOT, [4], 0.5, 2, 1.0, tmp_path / "host.json", texts_per_request=16)
    for row in result["results"]["4"]["this"]:
        assert row["host_us_per_text"] == pytest.approx(row["host_us_per_request"] / 16) and row["requests"] > 0
    summary = result["summary"]["c4"]
    assert len(summary["this_over_baseline_rounds"]) == 2 and summary["this_over_baseline_median_round"] > 0
    assert result["settings"]["texts_per_request"] == 16


def test_the_backbone_may_be_a_process_reached_over_the_pipe_as_served(tmp_path: Path) -> None:
    """With ``backbone_process``, each version's host reaches a stand-in of the backbone's process over its own pipe
    (its BackboneProcess, plain batches as arrays, scores read back against the bundled model's labels)."""
    result = host.run(ROOT, ROOT, [8], 0.5, 1, 1.0, tmp_path / "host.json", backbone_process=True)
    for name in ("this", "baseline"):
        (row,) = result["results"]["8"][name]
        assert row["requests"] > 0 and 0 < row["host_us_per_request"] < 10_000
    assert result["settings"]["backbone_process"] is True
