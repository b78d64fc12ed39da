"""The SimPy engine: it owns time. Arrivals feed replicas; each replica runs its scheduler's
plans for as long as the latency model says, then commits them.

SimPy is imported here and in `sim/cluster.py`, nowhere else in `sim/`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
import simpy

from sim.iteration_log import IterationLog
from sim.latency.base import BatchShape, LatencyModel
from sim.plan import Plan
from sim.request import Request, Status
from sim.routers.base import ReplicaLoad
from sim.schedulers.base import Scheduler, future_blocks, reserved_blocks
from sim.state import ReplicaState
from sim.stretch import Stretch, commit_stretch, plan_stretch

Hook = Callable[[Request], None]


class Replica:
    """One model instance: a scheduler, a latency model and a KV cache, run as a SimPy process.

    In a disaggregated cluster a prefill replica hands each request off after its first token
    (`on_handoff`), and a decode replica takes requests whose KV arrives by transfer
    (`reserve`, then `join`)."""

    def __init__(self, env: simpy.Environment, replica_id: int, scheduler: Scheduler,
                 latency: LatencyModel, state: ReplicaState, *, horizon_s: float | None = None,
                 fast_forward: bool = True, pool: str = "colocated",
                 on_handoff: Hook | None = None) -> None:
        self.env = env
        self.replica_id = replica_id
        self.scheduler = scheduler
        self.latency = latency
        self.state = state
        self.horizon_s = horizon_s
        self.fast_forward = fast_forward
        self.pool = pool
        self.on_handoff = on_handoff
        self.log = IterationLog()
        # The replica keeps its own clock so that iteration times are sums of durations, exactly
        # as a step-by-step run computes them; SimPy's clock orders the events.
        self.clock_s = 0.0
        self._poke: simpy.Event | None = None
        self._stretch: Stretch | None = None  # the decode stretch in progress, if any
        # Decode side: requests waiting for KV blocks here, and those whose KV is on its way.
        self._pending: deque[tuple[Request, simpy.Event]] = deque()
        self._incoming: dict[int, Request] = {}
        self.process = env.process(self.run())

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
        # Blocks are taken between iterations only (a stretch in progress is cut), so every
        # iteration's plan sees the KV it was scheduled with.
        self._wake()
        return done

    def join(self, req: Request) -> None:
        """Decode side: `req`'s KV has arrived; it decodes here from now on."""
        del self._incoming[req.request_id]
        req.move_to(self.replica_id)
        req.status = Status.RUNNING
        self.state.requests[req.request_id] = req
        self.state.running.append(req)
        self._wake()

    def release(self, req: Request) -> None:
        """Prefill side: `req`'s KV has been sent; its blocks here are free again."""
        self.state.release(req)
        self._wake()

    def load(self) -> ReplicaLoad:
        """Requests in flight here, and tokens of work queued or resident, as of now (a decode
        stretch in progress counts the tokens it has produced so far)."""
        state = self.state
        tokens = sum(r.num_uncomputed_tokens for r in state.waiting)
        tokens += sum(r.num_tokens for r in state.running)
        tokens += sum(r.num_tokens for r in self._incoming.values())
        tokens += sum(r.num_prompt_tokens for r, _ in self._pending)
        stretch = self._stretch
        if stretch is not None:
            steps = int(np.searchsorted(stretch.end_s, self.env.now, side="right"))
            tokens += steps * len(stretch.requests)
        num_outstanding = (state.num_outstanding + len(self._incoming) + len(self._pending))
        return ReplicaLoad(num_outstanding, tokens)

    def _wake(self) -> None:
        if self._poke is not None and not self._poke.triggered:
            self._poke.succeed()

    def run(self) -> Generator[simpy.Event, Any, None]:
        state = self.state
        while True:
            if self._pending:
                self._admit_pending()
            if not state.running and not state.waiting:
                yield from self._wait_for_work()
                continue
            plan = self.scheduler.schedule(state, self.clock_s)
            if not plan:
                if state.running or not (state.num_transferring or self._incoming):
                    raise RuntimeError(f"replica {self.replica_id}: requests queued, none can run")
                # KV held by transfers (out of a prefill replica, or into a decode one) fills
                # this replica: wait until one completes (or a request arrives).
                yield from self._wait_for_work()
                continue
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
        num_waiting = len(state.waiting)
        duration_s = float(self.latency.iteration_time_s(shape))
        start_s, end_s = self.clock_s, self.clock_s + duration_s
        yield self.env.timeout(duration_s)
        self.clock_s = end_s
        iteration = self.log.append(start_s, duration_s, shape.num_prefill_tokens,
                                    shape.num_decode_tokens, plan.num_seqs,
                                    state.kv.num_used_blocks, len(plan.preempted_ids),
                                    num_waiting)
        self._left_running(state.commit(plan, iteration, start_s, end_s))

    def _run_stretch(self, stretch: Stretch) -> Generator[simpy.Event, Any, None]:
        """Decode-only iterations until the first completion, KV shortfall, or arrival."""
        self._stretch = stretch
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
        self._stretch = None
        self.clock_s = float(stretch.end_s[num_steps - 1])
        self._left_running(commit_stretch(self.state, stretch, num_steps, self.log))

    def _left_running(self, done: list[Request]) -> None:
        for req in done:
            if req.status is Status.TRANSFERRING and self.on_handoff is not None:
                self.on_handoff(req)

    def _admit_pending(self) -> None:
        state, kv = self.state, self.state.kv
        cfg = self.scheduler.config
        cap = cfg.decode_reserve_tokens
        while self._pending:
            req, event = self._pending[0]
            if len(state.running) + len(self._incoming) >= cfg.max_num_seqs:
                return
            reserve = reserved_blocks(state, cap)
            reserve += sum(future_blocks(state, r, cap) for r in self._incoming.values())
            own_future = future_blocks(state, req, cap) - kv.num_blocks_to_grow(req, 0)
            if not kv.try_allocate(req, 0, reserve + own_future):
                return
            self._pending.popleft()
            self._incoming[req.request_id] = req
            event.succeed()


def feed_arrivals(env: simpy.Environment, requests: list[Request], route: Hook,
                  on_progress: Callable[[int, int], None] | None = None
                  ) -> Generator[simpy.Event, Any, None]:
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


Progress = Callable[[int, int], None]


def simulate(env: simpy.Environment, requests: list[Request], route: Hook,
             horizon_s: float | None, on_progress: Progress | None = None) -> None:
    """Feed the arrivals and run to completion, or to the horizon."""
    env.process(feed_arrivals(env, requests, route, on_progress))
    env.run(until=horizon_s)
