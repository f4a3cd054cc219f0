"""``bench host-work``: the engine's own host work a text, its device's compute replaced by a stand-in, against a
baseline in turns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.bench import host_work
from service.bench.gpu import ROOT, EngineWorker


def texts_file(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "texts.json"
    path.write_text(json.dumps({"texts": [f"text {k} " + "word " * (k % 7) for k in range(n)],
                                "labels": ["alpha"] * n}))
    return path


def test_the_host_work_is_measured_against_a_baseline_in_turns(tiny_repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "host-work.json"
    doc = host_work.run(ROOT, ROOT, "tiny", tiny_repo, 48, 512, 32, 0.2, 2, out, tmp_path / "logs",
                        texts_file(tmp_path, 48))
    assert json.loads(out.read_text()) == doc
    rows, summary = doc["results"], doc["summary"]
    for name in ("this", "baseline"):
        assert len(rows[name]) == 2  # one a round
        for row in rows[name]:
            # every batch ran in a bucket, so none computed: the figure is the host's own work
            assert row["buckets"]["bucketed"] > 0 and row["buckets"]["unfit"] == 0
            assert 0 < row["host_us_per_text"] == pytest.approx(1e6 / row["texts_per_s"])
    assert summary["texts_per_batch"] == 24  # 48 texts in batches of at most 32
    assert len(summary["this_over_baseline_host_us_per_text_rounds"]) == 2
    assert summary["this_over_baseline_host_us_per_text"] > 0


def test_a_stand_in_device_needs_shape_buckets(tiny_repo: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="needs shape buckets"):
        EngineWorker(ROOT, {"repository": str(tiny_repo), "model": "tiny", "device": "cpu", "dtype": "float32",
                            "texts_file": str(tmp_path / "none.json"), "engine": {"stand_in": True}},
                     tmp_path / "worker.log")


def test_the_stand_in_device_answers_at_once_with_zeros(tiny_repo: Path, tmp_path: Path) -> None:
    texts = tmp_path / "worker-texts.json"  # what the engine's process reads: the texts alone
    texts.write_text(json.dumps(json.loads(texts_file(tmp_path, 40).read_text())["texts"]))
    worker = EngineWorker(ROOT, {"repository": str(tiny_repo), "model": "tiny", "device": "cpu", "dtype": "float32",
                                 "texts_file": str(texts), "budget": 512, "max_texts": 32,
                                 "engine": {"buckets": "eager", "stand_in": True}}, tmp_path / "worker.log")
    try:
        k = len(worker.loaded["labels"])
        probs = worker.ask("predict", alone=False, budget=512, max_texts=32)["probs"]
    finally:
        worker.close()
    assert len(probs) == 40 and all(p == pytest.approx([1 / k] * k) for p in probs)  # zero logits, every text
