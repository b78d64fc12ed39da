"""One definition of a decode, `Request.is_decoding`: the hot loops over the running requests
(`schedule_decodes`, vLLM v1's, `BatchShape.of_replica`) tell decodes from prompts by identity
with `ReplicaState.prefilling()` (kept as requests join, catch up and leave) instead of asking
each request. Each against the definition, on the cases where a request is one token short of
its prompt or of its output, on a replica with and without a pipeline (where a request may be
caught up, its token in flight)."""

from __future__ import annotations

import itertools

from sim.core.kv_cache import KVCacheManager
from sim.core.plan import Plan
from sim.core.request import Request
from sim.core.state import ReplicaState
from sim.latency.base import BatchShape
from sim.schedulers.base import schedule_decodes
from sim.schedulers.vllm_v1 import VllmV1, VllmV1Config

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


def test_the_shape_of_an_iteration_from_the_replicas_counts():
    """`BatchShape.of_replica` (the decodes' KV from the token count the replica keeps, less
    the prompts') against `from_plan` at every iteration of three policies stepping random
    requests through preemptions (few blocks) and queues (few seats): equal, and the count is
    used on batches that only decode and on batches with chunks beside decodes."""
    import numpy as np

    from sim.schedulers.chunked_prefill import ChunkedPrefill, ChunkedPrefillConfig
    from sim.schedulers.prefill_first import PrefillFirst, PrefillFirstConfig
    from sim.schedulers.sglang import SGLang, SGLangConfig

    rng = np.random.default_rng(3)
    used = mixed = 0
    for make in (lambda: ChunkedPrefill(ChunkedPrefillConfig(
                     name="chunked_prefill", token_budget=64, max_num_seqs=6)),
                 lambda: PrefillFirst(PrefillFirstConfig(name="prefill_first", max_num_seqs=6)),
                 lambda: SGLang(SGLangConfig(name="sglang", chunked_prefill_size=64,
                                             max_running_requests=6)),
                 lambda: VllmV1(VllmV1Config(name="vllm_v1", max_num_batched_tokens=64,
                                             max_num_seqs=6))):
        state = ReplicaState(KVCacheManager(num_blocks=int(rng.choice([24, 200])),
                                            block_size=4))
        for i in range(40):
            state.add(Request(i, 0.0, int(rng.integers(1, 60)), int(rng.integers(1, 30))))
        scheduler = make()
        # (Not `Stepper`: the shape is read between the plan and its commit.)
        for iteration in range(2000):
            if not (state.running or state.waiting):
                break
            plan = scheduler.schedule(state, float(iteration))
            shape = BatchShape.of_replica(plan, state)
            assert shape == BatchShape.from_plan(plan, state.requests)
            every = plan.num_seqs == len(state.running)
            used += every and shape.num_prefill_seqs == 0
            mixed += every and shape.num_prefill_seqs > 0 and shape.num_decode_tokens > 0
            state.commit(plan, iteration, float(iteration), iteration + 1.0)
            state.check()
        assert not (state.running or state.waiting)
    assert used > 100 and mixed > 30, (used, mixed)


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
