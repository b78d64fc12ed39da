"""A plan's answer (`sim.studies.plan`): the cheapest deployment that holds, whether it holds
across the latency model's error band, the same at other seeds, and the cost/SLO front; written
as `plan.json` and `candidates.csv`."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sim.results.outdir import replace_text
from sim.studies.plan import LOAD_PRECISION, Evaluation, KindResult, Searcher
from sim.studies.plan_file import Plan
from sim.studies.plan_run import evaluation_rows, objective, unit_cost

NUM_DECIDING = 3  # the cheapest passing deployments checked across the band
# load_per_dollar: the best kinds searched at their band's slow end, at most (each search is
# some ten runs; a cliff at the slow end would otherwise send it down the whole ranking)
MAX_SLOW_ENDS = 8
MAX_EXTRA = 3  # replicas (units) added at the band's slow end, at most


def band_for(plan: Plan, result: KindResult) -> tuple[float, bool]:
    """(fraction, extrapolated): the error band of `result`'s kind (`plan.band`: as
    `servesim capacity` takes it, `latency_band`; or the plan's own), and whether its GPU is
    one the calibration did not measure."""
    from sim.studies.capacity import latency_band

    band, extrapolated = latency_band(plan.scenario(result.kind.changes(1)))
    given = plan.config.band
    if given == "none":
        return 0.0, extrapolated
    return (band if given == "auto" else float(given)), extrapolated


def answer(plan: Plan, searcher: Searcher, results: list[KindResult],
           on_run: Callable[[Evaluation], None] | None = None) -> dict[str, Any]:
    """The chosen deployment and the checks around it (module docstring), as plan.json's
    `answer`; runs the band ends and the seeds."""
    if plan.config.objective == "load_per_dollar":
        return answer_load(plan, searcher, results)
    def run(result: KindResult, units: int, role: str, **extra: Any) -> Evaluation:
        ev = searcher.evaluate(result.kind, units, role, **extra)
        same = next((e for e in result.evaluations if e.key == ev.key), None)
        if same is not None:  # the very run the search made (the base's seed, nominal times)
            return same
        result.evaluations.append(ev)
        if on_run is not None:
            on_run(ev)
        return ev

    # Cheapest first; at one cost, the one with the most room inside its tightest target.
    passing = sorted(((r, ev) for r in results if (ev := r.best()) is not None),
                     key=lambda pair: (objective(plan, pair[1]),
                                       -min((m for m in margins(plan, pair[1].values).values()
                                             if m is not None), default=0.0)))
    if not passing:
        return {"chosen": None, "why": "no deployment searched holds the SLOs at the target "
                                       "load (raise search.max_replicas, or widen the search)"}
    # The cheapest re-run with every seed, a replica (unit) more while one of them fails;
    # the next ones too while they may still be cheaper than that.
    picks: list[tuple[bool, float, int, KindResult, int, list[Evaluation], list[str],
                      list[str]]] = []
    for order, (result, nominal) in enumerate(passing):
        holding = [p for p in picks if not p[0]]
        if holding and objective(plan, nominal) > min(p[1] for p in holding):
            break
        units, raised = nominal.units, []
        while True:
            # (the base's seed: the cluster run itself, cached where the search made it)
            seeds = [run(result, units, "cluster" if i == 0 else "seed",
                         seed=plan.base.seed + i) for i in range(plan.config.seeds)]
            failed = [f"seed {ev.seed}: {ev.why}" for ev in seeds if not ev.ok]
            if not failed or units >= nominal.units + MAX_EXTRA:
                break
            raised.append(f"{units} units: {failed[0]}")
            units += 1
        picks.append((bool(failed), objective(plan, seeds[0]), order, result, units, seeds,
                      raised, failed))
    # Every seed held first, then the cheapest, then the search's order (margins on ties).
    _, _, _, result, units, seeds, raised, failed = min(picks, key=lambda p: p[:3])
    chosen = seeds[0]
    others = [(r, ev.units) for r, ev in passing if r is not result][:NUM_DECIDING - 1]
    deciding = []
    for kind_result, units_checked in [(result, units), *others]:
        band, extrapolated = band_for(plan, kind_result)
        check: dict[str, Any] = {"kind": kind_result.kind.label(), "units": units_checked,
                                 "replicas": kind_result.kind.replicas(units_checked),
                                 "band": band, "extrapolated": extrapolated}
        if band > 0:
            slow = units_checked
            while not (held := run(kind_result, slow, "slow_end", scale=1 + band)).ok:
                if slow >= units_checked + MAX_EXTRA:
                    break
                slow += 1
            check["units_at_slow_end"] = slow if held.ok else None
            check["replicas_at_slow_end"] = kind_result.kind.replicas(slow) if held.ok else None
            check["objective_at_slow_end"] = objective(plan, held) if held.ok else None
            check["holds_across_band"] = held.ok and slow == units_checked
            check["fewer_hold_at_fast_end"] = (
                units_checked > 1
                and run(kind_result, units_checked - 1, "fast_end", scale=1 - band).ok)
        deciding.append(check)
    # The cheapest of those that holds at the band's slow end, at the size it needs there.
    robust = sorted((c for c in deciding if c.get("objective_at_slow_end") is not None),
                    key=lambda c: c["objective_at_slow_end"])
    robust_choice = None
    if robust:
        robust_choice = f"{robust[0]['kind']} x {robust[0]['replicas_at_slow_end']}"
    elif all(not c["band"] for c in deciding):
        robust_choice = f"{chosen.kind} x {chosen.replicas}"
    return {
        "chosen": {"kind": chosen.kind, "units": chosen.units, "replicas": chosen.replicas,
                   "num_gpus": chosen.num_gpus, "usd_per_hour": chosen.usd_per_hour,
                   "usd_per_million_tokens": chosen.usd_per_million_tokens,
                   "values": chosen.values, "margins": margins(plan, chosen.values),
                   "raised_for_seeds": raised},
        "band_checks": deciding,
        "robust_choice": robust_choice,
        "seeds": {"seeds": [ev.seed for ev in seeds], "all_hold": not failed,
                  "failures": failed},
    }


def answer_load(plan: Plan, searcher: Searcher, results: list[KindResult]) -> dict[str, Any]:
    """`load_per_dollar`: the kind whose replica (or P:D unit) holds the most load per USD an
    hour; its load searched again at the band's ends (an interval), and re-run at that load
    with every seed. The next kinds' loads are searched at their own band's slow end while
    their nominal load per dollar could still beat the best slow end found (a kind holds no
    more with longer iterations), MAX_SLOW_ENDS kinds at most, naming the robust choice: the
    most load per dollar at the slow end."""
    ranked = sorted((r for r in results if r.capacity_qps), key=lambda r: (
        -(r.capacity_qps or 0.0) / unit_cost(plan, r.kind), r.kind.label()))
    if not ranked:
        return {"chosen": None, "why": "no kind holds the SLOs at any load tried"}
    result = ranked[0]
    capacity = result.capacity_qps or 0.0
    at_capacity = next(ev for ev in result.evaluations
                       if ev.role == "capacity" and ev.ok and ev.load_qps == capacity)
    checks: list[dict[str, Any]] = []
    unchecked = False  # kinds that might have beaten the robust choice were left unsearched
    best_slow = 0.0  # the most load per USD an hour at a checked kind's slow end
    for other in ranked:
        unit = unit_cost(plan, other.kind)
        nominal = (other.capacity_qps or 0.0) / unit
        if checks and nominal <= best_slow:  # (its slow end is at most its nominal load)
            break
        if len(checks) == MAX_SLOW_ENDS:
            unchecked = True
            break
        band, extrapolated = band_for(plan, other)
        check: dict[str, Any] = {"kind": other.kind.label(), "units": 1,
                                 "replicas": other.kind.replicas(1), "band": band,
                                 "extrapolated": extrapolated}
        slow = nominal_qps = other.capacity_qps or 0.0
        if band > 0:
            # From where the nominal load, scaled, puts each end; each found to the search's
            # precision on a grid of its own, so held to its side of the nominal load (a
            # kind holds no more with longer iterations, no less with shorter).
            slow = check["slow_qps"] = min(nominal_qps, searcher.max_load(
                other.kind, other, 1 + band, start_qps=nominal_qps / (1 + band)))
            if other is result:
                check["fast_qps"] = max(capacity, searcher.max_load(
                    other.kind, other, 1 - band, start_qps=capacity / (1 - band)))
        check["slow_qps_per_usd_hour"] = slow / unit
        best_slow = max(best_slow, slow / unit)
        checks.append(check)
    robust = max(checks, key=lambda c: c["slow_qps_per_usd_hour"])
    robust_choice = None if all(not c["band"] for c in checks) else robust["kind"]

    def at(load_qps: float) -> list[Evaluation]:
        runs = [searcher.evaluate(result.kind, 1, "seed", load_qps=load_qps,
                                  seed=plan.base.seed + i) for i in range(plan.config.seeds)]
        result.evaluations.extend(runs)
        return runs

    seeds = at(capacity)
    failed = [f"seed {ev.seed}: {ev.why}" for ev in seeds if not ev.ok]
    # Where another seed fails at it, the load every seed holds: down a step of the search's
    # precision at a time, to half the capacity at most.
    every_seed: float | None = capacity
    while every_seed is not None and not all(ev.ok for ev in (
            seeds if every_seed == capacity else at(every_seed))):
        every_seed *= 1 - LOAD_PRECISION
        if every_seed < capacity / 2:
            every_seed = None
    unit = unit_cost(plan, result.kind)
    slow_end = {c["kind"]: c["slow_qps_per_usd_hour"] for c in checks if c["band"]}
    return {
        "chosen": {"kind": result.kind.label(), "units": 1,
                   "replicas": result.kind.replicas(1), "num_gpus": at_capacity.num_gpus,
                   "usd_per_hour": at_capacity.usd_per_hour,
                   "usd_per_million_tokens": at_capacity.usd_per_million_tokens,
                   "capacity_qps": capacity, "qps_per_usd_hour": capacity / unit,
                   "values": at_capacity.values,
                   "margins": margins(plan, at_capacity.values), "raised_for_seeds": []},
        "ranking": [{"kind": r.kind.label(), "capacity_qps": r.capacity_qps,
                     "qps_per_usd_hour": (r.capacity_qps or 0.0) / unit_cost(plan, r.kind),
                     "slow_qps_per_usd_hour": slow_end.get(r.kind.label())}
                    for r in ranked],
        "band_checks": checks,
        "robust_choice": robust_choice,
        "robust_unchecked_kinds": unchecked,
        "seeds": {"seeds": [ev.seed for ev in seeds], "all_hold": not failed,
                  "failures": failed, "capacity_every_seed_qps": every_seed},
    }


def margins(plan: Plan, values: dict[str, float | None]) -> dict[str, float | None]:
    """Per target, how far inside it the value is, as a fraction of the target (attainment:
    above it); negative outside."""
    out: dict[str, float | None] = {}
    for key, target in plan.config.slo.items():
        value = values.get(key)
        if value is None or math.isinf(value):
            out[key] = None
        elif key == "attainment":
            out[key] = (value - target) / target
        else:
            out[key] = (target - value) / target
    return out


def front(plan: Plan, rows: list[Evaluation], key: str) -> list[Evaluation]:
    """The cost/`key` Pareto front of the cluster runs at the target (nominal times): no
    other run both costs no more and does better."""
    better = (lambda a, b: a >= b) if key == "attainment" else (lambda a, b: a <= b)
    points = sorted((ev for ev in rows if ev.values.get(key) is not None
                     and ev.role == "cluster" and not math.isinf(ev.values[key] or 0)),
                    key=lambda ev: (objective(plan, ev), ev.values[key]))
    out: list[Evaluation] = []
    for ev in points:
        if not out or not better(out[-1].values[key], ev.values[key]):
            out.append(ev)
    return out


def write_outputs(plan: Plan, out_dir: Path, results: list[KindResult],
                  answer_: dict[str, Any], seconds: float) -> None:
    """`candidates.csv` (every run, every refused kind) and `plan.json`."""
    import pandas as pd

    rows = evaluation_rows(results)
    table = pd.DataFrame(rows)
    replace_text(out_dir / "candidates.csv", table.to_csv(index=False))
    runs = [ev for r in results for ev in r.evaluations]
    record = {
        "name": plan.config.name, "plan": plan.config.model_dump(mode="json"),
        "target_qps": plan.config.target_qps, "objective": plan.config.objective,
        "answer": answer_,
        "kinds": [{"kind": r.kind.label(), "refused": r.refused, "units": r.units,
                   "capacity_qps": r.capacity_qps, "beyond": r.beyond,
                   "runs": len(r.evaluations), "seconds": round(r.seconds, 3),
                   "best": None if (ev := r.best()) is None else {
                       "replicas": ev.replicas, "num_gpus": ev.num_gpus,
                       "usd_per_hour": ev.usd_per_hour, "values": ev.values}}
                  for r in results],
        "counts": {"kinds": len(results),
                   # every size of every kind the search space holds
                   "candidates": sum(plan.config.search.max_replicas // r.kind.replicas(1)
                                     for r in results),
                   "refused": sum(r.refused is not None for r in results),
                   "runs": len(runs), "simulated": sum(not ev.cached for ev in runs),
                   "cached": sum(ev.cached for ev in runs),
                   "deployments": len({(ev.kind, ev.units) for ev in runs
                                       if ev.role != "probe"})},
        "seconds": round(seconds, 3),
    }
    replace_text(out_dir / "plan.json", json.dumps(record, indent=1, default=str) + "\n")
