"""One probed rate of a capacity search: the SLO targets, what a run measured against them
(over every arrived request, with lower bounds where a horizon cut requests off), and the
sequential test that decides the rate from its replications (`decide`; the method is described
in `sim.studies.capacity`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from sim.config.errors import COMMAND_LINE, InputError
from sim.results.metrics.intervals import CONFIDENCE, t_bounds
from sim.results.run_dir import Results

# target field -> (command-line option, label, summary section, percentile)
TARGETS = {
    "tbt_p99_s": ("--tbt-p99", "P99 TBT", "tbt_s", "p99"),
    "ttft_p90_s": ("--ttft-p90", "P90 TTFT", "ttft_s", "p90"),
    "sched_delay_p50_s": ("--sched-delay-p50", "P50 scheduling delay", "scheduling_delay_s",
                          "p50"),
}


def ms(value_s: float | None, near_s: float | None = None) -> str:
    """Seconds shown in milliseconds, 4 significant digits, or more where that would show a
    value equal to the target `near_s` it differs from (never `40 ms > 40 ms`)."""
    if value_s is None or math.isinf(value_s):
        return "unbounded"
    digits = 4
    while (near_s is not None and value_s != near_s and digits < 12
           and f"{value_s * 1e3:.{digits}g}" == f"{near_s * 1e3:.{digits}g}"):
        digits += 1
    return f"{value_s * 1e3:,.{digits}g} ms"


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
        raise InputError(COMMAND_LINE, "/".join(o for o, *_ in TARGETS.values()), None,
                         "give an SLO")
    for name, value in targets.given().items():
        if not (math.isfinite(value) and value > 0):
            raise InputError(COMMAND_LINE, TARGETS[name][0], value,
                             "must be a positive, finite number of seconds")
    if not (math.isfinite(precision) and 0 < precision < 1):
        raise InputError(COMMAND_LINE, "--precision", precision,
                         "must be a fraction between 0 and 1 (e.g. 0.02)")


@dataclass
class Trial:
    """One run of the search at one rate, and what decided it."""

    seed: int
    rate: float  # the knob's value (qps, or the trace's rate scale)
    qps: float
    ok: bool  # every target met for certain, and not overloaded
    violations: list[str]  # what keeps it from `ok` (certain misses; censored maybes)
    verdict: str = "unknown"  # the run's overload verdict
    # by target field: the value judged: exact, or, where requests left unfinished by the
    # horizon make it a lower bound, its worst case (`at_most`; inf where unbounded)
    metrics_s: dict[str, float | None] = field(default_factory=dict)
    cost: dict[str, Any] = field(default_factory=dict)  # the run's summary["cost"]
    # by target field, only where the value is censored: its lower bound (the best case)
    lower_s: dict[str, float] = field(default_factory=dict)
    # Iteration times' scale: 1, or an end of the latency model's error band (`--band`).
    latency_scale: float = 1.0

    def line(self, targets: SLOTargets) -> str:
        """E.g. `seed 0, rate 12.5 req/s: violates P99 TBT 61 ms > 50 ms`."""
        head = f"seed {self.seed}, rate {self.qps:.4g} req/s"
        if self.latency_scale != 1.0:
            head += f", iteration times x{self.latency_scale:g}"
        if self.violations:
            return f"{head}: violates {'; '.join(self.violations)}"
        given = targets.given()  # met: name the target it came closest to
        name = max(given, key=lambda n: (self.metrics_s.get(n) or 0.0) / given[n])
        value = self.metrics_s.get(name)
        shown = "-" if value is None else ms(value, given[name])
        worst = (" (at most; requests unfinished at the horizon: met in the worst case)"
                 if name in self.lower_s else "")
        return (f"{head}: meets {TARGETS[name][1]} {shown} <= {ms(given[name])}{worst} "
                f"({self.verdict})")


@dataclass
class RateDecision:
    """One probed rate: its runs (replications, in seed order), the decision and why."""

    rate: float  # the knob's value
    qps: float
    decision: str  # holds | fails | unsure
    reason: str
    trials: list[Trial] = field(default_factory=list)
    # by target field: mean over the runs and its one-sided bounds (None where not computed)
    stats_s: dict[str, dict[str, float | None]] = field(default_factory=dict)

    def line(self) -> str:
        """E.g. `rate 12.5 req/s: fails after 2 runs: P99 TBT mean 0.061 > 0.05 (...)`."""
        runs = f"{len(self.trials)} run{'s' if len(self.trials) != 1 else ''}"
        return f"rate {self.qps:.4g} req/s: {self.decision} after {runs}: {self.reason}"

    def record(self) -> dict[str, Any]:
        return {"rate": self.rate, "qps": self.qps, "runs": len(self.trials),
                "seeds": [t.seed for t in self.trials], "decision": self.decision,
                "reason": self.reason, "metrics_s": self.stats_s}


# Targets judged over every arrived request where the summary has that distribution (see
# `sim.results.metrics.arrived.arrived_stats`): over finished requests only, a horizon that cuts a
# queue hides the longest waits and biases them low.
ARRIVED = {"ttft_p90_s": "ttft_all_arrived_s",
           "sched_delay_p50_s": "scheduling_delay_all_arrived_s"}


def measures(results: Results) -> dict[str, tuple[float | None, float | None]]:
    """Each target's metric in a run as (worst case, best case): equal where exact. Over every
    arrival where the summary has it; where requests unfinished at the horizon make the
    percentile a lower bound, the best case is that bound and the worst its `at_most` (inf
    where unbounded): a rate holds only when its targets are met for certain."""
    s = results.summary
    out: dict[str, tuple[float | None, float | None]] = {}
    for name, (_, _, section, pct) in TARGETS.items():
        arrived = s.get(ARRIVED.get(name, ""))
        if arrived and arrived.get(pct) is not None:
            value = float(arrived[pct])
            if (arrived.get("is_lower_bound") or {}).get(pct):
                worst = (arrived.get("at_most") or {}).get(pct)
                out[name] = (math.inf if worst is None else float(worst), value)
            else:
                out[name] = (value, value)
        else:
            out[name] = (s[section][pct], s[section][pct])
    return out


def measured(results: Results) -> dict[str, float | None]:
    """The value of each target's metric in a run: exact, or its worst case (see
    `measures`)."""
    return {name: worst for name, (worst, _) in measures(results).items()}


def censored(results: Results) -> dict[str, float]:
    """The best case of each target's metric that is censored (a lower bound) in a run."""
    return {name: best for name, (worst, best) in measures(results).items()
            if best is not None and worst != best}


def violations(results: Results, targets: SLOTargets) -> list[str]:
    """What keeps the run from meeting its targets for certain: each target exceeded, each
    censored one whose range contains its target, and an overloaded verdict."""
    out = []
    values = measures(results)
    for name, target in targets.given().items():
        worst, best = values[name]
        label = TARGETS[name][1]
        if best is None and name == "tbt_p99_s":
            continue  # no request produced two tokens: no gap to miss the target
        if best is None or worst is None:
            out.append(f"{label} none > {ms(target)}")
        elif worst == best and worst > target:
            out.append(f"{label} {ms(worst, target)} > {ms(target)}")
        elif best > target:
            out.append(f"{label} >= {ms(best, target)} > {ms(target)} (a lower bound decided: "
                       "requests unfinished at the horizon)")
        elif worst > target:
            out.append(f"{label} in [{ms(best)}, {ms(worst)}] may exceed {ms(target)} "
                       "(requests unfinished at the horizon: a lower bound)")
    overload = results.summary.get("overload") or {}
    if overload.get("verdict") == "overloaded":
        out.append(f"overloaded: {overload.get('detail', '')}")
    return out


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def decide(trials: list[Trial], targets: SLOTargets, replications: int, *,
           deterministic: bool, confidence: float = CONFIDENCE
           ) -> tuple[str, str, dict[str, dict[str, float | None]]] | None:
    """The sequential test after each run at one rate (see the module): (decision, reason,
    per-target statistics), or None to run the next replication."""
    given = targets.given()
    last = trials[-1]
    if last.verdict == "overloaded":
        return "fails", f"overloaded in the run of seed {last.seed} (a queue grows)", {}
    missing = [TARGETS[n][1] for n in given
               if last.metrics_s.get(n) is None and n != "tbt_p99_s"]
    if missing:
        return "fails", f"no {', '.join(missing)} in the run of seed {last.seed}", {}
    # Per target, each run's worst case (judged for "holds") and best case (for "fails"); equal
    # where exact. A run without a P99 TBT (no request with two tokens) has no gap to miss the
    # target: it is left out, never averaged in as a fake 0.
    worst = {n: [v for t in trials if (v := t.metrics_s.get(n)) is not None] for n in given}
    best = {n: [t.lower_s.get(n, v) for t in trials if (v := t.metrics_s.get(n)) is not None]
            for n in given}
    cut = {n for n in given if any(n in t.lower_s for t in trials)}
    note = {n: " (lower bounds: requests unfinished at the horizon)" if n in cut else ""
            for n in given}
    gapless = [n for n in given if not worst[n]]  # only tbt_p99_s can be empty here
    if replications == 1:
        stats: dict[str, dict[str, float | None]] = {
            n: {"mean": _finite(worst[n][0]) if worst[n] else None, "lower": None,
                "upper": None} for n in given}
        why = ("deterministic: one run decides" if deterministic
               else f"one replication (seed {last.seed}): its run decides, no confidence")
        if last.ok:
            name = max(given, key=lambda n: (worst[n][0] if worst[n] else 0.0) / given[n])
            shown = ms(worst[name][0], given[name]) if worst[name] else "none (no gap)"
            return "holds", (f"{why}; {TARGETS[name][1]} {shown} <= "
                             f"{ms(given[name])}{note[name]}"), stats
        if any(best[n] and best[n][0] > given[n] for n in given):
            return "fails", f"{why}; {'; '.join(last.violations)}", stats
        return "unsure", f"{why}; {'; '.join(last.violations)}", stats
    if len(trials) < 2:
        return None
    # Bonferroni over the looks at 2..R runs and over the k targets (a rate holds when all k
    # upper bounds are below their targets, fails when one lower bound is above): each
    # decision wrong with probability <= 1 - confidence.
    level = 1 - (1 - confidence) / ((replications - 1) * len(given))
    at_end = len(trials) >= replications
    shown = f"{100 * confidence:g}%"
    stats = {}
    lower: dict[str, float] = {}
    upper: dict[str, float] = {}
    equal: set[str] = set()
    for n in given:
        if not worst[n]:  # no gap in any run: nothing can miss the target
            lower[n], upper[n] = -math.inf, -math.inf
            stats[n] = {"mean": None, "lower": None, "upper": None}
            continue
        hi_vals, lo_vals = np.asarray(worst[n]), np.asarray(best[n])
        same = len(hi_vals) > 1 and bool((hi_vals == hi_vals[0]).all()
                                         and (lo_vals == hi_vals[0]).all())
        if same or len(hi_vals) < 2:
            # No spread (a constant iteration time gives every run the same token gap), or a
            # single value: nothing to bound a mean with. Keep running; after all R runs,
            # decide by the values themselves, as deterministic as the model.
            if at_end:
                equal.add(n)
                lower[n], upper[n] = float(lo_vals.min()), float(hi_vals.max())
            else:
                lower[n], upper[n] = -math.inf, math.inf
        else:
            upper[n] = (math.inf if not np.isfinite(hi_vals).all()
                        else t_bounds(hi_vals.tolist(), level)[2])
            lower[n] = t_bounds(lo_vals.tolist(), level)[1]
        mean = float(hi_vals.mean())
        stats[n] = {"mean": _finite(mean), "lower": _finite(lower[n]),
                    "upper": _finite(upper[n])}
        if n in cut:
            stats[n]["mean_lower_bound"] = float(lo_vals.mean())

    def describe(n: str, side: str) -> str:
        mean = stats[n]["mean"]
        m = "unbounded" if mean is None else ms(mean, given[n])
        if n in equal:
            count = len(worst[n])
            what = (f"all {count} runs equal" if count > 1 else "one run with a value")
            return (f"{TARGETS[n][1]} {m} {side} {ms(given[n])} ({what}: no spread to bound, "
                    f"decided by the value, as deterministic as the model){note[n]}")
        bound = lower[n] if side == ">" else upper[n]
        b = ms(bound, given[n])
        which = "lower" if side == ">" else "upper"
        return (f"{TARGETS[n][1]} mean {m} {side} {ms(given[n])} ({shown} {which} bound "
                f"{b}){note[n]}")

    above = [n for n in given if lower[n] > given[n]]
    if above:
        name = max(above, key=lambda n: lower[n] / given[n])
        return "fails", describe(name, ">"), stats
    if all(upper[n] <= given[n] for n in given):
        judged = [n for n in given if n not in gapless] or list(given)
        name = max(judged, key=lambda n: upper[n] / given[n])
        if name in gapless:
            return "holds", (f"{TARGETS[name][1]}: no request produced two tokens in any "
                             "run, no gap to miss the target"), stats
        return "holds", describe(name, "<="), stats
    if not at_end:
        return None

    return "unsure", "; ".join(
        f"{TARGETS[n][1]} mean {ms(stats[n]['mean'])}, {shown} bounds "
        f"[{ms(lower[n])}, {ms(upper[n])}] contain {ms(given[n])}{note[n]}"
        for n in given if upper[n] > given[n]), stats


