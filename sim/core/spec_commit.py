"""`ReplicaState.commit` with speculative decoding (vLLM's `update_from_output` for a step
that verified drafts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.core.plan import Plan
from sim.core.request import Request, Status

if TYPE_CHECKING:
    from sim.core.state import InFlight, ReplicaState


def drop_padding(req: Request) -> bool:
    """Prefill replica of a disaggregated cluster (it verifies no drafts): vLLM 0.33.0 pads a
    prompt whose prefix hit leaves one token with drafts that cannot be accepted (the
    instance runs its drafter too), so the step computed past the prompt. The padding is
    rejected (`num_computed_tokens` back to the known tokens) and the request samples.
    Returns whether it has caught up (always, as padding covers the last token: a threshold
    below 1 + k is refused with the scenario)."""
    req.spec_padded = False
    num_known = req.num_prompt_tokens + req.num_output_tokens
    if req.num_computed_tokens < num_known:
        return False
    req.num_computed_tokens = num_known
    return True


def commit_speculative(state: ReplicaState, plan: Plan, iteration: int, start_s: float,
                       previous: int) -> list[Request]:
    """Apply `plan`'s iteration: a request that computed past its known tokens verified that
    many drafts; of them the accepted ones (`state.acceptance`) plus one sampled join its
    output, up to its last token (vLLM trims the rest at `max_tokens`), and the rejected
    ones' KV slots are computed again later (`num_computed_tokens -= num_rejected`). A request
    that sampled and goes on gets the plan's drafts for its next step. Returns the requests
    that sampled their last token (the caller lets them leave)."""
    acceptance = state.acceptance
    assert acceptance is not None and not state.prefill_only and not state.pipelined
    requests = state.requests
    num_drafts = plan.num_drafts_proposed
    num_sampled = 0
    done = []
    after_chunk = plan.num_drafts_after_chunk
    for request_id, num_tokens in plan.num_scheduled_tokens.items():
        req = requests[request_id]
        if req.first_scheduled_s is None:
            req.first_scheduled_s = start_s
        req.num_computed_tokens += num_tokens
        # Its drafts were spent by this step, however many it verified (padding or not).
        padded, req.spec_padded = req.spec_padded, False
        num_spec = req.num_computed_tokens - req.num_prompt_tokens - req.num_output_tokens
        if num_spec < 0:  # a prompt's chunk that does not finish it: nothing sampled
            if after_chunk:
                req.num_draft_tokens = after_chunk
                req.spec_padded = True
            continue
        num_accepted = 0
        if num_spec:
            if not padded:
                num_accepted = acceptance.accepted(request_id, req.num_output_tokens, num_spec)
            acceptance.record(num_spec, num_accepted)
            req.num_drafts_verified += num_spec
            req.num_drafts_accepted += num_accepted
            req.num_computed_tokens -= num_spec - num_accepted
        num_new = min(num_accepted + 1, req.num_target_output_tokens - req.num_output_tokens)
        req.num_overshoot_tokens = num_accepted + 1 - num_new
        # Stopped at its last token: vLLM trims the rest, and with them their KV slots
        # ("num_computed_tokens covers all new tokens but the last one").
        req.num_computed_tokens -= num_accepted + 1 - num_new
        req.num_output_tokens += num_new
        req.num_extra_tokens += num_new - 1
        num_sampled += num_new
        if req.last_token_iter >= previous:
            req.last_token_iter = iteration
        else:
            req.record_token(iteration, previous)
        if req.num_output_tokens == req.num_target_output_tokens:
            done.append(req)
        else:  # (an n-gram lookup that finds no match proposes none)
            req.num_draft_tokens = num_drafts if acceptance.matched(
                request_id, req.num_output_tokens) else 0
    state.num_running_tokens += num_sampled
    return done


def start_speculative(state: ReplicaState, plan: Plan, start_s: float,
                      placeholders: bool = True) -> list[InFlight]:
    """`ReplicaState.start` with speculative decoding, on an engine that schedules ahead
    (vLLM's `AsyncScheduler._update_after_schedule`): the plan's tokens count as computed;
    a request the step catches up samples, and its token and the drafts it verifies count as
    output placeholders from now (as if every draft were accepted), and it gets k drafts as
    placeholders for its next step. Each entry's fourth field is 1 + the drafts verified
    where the request samples (negated where those drafts are padding: the entry carries the
    step's `spec_padded`, which a later plan may set again before this step ends), else 0.
    Without `placeholders` (a synchronous data-parallel
    rank, whose next plan is made after this step ends) nothing is sampled until the step
    ends, and the drafts are the plan's, as `commit_speculative` gives them."""
    acceptance = state.acceptance
    assert acceptance is not None and not state.prefill_only
    state.pipelined = True
    state.spec_placeholders = placeholders
    num_drafts = acceptance.num_speculative_tokens
    if plan.num_spec_placeholders is not None:  # (vLLM's: k, or the dynamic schedule's)
        num_drafts = plan.num_spec_placeholders
    after_chunk = 0
    if not placeholders:  # (the drafts come with the step's result: `complete_speculative`)
        state.spec_drafts_proposed, after_chunk = (plan.num_drafts_proposed,
                                                   plan.num_drafts_after_chunk)
    requests = state.requests
    in_flight = []
    for request_id, num_tokens in plan.num_scheduled_tokens.items():
        req = requests[request_id]
        first = req.send_tokens(num_tokens, start_s)
        num_spec = req.num_computed_tokens - req.num_prompt_tokens - req.num_output_tokens
        samples = 0
        entry = 0
        if num_spec >= 0:  # not a prompt's chunk that leaves some of it
            samples = entry = 1 + num_spec
            if req.spec_padded:
                req.spec_padded = False
                entry = -samples
            if placeholders:
                req.num_output_tokens += samples
                req.num_placeholders += samples
                state.num_running_tokens += samples
                req.num_draft_tokens = num_drafts
        elif not placeholders:  # (`commit_speculative`'s drafts after a chunk)
            req.spec_padded = False
            if after_chunk:
                req.num_draft_tokens = after_chunk
                req.spec_padded = True
        in_flight.append((req, num_tokens, req.num_preemptions, entry, first))
    return in_flight


def complete_speculative(state: ReplicaState, in_flight: list[InFlight], end_s: float,
                         stale_delivered: bool) -> tuple[list[Request], list[int]]:
    """`ReplicaState.complete` with speculative decoding (`update_from_output`): of a
    request's placeholders, the rejected drafts are taken back (with their computed slots);
    the accepted ones and the sampled token join its output for good, up to its last token.
    A request preempted since lost its placeholders then; its tokens are still delivered
    where `stale_delivered` (no rejection applied: its counters were reset), and may finish
    it, even from the queue. (A synchronous rank's step counted no placeholders: its tokens
    join the output now.) Returns the requests that left the running list and the ids of
    those that sampled."""
    acceptance = state.acceptance
    assert acceptance is not None
    placeholders = state.spec_placeholders
    done: list[Request] = []
    sampled = []
    offload = state.offload
    for req, num_tokens, num_preemptions, samples, _ in in_flight:
        req.num_in_flight_tokens -= num_tokens
        if (samples and req.status is Status.FINISHED and offload is not None
                and req.request_id in offload.delayed):
            # Finished by an earlier step, its blocks held for its stores to the CPU tier, it
            # is still among vLLM's requests, so this step's output finishes it again
            # (`_free_request`): the worker hears of it once more, at the next step.
            offload.finished_ids.append(req.request_id)
        if not samples or req.status is Status.FAILED or req.status is Status.FINISHED:
            continue  # nothing sampled, aborted, or finished meanwhile: dropped
        padded = samples < 0  # (the step's drafts were padding: `start_speculative`)
        if padded:
            samples = -samples
        num_spec = samples - 1
        stale = req.num_preemptions != num_preemptions
        if stale and not stale_delivered:
            continue
        num_real = req.num_output_tokens - req.num_placeholders
        num_accepted = 0
        if num_spec:
            # (Scheduled ahead, the drafts are placeholders: where the n-gram lookup found
            # no match they are padding, and none is accepted.)
            if not padded and acceptance.matched(req.request_id, num_real):
                num_accepted = acceptance.accepted(req.request_id, num_real, num_spec)
            acceptance.record(num_spec, num_accepted)
        num_new = min(num_accepted + 1, req.num_target_output_tokens - num_real)
        req.num_drafts_verified += num_spec
        req.num_drafts_accepted += num_accepted
        req.num_extra_tokens += num_new - 1
        sampled.append(req.request_id)
        if stale:  # preempted since: its placeholders were dropped then
            _deliver_stale_tokens(state, req, num_new, end_s, done)
            continue
        num_rejected = num_spec - num_accepted
        req.num_overshoot_tokens = num_accepted + 1 - num_new
        req.num_computed_tokens -= num_rejected + req.num_overshoot_tokens  # (and trims)
        # Its placeholders for this step resolve: the rejected ones and any past its last
        # token go; the others are its output now. (Synchronous: none were counted.)
        num_gone = samples - num_new if placeholders else -num_new
        if placeholders:
            req.num_placeholders -= samples
        req.num_output_tokens -= num_gone
        if req.status is Status.RUNNING:
            state.num_running_tokens -= num_gone
            if req.num_output_tokens - req.num_placeholders == req.num_target_output_tokens:
                done.append(req)
            elif not placeholders:  # its next step's drafts, as `commit_speculative` gives them
                drafts = state.spec_drafts_proposed
                req.num_draft_tokens = drafts if acceptance.matched(
                    req.request_id, req.num_output_tokens) else 0
    for req in done:
        # Its later steps in flight are dropped ("The request is already finished").
        state.num_running_tokens -= req.num_placeholders
        req.num_output_tokens -= req.num_placeholders
        req.num_placeholders = 0
        state.finish(req, end_s)
    return done, sampled


def _deliver_stale_tokens(state: ReplicaState, req: Request, num_new: int, end_s: float,
                          done: list[Request]) -> None:
    """Tokens sampled before `req` was preempted come back: they join its output (more
    tokens to compute again), and may be its last."""
    req.num_output_tokens += num_new
    last = req.num_output_tokens - req.num_placeholders == req.num_target_output_tokens
    if req.status is Status.RUNNING:  # admitted again meanwhile
        state.num_running_tokens += num_new
        state.unsettled(req)
        if last:
            done.append(req)
    elif req.status is Status.WAITING:
        state.num_waiting_tokens += num_new
        if last:
            state.finish_from_queue(req, end_s)


def cancel_speculative(state: ReplicaState, in_flight: list[InFlight]) -> None:
    """`ReplicaState.cancel` with speculative decoding: an iteration that never ends takes
    its computed tokens and placeholders back. Newest iteration first."""
    for req, num_tokens, num_preemptions, samples, first in in_flight:
        req.num_in_flight_tokens -= num_tokens
        same = req.num_preemptions == num_preemptions
        if same:
            req.num_computed_tokens -= num_tokens
        else:
            req.num_recomputed_tokens -= num_tokens
        # (A synchronous rank's step counted no placeholders when sent.)
        if samples and same and req.status is Status.RUNNING and state.spec_placeholders:
            samples = abs(samples)  # (negated: padding drafts, `start_speculative`)
            req.num_placeholders -= samples
            req.num_output_tokens -= samples
            state.num_running_tokens -= samples
        if first:
            req.first_scheduled_s = None
