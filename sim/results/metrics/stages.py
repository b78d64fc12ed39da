"""Each load stage's own metrics (a workload sent in `stages`), as inference-perf reports a
stage."""

from __future__ import annotations

from typing import Any

import numpy as np

from sim.config.scenario import Scenario
from sim.results.columns import Columns, column
from sim.results.metrics.overload import overload
from sim.results.metrics.summary import FINISHED, finished_distribution

STAGE_COLUMNS = ("ttft_s", "client_ttft_s", "tpot_s", "e2e_s", "client_e2e_s")


def stage_stats(requests: Columns, scenario: Scenario, end_s: float) -> list[dict[str, Any]]:
    """Each load stage's own metrics, as inference-perf reports a stage: its rate, requests
    (finished, failed), finished requests per second (from its first arrival to its last
    end), latency distributions of its finished requests, and whether its queue grew."""
    stages = scenario.workload.load_stages()  # type: ignore[attr-defined]
    stage = column(requests, "stage")
    # Rows grouped by stage once (each stage a slice), not a mask over every row per stage.
    order = np.argsort(stage, kind="stable")
    ends = np.cumsum(np.bincount(stage, minlength=len(stages)))
    out = []
    for i, st in enumerate(stages):
        rows = order[(ends[i - 1] if i else 0):ends[i]]
        sub = {name: column(requests, name)[rows] for name in requests}
        done = sub["status"] == FINISHED
        failed = sub["status"] == "failed"
        first_s = float(sub["arrival_s"].min()) if len(rows) else 0.0
        # Its last end: a failed request's (its client gave up) counts, as inference-perf's.
        last_s = np.concatenate([sub["finish_s"][done], sub["failed_s"][failed]])
        span_s = float(last_s.max()) - first_s if done.any() else 0.0
        out.append({
            "stage": i, "rate_qps": st.rate_qps, "duration_s": st.duration_s,
            "requests": {"total": len(rows), "finished": int(done.sum()),
                         "failed": int(failed.sum())},
            "requests_per_s": int(done.sum()) / span_s if span_s > 0 else None,
            **{name: finished_distribution(sub[name][done]) for name in STAGE_COLUMNS},
            "overload": overload(sub, end_s) if len(rows) else None,
        })
    return out
