"""Commands that run many simulations: `compare`, `sweep`, `capacity`, and `plot` of results.

Each says what it kept when interrupted (Ctrl-C) and exits 130; finished runs stay on disk
whole, and no table is written from a partial set of runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from sim.cli.common import app, console, fmt, pct


def interrupted(kept: str) -> typer.Exit:
    """Say what an interrupted command kept; the exit to raise (130, as after SIGINT)."""
    print(f"interrupted: {kept}", file=sys.stderr, flush=True)
    return typer.Exit(130)


@app.command()
def compare(
    comparison: Annotated[Path, typer.Argument(help="comparison YAML: base + variants")],
    out: Annotated[Path | None, typer.Option(
        help="directory for each variant's results [default: results/<name>]")] = None,
) -> None:
    """Run every variant of a comparison file on the same trace; print one table."""
    from sim.compare import compare as run_all
    from sim.compare import load_comparison
    from sim.progress import ProgressReport

    scenarios = load_comparison(comparison)
    name = next(iter(scenarios.values())).name.split("/")[0]
    out_dir = out if out is not None else Path("results") / name
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
    console.print(comparison_table(name, table))
    console.print(f"results: {out_dir}/<variant>/ and {out_dir}/comparison.csv",
                  soft_wrap=True)


def comparison_table(title: str, df: Any) -> Table:
    """One column per variant, one row per number: a few variants fit 80 columns."""
    rows = (("pools", None), ("scheduler", None), ("overload", None), ("finished", None),
            ("ttft_p50_s", 1e3), ("ttft_p99_s", 1e3), ("tbt_p50_s", 1e3), ("tbt_p99_s", 1e3),
            ("e2e_p99_s", 1.0), ("output_tokens_per_s", 1.0), ("slo_attainment", 1.0),
            ("transfer_p99_s", 1e3), ("num_gpus", None), ("usd_per_million_tokens", 1.0))
    table = Table(title=title)
    table.add_column("variant")
    for variant in df["variant"]:
        table.add_column(str(variant), justify="right", overflow="fold")
    for key, scale in rows:
        cells = [str(v) if scale is None else pct(v) if key == "slo_attainment"
                 else fmt(v, scale) for v in df[key]]
        if key == "overload":
            cells = [f"[red]{c}[/]" if c == "overloaded" else c for c in cells]
        table.add_row(LABELS.get(key, key), *cells)
    return table


LABELS = {"ttft_p50_s": "TTFT P50 ms", "ttft_p99_s": "TTFT P99 ms", "tbt_p50_s": "TBT P50 ms",
          "tbt_p99_s": "TBT P99 ms", "e2e_p99_s": "E2E P99 s", "output_tokens_per_s": "tok/s",
          "slo_attainment": "SLO met", "transfer_p99_s": "xfer P99 ms", "num_gpus": "GPUs",
          "usd_per_million_tokens": "$/M tokens"}


@app.command()
def sweep(
    sweep_file: Annotated[Path, typer.Argument(metavar="SWEEP", help="sweep YAML")],
    out: Annotated[Path | None, typer.Option(
        help="sweep directory [default: results/<name>]")] = None,
    workers: Annotated[int | None, typer.Option(
        min=1, help="worker processes, or Ray tasks at once [default: one per CPU; on Ray, "
                    "the cluster's CPUs]")] = None,
    backend: Annotated[str, typer.Option(metavar="local|ray", help="where runs execute")
                       ] = "local",
    address: Annotated[str | None, typer.Option(help="Ray cluster address")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="re-run every point, even those already done")] = False,
) -> None:
    """Run every point of a sweep (cached: only new or changed points run); one table."""
    from sim.errors import InputError
    from sim.progress import ProgressReport
    from sim.sweep import check_sweep_dir, load_sweep, run_sweep, runs_kept

    if backend not in ("local", "ray"):
        raise InputError(None, "--backend", backend, "must be local or ray")
    name, runs = load_sweep(sweep_file)
    out_dir = out if out is not None else Path("results") / name
    check_sweep_dir(out_dir)
    try:
        with ProgressReport(f"sweep {name}", "runs", total=len(runs)) as progress:
            if backend == "local" and workers is None:
                workers = os.cpu_count() or 1
            table = run_sweep(runs, out_dir, workers=workers,
                              backend=backend, address=address, force=force,
                              on_progress=lambda done, total: progress.update(done, total))
    except KeyboardInterrupt:
        raise interrupted(f"{runs_kept(runs, out_dir)} of {len(runs)} runs complete and kept "
                          f"in {out_dir}/runs/; run the sweep again to finish it") from None
    console.print(sweep_table(name, table))
    over = int((table["overload"] == "overloaded").sum())
    if over:
        console.print(f"{over} of {len(table)} runs overloaded: a queue grew and did not drain, "
                      "their latencies depend on the trace's length")
    console.print(f"results: {out_dir}/results.parquet, results.csv, runs/<key>/",
                  soft_wrap=True)


def sweep_table(title: str, df: Any) -> Table:
    """The varied fields (mappings shown by their values), then the headline numbers."""
    from sim.sweep import METRICS, short_value

    varied = [c for c in df.columns if c not in {"seed", "key", *METRICS}]
    seeds = df["seed"].nunique() > 1
    metrics = (("ttft_p99_s", "TTFT\nP99 s", 1.0), ("tbt_p99_s", "TBT\nP99 ms", 1e3),
               ("output_tokens_per_s", "tok/s", 1.0))
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True)
    for column in varied:  # as wide as their values, up to a point
        width = min(24, max(len(short_value(v)) for v in df[column]))
        table.add_column(column.rsplit(".", 1)[-1], overflow="fold", min_width=width)
    if seeds:
        table.add_column("seed", justify="right")
    for _, label, _ in metrics:
        table.add_column(label, justify="right", no_wrap=True)
    table.add_column("SLO\nmet", justify="right", no_wrap=True)
    table.add_column("overload", min_width=10)
    for _, r in df.iterrows():
        cells = [short_value(r[c]) for c in varied] + ([str(r["seed"])] if seeds else [])
        cells += [fmt(r[key], scale) for key, _, scale in metrics]
        cells.append(pct(r["slo_attainment"]))
        table.add_row(*cells, "[red]overloaded[/]" if r["overload"] == "overloaded"
                      else str(r["overload"]))
    return table


@app.command()
def capacity(
    scenario: Annotated[Path | None, typer.Argument(help="scenario YAML [default: embedded]")
                        ] = None,
    tbt_p99: Annotated[float | None, typer.Option(help="SLO: P99 TBT, seconds")] = None,
    ttft_p90: Annotated[float | None, typer.Option(help="SLO: P90 TTFT, seconds")] = None,
    sched_delay_p50: Annotated[float | None, typer.Option(
        help="SLO: P50 scheduling delay, seconds")] = None,
    seeds: Annotated[int, typer.Option(min=1, help="replications (seeds 0..N-1)")] = 1,
    precision: Annotated[float, typer.Option(
        help="relative precision of the bisection, in (0, 1)")] = 0.02,
    out: Annotated[Path | None, typer.Option(
        help="directory for trials.csv and capacity.json "
             "[default: results/<scenario name>-capacity]")] = None,
) -> None:
    """Largest arrival rate at which every given SLO holds (expand, then bisect)."""
    from sim.capacity import CapacityLog, SLOTargets, check_options
    from sim.capacity import capacity as search
    from sim.config import load_scenario
    from sim.progress import ProgressReport

    targets = SLOTargets(tbt_p99, ttft_p90, sched_delay_p50)
    check_options(targets, precision)
    loaded = load_scenario(scenario)
    out_dir = out if out is not None else Path("results") / f"{loaded.name}-capacity"
    log = CapacityLog(out_dir)
    try:
        with ProgressReport(f"capacity of {loaded.name}", "trials") as progress:
            def trial_done(trial: Any) -> None:
                log.add(trial)
                progress.update(len(log.trials))
                progress.note(trial.line(targets))

            result = search(loaded, targets, list(range(seeds)), precision=precision,
                            on_trial=trial_done)
    except KeyboardInterrupt:
        raise interrupted(f"{len(log.trials)} trials kept in {out_dir}/trials.csv; no "
                          "capacity.json (the search did not finish): run it again") from None
    log.finish(loaded, targets, precision, result)
    console.print(capacity_table(loaded.name, result))
    console.print(f"results: {out_dir}/trials.csv, capacity.json (servesim plot {out_dir})",
                  soft_wrap=True)


def capacity_table(name: str, result: dict[str, Any]) -> Table:
    table = Table(title=f"capacity of {name} ({result['knob']})")
    for col in ("seed", "capacity (req/s)", "runs"):
        table.add_column(col, justify="right")
    table.add_column("first violation above it")
    for c in result["per_seed"]:
        failing = sorted((t for t in c.trials if not t.ok), key=lambda t: t.rate)
        shown = [v.split(":")[0] for v in failing[0].violations] if failing else ["-"]
        table.add_row(str(c.seed), fmt(c.capacity_qps), str(len(c.trials)), "; ".join(shown))
    low, high = result["ci95_qps"]
    table.caption = (f"capacity {fmt(result['capacity_qps'])} req/s, 95% CI "
                     f"[{fmt(low)}, {fmt(high)}]; {fmt(result['capacity_qps_per_gpu'])} req/s "
                     f"per GPU ({result['num_gpus']} GPUs)")
    if result.get("usd_per_million_tokens") is not None:
        table.caption += (f"; ${fmt(result['usd_per_million_tokens'])} per million tokens "
                          f"(${fmt(result['usd_per_million_output_tokens'])} per million "
                          "output tokens) at capacity")
    return table


@app.command()
def plot(
    results: Annotated[list[Path], typer.Argument(
        help="a run's, a sweep's, a comparison's or capacity searches' result directory")],
    out: Annotated[Path | None, typer.Option(help="figure directory [default: RESULTS/plots]")
                   ] = None,
) -> None:
    """Draw the figures a result directory's own files support (PNG and SVG)."""
    from sim.plots import plot_results

    for f in plot_results(results, out):
        console.print(str(f), soft_wrap=True, highlight=False)  # paths whole, to copy
