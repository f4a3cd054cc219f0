"""The model repository: one folder per servable model, holding ``manifest.json`` and
``head.safetensors``. Loading validates everything and names the file and the problem."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from service.files import replace_file
from service.modeling.backbone import Backbone, BackboneError
from service.modeling.classifier import RoutingClassifier
from service.modeling.head import RoutingHead
from service.modeling.manifest import (
    MANIFEST,
    WEIGHTS,
    BackboneSpec,
    HeadSpec,
    Manifest,
    ModelLoadError,
    discover,
    read_manifest,
    write_manifest,
)

__all__ = ["MANIFEST", "WEIGHTS", "BackboneSpec", "HeadSpec", "Manifest", "ModelLoadError", "build_head", "discover",
           "load_head", "load_model", "read_manifest", "save_model", "write_manifest"]

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


def save_model(folder: Path, manifest: Manifest, head: RoutingHead) -> None:
    """Write ``head.safetensors`` (contiguous float32 tensors), then ``manifest.json``, each replacing its old file
    whole (:func:`service.files.replace_file`): a server watching the folder reloads once the manifest lands, and
    never reads a file half written. (safetensors' own ``save_file`` leaves the file readable by its owner alone.)"""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().cpu() for k, v in head.state_dict().items()}
    replace_file(folder / WEIGHTS, save(state))
    write_manifest(folder, manifest)
