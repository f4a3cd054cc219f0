"""The engine: runs one batch of texts through a model on its device and turns the tensors into
plain results. It knows torch and the model, nothing about HTTP; it runs in the batcher's thread."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service.modeling import views
from service.modeling.classifier import Prediction, RoutingClassifier
from service.modeling.repository import Manifest, load_model

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
    return DTYPES[dtype]


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


@dataclass(frozen=True)
class Task:
    """One text and what to compute for it.

    ``explain``: None (scores only), ``"predicted"`` (token credit of the predicted label), or
    ``"full"`` (the explain endpoint's views for ``targets``; None = the predicted label).
    """

    text: str
    explain: str | None = None
    targets: tuple[str, ...] | None = None
    include_matrix: bool = False
    include_phi: bool = False


@dataclass
class Result:
    label: str
    scores: dict[str, float]
    explanation: dict[str, Any] | None = None
    n_tokens: int = 0


class Engine:
    """A loaded model ready to serve batches."""

    def __init__(self, manifest: Manifest, classifier: RoutingClassifier, device: torch.device,
                 dtype: torch.dtype, load_seconds: float) -> None:
        self.manifest, self.classifier, self.device, self.dtype = manifest, classifier, device, dtype
        self.load_seconds = load_seconds
        self.name = manifest.name
        self.labels = manifest.labels

    @classmethod
    def load(cls, folder: Path, device: str = "auto", dtype: str = "float32", warmup: bool = True) -> Engine:
        t0 = time.perf_counter()
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        manifest, clf = load_model(folder, device=dev, dtype=dt)
        engine = cls(manifest, clf, dev, dt, 0.0)
        if warmup:
            engine.run([Task("warm up the model", explain="full")])
        engine.load_seconds = time.perf_counter() - t0
        return engine

    @property
    def max_length(self) -> int:
        return self.classifier.backbone.max_length

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

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Sequence length of each text (chunk special tokens included): the batcher's cost."""
        return self.classifier.backbone.count_tokens(texts)

    def run(self, tasks: list[Task]) -> list[Result]:
        """Classify a batch; compute credit only if some text asks for it."""
        explain = any(t.explain for t in tasks)
        phi = any(t.include_phi for t in tasks)
        pred = self.classifier.predict([t.text for t in tasks], explain=explain, return_phi=phi)
        probs = pred.probs.cpu()  # one device-to-host copy per batch, not per text
        credit = pred.credit.cpu() if pred.credit is not None else None
        return [self._result(pred, probs, credit, b, t) for b, t in enumerate(tasks)]

    def _result(self, pred: Prediction, probs: torch.Tensor, credit_all: torch.Tensor | None, b: int,
                task: Task) -> Result:
        k = int(probs[b].argmax())
        scores = {lab: float(p) for lab, p in zip(self.labels, probs[b].tolist(), strict=True)}
        enc = pred.encoded
        n = enc.lengths[b]
        res = Result(label=self.labels[k], scores=scores, n_tokens=n)
        if task.explain is None or credit_all is None:
            return res
        credit = credit_all[b, :n]  # [n e k]
        per_token = views.token_credit(credit)  # [n k]
        offsets, special = enc.offsets[b], enc.special[b]
        tokens = self.classifier.backbone.tokenizer.convert_ids_to_tokens(enc.token_ids[b].tolist())
        if task.explain == "predicted":
            res.explanation = {"target": self.labels[k], "tokens": [
                {"token": tok, "start": int(offsets[p, 0]), "end": int(offsets[p, 1]), "credit": float(per_token[p, k])}
                for p, tok in enumerate(tokens) if not special[p]]}
            return res
        targets = list(task.targets) if task.targets else [self.labels[k]]
        words = views.words(task.text, offsets, enc.word_ids[b], special)
        sents = views.sentences(task.text, offsets, special)
        w_credit, s_credit = views.span_credit(per_token, words), views.span_credit(per_token, sents)
        by_target = {}
        for target in targets:
            j = self.labels.index(target)
            by_target[target] = {
                "tokens": per_token[:, j].tolist(),
                "words": [{"text": w.text, "start": w.start, "end": w.end, "credit": float(w_credit[s, j])}
                          for s, w in enumerate(words)],
                "sentences": [{"text": s.text, "start": s.start, "end": s.end, "credit": float(s_credit[q, j])}
                              for q, s in enumerate(sents)],
                "depth": credit[:, :, j].tolist(),
            }
        res.explanation = {
            "tokens": [{"token": tok, "start": int(offsets[p, 0]), "end": int(offsets[p, 1]),
                        "special": bool(special[p])} for p, tok in enumerate(tokens)],
            "targets": targets, "credit": by_target,
        }
        if task.include_matrix:
            res.explanation["matrix"] = credit.tolist()
        if task.include_phi and pred.phi is not None:
            phi1, phi2, phi3 = (p[b].float().cpu() for p in pred.phi)
            d_depth = credit.shape[1]
            res.explanation["phi"] = [phi1[: n * d_depth].tolist(), phi2.tolist(), phi3.tolist()]
        return res

    def explain_elements(self, n_tokens: int, include_matrix: bool, include_phi: bool) -> int:
        """How many numbers the full matrix and the phis add for a text of ``n_tokens``."""
        head = self.classifier.head
        n_i = n_tokens * head.d_depth
        total = n_i * len(self.labels) if include_matrix else 0
        if include_phi:
            total += n_i * head.n_hid + head.n_hid * head.n_hid + head.n_hid * len(self.labels)
        return total
