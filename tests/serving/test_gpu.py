"""Checks that need a CUDA device: ``routing-service bench gpu`` runs them on a GPU (``pytest -m gpu``); without
one they are skipped, and CI has none. What they hold there is what the CPU tests hold here: the packed stream
gives the Hugging Face module's states, a text's answer does not depend on its batch, credit stays complete."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from service.modeling.backbone import Backbone
from service.modeling.encoder import pack
from service.serving.core.work import CreditSpec, Task
from service.serving.engine.engine import Engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench gpu runs it)")]
TEXTS = ["short text", "a medium sized sentence, with a comma; and more words than the first",
         "The routing head reads every layer. " * 30, "x"]


def test_the_stream_on_the_gpu_gives_the_hugging_face_modules_states(tiny_backbone_dir: Path) -> None:
    bb = Backbone(str(tiny_backbone_dir), max_length=16, device="cuda")
    assert bb.stream is not None
    chunks = [[101] + [2000 + k] * n + [102] for k, n in enumerate([1, 12, 2, 13, 3, 14])]
    lengths = np.array([len(c) for c in chunks])
    flat = bb.stream(pack(np.concatenate(chunks), lengths, bb.device))  # [T e d]
    bb.stream = None
    for got, ref in zip(flat.split(lengths.tolist()), bb.run_chunks(chunks), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["contribution", "end_to_end"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_answers_on_the_gpu_match_the_cpus_and_do_not_depend_on_the_batch(tiny_repo: Path, dtype: str, method: str
                                                                          ) -> None:
    cpu = Engine.load(tiny_repo / "tiny", device="cpu")
    gpu = Engine.load(tiny_repo / "tiny", device="cuda", dtype=dtype)
    tol = 1e-4 if dtype == "float32" else 3e-2  # bfloat16 keeps 8 bits of mantissa in the encoder
    # the end-to-end split runs in the backbone's precision: complete to float32's rounding, or bfloat16's
    exact = dtype == "float32" or method == "contribution"
    spec = CreditSpec(method=method, detail="full")  # type: ignore[arg-type]
    batched = gpu.run([Task(t, credit=spec) for t in TEXTS])
    reference = cpu.run([Task(t, credit=spec) for t in TEXTS])
    for text, got, ref in zip(TEXTS, batched, reference, strict=True):
        (alone,) = gpu.run([Task(text, credit=spec)])
        for label, p in got.scores.items():
            assert abs(p - ref.scores[label]) <= tol
            assert abs(p - alone.scores[label]) <= (1e-5 if dtype == "float32" else 1e-2)
        target = got.credit.targets[0]  # credit complete: the tokens' credit plus the baseline is the logit
        bound = 1e-4 if exact else 5e-2 * (1 + abs(target.logit))
        assert abs(sum(target.tokens) + target.baseline - target.logit) <= bound


@pytest.mark.parametrize("head_dtype", ["float32", "bfloat16"])
def test_packed_heads_on_the_gpu_answer_as_the_padded_heads(tiny_repo: Path, head_dtype: str) -> None:
    """Texts without credit run their head packed where torch's grouped product serves the products' dtype (on a
    GPU, the heads' products in bfloat16: its grouped kernels), padded otherwise; either way each text's answer is
    the padded head's."""
    gpu = Engine.load(tiny_repo / "tiny", device="cuda")
    assert not gpu._packs("tiny")  # float32 heads (the default): padded
    gpu.head_dtype = head_dtype
    assert gpu._packs("tiny") == (head_dtype == "bfloat16")
    tasks = [Task(t) for t in TEXTS * 3]
    packed = gpu.run(tasks)
    gpu.packed_heads = False
    padded = gpu.run(tasks)
    tol = 1e-5 if head_dtype == "float32" else 1e-2
    for got, ref in zip(packed, padded, strict=True):
        assert max(abs(p - ref.scores[k]) for k, p in got.scores.items()) <= tol


def test_captured_buckets_answer_as_the_eager_engine(tiny_repo: Path, tiny_backbone_dir: Path, tmp_path: Path
                                                     ) -> None:
    """Plain batches replayed from CUDA graphs (``use_buckets("cuda")``) answer what the eager engine answers, alone
    (on the graphs for one head) and mixed, two batches in flight too; a head loaded after the capture answers as
    the eager engine does, and as the same head loaded at the start and captured with the other (within 1e-5)."""
    from tests.conftest import write_tiny_model

    write_tiny_model(tmp_path, tiny_backbone_dir, name="late", seed=3)
    dtype = "bfloat16"
    eager = Engine.load([tiny_repo / "tiny", tmp_path / "late"], device="cuda", dtype=dtype)
    eager.head_dtype = "bfloat16"  # as captured buckets compute the heads' products
    short = ["short text", "x", "one two three four", "a b"]  # one chunk each for the tiny model: plain batches
    tasks = [Task(t, model=m) for t in short for m in ("tiny", "late")]
    want = eager.run(tasks)
    engine = Engine.load(tiny_repo / "tiny", device="cuda", dtype=dtype)
    assert engine.head_dtype == "float32"
    stats = engine.use_buckets("cuda", lengths=[3, 5, 9, 14, 16])
    assert engine.head_dtype == "bfloat16"  # float32 grouped products are not capturable
    assert stats is not None and stats.failed == {} and stats.buckets > 0
    engine.add_heads([tmp_path / "late"], ["late"])  # after the capture: a free slot, nothing captured again
    tol = 1e-2  # bfloat16's rounding: products of another size
    for got, ref in zip(engine.run(tasks), want, strict=True):
        assert max(abs(p - ref.scores[k]) for k, p in got.scores.items()) <= tol
    for task, ref in zip(tasks, want, strict=True):
        (alone,) = engine.run([task])
        assert max(abs(p - ref.scores[k]) for k, p in alone.scores.items()) <= tol
    piped = [r for batch in engine.run_pipelined([tasks[:3], tasks[3:]]) for r in batch]
    for got, ref in zip(piped, want, strict=True):
        assert max(abs(p - ref.scores[k]) for k, p in got.scores.items()) <= tol
    stats = engine.bucket_stats  # every batch above in a bucket (one, then each alone, then two), each replayed
    assert stats.bucketed == 1 + len(tasks) + 2 and stats.replayed == stats.bucketed and stats.unfit == 0
    assert stats.one_head == len(tasks)  # those alone, on the graphs for one head (the others mix the two)
    # the same two heads loaded at the start, then captured: the late head answers the same (its slot's weights
    # read by index from the same stacked parameters, the same graphs)
    at_start = Engine.load([tiny_repo / "tiny", tmp_path / "late"], device="cuda", dtype=dtype)
    at_start.use_buckets("cuda", lengths=[3, 5, 9, 14, 16])
    assert at_start._buckets.slots.slot_of == engine._buckets.slots.slot_of == {"tiny": 0, "late": 1}
    late = [t for t in tasks if t.model == "late"]  # and alone, the late head picked out of its slot
    for batch in (tasks, late):
        for got, ref in zip(engine.run(batch), at_start.run(batch), strict=True):
            assert max(abs(p - ref.scores[k]) for k, p in got.scores.items()) <= 1e-5
    assert at_start.bucket_stats.replayed == 2 and at_start.bucket_stats.one_head == 1


def test_a_process_with_two_batches_in_flight_answers_as_with_one(tiny_repo: Path) -> None:
    """A backbone's process in captured buckets holding two batches at once (the next replayed before the one ahead
    of it is read, ``batches_in_flight=2``, a GPU's default) answers every batch as a process holding one."""
    from concurrent.futures import ThreadPoolExecutor

    from service.serving.engine.pipe import BucketPlan
    from service.serving.engine.process import BackboneProcess

    texts = [f"text {k} " + "word " * (k % 9) for k in range(48)]
    plan = BucketPlan("cuda", 64, 2048)
    one = BackboneProcess(tiny_repo / "tiny", device="cuda", dtype="bfloat16", buckets=plan)
    two = BackboneProcess(tiny_repo / "tiny", device="cuda", dtype="bfloat16", buckets=plan, in_flight=2)
    try:
        batches = [[w for plan_ in one.plan([Task(t) for t in texts[k:k + 4]]) for w in plan_]
                   for k in range(0, len(texts), 4)]
        want = [one.run_chunks(b) for b in batches]

        def run(parity: int) -> list[tuple[int, list]]:
            return [(k, two.runners[parity](b)) for k, b in enumerate(batches) if k % 2 == parity]

        with ThreadPoolExecutor(2) as pool:
            got = dict(r for rs in pool.map(run, [0, 1]) for r in rs)
        for k, answers in enumerate(want):
            for a, b in zip(answers, got[k], strict=True):
                assert a is not None and b is not None and a[0].label == b[0].label
                assert max(abs(p - b[0].scores[c]) for c, p in a[0].scores.items()) <= 1e-6, k
    finally:
        one.close()
        two.close()


def test_the_batch_invariant_kernel_on_the_gpu_keeps_each_row_whatever_the_batch() -> None:
    """The kernel (service.modeling.invariant), compiled for the card: within bfloat16's rounding of F.linear on
    fresh random operands, every element written, and each row alone equal to the bit to the same row among 16,384
    (which cuBLAS computes in other kernels)."""
    from torch.nn import functional as F

    from service.modeling import invariant

    g = torch.Generator(device="cuda").manual_seed(0)
    for T, i, o in [(16384, 384, 1152), (37, 1536, 384), (1, 384, 384)]:
        x = torch.randn(T, i, device="cuda", generator=g).bfloat16()  # [T i]
        w = (torch.randn(o, i, device="cuda", generator=g) / i**0.5).bfloat16()  # [o i]
        b = torch.randn(o, device="cuda", generator=g).bfloat16()  # [o]
        y = invariant.linear(x, w, b)  # [T o]
        ref = F.linear(x.double(), w.double(), b.double())  # [T o]
        assert torch.isfinite(y).all()
        assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2
        for k in (0, T // 2, T - 1):
            assert torch.equal(invariant.linear(x[k : k + 1], w, b)[0], y[k])
        assert torch.equal(invariant.linear(x[: min(T, 300)], w, b), y[: min(T, 300)])


def test_the_grouped_kernels_on_the_gpu_keep_each_text_whatever_the_batch() -> None:
    """The heads' grouped products (service.modeling.invariant's inner and rows), compiled for the card: within
    bfloat16's rounding of float64's, and a group of rows alone equal to the bit to the same group among 500 others
    at another offset."""
    from service.modeling import invariant

    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.randint(4, 400, (500,), device="cuda", generator=g)  # [G] rows of each group (texts x depths)
    ends = counts.cumsum(0).to(torch.int32)  # [G]
    total = int(ends[-1])
    a = torch.randn(total, 64, device="cuda", generator=g).bfloat16()  # [I m]
    b = torch.randn(total, 384, device="cuda", generator=g).bfloat16()  # [I n]
    w = (torch.randn(500, 384, 64, device="cuda", generator=g) / 384**0.5).bfloat16()  # [G n m]
    inner, rows = invariant.inner(a, b, ends), invariant.rows(b, w, ends)  # [G m n], [I m]
    k = 321
    s, e = int(ends[k - 1]), int(ends[k])
    ref_inner = a[s:e].double().T @ b[s:e].double()  # [m n]
    assert ((inner[k].double() - ref_inner).norm() / ref_inner.norm()).item() < 1e-2
    ref_rows = b[s:e].double() @ w[k].double()  # [rows m]
    assert ((rows[s:e].double() - ref_rows).norm() / ref_rows.norm()).item() < 1e-2
    one = torch.tensor([e - s], dtype=torch.int32, device="cuda")
    assert torch.equal(invariant.inner(a[s:e], b[s:e], one)[0], inner[k])
    assert torch.equal(invariant.rows(b[s:e], w[k : k + 1], one), rows[s:e])


def test_an_engine_with_batch_invariant_kernels_answers_as_without_and_a_text_alone_as_in_a_batch(
        tiny_repo: Path) -> None:
    plain = Engine.load(tiny_repo / "tiny", device="cuda", dtype="bfloat16")
    kernels = Engine.load(tiny_repo / "tiny", device="cuda", dtype="bfloat16", batch_invariance="kernels")
    assert kernels.batch_invariance == "kernels"
    # the encoder's states of a sequence alone and among others agree to the bit
    chunks = [[101] + [2000 + k] * n + [102] for k, n in enumerate([1, 12, 2, 13, 3, 14])]
    together = kernels.backbone.run_chunks(chunks)  # per chunk [L e d]
    assert all(torch.equal(kernels.backbone.run_chunks([c])[0], s) for c, s in zip(chunks, together, strict=True))
    # and a text's scores, alone and in a batch, to the bit: eagerly, then in captured shape buckets (the heads'
    # products through the grouped kernels there too)
    reference = plain.run([Task(t) for t in TEXTS])
    for captured in (False, True):
        if captured:
            kernels.use_buckets("cuda", lengths=[2, 3, 14, 15, 16])
        batched = kernels.run([Task(t) for t in TEXTS])
        for text, got, ref in zip(TEXTS, batched, reference, strict=True):
            (alone,) = kernels.run([Task(text)])
            assert all(abs(p - ref.scores[label]) <= 1e-2 for label, p in got.scores.items())  # bfloat16 apart
            assert alone.scores == got.scores, (captured, text)
    assert kernels.bucket_stats is not None and kernels.bucket_stats.replayed > 0
