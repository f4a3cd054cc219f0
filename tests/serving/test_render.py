"""The response bodies the routes build as plain values (render) have exactly the shape of the response models
that document them in /openapi.json, and msgspec writes the same JSON values as the framework's own encoding."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from pydantic import BaseModel

from service.serving.api.responses import JSONBody
from service.serving.api.schemas import ClassifyResponse, ExplainResponse, ExplainResult, PredictedExplanation
from service.serving.core.results import Credit, LabelCredit, Result, TokenSpan
from service.serving.pipeline import render

TEXT = "Good day. Bad night"
TOKENS = [TokenSpan("[CLS]", 0, 0, True), TokenSpan("good", 0, 4, False), TokenSpan("day", 5, 8, False),
          TokenSpan(".", 8, 9, False), TokenSpan("bad", 10, 13, False), TokenSpan("night", 14, 19, False),
          TokenSpan("[SEP]", 0, 0, True)]
WORD_IDS = [-1, 0, 1, 2, 3, 4, -1]
LABELS = ["negative", "positive"]


def target(label: str, k: int, shares: bool = False) -> LabelCredit:
    tokens = [0.5 * k - 0.125 * p + 1e-7 for p in range(len(TOKENS))]  # a tiny part: an exponent in the JSON
    depth = [[c / 3] * 3 for c in tokens]
    return LabelCredit(label, tokens, depth, None if shares else 2.5e-05 + k, None if shares else -0.25)


def result(method: str = "contribution", targets: tuple[int, ...] = (1,), matrix: bool = False,
           phi: bool = False) -> Result:
    credit = Credit(method, method != "shares", [target(LABELS[k], k, method == "shares") for k in targets])  # type: ignore[arg-type]
    if matrix:
        credit.matrix = [[[0.1 * p, -0.1 * p]] * 3 for p in range(len(TOKENS))]
    if phi:
        credit.phi = [[[0.25] * 4] * 21, [[0.5] * 4] * 4, [[0.75] * 2] * 4]
    return Result("positive", {"negative": 0.3, "positive": 0.7}, [-0.25, 0.6], credit=credit)


def exact(model: type[BaseModel], body: Any) -> None:
    """``body`` is what ``model`` dumps after validating it (the same keys in the same order at every level, the same
    values: the same text from the standard library's encoder), and msgspec's bytes decode to those values."""
    dumped = model.model_validate(body).model_dump(mode="json")
    assert json.dumps(body) == json.dumps(dumped)
    assert json.loads(JSONBody(body).body) == dumped
    assert msgspec.json.decode(JSONBody(body).body) == json.loads(json.dumps(dumped))


@pytest.mark.parametrize("method", ["contribution", "end_to_end", "shares"])
def test_classify_bodies_are_the_response_models_dumps(method: str) -> None:
    plain = render.classify_result(Result("negative", {"negative": 0.6, "positive": 0.4}, [0.2, -0.2]))
    explained = render.classify_result(result(method), TOKENS)
    exact(ClassifyResponse, {"model": "m", "results": [plain, explained]})
    view = PredictedExplanation.model_validate(explained["explanation"])
    assert [t.token for t in view.tokens] == ["good", "day", ".", "bad", "night"]  # special tokens summed apart
    assert view.special == pytest.approx(result(method).credit.targets[0].tokens[0]  # type: ignore[union-attr]
                                         + result(method).credit.targets[0].tokens[-1])  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="needs its tokens"):
        render.classify_result(result(method))


@pytest.mark.parametrize(("targets", "matrix", "phi"), [((1,), False, False), ((0, 1), True, True)])
def test_explain_bodies_are_the_response_models_dumps(targets: tuple[int, ...], matrix: bool, phi: bool) -> None:
    body = render.explain_result(result("contribution", targets, matrix, phi), TEXT, TOKENS, WORD_IDS)
    exact(ExplainResponse, {"model": "m", "labels": LABELS, "results": [body]})
    view = ExplainResult.model_validate(body)
    assert view.targets == [LABELS[k] for k in targets]
    assert [s.text for s in view.credit["positive"].sentences] == ["Good day.", "Bad night"]
    assert (view.matrix is not None) == matrix and (view.phi is not None) == phi


def test_json_body_writes_the_same_numbers_and_text() -> None:
    body = {"s": "é — \u2028 \"q\"", "x": [1e-7, 2.5e-05, 0.1 + 0.2, 1e22, -0.0, 5e-324], "n": None, "k": 3}
    got = JSONBody(body)
    assert got.media_type == "application/json"
    assert json.loads(got.body) == body
    assert [repr(v) for v in json.loads(got.body)["x"]] == [repr(v) for v in body["x"]]  # every float round-trips
