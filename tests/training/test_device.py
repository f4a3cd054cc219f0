"""Where training runs: ``--device`` and ``--dtype`` reach the features and the head's training, are checked before
any work, and are recorded in the manifest. The GPU case runs under the ``gpu`` marker (``bench gpu`` runs it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from service.cli import app
from service.training import pipeline
from tests.training.test_training import said, toy_args


def spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Record the device the pipeline gives the backbone (the features) and the head's training."""
    seen: dict[str, list[Any]] = {"backbone": [], "train_head": []}
    backbone, train_head = pipeline.Backbone, pipeline.train_head

    def backbone_on(*args: Any, **kwargs: Any) -> Any:
        seen["backbone"].append((str(kwargs["device"]), kwargs["dtype"]))
        return backbone(*args, **kwargs)

    def train_on(*args: Any) -> Any:
        seen["train_head"].append(str(args[-1]))
        return train_head(*args)

    monkeypatch.setattr(pipeline, "Backbone", backbone_on)
    monkeypatch.setattr(pipeline, "train_head", train_on)
    return seen


def test_an_explicit_cpu_reaches_the_features_and_the_training(tmp_path: Path, tiny_backbone_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    seen = spy(monkeypatch)
    args = toy_args(tmp_path, tiny_backbone_dir)
    res = CliRunner().invoke(app, ["train", "toy", "--out", str(tmp_path / "repo"), *args, "--device", "cpu",
                                   "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    assert seen == {"backbone": [("cpu", torch.float32)], "train_head": ["cpu"]}
    assert "toy: features and training on cpu (backbone in float32, head in float32)" in res.output
    training = json.loads((tmp_path / "repo" / "toy" / "manifest.json").read_text())["training"]
    assert (training["device"], training["backbone_dtype"]) == ("cpu", "float32")
    res = CliRunner().invoke(app, ["evaluate", str(tmp_path / "repo" / "toy"), "--cache", str(tmp_path / "cache"),
                                   "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert seen["backbone"][-1] == ("cpu", torch.float32)


@pytest.mark.parametrize(("options", "message"), [
    (["--device", "tpu"], "'tpu': auto, cpu or cuda[:n]"),
    (["--dtype", "float64"], "'float64': one of auto, float32, float16, bfloat16"),
    (["--device", "cpu", "--dtype", "bfloat16"], "dtype bfloat16 is only supported on GPU"),
    pytest.param(["--device", "cuda"], "CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
])
@pytest.mark.parametrize("command", ["train", "evaluate", "bench train"])
def test_a_device_or_precision_that_cannot_be_had_exits_2_before_any_work(tmp_path: Path, tiny_backbone_dir: Path,
                                                                         options: list[str], message: str,
                                                                         command: str) -> None:
    if command == "train":
        args = ["train", "toy", "--out", str(tmp_path / "repo"), *toy_args(tmp_path, tiny_backbone_dir)]
    elif command == "evaluate":
        args = ["evaluate", str(tmp_path)]  # checked before the folder is read
    else:
        args = ["bench", "train", "--datasets", "tweet-sentiment", "--out", str(tmp_path / "b.json")]
    res = CliRunner().invoke(app, [*args, *options])
    assert res.exit_code == 2 and message in said(res), res.output
    assert "train loss" not in res.output and not (tmp_path / "repo").exists() and not (tmp_path / "b.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench gpu runs it)")
def test_training_on_the_gpu_matches_the_cpu_in_float32_and_runs_there(tmp_path: Path, tiny_backbone_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    seen = spy(monkeypatch)
    args = toy_args(tmp_path, tiny_backbone_dir)
    runs = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "float32"), ("cuda", "auto")):
        out = tmp_path / f"{device}-{dtype}"
        res = CliRunner().invoke(app, ["train", "toy", "--out", str(out), *args, "--device", device, "--dtype", dtype])
        assert res.exit_code == 0, res.output
        runs[device, dtype] = json.loads((out / "toy" / "manifest.json").read_text()), load_file(
            out / "toy" / "head.safetensors")
    assert seen["backbone"] == [("cpu", torch.float32), ("cuda:0", torch.float32), ("cuda:0", torch.bfloat16)]
    assert seen["train_head"] == ["cpu", "cuda:0", "cuda:0"]
    (cpu, cpu_weights), (gpu, gpu_weights), (bf16, _) = runs.values()
    assert (gpu["training"]["device"], bf16["training"]["backbone_dtype"]) == ("cuda:0", "bfloat16")
    assert gpu["evaluation"]["head"]["accuracy"] == cpu["evaluation"]["head"]["accuracy"]
    assert bf16["evaluation"]["head"]["accuracy"] >= cpu["evaluation"]["head"]["accuracy"] - 0.05
    assert all(w.device.type == "cpu" for w in gpu_weights.values())  # written from the host either way
    for name, w in cpu_weights.items():  # float32 on both: the same training up to the order of additions
        torch.testing.assert_close(gpu_weights[name], w, atol=1e-2, rtol=1e-2)
