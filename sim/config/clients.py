"""Closed-loop clients (`clients:`): at most `concurrency` requests in flight, as `vllm bench
serve --max-concurrency N` and GenAI-Perf's `--concurrency N` hold them, over any workload.

Each client sends a request, waits for its answer (the engine's finish plus the API front end
of the engine calibration), thinks for `think_time_s`, then sends the next one. Requests go in
the workload's order: unpaced (the default, `vllm bench serve` without `--request-rate`), each
the moment a client is free; `paced`, also not before its own arrival time in the workload
(a Poisson or trace schedule capped by the clients: `--request-rate R --max-concurrency N`).
A request's `arrival_s` in the results is when it was sent. A request the engine rejects, or
whose client gives up (`workload.timeout_s`), frees its client too.

`warmup_requests`: the first N requests sent are served as any other but not measured in the
summary's `trimmed` distributions (what `simulate` prints after the warm-up), as GenAI-Perf's
and AIPerf's `--warmup-request-count`. `duration_s`: the clients send for this long; requests
in flight then are answered, the rest never sent (`after_duration`), as inference-perf's stage
`duration` and AIPerf's `--benchmark-duration`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sim.config.base import Frozen
from sim.workloads.base import MAX_REQUESTS, MAX_SPAN_S

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
    warmup_requests: int = Field(0, ge=0, le=MAX_REQUESTS,
                                 description="the first N requests sent are not measured")
    duration_s: float | None = Field(None, gt=0, le=MAX_SPAN_S,
                                     description="send for this long, then stop sending (those "
                                                 "in flight finish); none: send them all")
