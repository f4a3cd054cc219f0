"""Masking and the E/D-steps shared by the vector-routing variants.

Index letters follow the paper: ``i`` input vectors, ``j`` output vectors, ``d`` input features,
``...`` any batch shape. A mask is boolean with ``True`` meaning "input i is hidden from output j".

Beyond the reference library, an input vector masked for *every* output is treated as **absent**:
it contributes nothing, produces no NaN, and does not count in ``n`` (the number of input vectors
used for the ``1/sqrt(n)`` scaling). A zero-padded batch whose padding is masked therefore routes
each sample exactly as that sample alone would be routed (batch invariance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def check_config(n_inp: int, n_out: int, n_iters: int) -> None:
    """The constructor checks every routing variant shares."""
    if not (n_inp > 0 or n_inp == -1):
        raise ValueError(f"n_inp must be > 0 or -1 (variable), got {n_inp}")
    if n_out < 2:
        raise ValueError(f"n_out must be at least 2, got {n_out}")
    if n_iters < 1:
        raise ValueError(f"n_iters must be at least 1, got {n_iters}")


@dataclass(frozen=True)
class Mask:
    """A validated routing mask, broadcast to the batch.

    Attributes:
        keep: float ``[..., i, j]``, 1 where input i may feed output j, else 0.
        absent: bool ``[..., i]``, True for inputs masked for every output.
        n: float ``[..., 1, 1]``, number of present inputs per sample (at least 1).
    """

    keep: torch.Tensor
    absent: torch.Tensor
    n: torch.Tensor


def build_mask(mask: torch.Tensor | None, x_inp: torch.Tensor, n_out: int) -> Mask | None:
    """Check ``mask`` against ``x_inp [..., i, d]`` and return a :class:`Mask` (None if no mask).

    ``mask`` may be shared ``[i, j]`` or per sample ``[..., i, j]``; any shape that broadcasts
    against ``[..., i, j]`` is accepted.
    """
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = ignore), got {mask.dtype}")
    n_inp = x_inp.shape[-2]
    if mask.dim() < 2 or mask.shape[-2:] != (n_inp, n_out):
        raise ValueError(f"mask must end in [n_inp={n_inp}, n_out={n_out}], got {list(mask.shape)}")
    batch = torch.broadcast_shapes(mask.shape[:-2], x_inp.shape[:-2])
    mask = mask.to(x_inp.device).expand(*batch, n_inp, n_out)  # [...ij]
    keep = (~mask).to(x_inp.dtype)  # [...ij]
    absent = mask.all(dim=-1)  # [...i]
    n = (~absent).sum(dim=-1).clamp(min=1).to(x_inp.dtype)[..., None, None]  # [...11]
    return Mask(keep=keep, absent=absent, n=n)


def zero_absent(x_inp: torch.Tensor, m: Mask | None) -> torch.Tensor:
    """Zero the absent input vectors of ``x_inp [..., i, d]`` so that padding never leaks (NaN-safe)."""
    if m is None:
        return x_inp
    return x_inp.masked_fill(m.absent[..., None], 0.0)  # [...id]


def flat_prior(ones_over_n_out: torch.Tensor, m: Mask | None) -> torch.Tensor:
    """First-iteration routing probabilities: ``[j]`` without mask, ``[..., i, j]`` with one.

    With a mask, the flat prior is spread over the outputs each input may feed.
    """
    if m is None:
        return ones_over_n_out  # [j]
    return m.keep / m.keep.sum(dim=-1, keepdim=True).clamp(min=1.0)  # [...ij]


def route(S: torch.Tensor, m: Mask | None) -> torch.Tensor:
    """Routing probabilities ``R [..., i, j] = softmax_j(S)`` over the outputs each input may feed."""
    if m is None:
        return S.softmax(dim=-1)  # [...ij]
    S = S.masked_fill(m.keep == 0, torch.finfo(S.dtype).min)  # [...ij] finite: no NaN for absent rows
    return S.softmax(dim=-1) * m.keep  # [...ij]


def d_step(f_a: torch.Tensor, R: torch.Tensor, m: Mask | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Shares of data used and ignored, ``D_use = f(a) R`` and ``D_ign = f(a) - D_use``.

    Args:
        f_a: input activations ``[..., i, 1]`` in [0, 1].
        R: routing probabilities ``[j]`` or ``[..., i, j]``.
        m: mask; masked (i, j) pairs get neither use nor ignore.

    Returns:
        ``D_use, D_ign``, each ``[..., i, j]``.
    """
    f_a = f_a if m is None else f_a * m.keep  # [...ij] gate masked pairs
    D_use = f_a * R  # [...ij]
    D_ign = f_a - D_use  # [...ij]
    return D_use, D_ign
