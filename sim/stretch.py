"""Decode fast-forward: advance a stretch of identical decode-only iterations in one step.

When every running request decodes and nothing waits, each following iteration is the same plan
until a request arrives, finishes, or needs a KV block that is not free. The stretch is computed
with a few numpy operations whatever its length, and every token still gets its own time:
the cost of a simulation follows its events, not its tokens. Pure: no SimPy, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    num_kv_blocks_used: np.ndarray  # after each iteration's allocation

    def __len__(self) -> int:
        return len(self.end_s)

    def steps_done_by(self, now_s: float) -> int:
        """Iterations to commit if the stretch is cut at `now_s`: the one running then completes."""
        return min(len(self.end_s), int(np.searchsorted(self.end_s, now_s, side="left")) + 1)


def plan_stretch(state: ReplicaState, latency: LatencyModel, start_s: float,
                 horizon_s: float | None) -> Stretch | None:
    """The longest stretch from `start_s`, after `schedule()` allocated its first iteration for
    every running request; None unless every running request is decoding."""
    requests = list(state.running)
    counters = np.array(
        [(r.num_prompt_tokens, r.num_output_tokens, r.num_computed_tokens,
          r.num_target_output_tokens) for r in requests], dtype=np.int64).reshape(-1, 4)
    prompt, output, num_computed, target = counters.T
    if not ((output > 0) & (num_computed == prompt + output - 1)).all():
        return None
    # The iteration in which a request samples its last token ends the stretch.
    max_steps = int((target - output).min())

    # A request needs a new block at step j when (computed + j - 1) is a multiple of the block
    # size; the first step's blocks are already allocated.
    kv = state.kv
    bs = kv.block_size
    residue_count = np.bincount(num_computed % bs, minlength=bs)
    new_blocks = residue_count[(-np.arange(max_steps)) % bs]
    new_blocks[0] = 0
    extra = np.cumsum(new_blocks)
    max_steps = min(max_steps, int(np.searchsorted(extra, kv.num_free_blocks, side="right")))
    num_kv_blocks_used = kv.num_used_blocks + extra[:max_steps]

    first_kv_tokens = int(num_computed.sum()) + len(requests)
    duration = latency.decode_stretch_s(len(requests), first_kv_tokens, max_steps)
    # Sequential accumulation, so each end equals start + duration exactly as one step would be.
    end = np.add.accumulate(np.concatenate(([start_s], duration)))[1:]
    if horizon_s is not None:
        # Iterations after the horizon never complete; keep one so the engine can wait for it.
        keep = max(1, int(np.searchsorted(end, horizon_s, side="right")))
        duration, end, num_kv_blocks_used = duration[:keep], end[:keep], num_kv_blocks_used[:keep]
    return Stretch(requests, num_computed, start_s, duration, end, num_kv_blocks_used)


def commit_stretch(state: ReplicaState, stretch: Stretch, num_steps: int,
                   log: IterationLog) -> list[Request]:
    """Apply the first `num_steps` iterations of `stretch`; return the requests they finished."""
    end = stretch.end_s[:num_steps]
    start = np.concatenate(([stretch.start_s], end[:-1]))
    first_iter = log.extend_decodes(start, stretch.duration_s[:num_steps], len(stretch.requests),
                                    stretch.num_kv_blocks_used[:num_steps])
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

