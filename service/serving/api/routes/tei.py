"""Text-embeddings-inference's classification API (TEI's router, v1.9) and Hugging Face's ``POST /``, over the same
pipeline and batcher as ``/v1``: a TEI or ``huggingface_hub.InferenceClient`` user points the client here.

- ``POST /predict`` (and ``/models/{model}/predict``, and ``/invocations``: SageMaker's route, where TEI serves a
  classifier's ``/predict`` too): ``inputs`` one text, or a batch of one-text lists; every
  label's score, highest first (a list of those for a batch); ``raw_scores``, ``truncate``,
  ``truncation_direction``. A pair (``["q", "doc"]``) is a 422: these heads classify one text.
- ``GET /info``: the model as TEI describes it.
- ``POST /`` (and ``POST /models/{model}``): Hugging Face's text-classification task, ``{"inputs", "parameters":
  {"top_k", "function_to_apply"}}``, answered a list of labels per text, always nested (TEI answers one text with a
  flat list, of which ``InferenceClient.text_classification`` keeps the first label only).

The model is the default one, the one the ``X-Model`` header names, or the one in the path. Errors are TEI's:
``{"error", "error_type"}`` (see :mod:`service.serving.api.errors`).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool
from pydantic_core import PydanticCustomError

from service import __version__
from service.modeling.encoding import Truncation
from service.serving.api.responses import JSONBody
from service.serving.api.routes.deps import State, client_gone, require_json, require_key
from service.serving.api.schemas import NonBlank, json_kind
from service.serving.core.results import Result
from service.serving.pipeline.render import scores
from service.serving.state import AppState

MODEL_HEADER = "x-model"
"""The request header that names the model (absent: the default one)."""


class TEIError(BaseModel):
    error: str
    error_type: Literal["Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty"]


ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": TEIError} for s in (400, 401, 404, 413, 415, 422, 424, 429,
                                                                             503)}
router = APIRouter(tags=["text-embeddings-inference"], dependencies=[Depends(require_key), Depends(require_json)],
                   responses=ERRORS)
info = APIRouter(tags=["text-embeddings-inference"], dependencies=[Depends(require_key)], responses=ERRORS)

PAIR = ("{}a pair of texts, for a model trained on pairs (a reranker); this model classifies one text: send "
        '[["first"], ["second"]] to classify two')


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise PydanticCustomError("tei_inputs", "{where} must be a text; got {got}",
                                  {"where": where, "got": json_kind(value)})
    if not value.strip():
        raise PydanticCustomError("tei_inputs", "{where} is empty", {"where": where})
    if not value.isascii():
        try:  # the other routes' text type refuses this in its own validation; this one takes any str
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PydanticCustomError("tei_inputs", "{where} holds half of a surrogate pair ({half}) at character "
                                      "{at}: no text, and nothing a tokenizer reads",
                                      {"where": where, "half": ascii(e.object[e.start]), "at": e.start}) from None
    return value


def _inputs(value: Any) -> list[str] | str:
    """TEI's ``inputs``: a text, or a batch of one-text lists (a lone text in a list is one text too); a pair of
    texts, alone or in a batch, is refused with why."""
    if isinstance(value, str):
        return _text(value, "inputs")
    if not isinstance(value, list) or not value:
        raise PydanticCustomError("tei_inputs", "inputs must be a text or a list of one-text lists; got {got}",
                                  {"got": json_kind(value) if value != [] else "an empty list"})
    if all(isinstance(v, str) for v in value):
        if len(value) == 2:
            raise PydanticCustomError("tei_pair", PAIR.format(""))
        if len(value) > 2:
            raise PydanticCustomError("tei_inputs", 'inputs: a batch is a list of one-text lists, [["first"], '
                                                    '["second"], ...], not a list of texts')
        return [_text(value[0], "inputs.0")]
    for k, item in enumerate(value):
        if isinstance(item, list) and len(item) == 2:
            raise PydanticCustomError("tei_pair", PAIR.format(f"item {k} is "))
        if not isinstance(item, list) or len(item) != 1:
            raise PydanticCustomError("tei_inputs", "inputs.{k} must be a list of one text; got {got}",
                                      {"k": k, "got": json_kind(item) if item != [] else "an empty list"})
        _text(item[0], f"inputs.{k}.0")
    return value


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: Annotated[str | list[str] | list[list[str]], BeforeValidator(_inputs)] = Field(
        description='One text, or a batch of one-text lists ([["first"], ["second"]]); a pair (["q", "doc"]) is '
                    "refused: these models classify one text", examples=["I love this!"])
    raw_scores: StrictBool = Field(False, description="The head's logits instead of probabilities")
    truncate: StrictBool | None = Field(False, description="Cut a text longer than the model's chunk length to one "
                                        "chunk; without it a long text is read whole, in chunks")
    truncation_direction: Literal["Right", "Left", "right", "left"] = Field(
        "Right", description="Right keeps the beginning, Left the end (TEI's names; its documentation's lower-case "
        "spelling is taken too)")

    def texts(self) -> tuple[list[str], bool]:
        """The texts, and whether they came as a batch."""
        if isinstance(self.inputs, str):
            return [self.inputs], False
        if isinstance(self.inputs[0], list):
            return [item[0] for item in self.inputs], True  # type: ignore[index]
        return [self.inputs[0]], False  # type: ignore[list-item]

    def truncation(self) -> Truncation | None:
        return Truncation("left" if self.truncation_direction.lower() == "left" else "right") if self.truncate else None


class Prediction(BaseModel):
    score: float
    label: str


PREDICTIONS = list[Prediction] | list[list[Prediction]]
"""What /predict answers: every label of one text, or of each text of a batch."""


class ClassifierModel(BaseModel):
    id2label: dict[str, str]
    label2id: dict[str, int]


class ModelType(BaseModel):
    classifier: ClassifierModel


class Info(BaseModel):
    model_id: str
    model_sha: str | None
    model_dtype: str
    model_type: ModelType
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int | None
    max_client_batch_size: int
    auto_truncate: bool
    tokenization_workers: int
    version: str
    sha: str | None = None
    docker_label: str | None = None


Activation = Literal["sigmoid", "softmax", "none"]


class HFParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")
    top_k: int | None = Field(None, ge=1, description="The most labels to answer per text (default: every label)")
    function_to_apply: Activation | None = Field(
        None, description="softmax over the logits, sigmoid of each, or none (the logits); default: the model's own")


class HFRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: NonBlank | list[NonBlank] = Field(description="A text, or a list of texts", examples=["I love this!"])
    parameters: HFParameters | None = None


def model_of(request: Request, state: AppState, model: str | None = None) -> str:
    """The model a TEI or Hugging Face request asks: in the path, the ``X-Model`` header, or the default."""
    return model or request.headers.get(MODEL_HEADER) or state.default()


def ranked(values: dict[str, float], top_k: int | None = None) -> list[dict[str, Any]]:
    """Every label with its value, highest first (the first ``top_k``)."""
    ordered = sorted(values.items(), key=lambda kv: kv[1], reverse=True)[:top_k]
    return [{"score": v, "label": label} for label, v in ordered]


def applied(res: Result, function: Activation | None) -> dict[str, float]:
    """The scores ``function_to_apply`` asks for (None: the model's own probabilities)."""
    if function is None:
        return res.scores
    logits = scores(res, raw=True)
    if function == "none":
        return logits
    if function == "sigmoid":
        return {k: 1 / (1 + math.exp(-v)) for k, v in logits.items()}
    top = max(logits.values())
    exp = {k: math.exp(v - top) for k, v in logits.items()}
    total = sum(exp.values())
    return {k: e / total for k, e in exp.items()}


async def _predict(request: Request, state: AppState, model: str, body: PredictRequest) -> JSONBody:
    texts, batch = body.texts()
    scored = await state.inference.score(model, texts, None, client_gone(request), body.truncation())
    out = [ranked(scores(s.result, body.raw_scores)) for s in scored]
    return JSONBody(out if batch else out[0])


@router.post("/predict", response_model=PREDICTIONS, summary="TEI predict")
async def predict(request: Request, state: State, body: PredictRequest) -> JSONBody:
    """Text-embeddings-inference's `/predict` on the default model (or the one the `X-Model` header names): every
    label's score, highest first; a list of those for a batch."""
    return await _predict(request, state, model_of(request, state), body)


# SageMaker's route for a container's requests, where TEI serves a classifier's /predict too
router.add_api_route("/invocations", predict, methods=["POST"], response_model=PREDICTIONS,
                     summary="TEI predict, at SageMaker's route")


@router.post("/models/{model}/predict", response_model=PREDICTIONS,
             summary="TEI predict, one model")
async def predict_model(request: Request, state: State, model: str, body: PredictRequest) -> JSONBody:
    """`/predict` on the model named in the path."""
    return await _predict(request, state, model, body)


@info.get("/info", response_model=Info, summary="TEI info")
async def describe(request: Request, state: State) -> JSONBody:
    """The model `/predict` answers with (the default, or the `X-Model` header's), as TEI describes a model."""
    model = model_of(request, state)
    await state.inference.require([model])
    d = state.inference.describe(model)
    labels: list[str] = d["labels"]  # type: ignore[assignment]
    s = state.settings
    batch_size, batch_tokens = s.batch_limits(str(d["device"]))
    backbone: dict[str, Any] = d["backbone"]  # type: ignore[assignment]
    return JSONBody({
        "model_id": model, "model_sha": backbone.get("revision"), "model_dtype": d["dtype"],
        "model_type": {"classifier": {"id2label": {str(k): v for k, v in enumerate(labels)},
                                      "label2id": {v: k for k, v in enumerate(labels)}}},
        "max_concurrent_requests": s.max_queue, "max_input_length": d["max_length"],
        "max_batch_tokens": batch_tokens, "max_batch_requests": batch_size, "max_client_batch_size": s.max_inputs,
        "auto_truncate": False, "tokenization_workers": 1, "version": __version__, "sha": None, "docker_label": None,
    })


async def _task(request: Request, state: AppState, model: str, body: HFRequest) -> JSONBody:
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    params = body.parameters or HFParameters()
    scored = await state.inference.score(model, texts, None, client_gone(request))
    return JSONBody([ranked(applied(s.result, params.function_to_apply), params.top_k) for s in scored])


@router.post("/", response_model=list[list[Prediction]], summary="Hugging Face text classification")
async def hf_task(request: Request, state: State, body: HFRequest) -> JSONBody:
    """Hugging Face's text-classification task, as `huggingface_hub.InferenceClient(base_url).text_classification`
    sends it: each text's labels, highest first (`top_k` of them), as `function_to_apply` asks. The answer is a
    list per text, also for one text."""
    return await _task(request, state, model_of(request, state), body)


@router.post("/models/{model}", response_model=list[list[Prediction]], summary="Hugging Face text classification, "
             "one model")
async def hf_task_model(request: Request, state: State, model: str, body: HFRequest) -> JSONBody:
    """`POST /` on the model named in the path (`InferenceClient("http://host/models/<model>")`)."""
    return await _task(request, state, model, body)
