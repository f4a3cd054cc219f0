"""Every Prometheus metric of the service and its buckets, in one place.

One prefix (``routing_``), base units, counters ending in ``_total``, histograms (not summaries)
so replicas aggregate, and no high-cardinality labels (model names and route templates only).
Buckets cover both CPU (tens of ms to seconds) and GPU (milliseconds) serving.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import os
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from service.config import OTHER_MODELS
from service.serving.core.keys import model_of
from service.serving.core.results import WorkAnswer
from service.serving.core.work import ChunkWork, PlainRun, Work
from service.serving.observe.stats import InferenceStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)

FAILURE_REASONS = ("validation", "overloaded", "deadline", "disconnected", "auth", "internal", "draining")

DeviceMemory = Callable[[], Iterable[dict[str, float | str]]]
BackboneProcesses = Callable[[], Iterable[tuple[str, float, int]]]  # (backbone, resident bytes, restarts)

CHUNK = "(a text, or max_length tokens of a longer one)"
MULTIPROCESS = "PROMETHEUS_MULTIPROC_DIR" in os.environ
"""Several processes serve (``ROUTING_WORKERS`` > 1: the supervisor sets the folder where each writes its series)."""


MODEL_GAUGES = ("routing_model_info", "routing_model_weight_bytes")
"""The gauges whose series a model has while it is loaded: at zero, one means no model (see :func:`_drop`)."""


def _drop(gauge: Gauge, *labels: str) -> None:
    """``gauge``'s series of ``labels`` goes. With several processes, whose files keep every series a process wrote
    (prometheus_client cannot remove one there: it warns and keeps it), the series is set to zero instead: the
    page leaves the models' gauges out at zero (:class:`_WithoutUnloaded`); a queue of a backbone gone reads 0."""
    if MULTIPROCESS:
        gauge.labels(*labels).set(0)
    else:
        with contextlib.suppress(KeyError):
            gauge.remove(*labels)


class _WithoutUnloaded(Collector):
    """The series merged from every process's files, less the models' gauges at zero (models unloaded)."""

    def __init__(self, merged: MultiProcessCollector) -> None:
        self.merged = merged

    def collect(self) -> Iterable[Metric]:
        for family in self.merged.collect():
            if family.name in MODEL_GAUGES:
                family.samples = [s for s in family.samples if s.value != 0]
            yield family


class _DeviceMemoryCollector(Collector):
    """CUDA memory per device, read at scrape time from a callable the engine supplies."""

    def __init__(self, read: DeviceMemory) -> None:
        self.read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        families = {
            key: GaugeMetricFamily(f"routing_cuda_memory_{key}_bytes", f"CUDA memory {key}", labels=["device"])
            for key in ("allocated", "reserved", "peak", "total")
        }
        for dev in self.read():
            for key, fam in families.items():
                fam.add_metric([str(dev["device"])], float(dev[key]))
        return list(families.values())


class _BackboneProcessCollector(Collector):
    """Each backbone's own processes (where its weights and its heads are): their resident memory, and the times
    they were started again after exiting, read at scrape time."""

    def __init__(self, read: BackboneProcesses) -> None:
        self.read = read

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        memory = GaugeMetricFamily("routing_backbone_process_resident_memory_bytes",
                                   "Resident memory of a backbone's own processes, its heads included (replicas "
                                   "summed)", labels=["backbone"])
        restarts = CounterMetricFamily("routing_backbone_process_restarts", "Times a backbone's process was started "
                                       "again after it exited (replicas summed)", labels=["backbone"])
        for backbone, rss, started_again in self.read():
            memory.add_metric([backbone], rss)
            restarts.add_metric([backbone], started_again)
        return [memory, restarts]


class _GcCollector(Collector):
    """This process's garbage collector: collections and the seconds they took per generation (from gc's callbacks,
    installed once per process, counting from then), and the objects frozen out of its collections (counted as
    :func:`record_frozen` is told)."""

    collections: ClassVar[list[int]] = [0, 0, 0]  # one timer per process, whatever the apps
    seconds: ClassVar[list[float]] = [0.0, 0.0, 0.0]
    _started: ClassVar[float | None] = None
    frozen: ClassVar[int] = 0  # counted when frozen: ``gc.get_freeze_count`` walks them all

    @classmethod
    def install(cls) -> None:
        if cls._time not in gc.callbacks:
            gc.callbacks.append(cls._time)

    @classmethod
    def _time(cls, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            cls._started = time.perf_counter()
        elif cls._started is not None:
            cls.collections[info["generation"]] += 1
            cls.seconds[info["generation"]] += time.perf_counter() - cls._started
            cls._started = None

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        collections = CounterMetricFamily("routing_process_gc_collections", "Garbage collections of the server's "
                                          "process", labels=["generation"])
        seconds = CounterMetricFamily("routing_process_gc_seconds", "Time the server's process spent in garbage "
                                      "collections (its event loop waits meanwhile)", labels=["generation"])
        for generation, (n, s) in enumerate(zip(self.collections, self.seconds, strict=True)):
            collections.add_metric([str(generation)], n)
            seconds.add_metric([str(generation)], s)
        frozen = GaugeMetricFamily("routing_process_gc_frozen_objects", "Objects of the server's start left out of "
                                   "garbage collections", value=self.frozen)
        return [collections, seconds, frozen]


def record_frozen(count: int) -> None:
    """``routing_process_gc_frozen_objects``: the objects frozen out of this process's garbage collections, counted
    once, as they are frozen (:func:`service.collector.settle`): counting walks every one of them, and a scrape that
    counted again held the event loop 1-4 ms longer (the bundled models' server; 10 ms for 108,000 objects in one
    measure)."""
    _GcCollector.frozen = count


class Metrics:
    """The service's metrics, registered in their own registry (one per app)."""

    def __init__(self, device_memory: DeviceMemory | None = None,
                 backbone_processes: BackboneProcesses | None = None) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(namespace="routing", registry=r)  # routing_process_resident_memory_bytes, cpu, fds
        _GcCollector.install()
        r.register(_GcCollector())
        self.readings = CollectorRegistry()  # what a process reads of the devices and the backbones' processes
        for collector in ([_DeviceMemoryCollector(device_memory)] if device_memory is not None else []) + (
                [_BackboneProcessCollector(backbone_processes)] if backbone_processes is not None else []):
            r.register(collector)
            self.readings.register(collector)
        self.requests = Counter("routing_requests_total", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.request_duration = Histogram("routing_request_duration_seconds", "HTTP request duration",
                                          ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("routing_requests_in_flight", "HTTP requests being handled", registry=r,
                               multiprocess_mode="livesum")
        self.queue_wait = Histogram("routing_queue_wait_seconds", f"Time a chunk {CHUNK} waited in the queue",
                                    ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_seconds = Histogram("routing_batch_compute_seconds", "Time in the backbone and its heads per "
                                       "batch", ["backbone"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("routing_batch_size", f"Chunks {CHUNK} per batch", ["backbone"],
                                    buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram("routing_batch_tokens", "Tokens per batch, special tokens included (what "
                                      "ROUTING_MAX_BATCH_TOKENS limits; the encoder packs them, no padding)",
                                      ["backbone"], buckets=TOKEN_BUCKETS, registry=r)
        self.queue_depth = Gauge("routing_queue_depth", f"Chunks {CHUNK} waiting in a backbone's queue",
                                 ["backbone"], registry=r, multiprocess_mode="livesum")
        self.texts = Counter("routing_texts_processed_total", "Texts answered by the model (every chunk encoded, "
                             "head computed)", ["model"], registry=r)
        self.tokens = Counter("routing_tokens_processed_total", "Real tokens run through the backbone for the model "
                              "(a chunk shared by several models counts for each)", ["model"], registry=r)
        self.engine_batches = Counter("routing_engine_batches_total", "Batches an engine (a backbone's process "
                                      "on one device, ROUTING_DEVICES; with ROUTING_BATCHES_IN_FLIGHT=2, each of the "
                                      "two batches it holds at once) computed", ["backbone", "engine", "device"],
                                      registry=r)
        self.engine_busy = Counter("routing_engine_busy_seconds_total", "Seconds an engine computed batches: its rate "
                                   "is the engine's busy share (with two batches in flight, each counts from its "
                                   "batch's sending to its answer, overlapping the other's)",
                                   ["backbone", "engine", "device"], registry=r)
        self.failures = Counter("routing_failures_total", "Requests that failed, by reason", ["reason"],
                                registry=r)
        self.dropped = Counter("routing_dropped_texts_total", "Queued texts dropped before compute, by reason",
                               ["model", "reason"], registry=r)
        self.model_load = Gauge("routing_model_load_seconds", "Time to load and warm up a model", ["model"],
                                registry=r, multiprocess_mode="livemax")
        self.model_info = Gauge("routing_model_info", "Loaded models (value 1)",
                                ["model", "backbone", "device", "dtype"], registry=r, multiprocess_mode="livemax")
        self.model_loads = Counter("routing_model_loads_total", "Loads and reloads of a model at runtime, by outcome",
                                   ["model", "outcome"], registry=r)
        self.model_unloads = Counter("routing_model_unloads_total", "Unloads of a model at runtime", ["model"],
                                     registry=r)
        self.model_weight_bytes = Gauge("routing_model_weight_bytes", "Bytes of a loaded model's head weights",
                                        ["model"], registry=r, multiprocess_mode="livemax")
        self.head_cache_heads = Gauge("routing_head_cache_resident_heads", "Heads in memory (head cache)", registry=r,
                                      multiprocess_mode="livesum")
        self.head_cache_bytes = Gauge("routing_head_cache_resident_bytes", "Bytes of head weights in memory (head "
                                      "cache)", registry=r, multiprocess_mode="livesum")
        self.head_cache_hits = Counter("routing_head_cache_hits_total", "Models a request named that were in memory",
                                       registry=r)
        self.head_cache_misses = Counter("routing_head_cache_misses_total", "Models a request named that had to be "
                                         "loaded", registry=r)
        self.head_cache_evictions = Counter("routing_head_cache_evictions_total", "Heads that left memory for the "
                                            "budget", registry=r)
        self.head_cache_load = Histogram("routing_head_cache_load_seconds", "Time to bring a missing head in",
                                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.stats = InferenceStats()  # the same figures in Triton's statistics shape (/v2/models/stats)
        self._served: dict[tuple[str, int], tuple[Any, Any]] = {}  # (endpoint, status) -> its two series
        self._info: dict[str, tuple[str, str, str, str]] = {}  # loaded model -> its routing_model_info labels
        self._weights: dict[str, int] = {}  # loaded model -> its head's bytes
        self._labelled: frozenset[str] | None = None  # models with a model label of their own (None: every model)
        for reason in FAILURE_REASONS:
            self.failures.labels(reason)  # export zeros so dashboards and alerts see every series

    def served(self, endpoint: str, status: int, seconds: float) -> None:
        """An HTTP request answered: counted by endpoint and status, its duration observed (each series looked up
        once, then kept: a request costs two increments, not two lookups of its labels)."""
        series = self._served.get((endpoint, status))
        if series is None:
            series = self._served[(endpoint, status)] = (self.requests.labels(endpoint, str(status)),
                                                         self.request_duration.labels(endpoint))
        series[0].inc()
        series[1].observe(seconds)

    def exposition(self) -> bytes:
        """The ``/metrics`` page. In a server of several processes (fronts and an engine host, each writing its
        series under ``PROMETHEUS_MULTIPROC_DIR``): every process's series merged, counters and histograms summed,
        the in-flight and queue gauges summed over the live processes, the models' gauges their largest value, less
        those of models unloaded (the front adds the engine host's :meth:`reading`); the ``routing_process_*``
        series of each process are left out there."""
        if not MULTIPROCESS:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        merged.register(_WithoutUnloaded(MultiProcessCollector(None)))
        return generate_latest(merged)

    def reading(self) -> bytes:
        """The readings of this process's backbones and devices (their processes' memory and restarts, CUDA
        memory), as Prometheus text: what an engine host adds to its fronts' ``/metrics``."""
        return generate_latest(self.readings)

    def label_models(self, names: Iterable[str] | None) -> None:
        """From now on only the models ``names`` (None: every model) have series of their own; every other model's
        are summed under ``model="_other"``, exported at zero from now so that ``rate()`` over them is defined. Set
        once, as the server starts: a set that moved with traffic would make series come and go."""
        self._labelled = None if names is None else frozenset(names)
        if self._labelled is not None:
            self._exported(OTHER_MODELS)

    def model_label(self, name: str) -> str:
        """The ``model`` label that model ``name``'s metrics carry: its name, or ``_other``."""
        return name if self._labelled is None or name in self._labelled else OTHER_MODELS

    def _exported(self, label: str) -> None:
        """Every per-model series of ``label``, at zero until it counts something."""
        for series in (self.queue_wait, self.texts, self.tokens):
            series.labels(label)
        for reason in ("disconnected", "deadline"):
            self.dropped.labels(label, reason)

    def observer(self, backbone: str, devices: Sequence[str] = ("cpu",)) -> BatchMetrics:
        """The metrics of ``backbone``'s batcher, whose runners (engine processes) compute on ``devices``."""
        return BatchMetrics(self, backbone, devices)

    def closed(self, backbone: str) -> None:
        """Backbone group ``backbone`` has gone (its last model was unloaded): its gauge goes."""
        _drop(self.queue_depth, backbone)

    def loaded(self, name: str, backbone: str, device: str, dtype: str, seconds: float, weight_bytes: int) -> None:
        """Model ``name`` serves from now on (loaded at start, at runtime, or reloaded). A model without a label of
        its own counts in ``_other``'s gauges: ``routing_model_info`` then holds how many such models are loaded (on
        that backbone and device), ``routing_model_weight_bytes`` their sum, ``routing_model_load_seconds`` the last
        one's."""
        self.unloaded(name, count=False)
        label = self.model_label(name)
        self._exported(label)
        self._info[name] = (label, backbone, device, dtype)
        self._weights[name] = weight_bytes
        if label == name:
            self.model_info.labels(*self._info[name]).set(1)
            self.model_weight_bytes.labels(name).set(weight_bytes)
        else:
            self.model_info.labels(*self._info[name]).inc()
            self.model_weight_bytes.labels(label).inc(weight_bytes)
        self.model_load.labels(label).set(seconds)
        self.stats.loaded(name)

    def unloaded(self, name: str, count: bool = True) -> None:
        """Model ``name`` serves no more: its per-model gauges go, or leave ``_other``'s (counters stay, as
        Prometheus expects)."""
        labels = self._info.pop(name, None)
        if labels is None:
            return
        weight_bytes = self._weights.pop(name)
        label = labels[0]
        if label == name:
            _drop(self.model_info, *labels)
            _drop(self.model_weight_bytes, name)
        else:
            self.model_info.labels(*labels).dec()
            self.model_weight_bytes.labels(label).dec(weight_bytes)
        if count:
            self.model_unloads.labels(label).inc()
            self.stats.unloaded(name)


def observe_many(histogram: Histogram, amounts: Sequence[float]) -> None:
    """``histogram.observe(amount)`` for every one of ``amounts``, each bucket and the sum written once: a chunk's
    queue wait is observed once a batch for every chunk of it, and an observation of a histogram that several
    processes share writes two memory-mapped values (3 µs: a tenth of the engine host's CPU a text, with 16 texts a
    request). It writes prometheus_client's own histogram values as ``observe`` does (tests/serving/test_metrics.py
    checks it against ``observe``)."""
    bounds = histogram._upper_bounds  # ascending, +Inf last: an amount goes in the first bucket that holds it
    for bucket, n in Tally(bisect.bisect_left(bounds, amount) for amount in amounts).items():
        histogram._buckets[bucket].inc(n)
    histogram._sum.inc(sum(amounts))


def _models(work: ChunkWork) -> list[str]:
    """The models that ``work`` is for."""
    return [model_of(a.model or "") for a in work.job.asks]


class BatchMetrics:
    """Adapter from a backbone batcher's events to metrics (see ``batcher.BatchObserver``): batch metrics per
    backbone, queue waits, texts, tokens and drops per model."""

    def __init__(self, m: Metrics, backbone: str, devices: Sequence[str]) -> None:
        self.m, self.backbone = m, backbone
        # this backbone's series, looked up once (a lookup a request or a text was a tenth of the engine host's CPU,
        # with the metrics' own writes)
        self.sizes, self.costs, self.seconds = (h.labels(backbone) for h in (m.batch_size, m.batch_tokens,
                                                                              m.batch_seconds))
        self.depth = m.queue_depth.labels(backbone)
        self.depth.set(0)
        self.engines = [(m.engine_batches.labels(backbone, str(k), d), m.engine_busy.labels(backbone, str(k), d))
                        for k, d in enumerate(devices)]

    def on_queue_depth(self, depth: int) -> None:
        self.depth.set(depth)

    def on_drop(self, reason: str, payloads: Sequence[Work]) -> None:
        texts: Tally[str] = Tally()  # per model label
        for w in {id(w.job): w for w in payloads if type(w) is not PlainRun}.values():
            texts.update(self.m.model_label(m) for m in _models(w))
        for w in payloads:
            if type(w) is PlainRun:
                texts[self.m.model_label(model_of(w.model or ""))] += w.size
        for label, n in texts.items():
            self.m.dropped.labels(label, reason).inc(n)

    def on_batch(self, payloads: Sequence[Work], results: Sequence[WorkAnswer] | None, cost: int,
                 waits: Sequence[float], seconds: float, runner: int) -> None:
        m = self.m
        batches, busy = self.engines[runner]
        batches.inc()
        busy.inc(seconds)
        size = sum(w.size for w in payloads)  # chunks, a run's texts each
        self.sizes.observe(size)
        self.costs.observe(cost)
        self.seconds.observe(seconds)
        # tallied by head key first (a key's model is read once a batch, not once a chunk: the engine host counts
        # every front's texts), then by model
        by_key: dict[str | None, list[Any]] = {}  # key -> [chunks, texts, tokens, waits]
        for w, wait, answer in zip(payloads, waits, results or [None] * len(payloads), strict=True):
            if type(w) is PlainRun:  # its texts, each of one chunk, waited together
                row = by_key.get(w.model)
                if row is None:
                    row = by_key[w.model] = [0, 0, 0, []]
                row[0] += w.size
                row[2] += w.cost
                row[3].extend([wait] * w.size)
                if answer is not None:
                    row[1] += w.size
                continue
            for ask in w.job.asks:
                row = by_key.get(ask.model)
                if row is None:
                    row = by_key[ask.model] = [0, 0, 0, []]
                row[0] += 1
                row[2] += w.cost
                row[3].append(wait)
                if answer is not None:
                    row[1] += 1
        chunks: Tally[str] = Tally()
        texts: Tally[str] = Tally()
        tokens: Tally[str] = Tally()
        each_wait: dict[str, list[float]] = {}
        for key, (n_chunks, n_texts, n_tokens, key_waits) in by_key.items():
            model = model_of(key or "")
            chunks[model] += n_chunks
            texts[model] += n_texts
            tokens[model] += n_tokens
            each_wait.setdefault(model, []).extend(key_waits)
        waited = {model: sum(model_waits) for model, model_waits in each_wait.items()}
        for model, model_waits in each_wait.items():  # each model's series once a batch
            label = m.model_label(model)
            observe_many(m.queue_wait.labels(label), model_waits)
            m.tokens.labels(label).inc(tokens[model])
            if texts[model]:
                m.texts.labels(label).inc(texts[model])
        m.stats.batch(chunks, texts, waited, size, seconds)  # every model's own numbers
