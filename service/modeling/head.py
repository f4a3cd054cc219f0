"""RoutingHead (paper §5.2): three routings over the hidden states of every depth.

Indices: ``n`` token positions, ``e`` depths (``d_depth``), ``d`` embedding features, ``i`` input
vectors of the first routing (``i = n * d_depth``, position-major), ``j`` hidden vectors, ``k`` classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from service.routing import EfficientVectorRouting


@dataclass
class HeadOutput:
    """Scores and each routing's credit matrix.

    Attributes:
        scores: ``[..., n_classes]`` logits.
        phi: ``(phi1 [..., i, n_hid], phi2 [..., n_hid, n_hid], phi3 [..., n_hid, n_classes])``.
        absent: bool ``[..., i]``, True for the padding rows of ``phi1``.
    """

    scores: torch.Tensor
    phi: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    absent: torch.Tensor


class RoutingHead(nn.Module):
    """Layer norm at each depth, learned per-depth scale ``W`` and bias ``B``, then three routings:
    ``(n=-1 -> n_hid, d_emb -> d_hid)``, ``(n_hid -> n_hid, d_hid -> d_hid)``,
    ``(n_hid -> n_classes, d_hid -> 1)``. Parameter names match the paper's published heads.
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
            pad: optional bool ``[..., n]``, True at padding positions (absent in the first routing).

        Returns:
            :class:`HeadOutput`.
        """
        x = nn.functional.layer_norm(hidden, (self.d_emb,))  # [...ned] per-depth normalisation
        x = x * self.W + self.B  # [...ned]
        x = x.flatten(-3, -2)  # [...id] positions x depths as one sequence
        if pad is None:
            pad = torch.zeros(hidden.shape[:-2], dtype=torch.bool, device=hidden.device)  # [...n]
        absent = pad[..., None].expand(*pad.shape, self.d_depth).flatten(-2)  # [...i]
        mask = absent[..., None].expand(*absent.shape, self.n_hid)  # [...ij]
        r1 = self.route[0](x, mask=mask)
        r2 = self.route[1](r1["x_out"])
        r3 = self.route[2](r2["x_out"])
        scores = r3["x_out"].squeeze(-1)  # [...k]
        return HeadOutput(scores=scores, phi=(r1["phi"], r2["phi"], r3["phi"]), absent=absent)
