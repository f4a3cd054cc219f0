"""Backbone + routing head: class scores and credit assignments.

Three kinds of credit (see ``service.routing.credit`` and ``service.modeling.decompose``):

- ``"contribution"`` (default): the head's exact value-path split of a logit (or, in contrast form,
  of ``logit_k - mean_k' logit_k'``) over (position, depth) hidden states, in logit units, with its baseline.
- ``"end_to_end"``: the same read-out split exactly over the input tokens (their embeddings), carried on
  through the encoder with its attention, norms and activations held; by depth, over the depth through
  which the head reads it.
- ``"shares"``: the paper's end-to-end routing shares ``phi1 @ phi2 @ phi3`` (eq. 15) at unit variance:
  how much of each position's data the routings pass to a class, not whether it raises the score.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from service.modeling import decompose
from service.modeling.backbone import Backbone, Encoded, Encoding
from service.modeling.encoder import PackedEncoder, pack
from service.modeling.head import HeadOutput, RoutingHead
from service.routing import credit

Method = Literal["contribution", "end_to_end", "shares"]

SPLITS = ("contribution", "end_to_end")
"""The methods that split a read-out exactly (a baseline and a logit; contrast form or not)."""

END_TO_END_ROWS = 16384
"""Tokens x read-outs per end-to-end pass: texts are split in groups within it (a pass keeps ``[rows, f]``
feed-forward read-outs: 96 MB at this size for 1,536 features)."""


@dataclass(frozen=True)
class CreditRequest:
    """What to explain for one text: ``targets`` (class indices; None = the predicted class), with
    which ``method``, for the splits whether in ``contrast`` form, and for ``"end_to_end"`` whether ``by_depth``
    (each token's credit split by the depth the head reads it through; otherwise one depth, their sum)."""

    targets: tuple[int, ...] | None = None
    method: Method = "contribution"
    contrast: bool = True
    by_depth: bool = False


@dataclass
class Explained:
    """One text's credit, on the CPU, over its own positions only.

    Attributes:
        targets: class indices, aligned with the last axis of ``credit``.
        credit: ``[n, d_depth, t]`` (end to end without ``by_depth``: ``[n, 1, t]``).
        baseline: ``[t]`` the read-out at zero hidden states (contribution) or zero input embeddings (end to end);
            None for shares.
        logit: ``[t]`` the explained read-out: ``credit.sum((0, 1)) + baseline == logit``.
    """

    targets: list[int]
    credit: torch.Tensor
    baseline: torch.Tensor | None = None
    logit: torch.Tensor | None = None


@dataclass
class Classified:
    """One batch's results.

    Attributes:
        logits: ``[b, n_classes]`` the head's scores, float32 (probabilities are the reader's to take: a softmax
            for one label of all, a sigmoid per label for a multi-label head).
        encoded: the backbone's output (tokens, offsets, hidden states); None from a packed head call (scores only).
        explained: per text, its :class:`Explained` credit or None when none was asked for.
        phi: the head's three credit matrices (batched, padded), or None.
    """

    logits: torch.Tensor
    encoded: Encoded | None
    explained: list[Explained | None]
    phi: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def routing_shares(out: HeadOutput, n: int, d_depth: int) -> torch.Tensor:
    """``phi1 @ phi2 @ phi3`` scaled to unit variance over each text's real positions (eq. 15).

    Multiplied right to left, ``phi1 @ (phi2 @ phi3)``, so the cost beyond the forward pass is one
    ``[i, n_hid] x [n_hid, n_classes]`` product per text.

    Returns:
        ``[..., n, d_depth, n_classes]``; zero at padding.
    """
    phi1, phi2, phi3 = out.phi
    e2e = credit.sequential(phi1, credit.sequential(phi2, phi3))  # [...ik]
    e2e = credit.unit_variance(e2e, out.absent)  # [...ik]
    return e2e.unflatten(-2, (n, d_depth))  # [...nek]


class RoutingClassifier(torch.nn.Module):
    """A frozen backbone and a routing head, with the labels they were trained for."""

    def __init__(self, backbone: Backbone, head: RoutingHead, labels: list[str]) -> None:
        super().__init__()
        if head.n_classes != len(labels):
            raise ValueError(f"head has {head.n_classes} classes but {len(labels)} labels were given")
        if (head.d_depth, head.d_emb) != (backbone.d_depth, backbone.d_emb):
            raise ValueError(
                f"head expects hidden states [d_depth={head.d_depth}, d_emb={head.d_emb}] but the backbone "
                f"gives [{backbone.d_depth}, {backbone.d_emb}]"
            )
        self.backbone, self.head, self.labels = backbone, head, labels

    @torch.inference_mode()
    def predict(self, texts: list[str] | list[Encoding], explain: Sequence[CreditRequest | None] | None = None,
                return_phi: bool = False) -> Classified:
        """Classify ``texts`` (or texts already tokenized by ``backbone.encode``); ``explain[b]`` says what
        credit text ``b`` needs (None: none).

        Credit is computed only for the texts that ask for it, one batched pass per method.
        """
        return self.classify(self.backbone(texts), explain, return_phi)

    @torch.inference_mode()
    def classify(self, enc: Encoded, explain: Sequence[CreditRequest | None] | None = None,
                 return_phi: bool = False) -> Classified:
        """The head's part of :meth:`predict`, on hidden states the backbone has computed already."""
        return classify(self.head, enc, explain, return_phi, self.backbone.stream)


def scoring(device: torch.device, score_dtype: torch.dtype | None) -> contextlib.AbstractContextManager[object]:
    """Where a head's scores are computed with their matrix products in ``score_dtype`` (bfloat16: on tensor cores
    on a GPU, accumulating in float32; ``torch.autocast`` keeps norms, softmaxes and reductions in float32); None:
    in the head's own precision."""
    if score_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=score_dtype)


@torch.inference_mode()
def classify(head: RoutingHead, enc: Encoded, explain: Sequence[CreditRequest | None] | None = None,
             return_phi: bool = False, encoder: PackedEncoder | None = None,
             score_dtype: torch.dtype | None = None) -> Classified:
    """Scores and the credit ``explain[b]`` asks of each text ``b`` (None: none) from ``head`` (a stacked head: row
    ``b`` on its head ``b``) on hidden states ``enc`` the backbone has computed (with ``encoder``, which end-to-end
    credit needs). Credit is computed only for the texts that ask for it, one batched pass per method. With
    ``score_dtype`` the scores come from a pass in that precision (see :func:`scoring`) and credit from a pass in
    the head's own (float32), run only where credit or ``phi`` is asked for: a text's scores do not depend on
    whether its neighbours asked for credit."""
    n_texts = len(enc.encodings)
    hidden = enc.hidden.to(dtype=next(head.parameters()).dtype)  # [b n e d]
    requests = list(explain or [None] * n_texts)
    with scoring(hidden.device, score_dtype):
        scored = head(hidden, enc.pad)
    logits = scored.scores.float()  # [b k]
    out = scored
    if score_dtype is not None and (return_phi or any(r is not None for r in requests)):
        out = head(hidden, enc.pad)  # credit and phi from a float32 pass
    explained: list[Explained | None] = [None] * n_texts
    groups: dict[tuple[Method, bool], list[int]] = {}
    for b, req in enumerate(requests):
        if req is not None:
            groups.setdefault((req.method, req.method in SPLITS and req.contrast), []).append(b)
    # the predicted classes are read from the device only where credit needs them (a host sync otherwise)
    needs_predicted = any(requests[b].targets is None for rows in groups.values() for b in rows)  # type: ignore[union-attr]
    predicted = logits.argmax(dim=-1).tolist() if needs_predicted else []  # softmax and sigmoid keep the order
    for (method, contrast), rows in groups.items():
        wanted = [list(requests[b].targets or (predicted[b],)) for b in rows]  # type: ignore[union-attr]
        idx = torch.tensor(rows, device=hidden.device)  # [b']
        rows_head = head.rows(idx)
        sub = out.rows(idx, rows_head)
        lengths = [enc.lengths[b] for b in rows]
        if method == "shares":
            shares = routing_shares(sub, hidden.shape[1], head.d_depth).float().cpu()  # [b' n e k]
            for r, (b, w) in enumerate(zip(rows, wanted, strict=True)):
                explained[b] = Explained(w, shares[r, : lengths[r]][..., w])  # [n e t]
            continue
        t_max = max(map(len, wanted))
        targets = torch.tensor([w + w[:1] * (t_max - len(w)) for w in wanted], device=hidden.device)  # [b' t]
        if method == "end_to_end":
            if encoder is None:
                raise ValueError("end-to-end credit needs an encoder whose layers it knows (the BERT family)")
            ro = rows_head.readouts(sub, hidden[idx], targets, contrast)
            split = _end_to_end(encoder, [enc.encodings[b] for b in rows], hidden[idx], ro.grad,
                                [requests[b].by_depth for b in rows])  # type: ignore[union-attr]
            head_baseline, logit = ro.baseline.float().cpu(), ro.logit.float().cpu()  # [b' t], [b' t]
            for r, (b, w) in enumerate(zip(rows, wanted, strict=True)):
                t = len(w)
                values, bias = split[r]  # [n e t], [t]
                explained[b] = Explained(w, values[..., :t], head_baseline[r, :t] + bias[:t], logit[r, :t])
            continue
        c = rows_head.contributions(sub, targets, contrast)
        values, baseline, logit = c.credit.float().cpu(), c.baseline.float().cpu(), c.logit.float().cpu()
        for r, (b, w) in enumerate(zip(rows, wanted, strict=True)):
            t = len(w)
            explained[b] = Explained(w, values[r, :t, : lengths[r]].permute(1, 2, 0), baseline[r, :t],
                                     logit[r, :t])  # [n e t], [t], [t]
    return Classified(logits=logits, encoded=enc, explained=explained, phi=out.phi if return_phi else None)


def _end_to_end(encoder: PackedEncoder, encodings: list[Encoding], hidden: torch.Tensor, grad: torch.Tensor,
                by_depth: list[bool]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each text's end-to-end credit, ``[n, e, t]`` (not by depth: ``[n, 1, t]``), and ``[t]`` its encoder's biases'
    part of the baseline, float32 on the CPU: the head's read-outs ``grad [b', t, n, e, d]`` of the hidden states
    ``hidden [b', n, e, d]`` carried back through ``encoder`` (:func:`decompose.split`) chunk by chunk, the chunks
    of ``encodings`` packed again one a row. A chunk attends only to itself, so chunks are independent: they go in
    passes of at most :data:`END_TO_END_ROWS` tokens x read-outs (one chunk at least), those split by depth apart,
    and a long text costs a chunk's memory, not its own."""
    t_max, E = grad.shape[1], hidden.shape[2]
    depths = [E if d else 1 for d in by_depth]
    credit = [torch.zeros(e.n_tokens, depths[r], t_max) for r, e in enumerate(encodings)]  # [n e t] each
    bias = [torch.zeros(t_max) for _ in encodings]  # [t] each
    units = sorted(((r, start, c) for r, e in enumerate(encodings)
                    for start, c in zip(np.cumsum([0, *map(len, e.chunks)]).tolist(), e.chunks, strict=False)),
                   key=lambda u: by_depth[u[0]])  # (text, first position, chunk ids)

    def run(group: list[tuple[int, int, tuple[int, ...]]]) -> None:
        lengths = [len(c) for _, _, c in group]
        ids = np.fromiter((i for _, _, c in group for i in c), dtype=np.int64)  # [T]
        states = torch.cat([hidden[r, at : at + len(c)] for r, at, c in group])  # [T e d]
        g = torch.cat([grad[r, :, at : at + len(c)] for r, at, c in group], dim=1)  # [t T e d]
        parts = decompose.split(encoder, pack(ids, np.array(lengths), states.device), states, g, by_depth[group[0][0]])
        c_parts, b_parts = (x.cpu().split(lengths, dim=-1) for x in parts)  # per chunk [t L] or [t e L]
        for (r, at, chunk), c, b in zip(group, c_parts, b_parts, strict=True):
            credit[r][at : at + len(chunk)] = c.reshape(t_max, depths[r], len(chunk)).permute(2, 1, 0)  # [L e t]
            bias[r] += b.reshape(t_max, -1).sum(dim=-1)  # [t]

    group: list[tuple[int, int, tuple[int, ...]]] = []
    rows = 0
    for unit in units:
        cost = len(unit[2]) * t_max * depths[unit[0]]
        if group and (rows + cost > END_TO_END_ROWS or by_depth[unit[0]] != by_depth[group[0][0]]):
            run(group)
            group, rows = [], 0
        group.append(unit)
        rows += cost
    run(group)
    return list(zip(credit, bias, strict=True))
