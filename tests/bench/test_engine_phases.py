"""`bench engine`: the engine's batch time split by its profiler ranges, which cost nothing while no profiler runs."""

import contextlib
import json
from pathlib import Path

from typer.testing import CliRunner

from service.bench.engine_phases import PHASES, batches_of, phases, run
from service.cli import app
from service.serving.engine.engine import Engine, _phase

TEXTS = [f"text number {k} " + "word " * (k % 7) for k in range(24)]


def test_batches_are_whole_and_in_the_texts_order() -> None:
    assert batches_of(list("abcdefg"), 3) == [["a", "b", "c"], ["d", "e", "f"]]
    assert batches_of(list("ab"), 3) == []


def test_a_phase_is_a_profiler_range_only_while_a_profiler_runs() -> None:
    import torch
    from torch.profiler import profile

    assert isinstance(_phase("engine.encode"), contextlib.nullcontext)
    with profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not isinstance(_phase("engine.encode"), contextlib.nullcontext)


def test_the_phases_cover_the_profiled_batch(tiny_repo: Path) -> None:
    engine = Engine.load(tiny_repo / "tiny", device="cpu")
    out = phases(engine, batches_of(TEXTS, 8))
    parts = out["process_ms"]
    assert set(parts) == {p.removeprefix("engine.") for p in PHASES}
    assert all(parts[p] > 0 for p in ("plan", "encode", "join", "heads", "results")), parts
    # the five ranges are the batch, one after another: their sum is most of it and never more
    assert 0.6 * out["profiled_ms_per_batch"] < sum(parts.values()) <= out["profiled_ms_per_batch"], out
    assert "kernels_per_batch" not in out  # on the CPU nothing is launched on a device


def test_a_row_per_batch_size_with_a_whole_batch(tiny_repo: Path) -> None:
    engine = Engine.load(tiny_repo / "tiny", device="cpu")
    rows = run(engine, TEXTS, [1, 8, 100], seconds=0.1)
    assert [r["batch_size"] for r in rows] == [1, 8]  # no batch of 100 in 24 texts
    for r in rows:
        assert abs(r["texts_per_s"] - 1000 * r["batch_size"] / r["ms_per_batch"]) < 1e-6
        assert 0 < r["host_us_per_text"] < 1000 * r["ms_per_batch"] / r["batch_size"]  # a part of each text's time
        assert r["torch_ops_per_batch"] > 10


def test_torch_operators_per_batch_do_not_grow_with_its_texts(tiny_repo: Path) -> None:
    """A batch of 16 texts of many lengths calls as many operators as a batch of 2: the packed stream is one encoder
    call, the head one packed call, their scores one copy."""
    engine = Engine.load(tiny_repo / "tiny", device="cpu")
    mixed = [f"text {k:02d} " + "word " * (k % 9) for k in range(16)]
    assert len({e[16].n_tokens for e in engine.encode(mixed, [engine.default] * 16)}) == 9
    ops = {n: phases(engine, batches_of(mixed, n)[:2])["torch_ops_per_batch"] for n in (2, 16)}
    assert ops[2] == ops[16], ops
    # padded and cut into length groups (here one per length: a call costs nothing), a head call each: more
    engine.packed_heads, engine.head_call_overhead = False, 0
    padded = phases(engine, batches_of(mixed, 16)[:1])["torch_ops_per_batch"]
    assert padded > 5 * ops[16], (padded, ops)


def test_the_command_writes_a_row_per_batch_size(tiny_repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    res = CliRunner().invoke(app, ["bench", "engine", "--model", "tiny", "--preset", "tweet-sentiment",
                                   "--model-repository", str(tiny_repo), "--batch-sizes", "1,4", "--texts", "16",
                                   "--seconds", "0.1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert [r["batch_size"] for r in data["results"]] == [1, 4] and data["settings"]["device"] == "cpu"
    assert "encode_process_ms" in res.output


def test_a_changed_setting_is_measured_against_the_engine_as_it_is_in_turns(tiny_repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    res = CliRunner().invoke(app, ["bench", "engine", "--model", "tiny", "--preset", "tweet-sentiment",
                                   "--model-repository", str(tiny_repo), "--batch-sizes", "4", "--texts", "16",
                                   "--seconds", "0.1", "--variant", "packed_heads=false", "--variant-rounds", "2",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    cmp = data["results"]["variant"]
    assert cmp["setting"] == {"packed_heads": False} and cmp["current"] == {"packed_heads": True}
    row = cmp["by_batch_size"]["4"]
    assert len(row["current"]) == len(row["changed"]) == 2
    ratios = [c["ms_per_batch"] / v["ms_per_batch"] for c, v in zip(row["current"], row["changed"], strict=True)]
    assert row["ratios"] == ratios and min(ratios) <= row["changed_over_current"] <= max(ratios)
    assert data["summary"]["variant_over_current"] == {"4": row["changed_over_current"]}
    assert [r["batch_size"] for r in data["results"]["rows"]] == [4]


def test_a_setting_the_engine_lacks_exits_2(tiny_repo: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["bench", "engine", "--model", "tiny", "--preset", "tweet-sentiment",
                                   "--model-repository", str(tiny_repo), "--variant", "no_such=1",
                                   "--out", str(tmp_path / "e.json")])
    assert res.exit_code == 2 and "no_such" in res.output and not (tmp_path / "e.json").exists()


def test_a_device_that_is_not_there_exits_2(tiny_repo: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["bench", "engine", "--model", "tiny", "--preset", "tweet-sentiment",
                                   "--model-repository", str(tiny_repo), "--device", "cuda",
                                   "--out", str(tmp_path / "e.json")])
    said = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "CUDA is not available" in said, res.output


def test_the_backbone_is_compared_with_onnx_runtime_on_the_same_batches(tiny_backbone_dir: Path) -> None:
    from service.bench import onnx
    from service.modeling.backbone import Backbone

    backbone = Backbone(str(tiny_backbone_dir), max_length=16)
    texts = [f"text number {k} " + "word " * (k % 5) for k in range(10)]
    cmp = onnx.compare(backbone, str(tiny_backbone_dir), texts, batch=4, rounds=2)
    assert (cmp["texts"], cmp["batches"], cmp["rounds"]) == (8, 2, 2)  # whole batches only
    assert len(cmp["torch_ms_rounds"]) == len(cmp["onnxruntime_ms_rounds"]) == 2
    assert cmp["torch_over_onnxruntime"] == cmp["torch_ms_per_batch"] / cmp["onnxruntime_ms_per_batch"] > 0
    assert cmp["max_abs_difference"] < 1e-4  # the same encoder: the same hidden states on the real tokens
