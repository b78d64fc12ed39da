"""Sending that reacts to the engine, in simulated time: closed-loop clients
(`sim.config.clients`: a request is sent when a client is free, and a client is free again once
its answer has come back and it has thought) and sessions (`sim.workloads.base.Sessions`: a
conversation's next turn is sent a think time after the answer to the turn before).

Sending then depends on what the engine does, so the cluster says when a request is over
(`done`: finished, from the replica's state as it commits the finish; given up on, by the
timeouts at the deadline; rejected, at once). Replicas run ahead of the clock no further than
the next event of any kind (`Cluster._next_arrival`), and a decode stretch stops at its first
finish (`FastReplica._through_finishes`): a finish may send a request at that very instant,
by an event after the finishing replica has planned its next iteration, as a step-by-step run
has it.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Sequence

import numpy as np

from sim.config.clients import ClientsConfig
from sim.core.request import Request, Status
from sim.engine.clock import NORMAL, At, Environment, Hook, Progress
from sim.workloads.base import Sessions


class Dispatcher:
    """Sends `requests` (module docstring): each once it is ready (at its arrival time; or,
    unpaced clients, from the first arrival; or, a later turn, its think time after the answer
    before) and, with `clients`, a client is free; among ready ones, the earliest ready first,
    then the workload's order. `reply_s(req)`: how long after the engine's finish the client
    has the answer (the API front end)."""

    def __init__(self, env: Environment, requests: Sequence[Request], route: Hook,
                 reply_s: Callable[[Request], float], rng: np.random.Generator, *,
                 clients: ClientsConfig | None = None, sessions: Sessions | None = None,
                 on_progress: Progress | None = None) -> None:
        self.env = env
        self.requests = requests
        self.route = route
        self.reply_s = reply_s
        self.rng = rng
        self.clients = clients
        self.on_progress = on_progress
        self.num_free = clients.concurrency if clients is not None else math.inf
        # Later turns, by the request they wait for; their think times.
        self.followers: dict[int, list[int]] = {}
        self.delay_s: np.ndarray | None = None
        # A trace's follow-ups are not sent before their own time either (unpaced clients
        # use no time of the workload's).
        self.paced_turns = (sessions is not None and sessions.paced
                            and (clients is None or clients.paced))
        waits = np.zeros(len(requests), dtype=bool)
        if sessions is not None:
            self.delay_s = sessions.delay_s
            for i, before in enumerate(sessions.after.tolist()):
                if before >= 0:
                    self.followers.setdefault(before, []).append(i)
                    waits[i] = True
        # Ready to send, (time, index): first turns and lone requests now; later turns as the
        # answers they wait for come back.
        start_s = requests[0].arrival_s if requests else 0.0
        paced = clients is None or clients.paced
        self.paced = paced
        self.waits = waits
        self.ready = [(r.arrival_s if paced else start_s, i)
                      for i, r in enumerate(requests) if not waits[i]]
        heapq.heapify(self.ready)
        self.num_sent = 0
        self.sent = np.zeros(len(requests), dtype=bool)
        self.done_ids: set[int] = set()
        self._wake_at = math.inf  # the earliest wake-up scheduled for a request's time
        self._every = max(1, len(requests) // 200)
        # When the clients stop sending (`clients.duration_s` after the start).
        self.stop_s = math.inf

    def start(self) -> None:
        if self.clients is not None and self.clients.duration_s is not None:
            self.stop_s = self.env.now + self.clients.duration_s
        self._send()

    def _at(self, at_s: float, callback: Callable[[], None]) -> None:
        event = At(self.env, at_s, NORMAL)
        event.callbacks.append(lambda _: callback())

    def _send(self) -> None:
        """Send what is ready now, while clients are free; wake up when the next is ready."""
        now, ready = self.env.now, self.ready
        if now >= self.stop_s:
            return
        while self.num_free and ready:
            ready_s, i = ready[0]
            if ready_s > now:
                if ready_s < self._wake_at and ready_s < self.stop_s:
                    self._wake_at = ready_s
                    self._at(ready_s, self._woken)
                return
            heapq.heappop(ready)
            self.num_free -= 1
            self._dispatch(i)

    def _dispatch(self, i: int) -> None:
        """Send request `i` now, on a client already counted as busy (past the clients'
        duration: not sent)."""
        req, now = self.requests[i], self.env.now
        if now >= self.stop_s:
            return
        self.sent[i] = True
        self.num_sent += 1
        req.arrival_s = now
        self.route(req)
        if req.status is Status.REJECTED:  # the client has its error at once
            self.done(req, now)
        if self.on_progress is not None and (
                self.num_sent % self._every == 0 or self.num_sent == len(self.requests)):
            self.on_progress(self.num_sent, len(self.requests))

    def _woken(self) -> None:
        self._wake_at = math.inf
        self._send()

    def done(self, req: Request, end_s: float, *, gave_up: bool = False) -> None:
        """`req` is over for its client at `end_s` (the engine's finish: the answer comes
        `reply_s` later; a give-up or a rejection: then). A session's next turn goes on the
        same client its think time after a finished answer (the client stays busy: a user
        keeps their conversation), sent by an event even now (the replica that committed the
        finish plans its next iteration first, run ahead or stepped); else the client thinks,
        then is free."""
        rid = req.request_id
        if rid in self.done_ids:
            return  # (a request given up on finishes or is aborted later in the engine)
        self.done_ids.add(rid)
        answered = req.status is Status.FINISHED and not gave_up
        answer_s = end_s + self.reply_s(req) if answered else end_s
        followers = self.followers.pop(rid, [])
        if followers and answered:
            assert self.delay_s is not None
            for k, i in enumerate(followers):
                ready_s = answer_s + float(self.delay_s[i])
                if self.paced_turns:
                    ready_s = max(ready_s, self.requests[i].arrival_s)
                if k == 0:  # the session's next turn, on this client
                    self._at(ready_s, functools.partial(self._dispatch, i))
                else:  # (a turn continued twice: the others wait for a client of their own)
                    heapq.heappush(self.ready, (ready_s, i))
                    self._at(ready_s, self._send)
            return
        self._abandon(followers, rid)
        if self.clients is not None:
            self._at(answer_s + self._think_s(), self._freed)

    def _abandon(self, followers: list[int], rid: int) -> None:
        """The turns after one that got no answer, and theirs: never sent."""
        stack = list(followers)
        while stack:
            i = stack.pop()
            self.requests[i].reason = (f"abandoned: never sent, its session's turn before "
                                       f"(request {rid}) got no answer")
            stack += self.followers.pop(i, [])

    def _freed(self) -> None:
        self.num_free += 1
        self._send()

    def _think_s(self) -> float:
        cfg = self.clients
        assert cfg is not None
        if cfg.think_time == "exponential" and cfg.think_time_s > 0:
            return float(self.rng.exponential(cfg.think_time_s))
        return cfg.think_time_s

    def mark_unsent(self, horizon_s: float | None) -> None:
        """Say why each request never sent (and not abandoned) was not: the clients' duration
        ended, or the run stopped at its horizon first."""
        stop_s = self.stop_s
        stopped = stop_s < math.inf and (horizon_s is None or stop_s <= horizon_s)
        for i, req in enumerate(self.requests):
            if self.sent[i] or req.reason is not None:
                continue
            if stopped:
                req.reason = (f"after_duration: never sent, the clients stopped sending at "
                              f"{stop_s:.6g} s (clients.duration_s)")
                continue
            if self.waits[i]:
                why = "its session's turn before had no answer yet"
            elif self.paced:
                why = f"due at {req.arrival_s:.6g} s, no client free"
            else:
                why = "no client free"
            req.reason = f"after_horizon: never sent ({why})"
