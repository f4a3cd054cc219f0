"""End-to-end credit: a read-out of an encoder's hidden states split exactly over its input tokens.

Hold at their values, for the text at hand, every attention probability, every layer norm's scale and each
activation's ratio ``f(u) / u`` (element by element). The encoder is then affine in its input embeddings ``x0``
(each token's word + position + type embedding, before the embeddings' norm), and so is any read-out of its hidden
states that is affine in them with the head's coefficients held too (:meth:`RoutingHead.readouts`):

    read-out  =  sum_e sum_T <G_e, x_e>  +  c  =  sum_T <dx0_T, x0_T>  +  baseline        (exactly)

where ``dx0`` is the read-out's weight on each input token's embedding, carried back once through the frozen
coefficients (the adjoint of the affine map; one pass per read-out, not one vector per input token through the
layers), and ``baseline`` collects every bias's part: ``<adjoint at the bias, bias>`` at each bias of every layer,
plus ``c``. Token ``T``'s credit is ``<dx0_T, x0_T>``.

The coefficients are recomputed layer by layer from the hidden states the forward pass gave (nothing is kept during
it), in the backbone's precision; credit and baselines are summed in float32. Attention runs on each chunk's own
row, so a text's split does not depend on its batch neighbours.

Indices: ``T`` tokens (every chunk of the texts back to back), ``s`` chunks, ``L`` the longest, ``e`` depths
(embeddings output, then every layer), ``d`` features, ``f`` feed-forward features, ``h`` attention heads, ``c``
features per head, ``r`` read-outs (adjoint rows).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from service.modeling.encoder import PackedEncoder, PackedLayer, Packing
from service.routing.credit import norm_scale

RATIOS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": lambda u: 0.5 * (1.0 + torch.erf(u * math.sqrt(0.5))),  # gelu(u) / u = Phi(u)
    "gelu_new": lambda u: 0.5 * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3))),
    "gelu_pytorch_tanh": lambda u: 0.5 * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3))),
    "relu": lambda u: (u > 0).to(u.dtype),
}
"""Each activation's ``f(u) / u`` in closed form (no division: finite at 0)."""
KINDS = ("attention", "norms", "activation")
"""The kinds of coefficient the split holds at their values."""


def split(encoder: PackedEncoder, p: Packing, states: torch.Tensor, grad: torch.Tensor, by_depth: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each input token's part of the read-outs ``sum_e <grad[r, :, e], states[:, e]>`` of a packed batch, and each
    token's part of the baselines.

    Args:
        encoder: the encoder that computed ``states``.
        p: the packing they were computed on (one chunk a row: :func:`~service.modeling.encoder.pack` without rows).
        states: ``[T, e, d]`` the hidden states of every depth.
        grad: ``[r, T, e, d]`` each read-out's weights on them (0 where a read-out does not look).
        by_depth: split each read-out further by the depth its weights read (``r`` becomes ``r x e`` rows): how much
            of a token's credit reaches the read-out through each depth's hidden states.

    Returns:
        ``credit`` and ``bias``, ``[r, T]`` (by depth: ``[r, e, T]``), float32: token ``T``'s credit
        ``<dx0_T, x0_T>``, and the encoder's biases' part of the read-out at its positions. Per read-out,
        ``credit.sum() + bias.sum() == sum_e <grad[r, :, e], states[:, e]>`` exactly (to float rounding); a head's
        own constant (:attr:`Readout.baseline`) comes on top.
    """
    n_r, T, E, _ = grad.shape
    dtype = encoder.word.weight.dtype
    states, grad = states.to(dtype), grad.to(dtype)  # [T e d], [r T e d]
    # the adjoint rows: one per read-out, or per (read-out, depth) with the deepest depth first, so that the rows
    # already seeded are a prefix that grows as the pass goes down
    dx = grad[:, :, -1].unsqueeze(1)  # [r m T d] m = 1 row per read-out (by depth: the depths seeded so far)
    bias = dx.new_zeros(n_r, 1, T, dtype=torch.float32)  # [r m T]
    for layer, e in zip(reversed(encoder.layers), range(E - 2, -1, -1), strict=True):
        dx, b = adjoint(layer, p, states[:, e], dx.flatten(0, 1))  # [rm T d], [rm T]
        dx, bias = dx.unflatten(0, (n_r, -1)), bias + b.unflatten(0, (n_r, -1))  # [r m T d], [r m T]
        if by_depth:
            dx = torch.cat([dx, grad[:, :, e].unsqueeze(1)], dim=1)  # [r m+1 T d]
            bias = torch.cat([bias, bias.new_zeros(n_r, 1, T)], dim=1)  # [r m+1 T]
        else:
            dx = dx + grad[:, :, e].unsqueeze(1)  # [r 1 T d]
    x0 = input_embeddings(encoder, p)  # [T d]
    norm = encoder.norm
    bias = bias + (dx * norm.bias).sum(dim=-1, dtype=torch.float32)  # [r m T]
    dx0 = _norm_adjoint(dx, norm.weight, norm_scale(x0, encoder.eps))  # [r m T d]
    credit = (dx0 * x0).sum(dim=-1, dtype=torch.float32)  # [r m T]
    if not by_depth:
        return credit[:, 0], bias[:, 0]  # [r T]
    return credit.flip(1), bias.flip(1)  # [r e T] depths in order


@dataclass(frozen=True)
class Coefficients:
    """What the split holds of one layer on its input: the attention probabilities ``P [s, h, L, L]`` (query by key),
    the norms' scales ``s1, s2 [T, 1]`` and the activation's ratios ``rho [T, f]``."""

    P: torch.Tensor
    s1: torch.Tensor
    rho: torch.Tensor
    s2: torch.Tensor


def layer_forward(layer: PackedLayer, p: Packing, x: torch.Tensor, held: frozenset[str] = frozenset(KINDS)
                  ) -> tuple[torch.Tensor, Coefficients]:
    """``layer``'s output ``[T, d]`` on ``x [T, d]``, its attention written out, and its :class:`Coefficients`. Under
    autograd the kinds of coefficient in ``held`` (of :data:`KINDS`) are detached, so that the output is affine in
    ``x`` through them (all: the network the split decomposes); the values are the same whatever is held."""
    d = x.shape[-1]
    s, L = p.shape
    h = layer.n_heads
    c = d // h
    qkv = F.linear(x, layer.W_qkv, layer.b_qkv)  # [T 3d]
    padded = qkv.view(s, L, 3 * d) if p.to_padded is None else qkv[p.to_padded]  # [s L 3d]
    q, k, v = padded.view(s, L, 3, h, c).permute(2, 0, 3, 1, 4).unbind(0)  # each [s h L c]
    scores = q @ k.transpose(-1, -2) / math.sqrt(c)  # [s h L L]
    if p.keep is not None:
        scores = scores.masked_fill(~p.keep, float("-inf"))  # [s h L L]
    P = scores.softmax(dim=-1)  # [s h L L] query by key
    a = ((P.detach() if "attention" in held else P) @ v).transpose(1, 2).reshape(1, s * L, d)  # [1 sL d]
    x1, s1 = layer_norm(x + layer.out(_from_padded(a, p)[0]), layer.norm1, layer.eps, "norms" in held)  # [T d], [T 1]
    u = layer.up(x1)  # [T f]
    rho = RATIOS[layer.act_name](u)  # [T f] f(u) / u
    y = layer.down(u * rho.detach() if "activation" in held else layer.act(u))  # [T d]
    x2, s2 = layer_norm(x1 + y, layer.norm2, layer.eps, "norms" in held)  # [T d], [T 1]
    return x2, Coefficients(P, s1, rho, s2)


def layer_norm(x: torch.Tensor, norm: torch.nn.LayerNorm, eps: float, held: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm`` of ``x [T, d]`` written out, its scale detached where ``held``; and the scale ``[T, 1]``."""
    scale = norm_scale(x, eps)  # [T 1]
    out = (x - x.mean(dim=-1, keepdim=True)) * (scale.detach() if held else scale) * norm.weight + norm.bias  # [T d]
    return out, scale


def input_embeddings(encoder: PackedEncoder, p: Packing) -> torch.Tensor:
    """``[T, d]`` each token's word + position + type embedding: the inputs the split credits."""
    return encoder.word(p.ids) + encoder.position(p.positions) + encoder.type0  # [T d]


def adjoint(layer: PackedLayer, p: Packing, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Read-outs ``dy [r, T, d]`` of ``layer``'s output carried back to its input ``x [T, d]``, the layer's attention
    probabilities, norm scales and activation ratios held at their values on ``x`` (recomputed here).

    Returns:
        ``dx [r, T, d]`` and ``[r, T]`` float32, the part of each read-out the layer's biases make, by token.
    """
    d = x.shape[-1]
    s, L = p.shape
    h = layer.n_heads
    c = d // h
    _, k = layer_forward(layer, p, x)  # the coefficients
    # the adjoint, from the output down; each bias's part is <adjoint there, bias>
    W_v, b_v = layer.W_qkv[2 * d :], layer.b_qkv[2 * d :]  # [d d], [d]
    bias = _dot(dy, layer.norm2.bias)  # [r T]
    dr2 = _norm_adjoint(dy, layer.norm2.weight, k.s2)  # [r T d]
    bias = bias + _dot(dr2, layer.down.bias)  # [r T]
    du = (dr2 @ layer.down.weight) * k.rho  # [r T f]
    bias = bias + _dot(du, layer.up.bias)  # [r T]
    dx1 = dr2 + du @ layer.up.weight  # [r T d]
    bias = bias + _dot(dx1, layer.norm1.bias)  # [r T]
    dr1 = _norm_adjoint(dx1, layer.norm1.weight, k.s1)  # [r T d]
    bias = bias + _dot(dr1, layer.out.bias)  # [r T]
    da = dr1 @ layer.out.weight  # [r T d]
    da_p = _to_padded(da, p).view(-1, s, L, h, c).transpose(2, 3)  # [r s h L c] zero at empty slots
    dv = (k.P.transpose(-1, -2) @ da_p).transpose(2, 3).reshape(-1, s * L, d)  # [r sL d] key by query
    dv = _from_padded(dv, p)  # [r T d]
    bias = bias + _dot(dv, b_v)  # [r T]
    return dr1 + dv @ W_v, bias  # [r T d], [r T]


def _norm_adjoint(dy: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The adjoint of ``x -> (x - mean_d x) * scale * weight`` (scale held) on read-outs ``dy [..., T, d]``."""
    g = dy * weight  # [...Td]
    return (g - g.mean(dim=-1, keepdim=True)) * scale  # [...Td]


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` float32 ``sum_d a[..., T, d] b[d]``."""
    return (a * b).sum(dim=-1, dtype=torch.float32)  # [...T]


def _from_padded(x: torch.Tensor, p: Packing) -> torch.Tensor:
    """``x [r, sL, d]`` on the padded view -> ``[r, T, d]`` on the stream."""
    return x if p.from_padded is None else x[:, p.from_padded]  # [r T d]


def _to_padded(x: torch.Tensor, p: Packing) -> torch.Tensor:
    """``x [r, T, d]`` on the stream -> ``[r, sL, d]`` on the padded view, zero at empty slots."""
    if p.from_padded is None:
        return x  # [r sL d]
    s, L = p.shape
    out = x.new_zeros(x.shape[0], s * L, x.shape[-1])  # [r sL d]
    out[:, p.from_padded] = x
    return out
