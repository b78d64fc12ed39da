"""Figures, drawn from result files only (a run's directory, or a sweep's results table).
Each is written as PNG and SVG, titled, with units on the axes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402


def save(fig: Any, path: Path) -> list[Path]:
    """Write `path` as .png and .svg; return both."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    out = [path.with_suffix(".png"), path.with_suffix(".svg")]
    for p in out:
        fig.savefig(p, dpi=120)
    plt.close(fig)
    return out


def p99_tbt_vs_load(table: pd.DataFrame, load: str, group: str, path: Path, *,
                    slo_s: float | None = None, title: str = "P99 TBT vs load") -> list[Path]:
    """P99 TBT (mean over seeds) against `load`, one line per value of `group`."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, part in table.groupby(group, sort=True):
        mean = part.groupby(load)["tbt_p99_s"].mean().sort_index()
        ax.plot(mean.index, 1e3 * mean.to_numpy(), marker="o", label=str(key))
    if slo_s is not None:
        ax.axhline(1e3 * slo_s, color="red", linestyle="--", label=f"SLO {1e3 * slo_s:g} ms")
    ax.set(xlabel=load, ylabel="P99 TBT (ms)", title=title)
    ax.legend(title=group)
    return save(fig, path)


def latency_vs_throughput(table: pd.DataFrame, group: str, path: Path,
                          metric: str = "tbt_p99_s") -> list[Path]:
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, part in table.groupby(group, sort=True):
        part = part.sort_values("output_tokens_per_s")
        ax.plot(part["output_tokens_per_s"], 1e3 * part[metric], marker="o", label=str(key))
    ax.set(xlabel="throughput (output tokens/s)", ylabel=f"{metric.removesuffix('_s')} (ms)",
           title="latency vs throughput")
    ax.legend(title=group)
    return save(fig, path)


def cdfs(run_dirs: Sequence[Path], path: Path, labels: Sequence[str] | None = None
         ) -> list[Path]:
    """TTFT and TBT CDFs of runs (TBT from tokens.parquet if written, else each request's
    worst gap)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for i, run in enumerate(run_dirs):
        label = labels[i] if labels else run.name
        req = pd.read_parquet(run / "requests.parquet")
        _cdf(left, 1e3 * req["ttft_s"].dropna().to_numpy(), label)
        tokens = run / "tokens.parquet"
        if tokens.is_file():
            t = pd.read_parquet(tokens)
            gaps = t.groupby("request_id")["time_s"].diff().dropna().to_numpy()
            tbt_label = "TBT, every gap (ms)"
        else:
            gaps = req["max_tbt_s"].dropna().to_numpy()
            tbt_label = "worst TBT per request (ms)"
        _cdf(right, 1e3 * gaps, label)
    left.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF", xscale="log")
    right.set(xlabel=tbt_label, ylabel="fraction", title="TBT CDF", xscale="log")
    left.legend()
    return save(fig, path)


def _cdf(ax: Any, values: np.ndarray, label: str) -> None:
    values = np.sort(values[values > 0])
    if values.size:
        ax.plot(values, np.arange(1, values.size + 1) / values.size, label=label)


def capacity_bars(capacities: dict[str, dict[str, float]], path: Path) -> list[Path]:
    """Capacity per scheduler under each SLO (Sarathi-Serve's figure): {slo: {scheduler: qps}}."""
    fig, ax = plt.subplots(figsize=(6, 4))
    slos = list(capacities)
    schedulers = sorted({s for per in capacities.values() for s in per})
    width = 0.8 / max(1, len(schedulers))
    for j, scheduler in enumerate(schedulers):
        values = [capacities[slo].get(scheduler, 0.0) for slo in slos]
        ax.bar(np.arange(len(slos)) + j * width, values, width, label=scheduler)
    ax.set_xticks(np.arange(len(slos)) + width * (len(schedulers) - 1) / 2, slos)
    ax.set(ylabel="capacity (requests/s)", title="capacity under SLO")
    ax.legend()
    return save(fig, path)


def iteration_timeline(run_dir: Path, path: Path, replica_id: int = 0,
                       window_s: tuple[float, float] | None = None) -> list[Path]:
    """Each iteration's prefill and decode tokens over time (one replica)."""
    its = pd.read_parquet(run_dir / "iterations.parquet")
    its = its[its["replica_id"] == replica_id]
    if window_s is not None:
        its = its[(its["start_s"] >= window_s[0]) & (its["start_s"] < window_s[1])]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(its["start_s"], its["num_decode_tokens"], width=its["duration_s"], align="edge",
           label="decode tokens", color="tab:blue")
    ax.bar(its["start_s"], its["num_prefill_tokens"], width=its["duration_s"], align="edge",
           bottom=its["num_decode_tokens"], label="prefill tokens", color="tab:orange")
    ax.set(xlabel="time (s)", ylabel="tokens in the iteration",
           title=f"iterations of replica {replica_id}")
    ax.legend()
    return save(fig, path)


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """The figures one run's files support: CDFs and the iteration timeline."""
    out_dir = out_dir or run_dir / "plots"
    its = pd.read_parquet(run_dir / "iterations.parquet")
    start = float(its["start_s"].min())
    files = cdfs([run_dir], out_dir / "cdf")
    files += iteration_timeline(run_dir, out_dir / "timeline", window_s=(start, start + 5.0))
    return files


def plot_sweep(sweep_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """The figures a sweep's table supports: P99 TBT vs the first varied field, per the
    second (if any), and latency vs throughput."""
    table = pd.read_parquet(sweep_dir / "results.parquet")
    out_dir = out_dir or sweep_dir / "plots"
    varied = [c for c in table.columns if c not in {"seed", "key"} and c not in _metrics()]
    if not varied:
        return []
    load = varied[0]
    group = varied[1] if len(varied) > 1 else "seed"
    scenario = yaml.safe_load((sweep_dir / "runs" / table["key"].iloc[0] / "scenario.yaml")
                              .read_text())
    slo_s = (scenario.get("slo") or {}).get("tbt_s")
    files = p99_tbt_vs_load(table, load, group, out_dir / "p99_tbt_vs_load", slo_s=slo_s)
    files += latency_vs_throughput(table, group, out_dir / "latency_vs_throughput")
    return files


def _metrics() -> set[str]:
    from sim.sweep import METRICS

    return set(METRICS)
