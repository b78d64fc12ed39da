"""Every iteration takes the same time: for tests, where timestamps must be exact."""

from __future__ import annotations

from pydantic import Field

from sim.config.errors import INPUT_MODEL
from sim.hardware.gpus import GPUSpec
from sim.hardware.models import ModelShape
from sim.hardware.parallelism import SINGLE_GPU, Parallelism
from sim.latency.base import LATENCY_MODELS, BatchShape, LatencyConfig, LatencyModel, Num


class ConstantConfig(LatencyConfig):
    model_config = INPUT_MODEL  # finite: an infinite iteration would finish nothing

    iteration_s: float = Field(0.01, gt=0, description="seconds per iteration, whatever its batch")


@LATENCY_MODELS.register("constant")
class ConstantLatency(LatencyModel):
    Config = ConstantConfig

    def __init__(self, config: ConstantConfig, model: ModelShape, gpu: GPUSpec,
                 parallelism: Parallelism = SINGLE_GPU) -> None:
        self.iteration_s = config.iteration_s

    def iteration_time_s(self, shape: BatchShape) -> Num:
        return self.iteration_s
