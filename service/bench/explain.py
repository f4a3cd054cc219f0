"""`routing-service bench explain`: what credit assignment costs, compared with classifying alone and
with Captum's Layer Integrated Gradients on the same backbone + head, and whether it is faithful
(comprehensiveness: delete the top-credited tokens and watch the predicted probability drop)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

from service.bench import report
from service.bench.report import echo
from service.serving.engine import Engine, Task

FRACTIONS = (0.01, 0.03, 0.05, 0.10)


def _timed(fn: Any, rounds: int) -> float:
    t0 = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - t0) / rounds


def cost_of_credit(engine: Engine, texts: list[str], batch_size: int, rounds: int) -> dict[str, Any]:
    """Seconds per text for classify, classify + token credit, and the full explain views, interleaved
    round by round so that drift on a noisy machine hits all three alike."""
    ordered = sorted(texts, key=len)
    batches = [ordered[k : k + batch_size] for k in range(0, len(ordered), batch_size)]
    modes = {"classify": None, "classify_explain": "predicted", "explain_full": "full"}
    totals = dict.fromkeys(modes, 0.0)
    names = list(modes)
    for mode in modes.values():  # warm-up: first passes pay for allocations
        engine.run([Task(t, explain=mode) for t in batches[0]])
    for r in range(rounds):
        for name in names[r % 3 :] + names[: r % 3]:  # rotate the order so that none always goes first
            mode = modes[name]
            totals[name] += _timed(lambda m=mode: [engine.run([Task(t, explain=m) for t in b]) for b in batches], 1)
    per_text = {k: v / rounds / len(texts) for k, v in totals.items()}
    return {"batch_size": batch_size, "ms_per_text": {k: 1000 * v for k, v in per_text.items()},
            "explain_over_classify": per_text["classify_explain"] / per_text["classify"],
            "full_over_classify": per_text["explain_full"] / per_text["classify"]}


class LayerIG:
    """Captum's Layer Integrated Gradients on the backbone's embedding layer, through backbone + head."""

    def __init__(self, engine: Engine, n_steps: int = 50) -> None:
        from captum.attr import LayerIntegratedGradients

        self.engine, self.n_steps = engine, n_steps
        self.clf = engine.classifier
        self.tok = self.clf.backbone.tokenizer
        self.lig = LayerIntegratedGradients(self._prob, self.clf.backbone.encoder.embeddings)

    def _prob(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, target: int) -> torch.Tensor:
        out = self.clf.backbone.encoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        hidden = torch.stack(out.hidden_states, dim=-2).float()  # [b n e d]
        return self.clf.head(hidden, attention_mask == 0).scores.softmax(-1)[:, target]  # [b]

    def explain(self, text: str, target: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token attributions ``[n]``, offsets ``[n, 2]`` and special-token flags ``[n]`` for one text."""
        enc = self.tok(text, return_offsets_mapping=True, return_special_tokens_mask=True, truncation=True,
                       max_length=self.clf.backbone.max_length, return_tensors="pt")
        ids, att = enc["input_ids"], enc["attention_mask"]
        special = enc["special_tokens_mask"][0].bool()
        baseline = ids.clone()
        baseline[0, ~special] = self.tok.pad_token_id
        with torch.enable_grad():
            attr = self.lig.attribute(ids, baselines=baseline, additional_forward_args=(att, target),
                                      n_steps=self.n_steps, internal_batch_size=self.n_steps)
        return attr.sum(-1)[0].detach(), enc["offset_mapping"][0], special


def delete_tokens(text: str, offsets: torch.Tensor, positions: list[int]) -> str:
    """``text`` without the characters of the tokens at ``positions``."""
    spans = sorted((int(offsets[p, 0]), int(offsets[p, 1])) for p in positions)
    out, last = [], 0
    for s, e in spans:
        out.append(text[last:s])
        last = max(last, e)
    out.append(text[last:])
    return "".join(out)


def rankings(scores: list[float]) -> tuple[list[int], list[int]]:
    """Positions by score (highest first) and by magnitude (largest first)."""
    positions = range(len(scores))
    return sorted(positions, key=lambda k: -scores[k]), sorted(positions, key=lambda k: -abs(scores[k]))


def comprehensiveness(engine: Engine, texts: list[str], lig: LayerIG | None, seed: int = 0) -> dict[str, Any]:
    """Mean drop of the predicted class's probability after deleting the top-k% credited tokens,
    for routing credit, Layer IG (when given) and random tokens; with seconds per explanation.
    Tokens are ranked by signed credit (highest first) and, in the ``*_abs`` rows, by magnitude."""
    rng = random.Random(seed)
    methods = ["routing", "routing_abs", "random"] + (["layer_ig", "layer_ig_abs"] if lig else [])
    drops = {m: {f: [] for f in FRACTIONS} for m in methods}
    seconds = {"routing": 0.0, "layer_ig": 0.0}
    labels = engine.labels
    for n, text in enumerate(texts, 1):
        t0 = time.perf_counter()
        res = engine.run([Task(text, explain="predicted")])[0]
        seconds["routing"] += time.perf_counter() - t0
        target = labels.index(res.label)
        p0 = res.scores[res.label]
        toks = res.explanation["tokens"] if res.explanation else []
        offsets = torch.tensor([[t["start"], t["end"]] for t in toks]).reshape(-1, 2)
        ranked = {"random": rng.sample(range(len(toks)), len(toks))}
        ranked["routing"], ranked["routing_abs"] = rankings([t["credit"] for t in toks])
        lig_offsets = offsets
        if lig is not None:
            t0 = time.perf_counter()
            attr, lig_off, special = lig.explain(text, target)
            seconds["layer_ig"] += time.perf_counter() - t0
            keep = (~special).nonzero().flatten().tolist()
            lig_offsets = lig_off[keep]
            ranked["layer_ig"], ranked["layer_ig_abs"] = rankings(attr[keep].tolist())
        edits: list[tuple[str, float, str]] = []
        for method, order in ranked.items():
            offs = lig_offsets if method.startswith("layer_ig") else offsets
            for f in FRACTIONS:
                m = max(1, round(f * len(order)))
                edits.append((method, f, delete_tokens(text, offs, order[:m])))
        edited = [e[2] if e[2].strip() else "." for e in edits]
        after = engine.run([Task(t) for t in edited])
        for (method, f, _), r in zip(edits, after, strict=True):
            drops[method][f].append(p0 - r.scores[res.label])
        if n % 10 == 0 or n == len(texts):
            echo(f"  faithfulness: {n}/{len(texts)} texts", err=True)
    mean = {m: {f: sum(v) / len(v) for f, v in by_f.items()} for m, by_f in drops.items()}
    per_expl = {k: v / len(texts) for k, v in seconds.items() if k in methods}
    return {"mean_drop": mean, "seconds_per_explanation": per_expl, "n_texts": len(texts)}


def run(model: str, preset: str, repository: Path, n_texts: int, n_faithful: int, batch_size: int, rounds: int,
        n_steps: int, device: str, out: Path, seed: int = 0) -> dict[str, Any]:
    from service.bench.serve import test_texts

    texts = test_texts(preset, n_texts, seed)
    engine = Engine.load(repository / model, device=device)
    echo(f"bench explain: model {model}, {len(texts)} test texts; cost of credit at batch sizes 1 and "
         f"{batch_size}", err=True)
    costs = [cost_of_credit(engine, texts[: max(16, len(texts) // 8)], 1, rounds),
             cost_of_credit(engine, texts, batch_size, rounds)]
    try:
        lig: LayerIG | None = LayerIG(engine, n_steps)
    except ImportError:
        lig = None
        echo("  captum is not installed (pip install -e '.[bench]'): Layer IG comparison skipped", err=True)
    echo(f"faithfulness and per-explanation time on {n_faithful} texts (Layer IG: {n_steps} steps)", err=True)
    faith = comprehensiveness(engine, texts[:n_faithful], lig, seed)

    rows = [{"batch_size": c["batch_size"], **{f"{k}_ms": v for k, v in c["ms_per_text"].items()},
             "explain/classify": c["explain_over_classify"], "full/classify": c["full_over_classify"]}
            for c in costs]
    print("Cost of credit (ms per text, engine only, same texts, interleaved rounds):")
    print(report.table(rows, list(rows[0])))
    spe = faith["seconds_per_explanation"]
    print("\nSeconds per explanation (one text at a time):")
    print(report.table([{"method": k, "seconds": v} for k, v in spe.items()], ["method", "seconds"]))
    if "layer_ig" in spe:
        print(f"Layer IG / routing credit per explanation: {spe['layer_ig'] / spe['routing']:.1f}x")
    print("\nComprehensiveness: mean drop in the predicted class's probability after deleting the top-k% tokens")
    frows = [{"method": m, **{f"top {round(100 * f)}%": v for f, v in by_f.items()}}
             for m, by_f in faith["mean_drop"].items()]
    print(report.table(frows, list(frows[0])))
    summary: dict[str, Any] = {"explain_over_classify": {c["batch_size"]: c["explain_over_classify"] for c in costs},
                               "full_over_classify": {c["batch_size"]: c["full_over_classify"] for c in costs}}
    if "layer_ig" in spe:
        summary["layer_ig_over_routing_per_explanation"] = spe["layer_ig"] / spe["routing"]
    summary["mean_drop"] = faith["mean_drop"]
    settings = {"model": model, "texts": len(texts), "faithfulness_texts": n_faithful, "batch_size": batch_size,
                "rounds": rounds, "ig_steps": n_steps, "device": device, "fractions": FRACTIONS}
    path = report.write_json(out, "explain", settings, {"cost": costs, "faithfulness": faith}, summary)
    print(f"wrote {path}")
    return summary
