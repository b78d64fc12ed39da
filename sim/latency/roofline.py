"""Roofline estimate from datasheet figures: each part of an iteration takes the longer of its
FLOPs at the achievable compute rate and its bytes at the achievable memory bandwidth.

Parts, timed separately because different kernels run them: the linear layers (GEMMs: weights
read once, 2 FLOPs per parameter per token), prefill attention (FLOPs from query-key pairs),
decode attention (bytes of KV read), and the LM head on the sampled rows; plus a fixed
per-iteration overhead (scheduling, launches, sampling). Uncalibrated: `mfu`, `mbu` and
`overhead_s` are guesses until a profile replaces them.
"""

from __future__ import annotations

from pydantic import Field

from sim.errors import INPUT_MODEL
from sim.gpus import GPUSpec
from sim.latency.base import LATENCY_MODELS, BatchShape, LatencyConfig, LatencyModel, Num, maximum
from sim.models import ModelShape


class RooflineConfig(LatencyConfig):
    model_config = INPUT_MODEL  # finite numbers only

    mfu: float = Field(0.6, gt=0, le=1, description="fraction of peak FLOP/s reached by GEMMs")
    mbu: float = Field(0.8, gt=0, le=1, description="fraction of peak bandwidth reached")
    overhead_s: float = Field(0.002, ge=0, le=1, description="fixed cost per iteration (< 1 s)")


@LATENCY_MODELS.register("roofline")
class RooflineLatency(LatencyModel):
    Config = RooflineConfig

    def __init__(self, config: RooflineConfig, model: ModelShape, gpu: GPUSpec) -> None:
        flops_s = gpu.peak_bf16_flops * config.mfu
        bytes_s = gpu.memory_bandwidth_bytes_s * config.mbu
        m = model
        self.overhead_s = config.overhead_s
        # Seconds per unit of each feature, precomputed so a prediction is a few multiply-adds.
        linear_params = m.num_layers * m.num_linear_params_per_layer
        self.linear_weights_s = linear_params * m.dtype_bytes / bytes_s
        self.linear_token_s = 2 * linear_params / flops_s
        self.attn_pair_s = 4 * m.num_layers * m.q_size / flops_s
        kv_token_bytes = m.kv_bytes_per_token
        self.kv_token_s = kv_token_bytes / bytes_s
        self.lm_head_weights_s = m.vocab_size * m.hidden_size * m.dtype_bytes / bytes_s
        self.lm_head_token_s = 2 * m.vocab_size * m.hidden_size / flops_s

    def iteration_time_s(self, shape: BatchShape) -> Num:
        linear = maximum(self.linear_token_s * shape.num_tokens, self.linear_weights_s)
        prefill_attn = maximum(
            self.attn_pair_s * shape.prefill_attn_pairs, self.kv_token_s * shape.prefill_kv_tokens
        )
        decode_attn = maximum(
            self.attn_pair_s * shape.decode_kv_tokens, self.kv_token_s * shape.decode_kv_tokens
        )
        # The LM head's weights are read only if some row samples.
        lm_head = maximum(
            self.lm_head_token_s * shape.num_sampled_tokens,
            self.lm_head_weights_s * (shape.num_sampled_tokens > 0),
        )
        return self.overhead_s + linear + prefill_attn + decode_attn + lm_head
