"""`routing-service bench engine --onnx`: the backbone against ONNX Runtime on the same batches, in turns.

The Hugging Face encoder (every layer's hidden states, stacked) is exported to ONNX once (TorchScript exporter,
dynamic batch and length) and run by ONNX Runtime's CPU provider on padded batches with their attention mask, as
a server using it would; the backbone runs the same texts as the service does (:meth:`Backbone.forward`: the packed
stream where it agrees with the module). Each round times one pass of every batch with each, one after the other,
so that both see the machine in the same state; the ratio is of their medians over rounds. The outputs are compared
on the real tokens (padding left out): the largest absolute difference of any hidden state.
"""

from __future__ import annotations

import io
import statistics
import time
import warnings
from typing import Any

import numpy as np
import torch

from service.modeling.backbone import Backbone
from service.modeling.tokenizer import resolve_source


class _EveryLayer(torch.nn.Module):
    """The encoder's hidden states of every depth, ``[b, n, d_depth, d_emb]``, as one output."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        return torch.stack(out.hidden_states, 2)  # [b n e d]


def session(source: str, threads: int) -> Any:
    """An ONNX Runtime session of ``source``'s encoder (every layer), exported here, on ``threads`` threads."""
    import onnxruntime as ort
    from transformers import AutoModel

    encoder = AutoModel.from_pretrained(resolve_source(source), local_files_only=True).eval()
    ids = torch.randint(1000, 2000, (2, 8))  # [b n] an example: the axes are dynamic
    mask = torch.ones(2, 8, dtype=torch.long)  # [b n]
    mask[0, 6:] = 0
    blob = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        torch.onnx.export(_EveryLayer(encoder), (ids, mask), blob, input_names=["ids", "mask"], output_names=["hidden"],
                          dynamic_axes={"ids": {0: "b", 1: "n"}, "mask": {0: "b", 1: "n"}, "hidden": {0: "b", 1: "n"}},
                          dynamo=False, opset_version=17)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(blob.getvalue(), options, providers=["CPUExecutionProvider"])


def padded(chunks: list[tuple[int, ...]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``ids [b, n]`` and ``mask [b, n]`` (int64) of ``chunks``, padded to the longest."""
    n = max(map(len, chunks))
    ids = np.full((len(chunks), n), pad_id, dtype=np.int64)  # [b n]
    mask = np.zeros((len(chunks), n), dtype=np.int64)  # [b n]
    for r, c in enumerate(chunks):
        ids[r, : len(c)], mask[r, : len(c)] = c, 1
    return ids, mask


def compare(backbone: Backbone, source: str, texts: list[str], batch: int, rounds: int) -> dict[str, Any]:
    """The backbone and ONNX Runtime on ``texts`` in batches of ``batch`` (single-chunk texts only, in order), in
    ``rounds`` turns: milliseconds per batch of each (medians over rounds), their ratio, and the outputs' largest
    difference."""
    encodings = [e for e in backbone.encode(texts) if len(e.chunks) == 1]
    batches = [encodings[k : k + batch] for k in range(0, len(encodings) - batch + 1, batch)]
    if not batches:
        raise ValueError(f"fewer than {batch} single-chunk texts")
    ort = session(source, torch.get_num_threads())
    pad_id = backbone.tokenizer.pad_token_id or 0
    inputs = [padded([e.chunks[0] for e in b], pad_id) for b in batches]

    def run_torch() -> list[torch.Tensor]:
        with torch.inference_mode():
            return [backbone(b).hidden for b in batches]  # [b n e d] each

    def run_ort() -> list[np.ndarray]:
        return [ort.run(None, {"ids": ids, "mask": mask})[0] for ids, mask in inputs]  # [b n e d] each

    got_torch, got_ort = run_torch(), run_ort()  # warm-up, and the outputs compared
    worst = 0.0
    for t, o, (_, mask) in zip(got_torch, got_ort, inputs, strict=True):
        real = mask.astype(bool)  # [b n]
        worst = max(worst, float(np.abs(t.float().numpy()[real] - o[real]).max()))
    times: dict[str, list[float]] = {"torch": [], "onnxruntime": []}
    for _ in range(rounds):
        for name, fn in (("torch", run_torch), ("onnxruntime", run_ort)):
            t0 = time.perf_counter()
            fn()
            times[name].append(1000 * (time.perf_counter() - t0) / len(batches))
    torch_ms, ort_ms = statistics.median(times["torch"]), statistics.median(times["onnxruntime"])
    return {"texts": len(batches) * batch, "batch_size": batch, "batches": len(batches), "rounds": rounds,
            "threads": torch.get_num_threads(), "torch_ms_per_batch": torch_ms, "onnxruntime_ms_per_batch": ort_ms,
            "torch_over_onnxruntime": torch_ms / ort_ms, "max_abs_difference": worst,
            "torch_ms_rounds": times["torch"], "onnxruntime_ms_rounds": times["onnxruntime"],
            "onnxruntime_version": __import__("onnxruntime").__version__}
