"""`servesim plan`: size a fleet (`sim.studies.plan`); a table of the kinds searched, the
answer with its error-band check, and the files (`candidates.csv`, `plan.json`, `plan.png`)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from sim.cli.common import app, calibration_lines, console, interrupted, refuse_unused
from sim.cli.study import Backend


@app.command()
def plan(
    ctx: typer.Context,
    plan_file: Annotated[Path, typer.Argument(metavar="PLAN", help="plan YAML")],
    out: Annotated[Path | None, typer.Option(
        help="plan directory (runs cached there)", show_default="results/<name>")] = None,
    workers: Annotated[int | None, typer.Option(
        min=1, help="worker processes searching kinds at once, or Ray tasks",
        show_default="one per CPU; on Ray, the cluster's CPUs")] = None,
    backend: Annotated[Backend, typer.Option(
        help="where kinds are searched (Ray: the plan directory must be shared by the "
             "cluster's nodes)")] = Backend.local,
    address: Annotated[str | None, typer.Option(help="Ray cluster address")] = None,
) -> None:
    """Find the cheapest deployment (GPUs, parallelism, replicas, prefill:decode, scheduler)
    that holds a target load within SLOs, and whether it holds across the model's error band."""
    from sim.config.scenario import results_name
    from sim.config.yaml_input import read_yaml
    from sim.studies.plan import KindResult, Searcher
    from sim.studies.plan_answer import answer, write_outputs
    from sim.studies.plan_file import Plan
    from sim.studies.plan_run import run_plan

    if backend is Backend.local:
        refuse_unused(ctx, {"address": "only with --backend ray"})
        workers = workers or os.cpu_count() or 1
    loaded = Plan(plan_file)
    out_dir = out or Path("results") / results_name(plan_file, read_yaml(plan_file))
    check_plan_dir(out_dir)
    start = time.perf_counter()

    def on_kind(result: KindResult) -> None:
        ev = result.best()
        if result.refused is not None:
            line = f"[dim]refused: {result.refused}[/]"
        elif loaded.config.objective == "load_per_dollar":
            what = f"one {'unit' if result.kind.ratio else 'replica'}"
            lowest = min((e.load_qps for e in result.evaluations if e.load_qps), default=0.0)
            line = (f"{what} holds {result.capacity_qps:.4g} req/s" if result.capacity_qps else
                    f"[red]{what} fails[/] even at {lowest:.4g} req/s, the lowest load tried")
            line += f" ({len(result.evaluations)} runs)"
        elif ev is None:
            line = ("[red]no deployment holds[/] up to search.max_replicas or 1.5x the best "
                    f"cost found so far ({len(result.evaluations)} runs)")
        else:
            line = (f"[green]{ev.replicas} replica{'s' if ev.replicas != 1 else ''}, "
                    f"{ev.num_gpus} GPUs hold[/], {_usd(ev.usd_per_hour)}/h "
                    f"({len(result.evaluations)} runs, {result.seconds:.1f} s)")
        console.print(f"{result.kind.label()}: {line}", soft_wrap=True)

    try:
        results = run_plan(loaded, out_dir, workers=workers, backend=backend.value,
                           address=address, on_kind=on_kind)
        found = answer(loaded, Searcher(loaded, out_dir), results)
        seconds = time.perf_counter() - start
        write_outputs(loaded, out_dir, results, found, seconds)
        from sim.plots.plan import plan_figure

        drawn = plan_figure(out_dir)
    except KeyboardInterrupt:
        raise interrupted(f"the runs finished are cached in {out_dir}/runs/; run the plan "
                          "again to go on") from None
    if loaded.config.objective != "load_per_dollar":
        console.print(kinds_table(results))
    for line in answer_lines(loaded, found):
        console.print(line, soft_wrap=True)
    for line in calibration_lines([loaded.base]):
        console.print(line, soft_wrap=True)
    runs = [ev for r in results for ev in r.evaluations]
    candidates = sum(loaded.config.search.max_replicas // r.kind.replicas(1) for r in results)
    refused = sum(r.refused is not None for r in results)
    num_kinds = f"{len(results)} kind{'s' if len(results) != 1 else ''}"
    space = (num_kinds if loaded.config.objective == "load_per_dollar"
             else f"{candidates:,} candidate deployments ({len(results)} kinds x sizes)")
    console.print(f"{space}; "
                  f"{refused} kind{'s' if refused != 1 else ''} refused unsimulated; "
                  f"{len(runs)} runs ({sum(ev.cached for ev in runs)} cached) in "
                  f"{time.perf_counter() - start:.1f} s; results: {out_dir}/ (candidates.csv, "
                  f"plan.json{', plan.png' if drawn else ''})", soft_wrap=True)


def check_plan_dir(out: Path) -> None:
    """`out` can hold a plan: empty, new, or a plan's (its runs are reused); marked as one
    before any run, so that an interrupted plan's directory is known for what it is."""
    import json

    from sim.config.errors import InputError
    from sim.results.outdir import check_writable_dir, replace_text
    from sim.results.read import PLAN_MARKER

    check_writable_dir(out, "--out")
    if out.is_dir() and any(out.iterdir()) and not (out / PLAN_MARKER).is_file():
        raise InputError(out, "--out", str(out), f"is not a plan's directory (no {PLAN_MARKER}) "
                         "and not empty; refusing to write a plan there: choose another")
    replace_text(out / PLAN_MARKER, json.dumps({"kind": "servesim plan"}) + "\n")


def _cost(value: float) -> str:
    """A cost bound as the table shows it (USD, or GPUs for `objective: gpus`)."""
    return f"${value:,.0f}/h" if value >= 100 else f"${value:,.2f}/h"


def _usd(value: float | None) -> str:
    return "-" if value is None or math.isinf(value) else f"${value:,.2f}"


def kinds_table(results: list[Any]) -> Table:
    """Per kind searched: the smallest deployment that holds, its GPUs and cost (80 columns)."""
    table = Table("kind", "replicas", "GPUs", "$/h", "runs", box=box.SIMPLE_HEAD,
                  title="deployments searched, cheapest kind first")
    for result in results:
        ev = result.best()
        if result.refused is not None:
            table.add_row(result.kind.label(), "[dim]refused[/]", "", "", "0")
        elif ev is None and result.beyond is not None:
            table.add_row(result.kind.label(), f"> {_cost(result.beyond)}", "", "",
                          str(len(result.evaluations)))
        elif ev is None:
            table.add_row(result.kind.label(), "[red]none holds[/]", "", "",
                          str(len(result.evaluations)))
        else:
            table.add_row(result.kind.label(), str(ev.replicas), str(ev.num_gpus),
                          _usd(ev.usd_per_hour), str(len(result.evaluations)))
    return table


def answer_lines(plan: Any, found: dict[str, Any]) -> list[str]:
    """The chosen deployment, its SLO margins, the band check and the seeds."""
    from sim.studies.plan_file import slo_label

    chosen = found.get("chosen")
    if chosen is None:
        return [f"[red]no deployment found[/]: {found['why']}"]
    if "capacity_qps" in chosen:  # load_per_dollar
        lines = [f"[bold]most load per dollar[/]: {chosen['kind']} ({chosen['replicas']} "
                 f"replica{'s' if chosen['replicas'] != 1 else ''}, {chosen['num_gpus']} "
                 f"GPU{'s' if chosen['num_gpus'] != 1 else ''}, "
                 f"{_usd(chosen['usd_per_hour'])}/h) holds {chosen['capacity_qps']:.4g} req/s: "
                 f"{chosen['qps_per_usd_hour']:.4g} req/s per USD an hour"]
        for check in found["band_checks"]:
            if not check["band"]:
                continue
            where = " (a GPU the calibration did not measure)" if check["extrapolated"] else ""
            if check["kind"] == chosen["kind"]:
                lines.append(f"error band +/-{100 * check['band']:.0f}%{where}: "
                             f"{check['slow_qps']:.4g} req/s with iteration times "
                             f"{100 * check['band']:.0f}% longer, {check['fast_qps']:.4g} "
                             "shorter")
            else:
                lines.append(f"{check['kind']}, iteration times {100 * check['band']:.0f}% "
                             f"longer{where}: {check['slow_qps']:.4g} req/s "
                             f"({check['slow_qps_per_usd_hour']:.4g} per USD an hour)")
        robust = found.get("robust_choice")
        if robust is not None and robust != chosen["kind"]:
            lines.append(f"[bold]robust choice[/] (the most load per dollar at the band's slow "
                         f"end): {robust}" + (
                             f", of the {len(found['band_checks'])} best kinds searched there"
                             if found.get("robust_unchecked_kinds") else ""))
        seeds = found["seeds"]
        lines.append(f"seeds {seeds['seeds']} at that load: " + (
            "every SLO met in each" if seeds["all_hold"] else "; ".join(seeds["failures"])))
        if not seeds["all_hold"]:
            every = seeds.get("capacity_every_seed_qps")
            per_usd = chosen["qps_per_usd_hour"] / chosen["capacity_qps"]
            lines.append(f"[yellow]at every seed[/]: {every:.4g} req/s ({every * per_usd:.4g} "
                         "req/s per USD an hour)" if every else
                         "[yellow]at every seed[/]: not even half that load holds")
        return lines
    margin = ", ".join(
        f"{slo_label(k)} {_value(k, chosen['values'].get(k))} ({_margin(m)})"
        for k, m in chosen["margins"].items())
    lines = [f"[bold]chosen[/]: {chosen['kind']} x {chosen['replicas']} replicas, "
             f"{chosen['num_gpus']} GPUs, {_usd(chosen['usd_per_hour'])}/h, "
             f"{_usd(chosen['usd_per_million_tokens'])} per million tokens; {margin}"]
    robust = found.get("robust_choice")
    if robust is not None and robust != f"{chosen['kind']} x {chosen['replicas']}":
        lines.append(f"[bold]robust choice[/] (holds at the band's slow end too): {robust}")
    for raised in chosen.get("raised_for_seeds", []):
        lines.append(f"one replica (unit) more than the search found: at {raised}")
    for check in found["band_checks"]:
        band = check["band"]
        if not band:
            continue
        where = " (a GPU the calibration did not measure)" if check["extrapolated"] else ""
        if check["holds_across_band"]:
            verdict = "[green]holds across the band[/]"
        elif check["units_at_slow_end"] is None:
            verdict = ("[yellow]holds only at the nominal or fast end[/]: not even with 3 "
                       "more at the slow end")
        else:
            verdict = (f"[yellow]holds only at the nominal or fast end[/]: "
                       f"{check['units_at_slow_end']} units at the slow end")
        fewer = ("; one fewer holds at the fast end" if check.get("fewer_hold_at_fast_end")
                 else "")
        lines.append(f"error band +/-{100 * band:.0f}%{where}: {check['kind']} x "
                     f"{check['replicas']} {verdict}{fewer}")
    seeds = found["seeds"]
    lines.append(f"seeds {seeds['seeds']}: " + ("every SLO met in each" if seeds["all_hold"]
                                                else "; ".join(seeds["failures"])))
    return lines


def _value(key: str, value: float | None) -> str:
    if value is None:
        return "-"
    if key == "attainment":
        return f"{100 * value:.1f}%"
    return "unbounded" if math.isinf(value) else f"{value * 1e3:,.4g} ms"


def _margin(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.0f}% margin"
