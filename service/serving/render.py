"""One step from the engine's results to the response models: words, sentences, rounding-free lists.
Routes run it off the event loop and off the model thread (see :func:`off_loop`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from service.modeling import views
from service.serving.contract import Credit, Result, Token
from service.serving.schemas import (
    ClassifyResult,
    ExplainResult,
    PredictedExplanation,
    SpanCredit,
    TokenCredit,
)
from service.serving.schemas import TargetCredit as TargetCreditView
from service.serving.schemas import Token as TokenView

T = TypeVar("T")


async def off_loop(fn: Callable[[], T]) -> T:
    """Run ``fn`` in the default thread pool: response views of long texts take a while to build."""
    return await asyncio.get_running_loop().run_in_executor(None, fn)


def predicted(credit: Credit, tokens: list[Token]) -> PredictedExplanation:
    """Token credit (summed over depth) of the one explained label, special tokens summed apart."""
    target = credit.targets[0]
    return PredictedExplanation(
        target=target.label, method=credit.method, contrast=credit.contrast, logit=target.logit,
        baseline=target.baseline,
        special=float(sum(c for tok, c in zip(tokens, target.tokens, strict=True) if tok.special)),
        tokens=[TokenCredit(token=tok.token, start=tok.start, end=tok.end, credit=c)
                for tok, c in zip(tokens, target.tokens, strict=True) if not tok.special])


def classify_result(res: Result, tokens: list[Token] | None = None) -> ClassifyResult:
    """Label and probabilities; with credit, the predicted label's token credit (``tokens``: the text's)."""
    explanation = None
    if res.credit is not None:
        if tokens is None:
            raise ValueError("a result with credit needs its tokens")
        explanation = predicted(res.credit, tokens)
    return ClassifyResult(label=res.label, score=res.scores[res.label], scores=res.scores, explanation=explanation)


def explain_result(res: Result, text: str, tokens: list[Token], word_ids: tuple[int, ...] | list[int]) -> ExplainResult:
    """Tokens, and per target credit per token, word, sentence and depth (plus matrix and phi)."""
    c = res.credit
    if c is None:
        raise ValueError("an explain result needs its credit")
    offsets = [(t.start, t.end) for t in tokens]
    special = [t.special for t in tokens]
    words = views.words(text, offsets, list(word_ids), special)
    sents = views.sentences(text, offsets, special)

    def spans(items: list[views.Span], values: list[float]) -> list[SpanCredit]:
        return [SpanCredit(text=sp.text, start=sp.start, end=sp.end, credit=v)
                for sp, v in zip(items, values, strict=True)]

    by_target = {t.label: TargetCreditView(
        logit=t.logit, baseline=t.baseline, tokens=t.tokens, words=spans(words, views.span_credit(t.tokens, words)),
        sentences=spans(sents, views.span_credit(t.tokens, sents)), depth=t.depth or [])
        for t in c.targets}
    return ExplainResult(
        label=res.label, score=res.scores[res.label], scores=res.scores, method=c.method, contrast=c.contrast,
        tokens=[TokenView(token=t.token, start=t.start, end=t.end, special=t.special) for t in tokens],
        targets=[t.label for t in c.targets], credit=by_target, matrix=c.matrix, phi=c.phi)
