"""vLLM's prefix cache (`sim.core.block_cache`): shared prefixes computed once and their blocks
shared, hits on block boundaries with the last token left to compute, eviction in each vLLM
version's free-queue order, and on the Mooncake trace: real hits, the exact reuse an unbounded
cache finds, and fast-forward equal to stepping."""

from __future__ import annotations

import pandas as pd
import pytest

from sim import run_scenario
from sim.config.scenario import parse_scenario
from tests.helpers import cached_state, hashed, serve


def test_a_shared_prefix_is_computed_once_and_its_blocks_shared():
    state = cached_state()
    kv = state.kv
    first = hashed(0, prompt=100, output=5, ids=(7, 8, 9, 10))
    second = hashed(1, prompt=80, output=5, ids=(7, 8, 11))
    for req in (first, second):
        state.add(req)
    assert kv.prefix_hit_tokens(first) == 0
    assert kv.try_allocate(first, 100)
    state.admit(first)
    assert kv.num_used_blocks == 7  # ceil(100 / 16)
    # The first 64 tokens (units 7 and 8, two blocks each) are cached as soon as allocated.
    assert kv.prefix_hit_tokens(second) == 64
    assert kv.try_allocate(second, 16, 0, 64)
    state.admit(second, 64)
    assert second.num_computed_tokens == 64 and second.num_cached_tokens == 64
    # Shared, not duplicated: the second request adds only the block for its own 16 tokens.
    assert kv.num_used_blocks == 8
    assert kv.num_held_blocks(1) == 5
    kv.check()
    for req in (first, second):
        req.num_computed_tokens = req.num_prompt_tokens
        state.finish(req, 1.0)
    # Every full block is cached (vLLM's `cache_full_blocks`): the first request's 6, and the
    # second's own fifth block; nobody uses them: free, and evictable.
    assert kv.num_used_blocks == 0 and kv.num_cached_blocks == 7
    kv.check()


def test_a_hit_leaves_the_last_token_to_compute_and_follows_block_boundaries():
    state = cached_state()
    assert serve(state, hashed(0, prompt=64, output=2, ids=(1, 2))) == 0
    # Same 64 tokens again: a full hit would leave nothing to compute, so 3 blocks of 4.
    again = hashed(1, prompt=64, output=2, ids=(1, 2))
    assert serve(state, again) == 48
    # Ids of 24 tokens over 16-token blocks: a block is shared under the ids its tokens lie
    # in (block 1, tokens 16-31, under ids 5 and 6); past what the ids cover (72 tokens),
    # blocks are the request's own.
    odd = cached_state()
    serve(odd, hashed(2, prompt=100, output=2, ids=(5, 6, 7), unit=24))
    assert odd.kv.num_cached_blocks == 6  # 100 tokens: 6 full blocks, 4 under the ids
    assert odd.kv.prefix_hit_tokens(hashed(3, prompt=100, output=2, ids=(5, 6, 9), unit=24)) == 48
    assert odd.kv.prefix_hit_tokens(hashed(4, prompt=100, output=2, ids=(5, 6, 7), unit=24)) == 64


def test_lru_block_evicts_the_least_recently_freed_tail_first():
    # 8 blocks of 16; units of 32 tokens (2 blocks).
    state = cached_state(num_blocks=8)
    kv = state.kv
    serve(state, hashed(0, prompt=64, output=1, ids=(1, 2)))  # caches 1 -> 2
    serve(state, hashed(1, prompt=64, output=1, ids=(3, 4)))  # caches 3 -> 4
    assert kv.num_cached_blocks == 8 and kv.num_free_blocks == 8
    # Two blocks needed: the oldest freed unit goes, and request 0 freed its tail (2) first.
    req = hashed(2, prompt=20, output=1, ids=(9,))
    state.add(req)
    assert kv.try_allocate(req, 20)
    assert kv.num_evicted_blocks == 2
    assert kv.prefix_hit_tokens(hashed(3, prompt=90, output=1, ids=(1, 2, 5))) == 32
    assert kv.prefix_hit_tokens(hashed(4, prompt=90, output=1, ids=(3, 4, 5))) == 64
    kv.check()


def test_an_evicted_prefix_is_computed_and_cached_again():
    state = cached_state(num_blocks=8)
    kv = state.kv
    serve(state, hashed(0, prompt=65, output=1, ids=(1, 2, 3)))  # caches 1 -> 2 (4 blocks)
    filler = hashed(1, prompt=128, output=1, ids=(8, 8, 8, 8))
    serve(state, filler)  # needs all 8 blocks: evicts 2, then 1
    assert kv.num_evicted_blocks == 4
    again = hashed(2, prompt=65, output=1, ids=(1, 2, 3))
    assert kv.prefix_hit_tokens(again) == 0
    serve(state, again)
    assert kv.prefix_hit_tokens(hashed(3, prompt=100, output=1, ids=(1, 2, 4))) == 64


def mooncake(traces, **replica) -> dict:
    return {
        "name": "mooncake_cache",
        "workload": {"format": "mooncake",
                     "path": str(traces / "mooncake_fast25" / "conversation_trace.jsonl"),
                     "num_requests": 400},
        "replica": {"model": "llama-3.1-8b", "gpu": "h200",
                    "scheduler": {"name": "chunked_prefill", "token_budget": 2048},
                    "kv_cache": {"num_blocks": 100_000}, **replica},
        "cluster": {"replicas": 2, "router": {"name": "prefix_affinity"}},
    }


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["chunked_prefill", "prefill_first"])
def test_mooncake_hits_are_real_and_fast_forward_equals_stepping(traces, scheduler):
    data = mooncake(traces, prefix_caching=True,
                    scheduler={"name": scheduler} if scheduler == "prefill_first" else
                    {"name": scheduler, "token_budget": 2048})
    sc = parse_scenario(data, "mooncake.yaml")
    fast = run_scenario(sc)
    slow = run_scenario(sc, fast_forward=False)
    pd.testing.assert_frame_equal(fast.requests, slow.requests)
    pd.testing.assert_frame_equal(fast.iterations, slow.iterations)
    assert fast.summary == slow.summary
    req = fast.requests
    stats = fast.summary["prefix_cache"]
    assert 0.05 < stats["hit_rate_tokens"] < 1 and stats["num_evicted_blocks"] > 0
    assert (req["num_cached_tokens"] <= req["num_prompt_tokens"] - 1).all()
    assert (req["num_cached_tokens"] % 16 == 0).all()  # whole KV blocks (vLLM's hits)
    # The same trace without caching computes every prompt token: more prefill work.
    off = run_scenario(parse_scenario({**data, "replica": {**data["replica"],
                                                           "prefix_caching": False}}, "m.yaml"))
    assert "prefix_cache" not in off.summary and (off.requests["num_cached_tokens"] == 0).all()
    saved = off.iterations["num_prefill_tokens"].sum() - fast.iterations["num_prefill_tokens"].sum()
    recomputed = fast.requests["num_recomputed_tokens"].sum() - off.requests[
        "num_recomputed_tokens"].sum()
    assert saved == req["num_cached_tokens"].sum() - recomputed


@pytest.mark.slow
def test_an_unbounded_cache_finds_exactly_the_reuse_in_the_trace(traces):
    """One replica whose KV never runs out hits every prompt block seen before (whole 16-token
    blocks, as vLLM caches them, under the 512-token ids that cover them; at least one token
    left to compute): the share computed offline from the file."""
    path = traces / "mooncake_fast25" / "conversation_trace.jsonl"
    rows = pd.read_json(path, lines=True).head(1500)
    seen: set[tuple[int, ...]] = set()
    expected = 0
    for ids, prompt in zip(rows["hash_ids"], rows["input_length"], strict=True):
        # Block j's place: the ids up to the one holding its tokens (512 = 32 blocks).
        chains = [tuple(ids[: j // 32 + 1]) + (j,) for j in range(len(ids) * 32)]
        hit = 0
        while hit < min(len(chains), (prompt - 1) // 16) and chains[hit] in seen:
            hit += 1
        expected += hit * 16
        seen.update(chains[: prompt // 16])  # its full prompt blocks are cached
    data = mooncake(traces, prefix_caching=True, kv_cache={"num_blocks": 2_000_000})
    data["workload"]["num_requests"] = 1500
    data["cluster"] = {"replicas": 1}
    res = run_scenario(parse_scenario(data, "mooncake.yaml"))
    assert res.summary["prefix_cache"]["num_evicted_blocks"] == 0
    assert res.requests["num_cached_tokens"].sum() == expected > 0


@pytest.mark.parametrize("order", ["lru_block", "fifo_block"])
def test_vllm_free_queue_orders(order):
    """vLLM 0.33.0 (`lru_block`) reuses a freed block that holds no cached prefix before any
    cached one; 0.15.1 (`fifo_block`) takes free blocks in the order they were freed, cached or
    not. 6 blocks of 16: A caches 2 full blocks and frees them and its partial third; B (one
    block of its own, uncached: 8 tokens) frees after A; three blocks are then wanted."""
    state = cached_state(num_blocks=6, eviction=order)
    kv = state.kv
    a = hashed(0, prompt=40, output=1, ids=(1, 2, 3), unit=16)  # blocks 0, 1 full; 2 partial
    serve(state, a)
    b = hashed(1, prompt=8, output=1, ids=(9,), unit=16)
    serve(state, b)
    assert kv.num_cached_blocks == 2 and kv.num_free_blocks == 6
    # Never-used blocks come first in both: 2 of the 6 were never used.
    c = hashed(2, prompt=80, output=1, ids=(7, 7, 7, 7, 7), unit=16)
    state.add(c)
    assert kv.try_allocate(c, 64)  # 4 blocks: the 2 never used, then two freed
    # 0.33.0 takes the two freed uncached blocks (A's partial, B's): A's prefix stays whole;
    # 0.15.1 takes the first two freed: A's partial, then its block 1 (freed tail first),
    # evicting it.
    hit = kv.prefix_hit_tokens(hashed(3, prompt=60, output=1, ids=(1, 2, 3, 4), unit=16))
    assert hit == (32 if order == "lru_block" else 16)
    assert kv.num_evicted_blocks == (0 if order == "lru_block" else 1)
    kv.check()
