"""The scenario: a few validated, frozen objects loaded from YAML in one place.

Registry names pick the scheduler, latency model and workload format; each brings its own
parameter class, so `scheduler: {name: chunked_prefill, token_budget: 512}` is checked against
`ChunkedPrefillConfig` and unknown keys are rejected by name.
"""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)

from sim.errors import INPUT_MODEL, InputError, invalid
from sim.gpus import GPUS
from sim.latency import LATENCY_MODELS
from sim.latency.base import LatencyConfig
from sim.models import MODELS
from sim.registry import Registry
from sim.routers import ROUTERS, RouterConfig
from sim.schedulers import SCHEDULERS, SchedulerConfig
from sim.workloads import FORMATS, WorkloadConfig

DEFAULT_SCENARIO = "default.yaml"
# A scenario has about a hundred YAML nodes, a sweep a few thousand. Counting them with aliases
# expanded stops an alias bomb ("billion laughs") before it is built in memory.
MAX_YAML_NODES = 100_000
MAX_REPLICAS = 10_000  # per pool: each is a SimPy process with its own queues and KV state
# `name` becomes the directory results/<name>; comparisons name their runs `<name>/<variant>`.
_NAME_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")


class _Frozen(BaseModel):
    model_config = INPUT_MODEL


def _dispatch(registry: Registry[Any], key: str, value: Any) -> Any:
    """Validate a `{key: name, ...}` mapping with the parameter class the name registers."""
    if not isinstance(value, dict):
        return value
    known = ", ".join(registry.names())
    if key not in value:
        raise ValueError(f"needs '{key}', one of: {known}")
    name = value[key]
    if not isinstance(name, str) or name not in registry:
        raise invalid((key, name, f"unknown {registry.kind}; known: {known}"))
    return registry.get(name).Config.model_validate(value)


class KVCacheConfig(_Frozen):
    # Bounds keep block counts times block sizes (KV slots) well inside int64.
    block_size: int = Field(16, gt=0, le=65_536, description="token slots per KV block")
    num_blocks: int | None = Field(
        None, gt=0, le=10**12, description="blocks per replica; None: derived from GPU memory"
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="as vLLM's flag")
    activation_reserve_gb: float = Field(
        2.0, ge=0, description="memory kept for activations when num_blocks is derived"
    )

    @model_validator(mode="after")
    def _memory_or_blocks(self) -> KVCacheConfig:
        # Memory settings only derive num_blocks: given beside it, they would be ignored.
        ignored = _changed(self, "gpu_memory_utilization", "activation_reserve_gb")
        if self.num_blocks is not None and ignored:
            raise invalid(*[(name, value, "has no effect when num_blocks is given")
                            for name, value in ignored])
        return self


def _changed(model: BaseModel, *names: str) -> list[tuple[str, Any]]:
    """The named fields whose values differ from their defaults. (Whether a field was given
    cannot be told from a resolved scenario, which spells every default out.)"""
    fields = type(model).model_fields
    return [(name, getattr(model, name)) for name in names
            if getattr(model, name) != fields[name].get_default(call_default_factory=True)]


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

    replicas: int = Field(1, gt=0, le=MAX_REPLICAS)
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

    replicas: int = Field(1, gt=0, le=MAX_REPLICAS, description="colocated replicas")
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
        else:
            self._only_disaggregated()
        return self

    def _only_disaggregated(self) -> None:
        """Settings of KV transfers mean nothing to a colocated cluster: refuse them."""
        unused = _changed(self, "decode_router", "link", "overlap_transfer")
        if unused:
            raise invalid(*[(name, value, "only used by a disaggregated cluster (prefill and "
                             "decode pools)") for name, value in unused])

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

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        if len(name) > 200 or not all(_NAME_PART.fullmatch(p) for p in name.split("/")):
            raise ValueError("names the directory results/<name>: use letters, digits and "
                             "_ . - + =, not starting with '.', parts joined by single '/'")
        return name

    @field_validator("workload", mode="before")
    @classmethod
    def _workload(cls, value: Any) -> Any:
        return _dispatch(FORMATS, "format", value)


def parse_scenario(data: Any, source: str | Path, base_dir: Path | None = None) -> Scenario:
    """Validate a scenario mapping; relative paths in it resolve against `base_dir`. Every
    problem found is reported at once, one line each."""
    if not isinstance(data, dict):
        raise InputError(source, "<top level>", type(data).__name__, "a scenario must be a mapping")
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        raise InputError.from_validation(source, exc) from None
    if base_dir is not None:
        scenario = _resolve_paths(scenario, base_dir)
    scenario._source = str(source)
    scenario.workload._source = str(source)
    return scenario


def _resolve_paths(scenario: Scenario, base_dir: Path) -> Scenario:
    """Make file paths absolute so the resolved scenario written beside results still works.
    Symlinks are kept (not resolved), so a path reads the same after moving a checkout."""
    workload = scenario.workload
    updates: dict[str, Any] = {}
    path = getattr(workload, "path", None)
    if isinstance(path, Path):
        updates["path"] = _absolute(base_dir, path)
    lengths = getattr(workload, "lengths", None)
    file = getattr(lengths, "file", None)
    if lengths is not None and isinstance(file, Path):
        updates["lengths"] = lengths.model_copy(update={"file": _absolute(base_dir, file)})
    if updates:
        scenario = scenario.model_copy(update={"workload": workload.model_copy(update=updates)})
    scenario = scenario.model_copy(update={"replica": _resolve_latency(scenario.replica, base_dir)})
    cluster = scenario.cluster
    if cluster.prefill is not None and cluster.decode is not None:
        pools = {name: pool.model_copy(update={"replica": _resolve_latency(pool.replica, base_dir)})
                 for name, pool in (("prefill", cluster.prefill), ("decode", cluster.decode))}
        scenario = scenario.model_copy(update={"cluster": cluster.model_copy(update=pools)})
    return scenario


def _absolute(base_dir: Path, path: Path) -> Path:
    """`path` against `base_dir`, absolute and normalised (`a/../b` is `b`), symlinks kept."""
    return Path(os.path.abspath(base_dir / path))


def _resolve_latency(replica: ReplicaConfig, base_dir: Path) -> ReplicaConfig:
    latency = replica.latency
    path = getattr(latency, "path", None)
    if isinstance(path, Path):
        latency = latency.model_copy(update={"path": _absolute(base_dir, path)})
        replica = replica.model_copy(update={"latency": latency})
    return replica


def read_yaml(path: Path) -> Any:
    """A YAML file's single document; one-line errors for anything else."""
    if path.is_dir():
        raise InputError(path, "<file>", str(path), "is a directory, not a YAML file")
    if not path.exists():
        raise InputError(path, "<file>", str(path), "file not found")
    if not path.is_file():
        raise InputError(path, "<file>", str(path), "not a regular file")
    try:
        data = _load_bounded(path.read_text())
    except OSError as exc:
        raise InputError(path, "<file>", str(path), f"cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(path, "<file>", str(path), "not UTF-8 text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
        problem = getattr(exc, "problem", None) or str(exc)
        raise InputError(path, "<yaml>", where, f"malformed YAML: {problem}") from None
    except _TooBig:
        raise InputError(path, "<yaml>", f"more than {MAX_YAML_NODES} nodes",
                         "too large once aliases are expanded (an alias bomb?)") from None
    if data is None:
        raise InputError(path, "<file>", str(path), "empty: holds no YAML document")
    return data


class _TooBig(Exception):
    """The document expands past MAX_YAML_NODES nodes."""


def _load_bounded(text: str) -> Any:
    """`yaml.safe_load`, refusing documents past MAX_YAML_NODES nodes with aliases expanded.
    The node graph shares aliased nodes, so it is small even when its expansion is not."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, MAX_YAML_NODES) > MAX_YAML_NODES:
            raise _TooBig
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """Nodes in the document once every alias is expanded (limit + 1 once past `limit`, or if
    an alias contains itself). Each distinct node is sized once; no recursion."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        children = _children(node)
        if children_done:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in children)
            if sizes[key] > limit:
                return limit + 1
        elif key in on_path:
            return limit + 1  # recursive alias: infinite once expanded
        elif key not in sizes:
            on_path.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


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
