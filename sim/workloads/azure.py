"""Azure LLM inference traces: `TIMESTAMP,ContextTokens,GeneratedTokens` with wall-clock times.
The 2023 files (Splitwise) have 100 ns digits, no zone, CRLF line ends and no final newline; the
2024 week-long files (DynamoLLM, tens of millions of rows) have microseconds and `+00:00`. Large
files are parsed once and cached (`sim/workloads/cache.py`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sim.workloads.base import FORMATS, FilteredTraceConfig, Format, Workload
from sim.workloads.fields import seconds, token_counts
from sim.workloads.where import read_trace

COLUMNS = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]


@FORMATS.register("azure")
class Azure(Format):
    Config = FilteredTraceConfig

    def load(self, config: FilteredTraceConfig, base_dir: Path,
             rng: np.random.Generator) -> Workload:
        path, table = read_trace(config, base_dir, "csv", COLUMNS)
        return Workload(
            seconds(table, "TIMESTAMP", "datetime", path),
            token_counts(table, "ContextTokens", path),
            token_counts(table, "GeneratedTokens", path),
        )
