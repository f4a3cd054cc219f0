"""`bench gpu --device cpu`: the same measurements as on a GPU, run here as CI's smoke test on the tiny model. Every
section runs without error and the summary has every field, measured where a CPU measures it."""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.bench import cpus
from service.bench.gpu import (
    IN_FLIGHT,
    ROOT,
    EngineWorker,
    alone_vs_mixed,
    closed_loop,
    invariance,
    keep_partial,
    labelled_test,
    section,
    write_labelled,
)
from service.cli import app
from tests.conftest import TINY_LABELS


def test_every_section_runs_and_every_field_is_written_on_the_cpu(tiny_repo: Path, tmp_path: Path) -> None:
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps({"texts": [f"text {k} " + "word " * (k % 9) for k in range(40)],
                                 "labels": [["alpha", "beta", "gamma"][k % 3] for k in range(40)]}))
    out = tmp_path / "gpu.json"
    res = CliRunner().invoke(app, [
        "bench", "gpu", "--device", "cpu", "--model", "tiny", "--model-repository", str(tiny_repo),
        "--texts-file", str(texts), "--texts", "32", "--budgets", "64", "--seconds", "0.05", "--rounds", "2",
        "--baseline", str(ROOT), "--served-seconds", "0.3", "--concurrency", "4", "--load-processes", "2",
        "--accuracy-texts", "20", "--variant", "packed_heads=false,buckets=eager,head_dtype=bfloat16",
        "--served-variant", "buckets=eager,batches_in_flight=2", "--served-variant", "max_wait_ms=1",
        "--invariance", "batch_invariance=reductions",
        "--peers", "mosec",
        "--workers", "2", "--peer-concurrency", "4", "--load-cpus", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    results, summary = doc["results"], doc["summary"]
    assert summary["failed_sections"] == [], {k: v.get("error") for k, v in results.items() if "error" in v}
    # the served sections' load generator on a core of its own (the last), the servers on the rest
    split = cpus.split(1)
    assert split is not None and doc["settings"]["cpus"] == split.record()
    levels = [*results["served"]["levels"], *results["served_variant"]["levels"],
              *results["served_variant_2"]["levels"],
              *(r for level in results["beside"]["closed"].values() for rows in level["rounds"].values() for r in rows)]
    assert levels and all(r["load_cpus"] == list(split.load) for r in levels)
    assert results["served"]["server_cpus"] == results["served_variant"]["server_cpus"] == list(split.server)
    assert summary["served_fronts"] == 1  # auto on a CPU
    sections = {"load", "engine", "profile", "latency", "accuracy", "head_precision", "buckets", "invariance",
                "served",
                "served_variant", "served_variant_2", "beside", "gpu_tests", "routing_headline"}
    assert set(results) == sections | {"seconds"} and set(results["seconds"]) == sections
    assert set(summary["section_seconds"]) == sections and all(v >= 0 for v in summary["section_seconds"].values())
    assert summary["seconds_in_all"] == round(sum(results["seconds"].values()), 1) > 0
    # the served variants last, in the order asked, each its settings over the defaults
    assert list(results)[-2:] == ["served_variant", "served_variant_2"]
    assert not any(isinstance(v, dict) and "partial" in v for v in results.values())  # each section's end kept
    variants = summary["served_variants"]
    assert list(variants) == ["served_variant", "served_variant_2"]
    assert variants["served_variant"]["settings"] == {"ROUTING_BUCKETS": "eager", "ROUTING_BATCHES_IN_FLIGHT": "2"}
    assert variants["served_variant_2"]["settings"] == {"ROUTING_MAX_WAIT_MS": "1"}
    assert all(v["ready_s"] > 0 and set(v["levels"]) == {"c4x1", "c64x16"} for v in variants.values())
    assert all(r["errors"] == 0 and r["texts_per_s"] > 0 for v in variants.values() for r in v["levels"].values())
    assert results["routing_headline"]["n_inp"] == 2000 and results["routing_headline"]["finite"]
    # the engine as served against each --invariance candidate, its settings over the served engine's
    assert doc["settings"]["invariance"] == [{"batch_invariance": "reductions"}]
    assert results["invariance"]["candidates"] == {"served": {}, "batch_invariance-reductions": {
        "batch_invariance": "reductions"}}
    assert set(summary["invariance"]) == {"served", "batch_invariance-reductions"}
    assert all(row["texts_per_s"] > 0 and row[f"label_flips_alone_vs_mixed_{name}"] == 0
               for name, row in summary["invariance"].items())
    empty = {k for k, v in summary.items() if v is None}
    assert all(k.startswith("device_busy_share") for k in empty), empty  # a CPU has no device to be busy
    assert summary["kernels_per_batch"] == 0 and summary["torch_ops_per_batch"] > 0
    profiles = results["profile"]  # each of this version's engines profiled two batches in flight too (the
    # baseline has no such run), with the host's time by what it was in
    assert {k for k in profiles if k.endswith(IN_FLIGHT)} == {f"current{IN_FLIGHT}", *(
        f"{k}{IN_FLIGHT}" for k in results["engine"] if k.startswith("current-"))}
    assert profiles[f"current{IN_FLIGHT}"]["pipelined"] and not profiles["current"]["pipelined"]
    assert all(p["top_host_us_per_batch"] and p["wall_ms_per_batch_profiled"] > 0 for p in profiles.values())
    assert "device_busy_share_two_in_flight_current" in summary
    both = "current-packed_heads-False-buckets-eager-head_dtype-bfloat16"  # one variant of three settings
    # this version as served on a CPU (no buckets: auto is off there), each variant its own settings over it
    assert doc["settings"]["engines"] == {"current": {}, both: {"packed_heads": False, "buckets": "eager",
                                                                 "head_dtype": "bfloat16"}}
    assert set(results["engine"]) == {"current", "baseline", both}  # a truth parsed
    assert summary[f"buckets_{both}"]["bucketed"] > 0 and summary[f"buckets_{both}"]["failed"] == {}
    buckets = summary["buckets"]  # the labelled texts in buckets answer as without (eagerly padded on a CPU), the
    # heads' products in bfloat16 in both (as cuda computes them); the batches of one head, on the head as the eager
    # engine runs it (its parameters broadcast), of other shapes
    assert buckets["batches_buckets_eager"]["bucketed"] == buckets["batches_buckets_eager"]["one_head"] > 0
    assert buckets["batches_buckets_eager"]["unfit"] == 0
    assert 0 <= buckets["largest_probability_change_buckets_off_vs_eager"] <= 0.02
    assert buckets["labels_changed_buckets_off_vs_eager"] == 0 and buckets["warm_up_buckets_eager"]["buckets"] > 0
    for rows in results["engine"]["current"].values():  # both rounds, sequential and two batches in flight
        assert len(rows) == 2 and all(r["texts_per_s"] > 0 and r["texts_per_s_pipelined"] > 0 for r in rows)
        assert all(r["host_us_per_text"] > 0 for r in rows)
        assert all(r["collecting_ms_per_batch"] >= 0 and r["full_collections"] >= 0 for r in rows)
    assert sorted(results["engine"]["current"]) == ["64", "8192"]  # the CPU's default budget is added
    assert summary["accuracy"]["texts"] == 20 and 0 <= summary["accuracy"]["accuracy_float32"] <= 1
    assert summary["accuracy"]["largest_probability_change_alone_vs_mixed_float32"] <= 1e-5  # batch invariance
    assert summary["accuracy"]["label_flips_alone_vs_mixed_float32"] == 0
    assert summary["accuracy"]["flipped_alone_vs_mixed_float32"] == []
    heads = summary["head_precision"]  # float32 against bfloat16 heads, both measured
    assert heads["texts"] == 20 and 0 <= heads["accuracy_heads_bfloat16"] <= 1
    assert 0 < heads["largest_probability_change_heads_float32_vs_bfloat16"] < 0.1
    served = summary["served"]
    piped = summary["offline_texts_per_s_two_in_flight_current"]["8192"]  # served 16-text requests against the
    # engine offline one batch in flight (the headline) and two (as a GPU's server runs it)
    assert summary["served_over_offline_two_in_flight_multi_text"] == served["c64x16"]["texts_per_s"] / piped
    assert summary["served_over_offline_multi_text"] == (served["c64x16"]["texts_per_s"]
                                                         / summary["offline_texts_per_s_at_default_budget"])
    assert set(served) == {"c4x1", "c64x16"} and all(v["errors"] == 0 and v["texts_per_s"] > 0
                                                      for v in served.values())
    # where a served level's time went: texts a batch, the engine's busy share, each part's CPU a text
    assert all(v["mean_batch"] >= 1 and 0 < v["engine_busy"] <= 1.2 and v["server_cpu_ms"] > 0
               and v["models_cpu_ms"] > 0 for v in served.values())
    # one front, two fronts and mosec where it is installed (the bench extra; named as missing otherwise), each
    # answering every request
    beside, has_mosec = summary["beside"]["c4"], find_spec("mosec") is not None
    assert set(beside) == {"routing-service", "routing-service, 2 fronts", *(["mosec"] if has_mosec else [])}
    assert all(v["errors"] == 0 and v["texts_per_s"] > 0 for v in beside.values())
    two = beside["routing-service, 2 fronts"]
    assert two["this_over_it"] == beside["routing-service"]["texts_per_s"] / two["texts_per_s"]
    assert results["beside"]["max_batch_size"] == 32 and results["beside"]["max_wait_ms"] == 5  # a CPU's defaults
    assert results["beside"]["missing_peers"] == ([] if has_mosec else ["mosec"])
    said = summary["gpu_tests"]  # pytest's last line: the GPU tests found and skipped here, none failing
    assert " skipped" in said and "failed" not in said and "error" not in said, said


def test_a_flip_alone_vs_mixed_is_named_with_its_margins() -> None:
    alone = [[0.7, 0.2, 0.1], [0.4, 0.35, 0.25], [0.501, 0.499, 0.0]]
    mixed = [[0.7, 0.2, 0.1], [0.4, 0.36, 0.24], [0.498, 0.502, 0.0]]  # the third, a near tie, flips
    got = alone_vs_mixed(alone, mixed, "x")
    assert got["largest_probability_change_alone_vs_mixed_x"] == pytest.approx(0.01)
    assert got["label_flips_alone_vs_mixed_x"] == 1
    (flip,) = got["flipped_alone_vs_mixed_x"]
    assert flip["text"] == 2
    assert flip["margin_alone"] == pytest.approx(0.002) and flip["margin_mixed"] == pytest.approx(0.004)


def test_the_invariance_section_measures_each_candidate_on_the_same_texts(
        tiny_repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The served engine and each candidate, the kernel's by Triton's interpreter (the workers inherit it): in
    float32 every one keeps each text's probabilities whatever its batch, and its states at every depth."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    texts = [f"text {k} " + "word " * (k % 7) for k in range(12)]
    labels = [TINY_LABELS[k % 3] for k in range(12)]
    (tmp_path / "texts.json").write_text(json.dumps(texts))

    def make(name: str, engine: dict) -> EngineWorker:
        return EngineWorker(ROOT, {"repository": str(tiny_repo), "model": "tiny", "device": "cpu", "dtype": "float32",
                                   "texts_file": str(tmp_path / "texts.json"), "engine": engine},
                            tmp_path / f"{name}.log", load_now=False)

    # (reductions, which sets only cuBLAS's flags, computes here as served does: the every-section run measures it)
    candidates = {"served": {}, "kernels": {"batch_invariance": "kernels"}, "unknown": {"batch_invariance": "always"}}
    got = invariance(make, labels, candidates, budget=40, max_texts=8, seconds=0.05, rounds=2, traced=2)
    assert got["texts"] == 12 and got["candidates"] == candidates
    # a candidate that cannot run says why, and the others are measured
    assert "one of off, reductions, kernels" in got["unknown"]["error"]
    del candidates["unknown"]
    assert len(got["traced_texts"]) == 2 and set(got["traced_texts"]) <= set(range(12))
    accuracy = {got[name]["accuracy"] for name in candidates}
    assert len(accuracy) == 1 and 0 <= accuracy.pop() <= 1  # the same answers, whichever products
    for name in candidates:
        row = got[name]
        assert row[f"largest_probability_change_alone_vs_mixed_{name}"] <= 1e-5
        assert row[f"label_flips_alone_vs_mixed_{name}"] == 0 and row[f"flipped_alone_vs_mixed_{name}"] == []
        assert [d["text"] for d in row["divergence"]] == got["traced_texts"]
        for d in row["divergence"]:  # each depth's states, the embeddings' first: alone as in its batch
            assert len(d["largest_state_change_by_depth"]) == len(d["relative_state_change_by_depth"]) == 3
            assert max(d["relative_state_change_by_depth"]) <= 1e-5 and d["largest_probability_change"] <= 1e-5
            assert 0 <= d["head_probability_change_same_states"] <= 1e-5  # (the packed head runs on a CPU)
            assert 1 <= d["batch_texts"] <= 8 and d["tokens"] <= d["batch_tokens"] <= 40 + d["tokens"]
        assert len(row["throughput"]) == 2 and row["texts_per_s"] > 0 and row["texts_per_s_two_in_flight"] > 0
        assert row["load"]["device"] == "cpu"


def test_a_served_section_stopped_midway_keeps_its_levels_done() -> None:
    results: dict = {"served": {"levels": ["earlier section"]}}
    saved: list[dict] = []
    keep = keep_partial(results, "served_variant", lambda r: saved.append(json.loads(json.dumps(r))))
    out = {"ready_s": 1.0, "levels": [{"concurrency": 32}]}
    keep(out)  # the first level measured; the run is stopped during the second
    out["levels"].append({"concurrency": 256})  # (never reported: not kept)
    assert saved[-1]["served_variant"] == {"ready_s": 1.0, "levels": [{"concurrency": 32}], "partial": True}
    assert results["served"] == {"levels": ["earlier section"]}
    # a section that ends replaces what it kept, partial no more
    section(results, "served_variant", lambda: {**out, "levels": out["levels"]})
    assert "partial" not in results["served_variant"] and len(results["served_variant"]["levels"]) == 2


def test_labelled_texts_round_trip_through_a_file(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    write_labelled("tweet-sentiment", 50, path)
    texts, labels = labelled_test("tweet-sentiment", 50, path=path)
    assert (texts, labels) == labelled_test("tweet-sentiment", 50)  # the same seeded sample
    assert labelled_test("tweet-sentiment", 10, path=path) == (texts[:10], labels[:10])
    assert set(labels) <= {"negative", "neutral", "positive"}


def test_the_load_generator_counts_what_was_answered(tiny: object) -> None:
    row = closed_loop(tiny.url, ["a text", "another text"], concurrency=4, per_request=2, seconds=0.3, processes=2)
    assert row["errors"] == 0 and row["requests_per_s"] > 0
    assert abs(row["texts_per_s"] - 2 * row["requests_per_s"]) < 1e-6 and row["p50_ms"] <= row["p99_ms"]
