"""`routing-service bench routing`: time and peak memory of one EfficientVectorRouting forward pass
(paper §5.1, Figure 6) as each of n_inp, n_out, d_inp, d_out grows from the paper's baseline,
with memory-efficient (lazy) vs. eager (materialised) votes, with and without gradients.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated``; on CPU, the growth of the process's
peak resident set (VmHWM, reset through /proc/self/clear_refs before each run) measured in a
worker process whose allocator returns large blocks to the OS at once, so freed memory is not
reused silently.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BASELINE = {"n_inp": 100, "n_out": 100, "d_inp": 1024, "d_out": 1024}
HEADLINE = {"n_inp": 1_000_000, "n_out": 100, "d_inp": 1024, "d_out": 1024}
"""The reference library's headline for long sequences: 1,000,000 vectors of 1,024 features routed to 100 of 1,024 in
float32, gradients tracked, in "under ~18GB" of GPU memory (the routing's parameters, the input and the forward pass;
PyTorch's and CUDA's own ~1 GB apart)."""
HEADLINE_STATED_GB = 18.0


def configs(factors: list[int]) -> list[dict[str, Any]]:
    """The baseline, then each dimension grown by each factor while the others stay at baseline."""
    out = [dict(BASELINE, grown="baseline", factor=1)]
    for dim in BASELINE:
        for f in factors:
            if f > 1:
                out.append(dict(BASELINE, **{dim: BASELINE[dim] * f}, grown=dim, factor=f))
    return out


def _read_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMemory:
    """Peak memory from its making on: on CUDA the device's allocations (``torch.cuda.max_memory_allocated``), on a
    CPU the process's resident set (its high-water mark reset through /proc/self/clear_refs), in bytes."""

    def __init__(self, cuda: bool) -> None:
        import torch

        self.cuda = cuda
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set size
            self.base = _read_status_kib("VmRSS") * 1024

    def since(self) -> int:
        """The peak since then, over what was held then."""
        import torch

        if self.cuda:
            return torch.cuda.max_memory_allocated() - self.base
        return _read_status_kib("VmHWM") * 1024 - self.base


def measure_one(cfg: dict[str, Any], memory_efficient: bool, grad: bool, device: str, repeats: int) -> dict[str, Any]:
    """Time (median of ``repeats``) and peak memory of one forward (+ backward when ``grad``)."""
    import torch

    from service.routing import EfficientVectorRouting

    torch.manual_seed(0)
    dev = torch.device(device)
    m = EfficientVectorRouting(cfg["n_inp"], cfg["n_out"], cfg["d_inp"], cfg["d_out"],
                               memory_efficient=memory_efficient).to(dev)
    x = torch.randn(cfg["n_inp"], cfg["d_inp"], device=dev, requires_grad=grad)

    def step() -> None:
        if grad:
            m(x).sum().backward()
        else:
            with torch.no_grad():
                m(x)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up
    if dev.type != "cuda":
        m.zero_grad(set_to_none=True)
        x.grad = None
    meter = PeakMemory(dev.type == "cuda")
    step()
    peak = meter.since()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    return {**cfg, "votes": "lazy" if memory_efficient else "eager", "grad": grad,
            "time_ms": 1000 * times[len(times) // 2], "peak_mib": peak / 2**20}


def headline(device: str, n_inp: int = HEADLINE["n_inp"]) -> dict[str, Any]:
    """The :data:`HEADLINE` routing (``n_inp`` inputs: fewer for a smoke test) built on ``device`` and run forward with
    gradients tracked, then backward: seconds and peak memory of each, counted from before the routing was built
    (its parameters and the input included, as the reference counts them)."""
    import torch

    from service.routing import EfficientVectorRouting

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    meter = PeakMemory(cuda)
    torch.manual_seed(0)
    with dev:
        model = EfficientVectorRouting(n_inp, HEADLINE["n_out"], HEADLINE["d_inp"], HEADLINE["d_out"])
        x = torch.randn(n_inp, HEADLINE["d_inp"], requires_grad=True)  # [i d]
    sync()
    built = meter.since()
    t0 = time.perf_counter()
    out = model(x)  # [j h]
    sync()
    forward_s, forward_peak = time.perf_counter() - t0, meter.since()
    t0 = time.perf_counter()
    out.square().sum().backward()
    sync()
    return {**HEADLINE, "n_inp": n_inp, "device": str(dev), "dtype": "float32",
            "built_gib": built / 2**30, "forward_s": forward_s, "forward_peak_gib": forward_peak / 2**30,
            "backward_s": time.perf_counter() - t0, "backward_peak_gib": meter.since() / 2**30,
            "stated_gb": HEADLINE_STATED_GB if n_inp == HEADLINE["n_inp"] else None,
            "finite": bool(torch.isfinite(out).all() and torch.isfinite(x.grad).all())}


def worker(spec_json: str) -> None:
    """Entry point of the measuring process: one JSON line per result on stdout."""
    spec = json.loads(spec_json)
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    if spec.get("headline"):
        print(json.dumps(headline(spec["device"], spec["headline"])), flush=True)
        return
    for cfg in configs(spec["factors"]):
        for grad in (False, True):
            for eff in (True, False):
                r = measure_one(cfg, eff, grad, spec["device"], spec["repeats"])
                print(json.dumps(r), flush=True)


def run(device: str, factors: list[int], repeats: int, threads: int | None, progress: bool = True,
        headline_inputs: int = 0) -> list[dict]:
    """Run the worker in a fresh process and collect its results (``headline_inputs``: only :func:`headline`, with
    that many inputs)."""
    spec = json.dumps({"device": device, "factors": factors, "repeats": repeats, "threads": threads,
                       "headline": headline_inputs})
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, "-c", f"from service.bench.routing import worker; worker({spec!r})"]
    results = []
    total = len(configs(factors)) * 4
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            results.append(json.loads(line))
            if progress and not headline_inputs:
                r = results[-1]
                print(f"  [{len(results)}/{total}] {r['grown']} x{r['factor']} {r['votes']} grad={r['grad']}: "
                      f"{r['time_ms']:.1f} ms, {r['peak_mib']:.1f} MiB", file=sys.stderr, flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed with exit code {proc.returncode}")
    return results


def growth_exponents(results: list[dict], factors: list[int]) -> list[dict[str, Any]]:
    """Log-log slope of time and memory against each dimension (1.0 = linear)."""
    out = []
    top = max(factors)
    for grad in (False, True):
        for votes in ("lazy", "eager"):
            base = next(r for r in results if r["grown"] == "baseline" and r["votes"] == votes and r["grad"] == grad)
            for dim in BASELINE:
                r = next(r for r in results if r["grown"] == dim and r["factor"] == top and r["votes"] == votes
                         and r["grad"] == grad)
                slope_t = math.log(r["time_ms"] / base["time_ms"]) / math.log(top)
                slope_m = math.log(max(r["peak_mib"], 1e-3) / max(base["peak_mib"], 1e-3)) / math.log(top)
                out.append({"grad": grad, "votes": votes, "dim": dim, "factor": top,
                            "time_ratio": r["time_ms"] / base["time_ms"], "time_exponent": slope_t,
                            "mem_ratio": r["peak_mib"] / max(base["peak_mib"], 1e-3), "mem_exponent": slope_m})
    return out


def lazy_vs_eager(results: list[dict]) -> list[dict[str, Any]]:
    """Memory-efficient / eager ratios, in time and peak memory, for every configuration."""
    out = []
    for r in results:
        if r["votes"] != "lazy":
            continue
        e = next(x for x in results if x["votes"] == "eager" and x["grad"] == r["grad"]
                 and x["grown"] == r["grown"] and x["factor"] == r["factor"])
        out.append({"grown": r["grown"], "factor": r["factor"], "grad": r["grad"],
                    "time_ratio": r["time_ms"] / e["time_ms"], "mem_ratio": r["peak_mib"] / max(e["peak_mib"], 1e-3)})
    return out
