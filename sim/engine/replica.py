"""The SimPy engine's replicas: each runs its scheduler's plans for as long as the latency
model says, then commits them; stretches of predictable iterations (`sim.engine.fastpath.stretch`)
and iterations nothing outside can see in between run ahead without an event each (the fast
path). `sim.engine.clock` owns the order of events at one instant.

SimPy is imported here, in `sim/engine/clock.py`, in `sim/engine/pipeline.py` (a replica keeping
several iterations in flight down a pipeline of GPUs) and in `sim/engine/disaggregation.py`, nowhere
else in `sim/`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
import simpy

from sim.config.errors import InputError
from sim.core.plan import Plan
from sim.core.request import Request, Status
from sim.core.state import InFlight, ReplicaState
from sim.engine.clock import PLAN, At, Environment, Hook
from sim.engine.disaggregation import DecodeInbox
from sim.engine.fastpath.commit import allocate_first_step, commit_stretch
from sim.engine.fastpath.stretch import Stretch, is_steady, plan_stretch
from sim.engine.iteration_log import IterationLog
from sim.latency.base import BatchShape, LatencyModel
from sim.latency.noise import IterationNoise
from sim.routers.base import ReplicaLoad
from sim.schedulers.base import Scheduler
from sim.workloads.base import MAX_SPAN_S

# Most iterations a decode stretch is planned for. New work cuts most stretches after a few
# dozen iterations, while planning costs grow with the length; one that runs to the end is
# followed by another (the same results, one more event).
STRETCH_STEPS = 128


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 3x, on a hot path
class Iteration:
    """One planned iteration in flight, with what the log records of it at planning time."""

    plan: Plan
    shape: BatchShape
    start_s: float
    duration_s: float
    end_s: float  # start_s + duration_s
    num_kv_blocks_used: int
    num_waiting: int
    # Pipelined replica (`sim.engine.pipeline`): the requests sent down the pipeline.
    in_flight: list[InFlight] | None = None


class Replica:
    """One model instance: a scheduler, a latency model and a KV cache, run as a SimPy process.

    In a disaggregated cluster (`sim.engine.disaggregation`) a prefill replica hands each request
    off after its first token (`on_handoff`), and a decode replica's `inbox` holds the requests
    whose KV is to arrive by transfer."""

    def __init__(self, env: Environment, replica_id: int, scheduler: Scheduler,
                 latency: LatencyModel, state: ReplicaState, *, horizon_s: float | None = None,
                 fast_forward: bool = True, pool: str = "colocated",
                 quiet_until: Callable[[], float] | None = None,
                 where: tuple[str, str, Any] = ("<scenario>", "replica.latency", None),
                 noise: IterationNoise | None = None) -> None:
        self.env = env
        self.replica_id = replica_id
        self.turn = PLAN + replica_id
        self.scheduler = scheduler
        self.latency = latency
        # Per-iteration jitter by iteration index (`sim.latency.noise`): the i-th iteration of this
        # replica gets its i-th factor, stepped or in a stretch alike.
        self.noise = noise
        self.state = state
        self.horizon_s = horizon_s
        self.fast_forward = fast_forward
        self.pool = pool
        self.on_handoff: Hook | None = None
        self.inbox: DecodeInbox | None = None
        # The earliest time anything outside this replica may read or change it, asked when it
        # plans: its iterations ending before then commit without an event each. By default
        # the next event of any kind; never for a prefill replica, whose hand-offs start
        # transfers at the instant an iteration ends.
        self.quiet_until = _never if pool == "prefill" else quiet_until or env.peek
        # (file, field, value) named by errors about this replica's latency model.
        self.where = where
        self.log = IterationLog()
        # Set to a list to keep the plan of every iteration logged one by one (stepped, not
        # in a stretch): the golden schedules compare them with an engine's steps.
        self.plans: list[Plan] | None = None
        self._poke: simpy.Event | None = None
        # Work planned and not yet committed: one iteration, or a stretch.
        self._inflight: Iteration | Stretch | None = None
        # A stretch cut short by new work, and the iterations of it kept: resumed if, once the
        # replica has taken the work in, its plan would be the same (`_resume`).
        self._uncut: tuple[Stretch, int] | None = None
        self.process = env.process(self.run())

    # -- what the rest of the cluster sees and does --------------------------------------------

    def submit(self, req: Request) -> None:
        """A request arrives (now). Rejected at once if it can never be served here."""
        req.replica_id = req.prefill_replica_id = self.replica_id
        reason = self.scheduler.reject_reason(req, self.state.kv,
                                              self.state.num_kv_tokens_needed(req))
        if reason is not None:
            req.status, req.reason = Status.REJECTED, reason
            self.state.requests[req.request_id] = req
            return
        self.state.add(req)
        self.wake()

    def wake(self) -> None:
        """Something changed here (work arrived, KV was freed): plan again, at this replica's
        turn now, cutting a stretch in progress after its current iteration."""
        if self._poke is not None and not self._poke.triggered:
            self._poke.succeed()

    def load(self, req: Request | None = None) -> ReplicaLoad:
        """Requests in flight here, and tokens of work queued or resident, as of now; with
        `req`, also how many of its tokens are cached here."""
        state = self.state
        work = self._inflight
        decoded = num_finished = 0
        if isinstance(work, Stretch) and req is None:
            # A stretch in progress: the counts its ended iterations change, read
            # without committing them (a router reads every replica at every arrival).
            decoded, num_finished, finished_tokens = work.ended_counts(
                work.num_ended_by(self.env.now))
            decoded -= finished_tokens
        else:
            self.sync()  # prefix hits read the cache as the ended iterations left it
        tokens = state.num_waiting_tokens + state.num_running_tokens + decoded
        num_outstanding = state.num_outstanding - num_finished
        if self.inbox is not None:
            tokens += self.inbox.num_tokens
            num_outstanding += self.inbox.num_requests
        hit = state.kv.prefix_hit_tokens(req) if req is not None else 0
        return ReplicaLoad(num_outstanding, tokens, hit)

    def sync(self, *, before_s: float | None = None) -> None:
        """Commit the planned work that has ended by now (or strictly before `before_s`): the
        replica then looks exactly as a step-by-step run shows it at this instant. Called by
        whatever reads the replica's state; adding requests to its queues needs no sync, as
        committing work in flight never reads them."""
        work = self._inflight
        if work is None:
            return
        inclusive = before_s is None
        now = self.env.now if before_s is None else before_s
        if isinstance(work, Iteration):
            if work.end_s < now or (inclusive and work.end_s == now):
                self._inflight = None
                self._commit(work)
            return
        num_steps = work.num_ended_by(now, inclusive=inclusive)
        if num_steps:
            done, work = commit_stretch(self.state, work, num_steps, self.log)
            self._inflight = work
            self._left_running(done)
        # With prefix caching, the blocks the iteration in progress allocated may have evicted
        # cached prefixes, which a router reads: allocate them as a step-by-step run has.
        if work is not None and self.state.kv.caches_prefixes and inclusive and (
                work.start_s < now or self.env.reached(self.turn)):
            self._inflight = allocate_first_step(self.state, work)

    def next_commit_s(self) -> float:
        """The earliest time this replica may commit work (and, on a prefill replica, hand a
        request off): when its work in progress ends; now if it has work and none in progress
        (it plans at this instant, or waits for KV); never while it is idle."""
        work = self._inflight
        if work is not None:
            return work.end_s if isinstance(work, Iteration) else float(work.end_s[0])
        state = self.state
        return self.env.now if state.waiting or state.running else math.inf

    def stop(self, horizon_s: float) -> None:
        """The clock stopped at `horizon_s`: commit what ended before it; the iteration in
        progress holds the KV blocks it was planned with, as in a step-by-step run."""
        self.sync(before_s=horizon_s)
        if isinstance(self._inflight, Stretch):
            self._inflight = allocate_first_step(self.state, self._inflight)

    # -- the replica's own process ---------------------------------------------------------

    def run(self) -> Generator[simpy.Event, Any, None]:
        state = self.state
        # The replica's own clock: ahead of the environment's while it runs ahead (below).
        now = self.env.now
        while True:
            self.sync()
            if self.inbox is not None and self.inbox.pending:
                yield from self._admit_transfers(now)
            # A stretch cut short by new work goes on where that work changes no plan.
            work: Stretch | Iteration | None = self._resume() if self._uncut is not None \
                else None
            plan = None
            if work is None:
                plan = self.scheduler.schedule(state, now) if state.running or state.waiting \
                    else None
                if not plan:
                    yield from self._wait_idle(plan, now)
                    now = self.env.now
                    continue
            # Nothing outside this replica can look at it or change it before `quiet_s`, so
            # the iterations that end before then are committed at once, with no event each:
            # what a step-by-step run computes, in the same order, without the event loop.
            quiet_s = self.quiet_until() if self.fast_forward else -math.inf
            if plan is not None:
                # A stretch of iterations where every following plan repeats this one
                # (`is_steady`: the fast path), else its one iteration.
                if (self.fast_forward and not self.latency.sequential
                        and self.scheduler.allows_stretches and is_steady(state, plan)):
                    first = None
                    if plan.total_num_scheduled_tokens > plan.num_seqs:
                        # A prompt's chunk. Where new work may come before it ends, it would
                        # most likely cut a stretch there: the iteration is stepped, at a
                        # fraction of the cost of a stretch planned and cut.
                        first = work = self._plan_iteration(plan, now)
                    if first is None or first.end_s < quiet_s:
                        stretch = plan_stretch(
                            state, plan, self.latency, now, self.horizon_s,
                            through_finishes=self._through_finishes(), noise=self.noise,
                            first_index=len(self.log), max_steps=STRETCH_STEPS,
                            num_preempted=len(plan.preempted_ids),
                            first_s=None if first is None else first.duration_s)
                        if stretch is not None:
                            self._check_durations(stretch.starts_s, stretch.duration_s,
                                                  stretch.end_s)
                            work = stretch
                if work is None:
                    work = self._plan_iteration(plan, now)
            assert work is not None  # planned, or resumed
            if isinstance(work, Stretch):
                if work.end_s[-1] < quiet_s:
                    self._left_running(commit_stretch(state, work, len(work), self.log)[0])
                    now = float(work.end_s[-1])
                    continue
                yield from self._run_stretch(work)
            else:
                if work.end_s < quiet_s:
                    self._commit(work)
                    now = work.end_s
                    continue
                self._inflight = work
                yield At(self.env, work.end_s, self.turn)
            now = self.env.now

    def _through_finishes(self) -> bool:
        """Whether a stretch may run past its requests' finishes: only where freeing blocks
        decides nothing (no prefix cache, which frees into its eviction order, and no transfer
        waiting for a decode slot)."""
        return not self.state.kv.caches_prefixes and not (
            self.inbox is not None and self.inbox.pending)

    def _resume(self) -> Stretch | None:
        """The rest of the stretch that new work cut short, if this replica, having taken the
        work in (a decode replica admits a transfer: blocks for KV still on its way), would plan
        its iterations all the same; else None (and the replica plans as usual). The same
        plan: nothing waits and the running requests are the stretch's, so every policy gives
        each its one decode token, as it did when the stretch was planned; and the blocks its
        iterations may add (one per request per block of tokens, as `plan_stretch` counts)
        are free, so none is preempted. It stops at its first finish where a finish now
        decides something (a transfer still waits for a slot)."""
        assert self._uncut is not None
        stretch, num_kept = self._uncut
        self._uncut = None
        state = self.state
        kv = state.kv
        if state.waiting or num_kept >= len(stretch):
            return None
        rest = stretch.after(num_kept, 0)  # blocks in use: known once its first step allocates
        if rest.prefill_pos >= 0:  # a prompt still in chunks: its blocks are not in the bound below
            return None
        num_steps = len(rest)
        # The running list is the rest's requests, in order (the same objects): nobody joined.
        if state.running != rest.requests:
            return None
        if len(rest.requests) * ((num_steps - 1) // kv.block_size + 2) > kv.num_free_blocks:
            return None
        if not self._through_finishes() and rest.min_steps_left < num_steps:
            rest = rest.head(rest.min_steps_left)
        rest = allocate_first_step(state, rest)
        rest.num_used_blocks = kv.num_used_blocks
        return rest

    def _admit_transfers(self, now_s: float) -> Generator[simpy.Event, Any, None]:
        """Admit the transfers waiting in the inbox at this replica's clock `now_s` (admitting
        one starts it, so the environment's clock must have caught up first)."""
        if now_s > self.env.now:
            yield At(self.env, now_s, self.turn)
        assert self.inbox is not None
        self.inbox.admit()

    def _wait_idle(self, plan: Plan | None, now_s: float) -> Generator[simpy.Event, Any, None]:
        """Nothing to run at this replica's clock `now_s` (`plan` empty, or None with nothing
        queued): idle, or KV held by transfers (out of a prefill replica, or into a decode one)
        fills it; wait until a request arrives or a transfer completes. An empty plan with
        requests running and nothing transferring can never change: an error."""
        state = self.state
        if plan is not None and (state.running or not (
                state.num_transferring or state.incoming)):
            raise RuntimeError(f"replica {self.replica_id}: requests queued, none can run")
        if now_s > self.env.now:
            yield At(self.env, now_s, self.turn)
        yield from self._wait_for_work()

    def _wait_for_work(self) -> Generator[simpy.Event, Any, None]:
        self._poke = self.env.event()
        yield self._poke
        self._poke = None
        yield At(self.env, self.env.now, self.turn)  # plan after all else at this instant

    def _plan_iteration(self, plan: Plan, start_s: float, num_before: int = 0) -> Iteration:
        """The iteration of `plan` from `start_s`; `num_before` iterations not yet logged come
        before it (a pipeline's in flight)."""
        state = self.state
        shape = BatchShape.of_replica(plan, state)
        duration_s = float(self.latency.iteration_time_s(shape))
        if self.noise is not None:
            duration_s = duration_s * self.noise.factor(
                len(self.log) + num_before, shape.num_prefill_tokens, shape.num_decode_tokens)
        end_s = start_s + duration_s
        if not start_s < end_s < MAX_SPAN_S:  # NaN fails too
            self._check_durations(np.array([start_s]), np.array([duration_s]),
                                  np.array([end_s]))
        return Iteration(plan, shape, start_s, duration_s, end_s, state.kv.num_used_blocks,
                         len(state.waiting))

    def _run_stretch(self, stretch: Stretch) -> Generator[simpy.Event, Any, None]:
        """A stretch's iterations until its end (a finish or a KV shortfall), or new work."""
        self._inflight = stretch
        poke = self._poke = self.env.event()
        # The stretch's end pokes too (a callback, cheaper than waiting on `end | poke`); a
        # stale end, of a stretch already cut, finds its poke triggered.
        end = At(self.env, float(stretch.end_s[-1]), self.turn)
        def on_end(_: simpy.Event) -> None:
            if not poke.triggered:
                poke.succeed(_ENDED)

        end.callbacks.append(on_end)
        ended = yield poke
        self._poke = None
        if ended is _ENDED:
            return  # the stretch has ended; this is the replica's turn to plan
        # New work: stop after the iteration in progress, then plan with it at that turn. An
        # iteration starting now is in progress only if this replica's planning turn at this
        # instant has passed (a step-by-step run would have planned it already).
        rest, cut_s = self._inflight, self.env.now
        if isinstance(rest, Stretch):
            self._inflight = rest.cut_at(cut_s, started_now=self.env.reached(self.turn))
            if self._inflight is not None:
                cut_s = float(self._inflight.end_s[-1])
                if not self.state.waiting:  # a request waiting here changes the plan
                    self._uncut = (rest, len(self._inflight))
        yield At(self.env, cut_s, self.turn)

    def _commit(self, it: Iteration) -> None:
        since = self.log.last_decode_iteration  # before this one is logged
        iteration = self._log(it)
        self._left_running(self.state.commit(it.plan, iteration, it.start_s, it.end_s, since))
        self.scheduler.iteration_ended(it.plan)

    def _log(self, it: Iteration) -> int:
        """Add an iteration that has ended to the log; return its number."""
        shape = it.shape
        if self.plans is not None:
            self.plans.append(it.plan)
        return self.log.append(it.start_s, it.duration_s, shape.num_prefill_tokens,
                               shape.num_decode_tokens, it.plan.num_seqs, it.num_kv_blocks_used,
                               len(it.plan.preempted_ids), it.num_waiting)

    def _left_running(self, done: list[Request]) -> None:
        for req in done:
            if req.status is Status.TRANSFERRING and self.on_handoff is not None:
                self.on_handoff(req)

    def _check_durations(self, starts_s: np.ndarray, duration_s: np.ndarray, end_s: np.ndarray
                         ) -> None:
        """Every iteration must take a finite, positive time that moves the clock forward."""
        # Each end is its start plus a duration: every end after its start means every duration
        # is positive and moves the clock (NaN fails the comparisons too).
        if end_s[-1] < MAX_SPAN_S and (end_s > starts_s).all():
            return
        starts = starts_s
        bad = ~(np.isfinite(duration_s) & (duration_s > 0) & (end_s > starts))
        if not bad.any() and end_s[-1] >= MAX_SPAN_S:
            # Past 2**32 s float64 times resolve less than a microsecond: TBTs would be noise.
            i = int(np.argmax(end_s >= MAX_SPAN_S))
            raise InputError(*self.where, (
                f"predicted {float(duration_s[i]):.3g} s for an iteration at "
                f"t={starts[i]:.6g} s: the run passes 2**32 s (136 years), beyond which times "
                "lose their resolution; check the GPU's and the latency model's figures"))
        if bad.any():
            i = int(np.argmax(bad))
            value = float(duration_s[i])
            problem = (f"predicted {value:.3g} s for an iteration at t={starts[i]:.6g} s: every "
                       "iteration must take a finite, positive time"
                       if not (math.isfinite(value) and value > 0) else
                       f"an iteration of {value:.3g} s starting at t={starts[i]:.6g} s does not "
                       "move the clock (float64 resolution): the run spans too long")
            raise InputError(*self.where, problem)


_ENDED = object()  # what a stretch's own end pokes with


def _never() -> float:
    return -math.inf
