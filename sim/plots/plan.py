"""A plan's figure: each SLO's measured value against the deployment's cost, one panel per SLO,
every deployment verified at the target load (held: filled, failed: hollow), the cost/SLO front
as a step line, the target as a dashed line and the chosen deployment starred."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sim.plots.common import plt, save
from sim.studies.plan import KindResult, objective
from sim.studies.plan_answer import front
from sim.studies.plan_file import Plan, slo_label


def plan_figure(plan: Plan, results: list[KindResult], found: dict[str, Any],
                path: Path) -> list[Path]:
    slo = plan.config.slo
    runs = [ev for r in results for ev in r.evaluations if ev.role == "cluster"]
    fig, axes = plt.subplots(1, len(slo), figsize=(4.6 * len(slo), 4.2), squeeze=False)
    cost_label = "USD an hour" if plan.config.objective == "cost" else "GPUs"
    chosen = found.get("chosen")
    for ax, (key, target) in zip(axes[0], slo.items(), strict=True):
        scale = 100.0 if key == "attainment" else 1e3
        unit = "%" if key == "attainment" else "ms"
        shown = [ev for ev in runs if ev.values.get(key) is not None
                 and not math.isinf(ev.values[key] or 0)]
        for ok, style in ((True, {"marker": "o", "color": "tab:blue", "label": "holds"}),
                          (False, {"marker": "o", "markerfacecolor": "none",
                                   "color": "tab:gray", "label": "fails"})):
            part = [ev for ev in shown if ev.ok is ok]
            if part:
                ax.plot([objective(plan, ev) for ev in part],
                        [scale * (ev.values[key] or 0.0) for ev in part], linestyle="none",
                        **style)
        for ev in shown:
            if ev.ok:
                ax.annotate(f"{ev.kind} x{ev.replicas}", (objective(plan, ev),
                            scale * (ev.values[key] or 0.0)), fontsize=6, alpha=0.8,
                            xytext=(3, 3), textcoords="offset points")
        edge = front(plan, shown, key)
        if len(edge) > 1:
            ax.step([objective(plan, ev) for ev in edge],
                    [scale * (ev.values[key] or 0.0) for ev in edge], where="post",
                    color="tab:green", linewidth=1, label="front")
        ax.axhline(scale * target, color="red", linestyle="--", linewidth=1,
                   label=f"target {scale * target:g} {unit}")
        if chosen is not None and chosen["values"].get(key) is not None:
            cost = (chosen["usd_per_hour"] if plan.config.objective == "cost"
                    else chosen["num_gpus"])
            ax.plot([cost], [scale * chosen["values"][key]], marker="*", markersize=16,
                    color="gold", markeredgecolor="black", linestyle="none", label="chosen")
        ax.set_xlabel(cost_label)
        ax.set_ylabel(f"{slo_label(key)} ({unit})")
        if key == "attainment":
            ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{plan.config.name}: deployments at {plan.config.target_qps:g} req/s")
    return save(fig, path)
