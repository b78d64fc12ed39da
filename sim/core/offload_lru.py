"""vLLM 0.33.0's host blocks and their eviction (`v1/kv_offload/cpu/manager.py`,
`CPUOffloadingManager`, with `cpu/policies/lru.py`, `LRUCachePolicy`): which chain hashes the
tier holds, which are being stored or read, and which goes first when a store needs room. The
connector around it is `sim.core.offload_jobs`.

- A block is stored pending (not loadable, not evictable) until its job is reported done; a
  load pins the blocks it reads until it is.
- LRU by request: a block's rank is (its request's rank, minus its end position) while
  requests use it (the highest such rank any request gave it); a request's rank is given at
  its first store or load that sees a block new to it. When a request finishes, every block
  it saw gets a fresh rank, tail first, so its head is evicted last. Lookups rank nothing.
- A store evicts the lowest-ranked evictable blocks but never one it offers, and is refused
  (None) if there are not so many.
- With a `store_threshold` (`OfferCounts`) a block is stored only once offered that often.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from sim.core.offload import TierCounters

PENDING = -1  # a block whose store job is not reported done: not loadable, not evictable


class OfferCounts:
    """`store_threshold` (`CPUOffloadingManager._record_accesses`, 0.33.0): how many times
    each block has been offered for storing, held or not; a block the tier lacks is stored
    only from its `threshold`-th offer. Past `max_tracked` blocks the least recently offered
    is forgotten, but never one the offer at hand counts again."""

    def __init__(self, threshold: int, max_tracked: int = 64_000) -> None:
        self.threshold = threshold
        self.max_tracked = max_tracked
        self._counts: OrderedDict[int, int] = OrderedDict()

    def offered(self, hashes: list[int]) -> None:
        counts = self._counts
        num_counted_again = 0
        for h in hashes:
            if h in counts:
                counts.move_to_end(h)
                counts[h] += 1
                num_counted_again += 1
        num_unprotected = len(counts) - num_counted_again
        for h in hashes:
            if h in counts:
                continue
            if len(counts) >= self.max_tracked:
                if num_unprotected == 0:
                    continue
                counts.popitem(last=False)
                num_unprotected -= 1
            counts[h] = 1

    def admit(self, offered: list[tuple[int, int]], to_store: list[int],
              counters: TierCounters) -> list[int]:
        """Count an offer of these (hash, end position) blocks; of `to_store` (those the tier
        lacks), the ones offered often enough, the others counted as skipped."""
        self.offered([h for h, _ in offered])
        counts, threshold = self._counts, self.threshold
        allowed = [h for h in to_store if counts.get(h, 0) >= threshold]
        counters.num_skipped_stores += len(to_store) - len(allowed)
        return allowed


class RankedTier:
    """The host's blocks under 0.33.0's LRU by request (`CPUOffloadingManager` with
    `LRUCachePolicy`): chain hash -> users (PENDING while stored), ranked for eviction."""

    def __init__(self, num_blocks: int, offers: OfferCounts | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.offers = offers  # (`store_threshold` of 2 or more)
        self._ref: dict[int, int] = {}  # chain hash -> loads reading it, or PENDING
        self._rank: dict[int, tuple[int, int]] = {}
        self._evictable: set[int] = set()
        # (rank, hash) of evictable blocks, stale entries skipped (ranks are unique).
        self._heap: list[tuple[tuple[int, int], int]] = []
        self._next_rank = 0
        self._request_rank: dict[int, int] = {}
        # request id -> the blocks it has stored or loaded (hash -> end position), in order
        self._seen: dict[int, dict[int, int]] = {}
        self.counters = TierCounters()

    @property
    def num_used_blocks(self) -> int:
        return len(self._ref)

    def state_of(self, block_hash: int) -> int | None:
        """None: not held; PENDING: being stored; else the loads reading it."""
        return self._ref.get(block_hash)

    def _rank_of(self, request_id: int) -> int:
        rank = self._request_rank.get(request_id)
        if rank is None:
            self._next_rank += 1
            rank = self._request_rank[request_id] = self._next_rank
        return rank

    def _access(self, request_id: int, blocks: list[tuple[int, int]]) -> None:
        """`on_request_access` for the (hash, end position) pairs the request sees first."""
        seen = self._seen.setdefault(request_id, {})
        new = [(h, pos) for h, pos in blocks if h not in seen]
        if not new:
            return
        seen.update(new)
        rank = self._rank_of(request_id)
        for h, pos in new:
            if h not in self._ref:
                continue
            new_rank = (rank, -pos)
            if self._rank[h] >= new_rank:
                continue
            self._rank[h] = new_rank
            if h in self._evictable:
                heapq.heappush(self._heap, (new_rank, h))

    def _make_evictable(self, block_hash: int) -> None:
        self._evictable.add(block_hash)
        heapq.heappush(self._heap, (self._rank[block_hash], block_hash))

    def _evict(self, num_blocks: int, protected: set[int]) -> bool:
        """Evict the `num_blocks` lowest-ranked evictable blocks not `protected`; False (and
        nothing evicted) if there are not so many."""
        heap, ranks, evictable = self._heap, self._rank, self._evictable
        selected: list[tuple[tuple[int, int], int]] = []
        chosen: set[int] = set()
        deferred = []
        while heap and len(selected) < num_blocks:
            entry = heapq.heappop(heap)
            rank, h = entry
            if h not in evictable or ranks.get(h) != rank or h in chosen:
                continue  # stale
            if h in protected:
                deferred.append(entry)
                continue
            selected.append(entry)
            chosen.add(h)
        for entry in deferred:
            heapq.heappush(heap, entry)
        if len(selected) < num_blocks:
            for entry in selected:
                heapq.heappush(heap, entry)
            return False
        for _, h in selected:
            evictable.remove(h)
            del self._ref[h]
            del ranks[h]
        self.counters.num_evicted_blocks += num_blocks
        return True

    def prepare_load(self, request_id: int, blocks: list[tuple[int, int]]) -> None:
        """The request loads these (hash, end position) blocks: pinned until `complete_load`."""
        ref = self._ref
        for h, _ in blocks:
            if not ref[h]:
                self._evictable.remove(h)
            ref[h] += 1
        self._access(request_id, blocks)

    def complete_load(self, hashes: list[int]) -> None:
        ref = self._ref
        for h in hashes:
            ref[h] -= 1
            if not ref[h]:
                self._make_evictable(h)

    def prepare_store(self, request_id: int, blocks: list[tuple[int, int]]) -> list[int] | None:
        """The request offers these (hash, end position) blocks: the hashes to store (those
        not held), room made by eviction; None if there is not room enough."""
        ref, offers = self._ref, self.offers
        to_store = [h for h, _ in blocks if h not in ref]
        if offers is not None:
            to_store = offers.admit(blocks, to_store, self.counters)
        fresh = set(to_store)
        self._access(request_id, [(h, pos) for h, pos in blocks
                                  if h in fresh or ref.get(h, PENDING) != PENDING])
        if not to_store:
            return to_store
        short = len(to_store) - (self.num_blocks - len(ref))
        if short > 0 and (short > len(self._evictable)
                          or not self._evict(short, {h for h, _ in blocks})):
            return None
        rank = self._rank_of(request_id)
        positions = dict(blocks)
        for h in to_store:
            ref[h] = PENDING
            self._rank[h] = (rank, -positions[h])
        return to_store

    def complete_store(self, hashes: list[int]) -> None:
        ref = self._ref
        for h in hashes:
            if ref.get(h) == PENDING:
                ref[h] = 0
                self._make_evictable(h)

    def request_finished(self, request_id: int) -> None:
        """Every block the request saw gets a fresh rank, its tail first: its head is
        evicted last (`on_request_finished`)."""
        self._request_rank.pop(request_id, None)
        seen = self._seen.pop(request_id, None)
        if not seen:
            return
        ranks, ref, evictable = self._rank, self._ref, self._evictable
        for h in sorted(seen, key=seen.__getitem__, reverse=True):
            if h in ref:
                self._next_rank += 1
                ranks[h] = rank = (self._next_rank, 0)
                if h in evictable:
                    heapq.heappush(self._heap, (rank, h))

    def check(self) -> None:
        assert len(self._ref) <= self.num_blocks
        assert self._evictable == {h for h, r in self._ref.items() if r == 0}
        assert set(self._rank) == set(self._ref)
