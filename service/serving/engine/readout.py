"""A batch's head outputs read into plain answers: each text's label, probabilities and raw scores from one copy of
every head call's scores (logits) on the host (read by :mod:`~service.serving.engine.scores`, in numpy), and its
credit's numbers where it asked for credit (the views a response shows are built from them by the front, off the
model's thread)."""

from __future__ import annotations

from typing import cast

import torch

from service.modeling.classifier import Classified, CreditRequest, Explained
from service.modeling.manifest import Manifest
from service.serving.core.results import Answer, Credit, LabelCredit, Result
from service.serving.core.work import CreditSpec, TextJob
from service.serving.engine.scores import read_scores, unloaded

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
        for r, ((pos, a), res) in enumerate(zip(chosen, read_scores(mine, keys, manifests), strict=True)):
            spec = done[pos].asks[a].credit
            if spec is not None and not res.error and (explained := pred.explained[r]) is not None:
                res.credit = credit(manifests[keys[r]].labels, pred, r, explained, spec, int(mine[r].argmax()))
            results[pos][a] = res
    return cast(dict[int, Answer], results)  # every ask of a completed text is in one call: none left None


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
