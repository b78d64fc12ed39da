"""Admission, without SimPy: Mini-SGLang's reservation admits only what can finish, and a request
that can never fit, or is over a policy's batch limit, is rejected with its reason."""

from __future__ import annotations

from sim.core.kv_cache import KVCacheManager
from sim.schedulers.chunked_prefill import ChunkedPrefill, ChunkedPrefillConfig
from sim.schedulers.prefill_first import PrefillFirst, PrefillFirstConfig
from tests.helpers import Stepper, is_finished, make_request, make_state


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
