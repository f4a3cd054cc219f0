"""One step from the engine's results to the response bodies: words, sentences, rounding-free lists, as plain
dicts and lists shaped as the response models of :mod:`service.serving.api.schemas` dump (the models document the API
in ``/openapi.json`` and check these bodies in the tests; building one per text and having the framework validate it
again cost more than computing a tweet's scores took the front). The API encodes them
(:class:`~service.serving.api.responses.JSONBody`). Long texts' views are built off the event loop and off the model
thread (see :func:`off_loop`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from service.modeling import views
from service.serving.core.results import Credit, Result, TokenSpan

Body = dict[str, Any]
"""A response body, or a part of one, as plain JSON values (its shape: the response model the route declares)."""

T = TypeVar("T")


async def off_loop(fn: Callable[[], T]) -> T:
    """Run ``fn`` in the default thread pool: response views of long texts take a while to build."""
    return await asyncio.get_running_loop().run_in_executor(None, fn)


def predicted(credit: Credit, tokens: list[TokenSpan]) -> Body:
    """Token credit (summed over depth) of the one explained label, special tokens summed apart
    (:class:`~service.serving.api.schemas.PredictedExplanation`)."""
    target = credit.targets[0]
    return {"target": target.label, "method": credit.method, "contrast": credit.contrast, "logit": target.logit,
            "baseline": target.baseline,
            "special": float(sum(c for tok, c in zip(tokens, target.tokens, strict=True) if tok.special)),
            "tokens": [{"token": tok.token, "start": tok.start, "end": tok.end, "credit": c}
                       for tok, c in zip(tokens, target.tokens, strict=True) if not tok.special]}


def scores(res: Result, raw: bool = False) -> dict[str, float]:
    """Every label's probability, or (``raw``) the head's logit for it."""
    return dict(zip(res.scores, res.logits, strict=True)) if raw else res.scores


def _scored(res: Result, raw: bool) -> Body:
    """The label, its score and every label's; a multi-label model's predicted labels too."""
    every = scores(res, raw)
    body = {"label": res.label, "score": every[res.label], "scores": every}
    if res.labels is not None:
        body["labels"] = res.labels
    return body


def classify_result(res: Result, tokens: list[TokenSpan] | None = None, raw: bool = False) -> Body:
    """Label and probabilities (``raw``: logits); with credit, the predicted label's token credit (``tokens``: the
    text's) (:class:`~service.serving.api.schemas.ClassifyResult`)."""
    explanation = None
    if res.credit is not None:
        if tokens is None:
            raise ValueError("a result with credit needs its tokens")
        explanation = predicted(res.credit, tokens)
    return {**_scored(res, raw), "explanation": explanation}


def explain_result(res: Result, text: str, tokens: list[TokenSpan], word_ids: tuple[int, ...] | list[int],
                   raw: bool = False) -> Body:
    """Tokens, and per target credit per token, word, sentence and depth (plus matrix and phi); probabilities or
    (``raw``) logits (:class:`~service.serving.api.schemas.ExplainResult`)."""
    c = res.credit
    if c is None:
        raise ValueError("an explain result needs its credit")
    offsets = [(t.start, t.end) for t in tokens]
    special = [t.special for t in tokens]
    words = views.words(text, offsets, list(word_ids), special)
    sents = views.sentences(text, offsets, special)

    def spans(items: list[views.Span], values: list[float]) -> list[Body]:
        return [{"text": sp.text, "start": sp.start, "end": sp.end, "credit": v}
                for sp, v in zip(items, values, strict=True)]

    by_target = {t.label: {"logit": t.logit, "baseline": t.baseline, "tokens": t.tokens,
                           "words": spans(words, views.span_credit(t.tokens, words)),
                           "sentences": spans(sents, views.span_credit(t.tokens, sents)), "depth": t.depth or []}
                 for t in c.targets}
    return {**_scored(res, raw), "method": c.method,
            "contrast": c.contrast,
            "tokens": [{"token": t.token, "start": t.start, "end": t.end, "special": t.special} for t in tokens],
            "targets": [t.label for t in c.targets], "credit": by_target, "matrix": c.matrix, "phi": c.phi}
