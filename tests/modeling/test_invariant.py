"""The batch-invariant linear layer (:mod:`service.modeling.invariant`): Triton's kernel, run here by its interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported: in a process of its own), answers as ``F.linear`` does, and
each row alone as within a larger batch, to the bit; the packed encoder through it answers as through ``F.linear``.
On a CUDA device the same kernel is compiled (``bench gpu``'s ``invariance`` section measures it there)."""

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


def interpreted(script: str, *args: str) -> str:
    """``script``'s stdout, run by Python with Triton's interpreter on; fails the test with its stderr."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300)
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


def test_it_says_why_it_cannot_run_on_a_cpu_without_the_interpreter() -> None:
    if invariant.INTERPRETED:
        pytest.skip("this process interprets Triton's kernels")
    why = invariant.available(torch.device("cpu"))
    assert why is not None and "CUDA" in why and "TRITON_INTERPRET" in why
    with pytest.raises(ValueError, match="CUDA"):
        invariant.linear(torch.randn(2, 4), torch.randn(3, 4))
