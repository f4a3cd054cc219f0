"""Texts that ask for no credit run their head packed, back to back, one call per head whatever their lengths; the
answers are those of the padded head (and of each text alone); credit still reads the padded head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.serving.core.results import Result
from service.serving.core.work import CreditSpec, Task
from service.serving.engine.engine import Engine
from tests.conftest import write_tiny_model

TEXTS = ["a", "a short text", "another one, a little longer than that!", "mid length here", "x y",
         " ".join(f"w{k}" for k in range(40))]  # the last one: several of the tiny model's 16-token chunks


@pytest.fixture(scope="module")
def engine(tiny_repo: Path, tiny_backbone_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    repo = tmp_path_factory.mktemp("two-heads")
    write_tiny_model(repo, tiny_backbone_dir, "tiny")
    write_tiny_model(repo, tiny_backbone_dir, "other", seed=1)
    return Engine.load([repo / "tiny", repo / "other"], device="cpu")


def tasks() -> list[Task]:
    """Every text on both heads, some with credit."""
    return [Task(t, model=m, credit=CreditSpec() if (k + j) % 3 == 0 else None)
            for k, t in enumerate(TEXTS) for j, m in enumerate(("tiny", "other"))]


def close(a: list[Result], b: list[Result]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.label == y.label and not x.error and not y.error
        assert max(abs(x.scores[k] - y.scores[k]) for k in x.scores) <= 1e-5
        assert (x.credit is None) == (y.credit is None)
        if x.credit is not None and y.credit is not None:
            tokens = [torch.tensor(r.credit.targets[0].tokens) for r in (x, y)]  # type: ignore[union-attr]
            torch.testing.assert_close(*tokens, atol=1e-5, rtol=0)


def test_the_heads_run_packed_here(engine: Engine) -> None:
    assert engine._packs("tiny") and engine._packs("other")


def test_texts_without_credit_are_one_packed_call_per_head_whatever_their_lengths(engine: Engine) -> None:
    plain = [Task(t, model=m) for t in TEXTS[:5] for m in ("tiny", "other")]
    jobs = [w.job for w in engine._chunks(plain)]
    assert len({job.encoding.n_tokens for job in jobs}) == 4  # four lengths
    plan = engine._plan_calls(dict(enumerate(jobs)))
    assert [c.packed for c in plan] == [True, True]
    assert [len(c.chosen) for c in plan] == [5, 5]
    credit = engine._plan_calls(dict(enumerate(w.job for w in engine._chunks(
        [Task(t, credit=CreditSpec()) for t in TEXTS[:5]]))))
    assert credit and not any(c.packed for c in credit)  # credit reads padded tensors: length groups
    (alone,) = engine._plan_calls(dict(enumerate(w.job for w in engine._chunks(plain[:1]))))
    assert not alone.packed  # one text has no padding to save


def test_packed_answers_equal_the_padded_heads_and_each_text_alone(engine: Engine) -> None:
    batch = tasks()
    packed = engine.run(batch)
    engine.packed_heads = False
    try:
        padded = engine.run(batch)
        alone = [engine.run([t])[0] for t in batch]
    finally:
        engine.packed_heads = True
    close(packed, padded)
    close(packed, alone)
    close(packed, [engine.run([t])[0] for t in batch])  # and alone, packed


def test_a_long_text_over_several_batches_among_short_ones_gets_its_answer_alone(engine: Engine) -> None:
    """Packed among other texts in the batch of its last chunk, its earlier chunks' states gathered from where
    they were kept."""
    long, short = Task(TEXTS[-1]), [Task(t) for t in TEXTS[:4]]
    alone = engine.run([long])[0]
    (plan,) = engine.plan([long])
    others = [w for p in engine.plan(short) for w in p]
    assert len(plan) >= 3
    answers = engine.run_chunks(plan[:1] + others[:2])  # two short texts done here, the long one not yet
    last = engine.run_chunks(others[2:] + plan[1:])
    calls = engine._plan_calls({0: plan[-1].job, 1: others[2].job, 2: others[3].job})
    assert [c.packed for c in calls] == [True]  # how the last batch's head ran
    assert answers[0] is None and last[-1] is not None
    close([last[-1][0]], [alone])
    close([a[0] for a in (*answers[1:], *last[:2])], engine.run(short))


def test_the_positions_budget_splits_packed_calls(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    batch = [Task(t) for t in TEXTS[:5]]
    whole = engine.run(batch)
    monkeypatch.setattr(engine, "head_batch_positions", 8)
    plan = engine._plan_calls(dict(enumerate(w.job for w in engine._chunks(batch))))
    assert len(plan) > 1 and all(c.packed for c in plan)
    assert sum(len(c.chosen) for c in plan) == 5
    close(engine.run(batch), whole)


def test_a_head_the_grouped_product_cannot_run_goes_padded(tiny_repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_grouped_product(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("grouped_mm: not on this device")

    monkeypatch.setattr(torch.nn.functional, "grouped_mm", no_grouped_product)
    fresh = Engine.load(tiny_repo / "tiny", device="cpu")
    assert not fresh._packs("tiny")
    batch = [Task(t) for t in TEXTS]
    plan = fresh._plan_calls(dict(enumerate(w.job for w in fresh._chunks(batch[:5]))))
    assert plan and not any(c.packed for c in plan)
    answers = fresh.run(batch)
    monkeypatch.undo()
    close(answers, Engine.load(tiny_repo / "tiny", device="cpu").run(batch))
