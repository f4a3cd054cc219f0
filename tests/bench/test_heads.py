"""`bench heads` on the tiny model: perturbed copies of a head are written and served from one backbone; the
head step is measured by head and gathered; every workload is measured in turns with its latencies and batches;
memory is read with the pinned model only and with every head; with a budget below the heads in use, heads are
evicted and brought back and every answer equals the unlimited server's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from service.bench import heads


def test_heads_are_served_measured_and_answer_alike_under_a_budget(tiny_repo: Path, tmp_path: Path) -> None:
    repo = tmp_path / "models"
    shutil.copytree(tiny_repo / "tiny", repo / "tiny")
    names = heads.make_heads(repo / "tiny", repo, 6)
    assert len({(repo / n / "head.safetensors").read_bytes() for n in names}) == 6  # other weights each
    texts = ["a short text", "another one, a little longer", "x", "and a fourth"]

    step = heads.head_step(repo, "tiny", names, texts, batch=4, reps=2, rounds=1)
    assert [r["step"] for r in step["rows"]] == ["one head", "a head per text, by head", "a head per text, gathered"]
    assert step["backbone_ms"] > 0 and all(r["batch_ms"] > 0 for r in step["rows"])

    pairs = [(names[k % 6], texts[k % 4]) for k in range(12)]
    serving = heads.served(repo, "tiny", names, [1, 6], texts, concurrency=4, seconds=1.0, rounds=1, open_share=0.2,
                           pairs=pairs, logs=tmp_path / "logs")
    assert set(serving["rounds"]) == {"single head", "K=1", "K=6"}
    assert all(r["errors"] == 0 and r["throughput"] > 0 for rows in serving["levels"].values() for r in rows)
    assert serving["pss_mib"]["every_head"] > 0 and serving["pss_mib"]["pinned_only"] > 0  # tiny heads: within noise
    assert all(level["errors"] == 0 for level in serving["open_loop"]["levels"].values())
    reference = serving["reference"]
    assert all(isinstance(r, dict) for r in reference)

    budget = heads.budgeted(repo, "tiny", names, 2, texts, concurrency=4, seconds=2.0, pairs=pairs,
                            reference=reference, logs=tmp_path / "logs")
    assert budget["errors"] == 0 and budget["misses"] > 0 and budget["evictions"] > 0
    assert budget["answers_compared"] == 12 and budget["answers_differing"] == 0


def test_the_metrics_page_is_measured_with_every_head_used_at_each_setting(tiny_repo: Path, tmp_path: Path) -> None:
    summary = heads.metrics_page(tiny_repo, 12, tmp_path / "metrics.json", model="tiny")
    rows = {r["setting"]: r for r in json.loads((tmp_path / "metrics.json").read_text())["results"]["rows"]}
    pinned, every = rows["default (pinned)"], rows["ROUTING_METRICS_MODELS=all"]
    assert summary["default_series"] == pinned["series"] and summary["goal_met"]
    # every model labelled: each of the 12 heads adds its own series of every per-model metric
    assert every["series"] >= pinned["series"] + 12 * 20 and every["bytes"] > pinned["bytes"]
