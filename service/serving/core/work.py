"""The work a request hands the engine, as plain values (no torch, no HTTP): what to compute for a text.

A text is tokenized once and asked of one or more heads on one backbone (:class:`Ask`, each with its
:class:`CreditSpec`). The planner (:mod:`service.serving.engine.planner`) makes it a :class:`TextJob` and cuts
it into :class:`ChunkWork`, one per chunk of the heads' ``max_length`` tokens, for the batcher; the batch that
encodes the text's last chunk runs every head asked of it and answers with the plain numbers of
:mod:`service.serving.core.results`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

from service.modeling.encoding import Encoding

Method = Literal["contribution", "end_to_end", "shares"]
"""``"contribution"``: the value path's exact split of a logit over (token, depth) hidden states; ``"end_to_end"``:
its exact split over the input tokens, through the encoder; ``"shares"``: the paper's eq. 15 shares."""
METHODS: tuple[Method, ...] = get_args(Method)
SPLITS: tuple[Method, ...] = ("contribution", "end_to_end")
"""The methods that split a logit exactly: a logit and a baseline come with their credit."""
Detail = Literal["tokens", "full"]
"""``"tokens"``: credit per token of the targets; ``"full"``: also per (token, depth), for the explain views."""


@dataclass(frozen=True)
class CreditSpec:
    """What credit to compute for a text on one head, travelling from the request to the head and back.

    Attributes:
        method: see :data:`Method`.
        contrast: explain ``logit_k - mean(logits)`` instead of ``logit_k`` (the splits only: for
            shares it is always False).
        targets: class indices to explain; None: the predicted class.
        detail: see :data:`Detail`.
        matrix: also every class's ``[n, d_depth]`` credit (the full matrix).
        phi: also the three routings' ``phi``.
    """

    method: Method = "contribution"
    contrast: bool = True
    targets: tuple[int, ...] | None = None
    detail: Detail = "tokens"
    matrix: bool = False
    phi: bool = False

    def __post_init__(self) -> None:
        if self.method == "shares" and self.contrast:  # the one place the contrast rule lives
            object.__setattr__(self, "contrast", False)


@dataclass(frozen=True)
class TokenIds:
    """Texts a client sent as token ids (vLLM's ``/classify`` takes them): each list is read as it is, the special
    tokens where the client put them, in one chunk. Scores only: credit is shown on a text's characters and words,
    which these have none of."""

    ids: tuple[tuple[int, ...], ...]

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, slots=True)
class Ask:
    """One head asked of a text: the head's key (see :func:`~service.serving.core.keys.head_key`; None: the
    engine's only or first head) and its credit (None: scores only)."""

    model: str | None = None
    credit: CreditSpec | None = None


@dataclass(frozen=True)
class Task:
    """One text asked of one head: what :meth:`~service.serving.engine.engine.Engine.run` takes. ``encoding``: the
    text tokenized once for that head's chunk length (the planner tokenizes it only when it is absent)."""

    text: str
    encoding: Encoding | None = None
    model: str | None = None
    credit: CreditSpec | None = None


_JOB_KEYS = itertools.count()


@dataclass(eq=False, slots=True, weakref_slot=True)  # (the server's process watches a job's end)
class TextJob:
    """A text on its way through the backbone: its encoding, the heads asked of it, and each chunk's hidden
    states as the batches compute them. ``key`` names it across processes (a model process keeps the
    states of texts it has not finished)."""

    encoding: Encoding
    asks: tuple[Ask, ...]
    states: list[Any]
    left: int
    key: int = field(default_factory=lambda: next(_JOB_KEYS))
    failed: str | None = None
    """Why a chunk of the text could not be computed (the device ran out of memory for it alone): the text is
    answered with this error, unavailable, once its last chunk comes."""

    @classmethod
    def of(cls, encoding: Encoding, asks: Sequence[Ask]) -> TextJob:
        if not asks:
            raise ValueError("a text needs at least one head to ask")
        n = len(encoding.chunks)
        return cls(encoding, tuple(asks), [None] * n, n, next(_JOB_KEYS))  # (the key's default costs a call more)

    @property
    def plain(self) -> bool:
        """Whether it is a plain text: one chunk, one head asked of it, no credit, not failed (shape buckets and the
        backbone's pipe take such texts as arrays)."""
        return len(self.states) == 1 and len(self.asks) == 1 and self.asks[0].credit is None and not self.failed

    def chunks(self) -> list[ChunkWork]:
        """The batcher's units of work for this text, one per chunk."""
        return [ChunkWork(self, k, ids) for k, ids in enumerate(self.encoding.chunks)]

    def __reduce__(self) -> tuple[type[TextJob], tuple[Any, ...]]:
        # pickled as the constructor's arguments (every text of a batch crosses the backbone's pipe): a slotted
        # object's default pickling, its state by slot name, costs 1.5x to write and read
        return TextJob, (self.encoding, self.asks, self.states, self.left, self.key, self.failed)


@dataclass(eq=False, slots=True)
class ChunkWork:
    """The batcher's unit: chunk ``k`` of a text. Its cost is its token count; the text is its group. Not changed
    once made (not frozen only because a frozen dataclass sets each field through ``object.__setattr__``: three
    times the cost of making one, for every chunk of every request on the engine's thread)."""

    job: TextJob
    k: int
    ids: tuple[int, ...] = field(repr=False)

    @property
    def cost(self) -> int:
        return len(self.ids)

    @property
    def size(self) -> int:
        """The batcher's parts it is: one chunk (see :attr:`PlainRun.size`)."""
        return 1

    def __reduce__(self) -> tuple[type[ChunkWork], tuple[Any, ...]]:
        return ChunkWork, (self.job, self.k, self.ids)  # (see TextJob.__reduce__)


RUN_TEXTS = 16
"""The most texts a :class:`PlainRun` holds (what a batch that it does not fit into leaves out)."""


@dataclass(eq=False, slots=True)
class PlainRun:
    """Plain texts of one request side by side (see :attr:`TextJob.plain`; the engine host takes a front's plain texts
    so): one unit of the batcher's for several texts, with no object a text. Token ids ``ids [T]`` back to back
    (int32), each text's count of them ``lengths [s]``, each asking head ``model`` (None: the backbone's first) for
    its scores alone; ``cost``: its tokens in all, ``peak``: its longest text's. A batch answers it with each text's
    answer, in order."""

    ids: np.ndarray
    lengths: np.ndarray
    model: str | None
    cost: int
    peak: int

    @classmethod
    def split(cls, ids: np.ndarray, lengths: np.ndarray, model: str | None, most_texts: int = RUN_TEXTS,
              most_tokens: int | None = None) -> list[PlainRun]:
        """A request's plain texts (``ids [T]``, ``lengths [s]``) as runs of at most ``most_texts`` texts and, past
        their first, ``most_tokens`` tokens, in order."""
        ends = np.cumsum(lengths).tolist()  # [s]
        sizes = lengths.tolist()
        most = most_tokens if most_tokens is not None else ends[-1] if ends else 0
        runs, first, start = [], 0, 0  # the run being filled: its first text, its first token
        for t in range(1, len(sizes) + 1):  # the run of texts first..t-1 ends at the last text, or before text t
            # where it is full or text t would take it over ``most_tokens``
            if t == len(sizes) or t - first >= most_texts or ends[t] - start > most:
                end = ends[t - 1]
                runs.append(cls(ids[start:end], lengths[first:t], model, end - start, max(sizes[first:t])))
                first, start = t, end
        return runs

    @property
    def size(self) -> int:
        """Its texts."""
        return len(self.lengths)

    def jobs(self) -> list[TextJob]:
        """Each text's own job (where a batch is computed text by text)."""
        asks = (Ask(self.model),)
        return [TextJob.of(Encoding.of_chunks((ids,)), asks) for ids in per_text(self.ids, self.lengths)]


def per_text(ids: np.ndarray, lengths: np.ndarray) -> list[tuple[int, ...]]:
    """Texts' token ids back to back (``ids [T]``, each text's count ``lengths [s]``) as each text's own."""
    flat, ends = ids.tolist(), np.cumsum(lengths).tolist()  # [T], [s]
    return [tuple(flat[end - n : end]) for end, n in zip(ends, lengths.tolist(), strict=True)]


Work = ChunkWork | PlainRun
"""The batcher's unit of work on a backbone."""


@dataclass(frozen=True)
class RunBatch:
    """A batch of chunks to compute, as the server sends it to a backbone's own process; first forget the texts in
    ``forget`` (given up by the server)."""

    works: list[ChunkWork]
    forget: list[int]
