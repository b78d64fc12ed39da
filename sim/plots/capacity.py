"""Capacity figures: the capacity of each scenario under each SLO as bars (total or per GPU),
with the search's own interval as error bars, named by what it is (a confidence bound, or a
deterministic replay's bisection bracket); and one search's trials."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from textwrap import fill
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from sim.config.errors import InputError
from sim.plots.common import legend, mark_overloaded, overloaded, save
from sim.results.labels import axis_label, capacity_interval, slo_targets
from sim.results.read import read_csv, read_json

Span = tuple[float, float | None]  # an interval's ends; the upper None: unbounded


def capacity_bars(capacities: Mapping[str, Mapping[str, float]], path: Path,
                  intervals: Mapping[str, Mapping[str, Span]] | None = None, *,
                  interval: str | Mapping[str, str] = "95% CI", per_gpu: bool = False
                  ) -> list[Path]:
    """Capacity per scenario under each SLO (Sarathi-Serve's figure): {slo: {scenario: qps}},
    with `intervals` ({slo: {scenario: (low, high)}}) as error bars, said to be `interval` (a
    search's own kind of interval, `sim.results.labels.capacity_interval`): in the title, or, given
    per scenario, in the legend. An upper end None is unbounded (no rate probed failed): no
    upper whisker, its number shown as `>=`. `per_gpu`: the values are per GPU, as the axis
    says."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    slos = list(capacities)
    scenarios = sorted({s for per in capacities.values() for s in per})
    series = {s: _series(capacities, intervals or {}, s, slos) for s in scenarios}
    top = max(float(np.max(v + e[1], initial=0.0)) for v, e, _ in series.values())
    width = 0.8 / max(3, len(scenarios))  # a lone bar does not fill the figure
    for j, (scenario, (values, err, texts)) in enumerate(series.items()):
        x = np.arange(len(slos)) + (j - (len(scenarios) - 1) / 2) * width
        name = scenario if isinstance(interval, str) or not intervals else \
            f"{scenario}\n(error bar: {interval.get(scenario, '?')})"
        bars = ax.bar(x, values, width, label=name, yerr=err if intervals else None,
                      capsize=4)
        # a number inside its bar, clear of the error bar's caps; a bar too short to hold
        # it has it above its error bar instead
        tall = values >= SHORT_BAR * top
        ax.bar_label(bars, [t if k else "" for t, k in zip(texts, tall, strict=True)],
                     fontsize="x-small", label_type="center")
        ax.bar_label(bars, [t if not k else "" for t, k in zip(texts, tall, strict=True)],
                     fontsize="x-small", padding=3)
    ax.set_xticks(np.arange(len(slos)), [slo.replace(", ", ",\n") for slo in slos])
    title = "capacity per GPU under SLO" if per_gpu else "capacity under SLO"
    ax.set(ylabel=axis_label("capacity_qps_per_gpu" if per_gpu else "capacity_qps"),
           title=f"{title}\n{fill(f'error bars: {interval}', 60)}" if intervals and
           isinstance(interval, str) else title,
           xlim=(-0.5, len(slos) - 0.5), ylim=(0, 1.1 * top or 1.0))
    legend(ax)
    return save(fig, path)


SHORT_BAR = 0.15  # of the axis: a bar lower than this has its number above it


def _series(capacities: Mapping[str, Mapping[str, float]],
            intervals: Mapping[str, Mapping[str, Span]], scenario: str, slos: list[str]
            ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """One scenario's capacities across the SLOs, its error bars (distances below and above;
    none above an unbounded end) and its numbers (`>=` where unbounded)."""
    values = np.array([capacities[slo].get(scenario, 0.0) for slo in slos])
    spans = [intervals.get(slo, {}).get(scenario) for slo in slos]
    err = np.array([[v - s[0], 0.0 if s[1] is None else s[1] - v] if s else [0.0, 0.0]
                    for v, s in zip(values, spans, strict=True)]).T.clip(min=0.0)
    texts = [f"{'>=' if s and s[1] is None else ''}{v:.3g}"
             for v, s in zip(values, spans, strict=True)]
    return values, err.reshape(2, len(slos)), texts


def _entry(result: Mapping[str, Any], per_gpu: bool) -> tuple[str, str, float, Span]:
    """(SLO, scenario, capacity, interval) of one search's result; per GPU: over `num_gpus`."""
    low, high = result.get("interval_qps") or result["ci95_qps"]
    gpus = float(result["num_gpus"]) if per_gpu else 1.0
    value = result["capacity_qps_per_gpu"] if per_gpu else result["capacity_qps"]
    return (slo_targets(result["targets_s"]), str(result["scenario"]), float(value),
            (float(low) / gpus, None if high is None else float(high) / gpus))


def capacity_figure(results: Sequence[Mapping[str, Any]], path: Path, *,
                    per_gpu: bool = False) -> list[Path]:
    """Capacity searches' results (`capacity.json`, or what `sim.studies.capacity.capacity` returns
    with `targets_s` and `scenario` added) as bars grouped by SLO, one per scenario, their own
    intervals as error bars; `per_gpu`: `capacity_qps_per_gpu`, the interval over `num_gpus`."""
    values: dict[str, dict[str, float]] = {}
    spans: dict[str, dict[str, Span]] = {}
    for result in results:
        slo, name, value, span = _entry(result, per_gpu)
        values.setdefault(slo, {})[name] = value
        spans.setdefault(slo, {})[name] = span
    kinds = {str(r["scenario"]): capacity_interval(r) for r in results}
    shared = set(kinds.values())
    return capacity_bars(values, path, spans, interval=shared.pop() if len(shared) == 1
                         else kinds, per_gpu=per_gpu)


RATIO_SHOWN_MAX = 3.0  # metric / target drawn up to this; anything worse on the top line


def capacity_trials(trials: pd.DataFrame, result: dict[str, Any], path: Path) -> list[Path]:
    """Each trial of a capacity search: its rate, and each target's metric over the target
    (at most 1: met; worse than 3x drawn on the top line); met hollow, violated filled,
    overloaded runs ringed red; the capacity and its interval (named by what it is)."""
    fig, ax = plt.subplots(figsize=(8.5, 4))
    labelled: list[bool] = []
    rate = trials["qps"].to_numpy()
    ok = trials["ok"].to_numpy(dtype=bool)
    for i, (name, target) in enumerate(result["targets_s"].items()):
        if name not in trials or trials[name].isna().all():
            continue
        ratio = np.minimum(trials[name].fillna(0.0).to_numpy() / target, RATIO_SHOWN_MAX)
        text = slo_targets({name: target})
        ax.scatter(rate[ok], ratio[ok], facecolors="none", edgecolors=f"C{i}",
                   label=f"{text}: met")
        ax.scatter(rate[~ok], ratio[~ok], color=f"C{i}", label=f"{text}: missed")
        mark_overloaded(ax, rate, ratio, overloaded(trials).to_numpy(dtype=bool), labelled)
    low, high = result.get("interval_qps") or result["ci95_qps"]
    if high is None:  # unbounded: no rate probed failed; shade up to the highest probed
        high = max(float(rate.max()) if len(rate) else low, low)
    ax.axvspan(low, high, color="grey", alpha=0.2, label=capacity_interval(result))
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
    """Capacity searches: the bars of each (grouped by SLO targets, one bar per scenario),
    per GPU as well where a search's cluster has several GPUs, and, for one search, its
    trials."""
    out_dir = out_dir or dirs[0] / "plots"
    results = [read_json(d / "capacity.json", missing="the capacity search has not finished")
               for d in dirs]
    names = [str(r.get("scenario")) for r in results]
    results = [{**r, "scenario": f"{r.get('scenario')} ({d.name})"} if names.count(
        str(r.get("scenario"))) > 1 else r for d, r in zip(dirs, results, strict=True)]
    per_gpu = all("capacity_qps_per_gpu" in r and "num_gpus" in r for r in results) and any(
        r["num_gpus"] != 1 for r in results)
    for d, result in zip(dirs, results, strict=True):
        try:  # each file checked alone, so that the error names the one that is wrong
            _entry(result, per_gpu)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise InputError(d / "capacity.json", "<file>", str(d / "capacity.json"),
                             "not a capacity result (missing or malformed fields)") from None
    files = capacity_figure(results, out_dir / "capacity")
    if per_gpu:
        files += capacity_figure(results, out_dir / "capacity_per_gpu", per_gpu=True)
    if len(dirs) == 1:
        trials = read_csv(dirs[0] / "trials.csv", ["qps", "ok"])
        if "latency_scale" in trials:  # the band's ends searched too: the nominal runs only
            trials = trials[trials["latency_scale"] == 1.0].reset_index(drop=True)
        files += capacity_trials(trials, results[0], out_dir / "capacity_trials")
    return files
