"""Commands that measure real iterations with torch: `profile` and `fit`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sim.cli.common import app


@app.command()
def profile(
    model: Annotated[str, typer.Option(help="model shape to build (see `servesim list`)")] = "tiny",
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N")] = "cpu",
    out: Annotated[Path, typer.Option(help="profile file (parquet); resumed if it exists")] = Path(
        "profiles/profile.parquet"),
    reps: Annotated[int, typer.Option(min=1, help="timed repetitions per mix")] = 5,
    warmup: Annotated[int, typer.Option(min=0, help="untimed runs per mix first")] = 2,
    holdout: Annotated[int, typer.Option(min=0, help="random held-out mixes to measure")] = 200,
    seed: Annotated[int, typer.Option(min=0, help="seed of the grid, mixes and weights")] = 0,
    threads: Annotated[int | None, typer.Option(
        min=1, help="CPU threads for torch (default 1)")] = None,
    max_tokens: Annotated[int | None, typer.Option(min=1, help="most tokens per iteration")] = None,
    max_context: Annotated[int | None, typer.Option(min=1, help="longest context")] = None,
    max_batch: Annotated[int | None, typer.Option(min=1, help="most decodes per iteration")] = None,
    check: Annotated[Path | None, typer.Option(
        help="instead of profiling: measure fresh random mixes against this fitted file")] = None,
    num: Annotated[int, typer.Option(min=1, help="mixes for --check")] = 200,
    attention: Annotated[str | None, typer.Option(
        help="sdpa (portable) or varlen (paged FlashAttention, CUDA) [default: best here]")
    ] = None,
    plot: Annotated[Path | None, typer.Option(help="scatter plot for --check (png/svg)")] = None,
) -> None:
    """Measure real iterations of a model on a device (needs torch), or --check a fitted model."""
    from profiler import commands

    if check is not None:
        commands.run_check(check, device, num, seed, threads, plot)
        return
    commands.run_profile(model, device, out, reps=reps, warmup=warmup, holdout=holdout,
                         seed=seed, threads=threads, max_tokens=max_tokens,
                         max_context=max_context, max_batch=max_batch, attention=attention)


@app.command()
def fit(
    profile_path: Annotated[Path, typer.Argument(metavar="PROFILE", help="profile parquet")],
    out: Annotated[Path | None, typer.Option(help="fitted latency file [default: PROFILE.json]")
                   ] = None,
) -> None:
    """Fit the profile latency model; print its error on held-out mixes; write its file."""
    from profiler import commands

    commands.run_fit(profile_path, out)
