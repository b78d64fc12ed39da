"""What one replica holds: its queues and KV cache, and the mechanics of applying a plan.

Schedulers read and update this state through `preempt` and the KV manager; `commit` applies the
outcome of an iteration once the engine says it has ended. Nothing here knows about time sources.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from sim.core.kv_cache import KVCacheManager, cdiv
from sim.core.offload_jobs import JobOffloadState
from sim.core.pipeline_commit import (
    PLACEHOLDER,
    SAMPLES,
    InFlight,
    cancel_pipelined,
    complete_pipelined,
    start_pipelined,
)
from sim.core.plan import Plan
from sim.core.request import Request, Status
from sim.core.spec_commit import commit_speculative, drop_padding
from sim.core.speculative import Acceptance
from sim.core.state_check import check_state
from sim.core.waiting import PriorityWaiting

if TYPE_CHECKING:
    from sim.core.offload import OffloadState

__all__ = ["PLACEHOLDER", "SAMPLES", "InFlight", "ReplicaState"]


class ReplicaState:
    """Waiting queue (FCFS, preempted at the front; or by priority), running list, KV."""

    def __init__(self, kv: KVCacheManager, prefill_only: bool = False,
                 decode_only: bool = False, by_priority: bool = False,
                 waiting: PriorityWaiting | None = None) -> None:
        self.kv = kv
        # A prefill replica of a disaggregated cluster: a request leaves `running` after its
        # first token, keeping its KV blocks until the transfer to a decode replica is done.
        self.prefill_only = prefill_only
        # ... whose first token the client never gets (vLLM's disaggregated prefill: the
        # prefill request's `max_tokens=1` answer is dropped, and the decode side computes the
        # prompt's last token again to sample it: `join`).
        self.first_token_dropped = False
        # ... or whose first token goes with the KV, held until the decode side takes the
        # request in and streams it (SGLang: `stream_held`).
        self.first_token_held = False
        # A decode replica of one: requests join `running` as their KV arrives (`join`).
        self.decode_only = decode_only
        # By priority (vLLM's priority policy, or the policy's own queue: `sim.core.waiting`),
        # else FCFS.
        self.waiting: deque[Request] | PriorityWaiting = (
            waiting if waiting is not None else PriorityWaiting() if by_priority else deque())
        self.running: list[Request] = []
        # Decode side: requests joined with their first token held, not yet taken in.
        self.held: list[Request] = []
        self.num_transferring = 0  # handed off, KV still held here
        # Decode side: requests whose blocks are allocated here and whose KV is on its way.
        self.incoming: dict[int, Request] = {}
        self.requests: dict[int, Request] = {}  # every request this replica has held
        # Kept as requests move, so a router reads a replica's load without a pass over its
        # queues (`check` recounts them): tokens still to compute of the waiting requests, and
        # known tokens (prompt plus output) of the running ones.
        self.num_waiting_tokens = 0
        self.num_running_tokens = 0
        # Blocks the running requests need at their largest (`num_kv_tokens_needed`), summed:
        # what a full reservation keeps for them is this less what they hold
        # (`sim.schedulers.admission.reserved_blocks`, at every iteration where requests wait).
        self.num_running_max_blocks = 0
        # Running requests that may have prompt tokens left: those that joined before their
        # prompt was computed, in running order, pruned as they catch up (`prefilling`). A
        # running request that decodes never prefills again (preempted, it leaves and joins
        # anew), so a policy finds its chunked requests without a pass over every decode.
        self._maybe_prefilling: list[Request] = []
        # Whether iterations run on a pipeline (`start` / `complete`): only then can a running
        # request be caught up, its token in flight. Elsewhere every running request that is
        # not `prefilling()` decodes, which the policies' loops over the running requests and
        # `BatchShape.of_replica` use instead of asking each request (`check` asserts it).
        self.pipelined = False
        # Requests here that may time out, by deadline (`expire`): (deadline_s, request_id,
        # request), pushed when a request joins a queue; stale entries (finished, handed on)
        # are dropped when they come up.
        self._deadlines: list[tuple[float, int, Request]] = []
        # Told of each request that finishes here, as its finish is committed (closed-loop
        # clients send their next request then: `sim.engine.clients`).
        self.on_finish: Callable[[Request], None] | None = None
        # Speculative decoding: how many drafts each verification accepts (None: off; so on
        # a prefill replica, whose scheduler may still hold KV slots for drafts: `drafting`).
        self.acceptance: Acceptance | None = None
        self.drafting = False
        # A pipelined replica's steps' samples count as output placeholders when sent (async
        # scheduling); False for a synchronous data-parallel rank's, applied when they end.
        self.spec_placeholders = True
        self.spec_drafts_proposed = 0  # (the last such step's plan's drafts)
        # The KV cache's CPU tier (None: off): requests may wait in the queue holding blocks
        # while their KV is copied in, and a finished one's blocks may wait for its stores.
        self.offload: OffloadState | JobOffloadState | None = None

    def num_kv_tokens_needed(self, req: Request) -> int:
        """KV slots `req` needs here at its largest: its prompt on a prefill replica."""
        return req.num_prompt_tokens if self.prefill_only else req.num_max_kv_tokens

    def max_blocks(self, req: Request) -> int:
        """KV blocks `req` needs here at its largest."""
        return cdiv(self.num_kv_tokens_needed(req), self.kv.block_size)

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        req.status = Status.WAITING
        self.waiting.append(req)
        self.num_waiting_tokens += req.num_uncomputed_tokens
        self._watch_deadline(req)

    def admit(self, req: Request, num_cached_tokens: int = 0, index: int = 0) -> None:
        """Move the head of the waiting queue (or its `index`-th request, those before it
        waiting for KV from the CPU tier) to the running list (its blocks are allocated); its
        first `num_cached_tokens` came from the prefix cache and count as computed."""
        assert self.waiting[index] is req
        if index:
            self.waiting.remove(req)
        else:
            self.waiting.popleft()
        self.num_waiting_tokens -= req.num_uncomputed_tokens
        if num_cached_tokens:
            req.num_computed_tokens += num_cached_tokens
            if not req.num_preemptions:  # vLLM reports the hit of the first admission
                req.num_cached_tokens = num_cached_tokens
        self._start_running(req)

    def join(self, req: Request, now_s: float) -> None:
        """Decode side: `req`, prefilled elsewhere, has its KV here (at `now_s`) and runs from
        now on. Without its first token (`first_token_dropped` there) it computes the prompt's
        last token again to sample it, as vLLM's decode side does with a whole prompt loaded
        (`Scheduler._update_waiting_for_remote_kv`); with its first token held, the next pass
        streams it (`stream_held`), but for a request that asked for one token: it finishes
        as its KV lands (SGLang finishes it at that pass: a step sooner at most, and the room
        it frees is seen at once, as SGLang sees it at its next pass's preallocation)."""
        del self.incoming[req.request_id]
        if not req.num_output_tokens and req.num_computed_tokens == req.num_prompt_tokens:
            req.num_computed_tokens -= 1
        self.requests[req.request_id] = req
        self._start_running(req)
        if req.first_token_out_s != math.inf:
            self._watch_deadline(req)
        elif req.num_output_tokens == req.num_target_output_tokens:
            req.first_token_out_s = now_s
            self.finish(req, now_s)
        else:
            self._watch_deadline(req)
            self.held.append(req)

    def stream_held(self, now_s: float) -> None:
        """The decode side's pass at `now_s` takes in the requests whose KV has landed and
        streams the first token their prefill replica sent with it (SGLang's prebuilt batch,
        `process_batch_result_prebuilt`)."""
        for req in self.held:
            if req.status is Status.RUNNING:  # (else aborted meanwhile: never streamed)
                req.first_token_out_s = now_s
        self.held.clear()

    def _watch_deadline(self, req: Request) -> None:
        """`req` may time out here (`expire`)."""
        if req.deadline_s != math.inf:
            heapq.heappush(self._deadlines, (req.deadline_s, req.request_id, req))

    def _start_running(self, req: Request) -> None:
        """`req` joins the running list, and the counts kept of it (`check`)."""
        req.status = Status.RUNNING
        self.running.append(req)
        self.num_running_tokens += req.num_tokens
        self.num_running_max_blocks += self.max_blocks(req)
        if not req.is_decoding:
            self._maybe_prefilling.append(req)

    def _stop_running(self, req: Request) -> None:
        """`req` leaves the running list, and the counts kept of it."""
        self.running.remove(req)
        self.num_running_tokens -= req.num_tokens
        self.num_running_max_blocks -= self.max_blocks(req)
        if req in self._maybe_prefilling:  # (by identity: `Request` compares so)
            self._maybe_prefilling.remove(req)

    def unsettled(self, req: Request) -> None:
        """`req`, running, got tokens it has not computed (a stale step's, delivered after it
        was admitted again): if it no longer decodes, it joins `prefilling`'s candidates, in
        running order."""
        maybe = self._maybe_prefilling
        if req.is_decoding or any(r is req for r in maybe):
            return
        keep = {id(r) for r in maybe}
        keep.add(id(req))
        self._maybe_prefilling = [r for r in self.running if id(r) in keep]

    def prefilling(self) -> list[Request]:
        """Running requests with prompt tokens left to schedule, in running order: neither
        decoding nor, on a pipelined replica, caught up (their last chunk in flight). Every
        other running request decodes, unless the replica is `pipelined`: a loop over the
        running requests tells the two apart by identity with this list's next one, without
        asking each request (one definition, `Request.is_decoding`, kept here)."""
        maybe = self._maybe_prefilling
        if not maybe:
            return []
        self._maybe_prefilling = maybe = [r for r in maybe if not r.is_decoding]
        if not self.pipelined:  # none is caught up
            return list(maybe)  # (a copy: the caller may preempt, which edits the kept list)
        return [r for r in maybe if not r.is_caught_up]

    def preempt(self, req: Request, *, to_back: bool = False) -> None:
        """Preemption by recompute: drop the request's KV and put it back at the queue front
        (`to_back`: its end; by priority: where its priority puts it)."""
        self._stop_running(req)
        offload = self.offload
        if isinstance(offload, JobOffloadState) and offload.defers_frees:
            offload.free_blocks(req)  # (vLLM 0.33.0's tier, async: perhaps later)
        else:
            self.kv.free(req, preempted=True)
        req.num_recomputed_tokens += req.num_computed_tokens
        req.num_computed_tokens = 0
        req.num_draft_tokens = 0  # (vLLM: `_preempt_request` clears `spec_token_ids`)
        req.spec_padded = False
        if self.acceptance is not None:  # and its placeholders (delivered stale, if at all)
            req.num_output_tokens -= req.num_placeholders
            req.num_placeholders = 0
        req.num_preemptions += 1
        req.close_token_run()
        req.status = Status.WAITING
        if to_back:
            self.waiting.append(req)
        else:
            self.waiting.appendleft(req)
        self.num_waiting_tokens += req.num_uncomputed_tokens

    def abort(self, req: Request, now_s: float, reason: str) -> None:
        """The engine gives up on running `req` (SGLang aborts a request its KV cannot hold):
        it leaves the batch, its KV freed, and fails at `now_s` with `reason`; tokens in
        iterations still in flight never reach the client."""
        self._stop_running(req)
        self._free_finished(req, cache=False)  # (SGLang's `release_req`)
        req.num_output_tokens -= req.num_placeholders
        req.num_placeholders = 0
        req.close_token_run()
        req.status = Status.FAILED
        req.failed_s = now_s
        req.reason = reason

    def commit(self, plan: Plan, iteration: int, start_s: float, end_s: float,
               since: int | None = None) -> list[Request]:
        """Apply an iteration that ran from `start_s` to `end_s`; return the requests that left
        the running list: finished, or (on a prefill replica) prefilled and handed off.
        `since`: the last iteration before this one in which any request here decoded (default
        the one before it): a request's run of token iterations goes on through those between
        (`Request.record_token`). The one definition of token accounting: a committed stretch
        (`sim.engine.fastpath.commit`) is this applied to a run of decode iterations
        (tests/engine/test_commit.py checks the two agree)."""
        done: list[Request] = []
        requests = self.requests
        prefill_only = self.prefill_only
        num_sampled = 0
        previous = iteration - 1 if since is None else since
        if self.acceptance is not None:
            done = commit_speculative(self, plan, iteration, start_s, previous)
            if done:
                self.leave(done, end_s)
            return done
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            req = requests[request_id]
            if req.first_scheduled_s is None:
                req.first_scheduled_s = start_s
            req.num_computed_tokens += num_tokens
            # Caught up with prompt plus output (`num_tokens`, inlined: hot loop): sample one.
            if (req.num_computed_tokens == req.num_prompt_tokens + req.num_output_tokens
                    or req.spec_padded and drop_padding(req)):
                if prefill_only and self.first_token_dropped:
                    done.append(req)  # (its token never reaches the client)
                    continue
                req.num_output_tokens += 1
                num_sampled += 1
                if req.last_token_iter >= previous:  # `record_token`'s usual case, no call
                    req.last_token_iter = iteration
                else:
                    req.record_token(iteration, previous)
                if prefill_only:
                    self._handed_off(req, done)
                elif req.num_output_tokens == req.num_target_output_tokens:
                    done.append(req)
        self.num_running_tokens += num_sampled
        if done:
            self.leave(done, end_s)
        return done

    def _handed_off(self, req: Request, done: list[Request]) -> None:
        """Prefill replica: `req` sampled its first token and leaves (`leave`), that token held
        for the decode side to stream where the engine does so (`first_token_held`)."""
        if self.first_token_held:
            req.first_token_out_s = math.inf
        done.append(req)

    def leave(self, done: list[Request], end_s: float) -> None:
        """Requests that sampled their last token here leave: finished, or handed off (always,
        where the first token is held: the decode side streams it)."""
        for req in done:
            if (req.num_output_tokens == req.num_target_output_tokens
                    and req.first_token_out_s != math.inf):
                self.finish(req, end_s)
            else:
                self._stop_running(req)
                req.status = Status.TRANSFERRING
                req.prefill_end_s = end_s
                self.num_transferring += 1
                if self.offload is not None:  # (the connector is told; the blocks stay)
                    self.offload.finished(self, req, held=True)

    def start(self, plan: Plan, start_s: float, *, placeholders: bool = False
              ) -> list[InFlight]:
        """Pipelined replica: `plan` is sent off at `start_s`, its tokens computed from now
        (`sim.core.pipeline_commit.start_pipelined`); returns what `complete` needs."""
        return start_pipelined(self, plan, start_s, placeholders)

    def complete(self, in_flight: list[InFlight], end_s: float, *, stale_delivered: bool = False
                 ) -> tuple[list[Request], list[int]]:
        """Pipelined replica: the iteration `start` sent off has ended; returns the requests
        that left the running list, and the ids of those that sampled
        (`sim.core.pipeline_commit.complete_pipelined`)."""
        return complete_pipelined(self, in_flight, end_s, stale_delivered)

    def finish_from_queue(self, req: Request, end_s: float) -> None:
        """A queued request's last token came back (delivered stale): it finishes from the
        queue, holding no KV."""
        self.waiting.remove(req)
        self.num_waiting_tokens -= req.num_uncomputed_tokens
        req.close_token_run()
        if self.offload is not None:  # (it holds no KV; the connector is told)
            self.offload.finished(self, req)
        self._settle(req, end_s)

    def _free_finished(self, req: Request, *, cache: bool = True) -> None:
        """`req` finished or was aborted: free its KV blocks (with a CPU tier, perhaps once
        its stores are done), caching what it computed unless not to `cache`."""
        if self.offload is None:
            self.kv.free(req, preempted=not cache)
        else:
            self.offload.finished(self, req)

    def cancel(self, in_flight: list[InFlight]) -> None:
        """Pipelined replica: an iteration `start` sent off never ends (the run stopped at its
        horizon): its tokens are not computed (`sim.core.pipeline_commit.cancel_pipelined`)."""
        cancel_pipelined(self, in_flight)

    def release(self, req: Request) -> None:
        """A handed-off request's KV has reached its decode replica: free its blocks here
        (with a CPU tier, perhaps once its stores are done)."""
        if self.offload is None:
            self.kv.free(req)
        else:
            self.offload.released(self, req)
        self.num_transferring -= 1

    def decoded(self, num_tokens: int) -> None:
        """Running requests sampled `num_tokens` tokens in all (a decode stretch)."""
        self.num_running_tokens += num_tokens

    def finish(self, req: Request, end_s: float) -> None:
        self._stop_running(req)
        self._free_finished(req)
        req.close_token_run()
        self._settle(req, end_s)

    def _settle(self, req: Request, end_s: float) -> None:
        """`req` sampled its last token at `end_s`: finished (told to `on_finish`), or failed
        if its answer can no longer reach its client in time (its deadline passed during the
        iteration: the abort comes after it)."""
        if end_s > req.deadline_s:
            fail_timeout(req, f"its last token {end_s - req.deadline_s:.3g} s too late")
            return
        req.status = Status.FINISHED
        req.finish_s = end_s
        if self.on_finish is not None:
            self.on_finish(req)

    def expire(self, now_s: float) -> list[Request]:
        """Abort the requests here whose client has given up by `now_s` (their deadline has
        passed), as vLLM's engine applies the aborts it received before its next step: a
        queued one leaves the queue, a running one the batch, its KV blocks freed (cached
        prefixes stay cached); each fails, at its deadline, with the reason. A request
        handed off (its KV on the way to a decode replica) is aborted there. Returns them."""
        deadlines = self._deadlines
        aborted = []
        while deadlines and deadlines[0][0] <= now_s:
            req = heapq.heappop(deadlines)[2]
            if self.prefill_only and req.prefill_end_s is not None:
                continue  # handed off: a decode replica holds it (or its KV is on the way)
            if req.status is Status.WAITING:
                self.waiting.remove(req)
                self.num_waiting_tokens -= req.num_uncomputed_tokens
                if self.offload is not None:  # (queued, it holds KV only if loading it)
                    self.offload.finished(self, req)
                where = "queued"
            elif req.status is Status.RUNNING:
                self._stop_running(req)
                self._free_finished(req)
                # Tokens in iterations still in flight never reach the client.
                req.num_output_tokens -= req.num_placeholders
                req.num_placeholders = 0
                where = (f"running, {req.num_output_tokens:,} of "
                         f"{req.num_target_output_tokens:,} tokens generated")
            else:
                continue  # finished
            req.close_token_run()
            fail_timeout(req, where)
            aborted.append(req)
        return aborted

    @property
    def num_outstanding(self) -> int:
        return len(self.waiting) + len(self.running)

    def check(self) -> None:
        """The invariants (`sim.core.state_check.check_state`), asserted."""
        check_state(self)


def fail_timeout(req: Request, where: str) -> None:
    """`req`'s client gave up at its deadline: it failed, with the reason."""
    req.status = Status.FAILED
    req.failed_s = req.give_up_s
    req.reason = f"client_timeout: gave up {req.give_up_s - req.arrival_s:g} s after arriving, " \
                 f"{where}"
