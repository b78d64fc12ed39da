"""A run's figures: CDFs of TTFT and of every TBT gap (with a log view of the tail) and an
iteration timeline of a chosen window (the busiest by default), every pool shown."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D

from sim.plots.common import log_time_axis, save
from sim.results.labels import MS, Unit, label, time_unit
from sim.results.metrics.summary import WeightedSample
from sim.results.run_dir import Results

MARKERS = {"p50": ("o", 0.5), "p99": ("D", 0.99)}


@dataclass(frozen=True)
class Sample:
    """One run's values for a CDF: as weighted values, their summary percentiles (what the
    tables print), and what they are (`tbt_s`, or `max_tbt_per_request_s` where the run's
    files cannot give every gap)."""

    values: WeightedSample
    p50: float | None
    p99: float | None
    key: str


def tbt_sample(run: Results) -> Sample:
    """Every TBT gap of a run: from `tbt_gaps.parquet` (every run writes it) or, for a run
    written before it existed, `tokens.parquet`; failing both, each request's worst gap, which
    the figure then names as such."""
    expected = run.summary.get("tbt_s") or {}
    gaps, tokens = run.tbt_gaps, run.tokens
    if gaps is not None:
        sample = WeightedSample(gaps["gap_s"].to_numpy(float), gaps["count"].to_numpy(np.int64))
    elif tokens is not None:
        sample = WeightedSample.of(tokens.groupby("request_id")["time_s"].diff().dropna())
    else:
        return tbt_sample_worst(run)
    return Sample(sample, expected.get("p50"), expected.get("p99"), "tbt_s")


def ttft_sample(run: Results) -> Sample:
    """Finished requests' TTFT (the population of the summary's TTFT row)."""
    req = run.requests
    values = req.loc[req["status"] == "finished", "ttft_s"].dropna()
    ttft = run.summary.get("ttft_s") or {}
    return Sample(WeightedSample.of(values), ttft.get("p50"), ttft.get("p99"), "ttft_s")


def slo_targets_s(run: Results) -> dict[str, float]:
    """The run's SLO targets in seconds, from its resolved scenario (`ttft_s`, `tbt_s`)."""
    slo = run.scenario.slo
    return {k: float(v) for k, v in (("ttft_s", slo.ttft_s), ("tbt_s", slo.tbt_s))
            if v is not None}


def _cdf_pair(top: Any, tail: Any, samples: list[Sample], names: list[str], shown: Unit,
              slo_s: set[float]) -> None:
    """One quantity: its CDF above, the fraction above each value (log) below; P50 and P99
    marked on each curve, SLOs as red lines."""
    scale = shown.scale
    drawn = 0
    for i, (s, name) in enumerate(zip(samples, names, strict=True)):
        keep = s.values.counts > 0
        x, w = scale * s.values.values[keep], s.values.counts[keep].astype(float)
        if not x.size:
            continue
        drawn += 1
        top.ecdf(x, weights=w, label=name, color=f"C{i}")
        tail.ecdf(x, weights=w, complementary=True, color=f"C{i}")
        for p, (marker, q) in MARKERS.items():
            v = getattr(s, p)
            if v is not None:
                top.plot(scale * v, q, marker=marker, color=f"C{i}", markeredgecolor="black")
                tail.plot(scale * v, 1 - q, marker=marker, color=f"C{i}",
                          markeredgecolor="black")
    largest = max((int(s.values.counts.sum()) for s in samples), default=1)
    cdf_axes(top, tail, shown, slo_s, largest, empty=not drawn)


def cdf_axes(top: Any, tail: Any, shown: Unit, slo_s: set[float], largest: int, *,
             empty: bool = False) -> None:
    """A CDF's axes: SLOs as red lines, log time axes, the tail's fraction above on a log
    scale down to one in `largest` (the most values one curve has). `empty`: no curve was
    drawn (nothing finished, no request made two tokens), which the panel says."""
    for limit in sorted(slo_s):
        for ax in (top, tail):
            ax.axvline(shown.scale * limit, color="red", linestyle="--", linewidth=1,
                       label=f"SLO {shown.scale * limit:g} {shown.name}" if ax is top else None)
    for ax in (top, tail):
        if empty:  # a log axis over no data would have no range
            marks = [shown.scale * limit for limit in slo_s] or [1.0]
            ax.set_xlim(0.5 * min(marks), 2 * max(marks))
            ax.text(0.5, 0.5, "no values in these runs", transform=ax.transAxes,
                    ha="center", va="center", color="0.4")
        ax.set_xscale("log")
        log_time_axis(ax.xaxis)
    tail.set_yscale("log")
    tail.set_ylim(0.5 / max(largest, 1), 1.5)  # 1-F's last step is rounding, not a value
    top.set_ylabel("fraction at or below")
    tail.set_ylabel("fraction above")


def cdfs(runs: Sequence[Results], path: Path, labels: Sequence[str], *,
         worst_tbt: bool = False) -> list[Path]:
    """TTFT and TBT (every gap; each request's worst gap with `worst_tbt`) CDFs of runs, each
    over a log view of its tail (fraction above, log scale); P50 (circle) and P99 (diamond)
    marked; the scenarios' SLOs as red lines; an overloaded run's label says so. The runs are
    read (and checked) by the caller: `Results.load`."""
    names, ttfts, tbts, slos = [], [], [], []
    for name, run in zip(labels, runs, strict=True):
        if (run.summary.get("overload") or {}).get("verdict") == "overloaded":
            name += " (overloaded)"
        names.append(name)
        ttfts.append(ttft_sample(run))
        tbts.append(tbt_sample(run))
        slos.append(slo_targets_s(run))
    if worst_tbt or any(s.key != "tbt_s" for s in tbts):  # one quantity for all, titled
        tbts = [tbt_sample_worst(run) for run in runs]
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5), sharex="col",
                             gridspec_kw={"height_ratios": (3, 2)})
    peak = max((float(s.values.values.max()) for s in ttfts if s.values.values.size),
               default=0.0)
    shown = time_unit(peak)
    _cdf_pair(axes[0, 0], axes[1, 0], ttfts, names, shown,
              {s["ttft_s"] for s in slos if "ttft_s" in s})
    _cdf_pair(axes[0, 1], axes[1, 1], tbts, names, MS,
              {s["tbt_s"] for s in slos if "tbt_s" in s})
    what = label(tbts[0].key) if tbts else "TBT"
    axes[0, 0].set_title("TTFT (finished requests)")
    axes[0, 1].set_title(f"{what}, every gap" if tbts and tbts[0].key == "tbt_s"
                         else what if worst_tbt
                         else f"{what} (these runs keep no gaps: written before tbt_gaps)")
    axes[1, 0].set_xlabel(f"TTFT ({shown.name})")
    axes[1, 1].set_xlabel(f"{what} ({MS.name})")
    marks = [Line2D([], [], marker=m, color="grey", markeredgecolor="black", linestyle="none",
                    label=p.upper()) for p, (m, _) in MARKERS.items()]
    handles, texts = axes[0, 1].get_legend_handles_labels()
    axes[0, 1].legend(handles + marks, texts + [h.get_label() for h in marks],
                      fontsize="small", loc="lower right")
    # The TTFT panel's SLO line is named on its own panel: the legend above names only TBT's.
    slo = [(h, t) for h, t in zip(*axes[0, 0].get_legend_handles_labels(), strict=True)
           if t.startswith("SLO ")]
    if slo:
        axes[0, 0].legend(*zip(*slo, strict=True), fontsize="small", loc="upper left")
    return save(fig, path)


def tbt_sample_worst(run: Results) -> Sample:
    """Each finished request's worst gap, with the summary's percentiles of it."""
    req = run.requests
    done = req.loc[req["status"] == "finished", "max_tbt_s"].dropna()
    per = run.summary.get("max_tbt_per_request_s") or {}
    return Sample(WeightedSample.of(done), per.get("p50"), per.get("p99"),
                  "max_tbt_per_request_s")
