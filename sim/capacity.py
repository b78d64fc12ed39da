"""Capacity under SLOs: the largest arrival rate at which every given SLO holds.

As Sarathi-Serve's capacity search: start from the scenario's rate, double it while the SLOs
hold (halve it while they don't), then bisect to the stated precision. Each seed is searched on
its own; the capacity is their mean with a 95% confidence interval. A run whose overload verdict
(`summary["overload"]`, a slope test on the queues, see `sim.metrics.overload`) is `overloaded`
violates, whatever the percentiles say: near saturation a finite trace hides an unbounded queue.

`CapacityLog` keeps the search on disk as it goes: `trials.csv` (rewritten after each trial, so
an interrupted search keeps its trials) and, at the end, `capacity.json` (targets, per-seed
capacities, mean and CI), which `servesim plot` draws.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sim.config import Scenario
from sim.errors import InputError
from sim.outdir import check_writable_dir
from sim.runner import Results, cluster_gpus, load_workload, run_scenario

# target field -> (command-line option, label, summary section, percentile)
TARGETS = {
    "tbt_p99_s": ("--tbt-p99", "P99 TBT", "tbt_s", "p99"),
    "ttft_p90_s": ("--ttft-p90", "P90 TTFT", "ttft_s", "p90"),
    "sched_delay_p50_s": ("--sched-delay-p50", "P50 scheduling delay", "scheduling_delay_s",
                          "p50"),
}


@dataclass(frozen=True)
class SLOTargets:
    """Upper bounds in seconds; None: not a target. Each given one must be finite and > 0."""

    tbt_p99_s: float | None = None
    ttft_p90_s: float | None = None
    sched_delay_p50_s: float | None = None

    def given(self) -> dict[str, float]:
        return {name: value for name, value in asdict(self).items() if value is not None}


def check_options(targets: SLOTargets, precision: float) -> None:
    """One-line errors, before any run, for targets and a precision the search cannot use."""
    if not targets.given():
        raise InputError(None, "/".join(o for o, *_ in TARGETS.values()), None, "give an SLO")
    for name, value in targets.given().items():
        if not (math.isfinite(value) and value > 0):
            raise InputError(None, TARGETS[name][0], value,
                             "must be a positive, finite number of seconds")
    if not (math.isfinite(precision) and 0 < precision < 1):
        raise InputError(None, "--precision", precision,
                         "must be a fraction between 0 and 1 (e.g. 0.02)")


@dataclass
class Trial:
    """One run of the search at one rate, and what decided it."""

    seed: int
    rate: float  # the knob's value (qps, or the trace's rate scale)
    qps: float
    ok: bool
    violations: list[str]
    verdict: str = "unknown"  # the run's overload verdict
    metrics_s: dict[str, float | None] = field(default_factory=dict)  # by target field
    cost: dict[str, Any] = field(default_factory=dict)  # the run's summary["cost"]

    def line(self, targets: SLOTargets) -> str:
        """E.g. `seed 0, rate 12.5 req/s: violates P99 TBT 0.061 > 0.05`."""
        head = f"seed {self.seed}, rate {self.qps:.4g} req/s"
        if self.violations:
            return f"{head}: violates {'; '.join(self.violations)}"
        given = targets.given()  # met: name the target it came closest to
        name = max(given, key=lambda n: (self.metrics_s.get(n) or 0.0) / given[n])
        value = self.metrics_s.get(name)
        shown = "-" if value is None else f"{value:.4g}"
        return f"{head}: meets {TARGETS[name][1]} {shown} <= {given[name]:g} ({self.verdict})"


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


def measured(results: Results) -> dict[str, float | None]:
    """The value of each target's metric in a run."""
    s = results.summary
    return {name: s[section][pct] for name, (_, _, section, pct) in TARGETS.items()}


def violations(results: Results, targets: SLOTargets) -> list[str]:
    """What the run misses: each target exceeded, and an overloaded verdict."""
    out = []
    values = measured(results)
    for name, target in targets.given().items():
        value = values[name]
        if value is None and name == "tbt_p99_s":
            continue  # no request produced two tokens: no gap to miss the target
        if value is None or value > target:
            shown = "none" if value is None else f"{value:.4g}"
            out.append(f"{TARGETS[name][1]} {shown} > {target:g}")
    overload = results.summary.get("overload") or {}
    if overload.get("verdict") == "overloaded":
        out.append(f"overloaded: {overload.get('detail', '')}")
    return out


def search_seed(scenario: Scenario, targets: SLOTargets, seed: int, *, precision: float = 0.02,
                max_steps: int = 40, run: Callable[[Scenario], Results] = run_scenario,
                on_trial: Callable[[Trial], None] | None = None) -> SeedCapacity:
    """Expand, then bisect, the rate for one seed; `on_trial` sees each trial as it ends."""
    knob = rate_knob(scenario)
    start = (scenario.workload.arrivals.qps if knob == "qps"  # type: ignore[attr-defined]
             else scenario.workload.rate_scale)
    qps_per_unit = 1.0 if knob == "qps" else trace_qps(scenario)
    trials: list[Trial] = []

    def ok(rate: float) -> bool:
        results = run(with_rate(scenario, rate, seed))
        bad = violations(results, targets)
        verdict = (results.summary.get("overload") or {}).get("verdict", "unknown")
        trials.append(Trial(seed, rate, rate * qps_per_unit, not bad, bad, verdict,
                            measured(results), results.summary.get("cost") or {}))
        if on_trial is not None:
            on_trial(trials[-1])
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
            if ok(hi / 2):
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
             precision: float = 0.02, run: Callable[[Scenario], Results] = run_scenario,
             on_trial: Callable[[Trial], None] | None = None) -> dict[str, Any]:
    """Capacity per seed, their mean and a 95% confidence interval (Student t)."""
    check_options(targets, precision)
    per_seed = [search_seed(scenario, targets, seed, precision=precision, run=run,
                            on_trial=on_trial) for seed in seeds]
    values = np.array([c.capacity_qps for c in per_seed])
    mean = float(values.mean())
    half = 0.0
    if len(values) > 1:
        from scipy.stats import t

        half = float(t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values)))
    num_gpus = cluster_gpus(scenario)
    return {"knob": rate_knob(scenario), "capacity_qps": mean, "ci95_qps": [mean - half,
                                                                              mean + half],
            "per_seed": per_seed, "num_gpus": num_gpus,
            "capacity_qps_per_gpu": mean / num_gpus,
            **{key: _mean_at_capacity(per_seed, key)
               for key in ("usd_per_million_tokens", "usd_per_million_output_tokens")}}


def _mean_at_capacity(per_seed: list[SeedCapacity], key: str) -> float | None:
    """Mean over seeds of `key` of the cost in the run at each seed's capacity (the fastest
    rate that held); None if a seed has no such run or no price."""
    values = []
    for c in per_seed:
        held = [t for t in c.trials if t.ok and t.rate == c.capacity]
        value = held[0].cost.get(key) if held else None
        if value is None:
            return None
        values.append(value)
    return float(np.mean(values)) if values else None


TRIALS_FILE, RESULT_FILE = "trials.csv", "capacity.json"


def is_capacity_dir(path: Path) -> bool:
    return (path / TRIALS_FILE).is_file() or (path / RESULT_FILE).is_file()


class CapacityLog:
    """A capacity search on disk: `trials.csv` after each trial, `capacity.json` at the end."""

    def __init__(self, out_dir: Path) -> None:
        check_writable_dir(out_dir)
        if out_dir.is_dir() and any(out_dir.iterdir()) and not is_capacity_dir(out_dir):
            raise InputError(out_dir, "--out", str(out_dir), "exists, is not empty and holds "
                             f"no {TRIALS_FILE} (not a capacity search); choose another "
                             "directory")
        self.out_dir = out_dir
        self.trials: list[Trial] = []
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / RESULT_FILE).unlink(missing_ok=True)  # an earlier search's answer
            self._write_trials()
        except OSError as exc:
            raise InputError(out_dir, "--out", str(out_dir),
                             f"cannot write there: {exc.strerror}") from None

    def add(self, trial: Trial) -> None:
        self.trials.append(trial)
        self._write_trials()

    def _write_trials(self) -> None:
        rows = [{"seed": t.seed, "rate": t.rate, "qps": t.qps, "ok": t.ok,
                 "overload": t.verdict, **t.metrics_s, "violations": "; ".join(t.violations)}
                for t in self.trials]
        columns = ["seed", "rate", "qps", "ok", "overload", *TARGETS, "violations"]
        _replace(self.out_dir / TRIALS_FILE,
                 pd.DataFrame(rows, columns=columns).to_csv(index=False))

    def finish(self, scenario: Scenario, targets: SLOTargets, precision: float,
               result: dict[str, Any]) -> Path:
        """Write `capacity.json`: what was searched and what was found."""
        data = {
            "scenario": scenario.name, "source": scenario.source, "knob": result["knob"],
            "targets_s": targets.given(), "precision": precision,
            "per_seed": [{"seed": c.seed, "capacity": c.capacity,
                          "capacity_qps": c.capacity_qps, "trials": len(c.trials)}
                         for c in result["per_seed"]],
            "capacity_qps": result["capacity_qps"], "ci95_qps": result["ci95_qps"],
            **{key: result[key] for key in ("num_gpus", "capacity_qps_per_gpu",
                                            "usd_per_million_tokens",
                                            "usd_per_million_output_tokens")},
        }
        path = self.out_dir / RESULT_FILE
        _replace(path, json.dumps(data, indent=2) + "\n")
        return path


def _replace(path: Path, text: str) -> None:
    """Write `path` aside, then rename it into place: never half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
