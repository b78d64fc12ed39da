"""Join-shortest-queue on tokens: the replica with the fewest tokens of work queued or resident
in its KV cache (a long prompt weighs more than a short one)."""

from __future__ import annotations

from collections.abc import Sequence

from sim.core.request import Request
from sim.routers.base import ROUTERS, ReplicaLoad, Router, argmin_first, load_tokens


@ROUTERS.register("least_kv_load")
class LeastKVLoad(Router):
    def choose(self, req: Request, loads: Sequence[ReplicaLoad]) -> int:
        return argmin_first(load_tokens(loads))
