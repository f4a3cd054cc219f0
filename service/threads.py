"""How many threads torch computes with, and how its OpenMP threads wait between parallel regions.

Torch's intra-op threads are OpenMP threads that busy-wait for the next parallel region. On a small
machine the event loop, the tokenizer and the HTTP stack need the same cores, so the defaults here are
derived from the CPUs this process may really use (its affinity mask, capped by a cgroup CPU quota, as
in a container with a CPU limit), not from the host's core count that torch would otherwise take.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota when there is one."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            n = min(n, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, n)


def set_openmp(policy: str | None, spin_count: int | None) -> None:
    """Set OpenMP's wait policy (``OMP_WAIT_POLICY``) and how long its idle threads spin before they sleep
    (``GOMP_SPINCOUNT``, read by GNU OpenMP, which torch's Linux wheels use; left alone where the environment
    sets it) for this process and the processes it starts. Both are read once, when torch's OpenMP runtime
    loads, so this must run before torch is imported; afterwards it only warns."""
    wanted = {"OMP_WAIT_POLICY": policy.upper() if policy else None,
              "GOMP_SPINCOUNT": str(spin_count) if spin_count and "GOMP_SPINCOUNT" not in os.environ else None}
    for name, value in wanted.items():
        if value is None:
            continue
        if "torch" in sys.modules:
            if os.environ.get(name) != value:
                log.warning("%s=%s ignored: torch is already loaded (set it before start)", name, value)
            continue
        os.environ[name] = value


def serial_tokenizer() -> None:
    """Tokenize on the calling thread (``TOKENIZERS_PARALLELISM=false``, where the environment does not say
    otherwise): the `tokenizers` library otherwise hands a call of several texts to a pool of threads, one per core,
    which takes the cores a model's batch computes on (calls of 16 tweets here: 12-43 % more CPU a text, for 20-36 %
    less wall time on two cores). A front tokenizes many requests at once, one call each; the benches serve this
    way too."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def set_torch_threads(n: int | None) -> int:
    """Use ``n`` intra-op threads (None: :func:`available_cpus`); returns the number set."""
    import torch

    threads = n or available_cpus()
    torch.set_num_threads(threads)
    return threads
