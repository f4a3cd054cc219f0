"""The model behind LitServe (https://github.com/Lightning-AI/LitServe): one inference worker process,
LitServe's dynamic batching (``max_batch_size``, ``batch_timeout``), JSON in and out; ``POST /predict``."""

from __future__ import annotations

from typing import Any

import litserve as ls

from service.bench.peers import Model, setting


class Classify(ls.LitAPI):
    """One request (``{"inputs": [text]}``) is one item of a batch."""

    def setup(self, device: str) -> None:
        self.model = Model()

    # LitServe reads a pydantic model from ``request``'s annotation and a response model from the return
    # annotation of ``encode_response``: left out, the body is read as plain JSON and the answer is not validated
    def decode_request(self, request, **kwargs: Any) -> str:  # type: ignore[no-untyped-def]
        (text,) = request["inputs"]
        return text

    def batch(self, inputs: list[str]) -> list[str]:
        return list(inputs)

    def predict(self, texts: list[str], **kwargs: Any) -> list[dict[str, Any]]:
        return self.model(texts)

    def unbatch(self, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return output

    def encode_response(self, output: dict[str, Any], **kwargs: Any):  # type: ignore[no-untyped-def]
        return {"outputs": [output]}


if __name__ == "__main__":
    # one worker on the model's device (LitServe starts one per device it is given)
    accelerator = "cuda" if setting("DEVICE", "cpu").startswith("cuda") else "cpu"
    api = Classify(max_batch_size=int(setting("MAX_BATCH_SIZE", "32")),
                   batch_timeout=float(setting("MAX_WAIT_MS", "5")) / 1000)
    server = ls.LitServer(api, accelerator=accelerator, devices=1)
    server.run(host="127.0.0.1", port=int(setting("PORT", "8000")), generate_client_file=False)
