"""The engine's steps with a CPU tier for the KV cache (`replica.kv_offload`): what a replica
(`sim.engine.replica.Replica`, which mixes this in) does differently when its copies to and from
the tier are timed (`sim.engine.offload`). Each plan is launched with its copies, a step with
nothing to run still launches and polls, and the replica waits for a copy to end where nothing
else can change; a queue that can never move again stops the replica (`_stall`)."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from sim.core.block_cache import BlockPrefixCache
from sim.core.offload_jobs import JobTransfers
from sim.core.plan import Plan
from sim.engine.clock import At

if TYPE_CHECKING:
    import simpy

    from sim.core.offload import Report
    from sim.core.state import ReplicaState
    from sim.engine.clock import Environment
    from sim.engine.disaggregation import DecodeInbox
    from sim.engine.iteration_log import IterationLog
    from sim.engine.offload import HostCopies
    from sim.engine.offload_jobs import JobCopies
    from sim.engine.replica import Iteration
    from sim.schedulers.base import Scheduler


# Preemptions with no request decoding in between after which a replica with a CPU tier is
# taken to loop for ever (`OffloadSteps._preempted_in_turn`).
LIVELOCK_PREEMPTIONS = 1000


class OffloadSteps:
    """The CPU tier's part of a replica's step (module docstring)."""

    env: Environment
    log: IterationLog
    _last_decode_seen: int
    _num_preempted_since: int
    state: ReplicaState
    scheduler: Scheduler
    turn: int
    copies: HostCopies | JobCopies | None
    stalled: str | None
    _blocked: tuple[float, Report] | None
    _carried: list[int]
    _poke: simpy.Event | None
    inbox: DecodeInbox | None

    def _plan_iteration(self, plan: Plan, start_s: float, num_before: int = 0) -> Iteration:
        raise NotImplementedError

    def _next_work_offloading(self, now_s: float) -> tuple[Plan | None, Iteration | None]:
        """`_next_work` with a CPU tier: each plan is launched with its copies (later, if
        a preempted request's stores must end first); a plan with nothing to run still
        launches and polls, its report applied at once, and is planned again while that
        changes something."""
        state = self.state
        while True:
            plan = self.poll_plan(now_s)
            if plan is None:
                return None, None
            launch_s, report = self._launch(plan, now_s)
            if plan:
                if self._carried:  # an empty step's preemptions are logged with this plan
                    plan.preempted_ids[:0] = self._carried
                    self._carried = []
                it = self._plan_iteration(plan, launch_s)
                it.report = report
                assert self.copies is not None
                self.copies.computed_by(it.end_s)
                return plan, it
            self._carried += plan.preempted_ids
            if launch_s > now_s:
                # The launch waited for a preempted request's stores (the engine's host
                # blocked): the report is applied, and the next plan made, from then.
                self._blocked = (launch_s, report)
                return plan, None
            if report:
                assert state.offload is not None
                state.offload.apply(state, report)
                if reload_only(plan) and getattr(self.copies, "polled_empty_only", False):
                    # Only one-token prompts that "loaded" no block, to be asked again: vLLM
                    # 0.33.0 steps on so, empty, until a copy ends or a request arrives.
                    return plan, None
            elif idle_step(plan):
                return plan, None  # nothing changes until a copy ends or work arrives

    def poll_plan(self, now_s: float) -> Plan | None:
        """With a CPU tier: the next plan, or an empty one where only requests finished since
        the last need reporting to the worker (vLLM steps while it has them); None: idle, or
        stopped for good (`stalled`: a livelock, `_preempted_in_turn`)."""
        state = self.state
        if self.stalled is not None:
            return None
        if state.running or state.waiting:
            plan = self.scheduler.schedule(state, now_s)
            if plan.preempted_ids and self._preempted_in_turn(len(plan.preempted_ids)):
                return None
            return plan
        offload = state.offload
        # (vLLM 0.33.0's engine also steps while copy jobs are not reported done; and either
        # steps while a transfer waits for blocks on a decode replica: it is in the waiting
        # queue there, and each empty step's poll may free the blocks finished requests hold
        # until their stores are reported done.)
        inbox = self.inbox
        if offload is not None and (offload.finished_ids or offload.busy or (
                inbox is not None and inbox.pending)):
            plan = Plan()
            offload.build(state, plan, 0)
            return plan
        return None

    def _preempted_in_turn(self, num_preempted: int) -> bool:
        """Count preemptions since the last iteration in which a request decoded; past
        `LIVELOCK_PREEMPTIONS` the replica stops (True), its requests unfinished with the
        reason. Queued requests hold the KV they loaded from the tier, so under a tight GPU
        cache the running ones can preempt each other and be admitted again for ever, none
        reaching its next token (vLLM 0.15.1 does: found with EAGLE's lookahead slots and a
        small threshold, its own scheduler looping the same way)."""
        last = self.log.last_decode_iteration
        if last != self._last_decode_seen:
            self._last_decode_seen, self._num_preempted_since = last, 0
        self._num_preempted_since += num_preempted
        if self._num_preempted_since < LIVELOCK_PREEMPTIONS:
            return False
        reason = (f"engine_stalled: {self._num_preempted_since:,} preemptions and no request "
                  f"decoded since iteration {last:,}: the running and queued requests take "
                  "each other's KV blocks in turn (queued ones holding what they loaded from "
                  "the CPU tier); vLLM 0.15.1 loops there for ever")
        self._stop_for_good(reason)
        return True

    def _reload_loop(self) -> Generator[simpy.Event, Any, None]:
        """Nothing runs, nothing is copied, and the queue's loaded one-token prompts ask the
        tier again and again (`JobOffloadState.reload`): vLLM 0.33.0 loops so for ever,
        unless a request arrives (its stores may evict their block from the tier). Its
        requests say so until one does."""
        unmark = self.mark_reloading()
        yield from self._wait_for_work()  # type: ignore[attr-defined]
        unmark()

    def mark_reloading(self) -> Callable[[], None]:
        """The queue's requests say why they wait (`_reload_loop`) until the returned call,
        made once work arrives, takes it back."""
        reason = ("engine_stalled: one-token prompts whose block the CPU tier holds load "
                  "it again at every step (their token is computed again after a load, so "
                  "the queue takes them for new); vLLM 0.33.0 loops there for ever")
        waiting = list(self.state.waiting)
        for req in waiting:
            if req.reason is None:
                req.reason = reason

        def unmark() -> None:
            for req in waiting:
                if req.reason == reason:
                    req.reason = None

        return unmark

    def _stop_for_good(self, reason: str) -> None:
        """The replica will never run again: it and its requests say why (`stalled`; a
        request that arrives later is told too, `Replica.submit`)."""
        self.stalled = reason
        state = self.state
        for req in [*state.waiting, *state.running]:
            req.reason = reason

    def _launch(self, plan: Plan, now_s: float) -> tuple[float, Report]:
        """Launch `plan`'s step at `now_s` with its copies: when it launches, and what the
        worker's poll right after finds done."""
        assert self.copies is not None and plan.transfers is not None
        return self.copies.launch(plan.transfers, plan.preempted_ids, plan.finished_ids or [],
                                  now_s)

    def _stall(self) -> Generator[simpy.Event, Any, None]:
        """Nothing can run and nothing will change: queued requests hold KV loaded from the
        CPU tier that the queue's head needs (vLLM waits for ever here: its head blocks the
        queue). The replica stops; its requests stay unfinished, saying why."""
        self.stall_now()
        yield self.env.event()  # never triggered

    def stall_now(self) -> None:
        """`_stall`'s verdict, given at once (data-parallel ranks: the group steps on)."""
        state = self.state
        kv = state.kv
        assert isinstance(kv, BlockPrefixCache)  # (vLLM's tier: blocks keyed by prefix)
        # Blocks, not references: queued requests share their prefix's cached blocks.
        held = len({id(block) for r in state.waiting for block in kv.blocks_of(r.request_id)})
        reason = (f"engine_stalled: the queue's head cannot get its KV blocks "
                  f"({kv.num_free_blocks:,} free of {kv.num_blocks:,}) while queued requests "
                  f"behind it hold {held:,} with KV loaded from the CPU tier; vLLM 0.15.1 "
                  "waits for ever there")
        self._stop_for_good(reason)

    def _wait_copies(self, now_s: float, next_done_s: float | None = None
                     ) -> Generator[simpy.Event, Any, None]:
        """Wait until the next copy to or from the CPU tier (or SGLang's host memory:
        `next_done_s`) ends, or work arrives."""
        if next_done_s is None:
            assert self.copies is not None
            next_done_s = self.copies.next_done_s()
        done_s = max(next_done_s, now_s)
        poke = self._poke = self.env.event()
        timer = At(self.env, done_s, self.turn)

        def on_done(_: Any) -> None:
            if not poke.triggered:
                poke.succeed()

        timer.callbacks.append(on_done)
        yield poke
        self._poke = None
        if self.env.now < done_s or not self.env.reached(self.turn):
            yield At(self.env, self.env.now, self.turn)  # plan after all else at this instant


def reload_only(plan: Plan) -> bool:
    """Whether a plan that runs nothing only "loads" no block for one-token prompts asked
    again (`sim.core.offload_jobs.JobOffloadState.reload`)."""
    transfers = plan.transfers
    return (not plan and isinstance(transfers, JobTransfers) and bool(transfers.loads)
            and not any(n for _, _, n in transfers.loads)
            and not (transfers.stores or transfers.flush or plan.finished_ids
                     or plan.preempted_ids))


def idle_step(plan: Plan) -> bool:
    """Whether a plan that runs nothing and whose poll found nothing changes nothing: it
    started no load and told the worker of no finished request (vLLM's engine steps on,
    empty, until a copy ends or a request arrives)."""
    transfers = plan.transfers
    assert transfers is not None
    if isinstance(transfers, JobTransfers) and (transfers.stores or transfers.flush):
        return False
    return not (transfers.loads or plan.finished_ids or plan.preempted_ids)
