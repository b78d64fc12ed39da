"""Data-parallel ranks of an MoE model in lockstep (`replica.parallelism.data`, vLLM's
`--data-parallel-size`, with `--enable-expert-parallel` or each expert sliced over the ranks):
times worked out by hand on a linear latency model (a prompt on one rank stretches the other's
decode step; dummy batches while one rank is idle, and after all are, until the ranks' next
check), vLLM's load balancer, the roofline's lockstep step (every rank's tokens through each
MoE layer's routed experts, and the exchange; router and shared experts on a rank's own), GPU
counts and cost, and the inputs refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from sim import run_scenario
from sim.config.scenario import parse_scenario
from sim.core.request import Request, Status
from sim.engine.cluster import Cluster
from sim.engine.data_parallel import DataParallelGroup
from sim.latency.base import BatchShape
from sim.routers.base import ReplicaLoad
from sim.routers.vllm_dp import VllmDataParallel, VllmDataParallelConfig
from tests.engine.test_fast_path import assert_same_results
from tests.helpers import assert_one_line_error, run_cli
from tests.strategies import assert_nothing_lost, data_parallel_clusters, scenarios

BASE_S, PER_TOKEN_S = 0.01, 1e-5


def _scenario(version="0.15.1", async_scheduling=False, data=2, **replica):
    return parse_scenario({
        "name": "dp", "seed": 0,
        "workload": {"format": "synthetic", "num_requests": 1,
                     "arrivals": {"process": "poisson", "qps": 1.0},
                     "lengths": {"prompt": {"dist": "fixed", "value": 1},
                                 "output": {"dist": "fixed", "value": 1}}},
        "replica": {"model": "qwen3-30b-a3b",
                    "parallelism": {"data": data, "expert": data},
                    "scheduler": {"name": "vllm_v1", "async_scheduling": async_scheduling,
                                  "engine_version": version},
                    "latency": {"kind": "linear", "base_s": BASE_S, "per_token_s": PER_TOKEN_S},
                    **replica}}, "<test>")


def _times(cluster, req):
    """When `req`'s tokens came out: the ends of the iterations its rank sampled it in."""
    log = cluster.replicas[req.replica_id].log
    ids, iterations = log.sampled_tokens()
    return log.output_s()[iterations[ids == req.request_id]]


def _gaps(cluster, req):
    return np.diff(_times(cluster, req))


def test_a_prompt_on_one_rank_stretches_the_other_ranks_decode_step():
    """A (8-token prompt, 20 tokens out) runs on rank 0; B (1,000-token prompt) arrives at 50 ms
    and goes to rank 1 (vLLM 0.15's score 4 x waiting + running: rank 0 has A). Every step is
    the slower rank's: A's decode beside rank 1's dummy batch takes 10 ms + 1 token (10.01
    ms); beside B's prompt (1,000 tokens, more than a CUDA graph takes: unpadded) 20 ms."""
    cluster = Cluster(_scenario(), fast_forward=False)
    a = Request(0, 0.0, 8, 20)
    b = Request(1, 0.050, 1000, 2)
    cluster.run([a, b])
    assert [r.status for r in (a, b)] == [Status.FINISHED] * 2
    assert (a.replica_id, b.replica_id) == (0, 1)
    gaps = _gaps(cluster, a)
    decode_s, prompt_s = BASE_S + PER_TOKEN_S, BASE_S + 1000 * PER_TOKEN_S
    assert max(gaps) == pytest.approx(prompt_s, abs=1e-12)
    assert sorted(gaps)[:-1] == pytest.approx([decode_s] * (len(gaps) - 1), abs=1e-12)
    # A's prompt (8 tokens) and rank 1's dummy: 10.08 ms; then A's decodes, each 10.01 ms; B
    # is scheduled at the first step start after its arrival.
    first_s = BASE_S + 8 * PER_TOKEN_S
    starts = [first_s + k * decode_s for k in range(10)]
    b_start = next(s for s in starts if s >= 0.050)
    assert _times(cluster, b)[0] == pytest.approx(b_start + prompt_s, abs=1e-12)
    # Two engines of their own instead (vLLM's dense models): no step of A waits for B's.
    apart = parse_scenario({**_raw(), "replica": {**_raw()["replica"],
                                                  "parallelism": {"data": 1}},
                            "cluster": {"replicas": 2, "router": {"name": "vllm_dp"}}},
                           "<test>")
    cluster = Cluster(apart, fast_forward=False)
    a, b = Request(0, 0.0, 8, 20), Request(1, 0.050, 1000, 2)
    cluster.run([a, b])
    assert a.finish_s == pytest.approx(first_s + 19 * decode_s, abs=1e-12)


def test_noise_scales_each_lockstep_step_once_for_every_rank():
    """With lognormal noise each lockstep step takes its noiseless time times the group's draw
    for that step (the first rank's stream, by step count; its regime from every rank's
    tokens, an idle rank's dummy decode included): A alone on rank 0, its prompt step mixed,
    then decodes. With B on rank 1 too, both ranks log the same times for a step."""
    from sim.latency.noise import IterationNoise, NoiseConfig

    noise = {"kind": "lognormal", "sigma": 0.2}

    def logs(kind, requests):
        cluster = Cluster(_scenario(latency={"kind": "linear", "base_s": BASE_S,
                                             "per_token_s": PER_TOKEN_S,
                                             **({"noise": noise} if kind else {})}),
                          fast_forward=False)
        cluster.run(requests)
        assert all(r.status is Status.FINISHED for r in requests)
        return [cluster.replicas[i].log for i in (0, 1)]

    plain, noisy = logs(None, [Request(0, 0.0, 8, 20)])[0], logs("lognormal", [
        Request(0, 0.0, 8, 20)])[0]
    assert len(plain) == len(noisy) == 20
    draws = IterationNoise(NoiseConfig(**noise), 0, 0)
    prefill = plain.columns["num_prefill_tokens"]
    factors = [draws.factor(i, int(prefill[i]), 1) for i in range(20)]
    assert np.asarray(noisy.columns["duration_s"]) == pytest.approx(
        np.asarray(plain.columns["duration_s"]) * factors, rel=1e-12)
    assert not np.allclose(noisy.columns["duration_s"], plain.columns["duration_s"])
    rank0, rank1 = logs("lognormal", [Request(0, 0.0, 8, 20), Request(1, 0.050, 400, 4)])
    times0 = dict(zip(rank0.columns["start_s"], rank0.columns["duration_s"], strict=True))
    both = [(s, d) for s, d in zip(rank1.columns["start_s"], rank1.columns["duration_s"],
                                   strict=True) if s in times0]
    assert len(both) == len(rank1) and all(times0[s] == d for s, d in both)


@pytest.mark.parametrize(("version", "padding", "pads_prompt_step", "backend"), [
    ("0.15.1", None, True, "allgather_reducescatter"),
    ("0.15.1", "graph_steps", False, "allgather_reducescatter"),
    ("0.33.0", None, False, "allgather_reducescatter"),
    ("0.33.0", "every_step", True, "allgather_reducescatter"),
    ("0.15.1", None, False, "deepep_high_throughput"),
    ("0.33.0", "every_step", False, "deepep_high_throughput"),
    ("0.15.1", None, True, "deepep_low_latency")])
def test_vllm_0_15_pads_every_step_to_the_busiest_rank(version, padding, pads_prompt_step,
                                                       backend):
    """vLLM 0.15.1 pads every rank's step to the largest rank's token count wherever CUDA
    graphs are configured, eager steps too (`allow_dp_padding = cudagraph_mode != NONE`);
    from 0.19 only steps that fit a graph are. So beside B's 1,000-token prompt, A's decode
    rank runs 1,000 tokens through its layers on 0.15.1 (and both ranks' 2,000 through the
    MoE layers), 1 on 0.33.0 (1,001 through the MoE layers). DeepEP's normal kernels turn
    CUDA graphs off (cudagraph_mode NONE), so no step is padded; its low-latency ones keep
    them."""
    from sim.engine.cluster import make_latency

    scheduler = {"name": "vllm_v1", "async_scheduling": False, "engine_version": version,
                 **({"data_parallel_padding": padding} if padding else {})}
    scenario = _scenario(version=version, scheduler=scheduler,
                         latency={"kind": "roofline", "all2all_backend": backend})
    cluster = Cluster(scenario, fast_forward=False)
    a, b = Request(0, 0.0, 8, 20), Request(1, 0.050, 1000, 2)
    cluster.run([a, b])
    assert (a.replica_id, b.replica_id) == (0, 1)
    cfg = scenario.replica
    latency = make_latency(cfg, cfg.model_shape, "<test>")
    prompt = BatchShape(num_prefill_tokens=1000, num_prefill_seqs=1, num_sampled_tokens=1,
                        prefill_attn_pairs=1000 * 1001 // 2, prefill_kv_tokens=1000)
    decode = BatchShape.decode_only(1, 8 + 5)  # (A's KV where B's prompt runs; immaterial)
    padded_s, _ = latency.lockstep_time_s([decode, prompt], [1000, 1000])
    own_s, _ = latency.lockstep_time_s([decode, prompt], [1, 1000])
    if backend == "allgather_reducescatter":  # (its exchange grows with every rank's tokens)
        assert padded_s > own_s * 1.02  # (Qwen3-30B-A3B: the prompt's rank sets most of it)
    group = cluster.replicas[0].group
    assert (group.pad_limit > 0) == (backend != "deepep_high_throughput")
    longest = max(_gaps(cluster, a))
    assert longest == pytest.approx(padded_s if pads_prompt_step else own_s, rel=0.004)


def _raw():
    return {"name": "dp", "seed": 0,
            "workload": {"format": "synthetic", "num_requests": 3,
                         "arrivals": {"process": "poisson", "qps": 1.0},
                         "lengths": {"prompt": {"dist": "fixed", "value": 8},
                                     "output": {"dist": "fixed", "value": 4}}},
            "replica": {"model": "qwen3-30b-a3b",
                        "scheduler": {"name": "vllm_v1", "async_scheduling": False},
                        "latency": {"kind": "linear", "base_s": BASE_S,
                                    "per_token_s": PER_TOKEN_S}}}


@pytest.mark.parametrize(("version", "checked_every"), [("0.15.1", 32), ("0.33.0", 16)])
def test_idle_ranks_run_dummy_batches_until_the_ranks_next_check(version, checked_every):
    """A alone (5 tokens out: 5 steps) on rank 0: rank 1 runs a dummy batch in each; then both
    run dummies until the step count reaches the next check that every rank is idle (vLLM
    0.15-0.19: every 32 steps; 0.33: every 16). C, arriving during those, starts when the
    dummy step in progress ends."""
    cluster = Cluster(_scenario(version), fast_forward=False)
    (group,) = cluster.front
    assert isinstance(group, DataParallelGroup)
    a = Request(0, 0.0, 8, 5)
    cluster.run([a])
    trailing = checked_every - 5
    assert group.num_dummy_forwards == 5 + 2 * trailing
    step_s = BASE_S + PER_TOKEN_S  # a dummy (one token) or a decode, beside a dummy
    first_s = BASE_S + 8 * PER_TOKEN_S
    assert a.finish_s == pytest.approx(first_s + 4 * step_s, abs=1e-12)
    # C arrives 2.5 steps after A's finish: it waits for the third dummy step to end.
    cluster = Cluster(_scenario(version), fast_forward=False)
    a = Request(0, 0.0, 8, 5)
    c_arrival = first_s + 4 * step_s + 2.5 * step_s
    c = Request(1, c_arrival, 8, 1)
    cluster.run([a, c])
    assert _times(cluster, c)[0] == pytest.approx(first_s + 7 * step_s + first_s, abs=1e-12)


def test_async_ranks_finish_everything_and_log_each_step_once():
    """With async scheduling (two steps in flight, as vLLM keeps them) on a random workload:
    every request finished, each rank's iterations in time order, each step's ranks sharing
    its start and end."""
    raw = _raw()
    raw["workload"] = {"format": "synthetic", "num_requests": 60,
                       "arrivals": {"process": "poisson", "qps": 40.0},
                       "lengths": {"prompt": {"dist": "uniform", "low": 10, "high": 900},
                                   "output": {"dist": "uniform", "low": 1, "high": 60}}}
    raw["replica"] = {**raw["replica"], "parallelism": {"data": 2, "expert": 2},
                      "scheduler": {"name": "vllm_v1"}}
    res = run_scenario(parse_scenario(raw, "<test>"))
    req = res.requests
    assert (req["status"] == "finished").all()
    assert set(req["replica_id"]) == {0, 1}
    it = res.iterations
    for _, rank in it.groupby("replica_id"):
        assert (np.diff(rank["start_s"].to_numpy()) > 0).all()
    # The ranks' steps: where both ran one at an instant, the same end.
    ends = it.assign(end=it["start_s"] + it["duration_s"]).groupby("start_s")["end"].nunique()
    assert (ends == 1).all()
    assert res.summary["cost"]["num_gpus"] == 2
    facts = res.summary["data_parallel"]
    assert facts["ranks_per_replica"] == 2 and facts["num_dummy_forwards"] > 0


def test_the_roofline_times_each_moe_layer_on_every_ranks_tokens():
    """Qwen3-30B-A3B on two H100s, one rank each, experts split between them: a rank alone
    (`iteration_time_s`) is timed as if the other ran the same batch; the lockstep step is the
    slowest rank's own part plus each MoE layer on all tokens, and the exchange is an
    all-gather of hidden states and router logits and a reduce-scatter of hidden states."""
    from sim.engine.cluster import make_latency

    scenario = _scenario(latency={"kind": "roofline"})
    cfg = scenario.replica
    latency = make_latency(cfg, cfg.model_shape, "<test>")
    decode = BatchShape.decode_only(64, 64 * 1000)
    prompt = BatchShape(num_prefill_tokens=700, num_prefill_seqs=1, num_sampled_tokens=1,
                        prefill_attn_pairs=700 * 701 // 2, prefill_kv_tokens=700)
    step_s, exchange_s = latency.lockstep_time_s([decode, decode], [64, 64])
    assert step_s == latency.iteration_time_s(decode)
    # The prompt's rank sets the pace; the MoE layers take both ranks' tokens.
    mixed_s, _ = latency.lockstep_time_s([decode, prompt], [64, 700])
    assert step_s < mixed_s < latency.lockstep_time_s([prompt, prompt], [700, 700])[0]
    tables = latency.tables
    model = cfg.model_shape
    h, e = model.hidden_size, model.num_experts
    bandwidth = tables.comm.bandwidth
    expected = (bandwidth.all_gather_s(128 * (h * 2 + e * 2), 2)
                + bandwidth.all_gather_s(128 * h * 2, 2))
    assert exchange_s == pytest.approx(float(expected), rel=1e-12)
    assert exchange_s > 0
    # Half the experts on each GPU: both ranks' 128 tokens through the MoE layers take less
    # than on one GPU holding every expert (a rank's own terms, `tokens_s`, hold no MoE layer;
    # one GPU's hold them all).
    alone = make_latency(_scenario(data=1, latency={"kind": "roofline"}).replica,
                         model, "<test>")
    one_gpu_moe_s = float(alone.tables.tokens_s(128)) - float(tables.tokens_s(128))
    assert 0 < float(tables.moe_s(128)) < one_gpu_moe_s


@pytest.mark.parametrize(("parallelism", "num_gpus"), [
    ({"data": 4, "tensor": 2, "expert": 8}, 8),
    ({"data": 2, "tensor": 2, "expert": 1}, 4)],  # (experts sliced over the ranks)
    ids=["expert-parallel", "sliced"])
def test_a_data_parallel_replica_counts_and_prices_every_ranks_gpus(parallelism, num_gpus):
    raw = _raw()
    raw["replica"] = {**raw["replica"], "gpu": "h100-sxm", "parallelism": parallelism,
                      "latency": {"kind": "roofline"}}
    res = run_scenario(parse_scenario(raw, "<test>"))
    from sim.hardware.gpus import GPUS

    assert res.summary["requests"]["finished"] == raw["workload"]["num_requests"]
    assert res.summary["cost"]["num_gpus"] == num_gpus
    assert res.summary["cost"]["usd_per_hour"] == pytest.approx(
        num_gpus * GPUS.get("h100-sxm").cost_per_gpu_hour)
    assert "all_to_all_per_layer_s" in res.iterations.columns
    assert (res.iterations["all_to_all_per_layer_s"] > 0).all()


def _tables(model, latency, **parallelism):
    """The roofline's tables of `model` on H100s split so (its latency fields `latency`)."""
    from sim.engine.cluster import make_latency

    cfg = _scenario(latency={"kind": "roofline", **latency}, model=model,
                    parallelism=parallelism).replica
    return make_latency(cfg, cfg.model_shape, "<test>").tables


def test_experts_sliced_over_every_ranks_gpus_hold_and_cost_what_whole_ones_do():
    """`expert: 1` with ranks (vLLM's default, no --enable-expert-parallel): every GPU holds a
    1/(data x tensor) slice of every expert, the same bytes as E/(data x tensor) whole
    experts; attention and shared experts stay split over a rank's own GPUs. On the datasheet
    roofline (each GEMM the longer of its FLOPs and its bytes) the routed experts take the
    same time either way: twice the experts at half the width."""
    from sim.hardware.models import MODELS
    from sim.hardware.parallelism import Parallelism

    model = MODELS.get("qwen3-30b-a3b")
    sliced, whole = Parallelism(data=2, expert=1), Parallelism(data=2, expert=2)
    assert (sliced.expert_ways, whole.expert_ways) == (2, 1)
    assert sliced.problems(model) == [] and whole.problems(model) == []
    assert sliced.weight_bytes_per_gpu(model) == whole.weight_bytes_per_gpu(model)
    assert Parallelism(data=2, tensor=2, expert=1).expert_ways == 4
    # DeepSeek-V2-Lite's experts are 1,408 wide: sliced 8 ways, not 3 (vLLM asserts it).
    lite = MODELS.get("deepseek-v2-lite")
    assert Parallelism(data=8, expert=1).problems(lite) == []
    assert Parallelism(data=3, expert=1).problems(lite) == [
        ("data", 3, "deepseek-v2-lite's moe_intermediate_size (1408) does not split evenly "
                    "over data x tensor (3) GPUs (each expert sliced over every rank's; or "
                    "expert: data x tensor)")]
    assert [p[0] for p in Parallelism(data=3, expert=3).problems(lite)] == ["expert"]  # 64 experts
    m = np.array([1.0, 7.0, 64.0, 512.0, 4096.0])
    naive = {"linear": "naive", "elementwise": "none"}
    a = _tables("qwen3-30b-a3b", naive, data=2, expert=1)
    b = _tables("qwen3-30b-a3b", naive, data=2, expert=2)
    np.testing.assert_allclose(a.moe_s(m), b.moe_s(m), rtol=1e-12)
    np.testing.assert_allclose(a.tokens_s(m), b.tokens_s(m), rtol=1e-12)
    # On the calibrated GEMMs they differ: the slices are narrower GEMMs.
    c = _tables("qwen3-30b-a3b", {}, data=2, expert=1)
    d = _tables("qwen3-30b-a3b", {}, data=2, expert=2)
    assert not np.array_equal(c.moe_s(m), d.moe_s(m))


@pytest.mark.parametrize("expert", [1, 2])
def test_a_rank_runs_the_router_and_shared_experts_on_its_own_tokens(expert):
    """vLLM routes and runs the shared experts before the gather (0.15.1 `FusedMoE.
    forward_impl`; 0.33 `MoERunner`): on a rank's own tokens, in its own terms (`tokens_s`);
    only the routed experts take every rank's (`moe_s`). DeepSeek-V2-Lite has two shared
    experts: without them the routed part is unchanged, the rank's own part loses exactly
    their GEMMs."""
    from dataclasses import replace

    from sim.engine.cluster import make_latency

    # (Elementwise kernels left out: their calibration counts the shared experts' too.)
    cfg = _scenario(latency={"kind": "roofline", "elementwise": "none"},
                    model="deepseek-v2-lite", parallelism={"data": 2, "expert": expert}).replica
    shape = cfg.model_shape
    with_shared = make_latency(cfg, shape, "<test>").tables
    without = make_latency(cfg, replace(shape, shared_expert_intermediate_size=0),
                           "<test>").tables
    m = np.array([1.0, 64.0, 4096.0])
    np.testing.assert_array_equal(with_shared.moe_s(m), without.moe_s(m))
    s, h = shape.shared_expert_intermediate_size, shape.hidden_size
    gemm = with_shared.gemm
    shared_s = shape.num_moe_layers * (gemm(m, h, 2 * s) + gemm(m, s, h))
    np.testing.assert_allclose(with_shared.tokens_s(m) - without.tokens_s(m), shared_s,
                               rtol=1e-9)


def _loads(*counts):
    return [ReplicaLoad(w + r, 0, 0, w, r, kv) for w, r, kv in counts]


def test_vllm_balancer_scores_as_each_release():
    req = Request(0, 0.0, 8, 1)
    old = VllmDataParallel(VllmDataParallelConfig(name="vllm_dp", engines_publish_counts=True),
                           np.random.default_rng(0))
    # 4 x waiting + running: 1 waiting (4) loses to 3 running (3).
    assert old.choose(req, _loads((1, 0, 0.0), (0, 3, 0.0))) == 1
    # Within 100 ms the counts are the published ones plus a waiting request per pick.
    later = Request(1, 0.05, 8, 1)
    assert old.choose(later, _loads((0, 0, 0.0), (0, 0, 0.0))) == 0  # 4 vs 3 + 4 = 7
    # A tie goes to the lowest rank, every time.
    fresh = VllmDataParallel(VllmDataParallelConfig(name="vllm_dp", engines_publish_counts=True),
                             np.random.default_rng(0))
    assert [fresh.choose(Request(i, i * 1.0, 8, 1), _loads((0, 0, 0.0), (0, 0, 0.0)))
            for i in range(3)] == [0, 0, 0]
    new = VllmDataParallel(VllmDataParallelConfig(name="vllm_dp", engine_version="0.33.0"),
                           np.random.default_rng(0))
    # Ties go round; waiting weighs more once KV is over half used.
    assert [new.choose(Request(i, i * 1.0, 8, 1), _loads((0, 0, 0.0), (0, 0, 0.0)))
            for i in range(3)] == [0, 1, 0]
    # vLLM 0.15-0.19's dense engines publish no counts: its own picks alone, reset every 5 s.
    dense = VllmDataParallel(VllmDataParallelConfig(name="vllm_dp"), np.random.default_rng(0))
    assert not dense.published
    busy_first = _loads((5, 5, 0.5), (0, 0, 0.0))
    assert [dense.choose(Request(i, 0.01 * i, 8, 1), busy_first) for i in range(4)] == [
        0, 1, 0, 1]
    assert dense.choose(Request(9, 6.0, 8, 1), busy_first) == 0  # (reset: zeros again)
    busy = VllmDataParallel(VllmDataParallelConfig(name="vllm_dp", engine_version="0.33.0"),
                            np.random.default_rng(0))
    # rank 0: 2 waiting + 2 running at 90% KV: 4 + 2 x 6 x 0.4 = 8.8; rank 1: 8 running: 8.
    assert busy.choose(req, _loads((2, 2, 0.9), (0, 8, 0.2))) == 1
    assert math.isclose(2 * 6.0 * 0.4 + 4, 8.8)


@pytest.mark.parametrize(("change", "field", "needle"), [
    ({"model": "llama-3.1-8b", "parallelism": {"data": 2}}, "replica.parallelism.data",
     "independent engines"),
    ({"parallelism": {"data": 2, "tensor": 2, "expert": 2}}, "replica.parallelism.expert",
     "--enable-expert-parallel), or 1, each expert sliced"),
    ({"parallelism": {"data": 2, "expert": 2, "pipeline": 2}}, "replica.parallelism.data",
     "without pipeline stages"),
    ({"scheduler": {"name": "chunked_prefill"}}, "replica.parallelism.data",
     "vllm_v1 or sglang"),
    ({"latency": {"kind": "linear", "base_s": 1e-30}}, "replica.latency",
     "does not move the clock"),
])
def test_what_data_parallel_ranks_do_not_model_is_refused(tmp_path, monkeypatch, capsys,
                                                          change, field, needle):
    import yaml

    raw = _raw()
    raw["replica"] = {**raw["replica"], "parallelism": {"data": 2, "expert": 2}, **change}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out",
                        str(tmp_path / "o"))
    assert_one_line_error(code, err, field, needle)


def test_a_disaggregated_pool_of_ranks_refuses_what_ranks_do_not_model(tmp_path, monkeypatch,
                                                                        capsys):
    """A pool's ranks refuse what any ranks do, naming the pool's field."""
    import yaml

    raw = _raw()
    raw["replica"] = {**raw["replica"], "parallelism": {"data": 2, "expert": 2}}
    for pool, change, field, needle in [
            ("decode", {"scheduler": {"name": "prefill_first"}}, "parallelism.data",
             "vllm_v1 or sglang"),
            ("decode", {"scheduler": {"name": "sglang", "hierarchical_cache": {"ratio": 2.0}}},
             "scheduler.hierarchical_cache", "not modelled yet"),
            ("prefill", {"parallelism": {"data": 2, "expert": 2, "pipeline": 2}},
             "parallelism.data", "without pipeline stages")]:
        raw["cluster"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
        raw["cluster"][pool]["replica"] = change
        path = tmp_path / "s.yaml"
        path.write_text(yaml.safe_dump(raw))
        code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out",
                            str(tmp_path / "o"))
        assert_one_line_error(code, err, f"cluster.{pool}.replica.{field}", needle)


def test_kv_moves_between_ranks_of_a_prefill_and_a_decode_pool():
    """One prefill replica of two ranks and two decode replicas of two ranks each (vLLM's
    wide-EP shape): each request is prefilled on a prefill rank (the balancer's pick), its KV
    sent over that rank's link to the decode rank the decode router and that replica's
    balancer give it; the decode ranks step in lockstep, dummies and all."""
    raw = _raw()
    raw["workload"]["num_requests"] = 40
    raw["workload"]["arrivals"]["qps"] = 20.0
    raw["record_token_times"] = True
    raw["replica"]["parallelism"] = {"data": 2, "expert": 2}
    raw["cluster"] = {"prefill": {"replicas": 1},
                      "decode": {"replicas": 2, "replica": {"parallelism": {"data": 2,
                                                                            "expert": 1}}},
                      "link": {"bandwidth_gb_s": 10.0, "latency_s": 1e-3}}
    scenario = parse_scenario(raw, "<test>")
    res = run_scenario(scenario)
    req = res.requests
    assert (req["status"] == "finished").all()
    # Ranks 0-1 prefill, 2-5 decode: every decode rank got some of the requests.
    assert set(req["replica_id"]) == {0, 1}
    assert set(req["decode_replica_id"]) == {2, 3, 4, 5}
    assert (req["transfer_end_s"] > req["transfer_start_s"]).all()
    facts = res.summary["data_parallel"]
    assert facts["ranks_per_pool"] == {"prefill": 2, "decode": 2}
    assert res.summary["cost"]["num_gpus"] == 6
    assert res.summary["run"]["pools"] == {"prefill": 1, "decode": 2}
    assert_same_results(res, run_scenario(scenario, fast_forward=False))


def test_a_decode_ranks_balancer_reads_counts_by_the_hand_off_clock():
    """A decode pool's balancer picks when a prompt is done: its published counts refresh by
    that clock (every 100 ms), not by the requests' arrivals, which hand-offs follow out of
    order. A decode rank's queue counts the requests whose blocks or KV are still to come, as
    vLLM's decode engine keeps them waiting."""
    balancer = VllmDataParallel(VllmDataParallelConfig(name="vllm_dp",
                                                       engines_publish_counts=True),
                                np.random.default_rng(0))
    req = Request(0, 0.0, 8, 1)
    assert balancer.choose_at(req, _loads((2, 0, 0.0), (0, 0, 0.0)), 1.0) == 1
    # Same arrival, 200 ms later by the clock: the new counts are read.
    assert balancer.choose_at(req, _loads((0, 0, 0.0), (3, 0, 0.0)), 1.2) == 0
    # By the arrival's clock they would not have been (0 vs 1 + 4 picks' worth: rank 1 again
    # only after rank 0 took the next).
    stale = VllmDataParallel(VllmDataParallelConfig(name="vllm_dp",
                                                    engines_publish_counts=True),
                             np.random.default_rng(0))
    assert stale.choose(req, _loads((2, 0, 0.0), (0, 0, 0.0))) == 1
    assert stale.choose(req, _loads((0, 0, 0.0), (3, 0, 0.0))) == 1

    # As a decode router too: its counts are read by the hand-offs' clock (all arrive at
    # once; the prompts end over a second).
    raw = _raw()
    raw["cluster"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 2},
                      "decode_router": {"name": "vllm_dp", "engines_publish_counts": True}}
    cluster = Cluster(parse_scenario(raw, "<test>"))
    requests = [Request(i, 0.0, 5000, 2) for i in range(20)]
    cluster.run(requests)
    assert all(r.status is Status.FINISHED for r in requests)
    router = cluster.disaggregation.decode_router
    assert router._published_s >= max(r.transfer_start_s for r in requests) - 0.1 > 0.5

    raw = _raw()
    raw["replica"]["parallelism"] = {"data": 2, "expert": 2}
    raw["cluster"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    cluster = Cluster(parse_scenario(raw, "<test>"))
    rank = cluster.decode[0].ranks[0]
    assert rank.load().num_waiting == 0
    rank.inbox.reserve(Request(7, 0.0, 8, 4))
    assert rank.load().num_waiting == 1 and rank.load().num_outstanding == 1


def assert_exact_and_repeats(data: dict) -> None:
    """A random run on ranks: every request accounted for, the same results stepped or not
    and run twice."""
    scenario = parse_scenario(data, "hypothesis")
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert_same_results(fast, slow)
    assert_same_results(fast, run_scenario(scenario))
    assert_nothing_lost(data, fast)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data_parallel_clusters())
def test_pools_of_ranks_lose_nothing_and_repeat_exactly(data):
    """Random workloads through disaggregated clusters whose prefill pool, decode pool or both
    are replicas of ranks: every request accounted for, the same results stepped or not (the
    pools without ranks fast-forward) and run twice."""
    assert_exact_and_repeats(data)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(data_parallel=True))
def test_data_parallel_ranks_lose_nothing_and_repeat_exactly(data):
    """Random workloads (prefixes, priorities, timeouts, clients, a horizon) on 2 or 4 ranks:
    every request accounted for, the same results stepped or not (the group always steps) and
    run twice."""
    assert_exact_and_repeats(data)
