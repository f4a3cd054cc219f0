"""The tokenizer alone, as TEI and vLLM serve it: a client counts a text's tokens or sees how the model reads it
before sending it, and turns token ids back into text. Nothing is computed on the model.

- ``POST /tokenize`` takes either API's body. TEI's (``inputs``: a text or a list; ``add_special_tokens``) is
  answered TEI's way, a list per text of ``{"id", "text", "special", "start", "stop"}`` (``text``: the characters
  the token stands for, or a special token's spelling; ``start`` and ``stop``: character offsets, null for a special
  token). vLLM's (``prompt``, ``model``, ``add_special_tokens``, ``return_token_strs``) is answered vLLM's way,
  ``{"count", "max_model_len", "tokens", "token_strs"}``. A body with ``prompt`` (or a chat's ``messages``) and no
  ``inputs`` is vLLM's; its errors are vLLM's too.
- ``POST /decode`` (TEI): ``ids`` (a list of ids, or a list of those), ``skip_special_tokens`` (default true): a
  list of texts.
- ``POST /detokenize`` (vLLM): ``tokens`` and ``model``: ``{"prompt"}`` (special tokens kept, as vLLM decodes).

The model is vLLM's ``model`` field, else the one the ``X-Model`` header names, else the default one. A text is read
whole, with the special tokens of one chunk around it; the classifying routes read a text longer than the model's
chunk length (``max_model_len``, TEI's ``max_input_length``) in chunks, each with its special tokens.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from service.modeling.encoding import Token
from service.serving.api.responses import JSONBody
from service.serving.api.routes.deps import State, require_json, require_key
from service.serving.api.routes.tei import ERRORS, TEIError, model_of
from service.serving.api.routes.vllm import VLLMError, not_a_chat
from service.serving.api.schemas import json_kind

router = APIRouter(tags=["tokenizer"], dependencies=[Depends(require_key), Depends(require_json)])


def _ids(value: Any) -> Any:
    """TEI's ``ids``: a list of token ids, or a non-empty list of those; else one clear error."""
    lists = value if isinstance(value, list) and value and all(isinstance(v, list) for v in value) else [value]
    for k, one in enumerate(lists):
        bad = next((j for j, i in enumerate(one) if type(i) is not int), None) if isinstance(one, list) else -1
        if bad is not None:
            where = "ids" if lists is not value else f"ids.{k}"
            got = json_kind(one) if bad == -1 else f"item {bad}: {json_kind(one[bad])}"
            raise PydanticCustomError("tei_ids", "{where} must be a list of token ids or a list of those; got {got}",
                                      {"where": where, "got": got})
    return value


class TEITokenize(BaseModel):
    model_config = ConfigDict(extra="forbid", title="TEITokenizeRequest")
    inputs: str | Annotated[list[str], Field(min_length=1)] = Field(description="A text, or a list of texts",
                                                                    examples=["I love this!"])
    add_special_tokens: StrictBool = Field(True, description="The special tokens around the text ([CLS], [SEP])")
    prompt_name: None = Field(None, description="TEI's prompt of a sentence-transformers model: these models have "
                                                "none")

    @model_validator(mode="before")
    @classmethod
    def _no_prompt(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("prompt_name") is not None:
            raise PydanticCustomError("tei_prompt", "prompt_name: these models have no prompts (TEI's "
                                                    "sentence-transformers prompts); leave it out")
        return data


class TEIToken(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class VLLMTokenize(BaseModel):
    model_config = ConfigDict(extra="ignore", title="VLLMTokenizeRequest")
    model: str | None = Field(None, description="The model (absent: the default one)")
    prompt: str = Field(description="The text", examples=["I love this!"])
    add_special_tokens: StrictBool = Field(True, description="The special tokens around the text ([CLS], [SEP])")
    return_token_strs: StrictBool | None = Field(False, description="Also each token as the vocabulary spells it")

    @model_validator(mode="before")
    @classmethod
    def _not_a_chat(cls, data: Any) -> Any:
        return not_a_chat(data, "prompt")


class VLLMTokenized(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


def is_vllm(body: object) -> bool:
    """Whether a ``/tokenize`` body is vLLM's: a ``prompt`` (or a chat's ``messages``) and no TEI ``inputs``."""
    return isinstance(body, dict) and ("prompt" in body or "messages" in body) and "inputs" not in body


async def read_body(request: Request, body: dict[str, Any]) -> TEITokenize | VLLMTokenize:
    """The ``/tokenize`` body as the API it belongs to reads it (a vLLM body's errors are vLLM's from here on), from
    the JSON as the other routes' bodies are (where half a surrogate pair is no text)."""
    model = VLLMTokenize if is_vllm(body) else TEITokenize
    if model is VLLMTokenize:
        request.state.dialect = "vllm"
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False), body=body) from None


_REQUEST = {"requestBody": {"content": {"application/json": {"schema": {
    "oneOf": [TEITokenize.model_json_schema(), VLLMTokenize.model_json_schema()]}}}}}
"""The body either API sends, documented (the route takes a JSON object and reads it as one of them)."""


EITHER: dict[int | str, dict[str, Any]] = {s: {"model": TEIError | VLLMError}
                                          for s in (400, 401, 404, 413, 415, 422, 424, 429, 503)}
"""The errors of ``/tokenize``: TEI's shape, or vLLM's for a body of vLLM's."""


def _tei_tokens(text: str, tokens: list[Token]) -> list[dict[str, Any]]:
    return [{"id": t.id, "text": t.piece if t.span is None else text[t.span[0]:t.span[1]], "special": t.special,
             "start": None if t.span is None else t.span[0], "stop": None if t.span is None else t.span[1]}
            for t in tokens]


@router.post("/tokenize", response_model=list[list[TEIToken]] | VLLMTokenized, summary="TEI and vLLM tokenize",
             openapi_extra=_REQUEST, responses=EITHER)
async def tokenize(request: Request, state: State, body: Annotated[dict[str, Any], Body()]) -> JSONBody:
    """Each text's tokens, as TEI answers them (a list per text of `id`, `text`, `special`, `start`, `stop`) or, for
    a vLLM body (`prompt`), as vLLM does (`count`, `max_model_len`, `tokens`, `token_strs`)."""
    asked = await read_body(request, body)
    if isinstance(asked, VLLMTokenize):
        model = asked.model or model_of(request, state)
        (tokens,) = await state.inference.tokenize(model, [asked.prompt], asked.add_special_tokens)
        return JSONBody({"count": len(tokens), "max_model_len": state.inference.describe(model)["max_length"],
                         "tokens": [t.id for t in tokens],
                         "token_strs": [t.piece for t in tokens] if asked.return_token_strs else None})
    texts = [asked.inputs] if isinstance(asked.inputs, str) else asked.inputs
    read = await state.inference.tokenize(model_of(request, state), texts, asked.add_special_tokens)
    return JSONBody([_tei_tokens(text, tokens) for text, tokens in zip(texts, read, strict=True)])


class TEIDecode(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ids: Annotated[list[int] | list[list[int]], BeforeValidator(_ids)] = Field(
        description="Token ids, or a list of lists of them", examples=[[101, 7592, 102]])
    skip_special_tokens: StrictBool = Field(True, description="Leave the special tokens out of the text")


@router.post("/decode", response_model=list[str], summary="TEI decode", responses=ERRORS)
async def decode(request: Request, state: State, body: TEIDecode) -> JSONBody:
    """The text of token ids (of each list of them): a list of texts, as TEI answers."""
    lists: list[list[int]] = body.ids if body.ids and isinstance(body.ids[0], list) else [body.ids]  # type: ignore[list-item]
    return JSONBody(await state.inference.decode(model_of(request, state), lists, body.skip_special_tokens))


class VLLMDetokenize(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(None, description="The model (absent: the default one)")
    tokens: list[Annotated[int, Field(strict=True)]] = Field(description="Token ids", examples=[[101, 7592, 102]])


class VLLMDetokenized(BaseModel):
    prompt: str


@router.post("/detokenize", response_model=VLLMDetokenized, summary="vLLM detokenize",
             responses={s: {"model": VLLMError} for s in (400, 401, 404, 413, 415, 503)})
async def detokenize(request: Request, state: State, body: VLLMDetokenize) -> JSONBody:
    """The text of token ids, special tokens kept, as vLLM answers: `{"prompt"}`."""
    (text,) = await state.inference.decode(body.model or model_of(request, state), [body.tokens], False)
    return JSONBody({"prompt": text})

