"""``train --search``: a small grid of training settings around the given ones, every point trained from the same
seeded initial weights and judged on the validation split alone (the test split is never read), the best kept.

The grid multiplies the learning rate (x0.5, x1, x2) and the step budget (x1, x3: both its floors, ``steps`` and
``min_epochs``, or ``epochs`` when training by epochs), and tries whole texts against random windows of at least
60% of each (crop): twelve trainings. The point kept is the one whose checkpoint scored best by the training's own
rule (lowest validation loss by default).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from tqdm import tqdm

from service.modeling.head import RoutingHead
from service.training.config import TrainConfig
from service.training.features import Features
from service.training.trainer import improves, train_head

LR_FACTORS = (0.5, 1.0, 2.0)
BUDGET_FACTORS = (1, 3)
CROPS = (1.0, 0.6)


def grid(cfg: TrainConfig) -> list[TrainConfig]:
    """The settings tried, ``cfg`` itself first (its crop replaced by each of :data:`CROPS`)."""
    points = []
    for budget, lr, crop in itertools.product(BUDGET_FACTORS, LR_FACTORS, CROPS):
        points.append(replace(cfg.scaled(budget), max_lr=cfg.max_lr * lr, crop=crop))
    points.sort(key=lambda c: (c.max_lr, c.steps, c.epochs, c.crop) != (cfg.max_lr, cfg.steps, cfg.epochs, cfg.crop))
    return points


def search(make_head: Callable[[], RoutingHead], train: Features, y_train: list[int], val: Features, y_val: list[int],
           cfg: TrainConfig, device: torch.device | str = "cpu") -> tuple[RoutingHead, dict[str, Any]]:
    """Train a head (each from ``make_head()``, on ``device``) at every point of :func:`grid`, each to its own budget
    (no extension: the grid's longer budgets are the extension); the best by validation, and its training summary
    with ``search``: every point's settings and validation scores, and which was kept."""
    points = grid(cfg)
    tried: list[dict[str, Any]] = []
    best: tuple[int, RoutingHead, dict[str, Any]] | None = None
    t0 = time.time()
    for k, point in enumerate(points, 1):
        budget = f"{point.epochs} epochs" if point.epochs else f"{point.steps} steps"
        print(f"search {k}/{len(points)}: max_lr {point.max_lr:g}, {budget}, crop {point.crop:g}", flush=True)
        head, summary = train_head(make_head(), train, y_train, val, y_val, replace(point, extend=False), device)
        tried.append({"max_lr": point.max_lr, "steps": summary["steps"], "epochs": point.epochs, "crop": point.crop,
                      "best_val_loss": summary["best_val_loss"], "best_val_accuracy": summary["best_val_accuracy"],
                      "best_step": summary["best_step"], "train_seconds": summary["train_seconds"]})
        better = best is None or improves(summary["best_val_accuracy"], summary["best_val_loss"],
                                          (best[2]["best_val_accuracy"], best[2]["best_val_loss"]), cfg.select)
        if better:
            best = (k - 1, head, summary)
        print(f"search {k}/{len(points)}: validation loss {summary['best_val_loss']:.4f}, accuracy "
              f"{summary['best_val_accuracy']:.4f}{' (the best so far)' if better else ''}; "
              f"{tqdm.format_interval(time.time() - t0)} since the search began", flush=True)
    assert best is not None
    kept, head, summary = best
    print(f"search: kept point {kept + 1} (max_lr {tried[kept]['max_lr']:g}, crop {tried[kept]['crop']:g}; "
          f"validation loss {summary['best_val_loss']:.4f}, accuracy {summary['best_val_accuracy']:.4f})", flush=True)
    rule = "lowest validation loss" if cfg.select == "loss" else "best validation accuracy"
    return head, {**summary, "search": {"rule": rule, "kept": kept, "tried": tried}}
