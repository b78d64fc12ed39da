"""Chunked prefill (Sarathi-Serve stall-free batching), without SimPy."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sim.schedulers.chunked_prefill import ChunkedPrefill, ChunkedPrefillConfig
from tests.helpers import Stepper, cached_state, hashed, is_finished, make_request, make_state


def chunked(**params) -> ChunkedPrefill:
    return ChunkedPrefill(ChunkedPrefillConfig(name="chunked_prefill", **params))


def test_worked_example_from_the_tutorial():
    """Budget 64, chunk 32: a 150-token prompt joins 3 decoding requests (background/000)."""
    decoding = tuple(make_request(i, prompt=10, output=50, generated=1) for i in range(3))
    prompt = make_request(3, prompt=150, output=10)
    state = make_state(running=decoding, waiting=(prompt,))
    run = Stepper(chunked(token_budget=64, chunk_size=32, max_num_seqs=8), state)

    expected_chunks = [32, 32, 32, 32, 22]
    for step, chunk in enumerate(expected_chunks, start=1):
        plan = run.step()
        assert plan.num_scheduled_tokens == {0: 1, 1: 1, 2: 1, 3: chunk}, f"step {step}"
        assert plan.total_num_scheduled_tokens == chunk + 3
        assert prompt.num_computed_tokens == min(150, 32 * step)
        # Only the final chunk samples.
        assert prompt.num_output_tokens == (1 if step == 5 else 0)
    plan = run.step()  # step 6: four decodes
    assert plan.num_scheduled_tokens == {0: 1, 1: 1, 2: 1, 3: 1}
    assert prompt.num_output_tokens == 2


def test_budget_is_never_exceeded_and_no_decode_is_left_out():
    running = tuple(make_request(i, prompt=20, output=40, generated=1) for i in range(5))
    waiting = tuple(make_request(10 + i, prompt=300 + 37 * i, output=5) for i in range(6))
    state = make_state(running=running, waiting=waiting)
    run = Stepper(chunked(token_budget=100, max_num_seqs=16, max_num_partial_prefills=2), state)
    while state.running or state.waiting:
        decoding = {r.request_id for r in state.running if r.is_decoding}
        plan = run.step()
        assert plan.total_num_scheduled_tokens <= 100
        assert decoding <= set(plan.num_scheduled_tokens), "a running decode was left out"
        assert all(plan.num_scheduled_tokens[i] == 1 for i in decoding)
        partial = [r for r in state.running if not r.is_decoding]
        assert len(partial) <= 2
    assert all(is_finished(r) for r in running + waiting)


def test_partial_prefill_continues_where_it_stopped_and_first_token_only_at_the_end():
    req = make_request(0, prompt=130, output=3)
    state = make_state(waiting=(req,))
    run = Stepper(chunked(token_budget=50, max_num_seqs=4), state)
    seen = []
    while req.num_output_tokens == 0:
        before = req.num_computed_tokens
        plan = run.step()
        seen.append(plan.num_scheduled_tokens[0])
        assert req.num_computed_tokens == before + seen[-1]
    assert seen == [50, 50, 30]
    assert req.token_runs == [] and req.run_start_iter == 2  # first token at the end of step 3


def test_only_one_partial_prefill_by_default_but_a_short_prompt_may_join():
    long_a = make_request(0, prompt=500, output=2)
    long_b = make_request(1, prompt=500, output=2)
    short = make_request(2, prompt=20, output=2)
    state = make_state(waiting=(long_a, long_b, short))
    run = Stepper(chunked(token_budget=256, chunk_size=128, max_num_seqs=8), state)
    plan = run.step()
    # long_a takes a chunk and stays partial; long_b would be a second partial prefill: FCFS stops.
    assert plan.num_scheduled_tokens == {0: 128}
    state2 = make_state(waiting=(make_request(0, prompt=500, output=2),
                                 make_request(2, prompt=20, output=2)))
    plan = Stepper(chunked(token_budget=256, chunk_size=128, max_num_seqs=8), state2).step()
    assert plan.num_scheduled_tokens == {0: 128, 2: 20}  # completes in one chunk: allowed


def test_kv_blocks_are_allocated_per_chunk():
    req = make_request(0, prompt=100, output=2)
    state = make_state(num_blocks=50, block_size=16, waiting=(req,))
    run = Stepper(chunked(token_budget=40, max_num_seqs=4, decode_reserve_tokens=0), state)
    held = []
    for _ in range(3):
        run.step()
        held.append(state.kv.num_held_blocks(0))
    assert held == [3, 5, 7]  # ceil(40/16), ceil(80/16), ceil(100/16)


def test_max_num_seqs_above_budget_is_rejected():
    with pytest.raises(ValidationError, match="max_num_seqs"):
        ChunkedPrefillConfig(name="chunked_prefill", token_budget=64, max_num_seqs=128)


def test_min_chunk_tokens_keeps_small_chunks_waiting_unless_they_finish_the_prompt():
    """Background 002's min_chunk_size: a chunk smaller than the minimum waits for an iteration
    with more budget left, unless it completes its prompt."""
    decoding = tuple(make_request(i, prompt=10, output=50, generated=1) for i in range(3))
    short = make_request(3, prompt=60, output=2)  # one chunk of 60 < 64 finishes it: admitted
    long_prompt = make_request(4, prompt=400, output=2)
    state = make_state(running=decoding, waiting=(short, long_prompt))
    run = Stepper(chunked(token_budget=100, max_num_seqs=8, max_num_partial_prefills=2,
                          min_chunk_tokens=64), state)
    # 37 tokens are left for the long prompt: below the minimum, it waits.
    assert run.step().num_scheduled_tokens == {0: 1, 1: 1, 2: 1, 3: 60}
    assert run.step().num_scheduled_tokens == {0: 1, 1: 1, 2: 1, 3: 1, 4: 96}
    with pytest.raises(ValidationError, match="min_chunk_tokens"):
        chunked(token_budget=40, max_num_seqs=8, min_chunk_tokens=41)


def test_a_prefix_hit_makes_the_first_iteration_shorter():
    """Two requests with a shared 512-token prefix: the second computes only its own part."""
    state = cached_state(num_blocks=200)
    sched = ChunkedPrefill(ChunkedPrefillConfig(name="chunked_prefill", token_budget=1024))
    run = Stepper(sched, state)
    first = hashed(0, prompt=600, output=2, ids=(1, 2), unit=512)
    state.add(first)
    assert run.step().num_scheduled_tokens == {0: 600}
    second = hashed(1, prompt=600, output=2, ids=(1, 3), unit=512)
    state.add(second)
    plan = run.step()
    assert plan.num_scheduled_tokens == {0: 1, 1: 88}  # 600 - 512 cached
    assert second.num_cached_tokens == 512
    state.kv.check()
