"""Commands that measure real iterations with torch: `profile`, `fit`, `replay`, `validate`."""

from __future__ import annotations

import importlib.util
import math
import shlex
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from sim.cli.common import app, check_seed, console, interrupted
from sim.config.errors import COMMAND_LINE, InputError


def require_torch(device: str) -> None:
    """One line, exit 2, where torch is not installed (looked up, not imported: `sim/` runs
    without torch, and the profiler imports it where it measures)."""
    if importlib.util.find_spec("torch") is None:
        raise InputError(COMMAND_LINE, "--device", device,
                         "this command runs a real model and needs torch: "
                         "pip install -e '.[profile]'")


class Attention(str, Enum):  # noqa: UP042  (typer takes str-mixin enums as choices)
    """The profiler's attention kernels."""

    sdpa = "sdpa"
    varlen = "varlen"


def command_line() -> str:
    return shlex.join(["servesim", *sys.argv[1:]])


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
        min=1, help="CPU threads for torch", show_default="1")] = None,
    max_tokens: Annotated[int | None, typer.Option(min=1, help="most tokens per iteration")] = None,
    max_context: Annotated[int | None, typer.Option(min=1, help="longest context")] = None,
    max_batch: Annotated[int | None, typer.Option(min=1, help="most decodes per iteration")] = None,
    check: Annotated[Path | None, typer.Option(
        help="instead of profiling: measure fresh random mixes against this fitted file")] = None,
    num: Annotated[int, typer.Option(min=1, help="mixes for --check")] = 200,
    attention: Annotated[Attention | None, typer.Option(
        help="sdpa (portable) or varlen (paged FlashAttention, CUDA)",
        show_default="best here")] = None,
    plot: Annotated[Path | None, typer.Option(help="scatter plot for --check (png/svg)")] = None,
    tensor_parallel: Annotated[int | None, typer.Option(
        "--tensor-parallel", help="measure one GPU's shard of a T-way tensor-parallel replica "
        "(heads, MLP width and LM head divided by T); --check reads it from the file",
        show_default="1")] = None,
) -> None:
    """Measure real iterations of a model on a device (needs torch), or --check a fitted model."""
    require_torch(device)
    from profiler import commands

    if check is not None:
        commands.run_check(check, device, num, seed, threads, plot, tensor_parallel)
        return
    commands.run_profile(model, device, out, reps=reps, warmup=warmup, holdout=holdout,
                         seed=seed, threads=threads, max_tokens=max_tokens,
                         max_context=max_context, max_batch=max_batch,
                         attention=attention.value if attention else None,
                         tensor_parallel=1 if tensor_parallel is None else tensor_parallel)


@app.command()
def fit(
    profile_path: Annotated[Path, typer.Argument(metavar="PROFILE", help="profile parquet")],
    out: Annotated[Path | None, typer.Option(
        help="fitted latency file", show_default="PROFILE with .json")] = None,
    host_overhead_from: Annotated[list[Path] | None, typer.Option(
        help="replay result directories: add their median host time per iteration (outside "
             "the forward pass) to the model as a per-iteration term")] = None,
) -> None:
    """Fit the profile latency model; print its error on held-out mixes; write its file."""
    from profiler import commands

    commands.run_fit(profile_path, out, host_overhead_from or [])


@app.command()
def replay(
    scenario: Annotated[Path, typer.Argument(
        metavar="SCENARIO", help="scenario YAML with one colocated replica")],
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N")] = "cpu",
    out: Annotated[Path | None, typer.Option(
        help="directory for the result files", show_default="results/<scenario name>_replay")
    ] = None,
    threads: Annotated[int | None, typer.Option(
        min=1, help="CPU threads for torch (1 is steadier)", show_default="1")] = None,
    seed: Annotated[int | None, typer.Option(min=0, help="override the scenario's seed")] = None,
    attention: Annotated[Attention | None, typer.Option(
        help="sdpa (portable) or varlen (paged FlashAttention, CUDA)",
        show_default="best here")] = None,
) -> None:
    """Serve a scenario's requests for real, in real time, on one replica (needs torch).

    The simulator's scheduler and KV accounting; each plan one forward pass of the profiler's
    model; output lengths from the trace. Writes the simulator's result files, plus forward and
    host time per iteration. Ctrl-C stops and keeps what ran (marked incomplete)."""
    require_torch(device)
    from profiler.replay.serve import replay as serve
    from sim.cli.run import overload_line, rejected_line, summary_table
    from sim.config.scenario import load_scenario
    from sim.studies.progress import ProgressReport

    check_seed(seed)
    loaded = load_scenario(scenario)
    if seed is not None:
        loaded = loaded.model_copy(update={"seed": seed})
    out_dir = out if out is not None else Path("results") / f"{loaded.name}_replay"
    try:
        with ProgressReport(f"replaying {loaded.name}", "requests") as progress:
            results = serve(loaded, device=device, threads=threads,
                            attention=attention.value if attention else None,
                            out_dir=out_dir, progress=progress, command=command_line())
    except KeyboardInterrupt:
        # Ctrl-C while serving stops the loop and keeps what ran (handled inside): this one
        # came during the set-up (loading, the model's warm-up) or the final write.
        raise interrupted(f"before the replay's results were written: nothing new in "
                          f"{out_dir}/") from None
    summary = results.summary
    console.print(summary_table(summary))
    rep, its = summary["replay"], results.iterations
    console.print(f"{len(its)} iterations; host time outside the forward pass: median "
                  f"{1e3 * rep['host_s']['p50']:.3g} ms per iteration, "
                  f"{100 * rep['host_share']:.1f}% of busy time" if len(its) else "no iteration")
    console.print(overload_line(summary["overload"]))
    if line := rejected_line(summary):
        console.print(line)
    if unpriced := summary["run"].get("unpriced"):
        console.print(f"cost: none ({unpriced})")
    if not summary["run"]["complete"]:
        req = summary["requests"]
        console.print(f"interrupted at t={rep['interrupted_at_s']:.2f} s: kept {len(its)} "
                      f"iterations, {req['finished']} requests finished, {req['rejected']} "
                      f"rejected, {req['unfinished']} unfinished (reason: interrupted) -> "
                      f"{out_dir}/ (summary.json: run.complete false)")
        raise KeyboardInterrupt
    console.print(f"results: {out_dir}/ ("
                  f"{', '.join(sorted(p.name for p in Path(out_dir).iterdir()))})")


@app.command()
def validate(
    scenarios: Annotated[list[Path], typer.Argument(
        metavar="SCENARIO...", help="scenario YAMLs (one colocated replica; one scheduler each)")],
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N")] = "cpu",
    loads: Annotated[str, typer.Option(help="fractions of capacity, comma-separated")
                     ] = "0.5,0.8,0.95",
    profile: Annotated[Path | None, typer.Option(
        help="fitted profile to validate",
        show_default="measure one now, on a grid sized from the scenarios")] = None,
    capacity: Annotated[float | None, typer.Option(
        min=1e-9, help="requests/s that loads are fractions of",
        show_default="measured by a saturated replay")] = None,
    capacity_requests: Annotated[int | None, typer.Option(
        min=1, help="requests in the saturated replay", show_default="all the scenario's")
    ] = None,
    repeats: Annotated[int, typer.Option(min=1, help="replays per point (2+: the floor)")] = 2,
    threads: Annotated[int | None, typer.Option(min=1, help="CPU threads", show_default="1")
                       ] = None,
    out: Annotated[Path | None, typer.Option(
        help="directory for tables, figure and runs", show_default="validation/<name>")
    ] = None,
    profile_max_tokens: Annotated[int | None, typer.Option(
        min=1, help="cap the measured grid's tokens per iteration")] = None,
    profile_reps: Annotated[int, typer.Option(min=1, help="timed repetitions per mix")] = 5,
    profile_holdout: Annotated[int, typer.Option(min=1, help="held-out mixes")] = 60,
    reuse: Annotated[bool, typer.Option(
        "--reuse", help="reuse the profile and complete replays of identical scenarios "
                        "already in --out")
    ] = False,
) -> None:
    """Replay each scenario at each load, simulate the same requests, report the errors.

    Each scenario is replayed at each load (twice). Reported: the signed error of TTFT, TBT,
    E2E, scheduling delay and throughput, split into scheduling (recorded durations) and
    latency-model error (profile, with and without host overhead; roofline). Writes errors.csv,
    iterations.csv, meta.json, table.txt, validation.png."""
    require_torch(device)
    from profiler.replay.validate import Options, run_validation
    from sim.config.scenario import load_scenario

    try:
        fractions = [float(x) for x in loads.split(",") if x.strip()]
    except ValueError:
        raise InputError(COMMAND_LINE, "--loads", loads, "comma-separated numbers") from None
    if capacity is not None and not math.isfinite(capacity):  # typer takes inf and 1e400
        raise InputError(COMMAND_LINE, "--capacity", capacity,
                         "must be a finite rate in requests/s")
    loaded = [load_scenario(path) for path in scenarios]
    out_dir = out if out is not None else Path("validation") / loaded[0].name
    opts = Options(device=device, loads=fractions, profile=profile, capacity_rps=capacity,
                   capacity_requests=capacity_requests, repeats=repeats, threads=threads,
                   profile_max_tokens=profile_max_tokens, profile_reps=profile_reps,
                   profile_holdout=profile_holdout, reuse=reuse, command=command_line())
    meta = run_validation(loaded, opts, out_dir, lambda line: console.print(line, highlight=False))
    for line in meta["lines"]:
        console.print(line, highlight=False, soft_wrap=True)
    console.print(f"-> {out_dir}/ (errors.csv, iterations.csv, meta.json, table.txt, "
                  "validation.png; runs/)")
