"""`ReplicaState`'s steps on a pipelined replica, or one that schedules ahead (vLLM v1's
async scheduling, SGLang's overlap loop: `sim.engine.pipeline`): `start` counts a plan's
tokens as computed when it is sent, `complete` applies its outcome when it leaves the last
stage, `cancel` takes back one that never ends."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.core.plan import Plan
from sim.core.request import Request, Status
from sim.core.spec_commit import (
    cancel_speculative,
    complete_speculative,
    drop_padding,
    start_speculative,
)

if TYPE_CHECKING:
    from sim.core.state import ReplicaState

# A request in a pipelined iteration: it, its tokens there, its preemptions when sent, whether
# it samples at the end (SAMPLES; PLACEHOLDER: and the token counts as sampled already), and
# whether this iteration scheduled it first.
InFlight = tuple[Request, int, int, int, bool]
SAMPLES, PLACEHOLDER = 1, 2


def start_pipelined(state: ReplicaState, plan: Plan, start_s: float, placeholders: bool
                    ) -> list[InFlight]:
    """Pipelined replica: the plan's tokens count as computed from now, when it is sent
    down the pipeline (vLLM v1 advances `num_computed_tokens` when it schedules), so a plan
    built while this one is in flight skips what it computes: a request caught up waits
    for its token; a prompt's next chunk may follow its previous one. Returns what
    `complete` needs when the iteration leaves the last stage.

    With `placeholders` (vLLM's async scheduling, `AsyncScheduler._update_after_schedule`)
    the token a request will sample counts as sampled from now, an output placeholder, so
    the next plan schedules its next decode at once; except its last token, which leaves it
    caught up: vLLM schedules no step past a request's `max_tokens` ("Avoid scheduling an
    extra step", `Scheduler.schedule`), and it finishes when that token comes back."""
    if state.acceptance is not None:
        return start_speculative(state, plan, start_s, placeholders)
    state.pipelined = True
    in_flight: list[InFlight] = []
    append = in_flight.append
    requests = state.requests
    placeholders = placeholders and not state.prefill_only
    num_placeholders = 0
    # (`Request.send_tokens` and `is_caught_up` written out: once per request and step,
    # hundreds a step in a full batch.)
    for request_id, num_tokens in plan.num_scheduled_tokens.items():
        req = requests[request_id]
        first = req.first_scheduled_s is None
        if first:
            req.first_scheduled_s = start_s
        computed = req.num_computed_tokens + num_tokens
        req.num_computed_tokens = computed
        num_output = req.num_output_tokens
        # (A prefill replica drops vLLM 0.33.0's padding at once: the entry, taken back if
        # the step never ends, holds the prompt's tokens only.)
        if (computed != req.num_prompt_tokens + num_output and req.spec_padded
                and drop_padding(req)):
            num_tokens -= computed - req.num_computed_tokens
            computed = req.num_computed_tokens
        req.num_in_flight_tokens += num_tokens
        if computed != req.num_prompt_tokens + num_output:
            samples = 0
        elif placeholders and num_output + 1 < req.num_target_output_tokens:
            samples = PLACEHOLDER
            req.num_output_tokens = num_output + 1
            req.num_placeholders += 1
            num_placeholders += 1
        else:
            samples = SAMPLES
        append((req, num_tokens, req.num_preemptions, samples, first))
    state.num_running_tokens += num_placeholders
    return in_flight


def complete_pipelined(state: ReplicaState, in_flight: list[InFlight], end_s: float,
                       stale_delivered: bool) -> tuple[list[Request], list[int]]:
    """Pipelined replica: the iteration `start` sent off has ended: each request it caught
    up samples its token, as `commit` does. One preempted since has dropped its KV and
    will compute it again; its token counts only where `stale_delivered` (vLLM's async
    scheduling delivers it: `update_from_output`, "Its tokens are still delivered on
    return"), and not on a prefill replica, and it may then finish, even from the queue.
    Returns the requests that left the running list, and the ids of those that sampled (the
    caller records their tokens: `IterationLog.add_sampled`)."""
    if state.acceptance is not None:
        return complete_speculative(state, in_flight, end_s, stale_delivered)
    done: list[Request] = []
    sampled: list[int] = []
    note = sampled.append
    failed = Status.FAILED  # (locals: read for every request of every step)
    for req, num_tokens, num_preemptions, samples, _ in in_flight:
        req.num_in_flight_tokens -= num_tokens
        if req.status is failed:  # aborted meanwhile: its token is dropped
            continue
        if samples == PLACEHOLDER:  # counted when sent: its time is now
            req.num_placeholders -= 1
            if req.num_preemptions != num_preemptions and not stale_delivered:
                take_back(state, req)  # preempted since: the engine drops it
                continue
            note(req.request_id)
            continue
        if not samples or req.status is Status.FINISHED:
            # Finished meanwhile (a stale token delivered was its last): vLLM drops the
            # rest (`update_from_output`: "The request is already finished").
            continue
        if req.num_preemptions != num_preemptions:
            # A prefill replica's first token is only worth its KV, which was dropped: the
            # prompt is computed again and samples again (handed off with no KV, a
            # delivered token would have nothing to transfer).
            if (stale_delivered and not state.prefill_only
                    and req.status is not Status.FINISHED):
                _deliver_stale(state, req, end_s, done)
                sampled.append(req.request_id)
            continue
        if state.prefill_only and state.first_token_dropped:
            done.append(req)  # (its token never reaches the client)
            continue
        req.num_output_tokens += 1
        state.num_running_tokens += 1
        sampled.append(req.request_id)
        if state.prefill_only:
            state._handed_off(req, done)
        elif req.num_output_tokens == req.num_target_output_tokens:
            done.append(req)
    if done:
        state.leave(done, end_s)
    return done, sampled


def cancel_pipelined(state: ReplicaState, in_flight: list[InFlight]) -> None:
    """Pipelined replica: an iteration `start` sent off never ends (the run stopped at its
    horizon): its tokens are not computed, as a step-by-step replica leaves the iteration
    in progress uncommitted; its KV blocks stay allocated. Newest iteration first."""
    if state.acceptance is not None:
        cancel_speculative(state, in_flight)
        in_flight = []
    for req, num_tokens, num_preemptions, samples, first in in_flight:
        req.num_in_flight_tokens -= num_tokens
        if req.num_preemptions == num_preemptions:
            req.num_computed_tokens -= num_tokens
        else:  # preempted since: `preempt` counted these tokens as computed, then dropped
            req.num_recomputed_tokens -= num_tokens
        # (An aborted request's placeholders were dropped when it was aborted.)
        if samples == PLACEHOLDER and req.status is not Status.FAILED:
            req.num_placeholders -= 1
            take_back(state, req)
        if first:  # never scheduled in an iteration that ran
            req.first_scheduled_s = None
    # A placeholder taken back can leave a request short of its prompt again.
    state._maybe_prefilling = [r for r in state.running if not r.is_decoding]


def take_back(state: ReplicaState, req: Request) -> None:
    """An output counted when its iteration was sent never comes: `req` was preempted."""
    req.num_output_tokens -= 1
    if req.status is Status.RUNNING:
        state.num_running_tokens -= 1
        # Admitted again meanwhile, its recompute took that token as input: the token is
        # sampled again, its KV slot computed again (as recomputed work).
        last = req.num_prompt_tokens + req.num_output_tokens - 1
        if req.num_computed_tokens > last:
            req.num_recomputed_tokens += req.num_computed_tokens - last
            req.num_computed_tokens = last
    elif req.status is Status.WAITING:
        state.num_waiting_tokens -= 1


def _deliver_stale(state: ReplicaState, req: Request, end_s: float, done: list[Request]) -> None:
    """A token sampled before `req` was preempted comes back: it joins its output (one
    more token to compute again), and may be its last."""
    req.num_output_tokens += 1
    last = req.num_output_tokens == req.num_target_output_tokens
    if req.status is Status.RUNNING:  # admitted again meanwhile
        state.num_running_tokens += 1
        state.unsettled(req)
        if last:
            done.append(req)
    elif req.status is Status.WAITING:
        state.num_waiting_tokens += 1
        if last:
            state.finish_from_queue(req, end_s)
