"""Backbone features for training: hidden states of every depth, computed once and cached on disk
(float16, one flat tensor plus offsets, so 10^4-10^5 texts load in seconds)."""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from service.config import GPU_BATCH
from service.files import replacing
from service.modeling.backbone import Backbone
from service.training.progress import progress


@dataclass
class Features:
    """Hidden states of many texts, stored flat; a subset shares the memory (a view of other texts' rows).

    Attributes:
        flat: ``[N, d_depth, d_emb]`` float16, the positions of every text (of this set and maybe others).
        starts, ends: ``[T]`` where each text's positions begin and end in ``flat``.
    """

    flat: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor

    @classmethod
    def from_offsets(cls, flat: torch.Tensor, offsets: torch.Tensor) -> Features:
        """Texts one after another in ``flat``: text ``t`` from ``offsets[t]`` to ``offsets[t + 1]`` (``[T + 1]``)."""
        return cls(flat, offsets[:-1], offsets[1:])

    def __len__(self) -> int:
        return len(self.starts)

    def get(self, t: int) -> torch.Tensor:
        """``[n_t, d_depth, d_emb]`` hidden states of text ``t``."""
        return self.flat[self.starts[t] : self.ends[t]]

    def lengths(self) -> torch.Tensor:
        return self.ends - self.starts

    def subset(self, idx: list[int]) -> Features:
        """The features of texts ``idx``, in that order, sharing ``flat`` (no copy: a dataset's folds and splits
        take no memory beyond the dataset's)."""
        rows = torch.tensor(idx, dtype=torch.long)  # [T']
        return Features(self.flat, self.starts[rows], self.ends[rows])


def cache_key(backbone_source: str, max_length: int, texts: list[str], dtype: torch.dtype = torch.float32) -> str:
    """What a feature file holds: the backbone, its chunk length, its precision (float32's files keep the key they had
    before precisions were told apart) and the texts."""
    precision = "" if dtype == torch.float32 else f"|{dtype}"
    h = hashlib.sha1(f"{backbone_source}|{max_length}{precision}".encode())
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:16]


FEATURE_BATCH = {"cpu": (64, None), "cuda": GPU_BATCH}
"""Texts and tokens per feature batch by device type: on a CPU 64 texts (whatever their length), on a GPU as many as
the serving engine's batches hold (a smaller batch leaves the device waiting on the host)."""


def feature_batches(order: list[int], n_tokens: list[int], texts: int, tokens: int | None) -> list[list[int]]:
    """``order`` cut into consecutive batches of at most ``texts`` texts and ``tokens`` tokens (None: any number; a
    longer text makes a batch of its own)."""
    batches: list[list[int]] = []
    current: list[int] = []
    held = 0
    for k in order:
        if current and (len(current) >= texts or (tokens is not None and held + n_tokens[k] > tokens)):
            batches.append(current)
            current, held = [], 0
        current.append(k)
        held += n_tokens[k]
    if current:
        batches.append(current)
    return batches


def extract(backbone: Backbone, texts: list[str], batch_size: int | None = None, cache_dir: Path | None = None,
            source: str = "", desc: str = "features") -> Features:
    """Hidden states of ``texts`` (in order), from the cache when present (a cache file that cannot be read, e.g.
    cut short by a stopped run, is computed again). Says which, and where the cache file is. Computed on the
    backbone's device in batches of :data:`FEATURE_BATCH` (``batch_size``: texts per batch instead), kept on the host
    in float16."""
    path = None
    if cache_dir is not None:
        path = cache_dir / f"{cache_key(source, backbone.max_length, texts, backbone.dtype)}.pt"
        if path.is_file():
            try:
                data = torch.load(path)
                feats = Features.from_offsets(data["flat"], data["offsets"])
            except Exception as e:  # a damaged file must not stop training: it is written again below
                print(f"warning: {desc}: cached features {path} unreadable ({type(e).__name__}: {e}); computing "
                      "them again", file=sys.stderr, flush=True)
            else:
                print(f"{desc}: {len(texts)} texts from the cache, {path}", flush=True)
                return feats
    # every text tokenized first: its length places its states in one buffer, written batch by batch (no second
    # copy of them all, which the process would keep for the rest of training: see service.allocator)
    encodings = backbone.encode(texts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long),
                         torch.tensor([e.n_tokens for e in encodings], dtype=torch.long).cumsum(0)])  # [T + 1]
    flat = torch.empty(int(offsets[-1]), backbone.d_depth, backbone.d_emb, dtype=torch.float16)  # [N e d]
    order = sorted(range(len(texts)), key=lambda k: len(texts[k]))  # similar lengths together: less padding
    per_batch, tokens = FEATURE_BATCH["cuda" if backbone.device.type == "cuda" else "cpu"]
    batches = feature_batches(order, [e.n_tokens for e in encodings], batch_size or per_batch, tokens)
    with progress(total=len(texts), desc=desc, unit="text") as bar:
        # the longest batch first: each batch's memory then fits where the last one's was (shortest first, every batch
        # needed more and the process kept them all: 1.7 against 1.4 GB for 3,000 tweets); the same batches either way
        for idx in reversed(batches):
            enc = backbone([encodings[k] for k in idx])
            hidden = enc.hidden.to("cpu", torch.float16)  # [b n e d] one copy to the host
            for r, k in enumerate(idx):
                flat[offsets[k] : offsets[k + 1]] = hidden[r, : enc.lengths[r]]  # [n_t e d]
            bar.update(len(idx))
    feats = Features.from_offsets(flat, offsets)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as tmp:  # whole or not at all: a stopped run leaves no part
            torch.save({"flat": feats.flat, "offsets": offsets}, tmp)
        print(f"{desc}: cached in {path} ({path.stat().st_size / 2**20:,.1f} MiB; --cache sets the folder)", flush=True)
    return feats


def pad_batch(feats: Features, idx: list[int],
              spans: list[tuple[int, int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [b, n_max, d_depth, d_emb]`` (float32) and ``pad [b, n_max]`` for texts ``idx``, each
    cut to its positions ``[start, end)`` when ``spans`` is given."""
    parts = [feats.get(t) for t in idx]
    if spans is not None:
        parts = [p[s:e] for p, (s, e) in zip(parts, spans, strict=True)]
    n_max = max(len(p) for p in parts)
    hidden = torch.zeros(len(parts), n_max, *parts[0].shape[1:])  # [b n e d]
    pad = torch.ones(len(parts), n_max, dtype=torch.bool)  # [b n]
    for b, p in enumerate(parts):
        hidden[b, : len(p)] = p.float()
        pad[b, : len(p)] = False
    return hidden, pad
