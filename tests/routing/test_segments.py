"""Samples of different lengths routed back to back (``forward_packed``): each routed as it is alone."""

import copy

import pytest
import torch

from service.routing import EfficientVectorRouting, segments
from service.routing.segments import Segments, Slots, contract, per_sample, sum_by_sample, times_slot

LENGTHS = [1, 4, 9, 2, 4]


def segments_of(lengths: list[int], dtype: torch.dtype = torch.float32) -> Segments:
    return Segments.of(torch.tensor(lengths), sum(lengths), dtype)


def test_the_segments_of_counts() -> None:
    s = segments_of([2, 1, 3])
    assert s.ends.tolist() == [2, 3, 6] and s.ends.dtype == torch.int32
    assert s.index.tolist() == [0, 0, 1, 2, 2, 2]
    assert s.n.tolist() == [2.0, 1.0, 3.0] and s.samples == 3


def test_the_grouped_products_are_each_samples_own() -> None:
    gen = torch.Generator().manual_seed(0)
    s = segments_of(LENGTHS)
    a, b = torch.randn(sum(LENGTHS), 8, generator=gen), torch.randn(sum(LENGTHS), 4, generator=gen)
    m = torch.randn(len(LENGTHS), 8, 4, generator=gen)
    got_contract, got_per_sample, got_sum = contract(a, b, s), per_sample(a, m, s), sum_by_sample(a, s)
    for k, (a_k, b_k) in enumerate(zip(a.split(LENGTHS), b.split(LENGTHS), strict=True)):
        torch.testing.assert_close(got_contract[k], a_k.T @ b_k)
        torch.testing.assert_close(got_per_sample.split(LENGTHS)[k], a_k @ m[k])
        torch.testing.assert_close(got_sum[k], a_k.sum(dim=0))


@pytest.mark.parametrize("max_groups", [2, 3, 4])
def test_more_groups_than_one_call_takes_go_in_parts_with_the_same_products(max_groups: int,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU's grouped product takes fewer than 1024 groups (a shape bucket of 1,456 samples, a thousand heads'
    slots): more go in parts of ``MAX_GROUPS``, each sample's product the one it has in a single call (empty samples
    and a transposed operand too)."""
    lengths = [3, 0, 1, 4, 2, 2, 0, 5, 1, 3, 2]
    gen = torch.Generator().manual_seed(0)
    s = segments_of(lengths)
    a, b = torch.randn(sum(lengths), 8, generator=gen), torch.randn(sum(lengths), 16, generator=gen)
    m = torch.randn(len(lengths), 8, 16, generator=gen)
    y, w = torch.randn(len(lengths), 2, 8, generator=gen), torch.randn(len(lengths), 8, 16, generator=gen)
    slots = Slots.of(torch.arange(len(lengths)), torch.tensor(lengths), len(lengths))
    rows = (slots.sample_ends * 2).to(torch.int32)
    whole = contract(a, b, s), per_sample(a, m, s), times_slot(y, w, slots, rows)
    monkeypatch.setattr(segments, "MAX_GROUPS", max_groups)
    calls = []
    grouped = torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm",
                        lambda *args, **kw: calls.append(kw["offs"].shape[0]) or grouped(*args, **kw))
    parts = contract(a, b, s), per_sample(a, m, s), times_slot(y, w, slots, rows)
    assert calls and max(calls) <= max_groups and len(calls) == 3 * -(-len(lengths) // (max_groups - 1))
    for got, want in zip(parts, whole, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("public", [True, False])
def test_the_grouped_products_follow_autocast_through_either_of_torchs_functions(public: bool,
                                                                                 monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    """Under autocast the grouped products run in its dtype, as its other matrix products do (autocast leaves them
    out: float32 operands would take a per-group product on a GPU); a torch without the public function runs the
    operator underneath it."""
    if not public:
        monkeypatch.delattr(torch.nn.functional, "grouped_mm")
    gen = torch.Generator().manual_seed(0)
    s = segments_of(LENGTHS)
    a, b = torch.randn(sum(LENGTHS), 8, generator=gen), torch.randn(sum(LENGTHS), 8, generator=gen)
    assert contract(a, b, s).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = contract(a, b, s)  # [B 8 8]
    assert got.dtype == torch.bfloat16
    want = contract(a.bfloat16(), b.bfloat16(), s)  # the same product, its operands rounded
    assert torch.equal(got, want) and not torch.equal(got.float(), contract(a, b, s))


@pytest.mark.parametrize("n_iters", [1, 2, 3])
@pytest.mark.parametrize(("d_out", "normalize"), [(5, True), (5, False), (1, True)])
def test_a_packed_batch_routes_each_sample_as_it_is_alone(n_iters: int, d_out: int, normalize: bool) -> None:
    torch.manual_seed(0)
    m = EfficientVectorRouting(-1, 4, 8, d_out, n_iters=n_iters, normalize=normalize)
    with torch.no_grad():  # non-zero biases so every parameter is exercised
        for name, prm in m.named_parameters():
            if "B_" in name or "bias" in name:
                prm.normal_(std=0.3)
    x = torch.randn(sum(LENGTHS), 8, generator=torch.Generator().manual_seed(1))  # [I d]
    packed = m.forward_packed(x, segments_of(LENGTHS))  # [B j h]
    alone = torch.stack([m(x_b) for x_b in x.split(LENGTHS)])  # [B j h]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)
    # and as the padded, masked batch routes them
    N = max(LENGTHS)
    padded = torch.zeros(len(LENGTHS), N, 8)
    for b, x_b in enumerate(x.split(LENGTHS)):
        padded[b, : len(x_b)] = x_b
    absent = torch.arange(N)[None, :] >= torch.tensor(LENGTHS)[:, None]  # [B N]
    torch.testing.assert_close(packed, m(padded, mask=absent[..., None].expand(-1, -1, 4)), rtol=1e-5, atol=1e-6)


def test_a_routing_of_fixed_inputs_packs_as_each_sample_alone_and_stacked_by_slot() -> None:
    torch.manual_seed(0)
    routings = [EfficientVectorRouting(3, 4, 8, 5) for _ in range(3)]
    x = torch.randn(4 * 3, 8)  # [I d] four samples of three inputs
    alone = [m(x_b) for m, x_b in zip([routings[0]] * 4, x.split(3), strict=True)]
    segments = Segments.fixed(4, 3, x.dtype, x.device)
    torch.testing.assert_close(routings[0].forward_packed(x, segments), torch.stack(alone), rtol=1e-5, atol=1e-6)
    stacked = stack_heads_like(routings)
    slot = torch.tensor([0, 1, 1, 2])  # sorted by slot
    got = stacked.forward_packed(x, segments, Slots.of(slot, torch.full((4,), 3), 3))  # [B j h]
    want = torch.stack([routings[int(s)](x_b) for s, x_b in zip(slot, x.split(3), strict=True)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="slots"):
        routings[0].forward_packed(x, segments, Slots.of(slot, torch.full((4,), 3), 3))
    with pytest.raises(ValueError, match="slots"):
        stacked.forward_packed(x, segments)


def stack_heads_like(routings: list[EfficientVectorRouting]) -> EfficientVectorRouting:
    """One routing holding ``routings``' parameters stacked along a leading axis."""
    out = copy.deepcopy(routings[0])
    for name, _ in routings[0].named_parameters():
        owner, _, leaf = name.rpartition(".")
        module = out.get_submodule(owner) if owner else out
        module._parameters[leaf] = torch.nn.Parameter(
            torch.stack([r.get_parameter(name) for r in routings]).detach(), requires_grad=False)
    return out


@pytest.mark.parametrize("stacked", [False, True])
def test_under_autocast_a_packed_routing_casts_its_inputs_once_and_routes_as_each_product_casting_them(
        stacked: bool) -> None:
    """The ``[I, d]`` inputs go to every matrix product in autocast's dtype: cast once (a pass over the batch's
    largest tensor that autocast would otherwise make for each product: four stacked, six not, in two iterations), the
    same values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    routings = [EfficientVectorRouting(-1, 8, 16, 16, n_iters=2) for _ in range(3)]
    m = stack_heads_like(routings) if stacked else routings[0]
    slots = Slots.of(torch.tensor([0, 0, 1, 2, 2]), torch.tensor(LENGTHS), 3) if stacked else None
    x = torch.randn(sum(LENGTHS), 16)  # [I d]
    casts: list[torch.Size] = []

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func._overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to) and args[0] is x:
                casts.append(args[0].shape)
            return func(*args, **(kwargs or {}))

    with torch.autocast("cpu", dtype=torch.bfloat16), Casts():
        got = m.forward_packed(x, segments_of(LENGTHS), slots)  # [B j h]
    assert casts == [x.shape]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # each product casting the inputs itself: the same values
        want = m.forward_packed(x.bfloat16(), segments_of(LENGTHS), slots)
    assert torch.equal(got, want)
