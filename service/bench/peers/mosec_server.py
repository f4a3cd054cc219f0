"""The model behind mosec (https://github.com/mosecorg/mosec): one worker process, mosec's dynamic batching
(``max_batch_size``, ``max_wait_time``), JSON in and out; ``POST /inference``."""

from __future__ import annotations

from typing import Any

from mosec import Server, Worker

from service.bench.peers import Model, setting


class Classify(Worker):
    """A batch of requests (each ``{"inputs": [text, ...]}``) through the model; one response per request."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()

    def forward(self, data: list[dict[str, Any]]) -> list[dict[str, Any]]:
        texts = [t for request in data for t in request["inputs"]]
        outputs = iter(self.model(texts))
        return [{"outputs": [next(outputs) for _ in request["inputs"]]} for request in data]


if __name__ == "__main__":
    import sys

    sys.argv[1:] = ["--port", setting("PORT", "8000"), "--address", "127.0.0.1"]
    server = Server()
    server.append_worker(Classify, num=1, max_batch_size=int(setting("MAX_BATCH_SIZE", "32")),
                         max_wait_time=int(float(setting("MAX_WAIT_MS", "5"))))
    server.run()
