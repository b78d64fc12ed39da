"""`servesim export`: a run's results in other tools' formats."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from sim.cli.common import app, console, refuse_unused


class ExportFormat(str, Enum):  # noqa: UP042  (typer takes str-mixin enums as choices)
    vllm = "vllm"
    chrome = "chrome"


@app.command()
def export(
    ctx: typer.Context,
    results: Annotated[Path, typer.Argument(help="a run's result directory (one simulation)")],
    format: Annotated[ExportFormat, typer.Option(
        "--format", case_sensitive=False,
        help="vllm: vLLM's serving-benchmark result JSON (vllm bench serve --save-result); "
             "chrome: a Trace Event Format JSON for Perfetto or chrome://tracing")],
    out: Annotated[Path | None, typer.Option(
        help="file to write", show_default="RESULTS/vllm_result.json or RESULTS/trace.json")
    ] = None,
    percentiles: Annotated[str, typer.Option(
        metavar="P,P,...",
        help="vllm: percentiles of each metric, as vLLM's --metric-percentiles")] = "99",
    summary_only: Annotated[bool, typer.Option(
        "--summary-only", help="vllm: leave out the per-request arrays (input_lens, ttfts, "
        "itls, errors...), as vLLM does without --save-detailed")] = False,
    num_flows: Annotated[int, typer.Option(
        min=0, metavar="N", help="chrome: requests drawn as flows from arrival to finish, "
        "evenly spaced over request ids")] = 20,
) -> None:
    """Write a run's results as another tool's file: vLLM's benchmark result or a trace."""
    from sim.config.errors import COMMAND_LINE, InputError
    from sim.export import export_run
    from sim.workloads.base import MAX_REQUESTS

    refuse_unused(ctx, {"num_flows": "only with --format chrome"}
                  if format is ExportFormat.vllm else
                  {"percentiles": "only with --format vllm",
                   "summary_only": "only with --format vllm"})
    if num_flows > MAX_REQUESTS:  # more than any run's requests; 10**11 ran out of memory
        raise InputError(COMMAND_LINE, "--num-flows", num_flows,
                         f"at most {MAX_REQUESTS:,} (a run's most requests)")
    path = export_run(results, format.value, out, percentiles=parse_percentiles(percentiles),
                      detailed=not summary_only, num_flows=num_flows)
    console.print(str(path), soft_wrap=True, highlight=False)


def parse_percentiles(text: str) -> list[float]:
    """`50,90,99` as numbers in [0, 100]; a one-line `InputError` for anything else."""
    from sim.config.errors import COMMAND_LINE, InputError

    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise InputError(COMMAND_LINE, "--percentiles", text,
                             "must be numbers separated by commas, e.g. 50,90,99") from None
        if not 0 <= value <= 100:
            raise InputError(COMMAND_LINE, "--percentiles", text, "each must be between 0 and 100")
        if value in values:  # vLLM's result names each p<value>: the second would replace it
            raise InputError(COMMAND_LINE, "--percentiles", text, f"{part.strip()} is given "
                             "twice: give each percentile once")
        values.append(value)
    return values
