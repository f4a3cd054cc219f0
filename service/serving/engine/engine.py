"""The engine: one frozen backbone and the heads of every model on it. It runs batches of chunks through
the encoder once, each head on the texts that asked for it, and turns the tensors into plain results.
It knows torch and the models, nothing about HTTP.

A text is planned as one :class:`~service.serving.core.work.ChunkWork` per chunk; batches of chunks (from
any texts, for any heads) run through the encoder, and as soon as a text's last chunk has been encoded,
every head asked of it runs on it, in the same batch, together with the other texts completed there
that asked for the same head. The backbone is frozen, so a head's answer does not depend on which other
heads, or texts, share the batch."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.profiler import record_function

from service.allocator import keep_freed_memory
from service.collector import keep, settle
from service.modeling.backbone import Backbone, BackboneError, Encoded
from service.modeling.buckets import choose_buckets, draw_lengths
from service.modeling.classifier import Classified, RoutingClassifier, classify, scoring
from service.modeling.device import resolve_device, resolve_dtype
from service.modeling.encoder import to_device
from service.modeling.grouping import lay_out, length_groups
from service.modeling.head import HeadSlots, RoutingHead, StackSpace, head_shape, stack_heads
from service.modeling.repository import MANIFEST, Manifest, ModelLoadError, load_model, read_manifest
from service.routing.segments import Products
from service.serving.core.keys import backbone_key
from service.serving.core.results import Answer, Answers, Result, answers_of
from service.serving.core.work import METHODS, ChunkWork, CreditSpec, Task, TextJob
from service.serving.engine.compute import Compute
from service.serving.engine.gather import Stream, block, gather, locate, stream
from service.serving.engine.graphs import BucketRunner, BucketStats
from service.serving.engine.pipe import BucketPlan, RunPlain
from service.serving.engine.readout import HeadCall, credit_request, read_results
from service.serving.engine.scores import read_scores


def _phase(name: str) -> contextlib.AbstractContextManager[object]:
    """A range named ``name`` in a torch profile (``routing-service bench engine`` reads them), and nothing while
    no profiler runs (a range costs about 16 us on a 2-core CPU even then)."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


log = logging.getLogger("service.engine")


def _packed_agrees(head: RoutingHead, device: torch.device, score_dtype: torch.dtype | None = None,
                   products: Products | None = None) -> bool:
    """Whether ``head`` runs packed on ``device`` (the grouped product it needs runs for its dtype and shapes) and
    gives each of two small random texts the scores it gives the text alone (both with its scores' products in
    ``score_dtype``, see :func:`scoring`, through ``products``, or torch's). On a GPU, with torch's products, only in
    bfloat16 (``score_dtype``, or the head's own dtype): torch's grouped kernels are written for it (other dtypes fall
    back to a product per text, reading the offsets back)."""
    dtype = next(head.parameters()).dtype
    if device.type == "cuda" and products is None and (score_dtype or dtype) != torch.bfloat16:
        return False
    lengths = [3, 5]
    hidden = torch.randn(sum(lengths), head.d_depth, head.d_emb, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(device=device, dtype=dtype)  # [T e d]
    with torch.inference_mode(), scoring(device, score_dtype):
        try:
            packed = head.scores_packed(hidden, torch.tensor(lengths, device=device), None, products).float()  # [bk]
        except (RuntimeError, TypeError, ValueError) as e:  # no grouped product here, or not for these operands
            log.debug("packed head: %s", e)
            return False
        alone = torch.cat([head(h[None]).scores.float() for h in hidden.split(lengths)])  # [b k]
    tol = 1e-4 if dtype == torch.float32 and score_dtype is None else 5e-2
    return bool(torch.allclose(packed, alone, rtol=tol, atol=tol))


HEAD_DTYPES: dict[str, torch.dtype | None] = {"float32": None, "bfloat16": torch.bfloat16}
"""The precisions of the heads' scores (:attr:`Engine.head_dtype`): None, no autocast."""


def device_memory() -> list[dict[str, float | str]]:
    """Allocated, reserved, peak and total memory of every CUDA device (empty on CPU): one reading of the caching
    allocator's statistics a device (``memory_allocated``, ``memory_reserved`` and ``max_memory_allocated`` each
    read all of them, built into a dict in Python)."""
    if not torch.cuda.is_available():
        return []
    out = []
    for k in range(torch.cuda.device_count()):
        stats = torch.cuda.memory_stats(k)
        out.append({"device": f"cuda:{k}", "allocated": stats.get("allocated_bytes.all.current", 0),
                    "reserved": stats.get("reserved_bytes.all.current", 0),
                    "peak": stats.get("allocated_bytes.all.peak", 0),
                    "total": torch.cuda.get_device_properties(k).total_memory})
    return out


@dataclass(frozen=True)
class PlannedCall:
    """One head call of a batch as planned: its texts' (position, ask) places, the texts' positions, and whether
    they go packed (back to back, see :meth:`RoutingHead.scores_packed`) or padded to their longest."""

    chosen: list[tuple[int, int]]
    key: tuple[int, ...]
    packed: bool


@dataclass
class Submitted:
    """A batch whose kernels are launched (see :meth:`Engine.submit`): ``size`` chunks, the texts completed in it by
    position, the head calls, every call's scores (logits) flat on the host (in pinned memory on a GPU, filled once
    ``ready``: None where they are there already)."""

    size: int
    done: dict[int, TextJob]
    calls: list[HeadCall]
    logits: torch.Tensor | None
    ready: Any


@dataclass
class Begun:
    """A batch :meth:`Engine.begin` submitted: its chunks, their texts' counts and states before (to run it again in
    parts if the device has no memory for it), what was submitted (or the device's error: it did not fit whole),
    and the engine's clock over its submission (wall, forward, encoder seconds)."""

    works: list[ChunkWork]
    held: list[tuple[TextJob, int, list[Any]]]
    submitted: Submitted | torch.OutOfMemoryError
    clock: tuple[float, float, float]


@dataclass
class PlainBegun:
    """A plain batch :meth:`Engine.begin_plain` submitted: its scores' copy to the host (``logits [s k]`` flat, filled
    once ``ready``: None where they are there already), the texts' order in it (sorted by head slot; None: as they
    came) and the engine's clock over its submission."""

    logits: torch.Tensor
    ready: Any
    rows: int
    order: np.ndarray | None
    clock: tuple[float, float, float]


@dataclass
class EngineClock:
    """Where the batches' time went, since the engine started (``routing-service bench gpu`` reads it): ``wall_s`` in
    :meth:`Engine.run_chunks` in all, ``forward_s`` of it in the encoder's and heads' forward calls and waiting for
    the device's answer (on a GPU: launching kernels, then the copy back). The rest is the host's own work: packing
    the batch, gathering each text's states, reading the results."""

    batches: int = 0
    wall_s: float = 0.0
    forward_s: float = 0.0

    @property
    def host_s(self) -> float:
        return self.wall_s - self.forward_s


class NonFiniteScores(RuntimeError):
    """The model produced NaN or Inf scores: a fault of the model, never an answer."""


def load_backbone(folders: Sequence[Path], device: torch.device, dtype: torch.dtype, keys: Sequence[str] | None = None
                  ) -> tuple[list[Manifest], dict[str, RoutingClassifier]]:
    """Read every model folder, load their shared backbone once and each head onto it (``keys``: each head's key,
    by default its model's name).

    Raises:
        ModelLoadError: a folder is damaged, its backbone cannot load, or the folders name different backbones.
    """
    manifests = [read_manifest(Path(f)) for f in folders]
    first = manifests[0]
    for f, m in zip(folders, manifests, strict=True):
        if backbone_key(m) != backbone_key(first):
            raise ModelLoadError(Path(f) / MANIFEST, f"backbone {backbone_key(m)} differs from {first.name}'s "
                                 f"{backbone_key(first)}; load it on a backbone of its own")
    try:  # chunks as long as the backbone allows: each head cuts texts at its own max_length
        backbone = Backbone(first.backbone.source, max_length=None, device=device, dtype=dtype)
    except BackboneError as e:
        raise ModelLoadError(Path(folders[0]) / MANIFEST, f"unknown or unloadable backbone: {e}") from e
    return manifests, load_heads(folders, keys or [m.name for m in manifests], backbone)


def load_heads(folders: Sequence[Path], keys: Sequence[str], backbone: Backbone) -> dict[str, RoutingClassifier]:
    """The heads of ``folders`` on ``backbone``, by key (each folder validated; see ``load_model``)."""
    return {k: load_model(Path(f), device=backbone.device, dtype=backbone.dtype, backbone=backbone)[1]
            for f, k in zip(folders, keys, strict=True)}


class Engine(Compute):
    """A backbone and its heads, loaded and ready to serve batches, in this process."""

    def __init__(self, manifests: Sequence[Manifest], classifiers: dict[str, RoutingClassifier],
                 device: torch.device, dtype: torch.dtype, load_seconds: float) -> None:
        backbone = next(iter(classifiers.values())).backbone
        super().__init__(manifests, backbone.chunker, list(classifiers))
        self.backbone, self.classifiers, self.device, self.dtype = backbone, classifiers, device, dtype
        self.load_seconds = load_seconds
        self.head_seconds = dict.fromkeys(classifiers, load_seconds)  # head key -> time to load (and warm up) it
        self.gather_heads = False
        """Texts of different heads (of one shape) in one head call on their heads' stacked parameters, instead of
        one call per head. Slower on this CPU at every mix (32 texts of 32 heads: 62 ms against 59 ms; of 4 heads:
        60 against 40); ``routing-service bench heads`` measures both."""
        self._stack_space = StackSpace()
        self.packed_heads = True
        """Texts that ask for no credit run their head packed, back to back, in one call per head (the first routing's
        contractions over each text's inputs as grouped matrix products), where that product runs on this device
        and dtype (:meth:`_packs`); otherwise, and for credit (which reads padded tensors), in padded length groups.
        """
        self.head_dtype = "float32"
        """The precision of the heads' scores: ``"float32"``, or ``"bfloat16"``: their matrix products in bfloat16
        with float32 accumulation (``torch.autocast``; norms, softmaxes and reductions stay in float32), on tensor
        cores on a GPU. Credit is computed from a float32 pass whatever this says, so it still adds up to the
        logits it explains (a text asking for credit costs one more head pass). ``routing-service bench gpu
        --variant head_dtype=bfloat16`` measures it against float32; the tests state how far its scores move.
        ``use_buckets("cuda")`` sets it to bfloat16."""
        self._packable: dict[tuple[tuple[int, ...], str, str], bool] = {}  # (head shape, head_dtype, invariance) ->
        # packed agrees
        self._buckets: BucketRunner | None = None  # see use_buckets
        self.one_head_buckets = True
        """Shape buckets (:meth:`use_buckets`) with a second computation each for batches whose texts all ask one
        head: its parameters broadcast, not gathered for every text (:mod:`~service.serving.engine.graphs`); twice
        the captures at warm-up. ``routing-service bench gpu --variant one_head_buckets=false`` measures it."""
        self._invariance = "off"  # see batch_invariance
        self.clock = EngineClock()
        self.head_batch_positions = backbone.chunk_batch_tokens * (1 if device.type == "cpu" else 4)
        """Padded positions (texts x their longest) per head call. On a GPU larger than the encoder's budget: a
        head call costs about a hundred kernel launches, a padded position little."""
        self.head_call_overhead = 2 * backbone.call_overhead if device.type == "cpu" else 8192
        """What one more head call costs, in padded positions, when texts are cut into length groups. On the CPU
        2.4 ms a call against 0.018 ms a padded position (128). On a GPU the host launching the calls' kernels is
        the limit: 8,192 cut batches of 456 tweets into fewer calls than 2,048 did, 371 kernels a batch against
        495, and 13.3 against 10.2 thousand tweets/s at 4,096-token batches, 15.8 against 15.7 at 16,384 (an H200,
        bench gpu --variant, bench-results/gpu-h200-2.json)."""

    @classmethod
    def load(cls, folders: Path | Sequence[Path], device: str = "auto", dtype: str = "auto",
             warmup: bool = True, keys: Sequence[str] | None = None, buckets: BucketPlan | None = None,
             batch_invariance: str = "off") -> Engine:
        """Load the models of ``folders`` (one folder, or several naming the same backbone) on one backbone,
        each head under its key in ``keys`` (by default its model's name); with ``buckets``, its plain batches in
        shape buckets from the start (see :meth:`use_buckets`; ``auto``: captured where that can be, else none);
        ``batch_invariance`` set before the warm-up (see :attr:`batch_invariance`).

        Raises:
            ValueError: ``buckets`` or ``batch_invariance`` asks for what this device or backbone cannot do
                (``cuda`` without a GPU, a backbone the packed encoder does not know, kernels without Triton).
        """
        t0 = time.perf_counter()
        folders = [folders] if isinstance(folders, Path | str) else list(folders)
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        if dev.type == "cpu":  # batches reuse the pages the one before freed (on a GPU: the caching allocator's)
            keep_freed_memory()
        manifests, classifiers = load_backbone(folders, dev, dt, keys)
        engine = cls(manifests, classifiers, dev, dt, 0.0)
        if batch_invariance != "off":  # (its kernels compiled by the warm-up, before ready)
            engine.batch_invariance = batch_invariance
        if warmup:
            engine._warm_up(engine.models)
        if buckets is not None:
            mode = buckets.mode
            if mode == "auto":
                mode = "cuda" if dev.type == "cuda" and dt == torch.bfloat16 and engine.backbone.stream else "off"
            engine.use_buckets(mode, max_texts=buckets.max_texts, budget=buckets.budget)
        settle()  # what was loaded, out of every garbage collection from now on (see service.collector)
        engine.load_seconds = time.perf_counter() - t0
        engine.head_seconds = dict.fromkeys(engine.models, engine.load_seconds)
        return engine

    def _warm_up(self, keys: Sequence[str]) -> None:
        """One batch on each head of ``keys``: without credit (the packed head, tried there once per shape), and with
        both kinds of credit.

        Raises:
            NonFiniteScores: a head's scores were not finite.
        """
        full, shares = CreditSpec(detail="full"), CreditSpec(method="shares", detail="full")
        tasks = [Task(text, model=k, credit=c) for k in keys
                 for text, c in (("warm up the model", None), ("and its credit", full),
                                 ("and its routing shares", shares))]
        failed = [r.error for r in self.run(tasks) if r.error]
        if failed:
            raise NonFiniteScores(f"a model on backbone {self.name} failed its warm-up: {failed[0]}")

    def add_heads(self, folders: Sequence[Path], keys: Sequence[str], warmup: bool = True) -> None:
        t0 = time.perf_counter()
        manifests = {k: read_manifest(Path(f)) for f, k in zip(folders, keys, strict=True)}
        for f, m in zip(folders, manifests.values(), strict=True):
            if backbone_key(m) != self.key:
                raise ModelLoadError(Path(f) / MANIFEST, f"backbone {backbone_key(m)} differs from this backbone's "
                                     f"{self.key}; it loads on a backbone of its own")
        self.classifiers = {**self.classifiers, **load_heads(folders, keys, self.backbone)}
        self.add(manifests)
        if self._buckets is not None:  # into free slots of the captured buckets' stacked head: nothing captured again
            slots = self._buckets.slots
            for k in keys:
                if head_shape(self.classifiers[k].head) == slots.shape:
                    slots.put(k, self.classifiers[k].head)
                else:  # a head reloaded in another shape: its old slot must not answer for it
                    slots.drop(k)
        if warmup:
            try:
                self._warm_up(keys)
            except Exception:
                self.remove_heads(keys)
                raise
        keep()  # the new heads, out of every garbage collection too (see service.collector)
        self.head_seconds.update(dict.fromkeys(keys, time.perf_counter() - t0))

    def remove_heads(self, keys: Sequence[str]) -> None:
        self.remove(keys)
        self.classifiers = {k: c for k, c in self.classifiers.items() if k not in keys}
        self.head_seconds = {k: t for k, t in self.head_seconds.items() if k not in keys}
        if self._buckets is not None:
            for k in keys:
                self._buckets.slots.drop(k)

    def use_buckets(self, mode: str, lengths: Sequence[int] | None = None, max_texts: int = 1024,
                    budget: int | None = None, capacity: int = 64, count: int = 32, deadline_s: float = 20.0
                    ) -> BucketStats | None:
        """Plain batches (every text one chunk, one head, no credit) in shape buckets from now on (``mode``: ``cuda``
        captures them as CUDA graphs, ``eager`` pads without capturing, ``off`` stops; see
        :mod:`~service.serving.engine.graphs`); other batches, and those that fit no bucket, run as before.

        The buckets are chosen for chunk ``lengths`` like the traffic's (by default drawn from the lengths the
        models' manifests keep, see :meth:`_length_sample`), batches of up to ``budget`` tokens (by default the
        backbone's) and ``max_texts`` texts (:func:`~service.modeling.buckets.choose_buckets`, ``count`` of them),
        warmed (captured) until ``deadline_s``. The heads of the default model's shape go into ``capacity`` slots of
        stacked parameters, and heads added later into free ones, so that nothing is captured again; a head that
        finds no free slot, or of another shape, runs eagerly. Returns what the warm-up did (None with ``off``).

        With ``cuda`` the heads compute their matrix products in bfloat16 from then on (:attr:`head_dtype`), on every
        batch, captured or not (so that no answer depends on which path its batch took): torch's grouped products on
        a GPU read the groups of other dtypes back to the host, which a graph cannot capture.

        Raises:
            ValueError: ``cuda`` without a CUDA device, or a backbone the packed encoder does not know.
        """
        if mode == "off":
            self._buckets = None
            return None
        like = self.classifiers[self.default].head
        slots = HeadSlots(like, capacity)
        for key, clf in self.classifiers.items():
            if head_shape(clf.head) == slots.shape:
                slots.put(key, clf.head)
        sample = list(lengths) if lengths is not None else self._length_sample(list(slots.slot_of))
        bb = self.backbone
        buckets = choose_buckets(sample, budget or bb.chunk_batch_tokens, max_texts, bb.max_length, count)
        dtype = torch.bfloat16 if mode == "cuda" else self.score_dtype  # the dtype of the heads' products
        runner = BucketRunner(bb, slots, buckets, mode, dtype, self.one_head_buckets,
                              self.head_products)  # (raises before anything here has changed)
        if dtype != self.score_dtype:
            log.info("backbone %s: the heads' products in bfloat16, as captured buckets need", self.name)
            self.head_dtype = "bfloat16"
        stats = runner.warm(deadline_s)
        self._buckets = runner
        log.info("backbone %s: %d shape buckets (%s) warmed in %.1f s", self.name, len(runner.buckets), mode,
                 stats.capture_s)
        return stats

    def _length_sample(self, keys: list[str]) -> list[int]:
        """Chunk lengths like the traffic's: drawn from the training texts' lengths each model of ``keys`` keeps in
        its manifest (``token_lengths``), as many of each; without any, every length from 4 to 128 alike."""
        kept = [m.token_lengths for k in keys if (m := self.manifests[k]).token_lengths]
        if not kept:
            log.warning("backbone %s: no model keeps its texts' lengths (train it again to have them); shape "
                        "buckets are chosen for every length from 4 to 128 tokens alike", self.name)
            return list(range(4, 129))
        return [n for q in kept for n in draw_lengths(q, 4000 // len(kept) + 1)]

    @property
    def batch_invariance(self) -> str:
        """How much of a text's computation is kept from depending on the rest of its batch, beyond float32's
        (where any order agrees within 1e-5):

        - ``"off"``: the libraries' choices (cuBLAS picks a kernel by the product's shape, and may add the parts of
          a split sum in bfloat16);
        - ``"reductions"``: the parts of a split sum of a bfloat16 product added in float32 (cuBLAS's, for the
          whole process: ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` False);
        - ``"kernels"``: that, and the encoder's linear layers through one Triton kernel with one tiling, every
          token's outputs summed in the same order whatever the batch, its attention through one kernel whatever
          the shapes, masked or not, and the packed heads' products through Triton kernels of one tiling
          (:attr:`head_products`): a text's scores the same to the bit alone and in any batch, on the paths that
          classify without credit (:mod:`service.modeling.invariant`; a CUDA device, or Triton's interpreter on a
          CPU). Credit, and a head that does not run packed, still compute with torch's products.

        Set before :meth:`use_buckets` (captured graphs keep the kernels they captured). ``routing-service bench gpu
        --invariance batch_invariance=...`` measures how far each moves a text's probabilities between a batch of
        its own and mixed ones, and what it costs.

        Raises (on setting):
            ValueError: an unknown value; ``kernels`` where Triton cannot run or the backbone has no packed
                encoder; any value once buckets are in use.
        """
        return self._invariance

    @batch_invariance.setter
    def batch_invariance(self, value: str) -> None:
        from service.modeling import invariant  # (Triton itself is imported on the kernel's first use)

        if value not in ("off", "reductions", "kernels"):
            raise ValueError(f"batch_invariance {value!r}: one of off, reductions, kernels")
        if self._buckets is not None:
            raise ValueError("batch_invariance is set before use_buckets: captured graphs keep their kernels")
        stream = self.backbone.stream
        if value == "kernels":
            why = invariant.available(self.device)
            if why is None and stream is None:
                why = f"backbone {self.name} has no packed encoder, whose linear layers the kernel replaces"
            if why is not None:
                raise ValueError(f"batch_invariance kernels: {why}")
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = value == "off"
        if stream is not None:
            if value == "kernels":
                stream.use_kernels(invariant.linear, invariant.attention)
            else:
                stream.use_kernels()
        self._invariance = value

    @property
    def head_products(self) -> Products | None:
        """The matrix products the packed heads compute with (:class:`~service.routing.segments.Products`), as
        :attr:`batch_invariance` says: the invariant kernels' with ``kernels``, else None (torch's)."""
        from service.modeling import invariant

        return invariant.PRODUCTS if self._invariance == "kernels" else None

    @property
    def bucket_stats(self) -> BucketStats | None:
        """What the shape buckets have done (None while they are off)."""
        return None if self._buckets is None else self._buckets.stats

    def describe(self, model: str) -> dict[str, Any]:
        m, clf = self.manifests[model], self.classifiers[model]
        return {
            "name": m.name, "task": m.task, "description": m.description,
            "labels": m.labels, "problem_type": m.problem_type, "backbone": m.backbone.model_dump(),
            "head": m.head.model_dump(), "max_length": self.max_length(model),
            "parameters": {"head": sum(p.numel() for p in clf.head.parameters()),
                           "backbone": sum(p.numel() for p in self.backbone.parameters())},
            "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
            "evaluation": m.evaluation, "load_seconds": round(self.head_seconds.get(model, self.load_seconds), 3),
            "credit_methods": self.credit_methods(model),
        }

    def credit_methods(self, model: str) -> list[str]:
        """Every method, but end to end only on an encoder whose layers it knows (:attr:`Backbone.stream`)."""
        return [m for m in METHODS if m != "end_to_end" or self.backbone.stream is not None]

    def run(self, tasks: list[Task]) -> list[Result]:
        """Classify a batch of whole texts, each on its own head (every chunk in this one call)."""
        plain = self._begin_plain(tasks)
        if plain is not None:
            return plain()
        chunks = self._chunks(tasks)
        return [answer[0] for answer in answers_of(chunks, self.run_chunks(chunks))]

    def _begin_plain(self, tasks: list[Task]) -> Callable[[], list[Result]] | None:
        """Whole texts submitted as a plain batch of arrays (:meth:`begin_plain`, no object a text) where each is
        tokenized already into one chunk and asks no credit, and the batch runs in a shape bucket: the function that
        completes it and reads the results. None otherwise (nothing submitted: the texts go as chunks)."""
        if self._buckets is None:
            return None
        texts = []
        for t in tasks:
            if t.encoding is None or len(t.encoding.chunks) != 1 or t.credit is not None:
                return None
            texts.append((t.encoding.chunks[0], t.model))
        batch = RunPlain.of(texts, [])
        begun = self.begin_plain(batch.ids, batch.lengths, batch.head, batch.heads)
        if begun is None:
            return None
        keys = [t.model or self.default for t in tasks]
        return lambda: read_scores(self.complete_plain(begun)[0], keys, self.manifests)

    def _chunks(self, tasks: list[Task]) -> list[ChunkWork]:
        """The chunks of whole texts, in order (see :meth:`plan`)."""
        with _phase("engine.plan"):
            return [w for plan in self.plan(tasks) for w in plan]

    @torch.inference_mode()
    def run_chunks(self, works: list[ChunkWork]) -> Answers:
        """Encode a batch of chunks once, as one packed token stream; run each head on every text completed here
        that asked for it (packed, or in length groups: see :meth:`_plan_calls`) and answer each such text at its
        last chunk's place. The other places are None. The answers carry the batch's phases (see :class:`Answers`),
        from the engine's clock.

        A batch the device has no memory for is split in two and each half run in turn (and so on); a chunk that
        does not fit even alone fails its text only, answered ``unavailable`` (the server says 503: retry)."""
        return self.complete(self.begin(works))

    @torch.inference_mode()
    def begin(self, works: list[ChunkWork]) -> Begun:
        """The first half of :meth:`run_chunks`: the batch submitted (see :meth:`submit`), so that another may be
        begun before this one is completed (a backbone's process with two batches in flight)."""
        held = [(w.job, w.job.left, list(w.job.states)) for w in works]
        clock = self._clock_now()
        submitted: Submitted | torch.OutOfMemoryError
        try:
            submitted = self.submit(works)
        except torch.OutOfMemoryError as e:  # completed in parts (see complete)
            self._restore(held)
            submitted = e
        return Begun(works, held, submitted, self._clock_since(clock))

    @torch.inference_mode()
    def complete(self, begun: Begun) -> Answers:
        """The second half of :meth:`run_chunks`: the batch's answers, with its phases (this batch's own time in
        :meth:`begin` and here, not another batch's begun between them)."""
        clock = self._clock_now()
        answers = self._answers(begun)
        return Answers(answers, self._phases(begun.clock, clock))

    def _phases(self, begun: tuple[float, float, float], clock: tuple[float, float, float]) -> dict[str, float]:
        """A batch's phases (see :class:`Answers`): the engine's clock over its submission (``begun``) and since
        ``clock``, when its completion started."""
        wall, forward, encode = (a + b for a, b in zip(begun, self._clock_since(clock), strict=True))
        return {"encode": encode, "heads": max(forward - encode, 0.0), "host": max(wall - forward, 0.0)}

    @torch.inference_mode()
    def begin_plain(self, ids: np.ndarray, lengths: np.ndarray, head: np.ndarray, heads: Sequence[str | None]
                    ) -> PlainBegun | None:
        """A plain batch given as arrays, submitted in its shape bucket with no object a text (a backbone's process
        receives it so): token ids ``ids [T]`` back to back, ``lengths [s]``, text ``t`` on head ``heads[head[t]]``
        (None: the default). None where it cannot run so (no buckets, a head outside the slots, no bucket fits, or
        the device had no memory for it): nothing was launched, and the caller runs it as chunks."""
        clock, t0 = self._clock_now(), time.perf_counter()
        try:
            launched = self._bucket_launch(ids, lengths, head, heads)
            if launched is None:
                return None
            logits, order = launched
            host, ready = self._to_host(logits.flatten())  # [s k] flat
        except torch.OutOfMemoryError:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return None
        finally:
            self.clock.wall_s += time.perf_counter() - t0
        return PlainBegun(host, ready, len(lengths), order, self._clock_since(clock))

    def _bucket_launch(self, ids: np.ndarray, lengths: np.ndarray, head: np.ndarray, heads: Sequence[str | None]
                       ) -> tuple[torch.Tensor, np.ndarray | None] | None:
        """A plain batch launched in its shape bucket (arrays as :meth:`begin_plain` takes them), its texts sorted by
        head slot: ``logits [s k]`` on the device in that order, and the order (None: as they came). None where it
        cannot run there (no buckets, or captured for another head precision, a head outside the slots or not loaded,
        no bucket fits): nothing was launched."""
        runner = self._buckets
        if runner is None or runner.head_dtype != self.score_dtype:
            return None
        slot_of = runner.slots.slot_of
        keys = [key or self.default for key in heads]
        if any(key not in slot_of or key not in self.manifests for key in keys):
            return None
        slot = np.array([slot_of[key] for key in keys], dtype=np.int64)[head]  # [s]
        lengths = lengths.astype(np.int64, copy=False)  # [s]
        ids = ids.astype(np.int64, copy=False)  # [T]
        order = None
        if len(slot) > 1 and (slot[1:] < slot[:-1]).any():  # texts of several heads: sorted by slot
            order = np.argsort(slot, kind="stable")  # [s]
            starts = np.cumsum(lengths) - lengths  # [s] each text's first token
            n = lengths[order]  # [s]
            ids = ids[np.repeat(starts[order] - (np.cumsum(n) - n), n) + np.arange(len(ids))]  # [T] in that order
            lengths, slot = n, slot[order]
        forward0 = runner.stats.forward_s
        with _phase("engine.bucket"):
            logits = runner.run(ids, lengths, slot)  # [s k] in that order
        self.clock.forward_s += runner.stats.forward_s - forward0
        return None if logits is None else (logits, order)

    @staticmethod
    def computed(begun: Begun | PlainBegun) -> bool:
        """Whether a begun batch's scores are on the host already (its device's work done; always where nothing was
        left to wait for, as on a CPU): completing it now would not wait."""
        ready = begun.ready if isinstance(begun, PlainBegun) else getattr(begun.submitted, "ready", None)
        return ready is None or bool(ready.query())

    def complete_plain(self, begun: PlainBegun) -> tuple[np.ndarray, dict[str, float]]:
        """A :meth:`begin_plain` batch's scores, ``logits [s k]`` in the order its texts came, and its phases."""
        clock, t0 = self._clock_now(), time.perf_counter()
        try:
            if begun.ready is not None:  # waiting for the device: its time, not the host's
                begun.ready.synchronize()
                self.clock.forward_s += time.perf_counter() - t0
            got = begun.logits.numpy().reshape(begun.rows, -1)  # [s k]
            logits = np.empty_like(got)  # [s k] a copy: the pinned buffer goes back to torch's cache
            logits[slice(None) if begun.order is None else begun.order] = got
        finally:
            self.clock.batches += 1
            self.clock.wall_s += time.perf_counter() - t0
        return logits, self._phases(begun.clock, clock)

    def _clock_now(self) -> tuple[float, float, float]:
        """The engine's clock (wall, forward) and the encoder's seconds so far."""
        return self.clock.wall_s, self.clock.forward_s, self.backbone.forward_seconds

    def _clock_since(self, then: tuple[float, float, float]) -> tuple[float, float, float]:
        now = self._clock_now()
        return now[0] - then[0], now[1] - then[1], now[2] - then[2]

    def _restore(self, held: list[tuple[TextJob, int, list[Any]]]) -> None:
        """Texts' chunk counts and states as before an attempt the device had no memory for."""
        for job, left, states in held:
            job.left, job.states = left, states
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _answers(self, begun: Begun) -> list[Answer | None]:
        """A begun batch's answers; where the device had no memory for it, its halves' (see :meth:`_split`)."""
        if isinstance(begun.submitted, torch.OutOfMemoryError):
            return self._split(begun.works, begun.submitted)
        try:
            return self.finish(begun.submitted)
        except torch.OutOfMemoryError as e:
            self._restore(begun.held)
            return self._split(begun.works, e)

    def _split(self, works: list[ChunkWork], e: torch.OutOfMemoryError) -> list[Answer | None]:
        """A batch the device had no memory for, in two halves run in turn; a chunk alone fails its text."""
        if len(works) > 1:
            log.warning("backbone %s: out of memory for a batch of %d chunks (%d tokens): split in two",
                        self.name, len(works), sum(len(w.ids) for w in works))
            half = len(works) // 2
            return self._answers(self.begin(works[:half])) + self._answers(self.begin(works[half:]))
        (w,) = works
        job = w.job
        job.failed = f"the device ran out of memory for this text's chunk of {len(w.ids)} tokens alone: {e}"
        log.error("backbone %s: %s", self.name, job.failed)
        job.left -= 1
        if job.left:  # answered once its last chunk comes (see _submit)
            return [None]
        job.states = []
        return [[Result(label="", scores={}, error=job.failed, unavailable=True) for _ in job.asks]]

    def run_pipelined(self, batches: Iterable[list[Task]]) -> Iterator[list[Result]]:
        """Each batch's results, as :meth:`run` gives them, with two batches in flight: batch ``k + 1`` is packed and
        its kernels launched while batch ``k`` computes, and ``k``'s results are read while ``k + 1`` computes (on a
        GPU; on a CPU it computes as it is launched)."""
        pending: Callable[[], list[Result]] | None = None
        for tasks in batches:
            following = self._begin_plain(tasks) or self._submitted(tasks)
            if pending is not None:
                yield pending()
            pending = following
        if pending is not None:
            yield pending()

    def _submitted(self, tasks: list[Task]) -> Callable[[], list[Result]]:
        """Whole texts submitted as chunks (:meth:`submit`): the function that finishes them and gives their
        results."""
        chunks = self._chunks(tasks)
        submitted = self.submit(chunks)
        return lambda: [answer[0] for answer in answers_of(chunks, self.finish(submitted))]

    @torch.inference_mode()
    def submit(self, works: list[ChunkWork]) -> Submitted:
        """The first half of :meth:`run_chunks`: the batch packed, its encoder and head kernels launched and the copy
        of its scores to the host begun; :meth:`finish` waits for them and reads the results."""
        t0, forward0 = time.perf_counter(), self.backbone.forward_seconds
        try:
            with _phase("engine.submit"):
                return self._submit(works)
        finally:
            self.clock.wall_s += time.perf_counter() - t0
            self.clock.forward_s += self.backbone.forward_seconds - forward0

    def finish(self, submitted: Submitted) -> list[Answer | None]:
        """The results of a :meth:`submit` ted batch, each text's answer at its last chunk's place."""
        t0 = time.perf_counter()
        try:
            with _phase("engine.finish"):
                if submitted.ready is not None:  # waiting for the device: its time, not the host's
                    submitted.ready.synchronize()
                    self.clock.forward_s += time.perf_counter() - t0
                with _phase("engine.results"):
                    results = read_results(submitted.calls, submitted.done, submitted.logits, self.manifests)
                return [results.get(pos) for pos in range(submitted.size)]
        finally:
            self.clock.batches += 1
            self.clock.wall_s += time.perf_counter() - t0

    def _submit(self, works: list[ChunkWork]) -> Submitted:
        if self._buckets is not None:
            bucketed = self._submit_bucketed(works)
            if bucketed is not None:
                return bucketed
        lengths = np.fromiter((len(w.ids) for w in works), dtype=np.int64, count=len(works))  # [c]
        done: dict[int, TextJob] = {}  # position in the batch -> text completed there
        for pos, w in enumerate(works):
            w.job.states[w.k] = pos  # a chunk of this batch: its place in the batch
            w.job.left -= 1
            if w.job.left == 0:
                done[pos] = w.job
        failed = {pos: job for pos, job in done.items() if job.failed}
        done = {pos: job for pos, job in done.items() if not job.failed}
        plan = self._plan_calls(done)
        # a text of one chunk is written by the encoder where its first head call reads it, padded among that call's
        # texts (a block); the other calls (a text read twice, or again, or of several chunks) gather their texts'
        # states from where they lie
        blocks: dict[tuple[int, ...], int] = {}  # texts (positions) read in place -> their block
        placed: set[int] = set()
        for call in plan:
            key = call.key
            if (not call.packed and key not in blocks and len(set(key)) == len(key) and placed.isdisjoint(key)
                    and all(len(done[pos].states) == 1 for pos in key)):
                blocks[key] = len(blocks)
                placed.update(key)
        layout = lay_out(lengths, list(blocks))
        where, earlier = locate(layout, lengths, done)
        with _phase("engine.encode"):
            ids = np.fromiter(itertools.chain.from_iterable(w.ids for w in works), dtype=np.int64,
                              count=int(lengths.sum()))  # [T]
            rows = self.backbone.run_stream(ids, lengths, layout.dest,
                                            layout.rows + sum(len(st) for st in earlier))  # [R e d]
        with _phase("engine.join"):
            if earlier:  # the held chunks of texts completed here, after this batch's rows
                torch.cat(earlier, out=rows[layout.rows :])  # [R' e d]
            if len(layout.pad_rows):  # padding holds zeros (finite, and the head masks it): written, not copied
                rows.index_fill_(0, to_device([layout.pad_rows], rows.device), 0.0)  # [P e d] of [R e d]
            for pos, w in enumerate(works):
                if w.job.left:  # the text goes on in a later batch: its chunk's states kept (a copy: not the batch's)
                    first = int(layout.first[pos])
                    w.job.states[w.k] = rows[first : first + lengths[pos]].clone()  # [L_c e d]
            # every call's states before any head runs: the host's work together, not after each call's (the CPU's
            # caches hold the head's tensors then, and the host's small steps ran several times slower there)
            joined: dict[tuple[tuple[int, ...], bool], Encoded | Stream] = {}  # texts (positions) -> their states
            for call in plan:
                key = call.key
                if (key, call.packed) in joined:  # heads asked of the same texts read the same states
                    continue
                if call.packed:
                    joined[key, True] = stream(rows, [where[pos] for pos in key])
                    continue
                encodings = [done[pos].encoding for pos in key]
                joined[key, False] = (block(rows, layout.blocks[blocks[key]], lengths[list(key)], encodings)
                                      if key in blocks else gather(rows, [where[pos] for pos in key], encodings))
        calls: list[HeadCall] = []
        for call in plan:
            asks = [done[pos].asks[a] for pos, a in call.chosen]
            heads = [ask.model or self.default for ask in asks]
            states = joined[call.key, call.packed]
            pred = (self._heads_packed(heads[0], states) if isinstance(states, Stream) else
                    self._heads(heads, states, [ask.credit for ask in asks]))
            calls.append((call.chosen, heads, pred))
        for job in done.values():
            job.states = []  # the hidden states are no longer needed
        return self._launched(len(works), done, calls, failed)

    def _launched(self, size: int, done: dict[int, TextJob], calls: list[HeadCall], failed: dict[int, TextJob]
                  ) -> Submitted:
        """A batch whose head calls are launched: their scores' copy to the host begun, and the texts that failed
        before (by position) answered with why."""
        live = [c[2].logits.flatten() for c in calls if c[2] is not None]
        logits, ready = None, None
        if live:  # every call's scores to the host in one copy (heads differ in labels: flat, one after another)
            logits, ready = self._to_host(torch.cat(live))  # [sum b k]
        for pos, job in failed.items():  # answered with why, no head run
            job.states = []
            calls.append(([(pos, a) for a in range(len(job.asks))], [a.model or self.default for a in job.asks], None))
            done[pos] = job
        return Submitted(size, done, calls, logits, ready)

    @staticmethod
    def _to_host(on_device: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Scores on their way to the host: from a GPU a copy into pinned memory begun, and the event that marks it
        done (waited for when the batch is completed); elsewhere the tensor itself, and None."""
        if not on_device.is_cuda:
            return on_device, None
        host = torch.empty(on_device.shape, dtype=on_device.dtype, pin_memory=True)
        host.copy_(on_device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def _submit_bucketed(self, works: list[ChunkWork]) -> Submitted | None:
        """A plain batch (see :meth:`use_buckets`) launched in its shape bucket, sorted by head slot; None where it is
        not plain or fits no bucket (nothing has changed then)."""
        if not all(w.job.left == 1 and w.job.plain for w in works):
            return None
        batch = RunPlain.of([(w.ids, w.job.asks[0].model) for w in works], [])
        launched = self._bucket_launch(batch.ids, batch.lengths, batch.head, batch.heads)
        if launched is None:
            return None
        logits, order = launched  # [s k] sorted by slot
        for w in works:
            job = w.job
            job.left, job.states = 0, []
        # answered at the positions the texts came in
        positions = list(range(len(works))) if order is None else order.tolist()
        done = {pos: works[pos].job for pos in positions}
        keys = [done[pos].asks[0].model or self.default for pos in positions]
        pred = Classified(logits=logits, encoded=None, explained=[None] * len(works))
        return self._launched(len(works), done, [([(p, 0) for p in positions], keys, pred)], {})

    def _plan_calls(self, done: dict[int, TextJob]) -> list[PlannedCall]:
        """The head calls for the texts completed in a batch (by position): the texts that share a head call (see
        :meth:`_bucket`), those asking for no credit of a head that runs packed in one call (or a few, within
        ``head_batch_positions`` positions each; where there are two at least), the others in length groups."""
        buckets: dict[object, list[tuple[int, int]]] = {}  # texts whose heads run together
        for pos, job in done.items():
            for a, ask in enumerate(job.asks):
                buckets.setdefault(self._bucket(ask.model or self.default), []).append((pos, a))
        plan = []
        for bucket, places in buckets.items():
            packed: list[tuple[int, int]] = []
            if isinstance(bucket, str) and self._packs(bucket):
                plain = [(pos, a) for pos, a in places if done[pos].asks[a].credit is None]
                # one text alone has no padding: the padded head is the same, with less to set up (but for products
                # computed the same way whatever the batch, the packed head's)
                if len(plain) > 1 or (plain and self.head_products is not None):
                    packed = plain
                    places = [(pos, a) for pos, a in places if done[pos].asks[a].credit is not None]
            chosen: list[tuple[int, int]] = []
            taken = 0
            for place in packed:  # calls within the positions' budget, texts in order
                n = done[place[0]].encoding.n_tokens
                if chosen and taken + n > self.head_batch_positions:
                    plan.append(PlannedCall(chosen, tuple(pos for pos, _ in chosen), packed=True))
                    chosen, taken = [], 0
                chosen.append(place)
                taken += n
            if chosen:
                plan.append(PlannedCall(chosen, tuple(pos for pos, _ in chosen), packed=True))
            for group in self._head_groups([done[pos].encoding.n_tokens for pos, _ in places]):
                chosen = [places[g] for g in group]
                plan.append(PlannedCall(chosen, tuple(pos for pos, _ in chosen), packed=False))
        return plan

    def _packs(self, key: str) -> bool:
        """Whether head ``key`` runs packed here (``packed_heads`` on, and the grouped product runs on this device and
        dtype and agrees with the padded head: tried once per head shape and :attr:`head_dtype` on two small texts)."""
        clf = self.classifiers.get(key)
        if not self.packed_heads or clf is None:
            return False
        tried = (head_shape(clf.head), self.head_dtype, self._invariance)
        if tried not in self._packable:
            self._packable[tried] = _packed_agrees(clf.head, self.device, self.score_dtype, self.head_products)
            if not self._packable[tried]:
                log.info("backbone %s: heads of shape %s run padded with %s scores (the packed head does not run "
                         "here)", self.name, tried[0], tried[1])
        return self._packable[tried]

    @property
    def score_dtype(self) -> torch.dtype | None:
        """What :attr:`head_dtype` asks of the heads' scores: None for float32 (no autocast), else its dtype."""
        if self.head_dtype not in HEAD_DTYPES:
            raise ValueError(f"head_dtype {self.head_dtype!r}: one of {sorted(HEAD_DTYPES)}")
        return HEAD_DTYPES[self.head_dtype]

    def _heads_packed(self, key: str, texts: Stream) -> Classified | None:
        """Head ``key`` on texts back to back (no credit; see :meth:`RoutingHead.scores_packed`), left on the device;
        None where the head was dropped meanwhile."""
        clf = self.classifiers.get(key)
        if key not in self.manifests or clf is None:
            return None
        t0 = time.perf_counter()
        with _phase("engine.heads"):
            hidden = texts.hidden.to(dtype=next(clf.head.parameters()).dtype)  # [T e d]
            with scoring(self.device, self.score_dtype):
                logits = clf.head.scores_packed(hidden, texts.n_t, None, self.head_products).float()  # [b k]
        self.clock.forward_s += time.perf_counter() - t0
        return Classified(logits=logits, encoded=None, explained=[None] * len(texts.n_t))

    def _bucket(self, key: str) -> object:
        """What texts asking for head ``key`` share a head call with: the texts of the same head, or with
        ``gather_heads`` those of every head of its shape (a head dropped meanwhile: its own bucket)."""
        clf = self.classifiers.get(key)
        return head_shape(clf.head) if self.gather_heads and clf is not None else key

    def _head_groups(self, lengths: list[int]) -> list[list[int]]:
        """Texts (by index into ``lengths``) in length groups within ``head_batch_positions`` padded positions, so
        short texts are not padded to a long one, where that saves more than ``head_call_overhead``."""
        return length_groups(lengths, self.head_call_overhead, self.head_batch_positions)

    def _heads(self, keys: list[str], enc: Encoded, specs: list[CreditSpec | None]) -> Classified | None:
        """The heads' computation for texts whose chunks are all encoded (``enc``: their gathered hidden states; text
        ``b`` on head ``keys[b]``, one call for them all), left on the device; None where a head was dropped
        meanwhile (only texts whose callers have gone can still ask for it)."""
        if len(set(keys)) == 1:
            clf = self.classifiers.get(keys[0])
            if keys[0] not in self.manifests or clf is None:
                return None
            head = clf.head
        else:  # rows of different heads of one shape: their parameters stacked, one row each
            head = stack_heads([self.classifiers[k].head for k in keys], self._stack_space)
        requests = [credit_request(len(self.manifests[k].labels), s) for k, s in zip(keys, specs, strict=True)]
        t0 = time.perf_counter()
        with _phase("engine.heads"):
            pred = classify(head, enc, requests, return_phi=any(s is not None and s.phi for s in specs),
                            encoder=self.backbone.stream, score_dtype=self.score_dtype)
        self.clock.forward_s += time.perf_counter() - t0
        return pred

    def device_memory(self) -> list[dict[str, float | str]]:
        return device_memory()
