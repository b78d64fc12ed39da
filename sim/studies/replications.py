"""Independent replications of one scenario, and 95% confidence intervals from them.

Replication k runs the scenario with seed `scenario.seed + k`: generated arrivals (and
lengths) are drawn again, latency noise streams are drawn again, a random router draws again.
A replayed trace with no noise and no random router is deterministic: every replication would
be the same run, and an interval from them would be zero-width and fake, so it is refused
(`check_replicable`).

Each replication is one run, whole (`rep<k>/` holds a single run's files); its summary gives one
value per headline metric, and the replications are the independent observations:

Intervals from those values (Student t for means, an expanded percentile bootstrap for
percentiles, and why): `sim.results.metrics.intervals`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sim.config.errors import COMMAND_LINE, InputError
from sim.config.scenario import MAX_SEED, Scenario
from sim.results.formats import (
    DISTRIBUTIONS,
    PERCENTILES,
    THROUGHPUT,
)
from sim.results.formats import REPLICATED_COMPARISON_FILE as COMPARISON_FILE
from sim.results.formats import REPLICATIONS_FILE as RESULT_FILE
from sim.results.labels import fmt, label, unit
from sim.results.metrics.intervals import CONFIDENCE, MEAN_METHOD, PERCENTILE_METHOD, estimate
from sim.results.metrics.paired import DIFFERENCES_FILE, paired_differences
from sim.results.outdir import (
    PLOTS_DIR,
    REPORT_FILE,
    check_only_results,
    check_writable_dir,
    is_earlier_results,
    is_leftover,
    is_run_dir,
    shown_path,
    swap_in,
    temporary_dir,
)

# Each replication is a whole run, and the bootstrap draws BOOTSTRAP_RESAMPLES x N indices
# (80 MB at this N); 10**11 replications ran out of memory listing their seeds.
MAX_REPLICATIONS = 1_000
DETERMINISTIC = ("replications of a deterministic replay are identical; an interval would be "
                 "fake: add latency.noise or use generated arrivals")

# (summary section, label in tables, scale to the label's unit)
# The summary's distributions and throughputs replicated; names and units from `sim.results.labels`.
SLO_ORDER = ("ttft_attainment", "tbt_attainment", "tbt_gap_attainment", "all_attainment")

# -- what makes replications differ ------------------------------------------------------------

def variation_sources(scenario: Scenario) -> list[str]:
    """What differs between seeds: generated (or re-timed) arrivals, classes drawn by share,
    exponential think times, latency noise, a random router; empty for a deterministic
    replay."""
    sources = []
    workload = scenario.workload
    if getattr(workload, "arrivals", None) is not None or workload.retime is not None:
        sources.append("generated arrivals")
    columns = getattr(workload, "columns", None)
    if workload.classes and getattr(columns, "request_class", None) is None:
        sources.append("request classes drawn by share")
    clients = scenario.clients
    if clients is not None and clients.think_time == "exponential" and clients.think_time_s:
        sources.append("exponential think times")
    cluster = scenario.cluster
    if cluster.prefill is not None and cluster.decode is not None:
        pools = [(cluster.prefill.replica, cluster.prefill.replicas, cluster.router),
                 (cluster.decode.replica, cluster.decode.replicas, cluster.decode_router)]
    else:
        pools = [(scenario.replica, cluster.replicas, cluster.router)]
    noise = sorted({replica.latency.noise.kind for replica, _, _ in pools
                    if replica.latency.noise.enabled})
    if noise:
        sources.append(f"latency noise ({', '.join(noise)})")
    if any(router.name == "random" and count > 1 for _, count, router in pools):
        sources.append("random routing")
    return sources


def check_replicable(scenario: Scenario, replications: int,
                     field: str = "--replications") -> None:
    """One-line refusal of more replications than MAX_REPLICATIONS, of seeds past MAX_SEED,
    and of more than one replication of a deterministic scenario."""
    if replications > MAX_REPLICATIONS:
        raise InputError(COMMAND_LINE, field, replications, f"at most {MAX_REPLICATIONS:,}")
    last = scenario.seed + replications - 1
    if last > MAX_SEED:
        raise InputError(scenario.source, field, replications, f"seeds {scenario.seed}..{last} "
                         f"pass the largest seed, {MAX_SEED} (2**63 - 1): lower the seed")
    if replications > 1 and not variation_sources(scenario):
        raise InputError(scenario.source, field, replications, DETERMINISTIC)


def replication_seeds(scenario: Scenario, replications: int) -> list[int]:
    return [scenario.seed + k for k in range(replications)]


def summarize(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every headline metric over the replications' summaries (in replication order)."""
    metrics: dict[str, Any] = {}
    for key in DISTRIBUTIONS:
        dists = [s[key] for s in summaries]
        section = {pct: estimate([d.get(pct) for d in dists], "bootstrap") for pct in PERCENTILES}
        section["mean"] = estimate([d.get("mean") for d in dists], "t")
        metrics[key] = section
    metrics["throughput"] = {key: estimate([s["throughput"].get(key) for s in summaries], "t")
                             for key in THROUGHPUT}
    given = {name for s in summaries for name in s.get("slo", {})}
    names = [n for n in SLO_ORDER if n in given] + sorted(given - set(SLO_ORDER))
    metrics["slo"] = {name: estimate([s["slo"].get(name) for s in summaries], "t", (0.0, 1.0))
                      for name in names}
    return metrics


def censoring(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per replication, what the horizon left unfinished: the number of arrived requests
    counted at their wait so far in TTFT over every arrival (`ttft_all_arrived_s`), and which of
    its percentiles are then lower bounds. The headline TTFT (finished requests only) is biased
    low in a replication with any."""
    arrived = [s.get("ttft_all_arrived_s") or {} for s in summaries]
    marks = [a.get("is_lower_bound") or {} for a in arrived]
    return {"ttft_all_arrived_s": {
        "num_lower_bounds": [a.get("num_lower_bounds") for a in arrived],
        "is_lower_bound": {pct: [bool(m.get(pct, False)) for m in marks]
                           for pct in PERCENTILES},
        "p99": [a.get("p99") for a in arrived],
        "at_most_p99": [(a.get("at_most") or {}).get("p99") for a in arrived]}}


# -- running -----------------------------------------------------------------------------------

def is_replications_dir(path: Path) -> bool:
    return (path / RESULT_FILE).is_file()


def check_replications_dir(out: Path, field: str = "--out") -> None:
    """`out` may receive replications: absent, empty, an earlier run or earlier replications
    (replaced whole) holding nothing but what servesim writes there; anything else is refused
    before any run."""
    check_writable_dir(out, field)
    if (out.is_dir() and any(out.iterdir()) and not is_run_dir(out)
            and not is_replications_dir(out)):
        raise InputError(out, field, str(out), f"exists, is not empty and holds no "
                         f"{RESULT_FILE} or summary.json (not earlier results); refusing to "
                         "replace it: choose another directory")
    check_only_results(out, field)


def run_replications(scenario: Scenario, replications: int, out_dir: Path, *,
                     workers: int | None = None,
                     on_done: Callable[[int, dict[str, Any]], None] | None = None
                     ) -> dict[str, Any]:
    """Run the replications (on `workers` local processes; None or 1: in this process) into a
    fresh sibling of `out_dir`, then put it in `out_dir`'s place whole: `rep<k>/` per
    replication (a single run's files and its inputs record) and `replications.json`. Returns
    what `replications.json` holds. `on_done(k, summary)` as each replication finishes."""
    from sim.results.fingerprint import inputs_record
    from sim.results.read import read_json
    from sim.studies.workers import Job, run_jobs

    check_replicable(scenario, replications)
    check_replications_dir(out_dir)
    seeds = replication_seeds(scenario, replications)
    tmp = temporary_dir(out_dir)
    try:
        inputs = inputs_record(scenario)
        jobs = [Job(scenario.model_copy(update={"seed": seed}), str(tmp / f"rep{k}"), inputs)
                for k, seed in enumerate(seeds)]
        index = {job.out_dir: k for k, job in enumerate(jobs)}
        summaries: dict[int, dict[str, Any]] = {}

        def done(job: Job) -> None:
            k = index[job.out_dir]
            summaries[k] = read_json(Path(job.out_dir) / "summary.json")
            if on_done is not None:
                on_done(k, summaries[k])

        run_jobs(jobs, workers=workers, on_done=done)
        ordered = [summaries[k] for k in range(replications)]
        data = {
            "scenario": scenario.name, "source": scenario.source,
            "replications": replications, "seeds": seeds,
            "varies_by": variation_sources(scenario), "confidence": CONFIDENCE,
            "methods": {"mean": MEAN_METHOD, "percentile": PERCENTILE_METHOD},
            "metrics": summarize(ordered),
            "censoring": censoring(ordered),
            "overload": {"verdicts": [s.get("overload", {}).get("verdict", "unknown")
                                      for s in ordered]},
            "runs": [f"rep{k}" for k in range(replications)],
        }
        (tmp / RESULT_FILE).write_text(json.dumps(data, indent=2) + "\n")
        swap_in(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return data


# -- the table ---------------------------------------------------------------------------------

def table_rows(data: dict[str, Any]) -> list[tuple[str, dict[str, Any], float, str]]:
    """(label, metric, scale, kind) for each row: kind t or boot."""

    rows = []
    metrics = data["metrics"]
    for key in DISTRIBUTIONS:  # names and units as every table and figure gives them
        shown = unit(key)
        for stat in (*PERCENTILES, "mean"):
            name = f"{stat.upper() if stat != 'mean' else 'mean'} {label(key)} {shown.name}"
            rows.append((name, metrics[key][stat], shown.scale, stat))
    for key in THROUGHPUT:
        rows.append((f"{label(key)} {unit(key).name}", metrics["throughput"][key], 1.0, "mean"))
    for name, metric in metrics["slo"].items():  # short: the full labels widen the table
        rows.append((f"SLO attainment: {name.removesuffix('_attainment')} %", metric, 100.0,
                     "share"))
    return rows


def replications_table(data: dict[str, Any]) -> Any:
    """Each headline metric: estimate, 95% interval `[lo, hi]`, its half-width relative to the
    estimate, and the method; fits 80 columns."""
    from rich.table import Table

    seeds = data["seeds"]
    table = Table(title=f"{data['scenario']}: {data['replications']} replications, seeds "
                        f"{seeds[0]}..{seeds[-1]}", caption_justify="left")
    table.add_column("metric", no_wrap=True)
    table.add_column("estimate", justify="right", no_wrap=True)
    table.add_column("95% CI", justify="right", no_wrap=True)
    table.add_column("±", justify="right", no_wrap=True)
    table.add_column("CI", no_wrap=True)
    previous = None
    for name, metric, scale, kind in table_rows(data):
        group = name.split(" ")[0]
        if previous is not None and group != previous:
            table.add_section()
        previous = group
        est = metric["estimate"]
        lo, hi = metric["ci95"] or (None, None)
        if kind == "share":
            shown = "-" if est is None else f"{100 * est:.1f}%"
            ci = "-" if lo is None or hi is None else f"[{100 * lo:.1f}, {100 * hi:.1f}]"
        else:
            shown = fmt(est, scale)
            ci = "-" if lo is None or hi is None else f"[{fmt(lo, scale)}, {fmt(hi, scale)}]"
        if metric["ci95"] is None:
            ci = "all equal"
        half = ("-" if est in (None, 0) or lo is None or hi is None
                else f"{100 * (hi - lo) / 2 / abs(est):.1f}%")
        table.add_row(name, shown, ci, half, "boot" if metric["method"] == "bootstrap" else "t")
    verdicts = data["overload"]["verdicts"]
    over = sum(v == "overloaded" for v in verdicts)
    table.caption = (f"varies by: {', '.join(data['varies_by'])}. Overloaded in {over} of "
                     f"{len(verdicts)} replications. CI: t = Student t over the replications' "
                     "values; boot = expanded percentile bootstrap (fixed seed) of the mean of "
                     "the replications' percentiles, at least as wide as t. Intervals are "
                     "clipped to the values a metric can take; all equal: every replication "
                     "gave the same value, no interval (its spread says nothing).")
    cut = [n for n in data.get("censoring", {}).get("ttft_all_arrived_s", {})
           .get("num_lower_bounds", []) if n]
    if cut:
        table.caption += (f" TTFT is over finished requests: in {len(cut)} of {len(verdicts)} "
                          "replications the horizon left requests waiting, so it is biased low "
                          "(replications.json: censoring).")
    return table


# -- comparisons -------------------------------------------------------------------------------

# (column, metric path in `summarize`'s output); names and units from `sim.results.labels`
COMPARED = (("ttft_p50_s", ("ttft_s", "p50")), ("ttft_p99_s", ("ttft_s", "p99")),
            ("tbt_p50_s", ("tbt_s", "p50")), ("tbt_p99_s", ("tbt_s", "p99")),
            ("e2e_p99_s", ("e2e_s", "p99")),
            ("output_tokens_per_s", ("throughput", "output_tokens_per_s")),
            ("slo_attainment", ("slo", "all_attainment")))


# A plain comparison's table, and this one's two.
COMPARISON_TABLES = ("comparison.csv", COMPARISON_FILE, DIFFERENCES_FILE)


def check_comparison_dir(out_dir: Path, variants: Sequence[str]) -> None:
    """`out_dir` may receive a replicated comparison, which replaces it whole: absent, empty, or
    an earlier comparison (each entry a run's or replications' directory, a comparison table,
    or its plots); anything else is refused before any run."""
    check_writable_dir(out_dir)
    if is_run_dir(out_dir) or is_replications_dir(out_dir):
        raise InputError(out_dir, "--out", str(out_dir), "holds a single scenario's results; "
                         "choose another directory for a comparison")
    for variant in variants:
        check_replications_dir(out_dir / variant)
    check_only_comparison_entries(out_dir)


def check_only_comparison_entries(out_dir: Path) -> None:
    """`out_dir` is absent, empty or an earlier comparison (each entry a run's or replications'
    directory, a comparison table, or its plots or report): a comparison replaces the tables
    there, so anything else (a user's own files, `.notes` as much as `notes`: a replicated
    comparison is swapped in whole) refuses it before any run."""
    if not out_dir.is_dir():
        return
    for entry in sorted(out_dir.iterdir(), key=lambda e: e.name):
        if is_leftover(entry.name) or entry.name in (*COMPARISON_TABLES, REPORT_FILE):
            continue
        if entry.is_dir() and (entry.name == PLOTS_DIR or is_earlier_results(entry)):
            continue
        raise InputError(out_dir, "--out", str(out_dir), f"holds {shown_path(entry.name)}, "
                         "which is not part of an earlier comparison, and a comparison replaces "
                         "what is there: choose another directory")


def compare_replications(scenarios: dict[str, Scenario], replications: int, out_dir: Path, *,
                         workers: int | None = None,
                         on_variant: Callable[[str, dict[str, Any]], None] | None = None
                         ) -> dict[str, dict[str, Any]]:
    """Every variant of a comparison, `replications` times each (the same seeds for every
    variant), into `out_dir/<variant>/`; then `comparison_replications.csv` (estimate and
    interval of each headline number, one row per variant). Refused before any run where a
    variant is deterministic or a directory is taken.

    The whole comparison is built in a fresh sibling of `out_dir` and put in its place once
    every variant is done, replacing an earlier comparison there whole (its variants, tables
    and plots): an interrupted comparison leaves the earlier one as it was, never a mix of
    variants from two comparisons or a stale table beside new runs."""
    import pandas as pd

    for scenario in scenarios.values():
        check_replicable(scenario, replications)
    check_comparison_dir(out_dir, list(scenarios))
    tmp = temporary_dir(out_dir)
    try:
        done: dict[str, dict[str, Any]] = {}
        for variant, scenario in scenarios.items():
            done[variant] = run_replications(scenario, replications, tmp / variant,
                                             workers=workers)
            if on_variant is not None:
                on_variant(variant, done[variant])
        rows = []
        for variant, data in done.items():
            row: dict[str, Any] = {"variant": variant, "replications": replications}
            for column, (section, key) in COMPARED:
                metric = data["metrics"][section].get(key) or {"estimate": None,
                                                               "ci95": [None, None]}
                row[column] = metric["estimate"]
                # all replications equal: no interval (NaN in the table), see `estimate`
                row[f"{column}_lo"], row[f"{column}_hi"] = metric["ci95"] or (None, None)
            verdicts = data["overload"]["verdicts"]
            row["overloaded_replications"] = sum(v == "overloaded" for v in verdicts)
            rows.append(row)
        pd.DataFrame(rows).to_csv(tmp / COMPARISON_FILE, index=False)
        pd.DataFrame(paired_differences(done, COMPARED)).to_csv(tmp / DIFFERENCES_FILE,
                                                                index=False)
        swap_in(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return done
