"""The engine's process keeps freed memory for the next batch (glibc's malloc), unless its operator tuned malloc."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes, json, torch
from service.modeling.heap import keep_freed_memory

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



def glibc() -> bool:
    try:
        return "glibc" in (os.confstr("CS_GNU_LIBC_VERSION") or "")
    except (ValueError, OSError):
        return False


pytestmark = pytest.mark.skipif(not glibc(), reason="glibc's malloc only (CI runs on glibc)")


def probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_a_batch_s_large_blocks_come_from_the_kept_heap_not_pages_of_their_own() -> None:
    got = probe()
    assert got["before"] >= 64 << 20  # glibc's default: the block is mapped on its own, and unmapped when freed
    assert got["kept"] and got["after"] < 64 << 20  # kept: the block comes from the heap


def test_an_operator_s_malloc_settings_are_kept() -> None:
    got = probe(MALLOC_MMAP_MAX_="65536")
    assert not got["kept"] and got["after"] >= 64 << 20
    got = probe(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1048576")
    assert not got["kept"] and got["after"] >= 64 << 20
