"""Result tables as columns of numpy arrays.

A run makes its tables (requests, iterations, tokens, TBT gaps) as `Columns`: a name -> array
mapping, written to parquet by pyarrow and made a pandas DataFrame only when someone asks for
one (`to_frame`). A simulation never imports pandas: on these machines importing it takes
longer than simulating 1,000 requests does. The summary metrics (`sim.results.metrics.summary`) read
a column with `column`, so they take `Columns` and DataFrames (a run read back) alike.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True)
class Categorical:
    """A column of a few distinct strings kept as small integer codes (the iterations' `pool`):
    written as a parquet dictionary column and read back by pandas as a categorical, as
    `pd.Categorical.from_codes(codes, categories)` would be."""

    codes: np.ndarray  # int8, indices into `categories`
    categories: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.codes)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        # np.asarray(column) gives the strings, as a categorical Series' to_numpy() does.
        return np.asarray(self.categories, dtype=object)[self.codes]


Column: TypeAlias = "np.ndarray | Categorical"
Columns: TypeAlias = "dict[str, Column]"
# A table a metric reads: a run's columns, or a DataFrame read back from its files.
Table: TypeAlias = "Mapping[str, Any] | pd.DataFrame"


def column(table: Table, name: str) -> np.ndarray:
    """Column `name` of a table (`Columns` or a DataFrame) as a numpy array (strings as an
    object array; no copy where the table holds a numpy array)."""
    return np.asarray(table[name])


def num_rows(table: Table) -> int:
    """Rows of a table (`len` of a mapping counts its columns, not its rows)."""
    if isinstance(table, Mapping):
        return len(next(iter(table.values()))) if table else 0
    return len(table)


def to_frame(table: Columns | pd.DataFrame) -> pd.DataFrame:
    """The table as a DataFrame, its columns in order (numpy columns not copied)."""
    import pandas as pd

    if isinstance(table, pd.DataFrame):
        return table
    data = {name: (pd.Categorical.from_codes(col.codes, categories=pd.Index(col.categories))
                   if isinstance(col, Categorical) else col)
            for name, col in table.items()}
    return pd.DataFrame(data, copy=False)


def write_parquet(table: Columns | pd.DataFrame, path: Path,
                  counters: Collection[str] = ()) -> None:
    """Write a table as parquet, as pandas' `to_parquet` writes its DataFrame: missing floats
    (NaN) as nulls, text as strings, a `Categorical` as a dictionary column. `Columns` go to
    pyarrow as buffers: its `pa.array` and `pa.table` import pandas to check their argument
    for a pandas object, even a numpy array's, which is the import a run avoids. `counters`:
    integer columns that mostly step by small amounts from row to row (an iteration number,
    a token's index in its request), stored as differences."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not isinstance(table, Mapping):  # a DataFrame (a run read back and written again)
        table.to_parquet(path, index=False)
        return
    arrays = [_arrow_array(col) for col in table.values()]
    # Standard parquet encodings (every reader has them), each where it pays; measured on
    # the Mooncake scenario's 1.30M iterations (2026-11-24): a counter's dictionary holds
    # every value (iteration: 40 ms, 5.7 MB; as differences 8 ms, 0.01 MB); times are nearly
    # all distinct, and their bytes split by position compress (durations 10.4 -> 4.6 MB);
    # other integers and text repeat (dictionary pages, the default).
    encoding = {}
    for name, col in table.items():
        if name in counters and not isinstance(col, Categorical) and col.dtype.kind in "iu":
            encoding[name] = "DELTA_BINARY_PACKED"  # integers only (pyarrow refuses others)
        elif not isinstance(col, Categorical) and col.dtype.kind == "f":
            encoding[name] = "BYTE_STREAM_SPLIT"
    pq.write_table(pa.Table.from_arrays(arrays, names=list(table)), path,
                   use_dictionary=[name for name in table if name not in encoding],
                   column_encoding=encoding or None)


_ARROW_TYPES = {np.dtype(np.float64): "float64", np.dtype(np.int64): "int64",
                np.dtype(np.int32): "int32", np.dtype(np.int8): "int8",
                np.dtype(np.bool_): "bool_"}


def _arrow_array(col: Column) -> Any:
    """One column as a pyarrow array, from its buffers (no pandas; see `write_parquet`)."""
    import pyarrow as pa

    if isinstance(col, Categorical):
        return pa.DictionaryArray.from_arrays(_arrow_array(col.codes),
                                          _arrow_array(texts(col.categories)))
    if col.dtype == object:  # text: every value a str
        data = [value.encode() for value in col.tolist()]
        offsets = np.zeros(len(data) + 1, dtype=np.int64)
        np.cumsum([len(d) for d in data], out=offsets[1:])
        kind = pa.string() if offsets[-1] < 2**31 else pa.large_string()
        offsets = offsets.astype(np.int32 if kind == pa.string() else np.int64)
        return pa.Array.from_buffers(kind, len(data), [None, pa.py_buffer(offsets),
                                                       pa.py_buffer(b"".join(data))])
    kind = getattr(pa, _ARROW_TYPES[col.dtype])()
    values = np.ascontiguousarray(col)
    if values.dtype == np.bool_:  # arrow packs booleans into bits
        values = np.packbits(values, bitorder="little")
    validity = None
    num_nulls = 0
    if col.dtype.kind == "f":
        valid = ~np.isnan(col)
        num_nulls = int(len(col) - valid.sum())
        if num_nulls:
            validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(kind, len(col), [validity, pa.py_buffer(values)],
                                 null_count=num_nulls)


def texts(values: Sequence[str]) -> np.ndarray:
    """A text column: strings as a 1-D object array (`np.array` of them would make a fixed-width
    character array, or a 2-D one of a list of equal-length tuples)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def plain(value: Any) -> Any:
    """A numpy scalar as the Python value an error shows."""
    return value.item() if isinstance(value, np.generic) else value
