"""End-to-end credit (``service.modeling.decompose`` through ``classify``): each logit split exactly over the input
tokens, on random encoders of each activation it knows, texts of several chunks, padding around them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from transformers import BertConfig, BertModel

from service.modeling import decompose
from service.modeling.backbone import Encoded
from service.modeling.classifier import CreditRequest, classify
from service.modeling.encoder import PackedEncoder, pack
from service.modeling.encoding import Encoding
from service.modeling.head import RoutingHead

D, VOCAB, K = 32, 60, 3


def random_encoder(act: str, layers: int = 3, seed: int = 0) -> PackedEncoder:
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, hidden_act=act)
    model = BertModel(cfg).eval()
    with torch.no_grad():  # biases and norms away from their initial 0 and 1, so that every one of them counts
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(0.3 * torch.randn_like(p))
    encoder = PackedEncoder.of(model)
    assert encoder is not None
    return encoder


def random_head(layers: int, seed: int = 1) -> RoutingHead:
    torch.manual_seed(seed)
    head = RoutingHead(layers + 1, D, K, n_hid=8, d_hid=16).eval()
    with torch.no_grad():
        head.W.add_(0.5 * torch.randn_like(head.W))
        head.B.add_(0.5 * torch.randn_like(head.B))
    return head


def encoding(chunks: list[list[int]]) -> Encoding:
    n = sum(map(len, chunks))
    return Encoding(tuple(map(tuple, chunks)), ((0, 0),) * n, (False,) * n, tuple(range(n)))


def random_texts(rng: np.random.Generator, chunk_counts: list[int]) -> list[Encoding]:
    return [encoding([rng.integers(0, VOCAB, int(rng.integers(3, 12))).tolist() for _ in range(c)])
            for c in chunk_counts]


def encoded(encoder: PackedEncoder, encodings: list[Encoding]) -> Encoded:
    """The texts' hidden states as the engine hands them to a head: every chunk encoded on one packed stream, each
    text's chunks joined, the texts padded to the longest."""
    ids = np.array([i for e in encodings for c in e.chunks for i in c])
    lengths = np.array([len(c) for e in encodings for c in e.chunks])
    with torch.no_grad():
        states = encoder(pack(ids, lengths, torch.device("cpu")))  # [T e d]
    per_text = states.split([e.n_tokens for e in encodings])
    n = max(e.n_tokens for e in encodings)
    hidden = torch.zeros(len(encodings), n, *states.shape[1:])  # [b n e d]
    pad = torch.ones(len(encodings), n, dtype=torch.bool)  # [b n]
    for b, s in enumerate(per_text):
        hidden[b, : len(s)], pad[b, : len(s)] = s, False
    hidden[pad] = 7.0  # whatever padding holds must not reach anyone's credit
    return Encoded(hidden, pad, encodings)


@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_new"])
@pytest.mark.parametrize("by_depth", [False, True])
def test_input_token_credit_plus_baseline_is_the_logit(act: str, by_depth: bool) -> None:
    """For every text and target, contrast and plain: the credit of every input token plus the baseline (every
    bias's part, computed on its own) equals the logit the head gave, within 1e-4; by depth, the depths sum to
    the total."""
    encoder, head = random_encoder(act), random_head(3)
    texts = random_texts(np.random.default_rng(0), [1, 3, 2, 1])
    enc = encoded(encoder, texts)
    for contrast in (True, False):
        requests = [CreditRequest(targets=(0, 1, 2), method="end_to_end", contrast=contrast, by_depth=by_depth)] * 4
        pred = classify(head, enc, requests, encoder=encoder)
        scores = head(enc.hidden, enc.pad).scores  # [b k] the logits, from the head alone
        for b, ex in enumerate(pred.explained):
            assert ex is not None and ex.baseline is not None and ex.logit is not None
            assert ex.credit.shape == (texts[b].n_tokens, 4 if by_depth else 1, 3)
            logit = scores[b] - scores[b].mean() if contrast else scores[b]  # [k]
            torch.testing.assert_close(ex.logit, logit, atol=1e-5, rtol=0)
            torch.testing.assert_close(ex.credit.sum(dim=(0, 1)) + ex.baseline, ex.logit, atol=1e-4, rtol=0)
            assert ex.credit.abs().sum() > 0.1 and ex.baseline.abs().sum() > 0.1  # neither side is trivially all
        if by_depth:  # each depth's part: the split of the head's read-out of that depth alone
            flat = classify(head, enc, [CreditRequest(targets=(0, 1, 2), method="end_to_end", contrast=contrast)] * 4,
                            encoder=encoder)
            for ex, total in zip(pred.explained, flat.explained, strict=True):
                torch.testing.assert_close(ex.credit.sum(dim=1), total.credit[:, 0], atol=1e-5, rtol=0)
                torch.testing.assert_close(ex.baseline, total.baseline, atol=1e-5, rtol=0)


def frozen_credit(encoder: PackedEncoder, ids: list[int], grad: torch.Tensor) -> torch.Tensor:
    """``[r, T]`` each token's credit by autograd: the encoder's forward pass written again with every attention
    probability, norm scale and activation ratio detached, and each read-out's gradient times the input
    embeddings (an independent path to what :func:`decompose.split` carries back by hand)."""
    p = pack(np.array(ids), np.array([len(ids)]), torch.device("cpu"))

    def norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
        c = x - x.mean(-1, keepdim=True)
        return c * ((c * c).mean(-1, keepdim=True) + eps).rsqrt().detach() * w + b

    credits = []
    for g in grad:  # [T e d]
        x0 = (encoder.word(p.ids) + encoder.position(p.positions) + encoder.type0).detach().requires_grad_(True)
        x = norm(x0, encoder.norm.weight, encoder.norm.bias, encoder.eps)
        states = [x]
        for layer in encoder.layers:
            T, h = x.shape[0], layer.n_heads
            q, k, v = F.linear(x, layer.W_qkv, layer.b_qkv).view(T, 3, h, D // h).permute(1, 2, 0, 3)  # [h T c]
            P = ((q @ k.transpose(-1, -2)) / (D // h) ** 0.5).softmax(-1).detach()  # [h T T]
            a = (P @ v).transpose(0, 1).reshape(T, D)
            x1 = norm(x + layer.out(a), layer.norm1.weight, layer.norm1.bias, layer.eps)
            u = layer.up(x1)
            y = layer.down(u * (layer.act(u) / u).detach())
            x = norm(x1 + y, layer.norm2.weight, layer.norm2.bias, layer.eps)
            states.append(x)
        (torch.stack(states, dim=1) * g).sum().backward()
        credits.append((x0.grad * x0).sum(-1).detach())
    return torch.stack(credits)


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_each_tokens_credit_is_its_embeddings_gradient_times_itself_in_the_frozen_network(act: str) -> None:
    encoder = random_encoder(act)
    ids = np.random.default_rng(1).integers(0, VOCAB, 9).tolist()
    with torch.no_grad():
        states = encoder(pack(np.array(ids), np.array([len(ids)]), torch.device("cpu")))  # [T e d]
    grad = torch.randn(2, *states.shape)  # [r T e d]
    with torch.no_grad():
        credit, _ = decompose.split(encoder, pack(np.array(ids), np.array([9]), torch.device("cpu")), states, grad)
    with torch.enable_grad():
        expected = frozen_credit(encoder, ids, grad)
    torch.testing.assert_close(credit, expected, atol=1e-5, rtol=1e-4)


def test_a_texts_credit_does_not_depend_on_its_batch_neighbours_or_their_padding() -> None:
    encoder, head = random_encoder("gelu"), random_head(3)
    texts = random_texts(np.random.default_rng(2), [2, 1, 3, 1, 2])
    request = CreditRequest(targets=(1,), method="end_to_end")
    together = classify(head, encoded(encoder, texts), [request] * 5, encoder=encoder).explained
    for b, text in enumerate(texts):
        alone = classify(head, encoded(encoder, [text]), [request], encoder=encoder).explained[0]
        assert alone is not None and together[b] is not None
        torch.testing.assert_close(together[b].credit, alone.credit, atol=1e-5, rtol=0)
        torch.testing.assert_close(together[b].baseline, alone.baseline, atol=1e-5, rtol=0)


def test_texts_beyond_a_passs_rows_are_split_into_groups_with_the_same_answer(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    from service.modeling import classifier

    encoder, head = random_encoder("gelu"), random_head(3)
    texts = random_texts(np.random.default_rng(3), [1, 2, 1, 3])
    enc = encoded(encoder, texts)
    requests = [CreditRequest(targets=(0, 2), method="end_to_end", by_depth=b % 2 == 0) for b in range(4)]
    whole = classify(head, enc, requests, encoder=encoder).explained
    calls: list[int] = []
    real = decompose.split
    monkeypatch.setattr(decompose, "split", lambda *a, **k: (calls.append(a[1].ids.numel()), real(*a, **k))[1])
    monkeypatch.setattr(classifier, "END_TO_END_ROWS", 1)
    parts = classify(head, enc, requests, encoder=encoder).explained
    assert len(calls) == 7  # one chunk a pass (the texts have 1, 2, 1 and 3)
    for a, b in zip(whole, parts, strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(a.credit, b.credit, atol=1e-5, rtol=0)


def test_end_to_end_credit_needs_an_encoder() -> None:
    encoder, head = random_encoder("gelu"), random_head(3)
    enc = encoded(encoder, random_texts(np.random.default_rng(4), [1]))
    with pytest.raises(ValueError, match="BERT family"):
        classify(head, enc, [CreditRequest(method="end_to_end")])
