"""Backbone + routing head: class scores and credit assignments.

Two kinds of credit (see ``service.routing.credit``):

- ``"contribution"`` (default): the head's exact value-path split of a logit (or, in contrast form,
  of ``logit_k - mean_k' logit_k'``) over (position, depth), in logit units, with its baseline.
- ``"shares"``: the paper's end-to-end routing shares ``phi1 @ phi2 @ phi3`` (eq. 15) at unit variance:
  how much of each position's data the routings pass to a class, not whether it raises the score.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from service.modeling.backbone import Backbone, Encoded, Encoding
from service.modeling.head import HeadOutput, RoutingHead
from service.routing import credit

Method = Literal["contribution", "shares"]


@dataclass(frozen=True)
class CreditRequest:
    """What to explain for one text: ``targets`` (class indices; None = the predicted class), with
    which ``method``, and for contributions whether in ``contrast`` form."""

    targets: tuple[int, ...] | None = None
    method: Method = "contribution"
    contrast: bool = True


@dataclass
class Explained:
    """One text's credit, on the CPU, over its own positions only.

    Attributes:
        targets: class indices, aligned with the last axis of ``credit``.
        credit: ``[n, d_depth, t]``.
        baseline: ``[t]`` the contribution method's read-out at zero hidden states (None for shares).
        logit: ``[t]`` the explained read-out: ``credit.sum((0, 1)) + baseline == logit``.
    """

    targets: list[int]
    credit: torch.Tensor
    baseline: torch.Tensor | None = None
    logit: torch.Tensor | None = None


@dataclass
class Prediction:
    """One batch's results.

    Attributes:
        probs: ``[b, n_classes]`` class probabilities.
        encoded: the backbone's output (tokens, offsets, hidden states).
        explained: per text, its :class:`Explained` credit or None when none was asked for.
        phi: the head's three credit matrices (batched, padded), or None.
    """

    probs: torch.Tensor
    encoded: Encoded
    explained: list[Explained | None]
    phi: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def end_to_end_credit(out: HeadOutput, n: int, d_depth: int) -> torch.Tensor:
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
                return_phi: bool = False) -> Prediction:
        """Classify ``texts`` (or texts already tokenized by ``backbone.encode``); ``explain[b]`` says what
        credit text ``b`` needs (None: none).

        Credit is computed only for the texts that ask for it, one batched pass per method.
        """
        return self.classify(self.backbone(texts), explain, return_phi)

    @torch.inference_mode()
    def classify(self, enc: Encoded, explain: Sequence[CreditRequest | None] | None = None,
                 return_phi: bool = False) -> Prediction:
        """The head's part of :meth:`predict`, on hidden states the backbone has computed already."""
        return classify(self.head, enc, explain, return_phi)


@torch.inference_mode()
def classify(head: RoutingHead, enc: Encoded, explain: Sequence[CreditRequest | None] | None = None,
             return_phi: bool = False) -> Prediction:
    """Scores and the credit ``explain[b]`` asks of each text ``b`` (None: none) from ``head`` (a stacked head: row
    ``b`` on its head ``b``) on hidden states ``enc`` the backbone has computed. Credit is computed only for the
    texts that ask for it, one batched pass per method."""
    n_texts = len(enc.encodings)
    hidden = enc.hidden.to(dtype=next(head.parameters()).dtype)  # [b n e d]
    out = head(hidden, enc.pad)
    probs = out.scores.float().softmax(dim=-1)  # [b k]
    explained: list[Explained | None] = [None] * n_texts
    requests = list(explain or [None] * n_texts)
    groups: dict[tuple[Method, bool], list[int]] = {}
    for b, req in enumerate(requests):
        if req is not None:
            groups.setdefault((req.method, req.method == "contribution" and req.contrast), []).append(b)
    # the predicted classes are read from the device only where credit needs them (a host sync otherwise)
    needs_predicted = any(requests[b].targets is None for rows in groups.values() for b in rows)  # type: ignore[union-attr]
    predicted = probs.argmax(dim=-1).tolist() if needs_predicted else []
    for (method, contrast), rows in groups.items():
        wanted = [list(requests[b].targets or (predicted[b],)) for b in rows]  # type: ignore[union-attr]
        idx = torch.tensor(rows, device=hidden.device)  # [b']
        rows_head = head.rows(idx)
        sub = out.rows(idx, rows_head)
        lengths = [enc.lengths[b] for b in rows]
        if method == "shares":
            e2e = end_to_end_credit(sub, hidden.shape[1], head.d_depth).float().cpu()  # [b' n e k]
            for r, (b, w) in enumerate(zip(rows, wanted, strict=True)):
                explained[b] = Explained(w, e2e[r, : lengths[r]][..., w])  # [n e t]
            continue
        t_max = max(map(len, wanted))
        targets = torch.tensor([w + w[:1] * (t_max - len(w)) for w in wanted], device=hidden.device)  # [b' t]
        c = rows_head.contributions(sub, targets, contrast)
        values, baseline, logit = c.credit.float().cpu(), c.baseline.float().cpu(), c.logit.float().cpu()
        for r, (b, w) in enumerate(zip(rows, wanted, strict=True)):
            t = len(w)
            explained[b] = Explained(w, values[r, :t, : lengths[r]].permute(1, 2, 0), baseline[r, :t],
                                     logit[r, :t])  # [n e t], [t], [t]
    return Prediction(probs=probs, encoded=enc, explained=explained, phi=out.phi if return_phi else None)
