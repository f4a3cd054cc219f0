"""Credit assignment over compositions of routings.

Two kinds live here, both batched:

- **Routing shares** (paper Appendix A, eq. 15): compositions of the ``phi [..., i, j]`` matrices
  (``sequential``, ``residual``, ``sum_of``, ``concatenation``). ``phi_ij`` is the share of input i's
  data that output j uses; it says nothing of whether that data pushes a score up or down.
- **Value-path contributions** (:func:`value_path`): hold every routing's final ``phi`` and every
  output norm's scale at their values in a forward pass. Each routing's output
  ``x_out_jh = N(sum_i phi_ij F(x_inp_i)_jh)`` is then an affine function of its inputs, so a stack of
  routings is affine in the first routing's inputs, and any linear read-out of the last output
  splits *exactly* into one term per input plus a constant (the read-out at zero input).

Index letters: ``i`` inputs, ``j`` outputs, ``d`` input features, ``h`` output features, ``t``
read-outs (targets), ``...`` batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.routing.efficient import EfficientVectorRouting


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



@dataclass(frozen=True)
class Routed:
    """One routing's part in a forward pass, as the value path needs it.

    Attributes:
        routing: the module (its ``W_F1``, ``W_F2``, ``B_F2`` form the votes, ``N`` the output norm).
        x_inp: ``[..., i, d]`` the inputs it routed (absent ones zeroed).
        phi: ``[..., i, j]`` its final "bang per bit" coefficients (0 for absent inputs).
        n: ``[..., 1, 1]`` or ``[]`` the ``n`` of its ``1/sqrt(n)`` scaling (present inputs).
        x_out_raw: ``[..., j, h]`` its output before the final norm (the norm's scale comes from it).
    """

    routing: EfficientVectorRouting
    x_inp: torch.Tensor
    phi: torch.Tensor
    n: torch.Tensor
    x_out_raw: torch.Tensor

    def rows(self, idx: torch.Tensor, routing: EfficientVectorRouting | None = None) -> Routed:
        """The same routing for the batch rows ``idx [b']`` only (``routing``: the module of those rows, when
        its parameters are per sample; None: this one)."""
        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[idx] if t.dim() > 0 else t

        return Routed(routing or self.routing, pick(self.x_inp), pick(self.phi), pick(self.n), pick(self.x_out_raw))


def _norm_scale(r: Routed) -> torch.Tensor | None:
    """``1 / sqrt(var_h + eps)`` ``[..., j, 1]`` of the output norm ``N`` in this pass, or None without one."""
    N = r.routing.N
    if not (r.routing.normalize and isinstance(N, torch.nn.LayerNorm)):
        return None
    return norm_scale(r.x_out_raw, N.eps)  # [...j1]


def norm_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``[..., 1]`` a layer norm's ``1 / sqrt(var + eps)`` over the last axis of ``x [..., h]`` (the scale that credit
    holds at its value)."""
    centred = x - x.mean(dim=-1, keepdim=True)  # [...h]
    var = (centred * centred).mean(dim=-1, keepdim=True)  # [...1] (Tensor.var takes ~10x longer on a CPU)
    return (var + eps).rsqrt()  # [...1]


def _pull_back_norm(g: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Read-outs ``g [..., t, j, h]`` of a norm's output as read-outs of its input, the scale held
    fixed: the transpose of ``x -> (x - mean_h x) * scale`` (which is self-adjoint)."""
    if scale is None:
        return g
    return (g - g.mean(dim=-1, keepdim=True)) * scale[..., None, :, :]  # [...tjh]


def value_path(stack: Sequence[Routed], x_lin: torch.Tensor, readout: torch.Tensor,
               x_const: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact split of linear read-outs of a stack of routings over the first routing's inputs.

    With every ``phi`` and norm scale fixed, each routing's pre-norm output
    ``y_jh = sum_d (sum_i phi_ij x_id / sqrt(n)) W_F1_jd W_F2_dh + (sum_i phi_ij) B_F2_jh`` and its norm
    ``(y - mean_h y) * scale_j`` are affine, so the stack is affine in the first routing's inputs.
    Write those inputs as ``x_inp = x_lin + x_const``, where ``x_lin`` is the part to credit (the rest,
    e.g. a learned bias, is credited to no input). Then, for each read-out ``t`` with weights
    ``readout [..., t, j_L, h_L]`` on the last output,

        sum_jh readout_tjh x_out_L_jh  =  sum_i contrib_ti  +  baseline_t      (exactly)

    where ``contrib_ti`` is input i's part and ``baseline_t`` the read-out at ``x_lin = 0``: the votes'
    biases ``B_F2`` of every routing and ``x_const``, carried along the same paths.

    The read-outs travel back once through each routing, batched over ``t``; the ``[..., i, j, h]``
    votes are never materialised. Cost per read-out: about one M-step of each routing.

    Args:
        stack: the routings in order of application; each one's ``x_inp`` is the previous one's output.
        x_lin: ``[..., i, d]`` the part of the first routing's inputs to credit (absent inputs, whose
            ``phi`` is 0, get 0 where it is finite).
        readout: ``[..., t, j_L, h_L]`` weights of each read-out on the last output.
        x_const: ``[..., i, d]`` or ``[i, d]``, the rest, ``x_inp - x_lin`` (finite at absent inputs),
            when the caller has it in a cheaper form (a bias shared by every sample); None: computed.

    Returns:
        ``contrib [..., t, i]`` and ``baseline [..., t]``.
    """
    u, baseline = pull_back(stack, readout)  # [...tjd], [...t]
    first = stack[0]
    per_ij = torch.einsum("...id,...tjd->...tij", x_lin, u)  # [...tij] each input's vote features, read out
    contrib = (per_ij * first.phi[..., None, :, :]).sum(dim=-1)  # [...ti]
    if x_const is None:
        x_const = first.x_inp - x_lin  # [...id]
    return contrib, baseline + _const_part(first, u, x_const)  # [...ti], [...t]


def input_readouts(stack: Sequence[Routed], readout: torch.Tensor, x_const: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The linear read-outs ``readout [..., t, j_L, h_L]`` of :func:`value_path` as weights on the first routing's
    inputs, ``phi`` and norm scales fixed: ``g [..., t, i, d]`` with ``sum_jh readout_tjh x_out_L_jh =
    sum_id g_tid x_lin_id + baseline_t`` exactly (``baseline [..., t]`` as in :func:`value_path`). What a split
    that goes on past the first routing's inputs (through whatever computed them) starts from."""
    u, baseline = pull_back(stack, readout)  # [...tjd], [...t]
    g = torch.einsum("...ij,...tjd->...tid", stack[0].phi, u)  # [...tid]
    return g, baseline + _const_part(stack[0], u, x_const)  # [...tid], [...t]


def pull_back(stack: Sequence[Routed], readout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Read-outs ``readout [..., t, j_L, h_L]`` of the last routing's output carried back, ``phi`` and norm scales
    fixed, to the first routing's vote features: ``u [..., t, j, d]`` (the read-out of input ``i`` is
    ``sum_jd phi_ij x_inp_id u_tjd``), and ``[..., t]`` the part of the read-out the votes' biases make."""
    if not stack:
        raise ValueError("value_path() needs at least one routing")
    g = readout  # [...tjh] read-outs of the current routing's output
    baseline = readout.new_zeros(readout.shape[:-2])  # [...t]
    for depth, r in enumerate(reversed(stack)):
        R = r.routing
        g = _pull_back_norm(g, _norm_scale(r))  # [...tjh] read-outs of the pre-norm output
        baseline = baseline + torch.einsum("...tjh,...j,...jh->...t", g, r.phi.sum(dim=-2), R.B_F2)  # [...t]
        u = torch.einsum("...tjh,...dh->...tjd", g, R.W_F2) * R.W_F1.unsqueeze(-3) * r.n.rsqrt()[..., None]  # [...tjd]
        if depth + 1 < len(stack):  # read-outs of the previous routing's output, through phi
            g = torch.einsum("...ij,...tjd->...tid", r.phi, u)  # [...tid]
    return u, baseline


def _const_part(first: Routed, u: torch.Tensor, x_const: torch.Tensor) -> torch.Tensor:
    """``[..., t]`` the read-out of the first routing's inputs ``x_const [..., i, d]`` (see :func:`pull_back`)."""
    phi_x = torch.matmul(first.phi.transpose(-2, -1), x_const)  # [...jd] x_const, contracted over i
    return torch.einsum("...tjd,...jd->...t", u, phi_x)  # [...t]
