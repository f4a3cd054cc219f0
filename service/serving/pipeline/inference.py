"""The inference layer: the one pipeline every protocol's routes call, callable and tested without HTTP.

For a request of texts asked of one or more models it checks the limits, tokenizes each text once per
backbone (off the event loop; a queue without room answers before any tokenizing), plans each text as
jobs that share an encoder pass among the heads that cut it alike, submits them to each backbone
group, awaits the answers within the request's deadline while the client is there, and turns them
into plain per-model results and views. Failures are raised as :class:`~service.serving.core.errors.APIError`
with the status they answer with (the routes' error handlers give them each protocol's shape).

The models and their backbone groups are the :class:`~service.serving.models.registry.Registry`'s; each group is
reached through one interface (:class:`~service.serving.engine.group.BackboneGroup`), whether it computes in this
process's reach or on the engine host behind several fronts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from service.config import Settings
from service.modeling.encoding import Encoding, Token, Truncation
from service.modeling.tokenizer import BackboneError, NotAChunk, UnknownTokenId
from service.serving.core import errors
from service.serving.core.errors import APIError
from service.serving.core.lifecycle import Lifecycle
from service.serving.core.results import Answer, Result, TokenSpan
from service.serving.core.work import Ask, CreditSpec, Detail, Method, TextJob, TokenIds
from service.serving.engine.batcher import DeadlineExceeded, Draining, Overloaded
from service.serving.engine.group import BackboneGroup, credit_methods
from service.serving.models.cache import HeadCache
from service.serving.models.registry import Registry
from service.serving.observe import tracing
from service.serving.observe.stats import InferenceStats
from service.serving.pipeline import render
from service.serving.pipeline.render import Body

INLINE_CHARS = 2000
"""Texts of a request up to this many characters in all are tokenized on the event loop (about 0.9 ms: test tweets,
104 characters on average, take 44 us each, token ids alone): handing them to a thread took longer than tokenizing
them, as the thread waits for the GIL while the loop is busy (up to the interpreter's 5 ms switch interval); requests
of 16 tweets (1,700 characters) cost the fronts 0.081-0.086 ms of CPU a text on the loop against 0.090-0.094 through
a thread (2 fronts, c = 16, in turns)."""

Target = str | list[str] | None
"""What a request asks to explain: a label, a list of labels, ``"all"``, or None (the predicted label)."""


@dataclass(frozen=True)
class Scored:
    """One text's answer from one model, with its tokens (built from the encoding the front holds, only
    when credit was asked for)."""

    text: str
    result: Result
    encoding: Encoding
    tokens: list[TokenSpan] | None


Gone = Callable[[], Awaitable[None]]
"""Returns once the client has gone away (then the request's queued work is dropped)."""


class Inference:
    """The pipeline that serves the models of ``registry``: what a request names resolved, its texts planned,
    submitted and answered."""

    def __init__(self, settings: Settings, lifecycle: Lifecycle, registry: Registry,
                 stats: InferenceStats | None = None, cache: HeadCache | None = None) -> None:
        self.settings, self.lifecycle, self.registry = settings, lifecycle, registry
        self.stats = stats or InferenceStats()
        self.cache = cache
        """The head cache, when there is one: heads not in memory are brought in as requests name them."""

    @property
    def models(self) -> dict[str, BackboneGroup]:
        """Every model that serves, by name (see :attr:`Registry.models`)."""
        return self.registry.models

    async def require(self, names: Sequence[str], count: bool = True) -> None:
        """Check that every model of ``names`` can serve (503 while loading, 404 for no such model); with a head
        cache, bring their heads into memory (so the synchronous lookups that follow, up to the next await, find
        them), counting hits and misses when ``count`` (once per request)."""
        if self.cache is None:
            for name in names:
                self.group_of(name)
            return
        if not self.lifecycle.serving:
            raise errors.unavailable(f"models are {self.lifecycle.describe()}", "loading")
        await self.cache.bring(names, count)

    def check_name(self, name: str) -> None:
        """404 (or 503 while loading) now for a model that cannot serve, before its head is brought in."""
        if self.cache is None or name in self.models:
            self.group_of(name)
        else:
            self.cache.known(name)

    def describe(self, model: str) -> dict[str, object]:
        """What ``/v1/models`` says of ``model`` (404 if it is not loaded)."""
        return self.group_of(model).describe(self.heads[model])

    # --- resolving what a request names ---

    @property
    def heads(self) -> dict[str, str]:
        """Each model's current head key (see :attr:`Registry.heads`)."""
        return self.registry.heads

    def group_of(self, model: str) -> BackboneGroup:
        """The group serving ``model``: 503 while loading, 404 if there is none (while draining, requests that
        arrived before the drain still get their model)."""
        if not self.lifecycle.serving:
            raise errors.unavailable(f"models are {self.lifecycle.describe()}", "loading")
        group = self.models.get(model)
        if group is None:
            hint = ""
            if model == self.registry.default_model:  # named by no one: a route without a model in it
                hint = (" (the default model, which routes without a model name answer with, is not loaded: name "
                        "a model, or load it again)")
            raise APIError(404, f"unknown model {model!r}{hint}; available: {sorted(self.models)}")
        return group

    def labels(self, model: str) -> list[str]:
        return self.group_of(model).planner.labels(self.heads[model])

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
        unknown label). A multi-label model's labels are each scored on their own: its credit splits each label's own
        logit (``contrast`` does not apply)."""
        labels = self.labels(model)
        if self.group_of(model).planner.manifests[self.heads[model]].multi_label:
            contrast = False
        methods = credit_methods(self.group_of(model), self.heads[model])
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

    def check_limits(self, texts: Sequence[str] | TokenIds) -> None:
        """413 for too many texts or a text over the character limit (token ids: over the token limit, as they are
        planned)."""
        s = self.settings
        self.check_count(len(texts))
        for k, text in enumerate(texts if isinstance(texts, Sequence) else ()):
            if len(text) > s.max_chars:
                raise APIError(413, f"inputs.{k} has {len(text)} characters, more than the limit of {s.max_chars}")

    def check_count(self, n: int) -> None:
        """413 for more inputs than a request may send."""
        if n > self.settings.max_inputs:
            raise APIError(413, f"too many inputs: {n} > {self.settings.max_inputs}")

    # --- the tokenizer alone ---

    async def tokenize(self, model: str, texts: list[str], add_special_tokens: bool = True) -> list[list[Token]]:
        """Each text's tokens as ``model``'s tokenizer reads it whole (the special tokens of one chunk around them when
        ``add_special_tokens``); nothing is computed. A text longer than the model's chunk length is read in chunks,
        each with its own special tokens (see :meth:`run`). With a head cache, the model's head is brought in as a
        request to classify would bring it (its backbone's tokenizer is the head's), not counted as one."""
        await self.require([model], count=False)
        self.check_limits(texts)
        chunker = self.group_of(model).planner.chunker
        if sum(map(len, texts)) <= INLINE_CHARS:
            return chunker.read(texts, add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(None, chunker.read, texts, add_special_tokens)

    async def decode(self, model: str, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """The text of each list of ``model``'s token ids (413 for more lists than a request may send texts, 422 for an
        id outside the vocabulary, naming it)."""
        await self.require([model], count=False)
        self.check_count(len(ids))
        chunker = self.group_of(model).planner.chunker
        try:
            if sum(map(len, ids)) <= INLINE_CHARS:  # as many ids as characters: a long list off the event loop
                return chunker.decode(ids, skip_special_tokens)
            return await asyncio.get_running_loop().run_in_executor(None, chunker.decode, ids, skip_special_tokens)
        except UnknownTokenId as e:
            raise APIError(422, f"model {model}: token {e}") from None

    # --- the pipeline ---

    async def run(self, models: Sequence[str], texts: list[str] | TokenIds, specs: Sequence[CreditSpec | None],
                  deadline: float, gone: Gone | None = None, truncation: Truncation | None = None
                  ) -> list[list[Scored]]:
        """Every text (or list of token ids) on every model (``specs[m]``: the credit model ``m`` computes, None:
        scores only), each text cut to one chunk as ``truncation`` says (None: a long text is chunked whole).

        Returns:
            ``[model][text]`` answers, in the order asked (the text of token ids is ``""``).
        """
        if isinstance(texts, TokenIds) and any(spec is not None for spec in specs):
            raise APIError(422, "credit is shown on a text's characters and words: send texts, not token ids")
        self.check_limits(texts)
        if self.cache is not None:
            await self.cache.bring(models, False)  # again: a head may have left memory since the route brought it in
        groups = [self.group_of(name) for name in models]
        keys = [self.heads[name] for name in models]  # the heads this request holds until it is answered
        started = time.perf_counter()
        try:
            with self.registry.holding(keys):
                out = await self._run(groups, keys, texts, specs, deadline, gone, truncation)
        except BaseException:
            self.stats.answered(models, time.perf_counter() - started, ok=False)
            raise
        finally:
            if self.cache is not None:
                self.cache.released()
        self.stats.answered(models, time.perf_counter() - started, ok=True)
        return out

    async def _run(self, groups: list[BackboneGroup], keys: list[str], texts: list[str] | TokenIds,
                   specs: Sequence[CreditSpec | None], deadline: float, gone: Gone | None,
                   truncation: Truncation | None) -> list[list[Scored]]:
        """:meth:`run` on the heads ``keys[m]`` of ``groups[m]``."""
        by_group: dict[str, list[int]] = {}  # group -> the indices of its heads in ``keys``
        for m, group in enumerate(groups):
            by_group.setdefault(group.planner.name, []).append(m)
        named = {g.planner.name: g for g in groups}
        for name in by_group:
            try:
                named[name].check_room(len(texts))
            except (Overloaded, Draining) as e:
                raise _refused(e) from None
        loop = asyncio.get_running_loop()
        spans = any(spec is not None for spec in specs)  # credit is rendered over the tokens' spans; else ids alone
        plans: list[tuple[BackboneGroup, list[TextJob], list[int]]] = []  # a group's jobs, and each job's text
        encodings: dict[tuple[int, int], Encoding] = {}  # (head, text) -> the encoding it sees
        for name, ms in by_group.items():
            group = named[name]
            planner = group.planner
            heads = [keys[m] for m in ms]
            with tracing.span("tokenize", **{"routing.backbone": name, "routing.texts": len(texts)}):
                try:
                    if isinstance(texts, TokenIds):
                        per_text = planner.encode_ids(texts, heads, truncation)
                    elif sum(map(len, texts)) <= INLINE_CHARS:  # a thread hop would cost more than the tokenizing
                        per_text = planner.encode(texts, heads, truncation, spans)
                    else:
                        per_text = await loop.run_in_executor(None, planner.encode, texts, heads, truncation, spans)
                except BackboneError as e:  # a truncation the tokenizer cannot make
                    raise APIError(422, str(e), details=[{"field": "truncate", "message": str(e),
                                                          "type": "value_error"}]) from None
                except UnknownTokenId as e:
                    raise APIError(422, f"backbone {name}: token {e}") from None
                except NotAChunk as e:
                    raise APIError(422, f"inputs.{e.k} {e}: token ids (sent, or a text's without its special "
                                        "tokens) are read as one chunk; ask for truncation to cut them") from None
            jobs: list[TextJob] = []
            places: list[int] = []
            for t, by_length in enumerate(per_text):
                for m in ms:
                    encodings[(m, t)] = by_length[planner.max_length(keys[m])]
                text_jobs = planner.jobs(by_length, [Ask(keys[m], specs[m]) for m in ms])
                jobs += text_jobs
                places += [t] * len(text_jobs)
            tracing.follow(jobs)  # their batches' spans link to this request's
            plans.append((group, jobs, places))
        self._check_tokens(groups, keys, specs, encodings)
        answers = await self._submit([(g, jobs) for g, jobs, _ in plans], deadline, gone)
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
        tokens = await render.off_loop(lambda: self._tokens(groups, explained)) if explained else {}
        said = texts if isinstance(texts, list) else [""] * len(texts)
        return [[Scored(text, results[(m, t)], encodings[(m, t)], tokens.get(id(encodings[(m, t)])))
                 for t, text in enumerate(said)] for m in range(len(keys))]

    @staticmethod
    def _tokens(groups: Sequence[BackboneGroup], encodings: dict[tuple[int, int], Encoding]
                ) -> dict[int, list[TokenSpan]]:
        """The tokens of each encoding (by identity), built once however many models share it."""
        out: dict[int, list[TokenSpan]] = {}
        for (m, _), enc in encodings.items():
            if id(enc) not in out:
                out[id(enc)] = groups[m].planner.tokens(enc)
        return out

    def _check_tokens(self, groups: Sequence[BackboneGroup], keys: Sequence[str], specs: Sequence[CreditSpec | None],
                      encodings: dict[tuple[int, int], Encoding]) -> None:
        """413 for a text over ``max_text_tokens``, or a full matrix / phi payload over ``max_explain_elements``."""
        cap = self.settings.max_text_tokens
        size = 0
        for (m, t), enc in sorted(encodings.items(), key=lambda kv: kv[0][::-1]):
            if cap is not None and enc.n_tokens > cap:
                raise APIError(413, f"inputs.{t} has {enc.n_tokens} tokens, more than the limit of {cap}")
            spec = specs[m]
            if spec is not None and (spec.matrix or spec.phi):
                size += groups[m].planner.explain_elements(keys[m], enc.n_tokens, spec)
        if size > self.settings.max_explain_elements:
            raise APIError(413, f"include_matrix/include_phi would return {size} numbers, more than the limit of "
                                f"{self.settings.max_explain_elements}; send fewer or shorter texts")

    async def _submit(self, work: list[tuple[BackboneGroup, list[TextJob]]], deadline: float,
                      gone: Gone | None) -> list[list[Answer]]:
        """Submit each group's jobs and wait for them all, the deadline, or the client leaving. Returns each group's
        answers, one per job, in order."""
        tasks = [asyncio.ensure_future(g.submit(jobs, deadline)) for g, jobs in work]
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
        for (group, _), t in zip(work, tasks, strict=True):
            e = t.exception() if t.done() and not t.cancelled() else None
            if isinstance(e, Overloaded | Draining):
                raise _refused(e) from None
            if isinstance(e, DeadlineExceeded):
                raise APIError(504, f"deadline exceeded: {e}") from None
            if e is not None:
                raise APIError(500, f"backbone {group.planner.name} failed on this batch: {type(e).__name__}: {e}"
                               ) from e
        return [t.result() for t in tasks]

    async def score(self, model: str, texts: list[str] | TokenIds, timeout_s: float | None = None,
                    gone: Gone | None = None, truncation: Truncation | None = None) -> list[Scored]:
        """Each text's (or list of token ids') answer from ``model``, scores only (the other APIs' routes shape
        them)."""
        await self.require([model])  # brought in (and counted: once a request)
        (scored,) = await self.run([model], texts, [None], self.deadline(timeout_s), gone, truncation)
        return scored

    async def classify(self, models: Sequence[str], texts: list[str], explain: bool = False,
                       method: Method = "contribution", contrast: bool = True, timeout_s: float | None = None,
                       gone: Gone | None = None, raw_scores: bool = False, truncation: Truncation | None = None
                       ) -> list[list[Body]]:
        """Label and probabilities (``raw_scores``: the head's logits) of each text on each model; with ``explain``,
        token credit of the predicted label. Returns ``[model][text]`` bodies of
        :class:`~service.serving.api.schemas.ClassifyResult`."""
        await self.require(models, count=False)  # the route has brought them in (and counted)
        until = self.deadline(timeout_s)
        specs = [self.credit_spec(m, method=method, contrast=contrast) if explain else None for m in models]
        scored = await self.run(models, texts, specs, until, gone, truncation)
        build = lambda: [[render.classify_result(s.result, s.tokens, raw_scores) for s in per]  # noqa: E731
                         for per in scored]
        with tracing.span("render", **{"routing.texts": len(texts)}):
            return build() if not explain else await render.off_loop(build)

    async def explain(self, models: Sequence[str], texts: list[str], target: Target = None,
                      method: Method = "contribution", contrast: bool = True, matrix: bool = False, phi: bool = False,
                      timeout_s: float | None = None, gone: Gone | None = None, raw_scores: bool = False,
                      truncation: Truncation | None = None) -> list[list[Body]]:
        """Credit per token, word, sentence and depth of the ``target`` label(s) of each text on each model
        (with several models, ``target`` is ``"all"`` or None: each model's own labels). Returns ``[model][text]``
        bodies of :class:`~service.serving.api.schemas.ExplainResult`."""
        if len(models) > 1 and target not in (None, "all"):
            raise APIError(422, "target: with several models only 'all' or none (the predicted label) applies to "
                                "each; name labels with one model",
                           details=[{"field": "target", "message": "labels need one model", "type": "value_error"}])
        await self.require(models, count=False)  # the route has brought them in (and counted)
        until = self.deadline(timeout_s)
        specs = [self.credit_spec(m, target, method, contrast, "full", matrix, phi) for m in models]
        scored = await self.run(models, texts, specs, until, gone, truncation)
        with tracing.span("render", **{"routing.texts": len(texts)}):
            return await render.off_loop(lambda: [[render.explain_result(s.result, s.text, s.tokens or [],
                                                                         s.encoding.word_ids, raw_scores) for s in per]
                                                  for per in scored])


def _refused(e: Overloaded | Draining) -> APIError:
    """The answer when a batcher takes no more texts: 503 with Retry-After."""
    if isinstance(e, Draining):
        return errors.unavailable(errors.SHUTTING_DOWN, "draining")
    return errors.unavailable(f"overloaded, retry later ({e})", "overloaded")
