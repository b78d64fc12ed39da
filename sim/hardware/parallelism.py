"""How one replica is split over GPUs: tensor, pipeline and expert parallelism.

A replica spans `tensor * pipeline` GPUs. Tensor parallelism (Megatron style, as vLLM shards a
decoder) splits every layer's heads and MLP width over `tensor` GPUs and all-reduces the
activations twice per layer; pipeline parallelism gives each of `pipeline` stages a contiguous
run of layers and hands the activations on between stages; expert parallelism places whole
routed experts of an MoE layer on `expert` of the tensor-parallel GPUs instead of slicing every
expert (vLLM's `enable_expert_parallel` inside the tensor-parallel group).

Data parallelism (`data`, vLLM's `--data-parallel-size`, on one node or filling several)
makes a replica of `data` engine cores (ranks), each with its own scheduler and KV cache on
`tensor` GPUs. For an MoE model the ranks step in lockstep, each MoE layer exchanging tokens
between the ranks (`sim.engine.data_parallel`; how, by `latency.all2all_backend`:
`sim.latency.all_to_all`). With `expert = data * tensor` (`--enable-expert-parallel`) whole
experts are spread over all the replica's GPUs; with `expert: 1`, vLLM's default, every GPU
holds a 1/(data * tensor) slice of every expert (`FusedMoEParallelConfig` flattens the tensor
group across the ranks). Attention, dense and shared-expert layers are split over a rank's own
`tensor` GPUs either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from sim.config.errors import INPUT_MODEL

if TYPE_CHECKING:
    from sim.hardware.models import ModelShape

MAX_GPUS_PER_REPLICA = 1024
GPUS_PER_NODE = 8  # an NVLink domain (HGX/DGX); larger groups would cross slower links
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py)


class Parallelism(BaseModel):
    """`parallelism: {tensor: T, pipeline: P, expert: E}` of a replica."""

    model_config = INPUT_MODEL

    tensor: int = Field(1, ge=1, le=MAX_GPUS_PER_REPLICA,
                        description="GPUs splitting each layer (heads, MLP width)")
    pipeline: int = Field(1, ge=1, le=MAX_GPUS_PER_REPLICA,
                          description="stages, each a contiguous run of layers")
    expert: int = Field(1, ge=1, le=MAX_GPUS_PER_REPLICA,
                        description="GPUs holding whole routed experts (vLLM's "
                                    "--enable-expert-parallel): of the tensor group, or with "
                                    "data > 1 all data x tensor GPUs; 1: every expert sliced "
                                    "over the tensor group (with data > 1, over every rank's "
                                    "GPUs)")
    data: int = Field(1, ge=1, le=MAX_GPUS_PER_REPLICA,
                      description="data-parallel ranks (engine cores), each on `tensor` GPUs "
                                  "with its own scheduler and KV cache (vLLM's "
                                  "--data-parallel-size; across nodes of 8 GPUs where data x "
                                  "tensor is a multiple of 8; MoE models only)")

    @property
    def num_gpus(self) -> int:
        """GPUs one replica occupies (every data-parallel rank's)."""
        return self.tensor * self.pipeline * self.data

    @property
    def num_gpus_per_rank(self) -> int:
        """GPUs of one data-parallel rank (the whole replica without data parallelism)."""
        return self.tensor * self.pipeline

    @property
    def expert_ways(self) -> int:
        """Slices of each routed expert: `tensor / expert` GPUs share one, or 1 where whole
        experts sit on each GPU (expert parallelism over the data-parallel ranks), or every GPU
        of every rank (data-parallel ranks without expert parallelism)."""
        if self.data > 1 and self.expert == 1:
            return self.data * self.tensor
        return max(1, self.tensor // self.expert)

    @property
    def num_cross_node_handoffs(self) -> int:
        """Of the `pipeline - 1` hand-offs between stages, those between two nodes of
        `GPUS_PER_NODE`: stages fill nodes in order, `tensor` GPUs each (TP8 x PP2 spans two
        nodes, one hand-off between them; TP4 x PP2 stays in one)."""
        t = self.tensor
        return sum((k * t) // GPUS_PER_NODE != ((k + 1) * t) // GPUS_PER_NODE
                   for k in range(self.pipeline - 1))

    def problems(self, model: ModelShape) -> list[tuple[str, int, str]]:
        """What does not divide: (field, value, why) for each, empty if the split is valid.
        The rules are vLLM's: heads divide evenly over the tensor group (KV heads may be
        replicated when there are fewer of them than GPUs), every stage gets a layer."""
        found = []
        t, p, e = self.tensor, self.pipeline, self.expert
        if model.num_heads % t:
            found.append(("tensor", t, f"{model.name} has {model.num_heads} attention heads, "
                                       "not divisible by it"))
        kv = model.num_kv_heads
        if not found and (t <= kv and kv % t or t > kv and t % kv):  # else the heads' says it
            found.append(("tensor", t, f"{model.name}'s {kv} KV heads neither divide over it "
                                       "nor replicate evenly"))
        if t > GPUS_PER_NODE:
            found.append(("tensor", t, f"a tensor-parallel group spans one node's NVLink "
                                       f"domain here (at most {GPUS_PER_NODE} GPUs); add "
                                       "pipeline stages across nodes instead"))
        sliced_over_ranks = self.data > 1 and e == 1
        for what, size, ways in [] if found else _uneven_widths(model, t, self.expert_ways):
            if what == "moe_intermediate_size" and sliced_over_ranks:
                found.append(("data", self.data, f"{model.name}'s {what} ({size}) does not "
                              f"split evenly over data x tensor ({ways}) GPUs (each expert "
                              "sliced over every rank's; or expert: data x tensor)"))
            else:
                found.append(("tensor", t, f"{model.name}'s {what} ({size}) does not split "
                                           f"evenly over {ways} GPUs"))
        if p > model.num_layers:
            found.append(("pipeline", p, f"more stages than {model.name}'s "
                                         f"{model.num_layers} layers"))
        d = self.data
        if d > 1 and not model.num_experts:
            pass  # (said of `data` below)
        elif e > 1 and not model.num_experts:
            found.append(("expert", e, f"{model.name} is dense: it has no experts to place"))
        elif d > 1 and e not in (1, d * t):
            found.append(("expert", e, f"with data {d}: data x tensor ({d * t}), experts "
                                       "spread over every rank's GPUs (vLLM's "
                                       "--enable-expert-parallel), or 1, each expert sliced "
                                       "over them (vLLM's default)"))
        elif e > 1 and ((t % e and d == 1) or model.num_experts % e):
            within = f"tensor ({t}) and " if d == 1 else ""
            found.append(("expert", e, f"must divide {within}{model.name}'s "
                                       f"{model.num_experts} experts"))
        if d > 1 and not model.num_experts:
            found.append(("data", d, f"{model.name} is dense: vLLM runs a dense model's "
                                     "data-parallel ranks as independent engines (SGLang "
                                     "its --dp without DP attention); give cluster.replicas "
                                     "with router vllm_dp (or sglang_dp) instead"))
        elif d > 1 and self.pipeline > 1:
            found.append(("data", d, "data-parallel ranks without pipeline stages are "
                                     f"modelled; {d} x tensor {t} x pipeline "
                                     f"{self.pipeline} is not"))
        elif d * t > GPUS_PER_NODE and d * t % GPUS_PER_NODE:
            found.append(("data", d, f"data-parallel ranks across nodes fill nodes of "
                                     f"{GPUS_PER_NODE} GPUs: data x tensor ({d * t}) must be "
                                     f"a multiple of {GPUS_PER_NODE}"))
        elif d * t > MAX_GPUS_PER_REPLICA:
            found.append(("data", d, f"data x tensor ({d * t}) is more than "
                                     f"{MAX_GPUS_PER_REPLICA} GPUs"))
        return found

    def kv_heads_per_gpu(self, model: ModelShape) -> int:
        """KV heads each GPU of the tensor group stores (replicated if fewer than GPUs)."""
        return max(1, model.num_kv_heads // self.tensor)

    def kv_bytes_per_layer_token_per_gpu(self, model: ModelShape) -> float:
        """KV bytes one token takes in one layer on each GPU of the tensor group: its share of
        the KV heads (an MLA latent is not split by heads: every GPU keeps all of it)."""
        per_layer = model.kv_bytes_per_token / model.num_layers
        if model.is_mla:
            return per_layer
        return per_layer * self.kv_heads_per_gpu(model) / model.num_kv_heads

    def kv_bytes_per_token_per_gpu(self, model: ModelShape) -> float:
        """KV bytes one token takes on the busiest GPU (its stage's layers), which bounds the
        replica's KV capacity."""
        return (self.kv_bytes_per_layer_token_per_gpu(model)
                * -(-model.num_layers // self.pipeline))

    def stage_layers(self, num_layers: int) -> list[range]:
        """The layers of each pipeline stage, as vLLM assigns them (`get_pp_indices`): an
        even share each, the remainder one apiece to the stages before the last (which also
        holds the LM head), counting back from it."""
        base, extra = divmod(num_layers, self.pipeline)
        sizes = [base] * self.pipeline
        for i in range(2, extra + 2):
            sizes[-i] += 1
        starts = [sum(sizes[:i]) for i in range(self.pipeline)]
        return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]

    def vocab_rows_per_gpu(self, model: ModelShape, ranks: int = 1) -> int:
        """Rows of the embedding table and of the LM head on each GPU of the tensor group
        (of `ranks` data-parallel ranks' GPUs together: SGLang's LM head under DP attention):
        vLLM pads the vocabulary to a multiple of 64 and splits it evenly
        (`VocabParallelEmbedding`, `ParallelLMHead`)."""
        padded = -(-model.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
        return -(-padded // (self.tensor * ranks))

    def weight_bytes_per_gpu(self, model: ModelShape, lm_head_ranks: int = 1) -> int:
        """Weight bytes on the busiest GPU (the largest pipeline stage's), as vLLM shards
        them: sliced weights divided by `tensor`; K/V projections of at least one KV head per
        GPU (replicated when there are fewer KV heads than GPUs); replicated norms, MoE routers
        and MLA's down-projections (`q_a_proj`, `kv_a_proj_with_mqa`, `ReplicatedLinear`); the
        embedding table on the first stage, the LM head (and, tied, a copy of the table) on the
        last (split over `lm_head_ranks` ranks' GPUs: `ReplicaConfig.lm_head_ranks`). One
        GPU: `model.weight_bytes` where the vocabulary is a multiple of 64 (every committed
        model's)."""
        moe = set(model.moe_layer_indices)
        layer = {False: self._layer_bytes(model, moe=False),
                 True: self._layer_bytes(model, moe=True) if moe else 0}
        b = model.dtype_bytes  # the embedding table, the LM head and norms are never quantized
        table = self.vocab_rows_per_gpu(model) * model.hidden_size * b
        stages = self.stage_layers(model.num_layers)
        busiest = 0
        for index, layers in enumerate(stages):
            num_bytes = sum(layer[i in moe] for i in layers)
            if index == 0:
                num_bytes += table
            if index == len(stages) - 1:
                num_bytes += model.hidden_size * b  # the final norm
                if not (model.tie_embeddings and len(stages) == 1):
                    # the LM head (tied on one stage: the table itself)
                    num_bytes += (self.vocab_rows_per_gpu(model, lm_head_ranks)
                                  * model.hidden_size * b)
            busiest = max(busiest, num_bytes)
        return busiest

    def dense_layer_bytes_per_gpu(self, model: ModelShape) -> int:
        """One decoder layer with a dense MLP, as one GPU of the tensor group holds it: an
        EAGLE or MTP drafter's layer beside the target's."""
        return self._layer_bytes(model, moe=False)

    def _layer_bytes(self, model: ModelShape, moe: bool) -> int:
        """One layer's weight bytes on one GPU of the tensor group: norms and MoE router in
        the model's dtype, the linear layers in theirs (`quantization`)."""
        t, e, h = self.tensor, self.expert, model.hidden_size
        kept = 2 * h + (model.kv_lora_rank + (model.q_lora_rank or 0) if model.is_mla else 0)
        if moe:
            # Under expert parallelism E/e whole experts per GPU, each split t/e ways (whole
            # where e spans the data-parallel ranks' GPUs too).
            width = model.moe_intermediate_size // self.expert_ways
            kept += model.router_params_per_layer
            mlp = (model.num_experts // e * 3 * h * width
                   + 3 * h * (model.shared_expert_intermediate_size // t))
        else:
            mlp = 3 * h * (model.intermediate_size // t)
        attention = sum(k * n for k, n in self.attention_projections(model))
        return kept * model.dtype_bytes + (attention + mlp) * model.linear_weight_bytes

    def attention_projections(self, model: ModelShape) -> list[tuple[int, int]]:
        """(in, out) widths of one layer's attention projections on one GPU of the tensor
        group, in the order they run: GQA's fused QKV (KV heads replicated where fewer than
        GPUs) and output; MLA's q_a/q_b pair (or q_proj), kv_a_proj_with_mqa, kv_b_proj and
        o_proj, the down-projections (q_a, kv_a) replicated on every GPU and the rest split by
        heads, as vLLM does. What the weights count and what the roofline times."""
        t, h = self.tensor, model.hidden_size
        if model.is_mla:
            heads = model.num_heads // t
            qk = heads * (model.qk_nope_head_dim + model.qk_rope_head_dim)
            r = model.q_lora_rank
            query = [(h, r), (r, qk)] if r else [(h, qk)]
            return [*query, (h, model.kv_lora_rank + model.qk_rope_head_dim),
                    (model.kv_lora_rank, heads * (model.qk_nope_head_dim + model.v_head_dim)),
                    (heads * model.v_head_dim, h)]
        q = model.num_heads // t * model.head_dim
        kv = self.kv_heads_per_gpu(model) * model.head_dim
        return [(h, q + 2 * kv), (q, h)]

    def logits_bytes_per_row(self, model: ModelShape) -> int:
        """Bytes of one sampled row's logits gathered over the tensor group: every GPU's slice
        of the padded vocabulary."""
        return self.vocab_rows_per_gpu(model) * self.tensor * model.dtype_bytes


def _uneven_widths(model: ModelShape, t: int, expert_ways: int) -> list[tuple[str, int, int]]:
    """The widths tensor parallelism slices that leave a remainder, each with its slices (vLLM
    refuses those; the vocabulary it pads instead). Each routed expert is cut `expert_ways`
    ways (`Parallelism.expert_ways`; an `expert` not dividing `tensor` is reported on its
    own)."""
    widths = [("intermediate_size", model.intermediate_size, t)] if model.num_dense_layers else []
    if model.num_experts:
        widths.append(("moe_intermediate_size", model.moe_intermediate_size, expert_ways))
        # Shared experts are a dense MLP sliced over the rank's tensor group, whatever `expert`.
        widths.append(("shared_expert_intermediate_size",
                       model.shared_expert_intermediate_size, t))
    return [(what, size, ways) for what, size, ways in widths if size % ways]


SINGLE_GPU = Parallelism()
