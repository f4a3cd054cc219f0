"""Where a batch's texts lie in the rows the encoder wrote, and reading them for a head call: in place (a block of
rows padded as the encoder laid them out), gathered and padded to the longest, or back to back for a packed head.
Torch and numpy only (the batch's layout is :func:`~service.modeling.grouping.lay_out`'s)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from service.modeling.backbone import Encoded
from service.modeling.encoder import to_device
from service.modeling.encoding import Encoding
from service.modeling.grouping import Layout, run_rows
from service.serving.core.work import TextJob


@dataclass(frozen=True)
class Stream:
    """Texts' hidden states back to back, unpadded, for a packed head call: ``hidden [T, e, d]`` and ``n_t [b]`` each
    text's positions (on the device)."""

    hidden: torch.Tensor
    n_t: torch.Tensor


def locate(layout: Layout, lengths: np.ndarray, done: dict[int, TextJob]
           ) -> tuple[dict[int, tuple[int, int] | np.ndarray], list[torch.Tensor]]:
    """Where each completed text's tokens lie in the batch's rows (see ``Engine._submit``), by its last chunk's
    position: ``(first, count)`` when they are one run (a text of one chunk), else their indices (this batch's
    chunks at their rows, earlier batches' after ``layout.rows``); and those earlier chunks' held states, in the
    order they go there."""
    where: dict[int, tuple[int, int] | np.ndarray] = {}
    earlier: list[torch.Tensor] = []
    taken = layout.rows
    for pos, job in done.items():
        if len(job.states) == 1:
            where[pos] = (int(layout.first[pos]), int(lengths[pos]))
            continue
        parts = []
        for st in job.states:
            if isinstance(st, int):
                parts.append(np.arange(layout.first[st], layout.first[st] + lengths[st]))
            else:
                parts.append(np.arange(taken, taken + len(st)))
                earlier.append(st)
                taken += len(st)
        where[pos] = np.concatenate(parts)
    return where, earlier


def block(rows: torch.Tensor, block: tuple[int, int, int], n_t: np.ndarray, encodings: list[Encoding]
           ) -> Encoded:
    """Texts' hidden states ``[b, N, e, d]`` where the encoder wrote them, padded (a view of ``rows``, no copy):
    ``block`` is their first row, count and padded length (see :func:`~service.modeling.grouping.lay_out`),
    ``n_t [b]`` their lengths."""
    first, b, N = block
    hidden = rows[first : first + b * N].view(b, N, *rows.shape[1:])  # [b N e d]
    if bool((n_t == N).all()):
        return Encoded(hidden, None, encodings)
    n_d = to_device([n_t], rows.device)  # [b]
    return Encoded(hidden, torch.arange(N, device=rows.device) >= n_d[:, None], encodings)  # pad [b N]


def gather(source: torch.Tensor, where: list[tuple[int, int] | np.ndarray], encodings: list[Encoding]
            ) -> Encoded:
    """Texts' hidden states ``[b, n, e, d]`` padded to the longest, in one gather from ``source`` (``where[b]``:
    text ``b``'s rows of ``source``, see :func:`locate`); ``pad`` None when every text has the same length.
    Padding slots hold a copy of the text's first token (finite; the head masks them as absent)."""
    runs = [w for w in where if isinstance(w, tuple)]
    if len(runs) == len(where):  # every text one run: the index without a loop over texts
        first, n_t = np.array(runs, dtype=np.int64).reshape(-1, 2).T  # [b], [b]
        N = int(n_t.max())
        slot = np.arange(N)  # [N]
        index = first[:, None] + np.where(slot < n_t[:, None], slot, 0)  # [b N]
    else:
        n_t = np.array([w[1] if isinstance(w, tuple) else len(w) for w in where], dtype=np.int64)  # [b]
        N = int(n_t.max())
        index = np.empty((len(where), N), dtype=np.int64)  # [b N]
        for b, w in enumerate(where):
            rows = np.arange(w[0], w[0] + w[1]) if isinstance(w, tuple) else w
            index[b, : len(rows)] = rows
            index[b, len(rows) :] = rows[0]
    flat = to_device([index.ravel(), n_t], source.device)  # one copy to the device
    hidden = source[flat[: index.size]].view(len(where), N, *source.shape[1:])  # [b N e d]
    even = bool((n_t == N).all())
    pad = None if even else torch.arange(N, device=source.device) >= flat[index.size :, None]  # [b N]
    return Encoded(hidden, pad, encodings)


def stream(source: torch.Tensor, where: list[tuple[int, int] | np.ndarray]) -> Stream:
    """Texts' hidden states back to back from ``source`` (``where[b]``: text ``b``'s rows, see :func:`locate`): a
    view where they lie so already (texts of one chunk, in order: the encoder writes them so), else one gather."""
    n_t = np.array([w[1] if isinstance(w, tuple) else len(w) for w in where], dtype=np.int64)  # [b]
    T = int(n_t.sum())
    runs = [w for w in where if isinstance(w, tuple)]
    if len(runs) == len(where):
        first = np.array([w[0] for w in runs], dtype=np.int64)  # [b]
        starts = np.cumsum(n_t) - n_t  # [b] each text's first position in the stream
        if bool((first - starts == first[0]).all()):  # one run of rows
            return Stream(source[first[0] : first[0] + T], to_device([n_t], source.device))  # [T e d]
        index = run_rows(first, n_t)  # [T]
    else:
        index = np.concatenate([np.arange(w[0], w[0] + w[1]) if isinstance(w, tuple) else w for w in where])
    flat = to_device([index, n_t], source.device)  # one copy to the device
    return Stream(source[flat[:T]], flat[T:])  # [T e d]
