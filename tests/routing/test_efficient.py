import itertools
import zlib

import pytest
import torch

from service.routing import EfficientVectorRouting
from tests.routing.naive import naive_routing

N_INP, N_OUT, D_INP = 7, 4, 6
BATCHES = [(), (3,), (2, 3)]


def make_mask(kind: str, batch: tuple[int, ...], gen: torch.Generator) -> torch.Tensor | None:
    if kind == "none":
        return None
    shape = (N_INP, N_OUT) if kind == "shared" else (*batch, N_INP, N_OUT)
    mask = torch.rand(shape, generator=gen) < 0.3
    mask[..., 1, :] = True  # one input absent everywhere
    return mask


@pytest.mark.parametrize(
    ("n_inp", "d_out", "n_iters", "batch", "mask_kind"),
    list(itertools.product([N_INP, -1], [1, 5], [1, 2, 3], BATCHES, ["none", "shared", "per_sample"])),
)
def test_matches_naive_float64(n_inp: int, d_out: int, n_iters: int, batch: tuple[int, ...], mask_kind: str) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(repr((n_inp, d_out, n_iters, batch, mask_kind)).encode()))
    torch.manual_seed(0)
    m = EfficientVectorRouting(n_inp, N_OUT, D_INP, d_out, n_iters=n_iters, return_dict=True).double()
    with torch.no_grad():  # non-zero biases so every parameter is exercised
        for name, prm in m.named_parameters():
            if name.startswith("B_"):
                prm.normal_(std=0.3)
    x = torch.randn(*batch, N_INP, D_INP, generator=gen, dtype=torch.float64)
    mask = make_mask(mask_kind, batch, gen)
    out = m(x, mask=mask)
    x_ref, phi_ref = naive_routing(m, x, mask)
    torch.testing.assert_close(out["x_out"], x_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out["phi"], phi_ref, rtol=1e-9, atol=1e-9)
    assert out["x_out"].shape == (*batch, N_OUT, d_out)
    assert (out["S"] is None) == (n_iters == 1)


@pytest.mark.parametrize("n_inp", [N_INP, -1])
def test_eager_votes_match_memory_efficient(n_inp: int) -> None:
    torch.manual_seed(1)
    eff = EfficientVectorRouting(n_inp, N_OUT, D_INP, 3, return_dict=True).double()
    eager = EfficientVectorRouting(n_inp, N_OUT, D_INP, 3, memory_efficient=False, return_dict=True).double()
    eager.load_state_dict(eff.state_dict())
    x = torch.randn(2, N_INP, D_INP, dtype=torch.float64)
    a, b = eff(x), eager(x)
    assert a["V"] is None and b["V"].shape == (2, N_INP, N_OUT, 3)
    torch.testing.assert_close(a["x_out"], b["x_out"])
    torch.testing.assert_close(a["phi"], b["phi"])


def test_padding_invariance_and_no_nan() -> None:
    torch.manual_seed(2)
    m = EfficientVectorRouting(-1, N_OUT, D_INP, 5, return_dict=True)
    lengths = [3, 9, 6]
    texts = [torch.randn(n, D_INP) for n in lengths]
    n_max = max(lengths)
    x = torch.full((len(texts), n_max, D_INP), float("nan"))  # garbage padding must not leak
    mask = torch.ones(len(texts), n_max, N_OUT, dtype=torch.bool)
    for b, t in enumerate(texts):
        x[b, : len(t)] = t
        mask[b, : len(t)] = False
    batched = m(x, mask=mask)
    for name in ("x_out", "phi", "D_use", "R", "S", "pred_x_inp", "a_inp"):
        assert torch.isfinite(batched[name]).all(), name
    for b, t in enumerate(texts):
        alone = m(t)
        torch.testing.assert_close(batched["x_out"][b], alone["x_out"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batched["phi"][b, : len(t)], alone["phi"], atol=1e-5, rtol=1e-5)
        assert (batched["phi"][b, len(t):] == 0).all()


def test_all_inputs_absent_gives_zeros_not_nan() -> None:
    m = EfficientVectorRouting(-1, N_OUT, D_INP, 5, return_dict=True)
    out = m(torch.randn(4, D_INP), mask=torch.ones(4, N_OUT, dtype=torch.bool))
    assert torch.isfinite(out["x_out"]).all() and (out["phi"] == 0).all()


@pytest.mark.parametrize("n_inp", [N_INP, -1])
def test_gradients_flow_to_every_parameter(n_inp: int) -> None:
    torch.manual_seed(3)
    m = EfficientVectorRouting(n_inp, N_OUT, D_INP, 5, n_iters=3)
    x = torch.randn(2, N_INP, D_INP, requires_grad=True)
    m(x).pow(2).mul(torch.randn(2, N_OUT, 5)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for name, prm in m.named_parameters():
        assert prm.grad is not None and torch.isfinite(prm.grad).all(), name
        assert prm.grad.abs().sum() > 0, f"no gradient reaches {name}"


REFERENCE_KEYS_FIXED = {"CONST_ones_over_n_out", "W_A", "B_A", "W_F1", "W_F2", "B_F2", "W_G1", "W_G2", "B_G2",
                        "W_S", "B_S", "beta_use", "beta_ign"}
REFERENCE_KEYS_VAR = (REFERENCE_KEYS_FIXED - {"beta_use", "beta_ign"}) | {
    "compute_beta_use.weight", "compute_beta_use.bias", "compute_beta_ign.weight", "compute_beta_ign.bias"}


@pytest.mark.parametrize(("n_inp", "keys"), [(N_INP, REFERENCE_KEYS_FIXED), (-1, REFERENCE_KEYS_VAR)])
def test_state_dict_names_shapes_and_strict_round_trip(n_inp: int, keys: set[str]) -> None:
    a = EfficientVectorRouting(n_inp, N_OUT, D_INP, 5)
    sd = a.state_dict()
    assert set(sd) == keys
    m = max(1, n_inp)
    expected = {"CONST_ones_over_n_out": (N_OUT,), "W_A": (m, D_INP), "B_A": (m,), "W_F1": (N_OUT, D_INP),
                "W_F2": (D_INP, 5), "B_F2": (N_OUT, 5), "W_G1": (5, D_INP), "W_G2": (N_OUT, D_INP),
                "B_G2": (N_OUT, D_INP), "W_S": (m, N_OUT), "B_S": (m, N_OUT)}
    for k, shape in expected.items():
        assert tuple(sd[k].shape) == shape, k
    b = EfficientVectorRouting(n_inp, N_OUT, D_INP, 5)
    b.load_state_dict(sd, strict=True)
    x = torch.randn(N_INP, D_INP)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_initialisation_statistics() -> None:
    torch.manual_seed(4)
    d_inp, d_out = 256, 64
    m = EfficientVectorRouting(300, 200, d_inp, d_out)
    assert m.W_A.std().item() == pytest.approx(2 / d_inp**0.5, rel=0.05)
    assert m.W_F1.std().item() == pytest.approx(1.0, rel=0.05)
    assert m.W_F2.std().item() == pytest.approx(2 / d_inp**0.5, rel=0.05)
    assert m.W_G1.std().item() == pytest.approx(1 / d_out**0.5, rel=0.05)
    assert m.W_S.std().item() == pytest.approx(1 / d_inp**0.5, rel=0.05)
    assert m.beta_use.std().item() == pytest.approx(1.0, rel=0.05)
    for name in ("B_A", "B_F2", "B_G2", "B_S"):
        assert (getattr(m, name) == 0).all()


def test_bad_arguments_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="n_out"):
        EfficientVectorRouting(-1, 1, 4, 4)
    with pytest.raises(ValueError, match="n_inp"):
        EfficientVectorRouting(0, 3, 4, 4)
    m = EfficientVectorRouting(5, 3, 4, 4)
    with pytest.raises(ValueError, match="n_inp=5"):
        m(torch.randn(6, 4))
    with pytest.raises(ValueError, match="mask"):
        m(torch.randn(5, 4), mask=torch.zeros(5, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        m(torch.randn(5, 4), mask=torch.zeros(5, 3))
