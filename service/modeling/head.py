"""RoutingHead (paper §5.2): three routings over the hidden states of every depth.

Indices: ``n`` token positions, ``e`` depths (``d_depth``), ``d`` embedding features, ``i`` input
vectors of the first routing (``i = n * d_depth``, position-major), ``j`` hidden vectors, ``k`` classes,
``t`` explained targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from service.routing import EfficientVectorRouting, credit
from service.routing.segments import Products, Segments, Slots

NORM_EPS = 1e-5
"""The per-depth layer norm's epsilon."""


@dataclass
class HeadOutput:
    """Scores, each routing's credit matrix, and what the value path needs.

    Attributes:
        scores: ``[..., n_classes]`` logits.
        phi: ``(phi1 [..., i, n_hid], phi2 [..., n_hid, n_hid], phi3 [..., n_hid, n_classes])``.
        absent: bool ``[..., i]``, True for the padding rows of ``phi1``.
        stack: the three routings with their inputs, ``phi`` and ``n`` (see :class:`credit.Routed`); the
            first routing's inputs as given, padding included (:meth:`RoutingHead.contributions` masks it).
        normed: ``[..., n, d_depth, d_emb]`` the hidden states layer-normed at each depth, from which
            :meth:`RoutingHead.x_lin` builds the part of the first routing's inputs that depends on them.
    """

    scores: torch.Tensor
    phi: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    absent: torch.Tensor
    stack: tuple[credit.Routed, credit.Routed, credit.Routed]
    normed: torch.Tensor

    def rows(self, idx: torch.Tensor, head: RoutingHead | None = None) -> HeadOutput:
        """The same output for the batch rows ``idx [b']`` only (``head``: the head of those rows, for a stacked
        head its :meth:`RoutingHead.rows`)."""
        if idx.numel() == self.scores.shape[0] and bool((idx == torch.arange(len(idx), device=idx.device)).all()):
            return self  # every row, in order: nothing to copy
        routings = [None] * 3 if head is None else list(head.route)
        stack = tuple(r.rows(idx, routing) for r, routing in zip(self.stack, routings, strict=True))
        return HeadOutput(scores=self.scores[idx], phi=tuple(p[idx] for p in self.phi),  # type: ignore[arg-type]
                          absent=self.absent[idx], stack=stack, normed=self.normed[idx])  # type: ignore[arg-type]


@dataclass
class Readout:
    """Read-outs of some targets as weights on the hidden states (see :meth:`RoutingHead.readouts`).

    Attributes:
        grad: ``[..., t, n, d_depth, d_emb]`` each hidden state's weight in the read-out, every routing's ``phi`` and
            every norm's scale held at their values: ``(grad * hidden).sum((-3, -2, -1)) + baseline == logit``.
        baseline: ``[..., t]`` the read-out with every hidden state at 0.
        logit: ``[..., t]`` the read-out itself.
    """

    grad: torch.Tensor
    baseline: torch.Tensor
    logit: torch.Tensor


@dataclass
class Contribution:
    """Value-path credit of some targets (see :meth:`RoutingHead.contributions`).

    Attributes:
        credit: ``[..., t, n, d_depth]`` each (position, depth)'s contribution, in logit units.
        baseline: ``[..., t]`` the read-out with every hidden state at 0 (phi and norm scales fixed).
        logit: ``[..., t]`` the read-out itself: ``credit.sum((-2, -1)) + baseline == logit``.
    """

    credit: torch.Tensor
    baseline: torch.Tensor
    logit: torch.Tensor


class RoutingHead(nn.Module):
    """Layer norm at each depth, learned per-depth scale ``W`` and bias ``B``, then three routings:
    ``(n=-1 -> n_hid, d_emb -> d_hid)``, ``(n_hid -> n_hid, d_hid -> d_hid)``,
    ``(n_hid -> n_classes, d_hid -> 1)``. Parameter names match the paper's published heads.

    A *stacked* head (:func:`stack_heads`) holds the parameters of several heads of one shape along a leading
    axis ``b`` (``W [b, e, d]``, ...): row ``b`` of a batch runs on head ``b``, in one computation.
    """

    def __init__(self, d_depth: int, d_emb: int, n_classes: int, n_hid: int = 64, d_hid: int | None = None,
                 n_iters: int = 2) -> None:
        super().__init__()
        d_hid = d_hid or d_emb
        self.d_depth, self.d_emb, self.n_classes, self.n_hid, self.d_hid = d_depth, d_emb, n_classes, n_hid, d_hid
        self.W = nn.Parameter(torch.ones(d_depth, d_emb))  # [ed]
        self.B = nn.Parameter(torch.zeros(d_depth, d_emb))  # [ed]
        self.route = nn.Sequential(
            EfficientVectorRouting(-1, n_hid, d_emb, d_hid, n_iters=n_iters, return_dict=True),
            EfficientVectorRouting(n_hid, n_hid, d_hid, d_hid, n_iters=n_iters, return_dict=True),
            EfficientVectorRouting(n_hid, n_classes, d_hid, 1, n_iters=n_iters, return_dict=True),
        )

    def forward(self, hidden: torch.Tensor, pad: torch.Tensor | None = None) -> HeadOutput:
        """Classify hidden states.

        Args:
            hidden: ``[..., n, d_depth, d_emb]`` hidden states of every depth.
            pad: optional bool ``[..., n]``, True at padding positions (absent in the first routing); None where
                there is none.

        Returns:
            :class:`HeadOutput`.
        """
        masked = pad is not None  # no padding, no mask: the same routing in fewer operations (known on the host)
        if pad is None:
            pad = torch.zeros(hidden.shape[:-2], dtype=torch.bool, device=hidden.device)  # [...n]
        W, B = self.W.unsqueeze(-3), self.B.unsqueeze(-3)  # [1ed] (stacked: [b1ed])
        normed = nn.functional.layer_norm(hidden, (self.d_emb,), eps=NORM_EPS)  # [...ned] each depth normed
        x = torch.addcmul(B, normed, W).flatten(-3, -2)  # [...id] scaled, plus each depth's bias; positions x depths
        absent = pad[..., None].expand(*pad.shape, self.d_depth).flatten(-2)  # [...i]
        mask = absent[..., None].expand(*absent.shape, self.n_hid) if masked else None  # [...ij]
        r1 = self.route[0](x, mask=mask)
        r2 = self.route[1](r1["x_out"])
        r3 = self.route[2](r2["x_out"])
        scores = r3["x_out"].squeeze(-1)  # [...k]
        n1 = (~absent).sum(dim=-1).clamp(min=1).to(x.dtype)[..., None, None]  # [...11] present inputs
        n_hid = x.new_tensor(float(self.n_hid))  # [] inputs of routings 2 and 3
        stack = (credit.Routed(self.route[0], x, r1["phi"], n1, r1["x_out_raw"]),
                 credit.Routed(self.route[1], r1["x_out"], r2["phi"], n_hid, r2["x_out_raw"]),
                 credit.Routed(self.route[2], r2["x_out"], r3["phi"], n_hid, r3["x_out_raw"]))
        return HeadOutput(scores=scores, phi=(r1["phi"], r2["phi"], r3["phi"]), absent=absent, stack=stack,
                          normed=normed)

    def scores_packed(self, hidden: torch.Tensor, n_t: torch.Tensor, slot: torch.Tensor | None = None,
                      products: Products | None = None) -> torch.Tensor:
        """The scores :meth:`forward` gives each text alone, for texts lying back to back without padding: the
        first routing over every text's inputs in one packed call (:meth:`EfficientVectorRouting.forward_packed`),
        the other two on the batch. No credit (it reads the padded :class:`HeadOutput`).

        Args:
            hidden: ``[T, d_depth, d_emb]`` every text's hidden states, text after text.
            n_t: int64 ``[b]`` each text's positions (on ``hidden``'s device; they sum to ``T``; a text of none has
                no defined scores, and leaves the others' as they are).
            slot: with a stacked head (``S`` heads' parameters, see :class:`HeadSlots`), int64 ``[b]`` the head of
                each text, non-decreasing (the texts sorted by head); None with one head.
            products: the routings' matrix products (see :class:`~service.routing.segments.Products`; the later
                routings then packed too, on fixed segments); None: torch's.

        Returns:
            ``[b, n_classes]`` logits.

        Raises:
            RuntimeError: the grouped product the packed routing needs does not run here.
        """
        if (slot is not None) != self.stacked:
            raise ValueError("a stacked head needs each text's slot, and only a stacked head takes them")
        normed = nn.functional.layer_norm(hidden, (self.d_emb,), eps=NORM_EPS)  # [Ted] each depth normed
        T, b = hidden.shape[0], n_t.shape[0]
        if slot is None:
            x = torch.addcmul(self.B, normed, self.W)  # [Ted]
            segments = Segments.of(n_t * self.d_depth, T * self.d_depth, normed.dtype)
            x1 = self.route[0].forward_packed(x.flatten(0, 1), segments, products=products)  # [bjh]
            if products is None:
                x2 = self.route[1](x1)["x_out"]  # [bjh]
                return self.route[2](x2)["x_out"].squeeze(-1)  # [bk]
            fixed = Segments.fixed(b, self.n_hid, x.dtype, x.device)  # the later routings' inputs: n_hid each
            x2 = self.route[1].forward_packed(x1.flatten(0, 1), fixed, products=products)  # [bjh]
            return self.route[2].forward_packed(x2.flatten(0, 1), fixed, products=products).squeeze(-1)  # [bk]
        S = self.W.shape[0]
        own = torch.repeat_interleave(slot, n_t, output_size=T)  # [T] each position's head
        x = torch.addcmul(self.B[own], normed, self.W[own])  # [Ted] scaled by its head, plus its bias
        counts = n_t * self.d_depth  # [b]
        x1 = self.route[0].forward_packed(x.flatten(0, 1), Segments.of(counts, T * self.d_depth, x.dtype),
                                          Slots.of(slot, counts, S), products)  # [bjh]
        segments = Segments.fixed(b, self.n_hid, x.dtype, x.device)  # the later routings' inputs: n_hid each
        slots = Slots.of(slot, segments.n.to(torch.int64), S)
        x2 = self.route[1].forward_packed(x1.flatten(0, 1), segments, slots, products)  # [bjh]
        return self.route[2].forward_packed(x2.flatten(0, 1), segments, slots, products).squeeze(-1)  # [bk]

    def contributions(self, out: HeadOutput, targets: torch.Tensor, contrast: bool = True) -> Contribution:
        """Exact value-path credit of ``targets`` over (position, depth), in logit units.

        With every routing's ``phi`` and every norm's scale (the per-depth norm of the hidden states
        and the output norms of routings 1 and 2) held at their values in this forward pass, the head
        is an affine map of the hidden states ``h [n, e, d]``, and the credit of (n, e) for target k is
        ``sum_d (d logit_k / d h)[n, e, d] * h[n, e, d]``; the credits sum to ``logit_k - baseline_k``.

        Args:
            out: a forward pass's output.
            targets: ``[..., t]`` class indices to explain for each sample.
            contrast: explain ``logit_k - mean_k' logit_k'`` (what moves the probabilities) instead of
                ``logit_k``.

        Returns:
            :class:`Contribution` with ``credit [..., t, n, d_depth]`` (0 at padding).
        """
        readout = self._readout(out, targets, contrast)  # [...tk]
        x_lin = self.x_lin(out)  # [...id]
        x_const = self._x_const(out)  # [id] (stacked: [bid])
        contrib, baseline = credit.value_path(out.stack, x_lin, readout[..., None], x_const)  # [...ti], [...t]
        # padding takes no part (its phi is 0), but whatever it holds must not turn 0 * value into NaN
        contrib = contrib.masked_fill(out.absent[..., None, :], 0.0)  # [...ti]
        logit = torch.einsum("...tk,...k->...t", readout, out.scores)  # [...t]
        return Contribution(credit=contrib.unflatten(-1, (-1, self.d_depth)), baseline=baseline, logit=logit)

    def readouts(self, out: HeadOutput, hidden: torch.Tensor, targets: torch.Tensor, contrast: bool = True) -> Readout:
        """The read-outs :meth:`contributions` splits, as weights on the hidden states ``hidden [..., n, d_depth,
        d_emb]`` of ``out``'s forward pass: every ``phi`` and norm scale held, the head is affine in them, and
        ``grad`` is its linear part. What an end-to-end split carries on through the backbone.

        Args:
            out: the forward pass's output on ``hidden``.
            hidden: ``[..., n, d_depth, d_emb]`` its input.
            targets: ``[..., t]`` class indices.
            contrast: as in :meth:`contributions`.

        Returns:
            :class:`Readout` with ``grad [..., t, n, d_depth, d_emb]`` (0 at padding).
        """
        readout = self._readout(out, targets, contrast)  # [...tk]
        g, baseline = credit.input_readouts(out.stack, readout[..., None], self._x_const(out))  # [...tid], [...t]
        g = g.masked_fill(out.absent[..., None, :, None], 0.0)  # [...tid] padding takes no part
        g = g.unflatten(-2, (-1, self.d_depth)) * self.W.unsqueeze(-3).unsqueeze(-4)  # [...tned] weights on normed
        # the per-depth norm, its scale held: normed = (hidden - mean_d hidden) * scale, self-adjoint in d
        scale = credit.norm_scale(hidden, NORM_EPS)  # [...ne1]
        grad = (g - g.mean(dim=-1, keepdim=True)) * scale.unsqueeze(-4)  # [...tned]
        logit = torch.einsum("...tk,...k->...t", readout, out.scores)  # [...t]
        return Readout(grad=grad, baseline=baseline, logit=logit)

    def _readout(self, out: HeadOutput, targets: torch.Tensor, contrast: bool) -> torch.Tensor:
        """``[..., t, k]`` the weights of each target's read-out on the scores (its logit, or in contrast form,
        less the mean logit)."""
        readout = nn.functional.one_hot(targets, self.n_classes).to(out.scores.dtype)  # [...tk]
        return readout - 1.0 / self.n_classes if contrast else readout  # [...tk]

    def _x_const(self, out: HeadOutput) -> torch.Tensor:
        """``[i, d_emb]`` (stacked: ``[b, i, d_emb]``) the first routing's inputs less :meth:`x_lin`: each depth's bias
        ``B``, the same for every sample."""
        n = out.absent.shape[-1] // self.d_depth
        return self.B.unsqueeze(-3).expand(*self.B.shape[:-2], n, -1, -1).flatten(-3, -2)  # [id] (stacked: [bid])

    def x_lin(self, out: HeadOutput) -> torch.Tensor:
        """``[..., i, d_emb]`` the first routing's inputs of ``out`` (this head's forward pass) less the per-depth bias
        ``B``: the part that depends on the hidden states (padding rows unmasked). Built when credit asks for it:
        classifying alone computes the inputs in one pass, scale and bias together."""
        return (out.normed * self.W.unsqueeze(-3)).flatten(-3, -2)  # [...id]

    @property
    def stacked(self) -> bool:
        """Whether this head holds several heads' parameters (see :func:`stack_heads`)."""
        return self.W.dim() == 3

    def rows(self, idx: torch.Tensor) -> RoutingHead:
        """The head of batch rows ``idx [b']``: this one, or of a stacked head, its rows ``idx``."""
        if not self.stacked:
            return self
        return _assemble(self, {name: p[idx] for name, p in self.named_parameters()})


class StackSpace:
    """Memory that :func:`stack_heads` reuses from batch to batch. Stacking 32 bundled-size heads copies 115 MB:
    into fresh memory that took 39 ms here (page faults), into memory reused 5 ms."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, name: str, like: torch.Tensor, b: int) -> torch.Tensor:
        """``[b, *like.shape]`` memory for parameter ``name`` (grown when a batch needs more rows)."""
        key = (name, tuple(like.shape), like.dtype, like.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape[0] < b:
            buffer = self._buffers[key] = like.new_empty(b, *like.shape)  # [b...]
        return buffer[:b]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())


def stack_heads(heads: Sequence[RoutingHead], space: StackSpace | None = None) -> RoutingHead:
    """One head whose batch row ``b`` runs on ``heads[b]`` (heads of one shape): their parameters stacked along a
    new leading axis (``W [b, e, d]``, ...; a copy of every row's parameters, into ``space`` when given: the
    result is then valid until the next call with it). Exact against each head alone up to float rounding."""
    first = heads[0]
    shape = head_shape(first)
    if any(head_shape(h) != shape for h in heads):
        raise ValueError(f"heads of different shapes cannot be stacked: {sorted({head_shape(h) for h in heads})}")
    params = [dict(h.named_parameters()) for h in heads]
    stacked = {}
    for name, like in params[0].items():
        rows = [p[name] for p in params]
        stacked[name] = torch.stack(rows) if space is None else torch.stack(rows, out=space.take(name, like, len(rows)))
    return _assemble(first, stacked)


class HeadSlots:
    """Heads of one shape in ``capacity`` slots of stacked parameters (``W [capacity, e, d]``, ...), allocated once:
    a head put in a slot is copied into it, in place, so that a computation recorded on :attr:`head` (a CUDA graph)
    reads it without being recorded again, and a head taken out leaves its slot free. Texts choose their head by
    slot (see :meth:`RoutingHead.scores_packed`); an empty slot holds zeros (finite scores nobody reads)."""

    def __init__(self, like: RoutingHead, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.shape = head_shape(like)
        self.head = _assemble(like, {name: p.new_zeros(capacity, *p.shape) for name, p in like.named_parameters()})
        self._params = dict(self.head.named_parameters())
        self.picked = _assemble(like, {name: p.new_zeros(p.shape) for name, p in like.named_parameters()})
        """One head, not stacked: the slot :meth:`pick` copied into it last."""
        self._picked = dict(self.picked.named_parameters())
        self.slot_of: dict[str, int] = {}

    @property
    def capacity(self) -> int:
        return self.head.W.shape[0]

    @torch.no_grad()
    def put(self, key: str, head: RoutingHead) -> int | None:
        """``head``'s parameters copied into a free slot (its old one where ``key`` holds one already); the slot, or
        None where every slot is taken.

        Raises:
            ValueError: ``head`` is not of this shape.
        """
        if head_shape(head) != self.shape:
            raise ValueError(f"a head of shape {head_shape(head)} in slots of shape {self.shape}")
        slot = self.slot_of.get(key)
        if slot is None:
            free = sorted(set(range(self.capacity)) - set(self.slot_of.values()))
            if not free:
                return None
            slot = free[0]
        for name, value in head.named_parameters():
            self._params[name][slot].copy_(value)
        self.slot_of[key] = slot
        return slot

    @torch.no_grad()
    def pick(self, slot: torch.Tensor) -> RoutingHead:
        """:attr:`picked` holding slot ``slot``'s parameters (``slot``: int64 ``[1]`` on the device, read there and
        nothing read back, so that a CUDA graph captures the copy): for a batch whose texts all ask one head, which
        then runs with its parameters broadcast where the stacked head gathers every text's (``W [T, e, d]``, ...)."""
        for name, p in self._params.items():
            torch.index_select(p, 0, slot, out=self._picked[name].unsqueeze(0))  # [1 ...] into the picked head's
        return self.picked

    @torch.no_grad()
    def drop(self, key: str) -> None:
        """Head ``key``'s slot freed (zeroed); nothing where it holds none."""
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            for p in self._params.values():
                p[slot].zero_()


def head_shape(head: RoutingHead) -> tuple[int, ...]:
    """What heads must share to be stacked: ``(d_depth, d_emb, n_classes, n_hid, d_hid, n_iters)``."""
    return head.d_depth, head.d_emb, head.n_classes, head.n_hid, head.d_hid, head.route[0].n_iters


def _assemble(like: RoutingHead, params: dict[str, torch.Tensor]) -> RoutingHead:
    """A head shaped as ``like`` holding ``params`` (by name; not copied), and ``like``'s buffers (shared)."""
    with torch.device("meta"):  # the structure only: nothing allocated, nothing initialised
        head = RoutingHead(like.d_depth, like.d_emb, like.n_classes, like.n_hid, like.d_hid, like.route[0].n_iters)
    for name, value in params.items():
        owner, _, leaf = name.rpartition(".")
        head.get_submodule(owner)._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    for name, value in like.named_buffers():
        owner, _, leaf = name.rpartition(".")
        head.get_submodule(owner)._buffers[leaf] = value
    return head
