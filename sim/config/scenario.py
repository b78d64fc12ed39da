"""The scenario: a few validated, frozen objects loaded from YAML in one place.

Registry names pick the scheduler, latency model and workload format; each brings its own
parameter class, so `scheduler: {name: chunked_prefill, token_budget: 512}` is checked against
`ChunkedPrefillConfig` and unknown keys are rejected by name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from pydantic import (
    Field,
    PrivateAttr,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)

from sim.config.base import Frozen, changed_fields, dispatch
from sim.config.clients import ClientsConfig
from sim.config.engine import with_engine
from sim.config.errors import InputError, invalid
from sim.config.replica import ReplicaConfig
from sim.config.slo import SLOConfig
from sim.config.yaml_input import read_mapping, read_yaml
from sim.routers import ROUTERS, RouterConfig
from sim.workloads import FORMATS, WorkloadConfig

__all__ = ["Scenario", "load_scenario", "merge_mappings", "parse_scenario", "read_mapping",
           "read_yaml", "scenario_yaml", "with_pool_replicas"]

DEFAULT_SCENARIO = "default.yaml"
MAX_REPLICAS = 10_000  # per pool: each is a SimPy process with its own queues and KV state
# Seeds are written to result tables (a sweep's seed column, a capacity search's trials.csv)
# as int64: a larger seed ran, then failed writing them (numpy itself takes any size).
MAX_SEED = 2**63 - 1
# `name` becomes the directory results/<name>; comparisons name their runs `<name>/<variant>`.
# Letters and digits of any script (`\w`: `テスト`, `ünïcödé`), as every file system here takes.
_NAME_PART = re.compile(r"\w[\w.+=-]*")


class PoolConfig(Frozen):
    """A pool of identical replicas."""

    replicas: int = Field(1, gt=0, le=MAX_REPLICAS, description="replicas in the pool")
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig,
                                   description="changes to the scenario's replica")


class LinkConfig(Frozen):
    """The network a prefill replica sends KV over. The default is InfiniBand-class: NDR
    400 Gb/s = 50 GB/s per NIC with a few microseconds of latency. NVLink-class links inside one
    node move about 450 GB/s per direction (H100 NVLink 4: 900 GB/s both ways together)."""

    bandwidth_gb_s: float = Field(50.0, gt=0, description="GB/s (1e9 bytes/s)")
    latency_s: float = Field(5e-6, ge=0, description="seconds per transfer, before its bytes")


class ClusterConfig(Frozen):
    """Colocated: `replicas` copies of the scenario's `replica`. Disaggregated: a `prefill` and
    a `decode` pool, KV moving between them over `link`s (one per prefill replica); each pool's
    replica is the scenario's `replica` changed by what the pool gives."""

    replicas: int = Field(1, gt=0, le=MAX_REPLICAS, description="colocated replicas")
    router: SerializeAsAny[RouterConfig] = Field(
        default_factory=lambda: ROUTERS.get("round_robin").Config(name="round_robin"),
        description="picks a replica for each arrival: {name: <router>, <its parameters>}")
    prefill: PoolConfig | None = Field(None, description="disaggregated: the prefill pool")
    decode: PoolConfig | None = Field(None, description="disaggregated: the decode pool")
    decode_router: SerializeAsAny[RouterConfig] = Field(
        default_factory=lambda: ROUTERS.get("least_kv_load").Config(name="least_kv_load"),
        description="picks the decode replica when a prefill ends")
    link: LinkConfig = Field(default_factory=LinkConfig,
                             description="the KV link of each prefill replica")
    overlap_transfer: bool = Field(
        False, description="stream KV layer by layer during the prefill; only what is left "
                           "after it ends is exposed")

    @field_validator("router", "decode_router", mode="before")
    @classmethod
    def _router(cls, value: Any) -> Any:
        return dispatch(ROUTERS, "name", value)

    @model_validator(mode="after")
    def _pools(self) -> ClusterConfig:
        if (self.prefill is None) != (self.decode is None):
            raise ValueError("a disaggregated cluster needs both a prefill and a decode pool")
        if self.prefill is not None and self.decode is not None:
            if self.prefill.replica.model != self.decode.replica.model:
                raise ValueError("prefill and decode pools must serve the same model")
            if self.prefill.replica.kv_cache.dtype != self.decode.replica.kv_cache.dtype:
                # The decode replica attends over the KV the prefill replica wrote and sent.
                raise ValueError("prefill and decode pools must store KV alike: "
                                 f"kv_cache.dtype {self.prefill.replica.kv_cache.dtype} "
                                 f"(prefill) against {self.decode.replica.kv_cache.dtype} "
                                 "(decode)")
            if self.replicas != 1:
                raise ValueError("give replicas per pool (prefill.replicas, decode.replicas)")
        else:
            self._only_disaggregated()
        return self

    def _only_disaggregated(self) -> None:
        """Settings of KV transfers mean nothing to a colocated cluster: refuse them."""
        unused = changed_fields(self, "decode_router", "link", "overlap_transfer")
        if unused:
            raise invalid(*[(name, value, "only used by a disaggregated cluster (prefill and "
                             "decode pools)") for name, value in unused])

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


class Pool(NamedTuple):
    """One pool of identical replicas: its name, the scenario field its replica comes from,
    how many replicas, and their configuration."""

    name: str
    field: str
    num_replicas: int
    replica: ReplicaConfig


class Scenario(Frozen):
    name: str = Field("scenario", description="names the results directory results/<name>")
    seed: int = Field(0, ge=0, le=MAX_SEED,
                      description="seeds every random draw (arrivals, lengths, noise)")
    workload: SerializeAsAny[WorkloadConfig] = Field(
        description="the requests: {format: <workload format>, <its parameters>}")
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig,
                                   description="one replica: model, GPU, scheduler, latency")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig,
                                   description="replicas and routing, or disaggregated pools")
    slo: SLOConfig = Field(default_factory=SLOConfig, description="latency targets")
    clients: ClientsConfig | None = Field(
        None, description="closed-loop clients: at most `concurrency` requests in flight, each "
                          "sent when a client is free; none: every request at its arrival time")
    horizon_s: float | None = Field(
        None, gt=0, description="seconds after the first arrival to stop; requests not done "
                                "are reported unfinished"
    )
    record_token_times: bool = Field(False, description="also write every token's time")
    # The file the scenario came from, named by errors found while it runs (not a field).
    _source: str = PrivateAttr("<scenario>")

    @property
    def source(self) -> str:
        return self._source

    def pools(self) -> list[Pool]:
        """The cluster's pools: one colocated pool of `replica`, or the prefill and decode
        pools (each with its own replica), with the field each is read from."""
        cluster = self.cluster
        if cluster.prefill is not None and cluster.decode is not None:
            return [Pool("prefill", "cluster.prefill.replica", cluster.prefill.replicas,
                         cluster.prefill.replica),
                    Pool("decode", "cluster.decode.replica", cluster.decode.replicas,
                         cluster.decode.replica)]
        return [Pool("colocated", "replica", cluster.replicas, self.replica)]

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        if problem := name_problem(name):
            raise ValueError(problem)
        return name

    @field_validator("workload", mode="before")
    @classmethod
    def _workload(cls, value: Any) -> Any:
        return dispatch(FORMATS, "format", value)

    @model_validator(mode="after")
    def _scheduler_fits_blocks(self) -> Scenario:
        """A scheduler whose engine's rules are not modelled with the replica's KV block size
        (SGLang's page) refuses it (`SchedulerConfig.kv_block_problems`). Only a block size
        given is checked: one left unset is for the engine's default to decide."""
        problems = []
        for _, field, _, replica in self.pools():
            if "block_size" not in replica.kv_cache.model_fields_set:
                continue
            where = {"kv_cache.block_size": f"{field}.kv_cache.block_size"}
            problems += [(where.get(name, f"{field}.scheduler.{name}"), value, why)
                         for name, value, why in replica.scheduler.kv_block_problems(
                             replica.kv_cache.block_size)]
        if problems:
            raise invalid(*problems)
        return self

    @model_validator(mode="after")
    def _clients_pace(self) -> Scenario:
        """Unpaced clients send as answers come back, whatever times the workload gives: the
        fields that only set those times would silently do nothing."""
        clients, workload = self.clients, self.workload
        if clients is None or clients.paced:
            return self
        unused = "has no effect: unpaced clients send as answers come back (clients.paced: " \
                 "true sends each request no earlier than its time)"
        problems = [(f"workload.{name}", value, unused) for name, value in (
            ("rate_scale", workload.rate_scale if workload.rate_scale != 1.0 else None),
            ("retime", workload.retime.model_dump() if workload.retime else None),
            ("stages", getattr(workload, "stages", None))) if value is not None]
        if problems:
            raise invalid(*problems)
        return self


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a directory under results/ (a scenario's, a sweep's, a
    comparison's: absolute, with `..` or an empty part, it would leave results/), or None."""
    parts = name.split("/")
    if len(name) > 200 or not all(_NAME_PART.fullmatch(p) for p in parts):
        return ("names the directory results/<name>: use letters (any script), digits and "
                "_ . - + =, not starting with '.', parts joined by single '/'")
    try:  # a directory name holds at most 255 bytes (UTF-8: up to 4 a letter)
        too_long = any(len(p.encode()) > 255 for p in parts)
    except UnicodeEncodeError:
        return "names the directory results/<name>: not valid UTF-8 text"
    if too_long:
        return "names the directory results/<name>: a part over 255 bytes (UTF-8)"
    return None


def results_name(path: Path, data: dict[str, Any]) -> str:
    """A sweep's or comparison's `name` (the file's stem if it gives none), checked: it names
    results/<name>."""
    name = data.get("name", path.stem)
    if not isinstance(name, str):
        raise InputError(path, "name", name, "must be text")
    if problem := name_problem(name):
        given = "name" in data
        raise InputError(path, "name" if given else "<file>", name,
                         problem + ("" if given else " (the file's name: give a `name`)"))
    return name


def parse_scenario(data: Any, source: str | Path, base_dir: Path | None = None) -> Scenario:
    """Validate a scenario mapping; relative paths in it resolve against `base_dir`. Every
    problem found is reported at once, one line each."""
    if not isinstance(data, dict):
        raise InputError(source, "<top level>", type(data).__name__, "a scenario must be a mapping")
    data = _with_engines(_pools_inherit(data), source, base_dir)
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        raise InputError.from_validation(source, exc) from None
    if base_dir is not None:
        scenario = _resolve_paths(scenario, base_dir)
    if problems := _replica_problems(scenario):
        raise InputError.many(source, problems)
    scenario._source = str(source)
    scenario.workload._source = str(source)
    return scenario


def merge_mappings(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`base` changed by `override`: mappings merge key by key, except that a mapping naming
    another registry entry (`name`, `kind` or `format`: another scheduler, say) replaces the
    base's whole; anything else replaces."""
    out = dict(base)
    for key, value in override.items():
        old = out.get(key)
        if isinstance(value, dict) and isinstance(old, dict) and not _renamed(old, value):
            out[key] = merge_mappings(old, value)
        else:
            out[key] = value
    return out


def _renamed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    return any(k in new and new[k] != old.get(k) for k in ("name", "kind", "format"))


def _pools_inherit(data: dict[str, Any]) -> dict[str, Any]:
    """The pools of a disaggregated cluster start from the scenario's `replica` and change what
    they give (so the top-level `replica` is never silently ignored)."""
    cluster, replica = data.get("cluster"), data.get("replica")
    if not isinstance(cluster, dict) or not isinstance(replica, dict):
        return data
    pools = {}
    for name in ("prefill", "decode"):
        pool = cluster.get(name)
        if isinstance(pool, dict) and isinstance(pool.get("replica", {}), dict):
            pools[name] = {**pool, "replica": merge_mappings(replica, pool.get("replica", {}))}
    return {**data, "cluster": {**cluster, **pools}} if pools else data


def _with_engines(data: dict[str, Any], source: str | Path, base_dir: Path | None
                  ) -> dict[str, Any]:
    """Each replica's engine calibration applied (`sim.config.engine.with_engine`): the
    top-level replica's (given or not) and each pool's."""
    problems: list[tuple[str, Any, str]] = []

    def apply(replica: Any, field: str) -> Any:
        if not isinstance(replica, dict):
            return replica  # reported by the field's own validation
        out, problem = with_engine(replica, base_dir)
        if problem is not None:
            problems.append((f"{field}.engine", replica.get("engine"), problem))
        return out

    data = {**data, "replica": apply(data.get("replica", {}), "replica")}
    cluster = data.get("cluster")
    if isinstance(cluster, dict):
        pools = {name: {**pool, "replica": apply(pool.get("replica", {}),
                                                 f"cluster.{name}.replica")}
                 for name in ("prefill", "decode") if isinstance(pool := cluster.get(name), dict)}
        data["cluster"] = {**cluster, **pools}
    if problems:
        raise InputError.many(source, problems)
    return data


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
    return with_replicas(scenario, lambda replica: _resolve_latency(replica, base_dir))


def with_prefix_caching(scenario: Scenario, keyed: bool) -> Scenario:
    """Each replica's `prefix_caching` left unset, resolved: its engine's default
    (`SchedulerConfig.prefix_caching_default`: vLLM v1 and SGLang cache prefixes unless told
    not to) where `keyed` (a request of the workload names prefixes: hash ids) or the replica
    has a host tier (`kv_offload`, SGLang's `hierarchical_cache`), which keys blocks by
    prefix; else off. Without keys nothing can be shared:
    the run is then the same with caching off, and faster, but where a request is preempted
    (its own blocks stay cached in the engine) or, under SGLang, near a full KV cache (its
    radix cache's admission check): the runner says so (`run.prefix_caching_left_off`)."""

    def resolve(replica: ReplicaConfig) -> ReplicaConfig:
        if replica.prefix_caching is not None:
            return replica
        tiered = replica.kv_offload is not None or getattr(
            replica.scheduler, "hierarchical_cache", None) is not None
        on = (keyed or tiered) and type(replica.scheduler).prefix_caching_default
        return replica.model_copy(update={"prefix_caching": on})

    return with_replicas(scenario, resolve)


def with_replicas(scenario: Scenario, change: Callable[[ReplicaConfig], ReplicaConfig]
                   ) -> Scenario:
    """`scenario` with `change` applied to its replica and to each pool's."""
    return with_pool_replicas(scenario, lambda replica, _: change(replica))


def with_pool_replicas(scenario: Scenario,
                       change: Callable[[ReplicaConfig, str], ReplicaConfig]) -> Scenario:
    """`scenario` with `change(replica, pool)` applied to its replica ("colocated") and to
    each pool's ("prefill", "decode")."""
    scenario = scenario.model_copy(update={"replica": change(scenario.replica, "colocated")})
    cluster = scenario.cluster
    if cluster.prefill is not None and cluster.decode is not None:
        pools = {name: pool.model_copy(update={"replica": change(pool.replica, name)})
                 for name, pool in (("prefill", cluster.prefill), ("decode", cluster.decode))}
        scenario = scenario.model_copy(update={"cluster": cluster.model_copy(update=pools)})
    return scenario


def _absolute(base_dir: Path, path: Path) -> Path:
    """`path` against `base_dir`, absolute and normalised (`a/../b` is `b`), symlinks kept."""
    return Path(os.path.abspath(base_dir / path))


def _resolve_latency(replica: ReplicaConfig, base_dir: Path) -> ReplicaConfig:
    """The replica's file paths (its model's config.json, or the directory holding it; its
    latency model's inputs: a profile, measured communication tables) made absolute."""
    latency = replica.latency
    paths = {name: _absolute(base_dir, value) for name in type(latency).model_fields
             if isinstance(value := getattr(latency, name), Path)}
    if paths:
        replica = replica.model_copy(update={"latency": latency.model_copy(update=paths)})
    if isinstance(replica.model, Path):
        model = _absolute(base_dir, replica.model)
        if (model / "config.json").is_file():
            # A Hugging Face snapshot's directory: its config.json is the input (hashed into
            # the run's record and cache key; the weights beside it are never read).
            model = model / "config.json"
        replica = replica.model_copy(update={"model": model})
    if isinstance(replica.engine, Path):
        replica = replica.model_copy(update={"engine": _absolute(base_dir, replica.engine)})
    return replica


def _replica_problems(scenario: Scenario) -> list[tuple[str, Any, str]]:
    """What each replica's model and split get wrong, found once paths are resolved: a
    config.json that does not read, a split its heads or layers do not allow."""
    problems: list[tuple[str, Any, str]] = []
    for _, field, _, replica in scenario.pools():
        try:
            shape = replica.model_shape
        except ValueError as exc:
            problems.append((f"{field}.model", str(replica.model), str(exc)))
            continue
        problems += [(f"{field}.parallelism.{name}", value, why)
                     for name, value, why in replica.parallelism.problems(shape)]
        backend = getattr(replica.latency, "all2all_backend", "allgather_reducescatter")
        par = replica.parallelism
        if backend != "allgather_reducescatter" and not (
                shape.num_experts and par.data > 1 and par.expert == par.data * par.tensor):
            # vLLM runs its all-to-all kernels only for experts spread over data-parallel
            # ranks (`FusedMoEParallelConfig.use_all2all_kernels`); elsewhere the option
            # would do nothing, silently.
            problems.append((f"{field}.latency.all2all_backend", backend, (
                "an all-to-all backend exchanges tokens between data-parallel ranks whose GPUs "
                "hold whole experts: give an MoE model, parallelism.data > 1 and "
                "parallelism.expert = data x tensor, or drop it")))
        elif backend == "deepep_auto" and replica.scheduler.name != "sglang":
            problems.append((f"{field}.latency.all2all_backend", backend, (
                "DeepEP's auto mode (kernels chosen step by step) is SGLang's --deepep-mode "
                "auto; vLLM runs one family for every step: give deepep_high_throughput or "
                "deepep_low_latency, or scheduler.name sglang")))
        if getattr(replica.scheduler, "enable_dp_lm_head", False) and par.data == 1:
            problems.append((f"{field}.scheduler.enable_dp_lm_head", True, (
                "--enable-dp-lm-head requires DP attention (SGLang asserts it): give "
                "parallelism.data > 1, or drop it")))
    return problems


def scenario_source(path: str | Path | None = None) -> tuple[Any, str, Path | None]:
    """A scenario file's mapping, as read (not yet checked), with the source its errors name
    and the directory its relative paths resolve against; the embedded default for None."""
    if path is None:
        text = resources.files("sim").joinpath("data", DEFAULT_SCENARIO).read_text()
        return yaml.safe_load(text), f"<embedded {DEFAULT_SCENARIO}>", None
    path = Path(path)
    return read_yaml(path), str(path), path.parent


def load_scenario(path: str | Path | None = None) -> Scenario:
    """Load a scenario file, or the embedded default scenario when `path` is None."""
    return parse_scenario(*scenario_source(path))


class _Dumper(yaml.SafeDumper):
    """Lists of plain values in flow style (`[1, 2, 3]`, wrapped at 80 columns): a fitted
    distribution's thousand quantiles take a few dozen lines, not a thousand."""


def _list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flow = all(isinstance(item, (int, float, str, bool)) or item is None for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _list)


def scenario_yaml(scenario: Scenario) -> str:
    """The fully resolved scenario (every default spelled out), as YAML."""
    data = scenario.model_dump(mode="json")
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)
