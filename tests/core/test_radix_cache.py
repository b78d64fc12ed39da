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


def fill(state: ReplicaState, request_id: int, num_tokens: int) -> None:
    """A request with no ids takes `num_tokens` blocks (evicting what it must)."""
    req = Request(request_id, 0.0, num_tokens, 1, None, 0)
    state.add(req)
    assert state.kv.try_allocate(req, num_tokens)
    state.admit(req)


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
