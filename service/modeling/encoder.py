"""A BERT-family encoder on one packed token stream: every sequence of a batch back to back, no padding.

Hugging Face's ``BertModel`` runs padded rows ``[rows, L]``: its projections and feed-forward layers (about 97%
of the work for sequences of a few dozen tokens) compute padding too, and it launches a dozen more kernels per
layer than the arithmetic needs. Here the linear layers and norms run on the ``[T, d]`` stream of the ``T`` real
tokens; only attention, which mixes positions, runs on a padded view ``[s, L]`` gathered from it (one index) and
scattered back (one index), each key masked outside its own sequence. Query, key and value come from one
projection.

Indices: ``T`` real tokens of the batch, ``s`` sequences (chunks), ``L`` the longest, ``e`` depths (embeddings
output, then every layer), ``d`` features, ``h`` attention heads, ``c`` features per attention head.

The weights are the Hugging Face module's own (shared, not copied, except the query/key/value projection, joined
into one). Exact against it up to float rounding (tests: within 1e-5 in fp32).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""A linear layer's product, as ``torch.nn.functional.linear``: ``x [T, i]``, ``weight [o, i]``, ``bias [o]`` ->
``[T, o]``."""

Attention = Callable[..., torch.Tensor]
"""Attention as ``torch.nn.functional.scaled_dot_product_attention``: ``q, k, v [s, h, L, c]``, ``attn_mask`` (bool,
broadcast to ``[s, h, L, L]``, or None) -> ``[s, h, L, c]``."""

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class Packing:
    """Where each token of a packed batch sits, on the device (built on the host by :func:`pack`).

    Attributes:
        ids: ``[T]`` token ids, the sequences back to back.
        positions: ``[T]`` each token's position within its sequence.
        to_padded: ``[r, L]`` the stream index of each slot of the padded view, ``r`` rows of ``L`` slots (a
            sequence a row, or several side by side; empty slots point at token 0: their keys are masked and
            their queries never read back); None when every sequence has the same length and has a row of its
            own (the view is then the stream itself, reshaped).
        from_padded: ``[T]`` each token's slot in the flattened padded view (None with ``to_padded``).
        keep: bool, True where a query may attend to a key: ``[r, 1, 1, L]`` with a sequence a row (every slot
            but the padding), ``[r, 1, L, L]`` with several (the keys of the same sequence); None with
            ``to_padded``.
        shape: ``(r, L)``.
        dest: ``[T]`` the row of the output each token's states are written to (see :meth:`PackedEncoder.forward`);
            None: the stream's order.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    to_padded: torch.Tensor | None
    from_padded: torch.Tensor | None
    keep: torch.Tensor | None
    shape: tuple[int, int]
    dest: torch.Tensor | None = None


def pack(ids: np.ndarray, lengths: np.ndarray, device: torch.device, rows: list[list[int]] | None = None,
         width: int | None = None, dest: np.ndarray | None = None) -> Packing:
    """The :class:`Packing` of sequences of ``lengths [s]`` whose token ids lie back to back in ``ids [T]``:
    computed in numpy (no loop over tokens) and sent to the device in one copy.

    Attention runs on a padded view: one sequence per row, padded to the longest (``rows`` None; to ``width`` where
    given, a fixed shape), or the sequences ``rows[r]`` side by side in row ``r`` of ``width`` slots, each attending
    only to itself (less padding where lengths differ: on a CPU, where attention's padded work costs time; see
    :func:`~service.modeling.grouping.pack_rows`). ``dest [T]``: each token's row of the output, sent with the rest."""
    s, T = len(lengths), len(ids)
    tail = [] if dest is None else [dest.astype(np.int64, copy=False)]  # last: the other parts keep their places
    if rows is None and width is None and bool((lengths == lengths.max()).all()):  # the stream is the padded view
        flat = to_device([ids.astype(np.int64, copy=False), np.tile(np.arange(lengths[0]), s), *tail], device)
        return Packing(flat[:T], flat[T : 2 * T], None, None, None, (s, int(lengths[0])),
                       flat[2 * T :] if tail else None)
    host, n_rows, L = pack_host(ids, lengths, rows, width)
    return packing_of(to_device([host, *tail], device), T, n_rows, L, several=rows is not None,
                      dest=bool(tail))


def pack_host(ids: np.ndarray, lengths: np.ndarray, rows: list[list[int]] | None = None, width: int | None = None
              ) -> tuple[np.ndarray, int, int]:
    """The host's part of :func:`pack` (no shortcut): ``ids``, positions, the padded view's indices and each slot's
    sequence, flat (int64 ``[3T + 2rL]``, what :func:`packing_of` reads on the device), and ``(r, L)``. With ``rows``
    None and ``width`` given, ``r`` is the number of sequences (an empty one has an empty row)."""
    s, T = len(lengths), len(ids)
    starts = np.cumsum(lengths) - lengths  # [s] first token of each sequence in the stream
    positions = np.arange(T) - np.repeat(starts, lengths)  # [T]
    if rows is None:
        L = int(width or lengths.max())
        row_of, at = np.arange(s), np.zeros(s, dtype=np.int64)  # [s] each sequence's row, and where it starts there
    else:
        L = int(width or lengths.max())
        sizes = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))  # [r] sequences a row
        seq = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(sizes.sum()))  # [s] row by row
        n = lengths[seq]  # [s]
        end = np.cumsum(n)  # [s] each sequence's end, the rows back to back
        first = np.cumsum(sizes) - sizes  # [r] each row's first sequence in seq
        row_start = np.repeat(end[first] - n[first], sizes)  # [s] where its row starts, the rows back to back
        row_of, at = np.empty(s, dtype=np.int64), np.empty(s, dtype=np.int64)
        row_of[seq] = np.repeat(np.arange(len(rows)), sizes)
        at[seq] = end - n - row_start
        assert (at[seq] + n <= L).all(), f"a row holds more tokens than its {L} slots"
    assert (lengths <= L).all(), f"a sequence longer than its row's {L} slots"
    n_rows = int(row_of.max()) + 1
    from_padded = np.repeat(row_of * L + at, lengths) + positions  # [T] each token's slot
    to_padded = np.zeros(n_rows * L, dtype=np.int64)  # [rL] slots past the sequences read token 0 (never used)
    to_padded[from_padded] = np.arange(T)
    seg = np.full(n_rows * L, -1, dtype=np.int64)  # [rL] which sequence fills each slot; -1: none
    seg[from_padded] = np.repeat(np.arange(s), lengths)
    return np.concatenate([ids.astype(np.int64, copy=False), positions, to_padded, from_padded, seg]), n_rows, L


def packing_of(flat: torch.Tensor, T: int, n_rows: int, L: int, several: bool = False, dest: bool = False
               ) -> Packing:
    """The :class:`Packing` whose parts :func:`pack_host` laid out in ``flat`` (on the device; ``several``: rows of
    several sequences; ``dest``: each token's output row follows, ``[T]``). Views of ``flat`` and the attention mask
    computed from it: nothing read back, so a captured graph may build it from a buffer it reads."""
    end = 2 * T + n_rows * L + T + n_rows * L
    seg_d = flat[2 * T + n_rows * L + T : end].view(n_rows, L)  # [r L]
    # one sequence a row: the keys of every slot but the padding; several: the keys of the same sequence (empty
    # slots attend to each other, so that no row of the mask is all False)
    keep = ((seg_d[:, :, None] == seg_d[:, None, :])[:, None] if several  # [r 1 L L]
            else (seg_d >= 0)[:, None, None, :])  # [r 1 1 L]
    return Packing(flat[:T], flat[T : 2 * T], flat[2 * T : 2 * T + n_rows * L].view(n_rows, L),
                   flat[2 * T + n_rows * L : 2 * T + n_rows * L + T], keep, (n_rows, L),
                   flat[end : end + T] if dest else None)


def to_device(parts: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """``parts`` joined into one int64 tensor on ``device``, in one copy (pinned and asynchronous to a GPU)."""
    host = torch.from_numpy(np.concatenate(parts))  # [*]
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class PackedLayer(nn.Module):
    """One transformer layer (post-norm, as BERT) on a packed stream."""

    def __init__(self, layer: nn.Module, n_heads: int, act: str, eps: float) -> None:
        super().__init__()
        att = layer.attention
        q, k, v = att.self.query, att.self.key, att.self.value
        self.W_qkv = nn.Parameter(torch.cat([q.weight, k.weight, v.weight]), requires_grad=False)  # [3d d]
        self.b_qkv = nn.Parameter(torch.cat([q.bias, k.bias, v.bias]), requires_grad=False)  # [3d]
        self.out, self.norm1 = att.output.dense, att.output.LayerNorm
        self.up, self.down, self.norm2 = layer.intermediate.dense, layer.output.dense, layer.output.LayerNorm
        self.n_heads, self.act, self.act_name, self.eps = n_heads, ACTIVATIONS[act], act, eps
        self.linear: Linear = F.linear
        """How the layer's four products are computed (see :meth:`PackedEncoder.use_kernels`)."""
        self.attention: Attention = F.scaled_dot_product_attention
        """How its attention is computed (see :meth:`PackedEncoder.use_kernels`)."""

    def forward(self, x: torch.Tensor, p: Packing) -> torch.Tensor:
        """``x [T, d]`` -> ``[T, d]``."""
        d = x.shape[-1]
        s, L = p.shape
        h = self.n_heads
        linear = self.linear
        qkv = linear(x, self.W_qkv, self.b_qkv)  # [T 3d]
        padded = qkv.view(s, L, 3 * d) if p.to_padded is None else qkv[p.to_padded]  # [s L 3d]
        q, k, v = padded.view(s, L, 3, h, d // h).permute(2, 0, 3, 1, 4).unbind(0)  # each [s h L c]
        a = self.attention(q, k, v, attn_mask=p.keep)  # [s h L c]
        a = a.transpose(1, 2).reshape(s * L, d)  # [sL d]
        if p.from_padded is not None:
            a = a[p.from_padded]  # [T d]
        x = F.layer_norm(x + linear(a, self.out.weight, self.out.bias), (d,), self.norm1.weight, self.norm1.bias,
                         self.eps)  # [T d]
        up = self.act(linear(x, self.up.weight, self.up.bias))  # [T 4d]
        y = linear(up, self.down.weight, self.down.bias)  # [T d]
        return F.layer_norm(x + y, (d,), self.norm2.weight, self.norm2.bias, self.eps)  # [T d]


class PackedEncoder(nn.Module):
    """The hidden states of every depth of a BERT-family encoder (absolute positions, one token type), on a packed
    stream. Build it with :meth:`of`, which says None for an encoder it does not know."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        cfg = model.config
        emb = model.embeddings
        self.word, self.position, self.norm = emb.word_embeddings, emb.position_embeddings, emb.LayerNorm
        # every chunk is one segment: token type 0 throughout, one vector added to every token
        self.type0 = nn.Parameter(emb.token_type_embeddings.weight[0].detach().clone(), requires_grad=False)  # [d]
        self.eps = cfg.layer_norm_eps
        self.layers = nn.ModuleList(PackedLayer(layer, cfg.num_attention_heads, cfg.hidden_act, cfg.layer_norm_eps)
                                    for layer in model.encoder.layer)

    @classmethod
    def of(cls, model: nn.Module) -> PackedEncoder | None:
        """A packed encoder sharing ``model``'s weights, or None where ``model`` is not a BERT whose layers this
        module knows (another architecture, relative positions, another activation)."""
        cfg = model.config
        known = (getattr(cfg, "model_type", None) == "bert"
                 and getattr(cfg, "position_embedding_type", "absolute") == "absolute"
                 and getattr(cfg, "hidden_act", None) in ACTIVATIONS
                 and not getattr(cfg, "is_decoder", False)
                 and hasattr(model, "embeddings") and hasattr(model, "encoder"))
        return cls(model) if known else None

    def use_kernels(self, linear: Linear = F.linear, attention: Attention = F.scaled_dot_product_attention) -> None:
        """Every layer's products (query, key and value; attention's output; the feed-forward pair) through
        ``linear``, and its attention through ``attention``, from now on: torch's (the defaults), or those that
        compute each token's outputs in the same order whatever the batch (:func:`service.modeling.invariant.linear`,
        :func:`service.modeling.invariant.attention`)."""
        for layer in self.layers:
            layer.linear, layer.attention = linear, attention

    def forward(self, p: Packing, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, e, d]`` the hidden states of every depth of the packed tokens (the embeddings' output first); with
        ``out [R, e, d]`` (and ``p.dest``), each token's states written to its row ``p.dest`` of ``out`` as each depth
        is computed (one copy, no ``[T, e, d]`` of its own), and ``out`` returned."""
        d = self.word.embedding_dim
        x = self.word(p.ids) + self.position(p.positions) + self.type0  # [T d]
        x = F.layer_norm(x, (d,), self.norm.weight, self.norm.bias, self.eps)  # [T d]
        if out is not None:
            assert p.dest is not None, "an output needs each token's row"
            out[:, 0].index_copy_(0, p.dest, x)  # [R d] of [R e d]
            for depth, layer in enumerate(self.layers, start=1):
                x = layer(x, p)  # [T d]
                out[:, depth].index_copy_(0, p.dest, x)  # [R d] of [R e d]
            return out
        states = [x]
        for layer in self.layers:
            x = layer(x, p)  # [T d]
            states.append(x)
        return torch.stack(states, dim=1)  # [T e d]
