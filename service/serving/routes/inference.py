"""POST classify and explain, for a named model or the default one."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace

from fastapi import APIRouter, Depends, Request

from service.serving import errors, render
from service.serving.batcher import DeadlineExceeded, Draining, Overloaded
from service.serving.contract import Result, Task, results_of
from service.serving.errors import APIError
from service.serving.routes.deps import State, require_json, require_key, served_model
from service.serving.schemas import (
    ClassifyRequest,
    ClassifyResponse,
    ErrorResponse,
    ExplainRequest,
    ExplainResponse,
)
from service.serving.state import AppState, Served

ERRORS = {s: {"model": ErrorResponse} for s in (401, 404, 413, 415, 422, 503, 504)}
router = APIRouter(prefix="/v1", tags=["inference"], dependencies=[Depends(require_key), Depends(require_json)],
                   responses=ERRORS)


def check_limits(state: AppState, inputs: list[str]) -> None:
    s = state.settings
    if len(inputs) > s.max_inputs:
        raise APIError(413, f"too many inputs: {len(inputs)} > {s.max_inputs}")
    for k, text in enumerate(inputs):
        if len(text) > s.max_chars:
            raise APIError(413, f"inputs.{k} has {len(text)} characters, more than the limit of {s.max_chars}")


def deadline(state: AppState, timeout_s: float | None) -> float:
    """Monotonic deadline: the request's own timeout (capped by the server's maximum) or the default."""
    s = state.settings
    return time.monotonic() + min(timeout_s or s.request_timeout_s, s.max_request_timeout_s)


async def _watch_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _refused(e: Overloaded | Draining) -> APIError:
    """The answer when the batcher takes no more texts: 503 with Retry-After."""
    if isinstance(e, Draining):
        return errors.unavailable(errors.SHUTTING_DOWN, "draining")
    return errors.unavailable(f"overloaded, retry later ({e})", "overloaded")


async def encode(state: AppState, served: Served, tasks: list[Task]) -> list[Task]:
    """Tokenize the tasks' texts once, off the event loop; a queue without room answers 503 first, a
    text over ``max_text_tokens`` 413."""
    try:
        served.batcher.check_room(len(tasks))
    except (Overloaded, Draining) as e:
        raise _refused(e) from None
    encodings = await asyncio.get_running_loop().run_in_executor(None, served.engine.encode, [t.text for t in tasks])
    cap = state.settings.max_text_tokens
    for k, e in enumerate(encodings):
        if cap is not None and e.n_tokens > cap:
            raise APIError(413, f"inputs.{k} has {e.n_tokens} tokens, more than the limit of {cap}")
    return [replace(t, encoding=e) for t, e in zip(tasks, encodings, strict=True)]


async def run_tasks(request: Request, served: Served, tasks: list[Task], deadline: float) -> list[Result]:
    """Submit the texts (tokenized here unless they already are), answer errors in the one shape, and
    stop if the client goes away."""
    engine = served.engine
    if any(t.encoding is None for t in tasks):
        tasks = await encode(request.app.state.app_state, served, tasks)
    chunks = [w for plan in engine.plan(tasks) for w in plan]  # a long text: several chunks, one group
    work = asyncio.ensure_future(served.batcher.submit(chunks, [w.cost for w in chunks], deadline,
                                                       groups=[w.job for w in chunks]))
    watch = asyncio.ensure_future(_watch_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not work.done():  # the client disconnected: drop its queued texts
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await work
        raise APIError(499, "client disconnected")
    try:
        answers = work.result()
    except (Overloaded, Draining) as e:
        raise _refused(e) from None
    except DeadlineExceeded as e:
        raise APIError(504, f"deadline exceeded: {e}") from None
    except Exception as e:
        raise APIError(500, f"model {engine.name} failed on this batch: {type(e).__name__}: {e}") from e
    results = results_of(chunks, answers)
    failed = next((r.error for r in results if r.error), None)
    if failed:
        raise APIError(500, failed, reason="internal")
    return results


def targets(labels: list[str], target: str | list[str] | None) -> tuple[str, ...] | None:
    if target is None:
        return None
    if target == "all":
        return tuple(labels)
    wanted = [target] if isinstance(target, str) else target
    unknown = [t for t in wanted if t not in labels]
    if unknown or not wanted:
        raise APIError(422, f"target: unknown label(s) {unknown}; choose from {labels} or 'all'",
                       details=[{"field": "target", "message": f"unknown label(s) {unknown}", "type": "value_error"}])
    return tuple(dict.fromkeys(wanted))


async def classify(request: Request, state: AppState, model: str, body: ClassifyRequest) -> ClassifyResponse:
    served = served_model(state, model)
    check_limits(state, body.inputs)
    until = deadline(state, body.timeout_s)
    contrast = body.contrast and body.method == "contribution"
    tasks = [Task(t, explain="tokens" if body.explain else None, method=body.method, contrast=contrast)
             for t in body.inputs]
    results = await run_tasks(request, served, tasks, until)
    views = [render.classify_result(r) for r in results] if not body.explain else await render.off_loop(
        lambda: [render.classify_result(r) for r in results])
    return ClassifyResponse(model=model, results=views)


async def explain(request: Request, state: AppState, model: str, body: ExplainRequest) -> ExplainResponse:
    served = served_model(state, model)
    engine = served.engine
    check_limits(state, body.inputs)
    until = deadline(state, body.timeout_s)
    wanted = targets(engine.labels, body.target)
    contrast = body.contrast and body.method == "contribution"
    tasks = await encode(state, served, [Task(t, explain="full", targets=wanted, method=body.method, contrast=contrast,
                                       include_matrix=body.include_matrix, include_phi=body.include_phi)
                                  for t in body.inputs])
    if body.include_matrix or body.include_phi:
        size = sum(engine.explain_elements(t.encoding.n_tokens, body.include_matrix, body.include_phi)
                   for t in tasks if t.encoding is not None)
        if size > state.settings.max_explain_elements:
            raise APIError(413, f"include_matrix/include_phi would return {size} numbers, more than the limit of "
                                f"{state.settings.max_explain_elements}; send fewer or shorter texts")
    results = await run_tasks(request, served, tasks, until)
    views = await render.off_loop(lambda: [render.explain_result(r, t) for r, t in zip(results, body.inputs,
                                                                                        strict=True)])
    return ExplainResponse(model=model, labels=engine.labels, results=views)


@router.post("/models/{model}/classify", response_model=ClassifyResponse, summary="Classify texts")
async def classify_model(request: Request, state: State, model: str, body: ClassifyRequest) -> ClassifyResponse:
    """Predicted label and probabilities per text; with `explain`, token credit for the predicted label."""
    return await classify(request, state, model, body)


@router.post("/models/{model}/explain", response_model=ExplainResponse, summary="Credit assignments")
async def explain_model(request: Request, state: State, model: str, body: ExplainRequest) -> ExplainResponse:
    """Credit per token, word, sentence and depth for the target label(s): by default each token's exact
    contribution to the (contrast) logit through the head, with the baseline it sums to the logit with."""
    return await explain(request, state, model, body)


@router.post("/classify", response_model=ClassifyResponse, summary="Classify with the default model")
async def classify_default(request: Request, state: State, body: ClassifyRequest) -> ClassifyResponse:
    return await classify(request, state, state.settings.default_model, body)


@router.post("/explain", response_model=ExplainResponse, summary="Explain with the default model")
async def explain_default(request: Request, state: State, body: ExplainRequest) -> ExplainResponse:
    return await explain(request, state, state.settings.default_model, body)
