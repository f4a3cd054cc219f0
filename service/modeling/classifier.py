"""Backbone + routing head: class scores and end-to-end credit (paper §5.3, eq. 15)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.modeling.backbone import Backbone, Encoded
from service.modeling.head import HeadOutput, RoutingHead
from service.routing import credit


@dataclass
class Prediction:
    """One batch's results.

    Attributes:
        probs: ``[b, n_classes]`` class probabilities.
        encoded: the backbone's output (tokens, offsets, hidden states).
        credit: ``[b, n, d_depth, n_classes]`` end-to-end credit at unit variance, or None.
        phi: the head's three credit matrices (batched, padded), or None.
    """

    probs: torch.Tensor
    encoded: Encoded
    credit: torch.Tensor | None = None
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
    def predict(self, texts: list[str], explain: bool = False, return_phi: bool = False) -> Prediction:
        """Classify ``texts``; with ``explain`` also return end-to-end credit."""
        enc = self.backbone(texts)
        hidden = enc.hidden.to(dtype=next(self.head.parameters()).dtype)  # [b n e d]
        out = self.head(hidden, enc.pad)
        probs = out.scores.float().softmax(dim=-1)  # [b k]
        e2e = end_to_end_credit(out, hidden.shape[1], hidden.shape[2]).float() if explain else None
        return Prediction(probs=probs, encoded=enc, credit=e2e, phi=out.phi if return_phi else None)
