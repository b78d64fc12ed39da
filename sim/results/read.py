"""Reading result files back (for plots, reports and exports): what kind of directory this is,
and its tables and JSON, each checked against what servesim writes there, so that a file that is
missing, corrupt, edited or of another version is one `InputError` line naming it, the field and
the value, never a traceback and never a figure or export drawn from nonsense.

JSON is read strictly (`sim.config.input_file.loads`: no NaN, no key given twice), then
`summary.json` is checked for the sections readers rely on. Tables are checked column by column:
integers, finite numbers, numbers that may be missing (NaN) and text where servesim writes them; a
finished request with no TTFT, or a run's requests or iterations fewer than its summary
counts, is refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow as pa
import yaml

from sim.config.errors import InputError
from sim.config.input_file import FileProblem, loads, read_bytes, stat_regular
from sim.engine.iteration_log import COLUMNS as ITERATION_LOG_COLUMNS
from sim.results.columns import plain
from sim.results.formats import REPLICATED_COMPARISON_FILE, REPLICATIONS_FILE
from sim.results.outdir import is_run_dir

Kind = Literal["run", "sweep", "capacity", "comparison", "replications",
               "replicated_comparison", "plan"]
UNREADABLE = (OSError, ValueError, pa.ArrowException, yaml.YAMLError)
# A run's summary is a few kilobytes, a capacity search's or replications' record a few hundred;
# past this a "result" JSON file is not one servesim wrote.
MAX_JSON_BYTES = 64 * 2**20
EDITED = "written by another servesim version, or edited?"


PLAN_MARKER = "plan_search.json"  # written when a plan's search starts (`servesim plan`)


def directory_kind(path: Path) -> Kind:
    """A directory's kind, from its own marker file: a run (`summary.json`, written whole with
    its other files), a sweep (`sweep.json`), a capacity search (`capacity.json` or
    `trials.csv`), a plan (`plan_search.json`), a comparison (`comparison.csv`), replications
    of one scenario (`replications.json`, from `simulate --replications`), a replicated
    comparison (`comparison_replications.csv`, from `compare --replications`). Only a sweep
    written before sweeps had a marker is recognised by its table or `runs/` folder."""
    if not path.is_dir():
        raise InputError(path, "RESULTS", str(path),
                         "not a directory" if path.exists() else "directory not found")
    if is_run_dir(path):
        return "run"
    if (path / REPLICATIONS_FILE).is_file():
        return "replications"
    if (path / "sweep.json").is_file():
        return "sweep"
    if (path / "capacity.json").is_file() or (path / "trials.csv").is_file():
        return "capacity"
    if (path / PLAN_MARKER).is_file():
        return "plan"
    if (path / REPLICATED_COMPARISON_FILE).is_file():
        return "replicated_comparison"
    if (path / "comparison.csv").is_file():
        return "comparison"
    if (path / "results.parquet").is_file() or (path / "runs").is_dir():
        return "sweep"
    raise InputError(path, "RESULTS", str(path), "no servesim results here (no summary.json, "
                     f"{REPLICATIONS_FILE}, sweep.json, capacity.json, comparison.csv or "
                     f"{REPLICATED_COMPARISON_FILE})")


def _problem(exc: BaseException, path: Path) -> str:
    """The reader's complaint, without the path (named already), first sentence only."""
    text = " ".join(str(exc).split()).split(f"'{path}': ")[-1].split(". ")[0]
    return f"cannot read it ({text[:120] or type(exc).__name__})"


def _exists(path: Path, missing: str | None) -> None:
    """`path` is a regular file: a named pipe would hang the reader, a directory fail in it."""
    if not path.exists() and not path.is_symlink():
        raise InputError(path, "<file>", str(path), missing or "file not found")
    try:
        stat_regular(path)
    except FileProblem as exc:
        raise InputError(path, "<file>", str(path), str(exc)) from None


def _columns(df: pd.DataFrame, path: Path, columns: Sequence[str]) -> pd.DataFrame:
    absent = [c for c in columns if c not in df.columns]
    if absent:
        raise InputError(path, "<columns>", absent, "missing: not a servesim result file")
    return df


def read_parquet(path: Path, columns: Sequence[str] = (), missing: str | None = None
                 ) -> pd.DataFrame:
    return _read_table(pd.read_parquet, path, columns, missing)


def read_csv(path: Path, columns: Sequence[str] = (), missing: str | None = None
             ) -> pd.DataFrame:
    return _read_table(pd.read_csv, path, columns, missing)


def _read_table(reader: Callable[[Path], pd.DataFrame], path: Path, columns: Sequence[str],
                missing: str | None) -> pd.DataFrame:
    """A result table with the `columns` asked for, each of its columns of the kind servesim
    writes there (`check_table`); every failure one line naming the file."""
    _exists(path, missing)
    try:
        df = reader(path)
    except UNREADABLE as exc:
        raise InputError(path, "<file>", str(path), _problem(exc, path)) from None
    check_table(_columns(df, path, columns), path)
    return df


def read_json(path: Path, missing: str | None = None) -> dict[str, Any]:
    """A result JSON object, read strictly; a run's `summary.json` checked (`check_summary`)."""
    _exists(path, missing)
    try:
        data = loads(read_bytes(path, MAX_JSON_BYTES))
    except FileProblem as exc:
        raise InputError(path, "<file>", str(path), f"cannot read it: {exc}") from None
    if not isinstance(data, dict):
        raise InputError(path, "<top level>", type(data).__name__, "must be a JSON object")
    if path.name == SUMMARY_FILE:
        check_summary(data, path)
    return data


def read_yaml_file(path: Path) -> Any:
    _exists(path, None)
    try:
        return yaml.safe_load(path.read_text())
    except UNREADABLE as exc:
        raise InputError(path, "<file>", str(path), _problem(exc, path)) from None


# -- summary.json ------------------------------------------------------------------------------

SUMMARY_FILE = "summary.json"


def _summary_model() -> Any:
    """The sections of a run's summary that plots, reports and exports read: required where
    every servesim run writes them, checked for type where present. Other keys pass. Built on
    first use: pydantic is imported where a summary is read, not by `servesim --help`."""
    from pydantic import BaseModel, ConfigDict, Field

    loose = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    class Stats(BaseModel):  # one latency distribution; None where there were no values
        model_config = loose
        count: int = Field(ge=0)
        mean: float | None = None
        p50: float | None = None
        p90: float | None = None
        p99: float | None = None
        max: float | None = None

    class Run(BaseModel):
        model_config = loose
        model: str
        end_s: float = Field(ge=0)
        num_kv_blocks: int | None = Field(None, ge=0)

    class Replica(BaseModel):
        model_config = loose
        replica_id: int = Field(ge=0)
        pool: str | None = None  # None: a replica that ran no iteration

    class Requests(BaseModel):
        model_config = loose
        total: int = Field(ge=0)
        finished: int = Field(ge=0)
        rejected: int = Field(ge=0)
        unfinished: int = Field(ge=0)
        failed: int = Field(0, ge=0)  # (results written before client timeouts have none)

    class Verdict(BaseModel):
        model_config = loose
        verdict: str
        detail: str | None = None

    class Summary(BaseModel):
        model_config = loose
        run: Run
        requests: Requests
        replicas: list[Replica]
        num_iterations: int = Field(ge=0)
        num_preemptions: int | None = Field(None, ge=0)
        ttft_s: Stats
        tbt_s: Stats
        e2e_s: Stats
        tpot_s: Stats | None = None
        scheduling_delay_s: Stats | None = None
        max_tbt_per_request_s: Stats | None = None
        throughput: dict[str, float | None]
        cost: dict[str, float | None] | None = None
        slo: dict[str, float | None] | None = None
        overload: Verdict | None = None
        warmup: dict[str, Any] | None = None

    return Summary


_SUMMARY: list[Any] = []  # the model, once built


def check_summary(data: dict[str, Any], path: Path) -> None:
    """`data` (a run's summary.json) has the sections its readers rely on, of their types:
    else one line naming the first field that is wrong."""
    from pydantic import ValidationError

    if not _SUMMARY:
        _SUMMARY.append(_summary_model())
    try:
        _SUMMARY[0].model_validate(data)
    except ValidationError as exc:
        field, value, problem = InputError.from_validation(path, exc).problems[0]
        raise InputError(path, field, value, f"{problem} ({EDITED})") from None


# -- tables --------------------------------------------------------------------------------------

INTEGER, NUMBER, FINITE, TEXT, BOOLEAN = ("an integer", "a number", "a finite number", "text",
                                          "true or false")
# A time, a duration or a rate: never negative in any table servesim writes; missing (NaN) where
# a run had none to measure.
NOT_NEGATIVE = "a number, not negative"
COUNT = "a count (an integer, not negative; missing where not known)"
# A run's tables, column by column, as `Results.write` writes them (columns not named pass,
# except times: see `column_kind`).
RUN_TABLES: dict[str, dict[str, str]] = {
    "requests.parquet": {
        **dict.fromkeys(("request_id", "replica_id", "decode_replica_id", "num_prompt_tokens",
                         "num_output_tokens", "num_generated_tokens", "num_computed_tokens",
                         "num_cached_tokens", "num_preemptions", "num_recomputed_tokens"),
                        INTEGER),
        "arrival_s": FINITE, "status": TEXT, "reason": TEXT},
    "iterations.parquet": {
        "replica_id": INTEGER, "iteration": INTEGER, "pool": TEXT,
        **{name: FINITE if code == "d" else INTEGER
           for name, code in ITERATION_LOG_COLUMNS.items()}},
    "tokens.parquet": {"request_id": INTEGER, "token_index": INTEGER, "time_s": FINITE},
    "tbt_gaps.parquet": {"gap_s": FINITE, "count": INTEGER},
    "trials.csv": {"seed": INTEGER, "rate": FINITE, "qps": FINITE, "ok": BOOLEAN},
    "comparison.csv": {"variant": TEXT, "finished": COUNT, "failed": COUNT, "num_gpus": COUNT,
                       "num_preemptions": COUNT, "slo_attainment": NOT_NEGATIVE,
                       "usd_per_million_tokens": NOT_NEGATIVE},
}
RUN_FILES = ("requests.parquet", "iterations.parquet", "tokens.parquet", "tbt_gaps.parquet")
STATUSES = ("finished", "rejected", "failed", "unfinished")
# What every finished request has (the requests of a summary's latency rows).
FINISHED_TIMES = ("first_token_s", "finish_s", "ttft_s", "e2e_s")
# A time (`*_s`), a rate (`*_per_s`) or its interval's ends (`*_s_lo`, `*_s_hi`): a number, not
# negative, missing (NaN) where a run had none to measure.
_TIME = re.compile(r"_s(_lo|_hi)?$")
# Tables written once their runs are done, with a row per run or variant: one with none would
# draw an empty figure without a word.
NEVER_EMPTY = {"results.parquet": "a sweep writes one per run",
               "results_ci.parquet": "a sweep writes one per point",
               "comparison.csv": "a comparison writes one per variant"}
# Where a run's summary counts a table's rows: (summary section, key), what a row is.
ROW_COUNTS = {"requests.parquet": (("requests", "total"), "requests"),
              "iterations.parquet": (("num_iterations",), "iterations")}


def column_kind(table: str, column: str) -> str | None:
    """What `column` of result file `table` holds: None for a column not checked (a sweep's
    varied fields, which may be anything, have a dot in their names)."""
    known = RUN_TABLES.get(table, {}).get(column)
    if known is not None:
        return known
    if "." in column or not _TIME.search(column):
        return None
    # A run's own tables: `Results.load` checks their times against each other, and names
    # what is wrong more closely than "negative" (a finish before its arrival, say).
    return NUMBER if table in RUN_FILES else NOT_NEGATIVE


def check_table(df: pd.DataFrame, path: Path) -> None:
    """Each column of result table `path` of the kind servesim writes there (`column_kind`); a
    run's requests consistent with their status and, beside a summary, as many rows as it
    counts. Else one line: the file, the column, the first wrong value."""
    for column in df.columns:
        kind = column_kind(path.name, str(column))
        if kind is not None:
            _check_column(df[column], kind, path)
    if path.name in NEVER_EMPTY and not len(df):
        raise InputError(path, "<rows>", 0, f"no rows: {NEVER_EMPTY[path.name]} ({EDITED})")
    if path.name == "requests.parquet":
        _check_requests(df, path)
    if path.name in ROW_COUNTS and (path.parent / SUMMARY_FILE).is_file():
        _check_row_count(df, path)


def _wrong(path: Path, column: Any, value: Any, problem: str, row: int | None = None
           ) -> InputError:
    where = f" (row {row})" if row is not None else ""
    return InputError(path, str(column), value, f"{problem}{where} ({EDITED})")


def _check_column(series: pd.Series, kind: str, path: Path) -> None:
    dtype = series.dtype
    if kind == TEXT:
        if isinstance(dtype, pd.CategoricalDtype) or pd.api.types.is_string_dtype(dtype):
            return
        raise _wrong(path, series.name, _first(series), f"must be {TEXT}, not {dtype}", 0)
    if kind == BOOLEAN:
        if not pd.api.types.is_bool_dtype(dtype):
            raise _wrong(path, series.name, _first(series), f"must be {BOOLEAN}", 0)
        return
    if series.isna().all() and kind in (NUMBER, NOT_NEGATIVE):
        return  # nothing measured (a column of None reads back as objects)
    if pd.api.types.is_bool_dtype(dtype) or not pd.api.types.is_numeric_dtype(dtype):
        bad = next((i for i, v in enumerate(series) if not _is_number(v)), 0)
        raise _wrong(path, series.name, series.iloc[bad], f"must be {kind}", bad)
    values = series.to_numpy()
    if kind in (NOT_NEGATIVE, COUNT):
        with np.errstate(invalid="ignore"):
            negative = np.flatnonzero(values.astype(np.float64) < 0)
        if negative.size:
            bad = int(negative[0])
            raise _wrong(path, series.name, plain(values[bad]), f"must be {kind}", bad)
        if kind == COUNT and pd.api.types.is_float_dtype(dtype):
            with np.errstate(invalid="ignore"):
                bad_mask = np.isinf(values) | (np.isfinite(values) & (values != np.round(values)))
            if bad_mask.any():
                bad = int(np.flatnonzero(bad_mask)[0])
                raise _wrong(path, series.name, values[bad], f"must be {kind}", bad)
        kind = NUMBER
    if kind == INTEGER and not pd.api.types.is_integer_dtype(dtype):
        with np.errstate(invalid="ignore"):
            bad_mask = ~np.isfinite(values) | (values != np.round(values))
        if bad_mask.any():
            bad = int(np.flatnonzero(bad_mask)[0])
            raise _wrong(path, series.name, values[bad], f"must be {INTEGER}", bad)
        return
    if pd.api.types.is_float_dtype(dtype):
        bad_mask = np.isinf(values) if kind == NUMBER else ~np.isfinite(values)
        if bad_mask.any():
            bad = int(np.flatnonzero(bad_mask)[0])
            raise _wrong(path, series.name, values[bad], f"must be {FINITE}", bad)


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float | np.integer | np.floating)
            and not isinstance(value, bool | np.bool_))


def _first(series: pd.Series) -> Any:
    return series.iloc[0] if len(series) else None


def _check_requests(df: pd.DataFrame, path: Path) -> None:
    """Statuses are servesim's, and a finished request has its token and finish times."""
    if "status" not in df:
        return
    status = df["status"].astype(str).to_numpy()
    unknown = np.flatnonzero(~np.isin(status, STATUSES))
    if unknown.size:
        row = int(unknown[0])
        raise _wrong(path, "status", status[row], f"must be one of {', '.join(STATUSES)}", row)
    finished = status == "finished"
    for column in FINISHED_TIMES:
        if column in df:
            missing = np.flatnonzero(finished & ~np.isfinite(df[column].to_numpy(np.float64)))
            if missing.size:
                row = int(missing[0])
                raise _wrong(path, column, df[column].iloc[row],
                             "a finished request must have one", row)


def _check_row_count(df: pd.DataFrame, path: Path) -> None:
    """As many rows as the run's summary counts (a table emptied or cut short would draw, or
    export, a different run without a word)."""
    keys, what = ROW_COUNTS[path.name]
    summary_path = path.parent / SUMMARY_FILE
    value: Any = read_json(summary_path)
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and value != len(df):
        raise InputError(path, "<rows>", len(df), f"{summary_path.name} counts {value:,} "
                         f"{what} ({'.'.join(keys)}): not this run's file ({EDITED})")
