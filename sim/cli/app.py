"""The typer app with every command registered, in the order `--help` lists them."""

from __future__ import annotations

from importlib import import_module

from sim.cli.common import app

for _group in ("run", "listing", "compare", "study", "plan", "plot", "export", "report",
               "measure", "calibrate", "fit"):
    import_module(f"sim.cli.{_group}")

__all__ = ["app"]
