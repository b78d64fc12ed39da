"""A plan's figure, drawn from its files (`plan.json`, `candidates.csv`): each SLO's measured
value against the deployment's cost (log-log), one panel per SLO, every deployment run at the
target load (holds: filled; fails: hollow; beyond the top of the panel: a triangle at its
edge), the cost/SLO front, the target (dashed) and the chosen deployment (a star, named)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib import ticker

from sim.plots.common import plt, save
from sim.studies.plan_file import slo_label

TOP = 10.0  # the panel shows values up to this many times the target


def plan_figure(plan_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Draw `plan.png` (and .svg) from the plan's files into `out_dir` (default: the plan's
    own directory); nothing where no deployment ran at the target (every kind refused)."""
    from sim.results.read import read_csv, read_json

    record = read_json(plan_dir / "plan.json")
    table = read_csv(plan_dir / "candidates.csv")
    slo = record["plan"]["slo"]
    runs = table[table["role"] == "cluster"]  # at the target, nominal times, the base's seed
    if record["objective"] == "load_per_dollar":
        return _load_figure(record, plan_dir, out_dir)
    if runs.empty:
        return []
    by_gpus = record["objective"] == "gpus"
    cost = runs["num_gpus" if by_gpus else "usd_per_hour"].to_numpy(np.float64)
    fig, axes = plt.subplots(1, len(slo), figsize=(5.2 * len(slo), 5.4), squeeze=False)
    chosen = record["answer"].get("chosen")
    for ax, (key, target) in zip(axes[0], slo.items(), strict=True):
        percent = key == "attainment"
        scale, unit = (100.0, "%") if percent else (1e3, "ms")
        values = runs[key].to_numpy(np.float64) * scale if key in runs else np.full(
            len(runs), np.nan)
        ok = runs["ok"].astype(bool).to_numpy()
        top = 100.0 if percent else TOP * target * scale
        beyond = np.zeros(len(values), dtype=bool) if percent else values > top
        shown = np.where(beyond, top, values)
        for held, style in ((True, {"color": "tab:blue", "label": "holds"}),
                            (False, {"markerfacecolor": "none", "color": "tab:gray",
                                     "label": "fails"})):
            mask = (ok == held) & ~beyond & np.isfinite(shown)
            ax.plot(cost[mask], shown[mask], marker="o", linestyle="none", **style)
        if beyond.any():
            ax.plot(cost[beyond], shown[beyond], marker="^", linestyle="none",
                    color="tab:gray", markerfacecolor="none",
                    label=f"beyond {TOP:g}x the target")
        order = np.lexsort((shown, cost))
        front_x, front_y, best = [], [], math.inf
        for i in order:  # each cost's best value, where it beats every cheaper one
            value = shown[i] if not percent else -shown[i]
            if np.isfinite(value) and value < best:
                best = value
                front_x.append(cost[i])
                front_y.append(shown[i])
        if len(front_x) > 1:
            ax.step(front_x, front_y, where="post", color="tab:green", linewidth=1,
                    label="front")
        ax.axhline(scale * target, color="red", linestyle="--", linewidth=1,
                   label=f"target {scale * target:g} {unit}")
        if chosen is not None and chosen["values"].get(key) is not None:
            x = chosen["num_gpus"] if by_gpus else chosen["usd_per_hour"]
            y = scale * chosen["values"][key]
            ax.plot([x], [y], marker="*", markersize=16, color="gold", markeredgecolor="black",
                    linestyle="none", label=f"chosen: {chosen['kind']} x{chosen['replicas']}")
        if np.nanmax(cost) > 10 * np.nanmin(cost):  # a log axis where costs span decades
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        if not percent:
            ax.set_yscale("log")
            ax.yaxis.set_minor_formatter(ticker.NullFormatter())
            ax.set_ylim(top=top * 1.5)
        else:
            ax.set_ylim(0, 105)
        ax.set_xlabel("GPUs" if by_gpus else "USD an hour")
        ax.set_ylabel(f"{slo_label(key)} ({unit})")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2,
                  frameon=False)
    fig.suptitle(f"{record['name']}: deployments at {record['target_qps']:g} req/s")
    return save(fig, (out_dir or plan_dir) / "plan.png")


def _load_figure(record: dict, plan_dir: Path, out_dir: Path | None) -> list[Path]:
    """load_per_dollar: each kind's most load against what one replica (unit) costs, with the
    line of the chosen kind's load per dollar, and the checked kinds' load at the error band's
    slow end."""
    ranking = record["answer"].get("ranking") or []
    if not ranking:
        return []
    qps = np.array([r["capacity_qps"] for r in ranking])
    per = np.array([r["qps_per_usd_hour"] for r in ranking])
    cost = qps / per
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    ax.plot(cost, qps, marker="o", linestyle="none", color="tab:blue", label="kinds")
    slow = np.array([np.nan if r.get("slow_qps_per_usd_hour") is None
                     else r["slow_qps_per_usd_hour"] for r in ranking]) * cost
    checked = ~np.isnan(slow)
    if checked.any():  # each kind checked across the band: down to its slow end's load
        ax.vlines(cost[checked], slow[checked], qps[checked], color="tab:red", linewidth=1.5)
        ax.plot(cost[checked], slow[checked], marker="_", markersize=10, linestyle="none",
                color="tab:red", label="at the error band's slow end")
    best = per[0]
    xs = np.array([cost.min() * 0.8, cost.max() * 1.25])
    ax.plot(xs, best * xs, color="tab:green", linewidth=1,
            label=f"{best:.3g} req/s per USD an hour")
    ax.plot([cost[0]], [qps[0]], marker="*", markersize=16, color="gold",
            markeredgecolor="black", linestyle="none", label=f"chosen: {ranking[0]['kind']}")
    ax.set_xlabel("USD an hour (one replica or P:D unit)")
    ax.set_ylabel("most load held (req/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    fig.suptitle(f"{record['name']}: load per dollar")
    return save(fig, (out_dir or plan_dir) / "plan.png")
