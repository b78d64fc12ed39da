"""Fit the profile latency model to measurements, and score it on held-out mixes. numpy only."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import nnls

from sim.latency.base import BatchShape
from sim.latency.profile import FORMAT, RANGE_FEATURES, TERMS, knot_basis, predict_s


def fit(train: pd.DataFrame, knots: list[int] | None = None) -> dict[str, Any]:
    """Non-negative least squares on relative error (each row scaled by 1/measured time): every
    term of an iteration adds time, so no coefficient may go negative and extrapolate to
    nonsense."""
    n = train["num_tokens"].to_numpy(dtype=np.float64)
    if knots is None:
        knots = sorted(set(train.loc[train["tag"] == "tokens", "num_tokens"].tolist())
                       | {int(n.min()), int(n.max())})
    k = np.asarray(sorted(set(knots)), dtype=np.float64)
    x = np.hstack([knot_basis(n, k), train[list(TERMS)].to_numpy(dtype=np.float64)])
    y = train["median_s"].to_numpy(dtype=np.float64)
    weight = 1.0 / y
    solution, _ = nnls(x * weight[:, None], y * weight, maxiter=50 * x.shape[1])
    ranges = {name: float(train[name].max()) for name in RANGE_FEATURES if name in train}
    return {
        "format": FORMAT,
        "knots": k.tolist(),
        "knot_s": solution[: len(k)].tolist(),
        "coef": dict(zip(TERMS, solution[len(k):].tolist(), strict=True)),
        "range": ranges,
    }


def predict(fitted: dict[str, Any], df: pd.DataFrame) -> np.ndarray:
    shape = BatchShape(**{name: df[name].to_numpy(dtype=np.float64) for name in (
        "num_prefill_tokens", "num_prefill_seqs", "num_decode_tokens", "num_sampled_tokens",
        "prefill_attn_pairs", "prefill_kv_tokens", "decode_kv_tokens")})
    return predict_s(shape, np.asarray(fitted["knots"], dtype=np.float64),
                     np.asarray(fitted["knot_s"], dtype=np.float64),
                     [float(fitted["coef"][name]) for name in TERMS])


def errors(fitted: dict[str, Any], df: pd.DataFrame) -> dict[str, float]:
    """MAPE, P95 and max of |predicted - measured| / measured (as fractions)."""
    rel = np.abs(predict(fitted, df) - df["median_s"].to_numpy()) / df["median_s"].to_numpy()
    return {"n": int(rel.size), "mape": float(rel.mean()), "p95": float(np.percentile(rel, 95)),
            "max": float(rel.max())}


def noise(df: pd.DataFrame) -> dict[str, float]:
    """How much repeated timings of one mix spread: the floor for any model's error."""
    spread = (df["p90_s"] - df["p10_s"]) / df["median_s"]
    mad = df["samples_s"].map(lambda s: float(np.median(np.abs(np.asarray(s) - np.median(s)))))
    rel_mad = mad / df["median_s"]
    return {"median_p10_p90_spread": float(spread.median()),
            "median_rel_abs_dev": float(rel_mad.median()),
            "p95_rel_abs_dev": float(rel_mad.quantile(0.95))}


def fit_profile(df: pd.DataFrame, metadata: dict[str, Any]) -> dict[str, Any]:
    """Fit on the grid rows; score on the held-out rows; keep the facts of the measurement."""
    train, holdout = df[df["split"] == "train"], df[df["split"] == "holdout"]
    fitted = fit(train)
    fitted["model"] = metadata.get("model")
    fitted["device_name"] = metadata.get("device_name")
    fitted["tensor_parallel"] = int(metadata.get("tensor_parallel", 1))  # absent: whole model
    fitted["train"] = errors(fitted, train)
    fitted["holdout"] = errors(fitted, holdout) if len(holdout) else None
    fitted["noise"] = noise(df)
    fitted["measurement"] = metadata
    return fitted


def add_host_overhead(fitted: dict[str, Any], overhead_s: float,
                      stats: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fitted model plus a constant per-iteration host time (scheduling, input preparation,
    commit, measured by `servesim replay` outside the forward pass). The file format is
    unchanged: g(num_tokens) is the per-iteration curve, so the constant goes into every knot
    value; `host_overhead_s` records how much was added."""
    out = dict(fitted)
    base = float(fitted.get("host_overhead_s", 0.0))
    out["knot_s"] = [v - base + overhead_s for v in fitted["knot_s"]]
    out["host_overhead_s"] = overhead_s
    if stats is not None:
        out["host_overhead"] = stats
    return out
