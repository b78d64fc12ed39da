"""`bench/instructions.py`'s cases stay valid scenarios: each runs, under the project's own
parser, what the counter runs under valgrind (valgrind itself is not needed here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sim import run_scenario
from sim.config.scenario import parse_scenario
from tests.helpers import REPO, load_script

BENCH = REPO / "bench" / "instructions.py"


def load_bench():
    return load_script(BENCH, "bench_instructions")


@pytest.mark.parametrize("case", ["azure", "azure_v1", "colocated4", "disagg", "cluster16",
                                  "cluster64", "overload", "overload_sglang"])
def test_each_case_runs_its_requests(traces, case):
    bench = load_bench()
    assert case in bench.CASES
    data = bench.scenario(case, 40)
    result = run_scenario(parse_scenario(data, "bench/instructions.py"))
    assert result.summary["requests"]["total"] == 40
    assert result.summary["requests"]["finished"] == 40
    # The baseline run is smaller: the difference is the simulation of the extra requests.
    assert bench.scenario(case, bench.BASELINE_REQUESTS)["workload"]["num_requests"] == 10


def test_bad_options_are_refused_in_one_line():
    out = subprocess.run([sys.executable, str(BENCH), "--num-requests", "5"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "instructions.py: error: --num-requests 5: must exceed 10")


def test_recorded_counts_are_current_cases():
    # The shipped record names cases the script still has, at one request count.
    import json

    recorded = json.loads((REPO / "bench" / "instructions.json").read_text())
    assert set(recorded["instructions"]) <= set(load_bench().CASES)
    assert recorded["num_requests"] > load_bench().BASELINE_REQUESTS


def test_a_count_grown_past_the_tolerance_fails_the_comparison(capsys):
    bench = load_bench()
    env = {"commit": "abc", "python": "3.11.7", "numpy": "2.4.6"}
    recorded = {**env, "num_requests": 1500, "instructions": {"azure": 1000, "disagg": 2000}}
    assert bench.compare(recorded, {"azure": 1019, "disagg": 1900}, env, 0.02) == 0
    assert bench.compare(recorded, {"azure": 1021, "disagg": 2000}, env, 0.02) == 1
    assert "azure              1.021  GREW" in capsys.readouterr().out
    # Counted under another numpy: said, not judged.
    other = {**env, "numpy": "2.5.0"}
    assert bench.compare(recorded, {"azure": 5000}, other, 0.02) == 0
    assert "not comparable" in capsys.readouterr().out
