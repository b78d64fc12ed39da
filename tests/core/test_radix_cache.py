"""SGLang's radix cache (`sim/core/radix_cache.py`): what counts as a use, when a request's tokens
are inserted, and when a batch evicts. Token-level, as SGLang's tree (block and unit of 1)."""

from __future__ import annotations

from sim.core.radix_cache import PrefixCachingKVManager
from sim.core.request import Request
from sim.core.state import ReplicaState
from tests.helpers import cached_state, hashed, serve


def token_request(request_id: int, ids: tuple[int, ...], output: int = 1) -> Request:
    """A request whose prompt is `ids`, one token each."""
    return Request(request_id, 0.0, len(ids), output, ids, 1)


def finish(state: ReplicaState, req: Request, *, hit: int = 0) -> None:
    """Run `req` through its prompt and every output, then let it go (inserted at release)."""
    kv = state.kv
    state.add(req)
    assert kv.try_allocate(req, req.num_prompt_tokens - hit, 0, hit)
    state.admit(req, hit)
    req.num_computed_tokens = req.num_prompt_tokens + req.num_target_output_tokens - 1
    req.num_output_tokens = req.num_target_output_tokens
    assert kv.try_allocate(req, 0)
    state.finish(req, 0.0)
    kv.check()


def fill(state: ReplicaState, request_id: int, num_tokens: int) -> Request:
    """A request with no ids takes `num_tokens` blocks (evicting what it must); returned."""
    req = Request(request_id, 0.0, num_tokens, 1, None, 0)
    state.add(req)
    assert state.kv.try_allocate(req, num_tokens)
    state.admit(req)
    return req


def test_a_schedulers_match_is_a_use_a_routers_lookup_is_not():
    state = ReplicaState(PrefixCachingKVManager(20, 1))
    kv = state.kv
    finish(state, token_request(0, (1, 2, 3, 4)))  # older
    finish(state, token_request(1, (5, 6, 7, 8)))
    assert kv.num_free_blocks == 20 and kv.num_cached_blocks == 8
    probe_old, probe_new = token_request(2, (1, 2, 3, 4, 9)), token_request(3, (5, 6, 7, 8, 9))
    assert kv.prefix_hit_tokens(probe_old) == 4  # a lookup: the order stays
    fill(state, 10, 14)  # 12 uncached free: evicts the least recently used prefix
    assert (kv.prefix_hit_tokens(probe_old), kv.prefix_hit_tokens(probe_new)) == (0, 4)

    state = ReplicaState(PrefixCachingKVManager(20, 1))
    kv = state.kv
    finish(state, token_request(0, (1, 2, 3, 4)))
    finish(state, token_request(1, (5, 6, 7, 8)))
    assert kv.match_prefix(probe_old) == 4  # the scheduler tries it: now the newest
    fill(state, 10, 14)
    assert (kv.prefix_hit_tokens(probe_old), kv.prefix_hit_tokens(probe_new)) == (4, 0)
    kv.check()


def test_a_match_ending_inside_a_node_splits_it_and_touches_all_of_it():
    state = ReplicaState(PrefixCachingKVManager(20, 1))
    kv = state.kv
    finish(state, token_request(0, (1, 2, 3, 4)))  # one node, 1..4, older
    finish(state, token_request(1, (5, 6, 7, 8)))
    assert kv.match_prefix(token_request(2, (1, 2, 9))) == 2  # ends inside 1..4: split
    fill(state, 10, 14)  # the newest is 1..4 as a whole (SGLang's split keeps its time below)
    assert kv.prefix_hit_tokens(token_request(3, (1, 2, 3, 4, 9))) == 4
    assert kv.prefix_hit_tokens(token_request(4, (5, 6, 7, 8, 9))) == 0
    fill(state, 11, 3)  # then 3..4 is a leaf node of its own: 1..2 stays
    assert kv.prefix_hit_tokens(token_request(3, (1, 2, 3, 4, 9))) == 2
    kv.check()


def test_a_finished_requests_output_stays_cached_as_a_leaf_of_its_own():
    """`release_kv_cache(checkpoint=True)` inserts prompt and output, split at the prompt's end;
    a retracted request's release inserts nothing."""
    state = ReplicaState(PrefixCachingKVManager(20, 1))
    kv = state.kv
    finish(state, token_request(0, (1, 2, 3, 4), output=4))  # KV of 4 + 3 tokens
    assert kv.num_cached_blocks == 7 and kv.num_free_blocks == 20
    fill(state, 10, 16)  # 13 uncached: the output's 3 blocks go (a leaf), the prompt stays
    assert kv.num_evicted_blocks == 3
    assert kv.prefix_hit_tokens(token_request(1, (1, 2, 3, 4, 9))) == 4
    kv.check()

    state = ReplicaState(PrefixCachingKVManager(20, 1))
    kv = state.kv
    req = token_request(0, (1, 2, 3, 4), output=4)
    state.add(req)
    assert kv.try_allocate(req, 4)
    state.admit(req)
    req.num_computed_tokens = 4
    kv.checkpoint(req)  # its prefill ended: the prompt is inserted
    req.num_output_tokens, req.num_computed_tokens = 3, 6
    assert kv.try_allocate(req, 0)
    state.preempt(req)
    assert kv.num_cached_blocks == 4 and kv.num_free_blocks == 20
    kv.check()


def test_a_batch_evicts_once_after_every_request_in_it_was_matched():
    """Within `deferred_evictions`, an allocation short of uncached blocks evicts nothing yet:
    a later request of the same batch can still take (and pin) a prefix it would have evicted."""
    state = ReplicaState(PrefixCachingKVManager(20, 1))
    kv = state.kv
    finish(state, token_request(0, (1, 2, 3, 4)))  # the oldest: evicted first
    finish(state, token_request(1, (5, 6, 7, 8)))
    later = token_request(3, (1, 2, 3, 4, 9))
    with kv.deferred_evictions():
        fill(state, 10, 13)  # 12 uncached: owes 1 block of the cached ones
        assert kv.num_evicted_blocks == 0
        state.add(later)
        hit = kv.match_prefix(later)
        assert hit == 4 and kv.try_allocate(later, 1, 0, hit)  # pins 1..4
        state.admit(later, hit)
    assert kv.num_evicted_blocks == 4  # 5..8, whole, at the end of the pass
    assert kv.prefix_hit_tokens(token_request(4, (5, 6, 7, 8, 9))) == 0
    kv.check()


def test_lru_leaf_evicts_whole_leaf_nodes_least_recently_used_first():
    """SGLang's radix tree evicts a leaf node whole: what one insertion added, up to where
    paths diverge or another insertion or a match ended."""
    state = cached_state(num_blocks=8, eviction="lru_leaf")
    kv = state.kv
    serve(state, hashed(0, prompt=97, output=1, ids=(1, 2, 3, 4)))  # 1 -> 2 -> 3 (6 blocks)
    serve(state, hashed(1, prompt=33, output=1, ids=(5, 6)))  # 5 (2 blocks), used later
    req = hashed(2, prompt=40, output=1, ids=(7, 7))
    state.add(req)
    assert kv.try_allocate(req, 40)  # 3 blocks: the oldest leaf node, 1 -> 2 -> 3, whole
    assert kv.num_evicted_blocks == 6
    assert kv.prefix_hit_tokens(hashed(3, prompt=200, output=1, ids=(1, 2, 3, 4))) == 0
    assert kv.prefix_hit_tokens(hashed(4, prompt=200, output=1, ids=(5, 6))) == 32
    kv.check()
    # A path that diverges splits the node: evicting the new leaf leaves the shared part.
    state = cached_state(num_blocks=8, eviction="lru_leaf")
    kv = state.kv
    serve(state, hashed(5, prompt=65, output=1, ids=(1, 2, 3)))  # 1 -> 2 (4 blocks)
    serve(state, hashed(6, prompt=65, output=1, ids=(1, 8, 3)))  # hits 1; adds 8 (2 blocks)
    req = hashed(7, prompt=48, output=1, ids=(9,))
    state.add(req)
    assert kv.try_allocate(req, 48)  # 3 blocks, 2 uncached: leaf 2 (older), not unit 1 too
    assert kv.num_evicted_blocks == 2
    assert kv.prefix_hit_tokens(hashed(8, prompt=200, output=1, ids=(1, 8))) == 64
    kv.check()


def test_eagles_token_pair_keys_hold_one_token_less():
    """EAGLE keys the tree by token pairs: a prompt of n tokens caches the KV of n - 1, a match
    of n shared tokens reuses n - 1, and a request sharing only the first token matches
    nothing (it touches nothing: the older prefix is still evicted first)."""
    state = ReplicaState(PrefixCachingKVManager(20, 1))
    kv = state.kv
    kv.bigram_keys = True
    finish(state, token_request(0, (1, 2, 3, 4)))  # 4 + 1 - 1 = 4 tokens owned: 3 pairs
    finish(state, token_request(1, (5, 6, 7, 8)))
    assert kv.num_cached_blocks == 6
    assert kv.prefix_hit_tokens(token_request(2, (1, 2, 3, 4, 9))) == 3
    assert kv.prefix_hit_tokens(token_request(2, (1, 2, 9))) == 1
    assert kv.prefix_hit_tokens(token_request(2, (1, 2, 3, 4))) == 2  # the last one computed
    assert kv.match_prefix(token_request(2, (1, 9, 9, 9))) == 0
    fill(state, 10, 17)  # 14 uncached free: one prefix goes, the older
    assert kv.prefix_hit_tokens(token_request(3, (1, 2, 3, 4, 9))) == 0
    assert kv.prefix_hit_tokens(token_request(3, (5, 6, 7, 8, 9))) == 3
    kv.check()


def test_token_pair_keys_with_units_of_many_tokens():
    """Units of 4 tokens (a trace's hash ids): the first unit holds 3 tokens' KV, the next
    ones 4 each; a finished request's rest (its output) is a node of its own."""
    state = ReplicaState(PrefixCachingKVManager(40, 1))
    kv = state.kv
    kv.bigram_keys = True
    finish(state, Request(0, 0.0, 10, 3, (1, 2, 3), 4))  # owns 12 tokens: 11 pairs
    assert kv.num_cached_blocks == 11
    assert kv.prefix_hit_tokens(Request(1, 0.0, 12, 1, (1, 2, 4), 4)) == 7
    assert kv.prefix_hit_tokens(Request(1, 0.0, 8, 1, (1, 2), 4)) == 3  # 7 of the 8 at most
    kv.check()


def test_a_finished_request_caches_what_sglang_counts_as_its_own():
    """Its committed KV: not a verification in flight; one token more where its last
    verification accepted past its last token (`owned_kv_len`)."""
    for in_flight, overshoot, cached in ((0, 0, 12), (0, 2, 13), (4, 0, 12), (4, 2, 13)):
        state = ReplicaState(PrefixCachingKVManager(40, 1))
        req = token_request(0, tuple(range(1, 9)), output=5)
        state.add(req)
        assert state.kv.try_allocate(req, 8)
        state.admit(req)
        req.num_computed_tokens = 8 + 5 - 1 + in_flight
        req.num_in_flight_tokens = in_flight
        req.num_output_tokens = 5
        req.num_overshoot_tokens = overshoot
        assert state.kv.try_allocate(req, 0)
        state.kv.free(req)
        assert state.kv.num_cached_blocks == cached, (in_flight, overshoot)
        state.kv.check()


def test_evict_to_free_evicts_least_recently_used_leaves_until_enough_hold_nothing():
    state = ReplicaState(PrefixCachingKVManager(20, 1))
    kv = state.kv
    finish(state, token_request(0, (1, 2, 3, 4)))  # older
    finish(state, token_request(1, (5, 6, 7, 8)))
    kv.evict_to_free(12)  # 12 hold nothing already
    assert (kv.num_cached_blocks, kv.num_free_blocks) == (8, 20)
    kv.evict_to_free(13)  # one leaf, whole: the older
    assert (kv.num_cached_blocks, kv.num_free_blocks) == (4, 20)
    assert kv.prefix_hit_tokens(token_request(2, (5, 6, 7, 8, 9))) == 4
    kv.evict_to_free(100)  # all it can
    assert (kv.num_cached_blocks, kv.num_evicted_blocks) == (0, 8)
    kv.check()


def test_a_retracted_request_finds_the_outputs_it_computed_again_cached():
    """Retracted after 3 outputs, a request computes its prompt (4 tokens, its ids) and the 3
    outputs again; that extend caches all 7 (SGLang's `checkpoint_kv_cache` up to
    `extend_end`), the outputs as a node of its own under its prompt, which only it matches:
    retracted once more, it reuses 7 of its 8 tokens. Another request with the same prompt
    reuses only the prompt; a request without ids its own tokens the same way."""
    for ids in ((1, 2, 3, 4), None):
        state = ReplicaState(PrefixCachingKVManager(40, 1))
        kv = state.kv
        req = Request(0, 0.0, 4, 10, ids, 1 if ids else 0)
        state.add(req)
        req.num_output_tokens = 3  # (its outputs before it was retracted)
        assert kv.match_prefix(req) == 0
        assert kv.try_allocate(req, 7)
        state.admit(req)
        req.num_computed_tokens = 7
        kv.checkpoint(req)
        assert kv.num_cached_blocks == 7
        req.num_output_tokens = 4
        state.preempt(req)
        assert kv.prefix_hit_tokens(req) == 7
        if ids:
            assert kv.prefix_hit_tokens(Request(2, 0.0, 6, 1, (1, 2, 3, 4, 5, 6), 1)) == 4
        kv.check()
