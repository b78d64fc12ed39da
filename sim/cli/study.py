"""Commands that run many simulations: `compare`, `sweep` and `capacity`.

Each says what it kept when interrupted (Ctrl-C) and exits 130; finished runs stay on disk
whole, and no table is written from a partial set of runs.
"""

from __future__ import annotations

import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from sim.cli.common import app, console, fmt, pct, set_option


def interrupted(kept: str) -> typer.Exit:
    """Say what an interrupted command kept; the exit to raise (130, as after SIGINT)."""
    print(f"interrupted: {kept}", file=sys.stderr, flush=True)
    return typer.Exit(130)


@app.command()
def compare(
    comparison: Annotated[Path, typer.Argument(
        metavar="COMPARISON", help="comparison YAML: base + variants")],
    out: Annotated[Path | None, typer.Option(
        help="directory for each variant's results", show_default="results/<name>")] = None,
    replications: Annotated[int, typer.Option(
        min=1, help="run each variant N times (seeds SEED+0..N-1, the same for every "
                    "variant); each number with a 95% confidence interval")] = 1,
    workers: Annotated[int | None, typer.Option(
        min=1, help="replications: worker processes", show_default="one per CPU")] = None,
    set_: Annotated[list[str] | None, set_option(
        "in every variant, over the base and the variant's own changes")] = None,
) -> None:
    """Run every variant of a comparison file on the same trace; print one table."""
    from sim.compare import compare as run_all
    from sim.compare import load_comparison
    from sim.overrides import parse_overrides
    from sim.progress import ProgressReport

    overrides = parse_overrides(set_)
    scenarios = load_comparison(comparison, overrides)
    # Each variant is named <name>/<variant>, and a name may itself hold '/' (x/y).
    variant, first = next(iter(scenarios.items()))
    name = first.name.removesuffix(f"/{variant}")
    out_dir = out if out is not None else Path("results") / name
    if replications > 1:
        compare_replicated(name, scenarios, replications, out_dir, workers)
        return
    from sim.compare import check_comparison_dir
    from sim.replications import COMPARISON_FILE

    check_comparison_dir(out_dir, scenarios)
    # An earlier replicated comparison's table would look current beside these runs.
    (out_dir / COMPARISON_FILE).unlink(missing_ok=True)
    done: list[str] = []
    try:
        with ProgressReport(f"compare {name}", "variants", total=len(scenarios)) as progress:
            def advance(variant: str, results: Any) -> None:
                done.append(variant)
                progress.update(len(done))
                verdict = results.summary.get("overload", {}).get("verdict", "unknown")
                progress.note(f"{variant}: done ({verdict})")

            table, _ = run_all(scenarios, out_dir, on_variant=advance)
    except KeyboardInterrupt:
        raise interrupted(f"{len(done)} of {len(scenarios)} variants complete and kept in "
                          f"{out_dir}/<variant>/ ({', '.join(done) or 'none'}); comparison.csv "
                          "not written: run the comparison again") from None
    for part in comparison_tables(name, table, console.width):
        console.print(part)
    # A line each, short enough for 80 columns, and never folded inside a path.
    console.print(f"results: {out_dir}/", soft_wrap=True)
    console.print("  comparison.csv, <variant>/ (one run each)", soft_wrap=True)


def comparison_table(title: str, df: Any) -> Table:
    """One column per variant, one row per number (named by `sim.labels`): three variants
    with 18-character names fit 80 columns (no vertical rules). A row no variant has a value
    for (KV transfer when none is disaggregated) is left out."""
    import pandas as pd

    from sim.labels import label, unit

    rows = ("pools", "scheduler", "overload", "finished", "ttft_p50_s", "ttft_p99_s",
            "tbt_p50_s", "tbt_p99_s", "e2e_p99_s", "output_tokens_per_s", "slo_attainment",
            "transfer_p99_s", "num_gpus", "usd_per_million_tokens")
    numbers = {"ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s", "e2e_p99_s",
               "output_tokens_per_s", "transfer_p99_s", "usd_per_million_tokens"}
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("variant", max_width=18)  # labels wrap, not the variants' names
    for variant in df["variant"]:
        table.add_column(str(variant), justify="right", no_wrap=True)
    for key in rows:
        if key not in df or df[key].isna().all():
            continue
        shown = unit(key)
        if key == "slo_attainment":
            cells = [pct(v) for v in df[key]]
        elif key in numbers:
            cells = [fmt(v, shown.scale) for v in df[key]]
        elif key == "finished":
            cells = ["-" if pd.isna(v) else f"{int(v):,}" for v in df[key]]
        elif key == "pools" and "parallelism" in df:  # "2x TP4": GPUs per replica too
            cells = [p if pd.isna(s) or set(str(s).split("/")) == {"TP1"}
                     else f"{p} {_same(s)}"
                     for p, s in zip(df["pools"], df["parallelism"], strict=True)]
        elif key == "scheduler":  # one name where both pools run the same scheduler
            cells = [_same(s) for s in df[key]]
        else:
            cells = [str(v) for v in df[key]]
        if key == "overload":
            cells = [f"[red]{c}[/]" if c == "overloaded" else c for c in cells]
        name = label(key) if key in ("pools", "scheduler") or not shown.name else \
            f"{label(key)} {shown.name}"
        table.add_row(name, *cells)
    return table


def comparison_tables(title: str, df: Any, width: int) -> list[Table]:
    """`comparison_table`, split into tables of as many variants as fit `width` side by side
    with their names whole (six variants of 18 characters: two tables of three)."""
    longest = max((len(str(v)) for v in df["variant"]), default=1)
    per = max(1, (width - 20) // (max(longest, 8) + 2))  # the labels' 18, then 2 per gap
    if len(df) <= per:
        return [comparison_table(title, df)]
    parts = range(0, len(df), per)
    return [comparison_table(f"{title} ({k + 1} of {len(parts)})",
                             df.iloc[start:start + per].reset_index(drop=True))
            for k, start in enumerate(parts)]


def _same(value: Any) -> str:
    """"a/b" for pools that differ; "a" where every pool has the same ("a/a")."""
    parts = str(value).split("/")
    return parts[0] if len(set(parts)) == 1 else str(value)


def compare_replicated(name: str, scenarios: dict[str, Any], replications: int, out_dir: Path,
                       workers: int | None) -> None:
    """`compare --replications N`: each variant N times; estimates with 95% intervals."""
    from sim.outdir import SwappedInterrupt
    from sim.paired import DIFFERENCES_FILE
    from sim.progress import ProgressReport
    from sim.replications import COMPARISON_FILE, compare_replications

    done: list[str] = []
    try:
        with ProgressReport(f"compare {name}, {replications} replications each", "variants",
                            total=len(scenarios)) as progress:
            def advance(variant: str, data: dict[str, Any]) -> None:
                done.append(variant)
                progress.update(len(done))
                over = sum(v == "overloaded" for v in data["overload"]["verdicts"])
                progress.note(f"{variant}: done ({over} of {replications} overloaded)")

            results = compare_replications(scenarios, replications, out_dir, workers=min(
                workers or os.cpu_count() or 1, replications), on_variant=advance)
    except SwappedInterrupt:
        raise interrupted(f"after the comparison was complete: its results are in {out_dir}/ "
                          f"(<variant>/ and {COMPARISON_FILE})") from None
    except KeyboardInterrupt:
        raise interrupted(f"{len(done)} of {len(scenarios)} variants had finished; nothing "
                          f"changed in {out_dir}/ (a replicated comparison is put in place "
                          "whole once every variant is done): run the comparison again"
                          ) from None
    console.print(replicated_comparison_table(name, results))
    if len(results) > 1:
        console.print(differences_table(name, results))
    console.print(f"results: {out_dir}/", soft_wrap=True)
    console.print(f"  {COMPARISON_FILE}, {DIFFERENCES_FILE}", soft_wrap=True)
    console.print("  <variant>/replications.json, <variant>/rep<k>/ (one run each)",
                  soft_wrap=True)


def replicated_comparison_table(title: str, results: dict[str, dict[str, Any]]) -> Table:
    """One column per variant; each cell the estimate over the 95% interval `[lo, hi]`."""
    from sim.labels import label, unit
    from sim.replications import COMPARED

    first = next(iter(results.values()))
    table = Table(title=f"{title}: {first['replications']} replications per variant, seeds "
                        f"{first['seeds'][0]}..{first['seeds'][-1]}", caption_justify="left",
                  caption="estimate, then its 95% CI \\[lo, hi]: Student t for throughput and "
                          "SLO; for percentiles the mean of the replications' percentiles, "
                          "expanded percentile bootstrap at least as wide as t; all equal: "
                          "every replication gave the same value, no interval")
    table.add_column("metric", no_wrap=True)
    for variant in results:
        table.add_column(variant, justify="right", overflow="fold")
    for column, (section, key) in COMPARED:
        scale = unit(column).scale
        cells = []
        for data in results.values():
            metric = data["metrics"][section].get(key)
            if metric is None or metric["estimate"] is None:
                cells.append("-")
                continue
            lo, hi = metric["ci95"] or (None, None)
            interval = ("\n(all equal)" if metric["ci95"] is None else "" if lo is None
                        else f"\n[{fmt(lo, scale)}, {fmt(hi, scale)}]")
            cells.append(f"{fmt(metric['estimate'], scale)}{interval}")
        table.add_row(f"{label(column)} {unit(column).name}", *cells)
    overloaded = [sum(v == "overloaded" for v in d["overload"]["verdicts"])
                  for d in results.values()]
    table.add_row("overloaded", *(f"[red]{n} of {first['replications']}[/]" if n
                                  else f"0 of {first['replications']}" for n in overloaded))
    return table


def differences_table(title: str, results: dict[str, dict[str, Any]]) -> Table:
    """Each variant's paired difference from the first, one column per other variant."""
    from sim.labels import label, unit
    from sim.paired import paired_differences
    from sim.replications import COMPARED

    rows = paired_differences(results, COMPARED)
    baseline = next(iter(results))
    table = Table(title=f"{title}: each variant minus {baseline}, replication by replication",
                  caption_justify="left",
                  caption="mean of the paired differences (the same seeds for every variant), "
                          "then its 95% Student t CI; * the CI excludes 0; all equal: every "
                          "pair differed alike, no interval")
    table.add_column("metric", no_wrap=True)
    others = list(results)[1:]
    for variant in others:
        table.add_column(f"{variant} - {baseline}", justify="right", overflow="fold")
    for column, _ in COMPARED:
        scale = unit(column).scale
        cells = []
        for variant in others:
            row = next(r for r in rows if r["variant"] == variant and r["metric"] == column)
            if row["difference"] is None:
                cells.append("-")
                continue
            interval = ("\n(all equal)" if row["lo"] is None
                        else f"\n[{fmt(row['lo'], scale)}, {fmt(row['hi'], scale)}]")
            mark = " *" if row["clear"] else ""
            cells.append(f"{row['difference'] * scale:+,.4g}{mark}{interval}")
        table.add_row(f"{label(column)} {unit(column).name}", *cells)
    return table


class Backend(str, Enum):  # noqa: UP042  (typer takes str-mixin enums as choices)
    """Where a sweep's runs execute."""

    local = "local"
    ray = "ray"


@app.command()
def sweep(
    sweep_file: Annotated[Path, typer.Argument(metavar="SWEEP", help="sweep YAML")],
    out: Annotated[Path | None, typer.Option(
        help="sweep directory", show_default="results/<name>")] = None,
    workers: Annotated[int | None, typer.Option(
        min=1, help="worker processes, or Ray tasks at once",
        show_default="one per CPU; on Ray, the cluster's CPUs")] = None,
    backend: Annotated[Backend, typer.Option(help="where runs execute")] = Backend.local,
    address: Annotated[str | None, typer.Option(help="Ray cluster address")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="re-run every point, even those already done")] = False,
    set_: Annotated[list[str] | None, set_option(
        "in every run, over the base and the axes; refused for a swept field (or seed, "
        "where the sweep lists seeds): edit the sweep file for those")] = None,
) -> None:
    """Run every point of a sweep (cached: only new or changed points run); one table."""
    from sim.overrides import parse_overrides
    from sim.progress import ProgressReport
    from sim.sweep import check_sweep_dir, run_sweep, runs_kept
    from sim.sweep_file import load_sweep

    name, runs = load_sweep(sweep_file, parse_overrides(set_))
    out_dir = out if out is not None else Path("results") / name
    check_sweep_dir(out_dir)
    try:
        with ProgressReport(f"sweep {name}", "runs", total=len(runs)) as progress:
            if backend is Backend.local and workers is None:
                workers = os.cpu_count() or 1
            table = run_sweep(runs, out_dir, workers=workers,
                              backend=backend.value, address=address, force=force,
                              on_progress=lambda done, total: progress.update(done, total))
    except KeyboardInterrupt:
        raise interrupted(f"{runs_kept(runs, out_dir)} of {len(runs)} runs complete and kept "
                          f"in {out_dir}/runs/; run the sweep again to finish it") from None
    console.print(sweep_table(name, table))
    over = int((table["overload"] == "overloaded").sum())
    if over:
        console.print(f"{over} of {len(table)} runs overloaded: a queue grew faster than it was "
                      "served (over the run, or through a burst: see each run's verdict), so "
                      "their latencies describe no steady state")
    console.print(f"results: {out_dir}/", soft_wrap=True)  # lines for 80 columns, as compare's
    console.print("  results.parquet, results.csv, runs/<key>/ (one run each)", soft_wrap=True)
    if (out_dir / "results_ci.csv").is_file():
        console.print("  results_ci.csv: 95% intervals over seeds", soft_wrap=True)


def sweep_table(title: str, df: Any) -> Table:
    """The varied fields (mappings shown by their values), then the headline numbers; names
    and units from `sim.labels`, a word a line so that the numbers' columns stay narrow."""
    from sim.labels import label, param_label, unit
    from sim.sweep import METRICS, short_value

    varied = [c for c in df.columns if c not in {"seed", "key", *METRICS}]
    seeds = df["seed"].nunique() > 1
    # P99 TTFT in seconds here (E2E's unit): under load it runs to minutes.
    metrics = [(key, u) for key, u in (("ttft_p99_s", unit("e2e_p99_s")),
                                       ("tbt_p99_s", unit("tbt_p99_s")),
                                       ("output_tokens_per_s", unit("output_tokens_per_s")))]
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True)
    for column in varied:  # as wide as their values, up to a point
        width = min(24, max(len(short_value(v)) for v in df[column]))
        table.add_column("\n".join(param_label(column).split()), overflow="fold",
                         min_width=width)
    if seeds:
        table.add_column("seed", justify="right")
    for key, u in metrics:
        table.add_column("\n".join([*label(key).split(), u.name]), justify="right",
                         no_wrap=True)
    table.add_column("\n".join(label("slo_attainment").split()), justify="right", no_wrap=True)
    table.add_column("overload", min_width=10)
    for _, r in df.iterrows():
        cells = [short_value(r[c]) for c in varied] + ([str(r["seed"])] if seeds else [])
        cells += [fmt(r[key], u.scale) for key, u in metrics]
        cells.append(pct(r["slo_attainment"]))
        table.add_row(*cells, "[red]overloaded[/]" if r["overload"] == "overloaded"
                      else str(r["overload"]))
    return table


@app.command()
def capacity(
    scenario: Annotated[Path | None, typer.Argument(
        metavar="SCENARIO", help="scenario YAML; omit for the embedded default scenario")
    ] = None,
    tbt_p99: Annotated[float | None, typer.Option(help="SLO: P99 TBT, seconds")] = None,
    ttft_p90: Annotated[float | None, typer.Option(help="SLO: P90 TTFT, seconds")] = None,
    sched_delay_p50: Annotated[float | None, typer.Option(
        help="SLO: P50 scheduling delay, seconds")] = None,
    replications: Annotated[int | None, typer.Option(
        min=1, help="up to this many runs per probed rate (seeds SEED+0..N-1), stopping "
                    "early once a rate clearly holds or fails",
        show_default="5 where seeds make runs differ, 1 for a deterministic replay")] = None,
    seeds: Annotated[int | None, typer.Option(
        min=1, help="the older name of --replications (the same number)")] = None,
    precision: Annotated[float, typer.Option(
        help="relative precision of the bisection, in (0, 1)")] = 0.02,
    out: Annotated[Path | None, typer.Option(
        help="directory for trials.csv and capacity.json",
        show_default="results/<scenario name>-capacity")] = None,
    set_: Annotated[list[str] | None, set_option(
        "over the scenario file; the arrival rate (workload.arrivals.qps, or "
        "workload.rate_scale of a trace) is where the search starts")] = None,
) -> None:
    """Find the largest arrival rate at which every given SLO holds, as an interval.

    Expand, then bisect; each rate is decided by a sequential test over replications."""
    from sim.capacity import capacity as search
    from sim.capacity import default_replications
    from sim.capacity_log import CapacityLog
    from sim.errors import COMMAND_LINE, InputError
    from sim.overrides import load_scenario, parse_overrides
    from sim.progress import ProgressReport
    from sim.rate_decision import SLOTargets, check_options
    from sim.replications import check_replicable

    targets = SLOTargets(tbt_p99, ttft_p90, sched_delay_p50)
    check_options(targets, precision)
    if seeds is not None and replications is not None and seeds != replications:
        raise InputError(COMMAND_LINE, "--seeds", seeds, f"is the older name of --replications "
                         f"({replications}): give one of them")
    loaded = load_scenario(scenario, parse_overrides(set_))
    wanted = replications if replications is not None else seeds
    if wanted is not None:
        check_replicable(loaded, wanted, "--replications" if replications else "--seeds")
    out_dir = out if out is not None else Path("results") / f"{loaded.name}-capacity"
    log = CapacityLog(out_dir)
    try:
        with ProgressReport(f"capacity of {loaded.name}", "runs") as progress:
            def trial_done(trial: Any) -> None:
                log.add(trial)
                progress.update(len(log.trials))
                progress.note(trial.line(targets))

            result = search(loaded, targets, wanted if wanted is not None
                            else default_replications(loaded), precision=precision,
                            on_trial=trial_done,
                            on_rate=lambda decision: progress.note(decision.line()))
    except KeyboardInterrupt:
        raise interrupted(f"{len(log.trials)} trials kept in {out_dir}/trials.csv; no "
                          "capacity.json (the search did not finish): run it again") from None
    log.finish(loaded, targets, precision, result)
    console.print(capacity_table(loaded.name, result))
    console.print(f"results: {out_dir}/", soft_wrap=True)  # lines for 80 columns, as compare's
    console.print("  trials.csv, capacity.json", soft_wrap=True)
    console.print(f"  draw them: servesim plot {out_dir}", soft_wrap=True)


def capacity_table(name: str, result: dict[str, Any]) -> Table:
    """Each probed rate: its runs, decision and why; the interval in the caption."""
    from sim.labels import label, unit

    table = Table(title=f"capacity of {name} ({result['knob']})", caption_justify="left")
    table.add_column(f"{label('qps')}\n{unit('qps').name}", justify="right", no_wrap=True)
    if result["knob"] != "qps":
        table.add_column("scale", justify="right", no_wrap=True)
    table.add_column("runs", justify="right", no_wrap=True)
    table.add_column("decision", no_wrap=True)
    table.add_column("why")
    colour = {"holds": "green", "fails": "red", "unsure": "yellow"}
    for d in sorted(result["rates"], key=lambda d: d.rate):
        cells = [fmt(d.qps)] + ([fmt(d.rate)] if result["knob"] != "qps" else [])
        table.add_row(*cells, str(len(d.trials)), f"[{colour[d.decision]}]{d.decision}[/]",
                      d.reason)
    low, high = result["interval_qps"]
    level = f"{100 * result['confidence']:g}%"
    runs = (f"{result['num_runs']} runs, up to {result['replications']} per rate"
            if result["replications"] > 1 else f"{result['num_runs']} runs, one per rate")
    if high is None:
        caption = (f"capacity at least {fmt(low)} req/s, upper end unbounded: no rate probed "
                   f"failed ({runs})")
    elif result["highest_held"] == 0.0:
        caption = (f"capacity in [0, {fmt(high)}] req/s: no rate probed held, the targets are "
                   f"missed even at {fmt(high)} req/s (below an unloaded server's latency?) "
                   f"({runs})")
    else:
        caption = f"capacity in [{fmt(low)}, {fmt(high)}] req/s ({runs})"
    for where in result.get("stopped", []):
        caption += f"; the search stopped {where}"
    if result["deterministic"]:
        caption += "; deterministic: one run decides a rate, the width is the bisection precision"
    elif result["replications"] == 1:
        caption += f"; one replication per rate: seed {result['seeds'][0]} only, no confidence"
    else:
        caption += (f"; each end decided with {level} confidence, per probed rate, not a "
                    f"joint coverage (sequential one-sided t over replications differing by "
                    f"{', '.join(result['varies_by'])}, Bonferroni over looks and targets)")
    if result.get("saturation_knee"):
        caption += (f"; the upper end overloaded: lower end = {fmt(result['highest_held_qps'])} "
                    "req/s, the highest that held, less the overload test's 1% resolution")
    gpus = result["num_gpus"]
    caption += (f"; {fmt(result['capacity_qps_per_gpu'])} req/s per GPU at the lower end "
                f"({gpus} GPU{'s' if gpus != 1 else ''})")
    if result.get("usd_per_million_tokens") is not None:
        caption += (f"; ${fmt(result['usd_per_million_tokens'])} per million tokens "
                    f"(${fmt(result['usd_per_million_output_tokens'])} per million output "
                    "tokens) at the highest rate that held")
    table.caption = caption
    return table
