"""`servesim plot`: figures from any result directory's own files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sim.cli.common import app, console


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
