"""The SimPy engine's replica: the reference step. Each runs its scheduler's plans for as long
as the latency model says, then commits them, one event per iteration. The fast path
(`sim.engine.fastpath.replica.FastReplica`, used unless `fast_forward=False`) overrides how the
next work is planned and waited for: stretches of predictable iterations, and iterations nothing
outside can see run ahead without an event each. `sim.engine.clock` owns the order of events at
one instant.

SimPy is imported here, in `sim/engine/offload_steps.py` (this replica's steps with a CPU tier
for the KV cache), in `sim/engine/clock.py`, in `sim/engine/pipeline.py` (a replica keeping
several iterations in flight down a pipeline of GPUs), in `sim/engine/data_parallel.py`
(data-parallel ranks stepped together) and in `sim/engine/disaggregation.py`, nowhere else in
`sim/`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import simpy

from sim.config.errors import InputError
from sim.core.plan import Plan
from sim.core.request import Request, Status
from sim.core.state import InFlight, ReplicaState
from sim.engine.clock import PLAN, At, Environment, Hook
from sim.engine.disaggregation import DecodeInbox
from sim.engine.iteration_log import ALL_TO_ALL_COLUMN, SPEC_COLUMN, IterationLog
from sim.engine.offload_steps import OffloadSteps, reload_only
from sim.latency.base import BatchShape, LatencyModel
from sim.latency.noise import IterationNoise
from sim.routers.base import ReplicaLoad
from sim.schedulers.base import Scheduler
from sim.workloads.base import MAX_SPAN_S

if TYPE_CHECKING:
    from sim.core.offload import Report
    from sim.engine.fastpath.stretch import Stretch
    from sim.engine.hicache import HostCacheCopies
    from sim.engine.offload import HostCopies
    from sim.engine.offload_jobs import JobCopies

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
    # With a CPU tier: the copies its launch found done, applied with its output.
    report: Report | None = None
    # A data-parallel rank's: each MoE layer's exchange with the other ranks (s).
    all_to_all_s: float | None = None


class Replica(OffloadSteps):
    """One model instance: a scheduler, a latency model and a KV cache, run as a SimPy process,
    one iteration at a time (the reference; `FastReplica` adds the fast path).

    In a disaggregated cluster (`sim.engine.disaggregation`) a prefill replica hands each request
    off after its first token (`on_handoff`), and a decode replica's `inbox` holds the requests
    whose KV is to arrive by transfer."""

    def __init__(self, env: Environment, replica_id: int, scheduler: Scheduler,
                 latency: LatencyModel, state: ReplicaState, *, horizon_s: float | None = None,
                 fast_forward: bool = True, pool: str = "colocated",
                 quiet_until: Callable[[], float] | None = None,
                 where: tuple[str, str, Any] = ("<scenario>", "replica.latency", None),
                 noise: IterationNoise | None = None, start: bool = True) -> None:
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
        # Told of the requests that leave it without a hand-off, finished or failed (a decode
        # replica holding KV reserved for them gives it back: `Disaggregation`).
        self.on_dropped: Callable[[list[Request]], None] | None = None
        # The copies to and from the KV cache's CPU tier (`state.offload`), timed.
        self.copies: HostCopies | JobCopies | None = None
        # The copies of SGLang's hierarchical cache (`state.kv`, a `HierarchicalCache`), timed.
        self.host_copies: HostCacheCopies | None = None
        self.stalled: str | None = None  # why it stopped for good (`_stall`), if it did
        # Preemptions since the last iteration in which a request decoded, counted with a CPU
        # tier (`OffloadSteps._preempted_in_turn`).
        self._last_decode_seen = -1
        self._num_preempted_since = 0
        # An empty step's launch that blocked until then, and its poll's report.
        self._blocked: tuple[float, Report] | None = None
        self._carried: list[int] = []  # preempted by empty steps, logged with the next plan
        self.overlaps_host = False  # host work beside the GPU's (`PipelinedReplica`)
        self.inbox: DecodeInbox | None = None
        # Nothing outside reads or changes it between arrivals (a colocated replica with no
        # client timeouts, alone or behind a router that reads no loads): a replica that
        # schedules ahead may then run stretches (`sim.engine.fastpath.pipeline`).
        self.unobserved = False
        # Read between its arrivals only by a router weighing loads (`load()`, no prefix
        # lookups), with no timeouts or clients: an async replica's stretches then run on,
        # their loads read without a commit (`sim.engine.fastpath.pipeline`).
        self.read_by_loads = False
        # The only replica, fed by the trace alone (no clients, sessions or timeouts): nothing
        # but the next arrival (`Environment.next_arrival_s`), which comes to it, reads or
        # changes it. A stretch then knows when new work cuts it (`sim.engine.fastpath.
        # pipeline`).
        self.alone = False
        # The earliest time anything outside this replica may read or change it, asked when it
        # plans: its iterations ending before then commit without an event each. By default
        # the next event of any kind; never for a prefill replica, whose hand-offs start
        # transfers at the instant an iteration ends.
        self.quiet_until = _never if pool == "prefill" else quiet_until or env.peek
        # (file, field, value) named by errors about this replica's latency model.
        self.where = where
        self.log = IterationLog(speculative=state.acceptance is not None)
        self.bind_log()
        # Set to a list to keep the plan of every iteration logged one by one (stepped, not
        # in a stretch): the golden schedules compare them with an engine's steps.
        self.plans: list[Plan] | None = None
        self._poke: simpy.Event | None = None
        self._woken = False  # woken while not waiting for a poke
        # Work planned and not yet committed: one iteration, or (`FastReplica`) a stretch.
        self._inflight: Iteration | Stretch | None = None
        # (A data-parallel rank is stepped by its group's process, not its own.)
        self.process = env.process(self.run()) if start else None

    def bind_log(self) -> None:
        """Bind the log's speculative column's `append` (drafts verified; None without it): a
        data-parallel rank's group gives it a log of its own."""
        column = self.log.columns.get(SPEC_COLUMN)
        self._log_drafts = column.append if column is not None else None

    # -- what the rest of the cluster sees and does --------------------------------------------

    def reject_reason(self, req: Request) -> str | None:
        """Why `req` can never be served here; None if it can."""
        return self.scheduler.reject_reason(req, self.state.kv,
                                            self.state.num_kv_tokens_needed(req))

    def expire(self, now_s: float) -> None:
        """Abort the requests whose clients have given up by `now_s` (`ReplicaState.expire`),
        and tell the scheduler and `on_dropped`."""
        aborted = self.state.expire(now_s)
        if aborted:
            self.scheduler.requests_aborted(aborted)
            if self.on_dropped is not None:
                self.on_dropped(aborted)

    def submit(self, req: Request) -> None:
        """A request arrives (now). Rejected at once if it can never be served here."""
        req.replica_id = req.prefill_replica_id = self.replica_id
        reason = self.reject_reason(req)
        if reason is not None:
            req.status, req.reason = Status.REJECTED, reason
            self.state.requests[req.request_id] = req
            return
        self.state.add(req)
        if self.stalled is not None:  # (it will never run)
            req.reason = self.stalled
        self.wake()

    def wake(self) -> None:
        """Something changed here (work arrived, KV was freed): plan again, at this replica's
        turn now, cutting a stretch in progress after its current iteration."""
        if self._poke is not None and not self._poke.triggered:
            self._poke.succeed()
        else:
            self._woken = True  # (read by `_wait_idle` catching up to its clock)

    @property
    def ranks(self) -> list[Replica]:
        """The engine cores of this replica: itself (`DataParallelGroup` has several)."""
        return [self]

    def pick(self, req: Request) -> Replica:
        """The engine core that takes `req`: itself (`DataParallelGroup` balances)."""
        return self

    def load(self, req: Request | None = None) -> ReplicaLoad:
        """Requests in flight here, and tokens of work queued or resident, as of now; with
        `req`, also how many of its tokens are cached here."""
        self.sync()  # prefix hits read the cache as the ended iterations left it
        return self._load(req, 0, 0)

    def load_tokens(self) -> int:
        """`load().num_load_tokens` (a router weighing tokens reads no more)."""
        return self.load().num_load_tokens

    def _load_tokens(self, decoded: int) -> int:
        """`num_load_tokens`, given tokens decoded in work not yet committed (less the known
        tokens of requests that finished in it)."""
        state = self.state
        tokens = state.num_waiting_tokens + state.num_running_tokens + decoded
        if self.inbox is not None:
            tokens += self.inbox.num_tokens
        return tokens

    def _load(self, req: Request | None, decoded: int, num_finished: int,
              num_used_blocks: int | None = None) -> ReplicaLoad:
        """The load, given tokens decoded and requests finished in work not yet committed
        (and the KV blocks in use then, where that work changed them)."""
        state = self.state
        tokens = self._load_tokens(decoded)
        num_waiting = len(state.waiting)
        num_outstanding = num_waiting + len(state.running) - num_finished  # (`num_outstanding`)
        if self.inbox is not None:
            num_outstanding += self.inbox.num_requests
            # (vLLM's decode engine keeps them in its waiting queue, blocks or KV to come:
            # so its published counts say.)
            num_waiting += self.inbox.num_requests
        hit = state.kv.prefix_hit_tokens(req) if req is not None else 0
        kv = state.kv
        used = kv.num_used_blocks if num_used_blocks is None else num_used_blocks
        return ReplicaLoad(num_outstanding, tokens, hit, num_waiting,
                           len(state.running) - num_finished, used / kv.num_blocks)

    def sync(self, *, before_s: float | None = None) -> None:
        """Commit the planned work that has ended by now (or strictly before `before_s`): the
        replica then looks exactly as a step-by-step run shows it at this instant. Called by
        whatever reads the replica's state; adding requests to its queues needs no sync, as
        committing work in flight never reads them."""
        work = self._inflight
        if work is None:
            return
        now = self.env.now if before_s is None else before_s
        assert isinstance(work, Iteration)
        if work.end_s < now or (before_s is None and work.end_s == now):
            self._inflight = None
            self._commit(work)

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

    # -- the replica's own process ---------------------------------------------------------

    def run(self) -> Generator[simpy.Event, Any, None]:
        """The engine step, as `servesim replay` runs it on a wall clock: commit what has ended,
        abort requests whose client gave up, admit KV transfers, schedule and predict, wait for
        the work to end (its commit is the next step's sync). `now`: the replica's own clock
        (ahead of the environment's while a `FastReplica` runs ahead)."""
        now = self.env.now
        while True:
            self.sync()
            # Clients that gave up, before the next step; first, as the KV they free may admit
            # a transfer now (a stretch stops for nothing else that frees KV).
            self.expire(now)
            if self.inbox is not None and self.inbox.pending:
                yield from self._admit_transfers(now)
            plan, work = self._next_work(now)
            if work is None:
                yield from self._wait_idle(plan, now)
                now = self.env.now
            else:
                now = yield from self._wait(work)

    def _next_work(self, now_s: float) -> tuple[Plan | None, Iteration | Stretch | None]:
        """Schedule at `now_s` (None with nothing queued) and predict: the plan, and the work to
        run (None where the plan is empty)."""
        state = self.state
        if self.copies is not None:
            return self._next_work_offloading(now_s)
        if self.host_copies is not None:
            self.host_copies.pass_start(now_s)
        plan = self.scheduler.schedule(state, now_s) if state.running or state.waiting else None
        if self.host_copies is not None:  # (write_back: the pass waited for its backups)
            now_s = self.host_copies.wait_writes(now_s)
        return plan, self._plan_iteration(plan, now_s) if plan else None

    def _wait(self, work: Iteration | Stretch) -> Generator[simpy.Event, Any, float]:
        """Wait for `work` to end; return the replica's clock then."""
        assert isinstance(work, Iteration)
        self._inflight = work
        yield At(self.env, work.end_s, self.turn)
        return self.env.now

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
        if self._blocked is not None:
            until_s, report = self._blocked
            self._blocked = None
            yield At(self.env, until_s, self.turn)
            assert state.offload is not None
            state.offload.apply(state, report)
            return
        if self.copies is not None and self.copies.busy and plan is not None:
            # Copies to or from the CPU tier hold what the queue needs: poll when the next ends.
            yield from self._wait_copies(now_s)
            return
        if self.host_copies is not None and self.host_copies.busy:
            # A copy's ack to come (it may unlock KV the queue needs): SGLang polls on, and
            # takes a request that arrives first.
            yield from self._wait_copies(now_s, self.host_copies.next_done_s())
            return
        if self.inbox is not None and self.inbox.pending and plan is not None:
            # The empty plan may have freed KV (SGLang aborting a request its top-up outgrew):
            # a decode replica's loop admits transfers again before it waits.
            num_pending = len(self.inbox.pending)
            yield from self._admit_transfers(now_s)
            if len(self.inbox.pending) < num_pending:
                return
        # (An empty plan that left nothing running or queued aborted what there was: idle.)
        if plan is not None and (state.running or (
                state.waiting and not (state.num_transferring or state.incoming))):
            if not state.running and reload_only(plan):
                yield from self._reload_loop()
                return
            if state.offload is not None:
                yield from self._stall()
            raise RuntimeError(f"replica {self.replica_id}: requests queued, none can run")
        if now_s > self.env.now:
            # Catching up to the replica's clock, run ahead: work may arrive at that very
            # instant (a closed-loop client answered by the finish that left it idle).
            self._woken = False
            yield At(self.env, now_s, self.turn)
            if self._woken:
                return
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
        if self.overlaps_host:
            host_s = float(self.latency.host_time_s(shape))
            duration_s = max(duration_s - host_s, host_s)
        if self.noise is not None:
            duration_s = duration_s * self.noise.factor(
                len(self.log) + num_before, shape.num_prefill_tokens, shape.num_decode_tokens)
        if self.host_copies is not None:
            duration_s = self.host_copies.duration_s(duration_s)
        end_s = start_s + duration_s
        if not start_s < end_s < MAX_SPAN_S:  # NaN fails too
            self._check_durations(np.array([start_s]), np.array([duration_s]),
                                  np.array([end_s]))
        it = Iteration(plan, shape, start_s, duration_s, end_s, state.kv.num_used_blocks,
                       len(state.waiting))
        if self.host_copies is not None:
            self.host_copies.launched(it)
        return it

    def _commit(self, it: Iteration) -> None:
        since = self.log.last_decode_iteration  # before this one is logged
        iteration = self._log(it)
        state = self.state
        self._left_running(state.commit(it.plan, iteration, it.start_s, it.end_s, since))
        if it.report:
            assert state.offload is not None
            state.offload.apply(state, it.report)
        self.scheduler.iteration_ended(it.plan)

    def _log(self, it: Iteration) -> int:
        """Add an iteration that has ended to the log; return its number."""
        shape = it.shape
        if self.plans is not None:
            self.plans.append(it.plan)
        if self._log_drafts is not None:
            self._log_drafts(shape.num_spec_tokens)
        if it.all_to_all_s is not None:
            self.log.columns[ALL_TO_ALL_COLUMN].append(it.all_to_all_s)
        return self.log.append(it.start_s, it.duration_s, shape.num_prefill_tokens,
                               shape.num_decode_tokens, it.plan.num_seqs, it.num_kv_blocks_used,
                               len(it.plan.preempted_ids), it.num_waiting)

    def _left_running(self, done: list[Request]) -> None:
        for req in done:
            if req.status is Status.TRANSFERRING:
                if self.on_handoff is not None:
                    self.on_handoff(req)
            elif self.on_dropped is not None:
                self.on_dropped([req])

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


def _never() -> float:
    return -math.inf
