"""Training a routing head on frozen-backbone features with the paper's recipe (RAdam, one-cycle
learning rate with max 1e-3, mixup of hidden states with Beta(0.65, 0.65)), and evaluating it
against a logistic-regression probe on the mean-pooled last layer.

The defaults train to a budget of optimizer steps, not epochs, so a small dataset is seen as many times as
it takes (five epochs of 2,400 texts were 380 steps, too few to fit); the one-cycle warm-up is short and
fixed in steps; validation runs every epoch (at most every ``eval_every`` steps) and training stops once the
validation loss has not improved for ``patience`` validations, keeping the checkpoint of the lowest."""

from __future__ import annotations

import copy
import math
import random
import time
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from service.modeling.head import RoutingHead
from service.training.config import TrainConfig
from service.training.features import Features, pad_batch

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


def step_plan(lengths: torch.Tensor, cfg: TrainConfig, rng: random.Random) -> list[list[list[int]]]:
    """The batches of each epoch: ``cfg.epochs`` whole epochs, or epochs until ``cfg.steps`` batches (the last
    one cut short)."""
    if not len(lengths):
        raise ValueError("no training texts")
    plan: list[list[list[int]]] = []
    total = 0
    while (len(plan) < cfg.epochs) if cfg.epochs else (total < cfg.steps):
        batches = length_batches(lengths, cfg.batch_size, cfg.max_batch_positions, rng)
        if not cfg.epochs:
            batches = batches[: cfg.steps - total]
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
    best: tuple[float, float] | None = None
    best_state, best_step, best_epoch, since_best, step = None, 0, 0, 0, 0
    stopped = False
    t0 = time.time()
    for epoch, batches in enumerate(plan, 1):
        head.train()
        cut = [batches[k : k + cfg.eval_every] for k in range(0, len(batches), cfg.eval_every)]
        for part in cut:  # train on a part of the epoch, then validate
            bar = tqdm(part, desc=f"epoch {epoch}/{len(plan)}, steps {step + 1}-{step + len(part)} of {steps}",
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
                total += loss.item()
                bar.set_postfix(loss=f"{total / n:.4f}", lr=f"{sched.get_last_lr()[0]:.2e}")
            step += len(part)
            acc, val_loss = validation_scores(predict_features(head, val), y_val)
            head.train()
            cfg.history.append({"epoch": epoch, "step": step, "train_loss": total / len(part), "val_accuracy": acc,
                                "val_loss": val_loss})
            print(f"step {step}/{steps} (epoch {epoch}): train loss {total / len(part):.4f}, validation accuracy "
                  f"{acc:.4f}, validation loss {val_loss:.4f}", flush=True)
            if improves(acc, val_loss, best, cfg.select):
                best, best_state, best_step, best_epoch = (acc, val_loss), copy.deepcopy(head.state_dict()), step, epoch
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
    summary = {"best_step": best_step, "best_epoch": best_epoch, "best_val_accuracy": best[0],
               "best_val_loss": best[1], "steps_run": step, "stopped_early": stopped,
               "train_seconds": round(time.time() - t0, 1), "history": cfg.history, "steps": steps,
               "epochs": cfg.epochs, "warmup_steps": cfg.warmup_steps, "eval_every": cfg.eval_every,
               "patience": cfg.patience, "checkpoint": f"best validation {cfg.select}", "batch_size": cfg.batch_size,
               "max_batch_positions": cfg.max_batch_positions, "max_lr": cfg.max_lr, "crop": cfg.crop,
               "optimizer": "RAdam", "schedule": "one-cycle", "mixup": f"Beta({cfg.mixup_alpha}, {cfg.mixup_alpha})",
               "seed": cfg.seed}
    return head.eval(), summary


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


def mean_pooled_last_layer(feats: Features) -> np.ndarray:
    """``[T, d_emb]``: each text's last-layer states averaged over its real positions."""
    return np.stack([feats.get(t)[:, -1].float().mean(0).numpy() for t in range(len(feats))])


def logistic_baseline(train: Features, y_train: list[int], val: Features, y_val: list[int], test: Features,
                      y_test: list[int], n_classes: int) -> dict[str, Any]:
    """Logistic-regression probe on mean-pooled last-layer features, C chosen on validation."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(mean_pooled_last_layer(train))
    Xtr, Xva, Xte = (scaler.transform(mean_pooled_last_layer(f)) for f in (train, val, test))
    best = None
    for C in (0.01, 0.1, 1.0, 10.0):
        clf = LogisticRegression(C=C, max_iter=3000).fit(Xtr, y_train)
        acc = float((clf.predict(Xva) == np.array(y_val)).mean())
        if best is None or acc > best[0]:
            best = (acc, C, clf)
    assert best is not None
    metrics = classification_metrics(y_test, best[2].predict(Xte), n_classes)
    return {"method": "logistic regression on mean-pooled last layer (standardised), C tuned on validation",
            "C": best[1], "val_accuracy": best[0], "test": metrics}
