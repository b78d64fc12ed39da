"""Decode fast-forward: advance a stretch of identical decode-only iterations in one step.

When every running request decodes and nothing waits, each following iteration is the same plan
(less the requests that have finished) until a request arrives or needs a KV block that is not
free. The stretch is computed with a few numpy operations whatever its length, and every token
still gets its own time: the cost of a simulation follows its events, not its tokens. Pure: no
SimPy, no clock.

A stretch can be committed in pieces (whoever looks at the replica mid-stretch sees the
iterations that have ended, as a step-by-step run would show them) and cut short after the
iteration in progress (new work arrived).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sim.iteration_log import IterationLog
from sim.latency.base import BatchShape, LatencyModel
from sim.noise import IterationNoise
from sim.plan import Plan
from sim.request import Request
from sim.state import ReplicaState


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 3x, on a hot path
class Stretch:
    """`len(end_s)` decode iterations of `requests`; the first iteration's KV blocks are
    allocated (as `schedule()` allocates a plan's). Per-iteration arrays are computed once, when
    the stretch is planned; committing or cutting it takes slices."""

    requests: list[Request]
    num_computed: np.ndarray  # each request's computed tokens before the stretch
    starts_s: np.ndarray  # each iteration's start
    duration_s: np.ndarray
    end_s: np.ndarray
    num_used_blocks: int  # KV blocks in use during the first iteration (its blocks allocated)
    block_size: int
    # KV tokens each request's blocks were sized for: computed + 1 once `schedule()` allocated
    # the first iteration, computed after a partial commit (the next iteration allocates).
    num_allocated: np.ndarray
    # Iterations of the stretch each request is in: it samples its last token in the last one
    # (at least `len(self)` for a request that does not finish in the stretch).
    num_steps_left: np.ndarray
    # `num_steps_left.min()` as a plain int: read at every commit and every router look, where
    # a numpy reduction costs more than the rest of the test.
    min_steps_left: int
    # Requests preempted while the first iteration was planned (a policy may preempt one and,
    # with a prefix cache, take it back at once for its one uncomputed token): logged with that
    # iteration, as a step-by-step run logs them; 0 once it is committed.
    num_preempted: int = 0

    def __len__(self) -> int:
        return len(self.end_s)

    @property
    def start_s(self) -> float:
        return float(self.starts_s[0])

    def num_ended_by(self, now_s: float, *, inclusive: bool = True) -> int:
        """Iterations that have ended by `now_s` (at `now_s` too, if `inclusive`)."""
        if now_s < self.end_s[0]:  # most reads, at a cost far below a search's
            return 0
        return int(self.end_s.searchsorted(now_s, side="right" if inclusive else "left"))

    def cut_at(self, now_s: float, *, started_now: bool) -> Stretch | None:
        """The stretch stopped after the iteration in progress at `now_s`; None if none is.
        An iteration starting exactly now is in progress if `started_now` (the replica's
        planning turn at this instant has come: a step-by-step run has planned it)."""
        keep = int(self.starts_s.searchsorted(now_s, side="right" if started_now else "left"))
        if not keep:
            return None
        return Stretch(self.requests, self.num_computed, self.starts_s[:keep],
                       self.duration_s[:keep], self.end_s[:keep], self.num_used_blocks,
                       self.block_size, self.num_allocated, self.num_steps_left,
                       self.min_steps_left, self.num_preempted)

    def ended_counts(self, num_steps: int) -> tuple[int, int, int]:
        """What committing the first `num_steps` iterations would do to the replica's counts,
        without committing them (a router reads every replica at every arrival; committing a
        stretch in pieces costs a piece's arrays each time): tokens sampled, requests finished,
        and the known tokens (prompt plus output) those requests leave with."""
        if num_steps < self.min_steps_left:
            return num_steps * len(self.requests), 0, 0
        left = self.num_steps_left
        gone = left <= num_steps
        # A decoding request knows one token more than it has computed.
        leave_tokens = self.num_computed[gone] + 1 + left[gone]
        return (int(np.minimum(left, num_steps).sum()), int(gone.sum()),
                int(leave_tokens.sum()))


def extra_blocks(num_computed: np.ndarray, block_size: int, num_steps: int) -> np.ndarray:
    """Blocks added by the start of each of the first `num_steps` decode iterations of requests
    with `num_computed` tokens: a request needs one more at step j when (computed + j) is a
    multiple of the block size; the first step's blocks are already allocated."""
    # Blocks added at steps 1..block_size (one period): a request whose residue is r adds one
    # at step (block_size - r), or block_size for r = 0; every later period adds one each.
    steps_to_block = block_size - num_computed % block_size
    period = np.bincount(steps_to_block, minlength=block_size + 1)[1:].cumsum()
    steps = np.arange(num_steps)
    whole, part = np.divmod(steps, block_size)
    extra = whole * len(num_computed) + np.concatenate(([0], period[:-1]))[part]
    return extra
def is_steady(state: ReplicaState, plan: Plan) -> bool:
    """Whether, until a request arrives, finishes or needs a KV block that is not free, every
    following plan repeats `plan`, whatever the policy: nothing waits, so there is nothing to
    admit or to choose between, and every running request computes one token, which (checked by
    `plan_stretch`) is its decode. Any policy that schedules each running decode while nothing
    waits, as every engine does, gets the fast-forward without knowing of it."""
    return (not state.waiting and plan.num_seqs == len(state.running)
            and plan.total_num_scheduled_tokens == plan.num_seqs)


def plan_stretch(state: ReplicaState, latency: LatencyModel, start_s: float,
                 horizon_s: float | None, *, through_finishes: bool = False,
                 noise: IterationNoise | None = None, first_index: int = 0,
                 max_steps: int | None = None, num_preempted: int = 0) -> Stretch | None:
    """The longest stretch from `start_s`, after `schedule()` allocated its first iteration for
    every running request; None unless every running request is decoding. It ends when the
    first request finishes, or, `through_finishes`, when the last does (the batch shrinks as
    requests leave: with nothing waiting, nothing takes their place until work arrives), and
    after `max_steps` iterations at most (where it ends, the replica plans again, as at any
    iteration: any shorter stretch gives the same results). `num_preempted`: requests the
    plan of its first iteration preempted."""
    requests = list(state.running)
    computed = []
    left = []
    for r in requests:  # a plain loop: a few requests, called once per stretch
        if not r.is_decoding:
            return None
        computed.append(r.num_computed_tokens)
        # The iteration in which a request samples its last token is its last.
        left.append(r.num_target_output_tokens - r.num_output_tokens)
    num_computed = np.array(computed, dtype=np.int64)
    num_steps_left = np.array(left, dtype=np.int64)
    longest = max(left) if through_finishes else min(left)
    max_steps = longest if max_steps is None else min(longest, max_steps)
    kv = state.kv
    # The stretch stops before the blocks run out, counting every request's growth as if none
    # finished (freed blocks are not counted on: the stretch may stop early, never late). Each
    # request adds at most one block per `block_size` steps; only if that could exceed the
    # free blocks is the exact count needed (the log's per-iteration counts are taken when
    # iterations are committed: most stretches are cut short by new work).
    if len(requests) * ((max_steps - 1) // kv.block_size + 1) > kv.num_free_blocks:
        extra = extra_blocks(num_computed, kv.block_size, max_steps)
        max_steps = min(max_steps, int(np.searchsorted(extra, kv.num_free_blocks, side="right")))

    # One call on arrays of shapes: a latency model is element-wise, so this is exactly what
    # `max_steps` calls on one shape each would give.
    num_seqs, kv_tokens = batch_sizes(num_computed, num_steps_left, max_steps, min(left))
    duration = latency.iteration_time_s(BatchShape.decode_only(num_seqs, kv_tokens))
    if not isinstance(duration, np.ndarray) or duration.shape != (max_steps,):
        duration = np.broadcast_to(np.asarray(duration, dtype=np.float64), (max_steps,))
    if noise is not None:  # iteration `first_index + j`'s own factor, as a step would get it
        duration = duration * noise.factors_from(first_index, max_steps, 0, num_seqs)
    # Sequential accumulation, so each end equals start + duration exactly as one step would be.
    bounds = np.add.accumulate(np.concatenate(([start_s], duration)))
    starts, end = bounds[:-1], bounds[1:]
    if horizon_s is not None and end[-1] > horizon_s:
        # Iterations after the horizon never complete; keep one so the engine can wait for it.
        max_steps = max(1, int(np.searchsorted(end, horizon_s, side="right")))
        starts, duration, end = starts[:max_steps], duration[:max_steps], end[:max_steps]
    return Stretch(requests, num_computed, starts, duration, end, kv.num_used_blocks,
                   kv.block_size, num_computed + 1, num_steps_left, min(left), num_preempted)


def batch_sizes(num_computed: np.ndarray, num_steps_left: np.ndarray, num_steps: int,
                min_steps_left: int | None = None) -> tuple[Any, np.ndarray]:
    """Requests decoding in each of `num_steps` iterations (one number if none leaves before
    the last), and the KV tokens their attention reads: each request's computed tokens + 1 at
    step 0, one more each step, while it is in the batch. `min_steps_left`, the least of
    `num_steps_left`, if the caller knows it."""
    n = len(num_computed)
    if min_steps_left is None:
        min_steps_left = int(num_steps_left.min())
    if min_steps_left >= num_steps:
        first = int(num_computed.sum()) + n
        return n, np.arange(first, first + n * num_steps, n, dtype=np.int64)
    steps = np.arange(num_steps, dtype=np.int64)
    order = np.argsort(num_steps_left, kind="stable")
    # Requests gone by step j: those whose last step is before j.
    gone = np.searchsorted(num_steps_left[order], steps, side="right")
    computed_after = np.concatenate((np.cumsum(num_computed[order][::-1])[::-1], [0]))
    num_seqs = n - gone
    return num_seqs, computed_after[gone] + num_seqs * (steps + 1)


def commit_stretch(state: ReplicaState, stretch: Stretch, num_steps: int, log: IterationLog
                   ) -> tuple[list[Request], Stretch | None]:
    """Apply the first `num_steps` iterations of `stretch`. Returns the requests they finished
    (in the order a step-by-step run finishes them) and the rest of the stretch (None if
    nothing is left). KV blocks grow to hold what the committed iterations computed; the
    rest's first iteration allocates its own (as the step-by-step run's `schedule()` would,
    when it plans that iteration)."""
    bs = stretch.block_size
    left = stretch.num_steps_left
    computed0 = stretch.num_computed  # each request's `num_computed_tokens` now
    requests = stretch.requests
    nobody_leaves = stretch.min_steps_left > num_steps
    if nobody_leaves:
        num_seqs: Any = len(requests)
        used = stretch.num_used_blocks + extra_blocks(computed0, bs, num_steps + 1)
        steps_in: Any = num_steps  # iterations each request is in
    else:
        # Blocks held during each iteration j (after its allocation): a request in the batch
        # holds those of computed + j + 1 tokens; one that has left, none.
        steps = np.arange(num_steps + 1, dtype=np.int64)
        start_blocks = -(-(computed0 + 1) // bs)
        held = -(-(computed0[:, None] + steps[None, :] + 1) // bs)
        inside = steps[None, :] < left[:, None]
        used = stretch.num_used_blocks + np.where(
            inside, held - start_blocks[:, None], -start_blocks[:, None]).sum(axis=0)
        num_seqs = inside[:, :num_steps].sum(axis=0)
        steps_in = np.minimum(left, num_steps)
    first_iter = log.extend_decodes(stretch.starts_s[:num_steps], stretch.duration_s[:num_steps],
                                    num_seqs, used[:num_steps], stretch.num_preempted)
    # A plain loop over the batch for what lives on the requests (counters, token runs); the
    # arithmetic is done on the arrays, once per commit rather than once per request (a decode
    # replica of a disaggregated cluster commits its stretches an iteration or two at a time).
    steps_list = [num_steps] * len(requests) if nobody_leaves else steps_in.tolist()
    for req, n in zip(requests, steps_list, strict=True):
        req.decode_steps(first_iter, n)
    state.decoded(sum(steps_list))
    # Blocks to hold what each computed (a finishing request's too: with prefix caching, what
    # it frees is cached), in running order; the plan counted every request's growth, so they
    # fit. A request holds the blocks of its allocated tokens.
    grow = -(-(computed0 + steps_in) // bs) + (-stretch.num_allocated // bs)
    grow_blocks = state.kv.grow_blocks
    grow_list = grow.tolist()
    for pos in np.flatnonzero(grow > 0).tolist():
        grow_blocks(requests[pos].request_id, grow_list[pos])
    done: list[Request] = []
    if not nobody_leaves:
        # By the iteration that ends it, then running order, as stepping finishes them.
        leaving = np.flatnonzero(left <= num_steps)
        for pos in leaving[np.argsort(left[leaving], kind="stable")].tolist():
            req = requests[pos]
            state.finish(req, float(stretch.end_s[left[pos] - 1]))
            done.append(req)
    if num_steps == len(stretch):
        return done, None
    if nobody_leaves:
        return done, Stretch(requests, computed0 + num_steps, stretch.starts_s[num_steps:],
                             stretch.duration_s[num_steps:], stretch.end_s[num_steps:],
                             int(used[num_steps]), bs,
                             np.maximum(computed0 + num_steps, stretch.num_allocated),
                             left - num_steps, stretch.min_steps_left - num_steps)
    keep = np.flatnonzero(left > num_steps)
    computed_now = computed0[keep] + num_steps
    left_now = left[keep] - num_steps
    return done, Stretch([requests[i] for i in keep.tolist()], computed_now,
                         stretch.starts_s[num_steps:], stretch.duration_s[num_steps:],
                         stretch.end_s[num_steps:], int(used[num_steps]), bs,
                         np.maximum(computed_now, stretch.num_allocated[keep]), left_now,
                         int(left_now.min()) if len(left_now) else 0)


def allocate_first_step(state: ReplicaState, stretch: Stretch) -> Stretch:
    """KV blocks for the first iteration of `stretch` (as `schedule()` allocates a plan's), if
    not allocated yet; the stretch, knowing they are."""
    if stretch.num_allocated[0] > stretch.num_computed[0]:
        return stretch
    for req in stretch.requests:
        grow = state.kv.num_blocks_to_grow(req, 1)
        if grow:
            state.kv.grow_blocks(req.request_id, grow)
    stretch.num_allocated = stretch.num_computed + 1
    return stretch
