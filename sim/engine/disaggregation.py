"""Disaggregated serving: a prefill pool and a decode pool joined by KV-transfer links.

Everything that exists only because prefill and decode run apart lives here:
- the hand-off (`Disaggregation.handoff`): a request leaves its prefill replica after its first
  token, keeping its KV blocks there until the transfer is done;
- decode-side reservation (`DecodeInbox`): it waits, FCFS, until the decode replica's scheduler
  takes it (`Scheduler.admit_transfer` allocates the blocks its prompt's KV will fill; admitting
  is a scheduling decision, not the engine's);
- the links and the transfer time.

The replica state keeps only the counters its scheduler reads (`ReplicaState.incoming`,
`num_transferring`, `prefill_only`). SimPy is used here as in `sim/engine/replica.py`.

Links: each prefill replica sends KV through its own NIC, a `simpy.Resource` of capacity one, so
its transfers queue FIFO at full bandwidth while different replicas' transfers run in parallel.
FIFO rather than fair sharing because an RDMA NIC works through its send queue in order; for
equal transfers both give the same throughput and FIFO gives earlier first completions.
"""

from __future__ import annotations

import math
from bisect import insort
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any

import simpy

from sim.config.errors import InputError
from sim.core.request import Request
from sim.core.state import fail_timeout
from sim.routers.base import ReplicaLoad, Router
from sim.workloads.base import MAX_SPAN_S

if TYPE_CHECKING:
    from sim.config.scenario import LinkConfig
    from sim.engine.clock import Environment
    from sim.engine.data_parallel import DataParallelGroup
    from sim.engine.replica import Replica
    from sim.hardware.models import ModelShape


class DecodeInbox:
    """A decode replica's transfers waiting for KV blocks there, first come first served, or
    in its policy's order (`Scheduler.transfer_order`: vLLM's priority policy puts a request
    whose KV is remote in its waiting queue like any other; SGLang's decode server sorts its
    preallocation queue by priority), each taken while the policy takes them."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        # Each waiting request, and what to do once its blocks are allocated.
        self.pending: deque[tuple[Request, Callable[[], Any]]] = deque()
        # Prompt tokens of the requests waiting here or on their way: the KV they bring.
        self.num_tokens = 0

    def reserve(self, req: Request) -> simpy.Event:
        """An event that fires once the replica's scheduler has taken `req` and allocated
        blocks for its prompt's KV."""
        done = self.replica.env.event()
        self.reserve_then(req, done.succeed)
        return done

    def reserve_then(self, req: Request, then: Callable[[], Any]) -> None:
        """Call `then` as soon as the replica's scheduler has taken `req` and allocated blocks
        for its prompt's KV (within its planning turn, before it plans)."""
        order = self.replica.scheduler.transfer_order
        if order(req) is None:
            self.pending.append((req, then))
        else:  # (after those of its rank: ties keep the order they came in)
            insort(self.pending, (req, then), key=lambda entry: order(entry[0]) or ())
        self.num_tokens += req.num_prompt_tokens
        # Blocks are taken when the replica plans (a stretch in progress is cut), so every
        # iteration's plan sees the KV it was scheduled with.
        self.replica.wake()

    def admit(self) -> None:
        """At the replica's planning turn: hand transfers to the scheduler, in order, while it
        takes them (passing over those it skips this time: a CPU tier's lookup that must wait).
        A taken request counts in `state.incoming` until its KV arrives."""
        state, scheduler = self.replica.state, self.replica.scheduler
        pending = self.pending
        index = 0
        while index < len(pending):
            req, then = pending[index]
            taken = scheduler.admit_transfer(state, req)
            if taken is None:
                index += 1
                continue
            if not taken:
                return
            del pending[index]
            state.incoming[req.request_id] = req
            then()

    def drop_pending(self, req: Request) -> None:
        """`req`, waiting here for blocks, will never come: those behind it may fit now (the
        replica checks its queue at its next pass, as SGLang's loop does at every one)."""
        self.pending = deque(entry for entry in self.pending if entry[0] is not req)
        self.num_tokens -= req.num_prompt_tokens
        self.replica.wake()

    def withdraw(self, req: Request) -> None:
        """`req`, whose blocks were allocated here before its prefill, will never come (its
        client gave up): its blocks are free again."""
        state = self.replica.state
        del state.incoming[req.request_id]
        state.kv.free(req, preempted=True)
        self.num_tokens -= req.num_prompt_tokens
        self.replica.wake()

    def join(self, req: Request) -> None:
        """`req`'s KV has arrived: it decodes on this replica from now on."""
        replica = self.replica
        req.move_to(replica.replica_id)
        replica.state.join(req, replica.env.now)
        self.num_tokens -= req.num_prompt_tokens
        replica.wake()

    @property
    def num_requests(self) -> int:
        """Requests waiting here for blocks or on their way (blocks allocated)."""
        return len(self.pending) + len(self.replica.state.incoming)



class Disaggregation:
    """The prefill and decode pools of one cluster, the links between them, and hand-offs."""

    def __init__(self, env: Environment, prefill: list[Replica],
                 decode: Sequence[Replica | DataParallelGroup], decode_router: Router,
                 link: LinkConfig, overlap_transfer: bool, model: ModelShape,
                 loads: Callable[[Any], Sequence[ReplicaLoad]],
                 next_arrival: Callable[[], float], source: str = "<scenario>") -> None:
        """`prefill`: the prefill pool's engine cores (a replica's data-parallel ranks each
        one, with a link of its own); `decode`: the decode pool's replicas, which the decode
        router picks from (a replica of ranks then gives the request to one)."""
        self.env = env
        self.source = source  # the scenario file its errors name
        self.prefill = prefill
        self.decode = decode
        self.decode_router = decode_router
        self.link = link
        self.overlap = overlap_transfer
        self.model = model
        self.loads = loads  # the replicas' loads as a router reads them
        # When the next request arrives (or the horizon, if sooner): the cluster's answer.
        self.next_arrival = next_arrival
        # When each transfer on a link will have arrived (request id -> time).
        self._arrival_due_s: dict[int, float] = {}
        self.sources = {r.replica_id: r for r in prefill}
        self.links = {r.replica_id: simpy.Resource(env, capacity=1) for r in prefill}
        self._decode_ranks = [rank for unit in decode for rank in unit.ranks]
        self.inboxes = {r.replica_id: DecodeInbox(r) for r in self._decode_ranks}
        for replica in self._decode_ranks:
            replica.inbox = self.inboxes[replica.replica_id]
            replica.quiet_until = self._decode_quiet_until(replica)
        for replica in prefill:
            replica.on_handoff = self.handoff
        # SGLang's order (`Scheduler.decode_reserves_first`): the decode side preallocates a
        # request's KV before its prefill may start (the bootstrap); the decode replica so
        # chosen, by request id, until its prefill ends.
        self.reserves_first = self._decode_ranks[0].scheduler.decode_reserves_first
        self._reserved: dict[int, Replica] = {}
        self._bootstrapping: dict[int, Replica] = {}  # waiting for it, by request id
        if self.reserves_first:
            for replica in prefill:
                replica.on_dropped = self._unreserve

    def _decode_quiet_until(self, replica: Replica) -> Callable[[], float]:
        """The earliest time anything may touch decode `replica`: a hand-off (a prefill
        replica's iteration ending, at the earliest when the ones in progress end, when a
        transfer frees one's blocks, or when a request arrives) or the arrival of KV on its
        way to it. Other decode replicas never touch it."""
        env = self.env
        prefill, due = self.prefill, self._arrival_due_s
        incoming = replica.state.incoming

        def quiet_until() -> float:
            now = env.now
            bound = min(self.next_arrival(), min(due.values(), default=math.inf))
            for source in prefill:
                bound = min(bound, source.next_commit_s())
            for request_id, req in incoming.items():
                # KV on its way: it lands when its transfer says; before it has a link, now;
                # before its prefill ends (reserved first), not before a prefill replica's
                # work in progress ends (bounded above).
                if request_id in due:
                    bound = min(bound, due[request_id])
                elif req.prefill_end_s is not None:
                    bound = min(bound, now)
            return bound

        return quiet_until

    def reject_reason(self, req: Request) -> str | None:
        """Why no decode replica could ever hold `req`; None if one can."""
        dec = self._decode_ranks[0]
        reason = dec.reject_reason(req) or dec.scheduler.transfer_reason(dec.state.kv, req)
        if reason is None:
            return None
        kind, _, detail = reason.partition(": ")
        return f"{kind}: decode pool {detail}"

    def submit(self, req: Request, prefill: Replica | DataParallelGroup) -> None:
        """`req` arrives for `prefill`: it is submitted there, or (reserving first) once a
        decode replica has preallocated its KV; one the prefill replica refuses is refused
        at once."""
        if not self.reserves_first or prefill.reject_reason(req) is not None:
            prefill.submit(req)
            return
        # SGLang's bootstrap: the decode server the router pairs with the prefill one
        # preallocates the request's KV (`DecodePreallocQueue`); the prefill server takes it
        # then (`PrefillBootstrapQueue.pop_bootstrapped`), before the decode server plans: a
        # stretch planned there sees the prefill replica at work.
        # (Until the prefill replica takes it: its first rank's, for a replica of ranks.)
        req.replica_id = req.prefill_replica_id = prefill.ranks[0].replica_id
        target = self._decode_target(req)

        def bootstrapped() -> None:
            del self._bootstrapping[req.request_id]
            self._reserved[req.request_id] = target
            prefill.submit(req)

        self._bootstrapping[req.request_id] = target
        self.inboxes[target.replica_id].reserve_then(req, bootstrapped)

    def give_up(self, req: Request) -> bool:
        """`req`'s client gave up: if it still waits for a decode replica to preallocate its
        KV (before its prefill), it leaves that queue and fails; whether it did."""
        target = self._bootstrapping.pop(req.request_id, None)
        if target is None:
            return False
        self.inboxes[target.replica_id].drop_pending(req)
        fail_timeout(req, "waiting for a decode replica to preallocate its KV")
        return True

    def _unreserve(self, dropped: list[Request]) -> None:
        """Requests that left their prefill replica without a hand-off (their client gave up;
        or finished there, a policy whose first token stands asked for one) give back the KV
        a decode replica preallocated for them."""
        for req in dropped:
            target = self._reserved.pop(req.request_id, None)
            if target is not None:
                self.inboxes[target.replica_id].withdraw(req)

    def _decode_target(self, req: Request) -> Replica:
        """The decode replica (engine core) the decode router picks for `req` now."""
        decode = self.decode
        return decode[0 if len(decode) == 1 else self.decode_router.choose_at(
            req, self.loads(decode), self.env.now)].pick(req)

    def handoff(self, req: Request) -> None:
        """`req` has its first token on its prefill replica: move it to a decode replica."""
        self.env.process(self._transfer(req))

    def _transfer(self, req: Request) -> Generator[simpy.Event, Any, None]:
        """Wait for blocks on a decode replica (KV stays on the prefill side meanwhile; none
        where they were reserved first), then move the prompt's KV over the prefill
        replica's link."""
        source = self.sources[req.prefill_replica_id]
        target = self._reserved.pop(req.request_id, None)
        if target is None:
            target = self._decode_target(req)
            yield self.inboxes[target.replica_id].reserve(req)
        inbox = self.inboxes[target.replica_id]
        req.transfer_start_s = self.env.now
        with self.links[source.replica_id].request() as slot:
            yield slot
            req.transfer_wire_start_s = self.env.now
            wire_s = self.transfer_time_s(req)
            if not self.env.now + wire_s < MAX_SPAN_S:
                # Past 2**32 s, times lose their resolution (the engine refuses iterations
                # there): the link's settings, not the replica's latency model, are at fault.
                raise InputError(self.source, "cluster.link", self.link.model_dump(),
                                 f"a transfer of {req.num_prompt_tokens} tokens' KV takes "
                                 f"{wire_s:.3g} s and would end at t={self.env.now + wire_s:.3g} "
                                 "s, past 2**32 s (136 years), where times lose their "
                                 "resolution: check the link's bandwidth_gb_s and latency_s")
            self._arrival_due_s[req.request_id] = self.env.now + wire_s
            yield self.env.timeout(wire_s)
        del self._arrival_due_s[req.request_id]
        source.state.release(req)  # its KV has been sent: the blocks there are free again
        source.wake()
        req.transfer_end_s = self.env.now
        inbox.join(req)

    def transfer_time_s(self, req: Request) -> float:
        """Link latency plus the prompt's KV bytes over the bandwidth; with overlap, only the
        part not already streamed while the prefill ran."""
        num_bytes = req.num_prompt_tokens * self.model.kv_bytes_per_token
        wire_s = num_bytes / (self.link.bandwidth_gb_s * 1e9)
        if self.overlap and req.first_scheduled_s is not None and req.prefill_end_s is not None:
            wire_s = max(0.0, wire_s - (req.prefill_end_s - req.first_scheduled_s))
        return self.link.latency_s + wire_s
