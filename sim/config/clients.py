"""Closed-loop clients (`clients:`): at most `concurrency` requests in flight, as `vllm bench
serve --max-concurrency N` and GenAI-Perf's `--concurrency N` hold them, over any workload.

Each client sends a request, waits for its answer (the engine's finish plus the API front end
of the engine calibration), thinks for `think_time_s`, then sends the next one. Requests go in
the workload's order: unpaced (the default, `vllm bench serve` without `--request-rate`), each
the moment a client is free; `paced`, also not before its own arrival time in the workload
(a Poisson or trace schedule capped by the clients: `--request-rate R --max-concurrency N`).
A request's `arrival_s` in the results is when it was sent. A request the engine rejects, or
whose client gives up (`workload.timeout_s`), frees its client too."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sim.config.base import Frozen

MAX_CONCURRENCY = 1_000_000


class ClientsConfig(Frozen):
    concurrency: int = Field(gt=0, le=MAX_CONCURRENCY,
                             description="requests in flight at most: one per client")
    think_time_s: float = Field(0.0, ge=0, le=1e6,
                                description="a client's pause between an answer and its next "
                                            "request (mean, if exponential)")
    think_time: Literal["fixed", "exponential"] = Field(
        "fixed", description="fixed, or exponential with mean think_time_s")
    paced: bool = Field(False, description="also wait for each request's own arrival time in "
                                           "the workload (a rate capped by the clients)")
