"""vLLM 0.33.0's host blocks under ARC (`eviction_policy: arc` in the offloading connector's
extra config: `v1/kv_offload/cpu/manager.py`, `CPUOffloadingManager`, with
`cpu/policies/arc.py`, `ARCCachePolicy`). The same interface as the LRU tier
(`sim.core.offload_lru.RankedTier`), which the connector (`sim.core.offload_jobs`) drives.

- T1 holds blocks stored and not reused since, T2 blocks reused; both least recently used
  first. B1 and B2 remember the hashes evicted from each (at most as many as the tier holds).
- A store inserts its new blocks at T1's recent end (out of B1 and B2). Before that, each
  block a request offers for the first time that the tier lacks is a miss: found in B1 it
  moves ARC's target size for T1 up (by max(1, |B2| / |B1|)), in B2 down.
- When a request finishes, its blocks, tail first: one it only stored goes to the recent end
  of its list; one it reused (loaded, or offered while held and ready, not stored by itself)
  goes from T1 to T2, or to T2's recent end. Lookups change nothing.
- A store short of room evicts: from T1 while T1 holds at least the target, else from T2
  (falling back to T1), the least recent evictable block (no load reading it, stored, not
  offered by the store), each list scanned once; none evicted if not enough are found.
- With a `store_threshold` (`OfferCounts`) a block is stored only once offered that often.
Only hashes and counts are kept: no object per token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from sim.core.offload import TierCounters
from sim.core.offload_lru import PENDING, OfferCounts


@dataclass(slots=True)
class _Access:
    """What one request did to the tier (`_RequestCacheAccess`): the blocks it saw (hash ->
    end position), stored, reused, and the misses ARC has learnt from."""

    seen: dict[int, int] = field(default_factory=dict)
    inserted: set[int] = field(default_factory=set)
    reused: set[int] = field(default_factory=set)
    missed: set[int] = field(default_factory=set)


class ArcTier:
    """The host's blocks under 0.33.0's ARC (module docstring): chain hash -> loads reading
    it (PENDING while stored), in T1 or T2."""

    def __init__(self, num_blocks: int, offers: OfferCounts | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.offers = offers  # (`store_threshold` of 2 or more)
        self.target_t1_size = 0.0
        self._t1: OrderedDict[int, int] = OrderedDict()  # hash -> ref, least recent first
        self._t2: OrderedDict[int, int] = OrderedDict()
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()
        self._num_evictable = 0
        self._access: dict[int, _Access] = {}
        self.counters = TierCounters()

    @property
    def num_used_blocks(self) -> int:
        return len(self._t1) + len(self._t2)

    def state_of(self, block_hash: int) -> int | None:
        """None: not held; PENDING: being stored; else the loads reading it."""
        ref = self._t1.get(block_hash)
        return self._t2.get(block_hash) if ref is None else ref

    def _list_of(self, block_hash: int) -> OrderedDict[int, int]:
        return self._t1 if block_hash in self._t1 else self._t2

    def _record(self, request_id: int, blocks: list[tuple[int, int]],
                reused: list[int]) -> _Access:
        access = self._access.setdefault(request_id, _Access())
        for h, pos in blocks:
            access.seen.setdefault(h, pos)
        access.reused.update(h for h in reused if h not in access.inserted)
        return access

    def prepare_load(self, request_id: int, blocks: list[tuple[int, int]]) -> None:
        """The request loads these (hash, end position) blocks: pinned until `complete_load`."""
        for h, _ in blocks:
            held = self._list_of(h)
            if not held[h]:
                self._num_evictable -= 1
            held[h] += 1
        self._record(request_id, blocks, [h for h, _ in blocks])

    def complete_load(self, hashes: list[int]) -> None:
        for h in hashes:
            held = self._list_of(h)
            held[h] -= 1
            if not held[h]:
                self._num_evictable += 1

    def prepare_store(self, request_id: int, blocks: list[tuple[int, int]]) -> list[int] | None:
        """The request offers these (hash, end position) blocks: the hashes to store (those
        not held), room made by eviction; None if there is not room enough."""
        to_store = [h for h, _ in blocks if self.state_of(h) is None]
        ready = [h for h, _ in blocks if self.state_of(h) not in (None, PENDING)]
        if self.offers is not None:
            to_store = self.offers.admit(blocks, to_store, self.counters)
        access = self._access.setdefault(request_id, _Access())
        misses = [h for h in to_store if h not in access.missed]
        for h in reversed(misses):  # (`on_store_miss`, once per block and request)
            self._learn(h)
        access.missed.update(misses)
        recorded = set(to_store).union(ready)
        self._record(request_id, [(h, pos) for h, pos in blocks if h in recorded], ready)
        if not to_store:
            return to_store
        short = len(to_store) - (self.num_blocks - self.num_used_blocks)
        if short > 0 and (short > self._num_evictable
                          or not self._evict(short, {h for h, _ in blocks})):
            return None
        for h in to_store:
            self._t1[h] = PENDING
            self._b1.pop(h, None)
            self._b2.pop(h, None)
        access.inserted.update(to_store)
        return to_store

    def _learn(self, block_hash: int) -> None:
        """A miss found in a ghost list adapts T1's target (`_adapt_to_ghost_hit`)."""
        b1, b2 = self._b1, self._b2
        if block_hash in b1:
            delta = max(1, len(b2) / len(b1))
            self.target_t1_size = min(self.target_t1_size + delta, self.num_blocks)
            b1.move_to_end(block_hash)
        elif block_hash in b2:
            delta = max(1, len(b1) / len(b2))
            self.target_t1_size = max(self.target_t1_size - delta, 0)
            b2.move_to_end(block_hash)

    def _evict(self, num_blocks: int, protected: set[int]) -> bool:
        """`ARCCachePolicy.evict`: `num_blocks` blocks out, each list scanned once from its
        least recent end; False (and nothing evicted) if there are not so many."""
        def candidates(held: OrderedDict[int, int]) -> Iterator[int]:
            return (h for h, ref in held.items() if ref == 0 and h not in protected)

        t1_left, t2_left = candidates(self._t1), candidates(self._t2)
        chosen: list[tuple[int, bool]] = []  # (hash, from T1)
        virtual_t1_size = len(self._t1)
        for _ in range(num_blocks):
            h = None
            if virtual_t1_size >= int(self.target_t1_size):
                h = next(t1_left, None)
                if h is not None:
                    chosen.append((h, True))
                    virtual_t1_size -= 1
                    continue
            h = next(t2_left, None)
            if h is not None:
                chosen.append((h, False))
                continue
            h = next(t1_left, None)
            if h is None:
                return False
            chosen.append((h, True))
            virtual_t1_size -= 1
        for h, from_t1 in chosen:
            if from_t1:
                del self._t1[h]
                self._b1[h] = None
            else:
                del self._t2[h]
                self._b2[h] = None
        for ghosts in (self._b1, self._b2):
            for _ in range(len(ghosts) - self.num_blocks):
                ghosts.popitem(last=False)
        self._num_evictable -= num_blocks
        self.counters.num_evicted_blocks += num_blocks
        return True

    def complete_store(self, hashes: list[int]) -> None:
        for h in hashes:
            if self.state_of(h) == PENDING:
                self._list_of(h)[h] = 0
                self._num_evictable += 1

    def request_finished(self, request_id: int) -> None:
        """The request's blocks, tail first (`ARCCachePolicy.on_request_finished`): stored
        only, to its list's recent end; reused, into T2's recent end."""
        access = self._access.pop(request_id, None)
        if access is None:
            return
        t1, t2, reused = self._t1, self._t2, access.reused
        seen = access.seen
        for h in sorted(seen, key=seen.__getitem__, reverse=True):
            if h in access.inserted and h not in reused:
                if h in t1:
                    t1.move_to_end(h)
                elif h in t2:
                    t2.move_to_end(h)
            elif h in reused:
                if h in t1:
                    t2[h] = t1.pop(h)
                elif h in t2:
                    t2.move_to_end(h)

    def check(self) -> None:
        t1, t2 = self._t1, self._t2
        assert len(t1) + len(t2) <= self.num_blocks
        assert not t1.keys() & t2.keys() and not self._b1.keys() & self._b2.keys()
        assert not (t1.keys() | t2.keys()) & (self._b1.keys() | self._b2.keys())
        assert len(self._b1) <= self.num_blocks and len(self._b2) <= self.num_blocks
        assert self._num_evictable == sum(not r for r in (*t1.values(), *t2.values()))
        assert 0 <= self.target_t1_size <= self.num_blocks
