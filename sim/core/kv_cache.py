"""Paged KV-cache accounting: blocks of `block_size` token slots, allocated per chunk.

Only block counts are tracked (which physical block holds what does not change latency), so the
cost of an allocation does not depend on the number of tokens.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from sim.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Counts free blocks and the blocks each request holds."""

    caches_prefixes = False  # see `sim.core.radix_cache.PrefixCachingKVManager`
    num_evicted_blocks = 0

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_free_blocks = num_blocks
        self._held: dict[int, int] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def num_held_blocks(self, request_id: int) -> int:
        return self._held.get(request_id, 0)

    def num_blocks_to_grow(self, req: Request, num_new_tokens: int) -> int:
        """Blocks `req` must add to hold KV for `num_new_tokens` more computed tokens."""
        needed = cdiv(req.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - self._held.get(req.request_id, 0))

    def prefix_hit_tokens(self, req: Request) -> int:
        """Tokens of `req` (which holds no blocks) whose KV is cached here and could be reused:
        0 without prefix caching."""
        return 0

    def unused_prefix_tokens(self, req: Request) -> int:
        """Tokens of the cached prefix `req` would reuse that nobody uses now (free, and
        evictable until it takes them): 0 without prefix caching."""
        return 0

    def match_prefix(self, req: Request) -> int:
        """`prefix_hit_tokens`, asked by a scheduler about to admit `req`: a cache that orders
        eviction by use counts it as one (SGLang's `match_prefix`)."""
        return self.prefix_hit_tokens(req)

    def touch_prefix(self, req: Request) -> None:
        """Count `req`'s cached prefix as used now, matching nothing (SGLang's waiting-queue
        refresh); nothing without prefix caching."""

    def checkpoint(self, req: Request, num_tokens: int | None = None) -> None:
        """Cache `req`'s first `num_tokens` tokens (default: what it has computed) as it runs
        (SGLang inserts a request's prompt when its prefill or a chunk ends); nothing here."""

    def evict_to_free(self, num_blocks: int) -> None:
        """Evict cached blocks nobody uses until `num_blocks` blocks hold nothing (SGLang's
        decode-memory check and retraction do, at once); nothing is cached here."""

    def evict_before_paged_allocation(self, num_blocks: int) -> None:
        """SGLang's paged allocator evicting for `num_blocks` blocks before a batch's
        allocations (`sim.core.radix_cache`); nothing is cached here."""

    def deferred_evictions(self) -> AbstractContextManager[None]:
        """Within it, allocations take evictable cached blocks without evicting yet; leaving it
        evicts what they took, at once (SGLang evicts once for a whole prefill batch, after
        matching every request in it)."""
        return nullcontext()

    def try_allocate(self, req: Request, num_new_tokens: int, num_reserved_blocks: int = 0,
                     num_cached_tokens: int = 0, *, num_lookahead_tokens: int = 0) -> bool:
        """Grow `req` for its next `num_new_tokens`, keeping `num_reserved_blocks` free.
        `num_cached_tokens` (a request holding no blocks: at most `prefix_hit_tokens(req)`)
        first takes that cached prefix as its own, shared: the new tokens follow it. The
        last `num_lookahead_tokens` of the new ones are slots a drafter writes (a prefix cache
        caches none of them).

        Returns False, allocating nothing, if that does not fit."""
        assert num_cached_tokens == 0, "prefix caching is off"
        grow = self.num_blocks_to_grow(req, num_new_tokens)
        if grow + num_reserved_blocks > self.num_free_blocks:
            return False
        if grow:
            self.num_free_blocks -= grow
            self._held[req.request_id] = self._held.get(req.request_id, 0) + grow
        return True

    def allocate_one_token_each(self, requests: list[Request]) -> None:
        """`try_allocate(req, 1)` for each of `requests`, in order, which the caller has found
        to fit (SGLang's decode step, after `check_decode_mem`). One loop here; a prefix cache,
        whose allocations take and register blocks, makes each through its `try_allocate`."""
        if self.caches_prefixes:
            for req in requests:
                ok = self.try_allocate(req, 1)
                assert ok
            return
        held = self._held
        block_size = self.block_size
        free = self.num_free_blocks
        for req in requests:
            request_id = req.request_id
            has = held.get(request_id, 0)
            grow = -(-(req.num_computed_tokens + 1) // block_size) - has
            if grow > 0:
                free -= grow
                held[request_id] = has + grow
        assert free >= 0
        self.num_free_blocks = free

    def grow_blocks(self, request_id: int, num_blocks: int) -> None:
        """Add blocks known to be free (used by the engine's decode fast-forward)."""
        assert 0 <= num_blocks <= self.num_free_blocks
        self.num_free_blocks -= num_blocks
        self._held[request_id] = self._held.get(request_id, 0) + num_blocks

    def grow_to(self, request_id: int, num_blocks: int) -> None:
        """Hold at least `num_blocks` blocks for the request, adding blocks known to be free
        (an async replica's fast-forward)."""
        held = self._held.get(request_id, 0)
        if num_blocks > held:
            assert num_blocks - held <= self.num_free_blocks
            self.num_free_blocks -= num_blocks - held
            self._held[request_id] = num_blocks

    def free(self, req: Request, *, preempted: bool = False) -> None:
        """Give back `req`'s blocks: it finished, or it was `preempted` (SGLang keeps in its
        radix cache only what a finished request computed)."""
        self.num_free_blocks += self._held.pop(req.request_id, 0)

    def check(self) -> None:
        """Blocks are conserved: held plus free equals the total."""
        assert self.num_free_blocks >= 0
        assert sum(self._held.values()) + self.num_free_blocks == self.num_blocks
