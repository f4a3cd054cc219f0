"""What the engine answers, as plain values (no torch, no HTTP): each text's :class:`Result` per head asked of it
(label, probabilities and, when asked for, its :class:`Credit`), and where a response shows each token
(:class:`TokenSpan`, built by the front from the encoding it holds: results carry numbers only)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.serving.core.work import ChunkWork, Method


@dataclass(frozen=True)
class TokenSpan:
    """A token position as a response shows it: the token, its character span in the text ((0, 0) for
    special tokens), whether it is special."""

    token: str
    start: int
    end: int
    special: bool


@dataclass
class LabelCredit:
    """Credit of one target class.

    Attributes:
        label: the class's label.
        tokens: per token position, summed over depth.
        depth: ``[n_tokens][d_depth]`` per (position, depth); None unless ``detail="full"``.
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
    """One text's credit on one head: each target's numbers; ``matrix`` (``[n][d_depth][n_classes]``) and
    ``phi`` (the three routings') when asked for."""

    method: Method
    contrast: bool
    targets: list[LabelCredit]
    matrix: list[list[list[float]]] | None = None
    phi: list[Any] | None = None


@dataclass(slots=True)
class Result:
    """One text's answer from one head: the label of the highest score, every label's probability (``scores``: a
    softmax over the labels; for a multi-label head a sigmoid each) and the head's raw scores (``logits``, in the
    labels' order); for a multi-label head, ``labels``: those at or over their thresholds. ``error`` (the scores
    were not finite, or the device could not compute it) replaces everything else; ``unavailable``: the error is
    the device's state, not the text's (out of memory even alone): the client may retry."""

    label: str
    scores: dict[str, float]
    logits: list[float] = field(default_factory=list)
    labels: list[str] | None = None
    credit: Credit | None = None
    error: str | None = None
    unavailable: bool = False

    def __reduce__(self) -> tuple[type[Result], tuple[Any, ...]]:
        # pickled as the constructor's arguments, the common case's three alone (every text's result crosses the
        # backbone's pipe): the default pickling, a state dict, costs 1.3x to write and 3x to read back
        if self.labels is None and self.credit is None and self.error is None and not self.unavailable:
            return Result, (self.label, self.scores, self.logits)
        return Result, (self.label, self.scores, self.logits, self.labels, self.credit, self.error, self.unavailable)


Answer = list[Result]
"""A text's answers, one per :class:`Ask` of its job, in order."""


@dataclass(slots=True)
class Scores:
    """Plain texts' scores on head ``key`` as the backbone computed them, ``logits [s k]`` in the texts' order, not
    read into results yet: the engine host answers a front's plain texts so, and the front, which renders
    them, reads them (:func:`~service.serving.engine.scores.read_scores`)."""

    logits: np.ndarray
    key: str


WorkAnswer = Answer | list[Answer] | Scores | None
"""What a batch answers for one unit of work (see :data:`~service.serving.core.work.Work`): a chunk's text's
:data:`Answer` at its last chunk (None at the others); for a run of plain texts, their :class:`Scores`, or each one's
:data:`Answer` in order where its batch was computed text by text."""


class Answers(list):  # type: ignore[type-arg]  # list[Answer | None]
    """A batch's answers, as a runner gives them (each text's at its last chunk's place, None elsewhere), with where
    the engine's time on the batch went: ``phases``, seconds by phase (``encode``: the encoder's forward calls;
    ``heads``: the heads' and their credit's, and on a GPU the wait for the device; ``host``: the engine's own work),
    which the batch's trace reads. A plain list that pickles with its phases (a backbone's process sends it)."""

    phases: dict[str, float]

    def __init__(self, answers: Iterable[Answer | None] = (), phases: dict[str, float] | None = None) -> None:
        super().__init__(answers)
        self.phases = phases or {}


def answers_of(chunks: Sequence[ChunkWork], answers: Sequence[Answer | None]) -> list[Answer]:
    """Each text's answer (given at the place of the chunk whose batch completed it), in the order of the
    texts' first chunks."""
    by_text = {id(w.job): a for w, a in zip(chunks, answers, strict=True) if a is not None}
    return [by_text[id(w.job)] for w in chunks if w.k == 0]
