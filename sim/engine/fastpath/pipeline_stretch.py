"""Fast-forward on a replica of P > 1 pipeline stages (`sim.engine.pipeline`, vLLM v1's batch
queue, no output placeholders): a stretch of its iterations planned at once, exactly as
stepping plans them.

In a steady state (every running request decoding, nothing waiting) such a replica keeps G
batches (G <= P) taking turns: the requests of the plan just made (group 0) and those of each
iteration in flight (groups 1 .. G - 1, oldest first), every one of which samples at its end.
With no placeholders a request waits for its own token, so iteration j is planned when
iteration j - G leaves the last stage (the engine blocks on the oldest; a plan made while
fewer than P are in flight finds every other request caught up, and is empty), and its batch
is the requests of iteration j - G less those that sampled their last token there. A request
of group g is in iterations g, g + G, g + 2G, ..., reading one more KV token each time, and
adds a KV block where its computed tokens fill its last; stage times follow `_send`'s tandem
recursion. The stretch ends before a group would be empty (the turns would change), where its
block growth could exceed the blocks free at its first plan (so no plan in it can preempt),
after `max_steps` iterations, and before the horizon.

It is handed back at a planning turn k (1 <= k <= N, `hand_off`): the iterations that left
the last stage by then complete, the last G - 1 planned are in flight, as the stepped replica
holds them, and stepping plans iteration k with whatever arrived. Pure: no SimPy.

Output placeholders on several stages do not arise: vLLM's async scheduling keeps P
iterations in flight on P stages (`max_concurrent_batches`), so it runs as this synchronous
pipeline, and SGLang overlaps on one stage only; a pipeline deeper than its stages steps.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

from sim.core.kv_cache import cdiv
from sim.core.plan import Plan
from sim.core.request import Request
from sim.core.state import SAMPLES, ReplicaState
from sim.engine.fastpath.stretch import batch_sizes, decode_durations
from sim.engine.iteration_log import IterationLog
from sim.engine.replica import Iteration
from sim.latency.base import BatchShape, LatencyModel
from sim.latency.noise import IterationNoise
from sim.workloads.base import MAX_SPAN_S


@dataclass(slots=True)
class PipelineStretch:
    """Iterations 0..N-1 of a steady pipeline from its plan 0 (made, its blocks allocated, not
    yet sent), G = `num_groups` batches taking turns. Per request (group by group, each in
    running order): its first iteration (its group), its computed tokens when planned there,
    and the iterations it is in (it samples its last token in the last). Per iteration j:
    when it is planned (`plan_s`), its start, logged duration and end, each stage's free
    time after it (`stage_free_s`, N x P), its batch, KV read and blocks in use when
    planned."""

    plan0: Plan
    requests: list[Request]
    first_steps: list[int]
    num_computed: list[int]
    num_steps_left: list[int]
    num_groups: int
    first_index: int  # iteration number of plan 0
    block_size: int
    plan_s: np.ndarray
    starts_s: np.ndarray
    duration_s: np.ndarray
    end_s: np.ndarray
    stage_free_s: list[tuple[float, ...]]
    num_seqs: np.ndarray
    kv_tokens: np.ndarray
    num_used_blocks: list[int]
    # Where each group's requests start in `requests` (they come group by group), and end.
    group_bounds: list[int]
    # KV blocks freed just before plan j (0 .. N): by the iteration that ended then.
    freed_blocks: list[int]

    def __len__(self) -> int:
        return len(self.end_s)

    def num_planned_before(self, now_s: float, *, inclusive: bool = False) -> int:
        """Plans made before `now_s` (work arriving then is seen by the next), or by it where
        the replica's planning turn at `now_s` has passed (`inclusive`)."""
        return int(np.searchsorted(self.plan_s, now_s, side="right" if inclusive else "left"))

    def hand_off_s(self, k: int) -> float:
        """When plan k is made: the planning turn that takes the replica back."""
        if k < len(self.plan_s):
            return float(self.plan_s[k])
        return float(self.end_s[k - self.num_groups])

    def counts_at(self, now_s: float, *, inclusive: bool = False) -> tuple[int, int, int]:
        """What a router reading the replica at `now_s` sees changed by the stretch, without a
        commit (the iterations in flight before it complete as stepping completes them,
        first): the iterations ended by `now_s` complete (each request in one samples a
        token; one sampling its last leaves, with its tokens), and the blocks in use are
        those of the last plan made (by `now_s` where its planning turn has passed:
        `inclusive`), less those freed since. Returns (running tokens added, requests left,
        KV blocks in use)."""
        num_planned = max(1, self.num_planned_before(now_s, inclusive=inclusive))
        num_ended = int(np.searchsorted(self.end_s, now_s, side="right"))
        g_n = self.num_groups
        tokens = num_left = 0
        for req, f, n_left in zip(self.requests, self.first_steps, self.num_steps_left,
                                  strict=True):
            if num_ended <= f:
                continue
            complete = (num_ended - f + g_n - 1) // g_n
            if complete >= n_left:  # its last token sampled: it left
                num_left += 1
                tokens -= req.num_tokens
            else:
                tokens += complete
        used = self.num_used_blocks[num_planned - 1]
        if self.hand_off_s(num_planned) <= now_s:  # (ended at this instant, not yet planned)
            used -= self.freed_blocks[num_planned]
        return tokens, num_left, used

    def tokens_at(self, now_s: float, *, inclusive: bool = False) -> int:
        """`counts_at`'s running tokens added alone (`AsyncStretch.tokens_at`)."""
        return self.counts_at(now_s, inclusive=inclusive)[0]


def steady_groups(state: ReplicaState, plan0: Plan, batches: Any) -> list[list[Request]] | None:
    """The G batches of a steady pipeline at plan 0 (which gives each of its requests one
    token): its requests, then those of each iteration in flight (`batches`, oldest first)
    that will decode after it (every request there samples at its end), each in running
    order; None where the pipeline is not steady (a running request with prompt tokens left
    or in none of them, a plan with a report or preemptions, a request there preempted
    since)."""
    if state.prefilling():  # (else every request of plan 0 decodes: it is not caught up)
        return None
    num_in = plan0.num_seqs
    for it in batches:
        in_flight = it.in_flight
        # (A request not sampling at its end, a prompt's chunk, most often: told by the shape.)
        if (not it.plan or it.report is not None or in_flight is None or it.plan.preempted_ids
                or it.shape.num_sampled_tokens != len(in_flight)):
            return None
        num_in += len(in_flight)
    running = state.running
    if num_in != len(running):
        return None
    group_of = dict.fromkeys(plan0.num_scheduled_tokens, 0)
    for g, it in enumerate(batches, start=1):
        for req, _, num_preemptions, samples, _ in it.in_flight:
            if samples != SAMPLES or req.num_preemptions != num_preemptions:
                return None
            group_of[req.request_id] = g
    # Each plan lists its requests in running order, as the policies walk the running list.
    groups: list[list[Request]] = [[] for _ in range(len(batches) + 1)]
    for req in running:
        which = group_of.get(req.request_id)
        if which is None:
            return None
        # (Its last token in flight: it leaves when that iteration ends.)
        if not which or req.num_output_tokens + 1 < req.num_target_output_tokens:
            groups[which].append(req)
    return groups


def plan_pipeline_stretch(state: ReplicaState, plan0: Plan, groups: list[list[Request]],
                          batches: Any, latency: LatencyModel, plan_s: float,
                          stage_free_s: list[float], stage_shares: list[float] | None,
                          horizon_s: float | None, *, noise: IterationNoise | None,
                          first_index: int, max_steps: int, until_s: float = np.inf
                          ) -> PipelineStretch | None:
    """The stretch from plan 0 (`plan0`, made at `plan_s`, its blocks allocated), `groups`
    from `steady_groups`, `batches` the iterations in flight (oldest first),
    `stage_free_s` when each stage is next free, `stage_shares` each stage's share of a pass
    (None: even); None where fewer than G + 1 iterations qualify. The latency model is asked
    once, on arrays; the noise factor of iteration j is the one stepping gives it.
    `until_s`: work known to arrive then takes the replica back at the first plan made at or
    after it: no iteration is timed past that plan."""
    num_groups = len(groups)
    if batches and batches[-1].end_s >= until_s:
        return None  # (taken back before the stretch completes an iteration)
    num_stages = len(stage_free_s)
    kv = state.kv
    bs = kv.block_size
    held = kv.num_held_blocks
    requests: list[Request] = []
    firsts: list[int] = []
    computed: list[int] = []
    left: list[int] = []
    group_computed: list[list[int]] = []
    group_left: list[list[int]] = []
    # Until a group would be empty (stepping's turns change there).
    n = max_steps
    for g, group in enumerate(groups):
        cs = [req.num_computed_tokens for req in group]  # (in flight: its token counted)
        # Iterations each is in: it has sampled its token in flight by its first.
        ks = [req.num_target_output_tokens - req.num_output_tokens - (g > 0) for req in group]
        ahead = 1 if g == 0 else 0  # (plan 0's blocks allocated)
        for req, c in zip(group, cs, strict=True):
            # Blocks as a decode's plan leaves them, one per block of tokens; else stepping
            # would allocate otherwise than counted here.
            if held(req.request_id) != -(-(c + ahead) // bs):
                return None
        if not ks:
            return None
        n = min(n, g + num_groups * max(ks))
        requests += group
        firsts += [g] * len(group)
        computed += cs
        left += ks
        group_computed.append(cs)
        group_left.append(ks)
    if n <= num_groups:
        return None
    # Blocks: plan j adds one to each request in it whose computed tokens fill its blocks;
    # a request leaves with those of its tokens, freed before plan last + G; a request of
    # an iteration in flight that leaves there, with what it holds. Stop where the blocks
    # added could exceed those free at plan 0 (frees not counted: no plan in the stretch
    # can preempt).
    added = [0] * n
    change = [0] * (n + 1)
    change[0] = kv.num_used_blocks
    for g, it in enumerate(batches, start=1):
        assert it.in_flight is not None
        for req, _, _, _, _ in it.in_flight:
            if req.num_output_tokens + 1 == req.num_target_output_tokens:
                change[g] -= held(req.request_id)
    step = num_groups * bs
    for f, c, k in zip(firsts, computed, left, strict=True):
        m = -c % bs
        if m == 0 and f == 0:
            m = bs  # (plan 0's allocated)
        j = f + num_groups * m
        stop = last = f + num_groups * k  # (freed before plan `last`)
        if stop > n:
            stop = n
        while j < stop:
            added[j] += 1
            j += step
        if last <= n:
            change[last] -= -(-(c + k) // bs)
    if sum(added) > kv.num_free_blocks:
        n = int(np.searchsorted(list(accumulate(added)), kv.num_free_blocks, side="right"))
        if n <= num_groups:
            return None
    used = list(accumulate(map(int.__add__, change[:n], added[:n])))
    # Each group's batch sizes and KV reads, turn by turn, interleaved.
    num_seqs = np.empty(n, dtype=np.int64)
    kv_tokens = np.empty(n, dtype=np.int64)
    for g in range(num_groups):
        seqs, tokens = batch_sizes(group_computed[g], group_left[g], len(range(g, n, num_groups)))
        num_seqs[g::num_groups] = seqs
        kv_tokens[g::num_groups] = tokens
    duration = decode_durations(latency, num_seqs, kv_tokens, noise, first_index)
    # `_send`'s tandem recursion, iteration by iteration (each plan waits for the end of the
    # iteration G before it): the same float operations in the same order (`a if a > b
    # else b` is `max(b, a)`, NaN included). With even shares every stage of iteration j
    # takes its duration / P, and its first stage starts it (`start` is at least that
    # stage's free time): `start + s`.
    # Checked as it goes, as a step checks it (`Replica._plan_iteration`): each plan's time
    # plus its duration after it and within 2**32 s, the ends strictly in turn (one result
    # taken per turn). The first that fails ends the stretch before it: stepping says what
    # is wrong with it.
    durations = duration.tolist()
    if stage_shares is None:
        per_stage = (duration / num_stages).tolist()
    else:
        stages = (duration[:, None] * np.array(stage_shares)).tolist()
    plans = [plan_s, *(it.end_s for it in batches)]
    free = list(stage_free_s)
    starts: list[float] = []
    logged: list[float] = []
    ends: list[float] = []
    frees: list[tuple[float, ...]] = []
    later_stages = range(1, num_stages)
    last_end = batches[-1].end_s if batches else -math.inf
    for j in range(n):
        p = plans[j]
        planned_end = p + durations[j]
        if not (planned_end > p and planned_end < MAX_SPAN_S):
            n = j
            break
        free_s = free[0]
        start = free_s if free_s > p else p
        if stage_shares is None:
            stage_s = per_stage[j]
            free[0] = end = start + stage_s
            for k in later_stages:
                free_s = free[k]
                free[k] = end = (free_s if free_s > end else end) + stage_s
        else:
            end = start
            for k, stage_s in enumerate(stages[j]):
                free_s = free[k]
                free[k] = end = (free_s if free_s > end else end) + stage_s
        d = end - start
        e = start + d  # as the log will compute it
        if not e > last_end:
            n = j
            break
        last_end = e
        frees.append(tuple(free))
        starts.append(start)
        logged.append(d)
        ends.append(e)
        plans.append(e)  # (plan j + G)
        if p >= until_s:
            n = j + 1  # (plan j takes the replica back)
            break
    if horizon_s is not None:
        # Hand-off at plan n, when iteration n - G ends: before the horizon.
        n = min(n, bisect_left(ends, horizon_s, 0, n) + num_groups - 1)
    if n <= num_groups:
        return None
    plans_a, ends_a = np.array(plans[:n]), np.array(ends[:n])
    return PipelineStretch(plan0, requests, firsts, computed, left, num_groups, first_index, bs,
                           plans_a, np.array(starts[:n]), np.array(logged[:n]), ends_a,
                           frees[:n], num_seqs[:n], kv_tokens[:n], used[:n],
                           [0, *accumulate(len(group) for group in groups)],
                           [-b for b in change[:n + 1]])


def hand_off(state: ReplicaState, stretch: PipelineStretch, k: int, log: IterationLog
             ) -> tuple[list[Request], list[Iteration]]:
    """Commit the stretch as the stepped replica stands at plan k's turn (1 <= k <= N), the
    iterations in flight before it complete already where they ended by then: iterations
    0..k-G complete (logged, their tokens sampled, requests finished), plans up to k - 1
    sent (tokens computed, blocks grown); return the requests that left, and iterations
    k-G+1..k-1 (those of them in the stretch), in flight."""
    kv = state.kv
    bs = stretch.block_size
    g_n = stretch.num_groups
    done_k = max(0, k - g_n + 1)  # iterations complete
    first = stretch.first_index
    if done_k:
        assert len(log) == first
        log.extend_stretch(stretch.starts_s[:done_k], stretch.duration_s[:done_k],
                           stretch.num_seqs[:done_k].tolist(), stretch.num_used_blocks[:done_k],
                           len(stretch.plan0.preempted_ids))
    leaving: list[tuple[int, int]] = []
    num_sampled = 0
    grow_to = kv.grow_to
    add_sampled = log.add_sampled_strided
    for pos, (req, f, c, n_left) in enumerate(zip(stretch.requests, stretch.first_steps,
                                                  stretch.num_computed,
                                                  stretch.num_steps_left, strict=True)):
        # Its iterations f, f + G, ... among the first k sent and the first done_k complete.
        started = (k - f + g_n - 1) // g_n if k > f else 0
        if started > n_left:
            started = n_left
        complete = (done_k - f + g_n - 1) // g_n if done_k > f else 0
        if complete > n_left:
            complete = n_left
        req.num_computed_tokens = c + started
        req.num_in_flight_tokens += started - complete
        if complete:
            req.num_output_tokens += complete
            num_sampled += complete
            add_sampled(req.request_id, first + f, complete, g_n)
        if complete == n_left:
            leaving.append((f + g_n * (n_left - 1), pos))
        else:
            grow_to(req.request_id, cdiv(c + started, bs))
    state.decoded(num_sampled)
    done = []
    end = stretch.end_s
    leaving.sort()  # by the iteration that ends it, then running order
    for j, pos in leaving:
        req = stretch.requests[pos]
        state.leave([req], float(end[j]))
        done.append(req)
    return done, [_in_flight(stretch, j) for j in range(done_k, k)]


def _in_flight(stretch: PipelineStretch, j: int) -> Iteration:
    """Iteration j as the stepped replica holds it in flight: its plan, shape and times, and
    what `ReplicaState.start` returned for it."""
    g_n = stretch.num_groups
    g = j % g_n
    turn = j // g_n
    lo, hi = stretch.group_bounds[g], stretch.group_bounds[g + 1]
    in_flight = []
    scheduled: dict[int, int] = {}
    for req, n_left in zip(stretch.requests[lo:hi], stretch.num_steps_left[lo:hi], strict=True):
        if turn < n_left:
            scheduled[req.request_id] = 1
            in_flight.append((req, 1, req.num_preemptions, SAMPLES, False))
    plan = stretch.plan0 if j == 0 else Plan(scheduled)
    shape = BatchShape.decode_only(int(stretch.num_seqs[j]), int(stretch.kv_tokens[j]))
    it = Iteration(plan, shape, float(stretch.starts_s[j]), float(stretch.duration_s[j]),
                   float(stretch.end_s[j]), stretch.num_used_blocks[j], 0)
    it.in_flight = in_flight
    return it
