"""Decode fast-forward: advance a stretch of identical decode-only iterations in one step.

When every running request decodes and nothing waits, each following iteration is the same plan
until a request arrives, finishes, or needs a KV block that is not free. The stretch is computed
with a few numpy operations whatever its length, and every token still gets its own time:
the cost of a simulation follows its events, not its tokens. Pure: no SimPy, no clock.
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
    """Up to `len(end_s)` decode iterations of the running requests, from `start_s`."""

    requests: list[Request]
    num_computed: np.ndarray  # each request's computed tokens before the stretch
    start_s: float
    duration_s: np.ndarray
    end_s: np.ndarray
    num_used_blocks: int  # KV blocks in use after the first iteration's allocation
    block_size: int

    def __len__(self) -> int:
        return len(self.end_s)

    def steps_done_by(self, now_s: float) -> int:
        """Iterations to commit if the stretch is cut at `now_s`: the one running then completes."""
        return min(len(self.end_s), int(np.searchsorted(self.end_s, now_s, side="left")) + 1)

    def extra_blocks(self, num_steps: int) -> np.ndarray:
        """Blocks added by the end of each of the first `num_steps` iterations: a request needs
        one more at step j when (computed + j - 1) is a multiple of the block size; the first
        step's blocks were allocated by `schedule()`."""
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
                      kv.num_used_blocks, kv.block_size)
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


def commit_stretch(state: ReplicaState, stretch: Stretch, num_steps: int,
                   log: IterationLog) -> list[Request]:
    """Apply the first `num_steps` iterations of `stretch`; return the requests they finished."""
    end = stretch.end_s[:num_steps]
    start = np.concatenate(([stretch.start_s], end[:-1]))
    first_iter = log.extend_decodes(start, stretch.duration_s[:num_steps], len(stretch.requests),
                                    stretch.num_used_blocks + stretch.extra_blocks(num_steps))
    kv = state.kv
    bs = kv.block_size
    computed = stretch.num_computed
    # Blocks held cover computed + 1 tokens (the first step); grow them to computed + num_steps.
    grow = (cdiv_array(computed + num_steps, bs) - cdiv_array(computed + 1, bs)).tolist()
    last_iter = first_iter + num_steps - 1
    finished = []
    for req, num_blocks in zip(stretch.requests, grow, strict=True):
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
    return finished


def cdiv_array(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a // b)

