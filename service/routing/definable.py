"""DefinableVectorRouting: the general form of the algorithm (paper §2, Algorithm 1).

The caller supplies the four networks ``A`` (activations), ``F`` (votes), ``G`` (predictions of the
inputs from the outputs) and ``S`` (scores of actual vs. predicted inputs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from service.routing.masking import build_mask, check_config, d_step, flat_prior, route, zero_absent


class DefinableVectorRouting(nn.Module):
    """Route input vectors with user-defined ``A, F, G, S`` modules.

    Args:
        A: ``[..., n, d_inp] -> [..., n, 1]`` activation scores.
        F: ``[..., n, d_inp] -> [..., n, n_out, d_out]`` votes.
        G: ``[..., n_out, d_out] -> [..., n_out, d_inp]`` predicted inputs.
        S: ``([..., n, d_inp], [..., n_out, d_inp]) -> [..., n, n_out]`` scores.
        n_inp: number of input vectors, or -1 for variable length.
        n_out: number of output vectors (>= 2).
        n_iters: routing iterations (>= 1).
        return_dict: return every internal tensor, including ``phi``.
        d_inp: input size, used for the ``beta`` layers when ``n_inp == -1``; inferred on the
            first call when omitted.
    """

    def __init__(
        self,
        A: nn.Module,
        F: nn.Module,
        G: nn.Module,
        S: nn.Module,
        n_inp: int,
        n_out: int,
        n_iters: int = 2,
        return_dict: bool = False,
        d_inp: int | None = None,
    ) -> None:
        super().__init__()
        check_config(n_inp, n_out, n_iters)
        self.A, self.F, self.G, self.S = A, F, G, S
        self.n_inp, self.n_out, self.n_iters, self.return_dict = n_inp, n_out, n_iters, return_dict
        self.register_buffer("CONST_ones_over_n_out", torch.ones(n_out) / n_out)  # [j]
        if n_inp > 0:
            self.beta_use = nn.Parameter(torch.empty(n_inp, n_out).normal_())  # [ij]
            self.beta_ign = nn.Parameter(torch.empty(n_inp, n_out).normal_())  # [ij]
        else:
            self.compute_beta_use = nn.Linear(d_inp, n_out) if d_inp else nn.LazyLinear(n_out)
            self.compute_beta_ign = nn.Linear(d_inp, n_out) if d_inp else nn.LazyLinear(n_out)

    def forward(self, x_inp: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor | dict[str, Any]:
        """Route ``x_inp [..., n, d_inp]`` to ``x_out [..., n_out, d_out]`` (or a dict, see
        :class:`~service.routing.EfficientVectorRouting`); ``mask`` as there."""
        if self.n_inp > 0 and x_inp.shape[-2] != self.n_inp:
            raise ValueError(f"expected n_inp={self.n_inp} input vectors, got {x_inp.shape[-2]}")
        m = build_mask(mask, x_inp, self.n_out)
        x_inp = zero_absent(x_inp, m)  # [...id]
        if self.n_inp > 0:
            beta_use, beta_ign = self.beta_use, self.beta_ign  # [ij], [ij]
        else:
            beta_use, beta_ign = self.compute_beta_use(x_inp), self.compute_beta_ign(x_inp)  # [...ij]
        a_inp = self.A(x_inp).reshape(x_inp.shape[:-1])  # [...i]
        V = self.F(x_inp).reshape(*a_inp.shape, self.n_out, -1)  # [...ijh]
        f_a = torch.sigmoid(a_inp)[..., None]  # [...i1]

        pred_x_inp = S = None
        R = flat_prior(self.CONST_ones_over_n_out, m)  # [j] or [...ij]
        for iteration in range(self.n_iters):
            D_use, D_ign = d_step(f_a, R, m)  # [...ij], [...ij]
            phi = beta_use * D_use - beta_ign * D_ign  # [...ij]
            x_out = torch.einsum("...ij,...ijh->...jh", phi, V)  # [...jh]
            if iteration + 1 < self.n_iters:
                pred_x_inp = self.G(x_out)  # [...jd]
                S = self.S(x_inp, pred_x_inp)  # [...ij]
                R = route(S, m)  # [...ij]

        if not self.return_dict:
            return x_out
        return {
            "a_inp": a_inp, "V": V, "pred_x_inp": pred_x_inp, "S": S, "R": R.expand_as(D_use),
            "D_use": D_use, "D_ign": D_ign, "phi": phi, "x_out": x_out,
        }
