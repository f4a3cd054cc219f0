"""Readable views of one text's end-to-end credit ``[n, d_depth, k]`` (paper §5.3): summed over
depth per token, word pieces merged into words, and tokens grouped into sentences."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+|$)", re.MULTILINE)


@dataclass
class Span:
    """A piece of the text: characters ``[start, end)`` and the token positions inside it."""

    text: str
    start: int
    end: int
    tokens: list[int]


def token_credit(credit: torch.Tensor) -> torch.Tensor:
    """``[n, d_depth, k] -> [n, k]``: credit of each token position, summed over depth."""
    return credit.sum(dim=1)  # [nk]


def words(text: str, offsets: torch.Tensor, word_ids: torch.Tensor, special: torch.Tensor) -> list[Span]:
    """Merge word pieces: one span per word, in order (special tokens belong to no word).

    A word split over two chunks keeps one span holding the tokens of both.
    """
    spans: dict[int, Span] = {}
    for pos, (w, is_special) in enumerate(zip(word_ids.tolist(), special.tolist(), strict=True)):
        if is_special or w < 0:
            continue
        s, e = (int(v) for v in offsets[pos])
        if w in spans:
            sp = spans[w]
            sp.start, sp.end = min(sp.start, s), max(sp.end, e)
            sp.tokens.append(pos)
        else:
            spans[w] = Span("", s, e, [pos])
    out = sorted(spans.values(), key=lambda sp: sp.start)
    for sp in out:
        sp.text = text[sp.start : sp.end]
    return out


def sentences(text: str, offsets: torch.Tensor, special: torch.Tensor) -> list[Span]:
    """Split ``text`` into sentences and give each the non-special tokens that start inside it."""
    spans = [Span(m.group().strip(), m.start(), m.end(), []) for m in _SENTENCE.finditer(text) if m.group().strip()]
    if not spans:
        spans = [Span(text, 0, len(text), [])]
    k = 0
    for pos, is_special in enumerate(special.tolist()):
        if is_special:
            continue
        start = int(offsets[pos, 0])
        while k + 1 < len(spans) and start >= spans[k + 1].start:
            k += 1
        spans[k].tokens.append(pos)
    return spans


def span_credit(per_token: torch.Tensor, spans: list[Span]) -> torch.Tensor:
    """``[n, k] -> [len(spans), k]``: summed credit of each span's tokens."""
    out = per_token.new_zeros(len(spans), per_token.shape[-1])  # [sk]
    for s, sp in enumerate(spans):
        if sp.tokens:
            out[s] = per_token[sp.tokens].sum(dim=0)  # [k]
    return out
