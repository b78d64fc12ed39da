"""The `servesim` command line."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from sim.config import load_scenario
from sim.errors import InputError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Simulate LLM serving: TTFT and inter-token latency, before GPU hours.")
console = Console()


@app.command()
def simulate(
    scenario: Annotated[Path | None, typer.Argument(
        help="scenario YAML; omit to run the embedded default scenario")] = None,
    out: Annotated[Path | None, typer.Option(
        help="directory for the result files [default: results/<scenario name>]")] = None,
    seed: Annotated[int | None, typer.Option(help="override the scenario's seed")] = None,
) -> None:
    """Run one scenario; print its latency table; write results next to the resolved scenario."""
    from sim.runner import run_scenario

    loaded = load_scenario(scenario)
    out_dir = out if out is not None else Path("results") / loaded.name
    with _progress() as progress:
        task = progress.add_task(f"simulating {loaded.name}", total=None)

        def advance(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        results = run_scenario(loaded, seed=seed, out_dir=out_dir, on_progress=advance)
    console.print(summary_table(results.summary))
    if len(results.summary["replicas"]) > 1:
        console.print(replica_table(results.summary))
    console.print(f"results: {out_dir}/ (requests.parquet, iterations.parquet, summary.json, "
                  "scenario.yaml)")


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
    with console.status(f"running {len(scenarios)} variants"):
        table, _ = run_all(scenarios, out_dir)
    Console(width=max(console.width, 150)).print(comparison_table(name, table))
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
            if scale is None:
                cells.append(str(value))
            else:
                cells.append("-" if value is None or value != value else _fmt(value, scale))
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
    with _progress("runs") as progress:
        task = progress.add_task(f"sweep {name}", total=len(runs))
        table = run_sweep(runs, out_dir, workers=workers or os.cpu_count() or 1,
                          backend=backend, address=address,
                          on_progress=lambda done, total: progress.update(
                              task, completed=done, total=total))
    shown = [c for c in table.columns if c not in ("key",)][:12]
    wide = Console(width=max(console.width, 150))
    wide.print(table[shown].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
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
    with console.status("searching"):
        result = search(loaded, targets, list(range(seeds)), precision=precision)
    table = Table(title=f"capacity of {loaded.name} ({result['knob']})")
    for col in ("seed", "capacity (req/s)", "runs", "first violation above it"):
        table.add_column(col, justify="right")
    for c in result["per_seed"]:
        failing = sorted((t for t in c.trials if not t.ok), key=lambda t: t.rate)
        table.add_row(str(c.seed), _fmt(c.capacity_qps), str(len(c.trials)),
                      "; ".join(failing[0].violations) if failing else "-")
    low, high = result["ci95_qps"]
    table.caption = (f"capacity {_fmt(result['capacity_qps'])} req/s, 95% CI "
                     f"[{_fmt(low)}, {_fmt(high)}]")
    Console(width=max(console.width, 150)).print(table)


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


@app.command()
def profile(
    model: Annotated[str, typer.Option(help="model shape to build (see `servesim list`)")] = "tiny",
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N")] = "cpu",
    out: Annotated[Path, typer.Option(help="profile file (parquet); resumed if it exists")] = Path(
        "profiles/profile.parquet"),
    reps: Annotated[int, typer.Option(min=1, help="timed repetitions per mix")] = 5,
    warmup: Annotated[int, typer.Option(min=0, help="untimed runs per mix first")] = 2,
    holdout: Annotated[int, typer.Option(min=0, help="random held-out mixes to measure")] = 200,
    seed: Annotated[int, typer.Option(help="seed of the grid, mixes and weights")] = 0,
    threads: Annotated[int | None, typer.Option(help="CPU threads for torch (default 1)")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="most tokens per iteration")] = None,
    max_context: Annotated[int | None, typer.Option(help="longest context")] = None,
    max_batch: Annotated[int | None, typer.Option(help="most decodes per iteration")] = None,
    check: Annotated[Path | None, typer.Option(
        help="instead of profiling: measure fresh random mixes against this fitted file")] = None,
    num: Annotated[int, typer.Option(help="mixes for --check")] = 200,
    attention: Annotated[str | None, typer.Option(
        help="sdpa (portable) or varlen (paged FlashAttention, CUDA) [default: best here]")
    ] = None,
    plot: Annotated[Path | None, typer.Option(help="scatter plot for --check (png/svg)")] = None,
) -> None:
    """Measure real iterations of a model on a device (needs torch), or --check a fitted model."""
    from profiler import commands

    if check is not None:
        commands.run_check(check, device, num, seed, threads, plot)
        return
    commands.run_profile(model, device, out, reps=reps, warmup=warmup, holdout=holdout,
                         seed=seed, threads=threads, max_tokens=max_tokens,
                         max_context=max_context, max_batch=max_batch, attention=attention)


@app.command()
def fit(
    profile_path: Annotated[Path, typer.Argument(metavar="PROFILE", help="profile parquet")],
    out: Annotated[Path | None, typer.Option(help="fitted latency file [default: PROFILE.json]")
                   ] = None,
) -> None:
    """Fit the profile latency model; print its error on held-out mixes; write its file."""
    from profiler import commands

    commands.run_fit(profile_path, out)


@app.command("list")
def list_registered() -> None:
    """List the schedulers, latency models, workload formats, routers, models and GPUs."""
    from sim.config import FORMATS, GPUS, LATENCY_MODELS, MODELS, ROUTERS, SCHEDULERS

    table = Table(title="registered names")
    table.add_column("kind")
    table.add_column("names")
    for registry in (SCHEDULERS, LATENCY_MODELS, FORMATS, ROUTERS, MODELS, GPUS):
        table.add_row(registry.kind, ", ".join(registry.names()))
    console.print(table)


LATENCY_ROWS = (  # summary key, label, scale to the unit in the label
    ("ttft_s", "TTFT ms", 1e3),
    ("tbt_s", "TBT ms (all gaps)", 1e3),
    ("max_tbt_per_request_s", "worst TBT/req ms", 1e3),
    ("tpot_s", "TPOT ms", 1e3),
    ("e2e_s", "E2E s", 1.0),
    ("scheduling_delay_s", "sched. delay ms", 1e3),
)


def summary_table(summary: dict[str, Any]) -> Table:
    """Latency percentiles, then outcomes, throughput and SLO attainment."""
    run = summary["run"]
    table = Table(title=f"{run['scenario']}: {run['model']} on {run['gpu']}, {run['scheduler']}, "
                        f"{run['latency']} latency, seed {run['seed']}")
    table.add_column("metric", no_wrap=True)
    for col in ("P50", "P90", "P99", "max", "mean"):
        table.add_column(col, justify="right", no_wrap=True)
    for key, label, scale in LATENCY_ROWS:
        dist = summary[key]
        table.add_row(label, *(_fmt(dist[k], scale) for k in ("p50", "p90", "p99", "max", "mean")))
    req, thr = summary["requests"], summary["throughput"]
    table.add_section()
    table.add_row("requests", str(req["total"]), "finished", str(req["finished"]), "", "")
    table.add_row("", "", "rejected", str(req["rejected"]), "", "")
    table.add_row("", "", "unfinished", str(req["unfinished"]), "", "")
    table.add_row("throughput", _fmt(thr["requests_per_s"]), "req/s",
                  _fmt(thr["output_tokens_per_s"]), "tok/s", "")
    for name, value in summary["slo"].items():
        table.add_row(f"SLO {name.removesuffix('_attainment')}", _fmt(value), "met", "", "", "")
    return table


def replica_table(summary: dict[str, Any]) -> Table:
    """Per replica: pool, iterations, busy fraction, queue and KV use; then transfers."""
    table = Table(title="replicas")
    for col in ("replica", "pool", "iterations", "busy", "mean queue", "max queue", "mean KV",
                "max KV"):
        table.add_column(col, justify="right")
    for r in summary["replicas"]:
        table.add_row(str(r["replica_id"]), str(r["pool"]), str(r["num_iterations"]),
                      _pct(r["busy_fraction"]), _fmt(r["mean_queue_length"]),
                      str(r["max_queue_length"]), _pct(r["mean_kv_utilization"]),
                      _pct(r["max_kv_utilization"]))
    transfer = summary.get("transfer")
    if transfer:
        wait, move = transfer["decode_wait_s"], transfer["transfer_s"]
        table.caption = (f"KV transfer P50/P99: {_fmt(move['p50'], 1e3)}/{_fmt(move['p99'], 1e3)}"
                         f" ms; waiting for decode KV P50/P99: {_fmt(wait['p50'], 1e3)}/"
                         f"{_fmt(wait['p99'], 1e3)} ms")
    return table


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _fmt(value: float | None, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    return f"{value * scale:,.4g}"


def _progress(unit: str = "arrivals") -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}"
                    f"/{{task.total}} {unit}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    console=console, transient=True)


def main() -> None:
    """Entry point: input errors become one line on stderr and exit code 2."""
    try:
        app(standalone_mode=False)
    except InputError as exc:
        print(f"error: {exc.one_line()}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    except Exception as exc:  # click usage errors carry their own exit code
        code = getattr(exc, "exit_code", None)
        if code is None:
            raise
        show = getattr(exc, "show", None)
        if show is not None:
            show()
        sys.exit(code)
