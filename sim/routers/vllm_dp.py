"""vLLM's load balancer over data-parallel engine cores (`DPLBAsyncMPClient.
get_core_engine_for_request`, one API server): the engine with the lowest score gets the
request, its counts as the DP coordinator last published them (about every 100 ms while they
change: `min_stats_update_interval_ms`) plus one waiting request for each request this
balancer sent there since. Scores, by release:

- 0.15.1 and 0.19.0: `4 * waiting + running`; ties to the lowest rank.
- 0.33.0: `max(in flight, waiting + running) + 6 * waiting * max(0, KV usage - 0.5)`, in
  flight being the requests the balancer sent there and not yet answered; the scan starts
  one rank further after every pick, so ties go round.

The published counts are taken here at the first arrival at least `stats_interval_s` after the
last ones, from the engines as they are then (the coordinator's ticks run on their own clock:
an approximation of when each snapshot is taken, not of what it holds).

Which engines publish: an MoE model's data-parallel ranks (`DPEngineCoreProc`) in every
release, and every engine from 0.33.0 on; vLLM 0.15-0.19 runs a dense model's ranks as plain
engines that publish nothing, so the balancer then sees only its own picks, which the
coordinator's all-zero list resets about every 5 s (its update period while nothing changes).
Over a cluster's replicas (a dense model's ranks as vLLM runs them) that is the default
(`engines_publish_counts`); a data-parallel replica's ranks publish.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from sim.core.request import Request
from sim.routers.base import ROUTERS, ReplicaLoad, Router, RouterConfig


class VllmDataParallelConfig(RouterConfig):
    engine_version: Literal["0.15.1", "0.19.0", "0.33.0"] = Field(
        "0.15.1", description="the vLLM release whose score picks the engine")
    stats_interval_s: float = Field(
        0.1, ge=0, le=60, description="how often the coordinator publishes the engines' counts "
                                      "(vLLM: 100 ms while they change)",
        json_schema_extra={"unit": "s"})
    engines_publish_counts: bool | None = Field(
        None, description="whether the engines publish their counts; none: as the release "
                          "does for a dense model's engines (0.33.0 yes, older no: the "
                          "balancer's own picks, reset every 5 s)")


# `DPCoordinatorProc`: with no change to publish, it sends the (all-zero) counts every 5 s.
UNPUBLISHED_RESET_S = 5.0


@ROUTERS.register("vllm_dp")
class VllmDataParallel(Router):
    Config = VllmDataParallelConfig

    def __init__(self, config: VllmDataParallelConfig, rng: np.random.Generator) -> None:
        super().__init__(config, rng)
        self.latest = config.engine_version == "0.33.0"
        publish = config.engines_publish_counts
        self.published = self.latest if publish is None else publish
        # Unpublished: the coordinator's all-zero list, about every 5 s.
        self.interval_s = config.stats_interval_s if self.published else UNPUBLISHED_RESET_S
        self._published_s = -np.inf
        # Per engine: [waiting, running, KV usage] as last published, waiting bumped per pick.
        self._counts: list[list[float]] = []
        self._start = 0  # 0.33.0: where the next scan starts

    def choose(self, req: Request, loads: Sequence[ReplicaLoad]) -> int:
        return self.choose_at(req, loads, req.arrival_s)

    def choose_at(self, req: Request, loads: Sequence[ReplicaLoad], now_s: float) -> int:
        # (The published counts are refreshed by this clock: a decode pool's pick comes when
        # the request's prompt is done, in that order, not in the order of arrivals.)
        counts = self._counts
        if len(counts) != len(loads) or now_s - self._published_s >= self.interval_s:
            counts[:] = ([[load.num_waiting, load.num_running, load.kv_usage] for load in loads]
                         if self.published else [[0, 0, 0.0] for _ in loads])
            self._published_s = now_s
        num = len(loads)
        best, best_score = 0, np.inf
        for i in range(num):
            index = (self._start + i) % num if self.latest else i
            waiting, running, kv_usage = counts[index]
            if self.latest:
                score = max(loads[index].num_outstanding, waiting + running)
                if waiting:
                    score += waiting * 6.0 * max(0.0, kv_usage - 0.5)
            else:
                score = waiting * 4 + running
            if score < best_score:
                best, best_score = index, score
        counts[best][0] += 1
        if self.latest:
            self._start = (self._start + 1) % num
        return best
