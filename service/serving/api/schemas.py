"""Request and response models: the service's OpenAPI contract."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StringConstraints
from pydantic_core import PydanticCustomError

from service.modeling.encoding import Truncation
from service.modeling.manifest import ProblemType
from service.serving.core.lifecycle import Status
from service.serving.core.work import Method

NonBlank = Annotated[str, StringConstraints(min_length=1, pattern=r"\S"), Field(description="A text to classify")]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: list[NonBlank] = Field(min_length=1, description="Texts, answered in the same order",
                                   examples=[["I love this!", "That was terrible."]])
    timeout_s: StrictFloat | None = Field(None, ge=0.1, le=3600, description="Deadline for this request in seconds; "
                                    "the server's default applies when absent and its maximum caps it")


def _short(text: str, limit: int = 60) -> str:
    """``text``, cut to ``limit`` characters (an error message does not echo a whole body back)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_kind(value: Any) -> str:
    """What a JSON value is, in a client's words (for errors about a field of the wrong kind)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int | float):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"the string {_short(value)!r}"
    return "an object" if isinstance(value, dict) else "a list"


def _names(value: Any, expected: str, one: str | None) -> Any:
    """``value`` unchanged when it is null, a string or a list of strings, else a clear error (pydantic's union
    errors name each branch: 'models.list[constrained-str]: Input should be a valid list; models.literal['all']:
    ...'). ``one``: the hint for a lone string that is not accepted (None: a lone string is)."""
    if value is None or (isinstance(value, str) and (one is None or value == "all")):
        return value
    if isinstance(value, str):
        raise PydanticCustomError("names_type", "{expected}; got {got} ({one})",
                                  {"expected": expected, "got": json_kind(value), "one": one.format(_short(value))})
    if not isinstance(value, list) or not value:
        raise PydanticCustomError("names_type", "{expected}; got {got}",
                                  {"expected": expected, "got": json_kind(value) if value != [] else "an empty list"})
    bad = next((k for k, v in enumerate(value) if not isinstance(v, str) or not v), None)
    if bad is not None:
        raise PydanticCustomError("names_type", "{expected}; item {k} is {got}",
                                  {"expected": expected, "k": bad, "got": json_kind(value[bad]) if value[bad] != ""
                                   else "empty"})
    return value


ModelNames = Annotated[  # (an empty list is refused by _names; min_length is for the OpenAPI schema)
    Annotated[list[Annotated[str, StringConstraints(min_length=1)]], Field(min_length=1)] | Literal["all"] | None,
    BeforeValidator(lambda v: _names(v, 'a list of model names, or "all" for every loaded model', 'one model: ["{}"]')),
    Field(description='Only on /v1/classify and /v1/explain: several models (or "all": every loaded one) in '
    "place of the default; the answer then holds each model's usual response, in the order asked. A text's encoder "
    "pass is shared by the models on one backbone", examples=[["tweet-sentiment", "bbc-news-topics"]])]

Labels = Annotated[str | list[Annotated[str, StringConstraints(min_length=1)]] | None,
                   BeforeValidator(lambda v: _names(v, 'a label, a list of labels, or "all"', None))]
"""The labels a request explains (its ``target``)."""


class CreditOptions(BaseModel):
    method: Method = Field(
        "contribution", description='"contribution": each token\'s exact share of the logit through the head\'s '
        'value path (its hidden states at every depth), in logit units, summing to logit - baseline. "end_to_end": '
        'each input token\'s exact share (its word, position and type embedding), carried on through the encoder '
        'with its attention, norms and activations held at their values, summing to logit - baseline (BERT-family '
        'backbones; see a model\'s credit_methods). "shares": the paper\'s eq. 15 routing shares '
        '(phi1 @ phi2 @ phi3 at unit variance): how much of each token\'s data the routings pass to a class, '
        'not whether it raises the score')
    contrast: StrictBool = Field(True, description="With method contribution: explain logit_k - mean of all "
                                 "logits (what moves the probabilities) instead of logit_k alone (multi-label "
                                 "models: always logit_k alone, each label's probability is its own)")


class ScoreOptions(BaseModel):
    raw_scores: StrictBool = Field(False, description="Answer the head's raw scores (logits) in `score` and `scores` "
                                   "instead of probabilities")
    truncate: StrictBool = Field(False, description="Cut a text longer than the model's chunk length to one chunk "
                                 "(on the side `truncation_direction` says) instead of reading it whole in chunks")
    truncation_direction: Literal["right", "left"] = Field(
        "right", description='With `truncate`: "right" keeps the beginning of the text, "left" its end')

    def truncation(self) -> Truncation | None:
        """What the tokenizer cuts (None: nothing, a long text is read whole)."""
        return Truncation(self.truncation_direction) if self.truncate else None


class ClassifyRequest(ScoreOptions, CreditOptions, _Request):
    explain: StrictBool = Field(False, description="Also return token-level credit for each predicted label")
    models: ModelNames = None


class ExplainRequest(ScoreOptions, CreditOptions, _Request):
    target: Labels = Field(
        None, description='Label(s) to explain: a label, a list of labels, or "all" (default: the predicted one); '
        'with several models, "all" or none, for each model')
    models: ModelNames = None
    include_matrix: StrictBool = Field(False, description="Add the full credit matrix [n_pos, d_depth, n_classes] "
                                       "(every class, same method)")
    include_phi: StrictBool = Field(False, description="Add each routing's credit matrix phi "
                                                 "(phi1 is [n_pos*d_depth, n_hid])")


class TokenCredit(BaseModel):
    token: str
    start: int = Field(description="Character offset where the token starts")
    end: int = Field(description="Character offset where the token ends")
    credit: float


_LOGIT = ("The explained logit (contrast form: logit - mean of all logits); null for routing shares. "
          "Token credit (special tokens included) + baseline = logit")
_BASELINE = ("The logit with every hidden state at zero (contribution) or every input token's embedding at zero "
             "(end_to_end), the routing coefficients, attention probabilities, norm scales and activation ratios "
             "as in this pass")


class PredictedExplanation(BaseModel):
    target: str = Field(description="The label explained (the predicted one)")
    method: Method
    contrast: bool
    logit: float | None = Field(description=_LOGIT)
    baseline: float | None = Field(description=_BASELINE)
    special: float = Field(description="Credit of the special tokens ([CLS], [SEP] of every chunk), summed")
    tokens: list[TokenCredit] = Field(description="Credit per (non-special) token, summed over depth")


class ClassifyResult(BaseModel):
    label: str = Field(description="Predicted label (multi-label models: the label of the highest score)")
    score: float = Field(description="Probability of the predicted label (with `raw_scores`: its logit)")
    scores: dict[str, float] = Field(description="Probability of every label (with `raw_scores`: its logit; "
                                     "multi-label models: each label's own, by sigmoid)")
    labels: list[str] | None = Field(None, exclude_if=lambda v: v is None, description="Multi-label models only: "
                                     "every label whose probability reaches its threshold (`label` is the highest)")
    explanation: PredictedExplanation | None = None


class ClassifyResponse(BaseModel):
    model: str
    results: list[ClassifyResult]


class Token(BaseModel):
    token: str
    start: int
    end: int
    special: bool


class SpanCredit(BaseModel):
    text: str
    start: int
    end: int
    credit: float


class TargetCredit(BaseModel):
    logit: float | None = Field(description=_LOGIT)
    baseline: float | None = Field(description=_BASELINE)
    tokens: list[float] = Field(description="Credit per token position (aligned with `tokens`), summed over depth")
    words: list[SpanCredit] = Field(description="Word pieces merged into words")
    sentences: list[SpanCredit]
    depth: list[list[float]] = Field(description="[tokens x depth] credit matrix (end_to_end: each input token's "
                                     "credit by the depth through which the head reads it)")


class ExplainResult(BaseModel):
    label: str
    score: float
    scores: dict[str, float]
    labels: list[str] | None = Field(None, exclude_if=lambda v: v is None, description="Multi-label models only: "
                                     "every label whose probability reaches its threshold (`label` is the highest)")
    method: Method
    contrast: bool
    tokens: list[Token]
    targets: list[str]
    credit: dict[str, TargetCredit] = Field(description="Per target label")
    matrix: list[list[list[float]]] | None = Field(None, description="[n_pos, d_depth, n_classes] credit of "
                                                   "every class, same method")
    phi: list[list[list[float]]] | None = Field(None, description="phi1, phi2, phi3 of the three routings")


class ExplainResponse(BaseModel):
    model: str
    labels: list[str]
    results: list[ExplainResult]


class MultiClassifyResponse(BaseModel):
    models: list[str] = Field(description="The models asked, in order")
    responses: list[ClassifyResponse] = Field(description="Each model's own response, in the order of `models`")


class MultiExplainResponse(BaseModel):
    models: list[str] = Field(description="The models asked, in order")
    responses: list[ExplainResponse] = Field(description="Each model's own response, in the order of `models`")


class ModelInfo(BaseModel):
    name: str
    task: str
    description: str
    labels: list[str]
    problem_type: ProblemType = Field("single_label_classification", description="multi_label_classification: each "
                                      "label's probability on its own (sigmoid), the labels over their thresholds "
                                      "predicted")
    backbone: dict[str, Any]
    head: dict[str, Any]
    max_length: int
    parameters: dict[str, int]
    device: str
    dtype: str
    evaluation: dict[str, Any]
    load_seconds: float
    credit_methods: list[str] = Field(description="The credit methods this model answers (end_to_end needs a "
                                                  "BERT-family backbone)")
    default: bool = False
    ready: bool = Field(True, description="KServe V1's model readiness, as GET /v2/models/{model}/ready says it: "
                                          "a model described here is loaded and serves (one that is not is 404)")


class ModelCard(BaseModel):
    """A model as OpenAI's list of models holds it (vLLM's ``GET /v1/models``)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="Unix time of the answer, as vLLM gives it")
    owned_by: str = "routing-service"
    max_model_len: int = Field(description="Tokens a chunk holds, the special tokens included")


class ModelList(BaseModel):
    default: str | None = Field(description="The model behind /v1/classify and /v1/explain (null while none is: a "
                                            "server started without models, none loaded since)")
    models: list[ModelInfo]
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(description="The same models in OpenAI's shape, as vLLM lists them, the default "
                                              "first (vLLM's clients take data[0].id for the model to ask /classify)")


class ErrorBody(BaseModel):
    code: str = Field(description="Machine-readable error code", examples=["validation_error"])
    message: str = Field(description="What went wrong, for people")
    details: list[dict[str, Any]] | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class Health(BaseModel):
    status: Status
    models: list[str] = []
