"""A batch's head outputs read into plain answers: each text's label, probabilities and raw scores from one copy of
every head call's scores (logits) on the host (the probabilities taken there, as each head's problem type says),
and its credit's numbers where it asked for credit (the views a response shows are built from them by the front,
off the model's thread)."""

from __future__ import annotations

import torch

from service.modeling.classifier import Classified, CreditRequest, Explained
from service.modeling.manifest import Manifest
from service.serving.core.keys import model_of
from service.serving.core.results import Credit, LabelCredit, Result
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
                 manifests: dict[str, Manifest]) -> dict[tuple[int, int], Result]:
    """Each (position, ask)'s result from the head ``calls`` (``logits``: every call's scores flat on the host, one
    call's after another; ``done``: the texts completed in the batch, by position; ``manifests``: by head key)."""
    results: dict[tuple[int, int], Result] = {}
    at = 0
    for chosen, keys, pred in calls:
        if pred is None:  # a head dropped meanwhile, or a text the device could not compute
            for place in chosen:
                why = done[place[0]].failed
                results[place] = (Result(label="", scores={}, error=why, unavailable=True) if why else
                                  unloaded(keys[0]))
            continue
        assert logits is not None
        b, k = pred.logits.shape
        mine = logits[at : at + b * k].view(b, k)  # [b k]
        at += b * k
        found = [manifests.get(key) for key in keys]
        multi = [m is not None and m.multi_label for m in found]
        probs = mine.softmax(dim=-1)  # [b k]
        if any(multi):  # heads of one shape share a call: each row as its own head reads it
            probs = torch.where(torch.tensor(multi)[:, None], mine.sigmoid(), probs)  # [b k]
        raw, scores, best = mine.tolist(), probs.tolist(), mine.argmax(-1).tolist()
        finite = torch.isfinite(mine).all(dim=-1).tolist()
        specs = [done[pos].asks[a].credit for pos, a in chosen]
        for r, (place, key, manifest, spec) in enumerate(zip(chosen, keys, found, specs, strict=True)):
            if manifest is None:
                results[place] = unloaded(key)
                continue
            results[place] = result(manifest, pred, raw[r], scores[r], finite[r], best[r], r, spec)
    return results


def result(manifest: Manifest, pred: Classified, logits: list[float], scores: list[float], finite: bool, k: int,
           b: int, spec: CreditSpec | None) -> Result:
    """Text ``b``'s result: its ``logits`` and probabilities ``scores`` (``k``: the highest) when all are
    ``finite``, else an error."""
    if not finite:
        return Result(label="", scores={}, error=f"model {manifest.name} produced non-finite scores for this text")
    labels = manifest.labels
    res = Result(label=labels[k], scores=dict(zip(labels, scores, strict=True)), logits=logits,
                 labels=manifest.over_threshold(scores) if manifest.multi_label else None)
    explained = pred.explained[b]
    if spec is not None and explained is not None:
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
