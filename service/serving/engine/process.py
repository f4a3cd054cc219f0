"""A backbone and its heads in a process of their own.

The server's process keeps the HTTP stack, the tokenizer and the batcher; the backbone's process holds
the weights (one backbone, every head on it) and computes the batches of chunks the batcher sends it,
exchanging the typed messages of :mod:`service.serving.engine.pipe`. A model computing in a thread
of the server's process needs the GIL between every two tensor operations and waits for it while the
event loop answers requests; in a process of its own it never does (on two CPU cores, served
throughput at concurrency 32 rose by about 5%, measured in turns by ``bench serve``; see the README).

One pipe carries batches one way and answers the other, in the order the batches went. The server's event loop reads
it (the batcher awaits each batch there): no thread waits on the pipe, and a batch's answers are read and given to
their requests in the loop's turn their bytes arrive in (an echo of these messages through a worker thread cost 164
us of the server's CPU and 245 us of wall time a round trip here, against 82 and 158 on the loop). With two batches
in flight (``ROUTING_BATCHES_IN_FLIGHT``, a GPU's default) the process submits the next batch before it answers the
one ahead, so that the host's work on one overlaps the device's on the other; a batch that arrives while the process
waits for the device's scores of the one ahead is submitted at once, not after them. The model's process keeps the
hidden states of texts whose chunks span several batches; the server tells it which texts it has given up (their
``TextJob`` was freed), so nothing is held for a text nobody waits for. The model's process ignores SIGINT (Ctrl-C
reaches the whole process group; the server drains first and then closes it), and it exits by itself when the
server's process is gone. :class:`~service.serving.engine.replicas.Replicas` runs several such processes of one
backbone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np

from service.modeling.encoding import Encoding
from service.modeling.manifest import MANIFEST, ModelLoadError, read_manifest
from service.modeling.tokenizer import BackboneError, ChunkTokenizer
from service.serving.core.frames import Frames
from service.serving.core.results import Answer, Answers, Result, Scores, WorkAnswer
from service.serving.core.work import Ask, ChunkWork, PlainRun, RunBatch, TextJob, Work, per_text
from service.serving.engine.compute import AsyncRunner, Compute, Runner
from service.serving.engine.pipe import (
    BucketPlan,
    Computed,
    ComputedPlain,
    Failed,
    HeadsLoaded,
    LoadBackbone,
    Loaded,
    LoadHeads,
    RunPlain,
    UnloadHeads,
)
from service.serving.engine.scores import read_scores
from service.serving.observe import logs

if TYPE_CHECKING:
    from service.serving.engine.engine import Begun, Engine, PlainBegun

log = logging.getLogger("service.process")
T = TypeVar("T")
_SIZE = struct.Struct("!i")  # a frame's size, as multiprocessing's Connection writes it (-1: 8 bytes follow)
_LONG = struct.Struct("!Q")
MEMORY_EVERY_S = 1.0
"""The backbone's process reads the device's memory with a batch at most this often (the reading it sends between)."""


class ModelProcessError(RuntimeError):
    """The backbone's process failed to load, or exited while computing a batch."""


class HeadLoadError(RuntimeError):
    """Heads failed to load onto a running backbone's process (the message names the file and the problem); the
    heads it had are unchanged."""


class MemoryReadings:
    """The device memory a backbone's process sends with each batch's answers: read at most once every ``every_s``
    seconds, the last reading sent in between. A reading walks the caching allocator's statistics on the thread that
    launches the next batch; the metrics are scraped every few seconds."""

    def __init__(self, read: Callable[[], list[dict[str, float | str]]], every_s: float = MEMORY_EVERY_S) -> None:
        self.read, self.every_s = read, every_s
        self.last = read()
        self.at = time.monotonic()

    def __call__(self) -> list[dict[str, float | str]]:
        now = time.monotonic()
        if now - self.at >= self.every_s:
            self.last, self.at = self.read(), now
        return self.last


class Launches:
    """The backbone processes being started (loading their models), so that a server shutting down stops them
    instead of waiting for their loads: after :meth:`stop`, every start still loading, or begun later, fails at
    once with :class:`ModelProcessError`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loading: set[subprocess.Popen[bytes]] = set()
        self.stopped = False

    def add(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._loading.add(proc)
            if self.stopped:
                proc.terminate()

    def discard(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._loading.discard(proc)

    def stop(self) -> int:
        """Terminate every process still loading, and every one started from now on; how many were loading."""
        with self._lock:
            self.stopped = True
            for proc in self._loading:
                proc.terminate()
            return len(self._loading)


def _serve(conn: Connection) -> None:
    """The backbone process's main: load the engine, then answer batches until the server closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    load: LoadBackbone = conn.recv()
    logs.configure(load.log)  # before transformers is imported (its progress bars)
    from service.serving.engine.engine import Engine
    from service.threads import set_torch_threads

    try:
        set_torch_threads(load.torch_threads)
        engine = Engine.load([Path(f) for f in load.folders], load.device, load.dtype, load.warmup, load.keys,
                             load.buckets, load.batch_invariance)
    except Exception as e:  # reported to the server, which fails its start with it
        conn.send(Failed(f"{type(e).__name__}: {e}"))
        return
    memory = MemoryReadings(engine.device_memory)
    conn.send(Loaded({m: engine.describe(m) for m in engine.models}, str(engine.device),
                     str(engine.dtype).removeprefix("torch."), memory.last, plain=engine.bucket_stats is not None))
    held: dict[int, TextJob] = {}  # texts with chunks still to come: their states so far
    begun: Begun | PlainBegun | None = None  # a batch submitted, its answers not sent yet
    while True:
        if begun is not None and not _message_first(conn, engine, begun):  # no batch behind it: answer it
            _complete(engine, begun, held, conn, memory)
            begun = None
            continue
        try:
            msg: RunBatch | RunPlain | LoadHeads | UnloadHeads | None = conn.recv()
        except EOFError:  # the server's process is gone
            return
        if not isinstance(msg, RunBatch | RunPlain):  # heads change, or the server closes, between two batches
            if begun is not None:
                _complete(engine, begun, held, conn, memory)
                begun = None
            if msg is None:
                return
            conn.send(_change_heads(engine, msg))
            continue
        for key in msg.forget:
            held.pop(key, None)
        works: list[ChunkWork] = []
        following: Begun | PlainBegun | Exception | None
        try:  # submitted before the batch ahead of it is answered: the device computes that one meanwhile
            following = (engine.begin_plain(msg.ids, msg.lengths, msg.head, msg.heads) if isinstance(msg, RunPlain)
                         else None)
            if following is None:  # (a plain batch that cannot run in a shape bucket: as chunks)
                works = _plain_works(msg) if isinstance(msg, RunPlain) else [_held(w, held) for w in msg.works]
                following = engine.begin(works)
        except Exception as e:
            following = e
        if begun is not None:
            _complete(engine, begun, held, conn, memory)
        begun = None
        if isinstance(following, Exception):
            _failed(works, following, held, conn)
        else:
            begun = following


def _message_first(conn: Connection, engine: Engine, begun: Begun | PlainBegun) -> bool:
    """Whether a message (the next batch) comes before ``begun`` is computed: then it is received, and a batch begun
    (queued on the device behind this one), before this one is completed, so that the device does not idle on the
    next batch's launch while the process waits for this one's scores. Checked in a spin while the device computes
    (as waiting for it spins); where nothing is left to wait for (a CPU), whether one is there already."""
    while not conn.poll():
        if engine.computed(begun):
            return False
    return True


def _complete(engine: Engine, begun: Begun | PlainBegun, held: dict[int, TextJob], conn: Connection,
              memory: MemoryReadings) -> None:
    """Send a begun batch's answers (or why it failed), forgetting the texts it completed, and the device's memory."""
    from service.serving.engine.engine import PlainBegun

    if isinstance(begun, PlainBegun):  # its scores alone
        try:
            logits, phases = engine.complete_plain(begun)
        except Exception as e:
            _failed([], e, held, conn)
            return
        conn.send(ComputedPlain(logits, phases, memory(), len(held)))
        return
    try:
        answers = engine.complete(begun)
    except Exception as e:
        _failed(begun.works, e, held, conn)
        return
    if held:
        for w in begun.works:
            if w.job.left == 0:
                held.pop(w.job.key, None)
    conn.send(Computed(answers, memory(), len(held)))


def _failed(works: list[ChunkWork], e: Exception, held: dict[int, TextJob], conn: Connection) -> None:
    """A batch failed: its texts are answered 500 with why, and forgotten; the process goes on."""
    for w in works:
        held.pop(w.job.key, None)
    conn.send(Failed(f"{type(e).__name__}: {e}"))


def _change_heads(engine: Engine, msg: LoadHeads | UnloadHeads) -> HeadsLoaded | Failed:
    """Load or drop heads between two batches; a head that fails to load leaves the others as they were."""
    if isinstance(msg, UnloadHeads):
        engine.remove_heads(msg.keys)
        return HeadsLoaded({})
    try:
        engine.add_heads([Path(f) for f in msg.folders], msg.keys, msg.warmup)
    except ModelLoadError as e:  # a damaged folder: the server raises it again, naming the file and the problem
        return Failed(e.problem, path=str(e.path))
    except Exception as e:
        return Failed(f"{type(e).__name__}: {e}")
    return HeadsLoaded({k: engine.describe(k) for k in msg.keys})


def _computed_part(works: list[ChunkWork]) -> list[ChunkWork]:
    """``works`` as the backbone's process reads them: each text's job with its token ids alone (the spans, special
    tokens and words stay in the server's process, which renders the answer): about half the pickled bytes."""
    jobs: dict[int, TextJob] = {}
    out = []
    for w in works:
        if w.job.encoding.bare:  # ids alone already (a front tokenized the text): sent as it is
            out.append(w)
            continue
        job = jobs.get(w.job.key)
        if job is None:
            job = jobs[w.job.key] = TextJob(Encoding.of_chunks(w.job.encoding.chunks), w.job.asks, w.job.states,
                                            w.job.left, w.job.key, w.job.failed)
        out.append(ChunkWork(job, w.k, w.ids))
    return out


def _plain_batch(works: list[Work], forget: list[int]) -> RunPlain | None:
    """``works`` as a :class:`RunPlain` where every one is a plain text's (see :attr:`TextJob.plain`) or a run of them
    (their texts in order, each run's in its place); else None."""
    if not all(type(w) is PlainRun or w.job.plain for w in works):
        return None
    if not any(type(w) is PlainRun for w in works):
        return RunPlain.of([(w.ids, w.job.asks[0].model) for w in works], forget)
    heads: dict[str | None, int] = {}  # each head asked, by its place
    ids: list[np.ndarray] = []  # [T] in parts
    lengths: list[np.ndarray] = []  # [s] in parts
    head: list[np.ndarray] = []  # [s] in parts
    chunks: list[ChunkWork] = []  # plain texts' chunks since the last run

    def flush() -> None:
        if chunks:
            part = RunPlain.of([(w.ids, w.job.asks[0].model) for w in chunks], [])
            ids.append(part.ids)
            lengths.append(part.lengths)
            head.append(np.array([heads.setdefault(key, len(heads)) for key in part.heads], np.int32)[part.head])
            chunks.clear()

    for w in works:
        if type(w) is PlainRun:
            flush()
            ids.append(w.ids)
            lengths.append(w.lengths)
            head.append(np.full(w.size, heads.setdefault(w.model, len(heads)), np.int32))
        else:
            chunks.append(w)
    flush()
    return RunPlain(np.concatenate(ids).astype(np.int32, copy=False),
                    np.concatenate(lengths).astype(np.int32, copy=False), np.concatenate(head), tuple(heads), forget)


def _text_by_text(works: list[Work]) -> list[ChunkWork]:
    """``works`` as chunks, each run's texts as jobs of their own in its place (a batch computed text by text)."""
    return [c for w in works for c in ([j.chunks()[0] for j in w.jobs()] if type(w) is PlainRun else [w])]


def _per_work(works: list[Work], answers: Sequence[Answer | None]) -> list[WorkAnswer]:
    """Each work's answer from its texts' (in order, each run's texts in its place, as :func:`_text_by_text` gives
    them): a chunk's own, a run's list of its texts'."""
    if not any(type(w) is PlainRun for w in works):
        return list(answers)
    out: list[WorkAnswer] = []
    at = 0
    for w in works:
        out.append(cast(list[Answer], answers[at:at + w.size]) if type(w) is PlainRun else answers[at])
        at += w.size
    return out


def _plain_works(msg: RunPlain) -> list[ChunkWork]:
    """A :class:`RunPlain` batch as the chunks of its texts (where it cannot run in a shape bucket)."""
    asks = [(Ask(key),) for key in msg.heads]
    return [ChunkWork(TextJob(Encoding.of_chunks((ids,)), asks[h], [None], 1), 0, ids)
            for ids, h in zip(per_text(msg.ids, msg.lengths), msg.head.tolist(), strict=True)]


def _held(work: ChunkWork, held: dict[int, TextJob]) -> ChunkWork:
    """``work`` on the text's job as this process holds it (the one that has its earlier chunks' states; a text of
    one chunk is never held)."""
    if len(work.job.states) == 1:
        return work
    job = held.setdefault(work.job.key, work.job)
    return work if job is work.job else replace(work, job=job)


class _Link(asyncio.Protocol):
    """The server's end of the pipe to a backbone's process, on an event loop: each message pickled into the frame
    :class:`~multiprocessing.connection.Connection` reads (the process's end is one), the replies read as their bytes
    arrive and each given to the message it answers (the process answers in the order its messages went). No thread
    waits on the pipe: a batch's answers are read in the loop's turn their bytes arrive in."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False  # the process's end has closed (or this end was closed)
        self._waiting: collections.deque[asyncio.Future[Any]] = collections.deque()  # replies due, in order
        self._frames: Frames[Any] = Frames(pickle.loads, _SIZE, _LONG)  # the replies' frames

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def send(self, msg: Any) -> asyncio.Future[Any]:
        """Send ``msg``: the future of its reply (EOFError where the process has gone). What cannot be pickled
        raises here, and nothing was sent."""
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        frame = _frame(msg)
        if self.lost or self.transport is None:
            reply.set_exception(EOFError("the backbone's process has gone"))
            return reply
        self.transport.write(frame)
        self._waiting.append(reply)
        return reply

    def data_received(self, data: bytes) -> None:
        for msg in self._frames.feed(data):
            reply = self._waiting.popleft()
            if not reply.done():  # (a batch cancelled at shutdown: its reply is read and dropped)
                reply.set_result(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        while self._waiting:
            reply = self._waiting.popleft()
            if not reply.done():
                reply.set_exception(EOFError("the backbone's process has gone"))

    def close(self) -> None:
        """Close this end; the replies still due fail now."""
        if self.transport is not None:
            self.transport.close()
        self.connection_lost(None)


def _frame(msg: Any) -> bytes:
    """``msg`` pickled in a frame as :class:`~multiprocessing.connection.Connection` writes and reads one."""
    body = pickle.dumps(msg)  # (the protocol Connection pickles with)
    n = len(body)
    return (_SIZE.pack(n) if n <= 0x7FFFFFFF else _SIZE.pack(-1) + _LONG.pack(n)) + body


class BackboneProcess(Compute):
    """A backbone and its heads served from a process of their own; tokenizing and planning stay in this one.

    The pipe to the process is read on an event loop: the server's once :meth:`attach` ran on it (its batcher
    awaits each batch there: no thread a batch, and a batch's answers read in the loop's turn they arrive in), else
    a loop of this object's own in a thread, for blocking calls (benches, tests, a change of heads from a thread).

    Args:
        folders: the folders of the models on this backbone (their manifests name the same one).
        device, dtype, warmup, buckets, batch_invariance: as for :meth:`Engine.load`, in the backbone's process.
        torch_threads: intra-op threads of the backbone's process (None: the CPUs it may use).
        chunker: the backbone's tokenizer when it is already loaded (another process of the same backbone).
        launches: where the process is registered while it loads (a server shutting down stops it there).
        in_flight: batches the process may hold at once (the batcher's runners on it): with 2, the next batch is
            submitted while the device computes one (on a GPU: its host work overlaps the device's).

    Raises:
        ModelLoadError: a manifest or the tokenizer cannot be read.
        ModelProcessError: the backbone's process failed to load the models, or was stopped while loading.
    """

    def __init__(self, folders: Path | list[Path], device: str = "auto", dtype: str = "auto", warmup: bool = True,
                 torch_threads: int | None = None, chunker: ChunkTokenizer | None = None,
                 keys: list[str] | None = None, launches: Launches | None = None,
                 buckets: BucketPlan | None = None, in_flight: int = 1, batch_invariance: str = "off") -> None:
        folders = [folders] if isinstance(folders, Path) else list(folders)
        manifests = [read_manifest(f) for f in folders]
        if chunker is None:
            try:
                chunker = ChunkTokenizer.load(manifests[0].backbone.source)
            except BackboneError as e:
                raise ModelLoadError(folders[0] / MANIFEST, f"unknown or unloadable backbone: {e}") from e
        super().__init__(manifests, chunker, keys)
        self._folders = dict(zip(self.models, folders, strict=True))  # head key -> its model's folder
        self._load = LoadBackbone(tuple(str(f) for f in folders), tuple(self.models), device, dtype, warmup,
                                  torch_threads, logs.current(), buckets or BucketPlan(), batch_invariance)
        self._launches = launches or Launches()
        self.in_flight = in_flight
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that reads the pipe (see attach)
        self._loop_thread: int | None = None  # its thread
        self._own: threading.Thread | None = None  # the thread of a loop of this object's own, where none attached it
        self._attaching = threading.Lock()
        self._lock: asyncio.Lock  # one message at a time onto the pipe, and a restart between two (on the loop)
        self._link: _Link | None = None  # the pipe, read on the loop
        self._forget: collections.deque[int] = collections.deque()  # texts given up, to tell the process
        self._watched: set[int] = set()  # texts of several chunks whose freeing is watched
        self._lost: set[int] = set()  # texts with chunks computed by a process that has exited
        self.held_texts = 0  # texts whose states the backbone's process holds (after the last batch)
        self._restarts = 0  # times the process was started again after it exited
        self._memory: list[dict[str, float | str]]  # CUDA memory the backbone's process reported last
        self._descriptions: dict[str, dict[str, Any]]
        self._start()

    def _start(self) -> None:
        """Start the process and wait for its models to load (blocking: in a thread of its own when it restarts).
        A fresh interpreter running this module (not a fork of this process and its threads, and no re-import of
        whatever script started the server), on one end of a socket pair."""
        ours, theirs = socket.socketpair()
        with theirs:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                          pass_fds=[theirs.fileno()])
        self._launches.add(self._proc)
        try:
            with Connection(os.dup(ours.fileno())) as conn:  # the load, blocking; the loop reads the pipe after it
                conn.send(self._load)
                msg: Loaded | Failed = conn.recv()
        except (EOFError, OSError):
            ours.close()
            code = self._proc.wait()
            if self._launches.stopped:
                raise ModelProcessError(f"the process of backbone {self.name} was stopped while loading: the "
                                        "server is shutting down") from None
            raise ModelProcessError(f"the process of backbone {self.name} exited while loading (code {code})") from None
        finally:
            self._launches.discard(self._proc)
        if isinstance(msg, Failed):
            ours.close()
            self._proc.wait()
            raise ModelProcessError(msg.error)
        self._sock = ours
        self._descriptions, self.device, self.dtype, self._memory = msg.descriptions, msg.device, msg.dtype, msg.memory
        self._plain = msg.plain  # its plain batches go as arrays (RunPlain)
        log.info("backbone %s (models %s) computes in process %d", self.name, self.models, self._proc.pid)

    async def attach(self) -> None:
        """Read the pipe on the running event loop from now on: :attr:`runners` are coroutine functions there (the
        blocking calls, from other threads, are carried out there too)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None:
            raise RuntimeError(f"the pipe of backbone {self.name} is read on another event loop")
        self._loop, self._loop_thread = loop, threading.get_ident()
        self._lock = asyncio.Lock()
        self._link = await self._connect()

    async def _connect(self) -> _Link:
        _, link = await asyncio.get_running_loop().connect_accepted_socket(_Link, self._sock)
        return link

    def _on_loop(self, work: Coroutine[Any, Any, T]) -> T:
        """Await ``work`` on the loop that reads the pipe, from another thread (a blocking call); where none was
        attached, a loop of this object's own, in a thread of its own, is started first."""
        with self._attaching:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._own = threading.Thread(target=loop.run_forever, name=f"pipe-{self.name}", daemon=True)
                self._own.start()
                asyncio.run_coroutine_threadsafe(self.attach(), loop).result()
        assert self._loop is not None
        if threading.get_ident() == self._loop_thread:
            work.close()
            raise RuntimeError(f"a blocking call to backbone {self.name} on the loop that reads its pipe would wait "
                               "for itself: await it")
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def describe(self, model: str) -> dict[str, Any]:
        return dict(self._descriptions[model])

    def resident_bytes(self) -> int | None:
        """The backbone process's resident memory (Linux ``/proc``; None where it cannot be read)."""
        try:
            pages = int(Path(f"/proc/{self._proc.pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            return None
        return pages * os.sysconf("SC_PAGE_SIZE")

    def restarts(self) -> int:
        return self._restarts

    def device_memory(self) -> list[dict[str, float | str]]:
        return list(self._memory)  # as the process last read it (with a batch, at most once a second)

    @property
    def runners(self) -> list[Runner] | list[AsyncRunner]:
        """One for each batch the process may hold at once (see ``in_flight``): coroutine functions once attached to
        a server's loop (see :meth:`attach`), else blocking ones."""
        if self._loop is not None and self._own is None:
            return [self.arun_chunks] * self.in_flight
        return [self.run_chunks] * self.in_flight

    @property
    def runner_devices(self) -> list[str]:
        return [str(self.device)] * self.in_flight

    @property
    def takes_runs(self) -> bool:  # type: ignore[override]
        """Where the process computes plain batches as such (in shape buckets), runs of plain texts too: they go to it
        as arrays, and their scores come back unread."""
        return self._plain

    def run_chunks(self, works: list[Work]) -> list[WorkAnswer]:  # type: ignore[override]  # (runs too)
        """:meth:`arun_chunks`, waited for (not on the loop that reads the pipe)."""
        return self._on_loop(self.arun_chunks(works))

    async def arun_chunks(self, works: list[Work]) -> list[WorkAnswer]:
        """Compute a batch in the backbone's process (started again first if it has exited), on the loop that reads
        its pipe: chunks, each text answered at its last chunk's place, and runs of plain texts, each answered with
        its texts' answers. A text whose earlier chunks a process that exited had computed is answered with an error,
        not computed. A process that exits while computing the batch (killed, or dead just before the batch reached
        it) is started again and the batch computed once more; a second exit fails the batch. Batches sent by several
        runners (``in_flight``) are answered in the order they went."""
        for attempt in (1, 2):
            async with self._lock:
                if self._proc.poll() is not None:
                    log.error("the process of backbone %s had exited (code %s): starting it again", self.name,
                              self._proc.returncode)
                    await self._restart()
                answers, send = self._sendable(works)
                if not send:
                    return answers
                forget = [self._forget.popleft() for _ in range(len(self._forget))]
                sent = [works[pos] for pos in send]
                batch = (self._plain and _plain_batch(sent, forget)) or RunBatch(_computed_part(_text_by_text(sent)),
                                                                                 forget)
                reply = self._send(batch)
            try:
                msg: Computed | ComputedPlain | Failed = await reply
                break
            except EOFError:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.to_thread(self._proc.wait, 5)
                if attempt == 2:
                    raise ModelProcessError(f"the process of backbone {self.name} exited (code "
                                            f"{self._proc.returncode}) twice while computing this batch; it "
                                            "starts again with the next one") from None
                log.error("the process of backbone %s exited (code %s) while computing a batch: computing it "
                          "again", self.name, self._proc.returncode)
        if isinstance(msg, Failed):
            raise ModelProcessError(msg.error)
        self._memory, self.held_texts = msg.memory, msg.held
        if isinstance(msg, ComputedPlain):  # the process sent the scores alone: the chunks' read here, the runs'
            # left to whoever renders them
            got, phases = self._read_plain(sent, msg.logits), msg.phases
        else:
            got, phases = _per_work(sent, msg.answers), getattr(msg.answers, "phases", None)
        for pos, answer in zip(send, got, strict=True):
            answers[pos] = answer
        return Answers(answers, phases)

    def _read_plain(self, works: list[Work], logits: np.ndarray) -> list[WorkAnswer]:
        """Each work's answer from a plain batch's ``logits [s k]`` (its texts in :func:`_plain_batch`'s order): a
        chunk's text read into its results, a run's rows as its :class:`Scores`."""
        if not any(type(w) is PlainRun for w in works):
            keys = [w.job.asks[0].model or self.default for w in works]
            return [[r] for r in read_scores(logits, keys, self.manifests)]
        rows: list[int] = []  # the chunks' texts' rows
        out: list[WorkAnswer] = []
        at = 0
        for w in works:
            if type(w) is PlainRun:
                out.append(Scores(logits[at:at + w.size], w.model or self.default))
                at += w.size
            else:
                rows.append(at)
                out.append(None)
                at += 1
        if rows:
            chunks = [w for w in works if type(w) is not PlainRun]
            keys = [w.job.asks[0].model or self.default for w in chunks]
            read = iter(read_scores(logits[rows], keys, self.manifests))
            out = [w if type(w) is Scores else [next(read)] for w in out]
        return out

    def _send(self, msg: RunBatch | RunPlain | LoadHeads | UnloadHeads) -> asyncio.Future[Any]:
        """Send ``msg`` (on the loop, holding :attr:`_lock`): the future of its reply, which fails with EOFError
        where the process has gone (or goes before answering)."""
        assert self._link is not None
        return self._link.send(msg)

    async def _restart(self) -> None:
        """Start the process again (on the loop, holding :attr:`_lock`; its load in a thread): replies awaited from
        the one that exited fail."""
        assert self._link is not None
        self._link.close()
        self._lost |= self._watched  # their earlier chunks' states went with it
        self._restarts += 1
        await asyncio.get_running_loop().run_in_executor(None, self._start)
        self._link = await self._connect()

    def _sendable(self, works: list[Work]) -> tuple[list[WorkAnswer], list[int]]:
        """The answers known before computing (an error for a text whose earlier chunks were lost with an exited
        process) and the positions of the work to send; texts of several chunks are watched from now on."""
        answers: list[WorkAnswer] = [None] * len(works)
        send = []
        for pos, w in enumerate(works):
            if type(w) is PlainRun:  # texts of one chunk: nothing of them was held
                send.append(pos)
                continue
            if w.job.key in self._lost:
                lost = Result(label="", scores={}, error=f"the process of backbone {self.name} exited while "
                              "this text was being computed")
                answers[pos] = [lost for _ in w.job.asks]
                continue
            send.append(pos)
            if len(w.job.states) > 1 and w.job.key not in self._watched:
                self._watched.add(w.job.key)
                weakref.finalize(w.job, self._given_up, w.job.key)
        return answers, send

    def add_heads(self, folders: Sequence[Path], keys: Sequence[str], warmup: bool = True) -> None:
        manifests = {k: read_manifest(Path(f)) for f, k in zip(folders, keys, strict=True)}
        msg = self._on_loop(self._ask(LoadHeads(tuple(str(f) for f in folders), tuple(keys), warmup)))
        if isinstance(msg, Failed):
            raise ModelLoadError(Path(msg.path), msg.error) if msg.path is not None else HeadLoadError(msg.error)
        self.add(manifests)
        self._folders.update(zip(keys, map(Path, folders), strict=True))
        self._descriptions = {**self._descriptions, **msg.descriptions}
        self._restart_with()

    def remove_heads(self, keys: Sequence[str]) -> None:
        """Drop heads ``keys``. A process that has exited holds no heads: they are gone all the same, and the process
        started again for the next batch loads only the others."""
        try:
            self._on_loop(self._ask(UnloadHeads(tuple(keys))))
        except ModelProcessError as e:
            log.warning("%s: heads %s are dropped with it", e, list(keys))
        self.remove(keys)
        self._descriptions = {k: d for k, d in self._descriptions.items() if k not in keys}
        self._folders = {k: f for k, f in self._folders.items() if k not in keys}
        self._restart_with()

    async def _ask(self, msg: LoadHeads | UnloadHeads) -> HeadsLoaded | Failed:
        """Send a change of heads between two batches and wait for its answer."""
        async with self._lock:  # no batch goes meanwhile; those sent before are answered first
            try:
                reply: HeadsLoaded | Failed = await self._send(msg)
                return reply
            except EOFError:
                raise ModelProcessError(f"the process of backbone {self.name} exited while changing its heads "
                                        f"(code {self._proc.poll()})") from None

    def _restart_with(self) -> None:
        """What a restart of the backbone's process loads from now on: the heads it holds now."""
        folders = tuple(str(self._folders[k]) for k in self.models)
        self._load = replace(self._load, folders=folders, keys=tuple(self.models))

    def _given_up(self, key: int) -> None:
        self._watched.discard(key)
        self._lost.discard(key)
        self._forget.append(key)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the backbone's process to exit (after the batches it holds); kill it after ``timeout_s``. Not on the
        loop that reads the pipe (where that loop has stopped, the process is terminated)."""
        loop = self._loop
        reachable = loop is not None and loop.is_running() and threading.get_ident() != self._loop_thread
        if loop is None:  # never read on a loop: the pipe is still a blocking socket
            with contextlib.suppress(OSError):
                self._sock.sendall(_frame(None))
        elif reachable:
            self._on_loop(self._goodbye())
        else:
            self._proc.terminate()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if reachable and self._link is not None:
            self._on_loop(self._end())
        else:
            self._sock.close()
        if loop is not None and self._own is not None and not loop.is_closed():  # (closed once already)
            loop.call_soon_threadsafe(loop.stop)
            self._own.join()
            loop.close()

    async def _goodbye(self) -> None:
        """Tell the process to exit, after the messages sent before (it answers nothing); where its pipe is not read
        on the loop (a restart stopped at shutdown), close it: the process reads its end and exits."""
        async with self._lock:
            if self._link is not None and self._link.transport is not None and not self._link.lost:
                self._link.transport.write(_frame(None))
            else:
                self._sock.close()

    async def _end(self) -> None:
        assert self._link is not None
        self._link.close()


if __name__ == "__main__":  # started by BackboneProcess with the file descriptor of its end of the socket pair
    _serve(Connection(int(sys.argv[1])))
    # Exit as multiprocessing's children do, without the interpreter's teardown of torch and transformers
    # (1.3 s measured here), which the server's shutdown would wait for: nothing is left to write but stdio.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
