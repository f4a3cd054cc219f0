"""`routing-service bench gpu`: the engine's and the served numbers of a device in one run, one JSON.

Every measurement the GPU issues ask for, made the way the server computes, each section on its own (one that
fails records its error and the run goes on):

- ``engine``: texts/s of the engine alone on token ids (tokenizing is the fronts' work) by token budget, this
  version against another (``--baseline``: a folder holding that version's ``service`` package, e.g. a
  ``git worktree`` of it) in turns, each in a process of its own computing on its main thread (the processes
  started together, their imports side by side, each engine loaded in turn); with each, the
  host's microseconds per text (everything but the encoder's and heads' forward calls and the wait for the
  device, timed without the profiler, where the version keeps that clock). This version's engine (``current``) runs
  as the server's defaults have it on the device: in captured shape buckets on a GPU (:data:`SERVED_ENGINE_ON_GPU`),
  and each ``--variant`` is those settings with its own over them (``buckets=off``: the eager engine);
- ``profile``: kernels executed, copies, device-busy milliseconds and torch operators per batch at the default
  budget, from a torch profile; the device-busy share is its busy time over the unprofiled time per batch;
- ``latency``: one text a batch, p50, p90 and p99 milliseconds, every version;
- ``gpu_tests``: the tests marked ``gpu`` (``pytest -m gpu``), skipped without a GPU;
- ``accuracy``: the test texts' accuracy in float32 and in the default precision (bfloat16 on a GPU), the largest
  probability change between them, and between each text alone and in mixed batches (each text whose label changed
  named, with its margins: :func:`alone_vs_mixed`);
- ``head_precision``: the same for the heads' scores in float32 against bfloat16 (``Engine.head_dtype``), the
  backbone in its default precision (``--variant buckets=off,head_dtype=bfloat16`` measures their speed in the
  engine's turns);
- ``buckets``: the same for plain batches in shape buckets (``Engine.use_buckets``: captured as CUDA graphs on a
  GPU, padded eagerly on a CPU) against none, the heads' products in bfloat16 in both (as ``cuda`` computes them),
  and what the warm-up took (``--variant buckets=off`` measures the eager engine's speed in the turns, on a GPU);
- ``invariance`` (with ``--invariance``): the engine as served against each candidate's settings (e.g.
  ``batch_invariance=kernels``) on the labelled texts: accuracy, each text alone against mixed batches, where the
  texts that moved most part depth by depth, and texts/s in turns (:func:`invariance`);
- ``served``: the server started on the device, driven by clients in several processes (one aiohttp process tops
  out near 3,500 requests/s) with its default fronts (their number recorded): single-text requests at the given
  concurrencies and 16-text requests, requests and texts per second, p50 and p99. In this section, ``beside`` and
  the served variants the load processes run on cores of their own where the machine has them to spare, every
  server on the rest (:mod:`service.bench.cpus`; both recorded);
- ``beside``: single-text requests at the peer levels to this service with its default fronts and with other
  numbers of them (how many fronts a device needs), and to mosec and LitServe with this version's engine inside, in
  turns;
- ``routing_headline``: the reference library's headline (``bench routing --headline``): 1,000,000 vectors of
  1,024 features routed to 100 of 1,024 in float32 with gradients, peak device memory against its stated ~18 GB;
- ``served_variant``, ``served_variant_2``, ... (one for each ``--served-variant``, the run's last): the server
  again with settings over its defaults (e.g. one batch in flight, a shorter wait for a batch to fill, no buckets):
  its time to ready (which includes capturing the buckets' graphs), at every level of ``served``.

Each section's wall seconds are kept beside them (``seconds``; the summary's ``section_seconds``), so that the run's
sizes can be fitted to a device call's time.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from service.bench import report
from service.bench.cpus import CpuSplit, current, pinned
from service.bench.report import ROOT

WORKER = Path(__file__).with_name("engine_worker.py")


SERVED_ENGINE_ON_GPU = {"buckets": "cuda"}
"""The engine's settings the server's defaults give on a GPU (``ROUTING_BUCKETS=auto``), where ``bench gpu`` measures
this version's engine (``current``) as it serves."""

IN_FLIGHT = ", two in flight"
"""The suffix of a profile of an engine's batches two in flight (as the server's process runs them)."""


class EngineWorker:
    """An engine of the version in ``tree`` (a folder holding its ``service`` package) in a process of its own (see
    :mod:`service.bench.engine_worker`)."""

    def __init__(self, tree: Path, settings: dict[str, Any], log: Path, *, load_now: bool = True) -> None:
        """``load_now`` False: the process starts (its imports take seconds) and loads the engine when first asked
        (:attr:`loaded`, :meth:`ask`), so that processes started together import side by side and load in turn."""
        self.log_path = log
        self._log = log.open("w")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER.read_text()], cwd=tree, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)
        self._settings = settings
        self._loaded: dict[str, Any] | None = None
        if load_now:
            _ = self.loaded

    @property
    def loaded(self) -> dict[str, Any]:
        """What the engine's process answered once it loaded (loading it first if it has not yet)."""
        if self._loaded is None:
            self._loaded = self._send(self._settings)
        return self._loaded

    def _send(self, obj: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                out = json.loads(line[3:])
                if "error" in out:
                    raise RuntimeError(out["error"])
                return out
        self._log.flush()
        raise RuntimeError(f"the engine process exited ({self.proc.wait()}):\n{self.log_path.read_text()[-3000:]}")

    def ask(self, op: str, **args: Any) -> dict[str, Any]:
        _ = self.loaded
        return self._send({"op": op, **args})

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # it may have exited already
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def labelled_test(preset: str, limit: int, seed: int = 0, path: Path | None = None) -> tuple[list[str], list[str]]:
    """A seeded sample of at most ``limit`` texts of a bundled dataset's test split, and each one's label name; or the
    first ``limit`` of a file's (``path``: JSON ``{"texts": [...], "labels": [...]}``, e.g. written by
    :func:`write_labelled` where the dataset's package is installed, for a machine where it is not)."""
    if path is not None:
        doc = json.loads(path.read_text())
        return doc["texts"][:limit], doc["labels"][:limit]
    from service.training.data import make_dataset, preset_path, read_examples

    path, opts = preset_path(preset)
    data = make_dataset(read_examples(path, **opts), preset)
    picked = random.Random(seed).sample(range(len(data.test.texts)), min(limit, len(data.test.texts)))
    return [data.test.texts[k] for k in picked], [data.labels[data.test.labels[k]] for k in picked]


def write_labelled(preset: str, limit: int, path: Path) -> None:
    """The texts and labels :func:`labelled_test` samples, in a file it reads back."""
    texts, labels = labelled_test(preset, limit)
    path.write_text(json.dumps({"preset": preset, "texts": texts, "labels": labels}))


def section(results: dict[str, Any], name: str, fn: Callable[[], Any],
            checkpoint: Callable[[dict[str, Any]], None] | None = None) -> None:
    """``results[name] = fn()``, or the error it raised (the run goes on), and its wall seconds in
    ``results["seconds"][name]`` (what each section costs of a device call's time); then ``checkpoint(results)``
    (what a run stopped at its time limit has measured so far is kept)."""
    report.echo(f"bench gpu: {name} ...", err=True)
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as e:  # one section failing must not lose the others' numbers
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        report.echo(f"bench gpu: {name} failed: {e}", err=True)
    took = time.perf_counter() - t0
    results.setdefault("seconds", {})[name] = took
    report.echo(f"bench gpu: {name} took {took:.1f} s", err=True)
    if checkpoint is not None:
        checkpoint(results)


def keep_partial(results: dict[str, Any], name: str, save: Callable[[dict[str, Any]], None] | None
                 ) -> Callable[[dict[str, Any]], None]:
    """A served section's ``progress``: each time, ``results[name]`` becomes a copy of what it has measured so far,
    marked ``partial`` (the section's end replaces it), and ``save(results)`` keeps it (a run stopped at its time
    limit keeps the levels done)."""
    def keep(so_far: dict[str, Any]) -> None:
        results[name] = {**so_far, "levels": list(so_far["levels"]), "partial": True}
        if save is not None:
            save(results)
    return keep


def engine_turns(workers: dict[str, EngineWorker], budgets: list[int], max_texts: int, seconds: float,
                 rounds: int) -> dict[str, Any]:
    """Texts/s (and the host's microseconds per text) of each version at each budget, the versions in turns (the
    order reversed every other round)."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {name: {str(b): [] for b in budgets} for name in workers}
    for r in range(rounds):
        for b in budgets:
            for name in report.in_turns(list(workers), r):
                runs[name][str(b)].append(workers[name].ask("throughput", budget=b, max_texts=max_texts,
                                                            seconds=seconds))
    return runs


@contextlib.contextmanager
def started_together(keys: Sequence[str], make: Callable[[str], EngineWorker]) -> Iterator[dict[str, EngineWorker]]:
    """``make(key)`` for every key at once (their processes import side by side; each loads when first asked, so the
    caller loads and uses them in turn, closing each when done), every one closed at the end."""
    workers: dict[str, EngineWorker] = {}
    try:
        for key in keys:
            workers[key] = make(key)
        yield workers
    finally:
        for w in workers.values():
            w.close()


def accuracy(make: Callable[[str], EngineWorker], labels: list[str], dtypes: list[str], budget: int,
             max_texts: int) -> dict[str, Any]:
    """Accuracy of each precision on the labelled texts, the largest probability change between the first and each
    other precision, and, in the last precision, between each text alone and in batches of ``budget`` tokens."""
    probs: dict[str, list[list[float]]] = {}
    out: dict[str, Any] = {"texts": len(labels)}
    alone = None
    with started_together(dtypes, make) as workers:
        for dtype, w in workers.items():
            names = w.loaded["labels"]
            probs[dtype] = w.ask("predict", alone=False, budget=budget, max_texts=max_texts)["probs"]
            if dtype == dtypes[-1]:
                alone = w.ask("predict", alone=True)["probs"]
            w.close()
    for dtype, mixed in probs.items():
        out[f"accuracy_{dtype}"] = _accuracy(mixed, names, labels)
        out[f"probs_{dtype}"] = [[round(x, 7) for x in p] for p in mixed]  # to compare with another machine's
    out["labels"] = names
    first, last = dtypes[0], dtypes[-1]
    out["largest_probability_change_" + "_vs_".join(dtypes)] = _largest(probs[first], probs[last])
    out["accuracy_points_" + "_minus_".join((last, first))] = 100 * (out[f"accuracy_{last}"] -
                                                                      out[f"accuracy_{first}"])
    assert alone is not None
    out.update(alone_vs_mixed(alone, probs[last], last))
    return out


def agreement(make: Callable[[dict[str, Any]], EngineWorker], labels: list[str], budget: int, max_texts: int,
              setting: str, values: tuple[str, str], tag: str) -> dict[str, Any]:
    """This version with engine ``setting`` at each of two ``values`` (the backbone in its default precision), on the
    labelled texts: each one's accuracy, the points between them, the largest probability change and the labels
    changed; at the second value, each text alone against in batches of ``budget`` tokens. Keys name ``tag`` and the
    values (``accuracy_heads_float32``, ``largest_probability_change_heads_float32_vs_bfloat16``, ...), and where
    shape buckets ran, what they did with the batches (``batches_buckets_cuda``)."""
    out: dict[str, Any] = {"texts": len(labels), "setting": setting}
    probs: dict[str, list[list[float]]] = {}
    alone: list[list[float]] = []
    with started_together(values, lambda value: make({setting: value})) as workers:
        for value, w in workers.items():
            names = w.loaded["labels"]
            got = w.ask("predict", alone=False, budget=budget, max_texts=max_texts)
            probs[value] = got["probs"]
            if got.get("buckets"):  # how the batches ran: in buckets, for one head, fitting none
                out[f"batches_{tag}_{value}"] = {k: got["buckets"].get(k) for k in ("bucketed", "one_head", "unfit")}
            if value == values[1]:
                alone = w.ask("predict", alone=True)["probs"]
            if w.loaded.get("buckets"):
                out[f"warm_up_{tag}_{value}"] = w.loaded["buckets"]
            w.close()
    for value in values:
        out[f"accuracy_{tag}_{value}"] = _accuracy(probs[value], names, labels)
    a, b = values
    out[f"accuracy_points_{tag}_{b}_minus_{a}"] = 100 * (out[f"accuracy_{tag}_{b}"] - out[f"accuracy_{tag}_{a}"])
    out[f"largest_probability_change_{tag}_{a}_vs_{b}"] = _largest(probs[a], probs[b])
    out[f"labels_changed_{tag}_{a}_vs_{b}"] = sum(_argmax(x) != _argmax(y) for x, y in zip(probs[a], probs[b],
                                                                                            strict=True))
    out.update(alone_vs_mixed(alone, probs[b], f"{tag}_{b}"))
    return out


def invariance(make: Callable[[str, dict[str, Any]], EngineWorker], labels: list[str],
               candidates: dict[str, dict[str, Any]], budget: int, max_texts: int, seconds: float, rounds: int,
               traced: int = 4) -> dict[str, Any]:
    """Each candidate's engine settings (``candidates``: name -> settings, the engine as served first) on the
    labelled texts: its accuracy; each text alone against in batches of ``budget`` tokens (:func:`alone_vs_mixed`);
    for the ``traced`` texts that moved most as served (and any whose label flipped there), where their hidden
    states part, depth by depth (the worker's ``divergence``); and texts/s at ``budget``, one and two batches in
    flight, the candidates in turns (``rounds``, ``seconds`` each). ``make(name, settings)``: a worker on the
    labelled texts. Which settings keep a text's label whatever its batch, and at what cost."""
    out: dict[str, Any] = {"texts": len(labels), "candidates": candidates}
    traced_texts: list[int] = []
    with started_together(list(candidates), lambda name: make(name, candidates[name])) as workers:
        for name, w in list(workers.items()):
            try:
                names = w.loaded["labels"]
                mixed = w.ask("predict", alone=False, budget=budget, max_texts=max_texts)["probs"]
                alone = w.ask("predict", alone=True)["probs"]
                row = {"accuracy": _accuracy(mixed, names, labels), "load": w.loaded,
                       **alone_vs_mixed(alone, mixed, name)}
                if not traced_texts:  # the engine as served: the texts a batch moves most, and those it flips
                    moved = sorted(range(len(alone)), key=lambda k: -_largest([alone[k]], [mixed[k]]))
                    traced_texts = sorted({*moved[:traced],
                                           *(f["text"] for f in row[f"flipped_alone_vs_mixed_{name}"])})
                    out["traced_texts"] = traced_texts
                row["divergence"] = w.ask("divergence", texts=traced_texts, budget=budget,
                                          max_texts=max_texts)["texts"]
            except RuntimeError as e:  # a candidate that cannot run here (its process failed): the others go on
                out[name] = {"error": str(e)[-3000:]}
                w.close()
                del workers[name]
                continue
            out[name] = row
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in workers}
        for r in range(rounds):
            for name in report.in_turns(list(workers), r):
                runs[name].append(workers[name].ask("throughput", budget=budget, max_texts=max_texts,
                                                    seconds=seconds))
    for name, rows in runs.items():
        out[name]["throughput"] = rows
        out[name]["texts_per_s"] = max(r["texts_per_s"] for r in rows)
        piped = [r["texts_per_s_pipelined"] for r in rows if r.get("texts_per_s_pipelined")]
        out[name]["texts_per_s_two_in_flight"] = max(piped) if piped else None
    return out


def alone_vs_mixed(alone: list[list[float]], mixed: list[list[float]], tag: str) -> dict[str, Any]:
    """Each text's probabilities alone against in mixed batches: the largest change, the labels that flipped, and
    for each flipped text its margin (its top probability over its second, alone and mixed): a flip whose margin is
    within the largest change is a near tie that the precision's rounding decides."""
    flipped = [{"text": i, "margin_alone": _margin(a), "margin_mixed": _margin(m)}
               for i, (a, m) in enumerate(zip(alone, mixed, strict=True)) if _argmax(a) != _argmax(m)]
    return {f"largest_probability_change_alone_vs_mixed_{tag}": _largest(alone, mixed),
            f"label_flips_alone_vs_mixed_{tag}": len(flipped), f"flipped_alone_vs_mixed_{tag}": flipped}


def _margin(p: list[float]) -> float:
    first, second = sorted(p, reverse=True)[:2]
    return first - second


def _accuracy(probs: list[list[float]], names: list[str], labels: list[str]) -> float:
    """The share of texts whose likeliest label (of ``names``, in the order of each text's ``probs``) is its
    ``labels``'."""
    return sum(names[_argmax(p)] == t for p, t in zip(probs, labels, strict=True)) / len(labels)


def _named(settings: dict[str, Any]) -> str:
    """Engine settings as a name: ``{"buckets": "off"}`` -> ``buckets-off``."""
    return "-".join(f"{k}-{v}" for k, v in settings.items())


def _largest(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))


def _argmax(p: list[float]) -> int:
    return max(range(len(p)), key=p.__getitem__)


def closed_loop(url: str, texts: list[str], concurrency: int, per_request: int, seconds: float,
                processes: int, cpu: Callable[[], dict[str, float] | None] | None = None,
                load_cpus: tuple[int, ...] | None = None) -> dict[str, Any]:
    """``concurrency`` clients spread over ``processes`` load processes (on ``load_cpus``, where given), each sending
    ``per_request`` texts at a time for ``seconds``: requests and texts per second answered 200, latency percentiles
    (ms), errors; the texts a batch and the share of the time the engine computed (the server's metrics, summed over
    its runners: with two batches in flight, up to 2, each batch counted from its sending to its answer); with
    ``cpu`` (the server's parts' CPU seconds so far), each part's CPU milliseconds a text (``server_cpu_ms``,
    ``host_cpu_ms``, ``models_cpu_ms``, ``load_generator_cpu_ms``): where the machine's CPU went; ``load_cpus``: the
    CPUs the load generator ran on."""
    from service.bench.load import closed_loop as clients
    from service.bench.load import run_async

    t0 = time.monotonic()
    level = run_async(clients(url, "/v1/classify", texts, concurrency, seconds, processes=processes,
                              per_request=per_request, cpu=cpu, cpus=load_cpus))
    row = level.row()
    return {"concurrency": concurrency, "texts_per_request": per_request, "load_processes": row["load_processes"],
            "requests_per_s": row["requests_per_s"], "texts_per_s": row["throughput"], "errors": row["errors"],
            "p50_ms": row["p50_ms"], "p99_ms": row["p99_ms"], "wall_s": time.monotonic() - t0,
            "mean_batch": row["mean_batch"], "engine_busy": row["model_busy"], "batch_ms": row["batch_ms"],
            "load_cpus": row["load_cpus"],
            **{k: v for k, v in row.items() if k.endswith("_cpu_ms")}}


def served(repository: Path, model: str, device: str, texts: list[str], levels: list[tuple[int, int]],
           seconds: float, processes: int, logs: Path, settings: dict[str, str] | None = None,
           cpu_split: CpuSplit | None = None,
           progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """This version's server on ``device`` (with ``settings``, ``ROUTING_*`` variables, beside its defaults), driven at
    each (concurrency, texts per request) of ``levels``; ``ready_s``: from its start to ready. With ``cpu_split``, the
    server (its fronts counted from its CPUs) and the load generator each on their own CPUs. ``progress``: given what
    is measured so far after each level (a run stopped at its time limit keeps the levels done)."""
    from service.bench.server import ServerProcess, free_port, fronts_of, server_cpu

    port = free_port()
    command = [sys.executable, "-m", "service", "serve", "--model-repository", str(repository), "--models", model,
               "--device", device, "--port", str(port)]
    env = {**os.environ, "ROUTING_LOG_LEVEL": "warning", "ROUTING_MAX_QUEUE": "100000",
           "ROUTING_GRPC_PORT": str(free_port()),  # gRPC on a port of its own: the default may be taken
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(settings or {})}
    with pinned(cpu_split.server if cpu_split else None):
        server = ServerProcess(logs, command, env, "bench-gpu-server", port, cwd=ROOT)
    try:
        t0 = time.perf_counter()
        server.wait_ready(300)
        out: dict[str, Any] = {"ready_s": time.perf_counter() - t0, "fronts": fronts_of(server.proc.pid),
                               "settings": settings or {}, "levels": [],  # the default fronts (ROUTING_WORKERS=auto)
                               "server_cpus": list(current(server.proc.pid))}
        load_cpus = cpu_split.load if cpu_split else None
        closed_loop(server.url, texts, 8, 1, min(1.0, seconds), 1, load_cpus=load_cpus)  # warm-up
        fronts = out["fronts"]
        for concurrency, per_request in levels:
            row = closed_loop(server.url, texts, concurrency, per_request, seconds, processes,
                              lambda: server_cpu(server.proc.pid, fronts), load_cpus)
            report.echo(f"bench gpu: served c={concurrency} x{per_request}: {row['requests_per_s']:.0f} requests/s, "
                        f"p99 {row['p99_ms']:.1f} ms", err=True)
            out["levels"].append(row)
            if progress is not None:
                progress(out)
        return out
    finally:
        server.stop()


def beside(repository: Path, model: str, device: str, texts: list[str], peers: list[str], fronts: list[int],
           levels: list[int], seconds: float, rounds: int, processes: int, logs: Path,
           cpu_split: CpuSplit | None = None) -> dict[str, Any]:
    """This service (its default fronts, and each number of ``fronts``) and the ``peers`` (mosec, LitServe: this
    version's engine inside as the service runs it, captured shape buckets on a GPU included, their own batching at
    this service's default batch size and wait for the device), single texts at each closed-loop level of
    ``levels`` from ``processes`` load processes, each measured while the others are paused (see
    :func:`service.bench.versus.compare`); with ``cpu_split``, every server on its CPUs and the load generator on
    its own. Peers not installed are left out and named."""
    from importlib.metadata import version
    from importlib.util import find_spec

    from service.bench import versus
    from service.config import Settings

    missing = [p for p in peers if find_spec(p) is None]
    present = [p for p in peers if p not in missing]
    defaults = Settings()
    max_batch_size, _ = defaults.batch_limits(device)
    max_wait_ms = defaults.batch_wait_ms(device)
    with pinned(cpu_split.server if cpu_split else None):
        contenders = versus.start(present, repository, model, device, max_batch_size, max_wait_ms, logs, None,
                                  fronts)
    try:
        out = versus.compare(contenders, texts, levels, seconds, rounds, [], processes=processes,
                             load_cpus=cpu_split.load if cpu_split else None)
    finally:
        versus.stop(contenders)
    return {**out, "versions": {p: version(p) for p in present}, "missing_peers": missing,
            "max_batch_size": max_batch_size, "max_wait_ms": max_wait_ms}


def routing_headline(device: str) -> dict[str, Any]:
    """The reference library's long-sequence headline (``bench routing --headline``) in a process of its own: the
    full 1,000,000 inputs on a GPU, 2,000 on a CPU (a smoke test)."""
    from service.bench import routing

    (row,) = routing.run(device, [1], 1, None, progress=False,
                         headline_inputs=routing.HEADLINE["n_inp"] if device.startswith("cuda") else 2000)
    return row


def gpu_tests() -> dict[str, Any]:
    """The tests marked ``gpu``, in a process of their own (skipped where there is no GPU)."""
    tests = ROOT / "tests"
    if not tests.is_dir():
        return {"error": "no tests folder beside the package (run from a clone)"}
    # only the files that hold such tests: collecting the others needs the test extra's every package
    files = sorted(str(f) for f in tests.rglob("test_*.py") if "mark.gpu" in f.read_text())
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    lines = out.stdout.strip().splitlines()
    return {"returncode": out.returncode, "summary": lines[-1] if lines else "", "tail": out.stdout[-3000:]}


def run(device: str, model: str, repository: Path, n_texts: int, budgets: list[int], seconds: float, rounds: int,
        baseline: Path | None, served_seconds: float, concurrencies: list[int], load_processes: int,
        accuracy_texts: int, logs: Path, texts_file: Path | None = None,
        checkpoint: Callable[[dict[str, Any], dict[str, Any]], None] | None = None,
        variant: list[dict[str, Any]] | None = None, peers: list[str] | None = None, fronts: list[int] | None = None,
        peer_levels: list[int] | None = None, served_variants: list[dict[str, str]] | None = None,
        cpu_split: CpuSplit | None = None, invariance_candidates: list[dict[str, Any]] | None = None
        ) -> dict[str, Any]:
    """Every section (see the module's docstring); ``results`` and a ``summary`` of the headline numbers.
    ``checkpoint(settings, results)`` after each section. ``peers``, ``fronts``, ``peer_levels``: see :func:`beside`
    (none of either: no such section). ``served_variants``: the server again with each one's ``ROUTING_*``
    variables, at every served level, the run's last sections (what a run stopped at its time limit may lose).
    ``cpu_split``: the served sections' servers and load generator each on their own CPUs (none: they share the
    machine's). ``invariance_candidates``: engine settings over the served engine's, each measured against it in the
    ``invariance`` section (:func:`invariance`; none: no such section)."""
    import torch

    from service.config import CPU_BATCH, GPU_BATCH

    cuda = device.startswith("cuda")
    max_texts, default_budget = GPU_BATCH if cuda else CPU_BATCH
    budgets = sorted(set(budgets) | {default_budget})
    texts, labels = labelled_test(model, max(n_texts, accuracy_texts), path=texts_file)
    given_texts = texts_file
    logs.mkdir(parents=True, exist_ok=True)
    files = tempfile.TemporaryDirectory(prefix="bench-gpu-")
    texts_file = Path(files.name) / "texts.json"
    texts_file.write_text(json.dumps(texts[:n_texts]))
    labelled_file = Path(files.name) / "labelled.json"
    labelled_file.write_text(json.dumps(texts[:accuracy_texts]))
    repository = repository.resolve()

    def worker(tree: Path, name: str, dtype: str = "auto", path: Path = texts_file,
               engine: dict[str, Any] | None = None) -> EngineWorker:
        settings = {"repository": str(report.repository_for(tree, repository, model)), "model": model,
                    "device": device, "texts_file": str(path),
                    "engine": engine or {}, "max_texts": max_texts,
                    # an older version may not know "auto": give it what auto means
                    "dtype": dtype if dtype != "auto" else ("bfloat16" if cuda else "float32")}
        return EngineWorker(tree, settings, logs / f"engine-{name}-{dtype}.log", load_now=False)

    settings = {"device": device, "model": model, "texts": n_texts, "budgets": budgets,
                "default_budget": default_budget, "max_texts": max_texts, "seconds": seconds, "rounds": rounds,
                "baseline": str(baseline) if baseline else None, "served_seconds": served_seconds,
                "concurrencies": concurrencies, "load_processes": load_processes, "accuracy_texts": accuracy_texts,
                "texts_file": str(given_texts) if given_texts else None, "variant": variant,
                "peers": peers or [], "fronts": fronts or [], "peer_levels": peer_levels or [],
                "served_variants": served_variants or [], "invariance": invariance_candidates or [],
                "cpus": cpu_split.record() if cpu_split else None,
                "cuda_device": torch.cuda.get_device_name(0) if cuda and torch.cuda.is_available() else None}
    results: dict[str, Any] = {}

    save = None if checkpoint is None else lambda r: checkpoint(settings, r)

    def step(name: str, fn: Callable[[], Any]) -> None:
        section(results, name, fn, save)

    def so_far(name: str) -> Callable[[dict[str, Any]], None]:
        return keep_partial(results, name, save)

    versions = {"current": ROOT, **({"baseline": baseline.resolve()} if baseline else {})}
    # this version's engine as the server computes on this device (ROUTING_BUCKETS=auto: captured shape buckets on
    # a GPU); a variant is those settings with its own over them
    engines = {"current": dict(SERVED_ENGINE_ON_GPU if cuda else {})}
    engines.update({f"current-{_named(v)}": {**engines["current"], **v}
                    for v in variant or []})
    versions.update({name: ROOT for name in engines if name != "current"})
    settings["engines"] = engines
    workers: dict[str, EngineWorker] = {}
    try:
        def load() -> dict[str, Any]:
            # every process started at once (their imports side by side), each loaded in turn (load_s alone)
            for name, tree in versions.items():
                workers[name] = worker(tree, name, engine=engines.get(name))
            return {name: w.loaded for name, w in workers.items()}

        step("load", load)
        step("engine", lambda: engine_turns(workers, budgets, max_texts, seconds, rounds))
        step("profile", lambda: {
            **{name: w.ask("profile", budget=default_budget, max_texts=max_texts, batches=8)
               for name, w in workers.items()},
            **{f"{name}{IN_FLIGHT}": w.ask("profile", budget=default_budget, max_texts=max_texts, batches=8,
                                           pipelined=True) for name, w in workers.items() if name != "baseline"}})
        step("latency", lambda: {name: w.ask("latency", n=200) for name, w in workers.items()})
    finally:
        for w in workers.values():
            w.close()
    # the tests early: a run stopped at its time limit loses its last sections (the least needed one is last)
    step("gpu_tests", gpu_tests)
    dtypes = ["float32", "bfloat16"] if cuda else ["float32"]
    step("accuracy", lambda: accuracy(lambda dt: worker(ROOT, "accuracy", dt, labelled_file),
                                                  labels[:accuracy_texts], dtypes, default_budget, max_texts))
    step("head_precision", lambda: agreement(lambda engine: worker(ROOT, f"heads-{engine['head_dtype']}",
                                                                     path=labelled_file, engine=engine),
                                             labels[:accuracy_texts], default_budget, max_texts, "head_dtype",
                                             ("float32", "bfloat16"), "heads"))
    step("buckets", lambda: agreement(lambda engine: worker(ROOT, f"buckets-{engine['buckets']}", path=labelled_file,
                                                            engine={**engine, "head_dtype": "bfloat16"}),
                                      labels[:accuracy_texts], default_budget, max_texts, "buckets",
                                      ("off", "cuda" if cuda else "eager"), "buckets"))
    if invariance_candidates:
        candidates = {"served": engines["current"],
                      **{_named(c): {**engines["current"], **c}
                         for c in invariance_candidates}}
        step("invariance", lambda: invariance(
            lambda name, engine: worker(ROOT, f"invariance-{name}", path=labelled_file, engine=engine),
            labels[:accuracy_texts], candidates, default_budget, max_texts, seconds, rounds))
    levels = [(c, 1) for c in concurrencies] + [(64, 16)]
    step("served", lambda: served(repository, model, device, texts, levels, served_seconds, load_processes, logs,
                                  cpu_split=cpu_split, progress=so_far("served")))
    if (peers or fronts) and peer_levels:
        step("beside", lambda: beside(repository, model, device, texts, peers or [], fronts or [], peer_levels,
                                      served_seconds, 1, load_processes, logs, cpu_split))
    step("routing_headline", lambda: routing_headline(device))
    # last, the server with settings over its defaults (ready time and every level): what a run stopped at its
    # time limit may lose
    for k, changed in enumerate(served_variants or []):
        name = variant_section(k)
        step(name, lambda changed=changed, name=name: served(repository, model, device, texts, levels,
                                                             served_seconds, load_processes, logs, changed, cpu_split,
                                                             so_far(name)))
    files.cleanup()
    return {"settings": settings, "results": results, "summary": summarize(results, default_budget)}


def variant_section(k: int) -> str:
    """The section of the ``k``-th served variant (from 0): ``served_variant``, ``served_variant_2``, ..."""
    return "served_variant" + (f"_{k + 1}" if k else "")


def summarize(results: dict[str, Any], budget: int) -> dict[str, Any]:
    """The headline numbers; None where a section failed or did not measure it."""
    def get(*path: Any) -> Any:
        node: Any = results
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    def best(name: str, b: int, key: str = "texts_per_s") -> float | None:
        rows = [r[key] for r in get("engine", name, str(b)) or [] if key in r]
        return max(rows) if rows else None

    out: dict[str, Any] = {"default_budget": budget}
    engine = get("engine") or {}
    for name in ["current", "baseline", *(n for n in engine if n.startswith("current-"))]:
        per = {b: best(name, int(b)) for b in (engine.get(name) or {})}
        out[f"offline_texts_per_s_{name}"] = per or None
        piped = {b: best(name, int(b), "texts_per_s_pipelined") for b in (engine.get(name) or {})}
        out[f"offline_texts_per_s_two_in_flight_{name}"] = {b: v for b, v in piped.items() if v} or None
        rows = (engine.get(name) or {}).get(str(budget)) or []
        hosts = [r["host_us_per_text"] for r in rows if "host_us_per_text" in r]
        out[f"host_us_per_text_{name}"] = min(hosts) if hosts else None
    cur, base = out["offline_texts_per_s_current"] or {}, out["offline_texts_per_s_baseline"] or {}
    out["offline_texts_per_s_at_default_budget"] = cur.get(str(budget))
    out["current_over_baseline_same_budget"] = {b: cur[b] / base[b] for b in cur if base.get(b)} or None
    out["current_default_over_baseline_best"] = (cur.get(str(budget)) / max(base.values())
                                                 if base and cur.get(str(budget)) else None)
    prof = get("profile", "current") or {}
    out["kernels_per_batch"] = prof.get("kernels_per_batch")
    out["torch_ops_per_batch"] = prof.get("torch_ops_per_batch")
    out["baseline_kernels_per_batch"] = get("profile", "baseline", "kernels_per_batch")
    for name in (n for n in get("profile") or {} if n.startswith("current-") and not n.endswith(IN_FLIGHT)):
        out[f"kernels_per_batch_{name}"] = get("profile", name, "kernels_per_batch")
        busy_v = get("profile", name, "device_busy_ms_per_batch")
        ms_v = [r["ms_per_batch"] for r in (engine.get(name) or {}).get(str(budget)) or []]
        out[f"device_busy_share_{name}"] = busy_v / min(ms_v) if busy_v and ms_v else None
    for name in (n for n in get("profile") or {} if n.endswith(IN_FLIGHT)):  # busy share at two in flight
        busy_v, engine_name = get("profile", name, "device_busy_ms_per_batch"), name.removesuffix(IN_FLIGHT)
        rows = (engine.get(engine_name) or {}).get(str(budget)) or []
        piped = [1000 * r["texts_per_batch"] / r["texts_per_s_pipelined"] for r in rows
                 if r.get("texts_per_s_pipelined")]
        out[f"device_busy_share_two_in_flight_{engine_name}"] = busy_v / min(piped) if busy_v and piped else None
    ms = [r["ms_per_batch"] for r in (engine.get("current") or {}).get(str(budget)) or []]
    busy = prof.get("device_busy_ms_per_batch")
    out["device_busy_share"] = busy / min(ms) if busy and ms else None
    out["batch1_p50_ms"] = get("latency", "current", "p50_ms")
    out["batch1_p99_ms"] = get("latency", "current", "p99_ms")
    for name in (n for n in get("latency") or {} if n.startswith("current-")):
        out[f"batch1_p50_ms_{name}"] = get("latency", name, "p50_ms")
    out["baseline_batch1_p50_ms"] = get("latency", "baseline", "p50_ms")
    out["accuracy"] = {k: v for k, v in (get("accuracy") or {}).items()
                       if k != "traceback" and not k.startswith("probs")} or None
    out["head_precision"] = {k: v for k, v in (get("head_precision") or {}).items() if k != "traceback"} or None
    out["buckets"] = {k: v for k, v in (get("buckets") or {}).items() if k != "traceback"} or None
    inv = get("invariance") or {}
    out["invariance"] = {name: {k: row.get(k) for k in ("accuracy", f"largest_probability_change_alone_vs_mixed_{name}",
                                                        f"label_flips_alone_vs_mixed_{name}", "texts_per_s",
                                                        "texts_per_s_two_in_flight")} if "error" not in row
                         else {"error": row["error"][-300:]}
                         for name, row in inv.items() if name in (inv.get("candidates") or {})} or None
    for name, rows in engine.items():  # what the buckets did in the engine's turns at the default budget
        if not isinstance(rows, dict):
            continue
        last = next((r["buckets"] for r in reversed(rows.get(str(budget)) or []) if r.get("buckets")), None)
        if last is not None:
            out[f"buckets_{name}"] = {k: last.get(k) for k in ("bucketed", "replayed", "one_head", "unfit",
                                                               "padded_share", "capture_s", "buckets", "failed")}
    levels = get("served", "levels") or []

    def by_level(name: str) -> dict[str, Any] | None:
        return {f"c{r['concurrency']}x{r['texts_per_request']}": {
            "requests_per_s": r["requests_per_s"], "texts_per_s": r["texts_per_s"], "p99_ms": r["p99_ms"],
            "errors": r["errors"], "mean_batch": r.get("mean_batch"), "engine_busy": r.get("engine_busy"),
            "batch_ms": r.get("batch_ms"), **{k: v for k, v in r.items() if k.endswith("_cpu_ms")}}
            for r in get(name, "levels") or []} or None

    out["served"] = by_level("served")
    out["ready_s"] = get("served", "ready_s")
    out["served_fronts"] = get("served", "fronts")  # ROUTING_WORKERS=auto on the server's CPUs
    variants = [k for k in results if k == variant_section(0) or k.startswith(variant_section(0) + "_")]
    out["served_variants"] = {k: {"settings": get(k, "settings"), "ready_s": get(k, "ready_s"),
                                  "fronts": get(k, "fronts"), "levels": by_level(k),
                                  **({"partial": True} if get(k, "partial") else {})} for k in variants} or None
    multi = next((r for r in levels if r["texts_per_request"] > 1), None)
    offline = cur.get(str(budget))
    out["served_over_offline_multi_text"] = multi["texts_per_s"] / offline if multi and offline else None
    # against the engine offline as a GPU's server runs it by default, two batches in flight (the larger figure)
    piped = (out["offline_texts_per_s_two_in_flight_current"] or {}).get(str(budget))
    out["served_over_offline_two_in_flight_multi_text"] = multi["texts_per_s"] / piped if multi and piped else None
    closed = get("beside", "closed") or {}
    out["beside"] = {f"c{level}": {name: {"texts_per_s": m["throughput"], "p99_ms": m["p99_ms"],
                                          "this_over_it": m["this_over_it"], "errors": m["errors"]}
                                   for name, m in d["summary"].items()}
                     for level, d in closed.items()} or None
    out["gpu_tests"] = get("gpu_tests", "summary")
    out["routing_headline_forward_peak_gib"] = get("routing_headline", "forward_peak_gib")
    out["failed_sections"] = sorted(k for k, v in results.items() if isinstance(v, dict) and "error" in v)
    seconds = get("seconds") or {}
    out["section_seconds"] = {k: round(v, 1) for k, v in seconds.items()} or None
    out["seconds_in_all"] = round(sum(seconds.values()), 1) if seconds else None
    return out
