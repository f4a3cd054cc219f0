"""The served benches' CPUs: the load generator on whole cores of its own, the servers on the rest."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from service.bench import cpus


def hyperthreaded(cpu: int) -> tuple[int, int]:
    """8 cores of 2 hardware threads: CPU n and n + 8 on core n % 8."""
    return 0, cpu % 8


def test_the_load_generator_gets_whole_cores_from_the_end() -> None:
    got = cpus.split(4, range(16), hyperthreaded)
    assert got is not None and got.load == (6, 7, 14, 15)  # cores 6 and 7, both threads of each
    assert got.server == (0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13)
    three = cpus.split(3, range(16), hyperthreaded)  # rounded up to whole cores
    assert three is not None and three.load == (6, 7, 14, 15)
    plain = cpus.split(4, range(16), lambda c: (0, c))  # a core a CPU
    assert plain is not None and plain.load == (12, 13, 14, 15) and plain.server == tuple(range(12))
    assert plain.record() == {"server": list(range(12)), "load_generator": [12, 13, 14, 15]}


def test_no_split_that_leaves_the_servers_less_than_half_or_none_asked() -> None:
    assert cpus.split(0, range(16), hyperthreaded) is None
    assert cpus.split(9, range(16), lambda c: (0, c)) is None  # 7 of 16 left
    assert cpus.split(8, range(16), lambda c: (0, c)) is not None  # 8 of 16
    assert cpus.split(1, [0, 1], lambda c: (0, 0)) is None  # one core of two threads: nothing to split


def test_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(16)))
    auto = cpus.from_option("auto", 4)  # 16 CPUs: one a load process
    assert auto is not None and len(auto.load) >= 4 and not set(auto.load) & set(auto.server)
    assert cpus.from_option("auto", 5) is None  # fewer than 4 CPUs a load process: they share
    assert cpus.from_option("0", 4) is None
    two = cpus.from_option("2", 1)
    assert two is not None and len(two.load) >= 2
    with pytest.raises(ValueError, match="auto, 0 or a number"):
        cpus.from_option("some", 4)
    with pytest.raises(ValueError, match="fewer than half of the 16 usable"):
        cpus.from_option("9", 4)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_a_process_started_while_pinned_keeps_the_cpus_and_the_thread_gets_its_own_back() -> None:
    before = os.sched_getaffinity(0)
    last = max(before)
    with cpus.pinned([last]):
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True)
        assert os.sched_getaffinity(0) == {last}
    assert child.stdout.strip() == f"[{last}]"
    assert os.sched_getaffinity(0) == before
    with cpus.pinned(None):  # nothing asked: as it is
        assert os.sched_getaffinity(0) == before


def test_a_system_that_cannot_pin_shares_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``os.sched_getaffinity`` (not Linux) the load generator and the servers share the CPUs, and the CPUs
    a load ran on are not known, rather than the bench failing."""
    monkeypatch.delattr(cpus.os, "sched_getaffinity")
    assert cpus.current() == () and cpus.from_option("auto", 1) is None and cpus.split(1) is None
    with pytest.raises(ValueError, match="cannot pin"):
        cpus.from_option("1", 1)
