"""The fast path needs nothing from a policy or a latency model: a scheduler and a latency model
written here, knowing nothing of stretches or run-ahead, get both, and the results equal a
step-by-step run to the last bit."""

from __future__ import annotations

import numpy as np
import pytest

import sim.engine
from sim import run_scenario
from sim.config import parse_scenario
from sim.latency.base import LATENCY_MODELS, BatchShape, LatencyConfig, LatencyModel, Num
from sim.plan import Plan
from sim.schedulers.base import SCHEDULERS, Scheduler, schedule_decodes, try_admit
from sim.state import ReplicaState


class NewPolicy(Scheduler):
    """Decodes first, then admits whole prompts FCFS while blocks last: a policy as a new
    contributor would write it, with no fast-path code."""

    def schedule(self, state: ReplicaState, now_s: float) -> Plan:
        plan = Plan()
        schedule_decodes(state, plan)
        while state.waiting and len(state.running) < self.config.max_num_seqs:
            req = state.waiting[0]
            num_tokens = req.num_uncomputed_tokens
            if try_admit(state, req, num_tokens, None, 0) is None:
                break
            plan.num_scheduled_tokens[req.request_id] = num_tokens
        return plan


class NewLatency(LatencyModel):
    """A made-up model with a non-linear decode term, element-wise on arrays."""

    def __init__(self, config: LatencyConfig, model: object, gpu: object) -> None:
        pass

    def iteration_time_s(self, shape: BatchShape) -> Num:
        return 0.004 + 1e-5 * shape.num_prefill_tokens + 3e-8 * np.sqrt(
            shape.decode_kv_tokens * 1.0) * shape.num_decode_tokens


def synthetic(replica: dict, cluster: dict, *, seed: int, num_requests: int, qps: float,
              max_prompt: int, max_output: int):
    """Poisson arrivals, uniform lengths, token times recorded; `replica` on every replica of
    `cluster` (both pools of a disaggregated one)."""
    data = {"seed": seed, "record_token_times": True,
            "workload": {"format": "synthetic", "num_requests": num_requests,
                         "arrivals": {"process": "poisson", "qps": qps},
                         "lengths": {"prompt": {"dist": "uniform", "low": 20, "high": max_prompt},
                                     "output": {"dist": "uniform", "low": 1,
                                                "high": max_output}}},
            "cluster": cluster}
    if "prefill" in cluster:
        cluster["prefill"]["replica"] = cluster["decode"]["replica"] = replica
    else:
        data["replica"] = replica
    return parse_scenario(data, "test")


@pytest.fixture
def registered():
    SCHEDULERS.register("new_policy")(NewPolicy)
    LATENCY_MODELS.register("new_latency")(NewLatency)
    yield
    del SCHEDULERS._entries["new_policy"], LATENCY_MODELS._entries["new_latency"]


def count_events(monkeypatch) -> list[int]:
    """How many SimPy events the runs process (appended to the returned list)."""
    counts = [0]
    step = sim.engine.Environment.step

    def counting(env):
        counts[0] += 1
        step(env)

    monkeypatch.setattr(sim.engine.Environment, "step", counting)
    return counts


def fast_and_stepped(monkeypatch, scenario):
    """The scenario's results fast-forwarded and stepped, and the SimPy events each took."""
    events = count_events(monkeypatch)
    fast = run_scenario(scenario)
    num_fast = events[0]
    slow = run_scenario(scenario, fast_forward=False)
    return fast, slow, num_fast, events[0] - num_fast


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
    assert fast.requests.equals(slow.requests)
    assert fast.iterations.equals(slow.iterations)
    assert fast.tokens.equals(slow.tokens)
    assert fast.summary == slow.summary
    assert fast.summary["requests"]["finished"] == 300
    # Most iterations need no event of their own. Seen: colocated 1,370 events against 9,120
    # stepping; disaggregated 5,458 against 12,454 (prefill replicas step: their hand-offs are
    # events), so the bound is half.
    num_iterations = fast.summary["num_iterations"]
    assert num_slow > num_iterations
    assert num_fast < num_slow / 2, (num_fast, num_slow, num_iterations)


@pytest.mark.parametrize("scheduler", [{"name": "chunked_prefill", "token_budget": 512},
                                       {"name": "vllm_v1"}, {"name": "sglang"},
                                       {"name": "prefill_first"}])
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
    assert fast.requests.equals(slow.requests)
    assert fast.iterations.equals(slow.iterations)
    assert fast.tokens.equals(slow.tokens)
    assert fast.summary == slow.summary


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
    commit_stretch = sim.engine.commit_stretch

    def counting(state, stretch, num_steps, log):
        commits.append(num_steps == len(stretch))
        return commit_stretch(state, stretch, num_steps, log)

    sim.engine.commit_stretch = counting
    try:
        fast = run_scenario(scenario)
    finally:
        sim.engine.commit_stretch = commit_stretch
    slow = run_scenario(scenario, fast_forward=False)
    assert fast.requests.equals(slow.requests)
    assert fast.iterations.equals(slow.iterations)
    assert fast.tokens.equals(slow.tokens)
    assert fast.summary == slow.summary
    # Each stretch is committed whole (cut short by new work on its replica, or not). When a
    # read past a finish committed the ended part, 936 of 2,108 commits were partial
    # (least_kv_load; least_outstanding 935 of 2,227).
    assert commits and all(commits), (sum(commits), len(commits))


def test_batch_sizes_follow_the_requests_left():
    """A shrinking stretch's batch sizes and KV reads, against a request-by-request count."""
    from sim.stretch import batch_sizes

    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 12))
        computed = rng.integers(1, 5000, size=n)
        left = rng.integers(1, 60, size=n)
        num_steps = int(rng.integers(1, int(left.max()) + 1))
        seqs, kv = batch_sizes(computed, left, num_steps)
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
    monkeypatch.setattr(sim.engine, "STRETCH_STEPS", max_steps)
    replica = {"scheduler": {"name": "chunked_prefill", "token_budget": 256},
               "latency": {"kind": "roofline"}, "kv_cache": {"block_size": 16, "num_blocks": 600}}
    scenario = synthetic(replica, cluster, seed=5, num_requests=200, qps=30,
                         max_prompt=600, max_output=120)
    lengths = []
    plan_stretch = sim.engine.plan_stretch

    def planned(*args, **kwargs):
        stretch = plan_stretch(*args, **kwargs)
        if stretch is not None:
            lengths.append(len(stretch))
        return stretch

    monkeypatch.setattr(sim.engine, "plan_stretch", planned)
    fast = run_scenario(scenario)
    slow = run_scenario(scenario, fast_forward=False)
    assert max(lengths) == max_steps  # stretches were planned, and cut at the cap
    assert fast.summary["requests"]["finished"] == 200
    assert fast.requests.equals(slow.requests)
    assert fast.iterations.equals(slow.iterations)
    assert fast.tokens.equals(slow.tokens)
    assert fast.summary == slow.summary


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
                          "mixed_chunk": True, "decode_reserve_tokens": 8},
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
