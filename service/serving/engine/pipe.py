"""The messages between the server's process and a backbone's own process (:mod:`service.serving.engine.process`),
pickled over a pipe: load a backbone, change its heads, a plain batch as arrays (:class:`RunPlain`), and the answers
to those and to a batch (a batch of chunks is :class:`~service.serving.core.work.RunBatch`, beside the work it
carries: one module named in its pickle, not two)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.serving.core.results import Answer
from service.serving.observe.logs import LogSetup


@dataclass(frozen=True)
class BucketPlan:
    """Shape buckets for a backbone's plain batches (see ``Engine.use_buckets``): ``mode`` (``off``, ``auto``,
    ``eager``, ``cuda``) and the batcher's limits the buckets are chosen for."""

    mode: str = "off"
    max_texts: int = 1024
    budget: int = 16384


@dataclass(frozen=True)
class LoadBackbone:
    """Load a backbone and the heads of ``folders`` on it, each under its key in ``keys``."""

    folders: tuple[str, ...]
    keys: tuple[str, ...]
    device: str
    dtype: str
    warmup: bool
    torch_threads: int | None
    log: LogSetup = field(default_factory=LogSetup)
    buckets: BucketPlan = field(default_factory=BucketPlan)
    batch_invariance: str = "off"


@dataclass(frozen=True)
class LoadHeads:
    """Load the heads of ``folders`` onto the running backbone, each under its key in ``keys`` (all or none);
    answered with :class:`HeadsLoaded` or :class:`Failed`."""

    folders: tuple[str, ...]
    keys: tuple[str, ...]
    warmup: bool


@dataclass(frozen=True)
class HeadsLoaded:
    """The heads :class:`LoadHeads` asked for are in place: each one's description."""

    descriptions: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class UnloadHeads:
    """Drop these heads (their work has all been answered); answered with :class:`HeadsLoaded` (empty)."""

    keys: tuple[str, ...]


@dataclass(frozen=True)
class Loaded:
    """The backbone process is ready: each head's description, where it computes, its CUDA memory."""

    descriptions: dict[str, dict[str, Any]]
    device: str
    dtype: str
    memory: list[dict[str, float | str]]
    plain: bool = False
    """Whether its plain batches run in shape buckets (it takes them as :class:`RunPlain`)."""


@dataclass(frozen=True)
class Failed:
    """Loading, or a batch, failed: why (``path``: the file of a model folder that failed to load)."""

    error: str
    path: str | None = None


@dataclass(frozen=True)
class Computed:
    """A batch's answers (see :class:`Answer`), the CUDA memory after it, and how many texts are held."""

    answers: list[Answer | None]
    memory: list[dict[str, float | str]]
    held: int


@dataclass(frozen=True)
class RunPlain:
    """A plain batch (every text one chunk, asking one head, no credit) as arrays, so that neither process makes or
    reads an object a text: token ids ``ids [T]`` back to back, ``lengths [s]``, text ``t`` on head
    ``heads[head[t]]`` (None: the default); first forget the texts in ``forget`` (given up by the server). Answered
    with :class:`ComputedPlain` where it ran in a shape bucket, else as a :class:`~service.serving.core.work.RunBatch`
    (:class:`Computed`)."""

    ids: np.ndarray
    lengths: np.ndarray
    head: np.ndarray
    heads: tuple[str | None, ...]
    forget: list[int]

    @classmethod
    def of(cls, texts: Sequence[tuple[tuple[int, ...], str | None]], forget: list[int]) -> RunPlain:
        """The batch of ``texts``: each one's token ids and head key (None: the default)."""
        heads: dict[str | None, int] = {}  # each head asked, by its place in ``heads``
        head = np.fromiter((heads.setdefault(key, len(heads)) for _, key in texts), dtype=np.int32,
                           count=len(texts))  # [s]
        lengths = np.fromiter((len(ids) for ids, _ in texts), dtype=np.int32, count=len(texts))  # [s]
        flat = np.fromiter(itertools.chain.from_iterable(ids for ids, _ in texts), dtype=np.int32,
                           count=int(lengths.sum()))  # [T]
        return cls(flat, lengths, head, tuple(heads), forget)


@dataclass(frozen=True)
class ComputedPlain:
    """A :class:`RunPlain` batch's scores, ``logits [s k]`` in its texts' order (the server's process reads them into
    answers), its phases (see :class:`~service.serving.core.results.Answers`), the CUDA memory after it, and how many
    texts are held."""

    logits: np.ndarray
    phases: dict[str, float]
    memory: list[dict[str, float | str]]
    held: int
