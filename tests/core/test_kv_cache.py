"""Paged KV accounting (`sim.core.kv_cache`): blocks allocated as a request's tokens grow, held
per request, freed whole, conserved, and refused when they are not there."""

from __future__ import annotations

import pytest

from sim.core.kv_cache import KVCacheManager
from tests.helpers import make_request


def test_blocks_are_conserved_and_freed():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request(0, prompt=9, output=1)
    assert kv.num_blocks_to_grow(req, 9) == 3
    assert kv.try_allocate(req, 9)
    assert not kv.try_allocate(make_request(1, prompt=40, output=1), 40)
    assert (kv.num_free_blocks, kv.num_held_blocks(0)) == (7, 3)
    kv.check()
    kv.free(req)
    assert kv.num_free_blocks == 10
    kv.check()
    with pytest.raises(ValueError):
        KVCacheManager(0, 16)


def test_blocks_grow_with_the_computed_tokens_per_chunk():
    """A prompt computed in chunks holds the blocks of what it has computed and of the chunk
    it is given: a chunk ending inside a block takes that block, the next fills it first."""
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request(0, prompt=10, output=3)
    assert kv.try_allocate(req, 3)  # tokens 0-2: one block
    assert kv.num_held_blocks(0) == 1
    req.num_computed_tokens = 3
    assert kv.num_blocks_to_grow(req, 1) == 0  # token 3 fills block 0
    assert kv.num_blocks_to_grow(req, 2) == 1
    assert kv.try_allocate(req, 7)  # tokens 3-9: blocks 1 and 2
    assert (kv.num_held_blocks(0), kv.num_used_blocks) == (3, 3)
    req.num_computed_tokens = 10
    assert kv.try_allocate(req, 0) and kv.num_held_blocks(0) == 3  # nothing new: nothing taken
    kv.check()


def test_a_reservation_keeps_blocks_free_and_a_refusal_takes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    first, second = make_request(0, prompt=32, output=2), make_request(1, prompt=32, output=2)
    assert kv.try_allocate(first, 32)  # 2 blocks, 2 left
    assert not kv.try_allocate(second, 32, num_reserved_blocks=1)  # would leave fewer than 1
    assert (kv.num_free_blocks, kv.num_held_blocks(1)) == (2, 0)
    assert kv.try_allocate(second, 16, num_reserved_blocks=1)
    assert kv.num_free_blocks == 1
    kv.free(first, preempted=True)
    assert (kv.num_free_blocks, kv.num_held_blocks(0)) == (3, 0)
    kv.free(first)  # freeing what holds nothing changes nothing
    assert kv.num_free_blocks == 3
    assert kv.capacity_tokens == 64
    kv.check()


def test_without_prefix_caching_nothing_is_ever_a_hit():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request(0, prompt=16, output=1)
    req.hash_ids, req.hash_block_tokens = (1, 2), 8
    assert not kv.caches_prefixes
    assert kv.prefix_hit_tokens(req) == kv.match_prefix(req) == kv.unused_prefix_tokens(req) == 0
    with kv.deferred_evictions():
        assert kv.try_allocate(req, 16)
    assert kv.num_evicted_blocks == 0
