"""Training settings, without torch (the CLI reads their defaults before any model code loads)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal


@dataclass
class TrainConfig:
    """How a head is trained (see ``service.training.trainer``)."""

    steps: int = 1200  # optimizer steps at least, whatever the dataset's size (``epochs`` instead, when given)
    min_epochs: int = 5  # and at least this many epochs' worth of steps: a large dataset's budget grows with it
    epochs: int | None = None
    warmup_steps: int = 60  # one-cycle warm-up (at most 30% of the steps)
    eval_every: int = 200  # validate every epoch, or every this many steps if an epoch is longer
    patience: int = 5  # stop after this many validations without a better checkpoint (0: never stop early)
    select: Literal["loss", "accuracy"] = "loss"  # the checkpoint kept: lowest validation loss, or best accuracy
    batch_size: int = 32
    max_batch_positions: int = 8192  # padded token positions per batch: bounds memory for long texts
    max_lr: float = 1e-3
    mixup_alpha: float = 0.65
    ema: float = 0.995  # validate and keep an exponential moving average of the weights with this decay (0: off)
    crop: float = 1.0  # train on a random window of at least this fraction of each text (1: whole texts)
    seed: int = 0
    threads: int | None = None
    extend: bool = True  # a budget that ended with validation still improving: train on from there as long again

    def scaled(self, factor: int) -> TrainConfig:
        """The same settings with the budget times ``factor``: both its floors (``steps`` and ``min_epochs``, so a
        large dataset's budget grows too), or ``epochs`` when training by epochs."""
        budget = ({"epochs": self.epochs * factor} if self.epochs else
                  {"steps": self.steps * factor, "min_epochs": self.min_epochs * factor})
        return replace(self, **budget)
