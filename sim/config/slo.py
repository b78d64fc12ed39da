"""A scenario's latency targets (`slo:`), apart from the rest of the scenario: the summary metrics
score attainment against them without importing every model a scenario holds."""

from __future__ import annotations

from pydantic import Field

from sim.config.base import Frozen


class SLOConfig(Frozen):
    ttft_s: float | None = Field(None, gt=0,
                                 description="target time to first token, seconds")
    tbt_s: float | None = Field(None, gt=0,
                                description="target gap between output tokens, seconds")
