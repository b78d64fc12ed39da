"""Summary metrics on handcrafted records, and the torch-free import of sim/."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from sim.config import SLOConfig
from sim.metrics import distribution, slo_attainment, summarize


def frame(rows):
    cols = ["status", "reason", "arrival_s", "ttft_s", "max_tbt_s", "finish_s", "tpot_s",
            "e2e_s", "scheduling_delay_s", "num_generated_tokens", "num_preemptions"]
    return pd.DataFrame(rows, columns=cols)


REQUESTS = frame([
    ("finished", "", 0.0, 0.5, 0.05, 2.0, 0.04, 2.0, 0.1, 10, 0),
    ("finished", "", 1.0, 3.0, 0.20, 5.0, 0.10, 4.0, 2.5, 20, 1),
    ("finished", "", 2.0, 0.2, np.nan, 2.2, np.nan, 0.2, 0.0, 1, 0),  # one token: no gap
    ("rejected", "needs 9000 KV slots", 3.0, np.nan, np.nan, np.nan, np.nan, np.nan, np.nan, 0, 0),
])


def test_slo_attainment_counts_unserved_requests_as_misses():
    gaps = np.array([0.05, 0.05, 0.2, 0.1])
    out = slo_attainment(REQUESTS, gaps, SLOConfig(ttft_s=1.0, tbt_s=0.1))
    assert out["ttft_attainment"] == 0.5  # requests 0 and 2 of 4
    assert out["tbt_attainment"] == 0.5  # requests 0 and 2 (no gap) of 4
    assert out["tbt_gap_attainment"] == 0.75
    assert out["all_attainment"] == 0.5
    assert slo_attainment(REQUESTS, gaps, SLOConfig()) == {}


def test_summary_counts_and_throughput():
    iterations = pd.DataFrame({"start_s": [0.0]})
    s = summarize(REQUESTS, iterations, np.array([0.05, 0.2]), SLOConfig())
    assert s["requests"] == {"total": 4, "finished": 3, "rejected": 1, "unfinished": 0,
                             "reasons": {"needs 9000 KV slots": 1}}
    assert s["throughput"]["span_s"] == 5.0
    assert s["throughput"]["requests_per_s"] == pytest.approx(3 / 5)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(31 / 5)
    assert s["ttft_s"]["count"] == 3 and s["ttft_s"]["max"] == 3.0
    assert s["num_preemptions"] == 1


def test_distribution_of_nothing():
    assert distribution(np.array([np.nan]))["p99"] is None


def test_sim_runs_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from sim import run_scenario\n"
            "r = run_scenario()\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "print(r.summary['requests']['finished'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "2000"
