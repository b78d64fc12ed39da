"""Trace tables: a trace's rows as numpy columns, read from pyarrow without pandas.

The readers (`sim.workloads.cache`) give a `TraceTable` and the column checks
(`sim.workloads.base`) read it. Importing pandas takes about 0.45 s, more than reading and
simulating a trace of thousands of requests, and pyarrow imports it from nearly every
convenience it has: `pa.array`, `to_pandas`, even `Int64Array.to_numpy` (it probes for pandas
types). So the columns that traces hold (integers, floats, booleans, timestamps, none missing)
are read from their arrow buffers, as `sim.results.columns` writes them. A JSON-lines file's columns
are made from its parsed rows: integers, numbers or booleans in every row as the numpy array
pandas typed them as, any other values as an object array of them (a Mooncake trace's
`hash_ids` lists). Every other column (text, missing values, other types) is the pandas Series
it always was, made only then, and a check reading an object array (a JSON string where a
number belongs) reads pandas' Series of it: the checks and errors read the values they always
did.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa


@dataclass(frozen=True)
class TraceTable:
    """A trace's rows as columns, in file order (a `where:` condition may have dropped some)."""

    columns: dict[str, np.ndarray | pd.Series]  # in the file's order; every kept row
    positions: np.ndarray  # int64: each kept row's position among the file's rows (0 = first)
    # Every row read: a pyarrow table (CSV) or a JSON-lines file's rows, whose DataFrame
    # `where:` evaluates on and the error values of numpy columns are taken from.
    source: pa.Table | JsonRows
    lines: list[int] | None = None  # JSON lines: each position's line (blank lines skipped)
    csv_path: Path | None = None  # a CSV, whose lines are counted to name one (`csv_line`)

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def empty(self) -> bool:
        """No rows or no columns, as `DataFrame.empty`."""
        return not len(self) or not self.columns

    def take(self, keep: np.ndarray) -> TraceTable:
        """The rows where the boolean array `keep` is true."""
        return replace(self, columns={name: values[keep] for name, values in self.columns.items()},
                       positions=self.positions[keep])

    def frame(self) -> pd.DataFrame:
        """Every row read, as the DataFrame pandas makes of it."""
        if isinstance(self.source, JsonRows):
            return self.source.frame()
        return self.source.to_pandas()

    def series(self, name: str) -> pd.Series:
        """Column `name` of the kept rows as pandas holds it, indexed by the rows' positions."""
        values = self.columns[name]
        if not isinstance(values, np.ndarray):
            return values
        if isinstance(self.source, JsonRows):
            return self.source.frame()[name].iloc[self.positions]
        arrow: pa.Table = self.source
        index = list(self.columns).index(name)
        return arrow.select([index]).to_pandas().iloc[self.positions, 0]

    def value(self, name: str, row: int) -> Any:
        """Column `name`'s value in kept row `row` as pandas gives it (errors show it): a numpy
        number, or a pandas object (a `Timestamp` rather than numpy's datetime64)."""
        values = self.columns[name]
        if isinstance(values, np.ndarray) and values.dtype.kind in "biuf":
            return values[row]  # the numpy scalar pandas' `iloc` gives too
        return self.series(name).iloc[row]


def from_arrow(table: pa.Table, csv_path: Path) -> TraceTable:
    """A CSV's parsed columns: numpy where `numpy_column` reads them, else pandas' Series."""
    columns: dict[str, np.ndarray | pd.Series] = {}
    for index, name in enumerate(table.column_names):
        values = numpy_column(table.column(index))
        columns[name] = values if values is not None else \
            table.select([index]).to_pandas().iloc[:, 0]
    return TraceTable(columns, np.arange(table.num_rows), table, csv_path=csv_path)


_NUMPY_TYPES = {"int64": np.int64, "double": np.float64, "bool": np.bool_}


class JsonRows:
    """A JSON-lines file's parsed rows (one dict each, in file order), made the DataFrame pandas
    makes of them only when something needs pandas: a `where:` condition, an error's value, a
    column with missing values."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self._frame: pd.DataFrame | None = None

    def frame(self) -> pd.DataFrame:
        if self._frame is None:
            import pandas as pd

            self._frame = pd.DataFrame.from_records(self.rows)
        return self._frame


def from_rows(rows: list[dict[str, Any]], lines: list[int]) -> TraceTable:
    """A JSON-lines file's rows (row i from line `lines[i]`), columns in the order pandas gives
    them (as their names first appear): see the module's docstring."""
    source = JsonRows(rows)
    columns: dict[str, np.ndarray | pd.Series] = {}
    for name in dict.fromkeys(key for row in rows for key in row):
        values = [row.get(name, _MISSING) for row in rows]
        array = _json_column(values)
        # Missing from some rows, or null: pandas' Series, with what it puts there (NaN).
        columns[name] = array if array is not None else source.frame()[name]
    return TraceTable(columns, np.arange(len(rows)), source, lines=lines)


_MISSING = object()


def _json_column(values: list[Any]) -> np.ndarray | None:
    """One JSON value per row as the array of pandas' type for it: int64 if every value is an
    integer that fits it, float64 for numbers, bool for booleans; else the values as objects.
    None where a value is missing or null."""
    types = set(map(type, values))  # exact types: a boolean is no integer here
    if type(None) in types or object in types:  # null, or `_MISSING`
        return None
    if types == {int}:
        if min(values) >= -(2**63) and max(values) < 2**63:
            return np.array(values, dtype=np.int64)
    elif types == {bool}:
        return np.array(values, dtype=np.bool_)
    elif types <= {int, float}:
        return np.array(values, dtype=np.float64)
    return np.fromiter(values, dtype=object, count=len(values))


def numpy_column(chunked: pa.ChunkedArray) -> np.ndarray | None:
    """An int64, float64, boolean or timestamp column as numpy (a timestamp as datetime64 of
    its unit, counted from 1970 in UTC with or without a zone), read from its buffers as
    `to_pandas` would give it; None for other types and for missing values (which pandas turns
    into NaN or objects, for the checks to refuse)."""
    import pyarrow as pa

    kind = chunked.type
    if chunked.null_count:
        return None
    if pa.types.is_timestamp(kind):
        dtype = np.dtype(f"datetime64[{kind.unit}]")
    elif str(kind) in _NUMPY_TYPES:
        dtype = np.dtype(_NUMPY_TYPES[str(kind)])
    else:
        return None
    array = chunked.combine_chunks()
    if not len(array):
        return np.empty(0, dtype)
    data = array.buffers()[1]
    if dtype == np.bool_:  # arrow packs booleans into bits, the first in the lowest
        bits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")
        return bits[array.offset:array.offset + len(array)].astype(bool)
    return np.frombuffer(data, dtype, count=len(array), offset=array.offset * dtype.itemsize)


_TICKS_PER_SECOND = {"s": 1, "ms": 10**3, "us": 10**6, "ns": 10**9}


def seconds_since_first(times: np.ndarray) -> np.ndarray | None:
    """Times (datetime64, none missing) as float64 seconds since the first, bit for bit as
    pandas' `(times - times.iloc[0]).dt.total_seconds()`; None where a difference overflows
    int64 ticks (pandas raises its own error there)."""
    unit, _ = np.datetime_data(times.dtype)
    ticks = times.view(np.int64)
    first = int(ticks[0])
    if int(ticks.min()) - first < -(2**63) or int(ticks.max()) - first >= 2**63:
        return None
    return _total_seconds(ticks - first, _TICKS_PER_SECOND[unit])


def _total_seconds(ticks: np.ndarray, per_second: int) -> np.ndarray:
    """pandas' `TimedeltaArray.total_seconds` (3.x): whole seconds plus the residual's
    fraction, each rounded once, nudged off a whole second that only rounding reached."""
    whole, residual = np.divmod(ticks, per_second)
    result = whole + residual / per_second
    if (ticks > 2**53).any() or (ticks < -(2**53)).any():
        fixable = (residual != 0) & (np.abs(whole) < 2**52)
        whole_f = whole.astype(np.float64)
        on_floor = fixable & (result == whole_f)
        on_ceil = fixable & (result == whole_f + 1.0)
        if on_floor.any():
            result = np.where(on_floor, np.nextafter(result, result + 1.0), result)
        if on_ceil.any():
            result = np.where(on_ceil, np.nextafter(result, result - 1.0), result)
    return result


def csv_line(path: Path, position: int) -> int:
    """The line data row `position` (0 = the first after the header) starts on: pyarrow skips
    empty lines, and a quoted field may hold line breaks, so row and line part where the file
    has either. Read only to word an error."""
    import csv

    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.reader(f)
        next(reader, None)  # the header
        row = -1
        start = reader.line_num + 1
        for fields in reader:
            if fields:  # (an empty line: no row)
                row += 1
                if row == position:
                    return start
            start = reader.line_num + 1
    return position + 2
