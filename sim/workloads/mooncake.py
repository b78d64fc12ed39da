"""Mooncake FAST'25 traces: JSON lines of `timestamp` (ms), `input_length`, `output_length` and
`hash_ids` (prefix blocks of 512 tokens), kept on each request for prefix-cache work."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sim.workloads.base import FORMATS, Format, PrefixTraceConfig, Workload
from sim.workloads.fields import hash_id_lists, seconds, token_counts
from sim.workloads.where import read_trace

# Each Mooncake hash id stands for a block of 512 tokens (the trace's README).
HASH_BLOCK_TOKENS = 512


@FORMATS.register("mooncake")
class Mooncake(Format):
    Config = PrefixTraceConfig

    def load(self, config: PrefixTraceConfig, base_dir: Path, rng: np.random.Generator
             ) -> Workload:
        path, table = read_trace(config, base_dir, "jsonl", [])
        return Workload(
            seconds(table, "timestamp", "ms", path),
            token_counts(table, "input_length", path),
            token_counts(table, "output_length", path),
            hash_id_lists(table, "hash_ids", path),
            HASH_BLOCK_TOKENS,
        )
