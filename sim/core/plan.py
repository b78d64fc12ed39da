"""The plan of one iteration: which requests run, and how many tokens each computes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sim.core.offload import Transfers
    from sim.core.offload_jobs import JobTransfers


@dataclass(slots=True)
class Plan:
    """What a scheduler decided for one iteration (cf. vLLM v1 `SchedulerOutput`).

    Whether a request's tokens are prefill or decode is not stored: it falls out of the request's
    `num_computed_tokens` catching up with its `num_tokens`.
    """

    # request_id -> tokens computed this iteration, in scheduling order.
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)
    # requests preempted (by recompute) while this plan was built, newest first.
    preempted_ids: list[int] = field(default_factory=list)
    # Speculative decoding: drafts each request that samples in this iteration gets for its
    # next (vLLM's drafter proposes `num_speculative_tokens`, or none where it skips).
    num_drafts_proposed: int = 0
    # ... and each request whose prompt chunk does not finish it (vLLM 0.15.1's padded
    # drafter batch proposes for those too; nothing is sampled, so none can be accepted).
    num_drafts_after_chunk: int = 0
    # ... and the placeholders for its drafts that a step scheduled ahead of this one's end
    # verifies (async scheduling: whether the drafter runs or not); None: k.
    num_spec_placeholders: int | None = None
    # Whether the drafter runs after it though it proposes none (vLLM's dynamic k of 0: its
    # first pass keeps the drafter's KV in step).
    drafter_runs: bool = False
    # With a CPU tier for the KV cache (vLLM's offloading connector, `sim.core.offload`): the
    # copies this step starts, and the requests finished since the last plan (the worker
    # learns of them with this step: `finished_req_ids`).
    transfers: Transfers | JobTransfers | None = None
    finished_ids: list[int] | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def num_seqs(self) -> int:
        return len(self.num_scheduled_tokens)

    def __bool__(self) -> bool:
        return bool(self.num_scheduled_tokens)
