"""vLLM v1's unified scheduler (`vllm/v1/core/sched/scheduler.py`, `Scheduler.schedule`): no
prefill phase and no decode phase, one token budget, running requests first, then the queue.

Each rule, and where it comes from (vLLM files as read on vLLM's main branch; "doc 00N" is
`../shared/background/00N_*.txt`):

1. One budget. Every iteration computes at most `max_num_batched_tokens` tokens, prefill chunks
   and decode tokens together (`schedule`: `token_budget = self.max_num_scheduled_tokens`,
   asserted at its end). At most `max_num_seqs` requests run (`max_num_running_reqs`).
2. Running requests first, in running order (oldest admission first), while budget is left:
   each gets min(its uncomputed tokens, `long_prefill_token_threshold` if > 0, the budget left)
   (`schedule`, "First, schedule the RUNNING requests"). So a decode gets its one token and an
   unfinished prefill its next chunk; a prefill that takes the rest of the budget leaves nothing
   for running requests behind it, as in vLLM.
3. KV slots are allocated for exactly the tokens scheduled, nothing kept for future tokens
   (`KVCacheManager.allocate_slots` in `vllm/v1/core/kv_cache_manager.py`; lookahead slots only
   serve speculative decoding). Hence `decode_reserve_tokens` defaults to 0 here.
4. Preemption by recompute. When a running request cannot get its blocks, the last running
   request is preempted (FCFS policy: `self.running.pop()`), its KV freed, its computed tokens
   dropped and it goes back to the front of the queue (`_preempt_request`); repeat until the
   blocks fit; if the request itself was the victim, the running pass ends. vLLM takes a
   victim's already scheduled tokens back out of the step (its priority policy can pick one);
   under FCFS the last running request is never scheduled yet, so that gives nothing back.
5. The queue, FCFS, only if nothing was preempted in this step (`if not preempted_reqs`), while
   budget is left and fewer than `max_num_seqs` run. For the head: its prefix-cache hit first
   (`get_computed_blocks`, only for a request with nothing computed: here
   `KVCacheManager.prefix_hit_tokens`, 0 without caching; vLLM's hit is at most
   `num_tokens - 1`), then num_new = tokens still to compute, capped by the threshold; chunking
   off and num_new over the budget left: the queue stops (the prompt waits whole); otherwise
   capped by the budget left. If its blocks do not fit, the queue stops. Nothing is reserved
   for running requests' future tokens (a user-set `decode_reserve_tokens` is honoured as in
   `chunked_prefill`).
6. Chunking off. `SchedulerConfig.verify_max_model_len` (`vllm/config/scheduler.py`) requires
   `max_num_batched_tokens >= max_model_len` then, so a request whose recompute (prompt plus
   output) cannot fit one budget is refused here (`capacity_reason`, as `prefill_first` does).
   A threshold would still cut prompts (rule 5's order): refused with chunking off, like every
   setting here that chunking off would make meaningless.
7. Concurrent partial prefills. vLLM v1 does not limit them: `max_num_partial_prefills` and
   `max_long_partial_prefills` exist in `vllm/config/scheduler.py` (default 1) but the v1
   scheduler never reads them, and `EngineArgs._is_v1_supported_oracle`
   (`vllm/engine/arg_utils.py`) refuses other values ("Concurrent Partial Prefill is not
   supported"; issue #14003; PR #15419 added `long_prefill_token_threshold` instead; PRs #41399
   and #49075 to enforce them are unmerged). So by default (None) nothing limits them, as in v1:
   with a threshold, several long prompts advance side by side. Set, they limit admission as in
   vLLM v0 (`PartialPrefillMetadata`, `vllm/core/scheduler.py`): a queued request whose chunk
   would leave it part-way through its prefill is admitted only while fewer than
   `max_num_partial_prefills` requests would be part-way after this iteration, and, if long
   (tokens still to prefill > threshold), fewer than `max_long_partial_prefills` long ones.
   Unlike v0 the queue stops there (no queue jumping), and the budget is not split among them.
8. Minimum chunk (`min_chunk_tokens`, doc 002's `_schedule_prefills` `min_chunk_size`; vLLM's
   own scheduler has none; off by default). A chunk smaller than it that would not finish the
   request's catch-up (prompt, or prompt plus output after a preemption) is not scheduled: a
   queued request waits and the queue stops (doc 002: `break`); a running one is skipped this
   iteration, keeping its blocks (as vLLM skips a running request given 0 tokens).
9. A step that preempted and scheduled nothing (every running request preempted; by priority
   in 0.15.1, the first running request preempting itself) is empty in vLLM, and with nothing
   in flight the next step follows at once. A simulated iteration cannot be empty, so that
   next step is planned at once.
10. Pipeline parallelism (P > 1 stages): tokens count as computed when scheduled, and up to P
   iterations are in flight (the engine's batch queue; `sim.engine.pipeline`). A running
   request with nothing left to compute gets 0 tokens and is skipped (`schedule`: "No new
   tokens to schedule. This may happen when PP>1 and we have already scheduled all prompt
   tokens but they are not finished yet", `continue`), as `_chunk` gives 0 here; a step that
   schedules nothing while iterations are in flight just waits for them.

Release by release (`engine_version`; `ENGINE_VERSIONS` in `sim.schedulers.vllm_config`; the
golden schedules under `tests/golden/vllm-<version>/` check each against that release's own
scheduler code):
11. 0.33.0: `long_prefill_token_threshold` is not applied while one request at most is
   running or waiting (`schedule`, ~753-763: "When it is the only request there is nobody to
   starve"); 0.15.1 always applies it.
12. 0.33.0: `scheduler_reserve_full_isl` (default on): a waiting request is admitted only if
   blocks for all its known tokens beyond its prefix hit are free, not just its first chunk's
   (`KVCacheManager.allocate_slots(full_sequence_must_fit=...)`).
13. The null block: `BlockPool` takes one of `num_gpu_blocks` as a null block, never allocated;
   `kv_cache.num_blocks` is vLLM's `num_gpu_blocks`, one fewer usable (`num_null_blocks`).
14. Async scheduling (`async_scheduling`, both releases' default: `VllmConfig.__post_init__`
   resolves None to on with the uni or mp executor, off on a pipeline): the engine keeps two
   iterations in flight (`step_with_batch_queue`, `max_concurrent_batches` 2), scheduling the
   next as soon as one is sent; a request's token in flight is an output placeholder
   (`AsyncScheduler._update_after_schedule`), so its next decode is scheduled at once, except
   past its `max_tokens` ("Avoid scheduling an extra step"). A request arriving during
   iteration k first runs in k+2. `sim.engine.pipeline` runs it; `ReplicaState.start` counts.
15. The prefix cache works block by block, each release's free-queue order its own
   (`sim.core.block_cache`: 0.33.0 reuses uncached free blocks first, 0.15.1 in freeing order).
16. Async, a request preempted with a token in flight still gets it when its iteration ends
   (`update_from_output`: "still delivered on return"), and may finish from the queue.

17. The priority policy (`scheduling_policy: priority`, vLLM's `--scheduling-policy
   priority`): the queue is ordered by (priority, arrival, request id), a preempted request
   going back in that order (`sim.core.waiting`); the running pass's victim is the running
   request of the highest priority value, the latest arrival among those, wherever it runs
   (`max(self.running, key=...)`): its tokens already scheduled in this step go back to the
   budget. Admission never preempts (vLLM's waiting pass does not). Release by release: in
   0.33.0 a victim that was the request being scheduled lets the pass go on with the next
   one (`continue`); 0.15.1 ends the pass there, as FCFS does, and steps the pass's index
   back only for a victim already scheduled in this step (one ahead of the request but
   skipped, e.g. caught up on a pipeline, makes it skip the request after).

18. Speculative decoding (`speculative`, vLLM's `--speculative-config`; `sim.core.
   spec_commit` applies a step's outcome). After a step that samples, a request gets k drafts
   (`update_draft_token_ids`; 0.33.0 proposes none in a step where no scheduled request can
   use them, with a drafter that writes KV: `_drafts_unused`, `skip_drafts`). A running
   request then has 1 + k tokens to compute (`num_tokens_with_spec`), capped like a chunk
   (the threshold, the budget; 0.33.0's input budget less a draft model's one slot per
   request; `max_model_len - 1 - num_computed_tokens`); its drafts are spent once it is
   scheduled, however many fit. KV slots are allocated for the tokens scheduled plus the
   drafter's lookahead (k for EAGLE, MTP and draft models, 0 for n-gram; at admission 0.15.1
   allocates none, but to a request whose KV was loaded from the CPU tier:
   `effective_lookahead_tokens` is 0 only where nothing is computed). The step's accepted
   drafts and one sampled token join the output (`sim.core.spec_commit`); the rejected ones
   are computed again, and those past its output length are trimmed with their KV slots.
   Async scheduling (rule 14) counts a step's token and drafts as output placeholders, as if
   every draft were accepted, and takes the rejected ones back when the step ends. 0.33.0
   pads a decode admitted from the queue (a prefix hit leaving one token) to 1 + k tokens of
   drafts that cannot be accepted ("Pad new decode requests to uniform spec decoding size"),
   or admits nothing more if that does not fit (on a prefill instance too: `drop_padding`);
   0.15.1's EAGLE-family drafters drop the last block of a prefix hit (`use_eagle`). A
   request preempted loses its drafts. Synchronous 0.15.1 with a drafter that writes KV
   (EAGLE, draft models: a padded drafter batch) gives drafts to a prompt's unfinished chunk
   too (`update_draft_token_ids` has no prefill check): its last chunk then carries k drafts,
   which cannot be accepted (nothing was sampled to draft from).
19. A CPU tier for the KV cache (`replica.kv_offload`, vLLM's `--kv-offloading-size` with
   the native `OffloadingConnector`; its rules in `sim.core.offload`, its copies timed by
   `sim.engine.offload`). In the queue pass a request with nothing computed asks the tier
   after its GPU prefix hit; with a hit it gets blocks for both, is given no tokens and waits
   in the queue, skipped in its place (`WAITING_FOR_REMOTE_KVS`), until the copy is reported
   done; the pass that reaches it then takes the loaded tokens as computed and admits it as
   usual. At the end of each plan the full blocks its requests complete are stored
   (`build_connector_meta`); a finished request that stored keeps its blocks until its
   copies are done (`request_finished` delays the free). 0.33.0's connector
   (`sim.core.offload_jobs`, timed by `sim.engine.offload_jobs`) stores prompt blocks only,
   job by job, each loadable once its job is reported done; loading requests wait in a queue
   of their own, passed first (`kv_holding_waiting`), and a load is admitted only beside
   what every request still prefilling needs for its whole prompt; finished requests free
   their blocks at once, a pending store that reads one handed out again being flushed
   before the step; with async scheduling, once the last step that scheduled them is
   processed (`defer_block_free`), and the running pass stops rather than preempt a request
   whose blocks would come back only then; its holding queue is by priority under that
   policy; with drafts, a load keeps room for a step with drafts beside every prefill's;
   with an EAGLE-family drafter, a hit from the GPU (0.33.0 keeps its older block hashes
   beside a KV connector) or from the tier gives up its last block; a one-token prompt
   whose whole block was loaded is asked again, as a new request (blocks of one token).

Not modelled: speculative decoding on a pipeline, multi-module MTP's prefill lookahead,
0.33.0's EAGLE lookahead block hashes (a hit is taken whole), encoder inputs, KV connectors
other than the CPU tier, structured output, LoRA limits, Mamba or deterministic-caching
chunk alignment,
the running pass's max_model_len cap without speculative decoding (a request it would cut is
rejected on arrival; with drafts it is applied, rule 18), 0.33.0's skip of
a waiting request whose stale output is still in flight (it drains before the next plan in
every golden workload), a watermark, prefill throttling (off by default).
"""

from __future__ import annotations

from sim.core.kv_cache import KVCacheManager, cdiv
from sim.core.offload_jobs import JobOffloadState
from sim.core.plan import Plan
from sim.core.request import Request, Status
from sim.core.state import ReplicaState
from sim.schedulers.admission import admit_waiting
from sim.schedulers.base import (
    SCHEDULERS,
    Scheduler,
    any_in_flight,
    lowest_priority,
    preempt,
)
from sim.schedulers.vllm_config import (  # noqa: F401  (also imported from here)
    DEFAULT_ENGINE_VERSION,
    ENGINE_VERSIONS,
    EngineRules,
    VllmV1Config,
    unchunked_reason,
)
from sim.schedulers.vllm_spec import SpecRules


@SCHEDULERS.register("vllm_v1")
class VllmV1(Scheduler):
    """vLLM v1's policy (rules in the module docstring): running requests catch up first, in
    running order, preempting the newest when KV runs out; then the queue is admitted FCFS with
    what is left of the budget, prompts cut into chunks when chunking is on."""

    Config = VllmV1Config
    config: VllmV1Config
    num_null_blocks = 1  # rule 13: `BlockPool` takes block 0 as its null block
    delivers_stale_tokens = True  # rule 16: `update_from_output`, "still delivered on return"
    # Disaggregated: the proxy's prefill request (`max_tokens=1`) answers nobody; the decode
    # side loads the prompt's KV, computes its last token again and samples the first
    # (`_update_waiting_for_remote_kv`: "a full prompt hit re-computes that token").
    prefill_first_token = "dropped"

    def __init__(self, config: VllmV1Config, *, max_model_len: int | None = None) -> None:
        super().__init__(config, max_model_len=max_model_len)
        self._threshold = config.long_prefill_token_threshold  # this step's (rule 11)
        self.prefix_cache_eviction = config.rules.free_order  # rule 15
        self._spec = SpecRules.of(config)  # rule 18, speculative decoding
        self._draft_slots = self._spec.draft_slots if self._spec else 0
        self._drafts_needed = True  # this step's (rule 18)
        self._prefill_scheduled = False
        if self._spec is not None:
            self.allows_stretches = False  # (decode stretches assume one token a step)

    def num_batches_in_flight(self, pipeline_size: int) -> int:
        # Rule 14: `VllmConfig.max_concurrent_batches`: 2 with async scheduling on one stage,
        # else one per pipeline stage (V1 model runner).
        if self.config.async_scheduling:
            return max(2, pipeline_size)
        return pipeline_size

    @property
    def kv_cached_when_freed(self) -> bool:
        """Whether a request's computed blocks are cached by the time it frees them (rule 18:
        not with speculative decoding in 0.15.1)."""
        return self._spec is None or self._spec.caches_on_update

    @property
    def output_placeholders(self) -> bool:
        return bool(self.config.async_scheduling)

    @property
    def by_priority(self) -> bool:
        return self.config.scheduling_policy == "priority"  # rule 17

    def capacity_reason(self, kv: KVCacheManager, num_kv_tokens: int) -> str | None:
        # (0.33.0 with a draft model: a request's draft slot comes out of the step's budget.)
        reason = unchunked_reason(self.config.enable_chunked_prefill,
                                  self.config.max_num_batched_tokens, num_kv_tokens,
                                  self._draft_slots)
        if self._spec is not None:  # rule 18: drafts and lookahead past its last token
            num_kv_tokens += self._spec.capacity_margin
            if self.max_model_len is not None:
                num_kv_tokens = min(num_kv_tokens, self.max_model_len)
        return super().capacity_reason(kv, num_kv_tokens) or reason

    @property
    def max_num_scheduled_tokens(self) -> int | None:
        return self.config.max_num_batched_tokens

    def decide(self, state: ReplicaState, now_s: float) -> Plan:
        plan = self._step(state)
        # Rule 9: a step that preempted and scheduled nothing (everyone preempted; or, by
        # priority in 0.15.1, the first running request preempted itself and ended the pass)
        # is empty in vLLM; with nothing in flight the next step follows at once: planned
        # here, its preemptions after those (with iterations in flight, vLLM waits for the
        # oldest first, and so does the engine here). Each such step preempts one more.
        preempted = plan.preempted_ids
        # (With a CPU tier the empty step launches on its own: its launch waits for the
        # preempted requests' stores and polls, and the engine plans again after: rule 19.)
        while not plan and preempted and not any_in_flight(state) and state.offload is None:
            earlier = plan.preempted_ids
            plan = self._step(state)
            preempted = list(plan.preempted_ids)
            plan.preempted_ids[:0] = earlier
        # Else only requests in flight on a pipeline may be left running, with nothing to do.
        assert (plan or not (plan.preempted_ids and state.running) or any_in_flight(state)
                or state.offload is not None)
        return plan

    def _step(self, state: ReplicaState) -> Plan:
        cfg = self.config
        self._threshold = cfg.long_prefill_token_threshold
        if (cfg.rules.threshold_spares_lone_request
                and len(state.running) + len(state.waiting) <= 1):
            self._threshold = 0  # rule 11: nobody to starve
        plan = Plan()
        spec = self._spec
        self._drafts_needed = spec is None or not spec.can_skip_drafts
        self._prefill_scheduled = False
        budget = self._schedule_running(state, plan, self.config.max_num_batched_tokens)
        num_running = len(plan.num_scheduled_tokens)
        if not plan.preempted_ids:
            self._schedule_waiting(state, plan, budget)
        if state.offload is not None:  # rule 19
            state.offload.build(state, plan, num_running)
        if spec is not None:
            # Drafts after this step (`num_spec_tokens_to_schedule`): k, or the dynamic
            # schedule's for its number of requests; the next step's placeholders when
            # scheduling ahead, whether or not the drafter runs.
            drafts = spec.num_speculative_tokens
            if spec.drafts_by_batch_size is not None and plan.num_scheduled_tokens:
                drafts = spec.drafts_by_batch_size[len(plan.num_scheduled_tokens)]
            plan.num_spec_placeholders = drafts
            if self._drafts_needed:
                plan.num_drafts_proposed = drafts
                plan.drafter_runs = True
                if spec.drafts_after_chunk:
                    plan.num_drafts_after_chunk = plan.num_drafts_proposed
        return plan

    def _decode_tokens(self, req: Request, budget: int, num_scheduled: int) -> int:
        """Rule 18: a running request's tokens with its drafts (`num_tokens_with_spec`),
        capped as vLLM caps them; `num_scheduled` requests are in the plan so far."""
        num_tokens = req.num_uncomputed_tokens + req.num_draft_tokens
        if 0 < self._threshold < num_tokens:
            num_tokens = self._threshold
        num_tokens = min(num_tokens, budget - self._draft_slots * (num_scheduled + 1))
        if self.max_model_len is not None:
            num_tokens = min(num_tokens, self.max_model_len - 1 - req.num_computed_tokens)
        return num_tokens

    def _lookahead(self, req: Request, num_computed: int, num_tokens: int) -> int:
        """KV slots past `num_tokens` after `num_computed` the drafter writes (rule 18),
        within the context window (`allocate_slots`)."""
        ahead = self._spec.num_lookahead if self._spec else 0
        if self.max_model_len is not None:
            ahead = min(ahead, max(0, self.max_model_len - num_computed - num_tokens))
        return ahead

    def _note_drafts(self, req: Request, num_computed: int, num_tokens: int) -> None:
        """0.33.0's `_drafts_unused`, or'ed over the step: whether the drafts proposed after
        it may be used by `req`, scheduled for `num_tokens` after `num_computed`."""
        if self._drafts_needed:
            return
        if num_computed + num_tokens < req.num_tokens:
            return  # a prompt's chunk that does not finish it
        # Output sure to come: sampled, one from this step, one from a step in flight.
        num_sure = req.num_output_tokens - req.num_placeholders + 1 + (req.num_placeholders > 0)
        self._drafts_needed = num_sure < req.num_target_output_tokens

    def _chunk(self, num_uncomputed: int, budget: int) -> int:
        """Tokens a request with `num_uncomputed` tokens to catch up gets now (0: none)."""
        cfg = self.config
        num_tokens = num_uncomputed
        if 0 < self._threshold < num_tokens:
            num_tokens = self._threshold
        num_tokens = min(num_tokens, budget)
        minimum = cfg.min_chunk_tokens
        if minimum is not None and num_tokens < min(minimum, num_uncomputed):
            return 0  # rule 8: too small a chunk that does not finish
        return num_tokens

    def _schedule_running(self, state: ReplicaState, plan: Plan, budget: int) -> int:
        """Rules 2-4 (17 by priority); returns the budget left."""
        kv, scheduled = state.kv, plan.num_scheduled_tokens
        block_size = kv.block_size
        by_priority = self.by_priority
        goes_on = self.config.rules.priority_pass_goes_on
        # Told apart as in `schedule_decodes`: the requests with prompt tokens left, by
        # identity with the next of `prefilling()`; the others decode (or, pipelined, wait
        # for a token in flight). FCFS preemptions take the newest, past `index`, or stop the
        # loop; by priority a victim may be anywhere (rule 17).
        ahead = iter(state.prefilling())
        following = next(ahead, None)
        pipelined = state.pipelined
        spec = self._spec is not None
        index = 0
        is_prefill = False
        running = state.running  # (edited in place by preemptions, never replaced)
        # (0.33.0's CPU tier with steps in flight frees a request's blocks once they end)
        deferred_frees = state.offload if isinstance(state.offload, JobOffloadState) \
            and state.offload.defers_frees else None
        while index < len(running) and budget > 0:
            req = running[index]
            index += 1
            if spec:
                if budget <= self._draft_slots * (len(scheduled) + 1):
                    break  # 0.33.0's input budget is spent (`input_budget <= draft_slots`)
                if (req.num_placeholders and req.num_computed_tokens + 2 - req.num_placeholders
                        >= req.num_prompt_tokens + req.num_target_output_tokens):
                    continue  # async: its step in flight reaches its last token (rule 14)
                num_tokens = self._decode_tokens(req, budget, len(scheduled))
                if num_tokens <= 0:
                    continue  # nothing to compute until its step in flight ends
                is_prefill = req is following
                if is_prefill:
                    following = next(ahead, None)
            elif req is following:
                following = next(ahead, None)
                num_tokens = self._chunk(req.num_uncomputed_tokens, budget)
                if not num_tokens:
                    continue
            elif pipelined and (req.num_computed_tokens  # (`is_caught_up`, written out)
                                == req.num_prompt_tokens + req.num_output_tokens):
                continue
            else:
                # A decode gets its one token whatever the rules on chunks, and needs a block
                # only when its computed tokens fill the blocks it holds: elsewhere allocating
                # changes nothing.
                if req.num_computed_tokens % block_size:
                    scheduled[req.request_id] = 1
                    budget -= 1
                    continue
                num_tokens = 1
            num_ahead = self._lookahead(req, req.num_computed_tokens, num_tokens)
            while not kv.try_allocate(req, num_tokens + num_ahead,
                                      num_lookahead_tokens=num_ahead):
                if not by_priority:
                    victim = state.running[-1]
                    if deferred_frees and not deferred_frees.frees_now(victim):
                        return budget  # rule 19: its blocks would come back too late
                    budget += preempt(state, victim, plan.preempted_ids, scheduled)
                    if victim is req:
                        return budget
                    continue
                victim = lowest_priority(state)
                if deferred_frees and not deferred_frees.frees_now(victim):
                    return budget  # rule 19: its blocks would come back too late
                if goes_on:
                    back = state.running.index(victim) < index  # (`req` is at index - 1)
                else:
                    back = victim.request_id in scheduled
                index -= back
                budget += preempt(state, victim, plan.preempted_ids, scheduled)
                while following is not None and following.status is not Status.RUNNING:
                    following = next(ahead, None)  # preempted before its turn came
                if victim is req:
                    if not goes_on:
                        return budget
                    break
            else:
                scheduled[req.request_id] = num_tokens
                budget -= num_tokens
                if spec:
                    self._prefill_scheduled |= is_prefill
                    self._note_drafts(req, req.num_computed_tokens, num_tokens)
                    req.num_draft_tokens = 0  # spent, however many were scheduled
        return budget

    def _schedule_waiting(self, state: ReplicaState, plan: Plan, budget: int) -> None:
        """Rules 5-8: admit the head of the queue while it fits."""
        cfg = self.config
        if not state.waiting:
            return
        num_partial, num_long = self._num_partial(state, plan)

        spec = self._spec
        padded: list[Request] = []
        admitted = len(plan.num_scheduled_tokens)  # by the running pass

        def chunk(req: Request, num_new: int, budget: int | None) -> int:
            nonlocal num_partial, num_long
            assert budget is not None
            if spec is not None:
                # Rule 18: 0.33.0's input budget (a draft model's slot per request) and its
                # padding of a decode admitted from the queue.
                budget -= self._draft_slots * (len(plan.num_scheduled_tokens) + 1)
                if budget <= 0:
                    return 0
                if (num_new == 1 and spec.pads_decodes and not self._prefill_scheduled
                        and (admitted or req.num_uncomputed_tokens > num_new
                             or req.num_computed_tokens)
                        and (self.max_model_len is None
                             or req.num_tokens + spec.num_speculative_tokens + 1
                             <= self.max_model_len)):
                    num_new = 1 + spec.num_speculative_tokens
                    if num_new > budget:
                        return 0  # "Prefer to not schedule than schedule un-padded"
                    padded.append(req)
            if not cfg.enable_chunked_prefill and num_new > budget:
                return 0  # the prompt waits whole
            num_tokens = self._chunk(num_new, budget)
            is_partial = 0 < num_tokens < num_new
            is_long = 0 < self._threshold < num_new
            if is_partial and not self._may_add_partial(num_partial, num_long, is_long):
                return 0
            num_partial += is_partial
            num_long += is_partial and is_long
            return num_tokens

        def lookahead(req: Request, num_cached: int, num_tokens: int) -> int:
            if not admission_lookahead and not req.num_computed_tokens:
                return 0  # (0.15.1: only for one whose KV was loaded, from the CPU tier)
            return self._lookahead(req, req.num_computed_tokens + num_cached, num_tokens)

        def rest_of_prompt(req: Request, num_cached: int, num_tokens: int) -> int:
            """Rule 12: blocks for every known token beyond the chunk (and its lookahead)
            must be free too."""
            after = req.num_computed_tokens + num_cached + num_tokens
            if admission_lookahead:
                after += lookahead(req, num_cached, num_tokens)
            return max(0, cdiv(req.num_tokens, block_size) - cdiv(after, block_size))

        block_size = state.kv.block_size
        admission_lookahead = spec.admission_lookahead if spec else 0
        admit_waiting(state, plan, budget, cfg.max_num_seqs, cfg.decode_reserve_tokens, chunk,
                      rest_of_prompt if cfg.scheduler_reserve_full_isl else None,
                      lookahead if spec and spec.num_lookahead else None,
                      spec.hit_blocks_dropped if spec else 0)
        if spec is not None:
            requests, scheduled = state.requests, plan.num_scheduled_tokens
            for request_id in list(scheduled)[admitted:]:
                req = requests[request_id]
                self._note_drafts(req, req.num_computed_tokens, scheduled[request_id])
            for req in padded:
                if plan.num_scheduled_tokens.get(req.request_id, 0) > 1:
                    req.spec_padded = True

    def _num_partial(self, state: ReplicaState, plan: Plan) -> tuple[int, int]:
        """Running requests part-way through their prefill after this plan, and the long ones
        among them (rule 7; counted only when a limit is set)."""
        cfg = self.config
        if cfg.max_num_partial_prefills is None and cfg.max_long_partial_prefills is None:
            return 0, 0
        threshold = self._threshold
        num_partial = num_long = 0
        for req in state.prefilling():  # (a decode has no prompt tokens to leave over)
            left = req.num_uncomputed_tokens - plan.num_scheduled_tokens.get(req.request_id, 0)
            if left > 0:
                num_partial += 1
                num_long += 0 < threshold < req.num_uncomputed_tokens
        return num_partial, num_long

    def _may_add_partial(self, num_partial: int, num_long: int, is_long: bool) -> bool:
        cfg = self.config
        if cfg.max_num_partial_prefills is not None and num_partial >= cfg.max_num_partial_prefills:
            return False
        limit = cfg.max_long_partial_prefills
        return not (is_long and limit is not None and num_long >= limit)
