"""A backbone and its heads in a process of their own: the same answers as in the server's process, texts
whose chunks span batches, texts given up, a process that exits, one asked to close, a process that cannot load,
and no orphan when the server is killed."""

from __future__ import annotations

import gc
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from service.serving.core.results import answers_of
from service.serving.core.work import CreditSpec, Task
from service.serving.engine.engine import Engine
from service.serving.engine.process import BackboneProcess, MemoryReadings, ModelProcessError
from tests.serving.server import Server

TEXTS = ["a short text", "Long one. " * 30, "and a third, somewhat longer text than the first"]


@pytest.fixture(scope="module")
def model(tiny_repo: Path) -> Iterator[BackboneProcess]:
    mp = BackboneProcess(tiny_repo / "tiny", device="cpu")
    try:
        yield mp
    finally:
        mp.close()


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5


def test_chunks_over_several_batches_give_the_engines_answers(model: BackboneProcess, tiny_repo: Path) -> None:
    tasks = [Task(t, credit=CreditSpec()) for t in TEXTS]
    chunks = [w for plan in model.plan(tasks) for w in plan]
    assert len(chunks) > len(TEXTS)  # the long text has several chunks (max_length 16)
    answers, held = [], []
    for k in range(0, len(chunks), 2):  # two chunks per batch: the long text spans several
        answers += model.run_chunks(chunks[k : k + 2])
        held.append(model.held_texts)
    assert max(held) == 1 and held[-1] == 0  # its states were held between batches, then let go
    expected = Engine.load(tiny_repo / "tiny", device="cpu").run(tasks)
    for (got,), want in zip(answers_of(chunks, answers), expected, strict=True):
        assert got.label == want.label and close(list(got.scores.values()), list(want.scores.values()))
        assert got.credit is not None and want.credit is not None
        assert close(got.credit.targets[0].tokens, want.credit.targets[0].tokens)


def test_a_text_given_up_is_forgotten(model: BackboneProcess) -> None:
    chunks = [w for plan in model.plan([Task("Long one. " * 30)]) for w in plan]
    model.run_chunks(chunks[:1])
    assert model.held_texts == 1
    del chunks  # nobody waits for the rest of it: its job is freed
    gc.collect()
    model.run_chunks([w for plan in model.plan([Task("short")]) for w in plan])
    assert model.held_texts == 0


def test_a_process_that_exits_is_started_again_and_closes_cleanly(tiny_repo: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    mp = BackboneProcess(tiny_repo / "tiny", device="cpu")
    try:
        work = [w for plan in mp.plan([Task("a short text")]) for w in plan]
        pids = [mp.pid]
        assert mp.restarts() == 0
        os.kill(pids[-1], signal.SIGKILL)  # between batches: the next batch starts a new process
        mp._proc.wait()
        ((answer,),) = mp.run_chunks(work)
        assert answer.label in mp.labels("tiny") and mp.pid not in pids and mp.restarts() == 1
        pids.append(mp.pid)
        os.kill(pids[-1], signal.SIGKILL)  # during a batch (it is seen exiting only once the batch is sent):
        mp._proc.wait()
        with monkeypatch.context() as m:
            seen_alive = iter([None])  # the first look still finds it running
            m.setattr(mp._proc, "poll", lambda real=mp._proc.poll: next(seen_alive, real()))
            ((answer,),) = mp.run_chunks(work)  # the batch is computed again, by a new process
        assert answer.error is None and answer.label in mp.labels("tiny")
        assert mp.pid not in pids and mp.restarts() == 2
        pids.append(mp.pid)
        os.kill(pids[-1], signal.SIGKILL)  # a process that dies under the batch twice: the batch fails
        mp._proc.wait()
        with monkeypatch.context() as m:
            m.setattr(mp._proc, "poll", lambda: None)
            with pytest.raises(ModelProcessError, match=r"exited .* twice while computing this batch"):
                mp.run_chunks(work)
        ((answer,),) = mp.run_chunks(work)  # and the next one is computed by a new process
        assert mp.pid not in pids and mp.restarts() == 3
        long = [w for plan in mp.plan([Task("Long one. " * 30)]) for w in plan]
        mp.run_chunks(long[:1])
        mp.add_heads([tiny_repo / "tiny"], ["again"], warmup=False)
        os.kill(mp.pid, signal.SIGKILL)  # with a text half computed: its first chunk's states are gone
        mp._proc.wait()
        mp.remove_heads(["again"])  # heads dropped from a process that has exited are dropped all the same
        assert mp.models == ["tiny"] and mp.restarts() == 3
        answers = mp.run_chunks(long[1:] + work)
        lost = [a[0] for a in answers[:-1] if a is not None]
        assert lost and all(a.error and "exited while this text was being computed" in a.error for a in lost)
        assert answers[-1] is not None and answers[-1][0].error is None  # other texts are computed as usual
        assert mp.restarts() == 4 and set(mp._descriptions) == {"tiny"}  # the new process loaded only 'tiny'
    finally:
        mp.close(timeout_s=30)
    assert mp._proc.returncode == 0  # asked to close after a batch, it exited on its own, not killed after the timeout
    mp.close()  # a second close does nothing (its loop and pipe are closed already)


def test_a_process_attached_to_a_loop_computes_there_and_changes_heads_from_threads(tiny_repo: Path) -> None:
    """Attached to a server's event loop, a backbone's process is awaited there (its runners are coroutine functions;
    no thread reads its pipe), answering as the engine; a change of heads from a thread goes through that loop, a
    blocking call on the loop itself is refused rather than waiting for itself, and it closes from a thread."""
    import asyncio
    import inspect
    import threading

    texts = ["a short text", "another", "and a third one"]
    want = Engine.load(tiny_repo / "tiny", device="cpu").run([Task(t) for t in texts])
    mp = BackboneProcess(tiny_repo / "tiny", device="cpu", in_flight=2)

    async def serve() -> list:
        await mp.attach()
        assert all(inspect.iscoroutinefunction(r) for r in mp.runners) and len(mp.runners) == 2
        threads = threading.active_count()
        chunks = [[w for plan in mp.plan([Task(t)]) for w in plan] for t in texts]
        got = await asyncio.gather(*(mp.runners[k % 2](c) for k, c in enumerate(chunks)))
        assert threading.active_count() == threads  # no thread a batch
        await asyncio.to_thread(mp.add_heads, [tiny_repo / "tiny"], ["again"], False)
        again = [w for plan in mp.plan([Task(texts[0], model="again")]) for w in plan]
        got.append(await mp.arun_chunks(again))
        with pytest.raises(RuntimeError, match="would wait for itself"):
            mp.run_chunks(again)
        await asyncio.to_thread(mp.close, 30)
        return [a[0][0] for a in got]

    got = asyncio.run(serve())
    for answer, w in zip(got, [*want, want[0]], strict=True):
        assert answer.label == w.label and close(list(answer.scores.values()), list(w.scores.values()))
    assert mp._proc.returncode == 0  # asked to close, it exited on its own


def test_a_model_that_cannot_load_says_why(tiny_repo: Path, tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    shutil.copytree(tiny_repo / "tiny", folder)
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(b"not safetensors")
    with pytest.raises(ModelProcessError, match="ModelLoadError"):
        BackboneProcess(folder, device="cpu")


def test_the_api_answers_alike_in_either_process(pair: list[Server]) -> None:
    body = {"inputs": TEXTS, "explain": True}
    replies = [httpx.post(f"{srv.url}/v1/classify", json=body, timeout=60) for srv in pair]
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    answers = [r.json()["results"] for r in replies]
    for a, b in zip(*answers, strict=True):
        assert a["label"] == b["label"] and close(list(a["scores"].values()), list(b["scores"].values()))
        credit = [[t["credit"] for t in x["explanation"]["tokens"]] for x in (a, b)]
        assert close(*credit)


def test_no_model_process_outlives_a_killed_server(tiny_repo: Path, tmp_path: Path) -> None:
    srv = Server(tmp_path, model_repository=tiny_repo, default_model="tiny").wait_ready()
    found = re.search(r"\['tiny'\]\) computes in process (\d+)", srv.full_log())
    assert found, srv.log()
    child = int(found.group(1))
    os.kill(child, 0)  # alive
    srv.proc.kill()
    srv.proc.wait()
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the model's process outlived the server by 10 s")


def test_cuda_memory_of_the_model_processes_is_summed_per_device() -> None:
    from service.config import Settings
    from service.serving.engine.group import LocalGroup
    from service.serving.observe.metrics import Metrics
    from service.serving.state import AppState

    state = AppState(settings=Settings(), metrics=Metrics())
    for k, allocated in enumerate((1.0, 2.0)):  # two backbones' processes on one GPU, as of their last batches
        mp = object.__new__(BackboneProcess)
        mp.name, mp.manifests = f"b{k}", {}
        mp._memory = [{"device": "cuda:0", "allocated": allocated, "reserved": 2 * allocated, "peak": 3 * allocated,
                       "total": 80.0}]
        state.registry.add(LocalGroup(mp, batcher=None))  # type: ignore[arg-type]
    assert state.device_memory() == [{"device": "cuda:0", "allocated": 3.0, "reserved": 6.0, "peak": 9.0,
                                      "total": 80.0}]


def test_the_device_memory_sent_with_batches_is_read_at_most_once_an_interval() -> None:
    reads: list[float] = []

    def read() -> list[dict[str, float | str]]:
        reads.append(float(len(reads) + 1))
        return [{"device": "cuda:0", "allocated": reads[-1]}]

    every_minute = MemoryReadings(read, every_s=60)  # read once at the start, then the same reading with each batch
    assert [every_minute()[0]["allocated"] for _ in range(5)] == [1.0] * 5 and reads == [1.0]
    always = MemoryReadings(read, every_s=0)
    assert [always()[0]["allocated"] for _ in range(3)] == [3.0, 4.0, 5.0]


def test_replicas_answer_as_one_process_and_keep_a_texts_chunks_together(tiny_repo: Path, tmp_path: Path) -> None:
    """Two processes of the model, batches of two chunks (a long text spans several): concurrent requests
    get the engine's answers, both processes compute, and neither outlives the server."""
    from service.bench.server import cpu_seconds
    from tests.serving.server import metric

    srv = Server(tmp_path, model_repository=tiny_repo, default_model="tiny", model_replicas=2, max_batch_size=2,
                 max_wait_ms=0).wait_ready()
    try:
        pids = [int(p) for p in re.findall(r"\['tiny'\]\) computes in process (\d+)", srv.full_log())]
        assert len(set(pids)) == 2 and "computes in 2 processes (cpu, cpu) of 1 torch threads each" in srv.full_log()
        before = [cpu_seconds(p) or 0.0 for p in pids]
        page = _answers_as_the_engines(srv, tiny_repo)
        assert all((cpu_seconds(p) or 0.0) > b for p, b in zip(pids, before, strict=True))  # both computed
        assert metric(page, "routing_backbone_process_resident_memory_bytes", backbone="tiny-bert@random") > 0
    finally:
        srv.stop()
    for p in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(p, 0)


def _answers_as_the_engines(srv: Server, tiny_repo: Path) -> str:
    """Twelve concurrent requests of :data:`TEXTS` with credit (batches of two chunks: the long text spans several)
    answered as the engine answers them in this process; the server's metrics page after them."""
    engine = Engine.load(tiny_repo / "tiny", device="cpu")
    expected = engine.run([Task(t, credit=CreditSpec()) for t in TEXTS])
    special = [e.special for e in engine.chunker.encode(TEXTS, engine.max_length("tiny"))]
    with httpx.Client(base_url=srv.url, timeout=60) as client, ThreadPoolExecutor(6) as pool:
        rs = list(pool.map(lambda _: client.post("/v1/classify", json={"inputs": TEXTS, "explain": True}),
                           range(12)))
        page = client.get("/metrics").text
    for r in rs:
        assert r.status_code == 200, r.text
        for got, want, sp in zip(r.json()["results"], expected, special, strict=True):
            assert got["label"] == want.label and close(list(got["scores"].values()), list(want.scores.values()))
            assert want.credit is not None  # the API lists the text's own tokens, not the special ones
            words = [c for c, s in zip(want.credit.targets[0].tokens, sp, strict=True) if not s]
            assert close([t["credit"] for t in got["explanation"]["tokens"]], words)
    return page


def test_a_server_with_two_batches_in_flight_answers_as_the_engine(tiny_repo: Path, tmp_path: Path) -> None:
    """``ROUTING_BATCHES_IN_FLIGHT=2`` (a GPU's default) on the CPU: the batcher's two runners send batches to one
    process, which answers each with its own texts' answers."""
    from tests.serving.server import metric

    srv = Server(tmp_path, model_repository=tiny_repo, default_model="tiny", batches_in_flight=2, max_batch_size=2,
                 max_wait_ms=0).wait_ready()
    try:
        page = _answers_as_the_engines(srv, tiny_repo)
        batches = [metric(page, "routing_engine_batches_total", backbone="tiny-bert@random", engine=str(k),
                          device="cpu") for k in (0, 1)]
        assert all(n > 0 for n in batches)  # both runners sent batches
    finally:
        srv.stop()


def test_a_batchs_answers_carry_the_engines_phases_across_the_process(model: BackboneProcess) -> None:
    """The answers of a batch computed in a backbone's process come back with the engine's time in each phase (a
    batch's trace reads them), each measured, not made up: the encoder's and the heads' time are above zero."""
    answers = model.run_chunks([w for plan in model.plan([Task("a short text"), Task("another")]) for w in plan])
    assert len(answers) == 2 and all(a is not None for a in answers)
    phases = answers.phases  # type: ignore[attr-defined]
    assert set(phases) == {"encode", "heads", "host"} and phases["encode"] > 0 and phases["heads"] > 0
    assert all(s >= 0 for s in phases.values())


def test_two_batches_in_flight_are_answered_in_order_with_the_engines_answers(tiny_repo: Path) -> None:
    """A process holding two batches at once (``batches_in_flight=2``: the next is submitted before the one ahead of
    it is answered) answers each batch with its own texts' answers, batches sent from two threads at once, a long
    text's chunks over several batches of one runner included."""
    engine = Engine.load(tiny_repo / "tiny", device="cpu")
    texts = [f"text number {k} of many, {'long ' * (k % 7)}" for k in range(24)] + ["Long one. " * 30]
    expected = engine.run([Task(t) for t in texts])
    mp = BackboneProcess(tiny_repo / "tiny", device="cpu", in_flight=2)
    try:
        assert len(mp.runners) == 2 and mp.runner_devices == ["cpu", "cpu"]

        def run(ks: list[int]) -> list[tuple[int, str, list[float]]]:
            chunks = [w for plan in mp.plan([Task(texts[k]) for k in ks]) for w in plan]
            answers: list = []
            for at in range(0, len(chunks), 3):  # batches of three chunks, one after another on this runner
                answers += mp.runners[ks[0] % 2](chunks[at:at + 3])
            return [(k, a.label, list(a.scores.values())) for k, (a,) in zip(ks, answers_of(chunks, answers),
                                                                               strict=True)]

        with ThreadPoolExecutor(2) as pool:
            got = [r for rs in pool.map(run, [list(range(0, 25, 2)), list(range(1, 25, 2))]) for r in rs]
        assert sorted(k for k, _, _ in got) == list(range(25))
        for k, label, scores in got:
            assert label == expected[k].label and close(scores, list(expected[k].scores.values())), k
    finally:
        mp.close(timeout_s=30)


def test_two_batches_in_flight_when_the_process_exits_are_both_computed_again(tiny_repo: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The process exits with two batches sent to it: each is computed again by the process started in its place
    (started once), and a change of heads waits for the batches sent before it."""
    mp = BackboneProcess(tiny_repo / "tiny", device="cpu", in_flight=2)
    try:
        work = [[w for plan in mp.plan([Task(t)]) for w in plan] for t in ("a short text", "another text")]
        want = [mp.run_chunks(w)[0][0].label for w in work]  # type: ignore[index]
        send, sent = mp._send, []

        def send_then_kill(msg: object) -> object:
            if not sent:  # stopped first: it cannot answer the first batch before the second is sent
                os.kill(mp.pid, signal.SIGSTOP)
            reply = send(msg)  # type: ignore[arg-type]
            sent.append(mp.pid)
            if len(sent) == 2:  # gone with both batches
                os.kill(mp.pid, signal.SIGKILL)
                mp._proc.wait()
            return reply

        with monkeypatch.context() as m:  # seen running when the two batches are sent, exited once they are
            m.setattr(mp, "_send", send_then_kill)
            m.setattr(mp._proc, "poll", lambda real=mp._proc.poll: None if len(sent) < 2 else real())
            with ThreadPoolExecutor(2) as pool:
                first = pool.submit(mp.runners[0], work[0])
                while not sent:  # the first batch is sent before the second
                    time.sleep(0.001)
                second = pool.submit(mp.runners[1], work[1])
                got = [first.result(timeout=60), second.result(timeout=60)]
        assert sent[0] == sent[1] and sent[2] == sent[3] != sent[0] and len(sent) == 4  # again, once each
        assert [a[0][0].label for a in got] == want and all(a[0][0].error is None for a in got)  # type: ignore[index]
        assert mp.restarts() == 1
        mp.add_heads([tiny_repo / "tiny"], ["again"], warmup=False)  # on the new process, between batches
        assert mp.run_chunks(work[0])[0][0].label == want[0]  # type: ignore[index]
    finally:
        mp.close(timeout_s=30)
    assert mp._proc.returncode == 0


def test_plain_batches_cross_the_pipe_as_arrays_and_answer_as_the_engine(tiny_repo: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A process whose plain batches run in shape buckets takes them as arrays (``RunPlain``) and sends back their
    scores alone (``ComputedPlain``), read into answers here: the engine's answers within 1e-5; one that fits no
    bucket is run there as chunks. A batch with a text asking for credit, or a text of several chunks, goes as chunks
    (``RunBatch``), answered as before."""
    from service.serving.engine.pipe import BucketPlan

    texts = [f"text number {k}, {'word ' * (k % 5)}" for k in range(12)]
    engine = Engine.load(tiny_repo / "tiny", device="cpu")
    want = engine.run([Task(t) for t in texts])
    credit = engine.run([Task(TEXTS[0], credit=CreditSpec())])[0]
    long = engine.run([Task(TEXTS[1])])[0]
    mp = BackboneProcess(tiny_repo / "tiny", device="cpu", buckets=BucketPlan("eager", max_texts=16, budget=512))
    try:
        sent: list[str] = []
        send = mp._send
        monkeypatch.setattr(mp, "_send", lambda msg: (sent.append(type(msg).__name__), send(msg))[1])
        chunks = [w for plan in mp.plan([Task(t) for t in texts]) for w in plan]
        answers = answers_of(chunks, mp.run_chunks(chunks))
        phases = mp.run_chunks(chunks[:2]).phases  # type: ignore[attr-defined]
        assert set(phases) == {"encode", "heads", "host"} and phases["heads"] > 0
        for (got,), w in zip(answers, want, strict=True):
            assert got.label == w.label and close(got.logits, w.logits) and close(list(got.scores.values()),
                                                                                 list(w.scores.values()))
        with_credit = [w for plan in mp.plan([Task(TEXTS[0], credit=CreditSpec())]) for w in plan]
        (got_credit,) = answers_of(with_credit, mp.run_chunks(with_credit))[0]
        several = [w for plan in mp.plan([Task(TEXTS[1])]) for w in plan]
        (got_long,) = answers_of(several, mp.run_chunks(several))[0]
        assert sent == ["RunPlain", "RunPlain", "RunBatch", "RunBatch"]
        assert got_credit.credit is not None and close(got_credit.credit.targets[0].tokens,
                                                       credit.credit.targets[0].tokens)
        assert got_long.label == long.label and close(got_long.logits, long.logits)
        many = [w for plan in mp.plan([Task(t) for t in texts * 2]) for w in plan]  # more texts than any bucket's
        for (got,), w in zip(answers_of(many, mp.run_chunks(many)), want * 2, strict=True):  # so run as chunks there
            assert got.label == w.label and close(got.logits, w.logits)
        assert sent[-1] == "RunPlain"
    finally:
        mp.close()


class _Device:
    """A stand-in for a begun batch's device work: computed once ``done`` (what ``Engine.computed`` reads)."""

    def __init__(self) -> None:
        self.done = False
        self.asked = 0

    def computed(self, begun: object) -> bool:
        self.asked += 1
        return self.done


def test_a_batch_that_arrives_while_the_device_computes_is_taken_before_the_one_ahead_is_completed() -> None:
    from multiprocessing import Pipe

    from service.serving.engine.process import _message_first

    ours, theirs = Pipe()
    device = _Device()
    try:
        # the device still computing the batch ahead: the process waits until the next batch comes, and takes it
        # first (it goes on the device behind the one ahead), not after the scores
        with ThreadPoolExecutor(1) as pool:
            pool.submit(lambda: (time.sleep(0.05), theirs.send("next batch")))
            assert _message_first(ours, device, object())  # type: ignore[arg-type]
        assert device.asked > 1 and ours.recv() == "next batch"
        device.done = True  # the device done and nothing behind: the batch ahead is completed at once
        assert not _message_first(ours, device, object())  # type: ignore[arg-type]
        theirs.send("another")  # both: the message first, as before the device was asked at all
        asked = device.asked
        assert _message_first(ours, device, object()) and device.asked == asked  # type: ignore[arg-type]
    finally:
        ours.close()
        theirs.close()


def test_a_begun_batch_on_the_cpu_is_computed_already(tiny_repo: Path) -> None:
    engine = Engine.load(tiny_repo / "tiny", device="cpu")
    tasks = [Task("a short text"), Task("and a third, somewhat longer text than the first")]
    begun = engine.begin(engine._chunks(tasks))
    assert Engine.computed(begun)  # nothing to wait for on a CPU: the process completes it as before
    engine.complete(begun)
    engine.use_buckets("eager", lengths=[4, 8, 12, 16])  # a plain batch of arrays, in a shape bucket
    plain = engine.begin_plain(*_arrays(engine, tasks))
    assert plain is not None and Engine.computed(plain)


def _arrays(engine: Engine, tasks: list[Task]) -> tuple:
    from service.serving.engine.pipe import RunPlain

    encoded = [engine.encode([t.text], [engine.default])[0][engine.max_length(engine.default)] for t in tasks]
    batch = RunPlain.of([(e.chunks[0], None) for e in encoded], [])
    return batch.ids, batch.lengths, batch.head, batch.heads
