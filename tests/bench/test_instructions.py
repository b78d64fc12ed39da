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
