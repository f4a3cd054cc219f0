"""`routing-service bench explain`: is the credit faithful, and what does it cost?

Faithfulness, per text, for the predicted class's probability ``p``, with tokens ranked by each method
(highest first; ``|.|``: largest magnitude first):

- comprehensiveness at k%: ``p(text) - p(text without its top-k% tokens)`` (higher is better);
- sufficiency at k%: ``p(text) - p(only its top-k% tokens)`` (lower is better);
- deletion AUC: area under ``p`` as tokens are deleted in ranked order, 0 to 100% (lower is better);
- Spearman with occlusion: rank correlation of the method's token scores with each token's
  leave-one-out drop of ``p`` (higher is better).

Methods: value-path contribution (contrast form, the API's default, and plain logit form), the end-to-end
split over the input tokens through the encoder (contrast form), the paper's eq. 15 routing shares (signed
and magnitude), Captum's Layer Integrated Gradients on the embedding layer through backbone + head,
leave-one-token-out occlusion, and random tokens. Cost: milliseconds per explanation, one text at a time,
and classify with credit against classify alone at two batch sizes (the end-to-end split also for every
label with its depth split). The model runs in a worker thread, as the server runs it.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from service.bench import report
from service.bench.report import echo, in_worker_thread
from service.serving.api.schemas import PredictedExplanation, TokenCredit
from service.serving.core.results import Result
from service.serving.core.work import CreditSpec, Task
from service.serving.engine.engine import Engine
from service.serving.pipeline import render

FRACTIONS = (0.01, 0.05, 0.10, 0.20)
CURVE = tuple(k / 10 for k in range(11))  # deletion curve: 0%, 10%, ..., 100% of the tokens deleted
EXPLAINERS: dict[str, dict[str, Any]] = {  # method -> the credit that explains one text with it
    "contrast": {"method": "contribution", "contrast": True},
    "contribution": {"method": "contribution", "contrast": False},
    "end_to_end": {"method": "end_to_end", "contrast": True},
    "shares": {"method": "shares"},
}
METHODS = ("contrast", "contribution", "end_to_end", "shares", "shares_abs", "layer_ig", "occlusion", "random")
DESCRIPTIONS = {
    "contrast": "value path, contrast (default)", "contribution": "value path, plain logit",
    "end_to_end": "end to end, contrast",
    "shares": "eq. 15 shares, signed", "shares_abs": "eq. 15 shares, |.|", "layer_ig": "Layer IG",
    "occlusion": "leave-one-out occlusion", "random": "random tokens",
}


def cost_of_credit(engine: Engine, texts: list[str], batch_size: int, rounds: int) -> dict[str, Any]:
    """Milliseconds per text for classify alone and with credit, response views included (the service
    builds them off the model thread, but they are work all the same), interleaved round by round so
    that drift on a noisy machine hits every mode alike. ``one_explained``: one text of each batch asks
    for credit, the others classify only (what sharing a batch with explanations costs them); ``end_to_end_all``:
    the end-to-end split of every label, each by depth."""
    ordered = sorted(texts, key=len)
    batches = [ordered[k : k + batch_size] for k in range(0, len(ordered), batch_size)]
    every = tuple(range(len(engine.labels(engine.default))))
    modes: dict[str, Callable[[str, int], Task]] = {
        "classify": lambda t, _: Task(t),
        "contrast": lambda t, _: Task(t, credit=CreditSpec()),
        "end_to_end": lambda t, _: Task(t, credit=CreditSpec(method="end_to_end")),
        "end_to_end_all": lambda t, _: Task(t, credit=CreditSpec(method="end_to_end", targets=every, detail="full")),
        "shares": lambda t, _: Task(t, credit=CreditSpec(method="shares")),
        "full_views": lambda t, _: Task(t, credit=CreditSpec(detail="full")),
        "one_explained": lambda t, k: Task(t, credit=CreditSpec() if k == 0 else None),
    }
    names = list(modes)
    model = engine.default

    def answer(name: str, b: list[str]) -> list[Any]:
        """One batch as the service answers it: tokenizing, the engine, then the response views (render)."""
        encodings = engine.chunker.encode(b, engine.max_length(model))
        tasks = [replace(modes[name](t, k), encoding=e) for k, (t, e) in enumerate(zip(b, encodings, strict=True))]
        results = engine.run(tasks)
        if name == "full_views":
            return [render.explain_result(r, t, engine.tokens(e), e.word_ids)
                    for r, t, e in zip(results, b, encodings, strict=True)]
        return [render.classify_result(r, engine.tokens(e) if r.credit is not None else None)
                for r, e in zip(results, encodings, strict=True)]

    def once(name: str) -> float:
        t0 = time.perf_counter()
        for b in batches:
            answer(name, b)
        return time.perf_counter() - t0

    once("full_views")  # warm-up, untimed: first passes over new shapes pay for allocations
    for name in names:
        answer(name, batches[0])
    totals = dict.fromkeys(names, 0.0)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate: none always goes first
            totals[name] += once(name)
    ms = {k: 1000 * v / rounds / len(texts) for k, v in totals.items()}
    return {"batch_size": batch_size, "ms_per_text": ms,
            "over_classify": {k: v / ms["classify"] for k, v in ms.items() if k != "classify"}}


class LayerIG:
    """Captum's Layer Integrated Gradients on the backbone's embedding layer, through backbone + head,
    for the predicted class's probability. It sees the text's first chunk (``max_length`` tokens)."""

    def __init__(self, engine: Engine, n_steps: int = 50) -> None:
        from captum.attr import LayerIntegratedGradients

        self.n_steps = n_steps
        self.clf = engine.classifiers[engine.default]
        self.max_length = engine.max_length(engine.default)
        self.tok = self.clf.backbone.tokenizer
        self.lig = LayerIntegratedGradients(self._prob, self.clf.backbone.encoder.embeddings)

    def _prob(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, target: int) -> torch.Tensor:
        out = self.clf.backbone.encoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        hidden = torch.stack(out.hidden_states, dim=-2).float()  # [b n e d]
        return self.clf.head(hidden, attention_mask == 0).scores.softmax(-1)[:, target]  # [b]

    def explain(self, text: str, target: int) -> dict[tuple[int, int], float]:
        """Attribution of each (non-special) token of the first chunk, keyed by its character span."""
        enc = self.tok(text, return_offsets_mapping=True, return_special_tokens_mask=True, truncation=True,
                       max_length=self.max_length, return_tensors="pt")
        ids, att = enc["input_ids"], enc["attention_mask"]
        special = enc["special_tokens_mask"][0].bool()
        baseline = ids.clone()
        baseline[0, ~special] = self.tok.pad_token_id
        with torch.enable_grad():
            attr = self.lig.attribute(ids, baselines=baseline, additional_forward_args=(att, target),
                                      n_steps=self.n_steps, internal_batch_size=self.n_steps)
        scores = attr.sum(-1)[0].detach()  # [n]
        spans = enc["offset_mapping"][0].tolist()
        return {(s, e): float(v) for (s, e), v, sp in zip(spans, scores.tolist(), special.tolist(), strict=True)
                if not sp}


def explained_tokens(engine: Engine, text: str, res: Result) -> list[TokenCredit]:
    """The non-special tokens of ``text``'s explained result with their credit, as the service answers them."""
    (encoding,) = engine.chunker.encode([text], engine.max_length(engine.default))
    view = render.classify_result(res, engine.tokens(encoding))["explanation"]
    if view is None:
        raise ValueError("the result carries no credit")
    return PredictedExplanation.model_validate(view).tokens


def delete_tokens(text: str, offsets: Sequence[tuple[int, int]], positions: Sequence[int]) -> str:
    """``text`` without the characters of the tokens at ``positions``."""
    spans = sorted(offsets[p] for p in positions)
    out, last = [], 0
    for s, e in spans:
        out.append(text[last:s])
        last = max(last, e)
    out.append(text[last:])
    return "".join(out)


def ranking(scores: Sequence[float], by_magnitude: bool = False) -> list[int]:
    """Positions by score, highest first (or by magnitude, largest first); ties keep text order."""
    key = (lambda k: -abs(scores[k])) if by_magnitude else (lambda k: -scores[k])
    return sorted(range(len(scores)), key=key)


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (None when either side is constant or too short)."""
    from scipy.stats import spearmanr

    if len(a) < 3 or len(set(a)) < 2 or len(set(b)) < 2:
        return None
    return float(spearmanr(a, b).statistic)


@dataclass
class Probe:
    """One text: its tokens (character spans), predicted class and probability, and each method's
    token scores (None where a method does not score a token)."""

    text: str
    spans: list[tuple[int, int]]
    target: str
    p0: float
    scores: dict[str, list[float | None]] = field(default_factory=dict)
    occluded: list[int] = field(default_factory=list)  # token positions with an occlusion score


class Probabilities:
    """Probability of a label for many edited texts, each computed once, in length-sorted batches."""

    def __init__(self, engine: Engine, batch_size: int) -> None:
        self.engine, self.batch_size = engine, batch_size
        self.cache: dict[str, dict[str, float]] = {}

    def compute(self, texts: Sequence[str]) -> None:
        todo = sorted({t for t in texts if t not in self.cache}, key=len)
        for k in range(0, len(todo), self.batch_size):
            batch = todo[k : k + self.batch_size]
            for t, r in zip(batch, self.engine.run([Task(t) for t in batch]), strict=True):
                self.cache[t] = r.scores

    def __call__(self, text: str, label: str) -> float:
        return self.cache[text][label]


def probe(engine: Engine, probs: Probabilities, text: str, lig: LayerIG | None, rng: random.Random,
          max_occlusion: int) -> Probe:
    """Explain ``text`` with every method and score its tokens."""
    tokens: list[TokenCredit] = []
    pr: Probe | None = None
    for method, options in EXPLAINERS.items():
        res = engine.run([Task(text, credit=CreditSpec(**options))])[0]
        tokens = explained_tokens(engine, text, res)
        if pr is None:
            pr = Probe(text, [(t.start, t.end) for t in tokens], res.label, res.scores[res.label])
        pr.scores[method] = [t.credit for t in tokens]
    assert pr is not None
    pr.scores["shares_abs"] = [abs(v) for v in pr.scores["shares"]]  # type: ignore[arg-type]
    pr.scores["random"] = [rng.random() for _ in tokens]
    if lig is not None:
        by_span = lig.explain(text, engine.labels(engine.default).index(pr.target))
        pr.scores["layer_ig"] = [by_span.get(sp) for sp in pr.spans]
    n = len(pr.spans)
    pr.occluded = list(range(n)) if n <= max_occlusion else sorted(rng.sample(range(n), max_occlusion))
    edited = [delete_tokens(text, pr.spans, [m]) for m in pr.occluded]
    probs.compute(edited)
    occ: list[float | None] = [None] * n
    for m, e in zip(pr.occluded, edited, strict=True):
        occ[m] = pr.p0 - probs(e, pr.target)
    pr.scores["occlusion"] = occ
    return pr


def time_per_explanation(engine: Engine, texts: list[str], lig: LayerIG | None, batch_size: int,
                         max_occlusion: int, rounds: int = 2) -> dict[str, float]:
    """Milliseconds to explain one text with each method (classify alone for reference), one text at
    a time. Each method explains all ``texts`` back to back, as a service would (steady state); the
    methods' blocks alternate over ``rounds`` in a rotating order so that drift hits them alike.
    Occlusion: one forward pass per token (up to ``max_occlusion``), in batches."""
    def occlude(text: str) -> None:
        res = engine.run([Task(text, credit=CreditSpec())])[0]
        spans = [(t.start, t.end) for t in explained_tokens(engine, text, res)][:max_occlusion]
        edited = [delete_tokens(text, spans, [m]) for m in range(len(spans))]
        for k in range(0, len(edited), batch_size):
            engine.run([Task(t) for t in edited[k : k + batch_size]])

    methods: dict[str, Callable[[str], Any]] = {"classify": lambda t: engine.run([Task(t)])}
    for name, options in EXPLAINERS.items():
        methods[name] = lambda t, o=options: engine.run([Task(t, credit=CreditSpec(**o))])
    if lig is not None:
        methods["layer_ig"] = lambda t: lig.explain(t, 0)
    methods["occlusion"] = occlude
    names = list(methods)
    for name in names:  # warm-up
        methods[name](texts[0])
    seconds = dict.fromkeys(names, 0.0)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            for text in texts:
                methods[name](text)
            seconds[name] += time.perf_counter() - t0
    return {name: 1000 * v / rounds / len(texts) for name, v in seconds.items()}


def order_of(pr: Probe, method: str) -> list[int] | None:
    """The method's full token ranking, or None if it does not score every token of this text
    (occlusion on a sample). Tokens a method leaves unscored (Layer IG past the first chunk) go last."""
    scores = pr.scores.get(method)
    if scores is None or (method == "occlusion" and len(pr.occluded) < len(pr.spans)):
        return None
    filled = [-math.inf if v is None else v for v in scores]
    return ranking(filled, by_magnitude=method == "shares_abs")


def edits(pr: Probe, order: list[int]) -> dict[str, str]:
    """Every edited text the metrics need for one ranking."""
    n, out = len(order), {}
    for f in FRACTIONS:
        k = max(1, round(f * n))
        out[f"del{f}"] = delete_tokens(pr.text, pr.spans, order[:k])
        out[f"keep{f}"] = delete_tokens(pr.text, pr.spans, order[k:])
    for c in CURVE[1:-1]:
        out[f"curve{c}"] = delete_tokens(pr.text, pr.spans, order[: round(c * n)])
    out["curve1.0"] = delete_tokens(pr.text, pr.spans, order)
    return out


def metrics(pr: Probe, probs: Probabilities, edited: dict[str, str], method: str) -> dict[str, Any]:
    """Comprehensiveness, sufficiency, deletion AUC and Spearman with occlusion for one ranking."""
    p = {k: probs(t, pr.target) for k, t in edited.items()}
    curve = [pr.p0] + [p[f"curve{c}"] for c in CURVE[1:]]
    auc = sum((a + b) / 2 for a, b in itertools.pairwise(curve)) / (len(curve) - 1)
    out: dict[str, Any] = {"comprehensiveness": {f: pr.p0 - p[f"del{f}"] for f in FRACTIONS},
                           "sufficiency": {f: pr.p0 - p[f"keep{f}"] for f in FRACTIONS}, "deletion_auc": auc}
    if method != "occlusion":
        pairs = [(pr.scores[method][m], pr.scores["occlusion"][m]) for m in pr.occluded]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        out["spearman_occlusion"] = spearman([a for a, _ in pairs], [b for _, b in pairs])  # type: ignore[misc]
    return out


def faithfulness(engine: Engine, texts: list[str], lig: LayerIG | None, batch_size: int, max_occlusion: int,
                 seed: int = 0) -> dict[str, Any]:
    """Every method's faithfulness metrics, averaged over ``texts``."""
    rng = random.Random(seed)
    probs = Probabilities(engine, batch_size)
    per_method: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    t_start = time.perf_counter()
    for n, text in enumerate(texts, 1):
        pr = probe(engine, probs, text, lig, rng, max_occlusion)
        plans = {m: edits(pr, order) for m in METHODS if (order := order_of(pr, m)) is not None}
        probs.compute([t for plan in plans.values() for t in plan.values()])
        for m, plan in plans.items():
            per_method[m].append(metrics(pr, probs, plan, m))
        probs.cache.clear()
        if n % 10 == 0 or n == len(texts):
            eta = (time.perf_counter() - t_start) / n * (len(texts) - n)
            echo(f"  faithfulness: {n}/{len(texts)} texts, {eta:.0f} s to go", err=True)
    return {"n_texts": len(texts), "methods": {m: summarise(rows) for m, rows in per_method.items() if rows}}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over texts (Spearman over the texts where it is defined)."""
    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else float("nan")

    out: dict[str, Any] = {"n_texts": len(rows)}
    for key in ("comprehensiveness", "sufficiency"):
        out[key] = {f: mean([r[key][f] for r in rows]) for f in FRACTIONS}
        out[f"{key}_mean"] = mean(list(out[key].values()))
    out["deletion_auc"] = mean([r["deletion_auc"] for r in rows])
    rhos = [r["spearman_occlusion"] for r in rows if r.get("spearman_occlusion") is not None]
    out["spearman_occlusion"] = mean(rhos) if rhos else None
    return out


def print_tables(costs: list[dict[str, Any]], ms: dict[str, float], faith: dict[str, Any]) -> None:
    rows = [{"batch": c["batch_size"], "classify ms/text": c["ms_per_text"]["classify"],
             **{f"{k} x": v for k, v in c["over_classify"].items()}} for c in costs]
    echo("Cost of credit: ms per text for classify alone, and each mode over it (engine, interleaved rounds)")
    echo(report.table(rows, list(rows[0])))
    echo("\nMilliseconds per explanation, one text at a time (x: over classify alone, same texts)")
    echo(report.table([{"method": k, "ms": v, "x classify": v / ms["classify"]} for k, v in ms.items()],
                      ["method", "ms", "x classify"]))
    if not faith["methods"]:
        return
    echo(f"\nFaithfulness on {faith['n_texts']} texts (predicted class's probability; comprehensiveness and "
         "Spearman: higher is better; sufficiency and deletion AUC: lower is better)")
    frows = []
    for m, s in faith["methods"].items():
        row: dict[str, Any] = {"method": DESCRIPTIONS[m], "texts": s["n_texts"]}
        row.update({f"comp {round(100 * f)}%": v for f, v in s["comprehensiveness"].items()})
        row["comp mean"] = s["comprehensiveness_mean"]
        row.update({f"suff {round(100 * f)}%": v for f, v in s["sufficiency"].items()})
        row["del AUC"] = s["deletion_auc"]
        row["rho occl"] = "-" if s.get("spearman_occlusion") is None else s["spearman_occlusion"]
        frows.append(row)
    echo(report.table(frows, list(frows[0])))


def run(model: str, preset: str, repository: Path, n_texts: int, n_faithful: int, n_timed: int, batch_size: int,
        rounds: int, n_steps: int | None, max_occlusion: int, device: str, out: Path, seed: int = 0
        ) -> dict[str, Any]:
    """The whole bench (``n_steps`` None: Layer IG left out); writes ``out``."""
    from service.training.data import sample_test_texts

    texts = sample_test_texts(preset, max(n_texts, n_faithful, n_timed), seed)
    engine = in_worker_thread(lambda: Engine.load(repository / model, device=device))
    cost_texts = texts[:n_texts]
    echo(f"bench explain: model {model}; cost of credit at batch sizes 1 and {batch_size} on {len(cost_texts)} "
         "test texts", err=True)
    costs = in_worker_thread(lambda: [cost_of_credit(engine, cost_texts[: max(16, len(cost_texts) // 8)], 1, rounds),
                                      cost_of_credit(engine, cost_texts, batch_size, rounds)])
    lig: LayerIG | None = None
    try:
        lig = None if n_steps is None else LayerIG(engine, n_steps)
    except ImportError:
        echo("  captum is not installed (pip install -e '.[bench]'): Layer IG left out", err=True)
    echo(f"time per explanation on {min(n_timed, len(texts))} texts, one at a time", err=True)
    ms = in_worker_thread(lambda: time_per_explanation(engine, texts[:n_timed], lig, batch_size, max_occlusion))
    ig = "left out" if lig is None else f"{n_steps} steps on the first chunk"
    echo(f"faithfulness on {min(n_faithful, len(texts))} texts (Layer IG: {ig}; "
         f"occlusion: up to {max_occlusion} tokens per text)", err=True)
    faith = in_worker_thread(lambda: faithfulness(engine, texts[:n_faithful], lig, batch_size, max_occlusion, seed))
    print_tables(costs, ms, faith)
    summary: dict[str, Any] = {
        "over_classify": {c["batch_size"]: c["over_classify"] for c in costs},
        "ms_per_explanation": ms,
        "layer_ig_over_contrast": ms["layer_ig"] / ms["contrast"] if "layer_ig" in ms else None,
        "occlusion_over_contrast": ms["occlusion"] / ms["contrast"],
        "faithfulness": {m: {k: s[k] for k in ("comprehensiveness_mean", "sufficiency_mean", "deletion_auc",
                                                 "spearman_occlusion")} for m, s in faith["methods"].items()},
    }
    if summary["layer_ig_over_contrast"] is not None:
        echo(f"Layer IG / value-path credit per explanation: {summary['layer_ig_over_contrast']:.1f}x")
    settings = {"model": model, "cost_texts": len(cost_texts), "faithfulness_texts": faith["n_texts"],
                "timed_texts": min(n_timed, len(texts)), "batch_size": batch_size, "rounds": rounds,
                "ig_steps": n_steps, "max_occlusion": max_occlusion, "device": device, "fractions": FRACTIONS,
                "seed": seed}
    path = report.write_json(out, "explain", settings, {"cost": costs, "ms_per_explanation": ms,
                                                        "faithfulness": faith}, summary)
    echo(f"wrote {path}")
    return summary
