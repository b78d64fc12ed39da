"""A replica's state (`sim.core.state.ReplicaState`), without SimPy: one definition of a decode,
`Request.is_decoding`, and the running requests' partition into prefills and decodes that the
state keeps (`prefilling()`, kept as requests join, catch up and leave), which the hot loops
(`schedule_decodes`, vLLM v1's, `BatchShape.of_replica`) read by identity instead of asking each
request; each against the definition, on the cases where a request is one token short of its
prompt or of its output, on a replica with and without a pipeline (where a request may be caught
up, its token in flight). And a preemption's effect on a request's tokens."""

from __future__ import annotations

import itertools

import pytest

from sim.core.kv_cache import KVCacheManager
from sim.core.plan import Plan
from sim.core.request import Request
from sim.core.state import ReplicaState
from sim.latency.base import BatchShape
from sim.schedulers.base import schedule_decodes
from sim.schedulers.chunked_prefill import ChunkedPrefill, ChunkedPrefillConfig
from sim.schedulers.vllm_v1 import VllmV1, VllmV1Config
from tests.helpers import Stepper, is_finished, make_request, make_state

PROMPT = 20


def _running(block_size: int, pipelined: bool) -> tuple[ReplicaState, list[Request]]:
    """Requests of every kind running on one replica: a prompt not started, part-computed, one
    token short (never sampled: a prefill); decoding; recomputed after a preemption to one
    token short of its output (a decode, by definition) or fewer; and, `pipelined`, caught up
    (everything known computed: nothing to schedule), which only a pipeline's iterations in
    flight leave (`ReplicaState.start`)."""
    state = ReplicaState(KVCacheManager(num_blocks=10_000, block_size=block_size))
    state.pipelined = pipelined
    cases = []
    for num_output, num_computed in itertools.product(range(4), range(PROMPT + 4)):
        if num_computed > PROMPT + num_output - (not pipelined):
            continue
        cases.append((num_output, num_computed))
    requests = []
    for request_id, (num_output, num_computed) in enumerate(cases):
        req = Request(request_id, 0.0, PROMPT, 10)
        req.num_output_tokens, req.num_computed_tokens = num_output, num_computed
        state.add(req)
        assert state.kv.try_allocate(req, 0)
        state.admit(req)
        requests.append(req)
    state.check()
    return state, requests


def test_hot_loops_agree_with_is_decoding():
    for block_size, pipelined in itertools.product((1, 16), (False, True)):
        state, requests = _running(block_size, pipelined)
        decoding = [r.request_id for r in requests if r.is_decoding]
        prefilling = [r.request_id for r in requests if not r.is_decoding and not r.is_caught_up]
        assert decoding and prefilling
        assert pipelined == any(r.is_caught_up for r in requests)
        # The edges: a prompt one token short, a recompute one token short of its output.
        assert any(r.num_output_tokens == 0 and r.num_uncomputed_tokens == 1 for r in requests
                   if r.request_id in prefilling)
        assert any(r.num_output_tokens > 1 and r.num_uncomputed_tokens == 1 for r in requests
                   if r.request_id in decoding)

        assert [r.request_id for r in state.prefilling()] == prefilling
        plan = Plan()
        left = schedule_decodes(state, plan)
        assert [r.request_id for r in left] == prefilling
        assert plan.num_scheduled_tokens == dict.fromkeys(decoding, 1)
        # Decodes alone (some running requests unscheduled), then with every prompt's rest.
        assert BatchShape.of_replica(plan, state) == BatchShape.from_plan(plan, state.requests)
        for req in left:
            plan.num_scheduled_tokens[req.request_id] = req.num_uncomputed_tokens
        shape = BatchShape.of_replica(plan, state)
        assert shape == BatchShape.from_plan(plan, state.requests)
        assert shape.num_decode_tokens == len(decoding)
        assert shape.num_prefill_seqs == len(prefilling)
        assert shape.num_prefill_tokens == sum(r.num_uncomputed_tokens for r in left)
        assert shape.decode_kv_tokens == sum(r.num_computed_tokens + 1 for r in requests
                                             if r.request_id in decoding)

        state, requests = _running(block_size, pipelined)
        v1_plan = Plan()
        budget = 10**6
        scheduler = VllmV1(VllmV1Config(name="vllm_v1"))
        scheduler._schedule_running(state, v1_plan, budget)
        assert {k: v for k, v in v1_plan.num_scheduled_tokens.items() if k in decoding} == \
            dict.fromkeys(decoding, 1)
        assert {k: v for k, v in v1_plan.num_scheduled_tokens.items()
                if k not in decoding} == {r.request_id: r.num_uncomputed_tokens
                                           for r in requests if r.request_id in prefilling}


def test_prefilling_follows_requests_that_join_leave_and_catch_up():
    """`ReplicaState.prefilling` after admissions, a prefill's last chunk, a preemption and a
    readmission: always the running requests with prompt tokens left, in running order."""
    state = ReplicaState(KVCacheManager(num_blocks=1000, block_size=16))
    reqs = [Request(i, 0.0, 40, 5) for i in range(4)]
    for req in reqs:
        state.add(req)

    def expect() -> list[int]:
        return [r.request_id for r in state.running
                if not r.is_decoding and not r.is_caught_up]

    for req in reqs[:3]:
        assert state.kv.try_allocate(req, 40)
        state.admit(req)
    assert [r.request_id for r in state.prefilling()] == expect() == [0, 1, 2]
    plan = Plan(num_scheduled_tokens={0: 40, 1: 16, 2: 40})
    state.commit(plan, 0, 0.0, 1.0)  # 0 and 2 sample their first token; 1 has 24 left
    assert [r.request_id for r in state.prefilling()] == expect() == [1]
    state.preempt(reqs[1])
    assert state.prefilling() == [] and expect() == []
    state.check()
    assert state.kv.try_allocate(reqs[1], 40)
    state.admit(reqs[1])  # at the queue's front again, recomputed from scratch
    assert [r.request_id for r in state.prefilling()] == expect() == [1]
    state.check()


@pytest.mark.slow
def test_the_partition_against_asking_each_request():
    """Two replicas stepped side by side through the same random requests, preemptions (few
    blocks) and queues (few seats), under each policy: one as any replica, the other marked
    `pipelined` (nothing is ever in flight on it), which makes every loop ask each request
    what it is (`is_decoding`, `is_caught_up`) and `commit` test each request for a sample.
    Same plans, shapes, requests and finishes at every iteration; and the first replica
    commits batches that only decode without those tests."""
    import dataclasses

    import numpy as np

    from sim.schedulers.chunked_prefill import ChunkedPrefill, ChunkedPrefillConfig
    from sim.schedulers.prefill_first import PrefillFirst, PrefillFirstConfig
    from sim.schedulers.sglang import SGLang, SGLangConfig

    makers = (
        lambda: ChunkedPrefill(ChunkedPrefillConfig(name="chunked_prefill", token_budget=64,
                                                    max_num_seqs=6)),
        lambda: PrefillFirst(PrefillFirstConfig(name="prefill_first", max_num_seqs=6)),
        lambda: SGLang(SGLangConfig(name="sglang", chunked_prefill_size=64,
                                    max_running_requests=6)),
        lambda: VllmV1(VllmV1Config(name="vllm_v1", max_num_batched_tokens=64, max_num_seqs=6)))
    rng = np.random.default_rng()
    decode_only = 0
    for make in makers:
        num_blocks = int(rng.choice([24, 200]))
        lengths = [(int(rng.integers(1, 60)), int(rng.integers(1, 30))) for _ in range(40)]
        states = []
        for pipelined in (False, True):
            state = ReplicaState(KVCacheManager(num_blocks=num_blocks, block_size=4))
            state.pipelined = pipelined
            for i, (prompt, output) in enumerate(lengths):
                state.add(Request(i, 0.0, prompt, output))
            states.append((state, make()))
        for iteration in range(3000):
            if not any(s.running or s.waiting for s, _ in states):
                break
            plans = [policy.schedule(s, float(iteration)) for s, policy in states]
            assert plans[0] == plans[1]
            shapes = [BatchShape.of_replica(p, s)
                      for p, (s, _) in zip(plans, states, strict=True)]
            assert shapes[0] == shapes[1]
            decode_only += shapes[0].num_prefill_seqs == 0 and not states[0][0].prefilling()
            done = [s.commit(p, iteration, float(iteration), iteration + 1.0)
                    for p, (s, _) in zip(plans, states, strict=True)]
            assert [r.request_id for r in done[0]] == [r.request_id for r in done[1]]
            for a, b in zip(states[0][0].requests.values(), states[1][0].requests.values(),
                            strict=True):
                assert dataclasses.astuple(a) == dataclasses.astuple(b)
            states[0][0].check()
        assert not any(s.running or s.waiting for s, _ in states)
    assert decode_only > 50


def token_iterations(req) -> list[int]:
    return [i for _, first, end in req.all_token_runs() for i in range(first, end)]


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
