"""Summary metrics: pure functions of the result DataFrames."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from sim.config import SLOConfig

PERCENTILES = (50, 90, 99)


def distribution(values: np.ndarray | pd.Series) -> dict[str, float | int | None]:
    """Count, mean, P50/P90/P99 and max of the finite values (None where there are none)."""
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


def summarize(requests: pd.DataFrame, iterations: pd.DataFrame, tbt_gaps_s: np.ndarray,
              slo: SLOConfig) -> dict[str, Any]:
    """Latency distributions, throughput, outcome counts and SLO attainment of one run."""
    finished = requests[requests["status"] == "finished"]
    end_s = float(np.nanmax(requests["finish_s"])) if len(finished) else 0.0
    start_s = float(requests["arrival_s"].min()) if len(requests) else 0.0
    span_s = max(end_s - start_s, 0.0)
    counts = requests["status"].value_counts()
    # Reasons are `kind: detail`; count them by kind (one key per kind, not per number).
    reasons = requests.loc[requests["reason"] != "", "reason"].str.split(":").str[0].value_counts()
    return {
        "requests": {
            "total": len(requests),
            "finished": int(counts.get("finished", 0)),
            "rejected": int(counts.get("rejected", 0)),
            "unfinished": int(counts.get("unfinished", 0)),
            "reasons": {str(k): int(v) for k, v in sorted(reasons.items())},
        },
        "ttft_s": distribution(finished["ttft_s"]),
        "tbt_s": distribution(tbt_gaps_s),
        "max_tbt_per_request_s": distribution(finished["max_tbt_s"]),
        "tpot_s": distribution(finished["tpot_s"]),
        "e2e_s": distribution(finished["e2e_s"]),
        "scheduling_delay_s": distribution(finished["scheduling_delay_s"]),
        "throughput": {
            "span_s": span_s,
            "requests_per_s": len(finished) / span_s if span_s > 0 else None,
            "output_tokens_per_s": (
                float(requests["num_generated_tokens"].sum()) / span_s if span_s > 0 else None
            ),
        },
        "num_iterations": len(iterations),
        "num_preemptions": int(requests["num_preemptions"].sum()),
        "slo": slo_attainment(requests, tbt_gaps_s, slo),
    }


def slo_attainment(requests: pd.DataFrame, tbt_gaps_s: np.ndarray, slo: SLOConfig
                   ) -> dict[str, float | None]:
    """Fraction of all requests meeting each target; a request not finished meets none."""
    total = len(requests)
    if total == 0:
        return {}
    finished = (requests["status"] == "finished").to_numpy()
    ok = finished.copy()
    out: dict[str, float | None] = {}
    if slo.ttft_s is not None:
        ttft_ok = finished & (requests["ttft_s"].to_numpy() <= slo.ttft_s)
        out["ttft_attainment"] = float(ttft_ok.mean())
        ok &= ttft_ok
    if slo.tbt_s is not None:
        worst = requests["max_tbt_s"].to_numpy()
        tbt_ok = finished & ~(worst > slo.tbt_s)  # a one-token request has no gap: it meets it
        out["tbt_attainment"] = float(tbt_ok.mean())
        out["tbt_gap_attainment"] = (
            float((tbt_gaps_s <= slo.tbt_s).mean()) if tbt_gaps_s.size else None
        )
        ok &= tbt_ok
    if out:
        out["all_attainment"] = float(ok.mean())
    return out


def replica_stats(iterations: pd.DataFrame, num_kv_blocks: dict[int, int], end_s: float
                  ) -> list[dict[str, Any]]:
    """Per replica: iterations, busy fraction of the run [0, end_s], queue length and KV
    utilisation over its iterations (time-weighted by iteration duration)."""
    out = []
    by_replica = dict(list(iterations.groupby("replica_id", sort=True, observed=True)))
    for replica_id in sorted(num_kv_blocks):
        its = by_replica.get(replica_id, iterations.iloc[:0])
        duration = its["duration_s"].to_numpy()
        # A replica's iterations never overlap, so the time they cover within the run is at
        # most the run's length: busy fraction <= 1.
        start = its["start_s"].to_numpy()
        busy_s = float((np.minimum(start + duration, end_s) - np.minimum(start, end_s)).sum())
        weights = duration / duration.sum() if duration.sum() > 0 else np.ones_like(duration)
        kv = its["num_kv_blocks_used"].to_numpy() / num_kv_blocks[replica_id]
        waiting = its["num_waiting"].to_numpy()
        out.append({
            "replica_id": replica_id,
            "pool": str(its["pool"].iloc[0]) if len(its) else None,
            "num_iterations": len(its),
            "busy_fraction": busy_s / end_s if end_s > 0 else None,
            "mean_queue_length": float((waiting * weights).sum()) if len(its) else None,
            "max_queue_length": int(waiting.max()) if len(its) else 0,
            "mean_kv_utilization": float((kv * weights).sum()) if len(its) else None,
            "max_kv_utilization": float(kv.max()) if len(its) else None,
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


def transfer_stats(requests: pd.DataFrame) -> dict[str, Any]:
    """Disaggregated serving: how long KV waited for decode capacity and how long it moved."""
    return {"decode_wait_s": distribution(requests["decode_wait_s"]),
            "transfer_s": distribution(requests["transfer_s"])}


MIN_REQUESTS_FOR_VERDICT = 40
GROWTH_LIMIT = 0.01  # the queue grows by more than 1% of the arrival rate
T_LIMIT = 3.0  # and by more than 3 standard errors


def overload(requests: pd.DataFrame, end_s: float) -> dict[str, Any]:
    """Did a queue grow, and not drain, over the run? `stable`, `overloaded`, or `unknown` (too
    few requests to tell).

    Queues: requests arrived but not yet scheduled, and (disaggregated) prefilled requests not
    yet moving to a decode replica; a request never served counts as queued to the end. Each
    is sampled at the arrival times, over the last half of the arrivals (still growing at the
    end?) and over all of them (grown over the run, never drained: a backlog built early and
    carried to the end is overload too). Its slope against time comes from 10 batch means of
    consecutive samples (so correlated neighbours do not shrink the standard error), with that
    standard error. Under overload a queue grows at the arrival rate minus the service rate,
    so the slope over the arrival rate is the share of arrivals the system falls behind by:
    overloaded when that share is above 1% and the slope is more than 3 standard errors above
    zero. (A stable queue whose arrival rate rises grows far more slowly than 1% of arrivals.)"""
    kept = requests[(requests["status"] != "rejected")
                    & ~requests["reason"].str.startswith("after_horizon")]
    arrival = np.sort(kept["arrival_s"].to_numpy())
    if len(arrival) < MIN_REQUESTS_FOR_VERDICT:
        return {"verdict": "unknown",
                "detail": f"fewer than {MIN_REQUESTS_FOR_VERDICT} requests arrived"}
    queues = {"waiting": (kept["arrival_s"], kept["first_scheduled_s"]),
              "waiting_for_decode": (kept["prefill_end_s"], kept["transfer_start_s"])}
    windows = {"the last half of the arrivals": arrival[len(arrival) // 2:],
               "the whole run": arrival[len(arrival) // 10:]}
    found: list[dict[str, Any]] = []
    for queue, (enter, leave) in queues.items():
        entered = enter.notna().to_numpy()
        if not entered.any():
            continue
        into = np.sort(enter.to_numpy()[entered])
        out = np.sort(np.where(leave.notna(), leave, np.inf)[entered])
        for window, sample_s in windows.items():
            length = (np.searchsorted(into, sample_s, side="right")
                      - np.searchsorted(out, sample_s, side="right"))
            found.append(_growth(queue, window, sample_s, length.astype(np.float64)))
    for verdict in ("overloaded", "stable", "unknown"):
        matching = [f for f in found if f["verdict"] == verdict]
        if matching:  # the queue and window closest to (or deepest in) overload
            return max(matching, key=lambda f: f.get("t", 0.0))
    return {"verdict": "unknown", "detail": "no queue to test"}


def _growth(queue: str, window: str, times_s: np.ndarray, length: np.ndarray
            ) -> dict[str, Any]:
    """Slope of `length` against `times_s` from batch means, with its standard error."""
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
    overloaded = share > GROWTH_LIMIT and t > T_LIMIT
    verb = "grows" if slope > 0 else "shrinks"
    return {
        "verdict": "overloaded" if overloaded else "stable",
        "queue": queue,
        "growth_requests_per_s": slope,
        "growth_se": se,
        "growth_share_of_arrivals": share,
        "t": float(t),
        "window_start_s": float(times_s[0]),
        "window": window,
        "detail": (f"{queue.replace('_', ' ')} queue {verb} by {abs(slope):.3g} requests/s "
                   f"({100 * abs(share):.1f}% of arrivals; {t:.1f} s.e.) over {window}"),
    }
