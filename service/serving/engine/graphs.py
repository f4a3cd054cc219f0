"""Plain batches in shape buckets: the encoder and the heads of one shape run on a batch padded up to the smallest
fitting bucket (:mod:`service.modeling.buckets`), as one computation per bucket that reads a fixed buffer of token
ids and indices. On a GPU that computation is captured once per bucket as a CUDA graph at warm-up and replayed (a
few launches a batch instead of hundreds); elsewhere, or where capturing failed, it runs eagerly, on the same
padded shapes. It knows torch and the models, nothing of HTTP or of the engine's requests.

A *plain* batch is one the engine hands here whole: every text of one chunk, one head asked of it (a head of the
slots' shape), no credit. Texts are sorted by their head's slot (the stacked head reads each slot's texts in one
run), fillers go last on the last slot; every answer is read at its text's row, fillers' never. A bucket has a
second computation for batches whose texts all ask one head (a model served alone, the usual case): that head's
parameters copied out of its slot on the device and broadcast over the batch, where the stacked head gathers a copy
of them for every position and text (on an H200 the gathers took about 1 ms of a 6.3 ms batch of 16,384 tokens);
fillers then run on that head too.

Attention inside a bucket may use cuDNN's kernel: its plan is built for the bucket's shape once, at capture, where
outside buckets every new shape would build one (the backbone turns it off there)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from service.modeling.backbone import Backbone
from service.modeling.buckets import Bucket, pad_batch, smallest_fit
from service.modeling.classifier import scoring
from service.modeling.encoder import pack_host, packing_of
from service.modeling.head import HeadSlots
from service.routing.segments import Products

log = logging.getLogger("service.engine")

MODES = ("off", "eager", "cuda")
"""How buckets run: not at all (every batch eager as it comes), ``eager`` (padded to a bucket, not captured: what a
CPU can check), ``cuda`` (captured as CUDA graphs at warm-up, replayed)."""


def _attention() -> contextlib.AbstractContextManager[object]:
    """Inside a bucket: cuDNN's attention first where it takes the inputs, then flash, memory-efficient, math."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # a torch without priorities: the backends allowed, in its own order
        return sdpa_kernel(order)


@dataclass
class Captured:
    """A bucket's computation: ``inputs`` the int64 buffer it reads (see :meth:`BucketRunner.inputs_of`),
    ``logits [rows, k]`` what it writes, ``graph`` its CUDA graph (None: run eagerly)."""

    inputs: torch.Tensor
    logits: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None


@dataclass
class BucketStats:
    """What the buckets did since warm-up: batches run in a bucket (``replayed`` of them from a graph, ``one_head``
    of them on the computation for one head), batches that fit none, the tokens computed and the real ones among
    them, seconds computing (launching the kernels, or replaying the graph: the host's own work of packing the batch
    is not in it), the warm-up's seconds and buckets, and the failed captures by bucket."""

    bucketed: int = 0
    replayed: int = 0
    one_head: int = 0
    unfit: int = 0
    tokens: int = 0
    real_tokens: int = 0
    forward_s: float = 0.0
    capture_s: float = 0.0
    buckets: int = 0
    failed: dict[str, str] = field(default_factory=dict)


class BucketRunner:
    """Plain batches of one head shape through ``backbone`` and ``slots`` in ``buckets`` (``mode``: see
    :data:`MODES`); ``one_head``: each bucket with its computation for batches of one head too; ``products``: the
    heads' matrix products (see :class:`~service.routing.segments.Products`; None: torch's)."""

    def __init__(self, backbone: Backbone, slots: HeadSlots, buckets: Sequence[Bucket], mode: str,
                 head_dtype: torch.dtype | None = None, one_head: bool = True, products: Products | None = None
                 ) -> None:
        if mode not in MODES or mode == "off":
            raise ValueError(f"bucket mode {mode!r}: one of {MODES[1:]}")
        if backbone.stream is None:
            raise ValueError("buckets need the packed encoder (a BERT-family backbone)")
        if mode == "cuda" and backbone.device.type != "cuda":
            raise ValueError("CUDA graphs need the backbone on a CUDA device")
        self.backbone, self.slots, self.mode, self.head_dtype = backbone, slots, mode, head_dtype
        self.buckets = sorted(buckets, key=lambda b: b.cost)
        self.one_head, self.products = one_head, products
        self._captured: dict[Bucket, Captured] = {}
        self._one: dict[Bucket, Captured] = {}  # each bucket's computation for one head, where it runs
        self._pool: object = None
        self.stats = BucketStats()

    def fits(self, lengths: np.ndarray) -> Bucket | None:
        """The bucket a batch of sequences of ``lengths`` runs in, or None."""
        return smallest_fit(self.buckets, int(lengths.sum()), len(lengths), int(lengths.max()))

    def inputs_of(self, ids: np.ndarray, lengths: np.ndarray, slot: np.ndarray, bucket: Bucket) -> np.ndarray:
        """The int64 buffer a bucket's computation reads for a fitting batch (sequences sorted by ``slot``): the
        packed stream padded to the bucket (:func:`~service.modeling.encoder.pack_host`), then each sequence's
        length and slot (fillers: the last slot)."""
        padded_ids, padded_lengths = pad_batch(ids, lengths, bucket, pad_id=0)  # [tokens], [rows]
        host, _, _ = pack_host(padded_ids, padded_lengths, None, bucket.width)
        filler = np.full(bucket.rows - len(slot), self.slots.capacity - 1, dtype=np.int64)
        return np.concatenate([host, padded_lengths, slot.astype(np.int64, copy=False), filler])

    def _compute(self, bucket: Bucket, one: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
        """``inputs -> logits [rows, k]`` for ``bucket``: the encoder on the padded stream, then the stacked head on
        every sequence by its slot (``one``: the first sequence's head, picked out of its slot, on every one)."""
        T, r, L = bucket.tokens, bucket.rows, bucket.width
        at = 3 * T + 2 * r * L  # where the lengths start
        slots = self.slots
        dtype = next(slots.head.parameters()).dtype

        def compute(inputs: torch.Tensor) -> torch.Tensor:
            packing = packing_of(inputs, T, r, L)
            with _attention():
                hidden = self.backbone.stream(packing)  # [T e d]
            n_t, slot = inputs[at : at + r], inputs[at + r : at + 2 * r]  # [r], [r]
            with scoring(hidden.device, self.head_dtype):
                if one:
                    logits = slots.pick(slot[:1]).scores_packed(hidden.to(dtype), n_t, None, self.products)  # [rk]
                else:
                    logits = slots.head.scores_packed(hidden.to(dtype), n_t, slot, self.products)  # [r k]
            return logits.float()  # [r k]

        return compute

    def _example(self, bucket: Bucket) -> torch.Tensor:
        """Inputs of a batch that fills ``bucket`` (every row a filler's length), on the device."""
        lengths = bucket.filler(0, 0)  # [rows]
        keep = lengths[lengths > 0]
        host = self.inputs_of(np.zeros(int(keep.sum()), dtype=np.int64), keep, np.zeros(len(keep), dtype=np.int64),
                              bucket)
        return torch.from_numpy(host).to(self.backbone.device)

    @torch.inference_mode()
    def warm(self, deadline_s: float = 20.0) -> BucketStats:
        """Every bucket run once (``cuda``: captured), smallest first, until ``deadline_s`` seconds have gone. A bucket
        whose capture fails runs eagerly; one whose computation fails here (a head whose products the grouped kernels
        do not take) or that the deadline leaves out is dropped: its batches run as they come. Failures are in
        :attr:`stats`."""
        t0 = time.perf_counter()
        kept = []
        for bucket in self.buckets:
            if time.perf_counter() - t0 > deadline_s:
                log.warning("buckets: %d of %d warmed in %.1f s; the rest left out", len(kept), len(self.buckets),
                            deadline_s)
                break
            captured = self._prepare(bucket)
            if captured is not None:
                self._captured[bucket] = captured
                kept.append(bucket)
                one = self._prepare(bucket, one=True) if self.one_head else None
                if one is not None:
                    self._one[bucket] = one
        self.buckets = kept
        self.stats.capture_s, self.stats.buckets = time.perf_counter() - t0, len(kept)
        return self.stats

    def _prepare(self, bucket: Bucket, one: bool = False) -> Captured | None:
        """``bucket``'s computation (``one``: for one head) run once on an example, and with ``cuda`` captured; None
        where it fails. The computation for one head is kept only where it is captured as the other is meant to be:
        where it is not, its batches take the other."""
        compute = self._compute(bucket, one)
        inputs = self._example(bucket)
        name = f"{bucket}{', one head' if one else ''}"
        try:
            logits = compute(inputs)  # the kernels chosen and attention's plans built, outside any capture
        except RuntimeError as e:
            self.stats.failed[name] = f"runs nowhere: {str(e)[:500]}"
            log.warning("buckets: %s does not run, its batches go %s: %s", name,
                        "in the bucket for any heads" if one else "as they come", e)
            return None
        if self.mode != "cuda":
            return Captured(inputs, logits)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):  # warmed on a side stream, as capturing needs
                compute(inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = compute(inputs)
            self._pool = graph.pool()
            return Captured(inputs, logits, graph)
        except RuntimeError as e:  # the bucket runs eagerly: slower, never wrong
            torch.cuda.synchronize()
            if one:
                self.stats.failed[name] = f"not captured, its batches take the bucket's other: {str(e)[:500]}"
                log.warning("buckets: capturing %s failed, its batches take the bucket's other: %s", name, e)
                return None
            self.stats.failed[name] = f"not captured, runs eagerly: {str(e)[:500]}"
            log.warning("buckets: capturing %s failed, it runs eagerly: %s", name, e)
            return Captured(inputs, logits)

    @torch.inference_mode()
    def run(self, ids: np.ndarray, lengths: np.ndarray, slot: np.ndarray) -> torch.Tensor | None:
        """``[s, k]`` the logits of a plain batch (``ids [T]`` back to back, ``lengths [s]``, ``slot [s]``
        non-decreasing), left on the device; None where it fits no bucket (the caller runs it eagerly)."""
        bucket = self.fits(lengths)
        if bucket is None or bucket not in self._captured:
            self.stats.unfit += 1
            return None
        one = bool(slot[0] == slot[-1]) and bucket in self._one  # (sorted: every text asks one head)
        captured = self._one[bucket] if one else self._captured[bucket]
        host = torch.from_numpy(self.inputs_of(ids, lengths, slot, bucket))  # [n]
        t0 = time.perf_counter()
        self.stats.one_head += one
        if captured.graph is None:
            logits = self._compute(bucket, one)(host.to(captured.inputs.device))  # [r k]
        else:
            captured.inputs.copy_(host.pin_memory(), non_blocking=True)
            captured.graph.replay()
            logits = captured.logits  # [r k] the graph's output: read before the next replay (stream order)
            self.stats.replayed += 1
        self.stats.forward_s += time.perf_counter() - t0
        self.stats.bucketed += 1
        self.stats.tokens += bucket.tokens
        self.stats.real_tokens += len(ids)
        return logits[: len(lengths)]  # [s k]
