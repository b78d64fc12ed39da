"""Replicas split over GPUs: the roofline's per-GPU compute and communication, MoE weight
traffic, memory per GPU, GPU counts and cost, and models given as a config.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from sim.config.scenario import load_scenario
from sim.hardware.gpus import GPUS
from sim.hardware.models import MODELS
from sim.hardware.parallelism import Parallelism
from sim.latency import LATENCY_MODELS
from sim.latency.base import BatchShape
from sim.latency.comm import _non_decreasing, read_table
from sim.results.fingerprint import input_files
from sim.runner import run_scenario
from tests.helpers import REPO, assert_one_line_error, run_cli

NETWORK = REPO.parent / "shared" / "profiles" / "vidur" / "network"


def roofline(model: str, gpu: str = "h100-sxm", tensor: int = 1, pipeline: int = 1,
             expert: int = 1, **params):
    cls = LATENCY_MODELS.get("roofline")
    return cls(cls.Config(kind="roofline", **params), MODELS.get(model), GPUS.get(gpu),
               Parallelism(tensor=tensor, pipeline=pipeline, expert=expert))


def old_roofline_s(shape: BatchShape, model: str, gpu: str) -> float:
    """servesim's roofline before parallelism, written out as it was (mfu 0.6, mbu 0.8)."""
    m, g = MODELS.get(model), GPUS.get(gpu)
    flops_s, bytes_s = g.peak_bf16_flops * 0.6, g.memory_bandwidth_bytes_s * 0.8
    linear_params = m.num_layers * m.num_linear_params_per_layer
    linear = max(2 * linear_params / flops_s * shape.num_tokens,
                 linear_params * m.dtype_bytes / bytes_s)
    attn_pair_s = 4 * m.num_layers * m.q_size / flops_s
    kv_token_s = m.kv_bytes_per_token / bytes_s
    prefill = max(attn_pair_s * shape.prefill_attn_pairs, kv_token_s * shape.prefill_kv_tokens)
    decode = max(attn_pair_s * shape.decode_kv_tokens, kv_token_s * shape.decode_kv_tokens)
    head = max(2 * m.vocab_size * m.hidden_size / flops_s * shape.num_sampled_tokens,
               m.vocab_size * m.hidden_size * m.dtype_bytes / bytes_s
               * (shape.num_sampled_tokens > 0))
    return 0.002 + linear + prefill + decode + head


def shapes(seed: int, n: int = 200) -> list[BatchShape]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prefill = int(rng.integers(0, 4000))
        decodes = int(rng.integers(0 if prefill else 1, 256))
        cached = int(rng.integers(0, 4000))
        out.append(BatchShape(
            num_prefill_tokens=prefill, num_prefill_seqs=int(prefill > 0),
            num_decode_tokens=decodes, num_sampled_tokens=decodes + int(rng.integers(0, 2)),
            prefill_attn_pairs=prefill * cached + prefill * (prefill + 1) // 2,
            prefill_kv_tokens=(cached + prefill) * (prefill > 0),
            decode_kv_tokens=decodes * int(rng.integers(1, 8000))))
    return out


def test_one_gpu_naive_roofline_is_unchanged_bit_for_bit():
    for model, gpu in (("llama-3-8b", "h100-sxm"), ("mistral-7b", "a100-80gb")):
        latency = roofline(model, gpu, linear="naive", elementwise="none")
        for shape in shapes(1):
            assert latency.iteration_time_s(shape) == old_roofline_s(shape, model, gpu)


def test_tensor_parallel_halves_compute_per_gpu_and_adds_the_all_reduces():
    model = MODELS.get("llama-3.1-8b")
    one = roofline("llama-3.1-8b", linear="naive", elementwise="none")
    two = roofline("llama-3.1-8b", tensor=2, linear="naive", elementwise="none")
    gpu = GPUS.get("h100-sxm")
    m = 8192  # compute-bound: every GEMM's FLOPs outlast its weight bytes
    shape = BatchShape(num_prefill_tokens=m, num_prefill_seqs=1, prefill_attn_pairs=m * m,
                       prefill_kv_tokens=m)
    flops_s = gpu.peak_bf16_flops * 0.6
    linear_tp1 = 2 * m * model.num_layers * model.num_linear_params_per_layer / flops_s
    act_bytes = m * model.hidden_size * model.dtype_bytes
    # Ring all-reduce over 2 GPUs: 2(n-1)/n of the bytes at 75% of the link, 25 us to start.
    all_reduce_s = 25e-6 + act_bytes / (gpu.interconnect_bandwidth_bytes_s * 0.75)
    attn_tp1 = 4 * model.num_layers * model.q_size / flops_s * m * m
    assert one.iteration_time_s(shape) == pytest.approx(0.002 + linear_tp1 + attn_tp1, rel=1e-12)
    # Two all-reduces per layer and the vocabulary-parallel embedding's (nothing sampled: no
    # LM head, no logits to gather).
    expected_tp2 = (0.002 + linear_tp1 / 2 + (2 * model.num_layers + 1) * all_reduce_s
                    + attn_tp1 / 2)
    assert two.iteration_time_s(shape) == pytest.approx(expected_tp2, rel=1e-12)


def test_measured_all_reduce_table_is_read_for_the_group_size_and_smoothed():
    if not NETWORK.is_dir():
        pytest.skip(f"{NETWORK} is missing")
    table = read_table(NETWORK / "h100_dgx" / "all_reduce.csv", "all_reduce", 4, "t")
    assert np.all(np.diff(table.times_s) >= 0) and np.all(np.diff(table.sizes_bytes) > 0)
    # 64 MiB over 4 H100s: NCCL's median in the file is about 0.5 ms; sizes beyond carry on.
    assert 0.3e-3 < float(table(np.array([64 * 2**20]))[0]) < 0.8e-3
    assert float(table(np.array([2**28]))[0]) > float(table(np.array([2**27]))[0])
    with pytest.raises(Exception, match="no rows for 3 GPUs"):
        read_table(NETWORK / "h100_dgx" / "all_reduce.csv", "all_reduce", 3, "t")
    latency = roofline("llama-3.1-70b", tensor=4, all_reduce_table=NETWORK / "h100_dgx" /
                       "all_reduce.csv")
    bandwidth = roofline("llama-3.1-70b", tensor=4)
    decode = BatchShape.decode_only(32, 32 * 1000)
    # The tables' small messages take ~30 us like the bandwidth model's start-up: both close.
    assert latency.iteration_time_s(decode) == pytest.approx(
        bandwidth.iteration_time_s(decode), rel=0.25)


def test_pool_adjacent_violators_gives_the_non_decreasing_least_squares_fit():
    assert _non_decreasing(np.array([1.0, 3.0, 2.0, 4.0])).tolist() == [1.0, 2.5, 2.5, 4.0]
    assert _non_decreasing(np.array([3.0, 2.0, 1.0])).tolist() == [2.0, 2.0, 2.0]


def test_moe_decode_of_one_token_reads_only_the_active_experts():
    model = MODELS.get("mixtral-8x7b")
    gpu = GPUS.get("h100-sxm")
    latency = roofline("mixtral-8x7b", linear="naive", tensor=2, elementwise="none")
    bytes_s = gpu.memory_bandwidth_bytes_s * 0.8
    h, t = model.hidden_size, 2
    # One token: weight-bound everywhere. Per layer: QKV and output shards, the router, and
    # num_experts_per_token experts' gate, up and down shards; nothing of the other experts.
    q = model.num_heads // t * model.head_dim
    kv = model.num_kv_heads // t * model.head_dim
    attn = h * (q + 2 * kv) + q * h
    experts = model.num_experts_per_token * 3 * h * (model.moe_intermediate_size // t)
    per_layer_bytes = (attn + h * model.num_experts + experts) * model.dtype_bytes
    weights_s = model.num_layers * per_layer_bytes / bytes_s
    tables = latency.tables
    got = tables.tokens_s(1) - (2 * model.num_layers + 1) * tables.comm.all_reduce(
        np.array([h * model.dtype_bytes]))[0]
    assert got == pytest.approx(weights_s, rel=1e-9)
    all_experts_s = model.num_layers * model.num_experts * 3 * h * (
        model.moe_intermediate_size // t) * model.dtype_bytes / bytes_s
    assert got < all_experts_s / 2
    # A large batch reaches every expert.
    many = tables.tokens_s(4096) - (2 * model.num_layers + 1) * tables.comm.all_reduce(
        np.array([4096 * h * model.dtype_bytes]))[0]
    assert many > all_experts_s


def test_predictions_on_arrays_equal_scalar_calls_for_split_replicas():
    for kwargs in ({"tensor": 4}, {"tensor": 2, "pipeline": 2}, {"tensor": 1, "pipeline": 4}):
        latency = roofline("llama-3.1-70b", **kwargs)
        nums = np.array([1, 7, 64, 255, 5000, 9000])
        kv = nums * 1000
        vector = latency.iteration_time_s(BatchShape.decode_only(nums, kv))
        for i, n in enumerate(nums.tolist()):
            assert vector[i] == latency.iteration_time_s(BatchShape.decode_only(n, int(kv[i])))
    moe = roofline("qwen3-30b-a3b", tensor=2, expert=2)
    nums = np.array([1, 3, 200, 4097])
    vector = moe.iteration_time_s(BatchShape.decode_only(nums, nums * 10))
    assert [moe.iteration_time_s(BatchShape.decode_only(n, n * 10)) for n in nums.tolist()] \
        == vector.tolist()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


SYNTH = """\
name: split
workload:
  format: synthetic
  num_requests: 40
  arrivals: {qps: 2}
  lengths:
    prompt: {dist: uniform, low: 100, high: 2000}
    output: {dist: uniform, low: 5, high: 60}
"""


def test_a_70b_model_on_one_h100_is_refused_with_the_memory_it_needs(tmp_path, monkeypatch,
                                                                      capsys):
    path = write(tmp_path, SYNTH + "replica: {model: llama-3.1-70b, gpu: h100-sxm}\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out",
                        str(tmp_path / "out"))
    assert_one_line_error(code, err, "replica.kv_cache", "no room for KV")
    assert "131.4 GiB per GPU" in err and "72.0 GiB usable of 80.0 GiB" in err


def test_tp4_fits_and_counts_kv_per_gpu_and_gpus_and_cost(tmp_path):
    path = write(tmp_path, SYNTH + "replica: {model: llama-3.1-70b, gpu: h100-sxm, "
                                  "parallelism: {tensor: 4}}\ncluster: {replicas: 2}\n")
    scenario = load_scenario(path)
    results = run_scenario(scenario)
    model, gpu = MODELS.get("llama-3.1-70b"), GPUS.get("h100-sxm")
    free = gpu.memory_bytes * 0.9 - Parallelism(tensor=4).weight_bytes_per_gpu(model) - 2e9
    # Each GPU holds 2 of the 8 KV heads of every layer.
    assert results.summary["run"]["num_kv_blocks"] == int(
        free // (16 * model.kv_bytes_per_token / 4))
    cost = results.summary["cost"]
    assert cost["num_gpus"] == 8
    assert cost["usd_per_hour"] == pytest.approx(8 * gpu.cost_per_gpu_hour)
    thr = results.summary["throughput"]
    assert cost["requests_per_s_per_gpu"] == pytest.approx(thr["requests_per_s"] / 8)
    assert cost["usd_per_million_output_tokens"] == pytest.approx(
        8 * gpu.cost_per_gpu_hour / (thr["output_tokens_per_s"] * 3600) * 1e6)
    assert cost["usd_per_request"] == pytest.approx(
        8 * gpu.cost_per_gpu_hour / (thr["requests_per_s"] * 3600))
    assert results.summary["run"]["parallelism"] == "TP4"


@pytest.mark.parametrize(("split", "field", "words"), [
    ("{tensor: 3}", "replica.parallelism.tensor", "not divisible"),
    ("{pipeline: 200}", "replica.parallelism.pipeline", "more stages"),
    ("{expert: 2}", "replica.parallelism.expert", "dense"),
    ("{tensor: true}", "replica.parallelism.tensor", "boolean"),
])
def test_splits_the_model_does_not_allow_are_refused(tmp_path, monkeypatch, capsys, split,
                                                     field, words):
    path = write(tmp_path, SYNTH + f"replica: {{model: llama-3.1-8b, parallelism: {split}}}\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out",
                        str(tmp_path / "out"))
    assert_one_line_error(code, err, field, words)


def test_a_config_json_beside_the_scenario_is_a_model_and_an_input(tmp_path):
    config = json.loads((REPO / "sim" / "data" / "models" / "llama-3.1-8b.json").read_text())
    config["num_hidden_layers"] = 16  # a half-depth Llama: a shape no registry has
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "half.json").write_text(json.dumps(config))
    path = write(tmp_path, SYNTH + "replica: {model: models/half.json}\n")
    scenario = load_scenario(path)
    assert scenario.replica.model == tmp_path / "models" / "half.json"
    assert scenario.replica.model_shape.num_layers == 16
    assert input_files(scenario)["replica.model"] == tmp_path / "models" / "half.json"
    half = run_scenario(scenario).summary
    full = run_scenario(load_scenario(write(tmp_path, SYNTH + "replica: {model: llama-3.1-8b}\n")))
    assert half["e2e_s"]["mean"] < full.summary["e2e_s"]["mean"]


def test_a_missing_config_json_is_one_line(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, SYNTH + "replica: {model: nowhere/config.json}\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out",
                        str(tmp_path / "out"))
    assert_one_line_error(code, err, "replica.model", "config.json")


def test_a_custom_gpu_mapping_runs_and_prices(tmp_path):
    gpu = ("{name: my-gpu, peak_bf16_flops: 4.0e+14, memory_bandwidth_bytes_s: 2.0e+12, "
           "memory_bytes: 48000000000, interconnect_bandwidth_bytes_s: 3.2e+10, "
           "cost_per_gpu_hour: 1.5}")
    path = write(tmp_path, SYNTH + f"replica: {{model: llama-3.1-8b, gpu: {gpu}}}\n")
    summary = run_scenario(load_scenario(path)).summary
    assert summary["run"]["gpu"] == "my-gpu"
    assert summary["cost"]["usd_per_hour"] == 1.5
    assert math.isfinite(summary["cost"]["usd_per_million_tokens"])


def test_a_registered_gpu_with_your_own_price(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, SYNTH + "replica: {gpu: {base: h100-sxm, cost_per_gpu_hour: 2.49}}\n")
    scenario = load_scenario(path)
    spec = scenario.replica.gpu_spec
    h100 = GPUS.get("h100-sxm")
    assert (spec.name, spec.cost_per_gpu_hour) == ("h100-sxm-custom", 2.49)
    assert (spec.peak_bf16_flops, spec.memory_bytes) == (h100.peak_bf16_flops, h100.memory_bytes)
    priced = run_scenario(scenario)
    assert priced.summary["cost"]["usd_per_hour"] == 2.49
    # Only the price changed: the H100's measured kernels time it, iteration for iteration.
    named = run_scenario(load_scenario(write(tmp_path, SYNTH + "replica: {gpu: h100-sxm}\n")))
    assert priced.summary["latency_model"]["gemm_model"] == "calibrated"
    assert priced.iterations["duration_s"].equals(named.iterations["duration_s"])
    # Its own bandwidth: the H100's measurements no longer apply.
    other = run_scenario(load_scenario(write(tmp_path, SYNTH + (
        "replica: {gpu: {base: h100-sxm, memory_bandwidth_bytes_s: 4.0e+12}}\n"))))
    assert other.summary["latency_model"]["gemm_model"] == "extrapolated"
    bad = write(tmp_path, SYNTH + "replica: {gpu: {base: h100, cost_per_gpu_hour: 2.49}}\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(bad), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, "replica.gpu", "not a registered GPU")


def test_calibrated_moe_decode_pays_two_launches_per_layer_not_two_per_expert():
    model = MODELS.get("qwen3-30b-a3b")
    gpu = GPUS.get("h100-sxm")
    latency = roofline("qwen3-30b-a3b")
    tables = latency.tables
    m = 32
    moe = float(tables._moe_s(np.array([float(m)]))[0])
    # Weight bytes the layer's experts read at batch 32 (most of the 128 experts are reached),
    # at the calibrated bandwidth: the MoE time is within a small factor of it.
    reached = model.num_experts * (1 - (1 - model.num_experts_per_token / model.num_experts) ** m)
    bytes_s = tables.gemm.model.params.bytes_s
    weights_s = reached * model.expert_params * model.dtype_bytes / bytes_s
    assert weights_s < moe < 1.5 * weights_s + 4 * tables.gemm.launch_s
    # The whole iteration stays within a small factor of a dense model with more active
    # parameters per token but fewer in all (Llama-3.1-8B reads 16 GB).
    dense = roofline("llama-3.1-8b").iteration_time_s(BatchShape.decode_only(m, m * 500))
    moe_iteration = latency.iteration_time_s(BatchShape.decode_only(m, m * 500))
    assert moe_iteration < 4 * dense
    assert gpu.name == "h100-sxm"


def test_moe_with_every_expert_active_is_finite(tmp_path):
    config = json.loads((REPO / "sim" / "data" / "models" / "mixtral-8x7b.json").read_text())
    config["num_local_experts"] = config["num_experts_per_tok"] = 2
    (tmp_path / "m.json").write_text(json.dumps(config))
    from sim.hardware.models import resolve_model

    shape = resolve_model(str(tmp_path / "m.json"))
    cls = LATENCY_MODELS.get("roofline")
    latency = cls(cls.Config(kind="roofline"), shape, GPUS.get("h100-sxm"))
    times = latency.tables.tokens_s(np.arange(0, 64))
    assert np.all(np.isfinite(times)) and times[0] == 0 and np.all(np.diff(times) >= 0)


def test_uneven_widths_and_groups_beyond_a_node_are_refused():
    assert Parallelism(tensor=5).problems(MODELS.get("llama-2-13b"))  # 40 heads, MLP 13824
    llama = MODELS.get("llama-3.1-70b")
    assert [p[0] for p in Parallelism(tensor=16).problems(llama)] == ["tensor"]
    assert Parallelism(tensor=8, pipeline=2).problems(llama) == []


def test_a_shared_expert_width_that_does_not_split_is_refused(tmp_path, monkeypatch, capsys):
    """vLLM slices the shared experts' MLP over the whole tensor group (expert parallelism
    places only routed experts): its width must divide, as the others' must."""
    config = json.loads((REPO / "sim" / "data" / "models" / "llama-3.1-8b.json").read_text())
    config.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                  num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=256, shared_expert_intermediate_size=1001)
    (tmp_path / "moe.json").write_text(json.dumps(config))
    path = write(tmp_path, SYNTH + "replica: {model: moe.json, parallelism: {tensor: 2}}\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out",
                        str(tmp_path / "out"))
    assert_one_line_error(code, err, "replica.parallelism.tensor=2: ",
                          "shared_expert_intermediate_size (1001) does not split evenly over "
                          "2 GPUs")
    shape = load_scenario(write(tmp_path, SYNTH + "replica: {model: moe.json}\n")) \
        .replica.model_shape
    assert Parallelism(tensor=2, expert=2).problems(shape) == [
        ("tensor", 2, f"{shape.name}'s shared_expert_intermediate_size (1001) does not split "
                      "evenly over 2 GPUs")]
    assert Parallelism(tensor=1).problems(shape) == []
    # DeepSeek-V2-Lite's two shared experts (2 x 1408) split at every degree within a node.
    lite = MODELS.get("deepseek-v2-lite")
    assert all(Parallelism(tensor=t).problems(lite) == [] for t in (1, 2, 4, 8))


def test_a_sweep_over_splits_and_gpus_reports_gpus_and_cost_per_point(tmp_path):
    from sim.studies.sweep import run_sweep, short_value
    from sim.studies.sweep_file import load_sweep

    base = SYNTH + "replica: {model: llama-3.1-8b}\n"
    (tmp_path / "base.yaml").write_text(base)
    (tmp_path / "sweep.yaml").write_text(
        "name: splits\nbase: base.yaml\ngrid:\n  replica.parallelism.tensor: [1, 2]\n"
        "  replica.gpu: [h100-sxm, {base: h100-sxm, cost_per_gpu_hour: 2.0}]\n")
    _, runs = load_sweep(tmp_path / "sweep.yaml")
    table = run_sweep(runs, tmp_path / "out")
    assert sorted(table["num_gpus"]) == [1, 1, 2, 2]
    cheap = table["replica.gpu"] != "h100-sxm"
    assert (table.loc[cheap, "usd_per_million_tokens"].to_numpy()
            < table.loc[~cheap, "usd_per_million_tokens"].to_numpy()).all()
    assert {short_value(v) for v in table["replica.gpu"]} == {"h100-sxm", "h100-sxm-custom"}


def test_weights_per_gpu_replicate_kv_heads_beyond_the_tensor_group():
    """Qwen3-30B-A3B has 4 KV heads: at TP8 each GPU holds one KV head's K and V projections
    (vLLM's QKVParallelLinear replicates them), not half of one."""
    model = MODELS.get("qwen3-30b-a3b")  # hidden 2048, 32 heads of 128, 48 MoE layers
    # Per GPU per layer: q and o projections 2 * 2048 * (32/8 * 128) = 2,097,152; K and V of
    # one KV head 2 * 2048 * 128 = 524,288; the router 2048 * 128 = 262,144 (replicated); 128
    # experts of 3 * 2048 * (768/8) = 75,497,472; two norms 4,096: 78,385,152.
    per_layer = 2_097_152 + 524_288 + 262_144 + 75_497_472 + 4_096
    # Embedding and LM head: 151936/8 = 18,992 rows of 2048 each; the final norm 2048.
    whole = 48 * per_layer + 2 * 18_992 * 2048 + 2048
    assert whole == 3_840_280_576
    assert Parallelism(tensor=8).weight_bytes_per_gpu(model) == 2 * whole
    # Without the replication, K and V would be half of one head: 262,144 params less a layer.
    assert 2 * whole - 2 * 48 * 262_144 > model.weight_bytes / 8


def test_weights_per_gpu_of_tiny_at_tp4_and_on_one_gpu():
    tiny = MODELS.get("tiny")  # 4 layers, hidden 256, 4 heads and 2 KV heads of 64, MLP 688
    # q, o: 2 * 256 * 64; K, V of one head: 2 * 256 * 64; MLP 3 * 256 * 172; norms 512.
    per_layer = 32_768 + 32_768 + 132_096 + 512
    assert Parallelism(tensor=4).weight_bytes_per_gpu(tiny) == 2 * (
        4 * per_layer + 2 * 1024 * 256 + 256)
    for name in MODELS.names():
        model = MODELS.get(name)
        assert Parallelism().weight_bytes_per_gpu(model) == model.weight_bytes, name


def test_pipeline_stages_take_layers_as_vllm_does_and_the_busiest_bounds_weights():
    assert Parallelism(pipeline=3).stage_layers(32) == [range(0, 11), range(11, 22),
                                                       range(22, 32)]
    assert [len(r) for r in Parallelism(pipeline=4).stage_layers(30)] == [7, 8, 8, 7]
    model = MODELS.get("llama-3.1-70b")
    layer = Parallelism(pipeline=3)._layer_bytes(model, moe=False)
    table = model.vocab_size * model.hidden_size
    # Stages of 27, 27, 26 layers: the first's 27 layers and the table outweigh the last's 26
    # layers, LM head and norm.
    assert Parallelism(pipeline=3).weight_bytes_per_gpu(model) == 27 * layer + 2 * table


def test_mla_down_projections_and_routers_are_replicated():
    model = MODELS.get("deepseek-v2-lite")
    assert model.q_lora_rank is None  # its q_proj is sliced (no replicated q_a_proj)
    one, two = Parallelism(), Parallelism(tensor=2)
    kv_a = model.hidden_size * (model.kv_lora_rank + model.qk_rope_head_dim)
    # Halving every sliced matrix leaves kv_a (and the norms, the router) whole on each GPU.
    # In bytes: bf16, two per weight.
    dense, moe = ((one._layer_bytes(model, m) - 2 * two._layer_bytes(model, m)) // 2
                  for m in (False, True))
    norms = 2 * model.hidden_size + model.kv_lora_rank
    assert dense == -(kv_a + norms)
    assert moe == -(kv_a + norms + model.router_params_per_layer)


def test_mla_projections_as_vllm_splits_them_and_decode_in_the_latent():
    """DeepSeek's MLA: kv_a_proj_with_mqa (no q_lora here: one q_proj) is replicated on every
    GPU, q_proj, kv_b_proj and o_proj split by heads; decode attention works in the latent
    (vLLM's absorbed path), so a KV token costs QK over kv_lora + rope and PV over kv_lora."""
    from dataclasses import replace as with_fields

    from sim.latency.roofline import RooflineConfig, RooflineLatency

    lite = MODELS.get("deepseek-v2-lite")  # 16 heads, kv_lora 512, rope 64, nope 128, v 128
    tokens = np.array([1.0, 64.0, 512.0])
    # (in, out) of each projection on one GPU, by hand from the config (hidden 2048):
    # q_proj 2048 -> heads x (128 + 64), kv_a 2048 -> 512 + 64, kv_b 512 -> heads x (128 +
    # 128), o_proj heads x 128 -> 2048.
    shapes = {1: [(2048, 16 * 192), (2048, 576), (512, 16 * 256), (16 * 128, 2048)],
              2: [(2048, 8 * 192), (2048, 576), (512, 8 * 256), (8 * 128, 2048)]}
    for t, gemms in shapes.items():
        latency = RooflineLatency(RooflineConfig(kind="roofline"), lite, GPUS.get("h100-sxm"),
                                  Parallelism(tensor=t))
        expected = sum(latency.tables.gemm(tokens, k, n) for k, n in gemms)
        assert latency.tables._attention_gemms_s(tokens) == pytest.approx(expected, rel=1e-12)
        # A 512-token chunk after p cached tokens first up-projects their latents: kv_b_proj
        # (512 -> heads x 256) on p tokens, in each of the 27 layers, beyond its attention.
        for p in (1000, 8192):
            after, fresh = _chunk_after(p), _chunk_after(0)
            extra = (latency.iteration_time_s(after) - latency.iteration_time_s(fresh)
                     - (_prefill_attention_s(latency, after)
                        - _prefill_attention_s(latency, fresh)))
            up = 27 * float(latency.tables.gemm(np.array([float(p)]), 512, 16 // t * 256)[0])
            assert extra == pytest.approx(up, rel=1e-9)
    # A GPU with bandwidth to spare: decode attention is its FLOPs, the absorbed path's.
    fast = with_fields(GPUS.get("h100-sxm"), memory_bandwidth_bytes_s=1e18)
    latency = RooflineLatency(RooflineConfig(kind="roofline"), lite, fast)
    flops_s = fast.peak_bf16_flops * RooflineConfig(kind="roofline").mfu
    per_pair = 2 * 16 * (512 + 64) + 2 * 16 * 512
    assert latency.decode_kv_token_s == pytest.approx(27 * per_pair / flops_s, rel=1e-12)
    assert per_pair > lite.attn_flops_per_pair_per_layer  # prefill's pairs stay unabsorbed


def _chunk_after(cached: int) -> BatchShape:
    """A 512-token prefill chunk after `cached` tokens of its prompt."""
    return BatchShape(512, 1, 0, 1, 512 * cached + 512 * 513 // 2, cached + 512, 0)


def _prefill_attention_s(latency, shape: BatchShape) -> float:
    return max(latency.attn_pair_s * shape.prefill_attn_pairs,
               latency.kv_token_s * shape.prefill_kv_tokens)


def test_stages_fill_nodes_in_order_and_hand_offs_between_them_cross_the_network():
    assert [Parallelism(tensor=t, pipeline=p).num_cross_node_handoffs
            for t, p in ((4, 2), (8, 2), (4, 4), (8, 4), (2, 8), (1, 16))] == [0, 1, 1, 3, 1, 1]
    model, h = MODELS.get("llama-3.1-70b"), MODELS.get("llama-3.1-70b").hidden_size
    m = np.array([1.0, 512.0, 8192.0])
    hand_off = 2 * m * h * model.dtype_bytes  # hidden states and residual, as vLLM sends them
    # One node (TP4 x PP2): each of the 4 GPUs sends its quarter over NVLink, the next stage
    # all-gathers; added to the TP4 replica's linear-layer terms, nothing else.
    flat, piped = roofline("llama-3.1-70b", tensor=4), roofline("llama-3.1-70b", tensor=4,
                                                                 pipeline=2)
    comm = piped.tables.comm
    expected = (8e-6 + hand_off / 4 / (450e9 * 0.75)) + comm.all_gather(hand_off)
    assert piped.tables.tokens_s(m) - flat.tables.tokens_s(m) == pytest.approx(expected,
                                                                                rel=1e-9)
    # Two nodes (TP8 x PP2): the hand-off crosses a 400 Gb/s NIC per GPU, after 17 us.
    two_nodes = roofline("llama-3.1-70b", tensor=8, pipeline=2).tables.comm
    assert two_nodes.pipeline_handoffs(hand_off / 8) == pytest.approx(
        17e-6 + hand_off / 8 / (50e9 * 0.75), rel=1e-12)
    # Measured: the send/recv table's rows across nodes (devices_per_node 1), not NVLink's.
    table = NETWORK / "h100_dgx" / "send_recv.csv"
    measured = roofline("llama-3.1-70b", tensor=8, pipeline=2, send_recv_table=table)
    across = read_table(table, "send_recv", 2, "t", cross_node=True)
    assert measured.tables.comm.pipeline_handoffs(hand_off / 8) == pytest.approx(
        across(hand_off / 8), rel=1e-12)
    assert across(np.array([64e6]))[0] > 5 * read_table(table, "send_recv", 2, "t")(
        np.array([64e6]))[0]


def test_a_pipeline_across_nodes_needs_the_gpus_network(tmp_path, monkeypatch, capsys):
    gpu = ("{name: my-h100, peak_bf16_flops: 9.894e+14, memory_bandwidth_bytes_s: 3.35e+12, "
           "memory_bytes: 8.589934592e+10, interconnect_bandwidth_bytes_s: 4.5e+11}")
    path = write(tmp_path, SYNTH + f"replica: {{model: llama-3.1-70b, gpu: {gpu}, "
                                   "parallelism: {tensor: 8, pipeline: 2}}\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out",
                        str(tmp_path / "out"))
    assert_one_line_error(code, err, "replica.gpu", "network_bandwidth_bytes_s", "16 GPUs")
    # In one node the same GPU is enough; with `base` the registered GPU's NIC carries over.
    path = write(tmp_path, SYNTH + f"replica: {{model: llama-3.1-70b, gpu: {gpu}, "
                                   "parallelism: {tensor: 4, pipeline: 2}}\n")
    assert run_scenario(load_scenario(path)).summary["requests"]["finished"] > 0
    path = write(tmp_path, SYNTH + "replica: {model: llama-3.1-70b, gpu: {base: h100-sxm, "
                                   "cost_per_gpu_hour: 2.0}, parallelism: {tensor: 8, "
                                   "pipeline: 2}}\n")
    assert run_scenario(load_scenario(path)).summary["requests"]["finished"] > 0
