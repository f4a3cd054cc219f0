"""The names things go by across the server: a loaded head's key, the model a key belongs to, what makes models
share a backbone and the name of that backbone group. Plain functions of a model's manifest (no torch, no HTTP)."""

from __future__ import annotations

from service.modeling.manifest import Manifest


def backbone_key(manifest: Manifest) -> tuple[str, str]:
    """What makes two models share a loaded backbone: the same source and revision (device and dtype are
    the server's, the same for every model)."""
    return manifest.backbone.source, manifest.backbone.revision


def head_key(name: str, generation: int = 0) -> str:
    """A loaded head's key: the model's name, and ``name#n`` for its n-th reload (the old head answers what was
    accepted before the reload while the new one takes what comes after, both on the same backbone)."""
    return name if generation == 0 else f"{name}#{generation}"


def model_of(key: str) -> str:
    """The model's name of a head's key (names never hold ``#``: see the manifest's pattern)."""
    return key.partition("#")[0]


def group_name(manifest: Manifest) -> str:
    """The name of the backbone group ``manifest``'s model loads on, in logs and metrics (``name@revision``)."""
    return f"{manifest.backbone.name}@{manifest.backbone.revision}"
