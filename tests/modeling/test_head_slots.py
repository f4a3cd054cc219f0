"""Heads of one shape in stacked slots (``HeadSlots``), each text on its own head in one packed call: every text's
scores are its head's alone, a head put in later changes no slot's storage, and empty texts (a bucket's filler)
leave the others' scores as they are."""

import pytest
import torch

from service.modeling.head import HeadSlots, RoutingHead


def make_head(seed: int, n_classes: int = 4) -> RoutingHead:
    torch.manual_seed(seed)
    head = RoutingHead(d_depth=3, d_emb=16, n_classes=n_classes, n_hid=8, d_hid=12).eval()
    with torch.no_grad():
        head.B.normal_(std=0.3)  # the per-depth bias takes part
        head.W.normal_(mean=1.0, std=0.2)
    return head


def test_each_text_scores_on_its_own_head_in_one_packed_call() -> None:
    heads = [make_head(s) for s in range(3)]
    slots = HeadSlots(heads[0], capacity=4)
    for k, h in enumerate(heads):
        assert slots.put(f"h{k}", h) == k
    storage = [p.data_ptr() for p in slots.head.parameters()]
    lengths = [5, 1, 7, 3, 2, 0, 0]  # the last two: filler without positions
    owner = [0, 0, 1, 2, 2, 3, 3]  # sorted by slot; filler on the last (empty) slot
    hidden = torch.randn(sum(lengths), 3, 16, generator=torch.Generator().manual_seed(1))  # [T e d]
    with torch.inference_mode():
        got = slots.head.scores_packed(hidden, torch.tensor(lengths), torch.tensor(owner))  # [b k]
        alone = torch.cat([heads[o](h[None]).scores for h, o in zip(hidden.split(lengths[:5]), owner, strict=False)])
    torch.testing.assert_close(got[:5], alone, rtol=1e-5, atol=1e-5)
    # a head put in later takes a free slot in place: what a captured graph reads is where it was
    late = make_head(7)
    assert slots.put("late", late) == 3
    assert [p.data_ptr() for p in slots.head.parameters()] == storage
    with torch.inference_mode():
        again = slots.head.scores_packed(hidden[:5], torch.tensor([5]), torch.tensor([3]))  # [1 k]
        torch.testing.assert_close(again, late(hidden[None, :5]).scores, rtol=1e-5, atol=1e-5)
    assert slots.put("full", make_head(8)) is None  # every slot taken
    slots.drop("h1")
    assert slots.put("full", make_head(8)) == 1 and slots.put("late", make_head(9)) == 3  # freed; replaced in place


def test_slots_refuse_heads_of_another_shape_and_a_plain_head_refuses_slots() -> None:
    slots = HeadSlots(make_head(0), capacity=2)
    with pytest.raises(ValueError, match="shape"):
        slots.put("other", make_head(1, n_classes=3))
    with pytest.raises(ValueError, match="slot"):
        make_head(0).scores_packed(torch.zeros(2, 3, 16), torch.tensor([2]), torch.tensor([0]))
