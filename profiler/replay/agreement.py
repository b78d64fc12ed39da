"""How far two runs of the same requests are apart: the arithmetic of `servesim validate`.

Pure functions of result directories (summary.json, requests.parquet, iterations.parquet), so the
error table can be checked on hand-made folders, and of a replay's iteration times against a
latency model's predictions. Errors are signed and relative to the reference run (a replay):
(other - reference) / reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

# Table column -> (summary key, statistic).
METRICS: dict[str, tuple[str, str]] = {
    "ttft_p50": ("ttft_s", "p50"), "ttft_p90": ("ttft_s", "p90"), "ttft_p99": ("ttft_s", "p99"),
    "tbt_p50": ("tbt_s", "p50"), "tbt_p90": ("tbt_s", "p90"), "tbt_p99": ("tbt_s", "p99"),
    "e2e_p50": ("e2e_s", "p50"), "e2e_p90": ("e2e_s", "p90"), "e2e_p99": ("e2e_s", "p99"),
    "sched_delay_p50": ("scheduling_delay_s", "p50"),
    "throughput": ("throughput", "output_tokens_per_s"),
}
# What must match for two runs to have made the same plans.
PLAN_COLUMNS = ("num_prefill_tokens", "num_decode_tokens", "num_seqs", "num_preempted")


def read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def metric_values(summary: dict[str, Any]) -> dict[str, float | None]:
    return {name: summary[key][stat] for name, (key, stat) in METRICS.items()}


def relative_error(reference: float | None, other: float | None) -> float | None:
    """(other - reference) / reference; None where either is missing or the reference is 0."""
    if reference is None or other is None or reference == 0:
        return None
    return (other - reference) / reference


def metric_errors(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, float | None]:
    """Signed relative error of each table metric, from two summaries."""
    ref, oth = metric_values(reference), metric_values(other)
    return {name: relative_error(ref[name], oth[name]) for name in METRICS}


def plan_agreement(reference: pd.DataFrame, other: pd.DataFrame) -> dict[str, Any]:
    """Iteration by iteration: the same batches? `first_divergence` is the first iteration
    whose token counts, batch size or preemptions differ (None if none do)."""
    n = min(len(reference), len(other))
    same = np.ones(n, dtype=bool)
    for col in PLAN_COLUMNS:
        same &= reference[col].to_numpy()[:n] == other[col].to_numpy()[:n]
    diverged = np.flatnonzero(~same)
    first = int(diverged[0]) if diverged.size else (n if len(reference) != len(other) else None)
    return {"same_plans": first is None, "first_divergence": first,
            "num_iterations": [len(reference), len(other)]}


def request_agreement(reference: pd.DataFrame, other: pd.DataFrame) -> dict[str, Any]:
    """Request by request: same outcome and token count, and the largest relative gap of TTFT
    and of E2E among requests finished in both."""
    ref = reference.set_index("request_id")
    oth = other.set_index("request_id").reindex(ref.index)
    same = ((ref["status"] == oth["status"])
            & (ref["num_generated_tokens"] == oth["num_generated_tokens"]))
    both = (ref["status"] == "finished") & (oth["status"] == "finished")
    out: dict[str, Any] = {"same_outcomes": bool(same.all()),
                           "num_different_outcomes": int((~same).sum())}
    for col in ("ttft_s", "e2e_s"):
        r, o = ref.loc[both, col].to_numpy(), oth.loc[both, col].to_numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.abs(o - r) / r
        rel = rel[np.isfinite(rel)]
        out[f"max_request_{col.removesuffix('_s')}_error"] = float(rel.max()) if rel.size else None
    return out


def verdict(summary: dict[str, Any]) -> str | None:
    """A run's overload verdict (stable, overloaded, unknown); None where it has none."""
    overload = summary.get("overload")
    return overload.get("verdict") if isinstance(overload, dict) else None


def compare_runs(reference_dir: Path, other_dir: Path) -> dict[str, Any]:
    """Everything the table says about `other` against `reference`."""
    ref, oth = Path(reference_dir), Path(other_dir)
    ref_summary, other_summary = read_summary(ref), read_summary(oth)
    out: dict[str, Any] = metric_errors(ref_summary, other_summary)
    out.update(reference_verdict=verdict(ref_summary), verdict=verdict(other_summary))
    out.update(plan_agreement(pd.read_parquet(ref / "iterations.parquet"),
                              pd.read_parquet(oth / "iterations.parquet")))
    out.update(request_agreement(pd.read_parquet(ref / "requests.parquet"),
                                 pd.read_parquet(oth / "requests.parquet")))
    return out


def iteration_error(measured_s: np.ndarray, predicted_s: np.ndarray) -> dict[str, float]:
    """Per-iteration error of a latency model on the iterations that ran: median signed and
    mean absolute relative error, and the error of the total (what end-to-end time feels)."""
    measured = np.asarray(measured_s, dtype=np.float64)
    rel = (np.asarray(predicted_s, dtype=np.float64) - measured) / measured
    total = float(np.sum(measured))
    return {"n": int(rel.size),
            "median_signed": float(np.median(rel)) if rel.size else float("nan"),
            "mape": float(np.mean(np.abs(rel))) if rel.size else float("nan"),
            "total_signed": float(np.sum(predicted_s) / total - 1) if total > 0 else float("nan")}


def ratio_spread(measured_s: np.ndarray, predicted_s: np.ndarray, its: pd.DataFrame,
                 latency: Any) -> dict[str, float | None]:
    """Replay 1's forward time over the profile's prediction, iteration by iteration: the
    std of its log and its lag-1 correlation (consecutive iterations; normal scores within
    regimes, as the profile's correlation is fitted), beside the same of the
    profile's measured ratios (`noise.regimes`, pooled by how many iterations of each regime
    replay 1 ran; its `noise.correlation`), which `host+noise` draws from."""
    from profiler.fit.fitting import lag1_correlation
    from sim.latency.noise import REGIMES, regime_index

    regime = regime_index(its["num_prefill_tokens"].to_numpy(),
                          its["num_decode_tokens"].to_numpy())
    ok = (measured_s > 0) & (predicted_s > 0)
    log = np.log(measured_s[ok] / predicted_s[ok])
    out: dict[str, float | None] = {
        "replay_ratio_log_std": float(log.std()) if log.size else None,
        "replay_ratio_lag1": lag1_correlation(log, regime[ok]),
        "profile_ratio_log_std": None, "profile_correlation": None}
    quantiles = latency.noise_quantiles()
    if quantiles:
        weights = np.bincount(regime, minlength=len(REGIMES)) / max(1, len(regime))
        # Each regime's factor at a uniform u (linear between quantiles), as log-moments.
        u = np.linspace(0, 1, 4097)
        logs = [np.log(np.interp(u, np.linspace(0, 1, len(quantiles[r])), quantiles[r]))
                for r in REGIMES]
        mean = sum(w * x.mean() for w, x in zip(weights, logs, strict=True))
        second = sum(w * (x * x).mean() for w, x in zip(weights, logs, strict=True))
        out["profile_ratio_log_std"] = float(np.sqrt(max(second - mean * mean, 0.0)))
        out["profile_correlation"] = (latency.describe().get("measured_noise")
                                      or {}).get("correlation")
    return out
