"""Where a backbone runs and in what precision: the ``auto`` rules shared by serving and training."""

from __future__ import annotations

import torch

from service.config import DTYPES

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


def resolve_device(device: str) -> torch.device:
    """``auto`` picks the first GPU when there is one, else the CPU; ``cuda`` is the current GPU, by its index (what a
    manifest or a log records names the card)."""
    if device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 for the backbone on a GPU (the heads, and their credit, compute in float32 whatever the
    backbone's precision), float32 on a CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype != "float32" and device.type != "cuda":
        raise ValueError(f"dtype {dtype} is only supported on GPU; use float32 on {device}")
    return TORCH_DTYPES[dtype]
