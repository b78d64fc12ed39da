"""GPU datasheet figures (dense bf16 tensor throughput, without sparsity; HBM bandwidth)."""

from __future__ import annotations

from dataclasses import dataclass

from sim.registry import Registry


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_bf16_flops: float  # FLOP/s
    memory_bandwidth_bytes_s: float
    memory_bytes: float
    source: str


GPUS: Registry[GPUSpec] = Registry("gpu")


def _add(spec: GPUSpec) -> None:
    GPUS.register(spec.name)(spec)


_add(GPUSpec("a100-80gb", 312e12, 2.039e12, 80e9,
             "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB): 312 TFLOPS BF16, 2,039 GB/s"))
_add(GPUSpec("h100-sxm", 989.4e12, 3.35e12, 80e9,
             "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 1,979 TFLOPS BF16 with sparsity, "
             "so 989 dense; 3.35 TB/s"))
_add(GPUSpec("h200", 989.4e12, 4.8e12, 141e9,
             "NVIDIA H200 Tensor Core GPU datasheet (SXM): 1,979 TFLOPS BF16 with sparsity, "
             "so 989 dense; 4.8 TB/s; 141 GB"))
