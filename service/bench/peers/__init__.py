"""The same model function behind other Python serving frameworks, for ``bench serve --peers``.

Each peer is a small script run as ``python -m service.bench.peers.<name>``: it loads the bundled model with
:meth:`Engine.load` on the framework's worker process (the model computes on that process's main thread),
batches with the framework's own documented dynamic batching, and answers ``POST`` bodies of the service's
shape (``{"inputs": [text, ...]}``) with each text's label and scores. Settings come from the environment
(the frameworks parse their own command lines):

- ``PEER_MODEL``: the model's folder; ``PEER_DEVICE``: cpu or cuda;
- ``PEER_PORT``; ``PEER_MAX_BATCH_SIZE``; ``PEER_MAX_WAIT_MS``;
- ``PEER_BATCH_LOG``: a file the worker appends each batch's size to (one line per batch), so the bench
  reads the mean batch as it does the service's from its metrics.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class Model:
    """The model function every peer calls: texts in, one ``{"label", "scores"}`` per text out."""

    def __init__(self) -> None:
        from service.serving.engine.engine import Engine

        self.engine = Engine.load(Path(os.environ["PEER_MODEL"]), device=os.environ.get("PEER_DEVICE", "cpu"))
        log = os.environ.get("PEER_BATCH_LOG")
        self._log = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT) if log else None

    def __call__(self, texts: list[str]) -> list[dict[str, Any]]:
        from service.serving.core.work import Task

        results = self.engine.run([Task(t) for t in texts])
        if self._log is not None:
            os.write(self._log, b"%d\n" % len(texts))
        return [{"label": r.label, "scores": r.scores} for r in results]


def setting(name: str, default: str) -> str:
    return os.environ.get(f"PEER_{name}", default)
