"""Any CSV or JSON-lines trace, given a mapping from its column names to ours."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np

from sim.config.errors import InputError
from sim.workloads.base import FORMATS, Format, GenericConfig, Workload
from sim.workloads.classes import tagged_classes
from sim.workloads.fields import column, hash_id_lists, seconds, token_counts, where
from sim.workloads.where import read_trace


def _load(config: GenericConfig, base_dir: Path, kind: Literal["csv", "jsonl"],
          rng: np.random.Generator) -> Workload:
    cols = config.columns
    named = [cols.prompt_tokens, cols.output_tokens,
             *([cols.hash_ids] if cols.hash_ids is not None else []),
             *([cols.request_class] if cols.request_class is not None else [])]
    path, table = read_trace(config, base_dir, kind,
                             named if cols.arrival is None else [cols.arrival, *named])
    prompt = token_counts(table, cols.prompt_tokens, path)
    output = token_counts(table, cols.output_tokens, path)
    if cols.arrival is not None:
        arrival = seconds(table, cols.arrival, config.time_unit, path)
    else:
        assert config.arrivals is not None
        arrival = config.arrivals.sample(len(prompt), rng)
    request_class = None
    if cols.request_class is not None:
        classes = config.classes
        assert classes is not None, "checked with the scenario"
        name = cols.request_class

        def problem(row: int, value: Any) -> None:
            raise InputError(path, where(table, name, row), value, "not a class of "
                             f"workload.classes ({', '.join(c.name for c in classes)})")

        request_class = tagged_classes(column(table, name, path).tolist(), classes, problem)
    if cols.hash_ids is None:
        return Workload(arrival, prompt, output, request_class=request_class)
    assert config.hash_block_tokens is not None
    return Workload(arrival, prompt, output, hash_id_lists(table, cols.hash_ids, path),
                    config.hash_block_tokens, request_class=request_class)


@FORMATS.register("csv")
class GenericCSV(Format):
    Config = GenericConfig

    def load(self, config: GenericConfig, base_dir: Path, rng: np.random.Generator) -> Workload:
        return _load(config, base_dir, "csv", rng)


@FORMATS.register("jsonl")
class GenericJSONL(Format):
    Config = GenericConfig

    def load(self, config: GenericConfig, base_dir: Path, rng: np.random.Generator) -> Workload:
        return _load(config, base_dir, "jsonl", rng)
