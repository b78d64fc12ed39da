"""Sweep figures: P99 TBT and TTFT (P50, P99) against the swept field, one line per value of
the other, and latency against throughput; overloaded points ringed, 95% bands over seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from sim.plots.common import (
    band_line,
    groups,
    legend,
    log_time_axis,
    mark_overloaded,
    overloaded,
    positions,
    save,
    swept_axis,
)
from sim.results.formats import CI_TABLES, METRICS
from sim.results.labels import (
    MS,
    axis_label,
    is_load,
    label,
    natural_key,
    param_label,
    time_unit,
    unit,
    variant_label,
)
from sim.results.read import read_parquet, read_yaml_file

PERCENTILE_STYLES = {"p99": "-", "p50": "--"}


def _lines(table: pd.DataFrame, x_column: str, group: str, metric: str,
           ci: pd.DataFrame | None) -> list[dict[str, Any]]:
    """One line per value of `group`: x (positions), y, interval ends and overloaded points
    (any seed's run overloaded); from the interval table when there is one."""
    source = ci if ci is not None else table
    parts = _split(source, group)
    x_all, names = positions(source[x_column])
    x_of = pd.Series(x_all, index=source.index)
    out = []
    for name, part in parts:
        values = pd.to_numeric(part[metric], errors="coerce")  # None: no value (no gap at all)
        frame = pd.DataFrame({"x": x_of[part.index], "y": values})
        if ci is not None:
            frame["lo"] = pd.to_numeric(part[f"{metric}_lo"], errors="coerce")
            frame["hi"] = pd.to_numeric(part[f"{metric}_hi"], errors="coerce")
            frame["over"] = part["num_overloaded"] > 0
        else:
            frame["over"] = overloaded(part)
        by_x = frame.groupby("x", sort=True)
        line = by_x.mean(numeric_only=True)
        line["over"] = by_x["over"].any()
        out.append({"name": name, "x": line.index.to_numpy(float), "y": line["y"].to_numpy(),
                    "lo": line["lo"].to_numpy() if ci is not None else None,
                    "hi": line["hi"].to_numpy() if ci is not None else None,
                    "over": line["over"].to_numpy(bool)})
    return out if names is None else [{**line, "names": names} for line in out]


def _draw(ax: Any, lines: list[dict[str, Any]], scale: float, labelled: list[bool],
          suffix: str = "", **style: Any) -> None:
    for i, line in enumerate(lines):
        y = scale * line["y"]
        name = f"{line['name']}{suffix}" if line["name"] else suffix.strip(", ") or None
        kwargs = {"color": f"C{i}", **style}
        if line["lo"] is not None:
            band_line(ax, line["x"], y, scale * line["lo"], scale * line["hi"], name, **kwargs)
        else:
            ax.plot(line["x"], y, marker="o", label=name, **kwargs)
        mark_overloaded(ax, line["x"], y, line["over"], labelled)


def _finish(ax: Any, x_column: str, lines: list[dict[str, Any]]) -> None:
    names = lines[0].get("names") if lines else None
    values = [v for line in lines for v in line["x"]]
    swept_axis(ax, x_column, values, names)
    ax.set_xlabel(param_label(x_column))


def _title(what: str, x_column: str, fixed: str, ci: pd.DataFrame | None) -> str:
    title = f"{what} vs {label(x_column)}"
    if fixed:
        title += f"\n{fixed}"
    if ci is not None:
        title += f" (mean of {int(ci['num_seeds'].max())} seeds, band: 95% CI)"
    return title


def p99_tbt_vs_load(table: pd.DataFrame, load: str, group: str, path: Path, *,
                    slo_s: float | None = None, title: str | None = None,
                    ci: pd.DataFrame | None = None, fixed: str = "") -> list[Path]:
    """P99 TBT (mean over seeds) against the swept field `load`, one line per value of
    `group` (legend by its own names, in numeric order); a point is ringed red when any of
    its seeds' runs is overloaded. With `ci` (the sweep's interval table) each line from it,
    with its 95% interval as a band. `fixed`: what the sweep held constant, for the title."""
    fig, ax = plt.subplots(figsize=(8, 4))
    labelled: list[bool] = []
    lines = _lines(table, load, group, "tbt_p99_s", ci)
    _draw(ax, lines, MS.scale, labelled)
    if slo_s is not None:
        ax.axhline(1e3 * slo_s, color="red", linestyle="--", label=f"SLO {1e3 * slo_s:g} ms")
    _finish(ax, load, lines)
    ax.set(ylabel=axis_label("tbt_p99_s"), title=title or _title("P99 TBT", load, fixed, ci))
    # From 0, with room above the highest point (a flat line would sit on the frame).
    ax.set_ylim(0, max(ax.get_ylim()[1], 1.08 * ax.dataLim.y1))
    legend(ax, _legend_title(ci if ci is not None else table, group))
    return save(fig, path)


def ttft_vs_load(table: pd.DataFrame, load: str, group: str, path: Path, *,
                 slo_s: float | None = None, ci: pd.DataFrame | None = None,
                 fixed: str = "") -> list[Path]:
    """P99 (solid) and P50 (dashed) TTFT against the swept field, one colour per value of
    `group`, on a log scale (an overloaded point queues for minutes); rings and bands as in
    `p99_tbt_vs_load`."""
    fig, ax = plt.subplots(figsize=(8, 4))
    labelled: list[bool] = []
    peak = pd.to_numeric(table["ttft_p99_s"], errors="coerce").max()
    shown = time_unit(float(peak) if np.isfinite(peak) else 0.0)
    all_lines = []
    for p, style in PERCENTILE_STYLES.items():
        lines = _lines(table, load, group, f"ttft_{p}_s", ci)
        _draw(ax, lines, shown.scale, labelled, f", {p.upper()}", linestyle=style)
        all_lines += lines
    if slo_s is not None:
        ax.axhline(shown.scale * slo_s, color="red", linestyle=":",
                   label=f"SLO {shown.scale * slo_s:g} {shown.name}")
    _finish(ax, load, all_lines)
    ax.set_yscale("log")
    log_time_axis(ax.yaxis)
    ax.set(ylabel=f"TTFT ({shown.name})", title=_title("TTFT P50 and P99", load, fixed, ci))
    legend(ax, _legend_title(ci if ci is not None else table, group))
    return save(fig, path)


def latency_vs_throughput(table: pd.DataFrame, group: str, path: Path,
                          metric: str = "tbt_p99_s", ci: pd.DataFrame | None = None,
                          point_labels: str | None = None,
                          slo_s: float | None = None) -> list[Path]:
    """`metric` against output throughput, one line per value of `group`. With `ci` (the
    sweep's interval table) each point is a point's mean over its seeds, with the 95%
    interval of `metric` as a band; `point_labels`: a column whose value names each point;
    `slo_s`: the target of `metric` (a TBT SLO), as a red line."""
    fig, ax = plt.subplots(figsize=(8, 4))
    labelled: list[bool] = []
    source = ci if ci is not None else table
    for i, (name, part) in enumerate(_split(source, group)):
        # Joined in the swept value's order where the points are named by it (at one load the
        # throughputs barely differ, and their order is noise); else along throughput.
        if point_labels:
            names = [natural_key(variant_label(v)) for v in part[point_labels]]
            part = part.iloc[sorted(range(len(part)), key=names.__getitem__)]
        else:
            part = part.sort_values("output_tokens_per_s", kind="stable")
        x, y = (pd.to_numeric(part[c], errors="coerce").to_numpy(dtype=float)
                for c in ("output_tokens_per_s", metric))
        if ci is not None:
            lo, hi = (pd.to_numeric(part[f"{metric}_{e}"], errors="coerce").to_numpy(float)
                      for e in ("lo", "hi"))
            band_line(ax, x, 1e3 * y, 1e3 * lo, 1e3 * hi, name or None, color=f"C{i}")
            over = (part["num_overloaded"] > 0).to_numpy(bool)
        else:
            ax.plot(x, 1e3 * y, marker="o", label=name or None, color=f"C{i}")
            over = overloaded(part).to_numpy(bool)
        mark_overloaded(ax, x, 1e3 * y, over, labelled)
        if point_labels:  # one line: which point is which, named by the swept field
            what = param_label(point_labels).split(" (")[0]
            middle = (np.nanmin(x) + np.nanmax(x)) / 2 if x.size else 0.0
            for xi, yi, v in zip(x, 1e3 * y, part[point_labels], strict=True):
                right = xi > middle  # names on the inner side: none runs off the axes
                ax.annotate(f"{what} {variant_label(v)}", (xi, yi), textcoords="offset points",
                            xytext=(-5 if right else 5, 4), ha="right" if right else "left",
                            fontsize="x-small")
    if slo_s is not None:
        ax.axhline(1e3 * slo_s, color="red", linestyle="--", label=f"SLO {1e3 * slo_s:g} ms")
    title = f"{label(metric)} vs throughput"
    if ci is not None:
        title += f" (mean of {int(ci['num_seeds'].max())} seeds, band: 95% CI)"
    ax.set(xlabel=axis_label("output_tokens_per_s"), ylabel=axis_label(metric), title=title)
    if point_labels:  # room for the names beside and above the points
        ax.margins(x=0.08)
    ax.set_ylim(0, ax.get_ylim()[1] * (1.08 if point_labels else 1.0))
    legend(ax, _legend_title(source, group))
    return save(fig, path)


def _split(source: pd.DataFrame, group: str) -> list[tuple[str, pd.DataFrame]]:
    """The lines of a figure: one per value of `group`, or one in all where there is one."""
    if group not in source or source[group].nunique() < 2:
        return [("", source)]
    return groups(source, group)


def _legend_title(source: pd.DataFrame, group: str) -> str | None:
    return param_label(group) if group in source and source[group].nunique() > 1 else None


def sweep_axes(table: pd.DataFrame) -> tuple[str, str, str] | None:
    """(x, group, fixed): the field on the x axis (a load when one varies, else the first that
    varies), the one whose values are lines (else the seed) and a note of the fields the
    sweep held at one value; None: nothing varies."""
    fields = [c for c in table.columns if c not in {"seed", "key"} and c not in METRICS]
    varied = [c for c in fields if table[c].nunique() > 1]
    if not varied:
        return None
    loads = [c for c in varied if is_load(c) and table[c].nunique() > 2]
    x = (loads or varied)[0]
    rest = [c for c in varied if c != x]
    fixed = ", ".join(f"{label(c)} {variant_label(table[c].iloc[0])} {unit(c).name}".strip()
                      for c in fields if c not in varied)
    return x, rest[0] if rest else "seed", fixed


def _stem(x: str) -> str:
    return "load" if is_load(x) else x.rsplit(".", 1)[-1]


def plot_sweep(sweep_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """The figures a sweep's table supports: P99 TBT and TTFT vs the swept field (the load
    where one varies), lines per the other, and latency vs throughput; with the sweep's
    interval table (`results_ci`, several seeds a point) means over seeds with 95% bands."""
    table = read_parquet(sweep_dir / "results.parquet",
                         ["seed", "key", "tbt_p99_s", "output_tokens_per_s"],
                         missing="the sweep has not finished: run it again to complete it")
    out_dir = out_dir or sweep_dir / "plots"
    axes = sweep_axes(table) if not table.empty else None
    if axes is None:
        return []
    x, group, fixed = axes
    scenario = sweep_dir / "runs" / str(table["key"].iloc[0]) / "scenario.yaml"
    data = read_yaml_file(scenario) if scenario.is_file() else {}
    slo = (data if isinstance(data, dict) else {}).get("slo") or {}
    ci = None
    if (sweep_dir / CI_TABLES[1]).is_file():  # several seeds a point: draw the intervals
        ci = read_parquet(sweep_dir / CI_TABLES[0],
                          [x, "num_seeds", "num_overloaded", "output_tokens_per_s",
                           "tbt_p99_s", "tbt_p99_s_lo", "tbt_p99_s_hi"])
    stem = _stem(x)
    files = p99_tbt_vs_load(table, x, group, out_dir / f"p99_tbt_vs_{stem}",
                            slo_s=slo.get("tbt_s"), ci=ci, fixed=fixed)
    if "ttft_p50_s" in table and "ttft_p99_s" in table:
        has_ci = ci is not None and "ttft_p99_s_lo" in ci and "ttft_p50_s_lo" in ci
        files += ttft_vs_load(table, x, group, out_dir / f"ttft_vs_{stem}",
                              slo_s=slo.get("ttft_s"), ci=ci if has_ci else None, fixed=fixed)
    files += latency_vs_throughput(table, group, out_dir / "latency_vs_throughput", ci=ci,
                                   point_labels=x if group == "seed" else None,
                                   slo_s=slo.get("tbt_s"))
    return files
