"""EfficientVectorRouting: the paper's Algorithm 2 (§4), with lazy contraction of votes (Appendix C).

Notation: ``i`` input vectors, ``j`` output vectors, ``d`` input features, ``h`` output features,
``...`` batch. ``f`` is the logistic function and ``N`` a layer norm without affine parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from service.routing import segments as seg
from service.routing.masking import Mask, build_mask, check_config, d_step, flat_prior, route, zero_absent


class EfficientVectorRouting(nn.Module):
    """Route ``[..., n_inp, d_inp]`` input vectors to ``[..., n_out, d_out]`` output vectors.

    Parameter names, shapes and initialisation match the reference library, so its state dicts
    load with ``strict=True``. Every parameter may also carry the batch's leading axes (``[..., i, d]`` for
    ``W_A [i, d]``, and so on; see ``service.modeling.head.stack_heads``): then each sample routes with its
    own parameters.

    Args:
        n_inp: number of input vectors, or -1 for variable length (then ``beta_use`` and
            ``beta_ign`` are computed from each input vector by linear layers).
        n_out: number of output vectors (>= 2).
        d_inp: size of input vectors.
        d_out: size of output vectors.
        n_iters: routing iterations (>= 1).
        normalize: layer-normalise the final output vectors (identity when ``d_out == 1``).
        memory_efficient: never materialise the ``[..., i, j, h]`` votes (Appendix C).
        return_dict: return every internal tensor, including ``phi``, instead of ``x_out``.
    """

    def __init__(
        self,
        n_inp: int,
        n_out: int,
        d_inp: int,
        d_out: int,
        n_iters: int = 2,
        normalize: bool = True,
        memory_efficient: bool = True,
        return_dict: bool = False,
    ) -> None:
        super().__init__()
        check_config(n_inp, n_out, n_iters)
        m = max(1, n_inp)
        self.n_inp, self.n_out, self.d_inp, self.d_out, self.n_iters = n_inp, n_out, d_inp, d_out, n_iters
        self.normalize, self.memory_efficient, self.return_dict = normalize, memory_efficient, return_dict
        self.register_buffer("CONST_ones_over_n_out", torch.ones(n_out) / n_out)  # [j]
        self.W_A = nn.Parameter(torch.empty(m, d_inp).normal_(std=2.0 * d_inp**-0.5))  # [id]
        self.B_A = nn.Parameter(torch.zeros(m))  # [i]
        self.W_F1 = nn.Parameter(torch.empty(n_out, d_inp).normal_())  # [jd]
        self.W_F2 = nn.Parameter(torch.empty(d_inp, d_out).normal_(std=2.0 * d_inp**-0.5))  # [dh]
        self.B_F2 = nn.Parameter(torch.zeros(n_out, d_out))  # [jh]
        self.W_G1 = nn.Parameter(torch.empty(d_out, d_inp).normal_(std=d_out**-0.5))  # [hd]
        self.W_G2 = nn.Parameter(torch.empty(n_out, d_inp).normal_())  # [jd]
        self.B_G2 = nn.Parameter(torch.zeros(n_out, d_inp))  # [jd]
        self.W_S = nn.Parameter(torch.empty(m, n_out).normal_(std=d_inp**-0.5))  # [ij]
        self.B_S = nn.Parameter(torch.zeros(m, n_out))  # [ij]
        if n_inp > 0:
            self.beta_use = nn.Parameter(torch.empty(n_inp, n_out).normal_())  # [ij]
            self.beta_ign = nn.Parameter(torch.empty(n_inp, n_out).normal_())  # [ij]
        else:
            self.compute_beta_use = nn.Linear(d_inp, n_out)
            self.compute_beta_ign = nn.Linear(d_inp, n_out)
        self.N: nn.Module = nn.LayerNorm(d_out, elementwise_affine=False) if d_out > 1 else nn.Identity()

    def extra_repr(self) -> str:
        names = ["n_inp", "n_out", "d_inp", "d_out", "n_iters"]
        names += ["normalize", "memory_efficient", "return_dict"]
        return ", ".join(f"{k}={getattr(self, k)}" for k in names)

    def _betas(self, x_inp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``beta_use, beta_ign``: parameters ``[i, j]``, or computed ``[..., i, j]`` for variable n."""
        if self.n_inp > 0:
            return self.beta_use, self.beta_ign  # [ij] or stacked [...ij]
        use, ign = self.compute_beta_use, self.compute_beta_ign
        if use.weight.dim() == 2:  # one routing's parameters
            return use(x_inp), ign(x_inp)  # [...ij], [...ij]
        return (torch.einsum("...id,...jd->...ij", x_inp, use.weight) + use.bias[..., None, :],  # [...ij]
                torch.einsum("...id,...jd->...ij", x_inp, ign.weight) + ign.bias[..., None, :])  # [...ij]

    def _activations(self, x_inp: torch.Tensor) -> torch.Tensor:
        """``[..., i]`` each input's dot product with its row of ``W_A`` (one row shared by every input when ``n``
        is variable: then a matrix-vector product, without an ``[..., i, d]`` product in between)."""
        if self.W_A.shape[-2] == 1:
            return (x_inp @ self.W_A.transpose(-1, -2))[..., 0]  # [...i]
        return (x_inp * self.W_A).sum(dim=-1)  # [...i]

    def _check(self, x_inp: torch.Tensor) -> None:
        if x_inp.dim() < 2 or x_inp.shape[-1] != self.d_inp:
            raise ValueError(f"x_inp must be [..., n_inp, d_inp={self.d_inp}], got {list(x_inp.shape)}")
        if self.n_inp > 0 and x_inp.shape[-2] != self.n_inp:
            raise ValueError(f"expected n_inp={self.n_inp} input vectors, got {x_inp.shape[-2]}")

    def forward(self, x_inp: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor | dict[str, Any]:
        """Route input vectors.

        Args:
            x_inp: ``[..., n, d_inp]`` input vectors.
            mask: optional bool ``[n, n_out]`` or ``[..., n, n_out]``; True hides input i from
                output j. Inputs masked for every output are absent (see ``service.routing.masking``).

        Returns:
            ``x_out [..., n_out, d_out]``, or with ``return_dict`` a dict holding ``a_inp [...i]``,
            ``V [...ijh]`` (None when memory-efficient), ``pred_x_inp [...jd]`` and ``S [...ij]``
            (None after a single iteration), ``R``, ``D_use``, ``D_ign``, ``phi`` (each ``[...ij]``),
            ``x_out_raw [...jh]`` (the last M-step's output, before the final norm) and ``x_out [...jh]``.
        """
        self._check(x_inp)
        m: Mask | None = build_mask(mask, x_inp, self.n_out)
        x_inp = zero_absent(x_inp, m)  # [...id]
        beta_use, beta_ign = self._betas(x_inp)  # [...ij], [...ij]
        # (filled on the device, not copied from the host: a CUDA graph captures it)
        n = x_inp.new_full((), float(x_inp.shape[-2])) if m is None else m.n  # [] or [...11]
        # F1 scales the inputs by 1/sqrt(n); what is linear in them is scaled after contracting over d or i
        # instead (the same values up to rounding, and no pass over [..., i, d] for it)
        scale = n.rsqrt()  # [] or [...11]
        scale_i = scale if scale.dim() == 0 else scale[..., 0]  # [] or [...1]
        a_inp = torch.addcmul(self.B_A, self._activations(x_inp), scale_i)  # [...i]
        f_a = torch.sigmoid(a_inp)[..., None]  # [...i1]
        V = None
        if not self.memory_efficient:
            V = torch.einsum("...id,...jd,...dh->...ijh", x_inp * scale, self.W_F1, self.W_F2)  # [...ijh]
            V = V + self.B_F2.unsqueeze(-3)  # [...ijh]

        pred_x_inp = S = None
        R = flat_prior(self.CONST_ones_over_n_out, m)  # [j] or [...ij] E-step of iteration 1: flat prior
        for iteration in range(self.n_iters):
            # D-step: shares of data used and ignored.
            D_use, D_ign = d_step(f_a, R, m)  # [...ij], [...ij]

            # M-step: "bang per bit" coefficients, then contract the votes.
            phi = beta_use * D_use - beta_ign * D_ign  # [...ij]
            if V is None:
                phi_x = torch.einsum("...ij,...id->...jd", phi, x_inp)  # [...jd] contract over i first
                x_out = torch.einsum("...jd,...jd,...dh->...jh", phi_x, self.W_F1, self.W_F2)  # [...jh]
                x_out = torch.addcmul(phi.sum(dim=-2)[..., None] * self.B_F2, x_out, scale)  # [...jh] scaled, + bias
            else:
                x_out = torch.einsum("...ij,...ijh->...jh", phi, V)  # [...jh]

            # E-step of the next iteration: score how well each output predicts each input.
            if iteration + 1 < self.n_iters:
                x_hat = torch.einsum("...jh,...hd->...jd", self.N(x_out), self.W_G1)  # [...jd]
                pred_x_inp = x_hat * self.W_G2 + self.B_G2  # [...jd]
                dots = torch.einsum("...id,...jd->...ij", x_inp, pred_x_inp)  # [...ij]
                S = nn.functional.logsigmoid(dots * self.W_S + self.B_S)  # [...ij]
                R = route(S, m)  # [...ij]

        x_out_raw = x_out  # [...jh]
        if self.normalize:
            x_out = self.N(x_out)  # [...jh]

        if not self.return_dict:
            return x_out
        return {
            "a_inp": a_inp, "V": V, "pred_x_inp": pred_x_inp, "S": S, "R": R.expand_as(D_use),
            "D_use": D_use, "D_ign": D_ign, "phi": phi, "x_out_raw": x_out_raw, "x_out": x_out,
        }

    def forward_packed(self, x_inp: torch.Tensor, segments: seg.Segments, slots: seg.Slots | None = None,
                       products: seg.Products | None = None) -> torch.Tensor:
        """Route samples of different lengths lying back to back (see :mod:`service.routing.segments`), each as
        :meth:`forward` routes it alone: the same ``x_out`` up to float rounding, no padding, one call for the batch.
        With a fixed ``n`` every sample has ``n_inp`` inputs.

        Args:
            x_inp: ``[I, d_inp]`` every sample's input vectors, sample after sample.
            segments: where each sample's inputs lie.
            slots: with stacked parameters (every parameter ``[S, ...]``, see ``service.modeling.head.stack_heads``),
                the slot each sample routes with (the samples sorted by slot); None with one routing's parameters.
            products: the matrix products to compute with (see :class:`~service.routing.segments.Products`); None:
                torch's.

        Returns:
            ``x_out [B, n_out, d_out]``.

        Raises:
            RuntimeError: the grouped product does not run here (see :func:`service.routing.segments.contract`).
        """
        stacked = self.W_F1.dim() == 3
        if stacked != (slots is not None) or self.W_F1.dim() not in (2, 3):
            raise ValueError("a packed routing takes slots exactly when its parameters are stacked")
        if x_inp.dim() != 2 or x_inp.shape[-1] != self.d_inp:
            raise ValueError(f"x_inp must be [I, d_inp={self.d_inp}], got {list(x_inp.shape)}")
        scale = segments.n.rsqrt()  # [B]
        # the products' operand, cast once (under autocast each product would cast the [I, d] inputs again, to the
        # same values); what is elementwise in the inputs reads them as they are
        x_mm = x_inp.to(seg.product_dtype(x_inp))  # [Id]
        beta_use, beta_ign, a_inp, W_S, B_S = self._packed_inputs(x_inp, x_mm, segments, slots, scale,
                                                                  products)  # [ij] ..
        if slots is None:
            W_F1, B_F2, W_G2, B_G2 = self.W_F1, self.B_F2, self.W_G2, self.B_G2

            def times_F2(y: torch.Tensor) -> torch.Tensor:
                return y @ self.W_F2 if products is None else _times(products, y, self.W_F2)  # [Bjh]

            def times_G1(y: torch.Tensor) -> torch.Tensor:
                return y @ self.W_G1 if products is None else _times(products, y, self.W_G1)  # [Bjd]
        else:
            W_F1, B_F2, W_G2, B_G2 = (p[slots.slot] for p in (self.W_F1, self.B_F2, self.W_G2, self.B_G2))  # [Bj.]
            rows = slots.sample_ends * self.n_out  # [S] each slot's rows of a [B * j, ...] flattening

            def times_F2(y: torch.Tensor) -> torch.Tensor:
                return seg.times_slot(y, self.W_F2, slots, rows, products)  # [Bjh]

            def times_G1(y: torch.Tensor) -> torch.Tensor:
                return seg.times_slot(y, self.W_G1, slots, rows, products)  # [Bjd]
        f_a = torch.sigmoid(a_inp)[:, None]  # [i1]
        R = self.CONST_ones_over_n_out  # [j] E-step of iteration 1: flat prior
        for iteration in range(self.n_iters):
            D_use, D_ign = d_step(f_a, R, None)  # [ij], [ij]
            phi = beta_use * D_use - beta_ign * D_ign  # [ij]
            phi_x = seg.contract(phi, x_mm, segments, products)  # [Bjd] each sample's inputs contracted
            x_out = times_F2(phi_x * W_F1)  # [Bjh]
            x_out = torch.addcmul(seg.sum_by_sample(phi, segments, products)[..., None] * B_F2, x_out,
                                  scale[:, None, None])  # [Bjh] scaled, + bias
            if iteration + 1 < self.n_iters:
                pred_x_inp = times_G1(self.N(x_out)) * W_G2 + B_G2  # [Bjd]
                dots = seg.per_sample(x_mm, pred_x_inp.transpose(-1, -2), segments, products)  # [ij] its sample's
                S = nn.functional.logsigmoid(dots * W_S + B_S)  # [ij]
                R = route(S, None)  # [ij]
        return self.N(x_out) if self.normalize else x_out  # [Bjh]

    def _packed_inputs(self, x_inp: torch.Tensor, x_mm: torch.Tensor, segments: seg.Segments, slots: seg.Slots | None,
                       scale: torch.Tensor, products: seg.Products | None = None) -> tuple[torch.Tensor, ...]:
        """What :meth:`forward_packed` reads per input: ``beta_use [I, j]``, ``beta_ign [I, j]``, the activations
        ``a_inp [I]``, and ``W_S``, ``B_S`` (``[I, j]``, or ``[1, j]`` shared by every input); ``x_mm [I, d]``: the
        inputs ``x_inp`` as the matrix products take them. With variable ``n``
        and :class:`~service.routing.segments.Slots`, the three products with each input's slot's weights are one
        grouped product (its columns padded to a multiple of 8, as the grouped kernels need); with a fixed ``n``,
        input ``i`` of a sample is position ``i mod n`` of its parameters."""
        own = None if slots is None else slots.slot[segments.index]  # [i] each input's slot
        if self.n_inp > 0:  # per position: every sample has n_inp inputs
            pos = torch.arange(x_inp.shape[0], device=x_inp.device) % self.n_inp  # [i]
            at = pos if own is None else (own, pos)
            a_inp = torch.addcmul(self.B_A[at], seg.sum_of_rows(x_inp * self.W_A[at], products),
                                  scale[segments.index])  # [i]
            return self.beta_use[at], self.beta_ign[at], a_inp, self.W_S[at], self.B_S[at]
        if products is None and (own is None or slots is None):
            beta_use, beta_ign = self._betas(x_mm)  # [ij], [ij]
            a_inp = torch.addcmul(self.B_A, self._activations(x_mm), scale[segments.index])  # [i]
            return beta_use, beta_ign, a_inp, self.W_S, self.B_S
        # one grouped product with each input's slot's weights (with products, one routing's parameters are one slot:
        # a text then computes as among texts of other routings, to the bit)
        use, ign = self.compute_beta_use, self.compute_beta_ign
        j = self.n_out
        spare = -(2 * j + 1) % 8
        weights = torch.cat([use.weight, ign.weight, self.W_A,
                             self.W_A.new_zeros(*self.W_A.shape[:-2], spare, self.d_inp)], dim=-2)  # [S (2j+1+pad) d]
        if own is None or slots is None:
            y = seg.by_slot(x_mm, weights.transpose(-1, -2)[None], segments.ends[-1:], products)  # [i (2j+1+pad)]
            B_A, b_use, b_ign, W_S, B_S = self.B_A, use.bias, ign.bias, self.W_S, self.B_S  # shared by every input
        else:
            y = seg.by_slot(x_mm, weights.transpose(-1, -2), slots.input_ends, products)  # [i (2j+1+pad)]
            B_A, b_use, b_ign, W_S, B_S = self.B_A[own, 0], use.bias[own], ign.bias[own], self.W_S[own, 0], self.B_S[
                own, 0]  # [i], [ij], [ij], [ij], [ij]
        a_inp = torch.addcmul(B_A, y[:, 2 * j], scale[segments.index])  # [i]
        return y[:, :j] + b_use, y[:, j : 2 * j] + b_ign, a_inp, W_S, B_S  # [ij], [ij], [i], [ij], [ij]


def _times(products: seg.Products, y: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``y [B, j, k] @ W [k, n]`` -> ``[B, j, n]`` through ``products``, as one slot's matrix (see
    :func:`~service.routing.segments.by_slot`)."""
    rows = torch.full((1,), y.shape[0] * y.shape[1], dtype=torch.int32, device=y.device)  # [1] (no copy: captured)
    return seg.by_slot(y.flatten(0, 1), W[None], rows, products).view(*y.shape[:2], -1)  # [Bjn]
