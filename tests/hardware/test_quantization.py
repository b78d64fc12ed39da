"""`quantization: fp8` (vLLM's --quantization fp8): the linear layers' weights in one byte each,
their math at the GPU's fp8 peak where it has one (W8A8) and at the bf16 rate where it does not
(W8A16); the embedding table, the LM head, norms and MoE routers stay in the model's dtype."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from sim.engine.cluster import kv_cache_for, make_latency
from sim.hardware.gpus import GPUS, resolve_gpu
from sim.latency.gemm import GemmModel
from sim.runner import run_scenario
from tests.helpers import REPO, requires_torch


def replica_cfg(model: str = "llama-3.1-8b", gpu: str = "h100-sxm", tensor: int = 1,
                **extra: object):
    data = {"name": "q", "seed": 0,
            "workload": {"format": "synthetic", "num_requests": 30,
                         "arrivals": {"process": "poisson", "qps": 5},
                         "lengths": {"prompt": {"dist": "fixed", "value": 500},
                                     "output": {"dist": "fixed", "value": 20}}},
            "replica": {"model": model, "gpu": gpu, "parallelism": {"tensor": tensor},
                        **extra}}
    return parse_scenario(data, "test")


def test_weight_bytes_by_hand() -> None:
    shape = replica_cfg(quantization="fp8").replica.model_shape
    bf16 = replica_cfg().replica.model_shape
    h, vocab, layers = 4096, 128_256, 32
    kept = 2 * vocab * h + (2 * layers + 1) * h  # embedding, LM head, norms
    assert shape.num_unquantized_params == kept
    assert shape.weight_bytes == (bf16.num_params - kept) * 1 + kept * 2
    # About 9.08 GB, as the fp8 checkpoints of Llama-3.1-8B weigh; bf16 16.06 GB.
    assert shape.weight_bytes == pytest.approx(9.08e9, rel=0.002)
    assert bf16.weight_bytes == 2 * bf16.num_params
    # Per GPU, one GPU: the same bytes (the vocabulary is a multiple of 64).
    cfg = replica_cfg(quantization="fp8").replica
    assert cfg.parallelism.weight_bytes_per_gpu(shape) == shape.weight_bytes



def test_deepseek_v3_runs_as_fp8_and_its_weights_per_gpu_at_dp8_ep8() -> None:
    """The committed DeepSeek-V3 config.json is its fp8 checkpoint's: refused in bf16; at DP8 x
    EP8 (one GPU a rank, 32 of the 256 routed experts on each) every GPU holds the whole
    attention, the dense MLPs, the shared expert, the embedding table and the LM head."""
    with pytest.raises(InputError, match="an fp8 checkpoint: set replica.quantization: fp8"):
        replica_cfg("deepseek-v3", "h200")
    wide = {"tensor": 1, "data": 8, "expert": 8}
    cfg = replica_cfg("deepseek-v3", "h200", quantization="fp8", parallelism=wide).replica
    shape = cfg.model_shape
    h, vocab = 7168, 129_280
    attention = 187_105_280  # q_a, q_b, kv_a, kv_b, o (test_mla_attention_by_hand)
    norms = 2 * h + 512 + 1536  # two RMSNorms, the kv_a and q_a latents' norms
    dense = attention + 3 * h * 18_432
    moe = attention + (32 + 1) * 3 * h * 2048  # 32 routed experts and the shared one
    fp8 = 3 * dense + 58 * moe
    # Norms, routers, the table, the LM head and the final norm, in bf16.
    bf16 = 61 * norms + 58 * h * 256 + 2 * vocab * h + h
    assert cfg.parallelism.weight_bytes_per_gpu(shape) == fp8 + 2 * bf16 == 100_817_025_024
    # 94 of the H200's 141 GiB.
    assert (fp8 + 2 * bf16) / GPUS.get("h200").memory_bytes == pytest.approx(0.666, abs=0.001)


def test_moe_routers_stay_in_the_models_dtype() -> None:
    shape = replica_cfg("mixtral-8x7b", quantization="fp8").replica.model_shape
    routers = shape.num_moe_layers * shape.router_params_per_layer
    assert routers == 32 * 4096 * 8
    kept = shape.embedding_params + shape.norm_params + routers
    assert shape.weight_bytes == (shape.num_params - kept) + 2 * kept
    # A token reads its two experts' weights of eight, at one byte each.
    idle = 32 * 6 * shape.expert_params
    assert shape.active_weight_bytes == shape.weight_bytes - idle


def test_fp8_fits_llama_70b_on_one_h100_where_bf16_does_not() -> None:
    with pytest.raises(InputError, match="no room for KV"):
        cfg = replica_cfg("llama-3.1-70b").replica
        kv_cache_for(cfg, cfg.model_shape)
    cfg = replica_cfg("llama-3.1-70b", quantization="fp8").replica
    assert cfg.model_shape.weight_bytes / 2**30 == pytest.approx(67.7, abs=0.1)
    assert kv_cache_for(cfg, cfg.model_shape).num_blocks > 0


def test_an_fp8_gemm_streams_one_byte_weights_at_the_fp8_peak() -> None:
    h100, a100 = GPUS.get("h100-sxm"), GPUS.get("a100-80gb")
    base = GemmModel.for_gpu(h100)
    w8a8 = base.fp8(h100)
    assert (w8a8.weight_bytes, w8a8.input_bytes, w8a8.output_bytes) == (1, 1, 2)
    assert w8a8.params.flops_s == base.params.flops_s * 1979e12 / 989.4e12
    assert w8a8.params.bytes_s == base.params.bytes_s
    assert w8a8.form == "extrapolated" and w8a8.correction is None
    # A100: no fp8 math; weights at one byte, activations in bf16, the bf16 rate.
    w8a16 = GemmModel.for_gpu(a100).fp8(a100)
    assert (w8a16.weight_bytes, w8a16.input_bytes) == (1, 2)
    assert w8a16.params.flops_s == GemmModel.for_gpu(a100).params.flops_s
    # One token through a 4096 x 14336 projection: memory-bound, half the bytes of bf16 past
    # the launch; 4096 tokens: compute-bound, about half the time.
    smooth = GemmModel.for_gpu(h100, correction=False)
    k, n = 4096, 14336
    t0 = base.params.launch_s
    assert (w8a8.time_s(1, k, n) - t0) / (smooth.time_s(1, k, n) - t0) == pytest.approx(
        0.5, abs=0.01)
    assert w8a8.time_s(4096, k, n) / smooth.time_s(4096, k, n) == pytest.approx(0.5, abs=0.05)
    assert w8a8.time_s(0, k, n) == 0.0
    # The naive form stays naive: weights k n bytes at mbu of bandwidth, or FLOPs at the peak.
    naive = GemmModel.naive(h100).fp8(h100)
    assert naive.form == "naive"
    assert naive.time_s(1, k, n) == k * n * 1.0 / (h100.memory_bandwidth_bytes_s * 0.8)
    assert naive.time_s(8192, k, n) == 2.0 * 8192 * k * n / (1979e12 * 0.6)


@pytest.mark.parametrize("linear", ["calibrated", "naive"])
def test_the_lm_head_keeps_the_models_dtype(linear: str) -> None:
    """Only the linear layers change: the rows sampled cost what they cost in bf16."""
    plain, fp8 = (replica_cfg(latency={"kind": "roofline", "linear": linear}, **q).replica
                  for q in ({}, {"quantization": "fp8"}))
    t_plain = make_latency(plain, plain.model_shape, "test").tables
    t_fp8 = make_latency(fp8, fp8.model_shape, "test").tables
    rows = np.arange(0, 300, dtype=np.float64)
    assert np.array_equal(t_fp8._sampled_s(rows), t_plain._sampled_s(rows))
    tokens = np.array([1.0, 64.0, 4096.0])
    assert np.all(t_fp8._linear_s(tokens) < t_plain._linear_s(tokens))


def test_a_run_says_how_its_weights_were_timed() -> None:
    full = run_scenario(replica_cfg(quantization="fp8")).summary
    summary = full["latency_model"]
    assert summary["quantization"] == "fp8 linear layers, W8A8 at the GPU's fp8 peak"
    assert "not measured" in summary["gemm_source"]
    assert full["run"]["precision"] == "fp8 weights"
    plain = run_scenario(replica_cfg()).summary
    assert "quantization" not in plain["latency_model"] and "precision" not in plain["run"]
    both = run_scenario(replica_cfg(quantization="fp8", kv_cache={"dtype": "fp8"})).summary
    assert both["run"]["precision"] == "fp8 weights, fp8 KV"
    a100 = run_scenario(replica_cfg(gpu="a100-80gb", quantization="fp8")).summary
    assert a100["latency_model"]["quantization"].endswith("W8A16 (no fp8 math on this GPU)")


def test_a_custom_gpu_gives_its_fp8_peak_or_inherits_it() -> None:
    assert resolve_gpu({"base": "h100-sxm", "cost_per_gpu_hour": 2.0}).peak_fp8_flops == 1979e12
    own = resolve_gpu({"name": "mine", "peak_bf16_flops": 4e14, "peak_fp8_flops": 8e14,
                       "memory_bandwidth_bytes_s": 2e12, "memory_bytes": 4.8e10,
                       "interconnect_bandwidth_bytes_s": 6.4e10})
    assert own.peak_fp8_flops == 8e14
    with pytest.raises(ValueError, match="peak_fp8_flops"):
        resolve_gpu({"base": "h100-sxm", "peak_fp8_flops": 1979})  # TFLOP/s for FLOP/s


@requires_torch
def test_what_measured_weights_in_bf16_refuses_fp8() -> None:
    from profiler.replay.serve import check_replayable

    sc = replica_cfg("tiny", quantization="fp8",
                     latency={"kind": "profile", "path": str(REPO / "profiles" /
                                                             "cpu_tiny.json")})
    with pytest.raises(InputError) as info:
        run_scenario(sc)
    assert info.value.problems[0][0] == "replica.quantization"
    with pytest.raises(InputError, match="replay runs the model's weights in the model's dtype"):
        check_replayable(replica_cfg(quantization="fp8"))


def test_an_fp8_checkpoint_runs_only_as_fp8(tmp_path: Path) -> None:
    """A config.json whose quantization_config says fp8 (as Meta's and NVIDIA's fp8 releases
    of Llama-3.1 say): vLLM loads it quantized, so a bf16 replica of it is refused (its weights
    would count twice their size); with `quantization: fp8` it is the registered model in fp8."""
    import json

    config = json.loads((REPO / "sim" / "data" / "models" / "llama-3.1-8b.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    path = tmp_path / "Llama-3.1-8B-FP8" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    with pytest.raises(InputError) as info:
        replica_cfg(str(path))
    assert info.value.problems[0][0] == "replica.model"
    assert "an fp8 checkpoint: set replica.quantization: fp8" in str(info.value)
    shape = replica_cfg(str(path), quantization="fp8").replica.model_shape
    assert shape.weight_bytes == replica_cfg(quantization="fp8").replica.model_shape.weight_bytes
