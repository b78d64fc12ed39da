"""Decode fast-forward: advance a stretch of identical decode-only iterations in one step.

When every running request decodes and nothing waits, each following iteration is the same plan
until a request arrives, finishes, or needs a KV block that is not free. The stretch is computed
with a few numpy operations whatever its length, and every token still gets its own time:
the cost of a simulation follows its events, not its tokens. Pure: no SimPy, no clock.

A stretch can be committed in pieces (whoever looks at the replica mid-stretch sees the
iterations that have ended, as a step-by-step run would show them) and cut short after the
iteration in progress (new work arrived).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from sim.iteration_log import IterationLog
from sim.latency.base import LatencyModel
from sim.request import Request
from sim.state import ReplicaState


@dataclass(frozen=True)
class Stretch:
    """`len(end_s)` decode iterations of `requests`, the first starting at `start_s`; the first
    iteration's KV blocks are allocated (as `schedule()` allocates a plan's)."""

    requests: list[Request]
    num_computed: np.ndarray  # each request's computed tokens before the stretch
    start_s: float
    duration_s: np.ndarray
    end_s: np.ndarray
    num_used_blocks: int  # KV blocks in use after the first iteration's allocation
    block_size: int
    # KV tokens each request's blocks were sized for: computed + 1 once `schedule()` allocated
    # the first iteration, computed after a partial commit (the next iteration allocates).
    num_allocated: np.ndarray

    def __len__(self) -> int:
        return len(self.end_s)

    def num_ended_by(self, now_s: float, *, inclusive: bool = True) -> int:
        """Iterations that have ended by `now_s` (at `now_s` too, if `inclusive`)."""
        return int(np.searchsorted(self.end_s, now_s, side="right" if inclusive else "left"))

    def cut_at(self, now_s: float, *, started_now: bool) -> Stretch | None:
        """The stretch stopped after the iteration in progress at `now_s`; None if none is.
        An iteration starting exactly now is in progress if `started_now` (the replica's
        planning turn at this instant has come: a step-by-step run has planned it)."""
        starts = np.concatenate(([self.start_s], self.end_s[:-1]))
        keep = int(np.searchsorted(starts, now_s, side="right" if started_now else "left"))
        if not keep:
            return None
        return replace(self, duration_s=self.duration_s[:keep], end_s=self.end_s[:keep])

    def extra_blocks(self, num_steps: int) -> np.ndarray:
        """Blocks added by the start of each of the first `num_steps` iterations: a request
        needs one more at step j when (computed + j) is a multiple of the block size; the first
        step's blocks are already allocated."""
        bs = self.block_size
        residue_count = np.bincount(self.num_computed % bs, minlength=bs)
        new_blocks = residue_count[(-np.arange(num_steps)) % bs]
        new_blocks[0] = 0
        return np.cumsum(new_blocks)


def plan_stretch(state: ReplicaState, latency: LatencyModel, start_s: float,
                 horizon_s: float | None) -> Stretch | None:
    """The longest stretch from `start_s`, after `schedule()` allocated its first iteration for
    every running request; None unless every running request is decoding."""
    requests = list(state.running)
    computed = []
    max_steps = 1 << 62
    for r in requests:  # a plain loop: a few requests, called once per stretch
        c, out = r.num_computed_tokens, r.num_output_tokens
        if not out or c != r.num_prompt_tokens + out - 1:
            return None
        computed.append(c)
        # The iteration in which a request samples its last token ends the stretch.
        max_steps = min(max_steps, r.num_target_output_tokens - out)
    num_computed = np.array(computed, dtype=np.int64)
    kv = state.kv
    stretch = Stretch(requests, num_computed, start_s, np.empty(0), np.empty(0),
                      kv.num_used_blocks, kv.block_size, num_computed + 1)
    # Each request adds at most one block per `block_size` steps; only if that could exceed
    # the free blocks is the exact count needed.
    if len(requests) * ((max_steps - 1) // kv.block_size + 1) > kv.num_free_blocks:
        extra = stretch.extra_blocks(max_steps)
        max_steps = min(max_steps, int(np.searchsorted(extra, kv.num_free_blocks, side="right")))

    first_kv_tokens = sum(computed) + len(requests)
    duration = latency.decode_stretch_s(len(requests), first_kv_tokens, max_steps)
    # Sequential accumulation, so each end equals start + duration exactly as one step would be.
    end = np.add.accumulate(np.concatenate(([start_s], duration)))[1:]
    if horizon_s is not None:
        # Iterations after the horizon never complete; keep one so the engine can wait for it.
        keep = max(1, int(np.searchsorted(end, horizon_s, side="right")))
        duration, end = duration[:keep], end[:keep]
    return replace(stretch, duration_s=duration, end_s=end)


def commit_stretch(state: ReplicaState, stretch: Stretch, num_steps: int, log: IterationLog
                   ) -> tuple[list[Request], Stretch | None]:
    """Apply the first `num_steps` iterations of `stretch`. Returns the requests they finished
    and the rest of the stretch (None if nothing is left). KV blocks grow to hold what the
    committed iterations computed; the rest's first iteration allocates its own (as the
    step-by-step run's `schedule()` would, when it plans that iteration)."""
    end = stretch.end_s[:num_steps]
    start = np.concatenate(([stretch.start_s], end[:-1]))
    used = stretch.num_used_blocks + stretch.extra_blocks(num_steps + 1)
    first_iter = log.extend_decodes(start, stretch.duration_s[:num_steps],
                                    len(stretch.requests), used[:num_steps])
    kv = state.kv
    computed = stretch.num_computed + num_steps
    grow = (cdiv_array(computed, kv.block_size)
            - cdiv_array(stretch.num_allocated, kv.block_size)).clip(0)
    last_iter = first_iter + num_steps - 1
    finished = []
    for req, num_blocks in zip(stretch.requests, grow.tolist(), strict=True):
        req.num_computed_tokens += num_steps
        req.num_output_tokens += num_steps
        req.record_token(first_iter)
        req.last_token_iter = last_iter
        if num_blocks:
            kv.grow_blocks(req.request_id, num_blocks)
        if req.num_output_tokens == req.num_target_output_tokens:
            finished.append(req)
    end_s = float(end[-1])
    for req in finished:
        state.finish(req, end_s)
    if num_steps == len(stretch):
        return finished, None
    assert not finished, "a request finished inside a stretch"
    return finished, replace(stretch, num_computed=computed, num_allocated=np.maximum(
                                 computed, stretch.num_allocated), start_s=end_s,
                             duration_s=stretch.duration_s[num_steps:],
                             end_s=stretch.end_s[num_steps:],
                             num_used_blocks=int(used[num_steps]))


def cdiv_array(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a // b)


def allocate_first_step(state: ReplicaState, stretch: Stretch) -> Stretch:
    """KV blocks for the first iteration of `stretch` (as `schedule()` allocates a plan's), if
    not allocated yet; the stretch, knowing they are."""
    if stretch.num_allocated[0] > stretch.num_computed[0]:
        return stretch
    for req in stretch.requests:
        grow = state.kv.num_blocks_to_grow(req, 1)
        if grow:
            state.kv.grow_blocks(req.request_id, grow)
    return replace(stretch, num_allocated=stretch.num_computed + 1)
