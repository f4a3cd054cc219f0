"""Value-path credit (``credit.value_path`` through ``RoutingHead.contributions``) against an
independent computation: the full Jacobian, by autograd, of a naive re-implementation of the head
with every phi and norm scale frozen (votes materialised, padding removed rather than masked)."""

from __future__ import annotations

import pytest
import torch

from service.modeling.head import RoutingHead
from service.routing import credit
from tests.routing.naive import layer_norm


def random_head(dtype: torch.dtype, seed: int = 0, n_classes: int = 4) -> RoutingHead:
    torch.manual_seed(seed)
    head = RoutingHead(d_depth=3, d_emb=16, n_classes=n_classes, n_hid=6, d_hid=12).to(dtype)
    with torch.no_grad():
        for p in head.parameters():  # away from the initialisation: non-trivial W, B, B_F2, ...
            p.add_(torch.randn_like(p) * 0.3)
    return head


def frozen_logits(head: RoutingHead, h: torch.Tensor, phis: list[torch.Tensor], h0: torch.Tensor) -> torch.Tensor:
    """Logits of one text ``h [n, e, d]`` (no padding) with ``phis`` and every norm scale taken at ``h0``."""
    def fixed_norm(x: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        scale = 1 / torch.sqrt(x0.var(dim=-1, unbiased=False, keepdim=True) + 1e-5)
        return (x - x.mean(dim=-1, keepdim=True)) * scale

    x = (fixed_norm(h, h0) * head.W + head.B).flatten(0, 1)  # [i d]
    x0 = (layer_norm(h0) * head.W + head.B).flatten(0, 1)  # [i d]
    for r, phi in zip(head.route, phis, strict=True):
        n = x.shape[0]
        V = torch.einsum("id,jd,dh->ijh", x / n**0.5, r.W_F1, r.W_F2) + r.B_F2  # [ijh] votes, materialised
        V0 = torch.einsum("id,jd,dh->ijh", x0 / n**0.5, r.W_F1, r.W_F2) + r.B_F2  # [ijh]
        y, y0 = torch.einsum("ij,ijh->jh", phi, V), torch.einsum("ij,ijh->jh", phi, V0)  # [jh]
        x, x0 = (fixed_norm(y, y0), layer_norm(y0)) if r.d_out > 1 else (y, y0)
    return x.squeeze(-1)  # [k]


def test_value_path_equals_the_frozen_jacobian_times_the_input() -> None:
    head = random_head(torch.float64)
    lengths = [5, 2, 4]
    h = torch.randn(3, 5, 3, 16, dtype=torch.float64)
    pad = torch.arange(5)[None] >= torch.tensor(lengths)[:, None]  # [b n]
    h = h.masked_fill(pad[..., None, None], 0.0)
    with torch.no_grad():
        out = head(h, pad)
        targets = torch.arange(4).expand(3, 4)
        plain = head.contributions(out, targets, contrast=False)
        contrast = head.contributions(out, targets, contrast=True)
    for b, n in enumerate(lengths):
        hb = h[b, :n]
        phis = [out.phi[0][b, : n * 3], out.phi[1][b], out.phi[2][b]]
        torch.testing.assert_close(frozen_logits(head, hb, phis, hb), out.scores[b].detach())  # same forward
        J = torch.autograd.functional.jacobian(lambda x, p=phis, x0=hb: frozen_logits(head, x, p, x0), hb)  # [kned]
        ref = (J * hb).sum(-1)  # [k n e]
        torch.testing.assert_close(plain.credit[b, :, :n], ref, atol=1e-10, rtol=1e-9)
        torch.testing.assert_close(contrast.credit[b, :, :n], ref - ref.mean(0), atol=1e-10, rtol=1e-9)
        zero = frozen_logits(head, torch.zeros_like(hb), phis, hb)  # the baseline, independently
        torch.testing.assert_close(plain.baseline[b], zero.detach(), atol=1e-10, rtol=1e-9)
        assert (plain.credit[b, :, n:] == 0).all() and (contrast.credit[b, :, n:] == 0).all()


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-9)])
@pytest.mark.parametrize("contrast", [False, True])
def test_completeness_credit_sums_to_logit_minus_baseline(dtype: torch.dtype, tol: float, contrast: bool) -> None:
    for seed in range(5):
        head = random_head(dtype, seed, n_classes=2 + seed)
        h = torch.randn(4, 9, 3, 16, dtype=dtype) * (1 + seed)
        pad = torch.arange(9)[None] >= torch.tensor([9, 1, 6, 3])[:, None]
        with torch.no_grad():
            out = head(h, pad)
            c = head.contributions(out, torch.arange(head.n_classes).expand(4, -1), contrast)
        total = c.credit.sum((-2, -1)) + c.baseline  # [b k]
        assert (total - c.logit).abs().max() <= tol * max(1.0, c.logit.abs().max().item())
        ref = out.scores - out.scores.mean(-1, keepdim=True) if contrast else out.scores
        torch.testing.assert_close(c.logit, ref)


@pytest.mark.parametrize("junk", [123.0, float("nan")])
def test_targets_are_batched_and_padding_never_leaks(junk: float) -> None:
    head = random_head(torch.float32)
    h = torch.randn(1, 4, 3, 16)
    long = torch.cat([h, torch.randn(1, 7, 3, 16)], dim=1)  # another text, longer
    with torch.no_grad():
        alone = head.contributions(head(h), torch.tensor([[2, 0]]))
        hb = torch.cat([torch.nn.functional.pad(h, (0, 0, 0, 0, 0, 7), value=junk), long])  # junk in the padding
        pad = torch.tensor([[False] * 4 + [True] * 7, [False] * 11])
        both = head.contributions(head(hb, pad), torch.tensor([[2, 0], [1, 1]]))
        single = head.contributions(head(h), torch.tensor([[0]]))
    assert (both.credit[0, :, :4] - alone.credit[0]).abs().max() <= 1e-5
    assert (both.credit[0, :, 4:] == 0).all()
    assert (both.baseline[0] - alone.baseline[0]).abs().max() <= 1e-5
    torch.testing.assert_close(single.credit[0, 0], alone.credit[0, 1])  # target order is kept


def test_value_path_computes_the_constant_part_itself_when_not_given() -> None:
    # the head hands its per-depth bias over as x_const; any other stack of routings leaves it out
    head = random_head(torch.float64)
    h = torch.randn(2, 5, 3, 16, dtype=torch.float64)
    pad = torch.tensor([[False] * 5, [False] * 2 + [True] * 3])
    with torch.no_grad():
        out = head(h.masked_fill(pad[..., None, None], 0.0), pad)
        readout = torch.nn.functional.one_hot(torch.tensor([[1, 3], [0, 2]]), 4).to(torch.float64)[..., None]
        n = out.absent.shape[-1] // head.d_depth
        x_lin = head.x_lin(out)  # [bid]
        given = credit.value_path(out.stack, x_lin, readout, head.B.repeat(n, 1))
        computed = credit.value_path(out.stack, x_lin, readout)
        without = credit.value_path(out.stack, x_lin, readout, torch.zeros_like(head.B.repeat(n, 1)))
    for a, b in zip(given, computed, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert (without[1] - computed[1]).abs().min() > 1e-6  # the constant part moves the baseline
