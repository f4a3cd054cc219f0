"""settle: what a serving process has loaded is kept out of garbage collections (frozen), and what it drops later is
freed at the next settle, reference cycles too. In a fresh interpreter: freezing is process-wide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

STEPS = """
import gc, sys, weakref
from service.collector import settle

class Loaded:
    pass

def loaded():  # a reference cycle, as models hold (a module and its parts)
    a, b = Loaded(), Loaded()
    a.b, b.a = b, a
    return a

kept = loaded()
before = gc.get_freeze_count()
assert settle() > before  # the cycle and everything else alive: frozen
alive = weakref.ref(kept)
del kept
gc.collect()
assert alive() is not None  # frozen: no collection walks it
assert sys.argv[1] != "settle" or (settle(), alive() is None)[1]  # the next settle frees what was dropped
print("ok")
"""

ENGINE = """
import gc, sys, weakref
from pathlib import Path
from service.serving.engine.engine import Engine

engine = Engine.load(Path(sys.argv[1]) / "tiny", device="cpu", dtype="float32")
assert gc.get_freeze_count() > 10000  # torch, transformers and the model, out of every collection
engine.add_heads([Path(sys.argv[1]) / "tiny"], ["late"])
head = engine.classifiers["late"]
head.cycle = head  # a cycle the dropped head brings along
alive = weakref.ref(head)
del head
engine.remove_heads(["late"])
assert alive() is None  # freed as it was dropped, frozen as it was when loaded
print("ok")
"""


def run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])


def test_what_was_loaded_is_frozen_and_freed_at_the_next_settle_once_dropped() -> None:
    done = run(STEPS, "settle")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_an_engine_freezes_what_it_loads_and_frees_a_head_it_drops(tiny_repo: Path) -> None:
    done = run(ENGINE, str(tiny_repo))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
