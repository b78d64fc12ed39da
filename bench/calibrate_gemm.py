"""Fit `sim.latency.gemm`'s GEMM time model to Vidur's public H100/A100 measurements (issue 15).

Reads `compute/{h100,a100}/<org>/<model>/mlp.csv` under the Vidur profile folder (default
../shared/profiles/vidur, next to the repository; never copied into it), works out each row's
four linear-layer GEMMs as (m, k, n) from the shape columns, fits the four parameters of each
GPU and then its efficiency correction (a factor of tokens shared by all its shapes), writes
sim/data/gemm_calibration.json and prints how the model fares:

- per GPU x model x tensor-parallel degree: min/median/max of predicted/measured for the
  linear-layer time of one layer (the sum of its four GEMMs): the naive datasheet roofline (mfu
  0.6 and mbu 0.8 as in sim/latency/roofline.py), the smooth (monotone) form, the form with the
  correction, and held out (the correction fitted on the GPU's other models, leave-one-model-
  out), over the rows with 1 <= num_tokens <= 4096, and how many rows miss 10%; per GPU the
  rows within 10% and the worst rows of each;
- per GPU x GEMM: the same for each GEMM alone;
- the rows that miss 10%, with the measurement's own min..max spread, and per series the best
  any non-decreasing model could do (the measured sums drop by up to a third as tokens grow,
  where the library switches kernels, so some rows cannot be met by a sane model).

Measurements: the `median` column of each operator (robust to the odd slow repetition; the
min..max spread of a row is a few percent, far below the misses). GEMMs, with h = n_embd,
d = h / n_head, i = n_expanded_embd, t = num_tensor_parallel_workers and m = num_tokens:
attn_pre_proj [m x h] @ [h x (n_head + 2 n_kv_head) d / t], attn_post_proj [m x h/t] @ [h/t x h],
mlp_up_proj [m x h] @ [h x 2i/t] (gate and up fused; i/t if not gated), mlp_down_proj
[m x i/t] @ [i/t x h].

Fit: per GPU, least squares of log(predicted / measured) of the four-GEMM sum over all rows of
1-4096 tokens (every model and TP degree equally, each row once), with the FLOP/s and the
bandwidth bounded by the datasheet's (scipy.optimize.least_squares). Then the correction:
log(factor) piecewise linear on CORRECTION_KNOTS, linear least squares of log(measured /
smooth) of the same sums plus SMOOTHNESS x the squared second differences of log(factor).

    python bench/calibrate_gemm.py [VIDUR_DIR] [--markdown] [--rows out.csv] [--no-write]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sim.hardware.gpus import GPUS  # noqa: E402
from sim.latency.gemm import (  # noqa: E402
    CALIBRATION_PATH,
    REFERENCE_GPU,
    GemmModel,
    GemmParams,
)

DEFAULT_VIDUR = ROOT / ".." / "shared" / "profiles" / "vidur"
VIDUR_COMMIT = "7d47513363ec447a741ac5e47241580b47724fbf"
GPU_DIRS = {"h100": "h100-sxm", "a100": "a100-80gb"}  # Vidur's folder -> servesim's GPU
OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
MAX_TOKENS = 4096  # the acceptance range: 1 <= num_tokens <= 4096
M_TILE = 64
# The efficiency correction's knots: 1, 2, 4, 8, then every 16 tokens to 4096 (the measured
# token counts are every 8 to 1024, every 16 to 2048, every 32 to 4096); constant beyond.
CORRECTION_KNOTS = np.r_[1.0, 2.0, 4.0, 8.0, np.arange(16.0, MAX_TOKENS + 1, 16.0)]
SMOOTHNESS = 1.0  # weight of the squared second differences of log(factor) between knots
NAIVE_MFU, NAIVE_MBU = 0.6, 0.8  # RooflineConfig's defaults


@dataclass
class Rows:
    """One entry per measured row (a layer at one token count, model and TP degree)."""

    gpu: np.ndarray  # servesim GPU name
    model: np.ndarray  # Vidur's model folder, e.g. "Llama-2-7b-hf"
    tp: np.ndarray
    m: np.ndarray  # num_tokens
    kn: np.ndarray  # (rows, 4, 2): k and n of each GEMM in OPS order
    median_s: np.ndarray  # (rows, 4)
    min_s: np.ndarray
    max_s: np.ndarray
    files: dict[str, str]  # path relative to the Vidur folder -> sha256

    def select(self, mask: np.ndarray) -> Rows:
        return Rows(self.gpu[mask], self.model[mask], self.tp[mask], self.m[mask],
                    self.kn[mask], self.median_s[mask], self.min_s[mask], self.max_s[mask],
                    self.files)


def gemm_shapes(n_head: int, n_kv_head: int, n_embd: int, n_expanded_embd: int, gated: bool,
                tp: int) -> list[tuple[int, int]]:
    """(k, n) of attn_pre_proj, attn_post_proj, mlp_up_proj, mlp_down_proj: each GPU's shard."""
    d = n_embd // n_head
    up = (2 if gated else 1) * n_expanded_embd
    for what, size in (("QKV width", (n_head + 2 * n_kv_head) * d), ("heads", n_head * d),
                       ("MLP width", up), ("MLP width", n_expanded_embd)):
        if size % tp:
            raise ValueError(f"{what} {size} does not split over {tp} GPUs")
    return [(n_embd, (n_head + 2 * n_kv_head) * d // tp), (n_head * d // tp, n_embd),
            (n_embd, up // tp), (n_expanded_embd // tp, n_embd)]


def load_rows(vidur: Path, max_tokens: int | None = MAX_TOKENS) -> Rows:
    """Every row of every compute/<gpu>/<org>/<model>/mlp.csv with 1 <= num_tokens <=
    max_tokens (None: no upper bound), GPUs in GPU_DIRS only."""
    cols: dict[str, list[Any]] = {c: [] for c in ("gpu", "model", "tp", "m", "kn", "med", "lo",
                                                  "hi")}
    files = {}
    paths = sorted((vidur / "compute").glob("*/*/*/mlp.csv"))
    if not paths:
        raise FileNotFoundError(f"no compute/<gpu>/<org>/<model>/mlp.csv under {vidur}")
    for path in paths:
        gpu_dir = path.parts[-4]
        if gpu_dir not in GPU_DIRS:
            continue
        files[str(path.relative_to(vidur))] = hashlib.sha256(path.read_bytes()).hexdigest()
        with path.open(newline="") as f:
            for r in csv.DictReader(f):
                m = int(r["num_tokens"])
                if m < 1 or (max_tokens is not None and m > max_tokens):
                    continue
                tp = int(r["num_tensor_parallel_workers"])
                gated = r["use_gated_mlp"].strip().lower() in ("true", "1")
                cols["gpu"].append(GPU_DIRS[gpu_dir])
                cols["model"].append(path.parts[-2])
                cols["tp"].append(tp)
                cols["m"].append(m)
                cols["kn"].append(gemm_shapes(int(r["n_head"]), int(r["n_kv_head"]),
                                              int(r["n_embd"]), int(r["n_expanded_embd"]),
                                              gated, tp))
                for key, stat in (("med", "median"), ("lo", "min"), ("hi", "max")):
                    cols[key].append([float(r[f"time_stats.{op}.{stat}"]) * 1e-3 for op in OPS])
    rows = Rows(np.array(cols["gpu"]), np.array(cols["model"]), np.array(cols["tp"]),
                np.array(cols["m"], dtype=np.int64), np.array(cols["kn"], dtype=np.int64),
                np.array(cols["med"]), np.array(cols["lo"]), np.array(cols["hi"]), files)
    if not (np.all(np.isfinite(rows.median_s)) and np.all(rows.median_s > 0)):
        raise ValueError(f"{vidur}: a GEMM time is missing, zero or negative")
    return rows


def predict(model: GemmModel, rows: Rows) -> np.ndarray:
    """(rows, 4): each GEMM's predicted seconds; one vectorised call per distinct shape."""
    out = np.empty(rows.median_s.shape)
    for j in range(len(OPS)):
        kn = rows.kn[:, j]
        for k, n in np.unique(kn, axis=0):
            sel = (kn[:, 0] == k) & (kn[:, 1] == n)
            out[sel, j] = model.time_s(rows.m[sel], int(k), int(n))
    return out


def _model(gpu: str, x: np.ndarray) -> GemmModel:
    return GemmModel(GemmParams(float(x[0]), float(x[1]), float(x[2]), float(x[3]), M_TILE),
                     gpu, "calibrated")


def fit_gpu(gpu: str, rows: Rows) -> GemmParams:
    """Least squares of log(sum predicted / sum measured) over the rows of one GPU."""
    from scipy.optimize import least_squares

    spec = GPUS.get(gpu)
    measured = rows.median_s.sum(axis=1)
    peak_f, peak_b = spec.peak_bf16_flops, spec.memory_bandwidth_bytes_s
    # Parameters scaled to order one: t0 in us, F and B as fractions of the datasheet, c.
    scale = np.array([1e-6, peak_f, peak_b, 1.0])

    def residuals(z: np.ndarray) -> np.ndarray:
        pred = predict(_model(gpu, z * scale), rows).sum(axis=1)
        return np.log(pred / measured)

    z0 = np.array([5.0, 0.75, 0.85, 1.0])
    fit = least_squares(residuals, z0, bounds=([0.0, 0.05, 0.05, 0.0], [100.0, 1.0, 1.0, 4.0]),
                        x_scale=[1.0, 0.1, 0.1, 1.0])
    if not fit.success:
        raise RuntimeError(f"{gpu}: fit did not converge: {fit.message}")
    x = [float(f"{v:.4g}") for v in fit.x * scale]  # 4 digits: what the file keeps
    return GemmParams(x[0], x[1], x[2], x[3], M_TILE)


Correction = tuple[tuple[float, ...], tuple[float, ...]]


def fit_correction(gpu: str, params: GemmParams, rows: Rows) -> Correction:
    """The GPU's efficiency factor vs tokens: log(factor) piecewise linear on CORRECTION_KNOTS,
    least squares of log(measured / smooth form) of the four-GEMM sums of `rows` (every model
    and TP degree of the GPU, one factor for all shapes) plus SMOOTHNESS times the squared
    second differences of log(factor) (keeps it from chasing noise, and fills knots without
    rows). Factors kept to 4 digits, as the file keeps them."""
    knots = CORRECTION_KNOTS
    base = predict(GemmModel(params, gpu, "calibrated"), rows).sum(axis=1)
    r = np.log(rows.median_s.sum(axis=1) / base)
    eye = np.eye(len(knots))
    w = np.stack([np.interp(rows.m.astype(np.float64), knots, e) for e in eye], axis=1)
    d = np.diff(eye, 2, axis=0) * np.sqrt(SMOOTHNESS)
    v = np.linalg.lstsq(np.vstack([w, d]), np.r_[r, np.zeros(len(d))], rcond=None)[0]
    factors = tuple(float(f"{f:.4g}") for f in np.exp(v))
    return tuple(float(k) for k in knots), factors


def leave_one_model_out(gpu: str, params: GemmParams, rows: Rows) -> np.ndarray:
    """(rows,): predicted / measured of each row's four-GEMM sum with the correction fitted on
    the GPU's other models only (the smooth form's four parameters kept: they are fitted on
    every model)."""
    meas = rows.median_s.sum(axis=1)
    out = np.empty(len(meas))
    for model in sorted(set(rows.model.tolist())):
        held = rows.model == model
        corr = fit_correction(gpu, params, rows.select(~held))
        sub = rows.select(held)
        out[held] = predict(GemmModel(params, gpu, "calibrated", correction=corr),
                            sub).sum(axis=1) / meas[held]
    return out


def monotone_bound(m: np.ndarray, t: np.ndarray) -> float:
    """The smallest e such that some non-decreasing pred(m) has |pred / t - 1| <= e on every
    row: (D - 1) / (D + 1), D the largest factor by which t drops as m grows (rows at the same m
    count too: one m gets one prediction)."""
    values, group = np.unique(m, return_inverse=True)
    lt = np.log(t)
    hi = np.full(len(values), -np.inf)
    lo = np.full(len(values), np.inf)
    np.maximum.at(hi, group, lt)
    np.minimum.at(lo, group, lt)
    drop = float(np.exp(np.max(np.maximum.accumulate(hi) - lo)))
    return (drop - 1) / (drop + 1)


def _stats(r: np.ndarray) -> str:
    return f"{r.min():5.2f} {np.median(r):5.2f} {r.max():5.2f}"


def report(rows: Rows, before: np.ndarray, mono: np.ndarray, after: np.ndarray,
           lomo: np.ndarray, markdown: bool) -> list[str]:
    """The tables; returns the lines printed. `before`, `mono`, `after`: (rows, 4) GEMM times of
    the naive roofline, the smooth form alone and with the correction; `lomo`: (rows,) ratio of
    the corrected sum with the correction fitted leaving the row's model out."""
    lines: list[str] = []
    meas = rows.median_s.sum(axis=1)
    rb, rm, ra = before.sum(axis=1) / meas, mono.sum(axis=1) / meas, after.sum(axis=1) / meas
    series = sorted(set(zip(rows.gpu.tolist(), rows.model.tolist(), rows.tp.tolist(),
                            strict=True)))

    def off(r: np.ndarray) -> int:
        return int(np.sum(np.abs(r - 1) > 0.1))

    def trip(r: np.ndarray) -> str:
        return " / ".join(f"{v:.2f}" for v in _triple(r))

    if markdown:
        lines += ["| GPU | model | TP | rows | naive min / med / max | smooth min / med / max | "
                  "corrected min / med / max | held-out min / med / max | rows off > 10%: "
                  "smooth / corrected / held-out | best monotone |",
                  "|---|---|---:|---:|---|---|---|---|---:|---:|"]
    else:
        lines += ["Linear-layer time of one layer (four GEMMs), predicted / measured (min med "
                  f"max), 1 <= tokens <= {MAX_TOKENS}: naive roofline, smooth (monotone) form, "
                  "corrected (smooth x the GPU's efficiency factor of tokens), held-out (the "
                  "correction fitted leaving the row's model out); >10%: rows off by more than "
                  "10% (smooth / corrected / held-out); bound: the smallest max |predicted/"
                  "measured - 1| any non-decreasing curve in tokens could reach on that series",
                  f"{'GPU':10} {'model':26} {'TP':>2} {'rows':>4}   {'naive':17}   "
                  f"{'smooth':17}   {'corrected':17}   {'held-out':17} {'>10%':>12} "
                  f"{'bound':>6}"]
    for gpu, model, tp in series:
        sel = (rows.gpu == gpu) & (rows.model == model) & (rows.tp == tp)
        bound = monotone_bound(rows.m[sel], meas[sel])
        misses = f"{off(rm[sel])} / {off(ra[sel])} / {off(lomo[sel])}"
        if markdown:
            lines.append(f"| {gpu} | {model} | {tp} | {sel.sum()} | {trip(rb[sel])} | "
                         f"{trip(rm[sel])} | {trip(ra[sel])} | {trip(lomo[sel])} | {misses} | "
                         f"{bound:.1%} |")
        else:
            lines.append(f"{gpu:10} {model:26} {tp:>2} {sel.sum():>4}   {_stats(rb[sel]):17}   "
                         f"{_stats(rm[sel]):17}   {_stats(ra[sel]):17}   "
                         f"{_stats(lomo[sel]):17} {misses:>12} {bound:>6.1%}")
    for gpu in sorted(set(rows.gpu.tolist())):
        sel = rows.gpu == gpu
        misses = f"{off(rm[sel])} / {off(ra[sel])} / {off(lomo[sel])}"
        if markdown:
            lines.append(f"| {gpu} | all | | {sel.sum()} | {trip(rb[sel])} | {trip(rm[sel])} | "
                         f"{trip(ra[sel])} | {trip(lomo[sel])} | {misses} | |")
        else:
            lines.append(f"{gpu:10} {'all':26} {'':>2} {sel.sum():>4}   {_stats(rb[sel]):17}   "
                         f"{_stats(rm[sel]):17}   {_stats(ra[sel]):17}   "
                         f"{_stats(lomo[sel]):17} {misses:>12}")
    if markdown:
        lines += ["", "| GPU | rows | within 10%: naive / smooth / corrected / held-out | "
                  "worst (min, max): smooth | corrected | held-out |",
                  "|---|---:|---|---|---|---|"]
    else:
        lines += ["", "Per GPU: rows within 10% (naive / smooth / corrected / held-out) and the "
                  "worst rows (min, max of predicted / measured):"]
    for gpu in sorted(set(rows.gpu.tolist())):
        sel = rows.gpu == gpu
        within = " / ".join(f"{np.mean(np.abs(r[sel] - 1) <= 0.1):.1%}"
                            for r in (rb, rm, ra, lomo))
        worst = " | ".join(f"{r[sel].min():.2f}, {r[sel].max():.2f}" for r in (rm, ra, lomo))
        if markdown:
            lines.append(f"| {gpu} | {sel.sum()} | {within} | {worst} |")
        else:
            lines.append(f"  {gpu:10} {sel.sum():>4} rows: within 10% {within}; worst {worst}")
    if markdown:
        return lines
    lines += ["", "Each GEMM alone, predicted / measured (min median max), rows within 10%:"]
    for gpu in sorted(set(rows.gpu.tolist())):
        sel = rows.gpu == gpu
        for j, op in enumerate(OPS):
            b = before[sel, j] / rows.median_s[sel, j]
            a = after[sel, j] / rows.median_s[sel, j]
            lines.append(f"{gpu:10} {op:15} naive {_stats(b)}   corrected {_stats(a)}   "
                         f"within 10%: {np.mean(np.abs(a - 1) <= 0.1):.0%}")
    spread = (rows.max_s.sum(axis=1) - rows.min_s.sum(axis=1)) / meas
    missed = np.flatnonzero(np.abs(ra - 1) > 0.1)
    lines += ["", f"Rows off by more than 10% (corrected): {len(missed)} of {len(ra)}; the "
              "measurement's own (max - min) / median of the four-GEMM sum is "
              f"{np.median(spread):.1%} at the median row, {np.max(spread):.1%} at most.",
              "Worst 20 (GPU, model, TP, tokens: corrected predicted / measured (smooth), "
              "measured min..max relative to median):"]
    for i in missed[np.argsort(-np.abs(np.log(ra[missed])))][:20]:
        lo, hi = rows.min_s[i].sum() / meas[i], rows.max_s[i].sum() / meas[i]
        lines.append(f"  {rows.gpu[i]:10} {rows.model[i]:26} TP{rows.tp[i]} {rows.m[i]:>5}: "
                     f"{ra[i]:.2f} ({rm[i]:.2f})   measured {lo:.3f}..{hi:.3f}")
    return lines


def _series_masks(rows: Rows, gpu: str) -> list[np.ndarray]:
    return [(rows.gpu == gpu) & (rows.model == model) & (rows.tp == tp)
            for model, tp in sorted(set(zip(rows.model[rows.gpu == gpu].tolist(),
                                            rows.tp[rows.gpu == gpu].tolist(), strict=True)))]


def _triple(r: np.ndarray) -> tuple[float, float, float]:
    return float(r.min()), float(np.median(r)), float(r.max())


def write_rows(path: Path, rows: Rows, before: np.ndarray, after: np.ndarray) -> None:
    meas = rows.median_s.sum(axis=1)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gpu", "model", "tp", "num_tokens", "measured_s", "measured_min_s",
                    "measured_max_s", "naive_s", "calibrated_s", "naive_ratio", "calibrated_ratio"]
                   + [f"{op}_{what}" for op in OPS
                      for what in ("measured_s", "naive_ratio", "calibrated_ratio")])
        for i in range(len(meas)):
            w.writerow([rows.gpu[i], rows.model[i], rows.tp[i], rows.m[i], f"{meas[i]:.6g}",
                        f"{rows.min_s[i].sum():.6g}", f"{rows.max_s[i].sum():.6g}",
                        f"{before[i].sum():.6g}", f"{after[i].sum():.6g}",
                        f"{before[i].sum() / meas[i]:.4f}", f"{after[i].sum() / meas[i]:.4f}"]
                       + [v for j in range(len(OPS)) for v in
                          (f"{rows.median_s[i, j]:.6g}",
                           f"{before[i, j] / rows.median_s[i, j]:.4f}",
                           f"{after[i, j] / rows.median_s[i, j]:.4f}")])


def _fit_figures(ratio: np.ndarray) -> dict[str, float]:
    err = np.abs(ratio - 1)
    return {"max_abs_error": float(err.max()), "median_abs_error": float(np.median(err)),
            "ratio_min": float(ratio.min()), "ratio_max": float(ratio.max()),
            "rows_within_10pct": float(np.mean(err <= 0.1))}


def calibration_json(vidur: Path, rows: Rows, params: dict[str, GemmParams],
                     corrections: dict[str, Correction], mono: np.ndarray, after: np.ndarray,
                     lomo: np.ndarray) -> dict[str, Any]:
    meas = rows.median_s.sum(axis=1)
    ratio = after.sum(axis=1) / meas
    ratio_mono = mono.sum(axis=1) / meas
    try:
        shown = str(vidur.resolve().relative_to(ROOT.parent))
        shown = f"../{shown}"
    except ValueError:
        shown = str(vidur)
    out: dict[str, Any] = {
        "description": "Fitted parameters of sim/latency/gemm.py's GEMM time model, "
                       "t = launch_s + smax(2(kn + mk + mn)/bytes_s, 2kn*m'/flops_s), smax(a, b) "
                       "= (a + b + sqrt((a - b)^2 + overlap*a*b))/2, m' = m below m_tile, else m "
                       "rounded up to a multiple of m_tile; times correction.factors "
                       "interpolated linearly in tokens between correction.knots (constant "
                       "outside; measured GPUs only, GemmModel.for_gpu(..., correction=False) "
                       "leaves it out). Written by bench/calibrate_gemm.py.",
        "source": {
            "data": f"{shown}/compute/<gpu>/<org>/<model>/mlp.csv (relative to the repository)",
            "project": "github.com/microsoft/vidur (MIT licence; Agrawal et al., MLSys 2024)",
            "vidur_commit": VIDUR_COMMIT,
            "column": "time_stats.<op>.median, ops " + ", ".join(OPS),
            "rows": f"1 <= num_tokens <= {MAX_TOKENS}, every model and TP degree",
            "objective": "least squares of log(predicted/measured) of the four-GEMM sum per "
                         "layer; flops_s and bytes_s bounded by the datasheet; then the "
                         "correction: least squares of log(measured/smooth) of the same sums "
                         "over log(factor) piecewise linear on the knots, plus smoothness times "
                         "the squared second differences of log(factor)",
            "files_sha256": rows.files,
        },
        "fit_date": datetime.date.today().isoformat(),
        "reference_gpu": REFERENCE_GPU,
        "gpus": {},
    }
    for gpu, p in params.items():
        sel = rows.gpu == gpu
        spec = GPUS.get(gpu)
        knots, factors = corrections[gpu]
        out["gpus"][gpu] = {
            "vidur_folder": next(d for d, g in GPU_DIRS.items() if g == gpu),
            "models": sorted(set(rows.model[sel].tolist())),
            "datasheet": {"peak_bf16_flops": spec.peak_bf16_flops,
                          "memory_bandwidth_bytes_s": spec.memory_bandwidth_bytes_s},
            "params": {"launch_s": p.launch_s, "flops_s": p.flops_s, "bytes_s": p.bytes_s,
                       "overlap": p.overlap, "m_tile": p.m_tile,
                       "flops_fraction": p.flops_s / spec.peak_bf16_flops,
                       "bandwidth_fraction": p.bytes_s / spec.memory_bandwidth_bytes_s},
            "correction": {"knots": list(knots), "factors": list(factors),
                           "smoothness": SMOOTHNESS,
                           "note": "efficiency factor of tokens per iteration, one for every "
                                   "shape of this GPU; not applied to extrapolated GPUs"},
            "fit": {"rows": int(sel.sum()), **_fit_figures(ratio[sel]),
                    "best_monotone_max_abs_error": max(
                        monotone_bound(rows.m[s], meas[s]) for s in _series_masks(rows, gpu))},
            "fit_smooth_only": _fit_figures(ratio_mono[sel]),
            "fit_leave_one_model_out": _fit_figures(lomo[sel]),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("vidur", nargs="?", type=Path, default=DEFAULT_VIDUR,
                    help="Vidur profile folder (default ../shared/profiles/vidur)")
    ap.add_argument("--markdown", action="store_true", help="a compact table for the README")
    ap.add_argument("--rows", type=Path, help="write every row's ratios to this CSV")
    ap.add_argument("--no-write", action="store_true",
                    help=f"use the committed {CALIBRATION_PATH.name} instead of refitting it")
    args = ap.parse_args(argv)
    rows = load_rows(args.vidur)
    params: dict[str, GemmParams] = {}
    corrections: dict[str, Correction] = {}
    for gpu in sorted(set(rows.gpu.tolist())):
        if args.no_write:
            committed = GemmModel.for_gpu(GPUS.get(gpu))
            params[gpu] = committed.params
            if committed.correction is None:
                raise RuntimeError(f"{CALIBRATION_PATH}: no correction for {gpu}")
            corrections[gpu] = committed.correction
        else:
            params[gpu] = fit_gpu(gpu, rows.select(rows.gpu == gpu))
            corrections[gpu] = fit_correction(gpu, params[gpu], rows.select(rows.gpu == gpu))
    before = np.empty(rows.median_s.shape)
    mono = np.empty(rows.median_s.shape)
    after = np.empty(rows.median_s.shape)
    lomo = np.empty(len(rows.m))
    for gpu, p in params.items():
        sel = rows.gpu == gpu
        spec = GPUS.get(gpu)
        before[sel] = predict(GemmModel.naive(spec, NAIVE_MFU, NAIVE_MBU), rows.select(sel))
        mono[sel] = predict(GemmModel(p, gpu, "calibrated"), rows.select(sel))
        after[sel] = predict(GemmModel(p, gpu, "calibrated", correction=corrections[gpu]),
                             rows.select(sel))
        lomo[sel] = leave_one_model_out(gpu, p, rows.select(sel))
    if not args.no_write:
        data = calibration_json(args.vidur, rows, params, corrections, mono, after, lomo)
        CALIBRATION_PATH.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {CALIBRATION_PATH.relative_to(ROOT)}")
    if not args.markdown:
        for gpu, p in params.items():
            spec = GPUS.get(gpu)
            print(f"{gpu}: launch {p.launch_s * 1e6:.2f} us, {p.flops_s / 1e12:.0f} TFLOP/s "
                  f"({p.flops_s / spec.peak_bf16_flops:.0%} of datasheet), "
                  f"{p.bytes_s / 1e12:.2f} TB/s ({p.bytes_s / spec.memory_bandwidth_bytes_s:.0%}),"
                  f" overlap {p.overlap:.2f}, tile {p.m_tile}; correction factor "
                  f"{min(corrections[gpu][1]):.3f}-{max(corrections[gpu][1]):.3f} over "
                  f"{len(corrections[gpu][0])} knots")
        print()
    print("\n".join(report(rows, before, mono, after, lomo, args.markdown)))
    if args.rows:
        write_rows(args.rows, rows, before, after)
        print(f"wrote {args.rows}")
    if not args.markdown:
        print_beyond(args.vidur, params, corrections)
    return 0


def print_beyond(vidur: Path, params: dict[str, GemmParams],
                 corrections: dict[str, Correction]) -> None:
    """Rows beyond the fitted range (A100 Llama-3 go to 32768 tokens): not fitted, a check of
    extrapolation in tokens."""
    rows = load_rows(vidur, max_tokens=None)
    rows = rows.select(rows.m > MAX_TOKENS)
    if not len(rows.m):
        return
    print(f"\nBeyond the fit ({MAX_TOKENS} < tokens <= {rows.m.max()}, not fitted):")
    for gpu, model, tp in sorted(set(zip(rows.gpu.tolist(), rows.model.tolist(),
                                         rows.tp.tolist(), strict=True))):
        sel = (rows.gpu == gpu) & (rows.model == model) & (rows.tp == tp)
        sub = rows.select(sel)
        meas = sub.median_s.sum(axis=1)
        rm = predict(GemmModel(params[gpu], gpu, "calibrated"), sub).sum(axis=1) / meas
        ra = predict(GemmModel(params[gpu], gpu, "calibrated", correction=corrections[gpu]),
                     sub).sum(axis=1) / meas
        print(f"  {gpu:10} {model:26} TP{tp} {sel.sum():>3} rows: smooth {_stats(rm)}, "
              f"corrected {_stats(ra)}")


if __name__ == "__main__":
    sys.exit(main())
