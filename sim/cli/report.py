"""`servesim report`: one self-contained HTML page for a result directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sim.cli.common import app, console


@app.command()
def report(
    results: Annotated[Path, typer.Argument(
        metavar="RESULTS", help="a result directory: a run's, replications', a sweep's, a "
        "comparison's or a capacity search's")],
    out: Annotated[Path | None, typer.Option(
        help="the HTML file to write", show_default="RESULTS/report.html")] = None,
) -> None:
    """Write one HTML page for a result directory: figures, tables, verdict, scenario and
    versions, all inline (it opens offline, no script)."""
    from sim.report import write_report

    console.print(str(write_report(results, out)), soft_wrap=True, highlight=False)
