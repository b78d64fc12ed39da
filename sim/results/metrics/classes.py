"""Each request class's own metrics (`workload.classes`): counts, latency distributions, its
pooled TBT gaps, and SLO attainment against the class's own targets (else the scenario's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from sim.config.slo import SLOConfig
from sim.results.columns import Columns, column, texts
from sim.results.metrics.summary import (
    FINISHED,
    WeightedSample,
    attainment,
    distribution,
    finished_distribution,
    slo_attainment,
)

if TYPE_CHECKING:
    from sim.config.scenario import Scenario
    from sim.results.records import TokenRuns

CLASS_COLUMNS = ("ttft_s", "client_ttft_s", "tpot_s", "e2e_s", "scheduling_delay_s",
                 "max_tbt_s")


def class_gaps(request_class: np.ndarray, num_classes: int, runs: TokenRuns,
               end_s: np.ndarray) -> list[WeightedSample]:
    """The TBT gaps of each class's requests, pooled (as `token_stats` pools them all)."""
    from sim.results.records import TokenRuns, token_stats

    owner_class = request_class[runs.owner]
    out = []
    for c in range(num_classes):
        keep = owner_class == c
        sub = TokenRuns(runs.owner[keep], runs.start[keep], runs.end[keep],
                        runs.num_runs[request_class == c])
        out.append(token_stats(sub, end_s).gaps)
    return out


def class_columns(request_class: np.ndarray, scenario: Scenario) -> Columns:
    """The request table's `request_class` (the class's name) and `priority` columns."""
    classes = scenario.workload.classes or []
    return {"request_class": texts([c.name for c in classes])[request_class],
            "priority": np.array([c.priority for c in classes], dtype=np.int64)[request_class]}


def class_summary(requests: Columns, gaps: list[WeightedSample], scenario: Scenario
                  ) -> dict[str, Any]:
    """The summary's `classes` (`class_stats`), and its `slo` judged by each request's class
    where any class has targets of its own (`combined_attainment`)."""
    out: dict[str, Any] = {"classes": class_stats(requests, gaps, scenario)}
    if any(c.slo is not None for c in scenario.workload.classes or []):
        out["slo"] = combined_attainment(requests, gaps, scenario)
    return out


def class_targets(scenario: Scenario) -> list[SLOConfig]:
    """Each class's SLO targets: its own, else the scenario's."""
    return [c.slo or scenario.slo for c in scenario.workload.classes or []]


def class_stats(requests: Columns, gaps: list[WeightedSample], scenario: Scenario
                ) -> list[dict[str, Any]]:
    """Per class, in the order given: its name, priority and share, request counts by
    outcome, latency distributions of its finished requests, its pooled TBT gaps, and SLO
    attainment against its targets."""
    classes = scenario.workload.classes or []
    names = column(requests, "request_class")
    out: list[dict[str, Any]] = []
    for c, slo, class_gap in zip(classes, class_targets(scenario), gaps, strict=True):
        rows = np.flatnonzero(names == c.name)
        sub = {name: column(requests, name)[rows] for name in requests}
        status = sub["status"]
        done = status == FINISHED
        out.append({
            "name": c.name, "priority": c.priority, "share": c.share,
            "requests": {"total": len(rows), "finished": int(done.sum()),
                         **{kind: int((status == kind).sum())
                            for kind in ("rejected", "failed", "unfinished")}},
            **{name: finished_distribution(sub[name][done]) for name in CLASS_COLUMNS
               if name in sub},
            "tbt_s": distribution(class_gap),
            "slo": {**slo_attainment(sub, class_gap, slo),
                    "targets": slo.model_dump(exclude_none=True)},
        })
    return out


def combined_attainment(requests: Columns, gaps: list[WeightedSample], scenario: Scenario
                        ) -> dict[str, float | None]:
    """SLO attainment over every offered request, each judged by its class's targets (one of
    a class without a target for a metric meets it); the gaps by their class's TBT target."""
    tbt = [t.tbt_s for t in class_targets(scenario)]
    total = sum(g.size for g in gaps)
    met = sum(int(g.counts[g.values <= (np.inf if limit is None else limit)].sum())
              for g, limit in zip(gaps, tbt, strict=True))
    ttft_s, tbt_s = request_targets(column(requests, "request_class").tolist(), scenario)
    return attainment(requests, ttft_s, tbt_s, met / total if total else None)


def request_targets(request_class: list[str], scenario: Scenario
                    ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Each request's TTFT and TBT targets, its class's (else the scenario's): inf where its
    class has none for a metric, None where no class has one."""
    targets = class_targets(scenario)
    index = {c.name: i for i, c in enumerate(scenario.workload.classes or [])}
    which = np.array([index[n] for n in request_class], dtype=np.int64)

    def per_request(values: list[float | None]) -> np.ndarray | None:
        if all(v is None for v in values):
            return None
        return np.array([np.inf if v is None else v for v in values])[which]

    return (per_request([t.ttft_s for t in targets]), per_request([t.tbt_s for t in targets]))


def priorities_ignored(scenario: Scenario) -> str | None:
    """Why requests of differing priorities are served without them, where they are: a pool
    whose policy serves in arrival order (vLLM's FCFS accepts priorities and ignores them)."""
    levels = sorted({c.priority for c in scenario.workload.classes or []})
    fcfs = [f"{pool.field}.scheduler ({pool.replica.scheduler.name})" for pool in scenario.pools()
            if getattr(pool.replica.scheduler, "scheduling_policy", None) != "priority"
            and not getattr(pool.replica.scheduler, "enable_priority_scheduling", False)]
    if len(levels) < 2 or not fcfs:
        return None
    return (f"the classes' priorities {levels} are ignored by {', '.join(fcfs)}, which serves "
            "in arrival order (vLLM's FCFS ignores them too): vllm_v1 with scheduling_policy: "
            "priority, or sglang with enable_priority_scheduling, orders by them")
