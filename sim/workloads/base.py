"""Workloads: where requests come from (a trace format or a synthetic generator).

Every format turns its input into a `Workload`, a few numpy columns in arrival order with the
first arrival at t=0; the common selection (time window, first N, rate scale) applies after.
A new format is one file with a config class, a `load` function and one registry decorator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sim.errors import InputError
from sim.registry import Registry


@dataclass(frozen=True)
class Workload:
    """Requests as columns, sorted by arrival."""

    arrival_s: np.ndarray  # float64, seconds since the first arrival (before rate scaling)
    num_prompt_tokens: np.ndarray  # int64, >= 1
    num_output_tokens: np.ndarray  # int64, >= 1
    hash_ids: list[tuple[int, ...]] | None = None  # prefix-block ids (Mooncake), if any

    def __len__(self) -> int:
        return len(self.arrival_s)

    def take(self, index: np.ndarray | slice) -> Workload:
        hash_ids = None
        if self.hash_ids is not None:
            hash_ids = [self.hash_ids[i] for i in np.arange(len(self))[index]]
        return Workload(self.arrival_s[index], self.num_prompt_tokens[index],
                        self.num_output_tokens[index], hash_ids)


class WorkloadConfig(BaseModel):
    """Fields every format has: which format, and which part of its requests to take."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str
    start_s: float = Field(0.0, ge=0, description="skip requests arriving before this time")
    end_s: float | None = Field(None, gt=0, description="drop requests arriving at or after it")
    num_requests: int | None = Field(None, gt=0, description="then keep the first N")
    rate_scale: float = Field(1.0, gt=0, description="2.0 replays the arrivals at twice the rate")


class ArrivalConfig(BaseModel):
    """Generated arrivals: Poisson, or Gamma inter-arrival times with a given CV (burstier > 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    process: Literal["poisson", "gamma"] = "poisson"
    qps: float = Field(gt=0)
    cv: float = Field(1.0, gt=0, description="coefficient of variation of inter-arrival times")

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
    path: Path


class ArrivalsConfig(TraceConfig):
    """A file of request lengths without times: arrivals are generated."""

    arrivals: ArrivalConfig


class ColumnsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    arrival: str | None = None
    prompt_tokens: str
    output_tokens: str


class GenericConfig(TraceConfig):
    """Any CSV or JSONL file: name its columns; arrivals from a column or generated."""

    columns: ColumnsConfig
    time_unit: Literal["s", "ms", "us", "datetime"] = "s"
    arrivals: ArrivalConfig | None = None

    @model_validator(mode="after")
    def _one_arrival_source(self) -> GenericConfig:
        if (self.columns.arrival is None) == (self.arrivals is None):
            raise ValueError("give exactly one of columns.arrival and arrivals")
        return self


def resolve(base_dir: Path, path: Path) -> Path:
    return path if path.is_absolute() else base_dir / path


def read_table(path: Path, kind: Literal["csv", "jsonl"], field: str) -> pd.DataFrame:
    """Read a CSV or JSON-lines file; errors name the file."""
    if not path.is_file():
        raise InputError(path, field, str(path), "file not found")
    try:
        df = pd.read_csv(path) if kind == "csv" else pd.read_json(path, lines=True, dtype=False)
    except (ValueError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise InputError(path, field, str(path), f"cannot parse as {kind}: {exc}") from None
    df.attrs["first_line"] = 2 if kind == "csv" else 1  # file line of the first row
    return df


def where(df: pd.DataFrame, name: str, row: int) -> str:
    """`name (line N)`: the field of a bad value, with its line in the file."""
    return f"{name} (line {row + df.attrs.get('first_line', 1)})"


def column(df: pd.DataFrame, name: str, path: Path) -> pd.Series:
    if name not in df.columns:
        raise InputError(path, f"column {name!r}", list(df.columns), "missing")
    return df[name]


def token_counts(df: pd.DataFrame, name: str, path: Path) -> np.ndarray:
    """A column of token counts, each a positive integer; errors name the first bad row."""
    values = column(df, name, path)
    numeric = pd.to_numeric(values, errors="coerce").to_numpy(dtype=np.float64)
    bad = ~np.isfinite(numeric) | (numeric != np.floor(numeric)) | (numeric < 1)
    if bad.any():
        row = int(np.argmax(bad))
        raise InputError(path, where(df, name, row), values.iloc[row],
                         "must be a positive integer number of tokens")
    return numeric.astype(np.int64)


def seconds(df: pd.DataFrame, name: str, unit: str, path: Path) -> np.ndarray:
    """An arrival-time column as seconds since its first value, checked non-decreasing."""
    values = column(df, name, path)
    if unit == "datetime":
        times = pd.to_datetime(values, format="ISO8601", errors="coerce")
        bad = times.isna().to_numpy()
        arrival = (times - times.iloc[0]).dt.total_seconds().to_numpy() if not bad.any() else None
    else:
        numeric = pd.to_numeric(values, errors="coerce").to_numpy(dtype=np.float64)
        bad = ~np.isfinite(numeric)
        scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]
        arrival = (numeric - numeric[0]) * scale if not bad.any() else None
    if arrival is None:
        row = int(np.argmax(bad))
        raise InputError(path, where(df, name, row), values.iloc[row], "not a time")
    backwards = np.flatnonzero(np.diff(arrival) < 0)
    if backwards.size:
        row = int(backwards[0]) + 1
        raise InputError(path, where(df, name, row), values.iloc[row],
                         "arrival times must not decrease")
    return arrival


def select(workload: Workload, config: WorkloadConfig) -> Workload:
    """Apply the time window, then the first N, then the rate scale."""
    arrival = workload.arrival_s
    keep = arrival >= config.start_s
    if config.end_s is not None:
        keep &= arrival < config.end_s
    chosen = workload.take(np.flatnonzero(keep))
    if config.num_requests is not None:
        chosen = chosen.take(slice(0, config.num_requests))
    if len(chosen):
        # Time restarts at the first kept arrival, then compresses by the rate scale.
        shifted = (chosen.arrival_s - chosen.arrival_s[0]) / config.rate_scale
        chosen = Workload(shifted, chosen.num_prompt_tokens, chosen.num_output_tokens,
                          chosen.hash_ids)
    return chosen
