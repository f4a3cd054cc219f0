"""Backbone features for training: hidden states of every depth, computed once and cached on disk
(float16, one flat tensor plus offsets, so 10^4-10^5 texts load in seconds)."""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from service.files import replacing
from service.modeling.backbone import Backbone
from service.training.progress import progress


@dataclass
class Features:
    """Hidden states of many texts, stored flat.

    Attributes:
        flat: ``[sum_t n_t, d_depth, d_emb]`` float16.
        offsets: ``[T + 1]`` start of each text in ``flat``.
    """

    flat: torch.Tensor
    offsets: torch.Tensor

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def get(self, t: int) -> torch.Tensor:
        """``[n_t, d_depth, d_emb]`` hidden states of text ``t``."""
        return self.flat[self.offsets[t] : self.offsets[t + 1]]

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def subset(self, idx: list[int]) -> Features:
        """The features of texts ``idx``, in that order (a copy)."""
        parts = [self.get(t) for t in idx]
        lengths = torch.tensor([len(p) for p in parts], dtype=torch.long)  # [T']
        return Features(torch.cat(parts) if parts else self.flat[:0],
                        torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))


def cache_key(backbone_source: str, max_length: int, texts: list[str]) -> str:
    h = hashlib.sha1(f"{backbone_source}|{max_length}".encode())
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def extract(backbone: Backbone, texts: list[str], batch_size: int = 64, cache_dir: Path | None = None,
            source: str = "", desc: str = "features") -> Features:
    """Hidden states of ``texts`` (in order), from the cache when present (a cache file that cannot be read, e.g.
    cut short by a stopped run, is computed again). Says which, and where the cache file is."""
    path = None
    if cache_dir is not None:
        path = cache_dir / f"{cache_key(source, backbone.max_length, texts)}.pt"
        if path.is_file():
            try:
                data = torch.load(path)
                feats = Features(data["flat"], data["offsets"])
            except Exception as e:  # a damaged file must not stop training: it is written again below
                print(f"warning: {desc}: cached features {path} unreadable ({type(e).__name__}: {e}); computing "
                      "them again", file=sys.stderr, flush=True)
            else:
                print(f"{desc}: {len(texts)} texts from the cache, {path}", flush=True)
                return feats
    order = sorted(range(len(texts)), key=lambda k: len(texts[k]))  # similar lengths together: less padding
    parts: list[torch.Tensor | None] = [None] * len(texts)
    with progress(total=len(texts), desc=desc, unit="text") as bar:
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            enc = backbone([texts[k] for k in idx])
            for r, k in enumerate(idx):
                parts[k] = enc.hidden[r, : enc.lengths[r]].to(torch.float16).cpu()
            bar.update(len(idx))
    lengths = torch.tensor([len(p) for p in parts if p is not None])
    feats = Features(torch.cat([p for p in parts if p is not None]),
                     torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as tmp:  # whole or not at all: a stopped run leaves no part
            torch.save({"flat": feats.flat, "offsets": feats.offsets}, tmp)
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
