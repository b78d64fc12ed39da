"""The `servesim` command line: one module per group of commands, registered on one typer app
(`sim/cli/app.py`): `run` (simulate, list), `study` (compare, sweep, capacity, plot), `measure`
(profile, fit). Nothing heavy is imported before `main` runs, so a Ctrl-C at any moment is
answered the same way, and `servesim --help` starts fast.
"""

from __future__ import annotations

import os
import signal
import sys


def main() -> None:
    """Entry point: input errors become one line each on stderr and exit code 2; an interrupt
    exits 130 (the command says first what it kept)."""
    # numpy's OpenBLAS starts a thread per core at import, and it spins: on a busy 2-core VM that
    # took 40-60 ms from every start-up. servesim has no BLAS work worth threads (torch uses MKL),
    # and sweep workers, one per core, are better off without them. A user's setting wins.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # SIGTERM (a job manager's stop) is met as Ctrl-C is: worker processes stopped, what ran
    # kept or marked incomplete; then the exit a terminated process gives (143).
    terminated = []

    def on_sigterm(signum: int, frame: object) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        code = _run()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    # Without standalone mode, typer returns the exit code of an interrupt (130) or of
    # `typer.Exit(n)` instead of exiting.
    if code == 130 and terminated:
        code = 128 + signal.SIGTERM
    if isinstance(code, int) and code:
        sys.exit(code)


def _run() -> object:
    import typer

    from sim.cli.app import app
    from sim.config.errors import InputError

    try:
        return app(standalone_mode=False)
    except InputError as exc:
        for line in exc.lines():
            print(f"error: {line}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    except Exception as exc:  # click's errors (typer vendors its own click): a bad option
        code, message = getattr(exc, "exit_code", None), getattr(exc, "format_message", None)
        if code is None or message is None:
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":
            exc.show()  # type: ignore[attr-defined]  # `servesim` alone: the help
        else:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            print(f"error: {' '.join(message().split())}{hint}", file=sys.stderr)
        sys.exit(code)
