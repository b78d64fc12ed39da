"""SGLang's hierarchical KV cache (HiCache, `--enable-hierarchical-cache`): its radix tree
(`sim.core.radix_cache`) with host memory as a second tier, as SGLang 0.5.23 keeps it for a
dense model with full attention, no storage backend (paths under `sglang/srt/`; URC is
`mem_cache/unified_radix_cache.py`, UTC `mem_cache/unified_cache/unified_tree_core.py`).

- A unit of the tree is on the GPU, in host memory (`backed`), or both. The host pool holds
  `hicache_ratio` times the GPU pool's tokens, or `hicache_size` GB per rank, plus a page
  (`mem_cache/pool_host/base.py` `HostKVCache.__init__`).
- Write-through (`write_through`, SGLang's default; `write_through_selective`): each insertion
  (`checkpoint`: a prompt's or a chunk's end, a request's release) counts one hit on every
  node of its path past what the request inserted before (`cache_inserted_len`; a match does
  not count), the new leaf included, on the GPU nodes only. A node not yet backed whose hits
  reach the policy's threshold (1; 2 when selective, URC `init_hicache`) is backed up with
  its ancestors not yet backed (UTC `_build_backup_kv_action`), node by node; a node that
  finds no host room even after evicting from the host stops the rest. A backed node counts
  as backed at once, but it and its path stay locked (not evictable) until the copy's ack
  (`writing_check`), which the scheduler takes at its first pass after the copy ended
  (`HostCopy`, timed by the engine: `sim.engine.hicache`).
- Write-back (`write_back`): an insertion counts no hit and backs nothing up (UTC
  `_inc_hit_count_and_check`, `_should_backup_after_insert`); a node is backed up only when
  GPU eviction takes it, below.
- GPU eviction takes unlocked nodes with no child on the GPU (host-only children do not
  count), least recently used first (UTC `_is_device_leaf`): a backed one leaves the GPU and
  stays in the tree, host-only; one not backed is dropped (`evict_device_leaf`), or, with
  write_back, backed up first, that node alone (not its ancestors: `_build_backup_kv_action`
  `write_back=True`), host room made as for any backup, and the scheduler waits for the copy
  before it leaves the GPU (URC `_evict_components`: `_execute_and_commit_kv_backup`, then
  `writing_check(write_back=True)`, blocking, then `_demote`; the copy's time:
  `sim.engine.hicache`); its parent, a GPU leaf now, may follow in the same walk. A node the
  host cannot take is dropped, with the host-only nodes below it (UTC `drop_subtree_no_host`).
- With write_back the host room a backup needs comes first from the host copies of nodes
  also on the GPU (UTC `drive_host_eviction` -> `_reclaim_full_host_duplicates`): in the
  order they became so (`full_host_duplicates`: at a write-back's ack, just before the node
  leaves the GPU; at a load's ack, each load's deepest node first, `finish_load_back`; when an
  insertion gives a host-only node its GPU copy back), an entry staying, and its place, until a
  reclaim walks past it stale (`setdefault`; swept lazily); a first pass spares the GPU's
  evictable leaves, a second does not; nodes still loading are skipped. The node stays on the
  GPU, no longer backed (written again if evicted). Then host-only leaves, as below.
- Host eviction, only when a backup needs room: host-only nodes with no children at all,
  least recently used first, leave the tree (UTC `_is_host_leaf`, `evict_host`); not the
  one a load-back being admitted holds (`_lock_node(..., lock_host=True)`,
  `inc_host_lock_ref`: its evictions may back nodes up with write_back).
- A match walks GPU and host nodes (a match touches host-only nodes too): the GPU part is the
  prefix hit; the host part behind it is loaded back at admission (`init_load_back`) if it
  is at least `LOAD_BACK_THRESHOLD_TOKENS` and the GPU has room for it after eviction (the
  request's own prefix locked meanwhile); else it is computed again. Loaded nodes are on the
  GPU at once and count as prefix in the same batch; they and their path stay locked until
  the load's ack (`loading_check`), as the engine's copy runs beside the batch's forward.
- An insertion that meets a host-only node it computed again gives it its GPU copy back with
  no copy (UTC `_unevict_node_on_insert`).

With speculative decoding the tree is the same (`UnifiedRadixCache` serves both), keyed by
token pairs for the EAGLE family (`bigram_keys`, host-only nodes too: a host hit is counted in
those keys, `mem_cache/unified_radix_cache.py` `cache_unfinished_req`'s `is_bigram`), and the
scheduler's rules compose unchanged: the decode step's top-ups and retractions evict through
`evict_to_free` (a backed node leaves the GPU and stays in the tree), a retracted request's
counts start again (`reset_for_retract`); only a decode server backs a retracted request's KV
up (`managers/schedule_batch.py` `release_req`, disaggregated: not modelled). The drafter's
KV rides with the target's copies (`sim.engine.hicache`).

Not modelled: storage backends (L3), host
auto-sizing below the ratio for lack of host memory (`hicache_auto_size`: the host is assumed
large enough), a standalone draft model's host pool (its KV's size is not known),
disaggregated decode servers.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from sim.core.radix_cache import PrefixCachingKVManager, Unit
from sim.core.request import Request

# Host hits shorter than this are computed again, not loaded (URC: `load_back_threshold`).
LOAD_BACK_THRESHOLD_TOKENS = 10

# Hits an insertion counts before a node is backed up, by write policy (URC `init_hicache`);
# write_back backs a node up only when it is evicted from the GPU (no threshold).
WRITE_THRESHOLDS = {"write_through": 1, "write_through_selective": 2}
WRITE_POLICIES = (*WRITE_THRESHOLDS, "write_back")


@dataclass(slots=True)
class HostCopy:
    """One merged copy between the GPU and host memory: its blocks, and the units it keeps
    locked until its ack (`locked`, a path from the root, each counted once)."""

    num_blocks: int
    locked: list[Unit] = field(default_factory=list)
    # A load's: each request's units loaded, in order (write_back: duplicates at the ack).
    loaded: list[list[Unit]] = field(default_factory=list)


@dataclass(slots=True)
class HostCounters:
    """What a hierarchical cache did over a run (the summary's `kv_offload`)."""

    num_lookups: int = 0  # admissions that found a host hit
    num_hit_requests: int = 0  # loads (a request loaded back, each admission)
    num_hit_tokens: int = 0  # tokens loaded back
    num_first_hit_tokens: int = 0  # ... at a request's first admission
    num_loaded_blocks: int = 0
    num_stored_blocks: int = 0  # blocks backed up to the host
    num_evicted_blocks: int = 0  # blocks evicted from the host
    num_refused_stores: int = 0  # backups that found no host room
    num_delayed_lookups: int = 0  # (vLLM's tier's; none here)


class HierarchicalCache(PrefixCachingKVManager):
    """SGLang's radix cache with a host tier (module docstring). `num_host_blocks`: the host
    pool, in the GPU's blocks; `write_threshold`: hits before a node is backed up
    (write-through); `write_back`: backed up at its GPU eviction instead."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int,
                 write_threshold: int = 1, *, write_back: bool = False) -> None:
        super().__init__(num_blocks, block_size)
        self.num_host_blocks = num_host_blocks
        self.num_host_used_blocks = 0
        self.write_threshold = write_threshold
        self.write_back = write_back
        # write_back: the blocks of each synchronous backup made since the engine last took
        # them (`take_sync_writes`), in order; nodes on the GPU and in host memory (by their
        # last unit, in the order they became so: `full_host_duplicates`), reclaimed first
        # when the host needs room.
        self._sync_writes: list[int] = []
        self._dups: dict[Unit, None] = {}
        self._host_leaves: list[tuple[int, int, Unit]] = []  # (last_use, seq, unit)
        # request id -> the units of its path its insertions have counted (`cache_inserted_len`)
        self._num_counted: dict[int, int] = {}
        self._writes: list[HostCopy] = []  # backups queued since the last flush
        self._loading: set[Unit] = set()  # units loaded, their load not acknowledged yet
        self._pinned: Unit | None = None  # a host leaf a load-back holds (not evictable)
        self._load: HostCopy | None = None  # loads queued this pass (one merged copy)
        self.counters = HostCounters()

    # -- lookups --------------------------------------------------------------------------

    @staticmethod
    def _num_on_gpu(units: list[Unit]) -> int:
        """How many of a path's units are on the GPU: they come first (eviction takes a
        node only once no child is on the GPU)."""
        n = 0
        for unit in units:
            if not unit.on_device:
                break
            n += 1
        return n

    def prefix_hit_tokens(self, req: Request) -> int:
        units = self._match(req)
        return self._hit_tokens(units[:self._num_on_gpu(units)])

    def unused_prefix_tokens(self, req: Request) -> int:
        units = self._match(req)
        return sum(u.num_blocks for u in units[:self._num_on_gpu(units)]
                   if not u.num_users) * self.block_size

    def match_prefix(self, req: Request) -> int:
        units = self._match(req)
        if units:
            self._touch_path(units)  # (the host-only part too)
        return self._hit_tokens(units[:self._num_on_gpu(units)])

    def host_hit_tokens(self, req: Request) -> int:
        """Tokens of `req`'s match held only in host memory, behind its GPU hit."""
        units = self._match(req)
        return self._hit_tokens(units[self._num_on_gpu(units):])

    # -- loading back -----------------------------------------------------------------------

    def load_back(self, req: Request) -> int:
        """`init_load_back` at `req`'s admission: load its host hit to the GPU if it is long
        enough and room can be made (evicting, its own prefix locked); return the tokens
        loaded (0: none, to be computed again)."""
        units = self._match(req)
        n = self._num_on_gpu(units)
        host = units[n:]
        num_tokens = self._hit_tokens(host)
        if not host:
            return 0
        self.counters.num_lookups += 1
        if num_tokens < LOAD_BACK_THRESHOLD_TOKENS:
            return 0
        num_blocks = sum(u.num_blocks for u in host)
        gpu = units[:n]
        for unit in gpu:  # (the request's prefix, locked while room is made)
            self._use(unit)
        # (Its host part too: write_back's backups may evict from the host meanwhile.)
        self._pinned = host[-1]
        self.evict_to_free(num_blocks)
        self._pinned = None
        if self.num_free_blocks - self._num_evictable_blocks < num_blocks:
            for unit in gpu:
                self._release(unit)
            return 0
        for unit in host:
            unit.on_device = True
            unit.num_users = 1  # locked until the load's ack, as is the prefix above it
        self._num_cached_blocks += num_blocks
        self.num_free_blocks -= num_blocks
        load = self._load
        if load is None:
            load = self._load = HostCopy(0)
        load.num_blocks += num_blocks
        load.locked += units
        load.loaded.append(host)
        self._loading.update(host)
        counters = self.counters
        counters.num_hit_requests += 1
        counters.num_hit_tokens += num_tokens
        counters.num_loaded_blocks += num_blocks
        if req.first_scheduled_s is None and not req.num_preemptions:
            counters.num_first_hit_tokens += num_tokens
        return num_tokens

    def take_load(self) -> HostCopy | None:
        """The loads queued this pass, as one copy (`ready_to_load_host_cache`)."""
        load, self._load = self._load, None
        return load

    def take_writes(self) -> HostCopy | None:
        """The backups queued since the last flush, as one copy (`flush_pending_backups`)."""
        if not self._writes:
            return None
        copy = HostCopy(sum(c.num_blocks for c in self._writes),
                        [u for c in self._writes for u in c.locked])
        self._writes = []
        return copy

    def take_sync_writes(self) -> list[int]:
        """write_back: the blocks of each backup made at an eviction since the last call, in
        order (each copied while the scheduler waits: `writing_check(write_back=True)`)."""
        writes, self._sync_writes = self._sync_writes, []
        return writes

    def ack(self, copy: HostCopy) -> None:
        """A copy's ack (`writing_check`, `loading_check`): its units are unlocked; with
        write_back, the nodes a load brought back are duplicates from now (UTC
        `finish_load_back`: each load's, its deepest node first)."""
        for unit in copy.locked:
            self._release(unit)
        for host in copy.loaded:
            self._loading.difference_update(host)
            if self.write_back:
                for unit in reversed(host):
                    if unit.end and unit.parent is not None:
                        self._dups.setdefault(unit, None)

    # -- insertion and backup ---------------------------------------------------------------

    def _insert(self, req: Request, num_tokens: int, *, release: bool = False) -> list[Unit]:
        rest = super()._insert(req, num_tokens, release=release)
        rid = req.request_id
        path = self._units.get(rid, [])
        if rest:
            path = [*path, *rest]
        counted = self._num_counted.get(rid, 0)
        if len(path) > counted and not self.write_back:  # (UTC `_inc_hit_count_and_check`)
            self._count_hits(path, counted)
            self._num_counted[rid] = len(path)
        return rest

    def _count_hits(self, path: list[Unit], start: int) -> None:
        """An insertion walked `path` (from the root): each GPU node from `start` on counts a
        hit; nodes reaching the threshold are backed up with their ancestors not backed."""
        threshold = self.write_threshold
        last = -1  # the deepest unit to back up
        for i in range(start, len(path)):
            unit = path[i]
            if unit.on_device:
                unit.hit_count += 1
                if not unit.backed and unit.hit_count >= threshold:
                    last = i
        if last < 0:
            return
        # Node by node (a node ends at a unit marked `end`), ancestors first.
        deepest = -1
        i = 0
        while i <= last:
            j = i
            while not path[j].end and j + 1 < len(path):
                j += 1
            node = path[i:j + 1]
            if not node[0].backed:
                num_blocks = sum(u.num_blocks for u in node)
                if not self._host_room(num_blocks):
                    self.counters.num_refused_stores += 1
                    break
                for unit in node:
                    unit.backed = True
                self.num_host_used_blocks += num_blocks
                self.counters.num_stored_blocks += num_blocks
                self._writes.append(HostCopy(num_blocks))
                deepest = j
            i = j + 1
        if deepest >= 0:  # locked until the ack: the path down to the deepest backed node
            locked = path[:deepest + 1]
            for unit in locked:
                self._use(unit)
            self._writes[-1].locked = locked

    def _host_room(self, num_blocks: int) -> bool:
        """Whether the host pool has `num_blocks` free, after evicting host-only leaves (with
        write_back, the host copies of nodes on the GPU first: `_reclaim_duplicates`)."""
        short = num_blocks - (self.num_host_blocks - self.num_host_used_blocks)
        if short > 0:
            if self.write_back:
                short -= self._reclaim_duplicates(short)
            if short > 0:
                self._evict_host(short)
        return self.num_host_used_blocks + num_blocks <= self.num_host_blocks

    def _node_of(self, unit: Unit) -> list[Unit]:
        """The units of the node `unit` ends (or is in), from `unit` up."""
        units = [unit]
        root = self.root
        while (parent := units[-1].parent) is not root and parent is not None and not parent.end:
            units.append(parent)
        return units

    def _reclaim_duplicates(self, num_blocks: int) -> int:
        """write_back: free the host copies of nodes also on the GPU, in the order they became
        so, until `num_blocks` are freed; first sparing the GPU's evictable leaves (about to be
        evicted, they would be written back again), then not; none being loaded (UTC
        `_reclaim_full_host_duplicates`). A node's entry stays when it leaves the GPU until a
        reclaim walks past it (`full_host_duplicates` is cleaned lazily). Return the blocks
        freed."""
        freed = 0
        swept: list[Unit] = []
        dups = self._dups
        for spare_leaves in (True, False):
            for unit in dups:
                if freed >= num_blocks:
                    break
                if unit.parent is None or not unit.on_device or not unit.backed:
                    swept.append(unit)  # stale: gone, or in one tier only
                    continue
                if spare_leaves and not unit.num_users and self._is_leaf(unit):
                    continue
                if unit in self._loading:
                    continue
                node = self._node_of(unit)
                n = sum(u.num_blocks for u in node)
                for u in node:
                    u.backed = False
                self.num_host_used_blocks -= n
                self.counters.num_evicted_blocks += n
                freed += n
                swept.append(unit)
            if freed >= num_blocks:
                break
        for unit in swept:
            dups.pop(unit, None)
        return freed

    def _write_back(self, leaf: Unit) -> None:
        """write_back at the GPU eviction of `leaf`'s node, not backed up: back the node (only
        it) up, making host room; the scheduler waits for the copy (URC `_evict_components`,
        `_execute_and_commit_kv_backup(write_back=True)`, `writing_check(write_back=True)`).
        With no room the node is dropped, and its host-only nodes below it with it (UTC
        `drop_subtree_no_host`)."""
        node = self._node_of(leaf)
        num_blocks = sum(u.num_blocks for u in node)
        if self._host_room(num_blocks):
            for unit in node:
                unit.backed = True
            self.num_host_used_blocks += num_blocks
            self.counters.num_stored_blocks += num_blocks
            self._sync_writes.append(num_blocks)
            self._dups.setdefault(leaf, None)  # (at the ack, before it leaves the GPU)
            return
        self.counters.num_refused_stores += 1
        stack = list(leaf.children.values())
        while stack:
            unit = stack.pop()
            assert not unit.on_device and not unit.num_users and unit is not self._pinned
            stack.extend(unit.children.values())
            unit.parent = None
            self.num_host_used_blocks -= unit.num_blocks
        leaf.children = {}

    def _own_nodes(self, own: int, parent: Unit, num_blocks: int) -> list[Unit]:
        """A retracted request computed again what it had cached of its own, which may be in
        host memory only (evicted from the GPU, and not loaded back: too short, or no room):
        the insertion meets those nodes and gives them their GPU copy back with no copy (UTC
        `_unevict_node_on_insert`), splitting the last where the insertion ends inside it
        (`_split_node`); what lies past them is a new node."""
        nodes: list[Unit] = []
        while num_blocks > 0 and (unit := parent.children.get(own)) is not None:
            assert not unit.on_device and not unit.num_users, "its own GPU nodes were matched"
            if unit.num_blocks > num_blocks:  # split: the part below stays in host memory
                below = Unit(own, unit, unit.num_blocks - num_blocks)
                below.children, unit.children = unit.children, {own: below}
                for child in below.children.values():
                    child.parent = below
                below.backed, below.on_device, below.end = True, False, unit.end
                below.last_use, below.hit_count = unit.last_use, unit.hit_count
                unit.num_blocks = num_blocks
                if not below.children:
                    self._push_leaf(below)
            unit.on_device, unit.num_users, unit.end = True, 1, True
            self._num_cached_blocks += unit.num_blocks
            if self.write_back:  # (a duplicate at once)
                self._dups.setdefault(unit, None)
            num_blocks -= unit.num_blocks
            nodes.append(unit)
            parent = unit
        if num_blocks > 0:
            nodes += super()._own_nodes(own, parent, num_blocks)
        return nodes

    def _share_cached(self, unit: Unit, num_blocks: int) -> None:
        if unit.on_device:
            super()._share_cached(unit, num_blocks)
            return
        # Host-only, computed again: the request's blocks are its GPU copy (no copy made);
        # with write_back a duplicate at once (UTC `_unevict_node_on_insert`).
        unit.on_device = True
        unit.num_users += 1
        self._num_cached_blocks += num_blocks
        if self.write_back and unit.end:
            self._dups.setdefault(unit, None)

    def free(self, req: Request, *, preempted: bool = False) -> None:
        super().free(req, preempted=preempted)
        self._num_counted.pop(req.request_id, None)  # (`reset_for_retract` too)

    # -- eviction ---------------------------------------------------------------------------

    def _touch_path(self, units: list[Unit]) -> None:
        super()._touch_path(units)
        # A path may go on into host-only nodes: its last GPU unit may be a GPU leaf,
        # re-ordered by the touch too.
        n = self._num_on_gpu(units)
        if 0 < n < len(units):
            unit = units[n - 1]
            if not unit.num_users and self._is_leaf(unit):
                self._push_leaf(unit)

    def _is_leaf(self, unit: Unit) -> bool:
        if unit.on_device:  # (host-only children do not count)
            return not any(c.on_device for c in unit.children.values())
        return not unit.children

    def _push_leaf(self, unit: Unit) -> None:
        if unit.on_device:
            super()._push_leaf(unit)
            return
        self._seq += 1
        heapq.heappush(self._host_leaves, (unit.last_use, self._seq, unit))

    def _evict_one(self) -> None:
        """Evict the least recently used GPU leaf node, whole: off the GPU if backed (it
        stays in the tree), else out of the tree."""
        while True:
            last_use, _, unit = heapq.heappop(self._leaves)
            if (unit.on_device and not unit.num_users and last_use == unit.last_use
                    and unit.parent is not None and self._is_leaf(unit)):
                break
        if self.write_back and not unit.backed:
            self._write_back(unit)
        leaf = unit
        root = self.root
        while True:
            parent = unit.parent
            assert parent is not None
            if unit.backed:
                unit.on_device = False
                self._num_cached_blocks -= unit.num_blocks
                self._num_evictable_blocks -= unit.num_blocks
                self.num_evicted_blocks += unit.num_blocks
            else:
                assert not unit.children, "a child is backed only with its ancestors"
                self._drop(unit)
            if parent is root or parent.end or parent.num_users or not parent.on_device:
                break
            unit = parent
        if leaf.parent is not None and not leaf.children:
            self._push_leaf(leaf)  # a host-only leaf now
        if parent is not root and not parent.num_users and self._is_leaf(parent):
            self._push_leaf(parent)

    def _evict_host(self, num_blocks: int) -> None:
        """`evict_host`: drop host-only leaf nodes, least recently used first, until
        `num_blocks` are free or none is left."""
        root = self.root
        freed = 0
        leaves = self._host_leaves
        pinned = None
        while freed < num_blocks and leaves:
            last_use, _, unit = heapq.heappop(leaves)
            if (unit.on_device or unit.parent is None or unit.children
                    or last_use != unit.last_use):
                continue  # stale
            if unit is self._pinned:  # (held by a load-back: back in the heap after)
                pinned = unit
                continue
            while True:
                parent = unit.parent
                assert parent is not None
                del parent.children[unit.key]
                unit.parent = None
                self.num_host_used_blocks -= unit.num_blocks
                self.counters.num_evicted_blocks += unit.num_blocks
                freed += unit.num_blocks
                if (parent is root or parent.end or parent.children or parent.on_device):
                    break
                unit = parent
            if parent is not root and not parent.on_device and not parent.children:
                self._push_leaf(parent)
        if pinned is not None:
            self._push_leaf(pinned)

    # -- checks -----------------------------------------------------------------------------

    def check(self) -> None:
        super().check()
        num_host = 0
        stack = list(self.root.children.values())
        while stack:
            unit = stack.pop()
            assert unit.on_device or unit.backed, "a unit off the GPU is in host memory"
            parent = unit.parent
            assert parent is self.root or parent is not None and (
                parent.on_device or not unit.on_device), "the GPU holds a path's first units"
            if unit.backed:
                num_host += unit.num_blocks
            stack.extend(unit.children.values())
        assert num_host == self.num_host_used_blocks <= self.num_host_blocks
