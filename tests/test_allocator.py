"""keep_freed_memory: a large block freed and allocated again reuses the process's memory instead of new pages
from the kernel (each of which faults on first touch). Measured in a fresh interpreter each time: the setting is
process-wide."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

STEPS = """
import ctypes, ctypes.util, resource, sys
from service.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
size = 64 * 2**20
def step():  # 64 MiB allocated, every page touched, freed: a tensor of a training step
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(ctypes.c_void_p(block))
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 5)
"""


def faults_per_step(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_memory_is_reused_instead_of_faulted_in_again() -> None:
    pages = 64 * 2**20 // 4096
    assert faults_per_step("default") > pages // 2  # glibc maps a fresh block for every 64 MiB tensor
    assert faults_per_step("keep") < pages // 20  # the freed block is reused: no new pages to touch
