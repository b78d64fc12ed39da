"""A trace's columns read as checked values: token counts and arrival times. The first bad
row is named by its line in the file, with the value and what is wrong with it."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sim.config.errors import InputError
from sim.workloads.base import MAX_TOKENS
from sim.workloads.table import TraceTable, csv_line, seconds_since_first

if TYPE_CHECKING:
    import pandas as pd


def where(table: TraceTable, name: str, row: int) -> str:
    """`name (line N)`: the field of a bad value, with its line in the file."""
    return f"{name} (line {line_of(table, row)})"


def line_of(table: TraceTable, row: int) -> int:
    """The line in the file of row `row` (the table keeps each row's position in the file
    through `workload.where`)."""
    position = int(table.positions[row])
    if table.lines is not None:
        return int(table.lines[position])
    if table.csv_path is not None:
        return csv_line(table.csv_path, position)
    return position + 1


def column(table: TraceTable, name: str, path: Path) -> np.ndarray | pd.Series:
    """Column `name` (see `TraceTable`: numpy, or a pandas Series for text and missing
    values; a JSON-lines file's values of other types are an object array)."""
    if name not in table.columns:
        raise InputError(path, f"column {name!r}", list(table.columns), "missing")
    return table.columns[name]


def _checked_column(table: TraceTable, name: str, path: Path) -> np.ndarray | pd.Series:
    """Column `name` for the checks of numbers and times: JSON values they do not type (text,
    lists, mixed types) as pandas' Series of them, which the checks read as they always did."""
    values = column(table, name, path)
    if isinstance(values, np.ndarray) and values.dtype == object:
        return table.series(name)
    return values


def token_counts(table: TraceTable, name: str, path: Path) -> np.ndarray:
    """A column of token counts, each an integer in [1, MAX_TOKENS]; errors name the first bad
    row."""
    values = _checked_column(table, name, path)
    numeric, bad = _numbers(table, values)
    bad |= (numeric != np.floor(numeric)) | (numeric < 1)
    if bad.any():
        row = int(np.argmax(bad))
        value = table.value(name, row)
        raise InputError(path, where(table, name, row), value,
                         _kind_problem(value, table)
                         or "must be a positive integer number of tokens")
    too_many = numeric > MAX_TOKENS
    if too_many.any():
        row = int(np.argmax(too_many))
        raise InputError(path, where(table, name, row), table.value(name, row),
                         f"more than {MAX_TOKENS:.0e} tokens in one request")
    return numeric.astype(np.int64)


def _numbers(table: TraceTable, values: np.ndarray | pd.Series
             ) -> tuple[np.ndarray, np.ndarray]:
    """A column as float64, and which of its values are not finite numbers: NaN, infinities,
    booleans, dates, and text in a JSON-lines file (`"100"` is a string there, not a number;
    a CSV's cells are all text, which pyarrow typed)."""
    if isinstance(values, np.ndarray):  # typed by pyarrow, none missing: no pandas needed
        if values.dtype.kind == "M":
            return np.zeros(len(values)), np.ones(len(values), dtype=bool)
        numeric = values.astype(np.float64)
        return numeric, ~np.isfinite(numeric) | (values.dtype == bool)
    import pandas as pd

    if pd.api.types.is_datetime64_any_dtype(values.dtype):
        return np.zeros(len(values)), np.ones(len(values), dtype=bool)
    numeric = pd.to_numeric(values, errors="coerce").to_numpy(dtype=np.float64)
    bad = ~np.isfinite(numeric) | _booleans(values)
    # JSON text where a number belongs: an object column (mixed values), or one pandas 3 typed
    # as text because every value of it is quoted.
    if _is_json(table) and (values.dtype == object or pd.api.types.is_string_dtype(values.dtype)):
        bad |= np.fromiter((isinstance(v, str) for v in values), bool, len(values))
    return numeric, bad


def _is_json(table: TraceTable) -> bool:
    return table.lines is not None  # set by the JSON-lines reader only


def _kind_problem(value: Any, table: TraceTable) -> str | None:
    """Why `value` is no number, when its type says it better than its column's rule."""
    if isinstance(value, bool | np.bool_):
        return "must be a number, not a boolean"
    if isinstance(value, str) and _is_json(table):
        return "must be a JSON number, not a string (drop the quotes)"
    return None


def _booleans(values: pd.Series) -> np.ndarray:
    """Which values are booleans (true/false are not token counts)."""
    if values.dtype == bool:
        return np.ones(len(values), dtype=bool)
    if values.dtype == object:
        return np.fromiter((isinstance(v, bool | np.bool_) for v in values), bool, len(values))
    return np.zeros(len(values), dtype=bool)


def seconds(table: TraceTable, name: str, unit: str, path: Path) -> np.ndarray:
    """An arrival-time column as seconds since its first value, checked non-decreasing."""
    values = _checked_column(table, name, path)
    if unit == "datetime":
        arrival, bad = _datetimes(table, values, name, path)
    elif values.dtype.kind == "M":  # datetime64, with a zone or without (numpy or pandas)
        # Read as numbers, dates would count in pyarrow's unit for the column (s to ns).
        raise InputError(path, where(table, name, 0), str(table.value(name, 0)),
                         f"a date and time, not a number of {unit}: give time_unit: datetime")
    else:
        numeric, bad = _numbers(table, values)
        scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]
        arrival = (numeric - numeric[0]) * scale
    if bad.any():
        row = int(np.argmax(bad))
        value = table.value(name, row)
        problem = _kind_problem(value, table) if unit != "datetime" else None
        raise InputError(path, where(table, name, row), value, problem or "not a time")
    backwards = np.flatnonzero(np.diff(arrival) < 0)
    if backwards.size:
        row = int(backwards[0]) + 1
        raise InputError(path, where(table, name, row), table.value(name, row),
                         "arrival times must not decrease")
    return arrival


def _datetimes(table: TraceTable, values: np.ndarray | pd.Series, name: str, path: Path
               ) -> tuple[np.ndarray, np.ndarray]:
    """ISO 8601 times as seconds since the first, and which values are not times. Times with a
    zone are compared in UTC (a change of offset, e.g. to daylight saving, is no jump). A
    column where some times have a zone and others not is refused: the zone of those without
    is unknown (pandas would take them as UTC). Times pyarrow typed (the Azure traces'), none
    missing, need no pandas; text (an error, or a format pyarrow does not read) does."""
    if isinstance(values, np.ndarray):
        arrival = seconds_since_first(values) if values.dtype.kind == "M" else None
        if arrival is not None:
            return arrival, np.zeros(len(values), dtype=bool)
        # Numbers, or a span beyond int64 ticks: pandas' error, as before.
        values = table.series(name)
    import pandas as pd

    if values.dtype != object and not pd.api.types.is_string_dtype(values.dtype) \
            and not pd.api.types.is_datetime64_any_dtype(values.dtype):
        hint = "" if values.dtype == bool else ": give time_unit s, ms or us"
        raise InputError(path, where(table, name, 0), values.iloc[0],
                         f"not a date and time{hint}")
    text = values
    if values.dtype == object:  # JSON values: a number or a boolean would pass as a time
        not_text = np.fromiter((not isinstance(v, str) for v in values), bool, len(values))
        text = values.where(~not_text)  # parsed as missing: refused below
    times = pd.to_datetime(text, format="ISO8601", errors="coerce", utc=True)
    bad = times.isna().to_numpy()
    if bad.any():
        return np.zeros(len(values)), bad
    if not pd.api.types.is_datetime64_any_dtype(values.dtype):  # text: zones may be mixed
        try:
            pd.to_datetime(values, format="ISO8601")
        except ValueError:  # "Mixed timezones detected" (also offsets that differ: fine)
            _check_zones(table, values, name, path)
    return (times - times.iloc[0]).dt.total_seconds().to_numpy(), bad


def _check_zones(table: TraceTable, values: pd.Series, name: str, path: Path) -> None:
    """Refuse the first time with a zone where the first time has none, or the other way round
    (a scan of a few microseconds a row, for text columns pandas found mixed only)."""
    import pandas as pd

    zoned = pd.Timestamp(values.iloc[0]).tzinfo is not None
    for row, value in enumerate(values):
        if (pd.Timestamp(value).tzinfo is not None) != zoned:
            raise InputError(path, where(table, name, row), value,
                             f"a time zone on some times and not on others (line "
                             f"{line_of(table, 0)} has {'one' if zoned else 'none'}): give one "
                             "on every time or on none")


def hash_id_lists(table: TraceTable, name: str, path: Path) -> list[tuple[int, ...]]:
    """Each row's prefix-block ids: a list of ints (a JSON-lines list, or a CSV cell holding one
    as JSON text, `[3, 17, 42]`). Anything else is an error naming the row."""
    out = []
    for row, ids in enumerate(column(table, name, path)):
        if isinstance(ids, str):
            with contextlib.suppress(ValueError):  # (refused below, as not a list)
                ids = json.loads(ids)
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise InputError(path, where(table, name, row), ids, "must be a list of ints")
        out.append(tuple(ids))
    return out
