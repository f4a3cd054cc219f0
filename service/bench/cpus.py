"""Where a served bench's processes run: the load generator on CPUs of its own, the servers on the rest.

Clients of a real deployment run on other machines; a load generator that shares the server's cores takes the CPU
the fronts need (each of its requests costs about 0.3 ms of CPU on a GPU machine, about half a front's). Where the
machine has CPUs to spare (a GPU machine's 16), the load generator's processes get whole cores of their own and
every server under test the others (a server started while this thread is :func:`pinned` keeps the mask, and so do
the processes it starts: its fronts, engine host and backbones, whose defaults then count the CPUs it has). On a
small machine (2 cores) they share, as before; so they do where the system cannot pin a process (no
``os.sched_getaffinity``: not Linux).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

PER_LOAD_PROCESS = 4
"""A load generator gets CPUs of its own where the machine has at least this many usable CPUs a load process."""


@dataclass(frozen=True)
class CpuSplit:
    """The CPUs of the servers under test and those of the load generator's processes (disjoint)."""

    server: tuple[int, ...]
    load: tuple[int, ...]

    def record(self) -> dict[str, list[int]]:
        return {"server": list(self.server), "load_generator": list(self.load)}


def current(pid: int = 0) -> tuple[int, ...]:
    """The CPUs process ``pid`` (0: this thread) may run on; none where the system does not say."""
    return tuple(sorted(os.sched_getaffinity(pid))) if hasattr(os, "sched_getaffinity") else ()


def core_of(cpu: int) -> tuple[int, int]:
    """The (package, core) a CPU is a hardware thread of, from sysfs (the CPU alone where it does not say)."""
    top = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return int((top / "physical_package_id").read_text()), int((top / "core_id").read_text())
    except (OSError, ValueError):
        return -1, cpu


def split(load_cpus: int, usable: Collection[int] | None = None,
          core: Callable[[int], tuple[int, int]] = core_of) -> CpuSplit | None:
    """At least ``load_cpus`` of the ``usable`` CPUs (default: this process's affinity) for the load generator, as
    whole cores taken from the end (a core's every hardware thread goes to one side), the rest for the servers;
    None where ``load_cpus`` is 0, the servers would keep fewer than half of them, or nothing is known of them."""
    cpus = sorted(usable if usable is not None else current())
    if load_cpus <= 0 or not cpus:
        return None
    cores: dict[tuple[int, int], list[int]] = {}
    for c in cpus:
        cores.setdefault(core(c), []).append(c)
    load: list[int] = []
    for threads in sorted(cores.values(), key=min, reverse=True):
        if len(load) >= load_cpus:
            break
        load += threads
    server = [c for c in cpus if c not in load]
    if 2 * len(server) < len(cpus):
        return None
    return CpuSplit(tuple(server), tuple(sorted(load)))


def auto_split(load_processes: int) -> CpuSplit | None:
    """One CPU of its own a load process where the machine has :data:`PER_LOAD_PROCESS` usable CPUs a load process
    (16 for 4 processes), else None (they share)."""
    if len(current()) < PER_LOAD_PROCESS * load_processes:
        return None
    return split(load_processes)


def from_option(value: str, load_processes: int) -> CpuSplit | None:
    """A bench's ``--load-cpus``: ``auto`` (see :func:`auto_split`), ``0`` (the load generator and the servers
    share every CPU) or how many CPUs the load generator gets of its own.

    Raises:
        ValueError: neither, more than half of the usable CPUs asked, or a system that cannot pin a process.
    """
    if value == "auto":
        return auto_split(load_processes)
    if not value.isdigit():
        raise ValueError(f"{value!r}: auto, 0 or a number of CPUs")
    got = split(int(value))
    if got is None and int(value):
        usable = current()
        if not usable:
            raise ValueError("this system cannot pin a process to CPUs (no os.sched_getaffinity)")
        raise ValueError(f"{value} CPUs for the load generator would leave the servers fewer than half of the "
                         f"{len(usable)} usable")
    return got


@contextlib.contextmanager
def pinned(cpus: Collection[int] | None) -> Iterator[None]:
    """This thread on ``cpus`` meanwhile (none: as it is), so that a process it starts inherits them; its own mask
    again after."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
