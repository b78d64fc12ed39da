"""Workloads: where requests come from (a trace format or a synthetic generator).

Every format turns its input into a `Workload`, a few numpy columns in arrival order with the
first arrival at t=0; the common selection (time window, first N, rate scale) applies after.
A new format is one file with a config class, a `load` function and one registry decorator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, Field, PrivateAttr, model_validator

from sim.errors import INPUT_MODEL, InputError, invalid
from sim.registry import Registry
from sim.workloads.cache import csv_header, csv_line, read_table
from sim.workloads.table import TraceTable, seconds_since_first

if TYPE_CHECKING:
    import pandas as pd

# Tokens in one request's prompt or output. The longest contexts served today are about 10**7
# tokens; 10**9 leaves room while a chunk's causal attention pairs (about q**2 / 2) and every
# token sum stay far inside int64.
MAX_TOKENS = 10**9
# Requests in one run: the simulator keeps a Python object per request (a few hundred bytes
# with its token runs), so 10**7 requests already take gigabytes and hours.
MAX_REQUESTS = 10_000_000
# Simulated times are float64 seconds since the first arrival: below 2**32 s (136 years) they
# resolve 2**-20 s, about a microsecond, so TTFT and TBT keep their resolution.
MAX_SPAN_S = float(2**32)


@dataclass(frozen=True)
class Workload:
    """Requests as columns, sorted by arrival."""

    arrival_s: np.ndarray  # float64, seconds since the first arrival (before rate scaling)
    num_prompt_tokens: np.ndarray  # int64, >= 1
    num_output_tokens: np.ndarray  # int64, >= 1
    # Prefix-block ids (Mooncake, or generated), if any: requests sharing leading ids share a
    # prefix; each id stands for `hash_block_tokens` tokens (512 for Mooncake).
    hash_ids: list[tuple[int, ...]] | None = None
    hash_block_tokens: int = 0

    def __len__(self) -> int:
        return len(self.arrival_s)

    def take(self, index: np.ndarray | slice) -> Workload:
        hash_ids = None
        if self.hash_ids is not None:
            hash_ids = [self.hash_ids[i] for i in np.arange(len(self))[index]]
        return Workload(self.arrival_s[index], self.num_prompt_tokens[index],
                        self.num_output_tokens[index], hash_ids, self.hash_block_tokens)


class WorkloadConfig(BaseModel):
    """Fields every format has: which format, and which part of its requests to take."""

    model_config = INPUT_MODEL

    format: str
    start_s: float = Field(0.0, ge=0, description="skip requests arriving before this time")
    end_s: float | None = Field(None, gt=0, description="drop requests arriving at or after it")
    num_requests: int | None = Field(None, gt=0, le=MAX_REQUESTS,
                                     description="then keep the first N")
    rate_scale: float = Field(1.0, gt=0, description="2.0 replays the arrivals at twice the rate")
    token_scale: float = Field(
        1.0, gt=0, le=1000,
        description="multiply prompt and output lengths (rounded, at least 1 token): a trace's "
                    "shape served by a smaller model or machine (e.g. replay on a CPU)")
    # The scenario file, named by errors of the selection (set by `parse_scenario`).
    _source: str = PrivateAttr("<scenario>")

    @model_validator(mode="after")
    def _window(self) -> WorkloadConfig:
        if self.end_s is not None and self.end_s <= self.start_s:
            raise invalid(("end_s", self.end_s, f"must be after start_s ({self.start_s:g})"))
        return self


class ArrivalConfig(BaseModel):
    """Generated arrivals: Poisson, or Gamma inter-arrival times with a given CV (burstier > 1)."""

    model_config = INPUT_MODEL

    process: Literal["poisson", "gamma"] = "poisson"
    qps: float = Field(gt=0)
    # Gamma's shape is 1/cv**2: the bounds keep it a normal float.
    cv: float = Field(1.0, ge=1e-3, le=1e3,
                      description="coefficient of variation of inter-arrival times (gamma)")

    @model_validator(mode="after")
    def _cv_is_gamma(self) -> ArrivalConfig:
        if self.process == "poisson" and self.cv != 1.0:
            raise invalid(("cv", self.cv, "Poisson arrivals have cv 1: use process: gamma"))
        return self

    def sample(self, num_requests: int, rng: np.random.Generator) -> np.ndarray:
        mean_gap_s = 1.0 / self.qps
        if self.process == "poisson":
            gaps = rng.exponential(mean_gap_s, num_requests)
        else:
            shape = 1.0 / self.cv**2
            gaps = rng.gamma(shape, mean_gap_s / shape, num_requests)
        gaps[0] = 0.0  # the first request opens the trace
        return np.cumsum(gaps)


class Format(ABC):
    """A source of requests."""

    Config: ClassVar[type[WorkloadConfig]] = WorkloadConfig

    @abstractmethod
    def load(self, config: Any, base_dir: Path, rng: np.random.Generator) -> Workload:
        """Read or generate every request; `base_dir` resolves relative paths."""


FORMATS: Registry[type[Format]] = Registry("workload format")


class TraceConfig(WorkloadConfig):
    path: Path = Field(strict=False)  # a string in YAML


class FilteredTraceConfig(TraceConfig):
    """A trace whose rows may be chosen by a condition on its own columns."""

    where: str | None = Field(
        None, min_length=1, max_length=10_000,
        description="keep the rows where this pandas expression over the file's columns is "
                    "true, e.g. \"Model == 'ChatGPT' and `Response tokens` > 0\" (backticks "
                    "around names with spaces); times then start at the first row kept")


class ArrivalsConfig(FilteredTraceConfig):
    """A file of request lengths without times: arrivals are generated."""

    arrivals: ArrivalConfig


class ColumnsConfig(BaseModel):
    model_config = INPUT_MODEL

    arrival: str | None = None
    prompt_tokens: str
    output_tokens: str


class GenericConfig(FilteredTraceConfig):
    """Any CSV or JSONL file: name its columns; arrivals from a column or generated."""

    columns: ColumnsConfig
    time_unit: Literal["s", "ms", "us", "datetime"] = "s"
    arrivals: ArrivalConfig | None = None

    @model_validator(mode="after")
    def _one_arrival_source(self) -> GenericConfig:
        if (self.columns.arrival is None) == (self.arrivals is None):
            raise ValueError("give exactly one of columns.arrival and arrivals")
        if self.arrivals is not None and self.time_unit != "s":
            raise invalid(("time_unit", self.time_unit, "has no effect on generated arrivals"))
        return self


def resolve(base_dir: Path, path: Path) -> Path:
    return path if path.is_absolute() else base_dir / path


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
    """Column `name` (see `TraceTable`: numpy, or a pandas Series for text and JSON lines)."""
    if name not in table.columns:
        raise InputError(path, f"column {name!r}", list(table.columns), "missing")
    return table.columns[name]


def token_counts(table: TraceTable, name: str, path: Path) -> np.ndarray:
    """A column of token counts, each an integer in [1, MAX_TOKENS]; errors name the first bad
    row."""
    values = column(table, name, path)
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
    if _is_json(table) and values.dtype == object:
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
    values = column(table, name, path)
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


def select(workload: Workload, config: WorkloadConfig) -> Workload:
    """Apply the time window, then the first N, then the rate scale. A selection that keeps no
    request, asks for more than there are, or spans too long to simulate is an error."""
    arrival = workload.arrival_s
    keep = arrival >= config.start_s
    if config.end_s is not None:
        keep &= arrival < config.end_s
    chosen = workload.take(np.flatnonzero(keep))
    source, last_s = config._source, float(arrival[-1]) if len(arrival) else 0.0
    if not len(chosen):
        field, value = ("end_s", config.end_s) if config.end_s is not None else (
            "start_s", config.start_s)
        end = "end" if config.end_s is None else f"{config.end_s:g}"
        raise InputError(source, f"workload.{field}", value,
                         f"the window [{config.start_s:g}, {end}) s holds no request "
                         f"(arrivals span 0 to {last_s:g} s)")
    if config.num_requests is not None:
        if config.num_requests > len(chosen):
            windowed = config.start_s > 0 or config.end_s is not None
            raise InputError(source, "workload.num_requests", config.num_requests,
                             f"only {len(chosen)} requests "
                             f"{'in the window' if windowed else 'in the trace'}")
        chosen = chosen.take(slice(0, config.num_requests))
    # Time restarts at the first kept arrival, then compresses by the rate scale.
    shifted = (chosen.arrival_s - chosen.arrival_s[0]) / config.rate_scale
    _check_span(shifted, config)
    prompt, output = chosen.num_prompt_tokens, chosen.num_output_tokens
    hash_block_tokens = chosen.hash_block_tokens
    if config.token_scale != 1.0:
        prompt, output = (_scaled(n, config) for n in (prompt, output))
        # Prefix blocks shrink with the tokens they stand for (approximately, once rounded).
        hash_block_tokens = max(1, round(hash_block_tokens * config.token_scale))
    return Workload(shifted, prompt, output, chosen.hash_ids,
                    hash_block_tokens if chosen.hash_ids is not None else 0)


def _scaled(num_tokens: np.ndarray, config: WorkloadConfig) -> np.ndarray:
    """Token counts times `token_scale`, rounded, at least 1, at most MAX_TOKENS."""
    scaled = np.maximum(1.0, np.rint(num_tokens * config.token_scale))
    if scaled.max() > MAX_TOKENS:
        raise InputError(config._source, "workload.token_scale", config.token_scale,
                         f"makes a request of {scaled.max():.3g} tokens (at most {MAX_TOKENS:.0e})")
    return scaled.astype(np.int64)


def _check_span(arrival_s: np.ndarray, config: WorkloadConfig) -> None:
    """Arrival times must be finite and span less than MAX_SPAN_S; the error names the knob
    that set them: the rate scale, or the rate of generated arrivals."""
    span_s = float(arrival_s[-1]) if np.isfinite(arrival_s).all() else float("inf")
    if span_s < MAX_SPAN_S:
        return
    field, value = "workload.rate_scale", config.rate_scale
    arrivals = getattr(config, "arrivals", None)
    if isinstance(arrivals, ArrivalConfig) and config.rate_scale == 1.0:
        field, value = "workload.arrivals.qps", arrivals.qps
    raise InputError(config._source, field, value,
                     f"arrivals span {span_s:.3g} s; simulated times keep microsecond "
                     f"resolution only below 2**32 s (136 years)")
