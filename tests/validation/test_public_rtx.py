"""servesim against real vLLM 0.19.0 on RTX GPUs (`validation/public/rtx_vllm0190.py`): the
data-parallel MoE run (Qwen3-30B-A3B, two ranks with expert parallelism) read as one replica of
two ranks in lockstep, its requests in the order they were queued, and simulated within the
error the committed table states. Read from ../shared at run time (never copied)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.studies.measured import read_engine_run, simulate
from tests.helpers import TRACES

RUN = (TRACES.parent / "realruns" / "rtx_vllm0190" / "RTXPRO6000"
       / "Qwen3-30B-A3B-Instruct-2507" / "vllm")


def test_the_data_parallel_moe_run_is_two_ranks_in_lockstep():
    if not (RUN / "meta.json").is_file():
        pytest.skip(f"{RUN} is missing: the public measurements are not here")
    experiment = read_engine_run(RUN)
    replica = experiment.scenario["replica"]
    assert replica["parallelism"] == {"tensor": 1, "data": 2, "expert": 2}
    # vLLM 0.19 pads the ranks' steps only where they fit a CUDA graph (0.15.1: every step).
    assert replica["scheduler"]["data_parallel_padding"] == "graph_steps"
    # The engines logged their requests as each finished them: read in the order queued.
    path = experiment.scenario["workload"]["path"]
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    queued = [json.loads(line)["queued_ts"] for line in lines]
    assert queued == sorted(queued) and len(queued) == 300
    (stage,), (sim,) = experiment.stages, simulate((experiment, {}))
    # The committed table: TPOT 28-29% fast, E2E 30% (within a point or two).
    for metric, low, high in [("TPOT mean", -0.30, -0.26), ("TPOT P50", -0.31, -0.27),
                              ("E2E mean", -0.32, -0.28)]:
        error = (sim[metric] - stage.measured_ms[metric]) / stage.measured_ms[metric]
        assert low < error < high, (metric, error)
