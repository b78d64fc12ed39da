"""Data-parallel ranks of an MoE model stepped in lockstep, as vLLM runs `--data-parallel-size D`
on one node, with `--enable-expert-parallel` or without (the lockstep is the same: vLLM's
`DPEngineCoreProc` serves every MoE model's ranks; `sim.hardware.parallelism` says where the
experts sit).

Each rank is an engine core of its own (a scheduler, a KV cache, a batch queue: a
`PipelinedReplica` of one stage, whose own process is not started); the group's process steps
them together, because every MoE layer exchanges tokens between all ranks:

- A request goes to the rank vLLM's load balancer picks (`sim.routers.vllm_dp`, by the ranks'
  engine release).
- Each step, every rank schedules. A rank with nothing to run while another has work runs a
  dummy batch of one token (`DPEngineCoreProc.execute_dummy_batch`), so the collectives line
  up.
- The ranks' token counts are made equal, the most of any rank's, where every rank's step fits
  a CUDA graph (vLLM 0.19 and 0.33 pad them alike: `coordinate_batch_across_dp`, up to vLLM's
  largest captured size, `capture_ceiling`); a larger step runs eagerly, each rank at its own
  count. vLLM 0.15.1 pads every step, eager ones too, wherever
  CUDA graphs are configured (`data_parallel_padding`: a rank decoding beside another's long
  prompt chunk runs as many tokens). (vLLM pads further, to its next captured size: not modelled.)
- The step takes what the latency model says of all ranks together (`lockstep_time_s`: the
  slowest rank's own layers, then every MoE layer on all ranks' tokens and its all-gather and
  reduce-scatter), the same for every rank.
- With async scheduling, as many steps are in flight as one rank would keep (two); ranks take
  their results when a step ends.
- Per-iteration noise (`latency.noise`) scales each lockstep step, dummy ones too, by the
  group's own draw for that step (the first rank's stream, by the group's step count; its
  regime from all ranks' tokens): the ranks wait for one another, so they jitter as one.
- With speculative decoding each rank verifies its own drafts (its acceptance is drawn per
  request, as on one replica), and the drafter's passes run in lockstep too: vLLM's proposer
  pads them across the ranks (`coordinate_batch_across_dp` in `llm_base_proposer.py`), and an
  idle rank's dummy batch runs the drafter's dummy passes (`DraftingLatency.lockstep_time_s`).
  0.33.0's dummy batch is a uniform decode, 1 + k tokens (`execute_dummy_batch`), 0.15.1's
  one token. (vLLM runs a drafter batch of more sampled requests than its largest graph
  eagerly, unpadded: here always padded.)
- Once no rank has work the ranks go on with dummy steps until the next check of whether any
  has (every 32 steps in vLLM 0.15-0.19; at the first step of a wave and every 16 in 0.33);
  then they stop until a request arrives.
- With a CPU tier for the KV cache (`kv_offload`), each rank's engine core runs its own
  connector (`OffloadingConnector`, built from the same `--kv-transfer-config`) with a tier of
  the whole size (`sim.engine.cpu_tier`: vLLM's `CPUOffloadingSpec` divides
  `cpu_bytes_to_use` by a block's bytes on `parallel_config.world_size` GPUs, tensor x
  pipeline, not data-parallel ranks). Each step every rank schedules, then launches with its
  copies and polls (`OffloadSteps.poll_plan`, `_launch`), an empty step too
  (`kv_connector_no_forward`), its report applied with its output. A rank that computes
  nothing while its requests are unfinished (waiting for a load) runs a dummy batch
  (`DPEngineCoreProc.run_busy_loop`: `EngineCore.step` ran the scheduler and the connector's
  poll, `executed` is false, `has_unfinished_requests` true; the dummy batch,
  `Worker.execute_dummy_batch` -> `_dummy_run`, binds no connector metadata: it neither
  copies nor polls) and keeps every rank stepping: it polls once a lockstep step, where one
  replica plans again at once. A launch that waits for copies (a preempted request's
  stores, 0.15.1's `handle_preemptions`; flushed jobs, 0.33.0's) holds the step back for
  every rank, the MoE layers' exchange waiting for it; stores (and 0.33.0's loads) start
  once the lockstep step is computed. With async scheduling a rank's empty step joins its
  batch queue (`step_with_batch_queue`) and its report is applied when the rank takes it,
  at the step's end; a rank whose launch waited for copies takes the step in flight's
  results only once that launch is done, and the ranks plan again from then.

SGLang's DP attention (`scheduler.name: sglang`, `_sglang_group`) runs the same lockstep by
SGLang 0.5.23's rules: its controller's balancer (`sim.routers.sglang_dp`), each rank's share
of the replica's limits (`SGLangConfig.for_rank`), an idle forward of no tokens for a rank
without work while another has some and no step once none has (the ranks gather their token
counts every iteration), its CUDA graphs' padding (`_sglang_counts`), and with speculative
decoding no decode on any rank while one prefills (`_decode_unless_prefilling`).

In a disaggregated cluster a pool's replica may be such a group: a prefill rank hands its
requests off as a prefill replica does, and a decode rank admits KV transfers at each step
(`DecodeInbox.admit`), the decode router picking the group and its balancer the rank (`pick`).

Stepped one step at a time (no fast path); no pipeline stages here (refused where the replica
is built).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Generator
from typing import Any, cast

import numpy as np
import simpy

from sim.config.errors import InputError
from sim.config.replica import ReplicaConfig
from sim.core.offload import Report
from sim.core.plan import Plan
from sim.core.request import Request
from sim.engine.clock import PLAN, At, Environment
from sim.engine.iteration_log import IterationLog
from sim.engine.offload_steps import idle_step, reload_only
from sim.engine.pipeline import PipelinedReplica
from sim.engine.replica import Iteration
from sim.latency.all_to_all import DEEPEP_BACKENDS
from sim.latency.base import BatchShape, LatencyModel
from sim.routers.base import ReplicaLoad
from sim.routers.sglang_dp import SGLangDataParallel, SGLangDataParallelConfig
from sim.routers.vllm_dp import VllmDataParallel, VllmDataParallelConfig
from sim.schedulers.sglang_config import SGLangConfig
from sim.schedulers.sglang_memory import (
    HIP_GPUS,
    decode_graph_limit,
    decode_graph_sizes,
    prefill_graph_sizes,
    total_mib,
)
from sim.workloads.base import MAX_SPAN_S

# SGLang's default largest prefill graph, which `apply_deepep_adjustments` rounds the sizes to
# before DP attention's own limit is set (`cuda_graph_hook.py`, `parallel_hook.py`).
DEEPEP_PREFILL_GRAPH_MAX = 2048

# SGLang's `load_snapshot_publish_interval` (`fields/observability.py`): a scheduler
# publishes its load every this many batches, and at once after a prompt step.
SGLANG_PUBLISH_INTERVAL = 15
# `LOAD_STALL_REFRESH_S` (`managers/scheduler.py`): a stalled scheduler's publishing floor.
SGLANG_STALL_PUBLISH_S = 0.05

# vLLM's capture ceiling for CUDA graphs (`max_cudagraph_capture_size`'s default): steps of
# more tokens on any rank run eagerly, unpadded.
MAX_GRAPH_TOKENS = 512


class Rank(PipelinedReplica):
    """One data-parallel rank: a replica whose steps its group runs."""

    group: DataParallelGroup

    def wake(self) -> None:
        self.group.wake()


class DataParallelGroup:
    """A replica of several data-parallel ranks in lockstep (module docstring). To the cluster
    it is one replica: it takes requests (`submit`) and shows their load (`load`); its ranks
    are the cluster's replicas for results and timeouts."""

    def __init__(self, env: Environment, ranks: list[Rank], latency: LatencyModel,
                 balancer: VllmDataParallel | SGLangDataParallel, *, max_num_seqs: int,
                 sync_interval: int, sync_first_step: bool, pads_every_step: bool = False,
                 capture_limit: int = MAX_GRAPH_TOKENS, dummy: BatchShape | None = None,
                 graph_sizes: tuple[list[int], list[int]] | None = None,
                 spec_width: int = 1, decodes_extend: bool = True) -> None:
        self.env = env
        self.ranks = ranks
        self.latency = latency
        self.balancer = balancer
        self.replica_id = ranks[0].replica_id  # (the cluster's front end: the first rank's)
        self.turn = PLAN + ranks[0].replica_id
        # Steps padded alike up to this many tokens on the busiest rank (every step: inf).
        self.pad_limit = math.inf if pads_every_step else capture_limit
        # SGLang: the sizes its decode and prefill CUDA graphs are captured at (steps padded
        # to the next, `_sglang_counts`); None: vLLM's rule, to the most of any rank's.
        self.graph_sizes = graph_sizes
        self.spec_width = spec_width
        # Whether a decoding rank joins a prompt step's prefill graphs as one-token extends.
        self.decodes_extend = decodes_extend
        self._converted: list[bool] = []  # (the step's decoding ranks SGLang converted)
        # An idle rank's dummy batch (with a drafter: its dummy passes, `num_drafting_seqs`).
        self.dummy = dummy or BatchShape(num_decode_tokens=1)
        self.sync_interval = sync_interval
        self.sync_first_step = sync_first_step
        self.depth = ranks[0].pipeline_depth
        self.overlaps_host = ranks[0].overlaps_host
        for rank in ranks:
            rank.group = self
            rank.log = IterationLog(speculative=rank.state.acceptance is not None,
                                    data_parallel=True)
            rank.bind_log()
        self._steps: deque[float] = deque()  # ends of the steps in flight, oldest first
        self._free_s = -math.inf  # when the GPUs finish the last step sent
        self._counter = 0  # steps since the ranks last found every rank idle (a wave)
        self._num_steps = 0  # lockstep steps sent (each its own noise draw)
        self.noise = ranks[0].noise
        self._poke: simpy.Event | None = None
        # Ranks with a CPU tier whose last plan polled it with copies running, and ranks
        # whose one-token prompts reload for ever (`_launch`).
        self._polling: list[Rank] = []
        self._spinning: list[Rank] = []
        self.num_dummy_forwards = 0  # rank-steps that ran a dummy batch
        # SGLang's ranks publish their loads to its balancer (`SGLangDataParallel.publish`):
        # each rank's batches since it last did.
        self.publishes = isinstance(balancer, SGLangDataParallel)
        # SGLang's speculative decoding: no rank decodes while one prefills (`_send`).
        self.defers_decodes = self.publishes and ranks[0].state.drafting
        for rank in ranks if self.defers_decodes else ():
            cast(Any, rank.scheduler).defer_decodes = True
        self.idle_s = 0.0  # when the ranks last passed with no tokens on any (SGLang)
        self._stall_published_s = [-math.inf] * len(ranks)
        for rank in ranks if self.publishes else ():
            cast(Any, rank.scheduler).group_idle_since = lambda at_s: self.idle_s >= at_s
        self._unpublished = [0] * len(ranks)
        self.process = env.process(self.run())

    # -- what the cluster sees ---------------------------------------------------------------

    def submit(self, req: Request) -> None:
        self.pick(req).submit(req)

    def reject_reason(self, req: Request) -> str | None:
        """Why `req` can never be served here (its ranks alike); None if it can."""
        return self.ranks[0].reject_reason(req)

    def pick(self, req: Request) -> Rank:
        """The rank vLLM's balancer gives `req` (a request the cluster routed here, or, on a
        decode pool, whose KV is to come here)."""
        ranks = self.ranks
        if len(ranks) == 1:
            return ranks[0]
        loads = [rank.load() for rank in ranks]
        now_s = self.env.now
        if self.publishes and self._free_s <= now_s:
            # No step in flight: SGLang's schedulers loop with no batch, a fully idle one
            # publishing at every pass (`on_idle`), one with requests it cannot run at most
            # every 50 ms (`LOAD_STALL_REFRESH_S`).
            stalled = self._stall_published_s
            for index, (rank, load) in enumerate(zip(ranks, loads, strict=True)):
                if rank.state.running or rank.state.waiting:
                    if now_s - stalled[index] < SGLANG_STALL_PUBLISH_S:
                        continue
                    stalled[index] = now_s
                cast(SGLangDataParallel, self.balancer).publish(index, load, now_s)
        return ranks[self.balancer.choose_at(req, loads, now_s)]

    def load(self, req: Request | None = None) -> ReplicaLoad:
        loads = [rank.load(req) for rank in self.ranks]
        return ReplicaLoad(sum(x.num_outstanding for x in loads),
                           sum(x.num_load_tokens for x in loads),
                           max(x.num_prefix_hit_tokens for x in loads),
                           sum(x.num_waiting for x in loads),
                           sum(x.num_running for x in loads),
                           sum(x.kv_usage for x in loads) / len(loads))

    def load_tokens(self) -> int:
        return self.load().num_load_tokens

    def wake(self) -> None:
        if self._poke is not None and not self._poke.triggered:
            self._poke.succeed()

    # -- the group's process -----------------------------------------------------------------

    def run(self) -> Generator[simpy.Event, Any, None]:
        env, ranks = self.env, self.ranks
        while True:
            now = env.now
            for rank in ranks:
                rank.sync()
                rank.expire(now)
                if rank.inbox is not None and rank.inbox.pending:  # (a decode pool's rank)
                    rank.inbox.admit()
            while len(self._steps) < self.depth and self._send(now):
                pass
            if self._steps:
                yield At(env, self._steps.popleft(), self.turn)
                # With steps in flight (async scheduling) a rank whose launch waited for
                # copies takes its results once that launch is done, and the ranks plan
                # again from then (the others have taken theirs at the step's end).
                host_s = max(rank._host_s for rank in ranks)
                if host_s > env.now:
                    for rank in ranks:
                        rank.sync()
                    yield At(env, host_s, self.turn)
                continue
            self._counter = 0  # every rank idle, and all know it: the wave ends
            self.idle_s = env.now
            yield from self._idle()

    def _idle(self) -> Generator[simpy.Event, Any, None]:
        """No step is due: wait for work, or for the next copy of a rank that polls its CPU
        tier (`_polling`, as one replica waits: `_wait_copies`)."""
        env = self.env
        poke = self._poke = env.event()
        done_s = min((rank.copies.next_done_s() for rank in self._polling
                      if rank.copies is not None), default=math.inf)
        # (A rank's hierarchical cache: an ack to take may unlock what its queue needs; SGLang
        # polls on, `Replica._wait_idle`.)
        done_s = min([done_s] + [rank.host_copies.next_done_s() for rank in self.ranks
                                 if rank.host_copies is not None and rank.host_copies.busy])
        if done_s < math.inf:
            def on_done(_: Any) -> None:
                if not poke.triggered:
                    poke.succeed()

            At(env, max(done_s, env.now), self.turn).callbacks.append(on_done)
        unmark = [rank.mark_reloading() for rank in self._spinning]
        yield poke
        self._poke = None
        for undo in unmark:
            undo()
        yield At(env, env.now, self.turn)  # plan after all else at this instant

    def _send(self, now_s: float) -> bool:
        """Schedule every rank and send the step (dummy batches where a rank has none);
        False where no step is due: no rank has anything to run, and the ranks know it."""
        plans: list[Plan | None] = []
        for rank in self.ranks:
            state = rank.state
            if rank.host_copies is not None:  # (SGLang's hierarchical cache: a pass starts)
                rank.host_copies.pass_start(now_s)
            if rank.copies is not None:  # (a CPU tier: an empty plan still launches, polls)
                rank._hold = False  # (a planning turn: `PipelinedReplica._complete_batches`)
                plans.append(rank.poll_plan(now_s))
            else:
                plans.append(rank.scheduler.schedule(state, now_s)
                             if state.running or state.waiting else None)
        if self.defers_decodes:
            self._decode_unless_prefilling(plans, now_s)
        launch_s, reports, waits = self._launch(plans, now_s)
        passes_s = [rank.host_copies.wait_writes(now_s) for rank in self.ranks
                    if rank.host_copies is not None]
        if passes_s and max(passes_s) > now_s:
            # write_back: a rank's pass waits for the backups it made as it evicted; the
            # ranks then gather their batches' sizes (`prepare_mlp_sync_batch`, which blocks
            # each until the last arrives) and launch, and only then does each take the
            # results of the step in flight (the overlap loop's `process_batch_result`).
            launch_s = max(launch_s, *passes_s)
            for rank in self.ranks:
                rank._host_s = max(rank._host_s, launch_s)
        busy = any(plans) or waits
        if not busy and not self._trailing():
            for rank, plan, report in zip(self.ranks, plans, reports, strict=True):
                if plan is not None:
                    rank._preempted += plan.preempted_ids  # logged with its next plan
                if self.depth > 1 and report:
                    # (No step: the engine, with nothing more to schedule, takes the empty
                    # step's output at once.)
                    assert rank.state.offload is not None
                    rank.state.offload.apply(rank.state, report)
            if (any(plan is not None and rank.copies is None
                    for rank, plan in zip(self.ranks, plans, strict=True)) and not self._steps
                    and not any(rank.state.num_transferring or rank.state.incoming
                                or (rank.host_copies is not None and rank.host_copies.busy)
                                for rank in self.ranks)):
                # Requests queued that no rank can run, with nothing in flight, no KV on its
                # way in or out (a disaggregated pool's) and no copy of a hierarchical cache
                # to acknowledge (`_idle` waits for it): they never will.
                raise RuntimeError("data-parallel ranks: requests queued, none can run")
            return False
        self._counter += 1
        shapes = []
        for rank, plan in zip(self.ranks, plans, strict=True):
            if plan:
                shapes.append(BatchShape.of_replica(plan, rank.state))
            else:
                self.num_dummy_forwards += 1
                shapes.append(self.dummy)
        own = [int(shape.num_tokens) for shape in shapes]
        if self.graph_sizes is not None:
            counts = self._sglang_counts(shapes, own)
        else:
            counts = [max(own)] * len(own) if max(own) <= self.pad_limit else own
        step_s, all_to_all_s = self.latency.lockstep_time_s(shapes, counts)
        if self.overlaps_host:
            host_s = max(float(self.latency.host_time_s(shape)) for shape in shapes)
            step_s = max(step_s - host_s, host_s)
        if self.noise is not None:
            step_s *= self.noise.factor(self._num_steps,
                                        sum(int(shape.num_prefill_tokens) for shape in shapes),
                                        sum(int(shape.num_decode_tokens) for shape in shapes))
        # A rank's loads from its hierarchical cache are copied layer by layer ahead of its
        # layers (`HostCacheCopies.duration_s`): the slowest rank's sets the step.
        step_s = max([step_s] + [rank.host_copies.duration_s(step_s) for rank in self.ranks
                                 if rank.host_copies is not None])
        self._num_steps += 1
        start_s = max(launch_s, self._free_s)  # (every rank launched: a collective)
        end_s = start_s + step_s
        if not start_s < end_s < MAX_SPAN_S:  # NaN fails too (`Replica._check_durations`)
            self.ranks[0]._check_durations(np.array([start_s]), np.array([step_s]),
                                           np.array([end_s]))
        self._free_s = end_s
        step: Iteration | None = None  # (the step's first iteration: its end is every rank's)
        for rank, plan, shape, report in zip(self.ranks, plans, shapes, reports, strict=True):
            if plan is None:
                continue
            if rank.copies is not None and plan:
                rank.copies.computed_by(end_s)
            if not plan:
                rank._preempted += plan.preempted_ids
                if self.depth > 1 and report is not None and (report or not idle_step(plan)):
                    # Async scheduling: the empty step joins the rank's batch queue, its
                    # report applied when the rank takes it, at this step's end.
                    rank._batches.append(Iteration(plan, cast(BatchShape, None), start_s, 0.0,
                                                   end_s, 0, 0, [], report))
                continue
            if rank._preempted:
                plan.preempted_ids[:0] = rank._preempted
                rank._preempted = []
            state = rank.state
            it = Iteration(plan, shape, start_s, step_s, end_s, state.kv.num_used_blocks,
                           len(state.waiting), all_to_all_s=all_to_all_s)
            it.report = report  # (applied with the step's output, `_complete_batches`)
            it.in_flight = state.start(plan, start_s, placeholders=rank.placeholders)
            rank._batches.append(it)
            step = step or it
        for rank in self.ranks:
            if rank.host_copies is not None and step is not None:
                # Every rank ran the step (an idle forward too): its end is the fence for the
                # rank's backups and when the rank's loads end.
                rank.host_copies.launched(step)
        if self.publishes:
            self._publish(shapes, plans, now_s)
        self._steps.append(end_s)
        return True

    def _publish(self, shapes: list[BatchShape], plans: list[Plan | None], now_s: float
                 ) -> None:
        """SGLang's ranks publish their loads as each processes its batch's result
        (`process_batch_result` -> `publish_load_snapshot`): at once after a prompt step,
        else every 15th batch, an idle forward's too (`load_snapshot_publish_interval`).
        Taken here as the step is planned (with the overlap scheduler a batch's result is
        processed as the next is launched)."""
        balancer = cast(SGLangDataParallel, self.balancer)
        for index, (rank, shape, plan) in enumerate(zip(self.ranks, shapes, plans,
                                                        strict=True)):
            extend = bool(plan) and bool(shape.num_prefill_tokens) or (
                bool(self._converted) and self._converted[index])
            self._unpublished[index] += 1
            if extend or self._unpublished[index] >= SGLANG_PUBLISH_INTERVAL:
                self._unpublished[index] = 0
                balancer.publish(index, rank.load(), now_s)

    def _decode_unless_prefilling(self, plans: list[Plan | None], now_s: float) -> None:
        """SGLang with speculative decoding on DP attention (`get_next_batch_to_run`: the
        ranks sync on their new prefill batches first): where any rank prefills, the others
        run idle forwards, their decodes waiting; else each rank that would decode does."""
        ranks = self.ranks
        if any(plan and BatchShape.of_replica(plan, rank.state).num_prefill_tokens
               for rank, plan in zip(ranks, plans, strict=True)):
            return
        for index, (rank, plan) in enumerate(zip(ranks, plans, strict=True)):
            scheduler = cast(Any, rank.scheduler)
            if plan is None or not scheduler.decode_deferred:
                continue
            scheduler.decode_pass = True
            try:
                decode = scheduler.schedule(rank.state, now_s)
            finally:
                scheduler.decode_pass = False
            decode.preempted_ids[:0] = plan.preempted_ids
            plans[index] = decode

    def _sglang_counts(self, shapes: list[BatchShape], own: list[int]) -> list[int]:
        """The tokens each SGLang rank runs a step at (`prepare_mlp_sync_batch`): where no
        rank extends, the decode graph captured for the most of any rank's requests, on
        every rank; where one does, the prefill graph captured for the most of any rank's
        tokens, on every rank (an idle rank's a dummy extend of as many), unless a decoding
        rank cannot run as one-token extends (speculative decoding, an all-to-all backend:
        its vote fails); each rank's own where the step fits no graph (eager, SUM_LEN).
        Which decoding ranks SGLang converts to extends (none with an idle rank:
        `maybe_convert_decode_to_extend`) is kept for `_publish`."""
        decode_sizes, prefill_sizes = cast(tuple[list[int], list[int]], self.graph_sizes)
        self._converted = []
        if any(shape.num_prefill_tokens for shape in shapes):
            decoding = [not shape.num_prefill_tokens and bool(shape.num_decode_tokens)
                        for shape in shapes]
            sizes, most, width = prefill_sizes, max(own), 1
            if any(decoding) and not self.decodes_extend:
                sizes = []
            elif sizes and most <= sizes[-1] and min(own) > 0:
                self._converted = decoding
        else:  # (decode graphs by requests, each verifying `spec_width` tokens)
            sizes, width = decode_sizes, self.spec_width
            most = max(int(shape.num_decode_tokens) for shape in shapes)
        if not sizes or most > sizes[-1]:
            return own
        return [sizes[bisect_left(sizes, most)] * width] * len(own)

    def _launch(self, plans: list[Plan | None], now_s: float
                ) -> tuple[float, list[Report | None], bool]:
        """Each rank with a CPU tier launches its plan with its copies, an empty one too
        (vLLM's `kv_connector_no_forward`), and polls: when the last launch happens (a rank
        waiting for a preempted request's stores holds the collective back), each rank's
        report (an empty plan's is applied now, with its step's output), and whether a rank
        with nothing to compute waits on its copies (vLLM: its requests are unfinished, so
        it runs dummy batches and every rank steps). Ranks that wait for ever stop
        (`stall_now`) or, looping on one-token reloads, wait for work (`_spinning`)."""
        launch_s, waits = now_s, False
        reports: list[Report | None] = []
        self._polling, self._spinning = [], []
        for rank, plan in zip(self.ranks, plans, strict=True):
            copies, state = rank.copies, rank.state
            if copies is None or plan is None:
                reports.append(None)
                continue
            at_s, report = rank._launch(plan, now_s)
            rank._host_s = at_s  # (its results are taken once its launch is done)
            launch_s = max(launch_s, at_s)
            reports.append(report)
            if plan:
                continue
            assert state.offload is not None
            if self.depth == 1:  # (async: applied when the rank takes the step, `_send`)
                state.offload.apply(state, report)
            if copies.busy:
                self._polling.append(rank)  # (idle, it polls when the next copy ends)
            if not (state.waiting or state.running):
                continue
            if report and reload_only(plan) and getattr(copies, "polled_empty_only", False):
                if not state.running:
                    self._spinning.append(rank)
            elif report or not idle_step(plan) or copies.busy or rank._batches:
                waits = True  # (with steps in flight: an empty one's report is still to come)
            elif not (state.num_transferring or state.incoming):
                rank.stall_now()  # (vLLM steps on, dummy batches, for ever)
        return launch_s, reports, waits

    def _trailing(self) -> bool:
        """Whether the ranks, all idle, still run a dummy step: they learn that every rank is
        idle only at a check (`dp_sync_interval`), and run dummies until then."""
        counter = self._counter
        if counter == 0:
            return False  # (idle, and known to be: a new wave starts with work)
        if self.sync_first_step and counter == 1:
            return False
        return counter % self.sync_interval != 0



def _size_grid(most: int) -> list[int]:
    """vLLM's default grid up to `most`: 1, 2, 4, then by 8 below 256, then by 16."""
    return ([n for n in (1, 2, 4) if n <= most] + list(range(8, min(most + 1, 256), 8))
            + list(range(256, most + 1, 16)))


def capture_ceiling(max_num_seqs: int, k: int, max_num_batched_tokens: int | None,
                    latest: bool) -> int:
    """vLLM's largest CUDA-graph capture size by default (`VllmConfig._set_cudagraph_sizes`,
    0.15.1 and 0.33.0): at most twice `max_num_seqs` decodes of 1 + k tokens, 512 and the
    budget; the sizes captured step by 8 to 256, then by 16; 0.33.0 also captures the budget
    and uniform decode batches (n decodes of 1 + k tokens) within that."""
    width = 1 + k
    budget = max_num_batched_tokens if max_num_batched_tokens is not None else MAX_GRAPH_TOKENS
    cap = min(max_num_seqs * width * 2, MAX_GRAPH_TOKENS, budget)
    sizes = _size_grid(cap)
    if latest:
        if budget <= cap:
            sizes.append(budget)
        if width > 1:  # (request counts on the same grid, `request_counts`)
            most = min(max_num_seqs, MAX_GRAPH_TOKENS)
            sizes += [n * width for n in [*_size_grid(most), most]
                      if n * width <= min(cap, budget)]
        elif max_num_seqs <= cap:
            sizes.append(max_num_seqs)
    return max(sizes)


def build_group(env: Environment, cfg: ReplicaConfig, source: str,
                make_rank: Callable[[], Any], field: str = "replica",
                seed: np.random.SeedSequence | None = None) -> DataParallelGroup:
    """The replica `cfg` (at `field`: a pool's, in a disaggregated cluster) describes, of
    `cfg.parallelism.data` ranks (`make_rank` builds each); what the ranks do not model is
    refused, one line naming the field; `seed`: a balancer's draws (SGLang's bootstrap
    rooms)."""
    scheduler = cfg.scheduler
    if scheduler.name not in ("vllm_v1", "sglang"):
        raise InputError(source, f"{field}.parallelism.data", cfg.parallelism.data,
                         "data-parallel ranks are modelled as vLLM and SGLang run them: give "
                         "scheduler.name vllm_v1 or sglang")
    if isinstance(scheduler, SGLangConfig):
        return _sglang_group(env, cfg, source, make_rank, field, scheduler, seed)
    spec = getattr(scheduler, "speculative", None)
    if spec is not None and spec.num_speculative_tokens_per_batch_size is not None:
        raise InputError(source, f"{field}.scheduler.speculative."
                         "num_speculative_tokens_per_batch_size",
                         spec.num_speculative_tokens_per_batch_size,
                         "vLLM turns dynamic speculative decoding off with data-parallel ranks "
                         "(they could choose different drafts and deadlock): drop it, k "
                         "drafts a step as vLLM falls back to")
    ranks = _make_ranks(cfg, source, make_rank, field)
    version = getattr(scheduler, "engine_version", None) or "0.15.1"
    balancer = VllmDataParallel(
        VllmDataParallelConfig(name="vllm_dp", engine_version=version,
                               engines_publish_counts=True), np.random.default_rng(0))
    latest = version == "0.33.0"
    budget = getattr(scheduler, "max_num_batched_tokens", None)
    k = spec.num_speculative_tokens if spec is not None else 0
    width = 1 + k if latest else 1  # (`execute_dummy_batch`: 0.33.0's uniform decode)
    dummy = BatchShape(num_decode_tokens=1, num_spec_tokens=width - 1,
                       num_drafting_seqs=width if spec is not None else 0)
    # DeepEP's normal kernels cannot be captured: vLLM turns CUDA graphs off with them and
    # data-parallel ranks (`CompilationConfig`: cudagraph_mode NONE), so no step is padded.
    graphs = getattr(cfg.latency, "all2all_backend", None) != "deepep_high_throughput"
    return DataParallelGroup(env, ranks, ranks[0].latency, balancer,
                             max_num_seqs=int(scheduler.max_num_seqs),
                             capture_limit=capture_ceiling(
                                 int(scheduler.max_num_seqs), k,
                                 budget if type(budget) is int else None, latest)
                             if graphs else 0,
                             dummy=dummy,
                             sync_interval=16 if latest else 32, sync_first_step=latest,
                             pads_every_step=graphs and bool(getattr(scheduler,
                                                                     "pads_every_step", False)))


def _make_ranks(cfg: ReplicaConfig, source: str, make_rank: Callable[[], Any], field: str
                ) -> list[Rank]:
    """The replica's `cfg.parallelism.data` ranks; a recording refused (one replica's)."""
    ranks = [make_rank() for _ in range(cfg.parallelism.data)]
    if ranks[0].latency.sequential:
        raise InputError(source, f"{field}.latency.kind", cfg.latency.kind,
                         "a recording replays one replica's iterations in order; "
                         "data-parallel ranks would share it (not modelled)")
    return cast(list[Rank], ranks)


def _sglang_group(env: Environment, cfg: ReplicaConfig, source: str,
                  make_rank: Callable[[], Any], field: str, scheduler: SGLangConfig,
                  seed: np.random.SeedSequence | None) -> DataParallelGroup:
    """SGLang 0.5.23's DP attention (`--tp D x T --dp D --enable-dp-attention`): a scheduler
    per rank with its share of the replica's limits (`SGLangConfig.for_rank`), the
    controller's balancer (`sim.routers.sglang_dp`), and every scheduler iteration an
    all-gather of the ranks' token counts (`prepare_mlp_sync_batch`): where any rank has
    tokens, every rank without runs an idle forward of none, so no step trails the last work.
    Steps are padded to SGLang's CUDA graphs (`_sglang_counts`); with speculative decoding
    no rank decodes while one prefills (`_decode_unless_prefilling`)."""
    ranks = _make_ranks(cfg, source, make_rank, field)
    method = scheduler.load_balance_method
    if method == "auto":  # (`serving_hook.py`: by the server's disaggregation mode)
        method = ("follow_bootstrap_room" if field.startswith("cluster.prefill")
                  else "round_robin")
    balancer = SGLangDataParallel(
        SGLangDataParallelConfig(name="sglang_dp", load_balance_method=method),
        np.random.default_rng(seed), published=True)
    per_rank = cast(SGLangConfig, ranks[0].scheduler.config)
    block_size = cfg.kv_cache.block_size
    if (block_size > 1 and per_rank.chunked_prefill_size % block_size
            and per_rank.decode_reserve_tokens is None and not field.startswith("cluster.decode")):
        raise InputError(source, f"{field}.scheduler.chunked_prefill_size",
                         scheduler.chunked_prefill_size,
                         f"each of the {len(ranks)} ranks prefills {len(ranks)}th of it "
                         f"({per_rank.chunked_prefill_size} tokens), which SGLang asks to be "
                         f"whole pages of kv_cache.block_size ({block_size})")
    backend = getattr(cfg.latency, "all2all_backend", None)
    gathers = backend in (None, "allgather_reducescatter")
    gpu = cfg.gpu_spec
    # The decode graphs' largest batch by the GPU and the whole TP group, at most a given
    # running limit, the replica's (`memory_hook.py`), captured up to a rank's request pool;
    # the prefill graphs up to a rank's chunk (`parallel_hook.py`), with DeepEP and a chunk
    # of 2048 or more at sizes rounded up to multiples of 8, to 2048 (`apply_deepep_
    # adjustments`). DeepEP's normal kernels turn both off (`moe_hook.py`); in auto mode both
    # stay, a prompt step's exchange run eagerly between the graph's pieces with the normal
    # kernels (`DeepEPMoE.forward`); AMD GPUs capture no prefill graphs. A decoding rank joins
    # a prompt step's prefill graphs only without an all-to-all backend or speculative
    # decoding (`_local_prefill_cuda_graph_vote`).
    spec = scheduler.speculative
    graphs = backend != "deepep_high_throughput"
    decode_max_bs = decode_graph_limit(total_mib(gpu),
                                       cfg.parallelism.data * cfg.parallelism.tensor,
                                       scheduler.given_max_running_requests)
    decode_sizes = decode_graph_sizes(decode_max_bs, per_rank.max_num_seqs,
                                      spec=spec is not None) if graphs else []
    chunk = per_rank.chunked_prefill_size
    # (DeepEP's rounding runs before DP attention sets the graphs' limit, at SGLang's default
    # 2048: a rank's chunk below it rebuilds the sizes unrounded, one above keeps the
    # rounded ones up to 2048.)
    deepep_rounds = backend in DEEPEP_BACKENDS and chunk >= DEEPEP_PREFILL_GRAPH_MAX
    prefill_sizes = (prefill_graph_sizes(min(chunk, DEEPEP_PREFILL_GRAPH_MAX) if deepep_rounds
                                         else chunk, align_8=deepep_rounds)
                     if graphs and gpu.measured_as not in HIP_GPUS else [])
    if cfg.lm_head_ranks > 1:
        # The LM head over all D x T GPUs (`ReplicaConfig.lm_head_ranks`); on a decode pool
        # of one GPU a rank SGLang exchanges the logits all-to-all where the ranks' rows are
        # alike (`_tp_lm_head_all_to_all_default`, `_can_use_tp_lm_head_all_to_all`).
        all_to_all = field.startswith("cluster.decode") and cfg.parallelism.tensor == 1
        for latency in {id(rank.latency): rank.latency for rank in ranks}.values():
            split = getattr(latency, "split_lm_head", None)
            if split is not None:  # (a model that times the LM head: the roofline)
                split(cfg.lm_head_ranks, all_to_all)
    return DataParallelGroup(env, ranks, ranks[0].latency, balancer,
                             max_num_seqs=per_rank.max_num_seqs,
                             capture_limit=decode_sizes[-1] if decode_sizes else 0,
                             dummy=BatchShape(), sync_interval=1, sync_first_step=False,
                             graph_sizes=(decode_sizes, prefill_sizes),
                             spec_width=1 if spec is None else spec.num_draft_tokens or 1,
                             decodes_extend=gathers and spec is None)
