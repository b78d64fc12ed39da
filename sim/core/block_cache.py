"""vLLM's prefix cache, block by block: every full block a request computes is cached under the
hash of its whole prefix, and a later request (or the same one, preempted and back) reuses the
longest chain of its blocks that is cached.

What is modelled, and where it comes from (vLLM v1, `vllm/v1/core/`, 0.15.1 and 0.33.0 alike):
- A block's identity is the chain of its tokens' hashes (`kv_cache_utils.hash_block_tokens`:
  parent hash, then the block's tokens). Here a request names shared tokens by `hash_ids`
  (id i covers tokens [i * H, (i + 1) * H)); a block whose tokens all lie under ids is keyed by
  the ids it covers, so requests sharing leading ids share those blocks at any H; every other
  block (a unique suffix, generated tokens) gets a key of the request's own, which only the
  request itself can hit again after a preemption, as in vLLM, where its tokens are its own.
- Hits: the longest chain of cached blocks, at most `num_tokens - 1` tokens
  (`KVCacheManager.get_computed_blocks`), for a request that holds nothing.
- Caching: `allocate_slots` caches the full blocks the scheduled tokens fill
  (`cache_blocks(request, min(computed + new, num_tokens))`); here, the blocks full at each
  allocation of a prompt chunk (or a recompute), and at free every full block of computed
  tokens: a decode's blocks are cached then, not as they fill (only the request itself, or a
  later turn naming its answer while it still runs, could hit them sooner; the fast path
  grows decodes' blocks without a call per iteration).
  A block computed while an equal one is cached stays a second copy (`_insert_block_hash`);
  a hit takes the oldest copy (`get_one_block`).
- The free queue (`block_pool.py`, `FreeKVCacheBlockQueue`, `free_blocks`): it starts with
  every block; allocation takes from the front, evicting a cached block it takes
  (`get_new_blocks`); a hit takes its blocks out (`touch`); a request's blocks are freed tail
  first. Where they go differs by release (`free_order`):
  - "lru_block" (0.33.0): uncached ones to the front ("LIFO reuse of non-cached blocks"),
    cached ones to the back ("FIFO reuse of cached blocks for LRU eviction"): uncached free
    blocks always go first, then cached ones, least recently freed first;
  - "fifo_block" (0.15.1): every freed block to the back, cached or not: after the blocks
    never used, free blocks go in the order they were freed.
Only counts and cached blocks are objects here: one per cached or in-use block, none per token.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Literal

from sim.core.kv_cache import KVCacheManager, cdiv
from sim.core.request import Request


class Block:
    """A block in use or cached: its chain hash (None: not cached) and its users."""

    __slots__ = ("hash", "ref_cnt")

    def __init__(self, block_hash: int | None, ref_cnt: int) -> None:
        self.hash = block_hash
        self.ref_cnt = ref_cnt


class BlockPrefixCache(KVCacheManager):
    """A KV manager that caches prefixes block by block, as vLLM's does (module docstring)."""

    caches_prefixes = True
    # Whether a request's computed blocks are cached when it frees them (what vLLM's
    # `allocate_slots`, and with speculative decoding 0.33.0's `update_from_output`, cached
    # by then); else only as allocated (0.15.1's synchronous scheduler with speculative
    # decoding: a step's accepted drafts are cached at the next allocation, never if the
    # request stops there).
    cache_at_free = True

    def __init__(self, num_blocks: int, block_size: int,
                 free_order: Literal["lru_block", "fifo_block"] = "lru_block") -> None:
        super().__init__(num_blocks, block_size)
        self.eviction = free_order
        self._blocks: dict[int, list[Block]] = {}  # request id -> its blocks, in token order
        self._num_hashed: dict[int, int] = {}  # request id -> its leading blocks cached
        self._hashes: dict[int, list[int]] = {}  # request id -> its blocks' chain hashes so far
        self._cached: dict[int, list[Block]] = {}  # chain hash -> its copies, oldest first
        # The free queue: anonymous uncached blocks at its front (never used; with
        # "lru_block", every freed uncached one too), then the freed blocks kept in order
        # (cached ones; with "fifo_block", uncached ones too), the next to go first.
        self._num_front = num_blocks
        self._queue: OrderedDict[Block, None] = OrderedDict()
        self.num_evicted_blocks = 0
        # Cached blocks taken from the free queue for new ones, as they go (None: not kept):
        # vLLM 0.33.0's CPU tier flushes a store that reads one (`sim.core.offload_jobs`).
        self.taken: list[Block] | None = None
        self._detached: list[list[Block]] = []  # given up, not yet released (`detach`)
        # Changes whenever a chain hash is cached or evicted: a match kept from before is
        # stale (`_match_len`).
        self._version = 0
        self._memo: dict[int, tuple[int, int, int]] = {}

    # -- hashes ---------------------------------------------------------------------------

    def _chain(self, req: Request, num_blocks: int) -> list[int]:
        """The chain hashes of `req`'s first `num_blocks` blocks (kept, extended as needed)."""
        hashes = self._hashes.setdefault(req.request_id, [])
        bs = self.block_size
        ids, h = req.hash_ids, req.hash_block_tokens
        covered = len(ids) * h if ids else 0
        parent = hashes[-1] if hashes else 0
        for j in range(len(hashes), num_blocks):
            end = (j + 1) * bs
            key: Any
            if end <= covered:
                assert ids is not None
                key = (j, ids[j * bs // h:(end - 1) // h + 1])
            else:  # tokens of its own: only it can hit them
                key = (j, -1, req.request_id)
            parent = hash((parent, key))
            hashes.append(parent)
        return hashes  # (at least `num_blocks` long)

    def _match_len(self, req: Request) -> int:
        """How many blocks `req` (holding none) would reuse: the longest cached chain within
        its first `num_tokens - 1` tokens. Kept until the cache changes (a queue head is
        asked at every plan, and twice when admitted)."""
        rid = req.request_id
        if self._held.get(rid):
            return 0
        limit = (req.num_tokens - 1) // self.block_size
        memo = self._memo.get(rid)
        if memo is not None and memo[0] == self._version and memo[1] == limit:
            return memo[2]
        hashes = self._chain(req, limit)
        cached = self._cached
        n = 0
        while n < limit and hashes[n] in cached:
            n += 1
        self._memo[rid] = (self._version, limit, n)
        return n

    def _match(self, req: Request) -> list[Block]:
        """The cached blocks `req` would reuse (the oldest copy of each)."""
        n = self._match_len(req)
        cached = self._cached
        return [cached[h][0] for h in self._hashes[req.request_id][:n]] if n else []

    def prefix_hit_tokens(self, req: Request) -> int:
        return self._match_len(req) * self.block_size

    def unused_prefix_tokens(self, req: Request) -> int:
        return sum(1 for b in self._match(req) if not b.ref_cnt) * self.block_size

    # -- allocation -----------------------------------------------------------------------

    def try_allocate(self, req: Request, num_new_tokens: int, num_reserved_blocks: int = 0,
                     num_cached_tokens: int = 0, *, cache_new: bool = True,
                     num_lookahead_tokens: int = 0) -> bool:
        # (`cache_new` False: blocks for KV a CPU tier loads, cached once it has arrived:
        # `cache_loaded`; vLLM's `delay_cache_blocks`. The last `num_lookahead_tokens` of
        # `num_new_tokens` are a drafter's slots, never cached: vLLM caches up to the tokens
        # scheduled, `num_tokens_to_cache` in `KVCacheManager.allocate_slots`.)
        rid = req.request_id
        bs = self.block_size
        num_hit = num_cached_tokens // bs
        computed = req.num_computed_tokens + num_cached_tokens
        held = self._held.get(rid, 0) + num_hit
        grow = max(0, cdiv(computed + num_new_tokens, bs) - held)
        if grow + num_reserved_blocks > self.num_free_blocks:
            return False  # (whatever its hit pins: a queue head asks at every plan)
        hit: list[Block] = []
        if num_hit:
            hit = self._match(req)[:num_hit]
            assert len(hit) * bs == num_cached_tokens, "not a cached prefix"
        # A hit block nobody uses is in the free queue: taking it leaves one free block less.
        pinned = sum(1 for b in hit if not b.ref_cnt)
        if grow + pinned + num_reserved_blocks > self.num_free_blocks:
            return False
        blocks = self._blocks.setdefault(rid, [])
        for block in hit:
            if not block.ref_cnt:
                del self._queue[block]
                self.num_free_blocks -= 1
            block.ref_cnt += 1
            blocks.append(block)
        if hit:
            self._num_hashed[rid] = len(hit)
        if grow:
            self._take(grow)
            blocks.extend(Block(None, 1) for _ in range(grow))
        self._held[rid] = held + grow
        # Up to the tokens known: outputs still in flight (async placeholders) are not. A
        # decode's blocks are cached when it frees them, as the fast path (which grows a
        # decode's blocks without asking) leaves them: only the request itself, or a later
        # turn naming its answer while it still runs, could hit them before.
        if cache_new and (num_new_tokens != 1 or not req.is_decoding
                          or not self.cache_at_free):
            self._cache(req, min(computed + num_new_tokens - num_lookahead_tokens,
                                 req.num_tokens - req.num_placeholders))
        return True

    def chain_hashes(self, req: Request, num_blocks: int) -> list[int]:
        """The chain hashes of `req`'s blocks, the kept list itself (read only: no copy, at
        least `num_blocks` long). A CPU tier keys its blocks by them, as vLLM's offloading
        connector does by `request.block_hashes`."""
        return self._chain(req, num_blocks)

    def blocks_of(self, request_id: int) -> list[Block]:
        """The blocks `request_id` holds, in token order (the kept list itself: read only)."""
        return self._blocks.get(request_id, [])

    def cache_loaded(self, req: Request, num_tokens: int) -> None:
        """Cache `req`'s full blocks within its first `num_tokens`, loaded from a CPU tier."""
        self._cache(req, num_tokens)

    def grow_blocks(self, request_id: int, num_blocks: int) -> None:
        assert 0 <= num_blocks <= self.num_free_blocks
        self._take(num_blocks)
        self._blocks.setdefault(request_id, []).extend(Block(None, 1) for _ in range(num_blocks))
        self._held[request_id] = self._held.get(request_id, 0) + num_blocks

    def free(self, req: Request, *, preempted: bool = False) -> None:
        blocks = self._detach(req)
        if blocks:
            self._release(blocks)

    def detach(self, req: Request) -> list[Block]:
        """`req` gives up its blocks, which stay in use (cached ones can still be hit) until
        `release` (vLLM 0.33.0's `pop_blocks_for_free`, a free deferred while a step in
        flight may still write them). Returns them, in token order."""
        blocks = self._detach(req)
        if blocks:
            self._detached.append(blocks)
        return blocks

    def _detach(self, req: Request) -> list[Block]:
        rid = req.request_id
        if rid not in self._held:
            return []
        # What vLLM cached by then: every computed token but those of iterations in flight
        # (async: `update_from_output` caches up to `num_computed_tokens - num_in_flight`).
        if self.cache_at_free:
            self._cache(req, req.num_computed_tokens - req.num_in_flight_tokens)
        del self._held[rid]
        self._num_hashed.pop(rid, None)
        if req.num_output_tokens >= req.num_target_output_tokens:
            self._hashes.pop(rid, None)  # finished: it will not ask again
            self._memo.pop(rid, None)
        return self._blocks.pop(rid)

    def release(self, blocks: list[Block]) -> None:
        """Free blocks `detach` gave, tail first."""
        detached = self._detached
        del detached[next(i for i, b in enumerate(detached) if b is blocks)]
        self._release(blocks)

    def _release(self, blocks: list[Block]) -> None:
        uncached_first = self.eviction == "lru_block"
        for block in reversed(blocks):  # tail first: evicted first
            block.ref_cnt -= 1
            if not block.ref_cnt:
                self.num_free_blocks += 1
                if block.hash is None and uncached_first:
                    self._num_front += 1
                else:
                    self._queue[block] = None  # the back of the queue

    def _cache(self, req: Request, num_tokens: int) -> None:
        """Cache `req`'s full blocks within its first `num_tokens` tokens."""
        rid = req.request_id
        done = self._num_hashed.get(rid, 0)
        last = min(num_tokens // self.block_size, len(self._blocks.get(rid, ())))
        if last <= done:
            return
        blocks = self._blocks[rid]
        hashes = self._chain(req, last)
        cached = self._cached
        for j in range(done, last):
            block = blocks[j]
            block.hash = block_hash = hashes[j]
            copies = cached.get(block_hash)
            if copies is None:
                cached[block_hash] = [block]
                self._version += 1  # a new hash: a match may be longer now
            else:
                copies.append(block)
        self._num_hashed[rid] = last

    def _take(self, num_blocks: int) -> None:
        """Use the `num_blocks` free blocks at the front of the queue, evicting each cached
        one from the cache."""
        assert num_blocks <= self.num_free_blocks
        self.num_free_blocks -= num_blocks
        front = min(num_blocks, self._num_front)
        self._num_front -= front
        queue = self._queue
        taken = self.taken
        for _ in range(num_blocks - front):
            block, _ = queue.popitem(last=False)
            if taken is not None:
                taken.append(block)
            if block.hash is not None:
                copies = self._cached[block.hash]
                copies.remove(block)
                if not copies:
                    del self._cached[block.hash]
                    self._version += 1  # a hash gone: a match may be shorter now
                block.hash = None
                self.num_evicted_blocks += 1

    # -- checks ---------------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix (in use or not)."""
        return sum(len(copies) for copies in self._cached.values())

    def check(self) -> None:
        """Blocks are conserved: every block in use once, however many share it, plus the free
        ones, cached or not, make the total."""
        in_use = {id(b): b for blocks in [*self._blocks.values(), *self._detached]
                  for b in blocks}
        assert all(b.ref_cnt > 0 for b in in_use.values())
        assert not any(id(b) in in_use for b in self._queue)
        assert len(in_use) + self.num_free_blocks == self.num_blocks
        assert self._num_front >= 0 and self._num_front + len(self._queue) == self.num_free_blocks
        assert all(b.hash is not None for b in self._queue) or self.eviction == "fifo_block"
        for rid, blocks in self._blocks.items():
            assert self._held[rid] == len(blocks)
        assert set(self._held) == set(self._blocks)
