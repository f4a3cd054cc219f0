"""An independent, deliberately naive routing (Algorithm 1 with the A, F, G, S of Algorithm 2).

Votes are materialised, samples are routed one at a time, and absent inputs (masked for every
output) are *removed* before routing rather than masked, so it checks the library's masking too.
"""

from __future__ import annotations

import torch


def layer_norm(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps)


def route_one(p: dict[str, torch.Tensor], x: torch.Tensor, mask: torch.Tensor | None, n_iters: int,
              normalize: bool, fixed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Route one sample ``x [n, d]``; returns ``x_out [j, h]`` and ``phi [n, j]`` (0 for absent rows)."""
    n_all, n_out = x.shape[0], p["W_F1"].shape[0]
    keep_all = torch.ones(n_all, n_out, dtype=x.dtype) if mask is None else (~mask).to(x.dtype)
    present = keep_all.sum(dim=1) > 0
    idx = present.nonzero().flatten()
    x, keep = x[idx], keep_all[idx]
    n = max(1, len(idx))
    if fixed:
        W_A, B_A, W_S, B_S = p["W_A"][idx], p["B_A"][idx], p["W_S"][idx], p["B_S"][idx]
        beta_use, beta_ign = p["beta_use"][idx], p["beta_ign"][idx]
    else:
        W_A, B_A, W_S, B_S = p["W_A"], p["B_A"], p["W_S"], p["B_S"]
        beta_use = x @ p["compute_beta_use.weight"].T + p["compute_beta_use.bias"]
        beta_ign = x @ p["compute_beta_ign.weight"].T + p["compute_beta_ign.bias"]
    d_out = p["W_F2"].shape[1]
    a = (x / n**0.5 * W_A).sum(dim=1) + B_A
    V = torch.zeros(len(idx), n_out, d_out, dtype=x.dtype)
    for i in range(len(idx)):
        for j in range(n_out):
            V[i, j] = (x[i] / n**0.5 * p["W_F1"][j]) @ p["W_F2"] + p["B_F2"][j]
    N = layer_norm if d_out > 1 else (lambda t: t)
    x_out = None
    for it in range(n_iters):
        if it == 0:
            R = keep / keep.sum(dim=1, keepdim=True)
        else:
            pred = (N(x_out) @ p["W_G1"]) * p["W_G2"] + p["B_G2"]
            S = torch.nn.functional.logsigmoid((x @ pred.T) * W_S + B_S)
            e = torch.exp(S - S.max(dim=1, keepdim=True).values) * keep
            R = e / e.sum(dim=1, keepdim=True)
        f_a = torch.sigmoid(a)[:, None] * keep
        D_use = f_a * R
        D_ign = f_a - D_use
        phi = beta_use * D_use - beta_ign * D_ign
        x_out = torch.einsum("ij,ijh->jh", phi, V)
    if normalize:
        x_out = N(x_out)
    phi_all = torch.zeros(n_all, n_out, dtype=x.dtype)
    phi_all[idx] = phi
    return x_out, phi_all


def naive_routing(module: torch.nn.Module, x_inp: torch.Tensor, mask: torch.Tensor | None) -> tuple[
        torch.Tensor, torch.Tensor]:
    """Route a batch ``[..., n, d]`` sample by sample with ``module``'s parameters."""
    p = {k: v.detach() for k, v in module.state_dict().items()}
    batch = x_inp.shape[:-2]
    n, n_out = x_inp.shape[-2], p["W_F1"].shape[0]
    if mask is not None:
        mask = mask.expand(*batch, n, n_out)
    xs = x_inp.reshape(-1, *x_inp.shape[-2:])
    ms = None if mask is None else mask.reshape(-1, n, n_out)
    outs, phis = [], []
    for b in range(xs.shape[0]):
        o, ph = route_one(p, xs[b], None if ms is None else ms[b], module.n_iters, module.normalize,
                          module.n_inp > 0)
        outs.append(o)
        phis.append(ph)
    return (torch.stack(outs).reshape(*batch, *outs[0].shape), torch.stack(phis).reshape(*batch, n, n_out))
