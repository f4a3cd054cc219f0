"""What the inference layer hands the engine and what it gets back: plain dataclasses, no torch, no HTTP.

A text is tokenized once and asked of one or more heads on one backbone (:class:`Ask`, each with its
:class:`CreditSpec`). The planner cuts it into :class:`ChunkWork` (one per chunk of the heads'
``max_length`` tokens) for the batcher; the batch that encodes the text's last chunk runs every head
asked of it and answers with one :class:`Result` per head. Results carry numbers only: the tokens a
response shows are built from the encoding the front already holds.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

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
class Ask:
    """One head asked of a text: the head's key (see :func:`~service.serving.planner.head_key`; None: the
    engine's only or first head) and its credit (None: scores only)."""

    model: str | None = None
    credit: CreditSpec | None = None


@dataclass(frozen=True)
class Task:
    """One text asked of one head: what :meth:`~service.serving.engine.Engine.run` takes. ``encoding``: the
    text tokenized once for that head's chunk length (the planner tokenizes it only when it is absent)."""

    text: str
    encoding: Encoding | None = None
    model: str | None = None
    credit: CreditSpec | None = None


@dataclass(frozen=True)
class Token:
    """A token position as a response shows it: the token, its character span in the text ((0, 0) for
    special tokens), whether it is special."""

    token: str
    start: int
    end: int
    special: bool


@dataclass
class TargetCredit:
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
    targets: list[TargetCredit]
    matrix: list[list[list[float]]] | None = None
    phi: list[Any] | None = None


@dataclass
class Result:
    """One text's answer from one head; ``error`` (the scores were not finite, or the device could not compute it)
    replaces everything else; ``unavailable``: the error is the device's state, not the text's (out of memory even
    alone): the client may retry."""

    label: str
    scores: dict[str, float]
    credit: Credit | None = None
    error: str | None = None
    unavailable: bool = False


Answer = list[Result]
"""A text's answers, one per :class:`Ask` of its job, in order."""

_JOB_KEYS = itertools.count()


@dataclass(eq=False)
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
        return cls(encoding, tuple(asks), [None] * len(encoding.chunks), len(encoding.chunks))

    def chunks(self) -> list[ChunkWork]:
        """The batcher's units of work for this text, one per chunk."""
        return [ChunkWork(self, k, ids) for k, ids in enumerate(self.encoding.chunks)]


@dataclass(frozen=True, eq=False)
class ChunkWork:
    """The batcher's unit: chunk ``k`` of a text. Its cost is its token count; the text is its group."""

    job: TextJob
    k: int
    ids: tuple[int, ...] = field(repr=False)

    @property
    def cost(self) -> int:
        return len(self.ids)


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


# --- messages between the server's process and a backbone's process (pickled over a pipe) ---

@dataclass(frozen=True)
class LogSetup:
    """How a process of the server logs: one JSON object per line or plain lines, and from which level (the server
    sends its own to each backbone process; see :mod:`service.serving.logs`)."""

    json_lines: bool = False
    level: str = "info"


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


@dataclass(frozen=True)
class Failed:
    """Loading, or a batch, failed: why (``path``: the file of a model folder that failed to load)."""

    error: str
    path: str | None = None


@dataclass(frozen=True)
class RunBatch:
    """Compute these chunks; first forget the texts in ``forget`` (given up by the server)."""

    works: list[ChunkWork]
    forget: list[int]


@dataclass(frozen=True)
class Computed:
    """A batch's answers (see :class:`Answer`), the CUDA memory after it, and how many texts are held."""

    answers: list[Answer | None]
    memory: list[dict[str, float | str]]
    held: int
