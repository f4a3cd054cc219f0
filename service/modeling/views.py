"""Readable views of one text's credit: word pieces merged into words, tokens grouped into sentences,
and a view's credit as the sum over its tokens. Plain Python (no torch): the serving layer builds
them off the model thread."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+|$)", re.MULTILINE)


@dataclass
class Span:
    """A piece of the text: characters ``[start, end)`` and the token positions inside it."""

    text: str
    start: int
    end: int
    tokens: list[int]


def words(text: str, offsets: Iterable[Sequence[int]], word_ids: Iterable[int], special: Iterable[bool]) -> list[Span]:
    """Merge word pieces: one span per word, in order (special tokens belong to no word).

    A word split over two chunks keeps one span holding the tokens of both.
    """
    spans: dict[int, Span] = {}
    for pos, ((s, e), w, is_special) in enumerate(zip(offsets, word_ids, special, strict=True)):
        w = int(w)
        if is_special or w < 0:
            continue
        if w in spans:
            sp = spans[w]
            sp.start, sp.end = min(sp.start, int(s)), max(sp.end, int(e))
            sp.tokens.append(pos)
        else:
            spans[w] = Span("", int(s), int(e), [pos])
    out = sorted(spans.values(), key=lambda sp: sp.start)
    for sp in out:
        sp.text = text[sp.start : sp.end]
    return out


def sentences(text: str, offsets: Iterable[Sequence[int]], special: Iterable[bool]) -> list[Span]:
    """Split ``text`` into sentences and give each the non-special tokens that start inside it."""
    spans = [Span(m.group().strip(), m.start(), m.end(), []) for m in _SENTENCE.finditer(text) if m.group().strip()]
    if not spans:
        spans = [Span(text, 0, len(text), [])]
    k = 0
    for pos, ((start, _end), is_special) in enumerate(zip(offsets, special, strict=True)):
        if is_special:
            continue
        while k + 1 < len(spans) and int(start) >= spans[k + 1].start:
            k += 1
        spans[k].tokens.append(pos)
    return spans


def span_credit(per_token: Sequence[float], spans: list[Span]) -> list[float]:
    """Summed credit of each span's tokens."""
    return [float(sum(per_token[p] for p in sp.tokens)) for sp in spans]
