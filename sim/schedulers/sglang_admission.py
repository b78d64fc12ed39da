"""SGLang's admission of a prefill batch (`PrefillAdder`), as SGLang 0.5.23 runs it for requests
whose output length is known (`ignore_eos`, `max_new_tokens` = the trace's output).

Paths are under `sglang/srt/`; the golden schedules (`tools/golden/`) check these rules.

- The budget of one pass (`mem_cache/prefill_budget.py`): `available + evictable` tokens (free
  KV, and cached prefixes nobody uses), less two offsets: `total_offset`, which starts as every
  running (decoding) request's remaining output, clipped at 4096 (`CLIP_MAX_NEW_TOKENS`;
  `PrefillAdder._get_running_request_total_token_offset`, ratio 1 for `ignore_eos`, else
  `new_token_ratio`, a float: rule 14 of `sim.schedulers.sglang`), and
  `current_offset`, which starts at 0. Each request this pass takes adds `extend + page +
  min(max_new_tokens, 4096)` to the first (its output: 0 for a chunk that does not finish its
  prompt) and `extend + page` to the second (`reserve`; page: `--page-size`, servesim's KV
  block; the extend rounded up to pages, `_update_prefill_budget`, which charges the chunk
  and input budgets the rounded extend too). Free KV is
  read live (`PrefillBudget._available_and_evictable`), but SGLang allocates after the pass,
  so within it only locks move it: an admitted request's matched prefix is no longer
  evictable.
- The pass stops before matching anyone once a budget is spent (`budget_state()` OTHER), and
  does not start with no request slot left (`get_num_allocatable_reqs`, which latches).
- The chunked request continues first (`add_chunked_req`), with min(chunk budget, what is left
  of the total) tokens, or a whole chunk if that is nothing ("must make progress").
- The waiting queue, FCFS, stops at the first request refused:
  - at `max_running_requests` (the pass's requests, the chunked one included, beside the
    running ones; `get_num_allocatable_reqs`), which latches the batch as full;
  - without a radix cache, for an `ignore_eos` request (`add_one_req_ignore_eos`; the others
    take the next rule): its whole remaining prompt plus a page
    must fit both remainders (`can_allocate_prefill`), and every request, it included, must be
    able to finish in order: sorted by outputs left, each in turn must find room for one
    token a step for everyone still running, counting what those before it freed
    (`IGNORE_EOS_RESERVE_TOKENS` = 1 per request kept spare; `schedule_policy.py` ~1259-1303,
    its insertion order kept, quirk included);
  - with a radix cache (`add_one_req`, `_select_prefill_admission`): extend (unrounded) +
    min(output left, 4096) + page must be strictly below the total remainder, its matched
    prefix locked (not evictable) while it is checked;
  - what does not fit the chunk budget becomes the chunked request (its output reserved only
    with its last chunk; with a radix cache its chunk ends on a page, `_chunk_end`); after
    each request, the pass stops when a remainder is spent (no
    token: latches the batch as full if anything runs) or the chunk budget or
    `max_prefill_tokens` (16384) is.
- The latch (`running_batch.batch_is_full`, `scheduler.py`): while set and no request is being
  chunked, no prefill is tried at all; it clears when a running request leaves (finishes),
  when nothing runs, or when the last batch was a prefill that lost a request before the next
  pass (`last_batch.filter_batch`: one finished at its first token, or the chunked one); set
  while nothing decodes, it does not hold (the flag is on the running batch object, which the
  prefill batch then replaces).
- Priority preemption (`--enable-priority-scheduling`, `PrefillAdder.preempt_to_schedule`):
  the latch is cleared before every pass, and the pass does not stop at once for want of a
  request slot; where the batch is full by count (and from then on in the pass), the request
  at the head is admitted only if it preempts running requests: those it beats by more than
  `priority_scheduling_preemption_threshold`, least preferred first and, within a level, the
  latest to enter the queue first, as many as it takes for their outputs left (clipped at
  4096) to cover its need, at least one; none if they cannot cover it. Its need: its whole
  `max_new_tokens` clipped, less the total remainder, plus its fill ids less its prefix as
  they were when it was last tried in a pass (`init_next_round_input`: none if never; then
  its prompt and outputs less the prefix it matched, the prefix reset by a preemption). A
  victim's KV is freed (`release_req`: nothing inserted in the radix cache), its outputs
  kept (it is prefilled again with them), its offset given back, and it re-enters the queue
  after the pass, at the end of its level; after each victim's release the radix cache
  evicts room for 20 tokens per request left in the batch (`evict_from_tree_cache`). A
  victim's prefill again, chunked so that one token is left, is still SGLang's chunked
  request (never a candidate: `SGLang._prefilling`). Not modelled: the order in which the
  victims of one preemption re-enter (a set's, in SGLang: arbitrary; here the running
  batch's).
- Disaggregated: a prefill server's pass runs as above (the latch cleared before each pass, as
  its loop also does for every request, `get_next_disagg_prefill_batch_to_run`), but it never
  preempts: its running batch is empty. A decode server runs no `PrefillAdder` (transferred
  requests join its running batch as their KV lands): the requests it retracted and servesim
  computes again here are admitted without preemption.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.core.hicache import HierarchicalCache
from sim.core.kv_cache import cdiv
from sim.core.plan import Plan
from sim.core.request import Request, Status
from sim.core.state import ReplicaState
from sim.core.waiting import EntryOrderWaiting

if TYPE_CHECKING:
    from sim.schedulers.sglang import SGLang

CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION's default
IGNORE_EOS_RESERVE_TOKENS = 1
MAX_PREFILL_TOKENS = 16384  # `--max-prefill-tokens`' default
# `SGLANG_RETRACT_DECODE_STEPS`: a retraction or preemption evicts room for this many tokens
# per request left running (`release_req`)
RETRACT_DECODE_STEPS = 20


class PrefillAdder:
    """One prefill pass of SGLang's scheduler over `state` (module docstring)."""

    def __init__(self, policy: SGLang, state: ReplicaState, plan: Plan,
                 prefilling: list[Request], budget: int) -> None:
        self.policy = policy
        self.state = state
        self.plan = plan
        self.prefilling = prefilling
        self.rem_chunk = budget
        self.rem_input = MAX_PREFILL_TOKENS
        kv = state.kv
        # SGLang's page (`--page-size`, 1 by default) is servesim's KV block: admission
        # rounds extends up to it and keeps one spare a request (`_update_prefill_budget`).
        self.page = kv.block_size
        chunked = {id(r) for r in prefilling}
        # SGLang's running batch: the requests past their prefill.
        self.decoding = [r for r in state.running if id(r) not in chunked]
        self.free = kv.num_free_blocks * kv.block_size  # available + evictable, read once
        # A prefill replica of a disaggregated cluster computes each request's first token.
        self.prefill_only = state.prefill_only
        # (`_offset` summed, written out: a pass over every running request at every pass.)
        clip = CLIP_MAX_NEW_TOKENS
        # A request without `ignore_eos` reserves its outputs left times `new_token_ratio`,
        # a float (`policy.new_token_ratio`): the offsets are then floats, as SGLang's.
        ratio = policy.new_token_ratio
        self.total_offset: float = (
            sum(min(1 - r.num_output_tokens + r.num_placeholders, clip) for r in self.decoding)
            if self.prefill_only else
            sum(min(r.num_target_output_tokens - r.num_output_tokens + r.num_placeholders, clip)
                * (1 if r.ignore_eos else ratio) for r in self.decoding))
        self.current_offset = 0
        self.can_run: list[Request] = []
        self.completing: list[Request] = []  # of those, the ones whose prompt ends here
        self.req_states: list[tuple[float, int]] | None = None
        self.preempted: list[Request] = []  # by priority this pass, back in the queue after

    def _target(self, req: Request) -> int:
        """The request's `max_new_tokens` here."""
        return 1 if self.prefill_only else req.num_target_output_tokens

    def _paged(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.page) * self.page

    def _reserve(self, extend: int, max_new: int) -> None:
        immediate = self._paged(extend) + self.page
        self.total_offset += immediate + max_new
        self.current_offset += immediate
        self.rem_chunk -= self._paged(extend)
        self.rem_input -= self._paged(extend)

    def run(self) -> None:
        try:
            self._run()
        finally:
            for req in self.preempted:  # (`_add_request_to_queue`, after the pass)
                self.state.waiting.append(req)

    def _run(self) -> None:
        policy, state = self.policy, self.state
        # (A decode server runs no `PrefillAdder`: its retracted requests, computed again
        # here, take the pass without preemption, as without priorities.)
        preempting = policy.config.priority_preemption and not state.decode_only
        if preempting:
            policy.latch([])  # cleared before every pass, to try preemption
        full = policy.batch_is_full(state, self.decoding)
        if (full or not state.waiting) and not self.prefilling:
            return
        # (On a decode replica, a request whose KV is on its way holds its slot already.)
        max_new_reqs = policy.config.max_num_seqs - len(self.decoding) - len(state.incoming)
        if max_new_reqs <= 0 and not self.prefilling and not preempting:
            policy.latch(self.decoding)  # `get_num_allocatable_reqs` <= 0, before matching
            return
        kv = state.kv
        if kv.caches_prefixes and state.waiting:
            policy.refresh_waiting_prefixes(state)
        with kv.deferred_evictions():  # one allocation for the batch (`prepare_for_extend`)
            self._fill(full, preempting)
            if self.page > 1 and self.can_run:
                # (Pages > 1: evictions for the batch's tokens and a page a request.)
                scheduled = self.plan.num_scheduled_tokens
                num_tokens = sum(scheduled[r.request_id] for r in self.can_run)
                kv.evict_before_paged_allocation(
                    cdiv(num_tokens + len(self.can_run) * self.page, self.page))

    def _fill(self, full: bool, preempting: bool) -> None:
        """The pass itself: the chunked request, then the queue (module docstring)."""
        policy, state = self.policy, self.state
        for req in self.prefilling:  # the chunked request
            if not self._continue_chunk(req):
                return
        while state.waiting:
            if full and not preempting:
                return
            if self.rem_input <= 0 or self.rem_chunk <= 0:
                return  # `budget_state()` OTHER: stop before matching anyone
            max_new_reqs = (policy.config.max_num_seqs - len(self.decoding)
                            - len(state.incoming))
            if len(self.can_run) >= max_new_reqs:
                policy.latch(self.decoding)
                full = True  # (`batch_is_full` holds for the rest of the pass)
            if full and not (preempting and self._preempt_for(state.waiting[0])):
                return  # (the latch stops the loop at once: `batch_is_full`, break)
            result = self._add(state.waiting[0])
            if result != "continue":
                if result == "no_token" and (self.can_run or self.decoding):
                    policy.latch(self.decoding)
                return

    def _preempt_for(self, req: Request) -> bool:
        """`preempt_to_schedule`: preempt running requests to make room for `req` (module
        docstring); whether it did."""
        if self.prefill_only:
            # A prefill server's running batch is always empty (`get_next_disagg_prefill_
            # batch_to_run` never merges its batches into it: they go to the inflight
            # queue): `preempt_to_schedule` finds no victim.
            return False
        cfg = self.policy.config
        state = self.state
        waiting = state.waiting
        assert isinstance(waiting, EntryOrderWaiting)
        sign = 1 if cfg.schedule_low_priority_values_first else -1
        candidates = sorted(
            (r for r in self.decoding if r.status is Status.RUNNING),
            key=lambda r: (r.priority * -sign, -waiting.entered.get(r.request_id, 0)))
        # Its fill ids and prefix as last set (`init_next_round_input`, when it was last tried
        # in a pass): none before; its prefix reset by a preemption since.
        fill, prefix, preemptions = self.policy.last_tried.get(req.request_id, (0, 0, 0))
        if preemptions != req.num_preemptions:
            prefix = 0
        need = (fill - prefix + min(self._target(req), CLIP_MAX_NEW_TOKENS)
                - (self.free - self.total_offset))
        victims = []
        for running in candidates:
            if (req.priority - running.priority) * -sign <= (
                    cfg.priority_scheduling_preemption_threshold):
                break
            victims.append(running)
            need -= self._offset(running)
            if need <= 0:
                break
        if not victims or need > 0:
            return False
        kv = state.kv
        before = kv.num_free_blocks
        ids = {id(r) for r in victims}
        num_left = len(self.decoding)
        for victim in [r for r in self.decoding if id(r) in ids]:  # (the batch's order)
            self.total_offset -= self._offset(victim)
            # (With mixed_chunk its decode joined the batch first: out of it again; the budget
            # it took is not given back, as SGLang's `num_mixed_decode_tokens` is not.)
            self.plan.num_scheduled_tokens.pop(victim.request_id, None)
            state.preempt(victim)
            num_left -= 1  # `release_req`: room for 20 tokens a request left, evicted now
            kv.evict_to_free(cdiv(RETRACT_DECODE_STEPS * num_left, kv.block_size))
            waiting.remove(victim)  # (back in the queue after the pass)
            self.preempted.append(victim)
        self.decoding = [r for r in self.decoding if id(r) not in ids]
        self.req_states = None  # (the in-order check's list held them)
        # (One preemption's victims by request id: SGLang keeps them in a set.)
        self.plan.preempted_ids.extend(sorted(r.request_id for r in victims))
        self.free += (kv.num_free_blocks - before) * kv.block_size
        return True

    def _offset(self, req: Request) -> float:
        """A running request's reserved future tokens (`_get_running_request_total_token_
        offset`): its outputs left, clipped, times `new_token_ratio` without `ignore_eos`."""
        left = min(self._target(req) - output_ids_len(req), CLIP_MAX_NEW_TOKENS)
        return left if req.ignore_eos or self.prefill_only else left * self.policy.new_token_ratio

    def _continue_chunk(self, req: Request) -> bool:
        left = req.num_uncomputed_tokens
        rem = min(self.rem_chunk, int(self.free - self.total_offset))
        if rem <= 0:
            rem = self.rem_chunk
        num_tokens = min(left, rem)
        if num_tokens <= 0 or not self.state.kv.try_allocate(req, num_tokens):
            return False  # it keeps its place: nobody is admitted past it
        self.plan.num_scheduled_tokens[req.request_id] = num_tokens
        self._reserve(num_tokens, 0 if num_tokens < left else min(
            self._target(req), CLIP_MAX_NEW_TOKENS))
        self.can_run.append(req)
        if num_tokens == left:
            self.completing.append(req)
        return True

    def _add(self, req: Request) -> str:
        """`add_one_req` for the head of the queue: 'continue', 'no_token' or 'other'."""
        kv = self.state.kv
        hit = kv.match_prefix(req)  # (`init_next_round_input`: a use, even if refused)
        if self.policy.config.priority_preemption:  # (`full_untruncated_fill_ids`, `prefix_len`)
            self.policy.last_tried[req.request_id] = (
                req.num_prompt_tokens + output_ids_len(req), hit, req.num_preemptions)
        extend = req.num_uncomputed_tokens - hit
        max_new = min(self._target(req), CLIP_MAX_NEW_TOKENS)
        locked = 0
        # The general path (a radix cache, or no `ignore_eos`): its chunk ends on a page
        # (`_select_prefill_admission`).
        paged = kv.caches_prefixes or not req.ignore_eos
        if not paged:
            paged_input = self._paged(extend) + self.page
            if paged_input > min(self.free - self.current_offset, self.free - self.total_offset):
                return "no_token"
            if not self._everyone_finishes(req, paged_input):
                return "no_token"
        else:
            left = min(max(self._target(req) - output_ids_len(req), 0), CLIP_MAX_NEW_TOKENS)
            locked = kv.unused_prefix_tokens(req)
            # (The extend unrounded: `add_one_req`'s `total_tokens`.)
            if not extend + left + self.page < self.free - locked - self.total_offset:
                return "no_token"
            if isinstance(kv, HierarchicalCache) and (loaded := kv.load_back(req)):
                # Its host hit, loaded back: a prefix now, its blocks taken (`init_load_back`).
                hit += loaded
                extend -= loaded
                self.free -= loaded
                if self.policy.config.priority_preemption:
                    fill, _, preemptions = self.policy.last_tried[req.request_id]
                    self.policy.last_tried[req.request_id] = (fill, hit, preemptions)
        num_tokens = extend
        if (self._paged(extend) if paged else extend) > self.rem_chunk:
            if self.rem_chunk <= 0:
                return "other"
            num_tokens = self._chunk_end(hit, self.rem_chunk) - hit if paged else self.rem_chunk
            if num_tokens <= 0:
                return "other"
            max_new = 0
        if not kv.try_allocate(req, num_tokens, 0, hit):
            return "no_token"  # the pool itself is short (blocks rounding up): stop here
        self.state.admit(req, hit)
        self.free -= locked  # its prefix, locked now, is no longer evictable (read live)
        self.plan.num_scheduled_tokens[req.request_id] = num_tokens
        self._reserve(num_tokens, max_new)
        self.can_run.append(req)
        if num_tokens == extend:
            self.completing.append(req)
        if self.free - self.total_offset <= 0 or self.free - self.current_offset <= 0:
            return "no_token"
        if self.rem_input <= 0 or self.rem_chunk <= 0:
            return "other"
        return "continue"

    def _chunk_end(self, prefix: int, budget: int) -> int:
        """Where a chunk of a request with a radix cache ends: at most `budget` tokens past
        its `prefix`, on a page boundary (`_select_prefill_admission`, `schedule_policy.py`
        1665-1671: the budget floored to pages, then the end). Without a radix cache the
        chunk is the budget, unaligned (`add_one_req_ignore_eos` 1352-1375), and so is a
        continuing chunk's (`add_chunked_req` 1139-1171)."""
        return (prefix + budget // self.page * self.page) // self.page * self.page

    def _everyone_finishes(self, req: Request, paged_input: int) -> bool:
        """The in-order check of `add_one_req_ignore_eos`: `req` and everyone running or taken
        this pass, by outputs left, can each finish with one token a step for those after."""
        ratio = self.policy.new_token_ratio

        def state_of(r: Request) -> tuple[float, int] | None:
            out = output_ids_len(r)
            # (`max_new_tokens * new_token_ratio - len(output_ids)` without `ignore_eos`.)
            left = (self._target(r) - out if r.ignore_eos or self.prefill_only
                    else self._target(r) * ratio - out)
            return (left, r.num_prompt_tokens + out) if left > 0 else None

        states = self.req_states
        if states is None:
            # (`state_of` over everyone, written out: a pass over every running request.)
            states = []
            add = states.append
            for r in [req, *self.decoding, *self.can_run]:
                out = r.num_output_tokens - r.num_placeholders
                left: float = (1 if self.prefill_only else r.num_target_output_tokens) - out
                if not r.ignore_eos and not self.prefill_only:
                    left = r.num_target_output_tokens * ratio - out
                if left > 0:
                    add((left, r.num_prompt_tokens + out))
            states.sort(key=_left)
            self.req_states = states
        else:
            new = state_of(req)
            if new is not None:
                i = 0
                for i in range(len(states)):  # SGLang's insertion: before the last at worst
                    if new[0] <= states[i][0]:
                        break
                states.insert(i, new)
        current = self.free - self.current_offset - paged_input
        freed = 0
        n = len(states)
        for i, (left, occupied) in enumerate(states):
            batch = n - i
            if current + freed - left * batch <= IGNORE_EOS_RESERVE_TOKENS * batch:
                return False
            freed += occupied
        return True


def _left(state: tuple[float, int]) -> float:
    return state[0]


def output_ids_len(req: Request) -> int:
    """`len(req.output_ids)` as SGLang reads it: with the overlap loop, a token still in
    flight (a placeholder here) is not there yet, so each such request reserves one more."""
    return req.num_output_tokens - req.num_placeholders


def left_running(latched: set[int], state: ReplicaState) -> bool:
    """Whether a request that was running when the batch latched full has left since."""
    requests = state.requests
    return any(requests[rid].status is not Status.RUNNING for rid in latched)
