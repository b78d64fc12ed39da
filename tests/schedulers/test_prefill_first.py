"""Prefill-first (vLLM v0's default), without SimPy."""

from __future__ import annotations

from sim.schedulers.prefill_first import PrefillFirst, PrefillFirstConfig
from tests.helpers import Stepper, is_finished, make_request, make_state


def prefill_first(**params) -> PrefillFirst:
    return PrefillFirst(PrefillFirstConfig(name="prefill_first", **params))


def test_prompts_are_prefilled_whole_while_decodes_wait():
    decoding = tuple(make_request(i, prompt=10, output=20, generated=1) for i in range(2))
    new = make_request(5, prompt=3000, output=4)
    state = make_state(running=decoding, waiting=(new,))
    run = Stepper(prefill_first(), state)
    plan = run.step()
    assert plan.num_scheduled_tokens == {5: 3000}  # the decodes stall for this iteration
    assert new.num_output_tokens == 1
    plan = run.step()
    assert plan.num_scheduled_tokens == {0: 1, 1: 1, 5: 1}


def test_fcfs_within_batch_limits():
    waiting = tuple(make_request(i, prompt=300, output=2) for i in range(4))
    state = make_state(waiting=waiting)
    run = Stepper(prefill_first(max_num_batched_tokens=700, max_num_seqs=3), state)
    assert run.step().num_scheduled_tokens == {0: 300, 1: 300}  # a third would exceed 700
    assert run.step().num_scheduled_tokens == {2: 300}  # max_num_seqs = 3 running
    assert run.step().num_scheduled_tokens == {0: 1, 1: 1, 2: 1}  # all 3 finish here
    assert run.step().num_scheduled_tokens == {3: 300}
    assert run.step().num_scheduled_tokens == {3: 1}
    assert all(is_finished(r) for r in waiting)


def test_budget_never_exceeded_and_every_token_counted():
    waiting = tuple(make_request(i, prompt=50 + 25 * i, output=1 + i % 7) for i in range(20))
    state = make_state(num_blocks=400, waiting=waiting)
    run = Stepper(prefill_first(max_num_batched_tokens=600, max_num_seqs=6), state)
    total = 0
    while state.running or state.waiting:
        plan = run.step()
        assert plan.total_num_scheduled_tokens <= 600
        prefills = [n for n in plan.num_scheduled_tokens.values() if n > 1]
        assert not prefills or len(prefills) == plan.num_seqs  # never mixed
        total += plan.total_num_scheduled_tokens
    assert total == sum(r.num_max_kv_tokens for r in waiting)
    assert all(is_finished(r) for r in waiting)


def test_prefill_first_default_budget_is_vllm_v0s():
    config = PrefillFirstConfig(name="prefill_first")
    assert PrefillFirst(config, max_model_len=8192).max_num_batched_tokens == 8192
    assert PrefillFirst(config, max_model_len=1024).max_num_batched_tokens == 2048
    assert PrefillFirst(config).max_num_batched_tokens is None
