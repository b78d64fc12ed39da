"""Comparison and capacity figures: a comparison's variants overlaid (CDFs) and their headline
numbers as bars; capacity per scenario under each SLO, and a capacity search's trials."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from sim.errors import InputError
from sim.labels import PERCENT, axis_label, label, time_unit, unit
from sim.plots.common import legend, mark_overloaded, overloaded, save
from sim.plots.run import cdfs
from sim.result_files import read_csv, read_json

HEADLINE_PANELS = (("TTFT", ("ttft_p50_s", "ttft_p99_s")), ("TBT", ("tbt_p50_s", "tbt_p99_s")),
                   ("SLO attainment", ("slo_attainment",)))


def headline_bars(table: pd.DataFrame, path: Path, title: str = "") -> list[Path]:
    """A comparison's headline numbers, one bar per variant: P50 and P99 TTFT, P50 and P99
    TBT, SLO attainment; an overloaded variant's bars hatched and its name marked. Where the
    table has a column's interval (`<column>_lo`, `<column>_hi`: a replicated comparison),
    it is drawn as an error bar; a replicated variant is marked overloaded when any of its
    replications was, with how many."""
    panels = [(name, [c for c in cols if c in table and table[c].notna().any()])
              for name, cols in HEADLINE_PANELS]
    panels = [(name, cols) for name, cols in panels if cols]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), squeeze=False)
    over, names = _overloaded_names(table)
    x = np.arange(len(table))
    for ax, (name, cols) in zip(axes[0], panels, strict=True):
        values = {c: pd.to_numeric(table[c], errors="coerce").to_numpy(float) for c in cols}
        peak = max(float(np.nanmax(v)) for v in values.values())
        shown = PERCENT if name == "SLO attainment" else time_unit(peak)
        width = 0.8 / len(cols)
        for j, c in enumerate(cols):
            pos = x + (j - (len(cols) - 1) / 2) * width
            bars = ax.bar(pos, shown.scale * values[c], width, label=label(c),
                          color=f"C{j}", yerr=_error_bars(table, c, values[c], shown.scale),
                          capsize=4)
            for bar, o in zip(bars, over, strict=True):
                if o:
                    bar.set_hatch("//")
            ax.bar_label(bars, fmt="%.3g", fontsize="x-small")
        ax.set_xticks(x, names, rotation=15, ha="right", fontsize="small")
        ax.set(ylabel=f"{name} ({shown.name})", title=name)
        if len(cols) > 1:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return save(fig, path)


def _overloaded_names(table: pd.DataFrame) -> tuple[np.ndarray, list[str]]:
    """Which variants are overloaded, and their names marked so."""
    if "overloaded_replications" in table:
        count = pd.to_numeric(table["overloaded_replications"], errors="coerce").fillna(0)
        over = (count > 0).to_numpy(bool)
        of = table["replications"] if "replications" in table else ["?"] * len(table)
        names = [f"{v}\n(overloaded in {int(k)} of {n})" if k else str(v)
                 for v, k, n in zip(table["variant"], count, of, strict=True)]
        return over, names
    over = overloaded(table).to_numpy(bool)
    return over, [f"{v}\n(overloaded)" if o else str(v)
                  for v, o in zip(table["variant"], over, strict=True)]


def _error_bars(table: pd.DataFrame, column: str, values: np.ndarray, scale: float
                ) -> np.ndarray | None:
    """Distances from each bar's top to its interval's ends; none where the table has no
    interval for `column`, zero where a variant has none (its replications all equal)."""
    if f"{column}_lo" not in table or f"{column}_hi" not in table:
        return None
    lo, hi = (pd.to_numeric(table[f"{column}_{end}"], errors="coerce").to_numpy(float)
              for end in ("lo", "hi"))
    below = np.nan_to_num(values - lo, nan=0.0).clip(min=0.0)
    above = np.nan_to_num(hi - values, nan=0.0).clip(min=0.0)
    return scale * np.vstack([below, above])


def plot_comparison(compare_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """A comparison's variants: their TTFT and TBT CDFs overlaid, and their headline numbers."""
    table = read_csv(compare_dir / "comparison.csv", ["variant"])
    variants = [str(v) for v in table["variant"]]
    out_dir = out_dir or compare_dir / "plots"
    files = cdfs([compare_dir / v for v in variants], out_dir / "cdf", variants)
    return files + headline_bars(table, out_dir / "headline", compare_dir.name)


def _slo_name(targets_s: dict[str, float]) -> str:
    """SLO targets by their labels: {"tbt_p99_s": 0.05} -> "P99 TBT <= 50 ms"."""
    return ", ".join(f"{label(k)} <= {unit(k).scale * v:g} {unit(k).name}".strip()
                     for k, v in targets_s.items())


def capacity_bars(capacities: dict[str, dict[str, float]], path: Path,
                  ci95: dict[str, dict[str, tuple[float, float | None]]] | None = None
                  ) -> list[Path]:
    """Capacity per scheduler under each SLO (Sarathi-Serve's figure): {slo: {scheduler: qps}},
    with 95% confidence intervals as error bars where `ci95` has them."""
    fig, ax = plt.subplots(figsize=(7, 4))
    slos = list(capacities)
    schedulers = sorted({s for per in capacities.values() for s in per})
    width = 0.8 / max(3, len(schedulers))  # a lone bar does not fill the figure
    for j, scheduler in enumerate(schedulers):
        values = np.array([capacities[slo].get(scheduler, 0.0) for slo in slos])
        spans = [(ci95 or {}).get(slo, {}).get(scheduler) for slo in slos]
        # an upper end None is unbounded (no rate probed failed): no upper whisker
        err = np.array([[v - s[0], 0.0 if s[1] is None else s[1] - v] if s else [0.0, 0.0]
                        for v, s in zip(values, spans, strict=True)]).T
        x = np.arange(len(slos)) + (j - (len(schedulers) - 1) / 2) * width
        bars = ax.bar(x, values, width, label=scheduler, yerr=err if ci95 else None,
                      capsize=4)
        ax.bar_label(bars, fmt="%.3g", fontsize="x-small", label_type="center")
    ax.set_xticks(np.arange(len(slos)), slos)
    ax.set(ylabel=axis_label("capacity_qps"), title="capacity under SLO (95% CI)" if ci95
           else "capacity under SLO", xlim=(-0.5, len(slos) - 0.5))
    legend(ax)
    return save(fig, path)


RATIO_SHOWN_MAX = 3.0  # metric / target drawn up to this; anything worse on the top line


def capacity_trials(trials: pd.DataFrame, result: dict[str, Any], path: Path) -> list[Path]:
    """Each trial of a capacity search: its rate, and each target's metric over the target
    (at most 1: met; worse than 3x drawn on the top line); met hollow, violated filled,
    overloaded runs ringed red; the capacity and its 95% CI."""
    fig, ax = plt.subplots(figsize=(8.5, 4))
    labelled: list[bool] = []
    rate = trials["qps"].to_numpy()
    ok = trials["ok"].to_numpy(dtype=bool)
    for i, (name, target) in enumerate(result["targets_s"].items()):
        if name not in trials or trials[name].isna().all():
            continue
        ratio = np.minimum(trials[name].fillna(0.0).to_numpy() / target, RATIO_SHOWN_MAX)
        text = _slo_name({name: target})
        ax.scatter(rate[ok], ratio[ok], facecolors="none", edgecolors=f"C{i}",
                   label=f"{text}: met")
        ax.scatter(rate[~ok], ratio[~ok], color=f"C{i}", label=f"{text}: missed")
        mark_overloaded(ax, rate, ratio, overloaded(trials).to_numpy(dtype=bool), labelled)
    low, high = result["ci95_qps"]
    if high is None:  # unbounded: no rate probed failed; shade up to the highest probed
        high = max(float(rate.max()) if len(rate) else low, low)
    ax.axvspan(low, high, color="grey", alpha=0.2)
    ax.axvline(result["capacity_qps"], color="black", linestyle="--",
               label=f"capacity {result['capacity_qps']:.3g} req/s")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_yticks([0, 0.5, 1, 2, RATIO_SHOWN_MAX],
                  ["0", "0.5", "1 (target)", "2", f"{RATIO_SHOWN_MAX:g} or more"])
    ax.set(xlabel=axis_label("qps"), ylabel="metric / target",
           ylim=(-0.1, RATIO_SHOWN_MAX * 1.1), title=f"capacity search: {result['scenario']}")
    legend(ax)
    return save(fig, path)


def plot_capacity(dirs: Sequence[Path], out_dir: Path | None = None) -> list[Path]:
    """Capacity searches: the bars of each (grouped by SLO targets, one bar per scenario) and,
    for one search, its trials."""
    out_dir = out_dir or dirs[0] / "plots"
    means: dict[str, dict[str, float]] = {}
    spans: dict[str, dict[str, tuple[float, float | None]]] = {}
    results = [read_json(d / "capacity.json", missing="the capacity search has not finished")
               for d in dirs]
    for d, result in zip(dirs, results, strict=True):
        try:
            slo = _slo_name(result["targets_s"])
            means.setdefault(slo, {})[result["scenario"]] = float(result["capacity_qps"])
            spans.setdefault(slo, {})[result["scenario"]] = tuple(result["ci95_qps"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise InputError(d / "capacity.json", "<file>", str(d / "capacity.json"),
                             "not a capacity result (missing or malformed fields)") from None
    files = capacity_bars(means, out_dir / "capacity", spans)
    if len(dirs) == 1:
        trials = read_csv(dirs[0] / "trials.csv", ["qps", "ok"])
        files += capacity_trials(trials, results[0], out_dir / "capacity_trials")
    return files
