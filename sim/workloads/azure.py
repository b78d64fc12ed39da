"""Azure LLM inference trace 2023 (Splitwise): `TIMESTAMP,ContextTokens,GeneratedTokens`, with
wall-clock timestamps (100 ns digits, no zone), CRLF line ends and no final newline."""

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


@FORMATS.register("azure")
class Azure2023(Format):
    Config = TraceConfig

    def load(self, config: TraceConfig, base_dir: Path, rng: np.random.Generator) -> Workload:
        path = resolve(base_dir, config.path)
        df = read_table(path, "csv", "workload.path")
        return Workload(
            seconds(df, "TIMESTAMP", "datetime", path),
            token_counts(df, "ContextTokens", path),
            token_counts(df, "GeneratedTokens", path),
        )
