"""Pipeline parallelism: P iterations in flight, as vLLM v1's batch queue keeps them.

Exact timestamps with the constant latency model (each of P stages holds an iteration for
TICK / P), then invariants over random workloads with every policy, preemption of
requests in flight, prefix caching and horizons included.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim import run_scenario
from sim.config.scenario import parse_scenario
from tests.engine.fastpath_helpers import assert_same_results, fast_and_stepped
from tests.strategies import assert_nothing_lost, clusters, scenarios, without_speculative

TICK = 0.25  # a whole pass through the pipeline; binary fractions keep sums exact


def scenario(tmp_path: Path, rows: str, scheduler: dict, pipeline: int) -> dict:
    trace = tmp_path / "trace.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + rows)
    return {"name": "pp", "workload": {"format": "vidur", "path": str(trace)},
            "replica": {"scheduler": scheduler, "parallelism": {"pipeline": pipeline},
                        "latency": {"kind": "constant", "iteration_s": TICK},
                        "kv_cache": {"block_size": 16, "num_blocks": 100}},
            "record_token_times": True}


def run(data: dict):
    return run_scenario(parse_scenario(data, "test"))


def token_times(res, request_id: int) -> list[float]:
    tokens = res.tokens
    return tokens.loc[tokens["request_id"] == request_id, "time_s"].tolist()


CHUNKED_64 = [{"name": "chunked_prefill", "token_budget": 64, "max_num_seqs": 8},
              {"name": "vllm_v1", "max_num_batched_tokens": 64, "max_num_seqs": 8}]


def test_a_prompts_chunks_follow_each_other_down_the_pipeline(tmp_path):
    for scheduler in CHUNKED_64:
        # One prompt of 200 tokens in chunks of 64, 64, 64, 8, on two stages of TICK / 2.
        res = run(scenario(tmp_path, "0.0,200,3\n", scheduler, pipeline=2))
        # Chunks 1 and 2 are sent at 0 (the second enters stage 1 when the first leaves it);
        # chunk 3 when chunk 1 leaves the pipeline (0.25), chunk 4 at 0.375; the first token
        # at 0.625. A decode then waits for its own token: one pass (0.25) per token.
        assert token_times(res, 0) == [0.625, 0.875, 1.125], scheduler
        it = res.iterations
        assert it["start_s"].tolist() == [0.0, 0.125, 0.25, 0.375, 0.625, 0.875]
        assert it["duration_s"].tolist() == [TICK] * 6
        assert it["num_prefill_tokens"].tolist() == [64, 64, 64, 8, 0, 0]
        # Without the pipeline the same chunks take a pass each, one after the other.
        flat = run(scenario(tmp_path, "0.0,200,3\n", scheduler, pipeline=1))
        assert token_times(flat, 0) == [1.0, 1.25, 1.5]


def test_requests_in_separate_iterations_interleave(tmp_path):
    # A (100 tokens: chunks of 64 and 36) at 0, B (16) at 0.0625. Both of A's chunks are sent
    # at 0; the engine then blocks on the oldest result (0.25), as vLLM's does, and only then
    # sends B's prefill, which enters stage 1 as A's second chunk leaves it. From then on A's
    # and B's iterations alternate, one pass (0.25) per token each.
    rows = "0.0,100,4\n0.0625,16,4\n"
    scheduler = {"name": "chunked_prefill", "token_budget": 64, "max_num_seqs": 8}
    res = run(scenario(tmp_path, rows, scheduler, pipeline=2))
    assert token_times(res, 0) == [0.375, 0.625, 0.875, 1.125]
    assert token_times(res, 1) == [0.5, 0.75, 1.0, 1.25]
    assert res.iterations["start_s"].tolist()[:4] == [0.0, 0.125, 0.25, 0.375]
    # One stage: B's prefill joins A's second chunk, and both sample at 0.5.
    flat = run(scenario(tmp_path, rows, scheduler, pipeline=1))
    assert token_times(flat, 0) == [0.5, 0.75, 1.0, 1.25]
    assert token_times(flat, 1) == [0.5, 0.75, 1.0, 1.25]
    # Stages busy back to back from 0.125 on: the replica has an iteration in flight from 0 to
    # the end, and counts that time once.
    replica = res.summary["replicas"][0]
    assert replica["busy_fraction"] == 1.0
    # KV blocks as each iteration logged them at sending, holding until the next is sent: 4
    # blocks over [0, 0.125), 7 to 0.25, 8 to 0.5, 9 to the end at 1.25, of 100. Weighting
    # each overlapping pass by its whole duration would give 72 / 9 = 8.0 blocks.
    assert res.iterations["num_kv_blocks_used"].tolist() == [4, 7, 8, 8] + [9] * 5
    assert replica["mean_kv_utilization"] == round((4 + 7 + 2 * 8 + 6 * 9) * 0.125 / 1.25 / 100,
                                                   6)


def test_work_arriving_while_the_engine_blocks_waits_for_the_oldest_result(tmp_path):
    # A's prefill alone at 0 (nothing else to schedule): the engine blocks on it. B arrives
    # at 0.0625 and is scheduled only at 0.25, with A's first decode, in one iteration.
    res = run(scenario(tmp_path, "0.0,16,4\n0.0625,16,4\n",
                       {"name": "chunked_prefill", "token_budget": 64, "max_num_seqs": 8},
                       pipeline=2))
    assert token_times(res, 0) == [0.25, 0.5, 0.75, 1.0]
    assert token_times(res, 1) == [0.5, 0.75, 1.0, 1.25]
    assert res.requests["first_scheduled_s"].tolist() == [0.0, 0.25]


def test_stages_hold_their_share_of_the_layers(tmp_path):
    # Three stages of Llama-3-8B's 32 layers, split as vLLM's `get_pp_indices` splits them:
    # 11, 11 and 10. Three requests, each in its own iteration, keep the pipeline full: the
    # busiest stages (11 / 32 of a pass each) set the pace, so an iteration is sent every
    # 11 / 32 * TICK, where thirds of a pass would give TICK / 3. A pass still takes TICK.
    rows = "0.0,16,6\n" * 3
    res = run(scenario(tmp_path, rows, {"name": "chunked_prefill", "token_budget": 16,
                                        "max_num_seqs": 8}, pipeline=3))
    assert res.scenario.replica.model == "llama-3-8b"
    it = res.iterations
    assert it["start_s"].tolist()[:12] == [k * 11 / 32 * TICK for k in range(12)]
    assert (it["duration_s"] == TICK).all()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(2, 4))
def test_pipelined_invariants(data, pipeline):
    data["replica"]["parallelism"] = {"pipeline": pipeline}
    # (on a pipeline: refused, not modelled yet; but vLLM's CPU tier)
    without_speculative(data["replica"], cpu_tier=True)
    res = run_scenario(parse_scenario(data, "hypothesis"))
    req, it, tokens = res.requests, res.iterations, res.tokens
    assert_nothing_lost(data, res)
    # Tokens are conserved: an iteration in flight when its request was preempted still ran
    # (its tokens count as recomputed).
    computed = int(it["num_prefill_tokens"].sum() + it["num_decode_tokens"].sum())
    held = int((req["num_computed_tokens"] + req["num_recomputed_tokens"]).sum())
    if data["replica"]["prefix_caching"]:
        assert computed <= held
    else:
        assert computed == held
    done = req[req["status"] == "finished"]
    assert (done["num_computed_tokens"] == done["num_prompt_tokens"]
            + done["num_output_tokens"] - 1).all()
    assert (tokens.groupby("request_id")["time_s"].diff().dropna() > 0).all()
    assert (done["ttft_s"] > 0).all()
    # At most P iterations in flight, leaving in the order they were sent; no stage holds two.
    start = it["start_s"].to_numpy()
    end = start + it["duration_s"].to_numpy()
    assert np.all(np.diff(end) > 0) and np.all(np.diff(start) >= 0)
    assert np.all(start[pipeline:] >= end[:-pipeline])
    assert it["num_seqs"].gt(0).all()
    sched = data["replica"]["scheduler"]
    assert (it["num_seqs"] <= sched["max_num_seqs"]).all()
    assert (it["num_kv_blocks_used"] <= data["replica"]["kv_cache"]["num_blocks"]).all()


def kv_starved(tmp_path: Path) -> dict:
    """vLLM v1 on 3 stages, twelve requests, KV for about one long request."""
    rows = "".join(f"{0.01 * i:.2f},{100 + 7 * i},{40 + i}\n" for i in range(12))
    data = scenario(tmp_path, rows, {"name": "vllm_v1", "max_num_batched_tokens": 64,
                                     "max_num_seqs": 8}, pipeline=3)
    data["replica"]["kv_cache"] = {"block_size": 16, "num_blocks": 20}
    return data


def test_pipelined_runs_preempt_requests_in_flight(tmp_path):
    # vLLM v1 with barely enough KV for one long request: decodes run out of blocks and
    # preempt the newest running request, which may be in flight; everyone still finishes.
    data = kv_starved(tmp_path)
    res = run(data)
    req = res.requests
    assert (req["status"] == "finished").all()
    assert req["num_preemptions"].sum() > 0
    assert (req["num_generated_tokens"] == req["num_output_tokens"]).all()


def test_a_horizon_takes_back_iterations_in_flight_even_for_preempted_requests(tmp_path):
    # The same KV-starved run cut at many instants: tokens computed by logged iterations
    # equal what requests hold plus what they recomputed (an iteration in flight at the
    # horizon never ran, also for a request preempted while it was in flight), every
    # preemption is logged with an iteration or, at the horizon, with none, and a request whose
    # only iteration was in flight counts as never scheduled.
    data = kv_starved(tmp_path)
    full = run(data)
    assert int(full.iterations["num_preempted"].sum()) == int(
        full.requests["num_preemptions"].sum()) > 0
    for horizon in np.arange(0.19, 12.0, 0.37):
        res = run({**data, "horizon_s": float(horizon)})
        req, it = res.requests, res.iterations
        computed = int(it["num_prefill_tokens"].sum() + it["num_decode_tokens"].sum())
        assert computed == int((req["num_computed_tokens"] + req["num_recomputed_tokens"]).sum())
        never = req["num_computed_tokens"].eq(0) & req["num_recomputed_tokens"].eq(0)
        assert req.loc[never, "first_scheduled_s"].isna().all()


def pipelined(data: dict, pipeline: int) -> dict:
    """`data` with every replica (of each pool, in a disaggregated cluster) on `pipeline`
    stages."""
    pools = [data["cluster"][pool] for pool in ("prefill", "decode") if pool in data["cluster"]]
    for replica in [data["replica"]] if not pools else [pool["replica"] for pool in pools]:
        replica["parallelism"] = {"pipeline": pipeline}
        without_speculative(replica, cpu_tier=True)
    return data


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.integers(2, 4))
def test_pipelined_run_ahead_equals_stepping(data, pipeline):
    """A pipelined replica takes the results due before anything else can touch it without an
    event each, as any replica does: every cluster kind gives the files of a run that waits
    for every result, to the last bit."""
    scenario = parse_scenario(pipelined(data, pipeline), "hypothesis")
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert_same_results(fast, slow)


def test_pipelined_replicas_run_ahead_between_arrivals(monkeypatch):
    # Two colocated replicas on two stages: most results are taken with no event of their own
    # (seen: 428 events against 3,919 waiting for each, for 3,711 iterations).
    data = {"seed": 2, "workload": {"format": "synthetic", "num_requests": 120,
                                    "arrivals": {"process": "poisson", "qps": 8},
                                    "lengths": {"prompt": {"dist": "uniform", "low": 20,
                                                           "high": 300},
                                                "output": {"dist": "uniform", "low": 1,
                                                           "high": 80}}},
            "replica": {"scheduler": {"name": "chunked_prefill", "token_budget": 128},
                        "latency": {"kind": "roofline"}, "parallelism": {"pipeline": 2}},
            "cluster": {"replicas": 2, "router": {"name": "least_kv_load"}}}
    fast, slow, num_fast, num_slow = fast_and_stepped(monkeypatch, parse_scenario(data, "test"))
    assert fast.iterations.equals(slow.iterations)
    assert num_slow > fast.summary["num_iterations"]
    assert num_fast < num_slow / 3, (num_fast, num_slow)


@pytest.mark.parametrize("host_s, async_s", [(0.004, 0.006), (0.007, 0.007)])
def test_host_work_overlaps_the_gpu_under_async_scheduling(monkeypatch, host_s, async_s):
    """vLLM's async scheduling prepares an iteration while the GPU runs the one before: a 10 ms
    iteration of which `host_s` is host work takes max(10 ms - host, host); scheduling
    synchronously, the whole 10 ms (`LatencyModel.host_time_s`)."""
    from sim.latency.constant import ConstantLatency

    monkeypatch.setattr(ConstantLatency, "host_time_s", lambda self, shape: host_s)

    def durations(async_scheduling: bool) -> set[float]:
        res = run_scenario(parse_scenario({
            "workload": {"format": "synthetic", "num_requests": 20,
                         "arrivals": {"process": "poisson", "qps": 50},
                         "lengths": {"prompt": {"dist": "uniform", "low": 4, "high": 60},
                                     "output": {"dist": "uniform", "low": 2, "high": 30}}},
            "replica": {"model": "tiny", "latency": {"kind": "constant", "iteration_s": 0.01},
                        "scheduler": {"name": "vllm_v1", "max_num_batched_tokens": 64,
                                      "async_scheduling": async_scheduling}}}, "test"))
        return {round(d, 12) for d in res.iterations["duration_s"]}

    assert durations(True) == {async_s}
    assert durations(False) == {0.01}
