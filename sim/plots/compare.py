"""Comparison figures: a comparison's variants overlaid (CDFs) and their headline numbers as
bars, with their intervals where the comparison was replicated."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from sim.plots.common import overloaded, save
from sim.plots.run import cdfs
from sim.results.labels import PERCENT, label, time_unit
from sim.results.read import read_csv
from sim.results.run_dir import Results

HEADLINE_PANELS = (("TTFT", ("ttft_p50_s", "ttft_p99_s")), ("TBT", ("tbt_p50_s", "tbt_p99_s")),
                   ("SLO attainment", ("slo_attainment",)))
HEADROOM, HEADROOM_LEGEND = 1.12, 1.3  # y axis top over the highest bar or interval end


def headline_bars(table: pd.DataFrame, path: Path, title: str = "") -> list[Path]:
    """A comparison's headline numbers, one bar per variant: P50 and P99 TTFT, P50 and P99
    TBT, SLO attainment; an overloaded variant's bars hatched and its name marked. Where the
    table has a column's interval (`<column>_lo`, `<column>_hi`: a replicated comparison),
    it is drawn as an error bar; a replicated variant is marked overloaded when any of its
    replications was, with how many."""
    panels = [(name, [c for c in cols if c in table and table[c].notna().any()])
              for name, cols in HEADLINE_PANELS]
    panels = [(name, cols) for name, cols in panels if cols]
    # Each panel widens with the variants, so that their bars and numbers do not overlap.
    panel_width = max(4.0, 0.75 * len(table) + 1.0)
    fig, axes = plt.subplots(1, len(panels), figsize=(panel_width * len(panels), 4.5),
                             squeeze=False)
    over, names = _overloaded_names(table)
    x = np.arange(len(table))
    for ax, (name, cols) in zip(axes[0], panels, strict=True):
        values = {c: pd.to_numeric(table[c], errors="coerce").to_numpy(float) for c in cols}
        peak = max(float(np.nanmax(v)) for v in values.values())
        shown = PERCENT if name == "SLO attainment" else time_unit(peak)
        width = 0.8 / len(cols)
        top = 0.0
        for j, c in enumerate(cols):
            pos = x + (j - (len(cols) - 1) / 2) * width
            err = _error_bars(table, c, values[c], shown.scale)
            heights = shown.scale * values[c]
            bars = ax.bar(pos, heights, width, label=label(c), color=f"C{j}", yerr=err,
                          capsize=4)
            for bar, o in zip(bars, over, strict=True):
                if o:
                    bar.set_hatch("//")
            # bar_label puts a number at the upper end of the error bar when there is one;
            # the padding lifts it off the cap
            ax.bar_label(bars, labels=[_bar_number(h) for h in heights], fontsize="x-small",
                         padding=3, rotation=90 if len(cols) > 1 and len(table) > 3 else 0)
            top = max(top, float(np.nanmax(heights + (0 if err is None else err[1]))))
        # room above the tallest bar for its number and, with two series, a one-row legend
        ax.set_ylim(0, (HEADROOM_LEGEND if len(cols) > 1 else HEADROOM) * top or 1.0)
        ax.set_xticks(x, names, rotation=30, ha="right", rotation_mode="anchor",
                      fontsize="small")
        ax.set(ylabel=f"{name} ({shown.name})", title=name)
        if len(cols) > 1:
            ax.legend(fontsize="small", loc="upper center", ncols=len(cols), frameon=False)
    if title:
        fig.suptitle(title)
    return save(fig, path)


def _bar_number(value: float) -> str:
    """A bar's number as the tables print it: 5,841 rather than 5.84e+03."""
    if not np.isfinite(value):
        return ""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


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


def plot_comparison(compare_dir: Path, out_dir: Path | None = None, *,
                    worst_tbt: bool = False) -> list[Path]:
    """A comparison's variants: their TTFT and TBT CDFs overlaid (TBT: every gap, or each
    request's worst with `worst_tbt`), and their headline numbers."""
    table = read_csv(compare_dir / "comparison.csv", ["variant"])
    variants = [str(v) for v in table["variant"]]
    out_dir = out_dir or compare_dir / "plots"
    # Its own name: the every-gap CDF drawn before stays beside it.
    name = "cdf_worst_tbt" if worst_tbt else "cdf"
    # Each variant's run checked as any run read back is (`Results.load`).
    files = cdfs([Results.load(compare_dir / v) for v in variants], out_dir / name, variants,
                 worst_tbt=worst_tbt)
    return files + headline_bars(table, out_dir / "headline", compare_dir.name)
