"""`servesim export`: a run's results in other tools' formats."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from sim.cli.common import app, console


class ExportFormat(str, Enum):  # noqa: UP042  (typer takes str-mixin enums as choices)
    vllm = "vllm"
    chrome = "chrome"


@app.command()
def export(
    results: Annotated[Path, typer.Argument(help="a run's result directory (one simulation)")],
    format: Annotated[ExportFormat, typer.Option(
        "--format", case_sensitive=False,
        help="vllm: vLLM's serving-benchmark result JSON (vllm bench serve --save-result); "
             "chrome: a Trace Event Format JSON for Perfetto or chrome://tracing")],
    out: Annotated[Path | None, typer.Option(
        help="file to write (default: RESULTS/vllm_result.json, RESULTS/trace.json)")] = None,
    percentiles: Annotated[str, typer.Option(
        help="vllm: percentiles written for each metric, as vLLM's --metric-percentiles")
    ] = "99",
    detailed: Annotated[bool, typer.Option(
        help="vllm: per-request arrays (input_lens, ttfts, itls, errors...), as vLLM's "
             "--save-detailed")] = True,
    num_flows: Annotated[int, typer.Option(
        min=0, help="chrome: requests drawn as flows from arrival to finish, evenly spaced "
                    "over request ids")] = 20,
) -> None:
    """Write a run's results as another tool's file: vLLM's benchmark result or a trace."""
    from sim.export import export_run

    path = export_run(results, format.value, out, percentiles=parse_percentiles(percentiles),
                      detailed=detailed, num_flows=num_flows)
    console.print(str(path), soft_wrap=True, highlight=False)


def parse_percentiles(text: str) -> list[float]:
    """`50,90,99` as numbers in [0, 100]; a one-line `InputError` for anything else."""
    from sim.errors import InputError

    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise InputError(None, "--percentiles", text,
                             "must be numbers separated by commas, e.g. 50,90,99") from None
        if not 0 <= value <= 100:
            raise InputError(None, "--percentiles", text, "each must be between 0 and 100")
        values.append(value)
    return values
