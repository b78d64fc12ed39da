"""Reading result files back (for plots): what kind of directory this is, and its tables and
JSON, with a one-line `InputError` for a file that is missing, corrupt or lacks a column."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import pandas as pd
import pyarrow as pa
import yaml

from sim.errors import InputError
from sim.outdir import is_run_dir
from sim.replications import COMPARISON_FILE as REPLICATED_COMPARISON_FILE
from sim.replications import RESULT_FILE as REPLICATIONS_FILE

Kind = Literal["run", "sweep", "capacity", "comparison", "replications",
               "replicated_comparison"]
UNREADABLE = (OSError, ValueError, pa.ArrowException, yaml.YAMLError)


def directory_kind(path: Path) -> Kind:
    """A directory's kind, from its own marker file: a run (`summary.json`, written whole with
    its other files), a sweep (`sweep.json`), a capacity search (`capacity.json` or
    `trials.csv`), a comparison (`comparison.csv`), replications of one scenario
    (`replications.json`, from `simulate --replications`), a replicated comparison
    (`comparison_replications.csv`, from `compare --replications`). Only a sweep written
    before sweeps had a marker is recognised by its table or `runs/` folder."""
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
    if not path.is_file():
        raise InputError(path, "<file>", str(path), missing or "file not found")


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
    """A result table with the `columns` asked for; every failure one line naming the file."""
    _exists(path, missing)
    try:
        df = reader(path)
    except UNREADABLE as exc:
        raise InputError(path, "<file>", str(path), _problem(exc, path)) from None
    return _columns(df, path, columns)


def read_json(path: Path, missing: str | None = None) -> dict[str, Any]:
    _exists(path, missing)
    try:
        data = json.loads(path.read_text())
    except UNREADABLE as exc:
        raise InputError(path, "<file>", str(path), _problem(exc, path)) from None
    if not isinstance(data, dict):
        raise InputError(path, "<top level>", type(data).__name__, "must be a JSON object")
    return data


def read_yaml_file(path: Path) -> Any:
    _exists(path, None)
    try:
        return yaml.safe_load(path.read_text())
    except UNREADABLE as exc:
        raise InputError(path, "<file>", str(path), _problem(exc, path)) from None
