"""One step from the engine's results to the response bodies: words, sentences, rounding-free lists, as plain
dicts and lists shaped as the response models of :mod:`service.serving.schemas` dump (the models document the API in
``/openapi.json`` and check these bodies in the tests; building one per text and having the framework validate it
again cost more than computing a tweet's scores took the front). :class:`JSONBody` encodes them with msgspec. Routes
build long texts' views off the event loop and off the model thread (see :func:`off_loop`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from starlette.responses import Response

from service.modeling import views
from service.serving.contract import Credit, Result, Token

Body = dict[str, Any]
"""A response body, or a part of one, as plain JSON values (its shape: the response model the route declares)."""

T = TypeVar("T")


async def off_loop(fn: Callable[[], T]) -> T:
    """Run ``fn`` in the default thread pool: response views of long texts take a while to build."""
    return await asyncio.get_running_loop().run_in_executor(None, fn)


class JSONBody(Response):
    """A JSON response encoded by msgspec from plain values (see :data:`Body`): what the framework's own encoding
    (validating the body against the route's response model again, then the standard library's ``json``) does in
    a tenth of the time. Floats are written in their shortest round-trip form, as ``json`` writes them, exponents
    aside (``1e-7`` where ``json`` writes ``1e-07``: the same number)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


def predicted(credit: Credit, tokens: list[Token]) -> Body:
    """Token credit (summed over depth) of the one explained label, special tokens summed apart
    (:class:`~service.serving.schemas.PredictedExplanation`)."""
    target = credit.targets[0]
    return {"target": target.label, "method": credit.method, "contrast": credit.contrast, "logit": target.logit,
            "baseline": target.baseline,
            "special": float(sum(c for tok, c in zip(tokens, target.tokens, strict=True) if tok.special)),
            "tokens": [{"token": tok.token, "start": tok.start, "end": tok.end, "credit": c}
                       for tok, c in zip(tokens, target.tokens, strict=True) if not tok.special]}


def classify_result(res: Result, tokens: list[Token] | None = None) -> Body:
    """Label and probabilities; with credit, the predicted label's token credit (``tokens``: the text's)
    (:class:`~service.serving.schemas.ClassifyResult`)."""
    explanation = None
    if res.credit is not None:
        if tokens is None:
            raise ValueError("a result with credit needs its tokens")
        explanation = predicted(res.credit, tokens)
    return {"label": res.label, "score": res.scores[res.label], "scores": res.scores, "explanation": explanation}


def explain_result(res: Result, text: str, tokens: list[Token], word_ids: tuple[int, ...] | list[int]) -> Body:
    """Tokens, and per target credit per token, word, sentence and depth (plus matrix and phi)
    (:class:`~service.serving.schemas.ExplainResult`)."""
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
    return {"label": res.label, "score": res.scores[res.label], "scores": res.scores, "method": c.method,
            "contrast": c.contrast,
            "tokens": [{"token": t.token, "start": t.start, "end": t.end, "special": t.special} for t in tokens],
            "targets": [t.label for t in c.targets], "credit": by_target, "matrix": c.matrix, "phi": c.phi}
