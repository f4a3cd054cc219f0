"""One engine in a process of its own, driven over stdin/stdout by ``routing-service bench gpu``.

The same source runs against this tree's engine and against an older version's (``bench gpu --baseline``), so
that the two are measured alike, in turns, each computing on its process's main thread as the server's model
process does. It therefore imports nothing of this package beyond the engine API every version since the shared
backbone has (``Engine.load``, ``Engine.encode``, ``Engine.max_length``, ``Engine.run``, ``Task``), from where
each version keeps them, and is passed to ``python -c`` as text, so that the other version's ``service`` package is
the one imported.

Protocol: the first line of stdin is the settings (JSON: repository, model, device, dtype, texts_file; optionally
engine, its settings, max_texts and budget, the shape buckets' limits); each
further line a command (``{"op": ...}``); every answer is one line of stdout starting with ``@@ `` (JSON).
Texts are tokenized once at load: the engine is measured on token ids, tokenizing being the fronts' work.
"""

import json
import statistics
import sys
import time
from pathlib import Path


def answer(obj: object) -> None:
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def outermost(event: object) -> bool:
    """Whether a profiled operator was called by the engine, not inside another operator (``bench engine`` counts
    them with this too)."""
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = getattr(parent, "cpu_parent", None)
    return True


def bucket_stats(stats: object) -> dict | None:
    """What an engine's shape buckets did (see ``BucketStats``), and the padded share of the tokens they computed."""
    if stats is None:
        return None
    out = dict(vars(stats))
    out["padded_share"] = 1 - stats.real_tokens / stats.tokens if stats.tokens else None
    return out


def stand_in(engine: object, buckets: str) -> None:
    """Every bucket's computation (the encoder and the heads on the device) replaced by one that answers zeros at
    once, so that a plain batch costs only the host's own work: planning, packing, launching, reading the results
    (``bench host-work``). Only batches in shape buckets compute nothing (``buckets``: ``eager`` on a CPU)."""
    if buckets == "off":
        raise SystemExit("a stand-in device needs shape buckets (only their batches skip the compute)")
    try:
        from service.serving.engine.graphs import BucketRunner
    except ImportError:
        raise SystemExit("this engine has no shape buckets") from None
    import torch

    k = len(engine.labels(engine.models[0]))

    def instant(self: object, bucket: object, *which: object) -> object:  # (which of a bucket's computations)
        out = torch.zeros(bucket.rows, k)  # [rows k]
        return lambda inputs: out

    BucketRunner._compute = instant


def divergence(engine: object, encodings: list, batches: list[list[int]], picked: list[int], run: object) -> dict:
    """For each text of ``picked``: the largest difference of its hidden states at each depth (the embeddings'
    output first), computed alone and within its batch of ``batches``, on the backbone's own path (no shape buckets:
    the eager encoder), absolute and over the largest state of that depth; and its probabilities' largest change,
    the heads run as the engine runs them (``run``: a batch of text indices to results; buckets included); and the
    packed head's, on the text's states computed alone, alone against among the batch's others (the head's own
    share). What a batch changes in a text, depth by depth."""
    import torch

    from service.modeling.classifier import scoring

    backbone = engine.backbone
    model = engine.models[0]
    labels = engine.labels(model)
    head = engine.classifiers[model].head
    of = {k: b for b in batches for k in b}

    def head_probs(states: list, at: int) -> list | None:
        """The packed head's probabilities for sequence ``at`` among ``states`` (each ``[n e d]``), its products as
        the engine's (None where the packed head does not run here)."""
        hidden = torch.cat(states).to(next(head.parameters()).dtype)  # [T e d]
        n_t = torch.tensor([len(x) for x in states], device=hidden.device)  # [b]
        try:
            with scoring(hidden.device, engine.score_dtype):
                return head.scores_packed(hidden, n_t, None, engine.head_products)[at].float().softmax(-1).tolist()
        except RuntimeError:
            return None

    out = []
    for k in picked:
        ids = list(encodings[k].chunks[0])
        batch = of[k]
        at = batch.index(k)
        with torch.inference_mode():
            alone = backbone.run_chunks([ids])[0]  # [n e d]
            together = backbone.run_chunks([list(encodings[j].chunks[0]) for j in batch])  # per text [n e d]
            # the head alone against among the batch's others on the same states (the text's computed alone): what
            # the head's own products change with the batch
            head_alone = head_probs([alone], 0)
            head_mixed = head_probs([alone if j == at else x for j, x in enumerate(together)], at)
        mixed = together[at]
        diff = (alone.float() - mixed.float()).abs().amax(dim=(0, 2))  # [e]
        scale = alone.float().abs().amax(dim=(0, 2))  # [e]
        p_alone, p_mixed = run([k])[0].scores, run(batch)[at].scores
        out.append({"text": k, "tokens": len(ids), "batch_texts": len(batch), "batch_tokens": sum(
            len(encodings[j].chunks[0]) for j in batch), "largest_state_change_by_depth": diff.tolist(),
            "relative_state_change_by_depth": (diff / scale).tolist(),
            "largest_probability_change": max(abs(p_alone[n] - p_mixed[n]) for n in labels),
            "head_probability_change_same_states": None if head_alone is None or head_mixed is None else max(
                abs(a - b) for a, b in zip(head_alone, head_mixed, strict=True))})
    return {"texts": out}


def main() -> None:
    # imported before the settings are read: a process started ahead of its turn has them ready
    import torch

    try:  # the package in layers (2026-11-28 on)
        from service.serving.core.work import Task
        from service.serving.engine.engine import Engine
    except ImportError:  # an earlier version's flat package
        from service.serving.engine import Engine, Task  # type: ignore[no-redef]

    cfg = json.loads(sys.stdin.readline())
    t0 = time.perf_counter()
    engine = Engine.load(Path(cfg["repository"]) / cfg["model"], device=cfg["device"], dtype=cfg["dtype"])
    model = engine.models[0]
    settings = dict(cfg.get("engine", {}))
    buckets = settings.pop("buckets", "off")  # shape buckets: a call, after the other settings (see below)
    if settings.pop("stand_in", False):  # the device's answer at once: what is left is the host's own work
        stand_in(engine, buckets)
    for name, value in settings.items():  # a variant of this version's settings
        if not hasattr(engine, name):
            raise SystemExit(f"this engine has no setting {name!r}")
        setattr(engine, name, value)
    texts = json.loads(Path(cfg["texts_file"]).read_text())
    encodings = [e[engine.max_length(model)] for e in engine.encode(texts, [model] * len(texts))]
    tokens = [e.n_tokens for e in encodings]
    warmed = None
    if buckets != "off":  # chosen for these texts' lengths, warmed (captured) before the load is done
        if not hasattr(engine, "use_buckets"):
            raise SystemExit("this engine has no shape buckets")
        warmed = bucket_stats(engine.use_buckets(buckets, lengths=[max(len(c) for c in e.chunks) for e in encodings],
                                                 max_texts=cfg.get("max_texts", 1024),
                                                 **({"budget": cfg["budget"]} if "budget" in cfg else {})))
    import gc

    gc.collect()  # what was loaded kept out of collections, as every serving process keeps it (service.collector,
    gc.freeze()  # 2026-11-29 on); an older version's engine is measured alike
    collecting = {"s": 0.0, "runs": 0, "since": 0.0}  # the time the process spent in garbage collections

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            collecting["since"] = time.perf_counter()
        else:
            collecting["s"] += time.perf_counter() - collecting["since"]
            collecting["runs"] += info.get("generation", 0) == 2

    gc.callbacks.append(on_collection)
    cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    labels = engine.labels(model)
    answer({"load_s": time.perf_counter() - t0, "device": str(engine.device), "dtype": str(engine.dtype),
            "labels": labels, "tokens": sum(tokens), "buckets": warmed})

    def batches(budget: int, max_texts: int) -> list[list[int]]:
        """The texts in their sampled order, cut into batches of at most ``budget`` tokens and ``max_texts`` texts
        (a text longer than the budget alone)."""
        out: list[list[int]] = []
        current: list[int] = []
        total = 0
        for k, n in enumerate(tokens):
            if current and (total + n > budget or len(current) >= max_texts):
                out.append(current)
                current, total = [], 0
            current.append(k)
            total += n
        return [*out, current] if current else out

    def run(batch: list[int]) -> list:
        return engine.run([Task(texts[k], encodings[k], model) for k in batch])

    def one_pass(bs: list[list[int]], pipelined: bool) -> None:
        """Every batch of ``bs`` once (``pipelined``: two batches in flight)."""
        if pipelined:
            for _ in engine.run_pipelined([Task(texts[k], encodings[k], model) for k in b] for b in bs):
                pass
        else:
            for b in bs:
                run(b)

    def passes(bs: list[list[int]], seconds: float, pipelined: bool) -> tuple[int, float]:
        """Whole passes over ``bs`` for at least ``seconds`` (``pipelined``: two batches in flight): passes, wall."""
        n, start = 0, time.perf_counter()
        while True:
            one_pass(bs, pipelined)
            n += 1
            if time.perf_counter() - start >= seconds:
                break
        sync()
        return n, time.perf_counter() - start

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "throughput":  # whole passes of every batch, at least `seconds`
            bs = batches(cmd["budget"], cmd["max_texts"])
            for b in bs:  # a whole pass first: every shape's kernels chosen, the device's clocks up
                run(b)
            sync()
            clock = getattr(engine, "clock", None)
            host0 = clock.host_s if clock is not None else None
            gc0, full0 = collecting["s"], collecting["runs"]
            n, wall = passes(bs, cmd["seconds"], False)
            out = {"texts_per_s": n * len(texts) / wall, "ms_per_batch": 1000 * wall / (n * len(bs)),
                   "texts_per_batch": len(texts) / len(bs), "tokens_per_batch": sum(tokens) / len(bs),
                   "collecting_ms_per_batch": 1000 * (collecting["s"] - gc0) / (n * len(bs)),
                   "full_collections": collecting["runs"] - full0}
            if host0 is not None:
                out["host_us_per_text"] = 1e6 * (clock.host_s - host0) / (n * len(texts))
            if getattr(engine, "bucket_stats", None) is not None:
                out["buckets"] = bucket_stats(engine.bucket_stats)
            if hasattr(engine, "run_pipelined"):  # this version can keep two batches in flight
                n, wall = passes(bs, cmd["seconds"], True)
                out["texts_per_s_pipelined"] = n * len(texts) / wall
            answer(out)
        elif op == "latency":  # one text a batch, as a lone request is served
            lat = []
            for k in range(min(cmd["n"], len(texts))):
                t = time.perf_counter()
                run([k])
                lat.append(1000 * (time.perf_counter() - t))
            lat = lat[5:] or lat  # the first few warm the allocator and the kernels' choices
            answer({"p50_ms": statistics.median(lat), "p90_ms": statistics.quantiles(lat, n=10)[-1],
                    "p99_ms": statistics.quantiles(lat, n=100)[-1], "n": len(lat)})
        elif op == "predict":  # every text's probabilities, in batches of the budget or alone
            bs = [[k] for k in range(len(texts))] if cmd["alone"] else batches(cmd["budget"], cmd["max_texts"])
            probs: list[list[float] | None] = [None] * len(texts)
            for b in bs:
                for k, r in zip(b, run(b), strict=True):
                    probs[k] = [r.scores[label] for label in labels]
            out = {"probs": probs}
            if getattr(engine, "bucket_stats", None) is not None:  # what ran in the buckets so far
                out["buckets"] = bucket_stats(engine.bucket_stats)
            answer(out)
        elif op == "divergence":  # where a text's hidden states part, alone against in its mixed batch
            answer(divergence(engine, encodings, batches(cmd["budget"], cmd["max_texts"]), cmd["texts"], run))
        elif op == "profile":  # kernels and device time per batch, from a torch profile of a few batches
            from torch.autograd import DeviceType
            from torch.profiler import ProfilerActivity, profile

            bs = batches(cmd["budget"], cmd["max_texts"])[: cmd["batches"]]
            pipelined = cmd.get("pipelined", False)  # two batches in flight, as the server's process runs them
            run(bs[0])
            sync()
            activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
            t, gc0 = time.perf_counter(), collecting["s"]
            with profile(activities=activities) as prof:
                one_pass(bs, pipelined)
                sync()
            wall = time.perf_counter() - t
            events = prof.events()
            # the engine's ranges appear on the device too (each spanning its kernels): they are no kernels
            ranges = [e for e in events if e.device_type == DeviceType.CUDA and e.name.startswith("engine.")]
            device = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith("engine.")]
            kernels = [e for e in device if not e.name.startswith(("Memcpy", "Memset"))]
            ops = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")
                   and outermost(e)]
            by_name: dict[str, float] = {}
            for e in kernels:
                by_name[e.name[:80]] = by_name.get(e.name[:80], 0.0) + e.time_range.elapsed_us() / len(bs)
            phases: dict[str, float] = {}  # each range's kernels: those that ran within it on the device
            for r in ranges:
                inside = sum(k.time_range.elapsed_us() for k in kernels
                             if r.time_range.start <= k.time_range.start and k.time_range.end <= r.time_range.end)
                phases[r.name] = phases.get(r.name, 0.0) + inside / 1000 / len(bs)
            host: dict[str, float] = {}  # the process's own time by what it was in (operators, CUDA calls)
            for e in events:
                if e.device_type == DeviceType.CPU:
                    host[e.name[:80]] = host.get(e.name[:80], 0.0) + e.self_cpu_time_total / len(bs)
            answer({"batches": len(bs), "pipelined": pipelined, "kernels_per_batch": len(kernels) / len(bs),
                    "wall_ms_per_batch_profiled": 1000 * wall / len(bs),
                    "collecting_ms_per_batch": 1000 * (collecting["s"] - gc0) / len(bs),
                    "top_host_us_per_batch": dict(sorted(host.items(), key=lambda kv: -kv[1])[:25]),
                    "top_kernels_us_per_batch": dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:20]),
                    "phase_device_ms_per_batch": phases,
                    "copies_per_batch": (len(device) - len(kernels)) / len(bs),
                    "device_busy_ms_per_batch": sum(e.time_range.elapsed_us() for e in device) / 1000 / len(bs),
                    "torch_ops_per_batch": len(ops) / len(bs),
                    "texts_per_batch": sum(map(len, bs)) / len(bs)})
        else:
            answer({"error": f"unknown op {op!r}"})


if __name__ == "__main__":
    main()
