"""The messages between the fronts and the engine host (``ROUTING_WORKERS`` > 1): values, typed, encoded by msgspec's
MessagePack, one frame each (a 4-byte length, then the message) on a Unix socket. No working object crosses: a
front sends what the host reads of what it tokenized (each text's chunks of token ids and the heads it asks), the
host answers numbers (:class:`~service.serving.core.results.Result`); each side builds its own objects from them.

A front opens one connection, says :class:`Hello` and gets :class:`Models`; then :class:`Run` (one request's texts
on one backbone) is answered by :class:`Answered` or :class:`Refused` with the same ``id``, and :class:`Cancel`
drops a request whose client has gone. The host sends :class:`Models` again whenever the models it serves change,
and each front answers :class:`Applied`; a repository request a front takes goes to the host as :class:`Control`,
answered by :class:`Controlled` once every front serves the change.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import struct
from collections.abc import Sequence
from typing import Any, Literal, Protocol, TypeVar

import msgspec
import numpy as np

from service.modeling.encoding import Encoding
from service.serving.core import frames
from service.serving.core.results import Answer, Scores
from service.serving.core.work import Ask, TextJob

M = TypeVar("M")
FRAME = struct.Struct("<I")  # a frame's length
MAX_FRAME = 1 << 31


class Hello(msgspec.Struct, tag=True):
    """A front's first message: which front it is (for the host's logs)."""

    front: int


class BackboneInfo(msgspec.Struct):
    """A backbone group as the host serves it: its name, its heads (key -> the model's folder, in loading order),
    each head's description (what ``GET /v1/models/{model}`` says), where it computes."""

    name: str
    folders: dict[str, str]
    descriptions: dict[str, dict[str, Any]]
    device: str
    dtype: str


class Models(msgspec.Struct, tag=True):
    """What the host serves: every backbone group (with every head it holds, retired ones still answering what
    they took included), the head each model's name serves from (``served``: name -> head key), and the model
    behind ``/v1/classify``. ``version`` counts the changes: a front answers :class:`Applied` with it."""

    version: int
    backbones: list[BackboneInfo]
    served: dict[str, str]
    default_model: str | None


class Applied(msgspec.Struct, tag=True):
    """A front serves what :class:`Models` of ``version`` says (the host's change of models returns after every
    front has said so)."""

    version: int


class Control(msgspec.Struct, tag=True):
    """A repository request a front took (Triton's repository extension: ``index``, ``load``, ``unload``), for the
    host's model control to carry out once for the whole server; or the statistics of models ``names`` (``stats``:
    the host counts every front's requests)."""

    id: int
    op: Literal["index", "load", "unload", "stats"]
    name: str = ""
    ready_only: bool = False
    names: list[str] = msgspec.field(default_factory=list)


class Controlled(msgspec.Struct, tag=True):
    """The answer to :class:`Control` ``id``: ``status`` 200 with the index's ``entries`` or the ``stats``, or the
    error's status and message."""

    id: int
    status: int
    message: str = ""
    entries: list[dict[str, str]] = msgspec.field(default_factory=list)
    stats: dict[str, Any] = msgspec.field(default_factory=dict)


class Job(msgspec.Struct, array_like=True):
    """One text's job as the host reads it: its chunks' token ids and the heads asked of it (see
    :class:`~service.serving.core.work.TextJob`). The text's spans and words stay with the front, which renders the
    answer."""

    chunks: tuple[tuple[int, ...], ...]
    asks: tuple[Ask, ...]

    def text_job(self) -> TextJob:
        """The host's own job for the text."""
        return TextJob.of(Encoding.of_chunks(self.chunks), self.asks)


TOKEN = np.dtype("<i4")
"""A token id, or a text's count of them, in :class:`Plain`'s bytes."""
PLAIN_TEXTS = 4
"""The fewest texts a request sends as :class:`Plain`: its arrays cost the host a fixed amount a request (``bench
host`` with its stand-in backbone, the host's CPU a request as arrays against as jobs: 1.4-1.6x for single texts,
0.86x for 4, 0.33x for 16)."""


class Plain(msgspec.Struct, array_like=True):
    """A request's texts where each is one chunk asking the same head, ``model`` (None: the backbone's first), for its
    scores alone: their token ids back to back (``ids``) and each one's count of them (``lengths``), as
    :data:`TOKEN` bytes. The host reads them as arrays and batches them in runs (no object a text)."""

    ids: bytes
    lengths: bytes
    model: str | None

    @classmethod
    def of(cls, jobs: Sequence[TextJob]) -> Plain | None:
        """``jobs`` as one :class:`Plain` where there are :data:`PLAIN_TEXTS` or more and each is a plain text (see
        :attr:`TextJob.plain`) asking the same head; else None."""
        if len(jobs) < PLAIN_TEXTS or not all(job.plain for job in jobs):
            return None
        model = jobs[0].asks[0].model
        if any(job.asks[0].model != model for job in jobs):
            return None
        chunks = [job.encoding.chunks[0] for job in jobs]
        lengths = np.fromiter(map(len, chunks), dtype=TOKEN, count=len(chunks))  # [s]
        ids = np.fromiter(itertools.chain.from_iterable(chunks), dtype=TOKEN, count=int(lengths.sum()))  # [T]
        return cls(ids.tobytes(), lengths.tobytes(), model)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The token ids ``[T]`` and the texts' lengths ``[s]`` (int32).

        Raises:
            ValueError: there is no text, a length is not positive, or they do not add up to the ids sent.
        """
        if len(self.lengths) % TOKEN.itemsize or len(self.ids) % TOKEN.itemsize:
            raise ValueError("plain texts whose token ids or lengths are not whole int32 values")
        lengths = np.frombuffer(self.lengths, dtype=TOKEN).astype(np.int32, copy=False)  # [s]
        ids = np.frombuffer(self.ids, dtype=TOKEN).astype(np.int32, copy=False)  # [T]
        if not len(lengths) or (lengths <= 0).any() or int(lengths.sum()) != len(ids):
            raise ValueError("plain texts whose lengths do not add up to their token ids")
        return ids, lengths


class Run(msgspec.Struct, tag=True):
    """One request's texts on one backbone, to answer before ``deadline`` (``time.monotonic()``, the same clock in
    every process of the machine): as :class:`Plain` where each is a plain text on the same head (``jobs`` empty
    then), else a :class:`Job` each."""

    id: int
    backbone: str
    jobs: list[Job]
    deadline: float
    plain: Plain | None = None

    @classmethod
    def of(cls, k: int, backbone: str, jobs: Sequence[TextJob], deadline: float) -> Run:
        """Request ``k``'s ``jobs``, as plain texts where they are."""
        plain = Plain.of(jobs)
        if plain is not None:
            return cls(k, backbone, [], deadline, plain)
        return cls(k, backbone, [Job(j.encoding.chunks, j.asks) for j in jobs], deadline)


class Cancel(msgspec.Struct, tag=True):
    """The client of request ``id`` has gone: drop what is still queued of it."""

    id: int


class Scored(msgspec.Struct, array_like=True):
    """A :class:`Plain` request's scores, unread (:class:`~service.serving.core.results.Scores`): ``logits [s k]`` as
    float32 bytes, ``k`` of them a text, on head ``key``."""

    logits: bytes
    k: int
    key: str

    @classmethod
    def of(cls, scores: Scores) -> Scored:
        logits = np.ascontiguousarray(scores.logits, dtype=np.float32)  # [s k]
        return cls(logits.tobytes(), logits.shape[1], scores.key)

    def scores(self) -> Scores:
        """As the front reads them.

        Raises:
            ValueError: the bytes are not whole rows of ``k`` float32 values.
        """
        if self.k <= 0 or len(self.logits) % (4 * self.k):
            raise ValueError(f"scores that are not whole rows of {self.k} float32 values")
        return Scores(np.frombuffer(self.logits, dtype=np.float32).reshape(-1, self.k), self.key)


class Answered(msgspec.Struct, tag=True):
    """Request ``id``'s answers, one per job in order; for a :class:`Plain` request, where every text was computed
    plain, its texts' ``scores`` instead (the front reads them: the host makes no object a text)."""

    id: int
    answers: list[Answer]
    scores: Scored | None = None


Refusal = Literal["overloaded", "draining", "deadline", "failed"]


class Refused(msgspec.Struct, tag=True):
    """Request ``id`` got no answers: the queue was full, the server drains, its deadline passed, or its batch
    failed (``message`` says why)."""

    id: int
    kind: Refusal
    message: str


class Scrape(msgspec.Struct, tag=True):
    """A front answers ``/metrics``: the host's own readings (its backbones' processes, CUDA memory), as text."""

    id: int


class Scraped(msgspec.Struct, tag=True):
    """The answer to :class:`Scrape` ``id``: Prometheus text of the host's readings."""

    id: int
    text: bytes


ToHost = Hello | Run | Cancel | Applied | Control | Scrape
ToFront = Models | Answered | Refused | Controlled | Scraped

_encoder = msgspec.msgpack.Encoder()
TO_HOST = msgspec.msgpack.Decoder(ToHost)
TO_FRONT = msgspec.msgpack.Decoder(ToFront)


def frame(msg: ToHost | ToFront) -> bytes:
    """``msg`` as one frame."""
    body = _encoder.encode(msg)
    return FRAME.pack(len(body)) + body


class Writes(Protocol):
    """Where frames go: a stream's writer, or a protocol's transport."""

    def write(self, data: bytes) -> None: ...


class Outbox:
    """A stream's frames written together: every frame given in one turn of the event loop goes out in one write at
    its end (a front sends the requests of every client it read in that turn, the host the answers of a batch, with
    one system call, not one each). Frames go in the order given; a closed stream takes nothing more."""

    def __init__(self, writer: Writes) -> None:
        self.writer = writer
        self._frames: list[bytes] = []

    def put(self, msg: ToHost | ToFront) -> None:
        if not self._frames:
            asyncio.get_running_loop().call_soon(self._flush)
        self._frames.append(frame(msg))

    def _flush(self) -> None:
        data, self._frames = b"".join(self._frames), []
        with contextlib.suppress(ConnectionError, RuntimeError):  # the other side has gone (its reader says so)
            self.writer.write(data)


class Frames(frames.Frames[M]):
    """The messages of a stream's bytes as they arrive (a protocol's ``data_received``), decoded by ``decoder``: no
    coroutine a message, for the engine host's connections, which every request of every front passes through."""

    def __init__(self, decoder: msgspec.msgpack.Decoder[M]) -> None:
        super().__init__(decoder.decode, FRAME)


async def _read(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's body, None at the end of the stream."""
    try:
        head = await reader.readexactly(FRAME.size)
    except asyncio.IncompleteReadError:
        return None
    (n,) = FRAME.unpack(head)
    return await reader.readexactly(n)


async def read_to_front(reader: asyncio.StreamReader) -> ToFront | None:
    body = await _read(reader)
    return None if body is None else TO_FRONT.decode(body)
