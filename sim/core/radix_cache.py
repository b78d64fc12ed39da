"""SGLang's prefix cache (`sglang` policy), its radix tree as SGLang 0.5.23 keeps it: KV blocks
of a shared prefix are computed once and shared by the requests that start with it, and kept
after those requests end until their room is needed. (vLLM's, block by block, is
`sim.core.block_cache`.)

Requests name their prefix by `hash_ids`: id i stands for tokens [i * H, (i + 1) * H) (H =
`hash_block_tokens`, 512 for Mooncake; 1 for the golden schedules, SGLang's token-level tree).
The cache is a tree of such units (a unit's place in the tree is its whole prefix, as SGLang's
radix tree keys a path). A unit owns the KV blocks whose last token it holds. Only block counts
are tracked, never which physical block holds what.

What is modelled (rule, and where it comes from; paths under `sglang/srt/`):
- A hit skips computing those tokens; at least the last known token is always computed, to get
  logits (`_compute_max_prefix_len`: `len - 1` at most).
- Insertion (`mem_cache/radix_cache.py` `checkpoint`): what a request's extend computed is
  cached when its prefill ends (`checkpoint_kv_cache`, up to `extend_end`) and, chunk by chunk,
  when the next batch is scheduled (`stash_chunked_request`); a finished request's whole KV
  when it leaves (`release_kv_cache(checkpoint=True)`). Its prompt's ids are units; what lies
  past them (the outputs a retracted request computes again, or at its release, its output
  and a partial unit) becomes a node of its own under them (`split_prompt`) that only it can
  match (a retracted request finds its outputs cached when it comes back). A preempted
  (retracted) request caches nothing more when it leaves. Only full units are shared. A
  request inserting a unit already cached (computed by another meanwhile) takes the cached
  one and gives its own back (`_insert_cache` frees duplicates).
- Cached blocks nobody uses (lock count 0) are free: they count in `num_free_blocks` and are
  evicted only when an allocation finds no other free block; a whole prefill batch allocates,
  and evicts, once, after every request in it was matched (`deferred_evictions`).
- Eviction (`evict`, `LRUStrategy`): only leaf nodes go, least recently used first, each whole.
  A node ends where an insertion ended, where paths diverge, or where a match ended
  (`_split_node`). Used means touched: a match (`match_prefix`, the scheduler's, each waiting
  request it tries), a refresh (`touch_prefix`, every 32nd pass, the first 128 waiting
  requests, head last) and an insertion touch their whole path, and a match or insertion that
  ends inside a node the whole node (the split keeps the old node's part below with the new
  time). Locking and unlocking touch nothing; nor do lookups of routers and metrics
  (`prefix_hit_tokens`).
- EAGLE's keys (`bigram_keys`; EAGLE, EAGLE-3, NEXTN): the tree is keyed by token pairs
  (`RadixKey.maybe_to_bigram_view`), so n tokens are n - 1 keys holding the KV of their first
  n - 1 tokens: every match, insertion and limit is one token shorter. With one token per unit
  the first unit holds no KV and is the root's (a pair's node is the unit of its second token).
- A finished request caches what SGLang counts as its own (`owned_kv_len`): its committed KV,
  not a verification still in flight, and, where its last verification accepted past its
  last token, one token more (`min(kv_committed_len, prompt + outputs through the stop)`).
- Pages (SGLang's `--page-size`, the block size): only whole blocks are matched and cached
  (`RadixKey.page_aligned`: a key cut to whole pages; a partial last page stays its request's
  and is freed with it), and a paged allocation (pages > 1) evicts first until its batch's
  tokens and a page a request are free (`evict_before_paged_allocation`).
- Eager eviction (`evict_to_free`): SGLang's decode-memory check evicts what it is short of
  (`check_decode_capacity`) and a retraction evicts for 20 tokens a request still running
  (`release_req`, `SGLANG_RETRACT_DECODE_STEPS`), whether or not the step then fits.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from sim.core.kv_cache import KVCacheManager, cdiv
from sim.core.request import Request

# How a cache evicts: "lru_block" and "fifo_block", vLLM's free queue by release
# (`sim.core.block_cache`); "lru_leaf", SGLang's radix cache (this module).
Eviction = Literal["lru_block", "fifo_block", "lru_leaf"]


class Unit:
    """One cached unit: `num_blocks` KV blocks holding tokens of one prefix block."""

    __slots__ = ("backed", "children", "end", "hit_count", "key", "last_use", "num_blocks",
                 "on_device", "parent", "num_users")

    def __init__(self, key: int, parent: Unit | None, num_blocks: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, Unit] = {}
        self.num_blocks = num_blocks
        self.num_users = 0  # running requests sharing it (SGLang's lock_ref); 0: evictable
        self.last_use = 0
        # The last unit of a radix-tree node: an insertion ended here, or paths diverge after
        # it, or a match ended at it (`_split_node`). Eviction takes a leaf node whole: units up
        # to the last one of the node above.
        self.end = False
        # A hierarchical cache's (`sim.core.hicache`): whether its KV is on the GPU, whether a
        # copy is in host memory, and the insertions that walked it (SGLang's `hit_count`).
        self.on_device = True
        self.backed = False
        self.hit_count = 0


# Keys of the nodes holding a finished request's uncached rest (below the hash ids' range:
# Mooncake's are >= 0, the golden tool's are 64-bit hashes), so nobody matches them.
_REST_KEY = -(2**63) - 1


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
        # Of those, blocks of units nobody uses. Within `deferred_evictions` allocations may
        # take some before they are evicted: `num_free_blocks` below this by what they owe.
        self._num_evictable_blocks = 0
        self._leaves: list[tuple[int, int, Unit]] = []  # evictable leaves: (last_use, seq, unit)
        self._clock = 0  # orders touches (SGLang's `last_access_time`)
        self._seq = 0  # orders heap entries of equal times
        self._deferring = False
        self._num_deferred_blocks = 0  # blocks allocations took while deferring evictions
        self.num_evicted_blocks = 0
        self.bigram_keys = False  # EAGLE's token-pair keys (the module docstring)

    # -- lookups --------------------------------------------------------------------------

    def _first_unit(self, req: Request) -> int:
        """The first of `req`'s units that is a node of the tree: with token-pair keys and a
        unit per token, the first token is no key (the pair it starts is the next unit's)."""
        return 1 if self.bigram_keys and req.hash_block_tokens == 1 else 0

    def _cached_tokens(self, num_tokens: int) -> int:
        """Tokens of a key of `num_tokens` tokens that hold cached KV: its whole blocks (one
        token fewer with token-pair keys)."""
        return max(0, num_tokens - self.bigram_keys) // self.block_size * self.block_size

    def _unit_blocks(self, req: Request, index: int) -> int:
        """Blocks owned by unit `index` of `req`: those whose last token it holds."""
        h = req.hash_block_tokens
        return (self._cached_tokens((index + 1) * h) - self._cached_tokens(index * h)
                ) // self.block_size

    def _match(self, req: Request, limit: int | None = None) -> list[Unit]:
        """The cached units `req` can reuse: the longest cached chain of its ids within its
        first `limit` tokens (default: leaving at least one token to compute), and past its
        ids what it cached of its own before it was retracted (its outputs)."""
        if self._held.get(req.request_id):
            return []
        ids = req.hash_ids or ()
        if limit is None:
            limit = req.num_tokens - 1
        num_allowed = self._cached_tokens(limit) // self.block_size  # blocks it may reuse
        units: list[Unit] = []
        node = self.root
        num_blocks = 0
        index = self._first_unit(req)
        while index < len(ids):
            child = node.children.get(ids[index])
            if child is None or num_blocks + child.num_blocks > num_allowed:
                return units
            units.append(child)
            node = child
            num_blocks += child.num_blocks
            index += 1
        own = _REST_KEY - req.request_id
        while (child := node.children.get(own)) is not None:
            if num_blocks + child.num_blocks > num_allowed:
                break
            units.append(child)
            node = child
            num_blocks += child.num_blocks
        return units

    def _hit_tokens(self, units: list[Unit]) -> int:
        return sum(u.num_blocks for u in units) * self.block_size

    def prefix_hit_tokens(self, req: Request) -> int:
        return self._hit_tokens(self._match(req))

    def unused_prefix_tokens(self, req: Request) -> int:
        return sum(u.num_blocks for u in self._match(req) if not u.num_users) * self.block_size

    def match_prefix(self, req: Request) -> int:
        units = self._match(req)
        if units:
            self._touch_path(units)
        return self._hit_tokens(units)

    def touch_prefix(self, req: Request) -> None:
        # The whole key, prompt and output (`touch_waiting_prefix`): no token kept to compute.
        units = self._match(req, req.num_tokens)
        if units:
            self._touch_path(units)

    # -- allocation -----------------------------------------------------------------------

    def try_allocate(self, req: Request, num_new_tokens: int, num_reserved_blocks: int = 0,
                     num_cached_tokens: int = 0, *, num_lookahead_tokens: int = 0) -> bool:
        rid = req.request_id
        hit: list[Unit] = []
        if num_cached_tokens:
            hit = self._match(req)
            while hit and (self._hit_tokens(hit) > num_cached_tokens or not hit[-1].on_device):
                hit.pop()  # (a hierarchical cache's host-only units come last: not a hit)
            assert self._hit_tokens(hit) == num_cached_tokens, "not a cached prefix"
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
        return True

    def grow_blocks(self, request_id: int, num_blocks: int) -> None:
        assert 0 <= num_blocks <= self.num_free_blocks
        self._take(num_blocks)
        self._held[request_id] = self._held.get(request_id, 0) + num_blocks

    def checkpoint(self, req: Request, num_tokens: int | None = None) -> None:
        if self._held.get(req.request_id):
            self._insert(req, req.num_computed_tokens if num_tokens is None else num_tokens)

    def free(self, req: Request, *, preempted: bool = False) -> None:
        rid = req.request_id
        if rid not in self._held:
            return
        rest: list[Unit] = []
        if not preempted:  # SGLang's `release_kv_cache(checkpoint=True)`, its `owned_kv_len`
            num_owned = (req.num_computed_tokens - req.num_in_flight_tokens
                         + min(req.num_overshoot_tokens, 1))
            rest = self._insert(req, num_owned, release=True)
        units = self._units.pop(rid, [])
        owned = sum(u.num_blocks for u in units) + sum(u.num_blocks for u in rest)
        self.num_free_blocks += self._held.pop(rid) - owned
        for unit in units:
            self._release(unit)
        for unit in rest:
            self._release(unit)

    # -- the cache ------------------------------------------------------------------------

    def _insert(self, req: Request, num_tokens: int, *, release: bool = False) -> list[Unit]:
        """SGLang's `checkpoint`: cache `req`'s full units within its first `num_tokens`
        tokens, from its blocks, and touch its path. Past its ids (a retracted request's
        prompt and outputs, computed again) its blocks become a node of its own under them,
        which only it can match. At its release (`num_tokens` what it owns) its blocks past
        those become a node (or nodes) of their own too, returned (`release`: in use by `req`
        until it lets go)."""
        rid = req.request_id
        ids = req.hash_ids or ()
        units = self._units.setdefault(rid, [])
        own = _REST_KEY - rid
        num_shared = sum(u.key != own for u in units)  # (its own nodes come last)
        done = self._first_unit(req) + num_shared
        h = req.hash_block_tokens
        last = min(num_tokens // h, len(ids)) if ids else 0
        parent = units[-1] if units else self.root
        if num_shared == len(units):
            for index in range(done, last):
                key = ids[index]
                unit = parent.children.get(key)
                num_blocks = self._unit_blocks(req, index)
                if unit is None:
                    unit = self._new_unit(key, parent, num_blocks)
                else:  # cached meanwhile by another request: share it, give ours back
                    self._share_cached(unit, num_blocks)
                units.append(unit)
                parent = unit
            if last > done:
                parent.end = True  # the new node ends here (`_insert_helper`)
        num_rest = (self._cached_tokens(num_tokens) // self.block_size
                    - sum(u.num_blocks for u in units))
        if not release and last == len(ids) and num_rest > 0:  # a retracted one's outputs
            parent.end = True
            units += self._own_nodes(own, parent, num_rest)
        if units:
            self._touch_path(units)  # split where the insertion ends inside a node
        rest: list[Unit] = []
        if release and num_rest > 0:  # split at the prompt's end (`split_prompt`), touched
            rest = self._own_nodes(own, parent, num_rest)
            if not units:
                self._clock += 1
            for unit in rest:
                unit.last_use = self._clock
        if not units:
            del self._units[rid]
        return rest

    def _own_nodes(self, own: int, parent: Unit, num_blocks: int) -> list[Unit]:
        """`num_blocks` of a request's own (past its ids), cached under `parent` as nodes in
        use by it: one new node (a hierarchical cache may find those tokens in host memory
        from before its retraction: `sim.core.hicache`)."""
        unit = self._new_unit(own, parent, num_blocks)
        unit.end = True
        return [unit]

    def _new_unit(self, key: int, parent: Unit, num_blocks: int) -> Unit:
        """A unit of blocks a request held, now cached under `parent`, in use by it."""
        unit = Unit(key, parent, num_blocks)
        if parent.children:  # a second path from here: the node above ends here
            parent.end = True
        parent.children[key] = unit
        self._num_cached_blocks += num_blocks
        unit.num_users = 1
        return unit

    def _touch_path(self, units: list[Unit]) -> None:
        """`units`, a path from the root, are used now (one time for all, as SGLang stamps a
        path); a path ending inside a node splits it there, and the node's part below is
        touched too."""
        self._clock += 1
        now = self._clock
        for unit in units:
            unit.last_use = now
        unit = units[-1]
        if not unit.end:
            unit.end = True
            while True:  # inside a node: one child each, down to the node's end
                (unit,) = unit.children.values()
                unit.last_use = now
                if unit.end:
                    break
        if not unit.num_users and self._is_leaf(unit):  # an evictable leaf, re-ordered
            self._push_leaf(unit)

    def _is_leaf(self, unit: Unit) -> bool:
        """Whether `unit` ends a path of the cache: the leaves are what eviction takes."""
        return not unit.children

    def _share_cached(self, unit: Unit, num_blocks: int) -> None:
        """An insertion meets `unit` already cached: the request shares it and gives back its
        own `num_blocks` blocks of those tokens (`_insert_cache` frees duplicates)."""
        self._use(unit)
        self.num_free_blocks += num_blocks

    def _use(self, unit: Unit) -> None:
        """One more request shares `unit` (if it was unused, its blocks stop being free)."""
        if not unit.num_users:
            self.num_free_blocks -= unit.num_blocks
            self._num_evictable_blocks -= unit.num_blocks
        unit.num_users += 1

    def _release(self, unit: Unit) -> None:
        unit.num_users -= 1
        if unit.num_users:
            return
        self.num_free_blocks += unit.num_blocks
        self._num_evictable_blocks += unit.num_blocks
        if self._is_leaf(unit):
            self._push_leaf(unit)

    def _push_leaf(self, unit: Unit) -> None:
        self._seq += 1
        heapq.heappush(self._leaves, (unit.last_use, self._seq, unit))

    def _take(self, num_blocks: int) -> None:
        """Use `num_blocks` free blocks, evicting unused cached units if the others run out
        (later, when deferred)."""
        self.num_free_blocks -= num_blocks
        if self._deferring:
            self._num_deferred_blocks += num_blocks
        else:
            self._settle()

    def _settle(self) -> None:
        """Evict until the blocks taken are all uncached ones."""
        while self.num_free_blocks < self._num_evictable_blocks:
            self._evict_one()

    def evict_to_free(self, num_blocks: int) -> None:
        """SGLang's `evict_to_free_tokens`: evict unused cached units, least recently used leaf
        first, until `num_blocks` blocks hold nothing or nothing is left to evict."""
        while (self.num_free_blocks - self._num_evictable_blocks < num_blocks
               and self._num_evictable_blocks):
            self._evict_one()

    def evict_before_paged_allocation(self, num_blocks: int) -> None:
        """Inside `deferred_evictions`, after a batch's allocations: evict, least recently
        used leaf first, until `num_blocks` blocks held nothing before those allocations.
        SGLang's paged allocator (pages > 1) evicts for a page more per request of the batch
        than its tokens, before allocating (`mem_cache/allocation.py`
        `alloc_paged_token_slots_extend` 190-202: its tokens plus a page a request;
        `alloc_paged_token_slots_decode` 584-585: a page a request; `evict_to_free_tokens`,
        `allocator/base.py` 155-169); with pages of one token it evicts only what it
        allocates, as `_settle` does."""
        self.evict_to_free(num_blocks - self._num_deferred_blocks)

    @contextmanager
    def deferred_evictions(self) -> Iterator[None]:
        self._deferring = True
        self._num_deferred_blocks = 0
        try:
            yield
        finally:
            self._deferring = False
            self._settle()

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
