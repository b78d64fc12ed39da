"""Fleet sizing (`servesim plan`): the cheapest deployment (or the one with the fewest GPUs)
that holds a target load within SLOs, searched over GPUs, parallelism, quantization, scheduler
settings, colocated replicas and prefill:decode pools (`sim.studies.plan_file`).

Per replica kind (a GPU, a split, a quantization, a scheduler): refused before any run where
it cannot exist (weights beyond memory, a split the model does not divide into: the reason
kept); else, colocated, the fewest replicas k for which one replica holds 1/k of the load
(doubling, then bisecting: more replicas of one kind never hurt a stable SLO, so the
smallest passing k is found in about 2 log2(k) single-replica runs), then the cluster of k
replicas verified at the full load with the real router, one more added while it fails and
one taken away while it still holds. A prefill:decode ratio P:D is searched the same way
over units of P prefill and D decode replicas, each probe the whole cluster. Kinds go
cheapest replica first; a kind whose single replica (or unit) already costs as much as the
best deployment found is refused as dominated, unsimulated. A deployment fails an SLO when
the run is overloaded, rejects a request, or misses a target (TTFT and scheduling delay over
every arrived request, as `servesim capacity` judges them, a censored percentile at its worst
case).

Then the answer's uncertainty: the latency model's error band (`band`: the engine
calibration's, wider on a GPU it did not measure) re-runs the cheapest passing deployments
with every iteration time scaled to the band's slow end (`latency.scale` 1 + band), adding
replicas until they hold, and one replica fewer at the fast end: a deployment that holds only
at the nominal or fast end is marked. The chosen one is re-run with `seeds` seeds.

Every run is cached under the key of its scenario (`runs/<key>/summary.json`): a search
interrupted and started again re-runs nothing it finished. The whole search, over processes:
`sim.studies.plan_run`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.config.errors import InputError
from sim.config.scenario import Scenario
from sim.results.fingerprint import scenario_key
from sim.results.outdir import replace_text
from sim.studies.plan_file import GPUChoice, LinkChoice, Plan, Ratio, judge
from sim.workloads.load import rate_knob, trace_qps

LOAD_PRECISION = 0.05  # load_per_dollar: a kind's most load, to within this share
MAX_DOUBLINGS = 20  # of the starting load, upwards: a millionfold
# Downwards, a kind failing at 1/64 of the starting load is not worth more runs: it holds less
# than that (load_per_dollar's answer lies far above), so the search stops there.
MAX_HALVINGS = 6


@dataclass(frozen=True)
class Kind:
    """One kind of deployment, before its size: what each replica (or P:D unit) is."""

    gpu: GPUChoice
    tensor: int
    pipeline: int
    quantization: str
    scheduler: tuple[tuple[str, Any], ...]  # changes to the base's scheduler
    ratio: Ratio | None = None  # prefill:decode, or None: colocated
    link: LinkChoice | None = None  # a disaggregated kind's KV link (None: the base's)
    # changes to the decode pool's scheduler, over `scheduler` (disaggregated kinds only)
    decode_scheduler: tuple[tuple[str, Any], ...] = ()
    # data-parallel ranks of `tensor` GPUs each (MoE models), experts spread over all of them
    # or (`sliced`) each expert sliced over them
    data: int = 1
    base_expert: int = 1  # the base's expert parallelism, for a kind without ranks
    sliced: bool = False
    # (prefill or colocated, decode) `latency.all2all_backend` of a kind with ranks whose
    # GPUs hold whole experts; None: the base's
    all2all: tuple[str, str] | None = None

    def __hash__(self) -> int:
        # (A scheduler change's value may be a mapping: a speculative config, say.)
        return hash((self.gpu, self.tensor, self.pipeline, self.quantization,
                     json.dumps(self.scheduler, sort_keys=True), self.ratio, self.link,
                     json.dumps(self.decode_scheduler, sort_keys=True), self.data,
                     self.base_expert, self.sliced, self.all2all))

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor * self.pipeline * self.data

    @property
    def decode_gpus_per_replica(self) -> int:
        """A decode replica's GPUs: its own split where the ratio gives one (its ranks
        too)."""
        tensor = self.ratio.decode_tensor if self.ratio is not None else None
        return (tensor or self.tensor) * self.pipeline * self.data

    def replicas(self, units: int) -> int:
        """Replicas in a deployment of `units` (replicas, or P:D units)."""
        return units if self.ratio is None else units * (self.ratio.prefill + self.ratio.decode)

    def num_gpus(self, units: int) -> int:
        """GPUs of a deployment of `units` (replicas, or P:D units)."""
        if self.ratio is None:
            return units * self.gpus_per_replica
        return units * (self.ratio.prefill * self.gpus_per_replica
                        + self.ratio.decode * self.decode_gpus_per_replica)

    def label(self) -> str:
        parts = [self.gpu.name] + ([f"DP{self.data}"] if self.data > 1 else []) + [
            f"TP{self.tensor}"] + (["no-EP"] if self.sliced else [])
        if self.all2all is not None:
            prefill, decode = (ALL2ALL_LABELS[b] for b in self.all2all)
            parts.append(prefill if prefill == decode else f"{prefill}:{decode}")
        if self.pipeline > 1:
            parts.append(f"PP{self.pipeline}")
        if self.quantization != "none":
            parts.append(self.quantization)
        parts += [f"{k}={_shown(v)}" for k, v in self.scheduler]
        if self.ratio is not None:
            parts.append(f"P:D {self.ratio.prefill}:{self.ratio.decode}")
            if self.ratio.decode_gpu is not None or self.ratio.decode_tensor is not None:
                gpu = self.ratio.decode_gpu.name if self.ratio.decode_gpu else self.gpu.name
                ranks = f"DP{self.data} " if self.data > 1 else ""
                parts.append(f"decode {gpu} {ranks}TP{self.ratio.decode_tensor or self.tensor}")
        if self.decode_scheduler:
            parts.append("decode " + " ".join(f"{k}={_shown(v)}"
                                              for k, v in self.decode_scheduler))
        if self.link is not None:
            parts.append(f"link {self.link.name}")
        return " ".join(parts)

    def changes(self, units: int) -> dict[str, Any]:
        """Dotted scenario changes for a deployment of `units`."""
        gpu: Any = self.gpu.name
        if self.gpu.cost_per_gpu_hour is not None:
            gpu = {"base": self.gpu.name, "cost_per_gpu_hour": self.gpu.cost_per_gpu_hour}
        out: dict[str, Any] = {"replica.gpu": gpu, "replica.parallelism.tensor": self.tensor,
                               "replica.parallelism.pipeline": self.pipeline,
                               "replica.parallelism.data": self.data,
                               "replica.quantization": self.quantization}
        # Data-parallel ranks: experts over every rank's GPUs (vLLM's --enable-expert-parallel)
        # or each sliced over them (1); else the base's expert parallelism, where it had no
        # ranks of its own.
        out["replica.parallelism.expert"] = (
            (1 if self.sliced else self.data * self.tensor) if self.data > 1
            else self.base_expert)
        if self.all2all is not None:
            out["replica.latency.all2all_backend"] = self.all2all[0]
        out |= {f"replica.scheduler.{k}": v for k, v in self.scheduler}
        if self.ratio is None:
            out["cluster.replicas"] = units
        else:
            out["cluster.replicas"] = 1  # (the pools say how many)
            out["cluster.prefill"] = {"replicas": units * self.ratio.prefill}
            out["cluster.decode"] = {"replicas": units * self.ratio.decode}
            decode: dict[str, Any] = {}
            if (choice := self.ratio.decode_gpu) is not None:
                decode["gpu"] = choice.name if choice.cost_per_gpu_hour is None else {
                    "base": choice.name, "cost_per_gpu_hour": choice.cost_per_gpu_hour}
            if (tensor := self.ratio.decode_tensor) is not None:
                decode["parallelism"] = {"tensor": tensor}
                if self.data > 1:  # (experts over the decode ranks' GPUs, as the kind's)
                    decode["parallelism"]["expert"] = 1 if self.sliced else self.data * tensor
            if self.decode_scheduler:
                decode["scheduler"] = dict(self.decode_scheduler)
            if self.all2all is not None and self.all2all[1] != self.all2all[0]:
                decode["latency"] = {"all2all_backend": self.all2all[1]}
            if decode:
                out["cluster.decode"]["replica"] = decode
            if self.link is not None:
                out["cluster.link"] = {"bandwidth_gb_s": self.link.bandwidth_gb_s,
                                       "latency_s": self.link.latency_s}
        return out


@dataclass
class Evaluation:
    """One run: which deployment, what it was asked, what it measured, and the verdict."""

    kind: str
    role: str  # probe (one replica at 1/k of the load) | cluster | slow_end | fast_end | seed
    units: int
    replicas: int
    num_gpus: int
    load_qps: float
    scale: float
    seed: int
    ok: bool
    why: str
    values: dict[str, float | None]
    verdict: str
    usd_per_hour: float | None
    usd_per_million_tokens: float | None
    key: str
    cached: bool


@dataclass
class KindResult:
    kind: Kind
    refused: str | None = None  # why it was never simulated
    evaluations: list[Evaluation] = field(default_factory=list)
    units: int | None = None  # the smallest deployment verified at the target, if any
    seconds: float = 0.0
    capacity_qps: float | None = None  # load_per_dollar: the most one replica (unit) holds
    # None, or the cost (USD an hour, or GPUs) beyond which this kind was not searched
    beyond: float | None = None

    def best(self) -> Evaluation | None:
        return next((e for e in self.evaluations if e.role == "cluster" and e.ok
                     and e.units == self.units), None)


def kinds(plan: Plan) -> list[Kind]:
    """Every kind the search space names, colocated then by ratio."""
    cfg, base = plan.config.search, plan.base.replica
    gpus = cfg.gpus or [GPUChoice(name=base.measured_gpu,
                                  cost_per_gpu_hour=None if isinstance(base.gpu, str)
                                  else base.gpu_spec.cost_per_gpu_hour)]
    out: list[Kind] = []
    base_par = base.parallelism
    expert = base_par.expert if base_par.data == 1 else 1
    # (Experts sliced or not: a choice for kinds with ranks only.)
    eps = cfg.expert_parallel or [base_par.data == 1 or base_par.expert > 1]
    ranked = [(g, d, not ep) for g in gpus for d in cfg.data or [base_par.data]
              for ep in (eps if d > 1 else [True])]
    for gpu, data, sliced in dict.fromkeys(ranked):
        for tp in cfg.tensor or [base.parallelism.tensor]:
            for pp in cfg.pipeline or [base.parallelism.pipeline]:
                for quant in cfg.quantization or [base.quantization]:
                    for sched in cfg.schedulers:
                        ratios: list[Ratio | None] = [None] if cfg.colocated else []
                        ratios += list(cfg.disaggregated)
                        for ratio in ratios:
                            links: list[LinkChoice | None] = (
                                [None] if ratio is None or not cfg.links else list(cfg.links))
                            decodes = [{}] if ratio is None else cfg.decode_schedulers
                            backends = _backends(cfg.all2all_backends, data, sliced, ratio)
                            for link in links:
                                for decode in decodes:
                                    for backend in backends:
                                        kind = Kind(gpu, tp, pp, quant,
                                                    tuple(sorted(sched.items())), ratio, link,
                                                    tuple(sorted(decode.items())), data,
                                                    expert, sliced, backend)
                                        if kind not in out:  # (listed twice, searched once)
                                            out.append(kind)
    return out


ALL2ALL_LABELS = {"allgather_reducescatter": "AG/RS", "deepep_high_throughput": "DeepEP-HT",
                  "deepep_low_latency": "DeepEP-LL", "deepep_auto": "DeepEP-auto"}


def _backends(choices: list[Any] | None, data: int, sliced: bool,
              ratio: Ratio | None) -> list[tuple[str, str] | None]:
    """The (prefill or colocated, decode) all-to-all backends a kind is tried with: the
    search's where its ranks hold whole experts (a pool pair for disaggregated kinds only),
    else the base's (None)."""
    if not choices or data == 1 or sliced:
        return [None]
    out: list[tuple[str, str] | None] = []
    for choice in choices:
        if isinstance(choice, str):
            out.append((choice, choice))
        elif ratio is not None:
            out.append((choice.prefill, choice.decode))
    return out or [None]


class Searcher:
    """Runs (cached) the deployments of one plan; made again in each worker process."""

    def __init__(self, plan: Plan, out_dir: Path) -> None:
        self.plan = plan
        self.out_dir = out_dir
        self._max_units: int | None = None
        base = plan.base
        if base.clients is not None and not base.clients.paced:
            raise InputError(plan.path, "base.clients.paced", False,
                             "unpaced clients set no arrival rate: a plan holds a target rate "
                             "(clients.paced: true caps it)")
        knob = rate_knob(base)
        workload = base.workload
        if knob == "qps":
            self.knob = ("workload.retime.qps" if workload.retime is not None
                         else "workload.arrivals.qps")
            self.knob_per_qps = 1.0
        else:
            self.knob = "workload.rate_scale"
            qps = trace_qps(base)  # (at rate scale 1)
            if not qps > 0:
                raise InputError(plan.path, "base.workload", workload.format,
                                 "its requests arrive at one instant: no rate to scale")
            self.knob_per_qps = 1.0 / qps

    def evaluate(self, kind: Kind, units: int, role: str, *, load_fraction: float = 1.0,
                 scale: float = 1.0, seed: int | None = None,
                 load_qps: float | None = None) -> Evaluation:
        """Run `kind` at `units` (`probe`: one replica, at `load_fraction` of the target), at
        `load_qps` where given."""
        from sim.results.read import read_json
        from sim.runner import run_scenario

        plan = self.plan
        if load_qps is None:
            load_qps = plan.start_qps * load_fraction
        changes = kind.changes(1 if role == "probe" else units)
        changes[self.knob] = load_qps * self.knob_per_qps
        if scale != 1.0:
            changes["replica.latency.scale"] = scale
        if seed is not None:
            changes["seed"] = seed
        scenario = plan.scenario(changes)
        key = scenario_key(scenario)
        path = self.out_dir / "runs" / key / "summary.json"
        cached = path.is_file()
        if cached:
            summary = read_json(path)
        else:
            summary = run_scenario(scenario).summary
            replace_text(path, json.dumps(summary, sort_keys=True, default=str))
        ok, why, values = judge(summary, plan.config.slo)
        cost = summary.get("cost") or {}
        replicas = 1 if role == "probe" else kind.replicas(units)
        num_gpus = kind.gpus_per_replica if role == "probe" else kind.num_gpus(units)
        return Evaluation(kind.label(), role, units, replicas, num_gpus, load_qps, scale,
                          scenario.seed, ok,
                          why, values, (summary.get("overload") or {}).get("verdict", "unknown"),
                          cost.get("usd_per_hour"), cost.get("usd_per_million_tokens"), key,
                          cached)

    def precheck(self, kind: Kind) -> str | None:
        """Why `kind` cannot exist (one line), or None: its scenario, scheduler, latency model
        and KV cache are built, nothing simulated."""
        from sim.engine.cluster import kv_cache_for, make_latency, make_scheduler

        try:
            scenario = self.plan.scenario(kind.changes(1))
            for pool, cfg in _pools(scenario):
                scheduler = make_scheduler(cfg)
                make_latency(cfg, cfg.model_shape, scenario.source, pool)
                kv_cache_for(cfg, cfg.model_shape, pool, scenario.source, scheduler)
        except InputError as exc:
            return exc.one_line()
        return None

    def search(self, kind: Kind, max_units: int | None = None) -> KindResult:
        """Search `kind` (module docstring), no larger than `max_units` where given (larger
        ones would cost more than the plan cares to look at: `plan_run.COST_REACH`)."""
        start = time.perf_counter()
        self._max_units = max_units
        result = KindResult(kind, refused=self.precheck(kind))
        if result.refused is None:
            try:
                if self.plan.config.objective == "load_per_dollar":
                    result.capacity_qps = self.max_load(kind, result)
                elif kind.ratio is None:
                    self._colocated(kind, result)
                else:
                    self._units(kind, result)
            except InputError as exc:
                result.refused = exc.one_line()
        result.seconds = time.perf_counter() - start
        return result

    def max_load(self, kind: Kind, result: KindResult, scale: float = 1.0,
                 start_qps: float | None = None) -> float:
        """The most load one replica (or P:D unit) of `kind` holds, to LOAD_PRECISION:
        doubling from `start_qps` (the plan's starting load) while it holds (halving while it
        fails, at most MAX_HALVINGS times), then bisecting; 0 where even the lowest load tried
        fails."""
        role = "capacity" if scale == 1.0 else ("slow_end" if scale > 1 else "fast_end")

        def holds(qps: float) -> bool:
            ev = self.evaluate(kind, 1, role, load_qps=qps, scale=scale)
            result.evaluations.append(ev)
            return ev.ok

        lo, hi = 0.0, math.inf
        qps = self.plan.start_qps if start_qps is None else start_qps
        halvings = 0
        for _ in range(MAX_DOUBLINGS + MAX_HALVINGS):
            if holds(qps):
                lo = qps
                if hi < math.inf:
                    break
                qps *= 2
            else:
                hi = qps
                if lo > 0 or halvings == MAX_HALVINGS:
                    break
                qps /= 2
                halvings += 1
        if lo == 0.0 or hi == math.inf:
            return lo
        while (hi - lo) > LOAD_PRECISION * hi:
            mid = (lo + hi) / 2
            if holds(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def _limit(self, units: int) -> int:
        return units if self._max_units is None else min(units, self._max_units)

    def _colocated(self, kind: Kind, result: KindResult) -> None:
        limit = self._limit(self.plan.config.search.max_replicas)

        def probe(k: int) -> bool:
            ev = self.evaluate(kind, k, "probe", load_fraction=1.0 / k)
            result.evaluations.append(ev)
            return ev.ok

        # One replica failing at 1/limit of the load: the cluster of `limit` may still hold
        # (a router pools the load), so it is run all the same.
        k = _smallest(probe, limit) or limit
        self._verify(kind, result, k, limit)

    def _units(self, kind: Kind, result: KindResult) -> None:
        assert kind.ratio is not None
        limit = self._limit(self.plan.config.search.max_replicas
                            // (kind.ratio.prefill + kind.ratio.decode))
        if limit < 1:
            result.refused = (f"one unit of {kind.ratio.prefill}:{kind.ratio.decode} is more "
                              "than search.max_replicas replicas")
            return

        def cluster(m: int) -> bool:
            ev = self.evaluate(kind, m, "cluster")
            result.evaluations.append(ev)
            return ev.ok

        m = _smallest(cluster, limit)
        result.units = m

    def _verify(self, kind: Kind, result: KindResult, k: int, limit: int) -> None:
        """The cluster of `k` at the full load with the real router; one more while it fails
        (up to 4), one fewer while it holds (down to 1)."""
        runs: dict[int, bool] = {}

        def cluster(n: int) -> bool:
            if n not in runs:
                ev = self.evaluate(kind, n, "cluster")
                result.evaluations.append(ev)
                runs[n] = ev.ok
            return runs[n]

        n = k
        while not cluster(n):
            if n >= min(limit, k + 4):
                return
            n += 1
        while n > 1 and cluster(n - 1):
            n -= 1
        result.units = n


def _shown(value: Any) -> str:
    """A scheduler change's value in a kind's label: a mapping (a speculative config, say) as
    `(key=value,...)`, not a dict dump."""
    if isinstance(value, dict):
        return "(" + ",".join(f"{k}={_shown(v)}" for k, v in value.items()) + ")"
    if isinstance(value, list):
        return "[" + ",".join(_shown(v) for v in value) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _smallest(passes: Callable[[int], bool], limit: int) -> int | None:
    """The smallest n in [1, limit] with `passes(n)`, for a `passes` monotone in n: doubling
    from 1, then bisecting; None where `limit` fails."""
    lo, n = 0, 1  # lo: largest known failing
    while not passes(n):
        if n >= limit:
            return None
        lo, n = n, min(2 * n, limit)
    while n - lo > 1:
        mid = (lo + n) // 2
        if passes(mid):
            n = mid
        else:
            lo = mid
    return n


def _pools(scenario: Scenario) -> list[tuple[str, Any]]:
    cluster = scenario.cluster
    if cluster.prefill is not None and cluster.decode is not None:
        return [("cluster.prefill.replica", cluster.prefill.replica),
                ("cluster.decode.replica", cluster.decode.replica)]
    return [("replica", scenario.replica)]
