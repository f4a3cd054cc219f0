"""The engine's own host work a text (``routing-service bench host-work``): on a GPU whose encoder and heads run as
captured graphs, the device computes a batch of 456 tweets in about 7 ms while the process feeding it plans the
batch, packs it, launches it and reads its results text by text; that host work, not the device, set the offline
rate measured on an H200 (``bench-results/gpu-h200-3.json``). It is the same Python on any machine, so a CPU can
measure it.

Each version (this one, a ``--baseline`` checkout) runs its engine in a process of its own
(:mod:`service.bench.engine_worker`, on its main thread as served), its plain batches in shape buckets whose
computation is replaced by a stand-in that answers zeros at once: what a batch then costs is the host's work alone.
The texts are a seeded sample of the model's test split, tokenized once at load (tokenizing is the fronts' work), in
batches of the GPU's default budget. The versions are measured in turns (each first in every other round), whole
passes over the batches for ``seconds`` each, one batch in flight and then two (as the backbone's process keeps them
on a GPU)."""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from service.bench import report
from service.bench.gpu import EngineWorker, labelled_test


def run(root: Path, baseline: Path | None, model: str, repository: Path, n_texts: int, budget: int, max_texts: int,
        seconds: float, rounds: int, out: Path, logs: Path, texts_file: Path | None = None) -> dict[str, Any]:
    """Measure, print a line per version and write ``out``; returns what was written. ``texts_file``: the texts
    (see :func:`~service.bench.gpu.labelled_test`) where the model's dataset is not installed."""
    texts, _ = labelled_test(model, n_texts, path=texts_file)
    versions = {"this": root.resolve(), **({"baseline": baseline.resolve()} if baseline else {})}
    logs.mkdir(parents=True, exist_ok=True)
    settings = {"model": model, "texts": len(texts), "budget": budget, "max_texts": max_texts, "seconds": seconds,
                "rounds": rounds, "baseline": str(baseline) if baseline else None}
    workers: dict[str, EngineWorker] = {}
    with tempfile.TemporaryDirectory(prefix="bench-host-work-") as tmp:
        sent = Path(tmp) / "texts.json"
        sent.write_text(json.dumps(texts))
        try:
            for name, tree in versions.items():
                workers[name] = EngineWorker(tree, {
                    "repository": str(report.repository_for(tree, repository, model)), "model": model,
                    "device": "cpu", "dtype": "float32",
                    "texts_file": str(sent), "max_texts": max_texts, "budget": budget,
                    "engine": {"buckets": "eager", "stand_in": True}}, logs / f"host-work-{name}.log")
            rows: dict[str, list[dict[str, Any]]] = {name: [] for name in workers}
            for k in range(rounds):  # in turns, each version first in every other round
                for name in report.in_turns(list(workers), k):
                    rows[name].append(workers[name].ask("throughput", budget=budget, max_texts=max_texts,
                                                        seconds=seconds))
        finally:
            for w in workers.values():
                w.close()
    for name, rs in rows.items():
        for r in rs:
            r["host_us_per_text"] = 1e6 / r["texts_per_s"]
            r["host_us_per_text_two_in_flight"] = 1e6 / r["texts_per_s_pipelined"]
            unfit = (r.get("buckets") or {}).get("unfit", 0)
            if unfit:  # those batches computed for real: the figure is not the host's alone
                raise RuntimeError(f"{name}: {unfit} batches fit no bucket and were computed")
    summary: dict[str, Any] = {
        "texts_per_batch": rows["this"][0]["texts_per_batch"],
        "host_us_per_text": {n: statistics.median(r["host_us_per_text"] for r in rs) for n, rs in rows.items()},
        "host_us_per_text_two_in_flight": {n: statistics.median(r["host_us_per_text_two_in_flight"] for r in rs)
                                           for n, rs in rows.items()}}
    for name in rows:
        report.echo(f"{name}: {summary['host_us_per_text'][name]:.2f} us a text one batch in flight, "
                    f"{summary['host_us_per_text_two_in_flight'][name]:.2f} two ({summary['texts_per_batch']:.0f} "
                    f"texts a batch)")
    if "baseline" in rows:  # each round's ratio (the versions side by side in it), and their median
        for key in ("host_us_per_text", "host_us_per_text_two_in_flight"):
            ratios = report.round_ratios(rows["this"], rows["baseline"], key)
            summary[f"this_over_baseline_{key}"] = statistics.median(ratios)
            summary[f"this_over_baseline_{key}_rounds"] = ratios
        report.echo(f"this / baseline: {summary['this_over_baseline_host_us_per_text']:.3f} (one in flight), "
                    f"{summary['this_over_baseline_host_us_per_text_two_in_flight']:.3f} (two)")
    path = report.write_json(out, "host-work", settings, rows, summary)
    report.echo(f"wrote {path}")
    return json.loads(path.read_text())
