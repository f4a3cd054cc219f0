"""A backbone group as the server's front sees it, without torch: the models' manifests and the backbone's
tokenizer, which cut texts into the batcher's units of work. ``Engine`` (``service.serving.engine``) runs
them in this process, ``BackboneProcess`` (``service.serving.worker``) in a process of its own."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from service.modeling.encoding import Encoding
from service.modeling.manifest import Manifest
from service.modeling.tokenizer import ChunkTokenizer
from service.serving.contract import Answer, Ask, ChunkWork, CreditSpec, Task, TextJob, Token


def backbone_key(manifest: Manifest) -> tuple[str, str]:
    """What makes two models share a loaded backbone: the same source and revision (device and dtype are
    the server's, the same for every model)."""
    return manifest.backbone.source, manifest.backbone.revision


def head_key(name: str, generation: int = 0) -> str:
    """A loaded head's key: the model's name, and ``name#n`` for its n-th reload (the old head answers what was
    accepted before the reload while the new one takes what comes after, both on the same backbone)."""
    return name if generation == 0 else f"{name}#{generation}"


def model_of(key: str) -> str:
    """The model's name of a head's key (names never hold ``#``: see the manifest's pattern)."""
    return key.partition("#")[0]


def group_name(manifest: Manifest) -> str:
    """The backbone group's name in logs and metrics."""
    return f"{manifest.backbone.name}@{manifest.backbone.revision}"


class Planner(abc.ABC):
    """A backbone and its heads as the server's front sees them: the models' manifests and the backbone's
    tokenizer, which cut texts into the batcher's units of work. :class:`Engine` runs them in this process,
    ``BackboneProcess`` (``service.serving.worker``) in a process of its own; both add ``run_chunks``,
    ``describe``, ``device_memory`` and ``close``.

    Heads share a text's encoder pass when they cut it into the same chunks: always when their
    ``max_length`` is the same, and for a text that fits in one chunk of the shorter one otherwise.
    """

    device: Any  # where the heads compute (``torch.device`` here, its name for a process of its own)
    dtype: Any

    def __init__(self, manifests: Sequence[Manifest], chunker: ChunkTokenizer, keys: Sequence[str] | None = None
                 ) -> None:
        if not manifests:
            raise ValueError("a backbone needs at least one model")
        backbones = {backbone_key(m) for m in manifests}
        if len(backbones) > 1:
            raise ValueError(f"models on one backbone must name the same backbone, not {sorted(backbones)}")
        self.key = backbone_key(manifests[0])
        self.manifests = dict(zip(keys or [m.name for m in manifests], manifests, strict=True))  # head key -> manifest
        self.chunker = chunker
        self.name = group_name(manifests[0])
        self.default = next(iter(self.manifests))  # the head of a task that names none

    @property
    def models(self) -> list[str]:
        """The keys of the heads loaded (see :func:`head_key`)."""
        return list(self.manifests)

    def _added(self, manifests: dict[str, Manifest]) -> None:
        """Heads loaded at runtime (``manifests``: by key), after the backbone took them."""
        other = sorted({backbone_key(m) for m in manifests.values()} - {self.key})
        if other:
            raise ValueError(f"backbone {self.name} cannot take heads of backbone {other}")
        self.manifests = {**self.manifests, **manifests}  # a new dict: readers on other threads see one or the other

    def _removed(self, keys: Sequence[str]) -> None:
        """Heads dropped at runtime."""
        self.manifests = {k: m for k, m in self.manifests.items() if k not in keys}
        if self.default not in self.manifests and self.manifests:
            self.default = next(iter(self.manifests))

    @abc.abstractmethod
    def add_heads(self, folders: Sequence[Path], keys: Sequence[str], warmup: bool = True) -> None:
        """Load the heads of ``folders`` (models naming this backbone) onto it under ``keys``: all or none, while
        batches go on.

        Raises:
            ModelLoadError: a folder is damaged or names another backbone.
            NonFiniteScores, ModelProcessError: a head failed its warm-up, or the backbone's process failed.
        """

    @abc.abstractmethod
    def remove_heads(self, keys: Sequence[str]) -> None:
        """Drop these heads (the caller has answered all their work); their memory goes with them."""

    def labels(self, model: str) -> list[str]:
        return self.manifests[model].labels

    def credit_methods(self, model: str) -> list[str]:
        """The credit methods ``model`` answers (see :meth:`describe`)."""
        return self.describe(model)["credit_methods"]  # type: ignore[attr-defined, no-any-return]

    def max_length(self, model: str) -> int:
        """Tokens per chunk for ``model`` (its manifest's, capped at the backbone's limit)."""
        return self.chunker.cut(self.manifests[model].max_length)

    def encode(self, texts: list[str], models: Sequence[str]) -> list[dict[int, Encoding]]:
        """Tokenize ``texts`` once and cut each for every chunk length the ``models`` use (see
        :meth:`ChunkTokenizer.encode_lengths`): per text, chunk length -> encoding."""
        return self.chunker.encode_lengths(texts, [self.max_length(m) for m in models])

    def tokens(self, encoding: Encoding) -> list[Token]:
        """The positions of ``encoding`` as a response shows them (special tokens included)."""
        names = self.chunker.token_names(encoding)
        return [Token(t, s, e, sp) for t, (s, e), sp in zip(names, encoding.offsets, encoding.special, strict=True)]

    def jobs(self, encodings: dict[int, Encoding], asks: Sequence[Ask]) -> list[TextJob]:
        """One text's jobs: its asks grouped by the chunks their heads cut it into (one job, one encoder pass,
        for heads that cut it alike), in the order of each group's first ask."""
        groups: dict[tuple[tuple[int, ...], ...], tuple[Encoding, list[Ask]]] = {}  # chunks -> encoding, asks
        for ask in asks:
            enc = encodings[self.max_length(ask.model or self.default)]
            groups.setdefault(enc.chunks, (enc, []))[1].append(ask)
        return [TextJob.of(enc, group) for enc, group in groups.values()]

    def plan(self, tasks: list[Task]) -> list[list[ChunkWork]]:
        """Each single-head task's chunks as units of work for the batcher (texts not yet tokenized are
        tokenized here, once for all of them)."""
        models = [t.model or self.default for t in tasks]
        unknown = sorted(set(models) - set(self.manifests))
        if unknown:
            raise KeyError(f"no model {unknown} on backbone {self.name} (it has {self.models})")
        missing = [k for k, t in enumerate(tasks) if t.encoding is None]
        fresh = iter(self.encode([tasks[k].text for k in missing], [models[k] for k in missing]) if missing else [])
        plans = []
        for t, model in zip(tasks, models, strict=True):
            enc = t.encoding if t.encoding is not None else next(fresh)[self.max_length(model)]
            plans.append(TextJob.of(enc, [Ask(model, t.credit)]).chunks())
        return plans

    def explain_elements(self, model: str, n_tokens: int, spec: CreditSpec) -> int:
        """How many numbers the full matrix and the phis add for a text of ``n_tokens`` on ``model``."""
        m = self.manifests[model]
        n_hid, n_k = m.head.n_hid, len(m.labels)
        n_i = n_tokens * m.backbone.d_depth
        total = n_i * n_k if spec.matrix else 0
        if spec.phi:
            total += n_i * n_hid + n_hid * n_hid + n_hid * n_k
        return total

    @abc.abstractmethod
    def run_chunks(self, works: list[ChunkWork]) -> list[Answer | None]:
        """Compute a batch of chunks; each text completed in it is answered at its last chunk's place."""

    @property
    def runner_devices(self) -> list[str]:
        """The device each of :attr:`runners` computes on."""
        return [str(self.device)]

    @property
    def runners(self) -> list[Callable[[list[ChunkWork]], list[Answer | None]]]:
        """What computes batches, one batch at a time each: the batcher sends each batch to a free one and
        keeps a text's chunks on one (it holds their states until the last)."""
        return [self.run_chunks]

    def resident_bytes(self) -> int | None:
        """Resident memory of the backbone's own processes (None: it computes in the server's process)."""
        return None

    def restarts(self) -> int:
        """Times the backbone's own processes were started again after exiting (0: it computes in the server's
        process)."""
        return 0

    @abc.abstractmethod
    def describe(self, model: str) -> dict[str, Any]:
        """What ``/v1/models`` says of ``model``."""

    @abc.abstractmethod
    def device_memory(self) -> list[dict[str, float | str]]:
        """CUDA memory of the devices this backbone's process uses (empty on CPU)."""

    def close(self) -> None:  # noqa: B027 (nothing to release unless a subclass holds more)
        """Release what the backbone holds beyond this object (a process of its own)."""
