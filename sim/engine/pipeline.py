"""A replica split into pipeline stages, run as vLLM v1 runs one: up to P iterations in flight.

vLLM v1's engine (`EngineCore.step_with_batch_queue`) keeps a queue of `max_concurrent_batches`
(the pipeline size P) iterations. While fewer are in flight, the scheduler plans another at once
from what is not in flight: it counts scheduled tokens as computed (`ReplicaState.start`), so a
decode waits for its own token and a prompt's next chunk may follow its previous one down the
pipeline. With P in flight, or nothing more to schedule, the engine blocks on the oldest
iteration's result: work arriving meanwhile waits until that iteration leaves the last stage.

Stages are servers in tandem. An iteration whose whole pass takes T (the latency model's
answer: every stage in turn plus the hand-offs) holds each stage for its share of the model's
layers times T (`Parallelism.stage_layers`, vLLM's split: T / P each where the layers divide
evenly), once it has left the stage before and the iteration ahead has left this one. The
per-iteration overhead, the LM head and the hand-offs are spread the same way, an
approximation: they belong to the engine step, the last stage and the stage sending.

It runs the reference step (`Replica.run`) with its planning, waiting and commit overridden.
Iterations ending before anything outside the replica can look at it complete without an event
each, as on a `FastReplica`. Stretches (several iterations at once) exist for one stage that
schedules ahead and for a steady pipeline of several stages (`sim.engine.fastpath.pipeline`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Generator, Sequence
from typing import Any, cast

import simpy

from sim.core.offload_jobs import JobOffloadState
from sim.core.plan import Plan
from sim.engine.clock import At
from sim.engine.offload_steps import idle_step
from sim.engine.replica import Iteration, Replica
from sim.latency.base import BatchShape


class HostBusy:
    """The engine's host is busy until `end_s` (a launch that waited for copies): nothing is
    planned before, and requests arriving meanwhile are there when it plans again."""

    __slots__ = ("end_s",)

    def __init__(self, end_s: float) -> None:
        self.end_s = end_s


class PipelinedReplica(Replica):
    """A replica of P pipeline stages (P > 1): up to P iterations in flight, as vLLM v1's
    batch queue keeps them. `stage_layers` holds each stage's number of layers."""

    def __init__(self, *args: Any, stage_layers: Sequence[int], num_in_flight: int | None = None,
                 placeholders: bool = False, stale_delivered: bool = False, **kwargs: Any
                 ) -> None:
        super().__init__(*args, **kwargs)
        self.num_stages = len(stage_layers)
        # Iterations in flight at most: one per stage, or more where the engine schedules
        # ahead (vLLM's async scheduling: two on one stage).
        self.pipeline_depth = self.num_stages if num_in_flight is None else num_in_flight
        # Async scheduling: a request's token in flight is an output placeholder, and the
        # request may be scheduled again at once (`ReplicaState.start`).
        self.placeholders = placeholders
        # The engine schedules ahead of its stages (vLLM's async scheduling, SGLang's overlap
        # loop): its host work for an iteration runs while the GPU runs the one before, so an
        # iteration takes the larger of the two (`LatencyModel.host_time_s`).
        self.overlaps_host = self.pipeline_depth > self.num_stages
        self.stale_delivered = stale_delivered  # `ReplicaState.complete`
        # Each stage's share of a pass; None where the layers divide evenly (T / P each, the
        # same floats as before uneven splits were modelled).
        num_layers = sum(stage_layers)
        self._stage_shares = (None if len(set(stage_layers)) == 1
                              else [n / num_layers for n in stage_layers])
        # Sent and not yet out of the last stage, oldest first; when each stage is next free.
        self._batches: deque[Iteration] = deque()
        self._stage_free_s = [-math.inf] * self.num_stages
        self._preempted: list[int] = []  # by plans that scheduled nothing
        # With a CPU tier: an empty step at the head of the queue waits for a planning turn;
        # and when the last launch ended (it may block, waiting for a preempted request's
        # stores: nothing is scheduled or taken before).
        self._hold = False
        self._host_s = -math.inf
        # When a launch that had to wait for copies (`_launch`) let the engine go on: it takes
        # the requests that arrived meanwhile before it plans again (vLLM's loop adds them
        # between steps). None: no launch waited since the last plan.
        self._blocked_until: float | None = None

    def sync(self, *, before_s: float | None = None) -> None:
        """Complete the iterations that have left the last stage by now (or strictly before
        `before_s`)."""
        if self._batches:
            self._complete_batches(self.env.now if before_s is None else before_s,
                                   inclusive=before_s is None)

    def next_commit_s(self) -> float:
        if self._batches:
            return self._batches[0].end_s
        state = self.state
        return self.env.now if state.waiting or state.running else math.inf

    def stop(self, horizon_s: float) -> None:
        """The clock stopped at `horizon_s`: complete what left the pipeline before it; the
        iterations still in flight never end, and their tokens are not computed."""
        self.sync(before_s=horizon_s)
        while self._batches:  # newest first: a prompt's chunks come off in reverse
            in_flight = self._batches.pop().in_flight
            assert in_flight is not None
            self.state.cancel(in_flight)

    # The reference step (`Replica.run`) with its planning, waiting and commit (`sync`)
    # overridden: several iterations in flight, each completed when it leaves the last stage.

    def _next_work(self, now_s: float) -> tuple[Plan | None, Any]:
        """Schedule and send iterations while fewer than the pipeline's depth are in flight;
        the work to wait for is the oldest in flight (None: none), or the engine's host busy
        with a launch that waited for copies (`HostBusy`)."""
        state, batches = self.state, self._batches
        plan = None
        offloading = self.copies is not None
        self._hold = False  # a planning turn: an empty step at the head may be taken now
        host_copies = self.host_copies
        if host_copies is not None:
            host_copies.pass_start(now_s)
        while len(batches) < self.pipeline_depth and (
                state.running or state.waiting or offloading):
            blocked_s, self._blocked_until = self._blocked_until, None
            # (The replica's clock, `now_s`: ahead of the environment's while it runs ahead.)
            if blocked_s is not None and blocked_s > now_s:
                return plan, HostBusy(blocked_s)
            now_s = max(now_s, self._host_s)
            if host_copies is not None:
                host_copies.pass_start(now_s)
            plan = self.poll_plan(now_s) if offloading else self.scheduler.schedule(state, now_s)
            if plan is None:
                break
            if not plan:
                self._preempted += plan.preempted_ids  # logged with the next plan
                if offloading:
                    # With a CPU tier a step with nothing to run still launches and polls,
                    # and joins the batch queue (vLLM's `step_with_batch_queue`), its report
                    # applied when it is the oldest; unless it changes nothing (`idle_step`):
                    # then the engine blocks on the oldest in flight, or, with none, waits
                    # for a copy to end or work to arrive.
                    launch_s, report = self._launch(plan, now_s)
                    assert self.copies is not None
                    self.copies.computed_by(launch_s)
                    self._host_s = launch_s
                    if report or not idle_step(plan):
                        batches.append(Iteration(plan, cast(BatchShape, None), launch_s, 0.0,
                                                 launch_s, 0, 0, [], report))
                    elif not batches:
                        return plan, None
                break
            if self._preempted:
                plan.preempted_ids[:0] = self._preempted
                self._preempted = []
            if not self._dispatch(plan, now_s):
                break
        return plan, batches[0] if batches else None

    def _dispatch(self, plan: Plan, now_s: float) -> bool:
        """Send `plan` (`_send`); whether to go on planning (a fast path may take the plan
        and the ones after it instead: `sim.engine.fastpath.pipeline`)."""
        self._batches.append(self._send(plan, now_s))
        return True

    def _wait(self, work: Any) -> Generator[simpy.Event, Any, float]:
        """Blocked on the oldest result: no poke (`wake` finds none), as vLLM's engine reads
        new requests only between steps. Nothing outside this replica can look at it or change
        it before `quiet_until()`: a result due before then is taken at once, with no event
        (run-ahead, as `FastReplica` commits its iterations). `HostBusy`: until the engine's
        launch is done, taking no result."""
        if isinstance(work, HostBusy):
            end_s = work.end_s
            if end_s > self.env.now and not (self.fast_forward and end_s < self.quiet_until()):
                yield At(self.env, end_s, self.turn)
            elif end_s > self.env.now:
                # Run ahead: what the next step's `sync` would complete once the clock is
                # there (it reads the environment's, which stays behind).
                self._complete_batches(end_s, inclusive=True)
            return max(end_s, self.env.now)
        assert isinstance(work, Iteration)
        # (With a CPU tier a launch may have blocked the engine past the result's end: it is
        # taken once the engine is free.)
        end_s = max(work.end_s, self._host_s)
        if not work.plan:  # an empty step (a CPU tier's poll), ended when launched
            if end_s > self.env.now and not (self.fast_forward and end_s < self.quiet_until()):
                yield At(self.env, end_s, self.turn)  # (its launch blocked until then)
            self._complete_batches(end_s, inclusive=True)
            return max(end_s, self.env.now)
        if self.fast_forward and end_s < self.quiet_until():
            self._complete_batches(end_s, inclusive=True)
            return end_s
        yield At(self.env, end_s, self.turn)
        return self.env.now

    def _send(self, plan: Plan, now_s: float, it: Iteration | None = None) -> Iteration:
        """`plan` sent down the pipeline now: it enters each stage once it has left the one
        before and the iteration ahead has left this one. `it`: its iteration, where the caller
        has planned it already (`_plan_iteration`; not with a CPU tier, whose launch comes
        first)."""
        report = None
        if self.copies is not None:
            asked_s = now_s
            now_s, report = self._launch(plan, now_s)
            self._host_s = now_s
            if now_s > asked_s:
                self._blocked_until = now_s
        if self.host_copies is not None:
            # write_back: the pass waited for the backups it made as it evicted (a CPU tier's
            # blocked launch, as above: the results taken after it, at the earliest).
            free_s = self.host_copies.wait_writes(now_s)
            if free_s > now_s:
                self._host_s = max(self._host_s, free_s)
                self._blocked_until = now_s = free_s
        if it is None:
            it = self._plan_iteration(plan, now_s, len(self._batches))
        it.report = report
        free, shares = self._stage_free_s, self._stage_shares
        stages_s = ([it.duration_s / self.num_stages] * self.num_stages
                    if shares is None else [it.duration_s * share for share in shares])
        start_s = end_s = max(now_s, free[0])
        for k, stage_s in enumerate(stages_s):
            end_s = max(end_s, free[k]) + stage_s
            free[k] = end_s
        it.start_s, it.duration_s = start_s, end_s - start_s
        it.end_s = start_s + it.duration_s  # as the log will compute it
        it.in_flight = self.state.start(plan, start_s, placeholders=self.placeholders)
        if self.copies is not None:
            self.copies.computed_by(it.end_s)
        return it

    def _complete_batches(self, now_s: float, *, inclusive: bool) -> None:
        """Log and apply the iterations that have left the last stage by `now_s`."""
        batches = self._batches
        while batches:
            # Taken when it has ended and the engine is free: a launch that waited for copies
            # (a CPU tier's, write_back's backups) holds its results back until then, from
            # every reader (a router's load, a client's deadline, a prefill replica's
            # hand-off).
            end_s = batches[0].end_s
            taken_s = end_s if end_s >= self._host_s else self._host_s
            if not (taken_s < now_s or (inclusive and taken_s == now_s)):
                break
            if self._hold and not batches[0].plan:
                break  # an empty step is taken after the next planning turn (`_next_work`)
            it = batches.popleft()
            if batches and not batches[0].plan:
                # vLLM takes one result per engine step: an empty step next in the queue is
                # taken after the engine has scheduled again.
                self._hold = True
                batches[0].end_s = max(batches[0].end_s, it.end_s)
            if not it.plan:
                if it.report:
                    state = self.state
                    assert state.offload is not None
                    state.offload.apply(state, it.report)
                continue
            iteration = self._log(it)
            assert it.in_flight is not None
            state = self.state
            if taken_s != it.end_s:
                self.log.taken_s[iteration] = taken_s
            if isinstance(state.offload, JobOffloadState) and state.offload.defers_frees:
                state.offload.step_processed()
            done, sampled = state.complete(it.in_flight, taken_s,
                                           stale_delivered=self.stale_delivered)
            if it.report:
                assert state.offload is not None
                state.offload.apply(state, it.report)
            self.log.add_sampled(iteration, sampled)
            self.scheduler.iteration_ended(it.plan)
            self._left_running(done)
