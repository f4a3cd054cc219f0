"""What routes hand the engine and what they get back: plain dataclasses, no torch, no HTTP.

A route turns a request into :class:`Task` s (one per text, tokenized once), the engine's
:meth:`~service.serving.engine.Planner.plan` cuts each into :class:`ChunkWork` (one per chunk of
``max_length`` tokens) for the batcher, and the batch that computes a text's last chunk answers it
with a :class:`Result`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from service.modeling.encoding import Encoding

Explain = Literal["tokens", "full"]
"""``"tokens"``: credit per token of the targets; ``"full"``: also per (token, depth), for the explain views."""
Method = Literal["contribution", "shares"]


@dataclass(frozen=True)
class Task:
    """One text and what to compute for it.

    ``explain``: None (scores only), ``"tokens"`` or ``"full"`` (see :data:`Explain`); ``targets``:
    the labels to explain (None = the predicted label). ``method`` and ``contrast`` choose the credit
    (see ``service.modeling.classifier``). ``encoding``: the text tokenized once (the engine tokenizes
    it only when it is absent).
    """

    text: str
    encoding: Encoding | None = None
    explain: Explain | None = None
    targets: tuple[str, ...] | None = None
    method: Method = "contribution"
    contrast: bool = True
    include_matrix: bool = False
    include_phi: bool = False


@dataclass(frozen=True)
class Token:
    """A token position: the token, its character span in the text ((0, 0) for special tokens)."""

    token: str
    start: int
    end: int
    special: bool


@dataclass
class TargetCredit:
    """Credit of one target label.

    Attributes:
        tokens: per token position, summed over depth.
        depth: ``[n_tokens][d_depth]`` per (position, depth); None when only token credit was asked for.
        logit, baseline: the explained read-out and its value at zero hidden states
            (``sum(tokens) + baseline == logit``); None for routing shares.
    """

    label: str
    tokens: list[float]
    depth: list[list[float]] | None
    logit: float | None
    baseline: float | None


@dataclass
class Credit:
    """One text's credit: its tokens (every position, special ones included) and each target's credit;
    ``matrix`` (``[n][d_depth][n_classes]``) and ``phi`` (the three routings') when asked for."""

    method: Method
    contrast: bool
    tokens: list[Token]
    word_ids: list[int]
    targets: list[TargetCredit]
    matrix: list[list[list[float]]] | None = None
    phi: list[Any] | None = None


@dataclass
class Result:
    """One text's answer; ``error`` (the text's scores were not finite) replaces everything else."""

    label: str
    scores: dict[str, float]
    credit: Credit | None = None
    error: str | None = None


_JOB_KEYS = itertools.count()


@dataclass(eq=False)
class TextJob:
    """A text on its way through the model: each chunk's hidden states as the batches compute them.
    ``key`` names it across processes (a model process keeps the states of texts it has not finished)."""

    task: Task
    states: list[Any]
    left: int
    key: int = field(default_factory=lambda: next(_JOB_KEYS))

    @property
    def encoding(self) -> Encoding:
        if self.task.encoding is None:
            raise ValueError("a planned task is always encoded")
        return self.task.encoding


@dataclass(frozen=True, eq=False)
class ChunkWork:
    """The batcher's unit: chunk ``k`` of a text. Its cost is its token count; the text is its group."""

    job: TextJob
    k: int
    ids: tuple[int, ...] = field(repr=False)

    @property
    def cost(self) -> int:
        return len(self.ids)


def results_of(chunks: Sequence[ChunkWork], answers: Sequence[Result | None]) -> list[Result]:
    """Each text's answer (given at the place of the chunk whose batch completed it), in the order of the
    texts' first chunks."""
    by_text = {id(w.job): r for w, r in zip(chunks, answers, strict=True) if r is not None}
    return [by_text[id(w.job)] for w in chunks if w.k == 0]
