"""vLLM v0's default policy: waiting prompts are prefilled whole, and running decodes wait."""

from __future__ import annotations

from pydantic import Field

from sim.core.kv_cache import KVCacheManager
from sim.core.plan import Plan
from sim.core.request import Request
from sim.core.state import ReplicaState
from sim.schedulers.admission import admit_waiting
from sim.schedulers.base import (
    SCHEDULERS,
    Scheduler,
    SchedulerConfig,
    schedule_decodes,
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
        admit_waiting(state, plan, budget, cfg.max_num_seqs, cfg.decode_reserve_tokens,
                      _whole_prompt)
        if not plan:
            schedule_decodes(state, plan)
        return plan


def _whole_prompt(req: Request, num_new: int, budget: int | None) -> int:
    """A prompt is computed whole, within the budget, or waits."""
    return num_new if budget is None or num_new <= budget else 0
