"""Each request to the next replica in turn."""

from __future__ import annotations

from collections.abc import Sequence

from sim.core.request import Request
from sim.routers.base import ROUTERS, ReplicaLoad, Router


@ROUTERS.register("round_robin")
class RoundRobin(Router):
    reads_loads = False  # (only how many replicas there are)
    _next = 0

    def choose(self, req: Request, loads: Sequence[ReplicaLoad]) -> int:
        index = self._next % len(loads)
        self._next = index + 1
        return index
