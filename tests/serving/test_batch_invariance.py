"""``Engine.batch_invariance``: what each value sets, and what it refuses. (Its kernel's answers are tested in
tests/modeling/test_invariant.py, the engine through it in tests/bench/test_gpu.py's invariance section.) The
setting, ``ROUTING_BATCH_INVARIANCE``, reaches the model's process."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from torch.nn import functional as F

from service.modeling import invariant
from service.serving.core.work import Task
from service.serving.engine.engine import Engine
from tests.serving.server import Server, side_by_side


@pytest.fixture
def engine(tiny_repo: Path) -> Engine:
    return Engine.load(tiny_repo / "tiny", device="cpu")


TORCHS = {(F.linear, F.scaled_dot_product_attention)}
"""Every layer of the packed encoder computing with torch's linear layers and attention."""


def kernels(engine: Engine) -> set[tuple[object, object]]:
    """The (linear, attention) each layer of the engine's packed encoder computes with."""
    assert engine.backbone.stream is not None
    return {(layer.linear, layer.attention) for layer in engine.backbone.stream.layers}


def test_reductions_keep_cublas_split_sums_in_float32_and_off_gives_them_back(engine: Engine) -> None:
    matmul = torch.backends.cuda.matmul
    assert engine.batch_invariance == "off" and matmul.allow_bf16_reduced_precision_reduction
    try:
        engine.batch_invariance = "reductions"
        assert engine.batch_invariance == "reductions" and not matmul.allow_bf16_reduced_precision_reduction
        assert kernels(engine) == TORCHS  # the encoder's products as they were
        before = engine.run([Task("a text to score")])[0].scores
        engine.batch_invariance = "off"
        assert matmul.allow_bf16_reduced_precision_reduction
        assert engine.run([Task("a text to score")])[0].scores == before  # (a CUDA setting: nothing moves here)
    finally:
        matmul.allow_bf16_reduced_precision_reduction = True


def test_kernels_put_the_encoder_on_the_invariant_kernels_and_off_gives_torchs_back(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(invariant, "available", lambda device: None)  # as on a CUDA device (nothing runs here)
    try:
        engine.batch_invariance = "kernels"
        assert kernels(engine) == {(invariant.linear, invariant.attention)}
        assert engine.head_products is invariant.PRODUCTS  # the heads' grouped products too
        assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        engine.batch_invariance = "off"
        assert kernels(engine) == TORCHS and torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        assert engine.head_products is None
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True


def test_what_it_refuses_leaves_the_engine_as_it_was(engine: Engine) -> None:
    with pytest.raises(ValueError, match="one of off, reductions, kernels"):
        engine.batch_invariance = "always"
    if not invariant.INTERPRETED:  # Triton's kernels on a CPU only through its interpreter
        with pytest.raises(ValueError, match=r"kernels: .*CUDA"):
            engine.batch_invariance = "kernels"
    assert engine.batch_invariance == "off" and kernels(engine) == TORCHS
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    engine.use_buckets("eager", lengths=[4, 8])
    with pytest.raises(ValueError, match="before use_buckets"):  # graphs captured keep their kernels
        engine.batch_invariance = "reductions"
    assert engine.batch_invariance == "off"


def test_a_server_with_the_kernel_answers_as_one_without(tiny_repo: Path, tmp_path_factory: pytest.TempPathFactory,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``ROUTING_BATCH_INVARIANCE=kernels`` reaches the model's process (its kernels interpreted by Triton here, as
    CUDA compiles them on a GPU): every answer within 1e-5 of a server without it, alone and together. (To the bit
    alone and together on a GPU only: tests/serving/test_gpu.py. On a CPU torch's attention, and its vectorized
    elementwise functions, which compute the lanes of a vector otherwise than its tail, still move the last bits of a
    text's states with its place in the batch.)"""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (the servers' processes inherit it)
    texts = ["the first text", "a second, somewhat longer text. It has two sentences!", "x"]
    kernels, plain = side_by_side(tmp_path_factory.mktemp("logs-invariance"), *(
        {"model_repository": tiny_repo, "default_model": "tiny", "batch_invariance": value}
        for value in ("kernels", "off")))
    try:
        def classify(server: Server, inputs: list[str]) -> list[dict]:
            r = httpx.post(f"{server.url}/v1/classify", json={"inputs": inputs}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["results"]

        reference = classify(plain, texts)
        for got in (classify(kernels, texts), [classify(kernels, [t])[0] for t in texts]):
            for g, ref in zip(got, reference, strict=True):
                assert g["label"] == ref["label"]
                assert max(abs(g["scores"][lab] - p) for lab, p in ref["scores"].items()) <= 1e-5
    finally:
        assert [s.stop() for s in (kernels, plain)] == [0, 0]


SHAPED = """
import sys
from service.modeling import invariant
from service.modeling.head import RoutingHead
from service.serving.core.work import Task
from service.serving.engine.engine import Engine

plain = Engine.load(sys.argv[1], device="cpu")
engine = Engine.load(sys.argv[1], device="cpu", batch_invariance="kernels")
engine.use_buckets("eager", lengths=[3, 4, 6, 9, 14], budget=64, max_texts=8, count=3)  # padded shapes
texts = ["the first text", "a second, somewhat longer text. It has two sentences!", "x", "one more"]
reference = plain.run([Task(t) for t in texts])
products = []
scores_packed = RoutingHead.scores_packed
RoutingHead.scores_packed = lambda *a: products.append(a[-1]) or scores_packed(*a)  # what each head call takes
for got in (engine.run([Task(t) for t in texts]), [engine.run([Task(t)])[0] for t in texts]):
    for g, ref in zip(got, reference, strict=True):
        assert max(abs(p - ref.scores[label]) for label, p in g.scores.items()) <= 1e-5
assert engine.bucket_stats.bucketed == 5 and products == [invariant.PRODUCTS] * 5, (engine.bucket_stats, products)
print("ok")
"""


def test_in_shape_buckets_the_heads_compute_with_the_kernels_products(tiny_repo: Path) -> None:
    """Batches padded to shape buckets (filler sequences around the texts, the heads on their slots' parameters;
    eager here, captured on a GPU): with ``kernels`` (interpreted here) every head call takes the kernels' products,
    and answers as without them within 1e-5, alone and together."""
    pytest.importorskip("triton")
    from tests.modeling.test_invariant import interpreted

    assert interpreted(SHAPED, str(tiny_repo / "tiny")).strip().endswith("ok")
