"""The MoE exchange between data-parallel ranks by vLLM's `--all2all-backend`
(`sim.latency.all_to_all`): DeepEP's published kernel benchmarks reproduced, the routing
probabilities against sampled routing, low-latency rounds, the all-gather through the NICs
across nodes, and the inputs refused."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import yaml

from sim import run_scenario
from sim.config.scenario import parse_scenario
from sim.latency.all_to_all import (
    CHUNK_TOKENS,
    DEEPEP_LOW_LATENCY,
    ExpertExchange,
    _reached,
)
from tests.helpers import REPO, assert_one_line_error, run_cli

# An H100 as a scenario describes it with no network figure.
ISLAND = {"name": "island", "peak_bf16_flops": 989.4e12, "memory_bandwidth_bytes_s": 3.35e12,
          "memory_bytes": 80 * 2**30, "interconnect_bandwidth_bytes_s": 450e9}
# DeepEP's published benchmarks and the bytes they count: kept once, in the validation script.
_spec = importlib.util.spec_from_file_location("wide_ep",
                                               REPO / "validation" / "public" / "wide_ep.py")
assert _spec is not None and _spec.loader is not None
wide_ep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wide_ep)
H800 = wide_ep.H800


def _exchange(backend, ranks, num_experts=256, groups=1, groups_per_token=1, **kwargs):
    return wide_ep.deepep_exchange(backend, ranks, num_experts, groups, groups_per_token,
                                   **kwargs)


@pytest.mark.parametrize(("ep", "dispatch_us", "combine_us"), wide_ep.LOW_LATENCY_US)
def test_low_latency_kernels_take_deepeps_published_times(ep, dispatch_us, combine_us):
    """Dispatch and combine of 128 tokens per GPU within 10% of DeepEP's table at every EP
    size (one start-up and two link efficiencies fitted to all twelve figures)."""
    seconds = _exchange("deepep_low_latency", ep, num_experts=288).layer_s(ep * 128, 128)
    assert seconds == pytest.approx((dispatch_us + combine_us) * 1e-6, rel=0.10)


@pytest.mark.parametrize(("ep", "dispatch_gb_s", "combine_gb_s", "link"), wide_ep.NORMAL_GB_S)
def test_normal_kernels_move_deepeps_published_bandwidth(ep, dispatch_gb_s, combine_gb_s, link):
    """4096 tokens per GPU: the time DeepEP's bottleneck bandwidths imply for the bytes its
    test counts, within 10%."""
    nodes = max(ep // 8, 1)
    measured_s = wide_ep.normal_published_s(ep, dispatch_gb_s, combine_gb_s, link)
    exchange = _exchange("deepep_high_throughput", ep, groups=nodes,
                         groups_per_token=min(nodes, 4))
    assert exchange.layer_s(ep * 4096, 4096) == pytest.approx(measured_s, rel=0.10)


@pytest.mark.parametrize(("units", "groups", "chosen"), [
    (8, 1, 1), (64, 1, 1), (2, 8, 4), (8, 8, 4), (32, 8, 4), (64, 8, 4), (4, 8, 3)])
def test_reach_probabilities_match_sampled_routing(units, groups, chosen):
    """P(a GPU or node is reached by a token) against 40,000 sampled tokens: `chosen` of
    `groups` groups uniformly, then 8 distinct experts uniformly among theirs (uniform over
    all 256 with no groups)."""
    rng = np.random.default_rng(7)
    n, k, tokens = 256, 8, 40_000
    size = n // groups
    reached = np.zeros(units)
    for _ in range(tokens):
        picked = rng.choice(groups, chosen, replace=False)
        pool = (picked[:, None] * size + np.arange(size)).ravel()
        experts = rng.choice(pool, k, replace=False)
        reached[np.unique(experts // (n // units))] += 1
    p = _reached(n, k, units, groups, chosen)
    # (within four standard errors of the mean over units, and each unit about alike)
    assert reached.mean() / tokens == pytest.approx(p, abs=4 * math.sqrt(p * (1 - p) / tokens))


def test_low_latency_pays_a_round_per_chunk_of_the_busiest_rank():
    """A 600-token rank takes three rounds of 256 (vLLM's chunk), each with both kernels'
    start-up; the bytes go once whatever the rounds."""
    exchange = _exchange("deepep_low_latency", 16)
    start = 2 * DEEPEP_LOW_LATENCY.start_s
    assert math.ceil(600 / CHUNK_TOKENS) == 3
    assert exchange.layer_s(600 * 16, 600) == pytest.approx(
        3 * start + 600 * exchange.token_s, rel=1e-12)
    assert exchange.layer_s(256 * 16, 256) == pytest.approx(start + 256 * exchange.token_s,
                                                            rel=1e-12)
    assert exchange.layer_s(0, 0) == 0.0
    # Arrays and scalars alike, entry by entry.
    most = np.array([0, 1, 255, 256, 257, 600])
    assert exchange.layer_s(most * 16, most).tolist() == [
        exchange.layer_s(int(m) * 16, int(m)) for m in most]


def test_the_busiest_gpu_receives_its_share_times_the_imbalance():
    """A rank of 10 tokens beside ranks of 1,000: what it receives, not what it sends, sets its
    time; `expert_imbalance` scales the share received."""
    even = _exchange("deepep_high_throughput", 16)
    skewed = _exchange("deepep_high_throughput", 16, imbalance=1.5)
    total = 10 + 15 * 1000
    assert even.layer_s(total, 1000) == pytest.approx(even.start_s + 1000 * even.token_s)
    assert skewed.layer_s(total, 1000) == pytest.approx(
        even.start_s + 1.5 * total / 16 * even.token_s)


def _scenario(parallelism, latency=None, gpu="h100-sxm", num_requests=40):
    return {"name": "ep", "seed": 0,
            "workload": {"format": "synthetic", "num_requests": num_requests,
                         "arrivals": {"process": "poisson", "qps": 40.0},
                         "lengths": {"prompt": {"dist": "fixed", "value": 600},
                                     "output": {"dist": "fixed", "value": 20}}},
            "replica": {"model": "qwen3-30b-a3b", "gpu": gpu, "parallelism": parallelism,
                        "scheduler": {"name": "vllm_v1", "engine_version": "0.15.1"},
                        "latency": {"kind": "roofline", **(latency or {})}}}


def test_ranks_across_nodes_gather_through_the_nics():
    """Sixteen ranks fill two H100 nodes: the default exchange all-gathers every rank's tokens
    over the network (50 GB/s per GPU), not NVLink; DeepEP's kernels send each token only where
    its experts are and take less at 16 ranks of 64 tokens each."""
    from sim.engine.cluster import make_latency

    timed = {}
    for backend in ("allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency"):
        cfg = parse_scenario(_scenario({"data": 16, "expert": 16},
                                       {"all2all_backend": backend}), "<test>").replica
        latency = make_latency(cfg, cfg.model_shape, "<test>")
        _, timed[backend] = latency.lockstep_time_s([latency_shape()] * 16, [64] * 16)
        if backend == "allgather_reducescatter":
            tables, model = latency.tables, cfg.model_shape
            h, e = model.hidden_size, model.num_experts
            network = tables.comm.network
            expected = (network.all_gather_s(1024 * (2 * h + 2 * e), 16)
                        + network.all_gather_s(1024 * 2 * h, 16))
            assert timed[backend] == pytest.approx(float(expected), rel=1e-12)
            assert "network" in latency.describe()["communication"]["all_to_all"]
    assert timed["deepep_low_latency"] < timed["allgather_reducescatter"]
    assert timed["deepep_high_throughput"] < timed["allgather_reducescatter"]


def latency_shape():
    from sim.latency.base import BatchShape

    return BatchShape.decode_only(64, 64 * 600)


def test_a_two_node_replica_serves_with_every_backend_and_logs_its_exchange():
    """DP16 x EP16 on two nodes: every request finishes with each backend, the iteration log
    holds each step's exchange per layer, and the summary names the backend's method."""
    for backend in ("allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency"):
        res = run_scenario(parse_scenario(_scenario({"data": 16, "expert": 16},
                                                    {"all2all_backend": backend}), "<test>"))
        assert res.summary["requests"]["finished"] == 40
        assert res.summary["cost"]["num_gpus"] == 16
        assert (res.iterations["all_to_all_per_layer_s"] > 0).all()
        described = res.summary["latency_model"]["communication"]["all_to_all"]
        assert ("DeepEP" in described) == backend.startswith("deepep")


@pytest.mark.parametrize(("parallelism", "latency", "gpu", "field", "needle"), [
    ({"data": 2, "expert": 1}, {"all2all_backend": "deepep_low_latency"}, "h100-sxm",
     "replica.latency.all2all_backend", "hold whole experts"),
    ({"tensor": 2, "expert": 2}, {"all2all_backend": "deepep_high_throughput"}, "h100-sxm",
     "replica.latency.all2all_backend", "parallelism.data > 1"),
    ({"data": 12, "expert": 1}, {}, "h100-sxm", "replica.parallelism.data",
     "multiple of 8"),
    ({"data": 16, "expert": 16}, {}, ISLAND,
     "gpu.network_bandwidth_bytes_s", "span nodes"),
])
def test_what_the_exchange_cannot_time_is_refused(tmp_path, monkeypatch, capsys, parallelism,
                                                  latency, gpu, field, needle):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_scenario(parallelism, latency, gpu=gpu)))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out",
                        str(tmp_path / "o"))
    assert_one_line_error(code, err, field, needle)


def test_deepeps_buffers_come_out_of_the_kv_cache():
    """vLLM allocates DeepEP's buffers before it sizes the KV cache: 1 GiB of NVLink buffer
    (and 1 GiB of RDMA buffer across nodes) for the normal kernels; for the low-latency ones
    that and DeepEP's `LowLatencyLayout` for 256 tokens a rank (about 3.5 GiB for DeepSeek-V3's
    256 experts of hidden 7,168). Each GPU's KV blocks shrink by as many bytes."""
    from sim.engine.cluster import num_kv_blocks
    from sim.latency.all_to_all import deepep_buffer_bytes

    h, e = 7168, 256
    dispatch, combine = 16 + 2 * h, 4 * (h // 128) + 2 * h
    layout = 2 * (e * 256 * combine + e * 256 * max(dispatch, combine) + 4 * e)
    assert deepep_buffer_bytes("deepep_low_latency", hidden_size=h, num_experts=e,
                               num_gpus=16) == 2**30 + layout
    assert 3.4 < layout / 2**30 < 3.7
    assert deepep_buffer_bytes("deepep_high_throughput", hidden_size=h, num_experts=e,
                               num_gpus=8) == 2**30
    assert deepep_buffer_bytes("deepep_high_throughput", hidden_size=h, num_experts=e,
                               num_gpus=16) == 2 * 2**30
    assert deepep_buffer_bytes("allgather_reducescatter", hidden_size=h, num_experts=e,
                               num_gpus=16) == 0
    blocks = {}
    for backend in ("allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency"):
        cfg = parse_scenario(_scenario({"data": 16, "expert": 16},
                                       {"all2all_backend": backend}), "<test>").replica
        blocks[backend] = num_kv_blocks(cfg, cfg.model_shape, 0)
    model = cfg.model_shape
    block_bytes = cfg.kv_cache.block_size * cfg.parallelism.kv_bytes_per_token_per_gpu(model)
    for backend in ("deepep_high_throughput", "deepep_low_latency"):
        lost = deepep_buffer_bytes(backend, hidden_size=model.hidden_size,
                                   num_experts=model.num_experts, num_gpus=16)
        assert blocks["allgather_reducescatter"] - blocks[backend] == pytest.approx(
            lost / block_bytes, abs=1)


@pytest.mark.parametrize(("model", "fp8_dispatch"), [("deepseek-v3", True),
                                                     ("qwen3-30b-a3b", False)])
def test_only_block_fp8_checkpoints_dispatch_in_fp8(model, fp8_dispatch):
    """vLLM's DeepEP paths quantize before the dispatch for weights with 128 x 128 block scales
    (DeepSeek-V3's checkpoint) only; `quantization: fp8` of a bf16 checkpoint dispatches
    bf16."""
    from sim.engine.cluster import make_latency

    raw = _scenario({"data": 16, "expert": 16}, {"all2all_backend": "deepep_low_latency"},
                    gpu="h200")
    raw["replica"] |= {"model": model, "quantization": "fp8"}
    cfg = parse_scenario(raw, "<test>").replica
    exchange = make_latency(cfg, cfg.model_shape, "<test>").tables.exchange
    shape = cfg.model_shape
    expected = ExpertExchange(
        "deepep_low_latency", num_experts=shape.num_experts,
        experts_per_token=shape.num_experts_per_token, hidden_size=shape.hidden_size,
        dtype_bytes=2, fp8_dispatch=fp8_dispatch, num_ranks=16, tensor=1, imbalance=1.0,
        nvlink_bytes_s=450e9, network_bytes_s=50e9)
    assert exchange.token_s == expected.token_s


def _sglang_auto(backend="deepep_auto", data=16):
    raw = _scenario({"data": data, "expert": data}, {"all2all_backend": backend})
    raw["replica"]["scheduler"] = {"name": "sglang"}
    return raw


def test_sglangs_auto_mode_takes_the_normal_kernels_where_a_rank_extends():
    """SGLang's `--deepep-mode auto` resolves the kernels per step from the ranks' gathered
    `is_extend_in_batch`: a step where any of 16 ranks computes a prompt's tokens exchanges
    with the normal kernels (as `deepep_high_throughput` times it), a step where all only
    decode with the low-latency ones; on arrays row by row too. vLLM has no such mode."""
    from sim.engine.cluster import make_latency

    models = {}
    for backend in ("deepep_auto", "deepep_high_throughput", "deepep_low_latency"):
        cfg = parse_scenario(_sglang_auto(backend), "<test>").replica
        models[backend] = make_latency(cfg, cfg.model_shape, "<test>")
    auto, normal, low = (models[b] for b in ("deepep_auto", "deepep_high_throughput",
                                             "deepep_low_latency"))
    from sim.latency.base import BatchShape

    decodes = [BatchShape(num_decode_tokens=32, decode_kv_tokens=32 * 600)] * 16
    prompt = BatchShape(num_prefill_tokens=600, prefill_attn_pairs=600 * 601 // 2,
                        prefill_kv_tokens=600)
    mixed = [prompt, *decodes[1:]]
    counts_decode, counts_mixed = [32] * 16, [600] + [32] * 15
    assert auto.lockstep_time_s(decodes, counts_decode) == low.lockstep_time_s(
        decodes, counts_decode)
    assert auto.lockstep_time_s(mixed, counts_mixed) == normal.lockstep_time_s(
        mixed, counts_mixed)
    # (the kernels differ on these counts, so the test can tell them apart)
    assert low.lockstep_time_s(mixed, counts_mixed) != normal.lockstep_time_s(
        mixed, counts_mixed)
    rows = BatchShape(num_prefill_tokens=np.array([0, 600, 0]),
                      num_decode_tokens=np.array([32, 0, 8]),
                      prefill_attn_pairs=np.array([0, 600 * 601 // 2, 0]),
                      prefill_kv_tokens=np.array([0, 600, 0]),
                      decode_kv_tokens=np.array([32 * 600, 0, 8 * 600]))
    expected = np.where([False, True, False], normal.iteration_time_s(rows),
                        low.iteration_time_s(rows))
    assert auto.iteration_time_s(rows).tolist() == expected.tolist()
    described = auto.describe()["communication"]["all_to_all"]
    assert "auto" in described and "low-latency" in described and "normal" in described
    # DeepEP's buffer in auto mode: each part the larger of the two families' (16 GPUs: the
    # normal kernels' RDMA gigabyte against the low-latency layout, which is larger).
    from sim.latency.all_to_all import deepep_buffer_bytes

    sizes = {b: deepep_buffer_bytes(b, hidden_size=7168, num_experts=256, num_gpus=g)
             for b in ("deepep_auto", "deepep_high_throughput", "deepep_low_latency")
             for g in (16,)}
    assert sizes["deepep_auto"] == sizes["deepep_low_latency"] > sizes["deepep_high_throughput"]
    assert deepep_buffer_bytes("deepep_auto", hidden_size=64, num_experts=8,
                               num_gpus=16) == 2 * 2**30  # (a tiny layout: the normal RDMA)


def test_a_replica_in_auto_mode_serves_and_logs_each_steps_kernels(tmp_path, monkeypatch,
                                                                    capsys):
    """Served end to end on 16 SGLang ranks in auto mode: every request finishes; each step
    the ranks take together exchanges with the normal kernels where a rank ran a prompt's
    tokens and with the low-latency ones where all only decoded (both kinds occur), and the
    iteration log holds those times. vLLM refuses the mode, in one line."""
    from sim.latency.roofline import RooflineLatency

    steps = []
    lockstep = RooflineLatency.lockstep_time_s

    def recorded(self, shapes, counts):
        step_s, all_to_all_s = lockstep(self, shapes, counts)
        tables = self.tables
        extends = any(shape.num_prefill_tokens for shape in shapes)
        kernels = tables.exchange if extends else tables.decode_exchange
        assert all_to_all_s == kernels.layer_s(sum(counts), max(counts))
        steps.append((extends, all_to_all_s))
        return step_s, all_to_all_s

    monkeypatch.setattr(RooflineLatency, "lockstep_time_s", recorded)
    res = run_scenario(parse_scenario(_sglang_auto(), "<test>"), fast_forward=False)
    assert res.summary["requests"]["finished"] == 40
    assert {extends for extends, _ in steps} == {True, False}
    logged = set(res.iterations["all_to_all_per_layer_s"])
    assert logged <= {all_to_all_s for _, all_to_all_s in steps}
    path = tmp_path / "s.yaml"
    raw = _sglang_auto()
    raw["replica"]["scheduler"] = {"name": "vllm_v1"}
    path.write_text(yaml.safe_dump(raw))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out",
                        str(tmp_path / "o"))
    assert_one_line_error(code, err, "replica.latency.all2all_backend", "--deepep-mode auto")
