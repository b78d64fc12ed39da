"""Any CSV or JSON-lines trace, given a mapping from its column names to ours."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sim.workloads.base import (
    FORMATS,
    Format,
    GenericConfig,
    Workload,
    read_table,
    resolve,
    seconds,
    token_counts,
)


def _load(config: GenericConfig, path: Path, df, rng: np.random.Generator) -> Workload:
    cols = config.columns
    prompt = token_counts(df, cols.prompt_tokens, path)
    output = token_counts(df, cols.output_tokens, path)
    if cols.arrival is not None:
        arrival = seconds(df, cols.arrival, config.time_unit, path)
    else:
        assert config.arrivals is not None
        arrival = config.arrivals.sample(len(prompt), rng)
    return Workload(arrival, prompt, output)


@FORMATS.register("csv")
class GenericCSV(Format):
    Config = GenericConfig

    def load(self, config: GenericConfig, base_dir: Path, rng: np.random.Generator) -> Workload:
        path = resolve(base_dir, config.path)
        return _load(config, path, read_table(path, "csv", "workload.path"), rng)


@FORMATS.register("jsonl")
class GenericJSONL(Format):
    Config = GenericConfig

    def load(self, config: GenericConfig, base_dir: Path, rng: np.random.Generator) -> Workload:
        path = resolve(base_dir, config.path)
        return _load(config, path, read_table(path, "jsonl", "workload.path"), rng)
