"""Admission: the loop every policy runs over its waiting queue (`admit_waiting`), one
request's admission (`try_admit`), and the KV blocks running requests may still need for their
future tokens (`reserved_blocks`), which a policy that reserves them keeps free."""

from __future__ import annotations

from collections.abc import Callable

from sim.core.block_cache import BlockPrefixCache
from sim.core.kv_cache import cdiv
from sim.core.offload import OffloadState
from sim.core.offload_jobs import JobOffloadState
from sim.core.plan import Plan
from sim.core.request import Request
from sim.core.state import ReplicaState
from sim.core.waiting import PriorityWaiting, priority_key


def future_blocks(state: ReplicaState, req: Request, reserve_tokens: int | None) -> int:
    """Blocks `req` may still add here for its future tokens (at most `reserve_tokens` more)."""
    kv = state.kv
    future = state.num_kv_tokens_needed(req)
    if reserve_tokens is not None:
        future = min(future, req.num_computed_tokens + reserve_tokens)
    return max(0, cdiv(future, kv.block_size) - kv.num_held_blocks(req.request_id))


def reserved_blocks(state: ReplicaState, reserve_tokens: int | None) -> int:
    """Blocks running requests may still need for their future tokens (capped per request):
    `future_blocks` summed (a policy asks whenever requests wait: under overload, every
    iteration), from kept counts where it can be."""
    if reserve_tokens == 0:  # no future token reserved: every request holds what it computed
        return 0
    kv = state.kv
    if (reserve_tokens is None and not kv.caches_prefixes and not state.incoming
            and not state.num_transferring and not state.drafting):
        # Every block in use is then a running request's, and none holds more than it needs
        # at its largest (`ReplicaState.check`; speculative decoding's drafts and lookahead
        # may, a prefill replica's drafter's too): `summed_reserved_blocks` from two kept
        # counts.
        return state.num_running_max_blocks - kv.num_used_blocks
    return summed_reserved_blocks(state, reserve_tokens)


def summed_reserved_blocks(state: ReplicaState, reserve_tokens: int | None) -> int:
    """`reserved_blocks`, request by request (`future_blocks` written out: one loop)."""
    kv = state.kv
    block_size = kv.block_size
    held = kv.num_held_blocks
    prefill_only = state.prefill_only
    total = 0
    for req in state.running:
        future = req.num_prompt_tokens  # `state.num_kv_tokens_needed(req)`, written out
        if not prefill_only:
            future += req.num_target_output_tokens - 1
        if reserve_tokens is not None and req.num_computed_tokens + reserve_tokens < future:
            future = req.num_computed_tokens + reserve_tokens
        blocks = -(-future // block_size) - held(req.request_id)
        if blocks > 0:
            total += blocks
    return total


def admit_waiting(state: ReplicaState, plan: Plan, budget: int | None, max_num_seqs: int,
                  reserve_tokens: int | None, chunk: Callable[[Request, int, int | None], int],
                  extra_blocks: Callable[[Request, int, int], int] | None = None,
                  lookahead: Callable[[Request, int, int], int] | None = None,
                  num_hit_blocks_dropped: int = 0) -> int | None:
    """Admit the head of the waiting queue, request after request, while one fits: the one
    admission loop every policy runs. `chunk(req, num_new, budget)` is the policy's rule: how
    many of the `num_new` tokens the head has to compute (beyond a prefix-cache hit) it gets
    now, 0 to stop admitting (a policy counting what it admitted may count there: the loop ends
    at the first request refused). `extra_blocks(req, num_cached, num_tokens)`: blocks the head
    needs free beside its chunk and reserves (vLLM's `scheduler_reserve_full_isl`);
    `lookahead(req, num_cached, num_tokens)`: KV slots allocated past the chunk (vLLM's
    speculative lookahead); `num_hit_blocks_dropped`: blocks a prefix hit gives up at its end
    (0.15.1's EAGLE drafter recomputes the last). The running
    limit counts the requests whose KV is on its way (`state.incoming`, which hold their slots
    already). Returns the budget left (None: unbounded)."""
    kv, scheduled = state.kv, plan.num_scheduled_tokens
    # Summed over the running requests only when one may be admitted (under overload the batch
    # is mostly full): nothing changes it before the first admission.
    reserved: int | None = None
    offload = state.offload
    if isinstance(offload, JobOffloadState) and offload.drops_last_hit_block:
        # (0.33.0 keeps the legacy block hashes beside a KV connector: an EAGLE-family
        # drafter's GPU hit gives up its last block too, as 0.15.1's does.)
        num_hit_blocks_dropped = 1
    holding: set[Request] = set()
    if isinstance(offload, JobOffloadState) and offload.holding:
        # vLLM 0.33.0 passes the requests holding KV loaded from the CPU tier first, in their
        # own queue (`kv_holding_waiting`, by priority under that policy); one that is
        # refused ends the pass.
        holders = (sorted(offload.holding, key=priority_key)
                   if isinstance(state.waiting, PriorityWaiting) else list(offload.holding))
        requeued: list[Request] = []  # left the holding queue for the waiting one's front
        stop = False
        for req in holders:
            if not ((budget is None or budget > 0)
                    and len(state.running) + len(state.incoming) < max_num_seqs):
                stop = True
                break
            rid = req.request_id
            if rid in offload.loading:
                if rid not in offload.loaded:
                    continue  # still loading
                finish_load(state, offload, req)
            if not req.num_computed_tokens:
                # A load that covered a whole one-token prompt (blocks of one token) leaves
                # nothing computed (its token is computed again): vLLM 0.33.0's pass takes it
                # as a request never admitted (`num_computed_tokens == 0`) and asks the tier
                # again. A hit "loads" its own block, held and cached already: a job of no
                # block, and it waits for that again (for ever, while the tier keeps the
                # block); a lookup to wait sends it to the waiting queue's front.
                num_external = offload.lookup(req, 0)
                if num_external is None:
                    offload.admitted(req)
                    requeued.append(req)
                    continue
                if num_external:
                    if reserved is None:
                        reserved = reserved_blocks(state, reserve_tokens)
                    if not allocate_load(state, offload, req, 0, num_external, reserved,
                                         extra_blocks is not None):
                        stop = True
                        break
                    offload.reload(req)
                    continue
            num_tokens = chunk(req, req.num_uncomputed_tokens, budget)
            if not num_tokens:
                stop = True
                break
            if reserved is None:
                reserved = reserved_blocks(state, reserve_tokens)
            extra = 0 if extra_blocks is None else extra_blocks(req, 0, num_tokens)
            ahead = 0 if lookahead is None else lookahead(req, 0, num_tokens)
            index = next(i for i, r in enumerate(state.waiting) if r is req)
            own_reserve = try_admit(state, req, num_tokens, reserve_tokens, reserved, 0, ahead,
                                    extra, index)
            if own_reserve is None:
                stop = True
                break
            offload.admitted(req)
            reserved += own_reserve
            scheduled[rid] = num_tokens
            if budget is not None:
                budget -= num_tokens
        if requeued:  # (`step_skipped_waiting`, prepended in the order skipped)
            for req in requeued:
                state.waiting.remove(req)
            for req in reversed(requeued):
                state.waiting.appendleft(req)
        if stop:
            return budget
        holding = set(offload.holding)
    index = 0  # requests before it wait for KV from the CPU tier (skipped, in their place)
    while (len(state.waiting) > index and (budget is None or budget > 0)
           and len(state.running) + len(state.incoming) < max_num_seqs):
        req = state.waiting[index]
        if holding and req in holding:
            index += 1  # (passed in the holding queue)
            continue
        # (A waiting request with computed tokens has them from the CPU tier.)
        num_cached = kv.prefix_hit_tokens(req) if req.num_computed_tokens == 0 else 0
        if num_hit_blocks_dropped and num_cached:
            num_cached = max(0, num_cached - num_hit_blocks_dropped * kv.block_size)
        if isinstance(offload, JobOffloadState):
            num_external = offload.lookup(req, num_cached)
            if num_external is None:
                index += 1  # to wait for blocks being stored or loaded
                continue
            if num_external:  # blocks for hit and load now, no tokens until it is loaded
                if reserved is None:
                    reserved = reserved_blocks(state, reserve_tokens)
                # (A one-token prompt sent here from the holding queue holds its block,
                # cached: it loads none.)
                holds_hit = kv.num_held_blocks(req.request_id) * kv.block_size >= (
                    num_cached + num_external)
                if not allocate_load(state, offload, req, num_cached, num_external, reserved,
                                     extra_blocks is not None):
                    break
                if holds_hit:
                    offload.reload(req)
                else:
                    offload.start_load(req, num_cached, num_external)
                index += 1
                continue
        elif offload is not None:
            num_external = offload_lookup(state, offload, req, num_cached)
            if num_external is None:
                index += 1  # loading (or to wait for blocks another request loads)
                continue
            if num_external:  # blocks for hit and load now, no tokens until it is loaded
                if reserved is None:
                    reserved = reserved_blocks(state, reserve_tokens)
                extra = 0 if extra_blocks is None else extra_blocks(req, num_cached, 0)
                if not start_load(state, offload, req, num_cached, num_external,
                                  reserved + extra):
                    break
                index += 1
                continue
        num_new = req.num_uncomputed_tokens - num_cached
        assert num_new > 0, "a prefix hit must leave the last token to compute"
        num_tokens = chunk(req, num_new, budget)
        if not num_tokens:
            break
        if reserved is None:
            reserved = reserved_blocks(state, reserve_tokens)
        extra = 0 if extra_blocks is None else extra_blocks(req, num_cached, num_tokens)
        ahead = 0 if lookahead is None else lookahead(req, num_cached, num_tokens)
        own_reserve = try_admit(state, req, num_tokens, reserve_tokens, reserved,
                                num_cached, ahead, extra, index)
        if own_reserve is None:
            break
        reserved += own_reserve
        scheduled[req.request_id] = num_tokens
        if budget is not None:
            budget -= num_tokens
    return budget


def try_admit(
    state: ReplicaState, req: Request, num_tokens: int, reserve_tokens: int | None, reserved: int,
    num_cached_tokens: int = 0, num_lookahead_tokens: int = 0, num_extra_blocks: int = 0,
    index: int = 0,
) -> int | None:
    """Admit the head of the queue for a first chunk of `num_tokens` if it fits beside `reserved`
    blocks and its own future tokens (the Mini-SGLang admission rule). `num_cached_tokens` (at
    most `state.kv.prefix_hit_tokens(req)`) are taken from the prefix cache first: the chunk
    follows them, and they count as computed. `num_lookahead_tokens` more KV slots are
    allocated past the chunk (speculative decoding's drafter writes there). `num_extra_blocks`
    more must be free beside the chunk (vLLM's full-prompt check), counting those it reserves
    for its own future (the same blocks: the larger of the two is needed). `index`: where it
    is in the queue (those before it wait for KV from the CPU tier).

    Returns the blocks it keeps in reserve for its own future (add them to `reserved` before the
    next admission), or None if it was not admitted."""
    kv = state.kv
    after = req.num_computed_tokens + num_cached_tokens + num_tokens
    future = state.num_kv_tokens_needed(req)
    if reserve_tokens is not None:
        future = min(future, after + reserve_tokens)
    # (Beyond the slots allocated now: a drafter's lookahead slots hold future tokens too.)
    own_future = max(0, cdiv(future, kv.block_size)
                     - cdiv(after + num_lookahead_tokens, kv.block_size))
    if not kv.try_allocate(req, num_tokens + num_lookahead_tokens,
                           reserved + max(own_future, num_extra_blocks), num_cached_tokens,
                           num_lookahead_tokens=num_lookahead_tokens):
        return None
    state.admit(req, num_cached_tokens, index)
    return own_future


def allocate_load(state: ReplicaState, offload: JobOffloadState, req: Request,
                  num_cached: int, num_external: int, reserved: int, whole_prompt: bool
                  ) -> bool:
    """vLLM 0.33.0's admission of an async load: blocks for `req`'s GPU hit of `num_cached`
    tokens and the `num_external` it loads (cached once loaded; no drafter lookahead slots),
    if they fit beside `reserved` blocks and every prefilling or loading request's whole
    prompt (`_inflight_prefill_reserved_blocks`), and, `whole_prompt`, its own whole prompt
    fits too (`full_sequence_must_fit`). False: they do not."""
    kv = state.kv
    assert isinstance(kv, BlockPrefixCache)
    rest = (max(0, cdiv(req.num_tokens, kv.block_size)
                - cdiv(num_cached + num_external, kv.block_size)) if whole_prompt else 0)
    return kv.try_allocate(req, num_external,
                           reserved + max(offload.inflight_blocks(state), rest), num_cached,
                           cache_new=False)


def offload_lookup(state: ReplicaState, offload: OffloadState, req: Request,
                   num_cached: int) -> int | None:
    """With a CPU tier, for a queued request after its GPU prefix hit of `num_cached`
    tokens: the tokens it would load from the tier (0: none, it is admitted as usual), or None
    to skip it this time (its KV is still on its way, or blocks it would load are being loaded
    for another request). One whose load was reported done takes its loaded tokens as computed
    now and is admitted as usual (0)."""
    rid = req.request_id
    if rid in offload.loading:
        if rid not in offload.loaded:
            return None
        finish_load(state, offload, req)
        return 0
    if req.num_computed_tokens:
        return 0
    kv = state.kv
    assert isinstance(kv, BlockPrefixCache)
    block_size = kv.block_size
    num_blocks = req.num_tokens // block_size
    return offload.tier.lookup(kv.chain_hashes(req, num_blocks)[:num_blocks], num_cached,
                               block_size)


def start_load(state: ReplicaState, offload: OffloadState, req: Request, num_cached: int,
               num_external: int, num_reserved_blocks: int) -> bool:
    """Allocate `req`'s blocks for its GPU hit of `num_cached` tokens and the `num_external`
    it loads (cached once loaded), and start the load; False if they do not fit. It stays in
    the queue, skipped until the load is reported done."""
    kv = state.kv
    assert isinstance(kv, BlockPrefixCache)
    if not kv.try_allocate(req, num_external, num_reserved_blocks, num_cached, cache_new=False):
        return False
    block_size = kv.block_size
    start, end = num_cached // block_size, (num_cached + num_external) // block_size
    hashes = kv.chain_hashes(req, end)[start:end]
    rid = req.request_id
    offload.loading[rid] = req
    offload.loads.append((rid, offload.tier.start_load(rid, hashes)))
    offload.tier.set_next_stored(rid, end)
    counters = offload.tier.counters
    counters.num_hit_tokens += num_external
    if not req.num_preemptions:  # (its last token, if loaded, is computed again: `finish_load`)
        counters.num_first_hit_tokens += min(num_external, req.num_tokens - 1 - num_cached)
    return True


def finish_load(state: ReplicaState, offload: OffloadState | JobOffloadState,
                req: Request) -> None:
    """`req`'s KV has arrived: its blocks' tokens count as computed (all but the last token
    if they cover it), and are cached (`_update_waiting_for_remote_kv`)."""
    kv = state.kv
    assert isinstance(kv, BlockPrefixCache)
    rid = req.request_id
    del offload.loading[rid]
    offload.loaded.discard(rid)
    num_computed = min(kv.num_held_blocks(rid) * kv.block_size, req.num_tokens)
    if isinstance(offload, JobOffloadState):
        # (0.33.0 caches every loaded block, the last one too where the load covered the
        # whole prompt, before it rewinds to compute the last token again; 0.15.1 after.)
        kv.cache_loaded(req, num_computed)
    if num_computed == req.num_tokens:
        num_computed -= 1
    kv.cache_loaded(req, num_computed)
    req.num_computed_tokens = num_computed
    state.num_waiting_tokens -= num_computed
    if not req.num_preemptions:  # vLLM reports the hit of the first admission: both tiers'
        req.num_cached_tokens = num_computed
