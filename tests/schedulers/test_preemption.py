"""Paged KV accounting, preemption by recompute and rejection, without SimPy."""

from __future__ import annotations

from sim.schedulers.chunked_prefill import ChunkedPrefill, ChunkedPrefillConfig
from sim.schedulers.prefill_first import PrefillFirst, PrefillFirstConfig
from tests.helpers import Stepper, is_finished, make_request, make_state


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
