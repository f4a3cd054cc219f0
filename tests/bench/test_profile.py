"""`bench profile` puts each py-spy sample in its part of the serving path: the deepest frame that belongs to a
part decides, the server's start is left out, and the backbone's process is told from the server's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.bench import profile
from service.bench.profile import MODEL, OTHER, SERVER, part_of, split
from service.cli import app

SERVER_PROC = 'process 101:"/venv/bin/python3 -m service serve"'
MODEL_PROC = 'process 102:"/venv/bin/python3 -m service.serving.engine.process 7"'
ROUTE = "classify_default (service/serving/api/routes/inference.py:83)"
HTTP = "RequestResponseCycle.run_asgi (uvicorn/protocols/http/httptools_impl.py:416)"


def test_the_deepest_frame_of_a_part_decides() -> None:
    tokenizing = [HTTP, ROUTE, "Planner.encode (service/serving/engine/planner.py:108)",
                  "ChunkTokenizer.encode_lengths (service/modeling/tokenizer.py:91)"]
    assert part_of(tokenizing) == "tokenize"
    assert part_of(tokenizing[:3]) == "inference layer"
    assert part_of([HTTP, "Observe.__call__ (service/serving/api/middleware.py:99)",
                    "Logger.info (logging/__init__.py:1489)"]) == "middleware and metrics"
    assert part_of([HTTP, "serialize_response (fastapi/routing.py:358)"]) == "response building"
    assert part_of([ROUTE, "explain_result (service/serving/pipeline/render.py:60)",
                    "words (service/modeling/views.py:40)"]) == "response building"  # not the model's code
    assert part_of(["_recv_bytes (multiprocessing/connection.py:430)"]) == "pipe and pickling"
    assert part_of(["Runner.run (asyncio/runners.py:118)"]) == "event loop and threads"
    assert part_of(["<module> (somewhere.py:1)"]) == OTHER
    assert part_of(["serve (service/cli.py:90)", "_find_and_load (<frozen importlib._bootstrap>:1176)"]) is None
    assert part_of(["Runner.run (asyncio/runners.py:118)",  # the full collection once the models have loaded
                    "tune_garbage_collector (service/serving/server.py:96)"]) is None


def test_samples_split_by_process_and_part() -> None:
    lines = [
        f"{SERVER_PROC};{HTTP};{ROUTE} 7",
        f"{SERVER_PROC};{HTTP};serialize_response (fastapi/routing.py:358) 2",
        f"{SERVER_PROC};{MODEL_PROC};_serve (service/serving/engine/process.py:131);"
        "run (service/serving/engine/engine.py:200);forward (torch/nn/modules/linear.py:125) 40",
        f"{SERVER_PROC};{MODEL_PROC};_serve (service/serving/engine/process.py:130);"
        "recv (multiprocessing/connection.py:250) 3",
        f"{SERVER_PROC};{MODEL_PROC};Engine.load (service/serving/engine/engine.py:90) 500",
        f"{SERVER_PROC};<lambda> (odd.py:3) 1",
        "not a sample line",
    ]
    parts, other = split(lines)
    assert parts[SERVER] == {"inference layer": 7, "response building": 2, OTHER: 1}
    assert parts[MODEL] == {"model compute": 40, "pipe and pickling": 3}  # loading left out
    assert other[SERVER] == {"<lambda> (odd.py:3)": 1} and not other[MODEL]


def test_without_py_spy_it_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profile, "py_spy", lambda: None)
    res = CliRunner().invoke(app, ["bench", "profile", "--duration", "1"])
    assert res.exit_code == 2 and "py-spy" in res.output and ".[bench]" in res.output, res.output


def test_the_pipe_and_its_pickling_are_timed_per_batch(tiny_repo: Path) -> None:
    texts = ["a short text", "another text, a little longer than the first one", "three"] * 4
    rows = profile.pipe_cost(tiny_repo / "tiny", [1, 8], texts, repeats=5)
    assert [r["batch_size"] for r in rows] == [1, 8]
    one, eight = rows
    # each further text adds its token ids (74 bytes a text here), not its spans and words (which add 144)
    added = (eight["request_bytes"] - one["request_bytes"]) / 7
    assert 20 < added < 110 and eight["answer_bytes"] > one["answer_bytes"]
    for r in rows:
        assert r["pickling_ms"] > 0 and r["pipe_round_trip_ms"] > 0 and r["compute_ms"] > 0
        per_batch = r["pickling_ms"] + r["pipe_round_trip_ms"]
        assert r["ms_per_text"] == pytest.approx(per_batch / r["batch_size"])
        assert r["share_of_compute"] == pytest.approx(per_batch / r["compute_ms"])


def test_several_texts_a_request_reach_the_load_and_the_pipes_batches(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    """``--per-request 16``: each client sends 16 texts a request, the pipe is timed at the batches those make (up to
    the server's largest), and the JSON says so."""
    levels: list[tuple[int, int]] = []

    def level(spy: str, c: int, seconds: float, rate: int, texts: list[str], logs: Path, per_request: int) -> dict:
        levels.append((c, per_request))
        return {"concurrency": c, "texts_per_request": per_request, "texts_per_s": 1.0, "mean_batch": 1.0,
                "texts_served": 1, "parts": {}, "other_frames": {}}

    sizes: list[list[int]] = []

    def pipe(folder: Path, batch_sizes: list[int], texts: list[str]) -> list[dict]:
        sizes.append(batch_sizes)
        return [{"batch_size": b, "share_of_compute": 0.0} for b in batch_sizes]

    monkeypatch.setattr(profile, "py_spy", lambda: "py-spy")  # (the bench extra's program: never run here)
    monkeypatch.setattr(profile, "profile_level", level)
    monkeypatch.setattr(profile, "pipe_cost", pipe)
    monkeypatch.setattr(profile, "sample_test_texts", lambda preset, n: ["a text"] * n)
    res = CliRunner().invoke(app, ["bench", "profile", "--concurrency", "1,8", "--per-request", "16", "--duration",
                                   "1", "--out", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    assert levels == [(1, 16), (8, 16)] and sizes == [[16, 32]]  # 8 x 16 texts: the server's batches of 32
    assert json.loads((tmp_path / "p.json").read_text())["settings"]["texts_per_request"] == 16
    assert "concurrency 8 x 16 text(s)" in res.output
    bad = CliRunner().invoke(app, ["bench", "profile", "--per-request", "65"])
    assert bad.exit_code == 2 and "less than or equal to 64" in " ".join(bad.output.split())
