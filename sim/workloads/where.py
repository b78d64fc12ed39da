"""Reading a trace's rows, and `workload.where` row filters (pandas `DataFrame.eval` syntax,
imported only when a filter is given): errors name the file, the condition and the problem."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from sim.errors import InputError
from sim.workloads.base import FilteredTraceConfig, resolve
from sim.workloads.cache import csv_header, read_table
from sim.workloads.table import TraceTable

if TYPE_CHECKING:
    import pandas as pd


def read_trace(config: FilteredTraceConfig, base_dir: Path, kind: Literal["csv", "jsonl"],
               columns: list[str]) -> tuple[Path, TraceTable]:
    """The trace's path and its rows that `config.where` keeps (all without it), with
    `columns` and those the condition names (every column of a JSON-lines file)."""
    path = resolve(base_dir, config.path)
    if config.where is None:
        return path, read_table(path, kind, "workload.path", columns if kind == "csv" else None)
    if kind == "jsonl":
        table = read_table(path, kind, "workload.path")
        _check_condition(config.where, list(table.columns), path)
        return path, filter_rows(table, config.where, path)
    header = csv_header(path, "workload.path")
    _check_condition(config.where, header, path)
    named = [name for name in header if _names(config.where, name)]
    table = read_table(path, kind, "workload.path", [*columns, *named])
    return path, filter_rows(table, config.where, path)


def _names(condition: str, name: str) -> bool:
    """Whether `condition` may mention column `name` (reading a column too many costs little)."""
    import re

    return f"`{name}`" in condition or (
        name.isidentifier() and re.search(rf"\b{re.escape(name)}\b", condition) is not None)


# What evaluating a well-formed condition may raise on values of the wrong type.
_EVAL_ERRORS = (ValueError, TypeError, KeyError, AttributeError, NotImplementedError)


def _check_condition(condition: str, header: list[str], path: Path) -> None:
    """Syntax and column names, checked on an empty table before the rows are read (types
    are unknown there: other errors wait for the rows)."""
    import pandas as pd

    empty = pd.DataFrame({name: pd.Series([], dtype=object) for name in header})
    try:
        empty.eval(condition)
    except (pd.errors.UndefinedVariableError, SyntaxError, RecursionError):
        _evaluate(empty, condition, path)  # raises its one-line error
    except _EVAL_ERRORS:
        pass


def filter_rows(table: TraceTable, condition: str, path: Path) -> TraceTable:
    """The rows where `condition` (pandas `DataFrame.eval` syntax, evaluated on the rows as a
    DataFrame) is true; they keep their position in the file, for errors to give the line."""
    keep = _evaluate(table.frame(), condition, path)
    if not keep.any():
        raise InputError(path, "workload.where", condition,
                         f"selects none of the {len(table)} rows")
    return table.take(keep)


def _evaluate(df: pd.DataFrame, condition: str, path: Path) -> np.ndarray:
    import pandas as pd

    try:
        result = df.eval(condition)
    except pd.errors.UndefinedVariableError as exc:
        name = str(exc).split("'")[1] if str(exc).count("'") >= 2 else str(exc)
        raise InputError(path, "workload.where", condition,
                         f"no column {name!r} (backticks around names with spaces); the "
                         f"file's columns are {list(df.columns)}") from None
    except SyntaxError as exc:
        raise InputError(path, "workload.where", condition,
                         f"not a pandas expression: {exc.msg} (backticks around names with "
                         "spaces)") from None
    except _EVAL_ERRORS as exc:
        raise InputError(path, "workload.where", condition,
                         f"cannot evaluate: {' '.join(str(exc).split())}") from None
    except RecursionError:  # Python's parser and pandas' evaluator recurse per nesting level
        raise InputError(path, "workload.where", condition,
                         "nested too deeply to evaluate (e.g. thousands of 'not' or '-')"
                         ) from None
    if isinstance(result, pd.Series) and isinstance(result.dtype, pd.BooleanDtype):
        result = result.fillna(False)  # a comparison with a missing value keeps no row
    if not isinstance(result, pd.Series) or result.dtype != bool:
        raise InputError(path, "workload.where", condition,
                         "must be a condition (true or false for each row)")
    return result.to_numpy(dtype=bool)
