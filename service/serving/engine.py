"""The engine: one frozen backbone and the heads of every model on it. It runs batches of chunks through
the encoder once, each head on the texts that asked for it, and turns the tensors into plain results.
It knows torch and the models, nothing about HTTP.

A text is planned as one :class:`~service.serving.contract.ChunkWork` per chunk; batches of chunks (from
any texts, for any heads) run through the encoder, and as soon as a text's last chunk has been encoded,
every head asked of it runs on it, in the same batch, together with the other texts completed there
that asked for the same head. The backbone is frozen, so a head's answer does not depend on which other
heads, or texts, share the batch."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from service.config import DTYPES
from service.modeling.backbone import Backbone, BackboneError, Encoded
from service.modeling.classifier import CreditRequest, Explained, Prediction, RoutingClassifier, classify
from service.modeling.grouping import length_groups
from service.modeling.head import StackSpace, head_shape, stack_heads
from service.modeling.repository import MANIFEST, Manifest, ModelLoadError, load_model, read_manifest
from service.serving.contract import (
    Answer,
    Ask,
    ChunkWork,
    Credit,
    CreditSpec,
    Result,
    TargetCredit,
    Task,
    TextJob,
    answers_of,
)
from service.serving.planner import Planner, backbone_key, model_of

__all__ = ["Ask", "ChunkWork", "CreditSpec", "Engine", "NonFiniteScores", "Planner", "Result", "Task"]


def _phase(name: str) -> contextlib.AbstractContextManager[object]:
    """A range named ``name`` in a torch profile (``routing-service bench engine`` reads them), and nothing while
    no profiler runs (a range costs about 16 us on a 2-core CPU even then)."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


def resolve_device(device: str) -> torch.device:
    """``auto`` picks the first GPU when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "float32" and device.type != "cuda":
        raise ValueError(f"dtype {dtype} is only supported on GPU; use float32 on {device}")
    return TORCH_DTYPES[dtype]


def device_memory() -> list[dict[str, float | str]]:
    """Allocated, reserved, peak and total memory of every CUDA device (empty on CPU)."""
    if not torch.cuda.is_available():
        return []
    out = []
    for k in range(torch.cuda.device_count()):
        out.append({"device": f"cuda:{k}", "allocated": torch.cuda.memory_allocated(k),
                    "reserved": torch.cuda.memory_reserved(k), "peak": torch.cuda.max_memory_allocated(k),
                    "total": torch.cuda.get_device_properties(k).total_memory})
    return out


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


class Engine(Planner):
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

    @classmethod
    def load(cls, folders: Path | Sequence[Path], device: str = "auto", dtype: str = "float32",
             warmup: bool = True, keys: Sequence[str] | None = None) -> Engine:
        """Load the models of ``folders`` (one folder, or several naming the same backbone) on one backbone,
        each head under its key in ``keys`` (by default its model's name)."""
        t0 = time.perf_counter()
        folders = [folders] if isinstance(folders, Path | str) else list(folders)
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        manifests, classifiers = load_backbone(folders, dev, dt, keys)
        engine = cls(manifests, classifiers, dev, dt, 0.0)
        if warmup:
            engine._warm_up(engine.models)
        engine.load_seconds = time.perf_counter() - t0
        engine.head_seconds = dict.fromkeys(engine.models, engine.load_seconds)
        return engine

    def _warm_up(self, keys: Sequence[str]) -> None:
        """One batch on each head of ``keys``, with both kinds of credit.

        Raises:
            NonFiniteScores: a head's scores were not finite.
        """
        full, shares = CreditSpec(detail="full"), CreditSpec(method="shares", detail="full")
        tasks = [Task(text, model=k, credit=c) for k in keys
                 for text, c in (("warm up the model", full), ("and its routing shares", shares))]
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
        self._added(manifests)
        if warmup:
            try:
                self._warm_up(keys)
            except Exception:
                self.remove_heads(keys)
                raise
        self.head_seconds.update(dict.fromkeys(keys, time.perf_counter() - t0))

    def remove_heads(self, keys: Sequence[str]) -> None:
        self._removed(keys)
        self.classifiers = {k: c for k, c in self.classifiers.items() if k not in keys}
        self.head_seconds = {k: t for k, t in self.head_seconds.items() if k not in keys}

    def describe(self, model: str) -> dict[str, Any]:
        m, clf = self.manifests[model], self.classifiers[model]
        return {
            "name": m.name, "task": m.task, "description": m.description,
            "labels": m.labels, "backbone": m.backbone.model_dump(),
            "head": m.head.model_dump(), "max_length": self.max_length(model),
            "parameters": {"head": sum(p.numel() for p in clf.head.parameters()),
                           "backbone": sum(p.numel() for p in self.backbone.parameters())},
            "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
            "evaluation": m.evaluation, "load_seconds": round(self.head_seconds.get(model, self.load_seconds), 3),
        }

    @staticmethod
    def _credit_request(n_classes: int, spec: CreditSpec | None) -> CreditRequest | None:
        """The classifier's request for ``spec``: every class when the full matrix is wanted."""
        if spec is None:
            return None
        targets = tuple(range(n_classes)) if spec.matrix else spec.targets
        return CreditRequest(targets=targets, method=spec.method, contrast=spec.contrast)

    def run(self, tasks: list[Task]) -> list[Result]:
        """Classify a batch of whole texts, each on its own head (every chunk in this one call)."""
        with _phase("engine.plan"):
            chunks = [w for plan in self.plan(tasks) for w in plan]
        return [answer[0] for answer in answers_of(chunks, self.run_chunks(chunks))]

    @torch.inference_mode()
    def run_chunks(self, works: list[ChunkWork]) -> list[Answer | None]:
        """Encode a batch of chunks once; run each head on every text completed here that asked for it (in
        length groups) and answer each such text at its last chunk's place. The other places are None."""
        with _phase("engine.encode"):
            states = self.backbone.run_chunks([list(w.ids) for w in works])
        done: dict[int, TextJob] = {}  # position in the batch -> text completed there
        for pos, (w, st) in enumerate(zip(works, states, strict=True)):
            w.job.states[w.k] = st
            w.job.left -= 1
            if w.job.left == 0:
                done[pos] = w.job
        results: dict[tuple[int, int], Result] = {}  # (position, ask) -> its result
        buckets: dict[object, list[tuple[int, int]]] = {}  # texts whose heads run together
        for pos, job in done.items():
            for a, ask in enumerate(job.asks):
                buckets.setdefault(self._bucket(ask.model or self.default), []).append((pos, a))
        joined: dict[tuple[int, ...], Encoded] = {}  # texts (positions) -> their hidden states, joined once
        for places in buckets.values():
            for group in self._head_groups([done[pos].encoding.n_tokens for pos, _ in places]):
                chosen = [places[g] for g in group]
                key = tuple(pos for pos, _ in chosen)
                if key not in joined:  # heads asked of the same texts read the same joined states
                    jobs = [done[pos] for pos in key]
                    with _phase("engine.join"):
                        joined[key] = self.backbone.join([j.encoding for j in jobs], [j.states for j in jobs])
                asks = [done[pos].asks[a] for pos, a in chosen]
                heads = [ask.model or self.default for ask in asks]
                for place, res in zip(chosen, self._finish(heads, joined[key], [ask.credit for ask in asks]),
                                      strict=True):
                    results[place] = res
        for job in done.values():
            job.states = []  # the hidden states are no longer needed
        return [[results[(pos, a)] for a in range(len(done[pos].asks))] if pos in done else None
                for pos in range(len(works))]

    def _bucket(self, key: str) -> object:
        """What texts asking for head ``key`` share a head call with: the texts of the same head, or with
        ``gather_heads`` those of every head of its shape (a head dropped meanwhile: its own bucket)."""
        clf = self.classifiers.get(key)
        return head_shape(clf.head) if self.gather_heads and clf is not None else key

    def _head_groups(self, lengths: list[int]) -> list[list[int]]:
        """Texts (by index into ``lengths``) in length groups within ``chunk_batch_tokens`` padded positions, so
        short texts are not padded to a long one. A call of the head costs about twice what one of the
        encoder does in padded positions (on the CPU: 2.4 ms a call against 0.018 ms a padded position),
        so it is cut less often."""
        return length_groups(lengths, 2 * self.backbone.call_overhead, self.backbone.chunk_batch_tokens)

    def _finish(self, keys: list[str], enc: Encoded, specs: list[CreditSpec | None]) -> list[Result]:
        """The heads' part for texts whose chunks are all encoded (``enc``: their joined hidden states; text ``b``
        on head ``keys[b]``, one call for them all). A head dropped meanwhile answers with an error (only texts
        whose callers have gone can still ask for it)."""
        if len(set(keys)) == 1:
            manifest, clf = self.manifests.get(keys[0]), self.classifiers.get(keys[0])
            if manifest is None or clf is None:
                return [Result(label="", scores={}, error=f"model {model_of(keys[0])} was unloaded") for _ in specs]
            head = clf.head
        else:  # rows of different heads of one shape: their parameters stacked, one row each
            head = stack_heads([self.classifiers[k].head for k in keys], self._stack_space)
        requests = [self._credit_request(len(self.manifests[k].labels), s) for k, s in zip(keys, specs, strict=True)]
        with _phase("engine.heads"):
            pred = classify(head, enc, requests, return_phi=any(s is not None and s.phi for s in specs))
            probs = pred.probs.cpu()  # one device-to-host copy per batch, not per text
        with _phase("engine.results"):  # the batch's scores read once, not a few torch calls per text
            scores, finite, best = probs.tolist(), torch.isfinite(probs).all(dim=-1).tolist(), probs.argmax(-1).tolist()
            return [self._result(self.manifests[k].name, self.manifests[k].labels, pred, scores[b], finite[b],
                                 best[b], b, s)
                    for b, (k, s) in enumerate(zip(keys, specs, strict=True))]

    def _result(self, name: str, labels: list[str], pred: Prediction, scores: list[float], finite: bool, k: int,
                b: int, spec: CreditSpec | None) -> Result:
        """Text ``b``'s result: its ``scores`` (``k``: the highest) when all are ``finite``, else an error."""
        if not finite:
            return Result(label="", scores={}, error=f"model {name} produced non-finite scores for this text")
        res = Result(label=labels[k], scores=dict(zip(labels, scores, strict=True)))
        explained = pred.explained[b]
        if spec is not None and explained is not None:
            res.credit = self._credit(labels, pred, b, explained, spec, k)
        return res

    def _credit(self, labels: list[str], pred: Prediction, b: int, ex: Explained, spec: CreditSpec,
                predicted: int) -> Credit:
        """Plain numbers of one text's credit (views are built from them off the model thread)."""
        full = spec.detail == "full"
        targets = []
        for k in spec.targets or (predicted,):  # the full matrix covers every class; these are the asked ones
            j = ex.targets.index(k)
            logit, baseline = (None, None) if ex.logit is None or ex.baseline is None else (
                float(ex.logit[j]), float(ex.baseline[j]))
            depth = ex.credit[:, :, j].tolist() if full else None  # [n][e]
            targets.append(TargetCredit(labels[k], ex.credit[:, :, j].sum(dim=1).tolist(), depth, logit, baseline))
        credit = Credit(spec.method, spec.contrast, targets)
        if spec.matrix:
            credit.matrix = ex.credit.tolist()
        if spec.phi and pred.phi is not None:
            n_i = ex.credit.shape[0] * ex.credit.shape[1]
            phi1, phi2, phi3 = (p[b].float().cpu() for p in pred.phi)
            credit.phi = [phi1[:n_i].tolist(), phi2.tolist(), phi3.tolist()]
        return credit

    def device_memory(self) -> list[dict[str, float | str]]:
        return device_memory()
