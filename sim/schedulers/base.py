"""The scheduler interface and the steps every policy shares.

A scheduler is a pure policy: `schedule(state, now_s) -> Plan` decides one iteration and allocates
its KV blocks (as vLLM's does); the replica state's `commit` applies it once the iteration has run.
No SimPy, no clock, no torch here: the same objects can drive a real executor. `schedule` is the
same for every policy: it asks the policy (`decide`) and checks what came back (the budget, the
running limit, free blocks; with `checks(True)`, as the property tests run, every invariant of
the state, every step).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Literal, final

from pydantic import BaseModel, Field

from sim.config.errors import INPUT_MODEL
from sim.core.kv_cache import KVCacheManager
from sim.core.plan import Plan
from sim.core.registry import Registry
from sim.core.request import Request, Status
from sim.core.state import ReplicaState
from sim.core.waiting import PriorityWaiting, priority_key
from sim.schedulers.admission import future_blocks, reserved_blocks

if TYPE_CHECKING:
    from sim.hardware.gpus import GPUSpec


class SchedulerConfig(BaseModel):
    """Parameters shared by every scheduler; each scheduler's config extends this."""

    model_config = INPUT_MODEL
    # Whether the engine keeps a prefix cache unless told not to (`ReplicaConfig.
    # prefix_caching` left unset): off for the generic policies.
    prefix_caching_default: ClassVar[bool] = False

    name: str
    max_num_seqs: int = Field(256, gt=0, description="most requests running at once",
                              json_schema_extra={"unit": "requests"})
    decode_reserve_tokens: int | None = Field(
        None,
        ge=0,
        description=(
            "KV slots kept free per running request for its future tokens when admitting new "
            "work. None reserves all of them (Mini-SGLang's rule: no preemption if output "
            "lengths are right); 0 reserves none (vLLM v1: admit while blocks last, preempt later)."
        ),
    )

    def kv_block_problems(self, block_size: int) -> list[tuple[str, Any, str]]:
        """What these settings cannot be run with on KV blocks of `block_size` tokens: (a
        field of these settings, or `kv_cache.block_size`, its value, why). None by
        default."""
        return []

    @classmethod
    def for_gpu(cls, data: dict[str, Any], gpu: GPUSpec, context_len: int | None = None
                ) -> dict[str, Any]:
        """The scheduler's settings as given, with the defaults the engine picks by the GPU it
        runs on (and the model's context window, where known) filled in (before
        validation). As given by default."""
        return data

    @classmethod
    def for_model(cls, data: dict[str, Any], model_type: str | None) -> dict[str, Any]:
        """The scheduler's settings as given, with the defaults the engine picks by the model
        it serves (its config.json's `model_type`, None where not known) filled in (before
        validation). As given by default."""
        return data

    @classmethod
    def for_pipeline(cls, data: dict[str, Any], pipeline_size: int) -> dict[str, Any]:
        """The scheduler's settings as given, with the defaults that depend on the replica's
        pipeline size filled in (before validation); also where a setting cannot be had with
        that split. As given by default."""
        return data

    @classmethod
    def page_size(cls, data: dict[str, Any], gpu: GPUSpec | None, mla: bool) -> int | None:
        """The KV block size (page) the engine picks for these settings on `gpu` (for a model
        with DeepSeek's latent attention, `mla`) where `kv_cache.block_size` is not given;
        None: `KVCacheConfig`'s (vLLM's 16)."""
        return None

    @classmethod
    def page_refused(cls, data: dict[str, Any], gpu: GPUSpec | None, mla: bool,
                     block_size: int) -> str | None:
        """Why the engine would not run with the KV block size given (it would take another),
        or None."""
        return None

    @property
    def derives_from_kv(self) -> bool:
        """Whether a default is left for the engine to derive from its KV pool (`for_kv`):
        known only once the pool is sized, after validation. None by default."""
        return False

    def for_kv(self, num_kv_tokens: int, context_len: int | None, num_ranks: int = 1
               ) -> SchedulerConfig:
        """These settings with the defaults the engine derives from its KV pool
        (`num_kv_tokens` token slots, one rank's of `num_ranks` data-parallel ones) and
        context window filled in. As given by default."""
        return self

    def for_rank(self, num_ranks: int) -> SchedulerConfig:
        """The settings one of `num_ranks` data-parallel ranks schedules by, where the engine
        splits the replica's among them. As given by default (vLLM's are per engine core)."""
        return self


class Scheduler(ABC):
    """Decides, iteration by iteration, which requests compute how many tokens."""

    Config: ClassVar[type[SchedulerConfig]] = SchedulerConfig
    # Which unused cached prefixes go first when prefix caching needs room (see
    # `sim.core.radix_cache`): vLLM's block LRU unless the policy's engine does otherwise.
    prefix_cache_eviction: Literal["lru_block", "fifo_block", "lru_leaf"] = "lru_block"
    # KV blocks of the cache given (or sized from memory) that the engine never allocates.
    num_null_blocks: ClassVar[int] = 0
    # Whether the engine may run a stretch of iterations without asking for each plan (the
    # fast path, `sim.engine.fastpath.stretch`): not for a policy that must see every iteration end.
    allows_stretches: bool = True
    # Whether a token sampled before its request was preempted still joins its output when
    # its iteration ends (vLLM: "still delivered"), rather than being dropped (SGLang).
    delivers_stale_tokens: ClassVar[bool] = False
    # Prefilling for a disaggregated cluster, what becomes of the first token the engine
    # samples: it reaches the client ("client"); it is dropped and the decode side samples it
    # again (vLLM: "dropped"); it goes with the KV and the decode side streams it when it
    # takes the request in (SGLang: "held", `ReplicaState.stream_held`).
    prefill_first_token: ClassVar[Literal["client", "dropped", "held"]] = "client"
    # Whether `decide` reads `now_s`. None of the engines' policies does; one that does is
    # asked at every iteration (no stretch: a stretch repeats one plan over many instants).
    reads_clock: ClassVar[bool] = False

    def __init__(self, config: SchedulerConfig, *, max_model_len: int | None = None) -> None:
        self.config = config
        # The model's context window on this replica (prompt plus output); None: no limit.
        self.max_model_len = max_model_len

    def num_batches_in_flight(self, pipeline_size: int) -> int:
        """Iterations the engine keeps in flight on a replica of `pipeline_size` stages (one
        per stage: `sim.engine.pipeline`); more where the engine schedules ahead (async)."""
        return pipeline_size

    def waiting_queue(self, pool: str = "colocated") -> PriorityWaiting | None:
        """The waiting queue of this policy's replica in `pool` (`colocated`, `prefill` or
        `decode`): vLLM's priority order with `by_priority`, or the policy's own
        (`sim.core.waiting`); None: FCFS."""
        return PriorityWaiting() if self.by_priority else None

    def transfer_order(self, req: Request) -> tuple[float, ...] | None:
        """Decode side of a disaggregated cluster: where `req`, waiting for KV blocks here,
        goes in that queue (sorted by this, ties in the order they came); None: in the order
        they came. vLLM's decode side puts a request whose KV is remote in its waiting queue
        like any other: by `priority_key` under its priority policy."""
        return priority_key(req) if self.by_priority else None

    @property
    def by_priority(self) -> bool:
        """Whether the policy orders its waiting queue, and chooses whom to preempt, by the
        requests' priorities (vLLM's `--scheduling-policy priority`; `sim.core.waiting`).
        A policy that does not serves them in arrival order, as vLLM's FCFS does (it accepts
        a request's priority and ignores it); the run says so."""
        return False

    @property
    def output_placeholders(self) -> bool:
        """Whether a request may be scheduled again while the token it samples is in flight
        (vLLM's async scheduling: an output placeholder), rather than wait for it."""
        return False

    def iteration_ended(self, plan: Plan) -> None:  # noqa: B027  (a hook: most need none)
        """The iteration of `plan` has ended and its outcome is committed to the state (a
        policy wrapping an engine's scheduler feeds the engine its output here)."""

    def decodes_repeated(self, num_plans: int) -> None:  # noqa: B027  (a hook)
        """The engine made `num_plans` plans of a stretch (`sim.engine.fastpath`) without
        asking, each giving every running request one decode token, as `decide` would have
        made them. A policy whose own state moves at every such plan (SGLang's new-token
        ratio) moves it here; most need nothing."""

    def requests_aborted(self, requests: list[Request]) -> None:  # noqa: B027  (a hook)
        """`requests` were aborted (their client timed out: `ReplicaState.expire`) and have
        left the state, their KV freed (a policy wrapping an engine's scheduler aborts them
        there too)."""

    @final
    def schedule(self, state: ReplicaState, now_s: float) -> Plan:
        """The next iteration's plan (`decide`), checked: no more tokens than the policy's
        `max_num_scheduled_tokens`, no more requests running than `max_num_seqs`, free KV
        blocks not negative; with `checks(True)`, every scheduled request running (once: a plan
        maps each to its tokens) and given some, and `ReplicaState.check`. (A request preempted
        while the plan was built may be in it again: vLLM re-plans after preempting everyone.)"""
        if state.held:  # (before the pass: SGLang takes them in as it schedules)
            state.stream_held(now_s)
        plan = self.decide(state, now_s)
        budget = self.max_num_scheduled_tokens
        assert budget is None or plan.total_num_scheduled_tokens <= budget, (
            f"{type(self).__name__} scheduled {plan.total_num_scheduled_tokens} tokens, "
            f"more than {budget}")
        # (A request whose KV is on its way holds its slot: `admit_transfer`.)
        num_seqs = len(state.running) + len(state.incoming)
        assert num_seqs <= self.config.max_num_seqs, (
            f"{type(self).__name__} runs {num_seqs} requests (with those on their way), more "
            f"than max_num_seqs {self.config.max_num_seqs}")
        assert state.kv.num_free_blocks >= 0
        if _checks[0]:
            running = {req.request_id for req in state.running}
            assert running.issuperset(plan.num_scheduled_tokens), "a request scheduled not running"
            assert all(n > 0 for n in plan.num_scheduled_tokens.values())
            state.check()
        return plan

    @property
    def max_num_scheduled_tokens(self) -> int | None:
        """The most tokens one iteration may compute under this policy (None: no bound)."""
        return None

    @abstractmethod
    def decide(self, state: ReplicaState, now_s: float) -> Plan:
        """Build the next iteration's plan; allocate its KV blocks; preempt if it must. A policy
        that reads `now_s` must say so (`reads_clock`): it is then asked at every iteration.

        The fast path (`sim.engine.fastpath.stretch.is_steady`) asks one thing of a policy, which
        every engine's does: while nothing waits and the running requests stay the same, with blocks
        for them, a plan that gives every running request its tokens is repeated: each decode
        its one token, and a prompt cut into chunks the same chunk again until what is left of
        it is less."""

    def reject_reason(self, req: Request, kv: KVCacheManager, num_kv_tokens: int) -> str | None:
        """Why `req`, needing `num_kv_tokens` KV slots at most, can never be served on a replica
        with this KV cache; None if it can."""
        return self.context_reason(req) or self.capacity_reason(kv, num_kv_tokens)

    def capacity_reason(self, kv: KVCacheManager, num_kv_tokens: int) -> str | None:
        """Why a request needing `num_kv_tokens` KV slots at most never fits this replica; a
        policy whose iterations bound a prefill adds that bound here."""
        if num_kv_tokens > kv.capacity_tokens:
            return (f"kv_capacity: needs {num_kv_tokens} KV slots, a replica holds "
                    f"{kv.capacity_tokens}")
        return None

    def context_reason(self, req: Request) -> str | None:
        """Why `req` exceeds the model's context window; None if it fits. vLLM refuses a request
        whose prompt plus max_tokens exceeds max_model_len."""
        limit = self.max_model_len
        if limit is not None and req.num_prompt_tokens + req.num_target_output_tokens > limit:
            return (f"max_model_len: prompt {req.num_prompt_tokens} + output "
                    f"{req.num_target_output_tokens} tokens exceed max_model_len {limit}")
        return None

    @property
    def decode_reserves_first(self) -> bool:
        """Decode side of a disaggregated cluster: whether it preallocates a request's KV
        before the request's prefill may start (SGLang's bootstrap), rather than once it has
        ended (`admit_transfer` then allocates the blocks its prompt will fill)."""
        return False

    @property
    def admits_transfers_between_finishes(self) -> bool:
        """Decode side: whether a transfer refused now may be taken after a decode step with
        no finish (SGLang's preallocation counts the tokens running requests hold), not only
        once a finish frees room: a replica then steps while one waits."""
        return False

    def transfer_reason(self, kv: KVCacheManager, req: Request) -> str | None:
        """Why a decode replica with this KV cache could never take `req` in by transfer
        (beyond `reject_reason`); None if it could."""
        return None

    def admit_transfer(self, state: ReplicaState, req: Request) -> bool | None:
        """Decode side of a disaggregated cluster: take `req`, whose prompt KV is to arrive by
        transfer, now? If so, allocate blocks for its prompt and return True (the caller then
        counts it in `state.incoming`). Called on the requests waiting for a decode slot in
        their order (`transfer_order`), until one is refused.

        The default is this policy's admission rule for a prompt already computed: a running
        slot (`max_num_seqs`, counting the requests on their way) and blocks for the prompt
        beside `decode_reserve_tokens` of future tokens for every request here and on its way
        (vLLM v1, reserving 0, allocates while blocks last; Mini-SGLang reserves every future
        token).

        With a CPU tier (vLLM's offloading connector beside the transfer one) the tier is
        looked up first (`remote_lookup`): None skips `req` this time, those behind it may be
        taken."""
        if len(state.running) + len(state.incoming) >= self.config.max_num_seqs:
            return False
        offload = state.offload
        if offload is not None and not offload.remote_lookup(state, req):
            return None
        cap = self.config.decode_reserve_tokens
        reserve = reserved_blocks(state, cap)
        reserve += sum(future_blocks(state, r, cap) for r in state.incoming.values())
        own_future = future_blocks(state, req, cap) - state.kv.num_blocks_to_grow(req, 0)
        if not state.kv.try_allocate(req, 0, reserve + own_future):
            return False
        if offload is not None:
            offload.remote.add(req.request_id)
        return True


SCHEDULERS: Registry[type[Scheduler]] = Registry("scheduler", "sim.schedulers", "SCHEDULERS")

# Whether `Scheduler.schedule` checks every invariant of the state after every plan (slow: the
# property tests turn it on; `SERVESIM_CHECKS=1` does too).
_checks = [os.environ.get("SERVESIM_CHECKS") == "1"]


def checks(on: bool | None = None) -> bool:
    """Whether full checks run after every plan; `on` turns them on or off. Returns the setting
    before."""
    before = _checks[0]
    if on is not None:
        _checks[0] = on
    return before


def schedule_decodes(state: ReplicaState, plan: Plan) -> list[Request]:
    """Give every decoding running request its one token, oldest first; return the running
    requests that are still prefilling (with tokens left to schedule).

    When a decode cannot get a block, the newest running request is preempted by recompute
    (vLLM's rule), possibly the decode itself.
    """
    kv = state.kv
    block_size = kv.block_size
    scheduled = plan.num_scheduled_tokens
    # The running requests not in `prefilling` decode (or, pipelined, wait for a token in
    # flight): told apart by identity with the next prefilling one, in running order, so this
    # loop, which runs for every request every iteration, asks no request what it is.
    prefilling = state.prefilling()
    ahead = iter(prefilling)
    following = next(ahead, None)
    pipelined = state.pipelined
    running = Status.RUNNING  # a local: read for every request
    for req in list(state.running):
        if req is following:
            following = next(ahead, None)
            continue
        if req.status is not running:
            continue  # preempted by an earlier decode of this loop
        computed = req.num_computed_tokens
        if pipelined and computed == req.num_prompt_tokens + req.num_output_tokens:
            continue  # caught up, its token in flight: nothing to compute (`is_caught_up`)
        # A block is needed only when the computed tokens exactly fill the blocks held.
        while computed % block_size == 0 and not kv.try_allocate(req, 1):
            victim, _ = preempt_newest(state, plan.preempted_ids, scheduled)
            if victim is req:
                break
        else:
            scheduled[req.request_id] = 1
    return [req for req in prefilling if req.status is running]


def preempt_newest(state: ReplicaState, preempted: list[int],
                   scheduled: dict[int, int] | None = None) -> tuple[Request, int]:
    """Preempt the newest running request by recompute (vLLM's victim, and SGLang's as
    modelled here), note it in `preempted` and take its tokens out of `scheduled`; return it
    and those tokens. The one preemption rule every FCFS policy shares."""
    victim = state.running[-1]
    return victim, preempt(state, victim, preempted, scheduled)


def lowest_priority(state: ReplicaState) -> Request:
    """The victim of vLLM's priority policy: the running request of the highest priority
    value, the latest arrival among those, the first such in running order
    (`max(self.running, key=lambda r: (r.priority, r.arrival_time))`), wherever it runs."""
    return max(state.running, key=_victim_key)


def _victim_key(req: Request) -> tuple[int, float]:
    return (req.priority, req.arrival_s)


def preempt(state: ReplicaState, victim: Request, preempted: list[int],
            scheduled: dict[int, int] | None = None, *, to_back: bool = False) -> int:
    """Preempt `victim` by recompute, note it in `preempted` and take its tokens scheduled in
    this plan back out of `scheduled`; return those tokens. `to_back`: it waits behind the
    queue (SGLang's retraction), not at its front."""
    num_tokens = scheduled.pop(victim.request_id, 0) if scheduled is not None else 0
    preempted.append(victim.request_id)
    state.preempt(victim, to_back=to_back)
    return num_tokens


def any_in_flight(state: ReplicaState) -> bool:
    """Whether a running request waits for an iteration in flight on a pipeline: an empty plan
    then means nothing to do until it ends, not that KV ran out (no preemption is due)."""
    if state.acceptance is not None:  # speculative: a request in flight is not caught up
        return any(req.num_in_flight_tokens for req in state.running)
    return any(req.is_caught_up for req in state.running)
