"""BurstGPT (HPMLL/BurstGPT): `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log
Type`, with `Timestamp` in seconds since midnight of the trace's first day, `Model` ChatGPT or
GPT-4 and `Log Type` `Conversation log` or `API log`. Failed requests have 0 response tokens:
keep them out with `where: "`Response tokens` > 0"`, and pick a model or a log type the same way
(vLLM's benchmark keeps `Model == 'GPT-4'` rows with response tokens)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sim.config.errors import InputError
from sim.workloads.base import FORMATS, FilteredTraceConfig, Format, Workload
from sim.workloads.fields import column, seconds, token_counts, where
from sim.workloads.where import read_trace

COLUMNS = ["Timestamp", "Request tokens", "Response tokens"]
FAILED_HINT = 'a failed request: keep them out with where: "`Response tokens` > 0"'


@FORMATS.register("burstgpt")
class BurstGPT(Format):
    Config = FilteredTraceConfig

    def load(self, config: FilteredTraceConfig, base_dir: Path,
             rng: np.random.Generator) -> Workload:
        path, table = read_trace(config, base_dir, "csv", COLUMNS)
        response = column(table, "Response tokens", path)
        failed = np.flatnonzero(np.asarray(response == 0, dtype=bool))
        if failed.size:
            row = int(failed[0])
            raise InputError(path, where(table, "Response tokens", row), 0, FAILED_HINT)
        return Workload(
            seconds(table, "Timestamp", "s", path),
            token_counts(table, "Request tokens", path),
            token_counts(table, "Response tokens", path),
        )
