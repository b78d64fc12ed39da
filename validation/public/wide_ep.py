"""servesim's expert-parallel exchange and wide-EP steps against public figures: DeepEP's own
kernel benchmarks (deepseek-ai/DeepEP, MIT) and SGLang's 96-H100 DeepSeek deployment (LMSYS
blog, 2025-05-05), quoted here as published; no run data is read.

    python validation/public/wide_ep.py [--out FILE.md]

- DeepEP: dispatch plus combine of one MoE layer on H800s (NVLink 200 GB/s each way, one
  400 Gb/s NIC per GPU), low-latency kernels at 128 tokens per GPU (EP 8-256, top-8 of 288
  experts: its test's), normal kernels at 4,096 (EP 8-64, 256 experts in one group per node, 4
  per token: its test's routing; the time its bottleneck bandwidth implies for the bytes its
  test counts). The fit's own data: this checks the fit, not a prediction.
- SGLang on H100s, DeepSeek-V3 (fp8), DeepEP with DP attention: prefill on 4 nodes (EP32,
  normal kernels, 16,384 tokens per GPU a step, prompts of 1K/2K/4K) and decode on 9 (EP72,
  low-latency kernels, 256 requests per GPU at about 2,000 tokens of KV), tokens per second per
  node. servesim times one lockstep step of vLLM's ranks on those batches (`engine: none`,
  DeepSeek-V3's group-limited routing, uniform otherwise: `expert_imbalance` 1); EP64 stands
  for EP72 (72 GPUs do not divide 256 experts; SGLang ran 288 with 32 redundant). SGLang
  overlapped two micro-batches (TBO: the exchange behind compute) and balanced experts with
  EPLB; servesim does neither, and it models vLLM's engine, not SGLang's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import report  # noqa: E402

H800 = {"nvlink_bytes_s": 200e9, "network_bytes_s": 50e9}
HIDDEN = 7168
FP8_ROW, BF16_ROW = HIDDEN + 4 * HIDDEN // 128, 2 * HIDDEN
# deepseek-ai/DeepEP docs/legacy.md: EP, dispatch us, combine us (low latency, 128 tokens).
LOW_LATENCY_US = [(8, 77, 114), (16, 118, 195), (32, 155, 273), (64, 173, 314),
                  (128, 192, 369), (256, 194, 360)]
# ... and the normal kernels: EP, dispatch GB/s, combine GB/s, the link they count.
NORMAL_GB_S = [(8, 153, 158, "NVLink"), (16, 43, 43, "RDMA"), (32, 58, 57, "RDMA"),
               (64, 51, 50, "RDMA")]
# LMSYS, "Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on 96
# H100 GPUs": prefill tokens/s per node by prompt length (default EPLB), and with a simulated
# perfect EPLB at 4K; decode output tokens/s per node.
PREFILL_PER_NODE = [(1024, 57_674), (2048, 54_543), (4096, 50_302)]
PREFILL_PERFECT_EPLB_4K = 59_337
DECODE_PER_NODE = 22_282


def deepep_exchange(backend: str, ep: int, experts: int, groups: int = 1, chosen: int = 1,
                    **kwargs: float):
    """servesim's exchange for DeepEP's benchmark setting: H800 links, hidden 7,168, top-8,
    fp8 dispatch, one GPU a rank (`kwargs` change any of it, `imbalance` say)."""
    from sim.latency.all_to_all import ExpertExchange

    args = {"num_experts": experts, "experts_per_token": 8, "hidden_size": HIDDEN,
            "dtype_bytes": 2, "fp8_dispatch": True, "num_ranks": ep, "tensor": 1,
            "imbalance": 1.0, "groups": groups, "groups_per_token": chosen, **H800}
    return ExpertExchange(backend, **{**args, **kwargs})


def normal_published_s(ep: int, dispatch_gb_s: float, combine_gb_s: float, link: str) -> float:
    """The dispatch and combine time DeepEP's normal-kernel bandwidths imply at 4,096 tokens a
    GPU, for the bytes its test counts with its routing (256 experts, a group per node, 4
    groups a token): one row per (token, GPU) over NVLink, one per (token, node, its own
    included) over RDMA."""
    from sim.latency.all_to_all import _reached

    nodes = max(ep // 8, 1)
    units = ep if link == "NVLink" else nodes
    rows_per_token = units * _reached(256, 8, units, nodes, min(nodes, 4))
    return 4096 * rows_per_token * (FP8_ROW / (dispatch_gb_s * 1e9)
                                    + BF16_ROW / (combine_gb_s * 1e9))


def _deepep_rows() -> list[str]:
    rows = []
    for ep, dispatch_us, combine_us in LOW_LATENCY_US:
        measured = (dispatch_us + combine_us) * 1e-6
        simulated = deepep_exchange("deepep_low_latency", ep, 288).layer_s(ep * 128, 128)
        rows.append(_row(f"DeepEP low latency, EP{ep}, 128 tokens/GPU", "us",
                         measured * 1e6, simulated * 1e6))
    for ep, dispatch_gb_s, combine_gb_s, link in NORMAL_GB_S:
        nodes = max(ep // 8, 1)
        measured = normal_published_s(ep, dispatch_gb_s, combine_gb_s, link)
        simulated = deepep_exchange("deepep_high_throughput", ep, 256, nodes,
                                    min(nodes, 4)).layer_s(ep * 4096, 4096)
        rows.append(_row(f"DeepEP normal, EP{ep}, 4,096 tokens/GPU ({link})", "us",
                         measured * 1e6, simulated * 1e6))
    return rows


def _step_s(ranks: int, backend: str, shape, tokens: int) -> float:
    from sim.config.scenario import parse_scenario
    from sim.engine.cluster import make_latency

    raw = {"name": "wide_ep", "seed": 0,
           "workload": {"format": "synthetic", "num_requests": 1,
                        "arrivals": {"process": "poisson", "qps": 1.0},
                        "lengths": {"prompt": {"dist": "fixed", "value": 8},
                                    "output": {"dist": "fixed", "value": 1}}},
           "replica": {"model": "deepseek-v3", "quantization": "fp8", "gpu": "h100-sxm",
                       "parallelism": {"data": ranks, "expert": ranks},
                       "scheduler": {"name": "vllm_v1"}, "engine": "none",
                       "latency": {"kind": "roofline", "all2all_backend": backend}}}
    cfg = parse_scenario(raw, "<wide_ep>").replica
    latency = make_latency(cfg, cfg.model_shape, "<wide_ep>")
    step_s, _ = latency.lockstep_time_s([shape] * ranks, [tokens] * ranks)
    return step_s


def _sglang_rows() -> list[str]:
    from sim.latency.base import BatchShape

    rows = []
    per_gpu = 16_384
    for length, measured in PREFILL_PER_NODE:
        n = per_gpu // length
        shape = BatchShape(num_prefill_tokens=per_gpu, num_prefill_seqs=n, num_sampled_tokens=n,
                           prefill_attn_pairs=n * length * (length + 1) // 2,
                           prefill_kv_tokens=per_gpu)
        simulated = 8 * per_gpu / _step_s(32, "deepep_high_throughput", shape, per_gpu)
        rows.append(_row(f"SGLang prefill, EP32, {length:,}-token prompts", "tok/s/node",
                         measured, simulated))
        if length == 4096:
            rows.append(_row("  same, SGLang's simulated perfect EPLB", "tok/s/node",
                             PREFILL_PERFECT_EPLB_4K, simulated))
    decode = BatchShape.decode_only(256, 256 * 2000)
    simulated = 8 * 256 / _step_s(64, "deepep_low_latency", decode, 256)
    rows.append(_row("SGLang decode, EP72 (servesim EP64), 256 req/GPU", "tok/s/node",
                     DECODE_PER_NODE, simulated))
    return rows


def _row(what: str, unit: str, measured: float, simulated: float) -> str:
    return (f"| {what} | {unit} | {measured:,.0f} | {simulated:,.0f} | "
            f"{(simulated - measured) / measured * 100:+.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    args = parser.parse_args()
    lines = ["servesim vs published expert-parallel figures: (servesim - published) / "
             "published, %", "",
             "| what | unit | published | servesim | error % |", "|---|---|---:|---:|---:|",
             *_deepep_rows(), *_sglang_rows()]
    report("\n".join(lines), args.out, "wide_ep.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
