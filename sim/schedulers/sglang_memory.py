"""SGLang 0.5.23's KV pool from GPU memory (`sglang` with `kv_cache.num_blocks` unset).

SGLang does not size its pool as vLLM does (`gpu_memory_utilization` of the GPU for weights,
activations and KV). `--mem-fraction-static` is the fraction of the GPU for weights and the KV
pool together; the rest is left for activations and CUDA graphs. Unset, SGLang derives it
(`sglang/srt/arg_groups/memory_hook.py:47-343`, `handle_gpu_memory_settings`) from the GPU's
memory as nvidia-smi reports it (`gpu_mem`, MiB: `utils/common.py:802-832`
`get_nvgpu_memory_capacity`, rocm-smi's pool on AMD):

    reserved = 512 + 1.5 * max(chunked_prefill_size, 2048)        (MiB; memory_hook.py:304-310)
             + tp * pp / 8 * 1024                                 (:312)
             + 2 * decode_max_bs                                  (:368, reserve_for_graph_mb)
             + 8 * len(prefill graph sizes)  (1.5 GiB with MLA)   (:380-389)
    reserved = max(reserved, 10 GiB) above 60 GiB                 (:314-315)
    mem_fraction_static = round((gpu_mem - reserved) / gpu_mem, 3)  (:324-328)

`decode_max_bs` (the decode CUDA graphs' largest batch) is 8 below 20 GiB, 48 below 35 (160 from
TP4), 32 below 60 (160 from TP4), 256 below 160 GiB (512 from TP4), else 512 (:89-170), at most
a `--max-running-requests` given (:182-188). The prefill ("breakable") CUDA graphs are on by
default on CUDA only (`model_executor/cuda_graph_config.py:119` `default_prefill_backend`),
off on a pipeline (`cuda_graph_hook.py:136` `apply_cuda_graph_compatibility`); their sizes are
`generate_prefill_cuda_graph_batch_sizes` (`cuda_graph_hook.py:480-497`) up to the chunk (8192
with MLA; 4096 for a Llama-2, by its path: memory_hook.py:233-263). A disaggregated prefill
server has no decode graphs, a decode server no prefill graphs (`cuda_graph_hook.py:557-576`),
and a decode server's activations scale with its running requests times the draft tokens
(memory_hook.py:298-303) instead of the chunk. On AMD (AITER attention for a model without
MLA), a context window above 8192 scales the fraction by 0.85 (`attention_hook.py:244-269`).
Speculative decoding's cap of 48 requests is set after this (`speculative_hook.py:442`), so
it does not lower `decode_max_bs`.

The pool then holds what the fraction leaves after the weights
(`mem_cache/kv_cache_configurator.py:2990-3040` `_profile_available_bytes`): the free memory
measured after loading them, less `pre_model_load_memory * (1 - mem_fraction_static)`, where
`pre_model_load_memory` is the free memory measured before loading them
(`distributed/bootstrap.py:193`); divided by the cell
(a token's K and V on this GPU, a one-layer drafter's too: `model_executor/pool_configurator.py:
259-314`, 340-535) and rounded down to whole pages (:637-647). So the pool's bytes are
`pre_model_load_memory * mem_fraction_static - weights`.

What servesim cannot measure, it approximates:

- nvidia-smi's total (`TOTAL_MIB`) for each registered GPU, as nvidia-smi and rocm-smi print it
  on public machines; a custom GPU: its `memory_bytes` in MiB.
- `pre_model_load_memory`: that total less `PRE_LOAD_GAP_MIB`, the gap a public SGLang log shows
  on an H100 80GB (81,559 MiB; `Load weight begin. avail mem=78.43 GB`, SGLang's documentation
  notebooks, 2026-02, Llama-3.1-8B at TP1): memory the driver keeps from torch, the CUDA context,
  torch.distributed's set-up. NCCL's buffers on a TP or PP group (a few hundred MiB) are not
  counted, nor anything else loaded beside the weights. Where the weights fill most of the
  static memory the pool is a small difference of large numbers: on an RTX 4090 with
  Llama-3.1-8B (0.704, 8.8k tokens), 100 MiB more or less free is 800 tokens, 9%.
- Weights as servesim counts them (`Parallelism.weight_bytes_per_gpu`, a drafter's layer
  added): the log above measured 15.02 GiB for Llama-3.1-8B, servesim counts 14.96.
- DP attention (`parallelism.data` with `sglang`): SGLang's `--tp` is every rank's GPUs
  (data x tensor) and the decode graphs reserve `max_bs x ranks x 3` MiB more (4.5 above a
  `max_bs` of 300: memory_hook.py:370-378); each rank's pool then holds what its GPU has left.
- DeepEP, multimodal models, hybrid (Mamba) and sliding-window pools: not modelled.
- Whether `--max-running-requests` was given is read from the scenario; with speculative
  decoding a given 48 is taken for SGLang's own (the same number: the decode graphs' cap then
  stays 256 where SGLang would lower it to 48, 0.4 GiB more reserve).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sim.hardware.gpus import GPUS, GPUSpec

MiB = 2**20
GiB = 2**30

# nvidia-smi's `memory.total` (rocm-smi's VRAM total for the MI300X), MiB, as printed on public
# machines (ECC on where the part has it): what SGLang reads as the GPU's memory.
TOTAL_MIB: dict[str, int] = {
    "h100-sxm": 81_559,
    "h200": 143_771,
    "a100-80gb": 81_920,
    "b200": 183_359,
    "l40s": 46_068,
    "a10g": 23_028,
    "rtx4090": 24_564,
    "rtxpro6000": 97_887,
    "mi300x": 196_288,  # 205,822,885,888 bytes
}
# nvidia-smi's total less the free memory SGLang measures before loading the weights, MiB:
# 81,559 MiB - 78.43 GiB on an H100 80GB (see the module's docstring).
PRE_LOAD_GAP_MIB = 1247
# GPUs on which SGLang runs ROCm (no prefill CUDA graphs; AITER attention).
HIP_GPUS = frozenset({"mi300x"})

Role = Literal["colocated", "prefill", "decode"]


def total_mib(gpu: GPUSpec) -> float:
    """The GPU's memory as SGLang reads it (nvidia-smi's total, MiB): a registered GPU's (or
    a copy's with its base's memory) from `TOTAL_MIB`, else `memory_bytes` in MiB."""
    base = gpu.measured_as
    if base in TOTAL_MIB and GPUS.get(base).memory_bytes == gpu.memory_bytes:
        return TOTAL_MIB[base]
    return gpu.memory_bytes / MiB


def pre_load_bytes(gpu: GPUSpec) -> float:
    """SGLang's `pre_model_load_memory` in bytes: free memory before the weights load."""
    return (total_mib(gpu) - PRE_LOAD_GAP_MIB) * MiB


def decode_graph_max_bs(gpu_mib: float, tp: int) -> int:
    """The decode CUDA graphs' largest batch by the GPU's memory and TP (memory_hook.py:89-170)."""
    if gpu_mib < 20 * 1024:
        return 8
    if gpu_mib < 35 * 1024:
        return 48 if tp < 4 else 160
    if gpu_mib < 60 * 1024:
        return 32 if tp < 4 else 160
    if gpu_mib < 160 * 1024:
        return 256 if tp < 4 else 512
    return 512


def decode_graph_limit(gpu_mib: float, tp: int, max_running_requests: int | None) -> int:
    """The decode CUDA graphs' largest batch: by the GPU's memory and TP, at most a given
    `--max-running-requests` (memory_hook.py:182-188)."""
    max_bs = decode_graph_max_bs(gpu_mib, tp)
    if max_running_requests is not None and max_bs > max_running_requests:
        max_bs = max_running_requests
    return max_bs


def prefill_graph_sizes(max_bs: int, align_8: bool = False) -> list[int]:
    """The token counts SGLang captures prefill CUDA graphs at, up to `max_bs`
    (`generate_prefill_cuda_graph_batch_sizes`, cuda_graph_hook.py:480-497); with `align_8`
    (DeepEP, whose capture can hang otherwise) each rounded up to a multiple of 8
    (`apply_deepep_adjustments`, cuda_graph_hook.py:315-346)."""
    sizes = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
             + list(range(576, 1025, 64)) + list(range(1280, 4097, 256))
             + list(range(4608, max_bs + 1, 512)))
    sizes = [s for s in sizes if s <= max_bs]
    return sorted({-(-s // 8) * 8 for s in sizes}) if align_8 else sizes


def num_prefill_graphs(max_bs: int) -> int:
    """How many prefill CUDA graphs SGLang captures up to `max_bs` tokens."""
    return len(prefill_graph_sizes(max_bs))


def decode_graph_sizes(max_bs: int, num_max_requests: int, spec: bool = False) -> list[int]:
    """The batch sizes SGLang captures decode CUDA graphs at: its grid up to `max_bs` (finer
    for small batches with speculative decoding) and `max_bs` itself
    (`generate_decode_cuda_graph_batch_sizes`, cuda_graph_hook.py:500-532), then at most a
    scheduler's request pool, which is added where smaller (`base_cuda_graph_runner.py:
    77-101`; alignment to the attention TP size left out)."""
    grid = ([*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8),
             *range(272, max_bs + 1, 16)] if spec else
            [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16),
             *range(512, max_bs + 1, 32)])
    sizes = [bs for bs in grid if bs <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    if max(sizes) > num_max_requests:
        sizes.append(num_max_requests)
    return sorted({bs for bs in sizes if bs <= num_max_requests})


@dataclass(frozen=True)
class MemoryInputs:
    """What SGLang's default `mem_fraction_static` depends on, as servesim knows it."""

    gpu: GPUSpec
    tensor: int
    pipeline: int
    chunked_prefill_size: int
    max_running_requests: int | None  # given by the scenario; None: SGLang's own
    num_draft_tokens: int | None  # speculative decoding's, or None
    mla: bool
    llama2: bool  # the model's name holds "llama-2" (SGLang reads its path)
    context_len: int | None
    role: Role = "colocated"
    num_dp_ranks: int = 1  # DP attention's ranks (`tensor` is then SGLang's whole --tp)


def default_mem_fraction_static(m: MemoryInputs) -> float:
    """SGLang 0.5.23's `--mem-fraction-static` when unset (module docstring)."""
    gpu_mib = total_mib(m.gpu)
    hip = m.gpu.measured_as in HIP_GPUS
    max_bs = decode_graph_limit(gpu_mib, m.tensor, m.max_running_requests)
    if m.role == "decode":
        running = m.max_running_requests or max_bs or 1
        activation_tokens = max(running * (m.num_draft_tokens or 1), 2048)
    else:
        activation_tokens = max(m.chunked_prefill_size, 2048)
    reserved = 512 + activation_tokens * 1.5 + m.tensor * m.pipeline / 8 * 1024
    if m.role != "prefill":  # decode CUDA graphs
        reserved += max_bs * 2
        if m.num_dp_ranks > 1:  # DP attention's padding (`reserve_for_graph_mb`)
            reserved += max_bs * m.num_dp_ranks * (4.5 if max_bs > 300 else 3)
    if m.role != "decode" and not hip and m.pipeline == 1:  # prefill ("breakable") graphs
        if m.mla:
            reserved += 1.5 * 1024
        else:
            prefill_max_bs = min(m.chunked_prefill_size, 4096) if m.llama2 \
                else m.chunked_prefill_size
            reserved += num_prefill_graphs(prefill_max_bs) * 8
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    fraction = round((gpu_mib - reserved) / gpu_mib, 3)
    if hip and not m.mla and (m.context_len or 0) > 8192:
        fraction *= 0.85  # AITER's workspace (attention_hook.py:244-269)
    return fraction


def kv_pool_tokens(gpu: GPUSpec, mem_fraction_static: float, weight_bytes: float,
                   cell_bytes: float, page_size: int) -> int:
    """Token slots of SGLang's KV pool on `gpu` (`_profile_available_bytes`, then whole pages):
    `pre_model_load_memory * mem_fraction_static - weights` over the cell; at most 0 where
    the weights leave no room."""
    budget = pre_load_bytes(gpu) * mem_fraction_static - weight_bytes
    if budget <= 0:
        return int(budget // cell_bytes)
    return int(budget // cell_bytes) // page_size * page_size
