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
    reasons = requests.loc[requests["reason"] != "", "reason"].value_counts()
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


def replica_stats(iterations: pd.DataFrame, num_kv_blocks: dict[int, int], span_s: float
                  ) -> list[dict[str, Any]]:
    """Per replica: iterations, busy fraction, queue length and KV utilisation over its
    iterations (time-weighted by iteration duration)."""
    out = []
    by_replica = dict(list(iterations.groupby("replica_id", sort=True)))
    for replica_id in sorted(num_kv_blocks):
        its = by_replica.get(replica_id, iterations.iloc[:0])
        duration = its["duration_s"].to_numpy()
        busy_s = float(duration.sum())
        weights = duration / busy_s if busy_s > 0 else np.ones_like(duration)
        kv = its["num_kv_blocks_used"].to_numpy() / num_kv_blocks[replica_id]
        waiting = its["num_waiting"].to_numpy()
        out.append({
            "replica_id": replica_id,
            "pool": str(its["pool"].iloc[0]) if len(its) else None,
            "num_iterations": len(its),
            "busy_fraction": busy_s / span_s if span_s > 0 else None,
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
