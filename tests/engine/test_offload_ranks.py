"""A CPU tier for the KV cache on data-parallel ranks (`replica.kv_offload` with
`parallelism.data > 1`, `sim.engine.data_parallel`): each rank's engine core runs its own
connector and a tier of the whole size; a rank whose requests wait on copies polls once a
lockstep step, running dummy batches beside the others' work; a rank whose launch waits for a
preempted request's stores holds every rank's step back (with async scheduling, that rank's
results too), and an empty step's report waits in the rank's batch queue. Times worked out by
hand on a constant latency (10 ms a step), then (hypothesis) nothing lost and the same results
run twice."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim import run_scenario
from sim.config.scenario import parse_scenario
from sim.core.request import Request, Status
from sim.engine.cluster import Cluster
from tests.engine.test_data_parallel import assert_exact_and_repeats
from tests.engine.test_fast_path import assert_same_results
from tests.strategies import assert_nothing_lost, data_parallel_clusters, scenarios

# A 16-token block of Qwen3-30B-A3B on one GPU (48 layers, 4 KV heads of 128, bf16).
BLOCK_BYTES = 2 * 48 * 4 * 128 * 2 * 16
STEP_S = 0.01


def _raw(version: str = "0.15.1", num_blocks: int = 9, copy_s: float = 1e-3,
         num_cpu_blocks: int = 16, data: int = 2) -> dict:
    return {"name": "dp-tier", "seed": 0,
            "workload": {"format": "synthetic", "num_requests": 40,
                         "arrivals": {"process": "poisson", "qps": 20.0},
                         "lengths": {"prompt": {"dist": "fixed", "value": 64},
                                     "output": {"dist": "fixed", "value": 4}}},
            "replica": {"model": "qwen3-30b-a3b", "parallelism": {"data": data, "expert": data},
                        "scheduler": {"name": "vllm_v1", "async_scheduling": False,
                                      "engine_version": version},
                        "latency": {"kind": "constant", "iteration_s": STEP_S},
                        "prefix_caching": True,
                        "kv_cache": {"block_size": 16, "num_blocks": num_blocks},
                        "kv_offload": {"size_gib": num_cpu_blocks * BLOCK_BYTES / 2**30,
                                       "host_bandwidth_gb_s": BLOCK_BYTES / copy_s / 1e9}}}


def _cluster(**kwargs) -> Cluster:
    return Cluster(parse_scenario(_raw(**kwargs), "<test>"), fast_forward=False)


def _token_times(cluster: Cluster, req: Request) -> list[float]:
    log = cluster.replicas[req.replica_id].log
    ids, iterations = log.sampled_tokens()
    return log.output_s()[iterations[ids == req.request_id]].tolist()


def _run_reload(cluster: Cluster) -> tuple[Request, ...]:
    """The reload case below on `cluster` (two ranks): A, B and C go to rank 0, D and E to
    rank 1, and all finish; returns (A, B, C, D, E)."""
    a = Request(0, 0.0, 64, 2, hash_ids=(1, 2, 3, 4), hash_block_tokens=16)
    d = Request(1, 0.001, 16, 20, hash_ids=(40,), hash_block_tokens=16)
    b = Request(2, 0.030, 128, 1, hash_ids=tuple(range(10, 18)), hash_block_tokens=16)
    e = Request(3, 0.040, 16, 1, hash_ids=(50,), hash_block_tokens=16)
    c = Request(4, 0.050, 80, 1, hash_ids=(1, 2, 3, 4, 5), hash_block_tokens=16)
    cluster.run([a, d, b, e, c])
    assert all(r.status == Status.FINISHED for r in (a, b, c, d, e))
    assert [r.replica_id for r in (a, b, c, d, e)] == [0, 0, 0, 1, 1]
    return a, b, c, d, e


def _run_preemption(cluster: Cluster) -> tuple[Request, ...]:
    """The preemption case below on `cluster` (two ranks, 6 GPU blocks): A and B go to rank
    0, D to rank 1, B is preempted once, and all finish; returns (A, B, D)."""
    a = Request(0, 0.0, 32, 40, hash_ids=(1, 2), hash_block_tokens=16)
    d = Request(1, 0.0, 16, 10, hash_ids=(9,), hash_block_tokens=16)
    b = Request(2, 0.0, 32, 2, hash_ids=(3, 4), hash_block_tokens=16)
    cluster.run([a, d, b])
    assert all(r.status == Status.FINISHED for r in (a, b, d))
    assert [r.replica_id for r in (a, b, d)] == [0, 0, 1]
    assert b.num_preemptions == 1
    return a, b, d


def test_each_rank_holds_a_tier_of_the_whole_size():
    """vLLM's `CPUOffloadingSpec` divides `cpu_bytes_to_use` by a block's bytes on its
    engine's `world_size` GPUs (tensor x pipeline, not data-parallel ranks): every rank's
    connector gets the whole 16 blocks."""
    cluster = _cluster(data=4)
    assert [rank.state.offload.tier.num_blocks for rank in cluster.replicas] == [16] * 4


@pytest.mark.parametrize(("version", "first_s", "alone_s"),
                         [("0.15.1", 0.080, 0.054), ("0.33.0", 0.070, 0.054)])
def test_a_reload_on_one_rank_polls_once_a_step_while_the_other_decodes(version, first_s,
                                                                        alone_s):
    """vLLM 0.15.1's connector on rank 0 (9 GPU blocks, 8 usable; 1 ms a block each way); D
    decodes on rank 1 throughout, a token every 10 ms. The balancer (4 x waiting + running,
    its counts from t = 0 plus its own picks; ties to rank 0) sends A, B and C to rank 0, D
    and E to rank 1.
    - 0-10 ms A's 64-token prompt (4 blocks, stored 10-14 ms), 10-20 ms its last token; the
      20 ms poll finds its stores done: its blocks are freed, cached.
    - B (30 ms) takes all 8 blocks, evicting A's, and finishes at 40 ms; its 8 stores run
      40-48 ms, so it keeps its blocks until a poll finds them done.
    - C (A's prompt and 16 more) arrives at 50 ms. Rank 0 schedules first, then polls: C gets
      no block, the 50 ms poll frees B's; the step is a dummy batch (50-60 ms) beside D's
      decode. At 60 ms C finds A's 4 blocks on the CPU: its load runs 60-64 ms, another dummy.
      The 70 ms poll finds it done (a third dummy: the scheduler ran before the poll), and at
      80 ms C computes its last 16 tokens: its first token at 90 ms.
    On one replica (no lockstep) the engine plans again at once after each poll: C's load
    starts at 50 ms, its token comes at 64 ms.
    vLLM 0.33.0's connector frees B's blocks when it finishes, so C's load starts at 50 ms
    (50-54 ms, beside a dummy batch); the 60 ms poll finds it done, and C computes at 70 ms."""
    cluster = _cluster(version=version)
    a, b, c, d, e = _run_reload(cluster)
    assert c.first_scheduled_s == pytest.approx(first_s)
    assert c.finish_s == pytest.approx(first_s + STEP_S)
    assert c.num_cached_tokens == 64
    # D's decode is not held up: a token at the end of every step from its prompt's.
    assert _token_times(cluster, d) == pytest.approx([0.020 + k * STEP_S for k in range(20)])
    rank0, rank1 = cluster.replicas
    counters = rank0.state.offload.tier.counters
    assert (counters.num_hit_requests, counters.num_hit_tokens) == (1, 64)
    assert counters.num_stored_blocks == 4 + 8 + 1  # (A's, B's and C's fifth: all prompt)
    assert rank1.state.offload.tier.counters.num_hit_tokens == 0
    assert rank0.copies.load_busy_s == pytest.approx(4e-3)

    # One replica of one rank (no lockstep): the colocated timing.
    alone = Cluster(parse_scenario({**_raw(version), "replica": {
        **_raw(version)["replica"], "parallelism": {}}}, "<test>"), fast_forward=False)
    a, b, c = (Request(r.request_id, r.arrival_s, r.num_prompt_tokens,
                       r.num_target_output_tokens, hash_ids=r.hash_ids, hash_block_tokens=16)
               for r in (a, b, c))
    alone.run([a, b, c])
    assert c.first_scheduled_s == pytest.approx(alone_s)
    assert c.finish_s == pytest.approx(alone_s + STEP_S)


def test_a_launch_waiting_for_a_preempted_requests_stores_holds_every_rank_back():
    """Rank 0 (6 GPU blocks, 5 usable; 10 ms a block each way) runs A and B, 32-token
    prompts (2 blocks each) computed 0-10 ms; rank 1 runs D. Their 4 blocks' stores start at
    the 10 ms launch, in order: A's 10-30 ms, B's 30-50 ms. At 10 ms A's 33rd token takes the
    fifth block and B, short of a sixth, is preempted: vLLM 0.15.1's worker waits for a
    preempted request's stores before the step (`handle_preemptions`), so rank 0 launches at
    50 ms, and the collective holds rank 1 until then: D's second token comes at 60 ms, not
    20 ms."""
    cluster = _cluster(num_blocks=6, copy_s=10e-3)
    a, b, d = _run_preemption(cluster)
    times = _token_times(cluster, d)
    assert times[:3] == pytest.approx([0.010, 0.060, 0.070])
    assert _token_times(cluster, a)[:2] == pytest.approx([0.010, 0.060])
    # Without the tier nothing waits: D's second token at 20 ms.
    raw = _raw(num_blocks=6)
    del raw["replica"]["kv_offload"]
    plain = Cluster(parse_scenario(raw, "<test>"), fast_forward=False)
    a, d, b = (Request(r.request_id, r.arrival_s, r.num_prompt_tokens,
                       r.num_target_output_tokens, hash_ids=r.hash_ids, hash_block_tokens=16)
               for r in (a, d, b))
    plain.run([a, d, b])
    assert _token_times(plain, d)[:2] == pytest.approx([0.010, 0.020])


@pytest.mark.parametrize("version", ["0.15.1", "0.33.0"])
def test_the_summary_gives_the_ranks_tiers_as_one_replicas(version, tmp_path):
    """Hit rates by tier and the copies' busy time, summed over the ranks, as on a
    colocated replica; the same seed gives byte-identical results."""
    raw = _raw(version, num_blocks=12, num_cpu_blocks=64)
    # 8 system prompts of 4 blocks each: more than a rank's 11 usable GPU blocks hold.
    raw["workload"] = {"format": "shared_prefix", "num_groups": 8, "num_prompts_per_group": 5,
                       "system_prompt_tokens": 64, "question_tokens": 16, "output_tokens": 4,
                       "rate_qps": 20.0, "duration_s": 2.0}
    scenario = parse_scenario(raw, "<test>")
    res = run_scenario(scenario, out_dir=tmp_path / "a")
    tier = res.summary["kv_offload"]
    assert set(tier["hit_rate_tokens"]) == {"gpu", "cpu"}
    assert tier["hit_rate_tokens"]["cpu"] > 0
    assert tier["load_busy_s"] > 0 and tier["store_busy_s"] > 0
    assert tier["num_cpu_blocks"] == [64, 64]  # (each rank's whole tier)
    assert (res.requests["status"] == "finished").all()
    run_scenario(scenario, out_dir=tmp_path / "b")
    for name in ("summary.json", "requests.parquet", "iterations.parquet"):
        first, second = (tmp_path / run / name for run in ("a", "b"))
        if name.endswith(".json"):
            assert json.loads(first.read_text()) == json.loads(second.read_text())
        else:
            assert first.read_bytes() == second.read_bytes()


def test_with_async_scheduling_a_blocked_launch_holds_back_that_ranks_results():
    """The case above with async scheduling: step 1 is planned at 0 ms, while step 0 runs,
    and rank 0's launch of it waits for B's stores (10-50 ms, once step 0 is computed). Its
    engine is blocked meanwhile, so it takes step 0's results at 50 ms: A's first token
    comes then, not at 10 ms. Rank 1 takes D's at 10 ms; D's second token waits for the
    collective, 50-60 ms, and the ranks plan again from 50 ms."""
    raw = _raw(num_blocks=6, copy_s=10e-3)
    raw["replica"]["scheduler"]["async_scheduling"] = True
    cluster = Cluster(parse_scenario(raw, "<test>"), fast_forward=False)
    a, b, d = _run_preemption(cluster)
    assert _token_times(cluster, a)[:3] == pytest.approx([0.050, 0.060, 0.070])
    assert _token_times(cluster, d)[:3] == pytest.approx([0.010, 0.060, 0.070])
    rank0, rank1 = cluster.replicas
    assert rank0.log.taken_s == pytest.approx({0: 0.050})
    assert rank1.log.taken_s == {}


def test_with_async_scheduling_an_empty_steps_report_is_applied_when_the_rank_takes_it():
    """The reload case above (vLLM 0.33.0) with async scheduling: each step is planned while
    the one before runs, and a step that runs nothing on rank 0 (a dummy batch) joins its
    batch queue, the poll's report applied when the rank takes the step, at its end. C
    (50 ms) finds A's blocks on the CPU; its load ends before the poll of the step planned
    at 70 ms (run 80-90 ms), which is applied at 90 ms: the plan made then computes C,
    100-110 ms. Synchronous, C computes at 70 ms. D's tokens come every 10 ms throughout,
    from 30 ms (its prompt planned at 10 ms, run 20-30 ms behind A's step in flight)."""
    firsts = []
    for asynchronous in (False, True):
        raw = _raw("0.33.0")
        raw["replica"]["scheduler"]["async_scheduling"] = asynchronous
        cluster = Cluster(parse_scenario(raw, "<test>"), fast_forward=False)
        a, b, c, d, e = _run_reload(cluster)
        assert c.num_cached_tokens == 64
        assert c.finish_s == pytest.approx(c.first_scheduled_s + STEP_S)
        firsts.append(c.first_scheduled_s)
        first_token_s = 0.030 if asynchronous else 0.020
        assert _token_times(cluster, d) == pytest.approx(
            [first_token_s + k * STEP_S for k in range(20)])
    assert firsts == pytest.approx([0.070, 0.100])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(offload=True, data_parallel=True))
def test_ranks_with_a_cpu_tier_lose_nothing_and_repeat_exactly(data):
    """Random workloads on 2 or 4 ranks, each with either release's connector, synchronous
    or with async scheduling: every request
    finished or reported with its reason, the same results stepped or not and run twice."""
    assert_exact_and_repeats(data)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data_parallel_clusters(offload=True))
def test_pools_of_ranks_with_a_cpu_tier_lose_nothing_and_repeat_exactly(data):
    """Disaggregated pools of ranks, a tier on them (not beside speculative decoding on the
    decode pool): nothing lost, the same results run twice."""
    scenario = parse_scenario(data, "hypothesis")
    fast = run_scenario(scenario)
    assert_same_results(fast, run_scenario(scenario, fast_forward=False))
    assert_nothing_lost(data, fast)


@st.composite
def _shared_prefix_ranks(draw):
    """Shared system prompts on ranks whose GPU caches hold a few of them (loads, evictions,
    preemptions under tight caches), either release, the tier from a few blocks to many."""
    data = draw(st.sampled_from([2, 4]))
    version = draw(st.sampled_from(["0.15.1", "0.33.0"]))
    raw = _raw(version, num_blocks=draw(st.integers(14, 40)),
               copy_s=draw(st.sampled_from([1e-4, 1e-3, 2e-2])),
               num_cpu_blocks=draw(st.integers(1, 80)), data=data)
    raw["seed"] = draw(st.integers(0, 2**16))
    raw["workload"] = {"format": "shared_prefix", "num_groups": draw(st.integers(2, 10)),
                       "num_prompts_per_group": draw(st.integers(2, 6)),
                       "system_prompt_tokens": draw(st.sampled_from([32, 64, 128])),
                       "question_tokens": draw(st.integers(1, 40)),
                       "output_tokens": draw(st.integers(1, 40)),
                       "rate_qps": draw(st.sampled_from([5.0, 50.0, 500.0])),
                       "duration_s": 1.0}
    raw["replica"]["scheduler"].update(
        max_num_batched_tokens=draw(st.sampled_from([64, 256, 2048])),
        max_num_seqs=draw(st.integers(1, 16)))
    if version == "0.33.0" and draw(st.booleans()):
        raw["replica"]["kv_offload"].update(eviction_policy="arc",
                                            store_threshold=draw(st.sampled_from([0, 2])))
    raw["replica"]["latency"] = draw(st.sampled_from([
        {"kind": "constant", "iteration_s": STEP_S},
        {"kind": "linear", "base_s": STEP_S, "per_token_s": 1e-5}]))
    raw["horizon_s"] = draw(st.sampled_from([None, 0.7]))
    raw["record_token_times"] = True
    return raw


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_shared_prefix_ranks())
def test_ranks_loading_shared_prefixes_lose_nothing_and_repeat_exactly(raw):
    """Loads and stores on every rank, tight GPU caches: every request finished or reported
    with its reason (`engine_stalled` where a rank's queue can never move, as vLLM's would
    wait for ever), the same results run twice."""
    scenario = parse_scenario(raw, "hypothesis")
    res = run_scenario(scenario)
    assert_same_results(res, run_scenario(scenario))
    # (the shared-prefix generator's count: every request it made, accounted for)
    assert_nothing_lost({**raw, "workload": {**raw["workload"],
                                             "num_requests": len(res.requests)}}, res)
