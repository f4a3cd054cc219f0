"""The model function behind the peer frameworks (``service.bench.peers.Model``) is this version's engine as the
service runs it: the service's shape buckets on the device (``PEER_BUCKETS``; on a CPU, ``eager`` pads them as a
GPU would), the texts handed over tokenized, answering what the engine answers for the same texts."""

from pathlib import Path

import pytest

from service.bench.peers import Model
from service.serving.core.work import Task
from service.serving.engine.engine import Engine
from tests.conftest import write_tiny_model

TEXTS = ["short text", "a medium sized sentence, with a comma; and more words", "x", "one two three four five"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, tiny_backbone_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("peers")
    write_tiny_model(root, tiny_backbone_dir, name="tiny")
    return root / "tiny"


@pytest.mark.parametrize("buckets", ["off", "eager"])
def test_the_peers_model_runs_the_engine_as_served_and_answers_as_it(folder: Path, buckets: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"MODEL": str(folder), "DEVICE": "cpu", "BUCKETS": buckets, "MAX_BATCH_SIZE": "8"}.items():
        monkeypatch.setenv(f"PEER_{name}", value)
    model = Model()
    got = model(TEXTS)
    stats = model.engine.bucket_stats
    if buckets == "off":
        assert stats is None
    else:  # the batch went whole to a bucket, not as chunks
        assert stats is not None and stats.bucketed == 1 and stats.unfit == 0
    ref = Engine.load(folder, device="cpu").run([Task(t) for t in TEXTS])
    assert [g["label"] for g in got] == [r.label for r in ref]
    for g, r in zip(got, ref, strict=True):
        assert g["scores"].keys() == r.scores.keys()
        assert max(abs(p - r.scores[k]) for k, p in g["scores"].items()) <= 1e-5
