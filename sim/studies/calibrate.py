"""`servesim calibrate`: fit an engine calibration (`sim.config.engine`) to measured serving runs
(`sim.studies.measured`).

The fit is physical and shared by every run, never per run or per model: a grid of roofline
fields (attention's KV bandwidth `attention_mbu` and fixed time per layer `attention_layer_s` by
default) is simulated with no front end; at each point the front end is the least-squares line
`frontend_s + frontend_per_extra_gpu_s x (GPUs - 1)` through the stable stages' TTFT residuals
(measured client-side minus simulated engine-side); the point kept has the smallest loss, the
mean over stable stages of |error| of TPOT, TTFT and E2E means, each capped at 25% (one stage
at the edge of capacity cannot outweigh the rest), plus 25 for each stage whose overload
verdict differs from the measured one. Leave-one-model-out repeats the choice without each
model's runs and reports that model's error: how the calibration carries to a model it never
saw.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import math
import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from sim.studies.measured import (
    METRICS,
    Experiment,
    Stage,
    errors_pct,
    median_abs,
    simulate,
)

LOSS_METRICS = ("TPOT mean", "TTFT mean", "E2E mean")
CAP_PCT, VERDICT_PENALTY = 25.0, 25.0
DEFAULT_GRID = {"attention_mbu": [0.8, 0.85, 0.9, 0.95],
                "attention_layer_s": [0.0, 5e-6, 1e-5]}


@dataclass
class Fit:
    """A calibration's figures and its errors (% per stage and metric, client-side)."""

    latency: dict[str, float]
    frontend_s: float
    frontend_per_extra_gpu_s: float
    loss: float
    errors: list[dict[str, float | None]]
    verdicts: list[bool]  # simulated overloaded, per stage
    held_out: dict[str, dict[str, float]] = field(default_factory=dict)


def fit_frontend(stages: Sequence[Stage], sims: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """The front end's `(frontend_s, frontend_per_extra_gpu_s)` from the stable stages' TTFT-mean
    residuals (measured client-side minus simulated engine-side): a line in GPUs - 1 by least
    squares through each GPU count's median residual, weighted by its stages (medians: a stage
    at the edge of capacity, its TTFT off by a queue, does not move it), neither below 0."""
    by_gpus: dict[int, list[float]] = {}
    for stage, sim in zip(stages, sims, strict=True):
        if not stage.overloaded and sim["TTFT mean"] is not None and math.isfinite(
                stage.measured_ms["TTFT mean"]):
            by_gpus.setdefault(stage.num_gpus - 1, []).append(
                (stage.measured_ms["TTFT mean"] - sim["TTFT mean"]) / 1e3)
    if not by_gpus:
        return 0.0, 0.0
    xs = np.array(sorted(by_gpus), dtype=float)
    ys = np.array([np.median(by_gpus[int(x)]) for x in xs])
    weights = np.array([len(by_gpus[int(x)]) for x in xs], dtype=float)
    slope = 0.0
    if len(xs) > 1:
        mean_x = np.average(xs, weights=weights)
        mean_y = np.average(ys, weights=weights)
        slope = max(float(np.sum(weights * (xs - mean_x) * (ys - mean_y))
                          / np.sum(weights * (xs - mean_x) ** 2)), 0.0)
    intercept = max(float(np.average(ys - slope * xs, weights=weights)), 0.0)
    return intercept, slope


def loss(stages: Sequence[Stage], errors: Sequence[dict[str, float | None]],
         verdicts: Sequence[bool]) -> float:
    """Mean capped |error| of `LOSS_METRICS` over stable stages, plus the verdict penalty."""
    capped = [min(abs(e), CAP_PCT) for row in errors for name in LOSS_METRICS
              if (e := row[name]) is not None]
    wrong = sum(stage.overloaded is not None and stage.overloaded != v
                for stage, v in zip(stages, verdicts, strict=True))
    return (float(np.mean(capped)) if capped else 0.0) + VERDICT_PENALTY * wrong


def choose(stages: Sequence[Stage], by_point: Sequence[list[dict[str, Any]]],
           points: Sequence[dict[str, float]], keep: np.ndarray) -> Fit:
    """The grid point (with its fitted front end) of least loss on the stages where `keep`."""
    best: Fit | None = None
    kept = [s for s, k in zip(stages, keep, strict=True) if k]
    for point, sims in zip(points, by_point, strict=True):
        sub = [s for s, k in zip(sims, keep, strict=True) if k]
        front, per_gpu = fit_frontend(kept, sub)
        added = np.array([1e3 * (front + per_gpu * (s.num_gpus - 1)) for s in stages])
        errs = errors_pct(stages, sims, added)
        verdicts = [s["overloaded"] for s in sims]
        value = loss(kept, [e for e, k in zip(errs, keep, strict=True) if k],
                     [v for v, k in zip(verdicts, keep, strict=True) if k])
        if best is None or value < best.loss:
            best = Fit(dict(point), front, per_gpu, value, errs, verdicts)
    assert best is not None
    return best


def calibrate(experiments: Sequence[Experiment], grid: dict[str, list[float]],
              base_engine: str, jobs: int,
              on_done: Callable[[int, int], None] | None = None) -> tuple[Fit, Fit]:
    """The fitted calibration, and the errors of `base_engine` (before), over every stage of
    `experiments`; the fit's `held_out` holds each model's errors when left out of it."""
    points = [dict(zip(grid, values, strict=True))
              for values in itertools.product(*grid.values())]
    tasks: list[tuple[Experiment, dict[str, Any]]] = [
        (exp, {"engine": base_engine}) for exp in experiments]
    for point in points:
        tasks += [(exp, {"engine": "none", "latency": {"kind": "roofline", **point}})
                  for exp in experiments]
    results: list[list[dict[str, Any]]] = []
    with ProcessPoolExecutor(max(jobs, 1)) as pool:
        for i, result in enumerate(pool.map(simulate, tasks), 1):
            results.append(result)
            if on_done is not None:
                on_done(i, len(tasks))
    n = len(experiments)
    stages = [s for exp in experiments for s in exp.stages]

    def flat(chunk: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        return [s for run in chunk for s in run]

    before_sims = flat(results[:n])
    before_errs = errors_pct(stages, before_sims, np.zeros(len(stages)))
    before_verdicts = [s["overloaded"] for s in before_sims]
    before = Fit({}, 0.0, 0.0, loss(stages, before_errs, before_verdicts), before_errs,
                 before_verdicts)
    by_point = [flat(results[n * (k + 1): n * (k + 2)]) for k in range(len(points))]
    everything = np.ones(len(stages), dtype=bool)
    fit = choose(stages, by_point, points, everything)
    models = sorted({s.model for s in stages})
    if len(models) > 1:
        for model in models:
            own = np.array([s.model == model for s in stages])
            other = choose(stages, by_point, points, ~own)
            held = [e for e, k in zip(other.errors, own, strict=True) if k]
            fit.held_out[model] = {name: m for name, *_ in METRICS
                                   if (m := median_abs(held, name)) is not None}
    return fit, before


def error_summary(stages: Sequence[Stage], fit: Fit) -> str:
    """The one-paragraph validation error of a fit, as a calibration file states it."""
    medians = {name: median_abs(fit.errors, name) for name, *_ in METRICS}
    known = [(s.overloaded, v) for s, v in zip(stages, fit.verdicts, strict=True)
             if s.overloaded is not None]
    stable = sum(not s.overloaded for s in stages)
    text = (f"median |error| over {stable} stable stages, client-side: "
            + ", ".join(f"{name} {m:.1f}%" for name, m in medians.items() if m is not None))
    if known:
        text += (f"; overload verdict equal at {sum(a == b for a, b in known)} of {len(known)} "
                 "stages")
    if fit.held_out:
        worst = {name: max(h.get(name, 0.0) for h in fit.held_out.values())
                 for name in LOSS_METRICS}
        text += ("; leave-one-model-out, worst model's median: "
                 + ", ".join(f"{name} {m:.1f}%" for name, m in worst.items()))
    return text


def calibration_yaml(name: str, experiments: Sequence[Experiment], files: Sequence[Path],
                     grid: dict[str, list[float]], fit: Fit, command: str) -> str:
    """The calibration file of a fit, with its provenance and validation error."""
    stages = [s for exp in experiments for s in exp.stages]
    engines = sorted({exp.engine for exp in experiments})
    gpus = sorted({exp.gpu for exp in experiments})
    digests = ", ".join(f"{p.name} sha256 {hashlib.sha256(p.read_bytes()).hexdigest()[:16]}"
                        for p in files)
    provenance = (f"servesim calibrate on {len(experiments)} experiments, {len(stages)} load "
                  f"stages ({digests}); grid "
                  + ", ".join(f"{k} {v}" for k, v in grid.items())
                  + f"; front end by least squares on TTFT; `{command}` at {checkout_commit()}, "
                  f"{datetime.date.today().isoformat()}")
    data = {"name": name, "engine": "/".join(engines), "gpu": "/".join(gpus),
            "latency": {k: float(v) for k, v in fit.latency.items()},
            "frontend_s": round(fit.frontend_s, 6),
            "frontend_per_extra_gpu_s": round(fit.frontend_per_extra_gpu_s, 6),
            "provenance": provenance, "error": error_summary(stages, fit),
            "error_band": error_band(fit)}
    return yaml.safe_dump(data, sort_keys=False, width=100)


def error_band(fit: Fit) -> float:
    """The fraction iteration times are trusted within on the GPU measured: the worst model's
    median |error| of TPOT and E2E means, held out (all runs in, where one model only)."""
    if fit.held_out:
        worst = max(h.get(name, 0.0) for h in fit.held_out.values()
                    for name in ("TPOT mean", "E2E mean"))
    else:
        worst = max(median_abs(fit.errors, name) or 0.0 for name in ("TPOT mean", "E2E mean"))
    return round(worst / 100, 4)


def checkout_commit() -> str:
    """servesim's commit, and whether `sim/` differs from it, if it runs from a checkout."""
    root = Path(__file__).resolve().parents[2]

    def git(*words: str) -> str:
        try:
            return subprocess.run(["git", *words], cwd=root, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "an installed servesim"
    return head + (" with changes to sim/" if git("status", "--porcelain", "--", "sim") else "")
