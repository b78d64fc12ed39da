"""The `servesim` command line: one module per group of commands, registered on one typer app.

`run` (simulate, list), `study` (compare, sweep, capacity, plot), `measure` (profile, fit).
Commands import what they need inside their bodies, so `servesim --help` starts fast.
"""

from __future__ import annotations

import sys
from importlib import import_module

import typer

from sim.cli.common import app
from sim.errors import InputError

for _group in ("run", "study", "measure"):  # registers the commands, in the order --help lists
    import_module(f"sim.cli.{_group}")

__all__ = ["app", "main"]


def main() -> None:
    """Entry point: input errors become one line each on stderr and exit code 2; an interrupt
    exits 130 (the command says first what it kept)."""
    try:
        code = app(standalone_mode=False)
    except InputError as exc:
        for line in exc.lines():
            print(f"error: {line}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    except Exception as exc:  # click usage errors carry their own exit code
        code = getattr(exc, "exit_code", None)
        if code is None:
            raise
        show = getattr(exc, "show", None)
        if show is not None:
            show()
        sys.exit(code)
    # Without standalone mode, typer returns the exit code of an interrupt (130) or of
    # `typer.Exit(n)` instead of exiting.
    if isinstance(code, int) and code:
        sys.exit(code)
