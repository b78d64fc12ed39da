"""Capacity under SLOs: the largest arrival rate at which every given SLO holds, as an interval.

As Sarathi-Serve's capacity search: start from the scenario's rate, double it while the SLOs
hold (halve it while they fail), then bisect to the stated precision. What is new is how one
rate is decided. Each probed rate runs up to R replications (seeds `scenario.seed + 0..R-1`,
the same seeds at every rate: common random numbers), one at a time, and stops as soon as a
sequential test decides (`decide`):

- *fails* at once when a run is overloaded (`summary["overload"]`, a slope test on the queues,
  see `sim.results.metrics.overload`: near saturation a finite trace hides an unbounded queue, so a
  growing queue violates whatever the percentiles say), or has no value for a target;
- otherwise, from two runs on, each target's metric (the run's P99 TBT, say) is averaged over
  the runs so far: the rate *holds* when the one-sided upper confidence bound of that mean is
  at most the target for every target, and *fails* when the lower bound of one is above its
  target. Bounds are Student t; the level is Bonferroni-corrected for the up to R - 1 looks
  and the k targets (each at (1 - confidence) / ((R - 1) k)), so a decision is wrong with
  probability at most 1 - confidence (under normality of the per-run metric). The confidence
  is that of each rate's decision, not a joint coverage of the interval. Where the runs so far
  all give the same value (no spread: a constant iteration time gives every run the same
  token gap), no bound is drawn from it: the rate runs on to R, and there is decided by the
  value, as deterministic as the model. A run without a P99 TBT (no request with two tokens)
  has no gap to miss the target, and is left out of its mean;
- TTFT and scheduling-delay targets are judged over every arrived request (the summary's
  `*_all_arrived_s`), not only the finished: where requests unfinished at a horizon make a
  percentile a lower bound, "holds" uses its worst case (`at_most`, unbounded where it is)
  and "fails" its lower bound, so a rate holds only when its targets are met for certain;
- after R runs with neither, the rate is *unsure*: inside the statistical resolution of R
  replications.

The search keeps every decision and brackets the knee from both sides: the lower end is the
highest rate that holds, the upper end the lowest rate that fails (unsure rates lie between),
each end bisected to the precision. The capacity is that interval; `capacity_qps` is its lower
end (a rate shown to hold). Where the upper end failed by overload (the knee is saturation),
the lower end is lowered by the overload test's resolution (`GROWTH_LIMIT`, 1%): a finite run
does not call a queue that grows by less than that overloaded, so a rate that held may be that
far past saturation. A deterministic scenario (a replayed trace without latency noise or random
routing) runs once per rate: one run decides, and the interval's width is the bisection
precision (plus that resolution at a saturation knee), nothing more.

`CapacityLog` keeps the search on disk as it goes: `trials.csv` (one row per run, rewritten
after each, so an interrupted search keeps its runs) and, at the end, `capacity.json` (targets,
each probed rate with its runs, decision and reason, the interval), which `servesim plot`
draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sim.config.errors import InputError
from sim.config.scenario import Scenario
from sim.results.metrics.intervals import CONFIDENCE
from sim.results.metrics.overload import GROWTH_LIMIT
from sim.results.run_dir import Results
from sim.runner import cluster_gpus, run_scenario
from sim.studies.rate_decision import (
    TARGETS,
    RateDecision,
    SLOTargets,
    Trial,
    censored,
    check_options,
    decide,
    measured,
    ms,
    violations,
)
from sim.studies.replications import check_replicable, replication_seeds, variation_sources
from sim.workloads.base import MAX_RATE_QPS
from sim.workloads.load import rate_knob, trace_qps, with_rate

DEFAULT_REPLICATIONS = 5  # up to this many runs per rate, where seeds make runs differ

def search(scenario: Scenario, targets: SLOTargets, seeds: list[int], *,
           deterministic: bool = False, precision: float = 0.02, max_steps: int = 40,
           confidence: float = CONFIDENCE, run: Callable[[Scenario], Results] = run_scenario,
           on_trial: Callable[[Trial], None] | None = None,
           on_rate: Callable[[RateDecision], None] | None = None,
           stopped: list[str] | None = None) -> list[RateDecision]:
    """Expand, then bisect both ends of the knee; every probed rate, in the order probed.
    Expanding stops at a rate that cannot be simulated (halved until its arrivals span more
    than 2**32 s, say), saying why in `stopped`: the user gave the starting rate, not that
    one, so its input error would blame a value they never wrote. Doubling goes no further
    than MAX_RATE_QPS arrivals per second: it probes that rate last and, if it holds, says
    so in `stopped`."""
    if scenario.clients is not None and not scenario.clients.paced:
        raise InputError(scenario.source, "clients.paced", False,
                         "unpaced clients send as fast as answers come back: there is no "
                         "arrival rate to search; set clients.paced: true (a rate the clients "
                         "cap), or sweep clients.concurrency")
    knob = rate_knob(scenario)
    workload = scenario.workload
    start = (workload.rate_scale if knob != "qps"
             else workload.retime.qps if workload.retime is not None
             else workload.arrivals.qps)  # type: ignore[attr-defined]
    qps_per_unit = 1.0 if knob == "qps" else trace_qps(scenario)
    probed: dict[float, RateDecision] = {}

    def probe(rate: float) -> str:
        if rate in probed:
            return probed[rate].decision
        trials: list[Trial] = []
        decided = None
        for seed in seeds:
            results = run(with_rate(scenario, rate, seed))
            bad = violations(results, targets)
            verdict = (results.summary.get("overload") or {}).get("verdict", "unknown")
            trials.append(Trial(seed, rate, rate * qps_per_unit, not bad, bad, verdict,
                                measured(results), results.summary.get("cost") or {},
                                censored(results)))
            if on_trial is not None:
                on_trial(trials[-1])
            decided = decide(trials, targets, len(seeds), deterministic=deterministic,
                             confidence=confidence)
            if decided is not None:
                break
        assert decided is not None  # the last replication always decides
        probed[rate] = RateDecision(rate, rate * qps_per_unit, decided[0], decided[1], trials,
                                    decided[2])
        if on_rate is not None:
            on_rate(probed[rate])
        return decided[0]

    def probe_beyond(rate: float) -> str | None:
        """`probe`, or None where the rate cannot be simulated (said in `stopped`)."""
        try:
            return probe(rate)
        except InputError as exc:
            if stopped is not None:
                stopped.append(f"at {rate * qps_per_unit:.4g} req/s, which cannot be "
                               f"simulated ({exc.field}: {exc.problem})")
            return None

    # The highest rate simulated (MAX_RATE_QPS arrivals per second): doubling stops there,
    # probing it rather than a rate beyond, which would be refused.
    top = MAX_RATE_QPS / qps_per_unit if qps_per_unit > 0 else math.inf
    while top * qps_per_unit > MAX_RATE_QPS:  # rounded up: the last float below it
        top = math.nextafter(top, 0.0)
    first = probe(start)
    rate = start
    for _ in range(max_steps if first != "fails" else 0):  # up to a rate that fails
        if rate >= top:
            if stopped is not None:
                stopped.append(f"at {rate * qps_per_unit:.4g} req/s, the highest arrival rate "
                               f"simulated ({MAX_RATE_QPS:.0e} req/s: arrivals a nanosecond "
                               "apart on average)")
            break
        rate = min(rate * 2, top)
        if probe_beyond(rate) in ("fails", None):
            break
    rate = start
    for _ in range(max_steps if first != "holds" else 0):  # down to a rate that holds
        rate /= 2
        if probe_beyond(rate) in ("holds", None):
            break
        if (why := _unloaded_miss(probed[2 * rate], probed[rate], targets)) is not None:
            # Halving further changes nothing: the targets sit below an unloaded server's
            # latency (a search for 1 us TTFT halved 116 times to 6e-08 req/s).
            if stopped is not None:
                stopped.append(f"at {rate * qps_per_unit:.4g} req/s: {why}")
            break
    for _ in range(2 * max_steps):
        lo, hi = _ends(probed)
        if hi is None or lo == 0.0:
            break
        hi_lo = min(r for r, d in probed.items() if r > lo and d.decision != "holds")
        lo_hi = max(r for r, d in probed.items() if r < hi and d.decision != "fails")
        if hi_lo - lo > precision * hi_lo:  # bisect the lower end: last hold, first other
            probe((lo + hi_lo) / 2)
        elif hi - lo_hi > precision * hi:  # the upper end: last other, first fail
            probe((lo_hi + hi) / 2)
        else:
            break
    return list(probed.values())


# Within this of each other, failing latencies at a rate and at half of it show no load effect.
UNLOADED_RTOL = 0.02


def _unloaded_miss(higher: RateDecision, lower: RateDecision, targets: SLOTargets) -> str | None:
    """Why halving the rate again cannot help, or None: both rates failed, neither run was
    overloaded, and each target's metric (mean over the runs) is the same at both within
    UNLOADED_RTOL: the latency is the server's own, not the queue's."""
    runs = [*higher.trials, *lower.trials]
    both_failed = higher.decision == lower.decision == "fails"
    if not both_failed or any(t.verdict == "overloaded" for t in runs):
        return None
    missed = []
    for name, target in targets.given().items():
        means = []
        for decision in (higher, lower):
            given = [t.metrics_s.get(name) for t in decision.trials]
            values = [v for v in given if v is not None and math.isfinite(v)]
            if len(values) != len(given):
                return None
            means.append(float(np.mean(values)))
        if abs(means[0] - means[1]) > UNLOADED_RTOL * max(means):
            return None
        if means[1] > target:
            missed.append(f"{TARGETS[name][1]} {ms(means[1], target)} > {ms(target)}")
    if not missed:
        return None
    return (f"{'; '.join(missed)} at this rate and at twice it alike: the targets are below "
            "what an unloaded server gives, and no lower rate can meet them")


def _ends(probed: dict[float, RateDecision]) -> tuple[float, float | None]:
    """(highest rate that holds below the first that fails, or 0; first that fails, or
    None)."""
    fails = [r for r, d in probed.items() if d.decision == "fails"]
    hi = min(fails) if fails else None
    lo = max((r for r, d in probed.items() if d.decision == "holds" and (hi is None or r < hi)),
             default=0.0)
    return lo, hi


def default_replications(scenario: Scenario) -> int:
    """DEFAULT_REPLICATIONS where seeds make runs differ; 1 for a deterministic replay."""
    return DEFAULT_REPLICATIONS if variation_sources(scenario) else 1


def capacity(scenario: Scenario, targets: SLOTargets,
             replications: int | Sequence[int] | None = None, *, precision: float = 0.02,
             confidence: float = CONFIDENCE, max_steps: int = 40,
             run: Callable[[Scenario], Results] = run_scenario,
             on_trial: Callable[[Trial], None] | None = None,
             on_rate: Callable[[RateDecision], None] | None = None,
             band: float = 0.0) -> dict[str, Any]:
    """The capacity interval. `replications`: up to how many runs per rate (seeds
    `scenario.seed + 0..R-1`), or the seeds themselves; None: `default_replications`. More than
    one of a deterministic scenario is refused (they would be identical). `band` > 0: the
    search again with every iteration time `1 + band` and `1 - band` times the model's (the
    ends of its error band, `latency_band`), and `with_band_qps`, the interval from the slow
    end's lower bound to the fast end's upper one."""
    result = _capacity(scenario, targets, replications, precision=precision,
                       confidence=confidence, max_steps=max_steps, run=run, on_trial=on_trial,
                       on_rate=on_rate)
    if band > 0:
        def tagged(scale: float) -> Callable[[Trial], None] | None:
            if on_trial is None:
                return None

            def tag(trial: Trial) -> None:
                trial.latency_scale = scale
                on_trial(trial)
            return tag

        ends = {name: _capacity(with_latency_scale(scenario, scale), targets, replications,
                                precision=precision, confidence=confidence,
                                max_steps=max_steps, run=run, on_trial=tagged(scale),
                                on_rate=on_rate)
                for name, scale in (("slow", 1 + band), ("fast", 1 - band))}
        result["band"] = {"band": band, **{
            name: {"capacity_qps": end["capacity_qps"], "interval_qps": end["interval_qps"],
                   "num_runs": end["num_runs"]} for name, end in ends.items()}}
        result["with_band_qps"] = [ends["slow"]["interval_qps"][0],
                                   ends["fast"]["interval_qps"][1]]
        result["num_runs"] += sum(end["num_runs"] for end in ends.values())
    return result


def latency_band(scenario: Scenario) -> tuple[float, bool]:
    """(fraction, extrapolated) iteration times may be off by: the engine calibration's error
    band on the GPU it measured, wider on another (`EngineCalibration.band`); 0 where the
    latency model is not the calibrated roofline (a measured profile has its own error)."""
    errors = []
    for pool in scenario.pools():
        cfg = pool.replica
        if cfg.latency.kind != "roofline":
            return 0.0, False
        errors.append(cfg.calibration.band(cfg.measured_gpu))
    return max(e[0] for e in errors), any(e[1] for e in errors)


def with_latency_scale(scenario: Scenario, scale: float) -> Scenario:
    """`scenario` with every replica's iteration times `scale` times longer."""
    def scaled(cfg: Any) -> Any:
        latency = cfg.latency.model_copy(update={"scale": cfg.latency.scale * scale})
        return cfg.model_copy(update={"latency": latency})

    cluster = scenario.cluster
    if cluster.prefill is not None and cluster.decode is not None:
        cluster = cluster.model_copy(update={
            pool: getattr(cluster, pool).model_copy(update={
                "replica": scaled(getattr(cluster, pool).replica)})
            for pool in ("prefill", "decode")})
    return scenario.model_copy(update={"replica": scaled(scenario.replica), "cluster": cluster})


def _capacity(scenario: Scenario, targets: SLOTargets,
              replications: int | Sequence[int] | None, *, precision: float,
              confidence: float, max_steps: int, run: Callable[[Scenario], Results],
              on_trial: Callable[[Trial], None] | None,
              on_rate: Callable[[RateDecision], None] | None) -> dict[str, Any]:
    check_options(targets, precision)
    if replications is None:
        replications = default_replications(scenario)
    if isinstance(replications, int):
        check_replicable(scenario, replications)  # before listing 10**11 seeds, say
        seeds = replication_seeds(scenario, replications)
    else:
        seeds = list(replications)
        check_replicable(scenario, len(seeds))
    sources = variation_sources(scenario)
    deterministic = not sources
    stopped: list[str] = []
    rates = search(scenario, targets, seeds, deterministic=deterministic, precision=precision,
                   max_steps=max_steps, confidence=confidence, run=run, on_trial=on_trial,
                   on_rate=on_rate, stopped=stopped)
    probed = {d.rate: d for d in rates}
    held, hi = _ends(probed)
    # A knee at saturation (the upper end failed by overload) is seen only to the overload
    # test's resolution: a finite run does not call a queue growing by less than GROWTH_LIMIT
    # of the arrivals overloaded, so a rate that held may be up to that much past saturation.
    saturated = hi is not None and any(t.verdict == "overloaded" for t in probed[hi].trials)
    lo = held * (1 - GROWTH_LIMIT) if saturated else held
    qps_per_unit = rates[0].qps / rates[0].rate if rates[0].rate else 1.0
    lo_qps, hi_qps = lo * qps_per_unit, None if hi is None else hi * qps_per_unit
    num_gpus = cluster_gpus(scenario)
    num_runs = sum(len(d.trials) for d in rates)
    if deterministic:
        meaning = ("deterministic scenario (a replayed trace, no latency noise or random "
                   "routing): one run per rate decides; the interval is exact for this trace "
                   f"and its width is the bisection precision ({precision:g}), nothing more")
    elif len(seeds) == 1:
        meaning = (f"one replication per rate (seed {seeds[0]}): the interval holds for that "
                   "seed's draws only; no confidence is stated")
    else:
        meaning = (f"lower: the highest rate whose SLO metrics' means are below their targets "
                   f"with {100 * confidence:g}% confidence; upper: the lowest rate above them "
                   f"with {100 * confidence:g}% confidence, or overloaded (one-sided Student "
                   f"t over up to {len(seeds)} replications per rate, Bonferroni over the "
                   f"looks and the {len(targets.given())} target(s); runs differ by "
                   f"{', '.join(sources)}); rates in between are unsure. The confidence is "
                   "per probed rate (each end's own decision), not a joint coverage of the "
                   "interval")
    if saturated:
        meaning += (f"; the upper end failed by overload, and a finite run does not call a "
                    f"queue growing by less than {100 * GROWTH_LIMIT:g}% of arrivals "
                    f"overloaded, so the lower end is the highest rate that held "
                    f"({held * qps_per_unit:.4g} req/s) less {100 * GROWTH_LIMIT:g}%")
    if hi is None:
        within = "" if stopped else f" within {max_steps} doublings"
        meaning += f"; no rate probed failed{within}: the upper end is unbounded (null)"
    if held == 0.0 and hi is not None:
        meaning += ("; no rate probed held: the targets are missed even at the lowest rate "
                    f"probed, {hi * qps_per_unit:.4g} req/s (below an unloaded server's "
                    "latency?)")
    for where in stopped:
        meaning += f"; the search stopped {where}"
    runs_held = probed[held].trials if held in probed else []
    return {"knob": rate_knob(scenario), "capacity": lo, "capacity_qps": lo_qps,
            "highest_held": held, "highest_held_qps": held * qps_per_unit,
            "saturation_knee": saturated,
            "interval": [lo, hi], "interval_qps": [lo_qps, hi_qps],
            # the upper end None: unbounded, no rate probed failed within max_steps
            "ci95_qps": [lo_qps, hi_qps],
            "interval_meaning": meaning, "confidence": confidence,
            "replications": len(seeds), "seeds": seeds, "deterministic": deterministic,
            "varies_by": sources, "num_runs": num_runs, "rates": rates, "stopped": stopped,
            "num_gpus": num_gpus, "capacity_qps_per_gpu": lo_qps / num_gpus,
            **{key: _mean_cost(runs_held, key)
               for key in ("usd_per_million_tokens", "usd_per_million_output_tokens")}}


def _mean_cost(trials: list[Trial], key: str) -> float | None:
    """Mean over the runs at the highest rate that held of `key` of their cost; None if there
    is no such run or no price."""
    values = [t.cost.get(key) for t in trials]
    if not values or any(v is None for v in values):
        return None
    return float(np.mean([float(v) for v in values if v is not None]))
