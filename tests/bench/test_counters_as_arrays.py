"""`bench/counters_as_arrays.py` times the simulator's decode passes against an array
prototype: the prototype must count what the simulator does, or the comparison means nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO, load_script

BENCH = REPO / "bench" / "counters_as_arrays.py"


def load_bench():
    return load_script(BENCH, "bench_counters_as_arrays")


@pytest.mark.parametrize("num_running", [1, 7, 20])
def test_arrays_count_what_the_simulator_does(num_running):
    bench = load_bench()
    num_iterations = 3 * bench.BLOCK_SIZE + 5  # several block boundaries for every request
    objects = bench.ObjectCounters(num_running, num_iterations)
    arrays = bench.ArrayCounters(num_running, num_iterations)
    for _ in range(num_iterations):
        objects.step()
        arrays.step()
    state = objects.state
    state.check()
    running = state.running
    assert [r.num_computed_tokens for r in running] == arrays.num_computed.tolist()
    assert [r.num_output_tokens for r in running] == arrays.num_output.tolist()
    assert ([state.kv.num_held_blocks(r.request_id) for r in running]
            == arrays.num_held_blocks.tolist())
    assert state.kv.num_free_blocks == arrays.num_free_blocks
    assert [r.last_token_iter for r in running] == arrays.last_token_iter.tolist()
    # Every request took blocks along the way (the comparison covers allocation).
    assert all(r.num_computed_tokens >= bench._prompt(r.request_id) + num_iterations
               for r in running)


def test_prints_a_row_per_size():
    out = subprocess.run([sys.executable, str(BENCH), "--sizes", "3", "5"], check=True,
                         capture_output=True, text=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["3", "5"]
