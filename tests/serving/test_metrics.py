"""Every metric's name, type and labels, and that values move as traffic flows."""

import asyncio
import gc
import os
import re
import signal
import time
import weakref
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.bench.server import children, process_state
from service.collector import settle
from service.modeling.encoding import Encoding
from service.serving.core.work import Ask, TextJob
from service.serving.observe.metrics import LATENCY_BUCKETS, Metrics, observe_many, record_frozen
from tests.serving.server import Server, metric

EXPECTED = {  # name: (type, labels)
    "routing_requests": ("counter", {"endpoint", "status"}),
    "routing_request_duration_seconds": ("histogram", {"endpoint"}),
    "routing_requests_in_flight": ("gauge", set()),
    "routing_queue_wait_seconds": ("histogram", {"model"}),
    "routing_batch_compute_seconds": ("histogram", {"backbone"}),
    "routing_batch_size": ("histogram", {"backbone"}),
    "routing_batch_tokens": ("histogram", {"backbone"}),
    "routing_queue_depth": ("gauge", {"backbone"}),
    "routing_texts_processed": ("counter", {"model"}),
    "routing_tokens_processed": ("counter", {"model"}),
    "routing_failures": ("counter", {"reason"}),
    "routing_dropped_texts": ("counter", {"model", "reason"}),
    "routing_model_load_seconds": ("gauge", {"model"}),
    "routing_model_info": ("gauge", {"model", "backbone", "device", "dtype"}),
    "routing_process_resident_memory_bytes": ("gauge", set()),
    "routing_backbone_process_resident_memory_bytes": ("gauge", {"backbone"}),
    "routing_backbone_process_restarts": ("counter", {"backbone"}),
    "routing_process_gc_collections": ("counter", {"generation"}),
    "routing_process_gc_seconds": ("counter", {"generation"}),
    "routing_process_gc_frozen_objects": ("gauge", set()),
    "routing_cuda_memory_allocated_bytes": ("gauge", {"device"}),
    "routing_cuda_memory_reserved_bytes": ("gauge", {"device"}),
    "routing_cuda_memory_peak_bytes": ("gauge", {"device"}),
    "routing_cuda_memory_total_bytes": ("gauge", {"device"}),
}
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def families(server: Server) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}


def check_families(fams: dict, expected: dict) -> None:
    for name, (kind, labels) in expected.items():
        assert name in fams, f"{name} missing"
        fam = fams[name]
        assert fam.type == kind, (name, fam.type)
        assert fam.samples, f"{name} has no samples: its labels would go unchecked"
        for sample in fam.samples:
            got = set(sample.labels) - {"le"}
            assert got == labels, (name, sample)


def test_the_cuda_families_read_each_device() -> None:
    """On a CPU the server exports no CUDA samples, so the families are checked here with a reading of two
    devices, as a backbone's process on a GPU reports it."""
    reading = [{"device": f"cuda:{k}", "allocated": 1.0 + k, "reserved": 2.0, "peak": 3.0, "total": 80.0}
               for k in range(2)]
    registry = Metrics(device_memory=lambda: reading).registry
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    check_families(fams, {k: v for k, v in EXPECTED.items() if k.startswith("routing_cuda_")})
    allocated = {s.labels["device"]: s.value for s in fams["routing_cuda_memory_allocated_bytes"].samples}
    assert allocated == {"cuda:0": 1.0, "cuda:1": 2.0}


def test_every_metric_has_its_name_type_and_labels(tiny: Server) -> None:
    httpx.post(f"{tiny.url}/v1/classify", json={"inputs": ["warm"]})
    fams = families(tiny)
    check_families(fams, {k: v for k, v in EXPECTED.items() if not k.startswith("routing_cuda_")})
    assert not any(fams[k].samples for k in EXPECTED if k.startswith("routing_cuda_"))  # no GPU here
    for fam in fams.values():
        assert fam.name.startswith("routing_"), fam.name
    info = next(s for s in fams["routing_model_info"].samples if s.labels["model"] == "tiny")
    assert info.labels == {"model": "tiny", "backbone": "tiny-bert", "device": "cpu", "dtype": "float32"}
    assert info.value == 1
    assert next(s.value for s in fams["routing_model_load_seconds"].samples) > 0
    assert next(s.value for s in fams["routing_process_resident_memory_bytes"].samples) > 50e6
    rss = {s.labels["backbone"]: s.value for s in fams["routing_backbone_process_resident_memory_bytes"].samples}
    assert set(rss) == {"tiny-bert@random"} and rss["tiny-bert@random"] > 50e6  # its own process, torch loaded


def test_values_move_with_traffic_and_concurrent_load_batches(tiny: Server) -> None:
    before = httpx.get(f"{tiny.url}/metrics").text

    async def load() -> None:
        async with httpx.AsyncClient(base_url=tiny.url, timeout=30) as client:
            rs = await asyncio.gather(*(client.post("/v1/classify", json={"inputs": [f"text {k}", "another one"]})
                                        for k in range(24)))
            assert all(r.status_code == 200 for r in rs)

    asyncio.run(load())
    httpx.post(f"{tiny.url}/v1/classify", json={"inputs": []})
    after = httpx.get(f"{tiny.url}/metrics").text
    delta = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)  # noqa: E731
    assert delta("routing_requests_total", endpoint="/v1/classify", status="200") == 24
    assert delta("routing_requests_total", endpoint="/v1/classify", status="422") == 1
    assert delta("routing_failures_total", reason="validation") == 1
    assert delta("routing_texts_processed_total", model="tiny") == 48
    assert delta("routing_tokens_processed_total", model="tiny") >= 48 * 3
    assert delta("routing_request_duration_seconds_count", endpoint="/v1/classify") == 25
    assert delta("routing_queue_wait_seconds_count", model="tiny") == 48
    bb = "tiny-bert@random"
    batches = delta("routing_batch_size_count", backbone=bb)
    assert 0 < batches < 48  # texts shared batches
    assert delta("routing_batch_size_bucket", backbone=bb, le="1.0") < batches  # some batch held more than 1 text
    real_tokens = delta("routing_tokens_processed_total", model="tiny")
    assert delta("routing_batch_tokens_sum", backbone=bb) == real_tokens  # every text one chunk: each counted once
    assert metric(after, "routing_queue_depth", backbone=bb) == 0
    assert metric(after, "routing_requests_in_flight") == 1  # the /metrics request itself


def test_a_backbone_process_started_again_is_counted(tiny: Server) -> None:
    """A backbone's process that exits (killed here between batches) is started again by the next batch, which is
    answered, and ``routing_backbone_process_restarts_total`` counts the restart."""
    bb = "tiny-bert@random"
    before = metric(httpx.get(f"{tiny.url}/metrics").text, "routing_backbone_process_restarts_total", backbone=bb)
    started = re.compile(rf"backbone {re.escape(bb)} \(models .*\) computes in process (\d+)")
    child = int(started.findall(tiny.full_log())[-1])
    assert child in children(tiny.proc.pid)
    os.kill(child, signal.SIGKILL)
    for _ in range(500):  # dead (a zombie until the server reaps it): the next batch sees it exited
        if process_state(child) in (None, "Z", "X"):
            break
        time.sleep(0.01)
    r = httpx.post(f"{tiny.url}/v1/classify", json={"inputs": ["after the restart"]}, timeout=120)
    assert r.status_code == 200, r.text
    assert int(started.findall(tiny.full_log())[-1]) in set(children(tiny.proc.pid)) - {child}
    after = metric(httpx.get(f"{tiny.url}/metrics").text, "routing_backbone_process_restarts_total", backbone=bb)
    assert after == before + 1
    assert "had exited (code -9): starting it again" in tiny.full_log()


def test_the_server_leaves_its_startup_objects_out_of_garbage_collections(tiny: Server) -> None:
    """Once its models have loaded, the server's process freezes what it holds (``gc.freeze``): a full collection
    under load then walks only the objects made since, not every module's (about 30 ms of the event loop each on the
    bundled model's server, several a second under load, before this)."""
    page = httpx.get(f"{tiny.url}/metrics").text
    assert metric(page, "routing_process_gc_frozen_objects") > 50_000  # FastAPI, pydantic, tokenizers, the app


def test_the_garbage_collectors_collections_and_time_are_counted() -> None:
    registry = Metrics().registry
    page = lambda: generate_latest(registry).decode()  # noqa: E731
    before = page()
    gc.collect()
    after = page()
    full = dict(name="routing_process_gc_collections_total", generation="2")
    assert metric(after, **full) >= metric(before, **full) + 1
    assert metric(after, "routing_process_gc_seconds_total", generation="2") > metric(
        before, "routing_process_gc_seconds_total", generation="2")


def test_a_scrape_reports_the_frozen_objects_counted_when_they_were_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting the frozen objects walks every one of them (1-4 ms of the event loop for the bundled models'
    server): the count is taken once, when they are frozen, not on every scrape."""
    registry = Metrics().registry
    threshold = gc.get_threshold()
    try:
        frozen = settle()
        record_frozen(frozen)
        # frozen objects are still freed when nothing refers to them (another test's thread may drop some meanwhile)
        assert 0 < gc.get_freeze_count() <= frozen

        def walked() -> int:
            raise AssertionError("a scrape counted the frozen objects again")
        monkeypatch.setattr(gc, "get_freeze_count", walked)
        assert metric(generate_latest(registry).decode(), "routing_process_gc_frozen_objects") == frozen
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_tuning_collects_the_startups_garbage_then_freezes_and_collects_young_objects_less_often() -> None:
    from service.collector import YOUNG_COLLECTION_THRESHOLD
    from service.serving.server import tune_garbage_collector

    class Node:
        pass

    def collected(o: object) -> bool:  # whether the collector's generations hold o (frozen objects are in none)
        return any(x is o for x in gc.get_objects())

    a, b, kept = Node(), Node(), Node()
    a.other, b.other = b, a  # a cycle only the collector frees
    gone = weakref.ref(a)
    del a, b
    assert collected(kept)
    threshold = gc.get_threshold()
    try:
        tune_garbage_collector()
        assert gone() is None  # collected, not frozen in memory for good
        assert not collected(kept)
        assert gc.get_threshold() == (YOUNG_COLLECTION_THRESHOLD, *threshold[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
    assert collected(kept)


def test_the_servers_process_holds_no_torch(tiny: Server) -> None:
    """The front tokenizes with the Rust tokenizer alone: torch (and its memory) is only in the backbone's
    process."""
    maps = Path(f"/proc/{tiny.proc.pid}/maps").read_text()
    assert "libtorch" not in maps


def used_once_each(metrics: Metrics, names: list[str]) -> None:
    """Each of ``names`` loaded, then asked one text of 5 tokens (one batch each) and one dropped text."""
    observer = metrics.observer("bb")
    for name in names:
        metrics.loaded(name, "bb", "cpu", "float32", 0.5, 1000)
        encoding = Encoding(chunks=((101, 7, 8, 9, 102),), offsets=((0, 0),) * 5, special=(False,) * 5,
                            word_ids=(0,) * 5)
        work = TextJob.of(encoding, [Ask(model=name)]).chunks()
        observer.on_batch(work, [object()], 5, [0.01], 0.02, 0)  # type: ignore[list-item]  # any answer counts
        observer.on_drop("deadline", work)


@pytest.mark.parametrize("chosen", [["m0", "m7"], None])
def test_models_outside_the_labelled_ones_count_under_one_label_and_the_page_stays_small(
        chosen: list[str] | None) -> None:
    metrics = Metrics()
    metrics.label_models(chosen)
    names = [f"m{k}" for k in range(1000)]
    used_once_each(metrics, names)
    page = generate_latest(metrics.registry).decode()
    fams = {f.name: f for f in text_string_to_metric_families(page)}
    texts = {s.labels["model"]: s.value for s in fams["routing_texts_processed"].samples if s.name.endswith("_total")}
    if chosen is None:  # every model labelled: the page grows with the models (2.3 MB with 1,000 heads served)
        assert len(texts) == 1000 and len(page) > 1_000_000
        return
    assert texts == {"m0": 1, "m7": 1, "_other": 998} and len(page) < 200_000
    info = {s.labels["model"]: s.value for s in fams["routing_model_info"].samples}
    assert info == {"m0": 1, "m7": 1, "_other": 998}  # how many models count under _other
    weights = {s.labels["model"]: s.value for s in fams["routing_model_weight_bytes"].samples}
    assert weights == {"m0": 1000, "m7": 1000, "_other": 998_000}
    dropped = {s.labels["model"]: s.value for s in fams["routing_dropped_texts"].samples
               if s.name.endswith("_total") and s.labels["reason"] == "deadline"}
    assert dropped == {"m0": 1, "m7": 1, "_other": 998}
    waits = {s.labels["model"]: s.value for s in fams["routing_queue_wait_seconds"].samples
             if s.name.endswith("_count")}
    assert waits == {"m0": 1, "m7": 1, "_other": 998}
    # the statistics extension keeps every model's own numbers
    assert metrics.stats.models["m500"].inference_count == 1 and metrics.stats.models["m0"].inference_count == 1
    metrics.unloaded("m500")
    metrics.unloaded("m0")
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    info = {s.labels["model"]: s.value for s in fams["routing_model_info"].samples}
    assert info == {"m7": 1, "_other": 997}
    weights = {s.labels["model"]: s.value for s in fams["routing_model_weight_bytes"].samples}
    assert weights == {"m7": 1000, "_other": 997_000}


def test_the_labelled_models_setting_is_pinned_all_or_a_list() -> None:
    from service.config import Settings

    assert Settings().metrics_models == ["pinned"]
    assert Settings(metrics_models="a, b,a").metrics_models == ["a", "b"]
    for bad in ("", "all,a", "_other"):
        with pytest.raises(ValueError, match="metrics_models"):
            Settings(metrics_models=bad)


@pytest.mark.parametrize("amounts", [[], [0.0], [0.001, 0.0011, 0.003, 0.003, 0.7, 59.0, 61.0, 1e9], [-1.0, 0.02] * 50])
def test_many_observations_written_at_once_read_as_each_observed(amounts: list[float]) -> None:
    """``observe_many``: every bucket, the count and the sum as ``observe`` leaves them, one amount at a time (bounds
    included: an amount equal to a bound goes in that bucket; beyond the last, in +Inf)."""
    exports = []
    for many in (True, False):
        registry = CollectorRegistry()
        h = Histogram("wait_seconds", "wait", ["model"], buckets=LATENCY_BUCKETS, registry=registry).labels("m")
        if many:
            observe_many(h, amounts)
        else:
            for a in amounts:
                h.observe(a)
        exports.append([line for line in generate_latest(registry).decode().splitlines()
                        if "_created" not in line])  # (when each histogram was made)
    assert exports[0] == exports[1]
    assert f'wait_seconds_count{{model="m"}} {float(len(amounts))}' in exports[0]
