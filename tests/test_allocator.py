"""keep_freed_memory: a large block freed and allocated again reuses the process's memory instead of new pages
from the kernel (each of which faults on first touch), in the engine's process and training's, unless the operator
tuned malloc. Measured in a fresh interpreter each time: the setting is process-wide."""

from __future__ import annotations

import json
import os
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


GLIBC = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's (CI runs on glibc)")


def untuned(**env: str) -> dict[str, str]:
    """This process's environment without any malloc setting of its own, plus ``env``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}, **env}


def faults_per_step(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], env=untuned(), capture_output=True, text=True,
                         check=True)
    return int(out.stdout)


@GLIBC
def test_freed_memory_is_reused_instead_of_faulted_in_again() -> None:
    pages = 64 * 2**20 // 4096
    assert faults_per_step("default") > pages // 2  # glibc maps a fresh block for every 64 MiB tensor
    assert faults_per_step("keep") < pages // 20  # the freed block is reused: no new pages to touch


PROBE = """
import ctypes, json, torch
from service.allocator import keep_freed_memory

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info

def mapped_by_a_batch() -> int:
    '''Bytes in blocks mapped on their own while a 64 MiB tensor lives.'''
    x = torch.empty(64 << 20, dtype=torch.uint8)
    x.fill_(1)
    return libc.mallinfo2().hblkhd

before = mapped_by_a_batch()
kept = keep_freed_memory()
print(json.dumps({"before": before, "kept": kept, "after": mapped_by_a_batch()}))
"""


def probe(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env=untuned(**env), capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.splitlines()[-1])


@GLIBC
def test_a_batch_s_large_blocks_come_from_the_kept_heap_not_pages_of_their_own() -> None:
    got = probe()
    assert got["before"] >= 64 << 20  # glibc's default: the block is mapped on its own, and unmapped when freed
    assert got["kept"] and got["after"] < 64 << 20  # kept: the block comes from the heap


@GLIBC
def test_an_operator_s_malloc_settings_are_kept() -> None:
    got = probe(MALLOC_MMAP_MAX_="65536")
    assert not got["kept"] and got["after"] >= 64 << 20
    got = probe(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1048576")
    assert not got["kept"] and got["after"] >= 64 << 20
