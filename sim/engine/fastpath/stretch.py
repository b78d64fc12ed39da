"""Fast-forward: advance a stretch of predictable iterations in one step.

When every running request decodes and nothing waits, each following iteration is the same plan
(less the requests that have finished) until a request arrives or needs a KV block that is not
free. So it is when one running request still computes its prompt in chunks beside them: each
chunk is the one before (the last, what is left), and once the prompt is computed the request
decodes with the others. The stretch is computed with a few numpy operations whatever its
length, and every token still gets its own time: the cost of a simulation follows its events,
not its tokens. Pure: no SimPy, no clock.

A stretch can be committed in pieces (`sim.engine.fastpath.commit`: whoever looks at the replica
mid-stretch sees the iterations that have ended, as a step-by-step run would show them) and cut
short after the iteration in progress (new work arrived).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sim.core.plan import Plan
from sim.core.request import Request
from sim.core.state import ReplicaState
from sim.latency.base import BatchShape, LatencyModel
from sim.latency.noise import IterationNoise


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 3x, on a hot path
class Stretch:
    """`len(end_s)` iterations of `requests`; the first iteration's KV blocks are allocated
    (as `schedule()` allocates a plan's). Per-iteration arrays are computed once, when the
    stretch is planned; committing or cutting it takes slices.

    Every request decodes in every iteration it is in, but for one (at `prefill_pos`) that may
    first compute the rest of its prompt in `num_prefill_steps` chunks, `prefill_tokens`; its
    per-request numbers are those of a request that had decoded through those iterations (its
    known tokens less `num_prefill_steps` computed before the stretch, and in it from the
    first), so that committing, cutting or reading the stretch treats every request alike and
    corrects for that one where the chunks differ."""

    requests: list[Request]
    # Per request, plain lists: a few requests, read in loops (a commit's, a plan's); numpy
    # only where a table is made of them.
    num_computed: list[int]  # each request's computed tokens before the stretch
    starts_s: np.ndarray  # each iteration's start
    duration_s: np.ndarray
    end_s: np.ndarray
    num_used_blocks: int  # KV blocks in use during the first iteration (its blocks allocated)
    block_size: int
    # Whether the first iteration's KV blocks are allocated, as `schedule()` allocates a
    # plan's: each request's blocks then hold its computed tokens + 1; after a partial commit,
    # its computed tokens (the next iteration allocates).
    first_allocated: bool
    # Iterations of the stretch each request is in: it samples its last token in the last one
    # (at least `len(self)` for a request that does not finish in the stretch).
    num_steps_left: list[int]
    # `num_steps_left.min()` as a plain int: read at every commit and every router look, where
    # a numpy reduction costs more than the rest of the test.
    min_steps_left: int
    # Requests preempted while the first iteration was planned (a policy may preempt one and,
    # with a prefix cache, take it back at once for its one uncomputed token): logged with that
    # iteration, as a step-by-step run logs them; 0 once it is committed.
    num_preempted: int = 0
    # The request computing its prompt: the tokens of its chunks, one per iteration from the
    # first (as many as the stretch has iterations, or fewer: it decodes in the rest), its
    # place in `requests`, and the iterations of chunks it has left (possibly more than the
    # stretch's). None, -1 and 0 when every request decodes throughout.
    prefill_tokens: list[int] | None = None
    prefill_pos: int = -1
    num_prefill_steps: int = 0
    # Whether the first iteration's plan is the policy's (`plan_stretch`'s), not one the
    # stretch made for it (the rest of a stretch after a commit): `Scheduler.decodes_repeated`.
    planned_first: bool = False
    # `ended_counts` for every number of iterations, made on the first read past a finish.
    _ended: tuple[list[int], list[int], list[int]] | None = field(default=None, repr=False,
                                                                    compare=False)
    # `end_s` as a list, made on the first `num_ended_by`.
    _end_list: list[float] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.end_s)

    @property
    def start_s(self) -> float:
        return float(self.starts_s[0])

    def num_ended_by(self, now_s: float, *, inclusive: bool = True) -> int:
        """Iterations that have ended by `now_s` (at `now_s` too, if `inclusive`)."""
        ends = self._end_list
        if ends is None:
            # A list of the same floats, searched by `bisect`: a router reads every replica
            # at every arrival, where numpy's search (and its scalars) cost several times more.
            ends = self._end_list = self.end_s.tolist()
        return bisect_right(ends, now_s) if inclusive else bisect_left(ends, now_s)

    def cut_at(self, now_s: float, *, started_now: bool) -> Stretch | None:
        """The stretch stopped after the iteration in progress at `now_s`; None if none is.
        An iteration starting exactly now is in progress if `started_now` (the replica's
        planning turn at this instant has come: a step-by-step run has planned it)."""
        keep = int(self.starts_s.searchsorted(now_s, side="right" if started_now else "left"))
        return self.head(keep) if keep else None

    def head(self, num_steps: int) -> Stretch:
        """The stretch's first `num_steps` iterations."""
        prefill = self.prefill_tokens
        return Stretch(self.requests, self.num_computed, self.starts_s[:num_steps],
                       self.duration_s[:num_steps], self.end_s[:num_steps], self.num_used_blocks,
                       self.block_size, self.first_allocated, self.num_steps_left,
                       self.min_steps_left, self.num_preempted,
                       None if prefill is None else prefill[:num_steps], self.prefill_pos,
                       self.num_prefill_steps, self.planned_first)

    def after(self, num_steps: int, num_used_blocks: int) -> Stretch:
        """The iterations after the first `num_steps` (fewer than all), once those are
        committed: the requests still in the batch, their counters then, and
        `num_used_blocks`, the blocks in use during its first iteration."""
        left = self.num_steps_left
        # The request computing its prompt, if it has chunks left (and so is still in).
        prefill: list[int] | None = None
        pos = -1
        num_prefill_steps = self.num_prefill_steps - num_steps
        if self.prefill_tokens is not None and num_prefill_steps > 0:
            prefill, pos = self.prefill_tokens[num_steps:], self.prefill_pos
        else:
            num_prefill_steps = 0
        # Its first iteration's blocks are not allocated: each request's computed tokens now
        # (at least one more than the blocks were allocated for) fill them.
        computed = self.num_computed
        if self.min_steps_left > num_steps:  # nobody left
            return Stretch(self.requests, [c + num_steps for c in computed],
                           self.starts_s[num_steps:], self.duration_s[num_steps:],
                           self.end_s[num_steps:], num_used_blocks, self.block_size, False,
                           [k - num_steps for k in left], self.min_steps_left - num_steps, 0,
                           prefill, pos, num_prefill_steps)
        keep = [i for i, k in enumerate(left) if k > num_steps]
        left_now = [left[i] - num_steps for i in keep]
        if pos >= 0:
            pos = bisect_left(keep, pos)  # requests kept before it
        return Stretch([self.requests[i] for i in keep], [computed[i] + num_steps for i in keep],
                       self.starts_s[num_steps:], self.duration_s[num_steps:],
                       self.end_s[num_steps:], num_used_blocks, self.block_size, False,
                       left_now, min(left_now, default=0), 0, prefill, pos, num_prefill_steps)

    def ended_counts(self, num_steps: int) -> tuple[int, int, int]:
        """What committing the first `num_steps` iterations would do to the replica's counts,
        without committing them (a router reads every replica at every arrival; committing a
        stretch in pieces costs a piece's arrays each time): tokens sampled, requests finished,
        and the known tokens (prompt plus output) those requests leave with. `num_steps`: at
        most `len(self)` (`num_ended_by`)."""
        # The request computing its prompt samples in none of its chunks' iterations but the
        # last: counted as decoding from the first, it has that many samples fewer.
        not_sampled = min(num_steps, self.num_prefill_steps - 1) if self.prefill_pos >= 0 else 0
        if num_steps < self.min_steps_left:
            return num_steps * len(self.requests) - not_sampled, 0, 0
        # Past a finish, from a table of every count made once: on a large cluster a stretch
        # is read at every arrival until it ends (64 replicas at 64x the Azure conversation
        # trace: 1.2M reads), where a handful of numpy calls per read cost a third of the run.
        if self._ended is None:
            self._ended = self._ended_table()
        sampled, finished, leave_tokens = self._ended
        return sampled[num_steps] - not_sampled, finished[num_steps], leave_tokens[num_steps]

    def _ended_table(self) -> tuple[list[int], list[int], list[int]]:
        """`ended_counts` before the prompt's correction, for 0 .. len(self) iterations: the
        requests gone by k are those with `num_steps_left` <= k; each samples in
        min(its `num_steps_left`, k) of them, so the tokens sampled by k add up, iteration
        by iteration, the requests still in."""
        n = len(self)
        left = np.array(self.num_steps_left, dtype=np.int64)
        bucket = np.minimum(left, n + 1)  # the iteration it is gone from (n + 1: not in this one)
        finished = np.cumsum(np.bincount(bucket, minlength=n + 2))[:n + 1]
        # A decoding request knows one token more than it has computed.
        by_bucket = np.zeros(n + 2, dtype=np.int64)
        np.add.at(by_bucket, bucket, np.array(self.num_computed, dtype=np.int64) + 1 + left)
        leave_tokens = np.cumsum(by_bucket)[:n + 1]
        sampled = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(len(left) - finished[:n], out=sampled[1:])
        return sampled.tolist(), finished.tolist(), leave_tokens.tolist()


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
    following plan repeats `plan` (checked further by `plan_stretch`), whatever the policy:
    nothing waits, so there is nothing to admit or to choose between, and the plan gives every
    running request its tokens. Each decode then gets its one token again, and a prompt
    computed in chunks (one at most) the chunk it got, until what is left of it is less.

    That is all a policy is asked (`Scheduler`): while nothing waits and the running requests
    stay the same, it schedules each decode, and gives a prompt it cut into chunks the same
    chunk again (its budget less the same decodes, or a chunk size), as every engine does. It
    then gets the fast-forward without knowing of it."""
    # (On a prefill replica every request leaves at its first token: none ever decodes.)
    return not state.waiting and plan.num_seqs == len(state.running) and not state.prefill_only


def plan_stretch(state: ReplicaState, plan: Plan, latency: LatencyModel, start_s: float,
                 horizon_s: float | None, *, through_finishes: bool = False,
                 noise: IterationNoise | None = None, first_index: int = 0,
                 max_steps: int | None = None, num_preempted: int = 0,
                 first_s: float | None = None) -> Stretch | None:
    """The longest stretch from `start_s` of a steady `plan` (`is_steady`), which `schedule()`
    allocated; None unless every running request is decoding, but for one computing its prompt
    (replicas without prefix caching that decode what they prefill). It ends when the first
    request finishes, or, `through_finishes`, when the last does (the batch shrinks as
    requests leave: with nothing waiting, nothing takes their place until work arrives; not
    before the prompt is computed, whose chunks would grow), and after `max_steps`
    iterations at most (where it ends, the replica plans again, as at any iteration: any
    shorter stretch gives the same results). `num_preempted`: requests the plan of its first
    iteration preempted. `first_s`: the first iteration's duration where the caller has
    timed it already (a latency model is asked once per iteration: some count their
    predictions)."""
    requests = list(state.running)
    # Every running request decodes but those `prefilling()` lists (no pipeline here: a
    # pipelined replica plans its own iterations), so the counters are read without asking
    # each request what it is: the iteration in which a request samples its last token is
    # its last.
    computed = [r.num_computed_tokens for r in requests]
    left = [r.num_target_output_tokens - r.num_output_tokens for r in requests]
    prefill_pos = -1
    chunk = num_prefill_steps = 0
    prefill: Request | None = None
    prompts = state.prefilling()
    if prompts:
        # A prompt (or, preempted, its prompt and output again) computed in chunks of what
        # the plan gives it now, the last what is left; it samples at the end of that one.
        if len(prompts) > 1 or state.kv.caches_prefixes:
            return None
        prefill = prompts[0]
        chunk = plan.num_scheduled_tokens.get(prefill.request_id, 0)
        if not chunk:
            return None
        num_uncomputed = prefill.num_uncomputed_tokens
        num_prefill_steps = -(-num_uncomputed // chunk)
        if prefill.num_output_tokens and num_uncomputed == chunk * (num_prefill_steps - 1) + 1:
            # Recomputed after a preemption, its last chunk would be one token: a decode, by
            # `is_decoding` (so its iteration's shape), that samples. Stepped.
            return None
        prefill_pos = requests.index(prefill)  # (by identity: `Request` compares so)
        # Counted as decoding from the stretch's first iteration (`Stretch`).
        computed[prefill_pos] = prefill.num_tokens - num_prefill_steps
        left[prefill_pos] += num_prefill_steps - 1
    min_left = min(left)
    longest = max(left) if through_finishes else min_left
    if prefill is not None and through_finishes and len(left) > 1:
        # A decode leaving while the prompt is computed would leave its chunks more budget.
        first_leave = min(left[:prefill_pos] + left[prefill_pos + 1:])
        if first_leave < num_prefill_steps:
            longest = first_leave
    max_steps = longest if max_steps is None else min(longest, max_steps)
    kv = state.kv
    # The stretch stops before the blocks run out, counting every request's growth as if none
    # finished (freed blocks are not counted on: the stretch may stop early, never late). Each
    # request adds at most one block per `block_size` steps of decoding, and the prompt the
    # blocks of its chunks; only if that could exceed the free blocks is the exact count
    # needed (the log's per-iteration counts are taken when iterations are committed: most
    # stretches are cut short by new work).
    most_blocks = len(requests) * ((max_steps - 1) // kv.block_size + 1)
    prefill_tokens: list[int] | None = None
    if prefill is not None:
        # Its blocks for the rest of the prompt, taken by its later chunks: when they may not
        # fit, the iterations are stepped (the policy decides who gets blocks).
        most_blocks += (-(-prefill.num_tokens // kv.block_size)
                        - kv.num_held_blocks(prefill.request_id))
        if most_blocks > kv.num_free_blocks:
            return None
        # Its chunks' iterations one by one (a few), each as a step computes it; nobody leaves
        # before the last (`longest`), so each has every request in its batch.
        num_chunks = min(num_prefill_steps, max_steps)
        chunk_args = (latency, prefill, chunk, num_prefill_steps, computed[prefill_pos],
                      len(requests), sum(computed) + len(requests), noise, first_index)
        if first_s is None:
            prefill_tokens, first = _chunk_durations(*chunk_args, 0, num_chunks)
        else:
            prefill_tokens, first = _chunk_durations(*chunk_args, 1, num_chunks)
            prefill_tokens.insert(0, chunk)
            first.insert(0, first_s)
    if prefill is None and most_blocks > kv.num_free_blocks:
        extra = extra_blocks(np.array(computed, dtype=np.int64), kv.block_size, max_steps)
        max_steps = min(max_steps, int(np.searchsorted(extra, kv.num_free_blocks, side="right")))

    if prefill_tokens is None:
        num_seqs, kv_tokens = batch_sizes(computed, left, max_steps)
        duration = decode_durations(latency, num_seqs, kv_tokens, noise, first_index)
    elif num_chunks == max_steps:
        duration = np.array(first)
    else:  # the decodes after its chunks: on arrays, as any stretch's
        num_seqs, kv_tokens = batch_sizes(computed, left, max_steps)
        duration = np.empty(max_steps)
        duration[:num_chunks] = first
        duration[num_chunks:] = decode_durations(
            latency, num_seqs[num_chunks:] if isinstance(num_seqs, np.ndarray) else num_seqs,
            kv_tokens[num_chunks:], noise, first_index + num_chunks)
    # Sequential accumulation, so each end equals start + duration exactly as one step would be.
    bounds = np.add.accumulate(np.concatenate(([start_s], duration)))
    starts, end = bounds[:-1], bounds[1:]
    if horizon_s is not None and end[-1] > horizon_s:
        # Iterations after the horizon never complete; keep one so the engine can wait for it.
        max_steps = max(1, int(np.searchsorted(end, horizon_s, side="right")))
        starts, duration, end = starts[:max_steps], duration[:max_steps], end[:max_steps]
        if prefill_tokens is not None:
            prefill_tokens = prefill_tokens[:max_steps]
    return Stretch(requests, computed, starts, duration, end, kv.num_used_blocks,
                   kv.block_size, True, left, min_left, num_preempted, prefill_tokens,
                   prefill_pos, num_prefill_steps, True)


def decode_durations(latency: LatencyModel, num_seqs: Any, kv_tokens: np.ndarray,
                      noise: IterationNoise | None, first_index: int) -> np.ndarray:
    """Durations of decode-only iterations (`batch_sizes`' arrays), from iteration
    `first_index` of the replica: one call on arrays of shapes (a latency model is
    element-wise, so this is exactly what a call on each shape would give)."""
    num_steps = len(kv_tokens)
    duration = latency.iteration_time_s(BatchShape.decode_only(num_seqs, kv_tokens))
    if not isinstance(duration, np.ndarray) or duration.shape != (num_steps,):
        duration = np.broadcast_to(np.asarray(duration, dtype=np.float64), (num_steps,))
    if noise is not None:  # iteration `first_index + j`'s own factor, as a step would get it
        duration = duration * noise.factors_from(first_index, num_steps, 0, num_seqs)
    return duration


def _chunk_durations(latency: LatencyModel, req: Request, chunk: int, num_prefill_steps: int,
                     num_computed: int, num_seqs: int, num_kv_tokens: int,
                     noise: IterationNoise | None, first_index: int, first_step: int,
                     end_step: int) -> tuple[list[int], list[float]]:
    """The chunks of `req` (`chunk` tokens each, the last what is left) in iterations
    `first_step` .. `end_step - 1` of a stretch of `num_seqs` requests, and those iterations'
    durations, each shape summed as `BatchShape.from_plan` sums a plan's. `num_kv_tokens`, the
    KV tokens the first iteration would read were `req` decoding with `num_computed` tokens
    (`Stretch`'s count), grows by `num_seqs` an iteration."""
    cached = req.num_computed_tokens + chunk * first_step
    last = req.num_uncomputed_tokens - chunk * (num_prefill_steps - 1)
    num_decodes = num_seqs - 1
    tokens: list[int] = []
    durations: list[float] = []
    for j in range(first_step, end_step):
        final = j == num_prefill_steps - 1  # it samples at the end of its last chunk
        n = last if final else chunk
        shape = BatchShape(n, 1, num_decodes, num_decodes + final,
                           n * cached + n * (n + 1) // 2, cached + n,
                           num_kv_tokens + num_seqs * j - (num_computed + 1 + j))
        duration = float(latency.iteration_time_s(shape))
        if noise is not None:
            duration = duration * noise.factor(first_index + j, n, num_decodes)
        tokens.append(n)
        durations.append(duration)
        cached += n
    return tokens, durations


def batch_sizes(num_computed: list[int], num_steps_left: list[int], num_steps: int
                ) -> tuple[Any, np.ndarray]:
    """Requests decoding in each of `num_steps` iterations (one number if none leaves before
    the last), and the KV tokens their attention reads: each request's computed tokens + 1 at
    step 0, one more each step, while it is in the batch (it is in steps j < its
    `num_steps_left`)."""
    n = len(num_computed)
    computed = sum(num_computed)
    if min(num_steps_left) >= num_steps:
        first = computed + n
        return n, np.arange(first, first + n * num_steps, n, dtype=np.int64)
    # Between two leaving steps the batch, and the computed tokens of the requests in it, stay
    # the same: one segment each, found in a loop over the few requests, then spread over the
    # steps by one `repeat` (a dozen numpy calls on requests x steps arrays cost more).
    lengths, seqs, tokens = [], [], []
    start, in_batch = 0, n
    for left, c in sorted(zip(num_steps_left, num_computed, strict=True)):
        if left >= num_steps:
            break
        if left > start:
            lengths.append(left - start)
            seqs.append(in_batch)
            tokens.append(computed)
            start = left
        in_batch -= 1
        computed -= c
    lengths.append(num_steps - start)
    seqs.append(in_batch)
    tokens.append(computed)
    rows = np.repeat(np.array((seqs, tokens), dtype=np.int64), lengths, axis=1)
    num_seqs = rows[0]
    return num_seqs, rows[1] + num_seqs * np.arange(1, num_steps + 1, dtype=np.int64)
