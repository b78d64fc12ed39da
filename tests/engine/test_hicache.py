"""SGLang's hierarchical cache in time (`sim.engine.hicache`): a load-back worked out by hand,
what it refuses, and nothing lost on random scenarios."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from sim import run_scenario
from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from sim.core.hicache import HierarchicalCache
from sim.core.request import Request, Status
from sim.engine.cluster import Cluster
from tests.engine.test_offload import assert_tier_run_exact
from tests.strategies import scenarios

# 16 tokens of the default model (Llama-3-8B), one GPU: the bandwidths below copy them in
# 10 ms. (SGLang's pages of more than one token with HiCache are refused: these run on
# pages of one, the prompts' ids still of 16 tokens.)
BLOCK_BYTES = 131072 * 16
NUM_LAYERS = 32


# EAGLE's (S, K, D) = (3, 1, 4), its drafter's time left out of the steps.
EAGLE = {"algorithm": "eagle", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4,
         "acceptance_rate": 0.5, "draft_time_ratio": 0}


def _scenario(hicache: dict | None = None, spec: dict | None = None, **replica):
    scheduler = {"name": "sglang", "overlap_schedule": False,
                 **({"hierarchical_cache": hicache} if hicache is not None else {}),
                 **({"speculative": spec} if spec is not None else {})}
    return parse_scenario({
        "name": "hicache", "seed": 0,
        "workload": {"format": "synthetic", "num_requests": 1,
                     "arrivals": {"process": "poisson", "qps": 1.0},
                     "lengths": {"prompt": {"dist": "fixed", "value": 1},
                                 "output": {"dist": "fixed", "value": 1}}},
        "replica": {"scheduler": scheduler, "prefix_caching": True,
                    "latency": {"kind": "constant", "iteration_s": 0.01}, **replica}},
        "<test>")


def test_a_prefix_off_the_gpu_is_loaded_back_beside_its_batch():
    """A computes a 64-token prompt (4 ids of 16 tokens, a pool of 144, 10 ms a step, 10 ms
    for 16 tokens over the host link): inserted at its prefill's end, 10 ms, its 64 tokens
    are backed up, 10-50 ms; A finishes at 20 ms and the idle replica polls as the copies
    end, taking the acks. B (128 tokens, 70-80 ms) takes A's KV off the GPU (kept in host
    memory); its own backup runs 80-160 ms. C at 200 ms finds A's 64 tokens in host memory:
    loaded back (evicting B's from the GPU), they are a prefix at once, and C's batch
    computes its own 16 tokens while the 64 come in layer by layer: max(10 ms, 40 ms +
    10 ms / 32 layers)."""
    scenario = _scenario({"ratio": 4, "host_bandwidth_gb_s": BLOCK_BYTES / 0.010 / 1e9},
                         kv_cache={"block_size": 1, "num_blocks": 144})
    cluster = Cluster(scenario, fast_forward=True)
    a = Request(0, 0.0, 64, 2, hash_ids=(1, 2, 3, 4), hash_block_tokens=16)
    b = Request(1, 0.070, 128, 1, hash_ids=tuple(range(10, 18)), hash_block_tokens=16)
    c = Request(2, 0.200, 80, 1, hash_ids=(1, 2, 3, 4, 5), hash_block_tokens=16)
    cluster.run([a, b, c])
    assert [r.status for r in (a, b, c)] == [Status.FINISHED] * 3
    assert a.finish_s == pytest.approx(0.020) and b.finish_s == pytest.approx(0.080)
    assert c.first_scheduled_s == pytest.approx(0.200)
    assert c.num_cached_tokens == 64
    assert c.finish_s == pytest.approx(0.200 + 0.040 + 0.010 / NUM_LAYERS)
    replica = cluster.replicas[0]
    kv = replica.state.kv
    assert isinstance(kv, HierarchicalCache)
    counters = kv.counters
    assert (counters.num_hit_requests, counters.num_hit_tokens) == (1, 64)
    assert replica.host_copies is not None
    assert replica.host_copies.load_busy_s == pytest.approx(0.040)
    kv.check()

    # Without the host tier C computes its whole prompt in its 10 ms step.
    plain = Cluster(_scenario(kv_cache={"block_size": 1, "num_blocks": 144}), fast_forward=True)
    a, b, c = (Request(r.request_id, r.arrival_s, r.num_prompt_tokens,
                       r.num_target_output_tokens, hash_ids=r.hash_ids, hash_block_tokens=16)
               for r in (a, b, c))
    plain.run([a, b, c])
    assert c.num_cached_tokens == 0 and c.finish_s == pytest.approx(0.210)


def test_a_backup_holds_its_blocks_until_its_ack():
    """As above, but B arrives at 30 ms, while A's backup (10-50 ms) is in flight: A's 64
    tokens stay locked, and so does its first output's KV, cached when A finishes (20 ms)
    and backed up behind, 50-50.625 ms; B's 128 do not fit beside them, and B waits for the
    acks, taken at 50.625 ms (the replica polls when the copies end)."""
    scenario = _scenario({"ratio": 4, "host_bandwidth_gb_s": BLOCK_BYTES / 0.010 / 1e9},
                         kv_cache={"block_size": 1, "num_blocks": 144})
    cluster = Cluster(scenario, fast_forward=True)
    a = Request(0, 0.0, 64, 2, hash_ids=(1, 2, 3, 4), hash_block_tokens=16)
    b = Request(1, 0.030, 128, 1, hash_ids=tuple(range(10, 18)), hash_block_tokens=16)
    cluster.run([a, b])
    assert b.first_scheduled_s == pytest.approx(0.050625)
    assert b.finish_s == pytest.approx(0.060625)


def test_a_request_arriving_while_a_copy_runs_is_taken_at_once():
    """As above, but B (32 tokens) arrives at 30 ms, while A's backup (10-50 ms) is in
    flight, and fits beside A's locked KV: SGLang's idle loop, polling for the ack,
    takes B at its arrival (not when the copy ends)."""
    scenario = _scenario({"ratio": 4, "host_bandwidth_gb_s": BLOCK_BYTES / 0.010 / 1e9},
                         kv_cache={"block_size": 1, "num_blocks": 144})
    cluster = Cluster(scenario, fast_forward=True)
    a = Request(0, 0.0, 64, 2, hash_ids=(1, 2, 3, 4), hash_block_tokens=16)
    b = Request(1, 0.030, 32, 1, hash_ids=(20, 21), hash_block_tokens=16)
    cluster.run([a, b])
    assert b.first_scheduled_s == pytest.approx(0.030)
    assert b.finish_s == pytest.approx(0.040)


def test_with_eagle_the_drafter_layer_is_copied_too():
    """The first test's run with EAGLE (its drafter's time left out): keys are token pairs,
    so A's 80-token prompt (5 ids of 16) caches the KV of 79 tokens, and each token's copy
    moves the drafter's layer beside the target's 32: 0.625 ms x 33 / 32 = 0.64453125 ms.
    A (0-10 ms) is backed up 10-60.92 ms; B (128 tokens, 70-80 ms) takes A's KV off the GPU
    (kept in host memory) and backs up its 127 tokens' KV. C at 200 ms (96 tokens, A's 5
    ids and one of its own) finds A's 79 tokens in host memory: loaded back beside its
    batch, which takes max(10 ms, 79 x 0.64453125 ms + 10 ms / 32 layers) = 51.23 ms. C's
    prefill then backs up its own 16: 222 tokens in all."""
    scenario = _scenario({"ratio": 4, "host_bandwidth_gb_s": BLOCK_BYTES / 0.010 / 1e9},
                         EAGLE, kv_cache={"block_size": 1, "num_blocks": 144})
    cluster = Cluster(scenario, fast_forward=True)
    a = Request(0, 0.0, 80, 1, hash_ids=(1, 2, 3, 4, 5), hash_block_tokens=16)
    b = Request(1, 0.070, 128, 1, hash_ids=tuple(range(10, 18)), hash_block_tokens=16)
    c = Request(2, 0.200, 96, 1, hash_ids=(1, 2, 3, 4, 5, 99), hash_block_tokens=16)
    cluster.run([a, b, c])
    assert [r.status for r in (a, b, c)] == [Status.FINISHED] * 3
    assert b.first_scheduled_s == pytest.approx(0.070)
    assert c.num_cached_tokens == 79
    assert c.finish_s == pytest.approx(0.200 + 79 * 0.00064453125 + 0.010 / NUM_LAYERS)
    replica = cluster.replicas[0]
    copies = replica.host_copies
    assert copies is not None
    assert copies.s_per_block == pytest.approx(0.00064453125)
    assert copies.load_busy_s == pytest.approx(79 * 0.00064453125)
    kv = replica.state.kv
    assert isinstance(kv, HierarchicalCache)
    assert (kv.counters.num_hit_tokens, kv.counters.num_stored_blocks) == (79, 222)
    assert copies.store_busy_s == pytest.approx(222 * 0.00064453125)
    kv.check()


@pytest.mark.parametrize(("spec", "s_per_block", "num_host_blocks"), [
    # No drafter: the target's 32 layers, 0.625 ms a token; 0.2162688 GB holds 1,650
    # tokens of 131,072 bytes, plus a page: 1,651 blocks of one token.
    (None, 0.000625, 1651),
    # n-gram keeps no draft KV.
    ({"algorithm": "ngram", "acceptance_rate": 0.5}, 0.000625, 1651),
    # EAGLE's layer sits in a host pool of its own, as many tokens as the target's.
    (EAGLE, 0.00064453125, 1651),
    # An MTP head's layer is packed into the target's host pool: 135,168 bytes a token,
    # 1,600 tokens, plus a page.
    ({**EAGLE, "algorithm": "nextn"}, 0.00064453125, 1601),
])
def test_a_drafter_layer_adds_to_copies_and_maybe_to_the_host_pool(spec, s_per_block,
                                                                   num_host_blocks):
    scenario = _scenario({"size_gb": 1650 * 131072 / 1e9,
                          "host_bandwidth_gb_s": BLOCK_BYTES / 0.010 / 1e9},
                         spec, kv_cache={"block_size": 1, "num_blocks": 144})
    replica = Cluster(scenario, fast_forward=True).replicas[0]
    assert replica.host_copies is not None
    assert replica.host_copies.s_per_block == pytest.approx(s_per_block)
    kv = replica.state.kv
    assert isinstance(kv, HierarchicalCache)
    assert kv.num_host_blocks == num_host_blocks
    assert kv.bigram_keys == (spec is not None and spec["algorithm"] != "ngram")


def _prefill_pool_scenario(hicache: dict, scheduler: dict | None = None,
                           prefill_replicas: int = 1, router: str | None = None):
    """Disaggregated: one SGLang prefill server (or `prefill_replicas` behind `router`) with
    the hierarchical cache `hicache` (144 GPU slots, 10 ms a step, the normal loop unless
    `scheduler` says otherwise), one decode server of 3,200, a link carrying 64 tokens in
    100 ms."""
    side = {"scheduler": scheduler or {"name": "sglang", "overlap_schedule": False},
            "prefix_caching": True, "latency": {"kind": "constant", "iteration_s": 0.01},
            "kv_cache": {"block_size": 1, "num_blocks": 144}}
    prefill = {**side, "scheduler": {**side["scheduler"], "hierarchical_cache": hicache}}
    cluster = {"prefill": {"replicas": prefill_replicas, "replica": prefill},
               "decode": {"replicas": 1, "replica": {
                   **side, "kv_cache": {"block_size": 1, "num_blocks": 3200}}},
               "link": {"bandwidth_gb_s": 64 * BLOCK_BYTES / 16 / 0.100 / 1e9,
                        "latency_s": 0.0}}
    if router is not None:
        cluster["router"] = {"name": router}
    return parse_scenario({
        "name": "hicache_pd", "seed": 0,
        "workload": {"format": "synthetic", "num_requests": 1,
                     "arrivals": {"process": "poisson", "qps": 1.0},
                     "lengths": {"prompt": {"dist": "fixed", "value": 1},
                                 "output": {"dist": "fixed", "value": 1}}},
        "cluster": cluster}, "<test>")


def test_on_a_prefill_server_a_prompt_is_backed_up_at_its_end_and_loaded_back():
    """Disaggregated, the hierarchical cache on the prefill server (as above: 10 ms a step,
    10 ms for 16 tokens over the host link, 144 tokens). A's 64-token prompt is computed
    0-10 ms and inserted in the tree at once (`checkpoint_disagg_prefill`), its backup
    10-50 ms, while its KV crosses a slow link, 10-110 ms, holding its 64 slots. B (128
    tokens, 60 ms) waits for them: 110-120 ms, taking A's blocks off the GPU (kept in host memory);
    its own KV crosses the link 120-320 ms. C at 400 ms finds A's 64 tokens in host memory:
    its prompt ends at 400 ms + 40 ms + 10 ms / 32 layers (loaded back beside its batch)."""
    scenario = _prefill_pool_scenario({"ratio": 4,
                                       "host_bandwidth_gb_s": BLOCK_BYTES / 0.010 / 1e9})
    cluster = Cluster(scenario, fast_forward=True)
    a = Request(0, 0.0, 64, 2, hash_ids=(1, 2, 3, 4), hash_block_tokens=16)
    b = Request(1, 0.060, 128, 1, hash_ids=tuple(range(10, 18)), hash_block_tokens=16)
    c = Request(2, 0.400, 80, 1, hash_ids=(1, 2, 3, 4, 5), hash_block_tokens=16)
    cluster.run([a, b, c])
    assert [r.status for r in (a, b, c)] == [Status.FINISHED] * 3
    assert a.prefill_end_s == pytest.approx(0.010)
    assert a.transfer_end_s == pytest.approx(0.110)
    assert b.first_scheduled_s == pytest.approx(0.110)
    assert c.num_cached_tokens == 64
    assert c.prefill_end_s == pytest.approx(0.400 + 0.040 + 0.010 / NUM_LAYERS)
    kv = cluster.replicas[0].state.kv
    assert isinstance(kv, HierarchicalCache)
    assert (kv.counters.num_hit_requests, kv.counters.num_hit_tokens) == (1, 64)
    kv.check()


@pytest.mark.parametrize(("replica", "message"), [
    ({"prefix_caching": False}, "set prefix_caching: true"),
    ({"parallelism": {"pipeline": 2}}, "on a pipeline is not modelled yet"),
])
def test_what_is_not_modelled_is_refused_naming_the_field(replica, message):
    scenario = _scenario({"ratio": 2}, **replica)
    with pytest.raises(InputError, match=message) as err:
        Cluster(scenario, fast_forward=True)
    assert "scheduler.hierarchical_cache" in str(err.value)


def test_on_a_prefill_server_write_back_holds_the_hand_off_until_the_result_is_taken():
    """Two SGLang prefill servers with the overlap loop and write_back (144 GPU slots, 10 ms a
    step, 16 tokens a 10 ms backup, chunks of 64), a router reading loads. A's 64 tokens stay
    in replica 0's tree after their transfer, on the GPU only. D (16 tokens) and C (112) at
    200 ms: D and C's first 48 run 200-210 ms; the next pass, planned meanwhile, must evict
    A for C's other 64 and backs A up first: 210-250 ms, behind the batch in flight. The
    engine takes D's first token at 250 ms, and only then hands D to the decode side. E's
    arrival at 230 ms has the router read the loads, the engine still blocked: before
    2026-12-02 that read took D's result early and sent its KV at 230 ms (found by the
    property test)."""
    scenario = _prefill_pool_scenario(
        {"ratio": 4, "write_policy": "write_back",
         "host_bandwidth_gb_s": BLOCK_BYTES / 0.010 / 1e9},
        scheduler={"name": "sglang", "chunked_prefill_size": 64}, prefill_replicas=2,
        router="least_outstanding")
    for fast_forward in (True, False):
        a = Request(0, 0.0, 64, 2, hash_ids=(1, 2, 3, 4), hash_block_tokens=16)
        b = Request(1, 0.001, 16, 2, hash_ids=(50,), hash_block_tokens=16)
        d = Request(2, 0.200, 16, 2, hash_ids=(60,), hash_block_tokens=16)
        c = Request(3, 0.200, 112, 2, hash_ids=tuple(range(70, 77)), hash_block_tokens=16)
        e = Request(4, 0.230, 16, 2, hash_ids=(90,), hash_block_tokens=16)
        cluster = Cluster(scenario, fast_forward=fast_forward)
        cluster.run([a, b, d, c, e])
        assert all(r.status is Status.FINISHED for r in (a, b, c, d, e))
        assert [r.prefill_replica_id for r in (a, b, d, c, e)] == [0, 1, 0, 0, 1]
        assert d.prefill_end_s == pytest.approx(0.250)
        assert d.transfer_start_s == d.prefill_end_s
        assert d.transfer_end_s == pytest.approx(0.275)
        assert c.prefill_end_s == pytest.approx(0.260)
        for r in (a, b, c, d, e):
            assert r.transfer_start_s >= r.prefill_end_s


def test_a_draft_model_beside_it_is_refused():
    """SGLang backs up a draft model's KV too, whose size servesim does not know."""
    with pytest.raises(InputError, match="speculative.algorithm") as err:
        _scenario({}, {"algorithm": "standalone", "acceptance_rate": 0.5,
                       "draft_time_ratio": 0.1})
    assert "the draft model's KV" in str(err.value)


def test_a_run_says_what_the_host_tier_did():
    scenario = parse_scenario({
        "name": "hicache", "seed": 0,
        "workload": {"format": "shared_prefix", "num_groups": 8, "num_prompts_per_group": 4,
                     "system_prompt_tokens": 1000, "question_tokens": 100,
                     "output_tokens": 20, "rate_qps": 4.0, "duration_s": 20},
        "replica": {"scheduler": {"name": "sglang", "hierarchical_cache": {"ratio": 4}},
                    "kv_cache": {"block_size": 1, "num_blocks": 4800}}}, "<test>")
    results = run_scenario(scenario)
    off = results.summary["kv_offload"]
    assert off["num_loads"] > 0 and off["hit_rate_tokens"]["cpu"] > 0
    assert off["num_stored_blocks"] > 0
    assert results.summary["replicas"][0]["kv_blocks_in_use_at_end"] == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(host_cache=True))
def test_with_a_host_tier_fast_forward_is_exact_and_nothing_is_lost(data):
    assert_tier_run_exact(data)


def test_a_retracted_request_meets_its_own_nodes_in_host_memory(monkeypatch):
    """Retracted by priority, a request whose own nodes (its outputs, past its prompt's ids)
    went to host memory and were not loaded back (one-token prompts: under the load
    threshold) computes them again: its insertion gives them their GPU copy back, split
    where it ends inside one, instead of a second node under the same key (which lost the
    first's host blocks from the count: found by the property test above)."""
    met: list[int] = []
    own_nodes = HierarchicalCache._own_nodes

    def spy(self, own, parent, num_blocks):
        if own in parent.children:
            met.append(parent.children[own].num_blocks - num_blocks)
        return own_nodes(self, own, parent, num_blocks)

    monkeypatch.setattr(HierarchicalCache, "_own_nodes", spy)
    assert_tier_run_exact({
        "seed": 0, "horizon_s": None, "record_token_times": True,
        "workload": {"format": "synthetic", "num_requests": 12,
                     "arrivals": {"process": "gamma", "qps": 3.0, "cv": 4.0},
                     "lengths": {"prompt": {"dist": "uniform", "low": 1, "high": 1},
                                 "output": {"dist": "uniform", "low": 1, "high": 53}}},
        "replica": {"scheduler": {"name": "sglang", "chunked_prefill_size": 8,
                                  "max_num_seqs": 3, "enable_priority_scheduling": True,
                                  "priority_scheduling_preemption_threshold": 0,
                                  "hierarchical_cache": {"ratio": 1.0,
                                                         "host_bandwidth_gb_s": 0.2}},
                    "latency": {"kind": "roofline", "noise": {"kind": "none"}},
                    "kv_cache": {"block_size": 1, "num_blocks": 58},
                    "prefix_caching": True}})
    assert met, met  # (positive: split; 0: given back whole; negative: a new node below)


def test_write_back_copies_at_eviction_while_the_scheduler_waits():
    """write_back, as the first test: A's 64 tokens and its first output's KV (its own node)
    are cached at 20 ms, not copied. B (128 tokens) at 70 ms needs room: its pass evicts
    A's two nodes, each copied to the host as it goes, the pass waiting for them (1 token,
    0.625 ms, then 64, 40 ms): B's batch starts at 110.625 ms. C at 300 ms finds A's 64
    tokens in host memory; loading them back evicts B's 128 (80 ms of copy, waited for
    again), so C's batch starts at 380 ms and takes max(10 ms, 40 ms + 10 ms / 32)."""
    scenario = _scenario({"ratio": 4, "write_policy": "write_back",
                          "host_bandwidth_gb_s": BLOCK_BYTES / 0.010 / 1e9},
                         kv_cache={"block_size": 1, "num_blocks": 144})
    for fast_forward in (True, False):
        cluster = Cluster(scenario, fast_forward=fast_forward)
        a = Request(0, 0.0, 64, 2, hash_ids=(1, 2, 3, 4), hash_block_tokens=16)
        b = Request(1, 0.070, 128, 1, hash_ids=tuple(range(10, 18)), hash_block_tokens=16)
        c = Request(2, 0.300, 80, 1, hash_ids=(1, 2, 3, 4, 5), hash_block_tokens=16)
        cluster.run([a, b, c])
        assert a.finish_s == pytest.approx(0.020)
        assert b.first_scheduled_s == pytest.approx(0.110625)
        assert b.finish_s == pytest.approx(0.120625)
        assert c.first_scheduled_s == pytest.approx(0.380) and c.num_cached_tokens == 64
        assert c.finish_s == pytest.approx(0.380 + 0.040 + 0.010 / NUM_LAYERS)
        replica = cluster.replicas[0]
        kv = replica.state.kv
        assert isinstance(kv, HierarchicalCache) and replica.host_copies is not None
        assert kv.counters.num_stored_blocks == 65 + 128
        assert replica.host_copies.store_busy_s == pytest.approx(0.120625)
        kv.check()


def _ranks(hicache: dict) -> Cluster:
    return Cluster(parse_scenario({
        "name": "hicache-ranks", "seed": 0,
        "workload": {"format": "synthetic", "num_requests": 1,
                     "arrivals": {"process": "poisson", "qps": 1.0},
                     "lengths": {"prompt": {"dist": "fixed", "value": 1},
                                 "output": {"dist": "fixed", "value": 1}}},
        "replica": {"model": "qwen3-30b-a3b", "parallelism": {"data": 2, "expert": 1},
                    "scheduler": {"name": "sglang", "overlap_schedule": False,
                                  "hierarchical_cache": hicache},
                    "prefix_caching": True, "kv_cache": {"block_size": 1, "num_blocks": 144},
                    "latency": {"kind": "constant", "iteration_s": 0.01}}}, "<test>"),
        fast_forward=False)


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_each_rank_has_its_own_host_tier_and_its_copies_hold_the_step(write_policy):
    """SGLang's DP attention with the hierarchical cache: each rank its own host pool and
    copies, the step a collective. The first test's requests on rank 0 (round robin: A, B,
    C) beside short ones on rank 1 (Z with A, W with B, Y with C; one-token prompts, one
    token out). Qwen3-30B-A3B's KV is 96 KiB a token: 40 ms for A's 64 tokens here.
    - C loads A's 64 tokens from rank 0's host pool: its step takes max(10 ms, 40 ms +
      10 ms / 48 layers), and Y, on rank 1 in the same step, finishes with C, not 10 ms
      after its arrival.
    - write_back: A's tokens are backed up only as B's pass evicts them, the pass waiting
      40.625 ms for the copy (65 tokens: A's prompt and the token it decoded), so the step
      starts then for both ranks: W finishes at 120.625 ms, where write-through (A backed up
      at insertion) has it at 80 ms; and C's pass, evicting
      B's 128 tokens for A's, first waits 80 ms for their backup: C and Y start at 280 ms."""
    block_bytes = 98304 * 16  # (16 tokens of Qwen3-30B-A3B's KV, one GPU)
    cluster = _ranks({"ratio": 4, "write_policy": write_policy,
                      "host_bandwidth_gb_s": block_bytes / 0.010 / 1e9})
    a = Request(0, 0.0, 64, 2, hash_ids=(1, 2, 3, 4), hash_block_tokens=16)
    z = Request(1, 0.0, 1, 1)
    b = Request(2, 0.070, 128, 1, hash_ids=tuple(range(10, 18)), hash_block_tokens=16)
    w = Request(3, 0.070, 1, 1)
    c = Request(4, 0.200, 80, 1, hash_ids=(1, 2, 3, 4, 5), hash_block_tokens=16)
    y = Request(5, 0.200, 1, 1)
    cluster.run([a, z, b, w, c, y])
    assert [r.replica_id for r in (a, z, b, w, c, y)] == [0, 1, 0, 1, 0, 1]
    assert all(r.status is Status.FINISHED for r in (a, z, b, w, c, y))
    assert c.num_cached_tokens == 64
    back = write_policy == "write_back"
    load_step_s = max(0.010, 0.040 + 0.010 / 48)
    assert c.finish_s == pytest.approx(0.200 + (0.080 if back else 0.0) + load_step_s)
    assert y.finish_s == pytest.approx(c.finish_s, abs=1e-12)
    assert w.finish_s == pytest.approx(0.070 + (0.040625 if back else 0.0) + 0.010)
    rank0, rank1 = cluster.replicas
    assert rank0.host_copies.load_busy_s == pytest.approx(0.040)
    assert rank1.host_copies.load_busy_s == 0.0
    for rank in (rank0, rank1):
        rank.state.kv.check()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(host_cache=True, data_parallel=True))
def test_on_ranks_repeated_runs_are_exact_and_nothing_is_lost(data):
    """SGLang's ranks (DP attention), each with its hierarchical cache: fast-forward (the
    ranks are stepped either way) equal to stepping, nothing lost."""
    assert_tier_run_exact(data)
