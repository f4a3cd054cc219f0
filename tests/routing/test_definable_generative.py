import pytest
import torch
from torch import nn

from service.routing import DefinableVectorRouting, EfficientVectorRouting, GenerativeMatrixRouting


class Alg2(nn.Module):
    """A, F, G and S of Algorithm 2, reading their parameters from an EfficientVectorRouting."""

    def __init__(self, eff: EfficientVectorRouting, part: str) -> None:
        super().__init__()
        self.eff, self.part = eff, part

    def forward(self, x: torch.Tensor, pred: torch.Tensor | None = None) -> torch.Tensor:
        e = self.eff
        if self.part == "A":
            return ((x / x.shape[-2] ** 0.5) * e.W_A).sum(-1, keepdim=True) + e.B_A[:, None]
        if self.part == "F":
            return torch.einsum("...id,jd,dh->...ijh", x / x.shape[-2] ** 0.5, e.W_F1, e.W_F2) + e.B_F2
        if self.part == "G":
            return (e.N(x) @ e.W_G1) * e.W_G2 + e.B_G2
        return nn.functional.logsigmoid((x @ pred.transpose(-2, -1)) * e.W_S + e.B_S)


def test_definable_with_algorithm_2_modules_equals_efficient() -> None:
    torch.manual_seed(0)
    eff = EfficientVectorRouting(6, 4, 5, 3, n_iters=3, normalize=False, return_dict=True).double()
    dvr = DefinableVectorRouting(*(Alg2(eff, k) for k in "AFGS"), n_inp=6, n_out=4, n_iters=3,
                                 return_dict=True).double()
    dvr.beta_use, dvr.beta_ign = eff.beta_use, eff.beta_ign
    x = torch.randn(2, 6, 5, dtype=torch.float64)
    mask = torch.rand(2, 6, 4) < 0.3
    a, b = eff(x, mask=mask), dvr(x, mask=mask)
    torch.testing.assert_close(a["x_out"], b["x_out"])
    torch.testing.assert_close(a["phi"], b["phi"])


class Votes(nn.Module):
    def __init__(self, d_inp: int, n_out: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_inp, n_out * d_out)
        self.n_out = n_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).unflatten(-1, (self.n_out, -1))


class Dot(nn.Module):
    def forward(self, x: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        return x @ pred.transpose(-2, -1) * x.shape[-1] ** -0.5


@pytest.mark.parametrize("d_inp", [5, None])
def test_definable_variable_length(d_inp: int | None) -> None:
    torch.manual_seed(1)
    m = DefinableVectorRouting(nn.Linear(5, 1), Votes(5, 3, 2), nn.Linear(2, 5), Dot(), n_inp=-1, n_out=3,
                               return_dict=True, d_inp=d_inp)
    for n in (2, 9):
        out = m(torch.randn(4, n, 5))
        assert out["x_out"].shape == (4, 3, 2) and out["phi"].shape == (4, n, 3)
        assert torch.isfinite(out["x_out"]).all()
    m(torch.randn(4, 3, 5))["x_out"].sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    state = m.state_dict()
    m2 = DefinableVectorRouting(nn.Linear(5, 1), Votes(5, 3, 2), nn.Linear(2, 5), Dot(), n_inp=-1, n_out=3,
                                d_inp=5)
    m2.load_state_dict(state, strict=True)


def naive_generative(m: GenerativeMatrixRouting, a_inp: torch.Tensor, mu_inp: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loop-based 2019 routing for one sample (Gaussian model)."""
    n, n_out, eps = mu_inp.shape[0], m.n_out, m.eps
    W = m.W.detach().expand(n, -1, -1, -1)
    V = torch.stack([torch.stack([mu_inp[i] @ W[i, j] + m.B.detach()[min(i, m.B.shape[0] - 1), j]
                                  for j in range(n_out)]) for i in range(n)])
    f_a = torch.sigmoid(a_inp)
    R = torch.full((n, n_out), 1.0 / n_out, dtype=V.dtype)
    a_out = mu = sig2 = torch.empty(0)
    for it in range(m.n_iters):
        if it > 0:
            log_p = torch.zeros(n, n_out, dtype=V.dtype)
            for i in range(n):
                for j in range(n_out):
                    log_p[i, j] = (-((V[i, j] - mu[j]) ** 2 / (2 * sig2[j])).sum()
                                   - torch.log(torch.sqrt(sig2[j])).sum())
            R = torch.softmax(torch.nn.functional.logsigmoid(a_out)[None] + log_p, dim=1)
        D_use = f_a[:, None] * R
        D_ign = f_a[:, None] - D_use
        a_out = (m.beta_use.detach() * D_use).sum(0) - (m.beta_ign.detach() * D_ign).sum(0)
        w = D_use / (D_use.sum(0, keepdim=True) + eps)
        mu = torch.einsum("ij,ijch->jch", w, V)
        sig2 = torch.einsum("ij,ijch->jch", w, (V - mu[None]) ** 2) + eps
    return a_out, mu, sig2


def test_generative_matches_naive_and_has_reference_parameters() -> None:
    torch.manual_seed(2)
    m = GenerativeMatrixRouting(n_inp=5, n_out=3, d_cov=2, d_inp=3, d_out=4).double()
    with torch.no_grad():
        m.beta_use.normal_()
        m.beta_ign.normal_()
        m.B.normal_(std=0.1)
    assert set(m.state_dict()) == {"CONST_one", "W", "B", "beta_use", "beta_ign"}
    a_inp, mu_inp = torch.randn(5, dtype=torch.float64), torch.randn(5, 2, 3, dtype=torch.float64)
    got = m(a_inp, mu_inp)
    for g, r in zip(got, naive_generative(m, a_inp, mu_inp), strict=True):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("p_model", ["gaussian", "skm"])
def test_generative_variable_length_batched_single_beta(p_model: str) -> None:
    m = GenerativeMatrixRouting(n_inp=-1, n_out=4, d_cov=3, d_inp=3, d_out=3, single_beta=True, p_model=p_model,
                                return_dict=True)
    assert m.beta_use is m.beta_ign
    out = m(torch.randn(2, 7), torch.randn(2, 7, 3, 3))
    assert out["a_out"].shape == (2, 4) and out["mu_out"].shape == (2, 4, 3, 3)
    torch.testing.assert_close(out["R"].sum(-1), torch.ones(2, 7))
    assert (out["sig2_out"] > 0).all()
    with pytest.raises(ValueError, match="p_model"):
        GenerativeMatrixRouting(-1, 4, 3, 3, 3, p_model="nope")
