"""`simulate` (one scenario, its latency table) and `list` (the registered names)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from sim.cli.common import app, console, fmt, pct


@app.command()
def simulate(
    scenario: Annotated[Path | None, typer.Argument(
        help="scenario YAML; omit to run the embedded default scenario")] = None,
    out: Annotated[Path | None, typer.Option(
        help="directory for the result files [default: results/<scenario name>]")] = None,
    seed: Annotated[int | None, typer.Option(min=0, help="override the scenario's seed")] = None,
) -> None:
    """Run one scenario; print its latency table; write results next to the resolved scenario."""
    from sim.config import load_scenario
    from sim.outdir import is_run_dir
    from sim.progress import ProgressReport
    from sim.runner import run_scenario

    loaded = load_scenario(scenario)
    out_dir = out if out is not None else Path("results") / loaded.name
    try:
        with ProgressReport(f"simulating {loaded.name}", "arrivals") as progress:
            results = run_scenario(loaded, seed=seed, out_dir=out_dir,
                                   on_progress=lambda done, total: progress.update(done, total))
    except KeyboardInterrupt:
        kept = "the previous run's files are" if is_run_dir(out_dir) else "nothing was"
        console.print(f"interrupted: {kept} kept in {out_dir}/ (results are written whole "
                      "or not at all)")
        raise typer.Exit(130) from None
    console.print(summary_table(results.summary))
    if len(results.summary["replicas"]) > 1:
        console.print(replica_table(results.summary))
    console.print(overload_line(results.summary["overload"]))
    console.print(f"results: {out_dir}/ (requests.parquet, iterations.parquet, summary.json, "
                  "scenario.yaml)")


def overload_line(verdict: dict[str, Any]) -> str:
    """The run's overload verdict, loud when it is overloaded."""
    if verdict["verdict"] == "overloaded":
        return (f"[bold red]OVERLOADED[/]: {verdict['detail']}; latencies grow with the "
                "trace's length and do not describe a steady state")
    return f"{verdict['verdict']}: {verdict['detail']}"


@app.command("list")
def list_registered() -> None:
    """List the schedulers, latency models, workload formats, routers, models and GPUs."""
    # From the packages that fill them, not sim.config: no scenario model is built to list names.
    from sim.gpus import GPUS
    from sim.latency import LATENCY_MODELS
    from sim.models import MODELS
    from sim.routers import ROUTERS
    from sim.schedulers import SCHEDULERS
    from sim.workloads import FORMATS

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
        table.add_row(label, *(fmt(dist[k], scale) for k in ("p50", "p90", "p99", "max", "mean")))
    req, thr = summary["requests"], summary["throughput"]
    table.add_section()
    table.add_row("requests", str(req["total"]), "finished", str(req["finished"]), "", "")
    table.add_row("", "", "rejected", str(req["rejected"]), "", "")
    table.add_row("", "", "unfinished", str(req["unfinished"]), "", "")
    table.add_row("throughput", fmt(thr["requests_per_s"]), "req/s",
                  fmt(thr["output_tokens_per_s"]), "tok/s", "")
    for name, value in summary["slo"].items():
        table.add_row(f"SLO {name.removesuffix('_attainment')}", fmt(value), "met", "", "", "")
    return table


def replica_table(summary: dict[str, Any]) -> Table:
    """Per replica: pool, iterations, busy fraction, queue and KV use; then transfers."""
    table = Table(title="replicas")
    for col in ("id", "pool", "iterations", "busy", "mean queue", "max queue", "mean KV",
                "max KV"):
        table.add_column(col, justify="right", no_wrap=col in ("pool", "iterations"))
    for r in summary["replicas"]:
        table.add_row(str(r["replica_id"]), str(r["pool"]), f"{r['num_iterations']:,}",
                      pct(r["busy_fraction"]), fmt(r["mean_queue_length"]),
                      str(r["max_queue_length"]), pct(r["mean_kv_utilization"]),
                      pct(r["max_kv_utilization"]))
    transfer = summary.get("transfer")
    if transfer:
        wait, move = transfer["decode_wait_s"], transfer["transfer_s"]
        table.caption = (f"KV transfer P50/P99: {fmt(move['p50'], 1e3)}/{fmt(move['p99'], 1e3)}"
                         f" ms; waiting for decode KV P50/P99: {fmt(wait['p50'], 1e3)}/"
                         f"{fmt(wait['p99'], 1e3)} ms")
    return table
