"""Would the running requests' counters as arrays pay? The two passes a stepped decode
iteration makes over request objects, timed against the same work on arrays, by batch size.

Issue 14's notes named "the running requests' counters as arrays" as the next step for speed,
an architecture change (a policy would read counters from the replica's arrays, not from its
requests). This measures what it could gain before anyone builds it:

- **objects**: the simulator's own code, `ChunkedPrefill.schedule` (every running request
  decodes: `schedule_decodes`' loop, a block where the computed tokens fill the held ones)
  and `ReplicaState.commit` (each request computes its token and samples), per iteration on a
  real `ReplicaState` with N decoding requests and nothing waiting.
- **arrays**: the same counting on numpy arrays of N: which requests need a block, blocks
  taken, computed and output tokens advanced, token iterations noted, finishes found. A lower
  bound for an array design: no `Plan`, no log row, no KV-manager bookkeeping per block.

The crossover is what matters: below it, numpy's per-call cost (about 0.5-1 us a call) is more
than the loop it replaces. Measure on one core with nothing else running:

    taskset -c 0 python bench/counters_as_arrays.py [--sizes 8 16 32 ...]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sim.core.kv_cache import KVCacheManager  # noqa: E402
from sim.core.request import Request  # noqa: E402
from sim.core.state import ReplicaState  # noqa: E402
from sim.schedulers.chunked_prefill import ChunkedPrefill, ChunkedPrefillConfig  # noqa: E402

BLOCK_SIZE = 16
NUM_ITERATIONS = 2_000  # timed per round: 125 block boundaries per request, no finish
NUM_ROUNDS = 5  # best of


def _prompt(i: int) -> int:
    return 1_000 + i % BLOCK_SIZE  # block boundaries on different iterations


def _target(num_iterations: int) -> int:
    return 10 * num_iterations  # nobody finishes


def _num_blocks(num_running: int, num_iterations: int) -> int:
    return num_running * (-(-(_prompt(BLOCK_SIZE - 1) + num_iterations + 1) // BLOCK_SIZE))


def decoding_state(num_running: int, num_iterations: int) -> ReplicaState:
    """A replica with `num_running` requests decoding (prompts of 1,000-1,015 tokens), nothing
    waiting, KV for `num_iterations` more tokens each, none finishing in them."""
    state = ReplicaState(KVCacheManager(_num_blocks(num_running, num_iterations), BLOCK_SIZE))
    for i in range(num_running):
        req = Request(i, 0.0, _prompt(i), _target(num_iterations))
        req.num_output_tokens = 1
        req.num_computed_tokens = req.num_prompt_tokens
        state.add(req)
        assert state.kv.try_allocate(req, 0)
        state.admit(req)
    state.check()
    return state


class ObjectCounters:
    """The simulator's own passes: `ChunkedPrefill.schedule` then `ReplicaState.commit`."""

    def __init__(self, num_running: int, num_iterations: int) -> None:
        self.state = decoding_state(num_running, num_iterations)
        self.policy = ChunkedPrefill(ChunkedPrefillConfig(
            name="chunked_prefill", token_budget=max(512, num_running),
            max_num_seqs=max(256, num_running)))
        self.num_running = num_running
        self.iteration = 0

    def step(self) -> None:
        it = self.iteration
        plan = self.policy.schedule(self.state, float(it))
        assert plan.num_seqs == self.num_running and not plan.preempted_ids
        assert not self.state.commit(plan, it, float(it), float(it + 1))
        self.iteration = it + 1


class ArrayCounters:
    """The same counting on arrays of the running requests (`decoding_state`'s)."""

    def __init__(self, num_running: int, num_iterations: int) -> None:
        self.num_computed = np.array([_prompt(i) for i in range(num_running)], dtype=np.int64)
        self.num_output = np.ones(num_running, dtype=np.int64)
        self.num_target_output = np.full(num_running, _target(num_iterations), dtype=np.int64)
        self.num_held_blocks = -(-self.num_computed // BLOCK_SIZE)
        self.last_token_iter = np.full(num_running, -2, dtype=np.int64)
        self.num_free_blocks = (_num_blocks(num_running, num_iterations)
                                - int(self.num_held_blocks.sum()))
        self.iteration = 0

    def step(self) -> None:
        # The policy: a block for each request whose computed tokens fill its blocks.
        need = np.flatnonzero(self.num_computed % BLOCK_SIZE == 0)
        if len(need):
            assert self.num_free_blocks >= len(need)
            self.num_held_blocks[need] += 1
            self.num_free_blocks -= len(need)
        # The commit: one token computed and one sampled each; finishes found.
        self.num_computed += 1
        self.num_output += 1
        self.last_token_iter[:] = self.iteration
        assert not len(np.flatnonzero(self.num_output == self.num_target_output))
        self.iteration += 1


def seconds_per_iteration(counters: ObjectCounters | ArrayCounters, num_iterations: int,
                          num_rounds: int) -> float:
    """Best of `num_rounds` rounds of `num_iterations` steps."""
    best = min(timeit.repeat(counters.step, number=num_iterations, repeat=num_rounds))
    return best / num_iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256],
                        help="running requests (decoding) per case")
    args = parser.parse_args()
    table = Table(title="a stepped decode iteration: two passes over requests, objects vs "
                        "arrays (best of 5 rounds)")
    table.add_column("running", justify="right")
    table.add_column("objects, us", justify="right")
    table.add_column("us per request", justify="right")
    table.add_column("arrays, us", justify="right")
    table.add_column("arrays / objects", justify="right")
    for n in args.sizes:
        total = NUM_ROUNDS * NUM_ITERATIONS
        objects_s = seconds_per_iteration(ObjectCounters(n, total), NUM_ITERATIONS, NUM_ROUNDS)
        arrays_s = seconds_per_iteration(ArrayCounters(n, total), NUM_ITERATIONS, NUM_ROUNDS)
        table.add_row(f"{n:,}", f"{objects_s * 1e6:.1f}", f"{objects_s * 1e6 / n:.2f}",
                      f"{arrays_s * 1e6:.1f}", f"{arrays_s / objects_s:.2f}")
    Console(width=100).print(table)


if __name__ == "__main__":
    main()
