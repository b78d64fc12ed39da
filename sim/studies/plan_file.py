"""A plan file (`servesim plan`): a base scenario, the load the fleet must hold, the SLOs it
must meet, and the deployments to search::

    name: llama70b_chat
    base: chat.yaml              # a scenario file (relative to this file) or a mapping
    target_qps: 16.5             # arrivals per second the fleet must hold
    objective: cost              # cost (USD an hour), gpus, or load_per_dollar
    slo:                         # any of ttft, tbt, tpot, e2e, sched_delay x mean, p50, p90, p99
      ttft_p99_s: 2.0
      tbt_p99_s: 0.05
      attainment: 0.9            # share of requests meeting base.slo (ttft_s, tbt_s): goodput
    search:
      gpus: [h100-sxm, {name: a100-80gb, cost_per_gpu_hour: 1.8}]
      tensor: [1, 2, 4, 8]
      data: [1]
      pipeline: [1]
      quantization: [none, fp8]
      schedulers: [{max_num_batched_tokens: 2048}, {max_num_batched_tokens: 8192}]  # changes
      disaggregated: [{prefill: 1, decode: 1}, {prefill: 1, decode: 2, decode_gpu: l40s}]
      links: [{name: ib_ndr, bandwidth_gb_s: 50}, {name: roce_100g, bandwidth_gb_s: 12.5}]
      max_replicas: 32
    band: auto                   # check the answer at iteration times scaled by 1 -/+ band
    seeds: 5                     # the chosen deployment re-simulated with these many seeds

The search itself: `sim.studies.plan`.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from sim.config.base import Frozen
from sim.config.errors import InputError, invalid
from sim.config.overrides import resolved_defaults, set_path
from sim.config.scenario import MAX_REPLICAS, Scenario, parse_scenario
from sim.config.yaml_input import read_base, read_yaml
from sim.hardware.parallelism import MAX_GPUS_PER_REPLICA
from sim.latency.all_to_all import All2AllBackend

# SLO metric -> (summary distribution over finished requests, over every arrived request)
METRICS = {"ttft": ("ttft_s", "ttft_all_arrived_s"), "tbt": ("tbt_s", None),
           "tpot": ("tpot_s", None), "e2e": ("e2e_s", None),
           "sched_delay": ("scheduling_delay_s", "scheduling_delay_all_arrived_s")}
STATS = ("mean", "p50", "p90", "p99")
SLO_KEY = re.compile(rf"^({'|'.join(METRICS)})_({'|'.join(STATS)})_s$")
LABELS = {"ttft": "TTFT", "tbt": "TBT", "tpot": "TPOT", "e2e": "E2E",
          "sched_delay": "scheduling delay"}


def slo_label(key: str) -> str:
    """`ttft_p99_s` -> `P99 TTFT`; `attainment` -> `SLO attainment`."""
    match = SLO_KEY.match(key)
    if match is None:
        return "SLO attainment"
    metric, stat = match.groups()
    return f"{stat.upper() if stat != 'mean' else 'mean'} {LABELS[metric]}"


class GPUChoice(Frozen):
    name: str = Field(min_length=1, max_length=100, description="a GPU of `servesim list`")
    cost_per_gpu_hour: float | None = Field(None, gt=0, le=1000,
                                            description="USD an hour; none: the GPU table's")


class Ratio(Frozen):
    """A prefill:decode ratio; the decode pool on other GPUs or another split where given
    (heterogeneous pools), else the kind's."""

    prefill: int = Field(ge=1, le=64)
    decode: int = Field(ge=1, le=64)
    decode_gpu: GPUChoice | None = Field(None, description="the decode pool's GPU")
    decode_tensor: int | None = Field(None, ge=1, le=MAX_GPUS_PER_REPLICA,
                                      description="the decode pool's tensor parallelism")

    @field_validator("decode_gpu", mode="before")
    @classmethod
    def _named(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value


class LinkChoice(Frozen):
    """A KV link for disaggregated kinds (`cluster.link`), named in the tables."""

    name: str = Field(min_length=1, max_length=40, pattern=r"^[A-Za-z0-9_.+-]+$",
                      description="what the tables call it, e.g. ib_ndr")
    bandwidth_gb_s: float = Field(gt=0, le=10_000, description="GB/s (1e9 bytes/s)")
    latency_s: float = Field(5e-6, ge=0, le=1, description="seconds per transfer")


class BackendPair(Frozen):
    """The all-to-all backend of each pool of a disaggregated kind (DeepEP's normal kernels
    for prefill and its low-latency ones for decode, say)."""

    prefill: All2AllBackend
    decode: All2AllBackend


def _base_scheduler() -> list[dict[str, Any]]:
    return [{}]


class PlanSearch(Frozen):
    gpus: list[GPUChoice] = Field(default_factory=list, max_length=20,
                                  description="GPUs to try; none: the base's")
    tensor: list[int] | None = Field(None, min_length=1, max_length=8,
                                     description="none: the base's")
    pipeline: list[int] | None = Field(None, min_length=1, max_length=8,
                                       description="none: the base's")
    data: list[int] | None = Field(
        None, min_length=1, max_length=8,
        description="data-parallel ranks per replica (MoE models: vLLM's "
                    "--data-parallel-size); none: the base's")
    expert_parallel: list[bool] | None = Field(
        None, min_length=1, max_length=2,
        description="with data-parallel ranks: whole experts spread over all their GPUs "
                    "(true: --enable-expert-parallel), or every expert sliced over them "
                    "(false: vLLM's default); each choice its own kind; none: the base's "
                    "(true for a base without ranks)")
    all2all_backends: list[All2AllBackend | BackendPair] | None = Field(
        None, min_length=1, max_length=8,
        description="with data-parallel ranks and experts spread over them: vLLM's "
                    "--all2all-backend to try (latency.all2all_backend), each its own kind; "
                    "{prefill: ..., decode: ...} sets each pool's (disaggregated kinds "
                    "only); none: the base's")
    quantization: list[Literal["none", "fp8"]] | None = Field(
        None, min_length=1, max_length=2, description="none: the base's")
    schedulers: list[dict[str, Any]] = Field(
        default_factory=_base_scheduler, min_length=1, max_length=20,
        description="changes to the base's scheduler, one per choice")
    decode_schedulers: list[dict[str, Any]] = Field(
        default_factory=_base_scheduler, min_length=1, max_length=20,
        description="changes to a decode pool's scheduler (over the kind's), one per choice, "
                    "tried with each ratio; none: the kind's")
    colocated: bool = Field(True, description="try colocated replicas")
    disaggregated: list[Ratio] = Field(default_factory=list, max_length=20,
                                       description="prefill:decode ratios to try")
    links: list[LinkChoice] = Field(
        default_factory=list, max_length=8,
        description="KV links to try with each ratio (links have no price: the answer is the "
                    "cheapest deployment that holds, over any of them); none: the base's")
    max_replicas: int = Field(32, ge=1, le=MAX_REPLICAS,
                              description="replicas (or P:D units x their sum) at most")

    @field_validator("gpus", mode="before")
    @classmethod
    def _named(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"name": v} if isinstance(v, str) else v for v in value]
        return value

    @field_validator("tensor", "pipeline", "data")
    @classmethod
    def _sizes(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        # (ranks over nodes too: the split's own rules say more)
        bad = [v for v in value if not 1 <= v <= MAX_GPUS_PER_REPLICA]
        if bad:
            raise ValueError(f"{bad[0]}: each in [1, {MAX_GPUS_PER_REPLICA}]")
        return sorted(set(value))

    @model_validator(mode="after")
    def _something(self) -> PlanSearch:
        if not self.colocated and not self.disaggregated:
            raise invalid(("colocated", False, "and no disaggregated ratio: nothing to search"))
        if self.links and not self.disaggregated:
            raise invalid(("links", [link.name for link in self.links],
                           "KV links only carry disaggregated kinds: add ratios to "
                           "search.disaggregated"))
        if self.decode_schedulers != [{}] and not self.disaggregated:
            raise invalid(("decode_schedulers", self.decode_schedulers,
                           "a decode pool's scheduler needs disaggregated kinds: add ratios "
                           "to search.disaggregated"))
        pairs = [c for c in self.all2all_backends or [] if isinstance(c, BackendPair)]
        if pairs and not self.disaggregated:
            raise invalid(("all2all_backends", [c.model_dump() for c in pairs],
                           "a backend for each pool needs disaggregated kinds: add ratios to "
                           "search.disaggregated, or name one backend"))
        names = [link.name for link in self.links]
        if len(set(names)) != len(names):
            raise invalid(("links", names, "each link needs a name of its own"))
        return self


class PlanConfig(Frozen):
    name: str = Field("plan", min_length=1, max_length=200)
    target_qps: float | None = Field(
        None, gt=0, le=1e6, description="arrivals per second to hold (load_per_dollar: where "
                                        "each kind's search starts; none: the base's rate)")
    objective: Literal["cost", "gpus", "load_per_dollar"] = Field(
        "cost", description="cost: the cheapest deployment holding target_qps; gpus: the "
                            "fewest GPUs; load_per_dollar: the kind whose replica (or P:D "
                            "unit) holds the most load per USD an hour, as Vidur-Search")
    slo: dict[str, float] = Field(min_length=1, max_length=21)
    search: PlanSearch = Field(default_factory=PlanSearch)
    band: Literal["auto", "none"] | float = Field(
        "auto", description="auto: the engine calibration's error band (wider on a GPU it did "
                            "not measure); a fraction; none: no check")
    seeds: int = Field(3, ge=1, le=20, description="seeds the chosen deployment is re-run with")

    @field_validator("slo")
    @classmethod
    def _targets(cls, value: dict[str, float]) -> dict[str, float]:
        for key, target in value.items():
            if key == "attainment":
                if not 0 < target <= 1:
                    raise ValueError(f"attainment={target}: a share in (0, 1]")
            elif SLO_KEY.match(key) is None:
                raise ValueError(f"{key}: not a target; one of <metric>_<stat>_s with metric "
                                 f"{', '.join(METRICS)} and stat {', '.join(STATS)}, or "
                                 "attainment")
            elif not 0 < target <= 1e6:
                raise ValueError(f"{key}={target}: a positive number of seconds")
        return value

    @model_validator(mode="after")
    def _target(self) -> PlanConfig:
        if self.target_qps is None and self.objective != "load_per_dollar":
            raise invalid(("target_qps", None, f"the load to hold: needed by objective "
                                               f"{self.objective}"))
        return self

    @field_validator("band")
    @classmethod
    def _band(cls, value: Any) -> Any:
        if isinstance(value, float) and not 0 <= value < 1:
            raise ValueError(f"{value}: a fraction in [0, 1)")
        return value


class Plan:
    """A loaded plan file: its config, its base scenario (validated) and how to make each
    deployment's scenario from it."""

    def __init__(self, path: Path) -> None:
        data = read_yaml(path)
        if not isinstance(data, dict):
            raise InputError(path, "<top level>", type(data).__name__, "a plan is a mapping")
        base, self.base_dir, base_path = read_base(path, data)
        rest = {k: v for k, v in data.items() if k != "base"}
        try:
            self.config = PlanConfig.model_validate(rest)
        except ValidationError as exc:
            raise InputError.from_validation(path, exc) from None
        self.path = path
        self.source = str(base_path or path)
        self.base_data = base
        self.base = parse_scenario(base, self.source, self.base_dir)
        self._defaults = resolved_defaults(base, self.source, self.base_dir)
        # (A request class's own targets judge its requests: `summary.slo`, combined.)
        judged = [self.base.slo] + [c.slo for c in self.base.workload.classes or []
                                    if c.slo is not None]
        if "attainment" in self.config.slo and all(
                t.ttft_s is None and t.tbt_s is None for t in judged):
            raise InputError(path, "slo.attainment", self.config.slo["attainment"],
                             "counts requests meeting the base scenario's slo (ttft_s, tbt_s) "
                             "or their class's (workload.classes' slo): set them there")
        from sim.hardware.gpus import GPUS

        for i, gpu in enumerate(self.config.search.gpus):
            if gpu.name not in GPUS.names():
                raise InputError(path, f"search.gpus.{i}", gpu.name,
                                 f"no such GPU; known: {', '.join(GPUS.names())}")
        for i, ratio in enumerate(self.config.search.disaggregated):
            if ratio.decode_gpu is not None and ratio.decode_gpu.name not in GPUS.names():
                raise InputError(path, f"search.disaggregated.{i}.decode_gpu",
                                 ratio.decode_gpu.name,
                                 f"no such GPU; known: {', '.join(GPUS.names())}")
        if self.base.clients is not None:
            raise InputError(path, "base.clients", self.base.clients.model_dump(),
                             "a plan holds an open-loop load (target_qps); clients cap or set "
                             "the rate themselves: leave them out of the base")
        search = self.config.search
        for field, changes in (("schedulers", search.schedulers),
                               ("decode_schedulers", search.decode_schedulers)):
            for i, change in enumerate(changes):
                try:
                    self.scenario({f"replica.scheduler.{k}": v for k, v in change.items()})
                except InputError as exc:
                    raise InputError(path, f"search.{field}.{i}", change,
                                     exc.one_line().split(": ", 2)[-1]) from None
        if self.base.cluster.prefill is not None:
            raise InputError(path, "base.cluster", "prefill/decode",
                             "the plan makes the cluster: give a base with one replica kind "
                             "(search.disaggregated tries prefill:decode pools)")

    @property
    def start_qps(self) -> float:
        """The load a search starts from: `target_qps`, else the base's own rate."""
        from sim.workloads.load import rate_knob, trace_qps

        if self.config.target_qps is not None:
            return self.config.target_qps
        workload = self.base.workload
        if rate_knob(self.base) == "qps":
            arrivals = workload.retime or workload.arrivals  # type: ignore[attr-defined]
            return float(arrivals.qps)
        return trace_qps(self.base) * workload.rate_scale

    def scenario(self, changes: dict[str, Any]) -> Scenario:
        """The base with `changes` (dotted path -> value) set, validated."""
        data = dict(self.base_data)
        for dotted, value in changes.items():
            data = set_path(data, dotted, value, self._defaults)
        return parse_scenario(data, self.source, self.base_dir)


def judge(summary: dict[str, Any], slo: dict[str, float]) -> tuple[bool, str,
                                                                    dict[str, float | None]]:
    """(every target met, why not, each target's measured value) for a run's summary."""
    values: dict[str, float | None] = {}
    why = []
    for key, target in slo.items():
        if key == "attainment":
            value = (summary.get("slo") or {}).get("all_attainment")
            values[key] = value
            if value is None or value < target:
                why.append(f"SLO attainment {_pct(value)} < {_pct(target)}")
            continue
        match = SLO_KEY.match(key)
        assert match is not None
        metric, stat = match.groups()
        finished, arrived = METRICS[metric]
        dist = summary.get(arrived) if arrived else None
        if dist and dist.get(stat) is not None:
            value = dist[stat]
            if (dist.get("is_lower_bound") or {}).get(stat):  # censored: its worst case
                worst = (dist.get("at_most") or {}).get(stat)
                value = math.inf if worst is None else worst
        else:
            value = summary[finished].get(stat)
        values[key] = value
        if value is None:
            if metric != "tbt":  # no request with two tokens: no gap to miss
                why.append(f"no {slo_label(key)}")
        elif value > target:
            why.append(f"{slo_label(key)} {_ms(value)} > {_ms(target)}")
    requests = summary["requests"]
    if requests["rejected"]:
        reasons = ", ".join(requests.get("rejected_reasons", {}))
        why.append(f"rejects {requests['rejected']} requests ({reasons})")
    if requests.get("failed"):  # clients that gave up (workload.timeout_s)
        why.append(f"{requests['failed']} requests failed (their clients gave up)")
    verdict = (summary.get("overload") or {}).get("verdict", "unknown")
    if verdict == "overloaded":
        why.insert(0, "overloaded")
    return not why, "; ".join(why), values


def _ms(value_s: float) -> str:
    return "unbounded" if math.isinf(value_s) else f"{value_s * 1e3:,.4g} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
