"""`routing-service serve`, or a peer framework serving the same model (``service.bench.peers``), in a subprocess
on a free loopback port, for benchmarks and tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self, TypeVar

import httpx


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (Linux; None where it cannot be read):
    0 the state (``T``: stopped), 1 the parent's pid, 3 the session, 11-12 user and system ticks, 13-14 those of
    its exited children."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 14 else None


def cpu_seconds(pid: int, exited_children: bool = False) -> float | None:
    """User + system CPU seconds process ``pid`` has used, or with ``exited_children`` those its children
    that have exited (and been waited for) used (Linux ``/proc``; None where it cannot be read)."""
    fields = _stat(pid)
    if fields is None:
        return None
    first = 13 if exited_children else 11
    return (int(fields[first]) + int(fields[first + 1])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``; empty where it cannot be read)."""
    return [int(entry.name) for entry in Path("/proc").glob("[0-9]*")
            if (fields := _stat(entry.name)) is not None and fields[1] == str(pid)]


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``T``: stopped by a signal; None where it cannot be read)."""
    fields = _stat(pid)
    return None if fields is None else fields[0]


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and those they started, and so on (Linux ``/proc``)."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def pss_bytes(pid: int) -> float | None:
    """Proportional set size of process ``pid`` in bytes (Linux ``/proc/<pid>/smaps_rollup``)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


_GIVEN: set[int] = set()  # the ports free_port() has handed out in this process


def free_port() -> int:
    """A port free on 127.0.0.1 now that this process was not given before: a server's HTTP and gRPC ports are
    asked for one after the other, before either is bound, and the system may offer the same free port twice (a
    test server once got one port for both, and failed to bind the second)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


class ServerProcess:
    """A server in a subprocess of ours: its log, readiness and stop. ``ready``: the ``GET`` path
    that answers 200 once it serves."""

    ready = "/readyz"

    def __init__(self, log_dir: Path, command: list[str], env: dict[str, str], name: str, port: int,
                 cwd: Path | None = None, own_session: bool = False) -> None:
        self.port, self.env = port, env
        self.url = f"http://127.0.0.1:{self.port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}-{self.port}.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd,
                                     start_new_session=own_session)

    def wait_ready(self, timeout: float = 300) -> Self:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}{self.ready}", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        """The end of the server's log."""
        return self.full_log()[-5000:]

    def full_log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def pause(self, timeout: float = 2.0) -> None:
        """Stop (SIGSTOP) the server and every process it started, so that it takes no CPU while another server
        on this machine is measured (an idle framework may poll), and wait until they have stopped (at most
        ``timeout``); :meth:`resume` lets them go on."""
        self._signal_all(signal.SIGSTOP)
        members = self._members()  # stopped or stopping: they start no more
        end = time.monotonic() + timeout
        while time.monotonic() < end and any(process_state(p) not in (None, "T", "t", "Z", "X") for p in members):
            time.sleep(0.002)

    def resume(self) -> None:
        self._signal_all(signal.SIGCONT)

    def _members(self) -> list[int]:
        """The server's process and those it started."""
        return [self.proc.pid, *descendants(self.proc.pid)]

    def _signal_all(self, sig: signal.Signals) -> None:
        if self.proc.poll() is not None:  # exited (its pid may be another process's now)
            return
        for pid in self._members():  # the parent first: it starts no more meanwhile
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, wait for the drain to finish (kill after ``timeout``); the exit code."""
        self.resume()  # a paused server would not act on SIGTERM
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._log.close()


S = TypeVar("S", bound=ServerProcess)


def ready_together(starts: Sequence[Callable[[], S]]) -> list[S]:
    """A server from each of ``starts``, all started before any is waited for (each spends seconds importing and
    loading, mostly on one core), returned once every one answers; if one fails to start, every one started is
    stopped."""
    servers: list[S] = []
    try:
        for start in starts:
            servers.append(start())
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


class LocalServer(ServerProcess):
    """Start the service with ``ROUTING_<NAME>=value`` for every keyword setting; log to ``log_dir``.
    ``checkout``: run the service's code of another checkout of this repository (its root folder) instead of
    this one's, to compare two versions side by side. ``wrap``: a command the service runs under (e.g. a profiler's,
    ending in ``--``)."""

    def __init__(self, log_dir: Path, checkout: Path | None = None, wrap: list[str] | None = None,
                 **settings: object) -> None:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROUTING_")}
        env.update({"ROUTING_HOST": "127.0.0.1", "ROUTING_PORT": str(port), "HF_HUB_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false"})
        env["ROUTING_GRPC_PORT"] = str(free_port())  # gRPC serves as by default, on a port of its own: many servers
        # run side by side (a version without gRPC ignores the variable)
        env.update({f"ROUTING_{k.upper()}": str(v) for k, v in settings.items()})
        if checkout is not None:  # ``-m`` finds the package in the working folder first
            env["PYTHONPATH"] = str(checkout.resolve())
        given = str(settings.get("workers", ""))
        self.fronts = int(given) if given.isdigit() else 0  # 0: as the server chooses (read once it is ready)
        super().__init__(log_dir, [*(wrap or []), sys.executable, "-m", "service", "serve"], env, "server", port,
                         cwd=checkout)

    def wait_ready(self, timeout: float = 300) -> Self:
        super().wait_ready(timeout)
        if not self.fronts:
            self.fronts = fronts_of(self.proc.pid)
        return self

    def cpu(self) -> dict[str, float] | None:
        """CPU seconds used so far by the server's parts (see :func:`server_cpu`)."""
        return server_cpu(self.proc.pid, self.fronts)

    def pss(self) -> dict[str, float] | None:
        """Proportional set size (bytes) of the server's processes (with several fronts: the supervisor, the fronts
        and the engine host) and of the backbones' processes now: shared pages count once over them (Linux
        ``smaps_rollup``; None where unreadable)."""
        server = pss_bytes(self.proc.pid)
        if server is None:
            return None
        backbones = 0.0
        for pid in descendants(self.proc.pid):
            size = pss_bytes(pid)
            if size is None:
                return None
            if is_backbone_process(pid):
                backbones += size
            else:
                server += size
        return {"server": server, "backbones": backbones}


def _runs(pid: int, *modules: bytes) -> bool:
    """Whether process ``pid`` runs one of ``modules`` (its command line names it)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return any(module in cmdline for module in modules)


def server_cpu(pid: int, fronts: int) -> dict[str, float] | None:
    """CPU seconds used so far by the processes of the server of process ``pid`` running ``fronts`` fronts (HTTP,
    tokenizer, batcher: with several fronts, the supervisor, the fronts and the engine host) and by the backbones'
    processes (running, or exited and started again); with several fronts also the engine host's alone (``host``, a
    part of ``server``: it receives every front's texts); None where ``/proc`` cannot be read."""
    server, exited = cpu_seconds(pid), cpu_seconds(pid, exited_children=True)
    if server is None or exited is None:
        return None
    models = 0.0 if fronts > 1 else exited  # the supervisor's exited children are fronts started again
    server += 0.0 if fronts == 1 else exited
    host = 0.0
    for child in descendants(pid):
        own, gone = cpu_seconds(child), cpu_seconds(child, exited_children=True)
        if own is None or gone is None:
            continue  # it exited meanwhile
        if is_backbone_process(child):
            models += own
        else:
            server += own
            models += gone  # the engine host's exited children: backbones' processes
            if fronts > 1 and _runs(child, b"service.serving.host"):
                host += own
    return {"server": server, "models": models, **({"host": host} if fronts > 1 else {})}


def fronts_of(pid: int) -> int:
    """How many fronts the server of process ``pid`` runs (its front processes; one where it answers HTTP itself)."""
    return max(1, sum(_runs(child, b"service.serving.front") for child in descendants(pid)))


BACKBONE_PROCESSES = (b"service.serving.engine.process", b"service.serving.worker")
"""The module a backbone's process runs, by version (``service.serving.worker`` before the package's layers): a
baseline checkout's servers are measured too."""


def is_backbone_process(pid: int) -> bool:
    """Whether process ``pid`` computes a backbone (the main of a module of :data:`BACKBONE_PROCESSES`)."""
    return _runs(pid, *BACKBONE_PROCESSES)


PEERS = {"mosec": ("service.bench.peers.mosec_server", "/inference", "/"),
         "litserve": ("service.bench.peers.litserve_server", "/predict", "/health")}
"""Each peer framework's script, the path it serves the model on, and its readiness path."""


class PeerServer(ServerProcess):
    """A peer framework (a key of :data:`PEERS`) serving ``model`` (a model's folder) with its own dynamic
    batching, in a session of its own (the frameworks start processes of their own; all are stopped together).
    Each batch's size is appended to a file in ``log_dir`` (:meth:`batches`)."""

    def __init__(self, log_dir: Path, peer: str, model: Path, device: str, max_batch_size: int,
                 max_wait_ms: float) -> None:
        module, self.path, self.ready = PEERS[peer]
        port = free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.batch_log = log_dir / f"{peer}-{port}.batches"
        self.batch_log.write_text("")
        env = {**os.environ, "PEER_MODEL": str(model), "PEER_DEVICE": device, "PEER_PORT": str(port),
               "PEER_MAX_BATCH_SIZE": str(max_batch_size), "PEER_MAX_WAIT_MS": str(max_wait_ms),
               "PEER_BATCH_LOG": str(self.batch_log), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        super().__init__(log_dir, [sys.executable, "-m", module], env, peer, port, own_session=True)
        self.name = peer

    def wait_ready(self, timeout: float = 300) -> Self:
        """Ready once the model answers a request (a framework's health path may answer before its worker loaded)."""
        super().wait_ready(timeout)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if httpx.post(f"{self.url}{self.path}", json={"inputs": ["ready?"]}, timeout=30).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} did not answer after {timeout} s:\n{self.log()}")

    def batches(self) -> tuple[int, int]:
        """Texts and batches computed so far."""
        sizes = self.batch_log.read_text().split()
        return sum(map(int, sizes)), len(sizes)

    def cpu(self) -> dict[str, float] | None:
        """CPU seconds of every process of the framework's session so far (running ones; None if unreadable)."""
        total = 0.0
        for pid in self._members():
            if (fields := _stat(pid)) is not None:
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return {"peer": total}

    def _members(self) -> list[int]:
        """Every process of the framework's session."""
        return [int(entry.name) for entry in Path("/proc").glob("[0-9]*")
                if (fields := _stat(entry.name)) is not None and fields[3] == str(self.proc.pid)]

    def _signal_all(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):  # the framework's whole session
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM to the framework's whole session, SIGKILL after ``timeout``."""
        self.resume()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()
        finally:
            self._log.close()
