"""SGLang's hierarchical cache (`sim/core/hicache.py`): when nodes are backed up and locked,
what GPU eviction keeps in host memory, what host eviction drops, and what a request loads
back. Token-level (block and unit of 1), as SGLang's tree."""

from __future__ import annotations

from sim.core.hicache import LOAD_BACK_THRESHOLD_TOKENS, HierarchicalCache
from sim.core.request import Request
from sim.core.state import ReplicaState


def token_request(request_id: int, ids: tuple[int, ...], output: int = 1) -> Request:
    return Request(request_id, 0.0, len(ids), output, ids, 1)


def finish(state: ReplicaState, req: Request, *, hit: int = 0) -> None:
    """Run `req` through its prompt and outputs and let it go (inserted at release)."""
    kv = state.kv
    state.add(req)
    assert kv.try_allocate(req, req.num_prompt_tokens - hit, 0, hit)
    state.admit(req, hit)
    req.num_computed_tokens = req.num_prompt_tokens + req.num_target_output_tokens - 1
    req.num_output_tokens = req.num_target_output_tokens
    assert kv.try_allocate(req, 0)
    state.finish(req, 0.0)
    kv.check()


def ack_all(kv: HierarchicalCache) -> None:
    for copy in (kv.take_writes(), kv.take_load()):
        if copy is not None:
            kv.ack(copy)
    kv.check()


def fill(state: ReplicaState, request_id: int, num_tokens: int) -> Request:
    """A request with no ids takes `num_tokens` blocks (evicting what it must)."""
    req = Request(request_id, 0.0, num_tokens, 1, None, 0)
    state.add(req)
    assert state.kv.try_allocate(req, num_tokens)
    state.admit(req)
    return req


PROMPT = tuple(range(100, 112))  # 12 tokens: above the load-back threshold
assert len(PROMPT) >= LOAD_BACK_THRESHOLD_TOKENS


def test_write_through_backs_a_node_up_at_insertion_locked_until_its_ack():
    state = ReplicaState(HierarchicalCache(40, 1, 40))
    kv = state.kv
    assert isinstance(kv, HierarchicalCache)
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
    state = ReplicaState(HierarchicalCache(20, 1, 40))
    kv = state.kv
    assert isinstance(kv, HierarchicalCache)
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
    state = ReplicaState(HierarchicalCache(20, 1, 40))
    kv = state.kv
    assert isinstance(kv, HierarchicalCache)
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
    state = ReplicaState(HierarchicalCache(20, 1, 24))
    kv = state.kv
    assert isinstance(kv, HierarchicalCache)
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
    state = ReplicaState(HierarchicalCache(40, 1, 12))
    kv = state.kv
    assert isinstance(kv, HierarchicalCache)
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
    state = ReplicaState(HierarchicalCache(40, 1, 40, write_threshold=2))
    kv = state.kv
    assert isinstance(kv, HierarchicalCache)
    finish(state, token_request(0, PROMPT))
    assert kv.num_host_used_blocks == 0
    # A second request sharing it: its insertion walks the node again (a hit), which is
    # backed up; the new leaf of its own (one hit) is not.
    finish(state, token_request(1, (*PROMPT, 1, 2, 3)), hit=12)
    assert kv.num_host_used_blocks == 12
    ack_all(kv)
