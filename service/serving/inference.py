"""The inference layer: the one pipeline every protocol's routes call, callable and tested without HTTP.

For a request of texts asked of one or more models it checks the limits, tokenizes each text once per
backbone (off the event loop; a queue without room answers before any tokenizing), plans each text as
jobs that share an encoder pass among the heads that cut it alike, submits them to each backbone's
batcher, awaits the answers within the request's deadline while the client is there, and turns them
into plain per-model results and views. Failures are raised as :class:`~service.serving.errors.APIError`
with the status they answer with (the routes' error handlers give them each protocol's shape).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from service.config import Settings
from service.modeling.encoding import Encoding
from service.serving import errors, render, tracing
from service.serving.batcher import Batcher, DeadlineExceeded, Draining, Overloaded
from service.serving.contract import (
    Answer,
    Ask,
    ChunkWork,
    CreditSpec,
    Detail,
    Method,
    Result,
    TextJob,
    Token,
    answers_of,
)
from service.serving.errors import APIError
from service.serving.lifecycle import Lifecycle
from service.serving.planner import Planner, model_of
from service.serving.render import Body
from service.serving.stats import InferenceStats

if TYPE_CHECKING:
    from service.serving.cache import HeadCache

INLINE_CHARS = 1000
"""Texts of a request up to this many characters in all are tokenized on the event loop (a tweet takes 0.05 ms
here): handing them to a thread took longer than tokenizing them, as the thread waits for the GIL while the
loop is busy (up to the interpreter's 5 ms switch interval)."""

Target = str | list[str] | None
"""What a request asks to explain: a label, a list of labels, ``"all"``, or None (the predicted label)."""


@dataclass
class Backbone:
    """A loaded backbone group as the front serves it: its engine (here, in a process, or replicas) and its
    batcher, which mixes the chunks of every model on it."""

    engine: Planner
    batcher: Batcher[ChunkWork, Answer | None]


@dataclass(frozen=True)
class Scored:
    """One text's answer from one model, with its tokens (built from the encoding the front holds, only
    when credit was asked for)."""

    text: str
    result: Result
    encoding: Encoding
    tokens: list[Token] | None


Gone = Callable[[], Awaitable[None]]
"""Returns once the client has gone away (then the request's queued work is dropped)."""


class Inference:
    """Every loaded model, by name, on its backbone group; and the pipeline that serves them.

    A model's name leads to the key of its current head (:func:`~service.serving.planner.head_key`). A request
    holds the heads it was planned with until it is answered, so a head that a reload or an unload retires
    answers everything accepted before, while new requests go to the new head (or get 404)."""

    def __init__(self, settings: Settings, lifecycle: Lifecycle, stats: InferenceStats | None = None) -> None:
        self.settings, self.lifecycle = settings, lifecycle
        self.stats = stats or InferenceStats()
        self.backbones: dict[str, Backbone] = {}  # by the backbone group's name (see ``group_name``)
        self.models: dict[str, Backbone] = {}  # model name -> its backbone group, in loading order
        self.heads: dict[str, str] = {}  # model name -> the key of its current head
        self._using: Counter[str] = Counter()  # head key -> requests in flight planned with it
        self._released: dict[str, asyncio.Event] = {}  # retired head key -> set when its last request is answered
        self.cache: HeadCache | None = None
        """The head cache, when there is one: heads not in memory are brought in as requests name them."""

    def group_name(self, engine: Planner) -> str:
        """The name a new backbone group ``engine`` goes by here (in logs, metrics and the fronts): its own
        (``name@revision``), or where another group already goes by that (the same name and revision from another
        source) that name with its source, so that neither replaces the other."""
        other = self.backbones.get(engine.name)
        return engine.name if other is None else f"{engine.name} ({engine.key[0]})"

    def add(self, backbone: Backbone) -> None:
        """A backbone group and every head on it (under its name: see :meth:`group_name`)."""
        if backbone.engine.name in self.backbones:
            raise ValueError(f"a backbone group named {backbone.engine.name} is loaded already")
        self.backbones[backbone.engine.name] = backbone
        for key in backbone.engine.models:
            self.serve(model_of(key), key, backbone)

    def serve(self, name: str, key: str, backbone: Backbone) -> None:
        """Requests for model ``name`` go to head ``key`` on ``backbone`` from now on."""
        self.models[name], self.heads[name] = backbone, key

    def withdraw(self, name: str) -> None:
        """New requests for ``name`` get 404 from now on (those accepted keep their heads)."""
        self.models.pop(name, None)
        self.heads.pop(name, None)

    async def released(self, key: str, timeout_s: float) -> bool:
        """Wait until no request in flight holds head ``key`` (retired: no new one takes it); False on timeout."""
        if not self._using.get(key):
            return True
        event = self._released.setdefault(key, asyncio.Event())
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
            return True
        except TimeoutError:
            return False
        finally:
            self._released.pop(key, None)

    def holds(self, name: str) -> bool:
        """Whether a request in flight holds the current head of model ``name``."""
        return bool(self._using.get(self.heads.get(name, "")))

    async def require(self, names: Sequence[str], count: bool = True) -> None:
        """Check that every model of ``names`` can serve (503 while loading, 404 for no such model); with a head
        cache, bring their heads into memory (so the synchronous lookups that follow, up to the next await, find
        them), counting hits and misses when ``count`` (once per request)."""
        if self.cache is None:
            for name in names:
                self.backbone_of(name)
            return
        if not self.lifecycle.serving:
            raise errors.unavailable(f"models are {self.lifecycle.describe()}", "loading")
        await self.cache.bring(names, count)

    def check_name(self, name: str) -> None:
        """404 (or 503 while loading) now for a model that cannot serve, before its head is brought in."""
        if self.cache is None or name in self.models:
            self.backbone_of(name)
        else:
            self.cache.known(name)

    def describe(self, model: str) -> dict[str, object]:
        """What ``/v1/models`` says of ``model`` (404 if it is not loaded)."""
        return self.backbone_of(model).engine.describe(self.heads[model])

    # --- resolving what a request names ---

    def backbone_of(self, model: str) -> Backbone:
        """The group serving ``model``: 503 while loading, 404 if there is none (while draining, requests that
        arrived before the drain still get their model)."""
        if not self.lifecycle.serving:
            raise errors.unavailable(f"models are {self.lifecycle.describe()}", "loading")
        backbone = self.models.get(model)
        if backbone is None:
            raise APIError(404, f"unknown model {model!r}; available: {sorted(self.models)}")
        return backbone

    def labels(self, model: str) -> list[str]:
        return self.backbone_of(model).engine.labels(self.heads[model])

    def resolve(self, names: Sequence[str] | Literal["all"]) -> list[str]:
        """The models a request names: ``"all"`` is every loaded one; an unknown name is a 404 naming it, a
        repeated one a 422."""
        if not self.lifecycle.serving:
            raise errors.unavailable(f"models are {self.lifecycle.describe()}", "loading")
        if names == "all":
            return list(self.models)
        repeated = sorted({n for n in names if list(names).count(n) > 1})
        if repeated:
            raise APIError(422, f"models: {repeated} named more than once",
                           details=[{"field": "models", "message": f"repeated: {repeated}", "type": "value_error"}])
        unknown = [n for n in names if n not in self.models]
        if unknown and self.cache is not None:  # with a head cache, any model folder of the repository
            return list(names)  # (checked as it is brought in)
        if unknown:
            hint = '; "models": "all" (not in a list) asks every loaded model' if "all" in unknown else ""
            raise APIError(404, f"unknown model(s) {unknown}; available: {sorted(self.models)}{hint}")
        return list(names)

    def credit_spec(self, model: str, target: Target = None, method: Method = "contribution", contrast: bool = True,
                    detail: Detail = "tokens", matrix: bool = False, phi: bool = False) -> CreditSpec:
        """The credit of ``model`` a request asks for, its target labels turned into class indices (422 for an
        unknown label)."""
        labels = self.labels(model)
        methods = self.backbone_of(model).engine.credit_methods(self.heads[model])
        if method not in methods:
            raise APIError(422, f"method {method!r}: model {model} answers {methods}; end-to-end credit needs an "
                                "encoder whose layers it knows (the BERT family: absolute positions, a GELU or ReLU "
                                "activation), and this model's backbone is not one",
                           details=[{"field": "method", "message": f"not available for model {model}",
                                     "type": "value_error"}])
        targets: tuple[int, ...] | None = None
        if target == "all":
            targets = tuple(range(len(labels)))
        elif target is not None:
            wanted = [target] if isinstance(target, str) else target
            unknown = [t for t in wanted if t not in labels]
            if unknown or not wanted:
                raise APIError(422, f"target: unknown label(s) {unknown} for model {model}; choose from {labels} or "
                                    "'all'", details=[{"field": "target", "message": f"unknown label(s) {unknown}",
                                                       "type": "value_error"}])
            targets = tuple(labels.index(t) for t in dict.fromkeys(wanted))
        return CreditSpec(method=method, contrast=contrast, targets=targets, detail=detail, matrix=matrix, phi=phi)

    def deadline(self, timeout_s: float | None) -> float:
        """Monotonic deadline: the request's own timeout (capped by the server's maximum) or the default."""
        s = self.settings
        return time.monotonic() + min(timeout_s or s.request_timeout_s, s.max_request_timeout_s)

    def check_limits(self, texts: Sequence[str]) -> None:
        """413 for too many texts or a text over the character limit."""
        s = self.settings
        if len(texts) > s.max_inputs:
            raise APIError(413, f"too many inputs: {len(texts)} > {s.max_inputs}")
        for k, text in enumerate(texts):
            if len(text) > s.max_chars:
                raise APIError(413, f"inputs.{k} has {len(text)} characters, more than the limit of {s.max_chars}")

    # --- the pipeline ---

    async def run(self, models: Sequence[str], texts: list[str], specs: Sequence[CreditSpec | None],
                  deadline: float, gone: Gone | None = None) -> list[list[Scored]]:
        """Every text on every model (``specs[m]``: the credit model ``m`` computes, None: scores only).

        Returns:
            ``[model][text]`` answers, in the order asked.
        """
        self.check_limits(texts)
        if self.cache is not None:
            await self.cache.bring(models, False)  # again: a head may have left memory since the route brought it in
        backbones = [self.backbone_of(name) for name in models]
        keys = [self.heads[name] for name in models]  # the heads this request holds until it is answered
        started = time.perf_counter()
        try:
            with self.holding(keys):
                out = await self._run(backbones, keys, texts, specs, deadline, gone)
        except BaseException:
            self.stats.answered(models, time.perf_counter() - started, ok=False)
            raise
        finally:
            if self.cache is not None:
                self.cache.released()
        self.stats.answered(models, time.perf_counter() - started, ok=True)
        return out

    @contextlib.contextmanager
    def holding(self, keys: Sequence[str]) -> Iterator[None]:
        """Hold heads ``keys`` while the block runs: a retired head is dropped only once nothing holds it (see
        :meth:`released`)."""
        self._using.update(keys)
        try:
            yield
        finally:
            for key in keys:
                self._using[key] -= 1
                if self._using[key] <= 0:
                    del self._using[key]
                    if key in self._released:
                        self._released[key].set()

    async def _run(self, backbones: list[Backbone], keys: list[str], texts: list[str],
                   specs: Sequence[CreditSpec | None], deadline: float, gone: Gone | None) -> list[list[Scored]]:
        """:meth:`run` on the heads ``keys[m]`` of ``backbones[m]``."""
        by_backbone: dict[str, list[int]] = {}  # backbone -> the indices of its heads in ``keys``
        for m, backbone in enumerate(backbones):
            by_backbone.setdefault(backbone.engine.name, []).append(m)
        groups = {b.engine.name: b for b in backbones}
        for name in by_backbone:
            try:
                groups[name].batcher.check_room(len(texts))
            except (Overloaded, Draining) as e:
                raise _refused(e) from None
        loop = asyncio.get_running_loop()
        plans: list[tuple[Backbone, list[TextJob], list[int]]] = []  # a backbone's jobs, and each job's text
        encodings: dict[tuple[int, int], Encoding] = {}  # (head, text) -> the encoding it sees
        for name, ms in by_backbone.items():
            backbone = groups[name]
            engine = backbone.engine
            heads = [keys[m] for m in ms]
            with tracing.span("tokenize", **{"routing.backbone": name, "routing.texts": len(texts)}):
                if sum(map(len, texts)) <= INLINE_CHARS:  # a thread hop would cost more than the tokenizing
                    per_text = engine.encode(texts, heads)
                else:
                    per_text = await loop.run_in_executor(None, engine.encode, texts, heads)
            jobs: list[TextJob] = []
            places: list[int] = []
            for t, by_length in enumerate(per_text):
                for m in ms:
                    encodings[(m, t)] = by_length[engine.max_length(keys[m])]
                text_jobs = engine.jobs(by_length, [Ask(keys[m], specs[m]) for m in ms])
                jobs += text_jobs
                places += [t] * len(text_jobs)
            tracing.follow(jobs)  # their batches' spans link to this request's
            plans.append((backbone, jobs, places))
        self._check_tokens(backbones, keys, specs, encodings)
        answers = await self._submit([(b, [w for j in jobs for w in j.chunks()]) for b, jobs, _ in plans], deadline,
                                     gone)
        results: dict[tuple[int, int], Result] = {}  # (head, text) -> result
        index = {key: m for m, key in enumerate(keys)}
        for (_, jobs, places), got in zip(plans, answers, strict=True):
            for job, t, answer in zip(jobs, places, got, strict=True):
                for ask, res in zip(job.asks, answer, strict=True):
                    results[(index[ask.model or ""], t)] = res
        failed = next((r for r in results.values() if r.error), None)
        if failed is not None and failed.unavailable:  # the device's state, not the text: the client may retry
            raise errors.unavailable(failed.error or "", "overloaded")
        if failed is not None:
            raise APIError(500, failed.error or "", reason="internal")
        explained = {key: enc for key, enc in encodings.items() if specs[key[0]] is not None}
        tokens = await render.off_loop(lambda: self._tokens(backbones, explained)) if explained else {}
        return [[Scored(text, results[(m, t)], encodings[(m, t)], tokens.get(id(encodings[(m, t)])))
                 for t, text in enumerate(texts)] for m in range(len(keys))]

    @staticmethod
    def _tokens(backbones: Sequence[Backbone], encodings: dict[tuple[int, int], Encoding]) -> dict[int, list[Token]]:
        """The tokens of each encoding (by identity), built once however many models share it."""
        out: dict[int, list[Token]] = {}
        for (m, _), enc in encodings.items():
            if id(enc) not in out:
                out[id(enc)] = backbones[m].engine.tokens(enc)
        return out

    def _check_tokens(self, backbones: Sequence[Backbone], keys: Sequence[str], specs: Sequence[CreditSpec | None],
                      encodings: dict[tuple[int, int], Encoding]) -> None:
        """413 for a text over ``max_text_tokens``, or a full matrix / phi payload over ``max_explain_elements``."""
        cap = self.settings.max_text_tokens
        size = 0
        for (m, t), enc in sorted(encodings.items(), key=lambda kv: kv[0][::-1]):
            if cap is not None and enc.n_tokens > cap:
                raise APIError(413, f"inputs.{t} has {enc.n_tokens} tokens, more than the limit of {cap}")
            spec = specs[m]
            if spec is not None and (spec.matrix or spec.phi):
                size += backbones[m].engine.explain_elements(keys[m], enc.n_tokens, spec)
        if size > self.settings.max_explain_elements:
            raise APIError(413, f"include_matrix/include_phi would return {size} numbers, more than the limit of "
                                f"{self.settings.max_explain_elements}; send fewer or shorter texts")

    async def _submit(self, work: list[tuple[Backbone, list[ChunkWork]]], deadline: float,
                      gone: Gone | None) -> list[list[Answer]]:
        """Queue each backbone's chunks on its batcher and wait for them all, the deadline, or the client leaving.
        Returns each backbone's answers, one per text job, in the order of the jobs' first chunks."""
        tasks = [asyncio.ensure_future(b.batcher.submit(chunks, [w.cost for w in chunks], deadline,
                                                        groups=[w.job for w in chunks])) for b, chunks in work]
        watch = asyncio.ensure_future(gone()) if gone is not None else None
        try:
            pending: set[asyncio.Future[object]] = set(tasks)
            while pending:
                waiting = pending | ({watch} if watch is not None else set())
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if watch is not None and watch in done:
                    raise APIError(499, "client disconnected")
                pending -= done
                if any(not t.cancelled() and t.exception() is not None for t in done):
                    break
        finally:
            if watch is not None:
                watch.cancel()
            for t in tasks:  # on any early exit, drop what is still queued
                if not t.done():
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await t
        for (backbone, _), t in zip(work, tasks, strict=True):
            name = backbone.engine.name
            e = t.exception() if t.done() and not t.cancelled() else None
            if isinstance(e, Overloaded | Draining):
                raise _refused(e) from None
            if isinstance(e, DeadlineExceeded):
                raise APIError(504, f"deadline exceeded: {e}") from None
            if e is not None:
                raise APIError(500, f"backbone {name} failed on this batch: {type(e).__name__}: {e}") from e
        return [answers_of(chunks, t.result()) for (_, chunks), t in zip(work, tasks, strict=True)]

    async def classify(self, models: Sequence[str], texts: list[str], explain: bool = False,
                       method: Method = "contribution", contrast: bool = True, timeout_s: float | None = None,
                       gone: Gone | None = None) -> list[list[Body]]:
        """Label and probabilities of each text on each model; with ``explain``, token credit of the predicted
        label. Returns ``[model][text]`` bodies of :class:`~service.serving.schemas.ClassifyResult`."""
        await self.require(models, count=False)  # the route has brought them in (and counted)
        until = self.deadline(timeout_s)
        specs = [self.credit_spec(m, method=method, contrast=contrast) if explain else None for m in models]
        scored = await self.run(models, texts, specs, until, gone)
        build = lambda: [[render.classify_result(s.result, s.tokens) for s in per] for per in scored]  # noqa: E731
        with tracing.span("render", **{"routing.texts": len(texts)}):
            return build() if not explain else await render.off_loop(build)

    async def explain(self, models: Sequence[str], texts: list[str], target: Target = None,
                      method: Method = "contribution", contrast: bool = True, matrix: bool = False, phi: bool = False,
                      timeout_s: float | None = None, gone: Gone | None = None) -> list[list[Body]]:
        """Credit per token, word, sentence and depth of the ``target`` label(s) of each text on each model
        (with several models, ``target`` is ``"all"`` or None: each model's own labels). Returns ``[model][text]``
        bodies of :class:`~service.serving.schemas.ExplainResult`."""
        if len(models) > 1 and target not in (None, "all"):
            raise APIError(422, "target: with several models only 'all' or none (the predicted label) applies to "
                                "each; name labels with one model",
                           details=[{"field": "target", "message": "labels need one model", "type": "value_error"}])
        await self.require(models, count=False)  # the route has brought them in (and counted)
        until = self.deadline(timeout_s)
        specs = [self.credit_spec(m, target, method, contrast, "full", matrix, phi) for m in models]
        scored = await self.run(models, texts, specs, until, gone)
        with tracing.span("render", **{"routing.texts": len(texts)}):
            return await render.off_loop(lambda: [[render.explain_result(s.result, s.text, s.tokens or [],
                                                                         s.encoding.word_ids) for s in per]
                                                  for per in scored])


def _refused(e: Overloaded | Draining) -> APIError:
    """The answer when a batcher takes no more texts: 503 with Retry-After."""
    if isinstance(e, Draining):
        return errors.unavailable(errors.SHUTTING_DOWN, "draining")
    return errors.unavailable(f"overloaded, retry later ({e})", "overloaded")
