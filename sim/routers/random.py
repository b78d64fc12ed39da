"""A replica drawn uniformly at random, from the scenario's seed."""

from __future__ import annotations

from collections.abc import Sequence

from sim.core.request import Request
from sim.routers.base import ROUTERS, ReplicaLoad, Router


@ROUTERS.register("random")
class Random(Router):
    reads_loads = False  # (only how many replicas there are)
    def choose(self, req: Request, loads: Sequence[ReplicaLoad]) -> int:
        return int(self.rng.integers(len(loads)))
