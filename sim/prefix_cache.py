"""SGLang's prefix cache (`sglang` policy): KV blocks of a shared prefix are computed once and
shared by the requests that start with it, and kept after those requests end until their room
is needed. (vLLM's, block by block, is `sim.block_cache`.)

Requests name their prefix by `hash_ids`: id i stands for tokens [i * H, (i + 1) * H) (H =
`hash_block_tokens`, 512 for Mooncake), and requests sharing leading ids share those tokens. The
cache is a tree of such units (a unit's place in the tree is its whole prefix, as SGLang's radix
tree keys a path). A unit owns the KV blocks whose last token it holds.

What is modelled (rule, and where it comes from):
- A hit skips computing those tokens; at least the last known token is always computed, to get
  logits (SGLang's match leaves `len - 1` at most).
- Units are cached when allocated for prompt tokens, and a request's later units (its answer,
  where its ids cover it) when it frees its blocks (SGLang `cache_finished_req`). Only full
  units are cached.
- Cached blocks are shared, not duplicated: a request computing a unit already cached (computed
  concurrently) takes the cached one and gives its own back (SGLang's radix `insert`).
- Cached blocks nobody uses are free: they count in `num_free_blocks` and are evicted only when
  an allocation finds no other free block.
- Eviction (SGLang `RadixCache.evict`): only leaf nodes go, least recently used first, each
  whole: a node ends where an insertion ended (a chunk, a request's end), where paths diverge,
  or where a match ended (`_split_node`); a unit is used when a request takes it, caches it or
  releases it (SGLang's insertion at a request's end touches its whole path). Lookups alone
  touch nothing, so a router or a blocked queue head asking again and again does not keep a
  prefix alive (SGLang's `match_prefix` does touch: the golden schedules' `prefix_kv_starved`
  still differs).
Only block counts are tracked, never which physical block holds what.
"""

from __future__ import annotations

import heapq
from typing import Literal

from sim.kv_cache import KVCacheManager, cdiv
from sim.request import Request

# How a cache evicts: "lru_block" and "fifo_block", vLLM's free queue by release
# (`sim.block_cache`); "lru_leaf", SGLang's radix cache (this module).
Eviction = Literal["lru_block", "fifo_block", "lru_leaf"]


class Unit:
    """One cached unit: `num_blocks` KV blocks holding tokens of one prefix block."""

    __slots__ = ("children", "end", "key", "last_use", "num_blocks", "parent", "num_users")

    def __init__(self, key: int, parent: Unit | None, num_blocks: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, Unit] = {}
        self.num_blocks = num_blocks
        self.num_users = 0  # running requests sharing it; 0: evictable
        self.last_use = 0
        # The last unit of a radix-tree node (SGLang, `lru_leaf`): an insertion ended here, or
        # paths diverge after it, or a match ended at it (`_split_node`). Eviction takes a
        # leaf node whole: units up to the last one of the node above.
        self.end = False


class PrefixCachingKVManager(KVCacheManager):
    """A KV manager whose requests share cached prefix blocks (see the module docstring)."""

    caches_prefixes = True

    eviction = "lru_leaf"

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.root = Unit(-1, None, 0)
        # request id -> the units it shares, in order; its other held blocks are its own.
        self._units: dict[int, list[Unit]] = {}
        self._num_cached_blocks = 0  # blocks held by cached units, reachable or not
        self._num_evictable_blocks = 0  # of those, blocks of units nobody uses
        self._leaves: list[tuple[int, int, Unit]] = []  # evictable leaves: (last_use, seq, unit)
        self._clock = 0  # orders uses and heap entries
        self.num_evicted_blocks = 0

    # -- lookups --------------------------------------------------------------------------

    def _unit_blocks(self, req: Request, index: int) -> int:
        """Blocks owned by unit `index` of `req`: those whose last token it holds."""
        h = req.hash_block_tokens
        return (index + 1) * h // self.block_size - index * h // self.block_size

    def _match(self, req: Request) -> list[Unit]:
        """The cached units `req` can reuse: the longest cached chain of its ids that leaves at
        least one token to compute."""
        ids = req.hash_ids
        if not ids or self._held.get(req.request_id):
            return []
        h, bs = req.hash_block_tokens, self.block_size
        limit = req.num_tokens - 1
        units = []
        node = self.root
        for index, key in enumerate(ids):
            child = node.children.get(key)
            if child is None or (index + 1) * h // bs * bs > limit:
                break
            units.append(child)
            node = child
        return units

    def _hit_tokens(self, req: Request, num_units: int) -> int:
        return num_units * req.hash_block_tokens // self.block_size * self.block_size

    def prefix_hit_tokens(self, req: Request) -> int:
        return self._hit_tokens(req, len(self._match(req)))

    def unused_prefix_tokens(self, req: Request) -> int:
        return sum(u.num_blocks for u in self._match(req) if not u.num_users) * self.block_size

    # -- allocation -----------------------------------------------------------------------

    def try_allocate(self, req: Request, num_new_tokens: int, num_reserved_blocks: int = 0,
                     num_cached_tokens: int = 0) -> bool:
        rid = req.request_id
        hit: list[Unit] = []
        if num_cached_tokens:
            hit = self._match(req)
            while hit and self._hit_tokens(req, len(hit)) > num_cached_tokens:
                hit.pop()
            assert self._hit_tokens(req, len(hit)) == num_cached_tokens, "not a cached prefix"
        computed = req.num_computed_tokens + num_cached_tokens
        held = self._held.get(rid, 0) + num_cached_tokens // self.block_size
        grow = max(0, cdiv(computed + num_new_tokens, self.block_size) - held)
        # Taking an unused cached unit removes its blocks from the free ones.
        pinned = sum(u.num_blocks for u in hit if not u.num_users)
        if grow + pinned + num_reserved_blocks > self.num_free_blocks:
            return False
        if hit:
            self._units[rid] = hit
            hit[-1].end = True  # a match ending inside a node splits it there
            for unit in hit:
                self._use(unit)
            self._held[rid] = self._held.get(rid, 0) + num_cached_tokens // self.block_size
        if grow:
            self._take(grow)
            self._held[rid] = self._held.get(rid, 0) + grow
        if req.hash_ids:
            # Units the scheduled prompt tokens fill are cached now (vLLM `allocate_slots`).
            self._cache_units(req, min(computed + num_new_tokens, req.num_prompt_tokens))
        return True

    def grow_blocks(self, request_id: int, num_blocks: int) -> None:
        assert 0 <= num_blocks <= self.num_free_blocks
        self._take(num_blocks)
        self._held[request_id] = self._held.get(request_id, 0) + num_blocks

    def free(self, req: Request) -> None:
        rid = req.request_id
        if rid not in self._held:
            return
        if req.hash_ids:
            self._cache_units(req, req.num_computed_tokens)  # its answer's units, if named
        units = self._units.pop(rid, [])
        self.num_free_blocks += self._held.pop(rid) - sum(u.num_blocks for u in units)
        for unit in reversed(units):  # tail first: the prefix is evicted last
            self._release(unit)

    # -- the cache ------------------------------------------------------------------------

    def _cache_units(self, req: Request, num_tokens: int) -> None:
        """Cache `req`'s full units within its first `num_tokens` tokens, from its blocks."""
        rid = req.request_id
        ids = req.hash_ids
        assert ids is not None
        units = self._units.get(rid)
        done = len(units) if units else 0
        h = req.hash_block_tokens
        last = min(num_tokens // h, len(ids))
        if done >= last:
            return
        if units is None:
            units = self._units[rid] = []
        parent = units[-1] if units else self.root
        for index in range(done, last):
            key = ids[index]
            unit = parent.children.get(key)
            num_blocks = self._unit_blocks(req, index)
            if unit is None:
                unit = Unit(key, parent, num_blocks)
                if parent.children:  # a second path from here: the node above ends here
                    parent.end = True
                parent.children[key] = unit
                self._num_cached_blocks += num_blocks
                unit.num_users = 1
                self._touch(unit)
            else:  # cached meanwhile by another request: share it, give ours back
                self._use(unit)
                self.num_free_blocks += num_blocks
            units.append(unit)
            parent = unit
        parent.end = True  # an insertion ends here (SGLang: `cache_unfinished_req`, `insert`)

    def _touch(self, unit: Unit) -> None:
        self._clock += 1
        unit.last_use = self._clock

    def _use(self, unit: Unit) -> None:
        """One more request shares `unit` (if it was unused, its blocks stop being free)."""
        if not unit.num_users:
            self.num_free_blocks -= unit.num_blocks
            self._num_evictable_blocks -= unit.num_blocks
        unit.num_users += 1
        self._touch(unit)

    def _release(self, unit: Unit) -> None:
        unit.num_users -= 1
        self._touch(unit)
        if unit.num_users:
            return
        self.num_free_blocks += unit.num_blocks
        self._num_evictable_blocks += unit.num_blocks
        if not unit.children:
            self._push_leaf(unit)

    def _push_leaf(self, unit: Unit) -> None:
        self._clock += 1
        heapq.heappush(self._leaves, (unit.last_use, self._clock, unit))

    def _take(self, num_blocks: int) -> None:
        """Use `num_blocks` free blocks, evicting unused cached units if the others run out."""
        while self.num_free_blocks - self._num_evictable_blocks < num_blocks:
            self._evict_one()
        self.num_free_blocks -= num_blocks

    def _evict_one(self) -> None:
        """Evict the least recently used leaf node, whole."""
        while True:
            last_use, _, unit = heapq.heappop(self._leaves)
            # Stale entries: used again since, or no longer a leaf, or already gone.
            if (not unit.num_users and not unit.children and last_use == unit.last_use
                    and unit.parent is not None):
                break
        while True:
            parent = self._drop(unit)
            # The rest of the leaf's node goes with it.
            if parent is self.root or parent.end or parent.children or parent.num_users:
                break
            unit = parent
        if not parent.children and not parent.num_users and parent is not self.root:
            self._push_leaf(parent)

    def _drop(self, unit: Unit) -> Unit:
        """Evict one unused, childless unit; return its parent."""
        parent = unit.parent
        assert parent is not None
        if parent.children.get(unit.key) is unit:
            del parent.children[unit.key]
        unit.parent = None
        self._num_cached_blocks -= unit.num_blocks
        self._num_evictable_blocks -= unit.num_blocks
        self.num_evicted_blocks += unit.num_blocks
        return parent

    # -- checks ---------------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding cached units (in use or not)."""
        return self._num_cached_blocks

    def check(self) -> None:
        """Blocks are conserved: private blocks of requests, cached units (each counted once)
        and the blocks that are free and hold nothing add up to the total."""
        num_private = sum(self._held.values()) - sum(
            u.num_blocks for units in self._units.values() for u in units)
        num_uncached_free = self.num_free_blocks - self._num_evictable_blocks
        assert num_private >= 0 and num_uncached_free >= 0
        assert 0 <= self._num_evictable_blocks <= self._num_cached_blocks
        assert num_private + self._num_cached_blocks + num_uncached_free == self.num_blocks
        for rid, units in self._units.items():
            assert all(u.num_users > 0 for u in units)
            assert sum(u.num_blocks for u in units) <= self._held[rid]
