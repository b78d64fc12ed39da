"""vLLM 0.33.0's CPU tier for the KV cache (`sim.core.offload_jobs`, timed by
`sim.engine.offload_jobs`): its LRU by request, a flush worked out by hand, and what it still
refuses. Step for step against vLLM 0.33.0's own connector: the `offload_*` golden fixtures
under tests/golden/vllm-0.33.0 (tests/schedulers/test_golden.py)."""

from __future__ import annotations

import pytest

from sim.config.errors import InputError
from sim.core.offload_arc import ArcTier
from sim.core.offload_lru import PENDING, OfferCounts, RankedTier
from sim.core.request import Request, Status
from sim.engine.cluster import Cluster
from tests.engine.test_offload import BLOCK_BYTES, _scenario

SYNC_033 = {"name": "vllm_v1", "async_scheduling": False, "engine_version": "0.33.0"}


def test_the_tier_evicts_by_request_rank_and_never_what_a_store_offers():
    """Request 1 stores blocks 1, 2 and request 2 blocks 3, 4 (positions 16, 32; ranks by
    request, tail lowest). Request 1 finishes: its blocks get fresh ranks, tail first, so its
    head is evicted last, after the still-running request 2's. Request 3's store evicts 2's
    tail; request 4 offers block 3 (held: re-ranked, and protected) and a new one: the
    lowest-ranked block it does not offer goes, request 3's (ranked by request 3, whose rank
    was given at its first offer, before request 1 finished), then request 1's tail."""
    tier = RankedTier(4)
    assert tier.prepare_store(1, [(1, 16), (2, 32)]) == [1, 2]
    assert tier.state_of(1) == PENDING
    assert tier.prepare_store(2, [(3, 16), (4, 32)]) == [3, 4]
    # Nothing evictable while stores are pending: refused.
    assert tier.prepare_store(3, [(5, 16)]) is None
    tier.complete_store([1, 2, 3, 4])
    tier.request_finished(1)
    assert tier.prepare_store(3, [(5, 16)]) == [5]
    assert tier.state_of(4) is None and tier.state_of(3) == 0
    tier.complete_store([5])
    assert tier.prepare_store(4, [(3, 16), (6, 32)]) == [6]
    assert tier.state_of(5) is None
    assert {h for h in range(1, 7) if tier.state_of(h) is not None} == {1, 2, 3, 6}
    tier.complete_store([6])
    assert tier.prepare_store(5, [(7, 16)]) == [7]
    assert tier.state_of(2) is None  # request 1's tail, then its head
    tier.check()


def test_a_load_pins_its_blocks_until_it_is_done():
    tier = RankedTier(2)
    tier.prepare_store(1, [(1, 16), (2, 32)])
    tier.complete_store([1, 2])
    tier.prepare_load(2, [(1, 16)])
    assert tier.state_of(1) == 1
    assert tier.prepare_store(3, [(7, 16), (8, 32)]) is None  # block 1 is read
    tier.complete_load([1])
    assert tier.prepare_store(3, [(7, 16), (8, 32)]) == [7, 8]
    tier.check()


def test_arc_keeps_reused_blocks_over_blocks_stored_once():
    """A 4-block tier under ARC. Request 1 stores block 1 (into T1); request 2 loads it and
    finishes: 1 moves to T2. Request 3 stores 3, 4 and finishes (a finished request's blocks
    go to the recent end tail first: T1 = [4, 3]). Request 4 stores 5, 6, one block short:
    T1 holds at least its target (0), so T1's least recent block goes (4, into B1) and the
    reused block 1 stays, where LRU by request evicts 1, the least recently used. Request 5
    offers 4 again (a miss found in B1): T1's target grows by max(1, |B2| / |B1|) = 1 before
    its store evicts T1's least recent block, 3."""
    def run(tier):
        tier.prepare_store(1, [(1, 16)])
        tier.complete_store([1])
        tier.request_finished(1)
        tier.prepare_load(2, [(1, 16)])
        tier.complete_load([1])
        tier.request_finished(2)
        tier.prepare_store(3, [(3, 16), (4, 32)])
        tier.complete_store([3, 4])
        tier.request_finished(3)
        assert tier.prepare_store(4, [(5, 16), (6, 32)]) == [5, 6]
        tier.complete_store([5, 6])
        tier.request_finished(4)
        return tier

    tier = run(ArcTier(4))
    assert tier.state_of(4) is None and tier.state_of(1) == 0
    assert list(tier._t1) == [3, 6, 5] and list(tier._t2) == [1] and list(tier._b1) == [4]
    assert tier.prepare_store(5, [(4, 16)]) == [4]
    assert tier.target_t1_size == 1.0
    assert tier.state_of(3) is None and list(tier._b1) == [3]  # (4 left B1 when stored)
    assert list(tier._t1) == [6, 5, 4] and tier.counters.num_evicted_blocks == 2
    tier.check()

    lru = run(RankedTier(4))
    assert lru.state_of(1) is None and lru.state_of(4) == 0
    lru.check()


def test_arc_evicts_from_t2_below_its_target_and_nothing_when_short():
    """With T1 below its target ARC evicts from T2; a store that cannot find room in
    either list evicts nothing (and keeps what a load reads and what the store offers)."""
    tier = ArcTier(2)
    tier.prepare_store(1, [(1, 16), (2, 32)])
    tier.complete_store([1, 2])
    tier.prepare_load(2, [(1, 16), (2, 32)])
    tier.complete_load([1, 2])
    tier.request_finished(2)  # both reused: T2 = [2, 1] (tail first, head most recent)
    assert list(tier._t2) == [2, 1]
    tier.target_t1_size = 1.0  # (as a ghost hit in B1 would set it)
    assert tier.prepare_store(3, [(3, 16)]) == [3]
    assert tier.state_of(2) is None and list(tier._b2) == [2]
    tier.prepare_load(4, [(1, 16)])  # 1 is read, 3 still being stored
    assert tier.prepare_store(5, [(4, 16)]) is None
    assert tier.state_of(1) == 1 and tier.state_of(3) == PENDING
    tier.check()


@pytest.mark.parametrize(("setting", "words"), [({"eviction_policy": "arc"}, "KeyError"),
                                                ({"store_threshold": 2}, "every block")])
def test_what_vllm_0151s_tier_lacks_is_refused_naming_why(setting, words):
    with pytest.raises(InputError, match=words) as err:
        Cluster(_scenario(kv_offload={"size_gib": 1.0, **setting},
                          scheduler={**SYNC_033, "engine_version": "0.15.1"}))
    assert err.value.field == f"replica.kv_offload.{next(iter(setting))}"


def test_a_store_threshold_stores_a_block_from_its_nth_offer():
    """`store_threshold` 2: request 1 offers blocks 1, 2 (once each: nothing stored);
    request 2 offers 1, 3: 1 is stored, 3 is not. With room for 3 blocks tracked, request 3
    offering 4, 5 forgets the least recently offered, 2 then 1; an offer never forgets a
    block it counts again, so with every tracked block in it a new one goes untracked."""
    offers = OfferCounts(2, max_tracked=3)
    tier = RankedTier(4, offers)
    assert tier.prepare_store(1, [(1, 16), (2, 32)]) == []
    assert tier.prepare_store(2, [(1, 16), (3, 32)]) == [1]
    assert tier.counters.num_skipped_stores == 3
    assert list(offers._counts.items()) == [(2, 1), (1, 2), (3, 1)]
    assert tier.prepare_store(3, [(4, 16), (5, 32)]) == []
    assert list(offers._counts.items()) == [(3, 1), (4, 1), (5, 1)]
    offers.offered([3, 4, 5, 6])
    assert list(offers._counts.items()) == [(3, 2), (4, 2), (5, 2)]
    arc = ArcTier(4, OfferCounts(2))
    assert arc.prepare_store(1, [(1, 16)]) == [] and arc.prepare_store(2, [(1, 16)]) == [1]


def test_a_block_a_pending_store_reads_flushes_it_when_handed_out_again():
    """A's 64-token prompt (4 blocks) runs 0-10 ms and A finishes (one token). 0.33.0 frees
    its blocks at once (cached), its store of them (10 ms a block over the host link) is
    submitted at the next launch, 10 ms, after the step: 10-50 ms. B (128 tokens, 8 blocks,
    all the GPU's) arrives at 20 ms and takes A's freed blocks: the plan flushes A's store,
    and the worker waits for it before the step, launched at 50 ms (vLLM's
    `jobs_to_flush`, `handle_preemptions`), not 20."""
    scenario = _scenario(kv_cache={"block_size": 16, "num_blocks": 9},
                         kv_offload={"size_gib": 64 * BLOCK_BYTES / 2**30,
                                     "host_bandwidth_gb_s": BLOCK_BYTES / 10e-3 / 1e9},
                         scheduler=SYNC_033)
    cluster = Cluster(scenario, fast_forward=False)
    a = Request(0, 0.0, 64, 1, hash_ids=(1, 2, 3, 4), hash_block_tokens=16)
    b = Request(1, 0.020, 128, 1, hash_ids=tuple(range(10, 18)), hash_block_tokens=16)
    cluster.run([a, b])
    assert [r.status for r in (a, b)] == [Status.FINISHED] * 2
    assert a.finish_s == pytest.approx(0.010)
    assert b.first_scheduled_s == pytest.approx(0.050)
    assert b.finish_s == pytest.approx(0.060)
    counters = cluster.replicas[0].state.offload.tier.counters
    assert counters.num_stored_blocks == 4 + 8


def test_a_prefix_evicted_from_the_gpu_is_loaded_back():
    """As 0.15.1's worked case, on 0.33.0: A's prompt blocks are stored (0.33.0 stores
    prompt blocks only), B evicts them from the GPU, C (A's prompt and 16 more tokens) loads
    them. 0.33.0 starts a step's loads once the step is computed; an empty step's at once.
    A: 0-10 ms prompt (store 10-14 ms), 10-20 ms its last token. B at 30 ms: 30-40 ms, its
    store 40-48 ms. C at 50 ms: nothing on the GPU, 4 blocks on the CPU: an empty step
    launches its load, 50-54 ms; the engine steps on, empty, until the 54 ms poll finds it
    done; 54-64 ms its last 16 tokens."""
    scenario = _scenario(kv_cache={"block_size": 16, "num_blocks": 9},
                         kv_offload={"size_gib": 16 * BLOCK_BYTES / 2**30,
                                     "host_bandwidth_gb_s": BLOCK_BYTES / 1e-3 / 1e9},
                         scheduler=SYNC_033)
    cluster = Cluster(scenario, fast_forward=False)
    a = Request(0, 0.0, 64, 2, hash_ids=(1, 2, 3, 4), hash_block_tokens=16)
    b = Request(1, 0.030, 128, 1, hash_ids=tuple(range(10, 18)), hash_block_tokens=16)
    c = Request(2, 0.050, 80, 1, hash_ids=(1, 2, 3, 4, 5), hash_block_tokens=16)
    cluster.run([a, b, c])
    assert [r.status for r in (a, b, c)] == [Status.FINISHED] * 3
    assert c.first_scheduled_s == pytest.approx(0.054)
    assert c.finish_s == pytest.approx(0.064)
    assert c.num_cached_tokens == 64
    counters = cluster.replicas[0].state.offload.tier.counters
    assert (counters.num_hit_requests, counters.num_hit_tokens) == (1, 64)
    # A's 4 prompt blocks, B's 8, C's own fifth; none of A's decode blocks (prompt only).
    assert counters.num_stored_blocks == 4 + 8 + 1


def test_an_eagle_drafter_s_hit_from_the_tier_drops_its_last_block():
    """An EAGLE-family drafter's KV group (`is_eagle_group`): the connector pops the last
    block of a hit (its draft KV depends on the token after it), so a request whose three
    prompt blocks are all in the tier loads two; without a drafter, three."""
    from sim.core.block_cache import BlockPrefixCache
    from sim.core.offload_jobs import JobOffloadState

    for drops, loads in ((False, 48), (True, 32)):
        kv = BlockPrefixCache(8, 16)
        offload = JobOffloadState(RankedTier(8), kv, drops_last_hit_block=drops)
        req = Request(0, 0.0, 49, 4, hash_ids=(1, 2, 3), hash_block_tokens=16)
        hashes = kv.chain_hashes(req, 3)[:3]
        offload.tier.prepare_store(9, [(h, 16 * (i + 1)) for i, h in enumerate(hashes)])
        assert offload.lookup(req, 0) is None  # (being stored: wait)
        offload.tier.complete_store(hashes)
        assert offload.lookup(req, 0) == loads


def test_with_steps_in_flight_a_freed_request_s_blocks_wait_for_its_last_step():
    """Async scheduling (`defer_block_free`): a request scheduled in the step in flight gives
    up its blocks, which go back to the pool only when that step's output is processed; one
    not in it frees at once (`_free_request_blocks`)."""
    from sim.core.block_cache import BlockPrefixCache
    from sim.core.offload_jobs import JobOffloadState
    from sim.core.plan import Plan

    kv = BlockPrefixCache(8, 16)
    offload = JobOffloadState(RankedTier(4), kv, defers_frees=True)
    a, b = Request(0, 0.0, 32, 4), Request(1, 0.0, 16, 4)
    assert kv.try_allocate(a, 32) and kv.try_allocate(b, 16)

    class _State:  # (what `build` reads of a replica's state)
        requests = {0: a, 1: b}
        running = [a, b]

        @staticmethod
        def prefilling():
            return []

    _State.kv = kv
    offload.build(_State, Plan({0: 32}), 1)  # a scheduled in step 1; b not
    assert not offload.frees_now(a) and offload.frees_now(b)
    offload.free_blocks(b)
    assert kv.num_free_blocks == 8 - 2
    offload.free_blocks(a)
    assert kv.num_free_blocks == 8 - 2 and kv.num_held_blocks(0) == 0
    kv.check()
    offload.step_processed()  # step 1's output
    assert kv.num_free_blocks == 8
    kv.check()


def test_a_one_token_prompt_whose_block_the_tier_holds_loops_as_vllm_does():
    """Blocks of one token: B (token A alone) finds A in the tier, loads it, has nothing
    computed after (its one token is computed again), and 0.33.0 takes it for new: asked
    again, it "loads" its own block (a job of no block), and so on, for ever while the tier
    keeps A and nothing else runs or arrives (vLLM 0.33.0 loops there: checked with its own
    scheduler). A (tokens A B) finishes; B stays unfinished saying why."""
    block_bytes = 131072  # (a one-token block of the default model)
    scenario = _scenario(kv_cache={"block_size": 1, "num_blocks": 64},
                         kv_offload={"size_gib": 3 * block_bytes / 2**30,
                                     "host_bandwidth_gb_s": 0.1},
                         scheduler={**SYNC_033, "max_num_seqs": 4,
                                    "max_num_batched_tokens": 256})
    for fast_forward in (True, False):
        cluster = Cluster(scenario, fast_forward=fast_forward)
        a = Request(0, 0.0, 2, 5, hash_ids=(1, 2), hash_block_tokens=1)
        b = Request(1, 0.03, 1, 2, hash_ids=(1,), hash_block_tokens=1)
        cluster.run([a, b])
        assert a.status is Status.FINISHED
        assert b.status is not Status.FINISHED
        assert b.reason.startswith("engine_stalled: one-token prompts")
