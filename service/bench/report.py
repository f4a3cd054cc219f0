"""What every benchmark prints and writes: a plain table on stdout and a JSON file with the
machine, versions and settings beside the numbers."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
"""This checkout's root (the repository the benches run from)."""


def echo(message: str, err: bool = False) -> None:
    """Print a result line (stdout) or a progress line (``err``: stderr), unbuffered."""
    print(message, file=sys.stderr if err else sys.stdout, flush=True)


def machine() -> dict[str, Any]:
    """The machine, device and library versions a result was measured with."""
    import torch
    import transformers

    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def in_turns(names: Sequence[T], k: int) -> list[T]:
    """``names`` in the order of round ``k``: each first in every other round (an A/A run of ``bench host-work``
    showed a fixed order biasing one side by about 8 %)."""
    return list(names) if k % 2 == 0 else list(names)[::-1]


def round_ratios(these: Sequence[dict[str, Any]], those: Sequence[dict[str, Any]], key: str) -> list[float]:
    """Each round's ``these[r][key] / those[r][key]``: two versions measured side by side in that round."""
    return [a[key] / b[key] for a, b in zip(these, those, strict=True)]


def repository_for(tree: Path, repository: Path, model: str) -> Path:
    """The model repository the version checked out in ``tree`` serves ``model`` from: its own where ``tree`` is
    another checkout than this one and has that model (this version's manifests have fields an earlier version
    refuses; the benches compare speed, which depends on a head's shape, not on its weights), else ``repository``."""
    own = tree / "models"
    if tree.resolve() != ROOT and (own / model).is_dir():
        return own.resolve()
    return repository.resolve()


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """Format ``rows`` as a fixed-width text table with the given columns."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[k]) for row in cells)) if cells else len(c) for k, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def write_json(path: Path, kind: str, settings: dict[str, Any], results: Any, summary: dict[str, Any]) -> Path:
    """Write one benchmark's result file and return its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": kind, "machine": machine(), "settings": settings, "summary": summary, "results": results}
    path.write_text(json.dumps(doc, indent=2))
    return path


def in_worker_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a helper thread, as the server runs the model (torch's OpenMP threads busy-wait
    and slow down badly on the main thread of a busy machine); re-raise its exception here."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed back to the caller
            box["error"] = e

    thread = threading.Thread(target=target, name="bench-model")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def whole_passes(one_pass: Callable[[], None], n_texts: int, seconds: float) -> float:
    """Texts per second over whole passes of the texts, at least ``seconds`` (cut short, the shortest
    texts, which come first, would count more)."""
    n = 0
    t0 = time.perf_counter()
    while n == 0 or time.perf_counter() - t0 < seconds:
        one_pass()
        n += n_texts
    return n / (time.perf_counter() - t0)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """The median time of ``repeats`` calls of ``fn``, in milliseconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)
