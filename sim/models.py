"""Decoder model shapes (Llama/Mistral/Qwen style: GQA attention, SwiGLU MLP, RMSNorm).

Shared by the roofline model, the KV sizing and the profiler, which builds the same model with
random weights. Figures come from each model's published `config.json` on its model card.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.registry import Registry


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    dtype_bytes: int = 2  # bf16
    # Context window, prompt plus output (`max_position_embeddings`, vLLM's default max_model_len).
    max_model_len: int | None = None
    source: str = ""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_linear_params_per_layer(self) -> int:
        """QKV, output projection and the three SwiGLU matrices of one layer."""
        h = self.hidden_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = 3 * h * self.intermediate_size
        return attn + mlp

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_embeddings else embed
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.num_layers * self.num_linear_params_per_layer + embed + lm_head + norms

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.kv_size * self.dtype_bytes


MODELS: Registry[ModelShape] = Registry("model")


def _add(shape: ModelShape) -> None:
    MODELS.register(shape.name)(shape)


_add(ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, max_model_len=8192,
                source="meta-llama/Meta-Llama-3-8B config.json"))
# Llama-3.1: the same shape with a 128k context (RoPE scaling), for long-context traces.
_add(ModelShape("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, max_model_len=131072,
                source="meta-llama/Llama-3.1-8B config.json"))
_add(ModelShape("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, max_model_len=4096,
                source="meta-llama/Llama-2-7b-hf config.json"))
_add(ModelShape("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32000, max_model_len=32768,
                source="mistralai/Mistral-7B-v0.1 config.json"))
_add(ModelShape("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, max_model_len=40960,
                source="Qwen/Qwen3-8B config.json"))
# A model small enough to profile on a CPU in seconds; the shape of a Llama, scaled down.
_add(ModelShape("tiny", 4, 256, 4, 2, 64, 688, 4096, max_model_len=32768,
                source="servesim test model"))
