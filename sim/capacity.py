"""Capacity under SLOs: the largest arrival rate at which every given SLO holds.

As Sarathi-Serve's capacity search: start from the scenario's rate, double it while the SLOs
hold (halve it while they don't), then bisect to the stated precision. Each seed is searched on
its own; the capacity is their mean with a 95% confidence interval. A run whose queue is still
growing at the end violates, whatever the percentiles say: near saturation a finite trace hides
an unbounded queue (`queue_growing`: the last fifth of arrivals waits longer than the P50
scheduling-delay target, 2 s if none is given, and twice as long as the first fifth).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from sim.config import Scenario
from sim.runner import Results, load_workload, run_scenario


@dataclass(frozen=True)
class SLOTargets:
    tbt_p99_s: float | None = None
    ttft_p90_s: float | None = None
    sched_delay_p50_s: float | None = None


@dataclass
class Trial:
    rate: float  # the knob's value (qps, or the trace's rate scale)
    qps: float
    ok: bool
    violations: list[str]


@dataclass
class SeedCapacity:
    seed: int
    capacity: float  # in the knob's unit
    capacity_qps: float
    trials: list[Trial] = field(default_factory=list)


def rate_knob(scenario: Scenario) -> str:
    """`qps` for generated arrivals, `rate_scale` for timed traces."""
    return "qps" if getattr(scenario.workload, "arrivals", None) is not None else "rate_scale"


def with_rate(scenario: Scenario, rate: float, seed: int) -> Scenario:
    workload = scenario.workload
    if rate_knob(scenario) == "qps":
        arrivals = workload.arrivals.model_copy(update={"qps": rate})  # type: ignore[attr-defined]
        workload = workload.model_copy(update={"arrivals": arrivals})
    else:
        workload = workload.model_copy(update={"rate_scale": rate})
    return scenario.model_copy(update={"workload": workload, "seed": seed})


DEFAULT_DELAY_LIMIT_S = 2.0  # Sarathi-Serve's P50 scheduling-delay bound for capacity


def queue_growing(requests: pd.DataFrame, limit_s: float = DEFAULT_DELAY_LIMIT_S) -> bool:
    """Heuristic: the last fifth of arrivals waited (to be scheduled) longer than `limit_s` and
    more than twice as long as the first fifth; or some request was never served."""
    if (requests["status"] == "unfinished").any():
        return True
    ordered = requests.sort_values("arrival_s")["scheduling_delay_s"].to_numpy()
    n = len(ordered)
    if n < 10:
        return False
    first = np.nanmedian(ordered[: int(0.2 * n)])
    last = np.nanmedian(ordered[int(0.8 * n):])
    return bool(last > limit_s and last > 2 * first)


def violations(results: Results, targets: SLOTargets) -> list[str]:
    s = results.summary
    out = []
    checks = (("tbt_p99_s", s["tbt_s"]["p99"], "P99 TBT"),
              ("ttft_p90_s", s["ttft_s"]["p90"], "P90 TTFT"),
              ("sched_delay_p50_s", s["scheduling_delay_s"]["p50"], "P50 scheduling delay"))
    for name, value, label in checks:
        target = getattr(targets, name)
        if value is None and name == "tbt_p99_s":
            continue  # no request produced two tokens: no gap to miss the target
        if target is not None and (value is None or value > target):
            out.append(f"{label} {value if value is None else round(value, 4)} > {target}")
    limit = targets.sched_delay_p50_s or DEFAULT_DELAY_LIMIT_S
    if queue_growing(results.requests, limit):
        out.append("queue still growing at the end")
    return out


def search_seed(scenario: Scenario, targets: SLOTargets, seed: int, *, precision: float = 0.02,
                max_steps: int = 40, run: Callable[[Scenario], Results] = run_scenario
                ) -> SeedCapacity:
    """Expand, then bisect, the rate for one seed."""
    knob = rate_knob(scenario)
    start = (scenario.workload.arrivals.qps if knob == "qps"  # type: ignore[attr-defined]
             else scenario.workload.rate_scale)
    qps_per_unit = 1.0 if knob == "qps" else trace_qps(scenario)
    trials: list[Trial] = []

    def ok(rate: float) -> bool:
        bad = violations(run(with_rate(scenario, rate, seed)), targets)
        trials.append(Trial(rate, rate * qps_per_unit, not bad, bad))
        return not bad

    lo, hi = 0.0, start
    if ok(hi):
        lo = hi
        for _ in range(max_steps):
            hi = lo * 2
            if not ok(hi):
                break
            lo = hi
    else:
        for _ in range(max_steps):
            hi_ok = ok(hi / 2)
            if hi_ok:
                lo = hi / 2
                break
            hi = hi / 2
    for _ in range(max_steps):
        if hi - lo <= precision * hi:
            break
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return SeedCapacity(seed, lo, lo * qps_per_unit, trials)


def trace_qps(scenario: Scenario) -> float:
    """Mean arrival rate of the selected trace at rate scale 1."""
    workload = scenario.workload.model_copy(update={"rate_scale": 1.0})
    arrivals = load_workload(scenario.model_copy(update={"workload": workload})).arrival_s
    return (len(arrivals) - 1) / arrivals[-1] if len(arrivals) > 1 and arrivals[-1] > 0 else 0.0


def capacity(scenario: Scenario, targets: SLOTargets, seeds: list[int], *,
             precision: float = 0.02, run: Callable[[Scenario], Results] = run_scenario
             ) -> dict[str, Any]:
    """Capacity per seed, their mean and a 95% confidence interval (Student t)."""
    per_seed = [search_seed(scenario, targets, seed, precision=precision, run=run)
                for seed in seeds]
    values = np.array([c.capacity_qps for c in per_seed])
    mean = float(values.mean())
    half = 0.0
    if len(values) > 1:
        from scipy.stats import t

        half = float(t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values)))
    return {"knob": rate_knob(scenario), "capacity_qps": mean, "ci95_qps": [mean - half,
                                                                              mean + half],
            "per_seed": per_seed}
