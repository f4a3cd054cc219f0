"""Shape buckets: a packed batch padded up to the smallest of a few fixed shapes, so that a computation recorded
once per shape (a CUDA graph) can be replayed for every batch that fits (no torch here).

A bucket is ``(tokens, rows, width)``: the packed stream of ``tokens`` token ids, read by attention as ``rows``
sequences of at most ``width`` tokens, one a row (the view ``[rows, width]``). A batch of ``s`` sequences of ``T``
tokens, the longest ``L``, fits when ``T <= tokens``, ``s <= rows`` and ``L <= width``, and its spare tokens can
be spread over its spare rows as *filler* sequences: ``k = rows - s`` of them, each of 0 to ``width`` tokens,
holding the ``F = tokens - T`` spare tokens (``F <= k * width``). A filler sequence attends only to itself and
what is computed for it is never read (an empty one's attention row and scores are not even defined), so the real
sequences' states and scores are what they are without it, up to the float rounding of products of another size.

Which buckets: :func:`choose_buckets` takes a sample of sequence lengths (the lengths the service sees), forms the
batches the batcher would form from them at every load (one text to a full token budget), rounds each batch up to
its own bucket on a coarse ladder, and keeps the buckets that cover most tokens. :func:`padding` says what a
bucket list costs on a sample: the padded share of the tokens computed, and the share of batches that fit none
(those run eagerly, as they are)."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

TOKEN_STEP = 2 ** 0.25
"""The ladder of bucket token counts: each about 19 % above the one before (at most 19 % of a batch padded)."""
ROW_STEP = 2 ** 0.5
"""The ladder of bucket row counts (rows cost attention only, a small part of the work)."""
ALIGN = 16
"""Token and row counts are multiples of this (above it): fewer distinct shapes, aligned products."""


@dataclass(frozen=True, order=True)
class Bucket:
    """A fixed batch shape: ``tokens`` in the packed stream, ``rows`` sequences (the attention view's rows, one
    sequence a row), each at most ``width`` tokens."""

    tokens: int
    rows: int
    width: int

    def fits(self, n_tokens: int, n_seqs: int, longest: int) -> bool:
        """Whether a batch of ``n_seqs`` sequences of ``n_tokens`` tokens in all, the longest ``longest``, pads up
        to this bucket (its spare tokens spread over its spare rows, see the module's docstring)."""
        if n_tokens > self.tokens or n_seqs > self.rows or longest > self.width or n_seqs < 1:
            return False
        return self.tokens - n_tokens <= (self.rows - n_seqs) * self.width

    def filler(self, n_tokens: int, n_seqs: int) -> np.ndarray:
        """``[rows - n_seqs]`` the lengths of the filler sequences that pad a fitting batch up to this bucket: the
        spare tokens spread evenly (each 0 to ``width``)."""
        k, spare = self.rows - n_seqs, self.tokens - n_tokens
        if k == 0:
            return np.zeros(0, dtype=np.int64)
        out = np.full(k, spare // k, dtype=np.int64)  # [k]
        out[: spare % k] += 1
        return out

    @property
    def cost(self) -> tuple[int, int]:
        """What a batch padded to it computes, to order buckets: its tokens (projections and feed-forward layers),
        then its attention view's slots."""
        return self.tokens, self.rows * self.width


def _ladder(n: int, step: float, least: int) -> int:
    """The smallest rung at least ``n`` of the ladder ``least * step ** m`` (rungs above ``ALIGN`` rounded up to a
    multiple of it; powers of two stay rungs)."""
    m = 0
    while True:
        value = math.ceil(least * step ** m - 1e-6)
        if value > ALIGN:
            value = -(-value // ALIGN) * ALIGN
        if value >= n:
            return value
        m += 1


def own_bucket(n_tokens: int, n_seqs: int, longest: int, width_limit: int) -> Bucket:
    """The bucket of the ladders a batch rounds up to: width the next power of two (at least 16, at most
    ``width_limit``), tokens the next rung of their ladder, rows the next of theirs above the sequences and as
    many filler rows as the spare tokens need."""
    width = min(max(16, 1 << (max(1, longest) - 1).bit_length()), width_limit)
    tokens = _ladder(n_tokens, TOKEN_STEP, 16)
    rows = _ladder(n_seqs + math.ceil((tokens - n_tokens) / width), ROW_STEP, 1)
    return Bucket(tokens, rows, width)


def batches(lengths: Sequence[int], budget: int, max_texts: int, seed: int = 0, per_size: int = 64
            ) -> list[tuple[int, int, int]]:
    """``(tokens, sequences, longest)`` of batches the batcher forms from texts of ``lengths`` (drawn at random):
    ``per_size`` batches of each size 1, 2, 4, ... texts up to a full batch (``budget`` tokens or ``max_texts``
    texts, whichever comes first)."""
    rng = random.Random(seed)
    out, size = [], 1
    while True:
        full = False
        for _ in range(per_size):
            drawn, taken = [], 0
            while len(drawn) < size:
                n = rng.choice(lengths)
                if drawn and (taken + n > budget or len(drawn) >= max_texts):
                    full = True
                    break
                drawn.append(n)
                taken += n
            out.append((taken, len(drawn), max(drawn)))
        if full or size >= max_texts:
            return out
        size *= 2


def choose_buckets(lengths: Sequence[int], budget: int, max_texts: int, width_limit: int, count: int = 24,
                   seed: int = 0) -> list[Bucket]:
    """At most ``count`` buckets for batches of texts whose (chunk) lengths are like ``lengths``: each sampled batch
    (:func:`batches`) rounded up to its own bucket (:func:`own_bucket`), and the buckets that hold most of the
    sampled tokens kept; smallest first. A batch whose own bucket is not kept pads up to a larger kept one that
    fits it, or runs eagerly."""
    sample = [min(n, width_limit) for n in lengths if n > 0]
    if not sample:
        raise ValueError("choose_buckets needs a sample of positive lengths")
    weight: Counter[Bucket] = Counter()
    for n_tokens, n_seqs, longest in batches(sample, budget, max_texts, seed):
        weight[own_bucket(n_tokens, n_seqs, longest, width_limit)] += n_tokens
    return sorted(b for b, _ in weight.most_common(count))


def smallest_fit(buckets: Sequence[Bucket], n_tokens: int, n_seqs: int, longest: int) -> Bucket | None:
    """The cheapest bucket of ``buckets`` the batch fits (see :attr:`Bucket.cost`), or None."""
    fitting = [b for b in buckets if b.fits(n_tokens, n_seqs, longest)]
    return min(fitting, key=lambda b: b.cost) if fitting else None


def padding(buckets: Sequence[Bucket], sampled: Sequence[tuple[int, int, int]]) -> dict[str, float]:
    """What ``buckets`` cost on batches ``sampled`` (``(tokens, sequences, longest)`` each): ``padded_share``, the
    share of the tokens computed in buckets that are filler; ``eager_share``, the share of the batches that fit no
    bucket (by tokens)."""
    real = padded = eager = total = 0
    for n_tokens, n_seqs, longest in sampled:
        total += n_tokens
        bucket = smallest_fit(buckets, n_tokens, n_seqs, longest)
        if bucket is None:
            eager += n_tokens
            continue
        real += n_tokens
        padded += bucket.tokens
    return {"padded_share": 1 - real / padded if padded else 0.0, "eager_share": eager / total if total else 0.0}


def pad_batch(ids: np.ndarray, lengths: np.ndarray, bucket: Bucket, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``ids [tokens]`` and ``lengths [rows]`` of a fitting batch (``ids [T]`` back to back, ``lengths [s]``) padded
    up to ``bucket``: filler sequences of ``pad_id`` after the real ones.

    Raises:
        ValueError: the batch does not fit the bucket.
    """
    T, s = len(ids), len(lengths)
    if not bucket.fits(T, s, int(lengths.max()) if s else 0):
        raise ValueError(f"a batch of {s} sequences, {T} tokens, does not fit {bucket}")
    padded_ids = np.full(bucket.tokens, pad_id, dtype=np.int64)  # [tokens]
    padded_ids[:T] = ids
    return padded_ids, np.concatenate([lengths.astype(np.int64, copy=False), bucket.filler(T, s)])  # [rows]



QUANTILES = tuple(float(q) for q in np.concatenate([np.linspace(0, 0.98, 50), [0.99, 0.995, 0.999, 1.0]]))
"""Where :func:`length_sample` reads a distribution of lengths: every 2 %, and finer in the long tail (the longest
text of a full batch of hundreds sets its width)."""


def length_sample(lengths: Sequence[int]) -> list[int]:
    """``lengths``' quantiles at :data:`QUANTILES`: their distribution in a few dozen numbers, kept with a model (its
    manifest's ``token_lengths``) and drawn from again by :func:`draw_lengths`."""
    if not lengths:
        return []
    values = np.quantile(np.asarray(lengths, dtype=np.float64), QUANTILES)
    return [math.ceil(float(v)) for v in values]


def draw_lengths(quantiles: Sequence[int], n: int = 4000, seed: int = 0) -> list[int]:
    """``n`` lengths drawn from the distribution whose :data:`QUANTILES` are ``quantiles`` (inverse transform: a
    uniform draw's place between the quantiles, read off linearly)."""
    if len(quantiles) != len(QUANTILES):
        raise ValueError(f"expected {len(QUANTILES)} quantiles, got {len(quantiles)}")
    u = np.random.default_rng(seed).random(n)  # [n]
    return [max(1, math.ceil(float(v))) for v in np.interp(u, QUANTILES, np.asarray(quantiles, dtype=np.float64))]
