"""Summary metrics: pure functions of a run's tables (its `Columns`, or DataFrames read back)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from sim.columns import Table, column, num_rows
from sim.config import SLOConfig

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class WeightedSample:
    """A sample kept as values with counts: `values[i]` occurs `counts[i]` times (the pooled
    TBT gaps, whose expansion would hold one entry per generated token)."""

    values: np.ndarray  # float64
    counts: np.ndarray  # int64, >= 0

    @classmethod
    def of(cls, values: ArrayLike | WeightedSample) -> WeightedSample:
        if isinstance(values, WeightedSample):
            return values
        arr = np.asarray(values, dtype=np.float64)
        return cls(arr, np.ones(arr.shape, dtype=np.int64))

    @property
    def size(self) -> int:
        return int(self.counts.sum())

    def fraction_at_most(self, limit: float) -> float | None:
        """Share of the sample <= limit, as `(expanded <= limit).mean()` gives it."""
        total = self.size
        return int(self.counts[self.values <= limit].sum()) / total if total else None


def distribution(values: ArrayLike | WeightedSample) -> dict[str, float | int | None]:
    """Count, mean, P50/P90/P99 and max of the finite values (None where there are none).

    A `WeightedSample` gives what its expansion would: the same count, percentiles and max
    (numpy's default 'linear' percentiles, exactly), and the mean up to rounding (summed as
    value times count, not one value at a time)."""
    if isinstance(values, WeightedSample):
        return _weighted_distribution(values)
    arr = np.asarray(values, dtype=np.float64)
    arr = arr[np.isfinite(arr)]
    out: dict[str, float | int | None] = {"count": int(arr.size)}
    if arr.size == 0:
        out.update({"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None})
        return out
    out["mean"] = float(arr.mean())
    for p, q in zip(PERCENTILES, np.percentile(arr, PERCENTILES), strict=True):
        out[f"p{p}"] = float(q)
    out["max"] = float(arr.max())
    return out


def _weighted_distribution(sample: WeightedSample) -> dict[str, float | int | None]:
    values = np.asarray(sample.values, dtype=np.float64)
    counts = np.asarray(sample.counts, dtype=np.int64)
    keep = np.isfinite(values) & (counts > 0)
    if not keep.all():
        values, counts = values[keep], counts[keep]
    del keep
    total = int(counts.sum())
    out: dict[str, float | int | None] = {"count": total}
    if total == 0:
        out.update({"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None})
        return out
    out["mean"] = float((values * counts).sum() / total)
    order = np.argsort(values)  # equal values are interchangeable: any order of ties
    values, counts = values[order], counts[order]
    del order
    np.cumsum(counts, out=counts)
    for p, q in zip(PERCENTILES, weighted_percentile(values, counts, PERCENTILES),
                    strict=True):
        out[f"p{p}"] = float(q)
    out["max"] = float(values[-1])
    return out


def weighted_percentile(sorted_values: np.ndarray, cumulative_counts: np.ndarray,
                        percentiles: Sequence[float]) -> np.ndarray:
    """`np.percentile(expanded, percentiles)` (method 'linear') of the sample in which
    `sorted_values[i]` (ascending) occurs `cumulative_counts[i] - cumulative_counts[i - 1]`
    times, without expanding it: the same order statistics, interpolated by the same float
    operations (numpy/lib/_function_base_impl.py: `_quantile`, `_get_indexes`, `_lerp`)."""
    n = int(cumulative_counts[-1])
    quantiles = np.true_divide(np.asarray(percentiles), 100)
    virtual = (n - 1) * quantiles
    previous = np.floor(virtual)
    following = previous + 1
    above = virtual >= n - 1  # numpy takes the largest value (index -1) for both
    previous[above] = -1
    following[above] = -1
    below = virtual < 0
    previous[below] = 0
    following[below] = 0
    gamma = virtual - previous.astype(np.intp)

    def order_statistic(index: np.ndarray) -> np.ndarray:
        position = np.where(index < 0, n + index, index).astype(np.int64)
        return sorted_values[np.searchsorted(cumulative_counts, position, side="right")]

    a, b = order_statistic(previous), order_statistic(following)
    diff_b_a = b - a
    result = np.add(a, diff_b_a * gamma)
    np.subtract(b, diff_b_a * (1 - gamma), out=result, where=gamma >= 0.5)
    return result


# The request columns that the summary's distributions read, of finished requests only.
FINISHED_COLUMNS = ["ttft_s", "max_tbt_s", "tpot_s", "e2e_s", "scheduling_delay_s"]


FINISHED = "finished"  # the population of the headline distributions


def finished_distribution(values: np.ndarray) -> dict[str, Any]:
    """`distribution` of finished requests' values, saying so (`population: finished`): with a
    horizon or rejections that is not every request (see `arrived_stats`)."""
    return {**distribution(values), "population": FINISHED}


def summarize(requests: Table, iterations: Table | int,
              tbt_gaps_s: np.ndarray | WeightedSample, slo: SLOConfig) -> dict[str, Any]:
    """Latency distributions, throughput, outcome counts and SLO attainment of one run.
    `iterations`: the iteration frame, or just its length; `tbt_gaps_s`: every gap between
    consecutive tokens of a request, pooled (or as values with counts). The per-request
    distributions are over finished requests (`population: finished`); `arrived_stats` adds
    them over every arrived request, and `warmup_stats` trimmed of the start-up transient."""
    status = column(requests, "status")
    done = status == FINISHED
    # Only the columns it reads, of finished requests (not a copy of the whole table).
    finished = {col: column(requests, col)[done] for col in FINISHED_COLUMNS}
    num_finished = int(done.sum())
    end_s = float(np.nanmax(column(requests, "finish_s"))) if num_finished else 0.0
    start_s = float(column(requests, "arrival_s").min()) if len(status) else 0.0
    span_s = max(end_s - start_s, 0.0)
    counts = Counter(status.tolist())
    # Reasons are `kind: detail`; count them by kind (one key per kind, not per number).
    reasons = Counter(reason.split(":", 1)[0] for reason in column(requests, "reason").tolist()
                      if reason)
    return {
        "requests": {
            "total": len(status),
            "finished": int(counts.get("finished", 0)),
            "rejected": int(counts.get("rejected", 0)),
            "unfinished": int(counts.get("unfinished", 0)),
            "reasons": {str(k): int(v) for k, v in sorted(reasons.items())},
        },
        "ttft_s": finished_distribution(finished["ttft_s"]),
        "tbt_s": distribution(tbt_gaps_s),
        "max_tbt_per_request_s": finished_distribution(finished["max_tbt_s"]),
        "tpot_s": finished_distribution(finished["tpot_s"]),
        "e2e_s": finished_distribution(finished["e2e_s"]),
        "scheduling_delay_s": finished_distribution(finished["scheduling_delay_s"]),
        "throughput": {
            "span_s": span_s,
            "requests_per_s": num_finished / span_s if span_s > 0 else None,
            "output_tokens_per_s": (
                float(column(requests, "num_generated_tokens").sum()) / span_s
                if span_s > 0 else None
            ),
        },
        "num_iterations": iterations if isinstance(iterations, int) else num_rows(iterations),
        "num_preemptions": int(column(requests, "num_preemptions").sum()),
        "slo": slo_attainment(requests, tbt_gaps_s, slo),
    }


def slo_attainment(requests: Table, tbt_gaps_s: np.ndarray | WeightedSample,
                   slo: SLOConfig) -> dict[str, float | None]:
    """Fraction of all requests meeting each target; a request not finished meets none."""
    finished = column(requests, "status") == FINISHED
    if len(finished) == 0:
        return {}
    ok = finished.copy()
    out: dict[str, float | None] = {}
    if slo.ttft_s is not None:
        ttft_ok = finished & (column(requests, "ttft_s") <= slo.ttft_s)
        out["ttft_attainment"] = float(ttft_ok.mean())
        ok &= ttft_ok
    if slo.tbt_s is not None:
        worst = column(requests, "max_tbt_s")
        tbt_ok = finished & ~(worst > slo.tbt_s)  # a one-token request has no gap: it meets it
        out["tbt_attainment"] = float(tbt_ok.mean())
        out["tbt_gap_attainment"] = WeightedSample.of(tbt_gaps_s).fraction_at_most(slo.tbt_s)
        ok &= tbt_ok
    if out:
        out["all_attainment"] = float(ok.mean())
    return out


def replica_stats(iterations: Table, num_kv_blocks: dict[int, int], end_s: float
                  ) -> list[dict[str, Any]]:
    """Per replica: iterations, busy fraction of the run [0, end_s], queue length and KV
    utilisation over its iterations (time-weighted: what an iteration logged holds until it
    ends, or until the next starts if that is sooner, as on a pipelined replica)."""
    # Each replica's rows as slices of the columns read (the table's rows come grouped by
    # replica; otherwise they are grouped here, in order within each replica).
    replica_id = column(iterations, "replica_id")
    names = ["start_s", "duration_s", "num_kv_blocks_used", "num_waiting"]
    columns = {name: column(iterations, name) for name in names + ["pool"]}
    if (replica_id[1:] < replica_id[:-1]).any():
        order = np.argsort(replica_id, kind="stable")
        replica_id = replica_id[order]
        columns = {name: col[order] for name, col in columns.items()}
    out = []
    for replica_id_ in sorted(num_kv_blocks):
        lo, hi = np.searchsorted(replica_id, [replica_id_, replica_id_ + 1])
        n = int(hi - lo)
        duration = columns["duration_s"][lo:hi]
        # The time covered by at least one iteration within the run, so busy fraction <= 1: a
        # pipelined replica's iterations overlap (each starts before the one ahead ends; they
        # end in order), so each counts only from where the one before it ended.
        start = columns["start_s"][lo:hi]
        end = start + duration
        covered_from = np.concatenate((start[:1], np.maximum(start[1:], end[:-1])))
        busy_s = float((np.minimum(end, end_s) - np.minimum(covered_from, end_s)).sum())
        # Queue and KV as logged by each iteration hold until the next one starts: a pipelined
        # iteration weighs only until the next is sent, so overlapping passes count time once.
        # Back-to-back iterations weigh their durations, as the numbers were before pipelines.
        held = duration.copy()
        overlap = start[1:] < end[:-1]
        held[:-1][overlap] = (start[1:] - start[:-1])[overlap]
        weights = held / held.sum() if held.sum() > 0 else np.ones_like(held)
        kv = columns["num_kv_blocks_used"][lo:hi] / num_kv_blocks[replica_id_]
        waiting = columns["num_waiting"][lo:hi]
        out.append({
            "replica_id": replica_id_,
            "pool": str(columns["pool"][lo]) if n else None,
            "num_iterations": n,
            "busy_fraction": busy_s / end_s if end_s > 0 else None,
            "mean_queue_length": float((waiting * weights).sum()) if n else None,
            "max_queue_length": int(waiting.max()) if n else 0,
            "mean_kv_utilization": float((kv * weights).sum()) if n else None,
            "max_kv_utilization": float(kv.max()) if n else None,
        })
    return out


def pool_stats(replicas: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per pool (colocated, prefill, decode): its replicas' figures averaged, maxima kept."""
    out: dict[str, dict[str, Any]] = {}
    for pool in sorted({r["pool"] for r in replicas if r["pool"] is not None}):
        members = [r for r in replicas if r["pool"] == pool]

        def mean(key: str, members: list[dict[str, Any]] = members) -> float | None:
            values = [r[key] for r in members if r[key] is not None]
            return float(np.mean(values)) if values else None

        out[pool] = {
            "num_replicas": len(members),
            "num_iterations": sum(r["num_iterations"] for r in members),
            "mean_busy_fraction": mean("busy_fraction"),
            "mean_queue_length": mean("mean_queue_length"),
            "max_queue_length": max(r["max_queue_length"] for r in members),
            "mean_kv_utilization": mean("mean_kv_utilization"),
            "max_kv_utilization": max((r["max_kv_utilization"] or 0.0) for r in members),
        }
    return out


def transfer_stats(requests: Table) -> dict[str, Any]:
    """Disaggregated serving: how long KV waited for decode capacity and how long it moved."""
    return {"decode_wait_s": distribution(column(requests, "decode_wait_s")),
            "transfer_s": distribution(column(requests, "transfer_s"))}


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
        return {"verdict": "unknown",
                "detail": f"fewer than {MIN_REQUESTS_FOR_VERDICT} requests arrived"}
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


# Censoring: latencies over every arrived request, unfinished ones as lower bounds.

# For each latency, the event that ends it; a request without the event by the end of the run
# contributes its time so far (end of run - arrival), a lower bound.
ARRIVED_LATENCIES = {"ttft_s": "first_token_s", "e2e_s": "finish_s",
                     "scheduling_delay_s": "first_scheduled_s"}
ARRIVED = "arrived"  # every request that arrived before the end of the run and was not rejected


def arrived_mask(requests: Table) -> np.ndarray:
    """The requests that arrived (before the horizon) and were not rejected: finished ones, and
    unfinished ones queued or in progress at the end. Rejected requests (never admitted: too
    long for the KV cache, or refused) are counted apart, in `requests.rejected`, as vLLM's
    benchmark counts failed requests apart; requests after the horizon never arrived."""
    reasons = column(requests, "reason").tolist()
    after_horizon = np.fromiter((reason.startswith("after_horizon") for reason in reasons),
                                dtype=bool, count=len(reasons))
    return (column(requests, "status") != "rejected") & ~after_horizon


def arrived_latencies(requests: Table, end_s: float, arrived: np.ndarray | None = None
                      ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per latency of ARRIVED_LATENCIES, over the arrived requests in frame order (`arrived`:
    `arrived_mask`, if already made): (values, censored), where a censored value is a lower
    bound (the event had not happened by `end_s`; the value is the time from arrival to
    `end_s`)."""
    if arrived is None:
        arrived = arrived_mask(requests)
    arrival = column(requests, "arrival_s")[arrived]
    so_far = np.maximum(end_s - arrival, 0.0)
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
