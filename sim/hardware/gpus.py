"""GPU datasheet figures: dense bf16 tensor throughput (without sparsity), memory bandwidth and
capacity, the scale-up interconnect, and an on-demand cloud price per GPU-hour.

Units and conventions:

- `peak_bf16_flops`: FLOP/s of dense bf16 matrix math (datasheets print the 2:4-sparse figure
  next to it, twice as large; it is never used here).
- `peak_fp8_flops`: FLOP/s of dense fp8 matrix math, likewise without sparsity (`quantization:
  fp8`); None where the part has no fp8 tensor cores (A100, A10G).
- `memory_bandwidth_bytes_s`, `interconnect_bandwidth_bytes_s`: bytes/s, 1 GB/s = 1e9 bytes/s
  as datasheets count them.
- `memory_bytes`: the datasheet's capacity, exact, in binary units: NVIDIA's and AMD's "80GB",
  "141GB", "180GB", "192GB" of HBM are GiB (80 GiB = 5 stacks of 16 GiB; nvidia-smi shows an H100
  80GB with 81,559 MiB total and an H200 with 143,771 MiB, which 141e9 bytes = 134,468 MiB could
  not hold). What software can allocate is a little less: torch reports about 79.1 GiB total on
  an H100 80GB and about 140 GiB on an H200 (the driver keeps the rest), and GDDR6 parts with
  ECC on (the default for L40S and A10G) lose 1/16 to it: 45 of 48 GiB, 22.5 of 24 GiB.
  `kv_cache.gpu_memory_utilization` (0.9 by default) multiplies this figure, so those margins
  come out of its 10%.
- `interconnect_bandwidth_bytes_s`: what one GPU can send in one direction over the scale-up
  fabric that tensor-parallel all-reduces use: NVLink for SXM parts (datasheets print both
  directions together: H100's NVLink 4 "900 GB/s" is 450 GB/s each way), AMD Infinity Fabric
  for MI300X (7 links of 64 GB/s each way), PCIe for PCIe cards without NVLink (Gen4 x16:
  "64 GB/s bidirectional", 32 GB/s each way).
- `network_bandwidth_bytes_s`: what one GPU can send in one direction to another node, over
  the scale-out NICs of the reference 8-GPU server (one 400 Gb/s ConnectX-7 per GPU in DGX
  H100/H200/B200: 50 GB/s), used for pipeline hand-offs between nodes; None where unknown.
- `cost_per_gpu_hour`: USD for one GPU for one hour, on-demand (no commitment), from a public
  list price; an instance's price divided by its GPUs (CPUs, host memory and disks included).
  All NVIDIA parts are priced at AWS us-east-1 Linux on-demand and the MI300X at Azure (not sold
  by AWS) so that they compare; smaller clouds list the same GPUs for about half (Lambda: H100
  SXM $3.99, A100 SXM 80GB $2.79, B200 $6.69 per GPU-hour, lambda.ai/instances as transcribed
  2026-09-20; RunPod: H100 SXM $2.69-$3.99, runpod.io/pricing 2026-11-09). Prices move: give
  `cost_per_gpu_hour` in a custom `gpu:` mapping to use your own.

A scenario names a registered GPU (`gpu: h100-sxm`) or describes one as a mapping, read by
`GPUSpecInput` (see `resolve_gpu`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# pydantic, for `GPUSpecInput`: this module is not on the path of `servesim --help`
# (sim.cli.app does not import it; tests/hardware/test_gpus.py checks), and everything that
# imports it (the scenario models, the latency models, `servesim list`) loads pydantic anyway.
from pydantic import BaseModel, Field, field_validator, model_validator

from sim.config.errors import INPUT_MODEL
from sim.core.registry import Registry

GiB = 2**30

# Scale-up fabric for a PCIe card without NVLink: PCIe Gen4 x16, one direction; Gen5 twice it.
PCIE4_X16_BYTES_S = 32e9
PCIE5_X16_BYTES_S = 64e9


# The host link (PCIe x16) of each registered GPU, raw, one direction: Gen5 on Hopper,
# Blackwell, RTX PRO 6000 and MI300X, Gen4 on the rest (datasheets). KV copies to and from host
# memory (a CPU tier) use it; `host_link_bytes_s` gives the default.
_PCIE5_PARTS = frozenset({"h100-sxm", "h200", "b200", "rtxpro6000", "mi300x"})
HOST_LINK_EFFICIENCY = 0.8  # large pinned DMA copies reach about this share (an assumption)


def host_link_bytes_s(name: str) -> float:
    """Bytes/s one GPU's KV copies to or from host memory reach (each way), by default: its
    PCIe link's raw rate times `HOST_LINK_EFFICIENCY`."""
    raw = PCIE5_X16_BYTES_S if name in _PCIE5_PARTS else PCIE4_X16_BYTES_S
    return raw * HOST_LINK_EFFICIENCY


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_bf16_flops: float  # FLOP/s, dense (no sparsity)
    memory_bandwidth_bytes_s: float
    memory_bytes: float  # exact: the datasheet capacity in GiB times 2**30
    source: str  # the datasheet the figures above come from
    # Per GPU, one direction, of the fabric tensor-parallel all-reduces use.
    interconnect_bandwidth_bytes_s: float = PCIE4_X16_BYTES_S
    interconnect: str = "pcie4"  # "nvlink4", "nvlink5", "infinity-fabric", "pcie4", ...
    cost_per_gpu_hour: float | None = None  # USD, on-demand; None: unknown
    cost_source: str = ""  # where the price is from, and when it was seen
    # Per GPU, one direction, to another node (scale-out NICs); None: unknown.
    network_bandwidth_bytes_s: float | None = None
    network_source: str = ""  # which server's NICs, and where that is from
    # FLOP/s of dense fp8 matrix math (no sparsity); None: no fp8 tensor cores (Ampere), where
    # fp8 weights run as weight-only quantization on the bf16 units.
    peak_fp8_flops: float | None = None
    # The registered GPU whose kernel measurements time this one: its own name, or for a copy
    # that changes no figure kernels run at (its price, say: `gpu: {base: a100-80gb, ...}`),
    # its base's. None: the name.
    kernels_of: str | None = None

    @property
    def measured_as(self) -> str:
        """The name the GEMM and elementwise calibrations look this GPU up by."""
        return self.kernels_of or self.name

    def matmul_flops(self, fp8: bool = False) -> float:
        """Dense FLOP/s of matrix math: the fp8 peak if `fp8` and the GPU has fp8 tensor
        cores, else the bf16 peak (fp8 weights there run on the bf16 units, W8A16)."""
        if fp8 and self.peak_fp8_flops is not None:
            return self.peak_fp8_flops
        return self.peak_bf16_flops

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB


GPUS: Registry[GPUSpec] = Registry("gpu")


def measured_on(gpu_name: str, device_name: str) -> bool:
    """Whether a latency measured on `device_name` (torch's name for it: "NVIDIA H100 80GB HBM3",
    "cpu: AMD EPYC") is one of the GPU kind `gpu_name` ("h100-sxm"): its family, the name up to
    its first '-' ("h100"), is in the device's name."""
    family = gpu_name.split("-")[0].lower()
    # Torch's names space words ("NVIDIA GeForce RTX 4090"); registered ones do not ("rtx4090").
    return family in device_name.lower().replace(" ", "")


def _add(spec: GPUSpec) -> None:
    GPUS.register(spec.name)(spec)


_AWS = "AWS EC2 on-demand, us-east-1, Linux"
# Public transcriptions of AWS's price list, each with its date (no network here to re-read
# aws.amazon.com/ec2/pricing/on-demand/).
# Scale-out NICs: DGX H100, H200 and B200 alike (docs.nvidia.com/dgx-basepod, reference
# architecture "Core Components", read 2026-11-23: "Four OSFP ports serving eight single-port
# NVIDIA ConnectX-7 VPI ... up to 400 Gb/s InfiniBand/Ethernet", four of them for compute).
_DGX_CX7 = ("DGX H100/H200/B200: 8x single-port ConnectX-7 400 Gb/s InfiniBand, one per GPU "
            "(NVIDIA DGX BasePOD reference architecture, Core Components, read 2026-11-23)")
_FROM_MEMORY = "the vendor's published configuration as remembered; not re-checked here"
_RECEIPTS = ("github.com/datareceipts/data-receipts 109-gpu-pricing/hyperscalers.json "
             "(AWS price list, retrieved 2026-11-09)")

_add(GPUSpec(
    "a100-80gb", 312e12, 2.039e12, 80 * GiB,
    "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 312 TFLOPS dense (624 with "
    "sparsity), HBM2e 2,039 GB/s, 80GB; NVLink 3 600 GB/s (both directions)",
    300e9, "nvlink3",
    27.44705 / 8,
    f"{_AWS}: p4de.24xlarge (8x A100 SXM4 80GB) $27.44705/h / 8; {_RECEIPTS}",
    25e9, f"DGX A100: 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand for compute, one per "
          f"GPU ({_FROM_MEMORY})"))
_add(GPUSpec(
    "h100-sxm", 989.4e12, 3.35e12, 80 * GiB,
    "NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity, 989.4 dense "
    "(H100 architecture whitepaper); FP8 3,958 TFLOPS with sparsity, 1,979 dense; HBM3 "
    "3.35 TB/s, 80GB; NVLink 4 900 GB/s (both directions)",
    450e9, "nvlink4",
    55.04 / 8,
    f"{_AWS}: p5.48xlarge (8x H100 SXM5) $55.04/h / 8; {_RECEIPTS}",
    50e9, _DGX_CX7, 1979e12))
_add(GPUSpec(
    "h200", 989.4e12, 4.8e12, 141 * GiB,
    "NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity, so 989.4 "
    "dense (the H100's GH100 die), FP8 3,958 with sparsity, 1,979 dense; HBM3e 4.8 TB/s, "
    "141GB (GiB: nvidia-smi shows 143,771 MiB); "
    "NVLink 4 900 GB/s (both directions)",
    450e9, "nvlink4",
    63.296 / 8,
    f"{_AWS}: p5en.48xlarge (8x H200) $63.296/h / 8; `dstack offer` output in "
    "github.com/dstackai/dstack pull request #4110 (Aug 2026)",
    50e9, _DGX_CX7, 1979e12))
_add(GPUSpec(
    "b200", 2.25e15, 8e12, 180 * GiB,
    "NVIDIA HGX B200 datasheet: FP16/BF16 36 PFLOPS with sparsity for 8 GPUs, so 2.25 PFLOPS "
    "dense per GPU (1,000 W HGX part; GB200's runs at 2.5); FP8 72 PFLOPS with sparsity for 8, "
    "so 4.5 dense per GPU; HBM3e 8 TB/s and 180GB per GPU "
    "(1.44 TB per 8; nvidia-smi shows about 179 GiB); NVLink 5 1.8 TB/s (both directions)",
    900e9, "nvlink5",
    113.9328 / 8,
    f"{_AWS}: p6-b200.48xlarge (8x B200) $113.9328/h / 8; instances.vantage.sh figures as "
    "quoted in a public test fixture (undated, seen Nov 2026), not re-checked here",
    50e9, _DGX_CX7, 4.5e15))
_add(GPUSpec(
    "l40s", 362.05e12, 864e9, 48 * GiB,
    "NVIDIA L40S datasheet: BF16 Tensor Core 362.05 TFLOPS dense (733 with sparsity), FP8 733 "
    "dense (1,466 with sparsity), GDDR6 "
    "with ECC 864 GB/s, 48GB (45 GiB usable with ECC on); no NVLink: PCIe Gen4 x16 64 GB/s "
    "bidirectional",
    PCIE4_X16_BYTES_S, "pcie4",
    1.861,
    f"{_AWS}: g6e.xlarge (1x L40S) $1.861/h; devzero.io/instances/aws/g6e.xlarge as cited in "
    "a public 2026 research note, seen Nov 2026",
    6.25e9, f"AWS g6e.48xlarge (8x L40S): 400 Gb/s of networking, 50 Gb/s per GPU "
            f"({_FROM_MEMORY})", 733e12))
_add(GPUSpec(
    "a10g", 70e12, 600e9, 24 * GiB,
    "NVIDIA A10G (AWS G5; NVIDIA publishes no A10G datasheet): BF16/FP16 tensor 70 TFLOPS "
    "dense as tabulated by Baseten, 'NVIDIA A10 vs A10G for ML model inference' (the A10 "
    "datasheet's 125 is for a part that keeps full rate with fp32 accumulation), GDDR6 600 "
    "GB/s, 24GB (22.5 GiB usable with ECC on); no NVLink: PCIe Gen4 x16",
    PCIE4_X16_BYTES_S, "pcie4",
    1.006,
    f"{_AWS}: g5.xlarge (1x A10G) $1.006/h; factualminds.com 'Amazon EC2 On-Demand Pricing "
    "... (2026)', June 2026",
    1.5625e9, f"AWS g5.48xlarge (8x A10G): 100 Gb/s of networking, 12.5 Gb/s per GPU "
              f"({_FROM_MEMORY})"))
# Workstation and consumer parts: no hyperscaler lists them, so RunPod's on-demand price (about
# half AWS's for the GPUs both list, see the module's docstring) stands in. Their figures were
# read from public transcriptions of NVIDIA's documents (two or more agreeing, or one agreeing
# with the per-SM arithmetic), not from the PDFs themselves.
_ADA = "NVIDIA Ada GPU Architecture whitepaper v2.02+, Appendix A (as transcribed publicly)"
_RTX_PRO = ("NVIDIA RTX Blackwell PRO GPU Architecture whitepaper v1.0, Appendix A, and the RTX "
            "PRO 6000 Blackwell datasheets (as transcribed publicly)")
_RUNPOD = ("RunPod on-demand (not AWS: no hyperscaler lists it), deploybase.ai 'RunPod GPU "
           "Pricing: 2026 Comprehensive Pricing Guide', March 2026 table; prices there vary by "
           "page (another gives $0.34 for the RTX 4090)")
_add(GPUSpec(
    "rtx4090", 165.2e12, 1008e9, 24 * GiB,
    f"{_ADA}: BF16 tensor with FP32 accumulate 165.2 TFLOPS dense (a GeForce part: half its "
    "330.3 with FP16 accumulate), FP8 with FP32 accumulate 330.3 (v2.02's correction), "
    "GDDR6X 1,008 GB/s, 24 GB; no NVLink, no peer access on the stock driver: PCIe Gen4 x16",
    PCIE4_X16_BYTES_S, "pcie4", 0.60, f"{_RUNPOD}: RTX 4090 $0.60/h", None, "", 330.3e12))
_add(GPUSpec(
    "rtxpro6000", 503.8e12, 1792e9, 96 * GiB,
    f"{_RTX_PRO}: Workstation Edition BF16 with FP32 accumulate 503.8 TFLOPS dense (no "
    "halving), FP8 1,007.6, GDDR7 1,792 GB/s, 96 GB, PCIe Gen5 x16, no NVLink. Server "
    "Edition: 1,597 GB/s, no dense BF16 published (~468 by its clock)",
    PCIE5_X16_BYTES_S, "pcie5", 1.57, f"{_RUNPOD}: RTX PRO 6000 $1.57/h", None, "",
    1007.6e12))
_add(GPUSpec(
    "mi300x", 1307.4e12, 5.3e12, 192 * GiB,
    "AMD Instinct MI300X datasheet: peak BF16 1,307.4 TFLOPS dense (2,614.9 with sparsity), "
    "peak FP8 2,614.9 dense (5,229.8 with sparsity), "
    "HBM3 5.3 TB/s, 192GB (GiB: Azure lists 192 GiB per GPU); Infinity Fabric 7 links of 128 "
    "GB/s (both directions), so 448 GB/s out of one GPU each way",
    448e9, "infinity-fabric",
    48.0 / 8,
    "Azure on-demand, Linux: ND96isr_MI300X_v5 (8x MI300X) $48.00/h / 8, as listed in a public "
    "repository's pricing table (undated, seen Nov 2026); AWS does not sell MI300X; not "
    "re-checked here",
    50e9, f"Azure ND MI300X v5: 8x 400 Gb/s InfiniBand (ConnectX-7), one per GPU "
          f"({_FROM_MEMORY})", 2614.9e12))


# Bounds for a custom GPU: a few times beyond the largest part above, so that a unit slip
# (GB for bytes, TFLOP/s for FLOP/s) is refused instead of simulated.
_MAX_FLOPS = 1e17  # 100 PFLOP/s
_MAX_MEMORY_BANDWIDTH = 1e14  # 100 TB/s
_MAX_MEMORY_BYTES = 1e13  # 10 TB
_MAX_INTERCONNECT = 1e13  # 10 TB/s each way
_MAX_COST = 1000.0  # USD per GPU-hour
# And floors well below the smallest part above, for a unit slip the other way (TB/s given
# as 3.35): 1 TFLOP/s, 10 GB/s of memory, 1 GiB, 100 MB/s between GPUs.
_MIN_FLOPS = 1e12
_MIN_MEMORY_BANDWIDTH = 1e10
_MIN_MEMORY_BYTES = float(2**30)
_MIN_INTERCONNECT = 1e8
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class GPUSpecInput(BaseModel):
    """A GPU described in a scenario instead of named, e.g.

        gpu: {name: my-gpu, peak_bf16_flops: 4.0e+14, memory_bandwidth_bytes_s: 2.0e+12,
              memory_bytes: 4.8e+10, interconnect_bandwidth_bytes_s: 6.4e+10,
              cost_per_gpu_hour: 1.5}

    Units as `GPUSpec`'s. Every figure is a finite number (not text, not a boolean) between
    bounds that catch unit slips. With `base`, a registered GPU gives every figure not
    given, e.g. your own price: `gpu: {base: h100-sxm, cost_per_gpu_hour: 2.49}` (named
    `h100-sxm-custom` unless `name` says otherwise)."""

    model_config = INPUT_MODEL

    base: str | None = Field(None, description="a registered GPU giving the figures not given")

    name: str = Field(pattern=_NAME, max_length=64,
                      description="a name for results; not a registered GPU's")
    peak_bf16_flops: float = Field(ge=_MIN_FLOPS, le=_MAX_FLOPS,
                                   description="FLOP/s, dense bf16 (no sparsity)")
    peak_fp8_flops: float | None = Field(
        None, ge=_MIN_FLOPS, le=_MAX_FLOPS,
        description="FLOP/s, dense fp8 (no sparsity); None: no fp8 tensor cores")
    memory_bandwidth_bytes_s: float = Field(ge=_MIN_MEMORY_BANDWIDTH, le=_MAX_MEMORY_BANDWIDTH,
                                            description="bytes/s of GPU memory")
    memory_bytes: float = Field(ge=_MIN_MEMORY_BYTES, le=_MAX_MEMORY_BYTES,
                                description="bytes of GPU memory")
    interconnect_bandwidth_bytes_s: float = Field(
        ge=_MIN_INTERCONNECT, le=_MAX_INTERCONNECT,
        description="bytes/s one GPU sends one way over the tensor-parallel fabric")
    interconnect: str = Field("custom", pattern=_NAME, max_length=32,
                              description="a short word: nvlink4, pcie5, ...")
    cost_per_gpu_hour: float | None = Field(None, gt=0, le=_MAX_COST,
                                            description="USD per GPU-hour; None: unknown")
    network_bandwidth_bytes_s: float | None = Field(
        None, ge=_MIN_INTERCONNECT, le=_MAX_INTERCONNECT,
        description="bytes/s one GPU sends one way to another node; None: unknown")
    source: str = Field("custom GPU given in the scenario", max_length=500)
    cost_source: str = Field("given in the scenario", max_length=500)

    @model_validator(mode="before")
    @classmethod
    def _from_base(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("base") is None:
            return data
        base = data["base"]
        if not isinstance(base, str) or base not in GPUS:
            raise ValueError(f"base={base!r}: not a registered GPU; known: "
                             f"{', '.join(GPUS.names())}")
        spec = GPUS.get(base)
        given = {k: v for k, v in data.items() if v is not None}
        defaults: dict[str, Any] = {
            "name": f"{base}-custom", "peak_bf16_flops": spec.peak_bf16_flops,
            "memory_bandwidth_bytes_s": spec.memory_bandwidth_bytes_s,
            "memory_bytes": spec.memory_bytes,
            "interconnect_bandwidth_bytes_s": spec.interconnect_bandwidth_bytes_s,
            "interconnect": spec.interconnect, "source": f"{spec.source} (changed in the scenario)"}
        if "peak_fp8_flops" not in given and spec.peak_fp8_flops is not None:
            defaults["peak_fp8_flops"] = spec.peak_fp8_flops
        if "network_bandwidth_bytes_s" not in given and spec.network_bandwidth_bytes_s:
            defaults["network_bandwidth_bytes_s"] = spec.network_bandwidth_bytes_s
        if "cost_per_gpu_hour" not in given and spec.cost_per_gpu_hour is not None:
            defaults |= {"cost_per_gpu_hour": spec.cost_per_gpu_hour,
                         "cost_source": spec.cost_source}
        return defaults | given

    @field_validator("name")
    @classmethod
    def _not_registered(cls, name: str) -> str:
        if name in GPUS:
            raise ValueError(f"is a registered GPU's name; name a custom GPU otherwise, or give "
                             f"`gpu: {name}` to use the registered one")
        return name

    def to_spec(self) -> GPUSpec:
        cost, network = self.cost_per_gpu_hour, self.network_bandwidth_bytes_s
        return GPUSpec(self.name, float(self.peak_bf16_flops),
                       float(self.memory_bandwidth_bytes_s), float(self.memory_bytes),
                       self.source, float(self.interconnect_bandwidth_bytes_s), self.interconnect,
                       None if cost is None else float(cost),
                       "" if cost is None else self.cost_source,
                       None if network is None else float(network),
                       "" if network is None else self.source,
                       None if self.peak_fp8_flops is None else float(self.peak_fp8_flops),
                       self._kernels_of())

    def _kernels_of(self) -> str | None:
        """The base, where this copy runs kernels at its base's figures (compute and memory
        bandwidth): the base's measurements then time them."""
        if self.base is None:
            return None
        spec = GPUS.get(self.base)
        same = (self.peak_bf16_flops == spec.peak_bf16_flops
                and self.peak_fp8_flops == spec.peak_fp8_flops
                and self.memory_bandwidth_bytes_s == spec.memory_bandwidth_bytes_s)
        return self.base if same else None


def resolve_gpu(value: str | Mapping[str, Any]) -> GPUSpec:
    """A registered GPU by name, or a custom one described by a mapping (see `GPUSpecInput`).

    Raises ValueError naming the problem: an unknown name (with the known ones), a value that is
    neither a name nor a mapping, or a pydantic ValidationError (a ValueError) with each bad
    field of the mapping at its name."""
    if isinstance(value, str):
        if value not in GPUS:
            raise ValueError(f"unknown gpu {value!r}; known: {', '.join(GPUS.names())}, or a "
                             "mapping describing one (name, peak_bf16_flops, ...)")
        return GPUS.get(value)
    if isinstance(value, Mapping):
        return GPUSpecInput.model_validate(dict(value)).to_spec()
    raise ValueError(f"gpu must be a registered name ({', '.join(GPUS.names())}) or a mapping "
                     f"describing one, not {type(value).__name__} {value!r}")

