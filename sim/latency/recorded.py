"""Durations recorded by `servesim replay`, returned one by one: the i-th iteration the simulator
asks about takes what the i-th replayed iteration took.

With every duration identical, the simulator must reproduce replay's plans and timestamps; any
gap is a bug or time replay spent outside its iterations. So each call also checks the shape it
is asked about against the shape that ran, and `describe()` reports the first divergence.
`column: forward_s` replays the forward passes alone, leaving out replay's host time.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import Field

from sim.config.errors import InputError
from sim.hardware.gpus import GPUSpec
from sim.hardware.models import ModelShape
from sim.hardware.parallelism import SINGLE_GPU, Parallelism
from sim.latency.base import LATENCY_MODELS, BatchShape, LatencyConfig, LatencyModel, Num

if TYPE_CHECKING:
    import pandas as pd

# Shape fields compared when the recording has them (the simulator's log has the first two).
CHECKED = ("num_prefill_tokens", "num_decode_tokens", "num_prefill_seqs", "num_sampled_tokens",
           "prefill_attn_pairs", "prefill_kv_tokens", "decode_kv_tokens")


class RecordedConfig(LatencyConfig):
    path: Path = Field(strict=False, description="a replay's result directory or its "
                       "iterations.parquet")
    column: str = Field("duration_s", description="the column of seconds replayed: duration_s, "
                        "or forward_s (the forward passes without host time)")


@LATENCY_MODELS.register("recorded")
class RecordedLatency(LatencyModel):
    Config = RecordedConfig
    sequential = True  # the i-th call gets the i-th duration: no fast-forward
    accepts_noise = False  # measured durations carry their own jitter

    def __init__(self, config: RecordedConfig, model: ModelShape, gpu: GPUSpec,
                 parallelism: Parallelism = SINGLE_GPU) -> None:
        self.path = Path(config.path)
        file = self.path / "iterations.parquet" if self.path.is_dir() else self.path
        frame = _read(file)
        if config.column not in frame:
            raise InputError(file, "latency.column", config.column,
                             f"no such column; it has {', '.join(map(str, frame.columns))}")
        if frame["replica_id"].nunique() > 1:
            raise InputError(file, "replica_id", sorted(frame["replica_id"].unique())[:4],
                             "a recording of one replica is needed")
        self.column = config.column
        self.durations = frame[config.column].to_numpy(dtype=np.float64)
        self.shapes = {name: frame[name].to_numpy(dtype=np.int64) for name in CHECKED
                       if name in frame}
        self.fallback_s = float(np.median(self.durations)) if len(self.durations) else 1e-3
        self.num_asked = 0
        self.num_mismatched = 0
        self.first_mismatch: dict[str, Any] | None = None

    def iteration_time_s(self, shape: BatchShape) -> Num:
        if np.ndim(shape.num_decode_tokens):  # a vectorised call: answer element by element
            n = int(np.size(shape.num_decode_tokens))
            fields = {name: np.broadcast_to(getattr(shape, name), (n,)) for name in CHECKED}
            return np.array([self.iteration_time_s(BatchShape(**{k: v[i] for k, v in
                                                                 fields.items()}))
                             for i in range(n)])
        i = self.num_asked
        self.num_asked += 1
        if i >= len(self.durations):
            return self.fallback_s  # counted: describe() shows asked beyond recorded
        diff = {name: (int(getattr(shape, name)), int(values[i]))
                for name, values in self.shapes.items() if int(getattr(shape, name)) != values[i]}
        if diff:
            self.num_mismatched += 1
            if self.first_mismatch is None:
                self.first_mismatch = {"iteration": i, **{k: {"asked": a, "recorded": r}
                                                          for k, (a, r) in diff.items()}}
        return float(self.durations[i])

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.path), "column": self.column,
                "num_recorded_iterations": len(self.durations),
                "num_asked_iterations": self.num_asked,
                "num_beyond_recording": max(0, self.num_asked - len(self.durations)),
                "num_mismatched_iterations": self.num_mismatched,
                "first_mismatch": self.first_mismatch}


def _read(file: Path) -> pd.DataFrame:
    if not file.is_file():
        raise InputError(file, "latency.path", str(file),
                         "not found: give a replay's result directory or its iterations.parquet")
    import pandas as pd  # here, not at the top: `servesim --help` starts without pandas

    try:
        frame = pd.read_parquet(file)
    except Exception as exc:  # pyarrow raises several kinds for a file that is not parquet
        raise InputError(file, "latency.path", str(file),
                         f"not a parquet file: {type(exc).__name__}") from None
    missing = [c for c in ("replica_id", "num_prefill_tokens", "num_decode_tokens")
               if c not in frame]
    if missing:
        raise InputError(file, "columns", missing, "missing: not an iterations.parquet")
    return frame
