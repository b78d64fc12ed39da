"""Figures, drawn from result files only (a run's directory, a sweep's table, a comparison's
variants, a capacity search's trials, replications and replicated comparisons). Each is
written as PNG and SVG (PNG first), titled, named and unit-labelled from `sim.results.labels`;
overloaded runs are marked. `plot_results` draws what a directory's own kind supports;
unreadable files are one-line `InputError`s."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sim.config.errors import COMMAND_LINE, InputError
from sim.plots.capacity import capacity_bars, capacity_figure, capacity_trials, plot_capacity
from sim.plots.common import save
from sim.plots.compare import headline_bars, plot_comparison
from sim.plots.replicated import (
    percentile_intervals,
    plot_replicated_comparison,
    plot_replications,
    replicated_cdfs,
)
from sim.plots.run import cdfs, tbt_sample, ttft_sample
from sim.plots.sweep import latency_vs_throughput, p99_tbt_vs_load, plot_sweep, ttft_vs_load
from sim.plots.timeline import busiest_window, iteration_timeline
from sim.results.outdir import PLOTS_DIR, check_writable_dir
from sim.results.read import directory_kind
from sim.results.run_dir import Results

__all__ = ["busiest_window", "capacity_bars", "capacity_figure", "capacity_trials", "cdfs",
           "headline_bars", "iteration_timeline", "latency_vs_throughput", "p99_tbt_vs_load",
           "percentile_intervals", "plot_capacity", "plot_comparison",
           "plot_replicated_comparison", "plot_replications", "plot_results", "plot_run",
           "plot_sweep", "replicated_cdfs", "save", "tbt_sample", "ttft_sample", "ttft_vs_load"]


def plot_run(run_dir: Path, out_dir: Path | None = None, *,
             window_s: tuple[float, float] | None = None,
             replicas: Sequence[int] | None = None, worst_tbt: bool = False) -> list[Path]:
    """The figures one run's files support: CDFs (TBT: every gap, or each request's worst
    with `worst_tbt`) and the iteration timeline (of `window_s` and `replicas`; by default
    the busiest window, the first replica of each pool)."""
    run = Results.load(run_dir)  # refused in one line if its tables break what a run guarantees
    out_dir = out_dir or run_dir / "plots"
    # Its own name: the every-gap CDF drawn before stays beside it.
    files = cdfs([run], out_dir / ("cdf_worst_tbt" if worst_tbt else "cdf"), [run_dir.name],
                 worst_tbt=worst_tbt)
    return files + iteration_timeline(run, out_dir / "timeline", replicas, window_s)


def plot_results(dirs: Sequence[Path], out_dir: Path | None = None, *,
                 window_s: tuple[float, float] | None = None,
                 replicas: Sequence[int] | None = None, worst_tbt: bool = False
                 ) -> list[Path]:
    """Draw what the directories' own kind supports (several only for capacity searches);
    the written paths, each figure's PNG before its SVG. `window_s`, `replicas`: a run's
    timeline only; `worst_tbt`: a run's or a comparison's TBT CDF of each request's worst
    gap instead of every gap."""
    if out_dir is not None:
        check_writable_dir(out_dir)
    kinds = [directory_kind(d) for d in dirs]
    if len(dirs) > 1 and set(kinds) != {"capacity"}:
        raise InputError(COMMAND_LINE, "RESULTS", [str(d) for d in dirs],
                         "several directories are drawn together only for capacity searches")
    if (window_s is not None or replicas) and kinds[0] != "run":
        raise InputError(dirs[0], "--window/--replica", str(dirs[0]),
                         f"a timeline is drawn for one run; this is a {kinds[0]}")
    if worst_tbt and kinds[0] not in ("run", "comparison"):
        raise InputError(dirs[0], "--worst-tbt", str(dirs[0]),
                         f"draws a run's or a comparison's CDF; this is a {kinds[0]}")
    if out_dir is None:  # every kind draws into its (first) directory's `plots`
        check_writable_dir(dirs[0] / PLOTS_DIR, "--out (default RESULTS/plots)")
    if kinds[0] == "capacity":
        return plot_capacity(dirs, out_dir)
    if kinds[0] == "run":
        return plot_run(dirs[0], out_dir, window_s=window_s, replicas=replicas,
                        worst_tbt=worst_tbt)
    if kinds[0] == "comparison":
        return plot_comparison(dirs[0], out_dir, worst_tbt=worst_tbt)
    if kinds[0] == "plan":
        from sim.plots.plan import plan_figure

        return plan_figure(dirs[0], out_dir or dirs[0] / PLOTS_DIR)
    draw = {"sweep": plot_sweep, "replications": plot_replications,
            "replicated_comparison": plot_replicated_comparison}
    return draw[kinds[0]](dirs[0], out_dir)
