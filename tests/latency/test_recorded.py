"""The `recorded` latency kind (`sim.latency.recorded`): a replay's measured durations played back,
and where the simulation's plans diverge from the recorded ones."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from sim.config.errors import InputError
from sim.hardware.gpus import GPUS
from sim.hardware.models import MODELS
from sim.latency import LATENCY_MODELS, BatchShape


def recording(tmp_path: Path) -> Path:
    pd.DataFrame({"replica_id": [0, 0], "num_prefill_tokens": [8, 0],
                  "num_decode_tokens": [0, 1], "num_prefill_seqs": [1, 0],
                  "duration_s": [0.02, 0.005], "forward_s": [0.018, 0.004]}
                 ).to_parquet(tmp_path / "iterations.parquet")
    return tmp_path


def recorded(path: Path, **extra):
    kind = LATENCY_MODELS.get("recorded")
    return kind(kind.Config.model_validate({"kind": "recorded", "path": path, **extra}),
                MODELS.get("tiny"), GPUS.get("h100-sxm"))


def test_recorded_latency_replays_durations_and_reports_divergence(tmp_path):
    model = recorded(recording(tmp_path))
    assert model.sequential
    assert model.iteration_time_s(BatchShape(num_prefill_tokens=8, num_prefill_seqs=1)) == 0.02
    assert model.iteration_time_s(BatchShape(num_decode_tokens=2)) == 0.005  # not what ran
    assert model.iteration_time_s(BatchShape(num_decode_tokens=1)) == pytest.approx(0.0125)
    facts = model.describe()
    assert facts["num_mismatched_iterations"] == 1 and facts["num_beyond_recording"] == 1
    assert facts["first_mismatch"] == {"iteration": 1,
                                       "num_decode_tokens": {"asked": 2, "recorded": 1}}
    forward = recorded(tmp_path / "iterations.parquet", column="forward_s")
    assert forward.iteration_time_s(BatchShape(num_prefill_tokens=8, num_prefill_seqs=1)) == 0.018
    with pytest.raises(InputError, match="latency.column=.*no such column"):
        recorded(tmp_path, column="host_ms")
    with pytest.raises(InputError, match="not found"):
        recorded(tmp_path / "nowhere")
