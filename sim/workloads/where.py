"""Reading a trace's rows, and `workload.where` row filters (pandas `DataFrame.eval` syntax,
imported only when a filter is given): errors name the file, the condition and the problem."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NoReturn

import numpy as np

from sim.config.errors import InputError
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


# What evaluating a well-formed condition may raise on values of the wrong type (or on
# literals: `1/0`, `1e308**2`).
_EVAL_ERRORS = (ValueError, TypeError, KeyError, AttributeError, NotImplementedError,
                ArithmeticError)


def _check_condition(condition: str, header: list[str], path: Path) -> None:
    """Syntax and column names, checked on an empty table before the rows are read (types
    are unknown there: other errors wait for the rows)."""
    import tokenize

    import pandas as pd

    _refuse_unsafe(condition, path)
    empty = pd.DataFrame({name: pd.Series([], dtype=object) for name in header})
    try:
        empty.eval(condition)
    except (pd.errors.UndefinedVariableError, SyntaxError, tokenize.TokenError, RecursionError):
        _evaluate(empty, condition, path)  # raises its one-line error
    except _EVAL_ERRORS:
        pass


# What a row filter is made of: the file's columns, literals, comparisons (`in [...]` too),
# `and`/`or`/`not`, arithmetic and calls of pandas' math functions (`abs`, `log`, ...) or of
# its names `Timestamp`, `datetime`, `list`, `tuple`. Anything else is refused before pandas
# sees it, because pandas evaluates more than a filter needs, on the data or in Python:
# attributes and methods (`x.to_csv('f')` writes a file, `x.repeat(10**9)` fills memory),
# `@name` (the evaluating function's own variables: `@path.unlink()`), indexing, lambdas.
_ALLOWED_NODES = (
    ast.Module, ast.Expr, ast.Expression, ast.Load,
    ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.Invert, ast.USub, ast.UAdd,
    ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
    ast.BitAnd, ast.BitOr,
    ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn,
    ast.Name, ast.Constant, ast.List, ast.Tuple, ast.Call, ast.keyword,
)
_NODE_NAMES = {"Attribute": "an attribute or method ('.name')", "Subscript": "indexing ('[]')",
               "Lambda": "a lambda", "Assign": "an assignment ('=')"}
# pandas folds arithmetic on literals in Python, whose integers and strings have no size
# limit: `9**9**9**9` never returns and `'a' * 10**10` takes 10 GB. So `**` takes a number of
# at most this size as its exponent (`2**20`, `x ** 2`: what a filter on token counts or times
# needs) and no `**` inside its operands (each of at most 10,000 characters of digits raised
# to at most the 64th power is at most 640,000 digits: fast); `+ - * / // %` take no string,
# bytes or list literal (`'a' * n` repeats, `'%0999999999d' % 1` pads). `pow` and `<<` are
# not pandas functions or operators.
_MAX_EXPONENT = 64


def _refuse_unsafe(condition: str, path: Path) -> None:
    """Refuse, in one line, what a row filter has no use for and pandas would evaluate at any
    cost: see `_ALLOWED_NODES` and `_MAX_EXPONENT`. The expression is read as pandas reads it
    (its own preparser, so backticks and strings split alike); one that does not parse is left
    to pandas, which says why."""
    import tokenize

    def refuse(problem: str) -> NoReturn:
        raise InputError(path, "workload.where", condition, problem)

    try:  # DataFrame.eval's preparser (pandas' PandasExprVisitor): private names
        from pandas.core.computation.expr import (  # type: ignore[attr-defined]
            _compose,
            _preparse,
            _replace_booleans,
            _replace_locals,
        )
        from pandas.core.computation.ops import LOCAL_TAG  # type: ignore[attr-defined]
        from pandas.core.computation.parsing import clean_backtick_quoted_toks
    except ImportError:  # a pandas that moved them: backticked names as plain ones, no '@'
        if "@" in re.sub(r"`[^`]*`|'[^']*'|\"[^\"]*\"", "", condition):
            refuse("'@' (a Python variable) is not allowed: a row filter reads only the "
                   "file's columns")
        LOCAL_TAG = "__pd_eval_local_"
        prepared = re.sub(r"`[^`]*`", "_column", condition)
    else:
        try:
            prepared = _preparse(condition, f=_compose(
                _replace_locals, _replace_booleans, clean_backtick_quoted_toks))
        except (SyntaxError, tokenize.TokenError, ValueError):
            return  # pandas parses it the same way and says why
    try:
        tree = ast.parse(prepared)
    except (SyntaxError, tokenize.TokenError, ValueError):
        return  # pandas parses it the same way and says why
    except RecursionError:
        refuse("nested too deeply to evaluate (e.g. thousands of 'not' or '-')")
    for node in ast.walk(tree):  # iterative: no recursion however deep the nesting
        if not isinstance(node, _ALLOWED_NODES):
            name = type(node).__name__
            refuse(f"{_NODE_NAMES.get(name, repr(name))} is not allowed in a row filter "
                   "(columns, literals, comparisons, and/or/not, arithmetic, math functions)")
        if isinstance(node, ast.Name) and node.id.startswith(LOCAL_TAG):
            refuse(f"'@{node.id.removeprefix(LOCAL_TAG)}' is a Python variable, not a column: "
                   "a row filter reads only the file's columns")
        if isinstance(node, ast.Call) and not isinstance(node.func, ast.Name):
            refuse("only a named function can be called (e.g. abs(x))")
        if not isinstance(node, ast.BinOp):
            continue
        for operand in (node.left, node.right):
            if isinstance(operand, ast.List | ast.Tuple) or (
                    isinstance(operand, ast.Constant)
                    and isinstance(operand.value, str | bytes)):
                refuse("arithmetic on a string or list literal is not allowed (e.g. 'a' * n "
                       "repeats it n times)")
        if isinstance(node.op, ast.Pow):
            if not _small_number(node.right):
                refuse(f"'**' takes a number of at most {_MAX_EXPONENT} as its exponent "
                       "(e.g. 2**20 or x ** 2): a larger or computed one can take Python "
                       "forever (9**9**9**9)")
            if any(isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Pow)
                   for inner in ast.walk(node.left)):
                refuse("'**' inside the operand of another '**' is not allowed: a power of a "
                       "power can take Python forever (9**9**9**9)")


def _small_number(node: ast.expr) -> bool:
    """Whether `node` is an int or float literal (signed or not) of at most `_MAX_EXPONENT`."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        node = node.operand
    return (isinstance(node, ast.Constant) and isinstance(node.value, int | float)
            and not isinstance(node.value, bool) and abs(node.value) <= _MAX_EXPONENT)


def filter_rows(table: TraceTable, condition: str, path: Path) -> TraceTable:
    """The rows where `condition` (pandas `DataFrame.eval` syntax, evaluated on the rows as a
    DataFrame) is true; they keep their position in the file, for errors to give the line."""
    keep = _evaluate(table.frame(), condition, path)
    if not keep.any():
        raise InputError(path, "workload.where", condition,
                         f"selects none of the {len(table)} rows")
    return table.take(keep)


def _evaluate(df: pd.DataFrame, condition: str, path: Path) -> np.ndarray:
    import tokenize

    import pandas as pd

    _refuse_unsafe(condition, path)
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
    except tokenize.TokenError as exc:  # an unclosed bracket
        raise InputError(path, "workload.where", condition,
                         f"not a pandas expression: {exc.args[0]} (backticks around names "
                         "with spaces)") from None
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
