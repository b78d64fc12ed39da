"""The fast path as a strategy on the reference replica (`sim.engine.replica.Replica`): the same
step, with the next work planned and waited for differently, and the same results to the last
bit.

- Run-ahead: nothing outside the replica can look at it or change it before `quiet_until()`
  (the next event of any kind), so the iterations that end before then are committed at once,
  with no event each: what a step-by-step run computes, in the same order, without the event
  loop.
- Stretches (`sim.engine.fastpath.stretch`): where every following plan repeats this one
  (`is_steady`), a whole stretch of iterations is planned, timed (one latency call on arrays)
  and committed together (`sim.engine.fastpath.commit`); new work cuts it after the iteration
  in progress, and what is left of it resumes where that work changes no plan (`_resume`).

The cluster builds this replica unless `fast_forward=False`; the reference replica then never
imports this package.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any

from sim.core.plan import Plan
from sim.core.request import Request
from sim.engine.clock import At
from sim.engine.fastpath.commit import allocate_first_step, commit_stretch
from sim.engine.fastpath.stretch import Stretch, is_steady, plan_stretch
from sim.engine.replica import Iteration, Replica
from sim.routers.base import ReplicaLoad

# Most iterations a decode stretch is planned for. New work cuts most stretches after a few
# dozen iterations, while planning costs grow with the length; one that runs to the end is
# followed by another (the same results, one more event).
STRETCH_STEPS = 128

_ENDED = object()  # what a stretch's own end pokes with


def poke_or_end(replica: Replica, end_s: float) -> Any:
    """The replica's poke (new work), which its turn at `end_s` also triggers, with `_ENDED`
    (a callback, cheaper than waiting on `end | poke`; a stale end, of a stretch already
    cut, finds the poke triggered)."""
    poke = replica._poke = replica.env.event()
    end = At(replica.env, end_s, replica.turn)

    def on_end(_: Any) -> None:
        if not poke.triggered:
            poke.succeed(_ENDED)

    end.callbacks.append(on_end)
    return poke


class FastReplica(Replica):
    """A replica that runs ahead and fast-forwards stretches (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # A stretch cut short by new work, and the iterations of it kept: resumed if, once the
        # replica has taken the work in, its plan would be the same (`_resume`).
        self._uncut: tuple[Stretch, int] | None = None
        self._quiet_s = -math.inf  # `quiet_until()` as read when the work in hand was planned
        super().__init__(*args, **kwargs)

    # -- what the rest of the cluster sees -------------------------------------------------

    def load(self, req: Request | None = None) -> ReplicaLoad:
        work = self._inflight
        if isinstance(work, Stretch) and req is None:
            # A stretch in progress: the counts its ended iterations change, read without
            # committing them (a router reads every replica at every arrival).
            decoded, num_finished, finished_tokens = work.ended_counts(
                work.num_ended_by(self.env.now))
            return self._load(None, decoded - finished_tokens, num_finished)
        if work is None or (type(work) is Iteration and work.end_s > self.env.now):
            # Nothing ended to commit (`sync` would do nothing): read at once, as a router
            # reads every replica at every arrival.
            return self._load(req, 0, 0)
        return super().load(req)

    def load_tokens(self) -> int:
        # `load(None).num_load_tokens`, its cases written out, and `_load_tokens` inlined: a
        # router weighing tokens reads every replica at every arrival.
        work = self._inflight
        state = self.state
        if work is None or (type(work) is Iteration and work.end_s > self.env.now):
            tokens = state.num_waiting_tokens + state.num_running_tokens
        elif isinstance(work, Stretch):
            decoded, _, finished_tokens = work.ended_counts(work.num_ended_by(self.env.now))
            tokens = (state.num_waiting_tokens + state.num_running_tokens + decoded
                      - finished_tokens)
        else:
            return super().load_tokens()
        inbox = self.inbox
        return tokens if inbox is None else tokens + inbox.num_tokens

    def sync(self, *, before_s: float | None = None) -> None:
        work = self._inflight
        if not isinstance(work, Stretch):
            super().sync(before_s=before_s)
            return
        inclusive = before_s is None
        now = self.env.now if before_s is None else before_s
        num_steps = work.num_ended_by(now, inclusive=inclusive)
        rest: Stretch | None = work
        if num_steps:
            done, rest = self._commit_stretch(work, num_steps)
            self._inflight = rest
            self._left_running(done)
        # With prefix caching, the blocks the iteration in progress allocated may have evicted
        # cached prefixes, which a router reads: allocate them as a step-by-step run has.
        if rest is not None and self.state.kv.caches_prefixes and inclusive and (
                rest.start_s < now or self.env.reached(self.turn)):
            self._inflight = allocate_first_step(self.state, rest)

    def stop(self, horizon_s: float) -> None:
        super().stop(horizon_s)
        if isinstance(self._inflight, Stretch):
            self._inflight = allocate_first_step(self.state, self._inflight)

    # -- the step's planning and waiting -----------------------------------------------------

    def _next_work(self, now_s: float) -> tuple[Plan | None, Iteration | Stretch | None]:
        if self.copies is not None:  # (a CPU tier: no stretches, each step its copies)
            self._quiet_s = self.quiet_until()
            return self._next_work_offloading(now_s)
        state = self.state
        if self.host_copies is not None:  # (SGLang's hierarchical cache: each step its copies)
            self._quiet_s = self.quiet_until()
            return super()._next_work(now_s)
        # A stretch cut short by new work goes on where that work changes no plan.
        work: Stretch | Iteration | None = self._resume() if self._uncut is not None else None
        plan = None
        if work is None:
            plan = self.scheduler.schedule(state, now_s) if state.running or state.waiting \
                else None
            if not plan:
                return plan, None
        quiet_s = self._quiet_s = self.quiet_until()
        if plan is not None:
            # A stretch of iterations where every following plan repeats this one
            # (`is_steady`), else its one iteration.
            if (not self.latency.sequential and self.scheduler.allows_stretches
                    and not self.scheduler.reads_clock and not self._admission_may_pass()
                    and is_steady(state, plan)):
                first = None
                if plan.total_num_scheduled_tokens > plan.num_seqs:
                    # A prompt's chunk. Where new work may come before it ends, it would most
                    # likely cut a stretch there: the iteration is stepped, at a fraction of the
                    # cost of a stretch planned and cut.
                    first = work = self._plan_iteration(plan, now_s)
                if first is None or first.end_s < quiet_s:
                    stretch = plan_stretch(
                        state, plan, self.latency, now_s, self.horizon_s,
                        through_finishes=self._through_finishes(), noise=self.noise,
                        first_index=len(self.log), max_steps=STRETCH_STEPS,
                        num_preempted=len(plan.preempted_ids),
                        first_s=None if first is None else first.duration_s)
                    if stretch is not None:
                        self._check_durations(stretch.starts_s, stretch.duration_s,
                                              stretch.end_s)
                        work = stretch
            if work is None:
                work = self._plan_iteration(plan, now_s)
        return plan, work

    def _wait(self, work: Iteration | Stretch) -> Generator[Any, Any, float]:
        # Work ending before anything outside can look is committed now, with no event.
        if isinstance(work, Stretch):
            if work.end_s[-1] < self._quiet_s:
                self._left_running(self._commit_stretch(work, len(work))[0])
                return float(work.end_s[-1])
            yield from self._run_stretch(work)
            return self.env.now
        if work.end_s < self._quiet_s:
            self._commit(work)
            return work.end_s
        return (yield from super()._wait(work))

    def _commit_stretch(self, stretch: Stretch, num_steps: int
                        ) -> tuple[list[Request], Stretch | None]:
        """`commit_stretch`, the policy told of the plans the stretch made for it."""
        committed = commit_stretch(self.state, stretch, num_steps, self.log)
        if num_steps > stretch.planned_first:
            self.scheduler.decodes_repeated(num_steps - stretch.planned_first)
        return committed

    def _admission_may_pass(self) -> bool:
        """Whether a transfer waiting here may be taken after any step, finish or not
        (`Scheduler.admits_transfers_between_finishes`): then each step is planned."""
        return (self.inbox is not None and bool(self.inbox.pending)
                and self.scheduler.admits_transfers_between_finishes)

    def _through_finishes(self) -> bool:
        """Whether a stretch may run past its requests' finishes: only where freeing blocks
        decides nothing (no prefix cache, which frees into its eviction order, and no transfer
        waiting for a decode slot) and nobody waits for a finish (closed-loop clients)."""
        return not self.state.kv.caches_prefixes and not (
            self.inbox is not None and self.inbox.pending) and self.state.on_finish is None

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
        if state.waiting or num_kept >= len(stretch) or self._admission_may_pass():
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

    def _run_stretch(self, stretch: Stretch) -> Generator[Any, Any, None]:
        """A stretch's iterations until its end (a finish or a KV shortfall), or new work."""
        self._inflight = stretch
        end_s = float(stretch.end_s[-1])
        if self.alone:
            yield from self._run_stretch_alone(stretch, end_s)
            return
        ended = yield poke_or_end(self, end_s)
        self._poke = None
        if ended is _ENDED:
            return  # the stretch has ended; this is the replica's turn to plan
        # New work: stop after the iteration in progress, then plan with it at that turn. An
        # iteration starting now is in progress only if this replica's planning turn at this
        # instant has passed (a step-by-step run would have planned it already).
        cut_s = self._cut(self.env.now, started_now=self.env.reached(self.turn))
        yield At(self.env, cut_s, self.turn)

    def _run_stretch_alone(self, stretch: Stretch, end_s: float) -> Generator[Any, Any, None]:
        """`_run_stretch` on a lone replica (`Replica.alone`): the next arrival, known now,
        comes to it, and nothing else reads or changes it, so the stretch is cut after the
        iteration in progress then (work arriving is handled before the replica's turn at an
        instant), and that turn waited for with one event, no poke (one rejected cuts it all
        the same: the rest resumes, `_resume`)."""
        arrival_s = self.env.next_arrival_s
        if not arrival_s <= end_s:
            yield At(self.env, end_s, self.turn)
            return
        keep = int(stretch.starts_s.searchsorted(arrival_s, side="left"))
        yield At(self.env, float(stretch.end_s[keep - 1]) if keep else arrival_s, self.turn)
        self._cut(arrival_s, started_now=False)

    def _cut(self, now_s: float, *, started_now: bool) -> float:
        """Cut the stretch in progress after the iteration in progress at `now_s` (one
        starting then, if `started_now`); returns when the replica plans next."""
        rest, cut_s = self._inflight, now_s
        if isinstance(rest, Stretch):
            self._inflight = rest.cut_at(now_s, started_now=started_now)
            if self._inflight is not None:
                cut_s = float(self._inflight.end_s[-1])
                if not self.state.waiting:  # a request waiting here changes the plan
                    self._uncut = (rest, len(self._inflight))
        return cut_s
