"""Length-only CSVs (Vidur's arXiv summarisation, Sarathi-Serve's ShareGPT):
`num_prefill_tokens,num_decode_tokens,...` in file order, with generated arrivals."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sim.workloads.base import FORMATS, ArrivalsConfig, Format, Workload
from sim.workloads.fields import token_counts
from sim.workloads.where import read_trace


@FORMATS.register("lengths")
class Lengths(Format):
    Config = ArrivalsConfig

    def load(self, config: ArrivalsConfig, base_dir: Path, rng: np.random.Generator) -> Workload:
        path, table = read_trace(config, base_dir, "csv",
                                 ["num_prefill_tokens", "num_decode_tokens"])
        prompt = token_counts(table, "num_prefill_tokens", path)
        output = token_counts(table, "num_decode_tokens", path)
        return Workload(config.arrivals.sample(len(prompt), rng), prompt, output)
