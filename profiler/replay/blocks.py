"""Which physical KV blocks hold each request's tokens, kept in lockstep with the scheduler's
block counts (`sim.core.kv_cache.KVCacheManager`, which counts blocks but does not place them).

Every request holds exactly as many blocks here as the scheduler's accounting gives it; they are
freed when it frees them (completion, preemption). Placement keeps a request's blocks contiguous
where it can: with its first block a request claims room for its largest size (prompt plus
output), and others avoid claimed room while unclaimed room is left. Attention then reads a
request's context as one slice of the pool; a request whose blocks ended up scattered is read by
gathering its slots (`Decoder` does both), and the executor counts those.
"""

from __future__ import annotations

import numpy as np

UNCLAIMED = -1


class BlockMap:
    """Physical block ids per request, in token order."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free = np.ones(num_blocks, dtype=bool)
        self.claim = np.full(num_blocks, UNCLAIMED, dtype=np.int64)  # room kept for a request
        self.blocks: dict[int, list[int]] = {}
        self._contiguous: dict[int, bool] = {}

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - int(self.free.sum())

    def num_held(self, request_id: int) -> int:
        return len(self.blocks.get(request_id, ()))

    def contiguous(self, request_id: int) -> bool:
        """Its blocks are consecutive: its KV is one slice of the pool."""
        return self._contiguous.get(request_id, True)

    def grow(self, request_id: int, num_blocks: int, max_blocks: int) -> None:
        """Hold `num_blocks` blocks (the accounting's count); `max_blocks` is its largest size."""
        held = self.blocks.setdefault(request_id, [])
        while len(held) < num_blocks:
            after = held[-1] + 1 if held else self.num_blocks
            if after < self.num_blocks and self.free[after] and self.claim[after] in (
                    UNCLAIMED, request_id):
                block = after
            else:
                block = self._place(request_id, max_blocks - len(held))
                if held:
                    self._contiguous[request_id] = False
            self.free[block] = False
            self.claim[block] = request_id
            held.append(block)

    def release(self, request_id: int) -> None:
        """Free its blocks and the room it claimed (finished or preempted)."""
        for block in self.blocks.pop(request_id, ()):
            self.free[block] = True
        self._contiguous.pop(request_id, None)
        self.claim[self.claim == request_id] = UNCLAIMED

    def _place(self, request_id: int, need: int) -> int:
        """The first block of a new stretch of `need` blocks: the smallest unclaimed free run
        that holds them all, else the longest one (claimed for this request); else any free
        block (taking room another request claimed)."""
        ok = self.free & ((self.claim == UNCLAIMED) | (self.claim == request_id))
        edges = np.diff(np.concatenate(([0], ok.astype(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        if not len(starts):
            free = np.flatnonzero(self.free)
            assert len(free), "no free block: the map is out of step with the accounting"
            return int(free[0])
        lengths = ends - starts
        fits = lengths >= need
        pick = (int(np.argmin(np.where(fits, lengths, np.iinfo(np.int64).max))) if fits.any()
                else int(np.argmax(lengths)))
        start = int(starts[pick])
        self.claim[self.claim == request_id] = UNCLAIMED
        self.claim[start:start + min(need, int(lengths[pick]))] = request_id
        return start
