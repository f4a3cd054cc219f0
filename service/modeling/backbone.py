"""Frozen Hugging Face encoder that returns the hidden states of every depth, per text.

Long texts are split into chunks of the backbone's maximum length (special tokens in every chunk);
all chunks of a batch run through the backbone together, and each text's real positions (never
padding) are joined back into one sequence, as the paper does for IMDB.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerBase

from service.modeling.encoder import PackedEncoder, pack
from service.modeling.encoding import Encoding
from service.modeling.grouping import length_groups, pack_rows
from service.modeling.tokenizer import (
    BackboneError,
    ChunkTokenizer,
    load_error,
    local_only,
    resolve_source,
)

__all__ = ["Backbone", "BackboneError", "ChunkTokenizer", "Encoded", "resolve_source"]


@dataclass
class Encoded:
    """Hidden states of a batch of texts, padded to the longest text.

    Attributes:
        hidden: ``[b, n, d_depth, d_emb]`` hidden states (embeddings output, then every layer).
        pad: bool ``[b, n]``, True at padding positions; None when every text has the same length.
        encodings: each text's :class:`Encoding` (its tokens, their spans and words), from which the per-text
            tensors below are built when first read (classifying reads none of them).
    """

    hidden: torch.Tensor
    pad: torch.Tensor | None
    encodings: list[Encoding]

    @property
    def lengths(self) -> list[int]:
        """Each text's real positions (special tokens of every chunk included)."""
        return [e.n_tokens for e in self.encodings]

    @functools.cached_property
    def token_ids(self) -> list[torch.Tensor]:
        """Per text, ``[n_t]`` token ids of its real positions."""
        return [torch.tensor([i for c in e.chunks for i in c]) for e in self.encodings]

    @functools.cached_property
    def offsets(self) -> list[torch.Tensor]:
        """Per text, ``[n_t, 2]`` character span of each token in the text ((0, 0) for specials)."""
        return [torch.tensor(e.offsets, dtype=torch.long).reshape(-1, 2) for e in self.encodings]

    @functools.cached_property
    def special(self) -> list[torch.Tensor]:
        """Per text, bool ``[n_t]``, True at special tokens."""
        return [torch.tensor(e.special, dtype=torch.bool) for e in self.encodings]

    @functools.cached_property
    def word_ids(self) -> list[torch.Tensor]:
        """Per text, ``[n_t]`` index of the word each token belongs to (-1 for specials)."""
        return [torch.tensor(e.word_ids, dtype=torch.long) for e in self.encodings]


class Backbone(torch.nn.Module):
    """A frozen encoder in eval mode.

    Args:
        source: directory, hub id or ``package:<module>`` (see :func:`resolve_source`).
        max_length: tokens per chunk, special tokens included (capped at the model's limit).
        device, dtype: where and in what precision the encoder runs.
        chunk_batch_tokens: at most this many padded tokens go through the encoder at once.
        call_overhead: the fixed cost of one call of the encoder, in padded tokens, where chunks cannot be
            packed (see ``packs``): a batch of chunks of mixed lengths is then cut into length groups where
            that saves more padding than a call costs (see :func:`~service.modeling.grouping.length_groups`).
            None: 64 on a CPU (measured: random tweets in batches of 16 ran 22% faster than padded
            together, 48-64 being best), 1024 on a GPU (not measured here: there padding is nearly free
            until the device is saturated). The head's grouping is derived from it too.

    Attributes:
        stream: the encoder on one packed token stream (:class:`~service.modeling.encoder.PackedEncoder`), for the
            encoders whose layers it knows (the BERT family) and where it agrees with the Hugging Face module at
            load; None otherwise.
        packs: without ``stream``, whether chunks are packed several to a row (each attending only to itself, its
            positions counted from 0), which wastes no work on padding; checked at load against running chunks
            one by one, since not every encoder takes ``position_ids`` and a 4D mask in this sense.
    """

    def __init__(
        self,
        source: str,
        max_length: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        chunk_batch_tokens: int = 16384,
        call_overhead: int | None = None,
    ) -> None:
        super().__init__()
        path = resolve_source(source)
        only_local = local_only(path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=only_local)
            self.encoder = AutoModel.from_pretrained(path, dtype=dtype, local_files_only=only_local)
        except (OSError, ValueError) as e:
            raise load_error(source, path, only_local, e) from e
        cfg = self.encoder.config
        if not getattr(tokenizer, "is_fast", False):
            raise BackboneError(f"backbone {source!r}: the backbone needs a fast tokenizer (character offsets)")
        limit = min(tokenizer.model_max_length, getattr(cfg, "max_position_embeddings", 512))
        try:  # a copy of the Rust tokenizer: Hugging Face's wrapper reconfigures its own on every call
            self.chunker = ChunkTokenizer(Tokenizer.from_str(tokenizer.backend_tokenizer.to_str()), limit)
        except BackboneError as e:
            raise BackboneError(f"backbone {source!r}: {e}") from e
        self.tokenizer: PreTrainedTokenizerBase = tokenizer
        self.max_length = self.chunker.cut(max_length)
        self.encoder.eval().requires_grad_(False).to(device)
        if getattr(self.encoder, "pooler", None) is not None:
            # the pooled [CLS] output is never used; Hugging Face encoders skip a pooler set to None
            # (as when built with add_pooling_layer=False), which saves one matmul per chunk
            self.encoder.pooler = None
        self.d_emb: int = cfg.hidden_size
        self.d_depth: int = cfg.num_hidden_layers + 1
        self.chunk_batch_tokens = chunk_batch_tokens
        if call_overhead is None:
            call_overhead = 64 if self.device.type == "cpu" else 1024
        self.call_overhead = call_overhead
        # a packed row may hold several chunks, within what the encoder's position buffers allow
        self.row_limit: int = getattr(cfg, "max_position_embeddings", self.max_length)
        self.packs = self._packing_agrees()
        if self.device.type == "cuda":
            # cuDNN's attention builds a plan for every new shape, and a stream's padded view has a new one in nearly
            # every batch: on an H200 that held batches of 456 tweets at 26 ms while the device computed 8.6 ms of
            # it, and lone texts at 75 ms (p90). The memory-efficient and flash kernels take any shape as it comes.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.stream: PackedEncoder | None = None
        self.forward_seconds = 0.0
        """Time spent in :attr:`stream`'s forward calls so far (on a GPU, launching their kernels): what the bench
        leaves out of the host's own work."""
        stream = PackedEncoder.of(self.encoder)
        if stream is not None and self._stream_agrees(stream):
            self.stream = stream

    @property
    def device(self) -> torch.device:
        return next(self.encoder.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.encoder.parameters()).dtype

    def encode(self, texts: list[str]) -> list[Encoding]:
        """Tokenize ``texts`` and cut each into chunks of ``max_length`` (see :meth:`ChunkTokenizer.encode`)."""
        return self.chunker.encode(texts, self.max_length)

    @torch.inference_mode()
    def forward(self, texts: list[str] | list[Encoding]) -> Encoded:
        """Encode ``texts`` (or run already tokenized ones); see :class:`Encoded` for what comes back."""
        strings = [t for t in texts if isinstance(t, str)]
        if strings and len(strings) != len(texts):
            raise TypeError("pass texts or Encodings, not both")
        encodings = self.encode(strings) if strings else [t for t in texts if isinstance(t, Encoding)]
        states = self.run_chunks([list(c) for e in encodings for c in e.chunks])  # per chunk [L_c, d_depth, d_emb]
        per_text, k = [], 0
        for e in encodings:
            per_text.append(states[k : k + len(e.chunks)])
            k += len(e.chunks)
        return self.join(encodings, per_text)

    def join(self, encodings: list[Encoding], states: list[list[torch.Tensor]]) -> Encoded:
        """One batch from each text's chunk states (``states[b]``: its chunks' ``[L_c, d_depth, d_emb]`` in
        order), each text's real positions joined into one sequence and padded to the longest."""
        # a text of one chunk is that chunk's states as they are; the batch is copied once, in one call (on the H100
        # launching a copy and a fill per text took 5.5 ms of a 23 ms batch of 32, `bench engine`)
        joined = [p[0] if len(p) == 1 else torch.cat(p, dim=0) for p in states]  # per text [n_t, d_depth, d_emb]
        hidden = torch.nn.utils.rnn.pad_sequence(joined, batch_first=True)  # [b n depth emb], zeros past each text
        lengths = torch.tensor([len(j) for j in joined])  # [b]
        if bool((lengths == hidden.shape[1]).all()):  # no padding: none to mask (the head routes without a mask)
            return Encoded(hidden, None, list(encodings))
        pad = (torch.arange(hidden.shape[1]) >= lengths[:, None]).to(hidden.device)  # [b n]
        return Encoded(hidden, pad, list(encodings))

    @torch.inference_mode()
    def run_stream(self, ids: np.ndarray, lengths: np.ndarray, dest: np.ndarray | None = None, rows: int = 0
                   ) -> torch.Tensor:
        """``[T, d_depth, d_emb]`` hidden states of chunks whose token ids (special tokens included) lie back to back
        in ``ids [T]``, ``lengths [c]`` each, in the same order: through :attr:`stream` in calls of at most
        ``chunk_batch_tokens`` tokens, else (an encoder it does not know) through :meth:`run_chunks`.

        With ``dest [T]``: ``[rows, d_depth, d_emb]``, token ``t``'s states in row ``dest[t]`` (the other rows are left
        as allocated, for the caller to fill), written there as the encoder computes them: a reader of another
        layout (the heads' padded batches, see :func:`~service.modeling.grouping.lay_out`) then copies nothing."""
        bounds = np.cumsum(lengths)  # [c] each chunk's end in the stream
        out = None if dest is None else torch.empty(rows, self.d_depth, self.d_emb, device=self.device,
                                                    dtype=self.dtype)  # [R e d]
        if self.stream is None:
            chunks = [ids[a:b].tolist() for a, b in zip(bounds - lengths, bounds, strict=True)]
            flat = torch.cat(self.run_chunks(chunks)) if chunks else self._empty()  # [T e d]
            if out is None or dest is None:
                return flat
            out[torch.from_numpy(dest).to(self.device)] = flat  # [T e d] of [R e d]
            return out
        parts, first, taken = [], 0, 0
        while first < len(lengths):  # calls of whole chunks within the budget (a longer chunk alone)
            last = max(first + 1, int(np.searchsorted(bounds, taken + self.chunk_batch_tokens, side="right")))
            end = int(bounds[last - 1])
            parts.append(self._stream_call(ids[taken:end], lengths[first:last],
                                           None if dest is None else dest[taken:end], out))
            first, taken = last, end
        if out is not None:
            return out
        if not parts:
            return self._empty()
        return parts[0] if len(parts) == 1 else torch.cat(parts)  # [T e d]

    def _stream_call(self, ids: np.ndarray, lengths: np.ndarray, dest: np.ndarray | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """One call of :attr:`stream` (``dest``, ``out``: see :meth:`run_stream`). On a CPU, where attention's padded
        work costs time, chunks of different lengths share rows (:func:`~service.modeling.grouping.pack_rows`); on
        a GPU one chunk a row, which costs the host less."""
        assert self.stream is not None
        rows = width = None
        if self.device.type == "cpu" and len(lengths) > 1 and lengths.min() != lengths.max():
            width, rows = pack_rows(lengths.tolist(), self.row_limit, self.d_emb)
        packing = pack(ids, lengths, self.device, rows, width, dest)
        t0 = time.perf_counter()
        states = self.stream(packing, out)  # [T e d], or out [R e d]
        self.forward_seconds += time.perf_counter() - t0
        return states

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, self.d_depth, self.d_emb, device=self.device, dtype=self.dtype)  # [0 e d]

    @torch.inference_mode()
    def run_chunks(self, chunk_ids: list[list[int]]) -> list[torch.Tensor]:
        """Hidden states ``[L_c, d_depth, d_emb]`` of each chunk (token ids, special tokens included): packed
        several to a row when the encoder allows it (``packs``), else padded in length groups (see
        ``call_overhead``); at most ``chunk_batch_tokens`` positions go through the encoder at once."""
        if not chunk_ids:
            return []
        if self.stream is not None:
            lengths = np.fromiter(map(len, chunk_ids), dtype=np.int64, count=len(chunk_ids))
            flat = self.run_stream(np.fromiter((i for c in chunk_ids for i in c), dtype=np.int64,
                                               count=int(lengths.sum())), lengths)  # [T e d]
            return list(flat.split(lengths.tolist()))  # per chunk [L_c e d]
        # one chunk is one row either way; the grouped path builds less around it
        return self._run_packed(chunk_ids) if self.packs and len(chunk_ids) > 1 else self._run_grouped(chunk_ids)

    def _encode_rows(self, ids: torch.Tensor, mask: torch.Tensor | None,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``[r, L, d_depth, d_emb]`` hidden states of rows of token ids ``[r, L]``."""
        opt = {} if position_ids is None else {"position_ids": position_ids.to(self.device)}
        res = self.encoder(input_ids=ids.to(self.device), attention_mask=None if mask is None else mask.to(self.device),
                           output_hidden_states=True, **opt)
        return torch.stack(res.hidden_states, dim=-2)  # [r L depth emb]

    def _run_grouped(self, chunk_ids: list[list[int]]) -> list[torch.Tensor]:
        """One chunk per row, padded to the longest of its length group."""
        out: list[torch.Tensor | None] = [None] * len(chunk_ids)
        pad_id = self.tokenizer.pad_token_id or 0
        for group in length_groups([len(c) for c in chunk_ids], self.call_overhead, self.chunk_batch_tokens):
            L = len(chunk_ids[group[-1]])
            ids = torch.full((len(group), L), pad_id, dtype=torch.long)  # [c L]
            att = torch.zeros(len(group), L, dtype=torch.long)  # [c L]
            for r, k in enumerate(group):
                ids[r, : len(chunk_ids[k])] = torch.tensor(chunk_ids[k])
                att[r, : len(chunk_ids[k])] = 1
            # without padding in the group the all-ones mask changes nothing; leaving it out skips building it
            hs = self._encode_rows(ids, att if len(chunk_ids[group[0]]) < L else None)  # [c L depth emb]
            for r, k in enumerate(group):
                out[k] = hs[r, : len(chunk_ids[k])]
        return [o for o in out if o is not None]

    def _run_packed(self, chunk_ids: list[list[int]]) -> list[torch.Tensor]:
        """Chunks packed into rows (see :func:`~service.modeling.grouping.pack_rows`), each chunk attending
        only to itself with its own positions 0, 1, ...; a row's unused tail attends only to itself."""
        lengths = [len(c) for c in chunk_ids]
        L, rows = pack_rows(lengths, self.row_limit, self.d_emb)
        out: list[torch.Tensor | None] = [None] * len(chunk_ids)
        per_call = max(1, self.chunk_batch_tokens // L)
        pad_id = self.tokenizer.pad_token_id or 0
        arange = np.arange(L)  # [L]
        for first in range(0, len(rows), per_call):
            call = rows[first : first + per_call]
            # built in numpy: three torch calls per chunk took 1.1 ms a batch of 32 on a 2-core CPU, numpy 0.4 ms
            ids = np.full((len(call), L), pad_id, dtype=np.int64)  # [r L]
            pos = np.zeros((len(call), L), dtype=np.int64)  # [r L] position within its chunk
            seg = np.full((len(call), L), -1, dtype=np.int64)  # [r L] which chunk of the row; -1 the tail
            for r, row in enumerate(call):
                start = 0
                for s, k in enumerate(row):
                    ids[r, start : start + lengths[k]] = chunk_ids[k]
                    pos[r, start : start + lengths[k]] = arange[: lengths[k]]
                    seg[r, start : start + lengths[k]] = s
                    start += lengths[k]
            if bool((seg == 0).all()):  # one whole chunk per row: nothing to mask, positions as usual
                hs = self._encode_rows(torch.from_numpy(ids), None)  # [r L depth emb]
            else:
                mask = torch.from_numpy(seg[:, None, :, None] == seg[:, None, None, :])  # [r 1 L L] True: attends
                hs = self._encode_rows(torch.from_numpy(ids), mask, torch.from_numpy(pos))  # [r L depth emb]
            for r, row in enumerate(call):
                start = 0
                for k in row:
                    out[k] = hs[r, start : start + lengths[k]]  # [L_c depth emb]
                    start += lengths[k]
        return [o for o in out if o is not None]

    def _stream_agrees(self, stream: PackedEncoder) -> bool:
        """Whether ``stream`` gives what the Hugging Face module gives for chunks of two lengths, side by side
        (within the dtype's rounding)."""
        chunks = [[i % self.encoder.config.vocab_size for i in self.chunker.prefix + ids + self.chunker.suffix]
                  for ids in ([1000, 1001, 1002], [1003, 1004])]
        lengths = np.array([len(c) for c in chunks])
        try:
            with torch.inference_mode():
                alone = [self._run_grouped([c])[0] for c in chunks]  # per chunk [L_c depth emb]
                packed = stream(pack(np.concatenate(chunks), lengths, self.device)).split(lengths.tolist())
        except (TypeError, ValueError, RuntimeError):
            return False
        # relative to the states' norm: in half precision single elements differ by more than their rounding where
        # the two compute in another order (one projection for query, key and value), the whole by about 1e-3
        tol = 1e-5 if self.dtype == torch.float32 else 2e-2
        return all(float((a - b).float().norm() / b.float().norm()) <= tol for a, b in zip(alone, packed, strict=True))

    def _packing_agrees(self) -> bool:
        """Whether two chunks packed in one row give what each gives alone (within the dtype's rounding)."""
        chunks = [self.chunker.prefix + ids + self.chunker.suffix
                  for ids in ([1000, 1001, 1002], [1003, 1004])]
        chunks = [[i % self.encoder.config.vocab_size for i in c] for c in chunks]
        try:
            with torch.inference_mode():
                alone = [self._run_grouped([c])[0] for c in chunks]  # per chunk [L_c depth emb]
                # the joined chunk, longest, sets the row length: the two share the next row
                packed = self._run_packed([*chunks, chunks[0] + chunks[1]])[:2]  # per chunk [L_c depth emb]
        except (TypeError, ValueError, RuntimeError):
            return False
        tol = 1e-4 if self.dtype == torch.float32 else 3e-2
        return all(bool(torch.allclose(a, b, atol=tol, rtol=tol)) for a, b in zip(alone, packed, strict=True))
