import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.modeling.encoding import Truncation
from service.modeling.head import RoutingHead
from service.modeling.repository import ModelLoadError, discover, load_model, read_manifest
from tests.conftest import edit_manifest, write_tiny_model

PAPER_NAMES = {"W", "B"} | {f"route.{r}.{p}" for r in range(3) for p in
                            ["CONST_ones_over_n_out", "W_A", "B_A", "W_F1", "W_F2", "B_F2", "W_G1", "W_G2", "B_G2",
                             "W_S", "B_S"]} | {
    "route.0.compute_beta_use.weight", "route.0.compute_beta_use.bias", "route.0.compute_beta_ign.weight",
    "route.0.compute_beta_ign.bias", "route.1.beta_use", "route.1.beta_ign", "route.2.beta_use", "route.2.beta_ign"}


def test_head_uses_the_paper_parameter_names_and_loads_them_strictly(tmp_path: Path) -> None:
    head = RoutingHead(7, 32, 4, n_hid=8, d_hid=16)
    assert set(head.state_dict()) == PAPER_NAMES
    assert head.W.shape == (7, 32) and (head.W == 1).all() and (head.B == 0).all()
    # a head saved by other code under the paper's names loads strictly
    foreign = {k: torch.randn_like(v) for k, v in head.state_dict().items()}
    save_file(foreign, str(tmp_path / "w.safetensors"))
    other = RoutingHead(7, 32, 4, n_hid=8, d_hid=16)
    other.load_state_dict(load_file(str(tmp_path / "w.safetensors")), strict=True)
    torch.testing.assert_close(other.route[2].W_F1, foreign["route.2.W_F1"])


def test_loads_and_discovers(tiny_repo: Path) -> None:
    assert discover(tiny_repo) == ["tiny"]
    manifest, clf = load_model(tiny_repo / "tiny")
    assert manifest.labels == clf.labels == ["alpha", "beta", "gamma"]
    assert clf.predict(["hello"]).logits.shape == (1, 3)


@pytest.fixture
def broken(tmp_path: Path, tiny_backbone_dir: Path) -> Path:
    return write_tiny_model(tmp_path, tiny_backbone_dir)


def expect(folder: Path, file: str, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message) as e:
        load_model(folder)
    assert str(e.value).startswith(str(folder / file) if file else str(folder))


def test_missing_manifest(broken: Path) -> None:
    (broken / "manifest.json").unlink()
    expect(broken, "manifest.json", "missing manifest file")


def test_invalid_json(broken: Path) -> None:
    (broken / "manifest.json").write_text("{not json")
    expect(broken, "manifest.json", "not valid JSON")


def test_invalid_field(broken: Path) -> None:
    edit_manifest(broken, labels=["only-one"])
    expect(broken, "manifest.json", "labels")


def test_name_must_match_folder(broken: Path) -> None:
    edit_manifest(broken, name="other")
    expect(broken, "manifest.json", "differs from its folder")


def test_missing_weights(broken: Path) -> None:
    (broken / "head.safetensors").unlink()
    expect(broken, "head.safetensors", "missing head weights file")


def test_corrupt_weights(broken: Path) -> None:
    (broken / "head.safetensors").write_bytes(b"garbage")
    expect(broken, "head.safetensors", "unreadable")


def test_label_count_mismatch(broken: Path) -> None:
    edit_manifest(broken, labels=["a", "b", "c", "d"])
    expect(broken, "head.safetensors", "3 classes but the manifest lists 4 labels")


def test_wrong_shapes(broken: Path) -> None:
    data = json.loads((broken / "manifest.json").read_text())
    data["head"]["d_hid"] = 24
    (broken / "manifest.json").write_text(json.dumps(data))
    expect(broken, "head.safetensors", "wrong shapes")


def test_missing_parameter(broken: Path) -> None:
    state = load_file(str(broken / "head.safetensors"))
    del state["route.1.W_A"]
    save_file(state, str(broken / "head.safetensors"))
    expect(broken, "head.safetensors", r"missing \['route.1.W_A'\]")


def test_unknown_backbone(broken: Path) -> None:
    data = json.loads((broken / "manifest.json").read_text())
    data["backbone"]["source"] = "package:no_such_backbone_pkg"
    (broken / "manifest.json").write_text(json.dumps(data))
    expect(broken, "manifest.json", "unknown or unloadable backbone.*not installed")
    data["backbone"]["source"] = str(broken / "nowhere")
    (broken / "manifest.json").write_text(json.dumps(data))
    expect(broken, "manifest.json", "unknown or unloadable backbone")


def test_backbone_shape_mismatch(broken: Path) -> None:
    data = json.loads((broken / "manifest.json").read_text())
    data["backbone"]["d_depth"] = 5
    (broken / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError):
        load_model(broken)


def test_missing_folder(tmp_path: Path) -> None:
    expect(tmp_path / "absent", "", "no such model folder")
    with pytest.raises(ModelLoadError, match="does not exist"):
        discover(tmp_path / "absent")


def test_manifest_round_trip(broken: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy" / "tiny"
    shutil.copytree(broken, copy)
    assert read_manifest(copy) == read_manifest(broken)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_fail_loading_naming_the_tensor(broken: Path, value: float) -> None:
    path = broken / "head.safetensors"
    state = load_file(str(path))
    state["route.1.W_F2"][3, 2] = value
    save_file(state, str(path))
    expect(broken, "head.safetensors", r"non-finite values \(NaN or Inf\) in tensor route\.1\.W_F2 \(1 of ")


def test_unknown_hub_backbone_fails_fast_without_the_hub(broken: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline mode or an unreachable hub: only the local cache is asked, which fails at once
    (transformers' own retries took about a minute)."""
    import time

    data = json.loads((broken / "manifest.json").read_text())
    data["backbone"]["source"] = "someone/no-such-backbone"
    (broken / "manifest.json").write_text(json.dumps(data))
    for offline in ("1", None):
        if offline is None:
            monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
            monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
        else:
            monkeypatch.setenv("HF_HUB_OFFLINE", offline)
        t0 = time.monotonic()
        expect(broken, "manifest.json", "someone/no-such-backbone.*not in the local cache")
        assert time.monotonic() - t0 < 10


def test_the_fronts_tokenizer_cuts_texts_as_the_backbones_own(tiny_backbone_dir: Path) -> None:
    """ChunkTokenizer reads tokenizer.json without transformers; ids, offsets, words and chunks equal those of
    the backbone's Hugging Face tokenizer."""
    from service.modeling.backbone import Backbone
    from service.modeling.tokenizer import ChunkTokenizer

    texts = ["Hello, world! Ünïcödé and emojis 🙂 here.", "word " * 40, "x"]
    front = ChunkTokenizer.load(str(tiny_backbone_dir))
    backbone = Backbone(str(tiny_backbone_dir), max_length=16)
    assert front.max_length == 64 and backbone.max_length == 16
    for length in (16, 24, None):
        assert front.encode(texts, length) == backbone.chunker.encode(texts, length)
    hf = backbone.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    for t, enc in enumerate(front.encode(texts)):
        body = [i for c, s in zip([i for ch in enc.chunks for i in ch], enc.special, strict=True) if not s for i in [c]]
        assert body == hf["input_ids"][t]
        assert [o for o, s in zip(enc.offsets, enc.special, strict=True) if not s] == [tuple(o) for o in
                                                                                    hf["offset_mapping"][t]]
        assert front.token_names(enc) == backbone.tokenizer.convert_ids_to_tokens([i for c in enc.chunks for i in c])


@pytest.mark.parametrize("truncation", [None, Truncation("right"), Truncation("left"), Truncation("left", 7)])
def test_without_spans_the_tokenizer_cuts_the_same_ids_and_keeps_nothing_else(tiny_backbone_dir: Path,
                                                                             truncation: Truncation | None) -> None:
    """A text asking no credit is tokenized without character offsets (the tokenizer's faster call): its chunks
    are those of the full encoding, at every length, texts of one chunk and of several, and nothing else is kept."""
    from service.modeling.tokenizer import ChunkTokenizer

    texts = ["Hello, world! Ünïcödé and emojis 🙂 here.", "word " * 40, "x", "", "  spaced\tout\n text  ",
             "中文字符 mixed with English and accents: café, naïve."]
    chunker = ChunkTokenizer.load(str(tiny_backbone_dir))
    full = chunker.encode_lengths(texts, [12, 16, 64], truncation)
    bare = chunker.encode_lengths(texts, [12, 16, 64], truncation, spans=False)
    assert [sorted(f) for f in full] == [sorted(b) for b in bare] == [[12, 16, 64]] * len(texts)
    for f, b in zip(full, bare, strict=True):
        for length in f:
            assert b[length].chunks == f[length].chunks
            assert b[length].bare and not f[length].bare
    if truncation is None:  # a text that fits one chunk of the shortest length shares its encoding at every length
        assert bare[2][12] is bare[2][16] is bare[2][64]
        assert len(bare[1][12].chunks) > 1
