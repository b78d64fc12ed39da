"""Stretches on a replica of several pipeline stages (`sim.engine.fastpath.pipeline_stretch`):
hand-worked token times and iteration logs with the constant latency model, equal to
stepping to the last bit, and the property test over random steady pipelines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import sim.engine.fastpath.pipeline as fast_pipeline
from sim import run_scenario
from sim.config.scenario import parse_scenario
from sim.engine.iteration_log import IterationLog
from tests.engine.fastpath_helpers import assert_same_results, record_router_reads
from tests.strategies import assert_nothing_lost, scenarios, without_speculative

TICK = 0.25  # a whole pass through the pipeline; binary fractions keep sums exact


def scenario(tmp_path: Path, rows: str, pipeline: int, *, replicas: int = 1) -> dict:
    trace = tmp_path / "trace.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + rows)
    data = {"name": "pp", "workload": {"format": "vidur", "path": str(trace)},
            "replica": {"scheduler": {"name": "vllm_v1", "max_num_batched_tokens": 64,
                                      "max_num_seqs": 8},
                        "parallelism": {"pipeline": pipeline},
                        "latency": {"kind": "constant", "iteration_s": TICK},
                        "kv_cache": {"block_size": 16, "num_blocks": 100},
                        "prefix_caching": False},
            "record_token_times": True}
    if replicas > 1:
        data["cluster"] = {"replicas": replicas, "router": {"name": "round_robin"}}
    return data


def stretches_taken(monkeypatch) -> list[int]:
    """Lengths of the pipeline stretches the fast runs plan (appended to the returned list)."""
    lengths: list[int] = []
    plan = fast_pipeline.plan_pipeline_stretch

    def counting(*args, **kwargs):
        stretch = plan(*args, **kwargs)
        if stretch is not None:
            lengths.append(len(stretch))
        return stretch

    monkeypatch.setattr(fast_pipeline, "plan_pipeline_stretch", counting)
    return lengths


def fast_equals_stepped(data: dict):
    scen = parse_scenario(data, "test")
    fast, slow = run_scenario(scen), run_scenario(scen, fast_forward=False)
    assert_same_results(fast, slow)
    return fast


def token_times(res, request_id: int) -> list[float]:
    tokens = res.tokens
    return tokens.loc[tokens["request_id"] == request_id, "time_s"].tolist()


def test_two_stages_two_batches_take_turns(tmp_path, monkeypatch):
    # A (100 tokens: chunks of 64 and 36) at 0, B (16) at 0.0625, on two stages of TICK / 2.
    # Both of A's chunks go at 0; B's prefill when the first leaves (0.25); from A's first
    # token (0.375) on, A's and B's decodes take turns, each waiting for its own token: one
    # pass per token each, iterations TICK / 2 apart; once B is done, A's alone, TICK apart.
    lengths = stretches_taken(monkeypatch)
    res = fast_equals_stepped(scenario(tmp_path, "0.0,100,20\n0.0625,16,12\n", pipeline=2))
    assert lengths and max(lengths) > 10
    assert token_times(res, 0) == [0.375 + TICK * i for i in range(20)]
    assert token_times(res, 1) == [0.5 + TICK * i for i in range(12)]
    it = res.iterations
    # 2 chunks, B's prefill, then A's 19 decodes and B's 11 in turns (B's last sent at 3.0,
    # A's at 3.125), then A's 7 left, each sent as its last ends.
    both = [0.375 + TICK / 2 * i for i in range(12 + 11)]
    alone = [both[-1] + TICK * (i + 1) for i in range(19 - 12)]
    assert it["start_s"].tolist() == [0.0, 0.125, 0.25] + both + alone
    assert it["duration_s"].tolist() == [TICK] * len(it)
    assert it["num_seqs"].tolist() == [1] * len(it)
    assert it["num_prefill_tokens"].tolist()[:3] == [64, 36, 16]
    # KV blocks: A's 100 tokens take 7 of 16, B's 1 more; each adds one every 16 tokens.
    assert it["num_kv_blocks_used"].tolist()[:3] == [4, 7, 8]


def test_four_stages_four_batches_and_a_group_that_empties(tmp_path, monkeypatch):
    # A's prompt in four chunks (64, 64, 64, 16) fills the four stages at 0; B, C and D
    # arrive one by one and each gets its prefill as one of A's chunks leaves (0.25, 0.3125,
    # 0.375); A's first token at 0.4375. Then four batches take turns, TICK / 4 apart, each
    # request one pass per token; D's leaves first (its 5 tokens), then the rest go on at the
    # same pace, three batches (then two, then one) in the pipeline.
    rows = "0.0,208,30\n0.2,16,10\n0.3,16,20\n0.35,16,5\n"
    lengths = stretches_taken(monkeypatch)
    res = fast_equals_stepped(scenario(tmp_path, rows, pipeline=4))
    assert lengths and max(lengths) > 10
    for request_id, first_s, n in [(0, 0.4375, 30), (1, 0.5, 10), (2, 0.5625, 20),
                                   (3, 0.625, 5)]:
        assert token_times(res, request_id) == [first_s + TICK * i for i in range(n)]
    it = res.iterations
    assert it["start_s"].tolist()[:8] == [0.0, 0.0625, 0.125, 0.1875, 0.25, 0.3125, 0.375,
                                          0.4375]
    assert it["duration_s"].tolist() == [TICK] * len(it)
    assert len(it) == 4 + 3 + 29 + 9 + 19 + 4  # chunks, prefills, decodes after


def test_round_robin_replicas_cut_stretches_at_each_arrival(tmp_path, monkeypatch):
    # Two replicas behind round robin (nothing reads their loads): each stretch is cut by
    # the poke of a request arriving for it, handed back at its next planning turn.
    rows = "".join(f"{0.37 * i:.2f},{16 + 9 * i},{25 + 3 * (i % 5)}\n" for i in range(16))
    lengths = stretches_taken(monkeypatch)
    res = fast_equals_stepped(scenario(tmp_path, rows, pipeline=3, replicas=2))
    assert lengths
    assert (res.requests["status"] == "finished").all()


@pytest.mark.parametrize("spacing_s", [0.3, 0.5])
@pytest.mark.parametrize("router", ["least_kv_load", "least_outstanding"])
def test_routers_weighing_loads_read_stretches_mid_way(tmp_path, monkeypatch, router,
                                                       spacing_s):
    # Three replicas on four stages behind a router reading every replica at every arrival:
    # a stretch's counts (tokens, requests left, blocks in use) are read without a commit,
    # each load exactly as a stepped replica shows it then; small blocks, so the counts move.
    # Every 0.5 s an arrival comes as an iteration leaves the last stage, before the
    # replica's planning turn: its blocks are read freed (`counts_at`'s last branch).
    from sim.engine.fastpath.pipeline_stretch import PipelineStretch

    loads, mid_way = record_router_reads(monkeypatch, PipelineStretch)
    rows = "".join(f"{spacing_s * i:.2f},{16 + 9 * i},{5 + 11 * (i % 7)}\n"
                   for i in range(40))
    data = scenario(tmp_path, rows, pipeline=4, replicas=3)
    data["cluster"]["router"]["name"] = router
    data["replica"]["kv_cache"] = {"block_size": 4, "num_blocks": 400}
    lengths = stretches_taken(monkeypatch)
    scen = parse_scenario(data, "test")
    fast = run_scenario(scen)
    fast_loads, loads[:] = list(loads), []
    slow = run_scenario(scen, fast_forward=False)
    assert_same_results(fast, slow)
    assert fast_loads == loads
    assert lengths and mid_way[0] > 10


@pytest.mark.parametrize("horizon_s", [0.9, 1.7, 2.3, 3.05, 4.4])
def test_a_horizon_inside_a_steady_pipeline(tmp_path, horizon_s):
    data = scenario(tmp_path, "0.0,100,20\n0.0625,16,12\n0.4,40,9\n", pipeline=2)
    fast_equals_stepped({**data, "horizon_s": horizon_s})


def test_kv_that_runs_short_ends_the_stretch_before_a_preemption(tmp_path, monkeypatch):
    # Barely the blocks for the requests' prompts: decodes run out of blocks and preempt.
    rows = "".join(f"{0.01 * i:.2f},{100 + 7 * i},{40 + i}\n" for i in range(12))
    data = scenario(tmp_path, rows, pipeline=3)
    data["replica"]["kv_cache"] = {"block_size": 16, "num_blocks": 20}
    lengths = stretches_taken(monkeypatch)
    res = fast_equals_stepped(data)
    assert res.requests["num_preemptions"].sum() > 0
    assert lengths


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 12), st.integers(0, 4),
                          st.booleans(), st.booleans()), min_size=1, max_size=30),
       st.integers(1, 5))
# A request's run goes on into the next call's first iteration, which computed its prompt again
# (nobody decoded in it): a token there opens a run of its own.
@example([(0, 2, 0, False, False), (0, 2, 0, False, True)], 1)
def test_strided_tokens_make_the_rows_tokens_one_by_one_make(calls, stride):
    """`add_sampled_strided` records the tokens a step records one by one, the same runs,
    whether the iterations before a request's first (`idle_gap`) and that first itself
    (`idle_first`: a prompt's last chunk) had decodes or not."""
    one, bulk = IterationLog(), IterationLog()
    next_free = 0  # iterations come in order
    expected = []
    for request_id, num_tokens, gap, idle_gap, idle_first in calls:
        first = next_free + gap
        last = first + stride * (num_tokens - 1)
        for log in (one, bulk):
            for j in range(next_free, last + 1):
                idle = idle_first if j == first else idle_gap and j < first
                log.append(0.0, 1.0, 0, 0 if idle else 1, 1, 0, 0, 0)
        for i in range(num_tokens):
            one.add_sampled(first + stride * i, [request_id])
        bulk.add_sampled_strided(request_id, first, num_tokens, stride)
        expected += [(request_id, first + stride * i) for i in range(num_tokens)]
        next_free = last + 1
    ids, its = bulk.sampled_tokens()
    assert sorted(zip(ids.tolist(), its.tolist(), strict=True)) == sorted(expected)
    for a, b in zip(one.sampled_runs(), bulk.sampled_runs(), strict=True):
        assert np.array_equal(a, b)
    assert np.array_equal(one.sampled_request_ids, bulk.sampled_request_ids)


@st.composite
def steady_pipelines(draw):
    """A random scenario on 2 to 4 stages that stretches may cover: a plain KV cache, no
    client timeouts or closed-loop clients, one replica or several behind a router that
    reads no loads or weighs them (reading a stretch's counts mid-way)."""
    data = draw(scenarios())
    replica = data["replica"]
    without_speculative(replica)
    replica["prefix_caching"] = False
    replica["parallelism"] = {"pipeline": draw(st.integers(2, 4))}
    data.pop("clients", None)
    workload = data["workload"]
    workload.pop("timeout_s", None)
    if workload["format"] == "prefix":  # (turns: a client waits for each answer)
        workload.pop("num_turns", None)
        workload.pop("think_time_s", None)
    elif draw(st.booleans()):
        # Long answers, arrivals apart: long steady runs between them.
        workload["lengths"]["output"]["high"] = draw(st.integers(20, 300))
        workload["arrivals"]["qps"] = draw(st.floats(0.5, 20))
    replicas = draw(st.integers(1, 3))
    if replicas > 1:
        data["cluster"] = {"replicas": replicas, "router": {
            "name": draw(st.sampled_from(["round_robin", "random", "least_kv_load",
                                          "least_outstanding"]))}}
    return data


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steady_pipelines())
def test_pipeline_stretches_equal_stepping(data):
    """Stretches on pipelines of 2 to 4 stages (even and uneven layer splits, noise, every
    policy, horizons, preemptions) give the files of a stepped run, to the last bit."""
    scen = parse_scenario(data, "hypothesis")
    fast, slow = run_scenario(scen), run_scenario(scen, fast_forward=False)
    assert_same_results(fast, slow)
    assert_nothing_lost(data, fast)
