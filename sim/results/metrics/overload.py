"""The overload verdict of a run: did a queue grow, and not drain? (`overload`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from sim.results.columns import Table, column
from sim.results.metrics.arrived import arrived_mask

MIN_REQUESTS_FOR_VERDICT = 40
GROWTH_LIMIT = 0.01  # the queue grows by more than 1% of the arrival rate
T_LIMIT = 3.0  # and by more than 3 standard errors
# Over a quarter of the arrivals, by more than 5% of their rate: a stable queue near capacity
# wanders more over a shorter window (M/D/1 at 90% load, 2,000 requests: 6 of 40 seeds pass
# 1% in some quarter, none 5%; a trace's busy hour that builds a backlog grows by 10-20%).
BURST_GROWTH_LIMIT = 0.05


def overload(requests: Table, end_s: float) -> dict[str, Any]:
    """Did a queue grow, and not drain, over the run? `stable`, `overloaded`, or `unknown` (too
    few requests to tell).

    Queues: requests arrived but not yet scheduled, and (disaggregated) prefilled requests not
    yet moving to a decode replica, and those whose KV is on its way (queued for their link or
    on the wire: a link too slow for the load builds its backlog there); a request never
    served counts as queued to the end. Each
    is sampled at the arrival times, over the last half of the arrivals (still growing at the
    end?), over all of them (grown over the run, never drained: a backlog built early and
    carried to the end is overload too) and over each quarter of them (a burst that built a
    backlog, drained by the end or not: the burst's requests waited for it). Its slope
    against time comes from 10 batch means of consecutive samples (so correlated neighbours
    do not shrink the standard error), with that standard error. Under overload a queue
    grows at the arrival rate minus the service rate,
    so the slope over the arrival rate is the share of arrivals the system falls behind by:
    overloaded when that share is above 1% (5% over a quarter) and the slope is more than 3
    standard errors above zero. (A stable queue whose arrival rate rises grows far more slowly
    than 1% of arrivals.)"""
    arrived = arrived_mask(requests)
    kept = {name: column(requests, name)[arrived]  # only the columns read
            for name in ("arrival_s", "first_scheduled_s", "prefill_end_s", "transfer_start_s",
                         "transfer_end_s")}
    arrival = np.sort(kept["arrival_s"])
    if len(arrival) < MIN_REQUESTS_FOR_VERDICT:
        return {"verdict": "unknown", "detail": too_few(requests, MIN_REQUESTS_FOR_VERDICT)}
    queues = {"waiting": (kept["arrival_s"], kept["first_scheduled_s"]),
              "waiting_for_decode": (kept["prefill_end_s"], kept["transfer_start_s"]),
              "kv_transfer": (kept["transfer_start_s"], kept["transfer_end_s"])}
    # Each window's samples, and the growth that calls it overloaded.
    n = len(arrival)
    windows = {"the last half of the arrivals": (arrival[n // 2:], GROWTH_LIMIT),
               "the whole run": (arrival[n // 10:], GROWTH_LIMIT)}
    # A backlog built by a burst and drained before the end (a trace's busy hour) leaves no
    # slope over the whole run or its last half, yet every request of the burst waited for it.
    for k, name in enumerate(("first", "second", "third", "fourth")):
        windows[f"the {name} quarter of the arrivals"] = (
            arrival[k * n // 4:(k + 1) * n // 4], BURST_GROWTH_LIMIT)
    found: list[dict[str, Any]] = []
    for queue, (enter, leave) in queues.items():
        entered = ~np.isnan(enter)
        if not entered.any():
            continue
        into = np.sort(enter[entered])
        out = np.sort(np.where(np.isnan(leave), np.inf, leave)[entered])
        for window, (sample_s, growth_limit) in windows.items():
            length = (np.searchsorted(into, sample_s, side="right")
                      - np.searchsorted(out, sample_s, side="right"))
            found.append(_growth(queue, window, sample_s, length.astype(np.float64),
                                 growth_limit))
    return _timed_out(requests, _queue_verdict(found))


def _queue_verdict(found: list[dict[str, Any]]) -> dict[str, Any]:
    for verdict in ("overloaded", "stable", "unknown"):
        matching = [f for f in found if f["verdict"] == verdict]
        if verdict == "stable":  # told over the run or its end: a quarter's limit is another
            matching = [f for f in matching
                        if f["growth_limit_share"] == GROWTH_LIMIT] or matching
        if matching:  # the queue and window closest to (or deepest in) overload
            return max(matching, key=_t)
    return {"verdict": "unknown", "detail": "no queue to test"}


def _timed_out(requests: Table, verdict: dict[str, Any]) -> dict[str, Any]:
    """A run in which clients gave up (`workload.timeout_s`) after waiting in a queue for half
    their timeout or more is overloaded, whatever the queues' growth says: a timeout bounds how
    long a queue can grow. Requests that failed because serving them takes longer than the
    timeout (a long output on an idle server) are counted, not called overload."""
    status = column(requests, "status")
    failed = status == "failed"
    num_failed = int(failed.sum())
    if not num_failed:
        return verdict
    arrival = column(requests, "arrival_s")[failed]
    waited = column(requests, "first_scheduled_s")[failed] - arrival
    patience = column(requests, "failed_s")[failed] - arrival
    queued = int((np.isnan(waited) | (waited >= 0.5 * patience)).sum())
    failed_text = f"{num_failed:,} of {len(status):,} requests failed: their client gave up"
    if not queued:
        return {**verdict, "detail": f"{verdict['detail']}; {failed_text}, none after queueing "
                                     "(serving them outlasts workload.timeout_s)"}
    failed_text += f", {queued:,} after queueing half their timeout or more"
    if verdict["verdict"] == "overloaded":
        return {**verdict, "detail": f"{verdict['detail']}; {failed_text}"}
    return {"verdict": "overloaded", "num_failed": num_failed,
            "detail": f"{failed_text} (queues: {verdict['detail']})"}


def too_few(requests: Table, minimum: int) -> str:
    """Why a test needing `minimum` arrived requests (rejected ones left out) cannot tell."""
    rejected = int((column(requests, "status") == "rejected").sum())
    if not rejected:
        return f"fewer than {minimum} requests arrived"
    return (f"fewer than {minimum} requests arrived and were admitted ({rejected:,} of "
            f"{len(column(requests, 'status')):,} rejected)")


# A standard error below this share of the slope is rounding, not scatter: the fit is exact.
EXACT_SE = 1e-12


def _growth(queue: str, window: str, times_s: np.ndarray, length: np.ndarray,
            growth_limit: float) -> dict[str, Any]:
    """Slope of `length` against `times_s` from batch means, with its standard error;
    overloaded when it is above `growth_limit` of the arrival rate and T_LIMIT errors.

    The regression runs on times in units of the window's span (0 to 1): its sums of squares
    then stay well inside float64 however close together the arrivals come (in seconds, gaps
    of 1e-160 s square to zero and the slope was inf or NaN), and the share of arrivals and
    the t statistic, which do not depend on the unit, are computed in it. Every number
    returned is finite: a queue growing exactly linearly (no scatter, a standard error of 0)
    has `t` None, and a window too short for its growth in requests/s to be a float64
    (under about 1e-300 s) is `unknown`."""
    span_s = float(times_s[-1] - times_s[0])
    if span_s <= 0:
        return {"verdict": "unknown", "detail": f"all arrivals of {window} come at once"}
    unit = (times_s - times_s[0]) / span_s
    batches = np.array_split(np.arange(len(times_s)), 10)
    x = np.array([unit[b].mean() for b in batches])
    y = np.array([length[b].mean() for b in batches])
    dx = x - x.mean()
    sxx = float((dx**2).sum())  # > 0: sorted times spanning > 0 give unequal batch means
    slope_unit = float((dx * (y - y.mean())).sum() / sxx)  # requests per window span
    residual = y - y.mean() - slope_unit * dx
    se_unit = float(np.sqrt((residual**2).sum() / (len(x) - 2) / sxx))
    slope, se = slope_unit / span_s, se_unit / span_s
    if not (math.isfinite(slope) and math.isfinite(se)):
        return {"verdict": "unknown",
                "detail": f"the arrivals of {window} come within {span_s:.3g} s: too close "
                          "together to measure a queue's growth per second"}
    # Over the window `len - 1` arrivals came in `span_s`: the share is the slope over that rate.
    share = slope_unit / (len(times_s) - 1)
    # None: exact, no scatter to measure (a residual of rounding alone, a few ulps of the
    # slope, would give a t of 1e16).
    exact = se_unit <= EXACT_SE * abs(slope_unit)
    t = None if exact else slope_unit / se_unit
    overloaded = share > growth_limit and (slope > 0 if t is None else t > T_LIMIT)
    verb = "grows" if slope > 0 else "shrinks"
    errors = "exactly, no scatter" if t is None else f"{t:.1f} s.e."
    return {
        "verdict": "overloaded" if overloaded else "stable",
        "queue": queue,
        "growth_requests_per_s": slope,
        "growth_se": se,
        "growth_share_of_arrivals": share,
        "t": t,
        "growth_limit_share": growth_limit,
        "window_start_s": float(times_s[0]),
        "window": window,
        "detail": (f"{queue.replace('_', ' ')} queue {verb} by {abs(slope):.3g} requests/s "
                   f"({100 * abs(share):.1f}% of arrivals; {errors}) over {window}"),
    }


def _t(found: dict[str, Any]) -> float:
    """A window's t statistic for ranking; an exact slope (`t` None) ranks by its sign."""
    t = found.get("t", 0.0)
    if t is None:
        return math.inf if found["growth_requests_per_s"] > 0 else 0.0
    return float(t)
