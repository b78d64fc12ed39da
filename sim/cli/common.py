"""What every command group shares: the typer app, the console and number formatting."""

from __future__ import annotations

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Simulate LLM serving: TTFT and inter-token latency, before GPU hours.")
console = Console()


def fmt(value: float | None, scale: float = 1.0) -> str:
    """A number for a table: 4 significant digits, thousands separated; '-' for none."""
    if value is None or value != value:
        return "-"
    return f"{value * scale:,.4g}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def wide_console(min_width: int = 150) -> Console:
    """A console at least `min_width` wide, for tables with many columns."""
    return Console(width=max(console.width, min_width))
