"""What the validation scripts share: `--set` values, the error table's rows, and writing it
with the command, commit and date that made it."""

from __future__ import annotations

import datetime
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from sim.studies.calibrate import checkout_commit
from sim.studies.measured import METRICS, median_abs

ROOT = Path(__file__).resolve().parents[2]


def parse_set(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        field, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item}: give FIELD=VALUE")
        out[field] = yaml.safe_load(value)
    return out


def replica_fields(items: list[str]) -> dict[str, Any]:
    """`--set FIELD=VALUE` options as a (nested) replica mapping."""
    replica: dict[str, Any] = {}
    for dotted, value in parse_set(items).items():
        *keys, last = dotted.split(".")
        node = replica
        for key in keys:
            node = node.setdefault(key, {})
        node[last] = value
    return replica


def error_cells(row: dict[str, float | None]) -> str:
    """One stage's errors as table cells (blank where not compared)."""
    return " | ".join("" if (e := row[name]) is None else f"{e:+.1f}" for name, *_ in METRICS)


def median_row(label: str, errors: Sequence[dict[str, float | None]], last: str = "") -> str:
    """The median |error| of each metric over `errors`, as a table row."""
    return f"| {label} | " + " | ".join(
        "" if (m := median_abs(errors, name)) is None else f"{m:.1f}"
        for name, *_ in METRICS) + f" | {last} |"


def report(text: str, out: Path | None, script: str) -> None:
    """Print the table; with `out`, also write it with the command, commit and date."""
    print(text)
    if out:
        command = f"python validation/public/{script} " + " ".join(sys.argv[1:])
        out.write_text(f"{text}\n\n`{command}` at {checkout_commit()}, "
                       f"{datetime.date.today().isoformat()}\n")
