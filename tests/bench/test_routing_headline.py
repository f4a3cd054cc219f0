"""`bench routing --headline`: the reference library's long-sequence routing, here with few inputs (the full
1,000,000 needs a GPU's memory: `bench gpu` runs it there)."""

import json
from pathlib import Path

from typer.testing import CliRunner

from service.bench.routing import HEADLINE
from service.cli import app


def test_the_headline_routing_runs_and_reports_its_peak_memory(tmp_path: Path) -> None:
    out = tmp_path / "headline.json"
    res = CliRunner().invoke(app, ["bench", "routing", "--headline", "--headline-inputs", "3000", "--out", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    row = doc["results"]["headline"]
    assert (row["n_inp"], row["n_out"], row["d_inp"], row["d_out"]) == (3000, *list(HEADLINE.values())[1:])
    assert row["finite"] and row["forward_s"] > 0 and row["backward_s"] > 0
    # the parameters (the first routing's are per input: n_inp x (d_inp + 2 n_out + ...)) and the input are counted
    assert row["built_gib"] * 2**30 >= 3000 * 1024 * 4 * 2
    assert row["forward_peak_gib"] >= row["built_gib"] and row["stated_gb"] is None  # no claim at 3,000 inputs
    assert doc["summary"]["under_stated"] is None and doc["summary"]["finite"]
