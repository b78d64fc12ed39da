"""Vidur's processed traces: `arrived_at,num_prefill_tokens,num_decode_tokens`, seconds."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sim.workloads.base import (
    FORMATS,
    Format,
    TraceConfig,
    Workload,
    read_table,
    resolve,
    seconds,
    token_counts,
)


@FORMATS.register("vidur")
class Vidur(Format):
    Config = TraceConfig

    def load(self, config: TraceConfig, base_dir: Path, rng: np.random.Generator) -> Workload:
        path = resolve(base_dir, config.path)
        df = read_table(path, "csv", "workload.path")
        return Workload(
            seconds(df, "arrived_at", "s", path),
            token_counts(df, "num_prefill_tokens", path),
            token_counts(df, "num_decode_tokens", path),
        )
