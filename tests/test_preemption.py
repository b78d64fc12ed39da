"""Paged KV accounting, preemption by recompute and rejection, without SimPy."""

from __future__ import annotations

import pytest

from sim.core.kv_cache import KVCacheManager
from sim.schedulers.chunked_prefill import ChunkedPrefill, ChunkedPrefillConfig
from sim.schedulers.prefill_first import PrefillFirst, PrefillFirstConfig
from tests.conftest import Stepper, is_finished, make_request, make_state


def token_iterations(req) -> list[int]:
    return [i for _, first, end in req.all_token_runs() for i in range(first, end)]


def test_newest_request_is_preempted_by_recompute_and_resumes():
    a = make_request(0, prompt=8, output=10)
    b = make_request(1, prompt=8, output=10)
    state = make_state(num_blocks=6, block_size=4, waiting=(a, b))
    config = ChunkedPrefillConfig(name="chunked_prefill", token_budget=64, max_num_seqs=4,
                                  decode_reserve_tokens=0)
    run = Stepper(ChunkedPrefill(config), state)
    plans = [run.step() for _ in range(15)]

    assert plans[5].preempted_ids == [1] and plans[5].num_scheduled_tokens == {0: 1}
    assert all(1 not in p.num_scheduled_tokens for p in plans[5:10])  # waits for blocks
    assert plans[10].num_scheduled_tokens == {1: 13}  # recompute prompt + 5 generated tokens
    assert is_finished(a) and is_finished(b)
    assert (b.num_preemptions, b.num_recomputed_tokens) == (1, 12)
    assert token_iterations(a) == list(range(10))
    # The gap spent preempted stays inside B's token stream (TBT counts it).
    assert token_iterations(b) == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
    # Tokens are conserved: everything computed is prompt, output and recompute.
    computed = sum(p.total_num_scheduled_tokens for p in plans)
    assert computed == a.num_max_kv_tokens + b.num_max_kv_tokens + b.num_recomputed_tokens
    assert state.kv.num_free_blocks == 6


def test_preempted_and_recomputed_in_the_next_iteration_keeps_every_token():
    """Regression: a request preempted while a plan is built and recomputed in the very next
    iteration used to drop its next token (its token run was closed but looked contiguous)."""
    req = make_request(0, prompt=8, output=6)
    state = make_state(num_blocks=100, block_size=4, waiting=(req,))
    config = ChunkedPrefillConfig(name="chunked_prefill", token_budget=64, max_num_seqs=4)
    run = Stepper(ChunkedPrefill(config), state)
    run.step()
    run.step()  # iterations 0 and 1: prefill, one decode; tokens at 0 and 1
    state.preempt(req)  # e.g. a newer decode needed its blocks
    plan = run.step()  # iteration 2: the recompute (prompt + 2 outputs) samples the third token
    assert plan.num_scheduled_tokens == {0: 10}
    while not is_finished(req):
        run.step()
    assert token_iterations(req) == [0, 1, 2, 3, 4, 5]
    assert len(token_iterations(req)) == req.num_output_tokens == 6
    assert [run[1:] for run in req.all_token_runs()] == [(0, 2), (2, 6)]


def test_prefill_first_preempts_newest_decode_too():
    a = make_request(0, prompt=8, output=10)
    b = make_request(1, prompt=8, output=10)
    state = make_state(num_blocks=6, block_size=4, waiting=(a, b))
    run = Stepper(PrefillFirst(PrefillFirstConfig(name="prefill_first", decode_reserve_tokens=0)),
                  state)
    plans = [run.step() for _ in range(20) if state.running or state.waiting]
    assert plans[0].num_scheduled_tokens == {0: 8, 1: 8}
    assert sum(len(p.preempted_ids) for p in plans) == 1 and b.num_preemptions == 1
    assert is_finished(a) and is_finished(b)
    state.check()


def test_mini_sglang_reservation_admits_only_what_can_finish():
    """With the default rule a request is admitted only if its whole future fits beside the
    futures of those running, so nothing is ever preempted."""
    reqs = tuple(make_request(i, prompt=8, output=10) for i in range(3))
    state = make_state(num_blocks=12, block_size=4, waiting=reqs)
    run = Stepper(ChunkedPrefill(ChunkedPrefillConfig(name="chunked_prefill", token_budget=64,
                                                      max_num_seqs=4)), state)
    first = run.step()
    assert first.num_scheduled_tokens == {0: 8, 1: 8}  # 5 blocks each at most; a third won't fit
    while state.running or state.waiting:
        assert not run.step().preempted_ids
    assert all(is_finished(r) for r in reqs)


def test_request_that_can_never_fit_is_rejected_with_a_reason():
    kv = KVCacheManager(num_blocks=4, block_size=16)  # 64 slots
    sched = ChunkedPrefill(ChunkedPrefillConfig(name="chunked_prefill"))
    a, b = make_request(0, prompt=60, output=5), make_request(1, prompt=60, output=6)
    assert sched.reject_reason(a, kv, a.num_max_kv_tokens) is None
    reason = sched.reject_reason(b, kv, b.num_max_kv_tokens)
    assert reason is not None and "65" in reason and "64" in reason


def test_prefill_first_rejects_prompts_over_its_batch_limit():
    kv = KVCacheManager(num_blocks=100, block_size=16)
    sched = PrefillFirst(PrefillFirstConfig(name="prefill_first", max_num_batched_tokens=512))
    assert sched.reject_reason(make_request(0, prompt=500, output=13), kv, 512) is None
    assert "max_num_batched_tokens" in sched.reject_reason(make_request(1, prompt=500, output=14),
                                                            kv, 513)


def test_blocks_are_conserved_and_freed():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request(0, prompt=9, output=1)
    assert kv.num_blocks_to_grow(req, 9) == 3
    assert kv.try_allocate(req, 9)
    assert not kv.try_allocate(make_request(1, prompt=40, output=1), 40)
    assert (kv.num_free_blocks, kv.num_held_blocks(0)) == (7, 3)
    kv.check()
    kv.free(req)
    assert kv.num_free_blocks == 10
    kv.check()
    with pytest.raises(ValueError):
        KVCacheManager(0, 16)
