"""A batch's head outputs read into plain answers: each text's label, probabilities and raw scores from one copy of
every head call's scores (logits) on the host (the probabilities taken there, as each head's problem type says),
and its credit's numbers where it asked for credit (the views a response shows are built from them by the front,
off the model's thread)."""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from service.modeling.classifier import Classified, CreditRequest, Explained
from service.modeling.manifest import Manifest
from service.serving.core.keys import model_of
from service.serving.core.results import Answer, Credit, LabelCredit, Result
from service.serving.core.work import CreditSpec, TextJob

HeadCall = tuple[list[tuple[int, int]], list[str], Classified | None]
"""One call of the heads: its texts' (position, ask) places, each one's head key, and the head's output (None: the
head was dropped meanwhile, or the device could not compute the text)."""


def credit_request(n_classes: int, spec: CreditSpec | None) -> CreditRequest | None:
    """The classifier's request for ``spec``: every class when the full matrix is wanted."""
    if spec is None:
        return None
    targets = tuple(range(n_classes)) if spec.matrix else spec.targets
    return CreditRequest(targets=targets, method=spec.method, contrast=spec.contrast,
                         by_depth=spec.detail == "full" or spec.matrix)


def unloaded(key: str) -> Result:
    """The answer for a text whose head was dropped while it waited (only texts whose callers have gone)."""
    return Result(label="", scores={}, error=f"model {model_of(key)} was unloaded")


def read_results(calls: list[HeadCall], done: dict[int, TextJob], logits: torch.Tensor | None,
                 manifests: dict[str, Manifest]) -> dict[int, Answer]:
    """Each completed text's results, by position, one per ask, from the head ``calls`` (``logits``: every call's
    scores flat on the host, one call's after another; ``done``: the texts completed in the batch, by position;
    ``manifests``: by head key)."""
    results: dict[int, list[Result | None]] = {pos: [None] * len(job.asks) for pos, job in done.items()}
    flat = None if logits is None else logits.numpy()  # [sum b k] read in numpy: a few small steps a call, no torch
    at = 0
    for chosen, keys, pred in calls:
        if pred is None:  # a head dropped meanwhile, or a text the device could not compute
            for pos, a in chosen:
                why = done[pos].failed
                results[pos][a] = (Result(label="", scores={}, error=why, unavailable=True) if why else
                                   unloaded(keys[0]))
            continue
        assert flat is not None
        b, k = pred.logits.shape
        mine = flat[at : at + b * k].reshape(b, k)  # [b k]
        at += b * k
        heads = {key: manifests.get(key) for key in set(keys)}  # a call's texts mostly ask one head
        multi = {key for key, m in heads.items() if m is not None and m.multi_label}
        with np.errstate(over="ignore", invalid="ignore"):  # non-finite scores are answered as errors below
            e = np.exp(mine - mine.max(axis=1, keepdims=True))  # [b k]
            probs = e / e.sum(axis=1, keepdims=True)  # [b k] softmax
            if multi:  # heads of one shape may share a call: each row as its own head reads it
                rows = np.array([key in multi for key in keys])[:, None]  # [b 1]
                probs = np.where(rows, 1 / (1 + np.exp(-mine)), probs)  # [b k] sigmoid there
        raw, scores, best = mine.tolist(), probs.tolist(), mine.argmax(axis=1).tolist()
        finite = np.isfinite(mine).all(axis=1).tolist()
        for r, (pos, a) in enumerate(chosen):
            key = keys[r]
            manifest = heads[key]
            results[pos][a] = (unloaded(key) if manifest is None else
                               result(manifest, pred, raw[r], scores[r], finite[r], best[r], r,
                                      done[pos].asks[a].credit))
    return cast(dict[int, Answer], results)  # every ask of a completed text is in one call: none left None


def result(manifest: Manifest, pred: Classified, logits: list[float], scores: list[float], finite: bool, k: int,
           b: int, spec: CreditSpec | None) -> Result:
    """Text ``b``'s result: its ``logits`` and probabilities ``scores`` (``k``: the highest) when all are
    ``finite``, else an error."""
    if not finite:
        return Result(label="", scores={}, error=f"model {manifest.name} produced non-finite scores for this text")
    labels = manifest.labels
    res = Result(labels[k], dict(zip(labels, scores, strict=True)), logits,
                 manifest.over_threshold(scores) if manifest.multi_label else None)
    if spec is not None and (explained := pred.explained[b]) is not None:
        res.credit = credit(labels, pred, b, explained, spec, k)
    return res


def credit(labels: list[str], pred: Classified, b: int, ex: Explained, spec: CreditSpec, predicted: int) -> Credit:
    """Plain numbers of text ``b``'s credit (views are built from them off the model thread)."""
    full = spec.detail == "full"
    targets = []
    for k in spec.targets or (predicted,):  # the full matrix covers every class; these are the asked ones
        j = ex.targets.index(k)
        logit, baseline = (None, None) if ex.logit is None or ex.baseline is None else (
            float(ex.logit[j]), float(ex.baseline[j]))
        depth = ex.credit[:, :, j].tolist() if full else None  # [n][e]
        targets.append(LabelCredit(labels[k], ex.credit[:, :, j].sum(dim=1).tolist(), depth, logit, baseline))
    out = Credit(spec.method, spec.contrast, targets)
    if spec.matrix:
        out.matrix = ex.credit.tolist()
    if spec.phi and pred.phi is not None:
        n_i = ex.credit.shape[0] * ex.credit.shape[1]
        phi1, phi2, phi3 = (p[b].float().cpu() for p in pred.phi)
        out.phi = [phi1[:n_i].tolist(), phi2.tolist(), phi3.tolist()]
    return out
