import torch

from service.routing import EfficientVectorRouting, credit


def test_sequential_residual_sum_concat() -> None:
    g = torch.Generator().manual_seed(0)
    p1, p2, p3 = (torch.randn(2, a, b, generator=g) for a, b in [(5, 4), (4, 4), (4, 3)])
    torch.testing.assert_close(credit.sequential(p1, p2, p3), torch.einsum("bia,bac,bcj->bij", p1, p2, p3))
    torch.testing.assert_close(credit.residual(p1, p2), p1 + torch.einsum("bia,baj->bij", p1, p2))
    q = torch.randn(6, 3, generator=g)  # broadcasts over the batch
    s = credit.sum_of(p3, q)
    assert s.shape == (2, 10, 3)
    torch.testing.assert_close(s[1, 4:], q)
    c = credit.concatenation(p1, q)
    assert c.shape == (2, 11, 7)
    torch.testing.assert_close(c[0, :5, :4], p1[0])
    torch.testing.assert_close(c[0, 5:, 4:], q)
    assert (c[:, :5, 4:] == 0).all() and (c[:, 5:, :4] == 0).all()


def test_sequential_credit_is_exact_for_linear_routings_without_biases() -> None:
    """With biases at zero and d_out=1 at the end, x_out is linear in each routing's inputs through
    phi: the last output equals sum_i phi_e2e[i, j] * (contribution of input i), checked on R2 alone."""
    torch.manual_seed(0)
    r = EfficientVectorRouting(6, 3, 4, 1, normalize=False, return_dict=True).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    out = r(x)
    # x_out_j = sum_i phi_ij * V_ij (d_out = 1): credit is exactly additive over inputs
    V = torch.einsum("id,jd,dh->ijh", x / 6**0.5, r.W_F1, r.W_F2).squeeze(-1)
    torch.testing.assert_close(out["x_out"].squeeze(-1), (out["phi"] * V).sum(0))


def test_unit_variance_ignores_padding_rows() -> None:
    g = torch.Generator().manual_seed(1)
    phi = torch.randn(7, 3, generator=g, dtype=torch.float64)
    alone = credit.unit_variance(phi)
    assert abs(alone.std().item() - 1) < 1e-4
    padded = torch.cat([phi, torch.zeros(5, 3, dtype=torch.float64)])[None]
    absent = torch.tensor([[False] * 7 + [True] * 5])
    torch.testing.assert_close(credit.unit_variance(padded, absent)[0, :7], alone)
