"""`reserved_blocks` is `future_blocks` summed over the running requests (written out as one
loop, or, for a full reservation, from two kept counts): the same on random replica states,
colocated and prefill-only, whatever the reservation cap."""

from __future__ import annotations

import numpy as np
import pytest

from sim.core.kv_cache import KVCacheManager
from sim.core.request import Request
from sim.core.state import ReplicaState
from sim.schedulers.base import future_blocks, reserved_blocks, summed_reserved_blocks


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("prefill_only", [False, True])
def test_reserved_blocks_sums_future_blocks(seed, prefill_only):
    rng = np.random.default_rng(seed)
    state = ReplicaState(KVCacheManager(100_000, int(rng.choice([1, 16, 32]))), prefill_only)
    for rid in range(int(rng.integers(1, 40))):
        req = Request(rid, 0.0, int(rng.integers(1, 3000)), int(rng.integers(1, 800)))
        state.add(req)
        # Admitted part-way: some of its prompt (and, colocated, of its output) computed.
        done = int(rng.integers(0, req.num_prompt_tokens + 1))
        assert state.kv.try_allocate(req, done)
        state.admit(req)
        req.num_computed_tokens = done
        if not prefill_only and done == req.num_prompt_tokens and rng.random() < 0.7:
            out = int(rng.integers(1, req.num_target_output_tokens + 1))
            req.num_output_tokens = out
            extra = out - 1
            assert state.kv.try_allocate(req, extra)
            req.num_computed_tokens += extra
    for cap in (None, 0, 1, 17, 500):
        expected = sum(future_blocks(state, req, cap) for req in state.running)
        assert reserved_blocks(state, cap) == expected
        assert summed_reserved_blocks(state, cap) == expected
    # Prefill-only replicas reserve for the prompt alone: less than a colocated one would.
    if prefill_only:
        colocated = ReplicaState(state.kv, prefill_only=False)
        colocated.running = state.running
        colocated.num_running_max_blocks = sum(colocated.max_blocks(r) for r in state.running)
        assert reserved_blocks(state, None) <= reserved_blocks(colocated, None)
