"""vLLM v0's default policy: waiting prompts are prefilled whole, and running decodes wait."""

from __future__ import annotations

from pydantic import Field

from sim.core.kv_cache import KVCacheManager
from sim.core.plan import Plan
from sim.core.state import ReplicaState
from sim.schedulers.base import (
    SCHEDULERS,
    Scheduler,
    SchedulerConfig,
    reserved_blocks,
    schedule_decodes,
    try_admit,
)


class PrefillFirstConfig(SchedulerConfig):
    max_num_batched_tokens: int | None = Field(
        None, gt=0,
        description="most prompt tokens in one prefill iteration; None: vLLM v0's default "
                    "without chunking, max(max_model_len, 2048)")


@SCHEDULERS.register("prefill_first")
class PrefillFirst(Scheduler):
    """If any waiting prompt can be admitted, the iteration prefills admitted prompts whole (FCFS,
    within max_num_seqs, max_num_batched_tokens and KV); otherwise every running request decodes."""

    Config = PrefillFirstConfig
    config: PrefillFirstConfig

    def __init__(self, config: PrefillFirstConfig, *, max_model_len: int | None = None) -> None:
        super().__init__(config, max_model_len=max_model_len)
        budget = config.max_num_batched_tokens
        if budget is None and max_model_len is not None:
            budget = max(max_model_len, 2048)  # vLLM v0 `SchedulerConfig`, chunking off
        self.max_num_batched_tokens = budget

    def capacity_reason(self, kv: KVCacheManager, num_kv_tokens: int) -> str | None:
        budget = self.max_num_batched_tokens
        # As vLLM v0 without chunking, max_num_batched_tokens acts as max_model_len: a preempted
        # request's recompute (prompt plus output so far) must still fit one prefill.
        if budget is not None and num_kv_tokens > budget:
            return (f"max_num_batched_tokens: needs {num_kv_tokens} tokens in one prefill, "
                    f"max_num_batched_tokens is {budget}")
        return super().capacity_reason(kv, num_kv_tokens)

    @property
    def max_num_scheduled_tokens(self) -> int | None:
        # A prefill batch within the budget, or a decode batch of every running request.
        budget = self.max_num_batched_tokens
        return None if budget is None else max(budget, self.config.max_num_seqs)

    def decide(self, state: ReplicaState, now_s: float) -> Plan:
        cfg = self.config
        plan = Plan()
        budget = self.max_num_batched_tokens
        # Summed over the running requests only when one may be admitted (under overload the
        # batch is mostly full): nothing changes it before the first admission.
        reserved: int | None = None
        while state.waiting and len(state.running) < cfg.max_num_seqs:
            req = state.waiting[0]
            hit = state.kv.prefix_hit_tokens(req)
            num_tokens = req.num_uncomputed_tokens - hit
            if budget is not None and num_tokens > budget:
                break
            if reserved is None:
                reserved = reserved_blocks(state, cfg.decode_reserve_tokens)
            own_reserve = try_admit(state, req, num_tokens, cfg.decode_reserve_tokens, reserved,
                                    hit)
            if own_reserve is None:
                break
            reserved += own_reserve
            plan.num_scheduled_tokens[req.request_id] = num_tokens
            if budget is not None:
                budget -= num_tokens
        if not plan:
            schedule_decodes(state, plan)
        return plan
