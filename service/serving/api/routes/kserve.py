"""KServe V1 protocol: ``POST /v1/models/{model}:predict`` and ``:explain``, translated into this
service's own classify and explain requests (same batcher, limits, auth, metrics and answers). The options may come
in ``parameters`` too, as Vertex AI's clients send a custom container's requests (``{"instances", "parameters"}``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, model_validator
from pydantic_core import PydanticCustomError

from service.serving.api.errors import not_allowed
from service.serving.api.responses import JSONBody
from service.serving.api.routes import inference
from service.serving.api.routes.deps import State, require_json, require_key
from service.serving.api.schemas import (
    ClassifyRequest,
    ClassifyResult,
    CreditOptions,
    ExplainRequest,
    ExplainResult,
    Labels,
    NonBlank,
    ScoreOptions,
    json_kind,
)
from service.serving.core.errors import APIError

router = APIRouter(prefix="/v1", tags=["kserve v1"], dependencies=[Depends(require_key), Depends(require_json)],
                   responses=inference.ERRORS)
verbs = APIRouter(prefix="/v1", dependencies=[Depends(require_key)], include_in_schema=False)  # after ``router``
VERBS = ("predict", "explain")


class TextInstance(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: NonBlank


Instance = Annotated[NonBlank | TextInstance, Field(description='A text, or {"text": "..."}')]


def _parameters(data: Any) -> Any:
    """The body with the options of ``parameters`` (where Vertex AI's clients put them) among its own: the same
    options, in either place; one given in both is refused."""
    if not isinstance(data, dict) or "parameters" not in data:
        return data
    given = data["parameters"]
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise PydanticCustomError("parameters", "parameters must be an object of options; got {got}",
                                  {"got": json_kind(given)})
    twice = sorted(set(given) & set(data))  # "parameters" itself among them: options are not nested twice
    if twice:
        raise PydanticCustomError("parameters", "{twice} given both in the body and in parameters: send each once",
                                  {"twice": twice})
    return {**{k: v for k, v in data.items() if k != "parameters"}, **given}


class PredictRequest(ScoreOptions):
    model_config = ConfigDict(extra="forbid")
    instances: list[Instance] = Field(min_length=1, examples=[["I love this!", {"text": "That was terrible."}]])
    timeout_s: StrictFloat | None = Field(None, ge=0.1, le=3600, description="Deadline in seconds (capped)")
    parameters: dict[str, Any] | None = Field(None, description="The options, as Vertex AI's clients send them (in "
                                              "place of the body's own fields)")

    _from_parameters = model_validator(mode="before")(_parameters)

    def texts(self) -> list[str]:
        return [i if isinstance(i, str) else i.text for i in self.instances]


class ExplainInstancesRequest(CreditOptions, PredictRequest):
    target: Labels = Field(
        None, description='Label(s) to explain: a label, a list of labels, or "all" (default: the predicted one)')


class Prediction(BaseModel):
    label: str
    score: float
    scores: dict[str, float]
    labels: list[str] | None = ClassifyResult.model_fields["labels"]


class PredictResponse(BaseModel):
    predictions: list[Prediction]


class ExplainInstancesResponse(BaseModel):
    explanations: list[ExplainResult]


@router.post("/models/{model}:predict", response_model=PredictResponse, summary="KServe V1 predict")
async def predict(request: Request, state: State, model: str, body: PredictRequest) -> JSONBody:
    """The same as `/v1/models/{model}/classify` (without credit), in KServe V1's envelope."""
    req = ClassifyRequest(inputs=body.texts(), timeout_s=body.timeout_s, raw_scores=body.raw_scores,
                          truncate=body.truncate, truncation_direction=body.truncation_direction)
    (res,) = await inference.classify(request, state, [model], req)
    return JSONBody({"predictions": [{k: v for k, v in r.items() if k != "explanation"} for r in res["results"]]})


@router.post("/models/{model}:explain", response_model=ExplainInstancesResponse, summary="KServe V1 explain")
async def explain(request: Request, state: State, model: str, body: ExplainInstancesRequest) -> JSONBody:
    """The same as `/v1/models/{model}/explain`, in KServe V1's envelope."""
    req = ExplainRequest(inputs=body.texts(), timeout_s=body.timeout_s, target=body.target, method=body.method,
                         contrast=body.contrast, raw_scores=body.raw_scores, truncate=body.truncate,
                         truncation_direction=body.truncation_direction)
    (res,) = await inference.explain(request, state, [model], req)
    return JSONBody({"explanations": res["results"]})


@verbs.api_route("/models/{model}:{verb}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def other_verb(request: Request, model: str, verb: str) -> None:
    """What no route above takes on a verb's path (no model name has a colon): another verb than KServe V1's is
    404, and one of them with another method than POST 405 (else GET /v1/models/{model} would take the path for a
    model's name, and POST on it would be told to use GET)."""
    if verb in VERBS:
        raise APIError(405, not_allowed(request, "POST"), headers={"Allow": "POST"})
    raise APIError(404, f"no KServe V1 verb ':{verb}'; POST /v1/models/{model}:predict or /v1/models/{model}:explain")
