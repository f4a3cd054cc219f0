"""The same model function behind other Python serving frameworks, for ``bench serve --peers``.

Each peer is a small script run as ``python -m service.bench.peers.<name>``: it loads the bundled model with
:meth:`Engine.load` on the framework's worker process (the model computes on that process's main thread),
batches with the framework's own documented dynamic batching, and answers ``POST`` bodies of the service's
shape (``{"inputs": [text, ...]}``) with each text's label and scores. Settings come from the environment
(the frameworks parse their own command lines):

- ``PEER_MODEL``: the model's folder; ``PEER_DEVICE``: cpu or cuda;
- ``PEER_PORT``; ``PEER_MAX_BATCH_SIZE``; ``PEER_MAX_WAIT_MS``;
- ``PEER_BUCKETS``: the engine's shape buckets, as the service's ``buckets`` setting (default ``auto``, the
  service's own: captured on a GPU, none on a CPU), chosen for ``PEER_MAX_BATCH_SIZE`` texts and the service's
  token budget on the device; ``PEER_BATCH_INVARIANCE``: as the service's ``batch_invariance`` (default ``off``);
- ``PEER_BATCH_LOG``: a file the worker appends each batch's size to (one line per batch), so the bench
  reads the mean batch as it does the service's from its metrics.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class Model:
    """The model function every peer calls: texts in, one ``{"label", "scores"}`` per text out. It is this version's
    engine as the service runs it: loaded with the service's shape buckets on the device, each batch's texts
    tokenized in one call and handed to it tokenized (as the service's fronts hand them over)."""

    def __init__(self) -> None:
        from service.config import Settings
        from service.serving.engine.engine import Engine
        from service.serving.engine.pipe import BucketPlan

        device = setting("DEVICE", "cpu")
        _, budget = Settings().batch_limits(device)
        plan = BucketPlan(setting("BUCKETS", "auto"), int(setting("MAX_BATCH_SIZE", "32")), budget)
        self.engine = Engine.load(Path(os.environ["PEER_MODEL"]), device=device, buckets=plan,
                                  batch_invariance=setting("BATCH_INVARIANCE", "off"))
        self.key = self.engine.models[0]
        self.length = self.engine.max_length(self.key)
        log = os.environ.get("PEER_BATCH_LOG")
        self._log = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT) if log else None

    def __call__(self, texts: list[str]) -> list[dict[str, Any]]:
        from service.serving.core.work import Task

        encodings = self.engine.encode(texts, [self.key], spans=False)  # the ids alone, as a front asking no credit
        results = self.engine.run([Task(t, e[self.length], self.key) for t, e in zip(texts, encodings, strict=True)])
        if self._log is not None:
            os.write(self._log, b"%d\n" % len(texts))
        return [{"label": r.label, "scores": r.scores} for r in results]


def setting(name: str, default: str) -> str:
    return os.environ.get(f"PEER_{name}", default)
