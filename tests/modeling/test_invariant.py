"""The batch-invariant products (:mod:`service.modeling.invariant`): Triton's kernels, run here by its interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported: in a process of its own), answer as torch's products do, and
each row (or group) alone as within a larger batch, to the bit; the packed encoder through them answers as through
``F.linear``, and a head's packed scores through them as through torch's.
On a CUDA device the same kernels are compiled (``bench gpu``'s ``invariance`` section measures them there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.modeling import invariant

pytest.importorskip("triton")  # (the test extra installs it)

ROOT = Path(__file__).resolve().parents[2]


FIXED_ORDER_DOT = """
import types

import numpy
import triton.runtime.interpreter

# The interpreter computes tl.dot with numpy's matmul, which some OpenBLAS builds sum in an order that depends on a
# row's place in the tile (numpy 2.4.6 with OpenBLAS 0.3.31 on this AMD EPYC: 34 of 64 rows of a 64x32 by 32x64
# product differ alone from within it), where a GPU's compiled kernel sums each element in one order wherever it
# is. einsum's own loops (no BLAS) do too: the interpreter's numpy, but for that.
fixed = types.ModuleType("numpy_fixed_order")
fixed.__dict__.update(numpy.__dict__)
fixed.matmul = lambda a, b, dtype=None: numpy.einsum("...ik,...kj->...ij", a, b, dtype=dtype, optimize=False)
triton.runtime.interpreter.np = fixed
"""


def interpreted(script: str, *args: str) -> str:
    """``script``'s stdout, run by Python with Triton's interpreter on (its products summed in one order, as compiled:
    see :data:`FIXED_ORDER_DOT`); fails the test with its stderr."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", FIXED_ORDER_DOT + script, *args], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


LINEAR = """
import torch
from torch.nn import functional as F
from service.modeling import invariant

assert invariant.INTERPRETED and invariant.available(torch.device("cpu")) is None
torch.manual_seed(0)
# rows, inputs and outputs within one tile, across several, and not multiples of any
for T, i, o in [(1, 8, 3), (37, 100, 130), (300, 130, 260)]:
    x, w, b = torch.randn(T, i), torch.randn(o, i), torch.randn(o)  # [T i], [o i], [o]
    y = invariant.linear(x, w, b)  # [T o]
    assert y.shape == (T, o) and y.dtype == torch.float32
    # (sums of up to 130 products of a few units: float32 orders part by up to a few 1e-5)
    assert torch.allclose(y, F.linear(x, w, b), atol=1e-4, rtol=1e-5), (T, (y - F.linear(x, w, b)).abs().max())
    assert torch.allclose(invariant.linear(x, w), x @ w.T, atol=1e-4, rtol=1e-5)  # no bias
    # each row alone, and the rows at another offset within a batch of their own, to the bit
    assert all(torch.equal(invariant.linear(x[k : k + 1], w, b)[0], y[k]) for k in (0, T // 2, T - 1))
    assert torch.equal(invariant.linear(x[T // 3 :], w, b), y[T // 3 :])
    # bfloat16: float32 sums of the products, rounded once: as the float32 product of the same operands, rounded
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    yb = invariant.linear(xb, wb, bb)  # [T o]
    ref = F.linear(xb.float(), wb.float(), bb.float())  # [T o]
    assert yb.dtype == torch.bfloat16
    assert torch.allclose(yb.float(), ref, rtol=2 ** -7, atol=1e-2), (yb.float() - ref).abs().max()
    assert all(torch.equal(invariant.linear(xb[k : k + 1], wb, bb)[0], yb[k]) for k in (0, T - 1))
# a strided input (a column slice) and no rows at all
x, w = torch.randn(20, 16), torch.randn(5, 8)
assert torch.allclose(invariant.linear(x[:, ::2], w), x[:, ::2] @ w.T, atol=1e-5)
assert invariant.linear(torch.randn(0, 8), w).shape == (0, 5)
for bad in [(torch.randn(4, 7), w), (torch.randn(4, 8), w.double()), (torch.randn(2, 4, 8), w)]:
    try:
        invariant.linear(*bad)
    except ValueError as e:
        print("refused:", e)
    else:
        raise AssertionError(f"took {[tuple(t.shape) for t in bad]}")
"""


def test_the_kernel_answers_as_f_linear_and_each_row_as_alone() -> None:
    out = interpreted(LINEAR)
    assert out.count("refused:") == 3, out  # a shape mismatch, a dtype mismatch, a 3-d input: each a clear error


ENCODER = """
import sys
import numpy as np
import torch
from transformers import BertModel
from service.modeling import invariant
from service.modeling.encoder import PackedEncoder, pack

torch.manual_seed(0)
encoder = PackedEncoder.of(BertModel.from_pretrained(sys.argv[1]).eval())
lengths = np.array([5, 9, 3])
ids = np.random.default_rng(0).integers(100, 1000, int(lengths.sum()))
with torch.inference_mode():
    before = encoder(pack(ids, lengths, torch.device("cpu")))  # [T e d]
    encoder.use_kernels(invariant.linear, invariant.attention)
    after = encoder(pack(ids, lengths, torch.device("cpu")))  # [T e d]
    alone = encoder(pack(ids[5:14], lengths[1:2], torch.device("cpu")))  # [9 e d] the second sequence alone
    encoder.use_kernels()  # back to torch's
    again = encoder(pack(ids, lengths, torch.device("cpu")))  # [T e d]
assert torch.allclose(after, before, atol=1e-5), (after - before).abs().max()
assert torch.allclose(alone, after[5:14], atol=1e-5)
assert torch.equal(again, before)
print("ok")
"""


def test_the_packed_encoder_through_the_kernel_answers_as_through_f_linear(tiny_backbone_dir: Path) -> None:
    assert interpreted(ENCODER, str(tiny_backbone_dir)).strip() == "ok"


GROUPED = """
import torch
from service.modeling import invariant

torch.manual_seed(0)
# groups of 5, none, 35 and 63 rows: within one step of the summed axis, across several, not multiples of any
ends = torch.tensor([5, 5, 40, 103], dtype=torch.int32)
starts = [0, 5, 5, 40]
a, b, w = torch.randn(103, 20), torch.randn(103, 70), torch.randn(4, 70, 33)  # [I m], [I n], [G n o]
y = invariant.inner(a, b, ends)  # [G m n]
ref = torch.stack([a[s:e].T @ b[s:e] for s, e in zip(starts, ends.tolist())])  # [G m n]
assert y.shape == (4, 20, 70) and torch.allclose(y, ref, atol=1e-4), (y - ref).abs().max()
assert torch.equal(y[1], torch.zeros(20, 70))  # an empty group sums nothing
# a group alone, to the bit
assert torch.equal(invariant.inner(a[40:], b[40:], torch.tensor([63], dtype=torch.int32))[0], y[3])
r = invariant.rows(b, w, ends)  # [I o]
group = torch.tensor([0] * 5 + [2] * 35 + [3] * 63)
assert torch.allclose(r, torch.einsum("rk,rko->ro", b, w[group]), atol=1e-4)
assert torch.equal(invariant.rows(b[40:], w[3:], torch.tensor([63], dtype=torch.int32)), r[40:])
assert torch.equal(invariant.rows(b[3:7], w[:1].expand(4, -1, -1), torch.tensor([1, 2, 3, 4], dtype=torch.int32)),
                   invariant.rows(b[3:7], w[:1], torch.tensor([4], dtype=torch.int32)))  # rows of one matrix: alike
# bfloat16: the float32 sums of the same operands, rounded once (within a bfloat16 step: the interpreter truncates)
ab, bb = a.bfloat16(), b.bfloat16()
yb = invariant.inner(ab, bb, ends)
refb = torch.stack([ab[s:e].float().T @ bb[s:e].float() for s, e in zip(starts, ends.tolist())])  # [G m n]
assert yb.dtype == torch.bfloat16 and torch.allclose(yb.float(), refb, rtol=2 ** -7, atol=1e-3), (yb.float() - refb)
for bad in [(a, b[1:], ends), (a, b.double(), ends)]:
    try:
        invariant.inner(*bad)
    except ValueError as e:
        print("refused:", e)
    else:
        raise AssertionError("took it")
print("ok")
"""


def test_the_grouped_kernels_answer_as_torchs_products_and_each_group_as_alone() -> None:
    out = interpreted(GROUPED)
    assert out.count("refused:") == 2 and out.strip().endswith("ok"), out


HEAD = """
import torch
from service.modeling import invariant
from service.modeling.head import HeadSlots, RoutingHead

torch.manual_seed(0)
head, other = RoutingHead(d_depth=3, d_emb=32, n_classes=3).eval(), RoutingHead(d_depth=3, d_emb=32, n_classes=3)
with torch.no_grad():
    for p in head.parameters():
        p.add_(0.1 * torch.randn_like(p))  # (biases and scales away from their initial 0 and 1)
slots = HeadSlots(head, 4)
slots.put("head", head), slots.put("other", other)
n_t = torch.tensor([5, 9, 3, 12])
hidden = torch.randn(int(n_t.sum()), 3, 32)  # [T e d]
P = invariant.PRODUCTS
with torch.inference_mode():
    for bf16 in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            got = head.scores_packed(hidden, n_t, None, P)  # [b k]
            ref = head.scores_packed(hidden, n_t)  # [b k] torch's products
            alone = head.scores_packed(hidden[5:14], n_t[1:2], None, P)  # [1 k] the second text alone
            slot = torch.tensor([0, 0, 1, 1])
            stacked = slots.head.scores_packed(hidden, n_t, slot, P)  # [b k] two heads
            stacked_alone = slots.head.scores_packed(hidden[5:14], n_t[1:2], slot[1:2], P)
        tol = 5e-2 if bf16 else 1e-5  # (bfloat16: rounded in other orders than torch's: as the engine allows)
        assert torch.allclose(got.float(), ref.float(), atol=tol), (bf16, (got - ref).abs().max())
        assert torch.allclose(stacked[2:].float(), slots.head.scores_packed(hidden, n_t, slot)[2:].float(), atol=tol)
        if not bf16:  # a text alone as in its batch, a head's texts among another's as with it alone
            # (to the bit on a GPU, tests/serving/test_gpu.py; here within float32's last bits: torch's vectorized
            # elementwise functions on a CPU compute the lanes of a vector otherwise than its tail)
            for x, y in [(alone[0], got[1]), (stacked_alone[0], stacked[1]), (stacked[:2], got[:2])]:
                assert torch.allclose(x, y, rtol=0, atol=1e-6), (x - y).abs().max()
print("ok")
"""


def test_a_heads_packed_scores_through_the_kernels_are_torchs_and_a_text_alone_is_as_in_its_batch() -> None:
    assert interpreted(HEAD).strip() == "ok"


def test_it_says_why_it_cannot_run_on_a_cpu_without_the_interpreter() -> None:
    if invariant.INTERPRETED:
        pytest.skip("this process interprets Triton's kernels")
    why = invariant.available(torch.device("cpu"))
    assert why is not None and "CUDA" in why and "TRITON_INTERPRET" in why
    with pytest.raises(ValueError, match="CUDA"):
        invariant.linear(torch.randn(2, 4), torch.randn(3, 4))
