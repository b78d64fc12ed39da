"""`servesim calibrate`: fit an engine calibration to measured serving runs
(`sim.studies.calibrate`), print each stage's error before and after and the leave-one-model-out
errors, and write the calibration file a scenario names as `replica.engine`."""

from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from sim.cli.common import app, console, interrupted

GRID_HELP = ("a roofline field and the values to try, FIELD=V1,V2,... (repeat for more fields; "
             "default: attention_mbu 0.8, 0.85, 0.9 and 0.95 with attention_layer_s 0, 5e-6 "
             "and 1e-5)")


@app.command()
def calibrate(
    measured: Annotated[list[Path], typer.Argument(
        help="measured runs: stage tables (CSV, one row per load stage), engine-run folders "
             "(meta.json + requests.jsonl), inference-perf results folders (config.yaml + "
             "stage_<i>_lifecycle_metrics.json, with --deployment) or vllm bench serve "
             "results (JSON, with --deployment); see docs/fidelity.md")],
    out: Annotated[Path, typer.Option("--out", help="the calibration file to write (YAML)")],
    name: Annotated[str | None, typer.Option(
        help="the calibration's name (default: the file's stem)")] = None,
    grid: Annotated[list[str] | None, typer.Option("--grid", help=GRID_HELP)] = None,
    base: Annotated[str, typer.Option(
        help="the calibration the 'before' errors are of")] = "auto",
    gpu: Annotated[str | None, typer.Option(
        help="the servesim GPU the runs used (default: read from the table's gpu column)")
    ] = None,
    deployment: Annotated[Path | None, typer.Option(
        help="for vllm bench serve results and inference-perf folders: a scenario file of "
             "the server they measured (its workload is replaced by the run's)")] = None,
    jobs: Annotated[int, typer.Option(min=1, max=512, help="simulations at once")] = 2,
) -> None:
    """Fit the engine calibration (roofline fields and front end) that makes servesim agree
    best with measured runs; print every stage's error before and after, and each model's
    error when it is left out of the fit."""
    from sim.config.errors import COMMAND_LINE, InputError
    from sim.results.outdir import check_not_a_result_file, replace_text
    from sim.studies import calibrate as study
    from sim.studies import measured as runs

    points = parse_grid(grid) if grid else study.DEFAULT_GRID
    if out.suffix not in (".yaml", ".yml"):
        raise InputError(COMMAND_LINE, "--out", str(out), "a calibration is a .yaml file")
    check_not_a_result_file(out, out.parent)
    experiments = [exp for path in measured
                   for exp in runs.read_measured(path, gpu, deployment)]
    num_runs = len(experiments) * (1 + math.prod(len(v) for v in points.values()))
    console.print(f"calibrating on {len(experiments)} experiments: {num_runs} simulations, "
                  f"{jobs} at once")
    try:
        fit, before = study.calibrate(experiments, points, base, jobs,
                               lambda i, n: print(f"\r{i}/{n} simulated", end="",
                                                  file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        raise interrupted(f"nothing written ({out} left as it was)") from None
    print(file=sys.stderr)
    stages = [s for exp in experiments for s in exp.stages]
    table = Table(title="error, % (servesim - measured) / measured: before>after",
                  box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    table.add_column("stage", no_wrap=True)
    shown = ("TPOT mean", "TTFT mean", "E2E mean")
    for metric in shown:
        table.add_column(metric, justify="right", no_wrap=True)
    table.add_column("overl.", justify="right", no_wrap=True)

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:+.1f}"

    for k, stage in enumerate(stages):
        real = "?" if stage.overloaded is None else "yes" if stage.overloaded else "no"
        verdict = f"{'yes' if fit.verdicts[k] else 'no'}/{real}"
        table.add_row(stage.name, *(f"{cell(before.errors[k][m])}>{cell(fit.errors[k][m])}"
                                    for m in shown), verdict)
    table.add_section()
    def median(errors: list[dict[str, float | None]], metric: str) -> str:
        value = runs.median_abs(errors, metric)
        return "-" if value is None else f"{value:.1f}"

    table.add_row("median |error|", *(f"{median(before.errors, m)}>{median(fit.errors, m)}"
                                      for m in shown), "")
    wrong = sum(s.overloaded is not None and s.overloaded != v
                for s, v in zip(stages, before.verdicts, strict=True))
    table.caption = (f"overl.: overloaded, fitted/measured (?: not measured); {wrong} wrong "
                     "before")
    table.caption_justify = "left"
    console.print(table)
    if fit.held_out:
        held = Table(title="leave one model out: its median |error|, %", box=box.SIMPLE_HEAD,
                     pad_edge=False)
        held.add_column("model left out", no_wrap=True)
        names = [n for n, *_ in runs.METRICS]
        for metric in names:
            held.add_column(metric, justify="right")
        for model, errs in fit.held_out.items():
            held.add_row(model, *(f"{errs[m]:.1f}" if m in errs else "-" for m in names))
        console.print(held)
    fitted = ", ".join(f"{k} {v:g}" for k, v in fit.latency.items())
    console.print(f"fitted: {fitted}; front end {fit.frontend_s * 1e3:.3g} ms + "
                  f"{fit.frontend_per_extra_gpu_s * 1e3:.3g} ms per GPU beyond the first")
    console.print(study.error_summary(stages, fit))
    command = "servesim calibrate " + shlex.join(sys.argv[2:])
    replace_text(out, study.calibration_yaml(name or out.stem, experiments, measured, points, fit,
                                       command))
    console.print(f"written: {out} (use it as replica.engine: {out})")


def parse_grid(items: list[str]) -> dict[str, list[float]]:
    """`--grid FIELD=V1,V2` options as a mapping; one-line errors for anything else."""
    from sim.config.errors import COMMAND_LINE, InputError
    from sim.latency import LATENCY_MODELS

    fields = LATENCY_MODELS.get("roofline").Config.model_fields
    out: dict[str, list[float]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or key not in fields:
            raise InputError(COMMAND_LINE, "--grid", item,
                             "give FIELD=V1,V2,... with FIELD a roofline field")
        try:
            out[key] = [float(v) for v in values.split(",")]
        except ValueError:
            raise InputError(COMMAND_LINE, "--grid", item, "values must be numbers") from None
    return out

