"""What `servesim profile`, `servesim profile --check` and `servesim fit` do."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from profiler.fit.fitting import check_profile, errors, fit_profile, predict
from profiler.measure.device import check_buildable, check_memory, torch_setup
from profiler.measure.mixes import GridSpec
from profiler.measure.timing import load
from sim.config.errors import COMMAND_LINE, InputError
from sim.config.input_file import FileProblem, stat_regular
from sim.hardware.models import MODELS, ModelShape
from sim.latency.profile import load_fitted
from sim.results.outdir import replace_text
from sim.studies.progress import ProgressReport

console = Console()


def run_profile(model: str, device: str, out: Path, *, reps: int, warmup: int, holdout: int,
                seed: int, threads: int | None, max_tokens: int | None,
                max_context: int | None, max_batch: int | None,
                attention: str | None = None, tensor_parallel: int = 1) -> None:
    """Measure the grid and `holdout` random mixes; resume from `out` if it exists. With
    `tensor_parallel` T > 1: one GPU's shard of a T-way tensor-parallel replica."""
    from dataclasses import replace

    from profiler.measure.mixes import grid, random_mixes
    from profiler.measure.timing import ProfileInterrupted, default_attention, default_grid, profile

    if model not in MODELS:
        raise InputError(COMMAND_LINE, "--model", model,
                         f"unknown; known: {', '.join(MODELS.names())}")
    check_buildable(MODELS.get(model), COMMAND_LINE, "--model", model)
    check_tensor_parallel(MODELS.get(model), tensor_parallel)
    check_profile_out(out)
    torch, dtype = torch_setup(device, threads)
    attention = attention or default_attention(device)
    if attention == "varlen" and not device.startswith("cuda"):
        raise InputError(COMMAND_LINE, "--attention", attention, "varlen needs a CUDA device")
    shape = MODELS.get(model)
    spec = default_grid(shape, device, tensor_parallel)
    spec = replace(spec, max_tokens=max_tokens or spec.max_tokens,
                   max_context=max_context or spec.max_context,
                   max_batch=max_batch or spec.max_batch)
    check_grid(spec)
    rng = np.random.default_rng(seed)
    mixes = [(m, "train") for m in grid(spec, rng)]
    mixes += [(m, "holdout") for m in random_mixes(spec, holdout, rng)]
    command = shlex.join(["servesim", *sys.argv[1:]])
    what = f"{model} (one shard of TP{tensor_parallel})" if tensor_parallel > 1 else model
    kept = len(load(out, "--out")[0]) if out.exists() else 0
    try:
        # A bar on a terminal; a line every 10 s in a log (a GPU job left running).
        with ProgressReport(f"profiling {what} on {device}", "mixes", total=len(mixes)) as progress:
            progress.update(kept)
            df = profile(shape, device, out, spec, mixes, dtype=dtype, warmup=warmup, reps=reps,
                         seed=seed, command=command, attention=attention,
                         tensor_parallel=tensor_parallel, on_progress=progress.update)
    except ProfileInterrupted as stop:
        console.print(f"interrupted: {stop.num_rows - kept} mixes measured"
                      + (f", {kept} kept from before" if kept else "")
                      + (f" -> {out}" if stop.num_rows else ", nothing written")
                      + f"; {stop.num_todo - (stop.num_rows - kept)} left: the same command "
                      "resumes")
        raise
    console.print(f"{len(df) - kept} mixes measured" + (f", {kept} kept from before"
                                                          if kept else "") + f" -> {out}")


# The smallest grid a profile can be drawn and fitted on: held-out mixes draw decode contexts
# from 16 tokens to half the longest context, and the fitted curve over tokens needs two knots.
MIN_MAX_CONTEXT = 32
MIN_MAX_TOKENS = 2


def check_grid(spec: GridSpec) -> None:
    """One line, exit 2, for a grid too small to measure mixes on (`--max-context 16` ended in
    numpy's 'low >= high')."""
    if spec.max_context < MIN_MAX_CONTEXT:
        raise InputError(COMMAND_LINE, "--max-context", spec.max_context,
                         f"must be at least {MIN_MAX_CONTEXT} (held-out mixes draw decode "
                         f"contexts from 16 tokens to half of it)")
    if spec.max_tokens < MIN_MAX_TOKENS:
        raise InputError(COMMAND_LINE, "--max-tokens", spec.max_tokens,
                         f"must be at least {MIN_MAX_TOKENS} (the fit's curve over tokens needs "
                         "two token counts)")


def check_profile_out(out: Path) -> None:
    """Where the profile goes, before anything is measured: a new file, or a regular file to
    resume (read and checked when the measuring starts)."""
    _check_out_file(out, (".parquet",))


def _check_out_file(out: Path, suffixes: tuple[str, ...], option: str = "--out") -> None:
    """`option` names a file to write, ending in one of `suffixes` (a profile is parquet, a
    fitted model JSON: `x.json` holding parquet would be read as neither; a plot's format
    follows its suffix): a new one or a regular file, never a directory or a named pipe (the
    write would fail in one, hang on the other; a directory given as --plot was saved beside
    it as DIR.png)."""
    kinds = " or ".join(suffixes)
    if out.exists():
        try:
            stat_regular(out)
        except FileProblem as exc:
            hint = f": name a {kinds} file" if out.is_dir() else ""
            raise InputError(out, option, str(out), f"{exc}{hint}") from None
    if out.suffix.lower() not in suffixes:
        raise InputError(COMMAND_LINE, option, str(out), f"name a {kinds} file")


PLOT_SUFFIXES = (".png", ".svg")


def check_plot_out(plot: Path) -> None:
    """`--plot` names a .png or .svg file, checked before anything is measured (another
    suffix failed after the check had run, in a traceback)."""
    _check_out_file(plot, PLOT_SUFFIXES, "--plot")


def check_tensor_parallel(shape: ModelShape, tensor_parallel: int) -> None:
    """One line, exit 2, where the model's heads do not split `tensor_parallel` ways."""
    from sim.hardware.parallelism import MAX_GPUS_PER_REPLICA, Parallelism

    if not 1 <= tensor_parallel <= MAX_GPUS_PER_REPLICA:
        raise InputError(COMMAND_LINE, "--tensor-parallel", tensor_parallel,
                         f"must be between 1 and {MAX_GPUS_PER_REPLICA}")
    problems = Parallelism(tensor=tensor_parallel).problems(shape)
    if problems:
        raise InputError(COMMAND_LINE, "--tensor-parallel", tensor_parallel, problems[0][2])


def _check_fit_out(out: Path, profile_path: Path) -> None:
    """Where the fitted model goes: a new or regular file, in an existing directory, and never
    the measured profile itself (its measurements would be lost)."""
    if out.exists() and out.resolve() == profile_path.resolve():
        raise InputError(out, "--out", str(out), "is the profile being fitted, which this would "
                         "overwrite: name a .json file")
    _check_out_file(out, (".json",))
    if not out.absolute().parent.is_dir():
        raise InputError(out, "--out", str(out), "its directory does not exist")


def run_fit(profile_path: Path, out: Path | None, host_overhead_from: list[Path] | None = None
            ) -> Path:
    """Fit on the grid rows, report the error on held-out rows, write the latency file; with
    replay directories, add their median host time per iteration as a per-iteration term."""
    df, meta = load(profile_path)
    check_profile(df, meta, profile_path)
    out = out or profile_path.with_suffix(".json")
    _check_fit_out(out, profile_path)
    fitted = fit_profile(df, meta)
    fitted["source"] = str(profile_path)
    if host_overhead_from:
        from profiler.fit.fitting import add_host_overhead
        from profiler.replay.validate import host_overhead

        stats = host_overhead(list(host_overhead_from))
        fitted = add_host_overhead(fitted, stats["median_s"], stats)
        console.print(f"host overhead: {1e3 * stats['median_s']:.3g} ms per iteration (median "
                      f"of {stats['num_iterations']} replayed iterations) added to g(tokens)")
    try:
        replace_text(out, json.dumps(fitted, indent=1, sort_keys=True, allow_nan=False) + "\n")
    except OSError as exc:
        raise InputError(out, "--out", str(out), f"cannot write there ({exc.strerror})") from None
    console.print(error_table(f"fit of {profile_path.name}", fitted))
    console.print(f"latency model -> {out}  (scenario: latency: {{kind: profile, path: {out}}})")
    return out


def error_table(title: str, fitted: dict[str, Any]) -> Table:
    table = Table(title=title)
    for col in ("rows", "n", "MAPE %", "P95 %", "max %"):
        table.add_column(col, justify="right")
    for name in ("train", "holdout", "check"):
        e = fitted.get(name)
        if e:
            table.add_row(name, str(e["n"]), f"{100 * e['mape']:.2f}", f"{100 * e['p95']:.2f}",
                          f"{100 * e['max']:.2f}")
    noise = fitted.get("noise")
    if noise:
        table.caption = (f"timing noise: median |t - median| / median "
                         f"{100 * noise['median_rel_abs_dev']:.2f}%, P95 "
                         f"{100 * noise['p95_rel_abs_dev']:.2f}%")
    return table


def run_check(fitted_path: Path, device: str, num: int, seed: int, threads: int | None,
              plot: Path | None, tensor_parallel: int | None = None) -> dict[str, float]:
    """Measure `num` fresh random mixes and score the fitted model on them (on the shard the
    profile measured: its `tensor_parallel`)."""
    from dataclasses import fields

    from profiler.measure.mixes import GridSpec, random_mixes
    from profiler.measure.model import Decoder
    from profiler.measure.timing import Timer, measure_mix, row

    if plot is not None:
        check_plot_out(plot)
    fitted = load_fitted(fitted_path, "--check")
    meta = fitted.get("measurement", {})
    fitted_tp = int(fitted.get("tensor_parallel", 1))
    if tensor_parallel is not None and tensor_parallel != fitted_tp:
        raise InputError(fitted_path, "tensor_parallel", fitted_tp,
                         f"the profile times a shard of TP{fitted_tp}, --tensor-parallel is "
                         f"{tensor_parallel} (leave it out with --check)")
    shape = MODELS.get(fitted["model"])
    check_buildable(shape, fitted_path, "model", fitted["model"])
    torch, dtype = torch_setup(device, threads)
    spec = GridSpec(**{f.name: meta["grid"][f.name] for f in fields(GridSpec)
                       if f.name in meta.get("grid", {})})
    rng = np.random.default_rng(seed + 1_000_003)  # a different draw from the profile's
    check_memory(shape, spec.max_kv_tokens, device, dtype, fitted_tp, fitted_path, "model",
                 fitted["model"])
    mixes = random_mixes(spec, num, rng)
    decoder = Decoder(shape, spec.max_kv_tokens, device=device, dtype=dtype, seed=seed,
                      attention=meta.get("attention_backend", "sdpa"),
                      tensor_parallel=fitted_tp)
    timer = Timer(device)
    rows = []
    with ProgressReport(f"checking {fitted_path.name} on {device}", "mixes",
                        total=num) as progress:
        for mix in mixes:
            samples = measure_mix(decoder, mix, timer, meta.get("warmup", 2),
                                  meta.get("reps", 5), rng)
            rows.append(row(mix, "check", samples))
            progress.update(len(rows))
    df = pd.DataFrame(rows)
    result = errors(fitted, df)
    console.print(error_table(f"held-out check of {fitted_path.name}", {**fitted,
                                                                        "check": result}))
    recorded = (fitted.get("holdout") or {}).get("mape")
    if recorded and result["mape"] > 2 * recorded:
        console.print(f"[bold yellow]WORSE THAN RECORDED[/]: check MAPE "
                      f"{100 * result['mape']:.1f}% against {100 * recorded:.1f}% when fitted: "
                      f"this machine or its load now times the model differently from "
                      f"{meta.get('device_name', 'the machine that measured it')} then; "
                      "simulations with this profile may be off by as much")
    if plot is not None:
        scatter(df["median_s"].to_numpy(), predict(fitted, df), plot,
                f"{fitted['model']} on {meta.get('device_name', device)}: "
                f"MAPE {100 * result['mape']:.1f}%, P95 {100 * result['p95']:.1f}%")
        console.print(f"scatter plot -> {plot}")
    return result


def scatter(measured_s: np.ndarray, predicted_s: np.ndarray, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ms_measured, ms_predicted = 1e3 * measured_s, 1e3 * predicted_s
    ax.scatter(ms_measured, ms_predicted, s=10, alpha=0.7)
    top = float(max(ms_measured.max(), ms_predicted.max())) * 1.05
    ax.plot([0, top], [0, top], color="grey", linewidth=1, label="predicted = measured")
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured iteration time (ms)",
           ylabel="predicted iteration time (ms)", title=title)
    ax.title.set_fontsize(9)
    ax.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
