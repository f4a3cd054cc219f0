"""The batcher on its own: fake models, no torch, no HTTP."""

import asyncio
import gc
import threading
import time
from collections.abc import Callable

import pytest

from service.serving.engine.batcher import Batcher, BatchLimits, DeadlineExceeded, Draining, Overloaded


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.drops: dict[str, int] = {}
        self.depths: list[int] = []
        self.completed: list[int] = []

    def on_queue_depth(self, depth: int) -> None:
        self.depths.append(depth)

    def on_drop(self, reason: str, payloads) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + len(payloads)

    def on_batch(self, payloads, results, cost, waits, seconds, runner) -> None:
        self.completed.append(sum(r is not None for r in results or []))


def make(run, **limits):
    rec = Recorder()
    defaults = {"max_batch_size": 8, "max_batch_tokens": 1000, "max_wait_s": 0.02, "max_queue": 100}
    defaults.update(limits)

    def recording_run(payloads):
        rec.batches.append(list(payloads))
        return run(payloads)

    return Batcher(recording_run, BatchLimits(**defaults), rec), rec


def fails_on_bad(payloads: list[str]) -> list[str]:
    """A model that fails every batch holding ``"bad"``."""
    if "bad" in payloads:
        raise ValueError("boom")
    return payloads


def later(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


async def until(condition, timeout: float = 5.0) -> None:
    """Yield to the event loop until ``condition()`` holds (what the test waits for, not a guessed delay)."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "the condition never held"
        await asyncio.sleep(0.001)


async def busy(**limits):
    """A started batcher (one text per batch) whose model waits on ``gate``, already computing
    ``["slow"]`` (the ``blocker``); returns ``(batcher, recorder, gate, blocker)``."""
    gate = threading.Event()
    b, rec = make(lambda ps: (gate.wait(5), ps)[1], max_batch_size=1, **limits)
    b.start()
    blocker = asyncio.ensure_future(b.submit(["slow"], [1], later()))
    await until(lambda: rec.batches == [["slow"]])  # the model has it
    return b, rec, gate, blocker


async def test_concurrent_requests_are_batched_and_answered_in_order() -> None:
    b, rec = make(lambda ps: [p.upper() for p in ps])
    b.start()
    outs = await asyncio.gather(*(b.submit([f"a{k}", f"b{k}"], [1, 1], later()) for k in range(4)))
    assert outs == [[f"A{k}", f"B{k}"] for k in range(4)]
    assert max(len(x) for x in rec.batches) == 8  # all four requests in one batch
    await b.stop(1)


async def test_size_and_token_limits_and_similar_lengths_together() -> None:
    b, rec = make(lambda ps: ps, max_batch_size=3, max_batch_tokens=40)
    b.start()
    costs = [10, 10, 10, 10, 30, 2]
    await asyncio.gather(*(b.submit([f"t{k}"], [c], later()) for k, c in enumerate(costs)))
    for batch in rec.batches:
        cs = [costs[int(p[1:])] for p in batch]
        assert len(batch) <= 3 and sum(cs) <= 40  # the tokens themselves: the encoder packs them, no padding
    assert sorted(p for batch in rec.batches for p in batch) == sorted(f"t{k}" for k in range(6))
    await b.stop(1)


async def test_a_queue_that_fits_goes_whole_unless_an_item_is_much_costlier() -> None:
    b, rec, gate, blocker = await busy()  # "slow" computes (one item a batch) while the rest queue
    b.limits = BatchLimits(8, 1000, 0.02, 100)
    fits = asyncio.gather(*(b.submit([f"f{k}"], [c], later()) for k, c in enumerate([10, 12, 20, 40])))
    await until(lambda: b.queue_depth == 4)
    gate.set()
    await blocker
    await fits
    assert [sorted(batch) for batch in rec.batches[1:]] == [["f0", "f1", "f2", "f3"]]
    apart = asyncio.gather(*(b.submit([f"a{k}"], [c], later()) for k, c in enumerate([5, 6, 30])))  # 30 > 4 * 5
    await apart
    assert sorted(map(sorted, rec.batches[2:])) == [["a0", "a1"], ["a2"]]
    await b.stop(1)


async def test_a_batch_takes_whole_requests_in_the_order_they_came() -> None:
    # four requests of three items queued behind a batch, two requests' worth a batch: each batch holds whole
    # requests (by cost alone, the 10s would go together and every request wait for both batches), and the first
    # two are answered while the second batch computes
    gates = [threading.Event() for _ in range(3)]
    calls = iter(gates)
    b, rec = make(lambda ps: (next(calls).wait(5), ps)[1], max_batch_size=1)
    b.start()
    blocker = asyncio.ensure_future(b.submit(["slow"], [1], later()))
    await until(lambda: rec.batches == [["slow"]])
    b.limits = BatchLimits(6, 1000, 0.0, 100)
    costs = {"a": [10, 30, 10], "b": [30, 10, 30], "c": [10, 30, 10], "d": [30, 10, 30]}
    asked = {r: asyncio.ensure_future(b.submit([f"{r}{k}" for k in range(3)], c, later())) for r, c in costs.items()}
    await until(lambda: b.queue_depth == 12)
    gates[0].set()
    await blocker
    await until(lambda: len(rec.batches) == 2)
    gates[1].set()
    await until(lambda: len(rec.batches) == 3)  # the second of them computes, held
    assert [sorted(batch) for batch in rec.batches[1:]] == [["a0", "a1", "a2", "b0", "b1", "b2"],
                                                             ["c0", "c1", "c2", "d0", "d1", "d2"]]
    await until(lambda: asked["a"].done() and asked["b"].done())
    assert not asked["c"].done() and await asked["a"] == ["a0", "a1", "a2"]
    gates[2].set()
    assert await asked["d"] == ["d0", "d1", "d2"]
    await b.stop(1)


async def test_failing_batch_fails_only_its_own_requests() -> None:
    b, _rec = make(fails_on_bad, max_batch_size=1)
    b.start()
    good, bad = await asyncio.gather(b.submit(["ok"], [1], later()), b.submit(["bad"], [1], later()),
                                     return_exceptions=True)
    assert good == ["ok"] and isinstance(bad, ValueError)
    assert await b.submit(["again"], [1], later()) == ["again"]  # the loop survived
    await b.stop(1)


async def test_a_batch_settles_its_requests_as_it_ends() -> None:
    """Each request of a batch is answered by the time the batch's end is observed: its items settle it directly,
    with no turn of the event loop in between (no future an item)."""
    seen: list[list[bool]] = []
    requests: list[asyncio.Future[list[str]]] = []

    class Settled(Recorder):
        def on_batch(self, payloads, results, cost, waits, seconds, runner) -> None:
            seen.append([f.done() for f in requests])

    b = Batcher(lambda ps: [p.upper() for p in ps], BatchLimits(8, 1000, 0.02, 100), Settled())
    b.start()
    requests += [b.enqueue(["a", "b"], [1, 1], later(), list), b.enqueue(["c"], [1], later(), list)]
    assert await asyncio.gather(*requests) == [["A", "B"], ["C"]]
    assert seen == [[True, True]]
    await b.stop(1)


async def test_what_is_queued_of_a_request_another_item_failed_is_dropped() -> None:
    b, rec = make(fails_on_bad, max_batch_size=1)
    b.start()
    with pytest.raises(ValueError, match="boom"):
        await b.submit(["bad", "rest"], [1, 1], later())
    await until(lambda: b.idle)
    assert ["rest"] not in rec.batches and rec.drops == {"disconnected": 1}
    await b.stop(1)


async def test_a_request_whose_cost_is_not_a_number_is_refused_and_leaves_nothing() -> None:
    b, rec = make(lambda ps: ps)
    b.start()
    errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
    with pytest.raises(ValueError):
        b.enqueue(["a", "b"], [1, "many"], time.monotonic() + 0.05, list)  # type: ignore[list-item]
    assert b.queue_depth == 0 and b.queued_groups == 0
    await asyncio.sleep(0.1)  # its deadline passes: no request of it is left to expire, unanswered
    gc.collect()
    assert errors == []
    assert await b.submit(["c"], [1], later()) == ["c"] and rec.batches == [["c"]]
    await b.stop(1)


async def test_overload_rejects_whole_request_without_queueing() -> None:
    b, _rec, gate, first = await busy(max_queue=3)  # "slow" is computing; the queue is empty
    queued = asyncio.ensure_future(b.submit(["a", "b", "c"], [1, 1, 1], later()))
    await until(lambda: b.queue_depth == 3)
    with pytest.raises(Overloaded):
        await b.submit(["d"], [1], later())
    assert b.queue_depth == 3
    gate.set()
    assert await first == ["slow"] and await queued == ["a", "b", "c"]
    await b.stop(1)


async def test_deadline_while_queued_is_answered_and_dropped_before_compute() -> None:
    b, rec, gate, blocker = await busy()
    with pytest.raises(DeadlineExceeded):
        await b.submit(["late"], [1], time.monotonic() + 0.05)
    gate.set()
    await blocker
    await until(lambda: b.idle)
    assert ["late"] not in rec.batches and rec.drops.get("deadline") == 1
    await b.stop(1)


async def test_cancelled_caller_is_dropped_before_compute() -> None:
    b, rec, gate, blocker = await busy()
    gone = asyncio.ensure_future(b.submit(["gone"], [1], later()))
    await until(lambda: b.queue_depth == 1)
    gone.cancel()
    gate.set()
    await blocker
    assert await b.submit(["next"], [1], later()) == ["next"]
    assert ["gone"] not in rec.batches and rec.drops.get("disconnected") == 1
    await b.stop(1)


async def test_stop_answers_queued_work_then_refuses_new() -> None:
    b, _rec = make(lambda ps: (time.sleep(0.05), ps)[1], max_batch_size=2)
    b.start()
    pending = [asyncio.ensure_future(b.submit([f"p{k}"], [1], later())) for k in range(6)]
    await until(lambda: b.queue_depth + sum(map(len, _rec.batches)) == 6)  # every one accepted
    await b.stop(drain_timeout=5)
    assert [await p for p in pending] == [[f"p{k}"] for k in range(6)]
    with pytest.raises(Draining):
        await b.submit(["new"], [1], later())


async def test_event_loop_stays_free_while_a_batch_computes() -> None:
    """The model holds its batch until the event loop has run other work: it computes off the loop."""
    loop_ran = threading.Event()
    b, rec = make(lambda ps: (loop_ran.wait(5), ps)[1])
    b.start()
    work = asyncio.ensure_future(b.submit(["x"], [1], later()))
    await until(lambda: rec.batches == [["x"]])  # the model is computing
    assert not work.done()
    loop_ran.set()  # set by the event loop while the batch computes: it would deadlock if the loop were blocked
    assert await work == ["x"]
    await b.stop(1)


async def test_a_group_arriving_behind_a_long_one_goes_in_the_next_batch() -> None:
    """A long text's 12 chunks (one group) fill three batches; a short text that arrives while the first
    computes is in the second batch, not after the long text, and never rides with its chunks."""
    gates = [threading.Event() for _ in range(8)]
    calls = iter(gates)

    def run(ps):
        next(calls).wait(5)
        return [None if p.startswith("long") and p != "long11" else p for p in ps]

    b, rec = make(run, max_batch_size=8, max_batch_tokens=400, max_wait_s=0.0)
    b.start()
    long = asyncio.ensure_future(b.submit([f"long{k}" for k in range(12)], [100] * 12, later(),
                                          groups=["long"] * 12))
    await until(lambda: len(rec.batches) == 1)  # the first batch (4 chunks) is computing
    short = asyncio.ensure_future(b.submit(["short"], [5], later()))
    await until(lambda: b.queue_depth == 9)  # the long text's other 8 chunks and the short one
    for g in gates:
        g.set()
    assert await short == ["short"]
    assert (await long)[11] == "long11"
    assert [len(x) for x in rec.batches] == [4, 1, 4, 4], rec.batches
    assert rec.batches[1] == ["short"]
    assert rec.completed == [0, 1, 0, 1]  # None answers are parts, not completed work
    await b.stop(1)


async def test_groups_take_turns() -> None:
    """Two long groups queued together alternate batch by batch instead of one finishing first."""
    b, rec = make(lambda ps: ps, max_batch_size=2, max_batch_tokens=1000, max_wait_s=0.05)
    b.start()
    await asyncio.gather(b.submit([f"a{k}" for k in range(4)], [10] * 4, later(), groups=["a"] * 4),
                         b.submit([f"b{k}" for k in range(4)], [10] * 4, later(), groups=["b"] * 4))
    firsts = [batch[0][0] for batch in rec.batches]
    assert len(rec.batches) == 4 and firsts == ["a", "b", "a", "b"]
    await b.stop(1)


async def test_the_queue_limit_counts_groups_not_items() -> None:
    """A long text's many chunks take one place in the queue, as a text does."""
    b, _rec, gate, blocker = await busy(max_queue=2)
    long = asyncio.ensure_future(b.submit(["c0", "c1", "c2"], [1, 1, 1], later(), groups=["t"] * 3))
    short = asyncio.ensure_future(b.submit(["s"], [1], later()))
    await until(lambda: b.queue_depth == 4)
    assert b.queued_groups == 2
    with pytest.raises(Overloaded):
        await b.submit(["one more"], [1], later())
    gate.set()
    assert await long == ["c0", "c1", "c2"] and await short == ["s"] and await blocker == ["slow"]
    assert b.queued_groups == 0
    await b.stop(1)


async def test_an_item_of_several_parts_counts_each_towards_the_batch_size_and_the_queue() -> None:
    """An item of ``size`` parts (a run of several plain texts) fills a batch's ``max_batch_size`` and the queue's
    limit as that many items would; its ``peak`` (its costliest part), not its cost in all, is what ``SIMILAR``
    compares, so that a run of short texts rides with single short texts."""
    b, rec, gate, blocker = await busy(max_queue=9)
    b.limits = BatchLimits(6, 1000, 0.02, 9)
    runs = [asyncio.ensure_future(b.submit([f"r{k}"], [4 * 10], later(), sizes=[4], peaks=[10])) for k in range(2)]
    single = asyncio.ensure_future(b.submit(["s"], [10], later()))
    await until(lambda: b.queue_depth == 9)
    assert b.queued_groups == 9
    with pytest.raises(Overloaded):  # 9 texts queued in 3 items: the limit of 9 is reached
        await b.submit(["one more"], [1], later())
    gate.set()
    assert await blocker == ["slow"] and [await r for r in runs] == [["r0"], ["r1"]] and await single == ["s"]
    assert sorted(map(sorted, rec.batches[1:])) == [["r0", "s"], ["r1"]]  # 4 + 1 parts, then 4: at most 6 a batch
    assert b.queued_groups == 0 and b.queue_depth == 0
    mixed = asyncio.gather(b.submit(["run"], [3 * 10], later(), sizes=[3], peaks=[10]), b.submit(["x"], [8], later()))
    assert await mixed == [["run"], ["x"]]
    assert sorted(rec.batches[-1]) == ["run", "x"]  # 30 in all is more than 4x 8, but its longest part is not
    await b.stop(1)


def runners(n: int, gate: threading.Event | None = None, delay: float = 0.0):
    """``n`` runners that record ``(runner, payloads)`` and hold each batch until ``gate`` is set (or for
    ``delay`` seconds)."""
    log: list[tuple[int, list[str]]] = []
    started = [threading.Event() for _ in range(n)]

    def runner(r: int):
        def run(ps):
            log.append((r, list(ps)))
            started[r].set()
            if gate is not None:
                gate.wait(5)
            time.sleep(delay)
            return [f"{p}@{r}" for p in ps]
        return run

    return [runner(r) for r in range(n)], log, started


async def test_two_runners_compute_two_batches_at_once() -> None:
    gate = threading.Event()
    fns, log, started = runners(2, gate)
    b = Batcher(fns, BatchLimits(max_batch_size=1, max_batch_tokens=1000, max_wait_s=0.0, max_queue=100))
    b.start()
    first = asyncio.ensure_future(b.submit(["a"], [1], later()))
    second = asyncio.ensure_future(b.submit(["b"], [1], later()))
    third = asyncio.ensure_future(b.submit(["c"], [1], later()))
    for s in started:  # both runners hold a batch while neither has finished
        assert await asyncio.to_thread(s.wait, 5)
    assert len(log) == 2 and b.queue_depth == 1
    gate.set()
    outs = [(await first)[0], (await second)[0], (await third)[0]]
    assert [o.split("@")[0] for o in outs] == ["a", "b", "c"]
    assert {o.split("@")[1] for o in outs[:2]} == {"0", "1"}
    assert b.idle
    await b.stop(1)


async def test_a_group_stays_on_the_runner_that_took_its_first_items() -> None:
    """A long group's items over several batches all go to one runner (it may hold their state); the
    other runner takes the other requests meanwhile."""
    fns, log, _ = runners(2, delay=0.02)
    b = Batcher(fns, BatchLimits(max_batch_size=2, max_batch_tokens=1000, max_wait_s=0.0, max_queue=100))
    b.start()
    long = asyncio.ensure_future(b.submit([f"long{k}" for k in range(8)], [10] * 8, later(), groups=["t"] * 8))
    shorts = [asyncio.ensure_future(b.submit([f"s{k}"], [10], later())) for k in range(6)]
    out = await long
    assert len({o.split("@")[1] for o in out}) == 1, log
    outs = await asyncio.gather(*shorts)
    assert [o[0].split("@")[0] for o in outs] == [f"s{k}" for k in range(6)]
    assert {r for r, _ in log} == {0, 1}  # both runners worked
    assert sum(1 for _, ps in log if any(p.startswith("long") for p in ps)) >= 4
    await b.stop(1)


async def test_coroutine_runners_are_awaited_on_the_loop() -> None:
    """A runner that is a coroutine function (a model in another process, whose pipe the loop reads) is awaited on
    the event loop's own thread, no worker thread a batch; two such runners hold a batch each at once, and one that
    raises fails only its own batch's requests."""
    loop_thread, threads = threading.get_ident(), []
    release = asyncio.Event()
    holding: list[list[str]] = []

    async def run(payloads: list[str]) -> list[str]:
        threads.append(threading.get_ident())
        holding.append(payloads)
        await release.wait()
        return fails_on_bad(payloads)

    b = Batcher([run, run], BatchLimits(max_batch_size=1, max_batch_tokens=1000, max_wait_s=0.0, max_queue=100))
    b.start()
    work = [asyncio.ensure_future(b.submit([p], [1], later())) for p in ("a", "bad")]
    await until(lambda: len(holding) == 2)  # both runners hold a batch
    release.set()
    got = await asyncio.gather(*work, return_exceptions=True)
    assert got[0] == ["a"] and isinstance(got[1], ValueError)
    assert await b.submit(["c"], [1], later()) == ["c"]
    assert threads == [loop_thread] * 3
    await b.stop(1)


async def test_a_freed_runner_takes_the_next_batch_before_the_last_ones_requests_are_answered() -> None:
    """A batch's end frees its runner first: the next batch goes to the model (the runner called: a model in another
    process computing it) before the ended batch's requests are answered, so that answering them overlaps the model's
    next batch instead of delaying it; every request is answered all the same, in full."""
    events: list[tuple[str, str]] = []
    release = asyncio.Event()

    async def run(payloads: list[str]) -> list[str]:
        events.append(("run", payloads[0]))
        if payloads == ["a"]:
            await release.wait()
        return payloads

    def answered(results: list[str]) -> list[str]:
        events.append(("answered", results[0]))
        return results

    b = Batcher(run, BatchLimits(max_batch_size=1, max_batch_tokens=1000, max_wait_s=0.0, max_queue=100))
    b.start()
    first = b.enqueue(["a"], [1], later(), answered)
    await until(lambda: events == [("run", "a")])
    second = b.enqueue(["b"], [1], later(), answered)
    release.set()
    assert await first == ["a"] and await second == ["b"]
    assert events[:2] == [("run", "a"), ("run", "b")]  # b sent before a's request was answered
    assert sorted(events[2:]) == [("answered", "a"), ("answered", "b")]
    await b.stop(1)
    assert b.idle


async def test_stop_answers_a_batch_an_awaited_runner_holds() -> None:
    """A batch that a coroutine runner holds past the drain is answered ``Draining`` and the runner cancelled."""
    cancelled = asyncio.Event()

    async def run(payloads: list[str]) -> list[str]:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return payloads

    b = Batcher(run, BatchLimits(max_batch_size=1, max_batch_tokens=1000, max_wait_s=0.0, max_queue=100))
    b.start()
    work = asyncio.ensure_future(b.submit(["a"], [1], later()))
    await until(lambda: not b.idle and b.queue_depth == 0)  # computing
    await b.stop(0.05)
    with pytest.raises(Draining):
        await work
    assert cancelled.is_set()


async def test_stop_answers_what_every_runner_holds() -> None:
    gate = threading.Event()
    fns, _, started = runners(2, gate)
    b = Batcher(fns, BatchLimits(max_batch_size=1, max_batch_tokens=1000, max_wait_s=0.0, max_queue=100))
    b.start()
    work = [asyncio.ensure_future(b.submit([p], [1], later())) for p in "abc"]
    for s in started:
        assert await asyncio.to_thread(s.wait, 5)
    await b.stop(0.05)
    for w in work:
        with pytest.raises(Draining):
            await w
    gate.set()
    with pytest.raises(Draining):
        await b.submit(["d"], [1], later())


async def closed_loop_batches(clients: int, compute_s: float, think: Callable[[int], float], rounds: int,
                              **limits) -> list[int]:
    """Batch sizes when ``clients`` each send one item, wait for its answer, pause (client ``c``: ``think(c)``
    seconds, the time its answer and next request take on their way), and send the next, ``rounds`` times."""
    b, rec = make(lambda ps: (time.sleep(compute_s), ps)[1], **limits)
    b.start()

    async def client(c: int) -> None:
        for k in range(rounds):
            assert await b.submit([f"{c}.{k}"], [1], later()) == [f"{c}.{k}"]
            await asyncio.sleep(think(c))

    await asyncio.gather(*(client(c) for c in range(clients)))
    await b.stop(1)
    return [len(batch) for batch in rec.batches]


async def test_a_free_runner_waits_for_the_clients_its_last_batch_answered() -> None:
    # 8 clients whose next requests come back 0-21 ms after their answers, 3 ms apart: a batch that went once
    # its oldest item had waited 20 ms would hold those back by then, and the last would arrive while it
    # computes and go in the next one at once (7, 1, 7, 1, ...); waiting while they keep coming, all 8 go together
    sizes = await closed_loop_batches(8, compute_s=0.4, think=lambda c: c * 0.003, rounds=6, max_wait_s=0.02)
    assert sizes == [8] * 6, sizes


async def test_items_queued_during_a_batch_wait_for_the_clients_it_answered() -> None:
    # 8 clients whose next requests come back 25-32 ms after their answers (the front writes the answers first),
    # later than max_wait (15 ms); client 7 takes 300 ms, so it is queued while the next batch computes. The free
    # runner waits for the first returning client (at most the fill's cap, 50 ms) and client 7 goes with them,
    # not alone 15 ms after the runner became free with the others in a batch after it (8, 7, 1, 7, 1, 7, ...)
    sizes = await closed_loop_batches(8, compute_s=0.5, think=lambda c: 0.3 if c == 7 else 0.025 + c * 0.001,
                                      rounds=4, max_wait_s=0.015)
    assert sizes[:4] == [8, 7, 8, 7], sizes  # then client 7's last two rounds, alone


async def test_a_batch_as_large_as_the_last_ones_goes_without_waiting() -> None:
    # max_wait is 1 s: each batch of the 4 returning clients goes as soon as the 4th is back (with the wait,
    # 6 rounds would take 6 s)
    t0 = time.monotonic()
    sizes = await closed_loop_batches(4, compute_s=0.01, think=lambda c: c * 0.0005, rounds=6, max_wait_s=1.0)
    assert sizes[1:] == [4] * (len(sizes) - 1), sizes
    assert time.monotonic() - t0 < 2.5  # the first batch waits out the 1 s (nothing known yet), no other


async def test_one_client_at_a_time_is_not_kept_waiting() -> None:
    b, rec = make(lambda ps: ps, max_wait_s=1.0)
    b.start()
    assert await b.submit(["a"], [1], later()) == ["a"]  # the first batch waits (nothing known yet)
    t0 = time.monotonic()
    assert await b.submit(["b"], [1], later()) == ["b"]
    assert time.monotonic() - t0 < 0.5  # batches of one: the next one goes at once, not after max_wait
    await b.stop(1)
    assert rec.batches == [["a"], ["b"]]


def timed_run(seconds: float) -> tuple[Callable[[list], list], list[float], list[float]]:
    """A runner that computes each batch for ``seconds``, and the times each batch started and ended."""
    starts: list[float] = []
    ends: list[float] = []

    def run(payloads: list) -> list:
        starts.append(time.monotonic())
        time.sleep(seconds)
        ends.append(time.monotonic())
        return payloads

    return run, starts, ends


async def test_arrivals_that_do_not_follow_answers_are_not_kept_waiting() -> None:
    # one item arrives in the middle of each batch's compute and none right after it ends (independent
    # arrivals, not clients answered): the next batch goes as soon as the runner is free, without waiting
    # for followers that do not come
    run, starts, ends = timed_run(0.2)
    b, _ = make(run, max_wait_s=0.05)
    b.start()
    pending = [asyncio.ensure_future(b.submit(["0"], [1], later()))]
    for k in range(1, 6):
        await until(lambda k=k: len(starts) == k)
        await asyncio.sleep(0.1)  # mid-compute
        pending.append(asyncio.ensure_future(b.submit([str(k)], [1], later())))
    await asyncio.gather(*pending)
    await b.stop(1)
    gaps = [nxt - end for end, nxt in zip(ends, starts[1:], strict=False)]  # from each batch's real end
    assert len(gaps) == 5 and all(g < 0.04 for g in gaps), gaps  # not max_wait (0.05 s) after each


async def test_steady_arrivals_that_also_follow_batch_ends_are_not_kept_waiting() -> None:
    # a request every 20 ms, each batch 0.1 s: one arrives within the fill's cap (50 ms) after every batch's
    # end, but no faster than while it computed, so they do not follow answers: each batch goes when the runner
    # is free (waiting while they keep coming 20 ms apart would idle it up to 50 ms per batch)
    run, starts, ends = timed_run(0.1)
    b, _ = make(run, max_wait_s=0.05)
    b.start()
    pending = []
    for k in range(60):
        pending.append(asyncio.ensure_future(b.submit([str(k)], [1], later())))
        await asyncio.sleep(0.02)
    await asyncio.gather(*pending)
    await b.stop(1)
    gaps = sorted(nxt - end for end, nxt in list(zip(ends, starts[1:], strict=False))[3:])  # from each real end
    # a batcher that waited for them held every batch 23-26 ms; a machine that stalls the loop once may delay one
    assert len(gaps) >= 6 and gaps[len(gaps) // 2] < 0.01 and gaps[-2] < 0.03, gaps


async def test_clients_split_over_two_batches_come_together_again() -> None:
    # 8 clients that come back 2-6 ms after their answers; 4 of them start while the first batch computes, so the
    # first two batches hold 4 each. A free runner then waits for every client it answered and every one that was
    # waiting (clients left out of one batch would otherwise keep two batches going that fix each other's sizes:
    # 4, 4, 5, 6, 6, 6, ... as the largest recent batch was what a batch waited for)
    b, rec = make(lambda ps: (time.sleep(0.2), ps)[1], max_wait_s=0.02)
    b.start()

    async def client(c: int) -> None:
        await asyncio.sleep(0.1 if c >= 4 else 0.0)
        for k in range(12):
            assert await b.submit([f"{c}.{k}"], [1], later()) == [f"{c}.{k}"]
            await asyncio.sleep(0.002 + c * 0.0005)

    await asyncio.gather(*(client(c) for c in range(8)))
    await b.stop(1)
    sizes = [len(batch) for batch in rec.batches]
    assert sizes == [4, 4] + [8] * 11, sizes


async def test_arrivals_right_after_a_batch_follow_it_while_the_next_one_computes() -> None:
    # batch A (one item) ends; four items arrive within its fill's cap: two fill batch B (max_batch_size 2) at once,
    # the other two arrive while B computes. They follow A's answers, and are not arrivals during B's compute (which
    # would make B's clients look like independent arrivals, and the batch after B stop waiting for them)
    run, starts, _ = timed_run(0.1)
    b, _ = make(run, max_wait_s=0.05, max_batch_size=2)
    b.start()
    assert await b.submit(["a"], [1], later()) == ["a"]
    pending = [asyncio.ensure_future(b.submit([x], [1], later())) for x in "bc"]
    await until(lambda: len(starts) == 2)
    pending += [asyncio.ensure_future(b.submit([x], [1], later())) for x in "de"]
    await asyncio.gather(*pending)
    await b.stop(1)
    first, second = list(b._paces)[:2]  # A's and B's
    assert (first.after, second.during) == (4, 0), (first, second)
