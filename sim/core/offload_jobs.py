"""vLLM 0.33.0's CPU tier for the KV cache (`--kv-offloading-size`, the rewritten
`OffloadingConnector`), as its scheduler sees it; 0.15.1's is `sim.core.offload`. No time here:
the engine times the copies (`sim.engine.offload_jobs`) and reports the jobs done (`apply`).

The rules, from vLLM 0.33.0 (`distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py`,
`v1/kv_offload/cpu/manager.py`, `cpu/policies/lru.py`, `v1/core/sched/scheduler.py`), for one
full-attention group whose tier blocks are the GPU's:
- Only prompt blocks are stored (`offload_prompt_only`): at the end of each plan, for its
  requests in scheduling order, then those finished since the last plan, the full prompt
  blocks its tokens reach that the tier does not hold (a finished request offers every full
  prompt block it holds; an aborted one those it computed). Each offer is a copy job; a
  store needing more room than the evictable blocks give is refused, tried again next plan.
- A block is loadable once its own job is reported done (`completed_jobs`), whatever its
  request does; preemption completes nothing, but flushes the request's jobs (the worker
  waits for them before the step: `jobs_to_flush`). A lookup meeting a block being stored
  waits (`HIT_PENDING`), as does a request with jobs of its own in flight or one whose hit
  another request is loading; a request asked again offers its blocks from the first.
- The host blocks are evicted least recently used by request (`sim.core.offload_lru`).
- Finished requests free their GPU blocks at once. A block of a finished request's pending
  store that a plan hands out again (a hit, a new allocation) flushes that job.
- Loaded requests wait in a queue of their own (`kv_holding_waiting`), passed before the
  waiting one; a load is admitted only if its blocks fit beside what every request still
  prefilling (or loading) needs for its whole prompt (`_inflight_prefill_reserved_blocks`).
- With steps in flight, drafters, and one-token prompts: `free_blocks`, `inflight_blocks`,
  `lookup` and `reload` say what changes.
- On a disaggregated cluster's decode replica, beside the KV-transfer connector (a
  `MultiConnector`, NIXL listed first; paths under `distributed/kv_transfer/kv_connector/v1/`
  of 0.33.0): every connector is asked (`multi_connector.py:451-470`); this one's lookup
  sets the request's next block to offer back to 0 (`offloading/scheduler.py:1245`) and may
  make it wait, but NIXL takes the request (`nixl/pull_scheduler.py:59-65`) and this one is
  told of its blocks with no tokens to load (`multi_connector.py:484-494`, returning at
  `offloading/scheduler.py:1362`). So the prompt blocks the transfer brought are stored,
  from block 0, at its first step there (`_build_store_jobs`, line 1866). Once its KV has
  arrived (`v1/core/sched/scheduler.py:3467`) it waits in the holding queue
  (`kv_holding_waiting`, drained after the running requests, line 1065), so its stores
  follow the running requests' (`build`). NIXL clears its remote flag after the transfer
  (`nixl/pull_scheduler.py:188`): preempted there, it may load from this tier.
Only counts, hashes and the GPU blocks of pending stores are kept: no object per token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sim.core.block_cache import Block, BlockPrefixCache
from sim.core.kv_cache import cdiv
from sim.core.offload import Report
from sim.core.offload_lru import PENDING, RankedTier

if TYPE_CHECKING:
    from sim.core.offload_arc import ArcTier
    from sim.core.plan import Plan
    from sim.core.request import Request
    from sim.core.state import ReplicaState

@dataclass(slots=True)
class Job:
    """A copy job: a request's blocks loaded or stored, and for a store the GPU blocks it
    reads (a finished request's watched until the job is done)."""

    request_id: int
    hashes: list[int]
    is_store: bool
    gpu_blocks: list[Block] = field(default_factory=list)


@dataclass(slots=True)
class JobTransfers:
    """A step's copy jobs: loads and stores as (job id, request id, blocks), the jobs the
    worker must finish before the step (`jobs_to_flush`), and whether the step computes."""

    loads: list[tuple[int, int, int]] = field(default_factory=list)
    stores: list[tuple[int, int, int]] = field(default_factory=list)
    flush: set[int] = field(default_factory=set)
    runs: bool = True


@dataclass(slots=True)
class _RequestState:
    """`RequestOffloadState`: what the connector keeps of one request."""

    req: Request
    num_gpu_blocks: int = 0  # its GPU blocks the connector knows (`block_ids`)
    gpu_blocks: list[Block] | None = None  # at its finish
    next_stored: int = 0  # its next block to offer
    jobs: set[int] = field(default_factory=set)
    finished: bool = False
    signaled: bool = False  # its finish reached the tier (`finished_signaled`)


class JobOffloadState:
    """A replica's 0.33.0 CPU tier with the connector's and scheduler's bookkeeping around it
    (module docstring). Duck-typed like `sim.core.offload.OffloadState`."""

    def __init__(self, tier: RankedTier | ArcTier, kv: BlockPrefixCache,
                 defers_frees: bool = False, num_spec_step_tokens: int = 0,
                 drops_last_hit_block: bool = False) -> None:
        self.tier = tier
        self.kv = kv
        # With speculative decoding: a step's tokens with drafts and lookahead (1 + k +
        # lookahead), which a request still prefilling, or a load, keeps room for.
        self.num_spec_step_tokens = num_spec_step_tokens
        # An EAGLE-family drafter's group (`is_eagle_group`): a hit's last block, whose
        # draft KV depends on the token after it, is popped.
        self.drops_last_hit_block = drops_last_hit_block
        # With steps in flight (async scheduling) a request's freed blocks go back to the
        # pool only once the last step that scheduled it is processed (`defer_block_free`):
        # the steps planned and processed so far (non-empty ones), each request's last.
        self.defers_frees = defers_frees
        self._sched_seq = 0
        self._processed_seq = 0
        self._last_sched: dict[int, int] = {}
        self._deferred_frees: deque[tuple[int, list[Block]]] = deque()
        kv.taken = []  # (blocks handed out again, for the flush check)
        self._reqs: dict[int, _RequestState] = {}
        self._jobs: dict[int, Job] = {}
        self._next_job = 0
        self._being_loaded: set[int] = set()
        # GPU block -> pending store jobs that read it (finished requests' only).
        self._watched: dict[Block, set[int]] = {}
        # Loading (or loaded, not yet admitted) requests, in queue order; and of those, the
        # ones whose load was reported done (admitted at the queue pass that reaches them).
        self.holding: list[Request] = []
        self.loading: dict[int, Request] = {}
        self.loaded: set[int] = set()
        # Aborted while loading: their GPU blocks wait for the load to be reported.
        self.delayed: dict[int, Request] = {}
        self.finished_ids: list[int] = []
        self.loads: list[tuple[int, int, int]] = []
        # Decode replica: requests whose KV a transfer brings, taken (`remote_lookup`) and
        # not yet scheduled here.
        self.remote: set[int] = set()

    @property
    def busy(self) -> bool:
        """Jobs not reported done: vLLM's engine steps on (`has_pending_push_work`)."""
        return bool(self._jobs)

    def _state(self, req: Request) -> _RequestState:
        rs = self._reqs.get(req.request_id)
        if rs is None:
            rs = self._reqs[req.request_id] = _RequestState(req)
        return rs

    # -- the queue pass ---------------------------------------------------------------------

    def lookup(self, req: Request, num_gpu_hit_tokens: int) -> int | None:
        """`get_num_new_matched_tokens` for a queued request with nothing computed, after its
        GPU hit: the tokens it would load (0: none), or None to skip it this pass."""
        rs = self._state(req)
        rs.num_gpu_blocks = 0
        rs.next_stored = 0
        counters = self.tier.counters
        counters.num_lookups += 1
        if rs.jobs:
            counters.num_delayed_lookups += 1
            return None
        kv = self.kv
        block_size = kv.block_size
        num_blocks = req.num_tokens // block_size
        start = num_gpu_hit_tokens // block_size
        if num_blocks - start < 1:
            return 0
        hashes = kv.chain_hashes(req, num_blocks)
        state_of = self.tier.state_of
        hits = 0
        pending = False
        for h in hashes[start:num_blocks]:
            s = state_of(h)
            if s is None:
                break
            pending |= s == PENDING
            hits += 1
        if pending:
            counters.num_delayed_lookups += 1
            return None
        if hits and self.drops_last_hit_block:
            hits -= 1
        if hits and self._being_loaded and not self._being_loaded.isdisjoint(
                hashes[start:start + hits]):
            counters.num_delayed_lookups += 1
            return None
        return hits * block_size

    def remote_lookup(self, state: ReplicaState, req: Request) -> bool:
        """Decode replica: `req`, whose KV a transfer is to bring, is asked for by the queue.
        vLLM's `MultiConnector` asks every connector (`multi_connector.py:451-470` in 0.33.0):
        this one looks the tier up after the GPU hit (`get_num_new_matched_tokens` in
        `offloading/scheduler.py:1210-1277`, which also sets its next block to offer back to
        the first), its hit dropped (the transfer connector, first, claims the request), and
        None (blocks being stored or loaded) skips the request this step (False). Told of the
        allocation with no tokens to load (`multi_connector.py:484-494`), it loads nothing."""
        return self.lookup(req, state.kv.prefix_hit_tokens(req)) is not None

    def inflight_blocks(self, state: ReplicaState) -> int:
        """Blocks the requests still prefilling, or loading, need for their whole prompt
        (`_inflight_prefill_reserved_blocks`; with a drafter, a step's more each, and one
        step's for the load itself), which a load leaves free."""
        kv = state.kv
        block_size = kv.block_size
        extra = self.num_spec_step_tokens
        total = cdiv(extra, block_size)  # (`_spec_decode_step_blocks`)
        for req in [*state.prefilling(), *self.holding]:
            total += max(0, cdiv(req.num_tokens + extra, block_size)
                         - kv.num_held_blocks(req.request_id))
        return total

    def start_load(self, req: Request, num_gpu_hit_tokens: int, num_tokens: int) -> None:
        """`update_state_after_alloc`: `req` (its blocks allocated) loads `num_tokens` after
        its GPU hit; it waits in the holding queue until the load is reported done."""
        kv = self.kv
        block_size = kv.block_size
        start = num_gpu_hit_tokens // block_size
        end = (num_gpu_hit_tokens + num_tokens) // block_size
        hashes = kv.chain_hashes(req, end)[start:end]
        rid = req.request_id
        self.tier.prepare_load(rid, [(h, (i + 1) * block_size)
                                     for i, h in enumerate(hashes, start)])
        job_id = self._new_job(Job(rid, list(hashes), False))
        rs = self._state(req)
        rs.jobs.add(job_id)
        rs.next_stored = end
        self._being_loaded.update(hashes)
        self.loads.append((job_id, rid, len(hashes)))
        self.loading[rid] = req
        self.holding.append(req)
        counters = self.tier.counters
        counters.num_hit_requests += 1
        counters.num_loaded_blocks += len(hashes)
        counters.num_hit_tokens += num_tokens
        if not req.num_preemptions:  # (its last token, if loaded, is computed again)
            counters.num_first_hit_tokens += min(num_tokens,
                                                 req.num_tokens - 1 - num_gpu_hit_tokens)

    def reload(self, req: Request) -> None:
        """`update_state_after_alloc` for a one-token prompt asked again after its load
        (`sim.schedulers.admission.admit_waiting`): its block is held and cached, so the job
        loads none; it waits in the holding queue (back in it, if a lookup that had to wait
        sent it to the waiting queue) until the job is reported done."""
        rid = req.request_id
        job_id = self._new_job(Job(rid, [], False))
        rs = self._state(req)
        rs.jobs.add(job_id)
        rs.next_stored = req.num_tokens // self.kv.block_size
        self.loads.append((job_id, rid, 0))
        self.loading[rid] = req
        if req not in self.holding:  # (asked from the waiting queue)
            self.holding.append(req)

    def admitted(self, req: Request) -> None:
        """A loaded request left the holding queue for the running list."""
        self.holding.remove(req)

    def _new_job(self, job: Job) -> int:
        job_id = self._next_job
        self._next_job += 1
        self._jobs[job_id] = job
        return job_id

    # -- a request's end ----------------------------------------------------------------------

    def finished(self, state: ReplicaState, req: Request, *, held: bool = False) -> None:
        """`req` finished or was aborted: its GPU blocks are freed now (an aborted load's once
        the load is reported), its pending stores' blocks watched (`request_finished`).
        `held`: a prefill replica's request handed off, its blocks held for the KV transfer
        to a decode replica and freed when it ends (`released`): vLLM's transfer connector
        beside this one delays the free (a `MultiConnector`), this one does not."""
        rid = req.request_id
        self.finished_ids.append(rid)
        self.remote.discard(rid)
        rs = self._reqs.get(rid)
        if rs is not None:
            rs.finished = True
            if state.kv.num_held_blocks(rid):
                rs.gpu_blocks = list(self.kv.blocks_of(rid))
            for job_id in rs.jobs:
                job = self._jobs[job_id]
                for block in job.gpu_blocks:
                    self._watched.setdefault(block, set()).add(job_id)
        if req in self.holding:
            self.holding.remove(req)
        if rid in self.loading:
            del self.loading[rid]
            if rid not in self.loaded:
                self.delayed[rid] = req  # (its load still writes its blocks)
                return
            self.loaded.discard(rid)
        if held:
            return
        self.free_blocks(req)
        self._last_sched.pop(rid, None)

    def released(self, state: ReplicaState, req: Request) -> None:
        """A handed-off request's KV has reached its decode replica: its blocks go back."""
        self.free_blocks(req)
        self._last_sched.pop(req.request_id, None)

    def frees_now(self, req: Request) -> bool:
        """Whether `req`'s blocks would go back to the pool at once (no step in flight
        scheduled it): `_request_blocks_can_be_freed`."""
        return not self.defers_frees or self._last_sched.get(req.request_id, 0) <= \
            self._processed_seq

    def free_blocks(self, req: Request) -> None:
        """Free `req`'s GPU blocks (finished or preempted): now, or once the steps in flight
        that scheduled it are processed (`_free_request_blocks`)."""
        if self.frees_now(req):
            self.kv.free(req)
            return
        blocks = self.kv.detach(req)
        if blocks:
            self._deferred_frees.append((self._sched_seq, blocks))

    def step_processed(self) -> None:
        """A step that scheduled tokens has its output processed: the frees deferred until
        then go back to the pool (`_drain_deferred_frees`), before the output is applied."""
        self._processed_seq += 1
        deferred = self._deferred_frees
        while deferred and deferred[0][0] <= self._processed_seq:
            self.kv.release(deferred.popleft()[1])

    # -- the worker's report ------------------------------------------------------------------

    def apply(self, state: ReplicaState, report: Report) -> None:
        """The worker's report with a step's output: jobs done (`update_connector_output`),
        then requests whose load ended (`_update_from_kv_xfer_finished`)."""
        completed: list[int] = report.completed
        finished_recving: list[int] = report.finished_recving
        tier, jobs, watched = self.tier, self._jobs, self._watched
        for job_id in completed:
            job = jobs.pop(job_id)
            if job.is_store:
                tier.complete_store(job.hashes)
            else:
                tier.complete_load(job.hashes)
                self._being_loaded.difference_update(job.hashes)
            rs = self._reqs[job.request_id]
            if watched and rs.finished:
                for block in job.gpu_blocks:
                    pending = watched.get(block)
                    if pending is not None:
                        pending.discard(job_id)
                        if not pending:
                            del watched[block]
            rs.jobs.discard(job_id)
            if rs.signaled and not rs.jobs:
                del self._reqs[job.request_id]
        for rid in finished_recving:
            if rid in self.loading:
                self.loaded.add(rid)
            else:
                req = self.delayed.pop(rid, None)
                if req is not None:
                    self.free_blocks(req)

    # -- the end of a plan ----------------------------------------------------------------------

    def build(self, state: ReplicaState, plan: Plan, num_running: int) -> None:
        """`build_connector_meta`, at the end of a plan (its first `num_running` requests
        from the running pass): the jobs to flush, the stores of the prompt blocks the plan's
        requests (then those finished since the last) reach, and the loads started."""
        kv = self.kv
        block_size = kv.block_size
        scheduled = plan.num_scheduled_tokens
        flush: set[int] = set()
        load_ids = {job_id for job_id, _, _ in self.loads}
        for rid in plan.preempted_ids:
            rs = self._reqs.get(rid)
            if rs is not None and rs.jobs:
                flush.update(rs.jobs - load_ids)
        # (In request id order: vLLM's is a set of strings, which Python's hash seed orders.)
        finished_ids, self.finished_ids = sorted(self.finished_ids), []
        handed_out = self._handed_out(plan, num_running, bool(finished_ids))
        watched = self._watched
        if watched and handed_out:
            for block in handed_out:
                pending = watched.get(block)
                if pending:
                    flush.update(pending)
        tier, counters = self.tier, self.tier.counters
        order = list(scheduled)
        remote = self.remote
        for rid in plan.preempted_ids:
            remote.discard(rid)
        if remote:  # (decode replica: requests whose KV arrived wait in vLLM's holding queue,
            # drained after the running pass and before the waiting queue)
            joined = [r for r in order[:num_running] if r in remote]
            if joined:
                remote.difference_update(joined)
                running = [r for r in order[:num_running] if r not in joined]
                order = running + joined + order[num_running:]
        stores = []
        for rid, finished in [*((r, False) for r in order),
                              *((r, True) for r in finished_ids)]:
            rs = self._reqs.get(rid)
            if rs is None:
                continue
            req = rs.req
            if finished:
                if req.num_output_tokens >= req.num_target_output_tokens:
                    num_tokens = req.num_prompt_tokens  # (finished: its whole prompt)
                else:
                    num_tokens = req.num_computed_tokens  # (aborted)
                num_gpu_blocks = rs.num_gpu_blocks
            else:
                num_tokens = req.num_computed_tokens + scheduled[rid]
                rs.num_gpu_blocks = num_gpu_blocks = kv.num_held_blocks(rid)
            num_tokens = min(num_tokens, req.num_prompt_tokens)
            end = min(num_tokens // block_size, num_gpu_blocks)
            start = rs.next_stored
            if end <= start:
                continue
            hashes = kv.chain_hashes(req, end)
            to_store = tier.prepare_store(rid, [(hashes[i], (i + 1) * block_size)
                                                for i in range(start, end)])
            if to_store is None:
                counters.num_refused_stores += 1
                continue
            rs.next_stored = end
            if not to_store:
                continue
            gpu_blocks = rs.gpu_blocks if finished else kv.blocks_of(rid)
            assert gpu_blocks is not None
            fresh = set(to_store)
            sources = [gpu_blocks[i] for i in range(start, end) if hashes[i] in fresh]
            job_id = self._new_job(Job(rid, to_store, True, sources))
            rs.jobs.add(job_id)
            stores.append((job_id, rid, len(to_store)))
            counters.num_stored_blocks += len(to_store)
            if rs.finished:
                for block in sources:
                    watched.setdefault(block, set()).add(job_id)
                    if block in handed_out:
                        flush.add(job_id)
        for rid in finished_ids:
            rs = self._reqs.get(rid)
            if rs is None:
                continue
            rs.signaled = True
            tier.request_finished(rid)
            if not rs.jobs:
                del self._reqs[rid]
        plan.transfers = JobTransfers(self.loads, stores, flush, bool(scheduled))
        self.loads = []
        plan.finished_ids = finished_ids
        if self.defers_frees and scheduled:
            self._sched_seq += 1
            last_sched, seq = self._last_sched, self._sched_seq
            for rid in scheduled:
                last_sched[rid] = seq

    def _handed_out(self, plan: Plan, num_running: int, any_finished: bool) -> set[Block]:
        """GPU blocks this plan handed out (`_current_batch_allocated_block_ids`): every
        block of a request it took from the queue or started loading, and the cached blocks
        it evicted for new ones."""
        kv = self.kv
        taken = kv.taken
        assert taken is not None
        handed_out: set[Block] = set(taken)
        taken.clear()
        if not (self._watched or any_finished):
            return handed_out  # (checked against finished requests' pending stores only)
        for rid in list(plan.num_scheduled_tokens)[num_running:]:
            handed_out.update(kv.blocks_of(rid))
        for _, rid, _ in self.loads:
            handed_out.update(kv.blocks_of(rid))
        return handed_out

    def check(self, state: ReplicaState) -> None:
        """Every job its request's; loads pin what they read, and only that; the holding
        queue's requests wait, and hold KV."""
        self.tier.check()
        pinned: dict[int, int] = {}
        for job_id, job in self._jobs.items():
            assert job_id in self._reqs[job.request_id].jobs
            if not job.is_store:
                for h in job.hashes:
                    pinned[h] = pinned.get(h, 0) + 1
        assert self._being_loaded == set(pinned)
        for h, n in pinned.items():
            assert self.tier.state_of(h) == n
        waiting = {r.request_id for r in state.waiting}
        assert all(r.request_id in waiting for r in self.holding)
        assert set(self.loading) <= {r.request_id for r in self.holding}
        assert self.loaded <= set(self.loading)
