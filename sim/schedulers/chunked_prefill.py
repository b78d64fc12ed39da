"""Sarathi-Serve's stall-free batching: decodes first, then partial prefills, then new requests,
all within a per-iteration token budget.

How it differs from `vllm_v1` (vLLM's own unified scheduler): here every running decode is
guaranteed its token before any prefill (Sarathi-Serve's "stall-free" promise, so
`max_num_seqs` may not exceed the budget), a prompt's chunk is capped by `chunk_size`, and new
work is admitted only while blocks for running requests' future tokens stay free
(`decode_reserve_tokens`, default all of them); `vllm_v1` walks running requests in order with
one budget (an unfinished prefill may take it before later decodes), reserves nothing, and
preempts when blocks run out.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from sim.config.errors import invalid
from sim.core.plan import Plan
from sim.core.request import Request
from sim.core.state import ReplicaState
from sim.schedulers.admission import admit_waiting
from sim.schedulers.base import (
    SCHEDULERS,
    Scheduler,
    SchedulerConfig,
    any_in_flight,
    preempt_newest,
    schedule_decodes,
)


class ChunkedPrefillConfig(SchedulerConfig):
    token_budget: int = Field(512, gt=0, description="most tokens (prefill + decode) an iteration",
                              json_schema_extra={"unit": "tokens"})
    chunk_size: int | None = Field(None, gt=0, description="largest prefill chunk; default budget",
                                     json_schema_extra={"unit": "tokens"})
    max_num_partial_prefills: int = Field(1, gt=0, description="requests prefilling at once",
                                          json_schema_extra={"unit": "requests"})
    min_chunk_tokens: int | None = Field(
        None, gt=0,
        description="smallest chunk that does not finish its prompt (background 002's "
                    "min_chunk_size): a smaller one waits for the next iteration")

    @model_validator(mode="before")
    @classmethod
    def _default_max_num_seqs(cls, data: Any) -> Any:
        # Unless given, as many running requests as the budget has room for decodes (at most
        # vLLM's 256), so that small budgets (Sarathi-Serve sweeps down to 128) just work.
        if isinstance(data, dict) and "max_num_seqs" not in data:
            budget = data.get("token_budget", 512)
            if type(budget) is int and budget > 0:  # not a bool: strict validation refuses it
                data = {**data, "max_num_seqs": min(256, budget)}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ChunkedPrefillConfig:
        problems = []
        # Stall-free batching promises every running decode a slot in every iteration.
        if self.max_num_seqs > self.token_budget:
            problems.append(("max_num_seqs", self.max_num_seqs, f"must not exceed token_budget "
                             f"({self.token_budget}), or some decodes would stall"))
        # A chunk never exceeds what is left of the budget: a larger chunk_size would be ignored.
        if self.chunk_size is not None and self.chunk_size > self.token_budget:
            problems.append(("chunk_size", self.chunk_size,
                             f"must not exceed token_budget ({self.token_budget})"))
        # A minimum above the largest chunk would keep every long prompt waiting forever.
        largest = self.chunk_size or self.token_budget
        if self.min_chunk_tokens is not None and self.min_chunk_tokens > largest:
            problems.append(("min_chunk_tokens", self.min_chunk_tokens,
                             f"must not exceed the largest chunk ({largest})"))
        if problems:
            raise invalid(*problems)
        return self


@SCHEDULERS.register("chunked_prefill")
class ChunkedPrefill(Scheduler):
    """Every running decode gets its token; the rest of the budget goes to prefill chunks, first
    to requests already part-way through their prompt, then to new ones (FCFS). A request samples
    its first token only at the end of its last chunk."""

    Config = ChunkedPrefillConfig
    config: ChunkedPrefillConfig

    @property
    def max_num_scheduled_tokens(self) -> int | None:
        return self.config.token_budget

    def decide(self, state: ReplicaState, now_s: float) -> Plan:
        preempted: list[int] = []
        while True:
            plan = self._build(state)
            preempted += plan.preempted_ids
            if plan or not state.running or any_in_flight(state):
                plan.preempted_ids = preempted
                return plan
            # Partial prefills hold all the blocks and none can grow: free the newest.
            preempt_newest(state, preempted)

    def _build(self, state: ReplicaState) -> Plan:
        cfg = self.config
        chunk_size = cfg.chunk_size or cfg.token_budget
        plan = Plan()
        prefilling = schedule_decodes(state, plan)
        budget = cfg.token_budget - plan.num_seqs

        num_partial = len(prefilling)
        for req in prefilling:  # continue partial prefills where they stopped
            num_tokens = min(req.num_uncomputed_tokens, chunk_size, budget)
            if self._too_small(num_tokens, req.num_uncomputed_tokens):
                continue
            if num_tokens > 0 and state.kv.try_allocate(req, num_tokens):
                plan.num_scheduled_tokens[req.request_id] = num_tokens
                budget -= num_tokens

        def chunk(req: Request, num_new: int, budget: int | None) -> int:
            nonlocal num_partial
            assert budget is not None
            num_tokens = min(num_new, chunk_size, budget)
            partial = num_tokens < num_new
            if partial and (num_partial >= cfg.max_num_partial_prefills
                            or self._too_small(num_tokens, num_new)):
                return 0
            num_partial += partial
            return num_tokens

        admit_waiting(state, plan, budget, cfg.max_num_seqs, cfg.decode_reserve_tokens, chunk)
        return plan

    def _too_small(self, num_tokens: int, num_uncomputed: int) -> bool:
        """A chunk below `min_chunk_tokens` that does not finish its prompt waits."""
        least = self.config.min_chunk_tokens
        return least is not None and num_tokens < min(least, num_uncomputed)
