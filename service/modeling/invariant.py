"""The encoder's products computed the same way for a token whatever else is in its batch: linear layers through
one Triton kernel (:func:`linear`), attention through one kernel (:func:`attention`).

cuBLAS picks a kernel by the product's shape: the tokens of a text alone (a few dozen rows) and the same tokens among
16,000 go through different tilings, some splitting the sum over input features (split-K) and adding the parts in
bfloat16. Each order rounds differently, so a text's hidden states, and its probabilities, move with its batch (on
an H200 by up to 0.004 in bfloat16, enough to flip the label of a near tie). Here one Triton kernel with one tiling
for every shape: each output element is the sum over its input features in chunks of ``BLOCK_K``, in the same order,
accumulated in float32 and rounded once, whatever the number of rows (the rows of a product never share a sum). It
is the first of what a batch-invariant engine needs, with attention through one kernel whatever the shapes
(:func:`attention`); the heads' products are the rest (``routing-service bench gpu``'s ``invariance`` section measures
how far each moves a text).

Indices: ``T`` rows (tokens), ``i`` input features, ``o`` output features.

Triton compiles for CUDA devices; with ``TRITON_INTERPRET=1`` set before this module is imported it interprets the
kernel on CPU tensors (slowly: what the tests use on a machine without a GPU).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
"""The one tiling: rows, output features and input features per step of a program (on a Hopper card 8 warps and 3
stages keep its tensor cores fed at these sizes)."""

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton runs kernels in its interpreter, on CPU tensors (set before import)."""


def available(device: torch.device) -> str | None:
    """Why :func:`linear` cannot run on ``device`` (None: it can): Triton is not installed, or the device is neither
    CUDA nor a CPU with Triton's interpreter on."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton; torch's CUDA wheels bring it)"
    if device.type != "cuda" and not (INTERPRETED and device.type == "cpu"):
        return f"Triton's kernels run on CUDA devices, not {device.type} (TRITON_INTERPRET=1 interprets them on a CPU)"
    return None


_kernel: Any = None  # the compiled kernel (a Triton JITFunction), built on first use


def _compiled() -> Any:
    """The kernel, defined on first use (importing Triton takes a second)."""
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T"])  # one compiled kernel for every number of rows
    def linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, T, n_out, n_in,
                      sx_t, sx_i, sw_o, sw_i, sy_t, sy_o,
                      HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                      WIDEN: tl.constexpr):
        # programs in groups of GROUP row blocks, each group sweeping the output features (the weights stay in L2)
        pid = tl.program_id(0)
        n_m, n_n = tl.cdiv(T, BLOCK_M), tl.cdiv(n_out, BLOCK_N)
        group, within = pid // (GROUP * n_n), pid % (GROUP * n_n)
        first = group * GROUP
        size = tl.minimum(n_m - first, GROUP)
        pm, pn = first + within % size, within // size
        t = pm * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows
        o = pn * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
        k = tl.arange(0, BLOCK_K)  # [BK] input features of a step
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [BM BN]
        for i0 in range(0, n_in, BLOCK_K):  # the same steps, in the same order, for every row
            i = i0 + k
            x = tl.load(x_ptr + t[:, None] * sx_t + i[None, :] * sx_i,
                        mask=(t[:, None] < T) & (i[None, :] < n_in), other=0.0)  # [BM BK]
            w = tl.load(w_ptr + o[None, :] * sw_o + i[:, None] * sw_i,
                        mask=(o[None, :] < n_out) & (i[:, None] < n_in), other=0.0)  # [BK BN]
            if WIDEN:  # the interpreter's products of bfloat16 are wrong (Triton 3.9); theirs in float32 are exact
                x, w = x.to(tl.float32), w.to(tl.float32)  # [BM BK], [BK BN]
            acc = tl.dot(x, w, acc, input_precision=PRECISION)  # [BM BN]
        if HAS_BIAS:
            acc += tl.load(b_ptr + o, mask=o < n_out, other=0.0).to(tl.float32)[None, :]  # [BM BN]
        tl.store(y_ptr + t[:, None] * sy_t + o[None, :] * sy_o, acc.to(y_ptr.dtype.element_ty),
                 mask=(t[:, None] < T) & (o[None, :] < n_out))

    _kernel = linear_kernel
    return _kernel


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, i] @ weight[o, i].T + bias [o]`` -> ``[T, o]`` in ``x``'s dtype, as ``torch.nn.functional.linear``
    on 2-d inputs, each row computed in the same order whatever ``T`` is (see the module). float32 inputs
    accumulate without TF32.

    Raises:
        ValueError: a device it cannot run on (:func:`available`), or operands whose shapes, dtypes or devices
            do not match.
    """
    why = available(x.device)
    if why is not None:
        raise ValueError(why)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear of x {tuple(x.shape)} and weight {tuple(weight.shape)}: [T, i] and [o, i]")
    if weight.dtype != x.dtype or weight.device != x.device or (bias is not None and bias.shape != weight.shape[:1]):
        raise ValueError("weight and bias must match x's dtype and device, bias [o]")
    T, i = x.shape
    o = weight.shape[0]
    y = torch.empty(T, o, dtype=x.dtype, device=x.device)  # [T o]
    if T == 0:
        return y
    grid = (_cdiv(T, BLOCK_M) * _cdiv(o, BLOCK_N),)
    _compiled()[grid](x, weight, y if bias is None else bias, y, T, o, i, x.stride(0), x.stride(1),
                      weight.stride(0), weight.stride(1), y.stride(0), y.stride(1), HAS_BIAS=bias is not None,
                      PRECISION="ieee" if x.dtype == torch.float32 or INTERPRETED else None,
                      BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP=8, WIDEN=INTERPRETED,
                      num_warps=8, num_stages=3)
    return y


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None
              ) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` (``q, k, v [s, h, L, c]``, ``attn_mask`` bool or None ->
    ``[s, h, L, c]``) through one kernel whatever the shapes on a CUDA device: the memory-efficient one, which takes
    keys in blocks from the first whatever the row's length, so that masked keys past a sequence add exact zeros. Left
    to torch, a batch of equal lengths (no mask: a text alone) goes to the flash kernel and others to the
    memory-efficient one, and cuDNN's kernel (inside shape buckets) builds a plan for each shape. On a CPU torch's
    own."""
    if q.device.type != "cuda":
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # [s h L c]


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)
