"""Fit the profile latency model to measurements, score it on held-out mixes, and keep what it
leaves unexplained (measured/predicted ratios by regime, their correlation in run order) for
`latency.noise: {kind: empirical}`. numpy and scipy only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import nnls
from scipy.special import ndtri
from scipy.stats import rankdata

from sim.config.errors import InputError
from sim.latency.base import BatchShape
from sim.latency.noise import REGIMES, regime_index
from sim.latency.profile import FORMAT, RANGE_FEATURES, TERMS, knot_basis, predict_s

NUM_QUANTILES = 101  # quantiles kept per regime: every percentile, min and max included
MIN_REGIME_SAMPLES = 20  # timed repetitions a regime needs for ratios of its own ...
MIN_REGIME_MIXES = 5  # ... from this many mixes (five repetitions of one shape are one shape)
MIN_PAIRS = 10  # consecutive pairs a correlation needs
MAX_CORRELATION = 0.99  # `latency.noise.correlation` must stay below 1


# What `servesim profile` writes a row with, that a fit reads: the mix's counts (its features
# and tokens), its timings' median and spread, and every timed repetition.
COUNTS = ("num_tokens", "num_prefill_tokens", "num_prefill_seqs", "num_decode_tokens",
          "num_sampled_tokens", "prefill_attn_pairs", "prefill_kv_tokens", "decode_kv_tokens")
TIMES = ("median_s", "p10_s", "p90_s")
SPLITS = ("train", "holdout")
PROFILE_COLUMNS = ("split", "tag", *COUNTS, *TIMES, "samples_s")
EDITED = "written by another servesim version, or edited?"


def check_profile(df: pd.DataFrame, metadata: dict[str, Any], path: Path,
                  for_fit: bool = True) -> None:
    """The rows of profile `path` as `servesim profile` writes them: each mix's counts whole
    numbers (tokens at least 1), its times finite and positive (the fit weighs each row by
    1/median_s), its repetitions a non-empty list of such times, its split train or holdout;
    `for_fit`, at least two training rows of different token counts (the curve g needs two
    knots); else (resuming) each row's `key`. One line naming the file, column, row and value,
    where a fit would end in a traceback, a NaN error or a curve made of nonsense."""
    model = metadata.get("model")
    if not isinstance(model, str):
        raise InputError(path, "metadata.model", model, "must be the model's name (text): "
                         "not a servesim profile")
    tp = metadata.get("tensor_parallel", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise InputError(path, "metadata.tensor_parallel", tp, f"must be an integer >= 1 "
                         f"({EDITED})")
    needed = PROFILE_COLUMNS if for_fit else ("key", *PROFILE_COLUMNS)
    missing = [c for c in needed if c not in df]
    if missing:
        raise InputError(path, "<columns>", missing, "missing: not a servesim profile")
    for column in ("split", "tag", *(() if for_fit else ("key",))):
        texts = df[column].map(lambda v: isinstance(v, str)).to_numpy(bool)
        _refuse(path, df, column, ~texts, "must be text")
    _refuse(path, df, "split", ~df["split"].isin(SPLITS).to_numpy(bool),
            f"must be one of {', '.join(SPLITS)}")
    for column in (*COUNTS, *TIMES):
        values = _numbers(path, df, column)
        with np.errstate(invalid="ignore"):
            if column in COUNTS:
                least = 1 if column == "num_tokens" else 0
                _refuse(path, df, column, ~(np.isfinite(values) & (values == np.round(values))),
                        "must be a whole number")
                _refuse(path, df, column, values < least, f"must be at least {least}")
            else:
                _refuse(path, df, column, ~(np.isfinite(values) & (values > 0)),
                        "must be a finite time > 0 s")
    for row, samples in enumerate(df["samples_s"]):
        try:
            times = np.asarray(samples, dtype=np.float64)
        except (TypeError, ValueError):
            times = np.zeros(0)
        if (times.ndim != 1 or times.size == 0 or not np.isfinite(times).all()
                or (times <= 0).any()):
            shown = samples.tolist() if isinstance(samples, np.ndarray) else samples
            raise InputError(path, "samples_s", shown, f"row {row}: must be a non-empty list "
                             f"of finite times > 0 s ({EDITED})")
    if for_fit:
        train = df.loc[df["split"] == "train", "num_tokens"]
        if train.nunique() < 2:
            raise InputError(path, "split", f"{len(train)} train rows", "a fit needs training "
                             "rows (split=train) of at least two token counts: the curve over "
                             "tokens has a knot at each")


def _numbers(path: Path, df: pd.DataFrame, column: str) -> np.ndarray:
    """`column` as floats, where it holds numbers (not text, not booleans)."""
    series = df[column]
    if pd.api.types.is_numeric_dtype(series.dtype) and not pd.api.types.is_bool_dtype(
            series.dtype):
        return series.to_numpy(np.float64)
    bad = next((i for i, v in enumerate(series)
                if isinstance(v, bool) or not isinstance(v, int | float)), 0)
    raise InputError(path, column, series.iloc[bad], f"row {bad}: must be a number ({EDITED})")


def _refuse(path: Path, df: pd.DataFrame, column: str, bad: np.ndarray, problem: str) -> None:
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise InputError(path, column, df[column].iloc[row], f"row {row}: {problem} ({EDITED})")


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


def sample_ratios(fitted: dict[str, Any], df: pd.DataFrame) -> pd.DataFrame:
    """One row per timed repetition, in run order: `servesim profile` appends a mix's row as
    soon as it is measured (mixes in random order, a resumed run after the rows it kept) and
    times its repetitions back to back after the warm-up, so the frame's row order then the
    order within `samples_s` is the order the forward passes ran. Columns: `mix` (row
    position), `rep`, `split`, `regime` (0 decode-only, 1 mixed, 2 prefill-only) and `ratio`,
    measured over the fitted model's prediction for the mix."""
    predicted = predict(fitted, df)
    samples = (df["samples_s"] if "samples_s" in df
               else df["median_s"].map(lambda t: [t]))
    counts = samples.map(len).to_numpy()
    measured = np.concatenate([np.asarray(s, dtype=np.float64) for s in samples])
    mix = np.repeat(np.arange(len(df)), counts)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = measured / predicted[mix]
    out = pd.DataFrame({
        "mix": mix,
        "rep": np.concatenate([np.arange(c) for c in counts]),
        "split": np.repeat(df["split"].to_numpy(), counts),
        "regime": np.repeat(regime_index(df["num_prefill_tokens"].to_numpy(),
                                         df["num_decode_tokens"].to_numpy()), counts),
        "ratio": ratio,
    })
    # A shape predicted to take no time (all its terms fitted to 0) has no ratio.
    return out[np.isfinite(out["ratio"]) & (out["ratio"] > 0)]


def _enough(s: pd.DataFrame) -> bool:
    return len(s) >= MIN_REGIME_SAMPLES and s["mix"].nunique() >= MIN_REGIME_MIXES


def _regime_ratios(ratios: pd.DataFrame, source: str) -> dict[str, Any]:
    r = ratios["ratio"].to_numpy()
    return {"quantiles": np.quantile(r, np.linspace(0, 1, NUM_QUANTILES)).tolist(),
            "count": int(r.size), "num_mixes": int(ratios["mix"].nunique()), "source": source,
            "log_std": float(np.log(r).std())}


def _lag1(a: np.ndarray, b: np.ndarray) -> float | None:
    """Pearson correlation of paired values (None: too few pairs, or no spread)."""
    if a.size < MIN_PAIRS or a.std() == 0 or b.std() == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def normal_scores(values: np.ndarray, regime: np.ndarray) -> np.ndarray:
    """Each value's normal score within its regime: Phi^-1((rank - 1/2) / n)."""
    z = np.empty(len(values))
    for r in range(len(REGIMES)):
        mask = regime == r
        if mask.any():
            z[mask] = ndtri((rankdata(values[mask]) - 0.5) / mask.sum())
    return z


def lag1_correlation(values: np.ndarray, regime: np.ndarray) -> float | None:
    """The lag-1 correlation of a series' normal scores (`ratio_correlation`'s measure, for a
    series with no gaps, e.g. a replay's iterations)."""
    z = normal_scores(values, regime)
    return _lag1(z[:-1], z[1:])


def _pairs(ratios: pd.DataFrame) -> dict[str, Any]:
    """Lag-1 correlations of the normal scores of `ratios` (a subset of `sample_ratios`, in run
    order): over consecutive repetitions of a mix, and over mixes adjacent in the run (each
    mix's mean score; both mixes in the subset)."""
    z = normal_scores(ratios["ratio"].to_numpy(), ratios["regime"].to_numpy())
    mix = ratios["mix"].to_numpy()
    same = mix[1:] == mix[:-1]
    per_mix = pd.Series(z).groupby(mix).mean()
    ids = per_mix.index.to_numpy()
    adjacent = np.flatnonzero(np.diff(ids) == 1)
    values = per_mix.to_numpy()
    return {"repetition_pairs": int(same.sum()),
            "consecutive_repetitions": _lag1(z[:-1][same], z[1:][same]),
            "mix_pairs": int(adjacent.size),
            "consecutive_mixes": _lag1(values[adjacent], values[adjacent + 1])}


def ratio_correlation(ratios: pd.DataFrame) -> dict[str, Any]:
    """The AR(1) coefficient of `sim.latency.noise` fitted to the profile: each ratio becomes its
    normal score within its regime (the Gaussian copula's z, so that regimes' different levels and
    spreads are not mistaken for correlation, and a few outliers do not decide it), and the
    coefficient is the lag-1 correlation of z over consecutive repetitions of one mix, back-to-
    back forward passes as a serving engine's consecutive iterations are (of similar shapes, so
    the model's error on a shape persists over them as well as the machine's jitter). Mixes
    adjacent in the run are a fallback only, for profiles with one repetition per mix: a
    warm-up pass and a random change of shape separate them, unlike serving iterations. Held-
    out mixes where they give enough pairs: the fit pulls a training mix's ratios towards 1
    (a knot's mix, to its own median), which hides the persistent part."""
    held = ratios[ratios["split"] == "holdout"]
    options = [(held, "holdout"), (ratios, "all")] if len(held) else [(ratios, "all")]
    raw, used, detail = 0.0, "none: too few consecutive pairs; no correlation assumed", {}
    for subset, mixes in options:
        detail = {"mixes": mixes, **_pairs(subset)}
        if detail["consecutive_repetitions"] is not None:
            raw, used = detail["consecutive_repetitions"], "consecutive repetitions of a mix"
            break
        if detail["consecutive_mixes"] is not None:
            raw, used = (detail["consecutive_mixes"],
                         "consecutive mixes (the profile has one repetition per mix)")
            break
    return {"correlation": round(min(max(raw, 0.0), MAX_CORRELATION), 4),
            "correlation_from": used, "correlation_detail": detail}


def measured_noise(fitted: dict[str, Any], df: pd.DataFrame) -> dict[str, Any]:
    """What the fitted model leaves unexplained, for `latency.noise: {kind: empirical}`: by
    regime, the quantiles of measured/predicted over every timed repetition (held-out mixes
    where the regime has enough of them, as a fresh shape is; else all its mixes, training ones
    included, whose ratios the fit pulled towards 1; else the ratios of every regime pooled),
    and their lag-1 correlation in run order (`ratio_correlation`)."""
    ratios = sample_ratios(fitted, df)
    if ratios.empty:
        return {"ratios_note": "no measured/predicted ratios (no positive prediction)"}
    holdout = ratios[ratios["split"] == "holdout"]
    pooled_from = (holdout, "holdout") if _enough(holdout) else (ratios, "all")
    regimes: dict[str, Any] = {}
    for r, name in enumerate(REGIMES):
        held, every = holdout[holdout["regime"] == r], ratios[ratios["regime"] == r]
        if _enough(held):
            regimes[name] = _regime_ratios(held, "holdout")
        elif _enough(every):
            regimes[name] = _regime_ratios(every, "all")
        else:
            regimes[name] = {**_regime_ratios(*pooled_from), "source": f"pooled_{pooled_from[1]}",
                             "own_count": int(len(every)),
                             "note": f"fewer than {MIN_REGIME_SAMPLES} timings from "
                                     f"{MIN_REGIME_MIXES} mixes of this regime: the ratios of "
                                     f"every regime pooled"}
    return {
        "regimes": regimes,
        "ratios_note": "measured/predicted per timed repetition, by regime (decode: no prefill "
                       "tokens; mixed; prefill: no decodes); quantiles on an even grid of "
                       f"{NUM_QUANTILES} in [0, 1]; source holdout: held-out mixes, all: "
                       "every mix, pooled_*: every regime's",
        **ratio_correlation(ratios),
        "correlation_note": ("lag-1 autocorrelation of the ratios' normal scores "
                             "(sim.latency.noise's AR(1) coefficient on z), clipped to "
                             "[0, 0.99]: set `latency.noise: {kind: empirical, correlation: "
                             "<this>}` for jitter that persists over consecutive iterations as "
                             "measured"),
    }


def fit_profile(df: pd.DataFrame, metadata: dict[str, Any]) -> dict[str, Any]:
    """Fit on the grid rows; score on the held-out rows; keep the facts of the measurement."""
    train, holdout = df[df["split"] == "train"], df[df["split"] == "holdout"]
    fitted = fit(train)
    fitted["model"] = metadata.get("model")
    fitted["device_name"] = metadata.get("device_name")
    fitted["tensor_parallel"] = int(metadata.get("tensor_parallel", 1))  # absent: whole model
    fitted["train"] = errors(fitted, train)
    fitted["holdout"] = errors(fitted, holdout) if len(holdout) else None
    fitted["noise"] = {**noise(df), **measured_noise(fitted, df)}
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
