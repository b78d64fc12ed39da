"""Commands that run many simulations: `sweep` and `capacity` (`compare`: `sim.cli.compare`).

Each says what it kept when interrupted (Ctrl-C) and exits 130; finished runs stay on disk
whole, and no table is written from a partial set of runs.
"""

from __future__ import annotations

import math
import os
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from sim.cli.common import (
    app,
    calibration_lines,
    console,
    fmt,
    interrupted,
    pct,
    refuse_unused,
    set_option,
)


class Backend(str, Enum):  # noqa: UP042  (typer takes str-mixin enums as choices)
    """Where a sweep's runs execute."""

    local = "local"
    ray = "ray"


@app.command()
def sweep(
    ctx: typer.Context,
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
    from sim.config.overrides import parse_overrides
    from sim.studies.progress import ProgressReport
    from sim.studies.sweep import check_sweep_dir, run_sweep, runs_kept
    from sim.studies.sweep_file import load_sweep

    if backend is Backend.local:
        refuse_unused(ctx, {"address": "only with --backend ray"})
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
    for line in calibration_lines(run.scenario for run in runs):
        console.print(line)
    console.print(f"results: {out_dir}/", soft_wrap=True)  # lines for 80 columns, as compare's
    console.print("  results.parquet, results.csv, runs/<key>/ (one run each)", soft_wrap=True)
    if (out_dir / "results_ci.csv").is_file():
        console.print("  results_ci.csv: 95% intervals over seeds", soft_wrap=True)


def sweep_table(title: str, df: Any) -> Table:
    """The varied fields (mappings shown by their values), then the headline numbers; names
    and units from `sim.results.labels`, a word a line so that the numbers' columns stay narrow."""
    from sim.results.formats import METRICS
    from sim.results.labels import label, param_label, unit
    from sim.studies.sweep import short_value

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
    # What each point costs, where the points differ in it (a sizing sweep).
    costs = [key for key in ("num_gpus", "usd_per_million_tokens")
             if key in df and df[key].notna().any() and df[key].nunique() > 1]
    for key in costs:
        table.add_column("GPUs" if key == "num_gpus" else "$ per\nM tok", justify="right",
                         no_wrap=True)
    table.add_column("overload", min_width=10)
    for _, r in df.iterrows():
        cells = [short_value(r[c]) for c in varied] + ([str(r["seed"])] if seeds else [])
        cells += [fmt(r[key], u.scale) for key, u in metrics]
        cells.append(pct(r["slo_attainment"]))
        cells += [str(int(r[key])) if key == "num_gpus" else fmt(r[key]) for key in costs]
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
    band: Annotated[str, typer.Option(
        help="search again at the ends of the latency model's error band: auto (the engine "
             "calibration's, wider on a GPU it did not measure), none, or a fraction")
    ] = "auto",
) -> None:
    """Find the largest arrival rate at which every given SLO holds, as an interval.

    Expand, then bisect; each rate is decided by a sequential test over replications."""
    from sim.config.errors import COMMAND_LINE, InputError
    from sim.config.overrides import load_scenario, parse_overrides
    from sim.studies.capacity import capacity as search
    from sim.studies.capacity import default_replications
    from sim.studies.capacity_log import CapacityLog
    from sim.studies.progress import ProgressReport
    from sim.studies.rate_decision import SLOTargets, check_options
    from sim.studies.replications import check_replicable

    targets = SLOTargets(tbt_p99, ttft_p90, sched_delay_p50)
    check_options(targets, precision)
    if seeds is not None and replications is not None and seeds != replications:
        raise InputError(COMMAND_LINE, "--seeds", seeds, f"is the older name of --replications "
                         f"({replications}): give one of them")
    loaded = load_scenario(scenario, parse_overrides(set_))
    band_fraction, extrapolated = _band(band, loaded)
    wanted = replications if replications is not None else seeds
    if wanted is not None:
        check_replicable(loaded, wanted, "--replications" if replications else "--seeds")
    out_dir = out if out is not None else Path("results") / f"{loaded.name}-capacity"
    log = CapacityLog(out_dir)
    try:
        with ProgressReport(f"capacity of {loaded.name}", "runs") as progress:
            def trial_done(trial: Any) -> None:
                # Said, then kept: a trial in trials.csv has always been printed (an
                # interrupt between the two keeps one fewer than the lines shown).
                progress.note(trial.line(targets))
                log.add(trial)
                progress.update(len(log.trials))

            result = search(loaded, targets, wanted if wanted is not None
                            else default_replications(loaded), precision=precision,
                            on_trial=trial_done,
                            on_rate=lambda decision: progress.note(decision.line()),
                            band=band_fraction)
    except KeyboardInterrupt:
        raise interrupted(f"{len(log.trials)} trials kept in {out_dir}/trials.csv; no "
                          "capacity.json (the search did not finish): run it again") from None
    log.finish(loaded, targets, precision, result)
    console.print(capacity_table(loaded.name, result))
    if (ends := result.get("band")) is not None:
        low, high = result["with_band_qps"]
        where = " (a GPU the calibration did not measure)" if extrapolated else ""
        console.print(
            f"across the error band +/-{100 * ends['band']:.0f}%{where}: capacity "
            f"{fmt(ends['slow']['capacity_qps'])} req/s with iteration times "
            f"{100 * ends['band']:.0f}% longer, {fmt(ends['fast']['capacity_qps'])} req/s "
            f"{100 * ends['band']:.0f}% shorter; the interval with the band: "
            f"[{fmt(low)}, {'unbounded' if high is None else fmt(high)}] req/s",
            soft_wrap=True)
    for line in calibration_lines([loaded]):
        console.print(line)
    console.print(f"results: {out_dir}/", soft_wrap=True)  # lines for 80 columns, as compare's
    console.print("  trials.csv, capacity.json", soft_wrap=True)
    console.print(f"  draw them: servesim plot {out_dir}", soft_wrap=True)


def _band(given: str, scenario: Any) -> tuple[float, bool]:
    """`--band` as a fraction, and whether the scenario's GPU is one no calibration measured."""
    from sim.config.errors import COMMAND_LINE, InputError
    from sim.studies.capacity import latency_band

    fraction, extrapolated = latency_band(scenario)
    if given == "auto":
        return fraction, extrapolated
    if given == "none":
        return 0.0, extrapolated
    try:
        value = float(given)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise InputError(COMMAND_LINE, "--band", given, "auto, none, or a fraction in [0, 1)")
    return value, extrapolated


def capacity_table(name: str, result: dict[str, Any]) -> Table:
    """Each probed rate: its runs, decision and why; the interval in the caption."""
    from sim.results.labels import label, unit

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
