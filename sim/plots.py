"""Figures, drawn from result files only (a run's directory, a sweep's table, a comparison's
variants, a capacity search's trials). Each is written as PNG and SVG, titled, with units on the
axes; overloaded runs are marked. `plot_results` draws what a directory's own kind supports;
unreadable files are one-line `InputError`s.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from sim.errors import InputError  # noqa: E402
from sim.outdir import check_writable_dir  # noqa: E402
from sim.result_files import (  # noqa: E402
    directory_kind,
    read_csv,
    read_json,
    read_parquet,
    read_yaml_file,
)
from sim.sweep import CI_TABLES, METRICS, short_value  # noqa: E402

OVERLOADED = {"marker": "o", "markersize": 11, "markerfacecolor": "none",
              "markeredgecolor": "red", "markeredgewidth": 1.5, "linestyle": "none"}


def save(fig: Any, path: Path) -> list[Path]:
    """Write `path` as .png and .svg; return both."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    out = [path.with_suffix(".png"), path.with_suffix(".svg")]
    for p in out:
        fig.savefig(p, dpi=120)
    plt.close(fig)
    return out


def _mark_overloaded(ax: Any, x: np.ndarray, y: np.ndarray, over: np.ndarray,
                     labelled: list[bool]) -> None:
    """Ring the overloaded points red; one legend entry for all of them."""
    if over.any():
        ax.plot(x[over], y[over], label="overloaded" if not labelled else None, **OVERLOADED)
        labelled.append(True)


def _legend(ax: Any, title: str | None = None) -> None:
    """Beside the axes (lines of a sweep would hide behind it), `overloaded` last."""
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i] == "overloaded")
    ax.legend([handles[i] for i in order], [labels[i] for i in order], title=title,
              fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _overloaded(part: pd.DataFrame) -> pd.Series:
    if "overload" not in part:
        return pd.Series(False, index=part.index)
    return part["overload"] == "overloaded"


BAND_ALPHA = 0.2  # the 95% interval band around a sweep's line


def _ci_lines(ci: pd.DataFrame, group: str) -> list[tuple[str, pd.DataFrame]]:
    """A sweep's interval table (`results_ci`) as lines: one per value of `group`, or one in
    all where the lines would be seeds (each row of the table is already over the seeds)."""
    if group == "seed" or group not in ci:
        return [(f"mean of {int(ci['num_seeds'].max())} seeds", ci)]
    return [(short_value(key), part) for key, part in ci.groupby(group, sort=True)]


def _band_line(ax: Any, x: np.ndarray, y: np.ndarray, lo: np.ndarray, hi: np.ndarray,
               label: str) -> None:
    """The estimate's line and, shaded in its colour, its 95% interval; a point without an
    interval (its seeds all equal) is drawn with zero width there."""
    (line,) = ax.plot(x, y, marker="o", label=label)
    lo, hi = np.where(np.isnan(lo), y, lo), np.where(np.isnan(hi), y, hi)
    ax.fill_between(x, lo, hi, color=line.get_color(), alpha=BAND_ALPHA, linewidth=0)


def _ci_title(title: str, ci: pd.DataFrame) -> str:
    return f"{title}: mean of {int(ci['num_seeds'].max())} seeds, band 95% CI"


def _ci_columns(part: pd.DataFrame, metric: str, scale: float) -> tuple[np.ndarray, ...]:
    return tuple(scale * pd.to_numeric(part[c], errors="coerce").to_numpy(dtype=float)
                 for c in (metric, f"{metric}_lo", f"{metric}_hi"))


def _ci_band_lines(ax: Any, ci: pd.DataFrame, group: str, x_column: str, metric: str,
                   labelled: list[bool]) -> None:
    """One line per value of `group` from the sweep's interval table: `metric` (in ms)
    against `x_column`, its 95% interval as a band, overloaded points ringed."""
    for label, part in _ci_lines(ci, group):
        part = part.sort_values(x_column)
        x = pd.to_numeric(part[x_column], errors="coerce").to_numpy(float)
        y, lo, hi = _ci_columns(part, metric, 1e3)
        _band_line(ax, x, y, lo, hi, label)
        _mark_overloaded(ax, x, y, (part["num_overloaded"] > 0).to_numpy(dtype=bool), labelled)


def p99_tbt_vs_load(table: pd.DataFrame, load: str, group: str, path: Path, *,
                    slo_s: float | None = None, title: str = "P99 TBT vs load",
                    ci: pd.DataFrame | None = None) -> list[Path]:
    """P99 TBT (mean over seeds) against `load`, one line per value of `group`; a point is
    ringed red when any of its seeds' runs is overloaded. With `ci` (the sweep's interval
    table, several seeds a point) each line from it, with its 95% interval as a band."""
    fig, ax = plt.subplots(figsize=(8, 4))
    labelled: list[bool] = []
    if ci is not None:
        _ci_band_lines(ax, ci, group, load, "tbt_p99_s", labelled)
        title = _ci_title(title, ci)
    else:
        for key, part in table.groupby(group, sort=True):
            numbers = pd.to_numeric(part["tbt_p99_s"], errors="coerce")  # None: no gap at all
            by_load = part.assign(_over=_overloaded(part), tbt_p99_s=numbers).groupby(load)
            mean = by_load["tbt_p99_s"].mean().sort_index()
            over = by_load["_over"].any().reindex(mean.index).to_numpy(dtype=bool)
            x, y = mean.index.to_numpy(), 1e3 * mean.to_numpy()
            ax.plot(x, y, marker="o", label=short_value(key))
            _mark_overloaded(ax, x, y, over, labelled)
    if slo_s is not None:
        ax.axhline(1e3 * slo_s, color="red", linestyle="--", label=f"SLO {1e3 * slo_s:g} ms")
    ax.set(xlabel=load, ylabel="P99 TBT (ms)", title=title)
    _legend(ax, group if ci is None or group in ci else None)
    return save(fig, path)


def latency_vs_throughput(table: pd.DataFrame, group: str, path: Path,
                          metric: str = "tbt_p99_s", ci: pd.DataFrame | None = None
                          ) -> list[Path]:
    """`metric` against output throughput, one line per value of `group`. With `ci` (the
    sweep's interval table) each point is a point's mean over its seeds, with the 95%
    interval of `metric` as a band."""
    fig, ax = plt.subplots(figsize=(8, 4))
    labelled: list[bool] = []
    title = "latency vs throughput"
    if ci is not None:
        _ci_band_lines(ax, ci, group, "output_tokens_per_s", metric, labelled)
        title = _ci_title(title, ci)
    else:
        for key, part in table.groupby(group, sort=True):
            part = part.sort_values("output_tokens_per_s")
            x, y = (pd.to_numeric(part[c], errors="coerce").to_numpy(dtype=float)
                    for c in ("output_tokens_per_s", metric))
            y = 1e3 * y
            ax.plot(x, y, marker="o", label=short_value(key))
            _mark_overloaded(ax, x, y, _overloaded(part).to_numpy(dtype=bool), labelled)
    name = metric.removesuffix("_s").split("_")  # tbt_p99 -> P99 TBT
    ax.set(xlabel="throughput (output tokens/s)",
           ylabel=f"{' '.join(w.upper() for w in reversed(name))} (ms)", title=title)
    _legend(ax, group if ci is None or group in ci else None)
    return save(fig, path)


def cdfs(run_dirs: Sequence[Path], path: Path, labels: Sequence[str] | None = None
         ) -> list[Path]:
    """TTFT and TBT CDFs of runs (TBT from tokens.parquet if the run recorded token times,
    else each request's worst gap); an overloaded run's label says so."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    tbt_label = "TBT, every gap (ms)"
    for i, run in enumerate(run_dirs):
        label = labels[i] if labels else run.name
        if (read_json(run / "summary.json").get("overload") or {}).get("verdict") == "overloaded":
            label += " (overloaded)"
        req = read_parquet(run / "requests.parquet", ["ttft_s", "max_tbt_s"])
        _cdf(left, 1e3 * req["ttft_s"].dropna().to_numpy(), label)
        scenario = read_yaml_file(run / "scenario.yaml")
        if isinstance(scenario, dict) and scenario.get("record_token_times"):
            t = read_parquet(run / "tokens.parquet", ["request_id", "time_s"])
            gaps = t.groupby("request_id")["time_s"].diff().dropna().to_numpy()
        else:
            gaps = req["max_tbt_s"].dropna().to_numpy()
            tbt_label = "worst TBT per request (ms)"
        _cdf(right, 1e3 * gaps, label)
    left.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF", xscale="log")
    right.set(xlabel=tbt_label, ylabel="fraction", title="TBT CDF", xscale="log")
    left.legend()
    return save(fig, path)


def _cdf(ax: Any, values: np.ndarray, label: str) -> None:
    values = np.sort(values[values > 0])
    if values.size:
        ax.plot(values, np.arange(1, values.size + 1) / values.size, label=label)


def capacity_bars(capacities: dict[str, dict[str, float]], path: Path,
                  ci95: dict[str, dict[str, tuple[float, float | None]]] | None = None
                  ) -> list[Path]:
    """Capacity per scheduler under each SLO (Sarathi-Serve's figure): {slo: {scheduler: qps}},
    with 95% confidence intervals as error bars where `ci95` has them."""
    fig, ax = plt.subplots(figsize=(6, 4))
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
        ax.bar(x, values, width, label=scheduler, yerr=err if ci95 else None, capsize=4)
    ax.set_xticks(np.arange(len(slos)), slos)
    ax.set(ylabel="capacity (requests/s)", title="capacity under SLO (95% CI)" if ci95
           else "capacity under SLO", xlim=(-0.5, len(slos) - 0.5))
    ax.legend()
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
        label = f"{name.removesuffix('_s')} / {target:g} s"
        ax.scatter(rate[ok], ratio[ok], facecolors="none", edgecolors=f"C{i}",
                   label=f"{label}: SLOs met")
        ax.scatter(rate[~ok], ratio[~ok], color=f"C{i}", label=f"{label}: SLO missed")
        _mark_overloaded(ax, rate, ratio, _overloaded(trials).to_numpy(dtype=bool), labelled)
    low, high = result["ci95_qps"]
    if high is None:  # unbounded: no rate probed failed; shade up to the highest probed
        high = max(float(rate.max()) if len(rate) else low, low)
    ax.axvspan(low, high, color="grey", alpha=0.2)
    ax.axvline(result["capacity_qps"], color="black", linestyle="--",
               label=f"capacity {result['capacity_qps']:.3g} req/s")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_yticks([0, 0.5, 1, 2, RATIO_SHOWN_MAX],
                  ["0", "0.5", "1 (target)", "2", f"{RATIO_SHOWN_MAX:g} or more"])
    ax.set(xlabel="arrival rate (requests/s)", ylabel="metric / target",
           ylim=(-0.1, RATIO_SHOWN_MAX * 1.1), title=f"capacity search: {result['scenario']}")
    _legend(ax)
    return save(fig, path)


def iteration_timeline(run_dir: Path, path: Path, replica_id: int = 0,
                       window_s: tuple[float, float] | None = None) -> list[Path]:
    """Each iteration's prefill and decode tokens over time (one replica)."""
    its = read_parquet(run_dir / "iterations.parquet", ["replica_id", "start_s", "duration_s",
                                                        "num_decode_tokens",
                                                        "num_prefill_tokens"])
    its = its[its["replica_id"] == replica_id]
    if window_s is not None:
        its = its[(its["start_s"] >= window_s[0]) & (its["start_s"] < window_s[1])]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(its["start_s"], its["num_decode_tokens"], width=its["duration_s"], align="edge",
           label="decode tokens", color="tab:blue")
    ax.bar(its["start_s"], its["num_prefill_tokens"], width=its["duration_s"], align="edge",
           bottom=its["num_decode_tokens"], label="prefill tokens", color="tab:orange")
    ax.set(xlabel="time (s)", ylabel="tokens in the iteration",
           title=f"iterations of replica {replica_id}")
    ax.legend()
    return save(fig, path)


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """The figures one run's files support: CDFs and the iteration timeline."""
    out_dir = out_dir or run_dir / "plots"
    its = read_parquet(run_dir / "iterations.parquet", ["start_s"])
    start = float(its["start_s"].min()) if len(its) else 0.0
    files = cdfs([run_dir], out_dir / "cdf")
    files += iteration_timeline(run_dir, out_dir / "timeline", window_s=(start, start + 5.0))
    return files


def plot_sweep(sweep_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """The figures a sweep's table supports: P99 TBT vs the first varied field, per the
    second (if any), and latency vs throughput; with the sweep's interval table
    (`results_ci`, several seeds a point) each line is the mean over seeds with a 95% band."""
    table = read_parquet(sweep_dir / "results.parquet", ["seed", "key", "tbt_p99_s",
                                                         "output_tokens_per_s"],
                         missing="the sweep has not finished: run it again to complete it")
    out_dir = out_dir or sweep_dir / "plots"
    varied = [c for c in table.columns if c not in {"seed", "key"} and c not in METRICS]
    if not varied or table.empty:
        return []
    load = varied[0]
    group = varied[1] if len(varied) > 1 else "seed"
    scenario = sweep_dir / "runs" / str(table["key"].iloc[0]) / "scenario.yaml"
    data = read_yaml_file(scenario) if scenario.is_file() else {}
    slo_s = ((data if isinstance(data, dict) else {}).get("slo") or {}).get("tbt_s")
    ci = None
    if (sweep_dir / CI_TABLES[1]).is_file():  # several seeds a point: draw the intervals
        ci = read_parquet(sweep_dir / CI_TABLES[0],
                          [load, "num_seeds", "num_overloaded", "output_tokens_per_s",
                           "tbt_p99_s", "tbt_p99_s_lo", "tbt_p99_s_hi"])
    files = p99_tbt_vs_load(table, load, group, out_dir / "p99_tbt_vs_load", slo_s=slo_s,
                            ci=ci)
    files += latency_vs_throughput(table, group, out_dir / "latency_vs_throughput", ci=ci)
    return files


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
            slo = ", ".join(f"{k.removesuffix('_s')} {v:g} s"
                            for k, v in result["targets_s"].items())
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


def plot_comparison(compare_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """A comparison's variants: their TTFT and TBT CDFs in one figure."""
    table = read_csv(compare_dir / "comparison.csv", ["variant"])
    variants = [str(v) for v in table["variant"]]
    return cdfs([compare_dir / v for v in variants], (out_dir or compare_dir / "plots") / "cdf",
                variants)


def plot_results(dirs: Sequence[Path], out_dir: Path | None = None) -> list[Path]:
    """Draw what the directories' own kind supports; several only for capacity searches."""
    if out_dir is not None:
        check_writable_dir(out_dir)
    kinds = [directory_kind(d) for d in dirs]
    if len(dirs) > 1 and set(kinds) != {"capacity"}:
        raise InputError(None, "RESULTS", [str(d) for d in dirs],
                         "several directories are drawn together only for capacity searches")
    draw = {"run": plot_run, "sweep": plot_sweep, "comparison": plot_comparison}
    if kinds[0] == "capacity":
        return plot_capacity(dirs, out_dir)
    return draw[kinds[0]](dirs[0], out_dir)
