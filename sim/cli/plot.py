"""`servesim plot`: figures from any result directory's own files."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from sim.cli.common import app, console
from sim.config.errors import COMMAND_LINE, InputError


def parse_window(text: str) -> tuple[float, float]:
    """`START:END` in seconds of simulated time, START < END."""
    try:
        start, end = (float(part) for part in text.split(":"))
    except ValueError:
        raise InputError(COMMAND_LINE, "--window", text,
                         "must be START:END in seconds, e.g. 120:125") from None
    if not (math.isfinite(start) and math.isfinite(end) and 0 <= start < end):
        raise InputError(COMMAND_LINE, "--window", text, "must have 0 <= START < END, both finite")
    return start, end


@app.command()
def plot(
    results: Annotated[list[Path], typer.Argument(
        metavar="RESULTS...", help="a result directory: a run's, replications', a sweep's, a "
        "comparison's, or one or more capacity searches'")],
    out: Annotated[Path | None, typer.Option(help="figure directory",
                                                  show_default="RESULTS/plots")
                   ] = None,
    window: Annotated[str | None, typer.Option(
        metavar="START:END", help="a run's timeline: this window, in seconds",
        show_default="the busiest 5 s")] = None,
    replica: Annotated[list[int] | None, typer.Option(
        metavar="N", help="a run's timeline: this replica (repeat for several)",
        show_default="the first of each pool")] = None,
    worst_tbt: Annotated[bool, typer.Option(
        "--worst-tbt", help="a run's or comparison's TBT CDF: each request's worst gap, "
        "not every gap")] = False,
) -> None:
    """Draw the figures a result directory's own files support (PNG and SVG)."""
    from sim.plots import plot_results
    from sim.report import refuse_validation_dir

    for path in results:
        refuse_validation_dir(path)
    window_s = parse_window(window) if window is not None else None
    for f in plot_results(results, out, window_s=window_s, replicas=replica or None,
                          worst_tbt=worst_tbt):
        console.print(str(f), soft_wrap=True, highlight=False)  # paths whole, to copy
