"""The replica with the fewest requests in flight (queued, running or arriving by transfer)."""

from __future__ import annotations

from collections.abc import Sequence

from sim.core.request import Request
from sim.routers.base import ROUTERS, ReplicaLoad, Router, argmin_first


@ROUTERS.register("least_outstanding")
class LeastOutstanding(Router):
    def choose(self, req: Request, loads: Sequence[ReplicaLoad]) -> int:
        return argmin_first([load.num_outstanding for load in loads])
