"""A decoder model's shape: dense (Llama, Mistral, Qwen2/3), MoE (Mixtral, Qwen-MoE, DeepSeek)
and DeepSeek's multi-head latent attention (MLA); SwiGLU MLPs and RMSNorm throughout; its
parameter and FLOP counts. The registry of named models is `sim.hardware.models`.

Parameter counts are those of the weight matrices, the embedding table, the LM head (unless
tied) and the RMSNorm vectors. Biases (Qwen2's q/k/v), Qwen3's per-head q/k norms and routers'
bias terms are left out: under 0.01% of any model here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """One decoder's shape.

    Dense layers use `intermediate_size`; MoE layers (`moe_layer_indices`) a router, `num_experts`
    routed experts of `moe_intermediate_size` each (`num_experts_per_token` of them per token)
    and shared experts `shared_expert_intermediate_size` wide in all (0: none).

    MLA (`kv_lora_rank` > 0): queries come from `q_proj` (or `q_a_proj`/`q_b_proj` through
    `q_lora_rank`), keys and values from a compressed latent of `kv_lora_rank` plus a shared RoPE
    key of `qk_rope_head_dim`; `head_dim`, `q_size` and `kv_size` then describe no real tensor.
    KV bytes per token are those of the latent vLLM caches, `num_layers * (kv_lora_rank +
    qk_rope_head_dim) * kv_element_bytes`: an approximation that ignores the layout padding of
    some attention backends.

    `kv_dtype` is the KV cache's type as a replica's `kv_cache.dtype` names it: "auto" (the
    weights' dtype), or an fp8 format (one byte per element).
    `linear_dtype_bytes` likewise for the weights of the linear layers a replica with
    `quantization: fp8` stores in fp8, as vLLM's fp8 method does (`Fp8LinearMethod`,
    `Fp8MoEMethod`): attention projections, MLPs and experts; the embedding table, the LM
    head, norms and MoE routers stay in `dtype_bytes`.
    """

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
    kv_dtype: str = "auto"  # the KV cache's type as the scenario names it (`kv_cache.dtype`)
    # Bytes per weight of the quantized linear layers (attention projections, MLPs, experts)
    # where they differ from `dtype_bytes` (`quantization: fp8`: 1); None: dtype_bytes.
    linear_dtype_bytes: int | None = None
    # A config.json whose `quantization_config` says its linear layers are stored in fp8: a
    # replica must run it with `quantization: fp8`.
    checkpoint_fp8: bool = False
    # ... with a scale per 128 x 128 block of weights (`weight_block_size`, DeepSeek-V3's)
    fp8_block_scales: bool = False
    # Context window, prompt plus output (`max_position_embeddings`, vLLM's default max_model_len).
    max_model_len: int | None = None
    source: str = ""
    # Mixture of experts (num_experts == 0: dense).
    num_experts: int = 0  # routed experts per MoE layer
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0  # one routed expert's width
    shared_expert_intermediate_size: int = 0  # all shared experts' width together
    moe_layers: tuple[int, ...] | None = None  # MoE layer indices; None: every layer (if MoE)
    # Group-limited routing (DeepSeek's `n_group`, `topk_group`): the experts in equal groups,
    # each token's k experts from its `expert_groups_per_token` best groups; 1: no groups.
    num_expert_groups: int = 1
    expert_groups_per_token: int = 1
    # Multi-head latent attention (kv_lora_rank == 0: GQA/MHA).
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        if not self.is_moe:
            return ()
        return tuple(range(self.num_layers)) if self.moe_layers is None else self.moe_layers

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_indices)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def attn_params_per_layer(self) -> int:
        """The attention's projections: QKV and output (GQA), or MLA's q_proj (q_a_proj and
        q_b_proj), kv_a_proj_with_mqa, kv_b_proj and o_proj. Its norms count in `norm_params`."""
        h = self.hidden_size
        if not self.is_mla:
            return h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        qk = self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        r = self.q_lora_rank
        q = h * r + r * qk if r else h * qk  # through the q_a/q_b low-rank pair, or q_proj
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_a + kv_b + self.num_heads * self.v_head_dim * h

    @property
    def dense_mlp_params_per_layer(self) -> int:
        """The three SwiGLU matrices of a dense layer."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        """One routed expert (three SwiGLU matrices)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def shared_expert_params(self) -> int:
        """All shared experts of one MoE layer."""
        return 3 * self.hidden_size * self.shared_expert_intermediate_size

    @property
    def router_params_per_layer(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def moe_params_per_layer(self) -> int:
        """Router, every routed expert and the shared experts of one MoE layer."""
        return self.router_params_per_layer + self.num_experts * self.expert_params \
            + self.shared_expert_params

    @property
    def num_linear_params_per_layer(self) -> int:
        """Attention plus a dense MLP: every linear weight of one layer of a dense model. For an
        MoE model, what one of its dense layers holds; its MoE layers hold
        `attn_params_per_layer + moe_params_per_layer` instead."""
        return self.attn_params_per_layer + self.dense_mlp_params_per_layer

    @property
    def norm_params(self) -> int:
        """RMSNorm weights: two per layer, the final one, and MLA's latent (and query) norms."""
        mla = self.kv_lora_rank + (self.q_lora_rank or 0) if self.is_mla else 0
        return (2 * self.num_layers + 1) * self.hidden_size + self.num_layers * mla

    @property
    def embedding_params(self) -> int:
        """The embedding table plus the LM head unless tied to it."""
        embed = self.vocab_size * self.hidden_size
        return embed if self.tie_embeddings else 2 * embed

    @property
    def num_params(self) -> int:
        layers = self.num_layers * self.attn_params_per_layer \
            + self.num_dense_layers * self.dense_mlp_params_per_layer \
            + self.num_moe_layers * self.moe_params_per_layer
        return layers + self.embedding_params + self.norm_params

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to (the
        embedding table counts in full, as in Mistral's 12.9B for Mixtral)."""
        idle = self.num_experts - self.num_experts_per_token
        return self.num_params - self.num_moe_layers * idle * self.expert_params

    @property
    def linear_weight_bytes(self) -> int:
        """Bytes of one weight of the (possibly quantized) linear layers."""
        return self.dtype_bytes if self.linear_dtype_bytes is None else self.linear_dtype_bytes

    @property
    def num_unquantized_params(self) -> int:
        """What fp8 quantization leaves in `dtype_bytes`: the embedding table and LM head,
        the norms, the MoE routers."""
        return (self.embedding_params + self.norm_params
                + self.num_moe_layers * self.router_params_per_layer)

    @property
    def weight_bytes(self) -> int:
        kept = self.num_unquantized_params
        return kept * self.dtype_bytes + (self.num_params - kept) * self.linear_weight_bytes

    @property
    def active_weight_bytes(self) -> int:
        """Bytes of the weights one token uses (`num_active_params`)."""
        idle = self.num_experts - self.num_experts_per_token
        return (self.weight_bytes
                - self.num_moe_layers * idle * self.expert_params * self.linear_weight_bytes)

    @property
    def kv_element_bytes(self) -> int:
        """Bytes of one element of the KV cache."""
        return self.dtype_bytes if self.kv_dtype == "auto" else 1  # every other type is fp8

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token (MLA: the cached latent and RoPE key)."""
        if self.is_mla:
            return (self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim)
                    * self.kv_element_bytes)
        return 2 * self.num_layers * self.kv_size * self.kv_element_bytes

    @property
    def decode_attn_flops_per_pair_per_layer(self) -> int:
        """FLOPs of one query-key pair in one layer of decode attention. MLA decodes in the
        latent space, as vLLM's MLA backends do (`W_UK` absorbed into the query, `W_UV` into
        the output): QK^T over the latent and RoPE key, PV over the latent, every query head.
        Otherwise as prefill."""
        if self.is_mla:
            return (2 * self.num_heads * (self.kv_lora_rank + self.qk_rope_head_dim)
                    + 2 * self.num_heads * self.kv_lora_rank)
        return self.attn_flops_per_pair_per_layer

    @property
    def attn_flops_per_pair_per_layer(self) -> int:
        """FLOPs of one query-key pair in one layer: QK^T and PV over every query head."""
        if self.is_mla:
            qk_dim, v_dim = self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        else:
            qk_dim = v_dim = self.head_dim
        return 2 * self.num_heads * qk_dim + 2 * self.num_heads * v_dim
