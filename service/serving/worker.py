"""A model in a process of its own.

The server's process keeps the HTTP stack, the tokenizer and the batcher; the model's process holds
the weights and computes the batches of chunks the batcher sends it. A model computing in a thread
of the server's process needs the GIL between every two tensor operations and waits for it while the
event loop answers requests; in a process of its own it never does (on two CPU cores, served
throughput at concurrency 32 rose by about 5%, measured in turns by ``bench serve``; see the README).

One pipe carries batches one way and answers the other, one batch at a time (the batcher's thread
waits on it). The model's process keeps the hidden states of texts whose chunks span several
batches; the server tells it which texts it has given up (their ``TextJob`` was freed), so nothing
is held for a text nobody waits for. The model's process ignores SIGINT (Ctrl-C reaches the whole
process group; the server drains first and then closes it), and it exits by itself when the server's
process is gone.

:class:`Replicas` runs several such processes of one model; the batcher gives each its own batches
and keeps a text's chunks on one.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from service.modeling.backbone import BackboneError, ChunkTokenizer
from service.modeling.repository import MANIFEST, ModelLoadError, read_manifest
from service.serving.contract import ChunkWork, Result, TextJob
from service.serving.engine import Planner
from service.threads import available_cpus

log = logging.getLogger("service.worker")


class ModelProcessError(RuntimeError):
    """The model's process failed to load, or exited while computing a batch."""


def _serve(conn: Connection) -> None:
    """The model process's main: load the engine, then answer batches until the server closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from service.serving.engine import Engine
    from service.threads import set_torch_threads

    folder, device, dtype, warmup, torch_threads = conn.recv()
    try:
        set_torch_threads(torch_threads)
        engine = Engine.load(folder, device, dtype, warmup)
    except Exception as e:  # reported to the server, which fails its start with it
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", engine.describe(), str(engine.device), str(engine.dtype).removeprefix("torch."),
               engine.device_memory()))
    held: dict[int, TextJob] = {}  # texts with chunks still to come: their states so far
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the server's process is gone
            return
        if msg is None:
            return
        works, forget = msg
        for key in forget:
            held.pop(key, None)
        works = [_held(w, held) for w in works]
        try:
            answers = engine.run_chunks(works)
        except Exception as e:  # the batch fails (its texts are answered 500); the process goes on
            for w in works:
                held.pop(w.job.key, None)
            conn.send(("error", f"{type(e).__name__}: {e}"))
            continue
        for w in works:
            if w.job.left == 0:
                held.pop(w.job.key, None)
        conn.send(("ok", answers, engine.device_memory(), len(held)))


def _held(work: ChunkWork, held: dict[int, TextJob]) -> ChunkWork:
    """``work`` on the text's job as this process holds it (the one that has its earlier chunks' states)."""
    job = held.setdefault(work.job.key, work.job)
    return work if job is work.job else replace(work, job=job)


class ModelProcess(Planner):
    """A model served from a process of its own; tokenizing and planning stay in this process.

    Args:
        folder: the model's folder.
        device, dtype, warmup: as for :meth:`Engine.load`, in the model's process.
        torch_threads: intra-op threads of the model's process (None: the CPUs it may use).
        chunker: the model's tokenizer when it is already loaded (another process of the same model).

    Raises:
        ModelLoadError: the manifest or the tokenizer cannot be read.
        ModelProcessError: the model's process failed to load the model.
    """

    def __init__(self, folder: Path, device: str = "auto", dtype: str = "float32", warmup: bool = True,
                 torch_threads: int | None = None, chunker: ChunkTokenizer | None = None) -> None:
        manifest = read_manifest(folder)
        if chunker is None:
            try:
                chunker = ChunkTokenizer.load(manifest.backbone.source, manifest.max_length)
            except BackboneError as e:
                raise ModelLoadError(folder / MANIFEST, f"unknown or unloadable backbone: {e}") from e
        super().__init__(manifest, chunker)
        self._args = (folder, device, dtype, warmup, torch_threads)
        self._lock = threading.Lock()  # one batch at a time on the pipe
        self._forget: collections.deque[int] = collections.deque()  # texts given up, to tell the process
        self._watched: set[int] = set()  # texts of several chunks whose freeing is watched
        self._lost: set[int] = set()  # texts with chunks computed by a process that has exited
        self.held_texts = 0  # texts whose states the model's process holds (after the last batch)
        self._memory: list[dict[str, float | str]]  # CUDA memory the model's process reported last
        self._description: dict[str, Any]
        self._start()

    def _start(self) -> None:
        # a fresh interpreter running this module (not a fork of this process and its threads, and no
        # re-import of whatever script started the server), on one end of a socket pair
        ours, theirs = socket.socketpair()
        with theirs:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                          pass_fds=[theirs.fileno()])
        self._conn = Connection(ours.detach())
        try:
            self._conn.send(self._args)
            msg = self._conn.recv()
        except (EOFError, OSError):
            raise ModelProcessError(f"the process of model {self.name} exited while loading "
                                    f"(code {self._proc.wait()})") from None
        if msg[0] == "failed":
            self._proc.wait()
            raise ModelProcessError(msg[1])
        _, self._description, self.device, self.dtype, self._memory = msg
        log.info("model %s computes in process %d", self.name, self._proc.pid)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def describe(self) -> dict[str, Any]:
        return dict(self._description)

    def resident_bytes(self) -> int | None:
        """The model process's resident memory (Linux ``/proc``; None where it cannot be read)."""
        try:
            pages = int(Path(f"/proc/{self._proc.pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            return None
        return pages * os.sysconf("SC_PAGE_SIZE")

    def device_memory(self) -> list[dict[str, float | str]]:
        return list(self._memory)  # as of the last batch (or the warm-up)

    def run_chunks(self, works: list[ChunkWork]) -> list[Result | None]:
        """Compute a batch in the model's process (started again first if it has exited). A text whose
        earlier chunks a process that exited had computed is answered with an error, not computed."""
        with self._lock:
            if self._proc.poll() is not None:
                log.error("the process of model %s had exited (code %s): starting it again", self.name,
                          self._proc.returncode)
                self._conn.close()
                self._lost |= self._watched  # their earlier chunks' states went with it
                self._start()
            answers: list[Result | None] = [None] * len(works)
            send = []
            for pos, w in enumerate(works):
                if w.job.key in self._lost:
                    answers[pos] = Result(label="", scores={}, error=f"the process of model {self.name} exited "
                                          "while this text was being computed")
                    continue
                send.append(pos)
                if len(w.job.states) > 1 and w.job.key not in self._watched:
                    self._watched.add(w.job.key)
                    weakref.finalize(w.job, self._given_up, w.job.key)
            if not send:
                return answers
            forget = [self._forget.popleft() for _ in range(len(self._forget))]
            try:
                self._conn.send(([works[pos] for pos in send], forget))
                msg = self._conn.recv()
            except (EOFError, OSError):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(5)
                raise ModelProcessError(f"the process of model {self.name} exited (code {self._proc.returncode}) "
                                        "while computing this batch; it starts again with the next one") from None
        if msg[0] == "error":
            raise ModelProcessError(msg[1])
        _, computed, self._memory, self.held_texts = msg
        for pos, answer in zip(send, computed, strict=True):
            answers[pos] = answer
        return answers

    def _given_up(self, key: int) -> None:
        self._watched.discard(key)
        self._lost.discard(key)
        self._forget.append(key)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the model's process to exit (after the batch it computes, if any); kill it after ``timeout_s``."""
        with self._lock:
            with contextlib.suppress(OSError):
                self._conn.send(None)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._conn.close()


class Replicas(Planner):
    """Several processes of one model, each computing batches of its own (by default the CPUs this process
    may use, shared among them: one intra-op thread each on two cores). On a 2-core CPU, two processes of
    one thread computed 1.08-1.16x what one process of two threads did offline, and served 1.06-1.31x as
    much in five comparisons (measured in turns; see the README). Each holds a copy of the model's weights.

    Args:
        folder, device, dtype, warmup: as for :class:`ModelProcess`.
        n: processes (at least 2).
        torch_threads: intra-op threads of each (None: the CPUs this process may use, shared among them).

    Raises:
        ModelLoadError, ModelProcessError: as :class:`ModelProcess` (the processes already started are closed).
    """

    def __init__(self, folder: Path, device: str = "auto", dtype: str = "float32", warmup: bool = True,
                 torch_threads: int | None = None, n: int = 2) -> None:
        if n < 2:
            raise ValueError(f"replicas need at least 2 processes, not {n}")
        threads = torch_threads or max(1, available_cpus() // n)
        first = ModelProcess(folder, device, dtype, warmup, threads)
        super().__init__(first.manifest, first.chunker)
        self.processes = [first]
        with ThreadPoolExecutor(n - 1) as pool:  # the others load side by side
            started = [pool.submit(ModelProcess, folder, device, dtype, warmup, threads, first.chunker)
                       for _ in range(n - 1)]
        self.processes += [f.result() for f in started if f.exception() is None]
        failed = next((e for f in started if (e := f.exception()) is not None), None)
        if failed is not None:
            self.close()
            raise failed
        self.device, self.dtype = first.device, first.dtype
        log.info("model %s computes in %d processes of %d torch threads each", self.name, n, threads)

    @property
    def runners(self) -> list[Callable[[list[ChunkWork]], list[Result | None]]]:
        return [p.run_chunks for p in self.processes]

    def run_chunks(self, works: list[ChunkWork]) -> list[Result | None]:
        """Compute a batch in the first process (the batcher spreads batches over :attr:`runners`)."""
        return self.processes[0].run_chunks(works)

    def describe(self) -> dict[str, Any]:
        return self.processes[0].describe()

    def resident_bytes(self) -> int | None:
        readings = [p.resident_bytes() for p in self.processes]
        return None if None in readings else sum(r for r in readings if r is not None)

    def device_memory(self) -> list[dict[str, float | str]]:
        return [d for p in self.processes for d in p.device_memory()]

    def close(self, timeout_s: float = 10.0) -> None:
        """Close every process, side by side (each finishes its batch and exits on its own time)."""
        with ThreadPoolExecutor(len(self.processes)) as pool:
            list(pool.map(lambda p: p.close(timeout_s), self.processes))


if __name__ == "__main__":  # started by ModelProcess with the file descriptor of its end of the socket pair
    _serve(Connection(int(sys.argv[1])))
    # Exit as multiprocessing's children do, without the interpreter's teardown of torch and transformers
    # (1.3 s measured here), which the server's shutdown would wait for: nothing is left to write but stdio.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
