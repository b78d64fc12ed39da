"""Fast-forward on a replica that schedules ahead (vLLM v1's async scheduling, SGLang's overlap
loop: `sim.engine.pipeline`, one stage, two iterations in flight, output placeholders).

In a steady state (every running request decoding, nothing waiting) such a replica is as
regular as a synchronous one, one iteration later: iteration j is planned when j - 2 ends
(when j - 1 starts), gives every running request one token (`ReplicaState.start` counted the
token in flight as computed and as a placeholder), and its batch, KV read and block growth are
`batch_sizes`' and `extra_blocks`' with the counts read at the first plan. A request sampling
its last token in j gets no placeholder, so plan j + 1 leaves it out, and its blocks come back
when j ends, after plan j + 1 was made. Iterations run back to back: j starts when j - 1's GPU
time ends. `tools/async_stretch_check.py` checks these forms against stepped runs.

A stretch here is planned when its first plan is made and committed whole when it is handed
back: after its K-th plan's turn, the first K - 1 iterations complete and the K-th in flight
(`hand_off`), exactly as the stepped replica leaves them. Pure: no SimPy.

Its first plan may also compute prompts (`catch_up_tokens`: a new request's, beside the
decodes), where it gives every running request all its known tokens: each then samples at the
end of iteration 0 and is steady from plan 1 on, as `is_steady` asks of every policy. Iteration
0 is then timed as a step times it (the caller's `Iteration`), and each request is counted as
if it had decoded in it (its computed tokens at plan 0 less its tokens there, plus one).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

from sim.core.plan import Plan
from sim.core.request import Request
from sim.core.state import PLACEHOLDER, SAMPLES, ReplicaState
from sim.engine.fastpath.stretch import batch_sizes, extra_blocks
from sim.engine.iteration_log import IterationLog
from sim.engine.replica import Iteration
from sim.latency.base import BatchShape, LatencyModel
from sim.latency.noise import IterationNoise
from sim.workloads.base import MAX_SPAN_S

# `AsyncStretch.counts_at`'s tables (`AsyncStretch._read_tables`).
_Reads = tuple[list[float], list[float], list[int], list[int], list[int], list[int]]


@dataclass(slots=True)
class AsyncStretch:
    """Iterations 0..N-1 of a steady async replica from its plan 0 (made, its blocks
    allocated, not yet started). Per iteration j: `plan_s[j]` when it is planned (0: now;
    1: when the iteration in flight ends; then when j - 2 ends), its start, logged duration
    and end, the GPU's free time after it (`free_s`), its batch size and KV read."""

    plan0: Plan
    num_used_blocks0: int  # KV blocks in use at plan 0 (its blocks allocated)
    requests: list[Request]  # running order at plan 0
    num_computed: list[int]  # at plan 0 (the token in flight counted)
    num_steps_left: list[int]  # iterations each request is in (its last samples its last token)
    first_index: int  # iteration number of plan 0
    block_size: int
    plan_s: np.ndarray
    starts_s: np.ndarray
    duration_s: np.ndarray
    end_s: np.ndarray
    free_s: np.ndarray
    num_seqs: int | np.ndarray  # one number where nobody leaves before the last
    kv_tokens: np.ndarray
    # Where plan 0 computes prompts: iteration 0 as a step plans it (its shape and duration),
    # and each request's tokens in it, in running order; None: plan 0 decodes (all ones).
    first: Iteration | None = None
    first_tokens: list[int] | None = None
    # What routers read, made at the first read (`_read_tables`), and the blocks in use at
    # each plan as far as counted (`used_blocks_through`).
    _reads: _Reads | None = None
    _used: list[int] | None = None

    def num_used_blocks(self, n: int) -> list[int]:
        """KV blocks in use when each of the first `n` plans is made: plan j adds a block to
        each request in it whose tokens fill its last (computed + j a multiple of the block
        size); a request's blocks are freed when its last iteration ends, before plan
        left + 1. (Counted for the plans a hand-off keeps: most stretches are cut short. A
        list, summed by `accumulate`: a few dozen numbers, where numpy's calls and its
        element writes cost more than the counting.)"""
        block_size = self.block_size
        change = [0] * n
        change[0] = self.num_used_blocks0
        if len(self.num_computed) * (n // block_size) <= 2 * n:  # few: added one by one
            for c, k in zip(self.num_computed, self.num_steps_left, strict=True):
                j = -c % block_size or block_size
                stop = k if k < n else n
                while j < stop:
                    change[j] += 1
                    j += block_size
                if k + 1 < n:
                    change[k + 1] -= -(-(c + k) // block_size)
            return list(accumulate(change))
        # A request adds a block at j, j + block_size, ... before it leaves: marked where its
        # run starts and just past where it stops, then summed along each residue, so the
        # cost grows with requests plus plans, not their product (SGLang's pages of one
        # token add a block a plan each: `bench/README.md`, 2026-12-02).
        adds = [0] * n
        for c, k in zip(self.num_computed, self.num_steps_left, strict=True):
            j = -c % block_size or block_size
            stop = k if k < n else n
            if j < stop:
                adds[j] += 1
                past = stop + (j - stop) % block_size  # the first of j's residue from stop
                if past < n:
                    adds[past] -= 1
            if k + 1 < n:
                change[k + 1] -= -(-(c + k) // block_size)
        if block_size == 1:
            adds = list(accumulate(adds))
        else:
            for j in range(block_size, n):
                adds[j] += adds[j - block_size]
        return list(accumulate(map(int.__add__, change, adds)))

    def used_blocks_through(self, n: int) -> list[int]:
        """`num_used_blocks` for at least the first `n` plans, counted once as far as reads
        and the hand-off go (doubling: a router reads a stretch at every arrival, and most
        stretches are cut a few plans in)."""
        used = self._used
        if used is None or len(used) < n:
            used = self._used = self.num_used_blocks(min(len(self), max(n, 2 * len(used or ()),
                                                                        8)))
        return used

    def __len__(self) -> int:
        return len(self.end_s)

    def num_planned_before(self, now_s: float, *, inclusive: bool = False) -> int:
        """Plans made before `now_s` (work arriving then is seen by the next), or by it where
        the replica's planning turn at `now_s` has passed (`inclusive`: work its own turn set
        off, a transfer it admitted landing at once)."""
        return int(np.searchsorted(self.plan_s, now_s, side="right" if inclusive else "left"))

    def counts_at(self, now_s: float, *, inclusive: bool = False) -> tuple[int, int, int]:
        """What a router reading the replica at `now_s` sees changed since plan 0, without a
        commit: the plans made before `now_s` started (each a token, a placeholder, for each
        request in it, but for its last) and the iterations ended by it complete (a request
        whose last one has leaves, its tokens and blocks with it), as the stepped replica
        stands then (`inclusive`: its planning turn at `now_s` has passed, as
        `num_planned_before`). Returns (running tokens added, requests left, KV blocks in
        use).

        Read from sums made at the first read (`_read_tables`), a few bisections each:
        behind a router weighing loads every replica is read at every arrival (16 replicas
        under vLLM v1: about 23 reads of each stretch, where a pass over its requests at
        each read took half the run)."""
        num_planned, num_ended, num_left, tokens = self._tokens_at(now_s, inclusive)
        blocks_freed = 0
        if num_ended >= num_planned - 1:
            # Those that left with n >= num_planned - 1 did after the last plan was made:
            # their blocks are freed since.
            reads = self._reads
            assert reads is not None  # (made by `_tokens_at`)
            iterations, blocks_le = reads[2], reads[5]
            blocks_freed = (blocks_le[num_left]
                            - blocks_le[bisect_left(iterations, num_planned - 1)])
        used = self.used_blocks_through(num_planned)[num_planned - 1]
        return tokens, num_left, used - blocks_freed

    def tokens_at(self, now_s: float, *, inclusive: bool = False) -> int:
        """`counts_at`'s running tokens added alone (a router weighing tokens reads every
        replica at every arrival, and the blocks cost as much again)."""
        return self._tokens_at(now_s, inclusive)[3]

    def _tokens_at(self, now_s: float, inclusive: bool) -> tuple[int, int, int, int]:
        """(plans made, iterations ended, requests left, running tokens added) at `now_s`."""
        reads = self._reads
        if reads is None:
            reads = self._reads = self._read_tables()
        plans, ends, iterations, iterations_le, tokens_le, _ = reads
        num_planned = (bisect_right if inclusive else bisect_left)(plans, now_s)
        if num_planned < 1:
            num_planned = 1
        num_ended = bisect_right(ends, now_s)
        # By their iterations n (`num_steps_left`, ascending): those with n <= num_ended
        # left, with their known tokens; each other one has a token for each plan made, but
        # for its last: min(num_planned, n - 1).
        num_left = bisect_right(iterations, num_ended)
        tokens = -tokens_le[num_left]
        num_requests = len(iterations)
        if num_planned > num_ended:
            upto = bisect_right(iterations, num_planned)
            # (their iterations less one each: n - 1 summed over those between)
            tokens += (iterations_le[upto] - iterations_le[num_left] - (upto - num_left)
                       + num_planned * (num_requests - upto))
        else:
            tokens += num_planned * (num_requests - num_left)
        return num_planned, num_ended, num_left, tokens

    def _read_tables(self) -> _Reads:
        """`counts_at`'s tables: the plan and end times as lists (for `bisect`), the
        requests' iterations in ascending order, and sums along that order from none: of
        their iterations, of their known tokens, and of the blocks each holds at its last."""
        bs, ks = self.block_size, self.num_steps_left
        rows = sorted(zip(ks, [req.num_tokens for req in self.requests],
                          [-(-(c + k) // bs) for c, k in zip(self.num_computed, ks, strict=True)],
                          strict=True))
        iterations, tokens, blocks = ((list(col) for col in zip(*rows, strict=True)) if rows
                                      else ([], [], []))
        return (self.plan_s.tolist(), self.end_s.tolist(), iterations,
                list(accumulate(iterations, initial=0)), list(accumulate(tokens, initial=0)),
                list(accumulate(blocks, initial=0)))

    def hand_off_s(self, k: int) -> float:
        """When plan k is made: the planning turn that takes the replica back."""
        if k < len(self.plan_s):
            return float(self.plan_s[k])
        return float(self.end_s[k - 2])


def catch_up_tokens(state: ReplicaState, plan: Plan) -> list[int] | None:
    """The tokens `plan` gives each running request, where it gives each all its known tokens
    not yet computed (or in flight), so that every one samples at the end of its iteration,
    and lists them in running order (the order stepping sends and completes them in); else
    None. The plan must schedule every running request (`plan.num_seqs ==
    len(state.running)`)."""
    tokens = []
    for (request_id, num_tokens), req in zip(plan.num_scheduled_tokens.items(), state.running,
                                             strict=True):
        if (request_id != req.request_id
                or req.num_computed_tokens + num_tokens != req.num_tokens):
            return None
        tokens.append(num_tokens)
    return tokens


def plan_async_stretch(state: ReplicaState, plan0: Plan, latency: LatencyModel, plan_s: float,
                       free_s: float, pred_end_s: float | None, horizon_s: float | None, *,
                       noise: IterationNoise | None, first_index: int, max_steps: int,
                       first: Iteration | None = None, first_tokens: list[int] | None = None
                       ) -> AsyncStretch | None:
    """The stretch from plan 0 (`plan0`, made at `plan_s` with every running request in it,
    nothing waiting, all decoding; its blocks allocated), through finishes, while the blocks
    last, ending before the horizon; None where fewer than three iterations qualify.
    `free_s`: when the GPU is free; `pred_end_s`: the end of the iteration in flight (None:
    none). Where plan 0 computes prompts, `first_tokens` (`catch_up_tokens`) and `first`, its
    iteration as a step plans it (the latency model is asked once per iteration: some count
    their predictions)."""
    requests = list(state.running)
    if first_tokens is None:
        computed = [r.num_computed_tokens for r in requests]
    else:  # (as if each decoded in iteration 0: `AsyncStretch`)
        computed = [r.num_computed_tokens + t - 1
                    for r, t in zip(requests, first_tokens, strict=True)]
    left = [r.num_target_output_tokens - r.num_output_tokens for r in requests]
    n = min(max(left), max_steps)
    kv = state.kv
    if len(requests) * ((n - 1) // kv.block_size + 1) > kv.num_free_blocks:
        extra = extra_blocks(np.array(computed, dtype=np.int64), kv.block_size, n)
        n = min(n, int(np.searchsorted(extra, kv.num_free_blocks, side="right")))
    if n < 3:
        return None
    num_seqs, kv_tokens = batch_sizes(computed, left, n)
    if first is None:
        duration = _durations(latency, num_seqs, kv_tokens, noise, first_index)
    else:  # iteration 0 as the step timed it; the decodes after it on arrays
        duration = np.empty(n)
        duration[0] = first.duration_s
        duration[1:] = _durations(
            latency, num_seqs if isinstance(num_seqs, int) else num_seqs[1:], kv_tokens[1:],
            noise, first_index + 1)
    # Back to back from the first start: iteration j starts where j - 1 is free.
    free = np.add.accumulate(np.concatenate(([max(plan_s, free_s)], duration)))
    starts, free = free[:-1], free[1:]
    logged = free - starts  # as the stepped replica logs it: its end less its start
    end = starts + logged
    plans = np.concatenate(([plan_s, plan_s if pred_end_s is None else pred_end_s],
                            end[:-2]))
    planned_end = plans + duration
    if (((plans <= starts) & (planned_end > plans) & (end > starts)).all()
            and free[-1] < MAX_SPAN_S and (horizon_s is None or end[-1] < horizon_s)):
        # Every check below passes (what is usual), whole: each plan before its GPU time,
        # each plan's end after it and below the last free time (a plan's time plus its
        # duration is at most its start's), the ends after the starts, and all finite.
        return AsyncStretch(plan0, kv.num_used_blocks, requests, computed, left, first_index,
                            kv.block_size, plans, starts, logged, end, free, num_seqs,
                            kv_tokens, first, first_tokens)
    if not (plans <= starts).all():  # (each plan before its GPU time: always seen so)
        return None
    if horizon_s is not None and end[-1] >= horizon_s:
        n = int(np.searchsorted(end, horizon_s, side="left"))
        if n < 3:
            return None
    # Each plan's time plus its duration after it and within 2**32 s, as a step checks it
    # (`Replica._plan_iteration`); where not, stepping says what is wrong.
    planned_end = plans[:n] + duration[:n]
    within = (planned_end > plans[:n]) & (planned_end < MAX_SPAN_S)
    if not within.all():
        n = int(within.argmin())  # (the first that is not)
        if n < 3:
            return None
    if not (end[:n] > starts[:n]).all() or not np.isfinite(end[n - 1]):
        # (Ends increase, so the last is finite where all are.) The stepped replica says
        # what is wrong with such a duration.
        return None
    return AsyncStretch(plan0, kv.num_used_blocks, requests, computed, left, first_index,
                        kv.block_size, plans[:n], starts[:n], logged[:n], end[:n], free[:n],
                        num_seqs if isinstance(num_seqs, int) else num_seqs[:n],
                        kv_tokens[:n], first, first_tokens)


def _durations(latency: LatencyModel, num_seqs: Any, kv_tokens: np.ndarray,
               noise: IterationNoise | None, first_index: int) -> np.ndarray:
    """Durations of decode iterations from iteration `first_index`, as a step times each: the
    GPU's time or the host's, the larger (the host plans the next one meanwhile), times the
    iteration's noise factor."""
    n = len(kv_tokens)
    shape = BatchShape.decode_only(num_seqs, kv_tokens)
    duration = np.asarray(latency.iteration_time_s(shape), dtype=np.float64)
    if duration.shape != (n,):  # (a model whose time does not depend on the KV read)
        duration = np.broadcast_to(duration, (n,))
    host = latency.host_time_s(shape)
    duration = np.maximum(duration - host, host)
    if noise is not None:  # iteration `first_index + j`'s own factor, as a step gets it
        duration = duration * noise.factors_from(first_index, n, 0, num_seqs)
    return duration


def hand_off(state: ReplicaState, stretch: AsyncStretch, k: int, log: IterationLog
             ) -> tuple[list[Request], Iteration]:
    """Commit the stretch as the stepped replica stands at plan k's turn (1 <= k <= N):
    iterations 0..k-2 complete (logged, their tokens sampled, requests finished), every plan
    up to k - 1 made (tokens computed, blocks grown, placeholders); return the requests that
    left, and iteration k - 1, in flight. The iteration in flight before the stretch must be
    complete already."""
    kv = state.kv
    bs = kv.block_size
    # Its plans were sent, as `ReplicaState.start` sends one (a decode replica's first work
    # may be a stretch): plans from now on skip a request whose token is in flight.
    state.pipelined = True
    requests, computed, left = stretch.requests, stretch.num_computed, stretch.num_steps_left
    done_k = k - 1  # iterations complete
    first = stretch.first_index
    assert len(log) == first
    used = stretch.used_blocks_through(k)
    if done_k:
        seqs = stretch.num_seqs
        num_logged = 0
        if stretch.first is not None:  # iteration 0 computed prompts: logged as a step logs it
            shape = stretch.first.shape
            log.append(float(stretch.starts_s[0]), float(stretch.duration_s[0]),
                       shape.num_prefill_tokens, shape.num_decode_tokens,
                       stretch.plan0.num_seqs, used[0], len(stretch.plan0.preempted_ids), 0)
            num_logged = 1
        if done_k > num_logged:
            log.extend_stretch(stretch.starts_s[num_logged:done_k],
                               stretch.duration_s[num_logged:done_k],
                               seqs if isinstance(seqs, int) else
                               seqs[num_logged:done_k].tolist(),
                               used[num_logged:done_k],
                               0 if num_logged else len(stretch.plan0.preempted_ids))
    num_placeholders = 0
    leaving: list[tuple[int, int]] = []
    first_tokens = stretch.first_tokens
    # Iteration 0's tokens still in flight: a prompt's all (k = 1), or one each.
    in_flight0 = first_tokens if k == 1 and first_tokens is not None else None
    firsts: list[bool] | None = None
    if first_tokens is not None:  # requests scheduled for the first time, in iteration 0
        start0 = float(stretch.starts_s[0])
        firsts = [r.first_scheduled_s is None for r in requests]
        for req, is_first in zip(requests, firsts, strict=True):
            if is_first:
                req.first_scheduled_s = start0
    completes = []  # iterations complete of each request's, all with a token of it
    grow_to = kv.grow_to
    for pos, (req, c, n_left) in enumerate(zip(requests, computed, left, strict=True)):
        started = k if k < n_left else n_left
        complete = done_k if done_k < n_left else n_left
        completes.append(complete)
        req.num_computed_tokens = c + started  # (c: a prompt's tokens in iteration 0 as one)
        req.num_in_flight_tokens += (started - complete if in_flight0 is None
                                     else in_flight0[pos])
        added = started if started < n_left else n_left - 1
        retired = complete if complete < n_left else n_left - 1
        req.num_output_tokens += added
        req.num_placeholders += added - retired
        num_placeholders += added
        grow_to(req.request_id, -(-(c + started) // bs))
        if complete == n_left:
            leaving.append((n_left, pos))
    state.num_running_tokens += num_placeholders
    if done_k:  # each request sampled in each of its iterations complete: one run
        log.add_sampled_runs(requests, first, completes)
    done = []
    end = stretch.end_s
    leaving.sort()
    for n_left, pos in leaving:  # by the iteration that ends it, then running order
        req = requests[pos]
        req.num_output_tokens += 1  # its last token
        state.num_running_tokens += 1
        state.leave([req], float(end[n_left - 1]))
        done.append(req)
    if k == 1 and stretch.first is not None:
        return done, _first_in_flight(stretch, firsts)
    return done, _in_flight(stretch, k - 1, used[k - 1])


def _first_in_flight(stretch: AsyncStretch, firsts: list[bool] | None) -> Iteration:
    """Iteration 0, which computed prompts, in flight as `ReplicaState.start` leaves it:
    every request samples at its end (a placeholder, but for a request's last token);
    `firsts`: which it scheduled for the first time."""
    it = stretch.first
    assert it is not None and stretch.first_tokens is not None and firsts is not None
    it.start_s, it.duration_s, it.end_s = (float(stretch.starts_s[0]),
                                           float(stretch.duration_s[0]),
                                           float(stretch.end_s[0]))
    it.in_flight = [(req, num_tokens, req.num_preemptions,
                     PLACEHOLDER if n_left > 1 else SAMPLES, is_first)
                    for req, num_tokens, n_left, is_first in zip(
                        stretch.requests, stretch.first_tokens, stretch.num_steps_left, firsts,
                        strict=True)]
    return it


def _in_flight(stretch: AsyncStretch, j: int, num_used_blocks: int) -> Iteration:
    """Iteration j as the stepped replica holds it in flight: its plan, shape and times, and
    what `ReplicaState.start` returned for it."""
    plan = stretch.plan0
    in_flight = []
    scheduled: dict[int, int] | None = {} if j else None
    for req, n_left in zip(stretch.requests, stretch.num_steps_left, strict=True):
        if n_left <= j:
            continue
        if scheduled is not None:
            scheduled[req.request_id] = 1
        in_flight.append((req, 1, req.num_preemptions,
                          PLACEHOLDER if j < n_left - 1 else SAMPLES, False))
    if scheduled is not None:
        plan = Plan(scheduled)
    seqs = stretch.num_seqs
    shape = BatchShape.decode_only(seqs if isinstance(seqs, int) else int(seqs[j]),
                                   int(stretch.kv_tokens[j]))
    it = Iteration(plan, shape, float(stretch.starts_s[j]), float(stretch.duration_s[j]),
                   float(stretch.end_s[j]), num_used_blocks, 0)
    it.in_flight = in_flight
    return it

