"""A scenario's workload, loaded: its format's requests, selected (`select`); and the rate
knob a study turns (`qps` of generated arrivals, `rate_scale` of a timed trace)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sim.workloads import FORMATS, Workload, select
from sim.workloads.base import TraceSessionsConfig
from sim.workloads.classes import draw_classes
from sim.workloads.sessions import with_trace_sessions

if TYPE_CHECKING:
    from sim.config.scenario import Scenario


def load_workload(scenario: Scenario, base_dir: Path | None = None) -> Workload:
    cfg = scenario.workload
    rng = np.random.default_rng(scenario.seed)
    full = FORMATS.get(cfg.format)().load(cfg, base_dir or Path.cwd(), rng)
    chosen = select(full, cfg)
    if isinstance(sessions := getattr(cfg, "sessions", None), TraceSessionsConfig):
        chosen = with_trace_sessions(chosen, cfg, sessions)
    if cfg.retime is not None:
        # The selected requests, in their order, at the new process's times.
        chosen = dataclasses.replace(chosen, arrival_s=cfg.retime.sample(len(chosen), rng))
    if cfg.classes is not None and chosen.request_class is None:
        chosen = dataclasses.replace(chosen, request_class=draw_classes(
            cfg.classes, len(chosen), scenario.seed, chosen.sessions))
    return chosen


def rate_knob(scenario: Scenario) -> str:
    """`qps` for generated arrivals (a format's own, or a trace's `retime`), `rate_scale` for
    timed traces."""
    workload = scenario.workload
    generated = getattr(workload, "arrivals", None) is not None or workload.retime is not None
    return "qps" if generated else "rate_scale"


def with_rate(scenario: Scenario, rate: float, seed: int) -> Scenario:
    """`scenario` at `rate` (on its knob) with `seed`."""
    workload = scenario.workload
    if workload.retime is not None:
        workload = workload.model_copy(update={
            "retime": workload.retime.model_copy(update={"qps": rate})})
    elif rate_knob(scenario) == "qps":
        arrivals = workload.arrivals.model_copy(update={"qps": rate})  # type: ignore[attr-defined]
        workload = workload.model_copy(update={"arrivals": arrivals})
    else:
        workload = workload.model_copy(update={"rate_scale": rate})
    return scenario.model_copy(update={"workload": workload, "seed": seed})


def trace_qps(scenario: Scenario) -> float:
    """Mean arrival rate of the selected trace at rate scale 1."""
    workload = scenario.workload.model_copy(update={"rate_scale": 1.0})
    arrivals = load_workload(scenario.model_copy(update={"workload": workload})).arrival_s
    return (len(arrivals) - 1) / arrivals[-1] if len(arrivals) > 1 and arrivals[-1] > 0 else 0.0
