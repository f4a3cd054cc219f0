"""A text tokenized once and cut into chunks (no torch): what the batcher budgets and the encoder runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Encoding:
    """One text tokenized once and cut into chunks: what the batcher budgets and the encoder runs.

    Attributes:
        chunks: token ids of each chunk, the tokenizer's special tokens around each.
        offsets: ``(start, end)`` character span of each token of the joined chunks ((0, 0) for specials).
        special: True at special tokens.
        word_ids: index of the word each token belongs to (-1 for specials).
    """

    chunks: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, int], ...]
    special: tuple[bool, ...]
    word_ids: tuple[int, ...]

    @classmethod
    def of_chunks(cls, chunks: tuple[tuple[int, ...], ...]) -> Encoding:
        """The token ids alone, as a process that only computes receives them (the engine reads nothing else): the
        spans, special tokens and words stay with the front that tokenized the text (empty here)."""
        return cls(chunks, (), (), ())

    @property
    def bare(self) -> bool:
        """Whether it holds the token ids alone (see :meth:`of_chunks`)."""
        return not (self.offsets or self.special or self.word_ids)

    @property
    def n_tokens(self) -> int:
        """Positions the text takes in the head (special tokens of every chunk included)."""
        return sum(map(len, self.chunks))


@dataclass(frozen=True)
class Truncation:
    """Cut a text to one chunk instead of chunking it whole: keep its first tokens (``side="right"``: the end is cut
    off) or its last (``"left"``), at most ``tokens`` positions with the special tokens (None: a model's chunk
    length)."""

    side: Literal["right", "left"] = "right"
    tokens: int | None = None


@dataclass(frozen=True)
class Token:
    """One token of a text its tokenizer read whole (not cut into chunks), as a tokenize request answers it.

    Attributes:
        id: the token's id in the vocabulary.
        piece: the token as the vocabulary spells it (``"[CLS]"``, ``"##ing"``).
        span: its ``(start, end)`` character span in the text; None for a special token.
    """

    id: int
    piece: str
    span: tuple[int, int] | None

    @property
    def special(self) -> bool:
        """Whether the tokenizer added it (``[CLS]``, ``[SEP]``): it stands for no characters of the text."""
        return self.span is None

