"""GenerativeMatrixRouting: the original 2019 variant ("An Algorithm for Routing Capsules in All
Domains"), which routes matrices and generates each output matrix with a probabilistic model.

Indices: ``i`` inputs, ``j`` outputs, ``c`` rows of every matrix (``d_cov``), ``d`` input columns,
``h`` output columns, ``...`` batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from service.routing.masking import check_config

P_MODELS = ("gaussian", "skm")


class GenerativeMatrixRouting(nn.Module):
    """Route ``n_inp`` scored matrices ``[d_cov, d_inp]`` to ``n_out`` scored matrices ``[d_cov, d_out]``.

    Args:
        n_inp: number of input matrices, or -1 for variable length (parameters shared over i).
        n_out: number of output matrices (>= 2).
        d_cov: rows of input and output matrices.
        d_inp: columns of input matrices.
        d_out: columns of output matrices.
        n_iters: routing iterations (>= 1).
        single_beta: share one parameter for ``beta_use`` and ``beta_ign``.
        p_model: ``"gaussian"`` (mixture of Gaussians) or ``"skm"`` (soft k-means).
        eps: small positive number for numerical stability.
        return_dict: return every internal tensor.

    Forward takes ``a_inp [..., n]`` scores and ``mu_inp [..., n, d_cov, d_inp]`` matrices and
    returns ``a_out [..., n_out]``, ``mu_out`` and ``sig2_out`` (each ``[..., n_out, d_cov, d_out]``).
    """

    def __init__(
        self,
        n_inp: int,
        n_out: int,
        d_cov: int,
        d_inp: int,
        d_out: int,
        n_iters: int = 3,
        single_beta: bool = False,
        p_model: str = "gaussian",
        eps: float = 1e-5,
        return_dict: bool = False,
    ) -> None:
        super().__init__()
        check_config(n_inp, n_out, n_iters)
        if p_model not in P_MODELS:
            raise ValueError(f"p_model must be one of {P_MODELS}, got {p_model!r}")
        m = max(1, n_inp)
        self.n_inp, self.n_out, self.d_cov, self.d_inp, self.d_out = n_inp, n_out, d_cov, d_inp, d_out
        self.n_iters, self.single_beta, self.p_model, self.eps = n_iters, single_beta, p_model, eps
        self.return_dict = return_dict
        self.register_buffer("CONST_one", torch.tensor(1.0))
        self.W = nn.Parameter(torch.empty(m, n_out, d_inp, d_out).normal_() / d_inp)  # [ijdh]
        self.B = nn.Parameter(torch.zeros(m, n_out, d_cov, d_out))  # [ijch]
        self.beta_use = nn.Parameter(torch.zeros(m, n_out))  # [ij]
        self.beta_ign = self.beta_use if single_beta else nn.Parameter(torch.zeros(m, n_out))  # [ij]

    def _log_p(self, V_less_mu_2: torch.Tensor, sig2_out: torch.Tensor) -> torch.Tensor:
        """Log-density of each vote under each output's model: ``[..., i, j]``."""
        if self.p_model == "gaussian":
            quad = torch.einsum("...ijch,...jch->...ij", V_less_mu_2, 0.5 / sig2_out)  # [...ij]
            return -quad - 0.5 * sig2_out.log().sum(dim=(-2, -1))[..., None, :]  # [...ij]
        return torch.log_softmax(-V_less_mu_2.sum(dim=(-2, -1)), dim=-1)  # [...ij]

    def forward(
        self, a_inp: torch.Tensor, mu_inp: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | dict[str, Any]:
        n = mu_inp.shape[-3]
        if self.n_inp > 0 and n != self.n_inp:
            raise ValueError(f"expected n_inp={self.n_inp} input matrices, got {n}")
        W = self.W if self.n_inp > 0 else self.W.expand(n, -1, -1, -1)  # [ijdh]
        V = torch.einsum("...icd,ijdh->...ijch", mu_inp, W) + self.B  # [...ijch] votes
        f_a = torch.sigmoid(a_inp)[..., None]  # [...i1]
        log_p = None
        R = (self.CONST_one / self.n_out).expand(V.shape[:-2])  # [...ij] flat prior
        for iteration in range(self.n_iters):
            D_use = f_a * R  # [...ij]
            D_ign = f_a - D_use  # [...ij]
            a_out = (self.beta_use * D_use).sum(dim=-2) - (self.beta_ign * D_ign).sum(dim=-2)  # [...j]
            D_norm = D_use / (D_use.sum(dim=-2, keepdim=True) + self.eps)  # [...ij]
            mu_out = torch.einsum("...ij,...ijch->...jch", D_norm, V)  # [...jch]
            V_less_mu_2 = (V - mu_out[..., None, :, :, :]) ** 2  # [...ijch]
            sig2_out = torch.einsum("...ij,...ijch->...jch", D_norm, V_less_mu_2) + self.eps  # [...jch]
            if iteration + 1 < self.n_iters:
                log_p = self._log_p(V_less_mu_2, sig2_out)  # [...ij]
                R = torch.softmax(nn.functional.logsigmoid(a_out)[..., None, :] + log_p, dim=-1)  # [...ij]

        if not self.return_dict:
            return a_out, mu_out, sig2_out
        return {
            "V": V, "log_p": log_p, "R": R, "D_use": D_use, "D_ign": D_ign,
            "a_out": a_out, "mu_out": mu_out, "sig2_out": sig2_out,
        }
