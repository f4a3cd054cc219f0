"""`routing-service bench explain --ablation`: which held coefficient costs the end-to-end credit most faithfulness?

The end-to-end split (:mod:`service.modeling.decompose`) holds three kinds of coefficient at their values: the
attention probabilities, the layer norms' scales and the activations' ratios ``f(u)/u``. Each variant here lets one
kind vary with the input instead, and credits each token with gradient x input of that network (autograd through
the encoder; no longer an exact split, so its baseline is not computed): where letting a kind vary ranks tokens
better, holding it is what costs faithfulness. The same texts, metrics and occlusion as ``bench explain``.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from service.bench import explain as eb
from service.bench import report
from service.bench.report import echo, in_worker_thread
from service.modeling import decompose
from service.modeling.decompose import KINDS
from service.modeling.encoder import PackedEncoder, Packing
from service.serving.core.work import CreditSpec, Task
from service.serving.engine.engine import Engine

VARIANTS = {"held": frozenset(KINDS), **{f"{k} free": frozenset(KINDS) - {k} for k in KINDS}}
"""Each variant's held coefficients: all (the service's split, computed by autograd here too), or all but one."""

Split = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def gradient_split(held: frozenset[str]) -> Split:
    """A stand-in for :func:`decompose.split` (not by depth): each token's gradient x input embedding of the encoder
    with the ``held`` kinds of coefficient detached, per read-out; the bias part left at 0."""
    def split(encoder: PackedEncoder, p: Packing, states: torch.Tensor, grad: torch.Tensor, by_depth: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
        assert not by_depth, "the ablation splits totals only"
        with torch.inference_mode(False), torch.enable_grad():
            q = Packing(*(t.clone() if isinstance(t, torch.Tensor) else t for t in (
                p.ids, p.positions, p.to_padded, p.from_padded, p.keep)), p.shape)  # type: ignore[arg-type]
            x0 = decompose.input_embeddings(encoder, q).detach().requires_grad_(True)  # [T d]
            out = _forward(encoder, q, x0, held)  # [T e d]
            credit = []
            for g in grad.clone():  # [T e d] one read-out at a time
                (dx0,) = torch.autograd.grad((out * g).sum(), x0, retain_graph=True)  # [T d]
                credit.append((dx0 * x0).sum(dim=-1).detach())  # [T]
        c = torch.stack(credit).float()  # [r T]
        return c, torch.zeros_like(c)

    return split


def _forward(encoder: PackedEncoder, p: Packing, x0: torch.Tensor, held: frozenset[str]) -> torch.Tensor:
    """``[T, e, d]`` the encoder's hidden states from input embeddings ``x0 [T, d]``, the ``held`` kinds detached."""
    x, _ = decompose.layer_norm(x0, encoder.norm, encoder.eps, "norms" in held)  # [T d]
    states = [x]
    for layer in encoder.layers:
        x, _ = decompose.layer_forward(layer, p, x, held)  # [T d]
        states.append(x)
    return torch.stack(states, dim=1)  # [T e d]


@contextlib.contextmanager
def splitting_with(split: Split) -> Iterator[None]:
    """:func:`decompose.split` replaced by ``split`` for the engine's end-to-end credit, within the block."""
    real = decompose.split
    decompose.split = split
    try:
        yield
    finally:
        decompose.split = real


def run(engine: Engine, texts: list[str], batch_size: int, max_occlusion: int, seed: int = 0) -> dict[str, Any]:
    """Faithfulness of the default credit, each variant and occlusion on ``texts``, as :func:`eb.faithfulness`."""
    rng = random.Random(seed)
    probs = eb.Probabilities(engine, batch_size)
    methods = ["contrast", *VARIANTS, "occlusion"]
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    t0 = time.perf_counter()
    for n, text in enumerate(texts, 1):
        pr = eb.probe(engine, probs, text, None, rng, max_occlusion)
        for name, held in VARIANTS.items():
            with splitting_with(gradient_split(held)):
                res = engine.run([Task(text, credit=CreditSpec(method="end_to_end"))])[0]
            pr.scores[name] = [t.credit for t in eb.explained_tokens(engine, text, res)]
        plans = {m: eb.edits(pr, order) for m in methods if (order := eb.order_of(pr, m)) is not None}
        probs.compute([t for plan in plans.values() for t in plan.values()])
        for m, plan in plans.items():
            rows[m].append(eb.metrics(pr, probs, plan, m))
        probs.cache.clear()
        if n % 10 == 0 or n == len(texts):
            echo(f"  ablation: {n}/{len(texts)} texts, {(time.perf_counter() - t0) / n * (len(texts) - n):.0f} s to go",
                 err=True)
    return {"n_texts": len(texts), "methods": {m: eb.summarise(r) for m, r in rows.items() if r}}


def main(model: str, preset: str, repository: Path, n_texts: int, batch_size: int, max_occlusion: int, device: str,
         out: Path, seed: int = 0) -> dict[str, Any]:
    """The ablation on ``n_texts`` test texts of ``preset``; prints the table and writes ``out``."""
    from service.training.data import sample_test_texts

    texts = sample_test_texts(preset, n_texts, seed)
    engine = in_worker_thread(lambda: Engine.load(repository / model, device=device))
    echo(f"bench explain --ablation: model {model}, {len(texts)} test texts; each held kind of coefficient let vary "
         "in turn (gradient x input through the encoder)", err=True)
    faith = in_worker_thread(lambda: run(engine, texts, batch_size, max_occlusion, seed))
    rows = [{"method": m, "comp mean": s["comprehensiveness_mean"], "suff mean": s["sufficiency_mean"],
             "del AUC": s["deletion_auc"], "rho occl": "-" if s["spearman_occlusion"] is None else
             s["spearman_occlusion"]} for m, s in faith["methods"].items()]
    echo(report.table(rows, list(rows[0])))
    summary = {m: {k: s[k] for k in ("comprehensiveness_mean", "sufficiency_mean", "deletion_auc",
                                     "spearman_occlusion")} for m, s in faith["methods"].items()}
    settings = {"model": model, "faithfulness_texts": len(texts), "batch_size": batch_size,
                "max_occlusion": max_occlusion, "device": device, "seed": seed, "variants": {
                    k: sorted(v) for k, v in VARIANTS.items()}}
    path = report.write_json(out, "explain-ablation", settings, {"faithfulness": faith}, summary)
    echo(f"wrote {path}")
    return summary
