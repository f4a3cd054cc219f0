"""End-to-end credit assignment over compositions of routings (paper Appendix A, eq. 15).

Every function is batched: a credit matrix is ``[..., i, j]`` (inputs x outputs).
"""

from __future__ import annotations

import torch


def sequential(*phis: torch.Tensor) -> torch.Tensor:
    """Credit through routings applied one after another (eq. 17): ``phi1 @ phi2 @ ...``.

    Args:
        phis: ``[..., i, j1], [..., j1, j2], ...``.

    Returns:
        ``[..., i, j_last]``.
    """
    if not phis:
        raise ValueError("sequential() needs at least one credit matrix")
    out = phis[0]  # [...ij']
    for phi in phis[1:]:
        out = out @ phi  # [...ij]
    return out


def residual(phi1: torch.Tensor, phi2: torch.Tensor) -> torch.Tensor:
    """Credit when R2 is applied as a residual to R1, ``R1(x) + R2(R1(x))`` (eq. 19).

    Args:
        phi1: ``[..., i, j]``; phi2: ``[..., j, j]``.

    Returns:
        ``phi1 + phi1 @ phi2``, ``[..., i, j]``.
    """
    return phi1 + phi1 @ phi2  # [...ij]


def sum_of(*phis: torch.Tensor) -> torch.Tensor:
    """Credit for a sum of independent routings over separate inputs (eq. 21): concatenate over i.

    Args:
        phis: ``[..., i1, j], [..., i2, j], ...`` (order fixed: direct sums do not commute).

    Returns:
        ``[..., i1 + i2 + ..., j]``.
    """
    batch = torch.broadcast_shapes(*(p.shape[:-2] for p in phis))
    return torch.cat([p.expand(*batch, *p.shape[-2:]) for p in phis], dim=-2)  # [...ij]


def concatenation(*phis: torch.Tensor) -> torch.Tensor:
    """Credit for concatenated outputs of independent routings (eq. 23): block-diagonal direct sum.

    Args:
        phis: ``[..., i1, j1], [..., i2, j2], ...``.

    Returns:
        ``[..., i1 + i2 + ..., j1 + j2 + ...]`` with zeros off the diagonal blocks.
    """
    batch = torch.broadcast_shapes(*(p.shape[:-2] for p in phis))
    n_i = sum(p.shape[-2] for p in phis)
    n_j = sum(p.shape[-1] for p in phis)
    out = phis[0].new_zeros(*batch, n_i, n_j)  # [...ij]
    i0 = j0 = 0
    for p in phis:
        out[..., i0 : i0 + p.shape[-2], j0 : j0 + p.shape[-1]] = p  # [...i'j'] one diagonal block
        i0, j0 = i0 + p.shape[-2], j0 + p.shape[-1]
    return out


def unit_variance(phi: torch.Tensor, absent: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """Scale each sample's credit matrix to unit standard deviation over its elements (eq. 15).

    Args:
        phi: ``[..., i, j]`` credit.
        absent: optional bool ``[..., i]``; rows that are padding take no part in the statistics,
            so a sample's scaled credit does not depend on the batch it was padded into.
        eps: added to the standard deviation.

    Returns:
        ``[..., i, j]``, with absent rows set to 0.
    """
    n_j = phi.shape[-1]
    if absent is None:
        present = torch.ones(phi.shape[:-1], dtype=phi.dtype, device=phi.device)  # [...i]
    else:
        present = (~absent).to(phi.dtype)  # [...i]
    w = present[..., None]  # [...i1]
    count = (present.sum(dim=-1) * n_j)[..., None, None]  # [...11]
    mean = (phi * w).sum(dim=(-2, -1), keepdim=True) / count.clamp(min=1)  # [...11]
    var = (((phi - mean) * w) ** 2).sum(dim=(-2, -1), keepdim=True) / (count - 1).clamp(min=1)  # [...11]
    return phi * w / (var.sqrt() + eps)  # [...ij]

