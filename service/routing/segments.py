"""Samples of different lengths routed back to back, without padding (no serving code here).

A batch of variable-length samples is one stream of input vectors ``[I, d]``: sample ``b``'s ``n_b`` inputs
follow sample ``b - 1``'s. What the routing contracts over each sample's inputs (``phi`` against the inputs, the
inputs against the sample's predictions) is a grouped matrix product over the stream's segments, one call for
every sample; what it computes per input (activations, ``beta``, the D- and E-steps) is the padded routing's on
fewer rows. Padding a batch to its longest sample wastes a third of the work on short texts of mixed lengths, and
cutting it into length groups costs a call of every operation per group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

MAX_GROUPS = 1023  # groups one grouped product takes on a GPU (its CUDA kernels: fewer than 1024)


@dataclass(frozen=True)
class Segments:
    """Where each sample's inputs lie in a stream of ``I`` input vectors.

    Attributes:
        ends: int32 ``[B]`` each sample's end in the stream (exclusive, cumulative; the grouped product's ``offs``).
        index: int64 ``[I]`` each input's sample.
        n: ``[B]`` each sample's inputs, as the routing's float dtype (a sample of none, a shape bucket's filler, has
            outputs that are not numbers, and leaves every other sample's as they are).
        width: where every sample has the same number of inputs, that number (then the contractions below are
            batched products over ``[B, width, ...]`` views, which need no grouped kernel); else None.
    """

    ends: torch.Tensor
    index: torch.Tensor
    n: torch.Tensor
    width: int | None = None

    @classmethod
    def of(cls, counts: torch.Tensor, total: int, dtype: torch.dtype) -> Segments:
        """The segments of samples with ``counts [B]`` inputs each (int64, on the stream's device; see ``n`` for a
        count of 0), ``total`` of them in all (given, so that nothing is read back from the device)."""
        B = counts.shape[0]
        ends = counts.cumsum(0).to(torch.int32)  # [B]
        index = torch.repeat_interleave(torch.arange(B, device=counts.device), counts, output_size=total)  # [I]
        return cls(ends=ends, index=index, n=counts.to(dtype))

    @classmethod
    def fixed(cls, B: int, width: int, dtype: torch.dtype, device: torch.device) -> Segments:
        """The segments of ``B`` samples of ``width`` inputs each."""
        counts = torch.full((B,), width, dtype=torch.int64, device=device)  # [B]
        return cls(ends=(counts.cumsum(0)).to(torch.int32),
                   index=torch.arange(B, device=device).repeat_interleave(width), n=counts.to(dtype), width=width)

    @property
    def samples(self) -> int:
        return self.ends.shape[0]


@dataclass(frozen=True)
class Products:
    """Matrix products a packed routing can take from elsewhere in place of torch's (None where it takes torch's:
    cuBLAS's, the grouped kernels'), each on operands of one dtype, computing in float32 and rounding once to it:
    ``service.modeling.invariant``'s compute each row, or each group, the same way whatever else the stream holds.

    Attributes:
        inner: ``(a [I, m], b [I, n], ends [G]) -> [G, m, n]``: each group's rows (ending at ``ends``, int32,
            cumulative) contracted, as :func:`contract`.
        rows: ``(a [R, k], w [G, k, n], ends [G]) -> [R, n]``: each row times its group's matrix, as
            :func:`per_sample`.
    """

    inner: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    rows: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The grouped product of ``a`` and ``b`` in groups ending at ``offs``; under ``torch.autocast`` in its dtype, as
    autocast runs every other matrix product (it leaves the grouped one out: on a GPU, float32 operands would take a
    product per group, reading ``offs`` back to the host, which a CUDA graph cannot capture). Torch's public function
    where it has one, else the operator underneath it (an older torch)."""
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if grouped is None:
        raise RuntimeError(f"torch {torch.__version__} has no grouped matrix product")
    dtype = product_dtype(a)
    a, b = a.to(dtype), b.to(dtype)  # each keeps its strides (a transposed view stays one)
    if offs.shape[0] <= MAX_GROUPS:
        return grouped(a, b, offs=offs)
    return _in_parts(grouped, a, b, offs)


def _in_parts(grouped: Callable[..., torch.Tensor], a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor
              ) -> torch.Tensor:
    """The grouped product of more groups than one call takes, in calls of at most :data:`MAX_GROUPS` groups: each
    call's groups are ``G_part`` of the ``G``, behind one more that covers the rows (or, for ``[m, I] @ [I, n]``, the
    inputs) before them, as a grouped product's first group starts at 0. Nothing is read back from the device (the
    parts are the same for every batch of ``G`` groups: a CUDA graph captures them).

    ``a [m, I] @ b [I, n]`` (groups over the inputs) -> ``[G, m, n]``, the parts' products concatenated;
    ``a [R, k] @ b [G, k, n]`` (groups over the rows) -> ``[R, n]``, each row taken from the part holding its group
    (what a part writes elsewhere is not read).
    """
    G, step = offs.shape[0], MAX_GROUPS - 1
    starts = range(0, G, step)
    if b.dim() == 2:  # groups over the inputs
        parts = [grouped(a, b, offs=offs[max(s - 1, 0):s + step]) for s in starts]  # each [g+1 m n], [g m n] first
        return torch.cat([parts[0], *(p[1:] for p in parts[1:])])  # [Gmn]
    rows = torch.arange(a.shape[0], device=a.device)  # [R]
    out = grouped(a, b[:step], offs=offs[:step])  # [Rn] right on rows before offs[step - 1]
    for s in starts[1:]:
        part = grouped(a, b[s - 1:s + step], offs=offs[s - 1:s + step])  # [Rn] right on its groups' rows
        ours = (rows >= offs[s - 1]) & (rows < offs[min(s + step, G) - 1])  # [R]
        out = torch.where(ours.unsqueeze(1), part, out)  # [Rn]
    return out


def product_dtype(a: torch.Tensor) -> torch.dtype:
    """The dtype a matrix product of ``a`` runs in: autocast's where it is on for ``a``'s device, else ``a``'s (an
    operand cast to it once is what every product under autocast would cast it to, bit for bit)."""
    device = a.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else a.dtype


def contract(a: torch.Tensor, b: torch.Tensor, segments: Segments, products: Products | None = None
             ) -> torch.Tensor:
    """``[B, m, n]``: for each sample ``b``, ``a_b^T @ b_b`` over its inputs (``a [I, m]``, ``b [I, n]``), in one
    grouped call (``products``: see :class:`Products`).

    Raises:
        RuntimeError: the grouped product does not run here (this torch, device or dtype, or rows not aligned to 16
            bytes); callers then pad.
    """
    if products is not None:
        dtype = product_dtype(a)
        return products.inner(a.to(dtype), b.to(dtype), segments.ends)  # [Bmn]
    if segments.width is not None:
        w, dtype = segments.width, product_dtype(a)  # operands cast as the product would (one may be already)
        return torch.einsum("bim,bin->bmn", a.to(dtype).view(-1, w, a.shape[-1]),
                            b.to(dtype).view(-1, w, b.shape[-1]))  # [Bmn]
    return _grouped_mm(a.transpose(0, 1), b, segments.ends)  # [Bmn]


def per_sample(a: torch.Tensor, m: torch.Tensor, segments: Segments, products: Products | None = None
               ) -> torch.Tensor:
    """``[I, n]``: each input of ``a [I, k]`` times its sample's matrix of ``m [B, k, n]``, in one grouped call
    (``products``: see :class:`Products`).

    Raises:
        RuntimeError: as :func:`contract`.
    """
    if products is not None:
        return by_slot(a, m, segments.ends, products)  # [In]
    if segments.width is not None:
        dtype = product_dtype(a)  # operands cast as the product would (one may be already)
        return torch.bmm(a.to(dtype).view(-1, segments.width, a.shape[-1]), m.to(dtype)).flatten(0, 1)  # [In]
    return _grouped_mm(a, m, segments.ends)  # [In]


def sum_by_sample(a: torch.Tensor, segments: Segments, products: Products | None = None) -> torch.Tensor:
    """``[B, ...]``: the sum of ``a [I, ...]`` over each sample's inputs (with ``products``, ``a [I, m]`` contracted
    against ones, each sample's sum in the same order whatever the batch, where ``index_add_`` adds in any order on
    a GPU)."""
    if products is not None:
        ones = a.new_ones(1, 16).expand(a.shape[0], 16)  # [I 16] (a product's least width)
        return products.inner(a, ones, segments.ends)[..., 0]  # [Bm]
    if segments.width is not None:
        return a.view(-1, segments.width, *a.shape[1:]).sum(dim=1)  # [B...]
    return a.new_zeros(segments.samples, *a.shape[1:]).index_add_(0, segments.index, a)  # [B...]


def sum_of_rows(a: torch.Tensor, products: Products | None = None) -> torch.Tensor:
    """``[I]``: each row of ``a [I, k]`` summed (with ``products``, as a product with ones: in the same order
    whatever the number of rows, where a reduction's kernel may split rows otherwise when they are few)."""
    if products is None:
        return a.sum(dim=-1)  # [I]
    ones = a.new_ones(1, 1, 1).expand(1, a.shape[1], 16)  # [1 k 16] (a product's least width; nothing allocated)
    every = torch.full((1,), a.shape[0], dtype=torch.int32, device=a.device)  # [1] one group: every row
    return products.rows(a, ones, every)[:, 0]  # [I]


@dataclass(frozen=True)
class Slots:
    """Which of a stacked routing's parameter slots each sample of a stream routes with, the samples sorted by slot
    (so that every slot's inputs, and its samples, lie in one run: a product with a slot's weights is one group of a
    grouped product, and no weight is copied per sample).

    Attributes:
        slot: int64 ``[B]`` each sample's slot (non-decreasing).
        input_ends: int32 ``[S]`` where each slot's inputs end in the stream (exclusive, cumulative; empty slots too).
        sample_ends: int32 ``[S]`` where each slot's samples end among the ``B``.
    """

    slot: torch.Tensor
    input_ends: torch.Tensor
    sample_ends: torch.Tensor

    @classmethod
    def of(cls, slot: torch.Tensor, counts: torch.Tensor, n_slots: int) -> Slots:
        """The slots of samples sorted by ``slot [B]`` (int64), with ``counts [B]`` inputs each, among ``n_slots``."""
        per_slot = torch.zeros(n_slots, dtype=torch.int64, device=slot.device)  # [S]
        inputs = per_slot.index_add(0, slot, counts)  # [S]
        samples = per_slot.index_add(0, slot, torch.ones_like(slot))  # [S]
        return cls(slot=slot, input_ends=inputs.cumsum(0).to(torch.int32),
                   sample_ends=samples.cumsum(0).to(torch.int32))


def by_slot(a: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor, products: Products | None = None
            ) -> torch.Tensor:
    """``[R, n]``: each row of ``a [R, k]`` times its slot's matrix of ``weights [S, k, n]``, the rows in runs by slot
    ending at ``ends [S]`` (a :class:`Slots`' ``input_ends``, or its ``sample_ends`` scaled to rows), in one grouped
    call (``products``: see :class:`Products`).

    Raises:
        RuntimeError: as :func:`contract`.
    """
    if products is not None:
        dtype = product_dtype(a)
        return products.rows(a.to(dtype), weights.to(dtype), ends)  # [Rn]
    return _grouped_mm(a, weights, ends)  # [Rn]


def times_slot(y: torch.Tensor, weights: torch.Tensor, slots: Slots, rows: torch.Tensor,
               products: Products | None = None) -> torch.Tensor:
    """``[B, j, n]``: each sample's ``y [B, j, k]`` times its slot's matrix of ``weights [S, k, n]``: one grouped
    product over the samples' rows by slot (``rows [S]``: where each slot's rows of ``y`` flattened end), where the
    grouped kernels take the operands (rows of 16 bytes' multiples; ``products``' take any); else each sample's
    matrix gathered (small ones: a routing to one feature)."""
    size = product_dtype(weights).itemsize
    if products is not None or ((weights.shape[-1] * size) % 16 == 0 and (weights.shape[-2] * size) % 16 == 0):
        return by_slot(y.flatten(0, 1), weights, rows, products).view(*y.shape[:2], -1)  # [Bjn]
    return torch.bmm(y, weights[slots.slot])  # [Bjn]
