"""One replica's configuration: the model it serves, its GPU and how it splits over GPUs, its
scheduler and latency model (each a registry entry with its own parameters), its KV cache."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SerializeAsAny, ValidationError, field_validator, model_validator

from sim.config.base import Frozen, changed_fields, dispatch
from sim.config.engine import AUTO, EngineCalibration, auto_name, is_name, load_calibration
from sim.config.errors import invalid
from sim.core.registry import Registry
from sim.hardware.gpus import GPUS, GPUSpec, GPUSpecInput
from sim.hardware.models import MODELS, ModelShape, resolve_model
from sim.hardware.parallelism import Parallelism
from sim.latency import LATENCY_MODELS
from sim.latency.base import LatencyConfig
from sim.schedulers import SCHEDULERS, SchedulerConfig


class KVCacheConfig(Frozen):
    # Bounds keep block counts times block sizes (KV slots) well inside int64.
    block_size: int = Field(16, gt=0, le=65_536,
                            description="token slots per KV block (tokens); unset, the "
                                        "engine's: vLLM's 16 (64 or 32 for DeepSeek's MLA on "
                                        "Hopper and B200), SGLang's page: 1, 64 on a B200",
                            json_schema_extra={"shown_default": "the engine's (16)"})
    num_blocks: int | None = Field(
        None, gt=0, le=10**12, description="blocks per replica; None: derived from GPU memory"
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="fraction of GPU memory for weights, activations and KV, "
                                     "as vLLM's flag")
    activation_reserve_gb: float = Field(
        2.0, ge=0, description="GB kept for activations when num_blocks is derived"
    )
    dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="the KV cache's element type, as vLLM's --kv-cache-dtype: auto "
                            "(the model's dtype) or an fp8 format (one byte per element: "
                            "twice the KV slots in the same memory, half the bytes attention "
                            "reads and a transfer sends)")

    @model_validator(mode="after")
    def _memory_or_blocks(self) -> KVCacheConfig:
        # Memory settings only derive num_blocks: given beside it, they would be ignored.
        ignored = changed_fields(self, "gpu_memory_utilization", "activation_reserve_gb")
        if self.num_blocks is not None and ignored:
            raise invalid(*[(name, value, "has no effect when num_blocks is given")
                            for name, value in ignored])
        return self


class KVOffloadConfig(Frozen):
    """`kv_offload`: a CPU tier for the KV cache, as vLLM's `--kv-offloading-size` with
    `--kv-offloading-backend native` (its `OffloadingConnector`: 0.15.1's in
    `sim.core.offload`, 0.33.0's in `sim.core.offload_jobs`): full blocks computed are copied
    to host memory, and a queued request loads the blocks of its prefix the GPU has evicted
    instead of computing them."""

    size_gib: float = Field(
        gt=0, le=2**20, description="host memory for KV blocks (GiB), all of an engine core's "
                                    "GPUs together, as vLLM's --kv-offloading-size (on "
                                    "data-parallel ranks: each rank this much)")
    host_bandwidth_gb_s: float | None = Field(
        None, gt=0, le=10_000,
        description="GB/s one GPU copies KV to or from host memory, each way; None: 80% of "
                    "its PCIe x16 link (Gen5 64 GB/s raw on H100, H200, B200, RTX PRO 6000, "
                    "MI300X; Gen4 32 GB/s elsewhere)")
    eviction_policy: Literal["lru", "arc"] = Field(
        "lru", description="which host blocks go first when a store needs room: lru (vLLM's "
                           "default) or arc (adaptive replacement: blocks reused once outlive "
                           "those stored once), the connector's extra config "
                           "`eviction_policy`; arc with engine_version 0.33.0 only")
    store_threshold: int = Field(
        0, ge=0, le=1_000_000,
        description="a block is stored only once offered this many times (by requests "
                    "computing it; 0 or 1: every block), the connector's extra config "
                    "`store_threshold` (vLLM 0.33.0; it forgets the least recently offered "
                    "past 64,000 blocks)")


class ReplicaConfig(Frozen):
    model: str | Path = Field(
        "llama-3-8b", description="a registered model, or the path of a Hugging Face "
                                  "config.json (relative to the scenario)")
    gpu: str | GPUSpecInput = Field(
        "h100-sxm", description="a registered GPU, or a mapping of its figures")
    parallelism: Parallelism = Field(default_factory=Parallelism,
                                     description="how one replica splits over GPUs")
    scheduler: SerializeAsAny[SchedulerConfig] = Field(
        default_factory=lambda: SCHEDULERS.get("chunked_prefill").Config(name="chunked_prefill"),
        description="the batching policy: {name: <scheduler>, <its parameters>}")
    engine: str | Path = Field(
        AUTO, description="the engine calibration: a shipped name (`servesim list`), a "
                          "YAML file, none, or auto (vLLM's for every scheduler but sglang); "
                          "its latency fields are the roofline's defaults, its front end makes "
                          "the client-side latencies")
    latency: SerializeAsAny[LatencyConfig] = Field(
        default_factory=lambda: LATENCY_MODELS.get("roofline").Config(kind="roofline"),
        description="how long an iteration takes: {kind: <latency model>, <its parameters>}")
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig,
                                    description="KV blocks per replica")
    max_model_len: int | None = Field(
        None, gt=0, le=10**9,
        description="context window (prompt plus output) in tokens; None: the model's")
    prefix_caching: bool | None = Field(
        None, description="share and keep the KV of prefixes named by the requests' hash ids; "
                          "unset: the engine's default (on for vllm_v1 and sglang, off for "
                          "the generic policies) where a request names prefixes or a CPU tier "
                          "is set, else off (nothing to share)")
    kv_offload: KVOffloadConfig | None = Field(
        None, description="a CPU tier for the KV cache (vllm_v1 with prefix caching): "
                          "{size_gib, host_bandwidth_gb_s}")
    quantization: Literal["none", "fp8"] = Field(
        "none", description="weights of the linear layers, as vLLM's --quantization: none (the "
                            "model's dtype) or fp8 (one byte per weight; fp8 math where the GPU "
                            "has it)")

    @property
    def calibration(self) -> EngineCalibration:
        """The engine calibration this replica names (`auto` resolved: `with_engine`)."""
        engine = self.engine
        if engine == AUTO:
            engine = auto_name(self.scheduler.name)
        return load_calibration(engine)

    @property
    def frontend_latency_s(self) -> float:
        """What the API front end adds to this replica's TTFT and E2E (client-side)."""
        return self.calibration.frontend_latency_s(self.parallelism.num_gpus_per_rank)

    @property
    def context_len(self) -> int | None:
        """The context window in force: `max_model_len`, else the model's."""
        return self.max_model_len or self.model_shape.max_model_len

    @property
    def model_shape(self) -> ModelShape:
        """The model's shape (a config.json is read once per process), its KV cache's element
        size set by `kv_cache.dtype` and its linear layers' weights by `quantization`."""
        shape = resolve_model(str(self.model))
        if shape.checkpoint_fp8 and self.quantization != "fp8":
            # vLLM loads such a checkpoint quantized whatever its flag; simulated in bf16, its
            # weights would be twice their size.
            raise ValueError(f"{shape.source}: quantization_config: an fp8 checkpoint: set "
                             "replica.quantization: fp8")
        if self.kv_cache.dtype != "auto":
            shape = dataclasses.replace(shape, kv_dtype=self.kv_cache.dtype)
        if self.quantization == "fp8":
            shape = dataclasses.replace(shape, linear_dtype_bytes=1)
        return shape

    @property
    def lm_head_ranks(self) -> int:
        """Data-parallel ranks whose GPUs split the LM head between them: SGLang's DP
        attention splits it over all D x T GPUs (`ParallelLMHead` over the whole TP group:
        each GPU a D x T'th of the vocabulary, every rank's sampled rows gathered to it)
        unless `--enable-dp-lm-head` keeps it to each rank's own attention TP group, or the
        model ties it to the embedding table (split within the rank); 1 (each rank its own
        LM head over its T GPUs) otherwise, vLLM's ranks too."""
        data = self.parallelism.data
        if (data > 1 and self.scheduler.name == "sglang"
                and not getattr(self.scheduler, "enable_dp_lm_head", False)
                and not self.model_shape.tie_embeddings):
            return data
        return 1

    @property
    def gpu_spec(self) -> GPUSpec:
        return self.gpu.to_spec() if isinstance(self.gpu, GPUSpecInput) else GPUS.get(self.gpu)

    @property
    def measured_gpu(self) -> str:
        """The registered GPU whose figures this one has: its name, or, for a copy with its
        own price or figures (`gpu: {base: h100-sxm, ...}`), its base (what a calibration's
        measurements were made on)."""
        if isinstance(self.gpu, str):
            return self.gpu
        return self.gpu.base or self.gpu.name

    @property
    def gpu_name(self) -> str:
        return self.gpu if isinstance(self.gpu, str) else self.gpu.name

    @property
    def model_name(self) -> str:
        """The registered name, or a config.json's folder (`.../Llama-3.1-70B/config.json`)
        or file name; in a Hugging Face cache, the repository it came from
        (`.../models--meta-llama--Llama-3.1-8B/snapshots/<commit>/config.json`:
        `meta-llama/Llama-3.1-8B`)."""
        if isinstance(self.model, str):
            return self.model
        if self.model.name != "config.json":
            return self.model.stem
        folder = self.model.parent
        repo = folder.parent.parent.name
        if folder.parent.name == "snapshots" and repo.startswith("models--"):
            return repo.removeprefix("models--").replace("--", "/")
        return folder.name

    @field_validator("model", mode="before")
    @classmethod
    def _model(cls, value: Any) -> Any:
        """A registered name stays a name; anything else is a config.json's path (read once
        paths are resolved against the scenario's directory)."""
        if isinstance(value, Path):
            return value
        if not isinstance(value, str):
            raise ValueError("must be a registered model's name or a config.json's path")
        if value in MODELS or not _looks_like_path(value):
            return _known(MODELS, value)
        return Path(value).expanduser()

    @field_validator("engine", mode="before")
    @classmethod
    def _engine(cls, value: Any) -> Any:
        if isinstance(value, Path):
            return value
        if not isinstance(value, str) or not value:
            raise ValueError("must be an engine calibration's name or a YAML file's path")
        if is_name(value):
            if value != AUTO:
                load_calibration(value)  # an unknown name: ValueError, said at this field
            return value
        return Path(value).expanduser()

    @field_validator("gpu", mode="before")
    @classmethod
    def _gpu(cls, value: Any) -> Any:
        """A name, or a mapping checked as a `GPUSpecInput` here (so its problems are reported
        at their own fields, not once per member of the union)."""
        if isinstance(value, dict):
            return GPUSpecInput.model_validate(value)
        if isinstance(value, GPUSpecInput):
            return value
        if not isinstance(value, str):
            raise ValueError("must be a registered GPU's name or a mapping of its figures")
        return _known(GPUS, value)

    @field_validator("scheduler", mode="before")
    @classmethod
    def _scheduler(cls, value: Any) -> Any:
        return dispatch(SCHEDULERS, "name", value)

    @model_validator(mode="before")
    @classmethod
    def _scheduler_for_parallelism(cls, data: Any) -> Any:
        """A scheduler's defaults that depend on the replica's GPU (vLLM's batch sizes) and
        split (vLLM resolves async scheduling off on a pipeline): its Config's `for_gpu` and
        `for_pipeline`, before it is validated."""
        if not isinstance(data, dict) or not isinstance(data.get("scheduler"), dict):
            return data
        name = data["scheduler"].get("name")
        par = data.get("parallelism")
        pipeline = par.get("pipeline", 1) if isinstance(par, dict) else getattr(
            par, "pipeline", 1)
        if not isinstance(name, str) or name not in SCHEDULERS or type(pipeline) is not int:
            return data  # reported by the fields' own validators
        config = SCHEDULERS.get(name).Config
        gpu = _gpu_spec(data.get("gpu", cls.model_fields["gpu"].default))
        try:
            scheduler = data["scheduler"]
            if gpu is not None:
                scheduler = config.for_gpu(scheduler, gpu, _context_len(data))
            scheduler = config.for_pipeline(scheduler, pipeline)
            scheduler = config.for_model(scheduler, _model_type(data))
        except ValidationError as exc:  # located within the scheduler's settings
            raise invalid(*[(".".join(["scheduler", *map(str, e["loc"])]), e["input"], e["msg"])
                            for e in exc.errors()]) from None
        data = {**data, "scheduler": scheduler}
        mla = _uses_mla(data)
        kv = data.get("kv_cache", {})
        given = kv.get("block_size") if isinstance(kv, dict) else (
            kv.block_size if isinstance(kv, KVCacheConfig)
            and "block_size" in kv.model_fields_set else None)
        if type(given) is int and given > 0:
            if (why := config.page_refused(scheduler, gpu, mla, given)) is not None:
                raise invalid(("kv_cache.block_size", given, why))
        elif given is None and (page := config.page_size(scheduler, gpu, mla)) is not None:
            # The engine's own page where the scenario gives no block size (SGLang's 1).
            if isinstance(kv, dict):
                data["kv_cache"] = {**kv, "block_size": page}
            elif isinstance(kv, KVCacheConfig):
                data["kv_cache"] = kv.model_copy(update={"block_size": page})
        return data

    @field_validator("latency", mode="before")
    @classmethod
    def _latency(cls, value: Any) -> Any:
        return dispatch(LATENCY_MODELS, "kind", value)

    @model_validator(mode="after")
    def _sglang_memory(self) -> ReplicaConfig:
        """SGLang sizes its KV pool by `scheduler.mem_fraction_static` (weights and pool; its
        activations and CUDA graphs outside): vLLM's memory settings would mean something
        else there, and are refused rather than mapped; the fraction has no effect beside
        blocks given."""
        if self.scheduler.name != "sglang":
            return self
        fraction = getattr(self.scheduler, "mem_fraction_static", None)
        if self.kv_cache.num_blocks is not None and fraction is not None:
            raise invalid(("scheduler.mem_fraction_static", fraction,
                           "has no effect when kv_cache.num_blocks is given"))
        vllm = changed_fields(self.kv_cache, "gpu_memory_utilization", "activation_reserve_gb")
        if vllm:
            raise invalid(*[(f"kv_cache.{name}", value,
                             "vLLM's memory setting; SGLang sizes its KV pool by "
                             "--mem-fraction-static (weights and KV pool, activations and "
                             "CUDA graphs outside it): give scheduler.mem_fraction_static")
                            for name, value in vllm])
        return self


def _context_len(data: dict[str, Any]) -> int | None:
    """The context window a replica's raw fields give (`max_model_len`, else a registered
    model's), None where it takes more than a look (a config.json): vLLM's batch default
    without chunking depends on it."""
    given = data.get("max_model_len")
    if type(given) is int:
        return given
    from sim.hardware.models import MODELS

    model = data.get("model", _default_model())
    if isinstance(model, str) and model in MODELS.names():
        return MODELS.get(model).max_model_len
    return None


def _model_type(data: dict[str, Any]) -> str | None:
    """The `model_type` of the model a replica's raw fields name (`_model_config`); None where
    it gives none."""
    value = _model_config(data).get("model_type")
    return value if isinstance(value, str) else None


def _uses_mla(data: dict[str, Any]) -> bool:
    """Whether the model a replica's raw fields name keeps DeepSeek's latent KV (MLA)."""
    rank = _model_config(data).get("kv_lora_rank")
    return type(rank) is int and rank > 0


def _model_config(data: dict[str, Any]) -> dict[str, Any]:
    """The config.json of the model a replica's raw fields name: a committed one (a
    registered model) or the one at a path (as given: relative to the working directory);
    empty where neither is read."""
    from sim.hardware.models import DATA_DIR

    model = data.get("model", _default_model())
    if not isinstance(model, str):
        return {}
    path = DATA_DIR / f"{model}.json" if model in MODELS.names() else Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _default_model() -> Any:
    return ReplicaConfig.model_fields["model"].default


def _gpu_spec(value: Any) -> GPUSpec | None:
    """The GPU a replica's `gpu` field names or describes, None if it does not (yet): its own
    validator reports why."""
    try:
        if isinstance(value, str):
            return GPUS.get(value) if value in GPUS.names() else None
        if isinstance(value, dict):
            value = GPUSpecInput.model_validate(value)
        return value.to_spec() if isinstance(value, GPUSpecInput) else None
    except (ValidationError, ValueError):
        return None


def _looks_like_path(value: str) -> bool:
    return value.endswith(".json") or "/" in value or os.sep in value


def _known(registry: Registry[Any], name: str) -> str:
    if name not in registry:
        raise ValueError(f"unknown {registry.kind}; known: {', '.join(registry.names())}")
    return name
