"""The exchange around each MoE layer of an expert-parallel replica (data-parallel ranks whose
GPUs hold whole experts), by vLLM's `--all2all-backend`.

- `allgather_reducescatter` (vLLM's default): every rank's hidden states and router output
  all-gathered over the ranks, the local experts' partial sums reduce-scattered back: bytes by
  every rank's tokens, whichever experts they chose; through the NICs where the ranks span
  nodes.
- `deepep_high_throughput` (DeepEP's normal kernels): a token's hidden state goes once to each
  other node holding one of its k experts (RDMA), and once to each GPU holding one (NVLink,
  forwarded on arrival); the weighted results come back the same way (combine).
- `deepep_auto` (SGLang's `--moe-a2a-backend deepep --deepep-mode auto`, its default mode):
  per step, the normal kernels where any rank's batch extends (a prompt or a chunk of one:
  `DeepEPMode.resolve` on the ranks' gathered `is_extend_in_batch`), else the low-latency ones;
  SGLang only (vLLM picks one kernel family for every step).
- `deepep_low_latency` (DeepEP's low-latency kernels, made for decode under CUDA graphs): one
  message per (token, expert) pair, not de-duplicated: over NVLink to the node's GPUs, RDMA to
  the rest. At most `CHUNK_TOKENS` tokens per rank a round (vLLM's `VLLM_MOE_DP_CHUNK_SIZE`;
  later vLLM makes 256 the step's default budget instead), each round paying the kernels'
  start-up again: a long prompt chunk takes several.

Dispatch is fp8 (a float32 scale per 128 elements) for block-fp8 checkpoints run in fp8
(DeepSeek-V3's `weight_block_size` [128, 128]: vLLM's DeepEP paths quantize first for those
only), else in the model's dtype;
combine always in the model's dtype. Routing is uniform in expectation: each token's k distinct
experts a uniform draw, experts in equal contiguous runs over the GPUs (vLLM's `linear`
placement). The busiest GPU sends for its rank's tokens (split over its tensor group: vLLM's
sequence-parallel MoE) and receives its share of every rank's times `expert_imbalance`.

Each kernel (dispatch, combine) takes a start-up plus the slower of its NVLink and RDMA bytes
at effective bandwidths fitted to DeepEP's published benchmarks (H800, CX7 NICs: `DEEPEP_*`
below) as fractions of the links' rates, so they scale with a GPU's NVLink and NICs: an
extrapolation for other GPUs (docs/hardware.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from sim.hardware.parallelism import GPUS_PER_NODE
from sim.latency.base import Num

All2AllBackend = Literal["allgather_reducescatter", "deepep_high_throughput",
                         "deepep_low_latency", "deepep_auto"]
DEEPEP_BACKENDS = ("deepep_high_throughput", "deepep_low_latency", "deepep_auto")

# vLLM's VLLM_MOE_DP_CHUNK_SIZE: tokens per rank per round of the low-latency kernels.
CHUNK_TOKENS = 256
FP8_BLOCK = 128  # elements per float32 scale of an fp8 dispatch
LL_HEADER_BYTES = 16  # per low-latency dispatch message (DeepEP's `num_fp8_bytes` counts it)


@dataclass(frozen=True)
class DeepEPFit:
    """One kernel family's start-up and the fractions of the links' one-way rates it reaches.

    Fitted to DeepEP's README benchmarks on H800 (NVLink 200 GB/s each way, one 400 Gb/s CX7 NIC
    = 50 GB/s per GPU), deepseek-ai/DeepEP docs/legacy.md:
    - low latency (128 tokens per GPU, hidden 7168, top-8, fp8 dispatch, bf16 combine; EP 8 to
      256): dispatch 77/118/155/173/192/194 us, combine 114/195/273/314/369/360 us. A start-up
      of 37 us per kernel, RDMA at 0.93 of the NIC (46.5 GB/s) and NVLink at 0.83 (166 GB/s)
      give them within 10% (tests/latency/test_all_to_all.py).
    - normal (4096 tokens per GPU, same model): NVLink 153/158 GB/s (dispatch/combine, EP8)
      counting one row per (token, GPU); RDMA 43/58/51 GB/s (EP16/32/64) counting one per
      (token, node) with the token's own node, i.e. 0.87 of the NIC for the bytes that leave
      it; NVLink at 0.78. No small-batch time is published: each kernel takes the low-latency
      start-up, and dispatch also the layout kernel vLLM runs before it
      (`get_dispatch_layout`, 53-54 us at 4,096 tokens in DeepEP's test output quoted in its
      issues #75 and #261). The CPU's wait for the receive counts (`notify_dispatch`) is not
      timed.
    """

    start_s: float  # (each of dispatch and combine)
    nvlink_efficiency: float
    network_efficiency: float
    dispatch_extra_s: float = 0.0


DEEPEP_LOW_LATENCY = DeepEPFit(start_s=37e-6, nvlink_efficiency=0.83, network_efficiency=0.93)
DEEPEP_HIGH_THROUGHPUT = DeepEPFit(start_s=37e-6, nvlink_efficiency=0.78,
                                   network_efficiency=0.87, dispatch_extra_s=53e-6)


class ExpertExchange:
    """Seconds of one MoE layer's DeepEP dispatch and combine, for `most` tokens on the busiest
    rank and `total` over all ranks, element-wise on arrays (module docstring)."""

    def __init__(self, backend: str, *, num_experts: int, experts_per_token: int,
                 hidden_size: int, dtype_bytes: int, fp8_dispatch: bool, num_ranks: int,
                 tensor: int, nvlink_bytes_s: float, network_bytes_s: float | None,
                 imbalance: float, groups: int = 1, groups_per_token: int = 1) -> None:
        self.low_latency = backend == "deepep_low_latency"
        fit = DEEPEP_LOW_LATENCY if self.low_latency else DEEPEP_HIGH_THROUGHPUT
        g = num_ranks * tensor
        local = min(g, GPUS_PER_NODE)
        nodes = g // local
        self.tensor, self.num_gpus, self.imbalance = tensor, g, imbalance
        h = hidden_size
        payload = h + 4 * -(-h // FP8_BLOCK) if fp8_dispatch else h * dtype_bytes
        k, n = experts_per_token, num_experts
        if self.low_latency:
            # Per token, k messages: to experts on other GPUs of its node (NVLink) and on other
            # nodes (RDMA); those on its own GPU stay.
            pairs_nvlink = k * (local - 1) / g
            pairs_network = k * (g - local) / g
            dispatch, combine = payload + LL_HEADER_BYTES, h * dtype_bytes
        else:
            # Per token, one row per GPU reached (own included, as DeepEP counts) over NVLink,
            # one per other node reached over RDMA.
            pairs_nvlink = g * _reached(n, k, g, groups, groups_per_token)
            pairs_network = (nodes - 1) * _reached(n, k, nodes, groups, groups_per_token)
            dispatch, combine = payload, h * dtype_bytes
        nvlink_s = nvlink_bytes_s * fit.nvlink_efficiency
        # (one node: nothing crosses the network; several: checked that the GPU has one)
        network_s = (network_bytes_s or math.inf) * fit.network_efficiency
        # Seconds per token of the busiest GPU's two kernels, each on its slower link.
        per_kernel = [max(pairs_nvlink * size / nvlink_s, pairs_network * size / network_s)
                      for size in (dispatch, combine)]
        self.token_s = per_kernel[0] + per_kernel[1]
        self.start_s = 2 * fit.start_s + fit.dispatch_extra_s

    def layer_s(self, total: Num, most: Num) -> Num:
        """Dispatch and combine of one MoE layer: the busiest GPU's tokens, the larger of what
        it sends (its rank's, over the tensor group) and what it receives (its share of all,
        times the imbalance); a round per `CHUNK_TOKENS` of the busiest rank with low
        latency."""
        busiest = np.asarray(most, dtype=np.float64)
        tokens = np.maximum(busiest / self.tensor,
                            self.imbalance * np.asarray(total) / self.num_gpus)
        rounds = np.ceil(busiest / CHUNK_TOKENS) if self.low_latency else (busiest > 0) * 1.0
        seconds = np.where(busiest > 0, rounds * self.start_s + tokens * self.token_s, 0.0)
        return seconds if isinstance(most, np.ndarray) else float(seconds)

    def describe(self) -> str:
        kind = "low-latency" if self.low_latency else "normal (high-throughput)"
        return (f"DeepEP {kind} dispatch and combine per MoE layer over {self.num_gpus} GPUs, "
                "NVLink and RDMA at the shares of the links DeepEP's benchmarks reach (its "
                "published H800 times within 10%; other GPUs by their link rates)")


def _reached(num_experts: int, k: int, units: int, groups: int = 1, chosen: int = 1) -> float:
    """P(a token's k distinct experts reach one of `units` equal contiguous runs of
    `num_experts` (a GPU's, a node's)). Uniform draws; with group-limited routing (`groups`
    equal groups, the k from `chosen` of them) where runs and groups nest, else uniform."""
    n = num_experts
    held = n // units

    def missed(pool: int, out: int) -> float:  # P(k draws from `pool` avoid `out` of it)
        p = 1.0
        for i in range(k):
            p *= max(pool - out - i, 0) / (pool - i)
        return p

    if groups <= 1 or chosen >= groups:
        return 1.0 - missed(n, held)
    size = n // groups
    pool = chosen * size  # the experts of the chosen groups
    if units % groups == 0:  # a run inside one group: reached only if that group is chosen
        return chosen / groups * (1.0 - missed(pool, held))
    if groups % units == 0:  # a run of whole groups, c of them chosen (hypergeometric)
        per = groups // units
        total = math.comb(groups, chosen)
        return 1.0 - sum(math.comb(per, c) * math.comb(groups - per, chosen - c) / total
                         * missed(pool, c * size) for c in range(min(per, chosen) + 1))
    return 1.0 - missed(n, held)


# vLLM's VLLM_DEEPEP_BUFFER_SIZE_MB: each DeepEP buffer's NVLink part, and with ranks on
# several nodes the normal kernels' RDMA part.
DEEPEP_BUFFER_BYTES = 1024 * 2**20


def deepep_buffer_bytes(backend: str, *, hidden_size: int, num_experts: int,
                        num_gpus: int) -> int:
    """GPU memory one GPU gives DeepEP's buffers as vLLM sizes them (0 for the all-gather):
    the NVLink buffer of `VLLM_DEEPEP_BUFFER_SIZE_MB`, and the RDMA buffer: as large again for
    the normal kernels across nodes (none on one node), or for the low-latency kernels
    DeepEP's `LowLatencyLayout` for `CHUNK_TOKENS` tokens a rank (`get_low_latency_rdma_size_
    hint`: odd and even send and receive buffers, each message room for every expert). Taken
    before the KV cache is sized, as vLLM's memory profiling sees them."""
    if backend not in DEEPEP_BACKENDS:
        return 0
    normal_rdma = DEEPEP_BUFFER_BYTES if num_gpus > GPUS_PER_NODE else 0
    if backend == "deepep_high_throughput":
        return DEEPEP_BUFFER_BYTES + normal_rdma
    h, tokens, scales = hidden_size, CHUNK_TOKENS, hidden_size // FP8_BLOCK
    dispatch = 16 + max(2 * h, h + 4 * scales)  # (an int4 header, bf16 or fp8 and scales)
    combine = 4 * scales + 2 * h  # (bf16, and a min/max pair per 128 for LogFMT)
    send = max(tokens * dispatch, num_experts * tokens * combine)
    receive = num_experts * tokens * max(dispatch, combine)
    signals = 4 * num_experts
    low_latency_rdma = 2 * (send + receive + signals)
    # (Auto mode sizes one buffer for both families: each part the larger of their needs,
    # as SGLang's `DeepEPBuffer.get_deepep_buffer` does.)
    return DEEPEP_BUFFER_BYTES + (max(normal_rdma, low_latency_rdma)
                                  if backend == "deepep_auto" else low_latency_rdma)

