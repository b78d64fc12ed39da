"""Commands that run many simulations: `compare`, `sweep`, `capacity`, and `plot` of results."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from sim.cli.common import app, console, fmt, wide_console
from sim.config import load_scenario
from sim.errors import InputError
from sim.progress import ProgressReport


@app.command()
def compare(
    comparison: Annotated[Path, typer.Argument(help="comparison YAML: base + variants")],
    out: Annotated[Path | None, typer.Option(
        help="directory for each variant's results [default: results/<name>]")] = None,
) -> None:
    """Run every variant of a comparison file on the same trace; print one table."""
    from sim.compare import compare as run_all
    from sim.compare import load_comparison

    scenarios = load_comparison(comparison)
    name = next(iter(scenarios.values())).name.split("/")[0]
    out_dir = out if out is not None else Path("results") / name
    with ProgressReport(f"compare {name}", "variants", total=len(scenarios)):
        table, _ = run_all(scenarios, out_dir)
    wide_console().print(comparison_table(name, table))
    console.print(f"results: {out_dir}/<variant>/ and {out_dir}/comparison.csv")


def comparison_table(title: str, df: Any) -> Table:
    table = Table(title=title)
    columns = (("variant", None), ("pools", None), ("scheduler", None),
               ("finished", None), ("ttft_p50_s", 1e3), ("ttft_p99_s", 1e3),
               ("tbt_p50_s", 1e3), ("tbt_p99_s", 1e3), ("e2e_p99_s", 1.0),
               ("output_tokens_per_s", 1.0), ("slo_attainment", 1.0), ("transfer_p99_s", 1e3))
    labels = {"ttft_p50_s": "TTFT P50 ms", "ttft_p99_s": "TTFT P99 ms", "tbt_p50_s": "TBT P50 ms",
              "tbt_p99_s": "TBT P99 ms", "e2e_p99_s": "E2E P99 s", "output_tokens_per_s": "tok/s",
              "slo_attainment": "SLO met", "transfer_p99_s": "xfer P99 ms"}
    for key, scale in columns:
        table.add_column(labels.get(key, key), justify="left" if scale is None else "right")
    for _, r in df.iterrows():
        cells = []
        for key, scale in columns:
            value = r[key]
            cells.append(str(value) if scale is None else fmt(value, scale))
        table.add_row(*cells)
    return table


@app.command()
def sweep(
    sweep_file: Annotated[Path, typer.Argument(metavar="SWEEP", help="sweep YAML")],
    out: Annotated[Path | None, typer.Option(
        help="sweep directory [default: results/<name>]")] = None,
    workers: Annotated[int | None, typer.Option(
        min=1, help="local worker processes [default: one per CPU]")] = None,
    backend: Annotated[str, typer.Option(help="local or ray")] = "local",
    address: Annotated[str | None, typer.Option(help="Ray cluster address")] = None,
) -> None:
    """Run every point of a sweep (cached: only new or changed points run); one table."""
    from sim.sweep import load_sweep, run_sweep

    if backend not in ("local", "ray"):
        raise InputError(None, "--backend", backend, "must be local or ray")
    name, runs = load_sweep(sweep_file)
    out_dir = out if out is not None else Path("results") / name
    with ProgressReport(f"sweep {name}", "runs", total=len(runs)) as progress:
        table = run_sweep(runs, out_dir, workers=workers or os.cpu_count() or 1,
                          backend=backend, address=address,
                          on_progress=lambda done, total: progress.update(done, total))
    shown = [c for c in table.columns if c not in ("key",)][:12]
    wide_console().print(table[shown].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    console.print(f"results: {out_dir}/results.parquet, results.csv, runs/<key>/")


@app.command()
def capacity(
    scenario: Annotated[Path | None, typer.Argument(help="scenario YAML [default: embedded]")
                        ] = None,
    tbt_p99: Annotated[float | None, typer.Option(help="SLO: P99 TBT, seconds")] = None,
    ttft_p90: Annotated[float | None, typer.Option(help="SLO: P90 TTFT, seconds")] = None,
    sched_delay_p50: Annotated[float | None, typer.Option(
        help="SLO: P50 scheduling delay, seconds")] = None,
    seeds: Annotated[int, typer.Option(min=1, help="replications (seeds 0..N-1)")] = 1,
    precision: Annotated[float, typer.Option(help="relative precision of the bisection")] = 0.02,
) -> None:
    """Largest arrival rate at which every given SLO holds (expand, then bisect)."""
    from sim.capacity import SLOTargets
    from sim.capacity import capacity as search

    targets = SLOTargets(tbt_p99, ttft_p90, sched_delay_p50)
    if targets == SLOTargets():
        raise InputError(None, "--tbt-p99/--ttft-p90/--sched-delay-p50", None, "give an SLO")
    loaded = load_scenario(scenario)
    with ProgressReport(f"capacity of {loaded.name}", "trials"):
        result = search(loaded, targets, list(range(seeds)), precision=precision)
    table = Table(title=f"capacity of {loaded.name} ({result['knob']})")
    for col in ("seed", "capacity (req/s)", "runs", "first violation above it"):
        table.add_column(col, justify="right")
    for c in result["per_seed"]:
        failing = sorted((t for t in c.trials if not t.ok), key=lambda t: t.rate)
        table.add_row(str(c.seed), fmt(c.capacity_qps), str(len(c.trials)),
                      "; ".join(failing[0].violations) if failing else "-")
    low, high = result["ci95_qps"]
    table.caption = (f"capacity {fmt(result['capacity_qps'])} req/s, 95% CI "
                     f"[{fmt(low)}, {fmt(high)}]")
    wide_console().print(table)


@app.command()
def plot(
    results: Annotated[Path, typer.Argument(help="a run's or a sweep's results directory")],
    out: Annotated[Path | None, typer.Option(help="figure directory [default: RESULTS/plots]")
                   ] = None,
) -> None:
    """Draw the figures the result files support (PNG and SVG)."""
    from sim import plots

    if (results / "results.parquet").is_file():
        files = plots.plot_sweep(results, out)
    elif (results / "requests.parquet").is_file():
        files = plots.plot_run(results, out)
    else:
        raise InputError(results, "RESULTS", str(results), "no results.parquet or "
                         "requests.parquet here")
    for f in files:
        console.print(str(f))
