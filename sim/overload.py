"""The overload verdict of a run: did a queue grow, and not drain? (`overload`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from sim.arrived import arrived_mask
from sim.columns import Table, column

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
    yet moving to a decode replica; a request never served counts as queued to the end. Each
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
            for name in ("arrival_s", "first_scheduled_s", "prefill_end_s", "transfer_start_s")}
    arrival = np.sort(kept["arrival_s"])
    if len(arrival) < MIN_REQUESTS_FOR_VERDICT:
        return {"verdict": "unknown", "detail": too_few(requests, MIN_REQUESTS_FOR_VERDICT)}
    queues = {"waiting": (kept["arrival_s"], kept["first_scheduled_s"]),
              "waiting_for_decode": (kept["prefill_end_s"], kept["transfer_start_s"])}
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
    for verdict in ("overloaded", "stable", "unknown"):
        matching = [f for f in found if f["verdict"] == verdict]
        if verdict == "stable":  # told over the run or its end: a quarter's limit is another
            matching = [f for f in matching
                        if f["growth_limit_share"] == GROWTH_LIMIT] or matching
        if matching:  # the queue and window closest to (or deepest in) overload
            return max(matching, key=lambda f: f.get("t", 0.0))
    return {"verdict": "unknown", "detail": "no queue to test"}


def too_few(requests: Table, minimum: int) -> str:
    """Why a test needing `minimum` arrived requests (rejected ones left out) cannot tell."""
    rejected = int((column(requests, "status") == "rejected").sum())
    if not rejected:
        return f"fewer than {minimum} requests arrived"
    return (f"fewer than {minimum} requests arrived and were admitted ({rejected:,} of "
            f"{len(column(requests, 'status')):,} rejected)")


def _growth(queue: str, window: str, times_s: np.ndarray, length: np.ndarray,
            growth_limit: float) -> dict[str, Any]:
    """Slope of `length` against `times_s` from batch means, with its standard error;
    overloaded when it is above `growth_limit` of the arrival rate and T_LIMIT errors."""
    span_s = float(times_s[-1] - times_s[0])
    if span_s <= 0:
        return {"verdict": "unknown", "detail": f"all arrivals of {window} come at once"}
    batches = np.array_split(np.arange(len(times_s)), 10)
    x = np.array([times_s[b].mean() for b in batches])
    y = np.array([length[b].mean() for b in batches])
    dx = x - x.mean()
    slope = float((dx * (y - y.mean())).sum() / (dx**2).sum())
    residual = y - y.mean() - slope * dx
    se = float(np.sqrt((residual**2).sum() / (len(x) - 2) / (dx**2).sum()))
    rate = (len(times_s) - 1) / span_s  # arrivals per second over the window
    share = slope / rate
    t = slope / se if se > 0 else (np.inf if slope > 0 else 0.0)
    overloaded = share > growth_limit and t > T_LIMIT
    verb = "grows" if slope > 0 else "shrinks"
    return {
        "verdict": "overloaded" if overloaded else "stable",
        "queue": queue,
        "growth_requests_per_s": slope,
        "growth_se": se,
        "growth_share_of_arrivals": share,
        "t": float(t),
        "growth_limit_share": growth_limit,
        "window_start_s": float(times_s[0]),
        "window": window,
        "detail": (f"{queue.replace('_', ' ')} queue {verb} by {abs(slope):.3g} requests/s "
                   f"({100 * abs(share):.1f}% of arrivals; {t:.1f} s.e.) over {window}"),
    }
