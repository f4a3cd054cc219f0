"""The faithfulness measurements of `bench explain` on the tiny model: edits delete the right
characters, rankings order as documented, and the metrics agree with direct computation."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.bench.explain import delete_tokens, explained_tokens, faithfulness, ranking, spearman
from service.serving.core.work import CreditSpec, Task
from service.serving.engine.engine import Engine

TEXTS = ["the first text is here", "a second, somewhat longer text. It has two sentences!",
         "short but sweet words"]


@pytest.fixture(scope="module")
def engine(tiny_repo: Path) -> Engine:
    return Engine.load(tiny_repo / "tiny")


def test_edits_and_rankings() -> None:
    text = "The cat sat."
    spans = [(0, 3), (4, 7), (8, 11), (11, 12)]
    assert delete_tokens(text, spans, [1]) == "The  sat."
    assert delete_tokens(text, spans, [3, 0]) == " cat sat"
    assert delete_tokens(text, spans, []) == text
    assert ranking([0.1, -0.5, 0.3]) == [2, 0, 1] and ranking([0.1, -0.5, 0.3], by_magnitude=True) == [1, 2, 0]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 1, 1], [1, 2, 3]) is None


def test_metrics_agree_with_direct_computation(engine: Engine) -> None:
    out = faithfulness(engine, TEXTS, lig=None, batch_size=4, max_occlusion=64)
    methods = out["methods"]
    assert set(methods) == {"contrast", "contribution", "end_to_end", "shares", "shares_abs", "occlusion", "random"}
    assert methods["occlusion"]["spearman_occlusion"] is None
    # occlusion's top token is the one whose deletion drops p most: comprehensiveness at one token
    drops = []
    for text in TEXTS:
        res = engine.run([Task(text, credit=CreditSpec())])[0]
        spans = [(t.start, t.end) for t in explained_tokens(engine, text, res)]
        edited = engine.run([Task(delete_tokens(text, spans, [m])) for m in range(len(spans))])
        drops.append(max(res.scores[res.label] - r.scores[res.label] for r in edited))
    assert methods["occlusion"]["comprehensiveness"][0.01] == pytest.approx(sum(drops) / len(drops), abs=1e-6)
    for m in methods.values():
        assert 0.0 <= m["deletion_auc"] <= 1.0
        assert all(-1.0 <= v <= 1.0 for v in m["sufficiency"].values())


def test_the_ablations_held_variant_is_the_services_split_and_each_freed_kind_changes_it(engine: Engine) -> None:
    """``bench explain --ablation``: with every kind held, autograd's gradient x input is the service's end-to-end
    credit (its faithfulness too); letting any one kind vary gives other credit."""
    from service.bench import ablation

    spec = CreditSpec(method="end_to_end")
    exact = [engine.run([Task(t, credit=spec)])[0].credit.targets[0].tokens for t in TEXTS]  # type: ignore[union-attr]
    for name, held in ablation.VARIANTS.items():
        with ablation.splitting_with(ablation.gradient_split(held)):
            got = [engine.run([Task(t, credit=spec)])[0].credit.targets[0].tokens for t in TEXTS]  # type: ignore[union-attr]
        for a, b in zip(got, exact, strict=True):
            if name == "held":
                assert a == pytest.approx(b, abs=1e-5)
            else:
                assert max(abs(x - y) for x, y in zip(a, b, strict=True)) > 1e-6, name  # (tiny weights: small)
    out = ablation.run(engine, TEXTS, batch_size=4, max_occlusion=64)["methods"]
    assert set(out) == {"contrast", *ablation.VARIANTS, "occlusion"}
    reference = faithfulness(engine, TEXTS, lig=None, batch_size=4, max_occlusion=64)["methods"]
    for key in ("comprehensiveness_mean", "sufficiency_mean", "deletion_auc"):
        assert out["held"][key] == pytest.approx(reference["end_to_end"][key], abs=1e-6)
        assert out["occlusion"][key] == pytest.approx(reference["occlusion"][key], abs=1e-6)
