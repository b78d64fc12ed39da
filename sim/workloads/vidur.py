"""Vidur's processed traces: `arrived_at,num_prefill_tokens,num_decode_tokens`, seconds."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sim.workloads.base import FORMATS, FilteredTraceConfig, Format, Workload
from sim.workloads.fields import seconds, token_counts
from sim.workloads.where import read_trace


@FORMATS.register("vidur")
class Vidur(Format):
    Config = FilteredTraceConfig

    def load(self, config: FilteredTraceConfig, base_dir: Path, rng: np.random.Generator
             ) -> Workload:
        path, table = read_trace(config, base_dir, "csv",
                                 ["arrived_at", "num_prefill_tokens", "num_decode_tokens"])
        return Workload(
            seconds(table, "arrived_at", "s", path),
            token_counts(table, "num_prefill_tokens", path),
            token_counts(table, "num_decode_tokens", path),
        )
