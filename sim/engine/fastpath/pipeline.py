"""The fast path of a replica that schedules ahead (`sim.engine.fastpath.async_stretch`): a
`PipelinedReplica` of one stage and two iterations in flight with output placeholders (vLLM
v1's async scheduling, SGLang's overlap loop, both engines' defaults) that, at a steady plan,
takes that plan and the ones its stretch makes after it instead of stepping them, and hands
back to stepping at a planning turn, exactly where the stepped replica would stand. A plan
that computes prompts beside the decodes opens a stretch too where it catches every running
request up (`catch_up_tokens`: a new request's prompt whole, most often): the plan after an
arrival, so each arrival costs one stepped plan, not two.

Where: a colocated replica with no client timeouts and no closed-loop clients, alone or behind
a router that reads no loads (`unobserved`: `round_robin`, `random`) or one that weighs them
without prefix lookups (`read_by_loads`: `least_kv_load`, `least_outstanding`; the load of a
replica in a stretch is read from its arrays, `AsyncStretch.counts_at`, without a commit), with
a plain KV cache (no prefix caching, no CPU tier) and no speculative decoding; and a decode
replica of a disaggregated cluster so placed, behind its decode router, while no transfer
waits for its blocks. A stretch is taken back at the first planning turn after work arrives
for it (a request arriving; on a decode replica, a transfer asking for blocks or its KV
landing). Elsewhere every iteration is stepped, as before.

A replica of P > 1 stages (one iteration in flight per stage, no placeholders) has stretches
of its own (`sim.engine.fastpath.pipeline_stretch`): at a plan where every running request is
in it or in an iteration in flight, all decoding, nothing waiting, the batches take turns,
and the stretch is planned there and handed back at the first planning turn after work
arrives, as above; on a colocated replica alone or behind a router that reads no loads or
weighs them (`PipelineStretch.counts_at`).
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any

from sim.core.kv_cache import KVCacheManager
from sim.core.plan import Plan
from sim.core.request import Request
from sim.engine.clock import At
from sim.engine.fastpath.async_stretch import (
    AsyncStretch,
    catch_up_tokens,
    hand_off,
    plan_async_stretch,
)
from sim.engine.fastpath.pipeline_stretch import (
    PipelineStretch,
    plan_pipeline_stretch,
    steady_groups,
)
from sim.engine.fastpath.pipeline_stretch import hand_off as pipeline_hand_off
from sim.engine.fastpath.replica import _ENDED, poke_or_end
from sim.engine.pipeline import PipelinedReplica
from sim.routers.base import ReplicaLoad

MAX_STEPS = 128  # iterations a stretch plans at most (where it ends, stepping plans again)


class FastPipelinedReplica(PipelinedReplica):
    """A `PipelinedReplica` with stretches (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._stretch: AsyncStretch | PipelineStretch | None = None
        super().__init__(*args, **kwargs)

    def _eligible(self) -> bool:
        return ((self.unobserved or self.read_by_loads) and self.fast_forward
                and self.num_stages == 1
                and self.pipeline_depth == 2 and self.placeholders and self.overlaps_host
                and self._plain())

    def _eligible_stages(self) -> bool:
        """Whether a pipeline of several stages may run stretches (`sim.engine.fastpath.
        pipeline_stretch`): a colocated replica, one iteration in flight per stage, no
        placeholders, and nothing reading it between arrivals but a router weighing loads
        (a decode replica's transfers, landing mid-stretch, are left to stepping)."""
        return ((self.unobserved or self.read_by_loads) and self.pool == "colocated"
                and self.fast_forward and self.num_stages > 1
                and self.pipeline_depth == self.num_stages and not self.placeholders
                and not self.overlaps_host and self._plain())

    def _plain(self) -> bool:
        """No CPU tier, speculative decoding, prefix or hierarchical cache, transfer
        waiting, closed-loop client, kept plans, clock-reading policy or sequential latency
        model: every plan of a steady state repeats the one before."""
        state = self.state
        return (self.copies is None and self.host_copies is None and state.acceptance is None
                and not (self.inbox is not None and self.inbox.pending)
                and type(state.kv) is KVCacheManager and state.on_finish is None
                and self.plans is None and self.scheduler.allows_stretches
                and not self.scheduler.reads_clock and not self.latency.sequential)

    def load(self, req: Request | None = None) -> ReplicaLoad:
        stretch = self._stretch
        if stretch is None:
            return super().load(req)
        assert req is None, "a router reading prefix hits reads no stretch in progress"
        tokens, num_left, num_used_blocks = self._read(stretch)
        return self._load(None, tokens, num_left, num_used_blocks)

    def load_tokens(self) -> int:
        # `load(None).num_load_tokens`, without the rest of the load: a router weighing
        # tokens reads every replica at every arrival.
        stretch = self._stretch
        if stretch is None:
            return super().load_tokens()
        now = self.env.now
        if self._batches:
            self._complete_batches(now, inclusive=True)
        return self._load_tokens(stretch.tokens_at(now, inclusive=self.env.reached(self.turn)))

    def _read(self, stretch: AsyncStretch | PipelineStretch) -> tuple[int, int, int]:
        """`stretch.counts_at` now: the iteration in flight before the stretch completes as
        stepping completes it; the stretch's own are read, not committed (a router reads
        every replica at every arrival)."""
        now = self.env.now
        if self._batches:
            self._complete_batches(now, inclusive=True)
        return stretch.counts_at(now, inclusive=self.env.reached(self.turn))

    def _dispatch(self, plan: Plan, now_s: float) -> bool:
        state, batches = self.state, self._batches
        if self.num_stages > 1:
            return self._dispatch_stages(plan, now_s)
        if not (len(batches) <= 1 and not state.waiting and not plan.preempted_ids
                and plan.num_seqs == len(state.running) and self._eligible()):
            return super()._dispatch(plan, now_s)
        first = first_tokens = None
        if plan.total_num_scheduled_tokens != plan.num_seqs or state.prefilling():
            # Prompts beside the decodes (a new request's, most often): where the plan
            # catches every request up, each decodes from the next plan on, and this plan
            # opens the stretch, its iteration timed as a step times it.
            first_tokens = catch_up_tokens(state, plan)
            if first_tokens is None:
                return super()._dispatch(plan, now_s)
            first = self._plan_iteration(plan, now_s, len(batches))
        stretch = plan_async_stretch(
            state, plan, self.latency, now_s, self._stage_free_s[0],
            batches[-1].end_s if batches else None, self.horizon_s, noise=self.noise,
            first_index=len(self.log) + len(batches), max_steps=MAX_STEPS, first=first,
            first_tokens=first_tokens)
        if stretch is not None:
            self._stretch = stretch
            return False
        batches.append(self._send(plan, now_s, first))
        return True

    def _dispatch_stages(self, plan: Plan, now_s: float) -> bool:
        """`_dispatch` on a pipeline of several stages: a steady plan (every request in it or
        in flight, all decoding, nothing waiting) opens a stretch where one qualifies."""
        state, batches = self.state, self._batches
        if (state.waiting or plan.preempted_ids or plan.total_num_scheduled_tokens != plan.num_seqs
                or not self._eligible_stages()):
            return super()._dispatch(plan, now_s)
        groups = steady_groups(state, plan, batches)
        stretch = None if groups is None else plan_pipeline_stretch(
            state, plan, groups, batches, self.latency, now_s, self._stage_free_s,
            self._stage_shares, self.horizon_s, noise=self.noise,
            first_index=len(self.log) + len(batches), max_steps=MAX_STEPS,
            until_s=self.env.next_arrival_s if self.alone else math.inf)
        if stretch is None:
            return super()._dispatch(plan, now_s)
        self._stretch = stretch
        return False

    def _next_work(self, now_s: float) -> tuple[Plan | None, Any]:
        # (the work to wait for: the oldest iteration in flight, or a stretch)
        plan, work = super()._next_work(now_s)
        if self._stretch is not None:
            return plan, self._stretch
        return plan, work

    def _wait(self, work: Any) -> Generator[Any, Any, float]:
        if not isinstance(work, AsyncStretch | PipelineStretch):
            return (yield from super()._wait(work))
        stretch = work
        k = len(stretch)
        end_s = stretch.hand_off_s(k)
        if not end_s < self.quiet_until():  # (else nothing can arrive before its end)
            if self.alone:
                # The next arrival, known now, comes to this replica: the first plan made
                # after it takes the stretch back, with no event for the arrival's poke (one
                # rejected cuts it all the same: a cut anywhere gives the same results).
                arrival_s = self.env.next_arrival_s
                if arrival_s <= end_s:
                    k = max(1, stretch.num_planned_before(arrival_s))
                    end_s = stretch.hand_off_s(k)
                yield At(self.env, end_s, self.turn)
                self._take_back(stretch, k, end_s)
                return end_s
            # Work may arrive before the stretch ends: wait for it, or for the end.
            ended = yield poke_or_end(self, end_s)
            self._poke = None
            if ended is not _ENDED:
                # Seen by the first plan made after now (work arriving is handled before the
                # replicas plan at an instant; work set off after this replica's turn at this
                # instant, by the next plan after it).
                k = max(1, stretch.num_planned_before(
                    self.env.now, inclusive=self.env.reached(self.turn)))
                end_s = stretch.hand_off_s(k)
                yield At(self.env, end_s, self.turn)  # (at this instant too: after arrivals)
        self._take_back(stretch, k, end_s)
        return end_s if end_s > self.env.now else self.env.now

    def _take_back(self, stretch: AsyncStretch | PipelineStretch, k: int, now_s: float
                   ) -> None:
        """Hand the stretch back at plan k's turn (`now_s`): the iteration in flight before it
        completes, then the stretch's first k - 1, and its k-th is in flight (on several
        stages: those in flight before it that have ended, then the stretch's that have,
        and its last G - 1 in flight)."""
        self._complete_batches(now_s, inclusive=True)
        if k > 1:  # plans 1 .. k - 1, made for the policy (its own, plan 0)
            self.scheduler.decodes_repeated(k - 1)
        if isinstance(stretch, PipelineStretch):
            done, sent = pipeline_hand_off(self.state, stretch, k, self.log)
            self._left_running(done)
            self._batches.extend(sent)
            self._stage_free_s = list(stretch.stage_free_s[k - 1])
            self._stretch = None
            return
        assert not self._batches
        done, in_flight = hand_off(self.state, stretch, k, self.log)
        if k > 1 and stretch.first is not None:
            # (As a step runs it where its iteration ends: only a plan computing a prompt may
            # need it, and the later ones decode.)
            self.scheduler.iteration_ended(stretch.plan0)
        self._left_running(done)
        self._batches.append(in_flight)
        self._stage_free_s[0] = float(stretch.free_s[k - 1])
        self._stretch = None
