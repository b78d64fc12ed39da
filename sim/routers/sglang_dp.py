"""SGLang's data-parallel controller (`managers/data_parallel_controller.py`, 0.5.23): the
balancer over the ranks of DP attention (`--enable-dp-attention`), each request dispatched in
arrival order by `--load-balance-method`:

- `round_robin` (what `auto`, the default, resolves to outside a disaggregated prefill
  server): the next rank in turn, whatever their load.
- `follow_bootstrap_room` (`auto` on a prefill server): the request's bootstrap room, a
  random 63-bit number the PD router draws, modulo the ranks: a rank at random.
- `total_requests`: the rank with the fewest requests, running and waiting (ties to the lowest
  rank).
- `total_tokens`: the rank with the fewest tokens, those in its KV cache and those its waiting
  requests hold (servesim: `num_load_tokens`, work queued or resident), then the fewest
  requests, then the lowest rank.

For the two load methods the controller keeps a budget (`DPBudget`) that each dispatch bumps by
one request and the prompt's tokens, and that the ranks' published snapshots overwrite, read at
most every 20 ms (`refresh_load_budget`); a rank that has published nothing since the last read
keeps its bumps (`update_budget` skips a snapshot whose timestamp it has seen). A replica of
ranks publishes each rank's load as SGLang's schedulers do (`publish`: at a prompt step, every
15 decode steps, while idle); over replicas that publish nothing, every read takes the loads as
they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from sim.core.request import Request
from sim.routers.base import ROUTERS, ReplicaLoad, Router, RouterConfig


class SGLangDataParallelConfig(RouterConfig):
    load_balance_method: Literal["round_robin", "follow_bootstrap_room", "total_requests",
                                 "total_tokens"] = Field(
        "round_robin", description="--load-balance-method (auto: round_robin, on a prefill "
                                   "server follow_bootstrap_room)")
    refresh_interval_s: float = Field(
        0.02, ge=0, le=60, description="how often the controller reads the ranks' published "
                                       "loads (SGLang: at most every 20 ms)",
        json_schema_extra={"unit": "s"})


@ROUTERS.register("sglang_dp")
class SGLangDataParallel(Router):
    Config = SGLangDataParallelConfig

    def __init__(self, config: SGLangDataParallelConfig, rng: np.random.Generator,
                 published: bool = False) -> None:
        """`published`: the budget reads only what the ranks publish (`publish`: a replica
        of ranks); else the loads it is given, at each read."""
        super().__init__(config, rng)
        self.published = published
        self.method = config.load_balance_method
        self.interval_s = config.refresh_interval_s
        self._refreshed_s = -np.inf
        self._next = 0  # round_robin's counter
        self._budget: list[list[int]] = []  # per rank: [requests, tokens]
        # Per rank: its last published [requests, tokens, when], and when the budget last
        # took one of its snapshots (None: never).
        self._published: dict[int, tuple[int, int, float]] = {}
        self._read_s: dict[int, float] = {}

    def publish(self, index: int, load: ReplicaLoad, now_s: float) -> None:
        """Rank `index` publishes its load (`LoadInquirer`'s snapshot) at `now_s`."""
        self._published[index] = (load.num_running + load.num_waiting, load.num_load_tokens,
                                  now_s)

    def choose(self, req: Request, loads: Sequence[ReplicaLoad]) -> int:
        return self.choose_at(req, loads, req.arrival_s)

    def choose_at(self, req: Request, loads: Sequence[ReplicaLoad], now_s: float) -> int:
        num = len(loads)
        if self.method == "round_robin":
            index = self._next % num
            self._next = (index + 1) % num
            return index
        if self.method == "follow_bootstrap_room":
            return int(self.rng.integers(num))
        budget = self._budget
        if len(budget) != num:
            budget[:] = [[0, 0] for _ in range(num)]
        if now_s - self._refreshed_s >= self.interval_s:
            self._refreshed_s = now_s
            if not self.published:  # (replicas that publish nothing: their loads now)
                budget[:] = [[load.num_waiting + load.num_running, load.num_load_tokens]
                             for load in loads]
            for index, (num_requests, num_tokens, at_s) in self._published.items():
                if self._read_s.get(index) != at_s:
                    self._read_s[index] = at_s
                    budget[index] = [num_requests, num_tokens]
        if self.method == "total_requests":
            requests = [entry[0] for entry in budget]
            index = requests.index(min(requests))
        else:
            index = min(range(num), key=lambda i: (budget[i][1], budget[i][0], i))
        budget[index][0] += 1
        budget[index][1] += req.num_prompt_tokens
        return index
