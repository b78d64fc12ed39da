"""A measured experiment as `servesim calibrate` and `validation/public/` compare with it: its
stages and what each measured, the scenario that replays it (`sim.studies.measured` and
`sim.studies.inference_perf` read them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

STAGE_GAP_S = 10.0  # from a stage's last send to the next's first: every request done
# The client's total timeout where the table says none was set: aiohttp's default, which
# inference-perf's client then runs with (the data's README, caveat 7).
AIOHTTP_DEFAULT_TIMEOUT_S = 300.0


@dataclass
class Stage:
    """One measured load stage: what servesim is compared with."""

    name: str  # experiment@rate
    model: str
    num_gpus: int
    overloaded: bool | None  # None: not known (a benchmark's result file does not say)
    measured_ms: dict[str, float]
    # Share of the stage's requests that succeeded (the rest: client timeouts); None: not known.
    succeeded: float | None = None


@dataclass
class Experiment:
    """The stages one server ran one after another: one simulated run."""

    name: str
    scenario: dict[str, Any]
    stages: list[Stage]
    engine: str
    gpu: str
    base_dir: Path | None = None  # where the scenario's relative paths start
    engine_side: bool = False  # measured in the engine (no API server): compare engine-side
