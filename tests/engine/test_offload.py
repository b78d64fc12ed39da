"""The KV cache's CPU tier (`replica.kv_offload`, vLLM 0.15.1's offloading connector): its
rules on a hand-made case with times worked out by hand, the tier's bookkeeping, the inputs it
refuses, and (hypothesis) fast-forward equal to stepping with nothing lost. Step for step
against vLLM's own connector: the `offload_*` golden fixtures (tests/schedulers/test_golden.py)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from sim import run_scenario
from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from sim.core.offload import NOT_READY, CpuTier
from sim.core.offload_lru import PENDING
from sim.core.request import Request, Status
from sim.engine.cluster import Cluster
from tests.engine.test_fast_path import assert_same_results
from tests.helpers import run_cli_out
from tests.strategies import assert_nothing_lost, clusters, scenarios

BLOCK_BYTES = 131072 * 16  # a 16-token block of the default model (Llama-3-8B), one GPU


def _scenario(**replica):
    return parse_scenario({
        "name": "offload", "seed": 0,
        "workload": {"format": "synthetic", "num_requests": 1,
                     "arrivals": {"process": "poisson", "qps": 1.0},
                     "lengths": {"prompt": {"dist": "fixed", "value": 1},
                                 "output": {"dist": "fixed", "value": 1}}},
        "replica": {"scheduler": {"name": "vllm_v1", "async_scheduling": False},
                    "latency": {"kind": "constant", "iteration_s": 0.01},
                    "prefix_caching": True, **replica}}, "<test>")


def test_a_prefix_evicted_from_the_gpu_is_loaded_from_the_cpu_tier():
    """A computes a 64-token prompt; its 4 blocks are copied out (1 ms a block) while it
    decodes; B's prompt then takes every GPU block, evicting A's; C (A's prompt plus 16 of its
    own) finds nothing on the GPU and A's blocks on the CPU. Worked out step by step (10 ms a
    step; vLLM's sync engine):
    - 0-10 ms A's prompt (its blocks' stores planned), 10-20 ms its last token; the stores
      start at the 10 ms launch and end at 14 ms; A finishes at 20 ms holding its blocks (it
      stored), the 20 ms poll finds its stores done: freed (cached).
    - B (30 ms) takes all 8 usable blocks (9, less vLLM's null block): A's are evicted; 30-40
      ms, it finishes; its 8 stores start at the 40 ms poll, end at 48 ms: its blocks stay
      held until a poll finds that, which is C's arrival at 50 ms (the engine is idle).
    - C at 50 ms: no GPU hit, 64 tokens on the CPU: the poll frees B's blocks, C gets 5
      blocks and its load starts (50-54 ms); the 54 ms poll finds it done; 54-64 ms its last
      16 tokens, its first token at 64 ms."""
    scenario = _scenario(kv_cache={"block_size": 16, "num_blocks": 9},
                         kv_offload={"size_gib": 16 * BLOCK_BYTES / 2**30,
                                     "host_bandwidth_gb_s": BLOCK_BYTES / 1e-3 / 1e9},
                         scheduler={"name": "vllm_v1", "async_scheduling": False,
                                    "engine_version": "0.15.1"})
    cluster = Cluster(scenario, fast_forward=False)
    a = Request(0, 0.0, 64, 2, hash_ids=(1, 2, 3, 4), hash_block_tokens=16)
    b = Request(1, 0.030, 128, 1, hash_ids=tuple(range(10, 18)), hash_block_tokens=16)
    c = Request(2, 0.050, 80, 1, hash_ids=(1, 2, 3, 4, 5), hash_block_tokens=16)
    cluster.run([a, b, c])
    assert [r.status for r in (a, b, c)] == [Status.FINISHED] * 3
    assert a.finish_s == pytest.approx(0.020) and b.finish_s == pytest.approx(0.040)
    assert c.first_scheduled_s == pytest.approx(0.054)
    assert c.finish_s == pytest.approx(0.064)
    assert c.num_cached_tokens == 64 and c.num_computed_tokens == 80
    state = cluster.replicas[0].state
    counters = state.offload.tier.counters
    assert (counters.num_hit_requests, counters.num_hit_tokens) == (1, 64)
    # A's 4 blocks, B's 8 and C's own fifth were stored; nothing was evicted from the tier.
    assert counters.num_stored_blocks == 4 + 8 + 1 and counters.num_evicted_blocks == 0

    # Without the tier C computes its whole prompt: 50-60 ms (a constant step).
    plain = Cluster(_scenario(kv_cache={"block_size": 16, "num_blocks": 9}), fast_forward=False)
    a, b, c = (Request(r.request_id, r.arrival_s, r.num_prompt_tokens,
                       r.num_target_output_tokens, hash_ids=r.hash_ids, hash_block_tokens=16)
               for r in (a, b, c))
    plain.run([a, b, c])
    assert c.first_scheduled_s == pytest.approx(0.050) and c.num_cached_tokens == 0


def test_on_a_pipeline_each_stage_copies_its_share_after_the_step():
    """The case above on two pipeline stages (5 ms each; vLLM's engine synchronous there):
    each stage's GPU copies its half of a block's KV over its own host link, side by side,
    0.5 ms a block, a step's stores starting once its last stage is done. A's stores run
    10-12 ms, B's 40-44 ms; C's load of 4 blocks 50-52 ms, its last 16 tokens 52-62 ms."""
    scenario = _scenario(kv_cache={"block_size": 16, "num_blocks": 9},
                         kv_offload={"size_gib": 16 * BLOCK_BYTES / 2**30,
                                     "host_bandwidth_gb_s": BLOCK_BYTES / 1e-3 / 1e9},
                         parallelism={"pipeline": 2})
    cluster = Cluster(scenario, fast_forward=False)
    a = Request(0, 0.0, 64, 2, hash_ids=(1, 2, 3, 4), hash_block_tokens=16)
    b = Request(1, 0.030, 128, 1, hash_ids=tuple(range(10, 18)), hash_block_tokens=16)
    c = Request(2, 0.050, 80, 1, hash_ids=(1, 2, 3, 4, 5), hash_block_tokens=16)
    cluster.run([a, b, c])
    assert a.finish_s == pytest.approx(0.020) and b.finish_s == pytest.approx(0.040)
    assert c.first_scheduled_s == pytest.approx(0.052)
    assert c.finish_s == pytest.approx(0.062) and c.num_cached_tokens == 64
    replica = cluster.replicas[0]
    assert replica.copies.load_busy_s == pytest.approx(4 * 0.0005)
    assert replica.copies.store_busy_s == pytest.approx((4 + 8 + 1) * 0.0005)


def test_the_tier_evicts_least_recently_used_and_pins_what_loads():
    tier = CpuTier(3)
    assert tier.store(7, [1, 2, 3], 3) == 3
    assert tier.lookup([1, 2, 3], 0, 16) == 0  # being stored: not loadable yet
    tier.transfers_done([7], [])
    assert tier.lookup([1, 2, 3], 0, 16) == 48
    tier.start_load(8, [1, 2])  # pinned while loading
    # Room for one more block: the least recently used unpinned one goes (3: a touch makes a
    # request's first block the most recent, its last the least).
    assert tier.store(9, [4], 1) == 1 and 3 not in tier._blocks
    assert tier.counters.num_evicted_blocks == 1
    # Nothing evictable (1, 2 pinned, 4 being stored): refused, tried again later.
    assert tier.store(10, [5], 1) == 0 and tier.counters.num_refused_stores == 1
    # A request whose blocks another request loads waits (None).
    assert tier.lookup([1, 2], 0, 16) is None
    tier.transfers_done([9], [8])
    assert tier._blocks[4] == 0 and tier._blocks[1] == 0
    assert tier.store(10, [5], 1) == 1 and tier._blocks[5] == NOT_READY
    tier.check()


def test_a_finished_request_that_stored_keeps_its_blocks_until_its_stores_are_done():
    tier = CpuTier(4)
    assert tier.store(1, [11, 12], 2) == 2
    assert tier.request_finished(1)  # the scheduler delays the free
    assert not tier.request_finished(2)  # stored nothing


def _prefill_with_tier(wire_s: float, horizon_s: float, version: str) -> Cluster:
    """One prefill replica with a CPU tier (vLLM, sync engine, 10 ms a step, a block stored
    in 1 ms) and one decode replica; a 64-token prompt's KV crosses the link in `wire_s`."""
    sync = {"name": "vllm_v1", "async_scheduling": False, "engine_version": version}
    plain = {"scheduler": sync, "latency": {"kind": "constant", "iteration_s": 0.01},
             "prefix_caching": True, "kv_cache": {"block_size": 16, "num_blocks": 9}}
    tier = {"size_gib": 16 * BLOCK_BYTES / 2**30,
            "host_bandwidth_gb_s": BLOCK_BYTES / 1e-3 / 1e9}
    return Cluster(parse_scenario({
        "name": "pd_offload", "seed": 0, "horizon_s": horizon_s,
        "workload": {"format": "synthetic", "num_requests": 1,
                     "arrivals": {"process": "poisson", "qps": 1.0},
                     "lengths": {"prompt": {"dist": "fixed", "value": 1},
                                 "output": {"dist": "fixed", "value": 1}}},
        "cluster": {"prefill": {"replicas": 1, "replica": {**plain, "kv_offload": tier}},
                    "decode": {"replicas": 1, "replica": plain},
                    "link": {"bandwidth_gb_s": 64 * BLOCK_BYTES / 16 / wire_s / 1e9,
                             "latency_s": 0.0}}}, "<test>"), fast_forward=False)


def _host_states(tier) -> list:
    """Each host block's state: "stored" while its store is not complete, else the loads
    reading it (0.15.1's tier and 0.33.0's keep them apart)."""
    states = tier._blocks.values() if isinstance(tier, CpuTier) else tier._ref.values()
    return ["stored" if s in (NOT_READY, PENDING) else s for s in states]


@pytest.mark.parametrize("version", ["0.15.1", "0.33.0"])
@pytest.mark.parametrize("wire_s", [0.002, 0.030])
def test_a_prefill_replica_frees_a_handed_off_prompt_once_sent_and_stored(version, wire_s):
    """A's 64-token prompt (4 blocks) is computed 0-10 ms on the prefill replica and handed
    off; its 4 stores run 10-14 ms (after the step that computed them) while its KV crosses
    the link, 10-12 ms or 10-40 ms. B (8 tokens, one out: it finishes there) arrives at 15
    ms, so the engine steps (15-25 ms) and polls: an idle 0.15.1 engine polls no copy. Looked
    at 27 ms: vLLM frees A's blocks only once both are done (its transfer connector and the
    tier's, side by side in a `MultiConnector`, each delay the free). 0.15.1's tier
    completes A's stores, its host blocks loadable, only when A is reported finished
    sending (with B's step's output, at 25 ms), which `MultiConnector` holds back until the
    transfer has ended too; 0.33.0's completes each store when its copy ends."""
    cluster = _prefill_with_tier(wire_s, 0.027, version)
    a = Request(0, 0.0, 64, 2, hash_ids=(1, 2, 3, 4), hash_block_tokens=16)
    b = Request(1, 0.015, 8, 1)
    cluster.run([a, b])
    state = cluster.replicas[0].state
    assert a.prefill_end_s == pytest.approx(0.010)
    sent = a.transfer_end_s is not None
    assert sent == (wire_s < 0.005)
    assert state.kv.num_held_blocks(a.request_id) == (0 if sent else 4)
    assert state.offload.tier.counters.num_stored_blocks == 4
    assert _host_states(state.offload.tier) == [0 if sent or version == "0.33.0" else
                                                "stored"] * 4
    state.check()

    # Run on: at 40 ms both are done whichever ended last.
    cluster = _prefill_with_tier(wire_s, 0.5, version)
    a = Request(0, 0.0, 64, 2, hash_ids=(1, 2, 3, 4), hash_block_tokens=16)
    b = Request(1, 0.015, 8, 1)
    cluster.run([a, b])
    state = cluster.replicas[0].state
    assert a.status is b.status is Status.FINISHED
    assert state.kv.num_held_blocks(a.request_id) == 0 and not state.offload.delayed
    assert _host_states(state.offload.tier) == [0] * 4
    state.check()


@pytest.mark.parametrize(("replica", "field", "words"), [
    ({"scheduler": {"name": "sglang"}}, "replica.kv_offload", "offloading connector"),
    ({"prefix_caching": False}, "replica.kv_offload", "prefix_caching"),
    ({"kv_offload": {"size_gib": 1e-6}}, "replica.kv_offload.size_gib", "holds no KV block"),
])
def test_what_the_tier_refuses_is_named(replica, field, words):
    base = {"kv_offload": {"size_gib": 1.0}}
    with pytest.raises(InputError) as err:
        Cluster(_scenario(**{**base, **replica}))
    assert err.value.field == field and words in str(err.value)


def assert_tier_run_exact(data: dict) -> None:
    """A run with a host tier: fast-forward equal to stepping, nothing lost, the tier's facts
    in the summary once a request finished."""
    scenario = parse_scenario(data, "hypothesis")
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert_same_results(fast, slow)
    assert_nothing_lost(data, fast)
    if (fast.requests["status"] == "finished").any():
        assert "kv_offload" in fast.summary
    # A prefill replica hands a request off once the engine has taken its first token (a
    # launch blocked on copies takes it late).
    moved = fast.requests[fast.requests["transfer_start_s"].notna()]
    assert (moved["prefill_end_s"] <= moved["transfer_start_s"]).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(offload=True))
def test_with_a_cpu_tier_fast_forward_is_exact_and_nothing_is_lost(data):
    assert_tier_run_exact(data)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(host_tier=True))
def test_with_a_host_tier_on_the_prefill_pool_fast_forward_is_exact_and_nothing_is_lost(data):
    """Disaggregated, a CPU tier (vLLM) or a hierarchical cache (SGLang) on the prefill pool:
    hand-offs hold blocks the tier's copies read."""
    assert_tier_run_exact(data)


def _vllm_replica(version: str, num_blocks: int, tier_blocks: int, **tier) -> dict:
    return {"scheduler": {"name": "vllm_v1", "max_num_batched_tokens": 8, "max_num_seqs": 1,
                          "engine_version": version, "async_scheduling": False},
            "latency": {"kind": "roofline", "noise": {"kind": "none"}},
            "kv_cache": {"block_size": 1, "num_blocks": num_blocks}, "prefix_caching": True,
            "kv_offload": {"size_gib": tier_blocks * 131072 / 2**30,
                           "host_bandwidth_gb_s": 0.2, **tier}}


def test_an_idle_decode_replica_polls_its_tier_for_a_transfer_waiting_for_blocks():
    """Found by the property test below: a decode replica (vLLM 0.15.1, 5 usable one-token
    blocks, a CPU tier) goes idle holding its last request's 3 blocks until a poll reports
    their stores done (vLLM's engine idles so). A transfer that needs 3 of the 5 then waits
    there: vLLM keeps it in its waiting queue, so the engine steps, empty, and the first
    step's poll frees the blocks. Before, the replica waited for work that never came and
    the request was left unfinished ("transferring_at_horizon") with no horizon."""
    data = {"name": "idle-decode-poll", "seed": 0, "horizon_s": None, "record_token_times": True,
            "workload": {"format": "prefix", "num_conversations": 6, "num_requests": 6,
                         "arrivals": {"process": "gamma", "qps": 1.0, "cv": 1.0},
                         "question_tokens": {"dist": "uniform", "low": 1, "high": 3},
                         "output_tokens": {"dist": "uniform", "low": 1, "high": 1},
                         "hash_block_tokens": 4},
            "cluster": {"prefill": {"replicas": 1, "replica": _vllm_replica(
                            "0.33.0", 6, 1, store_threshold=0)},
                        "decode": {"replicas": 2, "replica": _vllm_replica("0.15.1", 6, 3)},
                        "link": {"bandwidth_gb_s": 0.001, "latency_s": 0.0},
                        "router": {"name": "round_robin"}}}
    assert_tier_run_exact(data)
    reqs = run_scenario(parse_scenario(data, "<test>")).requests
    assert (reqs["status"] == "finished").all()
    last = reqs.iloc[-1]
    # Its decode replica idled since 2.22 s with the blocks held; its stores were long done.
    assert last["decode_replica_id"] == 1
    assert last["transfer_start_s"] == last["prefill_end_s"]


LIVELOCK = {  # found by a fuzzer; vLLM 0.15.1's own scheduler loops on it too
    "name": "livelock", "seed": 511, "record_token_times": True,
    "workload": {"format": "synthetic", "num_requests": 16,
                 "arrivals": {"process": "gamma", "qps": 157.96306880105635, "cv": 0.3},
                 "lengths": {"prompt": {"dist": "uniform", "low": 1, "high": 128},
                             "output": {"dist": "uniform", "low": 1, "high": 25}}},
    "replica": {"scheduler": {"name": "vllm_v1", "max_num_batched_tokens": 8, "max_num_seqs": 7,
                              "long_prefill_token_threshold": 2, "engine_version": "0.15.1",
                              "speculative": {"method": "eagle3", "num_speculative_tokens": 4,
                                              "acceptance_rate": 0.8, "draft_time_ratio": 0.0},
                              "async_scheduling": False},
                "latency": {"kind": "constant", "iteration_s": 0.01},
                "kv_cache": {"block_size": 16, "num_blocks": 11}, "prefix_caching": True,
                "kv_offload": {"size_gib": 21 * BLOCK_BYTES / 2**30,
                               "host_bandwidth_gb_s": 50.0}}}


def test_a_livelock_stops_the_replica_with_its_reason(tmp_path, monkeypatch, capsys):
    """11 GPU blocks, EAGLE-3's 4 lookahead slots, a threshold of 2 and a CPU tier: two
    requests preempt each other and are admitted again for ever (one holding KV it reloaded
    from the tier), no token sampled, as vLLM 0.15.1's scheduler does (checked with it: 32,000
    preemptions each in 40 s of recording). With no horizon the run ends all the same: after
    1,000 preemptions with no request decoding, the replica stops, every request left
    unfinished saying why, and `simulate` says so. The tier's hit shares count first
    admissions (vLLM's `num_cached_tokens`), not the 500 reloads."""
    import yaml

    scenario = parse_scenario({**LIVELOCK, "horizon_s": None}, "<test>")
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert_same_results(fast, slow)
    reqs = fast.requests
    assert (reqs["status"] == "unfinished").all()
    assert reqs["reason"].str.startswith("engine_stalled: 1,000 preemptions").all()
    assert 1000 <= reqs["num_preemptions"].sum() < 1010
    hits = fast.summary["kv_offload"]["hit_rate_tokens"]
    assert 0 <= hits["gpu"] <= 1 and 0 <= hits["cpu"] <= 1
    assert fast.summary["kv_offload"]["num_loads"] > 400
    path = tmp_path / "livelock.yaml"
    path.write_text(yaml.safe_dump({**LIVELOCK, "horizon_s": None}))
    code, out = run_cli_out(monkeypatch, capsys, "simulate", str(path), "--out",
                            str(tmp_path / "o"))
    assert code == 0
    assert "STALLED: 16 requests will never finish" in out.replace("\n", " ")
