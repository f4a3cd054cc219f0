"""A model folder's manifest (labels, backbone, head, chunk length, training and evaluation records) and the
repository's folders, without torch: the server's front reads them, the backbone's process loads weights."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from service.files import replace_file

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


ProblemType = Literal["single_label_classification", "multi_label_classification"]
"""What a head's scores mean (Hugging Face's ``problem_type`` names): one label of all (probabilities by softmax), or
each label on its own (a probability per label by sigmoid, the labels over their thresholds predicted)."""

MODEL_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,199}$")  # a model's name, also its folder's
NAME_RULE = "lowercase letters, digits, '.', '_' and '-', starting with a letter or digit, at most 200 characters"


class HeadSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n_hid: int = Field(64, ge=2)
    d_hid: int = Field(gt=0)
    n_iters: int = Field(2, ge=1)


class Manifest(BaseModel):
    """Everything needed to rebuild, serve and judge one model."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=MODEL_NAME.pattern)
    task: str = "text-classification"
    description: str = ""
    labels: list[str] = Field(min_length=2)
    backbone: BackboneSpec
    head: HeadSpec
    max_length: int = Field(256, gt=2, description="Tokens per chunk, special tokens included")
    problem_type: ProblemType = "single_label_classification"
    thresholds: list[float] | None = Field(None, description="Multi-label: each label's probability threshold (chosen "
                                           "on validation), aligned with ``labels``")
    token_lengths: list[int] | None = Field(None, description="The training texts' chunk lengths in tokens, their "
                                            "quantiles at service.modeling.buckets.QUANTILES (every 2 %, finer in the "
                                            "tail): what a server chooses its shape buckets for")
    training: dict[str, Any] = Field(default_factory=dict)
    evaluation: dict[str, Any] = Field(default_factory=dict)

    @field_validator("labels")
    @classmethod
    def _unique_labels(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("labels must be unique")
        return v

    @model_validator(mode="after")
    def _thresholds(self) -> Manifest:
        if self.thresholds is not None and (self.problem_type != "multi_label_classification"
                                            or len(self.thresholds) != len(self.labels)):
            raise ValueError("thresholds: one per label, and only for problem_type multi_label_classification")
        return self

    @property
    def multi_label(self) -> bool:
        return self.problem_type == "multi_label_classification"

    def over_threshold(self, probs: list[float]) -> list[str]:
        """The labels a multi-label model predicts from its probabilities: each at or over its threshold (0.5
        where none was chosen)."""
        cut = self.thresholds or [0.5] * len(self.labels)
        return [label for label, p, c in zip(self.labels, probs, cut, strict=True) if p >= c]


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


def discover(repository: Path) -> list[str]:
    """Names of the model folders (those with a manifest) in ``repository``, sorted."""
    if not repository.is_dir():
        raise ModelLoadError(repository, "model repository folder does not exist")
    return sorted(p.name for p in repository.iterdir() if (p / MANIFEST).is_file())


def write_manifest(folder: Path, manifest: Manifest) -> None:
    """Write ``folder/manifest.json`` whole (:func:`service.files.replace_file`)."""
    replace_file(folder / MANIFEST, (json.dumps(manifest.model_dump(), indent=2) + "\n").encode())
