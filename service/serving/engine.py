"""The engine: runs batches of chunks through a model on its device and turns the tensors into plain
results. It knows torch and the model, nothing about HTTP; it runs in the batcher's thread.

A text is planned as one :class:`~service.serving.contract.ChunkWork` per chunk; batches of chunks
(from any texts) run through the encoder, and the head runs on a text as soon as its last chunk has
been encoded, in the same batch, together with the other texts completed there."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from service.config import DTYPES
from service.modeling.backbone import ChunkTokenizer
from service.modeling.classifier import CreditRequest, Explained, Prediction, RoutingClassifier
from service.modeling.encoding import Encoding
from service.modeling.grouping import length_groups
from service.modeling.repository import Manifest, load_model
from service.serving.contract import ChunkWork, Credit, Result, TargetCredit, Task, TextJob, Token, results_of

__all__ = ["ChunkWork", "Engine", "NonFiniteScores", "Planner", "Result", "Task"]

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


class Planner(abc.ABC):
    """A model as the server sees it before it runs: its manifest and tokenizer, which cut texts into the
    batcher's units of work. :class:`Engine` runs them in this process, ``ModelProcess``
    (``service.serving.worker``) in a process of its own; both add ``run_chunks``, ``describe``,
    ``device_memory`` and ``close``."""

    device: torch.device | str
    dtype: torch.dtype | str

    def __init__(self, manifest: Manifest, chunker: ChunkTokenizer) -> None:
        self.manifest, self.chunker = manifest, chunker
        self.name = manifest.name
        self.labels = manifest.labels

    @property
    def max_length(self) -> int:
        return self.chunker.max_length

    def encode(self, texts: list[str]) -> list[Encoding]:
        """Tokenize and chunk ``texts`` once; ``n_tokens`` of each is the batcher's cost."""
        return self.chunker.encode(texts)

    def plan(self, tasks: list[Task]) -> list[list[ChunkWork]]:
        """Each task's chunks as units of work for the batcher (texts not yet tokenized are tokenized)."""
        missing = [t.text for t in tasks if t.encoding is None]
        fresh = iter(self.encode(missing) if missing else [])
        plans = []
        for task in tasks:
            enc = task.encoding if task.encoding is not None else next(fresh)
            job = TextJob(replace(task, encoding=enc), [None] * len(enc.chunks), len(enc.chunks))
            plans.append([ChunkWork(job, k, ids) for k, ids in enumerate(enc.chunks)])
        return plans

    def explain_elements(self, n_tokens: int, include_matrix: bool, include_phi: bool) -> int:
        """How many numbers the full matrix and the phis add for a text of ``n_tokens``."""
        n_hid, n_k = self.manifest.head.n_hid, len(self.labels)
        n_i = n_tokens * self.manifest.backbone.d_depth
        total = n_i * n_k if include_matrix else 0
        if include_phi:
            total += n_i * n_hid + n_hid * n_hid + n_hid * n_k
        return total

    @abc.abstractmethod
    def run_chunks(self, works: list[ChunkWork]) -> list[Result | None]:
        """Compute a batch of chunks; each text completed in it is answered at its last chunk's place."""

    @property
    def runners(self) -> list[Callable[[list[ChunkWork]], list[Result | None]]]:
        """What computes batches, one batch at a time each: the batcher sends each batch to a free one and
        keeps a text's chunks on one (it holds their states until the last)."""
        return [self.run_chunks]

    def resident_bytes(self) -> int | None:
        """Resident memory of the model's own processes (None: it computes in the server's process)."""
        return None

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """What ``/v1/models`` says of the model."""

    @abc.abstractmethod
    def device_memory(self) -> list[dict[str, float | str]]:
        """CUDA memory of the devices this model's process uses (empty on CPU)."""

    def close(self) -> None:  # noqa: B027 (nothing to release unless a subclass holds more)
        """Release what the model holds beyond this object (a process of its own)."""


class Engine(Planner):
    """A loaded model ready to serve batches, in this process."""

    def __init__(self, manifest: Manifest, classifier: RoutingClassifier, device: torch.device,
                 dtype: torch.dtype, load_seconds: float) -> None:
        super().__init__(manifest, classifier.backbone.chunker)
        self.classifier, self.device, self.dtype = classifier, device, dtype
        self.load_seconds = load_seconds

    @classmethod
    def load(cls, folder: Path, device: str = "auto", dtype: str = "float32", warmup: bool = True) -> Engine:
        t0 = time.perf_counter()
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        manifest, clf = load_model(folder, device=dev, dtype=dt)
        engine = cls(manifest, clf, dev, dt, 0.0)
        if warmup:
            results = engine.run([Task("warm up the model", explain="full"),
                                  Task("and its routing shares", explain="full", method="shares")])
            failed = [r.error for r in results if r.error]
            if failed:
                raise NonFiniteScores(f"model {manifest.name} failed its warm-up: {failed[0]}")
        engine.load_seconds = time.perf_counter() - t0
        return engine

    def describe(self) -> dict[str, Any]:
        head = self.classifier.head
        return {
            "name": self.name, "task": self.manifest.task, "description": self.manifest.description,
            "labels": self.labels, "backbone": self.manifest.backbone.model_dump(),
            "head": self.manifest.head.model_dump(), "max_length": self.max_length,
            "parameters": {"head": sum(p.numel() for p in head.parameters()),
                           "backbone": sum(p.numel() for p in self.classifier.backbone.parameters())},
            "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
            "evaluation": self.manifest.evaluation, "load_seconds": round(self.load_seconds, 3),
        }

    def _credit_request(self, task: Task) -> CreditRequest | None:
        """The classifier's request for ``task``: every class when the full matrix is wanted."""
        if task.explain is None:
            return None
        targets = None
        if task.include_matrix:
            targets = tuple(range(len(self.labels)))
        elif task.targets is not None:
            targets = tuple(self.labels.index(t) for t in task.targets)
        return CreditRequest(targets=targets, method=task.method, contrast=task.contrast)

    def run(self, tasks: list[Task]) -> list[Result]:
        """Classify a batch of whole texts (every chunk in this one call)."""
        chunks = [w for plan in self.plan(tasks) for w in plan]
        return results_of(chunks, self.run_chunks(chunks))

    def run_chunks(self, works: list[ChunkWork]) -> list[Result | None]:
        """Encode a batch of chunks; run the head on every text whose last chunk this was (batched by
        length) and answer it at that chunk's place. The other places are None."""
        states = self.classifier.backbone.run_chunks([list(w.ids) for w in works])
        done: dict[int, TextJob] = {}  # position in the batch -> text completed there
        for pos, (w, st) in enumerate(zip(works, states, strict=True)):
            w.job.states[w.k] = st
            w.job.left -= 1
            if w.job.left == 0:
                done[pos] = w.job
        answers: list[Result | None] = [None] * len(works)
        for group in self._head_groups(done):
            jobs = [done[pos] for pos in group]
            for pos, res in zip(group, self._finish(jobs), strict=True):
                answers[pos] = res
            for job in jobs:
                job.states = []  # the hidden states are no longer needed
        return answers

    def _head_groups(self, done: dict[int, TextJob]) -> list[list[int]]:
        """Completed texts (by batch position) in length groups within ``chunk_batch_tokens`` padded
        positions, so short texts are not padded to a long one. A call of the head costs about twice
        what one of the encoder does in padded positions (on the CPU: 2.4 ms a call against 0.018 ms
        a padded position), so it is cut less often."""
        backbone = self.classifier.backbone
        positions = list(done)
        groups = length_groups([done[p].encoding.n_tokens for p in positions], 2 * backbone.call_overhead,
                               backbone.chunk_batch_tokens)
        return [[positions[k] for k in group] for group in groups]

    def _finish(self, jobs: list[TextJob]) -> list[Result]:
        """The head's part for texts whose chunks are all encoded."""
        tasks = [j.task for j in jobs]
        enc = self.classifier.backbone.join([j.encoding for j in jobs], [j.states for j in jobs])
        pred = self.classifier.classify(enc, explain=[self._credit_request(t) for t in tasks],
                                        return_phi=any(t.include_phi for t in tasks))
        probs = pred.probs.cpu()  # one device-to-host copy per batch, not per text
        return [self._result(pred, probs, b, t) for b, t in enumerate(tasks)]

    def _result(self, pred: Prediction, probs: torch.Tensor, b: int, task: Task) -> Result:
        if not bool(torch.isfinite(probs[b]).all()):
            return Result(label="", scores={}, error=f"model {self.name} produced non-finite scores for this text")
        k = int(probs[b].argmax())
        scores = {lab: float(p) for lab, p in zip(self.labels, probs[b].tolist(), strict=True)}
        res = Result(label=self.labels[k], scores=scores)
        explained = pred.explained[b]
        if task.explain is not None and explained is not None:
            res.credit = self._credit(pred, b, explained, task, res.label)
        return res

    def _credit(self, pred: Prediction, b: int, ex: Explained, task: Task, predicted: str) -> Credit:
        """Plain numbers of one text's credit (views are built from them off the model thread)."""
        enc = task.encoding
        if enc is None:
            raise ValueError("a task reaches the head encoded")
        names = self.classifier.backbone.tokenizer.convert_ids_to_tokens([i for c in enc.chunks for i in c])
        tokens = [Token(t, s, e, sp) for t, (s, e), sp in zip(names, enc.offsets, enc.special, strict=True)]
        full = task.explain == "full"
        targets = []
        for label in task.targets or (predicted,):  # the full matrix covers every class; these are the asked ones
            j = ex.targets.index(self.labels.index(label))
            logit, baseline = (None, None) if ex.logit is None or ex.baseline is None else (
                float(ex.logit[j]), float(ex.baseline[j]))
            depth = ex.credit[:, :, j].tolist() if full else None  # [n][e]
            targets.append(TargetCredit(label, ex.credit[:, :, j].sum(dim=1).tolist(), depth, logit, baseline))
        credit = Credit(task.method, task.contrast, tokens, list(enc.word_ids), targets)
        if task.include_matrix:
            credit.matrix = ex.credit.tolist()
        if task.include_phi and pred.phi is not None:
            n_i = ex.credit.shape[0] * ex.credit.shape[1]
            phi1, phi2, phi3 = (p[b].float().cpu() for p in pred.phi)
            credit.phi = [phi1[:n_i].tolist(), phi2.tolist(), phi3.tolist()]
        return credit

    def device_memory(self) -> list[dict[str, float | str]]:
        return device_memory()
