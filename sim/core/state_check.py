"""The invariants of a `ReplicaState` (`ReplicaState.check`, run every step under
`sim.schedulers.base.checks(True)`, as the property tests run)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.core.offload_jobs import JobOffloadState
from sim.core.request import Status
from sim.core.waiting import PriorityWaiting

if TYPE_CHECKING:
    from sim.core.state import ReplicaState


def check_state(state: ReplicaState) -> None:
    """KV conserved; nobody both waiting and running; no KV held while waiting, nor for a
    request that will never come (its KV on the way, or preallocated for its prefill); the
    kept counts right; a queue by priority in its order."""
    state.kv.check()
    running_ids = {r.request_id for r in state.running}
    assert len(running_ids) == len(state.running)
    assert not running_ids.intersection(r.request_id for r in state.waiting)
    assert not any(r.status in (Status.FAILED, Status.FINISHED) for r in state.incoming.values())
    offload = state.offload
    for req in state.waiting:  # (with a CPU tier: unless its KV is being, or was, loaded;
        # 0.33.0's: a one-token prompt whose loaded token is computed again holds its block)
        assert state.kv.num_held_blocks(req.request_id) == 0 or (
            offload is not None and (req.request_id in offload.loading
                                     or req.num_computed_tokens > 0
                                     or (isinstance(offload, JobOffloadState)
                                         and req.num_tokens == 1)))
    if isinstance(offload, JobOffloadState):
        offload.check(state)
    elif offload is not None:
        offload.tier.check()
        assert offload.loaded <= set(offload.loading)
    assert state.num_waiting_tokens == sum(r.num_uncomputed_tokens for r in state.waiting)
    assert state.num_running_tokens == sum(r.num_tokens for r in state.running)
    assert state.num_running_max_blocks == sum(state.max_blocks(r) for r in state.running)
    # `_maybe_prefilling`: running requests, once each, in running order, and every one
    # with prompt tokens left among them.
    maybe = {id(r) for r in state._maybe_prefilling}
    assert [id(r) for r in state._maybe_prefilling] == [
        id(r) for r in state.running if id(r) in maybe]
    assert maybe >= {id(r) for r in state.running if not r.is_decoding and not r.is_caught_up}
    if not state.pipelined:  # every running request decodes or has prompt tokens left
        assert not any(r.is_caught_up for r in state.running)
    # A request never holds more than it needs at its largest (`reserved_blocks` counts
    # on it; a prefix cache's shared blocks are counted apart).
    # (Speculative decoding allocates for drafts and lookahead past the last token.)
    if not state.kv.caches_prefixes and not state.drafting:
        for req in state.running:
            assert state.kv.num_held_blocks(req.request_id) <= state.max_blocks(req)
    if isinstance(state.waiting, PriorityWaiting):
        keys = [state.waiting.key(r) for r in state.waiting]
        assert keys == sorted(keys)
