"""A backbone group's planning, without torch: the models' manifests and the backbone's tokenizer, which cut texts
into the batcher's units of work. What computes them is elsewhere (:mod:`service.serving.engine.compute`: in this
process, in a process of its own, or on the engine host behind the fronts); a front plans with a planner alone."""

from __future__ import annotations

from collections.abc import Sequence

from service.modeling.encoding import Encoding, Truncation
from service.modeling.manifest import Manifest
from service.modeling.tokenizer import ChunkTokenizer
from service.serving.core.keys import backbone_key, group_name
from service.serving.core.results import TokenSpan
from service.serving.core.work import Ask, ChunkWork, CreditSpec, Task, TextJob, TokenIds


class Planner:
    """A backbone and its heads as a front plans with them: the models' manifests and the backbone's tokenizer,
    which cut texts into the batcher's units of work (:class:`~service.serving.core.work.ChunkWork`).

    Heads share a text's encoder pass when they cut it into the same chunks: always when their
    ``max_length`` is the same, and for a text that fits in one chunk of the shorter one otherwise.
    """

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
        """The keys of the heads loaded (see :func:`~service.serving.core.keys.head_key`)."""
        return list(self.manifests)

    def add(self, manifests: dict[str, Manifest]) -> None:
        """Plan for heads loaded at runtime too (``manifests``: by key), once the backbone has taken them."""
        other = sorted({backbone_key(m) for m in manifests.values()} - {self.key})
        if other:
            raise ValueError(f"backbone {self.name} cannot take heads of backbone {other}")
        self.manifests = {**self.manifests, **manifests}  # a new dict: readers on other threads see one or the other

    def remove(self, keys: Sequence[str]) -> None:
        """Plan for heads dropped at runtime no more."""
        self.manifests = {k: m for k, m in self.manifests.items() if k not in keys}
        if self.default not in self.manifests and self.manifests:
            self.default = next(iter(self.manifests))

    def labels(self, model: str) -> list[str]:
        return self.manifests[model].labels

    def max_length(self, model: str) -> int:
        """Tokens per chunk for ``model`` (its manifest's, capped at the backbone's limit)."""
        return self.chunker.cut(self.manifests[model].max_length)

    def encode(self, texts: list[str], models: Sequence[str], truncation: Truncation | None = None,
               spans: bool = True) -> list[dict[int, Encoding]]:
        """Tokenize ``texts`` once and cut each for every chunk length the ``models`` use (see
        :meth:`ChunkTokenizer.encode_lengths`; ``truncation``: to one chunk each; without ``spans``, the token ids
        alone, enough where no credit is asked): per text, chunk length -> encoding."""
        return self.chunker.encode_lengths(texts, [self.max_length(m) for m in models], truncation, spans)

    def encode_ids(self, ids: TokenIds, models: Sequence[str], truncation: Truncation | None = None
                   ) -> list[dict[int, Encoding]]:
        """Token ids sent in place of texts, each list one chunk for every chunk length the ``models`` use (see
        :meth:`ChunkTokenizer.encode_ids`): per list, chunk length -> encoding."""
        return self.chunker.encode_ids(ids.ids, [self.max_length(m) for m in models], truncation)

    def tokens(self, encoding: Encoding) -> list[TokenSpan]:
        """The positions of ``encoding`` as a response shows them (special tokens included)."""
        names = self.chunker.token_names(encoding)
        return [TokenSpan(t, s, e, sp) for t, (s, e), sp in zip(names, encoding.offsets, encoding.special, strict=True)]

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
        spans = any(tasks[k].credit is not None for k in missing)  # the ids alone where no credit is asked
        fresh = iter(self.encode([tasks[k].text for k in missing], [models[k] for k in missing], spans=spans)
                     if missing else [])
        plans = []
        asks: dict[tuple[str, CreditSpec | None], tuple[Ask]] = {}  # one Ask for every text asking the same
        for t, model in zip(tasks, models, strict=True):
            enc = t.encoding if t.encoding is not None else next(fresh)[self.max_length(model)]
            ask = asks.get((model, t.credit)) or asks.setdefault((model, t.credit), (Ask(model, t.credit),))
            plans.append(TextJob.of(enc, ask).chunks())
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
