"""What every figure shares: saving (PNG then SVG), legends, overloaded rings, interval bands,
axes for swept values (a log-2 axis for token counts, categories for names)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib import ticker  # noqa: E402

from sim.results.labels import natural_key, unit, variant_label  # noqa: E402
from sim.results.outdir import replace_file  # noqa: E402

OVERLOADED = {"marker": "o", "markersize": 11, "markerfacecolor": "none",
              "markeredgecolor": "red", "markeredgewidth": 1.5, "linestyle": "none"}
OVERLOADED_LABEL = "overloaded"
BAND_ALPHA = 0.2  # the 95% interval band around a sweep's line
# matplotlib writes the date and a random id into SVG files; fixed, a figure of the same
# results is the same bytes.
SVG_METADATA = {"Date": None}


def save(fig: Any, path: Path) -> list[Path]:
    """Write `path` as .png and .svg (PNG first); close the figure; return both paths."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    out = [path.with_suffix(".png"), path.with_suffix(".svg")]
    try:  # each file whole or not at all (an interrupt leaves the earlier figure)
        replace_file(out[0], lambda tmp: fig.savefig(tmp, format="png", dpi=110,
                                                     metadata={"Software": None}))
        with plt.rc_context({"svg.hashsalt": "servesim"}):
            replace_file(out[1], lambda tmp: fig.savefig(tmp, format="svg",
                                                         metadata=SVG_METADATA))
    finally:
        plt.close(fig)
    return out


def mark_overloaded(ax: Any, x: np.ndarray, y: np.ndarray, over: np.ndarray,
                    labelled: list[bool]) -> None:
    """Ring the overloaded points red; one legend entry for all of them."""
    over = np.asarray(over, dtype=bool)
    if over.any():
        ax.plot(x[over], y[over], label=None if labelled else OVERLOADED_LABEL, **OVERLOADED)
        labelled.append(True)


def legend(ax: Any, title: str | None = None, outside: bool = True) -> None:
    """Entries in the order drawn, `overloaded` last; beside the axes where lines of a sweep
    would hide behind it."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    order = sorted(range(len(labels)), key=lambda i: labels[i] == OVERLOADED_LABEL)
    where = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0)} if outside else {}
    ax.legend([handles[i] for i in order], [labels[i] for i in order], title=title,
              fontsize="small", title_fontsize="small", **where)


def overloaded(part: pd.DataFrame) -> pd.Series:
    """Each row's verdict as a boolean (no verdict column: none overloaded)."""
    if "overload" not in part:
        return pd.Series(False, index=part.index)
    return part["overload"] == "overloaded"


def band_line(ax: Any, x: np.ndarray, y: np.ndarray, lo: np.ndarray, hi: np.ndarray,
              label: str | None, **style: Any) -> Any:
    """The estimate's line and, shaded in its colour, its 95% interval; a point without an
    interval (its seeds all equal) is drawn with zero width there."""
    (line,) = ax.plot(x, y, marker="o", label=label, **style)
    lo, hi = np.where(np.isnan(lo), y, lo), np.where(np.isnan(hi), y, hi)
    ax.fill_between(x, lo, hi, color=line.get_color(), alpha=BAND_ALPHA, linewidth=0)
    return line


def groups(table: pd.DataFrame, column: str) -> list[tuple[str, pd.DataFrame]]:
    """The table split by `column`, each part named by its own value (a scheduler by its name
    and key parameter), in natural order: budget 256 before budget 2048."""
    parts = [(variant_label(key), part) for key, part in table.groupby(column, sort=False)]
    return sorted(parts, key=lambda p: natural_key(p[0]))


def numeric(values: Iterable[Any]) -> bool:
    """Whether every value is a number (not a bool): such an axis is drawn to scale."""
    return all(isinstance(v, int | float | np.integer | np.floating)
               and not isinstance(v, bool | np.bool_) for v in values)


def positions(column: pd.Series) -> tuple[np.ndarray, list[str] | None]:
    """x positions of a swept column: numbers as they are; anything else (a scheduler) as
    categories 0, 1, ... in natural order, with their names."""
    if numeric(column):
        return column.to_numpy(dtype=float), None
    names = sorted({variant_label(v) for v in column}, key=natural_key)
    where = {name: i for i, name in enumerate(names)}
    return np.array([where[variant_label(v)] for v in column], dtype=float), names


def swept_axis(ax: Any, key: str, values: Sequence[float], names: list[str] | None) -> None:
    """The x axis of a swept field: its categories by name; a token count (a budget) on a
    log-2 scale when it spans 4x or more, ticked at the values swept; else linear."""
    if names is not None:
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
        return
    values = sorted(set(values))
    if unit(key).name == "tokens" and values and values[0] > 0 and values[-1] >= 4 * values[0]:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(ticker.FixedLocator(values))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_locator(ticker.NullLocator())


def log_time_axis(axis: Any) -> None:
    """A log scale in plain numbers (0.01, 1, 100), not powers of ten; on an axis spanning
    less than about a decade, the minor ticks matplotlib chooses to label are plain too
    (3, 40, not 3x10^0, 4x10^1)."""
    plain = ticker.FuncFormatter(lambda v, _: f"{v:g}")
    axis.set_major_formatter(plain)
    axis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False))
