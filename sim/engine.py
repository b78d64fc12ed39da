"""The SimPy engine: it owns time. Arrivals feed replicas; each replica runs its scheduler's
plans for as long as the latency model says, then commits them.

Events at the same instant happen in one fixed order, whether a replica steps every iteration or
fast-forwards a stretch of them, so both give identical results:
1. iterations ending at that instant are complete: whoever looks at a replica (a router reading
   its load, a transfer handing it KV) first commits the work it has finished by now (`sync`);
2. arrivals, KV transfers and everything else, in the order they were scheduled;
3. last, replicas plan their next iteration, in replica order (priority `PLAN + replica_id`),
   having seen everything else that happened at that instant.

SimPy is imported here and in `sim/cluster.py`, nowhere else in `sim/`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from heapq import heappush
from typing import Any

import numpy as np
import simpy

from sim.errors import InputError
from sim.iteration_log import IterationLog
from sim.latency.base import BatchShape, LatencyModel
from sim.plan import Plan
from sim.request import Request, Status
from sim.routers.base import ReplicaLoad
from sim.schedulers.base import Scheduler
from sim.state import ReplicaState
from sim.stretch import Stretch, allocate_first_step, commit_stretch, plan_stretch

Hook = Callable[[Request], None]
NORMAL = simpy.events.NORMAL
PLAN = NORMAL + 1  # a replica's turn to plan: after everything else at the same instant


class Environment(simpy.Environment):
    """SimPy's environment, able to schedule an event at an absolute time (a stretch's iteration
    ends must fall on exactly the floats a step-by-step run reaches, and `now + delay` cannot
    always reach a given float), and to say which priorities the current instant has reached."""

    def __init__(self) -> None:
        super().__init__()
        self._phase_s = -math.inf  # the instant `_phase` belongs to
        self._phase = 0  # the highest priority processed at that instant so far

    def schedule_at(self, event: simpy.Event, priority: int, at_s: float) -> None:
        assert at_s >= self._now
        entry = (at_s, simpy.events.EventPriority(priority), next(self._eid), event)
        heappush(self._queue, entry)

    def step(self) -> None:
        if self._queue:
            at_s, priority = self._queue[0][0], self._queue[0][1]
            self._phase = priority if at_s != self._phase_s else max(self._phase, priority)
            self._phase_s = at_s
        super().step()

    def reached(self, priority: int) -> bool:
        """Whether this instant's events have reached `priority`: a replica whose planning turn
        that is has planned (or, mid-stretch, would have, stepping) its iteration starting now."""
        return self._phase_s == self._now and self._phase >= priority


class At(simpy.Event):
    """An event processed at the absolute time `at_s`, after any earlier `priority`."""

    def __init__(self, env: Environment, at_s: float, priority: int) -> None:
        super().__init__(env)
        self._ok = True  # as `simpy.Timeout`: triggered from the start, processed at `at_s`
        self._value = None
        env.schedule_at(self, priority, at_s)


@dataclass(frozen=True, slots=True)
class Iteration:
    """One planned iteration in flight, with what the log records of it at planning time."""

    plan: Plan
    shape: BatchShape
    start_s: float
    duration_s: float
    end_s: float  # start_s + duration_s
    num_kv_blocks_used: int
    num_waiting: int


class Replica:
    """One model instance: a scheduler, a latency model and a KV cache, run as a SimPy process.

    In a disaggregated cluster a prefill replica hands each request off after its first token
    (`on_handoff`), and a decode replica takes requests whose KV arrives by transfer
    (`reserve`, then `join`)."""

    def __init__(self, env: Environment, replica_id: int, scheduler: Scheduler,
                 latency: LatencyModel, state: ReplicaState, *, horizon_s: float | None = None,
                 fast_forward: bool = True, pool: str = "colocated",
                 on_handoff: Hook | None = None,
                 where: tuple[str, str, Any] = ("<scenario>", "replica.latency", None)
                 ) -> None:
        self.env = env
        self.replica_id = replica_id
        self.turn = PLAN + replica_id
        self.scheduler = scheduler
        self.latency = latency
        self.state = state
        self.horizon_s = horizon_s
        self.fast_forward = fast_forward
        self.pool = pool
        self.on_handoff = on_handoff
        # (file, field, value) named by errors about this replica's latency model.
        self.where = where
        self.log = IterationLog()
        self._poke: simpy.Event | None = None
        # Work planned and not yet committed: one iteration, or a decode stretch.
        self._inflight: Iteration | Stretch | None = None
        # Decode side: requests waiting for KV blocks here (their KV on its way is in
        # `state.incoming`), with the events their transfers wait on.
        self._pending: deque[tuple[Request, simpy.Event]] = deque()
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
        self._wake()

    def reserve(self, req: Request) -> simpy.Event:
        """Decode side: an event that fires once KV blocks for `req`'s prompt are allocated here
        (FCFS, with room kept for the running requests' future tokens)."""
        done = self.env.event()
        self._pending.append((req, done))
        # Blocks are taken when the replica plans (a stretch in progress is cut), so every
        # iteration's plan sees the KV it was scheduled with.
        self._wake()
        return done

    def join(self, req: Request) -> None:
        """Decode side: `req`'s KV has arrived; it decodes here from now on."""
        del self.state.incoming[req.request_id]
        req.move_to(self.replica_id)
        req.status = Status.RUNNING
        self.state.requests[req.request_id] = req
        self.state.running.append(req)
        self._wake()

    def release(self, req: Request) -> None:
        """Prefill side: `req`'s KV has been sent; its blocks here are free again."""
        self.state.release(req)
        self._wake()

    def load(self, req: Request | None = None) -> ReplicaLoad:
        """Requests in flight here, and tokens of work queued or resident, as of now; with
        `req`, also how many of its tokens are cached here."""
        self.sync()
        state = self.state
        tokens = sum(r.num_uncomputed_tokens for r in state.waiting)
        tokens += sum(r.num_tokens for r in state.running)
        tokens += sum(r.num_tokens for r in state.incoming.values())
        tokens += sum(r.num_tokens for r, _ in self._pending)
        num_outstanding = state.num_outstanding + len(state.incoming) + len(self._pending)
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

    def stop(self, horizon_s: float) -> None:
        """The clock stopped at `horizon_s`: commit what ended before it; the iteration in
        progress holds the KV blocks it was planned with, as in a step-by-step run."""
        self.sync(before_s=horizon_s)
        if isinstance(self._inflight, Stretch):
            self._inflight = allocate_first_step(self.state, self._inflight)

    # -- the replica's own process ---------------------------------------------------------

    def run(self) -> Generator[simpy.Event, Any, None]:
        state = self.state
        while True:
            self.sync()
            if self._pending:
                self._admit_pending()
            if not state.running and not state.waiting:
                yield from self._wait_for_work()
                continue
            now = self.env.now
            plan = self.scheduler.schedule(state, now)
            if not plan:
                if state.running or not (state.num_transferring or state.incoming):
                    raise RuntimeError(f"replica {self.replica_id}: requests queued, none can run")
                # KV held by transfers (out of a prefill replica, or into a decode one) fills
                # this replica: wait until one completes (or a request arrives).
                yield from self._wait_for_work()
                continue
            stretch = None
            if (self.fast_forward and not self.latency.sequential
                    and self.scheduler.steady(state, plan)):
                stretch = plan_stretch(state, self.latency, now, self.horizon_s)
            if stretch is not None:
                self._check_durations(stretch.duration_s, stretch.end_s, now)
                yield from self._run_stretch(stretch)
            else:
                yield from self._run_iteration(plan)

    def _wait_for_work(self) -> Generator[simpy.Event, Any, None]:
        self._poke = self.env.event()
        yield self._poke
        self._poke = None
        yield At(self.env, self.env.now, self.turn)  # plan after all else at this instant

    def _run_iteration(self, plan: Plan) -> Generator[simpy.Event, Any, None]:
        state = self.state
        shape = BatchShape.from_plan(plan, state.requests)
        start_s = self.env.now
        duration_s = float(self.latency.iteration_time_s(shape))
        end_s = start_s + duration_s
        if not start_s < end_s < math.inf:  # NaN fails too
            self._check_durations(np.array([duration_s]), np.array([end_s]), start_s)
        self._inflight = Iteration(plan, shape, start_s, duration_s, end_s,
                                   state.kv.num_used_blocks,
                                   len(state.waiting))
        yield At(self.env, end_s, self.turn)

    def _run_stretch(self, stretch: Stretch) -> Generator[simpy.Event, Any, None]:
        """Decode-only iterations until the first completion or KV shortfall, or new work."""
        self._inflight = stretch
        end = At(self.env, float(stretch.end_s[-1]), self.turn)
        poke = self._poke = self.env.event()
        yield end | poke
        self._poke = None
        if end.processed:
            return  # the stretch has ended; this is the replica's turn to plan
        # New work: stop after the iteration in progress, then plan with it at that turn. An
        # iteration starting now is in progress only if this replica's planning turn at this
        # instant has passed (a step-by-step run would have planned it already).
        rest, cut_s = self._inflight, self.env.now
        if isinstance(rest, Stretch):
            self._inflight = rest.cut_at(cut_s, started_now=self.env.reached(self.turn))
            if self._inflight is not None:
                cut_s = float(self._inflight.end_s[-1])
        yield At(self.env, cut_s, self.turn)

    def _commit(self, it: Iteration) -> None:
        shape = it.shape
        iteration = self.log.append(it.start_s, it.duration_s, shape.num_prefill_tokens,
                                    shape.num_decode_tokens, it.plan.num_seqs,
                                    it.num_kv_blocks_used, len(it.plan.preempted_ids),
                                    it.num_waiting)
        self._left_running(self.state.commit(it.plan, iteration, it.start_s, it.end_s))

    def _left_running(self, done: list[Request]) -> None:
        for req in done:
            if req.status is Status.TRANSFERRING and self.on_handoff is not None:
                self.on_handoff(req)

    def _wake(self) -> None:
        if self._poke is not None and not self._poke.triggered:
            self._poke.succeed()

    def _check_durations(self, duration_s: np.ndarray, end_s: np.ndarray, start_s: float
                         ) -> None:
        """Every iteration must take a finite, positive time that moves the clock forward."""
        if duration_s.min() > 0 and start_s < end_s[0] and end_s[-1] < math.inf and (
                end_s[1:] > end_s[:-1]).all():
            return  # NaN fails the comparisons too
        starts = np.concatenate(([start_s], end_s[:-1]))
        bad = ~(np.isfinite(duration_s) & (duration_s > 0) & (end_s > starts))
        if bad.any():
            i = int(np.argmax(bad))
            value = float(duration_s[i])
            problem = (f"predicted {value:.3g} s for an iteration at t={starts[i]:.6g} s: every "
                       "iteration must take a finite, positive time"
                       if not (math.isfinite(value) and value > 0) else
                       f"an iteration of {value:.3g} s starting at t={starts[i]:.6g} s does not "
                       "move the clock (float64 resolution): the run spans too long")
            raise InputError(*self.where, problem)

    def _admit_pending(self) -> None:
        """Decode side: the scheduler takes transfers FCFS while its policy admits them."""
        while self._pending:
            req, event = self._pending[0]
            if not self.scheduler.admit_transfer(self.state, req):
                return
            self._pending.popleft()
            self.state.incoming[req.request_id] = req
            event.succeed()


def feed_arrivals(env: Environment, requests: list[Request], route: Hook,
                  on_progress: Callable[[int, int], None] | None = None
                  ) -> Generator[simpy.Event, Any, None]:
    """Hand each request to `route` at its arrival time; report progress now and then."""
    total = len(requests)
    every = max(1, total // 200)
    for i, req in enumerate(requests):
        if req.arrival_s > env.now:
            yield At(env, req.arrival_s, NORMAL)
        route(req)
        if on_progress is not None and (i + 1) % every == 0:
            on_progress(i + 1, total)


Progress = Callable[[int, int], None]


def simulate(env: Environment, requests: list[Request], route: Hook,
             horizon_s: float | None, on_progress: Progress | None = None) -> None:
    """Feed the arrivals and run to completion, or to the horizon (events at the horizon
    itself do not happen)."""
    env.process(feed_arrivals(env, requests, route, on_progress))
    env.run(until=horizon_s)
