"""The engine's shape buckets on the CPU (``use_buckets("eager")``: padded as on a GPU, not captured): plain batches
run there and answer what they answer without, within 1e-5; every other batch falls back to the eager path; a head
loaded after the warm-up takes a free slot and answers as when loaded at the start."""

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from service.modeling.buckets import length_sample
from service.modeling.tokenizer import ChunkTokenizer
from service.serving.core.work import CreditSpec, Task
from service.serving.engine.engine import Engine
from service.serving.engine.pipe import RunPlain
from tests.conftest import edit_manifest, write_tiny_model
from tests.serving.server import Server, side_by_side

TEXTS = ["short text", "a medium sized sentence, with a comma; and more words", "x", "one two three four five",
         "The routing head reads every layer and every token of it"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, tiny_backbone_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("buckets")
    for name, seed in [("first", 0), ("second", 1), ("late", 2)]:
        write_tiny_model(root, tiny_backbone_dir, name=name, seed=seed)
    return root


def assert_same(got: list, ref: list, tol: float = 1e-5) -> None:
    for a, b in zip(got, ref, strict=True):
        assert a.label == b.label and a.error is None
        assert max(abs(p - b.scores[k]) for k, p in a.scores.items()) <= tol
        assert max(abs(x - y) for x, y in zip(a.logits, b.logits, strict=True)) <= tol


def test_plain_batches_run_in_buckets_and_answer_as_without(repo: Path) -> None:
    engine = Engine.load([repo / "first", repo / "second"], device="cpu")
    tasks = [Task(t, model=m) for t in TEXTS for m in ("first", "second")]  # heads mixed, by slot
    before = engine.run(tasks)
    alone = [engine.run([t])[0] for t in tasks]
    stats = engine.use_buckets("eager", lengths=[len(engine.backbone.encode([t])[0].chunks[0]) for t in TEXTS])
    assert stats is not None and stats.capture_s > 0 and len(engine._buckets.buckets) > 0
    assert_same(engine.run(tasks), before)
    assert_same([engine.run([t])[0] for t in tasks], alone)
    assert engine.bucket_stats.bucketed == 1 + len(tasks) and engine.bucket_stats.unfit == 0
    assert engine.bucket_stats.tokens > engine.bucket_stats.real_tokens  # padded up to its bucket


def test_a_plain_batch_given_as_arrays_scores_as_its_texts_run_whole(repo: Path) -> None:
    """``begin_plain``: token ids back to back, lengths and each text's head (heads mixed, so sorted by slot inside
    and put back in the order given), scored as the engine answers the same texts; None (nothing launched) where
    it cannot run in a bucket: a head outside the slots, or no buckets."""
    engine = Engine.load([repo / "first", repo / "second"], device="cpu")
    models = ["second", "first", "second", "first", "first"]
    tasks = [Task(t, model=m) for t, m in zip(TEXTS, models, strict=True)]
    want = engine.run(tasks)
    chunks = [engine.encode([t], [m])[0][engine.max_length(m)].chunks[0] for t, m in zip(TEXTS, models, strict=True)]
    ids = np.array([i for c in chunks for i in c], dtype=np.int32)
    lengths = np.array([len(c) for c in chunks], dtype=np.int32)
    head = np.array([0, 1, 0, 1, 1], dtype=np.int32)  # second: 0, first: 1 (first is the default: None)
    assert engine.begin_plain(ids, lengths, head, ("second", None)) is None  # no buckets yet
    engine.use_buckets("eager", lengths=lengths.tolist())
    begun = engine.begin_plain(ids, lengths, head, ("second", None))
    assert begun is not None and begun.order is not None  # sorted by slot inside
    logits, phases = engine.complete_plain(begun)
    assert logits.shape == (5, 3) and set(phases) == {"encode", "heads", "host"}
    for row, answer in zip(logits.tolist(), want, strict=True):
        assert max(abs(x - y) for x, y in zip(row, answer.logits, strict=True)) <= 1e-5
    assert engine.begin_plain(ids, lengths, head, ("second", "nowhere")) is None


def test_whole_texts_tokenized_already_run_as_arrays(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run`` and ``run_pipelined`` take texts tokenized into one chunk each, asking no credit, as a plain batch of
    arrays (no chunk is planned or submitted), answered as without buckets; a batch with a text asking credit goes as
    chunks."""
    engine = Engine.load([repo / "first", repo / "second"], device="cpu")
    models = ["second", "first", "first", "second", "first"]
    tasks = [Task(t, engine.encode([t], [m])[0][engine.max_length(m)], m) for t, m in zip(TEXTS, models, strict=True)]
    want = engine.run(tasks)
    engine.use_buckets("eager", lengths=[len(t.encoding.chunks[0]) for t in tasks])  # type: ignore[union-attr]
    submitted = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda works: (submitted.append(len(works)), submit(works))[1])
    assert_same(engine.run(tasks), want)
    assert_same([r for rs in engine.run_pipelined([tasks[:2], tasks[2:]]) for r in rs], want)
    assert submitted == []  # as arrays, every batch
    with_credit = [*tasks[:2], Task(TEXTS[0], tasks[0].encoding, models[0], CreditSpec())]
    assert [r for rs in engine.run_pipelined([with_credit]) for r in rs][2].credit is not None
    assert submitted == [3]


def test_other_batches_fall_back_to_the_eager_path(repo: Path) -> None:
    engine = Engine.load(repo / "first", device="cpu")
    long = "many words in a text that runs over one chunk of the backbone " * 20
    credit = [Task(TEXTS[0], credit=CreditSpec())]
    cases = {"credit": credit, "several chunks": [Task(long)]}
    want = {k: engine.run(v) for k, v in cases.items()}
    engine.use_buckets("eager", lengths=[4, 8, 12], max_texts=4)  # buckets for a few short texts only
    for name, tasks in cases.items():
        assert_same(engine.run(tasks), want[name])
    assert engine.bucket_stats.bucketed == 0
    many = [Task(t) for t in TEXTS * 4]  # more texts than any bucket's rows
    assert_same(engine.run(many), [engine.run([t])[0] for t in many])  # (those one by one fit)
    assert engine.bucket_stats.unfit == 1 and engine.bucket_stats.bucketed == len(many)
    credit_answer = engine.run(credit)[0]
    assert credit_answer.credit is not None  # credit still computed (eagerly)
    engine.use_buckets("off")
    assert engine.bucket_stats is None


@pytest.mark.parametrize("one_head", [True, False])
def test_a_batch_of_one_head_runs_with_its_parameters_broadcast_and_answers_as_mixed(repo: Path, one_head: bool
                                                                                      ) -> None:
    """A batch whose texts all ask one head takes its bucket's computation for one head (the head picked out of its
    slot, not gathered for every text; ``one_head_buckets``): each head its own parameters, whatever its slot, and
    the answers of the computation for any heads and of the engine without buckets, within 1e-5; a batch of two
    heads takes the other."""
    engine = Engine.load([repo / "first", repo / "second"], device="cpu")
    engine.one_head_buckets = one_head
    by_head = {m: [Task(t, model=m) for t in TEXTS] for m in ("first", "second")}
    want = {m: engine.run(tasks) for m, tasks in by_head.items()}
    engine.use_buckets("eager", lengths=[len(engine.backbone.encode([t])[0].chunks[0]) for t in TEXTS])
    runner = engine._buckets
    assert runner.slots.slot_of == {"first": 0, "second": 1}
    for m, tasks in by_head.items():
        assert_same(engine.run(tasks), want[m])
    assert engine.bucket_stats.one_head == (2 if one_head else 0) and engine.bucket_stats.bucketed == 2
    mixed = [t for pair in zip(*by_head.values(), strict=True) for t in pair]
    assert_same(engine.run(mixed), [a for pair in zip(*want.values(), strict=True) for a in pair])
    assert engine.bucket_stats.one_head == (2 if one_head else 0) and engine.bucket_stats.bucketed == 3
    # the two computations of a bucket, side by side on a batch of the second head
    batch = RunPlain.of([(engine.encode([t], ["second"])[0][engine.max_length("second")].chunks[0], "second")
                         for t in TEXTS], [])
    bucket = runner.fits(batch.lengths)
    inputs = torch.from_numpy(runner.inputs_of(batch.ids.astype(np.int64), batch.lengths.astype(np.int64),
                                               np.ones(len(TEXTS), dtype=np.int64), bucket))
    with torch.inference_mode():
        for_one, for_any = (runner._compute(bucket, one)(inputs)[: len(TEXTS)] for one in (True, False))
    torch.testing.assert_close(for_one, for_any, rtol=0, atol=1e-5)
    assert torch.equal(runner.slots.picked.W, runner.slots.head.W[1])  # the second's, picked out of its slot


def test_a_head_loaded_after_warm_up_answers_as_loaded_at_start(repo: Path) -> None:
    at_start = Engine.load([repo / "first", repo / "late"], device="cpu")
    want = at_start.run([Task(t, model="late") for t in TEXTS])
    engine = Engine.load(repo / "first", device="cpu")
    engine.use_buckets("eager", capacity=2)
    storage = [p.data_ptr() for p in engine._buckets.slots.head.parameters()]
    engine.add_heads([repo / "late"], ["late"])
    assert engine._buckets.slots.slot_of == {"first": 0, "late": 1}
    assert [p.data_ptr() for p in engine._buckets.slots.head.parameters()] == storage  # nothing new to capture
    bucketed = engine.bucket_stats.bucketed
    assert_same(engine.run([Task(t, model="late") for t in TEXTS]), want)
    assert engine.bucket_stats.bucketed == bucketed + 1
    engine.add_heads([repo / "second"], ["second"])  # no free slot: it runs eagerly, and right
    assert "second" not in engine._buckets.slots.slot_of
    assert engine.run([Task(TEXTS[0], model="second")])[0].error is None
    engine.remove_heads(["late"])
    assert engine._buckets.slots.slot_of == {"first": 0}


def test_a_bucket_that_does_not_run_is_dropped_and_its_batches_go_eagerly(repo: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from service.routing import segments

    engine = Engine.load(repo / "first", device="cpu")
    want = engine.run([Task(t) for t in TEXTS])

    def refuse(*args: object, **kwargs: object) -> object:
        raise RuntimeError("strides should be multiple of 16 bytes")

    monkeypatch.setattr(segments, "by_slot", refuse)  # as for a head whose products the grouped kernels refuse
    stats = engine.use_buckets("eager", lengths=[4, 8, 12])
    assert stats.buckets == 0 and stats.failed and all("runs nowhere" in v for v in stats.failed.values())
    assert_same(engine.run([Task(t) for t in TEXTS]), want)
    assert engine.bucket_stats.bucketed == 0 and engine.bucket_stats.unfit == 1


def test_buckets_follow_the_lengths_the_manifests_keep(tmp_path: Path, tiny_backbone_dir: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    folder = write_tiny_model(tmp_path, tiny_backbone_dir, name="kept")
    engine = Engine.load(folder, device="cpu")
    with caplog.at_level(logging.WARNING, logger="service.engine"):
        engine.use_buckets("eager", max_texts=4)
    assert "no model keeps its texts' lengths" in caplog.text  # every length alike, and said so
    generic = engine._buckets.buckets
    edit_manifest(folder, token_lengths=length_sample([5] * 50 + [9] * 50))
    engine = Engine.load(folder, device="cpu")
    engine.use_buckets("eager", max_texts=4)
    assert max(b.tokens for b in engine._buckets.buckets) <= 48 < max(b.tokens for b in generic)
    assert_same(engine.run([Task("a b c")]), Engine.load(folder, device="cpu").run([Task("a b c")]))
    assert engine.bucket_stats.bucketed == 1


def test_a_server_with_buckets_answers_as_one_without_through_the_api(tiny_repo: Path,
                                                                      tmp_path_factory: pytest.TempPathFactory
                                                                      ) -> None:
    """``ROUTING_BUCKETS=eager`` (the setting a GPU's ``cuda`` shares its path with), the model in a process of its
    own: every answer within 1e-5 of a server without buckets, alone, together and concurrently."""
    texts = ["the first text", "a second, somewhat longer text. It has two sentences!", "x", "Long one. " * 40]
    with_buckets, without = side_by_side(tmp_path_factory.mktemp("logs-buckets"), *(
        {"model_repository": tiny_repo, "default_model": "tiny", "buckets": mode} for mode in ("eager", "off")))
    try:
        def classify(server: Server, inputs: list[str]) -> list[dict]:
            r = httpx.post(f"{server.url}/v1/classify", json={"inputs": inputs}, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()["results"]

        async def concurrently(server: Server) -> list[dict]:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                rs = await asyncio.gather(*(client.post("/v1/classify", json={"inputs": [t]}) for t in texts * 3))
            return [r.json()["results"][0] for r in rs]

        reference = [classify(without, [t])[0] for t in texts]
        answers = [*([classify(with_buckets, [t])[0] for t in texts]), *classify(with_buckets, texts),
                   *asyncio.run(concurrently(with_buckets))]
        for k, got in enumerate(answers):
            ref = reference[k % len(texts)]
            assert got["label"] == ref["label"]
            assert max(abs(got["scores"][lab] - p) for lab, p in ref["scores"].items()) <= 1e-5
        explained = httpx.post(f"{with_buckets.url}/v1/explain", json={"inputs": texts[:1]}, timeout=30)
        assert explained.status_code == 200 and explained.json()["results"][0]["credit"]  # credit: eagerly
        assert "shape buckets (eager) warmed" in with_buckets.log_path.read_text()
        assert "shape buckets" not in without.log_path.read_text()
    finally:
        assert [s.stop() for s in (with_buckets, without)] == [0, 0]


def test_fronts_send_plain_texts_as_runs_and_read_their_scores_as_one_front_answers(
        tiny_repo: Path, tiny_backbone_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two fronts over an engine host whose backbone takes plain batches (``eager`` buckets): a request of several
    plain texts goes as arrays, is batched in runs and answered with its scores unread, which the front reads; every
    answer within 1e-5 of one front without buckets, whatever shares the batch (single texts, which go as jobs; texts
    asking for credit, with which a run is computed text by text), and a text too long for one chunk among them."""
    many = [f"text number {k} " + "and more " * (k % 4) for k in range(20)]  # two runs (16 texts at most)
    long = "Long one. " * 40
    chunker = ChunkTokenizer.load(str(tiny_backbone_dir))  # each of ``many`` one chunk of the tiny model's 16 tokens:
    assert all(len(enc.chunks) == 1 for enc in chunker.encode(many, 16))  # plain texts, sent as arrays
    runs, one = side_by_side(tmp_path_factory.mktemp("logs-runs"), {
        "model_repository": tiny_repo, "default_model": "tiny", "buckets": "eager", "workers": 2, "max_wait_ms": 20},
        {"model_repository": tiny_repo, "default_model": "tiny", "buckets": "off"})
    try:
        def reference(text: str) -> dict:
            r = httpx.post(f"{one.url}/v1/classify", json={"inputs": [text]}, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()["results"][0]

        bodies = [{"inputs": many}, {"inputs": many[:5]}, {"inputs": [many[3]]}, {"inputs": [*many[:6], long]},
                  {"inputs": many[:4], "explain": True}, {"inputs": many[::-1]}]

        async def together() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=runs.url, timeout=60) as client:
                return await asyncio.gather(*(client.post("/v1/classify", json=b) for b in bodies * 3))

        alone = [httpx.post(f"{runs.url}/v1/classify", json=b, timeout=60) for b in bodies]
        want = {t: reference(t) for t in {*many, long}}
        for body, r in zip(bodies * 4, [*alone, *asyncio.run(together())], strict=True):
            assert r.status_code == 200, r.text
            for text, got in zip(body["inputs"], r.json()["results"], strict=True):
                ref = want[text]
                assert got["label"] == ref["label"] and list(got["scores"]) == list(ref["scores"])
                assert max(abs(got["scores"][lab] - p) for lab, p in ref["scores"].items()) <= 1e-5
                assert (got["explanation"] is not None) == bool(body.get("explain"))
    finally:
        assert [s.stop() for s in (runs, one)] == [0, 0]


def test_a_head_reloaded_in_another_shape_leaves_its_slot(repo: Path, tmp_path: Path, tiny_backbone_dir: Path) -> None:
    engine = Engine.load(repo / "first", device="cpu")
    engine.use_buckets("eager", capacity=2)
    wider = write_tiny_model(tmp_path, tiny_backbone_dir, name="first", labels=["a", "b", "c", "d"])  # 4 labels
    engine.add_heads([wider], ["first"])  # reloaded under its key
    assert "first" not in engine._buckets.slots.slot_of
    got = engine.run([Task(t) for t in TEXTS])
    assert all(set(r.scores) == {"a", "b", "c", "d"} for r in got) and engine.bucket_stats.bucketed == 0


def shapes_only(compute: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor) -> tuple[int, ...]:
    """``compute(inputs)``'s output shape, computed on fake tensors (shapes and dtypes, no values): an operation whose
    output's shape depends on values (a read back to the host, which a CUDA graph cannot capture) raises, and so does
    a grouped product that the CUDA kernel's checks (dtype, 16-byte strides; torch's meta functions repeat them)
    refuse."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.inference_mode():
        return tuple(compute(mode.from_tensor(inputs)).shape)


def host_data(compute: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor) -> list[str]:
    """The tensors ``compute(inputs)`` makes of the host's data (``torch.tensor``, ``new_tensor``): on a GPU each is a
    copy from the host, which a CUDA graph cannot capture (the copy waits for the device)."""
    made: list[str] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten.lift_fresh.default:
                made.append(str(args[0]))
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(), Spy():
        compute(inputs)
    return made


@pytest.mark.parametrize("model", ["tiny", "bundled"])
def test_every_bucket_computes_what_a_cuda_graph_can_capture(model: str, repo: Path) -> None:
    """The GPU captures each bucket's computations (for any heads, and for one); what would stop it there is checked
    here, on its shapes: every bucket's computation, the heads' products in bfloat16 as ``cuda`` has them (their
    parameters in float32), reads nothing back, makes no tensor of the host's data and passes the grouped products'
    checks (the tiny heads, and the bundled model's, whose shape the GPU run measures)."""
    folder = repo / "first" if model == "tiny" else Path(__file__).parents[2] / "models" / "tweet-sentiment"
    engine = Engine.load(folder, device="cpu")
    engine.head_dtype = "bfloat16"  # what use_buckets("cuda") sets
    # (every bucket warmed whatever it takes, and small: the bundled heads' products in bfloat16 are slow on a CPU
    # without bfloat16 units, where 20 s, the default, warmed 3 of 6 buckets of 64 texts on a slow day; what the
    # check reads is the heads' computation, the same at any number of rows)
    engine.use_buckets("eager", lengths=[4, 9, 30], max_texts=4, count=6, deadline_s=600)
    runner = engine._buckets
    assert runner.head_dtype == torch.bfloat16 and next(runner.slots.head.parameters()).dtype == torch.float32
    k = len(engine.manifests[engine.default].labels)
    assert len(runner.buckets) == 6
    for bucket in runner.buckets:
        for one in (False, True):
            assert shapes_only(runner._compute(bucket, one), runner._example(bucket)) == (bucket.rows, k)
            assert host_data(runner._compute(bucket, one), runner._example(bucket)) == []

    def reads_back(inputs: torch.Tensor) -> torch.Tensor:  # the check fails where something is read back
        return runner._compute(bucket)(inputs)[: int(inputs[0])]

    with pytest.raises(DataDependentOutputException):
        shapes_only(reads_back, runner._example(bucket))
    assert host_data(lambda inputs: inputs + inputs.new_tensor(1), runner._example(bucket)) == ["tensor(1)"]
    with pytest.raises(DynamicOutputShapeException):  # repeats without output_size: their sum read back
        shapes_only(lambda inputs: torch.repeat_interleave(inputs[:2], inputs[2:4]), torch.tensor([0, 1, 2, 3]))


def test_buckets_with_the_heads_products_in_bfloat16_answer_as_without(repo: Path) -> None:
    """What ``cuda`` runs, run here eagerly: the heads' products in bfloat16 (their parameters in float32, autocast),
    the grouped products too; each answer within bfloat16's rounding of the engine without buckets, same label."""
    engine = Engine.load([repo / "first", repo / "second"], device="cpu")
    engine.head_dtype = "bfloat16"
    tasks = [Task(t, model=m) for t in TEXTS for m in ("first", "second")]
    want = engine.run(tasks)
    engine.use_buckets("eager", lengths=[4, 9, 14])
    for got, ref in zip(engine.run(tasks), want, strict=True):  # the tolerances of tests/serving/test_head_precision
        assert got.label == ref.label and got.error is None
        assert max(abs(p - ref.scores[k]) for k, p in got.scores.items()) <= 0.02
        assert max(abs(x - y) for x, y in zip(got.logits, ref.logits, strict=True)) <= 0.1
    assert engine.bucket_stats.bucketed == 1


def test_cuda_buckets_without_a_gpu_are_refused_and_change_nothing(repo: Path) -> None:
    engine = Engine.load(repo / "first", device="cpu")
    with pytest.raises(ValueError, match="CUDA"):
        engine.use_buckets("cuda")
    assert engine.head_dtype == "float32" and engine.bucket_stats is None
