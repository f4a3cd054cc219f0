"""vLLM's classification API, ``POST /classify`` (at the root, as vLLM serves it; ``/v1/classify`` is this service's
own), over the same pipeline and batcher as ``/v1``: ``model`` (absent: the default one), ``input`` (a text or a
list; or token ids, a list or a list of lists, each read as it is in one chunk), ``truncate_prompt_tokens`` (keep k
tokens, special tokens included; -1: the model's chunk length): the first k (``truncation_side`` ``"right"``, the
default, as vLLM truncates for classification) or the last k (``"left"``), ``use_activation`` (false: the logits;
``activation`` and ``softmax``, its older names, too), ``add_special_tokens`` (false: a text read as its ids alone).
Fields vLLM accepts and this service has no use for (``user``, ``priority``, ...) are ignored, as vLLM ignores the
ones it does not know; a chat (``messages``) is refused. Errors are vLLM's, ``{"error": {"message", "type", "param",
"code"}}`` (see :mod:`service.serving.api.errors`)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, model_validator
from pydantic_core import PydanticCustomError

from service.modeling.encoding import Truncation
from service.serving.api.responses import JSONBody
from service.serving.api.routes.deps import State, client_gone, require_json, require_key
from service.serving.api.schemas import NonBlank, json_kind
from service.serving.core.work import TokenIds
from service.serving.pipeline.render import scores


def _ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(i) is int for i in value)


def _input(value: Any) -> Any:
    """``value`` when it is a text, a non-empty list of texts, a list of token ids or a non-empty list of those (vLLM's
    four forms), else one clear error (not one per union branch)."""
    if isinstance(value, str) or _ids(value) or (isinstance(value, list) and value and (
            all(isinstance(v, str) for v in value) or all(_ids(v) for v in value))):
        return value
    if not isinstance(value, list) or not value:
        got = "an empty list" if value == [] else json_kind(value)
    else:
        first = value[0]
        fits = _ids if isinstance(first, list) else (lambda v: type(v) is int) if type(first) is int else (
            lambda v: isinstance(v, str))
        k = next(k for k, v in enumerate(value) if not fits(v))
        got = f"item {k}: " + ("an empty list" if value[k] == [] else "a list holding other than token ids"
                               if isinstance(value[k], list) else json_kind(value[k]))
    raise PydanticCustomError("vllm_input", "a text, a list of texts, a list of token ids or a list of those; got "
                                            "{got}", {"got": got})


def not_a_chat(data: Any, field: str) -> Any:
    """``data``, unless it is vLLM's other form of a request, a chat (``messages``): said to be one, not ``field`` said
    to be missing."""
    if isinstance(data, dict) and "messages" in data and field not in data:
        raise PydanticCustomError("vllm_chat", "messages (a chat, which vLLM renders with the model's chat template) "
                                  "is not taken: these models read plain text; send it as {field}", {"field": field})
    return data


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class VLLMError(BaseModel):
    error: ErrorInfo


router = APIRouter(tags=["vllm"], dependencies=[Depends(require_key), Depends(require_json)],
                   responses={s: {"model": VLLMError} for s in (400, 401, 404, 413, 415, 503, 504)})


class ClassificationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(None, description="The model (absent: the default one)")
    input: Annotated[NonBlank | Annotated[list[NonBlank], Field(min_length=1)] | list[StrictInt]
                     | Annotated[list[Annotated[list[StrictInt], Field(min_length=1)]], Field(min_length=1)],
                     BeforeValidator(_input)] = Field(
        description="A text, a list of texts, or texts as token ids (a list of ids, or a list of those: each read as "
                    "it is, special tokens included, in one chunk)", examples=[["I love this!"]])
    truncate_prompt_tokens: StrictInt | None = Field(
        None, ge=-1, description="Keep only k tokens of a text (special tokens included); -1: the model's chunk "
        "length. Absent: a long text is read whole, in chunks")
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="With truncate_prompt_tokens: \"right\" (the default) keeps the first k tokens, \"left\" "
        "the last k")
    use_activation: StrictBool | None = Field(None, description="false: the logits in `probs` (default: "
                                              "probabilities, the model's softmax or sigmoid)")
    softmax: StrictBool | None = Field(None, description="vLLM's older name of use_activation")
    activation: StrictBool | None = Field(None, description="vLLM's older name of use_activation")
    add_special_tokens: StrictBool = Field(True, description="false: a text is read without its special tokens, as "
                                           "one chunk (longer than one is refused unless truncate_prompt_tokens cuts "
                                           "it), as vLLM reads it")
    request_id: str | None = Field(None, description="The answer's id is classify-<this>, unless an X-Request-ID "
                                   "header names the request (absent both: the server's own request id)")

    @model_validator(mode="before")
    @classmethod
    def _not_a_chat(cls, data: Any) -> Any:
        return not_a_chat(data, "input")

    @model_validator(mode="after")
    def _one_activation(self) -> ClassificationRequest:
        said = {k: v for k, v in (("use_activation", self.use_activation), ("activation", self.activation),
                                  ("softmax", self.softmax)) if v is not None}
        if len(set(said.values())) > 1:
            raise PydanticCustomError("vllm_activation", "{said} disagree: activation and softmax are vLLM's older "
                                      "names of use_activation; send one", {"said": said})
        return self

    def raw(self) -> bool:
        """Whether the logits are asked for (``use_activation`` false, or its older names)."""
        return False in (self.use_activation, self.activation, self.softmax)

    def texts(self) -> list[str] | TokenIds:
        """The texts, or the token ids sent in their place."""
        if isinstance(self.input, str):
            return [self.input]
        if isinstance(self.input[0], int):
            return TokenIds((tuple(self.input),))  # type: ignore[arg-type]
        if isinstance(self.input[0], list):
            return TokenIds(tuple(tuple(ids) for ids in self.input))  # type: ignore[union-attr]
        return self.input  # type: ignore[return-value]

    def truncation(self) -> Truncation | None:
        k = self.truncate_prompt_tokens
        return None if k is None else Truncation(self.truncation_side or "right", None if k == -1 else k)


class ClassificationData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: dict[str, Any] | None = None


class ClassificationResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: Usage


def _request_id(request: Request, body: ClassificationRequest) -> str:
    """As vLLM names a request: the client's ``X-Request-ID``, else the body's ``request_id``, else (here) the
    server's own request id, the one in the answer's ``X-Request-ID`` and the log."""
    own: str | None = getattr(request.state, "request_id", None)
    if request.headers.get("x-request-id") is None and body.request_id:
        return body.request_id
    return own or uuid.uuid4().hex


@router.post("/classify", response_model=ClassificationResponse, summary="vLLM classify")
async def classify(request: Request, state: State, body: ClassificationRequest) -> JSONBody:
    """vLLM's `/classify`: each text's label and every label's probability (the logits with `use_activation`
    false), in the model's label order, and the tokens read."""
    model = body.model or state.default()
    texts = body.texts()
    if not body.add_special_tokens and isinstance(texts, list):  # read as vLLM reads them then: as their ids alone
        read = await state.inference.tokenize(model, texts, add_special_tokens=False)
        texts = TokenIds(tuple(tuple(t.id for t in tokens) for tokens in read))
    scored = await state.inference.score(model, texts, None, client_gone(request), body.truncation())
    raw = body.raw()
    data = [{"index": k, "label": s.result.label, "probs": list(scores(s.result, raw).values()),
             "num_classes": len(s.result.scores)} for k, s in enumerate(scored)]
    tokens = sum(s.encoding.n_tokens for s in scored)
    return JSONBody({"id": f"classify-{_request_id(request, body)}", "object": "list", "created": int(time.time()),
                     "model": model, "data": data,
                     "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                               "prompt_tokens_details": None}})
