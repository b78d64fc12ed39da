"""The SimPy engine: it owns time. Arrivals feed replicas; each replica runs its scheduler's
plans for as long as the latency model says, then commits them.

SimPy is imported here and nowhere else in `sim/`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import simpy

from sim.iteration_log import IterationLog
from sim.latency.base import BatchShape, LatencyModel
from sim.plan import Plan
from sim.request import Request, Status
from sim.schedulers.base import Scheduler
from sim.state import ReplicaState
from sim.stretch import Stretch, commit_stretch, plan_stretch


class Replica:
    """One model instance: a scheduler, a latency model and a KV cache, run as a SimPy process."""

    def __init__(self, env: simpy.Environment, replica_id: int, scheduler: Scheduler,
                 latency: LatencyModel, state: ReplicaState, *, horizon_s: float | None = None,
                 fast_forward: bool = True,
                 on_finish: Callable[[Request], None] | None = None) -> None:
        self.env = env
        self.replica_id = replica_id
        self.scheduler = scheduler
        self.latency = latency
        self.state = state
        self.horizon_s = horizon_s
        self.fast_forward = fast_forward
        self.on_finish = on_finish
        self.log = IterationLog()
        # The replica keeps its own clock so that iteration times are sums of durations, exactly
        # as a step-by-step run computes them; SimPy's clock orders the events.
        self.clock_s = 0.0
        self._poke: simpy.Event | None = None
        self.process = env.process(self.run())

    def submit(self, req: Request) -> None:
        """A request arrives (now). Rejected at once if it can never be served here."""
        req.replica_id = self.replica_id
        reason = self.scheduler.reject_reason(req, self.state.kv)
        if reason is not None:
            req.status, req.reason = Status.REJECTED, reason
            self.state.requests[req.request_id] = req
            return
        self.state.add(req)
        if self._poke is not None and not self._poke.triggered:
            self._poke.succeed()

    def run(self) -> Generator[simpy.Event, Any, None]:
        state = self.state
        while True:
            if not state.running and not state.waiting:
                yield from self._wait_for_work()
                continue
            plan = self.scheduler.schedule(state, self.clock_s)
            if not plan:
                raise RuntimeError(f"replica {self.replica_id}: requests queued, none can run")
            stretch = None
            if self.fast_forward and self.scheduler.steady(state, plan):
                stretch = plan_stretch(state, self.latency, self.clock_s, self.horizon_s)
            if stretch is not None:
                yield from self._run_stretch(stretch)
            else:
                yield from self._run_iteration(plan)

    def _wait_for_work(self) -> Generator[simpy.Event, Any, None]:
        self._poke = self.env.event()
        yield self._poke
        self._poke = None
        self.clock_s = max(self.clock_s, self.env.now)

    def _run_iteration(self, plan: Plan) -> Generator[simpy.Event, Any, None]:
        state = self.state
        shape = BatchShape.from_plan(plan, state.requests)
        duration_s = float(self.latency.iteration_time_s(shape))
        start_s, end_s = self.clock_s, self.clock_s + duration_s
        yield self.env.timeout(duration_s)
        self.clock_s = end_s
        iteration = self.log.append(start_s, duration_s, shape.num_prefill_tokens,
                                    shape.num_decode_tokens, plan.num_seqs,
                                    state.kv.num_used_blocks, len(plan.preempted_ids))
        self._finished(state.commit(plan, iteration, start_s, end_s))

    def _run_stretch(self, stretch: Stretch) -> Generator[simpy.Event, Any, None]:
        """Decode-only iterations until the first completion, KV shortfall, or arrival."""
        self._poke = self.env.event()
        done = self.env.timeout(max(0.0, float(stretch.end_s[-1]) - self.env.now))
        fired = yield done | self._poke
        self._poke = None
        num_steps = len(stretch)
        if done not in fired:  # an arrival: finish the iteration in progress, then reschedule
            num_steps = stretch.steps_done_by(self.env.now)
            remaining_s = float(stretch.end_s[num_steps - 1]) - self.env.now
            if remaining_s > 0:
                yield self.env.timeout(remaining_s)
        self.clock_s = float(stretch.end_s[num_steps - 1])
        self._finished(commit_stretch(self.state, stretch, num_steps, self.log))

    def _finished(self, finished: list[Request]) -> None:
        if self.on_finish is not None:
            for req in finished:
                self.on_finish(req)


Progress = Callable[[int, int], None]


def feed_arrivals(env: simpy.Environment, requests: list[Request],
                  route: Callable[[Request], None],
                  on_progress: Progress | None = None) -> Generator[simpy.Event, Any, None]:
    """Hand each request to `route` at its arrival time; report progress now and then."""
    total = len(requests)
    every = max(1, total // 200)
    for i, req in enumerate(requests):
        delay = req.arrival_s - env.now
        if delay > 0:
            yield env.timeout(delay)
        route(req)
        if on_progress is not None and (i + 1) % every == 0:
            on_progress(i + 1, total)


def simulate(env: simpy.Environment, requests: list[Request], route: Callable[[Request], None],
             horizon_s: float | None, on_progress: Progress | None = None) -> None:
    """Feed the arrivals and run to completion, or to the horizon."""
    env.process(feed_arrivals(env, requests, route, on_progress))
    env.run(until=horizon_s)
