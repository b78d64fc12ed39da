"""Figures of replications (`simulate --replications`) and of a replicated comparison
(`compare --replications`). A scenario's TTFT and TBT CDFs are drawn as the CDF of all its
replications pooled (the line), with a band spanning the replications' own CDFs (pointwise
lowest to highest, on a common grid), and its P50 and P99 marked at the estimates
`replications.json` states with their 95% intervals (the numbers the CLI prints). A
replicated comparison overlays its variants so, and draws its headline numbers as bars with
those intervals as error bars.

Why the range and not a central 95% of the replications' CDFs: replications are few (3 to 10,
typically), too few to place a 2.5% and a 97.5% quantile; the range is what they show."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from sim.config.errors import InputError
from sim.plots.common import BAND_ALPHA, save
from sim.plots.compare import headline_bars
from sim.plots.run import (
    MARKERS,
    Sample,
    cdf_axes,
    slo_targets_s,
    tbt_sample,
    tbt_sample_worst,
    ttft_sample,
)
from sim.results.formats import DISTRIBUTIONS
from sim.results.formats import REPLICATED_COMPARISON_FILE as COMPARISON_FILE
from sim.results.formats import REPLICATIONS_FILE as RESULT_FILE
from sim.results.labels import MS, Unit, label, time_unit
from sim.results.metrics.summary import WeightedSample
from sim.results.read import read_csv, read_json
from sim.results.run_dir import Results

GRID_POINTS = 2000  # values where replications' CDFs are compared, at most
BAND_NOTE = ("line: all replications pooled; band: range of the replications' CDFs; "
             "markers: P50 and P99 estimates with 95% CI")


@dataclass(frozen=True)
class Replicated:
    """One scenario's replications, as a CDF figure needs them: each replication's samples,
    the headline metrics' estimates and intervals (`replications.json`'s `metrics`), the SLO
    targets and how many replications were overloaded."""

    name: str
    ttft: list[Sample]
    tbt: list[Sample]
    metrics: dict[str, Any]
    slo_s: dict[str, float]
    num_overloaded: int

    @property
    def label(self) -> str:
        n = len(self.ttft)
        return self.name + (f" (overloaded in {self.num_overloaded} of {n})"
                            if self.num_overloaded else "")


def load_replicated(rep_dir: Path, name: str | None = None) -> Replicated:
    """A replications directory's runs and intervals, read back; named `name` (default: its
    scenario's name). A malformed `replications.json` is a one-line `InputError`."""
    path = rep_dir / RESULT_FILE
    data = read_json(path)
    runs, metrics = data.get("runs"), data.get("metrics")
    if (not isinstance(runs, list) or not runs or not all(isinstance(r, str) for r in runs)
            or not isinstance(metrics, dict)):
        raise InputError(path, "<file>", str(path),
                         "not a replications result (missing or malformed runs or metrics)")
    for r in runs:
        if not (rep_dir / r / "summary.json").is_file():
            path = rep_dir / r / "summary.json"
            raise InputError(path, "<file>", str(path), f"replication {r} is missing")
    # Each replication checked as any run read back is (`Results.load`), and read once.
    done = [Results.load(rep_dir / r) for r in runs]
    tbts = [tbt_sample(run) for run in done]
    if any(s.key != "tbt_s" for s in tbts):  # one quantity for all
        tbts = [tbt_sample_worst(run) for run in done]
    verdicts = [(run.summary.get("overload") or {}).get("verdict") for run in done]
    return Replicated(name or str(data.get("scenario") or rep_dir.name),
                      [ttft_sample(run) for run in done], tbts, metrics,
                      slo_targets_s(done[0]), verdicts.count("overloaded"))


def _kept(sample: WeightedSample) -> WeightedSample:
    keep = (sample.counts > 0) & np.isfinite(sample.values)
    return WeightedSample(sample.values[keep], sample.counts[keep])


def common_grid(samples: Sequence[WeightedSample], points: int = GRID_POINTS) -> np.ndarray:
    """Where the replications' CDFs are compared: every distinct value of any of them or,
    where there are more than `points`, evenly spaced ranks of those plus the largest
    `points // 4` (the tail, where the P99 lies), every one kept."""
    distinct = np.unique(np.concatenate([s.values for s in samples]))
    if len(distinct) <= points:
        return distinct
    tail = points // 4
    ranks = np.linspace(0, len(distinct) - tail - 1, points - tail).round().astype(np.int64)
    return distinct[np.union1d(ranks, np.arange(len(distinct) - tail, len(distinct)))]


def cdf_at(sample: WeightedSample, grid: np.ndarray) -> np.ndarray:
    """The sample's CDF (share at or below) at each grid value, as `Axes.ecdf` draws it."""
    order = np.argsort(sample.values, kind="stable")
    below = np.concatenate([[0], np.cumsum(sample.counts[order])])
    at = np.searchsorted(sample.values[order], grid, side="right")
    return below[at] / max(int(below[-1]), 1)


def pooled(samples: Sequence[WeightedSample]) -> WeightedSample:
    return WeightedSample(np.concatenate([s.values for s in samples]),
                          np.concatenate([s.counts for s in samples]))


def _estimate(ax: Any, metric: dict[str, Any] | None, y: float, scale: float, marker: str,
              color: str) -> None:
    """The estimate at height `y`, its 95% interval as a horizontal error bar (none where
    every replication gave the same value)."""
    if not metric or metric.get("estimate") is None:
        return
    est = float(metric["estimate"])
    lo, hi = metric.get("ci95") or (None, None)
    xerr = (None if lo is None or hi is None
            else [[scale * max(est - lo, 0.0)], [scale * max(hi - est, 0.0)]])
    ax.errorbar(scale * est, y, xerr=xerr, fmt=marker, color=color, markeredgecolor="black",
                ecolor="black", elinewidth=1.2, capsize=4, zorder=5)


def _band_pair(top: Any, tail: Any, reps: Sequence[Replicated], quantity: str,
               shown: Unit) -> None:
    """One quantity (`ttft` or `tbt`) of each scenario: band, pooled line, estimates."""
    for i, rep in enumerate(reps):
        samples: list[Sample] = getattr(rep, quantity)
        values = [v for v in (_kept(s.values) for s in samples) if v.values.size]
        if not values:
            continue
        color = f"C{i}"
        grid = common_grid(values)
        curves = np.array([cdf_at(v, grid) for v in values])
        low, high = curves.min(axis=0), curves.max(axis=0)
        x = shown.scale * grid
        band = {"step": "post", "color": color, "alpha": BAND_ALPHA, "linewidth": 0}
        top.fill_between(x, low, high, **band)
        tail.fill_between(x, 1 - high, 1 - low, **band)
        all_of = pooled(values)
        top.ecdf(shown.scale * all_of.values, weights=all_of.counts.astype(float),
                 color=color)
        tail.ecdf(shown.scale * all_of.values, weights=all_of.counts.astype(float),
                  complementary=True, color=color)
        section = rep.metrics.get(samples[0].key) or {}
        for p, (marker, q) in MARKERS.items():
            _estimate(top, section.get(p), q, shown.scale, marker, color)
            _estimate(tail, section.get(p), 1 - q, shown.scale, marker, color)
    largest = max((sum(s.values.size for s in getattr(rep, quantity)) for rep in reps),
                  default=1)
    slo = {rep.slo_s[f"{quantity}_s"] for rep in reps if f"{quantity}_s" in rep.slo_s}
    cdf_axes(top, tail, shown, slo, largest)


def _legend(ax: Any, reps: Sequence[Replicated]) -> None:
    """A band-and-line entry per scenario, the SLO lines, and the two estimate markers."""
    handles: list[Any] = [(Patch(color=f"C{i}", alpha=BAND_ALPHA, linewidth=0),
                           Line2D([], [], color=f"C{i}")) for i in range(len(reps))]
    texts = [rep.label for rep in reps]
    extra, extra_texts = ax.get_legend_handles_labels()  # the SLO lines
    marks = [Line2D([], [], marker=m, color="black", markerfacecolor="grey",
                    label=f"{p.upper()} ± 95% CI") for p, (m, _) in MARKERS.items()]
    ax.legend(handles + extra + marks, texts + extra_texts + [h.get_label() for h in marks],
              fontsize="small", loc="lower right")


def replicated_cdfs(reps: Sequence[Replicated], path: Path) -> list[Path]:
    """TTFT and TBT CDFs of scenarios over their replications, each above a log view of its
    tail: the pooled CDF as a line, the range of the replications' CDFs as a band, P50
    (circle) and P99 (diamond) at their estimates with 95% intervals; SLOs as red lines."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex="col",
                             gridspec_kw={"height_ratios": (3, 2)})
    peak = max((float(s.values.values.max()) for rep in reps for s in rep.ttft
                if s.values.values.size), default=0.0)
    shown = time_unit(peak)
    _band_pair(axes[0, 0], axes[1, 0], reps, "ttft", shown)
    _band_pair(axes[0, 1], axes[1, 1], reps, "tbt", MS)
    every_gap = all(s.key == "tbt_s" for rep in reps for s in rep.tbt)
    axes[0, 0].set_title("TTFT (finished requests)")
    axes[0, 1].set_title("TBT, every gap" if every_gap
                         else "worst TBT per request (every gap needs record_token_times)")
    axes[1, 0].set_xlabel(f"TTFT ({shown.name})")
    axes[1, 1].set_xlabel(f"{'TBT' if every_gap else 'worst TBT per request'} ({MS.name})")
    _legend(axes[0, 1], reps)
    counts = sorted({len(rep.ttft) for rep in reps})
    n = "/".join(str(c) for c in counts)
    fig.suptitle(f"{n} replications{' per variant' if len(reps) > 1 else ''}. {BAND_NOTE}",
                 fontsize="medium")
    return save(fig, path)


STATS = ("p50", "p90", "p99", "mean")


def percentile_intervals(data: dict[str, Any], path: Path) -> list[Path]:
    """Each headline latency's P50, P90, P99 and mean: the estimate with its 95% interval,
    and every replication's own value beside it (the spread the interval comes from)."""
    metrics = data.get("metrics") or {}
    panels = [(key, label(key)) for key in DISTRIBUTIONS if key in metrics]
    if not panels:
        return []
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.8), squeeze=False)
    for ax, (key, name) in zip(axes[0], panels, strict=True):
        section = metrics[key]
        peak = max((float(v) for s in STATS for v in (section.get(s) or {}).get(
            "per_replication") or [] if v is not None), default=0.0)
        shown = MS if key != "e2e_s" else time_unit(peak)
        for j, stat in enumerate(STATS):
            metric = section.get(stat) or {}
            each = [shown.scale * v for v in metric.get("per_replication") or []
                    if v is not None]
            ax.plot(np.full(len(each), j + 0.18), each, "o", color="grey", markersize=3,
                    label="each replication" if j == 0 else None)
            if metric.get("estimate") is None:
                continue
            est = shown.scale * float(metric["estimate"])
            lo, hi = metric.get("ci95") or (None, None)
            yerr = (None if lo is None or hi is None
                    else [[max(est - shown.scale * lo, 0.0)], [max(shown.scale * hi - est, 0.0)]])
            ax.errorbar(j, est, yerr=yerr, fmt="s", color="C0", capsize=5,
                        label="estimate ± 95% CI" if j == 0 else None)
        ax.set_xticks(range(len(STATS)), [s.upper() if s != "mean" else s for s in STATS])
        ax.set(ylabel=f"{name} ({shown.name})", title=name)
        ax.set_ylim(bottom=0)
    axes[0, 0].legend(fontsize="small")
    fig.suptitle(f"{data.get('scenario', '')}: {data.get('replications', '?')} replications "
                 "(percentiles: mean of the replications'; CI as the CLI prints it)",
                 fontsize="medium")
    return save(fig, path)


def plot_replications(rep_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Replications of one scenario: its CDFs with bands and intervals, and its headline
    latencies' intervals beside each replication's value."""
    out_dir = out_dir or rep_dir / "plots"
    files = replicated_cdfs([load_replicated(rep_dir)], out_dir / "cdf")
    return files + percentile_intervals(read_json(rep_dir / RESULT_FILE),
                                        out_dir / "intervals")


def plot_replicated_comparison(compare_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """A replicated comparison: the variants' CDFs overlaid, each with its band and
    intervals, and their headline numbers as bars with 95% intervals as error bars."""
    table = read_csv(compare_dir / COMPARISON_FILE, ["variant"])
    variants = [str(v) for v in table["variant"]]
    out_dir = out_dir or compare_dir / "plots"
    reps = [load_replicated(compare_dir / v, v) for v in variants]
    files = replicated_cdfs(reps, out_dir / "cdf")
    n = "/".join(str(r) for r in sorted(set(table.get("replications", []))))
    return files + headline_bars(table, out_dir / "headline",
                                 f"{compare_dir.name}: {n} replications per variant, "
                                 "error bars: 95% CI")
