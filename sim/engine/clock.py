"""Simulated time: the SimPy environment and the order of events at one instant, and the feed
of arrivals.

Events at the same instant happen in one fixed order, whether a replica steps every iteration or
fast-forwards a stretch of them, so both give identical results:
1. iterations ending at that instant are complete: whoever looks at a replica (a router reading
   its load, a transfer handing it KV) first commits the work it has finished by now
   (`Replica.sync`);
2. arrivals, KV transfers and everything else, in the order they were scheduled;
3. replicas plan their next iteration, in replica order (priority `PLAN + replica_id`),
   having seen everything else that happened at that instant;
4. last, clients learn of the answers finished at that instant (priority `ANSWERED`): what they
   send then is planned for at the replicas' next turns, after the iterations just planned,
   whether a replica committed the finish at its turn, when a router looked at it, or ahead of
   the clock (fast-forward).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from heapq import heappush
from typing import Any

import simpy

from sim.core.request import Request

Hook = Callable[[Request], None]
Progress = Callable[[int, int], None]
NORMAL = simpy.events.NORMAL
PLAN = NORMAL + 1  # a replica's turn to plan: after everything else at the same instant
ANSWERED = PLAN + 2**31  # after every replica's turn (replica ids stay far below 2**31)


class Environment(simpy.Environment):
    """SimPy's environment, able to schedule an event at an absolute time (a stretch's iteration
    ends must fall on exactly the floats a step-by-step run reaches, and `now + delay` cannot
    always reach a given float), and to say which priorities the current instant has reached."""

    def __init__(self) -> None:
        super().__init__()
        self._phase_s = -math.inf  # the instant `_phase` belongs to
        self._phase = 0  # the highest priority processed at that instant so far
        self.next_arrival_s = math.inf  # when the next request not yet routed arrives

    def schedule_at(self, event: simpy.Event, priority: int, at_s: float) -> None:
        assert at_s >= self._now
        entry = (at_s, simpy.events.EventPriority(priority), next(self._eid), event)
        heappush(self._queue, entry)

    def step(self) -> None:
        if self._queue:
            at_s, priority = self._queue[0][0], self._queue[0][1]
            self._phase = priority if at_s != self._phase_s else max(self._phase, priority)
            self._phase_s = at_s
        super().step()

    def reached(self, priority: int) -> bool:
        """Whether this instant's events have reached `priority`: a replica whose planning turn
        that is has planned (or, mid-stretch, would have, stepping) its iteration starting now."""
        return self._phase_s == self._now and self._phase >= priority


class At(simpy.Event):
    """An event processed at the absolute time `at_s`, after any earlier `priority`."""

    def __init__(self, env: Environment, at_s: float, priority: int) -> None:
        super().__init__(env)
        self._ok = True  # as `simpy.Timeout`: triggered from the start, processed at `at_s`
        self._value = None
        env.schedule_at(self, priority, at_s)


def feed_arrivals(env: Environment, requests: list[Request], route: Hook,
                  on_progress: Progress | None = None
                  ) -> Generator[simpy.Event, Any, None]:
    """Hand each request to `route` at its arrival time; report progress now and then, and
    after the last arrival (the final report says every request was fed)."""
    total = len(requests)
    every = max(1, total // 200)
    for i, req in enumerate(requests):
        if req.arrival_s > env.now:
            env.next_arrival_s = req.arrival_s
            yield At(env, req.arrival_s, NORMAL)
        route(req)
        if on_progress is not None and ((i + 1) % every == 0 or i + 1 == total):
            on_progress(i + 1, total)
    env.next_arrival_s = math.inf


def simulate(env: Environment, requests: list[Request], route: Hook,
             horizon_s: float | None, on_progress: Progress | None = None) -> None:
    """Feed the arrivals and run to completion, or to the horizon (events at the horizon
    itself do not happen)."""
    env.process(feed_arrivals(env, requests, route, on_progress))
    env.run(until=horizon_s)
