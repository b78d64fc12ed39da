"""The fast path (`sim.engine.fastpath`) needs nothing from a policy or a latency model: a
scheduler and a latency model written here, knowing nothing of stretches or run-ahead, get both,
and the results equal a step-by-step run to the last bit, on real traces, random scenarios and
clusters, stretches cut by admissions, and prompts in chunks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import sim.engine.clock
import sim.engine.fastpath.replica
import sim.engine.replica
from sim import run_scenario
from sim.config.scenario import parse_scenario
from tests.engine.fastpath_helpers import assert_same_results, fast_and_stepped, synthetic
from tests.strategies import clusters, scenarios


def run(data: dict, **kwargs):
    return run_scenario(parse_scenario(data, "test"), **kwargs)


@pytest.mark.parametrize("scheduler", [
    {"name": "chunked_prefill", "token_budget": 256, "max_num_seqs": 64},
    {"name": "prefill_first", "max_num_seqs": 64},
    # Tight KV with no reservation: preemptions, recomputes and KV-limited stretches.
    {"name": "chunked_prefill", "token_budget": 128, "max_num_seqs": 32,
     "decode_reserve_tokens": 0},
    {"name": "prefill_first", "decode_reserve_tokens": 0},
])
def test_fast_forward_matches_stepping_every_iteration(scheduler):
    data = {
        "seed": 3,
        "workload": {"format": "synthetic", "num_requests": 150,
                     "arrivals": {"process": "gamma", "qps": 20, "cv": 2},
                     "lengths": {"prompt": {"dist": "lognormal", "mean": 300, "std": 300,
                                            "max": 1500},
                                 "output": {"dist": "uniform", "low": 1, "high": 120}}},
        "replica": {"scheduler": scheduler, "latency": {"kind": "roofline"},
                    "kv_cache": {"block_size": 16, "num_blocks": 140}},
        "record_token_times": True,
    }
    fast = run(data)
    slow = run(data, fast_forward=False)
    assert len(slow.iterations) > 2 * fast.summary["requests"]["total"]
    for name in ("requests", "iterations", "tokens"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.equals(b), name
    if scheduler.get("decode_reserve_tokens") == 0:
        assert fast.summary["num_preemptions"] > 0
    assert np.isfinite(fast.requests["e2e_s"]).all()


@pytest.mark.parametrize("scheduler", [
    {"name": "chunked_prefill", "token_budget": 256},
    {"name": "prefill_first"},
    {"name": "vllm_v1", "async_scheduling": False},
    {"name": "sglang", "overlap_schedule": False},
])
def test_a_lone_replica_cuts_its_stretch_at_the_next_arrival_even_one_rejected(
        monkeypatch, scheduler):
    # A lone replica fed by the trace alone knows, when it runs a stretch, the arrival that
    # will cut it, and waits for the end of the iteration in progress then with no poke; one
    # rejected (beyond the context window) cuts it all the same, and the rest resumes.
    data = {
        "seed": 5,
        "workload": {"format": "synthetic", "num_requests": 400,
                     "arrivals": {"process": "poisson", "qps": 6},
                     "lengths": {"prompt": {"dist": "lognormal", "mean": 600, "std": 600,
                                            "max": 3000},
                                 "output": {"dist": "uniform", "low": 1, "high": 300}}},
        "replica": {"scheduler": scheduler, "latency": {"kind": "roofline"},
                    "max_model_len": 1500},
        "record_token_times": True,
    }
    cuts = {"cut": 0, "resumed": 0}
    alone = sim.engine.fastpath.replica.FastReplica._run_stretch_alone
    resume = sim.engine.fastpath.replica.FastReplica._resume

    def counted(self, stretch, end_s):
        assert self.alone
        cuts["cut"] += self.env.next_arrival_s <= end_s
        return alone(self, stretch, end_s)

    def resumed(self):
        rest = resume(self)
        cuts["resumed"] += rest is not None
        return rest

    monkeypatch.setattr(sim.engine.fastpath.replica.FastReplica, "_run_stretch_alone", counted)
    monkeypatch.setattr(sim.engine.fastpath.replica.FastReplica, "_resume", resumed)
    fast, slow, num_fast, num_slow = fast_and_stepped(monkeypatch, parse_scenario(data, "t"))
    assert_same_results(fast, slow)
    assert (fast.requests["status"] == "rejected").sum() >= 20
    assert cuts["cut"] >= 100 and cuts["resumed"] >= 10, cuts
    assert num_fast < num_slow


@pytest.mark.parametrize("cluster", [
    {"replicas": 2, "router": {"name": "least_kv_load"}},
    {"prefill": {"replicas": 1, "replica": None}, "decode": {"replicas": 2, "replica": None},
     "router": {"name": "round_robin"}},
])
def test_a_new_policy_and_latency_model_get_the_fast_path(registered, monkeypatch, cluster):
    replica = {"scheduler": {"name": "new_policy", "max_num_seqs": 24},
               "latency": {"kind": "new_latency"},
               "kv_cache": {"block_size": 16, "num_blocks": 400}}
    scenario = synthetic(replica, cluster, seed=3, num_requests=300, qps=20,
                         max_prompt=400, max_output=200)
    fast, slow, num_fast, num_slow = fast_and_stepped(monkeypatch, scenario)
    assert_same_results(fast, slow)
    assert fast.summary["requests"]["finished"] == 300
    # Most iterations need no event of their own. Seen: colocated 1,370 events against 9,120
    # stepping; disaggregated 5,458 against 12,454 (prefill replicas step: their hand-offs are
    # events), so the bound is half.
    num_iterations = fast.summary["num_iterations"]
    assert num_slow > num_iterations
    assert num_fast < num_slow / 2, (num_fast, num_slow, num_iterations)


@pytest.mark.parametrize("scheduler", [{"name": "chunked_prefill", "token_budget": 512},
                                       {"name": "vllm_v1"},
                                       {"name": "vllm_v1", "async_scheduling": False},
                                       {"name": "sglang"}, {"name": "prefill_first"}])
def test_fast_path_equals_stepping_on_a_real_trace(traces, scheduler):
    """The first 1,500 requests of the Azure conversation trace (long stretches, finishes
    inside them, arrivals cutting them): every result file equals a step-by-step run."""
    data = {"seed": 0, "record_token_times": True,
            "workload": {"format": "azure", "num_requests": 1500,
                         "path": str(traces / "azure_llm_2023" /
                                     "AzureLLMInferenceTrace_conv.csv")},
            "replica": {"model": "llama-3.1-8b", "gpu": "h100-sxm", "scheduler": scheduler,
                        "latency": {"kind": "roofline"}}}
    scenario = parse_scenario(data, "test")
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert fast.summary["requests"]["finished"] == 1500
    assert_same_results(fast, slow)


@pytest.mark.parametrize("router", ["least_kv_load", "least_outstanding"])
def test_routers_read_stretches_in_progress_as_stepping_shows_them(traces, router):
    """Four replicas at 4x the Azure conversation trace's rate: at each arrival the router
    reads every replica, most of them mid-stretch and many past a finish in it. The counts it
    reads from a stretch without committing it route every request as a step-by-step run
    does, and no stretch is committed piece by piece for the router's sake."""
    data = {"seed": 0, "record_token_times": True,
            "workload": {"format": "azure", "num_requests": 1500, "rate_scale": 4.0,
                         "path": str(traces / "azure_llm_2023" /
                                     "AzureLLMInferenceTrace_conv.csv")},
            "replica": {"model": "llama-3.1-8b", "gpu": "h100-sxm",
                        "scheduler": {"name": "chunked_prefill", "token_budget": 512},
                        "latency": {"kind": "roofline"}},
            "cluster": {"replicas": 4, "router": {"name": router}}}
    scenario = parse_scenario(data, "test")
    commits = []
    commit_stretch = sim.engine.fastpath.replica.commit_stretch

    def counting(state, stretch, num_steps, log):
        commits.append(num_steps == len(stretch))
        return commit_stretch(state, stretch, num_steps, log)

    sim.engine.fastpath.replica.commit_stretch = counting
    try:
        fast = run_scenario(scenario)
    finally:
        sim.engine.fastpath.replica.commit_stretch = commit_stretch
    slow = run_scenario(scenario, fast_forward=False)
    assert_same_results(fast, slow)
    # Each stretch is committed whole (cut short by new work on its replica, or not). When a
    # read past a finish committed the ended part, 936 of 2,108 commits were partial
    # (least_kv_load; least_outstanding 935 of 2,227).
    assert commits and all(commits), (sum(commits), len(commits))


@pytest.mark.parametrize("scheduler", [{"name": "chunked_prefill", "token_budget": 256},
                                       # (stretches: the synchronous engine's fast path)
                                       {"name": "vllm_v1", "async_scheduling": False},
                                       # (SGLang's own preallocation may pass after any step:
                                       # its replica steps while a transfer waits; Mini-SGLang's
                                       # rule, as the others, only after a finish)
                                       {"name": "sglang", "overlap_schedule": False,
                                        "decode_reserve_tokens": 0},
                                       {"name": "prefill_first"}, {"name": "new_policy"}])
@pytest.mark.parametrize("decode", [
    {"max_num_seqs": 64, "num_blocks": 2000},  # room: admissions rarely change a plan
    {"max_num_seqs": 6, "num_blocks": 150},  # transfers wait for slots and blocks
    {"max_num_seqs": 12, "num_blocks": 60},  # blocks run short: decodes are preempted
    # A slow link: KV takes long to arrive, so the rest of a stretch runs long enough for its
    # blocks to run short (vLLM v1 admits a transfer while blocks last).
    {"max_num_seqs": 24, "num_blocks": 50, "link_gb_s": 0.05, "seed": 7},
], ids=["room", "tight", "short", "slow_link"])
def test_a_stretch_cut_by_an_admission_resumes_as_stepping_plans(registered, monkeypatch,
                                                                 scheduler, decode):
    """A decode replica admitting a transfer (blocks for KV on its way) cuts its stretch; where
    its plan would not change, the rest of the stretch resumes instead of being planned again
    (`FastReplica._resume`): results equal stepping, with noise, whether the rest runs whole,
    stops at its first finish (a transfer still waits) or is refused (a join, blocks short)."""
    outcomes = []
    resume = sim.engine.fastpath.replica.FastReplica._resume

    def resumed(self):
        rest = resume(self)
        outcomes.append(rest is not None)
        return rest

    monkeypatch.setattr(sim.engine.fastpath.replica.FastReplica, "_resume", resumed)
    prefill = {"scheduler": {"name": "chunked_prefill", "token_budget": 512},
               "latency": {"kind": "roofline", "noise": {"kind": "lognormal", "sigma": 0.1}}}
    replica = {"scheduler": {**scheduler, "max_num_seqs": decode["max_num_seqs"]},
               "latency": {"kind": "roofline", "noise": {"kind": "lognormal", "sigma": 0.1}},
               "kv_cache": {"block_size": 16, "num_blocks": decode["num_blocks"]}}
    if scheduler["name"] == "new_policy":
        replica["latency"] = {"kind": "new_latency"}
    cluster = {"prefill": {"replicas": 1, "replica": None},
               "decode": {"replicas": 2, "replica": None}, "router": {"name": "least_kv_load"},
               "link": {"bandwidth_gb_s": decode.get("link_gb_s", 50.0)}}
    scenario = synthetic(replica, cluster, seed=decode.get("seed", 5), num_requests=200, qps=30,
                         max_prompt=300, max_output=120)
    data = scenario.model_dump(mode="json")
    data["cluster"]["prefill"]["replica"] = {**data["cluster"]["prefill"]["replica"], **prefill}
    scenario = parse_scenario(data, "test")
    fast = run_scenario(scenario)
    assert any(outcomes) and not all(outcomes), (sum(outcomes), len(outcomes))
    slow = run_scenario(scenario, fast_forward=False)
    assert_same_results(fast, slow)


@pytest.mark.parametrize("scheduler", [
    {"name": "chunked_prefill", "token_budget": 128},
    {"name": "chunked_prefill", "token_budget": 256, "chunk_size": 96, "min_chunk_tokens": 32},
    {"name": "vllm_v1", "max_num_batched_tokens": 256, "long_prefill_token_threshold": 80,
     "async_scheduling": False},  # (stretches: the synchronous engine's fast path)
    {"name": "sglang", "chunked_prefill_size": 128, "mixed_chunk": True,
     "overlap_schedule": False},
    {"name": "sglang", "chunked_prefill_size": 128, "overlap_schedule": False},
    {"name": "new_policy"},
], ids=["chunked", "chunk_size", "vllm_v1", "sglang_mixed", "sglang", "new_policy"])
@pytest.mark.parametrize("num_blocks", [2000, 140], ids=["room", "tight"])
def test_prompts_in_chunks_fast_forward_as_stepping(registered, monkeypatch, scheduler,
                                                    num_blocks):
    """Long prompts cut into chunks beside decodes on two replicas (a router reading them
    mid-stretch), with noise: stretches that begin with a prompt's chunks (`plan_stretch`)
    give every result file of a step-by-step run, with KV to spare or so short that
    requests are preempted and recomputed and a prompt's chunks may not find their blocks."""
    planned = []
    plan_stretch = sim.engine.fastpath.replica.plan_stretch

    def counted(*args, **kwargs):
        stretch = plan_stretch(*args, **kwargs)
        planned.append(stretch is not None and stretch.prefill_pos >= 0)
        return stretch

    monkeypatch.setattr(sim.engine.fastpath.replica, "plan_stretch", counted)
    # Admitting while blocks last (no reserve for decodes' future tokens) runs them short.
    replica = {"scheduler": {**scheduler, "max_num_seqs": 16, "decode_reserve_tokens": 0},
               "latency": {"kind": "roofline",
                           "noise": {"kind": "lognormal", "sigma": 0.2, "correlation": 0.5}},
               "kv_cache": {"block_size": 16, "num_blocks": num_blocks}}
    if scheduler["name"] == "new_policy":
        replica["latency"] = {"kind": "new_latency"}
    cluster = {"replicas": 2, "router": {"name": "least_kv_load"}}
    scenario = synthetic(replica, cluster, seed=13, num_requests=150, qps=8,
                         max_prompt=1200, max_output=100)
    fast, slow, num_fast, num_slow = fast_and_stepped(monkeypatch, scenario)
    assert sum(planned) > 20, (sum(planned), len(planned))
    if num_blocks < 1000 and scheduler["name"] != "new_policy":  # it reserves every token
        assert slow.iterations["num_preempted"].sum() > 0
    assert_same_results(fast, slow)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_fast_forward_is_exact(data):
    scenario = parse_scenario(data, "hypothesis")
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert_same_results(fast, slow)


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_cluster_fast_forward_is_exact(data):
    """Every cluster kind and router: fast-forward equals stepping, to the last bit. Events at
    the same instant (common with the constant model) happen in one fixed order in both modes:
    finished iterations first, then arrivals and transfers, then planning in replica order."""
    scenario = parse_scenario(data, "hypothesis")
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert_same_results(fast, slow)
