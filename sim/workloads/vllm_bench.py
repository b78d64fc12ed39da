"""A `vllm bench serve` result file (`--save-result --save-detailed`) as a trace: its requests'
send times (`start_times`, seconds), prompt lengths (`input_lens`) and output lengths
(`output_lens`), so a benchmark run can be simulated as it was sent (and `servesim calibrate`
can compare with it). `servesim export --format vllm` writes the same file.

A failed request's output length is 0 in the file (its target is not recorded): such requests
are refused unless `failed: skip` leaves them out (then the run served fewer requests than the
benchmark sent, and its load is understated).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from sim.config.errors import InputError
from sim.config.input_file import read_json_file
from sim.workloads.base import FORMATS, Format, TraceConfig, Workload, resolve

MAX_RESULT_BYTES = 2 << 30  # a detailed result of a million requests is ~0.5 GB


class VllmBenchConfig(TraceConfig):
    failed: Literal["refuse", "skip"] = Field(
        "refuse", description="requests that failed in the benchmark (output length 0): refuse "
                              "the file, or leave them out")


@FORMATS.register("vllm_bench")
class VllmBench(Format):
    Config = VllmBenchConfig

    def load(self, config: VllmBenchConfig, base_dir: Path, rng: np.random.Generator
             ) -> Workload:
        path = resolve(base_dir, config.path)
        data = read_json_file(path, None, "workload.path", MAX_RESULT_BYTES)
        if not isinstance(data, dict):
            raise InputError(path, "<top level>", type(data).__name__,
                             "a vllm bench serve result is a JSON object")
        columns = {}
        for key in ("start_times", "input_lens", "output_lens"):
            values = data.get(key)
            if not isinstance(values, list) or not values or not all(
                    isinstance(v, int | float) and not isinstance(v, bool) for v in values):
                raise InputError(path, key, None if values is None else f"{len(values)} values"
                                 if isinstance(values, list) else values,
                                 "needs a list of numbers per request (vllm bench serve "
                                 "--save-result --save-detailed)")
            columns[key] = np.asarray(values, dtype=np.float64)
        sizes = {key: len(v) for key, v in columns.items()}
        if len(set(sizes.values())) > 1:
            raise InputError(path, "output_lens", sizes["output_lens"],
                             f"lists of different lengths: {sizes}")
        start, prompt, output = (columns[k] for k in ("start_times", "input_lens",
                                                      "output_lens"))
        checks = (("start_times", start, np.isfinite(start) & (start >= 0),
                   "a finite time from 0"),
                  ("input_lens", prompt, (prompt >= 1) & (prompt == np.rint(prompt)),
                   "a whole number of tokens, at least 1"),
                  ("output_lens", output, (output >= 0) & (output == np.rint(output)),
                   "a whole number of tokens"))
        for key, values, ok, problem in checks:
            if not ok.all():
                row = int(np.argmin(ok))
                raise InputError(path, key, float(values[row]), f"request {row}: {problem}")
        failed = output < 1
        if failed.any() and config.failed == "refuse":
            raise InputError(path, "output_lens", 0, f"{int(failed.sum())} failed requests "
                             "(output length 0, their target not recorded): give failed: skip "
                             "to leave them out")
        keep = np.flatnonzero(~failed)
        order = keep[np.argsort(start[keep], kind="stable")]
        return Workload(start[order] - start[order][0], prompt[order].astype(np.int64),
                        output[order].astype(np.int64))
