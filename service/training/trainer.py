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

import copy
import math
import random
import time
from collections.abc import Callable
from dataclasses import replace
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

__all__ = ["TrainConfig", "train_head"]


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
    lam = torch.distributions.Beta(alpha, alpha).sample((b,))  # [b]
    perm = torch.randperm(b, generator=gen)  # [b]
    lam_h = lam[:, None, None, None]  # [b111]
    mixed = lam_h * hidden + (1 - lam_h) * hidden[perm]  # [bned]
    mixed_pad = pad & pad[perm]  # [bn] padding only where both are padding
    mixed_y = lam[:, None] * y + (1 - lam[:, None]) * y[perm]  # [bk]
    return mixed, mixed_pad, mixed_y


@torch.no_grad()
def predict_features(head: RoutingHead, feats: Features, batch_size: int = 64,
                     max_positions: int = 16384) -> np.ndarray:
    """Class probabilities ``[T, k]`` for cached features."""
    head.eval()
    lengths = feats.lengths()
    order = sorted(range(len(feats)), key=lambda k: int(lengths[k]))
    probs = np.zeros((len(feats), head.n_classes), dtype=np.float32)
    for idx in budget_batches(order, lengths, batch_size, max_positions):
        hidden, pad = pad_batch(feats, idx)
        probs[idx] = head(hidden, pad).scores.softmax(-1).numpy()
    return probs


def validation_scores(probs: np.ndarray, y: list[int]) -> tuple[float, float]:
    """Accuracy and mean negative log-likelihood of class probabilities ``[T, k]``."""
    y_arr = np.asarray(y)
    p_true = probs[np.arange(len(y_arr)), y_arr]  # [T]
    return float((probs.argmax(1) == y_arr).mean()), float(-np.log(np.clip(p_true, 1e-12, None)).mean())


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


def train_head(head: RoutingHead, train: Features, y_train: list[int], val: Features, y_val: list[int],
               cfg: TrainConfig) -> tuple[RoutingHead, dict[str, Any]]:
    """Train ``head``; return the checkpoint chosen by :func:`improves` on validation, and a summary."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    y_all = nn.functional.one_hot(torch.tensor(y_train), head.n_classes).float()  # [T k]
    lengths = train.lengths()
    plan = step_plan(lengths, cfg, rng)
    steps = sum(len(b) for b in plan)
    opt = torch.optim.RAdam(head.parameters(), lr=cfg.max_lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.max_lr, total_steps=steps + 1,
                                                pct_start=min(0.3, cfg.warmup_steps / steps))
    # the weights validated and kept: the trained ones, or their exponential moving average
    averaged = (AveragedModel(head, multi_avg_fn=get_ema_multi_avg_fn(cfg.ema), use_buffers=True) if cfg.ema
                else None)
    validated = cast(RoutingHead, averaged.module) if averaged is not None else head
    best: tuple[float, float] | None = None
    best_state, best_step, best_epoch, since_best, step, validations = None, 0, 0, 0, 0, 0
    stopped = False
    t0 = time.time()
    for epoch, batches in enumerate(plan, 1):
        head.train()
        cut = [batches[k : k + cfg.eval_every] for k in range(0, len(batches), cfg.eval_every)]
        for part in cut:  # train on a part of the epoch, then validate
            bar = progress(part, desc=f"epoch {epoch}/{len(plan)}, steps {step + 1}-{step + len(part)} of {steps}",
                           unit="batch")
            total = 0.0
            for n, idx in enumerate(bar, 1):
                spans = random_spans([int(lengths[k]) for k in idx], cfg.crop, rng) if cfg.crop < 1 else None
                hidden, pad = pad_batch(train, idx, spans)
                hidden, pad, y = mixup(hidden, pad, y_all[idx], cfg.mixup_alpha, gen)
                loss = -(y * head(hidden, pad).scores.log_softmax(-1)).sum(-1).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                if averaged is not None:
                    averaged.update_parameters(head)
                total += loss.item()
                bar.set_postfix(loss=f"{total / n:.4f}", lr=f"{sched.get_last_lr()[0]:.2e}", refresh=False)
            step += len(part)
            acc, val_loss = validation_scores(predict_features(validated, val), y_val)
            validations += 1
            head.train()
            cfg.history.append({"epoch": epoch, "step": step, "train_loss": total / len(part), "val_accuracy": acc,
                                "val_loss": val_loss})
            print(f"step {step}/{steps} (epoch {epoch}): train loss {total / len(part):.4f}, validation accuracy "
                  f"{acc:.4f}, validation loss {val_loss:.4f}; {time_so_far(t0, step, steps)}", flush=True)
            if improves(acc, val_loss, best, cfg.select):
                best, best_step, best_epoch = (acc, val_loss), step, epoch
                best_state = copy.deepcopy(validated.state_dict())
                since_best = 0
            else:
                since_best += 1
            if cfg.patience and since_best >= cfg.patience:
                print(f"early stop: no better validation {cfg.select} for {since_best} validations; keeping step "
                      f"{best_step}", flush=True)
                stopped = True
                break
        if stopped:
            break
    assert best is not None and best_state is not None
    head.load_state_dict(best_state)
    # the last validation was the best of several: the budget ended before validation stopped improving
    still_improving = not stopped and best_step == step and validations > 1
    if still_improving:
        print(f"validation {cfg.select} was still improving at the last step ({step})", flush=True)
    summary = {"best_step": best_step, "best_epoch": best_epoch, "best_val_accuracy": best[0],
               "best_val_loss": best[1], "steps_run": step, "stopped_early": stopped,
               "still_improving": still_improving,
               "train_seconds": round(time.time() - t0, 1), "history": cfg.history, "steps": steps,
               "min_epochs": cfg.min_epochs, "epochs": cfg.epochs, "warmup_steps": cfg.warmup_steps,
               "eval_every": cfg.eval_every,
               "patience": cfg.patience, "checkpoint": f"best validation {cfg.select}", "batch_size": cfg.batch_size,
               "max_batch_positions": cfg.max_batch_positions, "max_lr": cfg.max_lr, "crop": cfg.crop,
               "optimizer": "RAdam", "schedule": "one-cycle", "ema": cfg.ema,
               "mixup": f"Beta({cfg.mixup_alpha}, {cfg.mixup_alpha})", "seed": cfg.seed}
    return head.eval(), summary


def _longer_flag(cfg: TrainConfig, summary: dict[str, Any], factor: int) -> str:
    """The command-line flag for ``factor`` times the budget of the run ``summary`` describes."""
    return f"--epochs {factor * cfg.epochs}" if cfg.epochs else f"--steps {factor * summary['steps']}"


def train_with_extension(make_head: Callable[[], RoutingHead], train: Features, y_train: list[int], val: Features,
                         y_val: list[int], cfg: TrainConfig) -> tuple[RoutingHead, dict[str, Any]]:
    """:func:`train_head` on a head from ``make_head()``. When its step budget (not ``epochs``, a length asked for)
    ended with validation still improving (and ``cfg.extend``), train again from ``make_head()`` (the same seeded
    initial weights) with twice the budget and keep whichever checkpoint :func:`improves` prefers; the summary's
    ``extended`` records both runs."""
    head, summary = train_head(make_head(), train, y_train, val, y_val, replace(cfg, history=[]))
    if not (cfg.extend and summary["still_improving"] and not cfg.epochs):  # whole epochs: the length asked for
        if summary["still_improving"]:
            print(f"a longer budget ({_longer_flag(cfg, summary, 2)}) or --search may train a better head", flush=True)
        return head, summary
    longer = cfg.scaled(2)
    print(f"training again with twice the budget ({2 * summary['steps']} steps at most), from the same initial "
          f"weights; the better on validation is kept", flush=True)
    head_2, summary_2 = train_head(make_head(), train, y_train, val, y_val, longer)
    keep_longer = improves(summary_2["best_val_accuracy"], summary_2["best_val_loss"],
                           (summary["best_val_accuracy"], summary["best_val_loss"]), cfg.select)
    runs = [{k: s[k] for k in ("steps", "best_step", "best_val_loss", "best_val_accuracy", "still_improving",
                               "train_seconds")} for s in (summary, summary_2)]
    kept_head, kept = (head_2, summary_2) if keep_longer else (head, summary)
    print(f"kept the {'longer' if keep_longer else 'first'} run: validation loss {kept['best_val_loss']:.4f}, "
          f"accuracy {kept['best_val_accuracy']:.4f}", flush=True)
    if keep_longer and kept["still_improving"]:
        print(f"a longer budget still ({_longer_flag(cfg, summary, 4)}) or --search may train a better head",
              flush=True)
    extended = {"rule": "budget x2 when the last validation was the best; the better on validation kept",
                "runs": runs, "kept": "longer" if keep_longer else "first"}
    return kept_head, {**kept, "extended": extended,
                       "train_seconds": round(summary["train_seconds"] + summary_2["train_seconds"], 1)}


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
