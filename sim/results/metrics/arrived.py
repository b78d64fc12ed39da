"""Latencies over every arrived request, unfinished ones counted as lower bounds (censored).

The headline distributions of a summary (`sim.results.metrics.summary`) are over finished requests,
biased low when a horizon cuts a queue; these are over every request that arrived and was not
rejected, with each percentile marked where it is only a lower bound and bounded from above."""

from __future__ import annotations

from typing import Any

import numpy as np

from sim.results.columns import Table, column
from sim.results.metrics.summary import PERCENTILES, distribution, never_arrived

# For each latency, the event that ends it; a request without the event by the end of the run
# contributes its time so far (end of run - arrival), a lower bound.
ARRIVED_LATENCIES = {"ttft_s": "first_token_s", "e2e_s": "finish_s",
                     "scheduling_delay_s": "first_scheduled_s"}
ARRIVED = "arrived"  # every request that arrived before the end of the run and was not rejected

def arrived_mask(requests: Table) -> np.ndarray:
    """The requests that arrived (before the horizon) and were not rejected: finished ones,
    failed ones (their client gave up), and unfinished ones queued or in progress at the end.
    Rejected requests (never admitted: too long for the KV cache, or refused) are counted
    apart, in `requests.rejected`, as vLLM's benchmark counts failed requests apart; requests
    after the horizon (or after an interrupted replay stopped) never arrived."""
    return (column(requests, "status") != "rejected") & ~never_arrived(requests)


def arrived_latencies(requests: Table, end_s: float, arrived: np.ndarray | None = None
                      ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per latency of ARRIVED_LATENCIES, over the arrived requests in frame order (`arrived`:
    `arrived_mask`, if already made): (values, censored), where a censored value is a lower
    bound (the event had not happened by `end_s`, or by the request's failure, its client
    having given up; the value is the time from arrival to then)."""
    if arrived is None:
        arrived = arrived_mask(requests)
    arrival = column(requests, "arrival_s")[arrived]
    ended = np.full(len(arrival), end_s)
    if "failed_s" in requests:  # a request its client gave up on is known no further
        failed_s = column(requests, "failed_s")[arrived]
        ended = np.where(np.isnan(failed_s), ended, failed_s)
    so_far = np.maximum(ended - arrival, 0.0)
    out = {}
    for key, event in ARRIVED_LATENCIES.items():
        censored = np.isnan(column(requests, event)[arrived])
        out[key] = (np.where(censored, so_far, column(requests, key)[arrived]), censored)
    return out


def censored_distribution(values: np.ndarray, censored: np.ndarray) -> dict[str, Any]:
    """`distribution` of a sample in which `values[censored]` are lower bounds (the true value
    is at least that), with how many there are and which statistics are lower bounds.

    The true sample is this one with some entries raised, so each of its order statistics, and
    hence each percentile, mean and max, is at least the one shown. A percentile is interpolated
    from the order statistics at ranks floor(h) and ceil(h), h = (n - 1) p / 100 (numpy's
    'linear'): raising values above both leaves it as it is. So it is exact when every
    censored value lies above the higher of the two, and marked a lower bound when one lies at
    or below it (that value, raised, could move past it). The mean and max are lower bounds
    whenever any value is.

    `at_most` bounds each percentile from above: its value were every lower bound infinite
    (None where that makes it infinite too); the true percentile lies between the two."""
    arr = np.asarray(values, dtype=np.float64)
    keep = np.isfinite(arr)
    arr, cens = arr[keep], np.asarray(censored, dtype=bool)[keep]
    out: dict[str, Any] = dict(distribution(arr))
    num_censored = int(cens.sum())
    out["num_lower_bounds"] = num_censored
    flags = dict.fromkeys(["mean", *(f"p{p}" for p in PERCENTILES), "max"], num_censored > 0)
    at_most: dict[str, float | None] = {f"p{p}": out[f"p{p}"] for p in PERCENTILES}
    if num_censored:
        virtual = (arr.size - 1) * np.true_divide(np.asarray(PERCENTILES), 100)
        upper = np.minimum(np.ceil(virtual).astype(np.intp), arr.size - 1)
        lowest = float(arr[cens].min())
        ordered = np.sort(arr)
        # The sample with every lower bound infinite, as far as a percentile reads it: the
        # order statistics up to `upper` (the rest, at the largest value, are read only with
        # weight 0). Infinite where `upper` reaches a lower bound.
        worst = np.percentile(np.where(cens, arr.max(), arr), PERCENTILES)
        num_exact = arr.size - num_censored
        for p, rank, high in zip(PERCENTILES, upper, worst, strict=True):
            flags[f"p{p}"] = lowest <= float(ordered[rank])
            at_most[f"p{p}"] = float(high) if rank < num_exact else None
    out["is_lower_bound"] = flags
    out["at_most"] = at_most
    return out


def arrived_stats(requests: Table, end_s: float) -> dict[str, Any]:
    """`ttft_all_arrived_s`, `e2e_all_arrived_s` and `scheduling_delay_all_arrived_s`: over every
    arrived request (see `arrived_mask`), a request that had not reached the event by the end
    of the run (`end_s`) counted at its time so far, a lower bound. The headline distributions
    (`ttft_s`, ...) are over finished requests only, and so biased low when a horizon cuts a
    queue: these are not."""
    return {f"{key.removesuffix('_s')}_all_arrived_s": {
        **censored_distribution(values, censored), "population": ARRIVED}
        for key, (values, censored) in arrived_latencies(requests, end_s).items()}
