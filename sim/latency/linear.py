"""An iteration takes a fixed time plus a time per scheduled token: the step-time function of
the golden schedules (`tools/golden/`), where timestamps must equal an engine's to the bit."""

from __future__ import annotations

from pydantic import Field

from sim.config.errors import INPUT_MODEL
from sim.hardware.gpus import GPUSpec
from sim.hardware.models import ModelShape
from sim.latency.base import LATENCY_MODELS, BatchShape, LatencyConfig, LatencyModel, Num


class LinearConfig(LatencyConfig):
    model_config = INPUT_MODEL  # finite: an infinite iteration would finish nothing

    base_s: float = Field(0.005, gt=0, description="seconds per iteration, whatever its batch")
    per_token_s: float = Field(0.0, ge=0,
                               description="seconds per token scheduled (prefill or decode)")


@LATENCY_MODELS.register("linear")
class LinearLatency(LatencyModel):
    """base_s + per_token_s x the iteration's scheduled tokens, computed in that order (the
    golden recorders' float sums)."""

    Config = LinearConfig

    def __init__(self, config: LinearConfig, model: ModelShape, gpu: GPUSpec) -> None:
        self.base_s = config.base_s
        self.per_token_s = config.per_token_s

    def iteration_time_s(self, shape: BatchShape) -> Num:
        return self.base_s + self.per_token_s * shape.num_tokens
