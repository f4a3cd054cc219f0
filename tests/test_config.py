"""Settings that depend on where the backbone computes: batch limits and the backbone's precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.config import CPU_BATCH, CPU_WAIT_MS, GPU_BATCH, GPU_WAIT_MS, Settings, unknown_variables
from service.modeling.device import resolve_dtype
from tests.serving.test_tokenize_once import started


def test_batch_limits_default_per_device_and_as_set() -> None:
    s = Settings()
    assert s.max_batch_size is None and s.max_batch_tokens is None  # chosen where the backbone loads
    assert s.batch_limits("cpu") == CPU_BATCH == (32, 8192)
    assert s.batch_limits("cuda:0") == s.batch_limits("cuda") == GPU_BATCH == (1024, 16384)
    assert Settings(max_batch_size=8).batch_limits("cuda") == (8, 16384)
    assert Settings(max_batch_tokens=4096).batch_limits("cpu") == (32, 4096)
    with pytest.raises(ValueError, match="greater than or equal to 16"):
        Settings(max_batch_tokens=8)


def test_batch_wait_defaults_per_device_and_as_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().max_wait_ms is None  # chosen where the backbone loads
    assert Settings().batch_wait_ms("cpu") == CPU_WAIT_MS == 5.0
    assert Settings().batch_wait_ms("cuda:0") == Settings().batch_wait_ms("cuda") == GPU_WAIT_MS == 1.0
    assert Settings(max_wait_ms=0).batch_wait_ms("cuda") == 0  # set, even to nothing: as set on every device
    monkeypatch.setenv("ROUTING_MAX_WAIT_MS", "7.5")
    assert Settings().batch_wait_ms("cpu") == Settings().batch_wait_ms("cuda") == 7.5
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        Settings(max_wait_ms=-1)


def test_auto_precision_is_bfloat16_on_a_gpu_and_float32_on_a_cpu() -> None:
    assert Settings().dtype == "auto"
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda")) == torch.float32
    with pytest.raises(ValueError, match="only supported on GPU"):
        resolve_dtype("bfloat16", torch.device("cpu"))


def test_a_server_on_the_cpu_batches_with_the_cpus_limits(tiny_repo: Path) -> None:
    for c, _ in started(tiny_repo):
        limits = c.app.state.app_state.inference.models["tiny"].batcher.limits
        assert (limits.max_batch_size, limits.max_batch_tokens) == CPU_BATCH
        assert limits.max_wait_s == CPU_WAIT_MS / 1000
        assert c.get("/v1/models/tiny").json()["dtype"] == "float32"  # auto, on a CPU


def test_auto_fronts_one_on_the_cpu_several_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from service import config

    assert Settings(device="cpu").workers == 1 and Settings(devices=["cpu", "cpu"]).workers == 1
    assert Settings(device="cuda", workers=3).workers == 3  # a number is kept
    for cpus, fronts in ((2, 2), (8, 4), (10, 6), (12, 8), (16, 8), (64, 8)):
        monkeypatch.setattr(config, "available_cpus", lambda cpus=cpus: cpus)
        assert Settings(device="cuda:0").workers == fronts
        assert Settings(devices=["cuda:0", "cuda:1"]).workers == fronts
        assert Settings(device="cuda", head_cache_bytes=10_000_000).workers == 1  # a head cache needs one front
    monkeypatch.setenv("ROUTING_WORKERS", "auto")
    assert Settings(device="cpu").workers == 1


def test_variables_that_name_no_setting_are_found_with_the_setting_they_resemble() -> None:
    environ = {"ROUTING_MAX_BATCHSIZE": "8", "ROUTING_API_KEY": "k", "ROUTING_WORKER": "2", "ROUTING_BOGUS": "1",
               "ROUTING_PORT": "8000", "routing_max_queue": "9", "PATH": "/bin", "OTHER_ROUTING_X": "1"}
    assert unknown_variables(environ) == {"ROUTING_MAX_BATCHSIZE": "ROUTING_MAX_BATCH_SIZE",
                                          "ROUTING_API_KEY": "ROUTING_API_KEYS", "ROUTING_WORKER": "ROUTING_WORKERS",
                                          "ROUTING_BOGUS": None}
    assert unknown_variables({f"ROUTING_{name.upper()}": "" for name in Settings.model_fields}) == {}
