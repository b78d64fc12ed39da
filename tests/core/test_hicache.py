"""SGLang's hierarchical cache (`sim/core/hicache.py`): when nodes are backed up and locked,
what GPU eviction keeps in host memory, what host eviction drops, and what a request loads
back. Token-level (block and unit of 1), as SGLang's tree."""

from __future__ import annotations

from sim.core.hicache import LOAD_BACK_THRESHOLD_TOKENS, HierarchicalCache
from sim.core.state import ReplicaState
from tests.core.test_radix_cache import fill, finish, token_request


def hicache(num_blocks: int, num_host_blocks: int, write_threshold: int = 1
            ) -> tuple[ReplicaState, HierarchicalCache]:
    """A state on a token-level hierarchical cache, and that cache."""
    kv = HierarchicalCache(num_blocks, 1, num_host_blocks, write_threshold)
    return ReplicaState(kv), kv


def ack_all(kv: HierarchicalCache) -> None:
    for copy in (kv.take_writes(), kv.take_load()):
        if copy is not None:
            kv.ack(copy)
    kv.check()


PROMPT = tuple(range(100, 112))  # 12 tokens: above the load-back threshold
assert len(PROMPT) >= LOAD_BACK_THRESHOLD_TOKENS


def test_write_through_backs_a_node_up_at_insertion_locked_until_its_ack():
    state, kv = hicache(40, 40)
    finish(state, token_request(0, PROMPT))
    # Its 12 tokens cached and written at release; the copy's lock keeps them off the free list.
    assert kv.num_host_used_blocks == 12 and kv.counters.num_stored_blocks == 12
    assert kv.num_free_blocks == 28
    copy = kv.take_writes()
    assert copy is not None and copy.num_blocks == 12 and kv.take_writes() is None
    kv.ack(copy)
    assert kv.num_free_blocks == 40
    kv.check()


def test_gpu_eviction_keeps_a_backed_node_in_host_memory_and_it_loads_back():
    state, kv = hicache(20, 40)
    finish(state, token_request(0, PROMPT))
    ack_all(kv)
    filler = fill(state, 10, 20)  # every block: the prefix leaves the GPU
    assert kv.num_cached_blocks == 0 and kv.num_host_used_blocks == 12
    probe = token_request(1, (*PROMPT, 7))
    assert (kv.prefix_hit_tokens(probe), kv.host_hit_tokens(probe)) == (0, 12)
    state.finish(filler, 0.0)
    state.add(probe)
    assert kv.match_prefix(probe) == 0
    assert kv.load_back(probe) == 12
    # Its blocks are on the GPU at once, locked until the load's ack, a prefix of the request.
    assert kv.num_cached_blocks == 12 and kv.num_free_blocks == 8
    assert kv.try_allocate(probe, 1, 0, 12)
    state.admit(probe, 12)
    load = kv.take_load()
    assert load is not None and load.num_blocks == 12
    kv.ack(load)
    assert kv.num_free_blocks == 7  # the request holds the prefix and its own token
    assert kv.counters.num_hit_tokens == kv.counters.num_first_hit_tokens == 12
    kv.check()


def test_a_short_host_hit_is_computed_again_and_its_insertion_puts_it_back_on_the_gpu():
    state, kv = hicache(20, 40)
    short = PROMPT[:LOAD_BACK_THRESHOLD_TOKENS - 1]
    finish(state, token_request(0, short))
    ack_all(kv)
    state.finish(fill(state, 10, 20), 0.0)
    probe = token_request(1, (*short, 7))
    assert kv.host_hit_tokens(probe) == 9
    state.add(probe)
    assert kv.load_back(probe) == 0  # below the threshold: computed again
    assert kv.num_cached_blocks == 0
    stored = kv.counters.num_stored_blocks
    assert kv.try_allocate(probe, 10)
    state.admit(probe)
    probe.num_computed_tokens = 10
    kv.checkpoint(probe)
    # The insertion meets the host-only node: its KV is the GPU copy again, not written
    # again; only the new token's node is.
    assert kv.num_cached_blocks == 10 and kv.num_host_used_blocks == 10
    assert kv.counters.num_stored_blocks == stored + 1
    kv.check()


def test_host_eviction_drops_host_only_leaves_least_recently_used_first():
    state, kv = hicache(20, 24)
    a, b, c = (tuple(range(base, base + 12)) for base in (100, 200, 300))
    finish(state, token_request(0, a))
    ack_all(kv)
    finish(state, token_request(1, b))
    ack_all(kv)
    state.finish(fill(state, 10, 20), 0.0)  # both off the GPU, in host memory
    assert kv.num_host_used_blocks == 24
    kv.match_prefix(token_request(5, (*a, 1)))  # a used after b
    finish(state, token_request(2, c))  # its backup needs 12 host blocks: b goes
    assert kv.counters.num_evicted_blocks == 12
    assert kv.host_hit_tokens(token_request(6, (*a, 1))) == 12
    assert kv.host_hit_tokens(token_request(7, (*b, 1))) == 0
    ack_all(kv)


def test_a_node_on_the_gpu_is_no_host_eviction_candidate_so_a_backup_can_be_refused():
    state, kv = hicache(40, 12)
    finish(state, token_request(0, PROMPT))
    ack_all(kv)
    finish(state, token_request(1, tuple(range(200, 212))))
    # The first is still on the GPU: its host copy stays, the second finds no room.
    assert kv.counters.num_refused_stores == 1 and kv.num_host_used_blocks == 12
    # Not backed, it is dropped when evicted; the first leaves the GPU for host memory.
    state.finish(fill(state, 10, 40), 0.0)
    assert kv.num_cached_blocks == 0
    assert kv.host_hit_tokens(token_request(2, (*PROMPT, 1))) == 12
    assert kv.host_hit_tokens(token_request(3, (*range(200, 212), 1))) == 0
    kv.check()


def test_write_through_selective_backs_up_at_the_second_insertion():
    state, kv = hicache(40, 40, write_threshold=2)
    finish(state, token_request(0, PROMPT))
    assert kv.num_host_used_blocks == 0
    # A second request sharing it: its insertion walks the node again (a hit), which is
    # backed up; the new leaf of its own (one hit) is not.
    finish(state, token_request(1, (*PROMPT, 1, 2, 3)), hit=12)
    assert kv.num_host_used_blocks == 12
    ack_all(kv)


# -- write_back ---------------------------------------------------------------------------


def write_back(num_blocks: int, num_host_blocks: int) -> tuple[ReplicaState, HierarchicalCache]:
    """A state on a token-level hierarchical cache with the write_back policy."""
    kv = HierarchicalCache(num_blocks, 1, num_host_blocks, 0, write_back=True)
    return ReplicaState(kv), kv


def test_write_back_copies_a_node_to_the_host_only_when_it_leaves_the_gpu():
    state, kv = write_back(20, 40)
    finish(state, token_request(0, PROMPT))
    # Cached, not backed up: no copy, nothing locked, no hit counted.
    assert kv.num_host_used_blocks == 0 and kv.take_writes() is None
    assert kv.num_free_blocks == 20
    state.finish(fill(state, 10, 20), 0.0)
    # Its eviction backed it up (a copy the scheduler waits for), and it stays in host memory.
    assert kv.take_sync_writes() == [12] and kv.take_sync_writes() == []
    assert kv.num_host_used_blocks == kv.counters.num_stored_blocks == 12
    assert kv.take_writes() is None and kv.num_free_blocks == 20  # (nothing left locked)
    probe = token_request(1, (*PROMPT, 7))
    assert (kv.prefix_hit_tokens(probe), kv.host_hit_tokens(probe)) == (0, 12)
    kv.check()


def test_write_back_copies_the_evicted_node_alone_its_parent_when_it_goes_in_turn():
    state, kv = write_back(30, 40)
    finish(state, token_request(0, PROMPT))
    finish(state, token_request(1, (*PROMPT, *range(200, 212))), hit=12)
    state.finish(fill(state, 10, 30), 0.0)
    # The leaf node first, then its parent, each its own copy (write-through would have
    # backed the parent up first, with the leaf).
    assert kv.take_sync_writes() == [12, 12]
    assert kv.host_hit_tokens(token_request(2, (*PROMPT, *range(200, 212), 1))) == 24
    kv.check()


def test_write_back_frees_the_host_copies_of_prefixes_on_the_gpu_before_host_only_ones():
    state, kv = write_back(40, 24)
    a, b, c = (tuple(range(base, base + 12)) for base in (100, 200, 300))
    for rid, prompt in ((0, a), (1, b)):  # both written back, the host full
        finish(state, token_request(rid, prompt))
        state.finish(fill(state, 10 + rid, 40), 0.0)
    assert kv.take_sync_writes() == [12, 12] and kv.num_host_used_blocks == 24
    finish(state, token_request(2, c))
    # a loaded back: on the GPU and in host memory from its load's ack.
    probe = token_request(3, (*a, 7))
    state.add(probe)
    kv.match_prefix(probe)
    assert kv.load_back(probe) == 12
    assert kv.try_allocate(probe, 1, 0, 12)
    state.admit(probe, 12)
    load = kv.take_load()
    assert load is not None
    kv.ack(load)
    probe.num_computed_tokens = 13
    probe.num_output_tokens = 1
    state.finish(probe, 0.0)
    # c, least recently used, leaves the GPU: its 12 blocks take a's host copy (a stays on
    # the GPU), not b's, host-only, which is older.
    kv.evict_to_free(40 - kv.num_cached_blocks + 1)  # (one leaf node)
    assert kv.take_sync_writes() == [12]
    assert kv.counters.num_evicted_blocks == 12 and kv.num_host_used_blocks == 24
    assert kv.host_hit_tokens(token_request(4, (*b, 1))) == 12
    assert kv.host_hit_tokens(token_request(5, (*c, 1))) == 12
    assert kv.prefix_hit_tokens(token_request(6, (*a, 1))) == 12
    kv.check()


def test_write_back_drops_a_node_the_host_cannot_take():
    state, kv = write_back(40, 10)
    finish(state, token_request(0, PROMPT))
    state.finish(fill(state, 10, 40), 0.0)
    assert kv.take_sync_writes() == [] and kv.counters.num_refused_stores == 1
    assert kv.num_host_used_blocks == 0 and kv.num_cached_blocks == 0
    assert kv.host_hit_tokens(token_request(1, (*PROMPT, 1))) == 0
    kv.check()
