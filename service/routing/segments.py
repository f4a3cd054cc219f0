"""Samples of different lengths routed back to back, without padding (no serving code here).

A batch of variable-length samples is one stream of input vectors ``[I, d]``: sample ``b``'s ``n_b`` inputs
follow sample ``b - 1``'s. What the routing contracts over each sample's inputs (``phi`` against the inputs, the
inputs against the sample's predictions) is a grouped matrix product over the stream's segments, one call for
every sample; what it computes per input (activations, ``beta``, the D- and E-steps) is the padded routing's on
fewer rows. Padding a batch to its longest sample wastes a third of the work on short texts of mixed lengths, and
cutting it into length groups costs a call of every operation per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segments:
    """Where each sample's inputs lie in a stream of ``I`` input vectors.

    Attributes:
        ends: int32 ``[B]`` each sample's end in the stream (exclusive, cumulative; the grouped product's ``offs``).
        index: int64 ``[I]`` each input's sample.
        n: ``[B]`` each sample's inputs, as the routing's float dtype (each at least 1).
    """

    ends: torch.Tensor
    index: torch.Tensor
    n: torch.Tensor

    @classmethod
    def of(cls, counts: torch.Tensor, total: int, dtype: torch.dtype) -> Segments:
        """The segments of samples with ``counts [B]`` inputs each (int64, on the stream's device, every count at
        least 1), ``total`` of them in all (given, so that nothing is read back from the device)."""
        B = counts.shape[0]
        ends = counts.cumsum(0).to(torch.int32)  # [B]
        index = torch.repeat_interleave(torch.arange(B, device=counts.device), counts, output_size=total)  # [I]
        return cls(ends=ends, index=index, n=counts.to(dtype))

    @property
    def samples(self) -> int:
        return self.ends.shape[0]


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, segments: Segments) -> torch.Tensor:
    grouped = getattr(torch.nn.functional, "grouped_mm", None)
    if grouped is None:
        raise RuntimeError(f"torch {torch.__version__} has no grouped matrix product")
    return grouped(a, b, offs=segments.ends)


def contract(a: torch.Tensor, b: torch.Tensor, segments: Segments) -> torch.Tensor:
    """``[B, m, n]``: for each sample ``b``, ``a_b^T @ b_b`` over its inputs (``a [I, m]``, ``b [I, n]``), in one
    grouped call.

    Raises:
        RuntimeError: the grouped product does not run here (this torch, device or dtype, or rows not aligned to 16
            bytes); callers then pad.
    """
    return _grouped_mm(a.transpose(0, 1), b, segments)  # [Bmn]


def per_sample(a: torch.Tensor, m: torch.Tensor, segments: Segments) -> torch.Tensor:
    """``[I, n]``: each input of ``a [I, k]`` times its sample's matrix of ``m [B, k, n]``, in one grouped call.

    Raises:
        RuntimeError: as :func:`contract`.
    """
    return _grouped_mm(a, m, segments)  # [In]


def sum_by_sample(a: torch.Tensor, segments: Segments) -> torch.Tensor:
    """``[B, ...]``: the sum of ``a [I, ...]`` over each sample's inputs."""
    return a.new_zeros(segments.samples, *a.shape[1:]).index_add_(0, segments.index, a)  # [B...]
