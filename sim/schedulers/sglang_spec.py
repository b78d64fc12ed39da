"""SGLang's speculative decoding (`--speculative-algorithm`), as SGLang 0.5.23 schedules it:
its settings, their defaults, and the decode step's KV rule (rule 12 of `sim.schedulers.sglang`).

Paths are under `sglang/srt/` of the 0.5.23 wheel.
- Settings: `speculative_num_steps` S (draft passes), `speculative_eagle_topk` K (branches per
  pass), `speculative_num_draft_tokens` D (the verify's width: the pending token and D - 1
  drafts). Unset, SGLang picks them by the target (`_auto_choose_speculative_params`): (5, 4, 8)
  for a Llama, (3, 1, 4) for every other modelled architecture and for a standalone draft
  model; with K = 1, D is S + 1 (`arg_groups/speculative_hook.py`). NGRAM: K = 10 (its
  `max_bfs_breadth`), D = 12, S = D // K. `max_running_requests` becomes 48 unless given.
- Every decode of a step verifies D tokens (NGRAM pads its drafts to D); a verification accepts
  a run of drafts (at most S deep for the EAGLE family, D - 1 for NGRAM's trees) and samples one
  more, all joining the output; rejected slots are not freed until the request leaves.
- KV (`eagle_prepare_for_decode`, `mem_cache/allocation_sizing.py`): at each decode step a
  request holds max(what it holds, committed + 2L) slots, L = max(S * K, D) and committed its
  prompt and known outputs less one, or all of them while its prompt's sampled token is in
  flight (SGLang commits a prefill's KV as it allocates it); the 2L absorbs the overlap loop's
  step in flight, and applies without it too. The step is taken only if every request's top-up fits
  (`check_decode_mem`); else `retract_decode` retracts requests, fewest outputs first, ties the
  longest prompt first, keeping at least one (aborting that one if even it does not fit), and
  they go to the back of the queue. In the overlap loop a request whose queued result may finish
  it by length (one known token left) sits the step out (`_reqs_finishing_inflight`), and if
  the check fails with such a request, nobody decodes this step.
- The radix cache (`sim.core.radix_cache`): EAGLE, EAGLE-3 and NEXTN key it by token pairs
  (`bigram_keys`); `check_decode_mem` evicts what the top-ups are short of, fit or not, and
  each retraction evicts room for `RETRACT_DECODE_STEPS` tokens per request kept
  (`release_req`).
- The draft model's time: `sim.latency.base.EagleDraftingLatency`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, model_validator

from sim.config.errors import invalid
from sim.core.kv_cache import cdiv
from sim.core.plan import Plan
from sim.core.request import Request
from sim.core.state import ReplicaState
from sim.schedulers.base import preempt
from sim.schedulers.sglang_admission import RETRACT_DECODE_STEPS
from sim.schedulers.spec_config import AcceptanceSettings

# `--speculative-algorithm` as servesim names it (SGLang's upper-case names, lower-cased;
# NEXTN, DeepSeek's MTP, is EAGLE's alias).
SGLANG_SPEC_ALGORITHMS = ("eagle", "eagle3", "nextn", "standalone", "ngram")
SPEC_MAX_RUNNING_REQUESTS = 48  # "Max running requests is reset to 48 for speculative decoding"
NGRAM_TOPK = 10  # `speculative_ngram_max_bfs_breadth`
NGRAM_DRAFT_TOKENS = 12


def auto_params(algorithm: str, model_type: str | None) -> tuple[int, int, int] | None:
    """SGLang's (S, K, D) when none is given, by the target's `model_type` (None where it is
    not known: then they must be given)."""
    if algorithm == "ngram":
        return NGRAM_DRAFT_TOKENS // NGRAM_TOPK, NGRAM_TOPK, NGRAM_DRAFT_TOKENS
    if algorithm == "standalone":
        return 3, 1, 4
    if model_type is None:
        return None
    return (5, 4, 8) if model_type == "llama" else (3, 1, 4)


class SGLangSpeculativeConfig(AcceptanceSettings):
    """SGLang's `--speculative-algorithm` and its numbers: each decode step drafts
    `num_steps` deep (`eagle_topk` branches a pass) and verifies `num_draft_tokens` tokens
    per request (the pending one and its drafts). Unset, the three are SGLang's own choice for
    the replica's model (see `sim.schedulers.sglang_spec`)."""

    algorithm: Literal["eagle", "eagle3", "nextn", "standalone", "ngram"] = Field(
        description="SGLang's --speculative-algorithm: eagle, eagle3, nextn (an MTP head, "
                    "EAGLE's alias), standalone (a draft model), ngram (lookup in the tokens "
                    "seen)")
    num_steps: int | None = Field(
        None, ge=1, le=16, description="--speculative-num-steps: draft depth (passes) per step; "
                                       "None: SGLang's choice for the model")
    eagle_topk: int | None = Field(
        None, ge=1, le=16, description="--speculative-eagle-topk: branches per draft pass; "
                                       "None: SGLang's choice")
    num_draft_tokens: int | None = Field(
        None, ge=2, le=64, description="--speculative-num-draft-tokens: tokens each decode "
                                       "verifies (1 + drafts); None: SGLang's choice",
        json_schema_extra={"unit": "tokens"})
    draft_time_ratio: float | None = Field(
        None, ge=0, le=10,
        description="a draft pass's time relative to the target's for the same tokens; None: "
                    "0 for ngram, the drafter's share of the weights for eagle/eagle3/nextn "
                    "(one decoder layer and the LM head; over prompt tokens one layer of "
                    "the target's); standalone needs it")

    engine = "sglang"

    @model_validator(mode="before")
    @classmethod
    def _ngram_defaults(cls, data: Any) -> Any:
        # NGRAM's own defaults (`_handle_ngram`): each unset one filled in, S last.
        if not isinstance(data, dict) or data.get("algorithm") != "ngram":
            return data
        data = dict(data)
        data.setdefault("eagle_topk", NGRAM_TOPK)
        data.setdefault("num_draft_tokens", NGRAM_DRAFT_TOKENS)
        topk, draft = data["eagle_topk"], data["num_draft_tokens"]
        if "num_steps" not in data and type(topk) is int and type(draft) is int and topk > 0:
            data["num_steps"] = max(1, draft // topk)
        return data

    def _check_settings(self) -> None:
        given = (self.num_steps, self.eagle_topk, self.num_draft_tokens)
        if None in given:
            if any(v is not None for v in given):
                raise invalid(("num_steps", self.num_steps,
                               "give num_steps, eagle_topk and num_draft_tokens together, or "
                               "none of them (SGLang's choice for the model)"))
            raise invalid(("num_steps", None,
                           "SGLang picks num_steps, eagle_topk and num_draft_tokens by the "
                           "model's architecture, which is not known here: give them"))
        steps, topk, draft = given
        assert steps is not None and topk is not None and draft is not None
        if self.algorithm != "ngram" and topk == 1 and draft != steps + 1:
            raise invalid(("num_draft_tokens", draft,
                           f"SGLang sets it to num_steps + 1 ({steps + 1}) when eagle_topk is "
                           "1: give that"))
        if self.algorithm != "ngram" and draft - 1 > topk + (steps - 1) * topk * topk:
            raise invalid(("num_draft_tokens", draft,
                           f"more drafts than the tree of {steps} steps x {topk} branches "
                           "proposes"))
        if self.algorithm != "ngram" and topk > 1 and draft < steps + 1:
            # `_compact_accept_to_front` (speculative/eagle_worker_common.py) writes the
            # accepted path's S + 1 rows into each request's block of D: SGLang 0.5.23 fails
            # at the first tree verify.
            raise invalid(("num_draft_tokens", draft,
                           f"SGLang's tree verify needs at least num_steps + 1 ({steps + 1}) "
                           "tokens"))
        if self.algorithm == "standalone" and self.draft_time_ratio is None:
            raise invalid(("draft_time_ratio", None, "a draft model's time is its own: give "
                                                     "its step time relative to the target's"))

    def _positions(self) -> tuple[int, str]:
        # How deep a verification can accept: the draft depth for the EAGLE family (a path of
        # the tree), any of the drafts for NGRAM's.
        if self.algorithm == "ngram":
            return self.num_draft_tokens_set - 1, "num_draft_tokens - 1"
        return self.num_steps_set, "num_steps"

    @property
    def num_steps_set(self) -> int:
        assert self.num_steps is not None
        return self.num_steps

    @property
    def num_draft_tokens_set(self) -> int:
        assert self.num_draft_tokens is not None
        return self.num_draft_tokens

    @property
    def bigram_keys(self) -> bool:
        """Whether SGLang keys its radix cache by token pairs (`is_eagle`: the drafter reads
        each token's successor; not NGRAM, not a draft model)."""
        return self.algorithm in ("eagle", "eagle3", "nextn")

    @property
    def method(self) -> str:
        """The drafter's kind as `sim.latency.base.drafter_time_ratio` names it."""
        return {"eagle": "eagle", "eagle3": "eagle3", "nextn": "mtp", "standalone": "draft_model",
                "ngram": "ngram"}[self.algorithm]

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts each decode verifies."""
        return self.num_draft_tokens_set - 1

    def draws(self) -> list[float]:
        """Conditional acceptance rates over the drafts verified: those past the accepting
        depth are never accepted."""
        rates = self.rates
        return rates + [0.0] * (self.num_speculative_tokens - len(rates))


@dataclass(frozen=True)
class SGLangSpecRules:
    """The numbers SGLang's scheduler reads with speculative decoding on."""

    num_draft_tokens: int  # D: tokens every decode verifies
    reserve_tokens: int  # 2L: slots held past a request's committed KV at each decode step

    @classmethod
    def of(cls, spec: SGLangSpeculativeConfig | None) -> SGLangSpecRules | None:
        if spec is None:
            return None
        steps, draft = spec.num_steps_set, spec.num_draft_tokens_set
        topk = spec.eagle_topk
        assert topk is not None
        return cls(num_draft_tokens=draft, reserve_tokens=2 * max(steps * topk, draft))


def _known_outputs(req: Request) -> int:
    """Outputs whose results the scheduler has processed (`len(req.output_ids)`): those of a
    step still in flight are placeholders here."""
    return req.num_output_tokens - req.num_placeholders


def _committed(req: Request) -> int:
    """SGLang's `kv_committed_len`: the prompt and the known outputs but the last, whose KV is
    not written yet; while the token of a prompt's last chunk is in flight (the overlap loop),
    the whole prompt, which `alloc_for_extend` commits as it allocates it
    (`mem_cache/allocation.py`). (That token is the request's one placeholder; a verification
    in flight has D >= 2.)"""
    prefill_in_flight = req.num_placeholders == 1
    return req.num_prompt_tokens + _known_outputs(req) - (not prefill_in_flight)


def ratio_after_retract(kept: list[Request]) -> float:
    """`NewTokenRatioTracker.estimate_new_token_ratio_after_retract` over the requests kept
    (their known outputs; `max_new_tokens` their output lengths)."""
    decoded = sum(_known_outputs(r) for r in kept)
    max_new = sum(r.num_target_output_tokens for r in kept)
    return min(1.0, (decoded + RETRACT_DECODE_STEPS * len(kept)) / (max_new + 1))


def schedule_spec_decodes(state: ReplicaState, plan: Plan, rules: SGLangSpecRules,
                          now_s: float, tracker: Any = None,
                          prefilling: list[Request] | None = None) -> bool:
    """SGLang's decode step with speculative decoding (`update_running_batch`,
    `check_decode_mem`, `retract_decode`, `eagle_prepare_for_decode`): every running request
    not prefilling verifies D tokens, each topped up to its committed KV plus 2L slots; where
    the top-ups do not all fit, requests are retracted (see the module docstring).
    `prefilling`: the running requests still extending (default `state.prefilling()`). Returns
    whether it aborted one."""
    if state.prefill_only:
        return False  # (a prefill replica samples each request's first token, then hands off)
    kv = state.kv
    block_size = kv.block_size
    reserve = rules.reserve_tokens

    def finishing(req: Request) -> bool:  # its queued result finishes it
        return bool(req.num_in_flight_tokens) and \
            _known_outputs(req) + 1 >= req.num_target_output_tokens

    def top_up(req: Request) -> int:
        return max(0, cdiv(_committed(req) + reserve, block_size)
                   - kv.num_held_blocks(req.request_id))

    batch, aborted = decode_batch(state, plan, finishing, top_up, now_s, tracker, prefilling)
    scheduled = plan.num_scheduled_tokens
    for req in batch:
        grow = top_up(req)
        if grow:
            kv.grow_blocks(req.request_id, grow)
        scheduled[req.request_id] = rules.num_draft_tokens
    return aborted


def decode_batch(state: ReplicaState, plan: Plan, finishing: Callable[[Request], bool] | None,
                 top_up: Callable[[Request], int] | None, now_s: float, tracker: Any = None,
                 prefilling: list[Request] | None = None) -> tuple[list[Request], bool]:
    """The requests of SGLang's decode step (`update_running_batch`): every running request
    past its prefill but those whose result in flight finishes them (`finishing`:
    `_reqs_finishing_inflight`; None: a decode's, its last token in flight in the overlap
    loop, `is_caught_up`); where their top-ups do not all fit (`check_decode_mem`), none if a
    finishing request's KV comes back at the step's end, else those left after
    `retract_decode`, `tracker`'s new-token ratio set from them (decayed where all fit).
    `top_up` None: a block for each request whose KV fills its last (a decode's one token).
    `prefilling` (default `state.prefilling()`) are left out: still extending. Returns them in
    the batch's order, and whether one was aborted. (The rules for None are written out, not
    called per request: the decode step runs this for every request at every step.)"""
    extending = state.prefilling() if prefilling is None else prefilling
    caught_up = finishing is None and state.pipelined
    any_finishing = False
    if not extending and finishing is None and not caught_up:
        batch = list(state.running)
    else:
        ids = {id(r) for r in extending}
        batch = []
        for req in state.running:
            if id(req) in ids:
                continue
            if (req.num_computed_tokens == req.num_prompt_tokens + req.num_output_tokens
                    if caught_up else finishing is not None and finishing(req)):
                any_finishing = True
                continue
            batch.append(req)
    if not batch:
        return batch, False
    aborted = False
    if not _check_decode_mem(state, batch, top_up):
        if any_finishing:
            return [], False  # their KV comes back at this step's end: the rest next step
        batch, aborted = _retract(state, plan, batch, top_up, now_s)
        if tracker is not None:
            tracker.new_token_ratio = ratio_after_retract(batch)
    elif tracker is not None:
        tracker.decay_new_token_ratio()
    return batch, aborted


def _check_decode_mem(state: ReplicaState, batch: list[Request],
                      top_up: Callable[[Request], int] | None) -> bool:
    """`check_decode_mem`: whether every request of `batch` can be topped up, after evicting
    what they are short of from the radix cache (which it does whether they then fit or
    not). `top_up` None: a block where a request's KV fills its last, counted here (the
    decode step's test, once per request at every step: no call each)."""
    if top_up is not None:
        need = sum(top_up(r) for r in batch)
    elif (block_size := state.kv.block_size) == 1:
        need = len(batch)
    else:
        need = sum(1 for r in batch if r.num_computed_tokens % block_size == 0)
    state.kv.evict_to_free(need)
    return need <= state.kv.num_free_blocks


def _retract(state: ReplicaState, plan: Plan, batch: list[Request],
             top_up: Callable[[Request], int] | None, now_s: float) -> tuple[list[Request], bool]:
    """`retract_decode`: retract the requests SGLang keeps least (fewest known outputs, then
    the longest prompt; among equals the later in the batch) until the others' top-ups fit,
    at least one, keeping one; abort that one if even it does not fit. The kept requests run
    on in that order (`filter_batch(keep_indices=...)` reorders the batch). Returns them, and
    whether one was aborted."""
    kv = state.kv
    aborted = False
    order = sorted(range(len(batch)),
                   key=lambda i: (_known_outputs(batch[i]), -batch[i].num_prompt_tokens),
                   reverse=True)

    def fits() -> bool:
        return _check_decode_mem(state, [batch[i] for i in order], top_up)

    first = True
    while first or not fits():
        if len(order) == 1:
            break
        first = False
        preempt(state, batch[order.pop()], plan.preempted_ids, to_back=True)
        # `release_req`: "use the newly evictable memory instantly"
        kv.evict_to_free(cdiv(RETRACT_DECODE_STEPS * len(order), kv.block_size))
    if len(order) <= 1 and not fits():
        last = batch[order.pop()]
        # Released as a retracted request is (`release_req`: `reset_for_retract` counts it).
        last.num_preemptions += 1
        state.abort(last, now_s, "kv_oom: SGLang aborts the last request of a decode batch "
                                 "whose KV top-up does not fit even alone (retract_decode)")
        aborted = True
    kept = [batch[i] for i in order]
    # The batch's new order, in the places its requests held in the running list.
    places = {id(r) for r in kept}
    it = iter(kept)
    state.running[:] = [next(it) if id(r) in places else r for r in state.running]
    return kept, aborted
