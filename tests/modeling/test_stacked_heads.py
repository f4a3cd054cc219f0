"""Stacked heads: a batch whose row ``b`` runs on head ``b`` (their parameters stacked) answers each row as its
head alone does, scores and both kinds of credit, with padding and with credit asked of some rows only."""

from __future__ import annotations

import pytest
import torch

from service.modeling.backbone import Encoded
from service.modeling.classifier import CreditRequest, classify
from service.modeling.encoding import Encoding
from service.modeling.head import RoutingHead, StackSpace, stack_heads

D_DEPTH, D_EMB = 3, 16


def random_heads(k: int, n_classes: int = 4) -> list[RoutingHead]:
    torch.manual_seed(7)
    heads = []
    for _ in range(k):
        head = RoutingHead(D_DEPTH, D_EMB, n_classes, n_hid=8, d_hid=12)
        with torch.no_grad():  # trained heads' scale and bias are not 1 and 0
            head.W.normal_(1.0, 0.3)
            head.B.normal_(0.0, 0.3)
        heads.append(head.eval())
    return heads


def encoded(lengths: list[int]) -> Encoded:
    torch.manual_seed(3)
    n = max(lengths)
    pad = torch.arange(n)[None, :] >= torch.tensor(lengths)[:, None]  # [b n]
    hidden = torch.randn(len(lengths), n, D_DEPTH, D_EMB).masked_fill(pad[..., None, None], 0.0)  # [b n e d]
    return Encoded(hidden=hidden, pad=pad, encodings=[Encoding(chunks=((0,) * k,), offsets=((0, 0),) * k,
                                                               special=(False,) * k, word_ids=(0,) * k)
                                                      for k in lengths])


def one_row(enc: Encoded, b: int) -> Encoded:
    n = enc.lengths[b]
    return Encoded(hidden=enc.hidden[b : b + 1, :n], pad=enc.pad[b : b + 1, :n], encodings=[enc.encodings[b]])


REQUESTS = [None, CreditRequest(), CreditRequest(targets=(0, 3), contrast=False), CreditRequest(method="shares"),
            None, CreditRequest(targets=(2,))]


@pytest.mark.parametrize("space", [None, StackSpace()], ids=["fresh", "reused"])
def test_each_row_answers_as_its_head_alone(space: StackSpace | None) -> None:
    heads = random_heads(4)
    rows = [heads[k] for k in (0, 1, 2, 1, 3, 0)]  # a head may hold several rows
    enc = encoded([5, 9, 2, 9, 7, 4])
    with torch.inference_mode():
        for _ in range(2):  # a reused space holds the previous batch's parameters: overwritten, not mixed in
            got = classify(stack_heads(rows, space), enc, REQUESTS)
        for b, (head, req) in enumerate(zip(rows, REQUESTS, strict=True)):
            want = classify(head, one_row(enc, b), [req])
            torch.testing.assert_close(got.logits[b : b + 1].softmax(-1), want.logits.softmax(-1), atol=1e-6, rtol=0)
            g, w = got.explained[b], want.explained[0]
            assert (g is None) == (w is None) == (req is None)
            if g is None or w is None:
                continue
            assert g.targets == w.targets
            torch.testing.assert_close(g.credit, w.credit, atol=1e-5, rtol=0)
            if w.logit is not None:
                torch.testing.assert_close(g.logit, w.logit, atol=1e-5, rtol=0)
                torch.testing.assert_close(g.baseline, w.baseline, atol=1e-5, rtol=0)
                # the split stays exact: credit and baseline sum to the explained read-out
                torch.testing.assert_close(g.credit.sum((0, 1)) + g.baseline, g.logit, atol=1e-4, rtol=0)


def test_a_stack_of_one_head_per_row_is_a_copy_and_the_heads_are_untouched() -> None:
    heads = random_heads(2)
    before = [h.W.clone() for h in heads]
    stacked = stack_heads(heads)
    assert stacked.stacked and not heads[0].stacked
    assert stacked.W.shape == (2, D_DEPTH, D_EMB) and stacked.route[0].W_F2.shape == (2, D_EMB, 12)
    assert stacked.route[0].CONST_ones_over_n_out is heads[0].route[0].CONST_ones_over_n_out  # buffers shared
    assert all(torch.equal(h.W, w) for h, w in zip(heads, before, strict=True))
    assert torch.equal(stacked.rows(torch.tensor([1])).W[0], heads[1].W)


def test_heads_of_different_shapes_are_not_stacked() -> None:
    with pytest.raises(ValueError, match="different shapes"):
        stack_heads(random_heads(1, n_classes=3) + random_heads(1, n_classes=4))
