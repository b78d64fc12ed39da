"""SGLang's scheduler (and Mini-SGLang's, its teaching copy): prefill batches of at most
`chunked_prefill_size` new tokens run before decode batches; a prompt that does not fit is chunked
and finished first; a request is admitted only if its prompt and its whole output fit in KV.

Sources: SGLang `python/sglang/srt/managers/scheduler.py` (`get_next_batch_to_run`,
`_get_new_batch_prefill_raw`, `update_running_batch`) and `schedule_policy.py` (`PrefillAdder`:
`add_chunked_req`, `add_one_req`, `rem_total_tokens`, `new_token_ratio`); Mini-SGLang
`python/minisgl/scheduler/{scheduler,prefill,decode,config}.py` (`PrefillAdder`,
`PrefillManager`, `DecodeManager.inflight_tokens`, `max_extend_tokens`); background document 001
(Mini-SGLang's chunked-prefill page).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import cast

from sim.core.kv_cache import KVCacheManager
from sim.core.plan import Plan
from sim.core.request import Request, Status
from sim.core.state import ReplicaState
from sim.core.waiting import EntryOrderWaiting
from sim.schedulers.admission import admit_waiting
from sim.schedulers.base import (
    SCHEDULERS,
    Scheduler,
    any_in_flight,
    preempt_newest,
    schedule_decodes,
)
from sim.schedulers.sglang_admission import (
    CLIP_MAX_NEW_TOKENS,
    PrefillAdder,
    left_running,
    output_ids_len,
)
from sim.schedulers.sglang_config import SGLangConfig
from sim.schedulers.sglang_spec import SGLangSpecRules, decode_batch, schedule_spec_decodes

# `schedule_policy.py`: how often, and how many of, the waiting requests' prefixes are refreshed.
WAITING_PREFIX_REFRESH_INTERVAL = 32
WAITING_QUEUE_PREFIX_MATCH_MAX = 128

# `NewTokenRatioTracker.from_config` (`managers/scheduler_components/new_token_ratio_tracker.py`)
# with `environ.py`'s defaults (SGLANG_INIT_NEW_TOKEN_RATIO 0.7, SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
# 0.14, SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS 600) and `--schedule-conservativeness` 1.0, computed
# as SGLang computes them.


def new_token_ratios(conservativeness: float) -> tuple[float, float, float]:
    """`new_token_ratio`'s start, floor and decay per step for `--schedule-conservativeness`."""
    init = min(0.7 * conservativeness, 1.0)
    floor = min(init * 0.14, 1.0)
    return init, floor, (init - floor) / 600


NEW_TOKEN_RATIO_INIT, NEW_TOKEN_RATIO_MIN, NEW_TOKEN_RATIO_DECAY = new_token_ratios(1.0)


@SCHEDULERS.register("sglang")
class SGLang(Scheduler):
    """SGLang's rules, each with where it comes from:

    1. Prefill before decode, in separate iterations. If a prefill batch can be formed, it runs;
       otherwise every running decode gets one token (`get_next_batch_to_run`: "Run prefill
       first if possible", else `update_running_batch`; Mini-SGLang `_schedule_next_batch`:
       prefill manager `or` decode manager). Decodes wait while prefills run (doc 001).
    2. Budget: a prefill batch computes at most `chunked_prefill_size` new tokens
       (`PrefillAdder.rem_chunk_tokens`; Mini-SGLang `token_budget` = `max_extend_tokens`).
    3. Chunking: the request that does not fit what is left of the budget takes the rest of it
       and becomes *the* chunked request; it samples only after its last chunk (doc 001,
       `ChunkedReq`; SGLang `add_one_req` sets `new_chunked_req`). At most one is in progress.
       A request computed again after a retraction or preemption extends its prompt and
       outputs so: a last chunk of one token is still its extend, in a prefill batch, where
       it samples (`add_chunked_req`), not a decode (`_prefilling`).
    4. The chunked request continues first, ahead of the waiting queue, in the very next
       iteration: `_get_new_batch_prefill_raw` skips its early exits while `self.chunked_req`
       is set and calls `add_chunked_req` before the waiting queue, so the next batch is a
       prefill again and running decodes wait through every chunk of a long prompt (doc 001's
       40,000-token document: five prefill iterations, then decodes). Its chunk is what is
       left of the KV budget, or a whole chunk if nothing is (`available_chunk_tokens`).
    5. Admission, first come first served (SGLang's default `schedule_policy` fcfs), stopping at
       the first request refused: SGLang's `PrefillAdder` for requests of known output length
       (`ignore_eos`; without it, rule 14), every rule in `sim.schedulers.sglang_admission`
       (budget remainders, the in-order check without a radix cache, the strict check with
       one, the full-batch latch). An integer `decode_reserve_tokens` replaces it by
       Mini-SGLang's rule capped: extend plus that many output tokens beside as many for every
       running request.
    6. Prefix cache: a waiting request's cached prefix (`match_prefix`, 0 without caching)
       is reused, and only the rest is chunked and computed. The radix cache is SGLang's
       (`sim.core.radix_cache`): every request the pass tries is matched (a use), every 32nd pass
       refreshes the queue's first 128 prefixes, a prompt is inserted when its prefill ends
       (`iteration_ended`) and a chunk at the next pass (`stash_chunked_request`), a batch
       evicts once, after matching.
    7. `max_running_requests` (= `max_num_seqs`) caps running requests, the chunked one
       included (`get_num_allocatable_reqs`); unset, derived from the KV pool
       (`SGLangConfig.for_kv`).
    8. `mixed_chunk`: running decodes join a prefill batch (`mix_with_running`) and the budget
       shrinks by their number (`PrefillAdder(num_mixed_decode_tokens=running_bs)`); with no
       prefill to run the iteration is decodes only, as without it.
    9. KV shortfall at a decode step (`update_running_batch`): `check_decode_mem` asks a page
       (a block here) for every decoding request whose KV fills its last, after evicting that
       much from the radix cache; short, `retract_decode` retracts requests, the fewest
       outputs first (the longest prompt among equals, the later in the batch among those),
       each evicting room for 20 tokens per request kept, until the rest fit, keeping one
       (aborted if even it does not fit); they go to the back of the queue and are computed
       again, and the batch runs on in the order kept. In the overlap loop, if a request whose
       last token is in flight will free its KV at the step's end, nobody decodes this step
       instead. (With `ignore_eos` and outputs below 4096 tokens the admission rules never let
       it come to this.) With `decode_reserve_tokens` set, a decode without a block preempts
       the newest running request by recompute (base `schedule_decodes`), and if nothing at
       all can run while requests hold KV, the newest running request is preempted.

    10. The overlap event loop (`event_loop_overlap`, SGLang's default; `overlap_schedule`):
       batch k is decided right after k-1 is launched and runs after it (two in flight,
       `sim.engine.pipeline`); a decode follows its prefill at once with a future token (an output
       placeholder here); a request whose last token is in flight is left out of the next
       decode batch (`_reqs_finishing_inflight`) but still counts in admission; admission
       reads outputs one token behind for requests in flight (`sglang_admission.output_ids_len`);
       a retracted request's token in flight is dropped.

    11. Priorities (`enable_priority_scheduling`, SGLang's `--enable-priority-scheduling` with
       its fcfs policy; `sim.schedulers.sglang_admission`): the queue by priority, higher
       values first (lower with `schedule_low_priority_values_first`), then by when each
       request entered it (a preempted or retracted one re-enters at the end of its level:
       `EntryOrderWaiting`). With preemption (on unless `disable_priority_preemption`) the
       full-batch latch is cleared before every pass and, where the batch is full by count,
       the request at the head preempts running ones (`PrefillAdder.preempt_to_schedule`).
       Disaggregated (`disaggregation/prefill.py`, `decode.py`): a prefill server's waiting
       queue is ordered so too, each request entering it when its bootstrap ends
       (`pop_bootstrapped`), but it never preempts: its running batch stays empty (its
       batches go to the inflight queue), so `preempt_to_schedule` finds no victim. A decode
       server's preallocation queue is sorted by priority alone, stably, at every pass, and
       stops at the first request that does not fit (`pop_preallocated`, `transfer_order`);
       it runs no `PrefillAdder`, so nothing is preempted there either: the requests it
       retracts (speculative decoding) wait first come first served (`retracted_queue`).

    12. Speculative decoding (`speculative`, SGLang's `--speculative-algorithm`;
       `sim.schedulers.sglang_spec`): every decode verifies `num_draft_tokens` (D) tokens and
       keeps the drafts accepted in a row plus one; at each decode step a request is topped
       up to its committed KV plus 2L slots (L = max(num_steps x eagle_topk, D)), all or none
       (`check_decode_mem`), else `retract_decode` retracts the requests with the fewest
       outputs (the longest prompt among equals) to the back of the queue, keeping one
       (aborted if even it does not fit); in the overlap loop a request whose queued result
       finishes it sits the step out, and one whose result may (more than one token left)
       is verified once more, its result dropped. `max_running_requests` defaults to 48.
       With the radix cache, EAGLE's tree is keyed by token pairs (one token less per hit),
       and the memory check and each retraction evict at once (`sim.core.radix_cache`).

    13. Pages (`--page-size`: the KV block, `kv_cache.block_size`): a request holds whole pages
       (`allocator/paged.py`: an extend takes the pages its tokens reach, a decode a page only
       when its tokens fill the ones it holds); admission rounds each extend up to pages in
       its budgets and keeps a page spare a request (`_update_prefill_budget`,
       `schedule_policy.py` 895-944; `PrefillBudget.reserve`, `prefill_budget.py` 156-169),
       counts the extend unrounded in the radix cache's total (`add_one_req` 1407-1412) and,
       with the radix cache, ends a new request's chunk on a page (1665-1671); the radix
       cache matches and caches whole pages only (`RadixKey.page_aligned`,
       `mem_cache/radix_cache.py` 147-151, 406, 438); and with it each paged allocation
       first evicts until the batch's tokens and a page a request are free
       (`alloc_paged_token_slots_extend`, `_decode`, `mem_cache/allocation.py` 190-202,
       584-585). Chunk sizes must be whole pages.

    14. Requests without `ignore_eos` (`Request.ignore_eos`, the workload's client: `vllm bench
       serve`'s and `sglang.bench_serving`'s default): their output length is unknown to
       SGLang (`max_new_tokens` is the trace's output, where they stop here). Admission
       reserves a running one's outputs left (clipped at 4096) times `new_token_ratio`, a float
       (`PrefillAdder._get_running_request_total_token_offset`), and takes a waiting one by the
       general `add_one_req` path (prompt + output + page strictly below the remainder) even
       without a radix cache; the in-order check of an `ignore_eos` request counts one as
       `max_new_tokens * ratio - outputs` left. The ratio (`NewTokenRatioTracker`) starts at
       0.7, decays by (0.7 - 0.098) / 600 at each decode step that retracts nobody, down to
       0.098; a retraction sets it to min(1, (outputs kept + 20 x requests kept) / (their
       max_new_tokens + 1)); the scheduler idling (`on_idle` when `is_fully_idle`) resets it
       to 0.7: here, when a pass finds that everything the last pass left running has left,
       and every request now came after the last of them left. It over-admits: rule 9
       retracts. (The fast path's decode stretches decay it as stepping would, a step at a
       time: `decodes_repeated`.)

    Not modelled: `--prefill-decode-interval` (default 0), requests stopping on EOS before
    their trace's output length; with speculative decoding, mixed chunks (refused) and the
    overshoot verifications' rows in the acceptance counts (SGLang's global ones count them);
    with mixed chunks, the decode step's retraction (a decode without a block preempts the
    newest, base `schedule_decodes`); pages of more than 1 token with speculative decoding,
    the hierarchical cache or mixed chunks (refused where a block size is given and SGLang's
    own admission runs), and on a disaggregated decode pool (its preallocation, read for
    pages of 1 token).
    """

    Config = SGLangConfig
    config: SGLangConfig
    prefix_cache_eviction = "lru_leaf"  # SGLang's RadixCache evicts least recently used leaves
    # Disaggregated: the prefill server sends its first token with the KV; the decode server
    # streams it when it takes the request in (`process_batch_result_prebuilt`), and finishes
    # there a request that asked for one token.
    prefill_first_token = "held"

    def __init__(self, config: SGLangConfig, *, max_model_len: int | None = None) -> None:
        super().__init__(config, max_model_len=max_model_len)
        # `running_batch.batch_is_full`: the ids running when a pass found no room (or the
        # request cap), and those joining since; None while not latched.
        self._full: set[int] | None = None
        # The radix cache's insertions (`sim.core.radix_cache`): plans whose batch ends a prompt,
        # with those requests and their preemption counts (checkpointed when it ends), and
        # the chunked request's tokens cached so far (stashed at the next pass).
        self._prompts_ending: deque[tuple[Plan, list[tuple[Request, int, int]]]] = deque()
        self._stashed: dict[int, tuple[int, int]] = {}
        self._state: ReplicaState | None = None
        self._num_prefill_passes = 0  # passes with a queue: SGLang refreshes every 32nd
        self._last_extend: list[Request] = []  # the requests of the last batch, a prefill
        # SGLang's chunked request (`self.chunked_req`), its preemptions and outputs when it was
        # chunked: its extend goes on in prefill batches until it samples (`_prefilling`).
        self._chunked: tuple[Request, int, int] | None = None
        # Priority preemption: each request's fill ids and prefix when last tried in a pass
        # (`full_untruncated_fill_ids`, `prefix_len`), and its preemptions then.
        self.last_tried: dict[int, tuple[int, int, int]] = {}
        self._spec = SGLangSpecRules.of(config.speculative)  # rule 12
        if self._spec is not None:
            self.allows_stretches = False  # (decode stretches assume one token a step)
        # A data-parallel rank with speculative decoding (`sim.engine.data_parallel`) first
        # tries a prefill only (`defer_decodes`): SGLang syncs the ranks on it before any
        # decodes, and runs none while one prefills. `decode_deferred`: the pass found no
        # prefill and would decode.
        self.defer_decodes = False
        self.decode_deferred = False
        # Then, where no rank prefills, the decode alone (`decode_pass`: no second admission,
        # as SGLang's `update_running_batch` follows its one `get_new_batch_prefill`).
        self.decode_pass = False
        # On data-parallel ranks: whether the ranks all passed idle at or after a time (the
        # group's), for `on_idle`, which SGLang reaches only when no rank has tokens (else an
        # empty rank runs an idle batch); None: one replica, its own passes say.
        self.group_idle_since: Callable[[float], bool] | None = None
        self._now_s = 0.0
        self._aborted = False  # the last decode pass aborted a request (rule 12)
        # Rule 14: `new_token_ratio`, and what the last pass left running (to tell an idle
        # pass between two passes here).
        self.ratio_init, self.ratio_min, self.ratio_decay = new_token_ratios(
            config.schedule_conservativeness)
        self.new_token_ratio = self.ratio_init
        self._last_running: list[Request] = []

    @property
    def by_priority(self) -> bool:
        return self.config.enable_priority_scheduling

    def waiting_queue(self, pool: str = "colocated") -> EntryOrderWaiting | None:
        cfg = self.config
        if not cfg.enable_priority_scheduling or pool == "decode":
            # (A decode server's queue here holds only the requests it retracted, which
            # SGLang resumes first come first served: `retracted_queue`, rule 11.)
            return None
        return EntryOrderWaiting(low_first=cfg.schedule_low_priority_values_first)

    def transfer_order(self, req: Request) -> tuple[float, ...] | None:
        """`DecodePreallocQueue.pop_preallocated` sorts its queue by priority alone at every
        pass, stably (`disaggregation/decode.py`, "Sort by priority before any index-based
        bookkeeping"): a level's requests keep the order they came in."""
        cfg = self.config
        if not cfg.enable_priority_scheduling:
            return None
        return (req.priority * (1 if cfg.schedule_low_priority_values_first else -1),)

    def num_batches_in_flight(self, pipeline_size: int) -> int:
        # The overlap loop (`event_loop_overlap`): batch k is decided when k-1 is launched and
        # runs after it; a pipeline keeps SGLang's stages in flight instead.
        if self.config.overlap_schedule and pipeline_size == 1:
            return 2
        return pipeline_size

    @property
    def output_placeholders(self) -> bool:
        # The next decode is scheduled with a future token (`FutureMap`) while one runs.
        return self.config.overlap_schedule

    def reject_reason(self, req: Request, kv: KVCacheManager, num_kv_tokens: int) -> str | None:
        return self.context_reason(req) or self._capacity_reason(kv, num_kv_tokens,
                                                                 req.num_prompt_tokens)

    def capacity_reason(self, kv: KVCacheManager, num_kv_tokens: int) -> str | None:
        return self._capacity_reason(kv, num_kv_tokens, None)

    def _capacity_reason(self, kv: KVCacheManager, num_kv_tokens: int,
                         num_prompt_tokens: int | None) -> str | None:
        reason = super().capacity_reason(kv, num_kv_tokens)
        if reason is not None or self.config.decode_reserve_tokens is not None:
            return reason
        # Admission needs, on an empty replica, the prompt, every output token and spare
        # tokens: a page and, without a radix cache, the prompt rounded up to pages and 1
        # more for the in-order check, plus 1 (`sim.schedulers.sglang_admission`); a request
        # that never fits would wait for ever.
        page = kv.block_size
        spare = page + 1
        if not kv.caches_prefixes:
            spare += 1 + (-(num_prompt_tokens or 0)) % page
        if num_kv_tokens + 1 + spare > kv.capacity_tokens:
            return (f"kv_capacity: SGLang admits a request with room for its prompt, its "
                    f"output and {spare} spare tokens: needs {num_kv_tokens + 1 + spare} KV "
                    f"slots, a replica holds {kv.capacity_tokens}")
        # (With speculative decoding a decode step holds 2L slots past a request's KV, which
        # admission does not count: SGLang admits a request those do not fit beside, and
        # aborts it at the decode step they do not fit, rule 12.)
        return None

    def admit_transfer(self, state: ReplicaState, req: Request) -> bool | None:
        """SGLang's decode server preallocating `req`'s KV (`DecodePreallocQueue.
        pop_preallocated`, no radix cache on the decode side, its default; page 1): a request
        slot, and room for its prompt once the free KV has kept R tokens (R =
        `num_reserved_decode_tokens`) for every request running or on its way, or, if more,
        what the longest-promised running request could still need beyond what all running
        hold (`_need_space_for_single_req`); its own need is its prompt plus R, or plus its
        clipped output less what all running hold, the larger. (Its integer
        `decode_reserve_tokens` keeps Mini-SGLang's rule.)"""
        cfg = self.config
        if cfg.decode_reserve_tokens is not None:
            return super().admit_transfer(state, req)
        running = state.running
        num_active = len(running) + len(state.incoming)
        if num_active >= cfg.max_num_seqs:
            return False
        clip = CLIP_MAX_NEW_TOKENS
        retractable = sum(r.num_prompt_tokens + output_ids_len(r) for r in running)
        single = max((min(r.num_target_output_tokens, clip) + r.num_prompt_tokens
                      for r in running), default=retractable) - retractable
        kv = state.kv
        reserved = cfg.num_reserved_decode_tokens
        allocatable = kv.num_free_blocks * kv.block_size - max(reserved * num_active, single)
        fill = req.num_prompt_tokens  # (preallocated before its prefill: none computed yet)
        required = max(fill + reserved,
                       fill + min(req.num_target_output_tokens, clip) - retractable)
        return required <= allocatable and kv.try_allocate(req, fill - req.num_computed_tokens)

    @property
    def decode_reserves_first(self) -> bool:
        # Disaggregated: the router pairs a prefill and a decode server at arrival; the decode
        # one preallocates the KV (`pop_preallocated`) before the prefill one may start it
        # (bootstrap). (Not with Mini-SGLang's rule: reserving after the prefill.)
        return self.config.decode_reserve_tokens is None

    @property
    def admits_transfers_between_finishes(self) -> bool:
        # (Each decoded token adds to what running requests hold: the rule may pass.)
        return self.config.decode_reserve_tokens is None

    def transfer_reason(self, kv: KVCacheManager, req: Request) -> str | None:
        cfg = self.config
        if cfg.decode_reserve_tokens is not None:
            return None
        need = req.num_prompt_tokens + max(cfg.num_reserved_decode_tokens,
                                           min(req.num_target_output_tokens,
                                               CLIP_MAX_NEW_TOKENS))
        if need > kv.capacity_tokens:
            return (f"kv_capacity: SGLang's decode server preallocates a request with room "
                    f"for its prompt and max(num_reserved_decode_tokens, its output) more: "
                    f"needs {need} KV slots, a replica holds {kv.capacity_tokens}")
        return None

    def batch_is_full(self, state: ReplicaState, decoding: list[Request]) -> bool:
        """Whether the latch holds: set, and nobody has left the running batch since."""
        if self._full is None:
            return False
        if not decoding or left_running(self._full, state):
            self._full = None
            return False
        self._full.update(r.request_id for r in decoding)
        return True

    def latch(self, decoding: list[Request]) -> None:
        """Set the latch over the running requests `decoding`. With none running it never
        holds: SGLang sets it on an empty running batch, which the next pass replaces with the
        prefill batch just run (`running_batch = last_batch`), or clears while empty."""
        self._full = {r.request_id for r in decoding} if decoding else None

    def refresh_waiting_prefixes(self, state: ReplicaState) -> None:
        """SGLang's `_touch_waiting_prefixes` (fcfs, LRU, a radix cache; `calc_priority` each
        pass with a queue): every 32nd pass, from the first, the cached prefixes of the first
        128 waiting requests count as used, the head's last (evicted last)."""
        if not self._num_prefill_passes % WAITING_PREFIX_REFRESH_INTERVAL:
            waiting = state.waiting
            for i in range(min(len(waiting), WAITING_QUEUE_PREFIX_MATCH_MAX) - 1, -1, -1):
                state.kv.touch_prefix(waiting[i])
        self._num_prefill_passes += 1

    def prompts_ending(self, plan: Plan, requests: list[Request]) -> None:
        """`requests` compute the last of their prompt in `plan`'s batch (and of the outputs
        a retracted one computes again: its extend ends there)."""
        if requests:
            scheduled = plan.num_scheduled_tokens
            self._prompts_ending.append((plan, [
                (r, r.num_preemptions, r.num_computed_tokens + scheduled[r.request_id])
                for r in requests]))

    def iteration_ended(self, plan: Plan) -> None:
        # `process_batch_result_prefill`: a request whose prefill ended is inserted in the
        # radix cache (`checkpoint_kv_cache`), in the batch's order; one that finished was
        # at its release. A prefill server's, handed off, too (`checkpoint_disagg_prefill`,
        # before its KV is sent): later prompts match it while the transfer runs.
        pending = self._prompts_ending
        if self._state is None or not any(p is plan for p, _ in pending):
            return  # (no prompt ends in it)
        while pending[0][0] is not plan:
            pending.popleft()  # older plans: ended without this hook, or never ran
        kv = self._state.kv
        for req, num_preemptions, num_tokens in pending.popleft()[1]:
            if (req.status is Status.RUNNING or req.status is Status.TRANSFERRING) and \
                    req.num_preemptions == num_preemptions:
                kv.checkpoint(req, num_tokens)

    def _stash_chunked(self, state: ReplicaState) -> None:
        """`stash_chunked_request`: the chunked request's tokens computed since the last pass
        are inserted in the radix cache before the next batch is built."""
        stashed = {}
        for req in self._prefilling(state):
            progress = (req.num_preemptions, req.num_computed_tokens)
            if req.num_computed_tokens and self._stashed.get(req.request_id) != progress:
                state.kv.checkpoint(req)
            stashed[req.request_id] = progress
        self._stashed = stashed  # only the requests still prefilling

    @property
    def max_num_scheduled_tokens(self) -> int | None:
        # A prefill batch within the chunk size, or a decode batch of every running request
        # (D tokens each, speculative).
        per_decode = self._spec.num_draft_tokens if self._spec is not None else 1
        return max(self.config.chunked_prefill_size, self.config.max_num_seqs * per_decode)

    def _prefilling(self, state: ReplicaState) -> list[Request]:
        """The running requests whose extend has tokens left, in running order: those of
        `state.prefilling()` and the chunked request with only its last token left. A request
        computed again after a retraction or preemption extends its prompt and outputs, and
        where its chunks leave one token, `Request.is_decoding` reads it as decoding; SGLang
        extends that token in a prefill batch of its own, its chunked request's last
        (`add_chunked_req`, `schedule_policy.py` 1140-1185), and samples there (rule 3)."""
        prefilling = state.prefilling()
        chunked = self._chunked
        if chunked is None:
            return prefilling
        req, num_preemptions, num_outputs = chunked
        if (req.status is not Status.RUNNING or req.num_preemptions != num_preemptions
                or req.num_output_tokens != num_outputs):
            # Retracted, preempted or aborted since, or it sampled: its extend ended (the
            # fast path's stretches compute a prompt's last chunks without a pass here).
            self._chunked = None
            return prefilling
        if not req.is_decoding:
            return prefilling  # (in the list if tokens are left)
        ids = {id(r) for r in prefilling}
        ids.add(id(req))
        return [r for r in state.running if id(r) in ids]

    def _idled_since(self, state: ReplicaState, now_s: float) -> bool:
        """Whether SGLang's loop passed fully idle (`is_fully_idle`: nothing running or
        waiting, no batch in flight) since the last pass here: everything that ran then has
        left, and every request here now came after the last of them left (one that came at
        that instant is taken in before the pass). servesim plans no pass while a replica is
        idle."""
        if state.running:
            return False  # (admitted at a pass here: there since)
        left_s = self._now_s
        for req in self._last_running:
            if req.status in (Status.WAITING, Status.RUNNING, Status.TRANSFERRING):
                return False
            if req.finish_s is not None and req.finish_s > left_s:
                left_s = req.finish_s
        if self.group_idle_since is not None and not self.group_idle_since(left_s):
            return False
        return now_s > left_s and all(req.arrival_s > left_s for req in state.waiting)

    def decide(self, state: ReplicaState, now_s: float) -> Plan:
        if self.new_token_ratio != self.ratio_init and self._idled_since(state, now_s):
            self.new_token_ratio = self.ratio_init  # `on_idle`: the tracker's `reset`
        plan = self._decide(state, now_s)
        self._last_running = list(state.running)
        return plan

    def _decide(self, state: ReplicaState, now_s: float) -> Plan:
        self._state = state
        self._now_s = now_s
        if self.decode_pass:
            return self._decode_after_deferring(state)
        tried = self.last_tried
        if len(tried) > 2 * (len(state.waiting) + len(state.running)) + 64:
            # The requests that left go (SGLang keeps these on each request, for its life): so
            # when this runs changes nothing a later pass reads, and the fast path, which plans
            # no pass inside a stretch, agrees with stepping.
            here = {r.request_id for r in state.waiting} | {r.request_id for r in state.running}
            self.last_tried = {k: v for k, v in tried.items() if k in here}
        waiting = state.waiting
        if (isinstance(waiting, EntryOrderWaiting)
                and len(waiting.entered) > 2 * (len(waiting) + len(state.running)) + 64):
            # (A running request's entry orders the victims; a finished one's is not read.)
            waiting.forget({r.request_id for r in waiting}
                           | {r.request_id for r in state.running})
        last, self._last_extend = self._last_extend, []
        if self._full is not None and last:
            # `get_next_batch_to_run` filters the last batch, a prefill, of the requests that
            # finished and of the one still chunked: if it shrank, the latch clears.
            prefilling = {id(r) for r in self._prefilling(state)}
            if any(r.status is not Status.RUNNING or id(r) in prefilling for r in last):
                self._full = None
        if state.kv.caches_prefixes:
            self._stash_chunked(state)
        preempted: list[int] = []
        # (Before an abort takes its request's verify away; only speculative decodes abort.)
        in_flight = self._spec is not None and any_in_flight(state)
        self.decode_deferred = False
        while True:
            self._aborted = False
            plan = self._build(state)
            preempted += plan.preempted_ids
            if self.decode_deferred:
                break
            if not plan and self._aborted and not in_flight:
                # The last decode aborted: SGLang's loop passes again at once, and its queue
                # may start on the KV freed. (With a batch in flight, the overlap loop first
                # processes it, the aborted request's last verify, and takes the arrivals
                # until it ends: servesim decides again when it ends.)
                continue
            # Rebuild after freeing KV: the newest running request, or everyone (then the
            # queue can start again).
            if plan or not (state.running or plan.preempted_ids) or any_in_flight(state):
                break
            if state.running:
                preempt_newest(state, preempted)
        plan.preempted_ids = preempted
        return plan

    def _decode_after_deferring(self, state: ReplicaState) -> Plan:
        """The decode a pass deferred (`defer_decodes`), now that no rank prefills: the
        speculative decode step alone (a decode that aborts its request leaves the step
        empty: the next pass is the ranks' next synced iteration)."""
        plan = Plan()
        self._aborted = schedule_spec_decodes(state, plan, cast(SGLangSpecRules, self._spec),
                                              self._now_s, self, self._prefilling(state))
        return plan

    def _build(self, state: ReplicaState) -> Plan:
        cfg = self.config
        plan = Plan()
        # Mixed: the decodes first, in the prefill's batch; else only the chunked request(s).
        prefilling = schedule_decodes(state, plan) if cfg.mixed_chunk else self._prefilling(state)
        self._prefill(state, plan, prefilling, cfg.chunked_prefill_size - plan.num_seqs)
        if not plan and self._spec is not None and self.defer_decodes:
            self.decode_deferred = True  # (an empty plan: the group decides, then decodes)
        elif not plan and self._spec is not None:
            self._aborted = schedule_spec_decodes(state, plan, self._spec, self._now_s, self,
                                                  self._prefilling(state))
        elif not plan and cfg.decode_reserve_tokens is None and not state.prefill_only:
            self._decode(state, plan)
        elif not plan:
            self._decode_newest(state, plan)
        return plan

    def _decode(self, state: ReplicaState, plan: Plan) -> None:
        """SGLang's decode step without speculative decoding (`update_running_batch`): every
        running request past its prefill decodes a token, but one whose last token is in
        flight (`_reqs_finishing_inflight`); `check_decode_mem` asks a page (here a block)
        for each request whose KV fills its last (`new_tokens_required_next_decode`), after
        evicting that much from the radix cache; short, `retract_decode` (rule 9) unless a
        finishing request's KV comes back at the step's end (then nobody decodes). Sets
        `new_token_ratio` (rule 14)."""
        kv = state.kv
        # (A request whose last token is in flight finishes with it.)
        batch, self._aborted = decode_batch(state, plan, None, None, self._now_s, self,
                                            self._prefilling(state))
        if not batch:
            return
        scheduled = plan.num_scheduled_tokens
        # (With pages > 1 and the radix cache, the allocation first evicts until a page per
        # request of the batch is free: `_decode_newest`'s docstring.)
        with kv.deferred_evictions():
            kv.allocate_one_token_each(batch)
            if kv.block_size > 1 and kv.caches_prefixes:
                kv.evict_before_paged_allocation(len(batch))
        for req in batch:
            scheduled[req.request_id] = 1

    def decay_new_token_ratio(self) -> None:
        """A decode step without retraction: `NewTokenRatioTracker.decay_step`."""
        self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.ratio_min)

    def decodes_repeated(self, num_plans: int) -> None:
        # Each of a stretch's decode steps decays the ratio as `_decode` does (one step at a
        # time, as SGLang subtracts: `num_plans` x decay would round differently), down to
        # its floor. With mixed chunks or Mini-SGLang's rule a decode step leaves it as is.
        cfg = self.config
        if cfg.mixed_chunk or cfg.decode_reserve_tokens is not None:
            return
        ratio, floor, decay = self.new_token_ratio, self.ratio_min, self.ratio_decay
        for _ in range(num_plans):
            if ratio == floor:
                break
            ratio = max(ratio - decay, floor)
        self.new_token_ratio = ratio

    def _decode_newest(self, state: ReplicaState, plan: Plan) -> None:
        """A decode batch of every running request. With pages > 1 and the radix cache,
        SGLang evicts before allocating until a page per request of the batch is free
        (`alloc_paged_token_slots_decode`, `mem_cache/allocation.py` 584-585), though a
        request takes a page only when its tokens fill the pages it holds
        (`new_tokens_required_next_decode`, `schedule_batch.py` 3403-3418)."""
        kv = state.kv
        if kv.block_size == 1 or not kv.caches_prefixes:
            schedule_decodes(state, plan)
            return
        with kv.deferred_evictions():
            schedule_decodes(state, plan)
            kv.evict_before_paged_allocation(len(plan.num_scheduled_tokens))

    def _prefill(self, state: ReplicaState, plan: Plan, prefilling: list[Request],
                 budget: int) -> None:
        """Continue the chunked request, then admit waiting requests, within `budget` tokens."""
        if budget <= 0:  # mixed decodes took the whole budget
            return
        if self.config.decode_reserve_tokens is None:
            if (not prefilling and not state.waiting and self._full is None
                    and not self.config.priority_preemption):
                self._last_extend = []  # (the pass would stop at once: a decode batch)
                return
            adder = PrefillAdder(self, state, plan, prefilling, budget)
            adder.run()
            self.prompts_ending(plan, adder.completing)
            self._last_extend = adder.can_run
            for req in adder.can_run:  # (SGLang chunks one request at a time)
                if any(r is req for r in adder.completing):
                    if self._chunked is not None and self._chunked[0] is req:
                        self._chunked = None
                else:
                    self._chunked = (req, req.num_preemptions, req.num_output_tokens)
        else:
            self._prefill_reserving(state, plan, prefilling, budget)

    def _prefill_reserving(self, state: ReplicaState, plan: Plan, prefilling: list[Request],
                           budget: int) -> None:
        """`decode_reserve_tokens` set: admit while the chunk fits beside that many future
        tokens of every running request (Mini-SGLang's rule with a cap)."""
        cfg = self.config
        scheduled = plan.num_scheduled_tokens
        for req in prefilling:  # the chunked request (one, unless the engine made more)
            num_tokens = min(req.num_uncomputed_tokens, budget)
            if num_tokens <= 0 or not state.kv.try_allocate(req, num_tokens):
                return  # it keeps its place at the front: nobody is admitted past it
            scheduled[req.request_id] = num_tokens
            budget -= num_tokens

        left = admit_waiting(state, plan, budget, cfg.max_num_seqs, cfg.decode_reserve_tokens,
                             _within_budget)
        assert left is not None and left >= 0


def _within_budget(req: Request, num_new: int, budget: int | None) -> int:
    """As much of the prompt as the budget holds (a chunk, if it is short)."""
    assert budget is not None
    return min(num_new, budget)
