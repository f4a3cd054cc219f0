"""Plain texts side by side, the engine host's way for a front's requests of several plain texts: the wire's arrays,
runs of them in the batcher, a plain batch of runs and chunks, their scores unread until the front reads them, and
the metrics of a batch that holds runs. No torch, no server (``test_buckets`` serves them through the API)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.config import Settings
from service.modeling.encoding import Encoding
from service.modeling.manifest import read_manifest
from service.serving.core.results import Answer, Result, Scores
from service.serving.core.work import Ask, ChunkWork, CreditSpec, PlainRun, TextJob, Work
from service.serving.engine.batcher import Batcher, BatchLimits
from service.serving.engine.group import LocalGroup, _joined
from service.serving.engine.process import BackboneProcess, _per_work, _plain_batch, _text_by_text
from service.serving.engine.scores import read_scores
from service.serving.host import EngineHost
from service.serving.observe.metrics import Metrics
from service.serving.remote import wire
from tests.serving.test_host import _connect

SENTIMENT = read_manifest(Path(__file__).parents[2] / "models" / "tweet-sentiment")
KEY = "tweet-sentiment"


def plain_job(ids: tuple[int, ...], model: str | None = KEY, credit: CreditSpec | None = None) -> TextJob:
    return TextJob.of(Encoding.of_chunks((ids,)), [Ask(model, credit)])


def texts(lengths: list[int], first: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    """Token ids ``[T]`` counting up from ``first`` and ``lengths [s]``."""
    n = np.array(lengths, dtype=np.int32)
    return np.arange(first, first + int(n.sum()), dtype=np.int32), n


@pytest.mark.parametrize(("most_texts", "most_tokens"), [(16, None), (2, None), (16, 8), (3, 6), (1, None)])
def test_a_requests_texts_are_cut_into_runs_in_order_within_both_bounds(most_texts: int, most_tokens: int | None
                                                                        ) -> None:
    ids, lengths = texts([3, 5, 2, 7, 1, 1, 4])
    runs = PlainRun.split(ids, lengths, KEY, most_texts, most_tokens)
    assert np.array_equal(np.concatenate([r.ids for r in runs]), ids)
    assert np.array_equal(np.concatenate([r.lengths for r in runs]), lengths)
    for r in runs:
        assert 1 <= r.size <= most_texts and r.cost == int(r.lengths.sum()) == len(r.ids)
        assert r.peak == int(r.lengths.max()) and (most_tokens is None or r.size == 1 or r.cost <= most_tokens)
    if most_tokens is None:  # as few runs as the count allows
        assert len(runs) == -(-len(lengths) // most_texts)
    assert PlainRun.split(*texts([]), KEY) == []
    jobs = runs[0].jobs()  # each text's own job, where a batch computes text by text
    ends = np.cumsum(runs[0].lengths).tolist()
    assert [j.encoding.chunks for j in jobs] == [(tuple(runs[0].ids[end - n:end].tolist()),)
                                                 for end, n in zip(ends, runs[0].lengths.tolist(), strict=True)]
    assert all(j.plain and j.asks == (Ask(KEY),) for j in jobs)


def test_a_request_of_enough_plain_texts_on_one_head_travels_as_arrays() -> None:
    jobs = [plain_job(tuple(range(100 + k, 103 + 2 * k))) for k in range(5)]
    run = wire.Run.of(3, "b", jobs, 9.0)
    assert run.jobs == [] and run.plain is not None and run.plain.model == KEY
    got = msgspec.msgpack.Decoder(wire.ToHost).decode(wire.frame(run)[4:])
    ids, lengths = got.plain.arrays()
    assert lengths.tolist() == [len(j.encoding.chunks[0]) for j in jobs]
    assert ids.tolist() == [i for j in jobs for i in j.encoding.chunks[0]]
    fewer = wire.Run.of(3, "b", jobs[:wire.PLAIN_TEXTS - 1], 9.0)  # too few for the arrays' fixed cost
    credit = wire.Run.of(3, "b", [*jobs, plain_job((1, 2), credit=CreditSpec())], 9.0)
    heads = wire.Run.of(3, "b", [*jobs, plain_job((1, 2), model="other")], 9.0)
    chunks = wire.Run.of(3, "b", [*jobs, TextJob.of(Encoding.of_chunks(((1, 2), (3, 4))), [Ask(KEY)])], 9.0)
    for r in (fewer, credit, heads, chunks):
        assert r.plain is None and len(r.jobs) == len([*jobs, None][:len(r.jobs)]) and r.jobs


@pytest.mark.parametrize(("ids", "lengths"), [(b"\0" * 8, np.array([3], "<i4").tobytes()),
                                              (b"\0" * 8, np.array([2, 0], "<i4").tobytes()),
                                              (b"\0" * 7, np.array([2], "<i4").tobytes()),
                                              (b"", b"")])
def test_plain_texts_whose_lengths_do_not_add_up_are_refused(ids: bytes, lengths: bytes) -> None:
    with pytest.raises(ValueError, match="plain texts"):
        wire.Plain(ids, lengths, KEY).arrays()


def test_unread_scores_cross_the_wire_as_they_were() -> None:
    logits = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)  # [s k]
    sent = wire.Answered(4, [], wire.Scored.of(Scores(logits[1:4], KEY)))
    got = msgspec.msgpack.Decoder(wire.ToFront).decode(wire.frame(sent)[4:])
    assert isinstance(got, wire.Answered) and got.scores is not None
    scores = got.scores.scores()
    assert scores.key == KEY and np.array_equal(scores.logits, logits[1:4])
    with pytest.raises(ValueError, match="whole rows"):
        wire.Scored(b"\0" * 8, 3, KEY).scores()


def test_a_plain_batch_packs_runs_and_chunks_in_order_and_answers_each_work() -> None:
    """Runs and plain texts' chunks mixed in one batch: one array of every text in the works' order (a run's texts in
    its place), each text on its head; a run answered with its rows unread, a chunk with its text read."""
    run_a = PlainRun.split(*texts([2, 3]), KEY)[0]
    run_b = PlainRun.split(*texts([4], first=2000), "other")[0]
    chunk = plain_job((7, 8, 9)).chunks()[0]
    default = plain_job((5,), model=None).chunks()[0]
    works: list[Work] = [chunk, run_a, default, run_b]
    batch = _plain_batch(works, [11])
    assert batch is not None and batch.forget == [11]
    assert batch.ids.tolist() == [7, 8, 9, *range(1000, 1005), 5, *range(2000, 2004)]
    assert batch.lengths.tolist() == [3, 2, 3, 1, 4]
    assert [batch.heads[h] for h in batch.head.tolist()] == [KEY, KEY, KEY, None, "other"]
    assert _plain_batch([*works, plain_job((1,), credit=CreditSpec()).chunks()[0]], []) is None  # credit: not plain
    logits = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)  # [s k]
    process: Any = SimpleNamespace(default=KEY, manifests={KEY: SENTIMENT})
    got = BackboneProcess._read_plain(process, works, logits)
    assert got[0] == [read_scores(logits[:1], [KEY], {KEY: SENTIMENT})[0]]
    assert got[2] == [read_scores(logits[3:4], [KEY], {KEY: SENTIMENT})[0]]  # (the default head's)
    assert isinstance(got[1], Scores) and got[1].key == KEY and np.array_equal(got[1].logits, logits[1:3])
    assert isinstance(got[3], Scores) and got[3].key == "other" and np.array_equal(got[3].logits, logits[4:5])
    by_text = _text_by_text(works)  # the same works computed text by text (a batch with credit asked beside)
    assert [w.ids for w in by_text] == [(7, 8, 9), (1000, 1001), (1002, 1003, 1004), (5,), (2000, 2001, 2002, 2003)]
    answers: list[Answer | None] = [[Result(f"t{k}", {})] for k in range(5)]
    assert _per_work(works, answers) == [answers[0], answers[1:3], answers[3], answers[4:5]]


def test_a_requests_runs_are_answered_as_one_block_of_scores_or_read_where_one_was_computed_text_by_text() -> None:
    logits = np.random.default_rng(2).standard_normal((5, 3)).astype(np.float32)  # [s k]
    planner: Any = SimpleNamespace(manifests={KEY: SENTIMENT})
    whole = _joined(planner, [Scores(logits[:2], KEY), Scores(logits[2:], KEY)])
    assert isinstance(whole, Scores) and np.array_equal(whole.logits, logits)
    read = [[r] for r in read_scores(logits, [KEY] * 5, {KEY: SENTIMENT})]
    assert _joined(planner, [Scores(logits[:2], KEY), read[2:]]) == read  # a run computed text by text: all read


async def test_the_host_answers_a_plain_request_with_its_scores_unread(tmp_path: Path) -> None:
    """A front's request of plain texts goes to the batcher as runs (a unit each, at most 16 texts) and comes back as
    one block of scores; plain texts that do not add up are refused, the connection kept."""
    path = tmp_path / "host.sock"
    host = EngineHost(Settings(model_repository=tmp_path, default_model="none"), path)
    batches: list[list[Work]] = []

    async def run_works(works: list[Work]) -> list[Any]:
        batches.append(works)  # each text's score: its first token id
        return [Scores(np.repeat(w.ids[np.cumsum(w.lengths) - w.lengths, None], 3, 1).astype(np.float32), KEY)
                for w in works if isinstance(w, PlainRun)]

    def run_chunks(works: list[ChunkWork]) -> list[Answer | None]:  # a backbone that takes no runs
        return [[Result(f"text {w.ids[0]}", {})] for w in works]

    compute: Any = SimpleNamespace(default=KEY, name="b", models=[], device="cpu", dtype="float32",
                                   takes_runs=True, manifests={KEY: SENTIMENT})
    group = host.registry.groups["b"] = LocalGroup(compute, Batcher(run_works, BatchLimits(64, 4096, 0.001, 100)))
    texts_alone: Any = SimpleNamespace(default=KEY, name="c", models=[], device="cpu", dtype="float32",
                                       takes_runs=False)
    other = host.registry.groups["c"] = LocalGroup(texts_alone, Batcher(run_chunks, BatchLimits(64, 4096, 0.001, 100)))
    group.batcher.start()
    other.batcher.start()
    jobs = [plain_job((k, 100, 101)) for k in range(20)]
    server = await host.listen()
    async with server:
        reader, writer, _ = await _connect(path, 1)
        writer.write(wire.frame(wire.Run.of(1, "b", jobs, time.monotonic() + 10)))
        got = await asyncio.wait_for(wire.read_to_front(reader), 5)
        assert isinstance(got, wire.Answered) and got.id == 1 and got.answers == [] and got.scores is not None
        assert got.scores.scores().logits[:, 0].tolist() == list(range(20))
        assert [[w.size for w in batch] for batch in batches] == [[16, 4]]  # two runs, one unit of work each
        writer.write(wire.frame(wire.Run.of(2, "c", jobs[:5], time.monotonic() + 10)))
        got = await asyncio.wait_for(wire.read_to_front(reader), 5)  # a job a text there, answered as jobs are
        assert isinstance(got, wire.Answered) and got.id == 2 and got.scores is None
        assert [[r.label for r in a] for a in got.answers] == [[f"text {k}"] for k in range(5)]
        writer.write(wire.frame(wire.Run(3, "b", [], time.monotonic() + 10, wire.Plain(b"\0" * 8, b"\3\0\0\0", KEY))))
        refused = await asyncio.wait_for(wire.read_to_front(reader), 5)
        assert isinstance(refused, wire.Refused) and refused.kind == "failed" and "do not add up" in refused.message
        writer.close()
    await group.batcher.stop(1)
    await other.batcher.stop(1)


def test_a_batch_of_runs_counts_each_text_in_the_metrics() -> None:
    metrics = Metrics()
    observer = metrics.observer("b", ["cpu"])
    metrics.loaded(KEY, "b", "cpu", "float32", 0.5, 1000)
    run = PlainRun.split(*texts([3, 4, 5]), KEY)[0]
    chunk = plain_job((1, 2)).chunks()[0]
    observer.on_batch([run, chunk], [Scores(np.zeros((3, 3), np.float32), KEY), [Result("x", {})]], 14, [0.01, 0.02],
                      0.05, 0)
    observer.on_drop("deadline", [run, chunk])
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}

    def value(family: str, suffix: str = "_total", **labels: str) -> float:
        return sum(s.value for s in fams[family].samples if s.name.endswith(suffix)
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("routing_texts_processed", model=KEY) == 4 and value("routing_tokens_processed", model=KEY) == 14
    assert value("routing_queue_wait_seconds", "_count", model=KEY) == 4  # a run's texts waited together
    assert abs(value("routing_queue_wait_seconds", "_sum", model=KEY) - (3 * 0.01 + 0.02)) < 1e-9
    assert value("routing_batch_size", "_sum") == 4 and value("routing_dropped_texts", reason="deadline") == 4
