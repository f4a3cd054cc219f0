"""Products computed the same way for a token or a text whatever else is in its batch: the encoder's linear layers
through one Triton kernel (:func:`linear`), its attention through one kernel (:func:`attention`), and the heads'
products through two grouped ones (:func:`inner`, :func:`rows`; :data:`PRODUCTS`).

cuBLAS picks a kernel by the product's shape: the tokens of a text alone (a few dozen rows) and the same tokens among
16,000 go through different tilings, some splitting the sum over input features (split-K) and adding the parts in
bfloat16. Each order rounds differently, so a text's hidden states, and its probabilities, move with its batch (on
an H200 by up to 0.004 in bfloat16, enough to flip the label of a near tie). Here one Triton kernel with one tiling
for every shape: each output element is the sum over its input features in chunks of ``BLOCK_K``, in the same order,
accumulated in float32 and rounded once, whatever the number of rows (the rows of a product never share a sum).
The heads' grouped products (each text's inputs contracted, each input times its text's matrix) take the same way:
one tiling, a text's sums in the same chunks from its own first input, whatever else the stream holds. With
attention through one kernel whatever the shapes (:func:`attention`), and every other step of the encoder and the
heads computed row by row, a text's scores are the same to the bit alone and in any batch (``routing-service bench
gpu``'s ``invariance`` section measures how far each setting moves a text, and what it costs).

Indices: ``T`` rows (tokens), ``i`` input features, ``o`` output features; in the grouped products ``I`` or ``R``
rows of a stream in runs (``G`` groups: texts, or head slots), ``m``, ``n``, ``k`` a product's sizes.

Triton compiles for CUDA devices; with ``TRITON_INTERPRET=1`` set before this module is imported it interprets the
kernel on CPU tensors (slowly: what the tests use on a machine without a GPU).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from service.routing.segments import Products

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


GROUPED_BLOCKS = 64, 64, 32
"""The grouped products' one tiling (``m`` or rows, ``n``, and the summed axis per step): the heads' sizes are
multiples of 64 (64 hidden vectors, 384 features)."""

_grouped: Any = None  # the grouped kernels (inner, rows), built on first use


def _compiled_grouped() -> Any:
    """``(inner_kernel, rows_kernel)``, defined on first use."""
    global _grouped
    if _grouped is not None:
        return _grouped
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["G"])
    def inner_kernel(a_ptr, b_ptr, ends_ptr, y_ptr, G, m, n, sa_i, sa_m, sb_i, sb_n, sy_g, sy_m, sy_n,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     WIDEN: tl.constexpr):
        # program: group g's block (pm, pn) of a_g^T @ b_g, summed over the group's rows from its first
        pid = tl.program_id(0)
        n_m, n_n = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
        g = pid // (n_m * n_n)
        pm, pn = (pid % (n_m * n_n)) // n_n, pid % n_n
        start = tl.load(ends_ptr + g - 1, mask=g > 0, other=0).to(tl.int64)
        end = tl.load(ends_ptr + g).to(tl.int64)
        mi = pm * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        ni = pn * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        kk = tl.arange(0, BLOCK_K)  # [BK] rows of a step
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [BM BN]
        for r0 in range(start, end, BLOCK_K):  # the same steps from the group's first row, wherever it lies
            r = r0 + kk  # [BK]
            at = tl.load(a_ptr + r[None, :] * sa_i + mi[:, None] * sa_m,
                         mask=(r[None, :] < end) & (mi[:, None] < m), other=0.0)  # [BM BK] a_g transposed
            bt = tl.load(b_ptr + r[:, None] * sb_i + ni[None, :] * sb_n,
                         mask=(r[:, None] < end) & (ni[None, :] < n), other=0.0)  # [BK BN]
            if WIDEN:
                at, bt = at.to(tl.float32), bt.to(tl.float32)  # [BM BK], [BK BN]
            acc = tl.dot(at, bt, acc, input_precision=PRECISION)  # [BM BN]
        tl.store(y_ptr + g * sy_g + mi[:, None] * sy_m + ni[None, :] * sy_n, acc.to(y_ptr.dtype.element_ty),
                 mask=(mi[:, None] < m) & (ni[None, :] < n))

    @triton.jit(do_not_specialize=["R"])
    def rows_kernel(a_ptr, w_ptr, group_ptr, y_ptr, R, k, n, sa_r, sa_k, sw_g, sw_k, sw_n, sy_r, sy_n,
                    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    WIDEN: tl.constexpr):
        # program: rows block pm, outputs block pn; each group among its rows computed apart, with its own matrix
        pid = tl.program_id(0)
        n_n = tl.cdiv(n, BLOCK_N)
        pm, pn = pid // n_n, pid % n_n
        t = pm * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows
        ni = pn * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        kk = tl.arange(0, BLOCK_K)  # [BK]
        own = tl.load(group_ptr + t, mask=t < R, other=-1)  # [BM] each row's group (non-decreasing)
        g_lo = tl.load(group_ptr + pm * BLOCK_M)
        g_hi = tl.load(group_ptr + tl.minimum(pm * BLOCK_M + BLOCK_M, R) - 1)
        out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [BM BN]
        for g in range(g_lo, g_hi + 1):
            mine = own == g  # [BM]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [BM BN]
            for k0 in range(0, k, BLOCK_K):  # the same steps for every row
                i = k0 + kk  # [BK]
                x = tl.load(a_ptr + t[:, None].to(tl.int64) * sa_r + i[None, :] * sa_k,
                            mask=mine[:, None] & (i[None, :] < k), other=0.0)  # [BM BK]
                w = tl.load(w_ptr + g * sw_g + i[:, None] * sw_k + ni[None, :] * sw_n,
                            mask=(i[:, None] < k) & (ni[None, :] < n), other=0.0)  # [BK BN]
                if WIDEN:
                    x, w = x.to(tl.float32), w.to(tl.float32)  # [BM BK], [BK BN]
                acc = tl.dot(x, w, acc, input_precision=PRECISION)  # [BM BN]
            out = tl.where(mine[:, None], acc, out)  # [BM BN] group g's rows: its own sums
        tl.store(y_ptr + t[:, None].to(tl.int64) * sy_r + ni[None, :] * sy_n, out.to(y_ptr.dtype.element_ty),
                 mask=(t[:, None] < R) & (ni[None, :] < n))

    _grouped = inner_kernel, rows_kernel
    return _grouped


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, i] @ weight[o, i].T + bias [o]`` -> ``[T, o]`` in ``x``'s dtype, as ``torch.nn.functional.linear``
    on 2-d inputs, each row computed in the same order whatever ``T`` is (see the module). float32 inputs
    accumulate without TF32.

    Raises:
        ValueError: a device it cannot run on (:func:`available`), or operands whose shapes, dtypes or devices
            do not match.
    """
    _check(x, weight, "linear", x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1],
           "[T, i] and [o, i]")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError("bias must be [o], of x's dtype and device")
    T, i = x.shape
    o = weight.shape[0]
    y = torch.empty(T, o, dtype=x.dtype, device=x.device)  # [T o]
    if T == 0:
        return y
    grid = (_cdiv(T, BLOCK_M) * _cdiv(o, BLOCK_N),)
    _compiled()[grid](x, weight, y if bias is None else bias, y, T, o, i, x.stride(0), x.stride(1),
                      weight.stride(0), weight.stride(1), y.stride(0), y.stride(1), HAS_BIAS=bias is not None,
                      PRECISION=_precision(x.dtype),
                      BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP=8, WIDEN=INTERPRETED,
                      num_warps=8, num_stages=3)
    return y


def inner(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``[G, m, n]``: for each group ``g`` of rows (ending at ``ends [G]``, int32, cumulative; a group may be empty),
    ``a_g^T @ b_g`` (``a [I, m]``, ``b [I, n]``, one dtype), each group's sums in the same steps from its own first
    row whatever lies around it, in float32, rounded once to the operands' dtype. What
    :func:`service.routing.segments.contract` computes with torch's grouped product.

    Raises:
        ValueError: as :func:`linear`.
    """
    _check(a, b, "inner", a.dim() == 2 and b.dim() == 2 and a.shape[0] == b.shape[0], "[I, m] and [I, n]")
    G, (m, n) = ends.shape[0], (a.shape[1], b.shape[1])
    y = torch.empty(G, m, n, dtype=a.dtype, device=a.device)  # [G m n]
    if G == 0 or m == 0 or n == 0:
        return y
    bm, bn, bk = GROUPED_BLOCKS
    grid = (G * _cdiv(m, bm) * _cdiv(n, bn),)
    _compiled_grouped()[0][grid](a, b, ends, y, G, m, n, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                 y.stride(0), y.stride(1), y.stride(2), PRECISION=_precision(a.dtype),
                                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, WIDEN=INTERPRETED, num_warps=4, num_stages=3)
    return y


def rows(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``[R, n]``: each row of ``a [R, k]`` times its group's matrix of ``w [G, k, n]``, the rows in runs by group
    ending at ``ends [G]`` (int32, cumulative), each row's sums in the same steps whatever rows and groups lie around
    it, in float32, rounded once to the operands' dtype. What :func:`service.routing.segments.per_sample` and
    :func:`~service.routing.segments.by_slot` compute with torch's grouped product.

    Raises:
        ValueError: as :func:`linear`.
    """
    _check(a, w, "rows", a.dim() == 2 and w.dim() == 3 and a.shape[1] == w.shape[1], "[R, k] and [G, k, n]")
    R, k, n = a.shape[0], a.shape[1], w.shape[2]
    y = torch.empty(R, n, dtype=a.dtype, device=a.device)  # [R n]
    if R == 0 or n == 0:
        return y
    at = torch.arange(R, dtype=ends.dtype, device=a.device)  # [R]
    group = torch.searchsorted(ends, at, right=True).clamp_(max=w.shape[0] - 1)  # [R] each row's group
    bm, bn, bk = GROUPED_BLOCKS
    grid = (_cdiv(R, bm) * _cdiv(n, bn),)
    _compiled_grouped()[1][grid](a, w, group, y, R, k, n, a.stride(0), a.stride(1), w.stride(0), w.stride(1),
                                 w.stride(2), y.stride(0), y.stride(1), PRECISION=_precision(a.dtype),
                                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, WIDEN=INTERPRETED, num_warps=4, num_stages=3)
    return y


def _check(a: torch.Tensor, b: torch.Tensor, name: str, shapes: bool, expected: str) -> None:
    """Refuses what a kernel cannot take: a device (:func:`available`), operands of the wrong shapes
    (``shapes`` False), or of different dtypes or devices."""
    why = available(a.device)
    if why is not None:
        raise ValueError(why)
    if not shapes:
        raise ValueError(f"{name} of {tuple(a.shape)} and {tuple(b.shape)}: {expected}")
    if a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"{name}: operands of one dtype and device, got {a.dtype} and {b.dtype}")


def _precision(dtype: torch.dtype) -> str | None:
    """The kernels' ``input_precision``: float32 operands multiplied as float32 (no TF32), as in the interpreter."""
    return "ieee" if dtype == torch.float32 or INTERPRETED else None


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


PRODUCTS = Products(inner=inner, rows=rows)
"""The heads' grouped products through these kernels (see :class:`service.routing.segments.Products`)."""


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)
