"""Settings: every option of the service, each also an environment variable (prefix ROUTING_)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.threads import available_cpus

DType = Literal["auto", "float32", "float16", "bfloat16"]
DTYPES: tuple[str, ...] = get_args(DType)[1:]  # the precisions a backbone may run in (half: GPU only)
OTHER_MODELS = "_other"
"""The ``model`` label of every model whose metrics are not labelled one by one (see ``metrics_models``)."""
CPU_BATCH = (32, 8192)
"""``max_batch_size``, ``max_batch_tokens`` on a CPU: 32 texts (or chunks) in at most 8,192 tokens."""
GPU_BATCH = (1024, 16384)
"""On a GPU: 16,384 tokens (about 500 tweets), as text-embeddings-inference's default budget, and up to 1,024
chunks: a batch of fewer tokens leaves the device waiting on the host that launches its kernels."""
CPU_WAIT_MS = 5.0
"""``max_wait_ms`` on a CPU: a batch computes for tens of milliseconds there, and waiting 5 ms for the clients its
last answers bring back fills it."""
GPU_WAIT_MS = 1.0
"""On a GPU, where a captured batch of single texts computes in about a millisecond: with 5 ms, an H200 served
4,241 single-text requests/s at concurrency 32 and 11,155 at 256 (p99 13 and 35 ms); with 1 ms, 6,922 and 16,446
(p99 6.6 and 26 ms), in one run (``bench-results/gpu-h200-4-served-variant.json``)."""


def cuda_here() -> bool:
    """Whether a device on ``auto`` is a GPU here: this machine has an NVIDIA driver's device files (no torch
    imported to tell)."""
    return Path("/dev/nvidiactl").exists()


def on_gpu(settings: Settings) -> bool:
    """Whether the models compute on a GPU as ``settings`` say (``auto``: see :func:`cuda_here`)."""
    named = settings.devices or [settings.device]
    return any(d.startswith("cuda") or (d == "auto" and cuda_here()) for d in named)


def auto_fronts(settings: Settings) -> int:
    """The fronts ``ROUTING_WORKERS=auto`` chooses. One where the models compute on the CPU: there the fronts take
    the model's cores (on 2 cores two fronts served 0.95x one at c = 8 and 1.06x at c = 32, and took 134 MiB more:
    bench-results/serve-fronts-cpu-3.json), and one where a head cache is set (it needs one). On a GPU all but 4 of
    the usable CPUs (those left to the engine host, the model's process and the system), 2 to 8: there the device
    waits on the fronts, and more served more. On an H200 with 16 CPUs (bench-results/gpu-h200-3.json) 1, 2, 4 and
    8 fronts served 922, 1,033, 896 and 1,203 single-text requests/s to 32 clients and 1,171, 1,674, 1,767 and 1,860
    to 64; with 12 of them (gpu-h200-4.json, the load generator on the other 4), 8 fronts served 4,498 and 6,610
    to 32 and 64 clients in the same turns as 3,325 and 6,090 from 6 (one for every 2 CPUs, the rule before), and
    6 fronts took 0.18 ms of CPU a text of 16-text requests, the limit of the 32,391 texts/s they served."""
    if settings.head_cache_bytes is not None or not on_gpu(settings):
        return 1
    return max(2, min(8, available_cpus() - 4))


class Settings(BaseSettings):
    """Service configuration. ``ROUTING_MAX_BATCH_SIZE=64`` sets ``max_batch_size``, and so on.
    Lists are comma-separated: ``ROUTING_MODELS=tweet-sentiment,bbc-news-topics``."""

    model_config = SettingsConfigDict(env_prefix="ROUTING_", extra="forbid")

    # models
    model_repository: Path = Field(Path("models"), description="Folder with one sub-folder per model")
    models: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Models to load (all if empty)")
    default_model: str = Field("tweet-sentiment", description="Model behind /v1/classify and /v1/explain (not set, "
                               "and tweet-sentiment not served: the first model served; started without models, "
                               "the first to load)")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto | cpu | cuda[:n]")
    dtype: DType = Field("auto", description="Backbone precision: auto is bfloat16 on a GPU (the heads compute in "
                         "float32 there too, their matrix products in bfloat16 where shape buckets are captured), "
                         "float32 on a CPU; half precisions: GPU only")
    warmup: bool = Field(True, description="Run one batch per model before reporting ready")
    batch_invariance: Literal["off", "reductions", "kernels"] = Field(
        "off", description="On a GPU in bfloat16, how far a text's answer is kept from depending on the other texts "
        "of its batch (alone and among others it computes in products of other shapes, which round differently: on "
        "an H200 its probabilities moved by up to 0.005, and a near tie of 1,000 test tweets changed label in two "
        "runs of three; in float32 any batch agrees within 1e-5 whatever this says). off: as the libraries choose; "
        "reductions: cuBLAS adds the parts of a split product in float32; kernels: that, every product of the "
        "encoder and of the heads through Triton kernels whose order of summation does not depend on the batch, and "
        "attention through one kernel whatever the shapes (a CUDA device): on an H200 each of those tweets got the "
        "same probabilities to the bit alone and in any batch, at 0.81-0.84x the texts/s (texts asking for credit "
        "still compute with torch's products)")
    buckets: Literal["off", "auto", "eager", "cuda"] = Field(
        "auto", description="Plain batches (every text one chunk, one model, no credit) in shape buckets chosen "
        "for the lengths the models' manifests keep: cuda captures a CUDA graph per bucket before ready and replays "
        "it (a GPU, the backbone in bfloat16); eager pads them without capturing (to check on a CPU); auto is cuda "
        "where it can be, else off (on an H200: 1.7x the texts/s offline, batch-1 p50 1.2 against 6.6 ms, the same "
        "accuracy)")
    model_control: Literal["none", "explicit", "poll"] = Field(
        "none", description="Models at runtime (Triton's modes): none, only those loaded at start; explicit, "
        "loaded, reloaded and unloaded through /v2/repository with an admin key; poll, the repository folder is "
        "watched and new, changed or removed model folders are loaded, reloaded or unloaded")
    repository_poll_s: float = Field(10.0, gt=0, description="How often model_control=poll reads the repository")
    head_cache_bytes: int | None = Field(
        None, ge=0, description="Memory budget for head weights. Unset: the models of `models` (or the whole "
        "repository) load at start and stay. Set: every model folder of the repository serves, its head loaded on the "
        "first request that names it; beyond the budget the least recently used heads leave memory (and come back on "
        "demand); the models of `models` (default: default_model) load at start and are never evicted")
    admin_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Bearer keys for /v2/repository (model control), separate from api_keys")

    # HTTP
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    grpc_port: int = Field(8001, ge=0, le=65535, description="The Open Inference Protocol v2 over gRPC and the gRPC "
                           "health service (Triton's port); 0 turns gRPC off")
    log_json: bool = Field(False, description="One JSON object per log line")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    access_log: bool = Field(False, description="A log line for every HTTP request; off, only for those answered "
                             "with an error (4xx, 5xx)")
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Bearer keys for /v1")
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Origins whose pages may call the API from a browser (CORS), e.g. "
        "https://app.example.com; empty: none (no CORS headers). Credentials (cookies) are never allowed: an API key "
        "travels in the Authorization header the page sets")
    protect_metrics: bool = Field(False, description="Require an API key for /metrics too")
    metrics_models: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["pinned"], description="Models whose metrics carry their own model label: pinned "
        "(the default: the models loaded at start, i.e. `models`, or the whole repository, or with a head cache the "
        "pinned ones), all, or a comma-separated list. Every other model is counted under model=\"_other\" (the "
        "statistics extension, /v2/models/stats, keeps every model's own numbers): a thousand heads do not make a "
        "thousand series of each metric")

    # where and with how many threads the models compute
    model_process: bool = Field(True, description="Compute each model in a process of its own (the HTTP server, "
                                "tokenizer and batcher stay in the main one), so that the model's Python never "
                                "waits for the event loop's GIL; false: in a thread of the server's process")
    torch_threads: int | None = Field(None, ge=1, description="Torch intra-op threads (default: the CPUs this "
                                      "process may use: affinity mask, capped by a cgroup CPU quota)")
    batches_in_flight: Annotated[int, Field(ge=1, le=2)] | Literal["auto"] = Field(
        "auto", description="Batches a backbone's process holds at once (with model_process): 2 submits the next "
        "batch while the device computes one, so the host's work on it (receiving, planning, packing, launching) "
        "overlaps the device's; auto: 2 on a GPU, 1 on a CPU (where the host computes the batch itself)")
    model_replicas: int = Field(1, ge=1, description="Processes per model, each computing batches of its own "
                                "(needs model_process; torch threads default to the usable CPUs shared among them). "
                                "On small CPUs two processes of one thread served more than one of two threads; "
                                "each holds a copy of the model")
    devices: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Devices to serve every backbone on, one engine process on each (e.g. "
        "cuda:0,cuda:1): each batch goes to the first engine free, so texts go where the queue is shortest; empty: "
        "one engine on ``device``")
    workers: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto", description="Front processes on one port (HTTP and gRPC), each validating, tokenizing and rendering, "
        "over one engine host that batches every front's texts; auto: one where the models compute on the CPU or a "
        "head cache is set, on a GPU one for every 2 usable CPUs (2 to 8)")
    omp_wait_policy: Literal["active", "passive"] | None = Field(
        None, description="How idle OpenMP threads wait (OMP_WAIT_POLICY; default: the runtime's own, a short "
        "spin then sleep); applies when set before torch loads, as `routing-service serve` does")
    omp_spin_count: int | None = Field(
        10000, ge=0, description="How long idle OpenMP threads spin before they sleep (GOMP_SPINCOUNT, GNU OpenMP as "
        "in torch's Linux wheels; ignored where the environment sets GOMP_SPINCOUNT; 0: the runtime's own). A short "
        "spin frees the cores for the HTTP front while a batch fills: 2-4% more texts/s at concurrency 8 and 32 here")

    # batching
    max_batch_size: int | None = Field(None, ge=1, description="Chunks per batch (a text, or max_length tokens of a "
                                       f"longer one); default {CPU_BATCH[0]} on a CPU, {GPU_BATCH[0]} on a GPU")
    max_batch_tokens: int | None = Field(None, ge=16, description="Tokens per batch, special tokens included, no "
                                         "padding counted (the encoder packs the texts into one stream); default "
                                         f"{CPU_BATCH[1]} on a CPU, {GPU_BATCH[1]} on a GPU")
    max_wait_ms: float | None = Field(None, ge=0, description="How long a batch waits for its next chunk while it "
                                      "fills (from when the model is free; in all at most this or a tenth of the last "
                                      f"batch's compute); default {CPU_WAIT_MS:g} on a CPU, {GPU_WAIT_MS:g} on a GPU")
    max_queue: int = Field(1024, ge=1, description="Texts waiting; beyond it requests get 503")

    # request limits
    max_inputs: int = Field(64, ge=1, description="Texts per request")
    max_chars: int = Field(20000, ge=1, description="Characters per text")
    max_text_tokens: int | None = Field(None, ge=1, description="Tokens per text, special tokens of every chunk "
                                        "included (413 above; none: only max_chars limits a text)")
    max_body_bytes: int = Field(2_000_000, ge=1024, description="Request body size, as sent and once decompressed")
    body_timeout_s: float = Field(30.0, gt=0, description="Time to receive a request body (408 after)")
    header_timeout_s: float = Field(10.0, gt=0, description="Time to receive a request's head after connecting "
                                    "or starting it (408 after)")
    max_headers: int = Field(100, ge=8, description="Request headers per request (431 above)")
    max_header_bytes: int = Field(32768, ge=1024, description="Bytes of request headers, names and values (431 above)")
    request_timeout_s: float = Field(30.0, gt=0, description="Default deadline of a request")
    max_request_timeout_s: float = Field(120.0, gt=0, description="Largest deadline a client may ask for")
    max_explain_elements: int = Field(2_000_000, ge=1, description="Largest full credit/phi payload (numbers)")
    drain_timeout_s: float = Field(30.0, ge=0, description="On SIGTERM, time to answer accepted requests")

    def engine_devices(self) -> list[str]:
        """The device of each engine process of a backbone: ``devices``, else ``device`` once per replica."""
        return self.devices or [self.device] * self.model_replicas

    def in_flight(self, device: str) -> int:
        """Batches a backbone's process on ``device`` (a torch device's name, or auto) holds at once."""
        if self.batches_in_flight != "auto":
            return self.batches_in_flight
        return 2 if device.startswith("cuda") or (device == "auto" and cuda_here()) else 1

    def batch_wait_ms(self, device: str) -> float:
        """``max_wait_ms`` for a backbone on ``device`` (a torch device's name): as set, else the device's default."""
        if self.max_wait_ms is not None:
            return self.max_wait_ms
        return CPU_WAIT_MS if device.startswith("cpu") else GPU_WAIT_MS

    def batch_limits(self, device: str) -> tuple[int, int]:
        """``max_batch_size``, ``max_batch_tokens`` for a backbone on ``device`` (a torch device's name): as set, else
        the device's defaults."""
        size, tokens = CPU_BATCH if device.startswith("cpu") else GPU_BATCH
        return self.max_batch_size or size, self.max_batch_tokens or tokens

    @model_validator(mode="after")
    def _replicas_need_processes(self) -> Settings:
        if self.model_replicas > 1 and not self.model_process:
            raise ValueError("model_replicas > 1 needs model_process (replicas are processes)")
        return self

    @model_validator(mode="after")
    def _devices_are_processes(self) -> Settings:
        for d in self.devices:
            if not re.fullmatch(r"cpu|cuda(:\d+)?", d):
                raise ValueError(f"devices: {d!r} is not cpu or cuda[:n]")
        if len(self.devices) > 1 and not self.model_process:
            raise ValueError("devices: several need model_process (an engine process on each)")
        if len(self.devices) > 1 and self.model_replicas > 1:
            raise ValueError("devices and model_replicas > 1: name a device once per engine process instead (e.g. "
                             "cpu,cpu for two processes on the CPU)")
        return self

    @model_validator(mode="after")
    def _fronts_without_head_cache(self) -> Settings:
        if self.workers == "auto":
            self.workers = auto_fronts(self)
        if self.workers > 1 and self.head_cache_bytes is not None:
            raise ValueError("workers > 1 and a head cache: not built yet (a head cache needs one front)")
        return self

    @model_validator(mode="after")
    def _control_needs_admin_keys(self) -> Settings:
        if self.model_control == "explicit" and not self.admin_keys:
            raise ValueError("model_control=explicit needs admin_keys (ROUTING_ADMIN_KEYS): loading and unloading "
                             "models is not open to every client")
        overlap = set(self.admin_keys) & set(self.api_keys)
        if overlap:
            raise ValueError("admin_keys and api_keys must differ: an inference key must not control models")
        return self

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        for origin in v:
            if origin != "*" and (not origin.startswith(("http://", "https://")) or origin.rstrip("/") != origin
                                  or origin.count("/") != 2):
                raise ValueError(f"a CORS origin is scheme://host[:port] with no path or trailing slash, or *; got "
                                 f"{origin!r}")
        return v

    @field_validator("metrics_models")
    @classmethod
    def _metrics_models(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("metrics_models: pinned, all, or a comma-separated list of models")
        if len(v) > 1 and ({"pinned", "all"} & set(v)):
            raise ValueError("metrics_models: pinned or all alone, or a list of models")
        if OTHER_MODELS in v:
            raise ValueError(f"metrics_models: {OTHER_MODELS} is the label of the models not listed")
        return v

    @field_validator("models", "api_keys", "admin_keys", "cors_origins", "metrics_models", "devices", mode="before")
    @classmethod
    def _split_commas(cls, v: object) -> object:
        if isinstance(v, str):
            return [s.strip() for s in v.split(",") if s.strip()]
        return v

    @field_validator("models", "api_keys", "admin_keys", "cors_origins", "metrics_models")
    @classmethod
    def _once_each(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))  # a name or key given twice counts once, in the order first given


def unknown_variables(environ: Mapping[str, str]) -> dict[str, str | None]:
    """The ``ROUTING_*`` variables of ``environ`` that name no setting (the settings ignore them: a misspelt one
    changes nothing), each with the setting's variable it most resembles (None: none does)."""
    known = [name.upper() for name in Settings.model_fields]
    out: dict[str, str | None] = {}
    for var in environ:
        name = var.upper().removeprefix("ROUTING_")
        if var.upper().startswith("ROUTING_") and name not in known:
            like = difflib.get_close_matches(name, known, n=1, cutoff=0.75)  # the names, not their common prefix
            out[var] = f"ROUTING_{like[0]}" if like else None
    return out
