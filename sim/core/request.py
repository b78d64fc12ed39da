"""A request's state as token counters (vLLM v1 naming).

There is no prefill phase and no decode phase: a request holds `num_tokens` known tokens (prompt
plus what it has generated) of which `num_computed_tokens` have KV in the cache. Each iteration
computes some of the rest; when it catches up, one new token is sampled. A decode is a catch-up
of one token.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class Status(enum.Enum):
    WAITING = "waiting"  # queued (new or preempted), holds no KV blocks
    RUNNING = "running"  # admitted, holds KV blocks
    TRANSFERRING = "transferring"  # prefilled on a prefill replica; KV on its way to a decode one
    FINISHED = "finished"
    REJECTED = "rejected"  # can never be served; `reason` says why
    FAILED = "failed"  # aborted by its client (a timeout), its KV freed; `reason` says why


@dataclass(eq=False, slots=True)
class Request:
    request_id: int
    arrival_s: float
    num_prompt_tokens: int
    # Output length taken from the trace: the request stops (as on EOS) after this many tokens.
    num_target_output_tokens: int
    # Prefix-block ids (Mooncake `hash_ids`, or generated): block i stands for tokens
    # [i * hash_block_tokens, (i + 1) * hash_block_tokens) and requests sharing leading ids share
    # that prefix. They may run past the prompt (a generator knows the answer's blocks too).
    hash_ids: tuple[int, ...] | None = None
    hash_block_tokens: int = 0
    # vLLM's request priority (lower is served first under `scheduling_policy: priority`) and
    # the request's class (an index into `workload.classes`; -1: none).
    priority: int = 0
    request_class: int = -1
    # The client's `ignore_eos`: False, its output length is unknown to the engine (it may stop
    # on EOS; SGLang then estimates it, `new_token_ratio`). It still stops after
    # `num_target_output_tokens`. Only the sglang policy reads it.
    ignore_eos: bool = True

    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_output_tokens: int = 0  # tokens sampled so far
    status: Status = Status.WAITING
    reason: str | None = None
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # KV tokens dropped by preemption and computed again
    # Prompt tokens found in the prefix cache when first admitted (vLLM's `num_cached_tokens`).
    num_cached_tokens: int = 0
    # Pipelined or async replica (`ReplicaState.start`): tokens of this request in iterations
    # still in flight (vLLM's `num_in_flight_tokens`: after a preemption, stale ones), and of
    # its outputs, those counted as sampled while their iteration is in flight (placeholders).
    num_in_flight_tokens: int = 0
    num_placeholders: int = 0
    # Speculative decoding (vLLM's `spec_token_ids`): drafts proposed for the next step; that
    # step's drafts are padding that cannot be accepted (`spec_padded`: 0.33.0 pads a decode
    # admitted from the queue); drafts verified and accepted so far; and tokens sampled beyond
    # one per iteration (accepted drafts that joined the output: a token run counts one token
    # per iteration).
    num_draft_tokens: int = 0
    spec_padded: bool = False
    num_drafts_verified: int = 0
    num_drafts_accepted: int = 0
    num_extra_tokens: int = 0
    # Accepted past its last token by its last verification (SGLang keeps their KV: its
    # radix cache takes one of them when the request leaves; vLLM trims them).
    num_overshoot_tokens: int = 0
    replica_id: int = -1  # where it runs now (the decode replica, once transferred)
    prefill_replica_id: int = -1  # where it arrived
    first_scheduled_s: float | None = None
    finish_s: float | None = None
    # The client gives up at `give_up_s` (`workload.timeout_s` after arrival); an answer must
    # leave the engine by `deadline_s` (that, less the API front end) to reach it in time. The
    # engine aborts the request at its first step from its deadline (`ReplicaState.expire`).
    give_up_s: float = math.inf
    deadline_s: float = math.inf
    failed_s: float | None = None  # when its client gave up, once it failed
    # Disaggregated serving: prefill done, KV transfer started (decode blocks reserved) and done.
    prefill_end_s: float | None = None
    transfer_start_s: float | None = None
    transfer_wire_start_s: float | None = None  # when its link began sending (links queue)
    transfer_end_s: float | None = None
    # When its first token reached the client where that is not when it was sampled: SGLang's
    # prefill server sends it with the KV and the decode server streams it when it takes the
    # request in (`ReplicaState.stream_held`); inf while held. None: when sampled.
    first_token_out_s: float | None = None
    # Token times are kept as runs of iteration indices, not one object per token:
    # `token_runs` holds closed (replica_id, first_iter, end_iter) runs; the open run, on
    # `replica_id`, is [run_start_iter, last_token_iter + 1). A run holds a token at its first
    # iteration and at every later one in it in which any request of its replica decoded: it
    # goes on through iterations without decodes (a prefill-first policy's prompts, which
    # pause every decode), and `sim.results.records.token_runs` splits it there.
    token_runs: list[tuple[int, int, int]] = field(default_factory=list)
    run_start_iter: int = -1
    last_token_iter: int = -2

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus output sampled so far."""
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Has sampled at least once and needs exactly one token computed (its last sample)."""
        out = self.num_output_tokens  # `num_tokens` written out: called for every decode
        return out > 0 and self.num_computed_tokens == self.num_prompt_tokens + out - 1

    @property
    def is_caught_up(self) -> bool:
        """Every known token is computed, or scheduled in an iteration still in flight, and the
        next token is not sampled yet: nothing to schedule until that iteration ends. Only a
        pipelined replica, which counts tokens as computed when it schedules them (as vLLM v1
        does) and keeps several iterations in flight, has such requests running."""
        return self.num_computed_tokens == self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_remaining_output_tokens(self) -> int:
        return self.num_target_output_tokens - self.num_output_tokens

    @property
    def num_max_kv_tokens(self) -> int:
        """KV slots the request needs at its largest: the last sampled token is never computed."""
        return self.num_prompt_tokens + self.num_target_output_tokens - 1

    def send_tokens(self, num_tokens: int, start_s: float) -> bool:
        """`num_tokens` of it sent down a pipeline at `start_s` (`ReplicaState.start`):
        computed and in flight from now. Returns whether this is its first iteration."""
        first = self.first_scheduled_s is None
        if first:
            self.first_scheduled_s = start_s
        self.num_computed_tokens += num_tokens
        self.num_in_flight_tokens += num_tokens
        return first

    def record_token(self, iteration: int, since: int | None = None) -> None:
        """Note that this request sampled a token at the end of iteration `iteration`. `since`:
        the last iteration before it in which any request here decoded (default: the one
        before it). The open run goes on unless an iteration with decodes went by without
        a token of this request."""
        if self.last_token_iter < (iteration - 1 if since is None else since):
            self.close_token_run()
            self.run_start_iter = iteration
        self.last_token_iter = iteration

    def decode_steps(self, first_iter: int, num_steps: int, since: int | None = None) -> None:
        """Decoded in `num_steps` consecutive iterations from `first_iter` (a decode stretch):
        one token computed and one sampled in each (`since`: as `record_token`'s)."""
        self.num_computed_tokens += num_steps
        self.num_output_tokens += num_steps
        self.record_token(first_iter, since)
        self.last_token_iter = first_iter + num_steps - 1

    def close_token_run(self) -> None:
        """End the open run (preempted, finished, or moving): the next token opens a new one,
        even if it comes in the very next iteration."""
        if self.run_start_iter >= 0:
            self.token_runs.append((self.replica_id, self.run_start_iter, self.last_token_iter + 1))
            self.run_start_iter = -1
        self.last_token_iter = -2

    def move_to(self, replica_id: int) -> None:
        """Continue on another replica, whose iterations are numbered apart."""
        self.close_token_run()
        self.replica_id = replica_id

    def all_token_runs(self) -> list[tuple[int, int, int]]:
        """Closed runs plus the open one, as (replica_id, first_iter, end_iter)."""
        if self.run_start_iter >= 0:
            return [*self.token_runs,
                    (self.replica_id, self.run_start_iter, self.last_token_iter + 1)]
        return list(self.token_runs)
