"""The model repository: one folder per servable model, holding ``manifest.json`` and
``head.safetensors``. Loading validates everything and names the file and the problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from service.modeling.backbone import Backbone, BackboneError
from service.modeling.classifier import RoutingClassifier
from service.modeling.head import RoutingHead

MANIFEST = "manifest.json"
WEIGHTS = "head.safetensors"


class ModelLoadError(RuntimeError):
    """A model folder is missing something or holds something inconsistent."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = path, problem


class BackboneSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str = Field(description="Local directory, hub id, or package:<module> shipping the weights")
    name: str = Field(description="Human-readable name of the pretrained encoder")
    revision: str = Field(description="Version or revision of the weights")
    d_depth: int = Field(gt=0, description="Hidden states per position: embeddings + layers")
    d_emb: int = Field(gt=0)


class HeadSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n_hid: int = Field(64, ge=2)
    d_hid: int = Field(gt=0)
    n_iters: int = Field(2, ge=1)


class Manifest(BaseModel):
    """Everything needed to rebuild, serve and judge one model."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    task: str = "text-classification"
    description: str = ""
    labels: list[str] = Field(min_length=2)
    backbone: BackboneSpec
    head: HeadSpec
    max_length: int = Field(256, gt=2, description="Tokens per chunk, special tokens included")
    training: dict[str, Any] = Field(default_factory=dict)
    evaluation: dict[str, Any] = Field(default_factory=dict)

    @field_validator("labels")
    @classmethod
    def _unique_labels(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("labels must be unique")
        return v


def read_manifest(folder: Path) -> Manifest:
    """Parse and validate ``folder/manifest.json``."""
    path = folder / MANIFEST
    if not path.is_file():
        raise ModelLoadError(path, "missing manifest file")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(path, f"not valid JSON: {e}") from e
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ModelLoadError(path, f"invalid manifest: {problems}") from e
    if manifest.name != folder.name:
        raise ModelLoadError(path, f"manifest name {manifest.name!r} differs from its folder {folder.name!r}")
    return manifest


def build_head(manifest: Manifest) -> RoutingHead:
    b, h = manifest.backbone, manifest.head
    return RoutingHead(b.d_depth, b.d_emb, len(manifest.labels), n_hid=h.n_hid, d_hid=h.d_hid, n_iters=h.n_iters)


def load_head(folder: Path, manifest: Manifest) -> RoutingHead:
    """Build the head the manifest describes and load its weights strictly."""
    path = folder / WEIGHTS
    if not path.is_file():
        raise ModelLoadError(path, "missing head weights file")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(path, f"unreadable safetensors file: {e}") from e
    head = build_head(manifest)
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(path, f"parameter names differ from the manifest's head: missing {missing[:5]}, "
                                   f"unexpected {unexpected[:5]}")
    n_out = state["route.2.W_F1"].shape[0]
    if n_out != len(manifest.labels):
        raise ModelLoadError(path, f"head has {n_out} classes but the manifest lists {len(manifest.labels)} labels")
    wrong = [f"{k}: {list(state[k].shape)} != {list(v.shape)}" for k, v in expected.items()
             if state[k].shape != v.shape]
    if wrong:
        raise ModelLoadError(path, f"wrong shapes for the manifest's head config: {'; '.join(wrong[:5])}")
    bad = [f"{k} ({int((~torch.isfinite(v)).sum())} of {v.numel()})" for k, v in state.items()
           if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise ModelLoadError(path, f"non-finite values (NaN or Inf) in tensor {', '.join(bad[:5])}")
    head.load_state_dict(state, strict=True)
    return head.eval().requires_grad_(False)


def load_model(folder: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               backbone: Backbone | None = None) -> tuple[Manifest, RoutingClassifier]:
    """Load and validate one model folder; the head always runs in float32."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(folder, "no such model folder")
    manifest = read_manifest(folder)
    head = load_head(folder, manifest)
    if backbone is None:
        try:
            backbone = Backbone(manifest.backbone.source, max_length=manifest.max_length, device=device, dtype=dtype)
        except BackboneError as e:
            raise ModelLoadError(folder / MANIFEST, f"unknown or unloadable backbone: {e}") from e
    if (backbone.d_depth, backbone.d_emb) != (manifest.backbone.d_depth, manifest.backbone.d_emb):
        raise ModelLoadError(folder / MANIFEST, f"backbone gives [d_depth={backbone.d_depth}, d_emb={backbone.d_emb}]"
                             f" but the manifest says [{manifest.backbone.d_depth}, {manifest.backbone.d_emb}]")
    return manifest, RoutingClassifier(backbone, head.to(backbone.device), manifest.labels)


def discover(repository: Path) -> list[str]:
    """Names of the model folders (those with a manifest) in ``repository``, sorted."""
    if not repository.is_dir():
        raise ModelLoadError(repository, "model repository folder does not exist")
    return sorted(p.name for p in repository.iterdir() if (p / MANIFEST).is_file())


def save_model(folder: Path, manifest: Manifest, head: RoutingHead) -> None:
    """Write ``manifest.json`` and ``head.safetensors`` (contiguous float32 tensors)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(state, str(folder / WEIGHTS))
    write_manifest(folder, manifest)


def write_manifest(folder: Path, manifest: Manifest) -> None:
    (folder / MANIFEST).write_text(json.dumps(manifest.model_dump(), indent=2) + "\n")
