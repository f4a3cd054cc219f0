"""Data splitting, and the train/evaluate commands end to end on the tiny backbone."""

import csv
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner, Result

from service.cli import app
from service.modeling.backbone import Backbone
from service.modeling.buckets import QUANTILES
from service.modeling.head import RoutingHead
from service.modeling.repository import load_model
from service.training import progress as progress_module
from service.training.config import TrainConfig
from service.training.data import DatasetError, make_dataset, read_examples
from service.training.features import Features, extract
from service.training.pipeline import rare_labels
from service.training.progress import progress
from service.training.trainer import (
    choose_thresholds,
    classification_metrics,
    f1_scores,
    improves,
    mixup,
    predict_features,
    time_so_far,
    train_head,
    validation_scores,
)


def test_split_rule_dedup_and_conflicts() -> None:
    pairs = [(f"text {k}", "b" if k % 2 else "a") for k in range(200)]
    pairs += [("text 3", "b"), ("clash", "a"), ("clash", "b")]
    ds = make_dataset(pairs, "mem")
    assert ds.labels == ["a", "b"] and ds.dropped_duplicates == 2 and ds.dropped_conflicts == 1
    for name, bucket in (("test", {0}), ("validation", {1}), ("train", set(range(2, 10)))):
        split = getattr(ds, name)
        for t in split.texts:
            assert int(hashlib.sha1(t.encode("utf-8")).hexdigest(), 16) % 10 in bucket
    assert sum(len(getattr(ds, n).texts) for n in ("train", "validation", "test")) == 200
    assert "clash" not in ds.train.texts + ds.validation.texts + ds.test.texts


def test_readers(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"text": "a", "label": "x"}\n\n{"text": "b", "label": "y"}\n')
    assert read_examples(tmp_path / "d.jsonl") == [("a", "x"), ("b", "y")]
    for lab in ("pos", "neg"):
        (tmp_path / "dir" / lab).mkdir(parents=True)
        (tmp_path / "dir" / lab / "1.txt").write_text(f"a {lab} text")
    (tmp_path / "dir" / ".ipynb_checkpoints").mkdir()  # hidden folders (a notebook's, a tool's) are no labels
    (tmp_path / "dir" / ".ipynb_checkpoints" / "1-checkpoint.txt").write_text("a copy")
    assert read_examples(tmp_path / "dir") == [("a neg text", "neg"), ("a pos text", "pos")]
    (tmp_path / "bad.csv").write_text("foo,bar\n1,2\n")
    with pytest.raises(DatasetError, match="needs columns"):
        read_examples(tmp_path / "bad.csv")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(DatasetError, match=r"empty\.csv: is empty; needs a header row with columns 'text' and 'label'"):
        read_examples(tmp_path / "empty.csv")


def test_metrics_and_mixup() -> None:
    m = classification_metrics([0, 0, 1, 2], torch.tensor([0, 1, 1, 2]).numpy(), 3)
    assert m["accuracy"] == 0.75 and m["confusion_matrix"] == [[1, 1, 0], [0, 1, 0], [0, 0, 1]]
    assert m["macro_f1"] == pytest.approx((2 / 3 + 2 / 3 + 1) / 3)
    h = torch.randn(4, 5, 2, 3)
    pad = torch.zeros(4, 5, dtype=torch.bool)
    pad[0, 3:] = True
    y = torch.eye(3)[[0, 1, 2, 0]]
    mh, mp, my = mixup(h, pad, y, 0.65, torch.Generator().manual_seed(0))
    assert mh.shape == h.shape and torch.allclose(my.sum(-1), torch.ones(4))
    assert not mp[1:].any()


def said(res: Result) -> str:
    """A command's output as one line (typer's error box wraps at the terminal's width)."""
    return " ".join(res.output.replace("│", " ").split())


def write_toy_csv(path: Path, rows: list[tuple[str, str]], n: int, label_column: str = "label") -> None:
    """``n`` rows of a CSV file, the ``rows`` (text, label) in turn, each text numbered."""
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["text", label_column])
        for k in range(n):
            text, label = rows[k % len(rows)]
            w.writerow([f"{text} number {k}", label])


def toy_args(tmp_path: Path, backbone: Path) -> list[str]:
    """Options of ``train`` for 120 two-label texts written to ``tmp_path`` and the tiny backbone."""
    write_toy_csv(tmp_path / "data.csv", [("good great fine lovely", "pos"), ("bad awful terrible poor", "neg")], 120)
    return ["--data", str(tmp_path / "data.csv"), "--backbone", str(backbone), "--max-length", "16",
            "--n-hid", "4", "--d-hid", "8", "--epochs", "2", "--batch-size", "16", "--cache", str(tmp_path / "cache")]


def test_train_and_evaluate_commands(tmp_path: Path, tiny_backbone_dir: Path) -> None:
    runner = CliRunner()
    args = toy_args(tmp_path, tiny_backbone_dir)
    for repo in ("repo", "again"):
        res = runner.invoke(app, ["train", "toy", "--out", str(tmp_path / repo), *args])
        assert res.exit_code == 0, res.output
        assert "(epoch 1): train loss" in res.output and "batch/s" not in res.output  # a log: no short bars
        wall = json.loads((tmp_path / repo / "toy" / "manifest.json").read_text())["training"]["wall_seconds"]
        minutes, seconds = divmod(int(wall), 60)  # the manifest's time, as m:ss
        assert f"wrote {tmp_path / repo / 'toy'} ({minutes:02d}:{seconds:02d} in all)" in res.output
        assert f"ROUTING_MODEL_REPOSITORY={tmp_path / repo} routing-service serve" in res.output  # how to serve it
    first, second = (load_file(tmp_path / repo / "toy" / "head.safetensors") for repo in ("repo", "again"))
    assert all(torch.equal(first[name], second[name]) for name in first)  # seeded: same data, same weights
    umask = os.umask(0)
    os.umask(umask)
    for path in (tmp_path / "repo" / "toy").iterdir():  # readable as any new file is (a container's user)
        assert path.name in ("manifest.json", "head.safetensors") and path.stat().st_mode & 0o777 == 0o666 & ~umask
    before = (tmp_path / "repo" / "toy" / "head.safetensors").read_bytes()
    res = runner.invoke(app, ["train", "toy", "--out", str(tmp_path / "repo"), *args, "--seed", "1"])
    assert res.exit_code == 2 and "--overwrite replaces the model there" in said(res) and "train loss" not in res.output
    assert (tmp_path / "repo" / "toy" / "head.safetensors").read_bytes() == before
    (tmp_path / "repo" / "afile").write_text("not a model")
    res = runner.invoke(app, ["train", "afile", "--out", str(tmp_path / "repo"), *args, "--overwrite"])
    assert res.exit_code == 2 and "is a file, not a model folder" in said(res), res.output
    res = runner.invoke(app, ["train", "toy", "--out", str(tmp_path / "repo" / "afile" / "models"), *args])
    assert res.exit_code == 2 and "cannot write into" in said(res) and "train loss" not in res.output, res.output
    res = runner.invoke(app, ["train", "toy", "--out", str(tmp_path / "repo"), *args, "--seed", "1", "--overwrite"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "repo" / "toy" / "head.safetensors").read_bytes() != before
    assert sorted(p.name for p in (tmp_path / "repo" / "toy").iterdir()) == ["head.safetensors", "manifest.json"]
    for name in ("My-Topics", "my topics", "../toy"):  # refused before any work, not after training
        bad = runner.invoke(app, ["train", name, "--out", str(tmp_path / "named"), *args])
        assert bad.exit_code == 2 and "a model's name is lowercase letters, digits" in said(bad), bad.output
        assert not (tmp_path / "named").exists() and "train loss" not in bad.output
    res = runner.invoke(app, ["train", "toy", "--out", str(tmp_path / "cropped"), *args, "--crop", "0.5"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "cropped" / "toy" / "manifest.json").read_text())["training"]["crop"] == 0.5
    cropped = load_file(tmp_path / "cropped" / "toy" / "head.safetensors")
    assert not all(torch.equal(first[name], cropped[name]) for name in first)
    folder = tmp_path / "repo" / "toy"
    manifest = json.loads((folder / "manifest.json").read_text())
    ev = manifest["evaluation"]
    assert ev["head"]["n"] == len(make_dataset(read_examples(tmp_path / "data.csv"), "x").test.texts)
    assert {"accuracy", "macro_f1", "confusion_matrix"} <= set(ev["head"])
    assert "accuracy" in ev["baseline"]["test"] and "margin_accuracy" in ev
    assert ev["probe_all_layers"]["test"]["n"] == ev["head"]["n"] and "predicted" not in ev["probe_all_layers"]
    cmp = ev["comparison"]
    assert cmp["probe"] == "all layers" and 0 <= cmp["p_value"] <= 1
    assert cmp["margin_accuracy"] == ev["head"]["accuracy"] - ev["probe_all_layers"]["test"]["accuracy"]
    assert len(manifest["training"]["history"]) == 2 and manifest["training"]["data"]["n_train_used"] > 0
    lengths = manifest["token_lengths"]  # the training texts' chunk lengths, for a server's shape buckets
    assert len(lengths) == len(QUANTILES) and lengths == sorted(lengths) and 2 < lengths[0] <= lengths[-1] <= 16
    assert list((tmp_path / "cache").glob("*.pt"))
    _, clf = load_model(folder)
    assert clf.labels == ["neg", "pos"]
    res = runner.invoke(app, ["evaluate", str(folder), "--cache", str(tmp_path / "cache")])
    assert res.exit_code == 0, res.output
    again = json.loads((folder / "manifest.json").read_text())["evaluation"]
    assert again["head"] == ev["head"] and again["comparison"] == ev["comparison"]  # evaluate recomputes it
    (tmp_path / "data.csv").rename(tmp_path / "moved.csv")
    res = runner.invoke(app, ["evaluate", str(folder), "--cache", str(tmp_path / "cache")])
    assert res.exit_code == 2 and "data.csv: no such file or directory" in res.output and "--data" in res.output
    rows = (tmp_path / "moved.csv").read_text().splitlines()
    (tmp_path / "fewer.csv").write_text("\n".join(rows[:-5]) + "\n")  # the same labels, other splits
    res = runner.invoke(app, ["evaluate", str(folder), "--cache", str(tmp_path / "cache"),
                              "--data", str(tmp_path / "fewer.csv")])
    assert res.exit_code == 2 and "give the data it was trained on" in res.output, res.output
    assert json.loads((folder / "manifest.json").read_text())["training"]["data"]["path"].endswith("data.csv")
    res = runner.invoke(app, ["evaluate", str(folder), "--cache", str(tmp_path / "cache"),
                              "--data", str(tmp_path / "moved.csv")])
    assert res.exit_code == 0, res.output
    moved = json.loads((folder / "manifest.json").read_text())
    assert moved["evaluation"]["head"] == ev["head"]
    assert moved["training"]["data"]["path"] == str(tmp_path / "moved.csv")
    res = runner.invoke(app, ["evaluate", str(folder), "--cache", str(tmp_path / "cache")])  # the new path is kept
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["evaluate", str(folder.parent)])  # the repository, not the model
    assert res.exit_code == 2 and "is a model repository, not a model folder" in said(res), res.output
    bad = runner.invoke(app, ["train", "toy2", "--out", str(tmp_path / "repo")])
    assert bad.exit_code != 0 and "exactly one of --preset or --data" in said(bad)


def test_readers_take_files_as_users_write_them(tmp_path: Path) -> None:
    """A spreadsheet's UTF-8 CSV (byte-order mark), another encoding when named, a field over csv's default limit,
    numbers as labels, a .json array; rows without a label are counted, not silently lost."""
    (tmp_path / "bom.csv").write_text("text,label\nhello there,a\n", encoding="utf-8-sig")
    assert read_examples(tmp_path / "bom.csv") == [("hello there", "a")]
    (tmp_path / "semi.csv").write_text('text;label\n"hello, there";a\nbye;b\n')  # a spreadsheet's CSV in many locales
    (tmp_path / "tabs.tsv").write_text("label\ttext\na\thello, there\nb\tbye\n")
    assert read_examples(tmp_path / "semi.csv") == read_examples(tmp_path / "tabs.tsv") == [("hello, there", "a"),
                                                                                            ("bye", "b")]
    (tmp_path / "commas.csv").write_text('text,label\n"a; b; c",x\n')  # semicolons in a comma file's texts
    assert read_examples(tmp_path / "commas.csv") == [("a; b; c", "x")]
    (tmp_path / "cp.csv").write_bytes("text,label\ncafé au lait,a\n".encode("cp1252"))
    with pytest.raises(DatasetError, match=r"not utf-8 text \(byte 0xe9.*--encoding cp1252"):
        read_examples(tmp_path / "cp.csv")
    assert read_examples(tmp_path / "cp.csv", encoding="cp1252") == [("café au lait", "a")]
    with pytest.raises(DatasetError, match="unknown encoding 'klingon'"):
        read_examples(tmp_path / "cp.csv", encoding="klingon")
    long = "word " * 40_000  # 200,000 characters: over csv's 131,072 default
    (tmp_path / "long.csv").write_text(f'text,label\n"{long}",a\n')
    assert read_examples(tmp_path / "long.csv") == [(long.strip(), "a")]
    rows = [{"text": "one", "label": 1}, {"text": "two", "label": None}, {"text": None, "label": "x"}]
    (tmp_path / "n.jsonl").write_text("\n".join(map(json.dumps, rows)))
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2))
    assert read_examples(tmp_path / "n.jsonl") == read_examples(tmp_path / "a.json") == [
        ("one", "1"), ("two", ""), ("", "x")]
    (tmp_path / "s.jsonl").write_text('{"text": "a\u2028b", "label": "x"}\r\n', newline="")  # raw, as JSON allows
    assert read_examples(tmp_path / "s.jsonl") == [("a\u2028b", "x")]
    pairs = [(f"text {k}", "ab"[k % 2]) for k in range(99)] + [(" spaced ", "a"), ("two", ""), ("", "x"), ("  ", "a")]
    ds = make_dataset(pairs, "mem")
    assert ds.dropped_empty == 3 and ds.describe()["dropped_empty"] == 3
    texts = ds.train.texts + ds.validation.texts + ds.test.texts
    assert len(texts) == 100 and " spaced " in texts  # kept as given: the benchmarks' splits stay as published


@pytest.mark.parametrize(("content", "match"), [
    ('{"text": "a", "label": "x"}\n{"text": oops}\n', r"d.jsonl:2: Expecting value"),
    ('["a", "x"]\n', r"d.jsonl:1: expected an object with 'text' and 'label', got list"),
    ('{"text": 5, "label": "x"}\n', r"d.jsonl:1: 'text' must be a string, got int"),
    ('{"text": "a", "label": ["x"]}\n', r"d.jsonl:1: 'label' must be a string or a number, got list"),
    ('{"text": "a", "lbl": "x"}\n', r"d.jsonl:1: no 'label' field \(has \['lbl', 'text'\]\)"),
])
def test_malformed_json_lines_say_where(tmp_path: Path, content: str, match: str) -> None:
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(DatasetError, match=match):
        read_examples(tmp_path / "d.jsonl")


def test_too_few_examples_for_every_split() -> None:
    with pytest.raises(DatasetError, match=r"too few examples .*validation 0"):
        make_dataset([("hello there", "a"), ("bye now", "b")], "mem")
    with pytest.raises(DatasetError, match="no example has both a text and a label"):
        make_dataset([("hello there", ""), ("", "b")], "mem")


def test_train_says_which_rows_it_dropped(tmp_path: Path, tiny_backbone_dir: Path) -> None:
    args = toy_args(tmp_path, tiny_backbone_dir)
    with (tmp_path / "data.csv").open("a", newline="") as fh:
        csv.writer(fh).writerows([["good great fine lovely number 0", "pos"], ["no label here", ""], ["", "neg"],
                                  ["both ways", "pos"], ["both ways", "neg"]])
    res = CliRunner().invoke(app, ["train", "toy", "--out", str(tmp_path / "repo"), *args])
    assert res.exit_code == 0, res.output
    assert ("dropped 2 without a text or a label, 2 repeating a text, 1 texts seen with two labels (every copy)"
            in res.output), res.output
    data = json.loads((tmp_path / "repo" / "toy" / "manifest.json").read_text())["training"]["data"]
    assert (data["dropped_empty"], data["dropped_duplicates"], data["dropped_conflicts"]) == (2, 2, 1)


def test_train_reports_unreadable_data_as_an_error_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "cols.csv").write_text("a,b\n1,2\n")
    res = CliRunner().invoke(app, ["train", "x", "--out", str(tmp_path / "repo"), "--data", str(tmp_path / "cols.csv")])
    assert res.exit_code == 2 and res.exception is not None and not isinstance(res.exception, DatasetError)
    assert "needs columns 'text' and 'label'" in res.output
    for name, content in (("cp.csv", "text,label\ncafé,a\n".encode("cp1252")), ("list.jsonl", b'["a", "b"]\n'),
                          ("two.csv", b"text,label\nhello there,a\nbye now,b\n")):
        (tmp_path / name).write_bytes(content)
        res = CliRunner().invoke(app, ["train", "x", "--out", str(tmp_path / "repo"), "--data", str(tmp_path / name)])
        assert res.exit_code == 2 and not isinstance(res.exception, DatasetError | UnicodeError | TypeError), name
        assert res.output.startswith(f"error: {tmp_path / name}"), res.output
    res = CliRunner().invoke(app, ["train", "x", "--out", str(tmp_path / "repo"), "--data", str(tmp_path / "no.csv")])
    assert res.exit_code == 2 and "Invalid value for '--data'" in res.output
    assert not (tmp_path / "repo").exists()


def test_a_backbone_or_model_folder_that_cannot_be_used_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    args = toy_args(tmp_path, tmp_path / "no-backbone")
    res = CliRunner().invoke(app, ["train", "toy", "--out", str(tmp_path / "repo"), *args])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert "cannot load backbone" in res.output and not (tmp_path / "repo" / "toy").exists()
    (tmp_path / "not-a-model").mkdir()
    res = CliRunner().invoke(app, ["evaluate", str(tmp_path / "not-a-model"), "--cache", str(tmp_path / "cache")])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit)
    assert "not-a-model/manifest.json: missing manifest file" in res.output


def test_search_trains_the_grid_and_keeps_the_best_on_validation(tmp_path: Path, tiny_backbone_dir: Path) -> None:
    res = CliRunner().invoke(app, ["train", "toy", "--out", str(tmp_path / "repo"),
                                   *toy_args(tmp_path, tiny_backbone_dir), "--search"])
    assert res.exit_code == 0, res.output
    training = json.loads((tmp_path / "repo" / "toy" / "manifest.json").read_text())["training"]
    tried = training["search"]["tried"]
    assert {(t["max_lr"], t["epochs"], t["crop"]) for t in tried} == {
        (lr, epochs, crop) for lr in (5e-4, 1e-3, 2e-3) for epochs in (2, 6) for crop in (1.0, 0.6)}
    assert (tried[0]["max_lr"], tried[0]["epochs"], tried[0]["crop"]) == (1e-3, 2, 1.0)  # the given settings first
    kept = tried[training["search"]["kept"]]
    assert kept["best_val_loss"] == min(t["best_val_loss"] for t in tried) == training["best_val_loss"]
    assert (training["max_lr"], training["crop"]) == (kept["max_lr"], kept["crop"])
    assert "search 12/12" in res.output and training["search"]["rule"] == "lowest validation loss"
    done = [line for line in res.output.splitlines() if line.endswith("since the search began")]
    assert len(done) == 12 and done[0].startswith("search 1/12: validation loss ") and "(the best so far)" in done[0]
    # the kept point is the last to say it was the best so far
    assert max(k for k, line in enumerate(done) if "(the best so far)" in line) == training["search"]["kept"]


def test_train_extends_a_budget_that_ended_improving_and_no_extend_does_not(tmp_path: Path,
                                                                          tiny_backbone_dir: Path) -> None:
    args = toy_args(tmp_path, tiny_backbone_dir)
    args = args[: args.index("--epochs")] + args[args.index("--epochs") + 2 :]  # a step budget, not epochs
    args += ["--steps", "6", "--min-epochs", "0", "--warmup-steps", "1", "--eval-every", "2", "--max-lr", "0.003"]
    runs = {}
    for flag in ("--extend", "--no-extend"):
        res = CliRunner().invoke(app, ["train", "toy", "--out", str(tmp_path / flag), *args, flag])
        assert res.exit_code == 0, res.output
        runs[flag] = json.loads((tmp_path / flag / "toy" / "manifest.json").read_text())["training"], res.output
    (plain, out) = runs["--no-extend"]
    assert plain["still_improving"] and "extended" not in plain and "(--steps 12)" in out
    (extended, out) = runs["--extend"]
    first, continued = extended["extended"]["schedules"]
    assert (first["steps"], continued["steps"], extended["steps_run"]) == (6, 6, 12)
    assert "training on from here under another schedule of 6 steps" in out
    # the first schedule is the run without the extension, validation by validation
    assert first["best_val_loss"] == plain["best_val_loss"]
    assert extended["history"][:3] == plain["history"]
    assert extended["best_val_loss"] == min(h["val_loss"] for h in extended["history"])


def test_the_search_triples_the_budget_of_a_large_dataset_too() -> None:
    import random

    from service.training.search import grid
    from service.training.trainer import TrainConfig, step_plan

    budgets = {sum(map(len, step_plan(torch.full((1000,), 8), point, random.Random(0))))
               for point in grid(TrainConfig(steps=50, min_epochs=2, batch_size=4))}
    assert budgets == {2 * 250, 3 * 2 * 250}  # min_epochs sets both budgets here: it is scaled with steps


def test_batches_respect_size_and_position_budget() -> None:
    import random

    from service.training.trainer import budget_batches, length_batches

    lengths = torch.tensor([5, 300, 40, 40, 1000, 7, 80, 60, 10, 20])
    batches = budget_batches(sorted(range(10), key=lambda k: int(lengths[k])), lengths, 3, 200)
    assert sorted(k for b in batches for k in b) == list(range(10))
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or max(int(lengths[k]) for k in b) * len(b) <= 200
    shuffled = length_batches(lengths, 3, 200, random.Random(0))
    assert sorted(k for b in shuffled for k in b) == list(range(10))


def test_checkpoint_rule_validation_loss_then_accuracy() -> None:
    probs = np.array([[0.9, 0.1], [0.4, 0.6], [0.7, 0.3]])
    acc, loss = validation_scores(probs, [0, 1, 1])
    assert acc == pytest.approx(2 / 3) and loss == pytest.approx(-np.log([0.9, 0.6, 0.3]).mean())
    assert improves(0.5, 9.0, None)
    assert improves(0.6, 0.09, (0.7, 0.1)) and not improves(0.8, 0.11, (0.7, 0.1))
    assert improves(0.8, 0.1, (0.7, 0.1)) and not improves(0.7, 0.1, (0.7, 0.1))
    assert improves(0.8, 9.0, (0.7, 0.1), "accuracy") and not improves(0.6, 0.01, (0.7, 0.1), "accuracy")
    assert improves(0.7, 0.09, (0.7, 0.1), "accuracy") and not improves(0.7, 0.1, (0.7, 0.1), "accuracy")


def test_a_step_budget_that_grows_with_a_large_dataset() -> None:
    import random

    from service.training.trainer import TrainConfig, step_plan

    for n in (10, 100, 1000):
        plan = step_plan(torch.full((n,), 8), TrainConfig(steps=50, min_epochs=0, batch_size=4), random.Random(0))
        assert sum(map(len, plan)) == 50  # small data: as many epochs as it takes; large: part of one
        assert len(plan) == -(-50 // -(-n // 4))
        for epoch in plan[:-1]:
            assert sorted(k for b in epoch for k in b) == list(range(n))  # each whole epoch sees every text once
    for n, steps in ((10, 50), (100, 50), (1000, 2 * 250)):  # at least two epochs' worth of steps
        plan = step_plan(torch.full((n,), 8), TrainConfig(steps=50, min_epochs=2, batch_size=4), random.Random(0))
        assert sum(map(len, plan)) == steps
    assert [len(e) for e in plan] == [250, 250]
    plan = step_plan(torch.full((10,), 8), TrainConfig(steps=50, epochs=2, batch_size=4), random.Random(0))
    assert len(plan) == 2 and sum(map(len, plan)) == 6  # --epochs instead of the budget


def test_random_crops_are_windows_of_the_texts() -> None:
    import random

    from service.training.features import Features, pad_batch
    from service.training.trainer import random_spans

    rng = random.Random(0)
    lengths = [1, 7, 40, 300]
    for _ in range(50):
        for n, (s, e) in zip(lengths, random_spans(lengths, 0.5, rng), strict=True):
            assert 0 <= s < e <= n and e - s >= max(1, math.ceil(0.5 * n))
    assert {e - s for s, e in (random_spans([40], 0.5, rng)[0] for _ in range(200))} == set(range(20, 41))
    flat = torch.arange(12.0).reshape(6, 1, 2)  # two texts: 2 and 4 positions
    feats = Features.from_offsets(flat, torch.tensor([0, 2, 6]))
    hidden, pad = pad_batch(feats, [1, 0], [(1, 3), (0, 1)])
    assert torch.equal(hidden[0], flat[3:5]) and torch.equal(hidden[1, :1], flat[:1])
    assert pad.tolist() == [[False, False], [False, True]]


def test_training_stops_when_validation_loss_stops_improving_and_keeps_the_best() -> None:
    # random features whose labels cannot be learned: the validation loss soon stops falling, so training stops
    # after `patience` validations without a lower one, and the head is the checkpoint of the lowest
    from service.modeling.head import RoutingHead
    from service.training.features import Features
    from service.training.trainer import TrainConfig, train_head

    g = torch.Generator().manual_seed(0)

    def feats(n: int) -> Features:
        lengths = torch.randint(2, 6, (n,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        return Features.from_offsets(torch.randn(int(offsets[-1]), 3, 8, generator=g).half(), offsets)

    train, val = feats(64), feats(32)
    y_train, y_val = torch.randint(0, 2, (64,), generator=g).tolist(), torch.randint(0, 2, (32,), generator=g).tolist()
    cfg = TrainConfig(steps=400, batch_size=8, eval_every=4, patience=3, max_lr=3e-2)
    head, summary = train_head(RoutingHead(3, 8, 2, n_hid=4, d_hid=8), train, y_train, val, y_val, cfg)
    history = summary["history"]
    assert summary["stopped_early"] and summary["steps_run"] < 400 and len(history) == summary["steps_run"] // 4
    assert not summary["still_improving"]
    best = min(history, key=lambda h: h["val_loss"])
    assert summary["best_step"] == best["step"] and summary["best_val_loss"] == best["val_loss"]
    assert [h["step"] for h in history][-1] - best["step"] == 3 * 4  # three validations without a lower loss
    from service.training.trainer import predict_features, validation_scores

    assert validation_scores(predict_features(head, val), y_val)[1] == pytest.approx(best["val_loss"], abs=1e-5)


def learnable(n: int, seed: int) -> tuple[Features, list[int]]:
    """``n`` texts of 2-5 positions whose label a head learns at once: the sign of one feature's mean."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 6, (n,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    x = torch.randn(int(offsets[-1]), 3, 8, generator=g)  # [positions, depth, d_emb]
    y = [int(x[offsets[k] : offsets[k + 1], :, 0].mean() > 0) for k in range(n)]
    return Features.from_offsets(x.half(), offsets), y


def tiny_head() -> RoutingHead:
    """A small head over 3 depths of 8 features, 2 labels, from seeded initial weights."""
    torch.manual_seed(0)
    return RoutingHead(3, 8, 2, n_hid=4, d_hid=8)


def test_a_budget_that_ends_while_validation_still_improves_is_flagged(capsys: pytest.CaptureFixture[str]) -> None:
    # a budget far too short for a learnable task: every validation is the best so far, so the run ends
    # improving; the summary says so and, without the extension, the output suggests a longer budget
    feats, y = learnable(96, seed=2)
    train, val = feats.subset(list(range(64))), feats.subset(list(range(64, 96)))
    cfg = TrainConfig(steps=12, min_epochs=0, batch_size=8, eval_every=4, patience=3, max_lr=3e-2, ema=0,
                      extend=False)
    _, summary = train_head(tiny_head(), train, y[:64], val, y[64:], cfg)
    losses = [h["val_loss"] for h in summary["history"]]
    assert losses == sorted(losses, reverse=True) and len(losses) == 3  # falling at every validation
    assert summary["still_improving"] and summary["best_step"] == summary["steps_run"] == 12
    assert "extended" not in summary
    out = capsys.readouterr().out
    assert "still improving at the last step (12)" in out and "(--steps 24)" in out


def test_each_validation_line_says_the_time_spent_and_the_most_left(capsys: pytest.CaptureFixture[str]) -> None:
    assert time_so_far(1000.0, 100, 400, now=1065.2) == "01:05 elapsed, at most 03:15 left"  # 300 steps at 0.65 s
    assert time_so_far(1000.0, 50, 50, now=4725.5) == "1:02:05 elapsed, at most 00:00 left"
    feats, y = learnable(96, seed=2)
    cfg = TrainConfig(steps=12, min_epochs=0, batch_size=8, eval_every=4, patience=3, max_lr=3e-2, ema=0)
    train_head(tiny_head(), feats.subset(list(range(64))), y[:64], feats.subset(list(range(64, 96))), y[64:], cfg)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 6 and all(re.search(r"; \d\d:\d\d elapsed, at most \d\d:\d\d left$", line) for line in lines)
    # the budget ended improving and training went on: from then on, the steps and the time left count both schedules
    assert [line.split()[1] for line in lines] == ["4/12", "8/12", "12/12", "16/24", "20/24", "24/24"]
    assert lines[2].endswith("at most 00:00 left") and lines[-1].endswith("at most 00:00 left")


def test_a_budget_that_ends_improving_goes_on_from_where_it_is_and_keeps_the_best_of_both() -> None:
    feats, y = learnable(96, seed=2)
    train, val = feats.subset(list(range(64))), feats.subset(list(range(64, 96)))
    cfg = TrainConfig(steps=12, min_epochs=0, batch_size=8, eval_every=4, patience=3, max_lr=3e-2, ema=0)
    seen: list[tuple[bool, list[torch.Tensor]]] = []  # (training?, the weights) at every forward of the head

    def look(module: torch.nn.Module, args: object) -> None:
        seen.append((module.training, [p.detach().clone() for p in module.parameters()]))

    start = tiny_head()
    start.register_forward_pre_hook(look)
    head, summary = train_head(start, train, y[:64], val, y[64:], cfg)
    first, continued = summary["extended"]["schedules"]
    assert (first["steps"], first["still_improving"], continued["steps"]) == (12, True, 12)
    assert summary["steps"] == summary["steps_run"] == 24 and len(summary["history"]) == 6
    # the second schedule's first step starts from the weights the first schedule ended with (those its last
    # validation saw; with ema=0 the weights validated are the trained ones), not from the initial weights
    steps = [k for k, (training, _) in enumerate(seen) if training]
    assert len(steps) == 24
    twelfth, thirteenth = steps[11], steps[12]
    validated = [weights for training, weights in seen[twelfth + 1 : thirteenth] if not training]
    assert validated and all(torch.equal(a, b) for a, b in zip(validated[-1], seen[thirteenth][1], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(seen[steps[0]][1], seen[thirteenth][1], strict=True))
    # the first schedule is the run without the extension; the checkpoint kept is the best of both
    _, alone = train_head(tiny_head(), train, y[:64], val, y[64:], replace(cfg, extend=False))
    assert summary["history"][:3] == alone["history"] and first["best_val_loss"] == alone["best_val_loss"]
    best = min(summary["history"], key=lambda h: h["val_loss"])
    assert (summary["best_val_loss"], summary["best_step"]) == (best["val_loss"], best["step"])
    assert summary["extended"]["kept"] == ("continued" if best["step"] > 12 else "first")
    assert validation_scores(predict_features(head, val), y[64:])[1] == pytest.approx(summary["best_val_loss"],
                                                                                       abs=1e-5)


def test_a_continued_schedule_does_not_stop_early_in_its_first_half(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.training import trainer

    feats, y = learnable(96, seed=2)
    train, val = feats.subset(list(range(64))), feats.subset(list(range(64, 96)))
    cfg = TrainConfig(steps=12, min_epochs=0, batch_size=8, eval_every=4, patience=1, max_lr=3e-2, ema=0)
    scores = trainer.validation_scores
    seen: list[int] = []

    def worse_after_the_first_schedule(probs: np.ndarray, y_val: list[int]) -> tuple[float, float]:
        seen.append(1)
        acc, loss = scores(probs, y_val)
        return (acc, loss) if len(seen) <= 3 else (0.0, 10.0)  # validations 4 on: worse than any before

    monkeypatch.setattr(trainer, "validation_scores", worse_after_the_first_schedule)
    _, summary = train_head(tiny_head(), train, y[:64], val, y[64:], cfg)
    # patience 1 would stop at the continued schedule's first validation (step 16); it goes on to its half (step 18)
    # and stops at the first validation from there
    first, continued = summary["extended"]["schedules"]
    assert first["still_improving"] and continued["steps"] == 12
    assert summary["stopped_early"] and summary["steps_run"] == 20
    assert [h["step"] for h in summary["history"]] == [4, 8, 12, 16, 20] and summary["best_step"] == 12
    assert trainer.HOLD == 0.5 and "not stopping early in its first 50%" in summary["extended"]["rule"]


def test_a_moving_average_of_the_weights_is_what_validates_and_is_kept() -> None:
    from service.modeling.head import RoutingHead
    from service.training.features import Features
    from service.training.trainer import TrainConfig, predict_features, train_head

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 6, (48,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    feats = Features.from_offsets(torch.randn(int(offsets[-1]), 3, 8, generator=g).half(), offsets)
    train, val = feats.subset(list(range(32))), feats.subset(list(range(32, 48)))
    y = torch.randint(0, 2, (48,), generator=g).tolist()
    heads = {}
    for ema in (0.0, 0.9):
        torch.manual_seed(0)
        cfg = TrainConfig(steps=12, min_epochs=0, batch_size=8, eval_every=4, patience=0, max_lr=3e-2, ema=ema)
        heads[ema], summary = train_head(RoutingHead(3, 8, 2, n_hid=4, d_hid=8), train, y[:32], val, y[32:], cfg)
        assert summary["ema"] == ema
        loss = validation_scores(predict_features(heads[ema], val), y[32:])[1]
        assert loss == pytest.approx(summary["best_val_loss"], abs=1e-5)  # the kept weights are those validated
    plain, averaged = (dict(heads[e].named_parameters()) for e in (0.0, 0.9))
    assert any(not torch.allclose(plain[n], averaged[n]) for n in plain)


def test_mcnemar_counts_the_discordant_texts_and_tests_them_exactly() -> None:
    from service.training.trainer import mcnemar

    y = [0] * 12
    head = [0] * 10 + [1, 0]  # right on 11
    probe = [1] * 10 + [1, 1]  # right on none: 10 + 1 texts only the head got right, 0 only the probe
    got = mcnemar(y, head, probe)
    assert (got["only_head_right"], got["only_probe_right"]) == (11, 0)
    assert got["p_value"] == pytest.approx(2 * 0.5**11)
    assert mcnemar(y, head, head)["p_value"] == 1.0  # no discordant text: no evidence either way
    even = mcnemar([0, 0, 1, 1], [0, 1, 1, 0], [1, 0, 0, 1])  # 2 against 2
    assert (even["only_head_right"], even["only_probe_right"], even["p_value"]) == (2, 2, 1.0)
    assert even["texts_for_significance"] is None  # not ahead: no number of texts would do
    # 11 of 12 texts discordant, all the head's: 6 such texts give p = 2 / 2**6 < 0.05, 5 give 0.0625
    assert got["texts_for_significance"] == math.ceil(6 * 12 / 11)


def test_texts_for_significance_is_the_size_at_which_the_same_split_turns_significant() -> None:
    from scipy.stats import binomtest

    from service.training.trainer import texts_for_significance

    needed = texts_for_significance(107, 90, 2096)  # a bench's split: 107 texts only the head got right, 90 the probe
    assert needed is not None and needed > 2096

    def p_at(texts: int) -> float:
        discordant = round(texts * 197 / 2096)
        return binomtest(round(discordant * 107 / 197), discordant, 0.5).pvalue

    assert p_at(2096) > 0.05 and p_at(needed) < 0.05 and p_at(int(0.9 * needed)) > 0.05
    assert texts_for_significance(90, 107, 2096) is None and texts_for_significance(0, 0, 100) is None


def test_an_evaluation_ahead_but_not_significant_says_how_many_test_texts_would_show_the_lead() -> None:
    from service.training.pipeline import _power_hint
    from service.training.trainer import mcnemar

    y = [0] * 230
    head, probe = [0] * 220 + [1] * 10, [0] * 214 + [1] * 16  # 6 texts only the head got right, none only the probe
    c = mcnemar(y, head, probe)
    assert c["p_value"] == pytest.approx(2 * 0.5**6) and c["p_value"] < 0.05
    assert _power_hint(c, 230) == ""  # significant already
    probe = [0] * 215 + [1] * 15  # 5 against none: p 0.0625
    c = mcnemar(y, head, probe)
    assert _power_hint(c, 230) == f"; a lead of this size shows (p < 0.05) on about {math.ceil(6 * 230 / 5)} test " \
                                  "texts, this split has 230"
    assert _power_hint(mcnemar(y, probe, head), 230) == ""  # behind: no size would show it



@pytest.mark.parametrize("terminal", [True, False])
def test_progress_redraws_live_on_a_terminal_and_rarely_in_a_log(terminal: bool, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    monkeypatch.setattr(progress_module, "LOG_INTERVAL_S", 0.3)
    for _ in progress(range(40), desc="short"):  # work shorter than the log's interval
        pass
    t0 = time.monotonic()
    for _ in progress(range(40), desc="long"):
        time.sleep(0.025)  # 1 s in all
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert "long: 100%" in err and "40/40" in err
    if terminal:
        assert "short: 100%" in err and err.count("long:") >= 5  # tqdm's redraws, at most 0.1 s apart
    else:  # after 0.3 s, at most every 0.3 s, and the end
        assert "short:" not in err and 2 <= err.count("long:") <= elapsed / 0.3 + 1


def test_labels_with_few_training_texts_are_named_before_training() -> None:
    pairs = [(f"common text {k}", "common") for k in range(60)] + [(f"other text {k}", "other") for k in range(60)]
    pairs += [("the one rare text", "rare")]
    ds = make_dataset(pairs, "x")
    y_train = list(ds.train.labels)
    (line,) = rare_labels(ds, list(range(len(y_train))))
    n = y_train.count(ds.labels.index("rare"))
    assert line.startswith(f"label 'rare' has {n} training text") and "add examples" in line
    others = [t for t, k in enumerate(y_train) if ds.labels[k] != "common"]  # the training texts used
    assert rare_labels(ds, others)[0].startswith("label 'common' has 0")


def test_feature_cache_survives_a_file_cut_short(tmp_path: Path, tiny_backbone_dir: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A run stopped while the cache was written left a part the next run failed on: files are now written whole,
    and one that cannot be read is computed again."""
    backbone = Backbone(str(tiny_backbone_dir), max_length=16)
    texts = ["one text", "another text", "a third one"]
    first = extract(backbone, texts, cache_dir=tmp_path, source="tiny")
    (path,) = tmp_path.iterdir()  # the cache file alone: no temporary file left
    assert "cached in" in capsys.readouterr().out
    assert torch.equal(extract(backbone, texts, cache_dir=tmp_path, source="tiny").flat, first.flat)
    assert "3 texts from the cache" in capsys.readouterr().out
    path.write_bytes(path.read_bytes()[:100])
    assert torch.equal(extract(backbone, texts, cache_dir=tmp_path, source="tiny").flat, first.flat)
    out = capsys.readouterr()
    assert "unreadable" in out.err and "computing them again" in out.err and "cached in" in out.out
    assert torch.equal(extract(backbone, texts, cache_dir=tmp_path, source="tiny").flat, first.flat)


def test_features_are_each_texts_states_in_one_buffer_and_subsets_share_it(tiny_backbone_dir: Path) -> None:
    backbone = Backbone(str(tiny_backbone_dir), max_length=16)
    texts = ["a short text", "Long one. " * 30, "x", "and a third, somewhat longer text than the first"] * 3
    feats = extract(backbone, texts, batch_size=5)  # batches in order of length, across the texts' order
    assert len(feats) == len(texts) and int(feats.lengths()[1]) > 16  # the long text has several chunks
    for t, text in enumerate(texts):
        alone = backbone([text])
        assert torch.equal(feats.get(t), alone.hidden[0, : alone.lengths[0]].half())  # [n_t e d] as computed alone
    part = feats.subset([5, 2, 0])
    assert part.flat.data_ptr() == feats.flat.data_ptr()  # no copy
    assert [torch.equal(part.get(r), feats.get(t)) for r, t in enumerate([5, 2, 0])] == [True] * 3
    assert part.lengths().tolist() == [int(feats.lengths()[t]) for t in (5, 2, 0)]


def test_a_failed_evaluation_keeps_the_trained_head(tmp_path: Path, tiny_backbone_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from service.training import pipeline

    def failing(*args: object) -> None:
        raise RuntimeError("the probe failed")

    monkeypatch.setattr(pipeline, "evaluate_features", failing)
    res = CliRunner().invoke(app, ["train", "toy", "--out", str(tmp_path / "repo"), *toy_args(tmp_path,
                                                                                            tiny_backbone_dir)])
    assert isinstance(res.exception, RuntimeError) and "evaluation failed; the head is written" in res.output
    manifest, _ = load_model(tmp_path / "repo" / "toy")  # a model that serves, its evaluation still to add
    assert manifest.evaluation == {}


@pytest.mark.parametrize(("option", "value"), [("--batch-size", "0"), ("--max-lr", "-1"), ("--n-hid", "1"),
                                               ("--n-iters", "0"), ("--d-hid", "0"), ("--max-train", "0"),
                                               ("--max-batch-positions", "0")])
def test_a_training_setting_out_of_range_exits_2_before_any_work(tmp_path: Path, option: str, value: str) -> None:
    """The first four failed with a traceback (after reading the data and the backbone), the others were taken as
    their defaults without a word."""
    (tmp_path / "d.csv").write_text("text,label\na,x\nb,y\n")
    res = CliRunner().invoke(app, ["train", "x", "--out", str(tmp_path / "repo"), "--data", str(tmp_path / "d.csv"),
                                   option, value])
    assert res.exit_code == 2 and f"Invalid value for '{option}'" in said(res), res.output


def multi_label_args(tmp_path: Path, backbone: Path) -> list[str]:
    """Options of ``train --multi-label`` for 180 texts with one or two of three labels (``|``-separated)."""
    rows = [("good great fine lovely", "pos"), ("bad awful terrible poor", "neg"),
            ("good great loud noisy", "loud|pos"), ("bad awful loud noisy", "neg|loud")]
    write_toy_csv(tmp_path / "multi.csv", rows, 180, "tags")
    return ["--data", str(tmp_path / "multi.csv"), "--label-column", "tags", "--multi-label", "--label-separator",
            "|", "--backbone", str(backbone), "--max-length", "16", "--n-hid", "4", "--d-hid", "8", "--epochs", "3",
            "--batch-size", "16", "--cache", str(tmp_path / "cache")]


def test_train_multi_label(tmp_path: Path, tiny_backbone_dir: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["train", "tags", "--out", str(tmp_path / "repo"), *multi_label_args(tmp_path,
                                                                                                  tiny_backbone_dir)])
    assert res.exit_code == 0, res.output
    assert "validation micro-f1" in res.output and "routing head micro-F1" in res.output
    folder = tmp_path / "repo" / "tags"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["problem_type"] == "multi_label_classification" and manifest["labels"] == ["loud", "neg", "pos"]
    ev = manifest["evaluation"]
    assert manifest["thresholds"] == ev["thresholds"] and len(ev["thresholds"]) == 3
    assert all(0 < t < 1 for t in ev["thresholds"])
    assert {"micro_f1", "macro_f1", "per_label_f1", "exact_match"} <= set(ev["head"])
    assert ev["head"]["n"] == ev["probe_all_layers"]["test"]["n"] > 0
    assert ev["margin_micro_f1"] == ev["head"]["micro_f1"] - ev["probe_all_layers"]["test"]["micro_f1"]
    assert "val_micro_f1" in manifest["training"]["history"][0] and "best_val_micro_f1" in manifest["training"]
    assert manifest["training"]["data"]["label_separator"] == "|"
    res = runner.invoke(app, ["evaluate", str(folder), "--cache", str(tmp_path / "cache")])  # re-evaluated alike
    assert res.exit_code == 0, res.output
    again = json.loads((folder / "manifest.json").read_text())
    assert again["evaluation"]["head"] == ev["head"] and again["thresholds"] == manifest["thresholds"]
    for extra, says in ((["--search"], "--search trains single-label heads only"),):
        bad = runner.invoke(app, ["train", "tags2", "--out", str(tmp_path / "repo"),
                                  *multi_label_args(tmp_path, tiny_backbone_dir), *extra])
        assert bad.exit_code == 2 and says in said(bad), bad.output
    bad = runner.invoke(app, ["train", "x", "--out", str(tmp_path / "repo"), "--preset", "tweet-sentiment",
                              "--multi-label"])
    assert bad.exit_code == 2 and "is single-label: leave out --multi-label" in said(bad), bad.output
    bad = runner.invoke(app, ["train", "x", "--out", str(tmp_path / "repo"), "--preset", "bbc-news-digests"])
    assert bad.exit_code == 2 and "is multi-label: add --multi-label" in said(bad), bad.output


def test_multi_label_dataset_sets_conflicts_and_targets() -> None:
    pairs = [(f"text {k}", ["a", "b|a", "c", "a| b "][k % 4]) for k in range(200)]
    pairs += [("same set", "a|b"), ("same set", "b|a"), ("two sets", "a"), ("two sets", "a|c")]
    ds = make_dataset(pairs, "x", "|")
    assert ds.labels == ["a", "b", "c"] and ds.multi_label and ds.dropped_conflicts == 1  # "two sets" only
    everything = {t: s for split in (ds.train, ds.validation, ds.test)
                  for t, s in zip(split.texts, split.sets or [], strict=True)}
    assert everything["same set"] == (0, 1) and everything["text 3"] == (0, 1) and everything["text 2"] == (2,)
    y = ds.train.targets(3)
    assert y.shape == (len(ds.train.texts), 3) and y.sum() == sum(len(s) for s in ds.train.sets or [])


def test_f1_scores_and_thresholds_chosen_on_validation() -> None:
    y = np.array([[1, 0], [1, 1], [0, 1], [0, 0]], dtype=np.float32)
    got = f1_scores(y, np.array([[1, 0], [1, 0], [0, 1], [1, 0]], dtype=bool))
    assert got["micro_f1"] == pytest.approx(2 * 3 / (2 * 3 + 1 + 1))  # tp 3, fp 1, fn 1
    assert got["per_label_f1"] == pytest.approx([2 * 2 / (2 * 2 + 1), 2 * 1 / (2 * 1 + 1)])
    assert got["exact_match"] == 0.5
    probs = np.array([[0.3, 0.1], [0.35, 0.9], [0.1, 0.8], [0.2, 0.7]], dtype=np.float32)
    low, high = choose_thresholds(probs, y)
    assert 0.2 < low <= 0.3 and 0.7 < high <= 0.8  # the cuts that separate each label's texts
    assert f1_scores(y, probs >= np.array([low, high]))["micro_f1"] == 1.0
