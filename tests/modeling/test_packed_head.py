"""The head on texts back to back (``scores_packed``): each text's scores as the head gives them alone."""

import torch

from service.modeling.head import RoutingHead


def test_packed_texts_score_as_each_alone() -> None:
    torch.manual_seed(0)
    head = RoutingHead(d_depth=3, d_emb=16, n_classes=4, n_hid=8, d_hid=12).eval()
    with torch.no_grad():
        head.B.normal_(std=0.3)  # the per-depth bias takes part
    lengths = [5, 1, 7, 3]
    hidden = torch.randn(sum(lengths), 3, 16, generator=torch.Generator().manual_seed(1))  # [T e d]
    with torch.inference_mode():
        packed = head.scores_packed(hidden, torch.tensor(lengths))  # [b k]
        alone = torch.cat([head(h[None]).scores for h in hidden.split(lengths)])  # [b k]
    assert packed.shape == (4, 4)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)
