"""Roofline estimate of one iteration on one replica, per GPU of a tensor/pipeline-parallel split.

Parts, timed separately because different kernels run them:

- the linear layers: every GEMM of a layer (QKV and output projections, the MLP or the MoE
  layer's router, routed and shared experts) and the LM head on the sampled rows, each at its
  per-GPU shard shape. `linear: calibrated` (default) times a GEMM with `sim.latency.gemm`'s
  model fitted to public H100/A100 GEMM measurements; `linear: naive` takes the longer of its
  FLOPs at `mfu` of peak and its weight bytes at `mbu` of the bandwidth (the datasheet roofline;
  its single-GPU predictions are exactly those of servesim before parallelism existed).
  With fp8 weights (the replica's `quantization: fp8`, seen here as the model's
  `linear_dtype_bytes`), every GEMM but the LM head's and the MoE router's reads one-byte
  weights and, on a GPU with fp8 math, runs at its fp8 peak (`GemmModel.fp8`).
- the elementwise kernels, with `elementwise: calibrated` (default; `sim.latency.elementwise`):
  each layer's RMSNorms, rotary embedding, activation and residual add, and the embedding
  lookup, fitted to the same public measurements (3-39% of a layer's measured
  token-proportional time, 10-13% at the median). `none` leaves them out, as servesim did
  before.
- MoE layers: under uniform routing a batch of m tokens reaches E(1 - (1 - k/E)^m) of E
  experts in expectation (k per token); only their weights are read, each with m*k/that many
  tokens. `expert_imbalance` (>= 1) stretches the routed experts' time: the busiest expert
  (or GPU, under expert parallelism) sets the pace.
- attention: prefill FLOPs from query-key pairs, decode bytes of KV read (one byte per element
  with `kv_cache.dtype: fp8`) at `attention_mbu` (else `mbu`) of the bandwidth, per GPU
  (heads split over the tensor group; KV heads replicated where fewer than GPUs), and
  `attention_layer_s` per layer whatever it reads.
- communication (`sim.latency.comm`: measured NCCL tables or bandwidth): under tensor
  parallelism two all-reduces of the activations per layer, one more after the embedding
  (vLLM's `VocabParallelEmbedding` looks each token up in its vocabulary slice, zeros
  elsewhere, and all-reduces), and a gather of the sampled rows' logits (`ParallelLMHead` gives
  each GPU a vocabulary slice; `LogitsProcessor` gathers them, to one GPU or to all: the same
  bytes arrive); a hand-off between pipeline stages.
- a fixed per-iteration overhead (scheduling, launches, sampling).

Under pipeline parallelism a prediction is one iteration's whole pass: every stage in turn
plus P-1 hand-offs. The engine keeps up to P iterations in flight and holds each stage for
the pass times its share of the layers (`sim.engine.pipeline`), so iterations overlap as in vLLM v1.

Terms that depend only on the number of tokens (GEMMs, elementwise kernels, communication) are
tabulated
once per token count, so a prediction is a lookup and a few multiply-adds, the same on a scalar
as on each entry of an array.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from sim.config.errors import INPUT_MODEL, InputError
from sim.hardware.gpus import GPUSpec
from sim.hardware.models import ModelShape
from sim.hardware.parallelism import GPUS_PER_NODE, SINGLE_GPU, Parallelism
from sim.latency.all_to_all import DEEPEP_BACKENDS, All2AllBackend, ExpertExchange
from sim.latency.base import (
    LATENCY_MODELS,
    BatchShape,
    LatencyConfig,
    LatencyModel,
    Num,
    TokenTable,
    maximum,
)
from sim.latency.comm import BandwidthCollectives, Collectives, CustomAllReduce
from sim.latency.elementwise import ElementwiseModel


class RooflineConfig(LatencyConfig):
    model_config = INPUT_MODEL  # finite numbers only

    linear: Literal["calibrated", "naive"] = Field(
        "calibrated", description="GEMM times: fitted to measurements, or datasheet max()")
    elementwise: Literal["none", "calibrated"] = Field(
        "calibrated", description="norms, rotary, activation, residual add, embedding: fitted "
                                  "to measurements, or left out")
    mfu: float = Field(0.6, gt=0, le=1, description="fraction of peak FLOP/s reached by "
                                                   "attention (and GEMMs when naive)")
    mbu: float = Field(0.8, gt=0, le=1, description="fraction of peak bandwidth reached "
                                                   "(by attention, and GEMMs when naive)")
    attention_mbu: float | None = Field(
        None, gt=0, le=1, description="fraction of peak bandwidth attention reads KV at; "
                                      "None: mbu")
    attention_layer_s: float = Field(
        0.0, ge=0, le=0.01, description="attention's fixed time per layer and iteration, "
        "whatever the KV it reads (a kernel's launch and its smallest grid)")
    overhead_s: float = Field(
        0.002, ge=0, le=1, description="host time per iteration (< 1 s); an engine that "
        "overlaps it with the GPU (vLLM's async scheduling, SGLang's overlap loop) takes the "
        "larger of it and the GPU's time")
    expert_imbalance: float = Field(
        1.0, ge=1, le=1000, description="busiest expert's load over the mean (MoE)")
    all_reduce_table: Path | None = Field(
        None, strict=False, description="measured all-reduce CSV (Vidur layout); None: from "
                                        "the GPU's interconnect bandwidth")
    send_recv_table: Path | None = Field(
        None, strict=False, description="measured send/recv CSV for pipeline hand-offs")
    all_reduce_kernel: Literal["custom", "nccl"] = Field(
        "custom", description="custom: vLLM's and SGLang's own all-reduce kernel for the "
                              "messages it takes (below 8 MiB, 2/4/6/8 GPUs on NVLink), NCCL "
                              "for the rest; nccl: NCCL for every message")
    interconnect_efficiency: float = Field(
        0.75, gt=0, le=1, description="fraction of link bandwidth collectives reach")
    all_reduce_latency_s: float = Field(25e-6, ge=0, le=1, description="start-up per all-reduce")
    send_recv_latency_s: float = Field(8e-6, ge=0, le=1, description="start-up per hand-off")
    network_latency_s: float = Field(17e-6, ge=0, le=1,
                                     description="start-up per hand-off between nodes")
    all2all_backend: All2AllBackend = Field(
        "allgather_reducescatter", description=(
            "vLLM's --all2all-backend for the MoE exchange between data-parallel ranks "
            "with experts spread over them: allgather_reducescatter (vLLM's default), "
            "deepep_high_throughput or deepep_low_latency (DeepEP's kernels, timed from "
            "their published benchmarks); with scheduler sglang also deepep_auto (SGLang's "
            "--deepep-mode auto: normal kernels for steps where a rank extends, "
            "low-latency ones for decode-only steps)"))


# How far the roofline is from real runs (docs/fidelity.md), said in every run's summary; the
# engine calibration (`latency_model.calibration`) states its own.
ROOFLINE_ERROR = (
    "its own defaults (replica.engine: none) vs vLLM 0.15.1 serving on H100-SXM (TP1/2/4, "
    "async scheduling; validation/public): median |error| TPOT 3.6%, E2E 3.8%, TTFT 19% short "
    "(no API front end); with the default calibration vs public batch benchmarks (vLLM 0.5, "
    "TensorRT-LLM): 0.78-1.16x; other GPUs: GEMMs extrapolated (docs/fidelity.md)")


@LATENCY_MODELS.register("roofline")
class RooflineLatency(LatencyModel):
    Config = RooflineConfig

    def __init__(self, config: RooflineConfig, model: ModelShape, gpu: GPUSpec,
                 parallelism: Parallelism = SINGLE_GPU) -> None:
        self.tables = _tables(config, model, gpu, parallelism)
        flops_s = gpu.peak_bf16_flops * config.mfu
        bytes_s = gpu.memory_bandwidth_bytes_s * (config.attention_mbu or config.mbu)
        m, t = model, parallelism.tensor
        self.overhead_s = config.overhead_s
        # Each GPU runs every layer's attention once per iteration (a pipeline: its stages).
        self.attn_fixed_s = config.attention_layer_s * m.num_layers
        # Seconds per unit of each feature, precomputed so a prediction is a few multiply-adds.
        self.attn_pair_s = m.num_layers * m.attn_flops_per_pair_per_layer / t / flops_s
        # An iteration runs every stage in turn: KV of all layers, each GPU its share of heads.
        # One GPU keeps the whole-model expression, so its predictions stay bit-for-bit those
        # of servesim before parallelism (per layer times layers rounds differently).
        self.kv_token_s = (parallelism.kv_bytes_per_layer_token_per_gpu(m) * m.num_layers
                           / bytes_s if t > 1 or parallelism.pipeline > 1
                           else m.kv_bytes_per_token / bytes_s)
        # Decode attention reads each KV token once for one query: the larger of its compute
        # and memory times per token. max(a, b) * x is max(a * x, b * x) to the last bit for
        # x >= 0 (rounding keeps the order of products), at one operation on arrays.
        decode_pair_s = (m.num_layers * m.decode_attn_flops_per_pair_per_layer / t / flops_s
                         if m.is_mla else self.attn_pair_s)
        self.decode_kv_token_s = max(decode_pair_s, self.kv_token_s)

    def split_lm_head(self, ranks: int, all_to_all: bool = False) -> None:
        """Data-parallel ranks whose GPUs split the LM head between them
        (`ReplicaConfig.lm_head_ranks`): each GPU computes its slice of the vocabulary for
        every rank's sampled rows, gathered to it, and the logits are gathered back (with
        `all_to_all`, where the ranks' row counts are equal, each rank gets only its own rows:
        SGLang's LM-head all-to-all on a decode pool of one GPU a rank)."""
        self.lm_head_ranks = ranks
        self.lm_head_all_to_all = all_to_all

    lm_head_ranks = 1  # (each rank's own LM head)
    lm_head_all_to_all = False

    def iteration_time_s(self, shape: BatchShape) -> Num:
        if self.tables.moe_s is not None or self.lm_head_ranks > 1:
            # One data-parallel rank, as if every rank ran the same batch (the engine times
            # the ranks' steps together: `lockstep_time_s`).
            m = shape.num_tokens
            ranks = self.tables.parallelism.data
            total = ranks * m
            time = self._rank_s(shape, m, own_lm_head=self.lm_head_ranks == 1)
            if self.lm_head_ranks > 1:
                sampled = shape.num_sampled_tokens
                time = time + self._lm_head_s(ranks * np.asarray(sampled), sampled)
            if self.tables.moe_s is None:
                return time
            return (time + self.tables.moe_s(total)
                    + self.tables.model.num_moe_layers * self.tables.exchange_s(
                        total, m, shape.num_prefill_tokens > 0))
        return self._rank_s(shape, shape.num_tokens)

    def _lm_head_s(self, total: Num, most: Num, alike: bool = True) -> Num:
        """The LM head split over `lm_head_ranks` ranks' GPUs for `total` sampled rows of all
        ranks, `most` on the busiest: their hidden states gathered over the ranks, each GPU's
        vocabulary slice for all of them, the logits gathered back to every GPU (or each
        rank's own rows, all-to-all, where the ranks ran `alike` counts)."""
        tables = self.tables
        model, par = tables.model, tables.parallelism
        num_gpus = par.tensor * self.lm_head_ranks
        rows = par.vocab_rows_per_gpu(model, self.lm_head_ranks)
        bandwidth = tables.between_ranks
        total = np.asarray(total, dtype=np.float64)
        row_bytes = rows * num_gpus * model.dtype_bytes  # a row's logits, every slice
        logits_s = (bandwidth.all_gather_s(np.asarray(most) * row_bytes, num_gpus)
                    if self.lm_head_all_to_all and alike
                    else bandwidth.all_gather_s(total * row_bytes, num_gpus))
        time = (tables.gemm_kept(total, model.hidden_size, rows)
                + bandwidth.all_gather_s(total * model.hidden_size * model.dtype_bytes,
                                         self.lm_head_ranks)
                + logits_s)
        return time if isinstance(time, np.ndarray) and time.ndim else float(time)

    def host_time_s(self, shape: BatchShape) -> Num:
        return self.overhead_s

    def _rank_s(self, shape: BatchShape, num_tokens: Num, own_lm_head: bool = True) -> Num:
        """The step of `shape` with its token-count terms at `num_tokens` (its own, or a
        data-parallel rank's padded to the most of any rank's): all of it, but for
        data-parallel ranks the MoE layers, which `_Tables.tokens_s` then leaves out (timed on
        every rank's tokens), and an LM head split over the ranks (`own_lm_head` False:
        `_lm_head_s`)."""
        prefill_attn = maximum(
            self.attn_pair_s * shape.prefill_attn_pairs, self.kv_token_s * shape.prefill_kv_tokens
        )
        time = (self.overhead_s + self.tables.tokens_s(num_tokens) + prefill_attn
                + self.decode_kv_token_s * shape.decode_kv_tokens)
        if own_lm_head:
            time = time + self.tables.sampled_s(shape.num_sampled_tokens)
        if self.attn_fixed_s:  # 0 by default: predictions stay bit-for-bit as before
            time = time + self.attn_fixed_s * (num_tokens > 0)
        if self.tables.context_s is not None:  # MLA: the chunks' cached context, up-projected
            time = time + self.tables.context_s(shape.prefill_kv_tokens - shape.num_prefill_tokens)
        return time

    def lockstep_time_s(self, shapes: Sequence[BatchShape], num_tokens: Sequence[int]
                        ) -> tuple[float, float]:
        """The slowest rank's own part, then each MoE layer on every rank's tokens gathered:
        the local experts' GEMMs and the all-gather and reduce-scatter around them
        (`_Tables.all_to_all_s`), which no rank passes alone."""
        tables = self.tables
        own = self.lm_head_ranks == 1
        if tables.moe_s is None and own:  # (no MoE layer, no LM head spans the ranks)
            return super().lockstep_time_s(shapes, num_tokens)
        if tables.moe_s is None:  # (each rank at its own tokens, as without the split)
            num_tokens = [shape.num_tokens for shape in shapes]
        step_s = max(float(self._rank_s(shape, n, own)) for shape, n in zip(shapes, num_tokens,
                                                                             strict=True))
        if not own:
            sampled = [int(shape.num_sampled_tokens) for shape in shapes]
            step_s += float(self._lm_head_s(sum(sampled), max(sampled),
                                            alike=len(set(num_tokens)) == 1))
        if tables.moe_s is None:
            return step_s, 0.0
        total = sum(num_tokens)
        # (SGLang's ranks gather whether any extends: every rank then takes the same kernels.)
        extends = any(shape.num_prefill_tokens > 0 for shape in shapes)
        all_to_all_s = float(tables.exchange_s(total, max(num_tokens), extends))
        step_s = (step_s + float(tables.moe_s(total))
                  + self.tables.model.num_moe_layers * all_to_all_s)
        return step_s, all_to_all_s

    def describe(self) -> dict[str, Any]:
        """How GEMMs and communication are timed (e.g. a GEMM curve extrapolated from the
        H100's to another GPU)."""
        tables = self.tables
        facts: dict[str, Any] = {"linear": tables.config.linear, **tables.gemm.describe(),
                                 "elementwise": tables.config.elementwise,
                                 "host_s": self.overhead_s, "error": ROOFLINE_ERROR}
        if tables.elementwise is not None:
            facts.update(tables.elementwise.describe())
        if tables.quantized:
            facts["quantization"] = ("fp8 linear layers, W8A8 at the GPU's fp8 peak"
                                     if tables.gpu.peak_fp8_flops is not None else
                                     "fp8 linear layers, W8A16 (no fp8 math on this GPU)")
        if tables.parallelism.num_gpus > 1:
            facts["parallelism"] = tables.parallelism.model_dump()
            facts["communication"] = {
                "all_reduce": ("custom kernel below its buffer, then " if tables.comm.custom
                               is not None else "")
                + ("measured table" if tables.comm.all_reduce_table is not None
                   else "link bandwidth"),
                "logits_gather": "link bandwidth",
                "send_recv": "measured table" if tables.comm.send_recv_table is not None
                else "link bandwidth"}
            if tables.exchange is not None:
                facts["communication"]["all_to_all"] = tables.exchange.describe()
                if tables.decode_exchange is not None:
                    facts["communication"]["all_to_all"] = (
                        "SGLang's DeepEP auto mode: steps where a rank extends, "
                        + tables.exchange.describe() + "; decode-only steps, "
                        + tables.decode_exchange.describe())
            elif tables.moe_s is not None:
                facts["communication"]["all_to_all"] = (
                    "all-gather and reduce-scatter between data-parallel ranks per MoE layer "
                    "(vLLM's allgather_reducescatter), "
                    + ("network bandwidth between nodes" if tables.spans_nodes
                       else "link bandwidth"))
        return facts


class _Tables:
    """The token-count terms of one (config, model, GPU, split): linear layers, MoE and
    communication by tokens in the batch; the LM head by rows sampled."""

    def __init__(self, config: RooflineConfig, model: ModelShape, gpu: GPUSpec,
                 parallelism: Parallelism) -> None:
        self.config, self.model, self.gpu, self.parallelism = config, model, gpu, parallelism
        # fp8 linear layers (`quantization: fp8`); the LM head and MoE routers keep the
        # model's dtype, as vLLM's fp8 method leaves them.
        self.quantized = model.linear_weight_bytes != model.dtype_bytes
        self.gemm = _Gemm(config, gpu, fp8=self.quantized)
        self.gemm_kept = _Gemm(config, gpu) if self.quantized else self.gemm
        self.elementwise = (ElementwiseModel.for_gpu(gpu) if config.elementwise == "calibrated"
                            else None)
        self.comm = _collectives(config, gpu, parallelism)
        self.tokens_s = TokenTable(self._tokens_s)
        self.sampled_s = TokenTable(self._sampled_s)
        # MLA caches latents: a prefill chunk after cached tokens first expands theirs into
        # per-head keys and values (kv_b_proj on the context, vLLM's
        # `_compute_prefill_context`), by tokens of context; other layouts read K and V as
        # cached.
        self.context_s = TokenTable(self._mla_context_s) if model.is_mla else None
        # Data-parallel ranks of an MoE model: each MoE layer's routed experts (timed by the
        # tokens of every rank, gathered) apart from each rank's own terms (its router and
        # shared experts among them, on its own tokens).
        self.moe_s: TokenTable | None = None
        self.all_to_all_s: TokenTable = TokenTable(lambda m: np.zeros_like(m))
        self.exchange: ExpertExchange | None = None
        # SGLang's DeepEP auto mode: `exchange` (normal kernels) for steps where a rank
        # extends, this (low-latency) for the rest.
        self.decode_exchange: ExpertExchange | None = None
        self.spans_nodes = parallelism.data * parallelism.tensor > GPUS_PER_NODE
        if self.spans_nodes and gpu.network_bandwidth_bytes_s is None:
            raise InputError("<scenario>", "gpu.network_bandwidth_bytes_s", None, (
                f"data-parallel ranks on {parallelism.data * parallelism.tensor} GPUs span "
                f"nodes of {GPUS_PER_NODE}, and this GPU has no network bandwidth to time "
                "their exchange: give gpu.network_bandwidth_bytes_s"))
        if parallelism.data > 1 and model.num_moe_layers:
            self.moe_s = TokenTable(lambda m: model.num_moe_layers * self._routed_s(m))
            self.all_to_all_s = TokenTable(self._all_to_all_s)
            backend = config.all2all_backend
            if backend in DEEPEP_BACKENDS:  # (experts spread: checked)
                def exchange(kind: str) -> ExpertExchange:
                    return ExpertExchange(
                        kind, num_experts=model.num_experts,
                        experts_per_token=model.num_experts_per_token,
                        hidden_size=model.hidden_size, dtype_bytes=model.dtype_bytes,
                        # (vLLM's DeepEP paths quantize first for block-fp8 weights only)
                        fp8_dispatch=self.quantized and model.fp8_block_scales,
                        num_ranks=parallelism.data,
                        tensor=parallelism.tensor,
                        nvlink_bytes_s=gpu.interconnect_bandwidth_bytes_s,
                        network_bytes_s=gpu.network_bandwidth_bytes_s,
                        imbalance=config.expert_imbalance, groups=model.num_expert_groups,
                        groups_per_token=model.expert_groups_per_token)

                if backend == "deepep_auto":
                    self.exchange = exchange("deepep_high_throughput")
                    self.decode_exchange = exchange("deepep_low_latency")
                else:
                    self.exchange = exchange(backend)

    @property
    def between_ranks(self) -> BandwidthCollectives:
        """The links collectives between data-parallel ranks take: between nodes the rings run
        through the NICs (one per GPU), the slower links."""
        bandwidth = self.comm.network if self.spans_nodes else self.comm.bandwidth
        assert bandwidth is not None, "checked when built"
        return bandwidth

    def exchange_s(self, total: Num, most: Num, extends: Num = True) -> Num:
        """Seconds of one MoE layer's exchange between the data-parallel ranks for `total`
        tokens over all ranks, `most` on the busiest, in steps where a rank `extends` (a
        prompt's tokens; SGLang's auto mode picks its kernels by it) or not
        (`sim.latency.all_to_all`)."""
        if self.decode_exchange is not None:
            assert self.exchange is not None
            if not isinstance(extends, np.ndarray) and not isinstance(most, np.ndarray):
                return (self.exchange if extends else self.decode_exchange).layer_s(total, most)
            return np.where(extends, self.exchange.layer_s(total, most),
                            self.decode_exchange.layer_s(total, most))
        if self.exchange is not None:
            return self.exchange.layer_s(total, most)
        return self.all_to_all_s(total)

    def _tokens_s(self, m: np.ndarray) -> np.ndarray:
        time = self._linear_s(m)
        if self.elementwise is not None:
            time = time + self.elementwise.iteration_s(m, self.model, self.parallelism)
        return time

    def _linear_s(self, m: np.ndarray) -> np.ndarray:
        model, par, gemm = self.model, self.parallelism, self.gemm
        if (self.config.linear == "naive" and par.num_gpus == 1 and not model.num_experts
                and not self.quantized):
            return _naive_single_gpu(self.config, model, self.gpu, m)
        t, h = par.tensor, model.hidden_size
        time = model.num_layers * self._attention_gemms_s(m)
        if model.num_dense_layers:
            i = model.intermediate_size // t
            time = time + model.num_dense_layers * (gemm(m, h, 2 * i) + gemm(m, i, h))
        if model.num_moe_layers and par.data == 1:
            time = time + model.num_moe_layers * self._moe_s(m)
        elif model.num_moe_layers:  # (the routed experts on every rank's tokens: `moe_s`)
            time = time + model.num_moe_layers * self._moe_local_s(m)
        if t > 1:
            act_bytes = m * h * model.dtype_bytes
            # Two per layer, and the vocabulary-parallel embedding's.
            time = time + (2 * model.num_layers + 1) * self.comm.all_reduce(act_bytes)
        if par.pipeline > 1:
            # vLLM hands on the hidden states and the residual (`IntermediateTensors` of two
            # tokens x hidden tensors in its Llama-style models); each GPU of the tensor group
            # sends its 1/T slice and the next stage's group all-gathers them
            # (`send_tensor_dict(..., all_gather_group=get_tp_group())`), so T links carry a
            # hand-off between nodes side by side.
            handoff_bytes = 2 * m * h * model.dtype_bytes
            time = time + self.comm.pipeline_handoffs(handoff_bytes / t)
            if t > 1:
                time = time + (par.pipeline - 1) * self.comm.all_gather(handoff_bytes)
        return time

    def _mla_context_s(self, m: np.ndarray) -> np.ndarray:
        model, heads = self.model, self.model.num_heads // self.parallelism.tensor
        return model.num_layers * self.gemm(
            m, model.kv_lora_rank, heads * (model.qk_nope_head_dim + model.v_head_dim))

    def _attention_gemms_s(self, m: np.ndarray) -> np.ndarray:
        # Each projection at its shard shape, as the weights count them (MLA's decode absorbs
        # kv_b_proj into the query and output instead: the same weights, the same FLOPs per
        # token).
        gemm = self.gemm
        return sum((gemm(m, k, n) for k, n in self.parallelism.attention_projections(self.model)),
                   np.zeros_like(m, dtype=np.float64))

    def _moe_s(self, m: np.ndarray) -> np.ndarray:
        """One MoE layer for `m` tokens on one replica's GPUs: router, routed and shared
        experts."""
        time = self.gemm_kept(m, self.model.hidden_size, self.model.num_experts) \
            + self._routed_s(m)
        return self._with_shared_s(time, m)

    def _moe_local_s(self, m: np.ndarray) -> np.ndarray:
        """What a data-parallel rank computes of an MoE layer on its own `m` tokens alone: the
        router (vLLM 0.15.1 gathers its logits, 0.33 its top-k choices) and the shared
        experts, which run before the gather, on the rank's tensor group."""
        return self._with_shared_s(
            self.gemm_kept(m, self.model.hidden_size, self.model.num_experts), m)

    def _routed_s(self, m: np.ndarray) -> np.ndarray:
        """One MoE layer's routed experts for `m` tokens on one GPU: those it holds (`expert`
        of them, whole or sliced `expert_ways` ways), each with its expected share."""
        model, par, gemm, h = self.model, self.parallelism, self.gemm, self.model.hidden_size
        e = par.expert
        num_experts, k = model.num_experts, model.num_experts_per_token
        # Experts reached by m tokens choosing k of num_experts each, uniformly (expected).
        # math.pow entry by entry: libm's, as a scalar would get it, on every CPU (numpy's
        # vectorised pow/expm1 may round differently where SIMD versions exist).
        missed = np.array([math.pow(1 - k / num_experts, x) for x in m.tolist()])
        reached = np.where(m > 0, num_experts * (1 - missed), 0.0)
        per_expert = np.divide(m * k, reached, out=np.zeros_like(m), where=reached > 0)
        width = model.moe_intermediate_size // par.expert_ways  # each expert's slice
        # A fused MoE kernel (vLLM's) runs all experts of a layer in two launches, so the
        # fixed cost of a GEMM is paid twice per layer, not twice per expert.
        launch = gemm.launch_s
        per_expert_s = (gemm(per_expert, h, 2 * width) + gemm(per_expert, width, h)
                        - 2 * launch * (per_expert > 0))
        routed = reached / e * per_expert_s + 2 * launch * (m > 0)
        return self.config.expert_imbalance * routed

    def _with_shared_s(self, time: np.ndarray, m: np.ndarray) -> np.ndarray:
        """`time` plus the shared experts' GEMMs for `m` tokens (a dense MLP over the
        tensor group), if the model has any."""
        if not self.model.shared_expert_intermediate_size:
            return time
        s = self.model.shared_expert_intermediate_size // self.parallelism.tensor
        h = self.model.hidden_size
        return time + self.gemm(m, h, 2 * s) + self.gemm(m, s, h)

    def _all_to_all_s(self, m: np.ndarray) -> np.ndarray:
        """Seconds of one MoE layer's exchange between data-parallel ranks for `m` tokens of
        all ranks, as vLLM's default `allgather_reducescatter` backend does it: each rank's
        hidden states and router logits all-gathered over the ranks, then the local experts'
        partial sums reduce-scattered back (each rank gets its own rows). The router logits
        are what vLLM 0.15-0.19 gathers for a bf16 model (`dispatch_router_logits`); later
        releases gather the top-k ids and weights instead (a few bytes less)."""
        model, ranks = self.model, self.parallelism.data
        hidden_bytes = m * model.hidden_size * model.dtype_bytes
        logits_bytes = m * model.num_experts * model.dtype_bytes
        bandwidth = self.between_ranks
        return (bandwidth.all_gather_s(hidden_bytes + logits_bytes, ranks)
                + bandwidth.all_gather_s(hidden_bytes, ranks))

    def _sampled_s(self, s: np.ndarray) -> np.ndarray:
        model, par = self.model, self.parallelism
        if self.config.linear == "naive" and par.num_gpus == 1:
            return _naive_lm_head(self.config, model, self.gpu, s)
        if par.tensor == 1:
            return self.gemm_kept(s, model.hidden_size, model.vocab_size)
        rows = par.vocab_rows_per_gpu(model)  # the padded vocabulary's slice
        return (self.gemm_kept(s, model.hidden_size, rows)
                + self.comm.all_gather(s * par.logits_bytes_per_row(model)))


def _naive_single_gpu(config: RooflineConfig, m: ModelShape, gpu: GPUSpec,
                      num_tokens: np.ndarray) -> np.ndarray:
    """The datasheet roofline of a dense model's linear layers on one GPU, as servesim computed
    it before parallelism (one max over all layers' weights)."""
    flops_s = gpu.peak_bf16_flops * config.mfu
    bytes_s = gpu.memory_bandwidth_bytes_s * config.mbu
    linear_params = m.num_layers * m.num_linear_params_per_layer
    weights_s = linear_params * m.dtype_bytes / bytes_s
    token_s = 2 * linear_params / flops_s
    return np.where(num_tokens > 0, np.maximum(token_s * num_tokens, weights_s), 0.0)


def _naive_lm_head(config: RooflineConfig, m: ModelShape, gpu: GPUSpec,
                   num_sampled: np.ndarray) -> np.ndarray:
    flops_s = gpu.peak_bf16_flops * config.mfu
    bytes_s = gpu.memory_bandwidth_bytes_s * config.mbu
    weights_s = m.vocab_size * m.hidden_size * m.dtype_bytes / bytes_s
    token_s = 2 * m.vocab_size * m.hidden_size / flops_s
    return np.maximum(token_s * num_sampled, weights_s * (num_sampled > 0))


class _Gemm:
    """A `sim.latency.gemm.GemmModel`'s time of one GEMM (0 for no tokens): the fitted model,
    or with `linear: naive` the datasheet roofline, max(FLOPs at mfu of peak, weight bytes at
    mbu of bandwidth)."""

    def __init__(self, config: RooflineConfig, gpu: GPUSpec, fp8: bool = False) -> None:
        from sim.latency.gemm import GemmModel

        # fp8 weights: one byte each, and fp8 math where the GPU has it (W8A8).
        if config.linear == "naive":
            self.model = GemmModel.naive(gpu, config.mfu, config.mbu, fp8=fp8)
        else:
            self.model = GemmModel.for_gpu(gpu)
            if fp8:
                self.model = self.model.fp8(gpu)
        self.launch_s = self.model.params.launch_s

    def __call__(self, m: np.ndarray, k: int, n: int) -> np.ndarray:
        return np.where(m > 0, self.model.time_s(m, k, n), 0.0)

    def describe(self) -> dict[str, Any]:
        return self.model.describe()


def _collectives(config: RooflineConfig, gpu: GPUSpec, parallelism: Parallelism) -> Collectives:
    bandwidth = BandwidthCollectives(
        gpu.interconnect_bandwidth_bytes_s, config.interconnect_efficiency,
        config.all_reduce_latency_s, config.send_recv_latency_s)
    network = None if gpu.network_bandwidth_bytes_s is None else BandwidthCollectives(
        gpu.network_bandwidth_bytes_s, config.interconnect_efficiency,
        config.all_reduce_latency_s, config.network_latency_s)
    custom = (CustomAllReduce() if config.all_reduce_kernel == "custom"
              and CustomAllReduce.takes_group(parallelism.tensor, gpu.interconnect) else None)
    return Collectives(bandwidth, parallelism, config.all_reduce_table, config.send_recv_table,
                       network=network, custom=custom)


@lru_cache(maxsize=64)
def _tables(config: RooflineConfig, model: ModelShape, gpu: GPUSpec,
            parallelism: Parallelism) -> _Tables:
    """Shared by every replica of one kind (a sweep builds many), growing as they ask."""
    return _Tables(config, model, gpu, parallelism)
