"""Scores read into results (numpy alone): the common call (one head, every score finite) and every other."""

import math
from pathlib import Path

import numpy as np

from service.modeling.manifest import read_manifest
from service.serving.engine.scores import read_scores, scored, unloaded

SENTIMENT = read_manifest(Path(__file__).parents[2] / "models" / "tweet-sentiment")


def softmax(row: list[float]) -> list[float]:
    e = [math.exp(x - max(row)) for x in row]
    return [x / sum(e) for x in e]


def test_one_head_reads_each_row_as_scored_does() -> None:
    logits = np.random.default_rng(0).standard_normal((5, len(SENTIMENT.labels))).astype(np.float32)  # [b k]
    got = read_scores(logits, ["s@1"] * 5, {"s@1": SENTIMENT})
    for row, result in zip(logits.tolist(), got, strict=True):
        probs = softmax(row)
        assert result == scored(SENTIMENT, row, list(result.scores.values()), True, int(np.argmax(row)))
        assert result.label == SENTIMENT.labels[int(np.argmax(row))] and result.logits == row
        assert np.allclose(list(result.scores.values()), probs, atol=1e-6)


def test_a_row_not_finite_an_unloaded_head_and_a_multi_label_head_each_as_their_own() -> None:
    multi = SENTIMENT.model_copy(update={"problem_type": "multi_label_classification",
                                         "thresholds": [0.5] * len(SENTIMENT.labels)})
    logits = np.array([[1.0, 2.0, 0.5], [np.nan, 0.0, 1.0], [0.0, 3.0, -1.0], [-2.0, 2.0, 0.0]],
                      dtype=np.float32)  # [b k]
    got = read_scores(logits, ["s@1", "s@1", "gone@1", "m@1"], {"s@1": SENTIMENT, "m@1": multi})
    assert got[0].label == SENTIMENT.labels[1] and not got[0].error
    assert got[1].error and "non-finite" in got[1].error and got[1].scores == {}
    assert got[2] == unloaded("gone@1")
    sigmoid = [1 / (1 + math.exp(-x)) for x in [-2.0, 2.0, 0.0]]
    assert np.allclose(list(got[3].scores.values()), sigmoid) and got[3].labels == [SENTIMENT.labels[1],
                                                                                     SENTIMENT.labels[2]]
