"""settle and keep: what a serving process has loaded is kept out of garbage collections (frozen); what it drops later
is freed at once by reference counting (heads hold no cycles), or at the next settle for a cycle. In a fresh
interpreter: freezing is process-wide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

STEPS = """
import gc, weakref
from service.collector import keep, settle

class Loaded:
    pass

def loaded():  # a reference cycle: what only a collection frees
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
settle()
assert alive() is None  # the next settle frees what was dropped, its cycle too
kept = loaded()
keep()  # loaded later: frozen too, without a full collection
alive = weakref.ref(kept)
del kept
gc.collect()
assert alive() is not None
print("ok")
"""

ENGINE = """
import gc, sys, weakref
from pathlib import Path
from service.serving.engine.engine import Engine

engine = Engine.load(Path(sys.argv[1]) / "tiny", device="cpu", dtype="float32")
loaded = gc.get_freeze_count()
assert loaded > 10000  # torch, transformers and the model, out of every collection
engine.add_heads([Path(sys.argv[1]) / "tiny"], ["late"])
assert gc.get_freeze_count() > loaded  # the head loaded at runtime too
head = weakref.ref(engine.classifiers["late"])
engine.remove_heads(["late"])
assert head() is None  # freed as it is dropped, frozen or not: a head holds no reference cycle
print("ok")
"""


def run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])


def test_what_was_loaded_is_frozen_and_freed_at_the_next_settle_once_dropped() -> None:
    done = run(STEPS)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_an_engine_freezes_what_it_loads_and_a_head_it_drops_is_freed_at_once(tiny_repo: Path) -> None:
    done = run(ENGINE, str(tiny_repo))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
