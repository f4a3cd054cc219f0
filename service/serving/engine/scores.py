"""A head call's scores (logits) read into plain results, in numpy alone (no torch): each text's label, its
probabilities as its head's problem type says (a softmax over the labels; a sigmoid each for a multi-label head) and
its raw scores. The engine reads every call of a batch with it (:mod:`~service.serving.engine.readout`, which adds
credit), and the server's process a plain batch's scores sent back from the backbone's process."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.modeling.manifest import Manifest
from service.serving.core.keys import model_of
from service.serving.core.results import Answer, Result, Scores


def unloaded(key: str) -> Result:
    """The answer for a text whose head was dropped while it waited (only texts whose callers have gone)."""
    return Result(label="", scores={}, error=f"model {model_of(key)} was unloaded")


def read_scores(logits: np.ndarray, keys: Sequence[str], manifests: dict[str, Manifest]) -> list[Result]:
    """Each row's result from ``logits [b k]``, row ``r`` of head ``keys[r]`` (``manifests``: by key; a head not
    there any more: :func:`unloaded`), without credit."""
    heads = {key: manifests.get(key) for key in set(keys)}  # a call's texts mostly ask one head
    multi = {key for key, m in heads.items() if m is not None and m.multi_label}
    with np.errstate(over="ignore", invalid="ignore"):  # non-finite scores are answered as errors below
        e = np.exp(logits - logits.max(axis=1, keepdims=True))  # [b k]
        probs = e / e.sum(axis=1, keepdims=True)  # [b k] softmax
        if multi:  # heads of one shape may share a call: each row as its own head reads it
            rows = np.array([key in multi for key in keys])[:, None]  # [b 1]
            probs = np.where(rows, 1 / (1 + np.exp(-logits)), probs)  # [b k] sigmoid there
    raw, scores, best = logits.tolist(), probs.tolist(), logits.argmax(axis=1).tolist()
    finite = np.isfinite(logits).all(axis=1)  # [b]
    if len(heads) == 1 and not multi and finite.all():  # a batch's usual case, read in one tight loop: the engine
        # host reads every front's texts (1.7 us a text here, against 2.6 with a call of scored a text)
        (m,) = heads.values()
        if m is not None:
            labels = m.labels
            return [Result(labels[k], dict(zip(labels, p, strict=True)), x)
                    for k, p, x in zip(best, scores, raw, strict=True)]
    finite_rows = finite.tolist()
    return [unloaded(key) if (m := heads[key]) is None else scored(m, raw[r], scores[r], finite_rows[r], best[r])
            for r, key in enumerate(keys)]


def read_answers(scores: Scores, manifests: dict[str, Manifest]) -> list[Answer]:
    """Plain texts' answers, one result each, from their :class:`Scores` as the backbone computed them (see
    :func:`read_scores`)."""
    return [[r] for r in read_scores(scores.logits, [scores.key] * len(scores.logits), manifests)]


def scored(manifest: Manifest, logits: list[float], scores: list[float], finite: bool, k: int) -> Result:
    """A text's result on the head of ``manifest``: its ``logits`` and probabilities ``scores`` (``k``: the highest)
    when all are ``finite``, else an error."""
    if not finite:
        return Result(label="", scores={}, error=f"model {manifest.name} produced non-finite scores for this text")
    labels = manifest.labels
    return Result(labels[k], dict(zip(labels, scores, strict=True)), logits,
                  manifest.over_threshold(scores) if manifest.multi_label else None)
