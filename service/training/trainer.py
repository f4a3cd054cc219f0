"""Training a routing head on frozen-backbone features with the paper's recipe (RAdam, one-cycle
learning rate with max 1e-3, mixup of hidden states with Beta(0.65, 0.65)), and evaluating it
against logistic-regression probes on the same features.

The defaults train to a budget of optimizer steps, not epochs: at least ``steps``, so a small dataset is seen
as many times as it takes (five epochs of 2,400 texts were 380 steps, too few to fit), and at least
``min_epochs`` epochs' worth, so a large one is seen more than once. The one-cycle warm-up is short and fixed in
steps. What validates, and what is kept, is an exponential moving average of the weights (``ema``: its
validation loss is smoother than the weights' own, so early stopping is not set off by one noisy validation).
Validation runs every epoch (at most every ``eval_every`` steps), and training stops once the validation loss
has not improved for ``patience`` validations, keeping the checkpoint of the lowest."""

from __future__ import annotations

import math
import random
import time
from typing import Any, Literal, cast

import numpy as np
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from tqdm import tqdm

from service.modeling.head import RoutingHead
from service.training.config import TrainConfig
from service.training.features import Features, pad_batch
from service.training.progress import progress

__all__ = ["TrainConfig", "Training", "train_head"]


def budget_batches(order: list[int], lengths: torch.Tensor, batch_size: int, max_positions: int) -> list[list[int]]:
    """Cut ``order`` into consecutive batches of at most ``batch_size`` texts and ``max_positions``
    padded positions (a single longer text still makes a batch of its own)."""
    batches: list[list[int]] = []
    current: list[int] = []
    widest = 0
    for k in order:
        w = max(widest, int(lengths[k]))
        if current and (len(current) >= batch_size or w * (len(current) + 1) > max_positions):
            batches.append(current)
            current, w = [], int(lengths[k])
        current.append(k)
        widest = w
    if current:
        batches.append(current)
    return batches


def length_batches(lengths: torch.Tensor, batch_size: int, max_positions: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of texts of similar length (sorted within shuffled pools of 50 batches)."""
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    pool = batch_size * 50
    batches = []
    for s in range(0, len(idx), pool):
        chunk = sorted(idx[s : s + pool], key=lambda k: int(lengths[k]))
        batches += budget_batches(chunk, lengths, batch_size, max_positions)
    rng.shuffle(batches)
    return batches


def random_spans(lengths: list[int], min_fraction: float, rng: random.Random) -> list[tuple[int, int]]:
    """A random contiguous window ``(start, end)`` of each text, covering at least ``min_fraction`` of
    its ``n`` positions (and at least one)."""
    spans = []
    for n in lengths:
        width = rng.randint(max(1, math.ceil(min_fraction * n)), n)
        start = rng.randint(0, n - width)
        spans.append((start, start + width))
    return spans


def mixup(hidden: torch.Tensor, pad: torch.Tensor, y: torch.Tensor, alpha: float,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mix each sample's hidden states ``[b, n, e, d]`` and one-hot targets ``[b, k]`` with a partner's."""
    b = hidden.shape[0]
    lam = torch.distributions.Beta(alpha, alpha).sample((b,)).to(hidden.device)  # [b]
    perm = torch.randperm(b, generator=gen).to(hidden.device)  # [b]
    lam_h = lam[:, None, None, None]  # [b111]
    mixed = lam_h * hidden + (1 - lam_h) * hidden[perm]  # [bned]
    mixed_pad = pad & pad[perm]  # [bn] padding only where both are padding
    mixed_y = lam[:, None] * y + (1 - lam[:, None]) * y[perm]  # [bk]
    return mixed, mixed_pad, mixed_y


@torch.no_grad()
def predict_features(head: RoutingHead, feats: Features, batch_size: int = 64, max_positions: int = 16384,
                     device: torch.device | None = None, multi_label: bool = False) -> np.ndarray:
    """Class probabilities ``[T, k]`` for cached features (a softmax; ``multi_label``: a sigmoid each), computed on
    ``device`` (default: where ``head`` is)."""
    head.eval()
    device = device or next(head.parameters()).device
    lengths = feats.lengths()
    order = sorted(range(len(feats)), key=lambda k: int(lengths[k]))
    probs = np.zeros((len(feats), head.n_classes), dtype=np.float32)
    for idx in budget_batches(order, lengths, batch_size, max_positions):
        hidden, pad = pad_batch(feats, idx)  # [b n e d], [b n]
        scores = head(hidden.to(device), pad.to(device)).scores  # [b k]
        probs[idx] = (scores.sigmoid() if multi_label else scores.softmax(-1)).cpu().numpy()  # [b k]
    return probs


def validation_scores(probs: np.ndarray, y: list[int]) -> tuple[float, float]:
    """Accuracy and mean negative log-likelihood of class probabilities ``[T, k]``."""
    y_arr = np.asarray(y)
    p_true = probs[np.arange(len(y_arr)), y_arr]  # [T]
    return float((probs.argmax(1) == y_arr).mean()), float(-np.log(np.clip(p_true, 1e-12, None)).mean())


def multi_label_scores(probs: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Micro-F1 at a threshold of 0.5 and mean binary cross-entropy (per text and label) of probabilities ``[T, k]``
    against multi-hot targets ``y [T, k]``."""
    p = np.clip(probs, 1e-7, 1 - 1e-7)
    loss = float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())
    return f1_scores(y, probs >= 0.5)["micro_f1"], loss


def f1_scores(y: np.ndarray, predicted: np.ndarray) -> dict[str, Any]:
    """Micro- and macro-F1 of multi-label predictions ``[T, k]`` (bool) against targets ``y [T, k]``, each label's
    F1, and the share of texts whose labels are all right."""
    y, predicted = y.astype(bool), predicted.astype(bool)
    tp, fp, fn = ((y & predicted).sum(0), (~y & predicted).sum(0), (y & ~predicted).sum(0))  # [k] each
    per_label = [0.0 if t == 0 else float(2 * t / (2 * t + f + n)) for t, f, n in zip(tp, fp, fn, strict=True)]
    micro = 0.0 if tp.sum() == 0 else float(2 * tp.sum() / (2 * tp.sum() + fp.sum() + fn.sum()))
    return {"n": len(y), "micro_f1": micro, "macro_f1": float(np.mean(per_label)), "per_label_f1": per_label,
            "exact_match": float((y == predicted).all(1).mean())}


THRESHOLDS = np.round(np.arange(0.05, 0.96, 0.05), 2)
"""The thresholds a multi-label model's labels are chosen among (on validation)."""


def choose_thresholds(probs: np.ndarray, y: np.ndarray) -> list[float]:
    """Each label's threshold of :data:`THRESHOLDS` with the best F1 on ``probs [T, k]`` against ``y [T, k]`` (the
    middle one of equals), the threshold over which the label is predicted."""
    chosen = []
    for k in range(y.shape[1]):
        f1 = [f1_scores(y[:, k : k + 1], probs[:, k : k + 1] >= t)["micro_f1"] for t in THRESHOLDS]
        best = [t for t, f in zip(THRESHOLDS, f1, strict=True) if f == max(f1)]
        chosen.append(float(best[len(best) // 2]))
    return chosen


def improves(acc: float, loss: float, best: tuple[float, float] | None, select: str = "loss") -> bool:
    """Checkpoint rule: with ``select="loss"`` (the default), lower validation loss wins (accuracy on a small
    validation split moves in steps of one text; the loss moves with every probability), at equal loss higher
    accuracy; with ``"accuracy"`` (the earlier rule), higher accuracy, then lower loss."""
    if best is None:
        return True
    if select == "accuracy":
        return acc > best[0] or (acc == best[0] and loss < best[1])
    return loss < best[1] or (loss == best[1] and acc > best[0])


def time_so_far(t0: float, step: int, steps: int, now: float | None = None) -> str:
    """Time from ``t0`` (the run's start) to ``now`` (default: the present) and, at the pace so far, the most that
    ``steps - step`` more steps take (an early stop ends sooner), as a validation line prints them."""
    elapsed = (time.time() if now is None else now) - t0
    left = elapsed / max(step, 1) * (steps - step)
    return f"{tqdm.format_interval(elapsed)} elapsed, at most {tqdm.format_interval(left)} left"


def step_plan(lengths: torch.Tensor, cfg: TrainConfig, rng: random.Random) -> list[list[list[int]]]:
    """The batches of each epoch: ``cfg.epochs`` whole epochs, or epochs until a budget of ``cfg.steps`` batches
    or ``cfg.min_epochs`` epochs' worth, whichever is more (the last epoch cut short)."""
    if not len(lengths):
        raise ValueError("no training texts")
    plan: list[list[list[int]]] = []
    total, budget = 0, cfg.steps
    while (len(plan) < cfg.epochs) if cfg.epochs else (total < budget):
        batches = length_batches(lengths, cfg.batch_size, cfg.max_batch_positions, rng)
        if not cfg.epochs:
            if not plan:  # a large dataset's budget grows with it
                budget = max(cfg.steps, cfg.min_epochs * len(batches))
            batches = batches[: budget - total]
        plan.append(batches)
        total += len(batches)
    return plan


class Training:
    """One head's training: one-cycle schedules run one after another on the same weights, optimizer state and moving
    average, validated as they go; the best checkpoint of all of them is kept (see :func:`train_head`)."""

    def __init__(self, head: RoutingHead, train: Features, y_train: list[int] | np.ndarray, val: Features,
                 y_val: list[int] | np.ndarray, cfg: TrainConfig, device: torch.device) -> None:
        self.head, self.train, self.val, self.y_val, self.cfg, self.device = head, train, val, y_val, cfg, device
        self.multi_label = isinstance(y_train, np.ndarray)  # multi-hot targets: a sigmoid per label
        self.rng = random.Random(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.y_all = (torch.as_tensor(y_train, dtype=torch.float32) if isinstance(y_train, np.ndarray) else
                      nn.functional.one_hot(torch.tensor(y_train), head.n_classes).float())  # [T k]
        self.lengths = train.lengths()  # [T]
        self.opt = torch.optim.RAdam(head.parameters(), lr=cfg.max_lr)
        # the weights validated and kept: the trained ones, or their exponential moving average
        self.averaged = (AveragedModel(head, multi_avg_fn=get_ema_multi_avg_fn(cfg.ema), use_buffers=True)
                         if cfg.ema else None)
        self.validated = cast(RoutingHead, self.averaged.module) if self.averaged is not None else head
        self.best: tuple[float, float] | None = None
        self.best_state: dict[str, torch.Tensor] | None = None
        self.best_step = self.best_epoch = self.since_best = self.step = self.epoch = self.validations = 0
        self.planned = 0  # steps of every schedule begun so far
        self.history: list[dict[str, float]] = []  # every validation
        self.t0 = time.time()

    def schedule(self, plan: list[list[list[int]]], hold: float = 0.0) -> bool:
        """Train through ``plan`` (each epoch's batches) under one one-cycle learning rate, validating every epoch (at
        most every ``eval_every`` steps); True when it stopped early (``patience`` validations without a better
        checkpoint), which it does not in the first ``hold`` share of its steps."""
        cfg = self.cfg
        steps = sum(len(b) for b in plan)
        self.planned += steps
        held_until = self.step + hold * steps
        sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=cfg.max_lr, total_steps=steps + 1,
                                                    pct_start=min(0.3, cfg.warmup_steps / steps))
        for batches in plan:
            self.epoch += 1
            self.head.train()
            for part in (batches[k : k + cfg.eval_every] for k in range(0, len(batches), cfg.eval_every)):
                train_loss = self._steps(part, sched)  # train on a part of the epoch, then validate
                if self._validate(train_loss, may_stop=self.step >= held_until):
                    return True
        return False

    def _steps(self, part: list[list[int]], sched: torch.optim.lr_scheduler.LRScheduler) -> float:
        """One optimizer step per batch of ``part``; their mean training loss."""
        cfg, dev = self.cfg, self.device
        bar = progress(part, desc=f"epoch {self.epoch}, steps {self.step + 1}-{self.step + len(part)} of "
                                  f"{self.planned}", unit="batch")
        total = torch.zeros((), device=dev)  # []
        for n, idx in enumerate(bar, 1):
            spans = random_spans([int(self.lengths[k]) for k in idx], cfg.crop, self.rng) if cfg.crop < 1 else None
            hidden, pad = pad_batch(self.train, idx, spans)  # [b n e d], [b n]
            hidden, pad, y = hidden.to(dev), pad.to(dev), self.y_all[idx].to(dev)  # [b n e d], [b n], [b k]
            hidden, pad, y = mixup(hidden, pad, y, cfg.mixup_alpha, self.gen)
            scores = self.head(hidden, pad).scores  # [b k]
            loss = (nn.functional.binary_cross_entropy_with_logits(scores, y) if self.multi_label else
                    -(y * scores.log_softmax(-1)).sum(-1).mean())  # []
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            sched.step()
            if self.averaged is not None:
                self.averaged.update_parameters(self.head)
            total += loss.detach()
            if n % 16 == 0 or n == len(part):  # a device waits for the host only now and then
                bar.set_postfix(loss=f"{total.item() / n:.4f}", lr=f"{sched.get_last_lr()[0]:.2e}", refresh=False)
        self.step += len(part)
        return total.item() / len(part)

    def _validate(self, train_loss: float, may_stop: bool = True) -> bool:
        """Validate the current weights (or their average), keep them when :func:`improves` says so; True when
        ``patience`` validations in a row have not improved (and ``may_stop``)."""
        cfg = self.cfg
        probs = predict_features(self.validated, self.val, device=self.device, multi_label=self.multi_label)
        if isinstance(self.y_val, np.ndarray):
            acc, val_loss = multi_label_scores(probs, self.y_val)
        else:
            acc, val_loss = validation_scores(probs, self.y_val)
        what = "val_micro_f1" if self.multi_label else "val_accuracy"  # micro-F1 at 0.5 where labels are several
        self.validations += 1
        self.head.train()
        self.history.append({"epoch": self.epoch, "step": self.step, "train_loss": train_loss, what: acc,
                             "val_loss": val_loss})
        print(f"step {self.step}/{self.planned} (epoch {self.epoch}): train loss {train_loss:.4f}, validation "
              f"{what.removeprefix('val_').replace('_', '-')} {acc:.4f}, validation loss {val_loss:.4f}; "
              f"{time_so_far(self.t0, self.step, self.planned)}", flush=True)
        if improves(acc, val_loss, self.best, cfg.select):
            self.best, self.best_step, self.best_epoch, self.since_best = (acc, val_loss), self.step, self.epoch, 0
            self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in self.validated.state_dict().items()}
            return False
        self.since_best += 1
        if cfg.patience and self.since_best >= cfg.patience and may_stop:
            print(f"early stop: no better validation {cfg.select} for {self.since_best} validations; keeping step "
                  f"{self.best_step}", flush=True)
            return True
        return False

    def still_improving(self, stopped: bool, validations_before: int = 0) -> bool:
        """Whether the last validation was the best of several (of this schedule's): the budget ended before
        validation stopped improving."""
        return not stopped and self.best_step == self.step and self.validations - validations_before > 1


HOLD = 0.5
"""The share of a continued schedule's steps in which it does not stop early (see :func:`train_head`): by then its
learning rate has risen to the peak again and come back to about half of it."""


def train_head(head: RoutingHead, train: Features, y_train: list[int] | np.ndarray, val: Features,
               y_val: list[int] | np.ndarray, cfg: TrainConfig, device: torch.device | str = "cpu"
               ) -> tuple[RoutingHead, dict[str, Any]]:
    """Train ``head`` on ``device`` (features stay on the host; each batch goes over as it is used); return the
    checkpoint chosen by :func:`improves` on validation, on the CPU, and a summary. Labels ``y_train``, ``y_val``:
    each text's class, or multi-hot ``[T, k]`` arrays for a multi-label head (a sigmoid and binary cross-entropy
    per label; validation's "accuracy" is then micro-F1 at 0.5).

    When a step budget (not ``epochs``, a length asked for) ends with validation still improving and ``cfg.extend``,
    training goes on from where it is (the weights, the optimizer's state, the moving average) under a second
    one-cycle schedule of the same budget, and the best checkpoint of both is kept: no step is thrown away. That
    schedule does not stop early in its first half (:data:`HOLD`): its learning rate rises to the peak again, and
    validation worsens for a while before it can improve on the first schedule's end. The summary's ``extended``
    records both schedules."""
    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run = Training(head.to(device), train, y_train, val, y_val, cfg, device)
    plan = step_plan(run.lengths, cfg, run.rng)
    first = sum(len(b) for b in plan)
    stopped = run.schedule(plan)
    still_improving = run.still_improving(stopped)
    schedules = [_schedule_summary(run, first, still_improving)]
    if still_improving and cfg.extend and not cfg.epochs:  # whole epochs: the length asked for
        print(f"validation {cfg.select} was still improving at the last step ({run.step}): training on from here "
              f"under another schedule of {first} steps at most (not stopping early in its first half); the best "
              "checkpoint of both is kept", flush=True)
        before = run.validations
        stopped = run.schedule(step_plan(run.lengths, cfg, run.rng), hold=HOLD)
        still_improving = run.still_improving(stopped, before)
        schedules.append(_schedule_summary(run, run.planned - first, still_improving))
    if still_improving:
        print(f"validation {cfg.select} was still improving at the last step ({run.step})"
              + (f"; a longer budget ({_longer_flag(cfg, run.planned, 2)})"
               f"{'' if run.multi_label else ' or --search'} may train a better head" if not cfg.epochs else ""),
              flush=True)
    assert run.best is not None and run.best_state is not None
    head.load_state_dict(run.best_state)
    summary = {"best_step": run.best_step, "best_epoch": run.best_epoch,
               "best_val_micro_f1" if run.multi_label else "best_val_accuracy": run.best[0],
               "best_val_loss": run.best[1], "steps_run": run.step, "stopped_early": stopped,
               "still_improving": still_improving,
               "train_seconds": round(time.time() - run.t0, 1), "history": run.history, "steps": run.planned,
               "min_epochs": cfg.min_epochs, "epochs": cfg.epochs, "warmup_steps": cfg.warmup_steps,
               "eval_every": cfg.eval_every, "device": str(device),
               "patience": cfg.patience, "checkpoint": f"best validation {cfg.select}", "batch_size": cfg.batch_size,
               "max_batch_positions": cfg.max_batch_positions, "max_lr": cfg.max_lr, "crop": cfg.crop,
               "optimizer": "RAdam", "schedule": "one-cycle", "ema": cfg.ema,
               "mixup": f"Beta({cfg.mixup_alpha}, {cfg.mixup_alpha})", "seed": cfg.seed}
    if len(schedules) > 1:
        kept = "continued" if run.best_step > schedules[0]["steps_run"] else "first"
        summary["extended"] = {"rule": "when a budget ends with validation still improving, training goes on from "
                                       "the current state under a second one-cycle schedule of the same budget, "
                                       f"not stopping early in its first {HOLD:.0%}; the best checkpoint of both is "
                                       "kept",
                               "schedules": schedules, "kept": kept}
        print(f"kept step {run.best_step} ({'of the continued schedule' if kept == 'continued' else 'of the first'}): "
              f"validation loss {run.best[1]:.4f}, accuracy {run.best[0]:.4f}", flush=True)
    return head.cpu().eval(), summary


def _schedule_summary(run: Training, steps: int, still_improving: bool) -> dict[str, Any]:
    """Where one schedule of ``run`` ended: its budget, the steps run so far, the best checkpoint so far."""
    assert run.best is not None
    return {"steps": steps, "steps_run": run.step, "best_step": run.best_step, "best_val_loss": run.best[1],
            "best_val_micro_f1" if run.multi_label else "best_val_accuracy": run.best[0],
            "still_improving": still_improving,
            "train_seconds": round(time.time() - run.t0, 1)}


def _longer_flag(cfg: TrainConfig, steps: int, factor: int) -> str:
    """The command-line flag for ``factor`` times the budget of a run of ``steps`` steps."""
    return f"--epochs {factor * cfg.epochs}" if cfg.epochs else f"--steps {factor * steps}"


def classification_metrics(y_true: list[int], y_pred: np.ndarray, n_classes: int) -> dict[str, Any]:
    """Accuracy, macro-F1 and confusion matrix (rows = true label, columns = predicted)."""
    y = np.asarray(y_true)
    cm = np.zeros((n_classes, n_classes), dtype=int)
    np.add.at(cm, (y, y_pred), 1)
    f1s = []
    for k in range(n_classes):
        tp, fp, fn = cm[k, k], cm[:, k].sum() - cm[k, k], cm[k, :].sum() - cm[k, k]
        f1s.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return {"n": len(y), "accuracy": float((y == y_pred).mean()), "macro_f1": float(np.mean(f1s)),
            "confusion_matrix": cm.tolist()}


def mean_pooled(feats: Features, layers: Literal["last", "all"] = "last") -> np.ndarray:
    """Each text's states averaged over its real positions: the last layer's ``[T, d_emb]``, or every depth's
    concatenated ``[T, d_depth * d_emb]``."""
    rows = []
    for t in range(len(feats)):
        h = feats.get(t).float()  # [n e d]
        rows.append((h[:, -1] if layers == "last" else h.flatten(1)).mean(0).numpy())  # [d] or [e*d]
    return np.stack(rows)


PROBES = {"last": "logistic regression on the mean-pooled last layer (standardised), C tuned on validation",
          "all": "logistic regression on every depth mean-pooled and concatenated (standardised), C tuned on "
                 "validation"}


def logistic_probe(train: Features, y_train: list[int], val: Features, y_val: list[int], test: Features,
                   y_test: list[int], n_classes: int, layers: Literal["last", "all"] = "last") -> dict[str, Any]:
    """A logistic-regression probe on mean-pooled features (see :func:`mean_pooled`), C chosen on validation; its
    test metrics and test predictions."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(mean_pooled(train, layers))
    Xtr, Xva, Xte = (scaler.transform(mean_pooled(f, layers)) for f in (train, val, test))
    best = None
    for C in (0.01, 0.1, 1.0, 10.0):
        clf = LogisticRegression(C=C, max_iter=3000).fit(Xtr, y_train)
        acc = float((clf.predict(Xva) == np.array(y_val)).mean())
        if best is None or acc > best[0]:
            best = (acc, C, clf)
    assert best is not None
    predicted = best[2].predict(Xte)
    return {"method": PROBES[layers], "C": best[1], "val_accuracy": best[0],
            "test": classification_metrics(y_test, predicted, n_classes), "predicted": predicted.tolist()}


MULTI_LABEL_PROBE = ("one logistic regression per label on every depth mean-pooled and concatenated (standardised), "
                     "C tuned on validation micro-F1, each label's threshold chosen on validation")


def multi_label_probe(train: Features, y_train: np.ndarray, val: Features, y_val: np.ndarray, test: Features,
                      y_test: np.ndarray) -> dict[str, Any]:
    """The linear probe of a multi-label head (:data:`MULTI_LABEL_PROBE`): its test micro- and macro-F1."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.multiclass import OneVsRestClassifier
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(mean_pooled(train, "all"))
    Xtr, Xva, Xte = (scaler.transform(mean_pooled(f, "all")) for f in (train, val, test))
    best = None
    for C in (0.01, 0.1, 1.0, 10.0):
        clf = OneVsRestClassifier(LogisticRegression(C=C, max_iter=3000)).fit(Xtr, y_train)
        f1 = f1_scores(y_val, clf.predict_proba(Xva) >= 0.5)["micro_f1"]
        if best is None or f1 > best[0]:
            best = (f1, C, clf)
    assert best is not None
    thresholds = choose_thresholds(best[2].predict_proba(Xva), y_val)
    return {"method": MULTI_LABEL_PROBE, "C": best[1], "val_micro_f1": best[0], "thresholds": thresholds,
            "test": f1_scores(y_test, best[2].predict_proba(Xte) >= np.array(thresholds))}


def evaluate_multi_label(head: RoutingHead, f_val: Features, y_val: np.ndarray, f_test: Features, y_test: np.ndarray,
                         probe: dict[str, Any], device: torch.device | None = None) -> dict[str, Any]:
    """A multi-label head's thresholds chosen on validation (:func:`choose_thresholds`) and its test micro- and
    macro-F1 with them, beside the ``probe``'s (:func:`multi_label_probe`), and the margins."""
    thresholds = choose_thresholds(predict_features(head, f_val, device=device, multi_label=True), y_val)
    metrics = f1_scores(y_test, predict_features(head, f_test, device=device, multi_label=True)
                        >= np.array(thresholds))
    return {"split": "test", "thresholds": thresholds, "head": metrics, "probe_all_layers": probe,
            "margin_micro_f1": metrics["micro_f1"] - probe["test"]["micro_f1"],
            "margin_macro_f1": metrics["macro_f1"] - probe["test"]["macro_f1"]}


SIGNIFICANCE = 0.05
"""The level below which a p-value counts as significant: the bench's goal, the hint `train` prints."""


def mcnemar(y_true: list[int], a: list[int], b: list[int]) -> dict[str, Any]:
    """McNemar's exact test of two classifiers' errors on the same texts: the texts only ``a`` got right against
    those only ``b`` got right, two-sided binomial at 1/2 (scipy)."""
    from scipy.stats import binomtest

    only_a = sum(1 for y, p, q in zip(y_true, a, b, strict=True) if p == y != q)
    only_b = sum(1 for y, p, q in zip(y_true, a, b, strict=True) if q == y != p)
    p_value = 1.0 if only_a + only_b == 0 else float(binomtest(only_a, only_a + only_b, 0.5).pvalue)
    return {"test": "McNemar exact (two-sided binomial on the discordant texts)", "only_head_right": only_a,
            "only_probe_right": only_b, "p_value": p_value,
            "texts_for_significance": texts_for_significance(only_a, only_b, len(y_true))}


def texts_for_significance(only_a: int, only_b: int, n: int, alpha: float = SIGNIFICANCE) -> int | None:
    """About how many test texts McNemar's exact test needs for ``p < alpha`` in ``a``'s favour if texts split as
    these ``n`` did (the same share discordant, the same share of those that only ``a`` got right): the fewest, when
    it is below ``alpha`` already. None when ``a`` is not ahead (no number of texts would do). Read it as the size
    a test split must have for a lead of this size to show: a classifier truly this far ahead reaches ``p < alpha``
    on about half of the test splits of that size (more texts for more certainty)."""
    from scipy.stats import binomtest

    m = only_a + only_b
    if only_a <= only_b:
        return None
    share = only_a / m

    def significant(discordant: int) -> bool:
        return binomtest(round(share * discordant), discordant, 0.5).pvalue < alpha

    low, high = 1, m  # find a size that is significant (doubling), then the fewest (bisection)
    while not significant(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if significant(mid) else (mid, high)
    return math.ceil(high * n / m)


def compare(y_test: list[int], head: list[int], probes: dict[str, dict[str, Any]], n_classes: int) -> dict[str, Any]:
    """The head's test metrics beside the probes' (``last`` and ``all``, each from :func:`logistic_probe`, its
    ``predicted`` dropped here), the margins over each, and McNemar's test against the all-layer probe."""
    metrics = classification_metrics(y_test, np.asarray(head), n_classes)
    kept = {}
    for name, probe in probes.items():  # metrics recomputed: ``y_test`` may pool several folds' predictions
        kept[name] = {key: v for key, v in probe.items() if key != "predicted"}
        kept[name]["test"] = classification_metrics(y_test, np.asarray(probe["predicted"]), n_classes)
    last, every = kept["last"]["test"], kept["all"]["test"]
    return {"split": "test", "head": metrics, "baseline": kept["last"], "probe_all_layers": kept["all"],
            "margin_accuracy": metrics["accuracy"] - last["accuracy"],
            "margin_macro_f1": metrics["macro_f1"] - last["macro_f1"],
            "comparison": {"probe": "all layers", "margin_accuracy": metrics["accuracy"] - every["accuracy"],
                           "margin_macro_f1": metrics["macro_f1"] - every["macro_f1"],
                           **mcnemar(y_test, head, probes["all"]["predicted"])}}
