"""The supervisor of a server of several fronts (``ROUTING_WORKERS`` > 1): the ``routing-service serve`` process
itself, which serves nothing (it imports neither torch nor the HTTP stack).

::

    supervisor (routing-service serve)
      ├── engine host (service.serving.host): the models, one batcher per backbone, the backbones' processes
      └── front 0 .. N-1 (service.serving.front): HTTP accepted from one listening socket the supervisor opens
          (a front that dies takes no queued connection with it), gRPC on one port (SO_REUSEPORT); each validating,
          tokenizing and rendering, sending typed messages to the host

It starts the host, waits until its models are loaded, starts the fronts, and starts again a front that exits
while the server runs (after a growing wait when it keeps exiting soon after starting: see :class:`Backoff`; one
that cannot serve the host's models stops the server: it would again). On
SIGTERM (or Ctrl-C) every front drains (new requests 503, accepted ones answered) and exits; then the host, which
has answered them all, exits too.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from prometheus_client import multiprocess

from service.config import Settings
from service.serving.listen import CANNOT_LISTEN, check_ports, shared_socket
from service.serving.observe.logs import setup_logging, warn_unknown_variables

log = logging.getLogger("service.supervisor")
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In a child, before it runs: SIGTERM it when the supervisor exits, however it exits (Linux's
    ``PR_SET_PDEATHSIG``; nothing elsewhere): no front or host is left serving on its own."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _child(module: str, args: list[str], settings: Settings, env: dict[str, str], stdout: int | None = None,
           pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """A fresh interpreter running ``module`` with ``args``, the server's settings as JSON on its standard input."""
    # a session of its own: Ctrl-C reaches the supervisor alone, which stops the children once, in order
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=stdout, env=env,
                            start_new_session=True, preexec_fn=_die_with_parent, pass_fds=pass_fds)
    assert proc.stdin is not None
    proc.stdin.write(settings.model_dump_json(exclude_unset=True).encode())  # what was set stays set (only that)
    proc.stdin.close()
    return proc


class Backoff:
    """When a front that exited starts again: at once after a run of at least ``stable_s``; after a shorter one, in
    ``first_s``, doubling with every short run in a row up to ``max_s`` (a front that dies as it starts, e.g. killed
    for memory, is not started again in a busy loop)."""

    def __init__(self, stable_s: float = 30.0, first_s: float = 1.0, max_s: float = 60.0) -> None:
        self.stable_s, self.first_s, self.max_s = stable_s, first_s, max_s
        self.delay = 0.0

    def exited(self, ran_s: float) -> float:
        """Seconds to wait before starting again a front that exited after ``ran_s`` seconds."""
        self.delay = 0.0 if ran_s >= self.stable_s else min(self.max_s, max(self.first_s, 2 * self.delay))
        return self.delay


def run_supervisor(settings: Settings) -> int:
    """Serve with ``settings.workers`` fronts over one engine host until SIGTERM or Ctrl-C; the exit code (1: the
    models could not be loaded; 3: a front could not listen)."""
    folder = Path(tempfile.mkdtemp(prefix="routing-"))
    try:
        return _supervise(settings, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _supervise(settings: Settings, folder: Path) -> int:
    """:func:`run_supervisor` with ``folder`` for the host's socket and the metrics' files."""
    path = folder / "host.sock"
    (folder / "metrics").mkdir()  # each process's series, merged by whichever front answers /metrics
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder / "metrics")}
    stop, loaded = threading.Event(), threading.Event()
    host = _child("service.serving.host", [str(path)], settings, env, stdout=subprocess.PIPE)

    def on_signal(*_: object) -> None:
        stop.set()
        if not loaded.is_set():  # a signal while the models load stops them instead of waiting for them
            host.terminate()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    assert host.stdout is not None
    line = host.stdout.readline().decode().strip()  # "ready" once the models are loaded
    loaded.set()
    if line != "ready":
        code = host.wait()
        if stop.is_set():
            log.info("stopped while the models loaded")
            return 0
        log.error("exiting: %s", line.removeprefix("failed: ") or f"the engine host exited (code {code})")
        return 1
    try:
        listening = shared_socket(settings.host, settings.port)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, e.strerror or e)
        host.terminate()
        host.wait()
        return CANNOT_LISTEN

    def front(k: int) -> subprocess.Popen[bytes]:
        return _child("service.serving.front", [str(k), str(path), str(listening.fileno())], settings, env,
                      pass_fds=(listening.fileno(),))

    fronts: dict[int, subprocess.Popen[bytes] | None] = {k: front(k) for k in range(settings.workers)}
    started = dict.fromkeys(fronts, time.monotonic())  # when each front started, or is due to start again
    backoff = {k: Backoff() for k in fronts}
    log.info("%d fronts (processes %s) over the engine host (process %d) on %s:%d", settings.workers,
             [p.pid for p in fronts.values() if p], host.pid, settings.host, settings.port)
    code = 0
    while not stop.wait(0.2):
        if host.poll() is not None:
            log.error("the engine host exited (code %s): stopping the fronts", host.returncode)
            code = 1
            break
        for k, proc in fronts.items():
            now = time.monotonic()
            if proc is None:  # waiting to start again
                if now >= started[k]:
                    fronts[k], started[k] = front(k), now
                continue
            if proc.poll() is not None:
                if proc.returncode == 1:  # it cannot serve the host's models: it would not again
                    log.error("front %d exited (code %d): stopping", k, proc.returncode)
                    stop.set()
                    code = proc.returncode
                    break
                multiprocess.mark_process_dead(proc.pid, str(folder / "metrics"))  # its gauges go; counters stay
                delay = backoff[k].exited(now - started[k])
                log.error("front %d exited (code %s) after %.1f s: starting it again%s", k, proc.returncode,
                          now - started[k], f" in {delay:.0f} s (it exited soon after starting)" if delay else "")
                fronts[k], started[k] = None, now + delay
    # every front drains (new requests 503, accepted ones answered) and exits; the host answers what they sent, its
    # batches going without waiting to fill, and exits once they are all gone
    running = [proc for proc in fronts.values() if proc is not None]
    for proc in [*running, host]:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    for proc in running:
        try:
            proc.wait(settings.drain_timeout_s + 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    try:
        host.wait(settings.drain_timeout_s + 10)
    except subprocess.TimeoutExpired:
        host.kill()
        host.wait()
    log.info("stopped")
    return code


def serve(settings: Settings) -> None:
    """``routing-service serve`` with several fronts: exits with :func:`run_supervisor`'s code."""
    setup_logging(settings)
    warn_unknown_variables()
    check_ports(settings)
    sys.exit(run_supervisor(settings))
