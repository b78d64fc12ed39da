"""Stretches (`sim.engine.fastpath.stretch`): a shrinking batch's sizes, what a router reads of a
stretch in progress (`ended_counts`), and stretches cut short, preempting in their first plan,
with noise, KV shortfalls and a horizon: every result file equals a step-by-step run's."""

from __future__ import annotations

import numpy as np
import pytest

import sim.engine.clock
import sim.engine.fastpath.replica
import sim.engine.replica
from sim import run_scenario
from sim.config.scenario import parse_scenario
from tests.engine.fastpath_helpers import assert_same_results, ended_counts_direct, synthetic


def test_batch_sizes_follow_the_requests_left():
    """A shrinking stretch's batch sizes and KV reads, against a request-by-request count."""
    from sim.engine.fastpath.stretch import batch_sizes

    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 12))
        computed = rng.integers(1, 5000, size=n)
        left = rng.integers(1, 60, size=n)
        num_steps = int(rng.integers(1, int(left.max()) + 1))
        seqs, kv = batch_sizes(computed.tolist(), left.tolist(), num_steps)
        for j in range(num_steps):
            inside = left > j
            assert np.broadcast_to(seqs, (num_steps,))[j] == inside.sum()
            assert kv[j] == int((computed[inside] + j + 1).sum())


@pytest.mark.parametrize("max_steps", [1, 3])
@pytest.mark.parametrize("cluster", [
    {},
    {"prefill": {"replicas": 1, "replica": None}, "decode": {"replicas": 2, "replica": None},
     "router": {"name": "least_kv_load"}},
])
def test_stretches_planned_short_equal_stepping(monkeypatch, max_steps, cluster):
    """The engine plans a stretch for `STRETCH_STEPS` iterations at most, then plans again:
    stretches cut that short (and committed in pieces, finishing requests inside them) still
    give every result file of a step-by-step run."""
    monkeypatch.setattr(sim.engine.fastpath.replica, "STRETCH_STEPS", max_steps)
    replica = {"scheduler": {"name": "chunked_prefill", "token_budget": 256},
               "latency": {"kind": "roofline"}, "kv_cache": {"block_size": 16, "num_blocks": 600}}
    scenario = synthetic(replica, cluster, seed=5, num_requests=200, qps=30,
                         max_prompt=600, max_output=120)
    lengths = []
    plan_stretch = sim.engine.fastpath.replica.plan_stretch

    def planned(*args, **kwargs):
        stretch = plan_stretch(*args, **kwargs)
        if stretch is not None:
            lengths.append(len(stretch))
        return stretch

    monkeypatch.setattr(sim.engine.fastpath.replica, "plan_stretch", planned)
    fast = run_scenario(scenario)
    slow = run_scenario(scenario, fast_forward=False)
    assert max(lengths) == max_steps  # stretches were planned, and cut at the cap
    assert fast.summary["requests"]["finished"] == 200
    assert_same_results(fast, slow)


# Found by the cluster property test on a random seed (CI's derandomised seed never drew it):
# SGLang on a decode replica with a prefix cache preempts a request and takes it back at once,
# its prompt cached but for one token, so the plan is a steady decode batch and a stretch
# starts with it; the stretch logged 0 preemptions where stepping logs 1.
PREEMPT_THEN_STRETCH = {
    "seed": 23234,
    "workload": {"format": "prefix", "num_conversations": 37,
                 "arrivals": {"process": "gamma", "qps": 185.7382604807358,
                              "cv": 3.9726927040365916},
                 "question_tokens": {"dist": "uniform", "low": 1, "high": 107},
                 "output_tokens": {"dist": "uniform", "low": 1, "high": 64},
                 "hash_block_tokens": 4, "num_turns": 2, "think_time_s": 1.0,
                 "num_requests": 37},
    "record_token_times": True,
    "cluster": {
        **{pool: {"replicas": 2, "replica": {
            "scheduler": {"name": "sglang", "chunked_prefill_size": 14, "max_num_seqs": 31,
                          "mixed_chunk": True, "decode_reserve_tokens": 8,
                          "overlap_schedule": False},  # (stretches: the synchronous loop)
            "latency": {"kind": "roofline",
                        "noise": {"kind": "lognormal", "sigma": 0.1, "correlation": 0.8}},
            "kv_cache": {"block_size": 16, "num_blocks": 28}, "prefix_caching": True}}
           for pool in ("prefill", "decode")},
        "link": {"bandwidth_gb_s": 0.001, "latency_s": 0.0}, "overlap_transfer": True,
        "router": {"name": "round_robin"}},
}


def test_a_stretch_logs_the_preemptions_of_its_first_plan():
    scenario = parse_scenario(PREEMPT_THEN_STRETCH, "test")
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert fast.requests.equals(slow.requests)
    assert slow.iterations["num_preempted"].sum() > 0
    assert fast.iterations.equals(slow.iterations)


@pytest.mark.parametrize("cluster", [
    {},
    {"prefill": {"replicas": 1, "replica": None}, "decode": {"replicas": 2, "replica": None},
     "router": {"name": "least_kv_load"}},
])
def test_stretches_with_noise_shortfalls_and_a_horizon_equal_stepping(monkeypatch, cluster):
    """Stretches committed one iteration in and past a block's worth of iterations (16), with
    noise, KV shortfalls, finishes inside stretches and a horizon that stops the run
    mid-stretch: every result file equals a step-by-step run's."""
    lengths = []
    commit_stretch = sim.engine.fastpath.replica.commit_stretch

    def committed(state, stretch, num_steps, log):
        lengths.append(num_steps)
        return commit_stretch(state, stretch, num_steps, log)

    monkeypatch.setattr(sim.engine.fastpath.replica, "commit_stretch", committed)
    replica = {"scheduler": {"name": "chunked_prefill", "token_budget": 256},
               "latency": {"kind": "roofline",
                           "noise": {"kind": "lognormal", "sigma": 0.2, "correlation": 0.5}},
               "kv_cache": {"block_size": 16, "num_blocks": 500}}
    scenario = synthetic(replica, cluster, seed=11, num_requests=250, qps=25,
                         max_prompt=500, max_output=150)
    scenario = scenario.model_copy(update={"horizon_s": 9.0})
    fast = run_scenario(scenario)
    slow = run_scenario(scenario, fast_forward=False)
    assert min(lengths) == 1 and max(lengths) > 16 and len(lengths) > 50, lengths
    assert 0 < fast.summary["requests"]["finished"] < 250  # the horizon stopped it
    assert_same_results(fast, slow)


def test_ended_counts_of_decode_stretches_and_their_pieces():
    """What a router reads of a decode-only stretch (`ended_counts`, from a table made on the
    first read past a finish), against the stretch's arrays, for every number of iterations
    of random stretches and of what `head` and `after` leave of them."""
    from sim.engine.fastpath.stretch import Stretch

    rng = np.random.default_rng(11)
    past_finish = 0
    for _ in range(300):
        n = int(rng.integers(1, 8))
        length = int(rng.integers(1, 60))
        computed = rng.integers(1, 500, n).astype(np.int64)
        left = rng.integers(1, 80, n).astype(np.int64)
        end = np.cumsum(rng.uniform(0.01, 0.02, length))
        stretch = Stretch(list(range(n)), computed.tolist(), end - 0.01, np.full(length, 0.01),
                          end, 0, 16, True, left.tolist(), int(left.min()))
        cut = int(rng.integers(1, length + 1))
        pieces = [stretch, stretch.head(cut)]
        if cut < length:
            pieces.append(stretch.after(cut, 0))
        for piece in pieces:
            for k in range(len(piece) + 1):
                assert piece.ended_counts(k) == ended_counts_direct(piece, k), k
                past_finish += k >= piece.min_steps_left
    assert past_finish > 1000  # the table, not only the path before the first finish
