"""HTML pieces for the report: escaped text, tables with units in their headers, embedded
figures, and the page around them (inline CSS, no script, nothing fetched from elsewhere)."""

from __future__ import annotations

import base64
import math
from collections.abc import Collection, Iterable, Sequence
from html import escape
from pathlib import Path
from typing import Any

import pandas as pd

from sim.results.labels import axis_label, label, param_label, unit

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto;
       max-width: 1200px; padding: 0 1em; color: #1b1f24; background: #fff; line-height: 1.4; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #d0d7de;
     padding-bottom: 0.2em; margin-top: 1.6em; } h3 { margin-bottom: 0.3em; }
.meta { color: #57606a; } .verdict { font-size: 1.15em; padding: 0.5em 0.8em; border-radius: 6px;
     display: inline-block; } .stable { background: #dafbe1; } .overloaded { background: #ffebe9; }
.unknown { background: #fff8c5; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }
th, td { border: 1px solid #d0d7de; padding: 0.25em 0.6em; text-align: right; }
th { background: #f6f8fa; } td.text, th.text { text-align: left; }
td.overloaded { color: #cf222e; font-weight: 600; background: none; }
.scroll { overflow-x: auto; } td { white-space: nowrap; }
td.text { white-space: normal; } .ci { color: #57606a; font-size: 0.85em; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #d0d7de; }
figcaption { color: #57606a; font-size: 0.9em; }
pre { background: #f6f8fa; padding: 0.8em; overflow-x: auto; font-size: 0.85em;
      border-radius: 6px; }
code { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; }
"""

MS_PER_S = 1e3


def number(value: Any) -> str:
    """4 significant digits, thousands separated; '-' for none or NaN; text as it is."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool | str):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    try:
        x = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isfinite(x) and abs(x) >= 1e4:  # whole numbers, not 1.019e+04
        return f"{round(x):,}"
    return f"{x:,.4g}"


class Html(str):
    """Markup made here (escaped already), put in a table cell as it is."""


def header(name: str) -> str:
    """A result column's heading as the CLI tables and figures name it (`sim.results.labels`): a
    scenario field by its meaning, a metric with its unit; an unknown `*_s` column in seconds,
    any other unknown column by its words; a request class's (`class:<name>:<key>`) as its
    key's, after the class's name."""
    if name.startswith("class:"):
        _, who, key = name.split(":", 2)
        return f"{who}: {header(key)}"
    if "." in name:
        return param_label(name)
    if label(name) != name:
        return axis_label(name)
    words = name.replace("_", " ")
    if name.endswith("_s") and not name.endswith("_per_s"):
        return f"{words.removesuffix(' s')} (s)"
    return words


def scale(name: str) -> float:
    """The factor from a column's stored value to its heading's unit (seconds to ms, say)."""
    name = name.rsplit(":", 1)[-1]  # a request class's column: its key's
    return 1.0 if "." in name else unit(name).scale


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]],
          text_columns: int | Collection[int] = 1) -> str:
    """A table; text columns (the first `text_columns`, or those numbered) left-aligned, numbers
    right-aligned; an `overloaded` cell marked."""
    left = range(text_columns) if isinstance(text_columns, int) else text_columns

    def cell(tag: str, value: Any, i: int) -> str:
        classes = ["text"] if i in left else []
        if value == "overloaded":
            classes.append("overloaded")
        attr = f' class="{" ".join(classes)}"' if classes else ""
        text = value if isinstance(value, Html) else escape(
            number(value) if tag == "td" else str(value))
        return f"<{tag}{attr}>{text}</{tag}>"

    head = "".join(cell("th", h, i) for i, h in enumerate(headers))
    body = "\n".join("<tr>" + "".join(cell("td", v, i) for i, v in enumerate(row)) + "</tr>"
                     for row in rows)
    return f'<div class="scroll"><table>\n<tr>{head}</tr>\n{body}\n</table></div>'


def _interval(value: Any, lo: Any, hi: Any, scale: float) -> Html:
    """The estimate, its interval below it in small print (none: its seeds all equal)."""
    shown = escape(number(value * scale))
    if lo is None or hi is None or pd.isna(lo) or pd.isna(hi):
        return Html(shown)
    span = escape(f"[{number(lo * scale)}, {number(hi * scale)}]")
    return Html(f'{shown}<br><span class="ci">{span}</span>')


def frame_table(df: pd.DataFrame, text_columns: int = 1) -> str:
    """A result table headed as `header` names its columns, values in their units; a column
    with `_lo` and `_hi` siblings is shown as `value [lo, hi]` (its 95% interval)."""
    columns = [c for c in df.columns
               if not (c.endswith(("_lo", "_hi")) and c[:-3] in df.columns)]
    rows = []
    for record in df.to_dict("records"):
        row: list[Any] = []
        for c in columns:
            factor = scale(c)
            value = record[c]
            if isinstance(value, bool):  # "met the SLO: yes", not "True"
                row.append("yes" if value else "no")
            elif f"{c}_lo" in record and isinstance(value, int | float):
                row.append(_interval(value, record[f"{c}_lo"], record[f"{c}_hi"], factor))
            elif isinstance(value, int | float) and factor != 1:
                row.append(value * factor)
            else:
                row.append(value)
        rows.append(row)
    text = set(range(text_columns)) | {i for i, c in enumerate(columns)
                                       if df[c].dtype == object}
    return table([header(c) for c in columns], rows, text)


def figure(png: Path) -> str:
    """A PNG embedded as a data URI, captioned with its file's name (what `servesim plot`
    writes: its SVG beside it)."""
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    name = escape(png.name)
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{escape(png.stem)}">'
            f"<figcaption>{name}</figcaption></figure>")


def pre(text: str) -> str:
    return f"<pre><code>{escape(text)}</code></pre>"


def paragraph(text: str, cls: str | None = None) -> str:
    attr = f' class="{cls}"' if cls else ""
    return f"<p{attr}>{escape(text)}</p>"


def section(title: str, *parts: str) -> str:
    return f"<section>\n<h2>{escape(title)}</h2>\n" + "\n".join(parts) + "\n</section>"


def details(summary: str, body: str, is_open: bool = False) -> str:
    return (f"<details{' open' if is_open else ''}><summary>{escape(summary)}</summary>\n"
            f"{body}\n</details>")


def page(title: str, subtitle: str, sections: Sequence[str]) -> str:
    """The whole document: everything inline, so it opens offline and can be mailed."""
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
            f"<h1>{escape(title)}</h1>\n{paragraph(subtitle, 'meta')}\n"
            + "\n".join(sections) + "\n</body>\n</html>\n")
