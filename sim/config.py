"""The scenario: a few validated, frozen objects loaded from YAML in one place.

Registry names pick the scheduler, latency model and workload format; each brings its own
parameter class, so `scheduler: {name: chunked_prefill, token_budget: 512}` is checked against
`ChunkedPrefillConfig` and unknown keys are rejected by name.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)

from sim.errors import InputError
from sim.gpus import GPUS
from sim.latency import LATENCY_MODELS
from sim.latency.base import LatencyConfig
from sim.models import MODELS
from sim.registry import Registry
from sim.routers import ROUTERS, RouterConfig
from sim.schedulers import SCHEDULERS, SchedulerConfig
from sim.workloads import FORMATS, WorkloadConfig

DEFAULT_SCENARIO = "default.yaml"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _dispatch(registry: Registry[Any], key: str, value: Any) -> Any:
    """Validate a `{key: name, ...}` mapping with the parameter class the name registers."""
    if not isinstance(value, dict):
        return value
    if key not in value:
        raise ValueError(f"needs '{key}', one of: {', '.join(registry.names())}")
    name = value[key]
    if name not in registry:
        raise ValueError(f"unknown {registry.kind} {name!r}; known: {', '.join(registry.names())}")
    return registry.get(name).Config.model_validate(value)


class KVCacheConfig(_Frozen):
    block_size: int = Field(16, gt=0, description="token slots per KV block")
    num_blocks: int | None = Field(
        None, gt=0, description="blocks per replica; None: derived from GPU memory"
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="as vLLM's flag")
    activation_reserve_gb: float = Field(
        2.0, ge=0, description="memory kept for activations when num_blocks is derived"
    )


class ReplicaConfig(_Frozen):
    model: str = "llama-3-8b"
    gpu: str = "h100-sxm"
    scheduler: SerializeAsAny[SchedulerConfig] = Field(
        default_factory=lambda: SCHEDULERS.get("chunked_prefill").Config(name="chunked_prefill")
    )
    latency: SerializeAsAny[LatencyConfig] = Field(
        default_factory=lambda: LATENCY_MODELS.get("roofline").Config(kind="roofline")
    )
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig)

    @field_validator("model")
    @classmethod
    def _known_model(cls, name: str) -> str:
        return _known(MODELS, name)

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, name: str) -> str:
        return _known(GPUS, name)

    @field_validator("scheduler", mode="before")
    @classmethod
    def _scheduler(cls, value: Any) -> Any:
        return _dispatch(SCHEDULERS, "name", value)

    @field_validator("latency", mode="before")
    @classmethod
    def _latency(cls, value: Any) -> Any:
        return _dispatch(LATENCY_MODELS, "kind", value)


def _known(registry: Registry[Any], name: str) -> str:
    if name not in registry:
        raise ValueError(f"unknown {registry.kind}; known: {', '.join(registry.names())}")
    return name


class PoolConfig(_Frozen):
    """A pool of identical replicas."""

    replicas: int = Field(1, gt=0)
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig)


class LinkConfig(_Frozen):
    """The network a prefill replica sends KV over. The default is InfiniBand-class: NDR
    400 Gb/s = 50 GB/s per NIC with a few microseconds of latency. NVLink-class links inside one
    node move about 450 GB/s per direction (H100 NVLink 4: 900 GB/s both ways together)."""

    bandwidth_gb_s: float = Field(50.0, gt=0, description="GB/s (1e9 bytes/s)")
    latency_s: float = Field(5e-6, ge=0, description="per transfer")


class ClusterConfig(_Frozen):
    """Colocated: `replicas` copies of the scenario's `replica`. Disaggregated: a `prefill` and
    a `decode` pool, KV moving between them over `link`s (one per prefill replica)."""

    replicas: int = Field(1, gt=0, description="colocated replicas")
    router: SerializeAsAny[RouterConfig] = Field(
        default_factory=lambda: ROUTERS.get("round_robin").Config(name="round_robin"))
    prefill: PoolConfig | None = None
    decode: PoolConfig | None = None
    decode_router: SerializeAsAny[RouterConfig] = Field(
        default_factory=lambda: ROUTERS.get("least_kv_load").Config(name="least_kv_load"),
        description="picks the decode replica when a prefill ends")
    link: LinkConfig = Field(default_factory=LinkConfig)
    overlap_transfer: bool = Field(
        False, description="stream KV layer by layer during the prefill; only what is left "
                           "after it ends is exposed")

    @field_validator("router", "decode_router", mode="before")
    @classmethod
    def _router(cls, value: Any) -> Any:
        return _dispatch(ROUTERS, "name", value)

    @model_validator(mode="after")
    def _pools(self) -> ClusterConfig:
        if (self.prefill is None) != (self.decode is None):
            raise ValueError("a disaggregated cluster needs both a prefill and a decode pool")
        if self.prefill is not None and self.decode is not None:
            if self.prefill.replica.model != self.decode.replica.model:
                raise ValueError("prefill and decode pools must serve the same model")
            if self.replicas != 1:
                raise ValueError("give replicas per pool (prefill.replicas, decode.replicas)")
        return self

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


class SLOConfig(_Frozen):
    ttft_s: float | None = Field(None, gt=0, description="target time to first token")
    tbt_s: float | None = Field(None, gt=0, description="target gap between output tokens")


class Scenario(_Frozen):
    name: str = "scenario"
    seed: int = Field(0, ge=0)
    workload: SerializeAsAny[WorkloadConfig]
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    slo: SLOConfig = Field(default_factory=SLOConfig)
    horizon_s: float | None = Field(
        None, gt=0, description="stop here; requests not done are reported unfinished"
    )
    record_token_times: bool = Field(False, description="also write every token's time")
    # The file the scenario came from, named by errors found while it runs (not a field).
    _source: str = PrivateAttr("<scenario>")

    @property
    def source(self) -> str:
        return self._source

    @field_validator("workload", mode="before")
    @classmethod
    def _workload(cls, value: Any) -> Any:
        return _dispatch(FORMATS, "format", value)


def parse_scenario(data: Any, source: str | Path, base_dir: Path | None = None) -> Scenario:
    """Validate a scenario mapping; relative paths in it resolve against `base_dir`."""
    if not isinstance(data, dict):
        raise InputError(source, "<top level>", type(data).__name__, "a scenario must be a mapping")
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(part) for part in err["loc"]) or "<top level>"
        problem = err["msg"].removeprefix("Value error, ")
        raise InputError(source, field, err.get("input"), problem) from None
    if base_dir is not None:
        scenario = _resolve_paths(scenario, base_dir)
    scenario._source = str(source)
    return scenario


def _resolve_paths(scenario: Scenario, base_dir: Path) -> Scenario:
    """Make file paths absolute so the resolved scenario written beside results still works."""
    workload = scenario.workload
    updates: dict[str, Any] = {}
    path = getattr(workload, "path", None)
    if isinstance(path, Path) and not path.is_absolute():
        updates["path"] = (base_dir / path).resolve()
    lengths = getattr(workload, "lengths", None)
    file = getattr(lengths, "file", None)
    if lengths is not None and isinstance(file, Path) and not file.is_absolute():
        updates["lengths"] = lengths.model_copy(update={"file": (base_dir / file).resolve()})
    if updates:
        scenario = scenario.model_copy(update={"workload": workload.model_copy(update=updates)})
    scenario = scenario.model_copy(update={"replica": _resolve_latency(scenario.replica, base_dir)})
    cluster = scenario.cluster
    if cluster.prefill is not None and cluster.decode is not None:
        pools = {name: pool.model_copy(update={"replica": _resolve_latency(pool.replica, base_dir)})
                 for name, pool in (("prefill", cluster.prefill), ("decode", cluster.decode))}
        scenario = scenario.model_copy(update={"cluster": cluster.model_copy(update=pools)})
    return scenario


def _resolve_latency(replica: ReplicaConfig, base_dir: Path) -> ReplicaConfig:
    latency = replica.latency
    path = getattr(latency, "path", None)
    if isinstance(path, Path) and not path.is_absolute():
        latency = latency.model_copy(update={"path": (base_dir / path).resolve()})
        replica = replica.model_copy(update={"latency": latency})
    return replica


def read_yaml(path: Path) -> Any:
    if not path.is_file():
        raise InputError(path, "<file>", str(path), "file not found")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
        problem = getattr(exc, "problem", None) or str(exc)
        raise InputError(path, "<yaml>", where, f"malformed YAML: {problem}") from None


def read_mapping(path: Path, kind: str, allowed: set[str]) -> dict[str, Any]:
    """A YAML file that must be a mapping with only `allowed` top-level keys (sweeps,
    comparisons)."""
    data = read_yaml(path)
    if not isinstance(data, dict) or set(data) - allowed:
        extra = sorted(set(data) - allowed) if isinstance(data, dict) else data
        raise InputError(path, "<top level>", extra, f"a {kind} has {', '.join(sorted(allowed))}")
    return data


def load_scenario(path: str | Path | None = None) -> Scenario:
    """Load a scenario file, or the embedded default scenario when `path` is None."""
    if path is None:
        text = resources.files("sim").joinpath("data", DEFAULT_SCENARIO).read_text()
        return parse_scenario(yaml.safe_load(text), f"<embedded {DEFAULT_SCENARIO}>")
    path = Path(path)
    return parse_scenario(read_yaml(path), path, path.parent)


def scenario_yaml(scenario: Scenario) -> str:
    """The fully resolved scenario (every default spelled out), as YAML."""
    data = scenario.model_dump(mode="json")
    return yaml.safe_dump(data, sort_keys=False)
